//! `shim-bench`: what libvgpu.so adds to driver calls, measured in one process against
//! the simulated driver, interleaved A/B (the benchmarks brief's method).
//!
//! The process loads the simulator (`libcuda.so.1`) and libvgpu.so side by side
//! (`RTLD_LOCAL`: the shim interposes nothing here) and calls the same operation through
//! the bare driver and through the shim's hooks, alternating in rounds. Pass-through
//! calls and launches are resolved through the shim's `dlsym` hook, exactly as a program
//! that `dlopen`s the driver gets them. Then it starts N processes (`cuda-probe init`)
//! at once, with and without `LD_PRELOAD`, and compares their start-up times
//! (`--procs 0`: not).
//!
//! ```text
//! LD_LIBRARY_PATH=target/cuda-sim target/release/shim-bench [--iters N] [--procs N]
//! ```
//!
//! Prints a table and, last, one JSON line. Nothing is asserted.

// Calls the C ABI of libraries loaded at run time.
#![allow(unsafe_code)]

use std::ffi::{c_char, c_int, c_uint, c_void};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use libloading::Library;
use vgpu_cuda_sim::bench::{SPIN_PTX, Samples, Stats, warm_up};

type CuResult = c_int;
type Handle = *mut c_void;
type LaunchFn = vgpu_cuda_abi::fns::PFN_cuLaunchKernel;

fn sym<T: Copy>(lib: &Library, name: &str) -> Result<T> {
    // SAFETY: the caller names an entry point whose C signature is `T`.
    let s: libloading::Symbol<'_, T> =
        unsafe { lib.get(name.as_bytes()) }.with_context(|| format!("resolve {name}"))?;
    Ok(*s)
}

fn check(what: &str, r: CuResult) -> Result<()> {
    if r != 0 {
        bail!("{what} failed with CUresult {r}");
    }
    Ok(())
}

fn flag(args: &[String], name: &str, default: u64) -> Result<u64> {
    match args.iter().position(|a| a == name) {
        Some(i) => args
            .get(i + 1)
            .with_context(|| format!("{name} needs a value"))?
            .parse()
            .with_context(|| format!("bad {name}")),
        None => Ok(default),
    }
}

fn shim_path(exe_dir: &Path) -> Result<PathBuf> {
    [exe_dir.join("deps/libvgpu.so"), exe_dir.join("libvgpu.so")]
        .into_iter()
        .find(|p| p.exists())
        .context("libvgpu.so is not built next to shim-bench (cargo build --release)")
}

struct Pair {
    name: &'static str,
    bare: Samples,
    shim: Samples,
}

impl Pair {
    fn new(name: &'static str) -> Pair {
        Pair {
            name,
            bare: Samples::new(name, 1),
            shim: Samples::new(name, 1),
        }
    }
}

fn row(p: &Pair) -> Option<(String, String)> {
    let (a, b): (Stats, Stats) = (p.bare.stats()?, p.shim.stats()?);
    let text = format!(
        "{:<28} {:>9.0} {:>9.0} {:>9.0} {:>9.0} {:>+9.0} {:>+9.0} {:>7.2}",
        p.name,
        a.median_ns,
        a.p99_ns,
        b.median_ns,
        b.p99_ns,
        b.median_ns - a.median_ns,
        b.p99_ns - a.p99_ns,
        b.median_ns / a.median_ns.max(1.0)
    );
    let json = format!(
        "{{\"name\":{:?},\"bare\":{},\"shim\":{},\"added_median_ns\":{:.1},\"added_p99_ns\":{:.1}}}",
        p.name,
        a.to_json(),
        b.to_json(),
        b.median_ns - a.median_ns,
        b.p99_ns - a.p99_ns
    );
    Some((text, json))
}

/// Where a launch series' slowest 1 % fell: by round, at a batch's first launch, and
/// the ten slowest as `round:index=µs` (a gate that waits at a batch's start, in the
/// first round's warm-up, or every few launches shows its pattern here).
fn launch_tail(side: &str, ns: &[u64], batch: usize) -> String {
    let mut sorted = ns.to_vec();
    sorted.sort_unstable();
    if sorted.is_empty() {
        return format!("cuLaunchKernel {side} tail: no samples");
    }
    let cut = sorted[(sorted.len() * 99 / 100).min(sorted.len() - 1)];
    let slow: Vec<(usize, u64)> = ns
        .iter()
        .copied()
        .enumerate()
        .filter(|&(_, v)| v > cut)
        .collect();
    let rounds = ns.len().div_ceil(batch);
    let by_round: Vec<String> = (0..rounds)
        .map(|r| {
            slow.iter()
                .filter(|(i, _)| i / batch == r)
                .count()
                .to_string()
        })
        .collect();
    let first = slow.iter().filter(|(i, _)| i % batch == 0).count();
    let mut worst = slow.clone();
    worst.sort_unstable_by_key(|&(_, v)| std::cmp::Reverse(v));
    let top: Vec<String> = worst
        .iter()
        .take(10)
        .map(|&(i, v)| format!("{}:{}={:.1}", i / batch, i % batch, v as f64 / 1e3))
        .collect();
    format!(
        "cuLaunchKernel {side} tail: {} launches over p99 {:.1} us; per round [{}]; at a batch's first launch {first}; slowest (round:index=us) {}",
        slow.len(),
        cut as f64 / 1e3,
        by_round.join(" "),
        top.join(" ")
    )
}

fn percentile(v: &mut [f64], q: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return 0.0;
    }
    let i = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
    v[i]
}

/// Starts `n` `cuda-probe init` processes at once; their wall times in ms.
fn start_many(
    probe: &Path,
    shim: Option<&Path>,
    n: u64,
    env: &[(&str, PathBuf)],
) -> Result<Vec<f64>> {
    let mut children = Vec::new();
    for _ in 0..n {
        let mut c = Command::new(probe);
        c.arg("init").stdout(Stdio::null()).stderr(Stdio::null());
        for (k, v) in env {
            c.env(k, v);
        }
        if let Some(s) = shim {
            c.env("LD_PRELOAD", s).env("VGPU_MEMORY_LIMIT", "512Mi");
        }
        children.push((Instant::now(), c.spawn().context("spawn cuda-probe")?));
    }
    let mut times = Vec::new();
    for (t, mut ch) in children {
        let st = ch.wait()?;
        if !st.success() {
            bail!("cuda-probe init failed: {st}");
        }
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    Ok(times)
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let iters = flag(&args, "--iters", 20_000)?;
    let procs = flag(&args, "--procs", 128)?;
    let exe = std::env::current_exe()?;
    let exe_dir = exe.parent().context("exe dir")?.to_owned();
    let shim_lib = shim_path(&exe_dir)?;
    let tmp = tempfile::tempdir()?;
    // SAFETY: single-threaded here; nothing reads the environment concurrently.
    unsafe {
        std::env::set_var("VGPU_SIM_DIR", tmp.path().join("sim"));
        std::env::set_var("VGPU_CONTAINER_DIR", tmp.path().join("container"));
        std::env::set_var("VGPU_MEMORY_LIMIT", "4Gi");
    }
    // SAFETY: loading the simulated driver and the shim; their initializers are ours.
    let (cuda, shim) = unsafe {
        (
            Library::new("libcuda.so.1").context("dlopen libcuda.so.1")?,
            Library::new(&shim_lib).with_context(|| format!("dlopen {}", shim_lib.display()))?,
        )
    };
    let cuda_handle = {
        // The same handle the shim's dlsym hook gets from a dlopen of the driver.
        // SAFETY: dlopen of an already loaded library with RTLD_NOLOAD.
        let h =
            unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
        if h.is_null() {
            bail!("libcuda.so.1 is not loaded");
        }
        h
    };
    type Dlsym = unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void;
    let shim_dlsym: Dlsym = sym(&shim, "dlsym")?;
    // SAFETY: each call below follows its CUDA driver API signature with valid
    // pointers.
    unsafe {
        let via_dlsym =
            |name: &std::ffi::CStr| -> usize { shim_dlsym(cuda_handle, name.as_ptr()) as usize };
        let init: unsafe extern "C" fn(c_uint) -> CuResult = sym(&shim, "cuInit")?;
        check("cuInit", init(0))?;
        let retain: unsafe extern "C" fn(*mut Handle, c_int) -> CuResult =
            sym(&shim, "cuDevicePrimaryCtxRetain")?;
        let mut ctx = std::ptr::null_mut();
        check("cuDevicePrimaryCtxRetain", retain(&mut ctx, 0))?;
        let set: unsafe extern "C" fn(Handle) -> CuResult = sym(&cuda, "cuCtxSetCurrent")?;
        check("cuCtxSetCurrent", set(ctx))?;

        let get_cur_bare: unsafe extern "C" fn(*mut Handle) -> CuResult =
            sym(&cuda, "cuCtxGetCurrent")?;
        let p = via_dlsym(c"cuCtxGetCurrent");
        let get_cur_shim: unsafe extern "C" fn(*mut Handle) -> CuResult = std::mem::transmute(p);
        let launch_bare: LaunchFn = sym(&cuda, "cuLaunchKernel")?;
        let launch_shim: LaunchFn = std::mem::transmute(via_dlsym(c"cuLaunchKernel"));
        let alloc_bare: unsafe extern "C" fn(*mut u64, usize) -> CuResult =
            sym(&cuda, "cuMemAlloc_v2")?;
        let free_bare: unsafe extern "C" fn(u64) -> CuResult = sym(&cuda, "cuMemFree_v2")?;
        let alloc_shim: unsafe extern "C" fn(*mut u64, usize) -> CuResult =
            std::mem::transmute(via_dlsym(c"cuMemAlloc_v2"));
        let free_shim: unsafe extern "C" fn(u64) -> CuResult =
            std::mem::transmute(via_dlsym(c"cuMemFree_v2"));
        let info_bare: unsafe extern "C" fn(*mut usize, *mut usize) -> CuResult =
            sym(&cuda, "cuMemGetInfo_v2")?;
        let info_shim: unsafe extern "C" fn(*mut usize, *mut usize) -> CuResult =
            std::mem::transmute(via_dlsym(c"cuMemGetInfo_v2"));
        type AllocAsync = unsafe extern "C" fn(*mut u64, usize, Handle) -> CuResult;
        type FreeAsync = unsafe extern "C" fn(u64, Handle) -> CuResult;
        let alloc_async_bare: AllocAsync = sym(&cuda, "cuMemAllocAsync")?;
        let free_async_bare: FreeAsync = sym(&cuda, "cuMemFreeAsync")?;
        let alloc_async_shim: AllocAsync = std::mem::transmute(via_dlsym(c"cuMemAllocAsync"));
        let free_async_shim: FreeAsync = std::mem::transmute(via_dlsym(c"cuMemFreeAsync"));
        let sync_bare: unsafe extern "C" fn(Handle) -> CuResult =
            sym(&cuda, "cuStreamSynchronize")?;
        let sync_shim: unsafe extern "C" fn(Handle) -> CuResult =
            std::mem::transmute(via_dlsym(c"cuStreamSynchronize"));
        let hooked = alloc_shim as usize != alloc_bare as usize;
        let passthrough_same = get_cur_shim as usize == get_cur_bare as usize
            && launch_shim as usize == launch_bare as usize;
        if !hooked {
            bail!("the shim's dlsym did not return its cuMemAlloc_v2 hook");
        }

        // A kernel for the launch figures: the built-in spin of 0 ns.
        let load: unsafe extern "C" fn(*mut Handle, *const c_void) -> CuResult =
            sym(&cuda, "cuModuleLoadData")?;
        let getf: unsafe extern "C" fn(*mut Handle, Handle, *const c_char) -> CuResult =
            sym(&cuda, "cuModuleGetFunction")?;
        let sync: unsafe extern "C" fn(Handle) -> CuResult = sym(&cuda, "cuStreamSynchronize")?;
        let mut module = std::ptr::null_mut();
        check(
            "cuModuleLoadData",
            load(&mut module, SPIN_PTX.as_ptr().cast()),
        )?;
        let mut func = std::ptr::null_mut();
        check(
            "cuModuleGetFunction",
            getf(&mut func, module, c"vgpu_sim_spin".as_ptr()),
        )?;

        let mut pairs = [
            Pair::new("cuCtxGetCurrent (pass-through)"),
            Pair::new("cuLaunchKernel"),
            Pair::new("cuMemAlloc+cuMemFree 1 MiB"),
            Pair::new("cuMemGetInfo"),
            Pair::new("cuMemAllocAsync+cuMemFreeAsync 1 MiB"),
            Pair::new("cuStreamSynchronize (idle)"),
        ];
        let mut c: Handle = std::ptr::null_mut();
        let (mut f, mut t) = (0usize, 0usize);
        let mut ns = 0u64;
        let mut launch = |l: LaunchFn| {
            let mut params = [(&mut ns as *mut u64).cast::<c_void>()];
            let r = l(
                func,
                1,
                1,
                1,
                1,
                1,
                1,
                0,
                std::ptr::null_mut(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            );
            debug_assert_eq!(r, 0);
        };
        let alloc_free = |a: unsafe extern "C" fn(*mut u64, usize) -> CuResult,
                          fr: unsafe extern "C" fn(u64) -> CuResult| {
            let mut p = 0u64;
            if a(&mut p, 1 << 20) == 0 {
                fr(p);
            }
        };
        let alloc_free_async = |a: AllocAsync, fr: FreeAsync| {
            let mut p = 0u64;
            if a(&mut p, 1 << 20, std::ptr::null_mut()) == 0 {
                fr(p, std::ptr::null_mut());
            }
        };
        warm_up(1000, || alloc_free(alloc_shim, free_shim));
        warm_up(1000, || alloc_free(alloc_bare, free_bare));
        let rounds = 10;
        let per = (iters / rounds).max(1);
        for _ in 0..rounds {
            pairs[0].bare.run(per, || {
                get_cur_bare(&mut c);
            });
            pairs[0].shim.run(per, || {
                get_cur_shim(&mut c);
            });
            pairs[1].bare.run(per / 4, || launch(launch_bare));
            sync(std::ptr::null_mut());
            pairs[1].shim.run(per / 4, || launch(launch_shim));
            sync(std::ptr::null_mut());
            pairs[2]
                .bare
                .run(per / 4, || alloc_free(alloc_bare, free_bare));
            pairs[2]
                .shim
                .run(per / 4, || alloc_free(alloc_shim, free_shim));
            pairs[3].bare.run(per, || {
                info_bare(&mut f, &mut t);
            });
            pairs[3].shim.run(per, || {
                info_shim(&mut f, &mut t);
            });
            pairs[4].bare.run(per / 4, || {
                alloc_free_async(alloc_async_bare, free_async_bare)
            });
            sync(std::ptr::null_mut());
            pairs[4].shim.run(per / 4, || {
                alloc_free_async(alloc_async_shim, free_async_shim)
            });
            sync_shim(std::ptr::null_mut());
            pairs[5].bare.run(per, || {
                sync_bare(std::ptr::null_mut());
            });
            pairs[5].shim.run(per, || {
                sync_shim(std::ptr::null_mut());
            });
        }

        println!(
            "shim-bench: {iters} iterations in {rounds} interleaved rounds; pass-through and launch resolve to the driver's own function: {passthrough_same}"
        );
        println!(
            "{:<28} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>7}",
            "ns per call", "bare p50", "bare p99", "shim p50", "shim p99", "+p50", "+p99", "ratio"
        );
        let mut json = Vec::new();
        for p in &pairs {
            if let Some((text, j)) = row(p) {
                println!("{text}");
                json.push(j);
            }
        }
        let batch = usize::try_from(per / 4).unwrap_or(1).max(1);
        for (side, s) in [("bare", &pairs[1].bare), ("shim", &pairs[1].shim)] {
            println!("{}", launch_tail(side, s.ns(), batch));
        }

        if procs == 0 {
            println!("{{\"bench\":\"shim\",\"calls\":[{}]}}", json.join(","));
            return Ok(());
        }
        // Start-up of many processes at once, shimmed vs not, interleaved.
        let probe = exe_dir.join("cuda-probe");
        let env = [
            ("VGPU_SIM_DIR", tmp.path().join("sim-start")),
            ("VGPU_CONTAINER_DIR", tmp.path().join("container-start")),
        ];
        let (mut bare, mut shimmed) = (Vec::new(), Vec::new());
        for _ in 0..2 {
            bare.extend(start_many(&probe, None, procs, &env)?);
            std::thread::sleep(Duration::from_millis(200));
            shimmed.extend(start_many(&probe, Some(&shim_lib), procs, &env)?);
            std::thread::sleep(Duration::from_millis(200));
        }
        let (b50, b99) = (percentile(&mut bare, 0.5), percentile(&mut bare, 0.99));
        let (s50, s99) = (
            percentile(&mut shimmed, 0.5),
            percentile(&mut shimmed, 0.99),
        );
        println!(
            "{procs} processes starting at once (ms, 2 rounds): bare p50 {b50:.1} p99 {b99:.1}; shim p50 {s50:.1} p99 {s99:.1}; p99 ratio {:.2}",
            s99 / b99.max(0.001)
        );
        println!(
            "{{\"bench\":\"shim\",\"calls\":[{}],\"start\":{{\"procs\":{procs},\"bare_p50_ms\":{b50:.1},\"bare_p99_ms\":{b99:.1},\"shim_p50_ms\":{s50:.1},\"shim_p99_ms\":{s99:.1}}}}}",
            json.join(",")
        );
    }
    Ok(())
}
