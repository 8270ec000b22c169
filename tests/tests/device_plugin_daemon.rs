//! The device plugin connects each container to the node daemon: `Allocate` mounts the
//! daemon socket's directory and names the socket in `VGPU_DAEMON_SOCKET`; the pod's
//! `vgpu.io/compute-policy` and `vgpu.io/priority` annotations reach the quota file; a
//! real CUDA process under `libvgpu.so`, given exactly the environment `Allocate`
//! returned, registers with a real daemon (its library, serving on the socket), which
//! then holds the container as a tenant with the pod's share, policy and priority.
//!
//! No mount namespace here: the container path of the daemon directory is set to its host
//! path (so the mount would be an identity), and `VGPU_CONTAINER_DIR` to the allocation
//! directory the plugin mounts there.

use std::time::{Duration, Instant};

use serde_json::json;
use vgpu_core::inventory::GpuInfo;
use vgpu_core::resources::{ANNOTATION_COMPUTE_POLICY, ANNOTATION_PRIORITY};
use vgpu_core::sched_proto::{ComputePolicy, ComputeSettings, Priority};
use vgpu_testkit::fake_kubelet::FakeKubelet;
use vgpu_testkit::node::{PodContainer, TestNode, fake_containers, pod_json};
use vgpu_tests::{Probe, SimNode, probe_bin, shim_lib};

use super::common;

const UUID: &str = "GPU-51570000-0000-4000-8000-0000000da3e0";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_container_reaches_the_daemon_with_its_pods_compute_class() {
    let sim = SimNode::new(&format!(
        "[[device]]\nuuid = \"{UUID}\"\nname = \"NVIDIA H100 80GB HBM3\"\nmemory = \"8Gi\"\n"
    ));
    let host = tempfile::tempdir().expect("temporary directory");
    let daemon_dir = host.path().join("daemon");
    std::fs::create_dir_all(&daemon_dir).expect("daemon directory");
    let socket = daemon_dir.join("daemon.sock");

    // The daemon, as its binary runs it: library, timer and socket server.
    let served = common::daemon::serve(&socket).await;
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

    let cs: Vec<PodContainer<'_>> = vec![("main", false, vec![(UUID.to_owned(), 2048, 400, 4)])];
    let mut pod = pod_json("serving", "fast", "uid-fast", 0, &cs);
    pod["metadata"]["annotations"][ANNOTATION_COMPUTE_POLICY] = json!("cap");
    pod["metadata"]["annotations"][ANNOTATION_PRIORITY] = json!("latency-sensitive");
    node.put_pod(pod).await.expect("pod");
    let mut c = node.client.clone();
    let adm = node
        .kubelet
        .admit(&mut c, "serving", "fast", &fake_containers(&cs))
        .await
        .expect("admit");
    let (_, _, ids, answer) = &adm.containers[0];
    let mount = answer
        .mounts
        .iter()
        .find(|m| m.host_path == daemon_dir.display().to_string())
        .expect("the daemon directory is mounted");
    assert!(mount.read_only, "{mount:?}");
    let env_socket = answer
        .envs
        .get("VGPU_DAEMON_SOCKET")
        .expect("VGPU_DAEMON_SOCKET set")
        .clone();
    assert_eq!(env_socket, socket.display().to_string());
    FakeKubelet::prestart(&mut node.client, ids)
        .await
        .expect("PreStartContainer");
    let dir = node
        .handshake
        .allocation_dir(ids.iter().map(String::as_str));

    let mut cmd = sim.command(probe_bin());
    cmd.env("LD_PRELOAD", shim_lib())
        .env_remove("VGPU_MEMORY_LIMIT")
        .env_remove("VGPU_COMPUTE_SHARE");
    for (k, v) in &answer.envs {
        cmd.env(k, v);
    }
    // What the allocation directory's mount at VGPU_CONTAINER_DIR does.
    cmd.env("VGPU_CONTAINER_DIR", &dir);
    let probe = Probe::start(
        cmd,
        &["init", "alloc", "64Mi", "ready", "wait"],
        Duration::from_secs(30),
    );

    // A bound so that a broken registration fails the test instead of hanging it.
    let end = Instant::now() + Duration::from_secs(30);
    let tenant = loop {
        let snap = daemon.snapshot();
        if let Some(t) = snap.tenants.iter().find(|t| t.pids.contains(&probe.pid())) {
            break t.clone();
        }
        assert!(
            Instant::now() < end,
            "the container never registered with the daemon: {snap:#?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(
        (
            tenant.namespace.as_str(),
            tenant.pod.as_str(),
            tenant.container.as_str()
        ),
        ("serving", "fast", "main")
    );
    assert_eq!(tenant.gpus.len(), 1, "{tenant:#?}");
    let g = &tenant.gpus[0];
    assert_eq!(g.uuid, UUID);
    assert_eq!(
        g.settings,
        ComputeSettings {
            share_pct: 40,
            policy: ComputePolicy::Cap,
            priority: Priority::LatencySensitive,
        },
        "{tenant:#?}"
    );
    assert_eq!(g.memory_quota, Some(2048 << 20), "{tenant:#?}");
    probe.kill9();
}
