//! Fragmentation as FGD measures it (Weng et al., "Beware of Fragmentation", ATC'23).
//!
//! The workload is summarised by its *typical tasks*: the most frequent task shapes
//! (CPU, per-GPU milli, GPU count, model constraint; memory ignored; CPU-only tasks
//! included) that together cover a given share (95 %) of the tasks, each with its
//! frequency renormalised over the chosen shapes. A node's fragmentation is
//!
//! ```text
//! F(n) = Σ_t  w_t · frag_t(n)
//! frag_t(n) = all free milli-GPU of n                       if t cannot run on n at all
//!                                                           (CPU-only task, model excluded,
//!                                                            CPU short, too few GPUs with room)
//!           = Σ free milli of the GPUs with less than t needs  otherwise
//! ```
//!
//! and placing a task is scored by how much it lowers F. Per node, the per-typical-task
//! counts (GPUs with room, free milli below the need) are computed once per node state,
//! after which each candidate GPU of a sharing task is evaluated in O(typical tasks).

use std::collections::{BTreeMap, HashMap, HashSet};

use super::ledger::{NodeState, Task};
use crate::resources::ModelConstraint;
use crate::topology::LinkClass;

/// One typical task shape and its frequency.
#[derive(Debug, Clone, PartialEq)]
pub struct TypicalTask {
    /// CPU request, milli-cores.
    pub cpu_milli: u64,
    /// Per-GPU compute, milli-GPU (0 for a CPU-only task).
    pub gpu_milli: u32,
    /// Number of GPUs (0 for a CPU-only task).
    pub gpu_count: u32,
    /// Allowed models.
    pub models: ModelConstraint,
    /// Frequency in (0, 1]; the frequencies of a set sum to 1.
    pub freq: f64,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct ShapeKey {
    cpu_milli: u64,
    gpu_milli: u32,
    gpu_count: u32,
    allowed: Vec<String>,
    excluded: Vec<String>,
}

fn shape_of(t: &Task) -> ShapeKey {
    let (gpu_milli, gpu_count) = match t.gpus.first() {
        Some(d) => (d.compute_milli, d.count),
        None => (0, 0),
    };
    ShapeKey {
        cpu_milli: t.cpu_milli,
        gpu_milli,
        gpu_count,
        allowed: t.models.allowed.clone(),
        excluded: t.models.excluded.clone(),
    }
}

/// The typical tasks of a workload: the most frequent shapes covering `coverage`
/// (e.g. 0.95) of the tasks, most frequent first (ties: larger CPU, then larger per-GPU
/// milli, then more GPUs first), frequencies renormalised to sum to 1.
///
/// A multi-container task is summarised by its first GPU container.
pub fn typical_tasks<'a>(
    tasks: impl IntoIterator<Item = &'a Task>,
    coverage: f64,
) -> Vec<TypicalTask> {
    let mut counts: HashMap<ShapeKey, u64> = HashMap::new();
    let mut total = 0u64;
    for t in tasks {
        *counts.entry(shape_of(t)).or_default() += 1;
        total += 1;
    }
    let mut list: Vec<(ShapeKey, u64)> = counts.into_iter().collect();
    list.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| b.0.cmp(&a.0)));
    let expected = coverage * total as f64;
    let mut cum = 0u64;
    let mut n = 0;
    while (cum as f64) < expected && n < list.len() {
        cum += list[n].1;
        n += 1;
    }
    list.truncate(n);
    list.into_iter()
        .map(|(k, c)| TypicalTask {
            cpu_milli: k.cpu_milli,
            gpu_milli: k.gpu_milli,
            gpu_count: k.gpu_count,
            models: ModelConstraint {
                allowed: k.allowed,
                excluded: k.excluded,
            },
            freq: c as f64 / cum as f64,
        })
        .collect()
}

/// Which of the shapes left out of FGD's typical tasks `vgpu` adds back as classes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RareShapes {
    /// None (FGD's typical tasks alone).
    Drop,
    /// Multi-GPU shapes, one class per (GPU count, model constraint).
    MultiGpu,
    /// Every GPU shape, one class per (per-GPU milli, GPU count, model constraint).
    AllGpu,
    /// Multi-GPU shapes of a GPU count that no typical task has.
    MissingMultiGpu,
    /// As `MissingMultiGpu`, the class with its smallest CPU request.
    MissingMultiGpuMinCpu,
    /// As `MissingMultiGpu`, only classes at least as frequent as the rarest typical task.
    MissingMultiGpuCut,
}

/// FGD's typical tasks ([`typical_tasks`]) plus, for the shapes they leave out, one
/// *class* per GPU demand: the left-out tasks are grouped by their GPU shape ignoring
/// CPU (`which` says which shapes), each group becomes one typical task with the
/// group's median CPU and its share of all tasks as frequency, and every frequency is
/// renormalised over the tasks now represented.
///
/// Why: FGD ranks shapes by exact (CPU, GPU, count, models), so a demand spread over
/// many CPU sizes falls below the coverage cut although, summed, it is common. On the
/// `gpushare20` trace no 8-GPU task is typical (62 tasks over 5 CPU sizes) although
/// they are 6 % of the GPU demand: FGD sees no cost in breaking up a fully free 8-GPU
/// node (ADR 0006).
pub fn typical_tasks_with_classes<'a>(
    tasks: impl IntoIterator<Item = &'a Task>,
    coverage: f64,
    which: RareShapes,
) -> Vec<TypicalTask> {
    let tasks: Vec<&Task> = tasks.into_iter().collect();
    let mut out = typical_tasks(tasks.iter().copied(), coverage);
    if which == RareShapes::Drop {
        return out;
    }
    let keys: HashSet<ShapeKey> = out
        .iter()
        .map(|t| ShapeKey {
            cpu_milli: t.cpu_milli,
            gpu_milli: t.gpu_milli,
            gpu_count: t.gpu_count,
            allowed: t.models.allowed.clone(),
            excluded: t.models.excluded.clone(),
        })
        .collect();
    // Left-out tasks by class (their shape with CPU 0: per-GPU milli, count, models) →
    // their CPU requests.
    let mut groups: BTreeMap<ShapeKey, Vec<u64>> = BTreeMap::new();
    let mut covered = 0u64;
    for t in &tasks {
        let k = shape_of(t);
        if keys.contains(&k) {
            covered += 1;
            continue;
        }
        let take = match which {
            RareShapes::Drop => false,
            RareShapes::MultiGpu => k.gpu_count > 1,
            RareShapes::AllGpu => k.gpu_count > 0,
            RareShapes::MissingMultiGpu
            | RareShapes::MissingMultiGpuMinCpu
            | RareShapes::MissingMultiGpuCut => {
                k.gpu_count > 1 && !out.iter().any(|t| t.gpu_count == k.gpu_count)
            }
        };
        if take {
            let cpu = k.cpu_milli;
            groups
                .entry(ShapeKey { cpu_milli: 0, ..k })
                .or_default()
                .push(cpu);
        }
    }
    if which == RareShapes::MissingMultiGpuCut {
        let rarest = out.iter().map(|t| t.freq).fold(f64::INFINITY, f64::min) * covered as f64;
        groups.retain(|_, cpus| cpus.len() as f64 >= rarest - 1e-9);
    }
    let represented = covered + groups.values().map(|c| c.len() as u64).sum::<u64>();
    if represented == covered {
        return out;
    }
    let rescale = covered as f64 / represented as f64;
    for t in &mut out {
        t.freq *= rescale;
    }
    for (class, mut cpus) in groups {
        cpus.sort_unstable();
        out.push(TypicalTask {
            cpu_milli: if which == RareShapes::MissingMultiGpuMinCpu {
                cpus[0]
            } else {
                cpus[(cpus.len() - 1) / 2]
            },
            gpu_milli: class.gpu_milli,
            gpu_count: class.gpu_count,
            models: ModelConstraint {
                allowed: class.allowed,
                excluded: class.excluded,
            },
            freq: cpus.len() as f64 / represented as f64,
        });
    }
    out
}

/// Per typical task, the parts of `frag_t` for one node state.
#[derive(Debug, Clone, Copy, Default)]
struct Part {
    /// Allowed GPUs with at least the task's per-GPU milli free.
    n_fit: u32,
    /// Free milli on allowed GPUs with less than the task needs.
    below: u64,
    /// Free milli on GPUs of excluded models.
    excluded: u64,
    /// Topology extension (ADR 0021): the GPUs with room hold a set of the task's size
    /// at the best class the node offers (true when the extension does not apply).
    topo_ok: bool,
}

/// FGD's fragmentation model over a fixed set of typical tasks.
#[derive(Debug, Clone)]
pub struct Fragmentation {
    typical: Vec<TypicalTask>,
    /// Per node index: allowed[t * gpus + i].
    allowed: Vec<Option<Vec<bool>>>,
    coverage: f64,
    /// Expected final waste of one GPU by its free milli (see [`expected_waste`]).
    waste: Vec<f64>,
    /// Whether a multi-GPU typical task counts a node as fragmented for it when its
    /// GPUs with room no longer hold a set at the node's best class (ADR 0021).
    topology: bool,
    /// Per node index, per typical task: the best class a set of the task's GPU count
    /// has on the node with every GPU free, where the extension applies.
    topo_best: Vec<Option<Vec<Option<LinkClass>>>>,
}

/// The fragmentation of one node state, prepared for evaluating candidate placements.
#[derive(Debug, Clone, Default)]
pub struct NodeFrag {
    parts: Vec<Part>,
    free_total: u64,
    cpu_free: u64,
    /// F of the state.
    pub value: f64,
}

impl Fragmentation {
    /// A model over these typical tasks.
    pub fn new(typical: Vec<TypicalTask>) -> Self {
        Fragmentation {
            waste: expected_waste(&typical),
            typical,
            allowed: Vec::new(),
            coverage: 0.95,
            topology: false,
            topo_best: Vec::new(),
        }
    }

    /// Expected final waste (milli-GPU) of a GPU with `free` milli free.
    pub fn gpu_waste(&self, free: u32) -> f64 {
        self.waste[free.min(1000) as usize]
    }

    /// Turns on the topology extension (ADR 0021): for a typical task of `k ≥ 2` GPUs,
    /// a node whose GPUs with room hold no `k`-set at the best link class the node offers
    /// counts as one it cannot run on (`frag_t` = all its free milli), as FGD counts a
    /// node with too few GPUs; and [`Fragmentation::misplaced`] prices a placement's own
    /// worse-connected sets. Nodes without a known topology are measured as before.
    pub fn with_topology(mut self, on: bool) -> Self {
        self.topology = on;
        self
    }

    /// Whether the topology extension is on.
    pub fn topology(&self) -> bool {
        self.topology
    }

    /// The milli-GPU of a placement's multi-GPU containers whose sets are worse than the
    /// best their node offers for that size (0 with the extension off): capacity placed
    /// where its links are wasted, added to the fragmentation after the placement.
    pub fn misplaced(&self, node: &NodeState, containers: &[Vec<super::ledger::Grant>]) -> f64 {
        if !self.topology || !node.spec.topology.is_known() {
            return 0.0;
        }
        let all: Vec<u32> = (0..node.spec.gpus.len() as u32).collect();
        let mut out = 0.0;
        for grants in containers.iter().filter(|g| g.len() >= 2) {
            let set: Vec<u32> = grants.iter().map(|g| u32::from(g.gpu)).collect();
            let best = node.spec.topology.best_class(&all, set.len());
            if node.spec.topology.set_class(&set) < best {
                out += grants.iter().map(|g| f64::from(g.milli)).sum::<f64>();
            }
        }
        out
    }

    fn ensure_topo(&mut self, idx: usize, node: &NodeState) {
        if !self.topology {
            return;
        }
        if self.topo_best.len() <= idx {
            self.topo_best.resize(idx + 1, None);
        }
        if self.topo_best[idx].is_some() {
            return;
        }
        let g = node.spec.gpus.len();
        let topo = &node.spec.topology;
        let all: Vec<u32> = (0..g as u32).collect();
        let v = self
            .typical
            .iter()
            .map(|t| {
                let k = t.gpu_count as usize;
                // A set of the whole node, or one GPU, has no choice to keep.
                (topo.is_known() && k >= 2 && k < g)
                    .then(|| topo.best_class(&all, k))
                    .flatten()
            })
            .collect();
        self.topo_best[idx] = Some(v);
    }

    /// Whether the GPUs with at least `need` milli free (by `free`, allowed for typical
    /// task `ti`) hold a `k`-set at class `best`, leaving out GPU `skip`.
    fn topo_holds(
        node: &NodeState,
        allowed: &[bool],
        ti: usize,
        free: &[u32],
        need: u32,
        k: usize,
        best: LinkClass,
        skip: Option<usize>,
    ) -> bool {
        let g = free.len();
        let cands: Vec<u32> = (0..g)
            .filter(|&i| Some(i) != skip && allowed[ti * g + i] && free[i] >= need)
            .map(|i| i as u32)
            .collect();
        cands.len() >= k && node.spec.topology.best_class(&cands, k) >= Some(best)
    }

    /// Records the coverage the typical tasks were chosen with (informational).
    pub fn with_coverage(mut self, coverage: f64) -> Self {
        self.coverage = coverage;
        self
    }

    /// The coverage the typical tasks were chosen with.
    pub fn coverage(&self) -> f64 {
        self.coverage
    }

    /// CPU milli-cores per milli-GPU of the typical GPU tasks (frequency-weighted).
    pub fn cpu_per_gpu_milli(&self) -> f64 {
        let (mut cpu, mut gpu) = (0.0, 0.0);
        for t in &self.typical {
            if t.gpu_count > 0 {
                cpu += t.freq * t.cpu_milli as f64;
                gpu += t.freq * f64::from(t.gpu_milli) * f64::from(t.gpu_count);
            }
        }
        if gpu > 0.0 { cpu / gpu } else { 0.0 }
    }

    /// The typical tasks.
    pub fn typical(&self) -> &[TypicalTask] {
        &self.typical
    }

    /// Forgets the model table of node `idx` (its GPUs' models changed in place).
    pub fn forget_node(&mut self, idx: usize) {
        if let Some(slot) = self.allowed.get_mut(idx) {
            *slot = None;
        }
        if let Some(slot) = self.topo_best.get_mut(idx) {
            *slot = None;
        }
    }

    fn ensure_allowed(&mut self, idx: usize, node: &NodeState) {
        if self.allowed.len() <= idx {
            self.allowed.resize(idx + 1, None);
        }
        let g = node.spec.gpus.len();
        if self.allowed[idx]
            .as_ref()
            .is_some_and(|v| v.len() == self.typical.len() * g)
        {
            return;
        }
        let mut v = Vec::with_capacity(self.typical.len() * g);
        for t in &self.typical {
            for gpu in &node.spec.gpus {
                v.push(t.models.allows(&gpu.model));
            }
        }
        self.allowed[idx] = Some(v);
    }

    /// F for a node given its CPU free and per-GPU free milli.
    pub fn value(&mut self, idx: usize, node: &NodeState, cpu_free: u64, free: &[u32]) -> f64 {
        self.prepare(idx, node, cpu_free, free).value
    }

    /// Computes the per-typical-task parts and F for a node state.
    pub fn prepare(
        &mut self,
        idx: usize,
        node: &NodeState,
        cpu_free: u64,
        free: &[u32],
    ) -> NodeFrag {
        let mut out = NodeFrag::default();
        self.prepare_into(idx, node, cpu_free, free, &mut out);
        out
    }

    /// [`Fragmentation::prepare`] into `out`, reusing its storage (no allocation once
    /// `out` has held a node's parts).
    pub fn prepare_into(
        &mut self,
        idx: usize,
        node: &NodeState,
        cpu_free: u64,
        free: &[u32],
        out: &mut NodeFrag,
    ) {
        let g = free.len();
        let free_total: u64 = free.iter().map(|&m| u64::from(m)).sum();
        self.ensure_allowed(idx, node);
        self.ensure_topo(idx, node);
        let allowed = self.allowed[idx].as_deref().expect("just ensured");
        let topo_best = self.topo_best.get(idx).and_then(Option::as_deref);
        let parts = &mut out.parts;
        parts.clear();
        for (ti, t) in self.typical.iter().enumerate() {
            let mut p = Part {
                topo_ok: true,
                ..Part::default()
            };
            for (i, &m) in free.iter().enumerate() {
                if !allowed[ti * g + i] {
                    p.excluded += u64::from(m);
                } else if m >= t.gpu_milli {
                    p.n_fit += 1;
                } else {
                    p.below += u64::from(m);
                }
            }
            if let Some(best) = topo_best.and_then(|v| v[ti])
                && p.n_fit >= t.gpu_count
            {
                let k = t.gpu_count as usize;
                p.topo_ok = Self::topo_holds(node, allowed, ti, free, t.gpu_milli, k, best, None);
            }
            parts.push(p);
        }
        out.value = self.sum(parts, free_total, cpu_free);
        out.free_total = free_total;
        out.cpu_free = cpu_free;
    }

    fn sum(&self, parts: &[Part], free_total: u64, cpu_free: u64) -> f64 {
        let mut f = 0.0;
        for (t, p) in self.typical.iter().zip(parts) {
            let frag = if t.gpu_count == 0
                || cpu_free < t.cpu_milli
                || p.n_fit < t.gpu_count
                || !p.topo_ok
            {
                free_total
            } else {
                p.below + p.excluded
            };
            f += t.freq * frag as f64;
        }
        f
    }

    /// F after taking `milli` from GPU `gpu` (whose free milli is `free_before`) and
    /// `cpu` milli-cores from the node, in O(typical tasks) (plus, with the topology
    /// extension, a set search for each multi-GPU typical task the GPU stops fitting).
    #[allow(clippy::too_many_arguments)] // the node's state, the candidate, the demand
    pub fn value_after_share(
        &mut self,
        idx: usize,
        node: &NodeState,
        before: &NodeFrag,
        gpu: usize,
        free_before: u32,
        milli: u32,
        cpu: u64,
    ) -> f64 {
        let g = node.spec.gpus.len();
        self.ensure_allowed(idx, node);
        self.ensure_topo(idx, node);
        let allowed = self.allowed[idx].as_deref().expect("just ensured");
        let topo_best = self.topo_best.get(idx).and_then(Option::as_deref);
        let a = free_before;
        let b = free_before - milli;
        let free_total = before.free_total - u64::from(milli);
        let cpu_free = before.cpu_free - cpu;
        let mut f = 0.0;
        for (ti, t) in self.typical.iter().enumerate() {
            let mut p = before.parts[ti];
            if allowed[ti * g + gpu] {
                if a >= t.gpu_milli {
                    p.n_fit -= 1;
                } else {
                    p.below -= u64::from(a);
                }
                if b >= t.gpu_milli {
                    p.n_fit += 1;
                } else {
                    p.below += u64::from(b);
                }
            } else {
                p.excluded -= u64::from(milli);
            }
            // The GPU stops fitting the task: do the others still hold a best set?
            if allowed[ti * g + gpu]
                && a >= t.gpu_milli
                && b < t.gpu_milli
                && p.topo_ok
                && p.n_fit >= t.gpu_count
                && let Some(best) = topo_best.and_then(|v| v[ti])
            {
                let free: Vec<u32> = node.gpus.iter().map(|x| x.milli).collect();
                let k = t.gpu_count as usize;
                p.topo_ok =
                    Self::topo_holds(node, allowed, ti, &free, t.gpu_milli, k, best, Some(gpu));
            }
            let frag = if t.gpu_count == 0
                || cpu_free < t.cpu_milli
                || p.n_fit < t.gpu_count
                || !p.topo_ok
            {
                free_total
            } else {
                p.below + p.excluded
            };
            f += t.freq * frag as f64;
        }
        f
    }
}

/// The expected final waste of one GPU by its free milli, if tasks keep arriving from the
/// typical distribution and each lands on this GPU only when it fits:
///
/// ```text
/// W(r) = r                                   if no typical GPU task fits in r
///      = Σ_{t fits} p_t · W(r − m_t) / Σ_{t fits} p_t   otherwise
/// ```
///
/// where `m_t` is the task's per-GPU milli and `p_t` its frequency times its GPU count.
/// FGD's per-GPU term `r · P(m > r)` is the one-step version of this.
pub fn expected_waste(typical: &[TypicalTask]) -> Vec<f64> {
    let shapes: Vec<(usize, f64)> = typical
        .iter()
        .filter(|t| t.gpu_count > 0 && t.gpu_milli > 0)
        .map(|t| {
            (
                t.gpu_milli.min(1000) as usize,
                t.freq * f64::from(t.gpu_count),
            )
        })
        .collect();
    let mut w = vec![0.0; 1001];
    for r in 1..=1000usize {
        let (mut num, mut den) = (0.0, 0.0);
        for &(m, p) in &shapes {
            if m <= r {
                num += p * w[r - m];
                den += p;
            }
        }
        w[r] = if den > 0.0 { num / den } else { r as f64 };
    }
    w
}

/// FGD's score for a fragmentation decrease `delta` (milli-GPU): `int(100·sigmoid(Δ/1000))`.
pub fn fgd_score(delta: f64) -> i64 {
    let s = 1.0 / (1.0 + (-delta / 1000.0).exp());
    // Truncation toward zero, as the published simulator does; s is in (0, 1).
    (s * 100.0) as i64
}
