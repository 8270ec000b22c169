//! The composition root: [`run`] wires NVML health, the pod watch, the inventory, the
//! handshake, the audit, the clean-up, the metrics and the kubelet server from one
//! validated [`Config`], until `shutdown` completes. `main.rs` only parses, logs, calls
//! it and maps its error to an exit code.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::{WatchStreamExt, reflector, watcher};
use tracing::{error, warn};
use vgpu_core::inventory::GpuInfo;

use crate::config::{Config, ConfigError, DeviceMode};
use crate::error::error_chain;
use crate::handshake::Handshake;
use crate::health::HealthError;
use crate::metrics::Metrics;
use crate::plugin::{Plugin, prepare_state_dir};
use crate::preflight::{self, PreflightError};
use crate::{audit, gc, health, inventory, server};

/// Why the plugin could not start.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The configuration is invalid.
    #[error("configuration")]
    Config(#[from] ConfigError),
    /// The state directory could not be prepared.
    #[error("prepare state directory {path}")]
    StateDir {
        /// The directory.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// NVML did not give the node's GPUs.
    #[error("discover GPUs")]
    Health(#[from] HealthError),
    /// No client of the API server could be made.
    #[error("API server client (in-cluster or KUBECONFIG)")]
    Kube(#[source] kube::Error),
    /// The node cannot do what the configuration asks.
    #[error("preflight")]
    Preflight(#[from] PreflightError),
    /// The metrics address could not be bound.
    #[error("metrics address {addr}")]
    Metrics {
        /// The address.
        addr: std::net::SocketAddr,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The audit thread could not be started.
    #[error("start the audit thread")]
    Audit(#[source] std::io::Error),
}

/// Refuses what cannot work on this node: a GPU without its device node (device-node
/// mode), CDI devices kubelet or the runtime would drop (`--cdi`; when the Node cannot be
/// read, a warning says why and the plugin starts).
pub async fn check_node(
    cfg: &Config,
    client: &kube::Client,
    gpus: &[GpuInfo],
) -> Result<(), PreflightError> {
    match cfg.device_mode {
        DeviceMode::Nodes => preflight::device_nodes(&cfg.dev_dir, gpus),
        DeviceMode::Cdi => {
            match preflight::node_versions(client, &cfg.node_name, cfg.call_timeout).await {
                Ok((kubelet, runtime)) => {
                    let notes = preflight::cdi_support(
                        &cfg.node_name,
                        &kubelet,
                        &runtime,
                        cfg.kubelet_cdi_gate,
                    )?;
                    for note in notes {
                        warn!("{note}");
                    }
                }
                Err(why) => warn!(
                    reason = %why,
                    "--cdi: cannot learn kubelet's version from the Node; CDI needs kubelet >= 1.29"
                ),
            }
            Ok(())
        }
    }
}

/// Runs the plugin with `cfg` (validated here) until `shutdown` completes.
pub async fn run(cfg: Config, shutdown: impl Future<Output = ()>) -> Result<(), RunError> {
    cfg.validate()?;
    let cfg = Arc::new(cfg);
    prepare_state_dir(&cfg).map_err(|source| RunError::StateDir {
        path: cfg.state_dir.clone(),
        source,
    })?;
    let gpus = health::spawn_nvml_monitor(&cfg, cfg.nvml_lib.clone())?;
    let client = kube::Client::try_default().await.map_err(RunError::Kube)?;
    let initial = gpus.borrow().clone();
    check_node(&cfg, &client, &initial).await?;
    let (store, writer) = reflector::store();
    let pods: kube::Api<Pod> = kube::Api::all(client.clone());
    let wc = watcher::Config::default().fields(&format!("spec.nodeName={}", cfg.node_name));
    tokio::spawn(
        reflector(writer, watcher(pods, wc).default_backoff())
            .applied_objects()
            .for_each(|_| futures::future::ready(())),
    );
    tokio::spawn(inventory::publish(
        client.clone(),
        cfg.node_name.clone(),
        gpus.clone(),
        Duration::from_secs(5),
    ));
    let handshake = Handshake::new(cfg.clone(), client, Some(store), gpus.clone());
    let metrics = Metrics::new(gpus.clone());
    if let Some(addr) = cfg.metrics_addr {
        let l = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|source| RunError::Metrics { addr, source })?;
        let m = metrics.clone();
        tokio::spawn(async move {
            if let Err(e) = crate::metrics::serve(m, l).await {
                error!(error = %error_chain(&e), "metrics server stopped");
            }
        });
    }
    if let Some(every) = cfg.audit_interval {
        let rx = audit::spawn(cfg.clone(), cfg.nvml_lib.clone(), every).map_err(RunError::Audit)?;
        tokio::spawn(audit::report(handshake.clone(), rx, metrics.audit.clone()));
    }
    if let Some(every) = cfg.gc_interval {
        let m = metrics.clone();
        tokio::spawn(gc::run(handshake.clone(), every, move |r| m.gc_round(r)));
    }
    let plugin = Plugin::new(cfg.clone(), gpus, handshake);
    server::run(cfg, plugin, shutdown).await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_invalid_configuration_is_refused_by_name_before_anything_starts() {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = Config::new("");
        cfg.state_dir = dir.path().join("state");
        let e = run(cfg, std::future::pending()).await.unwrap_err();
        assert!(matches!(e, RunError::Config(_)), "{e:?}");
        assert!(error_chain(&e).contains("node-name"), "{}", error_chain(&e));
        assert!(!dir.path().join("state").exists(), "nothing was prepared");
    }
}
