//! Context memory reserved in placement (ADR 0012), through the extender's HTTP verbs:
//! every quota the extender grants on a GPU can be allocated while each container's
//! process holds its CUDA context there.

use super::common;

use std::sync::Arc;

use serde_json::json;
use vgpu_core::packing::{ContextReserve, PolicyName};
use vgpu_core::resources::{ANNOTATION_ASSIGNMENT, Assignment};
use vgpu_scheduler_extender::extender::policy::ExtenderPolicy;
use vgpu_scheduler_extender::extender::{Extender, State, StateConfig};

use common::Served;

/// cuda-sim's H100: 80 GiB, 300 MiB per context.
const GPU_MIB: u64 = 81_920;
const CONTEXT_MIB: u64 = 300;

#[tokio::test]
async fn ten_one_slice_pods_on_one_gpu_can_each_allocate_their_full_quota() {
    let (quotas, bound) = bind_ten(StateConfig::default()).await;
    // Each container fills its quota while its process holds one context: the GPU
    // must hold all of it at once.
    let physical: u64 = quotas.iter().map(|q| q + CONTEXT_MIB).sum();
    assert!(
        physical <= GPU_MIB,
        "quotas {quotas:?} + 10 contexts of {CONTEXT_MIB} MiB = {physical} MiB > the GPU's {GPU_MIB} MiB"
    );
    assert!(
        quotas.iter().all(|&q| q == quotas[0]),
        "equal requests, equal quotas: {quotas:?}"
    );

    // A restarted extender, rebuilt from the records, holds the same: nothing is free.
    let rebuilt = Arc::new(State::new(
        StateConfig::default(),
        ExtenderPolicy::new(PolicyName::Vgpu),
    ));
    let node = common::gpu_node("node-a", 1, "H100", GPU_MIB);
    rebuilt.replace_nodes(&[serde_json::from_value(node).expect("node")]);
    let pods: Vec<_> = bound
        .into_iter()
        .map(|p| serde_json::from_value(p).expect("pod"))
        .collect();
    rebuilt.replace_pods(&pods);
    let (ledger, _) = rebuilt.snapshot();
    let gpu = ledger.node(0).gpus[0];
    assert_eq!(
        (gpu.milli, gpu.memory_mib, gpu.slices),
        (0, 0, 0),
        "{quotas:?}"
    );

    // Without the reservation (the arithmetic before ADR 0012) the same ten pods get
    // quotas that over-commit the GPU by exactly their contexts: the race of issue 11.
    let none = StateConfig {
        contexts: ContextReserve::NONE,
        ..StateConfig::default()
    };
    let (quotas, _) = bind_ten(none).await;
    let physical: u64 = quotas.iter().map(|q| q + CONTEXT_MIB).sum();
    assert_eq!(physical, GPU_MIB + 10 * CONTEXT_MIB, "{quotas:?}");
}

/// Filters and binds 1-slice pods over HTTP on one 80 GiB GPU until one is refused;
/// returns the quotas granted and the bound pods as the watch would show them.
async fn bind_ten(config: StateConfig) -> (Vec<u64>, Vec<serde_json::Value>) {
    let node = common::gpu_node("node-a", 1, "H100", GPU_MIB);
    let state = common::synced_state(config, PolicyName::Vgpu, vec![node]);
    let binder = common::recording_binder();
    let served = Served::start(Extender::new(state.clone(), binder.clone())).await;

    let mut quotas = Vec::new();
    let mut bound = Vec::new();
    for i in 0..11 {
        let (name, uid) = (format!("p{i}"), format!("uid-p{i}"));
        let pod = common::gpu_pod(&name, &uid, json!({"vgpu.io/gpu": "1"}));
        let (_, ans) = served
            .post_json(
                "/scheduler/filter",
                &json!({"Pod": pod, "NodeNames": ["node-a"]}),
            )
            .await;
        if i == 10 {
            // The GPU's ten slices are taken: the eleventh pod (and context) is refused.
            assert_eq!(ans["NodeNames"], json!([]), "{ans}");
            break;
        }
        assert_eq!(ans["NodeNames"], json!(["node-a"]), "{name}: {ans}");
        let (_, ans) = served
            .post_json(
                "/scheduler/bind",
                &json!({"PodName": name, "PodNamespace": "default", "PodUID": uid, "Node": "node-a"}),
            )
            .await;
        assert_eq!(ans, json!({"Error": ""}), "{name}");
        let plan = binder
            .plans
            .lock()
            .expect("lock")
            .last()
            .cloned()
            .expect("plan");
        let a = Assignment::from_json(&plan.assignment_json).expect("record");
        quotas.push(a.containers[0].gpus[0].memory_mib);
        let mut pod = pod;
        pod["metadata"]["annotations"] = json!({ANNOTATION_ASSIGNMENT: plan.assignment_json});
        pod["spec"]["nodeName"] = json!("node-a");
        pod["status"]["phase"] = json!("Running");
        bound.push(pod);
    }
    (quotas, bound)
}
