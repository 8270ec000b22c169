//! NVML reports host PIDs (the driver's view); a container runs in a PID namespace of its
//! own, so a shim matching NVML's PIDs against its own would show the container none of
//! its processes. The node daemon learns each process's host PID from the socket's
//! credentials and tells the shim in its `Welcome`; the shim then lists the container's
//! processes under their own PIDs.
//!
//! A real process in a new PID namespace (`unshare --user --pid --fork`, without a new
//! `/proc`, so that cuda-sim sees the host PID as a kernel driver would) under the shim,
//! registered with a real daemon (library, socket server): NVML inside lists it as PID 1
//! with its charged memory. Needs unprivileged user namespaces; where the kernel does not
//! allow them the test says so and checks nothing.

use std::time::{Duration, Instant};

use vgpu_tests::{Container, Probe, SimNode, field, probe_bin};

use super::common;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_container_in_its_own_pid_namespace_sees_its_processes_under_its_own_pids() {
    if !vgpu_tests::pidns::unshare_allowed(false) {
        let why = "`unshare --user --pid` is not allowed here";
        return vgpu_test_needs::skip(vgpu_test_needs::Need::UserNamespaces, why);
    }
    let sim = SimNode::new(
        "[[device]]\nuuid = \"GPU-51570000-0000-4000-8000-0000000b1d00\"\nmemory = \"8Gi\"\n",
    );
    let host = tempfile::tempdir().expect("temporary directory");
    let socket = host.path().join("daemon.sock");
    let served = common::daemon::serve(&socket).await;
    let daemon = &served.daemon;

    let container = Container::new("1Gi").with("VGPU_DAEMON_SOCKET", &socket.to_string_lossy());
    let mut cmd = sim.command("unshare");
    container.apply(&mut cmd);
    cmd.args(["--user", "--map-root-user", "--pid", "--fork", "--"])
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

    // Wait (bounded) until the daemon holds the process: its Welcome carried the host PID.
    let end = Instant::now() + Duration::from_secs(30);
    let host_pid = loop {
        let snap = daemon.snapshot();
        if let Some(p) = snap.tenants.iter().flat_map(|t| t.pids.iter()).next() {
            break *p;
        }
        assert!(
            Instant::now() < end,
            "the process never registered: {snap:#?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_ne!(host_pid, 1, "the daemon sees the host PID");
    // Give the shim's gate thread the moment between the daemon's registration and its
    // reading of the Welcome; the listing below is what is checked.
    tokio::time::sleep(Duration::from_millis(500)).await;

    let lines = probe.finish(Duration::from_secs(30));
    let out = lines.join("\n");
    let procs = field(&out, "procs").unwrap_or_default();
    assert_eq!(
        procs,
        format!("1:{}", 64u64 << 20),
        "NVML in the namespace lists the process as PID 1 with its charged memory: {out}"
    );
}
