//! The extender's view of the cluster (its live state): nodes' GPUs, pods'
//! assignments, bind assumptions, and the [`Ledger`] derived from them.
//!
//! Sources of truth, in order:
//! 1. **Pods from the API server** (watch). A pod counts when it is not terminal
//!    (`Succeeded`/`Failed`), carries a valid `vgpu.io/assignment` record, and is
//!    bound to the node the record names. Its grants are exactly the record's.
//! 2. **Assumptions** made by bind, for pods whose record or Binding the watch has
//!    not shown yet. One is created atomically with the decision (under the write
//!    lock, against the ledger that already holds every other assumption), so two
//!    binds can never take the same GPU share. It lives while its bind is in
//!    flight, then until the watch confirms the pod, the pod is deleted or ends, or
//!    its TTL runs out.
//! 3. **Nodes' inventories** (watch), from the device plugin's annotation
//!    [`ANNOTATION_GPU_INVENTORY`](vgpu_core::inventory::ANNOTATION_GPU_INVENTORY).
//!
//! The [`Ledger`] is derived: one entry per pod UID, from the pod if it counts,
//! else from its live assumption. A change of a node's GPU list rebuilds it (a
//! change of GPU health relabels that node in place, and a node reporting 0
//! `vgpu.io/gpu` for a moment changes nothing in it); a pod change updates only
//! that pod's entry. A restarted extender therefore rebuilds exactly the
//! same ledger from the API objects, less only the assumptions of binds that
//! never reached the API server.
//!
//! Filter and prioritize read under a shared lock; bind and watch events write
//! under the exclusive lock. Requests seen by filter are kept for a short TTL so
//! that bind (whose request carries only the pod's name and UID) knows what the
//! pod asks for without another API call.
//!
//! This file holds the state and the watches' updates of it; the verbs over it
//! (filter, prioritize, bind, preemption) are `cluster/verbs.rs`, the API objects read
//! in the ledger's terms [`super::api_objects`], filter's fast answers and reasons
//! `super::filter_reasons`.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, Pod};
use tracing::{debug, info, warn};
use vgpu_core::packing::{
    ContextReserve, Grant, Ledger, NodeSpec, Placement, Rank, Reject, Task, reuse,
};
use vgpu_core::pod_request::PodGpuRequest;
use vgpu_core::resources::{ASSIGNMENT_VERSION, Assignment, ContainerAssignment, GpuGrant};
use vgpu_core::topology::TopologyRequirement;

use super::api_objects::{
    UNHEALTHY_PREFIX, assignment_of, effective_task, node_spec, placement_from_assignment, pod_key,
    pod_request, slots_of, task_of, topology_requirement, unavailable,
};
use super::binder::BindPlan;
use super::error::ExtenderError;
use super::filter_reasons::{quick_fit, quick_reject, resolvable};
use super::names::{Located, NameIndex};
use super::policy::ExtenderPolicy;
use super::sync::WatchKind;
use super::types::{
    ExtenderArgs, ExtenderBindingArgs, ExtenderPreemptionArgs, HostPriorityRef,
    MAX_EXTENDER_PRIORITY, MetaPod, MetaVictims,
};

mod quota_check;
mod verbs;

/// Settings of the state.
#[derive(Debug, Clone)]
pub struct StateConfig {
    /// How long a bind's assumption outlives its bind without the watch
    /// confirming the pod (and how long an uncertain failed bind keeps its GPUs).
    pub assume_ttl: Duration,
    /// How long a pod's request seen by filter is remembered for its bind.
    pub pending_ttl: Duration,
    /// GPU memory reserved per CUDA context, one per slice: quotas are packed into
    /// the rest of each GPU (ADR 0012).
    pub contexts: ContextReserve,
}

impl Default for StateConfig {
    fn default() -> Self {
        Self {
            assume_ttl: Duration::from_secs(300),
            pending_ttl: Duration::from_secs(600),
            contexts: ContextReserve::default(),
        }
    }
}

/// The candidate nodes of a filter or prioritize request, by name, in request order.
#[derive(Debug, Clone, Default)]
pub struct Candidates<'a> {
    /// Node names.
    pub names: Vec<&'a str>,
}

impl<'a> Candidates<'a> {
    /// Names from `NodeNames` (node cache on) or from the `Nodes` objects (off).
    #[must_use]
    pub fn from_args(args: &'a ExtenderArgs) -> Self {
        let names = match (&args.node_names, &args.nodes) {
            (Some(names), _) => names.iter().map(String::as_str).collect(),
            (None, Some(list)) => list
                .items
                .iter()
                .map(|n| n.metadata.name.as_deref().unwrap_or(""))
                .collect(),
            (None, None) => Vec::new(),
        };
        Self { names }
    }
}

/// The verdict of filter. Nodes are indices into the candidates, in request order;
/// a reason shared by many nodes is one string.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FilterOutcome {
    /// Feasible nodes.
    pub feasible: Vec<usize>,
    /// Nodes that lack free GPU now (preemption could help), with the reason.
    pub failed: Vec<(usize, Arc<str>)>,
    /// Nodes that can never take the pod as they are (no inventory, wrong model,
    /// too few GPUs), with the reason.
    pub unresolvable: Vec<(usize, Arc<str>)>,
}

/// A pod as the watch shows it, reduced to what the ledger needs.
#[derive(Debug, Clone)]
struct PodEntry {
    key: String,
    node_name: Option<String>,
    terminal: bool,
    /// The parsed GPU request (`None`: asks for no vgpu resource).
    request: Result<Option<PodGpuRequest>, String>,
    /// The valid assignment record, if any.
    assignment: Option<Assignment>,
}

impl PodEntry {
    /// Whether the API objects alone say this pod holds GPUs.
    fn counted(&self) -> Option<&Assignment> {
        let a = self.assignment.as_ref()?;
        (!self.terminal && self.node_name.as_deref() == Some(a.node.as_str())).then_some(a)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AssumeState {
    /// The bind's API calls are in progress; never expires by time.
    InFlight,
    /// The bind returned (success, or a failure that may have taken effect);
    /// held until the watch confirms or `until`.
    Held { until: Instant },
}

#[derive(Debug, Clone)]
struct Assumption {
    key: String,
    node: String,
    task: Task,
    placement_grants: Vec<Vec<Grant>>,
    assignment: Assignment,
    state: AssumeState,
}

#[derive(Debug, Clone)]
struct NodeEntry {
    /// The node's GPUs, or why it has none we can use.
    spec: Result<NodeSpec, String>,
    /// Its index in the ledger (set by every rebuild).
    slot: Option<usize>,
    /// Whether any of its GPUs is unhealthy.
    unhealthy: bool,
    /// Why it takes no new pod right now (its pods stay accounted).
    unavailable: Option<String>,
}

impl NodeEntry {
    /// The entry as the name index keeps it.
    fn located(&self) -> Located {
        Located {
            slot: self
                .slot
                .and_then(|i| u32::try_from(i).ok())
                .unwrap_or(u32::MAX),
            ready: self.spec.is_ok()
                && self.unavailable.is_none()
                && self.slot.is_some_and(|i| u32::try_from(i).is_ok()),
            unhealthy: self.unhealthy,
        }
    }

    fn new(spec: Result<NodeSpec, String>, unavailable: Option<String>) -> Self {
        let unhealthy = spec
            .as_ref()
            .is_ok_and(|s| s.gpus.iter().any(|g| g.model.starts_with(UNHEALTHY_PREFIX)));
        Self {
            spec,
            slot: None,
            unhealthy,
            unavailable,
        }
    }
}

#[derive(Debug, Clone)]
struct Pending {
    request: PodGpuRequest,
    /// The pod's `vgpu.io/gpu-topology` requirement, re-checked at bind.
    topology: TopologyRequirement,
    until: Instant,
}

/// FNV-1a: node names are short and come from the API server (not an attacker),
/// and filter looks up every candidate, so a cheaper hash than SipHash pays.
#[derive(Debug, Clone, Copy)]
struct Fnv(u64);

impl Default for Fnv {
    fn default() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
}

impl std::hash::Hasher for Fnv {
    fn finish(&self) -> u64 {
        // FNV-1a's low bits (the table's bucket index) depend only on the input's low
        // bits, and names differing in their last characters then crowd into a few
        // probe groups with equal control bytes (a string comparison each). A
        // multiply-xorshift finaliser (splitmix64's) spreads every bit.
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
}

type FnvBuild = std::hash::BuildHasherDefault<Fnv>;

#[derive(Debug, Default)]
struct Inner {
    nodes_synced: bool,
    pods_synced: bool,
    nodes: HashMap<String, NodeEntry, FnvBuild>,
    /// `nodes` laid out for the per-candidate lookups (rebuilt with the ledger,
    /// updated in place when a node's availability or health changes).
    index: NameIndex,
    pods: HashMap<String, PodEntry>,
    assumptions: HashMap<String, Assumption>,
    ledger: Ledger,
    /// Full ledger rebuilds so far.
    rebuilds: u64,
    /// Pods whose recorded grants do not fit their node's ledger (should never
    /// happen; a sign of an inventory change or a foreign writer). Their node is
    /// refused until it clears, so that nothing is placed on top of them.
    conflicts: HashMap<String, (String, String)>,
}

/// Counters for tests, benchmarks and logs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StateStats {
    /// Nodes known (with or without a usable inventory).
    pub nodes: usize,
    /// Pods known with GPU requests or assignments.
    pub pods: usize,
    /// Pods in the ledger.
    pub placed: usize,
    /// Live assumptions.
    pub assumptions: usize,
    /// Pods whose records conflict with the ledger.
    pub conflicts: usize,
    /// Full ledger rebuilds so far (node added, removed or its GPU list changed;
    /// lists).
    pub rebuilds: u64,
}

/// The extender's state. See the module documentation.
#[derive(Debug)]
pub struct State {
    inner: RwLock<Inner>,
    pending: Mutex<HashMap<String, Pending>>,
    config: StateConfig,
    policy: ExtenderPolicy,
    /// The namespaces' quota policies (ADR 0022; checked in `cluster/quota_check.rs`).
    quota: crate::extender::quota::QuotaBook,
}

/// Why filter rejects a node.
#[derive(Debug)]
enum Why {
    /// It cannot take vgpu pods at all (unresolvable), in words.
    Unusable(String),
    /// The ledger's reason.
    Reject(Reject),
}

fn pod_entry(pod: &Pod) -> Option<(String, PodEntry)> {
    let uid = pod.metadata.uid.clone()?;
    let request = match pod_request(pod) {
        Ok(r) if r.is_empty() => Ok(None),
        Ok(r) => Ok(Some(r)),
        Err(e) => Err(super::error::error_chain(&e)),
    };
    let assignment = assignment_of(pod);
    if matches!(request, Ok(None)) && assignment.is_none() {
        return None;
    }
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    Some((
        uid,
        PodEntry {
            key: pod_key(pod),
            node_name: pod.spec.as_ref().and_then(|s| s.node_name.clone()),
            terminal: matches!(phase, Some("Succeeded" | "Failed")),
            request,
            assignment,
        },
    ))
}

impl Inner {
    fn synced(&self) -> bool {
        self.nodes_synced && self.pods_synced
    }

    /// What the ledger should hold for `uid`: the pod's record if it counts,
    /// else its live assumption.
    fn desired(&self, uid: &str) -> Option<(String, Task, Placement)> {
        if let Some(pod) = self.pods.get(uid) {
            if pod.terminal {
                return None;
            }
            if let Some(a) = pod.counted() {
                let node = self.ledger.node_index(&a.node)?;
                let spec = &self.ledger.node(node).spec;
                let request = pod.request.as_ref().ok().and_then(Option::as_ref);
                return match placement_from_assignment(node, spec, a, request) {
                    Ok((task, placement)) => Some((a.node.clone(), task, placement)),
                    Err(reason) => {
                        warn!(pod = %pod.key, node = %a.node, %reason, "assignment does not match the node");
                        None
                    }
                };
            }
        }
        let a = self.assumptions.get(uid)?;
        let node = self.ledger.node_index(&a.node)?;
        Some((
            a.node.clone(),
            a.task.clone(),
            Placement {
                node,
                containers: a.placement_grants.clone(),
            },
        ))
    }

    /// Brings the ledger entry of `uid` in line with [`Inner::desired`].
    fn reconcile(&mut self, uid: &str) {
        let want = self.desired(uid);
        let have = self.ledger.placement(uid).cloned();
        if let (Some((_, _, w)), Some(h)) = (&want, &have)
            && w == h
        {
            return;
        }
        if have.is_some() {
            let _ = self.ledger.release(uid);
        }
        self.conflicts.remove(uid);
        if let Some((node, task, placement)) = want
            && let Err(e) = self.ledger.commit(uid, &task, placement)
        {
            let key = self
                .pods
                .get(uid)
                .map(|p| p.key.clone())
                .or_else(|| self.assumptions.get(uid).map(|a| a.key.clone()))
                .unwrap_or_default();
            warn!(pod = %key, %node, error = %e, "recorded assignment conflicts with the ledger; node refused until it clears");
            self.conflicts
                .insert(uid.to_string(), (node, e.to_string()));
        }
    }

    /// Rebuilds the ledger from the nodes, pods and assumptions.
    /// Returns the tasks of every pod it placed (the workload, for the policy).
    fn rebuild(&mut self) -> Vec<Task> {
        self.rebuilds += 1;
        let mut names: Vec<String> = self.nodes.keys().cloned().collect();
        names.sort();
        let mut ledger = Ledger::new();
        for name in names {
            let Some(entry) = self.nodes.get_mut(&name) else {
                continue;
            };
            entry.slot = None;
            if let Ok(spec) = &entry.spec {
                match ledger.add_node(spec.clone()) {
                    Ok(i) => entry.slot = Some(i),
                    Err(_) => warn!(node = %name, "duplicate node in rebuild"),
                }
            }
        }
        self.ledger = ledger;
        self.index = NameIndex::build(self.nodes.iter().map(|(n, e)| (n.as_str(), e.located())));
        self.conflicts.clear();
        let mut uids: Vec<String> = self
            .pods
            .iter()
            .filter(|(_, p)| p.counted().is_some())
            .map(|(u, _)| u.clone())
            .chain(self.assumptions.keys().cloned())
            .collect();
        uids.sort();
        uids.dedup();
        let mut workload = Vec::with_capacity(uids.len());
        for uid in uids {
            // The ledger is fresh: commit what is wanted (reconcile's path, without
            // the comparison with a previous entry).
            let Some((node, task, placement)) = self.desired(&uid) else {
                continue;
            };
            match self.ledger.commit(&uid, &task, placement) {
                Ok(()) => workload.push(task),
                Err(e) => {
                    warn!(%uid, %node, error = %e, "recorded assignment conflicts with the ledger; node refused until it clears");
                    self.conflicts.insert(uid, (node, e.to_string()));
                }
            }
        }
        workload
    }

    /// The tasks of every pod the ledger holds (the workload the policy adapts to).
    fn workload(&self) -> Vec<Task> {
        let mut uids: Vec<&String> = self
            .pods
            .iter()
            .filter(|(_, p)| p.counted().is_some())
            .map(|(u, _)| u)
            .chain(self.assumptions.keys())
            .collect();
        uids.sort();
        uids.dedup();
        uids.into_iter()
            .filter_map(|u| self.desired(u).map(|(_, task, _)| task))
            .collect()
    }

    fn conflict_on(&self, node: &str) -> Option<String> {
        self.conflicts
            .values()
            .find(|(n, _)| n == node)
            .map(|(_, reason)| format!("ledger conflict: {reason}"))
    }

    /// A candidate's ledger index and health flag, or why it cannot take vgpu pods
    /// at all (unresolvable).
    fn locate(&self, name: &str) -> Result<(usize, bool), String> {
        if let Some(l) = self.index.get(name)
            && l.ready
            && (self.conflicts.is_empty() || self.conflict_on(name).is_none())
        {
            return Ok((l.slot as usize, l.unhealthy));
        }
        self.locate_slowly(name)
    }

    /// [`Inner::locate`] from the full node entry, with the reason when it fails.
    fn locate_slowly(&self, name: &str) -> Result<(usize, bool), String> {
        let Some(entry) = self.nodes.get(name) else {
            return Err("node not known to the extender (not in its node watch)".into());
        };
        if let Err(reason) = &entry.spec {
            return Err(reason.clone());
        }
        if let Some(reason) = &entry.unavailable {
            return Err(reason.clone());
        }
        if !self.conflicts.is_empty()
            && let Some(reason) = self.conflict_on(name)
        {
            return Err(reason);
        }
        let Some(i) = entry.slot else {
            return Err("node not in the ledger".into());
        };
        Ok((i, entry.unhealthy))
    }

    /// The precise verdict for one node: `Err((resolvable, reason))` when it cannot
    /// take the task.
    fn verdict(&self, name: &str, task: &Task) -> Result<(), Why> {
        let (i, unhealthy) = self.locate(name).map_err(Why::Unusable)?;
        let node = self.ledger.node(i);
        let task = effective_task(task, &node.spec, unhealthy);
        match quick_fit(node, &task) {
            Some(true) => return Ok(()),
            Some(false) => {
                if let Some(r) = quick_reject(node, &task) {
                    return Err(Why::Reject(r));
                }
            }
            None => {}
        }
        node.fit(&task).map(|_| ()).map_err(Why::Reject)
    }

    /// Whether the GPUs the task gets on a node that fits meet the pod's topology
    /// requirement (ADR 0021): the plan holds the best-connected sets.
    fn topology_verdict(
        &self,
        name: &str,
        task: &Task,
        need: TopologyRequirement,
    ) -> Result<(), Reject> {
        if need == TopologyRequirement::Any || task.gpus.iter().all(|d| d.count < 2) {
            return Ok(());
        }
        let Ok((i, unhealthy)) = self.locate(name) else {
            return Ok(()); // `verdict` said why already
        };
        let node = self.ledger.node(i);
        let task = effective_task(task, &node.spec, unhealthy);
        let plan = node.plan(&task, None)?;
        node.check_topology(&plan, need)
    }
}

impl State {
    /// An empty, unsynced state deciding with `policy`.
    #[must_use]
    pub fn new(config: StateConfig, policy: ExtenderPolicy) -> Self {
        Self {
            inner: RwLock::new(Inner::default()),
            pending: Mutex::new(HashMap::new()),
            config,
            policy,
            quota: crate::extender::quota::QuotaBook::default(),
        }
    }

    fn read(&self) -> RwLockReadGuard<'_, Inner> {
        self.inner
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn write(&self) -> RwLockWriteGuard<'_, Inner> {
        self.inner
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Rebuilds the ledger and restarts the policy over it.
    fn rebuild(&self, inner: &mut Inner) {
        let workload = inner.rebuild();
        let tasks: Vec<&Task> = workload.iter().collect();
        self.policy.reset(&inner.ledger, &tasks);
    }

    /// Restarts the policy with the typical tasks of the current workload.
    fn refresh_policy(&self, inner: &Inner) {
        let workload = inner.workload();
        let tasks: Vec<&Task> = workload.iter().collect();
        self.policy.reset(&inner.ledger, &tasks);
    }

    fn pending(&self) -> MutexGuard<'_, HashMap<String, Pending>> {
        self.pending
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether both watches have completed their first list.
    #[must_use]
    pub fn is_synced(&self) -> bool {
        self.read().synced()
    }

    /// Marks one watch's first list as complete.
    pub fn mark_synced(&self, kind: WatchKind) {
        let mut inner = self.write();
        match kind {
            WatchKind::Nodes => inner.nodes_synced = true,
            WatchKind::Pods => inner.pods_synced = true,
        }
    }

    /// Counters.
    #[must_use]
    pub fn stats(&self) -> StateStats {
        let inner = self.read();
        StateStats {
            nodes: inner.nodes.len(),
            pods: inner.pods.len(),
            placed: inner.ledger.pod_count(),
            assumptions: inner.assumptions.len(),
            conflicts: inner.conflicts.len(),
            rebuilds: inner.rebuilds,
        }
    }

    /// A copy of the ledger and the workload (the task of every pod it holds), as of
    /// now: for tests and diagnostics that compare decisions with the policy core.
    #[must_use]
    pub fn snapshot(&self) -> (Ledger, Vec<Task>) {
        let inner = self.read();
        (inner.ledger.clone(), inner.workload())
    }

    /// Free compute (milli-GPU) per GPU of a node, by device index, as the ledger sees it.
    #[must_use]
    pub fn gpu_milli_free(&self, node: &str) -> Option<Vec<u32>> {
        let inner = self.read();
        let i = inner.ledger.node_index(node)?;
        Some(inner.ledger.node(i).gpus.iter().map(|g| g.milli).collect())
    }

    /// Replaces every node (end of a list).
    pub fn replace_nodes(&self, nodes: &[Node]) {
        let mut inner = self.write();
        inner.nodes = nodes
            .iter()
            .filter_map(|n| {
                let name = n.metadata.name.clone()?;
                Some((
                    name,
                    NodeEntry::new(node_spec(n, self.config.contexts), unavailable(n)),
                ))
            })
            .collect();
        self.rebuild(&mut inner);
    }

    /// One node added or changed. The ledger is rebuilt only if its GPU list changed;
    /// a change of GPU health alone relabels the node in place.
    pub fn apply_node(&self, node: &Node) {
        let Some(name) = node.metadata.name.clone() else {
            return;
        };
        let spec = node_spec(node, self.config.contexts);
        let unavailable = unavailable(node);
        let mut inner = self.write();
        if let Some(entry) = inner.nodes.get_mut(&name)
            && entry.spec == spec
        {
            // Same GPUs: at most the availability changed; no ledger entry moves.
            entry.unavailable = unavailable;
            let located = entry.located();
            inner.index.set(&name, located);
            return;
        }
        // Only GPU health changed (an unhealthy GPU is a renamed model): relabel the
        // node in place; its pods, and every other node, stay as they are.
        if let (Some(entry), Ok(new)) = (inner.nodes.get(&name), &spec)
            && entry.spec.is_ok()
            && let Some(slot) = entry.slot
            && inner.ledger.relabel_gpus(slot, new).is_ok()
        {
            debug!(node = %name, "GPU health changed");
            let entry = NodeEntry {
                slot: Some(slot),
                ..NodeEntry::new(spec, unavailable)
            };
            let located = entry.located();
            inner.nodes.insert(name.clone(), entry);
            inner.index.set(&name, located);
            self.policy.forget_node(slot);
            return;
        }
        debug!(node = %name, usable = spec.is_ok(), "node inventory changed");
        inner.nodes.insert(name, NodeEntry::new(spec, unavailable));
        self.rebuild(&mut inner);
    }

    /// One node deleted.
    pub fn delete_node(&self, node: &Node) {
        let Some(name) = node.metadata.name.as_deref() else {
            return;
        };
        let mut inner = self.write();
        if inner.nodes.remove(name).is_some() {
            self.rebuild(&mut inner);
        }
    }

    /// Replaces every pod (end of a list). Assumptions are kept: they stand for
    /// binds the list may predate.
    pub fn replace_pods(&self, pods: &[Pod]) {
        let mut inner = self.write();
        inner.pods = pods.iter().filter_map(pod_entry).collect();
        // A pod an assumption was made for that the list shows as terminal is done.
        let done: Vec<String> = inner
            .assumptions
            .keys()
            .filter(|uid| {
                inner
                    .pods
                    .get(*uid)
                    .is_some_and(|p| p.terminal || p.counted().is_some())
            })
            .cloned()
            .collect();
        for uid in done {
            inner.assumptions.remove(&uid);
        }
        self.rebuild(&mut inner);
        info!(
            pods = inner.pods.len(),
            placed = inner.ledger.pod_count(),
            "pods replaced"
        );
    }

    /// One pod added or changed.
    pub fn apply_pod(&self, pod: &Pod) {
        let Some(uid) = pod.metadata.uid.clone() else {
            return;
        };
        let entry = pod_entry(pod);
        let mut inner = self.write();
        match entry {
            Some((_, e)) => {
                // Confirmed by the watch (or over): the assumption has served,
                // unless its bind is still in flight (finish_bind drops it then).
                if let Some(a) = inner.assumptions.get(&uid)
                    && (e.terminal || (e.counted().is_some() && a.state != AssumeState::InFlight))
                {
                    inner.assumptions.remove(&uid);
                }
                inner.pods.insert(uid.clone(), e);
            }
            None => {
                inner.pods.remove(&uid);
            }
        }
        inner.reconcile(&uid);
        drop(inner);
        if pod
            .spec
            .as_ref()
            .and_then(|s| s.node_name.as_ref())
            .is_some()
        {
            self.pending().remove(&uid);
        }
    }

    /// One pod deleted: its GPUs, assumption and pending request are released.
    pub fn delete_pod(&self, pod: &Pod) {
        let Some(uid) = pod.metadata.uid.clone() else {
            return;
        };
        let mut inner = self.write();
        inner.pods.remove(&uid);
        inner.assumptions.remove(&uid);
        inner.reconcile(&uid);
        drop(inner);
        self.pending().remove(&uid);
    }

    /// Drops assumptions and pending requests whose TTL has run out.
    pub fn expire_now(&self) {
        let now = Instant::now();
        {
            let mut inner = self.write();
            let expired: Vec<String> = inner
                .assumptions
                .iter()
                .filter(|(_, a)| matches!(a.state, AssumeState::Held { until } if until <= now))
                .map(|(uid, _)| uid.clone())
                .collect();
            for uid in expired {
                if let Some(a) = inner.assumptions.remove(&uid) {
                    info!(pod = %a.key, node = %a.node, "assumption expired without the watch confirming the pod");
                }
                inner.reconcile(&uid);
            }
        }
        {
            // The typical tasks are statistics of the workload: recomputing them
            // needs only a shared lock, so filters go on meanwhile.
            let inner = self.read();
            if self.policy.stale(inner.ledger.pod_count()) {
                self.refresh_policy(&inner);
            }
        }
        self.pending().retain(|_, p| p.until > now);
    }
}
