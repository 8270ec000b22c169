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

use std::sync::{Mutex, MutexGuard};

use vgpu_core::packing::{
    Ledger, Placement, Policy, PolicyName, Rank, Reject, Scale, Scheduler, Task, VgpuParams,
    fragmentation_for,
};

/// Share of the workload the typical tasks cover (FGD's 95 %).
pub const TYPICAL_COVERAGE: f64 = 0.95;

/// Seed of the policy's random stream (`random`'s draws).
pub const POLICY_SEED: u64 = 0x5EED;

/// Shapes whose verdicts are cached at most; past that the cache starts afresh (pods
/// with one-off memory requests would otherwise grow it without bound).
const MAX_SHAPES: usize = 1024;

#[derive(Debug)]
struct Current {
    /// The policy core's scheduler: the same ranking the replay decides with.
    scheduler: Scheduler,
    /// Number of tasks the typical tasks were computed from.
    basis: usize,
}

/// The policy core's [`Scheduler`] behind a lock, refreshed from the ledger's workload.
///
/// Prioritize ranks candidates with [`Scheduler::rank_each`] and bind places with
/// [`Scheduler::place_on`], exactly as the replay's [`Scheduler::choose`] does: the
/// same cached scores, the same live secondary key (`vgpu`'s sum-of-squares choice
/// among tied GPUs, `random`'s draw), the same GPU.
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
            current: Mutex::new(Self::current(name, &Ledger::new(), &[])),
        }
    }

    /// The policy's name.
    #[must_use]
    pub fn name(&self) -> PolicyName {
        self.name
    }

    /// The core policy the extender decides with over `ledger` when its workload is
    /// `tasks`: typical tasks covering [`TYPICAL_COVERAGE`] of `tasks` (for `fgd` and
    /// `vgpu`, which adds the classes of left-out multi-GPU shapes: ADR 0006), [`POLICY_SEED`], the ledger's largest node as the scale.
    #[must_use]
    pub fn build(name: PolicyName, ledger: &Ledger, tasks: &[&Task]) -> Policy {
        let frag = fragmentation_for(
            name,
            &VgpuParams::default(),
            tasks.iter().copied(),
            TYPICAL_COVERAGE,
        );
        Policy::new(name, frag, POLICY_SEED, scale_of(ledger))
    }

    fn current(name: PolicyName, ledger: &Ledger, tasks: &[&Task]) -> Current {
        let order = (0..ledger.nodes().len()).collect();
        Current {
            scheduler: Scheduler::new(Self::build(name, ledger, tasks), order)
                .with_shape_limit(MAX_SHAPES),
            basis: tasks.len(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Current> {
        self.current
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Starts afresh over a rebuilt ledger (node indices may have changed) with the
    /// typical tasks of `tasks`.
    pub fn reset(&self, ledger: &Ledger, tasks: &[&Task]) {
        *self.lock() = Self::current(self.name, ledger, tasks);
    }

    /// Forgets what is cached about node `n`, whose GPUs' models (health) changed in
    /// place in the ledger.
    pub fn forget_node(&self, n: usize) {
        self.lock().scheduler.forget_node(n);
    }

    /// Whether the workload has moved enough (> 1 % or 100 pods) since the typical
    /// tasks were computed that they should be recomputed.
    #[must_use]
    pub fn stale(&self, tasks_now: usize) -> bool {
        let basis = self.lock().basis;
        let moved = tasks_now.abs_diff(basis);
        moved >= 100 || moved * 100 > basis.max(1)
    }

    /// Ranks candidates (prioritize), one `(node, task)` per candidate, under one lock:
    /// [`Scheduler::rank_each`], whose scores are cached per node state and pod shape
    /// (after the first pod of a shape only nodes that changed since are evaluated
    /// again) and whose live key is computed against the ledger as it is now.
    pub fn ranks(&self, ledger: &Ledger, items: &[Option<(usize, &Task)>]) -> Vec<Option<Rank>> {
        self.lock().scheduler.rank_each(ledger, items)
    }

    /// The concrete GPUs for `task` on node `n`, against the live ledger (bind):
    /// [`Scheduler::place_on`].
    pub fn place(&self, ledger: &Ledger, n: usize, task: &Task) -> Result<Placement, Reject> {
        self.lock().scheduler.place_on(ledger, task, n)
    }
}
