//! The container's view of a GPU's memory: what `cuMemGetInfo`, `cuDeviceTotalMem` and
//! `nvmlDeviceGetMemoryInfo` report under a quota, computed from what the real driver
//! reported (a device without a quota is shown as the driver sees it). The hooks read
//! the driver's answer, call one of these, and write the result back.

use crate::accounting;
use crate::process::{Shim, virtual_meminfo};

/// `cuMemGetInfo` of device `dev`: `(free, total)` under its quota, from the driver's
/// `(real_free, real_total)`; `None` when `dev` has no quota. What the pools no longer
/// keep is released first: it is not the container's any more.
pub fn cuda_mem_info(
    shim: &Shim,
    dev: usize,
    real_free: u64,
    real_total: u64,
) -> Option<(u64, u64)> {
    let q = shim.quota(dev)?;
    accounting::reconcile_all(shim, Some(dev));
    Some(virtual_meminfo(q, shim.used(dev), real_free, real_total))
}

/// `cuDeviceTotalMem` of device `dev` (a CUDA ordinal, possibly invalid): the driver's
/// `real_total`, capped by the quota.
pub fn device_total(shim: &Shim, dev: i32, real_total: usize) -> usize {
    match usize::try_from(dev).ok().and_then(|d| shim.quota(d)) {
        Some(q) => real_total.min(usize::try_from(q).unwrap_or(usize::MAX)),
        None => real_total,
    }
}

/// NVML's memory information of CUDA device `dev` under its quota: `(free, total,
/// used)` from the driver's `(real_free, real_total)`; `None` when `dev` has no quota.
pub fn nvml_memory(
    shim: &Shim,
    dev: usize,
    real_free: u64,
    real_total: u64,
) -> Option<(u64, u64, u64)> {
    let q = shim.quota(dev)?;
    let used = shim.used(dev);
    let (free, total) = virtual_meminfo(q, used, real_free, real_total);
    Some((free, total, used.min(total)))
}
