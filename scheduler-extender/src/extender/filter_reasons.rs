//! Filter's fast answers and the reasons it gives: an allocation-free fit for the
//! common one-demand shapes, the ledger's rejection reason computed without a plan, and
//! which rejections preemption can resolve. Checked against the ledger's full `fit` by
//! the property test below.

use vgpu_core::packing::{NodeState, Reject, Task};

/// An allocation-free feasibility check for the common case of one GPU demand
/// (one GPU container): the same rules as [`NodeState::plan`] (whole GPUs need
/// fully free GPUs of an allowed model; a share needs `count` distinct allowed
/// GPUs each with room, and taking one never changes another's room), so the
/// answer is exact. `None` when the task is not of that shape; filter then asks
/// the ledger's full `fit`, as it does for the reason of every rejection.
pub(super) fn quick_fit(node: &NodeState, task: &Task) -> Option<bool> {
    let [d] = task.gpus.as_slice() else {
        return None;
    };
    if task.cpu_milli > node.cpu_free || task.memory_mib > node.memory_free {
        return None;
    }
    let any_model = task.models.is_any();
    let whole = d.is_whole();
    let mut fitting = 0u32;
    for i in 0..node.gpus.len() {
        if !any_model && !task.models.allows(&node.spec.gpus[i].model) {
            continue;
        }
        let fits = if whole {
            node.gpu_fully_free(i)
        } else {
            node.share_fits(i, d)
        };
        if fits {
            fitting += 1;
            if fitting >= d.count {
                return Some(true);
            }
        }
    }
    Some(false)
}

/// The reason [`NodeState::fit`] gives when [`quick_fit`] said no, computed without
/// building a plan, for one GPU demand that is whole or a share of one GPU (the
/// common shapes; `None` otherwise, and the caller asks `fit`). The same rules as
/// `NodeState::plan` and its reasons, checked against `fit` by a property test.
pub(super) fn quick_reject(node: &NodeState, task: &Task) -> Option<Reject> {
    let [d] = task.gpus.as_slice() else {
        return None;
    };
    if task.cpu_milli > node.cpu_free || task.memory_mib > node.memory_free {
        return None;
    }
    if !(d.is_whole() || d.count == 1) {
        return None;
    }
    let allowed = |i: usize| task.models.is_any() || task.models.allows(&node.spec.gpus[i].model);
    let n = node.gpus.len();
    let have = (0..n).filter(|&i| allowed(i)).count();
    if have == 0 && !task.models.is_any() {
        return None; // the model reason: rare, left to `fit`
    }
    if have < d.count as usize {
        return Some(Reject::GpuCount {
            have,
            need: d.count,
        });
    }
    if d.is_whole() {
        let free = (0..n)
            .filter(|&i| allowed(i) && node.gpu_fully_free(i))
            .count();
        return (free < d.count as usize).then_some(Reject::WholeGpus {
            free,
            need: d.count,
        });
    }
    let mut max_milli = 0;
    let (mut with_compute, mut with_memory) = (0u32, 0u32);
    let mut memory: Option<(u64, u64)> = None;
    let mut max_slices = 0;
    for i in (0..n).filter(|&i| allowed(i)) {
        let g = &node.gpus[i];
        max_milli = max_milli.max(g.milli);
        if g.milli < d.compute_milli {
            continue;
        }
        with_compute += 1;
        let need = d.memory.resolve(node.spec.gpus[i].memory_mib);
        memory = memory.max(Some((g.memory_mib, need)));
        if g.memory_mib >= need {
            with_memory += 1;
            max_slices = max_slices.max(g.slices);
        }
    }
    Some(if with_compute < d.count {
        Reject::GpuCompute {
            max_free: max_milli,
            need: d.compute_milli,
            count: d.count,
        }
    } else if with_memory < d.count {
        let (max_free, need) = memory.unwrap_or((0, 0));
        Reject::GpuMemory { max_free, need }
    } else {
        Reject::GpuSlices {
            max_free: max_slices,
            need: d.slices,
            per_gpu: node.spec.slices_per_gpu,
        }
    })
}

/// Classifies a rejection: can preemption (freeing GPU shares) help?
pub(super) fn resolvable(reject: &Reject) -> bool {
    matches!(
        reject,
        Reject::Cpu { .. }
            | Reject::Memory { .. }
            | Reject::WholeGpus { .. }
            | Reject::GpuCompute { .. }
            | Reject::GpuMemory { .. }
            | Reject::GpuSlices { .. }
    ) || matches!(reject, Reject::Topology { ever: true, .. })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use vgpu_core::packing::{GpuSpec, Ledger, NodeSpec, Placement};
    use vgpu_core::resources::{GpuDemand, MemoryDemand, ModelConstraint};

    fn demand() -> impl Strategy<Value = GpuDemand> {
        prop_oneof![
            (1u32..=4).prop_map(GpuDemand::whole),
            (1u32..=9, 1u32..=3, proptest::option::of(1u64..=40_000)).prop_map(
                |(sl, count, mib)| GpuDemand {
                    count,
                    compute_milli: sl * 100,
                    memory: mib.map_or(MemoryDemand::FractionMilli(sl * 100), MemoryDemand::Mib),
                    slices: sl,
                }
            ),
        ]
    }

    proptest! {
        /// The allocation-free fast paths agree with the ledger's full fit, reasons included.
        #[test]
        fn quick_fit_agrees_with_fit(
            gpus in proptest::collection::vec((prop::bool::ANY, prop::bool::ANY), 1..8),
            placed in proptest::collection::vec(demand(), 0..12),
            probe in demand(),
            constrained in prop::bool::ANY,
        ) {
            let spec = NodeSpec {
                topology: Default::default(),
                name: "n".into(),
                cpu_milli: 0,
                memory_mib: 0,
                gpus: gpus
                    .iter()
                    .enumerate()
                    .map(|(i, (big, t4))| GpuSpec {
                        uuid: format!("GPU-{i}"),
                        model: if *t4 { "T4".into() } else { "A100".into() },
                        memory_mib: if *big { 81_920 } else { 16_384 },
                    })
                    .collect(),
                slices_per_gpu: vgpu_core::resources::SLICES_PER_GPU,
            };
            let mut ledger = Ledger::with_nodes([spec]).expect("one node");
            for (k, d) in placed.into_iter().enumerate() {
                let task = Task { cpu_milli: 0, memory_mib: 0, gpus: vec![d], models: ModelConstraint::any() };
                if let Ok(plan) = ledger.node(0).fit(&task) {
                    ledger
                        .commit(&format!("p{k}"), &task, Placement { node: 0, containers: plan })
                        .expect("a fitting plan commits");
                }
            }
            let models = if constrained { ModelConstraint::only(["A100"]) } else { ModelConstraint::any() };
            let task = Task { cpu_milli: 0, memory_mib: 0, gpus: vec![probe], models };
            let node = ledger.node(0);
            let fit = node.fit(&task);
            prop_assert_eq!(quick_fit(node, &task), Some(fit.is_ok()));
            if let Err(reason) = fit {
                let quick = quick_reject(node, &task);
                let simple = probe.is_whole() || probe.count == 1;
                prop_assert_eq!(quick.is_some(), simple && !matches!(reason, Reject::Model { .. }));
                if let Some(quick) = quick {
                    prop_assert_eq!(quick, reason);
                }
            }
        }
    }
}
