//! Hooks of NVML's topology queries that list GPUs (`nvmlDeviceGetTopologyNearestGpus`,
//! `nvmlSystemGetTopologyGpuSet`): a container sees only the GPUs it was given, so the
//! real list is filtered through [`crate::devices::nvml_visible`] (the handles are the
//! real NVML's; the container's own numbering comes from the `nvmlDeviceGetIndex` hook).
//! The topology queries that take handles and answer about them (common ancestor, P2P
//! status, NVLink state, affinity) pass through: the container can only name its own GPUs.
//! Part of [`crate::hooks`] (its `guard` and `real_or!`).

use std::ffi::c_uint;

use vgpu_cuda_abi::fns;
use vgpu_cuda_abi::nvml::{
    NVML_ERROR_INSUFFICIENT_SIZE, NVML_ERROR_INVALID_ARGUMENT, NVML_ERROR_LIBRARY_NOT_FOUND,
    NVML_ERROR_UNKNOWN, NVML_SUCCESS, nvmlDevice_t, nvmlGpuTopologyLevel_t, nvmlReturn_t,
};

use super::{guard, missing};
use crate::devices;
use crate::real::real;
use crate::table::Id;

/// The container's part of a handle list that `fetch` (the real function with its other
/// arguments bound) produces, returned with NVML's protocol: `*count == 0` asks for the
/// size; a smaller count is `NVML_ERROR_INSUFFICIENT_SIZE` with the size.
///
/// # Safety
/// `count` is null or valid for reading and writing; `array` is null or valid for
/// `*count` handles (the caller's NVML contract).
unsafe fn visible_list(
    count: *mut c_uint,
    array: *mut nvmlDevice_t,
    fetch: impl Fn(*mut c_uint, *mut nvmlDevice_t) -> nvmlReturn_t,
) -> nvmlReturn_t {
    match devices::nvml_map(super::passes_through()) {
        Ok(None) => return fetch(count, array),
        Ok(Some(_)) => {}
        Err(e) => return e,
    }
    if count.is_null() {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    let mut n: c_uint = 0;
    let r = fetch(&mut n, std::ptr::null_mut());
    if r != NVML_SUCCESS {
        return r;
    }
    let mut all = vec![std::ptr::null_mut(); n as usize];
    if n > 0 {
        let r = fetch(&mut n, all.as_mut_ptr());
        if r != NVML_SUCCESS {
            return r;
        }
        all.truncate(n as usize);
    }
    let mut mine = Vec::with_capacity(all.len());
    for h in all {
        match devices::nvml_visible(h, super::passes_through()) {
            Ok(true) => mine.push(h),
            Ok(false) => {}
            Err(e) => return e,
        }
    }
    let found = c_uint::try_from(mine.len()).unwrap_or(c_uint::MAX);
    // SAFETY: non-null, valid for reading and writing by the contract.
    let cap = unsafe { *count };
    // SAFETY: as above.
    unsafe { *count = found };
    if cap == 0 {
        return NVML_SUCCESS;
    }
    if cap < found {
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    if array.is_null() && found > 0 {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    for (i, h) in mine.into_iter().enumerate() {
        // SAFETY: `i < found <= cap`, and `array` holds `cap` handles by the contract.
        unsafe { array.add(i).write(h) };
    }
    NVML_SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetTopologyNearestGpus(
    device: nvmlDevice_t,
    level: nvmlGpuTopologyLevel_t,
    count: *mut c_uint,
    deviceArray: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    let f = real_or!(
        nvmlDeviceGetTopologyNearestGpus,
        fns::PFN_nvmlDeviceGetTopologyNearestGpus,
        NVML_ERROR_LIBRARY_NOT_FOUND
    );
    // SAFETY: forwarding the caller's arguments to the real function.
    let call = || unsafe { f(device, level, count, deviceArray) };
    guard(NVML_ERROR_UNKNOWN, call, || {
        // SAFETY: the caller's pointers, with the contract `visible_list` needs; the
        // real function gets ours or the caller's.
        unsafe { visible_list(count, deviceArray, |c, a| f(device, level, c, a)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetTopologyGpuSet(
    cpuNumber: c_uint,
    count: *mut c_uint,
    deviceArray: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    let f = real_or!(
        nvmlSystemGetTopologyGpuSet,
        fns::PFN_nvmlSystemGetTopologyGpuSet,
        NVML_ERROR_LIBRARY_NOT_FOUND
    );
    // SAFETY: forwarding the caller's arguments to the real function.
    let call = || unsafe { f(cpuNumber, count, deviceArray) };
    guard(NVML_ERROR_UNKNOWN, call, || {
        // SAFETY: as in the hook above.
        unsafe { visible_list(count, deviceArray, |c, a| f(cpuNumber, c, a)) }
    })
}
