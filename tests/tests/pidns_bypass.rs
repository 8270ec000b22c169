//! The bypass checks see through PID namespaces (issue 11 item 5): two "containers" of
//! the device plugin each run one process as PID 1 of a PID namespace of its own with its
//! own `/proc` (`unshare --user --map-root-user --pid --fork --mount-proc`, what a
//! container runtime gives a pod), one under `libvgpu.so` and registered with a real
//! daemon, one without the shim. On the host, the daemon's NVML watcher and the plugin's
//! audit (both reading cuda-sim's NVML, which reports host PIDs as NVIDIA's driver does)
//! flag exactly the process without the shim, under its host PID, attribute it to its
//! pod, and leave the registered one alone. Before cuda-sim reported host PIDs, the audit
//! flagged `pid=6 comm=kworker/…` (the container PID, read in the host's `/proc`) and the
//! daemon a bypass `pid=7`.
//!
//! Each process also has its container's directory at `/etc/vgpu`, as the plugin mounts
//! it: the audit attributes a process by that file (ADR 0042), never by its environment.
//! Needs user namespaces and mounts in them (a visible skip where refused, a failure
//! under CI). The test points this process's NVML at its own simulated node through the
//! environment (`VGPU_SIM_DIR`) before any thread of its own starts (nextest: a process
//! per test).

// `std::env::set_var` is unsafe (edition 2024); see the SAFETY comment below.
#![allow(unsafe_code)]

use super::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use vgpu_core::inventory::GpuInfo;
use vgpu_daemon::nvml::WatcherConfig;
use vgpu_device_plugin::audit::{self, AuditState, EVENT_REASON};
use vgpu_device_plugin::metrics::Metrics;
use vgpu_testkit::fake_kubelet::FakeKubelet;
use vgpu_testkit::node::{PodContainer, TestNode, fake_containers, pod_json};
use vgpu_tests::plugin_mount::PluginMount;
use vgpu_tests::{Probe, SimNode, field, probe_bin, shim_lib, sim_lib_dir};

const UUID: &str = "GPU-51570000-0000-4000-8000-00000000b1d5";

#[test]
fn bypass_checks_name_a_process_of_a_pid_namespace_by_its_host_pid() {
    if !vgpu_tests::pidns::unshare_allowed(true) {
        let why = "`unshare --user --pid --mount-proc` is not allowed here";
        return vgpu_test_needs::skip(vgpu_test_needs::Need::UserNamespaces, why);
    }
    let sim = SimNode::new(&format!(
        "[[device]]\nuuid = \"{UUID}\"\nname = \"NVIDIA H100 80GB HBM3\"\nmemory = \"8Gi\"\n"
    ));
    let mount = PluginMount::new();
    let mut enter = std::process::Command::new("unshare");
    enter.args(USERNS);
    if let Err(why) = mount.check(enter) {
        return vgpu_test_needs::skip(vgpu_test_needs::Need::UserNamespaces, &why);
    }
    // SAFETY: nextest runs each test in a process of its own (ADR 0045), and no thread
    // of ours runs yet (the runtime and the probes' readers start below).
    unsafe { std::env::set_var("VGPU_SIM_DIR", sim.state_dir()) };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(run(&sim, &mount));
}

/// The one child of process `pid` (the probe `unshare --fork` started), by the host's
/// `/proc`: its host PID.
fn only_child(pid: u32) -> u32 {
    let kids = vgpu_tests::pidns::children(pid);
    match kids.as_slice() {
        [p] => *p,
        other => panic!("unshare should have one child, the probe: {other:?}"),
    }
}

/// A PID namespace with its own `/proc`, in a user namespace, as a runtime gives a pod.
const USERNS: [&str; 6] = [
    "--user",
    "--map-root-user",
    "--pid",
    "--fork",
    "--mount-proc",
    "--",
];

async fn run(sim: &SimNode, mount: &PluginMount) {
    // The node's state is created from its configuration by its first user, a process
    // given `VGPU_SIM_CONFIG`; this one's NVML readers only have `VGPU_SIM_DIR`.
    sim.probe(&["init"]);
    let host = tempfile::tempdir().expect("temporary directory");
    let daemon_dir = host.path().join("daemon");
    std::fs::create_dir_all(&daemon_dir).expect("daemon directory");
    let socket = daemon_dir.join("daemon.sock");
    // The daemon with its NVML watcher (which flags processes no shim registered).
    let served = common::daemon::serve_with(&socket, |c| {
        c.reporting.nvml = Some(WatcherConfig {
            lib: sim_lib_dir().join("libnvidia-ml.so.1").into_os_string(),
            interval: Duration::from_millis(50),
            retry: Duration::from_millis(200),
            ..WatcherConfig::default()
        });
    })
    .await;
    let daemon = &served.daemon;

    let gpus = vec![GpuInfo {
        index: 0,
        uuid: UUID.into(),
        model: "NVIDIA H100 80GB HBM3".into(),
        memory_mib: 8192,
        healthy: true,
        topology: None,
    }];
    let (sock, cdir) = (socket.clone(), daemon_dir.clone());
    let mut node = TestNode::start_with(gpus, move |c| {
        c.daemon_socket = Some(sock);
        c.daemon_container_dir = cdir;
    })
    .await
    .expect("node");
    let mut dirs = Vec::new();
    for (i, name) in ["enforced", "escaped"].into_iter().enumerate() {
        let cs: Vec<PodContainer<'_>> =
            vec![("main", false, vec![(UUID.to_owned(), 2048, 300, 3)])];
        node.put_pod(pod_json("ns", name, &format!("uid-{name}"), i as u32, &cs))
            .await
            .expect("pod");
        let mut c = node.client.clone();
        let adm = node
            .kubelet
            .admit(&mut c, "ns", name, &fake_containers(&cs))
            .await
            .expect("admit");
        let ids = adm.containers[0].2.clone();
        FakeKubelet::prestart(&mut node.client, &ids)
            .await
            .expect("PreStartContainer");
        dirs.push(
            node.handshake
                .allocation_dir(ids.iter().map(String::as_str)),
        );
    }

    // Each process is PID 1 of its own PID namespace, with its own /proc.
    let in_container = |dir: &std::path::Path, shim: bool| {
        let preload = shim.then(shim_lib);
        let mut cmd = sim.command("unshare");
        cmd.args(USERNS)
            .args(mount.args(dir, preload.as_deref(), &probe_bin()))
            .env("VGPU_CONTAINER_DIR", dir)
            .env_remove("VGPU_MEMORY_LIMIT");
        if shim {
            cmd.env("VGPU_DAEMON_SOCKET", &socket);
        }
        Probe::start(
            cmd,
            &["init", "alloc", "256Mi", "ready", "wait"],
            Duration::from_secs(30),
        )
    };
    let enforced = in_container(&dirs[0], true);
    let escaped = in_container(&dirs[1], false);
    for p in [&enforced, &escaped] {
        let ready = p.seen.last().cloned().unwrap_or_default();
        assert_eq!(field(&ready, "pid").as_deref(), Some("1"), "{ready}");
    }
    let (enforced_pid, escaped_pid) = (only_child(enforced.pid()), only_child(escaped.pid()));
    assert!(enforced_pid != 1 && escaped_pid != 1);

    // The daemon: the shim registered under its host PID (the socket's credentials), the
    // watcher flags only the process without the shim, by its host PID.
    let end = Instant::now() + Duration::from_secs(30);
    loop {
        let snap = daemon.snapshot();
        let registered = snap
            .tenants
            .iter()
            .any(|t| t.pod == "enforced" && t.pids.contains(&enforced_pid));
        let g = snap.gpus.iter().find(|g| g.observed.uuid == UUID);
        let seen = |pid: u32| g.is_some_and(|g| g.processes.iter().any(|p| p.pid == pid));
        if registered && seen(enforced_pid) && seen(escaped_pid) {
            let g = g.expect("the GPU");
            assert_eq!(g.bypass_pids, [escaped_pid], "{g:#?}");
            let tenant_of = |pid: u32| {
                g.processes
                    .iter()
                    .find(|p| p.pid == pid)
                    .and_then(|p| p.tenant.clone())
            };
            assert_eq!(tenant_of(enforced_pid).as_deref(), Some("ns/enforced/main"));
            assert_eq!(tenant_of(escaped_pid), None);
            break;
        }
        assert!(
            Instant::now() < end,
            "the daemon never saw both processes under their host PIDs \
             (enforced {enforced_pid}, escaped {escaped_pid}): {snap:#?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // The plugin's audit: only the process without the shim, by its host PID and its
    // name, attributed to its pod; one event naming the host PID.
    let metrics = Metrics::new(tokio::sync::watch::channel(Vec::new()).1);
    let rx = audit::spawn(
        node.cfg.clone(),
        Some(sim_lib_dir().join("libnvidia-ml.so.1")),
        Duration::from_millis(50),
    )
    .expect("audit thread");
    let reporter = tokio::spawn(audit::report(
        node.handshake.clone(),
        rx,
        Arc::clone(&metrics.audit),
    ));
    let state = wait(&metrics, |s| s.checked >= 2 && !s.latest.is_empty()).await;
    let pids: Vec<u32> = state.latest.iter().map(|(u, _)| u.pid).collect();
    assert_eq!(pids, [escaped_pid], "{state:#?}");
    let (u, owner) = &state.latest[0];
    let probe_name = probe_bin()
        .file_name()
        .map(|n| n.to_string_lossy().chars().take(15).collect::<String>())
        .unwrap_or_default();
    assert_eq!(u.comm, probe_name, "{u:?}");
    let owner = owner.as_ref().expect("attributed to its pod");
    assert_eq!(
        (owner.namespace.as_str(), owner.pod.as_str()),
        ("ns", "escaped")
    );
    let end = Instant::now() + Duration::from_secs(30);
    let ev = loop {
        if let Some(e) = node
            .api
            .events()
            .into_iter()
            .find(|e| e["reason"] == EVENT_REASON)
        {
            break e;
        }
        assert!(Instant::now() < end, "no {EVENT_REASON} event");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(ev["involvedObject"]["name"], "escaped");
    let msg = ev["message"].as_str().unwrap_or("");
    assert!(msg.contains(&format!("{escaped_pid}")), "{msg}");
    reporter.abort();
    enforced.kill9();
    escaped.kill9();
}

/// Polls the audit state until `pred` holds (a bound so that a broken audit fails the
/// test instead of hanging it, not a timing claim).
async fn wait(metrics: &Metrics, pred: impl Fn(&AuditState) -> bool) -> AuditState {
    let end = Instant::now() + Duration::from_secs(30);
    loop {
        {
            let s = metrics.audit.lock().expect("lock");
            if pred(&s) {
                return s.clone();
            }
        }
        assert!(Instant::now() < end, "the audit never reported the process");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
