//! `memop-gate` and `memop-block`: what device-side gating would stand on, measured on
//! the driver the probe runs on (ADR 0034): the host's cost of a stream wait before each
//! launch, how soon a stream waiting on a word of mapped host memory goes on after the
//! host writes it, and whether it ran anything before; and a process whose stream waits
//! on a word nobody writes, for a neighbour to measure its kernels beside.

use std::ffi::{c_uint, c_void};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use vgpu_cuda_abi::cuda::memop;
use vgpu_cuda_abi::fns::PFN_cuStreamWaitValue32_v2;

use super::{CuResult, Cuda, LaunchFn, State, cuda, launch_spin, spin_function};

/// `CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP`.
const HOST_MAPPED: c_uint = 0x1 | 0x2;

/// A page of pinned host memory mapped into the device: its words on both sides.
struct Words {
    host: *mut AtomicU32,
    dev: u64,
}

impl Words {
    /// Word `i` as the host sees it.
    fn at(&self, i: usize) -> &AtomicU32 {
        // SAFETY: `host` is a live, page-sized, 4-aligned allocation; i < 1024.
        unsafe { &*self.host.add(i.min(1023)) }
    }

    /// Word `i`'s device address.
    fn dev(&self, i: usize) -> u64 {
        self.dev + 4 * i.min(1023) as u64
    }
}

/// The probe's entry points for stream memory operations.
struct MemOps {
    wait: PFN_cuStreamWaitValue32_v2,
    write: PFN_cuStreamWaitValue32_v2,
    launch: LaunchFn,
    func: *mut c_void,
    stream: *mut c_void,
    sync: unsafe extern "C" fn(*mut c_void) -> CuResult,
    query: unsafe extern "C" fn(*mut c_void) -> CuResult,
}

/// Resolves the entry points, loads the spin kernel, makes a stream and a mapped page
/// of zeros.
///
/// # Safety
/// `c` is a loaded driver with a current context.
unsafe fn setup(c: &Cuda) -> Result<(MemOps, Words)> {
    // SAFETY: each entry point is called with its driver API signature; out-pointers are
    // live locals.
    unsafe {
        let alloc: unsafe extern "C" fn(*mut *mut c_void, usize, c_uint) -> CuResult =
            c.sym("cuMemHostAlloc")?;
        let dptr: unsafe extern "C" fn(*mut u64, *mut c_void, c_uint) -> CuResult =
            c.sym("cuMemHostGetDevicePointer_v2")?;
        let mk_stream: unsafe extern "C" fn(*mut *mut c_void, c_uint) -> CuResult =
            c.sym("cuStreamCreate")?;
        let mut p = std::ptr::null_mut();
        c.check("cuMemHostAlloc", alloc(&mut p, 4096, HOST_MAPPED))?;
        std::ptr::write_bytes(p.cast::<u8>(), 0, 4096);
        let mut dev = 0u64;
        c.check("cuMemHostGetDevicePointer_v2", dptr(&mut dev, p, 0))?;
        let mut stream = std::ptr::null_mut();
        // CU_STREAM_NON_BLOCKING: nothing on the legacy stream waits for it.
        c.check("cuStreamCreate", mk_stream(&mut stream, 1))?;
        let ops = MemOps {
            wait: c.sym("cuStreamWaitValue32_v2")?,
            write: c.sym("cuStreamWriteValue32_v2")?,
            launch: c.sym("cuLaunchKernel")?,
            func: spin_function(c)?,
            stream,
            sync: c.sym("cuStreamSynchronize")?,
            query: c.sym("cuStreamQuery")?,
        };
        Ok((
            ops,
            Words {
                host: p.cast(),
                dev,
            },
        ))
    }
}

/// `memop-gate N KERNEL_NS`: N spin kernels launched plainly, then N each after a stream
/// wait on an open word (the host's ns per launch, and the wall time until they are
/// done, for both), then 20 trials of a wait on a closed word followed by a write: the
/// stream must not pass it before the host writes the word (`held=`), and the time from
/// the host's write until the stream's write is seen (`open_p50_us=`, `open_max_us=`).
pub(super) fn gate(st: &State, n: u64, kernel_ns: u64) -> Result<()> {
    let c = cuda(st)?;
    // SAFETY: as in `setup`; kernel parameters point to a live u64 during each launch.
    unsafe {
        let (m, w) = setup(c)?;
        let mut ns = kernel_ns;
        let mut timed = |gated: bool| -> Result<(f64, u64)> {
            w.at(0).store(1, Ordering::Release);
            let start = Instant::now();
            for _ in 0..n {
                if gated {
                    c.check(
                        "cuStreamWaitValue32_v2",
                        (m.wait)(m.stream, w.dev(0), 1, memop::WAIT_VALUE_GEQ),
                    )?;
                }
                launch_spin(c, m.launch, m.func, m.stream, &mut ns)?;
            }
            let per = start.elapsed().as_nanos() as f64 / n.max(1) as f64;
            c.check("cuStreamSynchronize", (m.sync)(m.stream))?;
            Ok((per, start.elapsed().as_micros() as u64))
        };
        let (plain, plain_wall) = timed(false)?;
        let (gated, gated_wall) = timed(true)?;
        let (plain2, _) = timed(false)?;
        let mut held = 0;
        let mut lat = Vec::new();
        for trial in 1..=20u32 {
            w.at(0).store(0, Ordering::Release);
            c.check(
                "cuStreamWaitValue32_v2",
                (m.wait)(m.stream, w.dev(0), trial, memop::WAIT_VALUE_GEQ),
            )?;
            c.check(
                "cuStreamWriteValue32_v2",
                (m.write)(m.stream, w.dev(1), trial, 0),
            )?;
            std::thread::sleep(Duration::from_millis(5));
            if w.at(1).load(Ordering::Acquire) != trial && (m.query)(m.stream) != 0 {
                held += 1;
            }
            let t0 = Instant::now();
            w.at(0).store(trial, Ordering::Release);
            while w.at(1).load(Ordering::Acquire) != trial {
                if t0.elapsed() > Duration::from_secs(2) {
                    bail!("the stream did not go on within 2 s of its word's write");
                }
                std::hint::spin_loop();
            }
            lat.push(t0.elapsed().as_nanos() as u64);
        }
        c.check("cuStreamSynchronize", (m.sync)(m.stream))?;
        lat.sort_unstable();
        println!(
            "plain_launch_ns={:.0} gated_launch_ns={:.0} plain_again_launch_ns={:.0} plain_wall_us={plain_wall} gated_wall_us={gated_wall} held={held}/20 open_p50_us={:.1} open_max_us={:.1}",
            plain,
            gated,
            plain2,
            lat[lat.len() / 2] as f64 / 1e3,
            lat.last().copied().unwrap_or(0) as f64 / 1e3,
        );
    }
    Ok(())
}

/// `memop-block MS`: a stream that waits on a word nobody writes, with a kernel of 1 ms
/// queued before the wait and one behind it, for MS ms (`blocked=ok` once queued); then the word is written and
/// the stream synchronized (`released=ok`).
pub(super) fn block(st: &State, ms: u64) -> Result<()> {
    let c = cuda(st)?;
    // SAFETY: as in `gate`.
    unsafe {
        let (m, w) = setup(c)?;
        let mut ns = 1_000_000u64;
        // A kernel before the wait too: the process has the GPU when its wait begins.
        launch_spin(c, m.launch, m.func, m.stream, &mut ns)?;
        c.check(
            "cuStreamWaitValue32_v2",
            (m.wait)(m.stream, w.dev(0), 1, memop::WAIT_VALUE_GEQ),
        )?;
        launch_spin(c, m.launch, m.func, m.stream, &mut ns)?;
        println!("blocked=ok");
        std::io::Write::flush(&mut std::io::stdout())?;
        std::thread::sleep(Duration::from_millis(ms));
        let before = (m.query)(m.stream);
        w.at(0).store(1, Ordering::Release);
        c.check("cuStreamSynchronize", (m.sync)(m.stream))?;
        println!("released=ok query_before={before}");
    }
    Ok(())
}
