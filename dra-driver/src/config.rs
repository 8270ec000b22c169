//! The driver's configuration: one validated struct (every knob is in
//! `docs/configuration.md`'s DRA driver section and `docs/dra.md`).

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Duration;

/// How a container gets its GPUs' device nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceMode {
    /// The driver's CDI spec lists `/dev/nvidia<index>` and the control nodes.
    Nodes,
    /// Each device also names NVIDIA's CDI device `<nvidia_cdi_kind>=<uuid>`, whose spec
    /// (nvidia-ctk) adds the nodes and the driver's libraries.
    Cdi,
}

/// Everything the driver needs to know.
#[derive(Debug, Clone)]
pub struct Config {
    /// The DRA driver name (the claims' `driver`, the plugin's registration name).
    pub driver_name: String,
    /// This node's name (the pool every device is in).
    pub node_name: String,
    /// Kubelet's plugin registration directory (`plugins_registry`), where the
    /// registration socket is created.
    pub registry_dir: PathBuf,
    /// The directory of the DRA service socket (`dra.sock`), the same path on the host
    /// (kubelet dials it) and in the driver.
    pub plugin_dir: PathBuf,
    /// The CDI spec directory the container runtime reads (`/var/run/cdi`).
    pub cdi_dir: PathBuf,
    /// The CDI kind of the driver's devices (`vgpu.io/gpu`).
    pub cdi_kind: String,
    /// Where the driver keeps its checkpoint, claim directories and `ld.so.preload`, as
    /// the driver sees it.
    pub state_dir: PathBuf,
    /// The same directory as the host sees it (the CDI spec's mount sources).
    pub host_state_dir: PathBuf,
    /// The shim's path on the host.
    pub shim_host_path: PathBuf,
    /// Where the shim is mounted in the container (the content of `ld.so.preload`).
    pub shim_container_path: PathBuf,
    /// The container's `VGPU_CONTAINER_DIR`.
    pub container_dir: PathBuf,
    /// Whether to mount the generated `ld.so.preload` at `/etc/ld.so.preload`.
    pub preload: bool,
    /// Device nodes or NVIDIA's CDI devices.
    pub device_mode: DeviceMode,
    /// NVIDIA's CDI kind for [`DeviceMode::Cdi`] (`nvidia.com/gpu`).
    pub nvidia_cdi_kind: String,
    /// Directory of the GPU device nodes (`/dev`), the same path on the host.
    pub dev_dir: PathBuf,
    /// The node daemon's shim socket on the host (its directory is mounted read-only at
    /// [`Config::daemon_container_dir`]); `None`: no daemon.
    pub daemon_socket: Option<PathBuf>,
    /// Where the daemon socket's directory appears in containers.
    pub daemon_container_dir: PathBuf,
    /// Namespaces whose claims may ask for the latency-sensitive priority class;
    /// `None`: every namespace.
    pub latency_sensitive_namespaces: Option<BTreeSet<String>>,
    /// Deadline of one API server read.
    pub call_timeout: Duration,
}

/// A configuration value that is not acceptable.
#[derive(Debug, thiserror::Error)]
#[error("{name}: {reason}")]
pub struct ConfigError {
    /// The knob.
    pub name: &'static str,
    /// What is wrong, naming the value.
    pub reason: String,
}

/// The driver name vgpu registers (the claims' `driver`).
pub const DRIVER_NAME: &str = "vgpu.io";

impl Config {
    /// Defaults for a node, paths as on a standard kubelet host.
    pub fn new(node_name: impl Into<String>) -> Config {
        Config {
            driver_name: DRIVER_NAME.to_owned(),
            node_name: node_name.into(),
            registry_dir: PathBuf::from("/var/lib/kubelet/plugins_registry"),
            plugin_dir: PathBuf::from("/var/lib/kubelet/plugins/vgpu.io"),
            cdi_dir: PathBuf::from("/var/run/cdi"),
            cdi_kind: "vgpu.io/gpu".to_owned(),
            state_dir: PathBuf::from("/var/lib/vgpu-dra"),
            host_state_dir: PathBuf::from("/var/lib/vgpu-dra"),
            shim_host_path: PathBuf::from("/var/lib/vgpu/lib/libvgpu.so"),
            shim_container_path: PathBuf::from("/usr/local/vgpu/libvgpu.so"),
            container_dir: PathBuf::from("/var/run/vgpu"),
            preload: true,
            device_mode: DeviceMode::Nodes,
            nvidia_cdi_kind: "nvidia.com/gpu".to_owned(),
            dev_dir: PathBuf::from("/dev"),
            daemon_socket: Some(PathBuf::from("/var/lib/vgpu/daemon/daemon.sock")),
            daemon_container_dir: PathBuf::from("/run/vgpu-daemon"),
            latency_sensitive_namespaces: None,
            call_timeout: Duration::from_secs(5),
        }
    }

    /// Checks the values that can be checked without I/O.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |name, reason: String| Err(ConfigError { name, reason });
        if self.node_name.is_empty() {
            return bad(
                "node-name",
                "empty (set NODE_NAME from the downward API)".into(),
            );
        }
        let dns = |s: &str| {
            !s.is_empty()
                && s.len() <= 253
                && s.split('.').all(|l| {
                    !l.is_empty()
                        && l.bytes()
                            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                        && !l.starts_with('-')
                        && !l.ends_with('-')
                })
        };
        if !dns(&self.driver_name) {
            return bad(
                "driver-name",
                format!("{:?} is not a DNS subdomain", self.driver_name),
            );
        }
        match self.cdi_kind.split_once('/') {
            Some((vendor, class)) if dns(vendor) && !class.is_empty() && !class.contains('/') => {}
            _ => {
                return bad(
                    "cdi-kind",
                    format!("{:?} is not vendor/class", self.cdi_kind),
                );
            }
        }
        for (name, p) in [
            ("shim-container-path", &self.shim_container_path),
            ("container-dir", &self.container_dir),
            ("daemon-container-dir", &self.daemon_container_dir),
            ("host-state-dir", &self.host_state_dir),
            ("shim-host-path", &self.shim_host_path),
            ("dev-dir", &self.dev_dir),
        ] {
            if !p.is_absolute() {
                return bad(name, format!("{} is not an absolute path", p.display()));
            }
        }
        if self
            .shim_container_path
            .to_string_lossy()
            .contains(['\n', ' ', ':'])
        {
            return bad(
                "shim-container-path",
                "ld.so.preload entries cannot hold spaces, colons or newlines".into(),
            );
        }
        if let Some(sock) = &self.daemon_socket {
            let dir = sock.parent().filter(|d| !d.as_os_str().is_empty());
            let Some(dir) = dir.filter(|_| sock.is_absolute() && sock.file_name().is_some()) else {
                return bad(
                    "daemon-socket",
                    format!("{} is not an absolute path to a file", sock.display()),
                );
            };
            // That directory is mounted into every container: it must not hold the
            // driver's state.
            if self.host_state_dir.starts_with(dir) {
                return bad(
                    "daemon-socket",
                    format!(
                        "its directory {} is mounted into every container and would expose the state directory {}",
                        dir.display(),
                        self.host_state_dir.display()
                    ),
                );
            }
        }
        if self.call_timeout.is_zero() {
            return bad("call-timeout", "must be > 0".into());
        }
        Ok(())
    }

    /// The DRA service socket (kubelet dials it: the registration's endpoint).
    pub fn dra_socket(&self) -> PathBuf {
        self.plugin_dir.join("dra.sock")
    }

    /// The registration socket kubelet's plugin watcher finds.
    pub fn registration_socket(&self) -> PathBuf {
        self.registry_dir
            .join(format!("{}-reg.sock", self.driver_name))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_validate_and_bad_values_are_named() {
        Config::new("n").validate().unwrap();
        let mut c = Config::new("n");
        c.driver_name = "Vgpu_IO".into();
        let e = c.validate().unwrap_err().to_string();
        assert!(e.starts_with("driver-name") && e.contains("Vgpu_IO"), "{e}");
        let mut c = Config::new("n");
        c.cdi_kind = "vgpu".into();
        assert!(c.validate().unwrap_err().to_string().contains("\"vgpu\""));
        let mut c = Config::new("n");
        c.daemon_socket = Some(PathBuf::from("/var/lib/daemon.sock"));
        assert!(c.validate().unwrap_err().to_string().contains("/var/lib"));
    }
}
