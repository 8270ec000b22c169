//! GPU memory reserved for CUDA contexts when placing, so that every quota granted can
//! be allocated (ADR 0012). The one rule the extender and the trace replay both apply.
//!
//! A process's CUDA context takes GPU memory outside its container's quota (ADR 0008:
//! the quota is what the application can allocate). Packing quotas into the whole of a
//! GPU's memory therefore over-commits it by the contexts: ten 1-slice containers on an
//! 80 GiB GPU got 8 GiB quotas each, and the last to fill its quota found only
//! `8192 − 10 × 300` MiB.
//!
//! The rule: each of a GPU's [`SLICES_PER_GPU`](crate::resources::SLICES_PER_GPU) slices carries one context's
//! reservation, and quotas (proportional ones and explicit `vgpu.io/gpu-memory`) are
//! packed into the rest, `total − 10 × context`. Every container holds at least one
//! slice of each of its GPUs, so at most 10 containers share a GPU, and as long as the
//! processes on a GPU hold at most one context per slice of their containers, every
//! container can allocate its whole quota at the same time.
//!
//! On a node configured for fine sharing (ADR 0023: up to 100 slices, so up to 100
//! containers, per GPU) the same rule reserves one context per slice the GPU advertises,
//! `total − slices_per_gpu × context`: at 100 containers each of them can still allocate
//! its quota. The price is memory the quotas cannot use while fewer containers are there
//! (29.3 GiB of an 80 GiB GPU at 300 MiB per context); ADR 0023 says why a reservation
//! charged per slice granted was left for later.

use crate::resources::GpuDemand;

use super::ledger::NodeSpec;

/// Default reservation per CUDA context, MiB: the simulator's figure, and within the
/// 100–500 MiB a context of a current driver takes (ADR 0008, ADR 0012).
pub const DEFAULT_CONTEXT_MIB: u64 = 300;

/// Largest reservation accepted, MiB: far above any context, far below a GPU; a larger
/// number is almost always a unit mistake.
pub const MAX_CONTEXT_MIB: u64 = 8192;

/// Why a context reservation cannot be applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ContextReserveError {
    /// The reservation is larger than any context.
    #[error(
        "context reservation {mib} MiB is more than {MAX_CONTEXT_MIB} MiB (a CUDA context takes 100–500 MiB; the unit is MiB)"
    )]
    TooLarge {
        /// The reservation asked for.
        mib: u64,
    },
    /// A GPU is too small to hold the contexts of all its slices and any quota.
    #[error(
        "GPU {uuid} has {total_mib} MiB: no memory left for quotas after {slices} CUDA contexts of {context_mib} MiB (one per slice, ADR 0012, ADR 0023)"
    )]
    GpuTooSmall {
        /// The GPU.
        uuid: String,
        /// Its memory, MiB.
        total_mib: u64,
        /// The reservation per context, MiB.
        context_mib: u64,
        /// The GPU's slices (contexts reserved).
        slices: u32,
    },
}

/// The memory reserved on every GPU for each of its slices' CUDA context.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ContextReserve {
    mib: u64,
}

impl Default for ContextReserve {
    fn default() -> Self {
        ContextReserve {
            mib: DEFAULT_CONTEXT_MIB,
        }
    }
}

impl std::fmt::Display for ContextReserve {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.mib)
    }
}

impl ContextReserve {
    /// No reservation: quotas packed into the whole GPU (the behaviour before ADR 0012,
    /// kept for the replay's comparison).
    pub const NONE: ContextReserve = ContextReserve { mib: 0 };

    /// A reservation of `mib` per context; refused above [`MAX_CONTEXT_MIB`].
    pub fn new(mib: u64) -> Result<Self, ContextReserveError> {
        if mib > MAX_CONTEXT_MIB {
            return Err(ContextReserveError::TooLarge { mib });
        }
        Ok(ContextReserve { mib })
    }

    /// MiB per context.
    pub fn mib(self) -> u64 {
        self.mib
    }

    /// What a GPU of `total_mib` with `slices` slices keeps for quotas: `total − slices ×
    /// context` (10 slices by default, up to 100 on a fine node, ADR 0023); an error
    /// naming the GPU when nothing would be left.
    pub fn quota_memory_mib(
        self,
        uuid: &str,
        total_mib: u64,
        slices: u32,
    ) -> Result<u64, ContextReserveError> {
        let reserved = self.mib.saturating_mul(u64::from(slices));
        match total_mib.checked_sub(reserved) {
            Some(left) if left > 0 => Ok(left),
            _ => Err(ContextReserveError::GpuTooSmall {
                uuid: uuid.to_owned(),
                total_mib,
                context_mib: self.mib,
                slices,
            }),
        }
    }

    /// A node as the ledger packs it: each GPU's memory is what it keeps for quotas.
    pub fn node_spec(self, mut spec: NodeSpec) -> Result<NodeSpec, ContextReserveError> {
        for g in &mut spec.gpus {
            g.memory_mib = self.quota_memory_mib(&g.uuid, g.memory_mib, spec.slices_per_gpu)?;
        }
        Ok(spec)
    }

    /// A demand as placed under the reservation: it holds at least one slice on each of
    /// its GPUs (one context's reservation), so that at most 10 demands share a GPU. A
    /// container's demand already does (`vgpu.io/gpu` ≥ 1); the trace's tasks, which
    /// model no slices, get one. Unchanged without a reservation.
    pub fn demand(self, d: GpuDemand) -> GpuDemand {
        if self.mib == 0 {
            return d;
        }
        GpuDemand {
            slices: d.slices.max(1),
            ..d
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests: a panic is the failure report

    use super::*;
    use crate::packing::{GpuSpec, Ledger, Placement, Task};
    use crate::resources::{ModelConstraint, SLICES_PER_GPU, parse_container_request};
    use std::collections::BTreeMap;

    /// The simulated H100: 80 GiB, 300 MiB per context (cuda-sim).
    const SIM_H100_MIB: u64 = 81_920;
    const SIM_CONTEXT_MIB: u64 = 300;

    fn one_gpu_node(total: u64) -> NodeSpec {
        NodeSpec {
            topology: Default::default(),
            name: "n".into(),
            cpu_milli: 0,
            memory_mib: 0,
            gpus: vec![GpuSpec {
                uuid: "GPU-0".into(),
                model: "H100".into(),
                memory_mib: total,
            }],
            slices_per_gpu: SLICES_PER_GPU,
        }
    }

    fn container(requests: &[(&str, &str)]) -> Task {
        let r: BTreeMap<String, String> = requests
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        Task {
            cpu_milli: 0,
            memory_mib: 0,
            gpus: vec![parse_container_request("c", &r).unwrap().unwrap()],
            models: ModelConstraint::any(),
        }
    }

    /// Places tasks one by one with the ledger's fit; returns the quotas granted.
    fn place_all(reserve: ContextReserve, total: u64, tasks: &[Task]) -> Vec<u64> {
        place_on(reserve, one_gpu_node(total), tasks)
    }

    /// [`place_all`] on a node of `spec`.
    fn place_on(reserve: ContextReserve, spec: NodeSpec, tasks: &[Task]) -> Vec<u64> {
        let spec = reserve.node_spec(spec).unwrap();
        let mut ledger = Ledger::with_nodes([spec]).unwrap();
        let mut quotas = Vec::new();
        for (k, t) in tasks.iter().enumerate() {
            let t = Task {
                gpus: t.gpus.iter().map(|d| reserve.demand(*d)).collect(),
                ..t.clone()
            };
            let Ok(grants) = ledger.node(0).fit(&t) else {
                continue;
            };
            quotas.push(grants[0][0].memory_mib);
            let placement = Placement {
                node: 0,
                containers: grants,
            };
            ledger.commit(&k.to_string(), &t, placement).unwrap();
        }
        quotas
    }

    #[test]
    fn ten_one_slice_containers_can_each_allocate_their_full_quota() {
        let tasks: Vec<Task> = (0..10)
            .map(|_| container(&[("vgpu.io/gpu", "1")]))
            .collect();
        let reserve = ContextReserve::new(SIM_CONTEXT_MIB).unwrap();
        let quotas = place_all(reserve, SIM_H100_MIB, &tasks);
        assert_eq!(quotas.len(), 10, "all ten are placed");
        // Every container fills its quota, each with its own context: the GPU holds it.
        let physical: u64 = quotas.iter().map(|q| q + SIM_CONTEXT_MIB).sum();
        assert!(
            physical <= SIM_H100_MIB,
            "quotas {quotas:?} plus 10 contexts = {physical} MiB > {SIM_H100_MIB} MiB"
        );
        assert_eq!(quotas[0], (SIM_H100_MIB - 10 * SIM_CONTEXT_MIB) / 10);
        // Without the reservation (the behaviour before ADR 0012) the same ten
        // containers over-commit the GPU by exactly their contexts.
        let before = place_all(ContextReserve::NONE, SIM_H100_MIB, &tasks);
        let physical: u64 = before.iter().map(|q| q + SIM_CONTEXT_MIB).sum();
        assert_eq!(physical, SIM_H100_MIB + 10 * SIM_CONTEXT_MIB);
    }

    #[test]
    fn a_fine_gpu_takes_one_hundred_containers_of_one_percent_each_with_its_context() {
        let fine = NodeSpec {
            slices_per_gpu: 100,
            ..one_gpu_node(SIM_H100_MIB)
        };
        let reserve = ContextReserve::new(SIM_CONTEXT_MIB).unwrap();
        // One context per slice the GPU advertises: 100 kept apart.
        let spec = reserve.node_spec(fine.clone()).unwrap();
        assert_eq!(
            spec.gpus[0].memory_mib,
            SIM_H100_MIB - 100 * SIM_CONTEXT_MIB
        );
        let one_percent = container(&[
            ("vgpu.io/gpu", "1"),
            ("vgpu.io/gpu-compute", "1"),
            ("vgpu.io/gpu-memory", "519"),
        ]);
        let quotas = place_on(reserve, fine.clone(), &vec![one_percent.clone(); 101]);
        assert_eq!(quotas.len(), 100, "100 placed, the 101st refused");
        let physical: u64 = quotas.iter().map(|q| q + SIM_CONTEXT_MIB).sum();
        assert!(physical <= SIM_H100_MIB, "{physical} MiB");
        // Compute alone would not stop an 11th container of 1 % on a 10-slice GPU: the
        // slices do.
        assert_eq!(
            place_all(reserve, SIM_H100_MIB, &vec![one_percent.clone(); 11]).len(),
            10
        );
        // A whole GPU on a fine node is exclusive and frees all 100 slices again.
        let spec = reserve.node_spec(fine).unwrap();
        let mut ledger = Ledger::with_nodes([spec]).unwrap();
        let whole = container(&[("vgpu.io/gpu", "10")]);
        let grants = ledger.node(0).fit(&whole).unwrap();
        assert_eq!(grants[0][0].slices, 10);
        let placement = Placement {
            node: 0,
            containers: grants,
        };
        ledger.commit("whole", &whole, placement).unwrap();
        assert!(ledger.node(0).fit(&one_percent).is_err(), "exclusive");
        ledger.release("whole").unwrap();
        assert!(ledger.node(0).gpu_fully_free(0));
        assert_eq!(ledger.node(0).gpus[0].slices, 100);
    }

    #[test]
    fn explicit_memory_requests_leave_the_contexts_reserved() {
        // Two containers asking 40 GiB each fitted an 80 GiB GPU exactly, leaving no
        // room for their contexts; now the second is refused there.
        let tasks: Vec<Task> = (0..2)
            .map(|_| container(&[("vgpu.io/gpu", "1"), ("vgpu.io/gpu-memory", "40960")]))
            .collect();
        let reserve = ContextReserve::default();
        assert_eq!(place_all(reserve, SIM_H100_MIB, &tasks), vec![40960]);
        assert_eq!(
            place_all(ContextReserve::NONE, SIM_H100_MIB, &tasks),
            vec![40960, 40960]
        );
    }

    #[test]
    fn at_most_ten_demands_share_a_gpu_even_without_slices() {
        // The trace's tasks model no slices; under the reservation each takes one, so
        // an eleventh context never lands on a GPU.
        let tasks: Vec<Task> = (0..12)
            .map(|_| Task {
                cpu_milli: 0,
                memory_mib: 0,
                gpus: vec![GpuDemand::share_milli(50)],
                models: ModelConstraint::any(),
            })
            .collect();
        assert_eq!(
            place_all(ContextReserve::default(), 16_384, &tasks).len(),
            10
        );
        assert_eq!(place_all(ContextReserve::NONE, 16_384, &tasks).len(), 12);
    }

    #[test]
    fn whole_gpus_and_bad_reservations() {
        let reserve = ContextReserve::default();
        let spec = reserve.node_spec(one_gpu_node(SIM_H100_MIB)).unwrap();
        assert_eq!(spec.gpus[0].memory_mib, SIM_H100_MIB - 3000);
        let e = ContextReserve::new(300_000).unwrap_err();
        assert!(e.to_string().contains("300000"), "{e}");
        let e = reserve.node_spec(one_gpu_node(3000)).unwrap_err();
        assert!(
            e.to_string().contains("GPU-0") && e.to_string().contains("3000 MiB"),
            "{e}"
        );
        assert_eq!(
            ContextReserve::NONE
                .quota_memory_mib("g", 1024, SLICES_PER_GPU)
                .unwrap(),
            1024
        );
    }
}
