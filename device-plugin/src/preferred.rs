//! `GetPreferredAllocation`: steer kubelet towards the GPUs the extender assigned to a
//! container still waiting for devices; else, for a request that needs several GPUs,
//! the best-connected set of them (`vgpu_core::topology`, issue 14); else pack onto the
//! tightest GPU. Only a preference: `PreStartContainer` identifies the container by
//! kubelet's record and refuses devices on other GPUs than its assignment.
//!
//! What kubelet asks for: `size` device IDs of `vgpu.io/gpu`, 0.1-GPU slices
//! `<gpu-uuid>-<slot>`, 10 per GPU; `vgpu.io/gpu-count` is not advertised, so kubelet
//! never sees it. A request needs several GPUs when it is larger than 10 slices (`20`:
//! two whole GPUs), when no single GPU has `size` slices left, or when the IDs kubelet
//! must include (devices an init container leaves to the next) are on several GPUs.

use std::collections::{BTreeMap, BTreeSet};

use tracing::debug;
use vgpu_core::inventory::GpuInfo;
use vgpu_core::resources::{Assignment, ContainerAssignment, SLICES_PER_GPU};
use vgpu_core::topology::NodeTopology;

use crate::error::error_chain;
use crate::handshake::Handshake;
use crate::identify::{assignment_of, is_terminal, total_slices};
use crate::ids;
use crate::podresources::listed;

impl Handshake {
    /// `GetPreferredAllocation` for one container: steer kubelet towards the GPUs that
    /// the extender assigned to a container still waiting for devices, else the
    /// best-connected GPUs for a request that needs several ([`by_connectivity`]), else
    /// pack.
    ///
    /// This is only a preference: it makes kubelet's ledger name the assigned GPUs.
    /// Correctness does not depend on it: `PreStartContainer` identifies the container
    /// by kubelet's record and refuses devices on other GPUs than its assignment.
    pub async fn preferred(
        &self,
        available: &[String],
        must_include: &[String],
        size: usize,
    ) -> Vec<String> {
        if let Some(ids) = self.steer(available, must_include, size).await {
            return ids;
        }
        let gpus = self.gpus.borrow().clone();
        if let Some(ids) = by_connectivity(available, must_include, size, &gpus) {
            debug!(size, "preferred allocation on the best-connected GPUs");
            return ids;
        }
        pack(available, must_include, size)
    }

    async fn steer(
        &self,
        available: &[String],
        must: &[String],
        size: usize,
    ) -> Option<Vec<String>> {
        let store = self.pods.as_ref()?;
        let resp = match self.lister.list().await {
            Ok(r) => r,
            Err(e) => {
                debug!(error = %error_chain(&e), "no steering: List failed");
                return None;
            }
        };
        let all = listed(&resp, &self.cfg.resource_name);
        let in_list: BTreeSet<(&str, &str)> = resp
            .pod_resources
            .iter()
            .map(|p| (p.namespace.as_str(), p.name.as_str()))
            .collect();
        let mut pods = store.state();
        pods.sort_by(|a, b| {
            a.metadata
                .creation_timestamp
                .cmp(&b.metadata.creation_timestamp)
                .then_with(|| a.metadata.name.cmp(&b.metadata.name))
        });
        for pod in pods {
            let ns = pod.metadata.namespace.as_deref().unwrap_or("default");
            let name = pod.metadata.name.as_deref().unwrap_or("");
            if !in_list.contains(&(ns, name)) || is_terminal(&pod) {
                continue;
            }
            if pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) != Some(&self.cfg.node_name) {
                continue;
            }
            let Some(a) = assignment_of(&pod).and_then(|t| Assignment::from_json(t).ok()) else {
                continue;
            };
            let have: BTreeSet<&str> = all
                .iter()
                .filter(|l| l.namespace == ns && l.pod == name)
                .map(|l| l.container.as_str())
                .collect();
            let Some(spec) = pod.spec.as_ref() else {
                continue;
            };
            // Init containers are never listed (kubelet 1.28); they wait for devices only
            // while no app container of the pod has any.
            let inits = spec
                .init_containers
                .iter()
                .flatten()
                .filter(|_| have.is_empty())
                .map(|c| c.name.as_str());
            let order: Vec<&str> = inits
                .chain(spec.containers.iter().map(|c| c.name.as_str()))
                .collect();
            for cname in order {
                if have.contains(cname) {
                    continue;
                }
                let Some(g) = a.container(cname) else {
                    continue;
                };
                if total_slices(g) as usize != size {
                    continue;
                }
                if let Some(ids) = pick(g, available, must) {
                    debug!(pod = %format!("{ns}/{name}"), container = cname, "steered preferred allocation");
                    return Some(ids);
                }
            }
        }
        None
    }
}

/// Device IDs on exactly the grant's GPUs (its slices on each), `must` first.
fn pick(g: &ContainerAssignment, available: &[String], must: &[String]) -> Option<Vec<String>> {
    let mut out = Vec::new();
    for grant in &g.gpus {
        let on_gpu = |id: &&String| ids::parse_device_id(id).is_ok_and(|(u, _)| u == grant.uuid);
        let mut take: Vec<&String> = must.iter().filter(on_gpu).collect();
        let mut rest: Vec<&String> = available
            .iter()
            .filter(on_gpu)
            .filter(|id| !must.contains(id))
            .collect();
        rest.sort_by_key(|id| ids::parse_device_id(id).map(|(_, s)| s).unwrap_or(u32::MAX));
        take.extend(rest);
        if take.len() < grant.slices as usize {
            return None;
        }
        out.extend(take.into_iter().take(grant.slices as usize).cloned());
    }
    if !must.iter().all(|m| out.contains(m)) {
        return None;
    }
    Some(out)
}

/// The device IDs of a request that needs several GPUs, on the best-connected set of
/// them (`NodeTopology::best_set` over the node's inventory topology): `n` GPUs, the
/// fewest that can hold `size` slices (at least `ceil(size / 10)`, at least the GPUs of
/// `must`), each with at least `ceil(size / n)` slices left, containing `must`'s GPUs;
/// then `must` first and about `size / n` slices of each GPU of the set, lowest slots
/// first. `None` when the request fits one GPU (packing decides), when an ID is not
/// ours or names a GPU the node does not list, or when no such set exists.
pub fn by_connectivity(
    available: &[String],
    must: &[String],
    size: usize,
    gpus: &[GpuInfo],
) -> Option<Vec<String>> {
    let per_gpu_max = SLICES_PER_GPU as usize;
    let index_of = |id: &str| -> Option<u32> {
        let (uuid, _) = ids::parse_device_id(id).ok()?;
        gpus.iter().find(|g| g.uuid == uuid).map(|g| g.index)
    };
    // Free slots per GPU (kubelet's available IDs and the ones it must include).
    let mut slots: BTreeMap<u32, Vec<String>> = BTreeMap::new();
    for id in available.iter().chain(must) {
        let v = slots.entry(index_of(id)?).or_default();
        if !v.contains(id) {
            v.push(id.clone());
        }
    }
    for v in slots.values_mut() {
        v.sort_by_key(|id| ids::parse_device_id(id).map(|(_, s)| s).unwrap_or(u32::MAX));
    }
    let mut must_gpus: Vec<u32> = must.iter().map(|m| index_of(m)).collect::<Option<_>>()?;
    must_gpus.sort_unstable();
    must_gpus.dedup();
    let fits_one = match must_gpus.as_slice() {
        [] => slots.values().any(|v| v.len() >= size),
        [g] => slots.get(g).is_some_and(|v| v.len() >= size),
        _ => false,
    };
    if size == 0 || must.len() > size || fits_one {
        return None;
    }
    // The fewest GPUs whose free slots can hold the request.
    let mut free: Vec<usize> = slots.values().map(Vec::len).collect();
    free.sort_unstable_by(|a, b| b.cmp(a));
    let mut fewest = 0;
    let mut sum = 0;
    while sum < size && fewest < free.len() {
        sum += free[fewest];
        fewest += 1;
    }
    let n = fewest
        .max(size.div_ceil(per_gpu_max))
        .max(must_gpus.len())
        .max(2);
    let share = size.div_ceil(n);
    let candidates: Vec<u32> = slots
        .iter()
        .filter(|(g, v)| v.len() >= share || must_gpus.contains(g))
        .map(|(g, _)| *g)
        .collect();
    let topo = NodeTopology::new(gpus.iter().map(|g| (g.index, g.topology.clone())));
    let set = topo.best_set(&candidates, &must_gpus, n)?;
    let mut out: Vec<String> = Vec::with_capacity(size);
    for m in must {
        if !out.contains(m) {
            out.push(m.clone());
        }
    }
    // Each GPU of the set up to its share, then whatever is left on the set.
    for cap in [share, per_gpu_max] {
        for g in &set {
            let on_gpu = slots.get(g).map(Vec::as_slice).unwrap_or_default();
            let mut have = on_gpu.iter().filter(|id| out.contains(id)).count();
            for id in on_gpu {
                if out.len() >= size || have >= cap {
                    break;
                }
                if !out.contains(id) {
                    out.push(id.clone());
                    have += 1;
                }
            }
        }
    }
    (out.len() == size).then_some(out)
}

/// Fallback: `must` first, then fill from the GPU with the fewest free slots that can
/// take the rest (packing), else from the GPUs with the most free slots.
pub fn pack(available: &[String], must: &[String], size: usize) -> Vec<String> {
    let mut out: Vec<String> = must.iter().take(size).cloned().collect();
    let mut by_gpu: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for id in available {
        if out.contains(id) {
            continue;
        }
        if let Ok((u, _)) = ids::parse_device_id(id) {
            by_gpu.entry(u.to_owned()).or_default().push(id.clone());
        }
    }
    for v in by_gpu.values_mut() {
        v.sort_by_key(|id| ids::parse_device_id(id).map(|(_, s)| s).unwrap_or(u32::MAX));
    }
    let need = size.saturating_sub(out.len());
    let mut gpus: Vec<(String, Vec<String>)> = by_gpu.into_iter().collect();
    if let Some((_, v)) = gpus
        .iter()
        .filter(|(_, v)| v.len() >= need)
        .min_by_key(|(_, v)| v.len())
    {
        out.extend(v.iter().take(need).cloned());
        return out;
    }
    gpus.sort_by_key(|(_, v)| std::cmp::Reverse(v.len()));
    for (_, v) in gpus {
        for id in v {
            if out.len() >= size {
                return out;
            }
            out.push(id);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn pack_prefers_the_tightest_gpu_and_honours_must() {
        let avail = ids(&["GPU-a-0", "GPU-a-1", "GPU-a-2", "GPU-b-5", "GPU-b-6"]);
        assert_eq!(pack(&avail, &[], 2), ids(&["GPU-b-5", "GPU-b-6"]));
        assert_eq!(
            pack(&avail, &[], 3),
            ids(&["GPU-a-0", "GPU-a-1", "GPU-a-2"])
        );
        assert_eq!(
            pack(&avail, &ids(&["GPU-a-2"]), 2),
            ids(&["GPU-a-2", "GPU-a-0"])
        );
        assert_eq!(pack(&avail, &[], 5).len(), 5);
    }

    /// 8 GPUs `GPU-<i>`, two per PCIe switch, four per NUMA node (the `pcie-8gpu` preset).
    fn pcie8() -> Vec<GpuInfo> {
        (0..8u32)
            .map(|i| GpuInfo {
                index: i,
                uuid: format!("GPU-{i}"),
                model: "L40S".into(),
                memory_mib: 46068,
                healthy: true,
                topology: Some(vgpu_core::inventory::GpuTopology {
                    numa_node: Some(i / 4),
                    switch_peers: vec![i ^ 1],
                    nvlink_peers: vec![],
                }),
            })
            .collect()
    }

    /// Every slot of the GPUs `whole`, and the slots from `from` up of the GPUs `part`.
    fn free(whole: &[u32], part: &[(u32, u32)]) -> Vec<String> {
        let mut v: Vec<String> = whole
            .iter()
            .flat_map(|g| (0..10).map(move |s| format!("GPU-{g}-{s}")))
            .collect();
        for &(g, from) in part {
            v.extend((from..10).map(|s| format!("GPU-{g}-{s}")));
        }
        v
    }

    fn gpus_of(ids: &[String]) -> Vec<String> {
        let mut g: Vec<String> = ids
            .iter()
            .map(|i| ids::parse_device_id(i).expect("ours").0.to_owned())
            .collect();
        g.sort();
        g.dedup();
        g
    }

    #[test]
    fn two_whole_gpus_go_to_a_free_switch_pair_not_the_first_two_free() {
        let g = pcie8();
        // GPUs 0 and 2 have a slice taken, GPU 5 is gone: whole GPUs 1, 3, 4, 6, 7.
        let avail = free(&[1, 3, 4, 6, 7], &[(0, 1), (2, 1)]);
        let ids = by_connectivity(&avail, &[], 20, &g).expect("a multi-GPU request");
        assert_eq!(gpus_of(&ids), ["GPU-6", "GPU-7"]);
        assert_eq!(ids.len(), 20);
        // Packing alone would take the first two free ones, across switches.
        assert_eq!(gpus_of(&pack(&avail, &[], 20)), ["GPU-1", "GPU-3"]);
        // Four whole GPUs: one NUMA node has only 1 and 3 whole; the other 4, 6, 7.
        let ids = by_connectivity(&avail, &[], 40, &g).expect("four GPUs");
        assert_eq!(ids.len(), 40);
        assert_eq!(gpus_of(&ids).len(), 4);
        // 15 slices: two GPUs of at least 8 free, 8 + 7, the best pair being 6 and 7.
        let ids = by_connectivity(&avail, &[], 15, &g).expect("two GPUs");
        assert_eq!(gpus_of(&ids), ["GPU-6", "GPU-7"]);
        assert_eq!(ids.iter().filter(|i| i.starts_with("GPU-6-")).count(), 8);
    }

    #[test]
    fn must_include_gpus_stay_in_the_set_and_single_gpu_requests_are_left_to_packing() {
        let g = pcie8();
        let avail = free(&[3, 4, 6, 7], &[(0, 1), (2, 1)]);
        let must = free(&[1], &[]);
        let got = by_connectivity(&avail, &must, 20, &g).expect("a multi-GPU request");
        assert!(must.iter().all(|m| got.contains(m)), "{got:?}");
        // GPU 1's switch peer (0) has 9 slots only: the best partner is 3 (same NUMA
        // node), not 6 and 7's switch.
        assert_eq!(gpus_of(&got), ["GPU-1", "GPU-3"]);
        // Must-include IDs on two GPUs make it a two-GPU request even for 2 slices.
        let two = vec!["GPU-4-0".to_owned(), "GPU-6-3".to_owned()];
        let got = by_connectivity(&avail, &two, 2, &g).expect("two GPUs");
        assert_eq!(got, two);
        // Fits one GPU: packing decides.
        assert_eq!(by_connectivity(&avail, &[], 10, &g), None);
        assert_eq!(by_connectivity(&avail, &free(&[3], &[]), 10, &g), None);
        // Not ours, or a GPU the node does not list: no opinion.
        assert_eq!(by_connectivity(&ids(&["x"]), &[], 20, &g), None);
        assert_eq!(by_connectivity(&free(&[9], &[]), &[], 20, &g), None);
        // Not enough GPUs with their share free.
        assert_eq!(
            by_connectivity(&free(&[], &[(0, 5), (1, 5)]), &[], 20, &g),
            None
        );
    }

    #[test]
    fn pick_takes_the_granted_slices_of_each_gpu() {
        let g = ContainerAssignment {
            name: "c".into(),
            gpus: vec![vgpu_core::resources::GpuGrant {
                uuid: "GPU-b".into(),
                compute_milli: 200,
                memory_mib: 100,
                slices: 2,
            }],
        };
        let avail = ids(&["GPU-a-0", "GPU-b-7", "GPU-b-3", "GPU-b-4"]);
        assert_eq!(pick(&g, &avail, &[]), Some(ids(&["GPU-b-3", "GPU-b-4"])));
        assert_eq!(pick(&g, &avail, &ids(&["GPU-a-0"])), None);
        assert_eq!(pick(&g, &ids(&["GPU-b-3"]), &[]), None);
    }
}
