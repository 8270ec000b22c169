//! Unit and property tests of the policy core.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use proptest::prelude::*;

use super::*;
use crate::resources::{GpuDemand, MemoryDemand, ModelConstraint};

fn node(name: &str, cpu: u64, mem: u64, gpus: &[(&str, u64)]) -> NodeSpec {
    NodeSpec {
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
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

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
