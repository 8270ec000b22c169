//! Publishes the node's GPU inventory for the scheduler extender: the annotation
//! `vgpu.io/gpu-inventory` (ADR 0007, `vgpu_core::inventory`) on this plugin's Node,
//! rewritten on every change (health included), and the label `vgpu.io/gpu-model` when
//! all GPUs are of one model.

use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::api::{Patch, PatchParams};
use serde_json::json;
use tokio::sync::watch;
use tracing::{info, warn};
use vgpu_core::inventory::{ANNOTATION_GPU_INVENTORY, GpuInfo, INVENTORY_VERSION, NodeInventory};
use vgpu_core::resources::LABEL_GPU_MODEL;

use crate::error::error_chain;

/// The merge patch that publishes `gpus`, advertised with `slices_per_gpu` device IDs
/// each (ADR 0023), on a Node.
pub fn node_patch(gpus: &[GpuInfo], slices_per_gpu: u32) -> serde_json::Value {
    let inv = NodeInventory {
        version: INVENTORY_VERSION,
        gpus: gpus.to_vec(),
        slices_per_gpu,
    };
    let model = match gpus.first() {
        Some(g) if gpus.iter().all(|h| h.model == g.model) => json!(label_value(&g.model)),
        _ => serde_json::Value::Null,
    };
    json!({"metadata": {
        "annotations": {ANNOTATION_GPU_INVENTORY: inv.to_json()},
        "labels": {LABEL_GPU_MODEL: model},
    }})
}

/// A model name as a label value (≤ 63 characters of `[A-Za-z0-9._-]`, spaces → `-`).
fn label_value(model: &str) -> String {
    let v: String = model
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '-'
            }
        })
        .take(63)
        .collect();
    v.trim_matches(|c: char| !c.is_ascii_alphanumeric())
        .to_owned()
}

/// Keeps the Node's inventory current until `gpus` closes. A failed write is retried
/// (every `retry`) until it lands or a newer list replaces it.
pub async fn publish(
    client: kube::Client,
    node: String,
    mut gpus: watch::Receiver<Vec<GpuInfo>>,
    slices_per_gpu: u32,
    retry: Duration,
) {
    let api: Api<Node> = Api::all(client);
    loop {
        let list = gpus.borrow_and_update().clone();
        let patch = node_patch(&list, slices_per_gpu);
        loop {
            match api
                .patch(&node, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                Ok(_) => {
                    info!(node = %node, gpus = list.len(), healthy = list.iter().filter(|g| g.healthy).count(), "GPU inventory published");
                    break;
                }
                Err(e) => {
                    warn!(node = %node, error = %error_chain(&e), "publish GPU inventory; retrying");
                    tokio::select! {
                        () = tokio::time::sleep(retry) => {}
                        r = gpus.changed() => { if r.is_err() { return } break }
                    }
                }
            }
        }
        if gpus.has_changed().unwrap_or(false) {
            continue;
        }
        if gpus.changed().await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patch_carries_a_valid_record_and_a_model_label() {
        let g = vgpu_testkit::node::gpus(2, 81920);
        let p = node_patch(&g, 100);
        let text = p["metadata"]["annotations"][ANNOTATION_GPU_INVENTORY]
            .as_str()
            .expect("string");
        let inv = NodeInventory::from_json(text).expect("valid");
        assert_eq!((inv.gpus, inv.slices_per_gpu), (g, 100));
        assert_eq!(
            p["metadata"]["labels"][LABEL_GPU_MODEL],
            "NVIDIA-A100-SXM4-80GB"
        );
        assert_eq!(label_value(" A100 (80GB) "), "A100--80GB");
    }
}
