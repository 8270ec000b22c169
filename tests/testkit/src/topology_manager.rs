//! kubelet's Topology Manager as it reads a device plugin's `TopologyInfo`, for the fake
//! kubelet's admission: the device manager's hint provider (one hint per combination of
//! NUMA nodes that holds enough devices, preferred when it has the fewest nodes any hint
//! needs), the `single-numa-node` policy's admission (a preferred hint of one NUMA node,
//! else `TopologyAffinityError`), and the split of the available devices that decides
//! what `GetPreferredAllocation` is offered.
//!
//! Modelled on kubelet's `devicemanager/topology_hints.go` (`generateDeviceTopologyHints`,
//! `filterByAffinity`) and `topologymanager/policy_single_numa_node.go`, with the device
//! manager as the only hint provider (no CPU manager hints to merge).

use std::collections::{BTreeMap, BTreeSet};

use vgpu_device_plugin::kubelet::v1beta1::Device;

/// One hint: a set of NUMA nodes, and whether it is among the narrowest possible.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hint {
    /// The NUMA nodes, ascending.
    pub numa: Vec<i64>,
    /// Whether no hint with fewer NUMA nodes could hold the request.
    pub preferred: bool,
}

/// The NUMA nodes a device lists in its `TopologyInfo`.
fn nodes_of(d: &Device) -> BTreeSet<i64> {
    d.topology
        .as_ref()
        .map(|t| t.nodes.iter().map(|n| n.id).collect())
        .unwrap_or_default()
}

/// The device manager's hints for `request` devices of one resource, given every device
/// the plugin listed, the healthy ones still `available` and the `reusable` ones (an init
/// container's): `None` when no device has `TopologyInfo` (kubelet: "no preference").
/// Masks are tried over every non-empty combination of the NUMA nodes the devices name.
pub fn device_hints(
    all: &[Device],
    available: &[String],
    reusable: &[String],
    request: usize,
) -> Option<Vec<Hint>> {
    let numa: BTreeSet<i64> = all.iter().flat_map(nodes_of).collect();
    if numa.is_empty() {
        return None;
    }
    let numa: Vec<i64> = numa.into_iter().collect();
    let by_id: BTreeMap<&str, BTreeSet<i64>> =
        all.iter().map(|d| (d.id.as_str(), nodes_of(d))).collect();
    let in_mask = |id: &str, mask: &BTreeSet<i64>| {
        by_id
            .get(id)
            .is_some_and(|n| n.iter().any(|x| mask.contains(x)))
    };
    let mut min_size = numa.len();
    let mut hints = Vec::new();
    for bits in 1u64..(1 << numa.len()) {
        let mask: BTreeSet<i64> = numa
            .iter()
            .enumerate()
            .filter(|(i, _)| bits & (1 << i) != 0)
            .map(|(_, n)| *n)
            .collect();
        let in_all = all.iter().filter(|d| in_mask(&d.id, &mask)).count();
        if in_all >= request && mask.len() < min_size {
            min_size = mask.len();
        }
        // Every reusable device with a topology must lie in the mask.
        let mut matching = 0;
        let mut fits = true;
        for r in reusable {
            match by_id.get(r.as_str()) {
                Some(n) if n.is_empty() => {}
                Some(_) if in_mask(r, &mask) => matching += 1,
                _ => fits = false,
            }
        }
        if !fits {
            continue;
        }
        matching += available.iter().filter(|a| in_mask(a, &mask)).count();
        if matching >= request {
            hints.push(Hint {
                numa: mask.into_iter().collect(),
                preferred: false,
            });
        }
    }
    for h in &mut hints {
        h.preferred = h.numa.len() == min_size;
    }
    Some(hints)
}

/// Why the `single-numa-node` policy refuses a pod.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("TopologyAffinityError: no preferred single NUMA node hint among {0:?}")]
pub struct TopologyAffinityError(pub Vec<Hint>);

/// The `single-numa-node` policy with the device manager as the only provider: `None`
/// (any NUMA node) without hints, else the lowest NUMA node of a preferred one-node hint.
pub fn single_numa_node(hints: Option<&[Hint]>) -> Result<Option<i64>, TopologyAffinityError> {
    let Some(hints) = hints else {
        return Ok(None);
    };
    hints
        .iter()
        .filter(|h| h.preferred && h.numa.len() == 1)
        .map(|h| h.numa[0])
        .min()
        .map(Some)
        .ok_or_else(|| TopologyAffinityError(hints.to_vec()))
}

/// kubelet's `filterByAffinity`: the available devices on the chosen NUMA node
/// (aligned), on other nodes (unaligned), and without `TopologyInfo`.
pub fn split_by_affinity(
    all: &[Device],
    available: &[String],
    numa: i64,
) -> (Vec<String>, Vec<String>, Vec<String>) {
    let by_id: BTreeMap<&str, BTreeSet<i64>> =
        all.iter().map(|d| (d.id.as_str(), nodes_of(d))).collect();
    let (mut aligned, mut unaligned, mut none) = (Vec::new(), Vec::new(), Vec::new());
    for a in available {
        match by_id.get(a.as_str()) {
            Some(n) if n.contains(&numa) => aligned.push(a.clone()),
            Some(n) if !n.is_empty() => unaligned.push(a.clone()),
            _ => none.push(a.clone()),
        }
    }
    (aligned, unaligned, none)
}
