//! The plugin against a fake kubelet speaking the real protocols over unix sockets and a
//! fake API server: registration, kubelet restart, health, and the handshake.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde_json::json;
use tonic::Code;
use vgpu_core::inventory::{GpuInfo, NodeInventory};
use vgpu_core::packing::{GpuSpec, Ledger, NodeSpec, Task, reuse};
use vgpu_core::pod_request::parse_pod_request;
use vgpu_core::resources::{ContainerKind, RESOURCE_GPU};
use vgpu_device_plugin::kubelet::{HEALTHY, UNHEALTHY};
use vgpu_testkit::fake_kubelet::{FakeKubelet, FakeKubeletError};

use vgpu_testkit::node::{NODE, PodContainer, TestNode, fake_containers, gpus, pod_json};

const T: Duration = Duration::from_secs(10);

fn grant(uuid: &str, mem: u64, milli: u32, slices: u32) -> Vec<(String, u64, u32, u32)> {
    vec![(uuid.to_owned(), mem, milli, slices)]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registers_and_lists_ten_slices_per_gpu() {
    let node = TestNode::start(gpus(2, 81920)).await.expect("node");
    let (_, reg) = node
        .kubelet
        .wait_registered(1, T)
        .await
        .expect("registered");
    assert_eq!(reg.version, "v1beta1");
    assert_eq!(
        reg.endpoint, "vgpu.sock",
        "the endpoint is the socket's file name"
    );
    assert_eq!(reg.resource_name, "vgpu.io/gpu");
    let o = reg.options.expect("options");
    assert!(o.pre_start_required && o.get_preferred_allocation_available);
    let d = node.kubelet.devices();
    assert_eq!(d.len(), 20);
    assert!(d.iter().all(|d| d.health == HEALTHY && d.id.len() <= 63));
    assert!(
        d.iter()
            .any(|d| d.id == format!("{}-9", gpus(2, 1)[1].uuid))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reregisters_on_a_fresh_socket_after_kubelet_restarts() {
    let mut node = TestNode::start(gpus(1, 81920)).await.expect("node");
    for round in 2..=4 {
        let t0 = node.kubelet.restart().expect("restart");
        let (at, reg) = node
            .kubelet
            .wait_registered(round, Duration::from_secs(2))
            .await
            .expect("re-registered within 2 s");
        let took = at.duration_since(t0);
        println!(
            "kubelet restart {}: re-registered in {:.1} ms",
            round - 1,
            took.as_secs_f64() * 1e3
        );
        assert!(took < Duration::from_secs(2));
        let mut c = node
            .kubelet
            .connect(&reg.endpoint)
            .await
            .expect("dial the new socket");
        node.kubelet
            .wait_devices("devices after restart", T, |d| d.len() == 10)
            .await
            .expect("full list");
        // The new socket serves every call.
        let a = vgpu_device_plugin::kubelet::v1beta1::AllocateRequest {
            container_requests: vec![
                vgpu_device_plugin::kubelet::v1beta1::ContainerAllocateRequest {
                    devices_ids: vec![node.kubelet.devices()[0].id.clone()],
                },
            ],
        };
        c.allocate(a).await.expect("Allocate on the new socket");
    }
}

/// Waits until the node's published inventory satisfies `pred`.
async fn wait_inventory(node: &TestNode, what: &str, pred: impl Fn(&NodeInventory) -> bool) {
    let end = Instant::now() + T;
    loop {
        let inv = node.api.node(NODE).and_then(|n| {
            n["metadata"]["annotations"]["vgpu.io/gpu-inventory"]
                .as_str()
                .map(|t| NodeInventory::from_json(t).expect("valid inventory"))
        });
        if inv.as_ref().is_some_and(&pred) {
            return;
        }
        assert!(
            Instant::now() < end,
            "timed out waiting for the inventory: {what}; last {inv:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_changes_send_the_full_list_both_ways() {
    let node = TestNode::start(gpus(2, 81920)).await.expect("node");
    let mut g = gpus(2, 81920);
    g[1].healthy = false;
    node.gpus.send_replace(g.clone());
    let d = node
        .kubelet
        .wait_devices("GPU 1 unhealthy", T, |d| {
            d.iter().any(|x| x.health == UNHEALTHY)
        })
        .await
        .expect("unhealthy");
    assert_eq!(d.len(), 20, "the full list every time");
    assert_eq!(d.iter().filter(|x| x.health == UNHEALTHY).count(), 10);
    assert!(
        d.iter()
            .filter(|x| x.health == UNHEALTHY)
            .all(|x| x.id.starts_with(&g[1].uuid))
    );
    g[1].healthy = true;
    node.gpus.send_replace(g);
    node.kubelet
        .wait_devices("healthy again", T, |d| {
            d.len() == 20 && d.iter().all(|x| x.health == HEALTHY)
        })
        .await
        .expect("healthy again");
    wait_inventory(&node, "all healthy", |i| i.gpus.iter().all(|g| g.healthy)).await;
    let n = node.api.node(NODE).expect("node");
    assert_eq!(
        n["metadata"]["labels"]["vgpu.io/gpu-model"],
        "NVIDIA-A100-SXM4-80GB"
    );
}

/// 50 pods with differing requests, admitted one after another as kubelet does, then
/// every PreStartContainer at once: each container's quota file must be its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_concurrent_pods_each_get_exactly_their_assignment() {
    fifty_pods(false).await;
}

/// The same, with each pod's PreStartContainer sent as soon as it is admitted, so the
/// calls overlap each other and the admission of later pods (kubelet's pod workers).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_pods_started_while_others_are_admitted_get_their_own_quota() {
    fifty_pods(true).await;
}

async fn fifty_pods(interleaved: bool) {
    let g = gpus(12, 81920);
    let mut node = TestNode::start(g.clone()).await.expect("node");
    node.kubelet.set_list_delay(Duration::from_millis(3));
    let mut used = vec![0u32; g.len()];
    let mut expected: BTreeMap<String, (u64, u32, String)> = BTreeMap::new();
    let mut client = node.client.clone();
    let mut all = Vec::new();
    let mut tasks = Vec::new();
    for i in 0..50u32 {
        let slices = 1 + (i % 3);
        // Place like an extender would, but not in kubelet's order: last GPU first.
        let gi = (0..g.len())
            .rev()
            .find(|&k| used[k] + slices <= 10)
            .expect("room");
        used[gi] += slices;
        let mem = 1000 + 37 * u64::from(i);
        let milli = 50 + 7 * i;
        let name = format!("pod-{i}");
        let cs: Vec<PodContainer<'_>> =
            vec![("main", false, grant(&g[gi].uuid, mem, milli, slices))];
        let adm = node
            .place(&mut client, ("ns", &name, &format!("uid-{i}"), i), &cs)
            .await
            .expect("admitted");
        let (_, _, ids, resp) = adm.containers.into_iter().next().expect("one container");
        assert_eq!(
            resp.envs.get("VGPU_CONTAINER_DIR").map(String::as_str),
            Some("/var/run/vgpu")
        );
        expected.insert(name.clone(), (mem, milli, g[gi].uuid.clone()));
        all.push((name.clone(), ids.clone()));
        if interleaved {
            let mut c = node.client.clone();
            tasks.push(tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(u64::from(i % 5))).await;
                let r = tokio::time::timeout(T, FakeKubelet::prestart(&mut c, &ids)).await;
                (name, r)
            }));
        }
    }
    let lists_before = node.kubelet.list_stats().1;
    for (name, ids) in all.clone().into_iter().filter(|_| !interleaved) {
        let mut c = node.client.clone();
        tasks.push(tokio::spawn(async move {
            let r = tokio::time::timeout(T, FakeKubelet::prestart(&mut c, &ids)).await;
            (name, r)
        }));
    }
    for t in tasks {
        let (name, r) = t.await.expect("task");
        r.expect("PreStartContainer answered in time")
            .unwrap_or_else(|s| panic!("PreStartContainer for {name}: {s}"));
    }
    let (max_conc, lists) = node.kubelet.list_stats();
    println!(
        "50 PreStartContainer calls (interleaved: {interleaved}) used {} List calls after admission, at most {max_conc} at once",
        lists - lists_before
    );
    assert!(
        max_conc <= vgpu_device_plugin::podresources::MAX_CONCURRENT_LISTS,
        "the plugin's own bound on concurrent List calls (kubelet allows 10 for all clients): {max_conc}"
    );
    let mut mismatches = Vec::new();
    for (name, ids) in &all {
        let q = node.read_quota(ids).expect("quota written");
        let (mem, milli, uuid) = &expected[name];
        let ok = q.pod == *name
            && q.container == "main"
            && q.gpus.len() == 1
            && q.gpus[0].uuid == *uuid
            && q.gpus[0].memory_mib == *mem
            && q.gpus[0].compute_milli == *milli
            && q.device_ids.len() == ids.len();
        if !ok {
            mismatches.push(format!("{name}: {q:?}"));
        }
    }
    assert!(mismatches.is_empty(), "mismatches: {mismatches:#?}");
    // Idempotent: a container restart calls PreStartContainer again.
    let (name, ids) = &all[7];
    FakeKubelet::prestart(&mut node.client, ids)
        .await
        .expect("again");
    assert_eq!(node.read_quota(ids).expect("quota").pod, *name);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocate_mounts_the_directory_the_shim_and_a_generated_preload() {
    let g = gpus(2, 81920);
    let mut node = TestNode::start(g.clone()).await.expect("node");
    let cs: Vec<PodContainer<'_>> = vec![("main", false, grant(&g[1].uuid, 4096, 200, 2))];
    node.put_pod(pod_json("ns", "p", "u", 0, &cs))
        .await
        .expect("pod");
    let mut c = node.client.clone();
    let adm = node
        .kubelet
        .admit(&mut c, "ns", "p", &fake_containers(&cs))
        .await
        .expect("admit");
    let (_, _, ids, r) = &adm.containers[0];
    assert!(
        ids.iter().all(|i| i.starts_with(&g[1].uuid)),
        "steered to the assigned GPU: {ids:?}"
    );
    let dir = node
        .handshake
        .allocation_dir(ids.iter().map(String::as_str));
    let m = |cp: &str| {
        r.mounts
            .iter()
            .find(|m| m.container_path == cp)
            .cloned()
            .expect(cp)
    };
    assert_eq!(m("/var/run/vgpu").host_path, dir.display().to_string());
    assert!(!m("/var/run/vgpu").read_only);
    assert!(
        m("/var/run/vgpu/vgpu.conf").read_only,
        "the tenant cannot edit its quota"
    );
    // The same directory at the fixed path, read-only (ADR 0042).
    assert_eq!(m("/etc/vgpu").host_path, dir.display().to_string());
    assert!(m("/etc/vgpu").read_only, "the tenant cannot move its quota");
    assert!(m("/usr/local/vgpu/libvgpu.so").read_only);
    let preload = m("/etc/ld.so.preload");
    assert_eq!(
        std::fs::read_to_string(&preload.host_path).expect("preload file"),
        "/usr/local/vgpu/libvgpu.so\n"
    );
    assert_eq!(r.devices.len(), 1);
    assert_eq!(r.devices[0].container_path, "/dev/nvidia1");
    assert_eq!(
        node.read_quota(ids),
        None,
        "no quota before PreStartContainer"
    );
    FakeKubelet::prestart(&mut node.client, ids)
        .await
        .expect("prestart");
    let q = node.read_quota(ids).expect("quota");
    assert_eq!((q.gpus[0].memory_mib, q.gpus[0].compute_milli), (4096, 200));
}

/// Issue 11 item 2 (plugin part): `Allocate` names the container's GPUs to CUDA and to the
/// NVIDIA container toolkit, by UUID, in the order of the quota file the shim numbers
/// its devices by (node index order, whatever the assignment's order).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_container_sees_its_gpus_by_uuid_in_the_quota_files_order() {
    // Node index order differs from UUID order (and from the assignment's order below).
    let mut g = gpus(2, 81920);
    let (u0, u1) = (g[1].uuid.clone(), g[0].uuid.clone());
    g[0].uuid = u0.clone();
    g[1].uuid = u1.clone();
    let mut node = TestNode::start(g.clone()).await.expect("node");
    let cs: Vec<PodContainer<'_>> = vec![
        // The case: granted GPU 1 only; its device 0 must be GPU 1.
        ("one", false, grant(&u1, 4096, 200, 2)),
        (
            "two",
            false,
            [grant(&u1, 1000, 300, 3), grant(&u0, 2000, 300, 3)].concat(),
        ),
    ];
    node.put_pod(pod_json("ns", "p", "u", 0, &cs))
        .await
        .expect("pod");
    let mut c = node.client.clone();
    let adm = node
        .kubelet
        .admit(&mut c, "ns", "p", &fake_containers(&cs))
        .await
        .expect("admit");
    let env = |i: usize, k: &str| adm.containers[i].3.envs.get(k).cloned();
    for k in ["CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"] {
        assert_eq!(env(0, k), Some(u1.clone()), "{k} of the GPU 1 container");
        assert_eq!(env(1, k), Some(format!("{u0},{u1}")), "{k}: index order");
    }
    for (i, want) in [
        (0, vec![(u1.clone(), 4096)]),
        (1, vec![(u0.clone(), 2000), (u1.clone(), 1000)]),
    ] {
        let ids = adm.containers[i].2.clone();
        FakeKubelet::prestart(&mut node.client, &ids)
            .await
            .expect("prestart");
        let q = node.read_quota(&ids).expect("quota");
        let got: Vec<(String, u64)> = q
            .gpus
            .iter()
            .map(|g| (g.uuid.clone(), g.memory_mib))
            .collect();
        assert_eq!(
            got, want,
            "the quota file lists the GPUs in CUDA_VISIBLE_DEVICES order"
        );
        let visible: Vec<String> = env(i, "CUDA_VISIBLE_DEVICES")
            .expect("set")
            .split(',')
            .map(str::to_owned)
            .collect();
        assert_eq!(visible, got.into_iter().map(|g| g.0).collect::<Vec<_>>());
    }
}

/// Issue 11 item 6: a GPU whose device node is missing is refused at `Allocate`, naming the
/// path, not left to fail in the runtime (`lstat /dev/nvidia0`, pod stuck creating).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocate_names_a_missing_device_node_instead_of_failing_in_the_runtime() {
    let g = gpus(2, 81920);
    let node = TestNode::start(g.clone()).await.expect("node");
    let gone = node.cfg.dev_dir.join("nvidia1");
    std::fs::remove_file(&gone).expect("remove the device node");
    let cs: Vec<PodContainer<'_>> = vec![("main", false, grant(&g[1].uuid, 4096, 200, 2))];
    node.put_pod(pod_json("ns", "p", "u", 0, &cs))
        .await
        .expect("pod");
    let mut c = node.client.clone();
    let e = node
        .kubelet
        .admit(&mut c, "ns", "p", &fake_containers(&cs))
        .await
        .expect_err("Allocate refused");
    match e {
        FakeKubeletError::Call { call, status } => {
            assert_eq!(call, "Allocate");
            assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
            assert!(
                status.message().contains(&gone.display().to_string())
                    && status.message().contains(&g[1].uuid),
                "{}",
                status.message()
            );
        }
        other => panic!("expected Allocate to be refused: {other}"),
    }
    // The other GPU's node is there: its containers are served.
    node.kubelet.remove_pod("ns", "p");
    let cs0: Vec<PodContainer<'_>> = vec![("main", false, grant(&g[0].uuid, 4096, 200, 2))];
    node.put_pod(pod_json("ns", "q", "v", 1, &cs0))
        .await
        .expect("pod");
    let adm = node
        .kubelet
        .admit(&mut c, "ns", "q", &fake_containers(&cs0))
        .await
        .expect("GPU 0 allocates");
    assert_eq!(
        adm.containers[0].3.devices[0].host_path,
        node.cfg.dev_dir.join("nvidia0").display().to_string()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_deleted_between_bind_and_allocate_gets_nothing_and_its_devices_are_clean_for_the_next()
 {
    let g = gpus(1, 81920);
    let mut node = TestNode::start(g.clone()).await.expect("node");
    let cs: Vec<PodContainer<'_>> = vec![("main", false, grant(&g[0].uuid, 8192, 300, 3))];
    node.put_pod(pod_json("ns", "gone", "u1", 0, &cs))
        .await
        .expect("pod");
    // Deleted from the API server after bind; kubelet still admits it.
    assert!(node.api.delete_pod("ns", "gone"));
    let mut c = node.client.clone();
    let adm = node
        .kubelet
        .admit(&mut c, "ns", "gone", &fake_containers(&cs))
        .await
        .expect("admit");
    let ids = adm.containers[0].2.clone();
    let e = FakeKubelet::prestart(&mut node.client, &ids)
        .await
        .expect_err("refused");
    assert_eq!(e.code(), Code::FailedPrecondition);
    assert!(
        e.message().contains("ns/gone") && e.message().contains("deleted"),
        "{}",
        e.message()
    );
    assert_eq!(node.read_quota(&ids), None);
    // Kubelet drops it; a new pod gets the same device IDs and its own quota.
    node.kubelet.remove_pod("ns", "gone");
    let e = FakeKubelet::prestart(&mut node.client, &ids)
        .await
        .expect_err("nobody holds them");
    assert_eq!(e.code(), Code::NotFound);
    let cs2: Vec<PodContainer<'_>> = vec![("main", false, grant(&g[0].uuid, 2048, 300, 3))];
    node.put_pod(pod_json("ns", "next", "u2", 1, &cs2))
        .await
        .expect("pod");
    let adm = node
        .kubelet
        .admit(&mut c, "ns", "next", &fake_containers(&cs2))
        .await
        .expect("admit");
    assert_eq!(adm.containers[0].2, ids, "kubelet reuses the freed devices");
    FakeKubelet::prestart(&mut node.client, &ids)
        .await
        .expect("prestart");
    let q = node.read_quota(&ids).expect("quota");
    assert_eq!((q.pod.as_str(), q.gpus[0].memory_mib), ("next", 2048));
}

fn mark_init_done(node: &TestNode, ns: &str, name: &str, init: &str) {
    let mut pod = node.api.pod(ns, name).expect("pod");
    pod["status"]["initContainerStatuses"] = json!([{
        "name": init, "ready": false, "restartCount": 0, "image": "x", "imageID": "",
        "state": {"terminated": {"exitCode": 0}},
    }]);
    node.api.put_pod(pod);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multi_container_and_init_container_pods() {
    let g = gpus(2, 81920);
    let mut node = TestNode::start(g.clone()).await.expect("node");
    let mut c = node.client.clone();
    // Init (2 slices on GPU 0), app "a" (3 on GPU 0, reuses the init's 2), app "b" (2 on GPU 1).
    let cs: Vec<PodContainer<'_>> = vec![
        ("setup", true, grant(&g[0].uuid, 1000, 200, 2)),
        ("a", false, grant(&g[0].uuid, 3000, 300, 3)),
        ("b", false, grant(&g[1].uuid, 2000, 200, 2)),
        ("sidecar", false, vec![]),
    ];
    node.put_pod(pod_json("ns", "multi", "um", 0, &cs))
        .await
        .expect("pod");
    let adm = node
        .kubelet
        .admit(&mut c, "ns", "multi", &fake_containers(&cs))
        .await
        .expect("admit");
    let ids = adm.ids();
    assert!(
        ids["setup"].iter().all(|i| ids["a"].contains(i)),
        "kubelet reused the init's devices"
    );
    FakeKubelet::prestart(&mut node.client, &ids["setup"])
        .await
        .expect("init prestart");
    let q = node.read_quota(&ids["setup"]).expect("init quota");
    assert_eq!(
        (q.container.as_str(), q.init, q.gpus[0].memory_mib),
        ("setup", true, 1000)
    );
    mark_init_done(&node, "ns", "multi", "setup");
    tokio::time::sleep(Duration::from_millis(50)).await;
    for (name, mem, uuid) in [("a", 3000, &g[0].uuid), ("b", 2000, &g[1].uuid)] {
        FakeKubelet::prestart(&mut node.client, &ids[name])
            .await
            .expect("app prestart");
        let q = node.read_quota(&ids[name]).expect("app quota");
        assert_eq!(
            (q.container.as_str(), q.init, q.gpus[0].memory_mib),
            (name, false, mem)
        );
        assert_eq!(&q.gpus[0].uuid, uuid);
    }

    // Init and app container with the same size: kubelet hands the app the very same IDs.
    let cs: Vec<PodContainer<'_>> = vec![
        ("init", true, grant(&g[1].uuid, 500, 100, 1)),
        ("main", false, grant(&g[1].uuid, 700, 100, 1)),
    ];
    node.put_pod(pod_json("ns", "same", "us", 1, &cs))
        .await
        .expect("pod");
    let adm = node
        .kubelet
        .admit(&mut c, "ns", "same", &fake_containers(&cs))
        .await
        .expect("admit");
    assert_eq!(adm.containers[0].2, adm.containers[1].2);
    let shared_ids = adm.containers[0].2.clone();
    FakeKubelet::prestart(&mut node.client, &shared_ids)
        .await
        .expect("init");
    let q = node.read_quota(&shared_ids).expect("quota");
    assert_eq!((q.container.as_str(), q.gpus[0].memory_mib), ("init", 500));
    // The init container finished, but its status reaches the API server only after
    // kubelet already asks for the app container: the plugin waits for it.
    let t0 = Instant::now();
    let mut c3 = node.client.clone();
    let ids3 = shared_ids.clone();
    let call = tokio::spawn(async move { FakeKubelet::prestart(&mut c3, &ids3).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    mark_init_done(&node, "ns", "same", "init");
    call.await.expect("task").expect("main");
    assert!(t0.elapsed() >= Duration::from_millis(300));
    let q = node.read_quota(&shared_ids).expect("quota");
    assert_eq!(
        (q.container.as_str(), q.init, q.gpus[0].memory_mib),
        ("main", false, 700)
    );
    FakeKubelet::prestart(&mut node.client, &shared_ids)
        .await
        .expect("main restarts");
    assert_eq!(
        node.read_quota(&shared_ids).expect("quota").container,
        "main"
    );

    // When the status never says, the call is refused as retryable, never guessed.
    let cs: Vec<PodContainer<'_>> = vec![
        ("init", true, grant(&g[0].uuid, 500, 100, 1)),
        ("main", false, grant(&g[0].uuid, 900, 100, 1)),
    ];
    node.put_pod(pod_json("ns", "silent", "ux", 2, &cs))
        .await
        .expect("pod");
    let adm = node
        .kubelet
        .admit(&mut c, "ns", "silent", &fake_containers(&cs))
        .await
        .expect("admit");
    let ids = adm.containers[0].2.clone();
    FakeKubelet::prestart(&mut node.client, &ids)
        .await
        .expect("init");
    let e = FakeKubelet::prestart(&mut node.client, &ids)
        .await
        .expect_err("cannot tell");
    assert_eq!(e.code(), Code::Unavailable, "{}", e.message());
    assert_eq!(node.read_quota(&ids).expect("quota").container, "init");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn devices_on_another_gpu_than_assigned_are_refused_not_guessed() {
    let g = gpus(2, 81920);
    let mut node = TestNode::start(g.clone()).await.expect("node");
    let cs: Vec<PodContainer<'_>> = vec![("main", false, grant(&g[1].uuid, 4096, 200, 2))];
    // Kubelet chose GPU 0 (e.g. without a preference): the handshake refuses.
    node.api.put_pod(pod_json("ns", "p", "u", 0, &cs));
    let ids: Vec<String> = (0..2).map(|s| format!("{}-{s}", g[0].uuid)).collect();
    let mut c = node.client.clone();
    let r = c
        .allocate(vgpu_device_plugin::kubelet::v1beta1::AllocateRequest {
            container_requests: vec![
                vgpu_device_plugin::kubelet::v1beta1::ContainerAllocateRequest {
                    devices_ids: ids.clone(),
                },
            ],
        })
        .await;
    r.expect("allocate");
    node.kubelet.record("ns", "p", "main", &ids);
    let t = Instant::now();
    let e = FakeKubelet::prestart(&mut node.client, &ids)
        .await
        .expect_err("mismatch refused");
    assert_eq!(e.code(), Code::FailedPrecondition);
    assert!(e.message().contains(&g[1].uuid), "{}", e.message());
    assert!(t.elapsed() < T);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compute_policy_and_priority_annotations_reach_the_quota_file_and_bad_ones_are_refused() {
    use vgpu_core::resources::{ANNOTATION_COMPUTE_POLICY, ANNOTATION_PRIORITY};
    use vgpu_core::sched_proto::{ComputePolicy, Priority};
    let g = gpus(1, 81920);
    let mut node = TestNode::start_with(g.clone(), |c| {
        c.latency_sensitive_namespaces = Some(["serving".to_owned()].into_iter().collect());
    })
    .await
    .expect("node");
    // (namespace, pod, annotations, expected: Ok((policy, priority)) or Err(words in the refusal))
    type Want = Result<(ComputePolicy, Priority), Vec<&'static str>>;
    type Case = (
        &'static str,
        &'static str,
        Vec<(&'static str, &'static str)>,
        Want,
    );
    let cases: Vec<Case> = vec![
        (
            "batch",
            "plain",
            vec![],
            Ok((ComputePolicy::Burst, Priority::BestEffort)),
        ),
        (
            "batch",
            "capped",
            vec![(ANNOTATION_COMPUTE_POLICY, "cap")],
            Ok((ComputePolicy::Cap, Priority::BestEffort)),
        ),
        (
            "serving",
            "fast",
            vec![
                (ANNOTATION_PRIORITY, "latency-sensitive"),
                (ANNOTATION_COMPUTE_POLICY, "burst"),
            ],
            Ok((ComputePolicy::Burst, Priority::LatencySensitive)),
        ),
        (
            "batch",
            "typo",
            vec![(ANNOTATION_COMPUTE_POLICY, "capped")],
            Err(vec![ANNOTATION_COMPUTE_POLICY, "\"capped\""]),
        ),
        (
            "batch",
            "sneaky",
            vec![(ANNOTATION_PRIORITY, "latency-sensitive")],
            Err(vec![ANNOTATION_PRIORITY, "\"batch\"", "serving"]),
        ),
    ];
    for (i, (ns, name, ann, want)) in cases.into_iter().enumerate() {
        let cs: Vec<PodContainer<'_>> = vec![("main", false, grant(&g[0].uuid, 8192, 100, 1))];
        let mut pod = pod_json(ns, name, &format!("uid-{name}"), i as u32, &cs);
        for (k, v) in ann {
            pod["metadata"]["annotations"][k] = json!(v);
        }
        node.put_pod(pod).await.expect("pod");
        let mut c = node.client.clone();
        let adm = node
            .kubelet
            .admit(&mut c, ns, name, &fake_containers(&cs))
            .await
            .expect("admit");
        let ids = adm.containers[0].2.clone();
        let r = FakeKubelet::prestart(&mut node.client, &ids).await;
        match want {
            Ok((policy, priority)) => {
                r.unwrap_or_else(|e| panic!("{ns}/{name}: {e:?}"));
                let q = node.read_quota(&ids).expect("quota written");
                assert_eq!((q.namespace.as_str(), q.pod.as_str()), (ns, name));
                assert_eq!(q.gpus[0].compute_policy, policy, "{ns}/{name}");
                assert_eq!(q.gpus[0].priority, priority, "{ns}/{name}");
            }
            Err(words) => {
                let e = r.expect_err("refused");
                assert_eq!(e.code(), Code::FailedPrecondition, "{ns}/{name}");
                for w in words {
                    assert!(
                        e.message().contains(w),
                        "{ns}/{name}: {w} not in {}",
                        e.message()
                    );
                }
                assert!(
                    node.read_quota(&ids).is_none(),
                    "no quota for a refused start"
                );
            }
        }
        node.kubelet.remove_pod(ns, name);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_memory_limit_annotation_reaches_the_quota_file_and_a_bad_one_refuses_the_start() {
    use vgpu_core::memory_limit::ANNOTATION_GPU_MEMORY_LIMIT;
    let g = gpus(1, 81920);
    let mut node = TestNode::start(g.clone()).await.expect("node");
    // (pod, annotation, expected: Ok(limit MiB) or Err(words in the refusal)); the
    // container "main" is granted 8192 MiB.
    type Case = (
        &'static str,
        Option<&'static str>,
        Result<u64, Vec<&'static str>>,
    );
    let cases: Vec<Case> = vec![
        ("plain", None, Ok(8192)),
        ("every", Some("16384"), Ok(16384)),
        ("named", Some("main=20000,side=9000"), Ok(20000)),
        ("others", Some("side=9000"), Ok(8192)),
        ("equal", Some("main=8192"), Ok(8192)),
        (
            "unit",
            Some("16Gi"),
            Err(vec![ANNOTATION_GPU_MEMORY_LIMIT, "\"16Gi\"", "MiB"]),
        ),
        (
            "garbage",
            Some("main=lots"),
            Err(vec![ANNOTATION_GPU_MEMORY_LIMIT, "\"main=lots\""]),
        ),
        (
            "below",
            Some("4096"),
            Err(vec![
                ANNOTATION_GPU_MEMORY_LIMIT,
                "\"main\"",
                "limit 4096 MiB",
                "request of 8192 MiB",
            ]),
        ),
    ];
    for (i, (name, ann, want)) in cases.into_iter().enumerate() {
        let cs: Vec<PodContainer<'_>> = vec![("main", false, grant(&g[0].uuid, 8192, 100, 1))];
        let mut pod = pod_json("ns", name, &format!("uid-{name}"), i as u32, &cs);
        if let Some(v) = ann {
            pod["metadata"]["annotations"][ANNOTATION_GPU_MEMORY_LIMIT] = json!(v);
        }
        node.put_pod(pod).await.expect("pod");
        let mut c = node.client.clone();
        let adm = node
            .kubelet
            .admit(&mut c, "ns", name, &fake_containers(&cs))
            .await
            .expect("admit");
        let ids = adm.containers[0].2.clone();
        let r = FakeKubelet::prestart(&mut node.client, &ids).await;
        match want {
            Ok(limit) => {
                r.unwrap_or_else(|e| panic!("{name}: {e:?}"));
                let q = node.read_quota(&ids).expect("quota written");
                assert_eq!(q.pod, name);
                let gq = &q.gpus[0];
                assert_eq!(
                    (gq.memory_mib, gq.memory_limit_mib, gq.limit_mib()),
                    (8192, Some(limit), limit),
                    "{name}"
                );
                assert_eq!(gq.is_burstable(), limit > 8192, "{name}");
            }
            Err(words) => {
                let e = r.expect_err("refused");
                assert_eq!(e.code(), Code::FailedPrecondition, "{name}");
                for w in words {
                    assert!(
                        e.message().contains(w),
                        "{name}: {w} not in {}",
                        e.message()
                    );
                }
                assert!(
                    node.read_quota(&ids).is_none(),
                    "no quota for a refused start"
                );
            }
        }
        node.kubelet.remove_pod("ns", name);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocation_directories_no_container_holds_are_removed_and_live_ones_kept() {
    use vgpu_device_plugin::gc;
    let g = gpus(2, 81920);
    // Grace 0: every directory is old enough; only kubelet's record and the API server
    // keep one.
    let mut node = TestNode::start_with(g.clone(), |c| c.gc_grace = Duration::ZERO)
        .await
        .expect("node");
    let mut c = node.client.clone();
    // "done": an app container; "init": an init container (never listed by kubelet)
    // and its app container on other devices; "pending": allocated, not started yet.
    let done: Vec<PodContainer<'_>> = vec![("main", false, grant(&g[0].uuid, 4096, 200, 2))];
    let init: Vec<PodContainer<'_>> = vec![
        ("setup", true, grant(&g[1].uuid, 4096, 100, 1)),
        ("main", false, grant(&g[0].uuid, 4096, 300, 3)),
    ];
    let mut dirs = BTreeMap::new();
    for (i, (name, cs)) in [("done", &done), ("init", &init)].into_iter().enumerate() {
        node.put_pod(pod_json("ns", name, &format!("uid-{name}"), i as u32, cs))
            .await
            .expect("pod");
        let adm = node
            .kubelet
            .admit(&mut c, "ns", name, &fake_containers(cs))
            .await
            .expect("admit");
        // Only the first container starts (the init container of "init", before its
        // app container): the app container's directory exists, nothing is written yet.
        for (n, _, ids, _) in &adm.containers {
            dirs.insert(
                format!("{name}/{n}"),
                node.handshake
                    .allocation_dir(ids.iter().map(String::as_str)),
            );
        }
        FakeKubelet::prestart(&mut node.client, &adm.containers[0].2)
            .await
            .expect("prestart");
    }
    assert_eq!(dirs.len(), 3);
    let r = gc::collect(&node.handshake).await.expect("a round");
    assert!(
        r.removed.is_empty(),
        "nothing removed while every pod lives: {r:?}"
    );
    assert_eq!(r.kept, 3);
    // "done" is deleted: kubelet drops it and the API server forgets it.
    node.kubelet.remove_pod("ns", "done");
    assert!(node.api.delete_pod("ns", "done"));
    let r = gc::collect(&node.handshake).await.expect("a round");
    assert_eq!(r.removed.len(), 1, "{r:?}");
    assert!(
        !dirs["done/main"].exists(),
        "the deleted pod's directory is gone"
    );
    assert!(
        dirs["init/setup"].exists(),
        "the running init container keeps its own"
    );
    assert!(
        dirs["init/main"].exists(),
        "a listed container keeps its own"
    );
    // A directory a new Allocate makes for the freed devices is young, so with a real
    // grace period nothing young is touched.
    let mut strict = (*node.cfg).clone();
    strict.gc_grace = Duration::from_secs(3600);
    let hs = vgpu_device_plugin::handshake::Handshake::new(
        std::sync::Arc::new(strict),
        node.api.client().expect("client"),
        None,
        node.gpus.subscribe(),
    );
    node.kubelet.remove_pod("ns", "init");
    assert!(node.api.delete_pod("ns", "init"));
    let r = gc::collect(&hs).await.expect("a round");
    assert!(r.removed.is_empty(), "young directories stay: {r:?}");
    let r = gc::collect(&node.handshake).await.expect("a round");
    assert_eq!(r.removed.len(), 2, "{r:?}");
    assert!(!dirs["init/setup"].exists() && !dirs["init/main"].exists());
}

/// The extender's decision for a pod alone on a node with GPUs `g`, as its bind makes
/// it from the policy core: the pod's ledger entries (reuse groups, ADR 0011), the
/// ledger's plan for them, one grant per container.
fn extender_assignment(
    g: &[GpuInfo],
    cs: &[(&'static str, ContainerKind, u32)],
) -> Vec<PodContainer<'static>> {
    let reqs: Vec<BTreeMap<String, String>> = cs
        .iter()
        .map(|(_, _, n)| BTreeMap::from([(RESOURCE_GPU.to_owned(), n.to_string())]))
        .collect();
    let request = parse_pod_request(
        cs.iter()
            .zip(&reqs)
            .map(|((name, kind, _), r)| (*name, *kind, r)),
        &BTreeMap::new(),
    )
    .expect("a pod the extender accepts");
    let slots = reuse::layout(&request.containers).expect("layout");
    let spec = NodeSpec {
        topology: Default::default(),
        name: NODE.into(),
        cpu_milli: 8000,
        memory_mib: 32768,
        gpus: g
            .iter()
            .map(|x| GpuSpec {
                uuid: x.uuid.clone(),
                model: x.model.clone(),
                memory_mib: x.memory_mib,
            })
            .collect(),
        slices_per_gpu: vgpu_core::resources::SLICES_PER_GPU,
    };
    let ledger = Ledger::with_nodes([spec]).expect("ledger");
    let task = Task {
        cpu_milli: 0,
        memory_mib: 0,
        gpus: slots.iter().map(|s| s.demand).collect(),
        models: Default::default(),
    };
    let grants = ledger.node(0).fit(&task).expect("fits");
    let per = reuse::expand(&request.containers, &slots, &grants, |i| {
        g[usize::from(i)].memory_mib
    });
    request
        .containers
        .iter()
        .zip(per)
        .map(|(c, gs)| {
            let name: &'static str = cs
                .iter()
                .find(|x| x.0 == c.name)
                .map(|x| x.0)
                .expect("name");
            (
                name,
                c.kind == ContainerKind::Init,
                gs.iter()
                    .map(|x| {
                        (
                            g[usize::from(x.gpu)].uuid.clone(),
                            x.memory_mib,
                            x.milli,
                            x.slices,
                        )
                    })
                    .collect(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn init_and_app_containers_start_on_the_extenders_gpus_whatever_kubelet_reuses() {
    let g = gpus(2, 81920);
    let node = TestNode::start(g.clone()).await.expect("node");
    let mut c = node.client.clone();
    let mut pc = node.client.clone();
    // An init container of 5 slices, then apps of 3 and 4: kubelet gives "train" 3 of
    // the init's 5 devices (in arbitrary order), "eval" the 2 left and 2 new ones.
    let cs: [(&'static str, ContainerKind, u32); 3] = [
        ("warmup", ContainerKind::Init, 5),
        ("train", ContainerKind::App, 3),
        ("eval", ContainerKind::App, 4),
    ];
    let pcs = extender_assignment(&g, &cs);
    let mut seen_draws = std::collections::BTreeSet::new();
    for round in 0..8u32 {
        node.kubelet
            .seed_reuse_order(u64::from(round).wrapping_mul(0x2545_f491_4f6c_dd1d) + 7);
        let name = format!("reuse-{round}");
        node.put_pod(pod_json(
            "ns",
            &name,
            &format!("u-reuse-{round}"),
            round,
            &pcs,
        ))
        .await
        .expect("pod");
        let adm = node
            .kubelet
            .admit(&mut c, "ns", &name, &fake_containers(&pcs))
            .await
            .expect("admit");
        let ids = adm.ids();
        assert!(
            ids["train"].iter().all(|i| ids["warmup"].contains(i)),
            "kubelet reused the init's devices"
        );
        seen_draws.insert(ids["train"].clone());
        let quota = |cname: &str| {
            let q = node.read_quota(&ids[cname]).expect("quota");
            let got: Vec<(String, u64, u32, u32)> = q
                .gpus
                .iter()
                .map(|x| (x.uuid.clone(), x.memory_mib, x.compute_milli, x.slices))
                .collect();
            (q.container, q.init, got)
        };
        FakeKubelet::prestart(&mut pc, &ids["warmup"])
            .await
            .expect("init prestart");
        assert_eq!(quota("warmup"), ("warmup".into(), true, pcs[0].2.clone()));
        mark_init_done(&node, "ns", &name, "warmup");
        tokio::time::sleep(Duration::from_millis(50)).await;
        for (cname, _, grants) in &pcs[1..] {
            FakeKubelet::prestart(&mut pc, &ids[*cname])
                .await
                .unwrap_or_else(|e| panic!("{cname} refused in round {round}: {e}"));
            assert_eq!(
                quota(cname),
                ((*cname).to_owned(), false, grants.clone()),
                "{cname} starts with the extender's grant"
            );
        }
        node.kubelet.remove_pod("ns", &name);
    }
    assert!(
        seen_draws.len() > 1,
        "kubelet's arbitrary order was exercised: {seen_draws:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_app_container_the_size_of_an_init_container_whose_status_lags_gets_its_own_quota() {
    let g = gpus(1, 81920);
    let mut node = TestNode::start(g.clone()).await.expect("node");
    let mut c = node.client.clone();
    // Three containers of 2 slices on one GPU: "a" takes exactly the init's devices from
    // kubelet's reuse pool, "b" gets others. Different memory tells their quotas apart.
    let cs: Vec<PodContainer<'_>> = vec![
        ("setup", true, grant(&g[0].uuid, 1000, 200, 2)),
        ("a", false, grant(&g[0].uuid, 3000, 200, 2)),
        ("b", false, grant(&g[0].uuid, 5000, 200, 2)),
    ];
    node.put_pod(pod_json("ns", "lag", "ul", 0, &cs))
        .await
        .expect("pod");
    let adm = node
        .kubelet
        .admit(&mut c, "ns", "lag", &fake_containers(&cs))
        .await
        .expect("admit");
    let ids = adm.ids();
    let set = |n: &str| {
        ids[n]
            .iter()
            .cloned()
            .collect::<std::collections::BTreeSet<_>>()
    };
    assert_eq!(
        set("setup"),
        set("a"),
        "a reuses exactly the init's devices"
    );
    assert!(
        set("setup").is_disjoint(&set("b")),
        "b has devices of its own"
    );
    FakeKubelet::prestart(&mut node.client, &ids["setup"])
        .await
        .expect("init");
    // The init container finished, but the API server does not say so (yet): "b" is
    // started on other devices than the init ran on, so it is "b", at once.
    let gets = node.api.gets();
    FakeKubelet::prestart(&mut node.client, &ids["b"])
        .await
        .expect("b");
    let q = node.read_quota(&ids["b"]).expect("quota");
    assert_eq!(
        (q.container.as_str(), q.init, q.gpus[0].memory_mib),
        ("b", false, 5000),
        "not the init container's quota"
    );
    // Decided from one read of the pod, without polling for the init's status.
    assert_eq!(node.api.gets() - gets, 1, "one GET of the pod");
    // "a" is on the init's very devices: the status decides, never a guess.
    let e = FakeKubelet::prestart(&mut node.client, &ids["a"])
        .await
        .expect_err("cannot tell yet");
    assert_eq!(e.code(), Code::Unavailable, "{}", e.message());
    mark_init_done(&node, "ns", "lag", "setup");
    tokio::time::sleep(Duration::from_millis(50)).await;
    FakeKubelet::prestart(&mut node.client, &ids["a"])
        .await
        .expect("a");
    let q = node.read_quota(&ids["a"]).expect("quota");
    assert_eq!(
        (q.container.as_str(), q.init, q.gpus[0].memory_mib),
        ("a", false, 3000)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sidecar_with_gpu_slices_gets_its_own_quota_beside_init_and_app_containers() {
    use vgpu_testkit::fake_kubelet::FakeContainer;
    let g = gpus(1, 81920);
    let mut node = TestNode::start(g.clone()).await.expect("node");
    let mut c = node.client.clone();
    // setup (init, 2 slices) fills kubelet's reuse pool; proxy (a sidecar, 1 slice) and
    // main (2 slices) take from it (kubelet 1.29+: sidecars are listed by PodResources
    // and their devices are never reused). All on the one GPU, as the extender groups them.
    let cs: Vec<PodContainer<'_>> = vec![
        ("setup", true, grant(&g[0].uuid, 1000, 200, 2)),
        ("proxy", true, grant(&g[0].uuid, 700, 100, 1)),
        ("main", false, grant(&g[0].uuid, 3000, 200, 2)),
    ];
    for seed in 0..6u64 {
        let name = format!("side{seed}");
        let mut pod = pod_json("ns", &name, &format!("u-{name}"), seed as u32, &cs);
        pod["spec"]["initContainers"][1]["restartPolicy"] = json!("Always");
        node.put_pod(pod).await.expect("pod");
        node.kubelet.seed_reuse_order(seed);
        let fake: Vec<FakeContainer> = fake_containers(&cs)
            .into_iter()
            .map(|mut f| {
                f.sidecar = f.name == "proxy";
                f
            })
            .collect();
        let adm = node
            .kubelet
            .admit(&mut c, "ns", &name, &fake)
            .await
            .expect("admit");
        let ids = adm.ids();
        // Kubelet's order: setup, then proxy (its status never says "done": it runs on),
        // then main while the API server still shows setup as not finished.
        for (who, mem, init) in [
            ("setup", 1000, true),
            ("proxy", 700, true),
            ("main", 3000, false),
        ] {
            FakeKubelet::prestart(&mut node.client, &ids[who])
                .await
                .unwrap_or_else(|e| panic!("seed {seed}: {who}: {e}"));
            let q = node.read_quota(&ids[who]).expect("quota");
            assert_eq!(
                (q.container.as_str(), q.init, q.gpus[0].memory_mib),
                (who, init, mem),
                "seed {seed}"
            );
        }
        // The sidecar restarts: its own devices, its own quota again.
        FakeKubelet::prestart(&mut node.client, &ids["proxy"])
            .await
            .expect("proxy restarts");
        assert_eq!(
            node.read_quota(&ids["proxy"]).expect("quota").container,
            "proxy"
        );
        node.kubelet.remove_pod("ns", &name);
    }
}
