//! A node daemon started in-process by its library's composition root
//! ([`vgpu_daemon::run::start`], as `main` does), for the tests whose containers register
//! with one.

use std::path::Path;
use std::sync::Arc;

use vgpu_core::sched_proto::{ComputePolicy, ComputeSettings, Priority};
use vgpu_daemon::daemon::{Config, Daemon};
use vgpu_daemon::reporting::ReportingConfig;

/// The gRPC API socket of the daemon serving the shims on `socket` (beside it, `.api`).
pub fn api_socket(socket: &Path) -> std::path::PathBuf {
    socket.with_extension("api")
}

/// A daemon serving on a socket until dropped.
pub struct Served {
    /// The daemon (its snapshot shows the tenants).
    pub daemon: Arc<Daemon>,
    /// The eBPF device gate, when one was asked for and attached.
    pub enforcement: Option<Arc<vgpu_daemon::enforcement::Enforcement>>,
    server: tokio::task::JoinHandle<Result<(), vgpu_daemon::run::RunError>>,
}

impl Drop for Served {
    fn drop(&mut self) {
        self.server.abort();
        // As `Node::serve` does when it stops: the event stream's followers see it end.
        if let Some(e) = &self.enforcement {
            e.events().close();
        }
    }
}

/// Starts a daemon on `socket` (default share 10 %, burst, best-effort; no NVML, no
/// metrics, no eBPF; the API on [`api_socket`]); call inside a tokio runtime.
pub async fn serve(socket: &Path) -> Served {
    serve_with_ebpf(socket, vgpu_daemon::enforcement::EbpfSettings::default()).await
}

/// [`serve`], with the eBPF gate and exit watcher as `ebpf` says, and the gRPC API on
/// [`api_socket`]`(socket)`.
pub async fn serve_with_ebpf(
    socket: &Path,
    ebpf: vgpu_daemon::enforcement::EbpfSettings,
) -> Served {
    serve_with(socket, |c| c.ebpf = ebpf).await
}

/// [`serve`], with its configuration changed by `tune` first (e.g. an NVML watcher).
pub async fn serve_with(socket: &Path, tune: impl FnOnce(&mut vgpu_daemon::run::Config)) -> Served {
    let mut cfg = vgpu_daemon::run::Config {
        daemon: Config {
            socket: socket.to_owned(),
            params: vgpu_daemon::arbiter::Params::default(),
            trusted_quota_file: None,
            default_settings: ComputeSettings {
                share_pct: 10,
                policy: ComputePolicy::Burst,
                priority: Priority::BestEffort,
            },
            state_file: None,
            gpus: Vec::new(),
        },
        reporting: ReportingConfig {
            nvml: None,
            metrics_addr: None,
            api_socket: Some(api_socket(socket)),
            api_addr: None,
        },
        ebpf: vgpu_daemon::enforcement::EbpfSettings::default(),
    };
    tune(&mut cfg);
    let node = vgpu_daemon::run::start(cfg)
        .await
        .expect("start the daemon");
    let daemon = Arc::clone(&node.daemon);
    let enforcement = node.enforcement.clone();
    let server = tokio::spawn(node.serve(std::future::pending()));
    Served {
        daemon,
        enforcement,
        server,
    }
}
