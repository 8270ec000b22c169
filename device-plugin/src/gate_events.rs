//! Posts a `Warning` event `VgpuGpuOpenRefused` on the pod of each process the node
//! daemon's eBPF GPU device gate refused (docs/ebpf.md): the plugin follows the daemon's
//! `WatchEnforcementEvents` stream on the daemon's **API** socket (root only, never
//! mounted into a container: the shims' socket is, and the stream names other pods'
//! processes), resolves the event's pod UID and container id through its pod watch, and
//! posts one event per (pod, process) — a process retrying its open a thousand times is
//! one event, not a flood. When the daemon restarts (or is not there yet) it reconnects,
//! waiting 100 ms, doubling up to 5 s; events the new daemon replays are not posted twice.

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
    /// Events the daemon dropped for this subscriber (it read too slowly).
    pub lost: u64,
}

/// The posted (pod, process) pairs, oldest first.
#[derive(Debug, Default)]
struct Posted {
    set: HashSet<(String, u32)>,
    order: VecDeque<(String, u32)>,
}

impl Posted {
    /// Whether the pair is new (and remembers it).
    fn insert(&mut self, key: (String, u32)) -> bool {
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
    {
        let mut st = lock(state);
        st.lost += e.lost_before;
        if e.kind != daemon_v1::EnforcementEventKind::Refused as i32 {
            return;
        }
        st.refusals += 1;
    }
    // Outside pods there is nobody to tell (the daemon's log and metrics have it).
    if e.pod_uid.is_empty() || !posted.insert((e.pod_uid.clone(), e.tgid)) {
        return;
    }
    let Some(owner) = owner_of(hs, e) else {
        warn!(pod_uid = %e.pod_uid, pid = e.tgid, "a refused GPU open in a pod this node's watch does not have");
        return;
    };
    let api: Api<Event> = Api::namespaced(hs.client().clone(), &owner.namespace);
    let ev = refused_event(e, &owner, &hs.config().node_name);
    match api.create(&PostParams::default(), &ev).await {
        Ok(_) => {
            lock(state).posted += 1;
            info!(pod = %format!("{}/{}", owner.namespace, owner.pod), pid = e.tgid, comm = %e.comm, "posted {EVENT_REFUSED}");
        }
        Err(err) => warn!(error = %error_chain(&err), "could not post the event"),
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
    pod_event(owner, EVENT_REFUSED, message, node)
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
        assert!(p.insert(("a".into(), 1)));
        assert!(!p.insert(("a".into(), 1)));
        assert!(p.insert(("b".into(), 1)));
        for pid in 0..REMEMBERED as u32 {
            p.insert(("c".into(), pid));
        }
        assert_eq!(p.set.len(), REMEMBERED);
        assert!(p.insert(("a".into(), 1)), "the oldest was forgotten");
    }
}
