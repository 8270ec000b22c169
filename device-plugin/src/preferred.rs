//! `GetPreferredAllocation`: steer kubelet towards the GPUs the extender assigned to a
//! container still waiting for devices, else pack onto the tightest GPU. Only a
//! preference: `PreStartContainer` identifies the container by kubelet's record and
//! refuses devices on other GPUs than its assignment.

use std::collections::{BTreeMap, BTreeSet};

use tracing::debug;
use vgpu_core::resources::{Assignment, ContainerAssignment};

use crate::error::error_chain;
use crate::handshake::Handshake;
use crate::identify::{assignment_of, is_terminal, total_slices};
use crate::ids;
use crate::podresources::listed;

impl Handshake {
    /// `GetPreferredAllocation` for one container: steer kubelet towards the GPUs that
    /// the extender assigned to a container still waiting for devices, else pack.
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
