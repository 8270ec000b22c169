//! The GPU resource model: what a container asks for, and what bind hands to it.
//!
//! Every name lives under the `vgpu.io` domain (see `docs/resources.md` and ADR 0005):
//!
//! | name | unit | meaning |
//! |---|---|---|
//! | `vgpu.io/gpu` | 0.1-GPU slice | the simple unit; memory and compute in proportion; `10` is a whole GPU, `20` two whole GPUs |
//! | `vgpu.io/gpu-count` | GPUs | spread `vgpu.io/gpu` evenly over this many GPUs (each a fraction) |
//! | `vgpu.io/gpu-memory` | MiB per GPU | overrides the proportional memory |
//! | `vgpu.io/gpu-compute` | percent per GPU | overrides the proportional compute share |
//! | annotation `vgpu.io/gpu-model` | `A|B` | the pod may only use these GPU models |
//! | annotation `vgpu.io/gpu-model-exclude` | `A|B` | the pod must not use these GPU models |
//! | annotation `vgpu.io/gpu-memory-limit` | MiB per GPU: `MiB` or `name=MiB,…` | the memory limit above the request (ADR 0066, [`crate::memory_limit`]) |
//! | annotation `vgpu.io/assignment` | JSON | written once by bind: which GPU(s) each container got |
//!
//! Internally everything is in milli-GPU of compute (1000 = a whole GPU) and MiB of
//! memory: the 0.1 slice is an input unit, never a scheduling step.
//!
//! Values are Kubernetes quantities (the API server may rewrite `1000` as `1k`), so they
//! are parsed as Kubernetes does and must come out as whole numbers of the unit.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

/// The resource domain every vgpu name lives under.
pub const DOMAIN: &str = "vgpu.io";
/// 0.1-GPU slices (the device plugin advertises 10 per physical GPU).
pub const RESOURCE_GPU: &str = "vgpu.io/gpu";
/// Number of GPUs the container's slices are spread over.
pub const RESOURCE_GPU_COUNT: &str = "vgpu.io/gpu-count";
/// GPU memory per GPU, in MiB.
pub const RESOURCE_GPU_MEMORY: &str = "vgpu.io/gpu-memory";
/// Compute share per GPU, in percent.
pub const RESOURCE_GPU_COMPUTE: &str = "vgpu.io/gpu-compute";
/// Pod annotation: allowed GPU models, `|`-separated.
pub const ANNOTATION_GPU_MODEL: &str = "vgpu.io/gpu-model";
/// Pod annotation: excluded GPU models, `|`-separated.
pub const ANNOTATION_GPU_MODEL_EXCLUDE: &str = "vgpu.io/gpu-model-exclude";
/// Pod annotation: how the pod's containers may use idle GPU time, `burst` (default) or
/// `cap` (ADR 0010).
pub const ANNOTATION_COMPUTE_POLICY: &str = "vgpu.io/compute-policy";
/// Pod annotation: the pod's priority class on its GPUs, `best-effort` (default) or
/// `latency-sensitive` (ADR 0010).
pub const ANNOTATION_PRIORITY: &str = "vgpu.io/priority";
/// Pod annotation written by bind: the [`Assignment`] record as JSON.
pub const ANNOTATION_ASSIGNMENT: &str = "vgpu.io/assignment";
/// Node label the device plugin sets to the node's GPU model (for node affinity).
pub const LABEL_GPU_MODEL: &str = "vgpu.io/gpu-model";

/// Slices per physical GPU on a node configured as today (the default), and the most
/// slices one container may hold on one GPU (`vgpu.io/gpu` counts tenths).
pub const SLICES_PER_GPU: u32 = 10;
/// Device IDs per physical GPU on a node configured for fine sharing (ADR 0023): up to
/// 100 containers share a GPU, each holding at least one ID.
pub const FINE_SLICES_PER_GPU: u32 = 100;

/// Checks a node's device IDs per GPU (`--slices-per-gpu`, the inventory's
/// `slices_per_gpu`): from [`SLICES_PER_GPU`] (10, the default) to
/// [`FINE_SLICES_PER_GPU`] (100). Fewer than 10 would refuse a whole GPU (`vgpu.io/gpu:
/// 10`) on that node; more than 100 would let containers below the 1 % compute step on.
pub fn check_slices_per_gpu(n: u32) -> Result<u32, String> {
    if (SLICES_PER_GPU..=FINE_SLICES_PER_GPU).contains(&n) {
        Ok(n)
    } else {
        Err(format!(
            "slices per GPU {n} is out of range: {SLICES_PER_GPU} (one per tenth, the default) to {FINE_SLICES_PER_GPU} (one per percent, ADR 0023)"
        ))
    }
}
/// Milli-GPU per physical GPU.
pub const MILLI_PER_GPU: u32 = 1000;
/// Largest number of GPUs one container may ask for.
pub const MAX_GPUS_PER_CONTAINER: u32 = 64;
/// Largest GPU memory request accepted, in MiB (16 TiB): a bigger number almost always
/// means a unit mistake (`8Gi` read as MiB).
pub const MAX_GPU_MEMORY_MIB: u64 = 1 << 24;

/// Why a container's or pod's GPU request could not be understood.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResourceError {
    /// A quantity is not a valid Kubernetes quantity.
    #[error("{name}: invalid quantity {value:?}: {reason}")]
    BadQuantity {
        /// The resource name.
        name: String,
        /// The text as given.
        value: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A quantity is out of the range the resource accepts.
    #[error("{name}: {value:?} is out of range: {reason}")]
    OutOfRange {
        /// The resource name.
        name: String,
        /// The text as given.
        value: String,
        /// The allowed range, in words.
        reason: String,
    },
    /// The combination of resources is inconsistent.
    #[error("container {container:?}: {reason}")]
    Inconsistent {
        /// The container's name.
        container: String,
        /// What does not add up.
        reason: String,
    },
    /// Containers that kubelet's device reuse ties together cannot be given GPUs on
    /// which every one of them gets exactly its assigned devices.
    #[error("containers {}: {reason}", quoted(.containers))]
    Reuse {
        /// The containers concerned, in kubelet's order.
        containers: Vec<String>,
        /// Why, in words.
        reason: String,
    },
    /// A name under the vgpu.io domain that we do not know (likely a typo).
    #[error(
        "container {container:?}: unknown resource {name:?} (known: vgpu.io/gpu, vgpu.io/gpu-count, vgpu.io/gpu-memory, vgpu.io/gpu-compute)"
    )]
    UnknownResource {
        /// The container's name.
        container: String,
        /// The unknown name.
        name: String,
    },
    /// A model annotation is malformed.
    #[error("annotation {annotation}: invalid model list {value:?}: {reason}")]
    BadModelList {
        /// The annotation name.
        annotation: &'static str,
        /// The text as given.
        value: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The pod annotation `vgpu.io/gpu-memory-limit` is malformed (ADR 0066).
    #[error("annotation vgpu.io/gpu-memory-limit: invalid value {value:?}: {reason}")]
    BadMemoryLimit {
        /// The bad part of the value as written (at most 64 characters of it).
        value: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A container's memory limit (`vgpu.io/gpu-memory-limit`) is below its request.
    #[error(
        "annotation vgpu.io/gpu-memory-limit: container {container:?}: limit {limit_mib} MiB is below its request of {request_mib} MiB per GPU (a limit is at least the request)"
    )]
    LimitBelowRequest {
        /// The container's name.
        container: String,
        /// Its limit, MiB per GPU.
        limit_mib: u64,
        /// Its request on the GPU, MiB.
        request_mib: u64,
    },
    /// A compute annotation holds an unknown value.
    #[error("annotation {annotation}: {reason}")]
    BadComputeClass {
        /// The annotation name.
        annotation: &'static str,
        /// What is wrong with it (names the value and the accepted ones).
        reason: String,
    },
}

fn quoted(names: &[String]) -> String {
    names
        .iter()
        .map(|n| format!("{n:?}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Parses a Kubernetes quantity (`3`, `1k`, `2Gi`, `1500m`, `1e3`) into a whole number of
/// units.
///
/// Fractions are accepted only when the value is whole (`1.5k` = 1500, `2000m` = 2).
/// Negative values are rejected.
pub fn parse_quantity(name: &str, text: &str) -> Result<u64, ResourceError> {
    let bad = |reason: &'static str| ResourceError::BadQuantity {
        name: name.to_owned(),
        value: text.to_owned(),
        reason,
    };
    let t = text.trim();
    if t.is_empty() {
        return Err(bad("empty"));
    }
    let t = t.strip_prefix('+').unwrap_or(t);
    if t.starts_with('-') {
        return Err(bad("negative"));
    }
    let num_end = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, suffix) = t.split_at(num_end);
    if num.is_empty() || num == "." || num.matches('.').count() > 1 {
        return Err(bad("expected a number"));
    }
    // value = mantissa * 10^exp10 * 2^exp2
    let (mut exp10, exp2): (i32, u32) = match suffix {
        "" => (0, 0),
        "m" => (-3, 0),
        "k" => (3, 0),
        "M" => (6, 0),
        "G" => (9, 0),
        "T" => (12, 0),
        "P" => (15, 0),
        "E" => (18, 0),
        "Ki" => (0, 10),
        "Mi" => (0, 20),
        "Gi" => (0, 30),
        "Ti" => (0, 40),
        "Pi" => (0, 50),
        "Ei" => (0, 60),
        s if s.starts_with(['e', 'E']) => {
            let e: i32 = s[1..]
                .parse()
                .map_err(|_| bad("unknown suffix (use k, M, G, Ki, Mi, Gi, m or eN)"))?;
            if !(-30..=30).contains(&e) {
                return Err(bad("exponent out of range"));
            }
            (e, 0)
        }
        _ => return Err(bad("unknown suffix (use k, M, G, Ki, Mi, Gi, m or eN)")),
    };
    let (int_part, frac_part) = num.split_once('.').unwrap_or((num, ""));
    let digits: String = format!("{int_part}{frac_part}");
    let digits = digits.trim_start_matches('0');
    let frac_len = i32::try_from(frac_part.len()).map_err(|_| bad("too many digits"))?;
    exp10 -= frac_len;
    if digits.is_empty() {
        return Ok(0);
    }
    if digits.len() > 38 {
        return Err(bad("too many digits"));
    }
    let mut mantissa: u128 = digits.parse().map_err(|_| bad("expected a number"))?;
    // Strip trailing zeros into the exponent so that 1500m stays exact.
    while exp10 < 0 && mantissa.is_multiple_of(10) {
        mantissa /= 10;
        exp10 += 1;
    }
    if exp10 < 0 {
        // Divide by 10^-exp10 after multiplying by 2^exp2; must stay whole.
        let scaled = mantissa
            .checked_mul(1u128 << exp2)
            .ok_or_else(|| bad("too large"))?;
        let div = 10u128
            .checked_pow(exp10.unsigned_abs())
            .ok_or_else(|| bad("not a whole number"))?;
        if !scaled.is_multiple_of(div) {
            return Err(bad("not a whole number"));
        }
        return u64::try_from(scaled / div).map_err(|_| bad("too large"));
    }
    let v = 10u128
        .checked_pow(exp10.unsigned_abs())
        .and_then(|p| mantissa.checked_mul(p))
        .and_then(|v| v.checked_mul(1u128 << exp2))
        .ok_or_else(|| bad("too large"))?;
    u64::try_from(v).map_err(|_| bad("too large"))
}

/// How much memory a container needs on each of its GPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum MemoryDemand {
    /// A fraction of that GPU's memory, in thousandths (1000 = all of it).
    /// Resolved as `floor(total_mib * milli / 1000)`, so shares never sum past the total.
    FractionMilli(u32),
    /// An absolute amount in MiB.
    Mib(u64),
    /// The larger of two terms, each `floor(total_mib * milli / 1000) + mib`: what
    /// containers that kubelet's device reuse puts on one GPU hold at their peak when
    /// their phases ask for memory in different units (`packing::reuse`).
    MaxOf([(u32, u64); 2]),
}

impl MemoryDemand {
    /// The MiB this demand takes on a GPU with `total_mib` of memory.
    pub fn resolve(self, total_mib: u64) -> u64 {
        match self {
            MemoryDemand::FractionMilli(m) => {
                let v = u128::from(total_mib) * u128::from(m.min(MILLI_PER_GPU)) / 1000;
                u64::try_from(v).expect("at most total_mib, which fits in u64")
            }
            MemoryDemand::Mib(m) => m,
            MemoryDemand::MaxOf(terms) => terms
                .iter()
                .map(|&(milli, mib)| {
                    MemoryDemand::FractionMilli(milli)
                        .resolve(total_mib)
                        .saturating_add(mib)
                })
                .max()
                .unwrap_or(0),
        }
    }
}

/// One container's (or one task's) GPU demand, per GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct GpuDemand {
    /// Number of distinct GPUs (≥ 1).
    pub count: u32,
    /// Compute share on each GPU, in milli-GPU (1..=1000).
    pub compute_milli: u32,
    /// Memory on each GPU.
    pub memory: MemoryDemand,
    /// 0.1-GPU slices held on each GPU (the device plugin's handles, at most 10 per GPU);
    /// 0 where slices are not modelled (trace replay).
    pub slices: u32,
}

impl GpuDemand {
    /// `count` whole GPUs.
    pub fn whole(count: u32) -> Self {
        GpuDemand {
            count,
            compute_milli: MILLI_PER_GPU,
            memory: MemoryDemand::FractionMilli(MILLI_PER_GPU),
            slices: SLICES_PER_GPU,
        }
    }

    /// A share of one GPU given in milli-GPU, memory in proportion (the trace's model).
    pub fn share_milli(milli: u32) -> Self {
        GpuDemand {
            count: 1,
            compute_milli: milli,
            memory: MemoryDemand::FractionMilli(milli),
            slices: 0,
        }
    }

    /// Whether each GPU is taken whole (exclusively).
    pub fn is_whole(&self) -> bool {
        self.compute_milli >= MILLI_PER_GPU
            && self.memory == MemoryDemand::FractionMilli(MILLI_PER_GPU)
    }

    /// Total milli-GPU of compute over all GPUs.
    pub fn total_milli(&self) -> u64 {
        u64::from(self.count) * u64::from(self.compute_milli)
    }
}

/// Which GPU models a pod may use.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ModelConstraint {
    /// If non-empty, only these models (exact, case-sensitive names).
    pub allowed: Vec<String>,
    /// Never these models.
    pub excluded: Vec<String>,
}

impl ModelConstraint {
    /// No constraint.
    pub fn any() -> Self {
        Self::default()
    }

    /// Only the given models (empty means any).
    pub fn only<S: Into<String>>(models: impl IntoIterator<Item = S>) -> Self {
        ModelConstraint {
            allowed: models.into_iter().map(Into::into).collect(),
            excluded: Vec::new(),
        }
    }

    /// Whether `model` satisfies the constraint.
    pub fn allows(&self, model: &str) -> bool {
        (self.allowed.is_empty() || self.allowed.iter().any(|m| m == model))
            && !self.excluded.iter().any(|m| m == model)
    }

    /// Whether there is no constraint at all.
    pub fn is_any(&self) -> bool {
        self.allowed.is_empty() && self.excluded.is_empty()
    }
}

impl fmt::Display for ModelConstraint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.allowed.is_empty(), self.excluded.is_empty()) {
            (true, true) => write!(f, "any model"),
            (false, true) => write!(f, "one of {}", self.allowed.join("|")),
            (true, false) => write!(f, "none of {}", self.excluded.join("|")),
            (false, false) => write!(
                f,
                "one of {} but none of {}",
                self.allowed.join("|"),
                self.excluded.join("|")
            ),
        }
    }
}

/// Parses a `|`-separated model list (`"A100|H100"`); surrounding spaces are ignored.
pub fn parse_model_list(
    annotation: &'static str,
    text: &str,
) -> Result<Vec<String>, ResourceError> {
    let bad = |reason| ResourceError::BadModelList {
        annotation,
        value: text.to_owned(),
        reason,
    };
    if text.trim().is_empty() {
        return Ok(Vec::new());
    }
    let mut out = Vec::new();
    for part in text.split('|') {
        let p = part.trim();
        if p.is_empty() {
            return Err(bad("empty model name"));
        }
        if !p
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        {
            return Err(bad(
                "model names use only letters, digits, '-', '_' and '.'",
            ));
        }
        if !out.iter().any(|m: &String| m == p) {
            out.push(p.to_owned());
        }
    }
    Ok(out)
}

/// Reads the model constraint from a pod's annotations.
pub fn parse_model_constraint(
    annotations: &BTreeMap<String, String>,
) -> Result<ModelConstraint, ResourceError> {
    let allowed = match annotations.get(ANNOTATION_GPU_MODEL) {
        Some(v) => parse_model_list(ANNOTATION_GPU_MODEL, v)?,
        None => Vec::new(),
    };
    let excluded = match annotations.get(ANNOTATION_GPU_MODEL_EXCLUDE) {
        Some(v) => parse_model_list(ANNOTATION_GPU_MODEL_EXCLUDE, v)?,
        None => Vec::new(),
    };
    Ok(ModelConstraint { allowed, excluded })
}

/// Reads a pod's compute policy and priority class ([`ANNOTATION_COMPUTE_POLICY`],
/// [`ANNOTATION_PRIORITY`]); absent annotations give the defaults (`burst`,
/// `best-effort`). Surrounding spaces are ignored.
pub fn parse_compute_class(
    annotations: &BTreeMap<String, String>,
) -> Result<
    (
        crate::sched_proto::ComputePolicy,
        crate::sched_proto::Priority,
    ),
    ResourceError,
> {
    fn one<T: std::str::FromStr<Err = String> + Default>(
        annotations: &BTreeMap<String, String>,
        annotation: &'static str,
    ) -> Result<T, ResourceError> {
        annotations.get(annotation).map_or(Ok(T::default()), |v| {
            v.trim()
                .parse()
                .map_err(|reason| ResourceError::BadComputeClass { annotation, reason })
        })
    }
    Ok((
        one(annotations, ANNOTATION_COMPUTE_POLICY)?,
        one(annotations, ANNOTATION_PRIORITY)?,
    ))
}

/// Parses one container's resource requests (name → quantity text) into its GPU demand.
///
/// Returns `Ok(None)` when the container asks for no vgpu resource. Names outside the
/// `vgpu.io` domain are ignored (CPU and memory are kube-scheduler's).
pub fn parse_container_request(
    container: &str,
    requests: &BTreeMap<String, String>,
) -> Result<Option<GpuDemand>, ResourceError> {
    let mut slices = None;
    let mut count = None;
    let mut memory = None;
    let mut compute = None;
    for (name, value) in requests {
        let Some(rest) = name.strip_prefix(DOMAIN) else {
            continue;
        };
        if !rest.starts_with('/') {
            continue;
        }
        let v = parse_quantity(name, value)?;
        match name.as_str() {
            RESOURCE_GPU => slices = Some(v),
            RESOURCE_GPU_COUNT => count = Some(v),
            RESOURCE_GPU_MEMORY => memory = Some(v),
            RESOURCE_GPU_COMPUTE => compute = Some(v),
            _ => {
                return Err(ResourceError::UnknownResource {
                    container: container.to_owned(),
                    name: name.clone(),
                });
            }
        }
    }
    let inconsistent = |reason: String| ResourceError::Inconsistent {
        container: container.to_owned(),
        reason,
    };
    let range = |name: &str, v: u64, reason: String| ResourceError::OutOfRange {
        name: name.to_owned(),
        value: requests.get(name).cloned().unwrap_or_else(|| v.to_string()),
        reason,
    };
    let Some(slices) = slices else {
        if count.is_some() || memory.is_some() || compute.is_some() {
            return Err(inconsistent(format!(
                "{RESOURCE_GPU_COUNT}, {RESOURCE_GPU_MEMORY} and {RESOURCE_GPU_COMPUTE} need {RESOURCE_GPU} \
                 (at least one slice per GPU: it is the device plugin's handle)"
            )));
        }
        return Ok(None);
    };
    if slices == 0 {
        if count.is_some() || memory.is_some() || compute.is_some() {
            return Err(range(
                RESOURCE_GPU,
                slices,
                "must be at least 1 when other vgpu.io resources are set".into(),
            ));
        }
        return Ok(None);
    }
    let count = match count {
        Some(0) => {
            return Err(range(RESOURCE_GPU_COUNT, 0, "must be at least 1".into()));
        }
        Some(c) => c,
        None if slices > u64::from(SLICES_PER_GPU) => {
            if !slices.is_multiple_of(u64::from(SLICES_PER_GPU)) {
                return Err(range(
                    RESOURCE_GPU,
                    slices,
                    format!(
                        "more than {SLICES_PER_GPU} slices must be whole GPUs (a multiple of {SLICES_PER_GPU}); \
                         set {RESOURCE_GPU_COUNT} to spread fractions over several GPUs"
                    ),
                ));
            }
            slices / u64::from(SLICES_PER_GPU)
        }
        None => 1,
    };
    if count > u64::from(MAX_GPUS_PER_CONTAINER) {
        return Err(range(
            RESOURCE_GPU_COUNT,
            count,
            format!("at most {MAX_GPUS_PER_CONTAINER} GPUs per container"),
        ));
    }
    if !slices.is_multiple_of(count) {
        return Err(inconsistent(format!(
            "{RESOURCE_GPU}={slices} cannot be split evenly over {RESOURCE_GPU_COUNT}={count} GPUs"
        )));
    }
    let per_gpu_slices = slices / count;
    if per_gpu_slices > u64::from(SLICES_PER_GPU) {
        return Err(inconsistent(format!(
            "{RESOURCE_GPU}={slices} over {count} GPUs is {per_gpu_slices} slices per GPU, more than {SLICES_PER_GPU}"
        )));
    }
    let per_gpu_slices = u32::try_from(per_gpu_slices).expect("at most 10");
    let count = u32::try_from(count).expect("at most MAX_GPUS_PER_CONTAINER");
    let compute_milli = match compute {
        Some(p) if (1..=100).contains(&p) => u32::try_from(p * 10).expect("at most 1000"),
        Some(p) => {
            return Err(range(
                RESOURCE_GPU_COMPUTE,
                p,
                "percent of one GPU, 1 to 100".into(),
            ));
        }
        None => per_gpu_slices * (MILLI_PER_GPU / SLICES_PER_GPU),
    };
    let memory = match memory {
        Some(0) => return Err(range(RESOURCE_GPU_MEMORY, 0, "at least 1 MiB".into())),
        Some(m) if m > MAX_GPU_MEMORY_MIB => {
            return Err(range(
                RESOURCE_GPU_MEMORY,
                m,
                format!(
                    "MiB per GPU, at most {MAX_GPU_MEMORY_MIB}: the unit is MiB, so write 8192 for 8 GiB, not 8Gi"
                ),
            ));
        }
        Some(m) => MemoryDemand::Mib(m),
        None => MemoryDemand::FractionMilli(per_gpu_slices * (MILLI_PER_GPU / SLICES_PER_GPU)),
    };
    Ok(Some(GpuDemand {
        count,
        compute_milli,
        memory,
        slices: per_gpu_slices,
    }))
}

/// How kubelet runs a container, which decides whether its devices are reused by the
/// pod's later containers (kubelet's device manager, see `packing::reuse`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ContainerKind {
    /// An init container (runs to completion before the next one starts); its devices
    /// go into the pod's reuse pool.
    Init,
    /// A restartable init container (`restartPolicy: Always`, a sidecar): takes from
    /// the pool like an app container and keeps its devices.
    Sidecar,
    /// An app container: takes from the pool first, keeps its devices.
    #[default]
    App,
}

/// One container of a pod and its GPU demand.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ContainerDemand {
    /// Container name.
    pub name: String,
    /// What it needs.
    pub demand: GpuDemand,
    /// Init, sidecar or app container.
    #[serde(default)]
    pub kind: ContainerKind,
}

/// The current version of the [`Assignment`] record.
pub const ASSIGNMENT_VERSION: u32 = 1;

/// What bind records on the pod (annotation [`ANNOTATION_ASSIGNMENT`]) and the device
/// plugin reads: which GPU(s) each container got, and how much of each.
///
/// Compatibility: readers ignore unknown fields (a later minor addition); a different
/// `version` means an incompatible change and is refused with [`AssignmentError::Version`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Assignment {
    /// Record format version ([`ASSIGNMENT_VERSION`]).
    pub version: u32,
    /// The node the pod is bound to.
    pub node: String,
    /// Per container, in pod spec order.
    pub containers: Vec<ContainerAssignment>,
}

/// One container's GPUs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContainerAssignment {
    /// Container name.
    pub name: String,
    /// The GPUs, one entry per GPU.
    pub gpus: Vec<GpuGrant>,
}

/// A share of one physical GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuGrant {
    /// The GPU's UUID (`GPU-…`), as NVML reports it.
    pub uuid: String,
    /// Compute share, milli-GPU (1000 = the whole GPU).
    pub compute_milli: u32,
    /// Memory limit, MiB.
    pub memory_mib: u64,
    /// 0.1-GPU slices of the device plugin held on this GPU.
    #[serde(default)]
    pub slices: u32,
}

/// Why an assignment record could not be read.
#[derive(Debug, thiserror::Error)]
pub enum AssignmentError {
    /// Not valid JSON of the expected shape.
    #[error("annotation vgpu.io/assignment: malformed record")]
    Malformed(#[source] serde_json::Error),
    /// Written by an incompatible version.
    #[error("annotation vgpu.io/assignment: unsupported version {0} (this build reads version 1)")]
    Version(u32),
    /// A grant is out of range.
    #[error("annotation vgpu.io/assignment: container {container:?}: {reason}")]
    Invalid {
        /// The container the bad grant belongs to.
        container: String,
        /// What is wrong.
        reason: String,
    },
}

impl Assignment {
    /// Encodes the record for the annotation.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("plain structs always serialize")
    }

    /// Decodes and validates a record from the annotation's value.
    pub fn from_json(text: &str) -> Result<Self, AssignmentError> {
        #[derive(Deserialize)]
        struct Probe {
            version: u32,
        }
        let probe: Probe = serde_json::from_str(text).map_err(AssignmentError::Malformed)?;
        if probe.version != ASSIGNMENT_VERSION {
            return Err(AssignmentError::Version(probe.version));
        }
        let a: Assignment = serde_json::from_str(text).map_err(AssignmentError::Malformed)?;
        for c in &a.containers {
            let invalid = |reason: String| AssignmentError::Invalid {
                container: c.name.clone(),
                reason,
            };
            if c.gpus.is_empty() {
                return Err(invalid("no GPU".into()));
            }
            for g in &c.gpus {
                if g.uuid.is_empty() {
                    return Err(invalid("empty GPU uuid".into()));
                }
                if g.compute_milli > MILLI_PER_GPU {
                    return Err(invalid(format!(
                        "compute_milli {} on {} exceeds 1000",
                        g.compute_milli, g.uuid
                    )));
                }
                if g.slices > SLICES_PER_GPU {
                    return Err(invalid(format!(
                        "slices {} on {} exceeds 10",
                        g.slices, g.uuid
                    )));
                }
            }
            let mut uuids: Vec<&str> = c.gpus.iter().map(|g| g.uuid.as_str()).collect();
            uuids.sort_unstable();
            if uuids.windows(2).any(|w| w[0] == w[1]) {
                return Err(invalid("the same GPU listed twice".into()));
            }
        }
        Ok(a)
    }

    /// The grants of one container, if it has any.
    pub fn container(&self, name: &str) -> Option<&ContainerAssignment> {
        self.containers.iter().find(|c| c.name == name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn req(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn compute_class_annotations_parse_and_bad_values_are_named() {
        use crate::sched_proto::{ComputePolicy, Priority};
        assert_eq!(
            parse_compute_class(&req(&[])).unwrap(),
            (ComputePolicy::Burst, Priority::BestEffort)
        );
        assert_eq!(
            parse_compute_class(&req(&[
                (ANNOTATION_COMPUTE_POLICY, " cap "),
                (ANNOTATION_PRIORITY, "latency-sensitive")
            ]))
            .unwrap(),
            (ComputePolicy::Cap, Priority::LatencySensitive)
        );
        let e = parse_compute_class(&req(&[(ANNOTATION_COMPUTE_POLICY, "capped")]))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(ANNOTATION_COMPUTE_POLICY) && e.contains("\"capped\""),
            "{e}"
        );
        let e = parse_compute_class(&req(&[(ANNOTATION_PRIORITY, "urgent")]))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(ANNOTATION_PRIORITY) && e.contains("\"urgent\""),
            "{e}"
        );
    }

    #[test]
    fn quantities_parse_like_kubernetes() {
        assert_eq!(parse_quantity("x", "3").unwrap(), 3);
        assert_eq!(parse_quantity("x", "1k").unwrap(), 1000);
        assert_eq!(parse_quantity("x", "1.5k").unwrap(), 1500);
        assert_eq!(parse_quantity("x", "2000m").unwrap(), 2);
        assert_eq!(parse_quantity("x", "1Ki").unwrap(), 1024);
        assert_eq!(parse_quantity("x", "8Gi").unwrap(), 8 << 30);
        assert_eq!(parse_quantity("x", "1e3").unwrap(), 1000);
        assert_eq!(parse_quantity("x", "0").unwrap(), 0);
        assert_eq!(parse_quantity("x", "+7").unwrap(), 7);
        for bad in [
            "",
            "-1",
            "1.5",
            "500m",
            "1x",
            "k",
            "1..2",
            "1e99",
            "99999999999999999999",
        ] {
            let e = parse_quantity("vgpu.io/gpu", bad).unwrap_err();
            assert!(e.to_string().contains("vgpu.io/gpu"), "{e}");
        }
    }

    #[test]
    fn slices_are_tenths_of_one_gpu() {
        let d = parse_container_request("c", &req(&[("vgpu.io/gpu", "3")]))
            .unwrap()
            .unwrap();
        assert_eq!(d.count, 1);
        assert_eq!(d.compute_milli, 300);
        assert_eq!(d.memory, MemoryDemand::FractionMilli(300));
        assert_eq!(d.slices, 3);
        assert!(!d.is_whole());
    }

    #[test]
    fn multiples_of_ten_are_whole_gpus() {
        let d = parse_container_request("c", &req(&[("vgpu.io/gpu", "20")]))
            .unwrap()
            .unwrap();
        assert_eq!(d, GpuDemand::whole(2));
        assert!(d.is_whole());
        let e = parse_container_request("c", &req(&[("vgpu.io/gpu", "15")])).unwrap_err();
        assert!(e.to_string().contains("\"15\""), "{e}");
    }

    #[test]
    fn count_spreads_fractions() {
        let d = parse_container_request(
            "c",
            &req(&[("vgpu.io/gpu", "10"), ("vgpu.io/gpu-count", "2")]),
        )
        .unwrap()
        .unwrap();
        assert_eq!((d.count, d.compute_milli, d.slices), (2, 500, 5));
        let e = parse_container_request(
            "trainer",
            &req(&[("vgpu.io/gpu", "5"), ("vgpu.io/gpu-count", "2")]),
        )
        .unwrap_err();
        assert!(e.to_string().contains("trainer"), "{e}");
    }

    #[test]
    fn fine_requests_override_proportions() {
        let d = parse_container_request(
            "c",
            &req(&[
                ("vgpu.io/gpu", "1"),
                ("vgpu.io/gpu-memory", "4096"),
                ("vgpu.io/gpu-compute", "46"),
                ("cpu", "2"),
            ]),
        )
        .unwrap()
        .unwrap();
        assert_eq!(d.compute_milli, 460);
        assert_eq!(d.memory, MemoryDemand::Mib(4096));
        assert_eq!(d.slices, 1);
        let e = parse_container_request(
            "c",
            &req(&[("vgpu.io/gpu", "1"), ("vgpu.io/gpu-memory", "8Gi")]),
        )
        .unwrap_err();
        assert!(
            e.to_string().contains("8Gi") && e.to_string().contains("MiB"),
            "{e}"
        );
        let e = parse_container_request(
            "c",
            &req(&[("vgpu.io/gpu", "1"), ("vgpu.io/gpu-compute", "120")]),
        )
        .unwrap_err();
        assert!(e.to_string().contains("\"120\""), "{e}");
        let e = parse_container_request("c", &req(&[("vgpu.io/gpu-memory", "1024")])).unwrap_err();
        assert!(e.to_string().contains("vgpu.io/gpu"), "{e}");
        let e = parse_container_request("c", &req(&[("vgpu.io/gpus", "1")])).unwrap_err();
        assert!(e.to_string().contains("vgpu.io/gpus"), "{e}");
    }

    #[test]
    fn no_vgpu_resources_is_no_demand() {
        assert_eq!(
            parse_container_request("c", &req(&[("cpu", "1"), ("nvidia.com/gpu", "1")])).unwrap(),
            None
        );
    }

    #[test]
    fn model_annotations() {
        let a = req(&[
            ("vgpu.io/gpu-model", "A100|H100"),
            ("vgpu.io/gpu-model-exclude", "T4"),
        ]);
        let m = parse_model_constraint(&a).unwrap();
        assert!(m.allows("A100") && m.allows("H100") && !m.allows("T4") && !m.allows("V100"));
        assert_eq!(m.to_string(), "one of A100|H100 but none of T4");
        let e = parse_model_constraint(&req(&[("vgpu.io/gpu-model", "A100||H100")])).unwrap_err();
        assert!(e.to_string().contains("A100||H100"), "{e}");
    }

    #[test]
    fn memory_fractions_never_sum_past_the_total() {
        let total = 16_280;
        let sum: u64 = (0..3)
            .map(|_| MemoryDemand::FractionMilli(333).resolve(total))
            .sum();
        assert!(sum <= total);
        assert_eq!(MemoryDemand::FractionMilli(1000).resolve(total), total);
    }

    #[test]
    fn assignment_round_trips_and_is_versioned() {
        let a = Assignment {
            version: ASSIGNMENT_VERSION,
            node: "n1".into(),
            containers: vec![ContainerAssignment {
                name: "main".into(),
                gpus: vec![GpuGrant {
                    uuid: "GPU-1".into(),
                    compute_milli: 460,
                    memory_mib: 7536,
                    slices: 1,
                }],
            }],
        };
        let s = a.to_json();
        assert_eq!(Assignment::from_json(&s).unwrap(), a);
        let future = s.replace("\"version\":1", "\"version\":2");
        assert!(matches!(
            Assignment::from_json(&future),
            Err(AssignmentError::Version(2))
        ));
        let extra = s.replace("\"node\"", "\"later_field\":true,\"node\"");
        assert_eq!(Assignment::from_json(&extra).unwrap(), a);
        let over = s.replace("460", "1460");
        assert!(matches!(
            Assignment::from_json(&over),
            Err(AssignmentError::Invalid { .. })
        ));
        assert!(matches!(
            Assignment::from_json("{"),
            Err(AssignmentError::Malformed(_))
        ));
    }

    proptest! {
        #[test]
        fn quantity_never_panics(s in "\\PC{0,24}") {
            let _ = parse_quantity("x", &s);
        }

        #[test]
        fn plain_integers_round_trip(n in 0u64..u64::MAX) {
            prop_assert_eq!(parse_quantity("x", &n.to_string()).unwrap(), n);
        }

        #[test]
        fn decimal_suffixes_scale(n in 0u64..1_000_000, s in 0usize..4) {
            let (suf, mul) = [("", 1u64), ("k", 1000), ("M", 1_000_000), ("Ki", 1024)][s];
            prop_assert_eq!(parse_quantity("x", &format!("{n}{suf}")).unwrap(), n * mul);
        }

        #[test]
        fn container_parser_never_panics_and_demands_are_sane(
            g in proptest::option::of("[0-9]{1,3}|[0-9]k|\\PC{0,4}"),
            c in proptest::option::of("[0-9]{1,2}|\\PC{0,3}"),
            m in proptest::option::of("[0-9]{1,6}|[0-9]Gi"),
            p in proptest::option::of("[0-9]{1,3}"),
        ) {
            let mut r = BTreeMap::new();
            if let Some(g) = g { r.insert(RESOURCE_GPU.to_owned(), g); }
            if let Some(c) = c { r.insert(RESOURCE_GPU_COUNT.to_owned(), c); }
            if let Some(m) = m { r.insert(RESOURCE_GPU_MEMORY.to_owned(), m); }
            if let Some(p) = p { r.insert(RESOURCE_GPU_COMPUTE.to_owned(), p); }
            if let Ok(Some(d)) = parse_container_request("c", &r) {
                prop_assert!(d.count >= 1 && d.count <= MAX_GPUS_PER_CONTAINER);
                prop_assert!(d.compute_milli >= 1 && d.compute_milli <= 1000);
                prop_assert!(d.slices >= 1 && d.slices <= SLICES_PER_GPU);
                if let MemoryDemand::Mib(mib) = d.memory {
                    prop_assert!((1..=MAX_GPU_MEMORY_MIB).contains(&mib));
                }
            }
        }

        #[test]
        fn model_lists_never_panic_and_round_trip(models in proptest::collection::vec("[A-Za-z0-9_.-]{1,8}", 0..5)) {
            let text = models.join("|");
            let parsed = parse_model_list(ANNOTATION_GPU_MODEL, &text).unwrap();
            for m in &models {
                prop_assert!(parsed.contains(m));
            }
        }
    }
}
