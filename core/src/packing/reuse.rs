//! Kubelet's device reuse between the containers of one pod, and what it means for
//! placement (ADR 0011).
//!
//! Kubelet's device manager (`pkg/kubelet/cm/devicemanager/manager.go`, `Allocate` and
//! `devicesToAllocate`) keeps, per pod, a pool of reusable devices:
//!
//! - containers are allocated in order: init containers (spec order), then app
//!   containers (spec order);
//! - every container first takes devices from the pool, in Go set iteration order
//!   (arbitrary), and only then gets new ones (`GetPreferredAllocation` with
//!   `must_include` = the reused ones);
//! - an init container's devices (reused ones and new ones) go into the pool; an app
//!   container's and a sidecar's (`restartPolicy: Always`) are taken out of it;
//! - every device a pod was given stays allocated at kubelet while the pod lives.
//!
//! So which GPUs a container's devices are on depends on the containers before it.
//! [`layout`] groups the containers that the pool ties together (a *reuse group*: an
//! init container that fills an empty pool and every later container that takes from
//! the pool before it is empty again) and refuses the combinations where kubelet's
//! arbitrary order could put a container on GPUs other than its assignment. A group
//! is placed as one ledger entry, on one GPU set, holding its peak: the most its
//! members use at one time (an init container runs with the sidecars started before
//! it; the app containers run with every sidecar), and the slices kubelet actually
//! hands out (the pool is reused, not added to).

use crate::resources::{
    ContainerDemand, ContainerKind, GpuDemand, MILLI_PER_GPU, MemoryDemand, ResourceError,
    SLICES_PER_GPU,
};

use super::ledger::Grant;

/// One ledger entry of a pod: a container on its own, or a reuse group.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ReuseSlot {
    /// Indices of the members in the pod's containers (kubelet's order).
    pub members: Vec<usize>,
    /// What the members hold together on each of their GPUs: the container's own
    /// demand for a single member, the group's peak otherwise.
    pub demand: GpuDemand,
}

/// The ledger entries of a pod whose GPU containers are `containers` (kubelet's order:
/// init containers, sidecars included, then app containers), in the order of their
/// first member; or why kubelet's device reuse makes the pod impossible to assign.
pub fn layout(containers: &[ContainerDemand]) -> Result<Vec<ReuseSlot>, ResourceError> {
    struct Open {
        members: Vec<usize>,
        /// Devices per GPU in the pool.
        pool: u32,
    }
    let names = |members: &[usize]| -> Vec<String> {
        members
            .iter()
            .map(|&i| containers[i].name.clone())
            .collect()
    };
    let mut slots = Vec::new();
    let mut open: Option<Open> = None;
    let mut seen_app = false;
    for (i, c) in containers.iter().enumerate() {
        let d = &c.demand;
        if c.kind == ContainerKind::App {
            seen_app = true;
        } else if seen_app {
            return Err(ResourceError::Reuse {
                containers: vec![c.name.clone()],
                reason: "an init container listed after an app container (kubelet allocates init containers first)".into(),
            });
        }
        let Some(g) = open.as_mut() else {
            if c.kind == ContainerKind::Init && d.slices > 0 {
                open = Some(Open {
                    members: vec![i],
                    pool: d.slices,
                });
            } else {
                slots.push(ReuseSlot {
                    members: vec![i],
                    demand: *d,
                });
            }
            continue;
        };
        let count = containers[g.members[0]].demand.count;
        if d.count != count {
            let mut m = g.members.clone();
            m.push(i);
            return Err(ResourceError::Reuse {
                containers: names(&m),
                reason: format!(
                    "kubelet gives {:?} first the devices that the init containers before it left to the pod, \
                     so it must use the same GPUs as they do, but it asks for {} GPU(s) and they for {count}: \
                     give them the same {} (ADR 0011)",
                    c.name,
                    d.count,
                    crate::resources::RESOURCE_GPU_COUNT
                ),
            });
        }
        if count > 1 && d.slices < g.pool {
            let mut m = g.members.clone();
            m.push(i);
            return Err(ResourceError::Reuse {
                containers: names(&m),
                reason: format!(
                    "kubelet gives {:?} {} of the {} devices that the init containers before it left on {count} GPUs, \
                     picked in arbitrary order, so they may lie on fewer GPUs than its assignment: \
                     ask for at least {} slices per GPU in {:?} ({} >= {}) (ADR 0011)",
                    c.name,
                    d.slices * count,
                    g.pool * count,
                    g.pool,
                    c.name,
                    crate::resources::RESOURCE_GPU,
                    g.pool * count
                ),
            });
        }
        let draw = d.slices.min(g.pool);
        g.members.push(i);
        if c.kind == ContainerKind::Init {
            g.pool += d.slices - draw;
        } else {
            g.pool -= draw;
        }
        if g.pool == 0
            && let Some(g) = open.take()
        {
            slots.push(close(containers, g.members)?);
        }
    }
    if let Some(g) = open {
        slots.push(close(containers, g.members)?);
    }
    slots.sort_by_key(|s| s.members[0]);
    Ok(slots)
}

/// The members (positions into `kinds`) that run at the same time: each init
/// container with the sidecars started before it, then every sidecar and app
/// container together.
fn phases(kinds: &[ContainerKind]) -> Vec<Vec<usize>> {
    let mut out = Vec::new();
    let mut sidecars = Vec::new();
    let mut apps = Vec::new();
    for (j, k) in kinds.iter().enumerate() {
        match k {
            ContainerKind::Init => {
                let mut p = sidecars.clone();
                p.push(j);
                out.push(p);
            }
            ContainerKind::Sidecar => sidecars.push(j),
            ContainerKind::App => apps.push(j),
        }
    }
    sidecars.extend(apps);
    if !sidecars.is_empty() {
        out.push(sidecars);
    }
    out
}

/// The devices kubelet hands a group on one GPU: members in kubelet's order, each
/// taking `slices` there, from the pool first.
fn devices_held(kinds: &[ContainerKind], slices: &[u32]) -> u32 {
    let (mut pool, mut held) = (0u32, 0u32);
    for (k, &s) in kinds.iter().zip(slices) {
        let draw = s.min(pool);
        held += s - draw;
        if *k == ContainerKind::Init {
            pool += s - draw;
        } else {
            pool -= draw;
        }
    }
    held
}

/// A memory demand as (milli of the GPU's memory, MiB) added together.
fn memory_term(m: MemoryDemand) -> (u32, u64) {
    match m {
        MemoryDemand::FractionMilli(f) => (f, 0),
        MemoryDemand::Mib(b) => (0, b),
        MemoryDemand::MaxOf(t) => (t[0].0.max(t[1].0), t[0].1.max(t[1].1)),
    }
}

/// The group's reservation: its peak of compute and memory, the devices kubelet hands it.
fn close(containers: &[ContainerDemand], members: Vec<usize>) -> Result<ReuseSlot, ResourceError> {
    if let [only] = members.as_slice() {
        return Ok(ReuseSlot {
            members: vec![*only],
            demand: containers[*only].demand,
        });
    }
    let names: Vec<String> = members
        .iter()
        .map(|&i| containers[i].name.clone())
        .collect();
    let fail = |reason: String| ResourceError::Reuse {
        containers: names.clone(),
        reason,
    };
    let demands: Vec<&GpuDemand> = members.iter().map(|&i| &containers[i].demand).collect();
    let kinds: Vec<ContainerKind> = members.iter().map(|&i| containers[i].kind).collect();
    let mut compute = 0u32;
    let mut terms: Vec<(u32, u64)> = Vec::new();
    for phase in phases(&kinds) {
        let milli: u32 = phase.iter().map(|&j| demands[j].compute_milli).sum();
        compute = compute.max(milli);
        let term = phase.iter().fold((0u32, 0u64), |(f, b), &j| {
            let (f2, b2) = memory_term(demands[j].memory);
            (f + f2, b.saturating_add(b2))
        });
        terms.push(term);
    }
    let shared = "kubelet's device reuse puts them on the same GPU(s)";
    if compute > MILLI_PER_GPU {
        return Err(fail(format!(
            "{shared}, where at their peak they need {:.3} GPU of compute on each (ADR 0011)",
            f64::from(compute) / 1000.0
        )));
    }
    if let Some((f, _)) = terms.iter().find(|(f, _)| *f > MILLI_PER_GPU) {
        return Err(fail(format!(
            "{shared}, where at their peak they need {:.1} % of each GPU's memory (ADR 0011)",
            f64::from(*f) / 10.0
        )));
    }
    let slices: Vec<u32> = demands.iter().map(|d| d.slices).collect();
    let held = devices_held(&kinds, &slices);
    if held > SLICES_PER_GPU {
        return Err(fail(format!(
            "{shared}, where kubelet hands them {held} slices of {} on each, more than {SLICES_PER_GPU} (ADR 0011)",
            crate::resources::RESOURCE_GPU
        )));
    }
    Ok(ReuseSlot {
        members,
        demand: GpuDemand {
            count: demands[0].count,
            compute_milli: compute,
            memory: peak_memory(terms),
            slices: held,
        },
    })
}

/// The larger of the phases' memory terms, exactly where at most two of them are not
/// dominated by another (always when every container asks in one unit); otherwise an
/// upper bound (the largest fraction plus the largest MiB).
fn peak_memory(terms: Vec<(u32, u64)>) -> MemoryDemand {
    let mut keep: Vec<(u32, u64)> = Vec::new();
    for &t in &terms {
        let dominated = terms.iter().any(|&o| o != t && o.0 >= t.0 && o.1 >= t.1);
        if !dominated && !keep.contains(&t) {
            keep.push(t);
        }
    }
    match keep.as_slice() {
        [(f, 0)] => MemoryDemand::FractionMilli(*f),
        [(0, b)] => MemoryDemand::Mib(*b),
        [t] => MemoryDemand::MaxOf([*t, *t]),
        [a, b] => MemoryDemand::MaxOf([*a, *b]),
        more => {
            let f = more.iter().map(|t| t.0).max().unwrap_or(0);
            let b = more.iter().map(|t| t.1).max().unwrap_or(0);
            MemoryDemand::MaxOf([(f, b), (f, b)])
        }
    }
}

/// Each container's grants (the pod's containers' order) from the grants of its
/// ledger entry (`slot_grants`, one list per slot of `slots`, as [`layout`] returned
/// them): a reuse group's members each get their own share on every GPU of the group.
/// `gpu_memory` gives a GPU's total memory in MiB by its index.
pub fn expand(
    containers: &[ContainerDemand],
    slots: &[ReuseSlot],
    slot_grants: &[Vec<Grant>],
    gpu_memory: impl Fn(u16) -> u64,
) -> Vec<Vec<Grant>> {
    let mut out = vec![Vec::new(); containers.len()];
    for (slot, grants) in slots.iter().zip(slot_grants) {
        if let [only] = slot.members.as_slice() {
            out[*only].clone_from(grants);
            continue;
        }
        for &m in &slot.members {
            let d = &containers[m].demand;
            out[m] = grants
                .iter()
                .map(|g| Grant {
                    gpu: g.gpu,
                    milli: d.compute_milli.min(MILLI_PER_GPU),
                    memory_mib: d.memory.resolve(gpu_memory(g.gpu)),
                    slices: d.slices,
                })
                .collect();
        }
    }
    out
}

/// What a pod holds per ledger entry, from each container's recorded grants
/// (`container_grants`, the pod's containers' order): a reuse group holds, on each of
/// its GPUs, the peak of its members' grants and the devices kubelet hands them.
/// `None` when the grants do not follow the layout (a group's members on different
/// GPUs, a record from before reuse groups): the caller then counts every container
/// on its own.
pub fn held(
    containers: &[ContainerDemand],
    slots: &[ReuseSlot],
    container_grants: &[Vec<Grant>],
) -> Option<Vec<Vec<Grant>>> {
    if container_grants.len() != containers.len() {
        return None;
    }
    let mut out = Vec::with_capacity(slots.len());
    for slot in slots {
        if let [only] = slot.members.as_slice() {
            out.push(container_grants[*only].clone());
            continue;
        }
        let gpus = |m: usize| {
            let mut v: Vec<u16> = container_grants[m].iter().map(|g| g.gpu).collect();
            v.sort_unstable();
            v
        };
        let first = gpus(slot.members[0]);
        if first.is_empty() || slot.members.iter().any(|&m| gpus(m) != first) {
            return None;
        }
        let kinds: Vec<ContainerKind> = slot.members.iter().map(|&m| containers[m].kind).collect();
        let mut grants = Vec::with_capacity(first.len());
        for &gpu in &first {
            let on: Vec<&Grant> = slot
                .members
                .iter()
                .filter_map(|&m| container_grants[m].iter().find(|g| g.gpu == gpu))
                .collect();
            let (mut milli, mut memory_mib) = (0u32, 0u64);
            for phase in phases(&kinds) {
                milli = milli.max(phase.iter().map(|&j| on[j].milli).sum());
                memory_mib = memory_mib.max(phase.iter().map(|&j| on[j].memory_mib).sum());
            }
            let slices: Vec<u32> = on.iter().map(|g| g.slices).collect();
            grants.push(Grant {
                gpu,
                milli,
                memory_mib,
                slices: devices_held(&kinds, &slices),
            });
        }
        out.push(grants);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests: a panic is the failure report

    use std::collections::BTreeMap;

    use proptest::prelude::*;

    use super::*;
    use crate::packing::{GpuSpec, Ledger, NodeSpec, Task};
    use crate::resources::{ContainerKind::*, parse_container_request};

    fn c(name: &str, kind: ContainerKind, req: &[(&str, &str)]) -> ContainerDemand {
        let r: BTreeMap<String, String> = req
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        ContainerDemand {
            name: name.into(),
            demand: parse_container_request(name, &r).unwrap().unwrap(),
            kind,
        }
    }

    fn gpu(n: &str) -> [(&'static str, &str); 1] {
        [("vgpu.io/gpu", n)]
    }

    fn members(slots: &[ReuseSlot]) -> Vec<Vec<usize>> {
        slots.iter().map(|s| s.members.clone()).collect()
    }

    #[test]
    fn without_init_containers_every_container_is_its_own_entry() {
        let cs = [
            c("a", App, &gpu("3")),
            c("b", App, &gpu("20")),
            c("side", Sidecar, &gpu("2")),
        ];
        // (A sidecar listed after an app container is out of kubelet's order.)
        assert!(layout(&cs).is_err());
        let cs = [
            c("side", Sidecar, &gpu("2")),
            c("a", App, &gpu("3")),
            c("b", App, &gpu("20")),
        ];
        let slots = layout(&cs).unwrap();
        assert_eq!(members(&slots), vec![vec![0], vec![1], vec![2]]);
        for (s, c) in slots.iter().zip(&cs) {
            assert_eq!(
                s.demand, c.demand,
                "unchanged: the replay's tasks stay as they are"
            );
        }
    }

    #[test]
    fn init_and_app_share_one_gpu_at_their_peak() {
        // Init 0.3, app 0.5: the app reuses the init's 3 devices and gets 2 more.
        let cs = [c("init", Init, &gpu("3")), c("app", App, &gpu("5"))];
        let slots = layout(&cs).unwrap();
        assert_eq!(members(&slots), vec![vec![0, 1]]);
        let d = slots[0].demand;
        assert_eq!((d.count, d.compute_milli, d.slices), (1, 500, 5));
        assert_eq!(d.memory, MemoryDemand::FractionMilli(500));
        // Init 0.5, app 0.3: the app takes 3 of the init's 5; kubelet holds 5.
        let cs = [c("init", Init, &gpu("5")), c("app", App, &gpu("3"))];
        let d = layout(&cs).unwrap()[0].demand;
        assert_eq!((d.compute_milli, d.slices), (500, 5));
        // Two apps drain the pool: the second one takes the last 2 and 1 new device.
        let cs = [
            c("init", Init, &gpu("5")),
            c("a", App, &gpu("3")),
            c("b", App, &gpu("3")),
            c("c", App, &gpu("4")),
        ];
        let slots = layout(&cs).unwrap();
        assert_eq!(
            members(&slots),
            vec![vec![0, 1, 2], vec![3]],
            "c takes no reused device"
        );
        let d = slots[0].demand;
        assert_eq!((d.compute_milli, d.slices), (600, 6));
    }

    #[test]
    fn whole_gpus_and_mixed_memory_units() {
        let cs = [c("init", Init, &gpu("10")), c("app", App, &gpu("3"))];
        let d = layout(&cs).unwrap()[0].demand;
        assert!(d.is_whole());
        assert_eq!(d.slices, 10);
        let cs = [c("init", Init, &gpu("20")), c("app", App, &gpu("20"))];
        let d = layout(&cs).unwrap()[0].demand;
        assert_eq!((d.count, d.is_whole(), d.slices), (2, true, 10));
        let cs = [
            c(
                "init",
                Init,
                &[("vgpu.io/gpu", "1"), ("vgpu.io/gpu-memory", "4096")],
            ),
            c("app", App, &gpu("5")),
        ];
        let d = layout(&cs).unwrap()[0].demand;
        assert_eq!(d.memory, MemoryDemand::MaxOf([(0, 4096), (500, 0)]));
        assert_eq!(d.memory.resolve(16384), 8192);
        assert_eq!(d.memory.resolve(6144), 4096);
    }

    #[test]
    fn sidecars_take_from_the_pool_and_keep_their_devices() {
        // The sidecar drains the init's pool: {init, side} share a GPU; the app is free.
        let cs = [
            c("init", Init, &gpu("3")),
            c("side", Sidecar, &gpu("3")),
            c("app", App, &gpu("4")),
        ];
        assert_eq!(members(&layout(&cs).unwrap()), vec![vec![0, 1], vec![2]]);
        // A sidecar before any init container takes nothing; the second init runs with it.
        let cs = [
            c("side", Sidecar, &gpu("2")),
            c("init", Init, &gpu("3")),
            c("app", App, &gpu("3")),
        ];
        assert_eq!(members(&layout(&cs).unwrap()), vec![vec![0], vec![1, 2]]);
        // A sidecar inside a group runs alongside the later init container and the apps.
        let cs = [
            c("init", Init, &gpu("6")),
            c(
                "side",
                Sidecar,
                &[("vgpu.io/gpu", "3"), ("vgpu.io/gpu-compute", "60")],
            ),
            c("app", App, &gpu("7")),
        ];
        let e = layout(&cs).unwrap_err().to_string();
        assert!(
            e.contains("\"init\", \"side\", \"app\"") && e.contains("1.300 GPU of compute"),
            "{e}"
        );
    }

    #[test]
    fn combinations_kubelet_cannot_place_consistently_are_refused_by_name() {
        // 8 + 2 + 9: the last app takes the 6 devices left and 3 new ones: 11 on one GPU.
        let cs = [
            c("init", Init, &gpu("8")),
            c("a", App, &gpu("2")),
            c(
                "b",
                App,
                &[
                    ("vgpu.io/gpu", "9"),
                    ("vgpu.io/gpu-compute", "10"),
                    ("vgpu.io/gpu-memory", "1024"),
                ],
            ),
        ];
        let e = layout(&cs).unwrap_err().to_string();
        assert!(
            e.contains("\"init\", \"a\", \"b\"") && e.contains("11 slices"),
            "{e}"
        );
        // Two whole GPUs in the pool, the app wants half of each: kubelet's 10 picks of
        // the 20 devices may all lie on one GPU.
        let cs = [
            c("init", Init, &gpu("20")),
            c(
                "app",
                App,
                &[("vgpu.io/gpu", "10"), ("vgpu.io/gpu-count", "2")],
            ),
        ];
        let e = layout(&cs).unwrap_err().to_string();
        assert!(
            e.contains("\"init\", \"app\"") && e.contains("arbitrary order"),
            "{e}"
        );
        let cs = [c("init", Init, &gpu("3")), c("app", App, &gpu("20"))];
        let e = layout(&cs).unwrap_err().to_string();
        assert!(
            e.contains("\"init\", \"app\"") && e.contains("vgpu.io/gpu-count"),
            "{e}"
        );
    }

    #[test]
    fn the_ledger_holds_the_peak_not_the_sum() {
        // One GPU with 0.6 free: an init of 0.5 and an app of 0.5 fit (they never run
        // together); reserved separately they would need 1.0.
        let spec = NodeSpec {
            topology: Default::default(),
            name: "n".into(),
            cpu_milli: 1000,
            memory_mib: 1024,
            gpus: vec![GpuSpec {
                uuid: "GPU-0".into(),
                model: "A100".into(),
                memory_mib: 40960,
            }],
            slices_per_gpu: SLICES_PER_GPU,
        };
        let mut ledger = Ledger::with_nodes([spec]).unwrap();
        let other = Task {
            cpu_milli: 0,
            memory_mib: 0,
            gpus: vec![c("x", App, &gpu("4")).demand],
            models: Default::default(),
        };
        let p = ledger.node(0).fit(&other).unwrap();
        ledger
            .commit(
                "other",
                &other,
                crate::packing::Placement {
                    node: 0,
                    containers: p,
                },
            )
            .unwrap();
        let cs = [c("init", Init, &gpu("5")), c("app", App, &gpu("5"))];
        let slots = layout(&cs).unwrap();
        let task = Task {
            cpu_milli: 0,
            memory_mib: 0,
            gpus: slots.iter().map(|s| s.demand).collect(),
            models: Default::default(),
        };
        let grants = ledger.node(0).fit(&task).unwrap();
        let per = expand(&cs, &slots, &grants, |_| 40960);
        assert_eq!(per[0][0].milli, 500);
        assert_eq!(per[1][0].milli, 500);
        assert_eq!(per[0][0].gpu, per[1][0].gpu);
        assert_eq!(
            held(&cs, &slots, &per).unwrap(),
            grants,
            "the record reads back"
        );
        ledger
            .commit(
                "pod",
                &task,
                crate::packing::Placement {
                    node: 0,
                    containers: grants,
                },
            )
            .unwrap();
        assert_eq!(ledger.node(0).gpus[0].milli, 100);
        assert_eq!(ledger.node(0).gpus[0].slices, 1);
        // A record whose init and app are on different GPUs counts each on its own.
        let mut split = per.clone();
        split[1][0].gpu = 1;
        assert!(held(&cs, &slots, &split).is_none());
    }

    /// A tiny deterministic generator (the order kubelet's Go set iteration picks).
    fn shuffle<T>(v: &mut [T], seed: &mut u64) {
        for i in (1..v.len()).rev() {
            *seed ^= *seed << 13;
            *seed ^= *seed >> 7;
            *seed ^= *seed << 17;
            let j = usize::try_from(*seed % (i as u64 + 1)).unwrap();
            v.swap(i, j);
        }
    }

    /// Each container's devices per GPU, and the devices the pod holds per GPU.
    type Handed = (Vec<BTreeMap<u16, u32>>, Vec<u32>);

    /// Kubelet's device manager over one pod (per `manager.go`): every container takes
    /// from the pool first in arbitrary order, then new devices where the device
    /// plugin's preference (its assignment's GPUs, `must_include` kept) puts them.
    /// Returns each container's devices as (gpu, count) or why the plugin's step 5
    /// would refuse it.
    fn kubelet(
        cs: &[ContainerDemand],
        per: &[Vec<Grant>],
        gpus: usize,
        seed: u64,
    ) -> Result<Handed, String> {
        let mut seed = seed | 1;
        let mut free: Vec<Vec<(u16, u32)>> = (0..gpus)
            .map(|g| (0..10).map(|s| (g as u16, s)).collect())
            .collect();
        let mut pool: Vec<(u16, u32)> = Vec::new();
        let mut out = Vec::new();
        for (c, grants) in cs.iter().zip(per) {
            let n = (c.demand.count * c.demand.slices) as usize;
            shuffle(&mut pool, &mut seed);
            let drawn: Vec<(u16, u32)> = pool.iter().take(n).copied().collect();
            let mut mine = drawn.clone();
            if drawn.len() < n {
                for g in grants {
                    let must = drawn.iter().filter(|d| d.0 == g.gpu).count() as u32;
                    let need = g.slices.checked_sub(must).ok_or_else(|| {
                        format!(
                            "{}: {must} reused devices on GPU {} > {}",
                            c.name, g.gpu, g.slices
                        )
                    })?;
                    let f = &mut free[usize::from(g.gpu)];
                    if (f.len() as u32) < need {
                        return Err(format!(
                            "{}: GPU {} has too few free devices",
                            c.name, g.gpu
                        ));
                    }
                    mine.extend(f.drain(..need as usize));
                }
            }
            let mut on: BTreeMap<u16, u32> = BTreeMap::new();
            for d in &mine {
                *on.entry(d.0).or_default() += 1;
            }
            let want: BTreeMap<u16, u32> = grants.iter().map(|g| (g.gpu, g.slices)).collect();
            if on.keys().ne(want.keys()) || mine.len() != n {
                return Err(format!("{}: devices on {on:?}, assigned {want:?}", c.name));
            }
            if c.kind == Init {
                for d in &mine {
                    if !pool.contains(d) {
                        pool.push(*d);
                    }
                }
            } else {
                pool.retain(|p| !mine.contains(p));
            }
            out.push(on);
        }
        let taken = free.iter().map(|f| 10 - f.len() as u32).collect();
        Ok((out, taken))
    }

    fn arb_container() -> impl Strategy<Value = (u8, u32, u32)> {
        // (kind: 0 init, 1 sidecar, 2 app; GPUs 1-2; slices per GPU 1-10)
        (0u8..3, 1u32..3, 1u32..11)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(400))]

        /// Whatever order kubelet takes reused devices in, every container's devices
        /// lie on exactly the GPUs of its assignment, and the pod never holds more on
        /// a GPU than its ledger entries reserve there (devices, and compute at every
        /// moment: each init container with the sidecars before it, then all sidecars
        /// and app containers).
        #[test]
        fn reuse_groups_are_consistent_whatever_kubelet_picks(
            raw in proptest::collection::vec(arb_container(), 1..6),
            seed in any::<u64>(),
        ) {
            let mut raw = raw;
            raw.sort_by_key(|(k, _, _)| u8::from(*k == 2));
            let cs: Vec<ContainerDemand> = raw.iter().enumerate().map(|(i, &(k, n, s))| {
                let kind = [Init, Sidecar, App][usize::from(k)];
                let total = (n * s).to_string();
                let count = n.to_string();
                c(&format!("c{i}"), kind, &[("vgpu.io/gpu", total.as_str()), ("vgpu.io/gpu-count", count.as_str())])
            }).collect();
            let Ok(slots) = layout(&cs) else { return Ok(()) };
            let gpus = 6;
            let spec = NodeSpec {
                topology: Default::default(),
                name: "n".into(),
                cpu_milli: 1000,
                memory_mib: 1024,
                gpus: (0..gpus).map(|i| GpuSpec { uuid: format!("GPU-{i}"), model: "A100".into(), memory_mib: 40960 }).collect(),
                slices_per_gpu: SLICES_PER_GPU,
            };
            let ledger = Ledger::with_nodes([spec]).unwrap();
            let task = Task {
                cpu_milli: 0,
                memory_mib: 0,
                gpus: slots.iter().map(|s| s.demand).collect(),
                models: Default::default(),
            };
            let Ok(grants) = ledger.node(0).fit(&task) else { return Ok(()) };
            let per = expand(&cs, &slots, &grants, |_| 40960);
            let back = held(&cs, &slots, &per);
            prop_assert_eq!(back.as_ref(), Some(&grants));
            let mut reserved_slices = vec![0u32; gpus];
            let mut reserved_milli = vec![0u32; gpus];
            for g in grants.iter().flatten() {
                reserved_slices[usize::from(g.gpu)] += g.slices;
                reserved_milli[usize::from(g.gpu)] += g.milli;
            }
            let kinds: Vec<ContainerKind> = cs.iter().map(|c| c.kind).collect();
            for ph in phases(&kinds) {
                let mut used = vec![0u32; gpus];
                for &j in &ph {
                    for g in &per[j] {
                        used[usize::from(g.gpu)] += g.milli;
                    }
                }
                for i in 0..gpus {
                    prop_assert!(used[i] <= reserved_milli[i], "GPU {}: {} > {} reserved", i, used[i], reserved_milli[i]);
                }
            }
            let mut s = seed;
            for _ in 0..8 {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let got = kubelet(&cs, &per, gpus, s);
                prop_assert!(got.is_ok(), "{:?}", got);
                let (on, taken) = got.unwrap();
                for (j, on) in on.iter().enumerate() {
                    for g in &per[j] {
                        prop_assert_eq!(on.get(&g.gpu).copied(), Some(g.slices), "{}", cs[j].name);
                    }
                }
                for i in 0..gpus {
                    prop_assert!(taken[i] <= reserved_slices[i], "GPU {}: kubelet holds {} devices, {} reserved", i, taken[i], reserved_slices[i]);
                }
            }
        }
    }
}
