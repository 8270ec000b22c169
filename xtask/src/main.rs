//! `cargo xtask <task>`: build tasks that are more than one cargo command.
//!
//! - `sim`: build the simulated driver (release) into `target/cuda-sim/` as
//!   `libcuda.so.1`, `libcuda.so`, `libnvidia-ml.so.1` and `libnvidia-ml.so`.
//! - `ci`: what CI checks, in order: the prerequisites (Debian packages installed as root,
//!   the Python clients in `target/venv`, tracefs mounted), formatting, one build of
//!   everything (tests included), clippy, the simulator, every test but the timing
//!   tests (Rust, under cargo-nextest, and the third-party Python clients), docs, then
//!   `busy`, which runs the timing tests: each test runs once. Every step runs even when one before failed; the run ends with each
//!   step's time, the line `N passed, N failed, N skipped`, the list of skipped tests with
//!   their reasons (`vgpu-test-needs`) and of every failed step and test, and fails if
//!   there is one.
//! - `busy`: the tests that measure time or shares (real processes on the simulated
//!   GPU), run with one CPU hog more than there are CPUs alongside: they must pass on
//!   a saturated machine (issue 16).
//! - `demo`: the main demo: `vgpu-daemon` on a simulated node, four tenants under the
//!   shim with different compute shares, policies and memory quotas, their achieved
//!   shares measured by the simulator and by the daemon; see `docs/demo.md`.
//! - `hostile`: the adversarial suite alone (`HOSTILE_TESTS`: what a hostile tenant
//!   tries, each a real-process test; `ci` runs them with every other test).
//! - `layout`: structure counts (import cycles among a crate's files, files over 800
//!   lines, primitives defined in more than one file).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

mod cluster;
mod demo;
mod images;
mod layout;
mod prereq;
mod testrun;

use std::time::{Duration, Instant};

use testrun::{Counts, Failures, Hogs, run_tests};

/// Tests picked by name for `busy` and `hostile`, as nextest filtersets (`kind(test)`:
/// integration tests only).
#[derive(Clone, Copy, Debug)]
enum Sel {
    /// A file of a consolidated crate: a module of its `integration` binary (ADR 0045);
    /// module names are unique across the workspace.
    Module(&'static str),
    /// A test binary of its own, by nextest's binary id (`crate::name`).
    Binary(&'static str),
    /// One test, by its path in its binary (`module::test`).
    Test(&'static str),
}

impl Sel {
    fn filterset(self) -> String {
        match self {
            Sel::Module(m) => format!("(kind(test) & test(/^{m}::/))"),
            Sel::Binary(b) => format!("(kind(test) & binary_id({b}))"),
            Sel::Test(t) => format!("(kind(test) & test(={t}))"),
        }
    }
}

/// The targets `ci` builds and tests: every library, binary and test, not the examples
/// (the device plugin's `bench` example alone took 300 s to build at opt-level 3 on a
/// busy 2-core machine, and no test runs it). Clippy checks every target, examples
/// included, so an example that no longer compiles still fails `ci` (ADR 0064).
const TEST_TARGETS: &[&str] = &["--lib", "--bins", "--tests"];

/// The tests that measure time or shares: what `busy` runs (every test that asserts a
/// share, a latency or a deadline with real processes): `vgpu-daemon`'s scheduling,
/// metrics, peers, hand_on and claims; `vgpu-tests`' cuda_sim, shim, shim_exit,
/// shim_hostile_region and ebpf_daemon; `vgpu-ebpf`'s gate; `vgpu-device-plugin`'s
/// kubelet.
const TIMING_TESTS: &[Sel] = &[
    Sel::Module("scheduling"),
    Sel::Module("metrics"),
    Sel::Module("peers"),
    Sel::Module("hand_on"),
    Sel::Module("claims"),
    Sel::Module("cuda_sim"),
    Sel::Module("shim"),
    Sel::Module("shim_exit"),
    Sel::Module("shim_hostile_region"),
    Sel::Module("ebpf_daemon"),
    Sel::Binary("vgpu-ebpf::gate"),
    Sel::Module("kubelet"),
];

/// The adversarial suite (issue 39): each attack a tenant can make on its quota or on the
/// node, as real processes. docs/testing.md lists what each one tries.
const HOSTILE_TESTS: &[Sel] = &[
    Sel::Module("hostile_quota"),
    Sel::Module("shim_hostile_region"),
    Sel::Module("flood"),
    Sel::Module("second_line"),
    Sel::Module("ebpf_fail_closed"),
    Sel::Test("registration::the_memory_quota_shown_is_the_files_never_the_one_the_tenant_wrote"),
    Sel::Test("registration::what_hellos_naming_made_up_gpus_leave_behind_is_bounded"),
    Sel::Test("registration::connections_per_tenant_are_capped_and_a_refusal_keeps_nothing"),
    Sel::Test(
        "peers::a_frozen_daemon_holds_launches_for_a_bounded_time_then_the_shim_falls_back_and_says_so",
    ),
];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace root")
        .to_owned()
}

fn run(cmd: &mut Command) -> Result<()> {
    eprintln!("xtask: running {cmd:?}");
    let status = cmd.status().with_context(|| format!("start {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed with {status}");
    }
    Ok(())
}

fn cargo() -> Command {
    let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    c.current_dir(root());
    // What `cargo run` sets for xtask itself: build scripts that watch these (ring's
    // `rerun-if-env-changed=CARGO_PKG_NAME`, …) would see other values than in a plain
    // `cargo` run and rebuild ring and all that depends on it at every switch.
    for (k, _) in std::env::vars_os() {
        let k = k.to_string_lossy();
        if k.starts_with("CARGO_PKG_")
            || [
                "CARGO_MANIFEST_DIR",
                "CARGO_MANIFEST_PATH",
                "CARGO_MANIFEST_LINKS",
                "CARGO_CRATE_NAME",
                "CARGO_BIN_NAME",
                "CARGO_PRIMARY_PACKAGE",
            ]
            .contains(&k.as_ref())
        {
            c.env_remove(k.as_ref());
        }
    }
    c
}

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("target"))
}

/// Builds the simulated libraries and installs them under their driver names.
fn sim() -> Result<PathBuf> {
    run(cargo().args([
        "build",
        "--release",
        "-p",
        "vgpu-sim-libcuda",
        "-p",
        "vgpu-sim-libnvml",
        "-p",
        "vgpu-cuda-sim",
    ]))?;
    install_sim()
}

/// Installs the built simulated libraries (`target/release`) under their driver names in
/// `target/cuda-sim/`.
fn install_sim() -> Result<PathBuf> {
    let rel = target_dir().join("release");
    let out = target_dir().join("cuda-sim");
    std::fs::create_dir_all(&out).with_context(|| format!("create {}", out.display()))?;
    // The versioned name is the file; the unversioned one is a symlink to it, as NVIDIA's
    // driver installs them, so that a program that loads both names (cudarc tries
    // `libcuda.so` first) maps one library, not two copies with separate state.
    for (built, versioned, plain) in [
        ("libcuda.so", "libcuda.so.1", "libcuda.so"),
        ("libnvidia_ml.so", "libnvidia-ml.so.1", "libnvidia-ml.so"),
    ] {
        let src = rel.join(built);
        let dst = out.join(versioned);
        // Copy to a temporary name and rename, so that a running process that has the
        // old library mapped keeps a consistent file.
        let tmp = out.join(format!(".{versioned}.tmp"));
        std::fs::copy(&src, &tmp)
            .with_context(|| format!("copy {} to {}", src.display(), tmp.display()))?;
        std::fs::rename(&tmp, &dst).with_context(|| format!("install {}", dst.display()))?;
        let link = out.join(plain);
        let tmp_link = out.join(format!(".{plain}.tmp"));
        let _ = std::fs::remove_file(&tmp_link);
        std::os::unix::fs::symlink(versioned, &tmp_link)
            .with_context(|| format!("link {}", tmp_link.display()))?;
        std::fs::rename(&tmp_link, &link).with_context(|| format!("install {}", link.display()))?;
    }
    eprintln!("xtask: simulated driver installed in {}", out.display());
    Ok(out)
}

/// Runs a non-test step; a failure is recorded and the run goes on.
fn step(f: &mut Failures, name: &str, cmd: &mut Command) {
    if let Err(e) = run(cmd) {
        f.step(name, format!("{e:#}"));
    }
}

/// One `ci` or `busy` run: its failures, the harnesses' totals and each step's time.
struct Run {
    f: Failures,
    counts: Counts,
    times: Vec<(String, Duration)>,
    /// The virtual environment's `bin` (Python clients), first on the tests' `PATH`.
    venv_bin: Option<PathBuf>,
    skip_log: PathBuf,
    nextest: bool,
}

impl Run {
    fn new() -> Result<Run> {
        let dir = target_dir().join("xtask");
        std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
        let skip_log = dir.join("skips.log");
        // A fresh log per run: only this run's skips are listed.
        std::fs::write(&skip_log, "").with_context(|| format!("write {}", skip_log.display()))?;
        Ok(Run {
            f: Failures::default(),
            counts: Counts::default(),
            times: Vec::new(),
            venv_bin: None,
            skip_log,
            nextest: false,
        })
    }

    /// Runs `body` as step `name`, timed.
    fn timed(&mut self, name: &str, body: impl FnOnce(&mut Run) -> Result<()>) -> Result<()> {
        eprintln!("xtask: == {name}");
        let t0 = Instant::now();
        let r = body(self);
        let took = t0.elapsed();
        eprintln!("xtask: == {name}: {:.0} s", took.as_secs_f64());
        self.times.push((name.to_owned(), took));
        r
    }

    /// The environment every test command gets: the skip log, the Python clients first on
    /// `PATH`.
    fn test_env(&self, c: &mut Command) {
        c.env(vgpu_test_needs::LOG_VAR, &self.skip_log);
        if let Some(bin) = &self.venv_bin {
            let path = std::env::var_os("PATH").unwrap_or_default();
            let mut dirs = vec![bin.clone()];
            dirs.extend(std::env::split_paths(&path));
            if let Ok(joined) = std::env::join_paths(dirs) {
                c.env("PATH", joined);
            }
        }
    }

    /// The test command over the whole workspace (`only`: just these tests). Under
    /// nextest only: each test its own process (a few tests set their process's
    /// environment, and the integration tests of a crate are one binary, ADR 0045);
    /// without it the step fails, saying how to install it.
    fn tests(&self, only: &[Sel]) -> Command {
        self.nextest_run(only, false)
    }

    /// The test command over the whole workspace but `these`.
    fn tests_but(&self, these: &[Sel]) -> Command {
        self.nextest_run(these, true)
    }

    /// `cargo nextest run` over the workspace: only `sel`, or all but `sel` (`negate`).
    fn nextest_run(&self, sel: &[Sel], negate: bool) -> Command {
        if !self.nextest {
            let mut c = Command::new("sh");
            c.args([
                "-c",
                "echo 'cargo-nextest is needed (one process per test): cargo install --locked cargo-nextest' >&2; exit 1",
            ]);
            return c;
        }
        let mut c = cargo();
        c.args([
            "nextest",
            "run",
            "--release",
            "--workspace",
            "--no-fail-fast",
        ])
        .args(TEST_TARGETS);
        if !sel.is_empty() {
            let expr: Vec<String> = sel.iter().map(|s| s.filterset()).collect();
            let expr = expr.join(" | ");
            let expr = if negate {
                format!("not ({expr})")
            } else {
                expr
            };
            c.args(["-E", &expr]);
        }
        self.test_env(&mut c);
        c
    }

    fn finish(&self) -> Result<()> {
        eprintln!("xtask: step times:");
        let mut total = Duration::ZERO;
        for (name, took) in &self.times {
            eprintln!("xtask:   {name:<16} {:>6.0} s", took.as_secs_f64());
            total += *took;
        }
        eprintln!("xtask:   {:<16} {:>6.0} s", "all", total.as_secs_f64());
        let (line, skips) = testrun::closing(self.counts, &self.skip_log);
        if !skips.is_empty() {
            eprintln!("xtask: skipped ({}):", skips.len());
            for s in &skips {
                eprintln!("  {s}");
            }
        }
        if self.f.is_empty() {
            eprintln!("xtask: every step passed");
            eprintln!("{line}");
            return Ok(());
        }
        eprint!("{}", self.f.summary());
        eprintln!("{line}");
        bail!("some steps failed (listed above)")
    }
}

fn ci() -> Result<()> {
    let mut r = Run::new()?;
    r.timed("prerequisites", |r| {
        let mut problems = Vec::new();
        r.venv_bin = prereq::for_ci(&root(), &target_dir(), &mut problems);
        match prereq::nextest(cargo) {
            Ok(()) => r.nextest = true,
            Err(e) => problems.push(format!("{e:#}")),
        }
        for p in problems {
            // Under CI a missing prerequisite is a failure here too, not only in the tests
            // that need it.
            if vgpu_test_needs::in_ci() {
                r.f.step("prerequisites", p);
            } else {
                eprintln!("xtask: {p}: the tests that need it skip (listed at the end)");
            }
        }
        Ok(())
    })?;
    r.timed("fmt", |r| {
        step(
            &mut r.f,
            "fmt",
            cargo().args(["fmt", "--all", "--", "--check"]),
        );
        Ok(())
    })?;
    // One build of everything the later steps use, tests included: the test commands and
    // `busy` then build nothing (same profile, same features), and clippy and the docs
    // reuse its build scripts and procedural macros.
    r.timed("build", |r| {
        step(
            &mut r.f,
            "build",
            cargo()
                .args(["build", "--release", "--workspace"])
                .args(TEST_TARGETS),
        );
        Ok(())
    })?;
    r.timed("clippy", |r| {
        step(
            &mut r.f,
            "clippy",
            cargo().args([
                "clippy",
                "--release",
                "--workspace",
                "--all-targets",
                "--",
                "-D",
                "warnings",
            ]),
        );
        Ok(())
    })?;
    r.timed("sim", |r| {
        if let Err(e) = install_sim() {
            r.f.step("sim", format!("{e:#}"));
        }
        Ok(())
    })?;
    r.timed("tests", |r| {
        // Every test but the timing tests, which `busy` runs (once, on saturated CPUs).
        let tests = r.tests_but(TIMING_TESTS);
        run_tests("tests", tests, &mut r.f, &mut r.counts)
    })?;
    r.timed("python clients", |r| {
        let py = root().join("tests/python");
        let python = r
            .venv_bin
            .as_ref()
            .map_or_else(|| PathBuf::from("python3"), |b| b.join("python3"));
        let mut c = Command::new(python);
        c.args(["-m", "pytest", "-q", "-rs"])
            .arg(&py)
            .env("VGPU_SIM_PREBUILT", "1")
            .current_dir(root());
        r.test_env(&mut c);
        run_tests("python clients", c, &mut r.f, &mut r.counts)
    })?;
    r.timed("docs", |r| {
        step(
            &mut r.f,
            "docs",
            cargo()
                .args(["doc", "--release", "--workspace", "--no-deps"])
                .env("RUSTDOCFLAGS", "-D warnings"),
        );
        Ok(())
    })?;
    r.timed("busy", busy_tests)?;
    if r.nextest {
        match testrun::ignored_tests(&mut cargo()) {
            Ok(n) => r.counts.ignored = n,
            Err(e) => r.f.step("tests", format!("count the ignored tests: {e:#}")),
        }
    }
    r.finish()
}

/// A run of some tests alone (`busy`, `hostile`): the simulator built and installed,
/// nextest there.
fn tests_alone() -> Result<Run> {
    let mut r = Run::new()?;
    r.timed("sim", |r| {
        if let Err(e) = sim() {
            r.f.step("sim", format!("{e:#}"));
        }
        if let Err(e) = prereq::nextest(cargo) {
            r.f.step("prerequisites", format!("{e:#}"));
        } else {
            r.nextest = true;
        }
        Ok(())
    })?;
    Ok(r)
}

/// `busy`: the timing tests on saturated CPUs.
fn busy() -> Result<()> {
    let mut r = tests_alone()?;
    r.timed("busy", busy_tests)?;
    r.finish()
}

/// `hostile`: the adversarial suite, nothing else.
fn hostile() -> Result<()> {
    let mut r = tests_alone()?;
    r.timed("hostile", |r| {
        let tests = r.tests(HOSTILE_TESTS);
        run_tests("hostile", tests, &mut r.f, &mut r.counts)
    })?;
    r.finish()
}

/// Builds the timing tests (nothing after `ci`'s build step), then runs them with the hogs
/// alongside (the build is not slowed down by them).
fn busy_tests(r: &mut Run) -> Result<()> {
    let all = TIMING_TESTS;
    let mut build = cargo();
    build
        .args(["build", "--release", "--workspace"])
        .args(TEST_TARGETS);
    step(&mut r.f, "busy (build)", &mut build);
    let _hogs = Hogs::start()?;
    let tests = r.tests(all);
    run_tests("busy", tests, &mut r.f, &mut r.counts)
}

/// Builds the simulator, the daemon and `vgpuctl`, the shim, `cuda-probe` and `vgpu-smi`
/// (release), then runs the demo.
fn demo() -> Result<()> {
    prereq::ebpf_toolchain()?;
    let libs = sim()?;
    run(cargo().args([
        "build",
        "--release",
        "-p",
        "vgpu-daemon",
        "-p",
        "vgpu-shim",
        "-p",
        "vgpu-tests",
        "-p",
        "vgpu-smi",
        // The shim's `libvgpu.so` is its library target.
        "--lib",
        "--bin",
        "vgpu-daemon",
        "--bin",
        "vgpuctl",
        "--bin",
        "cuda-probe",
        "--bin",
        "vgpu-smi",
    ]))?;
    demo::demo(&libs, &target_dir().join("release"))
}

fn main() -> Result<()> {
    let task = std::env::args().nth(1).unwrap_or_default();
    match task.as_str() {
        "sim" => sim().map(|_| ()),
        "ci" => ci(),
        "busy" => busy(),
        "hostile" => hostile(),
        "demo" => demo(),
        "layout" => layout::layout(&root()),
        "images" => images::images(&root()),
        "cluster" => cluster::cluster(&root(), sim),
        "glibc-floor" => {
            let rest: Vec<String> = std::env::args().skip(2).collect();
            images::glibc_floor(&root(), &rest)
        }
        other => bail!(
            "unknown task {other:?}: expected `sim`, `ci`, `busy`, `hostile`, `demo`, `layout`, `images`, `cluster` or `glibc-floor`"
        ),
    }
}
