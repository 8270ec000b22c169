//! The daemon's composition root: [`run`] (or [`start`], then [`Node::serve`]) takes a
//! [`Config`], validates it, and wires the node: saved settings, the scheduler's timer
//! thread, the shims' socket and the reporting surfaces (NVML, Prometheus, gRPC API);
//! then it serves until `shutdown` resolves. `main.rs` parses flags into a `Config`,
//! installs logging, calls [`run`] and maps a [`RunError`] to an exit code
//! ([`RunError::exit_code`]); tests start the same node in-process.

use std::future::Future;
use std::io;
use std::path::PathBuf;
use std::sync::Arc;

use tokio::net::UnixListener;
use tracing::{info, warn};

use crate::daemon::{ConfigError, Daemon};
use crate::reporting::{self, Reporting, ReportingConfig};

/// Everything the daemon runs with.
#[derive(Debug, Clone)]
pub struct Config {
    /// The scheduler and the shims' socket.
    pub daemon: crate::daemon::Config,
    /// NVML, `/metrics`, the gRPC API.
    pub reporting: ReportingConfig,
    /// The eBPF GPU device gate and exit watcher (off unless asked for).
    pub ebpf: crate::enforcement::EbpfSettings,
}

/// Longest NVML interval accepted, ms (one hour).
pub const MAX_NVML_INTERVAL_MS: u64 = 3_600_000;

impl Config {
    /// Checks every value, naming the first bad one.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.daemon.validate()?;
        if let Some(w) = &self.reporting.nvml {
            let ms = w.interval.as_millis();
            if ms == 0 || ms > u128::from(MAX_NVML_INTERVAL_MS) {
                return Err(ConfigError {
                    setting: "--nvml-interval-ms",
                    value: ms.to_string(),
                    reason: format!("out of range (0 disables NVML; 1–{MAX_NVML_INTERVAL_MS})"),
                });
            }
        }
        Ok(())
    }
}

/// Why the daemon could not start or stopped.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// A configuration value is invalid (the message is the source's: it is not
    /// repeated here, since `main` prints the chain).
    #[error("invalid configuration")]
    Config(#[from] ConfigError),
    /// The operators' settings saved by an earlier run could not be loaded.
    #[error("--state-file: {0}")]
    State(String),
    /// The scheduler's timer thread could not start.
    #[error("cannot start the scheduler's timer thread")]
    Timer(#[source] io::Error),
    /// The shims' socket could not be bound.
    #[error("cannot bind the shims' socket {path}")]
    Bind {
        /// The socket.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// A reporting surface could not start (the message names its flag).
    #[error("{0}")]
    Reporting(String),
    /// Accepting on the shims' socket failed.
    #[error("serving the shims' socket {path}")]
    Serve {
        /// The socket.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
}

impl RunError {
    /// The process exit code: 2 for a bad configuration, 1 otherwise.
    pub fn exit_code(&self) -> u8 {
        match self {
            RunError::Config(_) => 2,
            _ => 1,
        }
    }
}

/// A started node, not serving the shims yet.
#[derive(Debug)]
pub struct Node {
    /// The daemon (its snapshot is what every surface reports).
    pub daemon: Arc<Daemon>,
    /// The reporting surfaces (bound addresses).
    pub reporting: Reporting,
    /// The eBPF device gate, when attached (also the daemon's [`Daemon::device_gate`]).
    pub enforcement: Option<Arc<crate::enforcement::Enforcement>>,
    listener: UnixListener,
    socket: PathBuf,
    caps: crate::connections::Caps,
}

/// Validates `cfg` and starts everything but the shims' server: every socket and
/// address is bound when this returns, so a bad one fails here, naming it.
pub async fn start(cfg: Config) -> Result<Node, RunError> {
    cfg.validate()?;
    let socket = cfg.daemon.socket.clone();
    let daemon = Daemon::new(cfg.daemon);
    let kept = daemon.load_state().map_err(RunError::State)?;
    if kept > 0 {
        info!(kept, "operators' settings restored");
    }
    daemon.spawn_timer().map_err(RunError::Timer)?;
    crate::stopped::spawn(&daemon);
    // Before NVML starts: the watcher's own opens come from a trusted cgroup then. Without
    // eBPF the daemon runs on (NVML reconciliation, the plugin's audit), saying why.
    let enforcement = match crate::enforcement::Enforcement::start(&cfg.ebpf, &daemon) {
        Ok(Some(e)) => {
            daemon.set_device_gate(Arc::clone(&e) as Arc<dyn crate::daemon::DeviceGate>);
            Some(e)
        }
        Ok(None) => {
            info!("eBPF: off (--ebpf off)");
            daemon.set_no_device_gate("eBPF is off (--ebpf off)".to_owned());
            None
        }
        Err(e) => {
            let action =
                crate::enforcement::on_attach_failure(cfg.ebpf.mode, cfg.ebpf.enforce_fallback);
            if action.fail_closed {
                warn!(
                    "eBPF enforce: the GPU device gate cannot be attached: {e}; failing closed \
                     (/readyz not ready, new tenants refused; --ebpf-enforce-fallback serve runs without it)"
                );
            } else {
                warn!("eBPF: not attached, running without the GPU device gate: {e}");
            }
            daemon.set_no_device_gate(format!("eBPF is not attached: {e}"));
            let failure = crate::enforcement::EbpfFailure {
                mode: cfg.ebpf.mode,
                reason: e.to_string(),
                fail_closed: action.fail_closed,
            };
            // Enforce asked for and not delivered: an event the device plugin posts on
            // the node (ADR 0055); kept among the recent ones for a plugin that comes later.
            if let Some(ev) = crate::enforcement::not_enforcing_event(&failure) {
                daemon.events().publish(ev);
            }
            daemon.set_ebpf_failure(failure);
            None
        }
    };
    // Before the socket exists: every connection it will accept needs descriptors.
    let caps = match crate::server::raise_descriptor_limit() {
        Ok(l) => {
            let fitted = if l.caps == crate::connections::DEFAULT_CAPS {
                ""
            } else {
                " (caps fitted to the limit: raise the hard limit for the defaults)"
            };
            info!(
                before = l.before,
                soft = l.soft,
                hard = l.hard,
                connections = l.caps.total,
                per_container = l.caps.per_container,
                per_uid = l.caps.per_uid,
                "descriptor limit {} (was {}, hard {}){fitted}",
                l.soft,
                l.before,
                l.hard
            );
            daemon.sockets().set_limits(l.caps, l.soft);
            l.caps
        }
        Err(e) => {
            let caps = crate::connections::caps_within(1024, crate::connections::DEFAULT_CAPS);
            warn!("cannot read or raise the descriptor limit: {e}; caps as for 1024 descriptors");
            daemon.sockets().set_limits(caps, 1024);
            caps
        }
    };
    let listener = crate::server::bind(&socket).map_err(|source| RunError::Bind {
        path: socket.clone(),
        source,
    })?;
    let reporting = reporting::start(Arc::clone(&daemon), &cfg.reporting)
        .await
        .map_err(|e| RunError::Reporting(format!("{e:#}")))?;
    info!(socket = %socket.display(), "vgpu-daemon serving");
    Ok(Node {
        daemon,
        reporting,
        enforcement,
        listener,
        socket,
        caps,
    })
}

impl Node {
    /// Serves the shims until `shutdown` resolves (or accepting fails).
    pub async fn serve(self, shutdown: impl Future<Output = ()>) -> Result<(), RunError> {
        let Node {
            daemon,
            reporting,
            enforcement,
            listener,
            socket,
            caps,
        } = self;
        let events = Arc::clone(daemon.events());
        let r = tokio::select! {
            r = crate::server::serve(daemon, listener, caps) => r.map_err(|source| RunError::Serve {
                path: socket,
                source,
            }),
            () = shutdown => {
                info!("shutting down");
                Ok(())
            }
        };
        drop(reporting);
        // Followers of the event stream see it end (their connections may outlive the
        // server's task) and reconnect to the next daemon.
        events.close();
        drop(enforcement);
        r
    }
}

/// Starts the node and serves until `shutdown` resolves.
pub async fn run(cfg: Config, shutdown: impl Future<Output = ()>) -> Result<(), RunError> {
    start(cfg).await?.serve(shutdown).await
}
