//! The `VgpuQuotaPolicy` custom resource (`vgpu.io/v1alpha1`, namespaced) as operators
//! write it, and the CRD manifest generated from it (`vgpu-scheduler-extender crd`;
//! `deploy/10-crd-vgpuquotapolicy.json` is checked against it).
//!
//! The fields stay as written (quantities are strings, numbers are signed) so that a bad
//! value reaches [`super::rules`], which names the field, instead of failing the watch.

use kube::CustomResource;
use kube::core::crd::CustomResourceExt;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// What a namespace's GPU pods may ask for, and how much of the cluster's GPUs the
/// namespace may hold at once. Every policy of a namespace applies.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "vgpu.io",
    version = "v1alpha1",
    kind = "VgpuQuotaPolicy",
    plural = "vgpuquotapolicies",
    shortname = "vqp",
    namespaced,
    status = "VgpuQuotaPolicyStatus",
    printcolumn = r#"{"name":"Valid","type":"string","jsonPath":".status.conditions[?(@.type==\"Valid\")].status"}"#,
    printcolumn = r#"{"name":"MemoryMiB","type":"integer","jsonPath":".status.used.memoryMiB","description":"GPU memory held, MiB"}"#,
    printcolumn = r#"{"name":"Compute%","type":"number","jsonPath":".status.used.computePercent","description":"compute held over all GPUs, percent of one GPU"}"#,
    printcolumn = r#"{"name":"GPUs","type":"integer","jsonPath":".status.used.gpus","description":"distinct GPUs held a share of"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct VgpuQuotaPolicySpec {
    /// For containers that give only `vgpu.io/gpu` slices: what they get instead of the
    /// share in proportion to their slices.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub defaults: Option<QuotaDefaults>,
    /// Limits per container (per GPU it holds).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limits: Option<ContainerLimits>,
    /// Totals over all the namespace's pods that hold GPUs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub totals: Option<NamespaceTotals>,
}

/// Defaults for a container that asks only for `vgpu.io/gpu` slices.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct QuotaDefaults {
    /// GPU memory per GPU when the container sets no `vgpu.io/gpu-memory`: a Kubernetes
    /// quantity with a unit (`8Gi`, `512Mi`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<String>,
    /// Compute per GPU, percent of one GPU (1–100), when the container sets no
    /// `vgpu.io/gpu-compute`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute_percent: Option<i64>,
}

/// Limits per container.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ContainerLimits {
    /// Most GPU memory per GPU a container may hold (quantity with a unit).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<String>,
    /// Most compute per GPU a container may hold, percent of one GPU (1–100).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute_percent: Option<i64>,
    /// Compute policies (`vgpu.io/compute-policy`) pods may ask for: `burst`, `cap`.
    /// Absent: any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute_policies: Option<Vec<String>>,
    /// Priority classes (`vgpu.io/priority`) pods may ask for: `best-effort`,
    /// `latency-sensitive`. Absent: any. Replaces the device plugin's
    /// `--latency-sensitive-namespaces`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority_classes: Option<Vec<String>>,
}

/// Totals over the namespace's pods that hold GPUs (bound or being bound).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NamespaceTotals {
    /// GPU memory over all GPUs (quantity with a unit).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<String>,
    /// Compute over all GPUs, percent of one GPU (`250` = two and a half GPUs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute_percent: Option<i64>,
    /// Distinct GPUs the namespace's pods hold a share of.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpus: Option<i64>,
}

/// What the extender reports: use against the totals and whether the policy is valid.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VgpuQuotaPolicyStatus {
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// The namespace's use now (the extender's ledger: bound pods and binds in flight).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub used: Option<QuotaUse>,
    /// `Valid` (the spec parses and is consistent; else the message names the field).
    #[serde(default)]
    pub conditions: Vec<PolicyCondition>,
}

/// A namespace's use of GPUs.
///
/// The counts are `u64` in Rust; their schema says `format: int64` (with `minimum: 0`),
/// since Kubernetes knows no `uint64` format and warned `unrecognized format "uint64"`
/// at every install (issue 40).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct QuotaUse {
    /// GPU memory held, MiB.
    #[schemars(extend("format" = "int64"))]
    #[serde(rename = "memoryMiB")]
    pub memory_mib: u64,
    /// Compute held over all GPUs, percent of one GPU (may have one decimal).
    pub compute_percent: f64,
    /// Distinct GPUs held a share of.
    #[schemars(extend("format" = "int64"))]
    pub gpus: u64,
    /// Pods holding GPUs.
    #[schemars(extend("format" = "int64"))]
    pub pods: u64,
}

/// A status condition in Kubernetes' shape.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PolicyCondition {
    /// `Valid`.
    #[serde(rename = "type")]
    pub type_: String,
    /// `True` or `False`.
    pub status: String,
    /// One word: `Accepted` or `InvalidSpec`.
    pub reason: String,
    /// The error, naming the field and its value, or empty.
    pub message: String,
    /// When `status` last changed (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_transition_time: Option<String>,
}

/// The CRD manifest as JSON (what `vgpu-scheduler-extender crd` prints).
#[must_use]
pub fn crd_json() -> String {
    let crd = VgpuQuotaPolicy::crd();
    let mut text = serde_json::to_string_pretty(&crd).expect("a CRD serialises to JSON");
    text.push('\n');
    text
}
