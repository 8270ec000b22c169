//! The `vgpu-daemon` binary with its reporting surfaces: on cuda-sim (NVML watcher →
//! `vgpuctl gpus` and `/metrics` show a bypass process), without NVML (it keeps serving),
//! and with bad flags (refused, naming the value).

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use vgpu_tests::{Container, SimNode};

const UUID: &str = "GPU-51570000-0000-4000-8000-00000000bbbb";

struct Daemon {
    child: Child,
    log: PathBuf,
}

impl Daemon {
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits (bounded) until the log contains `needle`; returns the log.
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

fn start(mut cmd: Command, dir: &Path, extra: &[&str]) -> Daemon {
    let log = dir.join("daemon.log");
    let f = std::fs::File::create(&log).expect("log file");
    // No eBPF: these tests are about the daemon's other surfaces (eBPF: tests/ebpf_*.rs).
    let child = cmd
        .args(["--ebpf", "off", "--ebpf-pin-dir", "off"])
        .arg("--socket")
        .arg(dir.join("daemon.sock"))
        .arg("--api-socket")
        .arg(dir.join("api.sock"))
        .args(extra)
        .env("VGPU_DAEMON_LOG", "info")
        .env("NO_COLOR", "1")
        .stdout(Stdio::null())
        .stderr(f)
        .spawn()
        .expect("spawn vgpu-daemon");
    let mut d = Daemon { child, log };
    d.wait_log("vgpu-daemon serving");
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

fn http_get(addr: &str, path: &str) -> String {
    let mut s = std::net::TcpStream::connect(addr).expect("connect to /metrics");
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .expect("request");
    let mut r = String::new();
    s.read_to_string(&mut r).expect("response");
    r
}

/// The address the daemon logged for `/metrics`.
fn metrics_addr(log: &str) -> String {
    let i = log
        .find("metrics on http://")
        .expect("metrics address logged")
        + 18;
    let rest = &log[i..];
    rest[..rest.find('/').expect("address ends with /metrics")].to_owned()
}

#[test]
fn daemon_reports_a_bypass_on_cuda_sim() {
    let node = SimNode::new(&format!(
        "[[device]]\nuuid = \"{UUID}\"\nmemory = \"8Gi\"\n"
    ));
    let bypass = node.spawn_probe(
        &["init", "alloc", "128Mi", "ready", "wait"],
        Duration::from_secs(30),
    );
    let dir = tempfile::tempdir().expect("temporary directory");
    let mut d = start(
        node.command(crate::daemon_bin()),
        dir.path(),
        &["--nvml-interval-ms", "100", "--metrics-addr", "127.0.0.1:0"],
    );
    let api = dir.path().join("api.sock");
    let end = Instant::now() + Duration::from_secs(30);
    let gpus = loop {
        let (ok, out, err) = vgpuctl(&api, &["--json", "gpus"]);
        assert!(ok, "{err}");
        let v: serde_json::Value = serde_json::from_str(&out).expect("JSON");
        if v["gpus"][0]["bypass_pids"][0] == bypass.pid() {
            break v;
        }
        assert!(
            Instant::now() < end,
            "no bypass reported: {v:#}\n{}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(gpus["gpus"][0]["uuid"], UUID);
    assert_eq!(gpus["gpus"][0]["index"], 0);
    let (ok, table, err) = vgpuctl(&api, &["gpus"]);
    assert!(ok, "{err}");
    let line = table
        .lines()
        .find(|l| l.contains(&format!("pid {}", bypass.pid())))
        .unwrap_or_else(|| panic!("no process line:\n{table}"));
    assert!(line.contains("BYPASS"), "{table}");

    let log = d.wait_log("bypass");
    let addr = metrics_addr(&log);
    let m = http_get(&addr, "/metrics");
    assert!(m.starts_with("HTTP/1.1 200"), "{m}");
    assert!(
        m.contains(&format!("vgpu_gpu_bypass_processes{{gpu=\"{UUID}\"}} 1\n")),
        "{m}"
    );
    assert!(m.contains("vgpu_gpu_memory_total_bytes{gpu=\""), "{m}");
    assert!(http_get(&addr, "/healthz").ends_with("\r\n\r\nok\n"));
    // The warning names the PID, once.
    let pid_field = format!("pid={}", bypass.pid());
    let warnings = log
        .lines()
        .filter(|l| l.contains("bypass:") && l.contains(&pid_field))
        .count();
    assert_eq!(warnings, 1, "{log}");
    bypass.kill9();
}

#[test]
fn daemon_serves_without_nvml() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let mut d = start(
        Command::new(crate::daemon_bin()),
        dir.path(),
        &[
            "--nvml-lib",
            "/nonexistent/libnvidia-ml.so.1",
            "--metrics-addr",
            "off",
            "--api-addr",
            "127.0.0.1:0",
        ],
    );
    let log = d.wait_log("NVML unavailable");
    assert!(log.contains("/nonexistent/libnvidia-ml.so.1"), "{log}");
    assert!(!log.contains("metrics on"), "{log}");
    let api = dir.path().join("api.sock");
    let (ok, out, err) = vgpuctl(&api, &["tenants"]);
    assert!(ok, "{err}");
    assert!(out.starts_with("TENANT"), "{out}");
    // The same API on TCP.
    let i = log.find("gRPC API on tcp://").expect("TCP address logged") + 18;
    let tcp = log[i..]
        .split_whitespace()
        .next()
        .expect("address")
        .to_owned();
    let out = Command::new(crate::vgpuctl_bin())
        .args(["--api-addr", &tcp, "--json", "tenants"])
        .output()
        .expect("run vgpuctl");
    assert!(out.status.success(), "{out:?}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(v["tenants"].as_array().map(Vec::len), Some(0));
    let (ok, out, err) = vgpuctl(&api, &["--json", "gpus"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    assert_eq!(v["gpus"].as_array().map(Vec::len), Some(0));
    assert_eq!(d.log().matches("NVML unavailable").count(), 1);
}

#[test]
fn bad_reporting_flags_are_refused_by_name() {
    let dir = tempfile::tempdir().expect("temporary directory");
    for (args, needle) in [
        (
            vec!["--metrics-addr", "no-such-host-at-all:x"],
            "no-such-host-at-all:x",
        ),
        (vec!["--api-addr", "300.1.1.1:80"], "300.1.1.1:80"),
        (vec!["--nvml-interval-ms", "99999999"], "99999999"),
    ] {
        let out = Command::new(crate::daemon_bin())
            .args(["--ebpf", "off", "--ebpf-pin-dir", "off"])
            .arg("--socket")
            .arg(dir.path().join("d.sock"))
            .arg("--api-socket")
            .arg(dir.path().join("a.sock"))
            .args(&args)
            .env("NO_COLOR", "1")
            .output()
            .expect("run vgpu-daemon");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} accepted");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}

/// A process under the shim registers with the daemon: it is attributed to its tenant
/// (memory, quota, measured GPU time, settings from its environment), and a process
/// beside it without the shim is the only bypass.
#[test]
fn shim_process_is_a_tenant_and_a_bare_one_a_bypass() {
    let node = SimNode::new(&format!(
        "[[device]]\nuuid = \"{UUID}\"\nmemory = \"8Gi\"\n"
    ));
    let dir = tempfile::tempdir().expect("temporary directory");
    let mut d = start(
        node.command(crate::daemon_bin()),
        dir.path(),
        &["--nvml-interval-ms", "100", "--metrics-addr", "127.0.0.1:0"],
    );
    let key = "default/infer-0/server";
    let c = Container::new("1Gi")
        .with(
            "VGPU_DAEMON_SOCKET",
            &dir.path().join("daemon.sock").display().to_string(),
        )
        .with("VGPU_TENANT", key)
        .with("VGPU_COMPUTE_SHARE", "40")
        .with("VGPU_COMPUTE_POLICY", "cap");
    // A second of 1 ms kernels, then hold the memory.
    let tenant = node.spawn_probe_in(
        Some(&c),
        &[
            "init", "alloc", "256Mi", "saturate", "1", "1000000", "0", "ready", "wait",
        ],
        Duration::from_secs(60),
    );
    let bare = node.spawn_probe(
        &["init", "alloc", "128Mi", "ready", "wait"],
        Duration::from_secs(30),
    );
    let api = dir.path().join("api.sock");
    let end = Instant::now() + Duration::from_secs(30);
    let gpus = loop {
        let (ok, out, err) = vgpuctl(&api, &["--json", "gpus"]);
        assert!(ok, "{err}");
        let v: serde_json::Value = serde_json::from_str(&out).expect("JSON");
        let procs = v["gpus"][0]["processes"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        if procs.len() == 2 {
            break v;
        }
        assert!(
            Instant::now() < end,
            "processes not both seen: {v:#}\n{}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let g = &gpus["gpus"][0];
    assert_eq!(
        g["bypass_pids"],
        serde_json::json!([bare.pid()]),
        "{gpus:#}"
    );
    let procs = g["processes"].as_array().expect("processes");
    let of = |pid: u32| {
        procs
            .iter()
            .find(|p| p["pid"] == pid)
            .unwrap_or_else(|| panic!("pid {pid} not in {gpus:#}"))
    };
    assert_eq!(of(tenant.pid())["tenant"], key);
    assert_eq!(of(tenant.pid())["bypass"], false);
    assert_eq!(of(bare.pid())["bypass"], true);

    let (ok, out, err) = vgpuctl(&api, &["--json", "tenant", key]);
    assert!(ok, "{err}\n{}", d.log());
    let t: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    assert_eq!(t["pids"], serde_json::json!([tenant.pid()]));
    let tg = &t["gpus"][0];
    assert_eq!(tg["uuid"], UUID);
    assert_eq!(tg["share_pct"], 40);
    assert_eq!(tg["policy"], "cap");
    assert_eq!(tg["source"], "shim");
    assert_eq!(tg["memory_quota_bytes"], 1u64 << 30);
    assert!(tg["gpu_time_ns"].as_u64().expect("gpu time") > 0, "{t:#}");
    assert!(tg["grants"].as_u64().expect("grants") > 0, "{t:#}");

    // The same, scraped.
    let log = d.wait_log("bypass:");
    let m = http_get(&metrics_addr(&log), "/metrics");
    let line = m
        .lines()
        .find(|l| l.starts_with("vgpu_tenant_gpu_time_seconds_total{") && l.contains(key))
        .unwrap_or_else(|| panic!("no GPU time of {key}:\n{m}"));
    let secs: f64 = line
        .rsplit(' ')
        .next()
        .and_then(|v| v.parse().ok())
        .expect("a number");
    assert!(secs > 0.0, "{line}");
    assert!(
        m.contains(&format!("vgpu_gpu_bypass_processes{{gpu=\"{UUID}\"}} 1\n")),
        "{m}"
    );
    tenant.kill9();
    bare.kill9();
}

/// The library validates the configuration; `main` maps the error to exit code 2 and
/// the message names the flag and the value.
#[test]
fn bad_daemon_flags_exit_2_naming_flag_and_value() {
    let dir = tempfile::tempdir().expect("temporary directory");
    for (args, needle) in [
        (vec!["--quantum-ms", "0.1"], "--quantum-ms 0.1"),
        (vec!["--default-share", "0"], "--default-share 0"),
        (vec!["--min-charge-pct", "0"], "--min-charge-pct 0"),
        (
            vec!["--queue-ahead-us", "99999999999"],
            "--queue-ahead-us 99999999999",
        ),
        (
            vec!["--max-queue-ahead-us", "99999999999"],
            "'99999999999' for '--max-queue-ahead-us",
        ),
        (vec!["--claim-timeout-ms", "0"], "\"0\" is not a timeout"),
        (
            vec!["--claim-timeout-ms", "soon"],
            "\"soon\" is not a timeout",
        ),
        (vec!["--gpu", "not-a-gpu"], "--gpu not-a-gpu"),
        (
            vec!["--trusted-quota-file", "relative/vgpu.conf"],
            "relative/vgpu.conf",
        ),
    ] {
        let out = Command::new(crate::daemon_bin())
            .args(["--ebpf", "off", "--ebpf-pin-dir", "off"])
            .arg("--socket")
            .arg(dir.path().join("d.sock"))
            .arg("--api-socket")
            .arg(dir.path().join("a.sock"))
            .args(["--metrics-addr", "off", "--nvml-interval-ms", "0"])
            .args(&args)
            .env("NO_COLOR", "1")
            .output()
            .expect("run vgpu-daemon");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert_eq!(err.matches(needle).count(), 1, "said once: {args:?}: {err}");
    }
}
