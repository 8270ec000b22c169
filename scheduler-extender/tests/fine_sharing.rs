//! Fine sharing (ADR 0023) through the extender's HTTP verbs: on a node whose plugin
//! advertises 100 slices per GPU, 100 containers of 1 % are granted on one GPU and the
//! 101st is refused with a reason; beside it, in the same cluster, a node of 10 slices
//! per GPU still takes at most 10 containers per GPU.

use super::common;

use serde_json::{Value, json};
use vgpu_core::inventory::{ANNOTATION_GPU_INVENTORY, NodeInventory};
use vgpu_core::packing::PolicyName;
use vgpu_core::resources::{ANNOTATION_ASSIGNMENT, Assignment};
use vgpu_scheduler_extender::extender::policy::ExtenderPolicy;
use vgpu_scheduler_extender::extender::{Extender, State, StateConfig};

use common::{RecordingBinder, Served};

/// cuda-sim's H100: 80 GiB, 300 MiB per context.
const GPU_MIB: u64 = 81_920;
const CONTEXT_MIB: u64 = 300;

/// A one-GPU node whose plugin advertises `slices` device IDs per GPU.
fn node(name: &str, slices: u32) -> Value {
    let mut n = common::gpu_node(name, 1, "H100", GPU_MIB);
    let text = n["metadata"]["annotations"][ANNOTATION_GPU_INVENTORY]
        .as_str()
        .expect("inventory")
        .to_owned();
    let mut inv = NodeInventory::from_json(&text).expect("inventory");
    inv.slices_per_gpu = slices;
    n["metadata"]["annotations"][ANNOTATION_GPU_INVENTORY] = json!(inv.to_json());
    for k in ["capacity", "allocatable"] {
        n["status"][k]["vgpu.io/gpu"] = json!(slices.to_string());
    }
    n
}

/// A pod of one container at 1 % of a GPU and `mib` of its memory.
fn one_percent(name: &str, mib: u64) -> Value {
    common::gpu_pod(
        name,
        &format!("uid-{name}"),
        json!({"vgpu.io/gpu": "1", "vgpu.io/gpu-compute": "1", "vgpu.io/gpu-memory": mib.to_string()}),
    )
}

/// Filters `pod` against `node` alone; binds it when it passes and returns its
/// assignment, else the reason the node was refused.
async fn place(
    served: &Served,
    binder: &RecordingBinder,
    pod: &Value,
    node: &str,
) -> Result<Assignment, String> {
    let (_, ans) = served
        .post_json(
            "/scheduler/filter",
            &json!({"Pod": pod, "NodeNames": [node]}),
        )
        .await;
    if ans["NodeNames"] != json!([node]) {
        return Err(ans["FailedNodes"][node]
            .as_str()
            .unwrap_or_else(|| panic!("no reason for {node}: {ans}"))
            .to_owned());
    }
    let meta = &pod["metadata"];
    let (_, ans) = served
        .post_json(
            "/scheduler/bind",
            &json!({"PodName": meta["name"], "PodNamespace": "default", "PodUID": meta["uid"], "Node": node}),
        )
        .await;
    assert_eq!(ans, json!({"Error": ""}), "{}", meta["name"]);
    let plan = binder
        .plans
        .lock()
        .expect("lock")
        .last()
        .cloned()
        .expect("plan");
    Ok(Assignment::from_json(&plan.assignment_json).expect("record"))
}

#[tokio::test]
async fn a_fine_node_takes_one_hundred_one_percent_containers_per_gpu_and_a_coarse_one_ten() {
    let node_objects = vec![node("fine", 100), node("coarse", 10)];
    let state = common::synced_state(
        StateConfig::default(),
        PolicyName::Vgpu,
        node_objects.clone(),
    );
    let binder = common::recording_binder();
    let served = Served::start(Extender::new(state.clone(), binder.clone())).await;

    // The fine node's GPU keeps 100 contexts apart: 81920 − 100 × 300 = 51920 MiB for
    // quotas, room for 100 quotas of 500 MiB.
    let mut quotas = Vec::new();
    let mut bound = Vec::new();
    for i in 0..100 {
        let pod = one_percent(&format!("f{i}"), 500);
        let a = place(&served, &binder, &pod, "fine")
            .await
            .unwrap_or_else(|why| panic!("container {i} of 1 % refused: {why}"));
        let g = &a.containers[0].gpus;
        assert_eq!(g.len(), 1);
        assert_eq!(
            (
                g[0].uuid.as_str(),
                g[0].compute_milli,
                g[0].memory_mib,
                g[0].slices
            ),
            ("GPU-fine-0", 10, 500, 1),
            "pod {i}"
        );
        quotas.push(g[0].memory_mib);
        let mut pod = pod;
        pod["metadata"]["annotations"] = json!({ANNOTATION_ASSIGNMENT: a.to_json()});
        pod["spec"]["nodeName"] = json!("fine");
        pod["status"]["phase"] = json!("Running");
        bound.push(pod);
    }
    let physical: u64 = quotas.iter().map(|q| q + CONTEXT_MIB).sum();
    assert!(
        physical <= GPU_MIB,
        "100 quotas and their contexts: {physical} MiB > {GPU_MIB}"
    );
    // The 101st: refused, with the reason (the GPU's compute is all granted).
    let why = place(&served, &binder, &one_percent("f100", 1), "fine")
        .await
        .expect_err("the 101st container of 1 % is refused");
    assert!(
        why.contains("GPU compute: max free 0.000 GPU < 0.010 GPU"),
        "{why}"
    );

    // A restarted extender, rebuilt from the bound pods, holds the same: no slice,
    // no compute left on the fine GPU.
    let rebuilt = State::new(
        StateConfig::default(),
        ExtenderPolicy::new(PolicyName::Vgpu),
    );
    let nodes: Vec<_> = node_objects
        .into_iter()
        .map(|n| serde_json::from_value(n).expect("node"))
        .collect();
    rebuilt.replace_nodes(&nodes);
    let pods: Vec<_> = bound
        .into_iter()
        .map(|p| serde_json::from_value(p).expect("pod"))
        .collect();
    rebuilt.replace_pods(&pods);
    let (ledger, _) = rebuilt.snapshot();
    let fine = (0..2)
        .map(|i| ledger.node(i))
        .find(|n| n.spec.name == "fine")
        .expect("fine node");
    assert_eq!((fine.gpus[0].milli, fine.gpus[0].slices), (0, 0));

    // The coarse node beside it: ten containers take its ten slices, and the eleventh
    // is refused for want of a slice while 90 % of the compute is free.
    for i in 0..10 {
        place(
            &served,
            &binder,
            &one_percent(&format!("c{i}"), 500),
            "coarse",
        )
        .await
        .unwrap_or_else(|why| panic!("container {i} on the coarse node refused: {why}"));
    }
    let why = place(&served, &binder, &one_percent("c10", 500), "coarse")
        .await
        .expect_err("the 11th container on a 10-slice GPU is refused");
    assert!(
        why.contains("GPU slices: max free 0 < 1") && why.contains("10 per GPU on this node"),
        "{why}"
    );
}
