//! What the tasks need of the machine beyond the Rust toolchain, installed where xtask can
//! (Debian packages as root; Python packages in a virtual environment under `target/`, so
//! that PEP 668's "externally managed environment" cannot refuse them), and said by name
//! where it cannot: the tests that need a missing piece then skip visibly
//! (`vgpu-test-needs`) and the run lists them, or fail under `CI=true`.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};

/// A Debian package and how to tell it is there.
struct Deb {
    package: &'static str,
    /// What needs it, in words.
    for_what: &'static str,
    present: fn() -> bool,
}

/// Whether `program args…` runs and exits 0 (output discarded).
fn runs(program: &str, args: &[&str]) -> bool {
    Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn clang() -> String {
    std::env::var("CLANG").unwrap_or_else(|_| "clang".into())
}

/// The packages of the eBPF build (the daemon links `ebpf/`, whose build compiles C).
const EBPF_BUILD: &[Deb] = &[
    Deb {
        package: "clang",
        for_what: "building ebpf/ (the node daemon's eBPF programs)",
        present: || runs(&clang(), &["--version"]),
    },
    Deb {
        package: "libbpf-dev",
        for_what: "building ebpf/ (bpf_helpers.h)",
        present: || Path::new("/usr/include/bpf/bpf_helpers.h").exists(),
    },
];

/// The packages the tests use beyond the build.
const TEST_TOOLS: &[Deb] = &[
    Deb {
        package: "prometheus",
        for_what: "promtool checks of /metrics",
        present: || runs("promtool", &["--version"]),
    },
    Deb {
        package: "tmux",
        for_what: "driving `vgpuctl top` in a terminal",
        present: || runs("tmux", &["-V"]),
    },
    Deb {
        package: "util-linux",
        for_what: "unshare and setpriv (namespaces, dropped capabilities)",
        present: || runs("unshare", &["--version"]) && runs("setpriv", &["--version"]),
    },
    Deb {
        package: "python3-venv",
        for_what: "the Python clients' virtual environment",
        present: || runs("python3", &["-c", "import ensurepip, venv"]),
    },
];

/// Whether this process runs as root (the effective uid in /proc/self/status).
pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status").is_ok_and(|s| {
        s.lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .and_then(|l| l.split_whitespace().nth(1))
            == Some("0")
    })
}

/// Installs the missing packages of `debs` with apt-get as root on Debian; elsewhere an
/// error naming them and the command that would install them.
fn install(debs: &[&Deb]) -> Result<()> {
    if debs.is_empty() {
        return Ok(());
    }
    let names: Vec<&str> = debs.iter().map(|d| d.package).collect();
    if !is_root() || !Path::new("/usr/bin/apt-get").exists() {
        let why: Vec<String> = debs
            .iter()
            .map(|d| format!("{} ({})", d.package, d.for_what))
            .collect();
        bail!(
            "missing: {}; install them with `apt-get install {}` (xtask does it itself as root on Debian)",
            why.join(", "),
            names.join(" ")
        );
    }
    eprintln!("xtask: installing {}", names.join(" "));
    crate::run(Command::new("apt-get").args(["update", "-qq"]))?;
    crate::run(
        Command::new("apt-get")
            .args(["install", "-y", "-qq", "--no-install-recommends"])
            .args(&names)
            .env("DEBIAN_FRONTEND", "noninteractive"),
    )
}

fn missing(debs: &'static [Deb]) -> Vec<&'static Deb> {
    debs.iter().filter(|d| !(d.present)()).collect()
}

/// The eBPF build's packages (the demo needs only these).
pub fn ebpf_toolchain() -> Result<()> {
    install(&missing(EBPF_BUILD))
}

/// Everything `ci` needs: the eBPF build, the test tools, tracefs mounted (root), the
/// Python clients in `target/venv`. Returns the virtual environment's `bin` directory
/// when it is ready; every piece that could not be provided is an error in `problems`
/// (the run goes on: the tests that need it skip visibly, or fail under `CI=true`).
pub fn for_ci(root: &Path, target: &Path, problems: &mut Vec<String>) -> Option<PathBuf> {
    let mut debs = missing(EBPF_BUILD);
    debs.extend(missing(TEST_TOOLS));
    if let Err(e) = install(&debs) {
        problems.push(format!("{e:#}"));
    }
    if let Err(e) = tracefs() {
        problems.push(format!("{e:#}"));
    }
    match venv(root, target) {
        Ok(bin) => Some(bin),
        Err(e) => {
            problems.push(format!("{e:#}"));
            None
        }
    }
}

/// Mounts tracefs at `/sys/kernel/tracing` (the exit tracepoint's home) if it is not
/// mounted and this is root.
fn tracefs() -> Result<()> {
    let at = "/sys/kernel/tracing";
    if Path::new(at).join("events").is_dir() {
        return Ok(());
    }
    if !is_root() {
        bail!("tracefs is not mounted at {at} (eBPF exit events): mount it as root");
    }
    crate::run(Command::new("mount").args(["-t", "tracefs", "tracefs", at]))
}

/// `target/venv` with the packages of `tests/python/requirements.txt`, (re)made when the
/// file changed since it was last installed there; its `bin` directory.
fn venv(root: &Path, target: &Path) -> Result<PathBuf> {
    let reqs = root.join("tests/python/requirements.txt");
    let wanted =
        std::fs::read_to_string(&reqs).with_context(|| format!("read {}", reqs.display()))?;
    let dir = target.join("venv");
    let bin = dir.join("bin");
    let stamp = dir.join("installed-requirements.txt");
    if std::fs::read_to_string(&stamp).is_ok_and(|s| s == wanted) && bin.join("python3").exists() {
        return Ok(bin);
    }
    crate::run(Command::new("python3").args(["-m", "venv"]).arg(&dir))
        .context("make the Python clients' virtual environment")?;
    crate::run(
        Command::new(bin.join("python3"))
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
                "-r",
            ])
            .arg(&reqs),
    )
    .context("install the Python clients (tests/python/requirements.txt)")?;
    std::fs::write(&stamp, &wanted).with_context(|| format!("write {}", stamp.display()))?;
    Ok(bin)
}

/// cargo-nextest, the test runner `ci` and `busy` use (a process per test, hung tests
/// killed, no retries): installed with `cargo install --locked` where it is missing.
pub fn nextest(cargo: impl Fn() -> Command) -> Result<()> {
    if crate::testrun::have_nextest(&mut cargo()) {
        return Ok(());
    }
    eprintln!("xtask: installing cargo-nextest");
    crate::run(cargo().args(["install", "--locked", "cargo-nextest"]))
        .context("install cargo-nextest (the test runner)")
}
