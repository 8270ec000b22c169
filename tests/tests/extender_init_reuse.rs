//! End to end, init containers (ADR 0011): the extender's decision (filter, prioritize,
//! bind: the code its HTTP verbs run) for a pod whose init container and app containers
//! ask for different numbers of slices → the assignment on the pod → the fake kubelet
//! admits it, taking the init container's devices for the app containers in an
//! arbitrary (seeded) order as kubelet does → the device plugin's `PreStartContainer`
//! hands every container exactly the grant the extender wrote, in every order.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use serde_json::{Value, json};
use vgpu_core::container_quota::{ContainerQuota, QUOTA_FILE};
use vgpu_core::inventory::GpuInfo;
use vgpu_core::resources::RESOURCE_GPU;
use vgpu_testkit::fake_kubelet::{FakeContainer, FakeKubelet};
use vgpu_testkit::node::TestNode;

use super::common;
use common::extender::{decide, extender_for};

fn container(name: &str, slices: u32) -> Value {
    json!({"name": name, "image": "x", "resources": {
        "requests": {RESOURCE_GPU: slices.to_string()},
        "limits": {RESOURCE_GPU: slices.to_string()}}})
}

fn quota(node: &TestNode, ids: &[String]) -> ContainerQuota {
    let dir = node
        .handshake
        .allocation_dir(ids.iter().map(String::as_str));
    ContainerQuota::from_json(&std::fs::read_to_string(dir.join(QUOTA_FILE)).expect("quota"))
        .expect("a valid quota record")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn init_and_app_containers_start_with_the_extenders_grants_whatever_kubelet_reuses() {
    let gpus: Vec<GpuInfo> = (0..2)
        .map(|i| GpuInfo {
            index: i,
            uuid: format!("GPU-{i:08x}-0000-4000-8000-000000000000"),
            model: "NVIDIA A100-SXM4-80GB".into(),
            memory_mib: 81920,
            healthy: true,
            topology: None,
        })
        .collect();
    let node = TestNode::start(gpus).await.expect("node");
    let extender = extender_for(&node).await;
    // Another pod holds half of one GPU, so the GPUs differ for the policy.
    let (other, _) = decide(
        &extender,
        json!({"apiVersion": "v1", "kind": "Pod",
               "metadata": {"namespace": "ns", "name": "other", "uid": "uid-other",
                            "creationTimestamp": "2026-01-01T00:00:00Z"},
               "spec": {"containers": [container("main", 5)]},
               "status": {"phase": "Pending"}}),
    );
    node.put_pod(other).await.expect("pod");
    let mut c = node.client.clone();
    let adm = node
        .kubelet
        .admit(
            &mut c,
            "ns",
            "other",
            &[FakeContainer {
                name: "main".into(),
                slices: 5,
                init: false,
                sidecar: false,
            }],
        )
        .await
        .expect("admit");
    FakeKubelet::prestart(&mut c, &adm.containers[0].2)
        .await
        .expect("other starts");

    // Init 5 slices, apps 3 and 4: kubelet hands "train" 3 of the init's 5 devices (in
    // arbitrary order), "eval" the 2 left and 2 new ones.
    let mut draws = BTreeSet::new();
    for round in 0..8u32 {
        node.kubelet
            .seed_reuse_order(u64::from(round).wrapping_mul(0x2545_f491_4f6c_dd1d) + 3);
        let name = format!("reuse-{round}");
        let uid = format!("uid-{name}");
        let (pod, record) = decide(
            &extender,
            json!({"apiVersion": "v1", "kind": "Pod",
                   "metadata": {"namespace": "ns", "name": name, "uid": uid,
                                "creationTimestamp": format!("2026-01-01T00:01:{round:02}Z")},
                   "spec": {"initContainers": [container("warmup", 5)],
                            "containers": [container("train", 3), container("eval", 4)]},
                   "status": {"phase": "Pending"}}),
        );
        node.put_pod(pod.clone()).await.expect("pod");
        let cs: Vec<FakeContainer> = [("warmup", 5, true), ("train", 3, false), ("eval", 4, false)]
            .into_iter()
            .map(|(n, s, init)| FakeContainer {
                name: n.into(),
                slices: s,
                init,
                sidecar: false,
            })
            .collect();
        let adm = node
            .kubelet
            .admit(&mut c, "ns", &name, &cs)
            .await
            .expect("admit");
        let ids: BTreeMap<String, Vec<String>> = adm
            .containers
            .iter()
            .map(|(n, _, i, _)| (n.clone(), i.clone()))
            .collect();
        draws.insert(ids["train"].clone());
        let expect = |cname: &str, init: bool, q: ContainerQuota| {
            let grant = record.container(cname).expect("grant");
            let got: Vec<(String, u64, u32, u32)> = q
                .gpus
                .iter()
                .map(|g| (g.uuid.clone(), g.memory_mib, g.compute_milli, g.slices))
                .collect();
            let want: Vec<(String, u64, u32, u32)> = grant
                .gpus
                .iter()
                .map(|g| (g.uuid.clone(), g.memory_mib, g.compute_milli, g.slices))
                .collect();
            assert_eq!(
                (q.container.as_str(), q.init),
                (cname, init),
                "round {round}"
            );
            assert_eq!(got, want, "{cname} in round {round}");
        };
        FakeKubelet::prestart(&mut c, &ids["warmup"])
            .await
            .expect("init starts");
        expect("warmup", true, quota(&node, &ids["warmup"]));
        // The init container finished.
        let mut done = node.api.pod("ns", &name).expect("pod");
        done["status"]["initContainerStatuses"] = json!([{
            "name": "warmup", "ready": false, "restartCount": 0, "image": "x", "imageID": "",
            "state": {"terminated": {"exitCode": 0}},
        }]);
        node.api.put_pod(done);
        tokio::time::sleep(Duration::from_millis(50)).await;
        for cname in ["train", "eval"] {
            FakeKubelet::prestart(&mut c, &ids[cname])
                .await
                .unwrap_or_else(|e| panic!("{cname} refused in round {round}: {e}"));
            expect(cname, false, quota(&node, &ids[cname]));
        }
        // The pod ends: kubelet and the extender free its devices.
        node.kubelet.remove_pod("ns", &name);
        extender.delete_pod(&serde_json::from_value(pod).expect("a Pod"));
    }
    assert!(
        draws.len() > 1,
        "kubelet's arbitrary order was exercised: {draws:?}"
    );
}
