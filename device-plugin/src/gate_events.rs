//! Posts the node daemon's enforcement events to Kubernetes (docs/ebpf.md, ADR 0055): a
//! `Warning` event `VgpuGpuOpenRefused` on the pod of each process the eBPF GPU device
//! gate refused; `VgpuGpuMemoryKilled` / `VgpuGpuMemoryRefused` / `VgpuGpuMemoryOverQuota`
//! on the pod of each process the second line acted on (memory over quota, a second
//! driver), naming the process, the figures and the reason; and `VgpuEbpfNotEnforcing` on
//! the node when `--ebpf enforce` could not be delivered. The plugin follows the daemon's
//! `WatchEnforcementEvents` stream on the daemon's **API** socket (root only, never
//! mounted into a container: the shims' socket is, and the stream names other pods'
//! processes), resolves the event's pod UID and container id through its pod watch, and
//! posts one event per (pod, process, what) — a process retrying its open a thousand times
//! is one event, not a flood. When the daemon restarts (or is not there yet) it reconnects,
//! waiting 100 ms, doubling up to 5 s; events the new daemon replays are not posted twice.
//! Every event is named from what identifies it — a refusal from its pod, container and
//! process, a second-line action from its pod, action, process and the daemon's time of
//! it, the node's from the daemon's time — so a replay after the plugin itself restarts
//! meets the posted one (409 AlreadyExists) instead of making a second.

use std::collections::{HashSet, VecDeque};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use k8s_openapi::api::core::v1::{Event, Pod};
use kube::Api;
use kube::api::PostParams;
use tonic::transport::Endpoint;
use tracing::{info, warn};

use crate::audit::{Owner, pod_event};
use crate::error::error_chain;
use crate::handshake::Handshake;

use crate::kubelet::daemon_v1;

use daemon_v1::daemon_client::DaemonClient;

/// The event reason posted on a pod one of whose processes the gate refused.
pub const EVENT_REFUSED: &str = "VgpuGpuOpenRefused";
/// The second line killed a process of the pod (`--memory-enforce kill`).
pub const EVENT_MEMORY_KILLED: &str = "VgpuGpuMemoryKilled";
/// The second line withdrew a process's admission at the gate (`--memory-enforce refuse`).
pub const EVENT_MEMORY_REFUSED: &str = "VgpuGpuMemoryRefused";
/// The second line found a process over quota and only reported it (`report`).
pub const EVENT_MEMORY_OVER: &str = "VgpuGpuMemoryOverQuota";
/// Posted on the node: `--ebpf enforce` asked for, the gate not attached.
pub const EVENT_NOT_ENFORCING: &str = "VgpuEbpfNotEnforcing";
/// (pod, process) pairs remembered as posted; beyond, the oldest are forgotten.
const REMEMBERED: usize = 4096;
/// Waits between reconnections: from the first to the longest, doubling.
const BACKOFF: (Duration, Duration) = (Duration::from_millis(100), Duration::from_secs(5));

/// What the follower has done, for tests and metrics.
#[derive(Debug, Default, Clone)]
pub struct GateWatchState {
    /// Subscribed to the daemon's stream now.
    pub connected: bool,
    /// Subscriptions made so far (1 + reconnections).
    pub subscriptions: u64,
    /// Refusals received (every one, repeated or not).
    pub refusals: u64,
    /// Events posted on pods.
    pub posted: u64,
    /// Second-line actions received (every one, replayed or not).
    pub memory_actions: u64,
    /// Second-line events posted on pods.
    pub memory_posted: u64,
    /// Not-enforcing events posted on the node.
    pub node_posted: u64,
    /// Events the API server already had (posted before a restart of the plugin).
    pub already_posted: u64,
    /// Events the daemon dropped for this subscriber (it read too slowly).
    pub lost: u64,
}

/// What was posted: (pod UID, process, the event's reason), oldest first; the node's
/// events use the node's name and the daemon's time of the event.
type PostedKey = (String, u64, &'static str);

#[derive(Debug, Default)]
struct Posted {
    set: HashSet<PostedKey>,
    order: VecDeque<PostedKey>,
}

impl Posted {
    /// Whether the key is new (and remembers it).
    fn insert(&mut self, key: PostedKey) -> bool {
        if !self.set.insert(key.clone()) {
            return false;
        }
        self.order.push_back(key);
        if self.order.len() > REMEMBERED
            && let Some(old) = self.order.pop_front()
        {
            self.set.remove(&old);
        }
        true
    }
}

/// Follows the daemon's event stream on `socket` until the task is dropped, posting one
/// `Warning` event per refused (pod, process).
pub async fn follow(hs: Handshake, socket: PathBuf, state: Arc<Mutex<GateWatchState>>) {
    let mut posted = Posted::default();
    let mut wait = BACKOFF.0;
    let mut last_trouble = String::new();
    loop {
        match subscribe(&socket).await {
            Ok(mut stream) => {
                info!(socket = %socket.display(), "following the daemon's eBPF gate events");
                wait = BACKOFF.0;
                last_trouble.clear();
                {
                    let mut st = lock(&state);
                    st.connected = true;
                    st.subscriptions += 1;
                }
                let end = loop {
                    match stream.message().await {
                        Ok(Some(e)) => on_event(&hs, &e, &mut posted, &state).await,
                        Ok(None) => break "the daemon ended the stream".to_owned(),
                        Err(s) => break format!("the stream broke: {}", s.message()),
                    }
                };
                lock(&state).connected = false;
                info!(socket = %socket.display(), "{end}; reconnecting");
            }
            Err(why) => {
                if why != last_trouble {
                    warn!(socket = %socket.display(), "cannot follow the daemon's eBPF gate events (retrying): {why}");
                    last_trouble = why;
                }
            }
        }
        tokio::time::sleep(wait).await;
        wait = (wait * 2).min(BACKOFF.1);
    }
}

async fn subscribe(
    socket: &std::path::Path,
) -> Result<tonic::Streaming<daemon_v1::EnforcementEvent>, String> {
    let path = socket.to_owned();
    // The URI is required by tonic but never resolved: the connector dials the socket.
    let ch = Endpoint::from_static("http://localhost")
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let path = path.clone();
            async move {
                tokio::net::UnixStream::connect(path)
                    .await
                    .map(TokioIo::new)
            }
        }))
        .await
        .map_err(|e| format!("connect: {}", error_chain(&e)))?;
    DaemonClient::new(ch)
        .watch_enforcement_events(daemon_v1::WatchEnforcementEventsRequest {
            follow: true,
            recent: u32::MAX,
        })
        .await
        .map(tonic::Response::into_inner)
        .map_err(|s| format!("{} ({:?})", s.message(), s.code()))
}

async fn on_event(
    hs: &Handshake,
    e: &daemon_v1::EnforcementEvent,
    posted: &mut Posted,
    state: &Mutex<GateWatchState>,
) {
    lock(state).lost += e.lost_before;
    match daemon_v1::EnforcementEventKind::try_from(e.kind) {
        Ok(daemon_v1::EnforcementEventKind::Refused) => on_refused(hs, e, posted, state).await,
        Ok(daemon_v1::EnforcementEventKind::Memory) => on_memory(hs, e, posted, state).await,
        Ok(daemon_v1::EnforcementEventKind::NotEnforcing) => {
            on_not_enforcing(hs, e, posted, state).await;
        }
        _ => {}
    }
}

async fn on_refused(
    hs: &Handshake,
    e: &daemon_v1::EnforcementEvent,
    posted: &mut Posted,
    state: &Mutex<GateWatchState>,
) {
    lock(state).refusals += 1;
    let make = |owner: &Owner, node: &str| refused_event(e, owner, node);
    if post_on_pod(hs, e, EVENT_REFUSED, posted, state, make).await {
        lock(state).posted += 1;
    }
}

async fn on_memory(
    hs: &Handshake,
    e: &daemon_v1::EnforcementEvent,
    posted: &mut Posted,
    state: &Mutex<GateWatchState>,
) {
    lock(state).memory_actions += 1;
    let Some(a) = &e.second_line else {
        return;
    };
    let make = |owner: &Owner, node: &str| memory_event(e, a, owner, node);
    if post_on_pod(hs, e, memory_reason(&a.action), posted, state, make).await {
        lock(state).memory_posted += 1;
    }
}

/// Posts the event `make` builds (from the pod's owner and the node's name) on the pod of
/// `e`, once per (pod, process, `reason`): `true` when the API server created it. Outside
/// pods there is nobody to tell (the daemon's log and metrics have it).
async fn post_on_pod(
    hs: &Handshake,
    e: &daemon_v1::EnforcementEvent,
    reason: &'static str,
    posted: &mut Posted,
    state: &Mutex<GateWatchState>,
    make: impl FnOnce(&Owner, &str) -> Event,
) -> bool {
    if e.pod_uid.is_empty() || !posted.insert((e.pod_uid.clone(), u64::from(e.tgid), reason)) {
        return false;
    }
    let Some(owner) = owner_of(hs, e) else {
        warn!(pod_uid = %e.pod_uid, pid = e.tgid, "{reason} for a pod this node's watch does not have");
        return false;
    };
    let ev = make(&owner, &hs.config().node_name);
    let created = post(hs, &owner.namespace, ev, state).await == Some(true);
    if created {
        info!(pod = %format!("{}/{}", owner.namespace, owner.pod), pid = e.tgid, comm = %e.comm, "posted {reason}");
    }
    created
}

async fn on_not_enforcing(
    hs: &Handshake,
    e: &daemon_v1::EnforcementEvent,
    posted: &mut Posted,
    state: &Mutex<GateWatchState>,
) {
    let Some(n) = &e.not_enforcing else {
        return;
    };
    let node = &hs.config().node_name;
    if !posted.insert((node.clone(), e.time_unix_ms, EVENT_NOT_ENFORCING)) {
        return;
    }
    let ev = not_enforcing_event(e, n, node);
    if post(hs, NODE_EVENT_NAMESPACE, ev, state).await == Some(true) {
        lock(state).node_posted += 1;
        warn!(node = %node, reason = %n.reason, "posted {EVENT_NOT_ENFORCING} on the node");
    }
}

/// Posts `ev` in `namespace`: `Some(true)` when created, `Some(false)` when the API server
/// already had it (a replay after a restart of the plugin), `None` when it failed (logged).
async fn post(
    hs: &Handshake,
    namespace: &str,
    ev: Event,
    state: &Mutex<GateWatchState>,
) -> Option<bool> {
    let api: Api<Event> = Api::namespaced(hs.client().clone(), namespace);
    match api.create(&PostParams::default(), &ev).await {
        Ok(_) => Some(true),
        Err(kube::Error::Api(s)) if s.code == 409 => {
            lock(state).already_posted += 1;
            Some(false)
        }
        Err(err) => {
            warn!(error = %error_chain(&err), "could not post the event");
            None
        }
    }
}

/// Where node events go (as kubelet's: `kubectl describe node` looks there).
const NODE_EVENT_NAMESPACE: &str = "default";

/// The event reason for a second-line `action`.
pub fn memory_reason(action: &str) -> &'static str {
    match action {
        "kill" => EVENT_MEMORY_KILLED,
        "refuse" => EVENT_MEMORY_REFUSED,
        _ => EVENT_MEMORY_OVER,
    }
}

/// The pod (from the watch, by UID) and container (by the id in its status, else the
/// daemon's name for it) of an event.
fn owner_of(hs: &Handshake, e: &daemon_v1::EnforcementEvent) -> Option<Owner> {
    let pod: Arc<Pod> = hs
        .pods()?
        .state()
        .into_iter()
        .find(|p| p.metadata.uid.as_deref() == Some(e.pod_uid.as_str()))?;
    let container = pod
        .status
        .as_ref()
        .and_then(|s| {
            let all = s.container_statuses.iter().flatten();
            let init = s.init_container_statuses.iter().flatten();
            all.chain(init).find(|c| {
                !e.container_id.is_empty()
                    && c.container_id
                        .as_deref()
                        .and_then(|id| id.rsplit_once("://"))
                        .is_some_and(|(_, id)| id == e.container_id)
            })
        })
        .map_or_else(|| e.container.clone(), |c| c.name.clone());
    Some(Owner {
        namespace: pod.metadata.namespace.clone().unwrap_or_default(),
        pod: pod.metadata.name.clone().unwrap_or_default(),
        uid: e.pod_uid.clone(),
        container,
    })
}

fn refused_event(e: &daemon_v1::EnforcementEvent, owner: &Owner, node: &str) -> Event {
    let container = if owner.container.is_empty() {
        String::new()
    } else {
        format!(" of container {:?}", owner.container)
    };
    let message = format!(
        "process {} ({}){container} was refused access to GPU device {}:{}: it did not register through the vgpu shim (static binary, musl image, LD_PRELOAD removed, or the driver loaded by path); the node's eBPF gate enforces",
        e.tgid, e.comm, e.device_major, e.device_minor
    );
    let name = refused_event_name(&owner.pod, &e.container_id, e.tgid);
    named(pod_event(owner, EVENT_REFUSED, message, node), name)
}

/// `<pod>.vgpu-refused-<container id, 12>-<pid>` (`…-refused-<pid>` without a container
/// id): one name per refused process, however often it retries and whatever the daemon
/// still keeps of its refusals (a name with the time of one would differ when the first
/// refusal has left the daemon's recent events). The container id tells apart a process
/// of a restarted container that got the same host PID.
fn refused_event_name(pod: &str, container_id: &str, pid: u32) -> String {
    let id: String = container_id
        .chars()
        .filter(|c| c.is_ascii_hexdigit())
        .map(|c| c.to_ascii_lowercase())
        .take(12)
        .collect();
    if id.is_empty() {
        format!("{pod}.vgpu-refused-{pid}")
    } else {
        format!("{pod}.vgpu-refused-{id}-{pid}")
    }
}

/// `ev` under `name` instead of a generated one.
fn named(mut ev: Event, name: String) -> Event {
    ev.metadata.generate_name = None;
    ev.metadata.name = Some(name);
    ev
}

/// The pod event of a second-line action, named from what identifies it (replay-safe).
fn memory_event(
    e: &daemon_v1::EnforcementEvent,
    a: &daemon_v1::SecondLineAction,
    owner: &Owner,
    node: &str,
) -> Event {
    let reason = memory_reason(&a.action);
    let container = if owner.container.is_empty() {
        String::new()
    } else {
        format!(" of container {:?}", owner.container)
    };
    let done = match (a.killed, a.refused_at_gate) {
        (true, true) => "killed (SIGKILL) and refused further GPU access",
        (true, false) => "killed (SIGKILL)",
        (false, true) => "refused further GPU access",
        (false, false) if a.action == "report" => "reported (--memory-enforce report)",
        (false, false) => "to be acted on, but the action failed (see the node daemon's log)",
    };
    let mib = |b: u64| b >> 20;
    let message = format!(
        "process {} ({}){container} was {done} by the node's GPU memory second line: {}; it held {} MiB on GPU {}, its container {} MiB against a quota of {} MiB (limit {} MiB with context allowances) for {} ms",
        e.tgid,
        e.comm,
        a.reason,
        mib(a.process_held_bytes),
        a.gpu_uuid,
        mib(a.held_bytes),
        mib(a.quota_bytes),
        mib(a.limit_bytes),
        a.over_ms
    );
    let name = event_name(&owner.pod, &a.action, e.tgid, e.time_unix_ms);
    named(pod_event(owner, reason, message, node), name)
}

/// `<pod>.vgpu-<action>-<pid>-<ms>`: one name per action of the daemon (a DNS subdomain:
/// pod names are, and the rest is lower-case letters, digits and dashes).
fn event_name(pod: &str, action: &str, pid: u32, unix_ms: u64) -> String {
    let action: String = action
        .chars()
        .filter(|c| c.is_ascii_lowercase())
        .take(16)
        .collect();
    format!("{pod}.vgpu-{action}-{pid}-{unix_ms}")
}

/// The node event of enforce not delivered (as kubelet's node events: namespace
/// `default`, the node's name as its UID).
fn not_enforcing_event(
    e: &daemon_v1::EnforcementEvent,
    n: &daemon_v1::NotEnforcing,
    node: &str,
) -> Event {
    use k8s_openapi::api::core::v1::{EventSource, ObjectReference};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
    let now = Time(k8s_openapi::jiff::Timestamp::now());
    let then = if n.fail_closed {
        "failing closed: the node agent is not Ready and new GPU tenants are refused until the gate attaches"
    } else {
        "serving without it (--ebpf-enforce-fallback serve): processes without the shim are not refused"
    };
    Event {
        metadata: ObjectMeta {
            name: Some(format!("{node}.vgpu-not-enforcing-{}", e.time_unix_ms)),
            namespace: Some(NODE_EVENT_NAMESPACE.to_owned()),
            ..Default::default()
        },
        involved_object: ObjectReference {
            kind: Some("Node".into()),
            name: Some(node.to_owned()),
            uid: Some(node.to_owned()),
            ..Default::default()
        },
        reason: Some(EVENT_NOT_ENFORCING.into()),
        type_: Some("Warning".into()),
        message: Some(format!(
            "--ebpf {} was asked for and the GPU device gate is not attached: {}; {then}",
            n.mode, n.reason
        )),
        source: Some(EventSource {
            component: Some("vgpu-device-plugin".into()),
            host: Some(node.to_owned()),
        }),
        first_timestamp: Some(now.clone()),
        last_timestamp: Some(now),
        count: Some(1),
        ..Default::default()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_pod_and_process_is_posted_once_and_the_memory_is_bounded() {
        let mut p = Posted::default();
        assert!(p.insert(("a".into(), 1, EVENT_REFUSED)));
        assert!(!p.insert(("a".into(), 1, EVENT_REFUSED)));
        assert!(p.insert(("b".into(), 1, EVENT_REFUSED)));
        assert!(
            p.insert(("a".into(), 1, EVENT_MEMORY_KILLED)),
            "another action"
        );
        for pid in 0..REMEMBERED as u64 {
            p.insert(("c".into(), pid, EVENT_REFUSED));
        }
        assert_eq!(p.set.len(), REMEMBERED);
        assert!(
            p.insert(("a".into(), 1, EVENT_REFUSED)),
            "the oldest was forgotten"
        );
    }

    #[test]
    fn a_second_line_event_is_named_from_what_identifies_it() {
        assert_eq!(
            event_name("trainer-0", "kill", 4242, 1_795_703_401_005),
            "trainer-0.vgpu-kill-4242-1795703401005"
        );
        assert_eq!(event_name("p", "Re-fuse!", 1, 2), "p.vgpu-efuse-1-2");
        assert_eq!(memory_reason("kill"), EVENT_MEMORY_KILLED);
        assert_eq!(memory_reason("refuse"), EVENT_MEMORY_REFUSED);
        assert_eq!(memory_reason("report"), EVENT_MEMORY_OVER);
    }

    #[test]
    fn a_refusal_is_named_from_its_pod_container_and_process() {
        let id = "C0FFEE00D15EA5E0000000000000000000000000000000000000000000000013";
        assert_eq!(
            refused_event_name("escaper", id, 4242),
            "escaper.vgpu-refused-c0ffee00d15e-4242"
        );
        assert_eq!(
            refused_event_name("escaper", "", 4242),
            "escaper.vgpu-refused-4242"
        );
    }
}
