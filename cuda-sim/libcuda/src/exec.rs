//! Asynchronous execution: streams, events, the per-device worker that runs queued work
//! on the simulated GPU, and graphs captured from streams.
//!
//! Each process has one worker thread per device it uses. Work submitted to any stream
//! of that device goes into the worker's single FIFO, so stream order (and the legacy
//! default stream's implicit synchronization) holds trivially; the simulated device runs
//! one kernel at a time, as the cost model charges each kernel the whole GPU. Kernels
//! need the device's execution engine, which the node's processes share through the
//! state file and hand over round-robin every time slice (see `vgpu_cuda_sim::node_state`).
//!
//! Device time runs on a virtual clock, not on the host: a kernel of `ns` starts when
//! the engine is free and its launch was submitted (whichever is later: the engine's
//! clock in the state file, the submission time of the work), ends `ns` later, and is
//! recorded as exactly `ns` of device time. The worker thread only waits (sleeps, never
//! spins) until the host clock passes that end before it publishes the completion. A
//! worker that the host's CPUs run late (saturated CPUs, a throttled container)
//! therefore publishes late but loses no device time and counts none it did not run: it
//! catches up on the work that was already queued, as a real GPU would have run it
//! meanwhile. (Before, the worker spun the host CPU for the last 30 µs of every kernel
//! and recorded the host time it took: a preempted worker turned its preemption into
//! device time, and its spinning took CPU from its own process.)

use std::collections::VecDeque;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use vgpu_cuda_abi::cuda::*;
use vgpu_sys::mono_ns;

use crate::rt::{CuResult, Driver, Kind, from_ptr, new_handle};

mod host_cpu;
mod tail;

/// Where a copy reads from.
#[derive(Debug, Clone)]
pub enum CopySrc {
    /// An address (device memory, or pinned host memory read at execution time).
    Ptr(usize),
    /// Bytes snapshotted when the copy was issued (pageable host memory).
    Bytes(Arc<Vec<u8>>),
}

/// One unit of queued device work.
#[derive(Debug, Clone)]
pub enum Work {
    /// A kernel that occupies the GPU for `ns` of device time.
    Kernel {
        /// Device time.
        ns: u64,
    },
    /// A copy of `len` bytes to `dst`.
    Copy {
        /// Destination address.
        dst: usize,
        /// Source.
        src: CopySrc,
        /// Bytes.
        len: usize,
    },
    /// A copy of `len` bytes between two GPUs, at `gbps` (the link's bandwidth, GB/s:
    /// see `crate::peer`).
    PeerCopy {
        /// Destination address.
        dst: usize,
        /// Source address.
        src: usize,
        /// Bytes.
        len: usize,
        /// Bandwidth of the link between the GPUs, GB/s (bytes per ns).
        gbps: u64,
    },
    /// A memset of `height` rows of `width` elements of `elem` bytes, `pitch` apart.
    Memset {
        /// First byte.
        dst: usize,
        /// Row pitch in bytes.
        pitch: usize,
        /// Element size: 1, 2 or 4.
        elem: u8,
        /// The value (low `elem` bytes used).
        value: u32,
        /// Elements per row.
        width: usize,
        /// Rows.
        height: usize,
    },
    /// Records an event.
    EventRecord {
        /// The event.
        ev: Arc<Event>,
        /// The record generation this op belongs to.
        gen_: u64,
    },
    /// A host function (`cuLaunchHostFunc`).
    Host {
        /// The function.
        f: usize,
        /// Its argument.
        data: usize,
    },
    /// A stream callback (`cuStreamAddCallback`).
    Callback {
        /// The function.
        f: usize,
        /// The stream handle passed back.
        stream: usize,
        /// Its argument.
        data: usize,
    },
    /// A stream-ordered free (`cuMemFreeAsync`).
    Free {
        /// The pointer.
        ptr: u64,
    },
    /// Waits for work of another device's worker.
    WaitOther {
        /// The device.
        dev: usize,
        /// The sequence number to wait for.
        seq: u64,
    },
    /// An instantiated graph's work, in order.
    Batch(Arc<Vec<Work>>),
    /// Waits until the word at `addr` meets `flags`' condition against `value`
    /// (`cuStreamWaitValue32`/`64`; [`wait_value_met`]).
    WaitValue {
        /// The word's address (device or mapped host memory, aligned).
        addr: usize,
        /// The operand.
        value: u64,
        /// `CU_STREAM_WAIT_VALUE_*` (the flush bit cleared).
        flags: u32,
        /// A 64-bit word.
        wide: bool,
    },
    /// Writes `value` to the word at `addr` (`cuStreamWriteValue32`/`64`).
    WriteValue {
        /// The word's address (device or mapped host memory, aligned).
        addr: usize,
        /// The value.
        value: u64,
        /// A 64-bit word.
        wide: bool,
    },
}

/// Whether a stream wait on a word reading `cur` against `value` with condition `flags`
/// (`CU_STREAM_WAIT_VALUE_GEQ`, `EQ`, `AND`, `NOR`) is over. 32-bit words compare their
/// low 32 bits; `GEQ` is cyclic (`(int32_t)(cur - value) >= 0`, as `cuda.h` defines it).
pub fn wait_value_met(cur: u64, value: u64, flags: u32, wide: bool) -> bool {
    use vgpu_cuda_abi::cuda::memop;
    let (cur, value) = if wide {
        (cur, value)
    } else {
        (cur & 0xffff_ffff, value & 0xffff_ffff)
    };
    let mask = if wide { u64::MAX } else { 0xffff_ffff };
    match flags {
        memop::WAIT_VALUE_GEQ if wide => cur.wrapping_sub(value) as i64 >= 0,
        memop::WAIT_VALUE_GEQ => (cur as u32).wrapping_sub(value as u32) as i32 >= 0,
        memop::WAIT_VALUE_EQ => cur == value,
        memop::WAIT_VALUE_AND => cur & value != 0,
        memop::WAIT_VALUE_NOR => !(cur | value) & mask != 0,
        _ => true,
    }
}

/// Reads the word of a stream memory operation (acquire: what the writer stored before
/// it is visible after).
///
/// # Safety
/// `addr` is aligned and valid for reads of the word, as checked when the operation was
/// queued (memory is unmapped only after this queue drains).
unsafe fn read_word(addr: usize, wide: bool) -> u64 {
    use std::sync::atomic::AtomicU32;
    if wide {
        // SAFETY: per the function's contract.
        unsafe { &*(addr as *const AtomicU64) }.load(Ordering::Acquire)
    } else {
        // SAFETY: per the function's contract.
        u64::from(unsafe { &*(addr as *const AtomicU32) }.load(Ordering::Acquire))
    }
}

impl Work {
    fn needs_engine(&self) -> bool {
        match self {
            Work::Kernel { .. } => true,
            Work::Batch(b) => b.iter().any(Work::needs_engine),
            _ => false,
        }
    }
}

#[derive(Debug, Default)]
struct Queue {
    /// (sequence number, submission time (monotonic ns), work).
    ops: VecDeque<(u64, u64, Work)>,
    next_seq: u64,
    /// When all of `ops` ends, kept as they come and go.
    tail: tail::Tail,
}

/// The per-device executor of one process.
#[derive(Debug)]
pub struct Worker {
    drv: &'static Driver,
    dev: usize,
    q: Mutex<Queue>,
    cv: Condvar,
    done_cv: Condvar,
    done: AtomicU64,
    /// Engine-clock time by which the work taken off the queue so far completes
    /// (`u64::MAX`: not known, e.g. waiting for the engine or running a copy).
    ahead: AtomicU64,
}

struct Engine {
    held: bool,
    /// The claim another process took the engine over at (0: none): this worker's work
    /// that ends by then ran before the take-over and is placed without the engine.
    lost_claim: u64,
    /// Engine-clock time the current hold began (the simulator's own time-slicing).
    slice_start: u64,
    /// Virtual time at which the work this worker ran so far completed (monotonic ns);
    /// never ahead of the host clock once published.
    pos: u64,
}

impl Worker {
    /// Starts the worker thread of device `dev`.
    pub fn start(drv: &'static Driver, dev: usize) -> Arc<Worker> {
        let w = Arc::new(Worker {
            drv,
            dev,
            q: Mutex::new(Queue::default()),
            cv: Condvar::new(),
            done_cv: Condvar::new(),
            done: AtomicU64::new(0),
            ahead: AtomicU64::new(0),
        });
        let w2 = w.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("cuda-sim-gpu{dev}"))
            .spawn(move || w2.run());
        if let Err(e) = spawned {
            eprintln!("vgpu cuda-sim: cannot start the device worker thread: {e}");
        }
        w
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.q.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues work; returns its sequence number.
    pub fn submit(&self, w: Work) -> u64 {
        let mut q = self.lock();
        q.next_seq += 1;
        let seq = q.next_seq;
        let engine = w.needs_engine();
        let at = mono_ns();
        q.tail.pushed(seq, &w, at);
        q.ops.push_back((seq, at, w));
        if engine {
            self.publish_claim(&q, self.ahead.load(Ordering::Acquire));
        }
        drop(q);
        self.cv.notify_one();
        seq
    }

    /// Whether the work with sequence number `seq` has completed.
    pub fn is_done(&self, seq: u64) -> bool {
        self.done.load(Ordering::Acquire) >= seq
    }

    /// Whether the work with sequence number `seq` has completed on the device's clock,
    /// even if this worker thread, starved of host CPU, has not caught up with it yet:
    /// what a query of a real GPU answers. Kernels and event records are timed from the
    /// queue (each starts when the engine and its submission are there); any other work
    /// before `seq` still waits for the worker.
    pub fn is_done_on_device(&self, seq: u64) -> bool {
        self.is_done(seq) || self.done_on_device_at(seq).is_some_and(|t| t <= mono_ns())
    }

    /// When the work with sequence number `seq` completes on the device's clock, as
    /// predicted from the queue (None: not predictable: a copy or host function before
    /// it, the worker in the middle of one, or another process waiting for the engine,
    /// which may take it between kernels).
    fn done_on_device_at(&self, seq: u64) -> Option<u64> {
        if self.drv.state.engine_contended(self.dev) {
            return None;
        }
        let q = self.lock();
        predicted_done(self.ahead.load(Ordering::Acquire), &q.ops, seq)
    }

    /// Blocks until the work with sequence number `seq` has completed on the device's
    /// clock: what a synchronization with a real GPU waits for (the device runs on
    /// while the process's threads are off the CPU). Where the queue predicts it, the
    /// caller sleeps until then, and does not wait for this worker thread, which a
    /// starved or throttled process runs late; otherwise it waits for the worker.
    /// The work's effects that the host can see (copies, host functions, frees) are not
    /// predictable, so they are always waited for.
    pub fn wait_on_device(&self, seq: u64) {
        loop {
            if self.is_done(seq) {
                return;
            }
            match self.done_on_device_at(seq) {
                Some(t) if t <= mono_ns() => return,
                Some(t) => wait_until(t),
                // Looked at again within a millisecond: the queue may become
                // predictable (the engine free again) before the worker catches up.
                None => {
                    self.wait_done(seq, Some(Instant::now() + Duration::from_millis(1)));
                }
            }
        }
    }

    /// Blocks until everything queued so far has completed on the device's clock
    /// ([`Worker::wait_on_device`]).
    pub fn synchronize(&self) {
        let seq = self.lock().next_seq;
        self.wait_on_device(seq);
    }

    /// Blocks until the work with sequence number `seq` has completed.
    pub fn wait_for(&self, seq: u64) {
        self.wait_done(seq, None);
    }

    /// Blocks until this worker has completed the work with sequence number `seq`, or
    /// `deadline` passes.
    fn wait_done(&self, seq: u64, deadline: Option<Instant>) {
        let mut q = self.lock();
        while self.done.load(Ordering::Acquire) < seq {
            q = match deadline {
                None => self.done_cv.wait(q).unwrap_or_else(|p| p.into_inner()),
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return;
                    }
                    self.done_cv
                        .wait_timeout(q, left)
                        .unwrap_or_else(|p| p.into_inner())
                        .0
                }
            };
        }
    }

    /// Blocks until everything queued so far has completed.
    pub fn drain(&self) {
        let seq = self.lock().next_seq;
        self.wait_for(seq);
    }

    /// [`Worker::drain`], giving up after `limit`.
    pub fn drain_within(&self, limit: Duration) {
        let seq = self.lock().next_seq;
        self.wait_done(seq, Some(Instant::now() + limit));
    }

    /// Publishes, while this process owns the engine, when its queued work ends on the
    /// engine's clock (its claim: see `State::engine_acquire`). `q` is the locked queue,
    /// `ahead` when the work taken off it so far completes (`u64::MAX`: not known).
    fn publish_claim(&self, q: &Queue, ahead: u64) {
        let st = &self.drv.state;
        if !st.engine_owned(self.drv.slot, self.dev) {
            return;
        }
        let claim = q.tail.end(ahead).unwrap_or(u64::MAX);
        st.engine_claim_set(self.drv.slot, self.dev, claim);
    }

    /// The sequence number of the last queued work.
    pub fn last_seq(&self) -> u64 {
        self.lock().next_seq
    }

    fn run(self: Arc<Self>) {
        // Precise sleeps: the default 50 µs timer slack would distort short kernels.
        // SAFETY: PR_SET_TIMERSLACK takes an integer argument and affects only this thread.
        unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1000 as libc::c_ulong) };
        host_cpu::leave_cpu_limit();
        let mut eng = Engine {
            held: false,
            lost_claim: 0,
            slice_start: 0,
            pos: 0,
        };
        loop {
            let (seq, at, work) = {
                let mut q = self.lock();
                loop {
                    if let Some(op) = q.ops.pop_front() {
                        q.tail.popped(op.0, &op.2, op.1);
                        // Under the lock: a query of the queue never sees the work taken
                        // off it with a position that does not count it yet (it would
                        // predict what comes after too early).
                        self.ahead.store(u64::MAX, Ordering::Release);
                        break op;
                    }
                    if eng.held {
                        self.release_engine(&mut eng);
                    }
                    q = self.cv.wait(q).unwrap_or_else(|p| p.into_inner());
                }
            };
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                self.execute(&work, at, &mut eng, true)
            }));
            self.ahead.store(eng.pos, Ordering::Release);
            if r.is_err() {
                eprintln!("vgpu cuda-sim: internal error while executing device work (skipped)");
            }
            // Keep the engine while more kernels are queued (event records and the like in
            // between do not need it); give it up when no kernel is left in the queue.
            let next_needs_engine = self.lock().ops.iter().any(|(_, _, w)| w.needs_engine());
            if eng.held && !next_needs_engine {
                self.release_engine(&mut eng);
            }
            let _q = self.lock();
            self.done.store(seq, Ordering::Release);
            self.done_cv.notify_all();
        }
    }

    /// Gives the engine up, its clock moved on to the end of this worker's work first.
    fn release_engine(&self, eng: &mut Engine) {
        self.drv.state.engine_clock_advance(self.dev, eng.pos);
        self.drv.state.engine_release(self.drv.slot, self.dev);
        eng.held = false;
    }

    /// Notices that another process took the engine over while this worker was off the
    /// CPU (`State::engine_acquire`): the work this worker claimed ran before.
    fn note_take_over(&self, eng: &mut Engine) {
        let st = &self.drv.state;
        if eng.held && !st.engine_owned(self.drv.slot, self.dev) {
            eng.held = false;
            eng.lost_claim = st.engine_lost_claim(self.drv.slot, self.dev);
        }
    }

    /// Runs one unit of work submitted at `at` (monotonic ns). `ends_unit`: nothing
    /// unpredictable follows this piece in the unit taken off the queue, so a kernel may
    /// publish its end as where the worker will be ([`Worker::run_kernel`]).
    fn execute(&self, work: &Work, at: u64, eng: &mut Engine, ends_unit: bool) {
        match work {
            Work::Kernel { ns } => self.run_kernel(*ns, at, eng, ends_unit),
            Work::Copy { dst, src, len } => {
                let start = mono_ns();
                match src {
                    // SAFETY: both ranges were validated when the copy was issued, and
                    // memory is only unmapped after draining this queue.
                    CopySrc::Ptr(s) => unsafe {
                        std::ptr::copy(*s as *const u8, *dst as *mut u8, *len)
                    },
                    // SAFETY: as above for `dst`; the staged bytes are at least `len` long.
                    CopySrc::Bytes(b) => unsafe {
                        std::ptr::copy_nonoverlapping(
                            b.as_ptr(),
                            *dst as *mut u8,
                            (*len).min(b.len()),
                        )
                    },
                }
                self.copy_time(*len as u64, start);
                eng.pos = eng.pos.max(mono_ns());
            }
            Work::PeerCopy {
                dst,
                src,
                len,
                gbps,
            } => {
                // Device time on this worker's clock, as a kernel's (see the module's
                // doc): the copy starts when the stream's earlier work and its submission
                // are there and lasts `bytes / link bandwidth`, however long the host takes
                // to move the bytes; events after it see exactly that. A copy engine, not
                // the execution engine: it does not take the GPU from other processes.
                let start = eng.pos.max(at);
                let end = start + *len as u64 / (*gbps).max(1);
                // SAFETY: both device ranges were validated when the copy was issued, and
                // memory is only unmapped after draining this queue.
                unsafe { std::ptr::copy(*src as *const u8, *dst as *mut u8, *len) };
                wait_until(end);
                eng.pos = end;
            }
            Work::Memset {
                dst,
                pitch,
                elem,
                value,
                width,
                height,
            } => {
                // SAFETY: the rows were validated against the allocation when issued.
                unsafe { memset_rows(*dst, *pitch, *elem, *value, *width, *height) };
            }
            Work::EventRecord { ev, gen_ } => {
                // The event's time is where the stream is on the device's clock: after
                // the work before it, not before it was recorded.
                if ev.gen_.load(Ordering::Acquire) == *gen_ {
                    let t = eng.pos.max(at).min(mono_ns());
                    ev.time.store(t.max(1), Ordering::Release);
                    // A graph's record node: the event was last recorded by the graph.
                    ev.captured.store(false, Ordering::Release);
                }
            }
            Work::Host { f, data } => {
                // SAFETY: `f` is the CUhostFn the application passed (non-null, checked
                // when queued); CUDA calls it with its user data on a driver thread.
                let f: unsafe extern "C" fn(*mut c_void) = unsafe { std::mem::transmute(*f) };
                // SAFETY: as above.
                unsafe { f(*data as *mut c_void) };
            }
            Work::Callback { f, stream, data } => {
                // SAFETY: `f` is the application's CUstreamCallback, checked non-null.
                let f: unsafe extern "C" fn(CUstream, CUresult, *mut c_void) =
                    unsafe { std::mem::transmute(*f) };
                // SAFETY: as above.
                unsafe { f(*stream as CUstream, CUDA_SUCCESS, *data as *mut c_void) };
            }
            Work::Free { ptr } => crate::mem::free_now(self.drv, *ptr),
            Work::WaitOther { dev, seq } => self.drv.worker(*dev).wait_for(*seq),
            Work::WaitValue {
                addr,
                value,
                flags,
                wide,
            } => self.wait_value(*addr, *value, *flags, *wide, eng),
            Work::WriteValue { addr, value, wide } => {
                use std::sync::atomic::AtomicU32;
                // The write comes after the work before it on the device's clock.
                wait_until(eng.pos.max(at));
                // SAFETY: checked aligned and mapped when queued (see `read_word`).
                unsafe {
                    if *wide {
                        (&*(*addr as *const AtomicU64)).store(*value, Ordering::Release);
                    } else {
                        (&*(*addr as *const AtomicU32)).store(*value as u32, Ordering::Release);
                    }
                }
                eng.pos = eng.pos.max(at);
            }
            Work::Batch(b) => {
                for (i, w) in b.iter().enumerate() {
                    // A kernel followed by a copy, a memset or a host function in the
                    // same unit (a graph, the fill kernel) does not end it: the host must
                    // not see the unit done, on the device's clock, before those effects.
                    let rest_predictable = b[i + 1..].iter().all(|x| tail::step(x, at).is_some());
                    self.execute(w, at, eng, ends_unit && rest_predictable);
                }
            }
        }
    }

    /// A stream's wait on a word (`cuStreamWaitValue32`/`64`): the engine is given up
    /// while the condition does not hold (a real GPU runs other contexts meanwhile), the
    /// word is looked at again after 10 µs, doubling to 160 µs, and the device's clock
    /// resumes when the condition is seen to hold (not moved when it held at the first
    /// look: the device did not wait). The simulator's one queue per process
    /// and device means the wait holds up the process's other streams on that device too
    /// (a real GPU's other streams go on): a wait for a word that a later operation of
    /// the same process on another stream writes never ends here.
    fn wait_value(&self, addr: usize, value: u64, flags: u32, wide: bool, eng: &mut Engine) {
        let mut nap = 10_000u64;
        let mut waited = false;
        loop {
            // SAFETY: checked when the operation was queued (see `read_word`).
            let cur = unsafe { read_word(addr, wide) };
            if wait_value_met(cur, value, flags, wide) {
                if waited {
                    eng.pos = eng.pos.max(mono_ns());
                }
                return;
            }
            waited = true;
            if eng.held {
                self.release_engine(eng);
            }
            wait_until(mono_ns() + nap);
            nap = (nap * 2).min(160_000);
        }
    }

    /// Device time of a copy: the real memcpy time, stretched to the device's bandwidth.
    fn copy_time(&self, bytes: u64, start: u64) {
        let bw = u64::from(self.drv.state.info(self.dev).bandwidth_gbps).max(1);
        let ns = bytes / bw; // bytes / (GB/s) = ns
        sleep_until(start + ns);
    }

    /// Runs a kernel of `ns` device time submitted at `at`, on the engine's virtual
    /// clock (see the module's doc): it starts when both the engine and the launch are
    /// there, in chunks of at most the engine's time slice when other processes wait.
    /// `publish`: its end is where the worker will be once done with the unit of work it
    /// took off the queue (see [`Worker::is_done_on_device`]); otherwise the worker's
    /// position stays unknown until the unit is done.
    fn run_kernel(&self, ns: u64, at: u64, eng: &mut Engine, publish: bool) {
        let st = &self.drv.state;
        let slice = st.timeslice().as_nanos() as u64;
        let mut remaining = ns.max(1);
        let mut ready = at;
        while remaining > 0 {
            self.note_take_over(eng);
            // What a take-over's claim covered ran before it: placed without the engine.
            let covered = !eng.held && eng.pos.max(ready) + remaining <= eng.lost_claim;
            if !eng.held && !covered {
                eng.lost_claim = 0;
                st.engine_acquire(self.drv.slot, self.dev);
                eng.held = true;
                // Nothing of another process runs after the clock's reading: its owner
                // moved it on before handing the engine over.
                eng.pos = eng.pos.max(st.engine_clock(self.dev));
                eng.slice_start = eng.pos.max(ready);
            }
            let start = eng.pos.max(ready);
            let left_in_slice = (eng.slice_start + slice).saturating_sub(start).max(1000);
            let chunk = if covered {
                remaining
            } else {
                remaining.min(left_in_slice)
            };
            let end = start + chunk;
            if chunk == remaining {
                if publish {
                    self.ahead.store(end, Ordering::Release);
                }
                self.publish_claim(&self.lock(), end);
            } else if eng.held {
                // A chunk of a longer kernel: the engine is this process's until the
                // chunk's end, and another process may take it over from then if this
                // worker is off the CPU (a real GPU time-slices to the next context
                // whatever this process's threads do). Without it a throttled owner held
                // the engine through its whole stop.
                st.engine_claim_set(self.drv.slot, self.dev, end);
            }
            wait_until(end);
            st.add_busy(self.drv.slot, self.dev, start, end);
            eng.pos = end;
            ready = end;
            remaining -= chunk;
            if end >= eng.slice_start + slice {
                self.note_take_over(eng);
                if eng.held {
                    if st.engine_contended(self.dev) {
                        self.release_engine(eng);
                    } else {
                        eng.slice_start = end;
                    }
                }
            }
        }
    }
}

/// When the queued work up to sequence number `seq` completes on the engine's clock, the
/// work already taken off the queue completing at `ahead` (`u64::MAX`: not known); None
/// when not predictable from the queue ([`predicted_end`]).
fn predicted_done(ahead: u64, ops: &VecDeque<(u64, u64, Work)>, seq: u64) -> Option<u64> {
    if ahead == u64::MAX {
        return None;
    }
    let mut pos = ahead;
    for (s, at, w) in ops {
        if *s > seq {
            break;
        }
        pos = predicted_end(w, pos, *at)?;
    }
    Some(pos)
}

/// When queued work `w` submitted at `at` would end on the engine's clock if it starts
/// at `pos` (None: not predictable from the queue, such as a copy or a host function).
fn predicted_end(w: &Work, pos: u64, at: u64) -> Option<u64> {
    tail::step(w, at).map(|(a, b)| (pos + a).max(b))
}

/// Sleeps until the monotonic clock reads `deadline` (ns), without spinning: a late
/// wake-up delays when the host sees the work complete, never the device's clock.
fn wait_until(deadline: u64) {
    loop {
        if mono_ns() >= deadline {
            return;
        }
        vgpu_sys::clock::sleep_until(deadline);
    }
}

/// Sleeps until the monotonic clock reads `deadline` (ns). The last stretch is spun,
/// so that device times of a few microseconds are honoured.
pub(crate) fn sleep_until(deadline: u64) {
    const SPIN_NS: u64 = 30_000;
    let now = mono_ns();
    if deadline > now + SPIN_NS {
        vgpu_sys::clock::sleep_until(deadline - SPIN_NS);
    }
    while mono_ns() < deadline {
        std::hint::spin_loop();
    }
}

/// Fills rows with a 1-, 2- or 4-byte pattern.
///
/// # Safety
/// Every row `[dst + r*pitch, dst + r*pitch + width*elem)` must be writable memory.
pub unsafe fn memset_rows(
    dst: usize,
    pitch: usize,
    elem: u8,
    value: u32,
    width: usize,
    height: usize,
) {
    for r in 0..height {
        let row = dst + r * pitch;
        match elem {
            // SAFETY: the caller guarantees the row is writable.
            1 => unsafe { std::ptr::write_bytes(row as *mut u8, value as u8, width) },
            2 => {
                for i in 0..width {
                    // SAFETY: within the row; unaligned writes are fine.
                    unsafe { std::ptr::write_unaligned((row as *mut u16).add(i), value as u16) };
                }
            }
            _ => {
                for i in 0..width {
                    // SAFETY: within the row; unaligned writes are fine.
                    unsafe { std::ptr::write_unaligned((row as *mut u32).add(i), value) };
                }
            }
        }
    }
}

/// A stream capture in progress.
#[derive(Debug, Default)]
pub struct Capture {
    /// Captured work, in order.
    pub work: Vec<Work>,
    /// `CUstreamCaptureMode`.
    pub mode: u32,
    /// Set when an illegal operation invalidated the capture.
    pub invalid: bool,
    /// Capture sequence id.
    pub id: u64,
    /// The graph the capture adds its nodes to (`cuStreamBeginCaptureToGraph`); None:
    /// a new graph at the end.
    pub into: Option<u64>,
}

/// A stream.
#[derive(Debug)]
pub struct Stream {
    /// Handle value (for default streams, a private id).
    pub id: u64,
    /// Owning context.
    pub ctx: u64,
    /// Device.
    pub dev: usize,
    /// `CU_STREAM_*` flags.
    pub flags: u32,
    /// Priority.
    pub priority: i32,
    /// Sequence number of the last work queued on it.
    pub last: AtomicU64,
    /// Capture state.
    pub capture: Mutex<Option<Capture>>,
}

static CAPTURE_IDS: AtomicU64 = AtomicU64::new(1);

impl Stream {
    /// A context's default stream.
    pub fn new_default(ctx: u64, dev: usize) -> Arc<Stream> {
        Stream::new(ctx, dev, 0, 0)
    }

    /// A new stream.
    pub fn new(ctx: u64, dev: usize, flags: u32, priority: i32) -> Arc<Stream> {
        Arc::new(Stream {
            id: new_handle(Kind::Stream),
            ctx,
            dev,
            flags,
            priority,
            last: AtomicU64::new(0),
            capture: Mutex::new(None),
        })
    }

    fn capture_lock(&self) -> std::sync::MutexGuard<'_, Option<Capture>> {
        self.capture.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether the stream is capturing.
    pub fn is_capturing(&self) -> bool {
        self.capture_lock().is_some()
    }

    /// Queues work on the stream (or records it into the capture in progress).
    pub fn enqueue(&self, drv: &'static Driver, w: Work) -> CuResult<()> {
        {
            let mut cap = self.capture_lock();
            if let Some(c) = cap.as_mut() {
                if matches!(w, Work::Free { .. } | Work::WaitOther { .. }) {
                    c.invalid = true;
                    return Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
                }
                c.work.push(w);
                return Ok(());
            }
        }
        let seq = drv.worker(self.dev).submit(w);
        self.last.store(seq, Ordering::Release);
        Ok(())
    }

    /// Fails (and invalidates the capture) if the stream is capturing: synchronizing
    /// or querying a capturing stream is illegal.
    pub fn check_not_capturing(&self) -> CuResult<()> {
        let mut cap = self.capture_lock();
        if let Some(c) = cap.as_mut() {
            c.invalid = true;
            return Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
        }
        Ok(())
    }

    /// Invalidates the capture in progress on this stream, if any (true: there was one).
    /// A synchronization of the whole device does it to every capture on the device,
    /// whatever thread or capture mode made it.
    pub fn invalidate_capture(&self) -> bool {
        match self.capture_lock().as_mut() {
            Some(c) => {
                c.invalid = true;
                true
            }
            None => false,
        }
    }

    /// `cuStreamSynchronize`.
    pub fn synchronize(&self, drv: &'static Driver) -> CuResult<()> {
        self.check_not_capturing()?;
        drv.worker(self.dev)
            .wait_on_device(self.last.load(Ordering::Acquire));
        Ok(())
    }

    /// `cuStreamQuery`.
    pub fn query(&self, drv: &'static Driver) -> CuResult<()> {
        self.check_not_capturing()?;
        if drv
            .worker(self.dev)
            .is_done_on_device(self.last.load(Ordering::Acquire))
        {
            Ok(())
        } else {
            Err(CUDA_ERROR_NOT_READY)
        }
    }

    /// `cuStreamBeginCapture` (`into`: the graph of `cuStreamBeginCaptureToGraph`).
    pub fn begin_capture(&self, mode: u32, into: Option<u64>) -> CuResult<()> {
        let mut cap = self.capture_lock();
        if cap.is_some() {
            return Err(CUDA_ERROR_ILLEGAL_STATE);
        }
        *cap = Some(Capture {
            mode,
            id: CAPTURE_IDS.fetch_add(1, Ordering::Relaxed),
            into,
            ..Capture::default()
        });
        Ok(())
    }

    /// `cuStreamEndCapture`: the captured work, and the graph it goes into (None: a new
    /// one).
    pub fn end_capture(&self) -> CuResult<(Vec<Work>, Option<u64>)> {
        let c = self.capture_lock().take().ok_or(CUDA_ERROR_ILLEGAL_STATE)?;
        if c.invalid {
            return Err(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
        }
        Ok((c.work, c.into))
    }

    /// Capture status (0 none, 1 active, 2 invalidated), id, and the graph it adds to
    /// (`cuStreamBeginCaptureToGraph`'s).
    pub fn capture_info(&self) -> (u32, u64, Option<u64>) {
        match &*self.capture_lock() {
            None => (0, 0, None),
            Some(c) if c.invalid => (2, c.id, c.into),
            Some(c) => (1, c.id, c.into),
        }
    }
}

/// An event.
#[derive(Debug)]
pub struct Event {
    /// Handle.
    pub id: u64,
    /// `CU_EVENT_*` flags.
    pub flags: u32,
    /// Current record generation.
    pub gen_: AtomicU64,
    /// (device, sequence) of the latest record, if any.
    pub rec: Mutex<Option<(usize, u64)>>,
    /// Device time at which the latest record completed (mono ns; 0 = not yet).
    pub time: AtomicU64,
    /// The latest record was made into a stream capture: querying, synchronizing or
    /// timing the event is refused (`CUDA_ERROR_CAPTURED_EVENT`) until it is recorded
    /// outside one (or a graph's record node records it).
    pub captured: AtomicBool,
}

/// `CU_EVENT_DISABLE_TIMING`.
pub const CU_EVENT_DISABLE_TIMING: u32 = 0x2;

impl Event {
    /// A new event.
    pub fn new(flags: u32) -> Arc<Event> {
        Arc::new(Event {
            id: new_handle(Kind::Event),
            flags,
            gen_: AtomicU64::new(0),
            rec: Mutex::new(None),
            time: AtomicU64::new(0),
            captured: AtomicBool::new(false),
        })
    }

    fn rec(&self) -> Option<(usize, u64)> {
        *self.rec.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `cuEventRecord` on `stream` (`external`: `cuEventRecordWithFlags` with
    /// `CU_EVENT_RECORD_EXTERNAL`). Into a stream capture, a plain record only marks a
    /// point of the capture (for other captured streams to wait on), not a node of the
    /// graph; an external one is a node that records the event when the graph runs.
    /// Either way the event was last recorded in a capture.
    pub fn record(
        self: &Arc<Self>,
        drv: &'static Driver,
        stream: &Stream,
        external: bool,
    ) -> CuResult<()> {
        let gen_ = self.gen_.fetch_add(1, Ordering::AcqRel) + 1;
        if stream.is_capturing() {
            if external {
                stream.enqueue(
                    drv,
                    Work::EventRecord {
                        ev: self.clone(),
                        gen_,
                    },
                )?;
            }
            self.captured.store(true, Ordering::Release);
            return Ok(());
        }
        self.captured.store(false, Ordering::Release);
        self.time.store(0, Ordering::Release);
        let w = drv.worker(stream.dev);
        // Hold the record slot while queuing, so a concurrent query sees a consistent pair.
        let mut rec = self.rec.lock().unwrap_or_else(|p| p.into_inner());
        let seq = w.submit(Work::EventRecord {
            ev: self.clone(),
            gen_,
        });
        stream.last.store(seq, Ordering::Release);
        *rec = Some((stream.dev, seq));
        Ok(())
    }

    /// Refuses an event last recorded in a capture.
    fn check_not_captured(&self) -> CuResult<()> {
        if self.captured.load(Ordering::Acquire) {
            return Err(CUDA_ERROR_CAPTURED_EVENT);
        }
        Ok(())
    }

    /// `cuEventQuery`.
    pub fn query(&self, drv: &'static Driver) -> CuResult<()> {
        self.check_not_captured()?;
        match self.rec() {
            None => Ok(()),
            Some((d, seq)) if drv.worker(d).is_done_on_device(seq) => Ok(()),
            Some(_) => Err(CUDA_ERROR_NOT_READY),
        }
    }

    /// `cuEventSynchronize`.
    pub fn synchronize(&self, drv: &'static Driver) -> CuResult<()> {
        self.check_not_captured()?;
        if let Some((d, seq)) = self.rec() {
            drv.worker(d).wait_on_device(seq);
        }
        Ok(())
    }

    /// (device, seq) a stream must wait for to follow this event.
    pub fn wait_point(&self) -> Option<(usize, u64)> {
        self.rec()
    }

    /// `cuEventElapsedTime`, in milliseconds.
    pub fn elapsed_ms(drv: &'static Driver, start: &Event, end: &Event) -> CuResult<f32> {
        if start.flags & CU_EVENT_DISABLE_TIMING != 0 || end.flags & CU_EVENT_DISABLE_TIMING != 0 {
            return Err(CUDA_ERROR_INVALID_HANDLE);
        }
        start.check_not_captured()?;
        end.check_not_captured()?;
        if start.rec().is_none() || end.rec().is_none() {
            return Err(CUDA_ERROR_INVALID_HANDLE);
        }
        start.query(drv)?;
        end.query(drv)?;
        match (start.device_time(drv), end.device_time(drv)) {
            (Some(a), Some(b)) => Ok((b as f64 - a as f64) as f32 / 1e6),
            _ => Err(CUDA_ERROR_NOT_READY),
        }
    }

    /// The device-clock time the latest record of this completed event completed at.
    /// The worker writes it when it gets to the record, which a starved worker (or one
    /// between taking work off its queue and marking it done) does after the event has
    /// completed on the device's clock; until then the queue's prediction is the time
    /// (what the worker will write), else the worker is waited for.
    fn device_time(&self, drv: &'static Driver) -> Option<u64> {
        let t = self.time.load(Ordering::Acquire);
        if t != 0 {
            return Some(t);
        }
        let (d, seq) = self.rec()?;
        let w = drv.worker(d);
        if let Some(t) = w.done_on_device_at(seq).filter(|&t| t <= mono_ns()) {
            return Some(t.max(1));
        }
        w.wait_for(seq);
        let t = self.time.load(Ordering::Acquire);
        (t != 0).then_some(t)
    }
}

/// A graph: work in a valid execution order (insertion order).
#[derive(Debug, Default, Clone)]
pub struct Graph {
    /// The nodes' work.
    pub work: Vec<Work>,
}

/// Resolves a stream handle: null, `CU_STREAM_LEGACY` and `CU_STREAM_PER_THREAD` name the
/// current context's default stream.
pub fn resolve_stream(drv: &'static Driver, h: CUstream) -> CuResult<Arc<Stream>> {
    let v = h as usize;
    if v == 0 || v == CU_STREAM_LEGACY || v == CU_STREAM_PER_THREAD {
        return Ok(drv.current()?.default_stream.clone());
    }
    let id = from_ptr(h, Kind::Stream)?;
    drv.objects()
        .streams
        .get(&id)
        .cloned()
        .ok_or(CUDA_ERROR_INVALID_HANDLE)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kernel(seq: u64, at: u64, ns: u64) -> (u64, u64, Work) {
        (seq, at, Work::Kernel { ns })
    }

    #[test]
    fn stream_waits_compare_as_cuda_h_defines() {
        use vgpu_cuda_abi::cuda::memop::*;
        // GEQ is cyclic: a counter that wrapped is still ahead of the value.
        assert!(wait_value_met(5, 5, WAIT_VALUE_GEQ, false));
        assert!(!wait_value_met(4, 5, WAIT_VALUE_GEQ, false));
        assert!(wait_value_met(2, 0xffff_fffe, WAIT_VALUE_GEQ, false));
        assert!(!wait_value_met(0xffff_fffe, 2, WAIT_VALUE_GEQ, false));
        assert!(wait_value_met(1, u64::MAX, WAIT_VALUE_GEQ, true));
        // A 32-bit wait reads the low word only.
        assert!(wait_value_met(0x1_0000_0007, 7, WAIT_VALUE_EQ, false));
        assert!(!wait_value_met(0x1_0000_0007, 7, WAIT_VALUE_EQ, true));
        assert!(wait_value_met(0b0110, 0b0100, WAIT_VALUE_AND, false));
        assert!(!wait_value_met(0b0010, 0b0100, WAIT_VALUE_AND, false));
        // NOR: some bit is clear in both.
        assert!(wait_value_met(
            0xffff_0000,
            0x0000_fff0,
            WAIT_VALUE_NOR,
            false
        ));
        assert!(!wait_value_met(
            0xffff_0000,
            0x0000_ffff,
            WAIT_VALUE_NOR,
            false
        ));
        assert!(wait_value_met(
            0xffff_0000,
            0x0000_ffff,
            WAIT_VALUE_NOR,
            true
        ));
    }

    #[test]
    fn queued_kernels_are_done_on_the_device_clock_however_late_the_worker_is() {
        // The worker's work so far ends at 1000; two kernels were submitted at 500 and
        // 5000: the first starts at 1000 (the engine), the second at its submission.
        let ops: VecDeque<_> = [kernel(1, 500, 100), kernel(2, 5000, 300)].into();
        assert_eq!(predicted_done(1000, &ops, 1), Some(1100));
        assert_eq!(predicted_done(1000, &ops, 2), Some(5300));
        // Work already done (seq 0) ends where the worker is.
        assert_eq!(predicted_done(1000, &ops, 0), Some(1000));
        // Unknown while the worker runs something it cannot predict.
        assert_eq!(predicted_done(u64::MAX, &ops, 2), None);
        // A copy before the work waited for: its effect is the host's, not predictable.
        let mut with_copy = ops.clone();
        with_copy.push_front((
            0,
            400,
            Work::Copy {
                dst: 0,
                src: CopySrc::Ptr(0),
                len: 0,
            },
        ));
        assert_eq!(predicted_done(1000, &with_copy, 2), None);
        // A copy after it does not matter.
        let mut after = ops.clone();
        after.push_back((
            3,
            6000,
            Work::Copy {
                dst: 0,
                src: CopySrc::Ptr(0),
                len: 0,
            },
        ));
        assert_eq!(predicted_done(1000, &after, 2), Some(5300));
    }
}
