//! The placement policy as the live extender uses it.
//!
//! The policy core ([`vgpu_core::packing::Policy`]) scores a node and picks GPUs
//! within it; it keeps caches (the fragmentation model's per-node tables) and,
//! for `fgd` and the default `vgpu`, needs the workload's *typical tasks*. The
//! replay takes those from the trace; the live extender takes them from the
//! cluster: the shapes of every pod the ledger holds (recomputed when the ledger
//! is rebuilt and when the pod count has moved by more than 1 %), so the
//! fragmentation measure follows the workload actually running. With no pods
//! yet, every node's fragmentation is 0: scores tie except for the policy's own
//! tie-breaker, and kube-scheduler's other scores decide.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};

use vgpu_core::packing::{
    Fragmentation, Grant, Ledger, Policy, PolicyName, Reject, Scale, Task, typical_tasks,
};

/// Share of the workload the typical tasks cover (FGD's 95 %).
pub const TYPICAL_COVERAGE: f64 = 0.95;

/// Cached score of one (node, pod shape): valid while the node's generation is
/// unchanged (a node's score depends only on its state, the task and the typical
/// tasks, and a new set of typical tasks starts a new cache).
#[derive(Debug, Clone, Copy)]
struct Cached {
    /// Node generation + 1 when computed; 0 = empty.
    generation: u64,
    /// `i64::MIN` when the node does not fit.
    score: i64,
}

const EMPTY: Cached = Cached {
    generation: 0,
    score: i64::MIN,
};

/// Shapes remembered at most; past that the cache starts afresh (pods with
/// one-off memory requests would otherwise grow it without bound).
const MAX_SHAPES: usize = 1024;

#[derive(Debug)]
struct Current {
    policy: Policy,
    /// Number of tasks the typical tasks were computed from.
    basis: usize,
    shapes: HashMap<Task, usize>,
    /// Per node index, per shape id.
    cache: Vec<Vec<Cached>>,
}

impl Current {
    fn new(policy: Policy, basis: usize) -> Self {
        Self {
            policy,
            basis,
            shapes: HashMap::new(),
            cache: Vec::new(),
        }
    }

    fn shape_id(&mut self, task: &Task) -> usize {
        if let Some(&id) = self.shapes.get(task) {
            return id;
        }
        if self.shapes.len() >= MAX_SHAPES {
            self.shapes.clear();
            self.cache.clear();
        }
        let id = self.shapes.len();
        self.shapes.insert(task.clone(), id);
        id
    }
}

/// A [`Policy`] behind a lock, refreshed from the ledger's workload.
#[derive(Debug)]
pub struct ExtenderPolicy {
    name: PolicyName,
    current: Mutex<Current>,
}

fn scale_of(ledger: &Ledger) -> Scale {
    Scale {
        cpu_milli: ledger
            .nodes()
            .iter()
            .map(|n| n.spec.cpu_milli)
            .max()
            .unwrap_or(0),
        gpu_milli: ledger
            .nodes()
            .iter()
            .map(|n| 1000 * n.spec.gpus.len() as u64)
            .max()
            .unwrap_or(0),
    }
}

impl ExtenderPolicy {
    /// A policy by name, with no workload yet.
    #[must_use]
    pub fn new(name: PolicyName) -> Self {
        Self {
            name,
            current: Mutex::new(Current::new(Self::build(name, &Ledger::new(), &[]), 0)),
        }
    }

    /// The policy's name.
    #[must_use]
    pub fn name(&self) -> PolicyName {
        self.name
    }

    fn build(name: PolicyName, ledger: &Ledger, tasks: &[&Task]) -> Policy {
        let frag = name
            .needs_typical_tasks()
            .then(|| Fragmentation::new(typical_tasks(tasks.iter().copied(), TYPICAL_COVERAGE)));
        Policy::new(name, frag, 0x5EED, scale_of(ledger))
    }

    fn lock(&self) -> MutexGuard<'_, Current> {
        self.current
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Starts afresh over a rebuilt ledger (node indices may have changed) with the
    /// typical tasks of `tasks`.
    pub fn reset(&self, ledger: &Ledger, tasks: &[&Task]) {
        let policy = Self::build(self.name, ledger, tasks);
        *self.lock() = Current::new(policy, tasks.len());
    }

    /// Whether the workload has moved enough (> 1 % or 100 pods) since the typical
    /// tasks were computed that they should be recomputed.
    #[must_use]
    pub fn stale(&self, tasks_now: usize) -> bool {
        let basis = self.lock().basis;
        let moved = tasks_now.abs_diff(basis);
        moved >= 100 || moved * 100 > basis.max(1)
    }

    /// The policy's score for `task` on node `n` (higher is better), or why it does not fit.
    pub fn score(&self, ledger: &Ledger, n: usize, task: &Task) -> Result<i64, Reject> {
        let node = ledger
            .nodes()
            .get(n)
            .ok_or_else(|| Reject::UnknownNode(format!("#{n}")))?;
        self.lock().policy.evaluate(n, node, task).map(|e| e.score)
    }

    /// Scores of several nodes under one lock (prioritize), cached per node state
    /// and pod shape: after the first pod of a shape, only nodes that changed since
    /// are evaluated again.
    pub fn scores(
        &self,
        ledger: &Ledger,
        task: &Task,
        nodes: &[Option<usize>],
    ) -> Vec<Option<i64>> {
        let mut current = self.lock();
        let cacheable = current.policy.cacheable();
        let shape = current.shape_id(task);
        if current.cache.len() < ledger.nodes().len() {
            current.cache.resize_with(ledger.nodes().len(), Vec::new);
        }
        nodes
            .iter()
            .map(|n| {
                let n = (*n)?;
                let node = ledger.nodes().get(n)?;
                if !cacheable {
                    return current.policy.evaluate(n, node, task).ok().map(|e| e.score);
                }
                let row = &mut current.cache[n];
                if row.len() <= shape {
                    row.resize(shape + 1, EMPTY);
                }
                let hit = row[shape];
                if hit.generation == node.generation + 1 {
                    return (hit.score != i64::MIN).then_some(hit.score);
                }
                let score = current.policy.evaluate(n, node, task).ok().map(|e| e.score);
                current.cache[n][shape] = Cached {
                    generation: node.generation + 1,
                    score: score.unwrap_or(i64::MIN),
                };
                score
            })
            .collect()
    }

    /// The concrete GPUs for `task` on node `n`, against the live ledger (bind).
    pub fn place(&self, ledger: &Ledger, n: usize, task: &Task) -> Result<Vec<Vec<Grant>>, Reject> {
        let node = ledger
            .nodes()
            .get(n)
            .ok_or_else(|| Reject::UnknownNode(format!("#{n}")))?;
        let eval = self.lock().policy.evaluate(n, node, task)?;
        node.plan(task, eval.pick)
    }
}
