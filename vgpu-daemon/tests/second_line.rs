//! The second line (issue 39, ADR 0039) with real processes on cuda-sim: a container
//! (a cgroup) with a registered tenant under the shim (quota 256 MiB) and, in the same
//! cgroup, a process that allocates 1 GiB through the raw simulated driver without the
//! shim. The daemon charges the raw process's memory to the container (not to nobody)
//! and, the container over its quota plus context allowances for longer than the grace
//! (two NVML intervals), kills it, logging the process, the figures and the reason, and
//! counting it in `/metrics`; the registered tenant goes on. Before: the raw process held
//! its 1 GiB until it exited, reported as a bypass charged to no container.
//!
//! Needs root and a cgroup2 mount (the container's cgroup is made under it): fails without
//! them (CI runs as root).

#![allow(clippy::unwrap_used)] // test code: a failed step is the failure

use std::io::{Read, Write};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use vgpu_tests::{Container, Probe, SimNode, probe_bin};

const UUID: &str = "GPU-5ec0d000-0000-4000-8000-000000005ec0";

struct Daemon {
    child: Child,
    log: PathBuf,
}

impl Daemon {
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn wait_log(&mut self, needle: &str) -> String {
        let end = Instant::now() + Duration::from_secs(30);
        loop {
            let l = self.log();
            if l.contains(needle) {
                return l;
            }
            if let Ok(Some(st)) = self.child.try_wait() {
                panic!("vgpu-daemon exited ({st}) before logging {needle:?}:\n{l}");
            }
            assert!(Instant::now() < end, "no {needle:?} in the log:\n{l}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A cgroup2 child directory, removed when dropped.
struct Cgroup(PathBuf);

impl Cgroup {
    fn new(test: &str) -> Cgroup {
        let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap();
        let root = vgpu_ebpf::preflight::cgroup2_mount(&mounts)
            .unwrap_or_else(|| panic!("{test} needs a cgroup2 mount (none in /proc/self/mounts)"));
        let dir = Path::new(root).join(format!("vgpu-test-{test}-{}", std::process::id()));
        std::fs::create_dir(&dir).unwrap_or_else(|e| {
            panic!(
                "{test} needs root to make a cgroup ({}): {e}",
                dir.display()
            )
        });
        Cgroup(dir)
    }

    /// `program` started inside this cgroup (a shell moves itself in, then execs it).
    fn command(&self, sim: &SimNode, program: &Path) -> Command {
        let mut c = sim.command("sh");
        c.arg("-c")
            .arg(r#"echo $$ > "$0/cgroup.procs" && shift && exec "$@""#)
            .arg(&self.0)
            .arg("--")
            .arg(program);
        c
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        for _ in 0..250 {
            if std::fs::remove_dir(&self.0).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

fn http_get(addr: &str, path: &str) -> String {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut r = String::new();
    s.read_to_string(&mut r).unwrap();
    r
}

fn vgpuctl_json(api: &Path, what: &str) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_vgpuctl"))
        .arg("--api-socket")
        .arg(api)
        .args(["--json", what])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Bytes NVML shows `pids` holding on the GPU (the daemon's last reading).
fn held_by(api: &Path, pids: &[u32]) -> u64 {
    let v = vgpuctl_json(api, "gpus");
    v["gpus"][0]["processes"]
        .as_array()
        .map(|ps| {
            ps.iter()
                .filter(|p| pids.iter().any(|x| p["pid"] == *x))
                .map(|p| p["used_bytes"].as_u64().unwrap_or(0))
                .sum()
        })
        .unwrap_or(0)
}

#[test]
fn a_raw_process_in_a_containers_cgroup_is_charged_to_it_and_killed_past_the_grace() {
    let sim = SimNode::new(&format!(
        "[[device]]\nuuid = \"{UUID}\"\nmemory = \"8Gi\"\n"
    ));
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("daemon.log");
    let child = sim
        .command(env!("CARGO_BIN_EXE_vgpu-daemon"))
        .args(["--ebpf", "off", "--ebpf-pin-dir", "off"])
        .arg("--socket")
        .arg(dir.path().join("daemon.sock"))
        .arg("--api-socket")
        .arg(dir.path().join("api.sock"))
        .args(["--metrics-addr", "127.0.0.1:0", "--gpu", UUID])
        .args(["--nvml-interval-ms", "100", "--sched-priority", "0"])
        .env("VGPU_DAEMON_LOG", "info")
        .env("NO_COLOR", "1")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let mut daemon = Daemon { child, log };
    daemon.wait_log("NVML watcher started");
    let api = dir.path().join("api.sock");
    let socket = dir.path().join("daemon.sock");

    let cg = Cgroup::new("second-line");
    let container = Container::new("256Mi").with("VGPU_DAEMON_SOCKET", &socket.to_string_lossy());
    let mut cmd = cg.command(&sim, &probe_bin());
    container.apply(&mut cmd);
    let tenant = Probe::start(
        cmd,
        &["init", "alloc", "64Mi", "ready", "wait"],
        Duration::from_secs(30),
    );
    let end = Instant::now() + Duration::from_secs(10);
    while !vgpuctl_json(&api, "tenants")
        .to_string()
        .contains(&tenant.pid().to_string())
    {
        assert!(
            Instant::now() < end,
            "the tenant never registered\n{}",
            daemon.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }

    // The raw process: the simulated driver without the shim, in the same cgroup.
    let mut raw_cmd = cg.command(&sim, &probe_bin());
    raw_cmd.env_remove("LD_PRELOAD");
    let mut raw = Probe::start(
        raw_cmd,
        &["init", "alloc", "1Gi", "ready", "wait"],
        Duration::from_secs(30),
    );
    let t0 = Instant::now();
    let raw_pid = raw.pid();
    // Held against the container before the action (the daemon's readings).
    let mut held_before = 0;
    let status = loop {
        held_before = held_before.max(held_by(&api, &[tenant.pid(), raw_pid]));
        if let Some(st) = raw.child.try_wait().unwrap() {
            break st;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the raw process was not acted on within 10 s\n{}",
            daemon.log()
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    let acted_ms = t0.elapsed().as_millis();
    assert_eq!(
        status.signal(),
        Some(9),
        "killed by the second line: {status}"
    );
    let l = daemon.wait_log(&format!("pid={raw_pid}"));
    let line = l
        .lines()
        .find(|x| x.contains("second line") && x.contains(&format!("pid={raw_pid}")))
        .unwrap_or_else(|| panic!("no second-line log for {raw_pid}:\n{l}"));
    for field in [
        "held_bytes=",
        "quota_bytes=268435456",
        "action=\"kill\"",
        "killed=true",
        "no shim registered",
    ] {
        assert!(line.contains(field), "{field} missing from {line}");
    }
    // The tenant goes on; the container is back within its quota.
    std::thread::sleep(Duration::from_millis(300));
    let held_after = held_by(&api, &[tenant.pid(), raw_pid]);
    assert!(held_after <= (256 + 512) << 20, "{held_after}");
    let out = tenant.finish(Duration::from_secs(30)).join("\n");
    assert!(
        !out.contains("Error"),
        "the registered tenant goes on: {out}"
    );
    let addr = {
        let i = l.find("metrics on http://").unwrap() + 18;
        l[i..][..l[i..].find('/').unwrap()].to_owned()
    };
    let m = http_get(&addr, "/metrics");
    assert!(
        m.contains("vgpu_memory_enforcement_processes_total{step=\"killed\"} 1"),
        "{m}"
    );
    println!(
        "FIGURE second line: raw process (1 GiB, no shim) in a 256 MiB container killed {acted_ms} ms after its allocation (NVML every 100 ms, grace 200 ms); held by the container before {} MiB, after {} MiB",
        held_before >> 20,
        held_after >> 20
    );
}
