//! Simulated nodes modelled on real machines (`preset = "…"` in the configuration): their
//! GPUs and their topology. Where each fact comes from is in docs/cuda-sim.md ("Node
//! presets"); what is the model's own choice is said there too.

use crate::device::{DeviceConfig, default_device};
use crate::topology::{GpuPlace, NumaNode, Topology};

/// The preset names, for error messages and `vgpu-sim`.
pub const NAMES: [&str; 4] = ["dgx-h100", "dgx-a100", "pcie-8gpu", "t4-4gpu"];

/// Devices and topology of preset `name`.
pub fn preset(name: &str) -> Option<(Vec<DeviceConfig>, Topology)> {
    match name {
        "dgx-h100" => Some(dgx_h100()),
        "dgx-a100" => Some(dgx_a100()),
        "pcie-8gpu" => Some(pcie_8gpu()),
        "t4-4gpu" => Some(t4_4gpu()),
        _ => None,
    }
}

/// `count` devices like `template`, on the given PCI buses (domain 0, device 0, function 0).
fn devices(buses: &[u8], template: impl Fn(&mut DeviceConfig)) -> Vec<DeviceConfig> {
    buses
        .iter()
        .enumerate()
        .map(|(i, bus)| {
            let mut d = default_device(u32::try_from(i).expect("at most 8 devices"));
            template(&mut d);
            d.pci_bus_id = format!("00000000:{bus:02X}:00.0");
            d
        })
        .collect()
}

fn cpus(ranges: &[(u32, u32)]) -> Vec<u32> {
    ranges.iter().flat_map(|&(a, b)| a..=b).collect()
}

fn place(numa: u32, host_bridge: u32, switches: &[u32], pcie_gbps: u32) -> GpuPlace {
    GpuPlace {
        numa,
        host_bridge,
        switches: switches.to_vec(),
        nvlinks: Vec::new(),
        pcie_gbps,
    }
}

/// NVIDIA DGX H100: 8 × H100 SXM5 80 GB, 4 NVSwitches, 18 NVLink4 links per GPU
/// (900 GB/s per GPU both ways), 2 × Xeon Platinum 8480C (56 cores, 2 threads each).
/// GPUs 0–3 on socket 0, 4–7 on socket 1; each behind its own PCIe Gen5 switch.
fn dgx_h100() -> (Vec<DeviceConfig>, Topology) {
    let devs = devices(&[0x1B, 0x43, 0x52, 0x61, 0x9D, 0xC3, 0xD1, 0xDF], |_| {});
    let topo = Topology {
        numa: vec![
            NumaNode {
                cpus: cpus(&[(0, 55), (112, 167)]),
                socket: 0,
            },
            NumaNode {
                cpus: cpus(&[(56, 111), (168, 223)]),
                socket: 1,
            },
        ],
        gpus: (0..8).map(|i| place(i / 4, i, &[100 + i], 64)).collect(),
        nvlink_version: 4,
        nvlink_gbps: 25,
        nvswitch_links: 18,
        nvswitches: 4,
    };
    (devs, topo)
}

/// NVIDIA DGX A100 (640 GB): 8 × A100 SXM4 80 GB, 6 NVSwitches, 12 NVLink3 links per GPU
/// (600 GB/s per GPU both ways), 2 × EPYC 7742 (64 cores, 2 threads each) in NPS4: 8 NUMA
/// nodes of 16 cores. GPU pairs share a PCIe switch tree (PXB) under NUMA nodes 3, 1, 7, 5,
/// as `nvidia-smi topo -m` shows on a DGX A100.
fn dgx_a100() -> (Vec<DeviceConfig>, Topology) {
    let devs = devices(&[0x07, 0x0F, 0x47, 0x4E, 0x87, 0x90, 0xB7, 0xBD], |d| {
        d.name = "NVIDIA A100-SXM4-80GB".to_owned();
        d.sm_count = 108;
        d.cc_major = 8;
        d.cc_minor = 0;
        d.memory_bandwidth_gbps = 2039;
    });
    let numa = (0..8)
        .map(|k| NumaNode {
            cpus: cpus(&[(16 * k, 16 * k + 15), (128 + 16 * k, 128 + 16 * k + 15)]),
            socket: k / 4,
        })
        .collect();
    let pair_numa = [3, 1, 7, 5];
    let gpus = (0..8)
        .map(|i: u32| {
            let pair = i / 2;
            place(pair_numa[pair as usize], pair, &[10 + pair, 20 + i], 32)
        })
        .collect();
    let topo = Topology {
        numa,
        gpus,
        nvlink_version: 3,
        nvlink_gbps: 25,
        nvswitch_links: 12,
        nvswitches: 6,
    };
    (devs, topo)
}

/// An 8-GPU PCIe server: 8 × L40S (PCIe Gen4 x16), two GPUs per PCIe switch, two switches
/// (each on its own root port) per socket, 2 × 32-core CPUs with 2 threads per core.
/// No NVLink: pairs are PIX, NODE within a socket, SYS across.
fn pcie_8gpu() -> (Vec<DeviceConfig>, Topology) {
    let devs = devices(&[0x18, 0x19, 0x3B, 0x3C, 0x86, 0x87, 0xAF, 0xB0], |d| {
        d.name = "NVIDIA L40S".to_owned();
        d.memory = 48 << 30;
        d.sm_count = 142;
        d.cc_major = 8;
        d.cc_minor = 9;
        d.memory_bandwidth_gbps = 864;
    });
    let topo = Topology {
        numa: vec![
            NumaNode {
                cpus: cpus(&[(0, 31), (64, 95)]),
                socket: 0,
            },
            NumaNode {
                cpus: cpus(&[(32, 63), (96, 127)]),
                socket: 1,
            },
        ],
        gpus: (0..8).map(|i| place(i / 4, i / 2, &[i / 2], 32)).collect(),
        nvlink_version: 0,
        nvlink_gbps: 25,
        nvswitch_links: 0,
        nvswitches: 0,
    };
    (devs, topo)
}

/// A 4 × T4 server: Tesla T4 (16 GB GDDR6, PCIe Gen3 x16, 40 SMs, 7.5), two per socket on
/// one host bridge each (PHB), 2 × 20-core CPUs with 2 threads per core.
fn t4_4gpu() -> (Vec<DeviceConfig>, Topology) {
    let devs = devices(&[0x3B, 0x5E, 0xAF, 0xD8], |d| {
        d.name = "Tesla T4".to_owned();
        d.memory = 15 << 30;
        d.sm_count = 40;
        d.cc_major = 7;
        d.cc_minor = 5;
        d.memory_bandwidth_gbps = 320;
    });
    let topo = Topology {
        numa: vec![
            NumaNode {
                cpus: cpus(&[(0, 19), (40, 59)]),
                socket: 0,
            },
            NumaNode {
                cpus: cpus(&[(20, 39), (60, 79)]),
                socket: 1,
            },
        ],
        gpus: (0..4).map(|i| place(i / 2, i / 2, &[], 16)).collect(),
        nvlink_version: 0,
        nvlink_gbps: 25,
        nvswitch_links: 0,
        nvswitches: 0,
    };
    (devs, topo)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::topology::{LinkClass, PcieLevel};

    /// Every preset is a valid topology (it survives the same checks as a config file).
    fn checked(name: &str) -> (Vec<DeviceConfig>, Topology) {
        let (d, t) = preset(name).expect("preset");
        let again = Topology::from_raw(t.to_raw(), d.len(), name).expect("valid");
        assert_eq!(again, t, "{name}");
        (d, t)
    }

    fn matrix(t: &Topology) -> Vec<Vec<String>> {
        (0..t.gpu_count())
            .map(|a| {
                (0..t.gpu_count())
                    .map(|b| t.link_class(a, b).label())
                    .collect()
            })
            .collect()
    }

    #[test]
    fn dgx_h100_is_all_nv18_with_two_sockets() {
        let (d, t) = checked("dgx-h100");
        assert_eq!(d.len(), 8);
        assert_eq!(d[0].pci_bus_id, "00000000:1B:00.0");
        for (a, row) in matrix(&t).iter().enumerate() {
            for (b, l) in row.iter().enumerate() {
                assert_eq!(l, if a == b { "X" } else { "NV18" });
            }
        }
        assert_eq!(t.pcie_level(0, 1), PcieLevel::Node);
        assert_eq!(t.pcie_level(0, 4), PcieLevel::System);
        assert_eq!(t.copy_gbps(0, 7), 450);
        assert_eq!(t.cpus_of(5, false).len(), 112);
        assert_eq!(t.gpus_near_cpu(170), vec![4, 5, 6, 7]);
        assert!(t.p2p_supported(0, 7));
    }

    #[test]
    fn dgx_a100_is_nv12_with_pxb_pairs_in_nps4() {
        let (d, t) = checked("dgx-a100");
        assert_eq!(d[1].name, "NVIDIA A100-SXM4-80GB");
        assert_eq!(t.link_class(0, 5), LinkClass::NvLink(12));
        assert_eq!(t.pcie_level(0, 1), PcieLevel::Multiple);
        assert_eq!(
            t.pcie_level(0, 2),
            PcieLevel::Node,
            "NUMA 3 and 1 share socket 0"
        );
        assert_eq!(t.pcie_level(0, 4), PcieLevel::System);
        assert_eq!(t.numa.len(), 8);
        assert_eq!(
            crate::topology::format_cpu_list(&t.cpus_of(0, false)),
            "48-63,176-191"
        );
        assert_eq!(t.numa_nodes_of(0, true), vec![0, 1, 2, 3]);
        assert_eq!(t.copy_gbps(0, 1), 300);
    }

    #[test]
    fn pcie_8gpu_has_pix_node_and_sys() {
        let (_, t) = checked("pcie-8gpu");
        let m = matrix(&t);
        assert_eq!(m[0][1], "PIX");
        assert_eq!(m[0][2], "NODE");
        assert_eq!(m[0][4], "SYS");
        assert!(t.p2p_supported(0, 3) && !t.p2p_supported(0, 4));
        assert!(t.copy_gbps(0, 1) > t.copy_gbps(0, 2) && t.copy_gbps(0, 2) > t.copy_gbps(0, 4));
    }

    #[test]
    fn t4_4gpu_has_phb_and_sys() {
        let (d, t) = checked("t4-4gpu");
        assert_eq!(d.len(), 4);
        assert_eq!(d[0].name, "Tesla T4");
        assert_eq!(t.link_class(0, 1).label(), "PHB");
        assert_eq!(t.link_class(1, 2).label(), "SYS");
        assert_eq!(t.link_count(0), 0);
    }
}
