//! Suspension with real processes on cuda-sim (issue 43, ADRs 0066 and 0070): the
//! `vgpu-daemon` binary suspends a container under the shim by the driver's checkpoint
//! API (`vgpuctl suspend`), a neighbour sees the GPU memory free, the container's next
//! CUDA call waits in the shim for the resume it asks for, and its bytes are the same
//! after; what cannot be suspended is refused with its reason.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use vgpu_tests::{Container, Probe, SimNode, num};

const UUID: &str = "GPU-51570000-0000-4000-8000-0000000043aa";
const MIB: u64 = 1 << 20;
/// Host link of the simulated checkpoint copies, GB/s.
const COPY_GBPS: u64 = 2;

/// One 8 GiB device, 256 MiB per context; checkpoints over a 2 GB/s link into 64 GiB.
fn node() -> SimNode {
    SimNode::new(&format!(
        r#"
        [[device]]
        uuid = "{UUID}"
        memory = "8Gi"
        context_overhead = "256Mi"
        alloc_granularity = "2Mi"
        [host]
        memory = "64Gi"
        copy_gbps = {COPY_GBPS}
        "#
    ))
}

struct Daemon {
    child: Child,
    log: PathBuf,
    api: PathBuf,
    socket: PathBuf,
}

impl Daemon {
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts the daemon binary on `node` in `dir` (no eBPF, no NVML watcher) with `extra`.
fn start(node: &SimNode, dir: &Path, extra: &[&str]) -> Daemon {
    let log = dir.join(format!("daemon-{}.log", std::process::id()));
    let f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log)
        .expect("log file");
    let socket = dir.join("daemon.sock");
    let api = dir.join("api.sock");
    let child = node
        .command(crate::daemon_bin())
        .args([
            "--ebpf",
            "off",
            "--ebpf-pin-dir",
            "off",
            "--nvml-interval-ms",
            "0",
        ])
        .args(["--metrics-addr", "127.0.0.1:0"])
        .arg("--socket")
        .arg(&socket)
        .arg("--api-socket")
        .arg(&api)
        .args(extra)
        .env("VGPU_DAEMON_LOG", "info")
        .env("NO_COLOR", "1")
        .stdout(Stdio::null())
        .stderr(f)
        .spawn()
        .expect("spawn vgpu-daemon");
    let d = Daemon {
        child,
        log,
        api,
        socket,
    };
    let end = Instant::now() + Duration::from_secs(30);
    while !d.log().contains("vgpu-daemon serving") {
        assert!(
            Instant::now() < end,
            "the daemon did not start:\n{}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    d
}

fn vgpuctl(api: &Path, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(crate::vgpuctl_bin())
        .arg("--api-socket")
        .arg(api)
        .args(args)
        .output()
        .expect("run vgpuctl");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn json(api: &Path, args: &[&str]) -> serde_json::Value {
    let mut a = vec!["--json"];
    a.extend_from_slice(args);
    let (ok, out, err) = vgpuctl(api, &a);
    assert!(ok, "vgpuctl {args:?}: {err}");
    serde_json::from_str(&out).expect("JSON")
}

/// A container of the shim registered with `d` as tenant `key`.
fn container(d: &Daemon, key: &str) -> Container {
    Container::new("2Gi")
        .with("VGPU_DAEMON_SOCKET", &d.socket.display().to_string())
        .with("VGPU_TENANT", key)
}

/// A tenant holding `bytes` of pattern `seed` that, once its stdin closes, makes one
/// timed call (`cuMemGetInfo`), reads its data back and stays 2 s more.
fn tenant(node: &SimNode, c: &Container, bytes: u64) -> Probe {
    let n = bytes.to_string();
    node.spawn_probe_in(
        Some(c),
        &[
            "init",
            "fill",
            &n,
            "7",
            "ready",
            "wait",
            "timed-meminfo",
            "verify",
            "sleep",
            "2000",
        ],
        Duration::from_secs(60),
    )
}

/// Waits until the daemon reports at least `bytes` of tenant `key`'s memory.
fn wait_reported(d: &Daemon, key: &str, bytes: u64) -> serde_json::Value {
    let end = Instant::now() + Duration::from_secs(30);
    loop {
        let (ok, out, _) = vgpuctl(&d.api, &["--json", "tenant", key]);
        if ok {
            let t: serde_json::Value = serde_json::from_str(&out).expect("JSON");
            if t["gpus"][0]["memory_used_bytes"].as_u64().unwrap_or(0) >= bytes {
                return t;
            }
        }
        assert!(
            Instant::now() < end,
            "tenant {key} not reported with {bytes} B: {out}\n{}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn free(node: &SimNode) -> u64 {
    num(&node.probe(&["init", "meminfo"]), "free")
}

#[test]
fn a_suspended_container_frees_the_gpu_and_its_next_call_waits_for_the_resume() {
    let node = node();
    let dir = tempfile::tempdir().expect("temporary directory");
    let d = start(&node, dir.path(), &["--suspend-host-memory", "1Gi"]);
    let key = "default/notebook-0/main";
    let c = container(&d, key);
    let data = 256 * MIB;
    let mut t = tenant(&node, &c, data);
    wait_reported(&d, key, data);
    let before = free(&node);

    let s = json(&d.api, &["suspend", key]);
    assert_eq!(s["pids"], serde_json::json!([t.pid()]), "{s:#}");
    assert_eq!(s["bytes"], data, "{s:#}");
    let suspend_ms = s["took_ms"].as_u64().expect("took_ms");

    // A neighbour sees the memory (and the tenant's context) free.
    let during = free(&node);
    assert!(
        during >= before + data,
        "free {during} B while suspended, {before} B before"
    );
    // The daemon's books hold it as suspended; a second suspension is refused.
    let v = json(&d.api, &["tenant", key]);
    assert_eq!(v["gpus"][0]["suspended_bytes"], data, "{v:#}");
    assert_eq!(v["gpus"][0]["suspensions"], 1, "{v:#}");
    let (ok, _, err) = vgpuctl(&d.api, &["suspend", key]);
    assert!(!ok && err.contains("already suspended"), "{err}");

    // The tenant's next call waits for the resume its shim asks for, then succeeds.
    std::thread::sleep(Duration::from_millis(300));
    drop(t.child.stdin.take());
    let mut lines = Vec::new();
    while !lines.iter().any(|l: &String| l.starts_with("verify=")) {
        match t.next_line(Duration::from_secs(60)) {
            Some(l) => lines.push(l),
            None => panic!("no call and check after the resume: {lines:?}\n{}", d.log()),
        }
    }
    // Resumed: nothing suspended in the books any more.
    let v = json(&d.api, &["tenant", key]);
    assert_eq!(v["gpus"][0]["suspended_bytes"], 0, "{v:#}");
    assert_eq!(v["gpus"][0]["suspensions"], 1, "{v:#}");
    let call = lines
        .iter()
        .find(|l| l.starts_with("free="))
        .unwrap_or_else(|| panic!("no call after the resume: {lines:?}\n{}", d.log()));
    assert!(
        lines.iter().any(|l| l == "verify=ok"),
        "{lines:?}\n{}",
        d.log()
    );
    let call_us = num(call, "call_us");
    // The restore of the 256 MiB moved over the 2 GB/s link is inside the call.
    let model_us = data * 1_000_000 / (COPY_GBPS * 1_000_000_000);
    assert!(
        call_us >= model_us,
        "the call took {call_us} us, under the {model_us} us the restore takes"
    );
    eprintln!(
        "suspend of {data} B: {suspend_ms} ms; the call that resumed it: {} ms; modelled copy {} ms",
        call_us / 1000,
        model_us / 1000
    );
    let log = d.log();
    assert!(log.contains("resumed"), "{log}");
    for l in log
        .lines()
        .filter(|l| l.contains("suspended") || l.contains("resumed"))
    {
        eprintln!("{l}");
    }
    t.finish(Duration::from_secs(30));
}

#[test]
fn what_cannot_be_suspended_is_refused_and_keeps_running() {
    let node = node();
    let dir = tempfile::tempdir().expect("temporary directory");
    let d = start(&node, dir.path(), &["--suspend-host-memory", "128Mi"]);

    // Over the host memory bound: refused before anything is locked.
    let key = "default/big/main";
    let c = container(&d, key);
    let mut t = tenant(&node, &c, 256 * MIB);
    wait_reported(&d, key, 256 * MIB);
    let (ok, _, err) = vgpuctl(&d.api, &["suspend", key]);
    assert!(!ok, "suspended over the bound");
    assert!(
        err.contains("--suspend-host-memory 134217728 B") && err.contains("ResourceExhausted"),
        "{err}"
    );
    drop(t.child.stdin.take());
    let lines = t.finish(Duration::from_secs(30));
    assert!(lines.iter().any(|l| l == "verify=ok"), "{lines:?}");
    let call = lines.iter().find(|l| l.starts_with("free=")).expect("call");
    assert!(num(call, "call_us") < 200_000, "the call waited: {call}");

    // Unified memory: the driver's NOT_SUPPORTED, named; the tenant is unlocked.
    let key = "default/managed/main";
    let c = container(&d, key);
    let mut m = node.spawn_probe_in(
        Some(&c),
        &[
            "init",
            "alloc-api",
            "managed",
            "4Mi",
            "ready",
            "wait",
            "timed-meminfo",
        ],
        Duration::from_secs(60),
    );
    wait_reported(&d, key, 4 * MIB);
    let (ok, _, err) = vgpuctl(&d.api, &["suspend", key]);
    assert!(!ok, "suspended unified memory");
    assert!(
        err.contains("CUDA_ERROR_NOT_SUPPORTED") && err.contains("unified memory"),
        "{err}"
    );
    assert!(err.contains(&m.pid().to_string()), "{err}");
    drop(m.child.stdin.take());
    let lines = m.finish(Duration::from_secs(30));
    let call = lines
        .iter()
        .find(|l| l.starts_with("free="))
        .unwrap_or_else(|| panic!("{lines:?}"));
    assert!(num(call, "call_us") < 200_000, "the call waited: {call}");
}

#[test]
fn a_restarted_daemon_resumes_a_container_the_old_one_left_suspended() {
    let node = node();
    let dir = tempfile::tempdir().expect("temporary directory");
    let d = start(&node, dir.path(), &["--suspend-host-memory", "1Gi"]);
    let key = "default/notebook-1/main";
    let c = container(&d, key);
    let data = 64 * MIB;
    let mut t = tenant(&node, &c, data);
    wait_reported(&d, key, data);
    json(&d.api, &["suspend", key]);
    // The daemon goes away with the container suspended.
    drop(d);
    drop(t.child.stdin.take());
    assert_eq!(
        t.next_line(Duration::from_millis(700)),
        None,
        "a call of a suspended container returned with no daemon"
    );
    // A new daemon on the same socket: the waiting call's next request resumes it.
    let _d = start(&node, dir.path(), &["--suspend-host-memory", "1Gi"]);
    let lines = t.finish(Duration::from_secs(60));
    assert!(lines.iter().any(|l| l.starts_with("free=")), "{lines:?}");
    assert!(lines.iter().any(|l| l == "verify=ok"), "{lines:?}");
}
