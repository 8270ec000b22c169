//! The verbs over the state: filter (every feasible node, a precise reason for each
//! other), prioritize (the policy's ranks on `0..=10`), bind (decide and assume under
//! the write lock, then confirm or abort) and preemption. The state they read and the
//! watches that keep it are [`super`]'s.

use super::*;

impl State {
    fn request_for(&self, pod: &Pod) -> Result<PodGpuRequest, ExtenderError> {
        let request = self.with_quota_defaults(pod, pod_request(pod)?);
        let topology = topology_requirement(pod)?;
        if let Some(uid) = pod.metadata.uid.clone() {
            self.pending().insert(
                uid,
                Pending {
                    request: request.clone(),
                    topology,
                    until: Instant::now() + self.config.pending_ttl,
                },
            );
        }
        Ok(request)
    }

    /// Filter: every feasible candidate, and a precise reason for each other one.
    pub fn filter(
        &self,
        pod: &Pod,
        candidates: &Candidates<'_>,
    ) -> Result<FilterOutcome, ExtenderError> {
        let request = self.request_for(pod)?;
        let inner = self.read();
        if !inner.synced() {
            return Err(ExtenderError::NotSynced);
        }
        let mut outcome = FilterOutcome::default();
        if request.is_empty() {
            outcome.feasible = (0..candidates.names.len()).collect();
            return Ok(outcome);
        }
        let task = task_of(&request, &slots_of(&request, &pod_key(pod))?);
        let topology = topology_requirement(pod)?;
        // Thousands of nodes share a handful of reasons: each is written once.
        let mut reasons: HashMap<Reject, Arc<str>> = HashMap::new();
        for (i, name) in candidates.names.iter().enumerate() {
            let verdict = inner.verdict(name, &task).and_then(|()| {
                inner
                    .topology_verdict(name, &task, topology)
                    .map_err(Why::Reject)
            });
            match verdict {
                Ok(()) => outcome.feasible.push(i),
                Err(Why::Unusable(reason)) => outcome.unresolvable.push((i, reason.into())),
                Err(Why::Reject(r)) => {
                    let list = if resolvable(&r) {
                        &mut outcome.failed
                    } else {
                        &mut outcome.unresolvable
                    };
                    let reason = match reasons.get(&r) {
                        Some(text) => text.clone(),
                        None => {
                            let text: Arc<str> = r.to_string().into();
                            reasons.insert(r, text.clone());
                            text
                        }
                    };
                    list.push((i, reason));
                }
            }
        }
        self.quota_filter(&inner, pod, &request, &task, candidates, &mut outcome);
        Ok(outcome)
    }

    /// Prioritize: the policy's scores, mapped onto `0..=10` so that the best
    /// node(s) get 10 and every other node at most 9, in proportion.
    pub fn prioritize<'a>(
        &self,
        pod: &Pod,
        candidates: &Candidates<'a>,
    ) -> Result<Vec<HostPriorityRef<'a>>, ExtenderError> {
        let request = self.request_for(pod)?;
        let inner = self.read();
        if !inner.synced() {
            return Err(ExtenderError::NotSynced);
        }
        if request.is_empty() {
            return Ok(normalise(candidates, &vec![None; candidates.names.len()]));
        }
        let base = task_of(&request, &slots_of(&request, &pod_key(pod))?);
        // Nodes that filter would reject rank nothing; the others are ranked in one
        // pass of the policy core's scheduler (the replay's ranking), each with the
        // task as its node sees it (unhealthy GPUs excluded).
        let located: Vec<Option<(usize, Cow<'_, Task>)>> = candidates
            .names
            .iter()
            .map(|name| {
                let (i, unhealthy) = inner.locate(name).ok()?;
                let task = if unhealthy {
                    effective_task(&base, &inner.ledger.node(i).spec, true)
                } else {
                    Cow::Borrowed(&base)
                };
                Some((i, task))
            })
            .collect();
        let items: Vec<Option<(usize, &Task)>> = located
            .iter()
            .map(|l| l.as_ref().map(|(i, t)| (*i, t.as_ref())))
            .collect();
        let raw = self.policy.ranks(&inner.ledger, &items);
        Ok(normalise(candidates, &raw))
    }

    /// Bind, step 1 (atomic): decide the GPUs for the pod on `args.node` against
    /// the live ledger and hold them as an assumption; returns what to write.
    pub fn begin_bind(&self, args: &ExtenderBindingArgs) -> Result<BindPlan, ExtenderError> {
        let key = format!("{}/{}", args.pod_namespace, args.pod_name);
        let pending = self.pending().get(&args.pod_uid).cloned();
        let mut inner = self.write();
        if !inner.synced() {
            return Err(ExtenderError::NotSynced);
        }
        let plan = |a: &Assignment| BindPlan {
            namespace: args.pod_namespace.clone(),
            name: args.pod_name.clone(),
            uid: args.pod_uid.clone(),
            node: args.node.clone(),
            assignment_json: a.to_json(),
            already_bound: false,
        };
        // A retried bind to the same node reuses its decision (never decides twice).
        if let Some(a) = inner.assumptions.get_mut(&args.pod_uid) {
            if a.state == AssumeState::InFlight {
                return Err(ExtenderError::BindInFlight { pod: key });
            }
            if a.node == args.node {
                a.state = AssumeState::InFlight;
                return Ok(plan(&a.assignment));
            }
        }
        // Already bound there with its record (a bind retried after it landed): done.
        if let Some(a) = inner.pods.get(&args.pod_uid).and_then(PodEntry::counted)
            && a.node == args.node
        {
            return Ok(BindPlan {
                already_bound: true,
                ..plan(a)
            });
        }
        // The topology requirement is known from the pod's filter (the pod watch keeps
        // only its request); without one, the plan still takes the best sets.
        let topology = pending
            .as_ref()
            .map_or(TopologyRequirement::Any, |p| p.topology);
        let request = match pending {
            Some(p) => p.request,
            None => match inner.pods.get(&args.pod_uid).map(|p| p.request.clone()) {
                Some(Ok(Some(r))) => r,
                Some(Err(reason)) => return Err(ExtenderError::BadPodRequest { pod: key, reason }),
                Some(Ok(None)) => PodGpuRequest::default(),
                None => return Err(ExtenderError::UnknownPod { pod: key }),
            },
        };
        // A different decision for this pod (another node) replaces the old one.
        if inner.assumptions.remove(&args.pod_uid).is_some() {
            inner.reconcile(&args.pod_uid);
        }
        let unknown = || ExtenderError::UnknownNode {
            pod: key.clone(),
            node: args.node.clone(),
        };
        let node_index = inner.ledger.node_index(&args.node).ok_or_else(unknown)?;
        let unavailable = inner
            .nodes
            .get(&args.node)
            .and_then(|e| e.unavailable.clone());
        if let Some(reason) = unavailable.or_else(|| inner.conflict_on(&args.node)) {
            return Err(ExtenderError::NoLongerFits {
                pod: key,
                node: args.node.clone(),
                reason,
            });
        }
        let spec = inner.ledger.node(node_index).spec.clone();
        let unhealthy = inner.nodes.get(&args.node).is_some_and(|e| e.unhealthy);
        let slots = slots_of(&request, &key)?;
        let task = effective_task(&task_of(&request, &slots), &spec, unhealthy).into_owned();
        let placement = self
            .policy
            .place(&inner.ledger, node_index, &task)
            .and_then(|p| {
                let node = inner.ledger.node(node_index);
                node.check_topology(&p.containers, topology).map(|()| p)
            })
            .map_err(|r| ExtenderError::NoLongerFits {
                pod: key.clone(),
                node: args.node.clone(),
                reason: r.to_string(),
            })?;
        let grants = placement.containers.clone();
        // Each container's share: a reuse group's members each on all of the group's GPUs.
        let per_container = reuse::expand(&request.containers, &slots, &grants, |g| {
            spec.gpus.get(usize::from(g)).map_or(0, |s| s.memory_mib)
        });
        let assignment = Assignment {
            version: ASSIGNMENT_VERSION,
            node: args.node.clone(),
            containers: request
                .containers
                .iter()
                .zip(&per_container)
                .map(|(c, gs)| ContainerAssignment {
                    name: c.name.clone(),
                    gpus: gs
                        .iter()
                        .map(|g| GpuGrant {
                            uuid: spec.gpus[usize::from(g.gpu)].uuid.clone(),
                            compute_milli: g.milli,
                            memory_mib: g.memory_mib,
                            slices: g.slices,
                        })
                        .collect(),
                })
                .collect(),
        };
        // The namespace's quota policies, on these exact grants (ADR 0022).
        self.quota_admit(
            &inner,
            &key,
            &args.pod_uid,
            &args.node,
            node_index,
            &grants,
            &assignment,
        )?;
        // The commit re-checks every GPU: the decision and its reservation are one
        // step under the write lock.
        inner
            .ledger
            .commit(&args.pod_uid, &task, placement)
            .map_err(|e| ExtenderError::NoLongerFits {
                pod: key.clone(),
                node: args.node.clone(),
                reason: e.to_string(),
            })?;
        inner.assumptions.insert(
            args.pod_uid.clone(),
            Assumption {
                key,
                node: args.node.clone(),
                task,
                placement_grants: grants,
                assignment: assignment.clone(),
                state: AssumeState::InFlight,
            },
        );
        Ok(plan(&assignment))
    }

    /// Bind, step 2 on success: hold the assumption until the watch confirms the
    /// pod, or the TTL runs out.
    pub fn finish_bind(&self, uid: &str) {
        let mut inner = self.write();
        let confirmed = inner.pods.get(uid).is_some_and(|p| p.counted().is_some());
        if confirmed {
            inner.assumptions.remove(uid);
            inner.reconcile(uid);
        } else if let Some(a) = inner.assumptions.get_mut(uid) {
            a.state = AssumeState::Held {
                until: Instant::now() + self.config.assume_ttl,
            };
        }
    }

    /// Bind, step 2 on failure: release the GPUs at once, or, if the failure may
    /// have taken effect on the API server, hold them until the TTL.
    pub fn abort_bind(&self, uid: &str, uncertain: bool) {
        let mut inner = self.write();
        if uncertain {
            if let Some(a) = inner.assumptions.get_mut(uid) {
                a.state = AssumeState::Held {
                    until: Instant::now() + self.config.assume_ttl,
                };
            }
        } else if inner.assumptions.remove(uid).is_some() {
            inner.reconcile(uid);
        }
    }

    /// Preempt: of the proposed nodes, those where evicting the victims frees
    /// enough GPU for the pod (victims unchanged).
    pub fn preempt(
        &self,
        pod: &Pod,
        args: &ExtenderPreemptionArgs,
    ) -> Result<BTreeMap<String, MetaVictims>, ExtenderError> {
        let request = pod_request(pod)?;
        let task = task_of(&request, &slots_of(&request, &pod_key(pod))?);
        let inner = self.read();
        if !inner.synced() {
            return Err(ExtenderError::NotSynced);
        }
        let proposals: Vec<(String, Vec<String>, i64)> =
            match (&args.node_name_to_meta_victims, &args.node_name_to_victims) {
                (Some(meta), _) => meta
                    .iter()
                    .map(|(n, v)| {
                        (
                            n.clone(),
                            v.pods.iter().map(|p| p.uid.clone()).collect(),
                            v.num_pdb_violations,
                        )
                    })
                    .collect(),
                (None, Some(full)) => full
                    .iter()
                    .map(|(n, v)| {
                        (
                            n.clone(),
                            v.pods
                                .iter()
                                .filter_map(|p| p.metadata.uid.clone())
                                .collect(),
                            v.num_pdb_violations,
                        )
                    })
                    .collect(),
                (None, None) => Vec::new(),
            };
        let mut out = BTreeMap::new();
        for (name, victims, pdb) in proposals {
            let Some(i) = inner.ledger.node_index(&name) else {
                continue;
            };
            let mut node = inner.ledger.node(i).clone();
            for uid in &victims {
                if let Some(p) = inner.ledger.placement(uid) {
                    for g in p.containers.iter().flatten() {
                        let f = &mut node.gpus[usize::from(g.gpu)];
                        f.milli += g.milli;
                        f.memory_mib += g.memory_mib;
                        f.slices += g.slices;
                    }
                }
            }
            let unhealthy = inner.nodes.get(&name).is_some_and(|e| e.unhealthy);
            let task = effective_task(&task, &node.spec, unhealthy);
            if request.is_empty() || node.fit(&task).is_ok() {
                out.insert(
                    name,
                    MetaVictims {
                        pods: victims.into_iter().map(|uid| MetaPod { uid }).collect(),
                        num_pdb_violations: pdb,
                    },
                );
            }
        }
        Ok(out)
    }
}

/// Maps the policy's ranks (`None`: does not fit) onto `0..=10`: the node(s) with
/// the best key `(score, live)` get 10, every other node
/// `min(9, ⌊9·(score − min)/(max − min)⌋)` over the primary scores (so a node tied
/// on the score but not on the live key gets 9), and nodes that do not fit 0.
fn normalise<'a>(candidates: &Candidates<'a>, raw: &[Option<Rank>]) -> Vec<HostPriorityRef<'a>> {
    let present = raw.iter().flatten();
    let best = present.clone().map(Rank::key).max();
    let max = present.clone().map(|r| r.score).max();
    let min = present.map(|r| r.score).min();
    candidates
        .names
        .iter()
        .zip(raw)
        .map(|(name, r)| {
            let score = match (r, min, max) {
                (Some(r), Some(lo), Some(hi)) => {
                    if Some(r.key()) == best {
                        MAX_EXTENDER_PRIORITY
                    } else {
                        let span = i128::from(hi) - i128::from(lo);
                        let v = (i128::from(r.score) - i128::from(lo))
                            * i128::from(MAX_EXTENDER_PRIORITY - 1)
                            / span.max(1);
                        i64::try_from(v).unwrap_or(0).min(MAX_EXTENDER_PRIORITY - 1)
                    }
                }
                _ => 0,
            };
            HostPriorityRef { host: name, score }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalise_gives_the_best_ten_and_others_less() {
        let names = Candidates {
            names: vec!["a", "b", "c", "d"],
        };
        let r = |score, live| {
            Some(Rank {
                score,
                live,
                pick: None,
            })
        };
        let list = normalise(&names, &[r(50, 0), r(100, 0), r(99, 0), None]);
        let scores: Vec<i64> = list.iter().map(|h| h.score).collect();
        assert_eq!(scores, vec![0, 10, 8, 0]);
        let all_equal = normalise(&names, &[r(3, 0), r(3, 0), r(3, 0), r(3, 0)]);
        assert!(all_equal.iter().all(|h| h.score == 10));
        // The live key decides among equal scores: the runner-up gets 9.
        let live = normalise(&names, &[r(7, -3), r(7, 5), r(2, 9), r(7, 5)]);
        let scores: Vec<i64> = live.iter().map(|h| h.score).collect();
        assert_eq!(scores, vec![9, 10, 0, 10]);
    }
}
