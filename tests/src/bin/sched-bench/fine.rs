//! `sched-bench --only fine`: fine sharing (ADR 0023), 100 tenants of 1 % on one
//! simulated GPU, beside 1 × 100 % and 10 × 10 % in the same run, all through the daemon.
//!
//! Each tenant is a real process under the shim with its own container directory, its
//! own memory quota (`VGPU_MEMORY_LIMIT`, 64 MiB plus twice its index, so that no two
//! are alike) and an allocation of 2 × (its index + 1) MiB: it prints what `cuMemGetInfo` and
//! NVML tell it, and the scenario checks that every tenant saw its own quota as the
//! device's total and its own allocation as used. Shares are the simulator's device time
//! per process over the window (the benchmark's ground truth); the figures are the worst
//! error in percentage points of GPU time, Jain's fairness index over the tenants, and the
//! GPU's busy fraction of the window (what the daemon's hand-offs between tenants cost,
//! against one tenant alone and ten tenants, measured in the same run).

use std::process::Child;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use super::{Bench, Report, kill_all, now_ms};

/// Kernel length: 1 ms, as in the 10 × 10 % fairness scenario.
const KERNEL_NS: u64 = 1_000_000;

/// One run's outcome for `n` tenants of `share` % each.
struct Outcome {
    /// Worst |achieved − configured| over the tenants, pp of GPU time.
    worst_pp: f64,
    /// Jain's fairness index of the tenants' device times.
    jain: f64,
    /// Device time of all tenants over the window ÷ the window.
    busy: f64,
    /// Smallest and largest achieved share, % of GPU time.
    range: (f64, f64),
    /// Tenants whose `cuMemGetInfo`/NVML did not show their own quota and allocation.
    memory_wrong: Vec<String>,
    /// From the common start until every tenant had run on the GPU, ms.
    all_running_ms: u64,
}

/// Jain's fairness index of `x`: 1 when all are equal, `1/n` when one has everything.
pub(super) fn jain_index(x: &[f64]) -> f64 {
    let sum: f64 = x.iter().sum();
    let sq: f64 = x.iter().map(|v| v * v).sum();
    if sq == 0.0 {
        return 0.0;
    }
    sum * sum / (x.len() as f64 * sq)
}

/// The value of `key=` in the probe's output, if printed.
fn field(out: &str, key: &str) -> Option<u64> {
    out.split_whitespace()
        .filter_map(|kv| kv.split_once('='))
        .find(|(k, _)| *k == key)
        .and_then(|(_, v)| v.parse().ok())
}

/// Starts `n` tenants of `share` % at once, measures the window, and checks what each
/// saw of its memory.
fn run(b: &Bench, n: usize, share: u32, startup: Duration, window: Duration) -> Result<Outcome> {
    let d = b.daemon(&format!("fine{n}"), &[])?;
    let at = now_ms() + startup.as_millis() as u64;
    // Long enough for a slow start; the tenants are stopped after the window.
    let secs = (startup + window).as_secs() + 40;
    let mut children: Vec<Child> = Vec::with_capacity(n);
    let mut quotas = Vec::with_capacity(n);
    for i in 0..n {
        let dir = b
            .root
            .path()
            .join("containers")
            .join(format!("fine{n}-{i}"));
        std::fs::create_dir_all(&dir)?;
        // Distinct quotas and allocations (2 MiB steps: the allocation granularity).
        let quota_mib = 64 + 2 * i as u64;
        let alloc = (i as u64 + 1) << 21;
        let mut c = b.probe();
        c.env("LD_PRELOAD", b.bin_dir.join("libvgpu.so"))
            .env("VGPU_CONTAINER_DIR", &dir)
            .env("VGPU_COMPUTE_SHARE", share.to_string())
            .env("VGPU_MEMORY_LIMIT", format!("{quota_mib}Mi"))
            .env("VGPU_DAEMON_SOCKET", &d.socket)
            .args([
                "init",
                "alloc",
                &alloc.to_string(),
                "meminfo",
                "nvml",
                "load",
            ])
            .args([secs.to_string(), KERNEL_NS.to_string(), at.to_string()])
            .arg("1");
        match c.spawn() {
            Ok(ch) => children.push(ch),
            Err(e) => {
                kill_all(children);
                return Err(e).context("start cuda-probe");
            }
        }
        quotas.push((quota_mib << 20, alloc));
    }
    let pids: Vec<u32> = children.iter().map(Child::id).collect();
    // On a busy node 100 processes take seconds to start: the window opens one round
    // (a second) after every tenant has run on the GPU, not at a fixed time.
    let st = b.state()?;
    let deadline = Instant::now() + startup + Duration::from_secs(30);
    let running = loop {
        let seen = b.busy(&st);
        if pids.iter().all(|p| seen.get(p).is_some_and(|&ns| ns > 0)) {
            break true;
        }
        if Instant::now() > deadline {
            break false;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let all_running_ms = now_ms().saturating_sub(at);
    if !running {
        kill_all(children);
        bail!("not every one of {n} tenants ran on the GPU within 30 s of the start");
    }
    std::thread::sleep(Duration::from_secs(1));
    let t0 = Instant::now();
    let b0 = b.busy(&st);
    std::thread::sleep(window);
    let b1 = b.busy(&st);
    let elapsed = t0.elapsed().as_secs_f64();
    let busy: Vec<f64> = pids
        .iter()
        .map(|p| (b1.get(p).copied().unwrap_or(0) - b0.get(p).copied().unwrap_or(0)) as f64)
        .collect();
    for c in &mut children {
        let _ = c.kill();
    }
    let mut memory_wrong = Vec::new();
    for (i, (ch, (quota, alloc))) in children.into_iter().zip(quotas).enumerate() {
        let out = ch.wait_with_output()?;
        let text = String::from_utf8_lossy(&out.stdout);
        let seen = (
            field(&text, "total"),
            field(&text, "free"),
            field(&text, "nvml_total"),
            field(&text, "nvml_used"),
        );
        // Its own quota as the device's total, both ways; its own allocation as used.
        let own = seen.0 == Some(quota)
            && seen.2 == Some(quota)
            && seen
                .3
                .is_some_and(|u| u == alloc && seen.1 == Some(quota - u));
        if !own {
            memory_wrong.push(format!(
                "tenant {i} (quota {quota}, allocated {alloc}): {}",
                text.trim()
            ));
        }
    }
    drop(d);
    let total: f64 = busy.iter().sum();
    let pct: Vec<f64> = busy.iter().map(|v| v * 100.0 / total.max(1.0)).collect();
    let want = f64::from(share) * 100.0 / (f64::from(share) * n as f64);
    Ok(Outcome {
        worst_pp: pct.iter().map(|p| (p - want).abs()).fold(0.0, f64::max),
        jain: jain_index(&busy),
        busy: total / 1e9 / elapsed,
        range: (
            pct.iter().copied().fold(f64::INFINITY, f64::min),
            pct.iter().copied().fold(0.0, f64::max),
        ),
        memory_wrong,
        all_running_ms,
    })
}

/// The scenario: 1 × 100 %, 10 × 10 % and 100 × 1 % on one GPU, then the figures.
pub(super) fn fine(b: &Bench, r: &mut Report) -> Result<()> {
    // A round of 100 tenants is 100 quanta (1 s); five rounds keep one quantum's
    // rounding at 0.2 pp of GPU time while the scenario stays well under a minute.
    let window = b.window.min(Duration::from_secs(5));
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    r.say(format!(
        "fine sharing (ADR 0023; 1 ms kernels, burst, {} s windows; load average before: {}):",
        window.as_secs(),
        load.split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    ));
    let mut busy = Vec::new();
    for (n, share, startup) in [(1, 100, 1000), (10, 10, 1500), (100, 1, 3000)] {
        let o = run(b, n, share, Duration::from_millis(startup), window)?;
        r.say(format!(
            "  {n} × {share} %: all running {:.1} s after the start; achieved {:.2}–{:.2} % of GPU time; worst error {:.2} pp; Jain's fairness {:.4}; GPU busy {:.1} % of the window; own memory seen by {}/{n}",
            o.all_running_ms as f64 / 1000.0,
            o.range.0,
            o.range.1,
            o.worst_pp,
            o.jain,
            o.busy * 100.0,
            n - o.memory_wrong.len()
        ));
        for w in o.memory_wrong.iter().take(3) {
            r.say(format!("    memory not its own: {w}"));
        }
        if !o.memory_wrong.is_empty() {
            bail!(
                "{} of {n} tenants did not see their own memory quota and allocation",
                o.memory_wrong.len()
            );
        }
        busy.push(o.busy);
    }
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    r.say(format!(
        "  hand-off cost at 100 tenants: GPU busy {:.1} % vs {:.1} % with 1 tenant ({:+.1} pp) and {:.1} % with 10 ({:+.1} pp); load average after: {}",
        busy[2] * 100.0,
        busy[0] * 100.0,
        (busy[2] - busy[0]) * 100.0,
        busy[1] * 100.0,
        (busy[2] - busy[1]) * 100.0,
        load.split_whitespace().take(3).collect::<Vec<_>>().join(" ")
    ));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jain_is_one_for_equal_shares_and_one_over_n_for_one_hog() {
        assert!((jain_index(&[3.0; 100]) - 1.0).abs() < 1e-12);
        let mut x = vec![0.0; 100];
        x[7] = 5.0;
        assert!((jain_index(&x) - 0.01).abs() < 1e-12);
    }

    #[test]
    fn fields_are_read_by_key() {
        let out = "free=10 total=20\nnvml_used=5 nvml_total=20 nvml_free=15 procs=1:5";
        assert_eq!(field(out, "total"), Some(20));
        assert_eq!(field(out, "nvml_total"), Some(20));
        assert_eq!(field(out, "used"), None);
    }
}
