//! GPU memory allocations refused over a container's quota, as `Warning` events on its
//! pod (`VgpuMemoryQuotaExceeded`), so that `kubectl describe pod` explains the
//! out-of-memory error the application saw.
//!
//! The shim refuses the allocation and tells the node daemon (with its periodic usage
//! report, at once after a refusal); the daemon keeps a running count and the latest
//! figures per container and GPU, also after the container's processes are gone. Every
//! [`POLL`] this task reads them from the daemon's API (`ListTenants`, its `health`
//! records) and posts one event per container, GPU and *burst*: refusals with less than
//! [`QUIET`] between them are one burst ([`Bursts`], pure). The event names the figures:
//! quota, in use, asked, and how many were refused.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Event, Pod};
use kube::Api;
use kube::api::PostParams;
use tracing::{debug, info, warn};
use vgpu_core::bytes::Bytes;

use crate::audit::{Owner, pod_event};
use crate::error::error_chain;
use crate::handshake::Handshake;
use crate::kubelet::daemon_v1 as pb;
use crate::kubelet::daemon_v1::daemon_client::DaemonClient;

/// The event reason.
pub const EVENT_REASON: &str = "VgpuMemoryQuotaExceeded";
/// How often the daemon is asked.
pub const POLL: Duration = Duration::from_secs(2);
/// Refusals at least this far apart are separate bursts (each gets an event).
pub const QUIET: Duration = Duration::from_secs(60);

#[derive(Debug, Clone, Copy)]
struct Seen {
    count: u64,
    last_unix_ms: u64,
    polled_unix_ms: u64,
}

/// Which refusals start a new burst, per (container, GPU): a pure tracker of the
/// daemon's running counts, with the time of each reading given.
#[derive(Debug, Default)]
pub struct Bursts {
    seen: HashMap<(String, String), Seen>,
    quiet_ms: u64,
}

impl Bursts {
    /// A tracker for which refusals `quiet` apart are separate bursts.
    pub fn new(quiet: Duration) -> Bursts {
        Bursts {
            seen: HashMap::new(),
            quiet_ms: u64::try_from(quiet.as_millis()).unwrap_or(u64::MAX),
        }
    }

    /// The daemon says, at `now_ms`, that container `key` had `count` allocations refused
    /// on `gpu`, the latest at `last_unix_ms`. True: a new burst began; post an event.
    ///
    /// A container first seen is reported when its latest refusal is recent (less than
    /// the quiet time ago: the plugin restarted mid-burst, or the refusals came before its
    /// first reading); a count that went down (the daemon restarted) is a new baseline.
    pub fn observe(
        &mut self,
        key: &str,
        gpu: &str,
        count: u64,
        last_unix_ms: u64,
        now_ms: u64,
    ) -> bool {
        let now = Seen {
            count,
            last_unix_ms,
            polled_unix_ms: now_ms,
        };
        let k = (key.to_owned(), gpu.to_owned());
        let Some(prev) = self.seen.insert(k, now) else {
            return count > 0 && now_ms.saturating_sub(last_unix_ms) < self.quiet_ms;
        };
        if count <= prev.count {
            return count < prev.count
                && count > 0
                && now_ms.saturating_sub(last_unix_ms) < self.quiet_ms;
        }
        // New refusals since the previous reading: they came after it, so they continue
        // the burst of the previous latest refusal only if that one was recent then.
        prev.count == 0 || prev.polled_unix_ms.saturating_sub(prev.last_unix_ms) >= self.quiet_ms
    }

    /// Forgets containers the daemon no longer reports.
    pub fn retain(&mut self, live: &std::collections::HashSet<(String, String)>) {
        self.seen.retain(|k, _| live.contains(k));
    }
}

/// The event's message.
pub fn message(container: &str, m: &pb::MemoryRefusals) -> String {
    format!(
        "GPU memory allocation refused on GPU {}: container {container:?} asked for {} with {} in use of its {} quota ({} refused so far); the application saw CUDA_ERROR_OUT_OF_MEMORY",
        m.uuid,
        Bytes(m.last_asked_bytes),
        Bytes(m.last_used_bytes),
        Bytes(m.last_quota_bytes),
        m.count
    )
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// The pod's UID from the node's pod watch (empty when it is not there).
fn pod_uid(hs: &Handshake, namespace: &str, pod: &str) -> String {
    hs.pods()
        .and_then(|s| {
            s.state().into_iter().find(|p: &Arc<Pod>| {
                p.metadata.namespace.as_deref() == Some(namespace)
                    && p.metadata.name.as_deref() == Some(pod)
            })
        })
        .and_then(|p| p.metadata.uid.clone())
        .unwrap_or_default()
}

/// Asks the daemon at `socket` every [`POLL`] and posts an event per new burst; `posted`
/// counts them. Runs until the task is dropped; a daemon that does not answer is asked
/// again at the next poll (its refusals are kept, so none is lost while it restarts).
pub async fn run(hs: Handshake, socket: PathBuf, posted: Arc<AtomicU64>) {
    let mut client = DaemonClient::new(crate::kubelet::unix_channel(&socket));
    let mut bursts = Bursts::new(QUIET);
    let mut trouble = String::new();
    let mut tick = tokio::time::interval(POLL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let answer = tokio::time::timeout(
            hs.config().call_timeout,
            client.list_tenants(pb::ListTenantsRequest {}),
        )
        .await;
        let health = match answer {
            Ok(Ok(r)) => {
                trouble.clear();
                r.into_inner().health
            }
            Ok(Err(e)) => {
                let t = format!("the daemon's API at {} answers {e}", socket.display());
                if t != trouble {
                    warn!("refusal events: {t}");
                    trouble = t;
                }
                continue;
            }
            Err(_) => {
                debug!("refusal events: the daemon's API did not answer in time");
                continue;
            }
        };
        let now = now_ms();
        let mut live = std::collections::HashSet::new();
        for h in &health {
            for m in &h.memory_refusals {
                live.insert((h.key.clone(), m.uuid.clone()));
                if !bursts.observe(&h.key, &m.uuid, m.count, m.last_unix_ms, now) {
                    continue;
                }
                warn!(
                    container = %format!("{}/{}:{}", h.namespace, h.pod, h.container),
                    gpu = %m.uuid, asked = m.last_asked_bytes, used = m.last_used_bytes,
                    quota = m.last_quota_bytes, refused = m.count,
                    "GPU memory allocations refused over the container's quota"
                );
                if h.namespace.is_empty() || h.pod.is_empty() {
                    continue;
                }
                let owner = Owner {
                    namespace: h.namespace.clone(),
                    pod: h.pod.clone(),
                    uid: pod_uid(&hs, &h.namespace, &h.pod),
                    container: h.container.clone(),
                };
                let mut ev = pod_event(
                    &owner,
                    EVENT_REASON,
                    message(&h.container, m),
                    &hs.config().node_name,
                );
                if owner.uid.is_empty() {
                    ev.involved_object.uid = None;
                }
                let api: Api<Event> = Api::namespaced(hs.client().clone(), &owner.namespace);
                match api.create(&PostParams::default(), &ev).await {
                    Ok(_) => {
                        posted.fetch_add(1, Ordering::Relaxed);
                        info!(pod = %format!("{}/{}", owner.namespace, owner.pod), "posted {EVENT_REASON}");
                    }
                    Err(e) => warn!(error = %error_chain(&e), "could not post the event"),
                }
            }
        }
        bursts.retain(&live);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const Q: u64 = 60_000;

    #[test]
    fn one_event_per_burst_and_a_new_one_after_a_quiet_time() {
        let mut b = Bursts::new(Duration::from_millis(Q));
        // Nothing refused yet.
        assert!(!b.observe("c", "g", 0, 0, 1_000));
        // A burst: three readings with new refusals, one event.
        assert!(b.observe("c", "g", 2, 1_500, 2_000));
        assert!(!b.observe("c", "g", 5, 3_900, 4_000));
        assert!(!b.observe("c", "g", 9, 5_500, 6_000));
        // Quiet: no new refusals, no event.
        assert!(!b.observe("c", "g", 9, 5_500, 30_000));
        assert!(!b.observe("c", "g", 9, 5_500, 70_000));
        // Refusals again after the quiet time: a new burst.
        assert!(b.observe("c", "g", 10, 71_000, 72_000));
        assert!(!b.observe("c", "g", 11, 73_000, 74_000));
        // Another container, another GPU of the same container: their own bursts.
        assert!(b.observe("d", "g", 1, 74_000, 74_000));
        assert!(b.observe("c", "h", 1, 74_000, 74_000));
    }

    #[test]
    fn a_first_reading_reports_only_recent_refusals_and_a_daemon_restart_is_a_baseline() {
        let mut b = Bursts::new(Duration::from_millis(Q));
        // Seen first long after its refusals: old news.
        assert!(!b.observe("old", "g", 4, 1_000, 1_000 + Q));
        assert!(!b.observe("old", "g", 4, 1_000, 2_000 + Q));
        // Seen first during its burst (the plugin restarted): reported.
        assert!(b.observe("new", "g", 4, 100_000, 101_000));
        // The daemon restarted: its count starts again; recent refusals are a burst.
        assert!(b.observe("new", "g", 1, 200_000, 200_500));
        assert!(!b.observe("new", "g", 0, 0, 300_000));
    }

    #[test]
    fn the_message_names_quota_use_and_ask() {
        let m = pb::MemoryRefusals {
            uuid: "GPU-1".into(),
            count: 3,
            last_asked_bytes: 1 << 30,
            last_used_bytes: 3 << 30,
            last_quota_bytes: 4 << 30,
            last_unix_ms: 0,
        };
        let s = message("main", &m);
        assert!(
            s.contains("asked for 1Gi with 3Gi in use of its 4Gi quota"),
            "{s}"
        );
        assert!(
            s.contains("GPU-1") && s.contains("\"main\"") && s.contains("3 refused"),
            "{s}"
        );
    }
}
