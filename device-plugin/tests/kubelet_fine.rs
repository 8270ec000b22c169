//! Fine sharing (ADR 0023) against the fake kubelet over the real protocols: a plugin
//! configured for 100 slices per GPU advertises 100 device IDs per GPU; 100 containers
//! of 1 % start on one GPU with their own quotas; kubelet's own count refuses a 101st,
//! and a container the extender never placed (no assignment) that takes a freed device
//! is refused at `PreStartContainer`: never more containers on a GPU than granted.

use std::collections::BTreeSet;
use std::time::Duration;

use tonic::Code;
use vgpu_core::resources::ANNOTATION_ASSIGNMENT;
use vgpu_testkit::fake_kubelet::FakeKubelet;
use vgpu_testkit::node::{PodContainer, TestNode, fake_containers, gpus, pod_json};

const T: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_hundred_containers_of_one_percent_share_a_gpu_and_not_one_more() {
    let g = gpus(2, 81920);
    let node = TestNode::start_with(g.clone(), |c| c.slices_per_gpu = 100)
        .await
        .expect("node");
    node.kubelet
        .wait_devices("100 device IDs per GPU", T, |d| d.len() == 200)
        .await
        .expect("devices");
    let ids: BTreeSet<String> = node.kubelet.devices().into_iter().map(|d| d.id).collect();
    assert_eq!(ids.len(), 200, "distinct IDs");
    assert!(ids.contains(&format!("{}-99", g[1].uuid)) && ids.iter().all(|i| i.len() <= 63));

    // A second GPU is there, but the extender placed every container on GPU 0; the
    // preference steers kubelet there (GetPreferredAllocation).
    let mut client = node.client.clone();
    let mut started = Vec::new();
    for i in 0..100u32 {
        let name = format!("nb-{i}");
        let cs: Vec<PodContainer<'_>> = vec![(
            "main",
            false,
            vec![(g[0].uuid.clone(), 500 + u64::from(i), 10, 1)],
        )];
        let adm = node
            .place(&mut client, ("ns", &name, &format!("uid-{i}"), i), &cs)
            .await
            .unwrap_or_else(|e| panic!("{name} admitted: {e}"));
        let (_, _, ids, _) = adm.containers.into_iter().next().expect("one container");
        assert!(ids[0].starts_with(&g[0].uuid), "{name} on GPU 0: {ids:?}");
        FakeKubelet::prestart(&mut client, &ids)
            .await
            .unwrap_or_else(|s| panic!("PreStartContainer for {name}: {s}"));
        let q = node.read_quota(&ids).expect("quota written");
        assert_eq!(
            (
                q.pod.as_str(),
                q.gpus[0].compute_milli,
                q.gpus[0].memory_mib
            ),
            (name.as_str(), 10, 500 + u64::from(i))
        );
        started.push(ids);
    }

    // A 101st container on GPU 0, even with a record that says so: kubelet has no device
    // of that GPU left and would have to use GPU 1, which the plugin refuses at start.
    let cs: Vec<PodContainer<'_>> = vec![("main", false, vec![(g[0].uuid.clone(), 500, 10, 1)])];
    let adm = node
        .place(&mut client, ("ns", "nb-100", "uid-100", 100), &cs)
        .await
        .expect("kubelet admits on the other GPU's devices");
    let (_, _, ids, _) = adm.containers.into_iter().next().expect("one container");
    assert!(ids[0].starts_with(&g[1].uuid), "{ids:?}");
    let s = FakeKubelet::prestart(&mut client, &ids)
        .await
        .expect_err("a container on a GPU it was not granted is refused");
    assert_eq!(s.code(), Code::FailedPrecondition, "{s}");
    assert!(node.read_quota(&ids).is_none());
    node.kubelet.remove_pod("ns", "nb-100");

    // One container leaves GPU 0; a pod the extender never placed (no assignment)
    // takes the freed device from kubelet and is refused at PreStartContainer.
    node.kubelet.remove_pod("ns", "nb-0");
    let mut pod = pod_json("ns", "rogue", "uid-rogue", 101, &cs);
    pod["metadata"]["annotations"]
        .as_object_mut()
        .expect("annotations")
        .remove(ANNOTATION_ASSIGNMENT);
    node.put_pod(pod).await.expect("pod");
    let adm = node
        .kubelet
        .admit(&mut client, "ns", "rogue", &fake_containers(&cs))
        .await
        .expect("kubelet counts devices only");
    let (_, _, ids, _) = adm.containers.into_iter().next().expect("one container");
    let s = FakeKubelet::prestart(&mut client, &ids)
        .await
        .expect_err("a container without an assignment is refused");
    assert_eq!(s.code(), Code::FailedPrecondition, "{s}");
    assert!(
        s.message().contains("no vgpu.io/assignment annotation"),
        "{s}"
    );
    assert!(node.read_quota(&ids).is_none(), "no quota for it");

    // The 99 containers still there each still hold their own quota.
    for (i, ids) in started.iter().enumerate().skip(1) {
        let q = node.read_quota(ids).expect("quota kept");
        assert_eq!(q.pod, format!("nb-{i}"));
    }
}
