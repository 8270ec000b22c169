//! What the daemon reports: plain data, shared by the gRPC API, the Prometheus
//! endpoint and `vgpuctl`.

use serde::{Deserialize, Serialize};
use vgpu_core::sched_proto::ComputeSettings;

/// Where a tenant's compute settings came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SettingsSource {
    /// Proposed by the shim (its environment): standalone mode only.
    Shim,
    /// The container's quota file, read by the daemon through `/proc/PID/root`.
    QuotaFile,
    /// Set by an operator through the API (`vgpuctl set`).
    Api,
    /// The daemon's default (nothing trusted was found).
    Default,
}

/// Scheduling state of a tenant on one GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SliceState {
    /// Holds the GPU.
    Holding,
    /// Its grant was revoked; waiting for its queued work to drain.
    Draining,
    /// Has launches blocked, waiting for a grant.
    Waiting,
    /// Nothing to run.
    Idle,
}

/// One tenant (container) on one GPU.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TenantGpu {
    /// GPU UUID.
    pub uuid: String,
    /// Settings in force.
    pub settings: ComputeSettings,
    /// Where they came from.
    pub source: SettingsSource,
    /// Bytes of GPU memory charged to the container (reported by its shims).
    pub memory_used: u64,
    /// The container's memory quota on this GPU, bytes (None: unlimited).
    pub memory_quota: Option<u64>,
    /// GPU time charged since the tenant appeared, ns (measured: grant to drain).
    pub gpu_time_ns: u64,
    /// Time spent with launches blocked while another tenant held the GPU, ns.
    pub throttled_ns: u64,
    /// Grants received.
    pub grants: u64,
    /// Share of the GPU's time charged to this tenant over the last window, percent.
    pub recent_share_pct: f64,
    /// Current state.
    pub state: SliceState,
    /// Holding the GPU beside another tenant (co-holding, ADR 0029).
    #[serde(default)]
    pub co_held: bool,
    /// Device time over time held of its recent grants, percent (None: not measured).
    #[serde(default)]
    pub fill_pct: Option<f64>,
    /// Part of the recent time its container was stopped by its CPU limit, percent.
    #[serde(default)]
    pub cpu_stopped_pct: f64,
    /// Grants taken back before any of its processes launched under them: granted while
    /// its container was stopped (ADR 0030).
    #[serde(default)]
    pub unclaimed_grants: u64,
    /// Grants its shims yielded at their expiry because the daemon had not revoked (or
    /// renewed) them in time: the daemon was starved of CPU or frozen (ADR 0036).
    #[serde(default)]
    pub expired_grants: u64,
    /// How long its next exclusive slice lasts, ns: the quantum, longer for a tenant
    /// slow to start under its grants and to report its drains (its container starved
    /// or throttled of CPU); 0: not known.
    #[serde(default)]
    pub slice_ns: u64,
    /// The queue-ahead bound its next exclusive grant names, ns: the shims' bound, more
    /// for a tenant slow to start under its grants and to report its drains (ADR 0032);
    /// a best-effort holder beside latency-sensitive tenants is granted 300 µs instead
    /// (or the shims' bound where shorter); 0: not known (or unbounded).
    #[serde(default)]
    pub queue_ahead_ns: u64,
    /// GPU memory of the container held in host memory while it is suspended, bytes
    /// (its quota stays its own meanwhile; issue 43).
    #[serde(default)]
    pub suspended_bytes: u64,
    /// Times the container was suspended since the daemon started.
    #[serde(default)]
    pub suspensions: u64,
}

/// One tenant (container).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Tenant {
    /// Tenant key (one container).
    pub key: String,
    /// Pod namespace, if known.
    pub namespace: String,
    /// Pod name, if known.
    pub pod: String,
    /// Container name, if known.
    pub container: String,
    /// Host PIDs of its connected processes (from the socket's peer credentials).
    pub pids: Vec<u32>,
    /// Per GPU.
    pub gpus: Vec<TenantGpu>,
}

/// One process NVML reports on a GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuProcess {
    /// Host PID.
    pub pid: u32,
    /// Device memory it uses, bytes.
    pub used_bytes: u64,
    /// The tenant whose shim registered this PID, if any. None: a bypass.
    pub tenant: Option<String>,
}

/// What NVML says about one GPU (collected by the NVML watcher).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct GpuObservation {
    /// GPU UUID.
    pub uuid: String,
    /// NVML index.
    pub index: u32,
    /// Product name.
    pub name: String,
    /// Total memory, bytes.
    pub memory_total: u64,
    /// Used memory, bytes.
    pub memory_used: u64,
    /// Utilization over NVML's last sample period, percent (None: not supported).
    pub utilization_pct: Option<u32>,
    /// Compute processes and their memory: (host PID, bytes).
    pub processes: Vec<(u32, u64)>,
    /// When observed, ms since the Unix epoch.
    pub observed_unix_ms: u64,
}

/// One GPU as reported.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Gpu {
    /// The last NVML observation (empty name if NVML never answered).
    pub observed: GpuObservation,
    /// Processes using memory, with the tenant that owns each (reconciled).
    pub processes: Vec<GpuProcess>,
    /// PIDs using GPU memory that no shim reports (bypassing the shim).
    pub bypass_pids: Vec<u32>,
    /// GPU time charged to tenants since the daemon started, ns.
    pub scheduled_ns: u64,
    /// Tenant holding the GPU now, if any.
    pub holder: Option<String>,
}

/// What the daemon knows of a container's trouble: periods its processes enforced their
/// share locally (reported by the shims when they register again) and registrations it
/// refused. Kept while the container has processes, and after (at most
/// [`crate::daemon::MAX_HEALTH_RECORDS`] containers).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContainerHealth {
    /// Tenant key.
    pub key: String,
    /// Pod namespace (empty if unknown).
    pub namespace: String,
    /// Pod name.
    pub pod: String,
    /// Container name.
    pub container: String,
    /// Local fallback periods its processes reported.
    pub fallback_periods: u64,
    /// Their total length, ms.
    pub fallback_ms: u64,
    /// Why the last one began, as the shim said.
    pub last_fallback_reason: String,
    /// Registrations refused.
    pub refused_registrations: u64,
    /// The last refusal's reason.
    pub last_refusal: String,
    /// GPU memory allocations its shims refused over the container's quota, per GPU.
    #[serde(default)]
    pub memory_refusals: Vec<MemoryRefusals>,
    /// Its processes in local fallback now: their connection closed while they ran,
    /// and they have not registered again (ADR 0013).
    #[serde(default)]
    pub processes_in_fallback: u64,
}

/// Allocations a container's shims refused over its memory quota on one GPU.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryRefusals {
    /// GPU UUID.
    pub uuid: String,
    /// Allocations refused since the daemon first heard of the container.
    pub count: u64,
    /// Bytes the latest refused allocation asked for.
    pub last_asked: u64,
    /// Bytes the container had charged on the GPU then.
    pub last_used: u64,
    /// Its quota on the GPU, bytes.
    pub last_quota: u64,
    /// When the daemon heard of the latest, ms since the Unix epoch.
    pub last_unix_ms: u64,
}

/// Everything the daemon knows, at one instant.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeSnapshot {
    /// Seconds since the daemon started.
    pub uptime_s: f64,
    /// Tenants, sorted by key.
    pub tenants: Vec<Tenant>,
    /// GPUs, sorted by NVML index then UUID.
    pub gpus: Vec<Gpu>,
    /// Containers that fell back or were refused, sorted by key.
    #[serde(default)]
    pub health: Vec<ContainerHealth>,
}

/// A live change of a tenant's settings (fields left None keep their value).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct SettingsChange {
    /// New share, percent (1–100).
    pub share_pct: Option<u32>,
    /// New policy.
    pub policy: Option<vgpu_core::sched_proto::ComputePolicy>,
    /// New priority.
    pub priority: Option<vgpu_core::sched_proto::Priority>,
}
