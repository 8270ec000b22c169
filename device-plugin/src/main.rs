//! `vgpu-device-plugin`: parse the configuration, set up logging, run.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use vgpu_device_plugin::config::{Config, DeviceMode};
use vgpu_device_plugin::health;

#[derive(Parser, Debug)]
#[command(about = "vgpu's kubelet device plugin: fractional GPUs for exactly the right container")]
struct Cli {
    #[command(subcommand)]
    cmd: Option<Cmd>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Print the node's GPU inventory (JSON, one line) now and on every health change.
    Health(HealthArgs),
    /// Copy the shim onto the host atomically (the node agent's init container: the image
    /// has no shell): FROM to a temporary file beside TO, then renamed over TO, so a
    /// container that mapped the old file keeps it.
    InstallShim(InstallShimArgs),
}

#[derive(clap::Args, Debug)]
struct InstallShimArgs {
    /// The shim in the image.
    #[arg(long, default_value = "/usr/lib/vgpu/libvgpu.so")]
    from: PathBuf,
    /// Where it goes on the host (as mounted in the init container).
    #[arg(long)]
    to: PathBuf,
}

fn install_shim(a: &InstallShimArgs) -> Result<()> {
    let dir =
        a.to.parent()
            .with_context(|| format!("--to {} has no directory", a.to.display()))?;
    std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    let tmp = a.to.with_extension("so.new");
    std::fs::copy(&a.from, &tmp)
        .with_context(|| format!("copy {} to {}", a.from.display(), tmp.display()))?;
    std::fs::rename(&tmp, &a.to)
        .with_context(|| format!("rename {} to {}", tmp.display(), a.to.display()))?;
    eprintln!(
        "vgpu-device-plugin: installed {} as {}",
        a.from.display(),
        a.to.display()
    );
    Ok(())
}

#[derive(clap::Args, Debug)]
struct HealthArgs {
    /// NVML library to load (default: the system's libnvidia-ml.so.1).
    #[arg(long, env = "VGPU_NVML_LIB")]
    nvml_lib: Option<PathBuf>,
    /// XIDs that do not make a GPU unhealthy (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "13,31,43,45,68,109")]
    ignored_xids: Vec<u64>,
    /// Milliseconds after an XID/ECC fault before a GPU that answers NVML is healthy again (0: never).
    #[arg(long, default_value_t = 60_000)]
    health_recovery_ms: u64,
    /// How often each GPU is checked to answer NVML, ms.
    #[arg(long, default_value_t = 1000)]
    health_poll_ms: u64,
}

async fn health_cmd(args: HealthArgs) -> Result<()> {
    let mut cfg = Config::new("local");
    cfg.ignored_xids = args.ignored_xids.iter().copied().collect();
    cfg.health_recovery =
        (args.health_recovery_ms > 0).then(|| Duration::from_millis(args.health_recovery_ms));
    cfg.health_poll = Duration::from_millis(args.health_poll_ms.max(1));
    let mut rx = health::spawn_nvml_monitor(&cfg, args.nvml_lib)?;
    loop {
        let inv = vgpu_core::inventory::NodeInventory {
            version: vgpu_core::inventory::INVENTORY_VERSION,
            gpus: rx.borrow_and_update().clone(),
            slices_per_gpu: cfg.slices_per_gpu,
        };
        println!("{}", inv.to_json());
        tokio::select! {
            r = rx.changed() => r.context("the NVML monitor stopped")?,
            () = shutdown_signal() => return Ok(()),
        }
    }
}

#[derive(clap::Args, Debug)]
struct RunArgs {
    /// This node's name (from the downward API).
    #[arg(long, env = "NODE_NAME", default_value = "")]
    node_name: String,
    /// Kubelet's device-plugins directory.
    #[arg(long, default_value = "/var/lib/kubelet/device-plugins")]
    device_plugin_dir: PathBuf,
    /// Our socket's file name there.
    #[arg(long, default_value = "vgpu.sock")]
    socket_name: String,
    /// Kubelet's PodResources socket.
    #[arg(long, default_value = "/var/lib/kubelet/pod-resources/kubelet.sock")]
    pod_resources_socket: PathBuf,
    /// State directory as the plugin sees it.
    #[arg(long, default_value = "/var/lib/vgpu")]
    state_dir: PathBuf,
    /// The same directory on the host (defaults to --state-dir).
    #[arg(long)]
    host_state_dir: Option<PathBuf>,
    /// The shim's path on the host.
    #[arg(long, default_value = "/var/lib/vgpu/lib/libvgpu.so")]
    shim_host_path: PathBuf,
    /// Where the shim appears in containers (written into ld.so.preload).
    #[arg(long, default_value = "/usr/local/vgpu/libvgpu.so")]
    shim_container_path: PathBuf,
    /// VGPU_CONTAINER_DIR in containers.
    #[arg(long, default_value = "/var/run/vgpu")]
    container_dir: PathBuf,
    /// Do not mount /etc/ld.so.preload (the image loads the shim itself).
    #[arg(long)]
    no_preload: bool,
    /// Hand GPUs to containers as CDI devices instead of device nodes (needs kubelet
    /// >= 1.29 and containerd >= 1.7 with CDI enabled; checked at start).
    #[arg(long)]
    cdi: bool,
    /// With --cdi on kubelet 1.28: kubelet runs with
    /// --feature-gates=DevicePluginCDIDevices=true.
    #[arg(long)]
    kubelet_cdi_gate: bool,
    /// Directory of the GPU device nodes nvidia<index>, on the host and in the plugin.
    #[arg(long, default_value = "/dev")]
    dev_dir: PathBuf,
    /// XIDs that do not make a GPU unhealthy (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "13,31,43,45,68,109")]
    ignored_xids: Vec<u64>,
    /// Seconds after an XID/ECC fault before a GPU that answers NVML is healthy again (0: never).
    #[arg(long, default_value_t = 60)]
    health_recovery_s: u64,
    /// NVML library to load (default: the system's libnvidia-ml.so.1).
    #[arg(long, env = "VGPU_NVML_LIB")]
    nvml_lib: Option<PathBuf>,
    /// The node daemon's shim socket on the host ("" or "off": no daemon). Its directory
    /// is mounted read-only into containers and must hold nothing else.
    #[arg(long, default_value = "/var/lib/vgpu/daemon/daemon.sock")]
    daemon_socket: String,
    /// Where the daemon socket's directory appears in containers.
    #[arg(long, default_value = "/run/vgpu-daemon")]
    daemon_container_dir: PathBuf,
    /// The node daemon's gRPC API socket, whose eBPF gate events the plugin follows to
    /// post a VgpuGpuOpenRefused event on each refused process's pod, and whose memory
    /// refusals over quota become VgpuMemoryQuotaExceeded events ("" or "off": neither).
    /// Never mounted into containers.
    #[arg(long, default_value = "/var/lib/vgpu/daemon-api/api.sock")]
    daemon_api_socket: String,
    /// Namespaces whose pods may ask for vgpu.io/priority: latency-sensitive
    /// (comma-separated; "*": every namespace). Deprecated: write
    /// `spec.limits.priorityClasses` in a VgpuQuotaPolicy, which the scheduler extender
    /// enforces before the pod is placed; kept as a fallback check at container start.
    #[arg(long, value_delimiter = ',', default_value = "*")]
    latency_sensitive_namespaces: Vec<String>,
    /// Seconds between checks that every GPU process has the shim loaded (0: never).
    #[arg(long, default_value_t = 10)]
    audit_interval_s: u64,
    /// GPU memory (MiB) each process may hold beyond its container's quota (its context)
    /// before the audit reports the container over quota.
    #[arg(long, default_value_t = 1024)]
    context_allowance_mib: u64,
    /// Seconds between removals of allocation directories no container holds (0: never).
    #[arg(long, default_value_t = 60)]
    gc_interval_s: u64,
    /// An allocation directory younger than this many seconds is never removed.
    #[arg(long, default_value_t = 300)]
    gc_grace_s: u64,
    /// Serve Prometheus metrics on this address (e.g. 0.0.0.0:9401); none by default.
    #[arg(long)]
    metrics_addr: Option<std::net::SocketAddr>,
    /// Device IDs of vgpu.io/gpu advertised per GPU, so the most containers sharing one
    /// GPU: 10 (one per tenth) up to 100 (fine sharing, 1 % steps; ADR 0023).
    #[arg(long, default_value_t = 10)]
    slices_per_gpu: u32,
}

impl RunArgs {
    fn config(&self) -> Result<Config> {
        let mut c = Config::new(self.node_name.clone());
        c.device_plugin_dir = self.device_plugin_dir.clone();
        c.socket_name = self.socket_name.clone();
        c.pod_resources_socket = self.pod_resources_socket.clone();
        c.state_dir = self.state_dir.clone();
        c.host_state_dir = self
            .host_state_dir
            .clone()
            .unwrap_or_else(|| self.state_dir.clone());
        c.shim_host_path = self.shim_host_path.clone();
        c.shim_container_path = self.shim_container_path.clone();
        c.container_dir = self.container_dir.clone();
        c.preload = !self.no_preload;
        c.device_mode = if self.cdi {
            DeviceMode::Cdi
        } else {
            DeviceMode::Nodes
        };
        c.kubelet_cdi_gate = self.kubelet_cdi_gate;
        c.dev_dir = self.dev_dir.clone();
        c.ignored_xids = self.ignored_xids.iter().copied().collect();
        c.health_recovery =
            (self.health_recovery_s > 0).then(|| Duration::from_secs(self.health_recovery_s));
        c.daemon_socket = match self.daemon_socket.trim() {
            "" | "off" => None,
            p => Some(PathBuf::from(p)),
        };
        c.daemon_container_dir = self.daemon_container_dir.clone();
        c.daemon_api_socket = match self.daemon_api_socket.trim() {
            "" | "off" => None,
            p => Some(PathBuf::from(p)),
        };
        c.latency_sensitive_namespaces = if self
            .latency_sensitive_namespaces
            .iter()
            .any(|n| n == "*")
        {
            None
        } else {
            tracing::warn!(
                "--latency-sensitive-namespaces is deprecated: write spec.limits.priorityClasses in a VgpuQuotaPolicy per namespace (the scheduler extender enforces it before placing the pod); the flag is still checked at container start as a fallback"
            );
            Some(
                self.latency_sensitive_namespaces
                    .iter()
                    .map(|n| n.trim().to_owned())
                    .filter(|n| !n.is_empty())
                    .collect(),
            )
        };
        let secs = |s: u64| (s > 0).then(|| Duration::from_secs(s));
        c.audit_interval = secs(self.audit_interval_s);
        c.gc_interval = secs(self.gc_interval_s);
        c.context_allowance = self.context_allowance_mib.saturating_mul(1 << 20);
        c.nvml_lib = self.nvml_lib.clone();
        c.metrics_addr = self.metrics_addr;
        c.gc_grace = Duration::from_secs(self.gc_grace_s);
        c.slices_per_gpu = self.slices_per_gpu;
        Ok(c)
    }
}

/// Resolves on SIGTERM (kubelet stopping the pod) or SIGINT (Ctrl-C). Where a handler
/// cannot be installed, that signal keeps its default action.
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

/// Removes the plugin's socket in kubelet's directory at exit (kubelet sees the plugin
/// gone at once); nothing else the plugin wrote is removed: allocation directories
/// belong to running containers (docs/install.md, uninstall).
fn remove_socket(path: &std::path::Path) {
    use std::os::unix::fs::FileTypeExt;
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => match std::fs::remove_file(path) {
            Ok(()) => tracing::info!(socket = %path.display(), "socket removed"),
            Err(e) => tracing::warn!(socket = %path.display(), "cannot remove the socket: {e}"),
        },
        _ => {}
    }
}

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let cli = Cli::parse();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("vgpu-device-plugin: tokio runtime: {e}");
            return std::process::ExitCode::from(1);
        }
    };
    let r = rt.block_on(async {
        match cli.cmd {
            Some(Cmd::Health(h)) => health_cmd(h).await,
            Some(Cmd::InstallShim(a)) => install_shim(&a),
            None => {
                let cfg = cli.run.config()?;
                let socket = cfg.device_plugin_dir.join(&cfg.socket_name);
                let r = vgpu_device_plugin::run::run(cfg, shutdown_signal())
                    .await
                    .map_err(anyhow::Error::from);
                remove_socket(&socket);
                r
            }
        }
    });
    match r {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("vgpu-device-plugin: {e:#}");
            std::process::ExitCode::from(1)
        }
    }
}
