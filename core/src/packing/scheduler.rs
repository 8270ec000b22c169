//! Filter, score and choose over a ledger, with per-node caching of verdicts.
//!
//! A node's verdict for a task depends only on the node's state (its generation) and the
//! task, so it is cached per (node, task shape) and recomputed only after the node
//! changed: scheduling a task touches one node, so nearly every verdict is a cache hit.

use std::collections::HashMap;

use super::ledger::{Ledger, Placement, Reject, Task};
use super::policy::{Eval, Policy};

#[derive(Debug, Clone, Copy)]
struct Entry {
    /// Node generation + 1 at evaluation time; 0 = empty.
    generation: u64,
    /// `i64::MIN` when the node does not fit.
    score: i64,
    /// GPU pick + 1; 0 = none.
    pick: u32,
    /// GPUs tied with the pick.
    ties: u64,
}

const EMPTY: Entry = Entry {
    generation: 0,
    score: i64::MIN,
    pick: 0,
    ties: 0,
};

/// A policy over a ledger, with a fixed tie-breaking node order.
#[derive(Debug, Clone)]
pub struct Scheduler {
    policy: Policy,
    order: Vec<usize>,
    shapes: HashMap<Task, usize>,
    cache: Vec<Vec<Entry>>,
}

/// One node's filter verdict.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeVerdict {
    /// Node index.
    pub node: usize,
    /// Score when feasible, the reason otherwise.
    pub result: Result<i64, Reject>,
}

impl Scheduler {
    /// A scheduler; ties between equal scores go to the node that comes first in `order`
    /// (a permutation of the ledger's node indices; nodes missing from it are appended in
    /// index order).
    pub fn new(policy: Policy, order: Vec<usize>) -> Self {
        Scheduler {
            policy,
            order,
            shapes: HashMap::new(),
            cache: Vec::new(),
        }
    }

    /// The policy.
    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// The policy, mutably (to tune its parameters).
    pub fn policy_mut(&mut self) -> &mut Policy {
        &mut self.policy
    }

    fn sync_order(&mut self, n: usize) {
        if self.order.len() < n {
            let mut seen = vec![false; n];
            for &i in &self.order {
                if i < n {
                    seen[i] = true;
                }
            }
            for (i, s) in seen.iter().enumerate() {
                if !s {
                    self.order.push(i);
                }
            }
        }
        if self.cache.len() < n {
            self.cache.resize_with(n, Vec::new);
        }
    }

    fn shape_id(&mut self, task: &Task) -> usize {
        if let Some(&id) = self.shapes.get(task) {
            return id;
        }
        let id = self.shapes.len();
        self.shapes.insert(task.clone(), id);
        id
    }

    fn cached_eval(
        &mut self,
        ledger: &Ledger,
        n: usize,
        shape: usize,
        task: &Task,
    ) -> Option<Eval> {
        let node = ledger.node(n);
        if !self.policy.cacheable() {
            return self.policy.evaluate(n, node, task).ok();
        }
        let row = &mut self.cache[n];
        if row.len() <= shape {
            row.resize(shape + 1, EMPTY);
        }
        let e = row[shape];
        if e.generation == node.generation + 1 {
            return (e.score != i64::MIN).then(|| Eval {
                score: e.score,
                pick: e.pick.checked_sub(1).map(|p| p as usize),
                ties: e.ties,
            });
        }
        let r = self.policy.evaluate(n, node, task).ok();
        self.cache[n][shape] = Entry {
            generation: node.generation + 1,
            score: r.map_or(i64::MIN, |e| e.score),
            pick: r
                .and_then(|e| e.pick)
                .map_or(0, |p| u32::try_from(p + 1).expect("GPU index fits u32")),
            ties: r.map_or(0, |e| e.ties),
        };
        r
    }

    /// Chooses a node and concrete GPUs for `task`, or `None` when no node fits.
    pub fn choose(&mut self, ledger: &Ledger, task: &Task) -> Option<Placement> {
        let n_nodes = ledger.nodes().len();
        self.sync_order(n_nodes);
        let shape = self.shape_id(task);
        let mut best: Option<(usize, (i64, i64), Option<usize>)> = None;
        let hist = ledger.free_histogram();
        for k in 0..self.order.len() {
            let n = self.order[k];
            if n >= n_nodes {
                continue;
            }
            let node = ledger.node(n);
            if node.cpu_free < task.cpu_milli || node.memory_free < task.memory_mib {
                continue;
            }
            let Some(e) = self.cached_eval(ledger, n, shape, task) else {
                continue;
            };
            if best.is_some_and(|(_, (s, _), _)| e.score < s) {
                continue;
            }
            let (live, pick) = self
                .policy
                .live(node, task, &e, hist)
                .unwrap_or((0, e.pick));
            if best.is_none_or(|(_, key, _)| (e.score, live) > key) {
                best = Some((n, (e.score, live), pick));
            }
        }
        let (n, _, pick) = best?;
        let e = Eval {
            score: 0,
            pick,
            ties: 0,
        };
        let containers = ledger
            .node(n)
            .plan(task, e.pick)
            .expect("a node that was just evaluated as feasible has a plan");
        Some(Placement {
            node: n,
            containers,
        })
    }

    /// Filter and score for the given nodes: a score for each feasible node and a precise
    /// reason for each rejected one (uncached, for the extender's filter/prioritize).
    pub fn verdicts(&mut self, ledger: &Ledger, task: &Task, nodes: &[usize]) -> Vec<NodeVerdict> {
        nodes
            .iter()
            .map(|&n| NodeVerdict {
                node: n,
                result: if n < ledger.nodes().len() {
                    self.policy
                        .evaluate(n, ledger.node(n), task)
                        .map(|e| e.score)
                } else {
                    Err(Reject::UnknownNode(format!("#{n}")))
                },
            })
            .collect()
    }

    /// The concrete GPUs for `task` on node `n` (bind), against the live ledger.
    pub fn place_on(
        &mut self,
        ledger: &Ledger,
        task: &Task,
        n: usize,
    ) -> Result<Placement, Reject> {
        let node = ledger
            .nodes()
            .get(n)
            .ok_or_else(|| Reject::UnknownNode(format!("#{n}")))?;
        let e = self.policy.evaluate(n, node, task)?;
        let pick = self
            .policy
            .live(node, task, &e, ledger.free_histogram())
            .map_or(e.pick, |(_, p)| p);
        let containers = node.plan(task, pick)?;
        Ok(Placement {
            node: n,
            containers,
        })
    }
}
