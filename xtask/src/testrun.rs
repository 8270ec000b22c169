//! Test commands that report every failure and count what ran: each step's output is shown
//! as it comes and scanned for failed tests, failed test targets and the harness's totals,
//! so that `cargo xtask ci` runs every step and ends with one line `N passed, N failed, N
//! skipped` and one list of everything that failed or skipped (and a non-zero exit on a
//! failure). Tests run under cargo-nextest where it is installed (one process per test,
//! both CPUs busy, a hung test killed: `.config/nextest.toml`), else under `cargo test`.
//! `busy` runs the tests that measure time or shares with the CPUs saturated.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};

use anyhow::{Context, Result};

/// Failures collected over a run, one line each, naming the step.
#[derive(Debug, Default)]
pub struct Failures {
    items: Vec<String>,
}

impl Failures {
    /// Records a failed step that named no test (a build error, a linter).
    pub fn step(&mut self, step: &str, why: String) {
        self.items.push(format!("{step}: {why}"));
    }

    /// Whether nothing failed.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// The summary printed at the end of a run.
    pub fn summary(&self) -> String {
        let mut s = format!("xtask: {} failure(s):\n", self.items.len());
        for i in &self.items {
            s.push_str("  ");
            s.push_str(i);
            s.push('\n');
        }
        s
    }
}

/// What the test harnesses said they ran, summed over every test command of a run.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Counts {
    /// Tests the harness reported passed (a test that recorded a skip is among them).
    pub passed: u64,
    /// Tests that failed, timed out or crashed.
    pub failed: u64,
    /// `#[ignore]`d tests (a GPU, a cluster, or a helper process another test starts).
    pub ignored: u64,
    /// Tests pytest skipped (none is written to skip; each one is listed as a skip).
    pub pytest_skipped: u64,
}

impl Counts {
    fn add(&mut self, o: Counts) {
        self.passed += o.passed;
        self.failed += o.failed;
        self.ignored += o.ignored;
        self.pytest_skipped += o.pytest_skipped;
    }
}

/// The number before `word` in `text` ("12 passed; 0 failed" → 12 for "passed").
fn count_before(text: &str, word: &str) -> u64 {
    let toks: Vec<&str> = text
        .split(|c: char| c == ',' || c == ';' || c.is_whitespace())
        .filter(|t| !t.is_empty())
        .collect();
    toks.windows(2)
        .filter(|w| w[1] == word)
        .filter_map(|w| w[0].parse::<u64>().ok())
        .sum()
}

/// Whether `t` is pytest's closing line: "3 passed, 1 skipped in 2.50s" (`-q`), framed by
/// `=` without it.
fn pytest_totals(t: &str) -> Option<&str> {
    let t = t.trim_matches(|c: char| c == '=' || c.is_whitespace());
    let (totals, time) = t.rsplit_once(" in ")?;
    let timed = time.starts_with(|c: char| c.is_ascii_digit()) && time.contains('s');
    let words = ["passed", "failed", "skipped", "error", "errors"];
    let known = totals.split(", ").all(|p| {
        let mut w = p.split_whitespace();
        w.next().is_some_and(|n| n.parse::<u64>().is_ok())
            && w.next().is_some_and(|x| {
                words.contains(&x)
                    || x == "deselected"
                    || x == "xfailed"
                    || x == "xpassed"
                    || x == "warnings"
                    || x == "warning"
            })
    });
    (timed && known).then_some(totals)
}

/// The totals in a test command's output: libtest's `test result:` lines (one per test
/// binary), nextest's `Summary` line or pytest's closing line.
pub fn counts_in(output: &str) -> Counts {
    let mut c = Counts::default();
    // nextest echoes a failed test's captured output, libtest's `test result:` line
    // included: where nextest's Summary is there, it alone counts.
    let mut summary: Option<Counts> = None;
    for line in output.lines() {
        let t = line.trim();
        if let Some(rest) = pytest_totals(t) {
            c.add(Counts {
                passed: count_before(rest, "passed"),
                failed: count_before(rest, "failed")
                    + count_before(rest, "error")
                    + count_before(rest, "errors"),
                ignored: 0,
                pytest_skipped: count_before(rest, "skipped"),
            });
        } else if let Some(rest) = t.strip_prefix("test result: ") {
            c.add(Counts {
                passed: count_before(rest, "passed"),
                failed: count_before(rest, "failed"),
                ignored: count_before(rest, "ignored"),
                pytest_skipped: 0,
            });
        } else if t.starts_with("Summary [")
            && let Some((_, rest)) = t.split_once("tests run:")
        {
            // "… 99 passed, 1 failed, 1 timed out, 3 skipped". nextest's "skipped" are
            // the #[ignore]d tests and those the step's filter left to another step: not
            // counted here (`ignored_tests` counts the former once for the whole run).
            let timed_out = rest
                .split(',')
                .filter(|p| p.trim().ends_with("timed out"))
                .filter_map(|p| p.split_whitespace().next()?.parse::<u64>().ok())
                .sum::<u64>();
            summary.get_or_insert_with(Counts::default).add(Counts {
                passed: count_before(rest, "passed"),
                failed: count_before(rest, "failed") + timed_out,
                ignored: 0,
                pytest_skipped: 0,
            });
        }
    }
    summary.unwrap_or(c)
}

/// nextest's status words for a test that did not pass.
const NEXTEST_FAILED: &[&str] = &[
    "FAIL",
    "TIMEOUT",
    "SIGSEGV",
    "SIGABRT",
    "SIGKILL",
    "SIGBUS",
    "ABORT",
    "LEAK-FAIL",
];

/// What failed according to a test command's output (stdout and stderr interleaved): each
/// failed test as `target: name`, and each target cargo reports failed that no failed
/// test line accounts for (a crash, a timeout, a build error).
pub fn failed_in(output: &str) -> Vec<String> {
    let mut out = Vec::new();
    // nextest echoes a failed test's captured output, libtest's own "test … FAILED" line
    // included: where nextest named failures, those lines are not counted again.
    let mut nextest = Vec::new();
    let mut seen = BTreeSet::new();
    let mut target = String::from("?");
    let mut failed_targets = Vec::new();
    let mut in_target_list = false;
    for line in output.lines() {
        let t = line.trim();
        if let Some(rest) = t.strip_prefix("Running ") {
            // "Running tests/scheduling.rs (target/release/deps/scheduling-…)"
            target = rest.split(" (").next().unwrap_or(rest).to_owned();
            in_target_list = false;
        } else if let Some(rest) = t.strip_prefix("Doc-tests ") {
            target = format!("doc-tests {rest}");
            in_target_list = false;
        } else if let Some(name) = t
            .strip_prefix("test ")
            .and_then(|r| r.strip_suffix(" ... FAILED"))
        {
            out.push(format!("{target}: {name}"));
        } else if let Some(name) = nextest_failure(t) {
            // nextest names each failure twice (as it happens and in the final list).
            if seen.insert(name.clone()) {
                nextest.push(name);
            }
        } else if t.starts_with("error:") && t.contains("target") && t.ends_with("failed:") {
            in_target_list = true;
        } else if in_target_list && t.starts_with('`') {
            failed_targets.push(t.trim_matches('`').to_owned());
        } else if let Some(rest) = t.strip_prefix("error: test failed, to rerun pass ") {
            failed_targets.push(rest.trim_matches('`').to_owned());
        } else {
            in_target_list = false;
        }
    }
    if !nextest.is_empty() {
        out = nextest;
    }
    let tests = out.len();
    for ft in failed_targets {
        if tests == 0 {
            out.push(format!("target failed without a failed test line: {ft}"));
        }
    }
    out
}

/// `binary-id test` of a nextest status line `FAIL [   1.234s] (1/9) binary-id test`.
fn nextest_failure(t: &str) -> Option<String> {
    let (word, rest) = t.split_once(" [")?;
    if !NEXTEST_FAILED.contains(&word) {
        return None;
    }
    let (_, after) = rest.split_once("] ")?;
    let after = after.trim();
    // An optional "(n/m) " counter.
    let after = match after.strip_prefix('(') {
        Some(r) => r.split_once(") ").map_or(after, |(_, x)| x),
        None => after,
    };
    let mut parts = after.split_whitespace();
    let (bin, test) = (parts.next()?, parts.next()?);
    Some(format!("{bin}: {test}"))
}

/// Runs a test command, echoing its output; every failure goes into `f` (prefixed with
/// `step`), the totals into `counts`. Never stops the run: the caller goes on with the
/// next step.
pub fn run_tests(
    step: &str,
    mut cmd: Command,
    f: &mut Failures,
    counts: &mut Counts,
) -> Result<()> {
    eprintln!("xtask: running {cmd:?}");
    let (reader, writer) = std::io::pipe().context("pipe")?;
    cmd.stdout(writer.try_clone().context("pipe")?)
        .stderr(writer);
    let mut child = cmd.spawn().with_context(|| format!("start {cmd:?}"))?;
    // Our copies of the writer go with `cmd`: the reads end when the child's do.
    drop(cmd);
    let mut all = String::new();
    let mut stdout = std::io::stdout();
    for line in BufReader::new(reader).lines() {
        let line = line.unwrap_or_default();
        let _ = writeln!(stdout, "{line}");
        all.push_str(&line);
        all.push('\n');
    }
    let status = child.wait().context("wait for the tests")?;
    counts.add(counts_in(&all));
    if !status.success() {
        let failed = failed_in(&all);
        if failed.is_empty() {
            f.step(step, format!("failed with {status}"));
        }
        for x in failed {
            f.step(step, x);
        }
    }
    Ok(())
}

/// The number of `#[ignore]`d tests of the workspace (nextest's listing of them, one per
/// line): what a whole run leaves out.
pub fn ignored_tests(cargo: &mut Command) -> Result<u64> {
    let out = cargo
        .args([
            "nextest",
            "list",
            "--release",
            "--workspace",
            "--run-ignored",
            "only",
            "-T",
            "oneline",
        ])
        .args(crate::TEST_TARGETS)
        .stderr(Stdio::inherit())
        .output()
        .context("cargo nextest list")?;
    if !out.status.success() {
        anyhow::bail!(
            "cargo nextest list --run-ignored only failed ({})",
            out.status
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.trim().contains(' '))
        .count() as u64)
}

/// Whether cargo-nextest runs here.
pub fn have_nextest(cargo: &mut Command) -> bool {
    cargo
        .args(["nextest", "--version"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// The run's closing line and the list of skips: `passed` is what the harnesses passed
/// less the tests that recorded a skip (they return early and "pass").
pub fn closing(counts: Counts, skip_log: &Path) -> (String, Vec<String>) {
    let text = std::fs::read_to_string(skip_log).unwrap_or_default();
    let (skipped, mut list) = match vgpu_test_needs::parse_log(&text) {
        Ok(s) => {
            let tests: BTreeSet<&str> = s.iter().map(|k| k.test.as_str()).collect();
            let list = s
                .iter()
                .map(|k| format!("{}: needs {}: {}", k.test, k.need, k.why))
                .collect::<Vec<_>>();
            (tests.len() as u64, list)
        }
        Err(e) => (0, vec![format!("the skip log is unreadable: {e}")]),
    };
    list.dedup();
    if counts.pytest_skipped > 0 {
        list.push(format!(
            "{} Python client test(s) skipped by pytest (its output above names them)",
            counts.pytest_skipped
        ));
    }
    let skipped = skipped + counts.pytest_skipped;
    let line = format!(
        "xtask: tests: {} passed, {} failed, {} skipped ({} ignored: #[ignore], a GPU, a cluster or a helper process another test starts)",
        counts
            .passed
            .saturating_sub(skipped - counts.pytest_skipped),
        counts.failed,
        skipped,
        counts.ignored
    );
    (line, list)
}

/// CPU hogs (`sh -c 'while :; do :; done'`, normal priority), one more than there are
/// CPUs; killed (by their PIDs) when dropped.
pub struct Hogs {
    children: Vec<Child>,
}

impl Hogs {
    /// Starts them.
    pub fn start() -> Result<Hogs> {
        let n = std::thread::available_parallelism().map_or(2, |n| n.get()) + 1;
        let mut children = Vec::new();
        for _ in 0..n {
            children.push(
                Command::new("sh")
                    .args(["-c", "while :; do :; done"])
                    .stdin(Stdio::null())
                    .spawn()
                    .context("start a CPU hog (sh)")?,
            );
        }
        eprintln!("xtask: {n} CPU hogs running");
        Ok(Hogs { children })
    }
}

impl Drop for Hogs {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failed_tests_are_named_with_their_target_and_crashes_too() {
        let out = "\
     Running tests/api.rs (target/release/deps/api-1)
test a ... ok
     Running tests/scheduling.rs (target/release/deps/scheduling-2)
test a_live_share_change_takes_effect ... FAILED
test b ... ok
test a_tenant_of_several_processes_shares_as_one ... FAILED
error: test failed, to rerun pass `-p vgpu-daemon --test scheduling`
     Running tests/shim.rs (target/release/deps/shim-3)
test x ... FAILED
error: 2 targets failed:
    `-p vgpu-daemon --test scheduling`
    `-p vgpu-tests --test shim`
";
        assert_eq!(
            failed_in(out),
            vec![
                "tests/scheduling.rs: a_live_share_change_takes_effect",
                "tests/scheduling.rs: a_tenant_of_several_processes_shares_as_one",
                "tests/shim.rs: x",
            ]
        );
        let crash = "     Running tests/shim.rs (x)\nerror: test failed, to rerun pass `-p vgpu-tests --test shim`\n";
        assert_eq!(
            failed_in(crash),
            vec!["target failed without a failed test line: -p vgpu-tests --test shim"]
        );
        assert!(failed_in("test a ... ok\n").is_empty());
    }

    #[test]
    fn nextest_failures_are_named_once_each() {
        let out = "\
        PASS [   0.010s] ( 1/40) vgpu-core packing::tests::a
        FAIL [   2.500s] ( 2/40) vgpu-daemon::scheduling a_live_share_change_takes_effect
  stdout ───

    running 1 test
    test a_live_share_change_takes_effect ... FAILED

    test result: FAILED. 0 passed; 1 failed; 0 ignored; 0 measured; 9 filtered out; finished in 2.49s

     TIMEOUT [ 300.001s] ( 3/40) vgpu-tests::shim hangs
     SIGSEGV [   0.100s] vgpu-tests::shim_exit crashes
------------
     Summary [ 400.000s] 40 tests run: 37 passed, 2 failed, 1 timed out, 5 skipped
        FAIL [   2.500s] ( 2/40) vgpu-daemon::scheduling a_live_share_change_takes_effect
     TIMEOUT [ 300.001s] ( 3/40) vgpu-tests::shim hangs
     SIGSEGV [   0.100s] vgpu-tests::shim_exit crashes
error: test run failed
";
        assert_eq!(
            failed_in(out),
            vec![
                "vgpu-daemon::scheduling: a_live_share_change_takes_effect",
                "vgpu-tests::shim: hangs",
                "vgpu-tests::shim_exit: crashes",
            ]
        );
        assert_eq!(
            counts_in(out),
            Counts {
                passed: 37,
                failed: 3,
                // nextest's "skipped" mixes #[ignore] and filtered-out tests: not counted.
                ignored: 0,
                pytest_skipped: 0
            }
        );
    }

    #[test]
    fn libtest_totals_are_summed_over_binaries() {
        let out = "\
test result: ok. 12 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out; finished in 0.01s
test result: FAILED. 3 passed; 2 failed; 0 ignored; 0 measured; 0 filtered out; finished in 1.00s
";
        assert_eq!(
            counts_in(out),
            Counts {
                passed: 15,
                failed: 2,
                ignored: 1,
                pytest_skipped: 0
            }
        );
    }

    #[test]
    fn pytest_totals_are_read() {
        let out = "tests/python/test_a.py ..s.F\n1 failed, 3 passed, 1 skipped in 2.50s\n";
        assert_eq!(
            counts_in(out),
            Counts {
                passed: 3,
                failed: 1,
                ignored: 0,
                pytest_skipped: 1
            }
        );
        assert_eq!(counts_in("==== 12 passed in 0.40s ====\n").passed, 12);
        // Prose with " in " is not a total.
        assert_eq!(
            counts_in("5 tests passed in the first round\n"),
            Counts::default()
        );
    }

    #[test]
    fn the_closing_line_takes_skips_out_of_the_passes() {
        let dir = tempfile::tempdir().expect("temp dir");
        let log = dir.path().join("skips");
        std::fs::write(
            &log,
            "a::t\tthe program tmux\tnot found\na::t\tthe program promtool\tnot found\nb\troot\tuid 1000\n",
        )
        .expect("write");
        let (line, list) = closing(
            Counts {
                passed: 10,
                failed: 1,
                ignored: 2,
                pytest_skipped: 0,
            },
            &log,
        );
        assert!(
            line.starts_with("xtask: tests: 8 passed, 1 failed, 2 skipped (2 ignored"),
            "{line}"
        );
        assert_eq!(list.len(), 3, "{list:?}");
        assert!(list[2].contains("b: needs root: uid 1000"), "{list:?}");
        let (line, list) = closing(Counts::default(), &dir.path().join("none"));
        assert!(line.contains("0 passed, 0 failed, 0 skipped"), "{line}");
        assert!(list.is_empty());
    }

    #[test]
    fn the_summary_lists_every_failure() {
        let mut f = Failures::default();
        assert!(f.is_empty());
        f.step("clippy", "failed with exit status: 101".into());
        f.step("tests", "tests/shim.rs: x".into());
        let s = f.summary();
        assert!(s.starts_with("xtask: 2 failure(s)"), "{s}");
        assert!(
            s.contains("clippy: failed") && s.contains("tests: tests/shim.rs: x"),
            "{s}"
        );
    }
}
