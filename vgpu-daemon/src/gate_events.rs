//! The node's enforcement events as the daemon hands them on (`WatchEnforcementEvents`,
//! `vgpuctl events`, the device plugin's pod and node events): the eBPF gate's opens and
//! exits, the second line's actions (ADR 0039) and enforce failing closed (ADR 0055),
//! each record attributed to its pod, the latest
//! [`RECENT`] kept, and one bounded queue per subscriber. Publishing never waits: a
//! subscriber whose queue is full loses the event, and the loss is counted (per
//! subscriber, handed over with its next event, and for the node in
//! [`EventHub::dropped`]). No I/O; the readers of the ring buffers publish from their
//! threads, the gRPC API subscribes from its tasks.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::sync::mpsc;

/// How many of the latest events the daemon keeps for a new subscriber.
pub const RECENT: usize = 1024;
/// Events queued for one subscriber beyond those it asked to replay; past it, the
/// subscriber loses events (counted).
pub const SUBSCRIBER_BUFFER: usize = 1024;

/// What the gate saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GateEventKind {
    /// An open of a GPU device node refused (`EPERM`).
    Refused,
    /// An open enforce would refuse, allowed because the mode is audit.
    Audited,
    /// A watched process exited.
    Exit,
    /// The second line acted on a process ([`GateEvent::second_line`] says what).
    Memory,
    /// `--ebpf enforce` could not be delivered ([`GateEvent::not_enforcing`] says why).
    NotEnforcing,
}

/// What the second line did to one process, and why (ADR 0039).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SecondLineInfo {
    /// `report`, `refuse` or `kill`.
    pub action: &'static str,
    /// Why the process was an offender, in words.
    pub reason: &'static str,
    /// A registered process with a second driver mapped after admission.
    pub second_driver: bool,
    /// No shim registered the process.
    pub unregistered: bool,
    /// The GPU.
    pub gpu: String,
    /// The container's holding, quota and limit on the GPU, bytes.
    pub held: u64,
    /// Quota, bytes.
    pub quota: u64,
    /// Limit (quota and context allowances), bytes.
    pub limit: u64,
    /// How long the container had been over, ms.
    pub over_ms: u64,
    /// What NVML said this process held, bytes.
    pub process_held: u64,
    /// Its admission withdrawn at the gate.
    pub refused_at_gate: bool,
    /// SIGKILL sent.
    pub killed: bool,
    /// The tenant key charged.
    pub tenant: String,
}

/// Why the node does not enforce although `--ebpf enforce` was asked for.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NotEnforcingInfo {
    /// The mode asked for.
    pub mode: &'static str,
    /// Why the gate is not attached.
    pub reason: String,
    /// Failing closed (not ready, new tenants refused).
    pub fail_closed: bool,
}

/// Who an event's process is, from its cgroup (and the daemon's tenants for the names).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Attribution {
    /// cgroup2 path under the mount (`/kubepods.slice/…`); empty when it was gone.
    pub cgroup: String,
    /// Pod UID, when the cgroup is a pod's.
    pub pod_uid: String,
    /// Container id, when the cgroup is a container's.
    pub container_id: String,
    /// Namespace, pod and container names, when a registered process of the pod told the
    /// daemon.
    pub namespace: String,
    /// Pod name.
    pub pod: String,
    /// Container name.
    pub container: String,
}

impl Attribution {
    /// The key refusals are counted under in `/metrics`: `pod <uid>`, else `cgroup
    /// <path>` (`cgroup ?` when the cgroup was gone).
    pub fn metrics_key(&self) -> String {
        if !self.pod_uid.is_empty() {
            format!("pod {}", self.pod_uid)
        } else if self.cgroup.is_empty() {
            "cgroup ?".to_owned()
        } else {
            format!("cgroup {}", self.cgroup)
        }
    }
}

/// One event of the gate, attributed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GateEvent {
    /// Numbered from 1 by this daemon process ([`EventHub::publish`] sets it).
    pub seq: u64,
    /// What happened.
    pub kind: GateEventKind,
    /// Process id (host PID namespace).
    pub tgid: u32,
    /// Thread id.
    pub pid: u32,
    /// Command name.
    pub comm: String,
    /// cgroup v2 id.
    pub cgroup_id: u64,
    /// The device node (major, minor), for refused and audited opens.
    pub device: Option<(u32, u32)>,
    /// When, ms since the Unix epoch.
    pub time_unix_ms: u64,
    /// When, the kernel's CLOCK_MONOTONIC, ns.
    pub monotonic_ns: u64,
    /// Its pod and container.
    pub who: Attribution,
    /// [`GateEventKind::Memory`] only.
    pub second_line: Option<SecondLineInfo>,
    /// [`GateEventKind::NotEnforcing`] only.
    pub not_enforcing: Option<NotEnforcingInfo>,
}

impl GateEvent {
    /// An event of `kind` about process `tgid` at the current time, not yet numbered.
    pub fn now(kind: GateEventKind, tgid: u32, comm: String, who: Attribution) -> GateEvent {
        let time_unix_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        GateEvent {
            seq: 0,
            kind,
            tgid,
            pid: tgid,
            comm,
            cgroup_id: 0,
            device: None,
            time_unix_ms,
            monotonic_ns: vgpu_sys::mono_ns(),
            who,
            second_line: None,
            not_enforcing: None,
        }
    }
}

/// An event as one subscriber receives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delivered {
    /// The event.
    pub event: GateEvent,
    /// Events this subscriber lost just before it (its queue was full).
    pub lost_before: u64,
}

struct Subscriber {
    tx: mpsc::Sender<Delivered>,
    /// Lost since its last delivered event.
    lost: u64,
}

#[derive(Default)]
struct Inner {
    next_seq: u64,
    recent: VecDeque<GateEvent>,
    subscribers: Vec<Subscriber>,
    /// [`EventHub::close`] was called: followers' queues end.
    closed: bool,
}

/// The latest events and the subscribers.
#[derive(Default)]
pub struct EventHub {
    inner: Mutex<Inner>,
    dropped: AtomicU64,
    published: AtomicU64,
}

impl std::fmt::Debug for EventHub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventHub")
            .field("published", &self.published.load(Ordering::Relaxed))
            .field("dropped", &self.dropped.load(Ordering::Relaxed))
            .field("subscribers", &self.subscribers())
            .finish()
    }
}

impl EventHub {
    /// An empty hub.
    pub fn new() -> EventHub {
        EventHub::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // Every critical section leaves the queues consistent.
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Numbers `event`, keeps it among the recent ones and queues it for every
    /// subscriber without waiting; returns its number.
    pub fn publish(&self, mut event: GateEvent) -> u64 {
        let mut g = self.lock();
        g.next_seq += 1;
        event.seq = g.next_seq;
        if g.recent.len() == RECENT {
            g.recent.pop_front();
        }
        g.recent.push_back(event.clone());
        let mut dropped = 0;
        g.subscribers.retain_mut(|s| {
            let d = Delivered {
                event: event.clone(),
                lost_before: s.lost,
            };
            match s.tx.try_send(d) {
                Ok(()) => {
                    s.lost = 0;
                    true
                }
                Err(mpsc::error::TrySendError::Full(_)) => {
                    s.lost += 1;
                    dropped += 1;
                    true
                }
                Err(mpsc::error::TrySendError::Closed(_)) => false,
            }
        });
        let seq = event.seq;
        drop(g);
        self.published.fetch_add(1, Ordering::Relaxed);
        if dropped > 0 {
            self.dropped.fetch_add(dropped, Ordering::Relaxed);
        }
        seq
    }

    /// A queue holding the latest `recent` events (at most [`RECENT`]), then, with
    /// `follow`, every new one (up to [`SUBSCRIBER_BUFFER`] waiting; beyond, lost and
    /// counted). Without `follow` the queue ends after the recent ones. Dropping the
    /// receiver unsubscribes.
    pub fn subscribe(&self, recent: usize, follow: bool) -> mpsc::Receiver<Delivered> {
        let mut g = self.lock();
        let recent = recent.min(g.recent.len());
        let (tx, rx) = mpsc::channel(recent + SUBSCRIBER_BUFFER);
        for event in g.recent.iter().skip(g.recent.len() - recent) {
            // Cannot be full: the capacity covers the replay.
            let _ = tx.try_send(Delivered {
                event: event.clone(),
                lost_before: 0,
            });
        }
        if follow && !g.closed {
            g.subscribers.push(Subscriber { tx, lost: 0 });
        }
        rx
    }

    /// Ends every follower's queue (after what it holds) and every later one's after
    /// its recent events: the daemon is stopping, and a client must see its stream end
    /// (to reconnect to the next daemon) even where its connection outlives the server.
    pub fn close(&self) {
        let mut g = self.lock();
        g.closed = true;
        g.subscribers.clear();
    }

    /// Events published so far.
    pub fn published(&self) -> u64 {
        self.published.load(Ordering::Relaxed)
    }

    /// Events a subscriber lost so far (each lost event counted once per subscriber).
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// Subscribers following now.
    pub fn subscribers(&self) -> usize {
        self.lock().subscribers.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(tgid: u32) -> GateEvent {
        GateEvent {
            seq: 0,
            kind: GateEventKind::Refused,
            tgid,
            pid: tgid,
            comm: "x".into(),
            cgroup_id: 7,
            device: Some((195, 0)),
            time_unix_ms: 1,
            monotonic_ns: 1,
            who: Attribution::default(),
            second_line: None,
            not_enforcing: None,
        }
    }

    #[test]
    fn a_new_subscriber_gets_the_recent_events_then_the_new_ones_in_order() {
        let hub = EventHub::new();
        for i in 1..=3 {
            hub.publish(ev(i));
        }
        let mut rx = hub.subscribe(2, true);
        hub.publish(ev(4));
        let got: Vec<(u64, u32)> = std::iter::from_fn(|| rx.try_recv().ok())
            .map(|d| (d.event.seq, d.event.tgid))
            .collect();
        assert_eq!(got, [(2, 2), (3, 3), (4, 4)]);
        let mut once = hub.subscribe(RECENT, false);
        assert_eq!(std::iter::from_fn(|| once.try_recv().ok()).count(), 4);
        assert!(once.is_closed(), "without follow the queue ends");
        assert_eq!(hub.subscribers(), 1);
        hub.close();
        assert_eq!(hub.subscribers(), 0);
        while rx.try_recv().is_ok() {}
        assert!(
            rx.is_closed(),
            "a follower's queue ends when the hub closes"
        );
        let mut late = hub.subscribe(1, true);
        assert!(late.try_recv().is_ok() && late.is_closed());
    }

    #[test]
    fn a_slow_subscriber_loses_events_counted_and_never_blocks_the_publisher() {
        let hub = EventHub::new();
        let mut slow = hub.subscribe(0, true);
        let mut fast = hub.subscribe(0, true);
        let n = SUBSCRIBER_BUFFER as u32 + 10;
        let mut fast_got = 0;
        for i in 0..n {
            hub.publish(ev(i));
            while fast.try_recv().is_ok() {
                fast_got += 1;
            }
        }
        assert_eq!(fast_got, n, "a subscriber that keeps up loses nothing");
        assert_eq!(hub.dropped(), 10);
        let mut slow_got = 0;
        while slow.try_recv().is_ok() {
            slow_got += 1;
        }
        assert_eq!(slow_got, SUBSCRIBER_BUFFER);
        hub.publish(ev(99));
        let next = slow.try_recv().expect("room again");
        assert_eq!((next.event.tgid, next.lost_before), (99, 10));
        drop(slow);
        hub.publish(ev(100));
        assert_eq!(hub.subscribers(), 1, "a gone subscriber is removed");
    }

    #[test]
    fn only_the_latest_events_are_kept() {
        let hub = EventHub::new();
        for i in 0..(RECENT as u32 + 5) {
            hub.publish(ev(i));
        }
        let mut rx = hub.subscribe(usize::MAX, false);
        let first = rx.try_recv().unwrap();
        assert_eq!(first.event.seq, 6);
        assert_eq!(hub.published(), RECENT as u64 + 5);
    }
}
