//! The plugin's configuration: one validated struct (every knob is in
//! `docs/configuration.md`).

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Duration;

/// XIDs that are application errors, not GPU faults (ignored by default).
pub const DEFAULT_IGNORED_XIDS: [u64; 6] = [13, 31, 43, 45, 68, 109];

/// How the container gets its GPUs' device nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceMode {
    /// `DeviceSpec`s: `/dev/nvidia<index>` of each GPU plus the control nodes.
    Nodes,
    /// CDI device names `<cdi_kind>=<gpu-uuid>` (the runtime's CDI spec adds the nodes).
    Cdi,
}

/// Everything the plugin needs to know.
#[derive(Debug, Clone)]
pub struct Config {
    /// This node's name (the pod's `spec.nodeName` and the assignment's `node`).
    pub node_name: String,
    /// Extended resource advertised (`vgpu.io/gpu`).
    pub resource_name: String,
    /// Kubelet's device-plugins directory (holds `kubelet.sock` and our socket).
    pub device_plugin_dir: PathBuf,
    /// Our socket's file name in that directory (the registration endpoint).
    pub socket_name: String,
    /// Kubelet's PodResources socket.
    pub pod_resources_socket: PathBuf,
    /// Where the plugin creates allocation directories and `ld.so.preload`, as the
    /// plugin sees it.
    pub state_dir: PathBuf,
    /// The same directory as the host sees it (mount sources kubelet hands to the runtime).
    pub host_state_dir: PathBuf,
    /// The shim's path on the host.
    pub shim_host_path: PathBuf,
    /// Where the shim is mounted in the container (the content of `ld.so.preload`).
    pub shim_container_path: PathBuf,
    /// The container's `VGPU_CONTAINER_DIR`.
    pub container_dir: PathBuf,
    /// Whether to mount the generated `ld.so.preload` at `/etc/ld.so.preload`.
    pub preload: bool,
    /// Device nodes or CDI.
    pub device_mode: DeviceMode,
    /// CDI kind for [`DeviceMode::Cdi`] (`nvidia.com/gpu`).
    pub cdi_kind: String,
    /// Directory of the GPU device nodes `nvidia<index>` (`/dev`), the same path on the
    /// host (kubelet hands it to the runtime) and in the plugin (which checks them at
    /// start and at `Allocate`).
    pub dev_dir: PathBuf,
    /// With [`DeviceMode::Cdi`]: the operator says kubelet 1.28 runs with the
    /// `DevicePluginCDIDevices` feature gate (without it, kubelet < 1.29 is refused).
    pub kubelet_cdi_gate: bool,
    /// XIDs that do not make a GPU unhealthy.
    pub ignored_xids: BTreeSet<u64>,
    /// A GPU made unhealthy by an XID/ECC event is healthy again after this long
    /// without another one, if it answers NVML; `None` keeps it unhealthy until restart.
    pub health_recovery: Option<Duration>,
    /// How often the health monitor checks that each GPU answers NVML.
    pub health_poll: Duration,
    /// How often the kubelet socket is checked for a restart.
    pub kubelet_poll: Duration,
    /// Deadline of one PodResources `List` and of one API server read.
    pub call_timeout: Duration,
    /// The node daemon's shim socket on the host; its directory is mounted read-only
    /// into every container at [`Config::daemon_container_dir`] (so a restarted
    /// daemon's new socket is seen) and `VGPU_DAEMON_SOCKET` names it there. `None`:
    /// no daemon (the shim runs its local duty cycle at the container's share).
    pub daemon_socket: Option<PathBuf>,
    /// Where the daemon socket's directory appears in containers.
    pub daemon_container_dir: PathBuf,
    /// The node daemon's gRPC API socket (root only, never mounted into containers): the
    /// plugin follows its eBPF gate events there and posts a `VgpuGpuOpenRefused` event
    /// on the pod of each refused process, and polls the GPU memory allocations it saw
    /// refused over a container's quota, posted as `VgpuMemoryQuotaExceeded`. `None`:
    /// neither.
    pub daemon_api_socket: Option<PathBuf>,
    /// Namespaces whose pods may ask for the latency-sensitive priority class
    /// (`vgpu.io/priority`); `None`: every namespace.
    pub latency_sensitive_namespaces: Option<BTreeSet<String>>,
    /// How often GPU processes are checked for a loaded shim; `None`: never.
    pub audit_interval: Option<Duration>,
    /// GPU memory each process may hold beyond its container's quota before the
    /// container counts as over quota (its context, which the shim does not charge to
    /// the quota, ADR 0008), bytes.
    pub context_allowance: u64,
    /// How often allocation directories no container holds are removed; `None`: never.
    pub gc_interval: Option<Duration>,
    /// An allocation directory younger than this is never removed (kubelet records a
    /// container's devices only after `Allocate` returns).
    pub gc_grace: Duration,
    /// The NVML library to load; `None`: the system's `libnvidia-ml.so.1`.
    pub nvml_lib: Option<PathBuf>,
    /// Where to serve Prometheus metrics; `None`: nowhere.
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// Device IDs of `vgpu.io/gpu` advertised per GPU, so the most containers one GPU
    /// takes: 10 (the default) up to 100 (fine sharing, ADR 0023).
    pub slices_per_gpu: u32,
}

/// A configuration value that is not acceptable.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A value is invalid.
    #[error("{name}: {reason}")]
    Invalid {
        /// The knob.
        name: &'static str,
        /// What is wrong.
        reason: String,
    },
}

impl Config {
    /// Defaults for a node, paths as on a standard kubelet host.
    pub fn new(node_name: impl Into<String>) -> Config {
        Config {
            node_name: node_name.into(),
            resource_name: vgpu_core::resources::RESOURCE_GPU.to_owned(),
            device_plugin_dir: PathBuf::from("/var/lib/kubelet/device-plugins"),
            socket_name: "vgpu.sock".to_owned(),
            pod_resources_socket: PathBuf::from("/var/lib/kubelet/pod-resources/kubelet.sock"),
            state_dir: PathBuf::from("/var/lib/vgpu"),
            host_state_dir: PathBuf::from("/var/lib/vgpu"),
            shim_host_path: PathBuf::from("/var/lib/vgpu/lib/libvgpu.so"),
            shim_container_path: PathBuf::from("/usr/local/vgpu/libvgpu.so"),
            container_dir: PathBuf::from("/var/run/vgpu"),
            preload: true,
            device_mode: DeviceMode::Nodes,
            cdi_kind: "nvidia.com/gpu".to_owned(),
            dev_dir: PathBuf::from("/dev"),
            kubelet_cdi_gate: false,
            ignored_xids: DEFAULT_IGNORED_XIDS.into_iter().collect(),
            health_recovery: Some(Duration::from_secs(60)),
            health_poll: Duration::from_secs(1),
            kubelet_poll: Duration::from_millis(50),
            call_timeout: Duration::from_secs(5),
            daemon_socket: Some(PathBuf::from("/var/lib/vgpu/daemon/daemon.sock")),
            daemon_container_dir: PathBuf::from("/run/vgpu-daemon"),
            daemon_api_socket: Some(PathBuf::from("/var/lib/vgpu/daemon-api/api.sock")),
            latency_sensitive_namespaces: None,
            audit_interval: Some(Duration::from_secs(10)),
            context_allowance: 1 << 30,
            gc_interval: Some(Duration::from_secs(60)),
            gc_grace: Duration::from_secs(300),
            nvml_lib: None,
            metrics_addr: None,
            slices_per_gpu: vgpu_core::resources::SLICES_PER_GPU,
        }
    }

    /// Checks the values that can be checked without I/O.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |name, reason: &str| ConfigError::Invalid {
            name,
            reason: reason.to_owned(),
        };
        if self.node_name.is_empty() {
            return Err(invalid(
                "node-name",
                "empty (set NODE_NAME from the downward API)",
            ));
        }
        if self.socket_name.is_empty() || self.socket_name.contains('/') {
            return Err(invalid("socket-name", "must be a plain file name"));
        }
        if self.socket_name == crate::kubelet::KUBELET_SOCKET {
            return Err(invalid("socket-name", "must not be kubelet's own socket"));
        }
        if !self.shim_container_path.is_absolute() || !self.container_dir.is_absolute() {
            return Err(invalid(
                "shim-container-path/container-dir",
                "container paths must be absolute",
            ));
        }
        if self
            .shim_container_path
            .to_string_lossy()
            .contains(['\n', ' ', ':'])
        {
            return Err(invalid(
                "shim-container-path",
                "ld.so.preload entries cannot hold spaces, colons or newlines",
            ));
        }
        if let Some(sock) = &self.daemon_socket {
            let dir = sock.parent().filter(|d| !d.as_os_str().is_empty());
            let Some(dir) = dir.filter(|_| sock.is_absolute() && sock.file_name().is_some()) else {
                return Err(ConfigError::Invalid {
                    name: "daemon-socket",
                    reason: format!("{} is not an absolute path to a file", sock.display()),
                });
            };
            // That directory is mounted into every container: it must not be (or hold)
            // the plugin's state, kubelet's sockets or the root.
            for (what, other) in [
                ("the state directory", &self.host_state_dir),
                (
                    "kubelet's device-plugins directory",
                    &self.device_plugin_dir,
                ),
            ] {
                if other.starts_with(dir) {
                    return Err(ConfigError::Invalid {
                        name: "daemon-socket",
                        reason: format!(
                            "its directory {} is mounted into every container and would expose {what} {}; give the daemon socket a directory of its own",
                            dir.display(),
                            other.display()
                        ),
                    });
                }
            }
            if !self.daemon_container_dir.is_absolute() {
                return Err(invalid(
                    "daemon-container-dir",
                    "container paths must be absolute",
                ));
            }
        }
        if !self.dev_dir.is_absolute() {
            return Err(ConfigError::Invalid {
                name: "dev-dir",
                reason: format!("{} is not an absolute path", self.dev_dir.display()),
            });
        }
        if let Err(reason) = vgpu_core::resources::check_slices_per_gpu(self.slices_per_gpu) {
            return Err(ConfigError::Invalid {
                name: "slices-per-gpu",
                reason,
            });
        }
        if self.health_poll.is_zero() || self.kubelet_poll.is_zero() {
            return Err(invalid("health-poll/kubelet-poll", "must be > 0"));
        }
        Ok(())
    }
}
