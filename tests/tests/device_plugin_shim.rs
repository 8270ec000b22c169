//! End to end on one simulated node: the extender's assignment on a pod → the device
//! plugin's allocation and `PreStartContainer` (fake kubelet over real gRPC, fake API
//! server) → the container's quota file → a real CUDA process under `libvgpu.so` on
//! cuda-sim sees exactly that quota.
//!
//! The shim reads the quota file the plugin wrote (`vgpu.conf` in the container's
//! directory, mapped to devices by GPU UUID): no `VGPU_MEMORY_LIMIT` is set, so what
//! the container sees comes from the file alone. Everything is the real code path.

use std::path::Path;
use std::process::Command;

use vgpu_core::container_quota::{ContainerQuota, QUOTA_FILE};
use vgpu_core::inventory::GpuInfo;
use vgpu_device_plugin::testkit::fake_kubelet::FakeKubelet;
use vgpu_device_plugin::testkit::node::{PodContainer, TestNode, fake_containers, pod_json};
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
    // Two pods on the same GPU with different quotas, as the extender recorded them.
    let mut dirs = Vec::new();
    for (i, (name, mib, slices)) in [("small", 1000u64, 1u32), ("large", 3000, 4)]
        .into_iter()
        .enumerate()
    {
        let cs: Vec<PodContainer<'_>> = vec![(
            "main",
            false,
            vec![(uuid.to_owned(), mib, slices * 100, slices)],
        )];
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
        dirs.push((
            name,
            mib,
            node.handshake
                .allocation_dir(ids.iter().map(String::as_str)),
        ));
    }
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
