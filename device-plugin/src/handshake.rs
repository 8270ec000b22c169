//! The race-free handshake (ADR 0009): which container a set of device IDs belongs to,
//! and its quota.
//!
//! Kubelet records a container's device IDs when `Allocate` returns and sends
//! `PreStartContainer` exactly those IDs, so at that point its PodResources `List` names
//! the one container holding exactly that set. The pod's assignment record (written by
//! the scheduler extender at bind) then gives that container's GPUs and quota, and the
//! pod's `vgpu.io/gpu-memory-limit` its memory limit on each GPU (ADR 0066). Nothing is
//! carried over from `Allocate`: every answer is derived from kubelet's and the API
//! server's state at the time of the call, so calls are idempotent and survive restarts.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::runtime::reflector::Store;
use tokio::sync::watch;
use tracing::{info, warn};
use vgpu_core::container_quota::{ContainerQuota, GpuQuota, QUOTA_FILE, QUOTA_VERSION};
use vgpu_core::inventory::GpuInfo;
use vgpu_core::memory_limit::parse_memory_limits;
use vgpu_core::resources::{
    ANNOTATION_ASSIGNMENT, ANNOTATION_PRIORITY, Assignment, GpuGrant, parse_compute_class,
};
use vgpu_core::sched_proto::{ComputePolicy, Priority};

use crate::config::Config;
use crate::error::{HandshakeError, error_chain};
use crate::identify::{self, Decision, Found, INIT_STATUS_WAIT, assignment_of, is_terminal};
use crate::ids;
use crate::podresources::{SharedList, listed, lock};
use crate::visible;

/// What `PreStartContainer` decided and wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Handover {
    /// The quota written.
    pub quota: ContainerQuota,
    /// Where.
    pub path: PathBuf,
}

/// The handshake's state: configuration and clients, no per-allocation state.
#[derive(Clone)]
pub struct Handshake {
    pub(crate) cfg: Arc<Config>,
    pub(crate) lister: SharedList,
    client: kube::Client,
    pub(crate) pods: Option<Store<Pod>>,
    pub(crate) gpus: watch::Receiver<Vec<GpuInfo>>,
    alloc_lock: Arc<Mutex<()>>,
}

impl std::fmt::Debug for Handshake {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Handshake")
            .field("node", &self.cfg.node_name)
            .field("lister", &self.lister)
            .field("pod_watch", &self.pods.is_some())
            .finish_non_exhaustive()
    }
}

impl Handshake {
    /// A handshake over kubelet's PodResources socket and the API server. `pods`, when
    /// given, is a watch of this node's pods that `GetPreferredAllocation` steers by;
    /// `gpus` the node's GPUs (their indices order the quota file's GPUs, `visible`).
    pub fn new(
        cfg: Arc<Config>,
        client: kube::Client,
        pods: Option<Store<Pod>>,
        gpus: watch::Receiver<Vec<GpuInfo>>,
    ) -> Handshake {
        let lister = SharedList::new(&cfg.pod_resources_socket, cfg.call_timeout);
        Handshake {
            cfg,
            lister,
            client,
            pods,
            gpus,
            alloc_lock: Arc::default(),
        }
    }

    /// Held while an allocation directory is made or removed (`Allocate` and the
    /// garbage collector), so that a directory is never removed as it is being reused.
    pub fn alloc_lock(&self) -> MutexGuard<'_, ()> {
        lock(&self.alloc_lock)
    }

    /// The API server client.
    pub fn client(&self) -> &kube::Client {
        &self.client
    }

    /// The plugin's configuration.
    pub fn config(&self) -> &Arc<Config> {
        &self.cfg
    }

    /// The pod watch of this node, if there is one.
    pub fn pods(&self) -> Option<&Store<Pod>> {
        self.pods.as_ref()
    }

    /// Whether the plugin's pod watch holds this pod (tests wait for it).
    pub fn watch_has(&self, namespace: &str, name: &str) -> bool {
        self.pods.as_ref().is_some_and(|s| {
            s.state().iter().any(|p| {
                p.metadata.namespace.as_deref() == Some(namespace)
                    && p.metadata.name.as_deref() == Some(name)
            })
        })
    }

    /// The devices each init container of pod `uid` last ran on on this node: the
    /// `device_ids` of its quota file, if `PreStartContainer` wrote one (the file stays
    /// until a later container of the pod reuses exactly those devices, or the pod's
    /// allocation directories are cleaned up).
    fn init_devices(&self, uid: &str) -> BTreeMap<String, BTreeSet<String>> {
        let mut out = BTreeMap::new();
        let root = self.cfg.state_dir.join("alloc");
        let Ok(entries) = std::fs::read_dir(root) else {
            return out;
        };
        for e in entries.flatten() {
            let Ok(text) = std::fs::read_to_string(e.path().join(QUOTA_FILE)) else {
                continue;
            };
            let Ok(q) = ContainerQuota::from_json(&text) else {
                continue;
            };
            if q.init && q.uid == uid {
                out.entry(q.container)
                    .or_insert_with(|| q.device_ids.into_iter().collect());
            }
        }
        out
    }

    /// The shared PodResources lister.
    pub fn lister(&self) -> &SharedList {
        &self.lister
    }

    /// The per-allocation directory of a set of device IDs, as the plugin sees it.
    pub fn allocation_dir<'a>(&self, ids: impl IntoIterator<Item = &'a str>) -> PathBuf {
        self.cfg
            .state_dir
            .join("alloc")
            .join(ids::allocation_key(ids))
    }

    async fn get_pod(&self, namespace: &str, name: &str) -> Result<Option<Pod>, HandshakeError> {
        let api: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        let api_err = |source| HandshakeError::Api {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            source,
        };
        match tokio::time::timeout(self.cfg.call_timeout, api.get_opt(name)).await {
            Ok(r) => r.map_err(api_err),
            Err(_) => Err(HandshakeError::Pod {
                namespace: namespace.to_owned(),
                name: name.to_owned(),
                reason: format!(
                    "API server did not answer within {:?}",
                    self.cfg.call_timeout
                ),
            }),
        }
    }

    /// The pod's compute policy and priority class (its annotations), refused when a
    /// value is unknown or the namespace may not ask for latency-sensitive.
    fn compute_class(
        &self,
        pod: &Pod,
        namespace: &str,
        name: &str,
    ) -> Result<(ComputePolicy, Priority), HandshakeError> {
        let pod_err = |reason: String| HandshakeError::Pod {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            reason,
        };
        let empty = BTreeMap::new();
        let annotations = pod.metadata.annotations.as_ref().unwrap_or(&empty);
        let (policy, priority) =
            parse_compute_class(annotations).map_err(|e| pod_err(e.to_string()))?;
        if priority == Priority::LatencySensitive
            && let Some(allowed) = &self.cfg.latency_sensitive_namespaces
            && !allowed.contains(namespace)
        {
            return Err(pod_err(format!(
                "{ANNOTATION_PRIORITY}: latency-sensitive is not allowed in namespace {namespace:?} (allowed: {}; --latency-sensitive-namespaces)",
                allowed.iter().cloned().collect::<Vec<_>>().join(", ")
            )));
        }
        Ok((policy, priority))
    }

    /// `PreStartContainer`: finds the container holding exactly `device_ids`, and writes
    /// its quota file into the allocation directory.
    pub async fn prestart(&self, device_ids: &[String]) -> Result<Handover, HandshakeError> {
        let ids: BTreeSet<String> = device_ids.iter().cloned().collect();
        let id_gpus =
            ids::gpus_of(ids.iter().map(String::as_str)).map_err(HandshakeError::BadId)?;
        let resp = self.lister.list().await?;
        let Found {
            namespace,
            pod: pod_name,
            exact,
        } = identify::find_pod(&ids, &listed(&resp, &self.cfg.resource_name))?;
        let pod_err = |reason: String| HandshakeError::Pod {
            namespace: namespace.clone(),
            name: pod_name.clone(),
            reason,
        };
        let pod = self
            .get_pod(&namespace, &pod_name)
            .await?
            .ok_or_else(|| pod_err("deleted from the API server".into()))?;
        let node = pod.spec.as_ref().and_then(|s| s.node_name.as_deref());
        if node != Some(self.cfg.node_name.as_str()) {
            return Err(pod_err(format!(
                "bound to {:?}, not to this node {:?}",
                node, self.cfg.node_name
            )));
        }
        if is_terminal(&pod) {
            return Err(pod_err("already terminated".into()));
        }
        let text = assignment_of(&pod).ok_or_else(|| {
            pod_err(format!(
                "no {ANNOTATION_ASSIGNMENT} annotation (not scheduled by the vgpu extender?)"
            ))
        })?;
        let assignment =
            Assignment::from_json(text).map_err(|source| HandshakeError::Assignment {
                namespace: namespace.clone(),
                name: pod_name.clone(),
                source,
            })?;
        if assignment.node != self.cfg.node_name {
            return Err(pod_err(format!(
                "assignment is for node {:?}, not {:?}",
                assignment.node, self.cfg.node_name
            )));
        }
        let (compute_policy, priority) = self.compute_class(&pod, &namespace, &pod_name)?;
        let limits = {
            let empty = BTreeMap::new();
            let annotations = pod.metadata.annotations.as_ref().unwrap_or(&empty);
            parse_memory_limits(annotations).map_err(|e| pod_err(e.to_string()))?
        };
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        let dir = self.allocation_dir(ids.iter().map(String::as_str));
        let mut pod = pod;
        let waited_since = tokio::time::Instant::now();
        // The decision is pure (`identify::decide`); this loop only re-reads the pod while
        // its status does not yet say whether an init container finished.
        let (grant, init) = loop {
            let inits = identify::init_containers(&pod);
            let prior = self.init_devices(&uid);
            match identify::decide(&assignment, &inits, exact.as_deref(), &ids, &prior) {
                Decision::Container { grant, init } => break (grant.clone(), init),
                Decision::NoGrant { container } => {
                    return Err(pod_err(format!(
                        "container {container:?} has no grant in the assignment"
                    )));
                }
                Decision::NoContainer => {
                    return Err(HandshakeError::NoContainer {
                        ids: ids.iter().cloned().collect::<Vec<_>>().join(","),
                    });
                }
                Decision::Wait { init: name } => {
                    if waited_since.elapsed() >= INIT_STATUS_WAIT {
                        return Err(HandshakeError::NotYet {
                            namespace,
                            name: pod_name,
                            reason: format!(
                                "the status of init container {name:?} does not say yet whether it finished; kubelet will retry"
                            ),
                        });
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    pod = self
                        .get_pod(&namespace, &pod_name)
                        .await?
                        .ok_or_else(|| pod_err("deleted from the API server".into()))?;
                }
            }
        };
        let assigned: Vec<(String, u32)> = {
            let mut v: Vec<(String, u32)> = grant
                .gpus
                .iter()
                .map(|g| (g.uuid.clone(), g.slices))
                .collect();
            v.sort();
            v
        };
        let same_gpus = assigned.len() == id_gpus.len()
            && assigned.iter().zip(&id_gpus).all(|(a, d)| a.0 == d.0);
        if !same_gpus {
            return Err(HandshakeError::Mismatch {
                namespace,
                name: pod_name,
                container: grant.name.clone(),
                assigned,
                devices: id_gpus,
            });
        }
        // The container sees its GPUs in node-index order (`Allocate`'s
        // CUDA_VISIBLE_DEVICES): the quota file lists them in that order.
        let order = {
            let node_gpus = self.gpus.borrow();
            visible::in_device_order(grant.gpus.iter().map(|g| g.uuid.as_str()), &node_gpus)
        };
        let mut grants: Vec<&GpuGrant> = grant.gpus.iter().collect();
        grants.sort_by_key(|g| order.iter().position(|u| *u == g.uuid));
        // The limit on each GPU (ADR 0066): the annotation's, at least the MiB the GPU
        // was granted (a request in tenths is known in MiB only here); without one, the
        // request.
        let gpus = grants
            .into_iter()
            .map(|g| {
                let limit = limits
                    .limit_mib(&grant.name, g.memory_mib)
                    .map_err(|e| pod_err(format!("{e} (on GPU {})", g.uuid)))?;
                Ok(GpuQuota {
                    uuid: g.uuid.clone(),
                    memory_mib: g.memory_mib,
                    memory_limit_mib: Some(limit),
                    compute_milli: g.compute_milli,
                    slices: g.slices,
                    compute_policy,
                    priority,
                })
            })
            .collect::<Result<Vec<_>, HandshakeError>>()?;
        let quota = ContainerQuota {
            version: QUOTA_VERSION,
            namespace: namespace.clone(),
            pod: pod_name.clone(),
            uid: uid.clone(),
            container: grant.name.clone(),
            init,
            gpus,
            device_ids: ids.iter().cloned().collect(),
        };
        let path = dir.join(QUOTA_FILE);
        write_atomic(&dir, &path, quota.to_json().as_bytes()).map_err(|source| {
            HandshakeError::Write {
                path: path.clone(),
                source,
            }
        })?;
        info!(
            pod = %format!("{namespace}/{pod_name}"),
            container = %grant.name,
            init,
            gpus = ?assigned,
            "quota handed over"
        );
        Ok(Handover { quota, path })
    }
}

fn write_atomic(dir: &Path, path: &Path, data: &[u8]) -> std::io::Result<()> {
    use std::io::Write as _;
    std::fs::create_dir_all(dir)?;
    let tmp = dir.join(format!(".{QUOTA_FILE}.tmp"));
    let mut f = std::fs::File::create(&tmp)?;
    // No fsync: readers need atomicity (the rename), not durability; after a node crash
    // the containers are gone and kubelet calls PreStartContainer again.
    f.write_all(data)?;
    drop(f);
    std::fs::rename(&tmp, path)?;
    Ok(())
}

/// Logs a refused handover (kubelet shows the message on the pod's event).
pub fn log_refusal(ids: &[String], e: &HandshakeError) {
    warn!(devices = ?ids, error = %error_chain(e), "PreStartContainer refused");
}
