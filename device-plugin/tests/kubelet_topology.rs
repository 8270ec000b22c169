//! kubelet's Topology Manager view: the fake kubelet, speaking the real DevicePlugin
//! protocol, receives each device ID with its GPU's NUMA node in `TopologyInfo` (what
//! `single-numa-node` aligns CPUs with), and none where the GPU's node is unknown; its
//! Topology Manager (`vgpu_testkit::topology_manager`) turns them into hints, admits or
//! refuses as `single-numa-node` does, and offers `GetPreferredAllocation` the aligned
//! devices only, where the plugin keeps to them. Without an extender assignment to steer
//! by, a request that needs several GPUs gets the best-connected ones, must-include
//! devices kept.

use std::time::Duration;

use vgpu_core::inventory::{GpuInfo, GpuTopology, NvLinkPeer};
use vgpu_device_plugin::ids::parse_device_id;
use vgpu_device_plugin::kubelet::v1beta1::{
    ContainerPreferredAllocationRequest, PreferredAllocationRequest,
};
use vgpu_testkit::fake_kubelet::FakeContainer;
use vgpu_testkit::node::{TestNode, gpus};
use vgpu_testkit::topology_manager::{Hint, device_hints, single_numa_node, split_by_affinity};

const T: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listed_devices_carry_their_gpus_numa_node() {
    let mut list = gpus(3, 81920);
    list[0].topology = Some(GpuTopology {
        numa_node: Some(3),
        ..GpuTopology::default()
    });
    list[1].topology = Some(GpuTopology {
        numa_node: Some(1),
        ..GpuTopology::default()
    });
    let node = TestNode::start(list.clone()).await.expect("node");
    node.kubelet
        .wait_registered(1, T)
        .await
        .expect("registered");
    let devs = node
        .kubelet
        .wait_devices("30 devices", T, |d| d.len() == 30)
        .await
        .expect("devices");
    for d in &devs {
        let numa: Vec<i64> = d
            .topology
            .as_ref()
            .map(|t| t.nodes.iter().map(|n| n.id).collect())
            .unwrap_or_default();
        let want: Vec<i64> = if d.id.starts_with(&list[0].uuid) {
            vec![3]
        } else if d.id.starts_with(&list[1].uuid) {
            vec![1]
        } else {
            vec![]
        };
        assert_eq!(numa, want, "{}", d.id);
    }
}

/// The GPUs' NVML indices among `ids`, ascending, once each.
fn gpu_indices(node: &[GpuInfo], ids: &[String]) -> Vec<u32> {
    let mut v: Vec<u32> = ids
        .iter()
        .map(|i| {
            let (uuid, _) = parse_device_id(i).expect("our device ID");
            node.iter()
                .find(|g| g.uuid == uuid)
                .expect("a node GPU")
                .index
        })
        .collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// Every slot of GPU `g`.
fn slots(node: &[GpuInfo], g: usize) -> Vec<String> {
    (0..10).map(|s| format!("{}-{s}", node[g].uuid)).collect()
}

/// A DGX A100's shape: NUMA nodes 3, 3, 1, 1, 7, 7, 5, 5, every pair NV12.
fn dgx_a100() -> Vec<GpuInfo> {
    let mut list = gpus(8, 81920);
    for (i, g) in list.iter_mut().enumerate() {
        g.topology = Some(GpuTopology {
            numa_node: Some([3, 3, 1, 1, 7, 7, 5, 5][i]),
            switch_peers: Vec::new(),
            nvlink_peers: (0..8u32)
                .filter(|&j| j as usize != i)
                .map(|index| NvLinkPeer { index, links: 12 })
                .collect(),
        });
    }
    list
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_numa_node_hints_admission_and_the_aligned_preferred_allocation() {
    let list = dgx_a100();
    let mut node = TestNode::start(list.clone()).await.expect("node");
    let devs = node
        .kubelet
        .wait_devices("80 devices", T, |d| d.len() == 80)
        .await
        .expect("devices");
    let all: Vec<String> = devs.iter().map(|d| d.id.clone()).collect();

    // Two whole GPUs (20 slices): each NUMA node holds two GPUs, so every single node is
    // a preferred hint, pairs of nodes are hints but not preferred.
    let hints = device_hints(&devs, &all, &[], 20).expect("devices carry topology");
    let mut preferred: Vec<Vec<i64>> = hints
        .iter()
        .filter(|h: &&Hint| h.preferred)
        .map(|h| h.numa.clone())
        .collect();
    preferred.sort();
    assert_eq!(preferred, [vec![1], vec![3], vec![5], vec![7]]);
    assert!(hints.iter().any(|h| h.numa == [1, 3] && !h.preferred));
    assert_eq!(single_numa_node(Some(&hints)), Ok(Some(1)));
    // Three whole GPUs fit no NUMA node: `single-numa-node` refuses the pod.
    let hints30 = device_hints(&devs, &all, &[], 30).expect("hints");
    assert!(hints30.iter().all(|h| h.numa.len() >= 2));
    assert!(single_numa_node(Some(&hints30)).is_err());

    // NUMA node 1 (GPUs 2, 3) has a slice taken: it can no longer hold two whole GPUs,
    // so the hint is node 3, and the plugin is offered (and keeps to) GPUs 0 and 1.
    let mut available = all.clone();
    available.retain(|i| *i != format!("{}-0", list[2].uuid));
    let hints = device_hints(&devs, &available, &[], 20).expect("hints");
    assert!(!hints.iter().any(|h| h.numa == [1]));
    let numa = single_numa_node(Some(&hints))
        .expect("admitted")
        .expect("a NUMA node");
    assert_eq!(numa, 3);
    let (aligned, unaligned, none) = split_by_affinity(&devs, &available, numa);
    assert_eq!((aligned.len(), unaligned.len(), none.len()), (20, 59, 0));
    let mut client = node.client.clone();
    let pref = client
        .get_preferred_allocation(PreferredAllocationRequest {
            container_requests: vec![ContainerPreferredAllocationRequest {
                available_device_i_ds: aligned.clone(),
                must_include_device_i_ds: Vec::new(),
                allocation_size: 20,
            }],
        })
        .await
        .expect("GetPreferredAllocation")
        .into_inner();
    let ids = &pref.container_responses[0].device_i_ds;
    assert_eq!(ids.len(), 20);
    assert!(ids.iter().all(|i| aligned.contains(i)), "{ids:?}");
    assert_eq!(gpu_indices(&list, ids), [0, 1]);

    // Devices without a NUMA node: kubelet has no hint to give (any node will do).
    list_without_numa(&mut node).await;
}

/// With no GPU's NUMA node known, the devices carry no `TopologyInfo` and the device
/// manager gives no hints: `single-numa-node` admits without alignment.
async fn list_without_numa(node: &mut TestNode) {
    let plain = gpus(2, 81920);
    node.gpus
        .send(plain.clone())
        .expect("the plugin watches the GPU list");
    let devs = node
        .kubelet
        .wait_devices("20 devices without topology", T, |d| {
            d.len() == 20 && d.iter().all(|x| x.topology.is_none())
        })
        .await
        .expect("devices");
    let all: Vec<String> = devs.iter().map(|d| d.id.clone()).collect();
    assert_eq!(device_hints(&devs, &all, &[], 10), None);
    assert_eq!(single_numa_node(None), Ok(None));
}

/// 8 GPUs, two per PCIe switch, four per NUMA node (the `pcie-8gpu` preset's shape).
fn pcie8() -> Vec<GpuInfo> {
    let mut list = gpus(8, 46068);
    for (i, g) in list.iter_mut().enumerate() {
        let i = u32::try_from(i).expect("8 GPUs");
        g.topology = Some(GpuTopology {
            numa_node: Some(i / 4),
            switch_peers: vec![i ^ 1],
            nvlink_peers: Vec::new(),
        });
    }
    list
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_an_assignment_multi_gpu_requests_get_connected_gpus_and_keep_must_include() {
    let list = pcie8();
    let node = TestNode::start(list.clone()).await.expect("node");
    node.kubelet
        .wait_devices("80 devices", T, |d| d.len() == 80)
        .await
        .expect("devices");
    // Another pod holds a slice of GPUs 0 and 2 and all of GPU 5: whole GPUs left are
    // 1, 3 (NUMA 0, different switches), 4 (NUMA 1) and 6, 7 (one switch, NUMA 1).
    let mut taken = vec![format!("{}-0", list[0].uuid), format!("{}-0", list[2].uuid)];
    taken.extend(slots(&list, 5));
    node.kubelet.record("other", "busy", "main", &taken);
    let c = |name: &str, slices: usize, init: bool| FakeContainer {
        name: name.to_owned(),
        slices,
        init,
        sidecar: false,
    };
    // No pod on the API server: nothing to steer by.
    let mut client = node.client.clone();
    let two = node
        .kubelet
        .admit(&mut client, "ml", "trainer", &[c("main", 20, false)])
        .await
        .expect("admitted");
    let ids = &two.containers[0].2;
    assert_eq!(ids.len(), 20);
    assert_eq!(
        gpu_indices(&list, ids),
        [6, 7],
        "the free switch pair, not the first two free GPUs (1 and 3)"
    );
    // An init container takes one whole GPU (packing: the first of 1, 3, 4), then the
    // app container of two whole GPUs must include those devices: its partner is 3
    // (same NUMA node), not 4 across the sockets.
    let pod = node
        .kubelet
        .admit(
            &mut client,
            "ml",
            "with-init",
            &[c("setup", 10, true), c("main", 20, false)],
        )
        .await
        .expect("admitted");
    let setup = &pod.containers[0].2;
    let main = &pod.containers[1].2;
    assert_eq!(gpu_indices(&list, setup), [1]);
    assert!(setup.iter().all(|i| main.contains(i)), "{main:?}");
    assert_eq!(gpu_indices(&list, main), [1, 3]);
    assert_eq!(
        slots(&list, 3).iter().filter(|i| main.contains(i)).count(),
        10
    );
}
