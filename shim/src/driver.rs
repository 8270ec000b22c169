//! Safe wrappers of the real driver's calls that the shim makes for itself, not on the
//! application's behalf: the current device, context and memory pool, the allocation
//! granularity, pool attributes, the devices' UUIDs, streams' capture state, and the
//! gate thread's events, context synchronisation and capture mode. Each function is
//! resolved by name from the real library once ([`crate::real`]), never through the
//! hooks, and no lock is held while it runs.

use std::ffi::{CStr, c_int, c_uint};
use std::sync::OnceLock;

use vgpu_cuda_abi::cuda::*;
use vgpu_cuda_abi::fns::*;

use crate::real;

/// A function of the real driver, resolved by name once (0: absent).
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
    let f = unsafe { std::mem::transmute::<usize, PFN_cuCtxGetDevice>(p) };
    let mut d: CUdevice = -1;
    // SAFETY: a valid out-pointer.
    let r = unsafe { f(&mut d) };
    (r == CUDA_SUCCESS)
        .then(|| usize::try_from(d).ok())
        .flatten()
}

/// The current context (0: none).
pub(crate) fn current_context() -> usize {
    static P: OnceLock<usize> = OnceLock::new();
    let p = extra(&P, c"cuCtxGetCurrent");
    if p == 0 {
        return 0;
    }
    // SAFETY: `p` is the real cuCtxGetCurrent(CUcontext*).
    let f = unsafe { std::mem::transmute::<usize, PFN_cuCtxGetCurrent>(p) };
    let mut c: CUcontext = std::ptr::null_mut();
    // SAFETY: a valid out-pointer.
    if unsafe { f(&mut c) } == CUDA_SUCCESS {
        c as usize
    } else {
        0
    }
}

/// The driver's minimum allocation granularity of `dev` (None: it cannot say).
pub(crate) fn granularity(dev: usize) -> Option<u64> {
    static P: OnceLock<usize> = OnceLock::new();
    let p = extra(&P, c"cuMemGetAllocationGranularity");
    if p == 0 {
        return None;
    }
    // SAFETY: `p` is the real cuMemGetAllocationGranularity(size_t*, const
    // CUmemAllocationProp*, CUmemAllocationGranularity_flags).
    let f = unsafe { std::mem::transmute::<usize, PFN_cuMemGetAllocationGranularity>(p) };
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
    let r = unsafe { f(&mut out, &prop, 0) };
    (r == CUDA_SUCCESS && out > 0).then_some(out as u64)
}

/// A `u64` attribute of `pool` from the real driver (None: the query failed).
pub(crate) fn pool_attr(pool: u64, attr: c_int) -> Option<u64> {
    static P: OnceLock<usize> = OnceLock::new();
    let p = extra(&P, c"cuMemPoolGetAttribute");
    if p == 0 {
        return None;
    }
    // SAFETY: `p` is the real cuMemPoolGetAttribute(CUmemoryPool, CUmemPool_attribute,
    // void*).
    let f = unsafe { std::mem::transmute::<usize, PFN_cuMemPoolGetAttribute>(p) };
    let mut v = 0u64;
    // SAFETY: the reserved/used attributes are cuuint64_t, written to a valid u64.
    let r = unsafe { f(pool as CUmemoryPool, attr, (&raw mut v).cast()) };
    (r == CUDA_SUCCESS).then_some(v)
}

/// The current memory pool of `dev` (`cuDeviceGetMemPool`), which `cuMemAllocAsync`
/// allocates from.
pub(crate) fn current_pool(dev: usize) -> Option<u64> {
    static P: OnceLock<usize> = OnceLock::new();
    let p = extra(&P, c"cuDeviceGetMemPool");
    if p == 0 {
        return None;
    }
    // SAFETY: `p` is the real cuDeviceGetMemPool(CUmemoryPool*, CUdevice).
    let f = unsafe { std::mem::transmute::<usize, PFN_cuDeviceGetMemPool>(p) };
    let mut pool: CUmemoryPool = std::ptr::null_mut();
    // SAFETY: a valid out-pointer and a device ordinal.
    let r = unsafe { f(&mut pool, CUdevice::try_from(dev).ok()?) };
    (r == CUDA_SUCCESS && !pool.is_null()).then_some(pool as u64)
}

/// The UUIDs (`GPU-…`) of the visible devices in CUDA ordinal order, from the real
/// driver (initialised here with `cuInit(0)`, which is idempotent). No lock is held.
pub(crate) fn device_uuids() -> Result<Vec<String>, String> {
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
    let init = unsafe { std::mem::transmute::<usize, PFN_cuInit>(init) };
    // SAFETY: `count` is the real cuDeviceGetCount(int*).
    let count = unsafe { std::mem::transmute::<usize, PFN_cuDeviceGetCount>(count) };
    // SAFETY: `uuid` is the real cuDeviceGetUuid(_v2)(CUuuid*, CUdevice).
    let uuid = unsafe { std::mem::transmute::<usize, PFN_cuDeviceGetUuid>(uuid) };
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
            std::mem::transmute::<usize, PFN_cuCtxPushCurrent_v2>(push),
            std::mem::transmute::<usize, PFN_cuCtxPopCurrent_v2>(pop),
            std::mem::transmute::<usize, PFN_cuCtxSynchronize>(sync),
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

/// A new event with timing in the current context (None: the driver refused): the gate
/// thread measures the device time between two markers with it.
pub(crate) fn create_event() -> Option<usize> {
    static P: OnceLock<usize> = OnceLock::new();
    let p = extra(&P, c"cuEventCreate");
    if p == 0 {
        return None;
    }
    // SAFETY: `p` is the real cuEventCreate(CUevent*, unsigned int).
    let f = unsafe { std::mem::transmute::<usize, PFN_cuEventCreate>(p) };
    let mut e: CUevent = std::ptr::null_mut();
    // SAFETY: a valid out-pointer; 0 = CU_EVENT_DEFAULT (timing on).
    let r = unsafe { f(&mut e, 0) };
    (r == CUDA_SUCCESS && !e.is_null()).then_some(e as usize)
}

/// Registers the page at `host` (4096 bytes, page-aligned, the caller's for the
/// process's life) with the driver in the current context, mapped into the device
/// (`cuMemHostRegister_v2`, portable and mapped: the real one, not the hook): the
/// address the device reads it at (None: the driver refused).
pub(crate) fn register_host_page(host: usize) -> Option<u64> {
    static REG: OnceLock<usize> = OnceLock::new();
    static DPTR: OnceLock<usize> = OnceLock::new();
    let (r, d) = (
        extra(&REG, c"cuMemHostRegister_v2"),
        extra(&DPTR, c"cuMemHostGetDevicePointer_v2"),
    );
    if r == 0 || d == 0 {
        return None;
    }
    type Register = unsafe extern "C" fn(*mut std::ffi::c_void, usize, c_uint) -> CUresult;
    type DevicePointer =
        unsafe extern "C" fn(*mut CUdeviceptr, *mut std::ffi::c_void, c_uint) -> CUresult;
    // SAFETY: `r` is the real cuMemHostRegister_v2(void*, size_t, unsigned int), `d` the
    // real cuMemHostGetDevicePointer_v2(CUdeviceptr*, void*, unsigned int).
    let (register, dptr) = unsafe {
        (
            std::mem::transmute::<usize, Register>(r),
            std::mem::transmute::<usize, DevicePointer>(d),
        )
    };
    let p = host as *mut std::ffi::c_void;
    // SAFETY: a page-aligned page the caller keeps for the process's life;
    // CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP.
    if unsafe { register(p, 4096, 0x1 | 0x2) } != CUDA_SUCCESS {
        return None;
    }
    let mut dev: CUdeviceptr = 0;
    // SAFETY: a valid out-pointer and the page just registered.
    let ok = unsafe { dptr(&mut dev, p, 0) } == CUDA_SUCCESS && dev != 0;
    ok.then_some(dev)
}

/// Queues on `stream` (`_ptsz` when `ptsz`) a wait until the 32-bit word the device
/// reads at `word` is at least 1 (`cuStreamWaitValue32_v2`, `CU_STREAM_WAIT_VALUE_GEQ`).
/// False: not queued.
pub(crate) fn stream_wait_open(word: u64, stream: usize, ptsz: bool) -> bool {
    static P: OnceLock<usize> = OnceLock::new();
    static PTSZ: OnceLock<usize> = OnceLock::new();
    let p = if ptsz {
        extra(&PTSZ, c"cuStreamWaitValue32_v2_ptsz")
    } else {
        extra(&P, c"cuStreamWaitValue32_v2")
    };
    word_op(p, stream, word, 1, memop::WAIT_VALUE_GEQ)
}

/// Queues on `stream` (`_ptsz` when `ptsz`) a write of `value` to the 32-bit word the
/// device reads at `word` (`cuStreamWriteValue32_v2`). False: not queued.
pub(crate) fn stream_write_word(word: u64, value: u32, stream: usize, ptsz: bool) -> bool {
    static P: OnceLock<usize> = OnceLock::new();
    static PTSZ: OnceLock<usize> = OnceLock::new();
    let p = if ptsz {
        extra(&PTSZ, c"cuStreamWriteValue32_v2_ptsz")
    } else {
        extra(&P, c"cuStreamWriteValue32_v2")
    };
    word_op(p, stream, word, value, 0)
}

/// Calls `p`, a real stream memory operation on a 32-bit word (`cuStreamWaitValue32_v2`
/// or `cuStreamWriteValue32_v2`, one signature; 0: absent). False: not queued.
fn word_op(p: usize, stream: usize, word: u64, value: u32, flags: c_uint) -> bool {
    if p == 0 {
        return false;
    }
    // SAFETY: `p` is the real function, of `PFN_cuStreamWaitValue32_v2`'s signature.
    let f = unsafe { std::mem::transmute::<usize, PFN_cuStreamWaitValue32_v2>(p) };
    // SAFETY: the stream the application launches on, and a word of a page this shim
    // mapped for the process's life.
    unsafe { f(stream as CUstream, word, value, flags) == CUDA_SUCCESS }
}

/// Records `event` on `stream` (after the launch just made on it).
pub(crate) fn record_event(event: usize, stream: usize) -> bool {
    static P: OnceLock<usize> = OnceLock::new();
    let p = extra(&P, c"cuEventRecord");
    if p == 0 {
        return false;
    }
    // SAFETY: `p` is the real cuEventRecord(CUevent, CUstream).
    let f = unsafe { std::mem::transmute::<usize, PFN_cuEventRecord>(p) };
    // SAFETY: an event this shim created in the current context, and the stream the
    // application launched on.
    unsafe { f(event as CUevent, stream as CUstream) == CUDA_SUCCESS }
}

/// Device time from `start`'s completion to `end`'s, ns (None: not both complete, or the
/// driver cannot time them). Both are events of this process's contexts on one device;
/// the caller holds the context lock.
pub(crate) fn event_elapsed_ns(start: usize, end: usize) -> Option<u64> {
    static P: OnceLock<usize> = OnceLock::new();
    let p = extra(&P, c"cuEventElapsedTime");
    if p == 0 {
        return None;
    }
    // SAFETY: `p` is the real cuEventElapsedTime(float*, CUevent, CUevent).
    let f = unsafe { std::mem::transmute::<usize, PFN_cuEventElapsedTime>(p) };
    let mut ms: f32 = 0.0;
    // SAFETY: a valid out-pointer and two events of live contexts (the caller holds the
    // context lock).
    let r = unsafe { f(&mut ms, start as CUevent, end as CUevent) };
    (r == CUDA_SUCCESS && ms.is_finite() && ms >= 0.0).then(|| (f64::from(ms) * 1e6) as u64)
}

/// Whether `stream` (a launch's stream; `ptsz`: the launch was the per-thread-default-
/// stream variant) is capturing: its launches build a graph and run nothing. An error
/// (the legacy stream while another captures, an unknown handle) counts as not
/// capturing: the launch is then gated as any other.
pub(crate) fn stream_capturing(stream: usize, ptsz: bool) -> bool {
    static P: OnceLock<usize> = OnceLock::new();
    static P_PTSZ: OnceLock<usize> = OnceLock::new();
    let p = if ptsz {
        extra(&P_PTSZ, c"cuStreamIsCapturing_ptsz")
    } else {
        extra(&P, c"cuStreamIsCapturing")
    };
    if p == 0 {
        return false;
    }
    // SAFETY: `p` is the real cuStreamIsCapturing(CUstream, CUstreamCaptureStatus*).
    let f = unsafe { std::mem::transmute::<usize, PFN_cuStreamIsCapturing>(p) };
    let mut status: c_uint = 0;
    // SAFETY: the stream the application passed; a valid out-pointer.
    let r = unsafe { f(stream as CUstream, &mut status) };
    // CU_STREAM_CAPTURE_STATUS_ACTIVE 1, _INVALIDATED 2: both still capture.
    r == CUDA_SUCCESS && status != 0
}

/// Puts the calling thread (the gate thread) in the relaxed stream capture mode, so that
/// its calls are never the "potentially unsafe" ones a global-mode capture of the
/// application's forbids from every thread. False: the driver refused or lacks it.
pub(crate) fn relax_capture_mode() -> bool {
    static P: OnceLock<usize> = OnceLock::new();
    let p = extra(&P, c"cuThreadExchangeStreamCaptureMode");
    if p == 0 {
        return false;
    }
    // SAFETY: `p` is the real cuThreadExchangeStreamCaptureMode(CUstreamCaptureMode*).
    let f = unsafe { std::mem::transmute::<usize, PFN_cuThreadExchangeStreamCaptureMode>(p) };
    // CU_STREAM_CAPTURE_MODE_RELAXED.
    let mut mode: c_uint = 2;
    // SAFETY: a valid in/out pointer.
    unsafe { f(&mut mode) == CUDA_SUCCESS }
}

/// Whether `event` has completed (an error counts as completed: nothing to wait for).
pub(crate) fn event_done(event: usize) -> bool {
    static P: OnceLock<usize> = OnceLock::new();
    let p = extra(&P, c"cuEventQuery");
    if p == 0 {
        return true;
    }
    // SAFETY: `p` is the real cuEventQuery(CUevent).
    let f = unsafe { std::mem::transmute::<usize, PFN_cuEventQuery>(p) };
    // SAFETY: an event of a live context (the caller holds the context lock).
    unsafe { f(event as CUevent) != CUDA_ERROR_NOT_READY }
}
