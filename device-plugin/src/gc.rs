//! Removal of allocation directories that no container holds any more.
//!
//! `Allocate` makes `<state>/alloc/<key>/` for every container and nothing else removes
//! it: without this, a node accumulates one directory (quota file, the shim's accounting
//! region) per container it ever ran. A directory is removed only when all of these hold,
//! so a live container never loses its directory:
//!
//! - it has not changed for [`Config::gc_grace`](crate::config::Config::gc_grace) (kubelet records a container's devices
//!   only after `Allocate` returns; the shim and `PreStartContainer` touch it later);
//! - kubelet's PodResources `List`, started after the round began, lists no container
//!   holding exactly its device IDs;
//! - its quota file names no pod that the API server still shows on this node, not
//!   terminated (an init container is never listed by `List`; its pod is);
//! - it is still that old when the plugin removes it, under the lock that `Allocate`
//!   holds while it makes a directory (so one being reused right now is kept).
//!
//! A round whose `List` or pod list fails removes nothing.

use std::collections::BTreeSet;
use std::path::Path;
use std::time::{Duration, SystemTime};

use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::ListParams;
use tracing::{info, warn};
use vgpu_core::container_quota::{ContainerQuota, QUOTA_FILE};

use crate::error::{HandshakeError, error_chain};
use crate::handshake::Handshake;
use crate::podresources::listed_keys;

/// What one round did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct GcRound {
    /// Directories left in place.
    pub kept: usize,
    /// Keys of the directories removed.
    pub removed: Vec<String>,
}

/// Why a round removed nothing.
#[derive(Debug, thiserror::Error)]
pub enum GcError {
    /// Kubelet's `List` failed.
    #[error("PodResources List")]
    List(#[source] HandshakeError),
    /// The node's pods could not be listed.
    #[error("list the pods of node {node}")]
    Pods {
        /// The node.
        node: String,
        /// kube's error.
        #[source]
        source: kube::Error,
    },
    /// The allocation directory could not be read.
    #[error("read {path}")]
    Read {
        /// The directory.
        path: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
}

fn age(p: &Path, now: SystemTime) -> Option<Duration> {
    let m = std::fs::metadata(p).ok()?.modified().ok()?;
    Some(now.duration_since(m).unwrap_or(Duration::ZERO))
}

fn is_key(name: &str) -> bool {
    name.len() == 64 && name.bytes().all(|b| b.is_ascii_hexdigit())
}

/// UIDs of this node's pods that are not terminated, from the API server.
async fn live_pod_uids(hs: &Handshake) -> Result<BTreeSet<String>, GcError> {
    let node = &hs.config().node_name;
    let api: Api<Pod> = Api::all(hs.client().clone());
    let lp = ListParams::default().fields(&format!("spec.nodeName={node}"));
    let pods = api.list(&lp).await.map_err(|source| GcError::Pods {
        node: node.clone(),
        source,
    })?;
    Ok(pods
        .items
        .iter()
        .filter(|p| {
            !matches!(
                p.status.as_ref().and_then(|s| s.phase.as_deref()),
                Some("Succeeded" | "Failed")
            )
        })
        .filter_map(|p| p.metadata.uid.clone())
        .collect())
}

/// One round: removes the allocation directories no container holds (see the module).
pub async fn collect(hs: &Handshake) -> Result<GcRound, GcError> {
    let cfg = hs.config().clone();
    let root = cfg.state_dir.join("alloc");
    let started = SystemTime::now();
    // Candidates first: only directories already old when the round began.
    let mut old = Vec::new();
    let entries = std::fs::read_dir(&root).map_err(|source| GcError::Read {
        path: root.display().to_string(),
        source,
    })?;
    let mut round = GcRound::default();
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !is_key(&name) {
            continue;
        }
        match age(&e.path(), started) {
            Some(a) if a >= cfg.gc_grace => old.push(name),
            _ => round.kept += 1,
        }
    }
    if old.is_empty() {
        return Ok(round);
    }
    let resp = hs.lister().list().await.map_err(GcError::List)?;
    let held = listed_keys(&resp, &cfg.resource_name);
    let live = live_pod_uids(hs).await?;
    for key in old {
        let dir = root.join(&key);
        let owner = std::fs::read_to_string(dir.join(QUOTA_FILE))
            .ok()
            .and_then(|t| ContainerQuota::from_json(&t).ok());
        if held.contains(&key) || owner.as_ref().is_some_and(|q| live.contains(&q.uid)) {
            round.kept += 1;
            continue;
        }
        let _guard = hs.alloc_lock();
        // Reused since the round began (Allocate made it afresh): keep it.
        if age(&dir, SystemTime::now()).is_none_or(|a| a < cfg.gc_grace) {
            round.kept += 1;
            continue;
        }
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => {
                info!(
                    key = %key,
                    pod = %owner.as_ref().map(|q| format!("{}/{}:{}", q.namespace, q.pod, q.container)).unwrap_or_default(),
                    "removed an allocation directory no container holds"
                );
                round.removed.push(key);
            }
            Err(e) => {
                warn!(dir = %dir.display(), error = %e, "could not remove an allocation directory");
                round.kept += 1;
            }
        }
    }
    Ok(round)
}

/// Runs [`collect`] every `interval` until the task is dropped; `on_round` sees each
/// round's result (metrics).
pub async fn run(hs: Handshake, interval: Duration, on_round: impl Fn(&GcRound)) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        match collect(&hs).await {
            Ok(r) => on_round(&r),
            Err(e) => warn!(error = %error_chain(&e), "allocation directory clean-up skipped"),
        }
    }
}
