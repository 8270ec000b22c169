//! The exported driver API. Each function: guard, check arguments, call, map.

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use vgpu_cuda_abi::cuda::*;

use crate::exec::{Event, Graph, Stream, Work, resolve_stream};
use crate::mem::{self, AllocKind, Dir};
use crate::module::{self, FILL, Geometry, SPIN};
use crate::rt::{self, CuResult, Driver, Kind, driver, from_ptr, to_ptr};
use vgpu_cuda_sim::checkpoint_area::CkptOp;

/// Runs `f`, turning errors and panics into a `CUresult`. While the process is locked by
/// the checkpoint API the call waits first (`checkpoint::enter`).
pub(crate) fn guard(f: impl FnOnce() -> CuResult<()>) -> CUresult {
    let call = || {
        let _in_flight = crate::checkpoint::enter();
        f()
    };
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(call)) {
        Ok(Ok(())) => CUDA_SUCCESS,
        Ok(Err(e)) => e,
        Err(_) => CUDA_ERROR_UNKNOWN,
    }
}

/// Writes `$v` through the out-pointer `$p` (null → `CUDA_ERROR_INVALID_VALUE`).
macro_rules! out {
    ($p:expr, $v:expr) => {{
        let p = $p;
        let v = $v;
        if p.is_null() {
            Err(CUDA_ERROR_INVALID_VALUE)
        } else {
            // SAFETY: the CUDA API contract makes a non-null out-pointer valid for one
            // write of its pointee type.
            unsafe { p.write(v) };
            Ok(())
        }
    }};
}

/// Reads `*$p` (null → `CUDA_ERROR_INVALID_VALUE`).
macro_rules! inp {
    ($p:expr) => {{
        let p = $p;
        if p.is_null() {
            Err(CUDA_ERROR_INVALID_VALUE)
        } else {
            // SAFETY: the CUDA API contract makes a non-null in-pointer valid for one
            // read of its pointee type.
            Ok(unsafe { p.read_unaligned() })
        }
    }};
}

/// Fails with `CUDA_ERROR_INVALID_VALUE` if the out-pointer is null (checked before
/// doing work that would have to be undone).
pub(crate) fn nn<T>(p: *const T) -> CuResult<()> {
    if p.is_null() {
        Err(CUDA_ERROR_INVALID_VALUE)
    } else {
        Ok(())
    }
}

/// Defines exported functions; `a [b]` exports the same body under a second name (the
/// per-thread-stream variants and ABI-identical versioned names).
macro_rules! export {
    ($(fn $name:ident $([$($alias:ident),*])? ( $($a:ident : $t:ty),* $(,)? ) $body:block)*) => {
        $( export!(@one $name [$($($alias)*)?] ($($a : $t),*) $body); )*
    };
    (@one $name:ident [$($alias:ident)*] ( $($a:ident : $t:ty),* $(,)? ) $body:block) => {
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name($($a: $t),*) -> CUresult {
            guard(move || $body)
        }
        export!(@aliases $name [$($alias)*] ($($a : $t),*));
    };
    (@aliases $name:ident [$($alias:ident)*] $args:tt) => {
        $( export!(@alias $name $alias $args); )*
    };
    (@alias $name:ident $alias:ident ( $($a:ident : $t:ty),* )) => {
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $alias($($a: $t),*) -> CUresult {
            // SAFETY: same contract as the function this name aliases.
            unsafe { $name($($a),*) }
        }
    };
}

fn cur() -> CuResult<(&'static Driver, Arc<rt::Ctx>)> {
    let d = driver()?;
    Ok((d, d.current()?))
}

pub(crate) fn cstr<'a>(p: *const c_char) -> CuResult<&'a str> {
    if p.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: the API contract: a non-null C string argument is NUL-terminated.
    unsafe { CStr::from_ptr(p) }
        .to_str()
        .map_err(|_| CUDA_ERROR_INVALID_VALUE)
}

fn write_cstr(dst: *mut c_char, len: c_int, s: &str) -> CuResult<()> {
    nn(dst)?;
    let len = usize::try_from(len).map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
    if len == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let n = s.len().min(len - 1);
    // SAFETY: `dst` is valid for `len` bytes per the API contract and n + 1 <= len.
    unsafe {
        std::ptr::copy_nonoverlapping(s.as_ptr(), dst.cast::<u8>(), n);
        *dst.add(n) = 0;
    }
    Ok(())
}

fn stream(s: CUstream) -> CuResult<(&'static Driver, Arc<Stream>)> {
    let d = driver()?;
    Ok((d, resolve_stream(d, s)?))
}

fn event(d: &Driver, e: CUevent) -> CuResult<Arc<Event>> {
    let id = from_ptr(e, Kind::Event)?;
    d.objects()
        .events
        .get(&id)
        .cloned()
        .ok_or(CUDA_ERROR_INVALID_HANDLE)
}

// ---- stream memory operations ----------------------------------------------------------

/// The `Work` of a wait on the word at `addr` (`flags`: `CU_STREAM_WAIT_VALUE_*`; the
/// flush bit is refused, as on a device whose `CAN_FLUSH_REMOTE_WRITES` is 0).
fn wait_value_work(d: &Driver, addr: u64, value: u64, flags: u32, wide: bool) -> CuResult<Work> {
    if flags & memop::WAIT_VALUE_FLUSH != 0 {
        return Err(CUDA_ERROR_NOT_SUPPORTED);
    }
    if flags > memop::WAIT_VALUE_NOR {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    mem::check_memop_word(&d.objects(), addr, if wide { 8 } else { 4 })?;
    Ok(Work::WaitValue {
        addr: addr as usize,
        value,
        flags,
        wide,
    })
}

/// The `Work` of a write of `value` to the word at `addr` (`v2`: the v2 entry point,
/// which takes no flag; v1 also takes `CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER`).
fn write_value_work(
    d: &Driver,
    addr: u64,
    value: u64,
    flags: u32,
    wide: bool,
    v2: bool,
) -> CuResult<Work> {
    let allowed = if v2 {
        memop::WRITE_VALUE_DEFAULT
    } else {
        memop::WRITE_VALUE_NO_MEMORY_BARRIER
    };
    if flags & !allowed != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    mem::check_memop_word(&d.objects(), addr, if wide { 8 } else { 4 })?;
    Ok(Work::WriteValue {
        addr: addr as usize,
        value,
        wide,
    })
}

fn stream_wait_value(
    s: CUstream,
    addr: CUdeviceptr,
    value: u64,
    flags: c_uint,
    wide: bool,
) -> CuResult<()> {
    let (d, st) = stream(s)?;
    let w = wait_value_work(d, addr, value, flags, wide)?;
    st.enqueue(d, w)
}

fn stream_write_value(
    s: CUstream,
    addr: CUdeviceptr,
    value: u64,
    flags: c_uint,
    wide: bool,
    v2: bool,
) -> CuResult<()> {
    let (d, st) = stream(s)?;
    let w = write_value_work(d, addr, value, flags, wide, v2)?;
    st.enqueue(d, w)
}

/// `cuStreamBatchMemOp`: every operation is checked before any is queued; the batch is
/// queued as one piece of work, in order. A barrier orders nothing more than the queue
/// already does; flushing remote writes is not supported (as `CAN_FLUSH_REMOTE_WRITES`
/// says). At most 256 operations, as `cuda.h` documents for the count.
fn stream_batch_mem_op(
    s: CUstream,
    count: c_uint,
    ops: *mut CUstreamBatchMemOpParams,
    flags: c_uint,
    v2: bool,
) -> CuResult<()> {
    let (d, st) = stream(s)?;
    if flags != 0 || count == 0 || count > 256 || ops.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: the API contract: `paramArray` holds `count` parameter unions.
    let ops = unsafe { std::slice::from_raw_parts(ops.cast_const(), count as usize) };
    let mut work = Vec::with_capacity(ops.len());
    for op in ops {
        match op.operation {
            memop::OP_WAIT_VALUE_32 | memop::OP_WAIT_VALUE_64 => {
                let wide = op.operation == memop::OP_WAIT_VALUE_64;
                work.push(wait_value_work(d, op.address, op.value, op.flags, wide)?);
            }
            memop::OP_WRITE_VALUE_32 | memop::OP_WRITE_VALUE_64 => {
                let wide = op.operation == memop::OP_WRITE_VALUE_64;
                work.push(write_value_work(
                    d, op.address, op.value, op.flags, wide, v2,
                )?);
            }
            memop::OP_BARRIER => {}
            memop::OP_FLUSH_REMOTE_WRITES => return Err(CUDA_ERROR_NOT_SUPPORTED),
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        }
    }
    match work.len() {
        0 => Ok(()),
        1 => st.enqueue(d, work.pop().expect("one")),
        _ => st.enqueue(d, Work::Batch(Arc::new(work))),
    }
}

// ---- errors, init, version -------------------------------------------------------------

static NAMES: std::sync::OnceLock<Vec<(CUresult, std::ffi::CString, std::ffi::CString)>> =
    std::sync::OnceLock::new();

fn names() -> &'static [(CUresult, std::ffi::CString, std::ffi::CString)] {
    NAMES.get_or_init(|| {
        RESULTS
            .iter()
            .map(|&(c, n, s)| {
                (
                    c,
                    std::ffi::CString::new(n).expect("no NUL in names"),
                    std::ffi::CString::new(s).expect("no NUL in strings"),
                )
            })
            .collect()
    })
}

export! {
    fn cuGetErrorName(error: CUresult, pStr: *mut *const c_char) {
        nn(pStr)?;
        let e = names().iter().find(|e| e.0 == error);
        match e {
            Some(e) => out!(pStr, e.1.as_ptr()),
            None => {
                out!(pStr, std::ptr::null())?;
                Err(CUDA_ERROR_INVALID_VALUE)
            }
        }
    }

    fn cuGetErrorString(error: CUresult, pStr: *mut *const c_char) {
        nn(pStr)?;
        match names().iter().find(|e| e.0 == error) {
            Some(e) => out!(pStr, e.2.as_ptr()),
            None => {
                out!(pStr, std::ptr::null())?;
                Err(CUDA_ERROR_INVALID_VALUE)
            }
        }
    }

    fn cuInit(flags: c_uint) {
        if flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        rt::init().map(crate::checkpoint::start_agent)
    }

    fn cuDriverGetVersion(driverVersion: *mut c_int) {
        out!(driverVersion, rt::DRIVER_VERSION)
    }
}

// ---- devices ---------------------------------------------------------------------------

fn attribute(d: &Driver, dev: usize, a: c_int) -> CuResult<c_int> {
    let i = d.state.info(dev);
    // Component k of the PCI bus id (domain, bus, device), parsed only when asked for.
    let pci_at = |k: usize| {
        i.pci_bus_id()
            .split([':', '.'])
            .nth(k)
            .and_then(|p| u32::from_str_radix(p, 16).ok())
            .unwrap_or(0) as c_int
    };
    Ok(match a {
        attr::MAX_THREADS_PER_BLOCK | attr::MAX_BLOCK_DIM_X | attr::MAX_BLOCK_DIM_Y => 1024,
        attr::MAX_BLOCK_DIM_Z => 64,
        attr::MAX_GRID_DIM_X => i32::MAX,
        attr::MAX_GRID_DIM_Y | attr::MAX_GRID_DIM_Z => 65535,
        attr::MAX_SHARED_MEMORY_PER_BLOCK => 48 * 1024,
        attr::TOTAL_CONSTANT_MEMORY => 64 * 1024,
        attr::WARP_SIZE => 32,
        attr::MAX_PITCH => i32::MAX,
        attr::MAX_REGISTERS_PER_BLOCK | attr::MAX_REGISTERS_PER_MULTIPROCESSOR => 65536,
        attr::CLOCK_RATE => 1_980_000,
        attr::TEXTURE_ALIGNMENT => 512,
        attr::GPU_OVERLAP
        | attr::CAN_MAP_HOST_MEMORY
        | attr::CONCURRENT_KERNELS
        | attr::ECC_ENABLED => 1,
        attr::MULTIPROCESSOR_COUNT => i.sm_count as c_int,
        attr::KERNEL_EXEC_TIMEOUT
        | attr::INTEGRATED
        | attr::COMPUTE_MODE
        | attr::TCC_DRIVER
        | attr::MULTI_GPU_BOARD => 0,
        attr::PCI_DOMAIN_ID => pci_at(0),
        attr::PCI_BUS_ID => pci_at(1),
        attr::PCI_DEVICE_ID => pci_at(2),
        attr::MEMORY_CLOCK_RATE => 2_619_000,
        attr::GLOBAL_MEMORY_BUS_WIDTH => 5120,
        attr::L2_CACHE_SIZE => 50 * 1024 * 1024,
        attr::MAX_THREADS_PER_MULTIPROCESSOR => 2048,
        attr::ASYNC_ENGINE_COUNT => 2,
        attr::UNIFIED_ADDRESSING
        | attr::STREAM_PRIORITIES_SUPPORTED
        | attr::GLOBAL_L1_CACHE_SUPPORTED => 1,
        attr::LOCAL_L1_CACHE_SUPPORTED | attr::MANAGED_MEMORY | attr::CONCURRENT_MANAGED_ACCESS => {
            1
        }
        attr::COMPUTE_PREEMPTION_SUPPORTED | attr::COOPERATIVE_LAUNCH => 1,
        attr::VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
        | attr::HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED => 1,
        attr::MEMORY_POOLS_SUPPORTED => 1,
        attr::CAN_USE_STREAM_MEM_OPS_V1
        | attr::CAN_USE_64_BIT_STREAM_MEM_OPS_V1
        | attr::CAN_USE_STREAM_WAIT_VALUE_NOR_V1
        | attr::CAN_USE_64_BIT_STREAM_MEM_OPS
        | attr::CAN_USE_STREAM_WAIT_VALUE_NOR => 1,
        attr::CAN_FLUSH_REMOTE_WRITES => 0,
        attr::COMPUTE_CAPABILITY_MAJOR => i.cc_major as c_int,
        attr::COMPUTE_CAPABILITY_MINOR => i.cc_minor as c_int,
        attr::MAX_SHARED_MEMORY_PER_MULTIPROCESSOR => 228 * 1024,
        attr::MAX_SHARED_MEMORY_PER_BLOCK_OPTIN => 227 * 1024,
        attr::MAX_BLOCKS_PER_MULTIPROCESSOR => 32,
        attr::CLUSTER_LAUNCH => c_int::from(i.cc_major >= 9),
        attr::MAXIMUM_TEXTURE1D_WIDTH => mem::array_limits::TEX1D as c_int,
        attr::MAXIMUM_TEXTURE2D_WIDTH => mem::array_limits::TEX2D.0 as c_int,
        attr::MAXIMUM_TEXTURE2D_HEIGHT => mem::array_limits::TEX2D.1 as c_int,
        attr::MAXIMUM_TEXTURE3D_WIDTH
        | attr::MAXIMUM_TEXTURE3D_HEIGHT
        | attr::MAXIMUM_TEXTURE3D_DEPTH => mem::array_limits::TEX3D as c_int,
        attr::MAXIMUM_TEXTURE1D_MIPMAPPED_WIDTH => mem::array_limits::TEX1D_MIPMAP as c_int,
        attr::MAXIMUM_TEXTURE2D_MIPMAPPED_WIDTH | attr::MAXIMUM_TEXTURE2D_MIPMAPPED_HEIGHT => {
            mem::array_limits::TEX2D_MIPMAP as c_int
        }
        a if a > 0 && a < attr::MAX => 0,
        _ => return Err(CUDA_ERROR_INVALID_VALUE),
    })
}

export! {
    fn cuDeviceGetCount(count: *mut c_int) {
        let d = driver()?;
        out!(count, d.visible_count() as c_int)
    }

    fn cuDeviceGet(device: *mut CUdevice, ordinal: c_int) {
        let d = driver()?;
        d.device(ordinal)?;
        out!(device, ordinal)
    }

    fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: CUdevice) {
        let d = driver()?;
        let i = d.device(dev)?;
        write_cstr(name, len, d.state.info(i).name())
    }

    fn cuDeviceGetUuid [cuDeviceGetUuid_v2] (uuid: *mut CUuuid, dev: CUdevice) {
        let d = driver()?;
        let i = d.device(dev)?;
        out!(uuid, CUuuid { bytes: d.state.info(i).uuid })
    }

    fn cuDeviceGetLuid(luid: *mut c_char, mask: *mut c_uint, dev: CUdevice) {
        let d = driver()?;
        d.device(dev)?;
        let _ = (luid, mask);
        Err(CUDA_ERROR_NOT_SUPPORTED)
    }

    fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) {
        let d = driver()?;
        let i = d.device(dev)?;
        out!(bytes, d.state.info(i).memory as usize)
    }

    fn cuDeviceGetAttribute(pi: *mut c_int, attrib: c_int, dev: CUdevice) {
        let d = driver()?;
        let i = d.device(dev)?;
        nn(pi)?;
        out!(pi, attribute(d, i, attrib)?)
    }

    fn cuDeviceComputeCapability(major: *mut c_int, minor: *mut c_int, dev: CUdevice) {
        let d = driver()?;
        let i = d.device(dev)?;
        nn(minor)?;
        out!(major, d.state.info(i).cc_major as c_int)?;
        out!(minor, d.state.info(i).cc_minor as c_int)
    }

    fn cuDeviceGetPCIBusId(pciBusId: *mut c_char, len: c_int, dev: CUdevice) {
        let d = driver()?;
        let i = d.device(dev)?;
        // CUDA prints the 4-digit domain form: dddd:bb:dd.f
        let full = d.state.info(i).pci_bus_id();
        let short = full.get(4..).unwrap_or(full);
        write_cstr(pciBusId, len, &short.to_ascii_lowercase())
    }

    fn cuDeviceGetByPCIBusId(dev: *mut CUdevice, pciBusId: *const c_char) {
        let d = driver()?;
        let want = vgpu_cuda_sim::config::normalize_pci_bus_id(cstr(pciBusId)?).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let i = (0..d.device_count())
            .find(|&i| d.state.info(i).pci_bus_id() == want)
            .and_then(|i| d.ordinal(i))
            .ok_or(CUDA_ERROR_INVALID_DEVICE)?;
        out!(dev, i)
    }

    fn cuDeviceCanAccessPeer(canAccessPeer: *mut c_int, dev: CUdevice, peerDev: CUdevice) {
        let d = driver()?;
        out!(canAccessPeer, c_int::from(crate::peer::can_access(d, dev, peerDev)?))
    }

    fn cuDeviceGetP2PAttribute(value: *mut c_int, attrib: c_int, srcDevice: CUdevice, dstDevice: CUdevice) {
        let d = driver()?;
        out!(value, crate::peer::attribute(d, attrib, srcDevice, dstDevice)?)
    }

    fn cuDeviceGetDefaultMemPool(pool_out: *mut CUmemoryPool, dev: CUdevice) {
        let d = driver()?;
        let i = d.device(dev)?;
        out!(pool_out, to_ptr(mem::default_pool(d, i).id))
    }

    fn cuDeviceGetMemPool(pool: *mut CUmemoryPool, dev: CUdevice) {
        let d = driver()?;
        let i = d.device(dev)?;
        out!(pool, to_ptr(current_pool(d, i).id))
    }

    fn cuDeviceSetMemPool(dev: CUdevice, pool: CUmemoryPool) {
        let d = driver()?;
        let i = d.device(dev)?;
        let p = mem::pool(d, from_ptr(pool, Kind::Pool)?)?;
        if p.dev != i {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        CURRENT_POOLS.lock().unwrap_or_else(|p| p.into_inner()).insert(i, p);
        Ok(())
    }
}

static CURRENT_POOLS: std::sync::Mutex<std::collections::BTreeMap<usize, Arc<mem::Pool>>> =
    std::sync::Mutex::new(std::collections::BTreeMap::new());

fn current_pool(d: &Driver, dev: usize) -> Arc<mem::Pool> {
    CURRENT_POOLS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(&dev)
        .cloned()
        .unwrap_or_else(|| mem::default_pool(d, dev))
}

// ---- contexts --------------------------------------------------------------------------

export! {
    fn cuDevicePrimaryCtxRetain(pctx: *mut CUcontext, dev: CUdevice) {
        let d = driver()?;
        nn(pctx)?;
        let id = d.primary_retain(dev)?;
        out!(pctx, to_ptr(id))
    }

    fn cuDevicePrimaryCtxRelease_v2 [cuDevicePrimaryCtxRelease] (dev: CUdevice) {
        driver()?.primary_release(dev)
    }

    fn cuDevicePrimaryCtxReset_v2 [cuDevicePrimaryCtxReset] (dev: CUdevice) {
        driver()?.primary_reset(dev)
    }

    fn cuDevicePrimaryCtxSetFlags_v2 [cuDevicePrimaryCtxSetFlags] (dev: CUdevice, flags: c_uint) {
        driver()?.primary_set_flags(dev, flags)
    }

    fn cuDevicePrimaryCtxGetState(dev: CUdevice, flags: *mut c_uint, active: *mut c_int) {
        let (f, a) = driver()?.primary_state(dev)?;
        nn(active)?;
        out!(flags, f)?;
        out!(active, c_int::from(a))
    }

    fn cuCtxCreate_v2(pctx: *mut CUcontext, flags: c_uint, dev: CUdevice) {
        let d = driver()?;
        nn(pctx)?;
        let id = d.ctx_create(flags, dev)?;
        out!(pctx, to_ptr(id))
    }

    fn cuCtxCreate_v3(pctx: *mut CUcontext, paramsArray: *mut c_void, numParams: c_int, flags: c_uint, dev: CUdevice) {
        if numParams > 0 && !paramsArray.is_null() {
            return Err(CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY);
        }
        let d = driver()?;
        nn(pctx)?;
        let id = d.ctx_create(flags, dev)?;
        out!(pctx, to_ptr(id))
    }

    fn cuCtxCreate_v4(pctx: *mut CUcontext, ctxCreateParams: *mut c_void, flags: c_uint, dev: CUdevice) {
        if !ctxCreateParams.is_null() {
            // Execution affinity and CIG parameters are not simulated.
            let p: [usize; 4] = inp!(ctxCreateParams as *const [usize; 4])?;
            if p.iter().any(|&v| v != 0) {
                return Err(CUDA_ERROR_NOT_SUPPORTED);
            }
        }
        let d = driver()?;
        nn(pctx)?;
        let id = d.ctx_create(flags, dev)?;
        out!(pctx, to_ptr(id))
    }

    fn cuCtxDestroy_v2 [cuCtxDestroy] (ctx: CUcontext) {
        let d = driver()?;
        d.ctx_destroy(from_ptr(ctx, Kind::Ctx).map_err(|_| CUDA_ERROR_INVALID_CONTEXT)?)
    }

    fn cuCtxPushCurrent_v2 [cuCtxPushCurrent] (ctx: CUcontext) {
        let d = driver()?;
        let id = from_ptr(ctx, Kind::Ctx).map_err(|_| CUDA_ERROR_INVALID_CONTEXT)?;
        d.ctx(id)?;
        rt::push_current(id);
        Ok(())
    }

    fn cuCtxPopCurrent_v2 [cuCtxPopCurrent] (pctx: *mut CUcontext) {
        driver()?;
        let id = rt::pop_current().ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
        if !pctx.is_null() {
            out!(pctx, to_ptr(id))?;
        }
        Ok(())
    }

    fn cuCtxSetCurrent(ctx: CUcontext) {
        let d = driver()?;
        if ctx.is_null() {
            rt::set_current(0);
            return Ok(());
        }
        let id = from_ptr(ctx, Kind::Ctx).map_err(|_| CUDA_ERROR_INVALID_CONTEXT)?;
        d.ctx(id)?;
        rt::set_current(id);
        Ok(())
    }

    fn cuCtxGetCurrent(pctx: *mut CUcontext) {
        driver()?;
        out!(pctx, to_ptr(rt::current_id()))
    }

    fn cuCtxGetDevice(device: *mut CUdevice) {
        let (d, c) = cur()?;
        out!(device, d.ordinal(c.dev).ok_or(CUDA_ERROR_INVALID_DEVICE)?)
    }

    fn cuCtxGetDevice_v2(device: *mut CUdevice, ctx: CUcontext) {
        let d = driver()?;
        let c = if ctx.is_null() { d.current()? } else { d.ctx(from_ptr(ctx, Kind::Ctx).map_err(|_| CUDA_ERROR_INVALID_CONTEXT)?)? };
        out!(device, d.ordinal(c.dev).ok_or(CUDA_ERROR_INVALID_DEVICE)?)
    }

    fn cuCtxGetFlags(flags: *mut c_uint) {
        let (_, c) = cur()?;
        out!(flags, c.flags)
    }

    fn cuCtxSetFlags(flags: c_uint) {
        let _ = cur()?;
        let _ = flags;
        Ok(())
    }

    fn cuCtxGetId(ctx: CUcontext, ctxId: *mut u64) {
        let d = driver()?;
        let c = if ctx.is_null() { d.current()? } else { d.ctx(from_ptr(ctx, Kind::Ctx).map_err(|_| CUDA_ERROR_INVALID_CONTEXT)?)? };
        out!(ctxId, c.id >> 8)
    }

    fn cuCtxGetApiVersion(ctx: CUcontext, version: *mut c_uint) {
        let d = driver()?;
        if !ctx.is_null() {
            d.ctx(from_ptr(ctx, Kind::Ctx).map_err(|_| CUDA_ERROR_INVALID_CONTEXT)?)?;
        } else {
            d.current()?;
        }
        out!(version, 3020)
    }

    fn cuCtxSynchronize() {
        let (d, c) = cur()?;
        refuse_during_capture(d, c.dev)?;
        d.worker(c.dev).synchronize();
        Ok(())
    }

    fn cuCtxSynchronize_v2(ctx: CUcontext) {
        let d = driver()?;
        let c = if ctx.is_null() { d.current()? } else { d.ctx(from_ptr(ctx, Kind::Ctx).map_err(|_| CUDA_ERROR_INVALID_CONTEXT)?)? };
        refuse_during_capture(d, c.dev)?;
        d.worker(c.dev).synchronize();
        Ok(())
    }

    fn cuCtxGetLimit(pvalue: *mut usize, limit: c_int) {
        cur()?;
        let v = match limit {
            0 => 1024,              // STACK_SIZE
            1 => 1 << 20,           // PRINTF_FIFO_SIZE
            2 => 8 << 20,           // MALLOC_HEAP_SIZE
            3 => 2,                 // DEV_RUNTIME_SYNC_DEPTH
            4 => 2048,              // DEV_RUNTIME_PENDING_LAUNCH_COUNT
            5 => 32,                // MAX_L2_FETCH_GRANULARITY
            6 => 0,                 // PERSISTING_L2_CACHE_SIZE
            _ => return Err(CUDA_ERROR_UNSUPPORTED_LIMIT),
        };
        out!(pvalue, v)
    }

    fn cuCtxSetLimit(limit: c_int, value: usize) {
        cur()?;
        let _ = value;
        if (0..=6).contains(&limit) { Ok(()) } else { Err(CUDA_ERROR_UNSUPPORTED_LIMIT) }
    }

    fn cuCtxGetCacheConfig(pconfig: *mut c_int) {
        cur()?;
        out!(pconfig, 0)
    }

    fn cuCtxSetCacheConfig(config: c_int) {
        cur()?;
        if (0..=3).contains(&config) { Ok(()) } else { Err(CUDA_ERROR_INVALID_VALUE) }
    }

    fn cuCtxGetStreamPriorityRange(leastPriority: *mut c_int, greatestPriority: *mut c_int) {
        driver()?;
        if !leastPriority.is_null() {
            out!(leastPriority, 0)?;
        }
        if !greatestPriority.is_null() {
            out!(greatestPriority, -5)?;
        }
        Ok(())
    }

    fn cuCtxEnablePeerAccess(peerContext: CUcontext, flags: c_uint) {
        crate::peer::enable(driver()?, peerContext, flags)
    }

    fn cuCtxDisablePeerAccess(peerContext: CUcontext) {
        crate::peer::disable(driver()?, peerContext)
    }
}

// ---- memory ----------------------------------------------------------------------------

export! {
    fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) {
        let (d, c) = cur()?;
        nn(free)?;
        nn(total)?;
        d.state.reap_if_due(Some(d.slot), 10_000_000);
        let (f, t) = d.state.mem_info(c.dev);
        out!(free, f as usize)?;
        out!(total, t as usize)
    }

    fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, bytesize: usize) {
        let (d, c) = cur()?;
        nn(dptr)?;
        let p = mem::alloc_device(d, c.id, c.dev, bytesize as u64, AllocKind::Device)?;
        out!(dptr, p)
    }

    fn cuMemAllocPitch_v2(dptr: *mut CUdeviceptr, pPitch: *mut usize, widthInBytes: usize, height: usize, elementSizeBytes: c_uint) {
        let (d, c) = cur()?;
        nn(dptr)?;
        nn(pPitch)?;
        if widthInBytes == 0 || height == 0 || !matches!(elementSizeBytes, 4 | 8 | 16) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let pitch = widthInBytes.checked_next_multiple_of(512).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let size = (pitch as u64).checked_mul(height as u64).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let p = mem::alloc_device(d, c.id, c.dev, size, AllocKind::Device)?;
        out!(dptr, p)?;
        out!(pPitch, pitch)
    }

    fn cuMemAllocManaged(dptr: *mut CUdeviceptr, bytesize: usize, flags: c_uint) {
        let (d, c) = cur()?;
        nn(dptr)?;
        if flags != 1 && flags != 2 {
            return Err(CUDA_ERROR_INVALID_VALUE); // CU_MEM_ATTACH_GLOBAL or _HOST
        }
        let p = mem::alloc_device(d, c.id, c.dev, bytesize as u64, AllocKind::Managed)?;
        out!(dptr, p)
    }

    fn cuMemFree_v2(dptr: CUdeviceptr) {
        let d = driver()?;
        if dptr == 0 {
            return Ok(());
        }
        mem::free(d, dptr)
    }

    fn cuMemGetAddressRange_v2(pbase: *mut CUdeviceptr, psize: *mut usize, dptr: CUdeviceptr) {
        let d = driver()?;
        let (b, s) = mem::address_range(d, dptr)?;
        if !pbase.is_null() {
            out!(pbase, b)?;
        }
        if !psize.is_null() {
            out!(psize, s as usize)?;
        }
        Ok(())
    }

    fn cuMemAllocHost_v2(pp: *mut *mut c_void, bytesize: usize) {
        let (d, c) = cur()?;
        nn(pp)?;
        let p = mem::alloc_host(d, c.id, bytesize as u64)?;
        out!(pp, p as usize as *mut c_void)
    }

    fn cuMemHostAlloc(pp: *mut *mut c_void, bytesize: usize, flags: c_uint) {
        let (d, c) = cur()?;
        nn(pp)?;
        if flags & !0xf != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let p = mem::alloc_host(d, c.id, bytesize as u64)?;
        out!(pp, p as usize as *mut c_void)
    }

    fn cuMemFreeHost(p: *mut c_void) {
        let d = driver()?;
        mem::free_host(d, p as usize as u64)
    }

    fn cuMemHostGetDevicePointer_v2(pdptr: *mut CUdeviceptr, p: *mut c_void, flags: c_uint) {
        let d = driver()?;
        if flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let a = p as usize as u64;
        let ok = mem::find(&d.objects(), a, 1).is_some_and(|x| matches!(x.kind, AllocKind::Host | AllocKind::Registered));
        if !ok {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        out!(pdptr, a)
    }

    fn cuMemHostGetFlags(pFlags: *mut c_uint, p: *mut c_void) {
        let d = driver()?;
        let ok = mem::find(&d.objects(), p as usize as u64, 1).is_some_and(|x| matches!(x.kind, AllocKind::Host));
        if !ok {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        out!(pFlags, 0)
    }

    fn cuMemHostRegister_v2 [cuMemHostRegister] (p: *mut c_void, bytesize: usize, flags: c_uint) {
        let (d, c) = cur()?;
        let _ = flags;
        mem::host_register(d, c.id, p as usize as u64, bytesize as u64)
    }

    fn cuMemHostUnregister(p: *mut c_void) {
        let d = driver()?;
        mem::host_unregister(d, p as usize as u64)
    }

    fn cuPointerGetAttribute(data: *mut c_void, attribute: c_uint, ptr: CUdeviceptr) {
        let d = driver()?;
        nn(data)?;
        let (kind, dev, ctx, base, size) = {
            let o = d.objects();
            let a = mem::find(&o, ptr, 1).ok_or(CUDA_ERROR_INVALID_VALUE)?;
            (a.kind, a.dev, a.ctx, a.base, a.size)
        };
        let host = matches!(kind, AllocKind::Host | AllocKind::Registered);
        match attribute {
            pointer_attribute::CONTEXT => out!(data as *mut CUcontext, to_ptr(ctx)),
            pointer_attribute::MEMORY_TYPE => out!(data as *mut c_uint, if host { memorytype::HOST } else { memorytype::DEVICE }),
            pointer_attribute::DEVICE_POINTER | pointer_attribute::HOST_POINTER => out!(data as *mut u64, ptr),
            pointer_attribute::IS_MANAGED => out!(data as *mut c_uint, c_uint::from(kind == AllocKind::Managed)),
            pointer_attribute::DEVICE_ORDINAL => out!(data as *mut c_int, d.ordinal(dev).unwrap_or(-1)),
            pointer_attribute::RANGE_START_ADDR => out!(data as *mut u64, base),
            pointer_attribute::RANGE_SIZE => out!(data as *mut usize, size as usize),
            pointer_attribute::MAPPED => out!(data as *mut c_uint, 1),
            _ => Err(CUDA_ERROR_INVALID_VALUE),
        }
    }
}

// ---- copies and memsets ----------------------------------------------------------------

fn sync_copy(dir: Dir, dst: u64, src: u64, n: usize) -> CuResult<()> {
    let (d, _) = cur()?;
    mem::copy_sync(d, dir, dst, src, n as u64)
}

fn async_copy(dir: Dir, dst: u64, src: u64, n: usize, s: CUstream) -> CuResult<()> {
    let (d, st) = stream(s)?;
    mem::copy_async(d, dir, dst, src, n as u64, &st)
}

export! {
    fn cuMemcpyHtoD_v2 [cuMemcpyHtoD_v2_ptds] (dst: CUdeviceptr, src: *const c_void, n: usize) {
        sync_copy(Dir::HtoD, dst, src as usize as u64, n)
    }
    fn cuMemcpyDtoH_v2 [cuMemcpyDtoH_v2_ptds] (dst: *mut c_void, src: CUdeviceptr, n: usize) {
        sync_copy(Dir::DtoH, dst as usize as u64, src, n)
    }
    fn cuMemcpyDtoD_v2 [cuMemcpyDtoD_v2_ptds] (dst: CUdeviceptr, src: CUdeviceptr, n: usize) {
        sync_copy(Dir::DtoD, dst, src, n)
    }
    fn cuMemcpy [cuMemcpy_ptds] (dst: CUdeviceptr, src: CUdeviceptr, n: usize) {
        let d = driver()?;
        sync_copy(mem::classify(d, dst, src), dst, src, n)
    }
    fn cuMemcpyPeer [cuMemcpyPeer_ptds] (dst: CUdeviceptr, dstCtx: CUcontext, src: CUdeviceptr, srcCtx: CUcontext, n: usize) {
        crate::peer::copy_sync(driver()?, dst, dstCtx, src, srcCtx, n)
    }
    fn cuMemcpyHtoDAsync_v2 [cuMemcpyHtoDAsync_v2_ptsz] (dst: CUdeviceptr, src: *const c_void, n: usize, s: CUstream) {
        async_copy(Dir::HtoD, dst, src as usize as u64, n, s)
    }
    fn cuMemcpyDtoHAsync_v2 [cuMemcpyDtoHAsync_v2_ptsz] (dst: *mut c_void, src: CUdeviceptr, n: usize, s: CUstream) {
        async_copy(Dir::DtoH, dst as usize as u64, src, n, s)
    }
    fn cuMemcpyDtoDAsync_v2 [cuMemcpyDtoDAsync_v2_ptsz] (dst: CUdeviceptr, src: CUdeviceptr, n: usize, s: CUstream) {
        async_copy(Dir::DtoD, dst, src, n, s)
    }
    fn cuMemcpyAsync [cuMemcpyAsync_ptsz] (dst: CUdeviceptr, src: CUdeviceptr, n: usize, s: CUstream) {
        let d = driver()?;
        async_copy(mem::classify(d, dst, src), dst, src, n, s)
    }
    fn cuMemcpyPeerAsync [cuMemcpyPeerAsync_ptsz] (dst: CUdeviceptr, dstCtx: CUcontext, src: CUdeviceptr, srcCtx: CUcontext, n: usize, s: CUstream) {
        let (d, st) = stream(s)?;
        crate::peer::copy_async(d, dst, dstCtx, src, srcCtx, n, &st)
    }
    fn cuMemcpy2D_v2 [cuMemcpy2D_v2_ptds] (p: *const CUDA_MEMCPY2D) {
        memcpy_2d(inp!(p)?)
    }
    fn cuMemcpy2DUnaligned_v2 [cuMemcpy2DUnaligned_v2_ptds] (p: *const CUDA_MEMCPY2D) {
        memcpy_2d(inp!(p)?)
    }
    fn cuMemcpy2DAsync_v2 [cuMemcpy2DAsync_v2_ptsz] (p: *const CUDA_MEMCPY2D, s: CUstream) {
        let (d, st) = stream(s)?;
        let c = inp!(p)?;
        st.synchronize(d)?;
        memcpy_2d(c)
    }
    fn cuMemcpyHtoA_v2 [cuMemcpyHtoA_v2_ptds] (dstArray: CUarray, dstOffset: usize, src: *const c_void, n: usize) {
        let d = driver()?;
        let a = mem::array(d, from_ptr(dstArray, Kind::Array)?)?;
        let end = dstOffset.checked_add(n).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if end as u64 > a.bytes || src.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        d.worker(a.dev).drain();
        // SAFETY: the destination range is inside the array's mapping (checked); the
        // source is the application's buffer of `n` bytes.
        unsafe { std::ptr::copy(src.cast::<u8>(), (a.base + dstOffset) as *mut u8, n) };
        Ok(())
    }
    fn cuMemcpyAtoH_v2 [cuMemcpyAtoH_v2_ptds] (dst: *mut c_void, srcArray: CUarray, srcOffset: usize, n: usize) {
        let d = driver()?;
        let a = mem::array(d, from_ptr(srcArray, Kind::Array)?)?;
        let end = srcOffset.checked_add(n).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if end as u64 > a.bytes || dst.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        d.worker(a.dev).drain();
        // SAFETY: the source range is inside the array's mapping (checked); the
        // destination is the application's buffer of `n` bytes.
        unsafe { std::ptr::copy((a.base + srcOffset) as *const u8, dst.cast::<u8>(), n) };
        Ok(())
    }

    fn cuMemsetD8_v2 [cuMemsetD8_v2_ptds] (dst: CUdeviceptr, uc: u8, n: usize) {
        let (d, _) = cur()?;
        mem::memset(d, dst, 0, 1, u32::from(uc), n as u64, 1, None)
    }
    fn cuMemsetD16_v2 [cuMemsetD16_v2_ptds] (dst: CUdeviceptr, us: u16, n: usize) {
        let (d, _) = cur()?;
        mem::memset(d, dst, 0, 2, u32::from(us), n as u64, 1, None)
    }
    fn cuMemsetD32_v2 [cuMemsetD32_v2_ptds] (dst: CUdeviceptr, ui: u32, n: usize) {
        let (d, _) = cur()?;
        mem::memset(d, dst, 0, 4, ui, n as u64, 1, None)
    }
    fn cuMemsetD2D8_v2 [cuMemsetD2D8_v2_ptds] (dst: CUdeviceptr, pitch: usize, uc: u8, w: usize, h: usize) {
        let (d, _) = cur()?;
        mem::memset(d, dst, pitch as u64, 1, u32::from(uc), w as u64, h as u64, None)
    }
    fn cuMemsetD2D16_v2 [cuMemsetD2D16_v2_ptds] (dst: CUdeviceptr, pitch: usize, us: u16, w: usize, h: usize) {
        let (d, _) = cur()?;
        mem::memset(d, dst, pitch as u64, 2, u32::from(us), w as u64, h as u64, None)
    }
    fn cuMemsetD2D32_v2 [cuMemsetD2D32_v2_ptds] (dst: CUdeviceptr, pitch: usize, ui: u32, w: usize, h: usize) {
        let (d, _) = cur()?;
        mem::memset(d, dst, pitch as u64, 4, ui, w as u64, h as u64, None)
    }
    fn cuMemsetD8Async [cuMemsetD8Async_ptsz] (dst: CUdeviceptr, uc: u8, n: usize, s: CUstream) {
        let (d, st) = stream(s)?;
        mem::memset(d, dst, 0, 1, u32::from(uc), n as u64, 1, Some(&st))
    }
    fn cuMemsetD16Async [cuMemsetD16Async_ptsz] (dst: CUdeviceptr, us: u16, n: usize, s: CUstream) {
        let (d, st) = stream(s)?;
        mem::memset(d, dst, 0, 2, u32::from(us), n as u64, 1, Some(&st))
    }
    fn cuMemsetD32Async [cuMemsetD32Async_ptsz] (dst: CUdeviceptr, ui: u32, n: usize, s: CUstream) {
        let (d, st) = stream(s)?;
        mem::memset(d, dst, 0, 4, ui, n as u64, 1, Some(&st))
    }
    fn cuMemsetD2D8Async [cuMemsetD2D8Async_ptsz] (dst: CUdeviceptr, pitch: usize, uc: u8, w: usize, h: usize, s: CUstream) {
        let (d, st) = stream(s)?;
        mem::memset(d, dst, pitch as u64, 1, u32::from(uc), w as u64, h as u64, Some(&st))
    }
    fn cuMemsetD2D32Async [cuMemsetD2D32Async_ptsz] (dst: CUdeviceptr, pitch: usize, ui: u32, w: usize, h: usize, s: CUstream) {
        let (d, st) = stream(s)?;
        mem::memset(d, dst, pitch as u64, 4, ui, w as u64, h as u64, Some(&st))
    }
}

fn memcpy_2d(c: CUDA_MEMCPY2D) -> CuResult<()> {
    let d = driver()?;
    let (w, h) = (c.WidthInBytes as u64, c.Height as u64);
    let src = mem::side(
        d,
        c.srcMemoryType,
        c.srcHost as usize as u64,
        c.srcDevice,
        c.srcArray as usize as u64,
        c.srcXInBytes as u64,
        c.srcY as u64,
        if c.srcPitch == 0 {
            w
        } else {
            c.srcPitch as u64
        },
        w,
        h,
    )?;
    let dst = mem::side(
        d,
        c.dstMemoryType,
        c.dstHost as usize as u64,
        c.dstDevice,
        c.dstArray as usize as u64,
        c.dstXInBytes as u64,
        c.dstY as u64,
        if c.dstPitch == 0 {
            w
        } else {
            c.dstPitch as u64
        },
        w,
        h,
    )?;
    mem::copy_2d(d, dst, src, w, h)
}

// ---- stream-ordered allocation and pools -------------------------------------------------

export! {
    fn cuMemAllocAsync [cuMemAllocAsync_ptsz] (dptr: *mut CUdeviceptr, bytesize: usize, hStream: CUstream) {
        let (d, st) = stream(hStream)?;
        nn(dptr)?;
        let p = mem::alloc_async(d, &current_pool(d, st.dev), bytesize as u64, &st, st.ctx)?;
        out!(dptr, p)
    }
    fn cuMemAllocFromPoolAsync [cuMemAllocFromPoolAsync_ptsz] (dptr: *mut CUdeviceptr, bytesize: usize, pool: CUmemoryPool, hStream: CUstream) {
        let (d, st) = stream(hStream)?;
        nn(dptr)?;
        let pool = mem::pool(d, from_ptr(pool, Kind::Pool)?)?;
        let p = mem::alloc_async(d, &pool, bytesize as u64, &st, st.ctx)?;
        out!(dptr, p)
    }
    fn cuMemFreeAsync [cuMemFreeAsync_ptsz] (dptr: CUdeviceptr, hStream: CUstream) {
        let (d, st) = stream(hStream)?;
        mem::free_async(d, dptr, &st)
    }
    fn cuMemPoolCreate(pool: *mut CUmemoryPool, props: *const CUmemPoolProps) {
        let d = driver()?;
        nn(pool)?;
        let pr = inp!(props)?;
        if pr.location.type_ != CU_MEM_LOCATION_TYPE_DEVICE || pr.allocType != CU_MEM_ALLOCATION_TYPE_PINNED {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let dev = d.device(pr.location.id)?;
        let p = mem::Pool::new(dev);
        let id = p.id;
        d.objects().pools.insert(id, p);
        out!(pool, to_ptr(id))
    }
    fn cuMemPoolDestroy(pool: CUmemoryPool) {
        let d = driver()?;
        let id = from_ptr(pool, Kind::Pool)?;
        let p = d.objects().pools.remove(&id).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        p.trim(d, 0);
        Ok(())
    }
    fn cuMemPoolTrimTo(pool: CUmemoryPool, minBytesToKeep: usize) {
        let d = driver()?;
        let p = mem::pool(d, from_ptr(pool, Kind::Pool)?)?;
        p.trim(d, minBytesToKeep as u64);
        Ok(())
    }
    fn cuMemPoolSetAttribute(pool: CUmemoryPool, attr: c_int, value: *mut c_void) {
        let d = driver()?;
        let p = mem::pool(d, from_ptr(pool, Kind::Pool)?)?;
        use vgpu_cuda_abi::cuda::mempool_attr as A;
        match attr {
            A::REUSE_FOLLOW_EVENT_DEPENDENCIES | A::REUSE_ALLOW_OPPORTUNISTIC | A::REUSE_ALLOW_INTERNAL_DEPENDENCIES => {
                inp!(value as *const c_int).map(|_| ())
            }
            A::RELEASE_THRESHOLD => {
                let v: u64 = inp!(value as *const u64)?;
                p.threshold.store(v, Ordering::Release);
                p.trim(d, v);
                Ok(())
            }
            A::RESERVED_MEM_HIGH => {
                p.reserved_high.store(p.used.load(Ordering::Acquire) + p.cached.load(Ordering::Acquire), Ordering::Release);
                Ok(())
            }
            A::USED_MEM_HIGH => {
                p.used_high.store(p.used.load(Ordering::Acquire), Ordering::Release);
                Ok(())
            }
            _ => Err(CUDA_ERROR_INVALID_VALUE),
        }
    }
    fn cuMemPoolGetAttribute(pool: CUmemoryPool, attr: c_int, value: *mut c_void) {
        let d = driver()?;
        let p = mem::pool(d, from_ptr(pool, Kind::Pool)?)?;
        use vgpu_cuda_abi::cuda::mempool_attr as A;
        let u = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Acquire);
        match attr {
            A::REUSE_FOLLOW_EVENT_DEPENDENCIES | A::REUSE_ALLOW_OPPORTUNISTIC | A::REUSE_ALLOW_INTERNAL_DEPENDENCIES => {
                out!(value as *mut c_int, 1)
            }
            A::RELEASE_THRESHOLD => out!(value as *mut u64, u(&p.threshold)),
            A::RESERVED_MEM_CURRENT => out!(value as *mut u64, u(&p.used) + u(&p.cached)),
            A::RESERVED_MEM_HIGH => out!(value as *mut u64, u(&p.reserved_high)),
            A::USED_MEM_CURRENT => out!(value as *mut u64, u(&p.used)),
            A::USED_MEM_HIGH => out!(value as *mut u64, u(&p.used_high)),
            _ => Err(CUDA_ERROR_INVALID_VALUE),
        }
    }
}

// ---- virtual memory management -------------------------------------------------------------

export! {
    fn cuMemGetAllocationGranularity(granularity: *mut usize, prop: *const CUmemAllocationProp, option: c_int) {
        let d = driver()?;
        let pr = inp!(prop)?;
        let _ = option;
        out!(granularity, mem::vmm_granularity(d, &pr.location)? as usize)
    }
    fn cuMemAddressReserve(ptr: *mut CUdeviceptr, size: usize, alignment: usize, addr: CUdeviceptr, flags: u64) {
        let d = driver()?;
        nn(ptr)?;
        if flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let p = mem::address_reserve(d, size as u64, alignment as u64, addr)?;
        out!(ptr, p)
    }
    fn cuMemAddressFree(ptr: CUdeviceptr, size: usize) {
        mem::address_free(driver()?, ptr, size as u64)
    }
    fn cuMemCreate(handle: *mut CUmemGenericAllocationHandle, size: usize, prop: *const CUmemAllocationProp, flags: u64) {
        let d = driver()?;
        nn(handle)?;
        if flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let h = mem::vmm_create(d, size as u64, &inp!(prop)?)?;
        out!(handle, h)
    }
    fn cuMemRelease(handle: CUmemGenericAllocationHandle) {
        mem::vmm_release(driver()?, handle)
    }
    fn cuMemMap(ptr: CUdeviceptr, size: usize, offset: usize, handle: CUmemGenericAllocationHandle, flags: u64) {
        if flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        mem::vmm_map(driver()?, ptr, size as u64, offset as u64, handle)
    }
    fn cuMemUnmap(ptr: CUdeviceptr, size: usize) {
        mem::vmm_unmap(driver()?, ptr, size as u64)
    }
    fn cuMemSetAccess(ptr: CUdeviceptr, size: usize, desc: *const CUmemAccessDesc, count: usize) {
        let d = driver()?;
        if count == 0 || desc.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: the API contract: `desc` points to `count` descriptors.
        let descs = unsafe { std::slice::from_raw_parts(desc, count) };
        let mut prot = libc::PROT_NONE;
        for ds in descs {
            d.device(ds.location.id)?;
            prot |= match ds.flags {
                0 => libc::PROT_NONE,
                1 => libc::PROT_READ,
                3 => libc::PROT_READ | libc::PROT_WRITE,
                _ => return Err(CUDA_ERROR_INVALID_VALUE),
            };
        }
        mem::vmm_set_access(d, ptr, size as u64, prot)
    }
    fn cuMemGetAccess(flags: *mut u64, location: *const CUmemLocation, ptr: CUdeviceptr) {
        let d = driver()?;
        let _: CUmemLocation = inp!(location)?;
        out!(flags, u64::from(mem::vmm_get_access(d, ptr)?))
    }
    fn cuMemRetainAllocationHandle(handle: *mut CUmemGenericAllocationHandle, addr: *mut c_void) {
        let d = driver()?;
        nn(handle)?;
        out!(handle, mem::vmm_retain(d, addr as usize as u64)?)
    }
    fn cuMemExportToShareableHandle(shareableHandle: *mut c_void, handle: CUmemGenericAllocationHandle, handleType: c_uint, flags: u64) {
        let d = driver()?;
        nn(shareableHandle)?;
        if flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        match crate::ipc::export(d, handle, handleType)? {
            crate::ipc::Exported::Fd(fd) => out!(shareableHandle as *mut c_int, fd),
            crate::ipc::Exported::Fabric(b) => out!(shareableHandle as *mut [u8; CU_IPC_HANDLE_SIZE], b),
        }
    }
    fn cuMemImportFromShareableHandle(handle: *mut CUmemGenericAllocationHandle, osHandle: *mut c_void, shHandleType: c_uint) {
        let d = driver()?;
        nn(handle)?;
        let h = match shHandleType {
            // The descriptor itself, cast to a pointer (as cuda.h documents).
            CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR => {
                let fd = i32::try_from(osHandle as usize).map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
                crate::ipc::import(d, Some(fd), None)?
            }
            CU_MEM_HANDLE_TYPE_FABRIC => {
                let b: [u8; CU_IPC_HANDLE_SIZE] = inp!(osHandle as *const [u8; CU_IPC_HANDLE_SIZE])?;
                crate::ipc::import(d, None, Some(&b))?
            }
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        };
        out!(handle, h)
    }
    fn cuMemGetAllocationPropertiesFromHandle(prop: *mut CUmemAllocationProp, handle: CUmemGenericAllocationHandle) {
        let d = driver()?;
        let (location, handle_types, _) = mem::vmm_props(d, handle)?;
        out!(prop, CUmemAllocationProp {
            type_: CU_MEM_ALLOCATION_TYPE_PINNED,
            requestedHandleTypes: handle_types,
            location,
            win32HandleMetaData: std::ptr::null_mut(),
            allocFlags: [0; 8],
        })
    }
}

// ---- memory shared between processes ---------------------------------------------------

export! {
    fn cuIpcGetMemHandle(pHandle: *mut CUipcMemHandle, dptr: CUdeviceptr) {
        let d = driver()?;
        nn(pHandle)?;
        out!(pHandle, crate::ipc::get(d, dptr)?)
    }
    fn cuIpcOpenMemHandle_v2 [cuIpcOpenMemHandle] (pdptr: *mut CUdeviceptr, handle: CUipcMemHandle, Flags: c_uint) {
        let (d, c) = cur()?;
        nn(pdptr)?;
        out!(pdptr, crate::ipc::open(d, c.id, &handle, Flags)?)
    }
    fn cuIpcCloseMemHandle(dptr: CUdeviceptr) {
        crate::ipc::close(driver()?, dptr)
    }
}

// ---- arrays ----------------------------------------------------------------------------------

export! {
    fn cuArrayCreate_v2(pHandle: *mut CUarray, desc: *const CUDA_ARRAY_DESCRIPTOR) {
        let (d, c) = cur()?;
        nn(pHandle)?;
        let a = inp!(desc)?;
        let d3 = CUDA_ARRAY3D_DESCRIPTOR { Width: a.Width, Height: a.Height, Depth: 0, Format: a.Format, NumChannels: a.NumChannels, Flags: 0 };
        out!(pHandle, to_ptr(mem::array_create(d, c.dev, d3, 0)?))
    }
    fn cuArray3DCreate_v2(pHandle: *mut CUarray, desc: *const CUDA_ARRAY3D_DESCRIPTOR) {
        let (d, c) = cur()?;
        nn(pHandle)?;
        out!(pHandle, to_ptr(mem::array_create(d, c.dev, inp!(desc)?, 0)?))
    }
    fn cuMipmappedArrayCreate(pHandle: *mut CUmipmappedArray, desc: *const CUDA_ARRAY3D_DESCRIPTOR, numMipmapLevels: c_uint) {
        let (d, c) = cur()?;
        nn(pHandle)?;
        if numMipmapLevels == 0 || numMipmapLevels > 32 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        out!(pHandle, to_ptr(mem::array_create(d, c.dev, inp!(desc)?, numMipmapLevels)?))
    }
    fn cuMipmappedArrayGetLevel(pLevelArray: *mut CUarray, hMipmappedArray: CUmipmappedArray, level: c_uint) {
        let d = driver()?;
        let a = mem::array(d, from_ptr(hMipmappedArray, Kind::Array)?)?;
        let l = a.levels.get(level as usize).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        out!(pLevelArray, to_ptr(*l))
    }
    fn cuArrayDestroy [cuMipmappedArrayDestroy] (hArray: CUarray) {
        let d = driver()?;
        mem::array_destroy(d, from_ptr(hArray, Kind::Array)?)
    }
    fn cuArrayGetDescriptor_v2(pDesc: *mut CUDA_ARRAY_DESCRIPTOR, hArray: CUarray) {
        let d = driver()?;
        let a = mem::array(d, from_ptr(hArray, Kind::Array)?)?;
        out!(pDesc, CUDA_ARRAY_DESCRIPTOR { Width: a.desc.Width, Height: a.desc.Height, Format: a.desc.Format, NumChannels: a.desc.NumChannels })
    }
    fn cuArray3DGetDescriptor_v2(pDesc: *mut CUDA_ARRAY3D_DESCRIPTOR, hArray: CUarray) {
        let d = driver()?;
        let a = mem::array(d, from_ptr(hArray, Kind::Array)?)?;
        out!(pDesc, a.desc)
    }
}

// ---- streams and events ----------------------------------------------------------------------

export! {
    fn cuStreamCreate(phStream: *mut CUstream, flags: c_uint) {
        let (d, c) = cur()?;
        nn(phStream)?;
        if flags & !1 != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let s = Stream::new(c.id, c.dev, flags, 0);
        let id = s.id;
        d.objects().streams.insert(id, s);
        out!(phStream, to_ptr(id))
    }
    fn cuStreamCreateWithPriority(phStream: *mut CUstream, flags: c_uint, priority: c_int) {
        let (d, c) = cur()?;
        nn(phStream)?;
        if flags & !1 != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let s = Stream::new(c.id, c.dev, flags, priority.clamp(-5, 0));
        let id = s.id;
        d.objects().streams.insert(id, s);
        out!(phStream, to_ptr(id))
    }
    fn cuStreamDestroy_v2 [cuStreamDestroy] (hStream: CUstream) {
        let d = driver()?;
        let id = from_ptr(hStream, Kind::Stream)?;
        // Destroying returns at once; queued work still completes (it is in the FIFO).
        d.objects().streams.remove(&id).map(|_| ()).ok_or(CUDA_ERROR_INVALID_HANDLE)
    }
    fn cuStreamSynchronize [cuStreamSynchronize_ptsz] (hStream: CUstream) {
        let (d, s) = stream(hStream)?;
        s.synchronize(d)
    }
    fn cuStreamQuery [cuStreamQuery_ptsz] (hStream: CUstream) {
        let (d, s) = stream(hStream)?;
        s.query(d)
    }
    fn cuStreamGetPriority [cuStreamGetPriority_ptsz] (hStream: CUstream, priority: *mut c_int) {
        let (_, s) = stream(hStream)?;
        out!(priority, s.priority)
    }
    fn cuStreamGetFlags [cuStreamGetFlags_ptsz] (hStream: CUstream, flags: *mut c_uint) {
        let (_, s) = stream(hStream)?;
        out!(flags, s.flags)
    }
    fn cuStreamGetId [cuStreamGetId_ptsz] (hStream: CUstream, streamId: *mut u64) {
        let (_, s) = stream(hStream)?;
        out!(streamId, s.id >> 8)
    }
    fn cuStreamGetCtx [cuStreamGetCtx_ptsz] (hStream: CUstream, pctx: *mut CUcontext) {
        let (_, s) = stream(hStream)?;
        out!(pctx, to_ptr(s.ctx))
    }
    fn cuStreamGetCtx_v2 [cuStreamGetCtx_v2_ptsz] (hStream: CUstream, pctx: *mut CUcontext, pGreenCtx: *mut *mut c_void) {
        let (_, s) = stream(hStream)?;
        if !pGreenCtx.is_null() {
            out!(pGreenCtx, std::ptr::null_mut())?;
        }
        out!(pctx, to_ptr(s.ctx))
    }
    fn cuStreamWaitEvent [cuStreamWaitEvent_ptsz] (hStream: CUstream, hEvent: CUevent, flags: c_uint) {
        let (d, s) = stream(hStream)?;
        let e = event(d, hEvent)?;
        let _ = flags;
        match e.wait_point() {
            // Same device: the FIFO already orders the record before this point.
            Some((dev, seq)) if dev != s.dev => s.enqueue(d, Work::WaitOther { dev, seq }),
            _ => Ok(()),
        }
    }
    fn cuStreamWaitValue32_v2 [cuStreamWaitValue32_v2_ptsz, cuStreamWaitValue32, cuStreamWaitValue32_ptsz] (stream_: CUstream, addr: CUdeviceptr, value: u32, flags: c_uint) {
        stream_wait_value(stream_, addr, u64::from(value), flags, false)
    }
    fn cuStreamWaitValue64_v2 [cuStreamWaitValue64_v2_ptsz, cuStreamWaitValue64, cuStreamWaitValue64_ptsz] (stream_: CUstream, addr: CUdeviceptr, value: u64, flags: c_uint) {
        stream_wait_value(stream_, addr, value, flags, true)
    }
    fn cuStreamWriteValue32_v2 [cuStreamWriteValue32_v2_ptsz] (stream_: CUstream, addr: CUdeviceptr, value: u32, flags: c_uint) {
        stream_write_value(stream_, addr, u64::from(value), flags, false, true)
    }
    fn cuStreamWriteValue32 [cuStreamWriteValue32_ptsz] (stream_: CUstream, addr: CUdeviceptr, value: u32, flags: c_uint) {
        stream_write_value(stream_, addr, u64::from(value), flags, false, false)
    }
    fn cuStreamWriteValue64_v2 [cuStreamWriteValue64_v2_ptsz] (stream_: CUstream, addr: CUdeviceptr, value: u64, flags: c_uint) {
        stream_write_value(stream_, addr, value, flags, true, true)
    }
    fn cuStreamWriteValue64 [cuStreamWriteValue64_ptsz] (stream_: CUstream, addr: CUdeviceptr, value: u64, flags: c_uint) {
        stream_write_value(stream_, addr, value, flags, true, false)
    }
    fn cuStreamBatchMemOp_v2 [cuStreamBatchMemOp_v2_ptsz] (stream_: CUstream, count: c_uint, paramArray: *mut CUstreamBatchMemOpParams, flags: c_uint) {
        stream_batch_mem_op(stream_, count, paramArray, flags, true)
    }
    fn cuStreamBatchMemOp [cuStreamBatchMemOp_ptsz] (stream_: CUstream, count: c_uint, paramArray: *mut CUstreamBatchMemOpParams, flags: c_uint) {
        stream_batch_mem_op(stream_, count, paramArray, flags, false)
    }
    fn cuStreamAddCallback [cuStreamAddCallback_ptsz] (hStream: CUstream, callback: CUstreamCallback, userData: *mut c_void, flags: c_uint) {
        let (d, s) = stream(hStream)?;
        let f = callback.ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        s.enqueue(d, Work::Callback { f: f as usize, stream: hStream as usize, data: userData as usize })
    }
    fn cuLaunchHostFunc [cuLaunchHostFunc_ptsz] (hStream: CUstream, fn_: CUhostFn, userData: *mut c_void) {
        let (d, s) = stream(hStream)?;
        let f = fn_.ok_or(CUDA_ERROR_INVALID_VALUE)?;
        s.enqueue(d, Work::Host { f: f as usize, data: userData as usize })
    }

    fn cuEventCreate(phEvent: *mut CUevent, flags: c_uint) {
        let (d, _) = cur()?;
        nn(phEvent)?;
        if flags & !0x7 != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let e = Event::new(flags);
        let id = e.id;
        d.objects().events.insert(id, e);
        out!(phEvent, to_ptr(id))
    }
    fn cuEventDestroy_v2 [cuEventDestroy] (hEvent: CUevent) {
        let d = driver()?;
        let id = from_ptr(hEvent, Kind::Event)?;
        d.objects().events.remove(&id).map(|_| ()).ok_or(CUDA_ERROR_INVALID_HANDLE)
    }
    fn cuEventRecord [cuEventRecord_ptsz] (hEvent: CUevent, hStream: CUstream) {
        let (d, s) = stream(hStream)?;
        event(d, hEvent)?.record(d, &s, false)
    }
    fn cuEventRecordWithFlags [cuEventRecordWithFlags_ptsz] (hEvent: CUevent, hStream: CUstream, flags: c_uint) {
        let (d, s) = stream(hStream)?;
        // CU_EVENT_RECORD_DEFAULT 0, CU_EVENT_RECORD_EXTERNAL 1.
        if flags > 1 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        event(d, hEvent)?.record(d, &s, flags == 1)
    }
    fn cuEventQuery(hEvent: CUevent) {
        let d = driver()?;
        event(d, hEvent)?.query(d)
    }
    fn cuEventSynchronize(hEvent: CUevent) {
        let d = driver()?;
        event(d, hEvent)?.synchronize(d)
    }
    fn cuEventElapsedTime [cuEventElapsedTime_v2] (pMilliseconds: *mut f32, hStart: CUevent, hEnd: CUevent) {
        let d = driver()?;
        nn(pMilliseconds)?;
        let (a, b) = (event(d, hStart)?, event(d, hEnd)?);
        let ms = Event::elapsed_ms(d, &a, &b)?;
        out!(pMilliseconds, ms)
    }
}

// ---- modules, libraries, functions -------------------------------------------------------------

fn load_module(ctx: u64, image: &[u8]) -> CuResult<u64> {
    let d = driver()?;
    let (entries, v) = module::parse_image(image)?;
    let (m, funcs) = module::build(ctx, entries, v);
    let id = m.id;
    let mut o = d.objects();
    for f in funcs {
        o.funcs.insert(f.id, Arc::new(f));
    }
    o.modules.insert(id, Arc::new(m));
    Ok(id)
}

/// Reads a NUL-terminated PTX image (bounded to 256 MiB).
fn image_bytes<'a>(image: *const c_void) -> CuResult<&'a [u8]> {
    if image.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let p = image.cast::<u8>();
    // ELF and fatbin images start with a magic number; look at the first 8 bytes only.
    // SAFETY: every image format CUDA accepts is at least 8 bytes long.
    let head = unsafe { std::slice::from_raw_parts(p, 8) };
    if head.starts_with(b"\x7fELF") || head.starts_with(&0xBA55_ED50u32.to_le_bytes()) {
        return Ok(head);
    }
    // SAFETY: PTX images are NUL-terminated text per the API contract.
    Ok(unsafe { CStr::from_ptr(p.cast()) }.to_bytes())
}

fn unload_module(id: u64) -> CuResult<()> {
    let d = driver()?;
    let mut o = d.objects();
    let m = o.modules.remove(&id).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
    for (_, f) in &m.funcs {
        o.funcs.remove(f);
    }
    Ok(())
}

export! {
    fn cuModuleLoadData(module: *mut CUmodule, image: *const c_void) {
        let (_, c) = cur()?;
        nn(module)?;
        out!(module, to_ptr(load_module(c.id, image_bytes(image)?)?))
    }
    fn cuModuleLoadDataEx(module: *mut CUmodule, image: *const c_void, numOptions: c_uint, options: *mut c_int, optionValues: *mut *mut c_void) {
        let (_, c) = cur()?;
        nn(module)?;
        let _ = (numOptions, options, optionValues);
        out!(module, to_ptr(load_module(c.id, image_bytes(image)?)?))
    }
    fn cuModuleLoad(module: *mut CUmodule, fname: *const c_char) {
        let (_, c) = cur()?;
        nn(module)?;
        let path = cstr(fname)?;
        let bytes = std::fs::read(path).map_err(|_| CUDA_ERROR_FILE_NOT_FOUND)?;
        out!(module, to_ptr(load_module(c.id, &bytes)?))
    }
    fn cuModuleLoadFatBinary(module: *mut CUmodule, fatCubin: *const c_void) {
        let _ = (module, fatCubin);
        cur()?;
        Err(CUDA_ERROR_NO_BINARY_FOR_GPU)
    }
    fn cuModuleUnload(hmod: CUmodule) {
        unload_module(from_ptr(hmod, Kind::Module)?)
    }
    fn cuModuleGetFunction(hfunc: *mut CUfunction, hmod: CUmodule, name: *const c_char) {
        let d = driver()?;
        nn(hfunc)?;
        let id = from_ptr(hmod, Kind::Module)?;
        let name = cstr(name)?;
        let m = d.objects().modules.get(&id).cloned().ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        let f = m.funcs.iter().find(|(n, _)| n == name).ok_or(CUDA_ERROR_NOT_FOUND)?;
        out!(hfunc, to_ptr(f.1))
    }
    fn cuModuleGetFunctionCount(count: *mut c_uint, hmod: CUmodule) {
        let d = driver()?;
        let m = d.objects().modules.get(&from_ptr(hmod, Kind::Module)?).cloned().ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        out!(count, m.funcs.len() as c_uint)
    }
    fn cuModuleGetGlobal_v2(dptr: *mut CUdeviceptr, bytes: *mut usize, hmod: CUmodule, name: *const c_char) {
        let d = driver()?;
        d.objects().modules.get(&from_ptr(hmod, Kind::Module)?).cloned().ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        let _ = (dptr, bytes, cstr(name)?);
        // Module globals are not simulated.
        Err(CUDA_ERROR_NOT_FOUND)
    }
    fn cuModuleGetLoadingMode(mode: *mut c_int) {
        out!(mode, 2) // CU_MODULE_EAGER_LOADING
    }
    fn cuLibraryLoadData(library: *mut CUlibrary, code: *const c_void, jitOptions: *mut c_int, jitOptionsValues: *mut *mut c_void, numJitOptions: c_uint, libraryOptions: *mut c_int, libraryOptionValues: *mut *mut c_void, numLibraryOptions: c_uint) {
        driver()?;
        nn(library)?;
        let _ = (jitOptions, jitOptionsValues, numJitOptions, libraryOptions, libraryOptionValues, numLibraryOptions);
        out!(library, to_ptr(load_module(0, image_bytes(code)?)?))
    }
    fn cuLibraryUnload(library: CUlibrary) {
        unload_module(from_ptr(library, Kind::Module)?)
    }
    fn cuLibraryGetKernel(pKernel: *mut CUkernel, library: CUlibrary, name: *const c_char) {
        // SAFETY: same argument contract as cuModuleGetFunction.
        let r = unsafe { cuModuleGetFunction(pKernel, library, name) };
        if r == CUDA_SUCCESS { Ok(()) } else { Err(r) }
    }
    fn cuLibraryGetModule(pMod: *mut CUmodule, library: CUlibrary) {
        let d = driver()?;
        let id = from_ptr(library, Kind::Module)?;
        d.objects().modules.get(&id).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        out!(pMod, to_ptr(id))
    }
    fn cuKernelGetFunction(pFunc: *mut CUfunction, kernel: CUkernel) {
        let d = driver()?;
        d.current()?;
        let id = from_ptr(kernel, Kind::Func)?;
        d.objects().funcs.get(&id).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        out!(pFunc, to_ptr(id))
    }
    fn cuFuncGetAttribute(pi: *mut c_int, attrib: c_int, hfunc: CUfunction) {
        let d = driver()?;
        let f = d.objects().funcs.get(&from_ptr(hfunc, Kind::Func)?).cloned().ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        let v = match attrib {
            0 => 1024,            // MAX_THREADS_PER_BLOCK
            1..=3 => 0,           // SHARED, CONST, LOCAL sizes
            4 => 32,              // NUM_REGS
            5 => f.ptx_version,   // PTX_VERSION
            6 => 90,              // BINARY_VERSION
            7 => 0,               // CACHE_MODE_CA
            8 => 48 * 1024,       // MAX_DYNAMIC_SHARED_SIZE_BYTES
            9 => -1,              // PREFERRED_SHARED_MEMORY_CARVEOUT
            10..=15 => 0,
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        };
        out!(pi, v)
    }
    fn cuFuncSetAttribute(hfunc: CUfunction, attrib: c_int, value: c_int) {
        let d = driver()?;
        d.objects().funcs.get(&from_ptr(hfunc, Kind::Func)?).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        let _ = value;
        if (0..=15).contains(&attrib) { Ok(()) } else { Err(CUDA_ERROR_INVALID_VALUE) }
    }
    fn cuFuncSetCacheConfig(hfunc: CUfunction, config: c_int) {
        let d = driver()?;
        d.objects().funcs.get(&from_ptr(hfunc, Kind::Func)?).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        if (0..=3).contains(&config) { Ok(()) } else { Err(CUDA_ERROR_INVALID_VALUE) }
    }
    fn cuFuncGetModule(hmod: *mut CUmodule, hfunc: CUfunction) {
        let d = driver()?;
        let f = d.objects().funcs.get(&from_ptr(hfunc, Kind::Func)?).cloned().ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        out!(hmod, to_ptr(f.module))
    }
    fn cuFuncGetName(name: *mut *const c_char, hfunc: CUfunction) {
        let d = driver()?;
        let f = d.objects().funcs.get(&from_ptr(hfunc, Kind::Func)?).cloned().ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        let c = FUNC_NAMES.lock().unwrap_or_else(|p| p.into_inner()).entry(f.id).or_insert_with(|| std::ffi::CString::new(f.name.clone()).unwrap_or_default()).as_ptr();
        out!(name, c)
    }
    fn cuOccupancyMaxActiveBlocksPerMultiprocessor(numBlocks: *mut c_int, func: CUfunction, blockSize: c_int, dynamicSMemSize: usize) {
        let d = driver()?;
        d.objects().funcs.get(&from_ptr(func, Kind::Func)?).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        let _ = dynamicSMemSize;
        if !(1..=1024).contains(&blockSize) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        out!(numBlocks, (2048 / blockSize).clamp(1, 32))
    }
}

static FUNC_NAMES: std::sync::Mutex<std::collections::BTreeMap<u64, std::ffi::CString>> =
    std::sync::Mutex::new(std::collections::BTreeMap::new());

// ---- launches --------------------------------------------------------------------------------

/// Reads the kernel's parameter bytes: from `kernelParams` (one pointer per parameter)
/// or from the `extra` buffer protocol.
fn first_params(
    f: &module::Function,
    kernel_params: *mut *mut c_void,
    extra: *mut *mut c_void,
    want: usize,
) -> CuResult<Vec<u64>> {
    let n = f.params.len().min(want);
    let mut out = Vec::with_capacity(n);
    if !kernel_params.is_null() {
        for (i, &size) in f.params.iter().take(n).enumerate() {
            // SAFETY: the API contract: kernelParams holds one valid pointer per
            // parameter, each pointing to that parameter's value.
            let p = unsafe { *kernel_params.add(i) };
            if p.is_null() {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            let mut buf = [0u8; 8];
            // SAFETY: as above; at most 8 bytes of a parameter of `size` bytes.
            unsafe { std::ptr::copy_nonoverlapping(p.cast::<u8>(), buf.as_mut_ptr(), size.min(8)) };
            out.push(u64::from_le_bytes(buf));
        }
        return Ok(out);
    }
    if extra.is_null() {
        return if n == 0 {
            Ok(out)
        } else {
            Err(CUDA_ERROR_INVALID_VALUE)
        };
    }
    let (mut buf, mut len) = (std::ptr::null::<u8>(), 0usize);
    for i in (0..64).step_by(2) {
        // SAFETY: `extra` is a CU_LAUNCH_PARAM_END-terminated list of (key, value) pairs.
        let key = unsafe { *extra.add(i) } as usize;
        match key {
            0 => break,
            // SAFETY: as above; the value follows its key.
            1 => buf = unsafe { *extra.add(i + 1) }.cast(),
            // SAFETY: as above; the size value points to a size_t.
            2 => len = unsafe { *(*extra.add(i + 1)).cast::<usize>() },
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        }
    }
    if buf.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let mut off = 0usize;
    for &size in f.params.iter().take(n) {
        off = off.next_multiple_of(size.clamp(1, 8));
        if off + size > len {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut b = [0u8; 8];
        // SAFETY: within the `len` bytes of the packed buffer (checked).
        unsafe { std::ptr::copy_nonoverlapping(buf.add(off), b.as_mut_ptr(), size.min(8)) };
        out.push(u64::from_le_bytes(b));
        off += size;
    }
    Ok(out)
}

fn launch(
    f: CUfunction,
    g: Geometry,
    s: CUstream,
    kernel_params: *mut *mut c_void,
    extra: *mut *mut c_void,
    cooperative: bool,
) -> CuResult<()> {
    let (d, st) = stream(s)?;
    let func = d
        .objects()
        .funcs
        .get(&from_ptr(f, Kind::Func)?)
        .cloned()
        .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
    module::check_geometry(&g)?;
    d.check_alive(st.dev)?;
    let sm = d.state.info(st.dev).sm_count;
    if cooperative && !module::cooperative_fits(&g, sm) {
        return Err(CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE);
    }
    let work = if func.name == SPIN && func.params.first() == Some(&8) {
        let p = first_params(&func, kernel_params, extra, 1)?;
        Work::Kernel { ns: p[0] }
    } else if func.name == FILL && func.params == [8, 4, 8] {
        let p = first_params(&func, kernel_params, extra, 3)?;
        let (ptr, value, count) = (p[0], p[1] as u32, p[2]);
        let bytes = count.checked_mul(4).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        mem::check_device_range(&d.objects(), ptr, bytes.max(1))
            .map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
        let ns =
            module::cost_ns(&g, sm) + bytes / u64::from(d.state.info(st.dev).bandwidth_gbps.max(1));
        let fill = Work::Memset {
            dst: ptr as usize,
            pitch: 0,
            elem: 4,
            value,
            width: count as usize,
            height: 1,
        };
        Work::Batch(Arc::new(vec![Work::Kernel { ns }, fill]))
    } else {
        if kernel_params.is_null() && extra.is_null() && !func.params.is_empty() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        Work::Kernel {
            ns: module::cost_ns(&g, sm),
        }
    };
    st.enqueue(d, work)
}

export! {
    fn cuLaunchKernel [cuLaunchKernel_ptsz] (f: CUfunction, gridDimX: c_uint, gridDimY: c_uint, gridDimZ: c_uint, blockDimX: c_uint, blockDimY: c_uint, blockDimZ: c_uint, sharedMemBytes: c_uint, hStream: CUstream, kernelParams: *mut *mut c_void, extra: *mut *mut c_void) {
        let g = Geometry { grid: [gridDimX, gridDimY, gridDimZ], block: [blockDimX, blockDimY, blockDimZ], shared: sharedMemBytes };
        launch(f, g, hStream, kernelParams, extra, false)
    }
    fn cuLaunchCooperativeKernel [cuLaunchCooperativeKernel_ptsz] (f: CUfunction, gridDimX: c_uint, gridDimY: c_uint, gridDimZ: c_uint, blockDimX: c_uint, blockDimY: c_uint, blockDimZ: c_uint, sharedMemBytes: c_uint, hStream: CUstream, kernelParams: *mut *mut c_void) {
        let g = Geometry { grid: [gridDimX, gridDimY, gridDimZ], block: [blockDimX, blockDimY, blockDimZ], shared: sharedMemBytes };
        launch(f, g, hStream, kernelParams, std::ptr::null_mut(), true)
    }
    fn cuLaunchKernelEx [cuLaunchKernelEx_ptsz] (config: *const CUlaunchConfig, f: CUfunction, kernelParams: *mut *mut c_void, extra: *mut *mut c_void) {
        let c = inp!(config)?;
        let mut cooperative = false;
        if c.numAttrs > 0 {
            if c.attrs.is_null() {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            // SAFETY: the API contract: `attrs` points to `numAttrs` attributes.
            let attrs = unsafe { std::slice::from_raw_parts(c.attrs, c.numAttrs as usize) };
            cooperative = attrs.iter().any(|a| a.id == CU_LAUNCH_ATTRIBUTE_COOPERATIVE && a.value[0] != 0);
        }
        let g = Geometry { grid: [c.gridDimX, c.gridDimY, c.gridDimZ], block: [c.blockDimX, c.blockDimY, c.blockDimZ], shared: c.sharedMemBytes };
        launch(f, g, c.hStream, kernelParams, extra, cooperative)
    }
}

// ---- graphs (stream capture) -------------------------------------------------------------------

thread_local! {
    /// This thread's stream capture interaction mode (`cuThreadExchangeStreamCaptureMode`;
    /// CU_STREAM_CAPTURE_MODE_GLOBAL by default). Kept and answered; the prohibitions it
    /// selects for other API calls are not simulated, except the device synchronization's
    /// (`refuse_during_capture`), which holds in every mode.
    static CAPTURE_MODE: std::cell::Cell<c_uint> = const { std::cell::Cell::new(0) };
}

/// A synchronization of device `dev` (`cuCtxSynchronize`) while any stream of it is
/// capturing: refused, and every such capture invalidated, whatever thread or capture
/// mode (relaxed included) made it or makes the call. This is CUDA's behaviour as
/// measured on NVIDIA hardware by others (a device synchronization from a second thread
/// invalidated a capture on the same GPU, in global and thread-local mode alike); the
/// driver's documentation only lists it among the unsafe calls.
fn refuse_during_capture(d: &Driver, dev: usize) -> CuResult<()> {
    let streams: Vec<_> = d
        .objects()
        .streams
        .values()
        .filter(|s| s.dev == dev)
        .cloned()
        .collect();
    let mut any = false;
    for s in streams {
        any |= s.invalidate_capture();
    }
    if any {
        return Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    }
    Ok(())
}

fn new_graph(d: &Driver, g: Graph) -> u64 {
    let id = rt::new_handle(Kind::Graph);
    d.objects()
        .graphs
        .insert(id, Arc::new(std::sync::Mutex::new(g)));
    id
}

fn instantiate(d: &Driver, graph: CUgraph) -> CuResult<u64> {
    let g = d
        .objects()
        .graphs
        .get(&from_ptr(graph, Kind::Graph)?)
        .cloned()
        .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
    let snapshot = g.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let id = rt::new_handle(Kind::GraphExec);
    d.objects().graph_execs.insert(id, Arc::new(snapshot));
    Ok(id)
}

export! {
    fn cuStreamBeginCapture [cuStreamBeginCapture_ptsz] (hStream: CUstream) {
        let (_, s) = stream(hStream)?;
        if (hStream as usize) <= CU_STREAM_PER_THREAD {
            return Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
        }
        s.begin_capture(0, None)
    }
    fn cuStreamBeginCapture_v2 [cuStreamBeginCapture_v2_ptsz] (hStream: CUstream, mode: c_uint) {
        let (_, s) = stream(hStream)?;
        if (hStream as usize) <= CU_STREAM_PER_THREAD {
            return Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
        }
        if mode > 2 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        s.begin_capture(mode, None)
    }
    fn cuStreamBeginCaptureToGraph [cuStreamBeginCaptureToGraph_ptsz] (hStream: CUstream, hGraph: CUgraph, dependencies: *const CUgraphNode, dependencyData: *const c_void, numDependencies: usize, mode: c_uint) {
        let (d, s) = stream(hStream)?;
        if (hStream as usize) <= CU_STREAM_PER_THREAD {
            return Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
        }
        if mode > 2 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let id = from_ptr(hGraph, Kind::Graph)?;
        let g = d.objects().graphs.get(&id).cloned().ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        if numDependencies > 0 {
            nn(dependencies)?;
            let nodes = g.lock().unwrap_or_else(|p| p.into_inner()).work.len() as u64;
            for i in 0..numDependencies {
                // SAFETY: the API contract: `dependencies` holds `numDependencies` nodes.
                let node = unsafe { *dependencies.add(i) } as u64;
                // The graph's nodes, as `cuGraphGetNodes` names them. The simulator's
                // graphs run their nodes in order, so a dependency on one of them holds.
                if node & 0xff != Kind::GraphNode as u64 || !(1..=nodes).contains(&(node >> 8)) {
                    return Err(CUDA_ERROR_INVALID_VALUE);
                }
            }
        }
        // Edge data (CUgraphEdgeData) only qualifies the dependencies' edges.
        let _ = dependencyData;
        s.begin_capture(mode, Some(id))
    }
    fn cuStreamEndCapture [cuStreamEndCapture_ptsz] (hStream: CUstream, phGraph: *mut CUgraph) {
        let (d, s) = stream(hStream)?;
        nn(phGraph)?;
        let (work, into) = s.end_capture()?;
        let Some(id) = into else {
            return out!(phGraph, to_ptr(new_graph(d, Graph { work })));
        };
        // A capture begun with `cuStreamBeginCaptureToGraph`: its nodes go after the
        // graph's, and the graph is the one returned.
        let g = d.objects().graphs.get(&id).cloned().ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        g.lock().unwrap_or_else(|p| p.into_inner()).work.extend(work);
        out!(phGraph, to_ptr(id))
    }
    fn cuStreamIsCapturing [cuStreamIsCapturing_ptsz] (hStream: CUstream, captureStatus: *mut c_uint) {
        let (_, s) = stream(hStream)?;
        out!(captureStatus, s.capture_info().0)
    }
    fn cuStreamGetCaptureInfo [cuStreamGetCaptureInfo_ptsz] (hStream: CUstream, captureStatus: *mut c_uint, id: *mut u64) {
        let (_, s) = stream(hStream)?;
        let (st, cid, _) = s.capture_info();
        if !id.is_null() {
            out!(id, cid)?;
        }
        out!(captureStatus, st)
    }
    fn cuStreamGetCaptureInfo_v2 [cuStreamGetCaptureInfo_v2_ptsz] (hStream: CUstream, captureStatus: *mut c_uint, id: *mut u64, graph: *mut CUgraph, deps: *mut *const CUgraphNode, numDeps: *mut usize) {
        let (_, s) = stream(hStream)?;
        let (st, cid, into) = s.capture_info();
        if !id.is_null() {
            out!(id, cid)?;
        }
        if !graph.is_null() {
            // The graph a capture adds to when it was named (`cuStreamBeginCaptureToGraph`);
            // the simulator builds the others' at the end.
            out!(graph, into.map_or(std::ptr::null_mut(), to_ptr))?;
        }
        if !deps.is_null() {
            out!(deps, std::ptr::null())?;
        }
        if !numDeps.is_null() {
            out!(numDeps, 0)?;
        }
        out!(captureStatus, st)
    }
    fn cuGraphCreate(phGraph: *mut CUgraph, flags: c_uint) {
        let d = driver()?;
        nn(phGraph)?;
        if flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        out!(phGraph, to_ptr(new_graph(d, Graph::default())))
    }
    fn cuGraphDestroy(hGraph: CUgraph) {
        let d = driver()?;
        d.objects().graphs.remove(&from_ptr(hGraph, Kind::Graph)?).map(|_| ()).ok_or(CUDA_ERROR_INVALID_HANDLE)
    }
    fn cuGraphGetNodes(hGraph: CUgraph, nodes: *mut CUgraphNode, numNodes: *mut usize) {
        let d = driver()?;
        let g = d.objects().graphs.get(&from_ptr(hGraph, Kind::Graph)?).cloned().ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        let n = g.lock().unwrap_or_else(|p| p.into_inner()).work.len();
        if nodes.is_null() {
            return out!(numNodes, n);
        }
        let cap: usize = inp!(numNodes as *const usize)?;
        for i in 0..cap.min(n) {
            // SAFETY: the API contract: `nodes` has room for `*numNodes` handles.
            unsafe { *nodes.add(i) = to_ptr(((i as u64 + 1) << 8) | Kind::GraphNode as u64) };
        }
        out!(numNodes, cap.min(n))
    }
    fn cuGraphInstantiateWithFlags(phGraphExec: *mut CUgraphExec, hGraph: CUgraph, flags: u64) {
        let d = driver()?;
        nn(phGraphExec)?;
        let _ = flags;
        out!(phGraphExec, to_ptr(instantiate(d, hGraph)?))
    }
    fn cuGraphInstantiate_v2 (phGraphExec: *mut CUgraphExec, hGraph: CUgraph, phErrorNode: *mut CUgraphNode, logBuffer: *mut c_char, bufferSize: usize) {
        let d = driver()?;
        nn(phGraphExec)?;
        let _ = (phErrorNode, logBuffer, bufferSize);
        out!(phGraphExec, to_ptr(instantiate(d, hGraph)?))
    }
    fn cuGraphExecDestroy(hGraphExec: CUgraphExec) {
        let d = driver()?;
        d.objects().graph_execs.remove(&from_ptr(hGraphExec, Kind::GraphExec)?).map(|_| ()).ok_or(CUDA_ERROR_INVALID_HANDLE)
    }
    fn cuGraphLaunch [cuGraphLaunch_ptsz] (hGraphExec: CUgraphExec, hStream: CUstream) {
        let (d, s) = stream(hStream)?;
        let g = d.objects().graph_execs.get(&from_ptr(hGraphExec, Kind::GraphExec)?).cloned().ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        s.enqueue(d, Work::Batch(Arc::new(g.work.clone())))
    }
    fn cuGraphUpload [cuGraphUpload_ptsz] (hGraphExec: CUgraphExec, hStream: CUstream) {
        let (d, _) = stream(hStream)?;
        d.objects().graph_execs.get(&from_ptr(hGraphExec, Kind::GraphExec)?).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        Ok(())
    }
    fn cuThreadExchangeStreamCaptureMode(mode: *mut c_uint) {
        let m: c_uint = inp!(mode as *const c_uint)?;
        if m > 2 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        out!(mode, CAPTURE_MODE.with(|c| c.replace(m)))
    }
}

// ---- checkpoint (CUDA 12.8): another process, by pid (see `checkpoint.rs`) -------------------

/// Fails unless the optional argument struct at `p` has its reserved bytes zeroed.
fn zeroed_reserved<T>(p: *const T, reserved: impl FnOnce(&T) -> &[u8]) -> CuResult<()> {
    if p.is_null() {
        return Ok(());
    }
    // SAFETY: the API contract: a non-null args pointer points to one readable struct.
    let a = unsafe { &*p };
    if reserved(a).iter().all(|&b| b == 0) {
        Ok(())
    } else {
        Err(CUDA_ERROR_INVALID_VALUE)
    }
}

fn u64_bytes(v: &[u64]) -> &[u8] {
    // SAFETY: any initialized u64 slice is readable as bytes, same length × 8, align 1.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), size_of_val(v)) }
}

export! {
    fn cuCheckpointProcessLock(pid: c_int, args: *mut CUcheckpointLockArgs) {
        zeroed_reserved(args.cast_const(), |a| u64_bytes(&a.reserved1))?;
        let a: Option<CUcheckpointLockArgs> =
            if args.is_null() { None } else { Some(inp!(args.cast_const())?) };
        if a.is_some_and(|a| a.reserved0 != 0) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let timeout = a.map_or(0, |a| a.timeoutMs);
        crate::checkpoint::control(pid, CkptOp::Lock, timeout)
    }
    fn cuCheckpointProcessCheckpoint(pid: c_int, args: *mut CUcheckpointCheckpointArgs) {
        zeroed_reserved(args.cast_const(), |a| &a.reserved)?;
        if !args.is_null() && !inp!(args.cast_const())?.customStorageInfo_out.is_null() {
            // Custom storage (CUDA 13) is not simulated: memory goes to host memory.
            return Err(CUDA_ERROR_NOT_SUPPORTED);
        }
        crate::checkpoint::control(pid, CkptOp::Checkpoint, 0)
    }
    fn cuCheckpointProcessRestore(pid: c_int, args: *mut CUcheckpointRestoreArgs) {
        zeroed_reserved(args.cast_const(), |a| &a.reserved)?;
        if !args.is_null() {
            let a: CUcheckpointRestoreArgs = inp!(args.cast_const())?;
            if !a.customStorageInfo_out.is_null() {
                return Err(CUDA_ERROR_NOT_SUPPORTED);
            }
            if a.gpuPairsCount > 0 {
                if a.gpuPairs.is_null() {
                    return Err(CUDA_ERROR_INVALID_VALUE);
                }
                // SAFETY: the API contract: `gpuPairs` points to `gpuPairsCount` pairs.
                let pairs = unsafe { std::slice::from_raw_parts(a.gpuPairs, a.gpuPairsCount as usize) };
                // Restoring onto another GPU is not simulated; a pair naming the same GPU is.
                if pairs.iter().any(|p| p.oldUuid.bytes != p.newUuid.bytes) {
                    return Err(CUDA_ERROR_NOT_SUPPORTED);
                }
            }
        }
        crate::checkpoint::control(pid, CkptOp::Restore, 0)
    }
    fn cuCheckpointProcessUnlock(pid: c_int, args: *mut CUcheckpointUnlockArgs) {
        zeroed_reserved(args.cast_const(), |a| u64_bytes(&a.reserved))?;
        crate::checkpoint::control(pid, CkptOp::Unlock, 0)
    }
    fn cuCheckpointProcessGetState(pid: c_int, state: *mut c_uint) {
        nn(state)?;
        out!(state, crate::checkpoint::state_of(pid)?)
    }
    fn cuCheckpointProcessGetRestoreThreadId(pid: c_int, tid: *mut c_int) {
        nn(tid)?;
        out!(tid, crate::checkpoint::restore_thread(pid)?)
    }
}

// ---- entry-point lookup ------------------------------------------------------------------------

export! {
    fn cuGetExportTable(ppExportTable: *mut *const c_void, pExportTableId: *const CUuuid) {
        // The runtime's private export tables are NVIDIA-internal and not simulated.
        let _ = (ppExportTable, pExportTableId);
        Err(CUDA_ERROR_NOT_SUPPORTED)
    }
    fn cuProfilerStart() {
        Ok(())
    }
    fn cuProfilerStop() {
        Ok(())
    }
}
