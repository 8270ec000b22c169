//! `vgpu-daemon`: runs in the foreground; `--socket PATH` is the shims' socket.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Parser;
use vgpu_core::sched_proto::{ComputePolicy, ComputeSettings, Priority};
use vgpu_daemon::daemon::{Config, Daemon};
use vgpu_daemon::scheduler::Params;

/// vgpu's node daemon: time-slices kernels between containers by share and priority,
/// reports per-pod usage.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// The shims' unix socket (the shim's VGPU_DAEMON_SOCKET).
    #[arg(
        long,
        env = "VGPU_DAEMON_SOCKET",
        default_value = "/run/vgpu/daemon.sock"
    )]
    socket: PathBuf,
    /// Slice length, milliseconds.
    #[arg(long, default_value_t = 10.0)]
    quantum_ms: f64,
    /// GPU time a process may queue beyond what has completed, microseconds.
    #[arg(long, default_value_t = 1000)]
    queue_ahead_us: u64,
    /// Longest a revoked tenant may take to drain before the GPU moves on, milliseconds.
    #[arg(long, default_value_t = 500)]
    drain_timeout_ms: u64,
    /// Trusted mode (Kubernetes): the quota file's path inside containers; the daemon
    /// reads it through /proc/PID/root and ignores the shim's proposed settings.
    #[arg(long)]
    trusted_quota_file: Option<PathBuf>,
    /// Share for a process without trusted settings (trusted mode), percent.
    #[arg(long, default_value_t = 10)]
    default_share: u32,
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("VGPU_DAEMON_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let a = Args::parse();
    if !(a.quantum_ms >= 0.5 && a.quantum_ms <= 1000.0) {
        anyhow::bail!("--quantum-ms {} is out of range (0.5–1000)", a.quantum_ms);
    }
    let default_settings = ComputeSettings {
        share_pct: a.default_share,
        policy: ComputePolicy::Burst,
        priority: Priority::BestEffort,
    };
    default_settings
        .validate()
        .map_err(|e| anyhow::anyhow!("--default-share: {e}"))?;
    let cfg = Config {
        socket: a.socket.clone(),
        params: Params {
            quantum_ns: (a.quantum_ms * 1e6) as u64,
            drain_timeout_ns: a.drain_timeout_ms * 1_000_000,
            ..Params::default()
        },
        queue_ahead_us: a.queue_ahead_us,
        trusted_quota_file: a.trusted_quota_file,
        default_settings,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("tokio runtime")?;
    rt.block_on(async move {
        let daemon = Daemon::new(cfg);
        daemon.spawn_timer().context("timer thread")?;
        let listener = vgpu_daemon::server::bind(&a.socket)
            .with_context(|| format!("bind {}", a.socket.display()))?;
        tracing::info!(socket = %a.socket.display(), "vgpu-daemon serving");
        tokio::select! {
            r = vgpu_daemon::server::serve(daemon, listener) => r.context("serve")?,
            _ = tokio::signal::ctrl_c() => tracing::info!("interrupted"),
        }
        Ok(())
    })
}
