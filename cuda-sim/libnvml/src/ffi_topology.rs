//! The exported NVML topology, peer-to-peer, NVLink and affinity queries.
//!
//! As in [`crate::ffi`]: each export enters `guard`, checks its pointers, calls
//! [`crate::topo`] and writes the answer. The pointer contracts are `nvml.h`'s: output
//! pointers are null or valid for a write of their type, `cpuSet`/`nodeSet` hold
//! `cpuSetSize`/`nodeSetSize` `unsigned long`s, `deviceArray` holds `*count` handles.

// Parameter names are nvml.h's.
#![allow(non_snake_case)]

use std::ffi::{c_uint, c_ulong};

use vgpu_cuda_abi::nvml::*;

use crate::ffi::{get, guard, pci_info, pci_info_v2, put, put_slice};
use crate::sim::NvmlResult;
use crate::topo;

/// NVML's protocol for the handle lists of the topology queries: `*count == 0` asks for
/// the size (success, `*count` set); a smaller non-zero count is
/// `NVML_ERROR_INSUFFICIENT_SIZE` with `*count` set; otherwise the handles are written.
///
/// # Safety
/// `count` is null or valid for reading and writing a `c_uint`; `array` is null or valid
/// for writing `*count` handles.
unsafe fn handle_list(
    count: *mut c_uint,
    array: *mut nvmlDevice_t,
    items: &[nvmlDevice_t],
) -> NvmlResult<()> {
    // SAFETY: null (rejected) or valid, by this function's contract.
    let cap = unsafe { get(count) }? as usize;
    let n = c_uint::try_from(items.len()).expect("at most 8 devices");
    if cap == 0 {
        // SAFETY: as above.
        return unsafe { put(count, n) };
    }
    if cap < items.len() {
        // SAFETY: as above.
        unsafe { put(count, n) }?;
        return Err(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    // SAFETY: `array` holds `cap >= items.len()` handles by the contract.
    unsafe { put_slice(array, items) }?;
    // SAFETY: as above.
    unsafe { put(count, n) }
}

/// Writes a bitmask into a caller's `unsigned long` array.
///
/// # Safety
/// `set` is null or valid for writing `words.len()` `unsigned long`s.
unsafe fn put_mask(set: *mut c_ulong, words: &[c_ulong]) -> NvmlResult<()> {
    if set.is_null() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    // SAFETY: non-null and valid for `words.len()` elements by the contract.
    unsafe { put_slice(set, words) }
}

/// `nvmlDeviceGetTopologyCommonAncestor`.
///
/// # Safety
/// `pathInfo` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetTopologyCommonAncestor(
    device1: nvmlDevice_t,
    device2: nvmlDevice_t,
    pathInfo: *mut nvmlGpuTopologyLevel_t,
) -> nvmlReturn_t {
    guard(|| {
        let l = topo::common_ancestor(device1, device2)?;
        // SAFETY: null (rejected) or valid for the write.
        unsafe { put(pathInfo, l) }
    })
}

/// `nvmlDeviceGetTopologyNearestGpus`.
///
/// # Safety
/// `count` is null or valid for reading and writing a `c_uint`; `deviceArray` is null or
/// valid for writing `*count` handles (NVML's handle-list protocol: `*count == 0` asks
/// for the size).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetTopologyNearestGpus(
    device: nvmlDevice_t,
    level: nvmlGpuTopologyLevel_t,
    count: *mut c_uint,
    deviceArray: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    guard(|| {
        let gpus = topo::nearest_gpus(device, level)?;
        // SAFETY: the caller's contract, as `handle_list` needs it.
        unsafe { handle_list(count, deviceArray, &gpus) }
    })
}

/// `nvmlSystemGetTopologyGpuSet`.
///
/// # Safety
/// `count` is null or valid for reading and writing a `c_uint`; `deviceArray` is null or
/// valid for writing `*count` handles (NVML's handle-list protocol: `*count == 0` asks
/// for the size).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetTopologyGpuSet(
    cpuNumber: c_uint,
    count: *mut c_uint,
    deviceArray: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    guard(|| {
        let gpus = topo::gpu_set(cpuNumber)?;
        // SAFETY: the caller's contract, as `handle_list` needs it.
        unsafe { handle_list(count, deviceArray, &gpus) }
    })
}

/// `nvmlDeviceGetP2PStatus`.
///
/// # Safety
/// `p2pStatus` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetP2PStatus(
    device1: nvmlDevice_t,
    device2: nvmlDevice_t,
    p2pIndex: nvmlGpuP2PCapsIndex_t,
    p2pStatus: *mut nvmlGpuP2PStatus_t,
) -> nvmlReturn_t {
    guard(|| {
        let s = topo::p2p_status(device1, device2, p2pIndex)?;
        // SAFETY: null (rejected) or valid for the write.
        unsafe { put(p2pStatus, s) }
    })
}

/// `nvmlDeviceGetNvLinkState`.
///
/// # Safety
/// `isActive` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkState(
    device: nvmlDevice_t,
    link: c_uint,
    isActive: *mut nvmlEnableState_t,
) -> nvmlReturn_t {
    guard(|| {
        let v = topo::nvlink_state(device, link)?;
        // SAFETY: null (rejected) or valid for the write.
        unsafe { put(isActive, v) }
    })
}

/// `nvmlDeviceGetNvLinkVersion`.
///
/// # Safety
/// `version` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkVersion(
    device: nvmlDevice_t,
    link: c_uint,
    version: *mut c_uint,
) -> nvmlReturn_t {
    guard(|| {
        let v = topo::nvlink_version(device, link)?;
        // SAFETY: null (rejected) or valid for the write.
        unsafe { put(version, v) }
    })
}

/// `nvmlDeviceGetNvLinkCapability`.
///
/// # Safety
/// `capResult` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkCapability(
    device: nvmlDevice_t,
    link: c_uint,
    capability: nvmlNvLinkCapability_t,
    capResult: *mut c_uint,
) -> nvmlReturn_t {
    guard(|| {
        let v = topo::nvlink_capability(device, link, capability)?;
        // SAFETY: null (rejected) or valid for the write.
        unsafe { put(capResult, v) }
    })
}

/// `nvmlDeviceGetNvLinkRemotePciInfo_v2`.
///
/// # Safety
/// `pci` is null or valid for writing an [`nvmlPciInfo_t`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkRemotePciInfo_v2(
    device: nvmlDevice_t,
    link: c_uint,
    pci: *mut nvmlPciInfo_t,
) -> nvmlReturn_t {
    guard(|| {
        let p = topo::nvlink_remote_pci(device, link)?;
        let v = pci_info(&p);
        // SAFETY: null (rejected) or valid for the write.
        unsafe { put(pci, v) }
    })
}

/// `nvmlDeviceGetNvLinkRemotePciInfo` (first version): the older 52-byte layout.
///
/// # Safety
/// `pci` is null or valid for writing an [`nvmlPciInfo_v2_t`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkRemotePciInfo(
    device: nvmlDevice_t,
    link: c_uint,
    pci: *mut nvmlPciInfo_v2_t,
) -> nvmlReturn_t {
    guard(|| {
        let p = topo::nvlink_remote_pci(device, link)?;
        let v = pci_info_v2(&p);
        // SAFETY: null (rejected) or valid for the write.
        unsafe { put(pci, v) }
    })
}

/// `nvmlDeviceGetNvLinkRemoteDeviceType`.
///
/// # Safety
/// `pNvLinkDeviceType` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkRemoteDeviceType(
    device: nvmlDevice_t,
    link: c_uint,
    pNvLinkDeviceType: *mut nvmlIntNvLinkDeviceType_t,
) -> nvmlReturn_t {
    guard(|| {
        let v = topo::nvlink_remote_type(device, link)?;
        // SAFETY: null (rejected) or valid for the write.
        unsafe { put(pNvLinkDeviceType, v) }
    })
}

/// `nvmlDeviceGetCpuAffinity`: the CPUs of the GPU's NUMA node.
///
/// # Safety
/// `cpuSet` is null or valid for writing `cpuSetSize` `unsigned long`s.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCpuAffinity(
    device: nvmlDevice_t,
    cpuSetSize: c_uint,
    cpuSet: *mut c_ulong,
) -> nvmlReturn_t {
    guard(|| {
        let m = topo::cpu_affinity(device, cpuSetSize, NVML_AFFINITY_SCOPE_NODE)?;
        // SAFETY: the caller's contract.
        unsafe { put_mask(cpuSet, &m) }
    })
}

/// `nvmlDeviceGetCpuAffinityWithinScope`.
///
/// # Safety
/// `cpuSet` is null or valid for writing `cpuSetSize` `unsigned long`s.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCpuAffinityWithinScope(
    device: nvmlDevice_t,
    cpuSetSize: c_uint,
    cpuSet: *mut c_ulong,
    scope: nvmlAffinityScope_t,
) -> nvmlReturn_t {
    guard(|| {
        let m = topo::cpu_affinity(device, cpuSetSize, scope)?;
        // SAFETY: the caller's contract.
        unsafe { put_mask(cpuSet, &m) }
    })
}

/// `nvmlDeviceGetMemoryAffinity`.
///
/// # Safety
/// `nodeSet` is null or valid for writing `nodeSetSize` `unsigned long`s.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryAffinity(
    device: nvmlDevice_t,
    nodeSetSize: c_uint,
    nodeSet: *mut c_ulong,
    scope: nvmlAffinityScope_t,
) -> nvmlReturn_t {
    guard(|| {
        let m = topo::memory_affinity(device, nodeSetSize, scope)?;
        // SAFETY: the caller's contract.
        unsafe { put_mask(nodeSet, &m) }
    })
}

/// `nvmlDeviceGetNumaNodeId`: `NVML_ERROR_NOT_SUPPORTED` on the simulated (x86) nodes,
/// as on NVIDIA's (see [`topo::numa_node_id`]).
///
/// # Safety
/// `node` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNumaNodeId(
    device: nvmlDevice_t,
    node: *mut c_uint,
) -> nvmlReturn_t {
    guard(|| {
        let v = topo::numa_node_id(device)?;
        // SAFETY: null (rejected) or valid for the write.
        unsafe { put(node, v) }
    })
}
