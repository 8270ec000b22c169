//! `vgpu-daemon`: runs in the foreground; `--socket PATH` is the shims' socket. Parses
//! the flags into a [`vgpu_daemon::run::Config`], installs logging, calls
//! [`vgpu_daemon::run::start`] then serves until SIGTERM or SIGINT, removes the sockets it
//! bound (exit 0), and maps an error to an exit code (2: bad configuration).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use vgpu_core::sched_proto::{ComputePolicy, ComputeSettings, Priority};
use vgpu_daemon::arbiter::Params;
use vgpu_daemon::daemon::Config;
use vgpu_daemon::nvml::WatcherConfig;
use vgpu_daemon::reporting::{self, ReportingConfig};

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
    #[arg(long, default_value_t = 2000)]
    queue_ahead_us: u64,
    /// Longest a revoked tenant may take to drain before the GPU moves on, milliseconds.
    #[arg(long, default_value_t = 500)]
    drain_timeout_ms: u64,
    /// Hand-on (experimental, ADR 0026): margin after a revoked tenant's queued work (the
    /// queue-ahead bound, or three of its launches) before the GPU goes on to a waiting
    /// tenant without its drain report, milliseconds; `off` (default): wait for the
    /// report, up to the drain timeout.
    #[arg(
        long,
        env = "VGPU_HAND_ON_MARGIN_MS",
        default_value = "off",
        value_parser = parse_hand_on
    )]
    hand_on_margin_ms: HandOn,
    /// Least charge of a time slice, percent of the slice, whatever device time the
    /// tenant reports it used (bounds what holding the GPU idle costs the others).
    #[arg(long, default_value_t = Params::default().min_charge_pct)]
    min_charge_pct: u32,
    /// Co-holding (ADR 0029): a waiting `burst` tenant whose container is throttled most
    /// of the time runs beside the holder while their expected uses add up to at most
    /// this percent of the GPU (default 80, as measured); 0: every tenant holds the GPU
    /// alone.
    #[arg(
        long,
        env = "VGPU_CO_HOLD_FILL_PCT",
        default_value_t = Params::default().co_hold_fill_pct
    )]
    co_hold_fill_pct: u32,
    /// Claims (ADR 0030): how long after a grant, while another tenant waits, a holder
    /// whose container its CPU limit throttles and that has not launched under the grant
    /// keeps it, milliseconds (then it is withdrawn and the GPU goes on); `off`: until
    /// the slice's end. Revokes of grants nobody launched under go on at once either way.
    #[arg(
        long,
        env = "VGPU_CLAIM_TIMEOUT_MS",
        default_value_t = ClaimTimeout(vgpu_daemon::arbiter::DEFAULT_CLAIM_TIMEOUT_NS),
        value_parser = parse_claim_timeout
    )]
    claim_timeout_ms: ClaimTimeout,
    /// Longest slice, in quanta, of a tenant slow to start under its grants and to report
    /// its drains (its container starved or throttled of CPU): such a holder's slice is
    /// four times those waits, at least one quantum; 1: every slice is one quantum.
    #[arg(
        long,
        env = "VGPU_MAX_SLICE_QUANTA",
        default_value_t = Params::default().max_slice_quanta,
        value_parser = clap::value_parser!(u32).range(1..=100)
    )]
    max_slice_quanta: u32,
    /// Deepest queue-ahead bound, microseconds, of a tenant slow to start under its
    /// grants and to report its drains: such a holder may queue twice those waits of GPU
    /// time, at least `--queue-ahead-us`, at most half its slice (ADR 0032); at most
    /// `--queue-ahead-us`: every holder's bound is `--queue-ahead-us`.
    #[arg(
        long,
        env = "VGPU_MAX_QUEUE_AHEAD_US",
        default_value_t = Params::default().max_queue_ahead_ns / 1000,
        value_parser = clap::value_parser!(u64).range(0..=10_000_000)
    )]
    max_queue_ahead_us: u64,
    /// How long past its slice's end, ms, a grant held while another tenant waits (or a
    /// capped tenant's) expires in the tenant's shims if the daemon has not revoked it,
    /// a lone holder's four times that if the daemon has not renewed it: bounds what a
    /// daemon starved of CPU or frozen lets a holder overrun (ADR 0036); 0: grants never
    /// expire.
    #[arg(
        long,
        env = "VGPU_GRANT_EXPIRY_MS",
        default_value_t = Params::default().grant_expiry_margin_ns / 1_000_000,
        value_parser = clap::value_parser!(u64).range(0..=60_000)
    )]
    grant_expiry_ms: u64,
    /// Trusted mode (Kubernetes): the daemon reads a tenant's quota from
    /// /etc/vgpu/vgpu.conf through /proc/PID/root (ADR 0042), else from this path inside
    /// the container, and ignores the shim's proposed settings.
    #[arg(long)]
    trusted_quota_file: Option<PathBuf>,
    /// Keep operators' live settings (vgpuctl set) in this file across restarts.
    #[arg(long)]
    state_file: Option<PathBuf>,
    /// Share for a process without trusted settings (trusted mode), percent.
    #[arg(long, default_value_t = 10)]
    default_share: u32,
    /// Time between two NVML readings, milliseconds (0: no NVML watcher).
    #[arg(long, default_value_t = 1000)]
    nvml_interval_ms: u64,
    /// The NVML library: a soname or a path.
    #[arg(long, default_value = vgpu_daemon::nvml::DEFAULT_LIB)]
    nvml_lib: std::ffi::OsString,
    /// Prometheus endpoint (`/metrics`, `/healthz`), host:port; `off` disables it.
    #[arg(long, default_value = "127.0.0.1:9400")]
    metrics_addr: String,
    /// The gRPC API's unix socket (`vgpuctl --api-socket`); `off` disables it.
    #[arg(long, env = "VGPU_API_SOCKET", default_value = vgpu_daemon::api::DEFAULT_SOCKET)]
    api_socket: String,
    /// Also serve the gRPC API on this TCP address (host:port; unauthenticated).
    #[arg(long)]
    api_addr: Option<std::net::SocketAddr>,
    /// A GPU of this node (UUID; repeat for each). Without it the daemon takes the GPUs
    /// NVML reports; registrations naming any other GPU are refused.
    #[arg(long)]
    gpu: Vec<String>,
    /// Real-time priority of the daemon's threads (SCHED_FIFO 1–99; 0: normal class).
    #[arg(long, default_value_t = 10)]
    sched_priority: u32,
    /// The eBPF GPU device gate: off, audit (allow, report what enforce would refuse) or
    /// enforce (refuse GPU opens of processes not registered through the shim).
    #[arg(long, default_value = "audit", value_parser = parse_mode)]
    ebpf: vgpu_ebpf::Mode,
    /// The cgroup2 directory the gate covers (default: kubepods.slice or kubepods under
    /// the cgroup2 mount, else the whole mount).
    #[arg(long)]
    ebpf_cgroup_root: Option<PathBuf>,
    /// Where the gate's maps and links are pinned so that it outlives a restart (bpffs);
    /// `off`: not pinned (the gate detaches when the daemon exits).
    #[arg(long, default_value = vgpu_daemon::enforcement::DEFAULT_PIN_DIR)]
    ebpf_pin_dir: String,
    /// Where the GPU device nodes are.
    #[arg(long, default_value = "/dev")]
    ebpf_dev_dir: PathBuf,
    /// A cgroup2 directory whose processes may open GPU nodes without registering (a node
    /// agent: the device plugin, monitoring); repeat for each.
    #[arg(long)]
    ebpf_trusted_cgroup: Vec<PathBuf>,
    /// What `--ebpf enforce` does when the gate cannot be attached: `refuse` (fail closed:
    /// keep a gate an earlier run pinned, /readyz not ready, new tenants refused) or
    /// `serve` (run without the gate, removing a pinned one).
    #[arg(
        long,
        env = "VGPU_EBPF_ENFORCE_FALLBACK",
        default_value = "refuse",
        value_parser = parse_enforce_fallback
    )]
    ebpf_enforce_fallback: vgpu_daemon::enforcement::EnforceFallback,
    /// The second line (ADR 0039): what is done to the offending processes of a container
    /// that holds more GPU memory than its quota plus the context allowances, past the
    /// grace: off, report, refuse (withdraw their admission at the eBPF gate) or kill
    /// (refuse, then SIGKILL).
    #[arg(long, env = "VGPU_MEMORY_ENFORCE", default_value = "kill", value_parser = parse_memory_action)]
    memory_enforce: vgpu_daemon::second_line::Action,
    /// How long a container may hold more than its quota before the second line acts,
    /// milliseconds (default: two NVML intervals).
    #[arg(long, env = "VGPU_MEMORY_ENFORCE_GRACE_MS", value_parser = clap::value_parser!(u64).range(0..=3_600_000))]
    memory_enforce_grace_ms: Option<u64>,
    /// Device memory per process not charged against its container's quota (the context
    /// the shim does not count), MiB.
    #[arg(long, env = "VGPU_MEMORY_CONTEXT_ALLOWANCE_MIB", default_value_t = 512, value_parser = clap::value_parser!(u64).range(0..=65_536))]
    memory_context_allowance_mib: u64,
    /// The CUDA driver library whose checkpoint API suspends containers (a soname or a
    /// path; loaded at the first suspension).
    #[arg(long, env = "VGPU_CUDA_LIB", default_value = vgpu_daemon::checkpoint::DEFAULT_LIB)]
    cuda_lib: std::ffi::OsString,
    /// Host memory suspended containers' checkpoints may hold, node-wide (e.g. `64Gi`;
    /// 0: suspension off). A suspension that would exceed it is refused.
    #[arg(long, env = "VGPU_SUSPEND_HOST_MEMORY", default_value = "0", value_parser = parse_host_memory)]
    suspend_host_memory: u64,
    /// How long a suspension waits for a process's CUDA calls and GPU work in flight
    /// before it gives up (and suspends nothing), milliseconds.
    #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u32).range(1..=60_000))]
    suspend_lock_timeout_ms: u32,
}

fn parse_host_memory(v: &str) -> Result<u64, String> {
    vgpu_core::bytes::parse_bytes(v).map_err(|e| format!("{v:?}: {e}"))
}

fn parse_memory_action(v: &str) -> Result<vgpu_daemon::second_line::Action, String> {
    v.parse()
}

fn parse_enforce_fallback(v: &str) -> Result<vgpu_daemon::enforcement::EnforceFallback, String> {
    v.parse()
}

/// `--claim-timeout-ms`: a timeout in ns (0: `off`).
#[derive(Debug, Clone, Copy)]
struct ClaimTimeout(u64);

impl std::fmt::Display for ClaimTimeout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            0 => f.write_str("off"),
            ns => write!(f, "{}", ns as f64 / 1e6),
        }
    }
}

fn parse_claim_timeout(v: &str) -> Result<ClaimTimeout, String> {
    if v == "off" {
        return Ok(ClaimTimeout(0));
    }
    match v.parse::<f64>() {
        Ok(ms) if ms.is_finite() && ms > 0.0 && ms <= 1000.0 => Ok(ClaimTimeout((ms * 1e6) as u64)),
        _ => Err(format!(
            "{v:?} is not a timeout in milliseconds (above 0, at most 1000) or `off`"
        )),
    }
}

/// `--hand-on-margin-ms`: a margin in ns, or None (`off`).
#[derive(Debug, Clone, Copy)]
struct HandOn(Option<u64>);

fn parse_hand_on(v: &str) -> Result<HandOn, String> {
    if v == "off" {
        return Ok(HandOn(None));
    }
    match v.parse::<f64>() {
        Ok(ms) if ms.is_finite() && (0.0..=1000.0).contains(&ms) => {
            Ok(HandOn(Some((ms * 1e6) as u64)))
        }
        _ => Err(format!(
            "{v:?} is not a margin in milliseconds (0 to 1000) or `off`"
        )),
    }
}

fn parse_mode(v: &str) -> Result<vgpu_ebpf::Mode, String> {
    v.parse().map_err(|e: vgpu_ebpf::EbpfError| e.to_string())
}

fn config(a: &Args) -> vgpu_daemon::run::Config {
    vgpu_daemon::run::Config {
        daemon: Config {
            socket: a.socket.clone(),
            params: Params {
                quantum_ns: (a.quantum_ms * 1e6) as u64,
                drain_timeout_ns: a.drain_timeout_ms.saturating_mul(1_000_000),
                min_charge_pct: a.min_charge_pct,
                handoff_queue_ns: match a.hand_on_margin_ms.0 {
                    Some(_) => a.queue_ahead_us.saturating_mul(1000).max(1),
                    None => 0,
                },
                handoff_margin_ns: a.hand_on_margin_ms.0.unwrap_or(0),
                co_hold_fill_pct: a.co_hold_fill_pct,
                queue_ahead_ns: a.queue_ahead_us.saturating_mul(1000),
                claim_timeout_ns: a.claim_timeout_ms.0,
                max_slice_quanta: a.max_slice_quanta,
                max_queue_ahead_ns: a.max_queue_ahead_us.saturating_mul(1000),
                grant_expiry_margin_ns: a.grant_expiry_ms.saturating_mul(1_000_000),
                ..Params::default()
            },
            trusted_quota_file: a.trusted_quota_file.clone(),
            default_settings: ComputeSettings {
                share_pct: a.default_share,
                policy: ComputePolicy::Burst,
                priority: Priority::BestEffort,
            },
            state_file: a.state_file.clone(),
            gpus: a.gpu.clone(),
        },
        reporting: ReportingConfig {
            nvml: (a.nvml_interval_ms > 0).then(|| WatcherConfig {
                lib: a.nvml_lib.clone(),
                interval: Duration::from_millis(a.nvml_interval_ms),
                second_line: vgpu_daemon::second_line::Policy {
                    action: a.memory_enforce,
                    grace: a.memory_enforce_grace_ms.map(Duration::from_millis),
                    context_allowance: a.memory_context_allowance_mib << 20,
                },
                ..WatcherConfig::default()
            }),
            metrics_addr: reporting::optional(&a.metrics_addr),
            api_socket: reporting::optional(&a.api_socket).map(PathBuf::from),
            api_addr: a.api_addr,
        },
        ebpf: vgpu_daemon::enforcement::EbpfSettings {
            mode: a.ebpf,
            cgroup_root: a.ebpf_cgroup_root.clone(),
            pin_dir: reporting::optional(&a.ebpf_pin_dir).map(PathBuf::from),
            dev_dir: a.ebpf_dev_dir.clone(),
            trusted_cgroups: a.ebpf_trusted_cgroup.clone(),
            enforce_fallback: a.ebpf_enforce_fallback,
        },
    }
}

/// Resolves on SIGTERM (kubelet stopping the pod, systemd stopping the unit) or SIGINT
/// (Ctrl-C). Where a handler cannot be installed, that signal keeps its default action.
async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let wait = |kind: SignalKind, name: &'static str| async move {
        match signal(kind) {
            Ok(mut s) => {
                s.recv().await;
                tracing::info!("{name} received");
            }
            Err(e) => {
                tracing::warn!("cannot handle {name}: {e}");
                std::future::pending::<()>().await;
            }
        }
    };
    tokio::select! {
        () = wait(SignalKind::terminate(), "SIGTERM") => {}
        () = wait(SignalKind::interrupt(), "SIGINT") => {}
    }
}

/// A unix socket this run bound, identified by device and inode.
struct Bound {
    path: PathBuf,
    id: (u64, u64),
}

impl Bound {
    fn of(path: &std::path::Path) -> Option<Bound> {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::symlink_metadata(path).ok()?;
        Some(Bound {
            path: path.to_owned(),
            id: (m.dev(), m.ino()),
        })
    }

    /// Removes the socket if it is still the one bound (the eBPF pins stay: the gate
    /// outlives a restart by design, ADR 0018; uninstalling removes them).
    fn remove(&self) {
        if Bound::of(&self.path).is_some_and(|now| now.id == self.id) {
            match std::fs::remove_file(&self.path) {
                Ok(()) => tracing::info!(socket = %self.path.display(), "socket removed"),
                Err(e) => {
                    tracing::warn!(socket = %self.path.display(), "cannot remove the socket: {e}")
                }
            }
        }
    }
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("VGPU_DAEMON_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let a = Args::parse();
    if !(a.quantum_ms.is_finite()) {
        eprintln!("vgpu-daemon: --quantum-ms {} is not a number", a.quantum_ms);
        return ExitCode::from(2);
    }
    // Before any other thread exists, so that the timer and the runtime's workers
    // inherit the class (ADR 0013).
    let class = match vgpu_daemon::realtime::SchedClass::from_priority(a.sched_priority) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("vgpu-daemon: {e}");
            return ExitCode::from(2);
        }
    };
    if let Err(e) = vgpu_daemon::realtime::apply(class) {
        tracing::warn!(
            "{}: {}; slices may run late on a busy node (give the daemon CAP_SYS_NICE, or --sched-priority 0 to silence this)",
            e,
            std::error::Error::source(&e).map_or(String::new(), ToString::to_string)
        );
    }
    let cfg = config(&a);
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("vgpu-daemon: cannot start the tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let sockets = [
        Some(cfg.daemon.socket.clone()),
        cfg.reporting.api_socket.clone(),
    ];
    let served = rt.block_on(async {
        let node = vgpu_daemon::run::start(cfg).await?;
        node.daemon
            .set_suspension_settings(vgpu_daemon::daemon::SuspensionSettings {
                cuda_lib: a.cuda_lib.clone(),
                host_memory: a.suspend_host_memory,
                lock_timeout_ms: a.suspend_lock_timeout_ms,
                idle_after: None,
            });
        // The sockets as this run bound them: only those are removed at the end (a
        // successor that already replaced one keeps its own).
        let ours: Vec<_> = sockets
            .iter()
            .flatten()
            .filter_map(|p| Bound::of(p))
            .collect();
        let r = node.serve(shutdown_signal()).await;
        for b in &ours {
            b.remove();
        }
        r
    });
    match served {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let mut msg = format!("vgpu-daemon: {e}");
            let mut src = std::error::Error::source(&e);
            while let Some(s) = src {
                msg.push_str(&format!(": {s}"));
                src = s.source();
            }
            eprintln!("{msg}");
            ExitCode::from(e.exit_code())
        }
    }
}
