//! The race-free handshake (ADR 0009): which container a set of device IDs belongs to,
//! and its quota.
//!
//! Kubelet records a container's device IDs when `Allocate` returns and sends
//! `PreStartContainer` exactly those IDs, so at that point its PodResources `List` names
//! the one container holding exactly that set. The pod's assignment record (written by
//! the scheduler extender at bind) then gives that container's GPUs and quota. Nothing is
//! carried over from `Allocate`: every answer is derived from kubelet's and the API
//! server's state at the time of the call, so calls are idempotent and survive restarts.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::runtime::reflector::Store;
use tokio::sync::{oneshot, watch};
use tracing::{debug, info, warn};
use vgpu_core::container_quota::{ContainerQuota, GpuQuota, QUOTA_FILE, QUOTA_VERSION};
use vgpu_core::inventory::GpuInfo;
use vgpu_core::resources::{
    ANNOTATION_ASSIGNMENT, ANNOTATION_PRIORITY, Assignment, AssignmentError, ContainerAssignment,
    GpuGrant, parse_compute_class,
};
use vgpu_core::sched_proto::{ComputePolicy, Priority};

use crate::config::Config;
use crate::ids::{self, IdError};
use crate::kubelet::podresources::pod_resources_lister_client::PodResourcesListerClient;
use crate::kubelet::podresources::{ListPodResourcesRequest, ListPodResourcesResponse};
use crate::visible;

/// Why a container's quota could not be handed over.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    /// Kubelet's PodResources `List` failed.
    #[error("PodResources List on {socket}: {message}")]
    List {
        /// The socket.
        socket: String,
        /// gRPC status or timeout, in words.
        message: String,
    },
    /// A device ID is not one of ours.
    #[error("device IDs from kubelet")]
    BadId(#[source] IdError),
    /// No container holds these devices.
    #[error("no container on this node holds exactly the devices [{ids}]")]
    NoContainer {
        /// The IDs, comma-separated.
        ids: String,
    },
    /// More than one container claims these devices.
    #[error("devices [{ids}] are listed for several containers: {who}")]
    Ambiguous {
        /// The IDs.
        ids: String,
        /// The candidates.
        who: String,
    },
    /// Reading the pod from the API server failed.
    #[error("read pod {namespace}/{name} from the API server")]
    Api {
        /// Namespace.
        namespace: String,
        /// Name.
        name: String,
        /// kube's error.
        #[source]
        source: kube::Error,
    },
    /// The pod is not (or no longer) usable.
    #[error("pod {namespace}/{name}: {reason}")]
    Pod {
        /// Namespace.
        namespace: String,
        /// Name.
        name: String,
        /// What is wrong.
        reason: String,
    },
    /// The pod's assignment record is unreadable.
    #[error("pod {namespace}/{name}")]
    Assignment {
        /// Namespace.
        namespace: String,
        /// Name.
        name: String,
        /// The record's problem.
        #[source]
        source: AssignmentError,
    },
    /// The pod's status does not tell yet which container this is; kubelet retries.
    #[error("pod {namespace}/{name}: {reason}")]
    NotYet {
        /// Namespace.
        namespace: String,
        /// Name.
        name: String,
        /// What is not known yet.
        reason: String,
    },
    /// Kubelet's devices are on other GPUs than the assignment names.
    #[error(
        "pod {namespace}/{name} container {container:?}: assigned {assigned:?} but kubelet's devices are on {devices:?}"
    )]
    Mismatch {
        /// Namespace.
        namespace: String,
        /// Name.
        name: String,
        /// Container.
        container: String,
        /// GPUs (uuid, slices) of the assignment.
        assigned: Vec<(String, u32)>,
        /// GPUs (uuid, slices) of the device IDs.
        devices: Vec<(String, u32)>,
    },
    /// The quota file could not be written.
    #[error("write quota file {path}")]
    Write {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
}

impl HandshakeError {
    /// The gRPC status kubelet receives (the message names the pod and devices).
    pub fn to_status(&self) -> tonic::Status {
        let msg = error_chain(self);
        match self {
            HandshakeError::BadId(_) => tonic::Status::invalid_argument(msg),
            HandshakeError::NoContainer { .. } => tonic::Status::not_found(msg),
            HandshakeError::List { .. }
            | HandshakeError::Api { .. }
            | HandshakeError::NotYet { .. } => tonic::Status::unavailable(msg),
            HandshakeError::Write { .. } => tonic::Status::internal(msg),
            HandshakeError::Ambiguous { .. }
            | HandshakeError::Pod { .. }
            | HandshakeError::Assignment { .. }
            | HandshakeError::Mismatch { .. } => tonic::Status::failed_precondition(msg),
        }
    }
}

/// An error and its sources, `: `-joined.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

type ListResult = Result<Arc<ListPodResourcesResponse>, HandshakeError>;

/// Most PodResources `List` calls the plugin runs at once (kubelet allows 10 in all, for
/// every client of the node).
pub const MAX_CONCURRENT_LISTS: usize = 4;

#[derive(Debug, Default)]
struct ListState {
    running: usize,
    waiters: Vec<oneshot::Sender<ListResult>>,
    /// When the latest call started.
    last_start: Option<tokio::time::Instant>,
    /// How long calls take lately: the latest duration, or a slowly decaying maximum
    /// of the recent ones if that is longer.
    recent: Duration,
}

impl ListState {
    /// The earliest time the next call may start: calls are spread `recent / 4` apart,
    /// so that a burst of callers does not start every call back to back and then find
    /// every slot taken for a whole call's duration.
    fn next_start(&self) -> Option<tokio::time::Instant> {
        let gap = self.recent / u32::try_from(MAX_CONCURRENT_LISTS).unwrap_or(1);
        self.last_start.map(|t| t + gap)
    }

    fn finished(&mut self, took: Duration) {
        self.recent = took.max(self.recent.mul_f64(0.875));
    }
}

/// PodResources `List`, shared by concurrent callers. Every caller gets the answer of a
/// call that *started after it asked* (so a container whose devices kubelet recorded
/// before the request is in the answer). At most [`MAX_CONCURRENT_LISTS`] calls run at
/// once, and their starts are spread over the recent duration of a call (one every
/// duration / 4): every caller waiting for the next start is served by it. So a caller
/// waits at most a quarter of a call for a call to start, then that call: with kubelet's
/// worst `List` (68 ms) under 85 ms, however many callers come. Kubelet allows only 10
/// concurrent PodResources calls for all its clients; this uses at most 4.
#[derive(Debug, Clone)]
pub struct SharedList {
    socket: PathBuf,
    timeout: Duration,
    client: PodResourcesListerClient<tonic::transport::Channel>,
    state: Arc<Mutex<ListState>>,
    calls: Arc<std::sync::atomic::AtomicU64>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl SharedList {
    /// A lister of kubelet's PodResources socket (connects lazily).
    pub fn new(socket: &Path, timeout: Duration) -> SharedList {
        SharedList {
            socket: socket.to_owned(),
            timeout,
            client: PodResourcesListerClient::new(crate::kubelet::unix_channel(socket)),
            state: Arc::default(),
            calls: Arc::default(),
        }
    }

    /// How many `List` calls were made so far.
    pub fn calls(&self) -> u64 {
        self.calls.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Kubelet's answer from a `List` that started after this call.
    pub async fn list(&self) -> ListResult {
        let (tx, rx) = oneshot::channel();
        let start = {
            let mut st = lock(&self.state);
            st.waiters.push(tx);
            if st.running < MAX_CONCURRENT_LISTS {
                st.running += 1;
                true
            } else {
                false
            }
        };
        if start {
            let me = self.clone();
            tokio::spawn(async move { me.drive().await });
        }
        rx.await.unwrap_or_else(|_| {
            Err(HandshakeError::List {
                socket: self.socket.display().to_string(),
                message: "the list task ended".into(),
            })
        })
    }

    async fn drive(self) {
        loop {
            // Wait for this call's turn; callers arriving meanwhile join its batch.
            let not_before = lock(&self.state).next_start();
            if let Some(t) = not_before {
                tokio::time::sleep_until(t).await;
            }
            let batch = {
                let mut st = lock(&self.state);
                if st.waiters.is_empty() {
                    st.running -= 1;
                    return;
                }
                if st
                    .next_start()
                    .is_some_and(|t| t > tokio::time::Instant::now())
                {
                    // Another call started while this one waited: wait for the next turn.
                    continue;
                }
                st.last_start = Some(tokio::time::Instant::now());
                std::mem::take(&mut st.waiters)
            };
            let started = tokio::time::Instant::now();
            let r = self.call().await;
            lock(&self.state).finished(started.elapsed());
            for w in batch {
                let _ = w.send(match &r {
                    Ok(v) => Ok(v.clone()),
                    Err(m) => Err(HandshakeError::List {
                        socket: self.socket.display().to_string(),
                        message: m.clone(),
                    }),
                });
            }
        }
    }

    async fn call(&self) -> Result<Arc<ListPodResourcesResponse>, String> {
        self.calls
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut c = self.client.clone();
        match tokio::time::timeout(self.timeout, c.list(ListPodResourcesRequest {})).await {
            Ok(Ok(r)) => Ok(Arc::new(r.into_inner())),
            Ok(Err(s)) => Err(format!("{:?}: {}", s.code(), s.message())),
            Err(_) => Err(format!("no answer within {:?}", self.timeout)),
        }
    }
}

/// One container of kubelet's `List` with devices of our resource.
#[derive(Debug, Clone)]
struct Listed {
    namespace: String,
    pod: String,
    container: String,
    ids: BTreeSet<String>,
}

/// The allocation keys of every container kubelet lists with devices of `resource`.
pub fn listed_keys(resp: &ListPodResourcesResponse, resource: &str) -> BTreeSet<String> {
    listed(resp, resource)
        .iter()
        .map(|l| ids::allocation_key(l.ids.iter().map(String::as_str)))
        .collect()
}

fn listed(resp: &ListPodResourcesResponse, resource: &str) -> Vec<Listed> {
    let mut out = Vec::new();
    for p in &resp.pod_resources {
        for c in &p.containers {
            let ids: BTreeSet<String> = c
                .devices
                .iter()
                .filter(|d| d.resource_name == resource)
                .flat_map(|d| d.device_ids.iter().cloned())
                .collect();
            // Terminated pods stay in List without devices: skip them.
            if !ids.is_empty() {
                out.push(Listed {
                    namespace: p.namespace.clone(),
                    pod: p.name.clone(),
                    container: c.name.clone(),
                    ids,
                });
            }
        }
    }
    out
}

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
    cfg: Arc<Config>,
    lister: SharedList,
    client: kube::Client,
    pods: Option<Store<Pod>>,
    gpus: watch::Receiver<Vec<GpuInfo>>,
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

fn is_terminal(pod: &Pod) -> bool {
    matches!(
        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    )
}

fn assignment_of(pod: &Pod) -> Option<&str> {
    pod.metadata
        .annotations
        .as_ref()?
        .get(ANNOTATION_ASSIGNMENT)
        .map(String::as_str)
}

fn total_slices(c: &ContainerAssignment) -> u32 {
    c.gpus.iter().map(|g| g.slices).sum()
}

/// How long `PreStartContainer` waits for the pod status to tell whether an init
/// container finished, when the same devices serve it and then an app container.
pub const INIT_STATUS_WAIT: Duration = Duration::from_secs(2);

/// An init container's state per the pod's status in the API server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum InitState {
    /// Finished successfully (or the pod is `Initialized`).
    Done,
    /// Its last run failed: kubelet will run it again.
    Failed,
    /// Not started, running, or the status does not say.
    Unknown,
}

fn init_state(pod: &Pod, name: &str) -> InitState {
    let initialized = pod
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| {
            cs.iter()
                .any(|c| c.type_ == "Initialized" && c.status == "True")
        });
    if initialized {
        return InitState::Done;
    }
    let Some(st) = pod
        .status
        .as_ref()
        .and_then(|s| s.init_container_statuses.as_ref())
        .and_then(|ss| ss.iter().find(|s| s.name == name))
    else {
        return InitState::Unknown;
    };
    match st.state.as_ref() {
        Some(s) if s.terminated.as_ref().is_some_and(|t| t.exit_code == 0) => InitState::Done,
        Some(s) if s.terminated.is_some() => InitState::Failed,
        Some(s)
            if s.waiting.is_some()
                && st
                    .last_state
                    .as_ref()
                    .and_then(|l| l.terminated.as_ref())
                    .is_some_and(|t| t.exit_code != 0) =>
        {
            InitState::Failed
        }
        _ => InitState::Unknown,
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

    /// The devices init container `name` of pod `uid` last ran on on this node: the
    /// `device_ids` of its quota file, if `PreStartContainer` wrote one (the file stays
    /// until a later container of the pod reuses exactly those devices, or the pod's
    /// allocation directories are cleaned up).
    fn init_devices(&self, uid: &str, name: &str) -> Option<BTreeSet<String>> {
        let root = self.cfg.state_dir.join("alloc");
        std::fs::read_dir(root).ok()?.flatten().find_map(|e| {
            let text = std::fs::read_to_string(e.path().join(QUOTA_FILE)).ok()?;
            let q = ContainerQuota::from_json(&text).ok()?;
            (q.init && q.uid == uid && q.container == name)
                .then(|| q.device_ids.into_iter().collect())
        })
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
        let ids_text = ids.iter().cloned().collect::<Vec<_>>().join(",");
        let id_gpus =
            ids::gpus_of(ids.iter().map(String::as_str)).map_err(HandshakeError::BadId)?;
        let resp = self.lister.list().await?;
        let all = listed(&resp, &self.cfg.resource_name);
        let exact: Vec<&Listed> = all.iter().filter(|l| l.ids == ids).collect();
        let (namespace, pod_name, exact_container) = match exact.as_slice() {
            [one] => (
                one.namespace.clone(),
                one.pod.clone(),
                Some(one.container.clone()),
            ),
            [] => {
                // An init container: kubelet 1.28 does not list them. Its devices are
                // reused by the pod's app containers, so an overlap names the pod.
                let pods: BTreeSet<(&str, &str)> = all
                    .iter()
                    .filter(|l| !l.ids.is_disjoint(&ids))
                    .map(|l| (l.namespace.as_str(), l.pod.as_str()))
                    .collect();
                match pods.len() {
                    1 => {
                        let (ns, p) = pods.into_iter().next().expect("one element");
                        (ns.to_owned(), p.to_owned(), None)
                    }
                    0 => return Err(HandshakeError::NoContainer { ids: ids_text }),
                    _ => {
                        return Err(HandshakeError::Ambiguous {
                            ids: ids_text,
                            who: pods
                                .iter()
                                .map(|(n, p)| format!("{n}/{p}"))
                                .collect::<Vec<_>>()
                                .join(", "),
                        });
                    }
                }
            }
            many => {
                return Err(HandshakeError::Ambiguous {
                    ids: ids_text,
                    who: many
                        .iter()
                        .map(|l| format!("{}/{}:{}", l.namespace, l.pod, l.container))
                        .collect::<Vec<_>>()
                        .join(", "),
                });
            }
        };
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
        // Init containers in spec order, and whether each is a sidecar
        // (`restartPolicy: Always`: it keeps running and never shares its devices).
        let spec_init: Vec<(String, bool)> = pod
            .spec
            .as_ref()
            .and_then(|s| s.init_containers.as_ref())
            .map(|v| {
                v.iter()
                    .map(|c| {
                        (
                            c.name.clone(),
                            c.restart_policy.as_deref() == Some("Always"),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        let n = u32::try_from(ids.len()).unwrap_or(u32::MAX);
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        let dir = self.allocation_dir(ids.iter().map(String::as_str));
        let mut pod = pod;
        let waited_since = tokio::time::Instant::now();
        let (grant, init) = loop {
            // Kubelet starts init containers one by one, in order, before any app
            // container, and reuses their devices later. So, in spec order, an init
            // container of this size that is not done is this call's when it never
            // started (the devices it ran on are in its quota file), or when it ran on
            // exactly these devices and its status says it failed (kubelet re-runs it);
            // when it ran on them and its status does not say yet, the call is either its
            // re-run or the next container on its devices: wait for the status. An init
            // container that ran on other devices is not this call's.
            let mut decided = None;
            let mut unsure = None;
            let exact_is_init = exact_container
                .as_ref()
                .is_some_and(|c| spec_init.iter().any(|(i, _)| i == c));
            if !exact_is_init {
                for (name, sidecar) in &spec_init {
                    let Some(a) = assignment.container(name) else {
                        continue;
                    };
                    let state = init_state(&pod, name);
                    if total_slices(a) != n || (state == InitState::Done && !sidecar) {
                        continue;
                    }
                    match self.init_devices(&uid, name) {
                        None => {
                            decided = Some(a);
                            break;
                        }
                        Some(prior) if prior == ids => {
                            // A sidecar's devices are never handed to another container.
                            if *sidecar || state == InitState::Failed {
                                decided = Some(a);
                            } else {
                                unsure = Some(name.clone());
                            }
                            break;
                        }
                        Some(_) => {}
                    }
                }
            }
            match (decided, unsure, &exact_container) {
                (Some(a), _, _) => break (a.clone(), true),
                (None, Some(name), _) => {
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
                (None, None, Some(c)) => {
                    break (
                        assignment.container(c).cloned().ok_or_else(|| {
                            pod_err(format!("container {c:?} has no grant in the assignment"))
                        })?,
                        exact_is_init,
                    );
                }
                (None, None, None) => {
                    return Err(HandshakeError::NoContainer { ids: ids_text });
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
        let quota = ContainerQuota {
            version: QUOTA_VERSION,
            namespace: namespace.clone(),
            pod: pod_name.clone(),
            uid: uid.clone(),
            container: grant.name.clone(),
            init,
            gpus: grants
                .into_iter()
                .map(|g| GpuQuota {
                    uuid: g.uuid.clone(),
                    memory_mib: g.memory_mib,
                    compute_milli: g.compute_milli,
                    slices: g.slices,
                    compute_policy,
                    priority,
                })
                .collect(),
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

    /// `GetPreferredAllocation` for one container: steer kubelet towards the GPUs that
    /// the extender assigned to a container still waiting for devices, else pack.
    ///
    /// This is only a preference: it makes kubelet's ledger name the assigned GPUs.
    /// Correctness does not depend on it: `PreStartContainer` identifies the container
    /// by kubelet's record and refuses devices on other GPUs than its assignment.
    pub async fn preferred(
        &self,
        available: &[String],
        must_include: &[String],
        size: usize,
    ) -> Vec<String> {
        if let Some(ids) = self.steer(available, must_include, size).await {
            return ids;
        }
        pack(available, must_include, size)
    }

    async fn steer(
        &self,
        available: &[String],
        must: &[String],
        size: usize,
    ) -> Option<Vec<String>> {
        let store = self.pods.as_ref()?;
        let resp = match self.lister.list().await {
            Ok(r) => r,
            Err(e) => {
                debug!(error = %error_chain(&e), "no steering: List failed");
                return None;
            }
        };
        let all = listed(&resp, &self.cfg.resource_name);
        let in_list: BTreeSet<(&str, &str)> = resp
            .pod_resources
            .iter()
            .map(|p| (p.namespace.as_str(), p.name.as_str()))
            .collect();
        let mut pods = store.state();
        pods.sort_by(|a, b| {
            a.metadata
                .creation_timestamp
                .cmp(&b.metadata.creation_timestamp)
                .then_with(|| a.metadata.name.cmp(&b.metadata.name))
        });
        for pod in pods {
            let ns = pod.metadata.namespace.as_deref().unwrap_or("default");
            let name = pod.metadata.name.as_deref().unwrap_or("");
            if !in_list.contains(&(ns, name)) || is_terminal(&pod) {
                continue;
            }
            if pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) != Some(&self.cfg.node_name) {
                continue;
            }
            let Some(a) = assignment_of(&pod).and_then(|t| Assignment::from_json(t).ok()) else {
                continue;
            };
            let have: BTreeSet<&str> = all
                .iter()
                .filter(|l| l.namespace == ns && l.pod == name)
                .map(|l| l.container.as_str())
                .collect();
            let Some(spec) = pod.spec.as_ref() else {
                continue;
            };
            // Init containers are never listed (kubelet 1.28); they wait for devices only
            // while no app container of the pod has any.
            let inits = spec
                .init_containers
                .iter()
                .flatten()
                .filter(|_| have.is_empty())
                .map(|c| c.name.as_str());
            let order: Vec<&str> = inits
                .chain(spec.containers.iter().map(|c| c.name.as_str()))
                .collect();
            for cname in order {
                if have.contains(cname) {
                    continue;
                }
                let Some(g) = a.container(cname) else {
                    continue;
                };
                if total_slices(g) as usize != size {
                    continue;
                }
                if let Some(ids) = pick(g, available, must) {
                    debug!(pod = %format!("{ns}/{name}"), container = cname, "steered preferred allocation");
                    return Some(ids);
                }
            }
        }
        None
    }
}

/// Device IDs on exactly the grant's GPUs (its slices on each), `must` first.
fn pick(g: &ContainerAssignment, available: &[String], must: &[String]) -> Option<Vec<String>> {
    let mut out = Vec::new();
    for grant in &g.gpus {
        let on_gpu = |id: &&String| ids::parse_device_id(id).is_ok_and(|(u, _)| u == grant.uuid);
        let mut take: Vec<&String> = must.iter().filter(on_gpu).collect();
        let mut rest: Vec<&String> = available
            .iter()
            .filter(on_gpu)
            .filter(|id| !must.contains(id))
            .collect();
        rest.sort_by_key(|id| ids::parse_device_id(id).map(|(_, s)| s).unwrap_or(u32::MAX));
        take.extend(rest);
        if take.len() < grant.slices as usize {
            return None;
        }
        out.extend(take.into_iter().take(grant.slices as usize).cloned());
    }
    if !must.iter().all(|m| out.contains(m)) {
        return None;
    }
    Some(out)
}

/// Fallback: `must` first, then fill from the GPU with the fewest free slots that can
/// take the rest (packing), else from the GPUs with the most free slots.
pub fn pack(available: &[String], must: &[String], size: usize) -> Vec<String> {
    let mut out: Vec<String> = must.iter().take(size).cloned().collect();
    let mut by_gpu: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for id in available {
        if out.contains(id) {
            continue;
        }
        if let Ok((u, _)) = ids::parse_device_id(id) {
            by_gpu.entry(u.to_owned()).or_default().push(id.clone());
        }
    }
    for v in by_gpu.values_mut() {
        v.sort_by_key(|id| ids::parse_device_id(id).map(|(_, s)| s).unwrap_or(u32::MAX));
    }
    let need = size.saturating_sub(out.len());
    let mut gpus: Vec<(String, Vec<String>)> = by_gpu.into_iter().collect();
    if let Some((_, v)) = gpus
        .iter()
        .filter(|(_, v)| v.len() >= need)
        .min_by_key(|(_, v)| v.len())
    {
        out.extend(v.iter().take(need).cloned());
        return out;
    }
    gpus.sort_by_key(|(_, v)| std::cmp::Reverse(v.len()));
    for (_, v) in gpus {
        for id in v {
            if out.len() >= size {
                return out;
            }
            out.push(id);
        }
    }
    out
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

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn pack_prefers_the_tightest_gpu_and_honours_must() {
        let avail = ids(&["GPU-a-0", "GPU-a-1", "GPU-a-2", "GPU-b-5", "GPU-b-6"]);
        assert_eq!(pack(&avail, &[], 2), ids(&["GPU-b-5", "GPU-b-6"]));
        assert_eq!(
            pack(&avail, &[], 3),
            ids(&["GPU-a-0", "GPU-a-1", "GPU-a-2"])
        );
        assert_eq!(
            pack(&avail, &ids(&["GPU-a-2"]), 2),
            ids(&["GPU-a-2", "GPU-a-0"])
        );
        assert_eq!(pack(&avail, &[], 5).len(), 5);
    }

    #[test]
    fn pick_takes_the_granted_slices_of_each_gpu() {
        let g = ContainerAssignment {
            name: "c".into(),
            gpus: vec![GpuGrant {
                uuid: "GPU-b".into(),
                compute_milli: 200,
                memory_mib: 100,
                slices: 2,
            }],
        };
        let avail = ids(&["GPU-a-0", "GPU-b-7", "GPU-b-3", "GPU-b-4"]);
        assert_eq!(pick(&g, &avail, &[]), Some(ids(&["GPU-b-3", "GPU-b-4"])));
        assert_eq!(pick(&g, &avail, &ids(&["GPU-a-0"])), None);
        assert_eq!(pick(&g, &ids(&["GPU-b-3"]), &[]), None);
    }
}
