//! The driver's checkpoint API on the simulated node, as a node daemon uses it: one
//! process locks another by pid, moves its device memory to host memory and back, and
//! unlocks it; a third process watches the device (issue 43, ADR 0066).

use std::time::Duration;

use vgpu_tests::{Container, Probe, SimNode, field, num};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
/// `CUDA_SUCCESS`, `CUDA_ERROR_OUT_OF_MEMORY`, `CUDA_ERROR_ILLEGAL_STATE`,
/// `CUDA_ERROR_NOT_READY`, `CUDA_ERROR_NOT_SUPPORTED`.
const OK: u64 = 0;
const OOM: u64 = 2;
const ILLEGAL_STATE: u64 = 401;
const NOT_READY: u64 = 600;
const NOT_SUPPORTED: u64 = 801;
/// `CUprocessState`.
const RUNNING: u64 = 0;
const LOCKED: u64 = 1;
const CHECKPOINTED: u64 = 2;

/// Host link of the checkpoint copies in these tests, GB/s.
const COPY_GBPS: u64 = 2;

/// One 8 GiB device, 256 MiB per context, 2 MiB granularity; checkpoints over a 2 GB/s
/// host link into `host_memory` of host memory.
fn node(host_memory: &str) -> SimNode {
    SimNode::new(&format!(
        r#"
        [[device]]
        name = "NVIDIA A100-SXM4-40GB"
        memory = "8Gi"
        context_overhead = "256Mi"
        alloc_granularity = "2Mi"
        [host]
        memory = "{host_memory}"
        copy_gbps = {COPY_GBPS}
        "#
    ))
}

/// A tenant holding `fills` (bytes, seed) in device memory, waiting for its stdin to
/// close, then running `after`.
fn tenant(node: &SimNode, fills: &[(u64, u64)], after: &[&str]) -> Probe {
    let mut args: Vec<String> = vec!["init".into()];
    for (bytes, seed) in fills {
        args.extend(["fill".into(), bytes.to_string(), seed.to_string()]);
    }
    args.extend(["ready".into(), "wait".into()]);
    args.extend(after.iter().map(|s| s.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    node.spawn_probe(&args, Duration::from_secs(60))
}

/// Runs `ops` (`lock`, `checkpoint`, ...) on `pid` from a controller process; returns its
/// output.
fn control(node: &SimNode, pid: u32, ops: &[&str]) -> String {
    let pid = pid.to_string();
    let mut args = vec!["init"];
    for op in ops {
        args.extend(["ckpt", op, &pid]);
        if *op == "lock" {
            args.push("0");
        }
    }
    node.probe(&args)
}

/// The CUresult of the `n`th `op` in a controller's output.
fn code(out: &str, op: &str, n: usize) -> u64 {
    let key = format!("ckpt_{op}=");
    let line = out
        .lines()
        .filter(|l| l.starts_with(&key))
        .nth(n)
        .unwrap_or_else(|| panic!("no {key} number {n} in {out}"));
    num(line, &format!("ckpt_{op}"))
}

fn us_of(out: &str, op: &str) -> u64 {
    let key = format!("ckpt_{op}=");
    let line = out
        .lines()
        .find(|l| l.starts_with(&key))
        .unwrap_or_else(|| panic!("no {key} in {out}"));
    num(line, "us")
}

fn state_of(node: &SimNode, pid: u32) -> u64 {
    let out = control(node, pid, &["state"]);
    assert_eq!(code(&out, "state", 0), OK, "{out}");
    num(&out, "state")
}

#[test]
fn checkpoint_frees_the_device_and_restore_brings_every_byte_back() {
    let node = node("64Gi");
    let data = 256 * MIB;
    let t = tenant(&node, &[(data, 7), (3 * MIB, 8)], &["verify"]);
    let pid = t.pid();
    // A third process sees the tenant's context and memory (and its own context).
    let held = 256 * MIB + data + 4 * MIB;
    let before = node.probe(&["init", "meminfo"]);
    assert_eq!(num(&before, "free"), 8 * GIB - 256 * MIB - held, "{before}");

    // Out of order, as the driver refuses it: nothing to checkpoint or unlock while
    // RUNNING.
    let out = control(&node, pid, &["checkpoint", "unlock", "restore", "state"]);
    assert_eq!(code(&out, "checkpoint", 0), ILLEGAL_STATE, "{out}");
    assert_eq!(code(&out, "unlock", 0), ILLEGAL_STATE, "{out}");
    assert_eq!(code(&out, "restore", 0), ILLEGAL_STATE, "{out}");
    assert_eq!(num(&out, "state"), RUNNING, "{out}");

    let out = control(&node, pid, &["lock", "lock", "restore", "checkpoint"]);
    assert_eq!(code(&out, "lock", 0), OK, "{out}");
    assert_eq!(code(&out, "lock", 1), ILLEGAL_STATE, "locked twice: {out}");
    assert_eq!(code(&out, "restore", 0), ILLEGAL_STATE, "{out}");
    assert_eq!(code(&out, "checkpoint", 0), OK, "{out}");
    let checkpoint_us = us_of(&out, "checkpoint");
    assert_eq!(state_of(&node, pid), CHECKPOINTED);

    // The device has the memory back: cuMemGetInfo and NVML of a third process.
    let view = node.probe(&["init", "meminfo", "nvml"]);
    assert_eq!(num(&view, "free"), 8 * GIB - 256 * MIB, "{view}");
    assert_eq!(
        num(&view, "nvml_used"),
        256 * MIB,
        "only the viewer's context: {view}"
    );

    let out = control(
        &node,
        pid,
        &["unlock", "restore", "state", "unlock", "state"],
    );
    assert_eq!(
        code(&out, "unlock", 0),
        ILLEGAL_STATE,
        "unlock before restore: {out}"
    );
    assert_eq!(code(&out, "restore", 0), OK, "{out}");
    assert_eq!(code(&out, "state", 0), OK, "{out}");
    let states: Vec<u64> = out
        .lines()
        .filter_map(|l| field(l, "state"))
        .map(|s| s.parse().expect("a state number"))
        .collect();
    assert_eq!(
        states,
        [LOCKED, RUNNING],
        "restored is LOCKED until unlocked: {out}"
    );
    assert_eq!(code(&out, "unlock", 1), OK, "{out}");
    let restore_us = us_of(&out, "restore");
    let after = node.probe(&["init", "meminfo"]);
    assert_eq!(num(&after, "free"), num(&before, "free"), "{after}");

    // The tenant reads its data back, byte for byte.
    let lines = t.finish(Duration::from_secs(30));
    assert!(lines.iter().any(|l| l == "verify=ok"), "{lines:?}");

    // Copies take what the host link allows: 259 MiB (the mapped bytes of both
    // allocations) at 2 GB/s.
    let moved = data + 3 * MIB;
    let model_us = moved * 1_000_000 / (COPY_GBPS * 1_000_000_000);
    eprintln!(
        "checkpoint of {moved} B: {checkpoint_us} us, restore {restore_us} us, modelled {model_us} us"
    );
    for (what, us) in [("checkpoint", checkpoint_us), ("restore", restore_us)] {
        assert!(
            us >= model_us,
            "{what} took {us} us, under the modelled {model_us} us"
        );
        assert!(
            us < model_us + 2_000_000,
            "{what} took {us} us, far over the modelled {model_us} us"
        );
    }
}

#[test]
fn a_call_of_a_checkpointed_tenant_waits_for_the_unlock_then_succeeds() {
    let node = node("64Gi");
    let mut t = tenant(&node, &[(64 * MIB, 3)], &["timed-meminfo", "verify"]);
    let pid = t.pid();
    let out = control(&node, pid, &["lock", "checkpoint"]);
    assert_eq!(code(&out, "checkpoint", 0), OK, "{out}");
    // The tenant makes a call now: it waits at the gate.
    drop(t.child.stdin.take());
    assert_eq!(
        t.next_line(Duration::from_millis(700)),
        None,
        "a call of a checkpointed process returned"
    );
    let out = control(&node, pid, &["restore", "unlock"]);
    assert_eq!(code(&out, "restore", 0), OK, "{out}");
    assert_eq!(code(&out, "unlock", 0), OK, "{out}");
    let lines = t.finish(Duration::from_secs(30));
    let call = lines
        .iter()
        .find(|l| l.starts_with("free="))
        .unwrap_or_else(|| panic!("no meminfo after the unlock: {lines:?}"));
    assert!(
        num(call, "call_us") >= 700_000,
        "the call did not wait: {call}"
    );
    // Its context and memory are charged again (the controller's context may not be
    // reaped yet), and the data is intact.
    assert!(
        num(call, "free") <= 8 * GIB - 256 * MIB - 64 * MIB,
        "{call}"
    );
    assert!(lines.iter().any(|l| l == "verify=ok"), "{lines:?}");
}

#[test]
fn restore_without_the_memory_fails_cleanly_and_succeeds_once_it_is_back() {
    let node = node("64Gi");
    let t = tenant(&node, &[(512 * MIB, 11)], &["verify"]);
    let pid = t.pid();
    let out = control(&node, pid, &["lock", "checkpoint"]);
    assert_eq!(code(&out, "checkpoint", 0), OK, "{out}");
    // A neighbour takes most of what the checkpoint freed: 8 GiB less its context,
    // the controller's context and 512 MiB; the tenant needs 768 MiB back.
    let hog = node.spawn_probe(
        &["init", "alloc", "7Gi", "ready", "wait"],
        Duration::from_secs(30),
    );
    let out = control(&node, pid, &["restore", "state"]);
    assert_eq!(code(&out, "restore", 0), OOM, "{out}");
    assert_eq!(
        num(&out, "state"),
        CHECKPOINTED,
        "a failed restore changes nothing: {out}"
    );
    hog.finish(Duration::from_secs(10));
    let out = control(&node, pid, &["restore", "unlock"]);
    assert_eq!(code(&out, "restore", 0), OK, "{out}");
    assert_eq!(code(&out, "unlock", 0), OK, "{out}");
    let lines = t.finish(Duration::from_secs(30));
    assert!(lines.iter().any(|l| l == "verify=ok"), "{lines:?}");
}

#[test]
fn host_memory_is_bounded_and_a_refused_checkpoint_leaves_the_tenant_locked() {
    let node = node("128Mi");
    let t = tenant(&node, &[(256 * MIB, 5)], &["verify"]);
    let pid = t.pid();
    let out = control(&node, pid, &["lock", "checkpoint", "state", "unlock"]);
    assert_eq!(
        code(&out, "checkpoint", 0),
        OOM,
        "256 MiB into 128 MiB: {out}"
    );
    assert_eq!(num(&out, "state"), LOCKED, "{out}");
    assert_eq!(code(&out, "unlock", 0), OK, "{out}");
    let lines = t.finish(Duration::from_secs(30));
    assert!(lines.iter().any(|l| l == "verify=ok"), "{lines:?}");
}

#[test]
fn lock_times_out_while_work_is_in_flight_and_the_tenant_runs_on() {
    let node = node("64Gi");
    // A 3 s kernel and the synchronize that waits for it.
    let t = node.spawn_probe(
        &["init", "ready", "spin", "kernel", "1", "3000000000"],
        Duration::from_secs(30),
    );
    std::thread::sleep(Duration::from_millis(300));
    let pid = t.pid().to_string();
    let out = node.probe(&["init", "ckpt", "lock", &pid, "200", "ckpt", "state", &pid]);
    assert_eq!(code(&out, "lock", 0), NOT_READY, "{out}");
    assert!(us_of(&out, "lock") >= 200_000, "{out}");
    assert_eq!(num(&out, "state"), RUNNING, "{out}");
    let lines = t.finish(Duration::from_secs(30));
    assert!(lines.iter().any(|l| l.starts_with("spin=ok")), "{lines:?}");
}

#[test]
fn unified_memory_is_refused_as_the_driver_refuses_it() {
    let node = node("64Gi");
    let t = node.spawn_probe(
        &["init", "alloc-api", "managed", "4Mi", "ready", "wait"],
        Duration::from_secs(30),
    );
    let out = control(&node, t.pid(), &["lock", "checkpoint", "state", "unlock"]);
    assert_eq!(code(&out, "checkpoint", 0), NOT_SUPPORTED, "{out}");
    assert_eq!(num(&out, "state"), LOCKED, "{out}");
    assert_eq!(code(&out, "unlock", 0), OK, "{out}");
    t.finish(Duration::from_secs(10));
}

#[test]
fn a_tenant_under_the_shim_is_suspended_and_resumed_and_the_shim_passes_the_api_through() {
    let node = node("64Gi");
    let c = Container::new("1Gi");
    let t = node.spawn_probe_in(
        Some(&c),
        &[
            "init", "fill", "64Mi", "9", "ready", "wait", "verify", "alloc", "512Mi",
        ],
        Duration::from_secs(60),
    );
    let pid = t.pid();
    let out = control(&node, pid, &["lock", "checkpoint"]);
    assert_eq!(code(&out, "checkpoint", 0), OK, "{out}");
    let view = node.probe(&["init", "meminfo"]);
    assert_eq!(num(&view, "free"), 8 * GIB - 256 * MIB, "{view}");
    // A controller under the shim reaches the API by cuGetProcAddress (passed through
    // to the driver: the shim has no row for it).
    let p = pid.to_string();
    let out = node.probe_in(
        Some(&c),
        &[
            "route", "procaddr", "init", "ckpt", "state", &p, "ckpt", "restore", &p, "ckpt",
            "unlock", &p,
        ],
    );
    assert_eq!(num(&out, "state"), CHECKPOINTED, "{out}");
    assert_eq!(code(&out, "restore", 0), OK, "{out}");
    assert_eq!(code(&out, "unlock", 0), OK, "{out}");
    // The tenant's data is intact and its quota still holds.
    let lines = t.finish(Duration::from_secs(30));
    assert!(lines.iter().any(|l| l == "verify=ok"), "{lines:?}");
    assert!(
        lines
            .iter()
            .any(|l| l == "alloc=ok" || l.starts_with("alloc=ok ")),
        "{lines:?}"
    );
}
