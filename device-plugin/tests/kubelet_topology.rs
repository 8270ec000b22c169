//! kubelet's Topology Manager view: the fake kubelet, speaking the real DevicePlugin
//! protocol, receives each device ID with its GPU's NUMA node in `TopologyInfo` (what
//! `single-numa-node` aligns CPUs with), and none where the GPU's node is unknown.

use std::time::Duration;

use vgpu_core::inventory::GpuTopology;
use vgpu_testkit::node::{TestNode, gpus};

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
