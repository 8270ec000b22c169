//! The kube-rs side of quota policies: the watch of `VgpuQuotaPolicy` objects feeding
//! the [`super::QuotaBook`], the status writer (use against each total and the `Valid`
//! condition; at most one write per policy per [`QuotaSyncConfig::status_every`], and
//! none when nothing changed), and the `Warning` events on pods a policy refused (one per
//! pod and policy per minute, paced to [`QuotaSyncConfig::events_per_second`]).
//!
//! Policies are watched as dynamic objects and read field by field, so a bad one is an
//! error naming its field, never a broken watch.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Event, EventSource, ObjectReference};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use kube::api::{ApiResource, DynamicObject, Patch, PatchParams, PostParams};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event as WatchEvent};
use kube::{Api, Client};
use serde_json::{Value, json};
use tracing::{debug, info, warn};

use super::crd::{PolicyCondition, QuotaUse, VgpuQuotaPolicy, VgpuQuotaPolicyStatus};
use super::rules::Usage;
use super::{Notice, PolicyEntry};
use crate::extender::cluster::State;

/// The reason of the events on refused pods.
pub const EVENT_REASON: &str = "VgpuQuotaPolicyExceeded";

/// Settings of the policy watch, the status writer and the events.
#[derive(Debug, Clone)]
pub struct QuotaSyncConfig {
    /// Least time between two status writes of one policy.
    pub status_every: Duration,
    /// Most events posted per second (over all pods).
    pub events_per_second: u32,
}

impl Default for QuotaSyncConfig {
    fn default() -> Self {
        Self {
            status_every: Duration::from_secs(5),
            events_per_second: 10,
        }
    }
}

/// The API resource of `VgpuQuotaPolicy`.
#[must_use]
pub fn api_resource() -> ApiResource {
    ApiResource::erase::<VgpuQuotaPolicy>(&())
}

/// Runs the policy watch, the status writer and the event poster until one ends (they
/// end only when the runtime shuts down).
pub async fn run(client: Client, state: Arc<State>, config: QuotaSyncConfig) {
    tokio::select! {
        () = watch(client.clone(), state.clone()) => warn!("quota policy watch ended"),
        () = write_status(client.clone(), state.clone(), config.status_every) => warn!("quota status writer ended"),
        () = post_events(client, state, config.events_per_second) => warn!("quota event poster ended"),
    }
}

async fn watch(client: Client, state: Arc<State>) {
    let ar = api_resource();
    let api: Api<DynamicObject> = Api::all_with(client, &ar);
    let stream = watcher::watcher(api, watcher::Config::default()).default_backoff();
    let mut stream = std::pin::pin!(stream);
    let mut buffer: Option<Vec<DynamicObject>> = None;
    let book = state.quota();
    while let Some(item) = stream.next().await {
        match item {
            Ok(WatchEvent::Init) => buffer = Some(Vec::new()),
            Ok(WatchEvent::InitApply(obj)) => match buffer.as_mut() {
                Some(b) => b.push(obj),
                None => book.apply(&obj),
            },
            Ok(WatchEvent::InitDone) => {
                let objects = buffer.take().unwrap_or_default();
                info!(count = objects.len(), "quota policies listed");
                book.replace(&objects);
            }
            Ok(WatchEvent::Apply(obj)) => book.apply(&obj),
            Ok(WatchEvent::Delete(obj)) => book.delete(&obj),
            Err(error) => {
                warn!(%error, "quota policy watch error (is the VgpuQuotaPolicy CRD installed?); the watcher will retry");
            }
        }
    }
}

/// The status a policy should show now. `since` is when its validity last changed.
#[must_use]
pub fn status_of(entry: &PolicyEntry, used: &Usage, since: &str) -> VgpuQuotaPolicyStatus {
    let (status, reason, message) = match &entry.rules {
        Ok(_) => ("True", "Accepted", String::new()),
        Err(e) => ("False", "InvalidSpec", e.to_string()),
    };
    VgpuQuotaPolicyStatus {
        observed_generation: entry.generation,
        used: Some(QuotaUse {
            memory_mib: used.memory_mib,
            compute_percent: used.compute_milli as f64 / 10.0,
            gpus: used.gpus,
            pods: used.pods,
        }),
        conditions: vec![PolicyCondition {
            type_: "Valid".into(),
            status: status.into(),
            reason: reason.into(),
            message,
            last_transition_time: Some(since.to_owned()),
        }],
    }
}

async fn write_status(client: Client, state: Arc<State>, every: Duration) {
    let ar = api_resource();
    // (namespace, name) → (validity, when it last changed, the status last written).
    let mut written: HashMap<(String, String), (bool, String, Value)> = HashMap::new();
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let usage = state.quota_usage();
        let all = state.quota().all();
        written.retain(|(ns, name), _| {
            all.get(ns)
                .is_some_and(|l| l.iter().any(|e| &e.name == name))
        });
        for (ns, list) in &all {
            let used = usage.get(ns).copied().unwrap_or_default();
            for entry in list {
                let key = (ns.clone(), entry.name.clone());
                let valid = entry.rules.is_ok();
                let since = match written.get(&key) {
                    Some((v, t, _)) if *v == valid => t.clone(),
                    _ => k8s_openapi::jiff::Timestamp::now().to_string(),
                };
                let status = serde_json::to_value(status_of(entry, &used, &since))
                    .expect("a status serialises");
                if written.get(&key).is_some_and(|(_, _, s)| *s == status) {
                    continue;
                }
                let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, &ar);
                match api
                    .patch_status(
                        &entry.name,
                        &PatchParams::default(),
                        &Patch::Merge(json!({"status": status})),
                    )
                    .await
                {
                    Ok(_) => {
                        debug!(policy = %format!("{ns}/{}", entry.name), "quota policy status written");
                        written.insert(key, (valid, since, status));
                    }
                    Err(error) => {
                        warn!(policy = %format!("{ns}/{}", entry.name), %error, "write quota policy status (retried at the next tick)");
                    }
                }
            }
        }
    }
}

/// The event for a pod a policy refused.
#[must_use]
pub fn event_for(n: &Notice) -> Event {
    let now = Time(k8s_openapi::jiff::Timestamp::now());
    Event {
        metadata: ObjectMeta {
            generate_name: Some(format!("{}.vgpu-quota-", n.pod)),
            namespace: Some(n.namespace.clone()),
            ..ObjectMeta::default()
        },
        involved_object: ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Pod".into()),
            name: Some(n.pod.clone()),
            namespace: Some(n.namespace.clone()),
            uid: Some(n.uid.clone()),
            ..ObjectReference::default()
        },
        reason: Some(EVENT_REASON.into()),
        type_: Some("Warning".into()),
        message: Some(n.message.clone()),
        source: Some(EventSource {
            component: Some("vgpu-scheduler-extender".into()),
            host: None,
        }),
        first_timestamp: Some(now.clone()),
        last_timestamp: Some(now),
        count: Some(1),
        ..Event::default()
    }
}

async fn post_events(client: Client, state: Arc<State>, per_second: u32) {
    let pace = Duration::from_secs(1) / per_second.max(1);
    loop {
        let notified = state.quota().changed.notified();
        let notices = state.quota().take_notices();
        if notices.is_empty() {
            tokio::select! {
                () = notified => {}
                () = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
            continue;
        }
        for n in notices {
            let api: Api<Event> = Api::namespaced(client.clone(), &n.namespace);
            if let Err(error) = api.create(&PostParams::default(), &event_for(&n)).await {
                warn!(pod = %format!("{}/{}", n.namespace, n.pod), %error, "post quota policy event");
            }
            tokio::time::sleep(pace).await;
        }
    }
}
