//! cuda-sim's NVML reports host PIDs, as NVIDIA's driver does, also for a process in a
//! container with a PID namespace and a `/proc` of its own (issue 11 item 5): there the
//! process cannot learn its host PID, so the first NVML reader in the initial namespace
//! finds it (PID namespace, PID there, start time) and the node keeps it.
//!
//! A real process in `unshare --user --map-root-user --pid --fork --mount-proc` (PID 1
//! of its namespace, a fresh `/proc`) holds 64 MiB; an NVML reader on the host lists it
//! under its host PID. Needs unprivileged user namespaces; where the kernel does not
//! allow them the test says SKIPPED and checks nothing.

use std::time::Duration;

use vgpu_tests::{Probe, SimNode, field, probe_bin};

/// The PIDs of the probe's `procs=pid:bytes,...`.
fn pids(out: &str) -> Vec<u32> {
    field(out, "procs")
        .unwrap_or_default()
        .split(',')
        .filter_map(|p| p.split_once(':')?.0.parse().ok())
        .collect()
}

#[test]
fn nvml_lists_a_process_of_a_container_with_its_own_proc_under_its_host_pid() {
    if !vgpu_tests::pidns::unshare_allowed(true) {
        let why = "`unshare --user --pid --mount-proc` is not allowed here";
        return vgpu_test_needs::skip(vgpu_test_needs::Need::UserNamespaces, why);
    }
    let node = SimNode::new("[[device]]\nmemory = \"8Gi\"\n");
    let mut cmd = node.command("unshare");
    cmd.args([
        "--user",
        "--map-root-user",
        "--pid",
        "--fork",
        "--mount-proc",
        "--",
    ])
    .arg(probe_bin());
    let probe = Probe::start(
        cmd,
        &["init", "alloc", "64Mi", "ready", "wait", "nvml"],
        Duration::from_secs(30),
    );
    let ready = probe.seen.last().cloned().unwrap_or_default();
    assert_eq!(
        field(&ready, "pid").as_deref(),
        Some("1"),
        "the probe is PID 1 of its namespace: {ready}"
    );
    let host_pid = match vgpu_tests::pidns::children(probe.pid()).as_slice() {
        [p] => *p,
        other => panic!("unshare should have one child, the probe: {other:?}"),
    };
    assert_ne!(host_pid, 1);

    // An NVML reader on the host lists the process under its host PID (with its 64 MiB
    // and its context).
    let out = node.probe(&["nvml"]);
    assert_eq!(pids(&out), vec![host_pid], "host reader: {out}");
    // The node keeps it: the reader inside the container now gets the host PID too.
    let lines = probe.finish(Duration::from_secs(30));
    let out = lines.join("\n");
    assert_eq!(pids(&out), vec![host_pid], "reader in the container: {out}");
}
