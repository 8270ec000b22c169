//! Unit and property tests of the policy core.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use proptest::prelude::*;

use super::*;
use crate::resources::{GpuDemand, MemoryDemand, ModelConstraint};

fn node(name: &str, cpu: u64, mem: u64, gpus: &[(&str, u64)]) -> NodeSpec {
    NodeSpec {
        topology: Default::default(),
        name: name.into(),
        cpu_milli: cpu,
        memory_mib: mem,
        gpus: gpus
            .iter()
            .enumerate()
            .map(|(i, (m, mib))| GpuSpec {
                uuid: format!("GPU-{name}-{i}"),
                model: (*m).into(),
                memory_mib: *mib,
            })
            .collect(),
        slices_per_gpu: crate::resources::SLICES_PER_GPU,
    }
}

fn share(cpu: u64, milli: u32) -> Task {
    Task {
        cpu_milli: cpu,
        memory_mib: 1024,
        gpus: vec![GpuDemand::share_milli(milli)],
        models: ModelConstraint::any(),
    }
}

fn whole(cpu: u64, k: u32) -> Task {
    Task {
        cpu_milli: cpu,
        memory_mib: 1024,
        gpus: vec![GpuDemand::whole(k)],
        models: ModelConstraint::any(),
    }
}

fn scale() -> Scale {
    Scale {
        cpu_milli: 96_000,
        gpu_milli: 8000,
    }
}

fn typical_for(tasks: &[Task]) -> Fragmentation {
    Fragmentation::new(typical_tasks(tasks, 0.95))
}

fn scheduler(name: PolicyName, tasks: &[Task], n_nodes: usize) -> Scheduler {
    let frag = name.needs_typical_tasks().then(|| typical_for(tasks));
    Scheduler::new(Policy::new(name, frag, 7, scale()), (0..n_nodes).collect())
}

#[test]
fn commit_and_release_round_trip() {
    let mut l =
        Ledger::with_nodes([node("a", 8000, 65536, &[("T4", 16384), ("T4", 16384)])]).unwrap();
    let t = share(1000, 300);
    let plan = l.node(0).fit(&t).unwrap();
    l.commit(
        "p1",
        &t,
        Placement {
            node: 0,
            containers: plan,
        },
    )
    .unwrap();
    assert_eq!(l.node(0).gpus[0].milli, 700);
    assert_eq!(l.node(0).gpus[0].memory_mib, 16384 - 4915);
    assert_eq!(l.node(0).cpu_free, 7000);
    assert_eq!(l.free_histogram()[700], 1);
    assert!(matches!(
        l.commit(
            "p1",
            &t,
            Placement {
                node: 0,
                containers: vec![]
            }
        ),
        Err(LedgerError::AlreadyPlaced(_))
    ));
    l.release("p1").unwrap();
    assert_eq!(l.node(0).gpus[0].milli, 1000);
    assert_eq!(l.node(0).cpu_free, 8000);
    assert_eq!(l.free_histogram()[1000], 2);
    assert!(matches!(l.release("p1"), Err(LedgerError::NotPlaced(_))));
}

#[test]
fn relabel_changes_models_only_and_keeps_placements() {
    let spec = node("a", 8000, 65536, &[("T4", 16384), ("T4", 16384)]);
    let mut l = Ledger::with_nodes([spec.clone()]).unwrap();
    let t = share(1000, 300);
    let plan = l.node(0).fit(&t).unwrap();
    l.commit(
        "p1",
        &t,
        Placement {
            node: 0,
            containers: plan,
        },
    )
    .unwrap();
    let generation = l.node(0).generation;
    let mut marked = spec.clone();
    marked.gpus[0].model = "unhealthy:T4".into();
    l.relabel_gpus(0, &marked).unwrap();
    assert_eq!(l.node(0).spec, marked);
    assert!(l.node(0).generation > generation);
    assert_eq!(l.node(0).gpus[0].milli, 700, "placements stay");
    assert!(l.placement("p1").is_some());
    // Anything but models is refused, naming the difference.
    let mut other = spec.clone();
    other.gpus[1].uuid = "GPU-x".into();
    let e = l.relabel_gpus(0, &other).unwrap_err().to_string();
    assert!(e.contains("GPU-x"), "{e}");
    let mut fewer = spec;
    fewer.gpus.pop();
    let e = l.relabel_gpus(0, &fewer).unwrap_err().to_string();
    assert!(e.contains("1 GPUs, not 2"), "{e}");
    assert!(
        l.relabel_gpus(3, &marked)
            .unwrap_err()
            .to_string()
            .contains("#3")
    );
}

#[test]
fn over_assignment_is_refused() {
    let mut l = Ledger::with_nodes([node("a", 8000, 65536, &[("T4", 16384)])]).unwrap();
    let t = share(100, 600);
    let p = Placement {
        node: 0,
        containers: l.node(0).fit(&t).unwrap(),
    };
    l.commit("p1", &t, p.clone()).unwrap();
    let e = l.commit("p2", &t, p).unwrap_err();
    assert!(e.to_string().contains("free 400 milli"), "{e}");
    // A whole GPU needs a fully free GPU.
    let w = whole(100, 1);
    let forged = Placement {
        node: 0,
        containers: vec![vec![Grant {
            gpu: 0,
            milli: 1000,
            memory_mib: 16384,
            slices: 10,
        }]],
    };
    assert!(l.commit("p3", &w, forged).is_err());
}

#[test]
fn reasons_are_precise() {
    let mut l =
        Ledger::with_nodes([node("a", 4000, 8192, &[("T4", 16384), ("T4", 16384)])]).unwrap();
    let n = l.node(0);
    assert_eq!(
        n.fit(&share(8000, 100)).unwrap_err().to_string(),
        "CPU: free 4 cores < 8 cores"
    );
    let mut t = share(100, 100);
    t.memory_mib = 16384;
    assert_eq!(
        n.fit(&t).unwrap_err().to_string(),
        "memory: free 8 GiB < 16 GiB"
    );
    let mut t = share(100, 100);
    t.models = ModelConstraint::only(["A100"]);
    assert_eq!(
        n.fit(&t).unwrap_err().to_string(),
        "GPU model: node has T4 but the pod needs one of A100"
    );
    assert_eq!(
        n.fit(&whole(100, 3)).unwrap_err().to_string(),
        "GPU count: 2 GPUs of an allowed model < 3"
    );
    // Fill GPU 0 to 0.65 and GPU 1 to 0.5 of compute.
    let a = share(100, 350);
    let p = Placement {
        node: 0,
        containers: l.node(0).fit(&a).unwrap(),
    };
    l.commit("a", &a, p).unwrap();
    let b = share(100, 500);
    let p = Placement {
        node: 0,
        containers: l.node(0).plan(&b, Some(1)).unwrap(),
    };
    l.commit("b", &b, p).unwrap();
    let n = l.node(0);
    assert_eq!(
        n.fit(&share(100, 700)).unwrap_err().to_string(),
        "GPU compute: max free 0.650 GPU < 0.700 GPU"
    );
    assert_eq!(
        n.fit(&whole(100, 1)).unwrap_err().to_string(),
        "whole GPUs: 0 fully free < 1"
    );
    let mut m = share(100, 100);
    m.gpus[0].memory = MemoryDemand::Mib(12 * 1024);
    assert_eq!(
        n.fit(&m).unwrap_err().to_string(),
        "GPU memory: max free 10.4 GiB < 12 GiB"
    );
}

#[test]
fn multi_gpu_takes_lowest_numbered_fully_free() {
    let mut l = Ledger::with_nodes([node("a", 64000, 1 << 20, &[("G2", 16384); 8])]).unwrap();
    let s = share(100, 100);
    let p = Placement {
        node: 0,
        containers: l.node(0).plan(&s, Some(1)).unwrap(),
    };
    l.commit("s", &s, p).unwrap();
    let w = whole(100, 3);
    let plan = l.node(0).fit(&w).unwrap();
    let gpus: Vec<u16> = plan[0].iter().map(|g| g.gpu).collect();
    assert_eq!(gpus, vec![0, 2, 3]);
}

#[test]
fn sharing_goes_to_the_tightest_gpu_by_default() {
    let mut l = Ledger::with_nodes([node("a", 64000, 1 << 20, &[("G2", 16384); 3])]).unwrap();
    for (k, (gpu, milli)) in [(0usize, 200u32), (1, 600), (2, 500)]
        .into_iter()
        .enumerate()
    {
        let t = share(100, milli);
        let p = Placement {
            node: 0,
            containers: l.node(0).plan(&t, Some(gpu)).unwrap(),
        };
        l.commit(&k.to_string(), &t, p).unwrap();
    }
    // Free: 800, 400, 500. A 0.4 share fits GPU 1 exactly.
    let plan = l.node(0).fit(&share(100, 400)).unwrap();
    assert_eq!(plan[0][0].gpu, 1);
}

#[test]
fn fgd_score_matches_the_published_formula() {
    assert_eq!(fgd::fgd_score(0.0), 50);
    assert_eq!(fgd::fgd_score(1000.0), 73);
    assert_eq!(fgd::fgd_score(-1000.0), 26);
    assert_eq!(fgd::fgd_score(1e9), 100);
}

#[test]
fn typical_tasks_cover_and_renormalise() {
    let mut tasks = Vec::new();
    tasks.extend((0..60).map(|_| share(1000, 500)));
    tasks.extend((0..30).map(|_| whole(2000, 1)));
    tasks.extend((0..6).map(|_| whole(4000, 8)));
    tasks.extend((0..4).map(|_| share(1000, 250)));
    let t = typical_tasks(&tasks, 0.95);
    assert_eq!(t.len(), 3, "{t:?}");
    assert_eq!((t[0].gpu_milli, t[0].gpu_count), (500, 1));
    let sum: f64 = t.iter().map(|x| x.freq).sum();
    assert!((sum - 1.0).abs() < 1e-12);
    assert!((t[0].freq - 60.0 / 96.0).abs() < 1e-12);
}

#[test]
fn fragmentation_of_a_simple_node() {
    // Typical: half 0.5-GPU tasks, half whole GPUs; node with free 1000 and 300.
    let tasks: Vec<Task> = (0..10)
        .map(|i| {
            if i % 2 == 0 {
                share(1000, 500)
            } else {
                whole(1000, 1)
            }
        })
        .collect();
    let mut f = typical_for(&tasks);
    let l = Ledger::with_nodes([node("a", 8000, 65536, &[("T4", 16384), ("T4", 16384)])]).unwrap();
    let n = l.node(0);
    // 0.5-task: GPU with 300 is frag (300); whole: 300 is frag too → F = 0.5·300 + 0.5·300.
    let v = f.value(0, n, 8000, &[1000, 300]);
    assert!((v - 300.0).abs() < 1e-9, "{v}");
    // CPU short for every typical task: all free counts.
    let v = f.value(0, n, 500, &[1000, 300]);
    assert!((v - 1300.0).abs() < 1e-9, "{v}");
}

#[test]
fn policies_choose_sensibly() {
    let nodes = [
        node("a", 96000, 1 << 20, &[("G2", 16384); 8]),
        node("b", 96000, 1 << 20, &[("G2", 16384); 8]),
    ];
    let tasks = vec![share(1000, 500), share(1000, 500), whole(1000, 1)];
    for name in PolicyName::ALL {
        let mut l = Ledger::with_nodes(nodes.clone()).unwrap();
        let mut s = scheduler(name, &tasks, 2);
        let p = s.choose(&l, &tasks[0]).unwrap();
        let first = p.node;
        l.commit("0", &tasks[0], p).unwrap();
        let p = s.choose(&l, &tasks[1]).unwrap();
        match name {
            // Packing policies put the second half on the same GPU.
            PolicyName::BestFit | PolicyName::GpuPacking | PolicyName::Fgd | PolicyName::Vgpu => {
                assert_eq!(p.node, first, "{name}");
                assert_eq!(p.containers[0][0].gpu, 0, "{name}");
            }
            PolicyName::Spread => assert_ne!(p.node, first, "{name}"),
            PolicyName::Random => {}
        }
    }
}

#[test]
fn model_constraints_are_honoured_by_every_policy() {
    let nodes = [
        node("t4", 96000, 1 << 20, &[("T4", 15360); 4]),
        node("a100", 96000, 1 << 20, &[("A100", 81920); 4]),
    ];
    let mut t = share(1000, 300);
    t.models = ModelConstraint::only(["A100"]);
    let mut ex = whole(1000, 2);
    ex.models.excluded = vec!["A100".into()];
    for name in PolicyName::ALL {
        let l = Ledger::with_nodes(nodes.clone()).unwrap();
        let mut s = scheduler(name, &[t.clone(), ex.clone()], 2);
        assert_eq!(s.choose(&l, &t).unwrap().node, 1, "{name}");
        assert_eq!(s.choose(&l, &ex).unwrap().node, 0, "{name}");
    }
}

#[test]
fn verdicts_explain_every_rejected_node() {
    let l = Ledger::with_nodes([
        node("small", 2000, 65536, &[("T4", 15360)]),
        node("big", 96000, 1 << 20, &[("G2", 16384); 8]),
    ])
    .unwrap();
    let t = whole(4000, 2);
    let mut s = scheduler(PolicyName::Vgpu, std::slice::from_ref(&t), 2);
    let v = s.verdicts(&l, &t, &[0, 1, 7]);
    assert_eq!(
        v[0].result.clone().unwrap_err().to_string(),
        "CPU: free 2 cores < 4 cores"
    );
    assert!(v[1].result.is_ok());
    assert!(matches!(v[2].result, Err(Reject::UnknownNode(_))));
    let p = s.place_on(&l, &t, 1).unwrap();
    assert_eq!(p.containers[0].len(), 2);
}

#[test]
fn sum_of_squares_prefers_rare_gaps() {
    let mut hist = vec![0u32; 1001];
    hist[500] = 10;
    hist[200] = 1;
    // Filling a 0.5 gap exactly removes a common gap: strongly negative.
    assert_eq!(policy::sum_of_squares_delta(&hist, 500, 500), -19);
    // Creating another 0.5 gap from a fresh GPU is penalised.
    assert_eq!(policy::sum_of_squares_delta(&hist, 1000, 500), 21);
}

#[test]
fn node_sum_of_squares_prefers_rare_counts_of_free_gpus() {
    // Nodes by fully free GPUs: 10 with 8, 1 with 6, 1 with 2.
    let mut hist = vec![0u32; 9];
    hist[8] = 10;
    hist[6] = 1;
    hist[2] = 1;
    // Two GPUs from a node with 8 free: one fewer common count, one more of a rare one.
    assert_eq!(policy::sum_of_squares_delta_nodes(&hist, 8, 2), -19 + 3);
    // Four from the node with 6 free turns it into a second node with 2 free.
    assert_eq!(policy::sum_of_squares_delta_nodes(&hist, 6, 4), -1 + 3);
    // Taking more than a node has, or nothing, changes nothing.
    assert_eq!(policy::sum_of_squares_delta_nodes(&hist, 2, 4), 0);
    assert_eq!(policy::sum_of_squares_delta_nodes(&hist, 8, 0), 0);
}

#[test]
fn vgpu_breaks_whole_gpu_ties_by_node_sum_of_squares() {
    // Three identical 4-GPU nodes; one already gave 2 GPUs away. A 2-GPU task scores
    // alike on the two fresh nodes (and the used one); the node key prefers the
    // placement that leaves the counts of fully free GPUs most balanced.
    let nodes: Vec<NodeSpec> = (0..3)
        .map(|i| node(&format!("n{i}"), 96_000, 1 << 20, &[("A100", 81920); 4]))
        .collect();
    let mut l = Ledger::with_nodes(nodes).unwrap();
    let t = whole(1000, 2);
    let p = Placement {
        node: 2,
        containers: l.node(2).fit(&t).unwrap(),
    };
    l.commit("first", &t, p).unwrap();
    assert_eq!(l.whole_histogram(), &[0, 0, 1, 0, 2]);
    let mut s = scheduler(PolicyName::Vgpu, std::slice::from_ref(&t), 3);
    let ranks = s.rank(&l, &t, &[Some(0), Some(1), Some(2)]);
    let key = |n: usize| ranks[n].unwrap().live;
    // From a 4-free node: N(4) 2→1, N(2) 1→2: Δ = -3 + 3 = 0. From the 2-free node:
    // N(2) 1→0, N(0) 0→1: Δ = -1 + 1 = 0. Equal here; the keys are the negated deltas.
    assert_eq!(
        key(0),
        -policy::sum_of_squares_delta_nodes(l.whole_histogram(), 4, 2)
    );
    assert_eq!(
        key(2),
        -policy::sum_of_squares_delta_nodes(l.whole_histogram(), 2, 2)
    );
}

#[test]
fn vgpu_node_key_counts_nodes_of_the_same_size_only() {
    // Two 2-GPU nodes (both fully free) and two 4-GPU nodes (one fully free, one with 2
    // fully free). Per size, the 4-GPU node's key sees only the 4-GPU nodes: N₄(4) = 1,
    // N₄(2) = 1. Over all nodes it would also count the two 2-GPU nodes at level 2.
    let mut nodes: Vec<NodeSpec> = (0..2)
        .map(|i| node(&format!("s{i}"), 96_000, 1 << 20, &[("A100", 81920); 2]))
        .collect();
    nodes.extend((0..2).map(|i| node(&format!("b{i}"), 96_000, 1 << 20, &[("A100", 81920); 4])));
    let mut l = Ledger::with_nodes(nodes).unwrap();
    let t = whole(1000, 2);
    let p = Placement {
        node: 3,
        containers: l.node(3).fit(&t).unwrap(),
    };
    l.commit("first", &t, p).unwrap();
    assert_eq!(l.whole_histogram(), &[0, 0, 3, 0, 1]);
    assert_eq!(l.whole_histogram_of_size(2), &[0, 0, 2]);
    assert_eq!(l.whole_histogram_of_size(4), &[0, 0, 1, 0, 1]);
    assert!(l.whole_histogram_of_size(8).is_empty());
    let mut s = scheduler(PolicyName::Vgpu, std::slice::from_ref(&t), 4);
    assert!(s.policy().vgpu.node_ss_by_size, "per-size is the default");
    let ranks = s.rank(&l, &t, &[Some(0), Some(1), Some(2), Some(3)]);
    let key = |n: usize| ranks[n].unwrap().live;
    // 4-GPU node with 4 free: N₄(4) 1→0, N₄(2) 1→2: Δ = −1 + 3 = 2.
    assert_eq!(key(2), -2);
    assert_eq!(
        key(2),
        -policy::sum_of_squares_delta_nodes(l.whole_histogram_of_size(4), 4, 2)
    );
    // 2-GPU node with 2 free: N₂(2) 2→1, N₂(0) 0→1: Δ = −3 + 1 = −2 (over all nodes it
    // would be N(2) 3→2: −5 + 1 = −4).
    assert_eq!(key(0), 2);
    // The whole-cluster variant, for comparison.
    s.policy_mut().vgpu.node_ss_by_size = false;
    let ranks = s.rank(&l, &t, &[Some(0), Some(2)]);
    assert_eq!(ranks[0].unwrap().live, 4);
    assert_eq!(ranks[1].unwrap().live, -(1 - 2 + 2 * 3 + 1));
}

#[test]
fn open_node_key_leaves_out_idle_and_full_levels() {
    // Size 4: 5 idle nodes, 2 with 2 fully free, 3 full.
    let hist = [3u32, 0, 2, 0, 5];
    // Idle → 2 free: only the open level 2 counts: 2·2 + 1.
    assert_eq!(policy::sum_of_squares_delta_open_nodes(&hist, 4, 4, 2), 5);
    // 2 free → full: only level 2 counts: 1 − 2·2.
    assert_eq!(policy::sum_of_squares_delta_open_nodes(&hist, 4, 2, 2), -3);
    assert_eq!(policy::sum_of_squares_delta_open_nodes(&hist, 4, 2, 3), 0);
}

fn class_workload() -> Vec<Task> {
    // 70 shares and 24 whole GPUs are typical (94 of 97 ≥ 95 %); three 8-GPU tasks with
    // three different CPU requests are each too rare, together as frequent as 3 tasks.
    let mut tasks = Vec::new();
    tasks.extend((0..70).map(|_| share(1000, 500)));
    tasks.extend((0..24).map(|_| whole(2000, 1)));
    tasks.extend([whole(6000, 8), whole(4000, 8), whole(5000, 8)]);
    tasks
}

#[test]
fn left_out_multi_gpu_shapes_become_one_class_per_gpu_count() {
    let tasks = class_workload();
    let fgd = typical_tasks(&tasks, 0.95);
    assert_eq!(fgd.len(), 2, "{fgd:?}");
    assert!(fgd.iter().all(|t| t.gpu_count <= 1));
    let with = typical_tasks_with_classes(&tasks, 0.95, RareShapes::MissingMultiGpu);
    assert_eq!(with.len(), 3, "{with:?}");
    // FGD's typical tasks first, in order, renormalised over the 97 tasks represented.
    for (a, b) in fgd.iter().zip(&with) {
        assert_eq!(
            (a.cpu_milli, a.gpu_milli, a.gpu_count),
            (b.cpu_milli, b.gpu_milli, b.gpu_count)
        );
    }
    assert!((with[0].freq - 70.0 / 97.0).abs() < 1e-12);
    assert!((with[1].freq - 24.0 / 97.0).abs() < 1e-12);
    // The class: 8 whole GPUs, the median CPU, its share of the tasks.
    let c = &with[2];
    assert_eq!((c.cpu_milli, c.gpu_milli, c.gpu_count), (5000, 1000, 8));
    assert!((c.freq - 3.0 / 97.0).abs() < 1e-12);
    let sum: f64 = with.iter().map(|t| t.freq).sum();
    assert!((sum - 1.0).abs() < 1e-12);
    // `Drop` is FGD's list unchanged.
    assert_eq!(
        typical_tasks_with_classes(&tasks, 0.95, RareShapes::Drop),
        fgd
    );
    // The smallest CPU instead of the median, on request.
    let min = typical_tasks_with_classes(&tasks, 0.95, RareShapes::MissingMultiGpuMinCpu);
    assert_eq!(min[2].cpu_milli, 4000);
}

#[test]
fn no_class_for_a_gpu_count_the_typical_tasks_already_have() {
    let mut tasks = class_workload();
    // Make one 8-GPU shape typical: the left-out 8-GPU shapes then add no class (FGD's
    // measure already sees what breaking an 8-GPU node costs).
    tasks.extend((0..40).map(|_| whole(7000, 8)));
    let fgd = typical_tasks(&tasks, 0.95);
    assert!(fgd.iter().any(|t| t.gpu_count == 8));
    let with = typical_tasks_with_classes(&tasks, 0.95, RareShapes::MissingMultiGpu);
    assert_eq!(with, fgd);
    // `MultiGpu` adds them regardless.
    let multi = typical_tasks_with_classes(&tasks, 0.95, RareShapes::MultiGpu);
    assert_eq!(multi.len(), fgd.len() + 1);
}

#[test]
fn the_class_makes_breaking_an_idle_8_gpu_node_cost() {
    // Two identical 8-GPU nodes; one already runs a whole-GPU task. For another
    // whole-GPU task FGD's typical tasks (shares, single GPUs) see no difference between
    // the nodes: both score alike. With the 8-GPU class, taking a GPU from the idle node
    // makes its 7 free GPUs useless to the class (ΔF = −3/97·7000), from the used node
    // it frees the class's view of one GPU (ΔF = +3/97·1000): the used node scores higher.
    let tasks = class_workload();
    let nodes: Vec<NodeSpec> = (0..2)
        .map(|i| node(&format!("n{i}"), 96_000, 1 << 20, &[("A100", 81920); 8]))
        .collect();
    let mut l = Ledger::with_nodes(nodes).unwrap();
    let t = whole(2000, 1);
    let p = Placement {
        node: 1,
        containers: l.node(1).fit(&t).unwrap(),
    };
    l.commit("first", &t, p).unwrap();
    let scores = |rare: RareShapes| {
        let params = VgpuParams {
            rare,
            ..VgpuParams::default()
        };
        let frag = fragmentation_for(PolicyName::Vgpu, &params, &tasks, 0.95).unwrap();
        let mut policy = Policy::new(PolicyName::Vgpu, Some(frag), 7, scale());
        policy.vgpu = params;
        let mut s = Scheduler::new(policy, vec![0, 1]);
        let r = s.rank(&l, &t, &[Some(0), Some(1)]);
        (r[0].unwrap().score / 1000, r[1].unwrap().score / 1000)
    };
    let (idle, used) = scores(RareShapes::Drop);
    assert_eq!(idle, used);
    assert_eq!(scores(RareShapes::MissingMultiGpu), (44, 50));
}

fn arb_node(i: usize) -> impl Strategy<Value = NodeSpec> {
    (
        1u64..=64,
        prop::sample::select(vec![1usize, 2, 4, 8]),
        prop::sample::select(vec!["T4", "A100", "G2"]),
    )
        .prop_map(move |(cores, g, model)| {
            let mib = if model == "A100" { 81920 } else { 16384 };
            node(
                &format!("n{i}"),
                cores * 1000,
                1 << 18,
                &vec![(model, mib); g],
            )
        })
}

fn arb_task() -> impl Strategy<Value = Task> {
    (
        0u64..=16_000,
        0u64..=65536,
        prop_oneof![
            Just(None),
            (1u32..1000).prop_map(|m| Some(GpuDemand::share_milli(m))),
            (1u32..=8).prop_map(|k| Some(GpuDemand::whole(k))),
            (1u32..=3, 1u32..=1000, 1u64..=20_000).prop_map(|(k, m, mib)| Some(GpuDemand {
                count: k,
                compute_milli: m,
                memory: MemoryDemand::Mib(mib),
                slices: 1,
            })),
        ],
        prop::option::of(prop::sample::select(vec!["T4", "A100", "G2"])),
    )
        .prop_map(|(cpu, mem, g, model)| Task {
            cpu_milli: cpu,
            memory_mib: mem,
            gpus: g.into_iter().collect(),
            models: model.map_or_else(ModelConstraint::any, |m| ModelConstraint::only([m])),
        })
}

fn check_invariants(l: &Ledger, tasks: &[Task], placed: &[(usize, Placement)]) {
    for (ni, n) in l.nodes().iter().enumerate() {
        let mut used = vec![(0u32, 0u64, 0u32); n.spec.gpus.len()];
        let mut cpu = 0;
        let mut mem = 0;
        for (ti, p) in placed.iter().filter(|(_, p)| p.node == ni) {
            let t = &tasks[*ti];
            cpu += t.cpu_milli;
            mem += t.memory_mib;
            for (grants, d) in p.containers.iter().zip(&t.gpus) {
                assert_eq!(grants.len(), d.count as usize);
                let mut seen: Vec<u16> = grants.iter().map(|g| g.gpu).collect();
                seen.sort_unstable();
                seen.dedup();
                assert_eq!(seen.len(), grants.len(), "one GPU twice in a container");
                for g in grants {
                    let spec = &n.spec.gpus[usize::from(g.gpu)];
                    assert!(t.models.allows(&spec.model), "model constraint broken");
                    let u = &mut used[usize::from(g.gpu)];
                    u.0 += g.milli;
                    u.1 += g.memory_mib;
                    u.2 += g.slices;
                }
            }
        }
        assert!(cpu <= n.spec.cpu_milli && mem <= n.spec.memory_mib);
        assert_eq!(n.cpu_free, n.spec.cpu_milli - cpu);
        for (i, u) in used.iter().enumerate() {
            assert!(u.0 <= 1000, "GPU over-assigned in milli");
            assert!(
                u.1 <= n.spec.gpus[i].memory_mib,
                "GPU over-assigned in memory"
            );
            assert!(u.2 <= 10, "GPU over-assigned in slices");
            assert_eq!(n.gpus[i].milli, 1000 - u.0);
            assert_eq!(n.gpus[i].memory_mib, n.spec.gpus[i].memory_mib - u.1);
        }
    }
    // The histograms the live keys read match a recount.
    let mut free = vec![0u32; 1001];
    let mut whole = vec![0u32; l.whole_histogram().len()];
    for n in l.nodes() {
        for g in &n.gpus {
            free[g.milli as usize] += 1;
        }
        whole[n.fully_free_count()] += 1;
    }
    assert_eq!(l.free_histogram(), free.as_slice());
    assert_eq!(l.whole_histogram(), whole.as_slice());
    // And per node size.
    let sizes: std::collections::BTreeSet<usize> = l.nodes().iter().map(|n| n.gpus.len()).collect();
    for size in sizes {
        let mut by_size = vec![0u32; size + 1];
        for n in l.nodes().iter().filter(|n| n.gpus.len() == size) {
            by_size[n.fully_free_count()] += 1;
        }
        assert_eq!(
            l.whole_histogram_of_size(size),
            by_size.as_slice(),
            "size {size}"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn classes_keep_fgds_tasks_and_sum_to_one(
        tasks in proptest::collection::vec(arb_task(), 1..60),
        cov in 0.5f64..1.0,
    ) {
        let fgd = typical_tasks(&tasks, cov);
        for which in [RareShapes::MissingMultiGpu, RareShapes::MultiGpu, RareShapes::AllGpu] {
            let with = typical_tasks_with_classes(&tasks, cov, which);
            prop_assert!(with.len() >= fgd.len());
            let sum: f64 = with.iter().map(|t| t.freq).sum();
            prop_assert!((sum - 1.0).abs() < 1e-9, "{sum}");
            // FGD's typical tasks keep their order and their relative frequencies.
            for (a, b) in fgd.iter().zip(&with) {
                prop_assert_eq!((a.cpu_milli, a.gpu_milli, a.gpu_count), (b.cpu_milli, b.gpu_milli, b.gpu_count));
                prop_assert!((b.freq / with[0].freq - a.freq / fgd[0].freq).abs() < 1e-9);
            }
            for c in &with[fgd.len()..] {
                prop_assert!(c.gpu_count >= 1 && c.freq > 0.0);
                if which != RareShapes::AllGpu {
                    prop_assert!(c.gpu_count > 1);
                }
                if which == RareShapes::MissingMultiGpu {
                    prop_assert!(!fgd.iter().any(|t| t.gpu_count == c.gpu_count));
                }
            }
        }
    }

    /// The extender's path (rank the candidates, bind with `place_on` on a best-ranked
    /// node) decides exactly as the replay's `choose`: the chosen node is ranked best,
    /// and placing on it grants the same GPUs.
    #[test]
    fn place_on_the_best_ranked_node_is_choose(
        nodes in (1usize..6).prop_flat_map(|n| (0..n).map(arb_node).collect::<Vec<_>>()),
        tasks in prop::collection::vec(arb_task(), 1..40),
        policy in prop::sample::select(PolicyName::ALL.to_vec()),
    ) {
        prop_assume!(policy != PolicyName::Random); // draws afresh at every call
        let mut l = Ledger::with_nodes(nodes.clone()).unwrap();
        let mut s = scheduler(policy, &tasks, nodes.len());
        let all: Vec<Option<usize>> = (0..nodes.len()).map(Some).collect();
        for (i, t) in tasks.iter().enumerate() {
            let ranks = s.rank(&l, t, &all);
            let Some(p) = s.choose(&l, t) else {
                prop_assert!(ranks.iter().all(Option::is_none));
                continue;
            };
            let best = ranks.iter().flatten().map(Rank::key).max();
            prop_assert_eq!(ranks[p.node].map(|r| r.key()), best);
            prop_assert_eq!(&s.place_on(&l, t, p.node).unwrap(), &p);
            l.commit(&i.to_string(), t, p).unwrap();
        }
    }

    #[test]
    fn no_policy_ever_over_assigns(
        nodes in (1usize..6).prop_flat_map(|n| (0..n).map(arb_node).collect::<Vec<_>>()),
        tasks in prop::collection::vec(arb_task(), 1..60),
        release_every in 2usize..7,
        policy in prop::sample::select(PolicyName::ALL.to_vec()),
    ) {
        let mut l = Ledger::with_nodes(nodes.clone()).unwrap();
        let mut s = scheduler(policy, &tasks, nodes.len());
        let mut placed: Vec<(usize, Placement)> = Vec::new();
        for (i, t) in tasks.iter().enumerate() {
            match s.choose(&l, t) {
                Some(p) => {
                    // Whole-GPU demands land on GPUs that were fully free.
                    for (grants, d) in p.containers.iter().zip(&t.gpus) {
                        if d.is_whole() {
                            for g in grants {
                                prop_assert!(l.node(p.node).gpu_fully_free(usize::from(g.gpu)));
                            }
                        }
                    }
                    l.commit(&i.to_string(), t, p.clone()).unwrap();
                    placed.push((i, p));
                }
                None => {
                    // Nothing fits: every node must say why.
                    for n in l.nodes() {
                        prop_assert!(n.fit(t).is_err());
                    }
                }
            }
            if i % release_every == 0 && !placed.is_empty() {
                let (ti, _) = placed.remove(0);
                l.release(&ti.to_string()).unwrap();
            }
            check_invariants(&l, &tasks, &placed);
        }
    }

    #[test]
    fn incremental_fragmentation_matches_full_recomputation(
        frees in prop::collection::vec(0u32..=1000, 1..9),
        cpu_free in 0u64..64_000,
        tasks in prop::collection::vec(arb_task(), 1..20),
        m in 1u32..1000,
        cpu in 0u64..64_000,
        gpu in 0usize..8,
    ) {
        let g = frees.len();
        let gpu = gpu % g;
        prop_assume!(frees[gpu] >= m && cpu_free >= cpu);
        let mut f = typical_for(&tasks);
        let l = Ledger::with_nodes([node("a", 64_000, 1 << 20, &vec![("T4", 16384); g])]).unwrap();
        let n = l.node(0);
        let before = f.prepare(0, n, cpu_free, &frees);
        let fast = f.value_after_share(0, n, &before, gpu, frees[gpu], m, cpu);
        let mut after = frees.clone();
        after[gpu] -= m;
        let slow = f.value(0, n, cpu_free - cpu, &after);
        prop_assert!((fast - slow).abs() < 1e-6, "{fast} vs {slow}");
    }
}
