//! Measuring the host-side cost of driver calls: the loop behind `sim-bench`, reusable by
//! the shim's overhead benchmarks.
//!
//! Machines here are shared and noisy, so a figure means something only as a difference
//! or ratio against a baseline measured in the same run (see the benchmarks brief). The
//! simulator's own per-call cost, measured by `sim-bench` with this module, is that
//! baseline for the shim: a shim benchmark measures the same calls through the shim and
//! through the bare simulator with the same loop, interleaved ([`Samples`] makes that
//! easy: alternate `a.run(..)` and `b.run(..)` in rounds), and reports the difference.
//!
//! Method:
//! - a warm-up of 10 % of the iterations (at least 100 calls) resolves symbols, fills
//!   caches and lets lazily created state (worker threads, tables) come up;
//! - then each sample times `batch` consecutive calls with [`Instant`] (the vDSO
//!   `clock_gettime`, about 20 ns on these VMs) and records the time per call. With
//!   `batch` = 1 every call is its own sample, so the p99 is the p99 of single calls,
//!   and each sample includes one clock read: [`timer_overhead`] measures that, so
//!   absolute figures of calls costing a few nanoseconds can be read against it.
//!   Differences between two figures measured the same way are unaffected;
//! - median and p99 are nearest-rank percentiles of the samples; the mean is the total
//!   time over the total calls.
//!
//! Nothing here asserts a timing; the figures are printed for people and for later runs
//! to compare.

use std::fmt::Write as _;
use std::hint::black_box;
use std::time::Instant;

/// The spin kernel every benchmark and probe launches, as PTX text (NUL-terminated for
/// `cuModuleLoadData`). `vgpu_sim_spin(u64 ns)` keeps one thread busy until the GPU's
/// global timer has advanced `ns` nanoseconds. The simulator does not run the body: it
/// charges `ns` of device time for the entry by its name. On a real GPU the body runs, so
/// the same probe saturates a real GPU for the same device time (the timer keeps running
/// while another context holds the GPU: a kernel time-sliced out mid-way finishes early in
/// work, not late in time).
pub const SPIN_PTX: &std::ffi::CStr = c".version 8.0
.target sm_90
.address_size 64

.visible .entry vgpu_sim_spin(.param .u64 vgpu_sim_spin_param_0)
{
    .reg .pred %p<2>;
    .reg .b64 %rd<5>;

    ld.param.u64 %rd1, [vgpu_sim_spin_param_0];
    mov.u64 %rd2, %globaltimer;
    add.s64 %rd3, %rd2, %rd1;
$L_spin:
    mov.u64 %rd4, %globaltimer;
    setp.lt.u64 %p1, %rd4, %rd3;
    @%p1 bra $L_spin;
    ret;
}
";

/// Per-call figures of one measured operation, in nanoseconds.
#[derive(Debug, Clone, PartialEq)]
pub struct Stats {
    /// What was measured (e.g. `cuCtxGetCurrent`).
    pub name: String,
    /// Calls timed (warm-up excluded).
    pub iters: u64,
    /// Calls per sample.
    pub batch: u32,
    /// Median time per call.
    pub median_ns: f64,
    /// 99th percentile time per call (of samples of `batch` calls).
    pub p99_ns: f64,
    /// Mean time per call.
    pub mean_ns: f64,
    /// Fastest sample, per call.
    pub min_ns: f64,
    /// Slowest sample, per call.
    pub max_ns: f64,
}

impl Stats {
    /// The figures as one JSON object (no trailing newline).
    pub fn to_json(&self) -> String {
        format!(
            "{{\"name\":{},\"iters\":{},\"batch\":{},\"median_ns\":{:.1},\"p99_ns\":{:.1},\"mean_ns\":{:.1},\"min_ns\":{:.1},\"max_ns\":{:.1}}}",
            json_string(&self.name),
            self.iters,
            self.batch,
            self.median_ns,
            self.p99_ns,
            self.mean_ns,
            self.min_ns,
            self.max_ns
        )
    }
}

/// A JSON string literal for `s`.
pub fn json_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// Timed samples of one operation, collected in one or several runs (so that two
/// operations can be measured interleaved, round by round).
#[derive(Debug, Clone)]
pub struct Samples {
    name: String,
    batch: u32,
    /// Nanoseconds per sample (a sample is `batch` calls).
    ns: Vec<u64>,
}

impl Samples {
    /// No samples yet; each sample will time `batch` calls (at least 1).
    pub fn new(name: &str, batch: u32) -> Samples {
        Samples {
            name: name.to_owned(),
            batch: batch.max(1),
            ns: Vec::new(),
        }
    }

    /// Times `samples` samples of `batch` calls of `f` each (no warm-up: see [`warm_up`]).
    pub fn run(&mut self, samples: u64, mut f: impl FnMut()) {
        self.ns.reserve(usize::try_from(samples).unwrap_or(0));
        for _ in 0..samples {
            let t = Instant::now();
            for _ in 0..self.batch {
                f();
            }
            let el = t.elapsed();
            self.ns
                .push(u64::try_from(el.as_nanos()).unwrap_or(u64::MAX));
        }
    }

    /// The samples so far, in the order they were taken (nanoseconds per sample).
    pub fn ns(&self) -> &[u64] {
        &self.ns
    }

    /// The samples so far as per-call figures; `None` before the first sample.
    pub fn stats(&self) -> Option<Stats> {
        summarize(&self.name, self.batch, &self.ns)
    }
}

/// Calls `f` `n` times, untimed.
pub fn warm_up(n: u64, mut f: impl FnMut()) {
    for _ in 0..n {
        f();
    }
}

/// Warms up, then times `iters` calls of `f`, each call its own sample.
pub fn measure(name: &str, iters: u64, f: impl FnMut()) -> Stats {
    measure_batched(name, iters, 1, f)
}

/// Warms up (10 % of `iters`, at least 100 calls), then times `iters` calls of `f` in
/// samples of `batch` calls (`iters` is rounded up to whole samples).
pub fn measure_batched(name: &str, iters: u64, batch: u32, mut f: impl FnMut()) -> Stats {
    warm_up((iters / 10).max(100), &mut f);
    let mut s = Samples::new(name, batch);
    s.run(iters.max(1).div_ceil(u64::from(s.batch)), f);
    s.stats().expect("at least one sample was taken")
}

/// The cost of the timing itself: an empty call measured as [`measure_batched`] does
/// (the clock reads, spread over `batch` calls).
pub fn timer_overhead(iters: u64, batch: u32) -> Stats {
    measure_batched("(timer: empty call)", iters, batch, || black_box(()))
}

/// Per-call figures from samples of `batch` calls each (nanoseconds per sample).
pub fn summarize(name: &str, batch: u32, samples_ns: &[u64]) -> Option<Stats> {
    if samples_ns.is_empty() {
        return None;
    }
    let batch = batch.max(1);
    let mut sorted = samples_ns.to_vec();
    sorted.sort_unstable();
    let per_call = |ns: u64| ns as f64 / f64::from(batch);
    let total: u128 = sorted.iter().map(|&n| u128::from(n)).sum();
    let calls = sorted.len() as u64 * u64::from(batch);
    Some(Stats {
        name: name.to_owned(),
        iters: calls,
        batch,
        median_ns: per_call(percentile(&sorted, 50.0)),
        p99_ns: per_call(percentile(&sorted, 99.0)),
        mean_ns: total as f64 / calls as f64,
        min_ns: per_call(sorted[0]),
        max_ns: per_call(sorted[sorted.len() - 1]),
    })
}

/// Nearest-rank percentile `p` (0–100) of sorted, non-empty `v`.
fn percentile(v: &[u64], p: f64) -> u64 {
    let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
    v[rank.clamp(1, v.len()) - 1]
}

/// A table of results, one line per operation, with a header.
pub fn table(results: &[Stats]) -> String {
    let w = results
        .iter()
        .map(|s| s.name.len())
        .max()
        .unwrap_or(4)
        .max(4);
    let mut out = format!(
        "{:<w$}  {:>9}  {:>11}  {:>11}  {:>11}\n",
        "call", "iters", "median ns", "p99 ns", "mean ns"
    );
    for s in results {
        let _ = writeln!(
            out,
            "{:<w$}  {:>9}  {:>11.1}  {:>11.1}  {:>11.1}",
            s.name, s.iters, s.median_ns, s.p99_ns, s.mean_ns
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<u64> = (1..=100).collect();
        assert_eq!(percentile(&v, 50.0), 50);
        assert_eq!(percentile(&v, 99.0), 99);
        assert_eq!(percentile(&v, 100.0), 100);
        assert_eq!(percentile(&v, 0.0), 1);
        assert_eq!(percentile(&[7], 99.0), 7);
    }

    #[test]
    fn summarize_reports_per_call_figures() {
        // Samples of 4 calls each: 40, 80, 400 ns → 10, 20, 100 ns per call.
        let s = summarize("x", 4, &[400, 40, 80]).expect("samples");
        assert_eq!(s.iters, 12);
        assert_eq!(s.median_ns, 20.0);
        assert_eq!(s.p99_ns, 100.0);
        assert_eq!(s.min_ns, 10.0);
        assert_eq!(s.max_ns, 100.0);
        assert!((s.mean_ns - 520.0 / 12.0).abs() < 1e-9);
        assert_eq!(summarize("x", 1, &[]), None);
    }

    #[test]
    fn measure_calls_the_function_warm_up_plus_iters_times() {
        let mut calls = 0u64;
        let s = measure_batched("count", 1001, 8, || calls += 1);
        // 100 warm-up calls, then 1001 rounded up to 126 samples of 8.
        assert_eq!(calls, 100 + 126 * 8);
        assert_eq!(s.iters, 126 * 8);
        assert!(s.min_ns <= s.median_ns && s.median_ns <= s.p99_ns && s.p99_ns <= s.max_ns);
    }

    #[test]
    fn interleaved_runs_accumulate() {
        let mut a = Samples::new("a", 1);
        let mut b = Samples::new("b", 2);
        for _ in 0..3 {
            a.run(5, || {});
            b.run(5, || {});
        }
        assert_eq!(a.stats().expect("a").iters, 15);
        assert_eq!(b.stats().expect("b").iters, 30);
        assert!(Samples::new("c", 0).stats().is_none());
    }

    #[test]
    fn json_is_escaped() {
        assert_eq!(json_string("a\"b\\c\n"), "\"a\\\"b\\\\c\\u000a\"");
        let s = summarize("cuInit", 1, &[5]).expect("sample");
        assert_eq!(
            s.to_json(),
            "{\"name\":\"cuInit\",\"iters\":1,\"batch\":1,\"median_ns\":5.0,\"p99_ns\":5.0,\"mean_ns\":5.0,\"min_ns\":5.0,\"max_ns\":5.0}"
        );
    }
}
