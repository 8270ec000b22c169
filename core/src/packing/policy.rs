//! Placement policies: each gives every feasible node an integer score (higher is
//! better) and chooses the GPU(s) within the node.
//!
//! | name | node score | GPU within the node |
//! |---|---|---|
//! | `random` | uniformly random | uniformly random |
//! | `bestfit` | least CPU + GPU left after placement (normalised by the largest node) | tightest fit |
//! | `gpupacking` | shared GPU > used node > idle node | tightest fit |
//! | `fgd` | `int(100·sigmoid(ΔF/1000))`, best over GPUs | the first GPU reaching it |
//! | `spread` | most CPU + GPU left after placement | most free GPU |
//! | `vgpu` (default) | see [`VgpuParams`] and ADR 0006 | best candidate |

use std::fmt;
use std::str::FromStr;

use super::fgd::{
    Fragmentation, NodeFrag, RareShapes, fgd_score, typical_tasks, typical_tasks_with_classes,
};
use super::ledger::{NodeState, Reject, Task};
use crate::resources::MILLI_PER_GPU;

/// The policies by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PolicyName {
    /// Uniformly random feasible node.
    Random,
    /// Best fit on CPU and GPU.
    BestFit,
    /// GPU packing: fill partially used GPUs, then used nodes, then idle nodes.
    GpuPacking,
    /// Fragmentation gradient descent, as published.
    Fgd,
    /// Spread: emptiest node, most free GPU.
    Spread,
    /// vgpu's default.
    Vgpu,
}

impl PolicyName {
    /// Every policy, in table order.
    pub const ALL: [PolicyName; 6] = [
        PolicyName::Random,
        PolicyName::BestFit,
        PolicyName::GpuPacking,
        PolicyName::Fgd,
        PolicyName::Spread,
        PolicyName::Vgpu,
    ];

    /// The name used on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyName::Random => "random",
            PolicyName::BestFit => "bestfit",
            PolicyName::GpuPacking => "gpupacking",
            PolicyName::Fgd => "fgd",
            PolicyName::Spread => "spread",
            PolicyName::Vgpu => "vgpu",
        }
    }

    /// Whether the policy needs the workload's typical tasks.
    pub fn needs_typical_tasks(self) -> bool {
        matches!(self, PolicyName::Fgd | PolicyName::Vgpu)
    }
}

impl fmt::Display for PolicyName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An unknown policy name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown policy {0:?} (known: random, bestfit, gpupacking, fgd, spread, vgpu)")]
pub struct UnknownPolicy(pub String);

impl FromStr for PolicyName {
    type Err = UnknownPolicy;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        PolicyName::ALL
            .into_iter()
            .find(|p| p.as_str() == s)
            .ok_or_else(|| UnknownPolicy(s.to_owned()))
    }
}

/// A policy's verdict on one feasible node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Eval {
    /// Higher is better.
    pub score: i64,
    /// The GPU for a single-share task, when the policy chose one; otherwise the
    /// ledger's default plan (tightest fit, lowest-numbered whole GPUs) applies.
    pub pick: Option<usize>,
    /// GPUs (bit i = GPU i) whose placement reaches `score` equally; a policy with a live
    /// secondary key chooses among them ([`Policy::live`]).
    pub ties: u64,
}

/// Default weight of the expected-waste term of `vgpu` (ADR 0006).
pub const DEFAULT_WASTE_WEIGHT: f64 = 0.2;

/// Whether `vgpu`'s fragmentation measure has the topology extension by default (ADR
/// 0021: measured on the trace, see there).
pub const DEFAULT_TOPOLOGY_FRAGMENTATION: bool = false;

/// Knobs of the `vgpu` policy (see ADR 0006).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct VgpuParams {
    /// Resolution of the fragmentation score: `int(resolution · sigmoid(Δ/1000))`.
    /// 100 is FGD's; the score is coarse on purpose (see ADR 0006).
    pub resolution: f64,
    /// Secondary key for CPU-only tasks.
    pub cpu_only: TieKey,
    /// Secondary key for GPU tasks.
    pub gpu_tie: TieKey,
    /// Share of tasks the typical tasks cover (FGD: 0.95).
    pub coverage: f64,
    /// Break ties between equal fragmentation scores by the cluster-wide sum-of-squares
    /// key ([`sum_of_squares_delta`]).
    pub sum_of_squares: bool,
    /// Weight of the expected-waste decrease added to FGD's fragmentation decrease
    /// before quantisation ([`Fragmentation::gpu_waste`]; 0 = FGD's measure alone).
    pub waste_weight: f64,
    /// Whether whole GPUs taken by a placement add to the expected-waste decrease. Every
    /// placement of a whole-GPU demand takes fully free GPUs, so this part is the same for
    /// all of a task's candidates: it ranks nothing, it only moves the quantisation's bin
    /// edges (ADR 0006).
    pub waste_whole: bool,
    /// Break ties between equal scores of whole-GPU tasks by the sum-of-squares key over
    /// nodes' counts of fully free GPUs ([`sum_of_squares_delta_nodes`]).
    pub node_sum_of_squares: bool,
    /// Count nodes' fully free GPUs per node size (nodes of the same GPU count only) in
    /// that key, rather than over all nodes.
    pub node_ss_by_size: bool,
    /// Add the node key to a share's key too when the share takes a fully free GPU.
    pub node_ss_shares: bool,
    /// Leave out of that key the levels of full and idle nodes (0 and all GPUs fully
    /// free), as Csirik et al.'s sum of squares leaves out full and empty bins.
    pub node_ss_open_only: bool,
    /// Which shapes left out of FGD's typical tasks are added back as classes
    /// ([`super::fgd::typical_tasks_with_classes`]).
    pub rare: RareShapes,
    /// The fragmentation measure's topology extension (ADR 0021,
    /// [`Fragmentation::with_topology`]).
    pub topology: bool,
}

/// A secondary key among nodes with equal fragmentation scores.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TieKey {
    /// None: ties go to the random node order.
    None,
    /// Least CPU + GPU left after placement (best fit).
    BestFit,
    /// Most CPU + GPU left after placement.
    WorstFit,
    /// Least free GPU on the node (keep GPU nodes' CPU for GPU tasks).
    LeastGpuFree,
    /// Most free CPU per free GPU after placement.
    CpuRich,
    /// Largest CPU surplus after placement: free CPU minus what the node's free GPUs will
    /// need at the workload's CPU per GPU.
    Surplus,
}

impl Default for VgpuParams {
    fn default() -> Self {
        VgpuParams {
            resolution: 100.0,
            cpu_only: TieKey::LeastGpuFree,
            gpu_tie: TieKey::None,
            coverage: 0.95,
            sum_of_squares: true,
            waste_weight: DEFAULT_WASTE_WEIGHT,
            waste_whole: true,
            node_sum_of_squares: true,
            node_ss_by_size: true,
            node_ss_shares: false,
            node_ss_open_only: false,
            rare: RareShapes::MissingMultiGpu,
            topology: DEFAULT_TOPOLOGY_FRAGMENTATION,
        }
    }
}

impl VgpuParams {
    /// Parses `key=value,...` overrides: `res` (resolution), `w` (waste weight), `ww`
    /// (`1`/`0`: whole GPUs in the waste term), `ss` (`1`/`0`: sum-of-squares ties between
    /// GPUs), `nss` (sum-of-squares ties between nodes for whole GPUs: `size` over nodes
    /// of the same size, `1` over all nodes, `open` per size without idle and full nodes,
    /// `0` none), `nssx` (`1`: that key for shares taking a fully free GPU too), `rare`
    /// (classes of left-out shapes: `missing`, `missingmin`, `missingcut`, `multi`,
    /// `all`, `drop`; see [`RareShapes`]), `cpu` and `gpu` (tie keys: none, bestfit,
    /// worstfit, leastgpu, cpurich, surplus), `cov` (typical-task coverage), `topo` (`1`/`0`:
    /// the fragmentation measure's topology extension, ADR 0021).
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut p = VgpuParams::default();
        let key = |v: &str| -> Result<TieKey, String> {
            Ok(match v {
                "none" => TieKey::None,
                "bestfit" => TieKey::BestFit,
                "worstfit" => TieKey::WorstFit,
                "leastgpu" => TieKey::LeastGpuFree,
                "cpurich" => TieKey::CpuRich,
                "surplus" => TieKey::Surplus,
                _ => return Err(format!("unknown tie key {v:?}")),
            })
        };
        for kv in text.split(',').filter(|s| !s.is_empty()) {
            let (k, v) = kv
                .split_once('=')
                .ok_or_else(|| format!("expected key=value, got {kv:?}"))?;
            match k {
                "res" => p.resolution = v.parse().map_err(|_| format!("bad res {v:?}"))?,
                "cpu" => p.cpu_only = key(v)?,
                "gpu" => p.gpu_tie = key(v)?,
                "w" => p.waste_weight = v.parse().map_err(|_| format!("bad w {v:?}"))?,
                "ww" => p.waste_whole = v == "1",
                "nss" => {
                    p.node_sum_of_squares = v != "0";
                    p.node_ss_by_size = v == "size" || v == "open";
                    p.node_ss_open_only = v == "open";
                }
                "ss" => p.sum_of_squares = v == "1",
                "nssx" => p.node_ss_shares = v == "1",
                "rare" => {
                    p.rare = match v {
                        "drop" => RareShapes::Drop,
                        "multi" => RareShapes::MultiGpu,
                        "all" => RareShapes::AllGpu,
                        "missing" => RareShapes::MissingMultiGpu,
                        "missingmin" => RareShapes::MissingMultiGpuMinCpu,
                        "missingcut" => RareShapes::MissingMultiGpuCut,
                        _ => {
                            return Err(format!(
                                "bad rare {v:?} (missing, missingmin, missingcut, multi, all, drop)"
                            ));
                        }
                    }
                }
                "cov" => p.coverage = v.parse().map_err(|_| format!("bad cov {v:?}"))?,
                "topo" => {
                    p.topology = match v {
                        "1" => true,
                        "0" => false,
                        _ => return Err(format!("bad topo {v:?} (1 or 0)")),
                    }
                }
                _ => return Err(format!("unknown vgpu parameter {k:?}")),
            }
        }
        Ok(p)
    }
}

/// The fragmentation model `name` measures with over the workload `tasks`: FGD's typical
/// tasks covering `coverage` for `fgd`; for `vgpu`, those plus the classes of shapes they
/// leave out that `params.rare` names, at `params.coverage`
/// ([`typical_tasks_with_classes`]); `None` for the policies that need none. The replay and
/// the live extender both build the model here.
pub fn fragmentation_for<'a>(
    name: PolicyName,
    params: &VgpuParams,
    tasks: impl IntoIterator<Item = &'a Task>,
    coverage: f64,
) -> Option<Fragmentation> {
    match name {
        PolicyName::Fgd => {
            Some(Fragmentation::new(typical_tasks(tasks, coverage)).with_coverage(coverage))
        }
        PolicyName::Vgpu => Some(
            Fragmentation::new(typical_tasks_with_classes(
                tasks,
                params.coverage,
                params.rare,
            ))
            .with_coverage(params.coverage)
            .with_topology(params.topology),
        ),
        _ => None,
    }
}

/// Largest node capacities, used by best fit and spread to normalise.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scale {
    /// Largest node CPU, milli-cores.
    pub cpu_milli: u64,
    /// Largest node GPU total, milli-GPU.
    pub gpu_milli: u64,
}

/// A policy with its state (typical tasks, random stream).
#[derive(Debug, Clone)]
pub struct Policy {
    name: PolicyName,
    frag: Option<Fragmentation>,
    rng: u64,
    scale: Scale,
    /// Parameters of the `vgpu` policy.
    pub vgpu: VgpuParams,
    scratch: Scratch,
}

/// Buffers [`Policy::evaluate`] reuses from node to node, so that evaluating a node
/// allocates nothing on the common paths (the extender evaluates thousands per request).
#[derive(Debug, Clone, Default)]
struct Scratch {
    /// Free milli per GPU of the node being evaluated.
    free: Vec<u32>,
    /// Its fragmentation before the placement.
    before: NodeFrag,
    /// Candidate placements: the GPU (single shares) and the fragmentation decrease.
    cands: Vec<(Option<usize>, f64)>,
}

impl Policy {
    /// A policy. `frag` is required for `fgd` and `vgpu` (their typical tasks); `seed`
    /// drives `random`; `scale` normalises best fit and spread.
    pub fn new(name: PolicyName, frag: Option<Fragmentation>, seed: u64, scale: Scale) -> Self {
        Policy {
            name,
            frag,
            rng: seed ^ 0x9E37_79B9_7F4A_7C15,
            scale,
            vgpu: VgpuParams::default(),
            scratch: Scratch::default(),
        }
    }

    /// The policy's name.
    pub fn name(&self) -> PolicyName {
        self.name
    }

    /// Forgets the per-node tables kept for node `idx` (its spec changed in place).
    pub fn forget_node(&mut self, idx: usize) {
        if let Some(frag) = self.frag.as_mut() {
            frag.forget_node(idx);
        }
    }

    /// Whether a node's verdict depends only on the node's state and the task (so it can
    /// be cached per node generation).
    pub fn cacheable(&self) -> bool {
        true
    }

    fn next_random(&mut self) -> u64 {
        // SplitMix64: a tiny, well-mixed stream; `random` only needs uniform scores.
        self.rng = self.rng.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Scores `task` on node `idx` (state `node`), or says why it does not fit.
    pub fn evaluate(&mut self, idx: usize, node: &NodeState, task: &Task) -> Result<Eval, Reject> {
        node.check_host(task)?;
        // The default plan both proves GPU feasibility and gives the whole-GPU choice. A
        // single share needs no plan (the policy chooses its GPU): one allowed GPU with
        // room proves it fits, and only a node without one pays for the plan's reason.
        let plan = match task.single_share() {
            Some(d)
                if (0..node.gpus.len()).any(|i| {
                    node.share_fits(i, d) && task.models.allows(&node.spec.gpus[i].model)
                }) =>
            {
                None
            }
            _ => Some(node.plan(task, None)?),
        };
        let eval = match self.name {
            PolicyName::Random => {
                // Every feasible node scores 0; `live` draws the random key per decision.
                let score = 0;
                // A uniformly random GPU among those that fit (the paper's random baseline).
                let pick = match task.single_share() {
                    Some(d) => {
                        let fits: Vec<usize> = (0..node.gpus.len())
                            .filter(|&i| {
                                node.share_fits(i, d)
                                    && task.models.allows(&node.spec.gpus[i].model)
                            })
                            .collect();
                        let k = (self.next_random() % fits.len().max(1) as u64) as usize;
                        fits.get(k).copied()
                    }
                    None => None,
                };
                Eval {
                    score,
                    pick,
                    ties: 0,
                }
            }
            PolicyName::BestFit => Eval {
                score: bestfit_score(node, task, self.scale),
                pick: None,
                ties: 0,
            },
            PolicyName::GpuPacking => Eval {
                score: gpupacking_score(node, task),
                pick: None,
                ties: 0,
            },
            PolicyName::Spread => spread_eval(node, task, self.scale),
            PolicyName::Fgd => {
                let frag = self.frag.as_mut().expect("fgd needs typical tasks");
                candidates(frag, idx, node, task, plan.as_deref(), &mut self.scratch);
                fgd_eval(&self.scratch.cands, 100.0)
            }
            PolicyName::Vgpu => {
                let params = self.vgpu;
                let scale = self.scale;
                let frag = self.frag.as_mut().expect("vgpu needs typical tasks");
                candidates(frag, idx, node, task, plan.as_deref(), &mut self.scratch);
                vgpu_eval(
                    frag,
                    node,
                    task,
                    plan.as_deref(),
                    &self.scratch.cands,
                    params,
                    scale,
                )
            }
        };
        Ok(eval)
    }
}

/// Best fit (the paper's baseline): `int(100·(1 − ½·cpu_left/cpu_max − ½·gpu_left/gpu_max))`
/// with the left-overs after placement.
fn bestfit_score(node: &NodeState, task: &Task, scale: Scale) -> i64 {
    let cpu_left = (node.cpu_free - task.cpu_milli) as f64;
    let gpu_left = (node.gpu_milli_free() - task.total_gpu_milli()) as f64;
    let s = 0.5 * cpu_left / scale.cpu_milli.max(1) as f64
        + 0.5 * gpu_left / scale.gpu_milli.max(1) as f64;
    ((1.0 - s) * 100.0) as i64
}

/// GPU packing (the paper's baseline): a task that fits on partially used GPUs scores
/// 50–100 (less free on those GPUs is better), one that needs fully free GPUs of a used
/// node 33–50 (fewer is better), one on an idle node at most 33 (fewer GPUs is better).
fn gpupacking_score(node: &NodeState, task: &Task) -> i64 {
    if task.total_gpu_milli() == 0 {
        return 0;
    }
    let n = node.gpus.len();
    let fully_free_n = (0..n)
        .filter(|&i| node.gpus[i].milli == MILLI_PER_GPU)
        .count();
    let fully_free = i64::try_from(fully_free_n).unwrap_or(i64::MAX);
    if fully_free_n == n {
        return (33 - fully_free).max(fully_free);
    }
    let Some(d) = task.gpus.first() else { return 0 };
    let mut idx: Vec<usize> = (0..n).collect();
    idx.sort_by_key(|&i| node.gpus[i].milli);
    let mut need = d.count;
    let mut whole_used = 0i64;
    let mut free_ratio_sum = 0i64;
    for i in idx {
        if need == 0 {
            break;
        }
        let m = node.gpus[i].milli;
        if d.compute_milli <= m && task.models.allows(&node.spec.gpus[i].model) {
            need -= 1;
            if m == MILLI_PER_GPU {
                whole_used += 1;
            }
            free_ratio_sum += i64::from(m) * 100 / 1000;
        }
    }
    if whole_used > 0 {
        (50 - whole_used).max(33)
    } else {
        (100 - free_ratio_sum / 10).max(50)
    }
}

fn spread_eval(node: &NodeState, task: &Task, scale: Scale) -> Eval {
    let cpu_left = (node.cpu_free - task.cpu_milli) as f64;
    let gpu_left = (node.gpu_milli_free() - task.total_gpu_milli()) as f64;
    let s = 0.5 * cpu_left / scale.cpu_milli.max(1) as f64
        + 0.5 * gpu_left / scale.gpu_milli.max(1) as f64;
    let pick = task.single_share().and_then(|d| {
        (0..node.gpus.len())
            .filter(|&i| node.share_fits(i, d) && task.models.allows(&node.spec.gpus[i].model))
            .max_by_key(|&i| (node.gpus[i].milli, std::cmp::Reverse(i)))
    });
    Eval {
        score: (s * 100.0) as i64,
        pick,
        ties: 0,
    }
}

/// The fragmentation decrease of each candidate, into `scratch.cands`: for a single-share
/// task, every GPU it fits on (in index order); otherwise the default plan alone.
fn candidates(
    frag: &mut Fragmentation,
    idx: usize,
    node: &NodeState,
    task: &Task,
    plan: Option<&[Vec<super::ledger::Grant>]>,
    scratch: &mut Scratch,
) {
    let Scratch {
        free,
        before,
        cands,
    } = scratch;
    free.clear();
    free.extend(node.gpus.iter().map(|g| g.milli));
    frag.prepare_into(idx, node, node.cpu_free, free, before);
    cands.clear();
    if let Some(d) = task.single_share() {
        for (i, &f) in free.iter().enumerate() {
            if node.share_fits(i, d) && task.models.allows(&node.spec.gpus[i].model) {
                let after = frag.value_after_share(
                    idx,
                    node,
                    before,
                    i,
                    f,
                    d.compute_milli,
                    task.cpu_milli,
                );
                cands.push((Some(i), before.value - after));
            }
        }
    } else {
        let value_before = before.value;
        for grants in plan.expect("a task that is not a single share has a plan") {
            for g in grants {
                free[usize::from(g.gpu)] -= g.milli;
            }
        }
        let plan = plan.expect("a task that is not a single share has a plan");
        let after = frag.value(idx, node, node.cpu_free - task.cpu_milli, free)
            + frag.misplaced(node, plan);
        cands.push((None, value_before - after));
    }
}

fn fgd_eval(cands: &[(Option<usize>, f64)], resolution: f64) -> Eval {
    let mut best: Option<Eval> = None;
    for &(pick, delta) in cands {
        let s = if resolution == 100.0 {
            fgd_score(delta)
        } else {
            let sig = 1.0 / (1.0 + (-delta / 1000.0).exp());
            (sig * resolution) as i64
        };
        if best.is_none_or(|b| s > b.score) {
            best = Some(Eval {
                score: s,
                pick,
                ties: 0,
            });
        }
    }
    best.unwrap_or(Eval {
        score: 0,
        pick: None,
        ties: 0,
    })
}

fn tie_value(
    key: TieKey,
    node: &NodeState,
    task: &Task,
    scale: Scale,
    cpu_per_gpu_milli: f64,
) -> i64 {
    let cpu_left = (node.cpu_free - task.cpu_milli) as f64 / scale.cpu_milli.max(1) as f64;
    let gpu_left_milli = node.gpu_milli_free() - task.total_gpu_milli();
    let gpu_left = gpu_left_milli as f64 / scale.gpu_milli.max(1) as f64;
    let v = match key {
        TieKey::None => 0.0,
        TieKey::BestFit => 1.0 - 0.5 * (cpu_left + gpu_left),
        TieKey::WorstFit => 0.5 * (cpu_left + gpu_left),
        TieKey::LeastGpuFree => 1.0 - gpu_left,
        TieKey::Surplus => {
            let need = gpu_left_milli as f64 * cpu_per_gpu_milli;
            0.5 + ((node.cpu_free - task.cpu_milli) as f64 - need)
                / (2.0 * scale.cpu_milli.max(1) as f64)
        }
        TieKey::CpuRich => {
            let per_gpu =
                (node.cpu_free - task.cpu_milli) as f64 / (1.0 + gpu_left_milli as f64 / 1000.0);
            per_gpu / scale.cpu_milli.max(1) as f64
        }
    };
    (v * 999.0).clamp(0.0, 999.0) as i64
}

fn quantized(delta: f64, resolution: f64) -> i64 {
    let sig = 1.0 / (1.0 + (-delta / 1000.0).exp());
    (sig * resolution) as i64
}

fn vgpu_eval(
    frag: &Fragmentation,
    node: &NodeState,
    task: &Task,
    plan: Option<&[Vec<super::ledger::Grant>]>,
    cands: &[(Option<usize>, f64)],
    params: VgpuParams,
    scale: Scale,
) -> Eval {
    let share = task.single_share().map_or(0, |d| d.compute_milli);
    let lambda = params.waste_weight;
    let mut best: Option<(i64, Option<usize>)> = None;
    let mut ties = 0u64;
    for &(pick, delta) in cands {
        let dw = if lambda == 0.0 {
            0.0
        } else {
            match pick {
                Some(i) => {
                    let a = node.gpus[i].milli;
                    frag.gpu_waste(a) - frag.gpu_waste(a - share)
                }
                None => plan
                    .into_iter()
                    .flatten()
                    .flatten()
                    .filter(|g| params.waste_whole || g.milli < MILLI_PER_GPU)
                    .map(|g| {
                        let a = node.gpus[usize::from(g.gpu)].milli;
                        frag.gpu_waste(a) - frag.gpu_waste(a - g.milli)
                    })
                    .sum(),
            }
        };
        let primary = quantized(delta + lambda * dw, params.resolution);
        match best {
            Some((p, _)) if primary < p => {}
            Some((p, _)) if primary == p => {
                if let Some(i) = pick.filter(|&i| i < 64) {
                    ties |= 1 << i;
                }
            }
            _ => {
                best = Some((primary, pick));
                ties = pick.filter(|&i| i < 64).map_or(0, |i| 1 << i);
            }
        }
    }
    let (primary, pick) = best.unwrap_or((0, None));
    let key = if task.gpus.is_empty() {
        params.cpu_only
    } else {
        params.gpu_tie
    };
    Eval {
        score: primary * 1000 + tie_value(key, node, task, scale, frag.cpu_per_gpu_milli()),
        pick,
        ties,
    }
}

/// Sum-of-squares secondary key (Csirik et al.): the change of `Σ_h N(h)²` over the
/// cluster's GPU gaps `h` (free milli strictly between 0 and 1000, `N(h)` GPUs each) when
/// a share of `s` goes on a GPU with `g` free. Lower keeps the gaps balanced, so that later
/// tasks find gaps that fit them exactly.
pub fn sum_of_squares_delta(hist: &[u32], g: u32, s: u32) -> i64 {
    let n = |h: u32| i64::from(hist.get(h as usize).copied().unwrap_or(0));
    let mut d = 0;
    if g > 0 && g < MILLI_PER_GPU {
        d += 1 - 2 * n(g);
    }
    let after = g.saturating_sub(s);
    if after > 0 && after < MILLI_PER_GPU {
        d += 2 * n(after) + 1;
    }
    d
}

/// Sum-of-squares over nodes' fully free GPUs: the change of `Σ_k N(k)²` (`N(k)` = nodes
/// with exactly `k` fully free GPUs) when a node with `f` fully free GPUs gives `k` of them.
pub fn sum_of_squares_delta_nodes(hist: &[u32], f: usize, k: usize) -> i64 {
    if k == 0 || k > f {
        return 0;
    }
    let n = |h: usize| i64::from(hist.get(h).copied().unwrap_or(0));
    (1 - 2 * n(f)) + (2 * n(f - k) + 1)
}

/// [`sum_of_squares_delta_nodes`] over open nodes only: `N(k)` for `0 < k < size`, the
/// levels of a node of `size` GPUs that is neither full (no fully free GPU) nor idle (all
/// fully free), as Csirik et al. count only partly filled bins. `hist` is the histogram of
/// nodes of that size.
pub fn sum_of_squares_delta_open_nodes(hist: &[u32], size: usize, f: usize, k: usize) -> i64 {
    if k == 0 || k > f {
        return 0;
    }
    let n = |h: usize| i64::from(hist.get(h).copied().unwrap_or(0));
    let open = |h: usize| h > 0 && h < size;
    let mut d = 0;
    if open(f) {
        d += 1 - 2 * n(f);
    }
    if open(f - k) {
        d += 2 * n(f - k) + 1;
    }
    d
}

impl Policy {
    /// The live secondary key for a cached verdict: depends on cluster-wide state (the
    /// free-milli histogram of every GPU), so it is computed at every decision. Returns
    /// the key (higher is better) and the GPU to use. `None` when the policy has none.
    pub fn live(
        &mut self,
        node: &NodeState,
        task: &Task,
        eval: &Eval,
        hist: &[u32],
        whole_hist: &[u32],
        whole_of_size: &[u32],
    ) -> Option<(i64, Option<usize>)> {
        if self.name == PolicyName::Random {
            // A fresh uniform key per decision: the cached verdict only says the node fits.
            let key = i64::try_from(self.next_random() >> 2).expect("62 bits fit");
            return Some((key, eval.pick));
        }
        if self.name != PolicyName::Vgpu || !self.vgpu.sum_of_squares {
            return None;
        }
        let Some(d) = task.single_share() else {
            if self.vgpu.node_sum_of_squares
                && !task.gpus.is_empty()
                && task.gpus.iter().all(|d| d.is_whole())
            {
                let k: u32 = task.gpus.iter().map(|d| d.count).sum();
                let f = node.fully_free_count();
                let h = if self.vgpu.node_ss_by_size {
                    whole_of_size
                } else {
                    whole_hist
                };
                let delta = if self.vgpu.node_ss_open_only {
                    sum_of_squares_delta_open_nodes(h, node.gpus.len(), f, k as usize)
                } else {
                    sum_of_squares_delta_nodes(h, f, k as usize)
                };
                return Some((-delta, eval.pick));
            }
            return Some((0, eval.pick));
        };
        let mut best: Option<(i64, usize)> = None;
        let mut mask = eval.ties;
        if mask == 0 {
            return Some((0, eval.pick));
        }
        while mask != 0 {
            let i = mask.trailing_zeros() as usize;
            mask &= mask - 1;
            let mut key = -sum_of_squares_delta(hist, node.gpus[i].milli, d.compute_milli);
            if self.vgpu.node_ss_shares && node.gpu_fully_free(i) {
                let h = if self.vgpu.node_ss_by_size {
                    whole_of_size
                } else {
                    whole_hist
                };
                key -= sum_of_squares_delta_nodes(h, node.fully_free_count(), 1);
            }
            if best.is_none_or(|(k, _)| key > k) {
                best = Some((key, i));
            }
        }
        best.map(|(k, i)| (k, Some(i)))
    }
}
