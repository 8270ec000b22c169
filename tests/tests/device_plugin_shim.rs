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

use serde_json::json;
use vgpu_core::container_quota::{ContainerQuota, QUOTA_FILE};
use vgpu_core::inventory::GpuInfo;
use vgpu_core::resources::RESOURCE_GPU;
use vgpu_testkit::fake_kubelet::{FakeContainer, FakeKubelet};
use vgpu_testkit::node::TestNode;
use vgpu_tests::{SimNode, field, num, probe_bin, shim_lib};

use super::common;
use common::extender::{decide, extender_for};

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
        topology: None,
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
        let pod = json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"namespace": "ns", "name": name, "uid": uid,
                          "creationTimestamp": format!("2026-01-01T00:00:0{i}Z")},
            "spec": {"containers": [{"name": "main", "image": "x", "resources": {
                "requests": {RESOURCE_GPU: slices.to_string()},
                "limits": {RESOURCE_GPU: slices.to_string()}}}]},
            "status": {"phase": "Pending"},
        });
        let (pod, assignment) = decide(&extender, pod);
        let grant = &assignment.containers[0].gpus[0];
        assert_eq!((grant.uuid.as_str(), grant.slices), (uuid, slices));
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
