//! Starts the daemon's reporting surfaces next to the shims' server: the NVML watcher
//! ([`crate::nvml`]), the Prometheus endpoint ([`crate::metrics`]) and the gRPC API
//! ([`crate::api`]). Everything is bound before this returns, so a bad address fails the
//! start with a message naming it; a surface that dies later is logged and the daemon
//! keeps scheduling.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use tokio::task::JoinHandle;
use tracing::{error, info};

use crate::daemon::Daemon;
use crate::nvml::{Watcher, WatcherConfig};

/// What to start.
#[derive(Debug, Clone)]
pub struct ReportingConfig {
    /// The NVML watcher's settings; None: no NVML watcher.
    pub nvml: Option<WatcherConfig>,
    /// `host:port` of `/metrics` and `/healthz`; None: not served.
    pub metrics_addr: Option<String>,
    /// The gRPC API's unix socket; None: not served.
    pub api_socket: Option<PathBuf>,
    /// The gRPC API's TCP address, if any.
    pub api_addr: Option<std::net::SocketAddr>,
}

/// Parses an address flag where `off` (or `none`, or empty) disables the surface.
pub fn optional(v: &str) -> Option<String> {
    match v.trim() {
        "" | "off" | "none" => None,
        s => Some(s.to_owned()),
    }
}

/// The running surfaces; dropping it stops them.
#[derive(Debug)]
pub struct Reporting {
    watcher: Option<Watcher>,
    tasks: Vec<JoinHandle<()>>,
    /// Where `/metrics` is served (the bound address: port 0 resolved).
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// Where the API is served on TCP (bound address).
    pub api_addr: Option<std::net::SocketAddr>,
}

impl Drop for Reporting {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
        drop(self.watcher.take());
    }
}

/// Binds and starts what `cfg` asks for (inside a tokio runtime).
pub async fn start(daemon: Arc<Daemon>, cfg: &ReportingConfig) -> Result<Reporting> {
    let mut r = Reporting {
        watcher: None,
        tasks: Vec::new(),
        metrics_addr: None,
        api_addr: None,
    };
    if let Some(addr) = &cfg.metrics_addr {
        let l = crate::metrics::bind(addr)
            .await
            .with_context(|| format!("--metrics-addr {addr}"))?;
        let bound = l.local_addr().context("metrics listener address")?;
        info!(addr = %bound, "metrics on http://{bound}/metrics");
        r.metrics_addr = Some(bound);
        let d = Arc::clone(&daemon);
        r.tasks.push(tokio::spawn(async move {
            if let Err(e) = crate::metrics::serve(d, l).await {
                error!("metrics server ended: {e}");
            }
        }));
    }
    if let Some(path) = &cfg.api_socket {
        let l = crate::api::bind_unix(path)
            .with_context(|| format!("--api-socket {}", path.display()))?;
        info!(socket = %path.display(), "gRPC API on unix socket");
        let d = Arc::clone(&daemon);
        r.tasks.push(tokio::spawn(async move {
            if let Err(e) = crate::api::serve_unix(d, l).await {
                error!("gRPC API (unix socket) ended: {e}");
            }
        }));
    }
    if let Some(addr) = cfg.api_addr {
        let l = crate::api::bind_tcp(addr)
            .await
            .with_context(|| format!("--api-addr {addr}"))?;
        let bound = l.local_addr().context("API listener address")?;
        info!("gRPC API on tcp://{bound} (unauthenticated)");
        r.api_addr = Some(bound);
        let d = Arc::clone(&daemon);
        r.tasks.push(tokio::spawn(async move {
            if let Err(e) = crate::api::serve_tcp(d, l).await {
                error!("gRPC API (TCP) ended: {e}");
            }
        }));
    }
    if let Some(w) = &cfg.nvml {
        r.watcher = Some(crate::nvml::spawn(daemon, w.clone()).context("NVML watcher thread")?);
    }
    Ok(r)
}
