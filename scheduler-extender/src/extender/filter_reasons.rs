//! Filter's fast answers and the reasons it gives: an allocation-free fit for the
//! common one-demand shapes, the ledger's rejection reason computed without a plan, and
//! which rejections preemption can resolve. Checked against the ledger's full `fit` by
//! the property test in [`super::cluster`].

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
    )
}
