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

impl Daemon {
    /// Waits (10 s at most) for `needle` in the log, without waiting on the child.
    fn wait_log_ro(&self, needle: &str) {
        let end = Instant::now() + Duration::from_secs(10);
        while !self.log().contains(needle) {
            assert!(
                Instant::now() < end,
                "no {needle:?} in the log:\n{}",
                self.log()
            );
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

/// A cgroup2 child directory (and, for a pod's, the directories above it up to the
/// test's), removed when dropped.
struct Cgroup(PathBuf, Vec<PathBuf>);

impl Cgroup {
    /// A container of pod `uid` as kubelet and containerd lay it out (cgroupfs driver),
    /// under the test's cgroup.
    fn pod(test: &str, uid: &str, container_id: &str) -> Cgroup {
        let top = Cgroup::new(test);
        let mut dirs = vec![top.0.clone()];
        let mut dir = top.0.clone();
        for part in [
            "kubepods".to_owned(),
            "burstable".to_owned(),
            format!("pod{uid}"),
            container_id.to_owned(),
        ] {
            dir = dir.join(part);
            std::fs::create_dir(&dir).unwrap();
            dirs.push(dir.clone());
        }
        std::mem::forget(top);
        dirs.pop();
        dirs.reverse();
        Cgroup(dir, dirs)
    }

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
        Cgroup(dir, Vec::new())
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
        for dir in std::iter::once(&self.0).chain(&self.1) {
            for _ in 0..250 {
                if std::fs::remove_dir(dir).is_ok() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
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
    let out = Command::new(crate::vgpuctl_bin())
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
        .command(crate::daemon_bin())
        .args(if extra.contains(&"--ebpf") {
            &[][..]
        } else {
            &["--ebpf", "off", "--ebpf-pin-dir", "off"][..]
        })
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

/// `cuda-probe`'s script for a second-driver bypass: admitted with 64 MiB through the
/// hooked `cuInit`; when told (stdin closed), a second driver in a new link namespace
/// (`dlmopen`) and `size` through it; then it waits to be acted on.
fn bypass_script(size: &'static str) -> [&'static str; 9] {
    [
        "init",
        "alloc",
        "64Mi",
        "ready",
        "wait",
        "dlmopen-alloc",
        size,
        "sleep",
        "60000",
    ]
}

/// What the second line did to a bypass: how long after its allocation it was killed,
/// what it was seen holding until then, the daemon's log and its action line.
struct Killed {
    after: Duration,
    held_before: u64,
    log: String,
    action: String,
}

/// Tells a registered [`bypass_script`] probe to bypass, hands its result line to
/// `check` (the process is still alive then), and waits (10 s at most) for the second
/// line to kill it (SIGKILL) and log it as a second CUDA driver, naming its pid.
fn killed_as_a_second_driver(
    daemon: &mut Daemon,
    api: &Path,
    bypass: &mut Probe,
    check: impl FnOnce(&str),
) -> Killed {
    let pid = bypass.pid();
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
    check(&line);
    let mut held_before = 0;
    let status = loop {
        held_before = held_before.max(held_by(api, &[pid]));
        if let Some(st) = bypass.child.try_wait().unwrap() {
            break st;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the bypass ({line}) was not acted on within 10 s; held {held_before} bytes\n{}",
            daemon.log()
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    let after = t0.elapsed();
    assert_eq!(
        status.signal(),
        Some(9),
        "killed by the second line: {status}"
    );
    let log = daemon.wait_log("second CUDA driver mapped after admission");
    let pid_field = format!("pid={pid}");
    assert!(
        log.lines()
            .any(|x| x.contains("mapped the CUDA driver twice") && x.contains(&pid_field)),
        "no second-driver detection logged for {pid}:\n{log}"
    );
    let action = log
        .lines()
        .find(|x| x.contains("second CUDA driver mapped after admission"))
        .unwrap()
        .to_owned();
    assert!(action.contains(&pid_field), "{action}");
    Killed {
        after,
        held_before,
        log,
        action,
    }
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
    let mut bypass = Probe::start(cmd, &bypass_script("8Gi"), Duration::from_secs(30));
    let pid = bypass.pid();
    wait_registered(&daemon, &api, other.pid());
    wait_registered(&daemon, &api, pid);
    let Killed {
        after: acted,
        held_before,
        log: l,
        action,
    } = killed_as_a_second_driver(&mut daemon, &api, &mut bypass, |line| {
        // The shim does not see it: the second driver gave 8 GiB on a 256 MiB quota.
        assert!(
            line.starts_with("dlmopen_alloc=ok") && line.contains("driver_loads=2"),
            "{line}"
        );
    });
    // Bounded: the grace (200 ms) and one NVML interval (100 ms), with room for a loaded
    // machine.
    assert!(acted < Duration::from_secs(3), "acted on after {acted:?}");
    let action = action.as_str();
    for field in [
        format!("pid={pid}").as_str(),
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

/// A pod's UID and its container's id, for the pod-event tests.
const POD_UID: &str = "5ec0d11e-0000-4000-8000-0000000e7e17";
const CONTAINER_ID: &str = "5ec0d11e00000000000000000000000000000000000000000000000000000e17";

/// The device plugin on a fake API server with the pod `ml/trainer` (container `main`,
/// [`CONTAINER_ID`]) in its watch, following the daemon's API socket `api`.
async fn plugin_following(api: &Path) -> vgpu_testkit::node::TestNode {
    let api = api.to_owned();
    let node = vgpu_testkit::node::TestNode::start_with(vgpu_testkit::node::gpus(1, 8192), |c| {
        c.daemon_api_socket = Some(api);
    })
    .await
    .expect("the plugin's node");
    let mut pod =
        vgpu_testkit::node::pod_json("ml", "trainer", POD_UID, 0, &[("main", false, vec![])]);
    pod["status"]["containerStatuses"] = serde_json::json!([{
        "name": "main", "containerID": format!("containerd://{CONTAINER_ID}"),
        "image": "x", "imageID": "x", "ready": true, "restartCount": 0,
    }]);
    node.put_pod(pod).await.unwrap();
    node
}

/// The events on the fake API server with `reason`.
fn events_with(node: &vgpu_testkit::node::TestNode, reason: &str) -> Vec<serde_json::Value> {
    node.api
        .events()
        .into_iter()
        .filter(|e| e["reason"] == reason)
        .collect()
}

/// A second follower of the daemon's events with nothing remembered (the plugin
/// restarted): it replays every event the daemon kept. Returns what it did once it has
/// seen `n` events of the kind counted by `seen`.
async fn replayed(
    node: &vgpu_testkit::node::TestNode,
    api: &Path,
    seen: impl Fn(&vgpu_device_plugin::gate_events::GateWatchState) -> bool,
) -> vgpu_device_plugin::gate_events::GateWatchState {
    use vgpu_device_plugin::gate_events::{GateWatchState, follow};
    let state = std::sync::Arc::new(std::sync::Mutex::new(GateWatchState::default()));
    let task = tokio::spawn(follow(
        node.handshake.clone(),
        api.to_owned(),
        std::sync::Arc::clone(&state),
    ));
    let end = Instant::now() + Duration::from_secs(10);
    let got = loop {
        let st = state.lock().unwrap().clone();
        if seen(&st) {
            break st;
        }
        assert!(
            Instant::now() < end,
            "the second follower saw nothing: {st:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    // Its posts are done before it counts the next event; give the last one time.
    tokio::time::sleep(Duration::from_millis(300)).await;
    task.abort();
    let st = state.lock().unwrap().clone();
    assert_eq!((st.memory_posted, st.node_posted), (0, 0), "{got:?}");
    st
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_line_kill_is_one_warning_event_on_the_pod_naming_the_process_the_figures_and_the_reason()
 {
    let sim = SimNode::new(&format!(
        "[[device]]\nuuid = \"{UUID}\"\nmemory = \"8Gi\"\n"
    ));
    let dir = tempfile::tempdir().unwrap();
    let daemon = start_daemon(&sim, dir.path(), &[]);
    let api = dir.path().join("api.sock");
    let socket = dir.path().join("daemon.sock");
    let node = plugin_following(&api).await;

    // The pod's container: a registered tenant within its 256 MiB, and a raw process
    // holding 1 GiB.
    let cg = Cgroup::pod("pod-event", POD_UID, CONTAINER_ID);
    let container = Container::new("256Mi").with("VGPU_DAEMON_SOCKET", &socket.to_string_lossy());
    let mut cmd = cg.command(&sim, &probe_bin());
    container.apply(&mut cmd);
    let tenant = Probe::start(
        cmd,
        &["init", "alloc", "64Mi", "ready", "wait"],
        Duration::from_secs(30),
    );
    wait_registered(&daemon, &api, tenant.pid());
    let mut raw_cmd = cg.command(&sim, &probe_bin());
    raw_cmd.env_remove("LD_PRELOAD");
    let mut raw = Probe::start(
        raw_cmd,
        &["init", "alloc", "1Gi", "ready", "wait"],
        Duration::from_secs(30),
    );
    let raw_pid = raw.pid();
    let t0 = Instant::now();
    let status = loop {
        if let Some(st) = raw.child.try_wait().unwrap() {
            break st;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the raw process was not killed within 10 s\n{}",
            daemon.log()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    let killed = Instant::now();
    assert_eq!(
        status.signal(),
        Some(9),
        "killed by the second line: {status}"
    );

    // The event on the pod.
    let reason = vgpu_device_plugin::gate_events::EVENT_MEMORY_KILLED;
    let events = loop {
        let e = events_with(&node, reason);
        if !e.is_empty() {
            break e;
        }
        assert!(
            killed.elapsed() < Duration::from_secs(10),
            "no {reason} event within 10 s of the kill; events: {:#?}\n{}",
            node.api.events(),
            daemon.log()
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    };
    let to_event = killed.elapsed();
    let e = &events[0];
    assert_eq!(e["type"], "Warning");
    assert_eq!(e["involvedObject"]["kind"], "Pod");
    assert_eq!(e["involvedObject"]["namespace"], "ml");
    assert_eq!(e["involvedObject"]["name"], "trainer");
    assert_eq!(e["involvedObject"]["uid"], POD_UID);
    assert_eq!(e["involvedObject"]["fieldPath"], "spec.containers{main}");
    let message = e["message"].as_str().unwrap();
    for part in [
        format!("process {raw_pid} (cuda-probe) of container \"main\" was killed (SIGKILL)"),
        "GPU memory no shim registered, in the container's cgroup".to_owned(),
        "against a quota of 256 MiB".to_owned(),
        format!("on GPU {UUID}"),
    ] {
        assert!(message.contains(&part), "{part:?} missing from {message}");
    }
    // The process's own figure: at least the 1 GiB it allocated.
    let held: u64 = message
        .split("it held ")
        .nth(1)
        .and_then(|r| r.split(" MiB").next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    assert!(held >= 1024, "{message}");

    // One per (pod, process, action): nothing more once the container is within quota.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        events_with(&node, reason).len(),
        1,
        "{:#?}",
        node.api.events()
    );

    // The plugin restarts (a follower that remembers nothing): the daemon replays the
    // kill, the API server has the event by its name, nothing is posted twice.
    let st = replayed(&node, &api, |s| s.memory_actions >= 1).await;
    assert!(st.already_posted >= 1, "{st:?}");
    assert_eq!(
        events_with(&node, reason).len(),
        1,
        "{:#?}",
        node.api.events()
    );
    let out = tenant.finish(Duration::from_secs(30)).join("\n");
    assert!(
        !out.contains("Error"),
        "the registered tenant goes on: {out}"
    );
    println!(
        "FIGURE second line, pod event: {reason} on the pod {} ms after the kill was seen (kill {} ms after the allocation; NVML every 100 ms, grace 200 ms)",
        to_event.as_millis(),
        (killed - t0).as_millis()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enforce_that_cannot_enforce_is_a_warning_event_on_the_node() {
    let sim = SimNode::new(&format!(
        "[[device]]\nuuid = \"{UUID}\"\nmemory = \"8Gi\"\n"
    ));
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no-such-dev");
    let missing = missing.to_string_lossy();
    // The gate cannot attach (its device directory is missing): the daemon fails closed.
    let daemon = start_daemon(
        &sim,
        dir.path(),
        &[
            "--ebpf",
            "enforce",
            "--ebpf-pin-dir",
            "off",
            "--ebpf-dev-dir",
            &missing,
        ],
    );
    daemon.wait_log_ro("failing closed");
    let api = dir.path().join("api.sock");
    let node = plugin_following(&api).await;
    let reason = vgpu_device_plugin::gate_events::EVENT_NOT_ENFORCING;
    let end = Instant::now() + Duration::from_secs(10);
    let events = loop {
        let e = events_with(&node, reason);
        if !e.is_empty() {
            break e;
        }
        assert!(
            Instant::now() < end,
            "no {reason} event within 10 s; events: {:#?}\n{}",
            node.api.events(),
            daemon.log()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let e = &events[0];
    assert_eq!(e["type"], "Warning");
    assert_eq!(e["metadata"]["namespace"], "default");
    assert_eq!(e["involvedObject"]["kind"], "Node");
    assert_eq!(e["involvedObject"]["name"], node.cfg.node_name.as_str());
    let message = e["message"].as_str().unwrap();
    for part in [
        "--ebpf enforce was asked for and the GPU device gate is not attached",
        "no-such-dev",
        "failing closed: the node agent is not Ready and new GPU tenants are refused",
    ] {
        assert!(message.contains(part), "{part:?} missing from {message}");
    }
    // A restarted plugin meets the posted event; one in all.
    let st = replayed(&node, &api, |s| {
        s.subscriptions >= 1 && s.already_posted >= 1
    })
    .await;
    assert_eq!(st.already_posted, 1, "{st:?}");
    assert_eq!(
        events_with(&node, reason).len(),
        1,
        "{:#?}",
        node.api.events()
    );
}

#[test]
fn a_renamed_copy_of_the_driver_beside_the_real_one_is_a_second_driver() {
    const BYPASS: u64 = 4 << 30;
    let sim = SimNode::new(&format!(
        "[[device]]\nuuid = \"{UUID}\"\nmemory = \"16Gi\"\n"
    ));
    let dir = tempfile::tempdir().unwrap();
    let mut daemon = start_daemon(&sim, dir.path(), &[]);
    let api = dir.path().join("api.sock");
    let socket = dir.path().join("daemon.sock");
    let cg = Cgroup::new("renamed");
    let container = Container::new("256Mi").with("VGPU_DAEMON_SOCKET", &socket.to_string_lossy());

    // A copy of the driver under a name that is not libcuda's; `libcuda.so.1` in a
    // directory first on the library path leads to it (a symbolic link: the mapping
    // shows the copy's own name). The real driver is loaded at start (preloaded after the
    // shim), so that the program's and the shim's `libcuda.so.1` are it; only the new
    // link namespace of `dlmopen` searches the path and finds the copy.
    let real = vgpu_tests::sim_lib_dir().join("libcuda.so.1");
    let renamed = dir.path().join("lib");
    std::fs::create_dir(&renamed).unwrap();
    let copy = renamed.join("libgpuhelper.so");
    std::fs::copy(&real, &copy).unwrap();
    std::os::unix::fs::symlink(&copy, renamed.join("libcuda.so.1")).unwrap();

    let mut cmd = cg.command(&sim, &probe_bin());
    container.apply(&mut cmd);
    let shim = cmd
        .get_envs()
        .find(|(k, _)| *k == "LD_PRELOAD")
        .and_then(|(_, v)| v)
        .expect("the container preloads the shim")
        .to_owned();
    let mut preload = shim;
    preload.push(" ");
    preload.push(&real);
    cmd.env("LD_PRELOAD", preload);
    cmd.env("VGPU_REAL_LIBCUDA", &real).env(
        "LD_LIBRARY_PATH",
        format!(
            "{}:{}",
            renamed.display(),
            vgpu_tests::sim_lib_dir().display()
        ),
    );
    let mut bypass = Probe::start(cmd, &bypass_script("4Gi"), Duration::from_secs(30));
    let pid = bypass.pid();
    wait_registered(&daemon, &api, pid);
    let Killed {
        after: acted,
        log: l,
        action,
        ..
    } = killed_as_a_second_driver(&mut daemon, &api, &mut bypass, |line| {
        // By name the process has the driver once (the copy is not named libcuda).
        assert!(
            line.starts_with("dlmopen_alloc=ok") && line.contains("driver_loads=1"),
            "{line}"
        );
        let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
        assert!(maps.contains("libgpuhelper.so"), "{maps}");
    });
    assert!(log_num(&action, "held_bytes") >= BYPASS, "{action}");
    let m = metrics(&l);
    assert!(
        m.contains("vgpu_memory_second_driver_processes_total 1"),
        "{m}"
    );
    println!(
        "FIGURE second line, renamed driver copy (libgpuhelper.so, 4 GiB on a 256 MiB quota): recognised as a second driver and killed {} ms after its allocation",
        acted.as_millis()
    );
}
