//! Helpers for vgpu's cross-component tests: where the built artefacts are, a fresh
//! simulated node per test, and the `cuda-probe` client run as a real child process.

#![forbid(unsafe_code)]

pub mod cpu_load;
pub mod pidns;
pub mod plugin_mount;
pub mod promtool;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The repository root.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ lives in the repository root")
        .to_owned()
}

/// `target/cuda-sim`, where `cargo xtask sim` installs the simulated driver.
pub fn sim_lib_dir() -> PathBuf {
    // A relative CARGO_TARGET_DIR is relative to where cargo ran: the repository root.
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(|t| repo_root().join(t))
        .unwrap_or_else(|| repo_root().join("target"));
    let dir = target.join("cuda-sim");
    assert!(
        dir.join("libcuda.so.1").exists() && dir.join("libnvidia-ml.so.1").exists(),
        "the simulated driver is not built: run `cargo xtask sim` first (looked in {})",
        dir.display()
    );
    dir
}

/// The `cuda-probe` binary (`target/<profile>/cuda-probe`), refused when stale
/// (`vgpu_test_needs::bins`).
pub fn probe_bin() -> PathBuf {
    vgpu_test_needs::bins::Bin {
        name: "cuda-probe",
        package: "vgpu-tests",
    }
    .path()
}

/// The `device-probe` binary, found and checked as [`probe_bin`] is.
pub fn device_probe_bin() -> PathBuf {
    vgpu_test_needs::bins::Bin {
        name: "device-probe",
        package: "vgpu-tests",
    }
    .path()
}

/// The simulator's operator tool `vgpu-sim` (XIDs, faults), found and checked as
/// [`probe_bin`] is.
pub fn sim_tool_bin() -> PathBuf {
    vgpu_test_needs::bins::Bin {
        name: "vgpu-sim",
        package: "vgpu-cuda-sim",
    }
    .path()
}

/// `libvgpu.so` of the profile these tests were built with (cargo builds it as a
/// dependency of this package).
pub fn shim_lib() -> PathBuf {
    let bin = probe_bin();
    let dir = bin.parent().expect("cuda-probe lives in target/<profile>");
    for p in [dir.join("deps").join("libvgpu.so"), dir.join("libvgpu.so")] {
        if p.exists() {
            return p;
        }
    }
    panic!(
        "libvgpu.so is not built in {} (cargo builds it with the tests)",
        dir.display()
    );
}

/// A container for the shim: its accounting directory and quota.
#[derive(Debug)]
pub struct Container {
    dir: tempfile::TempDir,
    /// `VGPU_MEMORY_LIMIT` (None: unset).
    pub limit: Option<String>,
    /// Extra `VGPU_*` variables.
    pub env: Vec<(String, String)>,
}

impl Container {
    /// A container whose processes share one budget of `limit` per device.
    pub fn new(limit: &str) -> Container {
        Container {
            dir: tempfile::tempdir().expect("create a temporary directory"),
            limit: Some(limit.to_owned()),
            env: Vec::new(),
        }
    }

    /// The accounting directory (`VGPU_CONTAINER_DIR`).
    pub fn dir(&self) -> PathBuf {
        self.dir.path().join("vgpu")
    }

    /// Adds a variable to every process of the container.
    pub fn with(mut self, k: &str, v: &str) -> Container {
        self.env.push((k.to_owned(), v.to_owned()));
        self
    }

    /// Applies the container's preload and settings to `c`.
    pub fn apply(&self, c: &mut Command) {
        c.env("LD_PRELOAD", shim_lib())
            .env("VGPU_CONTAINER_DIR", self.dir());
        if let Some(l) = &self.limit {
            c.env("VGPU_MEMORY_LIMIT", l);
        }
        for (k, v) in &self.env {
            c.env(k, v);
        }
    }
}

/// A simulated node of its own: a state directory and a device configuration.
#[derive(Debug)]
pub struct SimNode {
    dir: tempfile::TempDir,
    config: PathBuf,
}

impl SimNode {
    /// A node with the devices described by `config_toml` (TOML of `VGPU_SIM_CONFIG`).
    pub fn new(config_toml: &str) -> SimNode {
        let dir = tempfile::tempdir().expect("create a temporary directory");
        let config = dir.path().join("config.toml");
        std::fs::write(&config, config_toml).expect("write the simulator config");
        SimNode { dir, config }
    }

    /// The state directory (`VGPU_SIM_DIR`).
    pub fn state_dir(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    /// A command with the environment that makes CUDA/NVML clients use this node.
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut c = Command::new(program);
        c.env("LD_LIBRARY_PATH", sim_lib_dir())
            .env("VGPU_SIM_DIR", self.state_dir())
            .env("VGPU_SIM_CONFIG", &self.config);
        c
    }

    /// Runs `cuda-probe` with `args` to completion; returns its stdout. Panics with its
    /// output if it fails.
    pub fn probe(&self, args: &[&str]) -> String {
        self.probe_in(None, args)
    }

    /// Like [`SimNode::probe`], inside `container` (under the shim) when given.
    pub fn probe_in(&self, container: Option<&Container>, args: &[&str]) -> String {
        let mut cmd = self.command(probe_bin());
        if let Some(c) = container {
            c.apply(&mut cmd);
        }
        let out = cmd.args(args).output().expect("run cuda-probe");
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "cuda-probe {args:?} failed ({}):\nstdout:\n{stdout}\nstderr:\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        stdout
    }

    /// Starts `cuda-probe` with `args` in the background and waits (at most `timeout`)
    /// until it prints a line starting with `ready`.
    pub fn spawn_probe(&self, args: &[&str], timeout: Duration) -> Probe {
        self.spawn_probe_in(None, args, timeout)
    }

    /// Like [`SimNode::spawn_probe`], inside `container` (under the shim) when given.
    pub fn spawn_probe_in(
        &self,
        container: Option<&Container>,
        args: &[&str],
        timeout: Duration,
    ) -> Probe {
        let mut cmd = self.command(probe_bin());
        if let Some(c) = container {
            c.apply(&mut cmd);
        }
        Probe::start(cmd, args, timeout)
    }
}

impl Probe {
    /// Starts `cmd` (a `cuda-probe` command with its environment) with `args` in the
    /// background and waits (at most `timeout`) until it prints a line starting with
    /// `ready`.
    pub fn start(mut cmd: Command, args: &[&str], timeout: Duration) -> Probe {
        let mut child = cmd
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn cuda-probe");
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let deadline = Instant::now() + timeout;
        let mut seen = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(line) if line.starts_with("ready") => {
                    seen.push(line);
                    return Probe {
                        child,
                        lines: rx,
                        seen,
                    };
                }
                Ok(line) => seen.push(line),
                Err(_) => {
                    let _ = child.kill();
                    panic!(
                        "cuda-probe {args:?} did not become ready within {timeout:?}; output so far: {seen:?}"
                    );
                }
            }
        }
    }
}

/// A `cuda-probe` running in the background.
#[derive(Debug)]
pub struct Probe {
    /// The process.
    pub child: Child,
    lines: std::sync::mpsc::Receiver<String>,
    /// Lines printed so far.
    pub seen: Vec<String>,
}

impl Probe {
    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The next line it prints, waiting at most `timeout`.
    pub fn next_line(&mut self, timeout: Duration) -> Option<String> {
        let line = self.lines.recv_timeout(timeout).ok()?;
        self.seen.push(line.clone());
        Some(line)
    }

    /// Sends SIGKILL and reaps the process.
    pub fn kill9(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Closes its stdin (the probe's signal to finish) and collects its remaining output.
    pub fn finish(mut self, timeout: Duration) -> Vec<String> {
        drop(self.child.stdin.take());
        let deadline = Instant::now() + timeout;
        while let Ok(line) = self
            .lines
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
        {
            self.seen.push(line);
        }
        // The output ends when the probe closes stdout; the exit status follows shortly.
        let status = loop {
            match self.child.try_wait() {
                Ok(Some(st)) => break Some(st),
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(5))
                }
                _ => break None,
            }
        };
        match status {
            Some(st) => assert!(
                st.success(),
                "cuda-probe failed: {st}; output {:?}",
                self.seen
            ),
            None => {
                let _ = self.child.kill();
                panic!(
                    "cuda-probe did not finish within {timeout:?}; output {:?}",
                    self.seen
                );
            }
        }
        self.seen
    }
}

/// The SysV shared memory keys of the shim's accounting region for the container
/// directory `dir` (ADR 0015), for tests that act as a tenant attacking it.
pub fn region_keys(dir: &Path) -> Vec<i32> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(dir).expect("stat the container directory");
    let born = m
        .created()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
    vgpu_core::region_key::keys(vgpu_core::region_key::DirIdentity {
        dev: m.dev(),
        ino: m.ino(),
        born,
    })
}

/// The value of `key=value` in the probe's output (the last occurrence).
pub fn field(out: &str, key: &str) -> Option<String> {
    out.split_whitespace()
        .rev()
        .filter_map(|kv| kv.split_once('='))
        .find(|(k, _)| *k == key)
        .map(|(_, v)| v.to_owned())
}

/// Like [`field`], parsed as an integer; panics with the output if absent.
pub fn num(out: &str, key: &str) -> u64 {
    field(out, key)
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no numeric {key}= in probe output:\n{out}"))
}

/// Nanoseconds the main thread of `pid` has waited for a CPU while runnable (the kernel's
/// run-queue delay, the second field of `/proc/<pid>/schedstat`); 0 when it cannot be
/// read. What a tenant's launcher could not ask of the GPU because it was off its CPU,
/// measured by the kernel rather than by vgpu.
pub fn runqueue_wait_ns(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/schedstat"))
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse().ok())
        .unwrap_or(0)
}
