//! The second line (issue 39, ADR 0039) with real processes on cuda-sim: a container
//! (a cgroup) with a registered tenant under the shim (quota 256 MiB) and, in the same
//! cgroup, a process that allocates 1 GiB through the raw simulated driver without the
//! shim. The daemon charges the raw process's memory to the container (not to nobody)
//! and, the container over its quota plus context allowances for longer than the grace
//! (two NVML intervals), kills it, logging the process, the figures and the reason, and
//! counting it in `/metrics`; the registered tenant goes on. Before: the raw process held
//! its 1 GiB until it exited, reported as a bypass charged to no container.
//!
//! And the `dlmopen` bypass (issue 39 item 3): a registered tenant under the shim loads a
//! second copy of the driver into a new link namespace after admission and allocates 8 GiB
//! through it, unseen by its shim. The daemon finds the driver mapped twice in
//! `/proc/PID/maps`, charges the memory to the container and kills the process past the
//! grace; another tenant of the container goes on. Before: it kept the 8 GiB (reported as
//! a bypass, charged to nobody).
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

/// The daemon on `sim`'s GPU, NVML read every 100 ms (grace 200 ms), its sockets in
/// `dir`, with `extra` arguments; started when its NVML watcher is.
fn start_daemon(sim: &SimNode, dir: &Path, extra: &[&str]) -> Daemon {
    let log = dir.join("daemon.log");
    let child = sim
        .command(env!("CARGO_BIN_EXE_vgpu-daemon"))
        .args(["--ebpf", "off", "--ebpf-pin-dir", "off"])
        .arg("--socket")
        .arg(dir.join("daemon.sock"))
        .arg("--api-socket")
        .arg(dir.join("api.sock"))
        .args(["--metrics-addr", "127.0.0.1:0", "--gpu", UUID])
        .args(["--nvml-interval-ms", "100", "--sched-priority", "0"])
        .args(extra)
        .env("VGPU_DAEMON_LOG", "info")
        .env("NO_COLOR", "1")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let mut daemon = Daemon { child, log };
    daemon.wait_log("NVML watcher started");
    daemon
}

/// Waits (10 s at most) until `pid` is a registered tenant's process.
fn wait_registered(daemon: &Daemon, api: &Path, pid: u32) {
    let end = Instant::now() + Duration::from_secs(10);
    while !vgpuctl_json(api, "tenants")
        .to_string()
        .contains(&pid.to_string())
    {
        assert!(
            Instant::now() < end,
            "process {pid} never registered\n{}",
            daemon.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The daemon's `/metrics` text (its address from the log).
fn metrics(log: &str) -> String {
    let i = log.find("metrics on http://").unwrap() + 18;
    http_get(&log[i..][..log[i..].find('/').unwrap()], "/metrics")
}

#[test]
fn a_raw_process_in_a_containers_cgroup_is_charged_to_it_and_killed_past_the_grace() {
    let sim = SimNode::new(&format!(
        "[[device]]\nuuid = \"{UUID}\"\nmemory = \"8Gi\"\n"
    ));
    let dir = tempfile::tempdir().unwrap();
    let mut daemon = start_daemon(&sim, dir.path(), &[]);
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
    wait_registered(&daemon, &api, tenant.pid());

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
    let m = metrics(&l);
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

/// The number after `key=` in a log line (0 when absent).
fn log_num(line: &str, key: &str) -> u64 {
    line.split_whitespace()
        .find_map(|f| f.strip_prefix(key)?.strip_prefix('='))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

#[test]
fn a_registered_process_that_dlmopens_a_second_driver_is_charged_to_its_container_and_killed() {
    const BYPASS: u64 = 8 << 30;
    let sim = SimNode::new(&format!(
        "[[device]]\nuuid = \"{UUID}\"\nmemory = \"16Gi\"\n"
    ));
    let dir = tempfile::tempdir().unwrap();
    let mut daemon = start_daemon(&sim, dir.path(), &[]);
    let api = dir.path().join("api.sock");
    let socket = dir.path().join("daemon.sock");
    let cg = Cgroup::new("dlmopen");
    let container = Container::new("256Mi").with("VGPU_DAEMON_SOCKET", &socket.to_string_lossy());

    // Another tenant of the container, within its quota: it goes on.
    let mut cmd = cg.command(&sim, &probe_bin());
    container.apply(&mut cmd);
    let other = Probe::start(
        cmd,
        &["init", "alloc", "64Mi", "ready", "wait"],
        Duration::from_secs(30),
    );
    // The bypass: admitted and registered through the hooked cuInit; when told (stdin
    // closed), a second driver in a new link namespace and 8 GiB through it.
    let mut cmd = cg.command(&sim, &probe_bin());
    container.apply(&mut cmd);
    let mut bypass = Probe::start(
        cmd,
        &[
            "init",
            "alloc",
            "64Mi",
            "ready",
            "wait",
            "dlmopen-alloc",
            "8Gi",
            "sleep",
            "60000",
        ],
        Duration::from_secs(30),
    );
    let pid = bypass.pid();
    wait_registered(&daemon, &api, other.pid());
    wait_registered(&daemon, &api, pid);
    drop(bypass.child.stdin.take());
    let line = loop {
        let l = bypass
            .next_line(Duration::from_secs(30))
            .unwrap_or_else(|| panic!("no dlmopen-alloc result: {:?}", bypass.seen));
        if l.starts_with("dlmopen_alloc=") {
            break l;
        }
    };
    let t0 = Instant::now();
    // The shim does not see it: the second driver gave 8 GiB on a 256 MiB quota.
    assert!(
        line.starts_with("dlmopen_alloc=ok") && line.contains("driver_loads=2"),
        "{line}"
    );
    let mut held_before = 0;
    let status = loop {
        held_before = held_before.max(held_by(&api, &[pid]));
        if let Some(st) = bypass.child.try_wait().unwrap() {
            break st;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the dlmopen bypass (8 GiB on a 256 MiB quota) was not acted on within 10 s; held {held_before} bytes\n{}",
            daemon.log()
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    let acted = t0.elapsed();
    assert_eq!(
        status.signal(),
        Some(9),
        "killed by the second line: {status}"
    );
    // Bounded: the grace (200 ms) and one NVML interval (100 ms), with room for a loaded
    // machine.
    assert!(acted < Duration::from_secs(3), "acted on after {acted:?}");
    let l = daemon.wait_log("second CUDA driver mapped after admission");
    let pid_field = format!("pid={pid}");
    assert!(
        l.lines()
            .any(|x| x.contains("mapped the CUDA driver twice") && x.contains(&pid_field)),
        "no second-driver detection logged for {pid}:\n{l}"
    );
    let action = l
        .lines()
        .find(|x| x.contains("second CUDA driver mapped after admission"))
        .unwrap();
    for field in [
        pid_field.as_str(),
        "quota_bytes=268435456",
        "action=\"kill\"",
        "killed=true",
    ] {
        assert!(action.contains(field), "{field} missing from {action}");
    }
    // Charged to its container: the container's holding judged includes the 8 GiB.
    let charged = log_num(action, "held_bytes");
    assert!(charged >= BYPASS, "{charged} charged: {action}");
    // Afterwards: nothing of the bypass held, the other tenant within the quota and going on.
    let end = Instant::now() + Duration::from_secs(5);
    while held_by(&api, &[pid]) > 0 {
        assert!(
            Instant::now() < end,
            "the killed process still shown holding memory"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let held_after = held_by(&api, &[other.pid(), pid]);
    assert!(held_after <= (256 + 512) << 20, "{held_after}");
    let out = other.finish(Duration::from_secs(30)).join("\n");
    assert!(!out.contains("Error"), "the other tenant goes on: {out}");
    let m = metrics(&l);
    for series in [
        "vgpu_memory_second_driver_processes_total 1",
        "vgpu_memory_enforcement_processes_total{step=\"killed\"} 1",
    ] {
        assert!(m.contains(series), "{series} missing:\n{m}");
    }
    println!(
        "FIGURE second line, dlmopen: a registered tenant's second driver (dlmopen, 8 GiB on a 256 MiB quota) killed {} ms after its allocation (NVML every 100 ms, grace 200 ms); held by it before {} MiB (the container {} MiB charged), after 0; the container after {} MiB",
        acted.as_millis(),
        held_before >> 20,
        charged >> 20,
        held_after >> 20
    );
}
