//! Quota policies per namespace (`VgpuQuotaPolicy`, ADR 0022): the custom resource
//! ([`crd`]), its validation and the pure checks ([`rules`]), the policies the extender
//! holds ([`QuotaBook`], fed by [`watch`]), the status and events it writes
//! ([`watch`]) and the metrics it serves ([`metrics`]).
//!
//! Enforcement sits beside the ledger in `cluster/quota_check.rs`: filter rejects, with
//! the policy's reason, every node where the pod would break a policy; bind checks the
//! totals again against the live ledger under its exclusive lock, on the GPUs it chose,
//! so two pods of one namespace racing for the last of a total never both get it.

pub mod crd;
pub mod metrics;
pub mod rules;
pub mod watch;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

use kube::api::DynamicObject;
use tracing::{info, warn};

use self::crd::VgpuQuotaPolicySpec;
use self::rules::{PolicyError, Rules};

/// One policy as the extender holds it.
#[derive(Debug, Clone)]
pub struct PolicyEntry {
    /// Its name (in its namespace).
    pub name: String,
    /// `metadata.generation`.
    pub generation: Option<i64>,
    /// The validated rules, or the error naming the bad field.
    pub rules: Result<Rules, PolicyError>,
}

/// A pod refused by a policy, to be told on the pod as an event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notice {
    /// Pod namespace.
    pub namespace: String,
    /// Pod name.
    pub pod: String,
    /// Pod UID.
    pub uid: String,
    /// `namespace/name` of the policy.
    pub policy: String,
    /// The reason, with the figures.
    pub message: String,
}

/// Counts of refusals per policy (`namespace/name`), for the metrics.
pub type Refusals = BTreeMap<String, u64>;

#[derive(Debug, Default)]
struct Notices {
    queue: Vec<Notice>,
    /// When each (pod UID, policy) was last queued: one notice per pod, policy and
    /// [`QuotaBook::NOTICE_EVERY`].
    last: HashMap<(String, String), Instant>,
    refusals: Refusals,
}

/// The policies of every namespace, as the watch last showed them.
#[derive(Debug, Default)]
pub struct QuotaBook {
    policies: RwLock<BTreeMap<String, Vec<PolicyEntry>>>,
    notices: Mutex<Notices>,
    /// Woken when a notice is queued or a policy changes.
    pub changed: tokio::sync::Notify,
}

/// What the rules of a namespace say for a pod: every valid policy applies; an invalid
/// one refuses the namespace's new pods (a typo must not lift a quota).
#[derive(Debug, Clone, Default)]
pub struct NamespaceRules {
    /// Valid policies, by name.
    pub valid: Vec<Rules>,
    /// Invalid policies' errors.
    pub invalid: Vec<PolicyError>,
}

impl NamespaceRules {
    /// Whether the namespace has no policy at all.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.valid.is_empty() && self.invalid.is_empty()
    }
}

/// Reads a policy object: its validated rules or the error naming the field.
#[must_use]
pub fn read_policy(obj: &DynamicObject) -> Option<(String, PolicyEntry)> {
    let namespace = obj.metadata.namespace.clone()?;
    let name = obj.metadata.name.clone()?;
    let key = format!("{namespace}/{name}");
    let spec = obj
        .data
        .get("spec")
        .cloned()
        .unwrap_or(serde_json::Value::Null);
    let rules = if spec.is_null() {
        Ok(Rules {
            policy: key.clone(),
            ..Rules::default()
        })
    } else {
        serde_json::from_value::<VgpuQuotaPolicySpec>(spec)
            .map_err(|e| PolicyError {
                policy: key.clone(),
                field: "spec".into(),
                value: String::new(),
                reason: format!("does not parse: {e}"),
            })
            .and_then(|spec| Rules::from_spec(&key, &spec))
    };
    Some((
        namespace,
        PolicyEntry {
            name,
            generation: obj.metadata.generation,
            rules,
        },
    ))
}

impl QuotaBook {
    /// How often one pod is told about one policy refusing it, at most.
    pub const NOTICE_EVERY: Duration = Duration::from_secs(60);

    fn notices(&self) -> MutexGuard<'_, Notices> {
        self.notices
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn log(entry: &PolicyEntry, namespace: &str) {
        match &entry.rules {
            Ok(_) => {
                info!(policy = %format!("{namespace}/{}", entry.name), "quota policy accepted")
            }
            Err(e) => {
                warn!(error = %e, "quota policy refused: the namespace takes no new GPU pod until it is fixed")
            }
        }
    }

    /// Replaces every policy (end of a list).
    pub fn replace(&self, objects: &[DynamicObject]) {
        let mut all: BTreeMap<String, Vec<PolicyEntry>> = BTreeMap::new();
        for (ns, entry) in objects.iter().filter_map(read_policy) {
            Self::log(&entry, &ns);
            all.entry(ns).or_default().push(entry);
        }
        for list in all.values_mut() {
            list.sort_by(|a, b| a.name.cmp(&b.name));
        }
        *self.write() = all;
        self.changed.notify_one();
    }

    /// One policy added or changed.
    pub fn apply(&self, obj: &DynamicObject) {
        let Some((ns, entry)) = read_policy(obj) else {
            return;
        };
        let mut all = self.write();
        let list = all.entry(ns.clone()).or_default();
        let old = list.iter().position(|e| e.name == entry.name);
        if old
            .is_none_or(|i| list[i].generation != entry.generation || list[i].rules != entry.rules)
        {
            Self::log(&entry, &ns);
        }
        match old {
            Some(i) => list[i] = entry,
            None => {
                list.push(entry);
                list.sort_by(|a, b| a.name.cmp(&b.name));
            }
        }
        drop(all);
        self.changed.notify_one();
    }

    /// One policy deleted.
    pub fn delete(&self, obj: &DynamicObject) {
        let (Some(ns), Some(name)) = (obj.metadata.namespace.as_ref(), obj.metadata.name.as_ref())
        else {
            return;
        };
        let mut all = self.write();
        if let Some(list) = all.get_mut(ns) {
            list.retain(|e| &e.name != name);
            if list.is_empty() {
                all.remove(ns);
            }
        }
        drop(all);
        self.changed.notify_one();
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, BTreeMap<String, Vec<PolicyEntry>>> {
        self.policies
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<String, Vec<PolicyEntry>>> {
        self.policies
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The rules of one namespace (empty when it has no policy).
    #[must_use]
    pub fn namespace(&self, namespace: &str) -> NamespaceRules {
        let all = self.read();
        let mut out = NamespaceRules::default();
        for e in all.get(namespace).into_iter().flatten() {
            match &e.rules {
                Ok(r) => out.valid.push(r.clone()),
                Err(err) => out.invalid.push(err.clone()),
            }
        }
        out
    }

    /// Every policy, by namespace.
    #[must_use]
    pub fn all(&self) -> BTreeMap<String, Vec<PolicyEntry>> {
        self.read().clone()
    }

    /// Queues a notice for the pod (at most one per pod and policy per
    /// [`Self::NOTICE_EVERY`]) and counts the refusal.
    pub fn refused(&self, notice: Notice, now: Instant) {
        let mut n = self.notices();
        *n.refusals.entry(notice.policy.clone()).or_default() += 1;
        let key = (notice.uid.clone(), notice.policy.clone());
        if n.last
            .get(&key)
            .is_some_and(|&t| now.duration_since(t) < Self::NOTICE_EVERY)
        {
            return;
        }
        n.last
            .retain(|_, t| now.duration_since(*t) < Self::NOTICE_EVERY);
        n.last.insert(key, now);
        n.queue.push(notice);
        drop(n);
        self.changed.notify_one();
    }

    /// Takes the queued notices.
    pub fn take_notices(&self) -> Vec<Notice> {
        std::mem::take(&mut self.notices().queue)
    }

    /// Refusals so far, per policy.
    #[must_use]
    pub fn refusals(&self) -> Refusals {
        self.notices().refusals.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pod_is_told_once_per_policy_and_minute_but_every_refusal_counts() {
        let book = QuotaBook::default();
        let t0 = Instant::now();
        let n = |uid: &str| Notice {
            namespace: "team".into(),
            pod: format!("p-{uid}"),
            uid: uid.into(),
            policy: "team/q".into(),
            message: "m".into(),
        };
        book.refused(n("a"), t0);
        book.refused(n("a"), t0 + Duration::from_secs(1));
        book.refused(n("b"), t0 + Duration::from_secs(2));
        assert_eq!(book.take_notices().len(), 2);
        book.refused(n("a"), t0 + Duration::from_secs(59));
        assert!(book.take_notices().is_empty());
        book.refused(n("a"), t0 + Duration::from_secs(61));
        assert_eq!(book.take_notices().len(), 1);
        assert_eq!(book.refusals().get("team/q"), Some(&5));
    }

    #[test]
    fn an_unparseable_policy_names_the_field() {
        let obj: DynamicObject = serde_json::from_value(serde_json::json!({
            "apiVersion": "vgpu.io/v1alpha1", "kind": "VgpuQuotaPolicy",
            "metadata": {"name": "q", "namespace": "team", "generation": 3},
            "spec": {"totals": {"gpus": "four"}},
        }))
        .expect("object");
        let (ns, e) = read_policy(&obj).expect("named");
        assert_eq!(ns, "team");
        let err = e.rules.expect_err("does not parse").to_string();
        assert!(
            err.contains("policy team/q: spec") && err.contains("\"four\""),
            "{err}"
        );
    }
}
