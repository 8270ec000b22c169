//! The kube-rs side of the extender's state: watches of Nodes and Pods.
//!
//! Each watch is a `kube_runtime::watcher`: it lists, then watches from the
//! list's resource version, and re-lists when the watch breaks (resource
//! version too old, API server restart, network error; with backoff). A
//! (re-)list is buffered from `Init` to `InitDone` and then replaces that
//! kind's objects in [`State`] in one step, so a decision never sees half a
//! list; single `Apply`/`Delete` events are applied as they come. [`State`]
//! refuses to decide until both kinds have completed their first list, so an
//! extender that has just (re)started never answers from a partial ledger.

use std::sync::Arc;
use std::time::Duration;

use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client};
use tracing::{debug, info, warn};

use super::cluster::State;

/// Which object kind a watch carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WatchKind {
    /// `v1.Node`.
    Nodes,
    /// `v1.Pod`.
    Pods,
}

/// Settings of the watches.
#[derive(Debug, Clone)]
pub struct SyncConfig {
    /// Page size of the initial list (0: the API server's default, one page).
    pub page_size: u32,
    /// How often assumptions and pending requests are checked for expiry.
    pub sweep_interval: Duration,
}

impl Default for SyncConfig {
    fn default() -> Self {
        Self {
            page_size: 500,
            sweep_interval: Duration::from_secs(5),
        }
    }
}

/// Runs the Node watch, the Pod watch and the expiry sweep until one of them
/// ends (they only end when the runtime shuts down).
pub async fn run(client: Client, state: Arc<State>, config: SyncConfig) {
    let nodes: Api<Node> = Api::all(client.clone());
    let pods: Api<Pod> = Api::all(client);
    let wc = watcher::Config::default().page_size(config.page_size);
    let node_stream = watcher::watcher(nodes, wc.clone()).default_backoff();
    let pod_stream = watcher::watcher(pods, wc).default_backoff();
    let node_task = drive(node_stream, state.clone(), WatchKind::Nodes);
    let pod_task = drive(pod_stream, state.clone(), WatchKind::Pods);
    let sweep = sweep(state, config.sweep_interval);
    tokio::select! {
        () = node_task => warn!("node watch ended"),
        () = pod_task => warn!("pod watch ended"),
        () = sweep => warn!("expiry sweep ended"),
    }
}

/// Periodically drops expired assumptions and pending requests.
async fn sweep(state: Arc<State>, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        state.expire_now();
    }
}

/// Objects a watch can feed into [`State`].
pub trait Watched: Sized + Send + 'static {
    /// Which kind this is.
    const KIND: WatchKind;
    /// Replaces every object of this kind (end of a list).
    fn replace(state: &State, objects: Vec<Self>);
    /// One object added or modified.
    fn apply(state: &State, object: Self);
    /// One object deleted.
    fn delete(state: &State, object: Self);
}

impl Watched for Node {
    const KIND: WatchKind = WatchKind::Nodes;
    fn replace(state: &State, objects: Vec<Self>) {
        state.replace_nodes(&objects);
    }
    fn apply(state: &State, object: Self) {
        state.apply_node(&object);
    }
    fn delete(state: &State, object: Self) {
        state.delete_node(&object);
    }
}

impl Watched for Pod {
    const KIND: WatchKind = WatchKind::Pods;
    fn replace(state: &State, objects: Vec<Self>) {
        state.replace_pods(&objects);
    }
    fn apply(state: &State, object: Self) {
        state.apply_pod(&object);
    }
    fn delete(state: &State, object: Self) {
        state.delete_pod(&object);
    }
}

/// Feeds one watcher stream into the state until the stream ends.
pub async fn drive<K, S>(stream: S, state: Arc<State>, kind: WatchKind)
where
    K: Watched,
    S: Stream<Item = Result<Event<K>, watcher::Error>>,
{
    let mut stream = std::pin::pin!(stream);
    let mut buffer: Option<Vec<K>> = None;
    while let Some(item) = stream.next().await {
        match item {
            Ok(Event::Init) => {
                debug!(?kind, "list started");
                buffer = Some(Vec::new());
            }
            Ok(Event::InitApply(obj)) => match buffer.as_mut() {
                Some(buf) => buf.push(obj),
                None => K::apply(&state, obj),
            },
            Ok(Event::InitDone) => {
                let objects = buffer.take().unwrap_or_default();
                info!(
                    ?kind,
                    count = objects.len(),
                    "list complete, state replaced"
                );
                K::replace(&state, objects);
                state.mark_synced(kind);
            }
            Ok(Event::Apply(obj)) => K::apply(&state, obj),
            Ok(Event::Delete(obj)) => K::delete(&state, obj),
            Err(error) => {
                // The watcher re-lists by itself after an error (with backoff).
                warn!(?kind, %error, "watch error, the watcher will retry");
            }
        }
    }
}
