//! Shared by the end-to-end tests that start from the extender's decision: its state fed
//! with the node the device plugin published, and one pod's filter, prioritize and bind
//! (the code behind its HTTP verbs).

use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use serde_json::{Value, json};
use vgpu_core::resources::{ANNOTATION_ASSIGNMENT, Assignment, RESOURCE_GPU};
use vgpu_scheduler_extender::extender::cluster::{Candidates, State, StateConfig};
use vgpu_scheduler_extender::extender::policy::ExtenderPolicy;
use vgpu_scheduler_extender::extender::sync::WatchKind;
use vgpu_scheduler_extender::extender::types::ExtenderBindingArgs;
use vgpu_testkit::node::{NODE, TestNode};

/// The extender's state with this node as its watch would see it, once the plugin has
/// published the node's GPU inventory.
pub async fn extender_for(node: &TestNode) -> State {
    let end = std::time::Instant::now() + Duration::from_secs(10);
    let mut obj = loop {
        if let Some(n) = node.api.node(NODE)
            && n["metadata"]["annotations"][vgpu_core::inventory::ANNOTATION_GPU_INVENTORY]
                .is_string()
        {
            break n;
        }
        assert!(
            std::time::Instant::now() < end,
            "the plugin did not publish the inventory"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    obj["apiVersion"] = json!("v1");
    obj["kind"] = json!("Node");
    obj["metadata"]["name"] = json!(NODE);
    // Kubelet reports the plugin's healthy devices as the node's allocatable resource.
    let healthy = node
        .kubelet
        .devices()
        .iter()
        .filter(|d| d.health == vgpu_device_plugin::kubelet::HEALTHY)
        .count();
    obj["status"]["allocatable"] = json!({RESOURCE_GPU: healthy.to_string()});
    obj["status"]["capacity"] = json!({RESOURCE_GPU: healthy.to_string()});
    let n: Node = serde_json::from_value(obj).expect("a Node");
    let state = State::new(
        StateConfig::default(),
        ExtenderPolicy::new(vgpu_core::packing::policy::PolicyName::Vgpu),
    );
    state.replace_nodes(&[n]);
    state.replace_pods(&[]);
    state.mark_synced(WatchKind::Nodes);
    state.mark_synced(WatchKind::Pods);
    state
}

/// Filter, prioritize and bind `pod` on the node; returns the pod as the binder leaves it
/// (record and node set) and the record.
pub fn decide(extender: &State, mut pod: Value) -> (Value, Assignment) {
    let typed: Pod = serde_json::from_value(pod.clone()).expect("a Pod");
    let name = pod["metadata"]["name"].as_str().expect("name").to_owned();
    let uid = pod["metadata"]["uid"].as_str().expect("uid").to_owned();
    let candidates = Candidates { names: vec![NODE] };
    let f = extender.filter(&typed, &candidates).expect("filter");
    assert_eq!(f.feasible, [0], "{name}: the node fits: {f:?}");
    extender
        .prioritize(&typed, &candidates)
        .expect("prioritize");
    let plan = extender
        .begin_bind(&ExtenderBindingArgs {
            pod_name: name,
            pod_namespace: "ns".into(),
            pod_uid: uid.clone(),
            node: NODE.into(),
        })
        .expect("bind");
    let record = Assignment::from_json(&plan.assignment_json).expect("assignment");
    pod["metadata"]["annotations"] = json!({ANNOTATION_ASSIGNMENT: plan.assignment_json});
    pod["spec"]["nodeName"] = json!(NODE);
    extender.apply_pod(&serde_json::from_value(pod.clone()).expect("a Pod"));
    extender.finish_bind(&uid);
    (pod, record)
}
