//! The container quota file: what the device plugin writes for one container and the
//! shim (`libvgpu.so`) reads at start.
//!
//! The file is `vgpu.conf` in the container's `VGPU_CONTAINER_DIR` (ADR 0009), and the
//! same file at the fixed path [`FIXED_QUOTA_FILE`] (ADR 0042): the device plugin mounts
//! the container's directory read-only at [`FIXED_DIR`], where the tenant can neither
//! choose nor replace it. It is JSON:
//!
//! ```json
//! {"version":1,"namespace":"ml","pod":"nb-1","uid":"7d…","container":"main","init":false,
//!  "gpus":[{"uuid":"GPU-8c1f…","memory_mib":8192,"memory_limit_mib":16384,
//!           "compute_milli":300,"slices":3}],
//!  "device_ids":["GPU-8c1f…-0","GPU-8c1f…-1","GPU-8c1f…-2"]}
//! ```
//!
//! Every reader asks one question of it, [`ContainerQuota::grant`]: "what does this GPU
//! get?". On each GPU, `memory_mib` is the container's memory *request* (guaranteed)
//! and `memory_limit_mib` its *limit* (ADR 0066: it may burst above the request up to
//! it); read them with [`GpuQuota::memory_bytes`], [`GpuQuota::limit_bytes`],
//! [`GpuQuota::burst_bytes`] and [`GpuQuota::is_burstable`]. A file without
//! `memory_limit_mib` (written before it existed) reads as limit = request, a guaranteed
//! container, as it always was; an older reader ignores the field and holds the container
//! to its request. A GPU is matched by UUID ignoring surrounding white space and ASCII case
//! ([`same_gpu`]); a listed GPU gets its memory and compute share
//! ([`GpuQuota::compute_settings`]); a GPU the container can see but the file does not
//! list is [`GpuGrant::NotGranted`]: no memory, no compute share (it is hidden from the
//! container's programs where the shim can, and never makes a whole process fail).
//! The shim, the daemon and the device plugin all read the file through
//! [`ContainerQuota::from_json`], which also refuses records no reader could honour
//! (a GPU listed twice, a listed GPU with no memory). Compatibility rules, as for the other records: readers
//! ignore unknown fields (minor additions); a different `version` is incompatible and
//! refused, and the shim then fails loudly rather than running unlimited.

use serde::{Deserialize, Serialize};

use crate::sched_proto::{ComputePolicy, ComputeSettings, Priority};

/// Name of the quota file inside the container directory.
pub const QUOTA_FILE: &str = "vgpu.conf";
/// The fixed directory, inside every container the device plugin allocates, that holds
/// the container's quota file (ADR 0042): its directory mounted read-only. Not
/// configurable (an environment variable would be the tenant's): where this directory
/// holds a quota file, the shim takes the quota and the accounting region's identity
/// from here, whatever `VGPU_CONTAINER_DIR` says.
pub const FIXED_DIR: &str = "/etc/vgpu";
/// The container's quota file at the fixed path ([`FIXED_DIR`] + [`QUOTA_FILE`]).
pub const FIXED_QUOTA_FILE: &str = "/etc/vgpu/vgpu.conf";
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
    /// Memory request, MiB: what the container is guaranteed on this GPU (ADR 0066).
    pub memory_mib: u64,
    /// Memory limit, MiB: what the container may reach by bursting above its request
    /// (ADR 0066), at least `memory_mib`. Absent (files written before the limit
    /// existed, or by a writer that gives none): the request. Read it through
    /// [`GpuQuota::limit_mib`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_limit_mib: Option<u64>,
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

/// What a container gets on one GPU, by its quota file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuGrant<'a> {
    /// The file lists the GPU: this is its quota.
    Granted(&'a GpuQuota),
    /// The container can see the GPU but was not given it: no memory, no compute share.
    NotGranted,
}

/// Whether two GPU UUIDs name the same GPU: equal after trimming white space, ignoring
/// ASCII case (NVIDIA prints lower-case hex; people and tools do not always).
pub fn same_gpu(a: &str, b: &str) -> bool {
    a.trim().eq_ignore_ascii_case(b.trim())
}

impl GpuQuota {
    /// The compute settings the file grants on this GPU: share in percent (the
    /// milli-GPU figure rounded down, at least 1 %, at most 100 %), policy, priority.
    pub fn compute_settings(&self) -> ComputeSettings {
        ComputeSettings {
            share_pct: (self.compute_milli / 10).clamp(1, 100),
            policy: self.compute_policy,
            priority: self.priority,
        }
    }

    /// The memory request (the guaranteed quota) in bytes.
    pub fn memory_bytes(&self) -> u64 {
        // `validate` refuses values whose byte count overflows.
        self.memory_mib.saturating_mul(1 << 20)
    }

    /// The memory limit, MiB: `memory_limit_mib`, or the request where the file gives
    /// none (never below the request: `validate` refuses such a record).
    pub fn limit_mib(&self) -> u64 {
        self.memory_limit_mib
            .unwrap_or(self.memory_mib)
            .max(self.memory_mib)
    }

    /// The memory limit in bytes ([`GpuQuota::limit_mib`]).
    pub fn limit_bytes(&self) -> u64 {
        // `validate` refuses values whose byte count overflows.
        self.limit_mib().saturating_mul(1 << 20)
    }

    /// What the container may take above its request on this GPU, bytes (0 for a
    /// guaranteed container).
    pub fn burst_bytes(&self) -> u64 {
        self.limit_bytes() - self.memory_bytes()
    }

    /// Whether the container may burst above its request on this GPU (limit above the
    /// request); otherwise it is guaranteed (ADR 0066).
    pub fn is_burstable(&self) -> bool {
        self.limit_mib() > self.memory_mib
    }
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
    /// A GPU is listed twice (UUIDs compared as by [`same_gpu`]).
    #[error("quota file: GPU {0:?} is listed twice")]
    Duplicate(String),
    /// A listed GPU has no memory or more than any GPU could have.
    #[error("quota file: GPU {uuid:?} has memory_mib {memory_mib} (1–{max} allowed)")]
    Memory {
        /// The GPU.
        uuid: String,
        /// Its `memory_mib`.
        memory_mib: u64,
        /// The largest accepted value.
        max: u64,
    },
    /// A listed GPU's memory limit is below its request or above any GPU's memory.
    #[error(
        "quota file: GPU {uuid:?} has memory_limit_mib {limit_mib} (memory_mib {memory_mib} to {max} allowed)"
    )]
    Limit {
        /// The GPU.
        uuid: String,
        /// Its `memory_limit_mib`.
        limit_mib: u64,
        /// Its `memory_mib` (the request, the smallest accepted limit).
        memory_mib: u64,
        /// The largest accepted value.
        max: u64,
    },
    /// A listed GPU's UUID is empty.
    #[error("quota file: a GPU has an empty uuid")]
    EmptyUuid,
}

/// Largest `memory_mib` a record may give one GPU (1 PiB: far above any GPU, far below
/// an overflow of the byte count).
pub const MAX_MEMORY_MIB: u64 = 1 << 30;

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
        let q: ContainerQuota = serde_json::from_str(text).map_err(QuotaFileError::Malformed)?;
        q.validate()?;
        Ok(q)
    }

    /// Checks what every reader relies on: each GPU listed once, with a UUID, a
    /// memory request of 1 MiB to [`MAX_MEMORY_MIB`] and a limit, where given, from the
    /// request to [`MAX_MEMORY_MIB`].
    pub fn validate(&self) -> Result<(), QuotaFileError> {
        for (i, g) in self.gpus.iter().enumerate() {
            if g.uuid.trim().is_empty() {
                return Err(QuotaFileError::EmptyUuid);
            }
            if g.memory_mib == 0 || g.memory_mib > MAX_MEMORY_MIB {
                return Err(QuotaFileError::Memory {
                    uuid: g.uuid.clone(),
                    memory_mib: g.memory_mib,
                    max: MAX_MEMORY_MIB,
                });
            }
            if let Some(limit) = g.memory_limit_mib
                && (limit < g.memory_mib || limit > MAX_MEMORY_MIB)
            {
                return Err(QuotaFileError::Limit {
                    uuid: g.uuid.clone(),
                    limit_mib: limit,
                    memory_mib: g.memory_mib,
                    max: MAX_MEMORY_MIB,
                });
            }
            if self.gpus[..i].iter().any(|o| same_gpu(&o.uuid, &g.uuid)) {
                return Err(QuotaFileError::Duplicate(g.uuid.clone()));
            }
        }
        Ok(())
    }

    /// What the container gets on the GPU `uuid` (matched as by [`same_gpu`]).
    pub fn grant(&self, uuid: &str) -> GpuGrant<'_> {
        match self.gpus.iter().find(|g| same_gpu(&g.uuid, uuid)) {
            Some(g) => GpuGrant::Granted(g),
            None => GpuGrant::NotGranted,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fixed_quota_file_is_the_fixed_directory_and_the_file_name() {
        assert_eq!(
            std::path::Path::new(FIXED_DIR).join(QUOTA_FILE),
            std::path::Path::new(FIXED_QUOTA_FILE)
        );
    }

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
                memory_limit_mib: Some(16384),
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

    fn two_gpus() -> ContainerQuota {
        let g = |uuid: &str, mib, milli| GpuQuota {
            uuid: uuid.into(),
            memory_mib: mib,
            memory_limit_mib: None,
            compute_milli: milli,
            slices: 1,
            compute_policy: ComputePolicy::Burst,
            priority: Priority::BestEffort,
        };
        ContainerQuota {
            version: QUOTA_VERSION,
            namespace: "ml".into(),
            pod: "p".into(),
            uid: "u".into(),
            container: "c".into(),
            init: false,
            gpus: vec![g("GPU-aa01", 1024, 300), g(" gpu-BB02 ", 2048, 5)],
            device_ids: vec![],
        }
    }

    #[test]
    fn a_gpu_is_matched_ignoring_case_and_white_space() {
        let q = two_gpus();
        for name in ["GPU-aa01", "gpu-AA01", " GPU-aa01\n"] {
            assert!(
                matches!(q.grant(name), GpuGrant::Granted(g) if g.memory_mib == 1024),
                "{name:?}"
            );
        }
        assert!(matches!(q.grant("GPU-bb02"), GpuGrant::Granted(g) if g.memory_mib == 2048));
        assert_eq!(q.grant("GPU-cc03"), GpuGrant::NotGranted);
        assert_eq!(q.grant(""), GpuGrant::NotGranted);
    }

    #[test]
    fn compute_settings_round_down_to_a_percent_of_at_least_one() {
        let q = two_gpus();
        assert_eq!(q.gpus[0].compute_settings().share_pct, 30);
        assert_eq!(q.gpus[1].compute_settings().share_pct, 1);
        assert_eq!(q.gpus[0].memory_bytes(), 1 << 30);
    }

    #[test]
    fn a_file_without_a_limit_reads_as_limit_equal_to_request() {
        // The version-1 file every plugin wrote before ADR 0066, byte for byte.
        let old = r#"{"version":1,"namespace":"ml","pod":"p","uid":"u","container":"c","init":false,"gpus":[{"uuid":"GPU-a","memory_mib":4096,"compute_milli":300,"slices":3}],"device_ids":[]}"#;
        let q = ContainerQuota::from_json(old).expect("an old file is valid");
        let g = &q.gpus[0];
        assert_eq!(g.memory_limit_mib, None);
        assert_eq!((g.limit_mib(), g.limit_bytes()), (4096, 4096 << 20));
        assert_eq!(g.burst_bytes(), 0);
        assert!(!g.is_burstable());
        // Written back without a limit, it stays the old shape.
        assert!(!q.to_json().contains("memory_limit_mib"));
    }

    #[test]
    fn a_limit_above_the_request_is_carried_and_read_back() {
        let mut q = two_gpus();
        q.gpus[0].memory_limit_mib = Some(3072);
        q.gpus[1].memory_limit_mib = Some(2048);
        let back = ContainerQuota::from_json(&q.to_json()).expect("valid");
        assert_eq!(back, q);
        let (a, b) = (&back.gpus[0], &back.gpus[1]);
        assert_eq!((a.memory_bytes(), a.limit_bytes()), (1 << 30, 3 << 30));
        assert_eq!(a.burst_bytes(), 2 << 30);
        assert!(a.is_burstable());
        assert_eq!((b.limit_mib(), b.burst_bytes()), (2048, 0));
        assert!(!b.is_burstable());
    }

    #[test]
    fn a_limit_below_the_request_or_past_any_gpu_is_refused_naming_the_gpu() {
        for limit in [1023, 0, MAX_MEMORY_MIB + 1, u64::MAX] {
            let mut q = two_gpus();
            q.gpus[0].memory_limit_mib = Some(limit);
            let e = ContainerQuota::from_json(&q.to_json()).expect_err("bad limit");
            assert!(matches!(e, QuotaFileError::Limit { .. }), "{e}");
            let e = e.to_string();
            assert!(
                e.contains("GPU-aa01") && e.contains(&format!("memory_limit_mib {limit}")),
                "{e}"
            );
        }
        let mut q = two_gpus();
        q.gpus[0].memory_limit_mib = Some(MAX_MEMORY_MIB);
        assert!(ContainerQuota::from_json(&q.to_json()).is_ok());
        let text = two_gpus().to_json().replace(
            "\"memory_mib\":1024",
            "\"memory_mib\":1024,\"memory_limit_mib\":-1",
        );
        assert!(matches!(
            ContainerQuota::from_json(&text),
            Err(QuotaFileError::Malformed(_))
        ));
    }

    #[test]
    fn records_no_reader_could_honour_are_refused_naming_the_gpu() {
        let mut q = two_gpus();
        q.gpus[1].uuid = "gpu-AA01".into();
        let e = ContainerQuota::from_json(&q.to_json()).expect_err("duplicate");
        assert!(e.to_string().contains("gpu-AA01"), "{e}");
        let mut q = two_gpus();
        q.gpus[0].memory_mib = 0;
        let e = ContainerQuota::from_json(&q.to_json()).expect_err("zero memory");
        assert!(e.to_string().contains("GPU-aa01") && e.to_string().contains("memory_mib 0"));
        let mut q = two_gpus();
        q.gpus[0].memory_mib = u64::MAX;
        assert!(ContainerQuota::from_json(&q.to_json()).is_err());
        let mut q = two_gpus();
        q.gpus[0].uuid = "  ".into();
        assert!(matches!(
            ContainerQuota::from_json(&q.to_json()),
            Err(QuotaFileError::EmptyUuid)
        ));
        assert!(ContainerQuota::from_json(&two_gpus().to_json()).is_ok());
    }
}
