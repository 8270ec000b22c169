//! The `DevicePlugin` gRPC service kubelet calls.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;

use futures::Stream;
use tokio::sync::watch;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use tracing::{debug, info};
use vgpu_core::container_quota::{FIXED_DIR, QUOTA_FILE};
use vgpu_core::inventory::GpuInfo;

use crate::config::{Config, DeviceMode};
use crate::error::error_chain;
use crate::handshake::{Handshake, log_refusal};
use crate::kubelet::v1beta1::device_plugin_server::DevicePlugin;
use crate::kubelet::v1beta1::{
    AllocateRequest, AllocateResponse, CdiDevice, ContainerAllocateResponse,
    ContainerPreferredAllocationResponse, Device, DevicePluginOptions, DeviceSpec, Empty,
    ListAndWatchResponse, Mount, NumaNode, PreStartContainerRequest, PreStartContainerResponse,
    PreferredAllocationRequest, PreferredAllocationResponse, TopologyInfo,
};
use crate::kubelet::{HEALTHY, UNHEALTHY};
use crate::preflight::{self, PreflightError};
use crate::{ids, visible};

/// File name of the generated preload list in the state directory.
pub const PRELOAD_FILE: &str = "ld.so.preload";
/// Control device nodes every CUDA container needs besides its GPUs' own.
pub const CONTROL_NODES: [&str; 3] = ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"];

/// Why an allocation was refused.
#[derive(Debug, thiserror::Error)]
pub enum AllocateError {
    /// A device ID is malformed.
    #[error("device IDs from kubelet")]
    BadId(#[source] ids::IdError),
    /// A device ID names a GPU this node does not have.
    #[error("device {0:?} is not on this node")]
    Unknown(String),
    /// A GPU's device node is missing on the host: the runtime would fail the container
    /// late and opaquely (`lstat /dev/nvidia<N>`).
    #[error("allocate")]
    DeviceNode(#[source] PreflightError),
    /// The allocation directory could not be made.
    #[error("prepare allocation directory {path}")]
    Dir {
        /// The directory.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
}

impl AllocateError {
    /// The gRPC status kubelet receives.
    pub fn to_status(&self) -> Status {
        let msg = error_chain(self);
        match self {
            AllocateError::BadId(_) | AllocateError::Unknown(_) => Status::invalid_argument(msg),
            AllocateError::DeviceNode(_) => Status::failed_precondition(msg),
            AllocateError::Dir { .. } => Status::internal(msg),
        }
    }
}

/// The device list kubelet sees: `slices_per_gpu` IDs per GPU (10, or up to 100 on a
/// node configured for fine sharing, ADR 0023), with the GPU's health and, where NVML
/// told it, its NUMA node (`TopologyInfo`, read by kubelet's Topology Manager).
pub fn devices(gpus: &[GpuInfo], slices_per_gpu: u32) -> Vec<Device> {
    gpus.iter()
        .flat_map(|g| {
            let topology = g
                .topology
                .as_ref()
                .and_then(|t| t.numa_node)
                .map(|n| TopologyInfo {
                    nodes: vec![NumaNode { id: i64::from(n) }],
                });
            (0..slices_per_gpu).map(move |s| Device {
                id: ids::device_id(&g.uuid, s),
                health: if g.healthy { HEALTHY } else { UNHEALTHY }.to_owned(),
                topology: topology.clone(),
            })
        })
        .collect()
}

/// Writes `ld.so.preload` (one line: the shim's path in the container) into the state
/// directory, and makes the allocation directory.
pub fn prepare_state_dir(cfg: &Config) -> std::io::Result<()> {
    std::fs::create_dir_all(cfg.state_dir.join("alloc"))?;
    let line = format!("{}\n", cfg.shim_container_path.display());
    std::fs::write(cfg.state_dir.join(PRELOAD_FILE), line)
}

/// The device plugin service.
#[derive(Debug, Clone)]
pub struct Plugin {
    cfg: Arc<Config>,
    gpus: watch::Receiver<Vec<GpuInfo>>,
    handshake: Handshake,
}

impl Plugin {
    /// A plugin over these GPUs.
    pub fn new(
        cfg: Arc<Config>,
        gpus: watch::Receiver<Vec<GpuInfo>>,
        handshake: Handshake,
    ) -> Plugin {
        Plugin {
            cfg,
            gpus,
            handshake,
        }
    }

    /// The daemon socket's host directory and file name, if a daemon is configured and
    /// its directory exists (a runtime fails a container whose mount source is missing;
    /// without it the shim runs its local duty cycle at the container's share).
    fn daemon_socket_dir(&self) -> Option<(PathBuf, std::ffi::OsString)> {
        let sock = self.cfg.daemon_socket.as_ref()?;
        let dir = sock.parent()?;
        let file = sock.file_name()?.to_owned();
        // The plugin sees host paths under the state directory at its own mount.
        let seen = match dir.strip_prefix(&self.cfg.host_state_dir) {
            Ok(rest) => self.cfg.state_dir.join(rest),
            Err(_) => dir.to_owned(),
        };
        if seen.is_dir() {
            Some((dir.to_owned(), file))
        } else {
            debug!(dir = %seen.display(), "no daemon socket directory: not mounted");
            None
        }
    }

    /// The `Allocate` answer for one container (public for benchmarks).
    pub fn allocate_one(
        &self,
        device_ids: &[String],
    ) -> Result<ContainerAllocateResponse, AllocateError> {
        let gpus = self.gpus.borrow().clone();
        let mut mine: Vec<&GpuInfo> = Vec::new();
        for id in device_ids {
            let (uuid, _) = ids::parse_device_id(id).map_err(AllocateError::BadId)?;
            let g = gpus
                .iter()
                .find(|g| g.uuid == uuid)
                .ok_or_else(|| AllocateError::Unknown(id.clone()))?;
            if !mine.iter().any(|m| m.uuid == g.uuid) {
                mine.push(g);
            }
        }
        mine.sort_by_key(|g| g.index);
        if self.cfg.device_mode == DeviceMode::Nodes {
            let owned: Vec<GpuInfo> = mine.iter().map(|g| (*g).clone()).collect();
            preflight::device_nodes(&self.cfg.dev_dir, &owned)
                .map_err(AllocateError::DeviceNode)?;
        }
        let key = ids::allocation_key(device_ids.iter().map(String::as_str));
        let dir = self.cfg.state_dir.join("alloc").join(&key);
        {
            let _guard = self.handshake.alloc_lock();
            reset_dir(&dir).map_err(|source| AllocateError::Dir {
                path: dir.clone(),
                source,
            })?;
        }
        let host_dir = self.cfg.host_state_dir.join("alloc").join(&key);
        let cdir = &self.cfg.container_dir;
        let path = |p: &Path| p.display().to_string();
        let mut mounts = vec![
            Mount {
                container_path: path(cdir),
                host_path: path(&host_dir),
                read_only: false,
            },
            // The quota file is read-only inside the container, over the writable dir.
            Mount {
                container_path: path(&cdir.join(QUOTA_FILE)),
                host_path: path(&host_dir.join(QUOTA_FILE)),
                read_only: true,
            },
            // The same directory read-only at the fixed path (ADR 0042): where the shim
            // (and the daemon, the audit) find the quota and the accounting region's
            // identity, whatever the tenant's environment says. A mount point: the
            // tenant can neither rename nor replace it, nor write into it here.
            Mount {
                container_path: FIXED_DIR.to_owned(),
                host_path: path(&host_dir),
                read_only: true,
            },
            Mount {
                container_path: path(&self.cfg.shim_container_path),
                host_path: path(&self.cfg.shim_host_path),
                read_only: true,
            },
        ];
        if self.cfg.preload {
            mounts.push(Mount {
                container_path: "/etc/ld.so.preload".into(),
                host_path: path(&self.cfg.host_state_dir.join(PRELOAD_FILE)),
                read_only: true,
            });
        }
        let mut envs = HashMap::new();
        envs.insert("VGPU_CONTAINER_DIR".to_owned(), path(cdir));
        // The container's GPUs by UUID, in the quota file's order (`visible`).
        let ordered = visible::in_device_order(mine.iter().map(|g| g.uuid.as_str()), &gpus);
        for (k, v) in visible::visible_env(&ordered) {
            envs.insert(k.to_owned(), v);
        }
        if let Some((host_dir, file)) = self.daemon_socket_dir() {
            // The directory, not the socket file: a restarted daemon's new socket is
            // seen. Read-only is enough to connect to a unix socket.
            let cdir = &self.cfg.daemon_container_dir;
            mounts.push(Mount {
                container_path: path(cdir),
                host_path: path(&host_dir),
                read_only: true,
            });
            envs.insert("VGPU_DAEMON_SOCKET".to_owned(), path(&cdir.join(file)));
        }
        let (devices, cdi_devices) = match self.cfg.device_mode {
            DeviceMode::Nodes => {
                let mut d: Vec<DeviceSpec> = mine
                    .iter()
                    .map(|g| {
                        let n = preflight::device_node(&self.cfg.dev_dir, g);
                        DeviceSpec {
                            container_path: format!("/dev/nvidia{}", g.index),
                            host_path: path(&n),
                            permissions: "rw".into(),
                        }
                    })
                    .collect();
                for c in CONTROL_NODES {
                    let n = self.cfg.dev_dir.join(c);
                    if n.exists() {
                        d.push(DeviceSpec {
                            container_path: format!("/dev/{c}"),
                            host_path: path(&n),
                            permissions: "rw".into(),
                        });
                    }
                }
                (d, Vec::new())
            }
            DeviceMode::Cdi => (
                Vec::new(),
                mine.iter()
                    .map(|g| CdiDevice {
                        name: format!("{}={}", self.cfg.cdi_kind, g.uuid),
                    })
                    .collect(),
            ),
        };
        Ok(ContainerAllocateResponse {
            envs,
            mounts,
            devices,
            annotations: HashMap::new(),
            cdi_devices,
        })
    }
}

/// Empties (or creates) an allocation directory and leaves an empty quota file in it,
/// so that the read-only mount has a source; the shim refuses an empty quota file.
fn reset_dir(dir: &Path) -> std::io::Result<()> {
    match std::fs::remove_dir_all(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join(QUOTA_FILE), b"")
}

type DeviceStream = Pin<Box<dyn Stream<Item = Result<ListAndWatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl DevicePlugin for Plugin {
    async fn get_device_plugin_options(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<DevicePluginOptions>, Status> {
        Ok(Response::new(DevicePluginOptions {
            pre_start_required: true,
            get_preferred_allocation_available: true,
        }))
    }

    type ListAndWatchStream = DeviceStream;

    async fn list_and_watch(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<Self::ListAndWatchStream>, Status> {
        let mut rx = self.gpus.clone();
        let slices_per_gpu = self.cfg.slices_per_gpu;
        let (tx, out) = tokio::sync::mpsc::channel(4);
        tokio::spawn(async move {
            loop {
                let list = devices(&rx.borrow_and_update(), slices_per_gpu);
                debug!(devices = list.len(), "ListAndWatch: sending the full list");
                if tx
                    .send(Ok(ListAndWatchResponse { devices: list }))
                    .await
                    .is_err()
                {
                    return;
                }
                tokio::select! {
                    r = rx.changed() => if r.is_err() { return },
                    () = tx.closed() => return,
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(out))))
    }

    async fn get_preferred_allocation(
        &self,
        req: Request<PreferredAllocationRequest>,
    ) -> Result<Response<PreferredAllocationResponse>, Status> {
        let mut container_responses = Vec::new();
        for c in req.into_inner().container_requests {
            let size = usize::try_from(c.allocation_size).unwrap_or(0);
            let ids = self
                .handshake
                .preferred(&c.available_device_i_ds, &c.must_include_device_i_ds, size)
                .await;
            container_responses.push(ContainerPreferredAllocationResponse { device_i_ds: ids });
        }
        Ok(Response::new(PreferredAllocationResponse {
            container_responses,
        }))
    }

    async fn allocate(
        &self,
        req: Request<AllocateRequest>,
    ) -> Result<Response<AllocateResponse>, Status> {
        let mut container_responses = Vec::new();
        for c in req.into_inner().container_requests {
            let r = self.allocate_one(&c.devices_ids).map_err(|e| {
                tracing::warn!(devices = ?c.devices_ids, error = %error_chain(&e), "Allocate refused");
                e.to_status()
            })?;
            info!(devices = c.devices_ids.len(), "allocated");
            container_responses.push(r);
        }
        Ok(Response::new(AllocateResponse {
            container_responses,
        }))
    }

    async fn pre_start_container(
        &self,
        req: Request<PreStartContainerRequest>,
    ) -> Result<Response<PreStartContainerResponse>, Status> {
        let ids = req.into_inner().devices_ids;
        match self.handshake.prestart(&ids).await {
            Ok(_) => Ok(Response::new(PreStartContainerResponse {})),
            Err(e) => {
                log_refusal(&ids, &e);
                Err(e.to_status())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plugin(mode: DeviceMode, root: &Path) -> Plugin {
        let mut cfg = Config::new("n");
        cfg.state_dir = root.join("state");
        cfg.host_state_dir = PathBuf::from("/host/vgpu");
        cfg.dev_dir = root.join("dev");
        cfg.device_mode = mode;
        std::fs::create_dir_all(&cfg.dev_dir).unwrap();
        std::fs::write(cfg.dev_dir.join("nvidiactl"), b"").unwrap();
        for i in 0..2 {
            std::fs::write(cfg.dev_dir.join(format!("nvidia{i}")), b"").unwrap();
        }
        prepare_state_dir(&cfg).unwrap();
        let cfg = Arc::new(cfg);
        let uri: http::Uri = "http://127.0.0.1:9".parse().unwrap();
        let client = kube::Client::try_from(kube::Config::new(uri)).unwrap();
        let (_tx, rx) = watch::channel(vgpu_testkit::node::gpus(2, 1024));
        let hs = Handshake::new(cfg.clone(), client, None, rx.clone());
        Plugin::new(cfg, rx, hs)
    }

    #[tokio::test]
    async fn the_daemon_socket_directory_is_mounted_read_only_with_its_path_in_the_env() {
        let root = tempfile::tempdir().unwrap();
        let mut p = plugin(DeviceMode::Nodes, root.path());
        let mut cfg = (*p.cfg).clone();
        // A directory under the state dir (as in deploy/): the plugin checks it at its
        // own mount, and hands kubelet the host path.
        std::fs::create_dir_all(cfg.state_dir.join("daemon")).unwrap();
        cfg.daemon_socket = Some(cfg.host_state_dir.join("daemon/daemon.sock"));
        cfg.validate().unwrap();
        p.cfg = Arc::new(cfg);
        let g = vgpu_testkit::node::gpus(2, 1024);
        let r = p.allocate_one(&[ids::device_id(&g[0].uuid, 1)]).unwrap();
        let m = r
            .mounts
            .iter()
            .find(|m| m.container_path == "/run/vgpu-daemon")
            .expect("daemon directory mounted");
        assert_eq!(m.host_path, "/host/vgpu/daemon");
        assert!(m.read_only);
        assert_eq!(
            r.envs.get("VGPU_DAEMON_SOCKET").map(String::as_str),
            Some("/run/vgpu-daemon/daemon.sock")
        );
        // A socket directory that would expose the state directory is refused by name.
        let mut bad = (*p.cfg).clone();
        bad.daemon_socket = Some(PathBuf::from("/host/daemon.sock"));
        let e = bad.validate().unwrap_err().to_string();
        assert!(e.contains("daemon-socket") && e.contains("/host"), "{e}");
    }

    #[tokio::test]
    async fn cdi_mode_names_cdi_devices_and_nodes_mode_device_nodes() {
        let root = tempfile::tempdir().unwrap();
        let g = vgpu_testkit::node::gpus(2, 1024);
        let ids = vec![ids::device_id(&g[1].uuid, 4), ids::device_id(&g[1].uuid, 5)];
        let r = plugin(DeviceMode::Cdi, root.path())
            .allocate_one(&ids)
            .unwrap();
        assert!(r.devices.is_empty());
        assert_eq!(r.cdi_devices.len(), 1);
        assert_eq!(
            r.cdi_devices[0].name,
            format!("nvidia.com/gpu={}", g[1].uuid)
        );
        let r = plugin(DeviceMode::Nodes, root.path())
            .allocate_one(&ids)
            .unwrap();
        let paths: Vec<&str> = r
            .devices
            .iter()
            .map(|d| d.container_path.as_str())
            .collect();
        assert_eq!(paths, ["/dev/nvidia1", "/dev/nvidiactl"]);
        assert!(
            r.mounts
                .iter()
                .all(|m| m.host_path.starts_with("/host/vgpu")
                    || m.container_path == "/usr/local/vgpu/libvgpu.so")
        );
        assert!(
            !r.envs.contains_key("VGPU_DAEMON_SOCKET"),
            "no daemon directory on this host: nothing mounted"
        );
        let e = plugin(DeviceMode::Nodes, root.path())
            .allocate_one(&["GPU-nope-1".to_owned()])
            .unwrap_err();
        assert_eq!(e.to_status().code(), tonic::Code::InvalidArgument);
        assert!(e.to_string().contains("GPU-nope-1"), "{e}");
    }
}
