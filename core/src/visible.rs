//! Which GPUs a process sees: NVIDIA's `CUDA_VISIBLE_DEVICES` rule ([`cuda_visible`]),
//! the container's selection among its granted GPUs ([`container_selection`]), and the
//! map between the container's device indices and a library's own enumeration
//! ([`DeviceMap`]). Pure: the simulated driver applies the rule to its node, the shim
//! applies it to the container's GPUs and maps NVML's indices (ADR 0014).
//!
//! The rule, as NVIDIA documents it for the CUDA driver (NVML ignores the variable):
//! unset, every GPU is visible in enumeration order; set to an empty string, none is;
//! otherwise it is a comma-separated sequence of GPU identifiers, each an index into the
//! enumeration or a UUID (`GPU-…`, or any prefix of one that names exactly one GPU), and
//! the GPUs are visible in the order of the sequence. The sequence stops at the first
//! identifier that names no GPU (an index out of range, `-1`, an unknown or ambiguous
//! UUID prefix, anything else): only the GPUs named before it are visible. A GPU named a
//! second time also ends the sequence (a GPU is enumerated once).

use crate::container_quota::same_gpu;

/// The environment variable the CUDA driver reads at `cuInit`.
pub const CUDA_VISIBLE_DEVICES: &str = "CUDA_VISIBLE_DEVICES";

/// The positions in `uuids` (a driver's enumeration, in order) that a process whose
/// `CUDA_VISIBLE_DEVICES` is `value` sees, in the order it sees them.
pub fn cuda_visible<S: AsRef<str>>(value: Option<&str>, uuids: &[S]) -> Vec<usize> {
    let Some(value) = value else {
        return (0..uuids.len()).collect();
    };
    let mut seen = Vec::new();
    if value.trim().is_empty() {
        return seen;
    }
    for entry in value.split(',') {
        match resolve(entry.trim(), uuids) {
            Some(i) if !seen.contains(&i) => seen.push(i),
            _ => break,
        }
    }
    seen
}

/// The GPU one identifier names: an index, or a UUID or UUID prefix naming exactly one.
fn resolve<S: AsRef<str>>(entry: &str, uuids: &[S]) -> Option<usize> {
    if !entry.is_empty() && entry.bytes().all(|b| b.is_ascii_digit()) {
        return entry.parse::<usize>().ok().filter(|&i| i < uuids.len());
    }
    if entry.len() < 5 || !entry.get(..4)?.eq_ignore_ascii_case("GPU-") {
        return None;
    }
    if let Some(i) = uuids.iter().position(|u| same_gpu(u.as_ref(), entry)) {
        return Some(i);
    }
    let mut hits = uuids.iter().enumerate().filter(|(_, u)| {
        let u = u.as_ref().trim();
        u.len() > entry.len()
            && u.get(..entry.len())
                .is_some_and(|p| p.eq_ignore_ascii_case(entry))
    });
    match (hits.next(), hits.next()) {
        (Some((i, _)), None) => Some(i),
        _ => None,
    }
}

/// The container's GPUs a process of it uses: `granted` (the quota file's GPUs, in its
/// order) narrowed by the process's own `CUDA_VISIBLE_DEVICES` (`tenant`), whose indices
/// and UUIDs refer to the container's GPUs (index 0 is the first granted GPU), never to
/// the node's. Returns positions in `granted`.
pub fn container_selection<S: AsRef<str>>(tenant: Option<&str>, granted: &[S]) -> Vec<usize> {
    cuda_visible(tenant, granted)
}

/// The `CUDA_VISIBLE_DEVICES` value that makes a driver enumerate exactly `uuids`, in
/// that order, whatever else the node has: the full UUIDs, comma-separated (an empty
/// string, no GPU, when `uuids` is empty).
pub fn visible_value<S: AsRef<str>>(uuids: &[S]) -> String {
    uuids
        .iter()
        .map(|u| u.as_ref().trim())
        .collect::<Vec<_>>()
        .join(",")
}

/// The container's device indices (its GPUs, numbered from 0 in its order) against a
/// library's own enumeration of the node (e.g. NVML's indices).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceMap {
    /// Library index of each container device.
    to_real: Vec<usize>,
}

impl DeviceMap {
    /// Maps `granted` (the container's GPUs in its order) onto `real` (the library's
    /// UUIDs in its index order). A granted GPU the library does not enumerate is left
    /// out (the container's later GPUs move up); a library GPU that is not granted has
    /// no container index.
    pub fn new<S: AsRef<str>, T: AsRef<str>>(granted: &[S], real: &[T]) -> DeviceMap {
        let mut to_real: Vec<usize> = Vec::new();
        for g in granted {
            if let Some(r) = real.iter().position(|u| same_gpu(u.as_ref(), g.as_ref()))
                && !to_real.contains(&r)
            {
                to_real.push(r);
            }
        }
        DeviceMap { to_real }
    }

    /// Every GPU of the library, unchanged (no quota file: nothing is hidden).
    pub fn identity(count: usize) -> DeviceMap {
        DeviceMap {
            to_real: (0..count).collect(),
        }
    }

    /// How many devices the container sees.
    pub fn len(&self) -> usize {
        self.to_real.len()
    }

    /// Whether the container sees no device.
    pub fn is_empty(&self) -> bool {
        self.to_real.is_empty()
    }

    /// The library index of container device `virt` (None: no such device).
    pub fn real(&self, virt: usize) -> Option<usize> {
        self.to_real.get(virt).copied()
    }

    /// The container index of library device `real` (None: hidden from the container).
    pub fn virt(&self, real: usize) -> Option<usize> {
        self.to_real.iter().position(|&r| r == real)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NODE: [&str; 4] = [
        "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6",
        "GPU-8932f937-0000-4106-c12f-20bd9faed9f7",
        "GPU-11111111-2222-3333-4444-555555555555",
        "GPU-aaaaaaaa-2222-3333-4444-555555555555",
    ];

    #[test]
    fn unset_shows_all_and_empty_shows_none() {
        assert_eq!(cuda_visible(None, &NODE), vec![0, 1, 2, 3]);
        assert_eq!(cuda_visible(Some(""), &NODE), Vec::<usize>::new());
        assert_eq!(cuda_visible(Some("  "), &NODE), Vec::<usize>::new());
    }

    #[test]
    fn indices_in_the_order_given_up_to_the_first_invalid_one() {
        // NVIDIA's examples: "2,1" hides 0 and shows 2 first; "0,2,-1,1" shows 0 and 2.
        assert_eq!(cuda_visible(Some("2,1"), &NODE), vec![2, 1]);
        assert_eq!(cuda_visible(Some("0,2,-1,1"), &NODE), vec![0, 2]);
        assert_eq!(cuda_visible(Some("-1"), &NODE), Vec::<usize>::new());
        assert_eq!(cuda_visible(Some("3,4,0"), &NODE), vec![3]);
        assert_eq!(cuda_visible(Some(" 1 , 0 "), &NODE), vec![1, 0]);
        assert_eq!(cuda_visible(Some("1,,0"), &NODE), vec![1]);
        assert_eq!(
            cuda_visible(Some("0,0,1"), &NODE),
            vec![0],
            "a repeat ends it"
        );
        assert_eq!(cuda_visible(Some("1x,0"), &NODE), Vec::<usize>::new());
    }

    #[test]
    fn uuids_and_unique_prefixes() {
        assert_eq!(cuda_visible(Some(NODE[2]), &NODE), vec![2]);
        assert_eq!(
            cuda_visible(Some(&NODE[3].to_uppercase().replace("GPU-", "gpu-")), &NODE),
            vec![3]
        );
        assert_eq!(cuda_visible(Some("GPU-1111"), &NODE), vec![2]);
        assert_eq!(
            cuda_visible(Some("GPU-8932f937,2"), &NODE),
            Vec::<usize>::new(),
            "an ambiguous prefix names no GPU"
        );
        assert_eq!(cuda_visible(Some("GPU-8932f937-d,2"), &NODE), vec![0, 2]);
        assert_eq!(cuda_visible(Some("GPU-,1"), &NODE), Vec::<usize>::new());
        assert_eq!(
            cuda_visible(Some("MIG-GPU-1111/0/0"), &NODE),
            Vec::<usize>::new()
        );
        assert_eq!(cuda_visible(Some("GPU-ffff,0"), &NODE), Vec::<usize>::new());
        assert_eq!(
            cuda_visible(Some(&format!("1,{}", NODE[1])), &NODE),
            vec![1],
            "the same GPU by index and by UUID is a repeat"
        );
    }

    #[test]
    fn a_container_selection_counts_from_its_first_granted_gpu() {
        let granted = [NODE[2], NODE[0]];
        assert_eq!(container_selection(None, &granted), vec![0, 1]);
        assert_eq!(container_selection(Some("1"), &granted), vec![1]);
        assert_eq!(container_selection(Some("1,0"), &granted), vec![1, 0]);
        assert_eq!(
            container_selection(Some(NODE[3]), &granted),
            Vec::<usize>::new(),
            "a GPU of the node the container was not given is nothing"
        );
        assert_eq!(
            container_selection(Some("2"), &granted),
            Vec::<usize>::new()
        );
        let value = visible_value(&[granted[1], granted[0]]);
        assert_eq!(value, format!("{},{}", NODE[0], NODE[2]));
        assert_eq!(cuda_visible(Some(&value), &NODE), vec![0, 2]);
        assert_eq!(visible_value::<&str>(&[]), "");
        assert_eq!(
            cuda_visible(Some(&visible_value::<&str>(&[])), &NODE),
            Vec::<usize>::new()
        );
    }

    #[test]
    fn device_map_numbers_the_granted_gpus_from_zero() {
        let m = DeviceMap::new(&[NODE[1]], &NODE);
        assert_eq!((m.len(), m.real(0), m.real(1)), (1, Some(1), None));
        assert_eq!((m.virt(1), m.virt(0), m.virt(3)), (Some(0), None, None));
        let m = DeviceMap::new(&[NODE[3], "GPU-gone", NODE[0], NODE[3]], &NODE);
        assert_eq!(m.len(), 2);
        assert_eq!((m.real(0), m.real(1)), (Some(3), Some(0)));
        assert_eq!((m.virt(3), m.virt(0)), (Some(0), Some(1)));
        let id = DeviceMap::identity(2);
        assert_eq!(
            (id.len(), id.real(1), id.virt(1), id.real(2)),
            (2, Some(1), Some(1), None)
        );
        assert!(DeviceMap::new::<&str, &str>(&[], &NODE).is_empty());
    }
}
