//! The extender's kube-rs side against a scripted fake API server speaking real
//! HTTP JSON: watches feed the state, bind writes the assignment once and then the
//! Binding, assumptions expire, a restarted extender rebuilds its ledger, and
//! concurrent binds never double-assign a GPU. Every wait has a deadline.

use super::common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};
use tokio::task::JoinHandle;
use vgpu_core::packing::PolicyName;
use vgpu_core::resources::{ANNOTATION_ASSIGNMENT, Assignment};
use vgpu_scheduler_extender::extender::binder::KubeBinder;
use vgpu_scheduler_extender::extender::policy::ExtenderPolicy;
use vgpu_scheduler_extender::extender::sync::{self, SyncConfig};
use vgpu_scheduler_extender::extender::{Extender, State, StateConfig};

use common::{Served, gpu_node, gpu_pod};
use vgpu_testkit::fake_api::FakeApi;

const DEADLINE: Duration = Duration::from_secs(10);

/// One extender instance: state, watches, HTTP server, real kube binder.
struct Instance {
    served: Served,
    sync: JoinHandle<()>,
}

impl Instance {
    async fn start(fake: &FakeApi, config: StateConfig) -> Self {
        let client = fake.client().expect("client");
        let state = Arc::new(State::new(config, ExtenderPolicy::new(PolicyName::Vgpu)));
        let sync = tokio::spawn(sync::run(
            client.clone(),
            state.clone(),
            SyncConfig {
                page_size: 500,
                sweep_interval: Duration::from_millis(50),
            },
        ));
        let served = Served::start(Extender::new(state, Arc::new(KubeBinder::new(client)))).await;
        let inst = Instance { served, sync };
        inst.eventually("state synced", || inst.state().is_synced())
            .await;
        inst
    }

    fn state(&self) -> &Arc<State> {
        self.served.extender.state()
    }

    /// Polls `cond` until it holds; fails the test after [`DEADLINE`].
    async fn eventually(&self, what: &str, cond: impl Fn() -> bool) {
        let end = tokio::time::Instant::now() + DEADLINE;
        while !cond() {
            assert!(
                tokio::time::Instant::now() < end,
                "timed out after {DEADLINE:?} waiting for {what}; stats {:?}",
                self.state().stats()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    async fn filter(&self, pod: &Value, nodes: &[&str]) -> Value {
        let (status, ans) = self
            .served
            .post_json(
                "/scheduler/filter",
                &json!({"Pod": pod, "Nodes": null, "NodeNames": nodes}),
            )
            .await;
        assert_eq!(status, 200);
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
        assert_eq!(status, 200);
        ans["Error"].as_str().expect("Error field").to_string()
    }

    fn stop(self) {
        self.sync.abort();
    }
}

fn total_free(inst: &Instance, node: &str) -> u64 {
    inst.state()
        .gpu_milli_free(node)
        .expect("node known")
        .iter()
        .map(|&m| u64::from(m))
        .sum()
}

fn slices(n: u32) -> Value {
    json!({"cpu": "100m", "vgpu.io/gpu": n.to_string()})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bind_writes_the_assignment_once_then_the_binding_and_the_watch_confirms() {
    let fake = FakeApi::start().await.expect("fake API");
    fake.put_node(gpu_node("node-a", 2, "A100", 81920));
    fake.put_node(gpu_node("node-b", 2, "A100", 81920));
    let inst = Instance::start(&fake, StateConfig::default()).await;
    let pod = gpu_pod("p1", "uid-p1", slices(3));
    fake.put_pod(pod.clone());
    inst.eventually("pod seen", || inst.state().stats().pods == 1)
        .await;

    let ans = inst.filter(&pod, &["node-a", "node-b"]).await;
    assert_eq!(ans["NodeNames"], json!(["node-a", "node-b"]));
    assert_eq!(inst.bind(&pod, "node-b").await, "");

    // Exactly one PATCH (UID-preconditioned merge patch of the annotation), then
    // exactly one Binding with the pod's UID, in that order.
    let writes: Vec<_> = fake
        .calls()
        .into_iter()
        .filter(|c| c.method != "GET")
        .collect();
    assert_eq!(writes.len(), 2, "{writes:#?}");
    assert_eq!(writes[0].method, "PATCH");
    assert_eq!(writes[0].path, "/api/v1/namespaces/default/pods/p1");
    assert_eq!(writes[0].body["metadata"]["uid"], "uid-p1");
    let record = writes[0].body["metadata"]["annotations"][ANNOTATION_ASSIGNMENT]
        .as_str()
        .expect("annotation");
    let a = Assignment::from_json(record).expect("valid record");
    assert_eq!(a.node, "node-b");
    assert_eq!(a.containers[0].gpus[0].compute_milli, 300);
    assert_eq!(writes[1].method, "POST");
    assert_eq!(writes[1].path, "/api/v1/namespaces/default/pods/p1/binding");
    assert_eq!(writes[1].body["metadata"]["uid"], "uid-p1");
    assert_eq!(
        writes[1].body["target"],
        json!({"apiVersion": "v1", "kind": "Node", "name": "node-b"})
    );

    // The API now holds the pod bound with its record; the watch turns the
    // assumption into a counted pod.
    let stored = fake.pod("default", "p1").expect("pod");
    assert_eq!(stored["spec"]["nodeName"], "node-b");
    assert_eq!(
        stored["metadata"]["annotations"][ANNOTATION_ASSIGNMENT],
        record
    );
    inst.eventually("assumption confirmed by the watch", || {
        let s = inst.state().stats();
        s.assumptions == 0 && s.placed == 1
    })
    .await;
    assert_eq!(total_free(&inst, "node-b"), 2000 - 300);

    // A bind retried after it landed succeeds without writing anything again.
    assert_eq!(inst.bind(&pod, "node-b").await, "");
    assert_eq!(fake.calls().iter().filter(|c| c.method != "GET").count(), 2);
    assert_eq!(total_free(&inst, "node-b"), 2000 - 300);
    inst.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleted_and_failed_pods_release_their_gpus() {
    let fake = FakeApi::start().await.expect("fake API");
    fake.put_node(gpu_node("node-a", 1, "A100", 81920));
    let inst = Instance::start(&fake, StateConfig::default()).await;
    for (name, uid) in [("p1", "uid-1"), ("p2", "uid-2")] {
        let pod = gpu_pod(name, uid, slices(5));
        fake.put_pod(pod.clone());
        inst.eventually("pod seen", || {
            inst.state().gpu_milli_free("node-a").is_some()
        })
        .await;
        inst.filter(&pod, &["node-a"]).await;
        assert_eq!(inst.bind(&pod, "node-a").await, "");
    }
    inst.eventually("both placed", || {
        inst.state().stats().placed == 2 && inst.state().stats().assumptions == 0
    })
    .await;
    assert_eq!(total_free(&inst, "node-a"), 0);
    // A third pod does not fit: the precise reason.
    let p3 = gpu_pod("p3", "uid-3", slices(5));
    let ans = inst.filter(&p3, &["node-a"]).await;
    assert_eq!(
        ans["FailedNodes"]["node-a"], "GPU compute: max free 0.000 GPU < 0.500 GPU",
        "{ans}"
    );

    fake.delete_pod("default", "p1");
    inst.eventually("deletion releases", || total_free(&inst, "node-a") == 500)
        .await;
    fake.set_pod_phase("default", "p2", "Failed");
    inst.eventually("failure releases", || total_free(&inst, "node-a") == 1000)
        .await;
    let ans = inst.filter(&p3, &["node-a"]).await;
    assert_eq!(ans["NodeNames"], json!(["node-a"]));
    inst.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_assumption_the_watch_never_confirms_expires_after_its_ttl() {
    let fake = FakeApi::start().await.expect("fake API");
    fake.put_node(gpu_node("node-a", 1, "A100", 81920));
    let ttl = Duration::from_millis(400);
    let inst = Instance::start(
        &fake,
        StateConfig {
            assume_ttl: ttl,
            ..StateConfig::default()
        },
    )
    .await;
    let pod = gpu_pod("p1", "uid-1", slices(10));
    fake.put_pod(pod.clone());
    inst.eventually("pod seen", || inst.state().stats().pods == 1)
        .await;
    inst.filter(&pod, &["node-a"]).await;
    // The API server says 201 but the pod never shows up bound.
    fake.lose_next_bindings(1);
    let started = tokio::time::Instant::now();
    assert_eq!(inst.bind(&pod, "node-a").await, "");
    // Held: the GPU is taken for another pod meanwhile.
    let other = gpu_pod("p2", "uid-2", slices(1));
    let ans = inst.filter(&other, &["node-a"]).await;
    assert!(ans["FailedNodes"]["node-a"].as_str().is_some(), "{ans}");
    assert_eq!(inst.state().stats().assumptions, 1);
    // Released after the TTL (plus a sweep), not before.
    inst.eventually("assumption expired", || {
        inst.state().stats().assumptions == 0
    })
    .await;
    assert!(
        started.elapsed() >= ttl,
        "released after {:?} < TTL {ttl:?}",
        started.elapsed()
    );
    assert_eq!(total_free(&inst, "node-a"), 1000);
    let ans = inst.filter(&other, &["node-a"]).await;
    assert_eq!(ans["NodeNames"], json!(["node-a"]));
    inst.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_binds_release_at_once_unless_the_outcome_is_uncertain() {
    let fake = FakeApi::start().await.expect("fake API");
    fake.put_node(gpu_node("node-a", 1, "A100", 81920));
    let inst = Instance::start(
        &fake,
        StateConfig {
            assume_ttl: Duration::from_secs(3600),
            ..StateConfig::default()
        },
    )
    .await;
    let pod = gpu_pod("p1", "uid-1", slices(10));
    fake.put_pod(pod.clone());
    inst.eventually("pod seen", || inst.state().stats().pods == 1)
        .await;
    inst.filter(&pod, &["node-a"]).await;

    // A definite refusal (422 Invalid): the GPU is free again at once.
    fake.fail_next_bindings(&[422]);
    let err = inst.bind(&pod, "node-a").await;
    assert!(
        err.starts_with("create binding of pod default/p1 to node node-a: "),
        "{err}"
    );
    assert_eq!(inst.state().stats().assumptions, 0);
    assert_eq!(total_free(&inst, "node-a"), 1000);

    // A failed annotation write: nothing bound, GPU free, no Binding attempted.
    fake.fail_next_patches(&[422]);
    let err = inst.bind(&pod, "node-a").await;
    assert!(
        err.starts_with("record GPU assignment on pod default/p1: "),
        "{err}"
    );
    assert_eq!(total_free(&inst, "node-a"), 1000);
    assert_eq!(fake.calls_matching("POST", "/binding").len(), 1);

    // A server error may have taken effect: the GPU stays held (until the TTL or
    // the watch). (503 and 504 kube-rs retries by itself; 500 it does not.)
    fake.fail_next_bindings(&[500]);
    let err = inst.bind(&pod, "node-a").await;
    assert!(err.contains("create binding"), "{err}");
    assert_eq!(inst.state().stats().assumptions, 1);
    assert_eq!(total_free(&inst, "node-a"), 0);

    // kube-scheduler retries the bind: the same decision is reused, and this time it lands.
    assert_eq!(inst.bind(&pod, "node-a").await, "");
    inst.eventually("confirmed", || {
        inst.state().stats().assumptions == 0 && inst.state().stats().placed == 1
    })
    .await;
    let patches = fake.calls_matching("PATCH", "/pods/p1");
    let records: Vec<&Value> = patches
        .iter()
        .map(|c| &c.body["metadata"]["annotations"][ANNOTATION_ASSIGNMENT])
        .collect();
    assert_eq!(
        records.first(),
        records.last(),
        "a retry writes the same record"
    );
    inst.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_extender_rebuilds_the_same_ledger_from_the_api() {
    let fake = FakeApi::start().await.expect("fake API");
    for n in ["node-a", "node-b", "node-c"] {
        fake.put_node(gpu_node(n, 4, "A100", 81920));
    }
    let first = Instance::start(&fake, StateConfig::default()).await;
    let shapes = [3, 10, 5, 2, 20, 7, 1, 4, 10, 6];
    for (i, s) in shapes.iter().enumerate() {
        let pod = gpu_pod(&format!("p{i}"), &format!("uid-{i}"), slices(*s));
        fake.put_pod(pod.clone());
        first
            .eventually("pod seen", || first.state().stats().pods == i + 1)
            .await;
        let ans = first.filter(&pod, &["node-a", "node-b", "node-c"]).await;
        let feasible: Vec<String> =
            serde_json::from_value(ans["NodeNames"].clone()).expect("names");
        let (_, prio) = first
            .served
            .post_json(
                "/scheduler/prioritize",
                &json!({"Pod": pod, "Nodes": null, "NodeNames": feasible}),
            )
            .await;
        let best = prio
            .as_array()
            .and_then(|l| l.iter().max_by_key(|h| h["Score"].as_i64()))
            .and_then(|h| h["Host"].as_str())
            .expect("a node")
            .to_string();
        assert_eq!(first.bind(&pod, &best).await, "");
    }
    first
        .eventually("all confirmed", || {
            let s = first.state().stats();
            s.placed == shapes.len() && s.assumptions == 0
        })
        .await;
    let before: HashMap<&str, Vec<u32>> = ["node-a", "node-b", "node-c"]
        .into_iter()
        .map(|n| (n, first.state().gpu_milli_free(n).expect("node")))
        .collect();
    first.stop();

    // A new process: nothing in memory, everything from list + watch.
    let second = Instance::start(&fake, StateConfig::default()).await;
    assert_eq!(second.state().stats().placed, shapes.len());
    for (n, free) in &before {
        assert_eq!(
            &second.state().gpu_milli_free(n).expect("node"),
            free,
            "{n}"
        );
    }
    let used: u64 = shapes.iter().map(|s| u64::from(*s) * 100).sum();
    let free: u64 = ["node-a", "node-b", "node-c"]
        .iter()
        .map(|n| total_free(&second, n))
        .sum();
    assert_eq!(free, 12_000 - used);
    second.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_binds_never_double_assign_a_gpu() {
    let fake = FakeApi::start().await.expect("fake API");
    fake.put_node(gpu_node("node-a", 2, "A100", 81920));
    // Binds overlap in flight at the API server.
    fake.set_binding_delay(Duration::from_millis(20));
    let inst = Arc::new(Instance::start(&fake, StateConfig::default()).await);
    // 30 pods of 0.3 GPU: three fit per GPU, so six in all.
    let pods: Vec<Value> = (0..30)
        .map(|i| gpu_pod(&format!("p{i}"), &format!("uid-{i}"), slices(3)))
        .collect();
    for p in &pods {
        fake.put_pod(p.clone());
    }
    inst.eventually("pods seen", || inst.state().stats().pods == pods.len())
        .await;
    // Every filter passes (the node is empty): the race is entirely at bind.
    for p in &pods {
        let ans = inst.filter(p, &["node-a"]).await;
        assert_eq!(ans["NodeNames"], json!(["node-a"]));
    }
    let mut tasks = Vec::new();
    for p in pods.clone() {
        let inst = inst.clone();
        tasks.push(tokio::spawn(async move { inst.bind(&p, "node-a").await }));
    }
    let mut ok = 0;
    for t in tasks {
        let err = tokio::time::timeout(DEADLINE, t)
            .await
            .expect("bind answers in time")
            .expect("task");
        if err.is_empty() {
            ok += 1;
        } else {
            assert!(err.contains("no longer fits"), "{err}");
        }
    }
    assert_eq!(ok, 6, "exactly the capacity is granted");
    // What the API server holds: per GPU, the bound pods' grants never exceed it.
    let mut per_gpu: HashMap<String, (u32, u32)> = HashMap::new();
    let mut bound = 0;
    for pod in fake.pods() {
        if pod["spec"]["nodeName"].is_null() {
            continue;
        }
        bound += 1;
        let record = pod["metadata"]["annotations"][ANNOTATION_ASSIGNMENT]
            .as_str()
            .expect("record");
        for g in &Assignment::from_json(record).expect("valid").containers[0].gpus {
            let e = per_gpu.entry(g.uuid.clone()).or_default();
            e.0 += g.compute_milli;
            e.1 += g.slices;
        }
    }
    assert_eq!(bound, 6);
    assert_eq!(per_gpu.len(), 2);
    for (uuid, (milli, sl)) in &per_gpu {
        assert!(
            *milli <= 1000 && *sl <= 10,
            "{uuid} over-assigned: {milli} milli, {sl} slices"
        );
    }
    inst.eventually("ledger matches the API", || {
        let s = inst.state().stats();
        s.placed == 6 && s.assumptions == 0
    })
    .await;
    assert_eq!(total_free(&inst, "node-a"), 2000 - 1800);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_plugin_is_unregistered_takes_no_pods_but_keeps_its_ledger() {
    let fake = FakeApi::start().await.expect("fake API");
    fake.put_node(gpu_node("node-a", 1, "A100", 81920));
    let inst = Instance::start(&fake, StateConfig::default()).await;
    let p1 = gpu_pod("p1", "uid-1", slices(4));
    fake.put_pod(p1.clone());
    inst.eventually("pod seen", || inst.state().stats().pods == 1)
        .await;
    inst.filter(&p1, &["node-a"]).await;
    assert_eq!(inst.bind(&p1, "node-a").await, "");
    inst.eventually("confirmed", || inst.state().stats().assumptions == 0)
        .await;
    assert_eq!(total_free(&inst, "node-a"), 600);

    // Kubelet restarted: the node reports 0 vgpu.io/gpu until the plugin registers.
    let mut node = gpu_node("node-a", 1, "A100", 81920);
    node["status"]["allocatable"]["vgpu.io/gpu"] = json!("0");
    fake.put_node(node);
    let p2 = gpu_pod("p2", "uid-2", slices(1));
    let reason = "node advertises no vgpu.io/gpu (device plugin not registered with kubelet)";
    let end = tokio::time::Instant::now() + DEADLINE;
    loop {
        let ans = inst.filter(&p2, &["node-a"]).await;
        if ans["FailedAndUnresolvableNodes"]["node-a"] == reason {
            break;
        }
        assert!(
            tokio::time::Instant::now() < end,
            "never unavailable: {ans}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Its pods stay accounted meanwhile.
    assert_eq!(total_free(&inst, "node-a"), 600);
    assert_eq!(inst.state().stats().placed, 1);

    // Registered again: schedulable, with p1 still counted.
    fake.put_node(gpu_node("node-a", 1, "A100", 81920));
    let end = tokio::time::Instant::now() + DEADLINE;
    loop {
        let ans = inst.filter(&p2, &["node-a"]).await;
        if ans["NodeNames"] == json!(["node-a"]) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < end,
            "never available again: {ans}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(total_free(&inst, "node-a"), 600);
    inst.stop();
}
