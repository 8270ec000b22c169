//! Quota policies against the ledger (ADR 0022): a namespace's use is what the ledger
//! holds for its pods and assumptions; filter rejects the nodes where a pod would break a
//! policy; bind checks again, exactly, on the GPUs it chose, under the exclusive lock
//! that also commits them (so the last of a total goes to one pod only). The rules and
//! their messages are `quota::rules`'.

use std::collections::HashSet;

use vgpu_core::resources::parse_compute_class;

use super::*;
use crate::extender::quota::rules::{Usage, Violation, apply_defaults};
use crate::extender::quota::{NamespaceRules, Notice};

/// A policy's verdict on a node (the reason, once written), by the node's smallest GPU
/// memory and the GPUs the pod would add there: nodes alike share it.
type NodeVerdict = Option<(Arc<str>, Violation)>;

/// The namespace of a `namespace/name` key.
fn namespace_of(key: &str) -> &str {
    key.split_once('/').map_or("", |(ns, _)| ns)
}

impl Inner {
    /// Every namespace's use, from the ledger (pods and live assumptions), with the GPUs
    /// (ledger node, device index) each holds a share of.
    pub(super) fn quota_usage(&self) -> BTreeMap<String, (Usage, HashSet<(usize, u16)>)> {
        self.usage_where(|_| true)
    }

    /// One namespace's use (see [`Inner::quota_usage`]).
    fn namespace_usage(&self, namespace: &str) -> (Usage, HashSet<(usize, u16)>) {
        self.usage_where(|ns| ns == namespace)
            .remove(namespace)
            .unwrap_or_default()
    }

    fn usage_where(
        &self,
        want: impl Fn(&str) -> bool,
    ) -> BTreeMap<String, (Usage, HashSet<(usize, u16)>)> {
        let mut out: BTreeMap<String, (Usage, HashSet<(usize, u16)>)> = BTreeMap::new();
        let mut seen: HashSet<&str> = HashSet::new();
        let keyed = self
            .pods
            .iter()
            .map(|(uid, p)| (uid, &p.key))
            .chain(self.assumptions.iter().map(|(uid, a)| (uid, &a.key)));
        for (uid, key) in keyed {
            let ns = namespace_of(key);
            if !want(ns) || !seen.insert(uid.as_str()) {
                continue;
            }
            let Some(p) = self.ledger.placement(uid) else {
                continue;
            };
            let (u, gpus) = out.entry(ns.to_owned()).or_default();
            u.pods += 1;
            for g in p.containers.iter().flatten() {
                u.memory_mib += g.memory_mib;
                u.compute_milli += u64::from(g.milli);
                gpus.insert((p.node, g.gpu));
            }
            u.gpus = gpus.len() as u64;
        }
        out
    }
}

/// The first reason the namespace's rules refuse the pod whatever the node: an invalid
/// policy, or a compute class the policies do not allow.
fn refused_anywhere(rules: &NamespaceRules, pod: &Pod) -> Option<Violation> {
    if let Some(e) = rules.invalid.first() {
        return Some(Violation {
            policy: e.policy.clone(),
            what: format!("the policy is invalid, so the namespace takes no new GPU pod: {e}"),
        });
    }
    let empty = BTreeMap::new();
    let annotations = pod.metadata.annotations.as_ref().unwrap_or(&empty);
    // A bad class is the request's error, reported before this runs.
    let (policy, priority) = parse_compute_class(annotations).ok()?;
    rules
        .valid
        .iter()
        .find_map(|r| r.check_class(policy, priority).err())
}

/// Which vgpu.io resources each container of the pod sets itself (requests or limits).
fn given_resources(pod: &Pod) -> BTreeMap<String, Vec<String>> {
    let Some(spec) = pod.spec.as_ref() else {
        return BTreeMap::new();
    };
    spec.init_containers
        .iter()
        .flatten()
        .chain(&spec.containers)
        .map(|c| {
            let res = c.resources.as_ref();
            let names = res
                .and_then(|r| r.requests.as_ref())
                .into_iter()
                .chain(res.and_then(|r| r.limits.as_ref()))
                .flat_map(|m| m.keys().cloned())
                .collect();
            (c.name.clone(), names)
        })
        .collect()
}

impl State {
    /// The quota policies the extender holds.
    #[must_use]
    pub fn quota(&self) -> &crate::extender::quota::QuotaBook {
        &self.quota
    }

    /// Every namespace's use now (the ledger's view), for the policies' status and the
    /// metrics.
    #[must_use]
    pub fn quota_usage(&self) -> BTreeMap<String, Usage> {
        self.read()
            .quota_usage()
            .into_iter()
            .map(|(ns, (u, _))| (ns, u))
            .collect()
    }

    /// The pod's request with its namespace's defaults applied (the first valid policy,
    /// by name, that sets them).
    pub(super) fn with_quota_defaults(
        &self,
        pod: &Pod,
        mut request: PodGpuRequest,
    ) -> PodGpuRequest {
        if request.is_empty() {
            return request;
        }
        let ns = pod.metadata.namespace.as_deref().unwrap_or("default");
        let rules = self.quota.namespace(ns);
        let defaults = rules
            .valid
            .iter()
            .find(|r| r.default_memory_mib.is_some() || r.default_compute_milli.is_some());
        if let Some(r) = defaults {
            apply_defaults(r, &given_resources(pod), &mut request);
        }
        request
    }

    fn notice(&self, pod_key: &str, uid: &str, v: &Violation) {
        let (ns, name) = pod_key.split_once('/').unwrap_or(("", pod_key));
        self.quota.refused(
            Notice {
                namespace: ns.to_owned(),
                pod: name.to_owned(),
                uid: uid.to_owned(),
                policy: v.policy.clone(),
                message: v.to_string(),
            },
            Instant::now(),
        );
    }

    /// Filter's policy pass: moves every feasible node where the pod would break one of
    /// its namespace's policies to the unresolvable ones, with the reason (evicting other
    /// namespaces' pods cannot help). Memory in proportion is resolved on the node's
    /// smallest GPU and new GPUs counted after the ones the namespace holds there, so
    /// filter never refuses what bind's exact check would accept.
    pub(super) fn quota_filter(
        &self,
        inner: &Inner,
        pod: &Pod,
        request: &PodGpuRequest,
        task: &Task,
        candidates: &Candidates<'_>,
        outcome: &mut FilterOutcome,
    ) {
        let ns = pod.metadata.namespace.as_deref().unwrap_or("default");
        let rules = self.quota.namespace(ns);
        if rules.is_empty() || outcome.feasible.is_empty() {
            return;
        }
        let key = pod_key(pod);
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        let mut last = None;
        if let Some(v) = refused_anywhere(&rules, pod) {
            let reason: Arc<str> = v.to_string().into();
            for i in outcome.feasible.drain(..) {
                outcome.unresolvable.push((i, reason.clone()));
            }
            self.notice(&key, &uid, &v);
            return;
        }
        let (used, touched) = inner.namespace_usage(ns);
        let mut reasons: HashMap<(u64, u64), NodeVerdict> = HashMap::new();
        let mut kept = Vec::with_capacity(outcome.feasible.len());
        for &i in &outcome.feasible {
            let Ok((slot, _)) = inner.locate(candidates.names[i]) else {
                kept.push(i);
                continue;
            };
            let spec = &inner.ledger.node(slot).spec;
            let gpu_mib = spec.gpus.iter().map(|g| g.memory_mib).min().unwrap_or(0);
            let held_here = touched.iter().filter(|(n, _)| *n == slot).count() as u64;
            let wanted: u64 = task.gpus.iter().map(|d| u64::from(d.count)).sum();
            let new_gpus = wanted.saturating_sub(held_here);
            let verdict = reasons.entry((gpu_mib, new_gpus)).or_insert_with(|| {
                let asked = Usage {
                    memory_mib: task
                        .gpus
                        .iter()
                        .map(|d| u64::from(d.count) * d.memory.resolve(gpu_mib))
                        .sum(),
                    compute_milli: task.total_gpu_milli(),
                    gpus: new_gpus,
                    pods: 1,
                };
                rules
                    .valid
                    .iter()
                    .find_map(|r| {
                        request
                            .containers
                            .iter()
                            .find_map(|c| {
                                r.check_container(
                                    &c.name,
                                    c.demand.compute_milli,
                                    c.demand.memory.resolve(gpu_mib),
                                )
                                .err()
                            })
                            .or_else(|| r.check_totals(&used, &asked).err())
                    })
                    .map(|v| (Arc::from(v.to_string()), v))
            });
            match verdict {
                Some((reason, v)) => {
                    outcome.unresolvable.push((i, reason.clone()));
                    last = Some(v.clone());
                }
                None => kept.push(i),
            }
        }
        outcome.feasible = kept;
        if outcome.feasible.is_empty()
            && let Some(v) = last
        {
            self.notice(&key, &uid, &v);
        }
    }

    /// Bind's policy check, under the exclusive lock before the commit: the exact grants
    /// of the decision (`grants`: the ledger's entries; `assignment`: each container's)
    /// against the namespace's use now.
    pub(super) fn quota_admit(
        &self,
        inner: &Inner,
        key: &str,
        uid: &str,
        node: &str,
        node_index: usize,
        grants: &[Vec<Grant>],
        assignment: &Assignment,
    ) -> Result<(), ExtenderError> {
        let ns = namespace_of(key);
        let rules = self.quota.namespace(ns);
        if rules.is_empty() {
            return Ok(());
        }
        let refuse = |v: Violation| {
            self.notice(key, uid, &v);
            ExtenderError::NoLongerFits {
                pod: key.to_owned(),
                node: node.to_owned(),
                reason: v.to_string(),
            }
        };
        if let Some(e) = rules.invalid.first() {
            return Err(refuse(Violation {
                policy: e.policy.clone(),
                what: format!("the policy is invalid, so the namespace takes no new GPU pod: {e}"),
            }));
        }
        let (used, touched) = inner.namespace_usage(ns);
        let mut new: HashSet<(usize, u16)> = HashSet::new();
        let mut asked = Usage {
            pods: 1,
            ..Usage::default()
        };
        for g in grants.iter().flatten() {
            asked.memory_mib += g.memory_mib;
            asked.compute_milli += u64::from(g.milli);
            if !touched.contains(&(node_index, g.gpu)) {
                new.insert((node_index, g.gpu));
            }
        }
        asked.gpus = new.len() as u64;
        for r in &rules.valid {
            for c in &assignment.containers {
                for g in &c.gpus {
                    r.check_container(&c.name, g.compute_milli, g.memory_mib)
                        .map_err(&refuse)?;
                }
            }
            r.check_totals(&used, &asked).map_err(&refuse)?;
        }
        Ok(())
    }
}
