//! Property tests of the extender's request decoding and of its state.
//!
//! - Whatever bytes arrive, every verb answers in its own form (filter and bind:
//!   JSON with `Error`; prioritize: a JSON list or an HTTP error) and never panics;
//!   so do truncated and mutated real kube-scheduler bodies.
//! - Whatever sequence of filters, binds, watch confirmations, deletions, failed
//!   binds and expiries happens, no GPU is ever granted more than it has, and the
//!   ledger's free capacity is exactly capacity minus what pods and assumptions hold.

use super::common;

use std::collections::HashMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::{Node, Pod};
use proptest::prelude::*;
use serde_json::{Value, json};
use vgpu_core::packing::PolicyName;
use vgpu_core::resources::{ANNOTATION_ASSIGNMENT, Assignment};
use vgpu_scheduler_extender::extender::policy::ExtenderPolicy;
use vgpu_scheduler_extender::extender::sync::WatchKind;
use vgpu_scheduler_extender::extender::types::{ExtenderBindingArgs, ExtenderFilterResult};
use vgpu_scheduler_extender::extender::{Extender, State, StateConfig};

use common::{fixture, gpu_node, gpu_pod, rewrite_resource};

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

fn extender(nodes: &[Value]) -> Extender {
    let state = Arc::new(State::new(
        StateConfig::default(),
        ExtenderPolicy::new(PolicyName::Vgpu),
    ));
    let nodes: Vec<Node> = nodes
        .iter()
        .map(|n| serde_json::from_value(n.clone()).expect("node"))
        .collect();
    state.replace_nodes(&nodes);
    state.replace_pods(&[]);
    state.mark_synced(WatchKind::Nodes);
    state.mark_synced(WatchKind::Pods);
    Extender::new(state, common::recording_binder())
}

fn check_answers(ext: &Extender, rt: &tokio::runtime::Runtime, body: &[u8]) {
    let (status, ans) = ext.filter(body);
    assert_eq!(status, 200);
    let parsed: ExtenderFilterResult = serde_json::from_slice(&ans).expect("filter answers JSON");
    assert!(parsed.error.is_empty() || (parsed.node_names.is_none() && parsed.nodes.is_none()));
    let (status, ans) = ext.prioritize(body);
    if status == 200 {
        let _: Vec<Value> = serde_json::from_slice(&ans).expect("prioritize answers a list");
    } else {
        assert!(status == 400 || status == 500, "{status}");
        assert!(!ans.is_empty());
    }
    let (status, ans) = rt.block_on(ext.bind(body));
    assert_eq!(status, 200);
    let v: Value = serde_json::from_slice(&ans).expect("bind answers JSON");
    assert!(v["Error"].is_string());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_get_well_formed_answers(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let ext = extender(&[gpu_node("n1", 2, "A100", 81920)]);
        check_answers(&ext, &runtime(), &bytes);
    }

    #[test]
    fn truncated_and_mutated_real_bodies_get_well_formed_answers(
        which in 0usize..3,
        cut in any::<prop::sample::Index>(),
        flip in any::<prop::sample::Index>(),
        byte in any::<u8>(),
    ) {
        let rel = ["extender-nodecache-false/001-filter-request.json",
                   "extender-nodecache-true/003-filter-request.json",
                   "extender-nodecache-true/002-bind-request.json"][which];
        let mut v = fixture(rel);
        rewrite_resource(&mut v);
        let mut bytes = serde_json::to_vec(&v).expect("json");
        let i = flip.index(bytes.len());
        bytes[i] = byte;
        let ext = extender(&[gpu_node("fake-gpu-node-a", 4, "A100", 81920)]);
        let rt = runtime();
        check_answers(&ext, &rt, &bytes);
        bytes.truncate(cut.index(bytes.len() + 1));
        check_answers(&ext, &rt, &bytes);
    }
}

/// One step of the random history.
#[derive(Debug, Clone)]
enum Op {
    /// Filter then bind pod `pod` (slices) on node `node`; `outcome`: 0 success and
    /// the watch confirms, 1 success without confirmation yet, 2 bind fails for good.
    Bind {
        pod: usize,
        slices: u32,
        node: usize,
        outcome: u8,
    },
    /// The watch shows pod `pod` deleted.
    Delete { pod: usize },
    /// The watch shows pod `pod` failed.
    Fail { pod: usize },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0usize..12, prop::sample::select(vec![1u32, 2, 3, 5, 7, 10, 20]), 0usize..2, 0u8..3)
            .prop_map(|(pod, slices, node, outcome)| Op::Bind { pod, slices, node, outcome }),
        1 => (0usize..12).prop_map(|pod| Op::Delete { pod }),
        1 => (0usize..12).prop_map(|pod| Op::Fail { pod }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn no_history_over_assigns_a_gpu(ops in proptest::collection::vec(op(), 1..40)) {
        let nodes = ["n0", "n1"];
        let ext = extender(&[gpu_node("n0", 2, "A100", 81920), gpu_node("n1", 2, "A100", 81920)]);
        let state = ext.state().clone();
        // What the API server holds: pod uid → (pod JSON, bound record if any).
        let mut api: HashMap<String, Value> = HashMap::new();
        // Pods whose GPUs are held by a live assumption (bound, not yet confirmed).
        let mut held: HashMap<String, Assignment> = HashMap::new();
        let mut generation = 0;
        for op in ops {
            match op {
                Op::Bind { pod, slices, node, outcome } => {
                    generation += 1;
                    let uid = format!("uid-{pod}-{generation}");
                    let name = format!("p{pod}-{generation}");
                    let p = gpu_pod(&name, &uid, json!({"vgpu.io/gpu": slices.to_string()}));
                    state.apply_pod(&serde_json::from_value::<Pod>(p.clone()).expect("pod"));
                    let (_, ans) = ext.filter(&serde_json::to_vec(&json!({"Pod": p, "NodeNames": nodes})).expect("json"));
                    let ans: Value = serde_json::from_slice(&ans).expect("json");
                    let node_name = nodes[node];
                    let args = ExtenderBindingArgs {
                        pod_name: name.clone(),
                        pod_namespace: "default".into(),
                        pod_uid: uid.clone(),
                        node: node_name.into(),
                    };
                    let begun = state.begin_bind(&args);
                    let feasible = ans["NodeNames"].as_array().is_some_and(|l| l.iter().any(|n| n == node_name));
                    // Bind succeeds exactly when filter (same snapshot, nothing in between) said it fits.
                    prop_assert_eq!(begun.is_ok(), feasible, "{:?} vs {}", begun, ans);
                    let Ok(plan) = begun else { api.insert(uid, p); continue };
                    match outcome {
                        0 => {
                            state.finish_bind(&uid);
                            let mut bound = p.clone();
                            bound["metadata"]["annotations"] = json!({ANNOTATION_ASSIGNMENT: plan.assignment_json});
                            bound["spec"]["nodeName"] = json!(node_name);
                            bound["status"]["phase"] = json!("Running");
                            state.apply_pod(&serde_json::from_value::<Pod>(bound.clone()).expect("pod"));
                            api.insert(uid, bound);
                        }
                        1 => {
                            state.finish_bind(&uid);
                            held.insert(uid.clone(), Assignment::from_json(&plan.assignment_json).expect("record"));
                            api.insert(uid, p);
                        }
                        _ => {
                            state.abort_bind(&uid, false);
                            api.insert(uid, p);
                        }
                    }
                }
                Op::Delete { pod } | Op::Fail { pod } => {
                    let prefix = format!("uid-{pod}-");
                    let victims: Vec<String> = api.keys().filter(|u| u.starts_with(&prefix)).cloned().collect();
                    for uid in victims {
                        let mut p = api.remove(&uid).expect("present");
                        held.remove(&uid);
                        let pod: Pod = if matches!(op, Op::Delete { .. }) {
                            serde_json::from_value(p).expect("pod")
                        } else {
                            p["status"]["phase"] = json!("Failed");
                            let f: Pod = serde_json::from_value(p).expect("pod");
                            state.apply_pod(&f);
                            continue;
                        };
                        state.delete_pod(&pod);
                    }
                }
            }
            // Invariant: per GPU, what bound pods and held assumptions were granted fits,
            // and the ledger's free compute is exactly the rest.
            let mut used: HashMap<String, (u32, u64, u32)> = HashMap::new();
            let records = api
                .values()
                .filter(|p| p["status"]["phase"] != "Failed" && !p["spec"]["nodeName"].is_null())
                .map(|p| Assignment::from_json(p["metadata"]["annotations"][ANNOTATION_ASSIGNMENT].as_str().expect("record")).expect("valid"))
                .chain(held.values().cloned());
            for a in records {
                for g in a.containers.iter().flat_map(|c| c.gpus.iter()) {
                    let e = used.entry(g.uuid.clone()).or_default();
                    e.0 += g.compute_milli;
                    e.1 += g.memory_mib;
                    e.2 += g.slices;
                }
            }
            for (uuid, (milli, mem, sl)) in &used {
                // Quotas plus a context per slice fit the GPU (ADR 0012).
                let contexts = 10 * vgpu_core::packing::context::DEFAULT_CONTEXT_MIB;
                prop_assert!(*milli <= 1000 && *mem + contexts <= 81920 && *sl <= 10, "{} over-assigned: {:?}", uuid, (milli, mem, sl));
            }
            for n in nodes {
                let free = state.gpu_milli_free(n).expect("node");
                for (i, f) in free.iter().enumerate() {
                    let uuid = format!("GPU-{n}-{i}");
                    let u = used.get(&uuid).map_or(0, |e| e.0);
                    prop_assert_eq!(*f + u, 1000, "{} free {} used {}", uuid, f, u);
                }
            }
        }
    }
}
