//! What a test needs of the machine, and the one way to say it is missing.
//!
//! Some tests need more than the default `cargo test` guarantees: root, the cgroup v1 `cpu`
//! controller, user/PID/time namespaces, a tmpfs mount, a Python module, a tool (clang,
//! promtool, tmux) or the kernel's eBPF. Where such a prerequisite is missing the test
//! calls [`skip`] and returns; that call
//!
//! - writes `SKIPPED <test>: needs <need>: <why>` to the process's stderr file descriptor
//!   directly, past libtest's output capture (nextest shows it with the test's output);
//! - appends one line to the run's skip log, the file named by `VGPU_SKIP_LOG` (set by
//!   `cargo xtask ci`), so that the run ends with `N passed, N failed, N skipped` and lists
//!   every skip with its reason;
//! - **fails the test instead** when `CI=true` and the need is one CI's machine provides
//!   (everything but a GPU): CI installs and mounts what the tests need, so a skip there
//!   is a broken CI machine, not a pass.
//!
//! The skip log's format has one writer ([`skip`]) and one reader ([`parse_log`]): a line
//! per skip, `<test>\t<need>\t<why>`, tabs and newlines in the fields replaced by spaces.
//!
//! A test also needs the workspace's binaries it runs to be built and current: [`bins`]
//! finds them for integration-test packages of their own and refuses a stale one.

use std::fmt;
use std::io::Write;

pub mod bins;
pub mod modules;

pub use modules::undeclared_test_files;

/// The environment variable naming the skip log.
pub const LOG_VAR: &str = "VGPU_SKIP_LOG";

/// A prerequisite of a test that a machine may lack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    /// Root (or the capabilities a test takes as root: mounts, cgroups, `mknod`).
    Root,
    /// The cgroup v1 `cpu` controller, writable (CPU-limited containers).
    CgroupV1Cpu,
    /// User and PID namespaces (`unshare --user --pid`).
    UserNamespaces,
    /// Time namespaces (`unshare --time`).
    TimeNamespaces,
    /// Mounting a file system (a small tmpfs).
    Mount,
    /// A Python module, in the `python3` the tests run.
    Python(&'static str),
    /// A program on `PATH` (clang, promtool, tmux, unshare).
    Tool(&'static str),
    /// eBPF in the kernel: BPF capabilities, BTF, tracefs, cgroup2.
    Ebpf,
    /// A real NVIDIA GPU: the only need CI's machine never has.
    Gpu,
}

impl Need {
    /// Whether CI's machine provides this need (`.ci/run` installs, mounts and runs as
    /// root): a skip of it under `CI=true` is a failure.
    pub fn ci_provides(self) -> bool {
        !matches!(self, Need::Gpu)
    }
}

impl fmt::Display for Need {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Need::Root => f.write_str("root"),
            Need::CgroupV1Cpu => f.write_str("the cgroup v1 cpu controller"),
            Need::UserNamespaces => f.write_str("user namespaces"),
            Need::TimeNamespaces => f.write_str("time namespaces"),
            Need::Mount => f.write_str("mounting a file system"),
            Need::Python(m) => write!(f, "the Python module {m}"),
            Need::Tool(t) => write!(f, "the program {t}"),
            Need::Ebpf => f.write_str("eBPF"),
            Need::Gpu => f.write_str("a GPU"),
        }
    }
}

/// Whether this run is CI's (`CI=true`, as CI systems set it; `1` too).
pub fn in_ci() -> bool {
    matches!(
        std::env::var("CI")
            .as_deref()
            .map(str::to_ascii_lowercase)
            .as_deref(),
        Ok("true" | "1")
    )
}

/// The running test's name: libtest runs each test on a thread named after it (under
/// `cargo test` and under nextest alike).
pub fn current_test() -> String {
    std::thread::current()
        .name()
        .filter(|n| *n != "main")
        .unwrap_or("(a test on the main thread)")
        .to_owned()
}

/// Says that the running test ([`current_test`]) does not run here because `need` is
/// missing (`why`: what was tried and what it answered). The caller returns right after.
/// Under CI ([`in_ci`]) a need CI provides makes this panic instead, failing the test.
pub fn skip(need: Need, why: &str) {
    let test = current_test();
    let test = test.as_str();
    if in_ci() && need.ci_provides() {
        panic!("{test}: needs {need}, which CI's machine provides, but: {why} (CI=true)");
    }
    let line = format!("SKIPPED {test}: needs {need}: {why}\n");
    // Straight to the descriptor: libtest's capture only takes `print!`/`eprint!`.
    let _ = std::io::stderr().write_all(line.as_bytes());
    if let Some(path) = std::env::var_os(LOG_VAR) {
        let record = format!(
            "{}\t{}\t{}\n",
            clean(test),
            clean(&need.to_string()),
            clean(why)
        );
        // One write of one short line in append mode: concurrent test processes' lines do
        // not interleave.
        let written = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .and_then(|mut f| f.write_all(record.as_bytes()));
        if let Err(e) = written {
            panic!(
                "{test}: skipped (needs {need}: {why}), and the skip could not be recorded in {}: {e}",
                std::path::Path::new(&path).display()
            );
        }
    }
}

/// A field of the log: no tab or newline.
fn clean(s: &str) -> String {
    s.replace(['\t', '\n', '\r'], " ")
}

/// One skip read back from the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Skipped {
    /// The test's name, as it gave it.
    pub test: String,
    /// What it needed, in words.
    pub need: String,
    /// Why the need is missing here.
    pub why: String,
}

/// Reads a skip log; a line that is not three tab-separated fields is an error naming it.
pub fn parse_log(text: &str) -> Result<Vec<Skipped>, String> {
    text.lines()
        .filter(|l| !l.is_empty())
        .enumerate()
        .map(|(i, l)| {
            let mut f = l.splitn(3, '\t');
            match (f.next(), f.next(), f.next()) {
                (Some(test), Some(need), Some(why)) => Ok(Skipped {
                    test: test.to_owned(),
                    need: need.to_owned(),
                    why: why.to_owned(),
                }),
                _ => Err(format!(
                    "skip log line {}: {l:?} is not <test>\\t<need>\\t<why>",
                    i + 1
                )),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_skip_is_logged_and_read_back() {
        let dir = std::env::temp_dir().join(format!("vgpu-needs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let log = dir.join("skips");
        let _ = std::fs::remove_file(&log);
        // The writer runs in a child with its own environment (setting variables in this
        // process would race the harness's other threads).
        let exe = std::env::current_exe().expect("test binary");
        let out = std::process::Command::new(exe)
            .args(["--exact", "tests::writer", "--ignored", "--nocapture"])
            .env(LOG_VAR, &log)
            .env_remove("CI")
            .output()
            .expect("run the writer");
        assert!(out.status.success(), "{out:?}");
        assert!(
            String::from_utf8_lossy(&out.stderr)
                .contains("SKIPPED tests::writer: needs the Python module pynvml: no module"),
            "{out:?}"
        );
        let text = std::fs::read_to_string(&log).expect("the log");
        assert_eq!(
            parse_log(&text).expect("parses"),
            vec![
                Skipped {
                    test: "tests::writer".into(),
                    need: "the Python module pynvml".into(),
                    why: "no module named pynvml".into()
                },
                Skipped {
                    test: "tests::writer".into(),
                    need: "root".into(),
                    why: "uid 1000 two lines".into()
                }
            ]
        );
        // Under CI the same skip fails the test.
        let out = std::process::Command::new(std::env::current_exe().expect("test binary"))
            .args(["--exact", "tests::writer", "--ignored"])
            .env(LOG_VAR, &log)
            .env("CI", "true")
            .output()
            .expect("run the writer");
        assert!(
            !out.status.success(),
            "a skip under CI=true passed: {out:?}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Not a test: the skipping test the one above runs in a child.
    #[test]
    #[ignore = "a helper process of a_skip_is_logged_and_read_back"]
    fn writer() {
        skip(Need::Python("pynvml"), "no module named pynvml");
        skip(Need::Root, "uid 1000\ttwo\nlines");
    }

    #[test]
    fn only_a_gpu_is_beyond_ci() {
        assert!(!Need::Gpu.ci_provides());
        for n in [
            Need::Root,
            Need::CgroupV1Cpu,
            Need::UserNamespaces,
            Need::TimeNamespaces,
            Need::Mount,
            Need::Python("x"),
            Need::Tool("tmux"),
            Need::Ebpf,
        ] {
            assert!(n.ci_provides(), "{n}");
        }
    }

    #[test]
    fn a_bad_log_line_is_named() {
        let e = parse_log("a\tb\tc\nbroken\n").expect_err("bad line");
        assert!(e.contains("line 2") && e.contains("broken"), "{e}");
    }
}
