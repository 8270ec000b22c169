//! Which GPUs a container sees, in which order: the one rule `Allocate` (the environment
//! variables) and `PreStartContainer` (the quota file's `gpus`) both follow.
//!
//! A container's GPUs are ordered by their node index (NVML's index, as `nvidia-smi`
//! shows them). `Allocate` names them in that order in `CUDA_VISIBLE_DEVICES` and
//! `NVIDIA_VISIBLE_DEVICES` (by UUID: indices would be renumbered by a runtime that
//! mounts only the container's GPUs, a UUID never is; CUDA enumerates the listed GPUs in
//! the listed order), and `PreStartContainer` writes the quota file's `gpus` in the same
//! order, so that the shim's device 0 (the quota file's first GPU) is CUDA's device 0.

use vgpu_core::inventory::GpuInfo;

/// The variable CUDA reads: the GPUs a process may enumerate, in enumeration order.
pub const CUDA_VISIBLE_DEVICES: &str = "CUDA_VISIBLE_DEVICES";
/// The variable the NVIDIA container toolkit reads (and NVIDIA's device plugin sets):
/// the GPUs to inject into the container.
pub const NVIDIA_VISIBLE_DEVICES: &str = "NVIDIA_VISIBLE_DEVICES";

/// `uuids` in the order the container sees them: by the GPU's index on the node; a UUID
/// the node's GPU list does not hold comes last, by UUID (the order stays a function of
/// the set, whoever asks). Duplicates are dropped.
pub fn in_device_order<'a>(
    uuids: impl IntoIterator<Item = &'a str>,
    gpus: &[GpuInfo],
) -> Vec<String> {
    let mut v: Vec<(Option<u32>, &str)> = uuids
        .into_iter()
        .map(|u| (gpus.iter().find(|g| g.uuid == u).map(|g| g.index), u))
        .collect();
    // `None` sorts before `Some`: put unknown GPUs last.
    v.sort_by(|a, b| (a.0.is_none(), a.0, a.1).cmp(&(b.0.is_none(), b.0, b.1)));
    v.dedup_by(|a, b| a.1 == b.1);
    v.into_iter().map(|(_, u)| u.to_owned()).collect()
}

/// The environment variables that name a container's GPUs (`ordered`, as returned by
/// [`in_device_order`]) to CUDA and to the NVIDIA container toolkit.
pub fn visible_env(ordered: &[String]) -> [(&'static str, String); 2] {
    let list = ordered.join(",");
    [
        (CUDA_VISIBLE_DEVICES, list.clone()),
        (NVIDIA_VISIBLE_DEVICES, list),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(index: u32, uuid: &str) -> GpuInfo {
        GpuInfo {
            index,
            uuid: uuid.into(),
            model: "m".into(),
            memory_mib: 1,
            healthy: true,
            topology: None,
        }
    }

    #[test]
    fn gpus_are_ordered_by_node_index_and_unknown_ones_last() {
        // Index order differs from UUID order on purpose.
        let node = [gpu(0, "GPU-b"), gpu(1, "GPU-a"), gpu(2, "GPU-c")];
        assert_eq!(
            in_device_order(["GPU-c", "GPU-a", "GPU-b"], &node),
            ["GPU-b", "GPU-a", "GPU-c"]
        );
        assert_eq!(
            in_device_order(["GPU-z", "GPU-c", "GPU-y", "GPU-c"], &node),
            ["GPU-c", "GPU-y", "GPU-z"]
        );
        assert!(in_device_order([], &node).is_empty());
    }

    #[test]
    fn both_variables_list_the_uuids_comma_separated() {
        let env = visible_env(&["GPU-b".into(), "GPU-a".into()]);
        assert_eq!(
            env,
            [
                ("CUDA_VISIBLE_DEVICES", "GPU-b,GPU-a".to_owned()),
                ("NVIDIA_VISIBLE_DEVICES", "GPU-b,GPU-a".to_owned())
            ]
        );
    }
}
