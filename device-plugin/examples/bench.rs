//! The device plugin's benchmark: `Allocate` and `PreStartContainer` latency under load,
//! on an in-process node (`vgpu-testkit`: fake kubelet over real unix-socket gRPC, fake
//! API server over HTTP). An example, so that only a dev-dependency brings the fakes
//! and the production binary has none:
//! `cargo run --release -p vgpu-device-plugin --example bench -- --pods 200`.
//! Pods are admitted one at a time as kubelet does, then every container's
//! `PreStartContainer` is sent at once, `--concurrency` at a time (kubelet's pod workers
//! run in parallel; 12 concurrent calls were seen on a real kubelet).

use std::time::{Duration, Instant};

use clap::Parser;
use vgpu_device_plugin::{audit, gc, metrics};
use vgpu_testkit::fake_kubelet::FakeKubelet;
use vgpu_testkit::node::{PodContainer, TestNode, fake_containers, gpus, pod_json};

/// Benchmark options.
#[derive(Parser, Debug, Clone)]
#[command(about = "Measure Allocate and PreStartContainer latency on an in-process fake node")]
struct BenchArgs {
    /// Pods to start.
    #[arg(long, default_value_t = 200)]
    pods: u32,
    /// GPUs on the node (each takes 10 slices).
    #[arg(long, default_value_t = 8)]
    gpus: u32,
    /// Concurrent PreStartContainer calls.
    #[arg(long, default_value_t = 12)]
    concurrency: usize,
    /// Extra latency of each PodResources List, ms (a real kubelet: 2.3 median, 68 worst).
    #[arg(long, default_value_t = 2.3)]
    list_delay_ms: f64,
    /// Seconds of steady state (everything registered and idle) to measure CPU and memory.
    #[arg(long, default_value_t = 5)]
    idle_s: u64,
    /// NVML library for the audit of GPU processes during the steady state (e.g.
    /// cuda-sim's `libnvidia-ml.so.1`; none: no audit). The audit and the allocation
    /// clean-up then run every second, ten and sixty times as often as by default.
    #[arg(long)]
    nvml_lib: Option<std::path::PathBuf>,
}

/// CPU time of this process so far (user + system), from `/proc/self/stat` (USER_HZ 100).
fn cpu_time() -> Option<Duration> {
    let s = std::fs::read_to_string("/proc/self/stat").ok()?;
    let rest = s.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    Some(Duration::from_millis(ticks * 10))
}

/// Resident memory of this process, MiB, from `/proc/self/status`.
fn rss_mib() -> Option<f64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

fn pct(v: &mut [Duration], p: f64) -> Duration {
    if v.is_empty() {
        return Duration::ZERO;
    }
    v.sort();
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i.min(v.len() - 1)]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    run(BenchArgs::parse()).await
}

/// Runs the benchmark and prints its figures.
async fn run(args: BenchArgs) -> anyhow::Result<()> {
    let node = TestNode::start(gpus(args.gpus, 81920)).await?;
    node.kubelet
        .set_list_delay(Duration::from_secs_f64(args.list_delay_ms / 1e3));
    let g = gpus(args.gpus, 81920);
    let mut used = vec![0u32; g.len()];
    let mut client = node.client.clone();
    let mut alloc = Vec::new();
    let mut pref = Vec::new();
    let mut all_ids = Vec::new();
    for i in 0..args.pods {
        let slices = 1 + (i % 3);
        let Some(gi) = used.iter().position(|u| u + slices <= 10) else {
            break;
        };
        used[gi] += slices;
        let grants = vec![(
            g[gi].uuid.clone(),
            81920 * u64::from(slices) / 10,
            slices * 100,
            slices,
        )];
        let containers: Vec<PodContainer<'_>> = vec![("main", false, grants)];
        let name = format!("p{i}");
        node.put_pod(pod_json(
            "bench",
            &name,
            &format!("uid-{i}"),
            i,
            &containers,
        ))
        .await?;
        let adm = node
            .kubelet
            .admit(&mut client, "bench", &name, &fake_containers(&containers))
            .await?;
        for (p, a) in &adm.timings {
            pref.extend(*p);
            alloc.push(*a);
        }
        for (_, _, ids, _) in adm.containers {
            all_ids.push(ids);
        }
    }
    let sem = std::sync::Arc::new(tokio::sync::Semaphore::new(args.concurrency.max(1)));
    let lists_before = node.kubelet.list_stats().1;
    let t_all = Instant::now();
    let mut tasks = Vec::new();
    for ids in all_ids.clone() {
        let mut c = node.client.clone();
        let sem = sem.clone();
        tasks.push(tokio::spawn(async move {
            let _permit = sem.acquire_owned().await;
            let t = Instant::now();
            let r = FakeKubelet::prestart(&mut c, &ids).await;
            (t.elapsed(), r.is_ok())
        }));
    }
    let mut pre = Vec::new();
    let mut failed = 0;
    for t in tasks {
        let (d, ok) = t.await?;
        pre.push(d);
        if !ok {
            failed += 1;
        }
    }
    let wall = t_all.elapsed();
    let (max_conc, lists) = node.kubelet.list_stats();
    println!(
        "vgpu-device-plugin bench: {} containers on {} GPUs, List delay {} ms",
        all_ids.len(),
        args.gpus,
        args.list_delay_ms
    );
    println!(
        "GetPreferredAllocation: p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
        ms(pct(&mut pref, 0.5)),
        ms(pct(&mut pref, 0.99)),
        ms(pct(&mut pref, 1.0))
    );
    println!(
        "Allocate: p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
        ms(pct(&mut alloc, 0.5)),
        ms(pct(&mut alloc, 0.99)),
        ms(pct(&mut alloc, 1.0))
    );
    println!(
        "PreStartContainer ({} concurrent): p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms; {} failed; all done in {:.1} ms",
        args.concurrency,
        ms(pct(&mut pre, 0.5)),
        ms(pct(&mut pre, 0.99)),
        ms(pct(&mut pre, 1.0)),
        failed,
        ms(wall)
    );
    println!(
        "PodResources List calls during PreStartContainer: {} for {} containers; most concurrent List calls seen: {max_conc} (kubelet's limit: 10)",
        lists - lists_before,
        all_ids.len()
    );
    let mut upkeep = Vec::new();
    if let Some(lib) = &args.nvml_lib {
        let every = Duration::from_secs(1);
        let metrics = metrics::Metrics::new(node.gpus.subscribe());
        let rx = audit::spawn(node.cfg.clone(), Some(lib.clone()), every)?;
        upkeep.push(tokio::spawn(audit::report(
            node.handshake.clone(),
            rx,
            metrics.audit.clone(),
        )));
        let m = metrics.clone();
        upkeep.push(tokio::spawn(gc::run(
            node.handshake.clone(),
            every,
            move |r| m.gc_round(r),
        )));
        println!(
            "steady state includes the GPU process audit ({}) and the allocation clean-up, every 1 s",
            lib.display()
        );
    }
    if args.idle_s > 0 {
        let c0 = cpu_time();
        let t0 = Instant::now();
        tokio::time::sleep(Duration::from_secs(args.idle_s)).await;
        if let (Some(c0), Some(c1)) = (c0, cpu_time()) {
            println!(
                "steady state over {:.1} s (plugin + fake kubelet + fake API server in one process): {:.2} % of one core, RSS {:.1} MiB",
                t0.elapsed().as_secs_f64(),
                100.0 * (c1 - c0).as_secs_f64() / t0.elapsed().as_secs_f64(),
                rss_mib().unwrap_or(f64::NAN)
            );
        }
    }
    for t in upkeep {
        t.abort();
    }
    if failed > 0 {
        anyhow::bail!("{failed} PreStartContainer calls failed");
    }
    Ok(())
}
