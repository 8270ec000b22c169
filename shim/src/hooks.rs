//! The exported hooks, all together. Each resolves the real function once, enters
//! `guard` (no panic crosses into the application; a re-entered hook calls the real
//! function directly), checks and converts its raw pointers, calls the safe logic
//! ([`crate::accounting`] for memory, [`crate::memory_view`] for the memory shown,
//! [`crate::nvml_procs`] for the processes shown, [`crate::gate`] for launches,
//! [`crate::devices`] for the devices shown), and returns a `CUresult` / `nvmlReturn_t`.
//! No lock is held while the real driver runs. The `dlsym` route to these hooks is
//! [`crate::dlsym`]; [`hook_addr`] and `guard` serve it too.

#![allow(non_snake_case, clippy::missing_safety_doc)]

use std::cell::Cell;
use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::sync::OnceLock;

use vgpu_cuda_abi::cuda::*;
use vgpu_cuda_abi::fns;
use vgpu_cuda_abi::nvml::{
    NVML_ERROR_INVALID_ARGUMENT, NVML_ERROR_LIBRARY_NOT_FOUND, NVML_ERROR_NO_PERMISSION,
    NVML_ERROR_NOT_FOUND, NVML_SUCCESS, nvmlDevice_t, nvmlMemory_t, nvmlMemory_v2_t,
    nvmlProcessInfo_t, nvmlProcessInfo_v1_t, nvmlProcessInfo_v2_t, nvmlProcessUtilizationSample_t,
    nvmlReturn_t,
};

use crate::accounting;
use crate::devices;
use crate::driver::{self, current_device};
use crate::memory_view;
use crate::nvml_procs::{self, PROC_V1, PROC_V2};
use crate::process::{self, Kind, array_bytes, enforced, enforcing};
use crate::real::{self, real};
use crate::table::Id;

thread_local! {
    static IN_HOOK: Cell<bool> = const { Cell::new(false) };
}

/// Runs `body` unless this thread is already inside a hook (then `reentered`), turning
/// a panic into `on_panic`.
pub(crate) fn guard<R>(on_panic: R, reentered: impl FnOnce() -> R, body: impl FnOnce() -> R) -> R {
    let already = IN_HOOK.try_with(|f| f.replace(true)).unwrap_or(true);
    if already {
        return reentered();
    }
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)).unwrap_or(on_panic);
    let _ = IN_HOOK.try_with(|f| f.set(false));
    r
}

/// [`guard`] for a CUDA entry point: a suspended container is resumed first (the call
/// waits for it, [`crate::suspension`]), then `body` runs. A re-entered hook (called by
/// the driver inside another) does not look: the outer one did.
pub(crate) fn cuda_guard<R>(
    on_panic: R,
    reentered: impl FnOnce() -> R,
    body: impl FnOnce() -> R,
) -> R {
    guard(on_panic, reentered, || {
        crate::suspension::wait_if_suspended();
        body()
    })
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

/// Builds [`hook_addr`] from the rows of the table, and checks at compile time that each
/// hook has its row's C signature (the type of `vgpu_cuda_abi::fns` that the simulated
/// driver's exports are checked against too).
macro_rules! hook_addrs {
    ($($id:ident : $lib:ident $base:literal $since:literal $pt:literal $pfn:ident;)*) => {
        /// Address of the hook of row `id` (the exported function of the row's name).
        pub fn hook_addr(id: Id) -> usize {
            match id { $(Id::$id => $id as *const () as usize),* }
        }
        $(const _: fns::$pfn = $id;)*
    };
}
crate::table::rows!(hook_addrs);

// NVML topology queries that list GPUs: in their own file, with this file's `guard` and
// `real_or!`.
#[path = "hooks_topology.rs"]
mod topology;
pub use topology::*;

// ---- initialisation and entry-point resolution ------------------------------------

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuInit(flags: c_uint) -> CUresult {
    let f = real_or!(cuInit, fns::PFN_cuInit, CUDA_ERROR_NO_DEVICE);
    // SAFETY: forwarding the caller's arguments to the real function.
    let call = || unsafe { f(flags) };
    cuda_guard(CUDA_ERROR_UNKNOWN, call, || {
        // Through the node's device gate before the driver opens a GPU node.
        crate::admission::admit();
        enforcing(CUDA_ERROR_NOT_PERMITTED, call, |_, call| call())
    })
}

macro_rules! nvml_init_hook {
    ($name:ident) => {
        /// Admits the process through the node's device gate, then initialises NVML.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name() -> nvmlReturn_t {
            let f = real_or!($name, fns::PFN_nvmlInit_v2, NVML_ERROR_LIBRARY_NOT_FOUND);
            // SAFETY: forwarding to the real function (no arguments).
            let call = || unsafe { f() };
            guard(vgpu_cuda_abi::nvml::NVML_ERROR_UNKNOWN, call, || {
                crate::admission::admit();
                call()
            })
        }
    };
}
nvml_init_hook!(nvmlInit);
nvml_init_hook!(nvmlInit_v2);

/// Admits the process through the node's device gate, then initialises NVML.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlInitWithFlags(flags: c_uint) -> nvmlReturn_t {
    let f = real_or!(
        nvmlInitWithFlags,
        fns::PFN_nvmlInitWithFlags,
        NVML_ERROR_LIBRARY_NOT_FOUND
    );
    // SAFETY: forwarding the caller's argument.
    let call = || unsafe { f(flags) };
    guard(vgpu_cuda_abi::nvml::NVML_ERROR_UNKNOWN, call, || {
        crate::admission::admit();
        call()
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
        && let Some(s) = enforced()
    {
        // SAFETY: the driver accepted `symbol` as a NUL-terminated name.
        let name = unsafe { CStr::from_ptr(symbol) }.to_bytes();
        if crate::table::TABLE
            .iter()
            .any(|e| e.base.as_bytes() == name)
        {
            process::log(s, || {
                format!(
                    "cuGetProcAddress({}) resolved to a function libvgpu does not know: passed through",
                    String::from_utf8_lossy(name)
                )
            });
        }
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetProcAddress(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cudaVersion: c_int,
    flags: u64,
) -> CUresult {
    let f = real_or!(
        cuGetProcAddress,
        fns::PFN_cuGetProcAddress,
        CUDA_ERROR_NOT_INITIALIZED
    );
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(symbol, pfn, cudaVersion, flags) };
    cuda_guard(CUDA_ERROR_UNKNOWN, call, || {
        let r = call();
        if r == CUDA_SUCCESS {
            // SAFETY: the driver succeeded with these pointers.
            unsafe { map_proc(symbol, pfn) };
        }
        r
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetProcAddress_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cudaVersion: c_int,
    flags: u64,
    symbolStatus: *mut c_int,
) -> CUresult {
    let f = real_or!(
        cuGetProcAddress_v2,
        fns::PFN_cuGetProcAddress_v2,
        CUDA_ERROR_NOT_INITIALIZED
    );
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(symbol, pfn, cudaVersion, flags, symbolStatus) };
    cuda_guard(CUDA_ERROR_UNKNOWN, call, || {
        let r = call();
        if r == CUDA_SUCCESS {
            // SAFETY: the driver succeeded with these pointers.
            unsafe { map_proc(symbol, pfn) };
        }
        r
    })
}

// ---- the container's view of memory -------------------------------------------------

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    let f = real_or!(
        cuMemGetInfo_v2,
        fns::PFN_cuMemGetInfo_v2,
        CUDA_ERROR_NOT_INITIALIZED
    );
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(free, total) };
    cuda_guard(CUDA_ERROR_UNKNOWN, call, || {
        enforcing(CUDA_ERROR_NOT_PERMITTED, call, |shim, call| {
            let r = call();
            if r != CUDA_SUCCESS || free.is_null() || total.is_null() {
                return r;
            }
            let Some(dev) = current_device() else {
                return r;
            };
            // SAFETY: the driver just wrote both non-null out-pointers.
            let (rf, rt) = unsafe { (*free as u64, *total as u64) };
            if let Some((vf, vt)) = memory_view::cuda_mem_info(shim, dev, rf, rt) {
                // SAFETY: as above.
                unsafe {
                    *free = usize::try_from(vf).unwrap_or(usize::MAX);
                    *total = usize::try_from(vt).unwrap_or(usize::MAX);
                }
            }
            r
        })
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) -> CUresult {
    let f = real_or!(
        cuDeviceTotalMem_v2,
        fns::PFN_cuDeviceTotalMem_v2,
        CUDA_ERROR_NOT_INITIALIZED
    );
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(bytes, dev) };
    cuda_guard(CUDA_ERROR_UNKNOWN, call, || {
        enforcing(CUDA_ERROR_NOT_PERMITTED, call, |shim, call| {
            let r = call();
            if r != CUDA_SUCCESS || bytes.is_null() {
                return r;
            }
            // SAFETY: the driver just wrote the non-null out-pointer.
            unsafe { *bytes = memory_view::device_total(shim, dev, *bytes) };
            r
        })
    })
}

// ---- allocations -------------------------------------------------------------------

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, bytesize: usize) -> CUresult {
    let f = real_or!(
        cuMemAlloc_v2,
        fns::PFN_cuMemAlloc_v2,
        CUDA_ERROR_NOT_INITIALIZED
    );
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(dptr, bytesize) };
    cuda_guard(CUDA_ERROR_UNKNOWN, call, || {
        if dptr.is_null() {
            return call();
        }
        // SAFETY: non-null, and written by the driver on success.
        accounting::charged(
            Kind::Ptr,
            current_device(),
            bytesize as u64,
            call,
            || unsafe { *dptr },
        )
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocManaged(
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    flags: c_uint,
) -> CUresult {
    let f = real_or!(
        cuMemAllocManaged,
        fns::PFN_cuMemAllocManaged,
        CUDA_ERROR_NOT_INITIALIZED
    );
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(dptr, bytesize, flags) };
    cuda_guard(CUDA_ERROR_UNKNOWN, call, || {
        if dptr.is_null() {
            return call();
        }
        // SAFETY: non-null, and written by the driver on success.
        accounting::charged(
            Kind::Ptr,
            current_device(),
            bytesize as u64,
            call,
            || unsafe { *dptr },
        )
    })
}

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
        fns::PFN_cuMemAllocPitch_v2,
        CUDA_ERROR_NOT_INITIALIZED
    );
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes) };
    cuda_guard(CUDA_ERROR_UNKNOWN, call, || {
        if dptr.is_null() || pPitch.is_null() {
            return call();
        }
        accounting::pitch_charged(
            WidthInBytes as u64,
            Height as u64,
            call,
            // SAFETY: written by the driver on success.
            || unsafe { *dptr },
            // SAFETY: written by the driver on success.
            || unsafe { *pPitch } as u64,
            // SAFETY: freeing the allocation just made.
            |key| unsafe { cuMemFree_v2(key) },
        )
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFree_v2(dptr: CUdeviceptr) -> CUresult {
    let f = real_or!(
        cuMemFree_v2,
        fns::PFN_cuMemFree_v2,
        CUDA_ERROR_NOT_INITIALIZED
    );
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(dptr) };
    // A re-entered free (from the pitch hook's rollback) must still uncharge.
    let body = || accounting::uncharged(Kind::Ptr, dptr, true, call);
    cuda_guard(CUDA_ERROR_UNKNOWN, body, body)
}

/// A stream-ordered allocation from the device's current pool.
///
/// # Safety
/// `f` is the real function and `free` the real `cuMemFreeAsync` of the same
/// per-thread-stream variant; the other arguments are the caller's, per the CUDA API.
unsafe fn alloc_async(
    f: fns::PFN_cuMemAllocAsync,
    free: Option<fns::PFN_cuMemFreeAsync>,
    dptr: *mut CUdeviceptr,
    n: usize,
    s: CUstream,
) -> CUresult {
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(dptr, n, s) };
    cuda_guard(CUDA_ERROR_UNKNOWN, call, || {
        if dptr.is_null() {
            return call();
        }
        let dev = current_device();
        match dev.and_then(driver::current_pool) {
            Some(pool) => accounting::pool_alloc(
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
            None => accounting::charged(Kind::Ptr, dev, n as u64, call, || unsafe { *dptr }),
        }
    })
}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocAsync(
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    hStream: CUstream,
) -> CUresult {
    let f = real_or!(
        cuMemAllocAsync,
        fns::PFN_cuMemAllocAsync,
        CUDA_ERROR_NOT_INITIALIZED
    );
    // SAFETY: the C signature of cuMemFreeAsync.
    let free = unsafe { real::<fns::PFN_cuMemFreeAsync>(Id::cuMemFreeAsync) };
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
        fns::PFN_cuMemAllocAsync,
        CUDA_ERROR_NOT_INITIALIZED
    );
    // SAFETY: the C signature of cuMemFreeAsync_ptsz.
    let free = unsafe { real::<fns::PFN_cuMemFreeAsync>(Id::cuMemFreeAsync_ptsz) };
    // SAFETY: the caller's arguments, forwarded.
    unsafe { alloc_async(f, free, dptr, bytesize, hStream) }
}

/// An allocation from a pool.
///
/// # Safety
/// `f` is the real function and `free` the real `cuMemFreeAsync` of the same
/// per-thread-stream variant; the other arguments are the caller's, per the CUDA API.
unsafe fn alloc_pool(
    f: fns::PFN_cuMemAllocFromPoolAsync,
    free: Option<fns::PFN_cuMemFreeAsync>,
    dptr: *mut CUdeviceptr,
    n: usize,
    pool: CUmemoryPool,
    s: CUstream,
) -> CUresult {
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(dptr, n, pool, s) };
    cuda_guard(CUDA_ERROR_UNKNOWN, call, || {
        if dptr.is_null() || pool.is_null() {
            return call();
        }
        accounting::pool_alloc(
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
        fns::PFN_cuMemAllocFromPoolAsync,
        CUDA_ERROR_NOT_INITIALIZED
    );
    // SAFETY: the C signature of cuMemFreeAsync.
    let free = unsafe { real::<fns::PFN_cuMemFreeAsync>(Id::cuMemFreeAsync) };
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
        fns::PFN_cuMemAllocFromPoolAsync,
        CUDA_ERROR_NOT_INITIALIZED
    );
    // SAFETY: the C signature of cuMemFreeAsync_ptsz.
    let free = unsafe { real::<fns::PFN_cuMemFreeAsync>(Id::cuMemFreeAsync_ptsz) };
    // SAFETY: the caller's arguments, forwarded.
    unsafe { alloc_pool(f, free, dptr, bytesize, pool, hStream) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFreeAsync(dptr: CUdeviceptr, hStream: CUstream) -> CUresult {
    let f = real_or!(
        cuMemFreeAsync,
        fns::PFN_cuMemFreeAsync,
        CUDA_ERROR_NOT_INITIALIZED
    );
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(dptr, hStream) };
    cuda_guard(CUDA_ERROR_UNKNOWN, call, || {
        accounting::uncharged(Kind::Ptr, dptr, false, call)
    })
}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFreeAsync_ptsz(dptr: CUdeviceptr, hStream: CUstream) -> CUresult {
    let f = real_or!(
        cuMemFreeAsync_ptsz,
        fns::PFN_cuMemFreeAsync,
        CUDA_ERROR_NOT_INITIALIZED
    );
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(dptr, hStream) };
    cuda_guard(CUDA_ERROR_UNKNOWN, call, || {
        accounting::uncharged(Kind::Ptr, dptr, false, call)
    })
}

// ---- memory pools and synchronisation: where the driver releases pool memory ----------

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemPoolCreate(
    pool: *mut CUmemoryPool,
    poolProps: *const CUmemPoolProps,
) -> CUresult {
    let f = real_or!(
        cuMemPoolCreate,
        fns::PFN_cuMemPoolCreate,
        CUDA_ERROR_NOT_INITIALIZED
    );
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(pool, poolProps) };
    cuda_guard(CUDA_ERROR_UNKNOWN, call, || {
        let r = call();
        if r == CUDA_SUCCESS && !pool.is_null() && !poolProps.is_null() {
            // SAFETY: a non-null in-pointer the driver accepted, and the out-pointer it
            // wrote on success.
            let (props, handle) = unsafe { (poolProps.read_unaligned(), *pool) };
            if props.location.type_ == CU_MEM_LOCATION_TYPE_DEVICE
                && let Ok(dev) = usize::try_from(props.location.id)
            {
                accounting::pool_created(handle as u64, dev);
            }
        }
        r
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemPoolDestroy(pool: CUmemoryPool) -> CUresult {
    let f = real_or!(
        cuMemPoolDestroy,
        fns::PFN_cuMemPoolDestroy,
        CUDA_ERROR_NOT_INITIALIZED
    );
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(pool) };
    cuda_guard(CUDA_ERROR_UNKNOWN, call, || {
        accounting::pool_destroyed(pool as u64, call)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemPoolTrimTo(pool: CUmemoryPool, minBytesToKeep: usize) -> CUresult {
    let f = real_or!(
        cuMemPoolTrimTo,
        fns::PFN_cuMemPoolTrimTo,
        CUDA_ERROR_NOT_INITIALIZED
    );
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(pool, minBytesToKeep) };
    cuda_guard(CUDA_ERROR_UNKNOWN, call, || {
        let r = call();
        if r == CUDA_SUCCESS
            && let Some(shim) = enforced()
        {
            accounting::reconcile(shim, pool as u64);
        }
        r
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemPoolSetAttribute(
    pool: CUmemoryPool,
    attr: c_int,
    value: *mut c_void,
) -> CUresult {
    let f = real_or!(
        cuMemPoolSetAttribute,
        fns::PFN_cuMemPoolSetAttribute,
        CUDA_ERROR_NOT_INITIALIZED
    );
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(pool, attr, value) };
    cuda_guard(CUDA_ERROR_UNKNOWN, call, || {
        let r = call();
        // A lower release threshold can release cached memory at once.
        if r == CUDA_SUCCESS
            && attr == mempool_attr::RELEASE_THRESHOLD
            && let Some(shim) = enforced()
        {
            accounting::reconcile(shim, pool as u64);
        }
        r
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamSynchronize(hStream: CUstream) -> CUresult {
    let f = real_or!(
        cuStreamSynchronize,
        fns::PFN_cuStreamSynchronize,
        CUDA_ERROR_NOT_INITIALIZED
    );
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(hStream) };
    cuda_guard(CUDA_ERROR_UNKNOWN, call, || {
        let r = call();
        accounting::synchronized(false);
        r
    })
}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamSynchronize_ptsz(hStream: CUstream) -> CUresult {
    let f = real_or!(
        cuStreamSynchronize_ptsz,
        fns::PFN_cuStreamSynchronize,
        CUDA_ERROR_NOT_INITIALIZED
    );
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(hStream) };
    cuda_guard(CUDA_ERROR_UNKNOWN, call, || {
        let r = call();
        accounting::synchronized(false);
        r
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventSynchronize(hEvent: CUevent) -> CUresult {
    let f = real_or!(
        cuEventSynchronize,
        fns::PFN_cuEventSynchronize,
        CUDA_ERROR_NOT_INITIALIZED
    );
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(hEvent) };
    cuda_guard(CUDA_ERROR_UNKNOWN, call, || {
        let r = call();
        accounting::synchronized(false);
        r
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxSynchronize() -> CUresult {
    let f = real_or!(
        cuCtxSynchronize,
        fns::PFN_cuCtxSynchronize,
        CUDA_ERROR_NOT_INITIALIZED
    );
    // SAFETY: no arguments.
    let call = || unsafe { f() };
    cuda_guard(CUDA_ERROR_UNKNOWN, call, || {
        let r = call();
        accounting::synchronized(r == CUDA_SUCCESS);
        r
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxSynchronize_v2(ctx: CUcontext) -> CUresult {
    let f = real_or!(
        cuCtxSynchronize_v2,
        fns::PFN_cuCtxSynchronize_v2,
        CUDA_ERROR_NOT_INITIALIZED
    );
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(ctx) };
    cuda_guard(CUDA_ERROR_UNKNOWN, call, || {
        let r = call();
        // Only one context's work is known to be done: destroyed pools keep their
        // charges (they may belong to another context).
        accounting::synchronized(false);
        r
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemCreate(
    handle: *mut CUmemGenericAllocationHandle,
    size: usize,
    prop: *const CUmemAllocationProp,
    flags: u64,
) -> CUresult {
    let f = real_or!(
        cuMemCreate,
        fns::PFN_cuMemCreate,
        CUDA_ERROR_NOT_INITIALIZED
    );
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(handle, size, prop, flags) };
    cuda_guard(CUDA_ERROR_UNKNOWN, call, || {
        if handle.is_null() || prop.is_null() {
            return call();
        }
        // SAFETY: a non-null in-pointer of the CUDA API, read once.
        let p = unsafe { prop.read_unaligned() };
        let dev = match accounting::vmm_location(p.location.type_, p.location.id) {
            accounting::VmmLocation::Host => return call(),
            accounting::VmmLocation::Device(d) => d,
            accounting::VmmLocation::Current => current_device(),
        };
        // Not tied to a context: VMM allocations live until released and unmapped.
        // SAFETY: non-null, and written by the driver on success.
        accounting::charged(Kind::Vmm, dev, size as u64, call, || unsafe { *handle })
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemRelease(handle: CUmemGenericAllocationHandle) -> CUresult {
    let f = real_or!(
        cuMemRelease,
        fns::PFN_cuMemRelease,
        CUDA_ERROR_NOT_INITIALIZED
    );
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(handle) };
    cuda_guard(CUDA_ERROR_UNKNOWN, call, || {
        accounting::vmm_released(handle, call)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemRetainAllocationHandle(
    handle: *mut CUmemGenericAllocationHandle,
    addr: *mut c_void,
) -> CUresult {
    let f = real_or!(
        cuMemRetainAllocationHandle,
        fns::PFN_cuMemRetainAllocationHandle,
        CUDA_ERROR_NOT_INITIALIZED
    );
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(handle, addr) };
    cuda_guard(CUDA_ERROR_UNKNOWN, call, || {
        let r = call();
        if r == CUDA_SUCCESS && !handle.is_null() {
            // SAFETY: non-null, and written by the driver on success.
            accounting::vmm_retained(unsafe { *handle });
        }
        r
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemMap(
    ptr: CUdeviceptr,
    size: usize,
    offset: usize,
    handle: CUmemGenericAllocationHandle,
    flags: u64,
) -> CUresult {
    let f = real_or!(cuMemMap, fns::PFN_cuMemMap, CUDA_ERROR_NOT_INITIALIZED);
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(ptr, size, offset, handle, flags) };
    cuda_guard(CUDA_ERROR_UNKNOWN, call, || {
        let r = call();
        if r == CUDA_SUCCESS {
            accounting::vmm_mapped(ptr, size as u64, handle);
        }
        r
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemUnmap(ptr: CUdeviceptr, size: usize) -> CUresult {
    let f = real_or!(cuMemUnmap, fns::PFN_cuMemUnmap, CUDA_ERROR_NOT_INITIALIZED);
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(ptr, size) };
    cuda_guard(CUDA_ERROR_UNKNOWN, call, || {
        let r = call();
        if r == CUDA_SUCCESS {
            accounting::vmm_unmapped(ptr, size as u64);
        }
        r
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArrayCreate_v2(
    pHandle: *mut CUarray,
    pAllocateArray: *const CUDA_ARRAY_DESCRIPTOR,
) -> CUresult {
    let f = real_or!(
        cuArrayCreate_v2,
        fns::PFN_cuArrayCreate_v2,
        CUDA_ERROR_NOT_INITIALIZED
    );
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(pHandle, pAllocateArray) };
    cuda_guard(CUDA_ERROR_UNKNOWN, call, || {
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
        accounting::charged(
            Kind::Array,
            current_device(),
            bytes,
            call,
            || unsafe { *pHandle } as u64,
        )
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArray3DCreate_v2(
    pHandle: *mut CUarray,
    pAllocateArray: *const CUDA_ARRAY3D_DESCRIPTOR,
) -> CUresult {
    let f = real_or!(
        cuArray3DCreate_v2,
        fns::PFN_cuArray3DCreate_v2,
        CUDA_ERROR_NOT_INITIALIZED
    );
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(pHandle, pAllocateArray) };
    cuda_guard(CUDA_ERROR_UNKNOWN, call, || {
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
        accounting::charged(
            Kind::Array,
            current_device(),
            bytes,
            call,
            || unsafe { *pHandle } as u64,
        )
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArrayDestroy(hArray: CUarray) -> CUresult {
    let f = real_or!(
        cuArrayDestroy,
        fns::PFN_cuArrayDestroy,
        CUDA_ERROR_NOT_INITIALIZED
    );
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(hArray) };
    cuda_guard(CUDA_ERROR_UNKNOWN, call, || {
        accounting::uncharged(Kind::Array, hArray as u64, true, call)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMipmappedArrayCreate(
    pHandle: *mut CUmipmappedArray,
    pMipmappedArrayDesc: *const CUDA_ARRAY3D_DESCRIPTOR,
    numMipmapLevels: c_uint,
) -> CUresult {
    let f = real_or!(
        cuMipmappedArrayCreate,
        fns::PFN_cuMipmappedArrayCreate,
        CUDA_ERROR_NOT_INITIALIZED
    );
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(pHandle, pMipmappedArrayDesc, numMipmapLevels) };
    cuda_guard(CUDA_ERROR_UNKNOWN, call, || {
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
        accounting::charged(
            Kind::Mipmap,
            current_device(),
            bytes,
            call,
            || unsafe { *pHandle } as u64,
        )
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMipmappedArrayDestroy(hMipmappedArray: CUmipmappedArray) -> CUresult {
    let f = real_or!(
        cuMipmappedArrayDestroy,
        fns::PFN_cuMipmappedArrayDestroy,
        CUDA_ERROR_NOT_INITIALIZED
    );
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(hMipmappedArray) };
    cuda_guard(CUDA_ERROR_UNKNOWN, call, || {
        accounting::uncharged(Kind::Mipmap, hMipmappedArray as u64, true, call)
    })
}

// ---- contexts ------------------------------------------------------------------------

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(pctx: *mut CUcontext, dev: CUdevice) -> CUresult {
    let f = real_or!(
        cuDevicePrimaryCtxRetain,
        fns::PFN_cuDevicePrimaryCtxRetain,
        CUDA_ERROR_NOT_INITIALIZED
    );
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(pctx, dev) };
    cuda_guard(CUDA_ERROR_UNKNOWN, call, || {
        enforcing(CUDA_ERROR_NOT_PERMITTED, call, |shim, call| {
            let r = call();
            if r == CUDA_SUCCESS && !pctx.is_null() {
                // SAFETY: written by the driver on success.
                accounting::primary_retained(shim, dev, unsafe { *pctx } as usize);
            }
            r
        })
    })
}

/// A primary-context release or reset, and its accounting.
///
/// # Safety
/// `f` is the real release or reset function.
unsafe fn primary_release(
    f: fns::PFN_cuDevicePrimaryCtxRelease_v2,
    dev: CUdevice,
    reset: bool,
) -> CUresult {
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(dev) };
    cuda_guard(CUDA_ERROR_UNKNOWN, call, || {
        // Not while the launch gate synchronizes this process's contexts.
        let lock = crate::gate::CTX_LOCK
            .write()
            .unwrap_or_else(|p| p.into_inner());
        let before = accounting::primary_context(dev);
        let r = call();
        if r == CUDA_SUCCESS && before != 0 && accounting::primary_is_gone(dev, reset) {
            crate::gate::forget_context(before);
        }
        drop(lock);
        if r == CUDA_SUCCESS {
            accounting::primary_released(dev, reset);
        }
        r
    })
}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxRelease(dev: CUdevice) -> CUresult {
    let f = real_or!(
        cuDevicePrimaryCtxRelease,
        fns::PFN_cuDevicePrimaryCtxRelease_v2,
        CUDA_ERROR_NOT_INITIALIZED
    );
    // SAFETY: the caller's argument, forwarded.
    unsafe { primary_release(f, dev, false) }
}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) -> CUresult {
    let f = real_or!(
        cuDevicePrimaryCtxRelease_v2,
        fns::PFN_cuDevicePrimaryCtxRelease_v2,
        CUDA_ERROR_NOT_INITIALIZED
    );
    // SAFETY: the caller's argument, forwarded.
    unsafe { primary_release(f, dev, false) }
}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxReset(dev: CUdevice) -> CUresult {
    let f = real_or!(
        cuDevicePrimaryCtxReset,
        fns::PFN_cuDevicePrimaryCtxRelease_v2,
        CUDA_ERROR_NOT_INITIALIZED
    );
    // SAFETY: the caller's argument, forwarded.
    unsafe { primary_release(f, dev, true) }
}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxReset_v2(dev: CUdevice) -> CUresult {
    let f = real_or!(
        cuDevicePrimaryCtxReset_v2,
        fns::PFN_cuDevicePrimaryCtxRelease_v2,
        CUDA_ERROR_NOT_INITIALIZED
    );
    // SAFETY: the caller's argument, forwarded.
    unsafe { primary_release(f, dev, true) }
}

/// The context a successful creation wrote (None: no out-pointer).
fn created(pctx: *mut CUcontext) -> Option<usize> {
    // SAFETY: called after the driver succeeded, so a non-null `pctx` holds the context
    // it wrote.
    (!pctx.is_null()).then(|| unsafe { *pctx } as usize)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxCreate_v2(
    pctx: *mut CUcontext,
    flags: c_uint,
    dev: CUdevice,
) -> CUresult {
    let f = real_or!(
        cuCtxCreate_v2,
        fns::PFN_cuCtxCreate_v2,
        CUDA_ERROR_NOT_INITIALIZED
    );
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(pctx, flags, dev) };
    cuda_guard(CUDA_ERROR_UNKNOWN, call, || {
        accounting::ctx_created(dev, call, || created(pctx))
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxCreate_v3(
    pctx: *mut CUcontext,
    paramsArray: *mut c_void,
    numParams: c_int,
    flags: c_uint,
    dev: CUdevice,
) -> CUresult {
    let f = real_or!(
        cuCtxCreate_v3,
        fns::PFN_cuCtxCreate_v3,
        CUDA_ERROR_NOT_INITIALIZED
    );
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(pctx, paramsArray, numParams, flags, dev) };
    cuda_guard(CUDA_ERROR_UNKNOWN, call, || {
        accounting::ctx_created(dev, call, || created(pctx))
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxCreate_v4(
    pctx: *mut CUcontext,
    ctxCreateParams: *mut c_void,
    flags: c_uint,
    dev: CUdevice,
) -> CUresult {
    let f = real_or!(
        cuCtxCreate_v4,
        fns::PFN_cuCtxCreate_v4,
        CUDA_ERROR_NOT_INITIALIZED
    );
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(pctx, ctxCreateParams, flags, dev) };
    cuda_guard(CUDA_ERROR_UNKNOWN, call, || {
        accounting::ctx_created(dev, call, || created(pctx))
    })
}

/// A context destruction, and its accounting.
///
/// # Safety
/// `f` is the real `cuCtxDestroy` of that ABI.
unsafe fn ctx_destroy(f: fns::PFN_cuCtxDestroy_v2, ctx: CUcontext) -> CUresult {
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(ctx) };
    cuda_guard(CUDA_ERROR_UNKNOWN, call, || {
        // Not while the launch gate synchronizes this process's contexts.
        let lock = crate::gate::CTX_LOCK
            .write()
            .unwrap_or_else(|p| p.into_inner());
        let r = call();
        if r == CUDA_SUCCESS {
            crate::gate::forget_context(ctx as usize);
        }
        drop(lock);
        if r == CUDA_SUCCESS {
            accounting::ctx_destroyed(ctx as usize);
        }
        r
    })
}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxDestroy(ctx: CUcontext) -> CUresult {
    let f = real_or!(
        cuCtxDestroy,
        fns::PFN_cuCtxDestroy_v2,
        CUDA_ERROR_NOT_INITIALIZED
    );
    // SAFETY: the caller's argument, forwarded.
    unsafe { ctx_destroy(f, ctx) }
}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxDestroy_v2(ctx: CUcontext) -> CUresult {
    let f = real_or!(
        cuCtxDestroy_v2,
        fns::PFN_cuCtxDestroy_v2,
        CUDA_ERROR_NOT_INITIALIZED
    );
    // SAFETY: the caller's argument, forwarded.
    unsafe { ctx_destroy(f, ctx) }
}

// ---- launches (the compute gate) --------------------------------------------------

/// Runs `launch` once the gate admits it (enforcing mode), else directly.
fn gated(stream: CUstream, ptsz: bool, launch: impl FnOnce() -> CUresult) -> CUresult {
    enforcing(CUDA_ERROR_NOT_PERMITTED, launch, |shim, launch| {
        // A launch into a stream capture builds a graph and runs nothing: not gated, not
        // counted, no marker (an event recorded into a capture cannot be queried). Its
        // graph's launch is gated. Looked at only while a capture is open (ADR 0033).
        if crate::gate::captures_open() && driver::stream_capturing(stream as usize, ptsz) {
            return launch();
        }
        let pass = match crate::gate::enter(shim, current_device, stream as usize, ptsz) {
            Ok(p) => p,
            // A GPU the container was not granted: no compute share.
            Err(crate::gate::NotGranted) => return CUDA_ERROR_NOT_PERMITTED,
        };
        if let Some(p) = &pass {
            p.device_wait();
        }
        let r = launch();
        drop(pass);
        r
    })
}

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
            cuda_guard(CUDA_ERROR_UNKNOWN, call, || gated(stream, ptsz, call))
        }
    };
}

/// A `cuStreamBeginCapture` hook: the capture is counted before the real call (and
/// uncounted if it fails), see `crate::gate::capture_begins`.
macro_rules! begin_capture_hook {
    ($name:ident, $ty:ty, $stream:ident, ($($arg:ident: $t:ty),* $(,)?)) => {
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name($($arg: $t),*) -> CUresult {
            let real = real_or!($name, $ty, CUDA_ERROR_NOT_INITIALIZED);
            // SAFETY: forwarding the caller's arguments.
            let call = || unsafe { real($($arg),*) };
            let ptsz = stringify!($name).ends_with("_ptsz");
            cuda_guard(CUDA_ERROR_UNKNOWN, call, || {
                crate::gate::capture_begins($stream as usize, ptsz);
                let r = call();
                if r != CUDA_SUCCESS {
                    crate::gate::capture_ended();
                }
                r
            })
        }
    };
}
begin_capture_hook!(cuStreamBeginCapture, fns::PFN_cuStreamBeginCapture, hStream, (hStream: CUstream));
begin_capture_hook!(cuStreamBeginCapture_ptsz, fns::PFN_cuStreamBeginCapture, hStream, (hStream: CUstream));
begin_capture_hook!(cuStreamBeginCapture_v2, fns::PFN_cuStreamBeginCapture_v2, hStream, (hStream: CUstream, mode: c_uint));
begin_capture_hook!(cuStreamBeginCapture_v2_ptsz, fns::PFN_cuStreamBeginCapture_v2, hStream, (hStream: CUstream, mode: c_uint));
begin_capture_hook!(cuStreamBeginCaptureToGraph, fns::PFN_cuStreamBeginCaptureToGraph, hStream, (hStream: CUstream, hGraph: CUgraph, deps: *const CUgraphNode, depData: *const c_void, numDeps: usize, mode: c_uint));
begin_capture_hook!(cuStreamBeginCaptureToGraph_ptsz, fns::PFN_cuStreamBeginCaptureToGraph, hStream, (hStream: CUstream, hGraph: CUgraph, deps: *const CUgraphNode, depData: *const c_void, numDeps: usize, mode: c_uint));

/// A `cuStreamEndCapture` hook: a capture that ended (a graph, or
/// `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED`) is uncounted.
macro_rules! end_capture_hook {
    ($name:ident) => {
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(hStream: CUstream, phGraph: *mut CUgraph) -> CUresult {
            let real = real_or!(
                $name,
                fns::PFN_cuStreamEndCapture,
                CUDA_ERROR_NOT_INITIALIZED
            );
            // SAFETY: forwarding the caller's arguments.
            let call = || unsafe { real(hStream, phGraph) };
            cuda_guard(CUDA_ERROR_UNKNOWN, call, || {
                let r = call();
                if r == CUDA_SUCCESS || r == CUDA_ERROR_STREAM_CAPTURE_INVALIDATED {
                    crate::gate::capture_ended();
                }
                r
            })
        }
    };
}
end_capture_hook!(cuStreamEndCapture);
end_capture_hook!(cuStreamEndCapture_ptsz);

macro_rules! launch_kernel_hook {
    ($name:ident) => {
        gated_launch_hook!($name, fns::PFN_cuLaunchKernel, hStream, (
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
        gated_launch_hook!($name, fns::PFN_cuLaunchKernelEx, ex_stream(config), (
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
        gated_launch_hook!($name, fns::PFN_cuLaunchCooperativeKernel, hStream, (
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

gated_launch_hook!(cuGraphLaunch, fns::PFN_cuGraphLaunch, hStream, (hGraphExec: CUgraphExec, hStream: CUstream));
gated_launch_hook!(cuGraphLaunch_ptsz, fns::PFN_cuGraphLaunch, hStream, (hGraphExec: CUgraphExec, hStream: CUstream));

// ---- NVML --------------------------------------------------------------------------

/// The CUDA ordinal of NVML device `device`, under which the container's accounts are
/// kept (by UUID: [`crate::devices::cuda_ordinal`]).
fn nvml_index(device: nvmlDevice_t) -> Option<usize> {
    devices::cuda_ordinal(device)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo(
    device: nvmlDevice_t,
    memory: *mut nvmlMemory_t,
) -> nvmlReturn_t {
    let f = real_or!(
        nvmlDeviceGetMemoryInfo,
        fns::PFN_nvmlDeviceGetMemoryInfo,
        NVML_ERROR_NO_PERMISSION
    );
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(device, memory) };
    guard(vgpu_cuda_abi::nvml::NVML_ERROR_UNKNOWN, call, || {
        enforcing(NVML_ERROR_NO_PERMISSION, call, |shim, call| {
            let r = call();
            if r != NVML_SUCCESS || memory.is_null() {
                return r;
            }
            // SAFETY: the real NVML just filled the non-null struct.
            let m = unsafe { &mut *memory };
            if let Some(d) = nvml_index(device)
                && let Some((free, total, used)) =
                    memory_view::nvml_memory(shim, d, m.free, m.total)
            {
                m.total = total;
                m.free = free;
                m.used = used;
            }
            r
        })
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    device: nvmlDevice_t,
    memory: *mut nvmlMemory_v2_t,
) -> nvmlReturn_t {
    let f = real_or!(
        nvmlDeviceGetMemoryInfo_v2,
        fns::PFN_nvmlDeviceGetMemoryInfo_v2,
        NVML_ERROR_NO_PERMISSION
    );
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(device, memory) };
    guard(vgpu_cuda_abi::nvml::NVML_ERROR_UNKNOWN, call, || {
        enforcing(NVML_ERROR_NO_PERMISSION, call, |shim, call| {
            let r = call();
            if r != NVML_SUCCESS || memory.is_null() {
                return r;
            }
            // SAFETY: the real NVML just filled the non-null struct.
            let m = unsafe { &mut *memory };
            if let Some(d) = nvml_index(device)
                && let Some((free, total, used)) =
                    memory_view::nvml_memory(shim, d, m.free, m.total)
            {
                m.total = total;
                m.reserved = 0;
                m.free = free;
                m.used = used;
            }
            r
        })
    })
}

/// The process-list hooks: the real list, filtered to the container's processes.
///
/// # Safety
/// `call` calls the real process-list function, whose entries are `stride` bytes, with
/// the caller's arguments `device`, `count` and `infos`, per NVML.
unsafe fn procs(
    call: impl Fn() -> nvmlReturn_t + Copy,
    stride: usize,
    device: nvmlDevice_t,
    count: *mut c_uint,
    infos: *mut c_void,
) -> nvmlReturn_t {
    guard(vgpu_cuda_abi::nvml::NVML_ERROR_UNKNOWN, call, || {
        enforcing(NVML_ERROR_NO_PERMISSION, call, |shim, call| {
            let r = call();
            if r != NVML_SUCCESS || count.is_null() || infos.is_null() {
                return r;
            }
            // SAFETY: the real NVML wrote `*count` entries of `stride` bytes at `infos`.
            let buf = unsafe {
                std::slice::from_raw_parts_mut(infos.cast::<u8>(), *count as usize * stride)
            };
            let kept = nvml_procs::container_processes(shim, nvml_index(device), buf, stride);
            // SAFETY: non-null out-pointer.
            unsafe { *count = kept as c_uint };
            r
        })
    })
}

macro_rules! proc_hooks {
    ($($name:ident $stride:ident $info:ty, $pfn:ident;)*) => {$(
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(
            device: nvmlDevice_t,
            infoCount: *mut c_uint,
            infos: *mut $info,
        ) -> nvmlReturn_t {
            const { assert!(size_of::<$info>() == $stride) };
            let f = real_or!($name, fns::$pfn, NVML_ERROR_NO_PERMISSION);
            // SAFETY: forwarding the caller's arguments.
            let call = || unsafe { f(device, infoCount, infos) };
            // SAFETY: `call` is the real function with the caller's arguments.
            unsafe { procs(call, $stride, device, infoCount, infos.cast()) }
        }
    )*};
}

proc_hooks! {
    nvmlDeviceGetComputeRunningProcesses PROC_V1 nvmlProcessInfo_v1_t, PFN_nvmlDeviceGetComputeRunningProcesses;
    nvmlDeviceGetComputeRunningProcesses_v2 PROC_V2 nvmlProcessInfo_v2_t, PFN_nvmlDeviceGetComputeRunningProcesses_v2;
    nvmlDeviceGetComputeRunningProcesses_v3 PROC_V2 nvmlProcessInfo_t, PFN_nvmlDeviceGetComputeRunningProcesses_v3;
    nvmlDeviceGetGraphicsRunningProcesses PROC_V1 nvmlProcessInfo_v1_t, PFN_nvmlDeviceGetComputeRunningProcesses;
    nvmlDeviceGetGraphicsRunningProcesses_v2 PROC_V2 nvmlProcessInfo_v2_t, PFN_nvmlDeviceGetComputeRunningProcesses_v2;
    nvmlDeviceGetGraphicsRunningProcesses_v3 PROC_V2 nvmlProcessInfo_t, PFN_nvmlDeviceGetComputeRunningProcesses_v3;
    nvmlDeviceGetMPSComputeRunningProcesses PROC_V1 nvmlProcessInfo_v1_t, PFN_nvmlDeviceGetComputeRunningProcesses;
    nvmlDeviceGetMPSComputeRunningProcesses_v2 PROC_V2 nvmlProcessInfo_v2_t, PFN_nvmlDeviceGetComputeRunningProcesses_v2;
    nvmlDeviceGetMPSComputeRunningProcesses_v3 PROC_V2 nvmlProcessInfo_t, PFN_nvmlDeviceGetComputeRunningProcesses_v3;
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetProcessUtilization(
    device: nvmlDevice_t,
    utilization: *mut nvmlProcessUtilizationSample_t,
    processSamplesCount: *mut c_uint,
    lastSeenTimeStamp: u64,
) -> nvmlReturn_t {
    let f = real_or!(
        nvmlDeviceGetProcessUtilization,
        fns::PFN_nvmlDeviceGetProcessUtilization,
        NVML_ERROR_NO_PERMISSION
    );
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(device, utilization, processSamplesCount, lastSeenTimeStamp) };
    guard(vgpu_cuda_abi::nvml::NVML_ERROR_UNKNOWN, call, || {
        enforcing(NVML_ERROR_NO_PERMISSION, call, |shim, call| {
            let r = call();
            if r != NVML_SUCCESS || utilization.is_null() || processSamplesCount.is_null() {
                return r;
            }
            let stride = size_of::<nvmlProcessUtilizationSample_t>();
            // SAFETY: the real NVML wrote `*processSamplesCount` samples at `utilization`.
            let buf = unsafe {
                std::slice::from_raw_parts_mut(
                    utilization.cast::<u8>(),
                    *processSamplesCount as usize * stride,
                )
            };
            let kept = nvml_procs::container_samples(shim, buf, stride);
            // SAFETY: non-null out-pointer.
            unsafe { *processSamplesCount = kept as c_uint };
            r
        })
    })
}

// ---- NVML: the container's devices only (ADR 0014) ----------------------------------

/// Whether the shim lets everything through (`VGPU_ON_ERROR=unenforced` after an error),
/// so that NVML shows every device. Runs the configuration on first use.
fn passes_through() -> bool {
    process::mode().passes_through()
}

macro_rules! nvml_count_hook {
    ($name:ident) => {
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(deviceCount: *mut c_uint) -> nvmlReturn_t {
            let f = real_or!(
                $name,
                fns::PFN_nvmlDeviceGetCount_v2,
                NVML_ERROR_LIBRARY_NOT_FOUND
            );
            // SAFETY: forwarding the caller's arguments.
            let call = || unsafe { f(deviceCount) };
            guard(vgpu_cuda_abi::nvml::NVML_ERROR_UNKNOWN, call, || {
                let r = call();
                if r != NVML_SUCCESS || deviceCount.is_null() {
                    return r;
                }
                match devices::nvml_map(passes_through()) {
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

macro_rules! nvml_by_index_hook {
    ($name:ident) => {
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(index: c_uint, device: *mut nvmlDevice_t) -> nvmlReturn_t {
            let f = real_or!(
                $name,
                fns::PFN_nvmlDeviceGetHandleByIndex_v2,
                NVML_ERROR_LIBRARY_NOT_FOUND
            );
            // SAFETY: forwarding the caller's arguments.
            let call = || unsafe { f(index, device) };
            guard(
                vgpu_cuda_abi::nvml::NVML_ERROR_UNKNOWN,
                call,
                || match devices::nvml_map(passes_through()) {
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

/// A handle looked up by UUID, PCI bus id or serial: a GPU the container was not given
/// is not found.
macro_rules! nvml_by_key_hook {
    ($name:ident) => {
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(
            key: *const c_char,
            device: *mut nvmlDevice_t,
        ) -> nvmlReturn_t {
            let f = real_or!(
                $name,
                fns::PFN_nvmlDeviceGetHandleByUUID,
                NVML_ERROR_LIBRARY_NOT_FOUND
            );
            // SAFETY: forwarding the caller's arguments.
            let call = || unsafe { f(key, device) };
            guard(vgpu_cuda_abi::nvml::NVML_ERROR_UNKNOWN, call, || {
                let r = call();
                if r != NVML_SUCCESS || device.is_null() {
                    return r;
                }
                // SAFETY: the real NVML just wrote the non-null out-pointer.
                let h = unsafe { *device };
                match devices::nvml_visible(h, passes_through()) {
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

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetIndex(
    device: nvmlDevice_t,
    index: *mut c_uint,
) -> nvmlReturn_t {
    let f = real_or!(
        nvmlDeviceGetIndex,
        fns::PFN_nvmlDeviceGetIndex,
        NVML_ERROR_LIBRARY_NOT_FOUND
    );
    // SAFETY: forwarding the caller's arguments.
    let call = || unsafe { f(device, index) };
    guard(vgpu_cuda_abi::nvml::NVML_ERROR_UNKNOWN, call, || {
        let r = call();
        if r != NVML_SUCCESS || index.is_null() {
            return r;
        }
        match devices::nvml_map(passes_through()) {
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
