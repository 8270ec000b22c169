//! The safe logic behind NVML's topology, peer-to-peer, NVLink and affinity queries: each
//! answer comes from the node's topology (`vgpu_cuda_sim::topology`), read from the state
//! directory the library was initialised on. [`crate::ffi_topology`] holds the exports.

use std::ffi::c_ulong;

use vgpu_cuda_abi::nvml::*;
use vgpu_cuda_sim::topology::{self, PcieLevel, Topology};

use crate::sim::{self, Dev, NvmlResult, Pci};

/// The node's topology, for an initialised library.
fn topo_of(dev: &Dev) -> NvmlResult<Topology> {
    topology::load(dev.st.dir(), dev.st.device_count()).map_err(|_| NVML_ERROR_UNKNOWN)
}

/// `nvmlDeviceGetTopologyCommonAncestor`.
pub fn common_ancestor(a: nvmlDevice_t, b: nvmlDevice_t) -> NvmlResult<nvmlGpuTopologyLevel_t> {
    let (da, db) = (sim::live_device(a)?, sim::live_device(b)?);
    Ok(topo_of(&da)?.pcie_level(da.d, db.d) as u32)
}

/// `nvmlDeviceGetTopologyNearestGpus`: the other GPUs at `level` or nearer.
pub fn nearest_gpus(
    h: nvmlDevice_t,
    level: nvmlGpuTopologyLevel_t,
) -> NvmlResult<Vec<nvmlDevice_t>> {
    let dv = sim::live_device(h)?;
    let level = PcieLevel::from_nvml(level).ok_or(NVML_ERROR_INVALID_ARGUMENT)?;
    let (_, gpus) = sim::state_and_gpus()?;
    Ok(topo_of(&dv)?
        .nearest(dv.d, level)
        .into_iter()
        .filter(|d| gpus.contains(d))
        .map(sim::handle_of)
        .collect())
}

/// `nvmlSystemGetTopologyGpuSet`: the GPUs whose local CPUs include `cpu`.
pub fn gpu_set(cpu: u32) -> NvmlResult<Vec<nvmlDevice_t>> {
    let (st, gpus) = sim::state_and_gpus()?;
    let dv = Dev { st, d: 0 };
    Ok(topo_of(&dv)?
        .gpus_near_cpu(cpu)
        .into_iter()
        .filter(|d| gpus.contains(d))
        .map(sim::handle_of)
        .collect())
}

/// `nvmlDeviceGetP2PStatus`.
pub fn p2p_status(
    a: nvmlDevice_t,
    b: nvmlDevice_t,
    index: nvmlGpuP2PCapsIndex_t,
) -> NvmlResult<nvmlGpuP2PStatus_t> {
    let (da, db) = (sim::live_device(a)?, sim::live_device(b)?);
    let t = topo_of(&da)?;
    let (x, y) = (da.d, db.d);
    let ok = |yes: bool, no: nvmlGpuP2PStatus_t| if yes { NVML_P2P_STATUS_OK } else { no };
    if x == y {
        return match index {
            NVML_P2P_CAPS_INDEX_READ..=NVML_P2P_CAPS_INDEX_PCI => Ok(NVML_P2P_STATUS_NOT_SUPPORTED),
            _ => Err(NVML_ERROR_INVALID_ARGUMENT),
        };
    }
    let nvlink = t.nvlinks_between(x, y) > 0;
    let pcie = t.pcie_level(x, y) <= PcieLevel::Node;
    Ok(match index {
        NVML_P2P_CAPS_INDEX_READ | NVML_P2P_CAPS_INDEX_WRITE => {
            ok(t.p2p_supported(x, y), NVML_P2P_STATUS_CHIPSET_NOT_SUPPORTED)
        }
        NVML_P2P_CAPS_INDEX_NVLINK | NVML_P2P_CAPS_INDEX_ATOMICS => {
            ok(nvlink, NVML_P2P_STATUS_NOT_SUPPORTED)
        }
        NVML_P2P_CAPS_INDEX_PCI => ok(pcie, NVML_P2P_STATUS_CHIPSET_NOT_SUPPORTED),
        _ => return Err(NVML_ERROR_INVALID_ARGUMENT),
    })
}

/// Link numbers NVML accepts: `NVML_NVLINK_MAX_LINKS` was 18 until CUDA 12's `nvml.h`
/// and is 36 in CUDA 13's (nvidia-ml-py 13 iterates to 36), so links up to 35 are valid
/// numbers and a link the GPU lacks is "not supported".
const LINK_NUMBERS: u32 = 36;

/// Where an NVLink query's link leads: checks the link number (beyond
/// [`LINK_NUMBERS`]: invalid; a link the GPU lacks: not supported).
fn link(h: nvmlDevice_t, link: u32) -> NvmlResult<(Dev, Topology, Result<usize, u32>)> {
    let dv = sim::live_device(h)?;
    if link >= LINK_NUMBERS {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    let t = topo_of(&dv)?;
    let peer = t.link_peer(dv.d, link).ok_or(NVML_ERROR_NOT_SUPPORTED)?;
    Ok((dv, t, peer))
}

/// `nvmlDeviceGetNvLinkState`: every link the GPU has is active.
pub fn nvlink_state(h: nvmlDevice_t, l: u32) -> NvmlResult<nvmlEnableState_t> {
    link(h, l).map(|_| NVML_FEATURE_ENABLED)
}

/// `nvmlDeviceGetNvLinkVersion`: an `nvmlNvlinkVersion_t` (NVLink 3 is
/// `NVML_NVLINK_VERSION_3_0` = 4, NVLink 4 is `…_4_0` = 6).
pub fn nvlink_version(h: nvmlDevice_t, l: u32) -> NvmlResult<u32> {
    let (_, t, _) = link(h, l)?;
    Ok(match t.nvlink_version {
        1 => NVML_NVLINK_VERSION_1_0,
        2 => NVML_NVLINK_VERSION_2_0,
        3 => NVML_NVLINK_VERSION_3_0,
        4 => NVML_NVLINK_VERSION_4_0,
        _ => NVML_NVLINK_VERSION_5_0,
    })
}

/// `nvmlDeviceGetNvLinkCapability`: P2P and P2P atomics over every link; no system
/// memory access (x86 hosts have no NVLink to the CPU) and no SLI.
pub fn nvlink_capability(h: nvmlDevice_t, l: u32, cap: nvmlNvLinkCapability_t) -> NvmlResult<u32> {
    let _ = link(h, l)?;
    match cap {
        NVML_NVLINK_CAP_P2P_SUPPORTED | NVML_NVLINK_CAP_P2P_ATOMICS | NVML_NVLINK_CAP_VALID => {
            Ok(1)
        }
        NVML_NVLINK_CAP_SYSMEM_ACCESS
        | NVML_NVLINK_CAP_SYSMEM_ATOMICS
        | NVML_NVLINK_CAP_SLI_BRIDGE => Ok(0),
        _ => Err(NVML_ERROR_INVALID_ARGUMENT),
    }
}

/// PCI location of NVSwitch chip `chip`: the simulator places the fabric's chips in PCI
/// domain 1 (bus `chip`), where no configured GPU is.
fn nvswitch_pci(chip: u32) -> Pci {
    Pci {
        domain: 1,
        bus: chip,
        device: 0,
        bus_id: format!("00000001:{chip:02X}:00.0"),
        bus_id_legacy: format!("0001:{chip:02X}:00.0"),
    }
}

/// `nvmlDeviceGetNvLinkRemotePciInfo(_v2)`: the peer GPU's, or the NVSwitch's.
pub fn nvlink_remote_pci(h: nvmlDevice_t, l: u32) -> NvmlResult<Pci> {
    let (dv, _, peer) = link(h, l)?;
    match peer {
        Ok(p) => Dev { st: dv.st, d: p }.pci(),
        Err(chip) => Ok(nvswitch_pci(chip)),
    }
}

/// `nvmlDeviceGetNvLinkRemoteDeviceType`.
pub fn nvlink_remote_type(h: nvmlDevice_t, l: u32) -> NvmlResult<nvmlIntNvLinkDeviceType_t> {
    let (_, _, peer) = link(h, l)?;
    Ok(if peer.is_ok() {
        NVML_NVLINK_DEVICE_TYPE_GPU
    } else {
        NVML_NVLINK_DEVICE_TYPE_SWITCH
    })
}

/// Sets bit `i` of an NVML bitmask of `words` `unsigned long`s for each `i` in `bits`
/// (bits beyond the caller's mask are dropped, as NVML does).
pub fn mask(bits: impl IntoIterator<Item = u32>, words: usize) -> Vec<c_ulong> {
    let width = c_ulong::BITS as usize;
    let mut out = vec![0 as c_ulong; words];
    for b in bits {
        let b = b as usize;
        if let Some(w) = out.get_mut(b / width) {
            *w |= 1 << (b % width);
        }
    }
    out
}

fn scope_is_socket(scope: nvmlAffinityScope_t) -> NvmlResult<bool> {
    match scope {
        NVML_AFFINITY_SCOPE_NODE => Ok(false),
        NVML_AFFINITY_SCOPE_SOCKET => Ok(true),
        _ => Err(NVML_ERROR_INVALID_ARGUMENT),
    }
}

/// `nvmlDeviceGetCpuAffinity(WithinScope)`: the CPUs of the GPU's NUMA node or socket.
pub fn cpu_affinity(
    h: nvmlDevice_t,
    words: u32,
    scope: nvmlAffinityScope_t,
) -> NvmlResult<Vec<c_ulong>> {
    let dv = sim::live_device(h)?;
    if words == 0 {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    let socket = scope_is_socket(scope)?;
    Ok(mask(topo_of(&dv)?.cpus_of(dv.d, socket), words as usize))
}

/// `nvmlDeviceGetMemoryAffinity`: the NUMA nodes of the GPU's node or socket.
pub fn memory_affinity(
    h: nvmlDevice_t,
    words: u32,
    scope: nvmlAffinityScope_t,
) -> NvmlResult<Vec<c_ulong>> {
    let dv = sim::live_device(h)?;
    if words == 0 {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    let socket = scope_is_socket(scope)?;
    Ok(mask(
        topo_of(&dv)?.numa_nodes_of(dv.d, socket),
        words as usize,
    ))
}

/// `nvmlDeviceGetNumaNodeId`: NVIDIA answers it only where the GPU's memory is itself a
/// NUMA node (Grace Hopper, Grace Blackwell); on the x86 machines simulated here it is
/// `NVML_ERROR_NOT_SUPPORTED`, and a GPU's node comes from `nvmlDeviceGetMemoryAffinity`.
pub fn numa_node_id(h: nvmlDevice_t) -> NvmlResult<u32> {
    sim::live_device(h)?;
    Err(NVML_ERROR_NOT_SUPPORTED)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masks_set_the_right_bits() {
        let m = mask([0, 1, 63, 64, 200], 2);
        assert_eq!(m, vec![(1 << 63) | 3, 1]);
    }
}
