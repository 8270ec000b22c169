//! The node's `ResourceSlice` (`resource.k8s.io/v1`): one device per GPU in the device
//! model of ADR 0071, built by a pure function ([`slice()`]) and published by server-side
//! apply ([`publish`]) as a dynamic object (ADR 0072).
//!
//! Each device is `gpu-<index>` with `allowMultipleAllocations: true` (consumable
//! capacity, KEP-5075) and two capacities: `memory` (bytes; a request that names none
//! takes all of it, at least 1 MiB in 1 MiB steps) and `compute` (`1` = the whole GPU; a
//! request that names none takes all of it, at least `10m` in `10m` steps: the daemon's
//! 1 % share granularity). Attributes: `uuid`, `model`, `index`, `memoryMiB` and, where
//! NVML told it, `numaNode`. An unhealthy GPU is left out (taints are not published yet).

use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams};
use serde_json::{Value, json};
use vgpu_core::inventory::GpuInfo;

use crate::claim::{CAPACITY_COMPUTE, CAPACITY_MEMORY, device_name};

/// The field manager of the driver's server-side applies.
pub const FIELD_MANAGER: &str = "vgpu-dra-driver";

/// The `resource.k8s.io/v1` ResourceSlice resource.
pub fn slice_resource() -> ApiResource {
    ApiResource {
        group: "resource.k8s.io".into(),
        version: "v1".into(),
        api_version: "resource.k8s.io/v1".into(),
        kind: "ResourceSlice".into(),
        plural: "resourceslices".into(),
    }
}

/// The slice's object name: `<node>-<driver>` (both DNS subdomains, so is the name).
pub fn slice_name(node: &str, driver: &str) -> String {
    format!("{node}-{driver}")
}

/// The node's ResourceSlice for `gpus`, pool generation `generation`.
pub fn slice(node: &str, driver: &str, gpus: &[GpuInfo], generation: u64) -> Value {
    let devices: Vec<Value> = gpus
        .iter()
        .filter(|g| g.healthy)
        .map(|g| {
            let mut attributes = json!({
                "uuid": {"string": g.uuid},
                "model": {"string": g.model},
                "index": {"int": g.index},
                "memoryMiB": {"int": g.memory_mib},
            });
            if let Some(n) = g.topology.as_ref().and_then(|t| t.numa_node) {
                attributes["numaNode"] = json!({"int": n});
            }
            let memory = format!("{}Mi", g.memory_mib);
            json!({
                "name": device_name(g.index),
                "allowMultipleAllocations": true,
                "attributes": attributes,
                "capacity": {
                    CAPACITY_MEMORY: {
                        "value": memory,
                        "requestPolicy": {
                            "default": memory,
                            "validRange": {"min": "1Mi", "step": "1Mi"},
                        },
                    },
                    CAPACITY_COMPUTE: {
                        "value": "1",
                        "requestPolicy": {
                            "default": "1",
                            "validRange": {"min": "10m", "max": "1", "step": "10m"},
                        },
                    },
                },
            })
        })
        .collect();
    json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": slice_name(node, driver)},
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
            "devices": devices,
        },
    })
}

/// Applies the node's slice (server-side apply, forced: the driver owns it).
pub async fn publish(
    client: &kube::Client,
    node: &str,
    driver: &str,
    gpus: &[GpuInfo],
    generation: u64,
) -> Result<(), kube::Error> {
    let api: Api<DynamicObject> = Api::all_with(client.clone(), &slice_resource());
    let body = slice(node, driver, gpus, generation);
    api.patch(
        &slice_name(node, driver),
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(body),
    )
    .await
    .map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;
    use vgpu_core::inventory::GpuTopology;

    #[test]
    fn one_shareable_device_per_healthy_gpu_with_memory_and_compute() {
        let mut gpus: Vec<GpuInfo> = (0..3)
            .map(|i| GpuInfo {
                index: i,
                uuid: format!("GPU-{i}"),
                model: "A100".into(),
                memory_mib: 40960,
                healthy: i != 2,
                topology: None,
            })
            .collect();
        gpus[1].topology = Some(GpuTopology {
            numa_node: Some(1),
            ..GpuTopology::default()
        });
        let s = slice("n1", "vgpu.io", &gpus, 3);
        assert_eq!(s["metadata"]["name"], "n1-vgpu.io");
        assert_eq!(
            s["spec"]["pool"],
            json!({"name": "n1", "generation": 3, "resourceSliceCount": 1})
        );
        let devices = s["spec"]["devices"].as_array().unwrap();
        assert_eq!(devices.len(), 2, "the unhealthy GPU is left out");
        let d = &devices[1];
        assert_eq!(d["name"], "gpu-1");
        assert_eq!(d["allowMultipleAllocations"], true);
        assert_eq!(d["attributes"]["uuid"]["string"], "GPU-1");
        assert_eq!(d["attributes"]["numaNode"]["int"], 1);
        assert!(devices[0]["attributes"].get("numaNode").is_none());
        assert_eq!(d["capacity"]["memory"]["value"], "40960Mi");
        assert_eq!(
            d["capacity"]["compute"]["requestPolicy"]["validRange"]["max"],
            "1"
        );
    }
}
