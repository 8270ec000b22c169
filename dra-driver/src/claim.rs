//! What a ResourceClaim's allocation gives each of its requests on this node: a pure
//! function ([`plan`]) of the claim as the API server returns it (`resource.k8s.io/v1`,
//! the subset read here), kubelet's claim reference, and the node's GPUs.
//!
//! The device model (ADR 0071): one DRA device per GPU, named `gpu-<index>` in the pool
//! named after the node; its consumable capacities are `memory` (bytes) and `compute`
//! (GPUs, so `300m` is 0.3 of the GPU). The scheduler writes what each allocation
//! consumes into `status.allocation.devices.results[].consumedCapacity`; a result
//! without a capacity (the device taken whole, or a kubelet/scheduler without
//! consumable capacity) gets the whole GPU for it. The compute policy and priority come
//! from the allocation's opaque configuration for this driver ([`GpuConfig`]); later
//! entries override earlier ones (the API server lists the class's before the claim's).

use std::collections::BTreeMap;

use serde::Deserialize;
use vgpu_core::inventory::GpuInfo;
use vgpu_core::resources::{MILLI_PER_GPU, SLICES_PER_GPU, parse_quantity};
use vgpu_core::sched_proto::{ComputePolicy, Priority};

/// The capacity name of a GPU's memory, in bytes.
pub const CAPACITY_MEMORY: &str = "memory";
/// The capacity name of a GPU's compute share, in GPUs (`1` = the whole GPU).
pub const CAPACITY_COMPUTE: &str = "compute";
/// The `apiVersion` of the driver's opaque configuration.
pub const CONFIG_API_VERSION: &str = "vgpu.io/v1alpha1";
/// The `kind` of the driver's opaque configuration.
pub const CONFIG_KIND: &str = "GpuConfig";

/// The DRA device name of the GPU with NVML index `index`.
pub fn device_name(index: u32) -> String {
    format!("gpu-{index}")
}

/// The claim kubelet asks about (`Claim` of the DRA gRPC API).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ClaimRef {
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
    /// Its UID.
    pub uid: String,
}

impl std::fmt::Display for ClaimRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{} (uid {})", self.namespace, self.name, self.uid)
    }
}

/// The subset of a `resource.k8s.io/v1` ResourceClaim the driver reads.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ResourceClaim {
    /// Its metadata (the UID is compared with kubelet's).
    #[serde(default)]
    pub metadata: Meta,
    /// Its status (allocation and consumers).
    #[serde(default)]
    pub status: Option<ClaimStatus>,
}

/// Object metadata.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Meta {
    /// The UID.
    #[serde(default)]
    pub uid: Option<String>,
}

/// `status` of a claim.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClaimStatus {
    /// Set by the scheduler when the claim is allocated.
    #[serde(default)]
    pub allocation: Option<Allocation>,
    /// The consumers (pods) the claim is reserved for.
    #[serde(default)]
    pub reserved_for: Vec<Consumer>,
}

/// One consumer of a claim.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Consumer {
    /// Its resource (`pods`).
    #[serde(default)]
    pub resource: String,
    /// Its name.
    #[serde(default)]
    pub name: String,
    /// Its UID.
    #[serde(default)]
    pub uid: String,
}

/// `status.allocation`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Allocation {
    /// The allocated devices.
    #[serde(default)]
    pub devices: Option<DeviceAllocation>,
}

/// `status.allocation.devices`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct DeviceAllocation {
    /// One entry per allocated device and request.
    #[serde(default)]
    pub results: Vec<DeviceResult>,
    /// The configuration that applies to them.
    #[serde(default)]
    pub config: Vec<AllocatedConfig>,
}

/// One allocated device.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceResult {
    /// The request (`name` or `name/subrequest`).
    pub request: String,
    /// The driver whose device it is.
    pub driver: String,
    /// The device's pool.
    pub pool: String,
    /// The device's name.
    pub device: String,
    /// Set when the device is shared by several allocations.
    #[serde(default, rename = "shareID")]
    pub share_id: Option<String>,
    /// What this allocation consumes of the device's capacities (quantities).
    #[serde(default)]
    pub consumed_capacity: BTreeMap<String, String>,
}

/// One configuration entry of the allocation.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct AllocatedConfig {
    /// The requests it applies to (empty: all).
    #[serde(default)]
    pub requests: Vec<String>,
    /// A driver's opaque parameters.
    #[serde(default)]
    pub opaque: Option<OpaqueConfig>,
}

/// `opaque` configuration.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct OpaqueConfig {
    /// The driver it is for.
    pub driver: String,
    /// Its parameters (for this driver: a [`GpuConfig`]).
    #[serde(default)]
    pub parameters: serde_json::Value,
}

/// The driver's opaque configuration (`apiVersion: vgpu.io/v1alpha1`, `kind: GpuConfig`).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GpuConfig {
    /// [`CONFIG_API_VERSION`].
    pub api_version: String,
    /// [`CONFIG_KIND`].
    pub kind: String,
    /// `burst` (the default) or `cap`.
    #[serde(default)]
    pub compute_policy: Option<String>,
    /// `best-effort` (the default) or `latency-sensitive`.
    #[serde(default)]
    pub priority: Option<String>,
}

/// What one request of a claim gets: its GPUs with their shares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestPlan {
    /// The request's name as the allocation names it.
    pub request: String,
    /// Its devices, by GPU index.
    pub devices: Vec<PlannedDevice>,
    /// How its compute share is enforced.
    pub compute_policy: ComputePolicy,
    /// Its priority class.
    pub priority: Priority,
}

/// One GPU of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedDevice {
    /// The allocation's pool.
    pub pool: String,
    /// The DRA device name.
    pub device: String,
    /// The GPU's UUID.
    pub uuid: String,
    /// The GPU's NVML index.
    pub index: u32,
    /// Memory quota, MiB.
    pub memory_mib: u64,
    /// Compute share, milli-GPU.
    pub compute_milli: u32,
}

impl PlannedDevice {
    /// The 0.1-GPU slices the share amounts to (rounded up; what the quota file's
    /// `slices` says).
    pub fn slices(&self) -> u32 {
        let per_slice = MILLI_PER_GPU / SLICES_PER_GPU;
        self.compute_milli.div_ceil(per_slice)
    }
}

/// Everything a claim gives on this node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimPlan {
    /// The first pod the claim is reserved for (name, UID), empty when none is listed.
    pub pod: (String, String),
    /// One entry per request of this driver, in the allocation's order.
    pub requests: Vec<RequestPlan>,
}

/// Why a claim cannot be prepared: the claim and the problem (boxed, so that results
/// stay small). Every message names the claim and the bad value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("claim {claim}: {problem}")]
pub struct ClaimError {
    /// The claim kubelet asked about.
    pub claim: ClaimRef,
    /// What is wrong with it.
    pub problem: Box<Problem>,
}

impl ClaimError {
    /// `problem` with `claim`.
    pub fn new(claim: &ClaimRef, problem: Problem) -> ClaimError {
        ClaimError {
            claim: claim.clone(),
            problem: Box::new(problem),
        }
    }
}

/// What is wrong with a claim.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Problem {
    /// The API server holds a different claim under that name (deleted and re-created).
    #[error("the API server's claim has uid {found:?}")]
    Uid {
        /// The UID found.
        found: String,
    },
    /// The claim has no allocation.
    #[error("not allocated (no status.allocation.devices)")]
    NotAllocated,
    /// No allocated device is this driver's.
    #[error("no device allocated to driver {driver:?} (allocated: {found})")]
    NotOurs {
        /// This driver's name.
        driver: String,
        /// The drivers of the claim's devices, or "none".
        found: String,
    },
    /// A device is in another node's pool.
    #[error("device {device:?} is in pool {pool:?}, not this node's {node:?}")]
    Pool {
        /// The device.
        device: String,
        /// Its pool.
        pool: String,
        /// This node.
        node: String,
    },
    /// A device name names no GPU of this node.
    #[error("device {device:?} is not a GPU of this node (it has {known})")]
    UnknownDevice {
        /// The device.
        device: String,
        /// The node's device names.
        known: String,
    },
    /// A consumed capacity is not a quantity, or is zero.
    #[error("device {device:?}: consumed {capacity} {value:?}: {reason}")]
    BadCapacity {
        /// The device.
        device: String,
        /// The capacity's name.
        capacity: String,
        /// Its value.
        value: String,
        /// What is wrong.
        reason: String,
    },
    /// A consumed capacity exceeds the GPU's.
    #[error(
        "device {device:?} ({uuid}): consumed {capacity} {value:?} is more than the GPU's {limit}"
    )]
    OverCapacity {
        /// The device.
        device: String,
        /// The GPU's UUID.
        uuid: String,
        /// The capacity's name.
        capacity: String,
        /// The value asked.
        value: String,
        /// The GPU's capacity, in words.
        limit: String,
    },
    /// One request was given the same GPU twice.
    #[error("request {request:?} holds device {device:?} twice")]
    Duplicate {
        /// The request.
        request: String,
        /// The device.
        device: String,
    },
    /// The opaque configuration for this driver is not a valid [`GpuConfig`].
    #[error("opaque configuration for {driver:?}: {reason}")]
    Config {
        /// This driver.
        driver: String,
        /// What is wrong.
        reason: String,
    },
}

/// Where the claim is prepared, and by whom.
#[derive(Debug, Clone, Copy)]
pub struct Context<'a> {
    /// This driver's name.
    pub driver: &'a str,
    /// This node's name (the pool's).
    pub node: &'a str,
    /// The node's GPUs.
    pub gpus: &'a [GpuInfo],
}

/// What `claim` (as the API server returned it for `want`) gives on this node.
pub fn plan(
    want: &ClaimRef,
    claim: &ResourceClaim,
    cx: Context<'_>,
) -> Result<ClaimPlan, ClaimError> {
    plan_inner(&want.uid, claim, cx).map_err(|p| ClaimError::new(want, p))
}

fn plan_inner(uid: &str, claim: &ResourceClaim, cx: Context<'_>) -> Result<ClaimPlan, Problem> {
    let found_uid = claim.metadata.uid.clone().unwrap_or_default();
    if found_uid != uid {
        return Err(Problem::Uid { found: found_uid });
    }
    let status = claim.status.clone().unwrap_or_default();
    let Some(devices) = status.allocation.and_then(|a| a.devices) else {
        return Err(Problem::NotAllocated);
    };
    let ours: Vec<&DeviceResult> = devices
        .results
        .iter()
        .filter(|r| r.driver == cx.driver)
        .collect();
    if ours.is_empty() {
        let mut drivers: Vec<&str> = devices.results.iter().map(|r| r.driver.as_str()).collect();
        drivers.sort_unstable();
        drivers.dedup();
        return Err(Problem::NotOurs {
            driver: cx.driver.to_owned(),
            found: if drivers.is_empty() {
                "none".to_owned()
            } else {
                drivers.join(", ")
            },
        });
    }
    let pod = status
        .reserved_for
        .iter()
        .find(|c| c.resource == "pods")
        .map(|c| (c.name.clone(), c.uid.clone()))
        .unwrap_or_default();
    let mut requests: Vec<RequestPlan> = Vec::new();
    for r in ours {
        let dev = planned_device(r, cx)?;
        let i = match requests.iter().position(|p| p.request == r.request) {
            Some(i) => i,
            None => {
                let (compute_policy, priority) =
                    compute_class(&devices.config, &r.request, cx.driver)?;
                requests.push(RequestPlan {
                    request: r.request.clone(),
                    devices: Vec::new(),
                    compute_policy,
                    priority,
                });
                requests.len() - 1
            }
        };
        let req = &mut requests[i];
        if req.devices.iter().any(|d| d.uuid == dev.uuid) {
            return Err(Problem::Duplicate {
                request: r.request.clone(),
                device: r.device.clone(),
            });
        }
        req.devices.push(dev);
    }
    for r in &mut requests {
        r.devices.sort_by_key(|d| d.index);
    }
    Ok(ClaimPlan { pod, requests })
}

/// One allocated device of this driver: its GPU and the share the result consumes.
fn planned_device(r: &DeviceResult, cx: Context<'_>) -> Result<PlannedDevice, Problem> {
    if r.pool != cx.node {
        return Err(Problem::Pool {
            device: r.device.clone(),
            pool: r.pool.clone(),
            node: cx.node.to_owned(),
        });
    }
    let Some(gpu) = cx.gpus.iter().find(|g| device_name(g.index) == r.device) else {
        return Err(Problem::UnknownDevice {
            device: r.device.clone(),
            known: cx
                .gpus
                .iter()
                .map(|g| device_name(g.index))
                .collect::<Vec<_>>()
                .join(", "),
        });
    };
    let bad = |capacity: &str, value: &str, reason: String| Problem::BadCapacity {
        device: r.device.clone(),
        capacity: capacity.to_owned(),
        value: value.to_owned(),
        reason,
    };
    let over = |capacity: &str, value: &str, limit: String| Problem::OverCapacity {
        device: r.device.clone(),
        uuid: gpu.uuid.clone(),
        capacity: capacity.to_owned(),
        value: value.to_owned(),
        limit,
    };
    let memory_mib = match r.consumed_capacity.get(CAPACITY_MEMORY) {
        None => gpu.memory_mib,
        Some(v) => {
            let bytes = parse_quantity(CAPACITY_MEMORY, v)
                .map_err(|e| bad(CAPACITY_MEMORY, v, e.to_string()))?;
            let mib = bytes.div_ceil(1 << 20);
            if mib == 0 {
                return Err(bad(CAPACITY_MEMORY, v, "zero memory".to_owned()));
            }
            if mib > gpu.memory_mib {
                return Err(over(CAPACITY_MEMORY, v, format!("{} MiB", gpu.memory_mib)));
            }
            mib
        }
    };
    let compute_milli = match r.consumed_capacity.get(CAPACITY_COMPUTE) {
        None => MILLI_PER_GPU,
        Some(v) => {
            let milli = milli_of(v).map_err(|reason| bad(CAPACITY_COMPUTE, v, reason))?;
            if milli == 0 {
                return Err(bad(CAPACITY_COMPUTE, v, "zero compute".to_owned()));
            }
            if milli > u64::from(MILLI_PER_GPU) {
                return Err(over(CAPACITY_COMPUTE, v, "1 (the whole GPU)".to_owned()));
            }
            u32::try_from(milli).expect("at most MILLI_PER_GPU")
        }
    };
    Ok(PlannedDevice {
        pool: r.pool.clone(),
        device: r.device.clone(),
        uuid: gpu.uuid.clone(),
        index: gpu.index,
        memory_mib,
        compute_milli,
    })
}

/// A quantity of GPUs in thousandths: `300m` → 300, `1` → 1000, `0.25` → 250. A
/// quantity finer than a thousandth is refused.
pub fn milli_of(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let r = if let Some(m) = t.strip_suffix('m') {
        parse_quantity(CAPACITY_COMPUTE, m)
    } else if !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        parse_quantity(CAPACITY_COMPUTE, &format!("{t}e3"))
    } else {
        parse_quantity(CAPACITY_COMPUTE, t).and_then(|v| {
            v.checked_mul(1000)
                .ok_or(vgpu_core::resources::ResourceError::BadQuantity {
                    name: CAPACITY_COMPUTE.to_owned(),
                    value: t.to_owned(),
                    reason: "too large",
                })
        })
    };
    r.map_err(|e| e.to_string())
}

/// The compute policy and priority that the allocation's configuration gives `request`
/// (`name/sub` matches entries for `name` too).
fn compute_class(
    config: &[AllocatedConfig],
    request: &str,
    driver: &str,
) -> Result<(ComputePolicy, Priority), Problem> {
    let parent = request.split('/').next().unwrap_or(request);
    let err = |reason: String| Problem::Config {
        driver: driver.to_owned(),
        reason,
    };
    let mut policy = ComputePolicy::default();
    let mut priority = Priority::default();
    for c in config {
        let Some(opaque) = c.opaque.as_ref().filter(|o| o.driver == driver) else {
            continue;
        };
        if !c.requests.is_empty() && !c.requests.iter().any(|q| q == request || q == parent) {
            continue;
        }
        let g: GpuConfig =
            serde_json::from_value(opaque.parameters.clone()).map_err(|e| err(e.to_string()))?;
        if g.api_version != CONFIG_API_VERSION || g.kind != CONFIG_KIND {
            return Err(err(format!(
                "apiVersion {:?} kind {:?} (expected {CONFIG_API_VERSION} {CONFIG_KIND})",
                g.api_version, g.kind
            )));
        }
        if let Some(p) = &g.compute_policy {
            policy = p.trim().parse().map_err(|e: String| err(e))?;
        }
        if let Some(p) = &g.priority {
            priority = p.trim().parse().map_err(|e: String| err(e))?;
        }
    }
    Ok((policy, priority))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn gpus() -> Vec<GpuInfo> {
        (0..2)
            .map(|i| GpuInfo {
                index: i,
                uuid: format!("GPU-{i}"),
                model: "m".into(),
                memory_mib: 16384,
                healthy: true,
                topology: None,
            })
            .collect()
    }

    fn want() -> ClaimRef {
        ClaimRef {
            namespace: "ml".into(),
            name: "c".into(),
            uid: "u1".into(),
        }
    }

    fn claim(results: serde_json::Value, config: serde_json::Value) -> ResourceClaim {
        serde_json::from_value(json!({
            "metadata": {"name": "c", "namespace": "ml", "uid": "u1"},
            "status": {
                "allocation": {"devices": {"results": results, "config": config}},
                "reservedFor": [{"resource": "pods", "name": "p", "uid": "pu"}]
            }
        }))
        .unwrap()
    }

    fn cx(g: &[GpuInfo]) -> Context<'_> {
        Context {
            driver: "vgpu.io",
            node: "n1",
            gpus: g,
        }
    }

    #[test]
    fn consumed_capacity_becomes_the_request_share_and_config_the_class() {
        let g = gpus();
        let c = claim(
            json!([
                {"request": "r", "driver": "vgpu.io", "pool": "n1", "device": "gpu-1",
                 "shareID": "s1", "consumedCapacity": {"memory": "4Gi", "compute": "300m"}},
                {"request": "r", "driver": "vgpu.io", "pool": "n1", "device": "gpu-0"},
                {"request": "other", "driver": "x.io", "pool": "n1", "device": "d"}
            ]),
            json!([
                {"source": "FromClass", "opaque": {"driver": "vgpu.io", "parameters":
                    {"apiVersion": "vgpu.io/v1alpha1", "kind": "GpuConfig", "computePolicy": "cap"}}},
                {"source": "FromClaim", "requests": ["r"], "opaque": {"driver": "vgpu.io", "parameters":
                    {"apiVersion": "vgpu.io/v1alpha1", "kind": "GpuConfig", "priority": "latency-sensitive"}}}
            ]),
        );
        let p = plan(&want(), &c, cx(&g)).unwrap();
        assert_eq!(p.pod, ("p".into(), "pu".into()));
        assert_eq!(p.requests.len(), 1);
        let r = &p.requests[0];
        assert_eq!(r.compute_policy, ComputePolicy::Cap);
        assert_eq!(r.priority, Priority::LatencySensitive);
        // Sorted by GPU index; the whole GPU where nothing was consumed.
        assert_eq!(r.devices[0].uuid, "GPU-0");
        assert_eq!(
            (r.devices[0].memory_mib, r.devices[0].compute_milli),
            (16384, 1000)
        );
        assert_eq!(
            (r.devices[1].memory_mib, r.devices[1].compute_milli),
            (4096, 300)
        );
        assert_eq!(r.devices[1].slices(), 3);
    }

    #[test]
    fn compute_quantities_in_thousandths() {
        assert_eq!(milli_of("300m"), Ok(300));
        assert_eq!(milli_of("1"), Ok(1000));
        assert_eq!(milli_of("0.25"), Ok(250));
        assert!(milli_of("0.0001").is_err());
        assert!(milli_of("lots").unwrap_err().contains("lots"));
    }

    #[test]
    fn bad_claims_are_refused_naming_the_value() {
        let g = gpus();
        let one = |dev: serde_json::Value| claim(json!([dev]), json!([]));
        let e = |c: &ResourceClaim| plan(&want(), c, cx(&g)).unwrap_err().to_string();
        let msg = e(&one(
            json!({"request": "r", "driver": "vgpu.io", "pool": "n1",
            "device": "gpu-0", "consumedCapacity": {"memory": "17Gi"}}),
        ));
        assert!(
            msg.contains("\"17Gi\"") && msg.contains("16384 MiB") && msg.contains("ml/c"),
            "{msg}"
        );
        let msg = e(&one(
            json!({"request": "r", "driver": "vgpu.io", "pool": "n1",
            "device": "gpu-0", "consumedCapacity": {"compute": "1500m"}}),
        ));
        assert!(msg.contains("compute \"1500m\""), "{msg}");
        let msg = e(&one(
            json!({"request": "r", "driver": "vgpu.io", "pool": "n1", "device": "gpu-7"}),
        ));
        assert!(
            msg.contains("\"gpu-7\"") && msg.contains("gpu-0, gpu-1"),
            "{msg}"
        );
        let msg = e(&one(
            json!({"request": "r", "driver": "vgpu.io", "pool": "n2", "device": "gpu-0"}),
        ));
        assert!(msg.contains("\"n2\""), "{msg}");
        let msg = e(&one(
            json!({"request": "r", "driver": "gpu.nvidia.com", "pool": "n1", "device": "gpu-0"}),
        ));
        assert!(
            msg.contains("gpu.nvidia.com") && msg.contains("\"vgpu.io\""),
            "{msg}"
        );
        let mut c =
            one(json!({"request": "r", "driver": "vgpu.io", "pool": "n1", "device": "gpu-0"}));
        c.metadata.uid = Some("u2".into());
        assert!(e(&c).contains("\"u2\""));
        c.metadata.uid = Some("u1".into());
        c.status = None;
        assert!(e(&c).contains("not allocated"));
        let c = claim(
            json!([{"request": "r", "driver": "vgpu.io", "pool": "n1", "device": "gpu-0"}]),
            json!([{"opaque": {"driver": "vgpu.io", "parameters":
                {"apiVersion": "vgpu.io/v1alpha1", "kind": "GpuConfig", "priority": "urgent"}}}]),
        );
        assert!(e(&c).contains("\"urgent\""));
    }
}
