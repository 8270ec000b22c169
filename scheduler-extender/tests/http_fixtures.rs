//! HTTP tests with the exact bodies a real kube-scheduler v1.28.4 sent
//! (shared/fixtures/kubernetes-v1.28), through the real HTTP server.
//!
//! The fixtures use the plain extended resource `example.com/gpu` (whole GPUs);
//! the scenario tests rewrite it to vgpu's `vgpu.io/gpu` (0.1-GPU slices, N GPUs
//! → N×10) with [`common::rewrite_resource`]. Everything else in the bodies is
//! byte-for-byte what kube-scheduler sent. The fixture nodes advertise 4 GPUs
//! each; the tests give them a 4-GPU inventory annotation.

use super::common;

use std::sync::Arc;

use k8s_openapi::api::core::v1::{Node, Pod};
use serde_json::{Value, json};
use vgpu_core::packing::PolicyName;
use vgpu_core::resources::{ANNOTATION_ASSIGNMENT, Assignment};
use vgpu_scheduler_extender::extender::policy::ExtenderPolicy;
use vgpu_scheduler_extender::extender::sync::WatchKind;
use vgpu_scheduler_extender::extender::types::{
    ExtenderArgs, ExtenderBindingArgs, ExtenderPreemptionArgs,
};
use vgpu_scheduler_extender::extender::{Extender, State, StateConfig};

use common::{RecordingBinder, Served, fixture, fixtures_dir, rewrite_resource};

fn fixture_files() -> Vec<std::path::PathBuf> {
    let mut files = Vec::new();
    for dir in ["extender-nodecache-false", "extender-nodecache-true"] {
        for entry in std::fs::read_dir(fixtures_dir().join(dir)).expect("fixture dir") {
            let path = entry.expect("entry").path();
            if path.extension().is_some_and(|e| e == "json") {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

#[test]
fn every_fixture_body_parses_with_the_extender_types() {
    let files = fixture_files();
    assert_eq!(
        files.len(),
        14,
        "expected 9 + 5 recorded requests: {files:?}"
    );
    for path in files {
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .expect("name")
            .to_string();
        let bytes = std::fs::read(&path).expect("read");
        if name.contains("-filter-") || name.contains("-prioritize-") {
            let args: ExtenderArgs =
                serde_json::from_slice(&bytes).unwrap_or_else(|e| panic!("{name}: {e}"));
            let pod = args.pod.as_ref().expect("pod");
            assert!(pod.metadata.uid.is_some(), "{name}");
            let spec = pod.spec.as_ref().expect("spec");
            assert!(!spec.containers.is_empty(), "{name}");
            // Exactly one of the two node forms, per the scheduler's nodeCacheCapable.
            let cache = path.to_string_lossy().contains("nodecache-true");
            assert_eq!(args.node_names.is_some(), cache, "{name}");
            assert_eq!(args.nodes.is_some(), !cache, "{name}");
            if let Some(nodes) = &args.nodes {
                for node in &nodes.items {
                    let alloc = node
                        .status
                        .as_ref()
                        .and_then(|s| s.allocatable.as_ref())
                        .expect("allocatable");
                    let want = if node.metadata.name.as_deref() == Some("fake-gpu-node-a") {
                        "4"
                    } else {
                        "8"
                    };
                    assert_eq!(alloc["example.com/gpu"].0, want, "{name}");
                }
            }
        } else if name.contains("-bind-") {
            let args: ExtenderBindingArgs =
                serde_json::from_slice(&bytes).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert!(!args.pod_uid.is_empty() && !args.node.is_empty(), "{name}");
        } else if name.contains("-preempt-") {
            let args: ExtenderPreemptionArgs =
                serde_json::from_slice(&bytes).unwrap_or_else(|e| panic!("{name}: {e}"));
            let victims = args
                .node_name_to_victims
                .as_ref()
                .expect("full victims (node cache off)");
            assert!(args.node_name_to_meta_victims.is_none());
            assert_eq!(victims["fake-gpu-node-b"].pods.len(), 1);
        } else {
            panic!("unexpected fixture {name}");
        }
    }
}

#[test]
fn fixture_bodies_round_trip_through_the_types() {
    // What we parse and write back keeps every key kube-scheduler sent (pods and nodes
    // included), so an answer with full Nodes carries the objects unchanged; k8s-openapi
    // adds only the objects' `apiVersion` and `kind`.
    for path in fixture_files() {
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .expect("name")
            .to_string();
        let original: Value =
            serde_json::from_slice(&std::fs::read(&path).expect("read")).expect("json");
        let again: Value = if name.contains("-bind-") {
            serde_json::to_value(
                serde_json::from_value::<ExtenderBindingArgs>(original.clone()).expect("parse"),
            )
        } else if name.contains("-preempt-") {
            serde_json::to_value(
                serde_json::from_value::<ExtenderPreemptionArgs>(original.clone()).expect("parse"),
            )
        } else {
            serde_json::to_value(
                serde_json::from_value::<ExtenderArgs>(original.clone()).expect("parse"),
            )
        }
        .expect("serialise");
        let again = strip_type_meta(again);
        if name.contains("-filter-") || name.contains("-prioritize-") {
            let original = strip_type_meta(original.clone());
            assert_eq!(
                again["Pod"], original["Pod"],
                "{name}: Pod differs after round trip"
            );
            assert_eq!(again["NodeNames"], original["NodeNames"], "{name}");
            if original["Nodes"].is_object() {
                assert_eq!(
                    again["Nodes"]["items"], original["Nodes"]["items"],
                    "{name}"
                );
            }
        } else if name.contains("-bind-") {
            assert_eq!(again, original, "{name}");
        }
    }
}

/// Removes `apiVersion`/`kind` of embedded objects (k8s-openapi writes them,
/// kube-scheduler's bodies omit them) and `null` fields (Go writes some, e.g.
/// `lastProbeTime`, k8s-openapi omits them; both mean unset).
fn strip_type_meta(mut v: Value) -> Value {
    fn walk(v: &mut Value) {
        match v {
            Value::Object(map) => {
                map.retain(|_, v| !v.is_null());
                if map.contains_key("metadata") {
                    map.remove("apiVersion");
                    map.remove("kind");
                }
                map.values_mut().for_each(walk);
            }
            Value::Array(items) => items.iter_mut().for_each(walk),
            _ => {}
        }
    }
    walk(&mut v);
    v
}

/// An extender whose state holds the fixture nodes (from the recorded filter body,
/// resource rewritten) with inventories of as many GPUs as they advertise (a: 4,
/// b: 8), plus `pods`.
async fn extender_over_fixture_nodes(pods: &[Value]) -> (Served, Arc<RecordingBinder>) {
    let mut body = fixture("extender-nodecache-false/001-filter-request.json");
    rewrite_resource(&mut body);
    let mut nodes: Vec<Node> = Vec::new();
    for mut node in body["Nodes"]["items"].as_array().expect("items").clone() {
        let name = node["metadata"]["name"].as_str().expect("name").to_string();
        let slices: usize = node["status"]["allocatable"]["vgpu.io/gpu"]
            .as_str()
            .and_then(|s| s.parse().ok())
            .expect("rewritten allocatable");
        node["metadata"]["annotations"][vgpu_core::inventory::ANNOTATION_GPU_INVENTORY] = json!(
            common::inventory_json(&name, slices / 10, "A100-SXM4-80GB", 81920)
        );
        nodes.push(serde_json::from_value(node).expect("node"));
    }
    let state = Arc::new(State::new(
        StateConfig::default(),
        ExtenderPolicy::new(PolicyName::Vgpu),
    ));
    state.replace_nodes(&nodes);
    let pods: Vec<Pod> = pods
        .iter()
        .map(|p| serde_json::from_value(p.clone()).expect("pod"))
        .collect();
    state.replace_pods(&pods);
    state.mark_synced(WatchKind::Nodes);
    state.mark_synced(WatchKind::Pods);
    let binder = common::recording_binder();
    let served = Served::start(Extender::new(state, binder.clone())).await;
    (served, binder)
}

/// The quota memory of the fixtures' 80 GiB GPUs: ten 300 MiB contexts reserved
/// (ADR 0012).
const QUOTA_MEMORY: u64 = 81920 - 10 * vgpu_core::packing::context::DEFAULT_CONTEXT_MIB;

fn body(rel: &str) -> Value {
    let mut b = fixture(rel);
    rewrite_resource(&mut b);
    b
}

/// What the watch would show after a bind: the pod with its assignment and node.
fn confirm(served: &Served, binder: &RecordingBinder, filter_rel: &str) {
    let plan = binder
        .plans
        .lock()
        .expect("lock")
        .last()
        .cloned()
        .expect("a plan");
    let mut pod = body(filter_rel)["Pod"].clone();
    pod["metadata"]["annotations"][ANNOTATION_ASSIGNMENT] = json!(plan.assignment_json);
    pod["spec"]["nodeName"] = json!(plan.node);
    pod["status"]["phase"] = json!("Running");
    served
        .extender
        .state()
        .apply_pod(&serde_json::from_value(pod).expect("pod"));
}

#[tokio::test]
async fn recorded_session_without_node_cache() {
    let (served, binder) = extender_over_fixture_nodes(&[]).await;
    assert_eq!(served.get("/readyz").await, 200);

    // 001 filter: gpu-pod-1 asks 2 GPUs; both 4-GPU nodes fit. Answer in the
    // request's form: full Nodes, unchanged, and no NodeNames.
    let req = body("extender-nodecache-false/001-filter-request.json");
    let (status, ans) = served.post_json("/scheduler/filter", &req).await;
    assert_eq!(status, 200);
    assert_eq!(ans["Error"], "");
    assert!(ans["NodeNames"].is_null(), "{ans}");
    assert_eq!(
        strip_type_meta(ans["Nodes"]["items"].clone()),
        req["Nodes"]["items"]
    );
    assert_eq!(ans["FailedNodes"], json!({}));

    // 002 prioritize: every node scored 0..=10, the best 10.
    let (status, ans) = served
        .post_json(
            "/scheduler/prioritize",
            &body("extender-nodecache-false/002-prioritize-request.json"),
        )
        .await;
    assert_eq!(status, 200);
    let list = ans.as_array().expect("HostPriorityList");
    assert_eq!(list.len(), 2);
    for h in list {
        let s = h["Score"].as_i64().expect("score");
        assert!((0..=10).contains(&s), "{h}");
    }
    assert_eq!(
        list.iter().map(|h| h["Score"].as_i64().unwrap_or(-1)).max(),
        Some(10)
    );

    // 003 bind gpu-pod-1 → node b: two whole GPUs recorded once, with their UUIDs.
    let (status, ans) = served
        .post_json(
            "/scheduler/bind",
            &body("extender-nodecache-false/003-bind-request.json"),
        )
        .await;
    assert_eq!((status, ans.clone()), (200, json!({"Error": ""})));
    {
        let plans = binder.plans.lock().expect("lock");
        assert_eq!(plans.len(), 1);
        let plan = &plans[0];
        assert_eq!(
            (plan.name.as_str(), plan.node.as_str()),
            ("gpu-pod-1", "fake-gpu-node-b")
        );
        assert_eq!(plan.uid, "2f15d973-e47b-435c-b81e-9640f6570174");
        let a = Assignment::from_json(&plan.assignment_json).expect("valid record");
        assert_eq!(a.node, "fake-gpu-node-b");
        assert_eq!(a.containers.len(), 1);
        assert_eq!(a.containers[0].name, "main");
        let gpus = &a.containers[0].gpus;
        assert_eq!(gpus.len(), 2);
        assert!(
            gpus.iter()
                .all(|g| g.compute_milli == 1000 && g.memory_mib == QUOTA_MEMORY && g.slices == 10)
        );
        assert_ne!(gpus[0].uuid, gpus[1].uuid);
        assert!(
            gpus.iter()
                .all(|g| g.uuid.starts_with("GPU-fake-gpu-node-b-"))
        );
    }
    confirm(
        &served,
        &binder,
        "extender-nodecache-false/001-filter-request.json",
    );

    // 004 filter gpu-pod-2 (2 GPUs): a has 4 free, b 6.
    let (_, ans) = served
        .post_json(
            "/scheduler/filter",
            &body("extender-nodecache-false/004-filter-request.json"),
        )
        .await;
    assert_eq!(
        ans["Nodes"]["items"].as_array().map(Vec::len),
        Some(2),
        "{ans}"
    );

    // 005 bind gpu-pod-2 → node a.
    let (_, ans) = served
        .post_json(
            "/scheduler/bind",
            &body("extender-nodecache-false/005-bind-request.json"),
        )
        .await;
    assert_eq!(ans, json!({"Error": ""}));
    confirm(
        &served,
        &binder,
        "extender-nodecache-false/004-filter-request.json",
    );

    // 006 filter gpu-pod-3 (3 GPUs) on node b (6 whole GPUs free): feasible.
    let (_, ans) = served
        .post_json(
            "/scheduler/filter",
            &body("extender-nodecache-false/006-filter-request.json"),
        )
        .await;
    assert_eq!(
        ans["Nodes"]["items"].as_array().map(Vec::len),
        Some(1),
        "{ans}"
    );

    // Before preemption, gpu-pod-high (8 GPUs) does not fit b (6 free): a node
    // preemption can help, with the precise reason.
    let (_, ans) = served
        .post_json(
            "/scheduler/filter",
            &body("extender-nodecache-false/008-filter-request.json"),
        )
        .await;
    assert_eq!(ans["Nodes"]["items"], json!([]), "{ans}");
    assert_eq!(
        ans["FailedNodes"]["fake-gpu-node-b"], "whole GPUs: 6 fully free < 8",
        "{ans}"
    );

    // 007 preempt: evicting gpu-pod-1 from b frees 8 GPUs, so b is kept with that victim.
    let (status, ans) = served
        .post_json(
            "/scheduler/preempt",
            &body("extender-nodecache-false/007-preempt-request.json"),
        )
        .await;
    assert_eq!(status, 200);
    assert_eq!(
        ans,
        json!({"NodeNameToMetaVictims": {"fake-gpu-node-b": {"Pods": [{"UID": "2f15d973-e47b-435c-b81e-9640f6570174"}], "NumPDBViolations": 0}}})
    );

    // The victim is deleted (as the pod watch reports it); 008 filter: b fits now.
    let victim: Pod = serde_json::from_value(
        body("extender-nodecache-false/001-filter-request.json")["Pod"].clone(),
    )
    .expect("pod");
    served.extender.state().delete_pod(&victim);
    let (_, ans) = served
        .post_json(
            "/scheduler/filter",
            &body("extender-nodecache-false/008-filter-request.json"),
        )
        .await;
    assert_eq!(
        ans["Nodes"]["items"].as_array().map(Vec::len),
        Some(1),
        "{ans}"
    );

    // 009 bind gpu-pod-high → b: all 8 GPUs.
    let (status, ans) = served
        .post_json(
            "/scheduler/bind",
            &body("extender-nodecache-false/009-bind-request.json"),
        )
        .await;
    assert_eq!((status, ans), (200, json!({"Error": ""})));
    let plan = binder
        .plans
        .lock()
        .expect("lock")
        .last()
        .cloned()
        .expect("plan");
    let a = Assignment::from_json(&plan.assignment_json).expect("record");
    assert_eq!(a.containers[0].gpus.len(), 8);

    // The same pod asked of node a (4 GPUs) is unresolvable, and a bind there is
    // refused with a clear message.
    let mut req = body("extender-nodecache-false/008-filter-request.json");
    req["Nodes"] = Value::Null;
    req["NodeNames"] = json!(["fake-gpu-node-a"]);
    req["Pod"]["metadata"]["uid"] = json!("uid-high-2");
    let (_, ans) = served.post_json("/scheduler/filter", &req).await;
    assert_eq!(
        ans["FailedAndUnresolvableNodes"]["fake-gpu-node-a"],
        "GPU count: 4 GPUs of an allowed model < 8",
        "{ans}"
    );
    let (status, ans) = served
        .post_json(
            "/scheduler/bind",
            &json!({"PodName": "gpu-pod-high", "PodNamespace": "default", "PodUID": "uid-high-2", "Node": "fake-gpu-node-a"}),
        )
        .await;
    assert_eq!(status, 200);
    let err = ans["Error"].as_str().expect("error");
    assert!(
        err.contains("default/gpu-pod-high")
            && err.contains("fake-gpu-node-a")
            && err.contains("GPU count"),
        "{err}"
    );
    assert_eq!(binder.plans.lock().expect("lock").len(), 3);
}

#[tokio::test]
async fn recorded_session_with_node_cache() {
    let (served, binder) = extender_over_fixture_nodes(&[]).await;
    // 001 filter c1 (2 GPUs) with NodeNames [a]: answered with NodeNames, no Nodes.
    let (_, ans) = served
        .post_json(
            "/scheduler/filter",
            &body("extender-nodecache-true/001-filter-request.json"),
        )
        .await;
    assert_eq!(ans["NodeNames"], json!(["fake-gpu-node-a"]), "{ans}");
    assert!(ans["Nodes"].is_null());
    // 002 bind c1 → a.
    let (_, ans) = served
        .post_json(
            "/scheduler/bind",
            &body("extender-nodecache-true/002-bind-request.json"),
        )
        .await;
    assert_eq!(ans, json!({"Error": ""}));
    confirm(
        &served,
        &binder,
        "extender-nodecache-true/001-filter-request.json",
    );
    // 003 filter c2 (2 GPUs) on [a, b]: both fit (a has 2 left).
    let (_, ans) = served
        .post_json(
            "/scheduler/filter",
            &body("extender-nodecache-true/003-filter-request.json"),
        )
        .await;
    assert_eq!(
        ans["NodeNames"],
        json!(["fake-gpu-node-a", "fake-gpu-node-b"]),
        "{ans}"
    );
    // 004 prioritize: both nodes scored within 0..=10 and the best gets 10 (which
    // one is the policy's business, tested in the policy core).
    let (_, ans) = served
        .post_json(
            "/scheduler/prioritize",
            &body("extender-nodecache-true/004-prioritize-request.json"),
        )
        .await;
    let list = ans.as_array().expect("HostPriorityList");
    let hosts: Vec<&str> = list.iter().filter_map(|h| h["Host"].as_str()).collect();
    assert_eq!(hosts, ["fake-gpu-node-a", "fake-gpu-node-b"], "{ans}");
    assert!(
        list.iter()
            .all(|h| (0..=10).contains(&h["Score"].as_i64().unwrap_or(-1))),
        "{ans}"
    );
    assert_eq!(
        list.iter().filter_map(|h| h["Score"].as_i64()).max(),
        Some(10),
        "{ans}"
    );
    // 005 bind c2 → a: the two GPUs c1 did not take.
    let (_, ans) = served
        .post_json(
            "/scheduler/bind",
            &body("extender-nodecache-true/005-bind-request.json"),
        )
        .await;
    assert_eq!(ans, json!({"Error": ""}));
    let plans = binder.plans.lock().expect("lock").clone();
    let uuids = |i: usize| -> Vec<String> {
        Assignment::from_json(&plans[i].assignment_json)
            .expect("record")
            .containers[0]
            .gpus
            .iter()
            .map(|g| g.uuid.clone())
            .collect()
    };
    let (first, second) = (uuids(0), uuids(1));
    assert!(
        first.iter().all(|u| !second.contains(u)),
        "{first:?} vs {second:?}"
    );
}

#[tokio::test]
async fn malformed_bodies_get_clear_errors_in_the_verbs_own_form() {
    let (served, _) = extender_over_fixture_nodes(&[]).await;
    let (status, ans) = served
        .post("/scheduler/filter", b"{not json".to_vec())
        .await;
    assert_eq!(status, 200);
    let ans: Value = serde_json::from_slice(&ans).expect("filter result");
    assert!(
        ans["Error"]
            .as_str()
            .expect("error")
            .starts_with("parse filter request body: "),
        "{ans}"
    );

    let (status, text) = served
        .post("/scheduler/prioritize", br#"{"Pod":null}"#.to_vec())
        .await;
    assert_eq!(status, 400);
    assert_eq!(
        String::from_utf8_lossy(&text),
        "prioritize request has no Pod"
    );

    let (status, ans) = served
        .post_json("/scheduler/bind", &json!({"PodName": "x"}))
        .await;
    assert_eq!(status, 200);
    assert!(
        ans["Error"]
            .as_str()
            .expect("error")
            .starts_with("parse bind request body: "),
        "{ans}"
    );

    // A pod with a malformed vgpu request: the error names the pod and the input.
    let mut req = body("extender-nodecache-true/001-filter-request.json");
    req["Pod"]["spec"]["containers"][0]["resources"]["requests"]["vgpu.io/gpu"] = json!("15");
    let (_, ans) = served.post_json("/scheduler/filter", &req).await;
    let err = ans["Error"].as_str().expect("error");
    assert!(
        err.contains("default/gpu-pod-c1") && err.contains("\"15\""),
        "{err}"
    );

    // An unknown compute class is refused before the pod is placed (the device plugin
    // would refuse the container's start), naming the annotation and the value.
    let mut req = body("extender-nodecache-true/001-filter-request.json");
    req["Pod"]["metadata"]["annotations"]["vgpu.io/priority"] = json!("urgent");
    let (_, ans) = served.post_json("/scheduler/filter", &req).await;
    let err = ans["Error"].as_str().expect("error");
    assert!(
        err.contains("default/gpu-pod-c1")
            && err.contains("vgpu.io/priority")
            && err.contains("\"urgent\""),
        "{err}"
    );

    // Bind for a pod never seen.
    let (_, ans) = served
        .post_json(
            "/scheduler/bind",
            &json!({"PodName": "ghost", "PodNamespace": "default", "PodUID": "u-ghost", "Node": "fake-gpu-node-a"}),
        )
        .await;
    assert!(
        ans["Error"]
            .as_str()
            .expect("error")
            .contains("default/ghost"),
        "{ans}"
    );
}

#[tokio::test]
async fn an_unsynced_extender_refuses_to_decide() {
    let state = Arc::new(State::new(
        StateConfig::default(),
        ExtenderPolicy::new(PolicyName::Vgpu),
    ));
    let served = Served::start(Extender::new(state, common::recording_binder())).await;
    assert_eq!(served.get("/readyz").await, 503);
    assert_eq!(served.get("/healthz").await, 200);
    let (_, ans) = served
        .post_json(
            "/scheduler/filter",
            &body("extender-nodecache-true/001-filter-request.json"),
        )
        .await;
    assert!(
        ans["Error"].as_str().expect("error").contains("not synced"),
        "{ans}"
    );
    assert!(ans["NodeNames"].is_null());
}

#[tokio::test]
async fn nodes_without_inventory_and_pods_without_gpus() {
    let (served, _) = extender_over_fixture_nodes(&[]).await;
    // A node the extender has never seen is rejected as unresolvable, with a reason.
    let mut req = body("extender-nodecache-true/003-filter-request.json");
    req["NodeNames"] = json!(["fake-gpu-node-a", "cpu-only-node"]);
    let (_, ans) = served.post_json("/scheduler/filter", &req).await;
    assert_eq!(ans["NodeNames"], json!(["fake-gpu-node-a"]));
    assert!(
        ans["FailedAndUnresolvableNodes"]["cpu-only-node"]
            .as_str()
            .expect("reason")
            .contains("not known"),
        "{ans}"
    );
    // A pod asking for no vgpu resource is not the extender's business: all pass.
    let mut req = body("extender-nodecache-true/003-filter-request.json");
    req["Pod"]["spec"]["containers"][0]["resources"] = json!({"requests": {"cpu": "1"}});
    let (_, ans) = served.post_json("/scheduler/filter", &req).await;
    assert_eq!(
        ans["NodeNames"],
        json!(["fake-gpu-node-a", "fake-gpu-node-b"]),
        "{ans}"
    );
}

#[tokio::test]
async fn fractional_pods_share_a_gpu_and_memory_limits_are_precise() {
    let (served, binder) = extender_over_fixture_nodes(&[]).await;
    let mut req = body("extender-nodecache-true/001-filter-request.json");
    // A 0.4 and a 0.3 GPU pod pack onto one GPU of node a (0.4 and 0.3 of the 80 GiB
    // less ten 300 MiB contexts, ADR 0012);
    // a 0.2 one asking 60 GiB has the compute there but not the memory, so it goes
    // to another GPU.
    let mut uuids = Vec::new();
    for (i, (slices, mem)) in [("4", None), ("3", None), ("2", Some("61440"))]
        .into_iter()
        .enumerate()
    {
        let uid = format!("frac-{i}");
        req["Pod"]["metadata"]["uid"] = json!(uid);
        req["Pod"]["metadata"]["name"] = json!(format!("frac-{i}"));
        let mut r = json!({"cpu": "100m", "vgpu.io/gpu": slices});
        if let Some(m) = mem {
            r["vgpu.io/gpu-memory"] = json!(m);
        }
        req["Pod"]["spec"]["containers"][0]["resources"] = json!({"requests": r, "limits": r});
        let (_, ans) = served.post_json("/scheduler/filter", &req).await;
        assert_eq!(ans["NodeNames"], json!(["fake-gpu-node-a"]), "{ans}");
        let (_, ans) = served
            .post_json(
                "/scheduler/bind",
                &json!({"PodName": format!("frac-{i}"), "PodNamespace": "default", "PodUID": uid, "Node": "fake-gpu-node-a"}),
            )
            .await;
        assert_eq!(ans, json!({"Error": ""}));
        let plan = binder
            .plans
            .lock()
            .expect("lock")
            .last()
            .cloned()
            .expect("plan");
        let a = Assignment::from_json(&plan.assignment_json).expect("record");
        let g = &a.containers[0].gpus[0];
        uuids.push(g.uuid.clone());
        match i {
            0 => assert_eq!((g.compute_milli, g.memory_mib, g.slices), (400, 31568, 4)),
            1 => assert_eq!((g.compute_milli, g.memory_mib, g.slices), (300, 23676, 3)),
            _ => assert_eq!((g.compute_milli, g.memory_mib, g.slices), (200, 61440, 2)),
        }
    }
    assert_eq!(uuids[0], uuids[1], "the 0.3 packs onto the 0.4's GPU");
    assert_ne!(
        uuids[2], uuids[0],
        "60 GiB does not fit in the 24 GiB left there"
    );
    let free = served
        .extender
        .state()
        .gpu_milli_free("fake-gpu-node-a")
        .expect("node");
    assert_eq!(free.iter().map(|&m| u64::from(m)).sum::<u64>(), 4000 - 900);
}

#[tokio::test]
async fn full_node_lists_past_axum_default_body_limit_are_accepted() {
    // nodeCacheCapable: false at 2,000 nodes: ~4 MiB of Node objects (axum's default
    // limit is 2 MiB). Only the two fixture nodes have inventories.
    let (served, _) = extender_over_fixture_nodes(&[]).await;
    let mut req = body("extender-nodecache-false/001-filter-request.json");
    let template = req["Nodes"]["items"][0].clone();
    let items = req["Nodes"]["items"].as_array_mut().expect("items");
    for i in 0..2000 {
        let mut n = template.clone();
        n["metadata"]["name"] = json!(format!("extra-node-{i:04}"));
        items.push(n);
    }
    let bytes = serde_json::to_vec(&req).expect("json");
    assert!(bytes.len() > 2 << 20, "{} bytes", bytes.len());
    let (status, ans) = served.post("/scheduler/filter", bytes).await;
    assert_eq!(status, 200);
    let ans: Value = serde_json::from_slice(&ans).expect("json");
    assert_eq!(ans["Error"], "");
    assert_eq!(ans["Nodes"]["items"].as_array().map(Vec::len), Some(2));
    assert_eq!(
        ans["FailedAndUnresolvableNodes"]
            .as_object()
            .map(|m| m.len()),
        Some(2000)
    );
}

#[tokio::test]
async fn unhealthy_gpus_take_no_new_pods_but_keep_theirs() {
    use vgpu_core::inventory::{ANNOTATION_GPU_INVENTORY, NodeInventory};
    // node-h: two GPUs, the first unhealthy; a pod already holds 0.3 of it.
    let mut node = common::gpu_node("node-h", 2, "A100", 81920);
    let mut inv = NodeInventory::from_json(
        node["metadata"]["annotations"][ANNOTATION_GPU_INVENTORY]
            .as_str()
            .expect("inventory"),
    )
    .expect("valid");
    inv.gpus[0].healthy = false;
    node["metadata"]["annotations"][ANNOTATION_GPU_INVENTORY] = json!(inv.to_json());
    let record = Assignment {
        version: vgpu_core::resources::ASSIGNMENT_VERSION,
        node: "node-h".into(),
        containers: vec![vgpu_core::resources::ContainerAssignment {
            name: "main".into(),
            gpus: vec![vgpu_core::resources::GpuGrant {
                uuid: "GPU-node-h-0".into(),
                compute_milli: 300,
                memory_mib: 24576,
                slices: 3,
            }],
        }],
    };
    let mut old = common::gpu_pod("old", "uid-old", json!({"vgpu.io/gpu": "3"}));
    old["metadata"]["annotations"] = json!({ANNOTATION_ASSIGNMENT: record.to_json()});
    old["spec"]["nodeName"] = json!("node-h");
    old["status"]["phase"] = json!("Running");

    let state = Arc::new(State::new(
        StateConfig::default(),
        ExtenderPolicy::new(PolicyName::Vgpu),
    ));
    state.replace_nodes(&[serde_json::from_value(node).expect("node")]);
    state.replace_pods(&[serde_json::from_value(old).expect("pod")]);
    state.mark_synced(WatchKind::Nodes);
    state.mark_synced(WatchKind::Pods);
    let binder = common::recording_binder();
    let served = Served::start(Extender::new(state.clone(), binder.clone())).await;
    // The old pod stays accounted on the unhealthy GPU.
    assert_eq!(state.gpu_milli_free("node-h"), Some(vec![700, 1000]));

    // A 0.5 pod fits only the healthy GPU.
    let p = common::gpu_pod("p", "uid-p", json!({"vgpu.io/gpu": "5"}));
    let (_, ans) = served
        .post_json(
            "/scheduler/filter",
            &json!({"Pod": p, "NodeNames": ["node-h"]}),
        )
        .await;
    assert_eq!(ans["NodeNames"], json!(["node-h"]), "{ans}");
    let (_, ans) = served
        .post_json(
            "/scheduler/bind",
            &json!({"PodName": "p", "PodNamespace": "default", "PodUID": "uid-p", "Node": "node-h"}),
        )
        .await;
    assert_eq!(ans, json!({"Error": ""}));
    let plan = binder
        .plans
        .lock()
        .expect("lock")
        .last()
        .cloned()
        .expect("plan");
    let a = Assignment::from_json(&plan.assignment_json).expect("record");
    assert_eq!(a.containers[0].gpus[0].uuid, "GPU-node-h-1");

    // Two whole GPUs: only one healthy GPU exists, so the node is rejected.
    let w = common::gpu_pod("w", "uid-w", json!({"vgpu.io/gpu": "20"}));
    let (_, ans) = served
        .post_json(
            "/scheduler/filter",
            &json!({"Pod": w, "NodeNames": ["node-h"]}),
        )
        .await;
    assert_eq!(ans["NodeNames"], json!([]), "{ans}");
    let reason = ans["FailedAndUnresolvableNodes"]["node-h"]
        .as_str()
        .expect("reason");
    assert!(
        reason.starts_with("GPU count: 1 GPUs of an allowed model < 2"),
        "{reason}"
    );
}

#[tokio::test]
async fn a_gpu_health_change_updates_the_node_in_place_without_a_rebuild() {
    use vgpu_core::inventory::{ANNOTATION_GPU_INVENTORY, NodeInventory};
    fn with_health(mut node: Value, healthy: [bool; 2]) -> Node {
        let mut inv = NodeInventory::from_json(
            node["metadata"]["annotations"][ANNOTATION_GPU_INVENTORY]
                .as_str()
                .expect("inventory"),
        )
        .expect("valid");
        for (g, h) in inv.gpus.iter_mut().zip(healthy) {
            g.healthy = h;
        }
        node["metadata"]["annotations"][ANNOTATION_GPU_INVENTORY] = json!(inv.to_json());
        serde_json::from_value(node).expect("node")
    }
    let record = Assignment {
        version: vgpu_core::resources::ASSIGNMENT_VERSION,
        node: "node-h".into(),
        containers: vec![vgpu_core::resources::ContainerAssignment {
            name: "main".into(),
            gpus: vec![vgpu_core::resources::GpuGrant {
                uuid: "GPU-node-h-0".into(),
                compute_milli: 300,
                memory_mib: 24576,
                slices: 3,
            }],
        }],
    };
    let mut old = common::gpu_pod("old", "uid-old", json!({"vgpu.io/gpu": "3"}));
    old["metadata"]["annotations"] = json!({ANNOTATION_ASSIGNMENT: record.to_json()});
    old["spec"]["nodeName"] = json!("node-h");
    old["status"]["phase"] = json!("Running");
    let old: Pod = serde_json::from_value(old).expect("pod");
    let node = common::gpu_node("node-h", 2, "A100", 81920);
    let other: Node =
        serde_json::from_value(common::gpu_node("node-o", 2, "A100", 81920)).expect("node");
    let state_with = |healthy: [bool; 2]| {
        let state = Arc::new(State::new(
            StateConfig::default(),
            ExtenderPolicy::new(PolicyName::Vgpu),
        ));
        state.replace_nodes(&[with_health(node.clone(), healthy), other.clone()]);
        state.replace_pods(std::slice::from_ref(&old));
        state.mark_synced(WatchKind::Nodes);
        state.mark_synced(WatchKind::Pods);
        state
    };
    let state = state_with([true, true]);
    let served = Served::start(Extender::new(state.clone(), common::recording_binder())).await;
    let filter = |pod: &Value| json!({"Pod": pod, "NodeNames": ["node-h", "node-o"]});
    let big = common::gpu_pod("big", "uid-big", json!({"vgpu.io/gpu": "8"}));
    let rebuilds = state.stats().rebuilds;

    // GPU 1 turns unhealthy: relabelled in place, the old pod stays accounted, and
    // a 0.8 pod no longer fits node-h (GPU 0 has 0.7 left).
    state.apply_node(&with_health(node.clone(), [true, false]));
    assert_eq!(
        state.stats().rebuilds,
        rebuilds,
        "no rebuild for a health change"
    );
    assert_eq!(state.gpu_milli_free("node-h"), Some(vec![700, 1000]));
    let (_, ans) = served.post_json("/scheduler/filter", &filter(&big)).await;
    assert_eq!(ans["NodeNames"], json!(["node-o"]), "{ans}");
    // The same answers as an extender that built everything from these objects.
    let fresh = Served::start(Extender::new(
        state_with([true, false]),
        common::recording_binder(),
    ))
    .await;
    for pod in [
        &big,
        &common::gpu_pod("s", "uid-s", json!({"vgpu.io/gpu": "2"})),
    ] {
        for verb in ["filter", "prioritize"] {
            let path = format!("/scheduler/{verb}");
            let (_, a) = served.post_json(&path, &filter(pod)).await;
            let (_, b) = fresh.post_json(&path, &filter(pod)).await;
            assert_eq!(a, b, "{verb}");
        }
    }

    // Healthy again: the 0.8 pod fits node-h's GPU 1 and binds there.
    state.apply_node(&with_health(node.clone(), [true, true]));
    assert_eq!(state.stats().rebuilds, rebuilds);
    let (_, ans) = served.post_json("/scheduler/filter", &filter(&big)).await;
    assert_eq!(ans["NodeNames"], json!(["node-h", "node-o"]), "{ans}");
    let (_, ans) = served
        .post_json(
            "/scheduler/bind",
            &json!({"PodName": "big", "PodNamespace": "default", "PodUID": "uid-big", "Node": "node-h"}),
        )
        .await;
    assert_eq!(ans, json!({"Error": ""}));
    assert_eq!(state.gpu_milli_free("node-h"), Some(vec![700, 200]));

    // A change of the GPU list itself still rebuilds.
    state.apply_node(
        &serde_json::from_value(common::gpu_node("node-h", 3, "A100", 81920)).expect("node"),
    );
    assert_eq!(state.stats().rebuilds, rebuilds + 1);
}

/// Filter and bind one pod from the recorded filter body with `spec` patched in;
/// returns the filter answer and, when it bound, the assignment.
async fn filter_and_bind(
    served: &Served,
    binder: &RecordingBinder,
    name: &str,
    patch: Value,
) -> (Value, Option<Assignment>) {
    let mut req = body("extender-nodecache-true/001-filter-request.json");
    req["Pod"]["metadata"]["uid"] = json!(name);
    req["Pod"]["metadata"]["name"] = json!(name);
    for (k, v) in patch.as_object().expect("patch") {
        req["Pod"]["spec"][k] = v.clone();
    }
    let (_, ans) = served.post_json("/scheduler/filter", &req).await;
    if ans["NodeNames"] != json!(["fake-gpu-node-a"]) {
        return (ans, None);
    }
    let (_, bound) = served
        .post_json(
            "/scheduler/bind",
            &json!({"PodName": name, "PodNamespace": "default", "PodUID": name, "Node": "fake-gpu-node-a"}),
        )
        .await;
    assert_eq!(bound, json!({"Error": ""}), "{name}");
    let plan = binder
        .plans
        .lock()
        .expect("lock")
        .last()
        .cloned()
        .expect("plan");
    let record = Assignment::from_json(&plan.assignment_json).expect("record");
    // What the watch shows after the bind: the pod with its record.
    req["Pod"]["metadata"]["annotations"][ANNOTATION_ASSIGNMENT] = json!(plan.assignment_json);
    req["Pod"]["spec"]["nodeName"] = json!("fake-gpu-node-a");
    req["Pod"]["status"] = json!({"phase": "Pending"});
    served
        .extender
        .state()
        .apply_pod(&serde_json::from_value(req["Pod"].clone()).expect("pod"));
    (ans, Some(record))
}

fn gpu_container(name: &str, requests: Value) -> Value {
    json!({"name": name, "image": "registry.invalid/none:0",
           "resources": {"requests": requests.clone(), "limits": requests}})
}

fn free_milli(served: &Served) -> u64 {
    served
        .extender
        .state()
        .gpu_milli_free("fake-gpu-node-a")
        .expect("node")
        .iter()
        .map(|&m| u64::from(m))
        .sum()
}

#[tokio::test]
async fn init_and_app_containers_that_kubelet_reuses_devices_between_share_a_gpu() {
    let (served, binder) = extender_over_fixture_nodes(&[]).await;
    // Node a's GPUs: one with exactly 0.5 free, three free.
    let (_, first) = filter_and_bind(
        &served,
        &binder,
        "half",
        json!({"containers": [gpu_container("main", json!({"vgpu.io/gpu": "5"}))]}),
    )
    .await;
    let half_gpu = first.expect("bound").containers[0].gpus[0].uuid.clone();
    assert_eq!(free_milli(&served), 3500);

    // An init container of 0.3 and an app container of 0.5: kubelet hands the app the
    // init's 3 devices first, so both must be on one GPU. Reserved one by one, the init
    // would fill the half-free GPU's tightest fit and the app land on another GPU
    // (the device plugin then refuses the app container). Together they hold their
    // peak, 0.5, not 0.8: the half-free GPU takes them exactly.
    let (_, record) = filter_and_bind(
        &served,
        &binder,
        "with-init",
        json!({
            "initContainers": [gpu_container("setup", json!({"cpu": "100m", "vgpu.io/gpu": "3"}))],
            "containers": [gpu_container("train", json!({"cpu": "100m", "vgpu.io/gpu": "5"}))],
        }),
    )
    .await;
    let record = record.expect("bound");
    let setup = record.container("setup").expect("init grant");
    let train = record.container("train").expect("app grant");
    assert_eq!(setup.gpus.len(), 1);
    assert_eq!(
        setup.gpus[0].uuid, train.gpus[0].uuid,
        "one GPU: {record:?}"
    );
    assert_eq!(setup.gpus[0].uuid, half_gpu);
    assert_eq!(
        (
            setup.gpus[0].compute_milli,
            setup.gpus[0].memory_mib,
            setup.gpus[0].slices
        ),
        (300, 23676, 3)
    );
    assert_eq!(
        (
            train.gpus[0].compute_milli,
            train.gpus[0].memory_mib,
            train.gpus[0].slices
        ),
        (500, 39460, 5)
    );
    // The peak is held (0.5), not the sum (0.8); the pod read back from its record
    // (the watch's view above) holds the same.
    assert_eq!(free_milli(&served), 3000);

    // A combination kubelet cannot hand out consistently is refused at filter, naming
    // the containers: the last app takes the 6 devices left in the pool and 3 more,
    // 11 slices on one GPU.
    let (ans, none) = filter_and_bind(
        &served,
        &binder,
        "impossible",
        json!({
            "initContainers": [gpu_container("setup", json!({"vgpu.io/gpu": "8"}))],
            "containers": [
                gpu_container("a", json!({"vgpu.io/gpu": "2"})),
                gpu_container("b", json!({"vgpu.io/gpu": "9", "vgpu.io/gpu-compute": "10", "vgpu.io/gpu-memory": "1024"})),
            ],
        }),
    )
    .await;
    assert!(none.is_none());
    let err = ans["Error"].as_str().expect("error");
    assert!(
        err.contains("default/impossible")
            && err.contains("\"setup\", \"a\", \"b\"")
            && err.contains("11 slices"),
        "{err}"
    );

    // A sidecar (restartPolicy: Always) that takes the init's devices keeps them: the
    // three of them share a GPU; a whole-GPU init and a 0.3 app hold the whole GPU.
    let (_, record) = filter_and_bind(
        &served,
        &binder,
        "sidecar",
        json!({
            "initContainers": [
                gpu_container("prep", json!({"vgpu.io/gpu": "2"})),
                {"name": "proxy", "image": "x", "restartPolicy": "Always",
                 "resources": {"limits": {"vgpu.io/gpu": "1"}}},
            ],
            "containers": [gpu_container("serve", json!({"vgpu.io/gpu": "2"}))],
        }),
    )
    .await;
    let record = record.expect("bound");
    let uuids: Vec<&str> = ["prep", "proxy", "serve"]
        .iter()
        .map(|c| record.container(c).expect("grant").gpus[0].uuid.as_str())
        .collect();
    assert!(uuids.iter().all(|u| *u == uuids[0]), "{record:?}");
    // Peak: the app and the sidecar together, 0.3 (the init alone is 0.2).
    assert_eq!(free_milli(&served), 2700);
    let (_, record) = filter_and_bind(
        &served,
        &binder,
        "whole",
        json!({
            "initContainers": [gpu_container("load", json!({"vgpu.io/gpu": "10"}))],
            "containers": [gpu_container("run", json!({"vgpu.io/gpu": "3"}))],
        }),
    )
    .await;
    let record = record.expect("bound");
    assert_eq!(
        record.container("load").expect("init").gpus[0].uuid,
        record.container("run").expect("app").gpus[0].uuid
    );
    assert_eq!(free_milli(&served), 1700);
}
