//! Each GPU's topology in the Node's inventory and in kubelet's device list, read from
//! NVML on the simulated presets: the DGX A100's NUMA nodes (3, 1, 7, 5 for its GPU pairs)
//! and NV12 fabric, the PCIe server's switch pairs. Needs the simulated driver
//! (`cargo xtask sim`).

use std::io::{BufRead, BufReader};
use std::process::Stdio;

use vgpu_core::inventory::{NodeInventory, NvLinkPeer};
use vgpu_device_plugin::plugin::devices;
use vgpu_tests::{SimNode, sim_lib_dir};

/// The first inventory `vgpu-device-plugin health` prints on a node of `preset`.
fn inventory(preset: &str) -> NodeInventory {
    let node = SimNode::new(&format!("preset = \"{preset}\"\n"));
    let mut child = node
        .command(crate::plugin_bin())
        .args(["health", "--nvml-lib"])
        .arg(sim_lib_dir().join("libnvidia-ml.so.1"))
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn the plugin's health command");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("piped"))
        .read_line(&mut line)
        .expect("read the inventory");
    let _ = child.kill();
    let _ = child.wait();
    NodeInventory::from_json(line.trim()).expect("an inventory line")
}

#[test]
fn dgx_a100_gpus_carry_numa_nodes_and_nvlink_peers() {
    let inv = inventory("dgx-a100");
    let numa: Vec<Option<u32>> = inv
        .gpus
        .iter()
        .map(|g| g.topology.as_ref().and_then(|t| t.numa_node))
        .collect();
    assert_eq!(numa, [3, 3, 1, 1, 7, 7, 5, 5].map(Some));
    let t0 = inv.gpus[0].topology.as_ref().expect("topology");
    assert!(
        t0.switch_peers.is_empty(),
        "PXB pairs share no single switch"
    );
    let peers: Vec<NvLinkPeer> = (1..8)
        .map(|index| NvLinkPeer { index, links: 12 })
        .collect();
    assert_eq!(t0.nvlink_peers, peers);
    // kubelet's view: every device ID of GPU 2 is on NUMA node 1.
    let devs = devices(&inv.gpus, inv.slices_per_gpu);
    let gpu2: Vec<_> = devs
        .iter()
        .filter(|d| d.id.starts_with(&inv.gpus[2].uuid))
        .collect();
    assert!(!gpu2.is_empty());
    for d in gpu2 {
        let t = d.topology.as_ref().expect("TopologyInfo");
        assert_eq!(t.nodes.iter().map(|n| n.id).collect::<Vec<_>>(), [1]);
    }
}

#[test]
fn pcie_server_gpus_carry_their_switch_pairs() {
    let inv = inventory("pcie-8gpu");
    let t = |i: usize| inv.gpus[i].topology.clone().expect("topology");
    assert_eq!(t(0).switch_peers, [1]);
    assert_eq!(t(5).switch_peers, [4]);
    assert_eq!(t(5).numa_node, Some(1));
    assert!(t(0).nvlink_peers.is_empty());
}
