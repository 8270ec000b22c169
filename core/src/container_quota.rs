//! The container quota file: what the device plugin writes for one container and the
//! shim (`libvgpu.so`) reads at start.
//!
//! The file is `vgpu.conf` in the container's `VGPU_CONTAINER_DIR` (ADR 0009). It is JSON:
//!
//! ```json
//! {"version":1,"namespace":"ml","pod":"nb-1","uid":"7d…","container":"main","init":false,
//!  "gpus":[{"uuid":"GPU-8c1f…","memory_mib":8192,"compute_milli":300,"slices":3}],
//!  "device_ids":["GPU-8c1f…-0","GPU-8c1f…-1","GPU-8c1f…-2"]}
//! ```
//!
//! The shim matches `gpus` to devices by UUID (through the real driver); a visible GPU
//! that is not listed gets a quota of 0. Compatibility rules, as for the other records: readers
//! ignore unknown fields (minor additions); a different `version` is incompatible and
//! refused, and the shim then fails loudly rather than running unlimited.

use serde::{Deserialize, Serialize};

use crate::sched_proto::{ComputePolicy, Priority};

/// Name of the quota file inside the container directory.
pub const QUOTA_FILE: &str = "vgpu.conf";
/// The current version of the quota record.
pub const QUOTA_VERSION: u32 = 1;

/// One container's quota, as the device plugin hands it to the shim.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContainerQuota {
    /// Record format version ([`QUOTA_VERSION`]).
    pub version: u32,
    /// The pod's namespace.
    pub namespace: String,
    /// The pod's name.
    pub pod: String,
    /// The pod's UID.
    pub uid: String,
    /// The container's name.
    pub container: String,
    /// Whether it is an init container.
    pub init: bool,
    /// The container's GPUs, in its device order.
    pub gpus: Vec<GpuQuota>,
    /// The kubelet device IDs the container holds.
    pub device_ids: Vec<String>,
}

/// The share of one GPU a container may use.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuQuota {
    /// The GPU's UUID (`GPU-…`).
    pub uuid: String,
    /// Memory limit, MiB.
    pub memory_mib: u64,
    /// Compute share, milli-GPU (1000 = the whole GPU).
    pub compute_milli: u32,
    /// 0.1-GPU slices held on this GPU.
    pub slices: u32,
    /// How the compute share is enforced (absent: `burst`).
    #[serde(default)]
    pub compute_policy: ComputePolicy,
    /// The container's priority class on this GPU (absent: `best-effort`).
    #[serde(default)]
    pub priority: Priority,
}

/// Why a quota record could not be read.
#[derive(Debug, thiserror::Error)]
pub enum QuotaFileError {
    /// Not valid JSON of the expected shape.
    #[error("quota file: malformed record")]
    Malformed(#[source] serde_json::Error),
    /// Written by an incompatible version.
    #[error("quota file: unsupported version {0} (this build reads version 1)")]
    Version(u32),
}

impl ContainerQuota {
    /// Encodes the record.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("plain structs always serialize")
    }

    /// Decodes a record, refusing another version.
    pub fn from_json(text: &str) -> Result<Self, QuotaFileError> {
        #[derive(Deserialize)]
        struct Probe {
            version: u32,
        }
        let probe: Probe = serde_json::from_str(text).map_err(QuotaFileError::Malformed)?;
        if probe.version != QUOTA_VERSION {
            return Err(QuotaFileError::Version(probe.version));
        }
        serde_json::from_str(text).map_err(QuotaFileError::Malformed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_is_versioned() {
        let q = ContainerQuota {
            version: QUOTA_VERSION,
            namespace: "ml".into(),
            pod: "nb-1".into(),
            uid: "u1".into(),
            container: "main".into(),
            init: false,
            gpus: vec![GpuQuota {
                uuid: "GPU-a".into(),
                memory_mib: 8192,
                compute_milli: 300,
                slices: 3,
                compute_policy: ComputePolicy::Cap,
                priority: Priority::BestEffort,
            }],
            device_ids: vec!["GPU-a-0".into()],
        };
        let s = q.to_json();
        assert_eq!(ContainerQuota::from_json(&s).expect("valid"), q);
        let extra = s.replace("\"pod\"", "\"later\":1,\"pod\"");
        assert_eq!(ContainerQuota::from_json(&extra).expect("valid"), q);
        assert!(matches!(
            ContainerQuota::from_json(&s.replace("\"version\":1", "\"version\":2")),
            Err(QuotaFileError::Version(2))
        ));
    }
}
