//! The live extender decides exactly as the policy core (and so the replay) does:
//! over HTTP, the nodes prioritize scores 10 are exactly the nodes the core's
//! ranking puts first, among them the node `Scheduler::choose` takes, and bind on
//! that node grants the GPU(s) `choose` grants. Checked in lockstep over a sequence
//! of pods for every deterministic policy; `random` is checked to draw afresh.

use super::common;

use std::collections::BTreeSet;
use std::sync::Arc;

use common::Served;
use k8s_openapi::api::core::v1::Pod;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use vgpu_core::packing::{Ledger, PolicyName, Scheduler, Task};
use vgpu_core::resources::ANNOTATION_ASSIGNMENT;
use vgpu_scheduler_extender::extender::api_objects::pod_task;
use vgpu_scheduler_extender::extender::policy::ExtenderPolicy;
use vgpu_scheduler_extender::extender::{Extender, State, StateConfig};

/// Sixteen nodes: twelve of 8 A100s, four of 4 L4s. With `topology`, their inventories
/// carry it: the A100 nodes alternate between an NVLink hybrid cube mesh (quads 0–3,
/// 4–7, and i ↔ i+4) and a PCIe server (two GPUs per switch, four per socket); the L4
/// nodes have two GPUs per socket on a host bridge.
fn nodes(topology: bool) -> Vec<Value> {
    (0..16)
        .map(|i| {
            let mut node = if i % 4 == 3 {
                common::gpu_node(&format!("node-{i}"), 4, "L4", 23_034)
            } else {
                common::gpu_node(&format!("node-{i}"), 8, "A100", 81_920)
            };
            if topology {
                add_topology(&mut node, i % 2 == 0);
            }
            node
        })
        .collect()
}

fn add_topology(node: &mut Value, nvlink: bool) {
    let key = vgpu_core::inventory::ANNOTATION_GPU_INVENTORY;
    let text = node["metadata"]["annotations"][key]
        .as_str()
        .expect("inventory")
        .to_string();
    let mut inv: Value = serde_json::from_str(&text).expect("inventory json");
    let gpus = inv["gpus"].as_array_mut().expect("gpus");
    let n = gpus.len() as u64;
    for (i, g) in gpus.iter_mut().enumerate() {
        let i = i as u64;
        g["topology"] = if n == 4 {
            json!({"numa_node": i / 2})
        } else if nvlink {
            let quad = i / 4 * 4;
            let mut peers: Vec<Value> = (quad..quad + 4)
                .filter(|&j| j != i)
                .map(|j| json!({"index": j, "links": 1 + (i + j) % 2}))
                .collect();
            peers.push(json!({"index": (i + 4) % 8, "links": 2}));
            json!({"numa_node": i / 4, "switch_peers": [i ^ 1], "nvlink_peers": peers})
        } else {
            json!({"numa_node": i / 4, "switch_peers": [i ^ 1]})
        };
    }
    node["metadata"]["annotations"][key] = json!(inv.to_string());
}

/// A pod of a random shape: shares of 0.1–0.9 GPU (some with a memory request),
/// one or two whole GPUs, some asking for a model; with `multi`, also whole sets of
/// 2–4 GPUs and shares spread over 2–4 GPUs.
fn random_pod(k: usize, rng: &mut StdRng, multi: bool) -> Value {
    let roll: f64 = rng.random();
    let requests = if multi && roll < 0.15 {
        let count = rng.random_range(2..=4);
        json!({"vgpu.io/gpu": (count * rng.random_range(2..=6)).to_string(), "vgpu.io/gpu-count": count.to_string()})
    } else if multi && roll < 0.25 {
        json!({"vgpu.io/gpu": (10 * rng.random_range(2..=4)).to_string()})
    } else if roll < 0.6 {
        json!({"vgpu.io/gpu": rng.random_range(1..=9).to_string()})
    } else if roll < 0.75 {
        json!({"vgpu.io/gpu": "2", "vgpu.io/gpu-memory": rng.random_range(1024..=20_000).to_string()})
    } else if roll < 0.92 {
        json!({"vgpu.io/gpu": "10"})
    } else {
        json!({"vgpu.io/gpu": "20"})
    };
    let mut pod = common::gpu_pod(&format!("p{k}"), &format!("uid-p{k}"), requests);
    if rng.random_bool(0.15) {
        pod["metadata"]["annotations"] = json!({"vgpu.io/gpu-model": "A100"});
    }
    pod
}

fn bound(mut pod: Value, node: &str, assignment_json: &str) -> Pod {
    let annotations = pod["metadata"]["annotations"]
        .as_object_mut()
        .map(std::mem::take)
        .unwrap_or_default();
    let mut annotations = Value::Object(annotations);
    annotations[ANNOTATION_ASSIGNMENT] = json!(assignment_json);
    pod["metadata"]["annotations"] = annotations;
    pod["spec"]["nodeName"] = json!(node);
    pod["status"]["phase"] = json!("Running");
    serde_json::from_value(pod).expect("pod")
}

fn names(ledger: &Ledger) -> Vec<String> {
    ledger.nodes().iter().map(|n| n.spec.name.clone()).collect()
}

/// The extender's filter then prioritize for `pod` over every node: the names that
/// scored 10, or `None` when filter kept no node.
async fn ten_scored(served: &Served, pod: &Value, all: &[String]) -> Option<BTreeSet<String>> {
    let (status, ans) = served
        .post_json("/scheduler/filter", &json!({"Pod": pod, "NodeNames": all}))
        .await;
    assert_eq!(status, 200, "{ans}");
    assert_eq!(ans["Error"], "", "{ans}");
    let feasible = ans["NodeNames"].as_array().cloned().unwrap_or_default();
    if feasible.is_empty() {
        return None;
    }
    let (status, ans) = served
        .post_json(
            "/scheduler/prioritize",
            &json!({"Pod": pod, "NodeNames": feasible}),
        )
        .await;
    assert_eq!(status, 200, "{ans}");
    Some(
        ans.as_array()
            .expect("HostPriorityList")
            .iter()
            .filter(|h| h["Score"] == 10)
            .map(|h| h["Host"].as_str().expect("host").to_string())
            .collect(),
    )
}

/// An extender with `warm` pods already placed (by its own bind) and its policy
/// restarted over that workload, as after a restart.
async fn warmed_up(
    policy: PolicyName,
    warm: usize,
    rng: &mut StdRng,
    topology: bool,
) -> (Served, Arc<State>) {
    let state = common::synced_state(StateConfig::default(), policy, nodes(topology));
    let binder = common::recording_binder();
    let served = Served::start(Extender::new(state.clone(), binder.clone())).await;
    let all: Vec<String> = names(&state.snapshot().0);
    let mut pods = Vec::new();
    for k in 0..warm {
        let pod = random_pod(100_000 + k, rng, topology);
        let Some(ten) = ten_scored(&served, &pod, &all).await else {
            continue;
        };
        let node = ten.iter().next().expect("a best node").clone();
        let (_, ans) = served
            .post_json(
                "/scheduler/bind",
                &json!({"PodName": pod["metadata"]["name"], "PodNamespace": "default",
                        "PodUID": pod["metadata"]["uid"], "Node": node}),
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
        pods.push(bound(pod, &node, &plan.assignment_json));
    }
    // The watch's list: the ledger is rebuilt and the policy restarted with the
    // typical tasks of these pods.
    state.replace_pods(&pods);
    (served, state)
}

async fn lockstep(policy: PolicyName, seed: u64) {
    lockstep_on(policy, seed, false).await;
}

/// `lockstep`; with `topology`, on nodes that publish their topology and with
/// multi-GPU pods, also checking that every multi-GPU container got the best-connected
/// set its node had free.
async fn lockstep_on(policy: PolicyName, seed: u64, topology: bool) {
    let mut rng = StdRng::seed_from_u64(seed);
    let (served, state) = warmed_up(policy, 60, &mut rng, topology).await;
    let (mut ledger, workload) = state.snapshot();
    assert_eq!(
        ledger.nodes().iter().all(|n| n.spec.topology.is_known()),
        topology,
        "the extender reads the inventory's topology"
    );
    let tasks: Vec<&Task> = workload.iter().collect();
    let all = names(&ledger);
    let mut core = Scheduler::new(
        ExtenderPolicy::build(policy, &ledger, &tasks),
        (0..all.len()).collect(),
    );
    let mut decided = 0;
    // Decisions where the live key (not the cached score alone) narrowed the best nodes.
    let mut live_decided = 0;
    // Multi-GPU containers placed, and those whose set had a worse class available.
    let mut multi = 0;
    for k in 0..120 {
        let pod = random_pod(k, &mut rng, topology);
        let task = pod_task(&serde_json::from_value(pod.clone()).expect("pod")).expect("task");
        let choice = core.choose(&ledger, &task);
        let ten = ten_scored(&served, &pod, &all).await;
        let (choice, ten) = match (choice, ten) {
            (Some(c), Some(t)) => (c, t),
            (None, None) => continue,
            (c, t) => panic!(
                "{policy} pod {k}: the core ({c:?}) and the extender ({t:?}) disagree on whether it fits"
            ),
        };
        // The nodes scored 10 are exactly those the core ranks first.
        let ranks = core.rank(
            &ledger,
            &task,
            &(0..all.len()).map(Some).collect::<Vec<_>>(),
        );
        let best = ranks.iter().flatten().map(|r| r.key()).max();
        let first: BTreeSet<String> = ranks
            .iter()
            .enumerate()
            .filter(|(_, r)| r.is_some_and(|r| Some(r.key()) == best))
            .map(|(i, _)| all[i].clone())
            .collect();
        assert_eq!(
            ten, first,
            "{policy} pod {k}: prioritize's 10s are the core's best"
        );
        let top = ranks.iter().flatten().map(|r| r.score).max();
        let top_score = ranks
            .iter()
            .filter(|r| r.is_some_and(|r| Some(r.score) == top))
            .count();
        if first.len() < top_score {
            live_decided += 1;
        }
        let node = all[choice.node].clone();
        assert!(
            ten.contains(&node),
            "{policy} pod {k}: the core's choice scores 10"
        );
        // Bind there grants exactly the core's GPUs.
        let (_, ans) = served
            .post_json(
                "/scheduler/bind",
                &json!({"PodName": format!("p{k}"), "PodNamespace": "default",
                        "PodUID": format!("uid-p{k}"), "Node": node}),
            )
            .await;
        assert_eq!(ans, json!({"Error": ""}), "{policy} pod {k}");
        let record = served
            .extender
            .state()
            .snapshot()
            .0
            .placement(&format!("uid-p{k}"))
            .cloned()
            .expect("bind placed the pod");
        assert_eq!(
            record, choice,
            "{policy} pod {k}: bind grants the core's GPUs"
        );
        if topology {
            let node = ledger.node(choice.node);
            for (grants, demand) in choice.containers.iter().zip(&task.gpus) {
                if grants.len() < 2 {
                    continue;
                }
                multi += 1;
                let set: Vec<u32> = grants.iter().map(|g| u32::from(g.gpu)).collect();
                let eligible: Vec<u32> = (0..node.gpus.len())
                    .filter(|&i| {
                        if demand.is_whole() {
                            node.gpu_fully_free(i)
                        } else {
                            node.share_fits(i, demand)
                        }
                    })
                    .map(|i| i as u32)
                    .collect();
                assert_eq!(
                    node.spec.topology.set_class(&set),
                    node.spec.topology.best_class(&eligible, set.len()),
                    "{policy} pod {k}: GPUs {set:?} of {} are not the best set of {eligible:?}",
                    node.spec.name
                );
            }
        }
        ledger
            .commit(&format!("uid-p{k}"), &task, choice)
            .expect("the core's choice commits");
        decided += 1;
    }
    // Multi-GPU pods fill the cluster sooner: the later ones check that both refuse.
    let enough = if topology { 40 } else { 80 };
    assert!(decided > enough, "{policy}: only {decided} pods placed");
    if topology {
        assert!(
            multi >= 10,
            "{policy}: only {multi} multi-GPU containers placed"
        );
    }
    if policy == PolicyName::Vgpu {
        assert!(
            live_decided > 0,
            "the sum-of-squares key never mattered: the test would not see it missing"
        );
    }
    eprintln!("{policy}: {decided} pods, live key decided {live_decided}");
    // Both ledgers ended in the same state, GPU by GPU.
    for name in &all {
        let i = ledger.node_index(name).expect("node");
        let core_free: Vec<u32> = ledger.node(i).gpus.iter().map(|g| g.milli).collect();
        assert_eq!(
            state.gpu_milli_free(name),
            Some(core_free),
            "{policy} {name}"
        );
    }
}

#[tokio::test]
async fn prioritize_and_bind_follow_the_core_policy_vgpu() {
    lockstep(PolicyName::Vgpu, 1).await;
    lockstep(PolicyName::Vgpu, 2).await;
}

#[tokio::test]
async fn prioritize_and_bind_follow_the_core_policy_with_topology() {
    lockstep_on(PolicyName::Vgpu, 5, true).await;
    lockstep_on(PolicyName::Fgd, 6, true).await;
}

#[tokio::test]
async fn prioritize_and_bind_follow_the_core_policy_baselines() {
    for policy in [
        PolicyName::Fgd,
        PolicyName::BestFit,
        PolicyName::GpuPacking,
        PolicyName::Spread,
    ] {
        lockstep(policy, 3).await;
    }
}

#[tokio::test]
async fn random_draws_a_fresh_node_per_decision() {
    let mut rng = StdRng::seed_from_u64(4);
    let (served, state) = warmed_up(PolicyName::Random, 20, &mut rng, false).await;
    let all = names(&state.snapshot().0);
    let pod = common::gpu_pod("r", "uid-r", json!({"vgpu.io/gpu": "1"}));
    let mut winners = BTreeSet::new();
    for _ in 0..40 {
        let ten = ten_scored(&served, &pod, &all).await.expect("fits");
        assert_eq!(ten.len(), 1, "one random best node: {ten:?}");
        winners.extend(ten);
    }
    assert!(
        winners.len() >= 4,
        "40 draws over 16 nodes picked only {winners:?}"
    );
}
