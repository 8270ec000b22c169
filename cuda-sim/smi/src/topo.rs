//! `vgpu-smi topo -m`: the GPU connection matrix in the form of `nvidia-smi topo -m`
//! (`X`, `NV#`, `PIX`, `PXB`, `PHB`, `NODE`, `SYS`, with each GPU's CPU and NUMA
//! affinity), read through NVML with [`nvml_wrapper`] as any client would.
//!
//! A pair's NVLink count is the number of active links from one GPU whose remote end is
//! the other GPU, plus, where both GPUs have links into an NVSwitch fabric (a remote end
//! that is no GPU), the smaller of their fabric link counts: that is how `nvidia-smi`
//! shows 8 GPUs on 4 NVSwitches with 18 links each as `NV18` everywhere.

use std::ffi::c_ulong;

use nvml_wrapper::Nvml;
use nvml_wrapper::enum_wrappers::device::TopologyLevel;
use nvml_wrapper::error::NvmlError;
use serde::Serialize;

use crate::{SmiError, call, optional};

/// Links NVML may report per GPU (`NVML_NVLINK_MAX_LINKS`).
const MAX_LINKS: u32 = 18;
/// `unsigned long`s asked for in the affinity masks (4096 CPUs, 4096 NUMA nodes).
const MASK_WORDS: usize = 64;
/// `NVML_AFFINITY_SCOPE_NODE`.
const SCOPE_NODE: u32 = 0;

/// The topology as NVML shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TopoView {
    /// One row per GPU, in NVML index order.
    pub gpus: Vec<TopoRow>,
}

/// One GPU's row.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TopoRow {
    /// NVML index.
    pub index: u32,
    /// The connection to each GPU, by index: `X`, `NV#`, `PIX`, `PXB`, `PHB`, `NODE`, `SYS`.
    pub links: Vec<String>,
    /// Local CPUs as a CPU list (`0-55,112-167`), `N/A` where NVML does not say.
    pub cpu_affinity: String,
    /// Local NUMA nodes as a list, `N/A` where NVML does not say.
    pub numa_affinity: String,
}

/// The `nvidia-smi topo` label of a PCIe common ancestor.
pub fn level_label(l: &TopologyLevel) -> &'static str {
    match l {
        TopologyLevel::Internal => "X",
        TopologyLevel::Single => "PIX",
        TopologyLevel::Multiple => "PXB",
        TopologyLevel::HostBridge => "PHB",
        TopologyLevel::Node => "NODE",
        TopologyLevel::System => "SYS",
    }
}

/// The set bits of an NVML bitmask, as a Linux list (`0-3,8`); `None` when empty.
pub fn mask_list(mask: &[c_ulong]) -> Option<String> {
    let width = c_ulong::BITS;
    let bits: Vec<u32> = mask
        .iter()
        .enumerate()
        .flat_map(|(w, &m)| {
            (0..width)
                .filter(move |b| m & (1 << b) != 0)
                .map(move |b| u32::try_from(w).unwrap_or(u32::MAX).saturating_mul(width) + b)
        })
        .collect();
    if bits.is_empty() {
        return None;
    }
    let mut parts = Vec::new();
    let mut i = 0;
    while i < bits.len() {
        let start = bits[i];
        while i + 1 < bits.len() && bits[i + 1] == bits[i] + 1 {
            i += 1;
        }
        parts.push(if start == bits[i] {
            start.to_string()
        } else {
            format!("{start}-{}", bits[i])
        });
        i += 1;
    }
    Some(parts.join(","))
}

/// A GPU's NVLinks: active links to each GPU (by PCI bus id) and into a fabric.
#[derive(Debug, Default)]
struct Links {
    to_bus: Vec<String>,
    fabric: u32,
}

/// Reads the topology from NVML.
pub fn snapshot(nvml: &Nvml) -> Result<TopoView, SmiError> {
    let count = call("nvmlDeviceGetCount_v2", None, nvml.device_count())?;
    let mut devs = Vec::new();
    let mut buses = Vec::new();
    for i in 0..count {
        let d = call(
            "nvmlDeviceGetHandleByIndex_v2",
            Some(i),
            nvml.device_by_index(i),
        )?;
        buses.push(call("nvmlDeviceGetPciInfo_v3", Some(i), d.pci_info())?.bus_id);
        devs.push(d);
    }
    let mut links = Vec::new();
    for (i, d) in (0..count).zip(&devs) {
        let mut l = Links::default();
        for link in 0..MAX_LINKS {
            let w = d.link_wrapper_for(link);
            match w.is_active() {
                Ok(true) => {}
                Ok(false) | Err(NvmlError::NotSupported | NvmlError::InvalidArg) => continue,
                Err(source) => {
                    return Err(SmiError::Call {
                        call: "nvmlDeviceGetNvLinkState",
                        gpu: Some(i),
                        source,
                    });
                }
            }
            let remote = call(
                "nvmlDeviceGetNvLinkRemotePciInfo_v2",
                Some(i),
                w.remote_pci_info(),
            )?;
            if buses.contains(&remote.bus_id) {
                l.to_bus.push(remote.bus_id);
            } else {
                l.fabric += 1;
            }
        }
        links.push(l);
    }
    let mut gpus = Vec::new();
    for (a, da) in (0..count).zip(&devs) {
        let mut row = Vec::new();
        for b in 0..count {
            if a == b {
                row.push("X".to_owned());
                continue;
            }
            let (la, lb) = (&links[a as usize], &links[b as usize]);
            let direct = la
                .to_bus
                .iter()
                .filter(|x| **x == buses[b as usize])
                .count();
            let fabric = if la.fabric > 0 && lb.fabric > 0 {
                la.fabric.min(lb.fabric) as usize
            } else {
                0
            };
            if direct + fabric > 0 {
                row.push(format!("NV{}", direct + fabric));
                continue;
            }
            // nvml-wrapper takes the other device by value: a fresh handle of it.
            let db = call(
                "nvmlDeviceGetHandleByIndex_v2",
                Some(b),
                nvml.device_by_index(b),
            )?;
            let level = call(
                "nvmlDeviceGetTopologyCommonAncestor",
                Some(a),
                da.topology_common_ancestor(db),
            )?;
            row.push(level_label(&level).to_owned());
        }
        let cpus = optional(
            "nvmlDeviceGetCpuAffinity",
            Some(a),
            da.cpu_affinity(MASK_WORDS),
        )?;
        let numa = optional(
            "nvmlDeviceGetMemoryAffinity",
            Some(a),
            da.memory_affinity(MASK_WORDS, SCOPE_NODE),
        )?;
        gpus.push(TopoRow {
            index: a,
            links: row,
            cpu_affinity: cpus
                .as_deref()
                .and_then(mask_list)
                .unwrap_or_else(|| "N/A".into()),
            numa_affinity: numa
                .as_deref()
                .and_then(mask_list)
                .unwrap_or_else(|| "N/A".into()),
        });
    }
    Ok(TopoView { gpus })
}

/// The legend `nvidia-smi topo -m` prints under the matrix.
pub const LEGEND: &str = "\
Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks";

/// Renders the matrix as `nvidia-smi topo -m` does: tab-separated columns.
pub fn render_matrix(v: &TopoView) -> String {
    let mut out = String::from("\t");
    for g in &v.gpus {
        out.push_str(&format!("GPU{}\t", g.index));
    }
    out.push_str("CPU Affinity\tNUMA Affinity\n");
    for g in &v.gpus {
        out.push_str(&format!("GPU{}\t", g.index));
        for l in &g.links {
            // nvidia-smi pads the self cell: " X ".
            if l == "X" {
                out.push_str(" X \t");
            } else {
                out.push_str(l);
                out.push('\t');
            }
        }
        out.push_str(&format!("{}\t{}\n", g.cpu_affinity, g.numa_affinity));
    }
    out.push('\n');
    out.push_str(LEGEND);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masks_become_cpu_lists() {
        assert_eq!(
            mask_list(&[0b1111 | 1 << 8, 1]).as_deref(),
            Some("0-3,8,64")
        );
        assert_eq!(mask_list(&[0, 0]), None);
    }

    #[test]
    fn the_matrix_reads_like_nvidia_smi() {
        let v = TopoView {
            gpus: vec![
                TopoRow {
                    index: 0,
                    links: vec!["X".into(), "NV12".into()],
                    cpu_affinity: "48-63,176-191".into(),
                    numa_affinity: "3".into(),
                },
                TopoRow {
                    index: 1,
                    links: vec!["NV12".into(), "X".into()],
                    cpu_affinity: "48-63,176-191".into(),
                    numa_affinity: "3".into(),
                },
            ],
        };
        let text = render_matrix(&v);
        let mut lines = text.lines();
        assert_eq!(
            lines.next(),
            Some("\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity")
        );
        assert_eq!(lines.next(), Some("GPU0\t X \tNV12\t48-63,176-191\t3"));
        assert!(text.contains("NV#  = Connection traversing a bonded set of # NVLinks"));
    }
}
