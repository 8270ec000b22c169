//! `vgpu-dra-driver`: parse the configuration, set up logging, run until SIGTERM/SIGINT.

use std::collections::BTreeSet;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Parser;
use vgpu_dra_driver::config::{Config, DeviceMode};

#[derive(Parser, Debug)]
#[command(
    about = "vgpu's DRA driver: shared GPUs with consumable capacity, handed over as CDI devices"
)]
struct Cli {
    /// This node's name (the pool of every device).
    #[arg(long, env = "NODE_NAME")]
    node_name: String,
    /// The DRA driver name (the claims' `driver`).
    #[arg(long, default_value = vgpu_dra_driver::config::DRIVER_NAME)]
    driver_name: String,
    /// Kubelet's plugin registration directory.
    #[arg(long, default_value = "/var/lib/kubelet/plugins_registry")]
    registry_dir: PathBuf,
    /// The directory of the DRA socket (same path on the host and here).
    #[arg(long, default_value = "/var/lib/kubelet/plugins/vgpu.io")]
    plugin_dir: PathBuf,
    /// The CDI spec directory the container runtime reads.
    #[arg(long, default_value = "/var/run/cdi")]
    cdi_dir: PathBuf,
    /// The driver's state directory as the driver sees it.
    #[arg(long, default_value = "/var/lib/vgpu-dra")]
    state_dir: PathBuf,
    /// The same directory as the host sees it (mount sources in CDI specs).
    #[arg(long)]
    host_state_dir: Option<PathBuf>,
    /// The shim's path on the host.
    #[arg(long, default_value = "/var/lib/vgpu/lib/libvgpu.so")]
    shim_host_path: PathBuf,
    /// Where the shim is mounted in containers.
    #[arg(long, default_value = "/usr/local/vgpu/libvgpu.so")]
    shim_container_path: PathBuf,
    /// The containers' `VGPU_CONTAINER_DIR`.
    #[arg(long, default_value = "/var/run/vgpu")]
    container_dir: PathBuf,
    /// Do not mount `/etc/ld.so.preload` (the tenant sets `LD_PRELOAD` itself).
    #[arg(long)]
    no_preload: bool,
    /// `nodes` (the spec lists /dev/nvidia<N>) or `cdi` (also NVIDIA's CDI device per GPU).
    #[arg(long, default_value = "nodes")]
    device_mode: String,
    /// NVIDIA's CDI kind in `cdi` mode.
    #[arg(long, default_value = "nvidia.com/gpu")]
    nvidia_cdi_kind: String,
    /// The GPU device nodes' directory.
    #[arg(long, default_value = "/dev")]
    dev_dir: PathBuf,
    /// The node daemon's shim socket on the host; `""` or `off`: no daemon.
    #[arg(long, default_value = "/var/lib/vgpu/daemon/daemon.sock")]
    daemon_socket: String,
    /// Comma-separated namespaces whose claims may ask for latency-sensitive; unset: all.
    #[arg(long)]
    latency_sensitive_namespaces: Option<String>,
    /// NVML library to load (default: the system's libnvidia-ml.so.1).
    #[arg(long)]
    nvml_lib: Option<PathBuf>,
}

impl Cli {
    fn config(self) -> Result<Config> {
        let mut c = Config::new(self.node_name);
        c.driver_name = self.driver_name;
        c.registry_dir = self.registry_dir;
        c.plugin_dir = self.plugin_dir;
        c.cdi_dir = self.cdi_dir;
        c.host_state_dir = self
            .host_state_dir
            .unwrap_or_else(|| self.state_dir.clone());
        c.state_dir = self.state_dir;
        c.shim_host_path = self.shim_host_path;
        c.shim_container_path = self.shim_container_path;
        c.container_dir = self.container_dir;
        c.preload = !self.no_preload;
        c.device_mode = match self.device_mode.as_str() {
            "nodes" => DeviceMode::Nodes,
            "cdi" => DeviceMode::Cdi,
            other => anyhow::bail!("--device-mode: {other:?} (expected nodes or cdi)"),
        };
        c.nvidia_cdi_kind = self.nvidia_cdi_kind;
        c.dev_dir = self.dev_dir;
        c.daemon_socket = match self.daemon_socket.as_str() {
            "" | "off" => None,
            p => Some(PathBuf::from(p)),
        };
        c.latency_sensitive_namespaces = self.latency_sensitive_namespaces.map(|s| {
            s.split(',')
                .map(|n| n.trim().to_owned())
                .filter(|n| !n.is_empty())
                .collect::<BTreeSet<_>>()
        });
        Ok(c)
    }
}

/// Resolves on SIGTERM or SIGINT.
async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let wait = |kind: SignalKind| async move {
        match signal(kind) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        () = wait(SignalKind::terminate()) => {}
        () = wait(SignalKind::interrupt()) => {}
    }
    tracing::info!("shutting down");
}

async fn run(cli: Cli) -> Result<()> {
    let nvml = cli.nvml_lib.clone();
    let cfg = cli.config()?;
    let gpus = vgpu_dra_driver::inventory::discover(nvml.as_deref())?;
    tracing::info!(gpus = gpus.len(), "GPUs found");
    let (_gpus_tx, gpus) = tokio::sync::watch::channel(gpus);
    let client = kube::Client::try_default()
        .await
        .context("API server client")?;
    let started = vgpu_dra_driver::run::start(cfg, client, gpus).await?;
    shutdown_signal().await;
    started.stop().await;
    Ok(())
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
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("vgpu-dra-driver: start the runtime: {e}");
            return std::process::ExitCode::from(1);
        }
    };
    match rt.block_on(run(cli)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("vgpu-dra-driver: {e:#}");
            std::process::ExitCode::from(1)
        }
    }
}
