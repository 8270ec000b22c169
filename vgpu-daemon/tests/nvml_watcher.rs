//! The NVML watcher against cuda-sim's `libnvidia-ml.so.1`: real processes holding GPU
//! memory; the one no shim registered shows up as a bypass, the registered one is
//! attributed to its tenant, and a killed bypass disappears.
//!
//! The only test in this binary: it points this process's NVML at its own simulated node
//! through the environment (`VGPU_SIM_DIR`), before any thread of its own starts.

// `std::env::set_var` is unsafe (edition 2024); see the SAFETY comment below.
#![allow(unsafe_code)]

use super::common;

use std::time::{Duration, Instant};

use common::register;
use vgpu_core::sched_proto::ComputePolicy;
use vgpu_daemon::model::{Gpu, NodeSnapshot};
use vgpu_daemon::nvml::{WatcherConfig, spawn};
use vgpu_tests::{SimNode, sim_lib_dir};

const UUID: &str = "GPU-51570000-0000-4000-8000-00000000aaaa";

/// Polls the daemon's snapshot until `pred` holds for the GPU (at most `limit`: a bound
/// so that a broken watcher fails the test instead of hanging it, not a timing claim).
fn wait_for(
    d: &vgpu_daemon::daemon::Daemon,
    what: &str,
    limit: Duration,
    pred: impl Fn(&Gpu) -> bool,
) -> NodeSnapshot {
    let end = Instant::now() + limit;
    loop {
        let s = d.snapshot();
        if s.gpus.iter().any(|g| g.observed.uuid == UUID && pred(g)) {
            return s;
        }
        assert!(
            Instant::now() < end,
            "{what}: not seen within {limit:?}; last snapshot {s:#?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn watcher_flags_unregistered_processes_as_bypass() {
    let node = SimNode::new(&format!(
        "[[device]]\nuuid = \"{UUID}\"\nname = \"NVIDIA H100 80GB HBM3\"\nmemory = \"16Gi\"\n"
    ));
    // SAFETY: the only test of this binary and no thread of ours is running yet (the
    // probes' output readers start below); the test harness's threads do not read the
    // environment while a test runs.
    unsafe { std::env::set_var("VGPU_SIM_DIR", node.state_dir()) };
    let hold = ["init", "alloc", "256Mi", "ready", "wait"];
    let bypass = node.spawn_probe(&hold, Duration::from_secs(30));
    let tenant = node.spawn_probe(&hold, Duration::from_secs(30));

    let d = common::daemon();
    let _reg = register(
        &d,
        tenant.pid(),
        "default/infer-0/server",
        "default",
        "infer-0",
        "server",
        &[(UUID, 40, ComputePolicy::Burst, Some(1 << 30))],
    );
    let watcher = spawn(
        d.clone(),
        WatcherConfig {
            lib: sim_lib_dir().join("libnvidia-ml.so.1").into_os_string(),
            interval: Duration::from_millis(50),
            retry: Duration::from_millis(200),
            ..WatcherConfig::default()
        },
    )
    .expect("start the watcher");

    let s = wait_for(&d, "the bypass process", Duration::from_secs(30), |g| {
        g.bypass_pids == [bypass.pid()]
    });
    let g = s
        .gpus
        .iter()
        .find(|g| g.observed.uuid == UUID)
        .expect("the GPU");
    assert_eq!(g.observed.index, 0);
    assert_eq!(g.observed.name, "NVIDIA H100 80GB HBM3");
    assert_eq!(g.observed.memory_total, 16 << 30);
    assert!(g.observed.memory_used >= 512 << 20, "{:?}", g.observed);
    assert!(g.observed.observed_unix_ms > 0);
    let p = |pid: u32| {
        g.processes
            .iter()
            .find(|p| p.pid == pid)
            .unwrap_or_else(|| panic!("pid {pid} not among {:?}", g.processes))
    };
    assert!(p(bypass.pid()).used_bytes >= 256 << 20);
    assert_eq!(p(bypass.pid()).tenant, None);
    assert_eq!(
        p(tenant.pid()).tenant.as_deref(),
        Some("default/infer-0/server")
    );
    // The Prometheus view of the same reconciliation.
    let text = vgpu_daemon::metrics::render(&s);
    assert!(
        text.contains(&format!("vgpu_gpu_bypass_processes{{gpu=\"{UUID}\"}} 1\n")),
        "{text}"
    );

    // The bypass dies: NVML stops reporting it, and so does the daemon.
    let gone = bypass.pid();
    bypass.kill9();
    wait_for(&d, "the bypass's exit", Duration::from_secs(30), |g| {
        g.bypass_pids.is_empty() && !g.processes.iter().any(|p| p.pid == gone)
    });
    watcher.stop();
    tenant.kill9();
}
