//! The packing benchmark: replays a production trace through a placement policy.
//!
//! The method follows `benchmarks.md` (the FGD paper's, ATC'23), per seed:
//!
//! 1. shuffle the trace's task list;
//! 2. tune it to `tune_ratio` × the cluster's GPU capacity: below the target, append
//!    copies of tasks drawn at random from the original list, stopping at the first draw
//!    whose per-GPU milli would push the total past the target; above it, remove random
//!    tasks until it is not;
//! 3. schedule the tasks one at a time in that order, never deleting any; a task that fits
//!    nowhere stays unscheduled;
//! 4. ties between equal node scores go to a random node order fixed per seed;
//! 5. record the GPU allocation ratio (allocated / total milli-GPU) against the arrived
//!    GPU demand (0 %, 1 %, … of capacity; failed tasks' demand counts as arrived).

mod topology;
mod trace;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Args;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, RngCore, SeedableRng};
use serde::Serialize;
use vgpu_core::packing::{
    ContextReserve, ContextReserveError, Fragmentation, Ledger, NodeSpec, Policy, PolicyName,
    Scale, Scheduler, Task, VgpuParams, fragmentation_for, typical_tasks,
};

pub use topology::{TopologyStats, topology_for};
pub use trace::{TraceError, read_nodes, read_tasks};
use vgpu_core::topology::NodeTopology;

/// Command-line arguments of `vgpu-scheduler-extender replay`.
#[derive(Debug, Clone, Args)]
pub struct ReplayArgs {
    /// Node list CSV (`sn,cpu_milli,memory_mib,gpu,model`).
    #[arg(long)]
    pub nodes: PathBuf,
    /// Task list CSV (`name,cpu_milli,memory_mib,num_gpu,gpu_milli[,gpu_spec,...]`).
    #[arg(long)]
    pub pods: PathBuf,
    /// Placement policy (random, bestfit, gpupacking, fgd, spread, vgpu), a comma-separated
    /// list, or `all` to run every policy side by side. `NAME:blind` places with the
    /// nodes' topologies hidden from the policy (with `--topology`; measured all the same).
    #[arg(long, default_value = "vgpu")]
    pub policy: String,
    /// Give the trace's nodes the topologies of real machines by GPU model (ADR 0021,
    /// `replay::topology`) and print, per policy, where multi-GPU pods landed: share on
    /// their node's best link class, share across sockets.
    #[arg(long)]
    pub topology: bool,
    /// Tune the task list to this multiple of the cluster's GPU capacity.
    #[arg(long, default_value_t = 1.3)]
    pub tune_ratio: f64,
    /// Seeds: `42-51`, `42,43` or `42`.
    #[arg(long, default_value = "42-51")]
    pub seeds: String,
    /// Share of tasks the FGD typical tasks cover.
    #[arg(long, default_value_t = 0.95)]
    pub typical_coverage: f64,
    /// Print the full curve (every 1 %) instead of every 10 %.
    #[arg(long)]
    pub full_curve: bool,
    /// Overrides of the `vgpu` policy's parameters, for experiments: `w=0.3` (waste
    /// weight), `ww=1` (whole GPUs in the waste term), `ss=1` (sum-of-squares ties
    /// between GPUs), `nss=1` (between nodes, for whole GPUs), `res=100`, `cpu=leastgpu`,
    /// `gpu=none`,
    /// `cov=0.95` (see ADR 0006).
    #[arg(long, default_value = "")]
    pub vgpu: String,
    /// Print, per seed, where the free GPU capacity is left at the end (by node type,
    /// CPU-starved nodes, gaps by size) and which task shapes failed, to stderr.
    #[arg(long)]
    pub explain: bool,
    /// Worker threads (default: available parallelism).
    #[arg(long)]
    pub threads: Option<usize>,
    /// GPU memory reserved per CUDA context, MiB, one per slice (ADR 0012): each GPU
    /// packs `memory − 10 × this` and holds at most 10 tasks. A comma-separated list
    /// (`0,300`) replays each on the same seeds, side by side; 0 reserves nothing.
    #[arg(long, default_value_t = ContextReserve::default().to_string())]
    pub context_reserve_mib: String,
}

/// Why a replay could not run.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// The trace could not be read.
    #[error(transparent)]
    Trace(#[from] TraceError),
    /// A bad `--seeds` value.
    #[error("--seeds {0:?}: expected N, N-M or a comma-separated list")]
    Seeds(String),
    /// A bad `--policy` value.
    #[error("--policy: {0}")]
    Policy(#[from] vgpu_core::packing::UnknownPolicy),
    /// A bad `--vgpu` value.
    #[error("--vgpu: {0}")]
    VgpuParams(String),
    /// A bad `--tune-ratio` value.
    #[error("--tune-ratio {0}: must be a positive finite number")]
    TuneRatio(f64),
    /// The node list has no GPU.
    #[error("node list {0}: no GPU in the cluster")]
    NoGpus(PathBuf),
    /// A bad `--context-reserve-mib` value.
    #[error("--context-reserve-mib {value:?}: {reason}")]
    ContextReserve {
        /// The text as given.
        value: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A GPU of the node list cannot hold the context reservation.
    #[error("node list {path}")]
    GpuTooSmall {
        /// The node list.
        path: PathBuf,
        /// Which GPU, and why.
        #[source]
        source: ContextReserveError,
    },
}

/// Parses `--context-reserve-mib`: `300` or a comma-separated list `0,300`.
pub fn parse_context_reserves(text: &str) -> Result<Vec<ContextReserve>, ReplayError> {
    let bad = |reason: String| ReplayError::ContextReserve {
        value: text.to_owned(),
        reason,
    };
    let out = text
        .split(',')
        .map(|part| {
            let mib: u64 = part
                .trim()
                .parse()
                .map_err(|_| bad(format!("{part:?} is not a whole number of MiB")))?;
            ContextReserve::new(mib).map_err(|e| bad(e.to_string()))
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(out)
}

impl Workload {
    /// The workload as placed under a context reservation (ADR 0012): every GPU packs
    /// what it keeps for quotas, every GPU task holds a slice.
    pub fn with_contexts(
        &self,
        contexts: ContextReserve,
        path: &Path,
    ) -> Result<Workload, ReplayError> {
        let nodes = self
            .nodes
            .iter()
            .map(|n| contexts.node_spec(n.clone()))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|source| ReplayError::GpuTooSmall {
                path: path.to_owned(),
                source,
            })?;
        let tasks = self
            .tasks
            .iter()
            .map(|t| Task {
                gpus: t.gpus.iter().map(|d| contexts.demand(*d)).collect(),
                ..t.clone()
            })
            .collect();
        Ok(Workload { nodes, tasks })
    }
}

/// Parses `42-51`, `42,43,44` or `42`.
pub fn parse_seeds(text: &str) -> Result<Vec<u64>, ReplayError> {
    let bad = || ReplayError::Seeds(text.to_owned());
    let mut out = Vec::new();
    for part in text.split(',') {
        let part = part.trim();
        if let Some((a, b)) = part.split_once('-') {
            let a: u64 = a.trim().parse().map_err(|_| bad())?;
            let b: u64 = b.trim().parse().map_err(|_| bad())?;
            if b < a || b - a > 10_000 {
                return Err(bad());
            }
            out.extend(a..=b);
        } else {
            out.push(part.parse().map_err(|_| bad())?);
        }
    }
    if out.is_empty() {
        return Err(bad());
    }
    Ok(out)
}

/// Parses `--policy` with `:blind` suffixes: each policy and whether it places blind to
/// the nodes' topologies.
pub fn parse_policy_runs(text: &str) -> Result<Vec<(PolicyName, bool)>, ReplayError> {
    let mut out = Vec::new();
    for part in text.split(',') {
        let part = part.trim();
        let (name, blind) = match part.strip_suffix(":blind") {
            Some(n) => (n, true),
            None => (part, false),
        };
        out.extend(parse_policies(name)?.into_iter().map(|p| (p, blind)));
    }
    Ok(out)
}

/// Parses `all`, one name, or a comma-separated list.
pub fn parse_policies(text: &str) -> Result<Vec<PolicyName>, ReplayError> {
    if text.trim() == "all" {
        return Ok(PolicyName::ALL.to_vec());
    }
    text.split(',')
        .map(|p| p.trim().parse::<PolicyName>().map_err(ReplayError::from))
        .collect()
}

/// The outcome of one seed.
#[derive(Debug, Clone, Serialize)]
pub struct SeedResult {
    /// The seed.
    pub seed: u64,
    /// Allocation ratio (%) at arrived demand 0 %, 1 %, … (index = percent).
    pub curve: Vec<f64>,
    /// Allocation ratio (%) once every task has arrived.
    pub final_allocation_pct: f64,
    /// Arrived demand at the end, % of capacity.
    pub final_arrived_pct: f64,
    /// Tasks in the tuned list.
    pub tasks: usize,
    /// Tasks that fit nowhere.
    pub failed: usize,
    /// Multi-GPU placements against the nodes' topologies (with `--topology`).
    pub topology: TopologyStats,
}

/// A cluster and a workload ready to replay.
#[derive(Debug, Clone)]
pub struct Workload {
    /// Nodes.
    pub nodes: Vec<NodeSpec>,
    /// Tasks in trace order.
    pub tasks: Vec<Task>,
}

impl Workload {
    /// Total GPU capacity, milli-GPU.
    pub fn capacity_milli(&self) -> u64 {
        self.nodes.iter().map(|n| n.gpus.len() as u64 * 1000).sum()
    }

    fn scale(&self) -> Scale {
        Scale {
            cpu_milli: self.nodes.iter().map(|n| n.cpu_milli).max().unwrap_or(1),
            gpu_milli: self
                .nodes
                .iter()
                .map(|n| n.gpus.len() as u64 * 1000)
                .max()
                .unwrap_or(1),
        }
    }
}

/// Shuffles and tunes the task list for one seed (steps 1–2 of the method).
pub fn tuned_order(
    tasks: &[Task],
    capacity_milli: u64,
    ratio: f64,
    rng: &mut StdRng,
) -> Vec<usize> {
    let mut order: Vec<usize> = (0..tasks.len()).collect();
    order.shuffle(rng);
    let target = ratio * capacity_milli as f64;
    let mut total: u64 = tasks.iter().map(Task::total_gpu_milli).sum();
    if (total as f64) < target && !tasks.is_empty() {
        loop {
            let i = rng.random_range(0..tasks.len());
            let per_gpu = tasks[i]
                .gpus
                .first()
                .map_or(0, |d| u64::from(d.compute_milli));
            if (total + per_gpu) as f64 > target {
                break;
            }
            order.push(i);
            total += tasks[i].total_gpu_milli();
        }
    } else {
        while (total as f64) > target && !order.is_empty() {
            let k = rng.random_range(0..order.len());
            let i = order.remove(k);
            total -= tasks[i].total_gpu_milli();
        }
    }
    order
}

/// Replays one seed with one policy. Multi-GPU placements are measured against
/// `measure` (a topology per node; empty or unknown: not measured).
#[allow(clippy::too_many_arguments)] // the replay's knobs, passed as they are
pub fn replay_seed(
    workload: &Workload,
    measure: &[NodeTopology],
    policy_name: PolicyName,
    frag: Option<&Fragmentation>,
    params: VgpuParams,
    seed: u64,
    ratio: f64,
    explain: bool,
) -> SeedResult {
    let mut rng = StdRng::seed_from_u64(seed);
    let capacity = workload.capacity_milli();
    let order = tuned_order(&workload.tasks, capacity, ratio, &mut rng);
    let mut node_order: Vec<usize> = (0..workload.nodes.len()).collect();
    node_order.shuffle(&mut rng);
    let mut policy = Policy::new(policy_name, frag.cloned(), rng.next_u64(), workload.scale());
    policy.vgpu = params;
    let mut scheduler = Scheduler::new(policy, node_order);
    let mut ledger =
        Ledger::with_nodes(workload.nodes.iter().cloned()).expect("node names were checked unique");

    let max_pct = (ratio * 100.0).round() as usize;
    let mut curve = Vec::with_capacity(max_pct + 1);
    curve.push(0.0);
    let mut arrived: u64 = 0;
    let mut allocated: u64 = 0;
    let mut failed = 0;
    let debug = explain;
    let mut fails: std::collections::BTreeMap<String, u64> = Default::default();
    let mut fails_n: std::collections::BTreeMap<u64, u64> = Default::default();
    let mut topo_stats = TopologyStats::default();
    for (k, &i) in order.iter().enumerate() {
        let task = &workload.tasks[i];
        arrived += task.total_gpu_milli();
        match scheduler.choose(&ledger, task) {
            Some(p) => {
                topo_stats.record(
                    measure.get(p.node).filter(|t| t.is_known()),
                    workload.nodes[p.node].gpus.len(),
                    &p,
                );
                ledger
                    .commit(&k.to_string(), task, p)
                    .expect("the scheduler's choice fits the ledger it was made on");
                allocated += task.total_gpu_milli();
            }
            None => {
                failed += 1;
                if debug {
                    let key = match task.gpus.first() {
                        None => "cpu".to_owned(),
                        Some(d) if d.count > 1 => format!("x{}", d.count),
                        Some(d) => d.compute_milli.to_string(),
                    };
                    *fails.entry(key).or_insert(0u64) += task.total_gpu_milli();
                    *fails_n.entry(pct_bucket(arrived, capacity)).or_insert(0u64) += 1;
                }
            }
        }
        let pct_arrived = arrived as f64 * 100.0 / capacity as f64;
        while curve.len() <= max_pct && (curve.len() as f64) <= pct_arrived {
            curve.push(allocated as f64 * 100.0 / capacity as f64);
        }
    }
    let final_allocation_pct = allocated as f64 * 100.0 / capacity as f64;
    if debug {
        debug_leftovers(&ledger, &workload.tasks);
        eprintln!("failed milli by shape: {fails:?}");
        eprintln!("failed tasks by arrived decile: {fails_n:?}");
    }
    while curve.len() <= max_pct {
        curve.push(final_allocation_pct);
    }
    SeedResult {
        seed,
        curve,
        final_allocation_pct,
        final_arrived_pct: arrived as f64 * 100.0 / capacity as f64,
        tasks: order.len(),
        failed,
        topology: topo_stats,
    }
}

fn pct_bucket(arrived: u64, capacity: u64) -> u64 {
    arrived * 10 / capacity
}

fn debug_leftovers(ledger: &Ledger, tasks: &[Task]) {
    use std::collections::BTreeMap;
    let min_cpu = tasks
        .iter()
        .filter(|t| !t.gpus.is_empty())
        .map(|t| t.cpu_milli)
        .min()
        .unwrap_or(0);
    // model -> (gpus, free milli, free on cpu-starved nodes, fully free gpus, partial free milli)
    let mut by: BTreeMap<String, [u64; 6]> = BTreeMap::new();
    for n in ledger.nodes() {
        let m = n.spec.gpus.first().map_or(String::new(), |g| {
            format!("{}x{}", g.model, n.spec.gpus.len())
        });
        let e = by.entry(m).or_default();
        let free = n.gpu_milli_free();
        e[0] += n.spec.gpus.len() as u64;
        e[1] += free;
        if n.cpu_free < 4000 {
            e[2] += free;
        }
        e[3] += n.gpus.iter().filter(|g| g.milli == 1000).count() as u64;
        e[4] += n
            .gpus
            .iter()
            .filter(|g| g.milli < 1000)
            .map(|g| u64::from(g.milli))
            .sum::<u64>();
        e[5] += n.cpu_free / 1000;
    }
    eprintln!("min gpu-task cpu {min_cpu}");
    let mut hist: BTreeMap<u32, (u64, u64)> = BTreeMap::new();
    for n in ledger.nodes() {
        for g in &n.gpus {
            if g.milli > 0 && g.milli < 1000 {
                let e = hist.entry(g.milli).or_default();
                e.0 += 1;
                if n.cpu_free < 4000 {
                    e.1 += 1;
                }
            }
        }
    }
    let mut line = String::new();
    for (k, (c, starved)) in hist.iter().filter(|(_, v)| v.0 >= 15) {
        line.push_str(&format!("{k}:{c}/{starved} "));
    }
    eprintln!("free-milli histogram (count/cpu-starved): {line}");
    for (k, v) in by {
        eprintln!(
            "{k:<12} gpus {:>5} free {:>8} cpu<4c {:>8} fullfree {:>5} partial {:>7} freecores {:>6}",
            v[0], v[1], v[2], v[3], v[4], v[5]
        );
    }
}

/// The results of one policy over all seeds.
#[derive(Debug, Clone, Serialize)]
pub struct PolicyResult {
    /// Policy name.
    pub policy: String,
    /// Mean over seeds of the final allocation ratio, %.
    pub mean_final_allocation_pct: f64,
    /// Final allocation ratio per seed, %.
    pub per_seed_final_allocation_pct: Vec<f64>,
    /// Mean failed tasks per seed.
    pub mean_failed_tasks: f64,
    /// Wall-clock seconds for all seeds of this policy.
    pub seconds: f64,
    /// Multi-GPU placements over all seeds (with `--topology`).
    pub topology: TopologyStats,
    /// Per-seed details.
    #[serde(skip)]
    pub seeds: Vec<SeedResult>,
}

impl PolicyResult {
    fn mean_curve(&self) -> Vec<f64> {
        let n = self.seeds.len().max(1) as f64;
        let len = self.seeds.first().map_or(0, |s| s.curve.len());
        (0..len)
            .map(|p| self.seeds.iter().map(|s| s.curve[p]).sum::<f64>() / n)
            .collect()
    }
}

/// Runs every seed of one policy, `threads` seeds at a time; `blind`: the policy places
/// with the nodes' topologies hidden (measured against them all the same).
#[allow(clippy::too_many_arguments)] // the replay's knobs, passed as they are
pub fn run_policy(
    workload: &Workload,
    blind: bool,
    policy: PolicyName,
    frag: &Fragmentation,
    params: VgpuParams,
    seeds: &[u64],
    ratio: f64,
    threads: usize,
    explain: bool,
) -> PolicyResult {
    let start = Instant::now();
    let measure: Vec<NodeTopology> = workload.nodes.iter().map(|n| n.topology.clone()).collect();
    let hidden;
    let workload = if blind {
        hidden = Workload {
            nodes: workload
                .nodes
                .iter()
                .map(|n| NodeSpec {
                    topology: NodeTopology::default(),
                    ..n.clone()
                })
                .collect(),
            tasks: workload.tasks.clone(),
        };
        &hidden
    } else {
        workload
    };
    let measure = &measure;
    // `vgpu` builds its own model (its classes, its coverage); the others share FGD's.
    let own;
    let frag = if policy == PolicyName::Vgpu {
        own = fragmentation_for(policy, &params, &workload.tasks, params.coverage);
        own.as_ref()
    } else {
        policy.needs_typical_tasks().then_some(frag)
    };
    let mut results: Vec<SeedResult> = Vec::with_capacity(seeds.len());
    for chunk in seeds.chunks(threads.max(1)) {
        let out: Vec<SeedResult> = std::thread::scope(|s| {
            let handles: Vec<_> = chunk
                .iter()
                .map(|&seed| {
                    s.spawn(move || {
                        replay_seed(
                            workload, measure, policy, frag, params, seed, ratio, explain,
                        )
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("a replay thread panicked"))
                .collect()
        });
        results.extend(out);
    }
    let finals: Vec<f64> = results.iter().map(|r| r.final_allocation_pct).collect();
    let n = finals.len().max(1) as f64;
    let mut topology = TopologyStats::default();
    for r in &results {
        topology.add(&r.topology);
    }
    PolicyResult {
        policy: if blind {
            format!("{policy}:blind")
        } else {
            policy.as_str().to_owned()
        },
        topology,
        mean_final_allocation_pct: finals.iter().sum::<f64>() / n,
        mean_failed_tasks: results.iter().map(|r| r.failed as f64).sum::<f64>() / n,
        per_seed_final_allocation_pct: finals,
        seconds: start.elapsed().as_secs_f64(),
        seeds: results,
    }
}

/// The trace's short name: `openb_pod_list_gpushare40.csv` → `gpushare40`.
pub fn trace_name(pods: &Path) -> String {
    let stem = pods
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    stem.strip_prefix("openb_pod_list_")
        .map(str::to_owned)
        .unwrap_or(stem)
}

#[derive(Debug, Serialize)]
struct Summary<'a> {
    policy: String,
    trace: String,
    seeds: &'a [u64],
    tune_ratio: f64,
    nodes: usize,
    gpus: u64,
    tasks_in_trace: usize,
    typical_tasks: usize,
    /// The context reservations replayed, MiB (ADR 0012).
    context_reserve_mib: Vec<u64>,
    /// One number for one policy; an object policy → number for several.
    mean_final_allocation_pct: serde_json::Value,
    results: &'a [PolicyResult],
    seconds: f64,
}

/// Runs the replay and prints the curve table and, as the last line, a JSON summary.
pub fn run(args: &ReplayArgs) -> Result<(), ReplayError> {
    let start = Instant::now();
    if !(args.tune_ratio.is_finite() && args.tune_ratio > 0.0) {
        return Err(ReplayError::TuneRatio(args.tune_ratio));
    }
    let seeds = parse_seeds(&args.seeds)?;
    let runs = parse_policy_runs(&args.policy)?;
    let policies: Vec<PolicyName> = runs.iter().map(|r| r.0).collect();
    let params = VgpuParams::parse(&args.vgpu).map_err(ReplayError::VgpuParams)?;
    let reserves = parse_context_reserves(&args.context_reserve_mib)?;
    let mut nodes = read_nodes(&args.nodes)?;
    if args.topology {
        for n in &mut nodes {
            let model = n.gpus.first().map_or("", |g| g.model.as_str());
            n.topology = topology_for(model, n.gpus.len()).unwrap_or_default();
        }
    }
    let tasks = read_tasks(&args.pods)?;
    let trace_workload = Workload { nodes, tasks };
    if trace_workload.capacity_milli() == 0 {
        return Err(ReplayError::NoGpus(args.nodes.clone()));
    }
    let threads = args.threads.unwrap_or_else(|| {
        std::thread::available_parallelism()
            .map(std::num::NonZeroUsize::get)
            .unwrap_or(1)
    });
    let trace = trace_name(&args.pods);
    let mut results = Vec::new();
    let mut n_typical = 0;
    for &contexts in &reserves {
        let workload = trace_workload.with_contexts(contexts, &args.nodes)?;
        let typical = typical_tasks(&workload.tasks, args.typical_coverage);
        n_typical = typical.len();
        let frag = Fragmentation::new(typical).with_coverage(args.typical_coverage);
        println!(
            "# trace {trace}: {} nodes, {} GPUs, {} tasks ({} typical shapes), tune ratio {}, seeds {}, context reservation {} MiB",
            workload.nodes.len(),
            workload.capacity_milli() / 1000,
            workload.tasks.len(),
            n_typical,
            args.tune_ratio,
            args.seeds,
            contexts.mib()
        );
        for &(p, blind) in &runs {
            let mut r = run_policy(
                &workload,
                blind,
                p,
                &frag,
                params,
                &seeds,
                args.tune_ratio,
                threads,
                args.explain,
            );
            if reserves.len() > 1 {
                r.policy = format!("{}/ctx{}", r.policy, contexts.mib());
            }
            eprintln!(
                "{:<11} mean {:.2} % ({} seeds, {:.1} s)",
                r.policy,
                r.mean_final_allocation_pct,
                seeds.len(),
                r.seconds
            );
            results.push(r);
        }
    }
    let workload = &trace_workload;
    print!("{}", curve_table(&results, args.full_curve));
    if args.topology {
        print!("{}", topology_table(&results));
    }
    let mean = if results.len() == 1 {
        serde_json::json!(round2(results[0].mean_final_allocation_pct))
    } else {
        serde_json::Value::Object(
            results
                .iter()
                .map(|r| {
                    (
                        r.policy.clone(),
                        serde_json::json!(round2(r.mean_final_allocation_pct)),
                    )
                })
                .collect(),
        )
    };
    let summary = Summary {
        policy: if policies.len() == 1 {
            results[0].policy.clone()
        } else {
            results
                .iter()
                .map(|r| r.policy.as_str())
                .collect::<Vec<_>>()
                .join(",")
        },
        trace,
        seeds: &seeds,
        tune_ratio: args.tune_ratio,
        nodes: workload.nodes.len(),
        gpus: workload.capacity_milli() / 1000,
        tasks_in_trace: workload.tasks.len(),
        typical_tasks: n_typical,
        context_reserve_mib: reserves.iter().map(|c| c.mib()).collect(),
        mean_final_allocation_pct: mean,
        results: &results,
        seconds: start.elapsed().as_secs_f64(),
    };
    println!(
        "{}",
        serde_json::to_string(&summary).expect("the summary always serializes")
    );
    Ok(())
}

/// Per policy, where its multi-GPU pods landed (all seeds together) beside its mean
/// allocation ratio.
pub fn topology_table(results: &[PolicyResult]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "| policy | multi-GPU pods | on their node's best class | with a choice: on best | across sockets (avoidable) | allocation % |"
    );
    let _ = writeln!(out, "|---|---|---|---|---|---|");
    for r in results {
        let t = &r.topology;
        if t.multi_gpu_pods == 0 {
            let _ = writeln!(
                out,
                "| {} | 0 | — | — | — | {:.2} |",
                r.policy, r.mean_final_allocation_pct
            );
            continue;
        }
        let _ = writeln!(
            out,
            "| {} | {} | {:.2} % | {:.2} % ({}) | {:.2} % | {:.2} |",
            r.policy,
            t.multi_gpu_pods,
            t.on_best_pct(),
            t.with_choice_on_best_pct(),
            t.with_choice,
            t.across_pct(),
            r.mean_final_allocation_pct
        );
    }
    out
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

/// The mean curve of each policy: allocation ratio (%) at arrived demand 0 %, 10 %, …
/// (every 1 % with `full`), and the final value.
pub fn curve_table(results: &[PolicyResult], full: bool) -> String {
    let mut out = String::new();
    let Some(first) = results.first() else {
        return out;
    };
    let len = first.seeds.first().map_or(0, |s| s.curve.len());
    let step = if full { 1 } else { 10 };
    let points: Vec<usize> = (0..len)
        .filter(|p| p % step == 0 || *p == len - 1)
        .collect();
    let _ = write!(out, "{:<8}", "arrived%");
    for r in results {
        let _ = write!(out, " {:>10}", r.policy);
    }
    out.push('\n');
    let curves: Vec<Vec<f64>> = results.iter().map(PolicyResult::mean_curve).collect();
    for &p in &points {
        let _ = write!(out, "{p:<8}");
        for c in &curves {
            let _ = write!(out, " {:>10.2}", c[p]);
        }
        out.push('\n');
    }
    let _ = write!(out, "{:<8}", "final");
    for r in results {
        let _ = write!(out, " {:>10.2}", r.mean_final_allocation_pct);
    }
    out.push('\n');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeds_parse() {
        assert_eq!(parse_seeds("42-44").ok(), Some(vec![42, 43, 44]));
        assert_eq!(parse_seeds("1,5").ok(), Some(vec![1, 5]));
        assert!(parse_seeds("5-1").is_err());
        assert!(parse_seeds("x").is_err());
    }

    #[test]
    fn trace_names() {
        assert_eq!(
            trace_name(Path::new("/a/openb_pod_list_gpushare40.csv")),
            "gpushare40"
        );
        assert_eq!(trace_name(Path::new("x.csv")), "x");
    }
}
