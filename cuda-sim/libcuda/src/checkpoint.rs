//! The driver's checkpoint API (`cuCheckpointProcess*`, CUDA 12.8, driver r570): one
//! process (the controller, a node daemon) locks another by pid, moves its device memory
//! to host memory and back, and unlocks it.
//!
//! Three parts, each running in a different place:
//! - the gate (`enter`), on every CUDA call of every process: while the process is
//!   locked its calls wait at the gate; it counts the calls in flight for the lock;
//! - the controller ([`control`], [`state_of`]), in the calling process: it finds the
//!   target's slot in the node's shared state, checks the transition
//!   ([`vgpu_cuda_sim::checkpoint_area::check_transition`]), posts the request and waits
//!   for the answer;
//! - the checkpoint thread ([`start_agent`], the driver's "restore thread"), in the
//!   target, where its device memory is mapped: it drains the work in flight (lock),
//!   copies the device memory out to host memory and releases it on the device
//!   (checkpoint), or takes the memory back and copies the bytes in at the same addresses
//!   (restore). Copies take at least what the host link's bandwidth allows
//!   (`[host] copy_gbps`), and checkpoints are held in the node's bounded host memory
//!   (`[host] memory`).
//!
//! What the simulator refuses to checkpoint (`CUDA_ERROR_NOT_SUPPORTED`): managed
//! (unified) memory, memory imported from or exported to another process (IPC), and the
//! virtual memory management API's physical allocations. See `docs/cuda-sim.md`.

use std::cell::Cell;
use std::sync::Mutex;
use std::sync::atomic::Ordering;
use std::time::Duration;

use vgpu_cuda_abi::cuda::*;
use vgpu_cuda_sim::checkpoint_area::{CkptOp, CkptSlot, check_transition, copy_ns};
use vgpu_sys::{futex_wait, futex_wake, mono_ns};

use crate::mem::AllocKind;
use crate::rt::{CuResult, Driver, driver};

const PAGE: usize = 4096;
/// How often a waiter re-checks that its peer process is still there.
const POLL: Duration = Duration::from_millis(100);

thread_local! {
    /// CUDA calls of this thread in progress (a call made inside another passes).
    static DEPTH: Cell<u32> = const { Cell::new(0) };
}

/// A CUDA call in progress, counted in the process's `inflight` until dropped.
pub(crate) struct Call(Option<&'static CkptSlot>);

impl Drop for Call {
    fn drop(&mut self) {
        DEPTH.with(|d| d.set(d.get().saturating_sub(1)));
        if let Some(s) = self.0 {
            s.inflight.fetch_sub(1, Ordering::AcqRel);
            if s.gate.load(Ordering::Acquire) != 0 {
                futex_wake(&s.inflight);
            }
        }
    }
}

/// Enters a CUDA call: waits while the process is locked, then counts the call in
/// flight. Before `cuInit` there is nothing to lock.
pub(crate) fn enter() -> Call {
    let depth = DEPTH.with(|d| {
        let v = d.get();
        d.set(v + 1);
        v
    });
    let Ok(drv) = driver() else {
        return Call(None);
    };
    if depth > 0 {
        return Call(None);
    }
    let s = drv.state.checkpoint().slot(drv.slot);
    loop {
        let g = s.gate.load(Ordering::Acquire);
        if g != 0 {
            futex_wait(&s.gate, g, POLL);
            continue;
        }
        s.inflight.fetch_add(1, Ordering::AcqRel);
        if s.gate.load(Ordering::Acquire) == 0 {
            return Call(Some(s));
        }
        // Locked between the two reads: step back and wait with the others.
        s.inflight.fetch_sub(1, Ordering::AcqRel);
        futex_wake(&s.inflight);
    }
}

// ---- the controller ----------------------------------------------------------------------

/// The slot of the CUDA process `pid` on this node.
fn slot_of(drv: &Driver, pid: i32) -> CuResult<usize> {
    let pid = u32::try_from(pid).map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
    drv.state
        .live_slots()
        .into_iter()
        .find(|&i| drv.state.pid_of(i) == pid)
        .ok_or(CUDA_ERROR_INVALID_VALUE)
}

/// `cuCheckpointProcessGetState`.
pub fn state_of(pid: i32) -> CuResult<u32> {
    let drv = driver()?;
    let i = slot_of(drv, pid)?;
    Ok(drv.state.checkpoint().slot(i).state.load(Ordering::Acquire))
}

/// `cuCheckpointProcessGetRestoreThreadId`.
pub fn restore_thread(pid: i32) -> CuResult<i32> {
    let drv = driver()?;
    let i = slot_of(drv, pid)?;
    let tid = drv
        .state
        .checkpoint()
        .slot(i)
        .agent_tid
        .load(Ordering::Acquire);
    if tid == 0 {
        return Err(CUDA_ERROR_NOT_SUPPORTED);
    }
    i32::try_from(tid).map_err(|_| CUDA_ERROR_INVALID_VALUE)
}

fn process_alive(pid: u32) -> bool {
    let Ok(p) = libc::pid_t::try_from(pid) else {
        return false;
    };
    // SAFETY: kill with signal 0 only checks that the process exists.
    let r = unsafe { libc::kill(p, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// Holds the target's operation word for this controller.
struct Busy<'a>(&'a CkptSlot);

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.0.busy.store(0, Ordering::Release);
        futex_wake(&self.0.busy);
    }
}

fn claim(s: &CkptSlot) -> Busy<'_> {
    let me = std::process::id();
    loop {
        match s
            .busy
            .compare_exchange(0, me, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => return Busy(s),
            // A controller that died mid-operation leaves its claim behind.
            Err(other) if !process_alive(other) => {
                let _ = s
                    .busy
                    .compare_exchange(other, 0, Ordering::AcqRel, Ordering::Relaxed);
            }
            Err(other) => {
                futex_wait(&s.busy, other, POLL);
            }
        }
    }
}

/// Runs `op` on the CUDA process `pid` (`arg`: the lock's timeout in ms, 0 for none).
pub fn control(pid: i32, op: CkptOp, arg: u32) -> CuResult<()> {
    let drv = driver()?;
    let i = slot_of(drv, pid)?;
    if i == drv.slot {
        // A process cannot wait for its own lock; the API is for a controller.
        return Err(CUDA_ERROR_NOT_SUPPORTED);
    }
    let area = drv.state.checkpoint();
    let s = area.slot(i);
    if s.agent_tid.load(Ordering::Acquire) == 0 {
        // No checkpoint thread (a forked child, or a driver without one).
        return Err(CUDA_ERROR_NOT_SUPPORTED);
    }
    let _busy = claim(s);
    let state = s.state.load(Ordering::Acquire);
    check_transition(op, state)?;
    let (_, after) = op.states();
    if op == CkptOp::Unlock {
        s.state.store(after, Ordering::Release);
        s.gate.store(0, Ordering::Release);
        futex_wake(&s.gate);
        return Ok(());
    }
    if op == CkptOp::Lock {
        // Close the gate first: from here on new calls wait, and the checkpoint thread
        // waits for the ones in flight.
        s.gate.store(1, Ordering::Release);
    }
    s.op.store(op as u32, Ordering::Relaxed);
    s.arg.store(arg, Ordering::Relaxed);
    let seq = s.req.fetch_add(1, Ordering::AcqRel).wrapping_add(1);
    futex_wake(&s.req);
    let r = loop {
        let done = s.done.load(Ordering::Acquire);
        if done == seq {
            break s.result.load(Ordering::Acquire);
        }
        if !futex_wait(&s.done, done, POLL) && !drv.state.live_slots().contains(&i) {
            // The target died; its slot is reclaimed with everything it held.
            break CUDA_ERROR_INVALID_VALUE;
        }
    };
    if r == CUDA_SUCCESS {
        s.state.store(after, Ordering::Release);
        Ok(())
    } else {
        if op == CkptOp::Lock {
            // A lock that timed out leaves the process RUNNING.
            s.gate.store(0, Ordering::Release);
            futex_wake(&s.gate);
        }
        Err(r)
    }
}

// ---- the checkpoint thread (in the target) -----------------------------------------------

/// Device memory copied out of one run of pages.
struct Run {
    addr: usize,
    bytes: Vec<u8>,
}

/// The process's checkpoint, held in its host memory.
struct Image {
    runs: Vec<Run>,
    /// Bytes of device memory the checkpoint stands for (the host memory it is charged).
    modelled: u64,
}

static IMAGE: Mutex<Option<Image>> = Mutex::new(None);

/// Starts the process's checkpoint thread (once; after `cuInit` succeeded).
pub fn start_agent(drv: &'static Driver) {
    static STARTED: std::sync::Once = std::sync::Once::new();
    STARTED.call_once(|| {
        let spawned = std::thread::Builder::new()
            .name("cuda-sim-ckpt".into())
            .spawn(move || agent(drv));
        if let Err(e) = spawned {
            eprintln!("vgpu cuda-sim: cannot start the checkpoint thread: {e}");
        }
    });
}

fn agent(drv: &'static Driver) {
    let s = drv.state.checkpoint().slot(drv.slot);
    // SAFETY: gettid takes no argument and cannot fail.
    let tid = unsafe { libc::gettid() };
    let mut seen = s.req.load(Ordering::Acquire);
    s.done.store(seen, Ordering::Release);
    s.agent_tid
        .store(u32::try_from(tid).unwrap_or(0), Ordering::Release);
    loop {
        futex_wait(&s.req, seen, Duration::from_secs(1));
        let now = s.req.load(Ordering::Acquire);
        if now == seen {
            continue;
        }
        seen = now;
        let arg = s.arg.load(Ordering::Relaxed);
        let r = match CkptOp::from_u32(s.op.load(Ordering::Relaxed)) {
            Some(CkptOp::Lock) => lock(drv, s, arg),
            Some(CkptOp::Checkpoint) => timed(s, || checkpoint(drv, s)),
            Some(CkptOp::Restore) => timed(s, || restore(drv, s)),
            Some(CkptOp::Unlock) | None => Err(CUDA_ERROR_INVALID_VALUE),
        };
        s.result
            .store(r.err().unwrap_or(CUDA_SUCCESS), Ordering::Release);
        s.done.store(now, Ordering::Release);
        futex_wake(&s.done);
    }
}

fn timed(s: &CkptSlot, f: impl FnOnce() -> CuResult<()>) -> CuResult<()> {
    let t0 = mono_ns();
    let r = f();
    s.last_ns.store(mono_ns() - t0, Ordering::Relaxed);
    r
}

/// Lock: waits for the calls in flight, then for the work queued on the devices, within
/// `timeout_ms` (0: no limit). The gate is already closed.
fn lock(drv: &'static Driver, s: &CkptSlot, timeout_ms: u32) -> CuResult<()> {
    let deadline = (timeout_ms != 0).then(|| mono_ns() + u64::from(timeout_ms) * 1_000_000);
    let left = || -> CuResult<Duration> {
        match deadline {
            None => Ok(POLL),
            Some(d) => {
                let now = mono_ns();
                if now >= d {
                    Err(CUDA_ERROR_NOT_READY)
                } else {
                    Ok(Duration::from_nanos(d - now).min(POLL))
                }
            }
        }
    };
    loop {
        let n = s.inflight.load(Ordering::Acquire);
        if n == 0 {
            break;
        }
        futex_wait(&s.inflight, n, left()?);
    }
    let slot = drv.state.slot(drv.slot);
    for d in 0..drv.device_count() {
        if slot.devs[d].contexts.load(Ordering::Acquire) == 0 {
            continue;
        }
        let w = drv.worker(d);
        let last = w.last_seq();
        while !w.is_done(last) {
            w.drain_within(left()?);
        }
    }
    Ok(())
}

/// The device memory ranges to move: (base, mapped length). Refuses what cannot be
/// checkpointed.
fn device_ranges(drv: &Driver) -> CuResult<Vec<(usize, usize)>> {
    let o = drv.objects();
    if !o.ipc.is_empty() || !o.vmm.is_empty() {
        return Err(CUDA_ERROR_NOT_SUPPORTED);
    }
    let mut out = Vec::new();
    for a in o.allocs.values() {
        match a.kind {
            AllocKind::Device | AllocKind::Pool(_) => {
                if a.map_len > 0 {
                    out.push((a.base as usize, a.map_len));
                }
            }
            AllocKind::Managed | AllocKind::IpcImport => return Err(CUDA_ERROR_NOT_SUPPORTED),
            AllocKind::VmmRange if !a.maps.is_empty() => return Err(CUDA_ERROR_NOT_SUPPORTED),
            AllocKind::VmmRange | AllocKind::Host | AllocKind::Registered => {}
        }
    }
    for arr in o.arrays.values() {
        if arr.map_len > 0 {
            out.push((arr.base, arr.map_len));
        }
    }
    Ok(out)
}

/// Which pages of `[base, base + len)` hold data (present or swapped); None if the page
/// map cannot be read (then every page is treated as holding data).
fn pages_in_use(base: usize, len: usize) -> Option<Vec<bool>> {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open("/proc/self/pagemap").ok()?;
    let n = len / PAGE;
    let mut raw = vec![0u8; n * 8];
    f.read_exact_at(&mut raw, (base / PAGE * 8) as u64).ok()?;
    Some(
        raw.chunks_exact(8)
            .map(|e| {
                let v = u64::from_le_bytes(e.try_into().expect("chunks of 8 bytes"));
                v & (3 << 62) != 0
            })
            .collect(),
    )
}

/// Copies the data-holding pages of a range into runs.
fn copy_out(base: usize, len: usize, runs: &mut Vec<Run>) {
    let used = pages_in_use(base, len);
    let n = len / PAGE;
    let mut p = 0;
    while p < n {
        let in_use = |q: usize| used.as_ref().is_none_or(|u| u[q]);
        if !in_use(p) {
            p += 1;
            continue;
        }
        let start = p;
        while p < n && in_use(p) {
            p += 1;
        }
        let addr = base + start * PAGE;
        let bytes = (p - start) * PAGE;
        // SAFETY: `[addr, addr + bytes)` lies in a mapping this driver made and still
        // owns (`device_ranges`); the process is locked and its device work drained, so
        // nothing writes it during the copy.
        let src = unsafe { std::slice::from_raw_parts(addr as *const u8, bytes) };
        runs.push(Run {
            addr,
            bytes: src.to_vec(),
        });
    }
}

/// Sleeps until `t0 + ns`: a copy takes at least what the link allows.
fn pace(t0: u64, ns: u64) {
    let until = t0.saturating_add(ns);
    while mono_ns() < until {
        vgpu_sys::clock::sleep_until(until);
    }
}

/// Checkpoint: the device memory goes to host memory and leaves the device.
fn checkpoint(drv: &'static Driver, s: &CkptSlot) -> CuResult<()> {
    let t0 = mono_ns();
    let ranges = device_ranges(drv)?;
    let modelled: u64 = ranges.iter().map(|&(_, l)| l as u64).sum();
    let area = drv.state.checkpoint();
    if !area.host_reserve(modelled) {
        return Err(CUDA_ERROR_OUT_OF_MEMORY);
    }
    let mut runs = Vec::new();
    for &(base, len) in &ranges {
        copy_out(base, len, &mut runs);
        // SAFETY: a private anonymous mapping this driver owns; MADV_DONTNEED drops its
        // pages (they read as zero until restored) and keeps the addresses reserved.
        unsafe { libc::madvise(base as *mut libc::c_void, len, libc::MADV_DONTNEED) };
    }
    for d in 0..drv.device_count() {
        let used = drv.state.slot(drv.slot).devs[d]
            .used
            .load(Ordering::Acquire);
        drv.state.release(drv.slot, d, used);
        s.moved[d].store(used, Ordering::Release);
    }
    s.host_bytes.store(modelled, Ordering::Release);
    *IMAGE.lock().unwrap_or_else(|p| p.into_inner()) = Some(Image { runs, modelled });
    pace(t0, copy_ns(modelled, area.copy_gbps()));
    Ok(())
}

/// Restore: the device memory is taken back (all or nothing) and the bytes copied in at
/// the addresses they left.
fn restore(drv: &'static Driver, s: &CkptSlot) -> CuResult<()> {
    let t0 = mono_ns();
    let mut taken = Vec::new();
    for d in 0..drv.device_count() {
        let bytes = s.moved[d].load(Ordering::Acquire);
        if bytes == 0 {
            continue;
        }
        if let Err(e) = drv.state.reserve(drv.slot, d, bytes, false) {
            for &(d, b) in &taken {
                drv.state.release(drv.slot, d, b);
            }
            return Err(match e {
                vgpu_cuda_sim::node_state::AllocError::DeviceLost => CUDA_ERROR_DEVICE_UNAVAILABLE,
                _ => CUDA_ERROR_OUT_OF_MEMORY,
            });
        }
        taken.push((d, bytes));
    }
    let image = IMAGE.lock().unwrap_or_else(|p| p.into_inner()).take();
    let modelled = image.as_ref().map_or(0, |i| i.modelled);
    for run in image.iter().flat_map(|i| &i.runs) {
        // SAFETY: `run.addr` is the start of `run.bytes.len()` bytes of a mapping this
        // driver still owns (allocations cannot be freed while the process is locked);
        // the host copy is a separate buffer.
        unsafe {
            std::ptr::copy_nonoverlapping(run.bytes.as_ptr(), run.addr as *mut u8, run.bytes.len())
        };
    }
    for m in &s.moved {
        m.store(0, Ordering::Release);
    }
    let area = drv.state.checkpoint();
    area.host_release(s.host_bytes.swap(0, Ordering::AcqRel));
    pace(t0, copy_ns(modelled, area.copy_gbps()));
    Ok(())
}
