//! The exported hooks, all together. Each is thin: it resolves the real function once,
//! enters `guard` (no panic crosses into the application; a re-entered hook calls the
//! real function directly), checks its raw pointers, runs the safe logic of
//! [`crate::state`], and returns a `CUresult` / `nvmlReturn_t`. No lock is held while the
//! real driver runs.

#![allow(non_snake_case, clippy::missing_safety_doc)]

use std::cell::Cell;
use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::sync::OnceLock;
use std::sync::atomic::Ordering;

use vgpu_cuda_abi::cuda::*;
use vgpu_cuda_abi::nvml::{
    NVML_ERROR_INVALID_ARGUMENT, NVML_ERROR_LIBRARY_NOT_FOUND, NVML_ERROR_NO_PERMISSION,
    NVML_ERROR_NOT_FOUND, NVML_SUCCESS, nvmlDevice_t, nvmlMemory_t, nvmlMemory_v2_t,
    nvmlProcessUtilizationSample_t, nvmlReturn_t,
};

use crate::config::MAX_DEVICES;
use crate::devices;
use crate::real::{self, real};
use crate::state::{self, Charge, Kind, Mode, Shim, array_bytes, mode, round_up, virtual_meminfo};
use crate::table::{Id, hook_addr};

thread_local! {
    static IN_HOOK: Cell<bool> = const { Cell::new(false) };
}

/// Runs `body` unless this thread is already inside a hook (then `reentered`), turning
/// a panic into `on_panic`.
fn guard<R>(on_panic: R, reentered: impl FnOnce() -> R, body: impl FnOnce() -> R) -> R {
    let already = IN_HOOK.try_with(|f| f.replace(true)).unwrap_or(true);
    if already {
        return reentered();
    }
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)).unwrap_or(on_panic);
    let _ = IN_HOOK.try_with(|f| f.set(false));
    r
}

/// Reports (once) that the real library cannot be used and returns `code`.
fn missing<R>(id: Id, code: R) -> R {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        let e = crate::table::entry(id);
        let why = match real::lib(e.lib) {
            Err(msg) => msg.to_owned(),
            Ok(_) => format!("the real library has no {}", e.symbol),
        };
        crate::say!("vgpu: ERROR: {why}");
    });
    code
}

/// The real function of a row, or an early return of `CUDA_ERROR_NOT_FOUND`.
macro_rules! real_or {
    ($id:ident, $ty:ty, $code:expr) => {
        // SAFETY: `$ty` is the C signature of `$id`, declared next to its hook.
        match unsafe { real::<$ty>(Id::$id) } {
            Some(f) => f,
            None => return missing(Id::$id, $code),
        }
    };
}

fn extra(cache: &'static OnceLock<usize>, name: &'static CStr) -> usize {
    *cache.get_or_init(|| real::cuda().map_or(0, |l| l.sym(name)))
}

/// The current context's device (None: no current context).
pub(crate) fn current_device() -> Option<usize> {
    static P: OnceLock<usize> = OnceLock::new();
    let p = extra(&P, c"cuCtxGetDevice");
    if p == 0 {
        return None;
    }
    // SAFETY: `p` is the real cuCtxGetDevice(CUdevice*).
    let f =
        unsafe { std::mem::transmute::<usize, unsafe extern "C" fn(*mut CUdevice) -> CUresult>(p) };
    let mut d: CUdevice = -1;
    // SAFETY: a valid out-pointer.
    let r = unsafe { f(&mut d) };
    (r == CUDA_SUCCESS)
        .then(|| usize::try_from(d).ok())
        .flatten()
}

/// The current context (0: none).
fn current_ctx() -> usize {
    static P: OnceLock<usize> = OnceLock::new();
    let p = extra(&P, c"cuCtxGetCurrent");
    if p == 0 {
        return 0;
    }
    // SAFETY: `p` is the real cuCtxGetCurrent(CUcontext*).
    let f = unsafe {
        std::mem::transmute::<usize, unsafe extern "C" fn(*mut CUcontext) -> CUresult>(p)
    };
    let mut c: CUcontext = std::ptr::null_mut();
    // SAFETY: a valid out-pointer.
    if unsafe { f(&mut c) } == CUDA_SUCCESS {
        c as usize
    } else {
        0
    }
}

/// The driver's allocation granularity of `dev` (cached; 2 MiB if it cannot say).
fn granularity(shim: &Shim, dev: usize) -> u64 {
    let g = shim.granularity(dev);
    if g != 0 {
        return g;
    }
    static P: OnceLock<usize> = OnceLock::new();
    let p = extra(&P, c"cuMemGetAllocationGranularity");
    let mut g = 2 << 20;
    if p != 0 {
        // SAFETY: `p` is the real cuMemGetAllocationGranularity(size_t*, const
        // CUmemAllocationProp*, CUmemAllocationGranularity_flags).
        let f = unsafe {
            std::mem::transmute::<
                usize,
                unsafe extern "C" fn(*mut usize, *const CUmemAllocationProp, c_int) -> CUresult,
            >(p)
        };
        let prop = CUmemAllocationProp {
            type_: CU_MEM_ALLOCATION_TYPE_PINNED,
            requestedHandleTypes: 0,
            location: CUmemLocation {
                type_: CU_MEM_LOCATION_TYPE_DEVICE,
                id: i32::try_from(dev).unwrap_or(0),
            },
            win32HandleMetaData: std::ptr::null_mut(),
            allocFlags: [0; 8],
        };
        let mut out = 0usize;
        // SAFETY: valid out- and in-pointers; option 0 = minimum granularity.
        if unsafe { f(&mut out, &prop, 0) } == CUDA_SUCCESS && out > 0 {
            g = out as u64;
        }
    }
    shim.set_granularity(dev, g);
    g
}

/// Reserve, allocate, roll back on failure; record the charge on success.
fn charged(
    kind: Kind,
    dev: Option<usize>,
    bytes: u64,
    call: impl FnOnce() -> CUresult,
    key: impl FnOnce() -> u64,
) -> CUresult {
    let shim = match mode() {
        Mode::Enforce(s) => s,
        Mode::Unenforced => return call(),
        Mode::Fail => return CUDA_ERROR_NOT_PERMITTED,
    };
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
    let ctx = if kind == Kind::Ptr { current_ctx() } else { 0 };
    shim.track(
        kind,
        key(),
        Charge {
            dev,
            bytes: charge,
            ctx,
            pool: 0,
        },
    );
    r
}

/// Frees, uncharging what the allocation was charged (for an allocation from a memory
/// pool: into the pool's credit, reconciled with the driver after a synchronous free).
/// `synchronous`: the memory is freed when the call returns (not stream-ordered).
fn uncharged(kind: Kind, key: u64, synchronous: bool, call: impl FnOnce() -> CUresult) -> CUresult {
    let Mode::Enforce(shim) = mode() else {
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

// ---- memory pools: what they keep stays charged ---------------------------------------

/// Reserves `bytes` on `dev`; before refusing, gives back what this process's pools on
/// `dev` no longer hold (the driver may have released cached memory since).
fn reserve(shim: &Shim, dev: usize, bytes: u64) -> bool {
    shim.reserve_or(dev, bytes, || reconcile_all(shim, Some(dev)) > 0)
}

/// A `u64` attribute of `pool` from the real driver (None: the query failed).
fn pool_attr(pool: u64, attr: c_int) -> Option<u64> {
    static P: OnceLock<usize> = OnceLock::new();
    let p = extra(&P, c"cuMemPoolGetAttribute");
    if p == 0 {
        return None;
    }
    // SAFETY: `p` is the real cuMemPoolGetAttribute(CUmemoryPool, CUmemPool_attribute,
    // void*).
    let f = unsafe {
        std::mem::transmute::<
            usize,
            unsafe extern "C" fn(CUmemoryPool, c_int, *mut c_void) -> CUresult,
        >(p)
    };
    let mut v = 0u64;
    // SAFETY: the reserved/used attributes are cuuint64_t, written to a valid u64.
    let r = unsafe { f(pool as CUmemoryPool, attr, (&raw mut v).cast()) };
    (r == CUDA_SUCCESS).then_some(v)
}

/// Lowers the charge of `pool` to what the driver reserves for it (plus allocations in
/// flight); returns the bytes given back. A reading raced by an allocation is retried,
/// never used.
fn reconcile(shim: &Shim, pool: u64) -> u64 {
    reconcile_reading(shim, pool).0
}

/// [`reconcile`], also returning the driver's reserved figure it read last.
fn reconcile_reading(shim: &Shim, pool: u64) -> (u64, Option<u64>) {
    let mut last = None;
    for _ in 0..4 {
        let Some(epoch) = shim.pools().snapshot(pool) else {
            return (0, last);
        };
        let Some(reserved) = pool_attr(pool, mempool_attr::RESERVED_MEM_CURRENT) else {
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
fn reconcile_all(shim: &Shim, dev: Option<usize>) -> u64 {
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
fn synchronized(whole_context: bool) {
    let Mode::Enforce(shim) = mode() else { return };
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
fn pool_alloc(
    pool: u64,
    dev: Option<usize>,
    bytes: u64,
    call: impl FnOnce() -> CUresult,
    result: impl FnOnce() -> CUdeviceptr,
    free: impl FnOnce(CUdeviceptr) -> CUresult,
) -> CUresult {
    let shim = match mode() {
        Mode::Enforce(s) => s,
        Mode::Unenforced => return call(),
        Mode::Fail => return CUDA_ERROR_NOT_PERMITTED,
    };
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
        && let Some(used) = pool_attr(pool, mempool_attr::USED_MEM_CURRENT)
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
    if let Some(reserved) = pool_attr(pool, mempool_attr::RESERVED_MEM_CURRENT) {
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
                state::log(shim, || {
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
            ctx: current_ctx(),
            pool,
        },
    );
    r
}

/// The current memory pool of `dev` (`cuDeviceGetMemPool`), which `cuMemAllocAsync`
/// allocates from.
fn current_pool(dev: usize) -> Option<u64> {
    static P: OnceLock<usize> = OnceLock::new();
    let p = extra(&P, c"cuDeviceGetMemPool");
    if p == 0 {
        return None;
    }
    // SAFETY: `p` is the real cuDeviceGetMemPool(CUmemoryPool*, CUdevice).
    let f = unsafe {
        std::mem::transmute::<usize, unsafe extern "C" fn(*mut CUmemoryPool, CUdevice) -> CUresult>(
            p,
        )
    };
    let mut pool: CUmemoryPool = std::ptr::null_mut();
    // SAFETY: a valid out-pointer and a device ordinal.
    let r = unsafe { f(&mut pool, CUdevice::try_from(dev).ok()?) };
    (r == CUDA_SUCCESS && !pool.is_null()).then_some(pool as u64)
}

/// The UUIDs (`GPU-…`) of the visible devices in CUDA ordinal order, from the real
/// driver (initialised here with `cuInit(0)`, which is idempotent). No lock is held.
pub fn device_uuids() -> Result<Vec<String>, String> {
    let lib = real::cuda().map_err(str::to_owned)?;
    let init = lib.sym(c"cuInit");
    let count = lib.sym(c"cuDeviceGetCount");
    let mut uuid = lib.sym(c"cuDeviceGetUuid_v2");
    if uuid == 0 {
        uuid = lib.sym(c"cuDeviceGetUuid");
    }
    if init == 0 || count == 0 || uuid == 0 {
        return Err("the real driver lacks cuInit, cuDeviceGetCount or cuDeviceGetUuid".into());
    }
    // SAFETY: `init` is the real cuInit(unsigned int).
    let init = unsafe { std::mem::transmute::<usize, CuInit>(init) };
    // SAFETY: `count` is the real cuDeviceGetCount(int*).
    let count = unsafe {
        std::mem::transmute::<usize, unsafe extern "C" fn(*mut c_int) -> CUresult>(count)
    };
    // SAFETY: `uuid` is the real cuDeviceGetUuid(_v2)(CUuuid*, CUdevice).
    let uuid = unsafe {
        std::mem::transmute::<usize, unsafe extern "C" fn(*mut CUuuid, CUdevice) -> CUresult>(uuid)
    };
    // SAFETY: plain flags argument.
    let r = unsafe { init(0) };
    if r != CUDA_SUCCESS {
        return Err(format!("cuInit returned {r}"));
    }
    let mut n: c_int = 0;
    // SAFETY: a valid out-pointer.
    let r = unsafe { count(&mut n) };
    if r != CUDA_SUCCESS {
        return Err(format!("cuDeviceGetCount returned {r}"));
    }
    let mut out = Vec::new();
    for d in 0..n {
        let mut u = CUuuid::default();
        // SAFETY: a valid out-pointer and an ordinal below the device count.
        let r = unsafe { uuid(&mut u, d) };
        if r != CUDA_SUCCESS {
            return Err(format!("cuDeviceGetUuid({d}) returned {r}"));
        }
        out.push(vgpu_core::gpu_uuid::format_uuid(&u.bytes));
    }
    Ok(out)
}

// ---- initialisation and entry-point resolution ------------------------------------

type CuInit = unsafe extern "C" fn(c_uint) -> CUresult;
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuInit(flags: c_uint) -> CUresult {
    let f = real_or!(cuInit, CuInit, CUDA_ERROR_NO_DEVICE);
    // SAFETY: forwarding the caller's arguments to the real function.
    let call = || unsafe { f(flags) };
    guard(CUDA_ERROR_UNKNOWN, call, || match mode() {
        Mode::Fail => CUDA_ERROR_NOT_PERMITTED,
        _ => call(),
    })
}

/// Replaces a resolved real entry point by its hook when it is one we intercept.
///
/// # Safety
/// `symbol` and `pfn` are the arguments of a `cuGetProcAddress` call that succeeded.
unsafe fn map_proc(symbol: *const c_char, pfn: *mut *mut c_void) {
    if pfn.is_null() {
        return;
    }
    // SAFETY: the driver succeeded, so `pfn` is a valid pointer it wrote.
    let p = unsafe { *pfn } as usize;
    let Ok(lib) = real::cuda() else { return };
    if let Some(id) = lib.id_of(p) {
        // SAFETY: as above.
        unsafe { *pfn = hook_addr(id) as *mut c_void };
    } else if !symbol.is_null()
        && let Mode::Enforce(s) = mode()
    {
        // SAFETY: the driver accepted `symbol` as a NUL-terminated name.
        let name = unsafe { CStr::from_ptr(symbol) }.to_bytes();
        if crate::table::TABLE
            .iter()
            .any(|e| e.base.as_bytes() == name)
        {
            state::log(s, || {
                format!(
                    "cuGetProcAddress({}) resolved to a function libvgpu does not know: passed through",
                    String::from_utf8_lossy(name)
                )
            });
        }
    }
}

type GetProc = unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64) -> CUresult;
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetProcAddress(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cudaVersion: c_int,
    flags: u64,
) -> CUresult {
    let f = real_or!(cuGetProcAddress, GetProc, CUDA_ERROR_NOT_INITIALIZED);
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(symbol, pfn, cudaVersion, flags) };
    guard(CUDA_ERROR_UNKNOWN, call, || {
        let r = call();
        if r == CUDA_SUCCESS {
            // SAFETY: the driver succeeded with these pointers.
            unsafe { map_proc(symbol, pfn) };
        }
        r
    })
}

type GetProcV2 =
    unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int) -> CUresult;
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetProcAddress_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cudaVersion: c_int,
    flags: u64,
    symbolStatus: *mut c_int,
) -> CUresult {
    let f = real_or!(cuGetProcAddress_v2, GetProcV2, CUDA_ERROR_NOT_INITIALIZED);
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(symbol, pfn, cudaVersion, flags, symbolStatus) };
    guard(CUDA_ERROR_UNKNOWN, call, || {
        let r = call();
        if r == CUDA_SUCCESS {
            // SAFETY: the driver succeeded with these pointers.
            unsafe { map_proc(symbol, pfn) };
        }
        r
    })
}

// ---- the container's view of memory -------------------------------------------------

type MemGetInfo = unsafe extern "C" fn(*mut usize, *mut usize) -> CUresult;
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    let f = real_or!(cuMemGetInfo_v2, MemGetInfo, CUDA_ERROR_NOT_INITIALIZED);
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(free, total) };
    guard(CUDA_ERROR_UNKNOWN, call, || {
        let shim = match mode() {
            Mode::Enforce(s) => s,
            Mode::Unenforced => return call(),
            Mode::Fail => return CUDA_ERROR_NOT_PERMITTED,
        };
        let r = call();
        if r != CUDA_SUCCESS || free.is_null() || total.is_null() {
            return r;
        }
        let Some(dev) = current_device() else {
            return r;
        };
        if let Some(q) = shim.quota(dev) {
            // What the pools no longer keep is not the container's any more.
            reconcile_all(shim, Some(dev));
            // SAFETY: the driver just wrote both non-null out-pointers.
            let (rf, rt) = unsafe { (*free as u64, *total as u64) };
            let (vf, vt) = virtual_meminfo(q, shim.used(dev), rf, rt);
            // SAFETY: as above.
            unsafe {
                *free = usize::try_from(vf).unwrap_or(usize::MAX);
                *total = usize::try_from(vt).unwrap_or(usize::MAX);
            }
        }
        r
    })
}

type DeviceTotalMem = unsafe extern "C" fn(*mut usize, CUdevice) -> CUresult;
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) -> CUresult {
    let f = real_or!(
        cuDeviceTotalMem_v2,
        DeviceTotalMem,
        CUDA_ERROR_NOT_INITIALIZED
    );
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(bytes, dev) };
    guard(CUDA_ERROR_UNKNOWN, call, || {
        let shim = match mode() {
            Mode::Enforce(s) => s,
            Mode::Unenforced => return call(),
            Mode::Fail => return CUDA_ERROR_NOT_PERMITTED,
        };
        let r = call();
        if r != CUDA_SUCCESS || bytes.is_null() {
            return r;
        }
        if let Some(q) = usize::try_from(dev).ok().and_then(|d| shim.quota(d)) {
            // SAFETY: the driver just wrote the non-null out-pointer.
            unsafe { *bytes = (*bytes).min(usize::try_from(q).unwrap_or(usize::MAX)) };
        }
        r
    })
}

// ---- allocations -------------------------------------------------------------------

type MemAlloc = unsafe extern "C" fn(*mut CUdeviceptr, usize) -> CUresult;
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, bytesize: usize) -> CUresult {
    let f = real_or!(cuMemAlloc_v2, MemAlloc, CUDA_ERROR_NOT_INITIALIZED);
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(dptr, bytesize) };
    guard(CUDA_ERROR_UNKNOWN, call, || {
        if dptr.is_null() {
            return call();
        }
        // SAFETY: non-null, and written by the driver on success.
        charged(
            Kind::Ptr,
            current_device(),
            bytesize as u64,
            call,
            || unsafe { *dptr },
        )
    })
}

type MemAllocManaged = unsafe extern "C" fn(*mut CUdeviceptr, usize, c_uint) -> CUresult;
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocManaged(
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    flags: c_uint,
) -> CUresult {
    let f = real_or!(
        cuMemAllocManaged,
        MemAllocManaged,
        CUDA_ERROR_NOT_INITIALIZED
    );
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(dptr, bytesize, flags) };
    guard(CUDA_ERROR_UNKNOWN, call, || {
        if dptr.is_null() {
            return call();
        }
        // SAFETY: non-null, and written by the driver on success.
        charged(
            Kind::Ptr,
            current_device(),
            bytesize as u64,
            call,
            || unsafe { *dptr },
        )
    })
}

/// Pitch the driver picks for rows of `width` bytes (512-byte aligned rows).
const PITCH_ALIGN: u64 = 512;

type MemAllocPitch =
    unsafe extern "C" fn(*mut CUdeviceptr, *mut usize, usize, usize, c_uint) -> CUresult;
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocPitch_v2(
    dptr: *mut CUdeviceptr,
    pPitch: *mut usize,
    WidthInBytes: usize,
    Height: usize,
    ElementSizeBytes: c_uint,
) -> CUresult {
    let f = real_or!(
        cuMemAllocPitch_v2,
        MemAllocPitch,
        CUDA_ERROR_NOT_INITIALIZED
    );
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes) };
    guard(CUDA_ERROR_UNKNOWN, call, || {
        if dptr.is_null() || pPitch.is_null() {
            return call();
        }
        let Mode::Enforce(shim) = mode() else {
            return charged(Kind::Ptr, None, 0, call, || 0);
        };
        let Some(dev) = current_device() else {
            return call();
        };
        let est = round_up(WidthInBytes as u64, PITCH_ALIGN).saturating_mul(Height as u64);
        let mut key = 0;
        let r = charged(Kind::Ptr, Some(dev), est, call, || {
            // SAFETY: written by the driver on success.
            key = unsafe { *dptr };
            key
        });
        if r != CUDA_SUCCESS {
            return r;
        }
        // The driver's real pitch may differ from the estimate: charge the truth.
        // SAFETY: written by the driver on success.
        let actual = (unsafe { *pPitch } as u64).saturating_mul(Height as u64);
        let g = granularity(shim, dev);
        let (est, actual) = (round_up(est, g), round_up(actual, g));
        if actual > est {
            if !reserve(shim, dev, actual - est) {
                // SAFETY: freeing the allocation just made.
                let _ = unsafe { cuMemFree_v2(key) };
                return CUDA_ERROR_OUT_OF_MEMORY;
            }
        } else if actual < est {
            shim.unreserve(dev, est - actual);
        }
        if let Some(mut c) = shim.untrack(Kind::Ptr, key) {
            c.bytes = actual;
            shim.retrack(Kind::Ptr, key, c);
        }
        r
    })
}

type MemFree = unsafe extern "C" fn(CUdeviceptr) -> CUresult;
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFree_v2(dptr: CUdeviceptr) -> CUresult {
    let f = real_or!(cuMemFree_v2, MemFree, CUDA_ERROR_NOT_INITIALIZED);
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(dptr) };
    // A re-entered free (from the pitch hook's rollback) must still uncharge.
    let body = || uncharged(Kind::Ptr, dptr, true, call);
    guard(CUDA_ERROR_UNKNOWN, body, body)
}

type MemAllocAsync = unsafe extern "C" fn(*mut CUdeviceptr, usize, CUstream) -> CUresult;
type MemFreeAsync = unsafe extern "C" fn(CUdeviceptr, CUstream) -> CUresult;
/// A stream-ordered allocation from the device's current pool.
///
/// # Safety
/// `f` is the real function and `free` the real `cuMemFreeAsync` of the same
/// per-thread-stream variant; the other arguments are the caller's, per the CUDA API.
unsafe fn alloc_async(
    f: MemAllocAsync,
    free: Option<MemFreeAsync>,
    dptr: *mut CUdeviceptr,
    n: usize,
    s: CUstream,
) -> CUresult {
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(dptr, n, s) };
    guard(CUDA_ERROR_UNKNOWN, call, || {
        if dptr.is_null() {
            return call();
        }
        let dev = current_device();
        match dev.and_then(current_pool) {
            Some(pool) => pool_alloc(
                pool,
                dev,
                n as u64,
                call,
                // SAFETY: non-null, and written by the driver on success.
                || unsafe { *dptr },
                // SAFETY: freeing, in the caller's stream, the allocation just made.
                |p| free.map_or(CUDA_ERROR_NOT_FOUND, |fr| unsafe { fr(p, s) }),
            ),
            // SAFETY: non-null, and written by the driver on success.
            None => charged(Kind::Ptr, dev, n as u64, call, || unsafe { *dptr }),
        }
    })
}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocAsync(
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    hStream: CUstream,
) -> CUresult {
    let f = real_or!(cuMemAllocAsync, MemAllocAsync, CUDA_ERROR_NOT_INITIALIZED);
    // SAFETY: the C signature of cuMemFreeAsync.
    let free = unsafe { real::<MemFreeAsync>(Id::cuMemFreeAsync) };
    // SAFETY: the caller's arguments, forwarded.
    unsafe { alloc_async(f, free, dptr, bytesize, hStream) }
}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocAsync_ptsz(
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    hStream: CUstream,
) -> CUresult {
    let f = real_or!(
        cuMemAllocAsync_ptsz,
        MemAllocAsync,
        CUDA_ERROR_NOT_INITIALIZED
    );
    // SAFETY: the C signature of cuMemFreeAsync_ptsz.
    let free = unsafe { real::<MemFreeAsync>(Id::cuMemFreeAsync_ptsz) };
    // SAFETY: the caller's arguments, forwarded.
    unsafe { alloc_async(f, free, dptr, bytesize, hStream) }
}

type MemAllocPool =
    unsafe extern "C" fn(*mut CUdeviceptr, usize, CUmemoryPool, CUstream) -> CUresult;
/// An allocation from a pool.
///
/// # Safety
/// `f` is the real function and `free` the real `cuMemFreeAsync` of the same
/// per-thread-stream variant; the other arguments are the caller's, per the CUDA API.
unsafe fn alloc_pool(
    f: MemAllocPool,
    free: Option<MemFreeAsync>,
    dptr: *mut CUdeviceptr,
    n: usize,
    pool: CUmemoryPool,
    s: CUstream,
) -> CUresult {
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(dptr, n, pool, s) };
    guard(CUDA_ERROR_UNKNOWN, call, || {
        if dptr.is_null() || pool.is_null() {
            return call();
        }
        pool_alloc(
            pool as u64,
            current_device(),
            n as u64,
            call,
            // SAFETY: non-null, and written by the driver on success.
            || unsafe { *dptr },
            // SAFETY: freeing, in the caller's stream, the allocation just made.
            |p| free.map_or(CUDA_ERROR_NOT_FOUND, |fr| unsafe { fr(p, s) }),
        )
    })
}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocFromPoolAsync(
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    pool: CUmemoryPool,
    hStream: CUstream,
) -> CUresult {
    let f = real_or!(
        cuMemAllocFromPoolAsync,
        MemAllocPool,
        CUDA_ERROR_NOT_INITIALIZED
    );
    // SAFETY: the C signature of cuMemFreeAsync.
    let free = unsafe { real::<MemFreeAsync>(Id::cuMemFreeAsync) };
    // SAFETY: the caller's arguments, forwarded.
    unsafe { alloc_pool(f, free, dptr, bytesize, pool, hStream) }
}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocFromPoolAsync_ptsz(
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    pool: CUmemoryPool,
    hStream: CUstream,
) -> CUresult {
    let f = real_or!(
        cuMemAllocFromPoolAsync_ptsz,
        MemAllocPool,
        CUDA_ERROR_NOT_INITIALIZED
    );
    // SAFETY: the C signature of cuMemFreeAsync_ptsz.
    let free = unsafe { real::<MemFreeAsync>(Id::cuMemFreeAsync_ptsz) };
    // SAFETY: the caller's arguments, forwarded.
    unsafe { alloc_pool(f, free, dptr, bytesize, pool, hStream) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFreeAsync(dptr: CUdeviceptr, hStream: CUstream) -> CUresult {
    let f = real_or!(cuMemFreeAsync, MemFreeAsync, CUDA_ERROR_NOT_INITIALIZED);
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(dptr, hStream) };
    guard(CUDA_ERROR_UNKNOWN, call, || {
        uncharged(Kind::Ptr, dptr, false, call)
    })
}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFreeAsync_ptsz(dptr: CUdeviceptr, hStream: CUstream) -> CUresult {
    let f = real_or!(
        cuMemFreeAsync_ptsz,
        MemFreeAsync,
        CUDA_ERROR_NOT_INITIALIZED
    );
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(dptr, hStream) };
    guard(CUDA_ERROR_UNKNOWN, call, || {
        uncharged(Kind::Ptr, dptr, false, call)
    })
}

// ---- memory pools and synchronisation: where the driver releases pool memory ----------

type MemPoolCreate = unsafe extern "C" fn(*mut CUmemoryPool, *const CUmemPoolProps) -> CUresult;
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemPoolCreate(
    pool: *mut CUmemoryPool,
    poolProps: *const CUmemPoolProps,
) -> CUresult {
    let f = real_or!(cuMemPoolCreate, MemPoolCreate, CUDA_ERROR_NOT_INITIALIZED);
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(pool, poolProps) };
    guard(CUDA_ERROR_UNKNOWN, call, || {
        let r = call();
        if r == CUDA_SUCCESS
            && !pool.is_null()
            && !poolProps.is_null()
            && let Mode::Enforce(shim) = mode()
        {
            // SAFETY: a non-null in-pointer the driver accepted, and the out-pointer it
            // wrote on success.
            let (props, handle) = unsafe { (poolProps.read_unaligned(), *pool) };
            if props.location.type_ == CU_MEM_LOCATION_TYPE_DEVICE
                && let Ok(dev) = usize::try_from(props.location.id)
            {
                shim.pools().register(handle as u64, dev);
            }
        }
        r
    })
}

type MemPoolDestroy = unsafe extern "C" fn(CUmemoryPool) -> CUresult;
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemPoolDestroy(pool: CUmemoryPool) -> CUresult {
    let f = real_or!(cuMemPoolDestroy, MemPoolDestroy, CUDA_ERROR_NOT_INITIALIZED);
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(pool) };
    guard(CUDA_ERROR_UNKNOWN, call, || {
        let Mode::Enforce(shim) = mode() else {
            return call();
        };
        // What is still allocated (stream-ordered frees not yet executed included)
        // outlives the pool in the driver until freed.
        let used = pool_attr(pool as u64, mempool_attr::USED_MEM_CURRENT);
        let r = call();
        if r == CUDA_SUCCESS {
            let (dev, back) = shim.pools().destroyed(pool as u64, used);
            shim.unreserve(dev, back);
        }
        r
    })
}

type MemPoolTrimTo = unsafe extern "C" fn(CUmemoryPool, usize) -> CUresult;
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemPoolTrimTo(pool: CUmemoryPool, minBytesToKeep: usize) -> CUresult {
    let f = real_or!(cuMemPoolTrimTo, MemPoolTrimTo, CUDA_ERROR_NOT_INITIALIZED);
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(pool, minBytesToKeep) };
    guard(CUDA_ERROR_UNKNOWN, call, || {
        let r = call();
        if r == CUDA_SUCCESS
            && let Mode::Enforce(shim) = mode()
        {
            reconcile(shim, pool as u64);
        }
        r
    })
}

type MemPoolSetAttribute = unsafe extern "C" fn(CUmemoryPool, c_int, *mut c_void) -> CUresult;
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemPoolSetAttribute(
    pool: CUmemoryPool,
    attr: c_int,
    value: *mut c_void,
) -> CUresult {
    let f = real_or!(
        cuMemPoolSetAttribute,
        MemPoolSetAttribute,
        CUDA_ERROR_NOT_INITIALIZED
    );
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(pool, attr, value) };
    guard(CUDA_ERROR_UNKNOWN, call, || {
        let r = call();
        // A lower release threshold can release cached memory at once.
        if r == CUDA_SUCCESS
            && attr == mempool_attr::RELEASE_THRESHOLD
            && let Mode::Enforce(shim) = mode()
        {
            reconcile(shim, pool as u64);
        }
        r
    })
}

type StreamSynchronize = unsafe extern "C" fn(CUstream) -> CUresult;
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamSynchronize(hStream: CUstream) -> CUresult {
    let f = real_or!(
        cuStreamSynchronize,
        StreamSynchronize,
        CUDA_ERROR_NOT_INITIALIZED
    );
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(hStream) };
    guard(CUDA_ERROR_UNKNOWN, call, || {
        let r = call();
        synchronized(false);
        r
    })
}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamSynchronize_ptsz(hStream: CUstream) -> CUresult {
    let f = real_or!(
        cuStreamSynchronize_ptsz,
        StreamSynchronize,
        CUDA_ERROR_NOT_INITIALIZED
    );
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(hStream) };
    guard(CUDA_ERROR_UNKNOWN, call, || {
        let r = call();
        synchronized(false);
        r
    })
}

type EventSynchronize = unsafe extern "C" fn(CUevent) -> CUresult;
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventSynchronize(hEvent: CUevent) -> CUresult {
    let f = real_or!(
        cuEventSynchronize,
        EventSynchronize,
        CUDA_ERROR_NOT_INITIALIZED
    );
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(hEvent) };
    guard(CUDA_ERROR_UNKNOWN, call, || {
        let r = call();
        synchronized(false);
        r
    })
}

type CtxSynchronize = unsafe extern "C" fn() -> CUresult;
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxSynchronize() -> CUresult {
    let f = real_or!(cuCtxSynchronize, CtxSynchronize, CUDA_ERROR_NOT_INITIALIZED);
    // SAFETY: no arguments.
    let call = || unsafe { f() };
    guard(CUDA_ERROR_UNKNOWN, call, || {
        let r = call();
        synchronized(r == CUDA_SUCCESS);
        r
    })
}

type CtxSynchronizeV2 = unsafe extern "C" fn(CUcontext) -> CUresult;
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxSynchronize_v2(ctx: CUcontext) -> CUresult {
    let f = real_or!(
        cuCtxSynchronize_v2,
        CtxSynchronizeV2,
        CUDA_ERROR_NOT_INITIALIZED
    );
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(ctx) };
    guard(CUDA_ERROR_UNKNOWN, call, || {
        let r = call();
        // Only one context's work is known to be done: destroyed pools keep their
        // charges (they may belong to another context).
        synchronized(false);
        r
    })
}

type MemCreate = unsafe extern "C" fn(
    *mut CUmemGenericAllocationHandle,
    usize,
    *const CUmemAllocationProp,
    u64,
) -> CUresult;
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemCreate(
    handle: *mut CUmemGenericAllocationHandle,
    size: usize,
    prop: *const CUmemAllocationProp,
    flags: u64,
) -> CUresult {
    let f = real_or!(cuMemCreate, MemCreate, CUDA_ERROR_NOT_INITIALIZED);
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(handle, size, prop, flags) };
    guard(CUDA_ERROR_UNKNOWN, call, || {
        if handle.is_null() || prop.is_null() {
            return call();
        }
        // SAFETY: a non-null in-pointer of the CUDA API, read once.
        let p = unsafe { prop.read_unaligned() };
        let dev = if p.location.type_ == CU_MEM_LOCATION_TYPE_DEVICE {
            usize::try_from(p.location.id).ok()
        } else {
            current_device()
        };
        // Not tied to a context: VMM allocations live until released.
        // SAFETY: non-null, and written by the driver on success.
        charged(Kind::Vmm, dev, size as u64, call, || unsafe { *handle })
    })
}

type MemRelease = unsafe extern "C" fn(CUmemGenericAllocationHandle) -> CUresult;
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemRelease(handle: CUmemGenericAllocationHandle) -> CUresult {
    let f = real_or!(cuMemRelease, MemRelease, CUDA_ERROR_NOT_INITIALIZED);
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(handle) };
    guard(CUDA_ERROR_UNKNOWN, call, || {
        uncharged(Kind::Vmm, handle, true, call)
    })
}

type ArrayCreate = unsafe extern "C" fn(*mut CUarray, *const CUDA_ARRAY_DESCRIPTOR) -> CUresult;
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArrayCreate_v2(
    pHandle: *mut CUarray,
    pAllocateArray: *const CUDA_ARRAY_DESCRIPTOR,
) -> CUresult {
    let f = real_or!(cuArrayCreate_v2, ArrayCreate, CUDA_ERROR_NOT_INITIALIZED);
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(pHandle, pAllocateArray) };
    guard(CUDA_ERROR_UNKNOWN, call, || {
        if pHandle.is_null() || pAllocateArray.is_null() {
            return call();
        }
        // SAFETY: a non-null in-pointer of the CUDA API, read once.
        let d = unsafe { pAllocateArray.read_unaligned() };
        let elem = array_format_bytes(d.Format).unwrap_or(0) * u64::from(d.NumChannels);
        let Some(bytes) = array_bytes(d.Width as u64, d.Height as u64, 0, elem, 0) else {
            return CUDA_ERROR_INVALID_VALUE;
        };
        // SAFETY: non-null, and written by the driver on success.
        charged(
            Kind::Array,
            current_device(),
            bytes,
            call,
            || unsafe { *pHandle } as u64,
        )
    })
}

type Array3DCreate = unsafe extern "C" fn(*mut CUarray, *const CUDA_ARRAY3D_DESCRIPTOR) -> CUresult;
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArray3DCreate_v2(
    pHandle: *mut CUarray,
    pAllocateArray: *const CUDA_ARRAY3D_DESCRIPTOR,
) -> CUresult {
    let f = real_or!(
        cuArray3DCreate_v2,
        Array3DCreate,
        CUDA_ERROR_NOT_INITIALIZED
    );
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(pHandle, pAllocateArray) };
    guard(CUDA_ERROR_UNKNOWN, call, || {
        if pHandle.is_null() || pAllocateArray.is_null() {
            return call();
        }
        // SAFETY: a non-null in-pointer of the CUDA API, read once.
        let d = unsafe { pAllocateArray.read_unaligned() };
        let elem = array_format_bytes(d.Format).unwrap_or(0) * u64::from(d.NumChannels);
        let Some(bytes) = array_bytes(d.Width as u64, d.Height as u64, d.Depth as u64, elem, 0)
        else {
            return CUDA_ERROR_INVALID_VALUE;
        };
        // SAFETY: non-null, and written by the driver on success.
        charged(
            Kind::Array,
            current_device(),
            bytes,
            call,
            || unsafe { *pHandle } as u64,
        )
    })
}

type ArrayDestroy = unsafe extern "C" fn(CUarray) -> CUresult;
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArrayDestroy(hArray: CUarray) -> CUresult {
    let f = real_or!(cuArrayDestroy, ArrayDestroy, CUDA_ERROR_NOT_INITIALIZED);
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(hArray) };
    guard(CUDA_ERROR_UNKNOWN, call, || {
        uncharged(Kind::Array, hArray as u64, true, call)
    })
}

type MipmapCreate =
    unsafe extern "C" fn(*mut CUmipmappedArray, *const CUDA_ARRAY3D_DESCRIPTOR, c_uint) -> CUresult;
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMipmappedArrayCreate(
    pHandle: *mut CUmipmappedArray,
    pMipmappedArrayDesc: *const CUDA_ARRAY3D_DESCRIPTOR,
    numMipmapLevels: c_uint,
) -> CUresult {
    let f = real_or!(
        cuMipmappedArrayCreate,
        MipmapCreate,
        CUDA_ERROR_NOT_INITIALIZED
    );
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(pHandle, pMipmappedArrayDesc, numMipmapLevels) };
    guard(CUDA_ERROR_UNKNOWN, call, || {
        if pHandle.is_null() || pMipmappedArrayDesc.is_null() || numMipmapLevels > 32 {
            return call();
        }
        // SAFETY: a non-null in-pointer of the CUDA API, read once.
        let d = unsafe { pMipmappedArrayDesc.read_unaligned() };
        let elem = array_format_bytes(d.Format).unwrap_or(0) * u64::from(d.NumChannels);
        let Some(bytes) = array_bytes(
            d.Width as u64,
            d.Height as u64,
            d.Depth as u64,
            elem,
            numMipmapLevels,
        ) else {
            return CUDA_ERROR_INVALID_VALUE;
        };
        // SAFETY: non-null, and written by the driver on success.
        charged(
            Kind::Mipmap,
            current_device(),
            bytes,
            call,
            || unsafe { *pHandle } as u64,
        )
    })
}

type MipmapDestroy = unsafe extern "C" fn(CUmipmappedArray) -> CUresult;
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMipmappedArrayDestroy(hMipmappedArray: CUmipmappedArray) -> CUresult {
    let f = real_or!(
        cuMipmappedArrayDestroy,
        MipmapDestroy,
        CUDA_ERROR_NOT_INITIALIZED
    );
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(hMipmappedArray) };
    guard(CUDA_ERROR_UNKNOWN, call, || {
        uncharged(Kind::Mipmap, hMipmappedArray as u64, true, call)
    })
}

// ---- contexts ------------------------------------------------------------------------

fn dev_index(dev: CUdevice) -> Option<usize> {
    usize::try_from(dev).ok().filter(|&d| d < MAX_DEVICES)
}

type PrimaryRetain = unsafe extern "C" fn(*mut CUcontext, CUdevice) -> CUresult;
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(pctx: *mut CUcontext, dev: CUdevice) -> CUresult {
    let f = real_or!(
        cuDevicePrimaryCtxRetain,
        PrimaryRetain,
        CUDA_ERROR_NOT_INITIALIZED
    );
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(pctx, dev) };
    guard(CUDA_ERROR_UNKNOWN, call, || {
        let shim = match mode() {
            Mode::Enforce(s) => s,
            Mode::Unenforced => return call(),
            Mode::Fail => return CUDA_ERROR_NOT_PERMITTED,
        };
        let r = call();
        if let (CUDA_SUCCESS, Some(d), false) = (r, dev_index(dev), pctx.is_null()) {
            if shim.primary_refs[d].fetch_add(1, Ordering::AcqRel) == 0 {
                shim.region.count_context(shim.slot, d, true);
            }
            // SAFETY: written by the driver on success.
            shim.primary_ctx[d].store(unsafe { *pctx } as usize, Ordering::Release);
            crate::gate::ensure_started(shim);
        }
        r
    })
}

/// Whether this release (or reset) of the primary context of `dev` destroys it: the
/// last reference goes.
fn primary_is_gone(dev: CUdevice, reset: bool) -> bool {
    match (mode(), dev_index(dev)) {
        (Mode::Enforce(shim), Some(d)) => {
            reset || shim.primary_refs[d].load(Ordering::Acquire) <= 1
        }
        _ => false,
    }
}

/// After a successful primary release (`reset`: all references at once).
fn primary_released(dev: CUdevice, reset: bool) {
    let (Mode::Enforce(shim), Some(d)) = (mode(), dev_index(dev)) else {
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
        shim.region.count_context(shim.slot, d, false);
        let pools = shim.drop_context_allocs(shim.primary_ctx[d].swap(0, Ordering::AcqRel));
        for p in pools {
            reconcile(shim, p);
        }
    }
}

type PrimaryRelease = unsafe extern "C" fn(CUdevice) -> CUresult;
/// A primary-context release or reset, and its accounting.
///
/// # Safety
/// `f` is the real release or reset function.
unsafe fn primary_release(f: PrimaryRelease, dev: CUdevice, reset: bool) -> CUresult {
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(dev) };
    guard(CUDA_ERROR_UNKNOWN, call, || {
        // Not while the launch gate synchronizes this process's contexts.
        let lock = crate::gate::CTX_LOCK
            .write()
            .unwrap_or_else(|p| p.into_inner());
        let before = match (mode(), dev_index(dev)) {
            (Mode::Enforce(shim), Some(d)) => shim.primary_ctx[d].load(Ordering::Acquire),
            _ => 0,
        };
        let r = call();
        if r == CUDA_SUCCESS && before != 0 && primary_is_gone(dev, reset) {
            crate::gate::forget_context(before);
        }
        drop(lock);
        if r == CUDA_SUCCESS {
            primary_released(dev, reset);
        }
        r
    })
}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxRelease(dev: CUdevice) -> CUresult {
    let f = real_or!(
        cuDevicePrimaryCtxRelease,
        PrimaryRelease,
        CUDA_ERROR_NOT_INITIALIZED
    );
    // SAFETY: the caller's argument, forwarded.
    unsafe { primary_release(f, dev, false) }
}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) -> CUresult {
    let f = real_or!(
        cuDevicePrimaryCtxRelease_v2,
        PrimaryRelease,
        CUDA_ERROR_NOT_INITIALIZED
    );
    // SAFETY: the caller's argument, forwarded.
    unsafe { primary_release(f, dev, false) }
}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxReset(dev: CUdevice) -> CUresult {
    let f = real_or!(
        cuDevicePrimaryCtxReset,
        PrimaryRelease,
        CUDA_ERROR_NOT_INITIALIZED
    );
    // SAFETY: the caller's argument, forwarded.
    unsafe { primary_release(f, dev, true) }
}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxReset_v2(dev: CUdevice) -> CUresult {
    let f = real_or!(
        cuDevicePrimaryCtxReset_v2,
        PrimaryRelease,
        CUDA_ERROR_NOT_INITIALIZED
    );
    // SAFETY: the caller's argument, forwarded.
    unsafe { primary_release(f, dev, true) }
}

/// Runs a context creation and counts the context.
fn ctx_created(pctx: *mut CUcontext, dev: CUdevice, call: impl FnOnce() -> CUresult) -> CUresult {
    let shim = match mode() {
        Mode::Enforce(s) => s,
        Mode::Unenforced => return call(),
        Mode::Fail => return CUDA_ERROR_NOT_PERMITTED,
    };
    let r = call();
    if let (CUDA_SUCCESS, Some(d), false) = (r, dev_index(dev), pctx.is_null()) {
        // SAFETY: written by the driver on success.
        let ctx = unsafe { *pctx } as usize;
        shim.ctx_dev
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(ctx, d);
        shim.region.count_context(shim.slot, d, true);
        crate::gate::ensure_started(shim);
    }
    r
}

type CtxCreateV2 = unsafe extern "C" fn(*mut CUcontext, c_uint, CUdevice) -> CUresult;
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxCreate_v2(
    pctx: *mut CUcontext,
    flags: c_uint,
    dev: CUdevice,
) -> CUresult {
    let f = real_or!(cuCtxCreate_v2, CtxCreateV2, CUDA_ERROR_NOT_INITIALIZED);
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(pctx, flags, dev) };
    guard(CUDA_ERROR_UNKNOWN, call, || ctx_created(pctx, dev, call))
}

type CtxCreateV3 =
    unsafe extern "C" fn(*mut CUcontext, *mut c_void, c_int, c_uint, CUdevice) -> CUresult;
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxCreate_v3(
    pctx: *mut CUcontext,
    paramsArray: *mut c_void,
    numParams: c_int,
    flags: c_uint,
    dev: CUdevice,
) -> CUresult {
    let f = real_or!(cuCtxCreate_v3, CtxCreateV3, CUDA_ERROR_NOT_INITIALIZED);
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(pctx, paramsArray, numParams, flags, dev) };
    guard(CUDA_ERROR_UNKNOWN, call, || ctx_created(pctx, dev, call))
}

type CtxCreateV4 = unsafe extern "C" fn(*mut CUcontext, *mut c_void, c_uint, CUdevice) -> CUresult;
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxCreate_v4(
    pctx: *mut CUcontext,
    ctxCreateParams: *mut c_void,
    flags: c_uint,
    dev: CUdevice,
) -> CUresult {
    let f = real_or!(cuCtxCreate_v4, CtxCreateV4, CUDA_ERROR_NOT_INITIALIZED);
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(pctx, ctxCreateParams, flags, dev) };
    guard(CUDA_ERROR_UNKNOWN, call, || ctx_created(pctx, dev, call))
}

type CtxDestroy = unsafe extern "C" fn(CUcontext) -> CUresult;
/// A context destruction, and its accounting.
///
/// # Safety
/// `f` is the real `cuCtxDestroy` of that ABI.
unsafe fn ctx_destroy(f: CtxDestroy, ctx: CUcontext) -> CUresult {
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(ctx) };
    guard(CUDA_ERROR_UNKNOWN, call, || {
        // Not while the launch gate synchronizes this process's contexts.
        let lock = crate::gate::CTX_LOCK
            .write()
            .unwrap_or_else(|p| p.into_inner());
        let r = call();
        if r == CUDA_SUCCESS {
            crate::gate::forget_context(ctx as usize);
        }
        drop(lock);
        if r == CUDA_SUCCESS
            && let Mode::Enforce(shim) = mode()
        {
            let dev = shim
                .ctx_dev
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&(ctx as usize));
            if let Some(d) = dev {
                shim.region.count_context(shim.slot, d, false);
            }
            for p in shim.drop_context_allocs(ctx as usize) {
                reconcile(shim, p);
            }
        }
        r
    })
}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxDestroy(ctx: CUcontext) -> CUresult {
    let f = real_or!(cuCtxDestroy, CtxDestroy, CUDA_ERROR_NOT_INITIALIZED);
    // SAFETY: the caller's argument, forwarded.
    unsafe { ctx_destroy(f, ctx) }
}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxDestroy_v2(ctx: CUcontext) -> CUresult {
    let f = real_or!(cuCtxDestroy_v2, CtxDestroy, CUDA_ERROR_NOT_INITIALIZED);
    // SAFETY: the caller's argument, forwarded.
    unsafe { ctx_destroy(f, ctx) }
}

// ---- launches (the compute gate) --------------------------------------------------

/// Waits for the queued work of context `ctx` (push, synchronize, pop) on the calling
/// thread (the gate thread): through the real driver, never the hooks.
pub(crate) fn sync_context(ctx: usize) {
    static PUSH: OnceLock<usize> = OnceLock::new();
    static POP: OnceLock<usize> = OnceLock::new();
    static SYNC: OnceLock<usize> = OnceLock::new();
    let push = extra(&PUSH, c"cuCtxPushCurrent_v2");
    let pop = extra(&POP, c"cuCtxPopCurrent_v2");
    let sync = extra(&SYNC, c"cuCtxSynchronize");
    if push == 0 || pop == 0 || sync == 0 || ctx == 0 {
        return;
    }
    // SAFETY: the real cuCtxPushCurrent_v2(CUcontext), cuCtxPopCurrent_v2(CUcontext*)
    // and cuCtxSynchronize(void).
    let (push, pop, sync) = unsafe {
        (
            std::mem::transmute::<usize, unsafe extern "C" fn(CUcontext) -> CUresult>(push),
            std::mem::transmute::<usize, unsafe extern "C" fn(*mut CUcontext) -> CUresult>(pop),
            std::mem::transmute::<usize, unsafe extern "C" fn() -> CUresult>(sync),
        )
    };
    // SAFETY: `ctx` is a live context of this process (the caller holds the context
    // lock that destroy hooks take); the out-pointer is valid.
    unsafe {
        if push(ctx as CUcontext) == CUDA_SUCCESS {
            sync();
            let mut popped: CUcontext = std::ptr::null_mut();
            pop(&mut popped);
        }
    }
}

/// The current context (0: none), for the gate's marker events.
pub(crate) fn current_context() -> usize {
    current_ctx()
}

/// A new event without timing in the current context (None: the driver refused).
pub(crate) fn create_event() -> Option<usize> {
    static P: OnceLock<usize> = OnceLock::new();
    let p = extra(&P, c"cuEventCreate");
    if p == 0 {
        return None;
    }
    // SAFETY: `p` is the real cuEventCreate(CUevent*, unsigned int).
    let f = unsafe {
        std::mem::transmute::<usize, unsafe extern "C" fn(*mut CUevent, c_uint) -> CUresult>(p)
    };
    let mut e: CUevent = std::ptr::null_mut();
    // SAFETY: a valid out-pointer; 2 = CU_EVENT_DISABLE_TIMING.
    let r = unsafe { f(&mut e, 2) };
    (r == CUDA_SUCCESS && !e.is_null()).then_some(e as usize)
}

/// Records `event` on `stream` (after the launch just made on it).
pub(crate) fn record_event(event: usize, stream: usize) -> bool {
    static P: OnceLock<usize> = OnceLock::new();
    let p = extra(&P, c"cuEventRecord");
    if p == 0 {
        return false;
    }
    // SAFETY: `p` is the real cuEventRecord(CUevent, CUstream).
    let f = unsafe {
        std::mem::transmute::<usize, unsafe extern "C" fn(CUevent, CUstream) -> CUresult>(p)
    };
    // SAFETY: an event this shim created in the current context, and the stream the
    // application launched on.
    unsafe { f(event as CUevent, stream as CUstream) == CUDA_SUCCESS }
}

/// Whether `event` has completed (an error counts as completed: nothing to wait for).
pub(crate) fn event_done(event: usize) -> bool {
    static P: OnceLock<usize> = OnceLock::new();
    let p = extra(&P, c"cuEventQuery");
    if p == 0 {
        return true;
    }
    // SAFETY: `p` is the real cuEventQuery(CUevent).
    let f = unsafe { std::mem::transmute::<usize, unsafe extern "C" fn(CUevent) -> CUresult>(p) };
    // SAFETY: an event of a live context (the caller holds the context lock).
    unsafe { f(event as CUevent) != CUDA_ERROR_NOT_READY }
}

/// Runs `launch` once the gate admits it (enforcing mode), else directly.
fn gated(stream: CUstream, ptsz: bool, launch: impl FnOnce() -> CUresult) -> CUresult {
    let shim = match mode() {
        Mode::Enforce(s) => s,
        Mode::Unenforced => return launch(),
        Mode::Fail => return CUDA_ERROR_NOT_PERMITTED,
    };
    let pass = match crate::gate::enter(shim, current_device, stream as usize, ptsz) {
        Ok(p) => p,
        // A GPU the container was not granted: no compute share.
        Err(crate::gate::NotGranted) => return CUDA_ERROR_NOT_PERMITTED,
    };
    let r = launch();
    drop(pass);
    r
}

type LaunchKernel = unsafe extern "C" fn(
    CUfunction,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    CUstream,
    *mut *mut c_void,
    *mut *mut c_void,
) -> CUresult;
type LaunchKernelEx = unsafe extern "C" fn(
    *const CUlaunchConfig,
    CUfunction,
    *mut *mut c_void,
    *mut *mut c_void,
) -> CUresult;
type LaunchCooperative = unsafe extern "C" fn(
    CUfunction,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    CUstream,
    *mut *mut c_void,
) -> CUresult;
type GraphLaunch = unsafe extern "C" fn(CUgraphExec, CUstream) -> CUresult;

/// The stream of a `cuLaunchKernelEx` configuration (null config: the default stream).
fn ex_stream(config: *const CUlaunchConfig) -> CUstream {
    if config.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: a non-null config points to the caller's CUlaunchConfig for the call.
    unsafe { (*config).hStream }
}

/// A launch hook: the real function of the same name, run once the gate admits it on
/// the launch's stream (`$stream`, an expression over the arguments).
macro_rules! gated_launch_hook {
    ($name:ident, $ty:ty, $stream:expr, ($($arg:ident: $t:ty),* $(,)?)) => {
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name($($arg: $t),*) -> CUresult {
            let real = real_or!($name, $ty, CUDA_ERROR_NOT_INITIALIZED);
            // SAFETY: forwarding the caller's arguments.
            let call = || unsafe { real($($arg),*) };
            let ptsz = stringify!($name).ends_with("_ptsz");
            let stream = $stream;
            guard(CUDA_ERROR_UNKNOWN, call, || gated(stream, ptsz, call))
        }
    };
}

macro_rules! launch_kernel_hook {
    ($name:ident) => {
        gated_launch_hook!($name, LaunchKernel, hStream, (
            f: CUfunction,
            gridDimX: c_uint,
            gridDimY: c_uint,
            gridDimZ: c_uint,
            blockDimX: c_uint,
            blockDimY: c_uint,
            blockDimZ: c_uint,
            sharedMemBytes: c_uint,
            hStream: CUstream,
            kernelParams: *mut *mut c_void,
            extra: *mut *mut c_void,
        ));
    };
}
launch_kernel_hook!(cuLaunchKernel);
launch_kernel_hook!(cuLaunchKernel_ptsz);

macro_rules! launch_kernel_ex_hook {
    ($name:ident) => {
        gated_launch_hook!($name, LaunchKernelEx, ex_stream(config), (
            config: *const CUlaunchConfig,
            f: CUfunction,
            kernelParams: *mut *mut c_void,
            extra: *mut *mut c_void,
        ));
    };
}
launch_kernel_ex_hook!(cuLaunchKernelEx);
launch_kernel_ex_hook!(cuLaunchKernelEx_ptsz);

macro_rules! launch_cooperative_hook {
    ($name:ident) => {
        gated_launch_hook!($name, LaunchCooperative, hStream, (
            f: CUfunction,
            gridDimX: c_uint,
            gridDimY: c_uint,
            gridDimZ: c_uint,
            blockDimX: c_uint,
            blockDimY: c_uint,
            blockDimZ: c_uint,
            sharedMemBytes: c_uint,
            hStream: CUstream,
            kernelParams: *mut *mut c_void,
        ));
    };
}
launch_cooperative_hook!(cuLaunchCooperativeKernel);
launch_cooperative_hook!(cuLaunchCooperativeKernel_ptsz);

gated_launch_hook!(cuGraphLaunch, GraphLaunch, hStream, (hGraphExec: CUgraphExec, hStream: CUstream));
gated_launch_hook!(cuGraphLaunch_ptsz, GraphLaunch, hStream, (hGraphExec: CUgraphExec, hStream: CUstream));

// ---- NVML --------------------------------------------------------------------------

/// The CUDA ordinal of NVML device `device`, under which the container's accounts are
/// kept (by UUID: [`crate::devices::cuda_ordinal`]).
fn nvml_index(device: nvmlDevice_t) -> Option<usize> {
    devices::cuda_ordinal(device)
}

type NvmlMemInfo = unsafe extern "C" fn(nvmlDevice_t, *mut nvmlMemory_t) -> nvmlReturn_t;
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo(
    device: nvmlDevice_t,
    memory: *mut nvmlMemory_t,
) -> nvmlReturn_t {
    let f = real_or!(
        nvmlDeviceGetMemoryInfo,
        NvmlMemInfo,
        NVML_ERROR_NO_PERMISSION
    );
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(device, memory) };
    guard(vgpu_cuda_abi::nvml::NVML_ERROR_UNKNOWN, call, || {
        let shim = match mode() {
            Mode::Enforce(s) => s,
            Mode::Unenforced => return call(),
            Mode::Fail => return NVML_ERROR_NO_PERMISSION,
        };
        let r = call();
        if r != NVML_SUCCESS || memory.is_null() {
            return r;
        }
        if let Some(d) = nvml_index(device)
            && let Some(q) = shim.quota(d)
        {
            // SAFETY: the real NVML just filled the non-null struct.
            let m = unsafe { &mut *memory };
            let used = shim.used(d);
            let (free, total) = virtual_meminfo(q, used, m.free, m.total);
            m.total = total;
            m.free = free;
            m.used = used.min(total);
        }
        r
    })
}

type NvmlMemInfoV2 = unsafe extern "C" fn(nvmlDevice_t, *mut nvmlMemory_v2_t) -> nvmlReturn_t;
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    device: nvmlDevice_t,
    memory: *mut nvmlMemory_v2_t,
) -> nvmlReturn_t {
    let f = real_or!(
        nvmlDeviceGetMemoryInfo_v2,
        NvmlMemInfoV2,
        NVML_ERROR_NO_PERMISSION
    );
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(device, memory) };
    guard(vgpu_cuda_abi::nvml::NVML_ERROR_UNKNOWN, call, || {
        let shim = match mode() {
            Mode::Enforce(s) => s,
            Mode::Unenforced => return call(),
            Mode::Fail => return NVML_ERROR_NO_PERMISSION,
        };
        let r = call();
        if r != NVML_SUCCESS || memory.is_null() {
            return r;
        }
        if let Some(d) = nvml_index(device)
            && let Some(q) = shim.quota(d)
        {
            // SAFETY: the real NVML just filled the non-null struct.
            let m = unsafe { &mut *memory };
            let used = shim.used(d);
            let (free, total) = virtual_meminfo(q, used, m.free, m.total);
            m.total = total;
            m.reserved = 0;
            m.free = free;
            m.used = used.min(total);
        }
        r
    })
}

type NvmlProcs = unsafe extern "C" fn(nvmlDevice_t, *mut c_uint, *mut c_void) -> nvmlReturn_t;

/// Keeps only the container's processes in a process list of `stride`-byte entries
/// whose first field is the pid.
///
/// # Safety
/// `f` is the real process-list function whose entries are `stride` bytes; the other
/// arguments are the caller's, per NVML.
unsafe fn procs(
    f: NvmlProcs,
    stride: usize,
    device: nvmlDevice_t,
    count: *mut c_uint,
    infos: *mut c_void,
) -> nvmlReturn_t {
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(device, count, infos) };
    guard(vgpu_cuda_abi::nvml::NVML_ERROR_UNKNOWN, call, || {
        let shim = match mode() {
            Mode::Enforce(s) => s,
            Mode::Unenforced => return call(),
            Mode::Fail => return NVML_ERROR_NO_PERMISSION,
        };
        let r = call();
        if r != NVML_SUCCESS || count.is_null() || infos.is_null() {
            return r;
        }
        shim.region.reap(Some(shim.slot));
        let dev = nvml_index(device);
        let base = infos.cast::<u8>();
        // SAFETY: the real NVML wrote `*count` entries of `stride` bytes at `infos`.
        let n = unsafe { *count } as usize;
        let mut kept = 0usize;
        for i in 0..n {
            // SAFETY: entry i lies within the `n` written entries; pid is its first
            // (4-byte) field, read unaligned.
            let pid = unsafe { base.add(i * stride).cast::<u32>().read_unaligned() };
            let Some(used) = shim.region.pid_used(pid, dev.unwrap_or(usize::MAX)) else {
                continue;
            };
            let own_pid = shim.region.container_pid(pid).unwrap_or(pid);
            let dst = base.wrapping_add(kept * stride);
            if kept != i {
                // SAFETY: both entries lie within the buffer; `kept < i` so they do
                // not overlap.
                unsafe { std::ptr::copy_nonoverlapping(base.add(i * stride), dst, stride) };
            }
            // The process as the container knows it: its PID in the container's namespace
            // (NVML reports host PIDs) and its memory as the container counts it (what
            // its quota covers).
            // SAFETY: pid is the u32 at offset 0 and usedGpuMemory the u64 at offset 8
            // of every entry version.
            unsafe {
                dst.cast::<u32>().write_unaligned(own_pid);
                dst.add(8).cast::<u64>().write_unaligned(used);
            }
            kept += 1;
        }
        // SAFETY: non-null out-pointer.
        unsafe { *count = kept as c_uint };
        r
    })
}

/// `nvmlProcessInfo_v1_t`: pid, usedGpuMemory.
const PROC_V1: usize = 16;
/// `nvmlProcessInfo_t` (v2/v3): pid, usedGpuMemory, gpuInstanceId, computeInstanceId.
const PROC_V2: usize = 24;

macro_rules! proc_hooks {
    ($($name:ident $stride:ident;)*) => {$(
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(
            device: nvmlDevice_t,
            infoCount: *mut c_uint,
            infos: *mut c_void,
        ) -> nvmlReturn_t {
            let f = real_or!($name, NvmlProcs, NVML_ERROR_NO_PERMISSION);
            // SAFETY: the caller's arguments, forwarded.
            unsafe { procs(f, $stride, device, infoCount, infos) }
        }
    )*};
}

proc_hooks! {
    nvmlDeviceGetComputeRunningProcesses PROC_V1;
    nvmlDeviceGetComputeRunningProcesses_v2 PROC_V2;
    nvmlDeviceGetComputeRunningProcesses_v3 PROC_V2;
    nvmlDeviceGetGraphicsRunningProcesses PROC_V1;
    nvmlDeviceGetGraphicsRunningProcesses_v2 PROC_V2;
    nvmlDeviceGetGraphicsRunningProcesses_v3 PROC_V2;
    nvmlDeviceGetMPSComputeRunningProcesses PROC_V1;
    nvmlDeviceGetMPSComputeRunningProcesses_v2 PROC_V2;
    nvmlDeviceGetMPSComputeRunningProcesses_v3 PROC_V2;
}

type NvmlProcUtil = unsafe extern "C" fn(
    nvmlDevice_t,
    *mut nvmlProcessUtilizationSample_t,
    *mut c_uint,
    u64,
) -> nvmlReturn_t;
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetProcessUtilization(
    device: nvmlDevice_t,
    utilization: *mut nvmlProcessUtilizationSample_t,
    processSamplesCount: *mut c_uint,
    lastSeenTimeStamp: u64,
) -> nvmlReturn_t {
    let f = real_or!(
        nvmlDeviceGetProcessUtilization,
        NvmlProcUtil,
        NVML_ERROR_NO_PERMISSION
    );
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(device, utilization, processSamplesCount, lastSeenTimeStamp) };
    guard(vgpu_cuda_abi::nvml::NVML_ERROR_UNKNOWN, call, || {
        let shim = match mode() {
            Mode::Enforce(s) => s,
            Mode::Unenforced => return call(),
            Mode::Fail => return NVML_ERROR_NO_PERMISSION,
        };
        let r = call();
        if r != NVML_SUCCESS || utilization.is_null() || processSamplesCount.is_null() {
            return r;
        }
        // SAFETY: the real NVML wrote `*processSamplesCount` samples at `utilization`.
        let n = unsafe { *processSamplesCount } as usize;
        let mut kept = 0usize;
        for i in 0..n {
            // SAFETY: sample i lies within the `n` written samples.
            let mut s = unsafe { utilization.add(i).read_unaligned() };
            if let Some(own) = shim.region.container_pid(s.pid) {
                s.pid = own;
                // SAFETY: `kept <= i < n`: within the written samples.
                unsafe { utilization.add(kept).write_unaligned(s) };
                kept += 1;
            }
        }
        // SAFETY: non-null out-pointer.
        unsafe { *processSamplesCount = kept as c_uint };
        r
    })
}

// ---- NVML: the container's devices only (ADR 0014) ----------------------------------

type NvmlCount = unsafe extern "C" fn(*mut c_uint) -> nvmlReturn_t;
macro_rules! nvml_count_hook {
    ($name:ident) => {
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(deviceCount: *mut c_uint) -> nvmlReturn_t {
            let f = real_or!($name, NvmlCount, NVML_ERROR_LIBRARY_NOT_FOUND);
            // SAFETY: forwarding the caller's arguments.
            let call = || unsafe { f(deviceCount) };
            guard(vgpu_cuda_abi::nvml::NVML_ERROR_UNKNOWN, call, || {
                let r = call();
                if r != NVML_SUCCESS || deviceCount.is_null() {
                    return r;
                }
                match devices::nvml_map() {
                    Ok(None) => r,
                    Ok(Some(m)) => {
                        // SAFETY: the real NVML just wrote the non-null out-pointer.
                        unsafe { *deviceCount = m.len() as c_uint };
                        r
                    }
                    Err(e) => e,
                }
            })
        }
    };
}
nvml_count_hook!(nvmlDeviceGetCount);
nvml_count_hook!(nvmlDeviceGetCount_v2);

type NvmlByIndex = unsafe extern "C" fn(c_uint, *mut nvmlDevice_t) -> nvmlReturn_t;
macro_rules! nvml_by_index_hook {
    ($name:ident) => {
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(index: c_uint, device: *mut nvmlDevice_t) -> nvmlReturn_t {
            let f = real_or!($name, NvmlByIndex, NVML_ERROR_LIBRARY_NOT_FOUND);
            // SAFETY: forwarding the caller's arguments.
            let call = || unsafe { f(index, device) };
            guard(
                vgpu_cuda_abi::nvml::NVML_ERROR_UNKNOWN,
                call,
                || match devices::nvml_map() {
                    Ok(None) => call(),
                    Ok(Some(m)) => match m
                        .real(index as usize)
                        .and_then(|i| c_uint::try_from(i).ok())
                    {
                        // SAFETY: the caller's out-pointer, NVML's index of the container's
                        // device `index`.
                        Some(real_index) => unsafe { f(real_index, device) },
                        None => NVML_ERROR_INVALID_ARGUMENT,
                    },
                    Err(e) => e,
                },
            )
        }
    };
}
nvml_by_index_hook!(nvmlDeviceGetHandleByIndex);
nvml_by_index_hook!(nvmlDeviceGetHandleByIndex_v2);

type NvmlByKey = unsafe extern "C" fn(*const c_char, *mut nvmlDevice_t) -> nvmlReturn_t;
/// A handle looked up by UUID, PCI bus id or serial: a GPU the container was not given
/// is not found.
macro_rules! nvml_by_key_hook {
    ($name:ident) => {
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(
            key: *const c_char,
            device: *mut nvmlDevice_t,
        ) -> nvmlReturn_t {
            let f = real_or!($name, NvmlByKey, NVML_ERROR_LIBRARY_NOT_FOUND);
            // SAFETY: forwarding the caller's arguments.
            let call = || unsafe { f(key, device) };
            guard(vgpu_cuda_abi::nvml::NVML_ERROR_UNKNOWN, call, || {
                let r = call();
                if r != NVML_SUCCESS || device.is_null() {
                    return r;
                }
                // SAFETY: the real NVML just wrote the non-null out-pointer.
                let h = unsafe { *device };
                match devices::nvml_visible(h) {
                    Ok(true) => r,
                    Ok(false) => {
                        // SAFETY: as above.
                        unsafe { *device = std::ptr::null_mut() };
                        NVML_ERROR_NOT_FOUND
                    }
                    Err(e) => e,
                }
            })
        }
    };
}
nvml_by_key_hook!(nvmlDeviceGetHandleByUUID);
nvml_by_key_hook!(nvmlDeviceGetHandleByPciBusId);
nvml_by_key_hook!(nvmlDeviceGetHandleByPciBusId_v2);
nvml_by_key_hook!(nvmlDeviceGetHandleBySerial);

type NvmlIndex = unsafe extern "C" fn(nvmlDevice_t, *mut c_uint) -> nvmlReturn_t;
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetIndex(
    device: nvmlDevice_t,
    index: *mut c_uint,
) -> nvmlReturn_t {
    let f = real_or!(nvmlDeviceGetIndex, NvmlIndex, NVML_ERROR_LIBRARY_NOT_FOUND);
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(device, index) };
    guard(vgpu_cuda_abi::nvml::NVML_ERROR_UNKNOWN, call, || {
        let r = call();
        if r != NVML_SUCCESS || index.is_null() {
            return r;
        }
        match devices::nvml_map() {
            Ok(None) => r,
            Ok(Some(m)) => {
                // SAFETY: the real NVML just wrote the non-null out-pointer.
                let real_index = unsafe { *index } as usize;
                match m.virt(real_index).and_then(|v| c_uint::try_from(v).ok()) {
                    Some(v) => {
                        // SAFETY: as above.
                        unsafe { *index = v };
                        r
                    }
                    None => NVML_ERROR_INVALID_ARGUMENT,
                }
            }
            Err(e) => e,
        }
    })
}

// ---- dlsym ---------------------------------------------------------------------------

#[cfg_attr(test, allow(dead_code))]
/// The logic of the `dlsym` hook: what the real `dlsym` finds, replaced by our hook when
/// it is the real function of an intercepted entry point.
unsafe extern "C" fn dlsym_hook(handle: *mut c_void, name: *const c_char) -> *mut c_void {
    // SAFETY: forwarding the caller's arguments.
    let r = unsafe { real::real_dlsym(handle, name) };
    if r.is_null() || name.is_null() {
        return r;
    }
    // SAFETY: dlsym found `name`, so it is a NUL-terminated string.
    let bytes = unsafe { CStr::from_ptr(name) }.to_bytes();
    let Some(id) = crate::table::find(bytes) else {
        return r;
    };
    if real::loading() {
        // The real library's own initializers look themselves up.
        return r;
    }
    guard(
        r,
        || r,
        || match real::lib(crate::table::entry(id).lib) {
            Ok(lib) if lib.ptr(id) == r as usize => hook_addr(id) as *mut c_void,
            Ok(_) => r,
            // The configured real library cannot be loaded: our hook reports it (loudly)
            // rather than letting the application run unenforced.
            Err(_) => hook_addr(id) as *mut c_void,
        },
    )
}

/// `dlsym`: a program that `dlopen`s the driver and looks up an intercepted entry point
/// on its handle gets our hook. `RTLD_NEXT` and `RTLD_DEFAULT` lookups jump straight to
/// libc's `dlsym` with the caller's return address intact (a naked tail jump): both are
/// resolved relative to the caller's scope, and in the global scope the preloaded shim's
/// exports come first anyway.
#[cfg(all(not(test), target_arch = "x86_64"))]
#[unsafe(naked)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, name: *const c_char) -> *mut c_void {
    core::arch::naked_asm!(
        "test rdi, rdi",
        "jz 2f",
        "cmp rdi, -1",
        "jne {hook}",
        "2:",
        "mov rax, qword ptr [rip + {real}]",
        "test rax, rax",
        "jz {hook}",
        "jmp rax",
        hook = sym dlsym_hook,
        real = sym real::REAL_DLSYM,
    )
}

/// Resolves libc's `dlsym` when the library loads, before any application lookup.
#[cfg(not(test))]
extern "C" fn on_load() {
    let _ = real::dlsym_fn();
}

#[cfg(not(test))]
#[used]
#[unsafe(link_section = ".init_array")]
static ON_LOAD: extern "C" fn() = on_load;
