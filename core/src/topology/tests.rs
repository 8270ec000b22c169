//! Tests of the link classes and of the best-set search, against real node shapes and
//! against an exhaustive search on random topologies.

use super::*;
use crate::inventory::NvLinkPeer;
use proptest::prelude::*;

fn gpu(numa: Option<u32>, switch: &[u32], nvlink: &[(u32, u32)]) -> Option<GpuTopology> {
    Some(GpuTopology {
        numa_node: numa,
        switch_peers: switch.to_vec(),
        nvlink_peers: nvlink
            .iter()
            .map(|&(index, links)| NvLinkPeer { index, links })
            .collect(),
    })
}

/// 8 GPUs, two per PCIe switch, four per NUMA node (socket).
fn pcie8() -> NodeTopology {
    NodeTopology::new((0..8u32).map(|i| (i, gpu(Some(i / 4), &[i ^ 1], &[]))))
}

/// 8 GPUs on an NVSwitch fabric (NV18 every pair), four per NUMA node, one per switch.
fn dgx_h100() -> NodeTopology {
    NodeTopology::new((0..8u32).map(|i| {
        let peers: Vec<(u32, u32)> = (0..8).filter(|&j| j != i).map(|j| (j, 18)).collect();
        (i, gpu(Some(i / 4), &[], &peers))
    }))
}

/// DGX-1 (V100) hybrid cube mesh: two fully connected quads 0–3 and 4–7, plus i ↔ i+4.
fn dgx1() -> NodeTopology {
    let nv = |i: u32| -> Vec<(u32, u32)> {
        let quad = i / 4 * 4;
        let mut v: Vec<(u32, u32)> = (quad..quad + 4)
            .filter(|&j| j != i)
            .map(|j| (j, 1))
            .collect();
        v.push(((i + 4) % 8, 1));
        v
    };
    NodeTopology::new((0..8u32).map(|i| (i, gpu(Some(i / 4), &[i ^ 1], &nv(i)))))
}

fn all(t: &NodeTopology) -> Vec<u32> {
    t.indices().to_vec()
}

#[test]
fn classes_are_ordered_best_last_and_named() {
    assert!(LinkClass::NvLink > LinkClass::Switch);
    assert!(LinkClass::Switch > LinkClass::Numa);
    assert!(LinkClass::Numa > LinkClass::System);
    let names: Vec<&str> = LinkClass::ALL_BEST_FIRST.iter().map(|c| c.name()).collect();
    assert_eq!(names, ["nvlink", "switch", "numa", "system"]);
    let nv2 = Link {
        class: LinkClass::NvLink,
        nvlinks: 2,
    };
    let nv1 = Link {
        class: LinkClass::NvLink,
        nvlinks: 1,
    };
    assert!(nv2 > nv1 && nv1 > Link::SYSTEM && Link::SAME > nv2);
}

#[test]
fn pair_links_follow_the_inventory() {
    let t = pcie8();
    assert_eq!(t.link(0, 1).class, LinkClass::Switch);
    assert_eq!(t.link(0, 2).class, LinkClass::Numa);
    assert_eq!(t.link(0, 4).class, LinkClass::System);
    assert_eq!(t.link(0, 0), Link::SAME);
    let h = dgx_h100();
    assert_eq!(
        h.link(0, 7),
        Link {
            class: LinkClass::NvLink,
            nvlinks: 18
        }
    );
    // One-sided and disagreeing records: either side's NVLink counts, the fewer links win.
    let t = NodeTopology::new([
        (0, gpu(Some(0), &[], &[(1, 4), (2, 2)])),
        (1, gpu(Some(0), &[], &[(0, 2)])),
        (2, gpu(Some(1), &[], &[])),
    ]);
    assert_eq!(t.link(0, 1).nvlinks, 2);
    assert_eq!(t.link(2, 0).class, LinkClass::NvLink);
    assert_eq!(t.link(1, 2).class, LinkClass::System);
}

#[test]
fn unknown_topology_is_the_worst_class() {
    let t = NodeTopology::new([(0, None), (1, gpu(Some(0), &[0], &[(0, 4)]))]);
    assert!(t.is_known());
    // GPU 1 says it is NVLinked to 0, but 0's topology is unknown: no promise.
    assert_eq!(t.link(0, 1), Link::SYSTEM);
    let none = NodeTopology::new([(0, None), (1, None)]);
    assert!(!none.is_known());
    assert_eq!(none.set_class(&[0, 1]), Some(LinkClass::System));
    // A GPU the node does not list.
    assert_eq!(t.link(1, 9), Link::SYSTEM);
    // NUMA nodes unknown on both: not "the same".
    let t = NodeTopology::new([(0, gpu(None, &[], &[])), (1, gpu(None, &[], &[]))]);
    assert_eq!(t.link(0, 1), Link::SYSTEM);
}

#[test]
fn a_set_is_its_worst_pair() {
    let t = pcie8();
    assert_eq!(t.set_class(&[0, 1]), Some(LinkClass::Switch));
    assert_eq!(t.set_class(&[0, 1, 2]), Some(LinkClass::Numa));
    assert_eq!(t.set_class(&[0, 1, 2, 4]), Some(LinkClass::System));
    assert_eq!(t.set_class(&[3]), None);
    assert_eq!(t.set_class(&[3, 3]), None);
    let d = dgx1();
    assert_eq!(d.set_class(&[0, 1, 2, 3]), Some(LinkClass::NvLink));
    assert_eq!(d.set_class(&[0, 1, 4, 5]), Some(LinkClass::System)); // 0–5: other socket, no NVLink
    assert_eq!(d.set_class(&[0, 2, 4, 6]), Some(LinkClass::System));
}

#[test]
fn best_set_on_real_shapes() {
    let t = pcie8();
    assert_eq!(t.best_set(&all(&t), &[], 2), Some(vec![0, 1]));
    assert_eq!(t.best_set(&all(&t), &[], 4), Some(vec![0, 1, 2, 3]));
    // GPU 0 taken: the pair stays on one switch; the four on one socket.
    let free = [1, 2, 3, 4, 5, 6, 7];
    assert_eq!(t.best_set(&free, &[], 2), Some(vec![2, 3]));
    assert_eq!(t.best_set(&free, &[], 4), Some(vec![4, 5, 6, 7]));
    assert_eq!(t.best_class(&free, 4), Some(LinkClass::Numa));
    // One GPU: the one whose switch peer is gone, keeping a pair intact.
    assert_eq!(t.best_set(&free, &[], 1), Some(vec![1]));
    // Three of socket 0 free: a 2-set takes the full switch pair, a 1-set the widow.
    assert_eq!(t.best_set(&[1, 2, 3], &[], 2), Some(vec![2, 3]));
    assert_eq!(
        t.best_set(&[0, 1, 3, 4, 5, 6, 7], &[], 3),
        Some(vec![0, 1, 3])
    );
    // Across sockets only when nothing else is left.
    assert_eq!(t.best_set(&[0, 2, 4, 6], &[], 3), Some(vec![0, 2, 4]));
    assert_eq!(t.best_class(&[0, 2, 4, 6], 3), Some(LinkClass::System));

    let d = dgx1();
    assert_eq!(d.best_set(&all(&d), &[], 4), Some(vec![0, 1, 2, 3]));
    assert_eq!(
        d.best_set(&[1, 2, 3, 4, 5, 6, 7], &[], 4),
        Some(vec![4, 5, 6, 7])
    );
    // 0 and 4 gone: the NVLink 3-sets are 1,2,3 and 5,6,7 (1–5: NVLink, but 2–5 not).
    assert_eq!(
        d.best_class(&[1, 2, 3, 5, 6, 7], 3),
        Some(LinkClass::NvLink)
    );
    let h = dgx_h100();
    assert_eq!(h.best_set(&[7, 3, 5, 1], &[], 2), Some(vec![1, 3]));
    assert_eq!(h.best_class(&all(&h), 8), Some(LinkClass::NvLink));
}

#[test]
fn best_set_keeps_required_gpus_and_rejects_impossible_asks() {
    let t = pcie8();
    assert_eq!(t.best_set(&all(&t), &[5], 2), Some(vec![4, 5]));
    assert_eq!(t.best_set(&all(&t), &[5], 3), Some(vec![4, 5, 6]));
    // Required GPUs across the sockets: the rest is still chosen well.
    assert_eq!(t.best_set(&all(&t), &[0, 4], 3), Some(vec![0, 1, 4]));
    assert_eq!(t.best_set(&all(&t), &[9], 1), None);
    assert_eq!(t.best_set(&[0, 1], &[], 3), None);
    assert_eq!(t.best_set(&[0, 1], &[0, 1], 1), None);
    assert_eq!(t.best_set(&[0, 0, 1], &[], 2), Some(vec![0, 1]));
    assert_eq!(t.best_set(&[], &[], 0), Some(vec![]));
    assert_eq!(t.best_class(&[0, 1], 1), None);
}

#[test]
fn requirement_parses_and_names_bad_values() {
    use TopologyRequirement::*;
    assert_eq!(TopologyRequirement::from_annotation(None), Ok(Any));
    assert_eq!(TopologyRequirement::parse("any"), Ok(Any));
    assert_eq!(
        TopologyRequirement::parse(" NVLink "),
        Ok(AtLeast(LinkClass::NvLink))
    );
    assert_eq!(
        TopologyRequirement::parse("switch"),
        Ok(AtLeast(LinkClass::Switch))
    );
    assert_eq!(
        TopologyRequirement::parse("numa"),
        Ok(AtLeast(LinkClass::Numa))
    );
    let e = TopologyRequirement::parse("nvswitch").expect_err("unknown");
    assert!(e.to_string().contains("\"nvswitch\""), "{e}");
    assert!(e.to_string().contains("vgpu.io/gpu-topology"), "{e}");
    // `system` is a class, not a requirement one would state.
    assert!(TopologyRequirement::parse("system").is_err());
    assert!(AtLeast(LinkClass::Switch).accepts(LinkClass::NvLink));
    assert!(!AtLeast(LinkClass::Switch).accepts(LinkClass::Numa));
    assert!(Any.accepts(LinkClass::System));
    assert_eq!(AtLeast(LinkClass::Numa).to_string(), "numa");
}

/// Exhaustive: every `n`-subset of `cands` containing `must`, ranked as documented.
fn brute(t: &NodeTopology, cands: &[u32], must: &[u32], n: usize) -> Option<Vec<u32>> {
    let m = cands.len();
    let mut best: Option<(Link, u64, u64, Vec<u32>)> = None;
    for mask in 0u32..(1 << m) {
        if mask.count_ones() as usize != n {
            continue;
        }
        let set: Vec<u32> = (0..m)
            .filter(|i| mask & (1 << i) != 0)
            .map(|i| cands[i])
            .collect();
        if !must.iter().all(|g| set.contains(g)) {
            continue;
        }
        let worst = t.set_link(&set).unwrap_or(Link::SAME);
        let mut inside = 0;
        let mut cut = 0;
        for &a in &set {
            for &b in cands {
                if a == b {
                    continue;
                }
                if set.contains(&b) {
                    inside += t.link(a, b).weight();
                } else {
                    cut += t.link(a, b).weight();
                }
            }
        }
        let better = match &best {
            None => true,
            Some((w, i, c, s)) => {
                (
                    worst,
                    inside,
                    std::cmp::Reverse(cut),
                    std::cmp::Reverse(&set),
                ) > (*w, *i, std::cmp::Reverse(*c), std::cmp::Reverse(s))
            }
        };
        if better {
            best = Some((worst, inside, cut, set));
        }
    }
    best.map(|b| b.3)
}

fn arb_node() -> impl Strategy<Value = NodeTopology> {
    (1usize..=8).prop_flat_map(|g| {
        let per_gpu = (
            proptest::option::weighted(0.9, 0u32..2),
            proptest::collection::vec(any::<bool>(), g),
            proptest::collection::vec(0u32..4, g),
        );
        (
            proptest::collection::vec(proptest::option::weighted(0.9, per_gpu), g),
            Just(g),
        )
            .prop_map(|(gpus, g)| {
                NodeTopology::new(gpus.into_iter().enumerate().map(|(i, rec)| {
                    let i = i as u32;
                    let topo = rec.map(|(numa, sw, nv)| GpuTopology {
                        numa_node: numa,
                        switch_peers: (0..g as u32)
                            .filter(|&j| j != i && sw[j as usize])
                            .collect(),
                        nvlink_peers: (0..g as u32)
                            .filter(|&j| j != i && nv[j as usize] > 0)
                            .map(|j| NvLinkPeer {
                                index: j,
                                links: nv[j as usize],
                            })
                            .collect(),
                    });
                    (i, topo)
                }))
            })
    })
}

proptest! {
    /// The chosen set is the best there is: the same as an exhaustive search, so its
    /// class is the best available class, its worst pair the best worst pair.
    #[test]
    fn best_set_is_the_exhaustive_best(
        t in arb_node(),
        free_mask in any::<u8>(),
        must_mask in any::<u8>(),
        n in 0usize..=8,
    ) {
        let cands: Vec<u32> = t.indices().iter().copied().filter(|&i| free_mask & (1 << i) != 0).collect();
        let must: Vec<u32> = cands.iter().copied().filter(|&i| must_mask & (1 << i) != 0 && i % 3 == 0).collect();
        let got = t.best_set(&cands, &must, n);
        let want = brute(&t, &cands, &must, n);
        prop_assert_eq!(&got, &want);
        if let Some(set) = got {
            prop_assert_eq!(set.len(), n);
            if must.is_empty() && n >= 2 {
                let best_class = brute(&t, &cands, &[], n).and_then(|s| t.set_class(&s));
                prop_assert_eq!(t.set_class(&set), best_class);
                prop_assert_eq!(t.best_class(&cands, n), best_class);
            }
        }
    }

    /// Links are symmetric and a set's class does not depend on its order.
    #[test]
    fn links_are_symmetric(t in arb_node(), a in 0u32..8, b in 0u32..8, c in 0u32..8) {
        prop_assert_eq!(t.link(a, b), t.link(b, a));
        prop_assert_eq!(t.set_link(&[a, b, c]), t.set_link(&[c, a, b]));
    }
}

mod placement {
    //! The ledger's plan gives a multi-GPU container the best-connected set the node
    //! has free (the scheduler's use of [`NodeTopology::best_set`]).

    use super::*;
    use crate::packing::{GpuSpec, Ledger, NodeSpec, Placement, Task};
    use crate::resources::{GpuDemand, ModelConstraint};

    fn ledger_with(topo: NodeTopology, gpus: usize) -> Ledger {
        Ledger::with_nodes([NodeSpec {
            name: "n".into(),
            cpu_milli: 64_000,
            memory_mib: 1 << 20,
            gpus: (0..gpus)
                .map(|i| GpuSpec {
                    uuid: format!("GPU-{i}"),
                    model: "A100".into(),
                    memory_mib: 81_920,
                })
                .collect(),
            topology: topo,
            slices_per_gpu: crate::resources::SLICES_PER_GPU,
        }])
        .expect("one node")
    }

    fn task(d: GpuDemand) -> Task {
        Task {
            cpu_milli: 0,
            memory_mib: 0,
            gpus: vec![d],
            models: ModelConstraint::default(),
        }
    }

    proptest! {
        /// Whatever is already placed, a container of `count` GPUs (whole or shares)
        /// gets a set whose class is the best available among the GPUs it fits on.
        #[test]
        fn the_chosen_set_is_the_best_available(
            t in arb_node(),
            used in proptest::collection::vec(0u32..=1000, 8),
            count in 2u32..=4,
            share in proptest::option::of(100u32..=700),
        ) {
            let g = t.indices().len();
            let mut ledger = ledger_with(t.clone(), g);
            for (i, &m) in used.iter().take(g).enumerate() {
                if m == 0 {
                    continue;
                }
                let grant = crate::packing::Grant {
                    gpu: i as u16,
                    milli: m,
                    memory_mib: 0,
                    slices: 1,
                };
                let p = Placement { node: 0, containers: vec![vec![grant]] };
                let mut d = GpuDemand::share_milli(m);
                d.memory = crate::resources::MemoryDemand::Mib(0);
                d.slices = 1;
                ledger.commit(&format!("p{i}"), &task(d), p).expect("fits an empty GPU");
            }
            let demand = match share {
                Some(m) => GpuDemand { count, ..GpuDemand::share_milli(m) },
                None => GpuDemand::whole(count),
            };
            let node = ledger.node(0);
            let eligible: Vec<u32> = (0..g)
                .filter(|&i| if demand.is_whole() { node.gpu_fully_free(i) } else { node.share_fits(i, &demand) })
                .map(|i| i as u32)
                .collect();
            match node.plan(&task(demand), None) {
                Ok(plan) => {
                    let set: Vec<u32> = plan[0].iter().map(|g| u32::from(g.gpu)).collect();
                    prop_assert_eq!(set.len(), count as usize);
                    prop_assert!(set.iter().all(|s| eligible.contains(s)));
                    prop_assert_eq!(t.set_class(&set), t.best_class(&eligible, count as usize));
                    prop_assert_eq!(t.set_link(&set), t.best_set(&eligible, &[], count as usize).and_then(|b| t.set_link(&b)));
                    // A requirement at the set's class is met; one above it is refused
                    // with the class named.
                    let class = t.set_class(&set).expect("two or more");
                    prop_assert!(node.check_topology(&plan, TopologyRequirement::AtLeast(class)).is_ok());
                    if let Some(&above) = LinkClass::ALL_BEST_FIRST.iter().rev().find(|c| **c > class) {
                        let e = node.check_topology(&plan, TopologyRequirement::AtLeast(above)).expect_err("above the best");
                        prop_assert!(e.to_string().contains(&format!("requires {above}")), "{}", e);
                    }
                }
                Err(_) => prop_assert!(eligible.len() < count as usize),
            }
        }
    }

    /// The fragmentation measure's topology extension: on a PCIe node whose only intact
    /// switch pair is 6–7, a share on GPU 6 leaves the 2-GPU typical task no pair at its
    /// best class (`frag_t` = all free milli), a share on GPU 0 does not; without the
    /// extension, or without a topology, both cost the same.
    #[test]
    fn the_fragmentation_extension_prices_breaking_the_last_pair() {
        use crate::packing::{Fragmentation, TypicalTask};
        let typical = vec![
            TypicalTask {
                cpu_milli: 0,
                gpu_milli: 1000,
                gpu_count: 2,
                models: ModelConstraint::default(),
                freq: 0.5,
            },
            TypicalTask {
                cpu_milli: 0,
                gpu_milli: 500,
                gpu_count: 1,
                models: ModelConstraint::default(),
                freq: 0.5,
            },
        ];
        let run = |topo: NodeTopology, on: bool| -> (f64, f64) {
            let mut ledger = ledger_with(topo, 8);
            for i in [1u16, 3, 5] {
                let grant = crate::packing::Grant {
                    gpu: i,
                    milli: 300,
                    memory_mib: 0,
                    slices: 1,
                };
                let mut d = GpuDemand::share_milli(300);
                d.memory = crate::resources::MemoryDemand::Mib(0);
                ledger
                    .commit(
                        &format!("p{i}"),
                        &task(d),
                        Placement {
                            node: 0,
                            containers: vec![vec![grant]],
                        },
                    )
                    .expect("fits");
            }
            let node = ledger.node(0);
            let mut frag = Fragmentation::new(typical.clone()).with_topology(on);
            let free: Vec<u32> = node.gpus.iter().map(|g| g.milli).collect();
            let before = frag.prepare(0, node, node.cpu_free, &free);
            let on6 = frag.value_after_share(0, node, &before, 6, 1000, 500, 0);
            let on0 = frag.value_after_share(0, node, &before, 0, 1000, 500, 0);
            // The incremental value agrees with a fresh measure of the state after.
            let mut after = free.clone();
            after[6] -= 500;
            assert_eq!(on6, frag.value(0, node, node.cpu_free, &after));
            (on6, on0)
        };
        let (on6, on0) = run(pcie8(), true);
        assert!(on6 > on0 + 1000.0, "{on6} vs {on0}");
        let (on6, on0) = run(pcie8(), false);
        assert_eq!(on6, on0);
        let (on6, on0) = run(NodeTopology::default(), true);
        assert_eq!(on6, on0);
    }

    #[test]
    fn one_whole_gpu_keeps_pairs_whole_and_unknown_topology_is_blind() {
        // PCIe pairs: GPU 0 busy; one whole GPU takes 1 (its pair is gone), not 2.
        let mut ledger = ledger_with(pcie8(), 8);
        let d = GpuDemand::whole(1);
        let p = ledger.node(0).plan(&task(d), None).expect("fits");
        ledger
            .commit(
                "a",
                &task(d),
                Placement {
                    node: 0,
                    containers: p,
                },
            )
            .expect("commit");
        let p = ledger.node(0).plan(&task(d), None).expect("fits");
        assert_eq!(p[0][0].gpu, 1);
        // Without a topology: the lowest-numbered fully free GPUs, as before.
        let blind = ledger_with(NodeTopology::default(), 8);
        let p = blind
            .node(0)
            .plan(&task(GpuDemand::whole(3)), None)
            .expect("fits");
        let set: Vec<u16> = p[0].iter().map(|g| g.gpu).collect();
        assert_eq!(set, [0, 1, 2]);
    }
}
