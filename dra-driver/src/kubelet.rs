//! Kubelet's gRPC APIs for DRA drivers (generated from `proto/`) and the unix-socket
//! plumbing the driver and kubelet's test doubles share.

use std::path::{Path, PathBuf};

use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint};

/// DRA API v1 (`k8s.io/kubelet/pkg/apis/dra/v1`), served by kubelet 1.34 and later.
#[allow(
    missing_docs,
    clippy::all,
    unused_qualifications,
    missing_debug_implementations
)]
pub mod dra_v1 {
    tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1");
}

/// Plugin registration API (`k8s.io/kubelet/pkg/apis/pluginregistration/v1`).
#[allow(
    missing_docs,
    clippy::all,
    unused_qualifications,
    missing_debug_implementations
)]
pub mod registration {
    tonic::include_proto!("pluginregistration");
}

/// The plugin type kubelet's plugin watcher routes to its DRA manager.
pub const PLUGIN_TYPE: &str = "DRAPlugin";
/// The service the driver serves, as listed in `supported_versions`: kubelet 1.34–1.36
/// take `v1.DRAPlugin` (and prefer it over `v1beta1.DRAPlugin`, ADR 0072).
pub const DRA_V1_SERVICE: &str = "v1.DRAPlugin";

/// A gRPC channel to a unix socket, connected now (fails if nobody listens).
pub async fn unix_channel(path: &Path) -> Result<Channel, tonic::transport::Error> {
    let path: PathBuf = path.to_owned();
    // The URI is required by tonic but never resolved: the connector dials the socket.
    Endpoint::from_static("http://localhost")
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let path = path.clone();
            async move { UnixStream::connect(path).await.map(TokioIo::new) }
        }))
        .await
}
