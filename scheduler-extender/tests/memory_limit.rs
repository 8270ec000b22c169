//! The extender packs by memory requests only (ADR 0066, point 2): a pod's
//! `vgpu.io/gpu-memory-limit` never enters the fit, so pods with limits far above their
//! requests fit where their requests fit; a malformed limit is refused at filter, naming
//! the value, before the pod is placed.

use super::common;

use serde_json::{Value, json};
use vgpu_core::memory_limit::ANNOTATION_GPU_MEMORY_LIMIT;
use vgpu_core::packing::PolicyName;
use vgpu_core::resources::{ANNOTATION_ASSIGNMENT, Assignment};
use vgpu_scheduler_extender::extender::{Extender, StateConfig};

use common::Served;

/// cuda-sim's H100: 80 GiB; the default context reserve is 300 MiB for each of the GPU's
/// 10 slices (ADR 0012), so requests may take 78,920 MiB.
const GPU_MIB: u64 = 81_920;
const CONTEXT_MIB: u64 = 300;
/// Four requests of this fit the GPU (76,000 of 78,920 MiB); a fifth does not.
const REQUEST_MIB: u64 = 19_000;

fn pod(name: &str, limit: Option<&str>) -> Value {
    let mut p = common::gpu_pod(
        name,
        &format!("uid-{name}"),
        json!({"vgpu.io/gpu": "1", "vgpu.io/gpu-memory": REQUEST_MIB.to_string()}),
    );
    if let Some(l) = limit {
        p["metadata"]["annotations"] = json!({ ANNOTATION_GPU_MEMORY_LIMIT: l });
    }
    p
}

/// Filters and binds the pods one after the other on one 80 GiB GPU; returns, per pod,
/// the MiB its assignment grants, or the filter's answer where it was refused.
async fn place(pods: Vec<Value>) -> Vec<Result<u64, Value>> {
    let node = common::gpu_node("node-a", 1, "H100", GPU_MIB);
    let state = common::synced_state(StateConfig::default(), PolicyName::Vgpu, vec![node]);
    let binder = common::recording_binder();
    let served = Served::start(Extender::new(state.clone(), binder.clone())).await;
    let mut out = Vec::new();
    let mut bound = Vec::new();
    for pod in pods {
        let name = pod["metadata"]["name"].as_str().expect("name").to_owned();
        let uid = pod["metadata"]["uid"].as_str().expect("uid").to_owned();
        let (_, ans) = served
            .post_json(
                "/scheduler/filter",
                &json!({"Pod": pod, "NodeNames": ["node-a"]}),
            )
            .await;
        if ans["NodeNames"] != json!(["node-a"]) {
            out.push(Err(ans));
            continue;
        }
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
        out.push(Ok(a.containers[0].gpus[0].memory_mib));
        let mut pod = pod;
        pod["metadata"]["annotations"][ANNOTATION_ASSIGNMENT] = json!(plan.assignment_json);
        pod["spec"]["nodeName"] = json!("node-a");
        pod["status"]["phase"] = json!("Running");
        bound.push(serde_json::from_value(pod).expect("pod"));
        // The pod watch sees the bound pods, as in a cluster.
        state.replace_pods(&bound);
    }
    out
}

#[tokio::test]
async fn pods_with_huge_limits_fit_where_their_requests_fit() {
    // Every limit alone is at least the GPU: a fit that counted limits would place none.
    let limits = ["16777216", "main=81920", "100000", "main=16777216"];
    let mut pods: Vec<Value> = (0..4)
        .map(|i| pod(&format!("burst-{i}"), Some(limits[i])))
        .collect();
    pods.push(pod("fifth", Some("19000")));
    let placed = place(pods).await;
    for (i, r) in placed[..4].iter().enumerate() {
        assert_eq!(r, &Ok(REQUEST_MIB), "pod {i} (limit {}): {r:?}", limits[i]);
    }
    // The fifth is refused by its request (5 × 19,000 > 78,920), its limit equal to the
    // request, as without a limit.
    let refused = placed[4]
        .as_ref()
        .expect_err("the fifth request does not fit");
    assert_eq!(refused["NodeNames"], json!([]), "{refused}");
    let for_requests = GPU_MIB - 10 * CONTEXT_MIB;
    assert!((4 * REQUEST_MIB..5 * REQUEST_MIB).contains(&for_requests));

    // The same five pods without limits are placed the same way.
    let plain = place((0..5).map(|i| pod(&format!("plain-{i}"), None)).collect()).await;
    assert_eq!(
        plain.iter().map(Result::is_ok).collect::<Vec<_>>(),
        placed.iter().map(Result::is_ok).collect::<Vec<_>>()
    );
}

#[tokio::test]
async fn a_bad_limit_is_refused_at_filter_naming_the_value() {
    for (limit, words) in [
        ("16Gi", vec!["\"16Gi\"", "MiB"]),
        ("mian=40000", vec!["\"mian\"", "\"main\""]),
        (
            "main=1024",
            vec!["\"main\"", "limit 1024 MiB", "request of 19000 MiB"],
        ),
        ("main=40000,", vec!["\"main=40000,\""]),
    ] {
        let placed = place(vec![pod("p", Some(limit))]).await;
        let ans = placed[0].as_ref().expect_err(limit);
        let error = ans["Error"].as_str().unwrap_or_default();
        assert!(
            error.contains(ANNOTATION_GPU_MEMORY_LIMIT) && error.contains("default/p"),
            "{limit}: {ans}"
        );
        for w in words {
            assert!(error.contains(w), "{limit}: {w} not in {error}");
        }
    }
}
