//! The error of `PreStartContainer` (and the PodResources `List` it depends on), and the
//! one mapping of it to the gRPC status kubelet receives.

use std::path::PathBuf;

use vgpu_core::resources::AssignmentError;

use crate::ids::IdError;

/// Why a container's quota could not be handed over.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    /// Kubelet's PodResources `List` failed.
    #[error("PodResources List on {socket}: {message}")]
    List {
        /// The socket.
        socket: String,
        /// gRPC status or timeout, in words.
        message: String,
    },
    /// A device ID is not one of ours.
    #[error("device IDs from kubelet")]
    BadId(#[source] IdError),
    /// No container holds these devices.
    #[error("no container on this node holds exactly the devices [{ids}]")]
    NoContainer {
        /// The IDs, comma-separated.
        ids: String,
    },
    /// More than one container claims these devices.
    #[error("devices [{ids}] are listed for several containers: {who}")]
    Ambiguous {
        /// The IDs.
        ids: String,
        /// The candidates.
        who: String,
    },
    /// Reading the pod from the API server failed.
    #[error("read pod {namespace}/{name} from the API server")]
    Api {
        /// Namespace.
        namespace: String,
        /// Name.
        name: String,
        /// kube's error.
        #[source]
        source: kube::Error,
    },
    /// The pod is not (or no longer) usable.
    #[error("pod {namespace}/{name}: {reason}")]
    Pod {
        /// Namespace.
        namespace: String,
        /// Name.
        name: String,
        /// What is wrong.
        reason: String,
    },
    /// The pod's assignment record is unreadable.
    #[error("pod {namespace}/{name}")]
    Assignment {
        /// Namespace.
        namespace: String,
        /// Name.
        name: String,
        /// The record's problem.
        #[source]
        source: AssignmentError,
    },
    /// The pod's status does not tell yet which container this is; kubelet retries.
    #[error("pod {namespace}/{name}: {reason}")]
    NotYet {
        /// Namespace.
        namespace: String,
        /// Name.
        name: String,
        /// What is not known yet.
        reason: String,
    },
    /// Kubelet's devices are on other GPUs than the assignment names.
    #[error(
        "pod {namespace}/{name} container {container:?}: assigned {assigned:?} but kubelet's devices are on {devices:?}"
    )]
    Mismatch {
        /// Namespace.
        namespace: String,
        /// Name.
        name: String,
        /// Container.
        container: String,
        /// GPUs (uuid, slices) of the assignment.
        assigned: Vec<(String, u32)>,
        /// GPUs (uuid, slices) of the device IDs.
        devices: Vec<(String, u32)>,
    },
    /// The quota file could not be written.
    #[error("write quota file {path}")]
    Write {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
}

impl HandshakeError {
    /// The gRPC status kubelet receives (the message names the pod and devices).
    pub fn to_status(&self) -> tonic::Status {
        let msg = error_chain(self);
        match self {
            HandshakeError::BadId(_) => tonic::Status::invalid_argument(msg),
            HandshakeError::NoContainer { .. } => tonic::Status::not_found(msg),
            HandshakeError::List { .. }
            | HandshakeError::Api { .. }
            | HandshakeError::NotYet { .. } => tonic::Status::unavailable(msg),
            HandshakeError::Write { .. } => tonic::Status::internal(msg),
            HandshakeError::Ambiguous { .. }
            | HandshakeError::Pod { .. }
            | HandshakeError::Assignment { .. }
            | HandshakeError::Mismatch { .. } => tonic::Status::failed_precondition(msg),
        }
    }
}

/// An error and its sources, `: `-joined.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}
