//! Choosing a node for a task (cluster placement): filter, score and choose over a
//! ledger, with per-node caching of verdicts.
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
///
/// Every decision goes through one ranking ([`Scheduler::rank_each`]): the replay's
/// [`Scheduler::choose`], the extender's prioritize and its bind
/// ([`Scheduler::place_on`]) all see the same key for a node, so the node the extender
/// scores best is the node the replay would choose.
#[derive(Debug, Clone)]
pub struct Scheduler {
    policy: Policy,
    order: Vec<usize>,
    shapes: HashMap<Task, usize>,
    /// Verdicts by shape, then by node index: one shape's verdicts over every node
    /// lie side by side, as a ranking reads them.
    cache: Vec<Vec<Entry>>,
    /// Shapes remembered at most before the cache starts afresh (`None`: no limit).
    shape_limit: Option<usize>,
}

/// One node's filter verdict.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeVerdict {
    /// Node index.
    pub node: usize,
    /// Score when feasible, the reason otherwise.
    pub result: Result<i64, Reject>,
}

/// A feasible node's rank for a task: nodes compare by `(score, live)`, higher is better.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rank {
    /// The policy's score (cached per node state and task shape).
    pub score: i64,
    /// The policy's live secondary key ([`Policy::live`]: cluster-wide state, e.g. the
    /// sum-of-squares key of `vgpu`, or `random`'s fresh draw). Computed only for nodes
    /// that reach the best score seen so far in the ranking order (every node reaching the
    /// final best score has it); 0 elsewhere and for policies without one.
    pub live: i64,
    /// The GPU a single-share task takes on this node, when the policy chose one.
    pub pick: Option<usize>,
}

impl Rank {
    /// The comparison key.
    pub fn key(&self) -> (i64, i64) {
        (self.score, self.live)
    }
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
            shape_limit: None,
        }
    }

    /// Limits the number of task shapes whose verdicts are cached: past `limit` the cache
    /// starts afresh (a live cluster's pods with one-off memory requests would otherwise
    /// grow it without bound). Results do not change, only what is recomputed.
    pub fn with_shape_limit(mut self, limit: usize) -> Self {
        self.shape_limit = Some(limit.max(1));
        self
    }

    /// Forgets everything cached about node `n` (its spec changed in place, e.g. a GPU's
    /// health, so cached verdicts and the policy's per-node tables are void).
    pub fn forget_node(&mut self, n: usize) {
        for row in &mut self.cache {
            if let Some(e) = row.get_mut(n) {
                *e = EMPTY;
            }
        }
        self.policy.forget_node(n);
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
        for row in &mut self.cache {
            if row.len() < n {
                row.resize(n, EMPTY);
            }
        }
    }

    fn shape_id(&mut self, task: &Task) -> usize {
        if let Some(&id) = self.shapes.get(task) {
            return id;
        }
        if self.shape_limit.is_some_and(|l| self.shapes.len() >= l) {
            self.shapes.clear();
            self.cache.clear();
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
        if self.cache.len() <= shape {
            self.cache.resize_with(shape + 1, Vec::new);
        }
        let row = &mut self.cache[shape];
        if row.len() <= n {
            row.resize(ledger.nodes().len().max(n + 1), EMPTY);
        }
        let e = row[n];
        if e.generation == node.generation + 1 {
            return (e.score != i64::MIN).then(|| Eval {
                score: e.score,
                pick: e.pick.checked_sub(1).map(|p| p as usize),
                ties: e.ties,
            });
        }
        let r = self.policy.evaluate(n, node, task).ok();
        self.cache[shape][n] = Entry {
            generation: node.generation + 1,
            score: r.map_or(i64::MIN, |e| e.score),
            pick: r
                .and_then(|e| e.pick)
                .map_or(0, |p| u32::try_from(p + 1).expect("GPU index fits u32")),
            ties: r.map_or(0, |e| e.ties),
        };
        r
    }

    /// Ranks nodes for tasks, one `(node, task)` per item (`None` items and nodes that do
    /// not fit rank `None`). Items usually share one task; a node may need its own variant
    /// (the extender keeps new pods off unhealthy GPUs by narrowing the task's models).
    /// Ties keep item order: the first item with the best key is the choice.
    pub fn rank_each(
        &mut self,
        ledger: &Ledger,
        items: &[Option<(usize, &Task)>],
    ) -> Vec<Option<Rank>> {
        let n_nodes = ledger.nodes().len();
        self.sync_order(n_nodes);
        let hist = ledger.free_histogram();
        let whole_hist = ledger.whole_histogram();
        let mut shape: Option<(&Task, usize)> = None;
        let mut best: Option<i64> = None;
        let mut out = Vec::with_capacity(items.len());
        for item in items {
            let Some((n, task)) = *item else {
                out.push(None);
                continue;
            };
            if n >= n_nodes {
                out.push(None);
                continue;
            }
            let node = ledger.node(n);
            if node.cpu_free < task.cpu_milli || node.memory_free < task.memory_mib {
                out.push(None);
                continue;
            }
            let id = match shape {
                Some((t, id)) if std::ptr::eq(t, task) || *t == *task => id,
                _ => {
                    let id = self.shape_id(task);
                    shape = Some((task, id));
                    id
                }
            };
            let Some(e) = self.cached_eval(ledger, n, id, task) else {
                out.push(None);
                continue;
            };
            if best.is_some_and(|b| e.score < b) {
                out.push(Some(Rank {
                    score: e.score,
                    live: 0,
                    pick: e.pick,
                }));
                continue;
            }
            best = Some(e.score);
            let (live, pick) = self
                .policy
                .live(
                    node,
                    task,
                    &e,
                    hist,
                    whole_hist,
                    ledger.whole_histogram_of_size(node.gpus.len()),
                )
                .unwrap_or((0, e.pick));
            out.push(Some(Rank {
                score: e.score,
                live,
                pick,
            }));
        }
        out
    }

    /// [`Scheduler::rank_each`] with one task for every node.
    pub fn rank(
        &mut self,
        ledger: &Ledger,
        task: &Task,
        nodes: &[Option<usize>],
    ) -> Vec<Option<Rank>> {
        let items: Vec<Option<(usize, &Task)>> =
            nodes.iter().map(|n| n.map(|n| (n, task))).collect();
        self.rank_each(ledger, &items)
    }

    /// Chooses a node and concrete GPUs for `task`, or `None` when no node fits: the
    /// best [`Rank`], ties to the scheduler's node order.
    pub fn choose(&mut self, ledger: &Ledger, task: &Task) -> Option<Placement> {
        self.sync_order(ledger.nodes().len());
        let nodes: Vec<Option<usize>> = self
            .order
            .iter()
            .map(|&n| (n < ledger.nodes().len()).then_some(n))
            .collect();
        let ranks = self.rank(ledger, task, &nodes);
        let mut best: Option<(usize, Rank)> = None;
        for (n, r) in nodes.iter().zip(&ranks) {
            if let (Some(n), Some(r)) = (n, r)
                && best.is_none_or(|(_, b)| r.key() > b.key())
            {
                best = Some((*n, *r));
            }
        }
        let (n, r) = best?;
        let containers = ledger
            .node(n)
            .plan(task, r.pick)
            .expect("a node that was just evaluated as feasible has a plan");
        Some(Placement {
            node: n,
            containers,
        })
    }

    /// Filter and score for the given nodes: a score for each feasible node and a precise
    /// reason for each rejected one (uncached).
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

    /// The concrete GPUs for `task` on node `n` (the extender's bind), against the live
    /// ledger: the GPU the node's [`Rank`] carries, so a bind on the node
    /// [`Scheduler::choose`] would take places the task exactly as `choose` does.
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
        let Some(rank) = self.rank(ledger, task, &[Some(n)]).pop().flatten() else {
            // Not feasible: the ledger's own check says precisely why.
            return Err(node
                .fit(task)
                .err()
                .unwrap_or_else(|| Reject::UnknownNode(format!("#{n}"))));
        };
        let containers = node.plan(task, rank.pick)?;
        Ok(Placement {
            node: n,
            containers,
        })
    }
}
