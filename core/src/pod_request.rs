//! What a pod asks of GPUs as a whole: its containers' demands (parsed by
//! [`crate::resources`]) in kubelet's order, and its model constraint; refused when
//! kubelet's device reuse between its containers ([`crate::packing::reuse`]) would put
//! one on GPUs no assignment can name. Above both: the resource model knows containers,
//! packing knows reuse, and this joins them.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::memory_limit::parse_memory_limits;
use crate::resources::{
    ContainerDemand, ContainerKind, ModelConstraint, ResourceError, parse_compute_class,
    parse_container_request, parse_model_constraint,
};

/// Everything a pod asks of GPUs.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PodGpuRequest {
    /// Containers with GPU demands in kubelet's order: init containers (sidecars
    /// included) in spec order, then app containers in spec order. Containers that
    /// kubelet's device reuse ties together are reserved as one group on the same
    /// GPU(s), at their peak (`packing::reuse`, ADR 0011).
    pub containers: Vec<ContainerDemand>,
    /// GPU model constraint for every container of the pod.
    pub models: ModelConstraint,
}

impl PodGpuRequest {
    /// Whether the pod needs no GPU at all.
    pub fn is_empty(&self) -> bool {
        self.containers.is_empty()
    }
}

/// Parses a pod: its containers' (name, kind, requests) in kubelet's order (init
/// containers first) and its annotations. Refuses, naming the containers, a pod whose
/// containers kubelet's device reuse would put on GPUs other than any assignment can
/// name (`packing::reuse::layout`), and a pod whose memory limit annotation is malformed,
/// names no GPU container of it, or is below a request given in MiB
/// ([`crate::memory_limit`]).
pub fn parse_pod_request<'a>(
    containers: impl IntoIterator<Item = (&'a str, ContainerKind, &'a BTreeMap<String, String>)>,
    annotations: &BTreeMap<String, String>,
) -> Result<PodGpuRequest, ResourceError> {
    let mut out = Vec::new();
    for (name, kind, requests) in containers {
        if let Some(demand) = parse_container_request(name, requests)? {
            out.push(ContainerDemand {
                name: name.to_owned(),
                demand,
                kind,
            });
        }
    }
    crate::packing::reuse::layout(&out)?;
    if !out.is_empty() {
        // The device plugin refuses a container of a pod with an unknown compute class
        // at its start; the scheduler says so before the pod is placed.
        parse_compute_class(annotations)?;
        // The same for the memory limit (ADR 0066): parsed and checked against the
        // containers here, never part of the request the scheduler fits.
        parse_memory_limits(annotations)?.check_pod(&out)?;
    }
    Ok(PodGpuRequest {
        containers: out,
        models: parse_model_constraint(annotations)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pod_request_collects_containers() {
        let a = BTreeMap::from([("vgpu.io/gpu".to_owned(), "3".to_owned())]);
        let b = BTreeMap::from([("cpu".to_owned(), "1".to_owned())]);
        let p = parse_pod_request(
            [("a", ContainerKind::App, &a), ("b", ContainerKind::App, &b)],
            &BTreeMap::new(),
        )
        .unwrap();
        assert_eq!(p.containers.len(), 1);
        assert_eq!(p.containers[0].name, "a");
    }

    #[test]
    fn a_bad_memory_limit_refuses_the_pod_and_a_good_one_changes_no_demand() {
        use crate::memory_limit::ANNOTATION_GPU_MEMORY_LIMIT;
        let a = BTreeMap::from([
            ("vgpu.io/gpu".to_owned(), "1".to_owned()),
            ("vgpu.io/gpu-memory".to_owned(), "4096".to_owned()),
        ]);
        let limit =
            |v: &str| BTreeMap::from([(ANNOTATION_GPU_MEMORY_LIMIT.to_owned(), v.to_owned())]);
        let plain = parse_pod_request([("a", ContainerKind::App, &a)], &BTreeMap::new()).unwrap();
        let huge = parse_pod_request([("a", ContainerKind::App, &a)], &limit("a=16000000"))
            .expect("a limit above the request is fine");
        assert_eq!(huge, plain, "a limit is no part of what the scheduler fits");
        for bad in ["a=1024", "1024", "b=8192", "a=8Gi", "nonsense"] {
            let e = parse_pod_request([("a", ContainerKind::App, &a)], &limit(bad))
                .expect_err(bad)
                .to_string();
            assert!(e.contains(ANNOTATION_GPU_MEMORY_LIMIT), "{bad}: {e}");
        }
    }
}
