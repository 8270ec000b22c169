//! A node's GPU inventory as the device plugin publishes it for the scheduler extender.
//!
//! The device plugin writes one annotation on its Node object,
//! [`ANNOTATION_GPU_INVENTORY`], whose value is a [`NodeInventory`] as JSON:
//!
//! ```json
//! {"version":1,"gpus":[{"index":0,"uuid":"GPU-8c1f…","model":"A100-SXM4-80GB","memory_mib":81920}]}
//! ```
//!
//! The extender reads it through its Node watch (ADR 0007). Compatibility rules, as
//! for the assignment record: readers ignore unknown fields (minor additions); a
//! different `version` is an incompatible change and is refused. Each GPU's `topology`
//! ([`GpuTopology`]: NUMA node, PCIe switch peers, NVLink peers) is such an addition,
//! written only when known:
//!
//! ```json
//! {"index":0,"uuid":"GPU-…","model":"…","memory_mib":81920,"healthy":true,
//!  "topology":{"numa_node":3,"nvlink_peers":[{"index":1,"links":12}]}}
//! ```
//!
//! So is the node's `slices_per_gpu` (ADR 0023: device IDs per GPU, 10 when absent, up
//! to 100 on a node configured for fine sharing).

use serde::{Deserialize, Serialize};

/// Node annotation carrying the [`NodeInventory`] JSON.
pub const ANNOTATION_GPU_INVENTORY: &str = "vgpu.io/gpu-inventory";
/// The current version of the inventory record.
pub const INVENTORY_VERSION: u32 = 1;
/// Largest number of GPUs on one node that the record may list.
pub const MAX_GPUS_PER_NODE: usize = 64;

/// One physical GPU of a node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuInfo {
    /// NVML index on the node.
    pub index: u32,
    /// The GPU's UUID (`GPU-…`), as NVML reports it; what bind writes in the assignment.
    pub uuid: String,
    /// Model name, matched exactly by the `vgpu.io/gpu-model` constraints.
    pub model: String,
    /// Total memory, MiB.
    pub memory_mib: u64,
    /// Whether the device plugin currently offers this GPU (false after an XID/ECC
    /// error); an unhealthy GPU takes no new pods.
    #[serde(default = "healthy_default")]
    pub healthy: bool,
    /// Where the GPU sits on the node (issue 14), as NVML reports it; absent when the
    /// driver does not say, and from plugins that predate it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub topology: Option<GpuTopology>,
}

/// A GPU's place in its node's topology: an addition to version 1 of the record, which
/// readers that predate it ignore (unknown fields), and which is absent when unknown.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct GpuTopology {
    /// The NUMA node nearest the GPU (NVML's memory affinity, node scope).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub numa_node: Option<u32>,
    /// NVML indices of the other GPUs under the same PCIe switch (NVML's
    /// `NVML_TOPOLOGY_SINGLE`, `nvidia-smi topo`: PIX), ascending.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub switch_peers: Vec<u32>,
    /// The GPUs it reaches over NVLink (directly or through an NVSwitch fabric), with the
    /// number of links, by NVML index.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nvlink_peers: Vec<NvLinkPeer>,
}

/// NVLinks from one GPU to another.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct NvLinkPeer {
    /// The peer's NVML index.
    pub index: u32,
    /// Links usable between the two (`nvidia-smi topo`: `NV<links>`).
    pub links: u32,
}

fn healthy_default() -> bool {
    true
}

/// Every GPU of a node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeInventory {
    /// Record format version ([`INVENTORY_VERSION`]).
    pub version: u32,
    /// The GPUs, in NVML index order.
    pub gpus: Vec<GpuInfo>,
    /// Device IDs of `vgpu.io/gpu` the plugin advertises per GPU, so the most containers
    /// one GPU takes (ADR 0023): 10 (the default, and what a plugin that predates the
    /// field advertises) up to 100 on a node configured for fine sharing.
    #[serde(default = "slices_default")]
    pub slices_per_gpu: u32,
}

fn slices_default() -> u32 {
    crate::resources::SLICES_PER_GPU
}

/// Why an inventory record could not be read.
#[derive(Debug, thiserror::Error)]
pub enum InventoryError {
    /// Not valid JSON of the expected shape.
    #[error("annotation vgpu.io/gpu-inventory: malformed record")]
    Malformed(#[source] serde_json::Error),
    /// Written by an incompatible version.
    #[error(
        "annotation vgpu.io/gpu-inventory: unsupported version {0} (this build reads version 1)"
    )]
    Version(u32),
    /// The record is inconsistent.
    #[error("annotation vgpu.io/gpu-inventory: {0}")]
    Invalid(String),
}

impl NodeInventory {
    /// Encodes the record for the annotation.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("plain structs always serialize")
    }

    /// Decodes and validates a record from the annotation's value.
    pub fn from_json(text: &str) -> Result<Self, InventoryError> {
        #[derive(Deserialize)]
        struct Probe {
            version: u32,
        }
        let probe: Probe = serde_json::from_str(text).map_err(InventoryError::Malformed)?;
        if probe.version != INVENTORY_VERSION {
            return Err(InventoryError::Version(probe.version));
        }
        let inv: NodeInventory = serde_json::from_str(text).map_err(InventoryError::Malformed)?;
        crate::resources::check_slices_per_gpu(inv.slices_per_gpu)
            .map_err(InventoryError::Invalid)?;
        if inv.gpus.len() > MAX_GPUS_PER_NODE {
            return Err(InventoryError::Invalid(format!(
                "{} GPUs listed, at most {MAX_GPUS_PER_NODE}",
                inv.gpus.len()
            )));
        }
        for (i, g) in inv.gpus.iter().enumerate() {
            if g.uuid.is_empty() {
                return Err(InventoryError::Invalid(format!("GPU {i}: empty uuid")));
            }
            if g.memory_mib == 0 {
                return Err(InventoryError::Invalid(format!(
                    "GPU {}: memory_mib is 0",
                    g.uuid
                )));
            }
            if inv.gpus[..i].iter().any(|h| h.uuid == g.uuid) {
                return Err(InventoryError::Invalid(format!(
                    "GPU {} listed twice",
                    g.uuid
                )));
            }
        }
        Ok(inv)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> NodeInventory {
        NodeInventory {
            version: INVENTORY_VERSION,
            gpus: vec![
                GpuInfo {
                    index: 0,
                    uuid: "GPU-a".into(),
                    model: "A100".into(),
                    memory_mib: 81920,
                    healthy: true,
                    topology: None,
                },
                GpuInfo {
                    index: 1,
                    uuid: "GPU-b".into(),
                    model: "A100".into(),
                    memory_mib: 81920,
                    healthy: false,
                    topology: None,
                },
            ],
            slices_per_gpu: 10,
        }
    }

    #[test]
    fn slices_per_gpu_defaults_to_ten_and_is_checked() {
        let old =
            r#"{"version":1,"gpus":[{"index":0,"uuid":"GPU-x","model":"T4","memory_mib":15360}]}"#;
        assert_eq!(
            NodeInventory::from_json(old).expect("valid").slices_per_gpu,
            10
        );
        let mut fine = sample();
        fine.slices_per_gpu = 100;
        let s = fine.to_json();
        assert!(s.contains(r#""slices_per_gpu":100"#), "{s}");
        assert_eq!(NodeInventory::from_json(&s).expect("valid"), fine);
        for bad in [0, 9, 101] {
            let s = s.replace(
                r#""slices_per_gpu":100"#,
                &format!(r#""slices_per_gpu":{bad}"#),
            );
            let e = NodeInventory::from_json(&s).expect_err("out of range");
            assert!(
                e.to_string()
                    .contains(&format!("slices per GPU {bad} is out of range")),
                "{e}"
            );
        }
    }

    #[test]
    fn round_trips_and_is_versioned() {
        let s = sample().to_json();
        assert_eq!(NodeInventory::from_json(&s).expect("valid"), sample());
        let future = s.replace("\"version\":1", "\"version\":2");
        assert!(matches!(
            NodeInventory::from_json(&future),
            Err(InventoryError::Version(2))
        ));
        let extra = s.replace("\"gpus\"", "\"later\":1,\"gpus\"");
        assert_eq!(NodeInventory::from_json(&extra).expect("valid"), sample());
        assert!(matches!(
            NodeInventory::from_json("{"),
            Err(InventoryError::Malformed(_))
        ));
    }

    #[test]
    fn healthy_defaults_to_true() {
        let s =
            r#"{"version":1,"gpus":[{"index":0,"uuid":"GPU-x","model":"T4","memory_mib":15360}]}"#;
        assert!(NodeInventory::from_json(s).expect("valid").gpus[0].healthy);
    }

    #[test]
    fn topology_is_an_addition_older_readers_ignore() {
        let mut inv = sample();
        inv.gpus[0].topology = Some(GpuTopology {
            numa_node: Some(3),
            switch_peers: vec![1],
            nvlink_peers: vec![NvLinkPeer {
                index: 1,
                links: 12,
            }],
        });
        let s = inv.to_json();
        assert!(
            s.contains(r#""topology":{"numa_node":3,"switch_peers":[1],"nvlink_peers":[{"index":1,"links":12}]}"#),
            "{s}"
        );
        assert_eq!(NodeInventory::from_json(&s).expect("valid"), inv);
        // The GPU without topology writes no field at all.
        assert_eq!(s.matches("topology").count(), 1, "{s}");
        // A reader built before the field (the record's own GpuInfo, as it was) still reads it.
        #[derive(Deserialize)]
        struct OldGpu {
            uuid: String,
            memory_mib: u64,
        }
        #[derive(Deserialize)]
        struct OldInventory {
            version: u32,
            gpus: Vec<OldGpu>,
        }
        let old: OldInventory = serde_json::from_str(&s).expect("an older reader parses it");
        assert_eq!(
            (
                old.version,
                old.gpus[0].uuid.as_str(),
                old.gpus[1].memory_mib
            ),
            (1, "GPU-a", 81920)
        );
    }

    #[test]
    fn rejects_inconsistent_records() {
        let dup = sample().to_json().replace("GPU-b", "GPU-a");
        let e = NodeInventory::from_json(&dup).expect_err("duplicate");
        assert!(e.to_string().contains("GPU-a listed twice"), "{e}");
        let zero = sample().to_json().replacen("81920", "0", 1);
        assert!(NodeInventory::from_json(&zero).is_err());
    }
}
