//! The API objects read in the ledger's terms: a pod's GPU request and ledger task
//! (containers in kubelet's order, reuse groups), a node's ledger spec from the device
//! plugin's inventory (unhealthy GPUs marked) and whether it takes pods now, and an
//! assignment record as a ledger placement. Pure functions of the objects; the state
//! that keeps them is [`super::cluster`].

use std::borrow::Cow;
use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Node, Pod};
use tracing::warn;
use vgpu_core::inventory::{ANNOTATION_GPU_INVENTORY, NodeInventory};
use vgpu_core::packing::{ContextReserve, Grant, NodeSpec, Placement, ReuseSlot, Task, reuse};
use vgpu_core::pod_request::{PodGpuRequest, parse_pod_request};
use vgpu_core::resources::{
    ANNOTATION_ASSIGNMENT, Assignment, ContainerKind, GpuDemand, MemoryDemand, RESOURCE_GPU,
};
use vgpu_core::topology::{ANNOTATION_GPU_TOPOLOGY, TopologyRequirement};

use super::error::ExtenderError;

/// `namespace/name` of a pod, for messages and the name index.
pub(super) fn pod_key(pod: &Pod) -> String {
    format!(
        "{}/{}",
        pod.metadata.namespace.as_deref().unwrap_or("default"),
        pod.metadata.name.as_deref().unwrap_or("")
    )
}

/// Reads a pod's [`ANNOTATION_GPU_TOPOLOGY`] (ADR 0021): what its multi-GPU containers
/// require of their GPUs' links; absent means no requirement.
pub fn topology_requirement(pod: &Pod) -> Result<TopologyRequirement, ExtenderError> {
    let value = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ANNOTATION_GPU_TOPOLOGY));
    TopologyRequirement::from_annotation(value.map(String::as_str)).map_err(|e| {
        ExtenderError::BadPodRequest {
            pod: pod_key(pod),
            reason: e.to_string(),
        }
    })
}

/// Reads a pod's GPU request (init containers first, then app containers, as kubelet
/// allocates them; an init container with `restartPolicy: Always` is a sidecar;
/// requests, falling back to limits as the API server defaults them).
pub fn pod_request(pod: &Pod) -> Result<PodGpuRequest, ExtenderError> {
    let bad = |reason: String| ExtenderError::BadPodRequest {
        pod: pod_key(pod),
        reason,
    };
    let Some(spec) = pod.spec.as_ref() else {
        return Ok(PodGpuRequest::default());
    };
    let containers = spec
        .init_containers
        .iter()
        .flatten()
        .map(|c| {
            let kind = if c.restart_policy.as_deref() == Some("Always") {
                ContainerKind::Sidecar
            } else {
                ContainerKind::Init
            };
            (c, kind)
        })
        .chain(spec.containers.iter().map(|c| (c, ContainerKind::App)));
    let mut requests: Vec<(&str, ContainerKind, BTreeMap<String, String>)> = Vec::new();
    for (c, kind) in containers {
        let res = c.resources.as_ref();
        let mut map: BTreeMap<String, String> = BTreeMap::new();
        if let Some(limits) = res.and_then(|r| r.limits.as_ref()) {
            for (k, v) in limits {
                map.insert(k.clone(), v.0.clone());
            }
        }
        if let Some(reqs) = res.and_then(|r| r.requests.as_ref()) {
            for (k, v) in reqs {
                map.insert(k.clone(), v.0.clone());
            }
        }
        requests.push((c.name.as_str(), kind, map));
    }
    let empty = BTreeMap::new();
    let annotations = pod.metadata.annotations.as_ref().unwrap_or(&empty);
    parse_pod_request(requests.iter().map(|(n, k, m)| (*n, *k, m)), annotations)
        .map_err(|e| bad(e.to_string()))
}

/// The ledger task of a pod, as filter, prioritize and bind decide it (GPU demands
/// only; CPU and memory are kube-scheduler's).
pub fn pod_task(pod: &Pod) -> Result<Task, ExtenderError> {
    let request = pod_request(pod)?;
    Ok(task_of(&request, &slots_of(&request, &pod_key(pod))?))
}

/// The pod's ledger entries: its containers, those that kubelet's device reuse ties
/// together as one group (ADR 0011).
pub(super) fn slots_of(
    request: &PodGpuRequest,
    pod: &str,
) -> Result<Vec<ReuseSlot>, ExtenderError> {
    reuse::layout(&request.containers).map_err(|e| ExtenderError::BadPodRequest {
        pod: pod.to_owned(),
        reason: e.to_string(),
    })
}

/// The ledger task for a pod request: GPU demands only (CPU and memory are
/// kube-scheduler's in production), one per ledger entry ([`slots_of`]).
pub(super) fn task_of(request: &PodGpuRequest, slots: &[ReuseSlot]) -> Task {
    Task {
        cpu_milli: 0,
        memory_mib: 0,
        gpus: slots.iter().map(|s| s.demand).collect(),
        models: request.models.clone(),
    }
}

/// A node's ledger spec from its Node object: each GPU's memory is what it keeps for
/// quotas once `contexts` are reserved (ADR 0012).
pub(super) fn node_spec(node: &Node, contexts: ContextReserve) -> Result<NodeSpec, String> {
    let name = node.metadata.name.clone().unwrap_or_default();
    let Some(text) = node
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ANNOTATION_GPU_INVENTORY))
    else {
        return Err(format!(
            "no vgpu GPU inventory (annotation {ANNOTATION_GPU_INVENTORY} not set by the device plugin)"
        ));
    };
    let inventory = NodeInventory::from_json(text).map_err(|e| super::error::error_chain(&e))?;
    // An unhealthy GPU keeps its index (pods already on it stay accounted) but
    // its model is marked, so that `effective_task` keeps new pods off it.
    let mut spec = NodeSpec::from_inventory(name, &inventory);
    for (gpu, info) in spec.gpus.iter_mut().zip(&inventory.gpus) {
        if !info.healthy {
            gpu.model = format!("{UNHEALTHY_PREFIX}{}", gpu.model);
        }
    }
    contexts.node_spec(spec).map_err(|e| e.to_string())
}

/// Why a node with an inventory takes no new pod right now, if so: kubelet reports
/// 0 `vgpu.io/gpu` while the device plugin is not registered (e.g. for about a
/// second after a kubelet restart). Kept apart from the inventory so that such a
/// flap changes no ledger entry: the pods on the node stay accounted.
pub(super) fn unavailable(node: &Node) -> Option<String> {
    let advertised = node
        .status
        .as_ref()
        .and_then(|s| s.allocatable.as_ref())
        .and_then(|a| a.get(RESOURCE_GPU))
        .map(|q| q.0.as_str());
    matches!(advertised, None | Some("0")).then(|| {
        format!("node advertises no {RESOURCE_GPU} (device plugin not registered with kubelet)")
    })
}

/// Model-name prefix that marks an unhealthy GPU inside the ledger.
pub(super) const UNHEALTHY_PREFIX: &str = "unhealthy:";

/// The task as the ledger must see it: unhealthy GPUs (model prefixed with
/// [`UNHEALTHY_PREFIX`]) are excluded by the model constraint.
pub(super) fn effective_task<'t>(
    task: &'t Task,
    node: &NodeSpec,
    unhealthy: bool,
) -> Cow<'t, Task> {
    if !unhealthy {
        return Cow::Borrowed(task);
    }
    let mut t = task.clone();
    let healthy: Vec<String> = node
        .gpus
        .iter()
        .filter(|g| !g.model.starts_with(UNHEALTHY_PREFIX) && task.models.allows(&g.model))
        .map(|g| g.model.clone())
        .collect();
    // An allow-list of the healthy allowed models; if none is left, a model that
    // no GPU has, so the node is rejected with the model reason.
    t.models.allowed = if healthy.is_empty() {
        vec![format!("{UNHEALTHY_PREFIX}none-healthy")]
    } else {
        healthy
    };
    Cow::Owned(t)
}

/// A pod's assignment annotation, if valid and present.
pub(super) fn assignment_of(pod: &Pod) -> Option<Assignment> {
    let text = pod
        .metadata
        .annotations
        .as_ref()?
        .get(ANNOTATION_ASSIGNMENT)?;
    match Assignment::from_json(text) {
        Ok(a) => Some(a),
        Err(e) => {
            warn!(pod = %pod_key(pod), error = %super::error::error_chain(&e), "ignoring unreadable assignment");
            None
        }
    }
}

/// Ledger placement and task from an assignment record on `node`. With the pod's
/// request, the containers of a reuse group count once, at their peak (ADR 0011);
/// without it, or when the record does not follow the request's layout (a record
/// from before reuse groups), every container counts on its own.
pub(super) fn placement_from_assignment(
    node_index: usize,
    spec: &NodeSpec,
    a: &Assignment,
    request: Option<&PodGpuRequest>,
) -> Result<(Task, Placement), String> {
    let mut per_container = Vec::with_capacity(a.containers.len());
    for c in &a.containers {
        let mut grants = Vec::with_capacity(c.gpus.len());
        for g in &c.gpus {
            let Some(i) = spec.gpus.iter().position(|s| s.uuid == g.uuid) else {
                return Err(format!("GPU {} is not in the node's inventory", g.uuid));
            };
            grants.push(Grant {
                gpu: u16::try_from(i).map_err(|_| "GPU index out of range".to_string())?,
                milli: g.compute_milli,
                memory_mib: g.memory_mib,
                slices: g.slices,
            });
        }
        per_container.push((c.name.as_str(), grants));
    }
    let grouped = request.and_then(|r| {
        let slots = reuse::layout(&r.containers).ok()?;
        let by_request: Vec<Vec<Grant>> = r
            .containers
            .iter()
            .map(|c| {
                per_container
                    .iter()
                    .find(|(n, _)| *n == c.name)
                    .map(|(_, g)| g.clone())
            })
            .collect::<Option<_>>()?;
        if by_request.len() != per_container.len() {
            return None;
        }
        reuse::held(&r.containers, &slots, &by_request)
    });
    let entries: Vec<Vec<Grant>> =
        grouped.unwrap_or_else(|| per_container.into_iter().map(|(_, g)| g).collect());
    let mut gpus = Vec::with_capacity(entries.len());
    let mut containers = Vec::with_capacity(entries.len());
    for grants in entries {
        let count = u32::try_from(grants.len()).map_err(|_| "too many GPUs".to_string())?;
        gpus.push(GpuDemand {
            count,
            compute_milli: grants.iter().map(|g| g.milli).min().unwrap_or(0),
            memory: MemoryDemand::Mib(grants.iter().map(|g| g.memory_mib).min().unwrap_or(0)),
            slices: grants.iter().map(|g| g.slices).min().unwrap_or(0),
        });
        containers.push(grants);
    }
    let task = Task {
        cpu_milli: 0,
        memory_mib: 0,
        gpus,
        models: Default::default(),
    };
    Ok((
        task,
        Placement {
            node: node_index,
            containers,
        },
    ))
}
