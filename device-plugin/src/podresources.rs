//! Kubelet's PodResources `List`, shared by concurrent callers ([`SharedList`]), and the
//! containers it names ([`listed`]).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::oneshot;

use crate::error::HandshakeError;
use crate::ids;
use crate::kubelet::podresources::pod_resources_lister_client::PodResourcesListerClient;
use crate::kubelet::podresources::{ListPodResourcesRequest, ListPodResourcesResponse};

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

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
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
pub struct Listed {
    /// The pod's namespace.
    pub namespace: String,
    /// The pod's name.
    pub pod: String,
    /// The container's name.
    pub container: String,
    /// Its device IDs of our resource.
    pub ids: BTreeSet<String>,
}

/// The allocation keys of every container kubelet lists with devices of `resource`.
pub fn listed_keys(resp: &ListPodResourcesResponse, resource: &str) -> BTreeSet<String> {
    listed(resp, resource)
        .iter()
        .map(|l| ids::allocation_key(l.ids.iter().map(String::as_str)))
        .collect()
}

/// Every container kubelet lists with devices of `resource`.
pub fn listed(resp: &ListPodResourcesResponse, resource: &str) -> Vec<Listed> {
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
