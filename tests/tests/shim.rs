//! libvgpu.so under real processes on the simulated node: every allocation path hits
//! the container's quota at exactly the first byte over it, through every route
//! (exported symbols, `dlsym`, `cuGetProcAddress`); racing processes never exceed it;
//! containers are isolated from each other; a killed process's memory comes back; the
//! container sees its own GPU; bad configuration is loud.

use std::io::{BufRead, BufReader};
use std::process::Command;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use vgpu_tests::{Container, SimNode, field, num, probe_bin, shim_lib};

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;
const OOM: u64 = 2; // CUDA_ERROR_OUT_OF_MEMORY

/// One 8 GiB device whose contexts cost 300 MiB (more than the smallest quota), in
/// 2 MiB granules.
fn node() -> SimNode {
    SimNode::new(
        r#"
        [[device]]
        memory = "8Gi"
        context_overhead = "300Mi"
        alloc_granularity = "2Mi"
        "#,
    )
}

fn run(node: &SimNode, c: &Container, args: &[&str]) -> std::process::Output {
    let mut cmd = node.command(probe_bin());
    c.apply(&mut cmd);
    cmd.args(args).output().expect("run cuda-probe")
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// For one API and route: fill the 256 MiB quota to 2 MiB short, then the first byte
/// over fails, exactly the rest fits, and one more byte fails.
fn first_byte_over_fails(node: &SimNode, api: &str, route: &str) {
    let c = Container::new("256Mi");
    let out = node.probe_in(
        Some(&c),
        &[
            "route",
            route,
            "init",
            "meminfo",
            "alloc-api",
            api,
            "254Mi",
            "alloc-api",
            api,
            "2097153",
            "alloc-api",
            api,
            "2Mi",
            "alloc-api",
            api,
            "1",
            "meminfo",
            "free-all",
            "meminfo",
        ],
    );
    let lines: Vec<&str> = out.lines().collect();
    let allocs: Vec<&str> = lines
        .iter()
        .copied()
        .filter(|l| l.starts_with("alloc="))
        .collect();
    assert_eq!(allocs.len(), 4, "{api}/{route}: {out}");
    assert!(allocs[0].starts_with("alloc=ok"), "{api}/{route}: {out}");
    assert_eq!(
        allocs[1],
        format!("alloc=err code={OOM}"),
        "{api}/{route}: {out}"
    );
    assert!(allocs[2].starts_with("alloc=ok"), "{api}/{route}: {out}");
    assert_eq!(
        allocs[3],
        format!("alloc=err code={OOM}"),
        "{api}/{route}: {out}"
    );
    let infos: Vec<&str> = lines
        .iter()
        .copied()
        .filter(|l| l.starts_with("free="))
        .collect();
    assert_eq!(
        infos,
        [
            "free=268435456 total=268435456",
            "free=0 total=268435456",
            "free=268435456 total=268435456"
        ],
        "{api}/{route}: {out}"
    );
}

const APIS: &[&str] = &[
    "mem", "pitch", "managed", "async", "pool", "vmm", "array", "array3d", "mipmap",
];

#[test]
fn every_allocation_path_fails_at_the_first_byte_over_the_quota() {
    let node = node();
    for api in APIS {
        first_byte_over_fails(&node, api, "dlsym");
    }
}

#[test]
fn exported_symbols_and_cu_get_proc_address_are_enforced_like_dlsym() {
    let node = node();
    for route in ["global", "procaddr", "procaddr-ptds"] {
        for api in APIS {
            first_byte_over_fails(&node, api, route);
        }
    }
}

#[test]
fn a_256_mib_quota_works_and_is_what_the_container_sees() {
    let node = node();
    let c = Container::new("256Mi");
    let out = node.probe_in(
        Some(&c),
        &[
            "init",
            "meminfo",
            "totalmem",
            "nvml",
            "roundtrip",
            "4Mi",
            "meminfo",
            "nvml",
        ],
    );
    assert!(out.contains("free=268435456 total=268435456"), "{out}");
    assert_eq!(num(&out, "totalmem"), 256 * MIB, "{out}");
    assert!(out.contains("roundtrip=ok"), "{out}");
    assert!(out.contains("free=264241152 total=268435456"), "{out}");
    // NVML: the quota as the GPU's size, the container's allocations as used.
    assert_eq!(num(&out, "nvml_total"), 256 * MIB, "{out}");
    assert_eq!(num(&out, "nvml_used"), 4 * MIB, "{out}");
    assert_eq!(num(&out, "nvml_free"), 252 * MIB, "{out}");
}

#[test]
fn racing_processes_of_one_container_never_exceed_the_quota() {
    let node = node();
    let c = Container::new("1Gi");
    let at = (now_ms() + 2500).to_string();
    let args = [
        "init",
        "at",
        at.as_str(),
        "until-oom",
        "mem",
        "2Mi",
        "ready",
        "wait",
    ];
    let procs: Vec<_> = (0..6)
        .map(|_| {
            let mut cmd = node.command(probe_bin());
            c.apply(&mut cmd);
            cmd.args(args)
                .stdin(std::process::Stdio::piped())
                .stdout(std::process::Stdio::piped())
                .spawn()
                .expect("spawn cuda-probe")
        })
        .collect();
    // Every process holds what it got (it blocks in `wait`) until all have raced.
    let mut readers = Vec::new();
    let mut children = Vec::new();
    for mut p in procs {
        let stdout = p.stdout.take().expect("piped stdout");
        let mut r = BufReader::new(stdout);
        let mut text = String::new();
        loop {
            let mut line = String::new();
            if r.read_line(&mut line).expect("read probe output") == 0 {
                panic!("cuda-probe ended before `ready`: {text}");
            }
            text.push_str(&line);
            if line.starts_with("ready") {
                break;
            }
        }
        readers.push(text);
        children.push(p);
    }
    for mut p in children {
        drop(p.stdin.take());
        assert!(p.wait().expect("wait for cuda-probe").success());
    }
    let mut total = 0;
    for s in &readers {
        assert_eq!(num(s, "code"), OOM, "{s}");
        total += num(s, "allocated");
    }
    let outs = readers;
    assert_eq!(total, GIB, "the container's processes together: {outs:?}");
}

#[test]
fn two_containers_on_one_gpu_each_get_their_own_quota() {
    let node = node();
    let a = Container::new("1Gi");
    let b = Container::new("512Mi");
    let pa = node.spawn_probe_in(
        Some(&a),
        &[
            "init",
            "until-oom",
            "mem",
            "2Mi",
            "meminfo",
            "ready",
            "wait",
        ],
        Duration::from_secs(30),
    );
    let out = node.probe_in(
        Some(&b),
        &["init", "until-oom", "mem", "2Mi", "meminfo", "nvml"],
    );
    assert_eq!(num(&out, "allocated"), 512 * MIB, "{out}");
    assert!(out.contains("free=0 total=536870912"), "{out}");
    // B's NVML process list shows only B's processes.
    let procs = field(&out, "procs").unwrap_or_default();
    assert!(
        !procs.contains(&format!("{}:", pa.pid())),
        "container A's process is visible in B: {out}"
    );
    assert_eq!(
        procs.split(',').filter(|p| !p.is_empty()).count(),
        1,
        "{out}"
    );
    let seen = pa.finish(Duration::from_secs(10)).join("\n");
    assert_eq!(num(&seen, "allocated"), GIB, "{seen}");
    assert!(seen.contains("free=0 total=1073741824"), "{seen}");
}

#[test]
fn a_killed_process_gives_its_memory_back_within_a_second() {
    let node = node();
    let c = Container::new("512Mi");
    let p = node.spawn_probe_in(
        Some(&c),
        &["init", "alloc", "512Mi", "ready", "wait"],
        Duration::from_secs(30),
    );
    assert!(
        p.seen.iter().any(|l| l.starts_with("alloc=ok")),
        "{:?}",
        p.seen
    );
    // A second process starts while the first still holds everything.
    let q = node.spawn_probe_in(
        Some(&c),
        &["init", "ready", "wait", "alloc", "512Mi", "meminfo"],
        Duration::from_secs(30),
    );
    let killed = Instant::now();
    p.kill9();
    let out = q.finish(Duration::from_secs(10)).join("\n");
    let took = killed.elapsed();
    assert!(out.contains("alloc=ok"), "{out}");
    assert!(out.contains("free=0 total=536870912"), "{out}");
    assert!(took < Duration::from_secs(1), "took {took:?}");
}

#[test]
fn bad_configuration_is_rejected_loudly_by_name_and_value() {
    let node = node();
    for (k, v) in [
        ("VGPU_MEMORY_LIMIT", "8G"),
        ("VGPU_MEMORY_LIMIT_0", "lots"),
        ("VGPU_MEMORY_LIMIT_x", "1Gi"),
        ("VGPU_ON_ERROR", "ignore"),
        ("VGPU_CONTAINER_DIR", "relative"),
    ] {
        let mut c = Container::new("1Gi");
        c.env.push((k.to_owned(), v.to_owned()));
        let out = run(&node, &c, &["init"]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{k}={v} was accepted");
        assert!(err.contains(&format!("{k}={v:?}")), "{k}={v}: {err}");
        assert!(err.contains("cuInit failed with CUresult 800"), "{err}");
    }
    // The unenforced policy runs, but says so.
    let mut c = Container::new("8G");
    c.env.push(("VGPU_ON_ERROR".into(), "unenforced".into()));
    let out = run(&node, &c, &["init", "alloc", "1Gi"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("WITHOUT GPU memory isolation"), "{err}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("alloc=ok"));
}

#[test]
fn a_missing_real_driver_is_reported() {
    let node = node();
    let c = Container::new("1Gi").with("VGPU_REAL_LIBCUDA", "/nonexistent/libcuda.so.1");
    let out = run(&node, &c, &["init"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("cannot load /nonexistent/libcuda.so.1"),
        "{err}"
    );
}

#[test]
fn per_device_limits_override_the_global_one() {
    let node = SimNode::new(
        r#"
        [[device]]
        memory = "4Gi"
        [[device]]
        memory = "4Gi"
        "#,
    );
    let c = Container::new("1Gi").with("VGPU_MEMORY_LIMIT_1", "512Mi");
    let out = node.probe_in(Some(&c), &["device", "1", "init", "meminfo", "totalmem"]);
    assert!(out.contains("total=536870912"), "{out}");
    assert_eq!(num(&out, "totalmem"), 512 * MIB);
    let out = node.probe_in(Some(&c), &["init", "meminfo"]);
    assert!(out.contains("total=1073741824"), "{out}");
}

#[test]
fn without_the_shim_nothing_changes() {
    // Sanity check of the test itself: the same probe without LD_PRELOAD sees 8 GiB.
    let node = node();
    let out = node.probe(&["init", "totalmem"]);
    assert_eq!(num(&out, "totalmem"), 8 * GIB);
    assert!(shim_lib().exists());
}

/// Runs a Python snippet inside `c`, or returns None if the module is not installed.
fn python(node: &SimNode, c: &Container, module: &'static str, code: &str) -> Option<String> {
    let ok = Command::new("python3")
        .args(["-c", &format!("import {module}")])
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        let why = "`python3 -c 'import …'` failed";
        vgpu_test_needs::skip(vgpu_test_needs::Need::Python(module), why);
        return None;
    }
    let mut cmd = node.command("python3");
    c.apply(&mut cmd);
    let out = cmd.args(["-c", code]).output().expect("run python3");
    let s = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "python failed:\n{s}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(s)
}

#[test]
fn cuda_python_is_enforced_through_cu_get_proc_address() {
    let node = node();
    let c = Container::new("256Mi");
    let code = r#"
from cuda.bindings import driver as d
def ok(r):
    assert r[0] == d.CUresult.CUDA_SUCCESS, r
    return r[1:] if len(r) > 2 else (r[1] if len(r) == 2 else None)
ok(d.cuInit(0))
dev = ok(d.cuDeviceGet(0))
ctx = ok(d.cuDevicePrimaryCtxRetain(dev))
ok(d.cuCtxSetCurrent(ctx))
free, total = ok(d.cuMemGetInfo())
print(f"free={free} total={total}")
print(f"totalmem={ok(d.cuDeviceTotalMem(dev))}")
p = ok(d.cuMemAlloc(254 << 20))
r = d.cuMemAlloc((2 << 20) + 1)
print(f"over={int(r[0])}")
q = ok(d.cuMemAlloc(2 << 20))
r = d.cuMemAllocManaged(1, 1)
print(f"over2={int(r[0])}")
ok(d.cuMemFree(q))
pool = ok(d.cuDeviceGetDefaultMemPool(dev))
r = d.cuMemAllocFromPoolAsync(4 << 20, pool, 0)
print(f"pool_over={int(r[0])}")
a = ok(d.cuMemAllocAsync(2 << 20, 0))
free, total = ok(d.cuMemGetInfo())
print(f"after free={free}")
"#;
    let Some(out) = python(&node, &c, "cuda.bindings.driver", code) else {
        return;
    };
    assert!(out.contains("free=268435456 total=268435456"), "{out}");
    assert_eq!(num(&out, "totalmem"), 256 * MIB, "{out}");
    assert_eq!(num(&out, "over"), OOM, "{out}");
    assert_eq!(num(&out, "over2"), OOM, "{out}");
    assert_eq!(num(&out, "pool_over"), OOM, "{out}");
    assert!(out.contains("after free=0"), "{out}");
}

#[test]
fn nvidia_ml_py_sees_the_quota_and_only_the_container() {
    let node = node();
    let c = Container::new("768Mi");
    let other = Container::new("2Gi");
    let o = node.spawn_probe_in(
        Some(&other),
        &["init", "alloc", "1Gi", "ready", "wait"],
        Duration::from_secs(30),
    );
    let p = node.spawn_probe_in(
        Some(&c),
        &["init", "alloc", "100Mi", "ready", "wait"],
        Duration::from_secs(30),
    );
    let code = r#"
import pynvml as n
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
m = n.nvmlDeviceGetMemoryInfo(h)
print(f"total={m.total} used={m.used} free={m.free}")
m2 = n.nvmlDeviceGetMemoryInfo(h, version=n.nvmlMemory_v2)
print(f"total2={m2.total} used2={m2.used}")
print("pids=" + ",".join(str(p.pid) for p in n.nvmlDeviceGetComputeRunningProcesses(h)))
"#;
    let out = python(&node, &c, "pynvml", code);
    let pid = p.pid();
    o.finish(Duration::from_secs(10));
    p.finish(Duration::from_secs(10));
    let Some(out) = out else { return };
    assert_eq!(num(&out, "total"), 768 * MIB, "{out}");
    assert_eq!(num(&out, "used"), 100 * MIB, "{out}");
    assert_eq!(num(&out, "free"), 668 * MIB, "{out}");
    assert_eq!(num(&out, "total2"), 768 * MIB, "{out}");
    assert_eq!(num(&out, "used2"), 100 * MIB, "{out}");
    assert_eq!(field(&out, "pids"), Some(pid.to_string()), "{out}");
}

#[test]
fn memory_of_a_destroyed_context_goes_back_to_the_quota() {
    let node = node();
    let c = Container::new("256Mi");
    let out = node.probe_in(
        Some(&c),
        &[
            "init",
            "ctx-create",
            "alloc-api",
            "mem",
            "200Mi",
            "alloc-api",
            "vmm",
            "20Mi",
            "alloc-api",
            "array",
            "30Mi",
            "meminfo",
            "ctx-destroy",
            "meminfo",
            "alloc",
            "200Mi",
            "meminfo",
            "primary-release",
            "init",
            "meminfo",
        ],
    );
    let infos: Vec<&str> = out.lines().filter(|l| l.starts_with("free=")).collect();
    // Device memory goes with its context; VMM allocations and arrays stay charged
    // until released (as the simulated driver keeps them).
    assert_eq!(
        infos,
        [
            "free=6291456 total=268435456",
            "free=216006656 total=268435456",
            "free=6291456 total=268435456",
            "free=216006656 total=268435456",
        ],
        "{out}"
    );
}

#[test]
fn gpustat_shows_the_container_its_own_gpu() {
    let node = node();
    let c = Container::new("768Mi");
    let other = Container::new("2Gi");
    let o = node.spawn_probe_in(
        Some(&other),
        &["init", "alloc", "1Gi", "ready", "wait"],
        Duration::from_secs(30),
    );
    let p = node.spawn_probe_in(
        Some(&c),
        &["init", "alloc", "100Mi", "ready", "wait"],
        Duration::from_secs(30),
    );
    let code = r#"
import json, subprocess, sys
out = subprocess.run([sys.executable, "-m", "gpustat", "--json"], check=True, capture_output=True, text=True).stdout
g = json.loads(out)["gpus"][0]
print(f"total={g['memory.total']} used={g['memory.used']}")
print("procs=" + ",".join(f"{p['pid']}:{p['gpu_memory_usage']}" for p in g["processes"]))
"#;
    let out = python(&node, &c, "gpustat", code);
    let pid = p.pid();
    o.finish(Duration::from_secs(10));
    p.finish(Duration::from_secs(10));
    let Some(out) = out else { return };
    // gpustat reports MiB.
    assert_eq!(num(&out, "total"), 768, "{out}");
    assert_eq!(num(&out, "used"), 100, "{out}");
    assert_eq!(field(&out, "procs"), Some(format!("{pid}:100")), "{out}");
}

#[test]
fn cu_get_proc_address_returns_the_hook_of_the_exact_variant() {
    let node = node();
    let c = Container::new("1Gi");
    let out = node.probe_in(
        Some(&c),
        &[
            "init",
            "procaddr",
            "cuMemAllocAsync",
            "13000",
            "0",
            "symaddr",
            "cuMemAllocAsync",
            "procaddr",
            "cuMemAllocAsync",
            "13000",
            "2",
            "symaddr",
            "cuMemAllocAsync_ptsz",
            "procaddr",
            "cuCtxCreate",
            "12050",
            "0",
            "symaddr",
            "cuCtxCreate_v4",
            "procaddr",
            "cuCtxCreate",
            "11040",
            "0",
            "symaddr",
            "cuCtxCreate_v3",
            "procaddr",
            "cuMemAlloc",
            "2000",
            "0",
            "procaddr",
            "cuMemAllocAsync",
            "11000",
            "0",
        ],
    );
    // The n-th value of `key` in the output.
    let nth = |key: &str, n: usize| -> String {
        out.split_whitespace()
            .filter_map(|kv| kv.split_once('='))
            .filter(|(k, _)| *k == key)
            .nth(n)
            .map(|(_, v)| v.to_owned())
            .unwrap_or_else(|| panic!("no {key} #{n} in {out}"))
    };
    // The driver's choice of ABI and per-thread variant, mapped to the matching hook
    // (the global scope finds the shim's export of that exact name).
    let lookups = [
        ("procaddr_cuMemAllocAsync", 0, "symaddr_cuMemAllocAsync"),
        (
            "procaddr_cuMemAllocAsync",
            1,
            "symaddr_cuMemAllocAsync_ptsz",
        ),
        ("procaddr_cuCtxCreate", 0, "symaddr_cuCtxCreate_v4"),
        ("procaddr_cuCtxCreate", 1, "symaddr_cuCtxCreate_v3"),
    ];
    for (got, n, want) in lookups {
        assert_eq!(nth(got, n), nth(want, 0), "{got} #{n}: {out}");
        assert_ne!(nth(want, 0), "0x0", "{out}");
    }
    assert_ne!(
        nth("symaddr_cuMemAllocAsync", 0),
        nth("symaddr_cuMemAllocAsync_ptsz", 0)
    );
    let lines: Vec<&str> = out.lines().collect();
    // What the driver does not resolve stays unresolved: never a hook of another ABI.
    assert!(
        out.contains("procaddr_cuMemAlloc=0x0 code=500 status=1"),
        "{out}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("procaddr_cuMemAllocAsync=0x0 code=500 status=2")),
        "{out}"
    );
}

#[test]
fn nvml_process_utilization_lists_only_the_container() {
    let node = node();
    let c = Container::new("1Gi");
    let other = Container::new("1Gi");
    let args = ["init", "ready", "saturate", "5", "2000000", "0"];
    let a = node.spawn_probe_in(Some(&c), &args, Duration::from_secs(30));
    let b = node.spawn_probe_in(Some(&other), &args, Duration::from_secs(30));
    // Polls until the container's own process shows up (both are busy all along).
    let code = format!(
        r#"
import time, pynvml as n
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
seen = set()
deadline = time.time() + 4
while time.time() < deadline and {pid} not in seen:
    try:
        seen |= {{s.pid for s in n.nvmlDeviceGetProcessUtilization(h, 0)}}
    except n.NVMLError_NotFound:
        pass
    time.sleep(0.1)
print("pids=" + ",".join(str(p) for p in sorted(seen)))
"#,
        pid = a.pid()
    );
    let out = python(&node, &c, "pynvml", &code);
    let pid = a.pid();
    a.finish(Duration::from_secs(20));
    b.finish(Duration::from_secs(20));
    let Some(out) = out else { return };
    assert_eq!(field(&out, "pids"), Some(pid.to_string()), "{out}");
}

#[test]
fn programs_that_never_use_cuda_are_untouched() {
    let c = Container::new("8G"); // invalid, but never read: no CUDA call is made
    let mut cmd = Command::new("sh");
    c.apply(&mut cmd);
    let out = cmd
        .args(["-c", "echo hello"])
        .output()
        .expect("run sh under the shim");
    assert!(out.status.success());
    assert_eq!(String::from_utf8_lossy(&out.stdout), "hello\n");
    assert!(
        out.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !c.dir().exists(),
        "the shim created its region without any CUDA call"
    );
}

#[test]
fn refusals_are_logged_only_when_asked() {
    let node = node();
    let quiet = Container::new("64Mi");
    let out = run(&node, &quiet, &["init", "alloc", "128Mi"]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("alloc=err code=2"));
    assert!(
        out.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let loud = Container::new("64Mi").with("VGPU_LOG", "1");
    let out = run(&node, &loud, &["init", "alloc", "128Mi"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("device 0: 134217728 bytes refused (out of memory): the container uses 0 bytes of a quota of 67108864"),
        "{err}"
    );
}
