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
//! different `version` is an incompatible change and is refused.

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
                },
                GpuInfo {
                    index: 1,
                    uuid: "GPU-b".into(),
                    model: "A100".into(),
                    memory_mib: 81920,
                    healthy: false,
                },
            ],
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
    fn rejects_inconsistent_records() {
        let dup = sample().to_json().replace("GPU-b", "GPU-a");
        let e = NodeInventory::from_json(&dup).expect_err("duplicate");
        assert!(e.to_string().contains("GPU-a listed twice"), "{e}");
        let zero = sample().to_json().replacen("81920", "0", 1);
        assert!(NodeInventory::from_json(&zero).is_err());
    }
}
