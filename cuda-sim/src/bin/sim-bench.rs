//! `sim-bench`: the simulated driver's own host-side cost per call.
//!
//! Loads `libcuda.so.1` with `dlopen` (the simulator by default, or any driver with
//! `--lib`), and times pass-through queries, kernel launches, allocations and stream and
//! event calls with [`vgpu_cuda_sim::bench`]. These figures are the baseline that the
//! shim's overhead benchmarks compare against, measured in the same run. Prints a table
//! and, last, one JSON line.

// This binary calls the C ABI of a library it loads at run time: every call is FFI.
#![allow(unsafe_code)]

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::hint::black_box;
use std::path::{Path, PathBuf};
use std::ptr::null_mut;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Parser;
use vgpu_cuda_abi::fns;
use vgpu_cuda_sim::bench::{self, SPIN_PTX, Stats, json_string};

#[derive(Parser, Debug)]
#[command(about = "Measure the simulated CUDA driver's own cost per call (median, p99, mean)")]
struct Cli {
    /// The driver library to load (default: `<repo>/target/cuda-sim/libcuda.so.1`).
    #[arg(long)]
    lib: Option<PathBuf>,
    /// Timed iterations of each cheap call.
    #[arg(long, default_value_t = 100_000)]
    iters: u64,
    /// Timed iterations of the cuMemAlloc_v2 + cuMemFree_v2 pair.
    #[arg(long, default_value_t = 10_000)]
    alloc_iters: u64,
    /// Bytes per allocation.
    #[arg(long, default_value_t = 1 << 20)]
    alloc_bytes: usize,
    /// Calls per timed sample (1: every call timed on its own).
    #[arg(long, default_value_t = 1)]
    batch: u32,
}

type CUresult = vgpu_cuda_abi::cuda::CUresult;
type Handle = *mut c_void;

/// The entry points measured, resolved once with `dlsym`.
struct Api {
    init: unsafe extern "C" fn(c_uint) -> CUresult,
    get_error_name: unsafe extern "C" fn(CUresult, *mut *const c_char) -> CUresult,
    device_get: unsafe extern "C" fn(*mut c_int, c_int) -> CUresult,
    device_get_attribute: unsafe extern "C" fn(*mut c_int, c_int, c_int) -> CUresult,
    primary_ctx_retain: unsafe extern "C" fn(*mut Handle, c_int) -> CUresult,
    ctx_set_current: unsafe extern "C" fn(Handle) -> CUresult,
    ctx_get_current: unsafe extern "C" fn(*mut Handle) -> CUresult,
    module_load_data: unsafe extern "C" fn(*mut Handle, *const c_void) -> CUresult,
    module_get_function: unsafe extern "C" fn(*mut Handle, Handle, *const c_char) -> CUresult,
    stream_create: unsafe extern "C" fn(*mut Handle, c_uint) -> CUresult,
    stream_synchronize: unsafe extern "C" fn(Handle) -> CUresult,
    stream_query: unsafe extern "C" fn(Handle) -> CUresult,
    launch_kernel: fns::PFN_cuLaunchKernel,
    mem_alloc: unsafe extern "C" fn(*mut u64, usize) -> CUresult,
    mem_free: unsafe extern "C" fn(u64) -> CUresult,
    mem_get_info: unsafe extern "C" fn(*mut usize, *mut usize) -> CUresult,
    event_create: unsafe extern "C" fn(*mut Handle, c_uint) -> CUresult,
    event_record: unsafe extern "C" fn(Handle, Handle) -> CUresult,
}

/// Resolves `name` in `lib` as a function of type `T`.
fn sym<T: Copy>(lib: &libloading::Library, name: &str) -> Result<T> {
    let cname = format!("{name}\0");
    // SAFETY: every `T` used here is the `extern "C"` signature that NVIDIA's `cuda.h`
    // declares for `name`, which the loaded library implements.
    let s = unsafe { lib.get::<T>(cname.as_bytes()) }
        .with_context(|| format!("the driver does not export {name}"))?;
    Ok(*s)
}

impl Api {
    fn load(lib: &libloading::Library) -> Result<Api> {
        Ok(Api {
            init: sym(lib, "cuInit")?,
            get_error_name: sym(lib, "cuGetErrorName")?,
            device_get: sym(lib, "cuDeviceGet")?,
            device_get_attribute: sym(lib, "cuDeviceGetAttribute")?,
            primary_ctx_retain: sym(lib, "cuDevicePrimaryCtxRetain")?,
            ctx_set_current: sym(lib, "cuCtxSetCurrent")?,
            ctx_get_current: sym(lib, "cuCtxGetCurrent")?,
            module_load_data: sym(lib, "cuModuleLoadData")?,
            module_get_function: sym(lib, "cuModuleGetFunction")?,
            stream_create: sym(lib, "cuStreamCreate")?,
            stream_synchronize: sym(lib, "cuStreamSynchronize")?,
            stream_query: sym(lib, "cuStreamQuery")?,
            launch_kernel: sym(lib, "cuLaunchKernel")?,
            mem_alloc: sym(lib, "cuMemAlloc_v2")?,
            mem_free: sym(lib, "cuMemFree_v2")?,
            mem_get_info: sym(lib, "cuMemGetInfo_v2")?,
            event_create: sym(lib, "cuEventCreate")?,
            event_record: sym(lib, "cuEventRecord")?,
        })
    }

    /// `cuStreamSynchronize` on a stream this driver created.
    fn synchronize(&self, stream: Handle) -> Result<()> {
        // SAFETY: `stream` is a handle this driver returned (or null, the default stream).
        let r = unsafe { (self.stream_synchronize)(stream) };
        self.check(r, "cuStreamSynchronize")
    }

    /// Fails with the driver's name for `r` unless it is `CUDA_SUCCESS`.
    fn check(&self, r: CUresult, what: &str) -> Result<()> {
        if r == 0 {
            return Ok(());
        }
        let mut name: *const c_char = std::ptr::null();
        // SAFETY: `name` is a valid out-pointer; the driver stores a static C string or
        // leaves it null.
        let named = unsafe { (self.get_error_name)(r, &mut name) } == 0 && !name.is_null();
        let name = if named {
            // SAFETY: a non-null result of cuGetErrorName is a static NUL-terminated string.
            unsafe { CStr::from_ptr(name) }
                .to_string_lossy()
                .into_owned()
        } else {
            "unknown error".to_owned()
        };
        bail!("{what} failed: {name} ({r})")
    }
}

const CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: c_int = 16;
const CUDA_ERROR_NOT_READY: CUresult = 600;

/// Records the first failing result of a measured call without slowing the loop.
#[derive(Default)]
struct FirstError(CUresult);

impl FirstError {
    #[inline(always)]
    fn note(&mut self, r: CUresult) {
        if r != 0 && self.0 == 0 {
            self.0 = r;
        }
    }
}

fn default_lib() -> PathBuf {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    repo.canonicalize()
        .unwrap_or(repo)
        .join("target/cuda-sim/libcuda.so.1")
}

/// The file the dynamic loader mapped for `libcuda` (from `/proc/self/maps`).
fn mapped_driver() -> Option<String> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| p.contains("libcuda"))
        .map(str::to_owned)
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let lib_path = cli.lib.clone().unwrap_or_else(default_lib);
    if !lib_path.is_file() {
        bail!(
            "{} not found: build the simulator with `cargo xtask sim`, or pass --lib",
            lib_path.display()
        );
    }

    let mut own_dir = None;
    if std::env::var_os("VGPU_SIM_DIR").is_none() {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let dir =
            std::env::temp_dir().join(format!("vgpu-sim-bench-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
        // SAFETY: no other thread exists yet (the driver is not loaded), so nothing can
        // read the environment concurrently.
        unsafe { std::env::set_var("VGPU_SIM_DIR", &dir) };
        own_dir = Some(dir);
    }
    let result = run(&cli, &lib_path);
    if let Some(dir) = own_dir {
        let _ = std::fs::remove_dir_all(dir);
    }
    result
}

fn run(cli: &Cli, lib_path: &Path) -> Result<()> {
    // SAFETY: loading the driver runs its initializers, which have no preconditions.
    let lib = unsafe { libloading::Library::new(lib_path) }
        .with_context(|| format!("dlopen {}", lib_path.display()))?;
    let api = Api::load(&lib)?;
    println!(
        "driver: {} (mapped: {})",
        lib_path.display(),
        mapped_driver().as_deref().unwrap_or("?")
    );
    println!(
        "VGPU_SIM_DIR={}",
        std::env::var("VGPU_SIM_DIR").unwrap_or_default()
    );

    // Set up: primary context on device 0, a stream, the spin kernel, an event.
    let mut dev: c_int = 0;
    let mut ctx: Handle = null_mut();
    let mut module: Handle = null_mut();
    let mut spin: Handle = null_mut();
    let mut stream: Handle = null_mut();
    let mut event: Handle = null_mut();
    // SAFETY: for all calls below, every pointer argument is a live local of the type the
    // driver API declares; handles passed in are the ones the driver returned.
    unsafe {
        api.check((api.init)(0), "cuInit")?;
        api.check((api.device_get)(&mut dev, 0), "cuDeviceGet")?;
        api.check(
            (api.primary_ctx_retain)(&mut ctx, dev),
            "cuDevicePrimaryCtxRetain",
        )?;
        api.check((api.ctx_set_current)(ctx), "cuCtxSetCurrent")?;
        api.check(
            (api.module_load_data)(&mut module, SPIN_PTX.as_ptr().cast()),
            "cuModuleLoadData",
        )?;
        api.check(
            (api.module_get_function)(&mut spin, module, c"vgpu_sim_spin".as_ptr()),
            "cuModuleGetFunction",
        )?;
        api.check((api.stream_create)(&mut stream, 0), "cuStreamCreate")?;
        api.check((api.event_create)(&mut event, 0), "cuEventCreate")?;
    }

    let n = cli.iters;
    let batch = cli.batch;
    let mut results: Vec<Stats> = vec![bench::timer_overhead(n, batch)];
    let mut err = FirstError::default();

    let mut cur: Handle = null_mut();
    results.push(bench::measure_batched("cuCtxGetCurrent", n, batch, || {
        // SAFETY: as above.
        err.note(unsafe { (api.ctx_get_current)(&mut cur) });
        black_box(cur);
    }));
    api.check(err.0, "cuCtxGetCurrent")?;

    let mut v: c_int = 0;
    results.push(bench::measure_batched(
        "cuDeviceGetAttribute",
        n,
        batch,
        || {
            // SAFETY: as above.
            err.note(unsafe {
                (api.device_get_attribute)(&mut v, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev)
            });
            black_box(v);
        },
    ));
    api.check(err.0, "cuDeviceGetAttribute")?;

    let (mut free, mut total) = (0usize, 0usize);
    results.push(bench::measure_batched("cuMemGetInfo_v2", n, batch, || {
        // SAFETY: as above.
        err.note(unsafe { (api.mem_get_info)(&mut free, &mut total) });
        black_box((free, total));
    }));
    api.check(err.0, "cuMemGetInfo_v2")?;

    // Launches of a 0 ns kernel, unsynchronised: the host cost of queueing one.
    let mut ns: u64 = 0;
    let mut params: [*mut c_void; 1] = [(&raw mut ns).cast()];
    let params_ptr = params.as_mut_ptr();
    let mut launch = || {
        // SAFETY: as above; `params` holds one pointer to the kernel's one .u64 parameter
        // and outlives the call (the driver copies parameters at launch).
        err.note(unsafe {
            (api.launch_kernel)(spin, 1, 1, 1, 1, 1, 1, 0, stream, params_ptr, null_mut())
        });
    };
    results.push(bench::measure_batched(
        "cuLaunchKernel (0 ns spin, unsynced)",
        n,
        batch,
        &mut launch,
    ));
    api.check(err.0, "cuLaunchKernel")?;
    let t = Instant::now();
    api.synchronize(stream)?;
    let drain = t.elapsed();

    results.push(bench::measure_batched("cuEventRecord", n, batch, || {
        // SAFETY: as above.
        err.note(unsafe { (api.event_record)(event, stream) });
    }));
    api.check(err.0, "cuEventRecord")?;
    api.synchronize(stream)?;

    results.push(bench::measure_batched(
        "cuStreamQuery (idle stream)",
        n,
        batch,
        || {
            // SAFETY: as above.
            let r = unsafe { (api.stream_query)(stream) };
            err.note(if r == CUDA_ERROR_NOT_READY { 0 } else { r });
        },
    ));
    api.check(err.0, "cuStreamQuery")?;

    let bytes = cli.alloc_bytes;
    let name = format!("cuMemAlloc_v2+cuMemFree_v2 ({bytes} B)");
    results.push(bench::measure_batched(
        &name,
        cli.alloc_iters,
        batch,
        || {
            let mut p: u64 = 0;
            // SAFETY: as above; `p` is freed right after it is allocated.
            unsafe {
                err.note((api.mem_alloc)(&mut p, bytes));
                if p != 0 {
                    err.note((api.mem_free)(p));
                }
            }
        },
    ));
    api.check(err.0, "cuMemAlloc_v2/cuMemFree_v2")?;

    println!();
    print!("{}", bench::table(&results));
    println!(
        "cuStreamSynchronize after the launches: {:.3} ms to drain the queue",
        drain.as_secs_f64() * 1e3
    );
    let json: Vec<String> = results.iter().map(Stats::to_json).collect();
    println!(
        "{{\"bench\":\"sim-bench\",\"lib\":{},\"results\":[{}],\"launch_drain_ns\":{}}}",
        json_string(&lib_path.display().to_string()),
        json.join(","),
        drain.as_nanos()
    );
    // The library stays loaded until exit: the driver's threads may still run.
    std::mem::forget(lib);
    Ok(())
}
