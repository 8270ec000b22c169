//! The accounting core: what an allocation is charged (rounded to the driver's
//! granularity), reserving before the driver allocates and rolling back when it fails,
//! uncharging on free, the memory pools' credit reconciled with what the driver really
//! keeps, and the contexts whose allocations die with them. Called by the hooks with the
//! real call as a closure; calls the real driver only through [`crate::driver`].

use std::sync::atomic::Ordering;

use vgpu_cuda_abi::cuda::*;

use crate::config::MAX_DEVICES;
use crate::driver;
use crate::process::{self, Charge, Kind, Shim, enforced, enforcing, round_up};

/// The driver's allocation granularity of `dev` (cached; 2 MiB if it cannot say).
fn granularity(shim: &Shim, dev: usize) -> u64 {
    let g = shim.granularity(dev);
    if g != 0 {
        return g;
    }
    let g = driver::granularity(dev).unwrap_or(2 << 20);
    shim.set_granularity(dev, g);
    g
}

/// Reserve, allocate, roll back on failure; record the charge on success.
pub(crate) fn charged(
    kind: Kind,
    dev: Option<usize>,
    bytes: u64,
    call: impl FnOnce() -> CUresult,
    key: impl FnOnce() -> u64,
) -> CUresult {
    enforcing(CUDA_ERROR_NOT_PERMITTED, call, |shim, call| {
        // No current context: the driver refuses the allocation itself. A device beyond
        // the accounts is refused rather than allocated unaccounted.
        let Some(dev) = dev else { return call() };
        if dev >= MAX_DEVICES {
            return CUDA_ERROR_NOT_SUPPORTED;
        }
        let charge = round_up(bytes, granularity(shim, dev));
        if !reserve(shim, dev, charge) {
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        let r = call();
        if r != CUDA_SUCCESS {
            shim.unreserve(dev, charge);
            return r;
        }
        // Device pointers die with their context; VMM handles and arrays are kept until
        // released (the simulator keeps them; on a real driver a leaked handle of a
        // destroyed context stays charged until the process exits: the safe direction).
        let ctx = if kind == Kind::Ptr {
            driver::current_context()
        } else {
            0
        };
        let c = Charge {
            dev,
            bytes: charge,
            ctx,
            pool: 0,
        };
        if kind == Kind::Vmm {
            let stale = shim.vmm().created(key(), c);
            if let Some(old) = stale {
                shim.release(old, true);
            }
        } else {
            shim.track(kind, key(), c);
        }
        r
    })
}

/// Where a `cuMemCreate` allocation is charged, from its `CUmemLocation`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VmmLocation {
    /// Host memory (`CU_MEM_LOCATION_TYPE_HOST`, `_HOST_NUMA`, `_HOST_NUMA_CURRENT`):
    /// charged to no GPU.
    Host,
    /// The device the location names (None: an ordinal the driver will refuse).
    Device(Option<usize>),
    /// A location type this shim does not know: the current device (the safe
    /// direction; the driver refuses an invalid one and the charge is rolled back).
    Current,
}

/// Where an allocation at location (`type_`, `id`) is charged. A pure decision.
pub fn vmm_location(type_: u32, id: i32) -> VmmLocation {
    match type_ {
        CU_MEM_LOCATION_TYPE_DEVICE => VmmLocation::Device(usize::try_from(id).ok()),
        CU_MEM_LOCATION_TYPE_HOST
        | CU_MEM_LOCATION_TYPE_HOST_NUMA
        | CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT => VmmLocation::Host,
        _ => VmmLocation::Current,
    }
}

/// A VMM reference dropped (`cuMemRelease`, `call`): the charge goes back once no
/// reference and no mapping holds the memory.
pub(crate) fn vmm_released(handle: u64, call: impl FnOnce() -> CUresult) -> CUresult {
    let Some(shim) = enforced() else {
        return call();
    };
    let r = call();
    if r == CUDA_SUCCESS {
        let back = shim.vmm().released(handle);
        if let Some(c) = back {
            shim.release(c, true);
        }
    }
    r
}

/// A VMM reference taken (`cuMemRetainAllocationHandle` wrote `handle`).
pub(crate) fn vmm_retained(handle: u64) {
    if let Some(shim) = enforced() {
        shim.vmm().retained(handle);
    }
}

/// `handle` mapped at `[va, va + len)` (`cuMemMap` succeeded).
pub(crate) fn vmm_mapped(va: u64, len: u64, handle: u64) {
    if let Some(shim) = enforced() {
        shim.vmm().mapped(va, len, handle);
    }
}

/// `[va, va + len)` unmapped (`cuMemUnmap` succeeded): the charges of the handles that
/// nothing holds any more go back.
pub(crate) fn vmm_unmapped(va: u64, len: u64) {
    let Some(shim) = enforced() else { return };
    let back = shim.vmm().unmapped(va, len);
    for c in back {
        shim.release(c, true);
    }
}

/// Frees, uncharging what the allocation was charged (for an allocation from a memory
/// pool: into the pool's credit, reconciled with the driver after a synchronous free).
/// `synchronous`: the memory is freed when the call returns (not stream-ordered).
pub(crate) fn uncharged(
    kind: Kind,
    key: u64,
    synchronous: bool,
    call: impl FnOnce() -> CUresult,
) -> CUresult {
    let Some(shim) = enforced() else {
        return call();
    };
    let c = shim.untrack(kind, key);
    let r = call();
    match c {
        Some(c) if r == CUDA_SUCCESS => {
            shim.release(c, synchronous);
            if c.pool != 0 && synchronous {
                reconcile(shim, c.pool);
            }
        }
        Some(c) => shim.retrack(kind, key, c),
        None => {}
    }
    r
}

/// Reserves `bytes` on `dev`; before refusing, gives back what this process's pools on
/// `dev` no longer hold (the driver may have released cached memory since).
fn reserve(shim: &Shim, dev: usize, bytes: u64) -> bool {
    shim.reserve_or(dev, bytes, || reconcile_all(shim, Some(dev)) > 0)
}

/// Lowers the charge of `pool` to what the driver reserves for it (plus allocations in
/// flight); returns the bytes given back. A reading raced by an allocation is retried,
/// never used.
pub(crate) fn reconcile(shim: &Shim, pool: u64) -> u64 {
    reconcile_reading(shim, pool).0
}

/// [`reconcile`], also returning the driver's reserved figure it read last.
fn reconcile_reading(shim: &Shim, pool: u64) -> (u64, Option<u64>) {
    let mut last = None;
    for _ in 0..4 {
        let Some(epoch) = shim.pools().snapshot(pool) else {
            return (0, last);
        };
        let Some(reserved) = driver::pool_attr(pool, mempool_attr::RESERVED_MEM_CURRENT) else {
            return (0, last);
        };
        last = Some(reserved);
        let settled = shim.pools().settle(pool, epoch, reserved);
        if let Some((dev, back)) = settled {
            shim.unreserve(dev, back);
            return (back, last);
        }
    }
    (0, last)
}

/// Reconciles every pool of this process (on `dev`, or on all devices) that holds
/// credit; returns the bytes given back.
pub(crate) fn reconcile_all(shim: &Shim, dev: Option<usize>) -> u64 {
    if !shim.pools_used() || !shim.take_credit_mark() {
        return 0;
    }
    let pools = shim.pools().with_credit(dev);
    let back = pools.into_iter().map(|p| reconcile(shim, p)).sum();
    if !shim.pools().with_credit(None).is_empty() {
        shim.mark_credit();
    }
    back
}

/// After a synchronisation, when the driver releases what its pools keep above their
/// thresholds (`whole_context`: every stream-ordered free has executed).
pub(crate) fn synchronized(whole_context: bool) {
    let Some(shim) = enforced() else { return };
    if !shim.pools_used() {
        return;
    }
    if whole_context {
        let back = shim.pools().ctx_synchronized();
        for (dev, b) in back {
            shim.unreserve(dev, b);
        }
    }
    reconcile_all(shim, None);
}

/// A stream-ordered allocation of `bytes` from `pool` (device `dev` unless the pool's
/// is known): served from the pool's credit when it covers it, else charged; then the
/// driver's reserved figure is checked, and growth beyond the charge is charged too or
/// the allocation undone (`free`).
pub(crate) fn pool_alloc(
    pool: u64,
    dev: Option<usize>,
    bytes: u64,
    call: impl FnOnce() -> CUresult,
    result: impl FnOnce() -> CUdeviceptr,
    free: impl FnOnce(CUdeviceptr) -> CUresult,
) -> CUresult {
    enforcing(CUDA_ERROR_NOT_PERMITTED, call, |shim, call| {
        let known = shim.pools().get(pool).map(|a| a.dev);
        let Some(dev) = known.or(dev) else {
            return call();
        };
        if dev >= MAX_DEVICES {
            return CUDA_ERROR_NOT_SUPPORTED;
        }
        let need = round_up(bytes, granularity(shim, dev));
        if need == 0 {
            return call();
        }
        // The credit serves only what the driver really has cached now: it may have
        // released part of it since the last reconciliation, and frees it has not executed
        // yet are credit but no cache (the allocation would be reserved anew).
        let mut cached = 0;
        if shim.pools().get(pool).is_some_and(|a| a.credit() >= need)
            && let (_, Some(reserved)) = reconcile_reading(shim, pool)
            && let Some(used) = driver::pool_attr(pool, mempool_attr::USED_MEM_CURRENT)
        {
            cached = reserved.saturating_sub(used);
        }
        let fresh = if shim.pools().take_credit(pool, dev, need, cached) {
            false
        } else {
            if !reserve(shim, dev, need) {
                return CUDA_ERROR_OUT_OF_MEMORY;
            }
            shim.pools().add_fresh(pool, dev, need);
            true
        };
        let r = call();
        let (_, back) = shim.pools().finish(pool, need, fresh, r == CUDA_SUCCESS);
        shim.unreserve(dev, back);
        if r != CUDA_SUCCESS {
            // Credit taken for the allocation is credit again.
            shim.mark_credit();
            return r;
        }
        let ptr = result();
        if let Some(reserved) = driver::pool_attr(pool, mempool_attr::RESERVED_MEM_CURRENT) {
            let grow = shim.pools().growth(pool, reserved);
            if grow > 0 {
                if reserve(shim, dev, grow) {
                    shim.pools().add_charge(pool, grow);
                    shim.mark_credit();
                } else {
                    let fr = free(ptr);
                    let (d, back) = shim.pools().freed(pool, need, false);
                    shim.mark_credit();
                    shim.unreserve(d, back);
                    process::log(shim, || {
                        format!(
                            "device {dev}: pool {pool:#x} grew by {grow} bytes beyond its charge; \
                             the allocation is undone (free: {fr}), out of memory"
                        )
                    });
                    return CUDA_ERROR_OUT_OF_MEMORY;
                }
            }
        }
        shim.track(
            Kind::Ptr,
            ptr,
            Charge {
                dev,
                bytes: need,
                ctx: driver::current_context(),
                pool,
            },
        );
        r
    })
}

/// Pitch the driver picks for rows of `width` bytes (512-byte aligned rows).
const PITCH_ALIGN: u64 = 512;

/// A pitched allocation of `height` rows of `width` bytes (`key`: its pointer, `pitch`:
/// the pitch the driver chose, both read after success): charged at the estimated
/// pitch, then at the real one; one that does not fit at its real pitch is freed again
/// (`free`) and refused.
pub(crate) fn pitch_charged(
    width: u64,
    height: u64,
    call: impl FnOnce() -> CUresult,
    key: impl FnOnce() -> CUdeviceptr,
    pitch: impl FnOnce() -> u64,
    free: impl FnOnce(CUdeviceptr) -> CUresult,
) -> CUresult {
    let Some(shim) = enforced() else {
        return charged(Kind::Ptr, None, 0, call, || 0);
    };
    let Some(dev) = driver::current_device() else {
        return call();
    };
    let est = round_up(width, PITCH_ALIGN).saturating_mul(height);
    let mut ptr = 0;
    let r = charged(Kind::Ptr, Some(dev), est, call, || {
        ptr = key();
        ptr
    });
    if r != CUDA_SUCCESS {
        return r;
    }
    // The driver's real pitch may differ from the estimate: charge the truth.
    let actual = pitch().saturating_mul(height);
    let g = granularity(shim, dev);
    let (est, actual) = (round_up(est, g), round_up(actual, g));
    if actual > est {
        if !reserve(shim, dev, actual - est) {
            let _ = free(ptr);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
    } else if actual < est {
        shim.unreserve(dev, est - actual);
    }
    if let Some(mut c) = shim.untrack(Kind::Ptr, ptr) {
        c.bytes = actual;
        shim.retrack(Kind::Ptr, ptr, c);
    }
    r
}

/// A device ordinal within the accounts.
fn dev_index(dev: CUdevice) -> Option<usize> {
    usize::try_from(dev).ok().filter(|&d| d < MAX_DEVICES)
}

/// Whether this release (or reset) of the primary context of `dev` destroys it: the
/// last reference goes.
pub(crate) fn primary_is_gone(dev: CUdevice, reset: bool) -> bool {
    match (enforced(), dev_index(dev)) {
        (Some(shim), Some(d)) => reset || shim.primary_refs[d].load(Ordering::Acquire) <= 1,
        _ => false,
    }
}

/// After a successful primary release (`reset`: all references at once).
pub(crate) fn primary_released(dev: CUdevice, reset: bool) {
    let (Some(shim), Some(d)) = (enforced(), dev_index(dev)) else {
        return;
    };
    let refs = &shim.primary_refs[d];
    let before = if reset {
        refs.swap(0, Ordering::AcqRel)
    } else {
        refs.fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
            Some(v.saturating_sub(1))
        })
        .unwrap_or(0)
    };
    if before > 0 && (reset || before == 1) {
        shim.region.count_context(shim.slot, shim.rdev(d), false);
        let pools = shim.drop_context_allocs(shim.primary_ctx[d].swap(0, Ordering::AcqRel));
        for p in pools {
            reconcile(shim, p);
        }
    }
}

/// Runs a context creation (`created`: the context the driver wrote, None without an
/// out-pointer) and counts the context.
pub(crate) fn ctx_created(
    dev: CUdevice,
    call: impl FnOnce() -> CUresult,
    created: impl FnOnce() -> Option<usize>,
) -> CUresult {
    enforcing(CUDA_ERROR_NOT_PERMITTED, call, |shim, call| {
        let r = call();
        if let (CUDA_SUCCESS, Some(d)) = (r, dev_index(dev))
            && let Some(ctx) = created()
        {
            shim.ctx_dev
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(ctx, d);
            shim.region.count_context(shim.slot, shim.rdev(d), true);
            crate::gate::ensure_started(shim);
        }
        r
    })
}

/// After a successful retain of the primary context `ctx` of `dev`: counted at its first
/// reference.
pub(crate) fn primary_retained(shim: &'static Shim, dev: CUdevice, ctx: usize) {
    let Some(d) = dev_index(dev) else { return };
    if shim.primary_refs[d].fetch_add(1, Ordering::AcqRel) == 0 {
        shim.region.count_context(shim.slot, shim.rdev(d), true);
    }
    shim.primary_ctx[d].store(ctx, Ordering::Release);
    crate::gate::ensure_started(shim);
}

/// The primary context of `dev` as this process last retained it (0: none known).
pub(crate) fn primary_context(dev: CUdevice) -> usize {
    match (enforced(), dev_index(dev)) {
        (Some(shim), Some(d)) => shim.primary_ctx[d].load(Ordering::Acquire),
        _ => 0,
    }
}

/// After a successful destruction of context `ctx`: uncounted, and its allocations
/// uncharged.
pub(crate) fn ctx_destroyed(ctx: usize) {
    let Some(shim) = enforced() else { return };
    let dev = shim
        .ctx_dev
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .remove(&ctx);
    if let Some(d) = dev {
        shim.region.count_context(shim.slot, shim.rdev(d), false);
    }
    for p in shim.drop_context_allocs(ctx) {
        reconcile(shim, p);
    }
}

/// Destroys `pool` (`call`); what is still allocated from it (stream-ordered frees not
/// yet executed included) outlives the pool in the driver until freed.
pub(crate) fn pool_destroyed(pool: u64, call: impl FnOnce() -> CUresult) -> CUresult {
    let Some(shim) = enforced() else {
        return call();
    };
    let used = driver::pool_attr(pool, mempool_attr::USED_MEM_CURRENT);
    let r = call();
    if r == CUDA_SUCCESS {
        let (dev, back) = shim.pools().destroyed(pool, used);
        shim.unreserve(dev, back);
    }
    r
}

/// Records that `pool` allocates on `dev` (a pool created with a device location).
pub(crate) fn pool_created(pool: u64, dev: usize) {
    if let Some(shim) = enforced() {
        shim.pools().register(pool, dev);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_locations_are_charged_to_no_gpu() {
        for t in [
            CU_MEM_LOCATION_TYPE_HOST,
            CU_MEM_LOCATION_TYPE_HOST_NUMA,
            CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT,
        ] {
            // The id of a host location is a NUMA node (or ignored), never a device.
            assert_eq!(vmm_location(t, 3), VmmLocation::Host);
            assert_eq!(vmm_location(t, -1), VmmLocation::Host);
        }
        assert_eq!(
            vmm_location(CU_MEM_LOCATION_TYPE_DEVICE, 2),
            VmmLocation::Device(Some(2))
        );
        assert_eq!(
            vmm_location(CU_MEM_LOCATION_TYPE_DEVICE, -1),
            VmmLocation::Device(None)
        );
        assert_eq!(vmm_location(0, 0), VmmLocation::Current);
        assert_eq!(vmm_location(99, 0), VmmLocation::Current);
    }
}
