//! `vgpu-smi` on a fresh simulated node, with a real CUDA process on it: what the driver
//! accounts and measures must show up through the unmodified NVML client.
//!
//! Needs the simulated driver (`cargo xtask sim`). The CUDA process is `cuda-probe`
//! when cargo built it next to this test (`cargo test --workspace`), otherwise a small
//! Python/ctypes program (`VGPU_SMI_TEST_PYTHON=1` forces that one).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use vgpu_tests::SimNode;

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

fn node() -> SimNode {
    SimNode::new(
        r#"
        [[device]]
        name = "NVIDIA H100 80GB HBM3"
        memory = "8Gi"
        context_overhead = "256Mi"
        alloc_granularity = "2Mi"
        [[device]]
        name = "NVIDIA A100-SXM4-40GB"
        memory = "4Gi"
        context_overhead = "256Mi"
        alloc_granularity = "2Mi"
        "#,
    )
}

/// A CUDA process on the node; killed (SIGKILL) and reaped when dropped.
struct Tenant {
    child: Child,
}

impl Drop for Tenant {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Tenant {
    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL now, and reap.
    fn kill9(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A Python/ctypes CUDA program: context on device 0, `argv[1]` bytes, then spin kernels.
const PY_TENANT: &str = r#"
import ctypes, os, sys
cu = ctypes.CDLL("libcuda.so.1")
def ok(rc, what):
    if rc != 0:
        sys.exit(f"{what} failed: CUresult {rc}")
ok(cu.cuInit(0), "cuInit")
dev = ctypes.c_int()
ok(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
ctx = ctypes.c_void_p()
ok(cu.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev), "cuCtxCreate_v2")
ptr = ctypes.c_uint64()
ok(cu.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(int(sys.argv[1]))), "cuMemAlloc_v2")
ptx = b".version 8.0\n.target sm_90\n.address_size 64\n.visible .entry vgpu_sim_spin(.param .u64 ns) { ret; }\n"
mod = ctypes.c_void_p()
ok(cu.cuModuleLoadData(ctypes.byref(mod), ctypes.c_char_p(ptx)), "cuModuleLoadData")
fn = ctypes.c_void_p()
ok(cu.cuModuleGetFunction(ctypes.byref(fn), mod, b"vgpu_sim_spin"), "cuModuleGetFunction")
print(f"ready pid={os.getpid()}", flush=True)
ns = ctypes.c_uint64(2_000_000)
params = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.byref(ns), ctypes.c_void_p))
u = ctypes.c_uint
while True:
    for _ in range(4):
        ok(cu.cuLaunchKernel(fn, u(1), u(1), u(1), u(1), u(1), u(1), u(0), None, params, None), "cuLaunchKernel")
    ok(cu.cuCtxSynchronize(), "cuCtxSynchronize")
"#;

/// `target/<profile>/cuda-probe`, if cargo built it with these tests.
fn probe_next_to_tests() -> Option<PathBuf> {
    if std::env::var_os("VGPU_SMI_TEST_PYTHON").is_some() {
        return None;
    }
    let exe = std::env::current_exe().ok()?;
    let bin = exe.parent()?.parent()?.join("cuda-probe");
    bin.exists().then_some(bin)
}

/// Starts a process that holds `bytes` on GPU 0 and keeps it busy; returns once it has.
fn start_tenant(node: &SimNode, bytes: u64) -> Tenant {
    let mut cmd = match probe_next_to_tests() {
        Some(probe) => {
            let mut c = node.command(probe);
            c.args(["init", "alloc", &bytes.to_string(), "ready"])
                .args(["saturate", "60", "2000000", "0"]);
            c
        }
        None => {
            let mut c = node.command("python3");
            c.args(["-c", PY_TENANT, &bytes.to_string()]);
            c
        }
    };
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start a CUDA process (cuda-probe, or python3 when cuda-probe is not built)");
    let stdout = child.stdout.take().expect("piped stdout");
    let tenant = Tenant { child };
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut seen = Vec::new();
    loop {
        match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(line) if line.starts_with("ready") => return tenant,
            Ok(line) => seen.push(line),
            Err(_) => panic!("the CUDA process did not become ready in 30 s; output {seen:?}"),
        }
    }
}

fn smi(node: &SimNode, args: &[&str]) -> Output {
    node.command(env!("CARGO_BIN_EXE_vgpu-smi"))
        .args(args)
        .output()
        .expect("run vgpu-smi")
}

fn smi_json(node: &SimNode) -> Value {
    let out = smi(node, &["--json"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "vgpu-smi --json failed ({}): {stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(stdout.trim()).expect("vgpu-smi --json prints one JSON object")
}

fn process(gpu: &Value, pid: u32) -> Option<&Value> {
    gpu["processes"]
        .as_array()
        .expect("a process list")
        .iter()
        .find(|p| p["pid"] == pid)
}

#[test]
fn a_cuda_process_its_memory_and_its_utilization_show_up() {
    let node = node();
    let tenant = start_tenant(&node, GIB);
    let pid = tenant.pid();
    // The process holds its context and its allocation, on GPU 0 only.
    let want = 256 * MIB + GIB;
    let v = smi_json(&node);
    let gpus = v["gpus"].as_array().expect("a GPU list");
    assert_eq!(gpus.len(), 2, "{v}");
    let p = process(&gpus[0], pid).unwrap_or_else(|| panic!("pid {pid} missing on GPU 0: {v}"));
    assert_eq!(p["memory_used"], want, "{v}");
    assert_eq!(gpus[0]["memory_used"], want, "{v}");
    assert_eq!(gpus[0]["memory_total"], 8 * GIB, "{v}");
    assert_eq!(gpus[0]["name"], "NVIDIA H100 80GB HBM3", "{v}");
    assert_eq!(gpus[1]["memory_used"], 0, "{v}");
    assert_eq!(
        gpus[1]["processes"].as_array().map(Vec::len),
        Some(0),
        "{v}"
    );

    // It keeps the GPU busy: once a full second has been measured, the device and the
    // process both read (nearly) fully busy.
    std::thread::sleep(Duration::from_millis(1500));
    let v = smi_json(&node);
    let util = v["gpus"][0]["utilization_pct"].as_u64().expect("a number");
    let sm = process(&v["gpus"][0], pid).expect("still there")["sm_pct"]
        .as_u64()
        .expect("a number");
    assert!(
        util >= 80,
        "GPU 0 utilization {util} % with one saturating process: {v}"
    );
    assert!(
        sm >= 80,
        "process SM share {sm} % while it saturates GPU 0: {v}"
    );
    assert_eq!(v["gpus"][1]["utilization_pct"], 0, "{v}");

    // The table shows the same.
    let out = smi(&node, &[]);
    assert!(out.status.success());
    let table = String::from_utf8_lossy(&out.stdout);
    let row = table
        .lines()
        .find(|l| l.split_whitespace().next() == Some(&pid.to_string()))
        .unwrap_or_else(|| panic!("no row for pid {pid}:\n{table}"));
    let shown = vgpu_smi::format_bytes(want);
    assert!(row.contains(&shown), "{row}");
    assert!(
        table.contains(&format!("memory {shown} / 8.0 GiB")),
        "{table}"
    );

    // Killed with SIGKILL, the process and its memory are gone within a second.
    tenant.kill9();
    let t0 = Instant::now();
    loop {
        let v = smi_json(&node);
        if process(&v["gpus"][0], pid).is_none() && v["gpus"][0]["memory_used"] == 0 {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(1),
            "a killed process still shows after 1 s: {v}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn watch_prints_count_views() {
    let node = node();
    let out = smi(&node, &["--json", "--watch", "0.1", "--count", "3"]);
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    let views: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).expect("each line is a JSON view"))
        .collect();
    assert_eq!(views.len(), 3, "{text}");
    assert!(
        views
            .iter()
            .all(|v| v["gpus"].as_array().map(Vec::len) == Some(2))
    );
}

#[test]
fn a_missing_nvml_is_a_clear_error_not_a_panic() {
    let node = node();
    let missing = Path::new("/nonexistent/libnvidia-ml.so.1");
    let out = smi(&node, &["--nvml-lib", &missing.to_string_lossy()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("nvmlInit_v2"), "{err}");
    assert!(err.contains("/nonexistent/libnvidia-ml.so.1"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn count_needs_watch() {
    let out = Command::new(env!("CARGO_BIN_EXE_vgpu-smi"))
        .args(["--count", "2"])
        .output()
        .expect("run vgpu-smi");
    assert!(!out.status.success());
}
