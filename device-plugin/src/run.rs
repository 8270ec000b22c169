//! The composition root: [`run`] wires NVML health, the pod watch, the inventory, the
//! handshake, the audit, the daemon's eBPF gate events, the clean-up, the metrics and the kubelet server from one
//! validated [`Config`], until `shutdown` completes. `main.rs` only parses, logs, calls
//! it and maps its error to an exit code.
//!
//! What the plugin must not make for itself in a test — the API server client and the
//! GPU source — comes in as [`Deps`]: [`run`] makes the real ones (the in-cluster or
//! `KUBECONFIG` client, the NVML monitor) and calls [`run_with`]; the fake node of
//! `vgpu-testkit` passes its fakes to [`start`], the same wiring.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::{WatchStreamExt, reflector, watcher};
use tokio::sync::watch;
use tokio::task::JoinHandle;
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

/// What [`run`] makes for itself and a test passes in.
#[derive(Clone)]
pub struct Deps {
    /// The API server client (pods, the Node, events).
    pub client: kube::Client,
    /// The node's GPUs, sent again on every health change (the NVML monitor's channel).
    pub gpus: watch::Receiver<Vec<GpuInfo>>,
    /// How often a failed write of the Node's inventory is retried.
    pub inventory_retry: Duration,
}

impl std::fmt::Debug for Deps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Deps")
            .field("gpus", &*self.gpus.borrow())
            .field("inventory_retry", &self.inventory_retry)
            .finish_non_exhaustive()
    }
}

/// Validates `cfg` and prepares its state directory: the first step of [`run`], before
/// anything else starts.
pub fn prepare(cfg: Config) -> Result<Arc<Config>, RunError> {
    cfg.validate()?;
    let cfg = Arc::new(cfg);
    prepare_state_dir(&cfg).map_err(|source| RunError::StateDir {
        path: cfg.state_dir.clone(),
        source,
    })?;
    Ok(cfg)
}

/// The plugin wired and its background tasks started, not yet served to kubelet.
/// Dropping it stops the tasks it started.
#[derive(Debug)]
pub struct Started {
    cfg: Arc<Config>,
    handshake: Handshake,
    plugin: Plugin,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for Started {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl Started {
    /// The handshake (its pod watch, its `List` calls, its allocation directories).
    pub fn handshake(&self) -> &Handshake {
        &self.handshake
    }

    /// Serves the plugin to kubelet (register, re-register on a kubelet restart) until
    /// `shutdown` completes; then stops the background tasks.
    pub async fn serve(self, shutdown: impl Future<Output = ()>) {
        server::run(self.cfg.clone(), self.plugin.clone(), shutdown).await;
    }
}

/// Wires the plugin over `deps` with `cfg` (as [`prepare`] returns it): refuses what
/// cannot work on this node ([`check_node`]), then starts the pod watch, the inventory,
/// the metrics server, the audit and the clean-up as `cfg` asks.
pub async fn start(cfg: Arc<Config>, deps: Deps) -> Result<Started, RunError> {
    let Deps {
        client,
        gpus,
        inventory_retry,
    } = deps;
    let initial = gpus.borrow().clone();
    check_node(&cfg, &client, &initial).await?;
    let (store, writer) = reflector::store();
    let pods: kube::Api<Pod> = kube::Api::all(client.clone());
    let wc = watcher::Config::default().fields(&format!("spec.nodeName={}", cfg.node_name));
    let mut tasks = vec![tokio::spawn(
        reflector(writer, watcher(pods, wc).default_backoff())
            .applied_objects()
            .for_each(|_| futures::future::ready(())),
    )];
    tasks.push(tokio::spawn(inventory::publish(
        client.clone(),
        cfg.node_name.clone(),
        gpus.clone(),
        cfg.slices_per_gpu,
        inventory_retry,
    )));
    let handshake = Handshake::new(cfg.clone(), client, Some(store), gpus.clone());
    let metrics = Metrics::new(gpus.clone());
    if let Some(addr) = cfg.metrics_addr {
        let l = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|source| RunError::Metrics { addr, source })?;
        let m = metrics.clone();
        tasks.push(tokio::spawn(async move {
            if let Err(e) = crate::metrics::serve(m, l).await {
                error!(error = %error_chain(&e), "metrics server stopped");
            }
        }));
    }
    if let Some(every) = cfg.audit_interval {
        let rx = audit::spawn(cfg.clone(), cfg.nvml_lib.clone(), every).map_err(RunError::Audit)?;
        tasks.push(tokio::spawn(audit::report(
            handshake.clone(),
            rx,
            metrics.audit.clone(),
        )));
    }
    if let Some(socket) = &cfg.daemon_api_socket {
        tasks.push(tokio::spawn(crate::gate_events::follow(
            handshake.clone(),
            socket.clone(),
            metrics.gate.clone(),
        )));
        tasks.push(tokio::spawn(crate::refusal_events::run(
            handshake.clone(),
            socket.clone(),
            metrics.refusal_events.clone(),
        )));
    }
    if let Some(every) = cfg.gc_interval {
        let m = metrics.clone();
        tasks.push(tokio::spawn(gc::run(handshake.clone(), every, move |r| {
            m.gc_round(r)
        })));
    }
    let plugin = Plugin::new(cfg.clone(), gpus, handshake.clone());
    Ok(Started {
        cfg,
        handshake,
        plugin,
        tasks,
    })
}

/// [`start`], then serves until `shutdown` completes.
pub async fn run_with(
    cfg: Arc<Config>,
    deps: Deps,
    shutdown: impl Future<Output = ()>,
) -> Result<(), RunError> {
    start(cfg, deps).await?.serve(shutdown).await;
    Ok(())
}

/// Runs the plugin with `cfg` (validated here) until `shutdown` completes, over the
/// node's NVML and the in-cluster (or `KUBECONFIG`) API server client.
pub async fn run(cfg: Config, shutdown: impl Future<Output = ()>) -> Result<(), RunError> {
    let cfg = prepare(cfg)?;
    let gpus = health::spawn_nvml_monitor(&cfg, cfg.nvml_lib.clone())?;
    let client = kube::Client::try_default().await.map_err(RunError::Kube)?;
    let deps = Deps {
        client,
        gpus,
        inventory_retry: Duration::from_secs(5),
    };
    run_with(cfg, deps, shutdown).await
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
