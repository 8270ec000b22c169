//! The launch gate: every kernel launch path (`cuLaunchKernel`, `Ex`, cooperative,
//! `_ptsz`, graph launches) passes [`enter`] before the real driver runs it.
//!
//! Fast path (the container holds its slice): one load of the grant word in shared
//! memory, the in-flight counter, the queue-ahead budget: no syscall, no lock. A
//! blocked launch tells the daemon (one frame on the socket) and waits on the grant
//! word with a futex; it never sleeps in a loop. A launch out of budget looks at the
//! marker events itself, and between looks waits on the budget word (ADR 0028).
//!
//! One thread per process (the "gate thread") talks to the daemon: it registers (the
//! daemon takes the process's PID from the socket), receives grants and revocations,
//! drains the process's queued work when a slice ends (waits for launches in flight,
//! then synchronizes each of the process's contexts on that GPU) and reports when the
//! work completed, which is how the daemon measures GPU time. While holding, it bounds
//! the work queued ahead (an estimate from measured per-launch time), and yields the
//! slice when the process stops launching.
//!
//! Without a daemon (not running, dead, refusing, frozen), the gate thread runs a local
//! fallback: a duty cycle at the container's share over measured time (share 100: open)
//! and reconnects (after 250 ms, doubling to 2 s); a daemon that comes back gets the
//! process re-registered, and is told how long the process enforced locally.
//!
//! A grant does not outlast a late daemon: past the expiry the daemon writes beside the
//! grant word (its slice's end plus a margin), the gate thread yields it as if revoked
//! (ADR 0036).
//!
//! Every wait on the daemon has a deadline: the whole handshake (connect, `Hello`, the
//! `Welcome`) `HANDSHAKE_DEADLINE_MS`; with launches blocked, a daemon that stays
//! silent is pinged and given `PEER_DEADLINE_MS` to answer (`vgpu_core::sched_proto`). Past either, the process
//! falls back and says so once (one stderr line per fallback period, none per retry).
//!
//! With a quota file, only the GPUs it grants are registered; a launch on a visible GPU
//! it does not list is refused (`NotGranted`, `CUDA_ERROR_NOT_PERMITTED` at the hook),
//! said once per device: such a GPU has no memory and no compute share.
//!
//! This file is the fast path and the gates' shared state; `runner` is the gate thread
//! (daemon client and local fallback), `peer` its socket calls, each with a bound.

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock, RwLock};
use std::time::{Duration, Instant};

use vgpu_core::sched_proto::{
    CLAIM_TIME_OFFSET, EXPIRY_AT_OFFSET, EXPIRY_GEN_OFFSET, GrantWord, ShimMsg, encode,
};
use vgpu_sys::{futex_wait, futex_wake};

use crate::config::MAX_DEVICES;
use crate::process::Shim;

pub(crate) mod peer;
mod runner;

use runner::Runner;

/// No generation yielded.
const NONE: u32 = u32::MAX;
/// The local word of an open gate: held, generation 0.
const OPEN: u32 = GrantWord::held(0).pack();
/// How often a blocked launcher repeats its demand (lost-message safety net).
const DEMAND_REPEAT: Duration = Duration::from_millis(100);
/// Gate thread tick while the process holds a slice somewhere.
const TICK: Duration = Duration::from_micros(500);
/// Ticks without a launch before the process yields a slice it holds.
const IDLE_TICKS: u32 = 4;
/// Fallback duty-cycle period's open part at most (then the share decides the rest).
const LOCAL_QUANTUM_NS: u64 = 10_000_000;
/// First reconnect interval without a daemon (doubles after each failure).
const RECONNECT: Duration = Duration::from_millis(250);
/// Longest reconnect interval.
const RECONNECT_MAX: Duration = Duration::from_secs(2);
/// Silence from the daemon, with launches blocked, after which the gate thread pings it.
const PING_AFTER: Duration = Duration::from_millis(250);
/// Not a registered GPU (no protocol index).
const UNREGISTERED: u32 = u32::MAX;
/// How often a drain re-checks launches in flight (a sleep, not a yield: a real-time
/// gate thread that yields never lets a time-sharing launcher on its CPU run).
const INFLIGHT_POLL: Duration = Duration::from_micros(50);
/// The gate thread's real-time priority when the process may use one (ADR 0013).
const GATE_RT_PRIORITY: i32 = 1;

/// Puts the gate thread in SCHED_FIFO at the lowest real-time priority when the process
/// is allowed to (CAP_SYS_NICE or RLIMIT_RTPRIO, and real-time runtime in its cgroup):
/// on a node whose CPUs are saturated it then answers revocations and feeds the
/// queue-ahead budget at once. Otherwise it stays where it is, which is correct, only
/// slower to hand over (the daemon charges the tenant for the delay). The thread only
/// waits (poll, futex, sleeps), so it cannot monopolise a CPU; children reset to the
/// default class.
fn raise_gate_thread_priority(shim: &Shim) {
    let param = libc::sched_param {
        sched_priority: GATE_RT_PRIORITY,
    };
    // SAFETY: pid 0 is the calling thread (the gate thread); `param` is initialised and
    // outlives the call; failure changes nothing.
    let r = unsafe {
        libc::sched_setscheduler(0, libc::SCHED_FIFO | libc::SCHED_RESET_ON_FORK, &param)
    };
    if r != 0 {
        let e = std::io::Error::last_os_error();
        crate::process::log(shim, || {
            format!("gate thread stays in the time-sharing class ({e})")
        });
    }
}

/// Contexts may not be destroyed while the gate thread synchronizes them: destroy
/// hooks take this for writing, the drain for reading (held across the real
/// `cuCtxSynchronize`, which only waits for finite queued work).
pub static CTX_LOCK: RwLock<()> = RwLock::new(());

/// One GPU's gate in this process.
#[derive(Debug)]
pub struct Gate {
    enabled: AtomicBool,
    /// The container was not granted this GPU: launches are refused.
    not_granted: AtomicBool,
    /// The refusal was said (once per device).
    refusal_said: AtomicBool,
    /// The GPU's index in this connection's `Hello` ([`UNREGISTERED`]: none).
    proto: AtomicU32,
    word: AtomicPtr<AtomicU32>,
    local: AtomicU32,
    yielded: AtomicU32,
    inflight: AtomicU32,
    launched: AtomicU64,
    /// This GPU's word of the tenant's claim page (null: none; ADR 0030).
    claim: AtomicPtr<AtomicU32>,
    /// The grant word last claimed (0, never a held word: none).
    claimed: AtomicU32,
    /// Launches may proceed while `launched < budget` (= completed + allowed).
    budget: AtomicU64,
    budget_seq: AtomicU32,
    waiting: AtomicU32,
    /// Launchers waiting for budget.
    budget_waiting: AtomicU32,
    /// Launches known to have completed (from marker events and drains).
    completed: AtomicU64,
    /// Launches allowed beyond `completed` (u64::MAX / 2: unbounded).
    allowed: AtomicU64,
    /// A launcher's look found every launch complete with the budget spent (taken by the
    /// gate thread's next poll: the count grows as when a poll finds it so).
    ran_dry: AtomicBool,
    /// Record a marker event at this launch count.
    next_mark: AtomicU64,
    /// Launches between two markers.
    mark_every: AtomicU64,
    markers: Mutex<Markers>,
    /// The word the device waits on (device-side gating, ADR 0034).
    device: DeviceWord,
}

/// Device-side gating (ADR 0034, opt-in: `VGPU_DEVICE_GATE`): a thread's launches on a
/// stream go in runs; before each run the stream waits on the gate's word until it is at
/// least 1, then writes the run's number to the run's slot (the run started on the
/// device). The gate thread sets the word 0 at a revocation, waits for the runs that
/// started, and sets it 1 at the next grant (or for good at a fallback or at exit): what
/// runs on the device past a revocation is the runs that had started, at most one per
/// stream. A run ends at `every` launches or [`RUN_NS`] of estimated device time.
///
/// One page per context the process launches in (registered host memory mapped into the
/// device), word 0 the gate's, the rest the runs' slots; the pages are allocated for the
/// process's life, so the host's writes stay valid whatever the application destroys.
#[derive(Debug)]
struct DeviceWord {
    /// Launches of a thread on a stream per run at most (0: no device-side gating).
    every: AtomicU32,
    /// The gate thread's estimate of the device time per launch, ns (0: not measured).
    est_launch_ns: AtomicU64,
    /// The next run's number (from 1); run `r` writes `r` to slot `1 + r % RUN_SLOTS`.
    runs: AtomicU64,
    /// What the word should say: whether the process holds its slice here.
    open: AtomicBool,
    /// The pages, by context.
    pages: Mutex<Vec<Page>>,
}

/// A page of the device-side word in one context.
#[derive(Debug, Clone, Copy)]
struct Page {
    ctx: usize,
    /// Host address (page-aligned, never freed; 0: the driver refused to map it here).
    host: usize,
    /// The address the device reads it at.
    dev: u64,
}

/// Estimated device time after which a run of launches ends (the next launch waits on
/// the word again): what runs past a revocation, per stream, when the estimate holds.
const RUN_NS: u64 = 500_000;
/// Slots of a page for runs' start marks (word 0 is the gate's).
const RUN_SLOTS: u64 = 1023;

impl DeviceWord {
    fn new() -> DeviceWord {
        DeviceWord {
            every: AtomicU32::new(0),
            est_launch_ns: AtomicU64::new(0),
            runs: AtomicU64::new(1),
            open: AtomicBool::new(true),
            pages: Mutex::new(Vec::new()),
        }
    }

    fn pages(&self) -> MutexGuard<'_, Vec<Page>> {
        self.pages.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The current context's page, mapped first if need be (None: no context, or the
    /// driver refused; not asked again in that context).
    fn page(&self) -> Option<Page> {
        let ctx = crate::driver::current_context();
        if ctx == 0 {
            return None;
        }
        let mut pages = self.pages();
        if let Some(p) = pages.iter().find(|p| p.ctx == ctx) {
            return (p.host != 0).then_some(*p);
        }
        let layout = std::alloc::Layout::from_size_align(4096, 4096).ok()?;
        // SAFETY: a non-zero size; the page is never freed (the device may read it, and
        // the gate thread writes it, whatever becomes of the context).
        let host = unsafe { std::alloc::alloc_zeroed(layout) } as usize;
        if host == 0 {
            return None;
        }
        // SAFETY: a fresh, page-aligned page of 1024 words, kept for the process's life.
        unsafe { &*(host as *const AtomicU32) }.store(
            u32::from(self.open.load(Ordering::SeqCst)),
            Ordering::SeqCst,
        );
        let page = match crate::driver::register_host_page(host) {
            Some(dev) => Page { ctx, host, dev },
            None => Page {
                ctx,
                host: 0,
                dev: 0,
            },
        };
        pages.push(page);
        (page.host != 0).then_some(page)
    }

    /// Starts a run on `stream`: its slot cleared, then a wait on the word and the write
    /// of its number to the slot queued. The run's number and its page's host address
    /// (None: no page, or the driver refused the wait).
    fn start_run(&self, stream: usize, ptsz: bool) -> Option<(u64, usize)> {
        let page = self.page()?;
        let r = self.runs.fetch_add(1, Ordering::Relaxed);
        let slot = 1 + r % RUN_SLOTS;
        // SAFETY: a word of a mapped page (see `page`).
        unsafe { &*((page.host + 4 * slot as usize) as *const AtomicU32) }
            .store(0, Ordering::SeqCst);
        if !crate::driver::stream_wait_open(page.dev, stream, ptsz) {
            return None;
        }
        let _ = crate::driver::stream_write_word(page.dev + 4 * slot, r as u32, stream, ptsz);
        Some((r, page.host))
    }

    /// Whether run `r` (of the page at `host`) started on the device.
    fn run_started(r: u64, host: usize) -> bool {
        if host == 0 {
            return true;
        }
        let slot = 1 + r % RUN_SLOTS;
        // SAFETY: a word of a page kept for the process's life.
        unsafe { &*((host + 4 * slot as usize) as *const AtomicU32) }.load(Ordering::SeqCst)
            == r as u32
    }

    /// Launches in a run: at most `every`, and [`RUN_NS`] of estimated device time (one
    /// while nothing is measured).
    fn run_limit(&self) -> u64 {
        let every = u64::from(self.every.load(Ordering::Relaxed)).max(1);
        let est = self.est_launch_ns.load(Ordering::Relaxed);
        RUN_NS.checked_div(est).map_or(1, |n| n.clamp(1, every))
    }

    /// Whether some stream of the process may wait on the word.
    fn mapped(&self) -> bool {
        self.pages().iter().any(|p| p.host != 0)
    }

    /// Opens (1) or closes (0) the word in every page. `wait`: take the lock (not at
    /// exit, where a thread that died holding it must not stop the process).
    fn set(&self, open: bool, wait: bool) {
        let pages = if wait {
            Some(self.pages())
        } else {
            self.pages.try_lock().ok()
        };
        self.open.store(open, Ordering::SeqCst);
        for p in pages.iter().flat_map(|g| g.iter()).filter(|p| p.host != 0) {
            // SAFETY: word 0 of a page kept for the process's life.
            unsafe { &*(p.host as *const AtomicU32) }.store(u32::from(open), Ordering::SeqCst);
        }
    }

    /// Context `ctx` is being destroyed: its page is not waited on again (its memory
    /// stays the process's).
    fn forget(&self, ctx: usize) {
        self.pages().retain(|p| p.ctx != ctx);
    }
}

/// A thread's run of launches on one stream, between two device-side waits.
#[derive(Debug, Clone, Copy)]
struct Run {
    gate: usize,
    key: usize,
    launches: u64,
    /// Its number (0: none started).
    id: u64,
    /// Its page's host address.
    page: usize,
    /// The context current when it started, for the stream handles every context has
    /// (0 otherwise; see [`run_ctx`]).
    ctx: usize,
}

thread_local! {
    /// This thread's current run.
    static RUN: std::cell::Cell<Run> = const {
        std::cell::Cell::new(Run { gate: 0, key: 0, launches: 0, id: 0, page: 0, ctx: 0 })
    };
}

/// The context a run on `stream` belongs to, beyond the handle: the current one for the
/// handles every context has (0, `CU_STREAM_LEGACY`, `CU_STREAM_PER_THREAD`: a thread
/// that changed its current context launches into another context's stream under the
/// same handle, which has not waited on the word), 0 for a stream object (one context's).
fn run_ctx(stream: usize) -> usize {
    if stream <= vgpu_cuda_abi::cuda::CU_STREAM_PER_THREAD {
        crate::driver::current_context()
    } else {
        0
    }
}

/// The key of a thread's run on `stream` (`ptsz`: the per-thread default stream variant).
fn run_key(stream: usize, ptsz: bool) -> usize {
    stream * 2 + usize::from(ptsz)
}

/// This thread's current run if it is its run on `stream` of `gate` (a started one: its
/// number is not 0). The context is not compared ([`run_ctx`]).
fn this_run(gate: &Gate, stream: usize, ptsz: bool) -> Option<Run> {
    let r = RUN.with(std::cell::Cell::get);
    (r.gate == gate as *const Gate as usize && r.key == run_key(stream, ptsz) && r.id != 0)
        .then_some(r)
}

/// The run this thread's launches on `stream` of `gate` belong to, and its page ((0, 0):
/// none).
fn current_run(gate: &Gate, stream: usize, ptsz: bool) -> (u64, usize) {
    this_run(gate, stream, ptsz).map_or((0, 0), |r| (r.id, r.page))
}

/// Whether the calling thread's next launch on `stream` of `gate` goes on in its current
/// run (a run started, below `limit` launches).
fn run_continues(gate: &Gate, stream: usize, ptsz: bool, limit: u64) -> bool {
    this_run(gate, stream, ptsz).is_some_and(|r| r.launches < limit)
}

/// Opens every device-side word of the process for good (at exit: nothing may wait on
/// a word that nobody will write).
extern "C" fn open_device_words() {
    if let Some(Some(g)) = GATES.get() {
        for gate in &g.gates {
            gate.device.every.store(0, Ordering::SeqCst);
            gate.device.set(true, false);
        }
    }
}

/// Marker events: recorded after a launch every `mark_every` launches, on the launch's
/// own stream; the gate thread queries them to learn which launches completed, and times
/// them on the device to learn the device time per launch.
#[derive(Debug, Default)]
struct Markers {
    /// Recorded, not yet seen complete.
    pending: std::collections::VecDeque<Marker>,
    /// The last one seen complete, kept (not reused) until the next completes: the start
    /// of the next device-time interval.
    last: Option<Marker>,
    /// Completed, reusable: (context, event).
    free: Vec<(usize, usize)>,
    /// Events created so far.
    created: usize,
}

/// One recorded marker event.
#[derive(Debug, Clone, Copy)]
struct Marker {
    ctx: usize,
    event: usize,
    /// The launch count it follows.
    seq: u64,
    /// The marker before it was still pending when this one was recorded: every launch
    /// between the two was queued before the earlier one completed, so the device had
    /// this process's work all along between their completions (no idle gap in it).
    contiguous: bool,
    /// The device-side run of the launch it follows (0: none; ADR 0034), and its page.
    run: (u64, usize),
    /// Recorded at the start of its run, after the run's wait on the device-side word
    /// (ADR 0034): the run's end marker times the run alone, whatever the run waited
    /// for (never a sample's end: the time from the marker before it spans the wait).
    start: bool,
}

/// Most marker events per gate.
pub(crate) const MAX_MARKERS: usize = 64;
/// Launches allowed outstanding before the GPU time per launch is measured (a marker
/// after each: two consecutive ones give the first measure). Kernels of any length may
/// come first: four of 5 ms overrun a slice by 20 ms once, four of 10 µs wait 40 µs.
const UNMEASURED_ALLOWED: u64 = 4;
/// Unbounded.
const UNBOUNDED: u64 = u64::MAX / 2;
/// Longest a launcher out of budget waits before it looks at the gate again.
const BUDGET_WAIT: Duration = Duration::from_millis(2);
/// First and longest interval at which a launcher out of budget looks at the oldest
/// marker itself (`Gate::wait_for_budget`).
const BUDGET_POLL_MIN: Duration = Duration::from_micros(10);
const BUDGET_POLL_MAX: Duration = Duration::from_micros(200);

/// Stream captures begun in this process and not ended (the hooks of
/// `cuStreamBeginCapture*`, `cuStreamBeginCaptureToGraph*` and `cuStreamEndCapture*`; a
/// capture begun some other way is not counted). While one is open (ADR 0033): a launch
/// into a capturing stream passes ungated (it runs nothing); every gated launch is
/// followed by a marker, at most [`MAX_MARKERS`] ahead; and a drain waits for those
/// markers instead of synchronizing the device, which would invalidate the
/// application's capture.
static CAPTURES: AtomicU32 = AtomicU32::new(0);

/// Whether a stream capture is open in this process.
pub(crate) fn captures_open() -> bool {
    CAPTURES.load(Ordering::Relaxed) > 0
}

/// A stream capture is about to begin on `stream` (before the real call; `ptsz`: the
/// per-thread-default-stream variant): counted, and the work queued on the stream so far
/// gets a marker now, while it still can, so that a drain during the capture waits for it.
pub(crate) fn capture_begins(stream: usize, ptsz: bool) {
    CAPTURES.fetch_add(1, Ordering::SeqCst);
    let Some(Some(g)) = GATES.get() else { return };
    let Some((_, gate)) = g.enabled_gate(crate::driver::current_device) else {
        return;
    };
    let launched = gate.launched.load(Ordering::Relaxed);
    gate.mark_every.store(1, Ordering::Relaxed);
    gate.next_mark.store(launched + 1, Ordering::Relaxed);
    gate.allowed
        .fetch_min(MAX_MARKERS as u64, Ordering::Relaxed);
    gate.publish_budget();
    if launched > gate.completed.load(Ordering::Relaxed) {
        gate.mark(launched, stream, ptsz, false);
    }
}

/// A stream capture ended (`cuStreamEndCapture` returned a graph, or said the capture
/// was invalidated: either way it is over). Never below zero.
pub(crate) fn capture_ended() {
    let _ = CAPTURES.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
}

impl Gate {
    fn new() -> Gate {
        Gate {
            enabled: AtomicBool::new(false),
            not_granted: AtomicBool::new(false),
            refusal_said: AtomicBool::new(false),
            proto: AtomicU32::new(UNREGISTERED),
            word: AtomicPtr::new(std::ptr::null_mut()),
            local: AtomicU32::new(OPEN),
            yielded: AtomicU32::new(NONE),
            inflight: AtomicU32::new(0),
            launched: AtomicU64::new(0),
            claim: AtomicPtr::new(std::ptr::null_mut()),
            claimed: AtomicU32::new(0),
            budget: AtomicU64::new(UNBOUNDED),
            budget_seq: AtomicU32::new(0),
            waiting: AtomicU32::new(0),
            budget_waiting: AtomicU32::new(0),
            completed: AtomicU64::new(0),
            allowed: AtomicU64::new(UNBOUNDED),
            ran_dry: AtomicBool::new(false),
            next_mark: AtomicU64::new(u64::MAX),
            mark_every: AtomicU64::new(1),
            markers: Mutex::new(Markers::default()),
            device: DeviceWord::new(),
        }
    }

    /// Whether this gate's work waits on its device-side word (ADR 0034): enabled and
    /// mapped. A drain then cannot synchronize after a revocation (the work behind a
    /// closed word does not complete before the next grant).
    pub(super) fn device_gated(&self) -> bool {
        self.device.every.load(Ordering::Relaxed) > 0 && self.device.mapped()
    }

    /// Whether a marker still pending may yet complete before the next grant: its run
    /// started on the device (or it has none), and it is not complete.
    pub(super) fn started_work_pending(&self) -> bool {
        let _held = CTX_LOCK.read().unwrap_or_else(|p| p.into_inner());
        let pending: Vec<Marker> = self.markers().pending.iter().copied().collect();
        pending.iter().any(|k| {
            (k.run.0 == 0 || DeviceWord::run_started(k.run.0, k.run.1))
                && !crate::driver::event_done(k.event)
        })
    }

    /// Sets the estimate of device time per launch that ends runs (the gate thread).
    pub(super) fn set_device_estimate(&self, ns: f64) {
        let v = if ns.is_finite() && ns > 0.0 {
            ns as u64
        } else {
            0
        };
        self.device.est_launch_ns.store(v, Ordering::Relaxed);
    }

    /// No pending marker whose run waits on the device for the next grant closes a
    /// device-time sample (a revocation held it back, ADR 0034): the time from the
    /// marker before it spans that wait. A marker whose run had started (or with no run:
    /// not known) keeps its own: its run went on past the revocation without waiting,
    /// and was the only measure of a slice of one run of long kernels.
    ///
    /// A marker right after its own run's start marker keeps its sample either way: the
    /// start marker completes after the wait, so the pair times the run alone (without
    /// it, a slice whose only run had been held back by the revocation before measured
    /// nothing, and a tenant turning to long kernels was charged them at its short
    /// kernels' time: 68 % of the GPU under a 20 % cap, in CI).
    pub(super) fn markers_not_contiguous(&self) {
        let mut before: Option<Marker> = None;
        for k in self.markers().pending.iter_mut() {
            let after_own_start = before.is_some_and(|b| b.start && k.run.0 != 0 && b.run == k.run);
            if !after_own_start && (k.run.0 == 0 || !DeviceWord::run_started(k.run.0, k.run.1)) {
                k.contiguous = false;
            }
            before = Some(*k);
        }
    }

    /// Launches of a thread on a stream per device-side wait (0: no device-side gating).
    pub(super) fn device_every(&self) -> u32 {
        self.device.every.load(Ordering::Relaxed)
    }

    /// Whether the calling thread's next launch on `stream` would start a device-side
    /// run (ADR 0034) for which the marker pool has no room: a run needs two markers (at
    /// its start and its end). Such a launch waits as one out of budget does: a run
    /// without its markers is invisible to the gate thread, which neither waits for it
    /// at a revocation nor charges it (a tenant turning from 10 µs kernels to 5 ms ones
    /// queued 87 launches without a marker: 20 grants in a row charged nothing while
    /// they ran).
    fn run_wants_room(&self, stream: usize, ptsz: bool) -> bool {
        // Cheapest first: on most launches the thread's run goes on.
        if self.device_every() == 0
            || run_continues(self, stream, ptsz, self.device.run_limit())
            || captures_open()
            || !self.device.mapped()
        {
            return false;
        }
        // Every marker not taken off by the gate thread holds its event, counted by a
        // look or not: letting launches through on the count (the markers a look found
        // complete) left runs without markers again when the gate thread was behind
        // (16 slices charged nothing in one run of the capped tenant).
        let m = self.markers();
        m.pending.len() + usize::from(m.last.is_some()) + 2 > MAX_MARKERS
    }

    /// The gate thread took markers off: launchers waiting for room in the pool look
    /// again at once (their budget may not have changed, which alone wakes them).
    pub(super) fn markers_taken_off(&self) {
        if self.budget_waiting.load(Ordering::SeqCst) > 0 {
            self.budget_seq.fetch_add(1, Ordering::Release);
            futex_wake(&self.budget_seq);
        }
    }

    /// Whether work waits on the device for the next grant: the device-side word is
    /// closed and launches are not known complete.
    pub(super) fn device_held_back(&self) -> bool {
        self.device_gated()
            && !self.device.open.load(Ordering::SeqCst)
            && self.launched.load(Ordering::Relaxed) > self.completed.load(Ordering::Relaxed)
    }

    /// A marker after launch `n` on `stream` unless one already covers it (or all of it
    /// completed).
    fn cover(&self, n: u64, stream: usize, ptsz: bool) {
        if n > self.completed.load(Ordering::Relaxed)
            && !self.markers().pending.iter().any(|k| k.seq >= n)
        {
            self.mark(n, stream, ptsz, false);
        }
    }

    /// Claims the grant in force for the work held back on the device (the gate thread,
    /// at a grant): as the first launch under it would.
    pub(super) fn claim_for_held_back(&self) {
        let w = self.word().load(Ordering::SeqCst);
        if self.held(w) {
            let _ = self.claim(w);
        }
    }

    /// Opens or closes the device-side word (the gate thread: at grants, revocations,
    /// fallback).
    pub(super) fn set_device_open(&self, open: bool) {
        self.device.set(open, true);
    }

    fn markers(&self) -> MutexGuard<'_, Markers> {
        self.markers.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// After a synchronization: everything launched so far has completed, the markers
    /// are free again.
    fn all_completed(&self) {
        {
            let mut m = self.markers();
            let last = m.last.take();
            let done: Vec<(usize, usize)> = m
                .pending
                .drain(..)
                .chain(last)
                .map(|k| (k.ctx, k.event))
                .collect();
            m.free.extend(done);
        }
        self.completed
            .fetch_max(self.launched.load(Ordering::Relaxed), Ordering::Relaxed);
        self.publish_budget();
    }

    /// Sets the budget from `completed` and `allowed`, waking launchers waiting for it.
    fn publish_budget(&self) {
        let b = self
            .completed
            .load(Ordering::Relaxed)
            .saturating_add(self.allowed.load(Ordering::Relaxed));
        if self.budget.swap(b, Ordering::Relaxed) != b {
            self.budget_seq.fetch_add(1, Ordering::Release);
            futex_wake(&self.budget_seq);
        }
    }

    /// After the real launch that brought the count to `n`: a marker, if one is due.
    fn maybe_mark(&self, n: u64, stream: usize, ptsz: bool) {
        if n < self.next_mark.load(Ordering::Relaxed) {
            return;
        }
        // A launch of a device-side run: the run's own markers (at its start and end)
        // take the place of the periodic one, which would take the pool's room for them
        // (ADR 0034).
        if self.device_every() > 0 && current_run(self, stream, ptsz).0 != 0 {
            return;
        }
        let every = self.mark_every.load(Ordering::Relaxed).max(1);
        self.next_mark.store(n + every, Ordering::Relaxed);
        self.mark(n, stream, ptsz, false);
    }

    /// Records a marker after launch `n` on `stream` (the calling thread's launches);
    /// `start`: at the start of the thread's run on the stream, after its wait (ADR 0034).
    fn mark(&self, n: u64, stream: usize, ptsz: bool, start: bool) {
        let ctx = crate::driver::current_context();
        if ctx == 0 {
            return;
        }
        let reuse = {
            let mut m = self.markers();
            if m.pending.len() >= MAX_MARKERS {
                return;
            }
            match m.free.iter().position(|(c, _)| *c == ctx) {
                Some(i) => Some(m.free.swap_remove(i).1),
                None if m.created < MAX_MARKERS => {
                    m.created += 1;
                    None
                }
                None => return,
            }
        };
        let event = match reuse {
            Some(e) => e,
            None => match crate::driver::create_event() {
                Some(e) => e,
                None => {
                    self.markers().created -= 1;
                    return;
                }
            },
        };
        // A per-thread-default-stream launch on stream 0 used this thread's stream.
        let stream = if ptsz && stream == 0 { 2 } else { stream };
        // Not looked at while a capture is open: the launching thread may be the one
        // capturing, and an event query is not a call it may make then.
        let contiguous = !start && !captures_open() && {
            let _held = CTX_LOCK.read().unwrap_or_else(|p| p.into_inner());
            // Read under the lock: a destroyed context's markers are gone by then.
            let before = self.markers().pending.back().map(|k| k.event);
            before.is_some_and(|e| !crate::driver::event_done(e))
        };
        if crate::driver::record_event(event, stream) {
            let run = current_run(self, stream, ptsz);
            self.markers().pending.push_back(Marker {
                ctx,
                event,
                seq: n,
                contiguous,
                run,
                start,
            });
        } else {
            self.markers().free.push((ctx, event));
        }
    }

    /// A launcher out of budget waits for the queue to progress, at most
    /// [`BUDGET_WAIT`]. It looks at the markers itself ([`Gate::look`]), at once and then
    /// after sleeps doubling from [`BUDGET_POLL_MIN`] to [`BUDGET_POLL_MAX`], and raises
    /// the budget the moment one completed: waiting for the gate thread instead held
    /// launches of short kernels up to a tick (0.5 ms) behind a GPU that had long
    /// finished the work, and far longer where the gate thread waits for a CPU (a
    /// CPU-limited container: the queue ran dry meanwhile). The launcher only advances
    /// `completed` (and says when it found the queue dry at the bound); markers, samples
    /// and the count stay the gate thread's (ADR 0028).
    fn wait_for_budget(&self, seq: u32, stream: usize, ptsz: bool) {
        if self.look(stream, ptsz) {
            return;
        }
        let t0 = Instant::now();
        let mut step = BUDGET_POLL_MIN;
        while t0.elapsed() < BUDGET_WAIT {
            if futex_wait(&self.budget_seq, seq, step)
                || self.budget_seq.load(Ordering::Acquire) != seq
                || self.look(stream, ptsz)
            {
                return;
            }
            step = (step * 2).min(BUDGET_POLL_MAX);
        }
    }

    /// A launcher's look at the queue: the pending markers not counted yet, oldest first,
    /// while they have completed; the launches before the last complete one count as
    /// completed and the budget grows (the gate thread takes the markers off, with their
    /// device-time samples, at its next poll). True: the budget grew. When no pending
    /// marker covers the last launch (all of them counted, or the queue full of counted
    /// ones the gate thread has not taken off yet), that launch gets one if it can, so
    /// the next look learns something. Never while a stream capture is open: the
    /// launching thread may be the one capturing, and may not query an event then.
    fn look(&self, stream: usize, ptsz: bool) -> bool {
        if captures_open() {
            return false;
        }
        let launched = self.launched.load(Ordering::Relaxed);
        let mut counted = None;
        for _ in 0..MAX_MARKERS {
            let completed = self.completed.load(Ordering::Relaxed);
            // Past the markers this look (or another launcher's) counted already.
            let Some(k) = self
                .markers()
                .pending
                .iter()
                .find(|k| k.seq > completed)
                .copied()
            else {
                break;
            };
            let done = {
                let _held = CTX_LOCK.read().unwrap_or_else(|p| p.into_inner());
                // Still pending under the lock: a context destroyed meanwhile took its
                // markers away (`forget_context`), and its events with them; a marker the
                // gate thread took off may be recorded again for a later launch.
                self.markers()
                    .pending
                    .iter()
                    .any(|f| f.event == k.event && f.seq == k.seq)
                    && crate::driver::event_done(k.event)
            };
            if !done {
                break;
            }
            self.completed.fetch_max(k.seq, Ordering::Relaxed);
            counted = Some(k.seq);
        }
        let Some(seq) = counted else {
            let completed = self.completed.load(Ordering::Relaxed);
            let covered = self.markers().pending.iter().any(|k| k.seq >= launched);
            if launched > completed && !covered {
                self.mark(launched, stream, ptsz, false);
            }
            return false;
        };
        // Everything launched had completed with the budget spent: the GPU ran the whole
        // queue before anyone looked, which the gate thread's count grows on.
        if seq >= launched && launched >= self.budget.load(Ordering::Relaxed) {
            self.ran_dry.store(true, Ordering::Relaxed);
        }
        self.publish_budget();
        true
    }

    fn word(&self) -> &AtomicU32 {
        let p = self.word.load(Ordering::Acquire);
        if p.is_null() {
            return &self.local;
        }
        // SAFETY: a non-null pointer is either `self.local` or a word of a board
        // mapping that is never unmapped (boards of past connections are leaked on
        // purpose, one page each, so a launcher holding the old pointer stays valid).
        unsafe { &*p }
    }

    /// When grant `generation`, held here, expires without word from the daemon
    /// (CLOCK_MONOTONIC ns), as the board says beside the grant word (ADR 0036; the
    /// sequence lock of [`vgpu_core::sched_proto`], "Expiry"). None: no board word (the
    /// local fallback's), no expiry, one for another grant, or the word does not say
    /// this grant is held any more.
    fn expiry(&self, generation: u32) -> Option<u64> {
        let p = self.word.load(Ordering::Acquire);
        if p.is_null() || std::ptr::eq(p, &self.local) {
            return None;
        }
        // SAFETY: a non-null pointer other than `self.local` is a grant word of a board
        // mapping that is never unmapped (see `Gate::word`), at a multiple of the
        // stride of a page-aligned mapping, so the expiry's fields in its stride are in
        // the page and aligned; the board is only read, atomically.
        let (word, gen_of, at) = unsafe {
            let base = p.cast::<u8>();
            (
                &*p,
                &*base.add(EXPIRY_GEN_OFFSET).cast::<AtomicU32>(),
                &*base.add(EXPIRY_AT_OFFSET).cast::<AtomicU64>(),
            )
        };
        if gen_of.load(Ordering::SeqCst) != generation {
            return None;
        }
        let t = at.load(Ordering::SeqCst);
        if t == 0
            || gen_of.load(Ordering::SeqCst) != generation
            || word.load(Ordering::SeqCst) != GrantWord::held(generation).pack()
        {
            return None;
        }
        Some(t)
    }

    fn held(&self, w: u32) -> bool {
        let w = GrantWord::unpack(w);
        w.held && w.generation != self.yielded.load(Ordering::SeqCst)
    }

    /// Claims grant word `w` before the first launch under it (ADR 0030): stores it in
    /// the claim page, then reads the grant word again. The daemon stores a revocation
    /// and then reads the claim, all four sequentially consistent, so either it sees
    /// this claim (and waits for the drain report) or this read sees the revocation.
    /// False: the grant changed meanwhile (do not launch under `w`). Later launches under
    /// the same grant cost one load. No claim page, or the local word: nothing to claim.
    fn claim(&self, w: u32) -> bool {
        if self.claimed.load(Ordering::Acquire) == w {
            return true;
        }
        let c = self.claim.load(Ordering::Acquire);
        if c.is_null() || self.word.load(Ordering::Acquire).is_null() {
            return true;
        }
        // SAFETY: a non-null claim pointer is a word of a claim page mapping that is
        // never unmapped (see `Gate::word`); its time is in the same stride, 8-aligned
        // (`CLAIM_TIME_OFFSET`).
        unsafe {
            // Another process of the tenant claimed this grant first: its claim stands
            // (the daemon reads it after the revocation all the same), and so does its
            // time, the tenant's first launch under the grant.
            if (*c).load(Ordering::SeqCst) != w {
                let at = c.cast::<u8>().add(CLAIM_TIME_OFFSET).cast::<AtomicU64>();
                // Before the claim (whose store releases it): the daemon reads it after.
                (*at).store(vgpu_sys::mono_ns(), Ordering::Relaxed);
                (*c).store(w, Ordering::SeqCst);
            }
        }
        if self.word().load(Ordering::SeqCst) != w {
            return false;
        }
        self.claimed.store(w, Ordering::Release);
        true
    }
}

/// The gates of this process.
#[derive(Debug)]
pub struct Gates {
    gates: [Gate; MAX_DEVICES],
    /// The only enabled device, or `usize::MAX` when several are.
    single: AtomicUsize,
    /// Writer side of the daemon connection (None: fallback).
    ctl: Mutex<Option<UnixStream>>,
    /// A write to the daemon failed (the gate thread falls back).
    lost: AtomicBool,
    /// Wakes the gate thread (fallback demand).
    doorbell: AtomicU32,
    /// The tenant's suspension word in the board of the current connection (null: none
    /// yet; [`vgpu_core::suspension`]).
    suspension: AtomicPtr<AtomicU32>,
}

static GATES: OnceLock<Option<&'static Gates>> = OnceLock::new();

/// The tenant's suspension word, once the process registered with a daemon (None:
/// never registered, or no gate).
pub(crate) fn suspension_word() -> Option<&'static AtomicU32> {
    let Some(Some(g)) = GATES.get() else {
        return None;
    };
    let p = g.suspension.load(Ordering::Acquire);
    // SAFETY: a non-null pointer stored here points into a board mapping that is never
    // unmapped (see `Gate::word`), u32-aligned.
    (!p.is_null()).then(|| unsafe { &*p })
}

/// A launch admitted by the gate: count it when dropped (after the real launch).
#[derive(Debug)]
pub struct Pass {
    gate: &'static Gate,
    stream: usize,
    ptsz: bool,
}

impl Pass {
    /// Just before the real launch: with device-side gating (ADR 0034), a wait on the
    /// gate's word first when this thread's run of launches on the stream is new or has
    /// reached its length. Never while a stream capture is open (a wait in a capturing
    /// stream would become a node of the application's graph; the host gate holds then).
    pub fn device_wait(&self) {
        let every = u64::from(self.gate.device.every.load(Ordering::Relaxed));
        if every == 0 || captures_open() {
            return;
        }
        // A run ends at `every` launches, or at RUN_NS of estimated device time (at one
        // launch while the estimate is not known).
        let limit = self.gate.device.run_limit();
        // Only here is the context compared (a driver call): the other looks at the run
        // during this launch come after this one, or decide nothing a new run would not.
        let ctx = run_ctx(self.stream);
        let run = this_run(self.gate, self.stream, self.ptsz).filter(|r| r.ctx == ctx);
        if let Some(r) = run.filter(|r| r.launches < limit) {
            RUN.with(|c| {
                c.set(Run {
                    launches: r.launches + 1,
                    ..r
                })
            });
            return;
        }
        // The run this thread had on the stream ends: a marker after its last launch,
        // so that a revocation's drain knows when it is over (not from another context:
        // the marker would go to this one's stream).
        if run.is_some() {
            let launched = self.gate.launched.load(Ordering::Relaxed);
            self.gate.cover(launched, self.stream, self.ptsz);
        }
        let (id, page) = self
            .gate
            .device
            .start_run(self.stream, self.ptsz)
            .unwrap_or((0, 0));
        RUN.with(|c| {
            c.set(Run {
                gate: self.gate as *const Gate as usize,
                key: run_key(self.stream, self.ptsz),
                launches: 1,
                id,
                page,
                ctx,
            })
        });
        // The run's start on the device, after its wait: its end marker is timed from
        // here (see `Gate::markers_not_contiguous`).
        if id != 0 {
            let launched = self.gate.launched.load(Ordering::Relaxed);
            self.gate.mark(launched, self.stream, self.ptsz, true);
        }
    }
}

impl Drop for Pass {
    fn drop(&mut self) {
        let n = self.gate.launched.fetch_add(1, Ordering::Relaxed) + 1;
        self.gate.inflight.fetch_sub(1, Ordering::SeqCst);
        self.gate.maybe_mark(n, self.stream, self.ptsz);
        // A run that is full ends with a marker at once (ADR 0034): a revocation waits
        // for the runs that started by their markers, and a tail without one would run
        // on past it uncharged.
        if self.gate.device_every() > 0
            && this_run(self.gate, self.stream, self.ptsz)
                .is_some_and(|r| r.launches >= self.gate.device.run_limit())
        {
            self.gate.cover(n, self.stream, self.ptsz);
        }
    }
}

/// Registers the process with the daemon (once), at its first context: a process that
/// holds GPU memory is then known to the daemon before it launches anything (else NVML
/// reconciliation would flag it as a bypass).
pub fn ensure_started(shim: &'static Shim) {
    let _ = GATES.get_or_init(|| start(shim));
}

/// A launch on a GPU the container was not granted (its quota file does not list it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NotGranted;

/// Admits a launch on the current context's device, blocking while the container does
/// not hold its slice there. `Ok(None)`: not gated (no enforcing shim, or an unknown
/// device); `Err`: the container was not granted this device.
pub fn enter(
    shim: &'static Shim,
    current_device: impl FnOnce() -> Option<usize>,
    stream: usize,
    ptsz: bool,
) -> Result<Option<Pass>, NotGranted> {
    let g = match GATES.get() {
        Some(Some(g)) => *g,
        Some(None) => return Ok(None),
        None => match *GATES.get_or_init(|| start(shim)) {
            Some(g) => g,
            None => return Ok(None),
        },
    };
    let Some((dev, gate)) = g.enabled_gate(current_device) else {
        return Ok(None);
    };
    if gate.not_granted.load(Ordering::Relaxed) {
        if !gate.refusal_said.swap(true, Ordering::Relaxed) {
            crate::say!(
                "vgpu: WARNING: launch on device {dev} refused: the container was not granted this GPU (its quota file {} does not list it)",
                shim.cfg.quota_file().display()
            );
        }
        return Err(NotGranted);
    }
    loop {
        gate.inflight.fetch_add(1, Ordering::SeqCst);
        let w = gate.word().load(Ordering::SeqCst);
        if gate.held(w)
            && gate.launched.load(Ordering::Relaxed) < gate.budget.load(Ordering::Relaxed)
            && !gate.run_wants_room(stream, ptsz)
        {
            if gate.claim(w) {
                return Ok(Some(Pass { gate, stream, ptsz }));
            }
            // Revoked (or granted anew) while claiming: look at the word again.
            gate.inflight.fetch_sub(1, Ordering::SeqCst);
            continue;
        }
        gate.inflight.fetch_sub(1, Ordering::SeqCst);
        g.block(gate, w, stream, ptsz);
    }
}

impl Gates {
    /// The enabled gate of the current context's device (the only one when a single
    /// device is enabled), with its ordinal; None: no current device, or not gated.
    fn enabled_gate(
        &'static self,
        current_device: impl FnOnce() -> Option<usize>,
    ) -> Option<(usize, &'static Gate)> {
        let dev = match self.single.load(Ordering::Relaxed) {
            usize::MAX => current_device()?,
            d => d,
        };
        let gate = self.gates.get(dev)?;
        gate.enabled.load(Ordering::Relaxed).then_some((dev, gate))
    }

    fn ctl(&self) -> MutexGuard<'_, Option<UnixStream>> {
        self.ctl.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The slow path: wait for the budget to grow, or for a grant (asking for it).
    fn block(&self, gate: &Gate, w: u32, stream: usize, ptsz: bool) {
        // This thread's run stops here for a while: its tail gets its marker (ADR 0034).
        if gate.device_every() > 0 && current_run(gate, stream, ptsz).0 != 0 {
            gate.cover(gate.launched.load(Ordering::Relaxed), stream, ptsz);
        }
        if gate.held(w) {
            // Out of budget: wait until a look (this launcher's, or the gate thread's)
            // sees more of the queue complete, or a revoke/grant wakes us. With no
            // marker outstanding nobody would learn anything: mark what this thread
            // launched so far.
            let seq = gate.budget_seq.load(Ordering::Acquire);
            let launched = gate.launched.load(Ordering::Relaxed);
            if launched >= gate.budget.load(Ordering::Relaxed) || gate.run_wants_room(stream, ptsz)
            {
                if gate.markers().pending.is_empty() {
                    gate.mark(launched, stream, ptsz, false);
                }
                gate.budget_waiting.fetch_add(1, Ordering::SeqCst);
                gate.wait_for_budget(seq, stream, ptsz);
                gate.budget_waiting.fetch_sub(1, Ordering::SeqCst);
            }
            return;
        }
        {
            let mut ctl = self.ctl();
            gate.waiting.fetch_add(1, Ordering::SeqCst);
            match ctl.as_mut() {
                Some(s) => {
                    let gpu = gate.proto.load(Ordering::Relaxed);
                    let since_ns = Some(vgpu_sys::mono_ns());
                    if s.write_all(&encode(&ShimMsg::Demand { gpu, since_ns }))
                        .is_err()
                    {
                        // A daemon that does not take a small frame within the write
                        // timeout is gone: no launcher writes to it again, and the gate
                        // thread falls back.
                        *ctl = None;
                        self.lost.store(true, Ordering::SeqCst);
                        futex_wake(&self.doorbell);
                    }
                }
                None => {
                    self.doorbell.fetch_add(1, Ordering::Release);
                    futex_wake(&self.doorbell);
                }
            }
        }
        // Re-read after registering the demand: a grant may have come meanwhile.
        let word = gate.word();
        if word.load(Ordering::SeqCst) == w {
            futex_wait(word, w, DEMAND_REPEAT);
        }
        gate.waiting.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Creates the gates and the gate thread (first launch of the process).
fn start(shim: &'static Shim) -> Option<&'static Gates> {
    let uuids = match crate::driver::device_uuids() {
        Ok(u) => u,
        Err(e) => {
            crate::say!("vgpu: WARNING: launch gate disabled: cannot list devices: {e}");
            return None;
        }
    };
    let n = uuids.len().min(MAX_DEVICES);
    let g: &'static Gates = Box::leak(Box::new(Gates {
        gates: std::array::from_fn(|_| Gate::new()),
        single: AtomicUsize::new(if n == 1 { 0 } else { usize::MAX }),
        ctl: Mutex::new(None),
        lost: AtomicBool::new(false),
        doorbell: AtomicU32::new(0),
        suspension: AtomicPtr::new(std::ptr::null_mut()),
    }));
    for gate in &g.gates[..n] {
        gate.enabled.store(true, Ordering::Relaxed);
        gate.device
            .every
            .store(shim.cfg.device_gate_every, Ordering::Relaxed);
    }
    if shim.cfg.device_gate_every > 0 {
        // SAFETY: registers a function without arguments that only stores to atomics.
        unsafe { libc::atexit(open_device_words) };
    }
    let mut runner = Runner::new(g, shim, uuids[..n].to_vec());
    // The first connection attempt happens before the first launch is admitted, so
    // that launch is already scheduled by the daemon when one runs (it waits at most
    // the handshake deadline).
    runner.connect();
    if runner.conn.is_none() {
        runner.enter_fallback(None);
    }
    let spawned = std::thread::Builder::new()
        .name("vgpu-gate".into())
        .spawn(move || {
            raise_gate_thread_priority(shim);
            // Its event queries may then run beside an application's global-mode capture.
            if !crate::driver::relax_capture_mode() {
                crate::process::log(shim, || {
                    "gate thread keeps the default stream capture mode".to_owned()
                });
            }
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| runner.run()));
            if r.is_err() {
                // Never leave launchers waiting on a gate nobody runs: open them all.
                crate::say!("vgpu: ERROR: the launch gate failed; compute sharing is OFF");
                open_device_words();
                for gate in &g.gates {
                    gate.enabled.store(false, Ordering::SeqCst);
                    gate.budget.store(UNBOUNDED, Ordering::SeqCst);
                    gate.local.store(OPEN, Ordering::SeqCst);
                    gate.word.store(std::ptr::null_mut(), Ordering::SeqCst);
                    gate.yielded.store(NONE, Ordering::SeqCst);
                    futex_wake(&gate.budget_seq);
                    futex_wake(&gate.local);
                }
            }
        });
    if let Err(e) = spawned {
        crate::say!("vgpu: WARNING: launch gate disabled: cannot start its thread: {e}");
        for gate in &g.gates {
            gate.enabled.store(false, Ordering::Relaxed);
        }
    }
    Some(g)
}

/// Waits for every context of this process on device `dev` to finish its queued work.
fn sync_device(shim: &Shim, dev: usize) {
    let _held = CTX_LOCK.read().unwrap_or_else(|p| p.into_inner());
    let mut ctxs: Vec<usize> = shim
        .ctx_dev
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .filter(|(_, d)| **d == dev)
        .map(|(c, _)| *c)
        .collect();
    if shim.primary_refs[dev].load(Ordering::Acquire) > 0 {
        let p = shim.primary_ctx[dev].load(Ordering::Acquire);
        if p != 0 {
            ctxs.push(p);
        }
    }
    for c in ctxs {
        crate::driver::sync_context(c);
    }
}

/// Context `ctx` is being destroyed (the caller holds [`CTX_LOCK`] for writing): its
/// marker events go with it.
pub fn forget_context(ctx: usize) {
    let Some(Some(g)) = GATES.get() else { return };
    for gate in &g.gates {
        gate.device.forget(ctx);
        let mut m = gate.markers();
        let before = m.pending.len() + m.free.len() + usize::from(m.last.is_some());
        m.pending.retain(|k| k.ctx != ctx);
        m.free.retain(|(c, _)| *c != ctx);
        if m.last.is_some_and(|k| k.ctx == ctx) {
            m.last = None;
        }
        let gone = before - m.pending.len() - m.free.len() - usize::from(m.last.is_some());
        m.created -= gone.min(m.created);
    }
}
