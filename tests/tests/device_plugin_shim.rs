//! End to end on one simulated node: the extender's decision (its state fed with the
//! Node inventory the plugin published, then filter, prioritize and bind, the code its
//! HTTP verbs run) → the assignment on the pod → the device plugin's allocation and
//! `PreStartContainer` (fake kubelet over real gRPC, fake API server) → the container's
//! quota file → a real CUDA process under `libvgpu.so` on cuda-sim sees exactly that
//! quota.
//!
//! The shim reads the quota file the plugin wrote (`vgpu.conf` in the container's
//! directory, mapped to devices by GPU UUID): no `VGPU_MEMORY_LIMIT` is set, so what
//! the container sees comes from the file alone. Everything is the real code path.

use std::path::Path;
use std::process::Command;

use k8s_openapi::api::core::v1::{Node, Pod};
use serde_json::json;
use vgpu_core::container_quota::{ContainerQuota, QUOTA_FILE};
use vgpu_core::inventory::GpuInfo;
use vgpu_core::resources::{ANNOTATION_ASSIGNMENT, Assignment, RESOURCE_GPU};
use vgpu_device_plugin::testkit::fake_kubelet::{FakeContainer, FakeKubelet};
use vgpu_device_plugin::testkit::node::{NODE, TestNode};
use vgpu_scheduler_extender::extender::policy::ExtenderPolicy;
use vgpu_scheduler_extender::extender::state::{Candidates, State, StateConfig};
use vgpu_scheduler_extender::extender::sync::WatchKind;
use vgpu_scheduler_extender::extender::types::ExtenderBindingArgs;
use vgpu_tests::{SimNode, field, num, probe_bin, shim_lib};

const MIB: u64 = 1 << 20;

/// The environment a container with this directory gets: the shim and its directory,
/// no memory limit (the quota comes from the file). Returns the file's record.
fn shim_env(cmd: &mut Command, dir: &Path) -> ContainerQuota {
    let q = ContainerQuota::from_json(
        &std::fs::read_to_string(dir.join(QUOTA_FILE)).expect("quota file"),
    )
    .expect("valid quota");
    cmd.env("LD_PRELOAD", shim_lib())
        .env("VGPU_CONTAINER_DIR", dir)
        .env_remove("VGPU_MEMORY_LIMIT");
    q
}

/// The extender's state with this node as its watch would see it, once the plugin has
/// published the node's GPU inventory.
async fn extender_for(node: &TestNode) -> State {
    let end = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let published = loop {
        if let Some(n) = node.api.node(NODE)
            && n["metadata"]["annotations"][vgpu_core::inventory::ANNOTATION_GPU_INVENTORY]
                .is_string()
        {
            break n;
        }
        assert!(
            std::time::Instant::now() < end,
            "the plugin did not publish the inventory"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    let mut obj = published;
    obj["apiVersion"] = json!("v1");
    obj["kind"] = json!("Node");
    obj["metadata"]["name"] = json!(NODE);
    // Kubelet reports the plugin's healthy devices as the node's allocatable resource.
    let healthy = node
        .kubelet
        .devices()
        .iter()
        .filter(|d| d.health == vgpu_device_plugin::kubelet::HEALTHY)
        .count();
    obj["status"]["allocatable"] = json!({RESOURCE_GPU: healthy.to_string()});
    obj["status"]["capacity"] = json!({RESOURCE_GPU: healthy.to_string()});
    let n: Node = serde_json::from_value(obj).expect("a Node");
    let state = State::new(
        StateConfig::default(),
        ExtenderPolicy::new(vgpu_core::packing::policy::PolicyName::Vgpu),
    );
    state.replace_nodes(&[n]);
    state.replace_pods(&[]);
    state.mark_synced(WatchKind::Nodes);
    state.mark_synced(WatchKind::Pods);
    state
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_container_sees_exactly_the_quota_its_pod_was_assigned() {
    let sim = SimNode::new(
        r#"
        [[device]]
        memory = "8Gi"
        context_overhead = "300Mi"
        alloc_granularity = "2Mi"
        "#,
    );
    let uuid = "GPU-51570000-0000-4000-8000-000000000000";
    let gpus = vec![GpuInfo {
        index: 0,
        uuid: uuid.into(),
        model: "NVIDIA H100 80GB HBM3".into(),
        memory_mib: 8192,
        healthy: true,
    }];
    let mut node = TestNode::start(gpus).await.expect("node");
    // The extender's view of the node: the Node object with the GPU inventory the plugin
    // published on it (the annotation the extender's node watch reads).
    let extender = extender_for(&node).await;
    // Two pods on the same GPU with different requests (1 and 4 slices): the extender
    // decides their GPUs and quotas at bind, exactly as its HTTP verbs do.
    let mut dirs = Vec::new();
    for (i, (name, slices)) in [("small", 1u32), ("large", 4)].into_iter().enumerate() {
        let uid = format!("uid-{name}");
        let mut pod = json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"namespace": "ns", "name": name, "uid": uid,
                          "creationTimestamp": format!("2026-01-01T00:00:0{i}Z")},
            "spec": {"containers": [{"name": "main", "image": "x", "resources": {
                "requests": {RESOURCE_GPU: slices.to_string()},
                "limits": {RESOURCE_GPU: slices.to_string()}}}]},
            "status": {"phase": "Pending"},
        });
        let typed: Pod = serde_json::from_value(pod.clone()).expect("a Pod");
        let candidates = Candidates { names: vec![NODE] };
        let f = extender.filter(&typed, &candidates).expect("filter");
        assert_eq!(f.feasible, [0], "{name}: the node fits: {f:?}");
        extender
            .prioritize(&typed, &candidates)
            .expect("prioritize");
        let plan = extender
            .begin_bind(&ExtenderBindingArgs {
                pod_name: name.into(),
                pod_namespace: "ns".into(),
                pod_uid: uid.clone(),
                node: NODE.into(),
            })
            .expect("bind");
        let assignment = Assignment::from_json(&plan.assignment_json).expect("assignment");
        let grant = &assignment.containers[0].gpus[0];
        assert_eq!((grant.uuid.as_str(), grant.slices), (uuid, slices));
        // What the binder writes: the record, then the Binding (spec.nodeName).
        pod["metadata"]["annotations"] = json!({ANNOTATION_ASSIGNMENT: plan.assignment_json});
        pod["spec"]["nodeName"] = json!(NODE);
        let bound: Pod = serde_json::from_value(pod.clone()).expect("a Pod");
        extender.apply_pod(&bound);
        extender.finish_bind(&uid);
        node.put_pod(pod).await.expect("pod");
        let mut c = node.client.clone();
        let cs = [FakeContainer {
            name: "main".into(),
            slices: slices as usize,
            init: false,
            sidecar: false,
        }];
        let adm = node
            .kubelet
            .admit(&mut c, "ns", name, &cs)
            .await
            .expect("admit");
        let ids = adm.containers[0].2.clone();
        FakeKubelet::prestart(&mut node.client, &ids)
            .await
            .expect("PreStartContainer");
        dirs.push((
            name,
            grant.memory_mib,
            node.handshake
                .allocation_dir(ids.iter().map(String::as_str)),
        ));
    }
    assert!(
        dirs[0].1 < dirs[1].1,
        "quotas in proportion to the requests: {dirs:?}"
    );
    for (name, mib, dir) in &dirs {
        let mut cmd = sim.command(probe_bin());
        let q = shim_env(&mut cmd, dir);
        assert_eq!((q.pod.as_str(), q.gpus[0].memory_mib), (*name, *mib));
        let out = cmd
            .args(["init", "meminfo", "alloc-until-oom", "2097152"])
            .output()
            .expect("run cuda-probe");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{name}: {text}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(
            num(&text, "total"),
            mib * MIB,
            "{name} sees its quota: {text}"
        );
        // Allocations stop at the quota (the context is charged inside it).
        let allocated = num(&text, "allocated");
        assert!(allocated > 0 && allocated <= mib * MIB, "{name}: {text}");
        assert_eq!(
            field(&text, "code").as_deref(),
            Some("2"),
            "out of memory: {text}"
        );
        println!(
            "{name}: quota {mib} MiB, total {} MiB, allocated until OOM {} MiB",
            num(&text, "total") / MIB,
            allocated / MIB
        );
    }
}
