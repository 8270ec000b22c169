//! Test commands that report every failure: each step's output is shown as it comes and
//! scanned for failed tests and failed test targets, so that `cargo xtask ci` runs every
//! step and ends with one list of everything that failed (and a non-zero exit).
//! `busy` runs the tests that measure time or shares with the CPUs saturated.

use std::io::{BufRead, BufReader, Write};
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

/// What failed according to `cargo test` output (stdout and stderr interleaved): each
/// failed test as `target: name`, and each target cargo reports failed that no failed
/// test line accounts for (a crash, a timeout, a build error).
pub fn failed_in(output: &str) -> Vec<String> {
    let mut out = Vec::new();
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
    let tests = out.len();
    for ft in failed_targets {
        if tests == 0 {
            out.push(format!("target failed without a failed test line: {ft}"));
        }
    }
    out
}

/// Runs a test command, echoing its output; every failure goes into `f` (prefixed with
/// `step`). Never stops the run: the caller goes on with the next step.
pub fn run_tests(step: &str, mut cmd: Command, f: &mut Failures) -> Result<()> {
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
    let status = child.wait().context("wait for cargo test")?;
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
