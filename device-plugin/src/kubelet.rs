//! Kubelet's gRPC APIs (generated from `proto/`) and unix-socket plumbing shared by the
//! plugin and by test doubles of kubelet.

use std::path::{Path, PathBuf};

use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint};

/// Device plugin API v1beta1 (`k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1`).
#[allow(
    missing_docs,
    clippy::all,
    unused_qualifications,
    missing_debug_implementations
)]
pub mod v1beta1 {
    tonic::include_proto!("v1beta1");
}

/// PodResources API v1 (`k8s.io/kubelet/pkg/apis/podresources/v1`), `List` only.
#[allow(
    missing_docs,
    clippy::all,
    unused_qualifications,
    missing_debug_implementations
)]
pub mod podresources {
    tonic::include_proto!("v1");
}

/// The node daemon's API (`vgpu-daemon/proto/vgpu_daemon_v1.proto`), client only.
#[allow(
    missing_docs,
    clippy::all,
    unused_qualifications,
    missing_debug_implementations
)]
pub mod daemon_v1 {
    tonic::include_proto!("vgpu.daemon.v1");
}

/// The API version the plugin registers with.
pub const API_VERSION: &str = "v1beta1";
/// Kubelet's registration socket, in the device-plugins directory.
pub const KUBELET_SOCKET: &str = "kubelet.sock";
/// Health string of a usable device.
pub const HEALTHY: &str = "Healthy";
/// Health string of an unusable device.
pub const UNHEALTHY: &str = "Unhealthy";

/// A lazily connecting gRPC channel to a unix socket (reconnects after failures).
pub fn unix_channel(path: &Path) -> Channel {
    let path: PathBuf = path.to_owned();
    // The URI is required by tonic but never resolved: the connector dials the socket.
    Endpoint::from_static("http://localhost").connect_with_connector_lazy(tower::service_fn(
        move |_: tonic::transport::Uri| {
            let path = path.clone();
            async move { UnixStream::connect(path).await.map(TokioIo::new) }
        },
    ))
}

/// A gRPC channel to a unix socket, connected now (fails if nobody listens).
pub async fn unix_channel_connected(path: &Path) -> Result<Channel, tonic::transport::Error> {
    let path: PathBuf = path.to_owned();
    Endpoint::from_static("http://localhost")
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let path = path.clone();
            async move { UnixStream::connect(path).await.map(TokioIo::new) }
        }))
        .await
}
