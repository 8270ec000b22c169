//! The simulated driver, tested as a node is used: real processes, one shared GPU.

use std::time::{Duration, Instant};

use vgpu_tests::{Probe, SimNode, num};

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

/// One 8 GiB device, 256 MiB per context, 2 MiB allocation granularity.
fn small_node() -> SimNode {
    SimNode::new(
        r#"
        [[device]]
        name = "NVIDIA A100-SXM4-40GB"
        memory = "8Gi"
        context_overhead = "256Mi"
        alloc_granularity = "2Mi"
        "#,
    )
}

#[test]
fn capacity_is_shared_across_processes_and_oom_is_exact() {
    let node = small_node();
    let a = node.spawn_probe(
        &["init", "alloc", "4Gi", "ready", "wait"],
        Duration::from_secs(20),
    );
    // B sees A's context and allocation, plus its own context.
    let out = node.probe(&["init", "meminfo"]);
    assert_eq!(num(&out, "total"), 8 * GIB);
    assert_eq!(
        num(&out, "free"),
        8 * GIB - 2 * 256 * MIB - 4 * GIB,
        "{out}"
    );
    // B takes exactly what is left, in 2 MiB steps, and then the next allocation fails.
    let out = node.probe(&["init", "alloc-until-oom", "2Mi", "meminfo", "alloc", "1"]);
    assert_eq!(num(&out, "allocated"), 8 * GIB - 2 * 256 * MIB - 4 * GIB);
    assert_eq!(num(&out, "code"), 2, "CUDA_ERROR_OUT_OF_MEMORY");
    assert_eq!(num(&out, "free"), 0);
    assert!(out.contains("alloc=err code=2"), "{out}");
    a.finish(Duration::from_secs(10));
    // With A gone, its memory is back.
    let out = node.probe(&["init", "meminfo"]);
    assert_eq!(num(&out, "free"), 8 * GIB - 256 * MIB);
}

#[test]
fn the_last_byte_fits_and_the_next_does_not() {
    let node = small_node();
    let free = 8 * GIB - 256 * MIB;
    let out = node.probe(&["init", "alloc", &free.to_string(), "meminfo", "alloc", "1"]);
    assert!(out.contains("alloc=ok"), "{out}");
    assert_eq!(num(&out, "free"), 0);
    assert!(out.contains("alloc=err code=2"), "{out}");
    let out = node.probe(&["init", "alloc", &(free + 1).to_string()]);
    assert!(
        out.contains("alloc=err code=2"),
        "one byte over the device: {out}"
    );
}

#[test]
fn sigkill_returns_memory_to_the_node() {
    let node = small_node();
    let a = node.spawn_probe(
        &["init", "alloc", "6Gi", "ready", "wait"],
        Duration::from_secs(20),
    );
    let out = node.probe(&["init", "meminfo"]);
    assert_eq!(num(&out, "free"), 8 * GIB - 2 * 256 * MIB - 6 * GIB);
    a.kill9();
    let t0 = Instant::now();
    loop {
        let out = node.probe(&["init", "meminfo"]);
        if num(&out, "free") == 8 * GIB - 256 * MIB {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(1),
            "memory of a killed process not back within 1 s: {out}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // And a process can now take what the killed one held.
    let out = node.probe(&["init", "alloc", "7Gi"]);
    assert!(out.contains("alloc=ok"), "{out}");
}

#[test]
fn data_round_trips_through_device_memory() {
    let node = small_node();
    let out = node.probe(&["init", "roundtrip", "64Mi", "roundtrip", "4097"]);
    assert_eq!(out.matches("roundtrip=ok").count(), 2, "{out}");
}

#[test]
fn nvml_agrees_with_the_driver() {
    let node = small_node();
    let a = node.spawn_probe(
        &["init", "alloc", "1Gi", "alloc", "3", "ready", "wait"],
        Duration::from_secs(20),
    );
    let pid = a.pid();
    let out = node.probe(&["init", "meminfo", "nvml"]);
    let driver_used = num(&out, "total") - num(&out, "free");
    assert_eq!(num(&out, "nvml_used"), driver_used, "{out}");
    assert_eq!(num(&out, "nvml_total"), 8 * GIB);
    // A holds its context, 1 GiB and one 2 MiB granule.
    let procs = vgpu_tests::field(&out, "procs").unwrap_or_default();
    let want = format!("{pid}:{}", 256 * MIB + GIB + 2 * MIB);
    assert!(
        procs.split(',').any(|p| p == want),
        "NVML processes {procs:?} lack {want}"
    );
    a.finish(Duration::from_secs(10));
}

#[test]
fn two_saturating_processes_each_get_half_the_gpu() {
    let node = small_node();
    let start = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock after 1970")
        .as_millis() as u64
        + 2000;
    let at = start.to_string();
    let spawn = || {
        node.command(vgpu_tests::probe_bin())
            .args(["init", "saturate", "5", "1000000", at.as_str()])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("spawn cuda-probe")
    };
    let (a, b) = (spawn(), spawn());
    let mut shares = Vec::new();
    for child in [a, b] {
        let out = child.wait_with_output().expect("wait for cuda-probe");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "{text}");
        shares.push(num(&text, "device_ns") as f64 / num(&text, "window_ns") as f64);
    }
    eprintln!("achieved shares of two saturating processes: {shares:?}");
    for s in &shares {
        assert!(
            (0.45..=0.55).contains(s),
            "each saturating process should get 50 ± 5 % of the GPU; got {shares:?}"
        );
    }
}

/// The GPU share in a `saturate` probe's output.
fn gpu_share(out: &str) -> f64 {
    num(out, "device_ns") as f64 / num(out, "window_ns") as f64
}

/// What one saturating process gets alone on this machine right now, then a process `A`
/// that saturates the GPU with kernels of `kernel_ns` (running 500 ms by the return).
fn alone_then_holder(node: &SimNode, kernel_ns: &str) -> (f64, Probe) {
    let alone = gpu_share(&node.probe(&["init", "saturate", "2", "1000000", "0"]));
    let a = node.spawn_probe(
        &["init", "ready", "saturate", "60", kernel_ns, "0"],
        Duration::from_secs(20),
    );
    std::thread::sleep(Duration::from_millis(500));
    (alone, a)
}

#[test]
fn a_stopped_process_holding_the_gpu_does_not_stall_the_others() {
    // A real GPU runs a stopped (or CPU-throttled) process's queued kernels and then the
    // other contexts'; the simulator's engine used to wait for the owner's worker thread
    // to hand it over, so a stopped owner stalled every other process.
    let node = small_node();
    // A saturates the GPU (4 kernels of 1 ms in flight), then is stopped.
    let (alone, a) = alone_then_holder(&node, "1000000");
    let stopped = std::process::Command::new("kill")
        .args(["-STOP", &a.pid().to_string()])
        .status()
        .is_ok_and(|s| s.success());
    assert!(stopped, "kill -STOP");
    // Bounded: a stalled engine would hold B for as long as A stays stopped.
    let mut b = node.spawn_probe(
        &["init", "ready", "saturate", "2", "1000000", "0"],
        Duration::from_secs(20),
    );
    let out = b.next_line(Duration::from_secs(20)).unwrap_or_default();
    let _ = std::process::Command::new("kill")
        .args(["-CONT", &a.pid().to_string()])
        .status();
    a.kill9();
    b.kill9();
    assert!(
        out.contains("device_ns="),
        "a process beside a stopped holder did not finish 2 s of work in 20 s: {out:?}"
    );
    let after = gpu_share(&out);
    eprintln!("GPU share alone {alone:.3}, beside a stopped holder {after:.3}");
    assert!(
        after >= 0.6 * alone,
        "GPU share beside a stopped holder: {after} vs {alone} alone ({out})"
    );
}

#[test]
fn a_process_killed_while_holding_the_gpu_does_not_stall_the_others() {
    let node = small_node();
    // A saturates the GPU with 5 ms kernels, so it holds the engine most of the time.
    let (alone, a) = alone_then_holder(&node, "5000000");
    a.kill9();
    // B then gets the GPU as if alone: the dead owner's turn is taken back within
    // milliseconds (a stalled engine would leave B next to nothing).
    let out = node.probe(&["init", "saturate", "2", "1000000", "0"]);
    let after = gpu_share(&out);
    eprintln!("GPU share alone {alone:.3}, after the holder was killed {after:.3}");
    assert!(
        after >= 0.6 * alone,
        "GPU share after the holder was killed: {after} vs {alone} alone ({out})"
    );
}

#[test]
fn a_stream_waiting_on_a_word_holds_its_work_and_not_the_gpu() {
    // Stream memory operations (`cuStreamWaitValue32`): work behind a wait does not run
    // before the word is written, and the waiting process leaves the engine to the others
    // meanwhile, as a real GPU runs other contexts.
    let node = small_node();
    let mut a = node.spawn_probe(
        &["init", "ready", "memop-block", "20000"],
        Duration::from_secs(20),
    );
    let blocked = a.next_line(Duration::from_secs(20)).unwrap_or_default();
    assert!(blocked.contains("blocked=ok"), "{blocked:?}");
    // B's 200 ms of kernels end while A still waits (A writes its word after 20 s: an
    // engine kept by the waiting process would hold B until then, and A would have
    // printed its release by the time B is done).
    let out = node.probe(&["init", "spin", "kernel", "200", "1000000"]);
    assert!(out.contains("spin=ok"), "{out}");
    let after = a.next_line(Duration::ZERO);
    a.kill9();
    assert_eq!(
        after, None,
        "the waiting process printed this before B's kernels ended: it kept the GPU until its word was written (or went on before)"
    );
    // A wait on a closed word holds in each of 20 trials, and the stream goes on once
    // the host writes the word (the probe fails if it does not within 2 s).
    let out = node.probe(&["init", "memop-gate", "200", "10000"]);
    assert!(out.contains("held=20/20"), "{out}");
}

/// Each thread of `pid` with its name and its group in the `cpu` hierarchy `ctl`.
fn threads_and_groups(
    ctl: &vgpu_tests::cpu_load::CpuController,
    pid: u32,
) -> Vec<(String, Option<std::path::PathBuf>)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(format!("/proc/{pid}/task"))
        .expect("read the probe's tasks")
        .flatten()
    {
        let comm = std::fs::read_to_string(e.path().join("comm")).unwrap_or_default();
        let cgroup = std::fs::read_to_string(e.path().join("cgroup")).unwrap_or_default();
        out.push((comm.trim().to_owned(), ctl.group_of(&cgroup)));
    }
    out
}

#[test]
fn the_simulated_gpu_does_not_run_in_its_processs_cpu_limit() {
    // ADR 0035: a real GPU runs the work queued to it whatever its tenant's CPU does; the
    // simulator's device is a worker thread of the process, which leaves the process's
    // CPU-limited group (cgroup v1) for the hierarchy's root when it starts.
    if let Some(why) = vgpu_tests::cpu_load::CpuLimited::unavailable() {
        return vgpu_test_needs::skip(vgpu_test_needs::Need::CgroupV1Cpu, &why);
    }
    let ctl = vgpu_tests::cpu_load::find_cpu_controller().expect("the cpu controller");
    let v1 = matches!(ctl, vgpu_tests::cpu_load::CpuController::V1(_));
    let node = small_node();
    let g = vgpu_tests::cpu_load::CpuLimited::new("vgpu-test-sim-device", 200).expect("cpu cgroup");
    let start = |mode: Option<&str>| {
        let mut cmd = g.command(&vgpu_tests::probe_bin());
        cmd.env("LD_LIBRARY_PATH", vgpu_tests::sim_lib_dir())
            .env("VGPU_SIM_DIR", node.state_dir());
        if let Some(m) = mode {
            cmd.env("VGPU_SIM_DEVICE_CPU", m);
        }
        Probe::start(
            cmd,
            &["init", "spin", "kernel", "1", "1000", "ready", "wait"],
            Duration::from_secs(20),
        )
    };
    // (the main thread's group, the worker's, every thread) once the worker has run
    // and, when `moved`, left the group, or after 10 s. A new thread is named (and
    // moves itself) when it first runs, which a throttled group may delay past the
    // probe's `ready`: the work was done on the device's clock without it.
    let look = |p: &Probe, moved: bool| {
        let t0 = Instant::now();
        loop {
            let threads = threads_and_groups(&ctl, p.pid());
            let of = |n: &str| {
                threads
                    .iter()
                    .find(|(name, _)| name == n)
                    .and_then(|(_, g)| g.clone())
            };
            let (main, worker) = (of("cuda-probe"), of("cuda-sim-gpu0"));
            let done = worker.is_some() && (!moved || worker != main);
            if done || t0.elapsed() > Duration::from_secs(10) {
                return (main, worker, threads);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    let p = start(None);
    let (main, worker, threads) = look(&p, v1);
    p.kill9();
    let main = main.unwrap_or_else(|| panic!("no main thread among {threads:?}"));
    let worker = worker.unwrap_or_else(|| panic!("no device worker among {threads:?}"));
    assert_eq!(
        main,
        g.path(),
        "the probe is not in the limited group: {threads:?}"
    );
    if v1 {
        assert_eq!(
            worker,
            ctl.root(),
            "the device worker stayed in its process's CPU limit: {threads:?}"
        );
    } else {
        // cgroup2 moves no single thread out of a domain group: it stays (ADR 0035).
        assert_eq!(worker, main, "{threads:?}");
    }
    // Kept in with `inherit` (the simulator before ADR 0035): the check above can fail.
    let p = start(Some("inherit"));
    let (main, worker, threads) = look(&p, false);
    p.kill9();
    assert!(worker.is_some(), "no device worker among {threads:?}");
    assert_eq!(worker, main, "{threads:?}");
}
