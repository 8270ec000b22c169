//! `cargo xtask <task>`: build tasks that are more than one cargo command.
//!
//! - `sim`: build the simulated driver (release) into `target/cuda-sim/` as
//!   `libcuda.so.1`, `libcuda.so`, `libnvidia-ml.so.1` and `libnvidia-ml.so`.
//! - `ci`: what CI checks, in order: formatting, clippy, the simulator, every test
//!   (Rust and the third-party Python clients), docs, then `busy`. Every step runs
//!   even when one before failed (`cargo test --no-fail-fast`); the run ends with the
//!   list of every failed step and test, and fails if there is one.
//! - `busy`: the tests that measure time or shares (real processes on the simulated
//!   GPU), run with one CPU hog more than there are CPUs alongside: they must pass on
//!   a saturated machine (issue 16).
//! - `demo`: the main demo: `vgpu-daemon` on a simulated node, four tenants under the
//!   shim with different compute shares, policies and memory quotas, their achieved
//!   shares measured by the simulator and by the daemon; see `docs/demo.md`.
//! - `layout`: structure counts (import cycles among a crate's files, files over 800
//!   lines, primitives defined in more than one file).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

mod demo;
mod layout;
mod testrun;

use testrun::{Failures, Hogs, run_tests};

/// The test targets that measure time or shares, grouped by package (one run each; a
/// name is unique across the workspace): what `busy` runs (every test that asserts a
/// share, a latency or a deadline with real processes).
const TIMING_TESTS: &[(&str, &[&str])] = &[
    (
        "vgpu-daemon",
        &["scheduling", "metrics", "peers", "hand_on", "claims"],
    ),
    (
        "vgpu-tests",
        &[
            "cuda_sim",
            "shim",
            "shim_exit",
            "shim_hostile_region",
            "ebpf_daemon",
        ],
    ),
    ("vgpu-ebpf", &["gate"]),
    ("vgpu-device-plugin", &["kubelet"]),
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

fn ci() -> Result<()> {
    let mut f = Failures::default();
    step(
        &mut f,
        "fmt",
        cargo().args(["fmt", "--all", "--", "--check"]),
    );
    step(
        &mut f,
        "clippy",
        cargo().args([
            "clippy",
            "--workspace",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ]),
    );
    if let Err(e) = sim() {
        f.step("sim", format!("{e:#}"));
    }
    let mut tests = cargo();
    tests.args(["test", "--workspace", "--release", "--no-fail-fast"]);
    run_tests("tests", tests, &mut f)?;
    let py = root().join("tests/python");
    if py.is_dir() {
        step(
            &mut f,
            "python clients",
            Command::new("python3")
                .args(["-m", "pytest", "-q"])
                .arg(&py)
                .env("VGPU_SIM_PREBUILT", "1")
                .current_dir(root()),
        );
    }
    step(
        &mut f,
        "docs",
        cargo()
            .args(["doc", "--workspace", "--no-deps"])
            .env("RUSTDOCFLAGS", "-D warnings"),
    );
    busy_tests(&mut f)?;
    finish(&f)
}

/// `busy`: the timing tests on saturated CPUs.
fn busy() -> Result<()> {
    let mut f = Failures::default();
    if let Err(e) = sim() {
        f.step("sim", format!("{e:#}"));
    }
    busy_tests(&mut f)?;
    finish(&f)
}

/// Builds the timing tests, then runs them with the hogs alongside (the build is not
/// slowed down by them). Each test is named across the whole workspace (the names are
/// unique), not by its package: cargo then resolves features as for `cargo test
/// --workspace`, so after the `tests` step nothing is rebuilt (by package, a second
/// feature set rebuilt a third of the workspace and took its disk twice).
fn busy_tests(f: &mut Failures) -> Result<()> {
    let targets = |c: &mut Command, names: &[&str]| {
        c.args(["test", "--release", "--no-fail-fast", "--workspace"]);
        for n in names {
            c.args(["--test", n]);
        }
    };
    // The tests, and the programs they start: the daemon (a binary of the package of
    // `scheduling`), `cuda-probe` and `libvgpu.so` (of `vgpu-tests` and its dependencies).
    let all: Vec<&str> = TIMING_TESTS
        .iter()
        .flat_map(|(_, n)| n.iter().copied())
        .collect();
    let mut build = cargo();
    targets(&mut build, &all);
    step(f, "busy (build)", build.arg("--no-run"));
    let _hogs = Hogs::start()?;
    for (_, names) in TIMING_TESTS {
        let mut c = cargo();
        targets(&mut c, names);
        run_tests("busy", c, f)?;
    }
    Ok(())
}

fn finish(f: &Failures) -> Result<()> {
    if f.is_empty() {
        eprintln!("xtask: every step passed");
        return Ok(());
    }
    eprint!("{}", f.summary());
    bail!("some steps failed (listed above)")
}

/// Builds the simulator, the daemon and `vgpuctl`, the shim, `cuda-probe` and `vgpu-smi`
/// (release), then runs the demo.
fn demo() -> Result<()> {
    ebpf_toolchain()?;
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

/// The daemon links `ebpf/`, whose build compiles C for the bpf target: on a fresh Debian
/// machine the demo installs clang and the libbpf headers itself (as root), so that it
/// stays one command; elsewhere it says what to install.
fn ebpf_toolchain() -> Result<()> {
    let clang = std::env::var("CLANG").unwrap_or_else(|_| "clang".into());
    let have_clang = Command::new(&clang)
        .arg("--version")
        .stdout(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if have_clang && Path::new("/usr/include/bpf/bpf_helpers.h").exists() {
        return Ok(());
    }
    // Root: the effective uid in /proc/self/status.
    let root = std::fs::read_to_string("/proc/self/status").is_ok_and(|s| {
        s.lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .and_then(|l| l.split_whitespace().nth(1))
            == Some("0")
    });
    if !root || !Path::new("/usr/bin/apt-get").exists() {
        bail!(
            "building the node daemon needs clang and the libbpf headers (ebpf/): install them with `apt-get install clang libbpf-dev`"
        );
    }
    eprintln!("xtask: installing clang and libbpf-dev (the node daemon's eBPF programs are C)");
    run(Command::new("apt-get").args(["update", "-qq"]))?;
    run(Command::new("apt-get").args([
        "install",
        "-y",
        "-qq",
        "--no-install-recommends",
        "clang",
        "libbpf-dev",
    ]))
}

fn main() -> Result<()> {
    let task = std::env::args().nth(1).unwrap_or_default();
    match task.as_str() {
        "sim" => sim().map(|_| ()),
        "ci" => ci(),
        "busy" => busy(),
        "demo" => demo(),
        "layout" => layout::layout(&root()),
        other => bail!("unknown task {other:?}: expected `sim`, `ci`, `busy`, `demo` or `layout`"),
    }
}
