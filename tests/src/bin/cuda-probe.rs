//! `cuda-probe`: a small scripted CUDA driver API and NVML client, for tests that need
//! real processes using a GPU (the simulated one, or a real one).
//!
//! It loads `libcuda.so.1` and `libnvidia-ml.so.1` by name with `dlopen` (so
//! `LD_LIBRARY_PATH` and `LD_PRELOAD` decide what it gets, exactly as for any CUDA
//! program), resolves entry points by their exported names, and runs its arguments as a
//! script, printing `key=value` results:
//!
//! ```text
//! init                         cuInit, retain device 0's primary context, make it current
//! device N                     use device N for what follows (before init)
//! meminfo                      free= total=
//! alloc BYTES                  alloc=ok|err code=   (keeps the allocation)
//! alloc-until-oom CHUNK        allocations= allocated= code=  (keeps them)
//! free-all                     frees everything allocated so far (every API)
//! roundtrip BYTES              roundtrip=ok after copying a pattern to the device and back
//! saturate SECS KERNEL_NS AT   from unix time AT (ms; 0 = now) for SECS seconds keep the GPU
//!                              busy with spin kernels, 4 in flight; kernels= device_ns=
//! load SECS KERNEL_NS AT BATCH  like saturate, BATCH kernels per event (4 events in
//!                              flight): saturates even with short kernels
//! latency N KERNEL_NS PERIOD_US AT
//!                              N requests, one every PERIOD_US: launch one kernel, wait
//!                              for it; lat_p50_us= lat_p99_us= lat_max_us= (wall)
//! spin PATH N KERNEL_NS        N kernels through launch path PATH (kernel, kernel-ptsz,
//!                              ex, ex-ptsz, coop, coop-ptsz, graph, graph-ptsz), then
//!                              synchronize; spin=ok wall_us=
//! capture N KERNEL_NS PAUSE_MS  N kernels on a stream, synchronized; then a capture
//!                              (global mode) on another stream of N kernels with a
//!                              pause of PAUSE_MS in it, ended, and its graph launched
//!                              and synchronized: capture=ok|err code= graph=ok wall_us=
//! capture-to-graph N KERNEL_NS PAUSE_MS
//!                              the same, the capture begun with
//!                              cuStreamBeginCaptureToGraph into a graph made first
//!                              (cuGraphCreate); also graph_same=0|1: the capture's graph
//!                              is the one named
//! memop-gate N KERNEL_NS        stream memory operations (device-side gating's footing,
//!                              ADR 0034): host ns per launch plain and after a stream
//!                              wait, whether a waiting stream holds, how soon it goes
//!                              on: plain_launch_ns= gated_launch_ns= held=K/20
//!                              open_p50_us= open_max_us= (and wall times)
//! memop-block MS               a stream waits on a word nobody writes, a kernel before
//!                              and one behind it, for MS ms: blocked=ok, released=ok
//! capture-open                 begins a capture (relaxed mode) on a new stream and
//!                              leaves it open for the rest of the run: capture_open=ok
//! nvml                         nvml_used= nvml_total= procs=pid:bytes,...
//! route dlsym|global|procaddr|procaddr-ptds
//!                              how entry points are resolved (before init): dlsym on the
//!                              driver's handle (default), the global scope (as a linked
//!                              program binds), or cuGetProcAddress_v2 (CUDA 13.0; -ptds:
//!                              with the per-thread-default-stream flag)
//! alloc-api API BYTES          alloc=ok|err code= with API mem, pitch, managed, async,
//!                              pool, vmm, array, array3d or mipmap (kept)
//! until-oom API CHUNK          allocations= allocated= code= with that API (kept)
//! totalmem                     totalmem= (cuDeviceTotalMem_v2)
//! procaddr NAME VERSION FLAGS  procaddr_NAME=<address> code= status= (cuGetProcAddress_v2)
//! symaddr NAME                 symaddr_NAME=<address> in the global scope (0: none)
//! ctx-create                   cuCtxCreate on the device (current from then on)
//! ctx-destroy                  destroys the last created context (and what it holds);
//!                              the primary context is current again
//! primary-release              releases the primary context (and what it holds)
//! pool-create                  cuMemPoolCreate on the device: `alloc-api pool` and the
//!                              pool commands use it from then on (default: the
//!                              device's default pool)
//! pool-threshold BYTES|max     sets the pool's CU_MEMPOOL_ATTR_RELEASE_THRESHOLD
//! pool-trim BYTES              cuMemPoolTrimTo(pool, BYTES)
//! pool-destroy                 cuMemPoolDestroy of the created pool
//! pool-info                    pool_reserved= pool_used= (the driver's current figures)
//! free-async-all               cuMemFreeAsync of every async/pool allocation kept, on
//!                              the legacy stream, without synchronising
//! sync                         cuStreamSynchronize(legacy stream)
//! ctx-sync                     cuCtxSynchronize
//! dlmopen-alloc BYTES          (after `init`, the process admitted and registered by
//!                              the shim, or without it): loads a second driver with
//!                              dlmopen(LM_ID_NEWLM, "libcuda.so.1", RTLD_NOW), resolves
//!                              cuInit, cuDeviceGet, cuCtxCreate_v2 and cuMemAlloc_v2 on
//!                              that handle (the shim's hooks are not in that namespace)
//!                              and allocates BYTES there on the probe's device, kept:
//!                              dlmopen_alloc=ok|err code= ptr= driver_loads= (the
//!                              driver's loads in /proc/self/maps); follow with `wait`
//!                              or `sleep` to hold it (issue 39 item 3)
//! fill BYTES SEED / verify / ckpt OP PID [MS] / timed-meminfo
//!                              the checkpoint API from both sides (`cuda-probe/checkpoint.rs`)
//! ready                        prints "ready pid=<pid>"
//! wait                         blocks until stdin is closed
//! sleep MS                     sleeps
//! at UNIX_MS                   sleeps until that time (a start barrier for races)
//! ```

// The probe calls C entry points resolved with dlopen/dlsym; each block says why the
// call matches its C signature.
#![allow(unsafe_code)]

use std::collections::VecDeque;
use std::ffi::{c_char, c_int, c_uint, c_void};
use std::io::{Read, Write};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};
use libloading::{Library, Symbol};
use vgpu_cuda_abi::cuda::{CUlaunchConfig, attr};
use vgpu_cuda_abi::fns;
use vgpu_cuda_sim::bench::SPIN_PTX;

type CuResult = c_uint;

#[path = "cuda-probe/memops.rs"]
mod memops;

#[path = "cuda-probe/checkpoint.rs"]
mod checkpoint;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Route {
    Dlsym,
    Global,
    ProcAddr,
    /// `cuGetProcAddress_v2` with `CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM`.
    ProcAddrPtds,
}

struct Cuda {
    lib: Library,
    route: Route,
}

impl Cuda {
    /// Resolves `name` by the probe's route: `dlsym` on the driver's handle (the
    /// default), the global scope (as a program linked against libcuda binds), or
    /// `cuGetProcAddress_v2` (base name without `_v2`, CUDA 13.0, no flags).
    fn sym<T: Copy>(&self, name: &str) -> Result<T> {
        const { assert!(size_of::<T>() == size_of::<usize>()) };
        let p: usize = match self.route {
            Route::Dlsym => {
                // SAFETY: the caller names a CUDA driver entry point with its C signature.
                let s: Symbol<'_, usize> = unsafe { self.lib.get(name.as_bytes()) }
                    .with_context(|| format!("resolve {name}"))?;
                // SAFETY: reading the symbol's address, not calling it.
                unsafe { s.into_raw().into_raw() as usize }
            }
            Route::Global => {
                let this = libloading::os::unix::Library::this();
                // SAFETY: as above.
                let s: libloading::os::unix::Symbol<usize> =
                    unsafe { this.get(name.as_bytes()) }
                        .with_context(|| format!("resolve {name} in the global scope"))?;
                s.into_raw() as usize
            }
            Route::ProcAddr | Route::ProcAddrPtds => {
                type GetProc = unsafe extern "C" fn(
                    *const c_char,
                    *mut *mut c_void,
                    c_int,
                    u64,
                    *mut c_int,
                ) -> CuResult;
                // SAFETY: cuGetProcAddress_v2's C signature.
                let gp: Symbol<'_, GetProc> = unsafe { self.lib.get(b"cuGetProcAddress_v2") }
                    .context("resolve cuGetProcAddress_v2")?;
                let base = name.strip_suffix("_v2").unwrap_or(name);
                let cname = std::ffi::CString::new(base)?;
                let mut p = std::ptr::null_mut();
                let mut status = 0;
                let flags = if self.route == Route::ProcAddrPtds {
                    2
                } else {
                    0
                };
                // SAFETY: valid name and out-pointers.
                let r = unsafe { gp(cname.as_ptr(), &mut p, 13000, flags, &mut status) };
                if r != 0 || p.is_null() {
                    bail!("cuGetProcAddress_v2({base}) failed: {r} status {status}");
                }
                p as usize
            }
        };
        // SAFETY: `p` is the address of the named entry point, whose C signature the
        // caller gives as `T` (a function pointer of pointer size).
        Ok(unsafe { std::mem::transmute_copy::<usize, T>(&p) })
    }

    fn check(&self, what: &str, r: CuResult) -> Result<()> {
        if r != 0 {
            bail!("{what} failed with CUresult {r}");
        }
        Ok(())
    }
}

struct State {
    cuda: Option<Cuda>,
    device: c_int,
    route: Route,
    ptrs: Vec<u64>,
    others: Vec<(Api, u64)>,
    primary: usize,
    created: Vec<usize>,
    /// The pool of `alloc-api pool` and the pool commands (0: the default pool).
    pool: usize,
}

fn arg<'a>(it: &mut impl Iterator<Item = &'a String>, what: &str) -> Result<u64> {
    let v = it.next().with_context(|| format!("missing {what}"))?;
    vgpu_core::bytes::parse_bytes(v).with_context(|| format!("bad {what} {v:?}"))
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn cuda(st: &State) -> Result<&Cuda> {
    st.cuda.as_ref().context("`init` must come first")
}

fn init(st: &mut State) -> Result<()> {
    // SAFETY: loading the CUDA driver library; its initializers are the driver's.
    let lib = if st.route == Route::Global {
        // SAFETY: as above; global, as a program linked against the driver sees it.
        unsafe {
            libloading::os::unix::Library::open(
                Some("libcuda.so.1"),
                libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL,
            )
        }
        .map(Library::from)
    } else {
        // SAFETY: as above.
        unsafe { Library::new("libcuda.so.1") }
    }
    .context("dlopen libcuda.so.1")?;
    let c = Cuda {
        lib,
        route: st.route,
    };
    // SAFETY: every call below passes arguments matching its CUDA driver API signature.
    unsafe {
        let cu_init: unsafe extern "C" fn(c_uint) -> CuResult = c.sym("cuInit")?;
        c.check("cuInit", cu_init(0))?;
        let retain: unsafe extern "C" fn(*mut *mut c_void, c_int) -> CuResult =
            c.sym("cuDevicePrimaryCtxRetain")?;
        let mut ctx = std::ptr::null_mut();
        c.check("cuDevicePrimaryCtxRetain", retain(&mut ctx, st.device))?;
        let set: unsafe extern "C" fn(*mut c_void) -> CuResult = c.sym("cuCtxSetCurrent")?;
        c.check("cuCtxSetCurrent", set(ctx))?;
        st.primary = ctx as usize;
    }
    st.cuda = Some(c);
    println!("init=ok");
    Ok(())
}

fn meminfo(st: &State) -> Result<(u64, u64)> {
    let c = cuda(st)?;
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: cuMemGetInfo_v2(size_t*, size_t*).
    unsafe {
        let f: unsafe extern "C" fn(*mut usize, *mut usize) -> CuResult =
            c.sym("cuMemGetInfo_v2")?;
        c.check("cuMemGetInfo_v2", f(&mut free, &mut total))?;
    }
    Ok((free as u64, total as u64))
}

fn alloc(st: &mut State, bytes: u64) -> Result<Result<u64, CuResult>> {
    let c = cuda(st)?;
    let mut p = 0u64;
    // SAFETY: cuMemAlloc_v2(CUdeviceptr*, size_t).
    let r = unsafe {
        let f: unsafe extern "C" fn(*mut u64, usize) -> CuResult = c.sym("cuMemAlloc_v2")?;
        f(&mut p, bytes as usize)
    };
    if r == 0 {
        st.ptrs.push(p);
        Ok(Ok(p))
    } else {
        Ok(Err(r))
    }
}

fn free_all(st: &mut State) -> Result<()> {
    let c = cuda(st)?;
    // SAFETY: cuMemFree_v2(CUdeviceptr) on pointers cuMemAlloc_v2 returned.
    unsafe {
        let f: unsafe extern "C" fn(u64) -> CuResult = c.sym("cuMemFree_v2")?;
        for &p in &st.ptrs {
            c.check("cuMemFree_v2", f(p))?;
        }
    }
    st.ptrs.clear();
    Ok(())
}

fn roundtrip(st: &mut State, bytes: u64) -> Result<()> {
    let p = alloc(st, bytes)?.map_err(|e| anyhow::anyhow!("cuMemAlloc_v2 failed with {e}"))?;
    let c = cuda(st)?;
    let src: Vec<u8> = (0..bytes)
        .map(|i| (i.wrapping_mul(2654435761) >> 7) as u8)
        .collect();
    let mut dst = vec![0u8; bytes as usize];
    // SAFETY: copies of `bytes` bytes between host vectors of that size and `p`.
    unsafe {
        let h2d: unsafe extern "C" fn(u64, *const c_void, usize) -> CuResult =
            c.sym("cuMemcpyHtoD_v2")?;
        let d2h: unsafe extern "C" fn(*mut c_void, u64, usize) -> CuResult =
            c.sym("cuMemcpyDtoH_v2")?;
        c.check("cuMemcpyHtoD_v2", h2d(p, src.as_ptr().cast(), src.len()))?;
        c.check(
            "cuMemcpyDtoH_v2",
            d2h(dst.as_mut_ptr().cast(), p, dst.len()),
        )?;
    }
    if src != dst {
        bail!("data did not round-trip through device memory");
    }
    println!("roundtrip=ok bytes={bytes}");
    Ok(())
}

type LaunchFn = fns::PFN_cuLaunchKernel;

fn saturate(st: &State, secs: u64, kernel_ns: u64, at_ms: u64) -> Result<()> {
    load(st, secs, kernel_ns, at_ms, 1)
}

/// Launches the one-thread spin kernel `func` for `*ns` nanoseconds on `stream`.
///
/// # Safety
/// `launch` is `cuLaunchKernel` (or `_ptsz`) of `c`; `func` and `stream` belong to the
/// current context.
unsafe fn launch_spin(
    c: &Cuda,
    launch: LaunchFn,
    func: *mut c_void,
    stream: *mut c_void,
    ns: &mut u64,
) -> Result<()> {
    let mut params = [(ns as *mut u64).cast::<c_void>()];
    // SAFETY: the caller's guarantees; `params` points to a live u64 for the call.
    let r = unsafe {
        launch(
            func,
            1,
            1,
            1,
            1,
            1,
            1,
            0,
            stream,
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    };
    c.check("cuLaunchKernel", r)
}

/// The spin kernel, loaded once per call site.
///
/// # Safety
/// `c` is a loaded driver with a current context.
unsafe fn spin_function(c: &Cuda) -> Result<*mut c_void> {
    // SAFETY: the driver API signatures of cuModuleLoadData and cuModuleGetFunction.
    unsafe {
        let load: unsafe extern "C" fn(*mut *mut c_void, *const c_void) -> CuResult =
            c.sym("cuModuleLoadData")?;
        let getf: unsafe extern "C" fn(*mut *mut c_void, *mut c_void, *const c_char) -> CuResult =
            c.sym("cuModuleGetFunction")?;
        let mut module = std::ptr::null_mut();
        c.check(
            "cuModuleLoadData",
            load(&mut module, SPIN_PTX.as_ptr().cast()),
        )?;
        let mut func = std::ptr::null_mut();
        c.check(
            "cuModuleGetFunction",
            getf(&mut func, module, c"vgpu_sim_spin".as_ptr()),
        )?;
        Ok(func)
    }
}

fn load(st: &State, secs: u64, kernel_ns: u64, at_ms: u64, batch: u64) -> Result<()> {
    let c = cuda(st)?;
    // SAFETY: every call follows its CUDA driver API signature; kernel parameters point
    // to a live u64 for the duration of each launch call.
    unsafe {
        let func = spin_function(c)?;
        let mk_stream: unsafe extern "C" fn(*mut *mut c_void, c_uint) -> CuResult =
            c.sym("cuStreamCreate")?;
        let mk_event: unsafe extern "C" fn(*mut *mut c_void, c_uint) -> CuResult =
            c.sym("cuEventCreate")?;
        let record: unsafe extern "C" fn(*mut c_void, *mut c_void) -> CuResult =
            c.sym("cuEventRecord")?;
        let sync: unsafe extern "C" fn(*mut c_void) -> CuResult = c.sym("cuEventSynchronize")?;
        let launch: LaunchFn = c.sym("cuLaunchKernel")?;
        let mut stream = std::ptr::null_mut();
        c.check("cuStreamCreate", mk_stream(&mut stream, 0))?;
        let mut free_events = Vec::new();
        for _ in 0..4 {
            let mut e = std::ptr::null_mut();
            c.check("cuEventCreate", mk_event(&mut e, 2))?;
            free_events.push(e);
        }
        std::thread::sleep(Duration::from_millis(at_ms.saturating_sub(now_ms())));
        let end = Instant::now() + Duration::from_secs(secs);
        let mut inflight = VecDeque::new();
        let mut done = 0u64;
        let mut ns = kernel_ns;
        loop {
            while Instant::now() < end
                && let Some(e) = free_events.pop()
            {
                for _ in 0..batch {
                    launch_spin(c, launch, func, stream, &mut ns)?;
                }
                c.check("cuEventRecord", record(e, stream))?;
                inflight.push_back(e);
            }
            let Some(e) = inflight.pop_front() else { break };
            c.check("cuEventSynchronize", sync(e))?;
            if Instant::now() <= end {
                done += batch;
            }
            free_events.push(e);
        }
        println!(
            "kernels={done} device_ns={} window_ns={}",
            done * kernel_ns,
            secs * 1_000_000_000
        );
    }
    Ok(())
}

fn latency(st: &State, n: u64, kernel_ns: u64, period_us: u64, at_ms: u64) -> Result<()> {
    let c = cuda(st)?;
    // SAFETY: as in `load`.
    unsafe {
        let func = spin_function(c)?;
        let mk_stream: unsafe extern "C" fn(*mut *mut c_void, c_uint) -> CuResult =
            c.sym("cuStreamCreate")?;
        let ssync: unsafe extern "C" fn(*mut c_void) -> CuResult = c.sym("cuStreamSynchronize")?;
        let launch: LaunchFn = c.sym("cuLaunchKernel")?;
        let mut stream = std::ptr::null_mut();
        c.check("cuStreamCreate", mk_stream(&mut stream, 0))?;
        std::thread::sleep(Duration::from_millis(at_ms.saturating_sub(now_ms())));
        let mut lat = Vec::with_capacity(n as usize);
        let mut ns = kernel_ns;
        let t0 = Instant::now();
        for i in 0..n {
            let due = t0 + Duration::from_micros(period_us * i);
            std::thread::sleep(due.saturating_duration_since(Instant::now()));
            let start = Instant::now();
            launch_spin(c, launch, func, stream, &mut ns)?;
            c.check("cuStreamSynchronize", ssync(stream))?;
            lat.push(start.elapsed().as_micros() as u64);
        }
        lat.sort_unstable();
        let pct = |p: f64| lat[((lat.len() as f64 - 1.0) * p).round() as usize];
        println!(
            "lat_p50_us={} lat_p99_us={} lat_max_us={} requests={n}",
            pct(0.5),
            pct(0.99),
            lat.last().copied().unwrap_or(0)
        );
    }
    Ok(())
}

fn spin(st: &State, path: &str, n: u64, kernel_ns: u64) -> Result<()> {
    let c = cuda(st)?;
    let ptsz = path.ends_with("-ptsz");
    let base = path.trim_end_matches("-ptsz");
    let sfx = if ptsz { "_ptsz" } else { "" };
    // SAFETY: each entry point is called with its driver API signature; parameters
    // point to live locals for the duration of each call.
    unsafe {
        let func = spin_function(c)?;
        let mut ns = kernel_ns;
        let mut params = [(&mut ns as *mut u64).cast::<c_void>()];
        let mk_stream: unsafe extern "C" fn(*mut *mut c_void, c_uint) -> CuResult =
            c.sym("cuStreamCreate")?;
        let ssync: unsafe extern "C" fn(*mut c_void) -> CuResult = c.sym("cuStreamSynchronize")?;
        let mut stream = std::ptr::null_mut();
        c.check("cuStreamCreate", mk_stream(&mut stream, 0))?;
        let start = Instant::now();
        match base {
            "kernel" => {
                let launch: LaunchFn = c.sym(&format!("cuLaunchKernel{sfx}"))?;
                for _ in 0..n {
                    launch_spin(c, launch, func, stream, &mut ns)?;
                }
            }
            "ex" => {
                let launch: fns::PFN_cuLaunchKernelEx = c.sym(&format!("cuLaunchKernelEx{sfx}"))?;
                let cfg = CUlaunchConfig {
                    gridDimX: 1,
                    gridDimY: 1,
                    gridDimZ: 1,
                    blockDimX: 1,
                    blockDimY: 1,
                    blockDimZ: 1,
                    sharedMemBytes: 0,
                    hStream: stream,
                    attrs: std::ptr::null_mut(),
                    numAttrs: 0,
                };
                for _ in 0..n {
                    c.check(
                        "cuLaunchKernelEx",
                        launch(&cfg, func, params.as_mut_ptr(), std::ptr::null_mut()),
                    )?;
                }
            }
            "coop" => {
                let launch: fns::PFN_cuLaunchCooperativeKernel =
                    c.sym(&format!("cuLaunchCooperativeKernel{sfx}"))?;
                for _ in 0..n {
                    c.check(
                        "cuLaunchCooperativeKernel",
                        launch(func, 1, 1, 1, 1, 1, 1, 0, stream, params.as_mut_ptr()),
                    )?;
                }
            }
            "graph" => {
                let g = GraphApi::resolve(c, sfx)?;
                let launch: LaunchFn = c.sym("cuLaunchKernel")?;
                // Captured on the stream: the capture itself launches nothing.
                c.check("cuStreamBeginCapture", (g.begin)(stream, 0))?;
                launch_spin(c, launch, func, stream, &mut ns)?;
                let mut graph = std::ptr::null_mut();
                c.check("cuStreamEndCapture", (g.end)(stream, &mut graph))?;
                let mut exec = std::ptr::null_mut();
                c.check("cuGraphInstantiate", (g.instantiate)(&mut exec, graph, 0))?;
                for _ in 0..n {
                    c.check("cuGraphLaunch", (g.launch)(exec, stream))?;
                }
            }
            other => bail!("unknown launch path {other:?}"),
        }
        c.check("cuStreamSynchronize", ssync(stream))?;
        println!("spin=ok wall_us={}", start.elapsed().as_micros());
    }
    Ok(())
}

/// The stream capture and graph entry points the probe uses.
struct GraphApi {
    begin: unsafe extern "C" fn(*mut c_void, c_int) -> CuResult,
    end: unsafe extern "C" fn(*mut c_void, *mut *mut c_void) -> CuResult,
    instantiate: unsafe extern "C" fn(*mut *mut c_void, *mut c_void, u64) -> CuResult,
    launch: unsafe extern "C" fn(*mut c_void, *mut c_void) -> CuResult,
}

impl GraphApi {
    /// `cuStreamBeginCapture_v2`, `cuStreamEndCapture`, `cuGraphInstantiateWithFlags`
    /// and `cuGraphLaunch{sfx}` (`sfx`: "" or "_ptsz").
    fn resolve(c: &Cuda, sfx: &str) -> Result<GraphApi> {
        Ok(GraphApi {
            begin: c.sym("cuStreamBeginCapture_v2")?,
            end: c.sym("cuStreamEndCapture")?,
            instantiate: c.sym("cuGraphInstantiateWithFlags")?,
            launch: c.sym(&format!("cuGraphLaunch{sfx}"))?,
        })
    }
}

/// `capture`: real work first (the process then holds the GPU, or just did), then a
/// stream capture in global mode with a pause in it, as an application that captures a
/// CUDA graph after its warm-up does (PyTorch synchronizes, then captures). `to_graph`:
/// the capture adds to a graph made first (`cuStreamBeginCaptureToGraph`, CUDA 12.3).
fn capture(st: &State, n: u64, kernel_ns: u64, pause_ms: u64, to_graph: bool) -> Result<()> {
    let c = cuda(st)?;
    // SAFETY: each entry point is called with its driver API signature; parameters
    // point to live locals for the duration of each call.
    unsafe {
        let func = spin_function(c)?;
        let mut ns = kernel_ns;
        let mk_stream: unsafe extern "C" fn(*mut *mut c_void, c_uint) -> CuResult =
            c.sym("cuStreamCreate")?;
        let ssync: unsafe extern "C" fn(*mut c_void) -> CuResult = c.sym("cuStreamSynchronize")?;
        let g = GraphApi::resolve(c, "")?;
        let launch: LaunchFn = c.sym("cuLaunchKernel")?;
        let (mut work, mut side) = (std::ptr::null_mut(), std::ptr::null_mut());
        c.check("cuStreamCreate", mk_stream(&mut work, 0))?;
        c.check("cuStreamCreate", mk_stream(&mut side, 0))?;
        let start = Instant::now();
        for _ in 0..n {
            launch_spin(c, launch, func, work, &mut ns)?;
        }
        c.check("cuStreamSynchronize", ssync(work))?;
        let mut target = std::ptr::null_mut();
        if to_graph {
            let create: unsafe extern "C" fn(*mut *mut c_void, c_uint) -> CuResult =
                c.sym("cuGraphCreate")?;
            let begin: unsafe extern "C" fn(
                *mut c_void,
                *mut c_void,
                *const *mut c_void,
                *const c_void,
                usize,
                c_int,
            ) -> CuResult = c.sym("cuStreamBeginCaptureToGraph")?;
            c.check("cuGraphCreate", create(&mut target, 0))?;
            c.check(
                "cuStreamBeginCaptureToGraph",
                begin(side, target, std::ptr::null(), std::ptr::null(), 0, 0),
            )?;
        } else {
            c.check("cuStreamBeginCapture", (g.begin)(side, 0))?;
        }
        for i in 0..n {
            launch_spin(c, launch, func, side, &mut ns)?;
            if i == 0 {
                std::thread::sleep(Duration::from_millis(pause_ms));
            }
        }
        let mut graph = std::ptr::null_mut();
        let r = (g.end)(side, &mut graph);
        if r != 0 {
            println!("capture=err code={r}");
            return Ok(());
        }
        println!("capture=ok");
        if to_graph {
            println!("graph_same={}", u8::from(graph == target));
        }
        let mut exec = std::ptr::null_mut();
        c.check("cuGraphInstantiate", (g.instantiate)(&mut exec, graph, 0))?;
        c.check("cuGraphLaunch", (g.launch)(exec, side))?;
        c.check("cuStreamSynchronize", ssync(side))?;
        println!("graph=ok wall_us={}", start.elapsed().as_micros());
    }
    Ok(())
}

#[repr(C)]
#[derive(Default, Clone, Copy)]
struct NvmlMemory {
    total: u64,
    free: u64,
    used: u64,
}

#[repr(C)]
#[derive(Default, Clone, Copy)]
struct NvmlProcess {
    pid: c_uint,
    used: u64,
    gpu_instance: c_uint,
    compute_instance: c_uint,
}

fn nvml(device: c_int) -> Result<()> {
    // SAFETY: loading NVML; the calls below follow nvml.h's signatures.
    unsafe {
        let lib = Library::new("libnvidia-ml.so.1").context("dlopen libnvidia-ml.so.1")?;
        let init: Symbol<'_, unsafe extern "C" fn() -> c_uint> = lib.get(b"nvmlInit_v2")?;
        let handle: Symbol<'_, unsafe extern "C" fn(c_uint, *mut *mut c_void) -> c_uint> =
            lib.get(b"nvmlDeviceGetHandleByIndex_v2")?;
        let mem: Symbol<'_, unsafe extern "C" fn(*mut c_void, *mut NvmlMemory) -> c_uint> =
            lib.get(b"nvmlDeviceGetMemoryInfo")?;
        let procs: Symbol<
            '_,
            unsafe extern "C" fn(*mut c_void, *mut c_uint, *mut NvmlProcess) -> c_uint,
        > = lib.get(b"nvmlDeviceGetComputeRunningProcesses_v3")?;
        let r = init();
        if r != 0 {
            bail!("nvmlInit_v2 failed with {r}");
        }
        let mut h = std::ptr::null_mut();
        let r = handle(device as c_uint, &mut h);
        if r != 0 {
            bail!("nvmlDeviceGetHandleByIndex_v2 failed with {r}");
        }
        let mut m = NvmlMemory::default();
        let r = mem(h, &mut m);
        if r != 0 {
            bail!("nvmlDeviceGetMemoryInfo failed with {r}");
        }
        let mut list = [NvmlProcess::default(); 256];
        let mut n = list.len() as c_uint;
        let r = procs(h, &mut n, list.as_mut_ptr());
        if r != 0 {
            bail!("nvmlDeviceGetComputeRunningProcesses_v3 failed with {r}");
        }
        let ps: Vec<String> = list[..n as usize]
            .iter()
            .map(|p| format!("{}:{}", p.pid, p.used))
            .collect();
        println!(
            "nvml_used={} nvml_total={} nvml_free={} procs={}",
            m.used,
            m.total,
            m.free,
            ps.join(",")
        );
    }
    Ok(())
}

/// An allocation API of the driver.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Api {
    Mem,
    Pitch,
    Managed,
    Async,
    Pool,
    Vmm,
    Array,
    Array3d,
    Mipmap,
}

impl Api {
    fn parse(s: &str) -> Result<Api> {
        Ok(match s {
            "mem" => Api::Mem,
            "pitch" => Api::Pitch,
            "managed" => Api::Managed,
            "async" => Api::Async,
            "pool" => Api::Pool,
            "vmm" => Api::Vmm,
            "array" => Api::Array,
            "array3d" => Api::Array3d,
            "mipmap" => Api::Mipmap,
            _ => bail!("unknown allocation API {s:?}"),
        })
    }
}

/// Splits `n` bytes into `(a, b)` with `a × b = n`, `a` ≤ `limits[0]` and `b` ≤
/// `limits[1]` (`a` as large as it can be). A size with no such split (2 MiB + 1 bytes)
/// comes back as `(n, 1)`: the driver then judges the shape (a real GPU refuses it with
/// `CUDA_ERROR_INVALID_VALUE`), unless the shim refuses it first for the quota.
fn extents(n: usize, limits: &[usize; 2]) -> (usize, usize) {
    let lowest = n.div_ceil(limits[1]).max(1);
    (lowest..=n.min(limits[0]))
        .rev()
        .find(|a| n.is_multiple_of(*a))
        .map_or((n, 1), |a| (a, n / a))
}

#[repr(C)]
struct ArrayDesc {
    width: usize,
    height: usize,
    format: c_uint,
    channels: c_uint,
}

#[repr(C)]
struct Array3dDesc {
    width: usize,
    height: usize,
    depth: usize,
    format: c_uint,
    channels: c_uint,
    flags: c_uint,
}

#[repr(C)]
struct MemProp {
    type_: c_uint,
    handle_types: c_uint,
    loc_type: c_uint,
    loc_id: c_int,
    win32: *mut c_void,
    flags: [u8; 8],
}

/// Allocates `bytes` with `api` (arrays: `bytes` one-byte elements); keeps it.
fn alloc_api(st: &mut State, api: Api, bytes: u64) -> Result<Result<u64, CuResult>> {
    if api == Api::Mem {
        return alloc(st, bytes);
    }
    let c = cuda(st)?;
    let n = bytes as usize;
    let mut h = 0u64;
    // Array extents as the device reports them (the H100's and H200's where it cannot).
    let limit = |a: i32, or: usize| device_attribute(c, st.device, a).unwrap_or(or);
    // SAFETY: every call follows its CUDA driver API signature with valid
    // out- and in-pointers.
    let r = unsafe {
        match api {
            Api::Mem => unreachable!("handled above"),
            Api::Pitch => {
                let f: unsafe extern "C" fn(
                    *mut u64,
                    *mut usize,
                    usize,
                    usize,
                    c_uint,
                ) -> CuResult = c.sym("cuMemAllocPitch_v2")?;
                let mut pitch = 0usize;
                f(&mut h, &mut pitch, n, 1, 4)
            }
            Api::Managed => {
                let f: unsafe extern "C" fn(*mut u64, usize, c_uint) -> CuResult =
                    c.sym("cuMemAllocManaged")?;
                f(&mut h, n, 1)
            }
            Api::Async => {
                let f: unsafe extern "C" fn(*mut u64, usize, *mut c_void) -> CuResult =
                    c.sym("cuMemAllocAsync")?;
                f(&mut h, n, std::ptr::null_mut())
            }
            Api::Pool => {
                let f: unsafe extern "C" fn(*mut u64, usize, *mut c_void, *mut c_void) -> CuResult =
                    c.sym("cuMemAllocFromPoolAsync")?;
                f(&mut h, n, the_pool(st)?, std::ptr::null_mut())
            }
            Api::Vmm => {
                let f: unsafe extern "C" fn(*mut u64, usize, *const MemProp, u64) -> CuResult =
                    c.sym("cuMemCreate")?;
                let prop = MemProp {
                    type_: 1,
                    handle_types: 0,
                    loc_type: 1,
                    loc_id: st.device,
                    win32: std::ptr::null_mut(),
                    flags: [0; 8],
                };
                f(&mut h, n, &prop, 0)
            }
            Api::Array => {
                let f: unsafe extern "C" fn(*mut u64, *const ArrayDesc) -> CuResult =
                    c.sym("cuArrayCreate_v2")?;
                // A 2D array of bytes, no wider than a 1D one may be (a single row is
                // one), at most half of that (room to pick a divisor of `n`).
                let wide = limit(attr::MAXIMUM_TEXTURE1D_WIDTH, 131_072)
                    .min(limit(attr::MAXIMUM_TEXTURE2D_WIDTH, 131_072));
                let high = limit(attr::MAXIMUM_TEXTURE2D_HEIGHT, 65_536);
                let (width, height) = extents(n, &[(wide / 2).max(1), high]);
                let d = ArrayDesc {
                    width,
                    height: height.max(1),
                    format: 1,
                    channels: 1,
                };
                f(&mut h, &d)
            }
            Api::Array3d | Api::Mipmap => {
                // Within the device's 3D extents.
                let w = limit(attr::MAXIMUM_TEXTURE3D_WIDTH, 16_384);
                let hi = limit(attr::MAXIMUM_TEXTURE3D_HEIGHT, 16_384);
                let de = limit(attr::MAXIMUM_TEXTURE3D_DEPTH, 16_384);
                let (width, rest) = extents(n, &[w, hi.saturating_mul(de)]);
                let (height, depth) = extents(rest, &[hi, de]);
                let d = Array3dDesc {
                    width,
                    height: height.max(1),
                    depth: depth.max(1),
                    format: 1,
                    channels: 1,
                    flags: 0,
                };
                if api == Api::Array3d {
                    let f: unsafe extern "C" fn(*mut u64, *const Array3dDesc) -> CuResult =
                        c.sym("cuArray3DCreate_v2")?;
                    f(&mut h, &d)
                } else {
                    let f: unsafe extern "C" fn(*mut u64, *const Array3dDesc, c_uint) -> CuResult =
                        c.sym("cuMipmappedArrayCreate")?;
                    f(&mut h, &d, 1)
                }
            }
        }
    };
    if r == 0 {
        st.others.push((api, h));
        Ok(Ok(h))
    } else {
        Ok(Err(r))
    }
}

/// Device attribute `a` of `device` (None: the driver did not answer it, or it is 0).
fn device_attribute(c: &Cuda, device: c_int, a: i32) -> Option<usize> {
    let f: unsafe extern "C" fn(*mut c_int, c_int, c_int) -> CuResult =
        c.sym("cuDeviceGetAttribute").ok()?;
    let mut v: c_int = 0;
    // SAFETY: cuDeviceGetAttribute(int*, CUdevice_attribute, CUdevice) with a valid
    // out-pointer.
    let r = unsafe { f(&mut v, a, device) };
    (r == 0 && v > 0).then(|| usize::try_from(v).ok()).flatten()
}

/// The probe's pool: the created one, else the device's default pool.
fn the_pool(st: &State) -> Result<*mut c_void> {
    if st.pool != 0 {
        return Ok(st.pool as *mut c_void);
    }
    let c = cuda(st)?;
    let mut pool = std::ptr::null_mut();
    // SAFETY: cuDeviceGetDefaultMemPool(CUmemoryPool*, CUdevice).
    unsafe {
        let get: unsafe extern "C" fn(*mut *mut c_void, c_int) -> CuResult =
            c.sym("cuDeviceGetDefaultMemPool")?;
        c.check("cuDeviceGetDefaultMemPool", get(&mut pool, st.device))?;
    }
    Ok(pool)
}

/// The pool commands.
fn pool_cmd(st: &mut State, cmd: &str, arg: Option<u64>) -> Result<()> {
    let pool = if cmd == "pool-create" {
        std::ptr::null_mut()
    } else {
        the_pool(st)?
    };
    let c = cuda(st)?;
    // SAFETY: each call follows its CUDA driver API signature with a pool handle the
    // driver gave and valid in- and out-pointers.
    unsafe {
        match cmd {
            "pool-create" => {
                #[repr(C)]
                struct PoolProps {
                    alloc_type: c_uint,
                    handle_types: c_uint,
                    loc_type: c_uint,
                    loc_id: c_int,
                    win32: *mut c_void,
                    max_size: usize,
                    usage: u16,
                    reserved: [u8; 54],
                }
                let f: unsafe extern "C" fn(*mut *mut c_void, *const PoolProps) -> CuResult =
                    c.sym("cuMemPoolCreate")?;
                let props = PoolProps {
                    alloc_type: 1,
                    handle_types: 0,
                    loc_type: 1,
                    loc_id: st.device,
                    win32: std::ptr::null_mut(),
                    max_size: 0,
                    usage: 0,
                    reserved: [0; 54],
                };
                let mut p = std::ptr::null_mut();
                c.check("cuMemPoolCreate", f(&mut p, &props))?;
                st.pool = p as usize;
                println!("pool=created");
            }
            "pool-threshold" => {
                let f: unsafe extern "C" fn(*mut c_void, c_int, *mut c_void) -> CuResult =
                    c.sym("cuMemPoolSetAttribute")?;
                let mut v: u64 = arg.context("missing threshold")?;
                c.check("cuMemPoolSetAttribute", f(pool, 4, (&raw mut v).cast()))?;
                println!("pool_threshold={v}");
            }
            "pool-trim" => {
                let f: unsafe extern "C" fn(*mut c_void, usize) -> CuResult =
                    c.sym("cuMemPoolTrimTo")?;
                let keep = arg.context("missing bytes to keep")?;
                c.check("cuMemPoolTrimTo", f(pool, keep as usize))?;
                println!("pool=trimmed");
            }
            "pool-destroy" => {
                let f: unsafe extern "C" fn(*mut c_void) -> CuResult = c.sym("cuMemPoolDestroy")?;
                c.check("cuMemPoolDestroy", f(pool))?;
                st.pool = 0;
                println!("pool=destroyed");
            }
            "pool-info" => {
                let f: unsafe extern "C" fn(*mut c_void, c_int, *mut c_void) -> CuResult =
                    c.sym("cuMemPoolGetAttribute")?;
                let (mut reserved, mut used) = (0u64, 0u64);
                c.check(
                    "cuMemPoolGetAttribute",
                    f(pool, 5, (&raw mut reserved).cast()),
                )?;
                c.check("cuMemPoolGetAttribute", f(pool, 7, (&raw mut used).cast()))?;
                println!("pool_reserved={reserved} pool_used={used}");
            }
            "sync" => {
                let f: unsafe extern "C" fn(*mut c_void) -> CuResult =
                    c.sym("cuStreamSynchronize")?;
                c.check("cuStreamSynchronize", f(std::ptr::null_mut()))?;
                println!("sync=ok");
            }
            "ctx-sync" => {
                let f: unsafe extern "C" fn() -> CuResult = c.sym("cuCtxSynchronize")?;
                c.check("cuCtxSynchronize", f())?;
                println!("sync=ok");
            }
            other => bail!("unknown pool command {other:?}"),
        }
    }
    Ok(())
}

/// `cuMemFreeAsync` of every stream-ordered allocation `alloc_api` kept, without
/// synchronising.
fn free_async_all(st: &mut State) -> Result<()> {
    let c = cuda(st)?;
    // SAFETY: cuMemFreeAsync(CUdeviceptr, CUstream) on pointers the driver returned,
    // on the legacy stream.
    let f: unsafe extern "C" fn(u64, *mut c_void) -> CuResult = c.sym("cuMemFreeAsync")?;
    for &(api, h) in st
        .others
        .iter()
        .filter(|(a, _)| matches!(a, Api::Async | Api::Pool))
    {
        // SAFETY: as above.
        c.check(&format!("cuMemFreeAsync({api:?})"), unsafe {
            f(h, std::ptr::null_mut())
        })?;
    }
    st.others
        .retain(|(a, _)| !matches!(a, Api::Async | Api::Pool));
    println!("free_async=ok");
    Ok(())
}

/// Frees everything `alloc_api` kept.
fn free_others(st: &mut State) -> Result<()> {
    let c = cuda(st)?;
    for &(api, h) in &st.others {
        let (name, r) = {
            let name = match api {
                Api::Mem | Api::Pitch | Api::Managed => "cuMemFree_v2",
                Api::Async | Api::Pool => "cuMemFreeAsync",
                Api::Vmm => "cuMemRelease",
                Api::Array | Api::Array3d => "cuArrayDestroy",
                Api::Mipmap => "cuMipmappedArrayDestroy",
            };
            // SAFETY: each free function takes the handle (and a null stream where it
            // is stream-ordered).
            let r = unsafe {
                if matches!(api, Api::Async | Api::Pool) {
                    let f: unsafe extern "C" fn(u64, *mut c_void) -> CuResult = c.sym(name)?;
                    f(h, std::ptr::null_mut())
                } else {
                    let f: unsafe extern "C" fn(u64) -> CuResult = c.sym(name)?;
                    f(h)
                }
            };
            (name, r)
        };
        c.check(name, r)?;
    }
    // Stream-ordered frees complete with the stream.
    // SAFETY: cuStreamSynchronize(CUstream) on the legacy default stream.
    unsafe {
        let sync: unsafe extern "C" fn(*mut c_void) -> CuResult = c.sym("cuStreamSynchronize")?;
        c.check("cuStreamSynchronize", sync(std::ptr::null_mut()))?;
    }
    st.others.clear();
    Ok(())
}

/// `cuCtxCreate` on the probe's device (it becomes current).
fn ctx_create(st: &mut State) -> Result<()> {
    let c = cuda(st)?;
    let mut ctx = std::ptr::null_mut();
    // SAFETY: cuCtxCreate_v2(CUcontext*, unsigned int, CUdevice).
    unsafe {
        let f: unsafe extern "C" fn(*mut *mut c_void, c_uint, c_int) -> CuResult =
            c.sym("cuCtxCreate_v2")?;
        c.check("cuCtxCreate_v2", f(&mut ctx, 0, st.device))?;
    }
    st.created.push(ctx as usize);
    println!("ctx=created");
    Ok(())
}

/// `cuCtxDestroy` of the last created context; the primary context becomes current.
/// Allocations made in it are gone (forgotten by the probe).
fn ctx_destroy(st: &mut State) -> Result<()> {
    let ctx = st.created.pop().context("no created context")?;
    let c = cuda(st)?;
    // SAFETY: cuCtxDestroy_v2(CUcontext) and cuCtxSetCurrent(CUcontext) on contexts
    // this process holds.
    unsafe {
        let f: unsafe extern "C" fn(*mut c_void) -> CuResult = c.sym("cuCtxDestroy_v2")?;
        c.check("cuCtxDestroy_v2", f(ctx as *mut c_void))?;
        let set: unsafe extern "C" fn(*mut c_void) -> CuResult = c.sym("cuCtxSetCurrent")?;
        c.check("cuCtxSetCurrent", set(st.primary as *mut c_void))?;
    }
    st.ptrs.clear();
    st.others.clear();
    println!("ctx=destroyed");
    Ok(())
}

/// `cuDevicePrimaryCtxRelease` (the probe's one reference): everything allocated in
/// the primary context is gone.
fn primary_release(st: &mut State) -> Result<()> {
    let c = cuda(st)?;
    // SAFETY: cuDevicePrimaryCtxRelease_v2(CUdevice) after our one retain.
    unsafe {
        let f: unsafe extern "C" fn(c_int) -> CuResult = c.sym("cuDevicePrimaryCtxRelease_v2")?;
        c.check("cuDevicePrimaryCtxRelease_v2", f(st.device))?;
    }
    st.ptrs.clear();
    st.others.clear();
    println!("primary=released");
    Ok(())
}

fn total_mem(st: &State) -> Result<u64> {
    let c = cuda(st)?;
    let mut t = 0usize;
    // SAFETY: cuDeviceTotalMem_v2(size_t*, CUdevice).
    unsafe {
        let f: unsafe extern "C" fn(*mut usize, c_int) -> CuResult =
            c.sym("cuDeviceTotalMem_v2")?;
        c.check("cuDeviceTotalMem_v2", f(&mut t, st.device))?;
    }
    Ok(t as u64)
}

/// The `dlmopen` bypass (issue 39 item 3): a second copy of the driver in a new link
/// namespace, where the preloaded shim is not, and `bytes` allocated through it on
/// `device` in a context of its own. The copy is never unloaded (its allocation stays
/// until the process exits). Returns the allocation's `CUresult` and pointer.
fn dlmopen_alloc(device: c_int, bytes: u64) -> Result<(CuResult, u64)> {
    // SAFETY: dlmopen with a NUL-terminated name; the driver's initializers run in the
    // new namespace.
    let h = unsafe { libc::dlmopen(libc::LM_ID_NEWLM, c"libcuda.so.1".as_ptr(), libc::RTLD_NOW) };
    if h.is_null() {
        // SAFETY: dlerror returns null or a NUL-terminated string valid until the next
        // dl call on this thread.
        let e = unsafe { libc::dlerror() };
        let why = if e.is_null() {
            String::from("unknown error")
        } else {
            // SAFETY: as above.
            unsafe { std::ffi::CStr::from_ptr(e) }
                .to_string_lossy()
                .into_owned()
        };
        bail!("dlmopen(LM_ID_NEWLM, libcuda.so.1): {why}");
    }
    let sym = |name: &std::ffi::CStr| -> Result<usize> {
        // SAFETY: a handle from dlmopen and a NUL-terminated name.
        let p = unsafe { libc::dlsym(h, name.as_ptr()) };
        if p.is_null() {
            bail!("{name:?} not found in the dlmopen-ed driver");
        }
        Ok(p as usize)
    };
    type Init = unsafe extern "C" fn(c_uint) -> CuResult;
    type DeviceGet = unsafe extern "C" fn(*mut c_int, c_int) -> CuResult;
    type CtxCreate = unsafe extern "C" fn(*mut *mut c_void, c_uint, c_int) -> CuResult;
    type MemAlloc = unsafe extern "C" fn(*mut u64, usize) -> CuResult;
    // SAFETY: each address is the named driver entry point, whose C signature is the
    // type it is turned into (function pointers of pointer size).
    let (init, device_get, ctx_create, mem_alloc) = unsafe {
        (
            std::mem::transmute::<usize, Init>(sym(c"cuInit")?),
            std::mem::transmute::<usize, DeviceGet>(sym(c"cuDeviceGet")?),
            std::mem::transmute::<usize, CtxCreate>(sym(c"cuCtxCreate_v2")?),
            std::mem::transmute::<usize, MemAlloc>(sym(c"cuMemAlloc_v2")?),
        )
    };
    let check = |what: &str, r: CuResult| -> Result<()> {
        if r != 0 {
            bail!("{what} in the dlmopen-ed driver failed with CUresult {r}");
        }
        Ok(())
    };
    let (mut dev, mut ctx, mut ptr) = (0, std::ptr::null_mut(), 0u64);
    // SAFETY: every call passes arguments matching its CUDA driver API signature, with
    // out-pointers to live locals; the context is made current on this thread by
    // cuCtxCreate, in the second driver only.
    let r = unsafe {
        check("cuInit", init(0))?;
        check("cuDeviceGet", device_get(&mut dev, device))?;
        check("cuCtxCreate_v2", ctx_create(&mut ctx, 0, dev))?;
        mem_alloc(&mut ptr, bytes as usize)
    };
    Ok((r, ptr))
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut st = State {
        cuda: None,
        device: 0,
        route: Route::Dlsym,
        ptrs: Vec::new(),
        others: Vec::new(),
        primary: 0,
        created: Vec::new(),
        pool: 0,
    };
    let mut it = args.iter();
    while let Some(cmd) = it.next() {
        match cmd.as_str() {
            "device" => st.device = arg(&mut it, "device index")? as c_int,
            "init" => init(&mut st)?,
            "meminfo" => {
                let (f, t) = meminfo(&st)?;
                println!("free={f} total={t}");
            }
            "alloc" => {
                let n = arg(&mut it, "size")?;
                match alloc(&mut st, n)? {
                    Ok(p) => println!("alloc=ok ptr={p:#x}"),
                    Err(e) => println!("alloc=err code={e}"),
                }
            }
            "alloc-until-oom" => {
                let chunk = arg(&mut it, "chunk size")?;
                let (mut n, mut total) = (0u64, 0u64);
                let code = loop {
                    match alloc(&mut st, chunk)? {
                        Ok(_) => {
                            n += 1;
                            total += chunk;
                        }
                        Err(e) => break e,
                    }
                };
                println!("allocations={n} allocated={total} code={code}");
            }
            "free-all" => {
                free_all(&mut st)?;
                free_others(&mut st)?;
            }
            "route" => {
                st.route = match it.next().map(String::as_str) {
                    Some("dlsym") => Route::Dlsym,
                    Some("global") => Route::Global,
                    Some("procaddr") => Route::ProcAddr,
                    Some("procaddr-ptds") => Route::ProcAddrPtds,
                    other => {
                        bail!("unknown route {other:?} (dlsym, global, procaddr, procaddr-ptds)")
                    }
                }
            }
            "alloc-api" => {
                let api = Api::parse(it.next().context("missing API")?)?;
                let n = arg(&mut it, "size")?;
                match alloc_api(&mut st, api, n)? {
                    Ok(h) => println!("alloc=ok handle={h:#x}"),
                    Err(e) => println!("alloc=err code={e}"),
                }
            }
            "until-oom" => {
                let api = Api::parse(it.next().context("missing API")?)?;
                let chunk = arg(&mut it, "chunk size")?;
                let (mut n, mut total) = (0u64, 0u64);
                let code = loop {
                    match alloc_api(&mut st, api, chunk)? {
                        Ok(_) => {
                            n += 1;
                            total += chunk;
                        }
                        Err(e) => break e,
                    }
                };
                println!("allocations={n} allocated={total} code={code}");
            }
            "ctx-create" => ctx_create(&mut st)?,
            "pool-create" | "pool-destroy" | "pool-info" | "sync" | "ctx-sync" => {
                pool_cmd(&mut st, cmd, None)?
            }
            "pool-threshold" | "pool-trim" => {
                let v = match it.next().map(String::as_str) {
                    Some("max") => u64::MAX,
                    Some(v) => vgpu_core::bytes::parse_bytes(v)
                        .with_context(|| format!("bad byte count {v:?}"))?,
                    None => bail!("{cmd}: missing bytes"),
                };
                pool_cmd(&mut st, cmd, Some(v))?
            }
            "free-async-all" => free_async_all(&mut st)?,
            "ctx-destroy" => ctx_destroy(&mut st)?,
            "primary-release" => primary_release(&mut st)?,
            "procaddr" => {
                let name = it.next().context("missing name")?;
                let version = arg(&mut it, "CUDA version")?;
                let flags = arg(&mut it, "flags")?;
                let c = cuda(&st)?;
                type GetProc = unsafe extern "C" fn(
                    *const c_char,
                    *mut *mut c_void,
                    c_int,
                    u64,
                    *mut c_int,
                ) -> CuResult;
                // SAFETY: cuGetProcAddress_v2's C signature; valid name and out-pointers.
                let (r, p, status) = unsafe {
                    let gp: Symbol<'_, GetProc> = c.lib.get(b"cuGetProcAddress_v2")?;
                    let cname = std::ffi::CString::new(name.as_str())?;
                    let mut p = std::ptr::null_mut();
                    let mut status = 0;
                    let r = gp(cname.as_ptr(), &mut p, version as c_int, flags, &mut status);
                    (r, p, status)
                };
                println!("procaddr_{name}={:#x} code={r} status={status}", p as usize);
            }
            "symaddr" => {
                let name = it.next().context("missing name")?;
                let this = libloading::os::unix::Library::this();
                // SAFETY: reading a symbol's address, not calling it.
                let p = unsafe { this.get::<usize>(name.as_bytes()) }
                    .map(|s| s.into_raw() as usize)
                    .unwrap_or(0);
                println!("symaddr_{name}={p:#x}");
            }
            "totalmem" => println!("totalmem={}", total_mem(&st)?),
            "roundtrip" => {
                let n = arg(&mut it, "size")?;
                roundtrip(&mut st, n)?;
            }
            "saturate" => {
                let secs = arg(&mut it, "seconds")?;
                let kns = arg(&mut it, "kernel ns")?;
                let at = arg(&mut it, "start time")?;
                saturate(&st, secs, kns, at)?;
            }
            "load" => {
                let secs = arg(&mut it, "seconds")?;
                let kns = arg(&mut it, "kernel ns")?;
                let at = arg(&mut it, "start time")?;
                let batch = arg(&mut it, "batch")?;
                load(&st, secs, kns, at, batch.max(1))?;
            }
            "latency" => {
                let n = arg(&mut it, "requests")?;
                let kns = arg(&mut it, "kernel ns")?;
                let period = arg(&mut it, "period us")?;
                let at = arg(&mut it, "start time")?;
                latency(&st, n, kns, period, at)?;
            }
            "spin" => {
                let path = it.next().context("spin: missing launch path")?;
                let n = arg(&mut it, "kernels")?;
                let kns = arg(&mut it, "kernel ns")?;
                spin(&st, path, n, kns)?;
            }
            "capture" => {
                let n = arg(&mut it, "kernels")?;
                let kns = arg(&mut it, "kernel ns")?;
                let pause = arg(&mut it, "pause ms")?;
                capture(&st, n, kns, pause, false)?;
            }
            "capture-to-graph" => {
                let n = arg(&mut it, "kernels")?;
                let kns = arg(&mut it, "kernel ns")?;
                let pause = arg(&mut it, "pause ms")?;
                capture(&st, n, kns, pause, true)?;
            }
            "memop-gate" => {
                let n = arg(&mut it, "kernels")?;
                let kns = arg(&mut it, "kernel ns")?;
                memops::gate(&st, n, kns)?;
            }
            "memop-block" => memops::block(&st, arg(&mut it, "milliseconds")?)?,
            "fill" => {
                let n = arg(&mut it, "size")?;
                let seed = arg(&mut it, "seed")?;
                checkpoint::fill(&mut st, n, seed)?;
            }
            "verify" => checkpoint::verify(&st)?,
            "timed-meminfo" => checkpoint::timed_meminfo(&st)?,
            "ckpt" => {
                let op = it.next().context("ckpt: missing operation")?.clone();
                let pid = c_int::try_from(arg(&mut it, "pid")?).context("pid out of range")?;
                let ms = if op == "lock" {
                    u32::try_from(arg(&mut it, "lock timeout ms")?)
                        .context("timeout out of range")?
                } else {
                    0
                };
                checkpoint::ckpt(&st, &op, pid, ms)?;
            }
            "capture-open" => {
                let c = cuda(&st)?;
                let g = GraphApi::resolve(c, "")?;
                // SAFETY: cuStreamCreate's signature; a live out-pointer.
                unsafe {
                    let mk_stream: unsafe extern "C" fn(*mut *mut c_void, c_uint) -> CuResult =
                        c.sym("cuStreamCreate")?;
                    let mut s = std::ptr::null_mut();
                    c.check("cuStreamCreate", mk_stream(&mut s, 0))?;
                    // CU_STREAM_CAPTURE_MODE_RELAXED: the thread launches elsewhere too.
                    c.check("cuStreamBeginCapture", (g.begin)(s, 2))?;
                }
                println!("capture_open=ok");
            }
            "nvml" => nvml(st.device)?,
            "dlmopen-alloc" => {
                let n = arg(&mut it, "size")?;
                let (r, ptr) = dlmopen_alloc(st.device, n)?;
                let maps = std::fs::read_to_string("/proc/self/maps").context("read maps")?;
                let loads = vgpu_core::proc_maps::driver_loads(&maps);
                match r {
                    0 => println!("dlmopen_alloc=ok ptr={ptr:#x} driver_loads={loads}"),
                    e => println!("dlmopen_alloc=err code={e} driver_loads={loads}"),
                }
            }
            "ready" => println!("ready pid={}", std::process::id()),
            "wait" => {
                std::io::stdout().flush()?;
                let mut sink = Vec::new();
                let _ = std::io::stdin().read_to_end(&mut sink);
            }
            "at" => {
                let at = arg(&mut it, "unix time in ms")?;
                std::thread::sleep(Duration::from_millis(at.saturating_sub(now_ms())));
            }
            "sleep" => std::thread::sleep(Duration::from_millis(arg(&mut it, "milliseconds")?)),
            other => bail!("unknown probe command {other:?}"),
        }
        std::io::stdout().flush()?;
    }
    Ok(())
}
