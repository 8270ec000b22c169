//! Quota policies (`VgpuQuotaPolicy`, ADR 0022) against the scripted fake API server:
//! the extender's watches, HTTP server and kube binder as `serve` runs them, the policy
//! watch, its status writer and its events. Every wait has a deadline.

use super::common;

use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};
use tokio::task::JoinHandle;
use vgpu_core::packing::PolicyName;
use vgpu_core::resources::{ANNOTATION_ASSIGNMENT, ANNOTATION_PRIORITY, Assignment};
use vgpu_scheduler_extender::extender::binder::KubeBinder;
use vgpu_scheduler_extender::extender::policy::ExtenderPolicy;
use vgpu_scheduler_extender::extender::quota;
use vgpu_scheduler_extender::extender::quota::watch::QuotaSyncConfig;
use vgpu_scheduler_extender::extender::sync::{self, SyncConfig};
use vgpu_scheduler_extender::extender::{Extender, State, StateConfig};

use common::{Served, gpu_node, gpu_pod};
use vgpu_testkit::fake_api::FakeApi;

const DEADLINE: Duration = Duration::from_secs(10);

struct Instance {
    served: Served,
    tasks: Vec<JoinHandle<()>>,
}

impl Instance {
    async fn start(fake: &FakeApi) -> Self {
        let client = fake.client().expect("client");
        let state = Arc::new(State::new(
            StateConfig::default(),
            ExtenderPolicy::new(PolicyName::Vgpu),
        ));
        let tasks = vec![
            tokio::spawn(sync::run(
                client.clone(),
                state.clone(),
                SyncConfig {
                    page_size: 500,
                    sweep_interval: Duration::from_millis(50),
                },
            )),
            tokio::spawn(quota::watch::run(
                client.clone(),
                state.clone(),
                QuotaSyncConfig {
                    status_every: Duration::from_millis(100),
                    events_per_second: 100,
                },
            )),
        ];
        let served = Served::start(Extender::new(state, Arc::new(KubeBinder::new(client)))).await;
        let inst = Instance { served, tasks };
        eventually("state synced", || inst.state().is_synced()).await;
        inst
    }

    fn state(&self) -> &Arc<State> {
        self.served.extender.state()
    }

    async fn filter(&self, pod: &Value, nodes: &[&str]) -> Value {
        let (status, ans) = self
            .served
            .post_json(
                "/scheduler/filter",
                &json!({"Pod": pod, "NodeNames": nodes}),
            )
            .await;
        assert_eq!(status, 200, "{ans}");
        ans
    }

    async fn bind(&self, pod: &Value, node: &str) -> String {
        let (status, ans) = self
            .served
            .post_json(
                "/scheduler/bind",
                &json!({
                    "PodName": pod["metadata"]["name"],
                    "PodNamespace": pod["metadata"]["namespace"],
                    "PodUID": pod["metadata"]["uid"],
                    "Node": node,
                }),
            )
            .await;
        assert_eq!(status, 200, "{ans}");
        ans["Error"].as_str().expect("Error field").to_string()
    }
}

impl Drop for Instance {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

async fn eventually(what: &str, cond: impl Fn() -> bool) {
    let end = tokio::time::Instant::now() + DEADLINE;
    while !cond() {
        assert!(
            tokio::time::Instant::now() < end,
            "timed out after {DEADLINE:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn team_pod(name: &str, requests: Value) -> Value {
    let mut pod = gpu_pod(name, &format!("uid-{name}"), requests);
    pod["metadata"]["namespace"] = json!("team");
    pod
}

fn slices(n: u32) -> Value {
    json!({"cpu": "100m", "vgpu.io/gpu": n.to_string()})
}

fn policy(name: &str, spec: Value) -> Value {
    json!({"metadata": {"name": name, "namespace": "team", "uid": format!("uid-policy-{name}")}, "spec": spec})
}

/// Waits until the extender holds `n` policies in namespace `team`.
/// One A100 node, team's policy of 64 GiB / 150 % / 2 GPUs (seen by the extender), and
/// team's pod `p1` (5 slices, 16 GiB) filtered and bound: the API and the extender.
async fn team_with_one_pod_placed() -> (FakeApi, Instance) {
    let fake = FakeApi::start().await.expect("fake API");
    fake.put_node(gpu_node("node-a", 2, "A100", 81920));
    fake.put_quota_policy(policy(
        "gpu",
        json!({"totals": {"memory": "64Gi", "computePercent": 150, "gpus": 2}}),
    ));
    let inst = Instance::start(&fake).await;
    policies_seen(&inst, 1, 0).await;
    let p1 = team_pod(
        "p1",
        json!({"vgpu.io/gpu": "5", "vgpu.io/gpu-memory": "16384"}),
    );
    fake.put_pod(p1.clone());
    inst.filter(&p1, &["node-a"]).await;
    assert_eq!(inst.bind(&p1, "node-a").await, "");
    (fake, inst)
}

async fn policies_seen(inst: &Instance, valid: usize, invalid: usize) {
    eventually("policies seen by the extender", || {
        let r = inst.state().quota().namespace("team");
        r.valid.len() == valid && r.invalid.len() == invalid
    })
    .await;
}

#[test]
fn the_shipped_crd_is_what_the_type_generates() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../deploy/10-crd-vgpuquotapolicy.json");
    let shipped = std::fs::read_to_string(&path).expect("the shipped CRD");
    assert_eq!(
        shipped,
        quota::crd::crd_json(),
        "{} is stale: regenerate it with `vgpu-scheduler-extender crd > {}`",
        path.display(),
        path.display()
    );
    let crd: Value = serde_json::from_str(&shipped).expect("JSON");
    assert_eq!(crd["spec"]["group"], "vgpu.io");
    assert_eq!(crd["spec"]["scope"], "Namespaced");
    assert_eq!(crd["spec"]["names"]["plural"], "vgpuquotapolicies");
    let v = &crd["spec"]["versions"][0];
    assert_eq!(v["name"], "v1alpha1");
    assert!(
        v["subresources"]["status"].is_object(),
        "status subresource"
    );
    let props = &v["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"];
    for field in ["defaults", "limits", "totals"] {
        assert!(
            props[field].is_object(),
            "spec.{field} in the schema: {props}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pods_racing_for_the_last_of_a_total_only_as_many_as_fit_are_placed() {
    let fake = FakeApi::start().await.expect("fake API");
    fake.put_node(gpu_node("node-a", 4, "A100", 81920));
    fake.put_node(gpu_node("node-b", 4, "A100", 81920));
    // 100 % of compute for the namespace: five pods of 20 % fit, not ten.
    fake.put_quota_policy(policy("gpu", json!({"totals": {"computePercent": 100}})));
    let pods: Vec<Value> = (0..10)
        .map(|i| team_pod(&format!("p{i}"), slices(2)))
        .collect();
    for p in &pods {
        fake.put_pod(p.clone());
    }
    let inst = Arc::new(Instance::start(&fake).await);
    policies_seen(&inst, 1, 0).await;
    // Every filter passes: nothing is held yet. The binds then race.
    for p in &pods {
        let ans = inst.filter(p, &["node-a", "node-b"]).await;
        assert_eq!(ans["NodeNames"].as_array().map(Vec::len), Some(2), "{ans}");
    }
    let binds: Vec<_> = pods
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let inst = inst.clone();
            let p = p.clone();
            tokio::spawn(async move {
                inst.bind(&p, if i % 2 == 0 { "node-a" } else { "node-b" })
                    .await
            })
        })
        .collect();
    let mut errors = Vec::new();
    for b in binds {
        let e = b.await.expect("bind task");
        if !e.is_empty() {
            errors.push(e);
        }
    }
    assert_eq!(errors.len(), 5, "{errors:#?}");
    for e in &errors {
        assert!(
            e.contains("quota policy team/gpu: namespace compute 100% in use + 20% asked > spec.totals.computePercent 100%"),
            "{e}"
        );
    }
    let bound = fake
        .pods()
        .iter()
        .filter(|p| p["spec"]["nodeName"].is_string())
        .count();
    assert_eq!(bound, 5);
    // Once the watch shows them, the use is the five pods' 100 %.
    eventually("use of 100 %", || {
        inst.state()
            .quota_usage()
            .get("team")
            .map(|u| u.compute_milli)
            == Some(1000)
    })
    .await;
    // Each refused pod got one event naming the policy.
    fake.wait_for_calls("five events", DEADLINE, |calls| {
        calls
            .iter()
            .filter(|c| c.method == "POST" && c.path.ends_with("/events"))
            .count()
            >= 5
    })
    .await;
    let events = fake.events();
    let mut told: Vec<&str> = events
        .iter()
        .filter_map(|e| e["involvedObject"]["name"].as_str())
        .collect();
    told.sort_unstable();
    told.dedup();
    assert_eq!(told.len(), 5, "one event per refused pod: {events:#?}");
    assert!(
        events
            .iter()
            .all(|e| e["reason"] == "VgpuQuotaPolicyExceeded"
                && e["type"] == "Warning"
                && e["message"]
                    .as_str()
                    .is_some_and(|m| m.contains("quota policy team/gpu"))),
        "{events:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_pods_racing_for_the_last_share_exactly_one_is_placed() {
    for round in 0..5 {
        let fake = FakeApi::start().await.expect("fake API");
        fake.put_node(gpu_node("node-a", 2, "A100", 81920));
        fake.put_quota_policy(policy(
            "gpu",
            json!({"totals": {"memory": "40Gi", "gpus": 2}}),
        ));
        // 30 GiB held already; two pods ask 8 GiB each; 10 GiB left.
        let held = team_pod(
            "held",
            json!({"vgpu.io/gpu": "3", "vgpu.io/gpu-memory": "30720"}),
        );
        fake.put_pod(held.clone());
        let a = team_pod(
            "a",
            json!({"vgpu.io/gpu": "1", "vgpu.io/gpu-memory": "8192"}),
        );
        let b = team_pod(
            "b",
            json!({"vgpu.io/gpu": "1", "vgpu.io/gpu-memory": "8192"}),
        );
        fake.put_pod(a.clone());
        fake.put_pod(b.clone());
        let inst = Arc::new(Instance::start(&fake).await);
        policies_seen(&inst, 1, 0).await;
        assert_eq!(
            inst.filter(&held, &["node-a"]).await["NodeNames"],
            json!(["node-a"])
        );
        assert_eq!(inst.bind(&held, "node-a").await, "");
        for p in [&a, &b] {
            assert_eq!(
                inst.filter(p, &["node-a"]).await["NodeNames"],
                json!(["node-a"]),
                "round {round}"
            );
        }
        let (ra, rb) = tokio::join!(inst.bind(&a, "node-a"), inst.bind(&b, "node-a"));
        let refused: Vec<&String> = [&ra, &rb].into_iter().filter(|e| !e.is_empty()).collect();
        assert_eq!(refused.len(), 1, "round {round}: {ra:?} / {rb:?}");
        assert!(
            refused[0].contains("quota policy team/gpu: namespace GPU memory 38912 MiB in use + 8192 MiB asked > spec.totals.memory 40960 MiB"),
            "{}",
            refused[0]
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_shows_use_a_bad_policy_names_its_field_and_blocks_new_pods() {
    let (fake, inst) = team_with_one_pod_placed().await;
    eventually("status with the pod's use", || {
        let s = &fake.quota_policy("team", "gpu").expect("policy")["status"];
        s["used"] == json!({"memoryMiB": 16384, "computePercent": 50.0, "gpus": 1, "pods": 1})
            && s["conditions"][0]["type"] == "Valid"
            && s["conditions"][0]["status"] == "True"
            && s["observedGeneration"] == 1
    })
    .await;
    // A second policy with a per-container limit above the namespace total.
    fake.put_quota_policy(policy(
        "broken",
        json!({"limits": {"memory": "32Gi"}, "totals": {"memory": "16Gi"}}),
    ));
    policies_seen(&inst, 1, 1).await;
    eventually("the bad policy's condition", || {
        let s = &fake.quota_policy("team", "broken").expect("policy")["status"];
        s["conditions"][0]["status"] == "False"
            && s["conditions"][0]["reason"] == "InvalidSpec"
            && s["conditions"][0]["message"].as_str().is_some_and(|m| {
                m.contains("spec.limits.memory") && m.contains("above spec.totals.memory")
            })
    })
    .await;
    let p2 = team_pod("p2", slices(1));
    fake.put_pod(p2.clone());
    let ans = inst.filter(&p2, &["node-a"]).await;
    assert_eq!(ans["NodeNames"], json!([]), "{ans}");
    let reason = ans["FailedAndUnresolvableNodes"]["node-a"]
        .as_str()
        .expect("reason");
    assert!(
        reason.contains("quota policy team/broken: the policy is invalid")
            && reason.contains("spec.limits.memory = \"32Gi\""),
        "{reason}"
    );
    // The running pod is untouched.
    assert_eq!(
        fake.pod("team", "p1").expect("p1")["spec"]["nodeName"],
        "node-a"
    );
    assert!(fake.calls_matching("DELETE", "").is_empty());
    // Unparseable: a string where a number belongs.
    fake.put_quota_policy(policy("broken", json!({"totals": {"gpus": "two"}})));
    eventually("the unparseable policy's condition", || {
        let s = &fake.quota_policy("team", "broken").expect("policy")["status"];
        s["observedGeneration"] == 2
            && s["conditions"][0]["message"]
                .as_str()
                .is_some_and(|m| m.contains("policy team/broken: spec") && m.contains("\"two\""))
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_change_applies_to_new_pods_at_once_and_never_evicts_running_ones() {
    let fake = FakeApi::start().await.expect("fake API");
    fake.put_node(gpu_node("node-a", 2, "A100", 81920));
    fake.put_quota_policy(policy("gpu", json!({"totals": {"computePercent": 100}})));
    let inst = Instance::start(&fake).await;
    policies_seen(&inst, 1, 0).await;
    for name in ["p1", "p2"] {
        let p = team_pod(name, slices(4));
        fake.put_pod(p.clone());
        inst.filter(&p, &["node-a"]).await;
        assert_eq!(inst.bind(&p, "node-a").await, "");
    }
    eventually("80 % held", || {
        inst.state()
            .quota_usage()
            .get("team")
            .map(|u| u.compute_milli)
            == Some(800)
    })
    .await;
    // Lowered below what runs: the running pods stay, a new one is refused at once.
    fake.put_quota_policy(policy("gpu", json!({"totals": {"computePercent": 50}})));
    eventually("the lowered total", || {
        inst.state()
            .quota()
            .namespace("team")
            .valid
            .first()
            .and_then(|r| r.total_compute_milli)
            == Some(500)
    })
    .await;
    let p3 = team_pod("p3", slices(1));
    fake.put_pod(p3.clone());
    let ans = inst.filter(&p3, &["node-a"]).await;
    let reason = ans["FailedAndUnresolvableNodes"]["node-a"]
        .as_str()
        .unwrap_or_default();
    assert!(
        reason
            .contains("namespace compute 80% in use + 10% asked > spec.totals.computePercent 50%"),
        "{ans}"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    for name in ["p1", "p2"] {
        let p = fake.pod("team", name).expect("still there");
        assert_eq!(p["spec"]["nodeName"], "node-a");
        assert!(p["metadata"]["annotations"][ANNOTATION_ASSIGNMENT].is_string());
    }
    assert!(fake.calls_matching("DELETE", "").is_empty());
    assert_eq!(inst.state().quota_usage()["team"].compute_milli, 800);
    // Raised again: the same pod fits at once.
    fake.put_quota_policy(policy("gpu", json!({"totals": {"computePercent": 200}})));
    eventually("the raised total", || {
        inst.state()
            .quota()
            .namespace("team")
            .valid
            .first()
            .and_then(|r| r.total_compute_milli)
            == Some(2000)
    })
    .await;
    assert_eq!(
        inst.filter(&p3, &["node-a"]).await["NodeNames"],
        json!(["node-a"])
    );
    assert_eq!(inst.bind(&p3, "node-a").await, "");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn defaults_limits_and_classes_apply_per_container() {
    let fake = FakeApi::start().await.expect("fake API");
    fake.put_node(gpu_node("node-a", 1, "A100", 81920));
    fake.put_quota_policy(policy(
        "gpu",
        json!({
            "defaults": {"memory": "4Gi", "computePercent": 15},
            "limits": {"memory": "16Gi", "computePercent": 50, "priorityClasses": ["best-effort"]},
        }),
    ));
    let inst = Instance::start(&fake).await;
    policies_seen(&inst, 1, 0).await;
    // Only slices: the defaults, recorded in the assignment the device plugin reads.
    let p = team_pod("slices-only", slices(3));
    fake.put_pod(p.clone());
    assert_eq!(
        inst.filter(&p, &["node-a"]).await["NodeNames"],
        json!(["node-a"])
    );
    assert_eq!(inst.bind(&p, "node-a").await, "");
    let stored = fake.pod("team", "slices-only").expect("pod");
    let a = Assignment::from_json(
        stored["metadata"]["annotations"][ANNOTATION_ASSIGNMENT]
            .as_str()
            .expect("record"),
    )
    .expect("valid record");
    assert_eq!(a.containers[0].gpus[0].memory_mib, 4096);
    assert_eq!(a.containers[0].gpus[0].compute_milli, 150);
    // Above the per-container limits: compute given explicitly, then memory.
    let big = team_pod(
        "big",
        json!({"vgpu.io/gpu": "6", "vgpu.io/gpu-compute": "60"}),
    );
    let ans = inst.filter(&big, &["node-a"]).await;
    assert_eq!(
        ans["FailedAndUnresolvableNodes"]["node-a"],
        "quota policy team/gpu: container \"main\" asks 60% of compute per GPU, above spec.limits.computePercent (50%)"
    );
    let big = team_pod(
        "big2",
        json!({"vgpu.io/gpu": "2", "vgpu.io/gpu-memory": "20480"}),
    );
    let ans = inst.filter(&big, &["node-a"]).await;
    assert_eq!(
        ans["FailedAndUnresolvableNodes"]["node-a"],
        "quota policy team/gpu: container \"main\" asks 20480 MiB of GPU memory per GPU, above spec.limits.memory (16384 MiB)"
    );
    let mut ls = team_pod("ls", slices(1));
    ls["metadata"]["annotations"] = json!({ANNOTATION_PRIORITY: "latency-sensitive"});
    let ans = inst.filter(&ls, &["node-a"]).await;
    assert_eq!(
        ans["FailedAndUnresolvableNodes"]["node-a"],
        "quota policy team/gpu: vgpu.io/priority latency-sensitive is not allowed (spec.limits.priorityClasses: best-effort)"
    );
    // Another namespace is not bound by team's policy.
    let mut other = gpu_pod("free", "uid-free", slices(1));
    other["metadata"]["annotations"] = json!({ANNOTATION_PRIORITY: "latency-sensitive"});
    assert_eq!(
        inst.filter(&other, &["node-a"]).await["NodeNames"],
        json!(["node-a"])
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_show_each_namespaces_use_against_its_policy_totals() {
    // The fake API serves the extender while bound.
    let (_fake, inst) = team_with_one_pod_placed().await;
    let text = quota::metrics::render(inst.state());
    for line in [
        "vgpu_namespace_gpu_memory_used_bytes{namespace=\"team\"} 17179869184",
        "vgpu_namespace_gpu_compute_used_ratio{namespace=\"team\"} 0.5",
        "vgpu_namespace_gpus_used{namespace=\"team\"} 1",
        "vgpu_namespace_gpu_pods{namespace=\"team\"} 1",
        "vgpu_quota_policy_memory_total_bytes{namespace=\"team\",policy=\"gpu\"} 68719476736",
        "vgpu_quota_policy_compute_total_ratio{namespace=\"team\",policy=\"gpu\"} 1.5",
        "vgpu_quota_policy_total_gpus{namespace=\"team\",policy=\"gpu\"} 2",
        "vgpu_quota_policy_valid{namespace=\"team\",policy=\"gpu\"} 1",
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "{line} missing in:\n{text}"
        );
    }
    // Served at /metrics.
    assert_eq!(inst.served.get("/metrics").await, 200);
}

/// What a ResourceQuota `requests.vgpu.io/gpu: 20` admits at creation (20 slices) is
/// what `totals.computePercent: 200` admits at placement when pods give only slices:
/// the two can be set to the same figure and agree (docs/operations.md). The
/// ResourceQuota itself is the API server's (admission), which the fake does not run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slices_count_alike_in_a_resource_quota_and_a_compute_total() {
    let fake = FakeApi::start().await.expect("fake API");
    fake.put_node(gpu_node("node-a", 4, "A100", 81920));
    fake.put_quota_policy(policy("gpu", json!({"totals": {"computePercent": 200}})));
    let inst = Instance::start(&fake).await;
    policies_seen(&inst, 1, 0).await;
    let mut slices_placed = 0;
    for (i, n) in [5u32, 3, 7, 5].into_iter().enumerate() {
        let p = team_pod(&format!("p{i}"), slices(n));
        fake.put_pod(p.clone());
        inst.filter(&p, &["node-a"]).await;
        assert_eq!(inst.bind(&p, "node-a").await, "", "pod {i}");
        slices_placed += n;
    }
    assert_eq!(slices_placed, 20);
    let extra = team_pod("extra", slices(1));
    fake.put_pod(extra.clone());
    let ans = inst.filter(&extra, &["node-a"]).await;
    let reason = ans["FailedAndUnresolvableNodes"]["node-a"]
        .as_str()
        .unwrap_or_default();
    assert!(
        reason.contains(
            "namespace compute 200% in use + 10% asked > spec.totals.computePercent 200%"
        ),
        "{ans}"
    );
}
