//! The checkpoint API from both sides: `fill`/`verify` (a tenant's data, checked byte
//! for byte), `ckpt OP PID` (a controller acting on another process by pid) and
//! `timed-meminfo` (a call that waits while the process is locked).
//!
//! ```text
//! fill BYTES SEED     allocates BYTES and writes a pattern from SEED: fill=ok ptr=
//! verify              reads every filled allocation back: verify=ok | verify=bad ptr=
//! ckpt OP PID [MS]    OP: lock (timeout MS), checkpoint, restore, unlock, state, tid:
//!                     ckpt_OP=<CUresult> us=<call time> [state= | tid=]
//! timed-meminfo       cuMemGetInfo_v2: free= total= call_us=
//! ```

use std::ffi::{c_int, c_uint, c_void};
use std::sync::Mutex;
use std::time::Instant;

use anyhow::{Result, bail};
use vgpu_cuda_abi::cuda::CUcheckpointLockArgs;
use vgpu_cuda_abi::fns;

use super::{CuResult, State, alloc, cuda, meminfo};

/// Allocations written by `fill`: (device pointer, bytes, seed).
static FILLS: Mutex<Vec<(u64, u64, u64)>> = Mutex::new(Vec::new());

fn pattern(bytes: u64, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..bytes)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

pub fn fill(st: &mut State, bytes: u64, seed: u64) -> Result<()> {
    let p = alloc(st, bytes)?.map_err(|e| anyhow::anyhow!("cuMemAlloc_v2 failed with {e}"))?;
    let c = cuda(st)?;
    let src = pattern(bytes, seed);
    // SAFETY: cuMemcpyHtoD_v2(CUdeviceptr, const void*, size_t) of `bytes` bytes from a
    // host vector of that size into the allocation of that size.
    unsafe {
        let h2d: unsafe extern "C" fn(u64, *const c_void, usize) -> CuResult =
            c.sym("cuMemcpyHtoD_v2")?;
        c.check("cuMemcpyHtoD_v2", h2d(p, src.as_ptr().cast(), src.len()))?;
    }
    FILLS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push((p, bytes, seed));
    println!("fill=ok ptr={p:#x}");
    Ok(())
}

pub fn verify(st: &State) -> Result<()> {
    let c = cuda(st)?;
    let fills = FILLS.lock().unwrap_or_else(|e| e.into_inner()).clone();
    for (p, bytes, seed) in fills {
        let mut dst = vec![0u8; bytes as usize];
        // SAFETY: cuMemcpyDtoH_v2(void*, CUdeviceptr, size_t) into a host vector of the
        // allocation's size.
        unsafe {
            let d2h: unsafe extern "C" fn(*mut c_void, u64, usize) -> CuResult =
                c.sym("cuMemcpyDtoH_v2")?;
            c.check(
                "cuMemcpyDtoH_v2",
                d2h(dst.as_mut_ptr().cast(), p, dst.len()),
            )?;
        }
        if dst != pattern(bytes, seed) {
            let at = dst
                .iter()
                .zip(pattern(bytes, seed))
                .position(|(a, b)| *a != b)
                .unwrap_or(0);
            println!("verify=bad ptr={p:#x} at={at}");
            return Ok(());
        }
    }
    println!("verify=ok");
    Ok(())
}

pub fn ckpt(st: &State, op: &str, pid: c_int, ms: u32) -> Result<()> {
    let c = cuda(st)?;
    let t0 = Instant::now();
    let mut extra = String::new();
    // SAFETY: each entry point is called with its C signature (`vgpu_cuda_abi::fns`):
    // the pid, and a null (optional) argument struct or a pointer to a live local.
    let r = unsafe {
        match op {
            "lock" => {
                let f: fns::PFN_cuCheckpointProcessLock = c.sym("cuCheckpointProcessLock")?;
                let mut a = CUcheckpointLockArgs {
                    timeoutMs: ms,
                    ..CUcheckpointLockArgs::default()
                };
                f(pid, &mut a)
            }
            "checkpoint" => {
                let f: fns::PFN_cuCheckpointProcessCheckpoint =
                    c.sym("cuCheckpointProcessCheckpoint")?;
                f(pid, std::ptr::null_mut())
            }
            "restore" => {
                let f: fns::PFN_cuCheckpointProcessRestore = c.sym("cuCheckpointProcessRestore")?;
                f(pid, std::ptr::null_mut())
            }
            "unlock" => {
                let f: fns::PFN_cuCheckpointProcessUnlock = c.sym("cuCheckpointProcessUnlock")?;
                f(pid, std::ptr::null_mut())
            }
            "state" => {
                let f: fns::PFN_cuCheckpointProcessGetState =
                    c.sym("cuCheckpointProcessGetState")?;
                let mut s: c_uint = 99;
                let r = f(pid, &mut s);
                extra = format!(" state={s}");
                r
            }
            "tid" => {
                let f: fns::PFN_cuCheckpointProcessGetRestoreThreadId =
                    c.sym("cuCheckpointProcessGetRestoreThreadId")?;
                let mut t: c_int = 0;
                let r = f(pid, &mut t);
                extra = format!(" tid={t}");
                r
            }
            other => bail!("unknown checkpoint operation {other:?}"),
        }
    };
    println!("ckpt_{op}={r} us={}{extra}", t0.elapsed().as_micros());
    Ok(())
}

pub fn timed_meminfo(st: &State) -> Result<()> {
    let t0 = Instant::now();
    let (f, t) = meminfo(st)?;
    println!("free={f} total={t} call_us={}", t0.elapsed().as_micros());
    Ok(())
}
