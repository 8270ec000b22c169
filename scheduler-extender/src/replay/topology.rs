//! The replay's node topologies by GPU model (issue 14, ADR 0021), and what it measures
//! of multi-GPU placements: the link class each multi-GPU pod got against the best its
//! node offers.
//!
//! The Alibaba trace names each node's GPU model and count, not its topology. Each
//! (model, count) gets the layout of a real machine of that kind (sources in
//! `docs/specification.md`, issue 14 section):
//!
//! | model × GPUs | layout | pairs |
//! |---|---|---|
//! | `V100M16`/`V100M32` × 8 | DGX-1V hybrid cube mesh: 6 NVLink2 per GPU, quads 0–3 and 4–7 fully connected, GPU i ↔ i+4; two GPUs per PCIe switch; GPUs 0–3 on socket 0, 4–7 on socket 1 | NV1/NV2 within a quad and to i+4, else SYS |
//! | `V100M16`/`V100M32` × 4 | DGX Station V100: four SXM2 GPUs fully connected by NVLink (2 links per pair), one socket | NV2 |
//! | `G3` × 8 | NVSwitch (DGX A100-like: 12 NVLink3 per GPU into the fabric), 4 GPUs per socket | NV12 |
//! | `G2` × 8 | 8-GPU PCIe server (cuda-sim's `pcie-8gpu`): two GPUs per PCIe switch, two switches per socket | PIX, NODE, SYS |
//! | `T4` × 4 | cuda-sim's `t4-4gpu`: two GPUs per socket on one host bridge | PHB, SYS |
//! | `T4`, `P100` × 2 | both GPUs under one PCIe switch | PIX |
//! | any × 1 | one GPU | — |
//!
//! G2 and G3 are the trace's names for models it does not disclose; their layouts are
//! assumptions (documented as such): G2 the PCIe server, where topology matters most,
//! G3 an NVSwitch machine. Any other (model, count) has no topology.

use vgpu_core::inventory::{GpuTopology, NvLinkPeer};
use vgpu_core::packing::Placement;
use vgpu_core::topology::{LinkClass, NodeTopology};

/// DGX-1V's NVLink matrix: links between GPU i and j, 0 = none. Which pairs are linked
/// is the hybrid cube mesh of NVIDIA's DGX-1V white paper; the 1-or-2 link counts are as
/// recalled from a DGX-1V's `nvidia-smi topo -m`, not re-checked (they order sets of one
/// class, never change a class).
const DGX1V_LINKS: [[u32; 8]; 8] = [
    [0, 1, 1, 2, 2, 0, 0, 0],
    [1, 0, 2, 1, 0, 2, 0, 0],
    [1, 2, 0, 2, 0, 0, 1, 0],
    [2, 1, 2, 0, 0, 0, 0, 1],
    [2, 0, 0, 0, 0, 1, 1, 2],
    [0, 2, 0, 0, 1, 0, 2, 1],
    [0, 0, 1, 0, 1, 2, 0, 2],
    [0, 0, 0, 1, 2, 1, 2, 0],
];

fn gpu(numa: u32, switch_peers: Vec<u32>, nvlink: Vec<(u32, u32)>) -> Option<GpuTopology> {
    Some(GpuTopology {
        numa_node: Some(numa),
        switch_peers,
        nvlink_peers: nvlink
            .into_iter()
            .map(|(index, links)| NvLinkPeer { index, links })
            .collect(),
    })
}

/// The topology the replay gives a node of `count` GPUs of `model` (see the module
/// table); `None` for a shape it has no layout for.
pub fn topology_for(model: &str, count: usize) -> Option<NodeTopology> {
    let n = u32::try_from(count).ok()?;
    let v100 = model.starts_with("V100");
    let gpus: Vec<(u32, Option<GpuTopology>)> = match (count, model) {
        (1, _) => vec![(0, gpu(0, vec![], vec![]))],
        (8, _) if v100 => (0..8u32)
            .map(|i| {
                let nv = (0..8u32)
                    .filter(|&j| DGX1V_LINKS[i as usize][j as usize] > 0)
                    .map(|j| (j, DGX1V_LINKS[i as usize][j as usize]))
                    .collect();
                (i, gpu(i / 4, vec![i ^ 1], nv))
            })
            .collect(),
        (4, _) if v100 => (0..4u32)
            .map(|i| {
                let nv = (0..4u32).filter(|&j| j != i).map(|j| (j, 2)).collect();
                (i, gpu(0, vec![], nv))
            })
            .collect(),
        (8, "G3") => (0..8u32)
            .map(|i| {
                let nv = (0..8u32).filter(|&j| j != i).map(|j| (j, 12)).collect();
                (i, gpu(i / 4, vec![], nv))
            })
            .collect(),
        (8, "G2") => (0..8u32)
            .map(|i| (i, gpu(i / 4, vec![i ^ 1], vec![])))
            .collect(),
        (4, "T4") => (0..4u32).map(|i| (i, gpu(i / 2, vec![], vec![]))).collect(),
        (2, "T4" | "P100") => (0..2u32)
            .map(|i| (i, gpu(0, vec![i ^ 1], vec![])))
            .collect(),
        _ => return None,
    };
    debug_assert_eq!(gpus.len(), n as usize);
    Some(NodeTopology::new(gpus))
}

/// Multi-GPU placements seen in one replay.
#[derive(Debug, Clone, Copy, Default, serde::Serialize, PartialEq, Eq)]
pub struct TopologyStats {
    /// Placed pods with a container of two or more GPUs, on a node with a topology.
    pub multi_gpu_pods: u64,
    /// Those whose every multi-GPU container got the best class its node offers (the
    /// class of the best set of that size on the node with every GPU free).
    pub on_best_class: u64,
    /// Those with a container whose GPUs talk across sockets ([`LinkClass::System`])
    /// although its node offers a better set of that size.
    pub across_sockets: u64,
    /// Of `multi_gpu_pods`, those that had a choice: fewer GPUs than their node has.
    pub with_choice: u64,
    /// Of `with_choice`, those on the best class.
    pub with_choice_on_best: u64,
}

impl TopologyStats {
    /// Records one placement on a node of topology `topo` (`None`: not counted).
    pub fn record(&mut self, topo: Option<&NodeTopology>, gpus_on_node: usize, p: &Placement) {
        let Some(topo) = topo else { return };
        let multi: Vec<Vec<u32>> = p
            .containers
            .iter()
            .filter(|g| g.len() >= 2)
            .map(|g| g.iter().map(|x| u32::from(x.gpu)).collect())
            .collect();
        if multi.is_empty() {
            return;
        }
        let all: Vec<u32> = topo.indices().to_vec();
        let mut best = true;
        let mut across = false;
        let mut choice = false;
        for set in &multi {
            let class = topo.set_class(set).unwrap_or(LinkClass::System);
            let possible = topo
                .best_class(&all, set.len())
                .unwrap_or(LinkClass::System);
            best &= class >= possible;
            across |= class == LinkClass::System && possible > LinkClass::System;
            choice |= set.len() < gpus_on_node;
        }
        self.multi_gpu_pods += 1;
        self.on_best_class += u64::from(best);
        self.across_sockets += u64::from(across);
        self.with_choice += u64::from(choice);
        self.with_choice_on_best += u64::from(choice && best);
    }

    /// Adds another replay's counts.
    pub fn add(&mut self, o: &TopologyStats) {
        self.multi_gpu_pods += o.multi_gpu_pods;
        self.on_best_class += o.on_best_class;
        self.across_sockets += o.across_sockets;
        self.with_choice += o.with_choice;
        self.with_choice_on_best += o.with_choice_on_best;
    }
}

fn pct(a: u64, b: u64) -> f64 {
    if b == 0 {
        100.0
    } else {
        a as f64 * 100.0 / b as f64
    }
}

impl TopologyStats {
    /// Share of multi-GPU pods on their node's best class, %.
    pub fn on_best_pct(&self) -> f64 {
        pct(self.on_best_class, self.multi_gpu_pods)
    }
    /// Share of multi-GPU pods across sockets, %.
    pub fn across_pct(&self) -> f64 {
        pct(self.across_sockets, self.multi_gpu_pods)
    }
    /// Share of the pods that had a choice on their best class, %.
    pub fn with_choice_on_best_pct(&self) -> f64 {
        pct(self.with_choice_on_best, self.with_choice)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vgpu_core::packing::Grant;

    fn placement(sets: &[&[u16]]) -> Placement {
        Placement {
            node: 0,
            containers: sets
                .iter()
                .map(|s| {
                    s.iter()
                        .map(|&gpu| Grant {
                            gpu,
                            milli: 1000,
                            memory_mib: 1,
                            slices: 1,
                        })
                        .collect()
                })
                .collect(),
        }
    }

    #[test]
    fn layouts_give_the_documented_classes() {
        let dgx1 = topology_for("V100M32", 8).expect("layout");
        assert_eq!(dgx1.set_class(&[0, 1, 2, 3]), Some(LinkClass::NvLink));
        assert_eq!(dgx1.set_class(&[0, 5]), Some(LinkClass::System));
        assert_eq!(dgx1.link(0, 3).nvlinks, 2);
        // The matrix is symmetric and every GPU has 6 links.
        for (i, row) in DGX1V_LINKS.iter().enumerate() {
            assert_eq!(row.iter().sum::<u32>(), 6);
            for (j, links) in row.iter().enumerate() {
                assert_eq!(*links, DGX1V_LINKS[j][i]);
            }
        }
        let g2 = topology_for("G2", 8).expect("layout");
        assert_eq!(
            g2.best_class(&[0, 1, 2, 3, 4, 5, 6, 7], 2),
            Some(LinkClass::Switch)
        );
        assert_eq!(
            g2.best_class(&[0, 1, 2, 3, 4, 5, 6, 7], 4),
            Some(LinkClass::Numa)
        );
        let g3 = topology_for("G3", 8).expect("layout");
        assert_eq!(g3.set_class(&[0, 7]), Some(LinkClass::NvLink));
        let t4 = topology_for("T4", 4).expect("layout");
        assert_eq!(t4.set_class(&[0, 1]), Some(LinkClass::Numa));
        assert_eq!(t4.set_class(&[1, 2]), Some(LinkClass::System));
        assert_eq!(
            topology_for("P100", 2).and_then(|t| t.set_class(&[0, 1])),
            Some(LinkClass::Switch)
        );
        assert!(topology_for("A10", 1).is_some());
        assert!(topology_for("H800", 8).is_none());
    }

    #[test]
    fn stats_count_best_and_across() {
        let g2 = topology_for("G2", 8).expect("layout");
        let mut s = TopologyStats::default();
        s.record(Some(&g2), 8, &placement(&[&[0, 1]])); // PIX: best
        s.record(Some(&g2), 8, &placement(&[&[1, 2]])); // NODE: not best
        s.record(Some(&g2), 8, &placement(&[&[3, 4]])); // SYS
        s.record(Some(&g2), 8, &placement(&[&[0, 1, 2, 3, 4, 5, 6, 7]])); // whole node: SYS, but best
        s.record(Some(&g2), 8, &placement(&[&[5]])); // one GPU: not counted
        s.record(None, 8, &placement(&[&[0, 1]])); // no topology: not counted
        assert_eq!(
            s,
            TopologyStats {
                multi_gpu_pods: 4,
                on_best_class: 2,
                across_sockets: 1,
                with_choice: 3,
                with_choice_on_best: 1,
            }
        );
        assert_eq!(s.on_best_pct(), 50.0);
    }
}
