//! ebpf-bench: what the gate and the exit watcher cost, measured in one run (root):
//! open()+close() of a GPU node (registered and refused) and of a /dev/null clone, from a
//! process in a test cgroup, with the gate detached vs attached; then the exit-event latency
//! (kernel tracepoint → user-space reader) p50/p99 and the reader's CPU at a target rate of
//! process exits. Usage: `ebpf-bench [OPENS] [EXITS] [EXITS_PER_SECOND]`
//! (defaults 200000, 3000, 1000). Figures go to docs/specification.md.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use vgpu_ebpf::{EbpfConfig, Enforcer, EventKind, GpuDevice, Mode, preflight};

struct Probe {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    pid: u32,
}

impl Probe {
    fn spawn(binary: &Path) -> anyhow::Result<Self> {
        let mut child = Command::new(binary)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()?;
        let stdin = child.stdin.take().context("probe stdin")?;
        let mut stdout = BufReader::new(child.stdout.take().context("probe stdout")?);
        let mut line = String::new();
        stdout.read_line(&mut line)?;
        let pid = line
            .trim()
            .strip_prefix("ready ")
            .context("probe greeting")?
            .parse()?;
        Ok(Self {
            child,
            stdin,
            stdout,
            pid,
        })
    }

    fn ask(&mut self, command: &str) -> anyhow::Result<String> {
        writeln!(self.stdin, "{command}")?;
        let mut line = String::new();
        self.stdout.read_line(&mut line)?;
        Ok(line.trim().to_owned())
    }

    fn bench(&mut self, path: &Path, count: u32) -> anyhow::Result<f64> {
        let answer = self.ask(&format!("bench {} {count}", path.display()))?;
        let ns = answer
            .strip_prefix("ns ")
            .with_context(|| format!("probe said {answer:?}"))?;
        Ok(ns.parse()?)
    }
}

/// The probe binary, built next to this one.
fn probe_binary() -> anyhow::Result<PathBuf> {
    let me = std::env::current_exe()?;
    let probe = me.with_file_name("ebpf-probe");
    if !probe.exists() {
        bail!(
            "{} not found: cargo build --release -p vgpu-ebpf",
            probe.display()
        );
    }
    Ok(probe)
}

fn monotonic() -> Duration {
    let now = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    Duration::new(
        now.tv_sec.unsigned_abs(),
        now.tv_nsec.unsigned_abs().try_into().unwrap_or(0),
    )
}

/// CPU time of the calling thread, from /proc/thread-self/schedstat (first field, ns).
fn thread_cpu() -> Duration {
    let text = std::fs::read_to_string("/proc/thread-self/schedstat").unwrap_or_default();
    let ns = text
        .split_whitespace()
        .next()
        .and_then(|ns| ns.parse().ok())
        .unwrap_or(0);
    Duration::from_nanos(ns)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let index = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[index.min(sorted.len() - 1)]
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |index: usize, default: u32| -> anyhow::Result<u32> {
        args.get(index).map_or(Ok(default), |text| {
            text.parse()
                .with_context(|| format!("argument {} {text:?} is not a count", index + 1))
        })
    };
    let (opens, exits, rate) = (arg(0, 200_000)?, arg(1, 3_000)?, arg(2, 1_000)?);
    let mounts = std::fs::read_to_string("/proc/self/mounts")?;
    let cgroup2 = preflight::cgroup2_mount(&mounts).context("no cgroup2 mount")?;
    let cgroup = PathBuf::from(cgroup2).join(format!("vgpu-ebpf-bench-{}", std::process::id()));
    std::fs::create_dir(&cgroup).with_context(|| format!("create {}", cgroup.display()))?;
    let result = run(&cgroup, opens, exits, rate);
    let removed = std::fs::remove_dir(&cgroup);
    result?;
    removed.with_context(|| format!("remove {}", cgroup.display()))
}

fn run(cgroup: &Path, opens: u32, exits: u32, rate: u32) -> anyhow::Result<()> {
    let nodes = std::env::temp_dir().join(format!("vgpu-ebpf-bench-{}", std::process::id()));
    std::fs::create_dir_all(&nodes)?;
    for (name, major, minor) in [("nvidia0", "195", "0"), ("null", "1", "3")] {
        let path = nodes.join(name);
        let _ = std::fs::remove_file(&path);
        let status = Command::new("mknod")
            .arg(&path)
            .args(["c", major, minor])
            .status()?;
        if !status.success() {
            bail!("mknod {} failed", path.display());
        }
    }
    let gpu = nodes.join("nvidia0");
    let null = nodes.join("null");
    let binary = probe_binary()?;
    let config = EbpfConfig {
        mode: Mode::Enforce,
        cgroup_root: cgroup.to_owned(),
        pin_dir: None,
    };
    let devices = [GpuDevice {
        major: 195,
        minor: None,
    }];

    let mut probe = Probe::spawn(&binary)?;
    std::fs::write(cgroup.join("cgroup.procs"), probe.pid.to_string())?;
    let _ = probe.bench(&gpu, opens / 10)?; // warm up
    // Rounds alternate detached and attached so that drift on a busy machine hits both; the
    // minimum over rounds is the cost with the least interference.
    let rounds = 5;
    let per_round = (opens / rounds).max(1);
    let (mut detached_gpu, mut detached_null) = (f64::MAX, f64::MAX);
    let (mut allowed_gpu, mut attached_null, mut refused_gpu) = (f64::MAX, f64::MAX, f64::MAX);
    for _ in 0..rounds {
        detached_gpu = detached_gpu.min(probe.bench(&gpu, per_round)?);
        detached_null = detached_null.min(probe.bench(&null, per_round)?);
        let mut enforcer = Enforcer::attach(&config, &devices)?;
        enforcer.allow_tgid(probe.pid)?;
        allowed_gpu = allowed_gpu.min(probe.bench(&gpu, per_round)?);
        attached_null = attached_null.min(probe.bench(&null, per_round)?);
        enforcer.forget_tgid(probe.pid)?;
        // Nobody reads the gate events here: most of a burst overflows the ring buffer.
        refused_gpu = refused_gpu.min(probe.bench(&gpu, per_round / 10)?);
        enforcer.detach()?;
    }
    drop(probe.stdin);
    let _ = probe.child.wait();
    println!(
        "open()+close(), ns per call: minimum over {rounds} alternating rounds of {per_round} \
         calls (gate enforce)"
    );
    println!("  GPU node, detached              {detached_gpu:>8.0}");
    println!(
        "  GPU node, attached, registered  {allowed_gpu:>8.0}  ratio {:.2}  added {:+.0} ns",
        allowed_gpu / detached_gpu,
        allowed_gpu - detached_gpu
    );
    println!("  GPU node, attached, refused     {refused_gpu:>8.0}  (EPERM + one event each)");
    println!("  /dev/null clone, detached       {detached_null:>8.0}");
    println!(
        "  /dev/null clone, attached       {attached_null:>8.0}  ratio {:.2}  added {:+.0} ns",
        attached_null / detached_null,
        attached_null - detached_null
    );

    let mut enforcer = Enforcer::attach(&config, &devices)?;
    let mut events = enforcer.take_exit_events().context("exit event reader")?;
    // Exit events: children wait on stdin, are watched, then released at `rate` per second.
    let reader = std::thread::spawn(move || {
        let cpu_start = thread_cpu();
        let mut latencies = Vec::with_capacity(exits as usize);
        let deadline = Instant::now() + Duration::from_secs(60);
        while latencies.len() < exits as usize && Instant::now() < deadline {
            match events.next_timeout(Duration::from_millis(200)) {
                Ok(Some(event)) if event.kind == EventKind::Exit => {
                    latencies.push(monotonic().saturating_sub(event.time));
                }
                Ok(_) => {}
                Err(error) => {
                    eprintln!("reader: {error}");
                    break;
                }
            }
        }
        (latencies, thread_cpu().saturating_sub(cpu_start))
    });
    let period = Duration::from_secs(1) / rate.max(1);
    let batch = 200;
    let started = Instant::now();
    let mut released = 0u32;
    while released < exits {
        let mut children = Vec::new();
        for _ in 0..batch.min(exits - released) {
            let probe = Probe::spawn(&binary)?;
            enforcer.watch_tgid(probe.pid)?;
            children.push(probe);
        }
        let batch_start = Instant::now();
        for (index, probe) in children.iter_mut().enumerate() {
            let due = batch_start + period * u32::try_from(index)?;
            if let Some(wait) = due.checked_duration_since(Instant::now()) {
                std::thread::sleep(wait);
            }
            let _ = probe.stdin.write_all(b"exit\n");
            released += 1;
        }
        for mut probe in children {
            let _ = probe.child.wait();
        }
    }
    let elapsed = started.elapsed();
    let (mut latencies, reader_cpu) = reader
        .join()
        .map_err(|_| anyhow::anyhow!("reader thread panicked"))?;
    latencies.sort();
    let counters = enforcer.counters()?;
    enforcer.detach()?;
    let _ = std::fs::remove_dir_all(&nodes);
    println!(
        "exit events: {} of {exits} received (released at {rate}/s in batches of {batch}; \
         {} lost)",
        latencies.len(),
        counters.exit_lost
    );
    println!(
        "  latency tracepoint → reader: p50 {:?}  p99 {:?}  max {:?}",
        percentile(&latencies, 0.50),
        percentile(&latencies, 0.99),
        latencies.last().copied().unwrap_or_default()
    );
    let per_event = reader_cpu / u32::try_from(latencies.len().max(1))?;
    println!(
        "  reader thread CPU {reader_cpu:?} over {elapsed:?} ({per_event:?} per event: \
         {:.1} % of one core at {rate} exits/s)",
        per_event.as_secs_f64() * f64::from(rate) * 100.0
    );
    Ok(())
}
