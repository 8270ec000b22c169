//! `topo-bench`: does the extender's choice of GPUs for a multi-GPU container matter?
//! A ring of peer copies, as a ring all-reduce moves data, timed by the simulator's
//! device time on a node preset with some GPUs already taken: on the set the extender's
//! policy chooses (`vgpu_core::packing`: the plan that `filter`/`bind` use, with the
//! node's topology from the device plugin's inventory), on the set the topology-blind
//! rule took before (the lowest-numbered free GPUs), and on random feasible sets.
//!
//! Build first (`cargo xtask sim && cargo build --release -p vgpu-device-plugin -p
//! vgpu-tests --bin topo-bench`), then run
//! `target/release/topo-bench [--preset pcie-8gpu] [--count 4] [--taken 0,5] [--random 20]
//! [--seed 1] [--mib 256] [--reps 4] [--rounds 3]`.
//!
//! How: the node's inventory is what `vgpu-device-plugin health` reads from the
//! simulated NVML (the plugin binary next to this one). Each set runs in its own process
//! (this binary, `ring`), with `CUDA_VISIBLE_DEVICES` naming the set's GPUs, as a
//! container granted them: it allocates a `--mib` buffer on each GPU and, per round,
//! holds every GPU's stream at a gate while it queues `--reps` copies of one ring chunk
//! (`mib / count`) from each GPU to the next (`cuMemcpyPeerAsync` on the sender's
//! stream) between two events, then opens the gate. A ring all-reduce's step is
//! bounded by its slowest link, so the step's device time is the slowest GPU's
//! `cuEventElapsedTime / reps`, and the all-reduce takes `2 (count - 1)` such steps.
//! The simulator charges each copy `bytes / link bandwidth` on the device's virtual clock
//! (ADR 0019), so the figures are the model's link classes as a program sees them through
//! the driver API, not a host's timing; the median of `--rounds` is reported.

#![allow(unsafe_code)] // calls C entry points resolved with dlopen/dlsym; each says why.

use std::collections::BTreeSet;
use std::ffi::{c_int, c_void};
use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{Context, Result, bail};
use libloading::{Library, Symbol};
use vgpu_core::inventory::NodeInventory;
use vgpu_core::packing::{Grant, Ledger, NodeSpec, Placement, Task};
use vgpu_core::resources::{GpuDemand, ModelConstraint};
use vgpu_core::topology::NodeTopology;
use vgpu_cuda_abi::cuda::{CUcontext, CUdeviceptr, CUevent, CUstream};
use vgpu_cuda_abi::fns;
use vgpu_tests::{SimNode, sim_lib_dir};

struct Args {
    preset: String,
    count: usize,
    taken: Vec<u32>,
    random: usize,
    seed: u64,
    mib: usize,
    reps: usize,
    rounds: usize,
}

fn value<T: std::str::FromStr>(flag: &str, v: Option<String>) -> Result<T> {
    let v = v.with_context(|| format!("{flag} needs a value"))?;
    v.parse()
        .map_err(|_| anyhow::anyhow!("{flag}: {v:?} is not a valid value"))
}

fn parse_args(mut it: impl Iterator<Item = String>) -> Result<Args> {
    let mut a = Args {
        preset: "pcie-8gpu".into(),
        count: 4,
        taken: vec![0, 5],
        random: 20,
        seed: 1,
        mib: 256,
        reps: 4,
        rounds: 3,
    };
    while let Some(f) = it.next() {
        match f.as_str() {
            "--preset" => a.preset = value(&f, it.next())?,
            "--count" => a.count = value(&f, it.next())?,
            "--taken" => {
                let v: String = value(&f, it.next())?;
                a.taken = v
                    .split(',')
                    .filter(|s| !s.is_empty())
                    .map(|s| {
                        s.parse()
                            .map_err(|_| anyhow::anyhow!("--taken: {s:?} is not a GPU index"))
                    })
                    .collect::<Result<_>>()?;
            }
            "--random" => a.random = value(&f, it.next())?,
            "--seed" => a.seed = value(&f, it.next())?,
            "--mib" => a.mib = value(&f, it.next())?,
            "--reps" => a.reps = value(&f, it.next())?,
            "--rounds" => a.rounds = value(&f, it.next())?,
            _ => bail!("unknown argument {f:?} (see the file's documentation)"),
        }
    }
    if a.count < 2 {
        bail!("--count: {} GPUs make no ring (at least 2)", a.count);
    }
    if a.mib == 0 || a.reps == 0 || a.rounds == 0 {
        bail!("--mib, --reps and --rounds must be at least 1");
    }
    Ok(a)
}

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1).peekable();
    if args.peek().map(String::as_str) == Some("ring") {
        args.next();
        let mib: usize = value("ring MIB", args.next())?;
        let reps: usize = value("ring REPS", args.next())?;
        let rounds: usize = value("ring ROUNDS", args.next())?;
        return ring(mib, reps, rounds);
    }
    let a = parse_args(args)?;
    bench(&a)
}

/// The node's inventory as the device plugin publishes it (its `health` command).
fn inventory(node: &SimNode) -> Result<NodeInventory> {
    let plugin = std::env::current_exe()?
        .parent()
        .context("the binary's directory")?
        .join("vgpu-device-plugin");
    let mut child = node
        .command(&plugin)
        .args(["health", "--nvml-lib"])
        .arg(sim_lib_dir().join("libnvidia-ml.so.1"))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| {
            format!(
                "run {} (build it with -p vgpu-device-plugin)",
                plugin.display()
            )
        })?;
    let mut line = String::new();
    BufReader::new(child.stdout.take().context("piped stdout")?).read_line(&mut line)?;
    let _ = child.kill();
    let _ = child.wait();
    NodeInventory::from_json(line.trim()).context("the plugin's inventory line")
}

/// The set the extender's plan gives a container of `count` whole GPUs on this node with
/// `taken` GPUs held by other pods, with and without the node's topology.
fn extender_set(
    inv: &NodeInventory,
    taken: &[u32],
    count: usize,
    topology: bool,
) -> Result<Vec<u32>> {
    let mut spec = NodeSpec::from_inventory("bench".into(), inv);
    spec.cpu_milli = 1_000_000;
    spec.memory_mib = 1 << 30;
    if !topology {
        spec.topology = NodeTopology::default();
    }
    let mut ledger = Ledger::new();
    ledger.add_node(spec)?;
    let whole = |n: u32| Task {
        cpu_milli: 0,
        memory_mib: 0,
        gpus: vec![GpuDemand::whole(n)],
        models: ModelConstraint::any(),
    };
    for &t in taken {
        let g = inv.gpus.get(t as usize).with_context(|| {
            format!("--taken: GPU {t} is not on the {}-GPU node", inv.gpus.len())
        })?;
        let grant = Grant {
            gpu: u16::try_from(t)?,
            milli: 1000,
            memory_mib: g.memory_mib,
            slices: 10,
        };
        ledger.commit(
            &format!("taken-{t}"),
            &whole(1),
            Placement {
                node: 0,
                containers: vec![vec![grant]],
            },
        )?;
    }
    let plan = ledger
        .node(0)
        .fit(&whole(u32::try_from(count)?))
        .map_err(|r| anyhow::anyhow!("the extender does not place {count} GPUs: {r:?}"))?;
    let mut set: Vec<u32> = plan[0].iter().map(|g| u32::from(g.gpu)).collect();
    set.sort_unstable();
    Ok(set)
}

/// xorshift64: deterministic random sets for a seed.
fn next(s: &mut u64) -> u64 {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    *s
}

/// Up to `n` distinct random `count`-subsets of `free`.
fn random_sets(free: &[u32], count: usize, n: usize, seed: u64) -> Vec<Vec<u32>> {
    let mut s = seed.max(1).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut out: BTreeSet<Vec<u32>> = BTreeSet::new();
    let mut seen = Vec::new();
    for _ in 0..n * 50 {
        if seen.len() >= n {
            break;
        }
        let mut pool = free.to_vec();
        for i in (1..pool.len()).rev() {
            let j = usize::try_from(next(&mut s) % (i as u64 + 1)).unwrap_or(0);
            pool.swap(i, j);
        }
        let mut set: Vec<u32> = pool.into_iter().take(count).collect();
        set.sort_unstable();
        if out.insert(set.clone()) {
            seen.push(set);
        }
    }
    seen
}

/// Device time of one ring step (ms, median of the rounds) on `set`, in its own process.
fn run_ring(node: &SimNode, set: &[u32], a: &Args) -> Result<f64> {
    let visible = set
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let out = node
        .command(std::env::current_exe()?)
        .args([
            "ring",
            &a.mib.to_string(),
            &a.reps.to_string(),
            &a.rounds.to_string(),
        ])
        .env("CUDA_VISIBLE_DEVICES", &visible)
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "ring on GPUs {visible} failed ({}): {text}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    text.lines()
        .find_map(|l| l.strip_prefix("step_ms="))
        .and_then(|v| v.trim().parse().ok())
        .with_context(|| format!("no step_ms= from the ring on {visible}: {text}"))
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn bench(a: &Args) -> Result<()> {
    let node = SimNode::new(&format!("preset = \"{}\"\n", a.preset));
    let inv = inventory(&node)?;
    let topo = NodeTopology::from_inventory(&inv);
    let free: Vec<u32> = (0..u32::try_from(inv.gpus.len())?)
        .filter(|g| !a.taken.contains(g))
        .collect();
    let aware = extender_set(&inv, &a.taken, a.count, true)?;
    let blind = extender_set(&inv, &a.taken, a.count, false)?;
    let randoms = random_sets(&free, a.count, a.random, a.seed);
    let steps = 2 * (a.count - 1);
    let chunk_mib = a.mib as f64 / a.count as f64;
    println!(
        "topo-bench: preset {}, GPUs taken {:?}, ring of {} GPUs, {} MiB per GPU ({chunk_mib:.1} MiB chunks, {steps} steps), {} copies per step, median of {} rounds; device time (simulator)",
        a.preset, a.taken, a.count, a.mib, a.reps, a.rounds
    );
    let class = |s: &[u32]| topo.set_class(s).map_or("-", |c| c.name());
    let row = |label: &str, s: &[u32], ms: f64, base: f64| {
        println!(
            "  {label:<22} GPUs {:<14} worst pair {:<7} all-reduce {:>8.3} ms  ×{:.2} of the extender's",
            format!("{s:?}"),
            class(s),
            ms * steps as f64,
            ms / base
        );
    };
    let aware_ms = run_ring(&node, &aware, a)?;
    row("extender (topology)", &aware, aware_ms, aware_ms);
    let blind_ms = run_ring(&node, &blind, a)?;
    row("lowest free (blind)", &blind, blind_ms, aware_ms);
    let mut rand_ms = Vec::new();
    for (i, s) in randoms.iter().enumerate() {
        let ms = run_ring(&node, s, a)?;
        row(&format!("random #{}", i + 1), s, ms, aware_ms);
        rand_ms.push(ms);
    }
    if rand_ms.is_empty() {
        bail!("no random feasible set of {} among {free:?}", a.count);
    }
    let mean = rand_ms.iter().sum::<f64>() / rand_ms.len() as f64;
    let med = median(&mut rand_ms);
    let better = rand_ms.iter().filter(|&&m| m < aware_ms * 0.999).count();
    println!(
        "summary: all-reduce on the extender's set {:.3} ms; random feasible sets ({}) mean {:.3} ms (×{:.2}), median {:.3} ms (×{:.2}); topology-blind set {:.3} ms (×{:.2}); random sets faster than the extender's: {better}",
        aware_ms * steps as f64,
        rand_ms.len(),
        mean * steps as f64,
        mean / aware_ms,
        med * steps as f64,
        med / aware_ms,
        blind_ms * steps as f64,
        blind_ms / aware_ms
    );
    Ok(())
}

// ---- the ring, in the process that runs it ------------------------------------------------

struct Cuda {
    lib: Library,
}

impl Cuda {
    fn sym<T: Copy>(&self, name: &str) -> Result<T> {
        // SAFETY: every caller names a driver entry point with the matching C signature
        // from `vgpu_cuda_abi::fns`.
        let s: Symbol<'_, T> =
            unsafe { self.lib.get(name.as_bytes()) }.with_context(|| format!("resolve {name}"))?;
        Ok(*s)
    }
}

fn ok(what: &str, r: u32) -> Result<()> {
    if r != 0 {
        bail!("{what} failed: CUresult {r}");
    }
    Ok(())
}

/// The gate every stream waits at while a round is queued.
static GATE_OPEN: AtomicBool = AtomicBool::new(false);

unsafe extern "C" fn gate(_: *mut c_void) {
    while !GATE_OPEN.load(Ordering::Acquire) {
        std::thread::sleep(std::time::Duration::from_micros(100));
    }
}

fn ring(mib: usize, reps: usize, rounds: usize) -> Result<()> {
    // SAFETY: loading the driver runs its initialisers, as any CUDA program does.
    let lib = unsafe { Library::new("libcuda.so.1") }.context("load libcuda.so.1")?;
    let cu = Cuda { lib };
    let init: fns::PFN_cuInit = cu.sym("cuInit")?;
    let count_fn: fns::PFN_cuDeviceGetCount = cu.sym("cuDeviceGetCount")?;
    let retain: fns::PFN_cuDevicePrimaryCtxRetain = cu.sym("cuDevicePrimaryCtxRetain")?;
    let set_current: fns::PFN_cuCtxSetCurrent = cu.sym("cuCtxSetCurrent")?;
    let alloc: fns::PFN_cuMemAlloc_v2 = cu.sym("cuMemAlloc_v2")?;
    let stream_create: fns::PFN_cuStreamCreate = cu.sym("cuStreamCreate")?;
    let stream_sync: fns::PFN_cuStreamSynchronize = cu.sym("cuStreamSynchronize")?;
    let event_create: fns::PFN_cuEventCreate = cu.sym("cuEventCreate")?;
    let record: fns::PFN_cuEventRecord = cu.sym("cuEventRecord")?;
    let elapsed: fns::PFN_cuEventElapsedTime = cu.sym("cuEventElapsedTime")?;
    let peer: fns::PFN_cuMemcpyPeerAsync = cu.sym("cuMemcpyPeerAsync")?;
    let dtod: fns::PFN_cuMemcpyDtoDAsync_v2 = cu.sym("cuMemcpyDtoDAsync_v2")?;
    let host_fn: fns::PFN_cuLaunchHostFunc = cu.sym("cuLaunchHostFunc")?;

    let bytes = mib << 20;
    let mut steps = Vec::new();
    // SAFETY: every call passes pointers to live locals, or handles and device pointers
    // this driver returned, as the entry point's C signature (`vgpu_cuda_abi::fns`)
    // requires; `gate` is a `CUhostFn` that only reads an atomic.
    unsafe {
        ok("cuInit", init(0))?;
        let mut n: c_int = 0;
        ok("cuDeviceGetCount", count_fn(&mut n))?;
        let n = usize::try_from(n)?;
        if n < 2 {
            bail!("{n} visible GPUs make no ring");
        }
        let chunk = bytes / n;
        let mut ctx: Vec<CUcontext> = Vec::new();
        let mut buf: Vec<CUdeviceptr> = Vec::new();
        let mut scratch: Vec<CUdeviceptr> = Vec::new();
        let mut streams: Vec<CUstream> = Vec::new();
        let mut ev: Vec<(CUevent, CUevent)> = Vec::new();
        for d in 0..n {
            let mut c: CUcontext = std::ptr::null_mut();
            ok(
                "cuDevicePrimaryCtxRetain",
                retain(&mut c, c_int::try_from(d)?),
            )?;
            ok("cuCtxSetCurrent", set_current(c))?;
            let (mut p, mut q) = (0, 0);
            ok("cuMemAlloc_v2", alloc(&mut p, bytes))?;
            ok("cuMemAlloc_v2", alloc(&mut q, 8192))?;
            let mut s: CUstream = std::ptr::null_mut();
            ok("cuStreamCreate", stream_create(&mut s, 1))?;
            let (mut e0, mut e1): (CUevent, CUevent) = (std::ptr::null_mut(), std::ptr::null_mut());
            ok("cuEventCreate", event_create(&mut e0, 0))?;
            ok("cuEventCreate", event_create(&mut e1, 0))?;
            ctx.push(c);
            buf.push(p);
            scratch.push(q);
            streams.push(s);
            ev.push((e0, e1));
        }
        for _ in 0..rounds {
            GATE_OPEN.store(false, Ordering::Release);
            for (i, &s) in streams.iter().enumerate() {
                let j = (i + 1) % n;
                ok("cuCtxSetCurrent", set_current(ctx[i]))?;
                // Held at the gate until every stream's round is queued; then a small
                // copy brings the stream's clock to the gate's opening, so that the
                // events see the peer copies only, back to back.
                ok(
                    "cuLaunchHostFunc",
                    host_fn(s, Some(gate), std::ptr::null_mut()),
                )?;
                ok(
                    "cuMemcpyDtoDAsync_v2",
                    dtod(scratch[i] + 4096, scratch[i], 4096, s),
                )?;
                ok("cuEventRecord", record(ev[i].0, s))?;
                for r in 0..reps {
                    let off = ((r * chunk) % (bytes - chunk + 1)) as CUdeviceptr;
                    ok(
                        "cuMemcpyPeerAsync",
                        peer(buf[j] + off, ctx[j], buf[i] + off, ctx[i], chunk, s),
                    )?;
                }
                ok("cuEventRecord", record(ev[i].1, s))?;
            }
            GATE_OPEN.store(true, Ordering::Release);
            let mut worst = 0f64;
            for (&s, &(e0, e1)) in streams.iter().zip(&ev) {
                ok("cuStreamSynchronize", stream_sync(s))?;
                let mut ms = 0f32;
                ok("cuEventElapsedTime", elapsed(&mut ms, e0, e1))?;
                worst = worst.max(f64::from(ms) / reps as f64);
            }
            steps.push(worst);
        }
    }
    println!("step_ms={}", median(&mut steps));
    Ok(())
}
