//! Each GPU's place in the node's topology, read from NVML once at discovery: its NUMA
//! node (memory affinity), the GPUs under the same PCIe switch, and its NVLink peers. It
//! goes into the Node's GPU inventory (`vgpu_core::inventory::GpuTopology`) and, as the
//! NUMA node, into the `TopologyInfo` of the devices kubelet lists (`ListAndWatch`), so
//! that kubelet's Topology Manager can align a container's CPUs with its GPUs.
//!
//! Best effort: a driver that does not answer a query leaves that part unknown, never
//! fails discovery.

use std::ffi::c_ulong;

use nvml_wrapper::Nvml;
use nvml_wrapper::enum_wrappers::device::TopologyLevel;
use tracing::debug;
use vgpu_core::inventory::{GpuTopology, NvLinkPeer};

/// Link numbers asked about (CUDA 13's `NVML_NVLINK_MAX_LINKS`).
const MAX_LINKS: u32 = 36;
/// `unsigned long`s of the NUMA node mask asked for (4096 nodes).
const MASK_WORDS: usize = 64;
/// `NVML_AFFINITY_SCOPE_NODE`.
const SCOPE_NODE: u32 = 0;

/// The lowest set bit of an NVML bitmask.
pub fn first_bit(mask: &[c_ulong]) -> Option<u32> {
    let width = c_ulong::BITS;
    mask.iter().enumerate().find_map(|(w, &m)| {
        (m != 0).then(|| {
            u32::try_from(w).unwrap_or(u32::MAX).saturating_mul(width) + m.trailing_zeros()
        })
    })
}

/// NVLink peers from each GPU's links: `to[a]` lists the GPU index at the far end of each
/// of GPU a's links that ends at a GPU, `fabric[a]` counts its links into an NVSwitch
/// fabric (a far end that is no GPU). Two GPUs that both have fabric links reach each
/// other over the smaller number of them, as `nvidia-smi topo` counts.
pub fn nvlink_peers(to: &[Vec<u32>], fabric: &[u32], a: usize) -> Vec<NvLinkPeer> {
    (0..to.len())
        .filter(|&b| b != a)
        .filter_map(|b| {
            let direct = to[a].iter().filter(|&&p| p as usize == b).count();
            let through = if fabric[a] > 0 && fabric[b] > 0 {
                fabric[a].min(fabric[b])
            } else {
                0
            };
            let links = u32::try_from(direct).unwrap_or(u32::MAX) + through;
            (links > 0).then(|| NvLinkPeer {
                index: u32::try_from(b).unwrap_or(u32::MAX),
                links,
            })
        })
        .collect()
}

/// Reads every GPU's topology (`count` GPUs, NVML indices `0..count`).
pub fn discover(nvml: &Nvml, count: u32) -> Vec<Option<GpuTopology>> {
    let mut buses = Vec::new();
    for i in 0..count {
        let bus = nvml
            .device_by_index(i)
            .and_then(|d| d.pci_info())
            .map(|p| p.bus_id);
        match bus {
            Ok(b) => buses.push(b),
            Err(e) => {
                debug!(gpu = i, error = %e, "no PCI info: topology unknown");
                return vec![None; count as usize];
            }
        }
    }
    let mut to = vec![Vec::new(); count as usize];
    let mut fabric = vec![0u32; count as usize];
    for i in 0..count {
        let Ok(d) = nvml.device_by_index(i) else {
            continue;
        };
        for link in 0..MAX_LINKS {
            let w = d.link_wrapper_for(link);
            if !matches!(w.is_active(), Ok(true)) {
                continue;
            }
            match w.remote_pci_info() {
                Ok(p) => match buses.iter().position(|b| *b == p.bus_id) {
                    Some(peer) => to[i as usize].push(u32::try_from(peer).unwrap_or(u32::MAX)),
                    None => fabric[i as usize] += 1,
                },
                Err(e) => debug!(gpu = i, link, error = %e, "NVLink remote unknown"),
            }
        }
    }
    (0..count)
        .map(|i| {
            let d = nvml.device_by_index(i).ok()?;
            let numa_node = d
                .memory_affinity(MASK_WORDS, SCOPE_NODE)
                .ok()
                .and_then(|m| first_bit(&m));
            let switch_peers = d
                .topology_nearest_gpus(TopologyLevel::Single)
                .map(|v| {
                    let mut peers: Vec<u32> = v.iter().filter_map(|g| g.index().ok()).collect();
                    peers.sort_unstable();
                    peers
                })
                .unwrap_or_default();
            Some(GpuTopology {
                numa_node,
                switch_peers,
                nvlink_peers: nvlink_peers(&to, &fabric, i as usize),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masks_and_links() {
        assert_eq!(first_bit(&[0, 1 << 3]), Some(67));
        assert_eq!(first_bit(&[0, 0]), None);
        // GPU 0: two links to GPU 1; GPUs 1 and 2: 12 links each into a fabric.
        let to = vec![vec![1, 1], vec![0, 0], vec![]];
        let fabric = vec![0, 12, 12];
        assert_eq!(
            nvlink_peers(&to, &fabric, 0),
            vec![NvLinkPeer { index: 1, links: 2 }]
        );
        assert_eq!(
            nvlink_peers(&to, &fabric, 1),
            vec![
                NvLinkPeer { index: 0, links: 2 },
                NvLinkPeer {
                    index: 2,
                    links: 12
                }
            ]
        );
    }
}
