//! The launch gate: every kernel launch path (`cuLaunchKernel`, `Ex`, cooperative,
//! `_ptsz`, graph launches) passes [`enter`] before the real driver runs it.
//!
//! Fast path (the container holds its slice): one load of the grant word in shared
//! memory, the in-flight counter, the queue-ahead budget: no syscall, no lock. A
//! blocked launch tells the daemon (one frame on the socket) and waits on the grant
//! word with a futex; it never sleeps in a loop.
//!
//! One thread per process (the "gate thread") talks to the daemon: it registers (the
//! daemon takes the process's PID from the socket), receives grants and revocations,
//! drains the process's queued work when a slice ends (waits for launches in flight,
//! then synchronizes each of the process's contexts on that GPU) and reports when the
//! work completed, which is how the daemon measures GPU time. While holding, it bounds
//! the work queued ahead (an estimate from measured per-launch time), and yields the
//! slice when the process stops launching.
//!
//! Without a daemon (not running, dead, refusing), the gate thread runs a local
//! fallback: a duty cycle at the container's share over measured time (share 100: open)
//! and reconnects every 250 ms; a daemon that comes back gets the process re-registered.

use std::io::{self, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock, RwLock};
use std::time::{Duration, Instant};

use vgpu_core::sched_proto::{
    BOARD_BYTES, BOARD_STRIDE, ComputePolicy, ComputeSettings, ContainerIdent, DaemonMsg,
    GpuRegistration, PROTO_VERSION, ShimMsg, decode, encode,
};

use crate::config::MAX_DEVICES;
use crate::state::Shim;

/// No generation yielded.
const NONE: u32 = u32::MAX;
/// How often a blocked launcher repeats its demand (lost-message safety net).
const DEMAND_REPEAT: Duration = Duration::from_millis(100);
/// Gate thread tick while the process holds a slice somewhere.
const TICK: Duration = Duration::from_micros(500);
/// Ticks without a launch before the process yields a slice it holds.
const IDLE_TICKS: u32 = 4;
/// Fallback duty-cycle period's open part at most (then the share decides the rest).
const LOCAL_QUANTUM_NS: u64 = 10_000_000;
/// Reconnect interval without a daemon.
const RECONNECT: Duration = Duration::from_millis(250);
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
        let e = io::Error::last_os_error();
        crate::state::log(shim, || {
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
    word: AtomicPtr<AtomicU32>,
    local: AtomicU32,
    yielded: AtomicU32,
    inflight: AtomicU32,
    launched: AtomicU64,
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
    /// Record a marker event at this launch count.
    next_mark: AtomicU64,
    /// Launches between two markers.
    mark_every: AtomicU64,
    markers: Mutex<Markers>,
}

/// Marker events: recorded after a launch every `mark_every` launches, on the launch's
/// own stream; the gate thread queries them to learn which launches completed.
#[derive(Debug, Default)]
struct Markers {
    /// Recorded, not yet seen complete: (context, event, launch count).
    pending: std::collections::VecDeque<(usize, usize, u64)>,
    /// Completed, reusable: (context, event).
    free: Vec<(usize, usize)>,
    /// Events created so far.
    created: usize,
}

/// Most marker events per gate.
const MAX_MARKERS: usize = 16;
/// Launches allowed outstanding before the GPU time per launch is measured (a marker
/// every quarter of them).
const UNMEASURED_ALLOWED: u64 = 8;
/// Unbounded.
const UNBOUNDED: u64 = u64::MAX / 2;

impl Gate {
    fn new() -> Gate {
        Gate {
            enabled: AtomicBool::new(false),
            word: AtomicPtr::new(std::ptr::null_mut()),
            local: AtomicU32::new(1),
            yielded: AtomicU32::new(NONE),
            inflight: AtomicU32::new(0),
            launched: AtomicU64::new(0),
            budget: AtomicU64::new(UNBOUNDED),
            budget_seq: AtomicU32::new(0),
            waiting: AtomicU32::new(0),
            budget_waiting: AtomicU32::new(0),
            completed: AtomicU64::new(0),
            allowed: AtomicU64::new(UNBOUNDED),
            next_mark: AtomicU64::new(u64::MAX),
            mark_every: AtomicU64::new(1),
            markers: Mutex::new(Markers::default()),
        }
    }

    fn markers(&self) -> MutexGuard<'_, Markers> {
        self.markers.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// After a synchronization: everything launched so far has completed, the markers
    /// are free again.
    fn all_completed(&self) {
        {
            let mut m = self.markers();
            let done: Vec<(usize, usize)> = m.pending.drain(..).map(|(c, e, _)| (c, e)).collect();
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
        let every = self.mark_every.load(Ordering::Relaxed).max(1);
        self.next_mark.store(n + every, Ordering::Relaxed);
        self.mark(n, stream, ptsz);
    }

    /// Records a marker after launch `n` on `stream` (the calling thread's launches).
    fn mark(&self, n: u64, stream: usize, ptsz: bool) {
        let ctx = crate::hooks::current_context();
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
            None => match crate::hooks::create_event() {
                Some(e) => e,
                None => {
                    self.markers().created -= 1;
                    return;
                }
            },
        };
        // A per-thread-default-stream launch on stream 0 used this thread's stream.
        let stream = if ptsz && stream == 0 { 2 } else { stream };
        if crate::hooks::record_event(event, stream) {
            self.markers().pending.push_back((ctx, event, n));
        } else {
            self.markers().free.push((ctx, event));
        }
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

    fn held(&self, w: u32) -> bool {
        w & 1 == 1 && (w >> 1) != self.yielded.load(Ordering::SeqCst)
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
    /// Wakes the gate thread (fallback demand).
    doorbell: AtomicU32,
}

static GATES: OnceLock<Option<&'static Gates>> = OnceLock::new();

/// A launch admitted by the gate: count it when dropped (after the real launch).
#[derive(Debug)]
pub struct Pass {
    gate: &'static Gate,
    stream: usize,
    ptsz: bool,
}

impl Drop for Pass {
    fn drop(&mut self) {
        let n = self.gate.launched.fetch_add(1, Ordering::Relaxed) + 1;
        self.gate.inflight.fetch_sub(1, Ordering::SeqCst);
        self.gate.maybe_mark(n, self.stream, self.ptsz);
    }
}

/// Registers the process with the daemon (once), at its first context: a process that
/// holds GPU memory is then known to the daemon before it launches anything (else NVML
/// reconciliation would flag it as a bypass).
pub fn ensure_started(shim: &'static Shim) {
    let _ = GATES.get_or_init(|| start(shim));
}

/// Admits a launch on the current context's device, blocking while the container does
/// not hold its slice there. None: not gated (no enforcing shim, or an unknown device).
pub fn enter(
    shim: &'static Shim,
    current_device: impl FnOnce() -> Option<usize>,
    stream: usize,
    ptsz: bool,
) -> Option<Pass> {
    let g = match GATES.get() {
        Some(g) => (*g)?,
        None => (*GATES.get_or_init(|| start(shim)))?,
    };
    let dev = match g.single.load(Ordering::Relaxed) {
        usize::MAX => current_device()?,
        d => d,
    };
    let gate = g.gates.get(dev)?;
    if !gate.enabled.load(Ordering::Relaxed) {
        return None;
    }
    loop {
        gate.inflight.fetch_add(1, Ordering::SeqCst);
        let w = gate.word().load(Ordering::SeqCst);
        if gate.held(w)
            && gate.launched.load(Ordering::Relaxed) < gate.budget.load(Ordering::Relaxed)
        {
            // SAFETY-free: `g` is 'static, so the gate is too.
            return Some(Pass {
                gate: &g.gates[dev],
                stream,
                ptsz,
            });
        }
        gate.inflight.fetch_sub(1, Ordering::SeqCst);
        g.block(dev, gate, w, stream, ptsz);
    }
}

impl Gates {
    fn ctl(&self) -> MutexGuard<'_, Option<UnixStream>> {
        self.ctl.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The slow path: wait for the budget to grow, or for a grant (asking for it).
    fn block(&self, dev: usize, gate: &Gate, w: u32, stream: usize, ptsz: bool) {
        if gate.held(w) {
            // Out of budget: wait until the gate thread sees more of the queue
            // complete (or a revoke/grant wakes us). With no marker outstanding it
            // would learn nothing: mark what this thread launched so far.
            let seq = gate.budget_seq.load(Ordering::Acquire);
            let launched = gate.launched.load(Ordering::Relaxed);
            if launched >= gate.budget.load(Ordering::Relaxed) {
                if gate.markers().pending.is_empty() {
                    gate.mark(launched, stream, ptsz);
                }
                gate.budget_waiting.fetch_add(1, Ordering::SeqCst);
                futex_wait(&gate.budget_seq, seq, Duration::from_millis(2));
                gate.budget_waiting.fetch_sub(1, Ordering::SeqCst);
            }
            return;
        }
        {
            let mut ctl = self.ctl();
            gate.waiting.fetch_add(1, Ordering::SeqCst);
            match ctl.as_mut() {
                Some(s) => {
                    let gpu = u32::try_from(self.index_of(dev)).unwrap_or(0);
                    if s.write_all(&encode(&ShimMsg::Demand { gpu })).is_err() {
                        // The gate thread notices the broken connection and falls back.
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

    /// Position of `dev` among the enabled devices (the protocol's GPU index).
    fn index_of(&self, dev: usize) -> usize {
        self.gates[..dev]
            .iter()
            .filter(|g| g.enabled.load(Ordering::Relaxed))
            .count()
    }
}

/// Creates the gates and the gate thread (first launch of the process).
fn start(shim: &'static Shim) -> Option<&'static Gates> {
    let uuids = match crate::hooks::device_uuids() {
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
        doorbell: AtomicU32::new(0),
    }));
    for gate in &g.gates[..n] {
        gate.enabled.store(true, Ordering::Relaxed);
    }
    let mut runner = Runner::new(g, shim, uuids[..n].to_vec());
    // The first connection attempt happens before the first launch is admitted, so
    // that launch is already scheduled by the daemon when one runs.
    runner.connect();
    if runner.conn.is_none() {
        runner.enter_fallback();
    }
    let spawned = std::thread::Builder::new()
        .name("vgpu-gate".into())
        .spawn(move || {
            raise_gate_thread_priority(shim);
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| runner.run()));
            if r.is_err() {
                // Never leave launchers waiting on a gate nobody runs: open them all.
                crate::say!("vgpu: ERROR: the launch gate failed; compute sharing is OFF");
                for gate in &g.gates {
                    gate.enabled.store(false, Ordering::SeqCst);
                    gate.budget.store(UNBOUNDED, Ordering::SeqCst);
                    gate.local.store(1, Ordering::SeqCst);
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

/// Per-device state of the gate thread.
#[derive(Debug)]
struct Dev {
    uuid: String,
    settings: ComputeSettings,
    /// Generation held (daemon grant, or local open).
    holding: Option<u32>,
    grant_at: u64,
    launched_at_grant: u64,
    last_launched: u64,
    idle_ticks: u32,
    /// Measured GPU time per launch, ns (0: unknown yet), from marker completions.
    per_launch_ns: f64,
    /// Last marker completion seen: (when, launch count, whether more was queued).
    last_obs: Option<(u64, u64, bool)>,
    /// Queue-ahead bound in force, ns (the Welcome's, or a tighter one of the grant).
    queue_ahead_ns: u64,
    /// Fallback: closed until (mono ns).
    closed_until: u64,
    local_gen: u32,
    word_index: usize,
}

struct Conn {
    stream: UnixStream,
    buf: Vec<u8>,
}

struct Runner {
    g: &'static Gates,
    shim: &'static Shim,
    devs: Vec<Dev>,
    conn: Option<Conn>,
    queue_ahead_ns: u64,
    next_connect: Instant,
    last_usage: Instant,
    warned: bool,
}

impl std::fmt::Debug for Runner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runner").field("devs", &self.devs).finish()
    }
}

/// CLOCK_MONOTONIC, ns.
pub fn mono_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    u64::try_from(ts.tv_sec).unwrap_or(0) * 1_000_000_000 + u64::try_from(ts.tv_nsec).unwrap_or(0)
}

impl Runner {
    fn new(g: &'static Gates, shim: &'static Shim, uuids: Vec<String>) -> Runner {
        let file = read_quota_file(shim);
        let devs = uuids
            .into_iter()
            .map(|uuid| {
                let from_file = file.as_ref().map(|q| {
                    q.gpus
                        .iter()
                        .find(|x| x.uuid.eq_ignore_ascii_case(&uuid))
                        .map_or(
                            ComputeSettings {
                                share_pct: 1,
                                policy: ComputePolicy::Cap,
                                priority: Default::default(),
                            },
                            |x| ComputeSettings {
                                share_pct: (x.compute_milli / 10).clamp(1, 100),
                                policy: x.compute_policy,
                                priority: x.priority,
                            },
                        )
                });
                Dev {
                    uuid,
                    settings: shim.cfg.compute_settings(from_file),
                    holding: None,
                    grant_at: 0,
                    launched_at_grant: 0,
                    last_launched: 0,
                    idle_ticks: 0,
                    per_launch_ns: 0.0,
                    last_obs: None,
                    queue_ahead_ns: 2_000_000,
                    closed_until: 0,
                    local_gen: 0,
                    word_index: 0,
                }
            })
            .collect();
        Runner {
            g,
            shim,
            devs,
            conn: None,
            queue_ahead_ns: 2_000_000,
            next_connect: Instant::now(),
            last_usage: Instant::now(),
            warned: false,
        }
    }

    fn ident(&self) -> ContainerIdent {
        let dir = self.shim.cfg.container_dir.display().to_string();
        let file = read_quota_file(self.shim);
        let key = match (&self.shim.cfg.tenant, &file) {
            (Some(t), _) => t.clone(),
            (None, Some(q)) => format!("{}/{}/{}", q.namespace, q.pod, q.container),
            (None, None) => dir.clone(),
        };
        ContainerIdent {
            key,
            namespace: file
                .as_ref()
                .map(|q| q.namespace.clone())
                .unwrap_or_default(),
            pod: file.as_ref().map(|q| q.pod.clone()).unwrap_or_default(),
            container: file.map(|q| q.container).unwrap_or_default(),
            container_dir: dir,
        }
    }

    fn log(&self, msg: impl FnOnce() -> String) {
        crate::state::log(self.shim, msg);
    }

    /// Tries to register with the daemon; on success the gates follow its board.
    fn connect(&mut self) {
        self.next_connect = Instant::now() + RECONNECT;
        let Some(path) = self.shim.cfg.daemon_socket.clone() else {
            return;
        };
        match self.try_connect(&path) {
            Ok(conn) => {
                self.log(|| format!("registered with the daemon at {}", path.display()));
                self.warned = false;
                self.conn = Some(conn);
            }
            Err(e) => {
                if !self.warned && e.kind() != io::ErrorKind::NotFound {
                    crate::say!(
                        "vgpu: WARNING: daemon at {} unavailable ({e}); compute share enforced locally",
                        path.display()
                    );
                }
                self.warned = true;
            }
        }
    }

    fn try_connect(&mut self, path: &std::path::Path) -> io::Result<Conn> {
        let mut s = UnixStream::connect(path)?;
        s.set_read_timeout(Some(Duration::from_secs(2)))?;
        let gpus: Vec<GpuRegistration> = self
            .devs
            .iter()
            .enumerate()
            .map(|(i, d)| GpuRegistration {
                uuid: d.uuid.clone(),
                ordinal: u32::try_from(i).unwrap_or(0),
                settings: d.settings,
                memory_quota: self.shim.quota(i),
            })
            .collect();
        let hello = ShimMsg::Hello {
            proto: PROTO_VERSION,
            pid: std::process::id(),
            ident: self.ident(),
            gpus,
        };
        s.write_all(&encode(&hello))?;
        let mut buf = Vec::new();
        let mut fd: Option<OwnedFd> = None;
        let msg = loop {
            if let Some(m) = decode::<DaemonMsg>(&mut buf)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?
            {
                break m;
            }
            let mut chunk = [0u8; 4096];
            let (n, got) = recv_with_fd(s.as_raw_fd(), &mut chunk)?;
            if got.is_some() {
                fd = got;
            }
            if n == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "daemon closed the connection",
                ));
            }
            buf.extend_from_slice(&chunk[..n]);
        };
        let (settings, words, queue_ahead_us) = match msg {
            DaemonMsg::Welcome {
                settings,
                words,
                queue_ahead_us,
                host_pid,
                ..
            } => {
                if let Some(p) = host_pid {
                    self.shim.region.set_host_pid(self.shim.slot, p);
                }
                (settings, words, queue_ahead_us)
            }
            DaemonMsg::Refused { reason } => {
                crate::say!("vgpu: WARNING: the daemon refused this process: {reason}");
                return Err(io::Error::new(io::ErrorKind::PermissionDenied, reason));
            }
            other => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("unexpected first message {other:?}"),
                ));
            }
        };
        let fd = fd.ok_or_else(|| io::Error::other("Welcome without a board descriptor"))?;
        if words.len() != self.devs.len() || settings.len() != self.devs.len() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "Welcome does not match the registered GPUs",
            ));
        }
        // SAFETY: mapping a page of a descriptor we received, read-only and shared.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                BOARD_BYTES,
                libc::PROT_READ,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        drop(fd);
        s.set_read_timeout(None)?;
        // A daemon that stops reading must not hang a launcher: writes give up after 1 s
        // (the connection is then treated as lost).
        s.set_write_timeout(Some(Duration::from_secs(1)))?;
        let writer = s.try_clone()?;
        let ahead = queue_ahead_us.saturating_mul(1000);
        self.queue_ahead_ns = ahead;
        for d in &mut self.devs {
            d.queue_ahead_ns = ahead;
        }
        for (i, (d, (w, st))) in self
            .devs
            .iter_mut()
            .zip(words.iter().zip(settings))
            .enumerate()
        {
            let w = usize::try_from(*w).unwrap_or(usize::MAX);
            if w >= BOARD_BYTES / BOARD_STRIDE {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("board word {w} out of range"),
                ));
            }
            d.word_index = w;
            d.settings = st;
            d.holding = None;
            let gate = &self.g.gates[i];
            // SAFETY: `w * BOARD_STRIDE` is inside the page-sized mapping, u32-aligned;
            // the mapping is never unmapped (see `Gate::word`).
            let p = unsafe { base.cast::<u8>().add(w * BOARD_STRIDE) }.cast::<AtomicU32>();
            let launched = gate.launched.load(Ordering::Relaxed);
            gate.completed.fetch_max(launched, Ordering::Relaxed);
            gate.next_mark.store(launched + 1, Ordering::Relaxed);
            let old = gate.word();
            gate.word.store(p, Ordering::Release);
            // Launchers waiting on the local word look again, at the board.
            futex_wake(old);
        }
        for i in 0..self.devs.len() {
            self.set_allowed(i);
        }
        *self.g.ctl() = Some(writer);
        // Launchers that were already waiting must be asked for.
        for (i, _) in self.devs.iter().enumerate() {
            if self.g.gates[i].waiting.load(Ordering::SeqCst) > 0 {
                let mut ctl = self.g.ctl();
                if let Some(w) = ctl.as_mut() {
                    let _ = w.write_all(&encode(&ShimMsg::Demand {
                        gpu: u32::try_from(i).unwrap_or(0),
                    }));
                }
            }
        }
        Ok(Conn { stream: s, buf })
    }

    /// The daemon is gone: every gate follows its local word from now on.
    fn enter_fallback(&mut self) {
        *self.g.ctl() = None;
        self.conn = None;
        let now = mono_ns();
        for (i, d) in self.devs.iter_mut().enumerate() {
            let gate = &self.g.gates[i];
            d.local_gen = d.local_gen.wrapping_add(1) & 0x7fff_ffff;
            d.holding = Some(d.local_gen);
            d.grant_at = now;
            d.launched_at_grant = gate.launched.load(Ordering::Relaxed);
            gate.yielded.store(NONE, Ordering::SeqCst);
            gate.local.store((d.local_gen << 1) | 1, Ordering::SeqCst);
            let old = gate.word();
            gate.word.store(std::ptr::null_mut(), Ordering::Release);
            futex_wake(old);
            futex_wake(&gate.local);
        }
        for i in 0..self.devs.len() {
            self.set_allowed(i);
        }
    }

    fn send(&mut self, msg: &ShimMsg) {
        let mut ctl = self.g.ctl();
        if let Some(w) = ctl.as_mut() {
            // Blocking write of a small frame; on failure the reader sees the error.
            let _ = w.write_all(&encode(msg));
        }
    }

    fn run(mut self) {
        loop {
            let holding = self.devs.iter().any(|d| d.holding.is_some());
            if self.conn.is_none() {
                if Instant::now() >= self.next_connect {
                    self.connect();
                    if self.conn.is_some() {
                        continue;
                    }
                }
                self.poll_markers();
                self.fallback_tick();
                let seq = self.g.doorbell.load(Ordering::Acquire);
                let wait = if holding {
                    TICK
                } else {
                    Duration::from_millis(20)
                };
                futex_wait(&self.g.doorbell, seq, wait);
                continue;
            }
            let timeout = if holding {
                TICK
            } else {
                Duration::from_millis(200)
            };
            match self.poll_daemon(timeout) {
                Ok(msgs) => {
                    for m in msgs {
                        self.handle(m);
                    }
                }
                Err(e) => {
                    self.log(|| format!("daemon connection lost ({e}); local fallback"));
                    self.enter_fallback();
                    continue;
                }
            }
            self.poll_markers();
            self.holding_tick();
            if self.last_usage.elapsed() >= Duration::from_secs(1) {
                self.last_usage = Instant::now();
                for i in 0..self.devs.len() {
                    let memory_used = self.shim.region.used(i);
                    self.send(&ShimMsg::Usage {
                        gpu: u32::try_from(i).unwrap_or(0),
                        memory_used,
                    });
                }
            }
        }
    }

    fn poll_daemon(&mut self, timeout: Duration) -> io::Result<Vec<DaemonMsg>> {
        let conn = self
            .conn
            .as_mut()
            .ok_or_else(|| io::Error::other("no connection"))?;
        let mut pfd = libc::pollfd {
            fd: conn.stream.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = i32::try_from(timeout.as_millis())
            .unwrap_or(i32::MAX)
            .max(0);
        let ms = if timeout < Duration::from_millis(1) {
            1
        } else {
            ms
        };
        // SAFETY: one valid pollfd.
        let r = unsafe { libc::poll(&mut pfd, 1, ms) };
        if r < 0 {
            let e = io::Error::last_os_error();
            return if e.kind() == io::ErrorKind::Interrupted {
                Ok(Vec::new())
            } else {
                Err(e)
            };
        }
        let mut out = Vec::new();
        if r > 0 {
            let mut chunk = [0u8; 4096];
            loop {
                // SAFETY: a valid socket and buffer; MSG_DONTWAIT keeps the (blocking)
                // socket's reads non-blocking without changing the shared file
                // description that launchers write through.
                let n = unsafe {
                    libc::recv(
                        conn.stream.as_raw_fd(),
                        chunk.as_mut_ptr().cast(),
                        chunk.len(),
                        libc::MSG_DONTWAIT,
                    )
                };
                if n == 0 {
                    return Err(io::Error::from(io::ErrorKind::UnexpectedEof));
                }
                if n < 0 {
                    let e = io::Error::last_os_error();
                    match e.kind() {
                        io::ErrorKind::WouldBlock => break,
                        io::ErrorKind::Interrupted => continue,
                        _ => return Err(e),
                    }
                }
                conn.buf.extend_from_slice(&chunk[..n as usize]);
            }
            while let Some(m) = decode::<DaemonMsg>(&mut conn.buf)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?
            {
                out.push(m);
            }
        }
        Ok(out)
    }

    fn handle(&mut self, m: DaemonMsg) {
        match m {
            DaemonMsg::Grant {
                gpu,
                generation,
                queue_ahead_us,
            } => {
                let i = gpu as usize;
                let base = self.queue_ahead_ns;
                let Some(d) = self.devs.get_mut(i) else {
                    return;
                };
                let ahead = queue_ahead_us.map_or(base, |q| q.saturating_mul(1000).min(base));
                if ahead != d.queue_ahead_ns {
                    d.queue_ahead_ns = ahead;
                    self.set_allowed(i);
                }
                let Some(d) = self.devs.get_mut(i) else {
                    return;
                };
                let gate = &self.g.gates[i];
                d.holding = Some(generation);
                d.grant_at = mono_ns();
                d.launched_at_grant = gate.launched.load(Ordering::Relaxed);
                d.last_launched = d.launched_at_grant;
                d.idle_ticks = 0;
            }
            DaemonMsg::Revoke { gpu, generation } => {
                let i = gpu as usize;
                if i < self.devs.len() {
                    self.drain(i, generation, false);
                }
            }
            DaemonMsg::Settings { gpu, settings } => {
                if let Some(d) = self.devs.get_mut(gpu as usize) {
                    d.settings = settings;
                }
            }
            DaemonMsg::Welcome { .. } | DaemonMsg::Refused { .. } => {}
        }
    }

    /// How many launches may be outstanding on GPU `i`: the queue-ahead bound over the
    /// measured GPU time per launch (2 until measured; unbounded if the bound is 0).
    fn set_allowed(&mut self, i: usize) {
        let gate = &self.g.gates[i];
        let per = self.devs[i].per_launch_ns;
        let ahead = self.devs[i].queue_ahead_ns as f64;
        let (allowed, every) = if ahead <= 0.0 {
            (UNBOUNDED, u64::MAX / 4)
        } else if per <= 0.0 {
            (UNMEASURED_ALLOWED, UNMEASURED_ALLOWED / 4)
        } else {
            let a = ((ahead / per).ceil() as u64).clamp(2, 1 << 20);
            (a, (a / 4).max(1))
        };
        gate.allowed.store(allowed, Ordering::Relaxed);
        gate.mark_every.store(every, Ordering::Relaxed);
        let launched = gate.launched.load(Ordering::Relaxed);
        let next = gate.next_mark.load(Ordering::Relaxed);
        if next > launched + every {
            gate.next_mark.store(launched + every, Ordering::Relaxed);
        }
        gate.publish_budget();
    }

    /// Learns which launches completed from the marker events (in order), and the GPU
    /// time per launch while the queue stayed busy.
    fn poll_markers(&mut self) {
        for i in 0..self.devs.len() {
            let gate = &self.g.gates[i];
            let mut advanced = false;
            loop {
                let front = gate.markers().pending.front().copied();
                let Some((ctx, event, seq)) = front else {
                    break;
                };
                let done = {
                    let _held = CTX_LOCK.read().unwrap_or_else(|p| p.into_inner());
                    crate::hooks::event_done(event)
                };
                if !done {
                    break;
                }
                {
                    let mut m = gate.markers();
                    if m.pending.front().is_some_and(|f| f.1 == event) {
                        m.pending.pop_front();
                        m.free.push((ctx, event));
                    }
                }
                let now = mono_ns();
                let d = &mut self.devs[i];
                if let Some((t0, s0, busy)) = d.last_obs
                    && busy
                    && seq > s0
                {
                    let sample = now.saturating_sub(t0) as f64 / (seq - s0) as f64;
                    d.per_launch_ns = if d.per_launch_ns <= 0.0 {
                        sample
                    } else {
                        0.8 * d.per_launch_ns + 0.2 * sample
                    };
                }
                let launched = gate.launched.load(Ordering::Relaxed);
                d.last_obs = Some((now, seq, launched > seq));
                gate.completed.fetch_max(seq, Ordering::Relaxed);
                advanced = true;
            }
            if advanced {
                self.set_allowed(i);
            }
            if cfg!(debug_assertions) && std::env::var_os("VGPU_GATE_DEBUG").is_some() {
                let m = gate.markers();
                crate::say!(
                    "gate dbg: launched {} completed {} allowed {} budget {} next_mark {} every {} pending {} free {} created {} per {:.0}",
                    gate.launched.load(Ordering::Relaxed),
                    gate.completed.load(Ordering::Relaxed),
                    gate.allowed.load(Ordering::Relaxed),
                    gate.budget.load(Ordering::Relaxed),
                    gate.next_mark.load(Ordering::Relaxed),
                    gate.mark_every.load(Ordering::Relaxed),
                    m.pending.len(),
                    m.free.len(),
                    m.created,
                    self.devs[i].per_launch_ns
                );
            }
        }
    }

    /// While holding: bound the queue, and yield a slice the process stopped using.
    fn holding_tick(&mut self) {
        let now = mono_ns();
        for i in 0..self.devs.len() {
            let gate = &self.g.gates[i];
            let d = &mut self.devs[i];
            let Some(generation) = d.holding else {
                continue;
            };
            let launched = gate.launched.load(Ordering::Relaxed);
            if launched == d.last_launched
                && gate.waiting.load(Ordering::SeqCst) == 0
                && gate.budget_waiting.load(Ordering::SeqCst) == 0
                && gate.inflight.load(Ordering::SeqCst) == 0
                && gate.markers().pending.is_empty()
            {
                d.idle_ticks += 1;
            } else {
                d.idle_ticks = 0;
                d.last_launched = launched;
            }
            // Idle: no launch for IDLE_TICKS ticks and at least two launches' time.
            let ticks = IDLE_TICKS.max((2.0 * d.per_launch_ns / TICK.as_nanos() as f64) as u32);
            let _ = now;
            if d.idle_ticks >= ticks {
                self.drain(i, generation, true);
            }
        }
    }

    /// Ends this process's part of a slice: no new launches, in-flight ones finish,
    /// queued work completes; then reports when.
    fn drain(&mut self, i: usize, generation: u32, idle: bool) {
        let gate = &self.g.gates[i];
        if idle {
            gate.yielded.store(generation, Ordering::SeqCst);
        }
        let t0 = Instant::now();
        while gate.inflight.load(Ordering::SeqCst) != 0 && t0.elapsed() < Duration::from_millis(200)
        {
            std::thread::sleep(INFLIGHT_POLL);
        }
        sync_device(self.shim, i);
        let end = mono_ns();
        let d = &mut self.devs[i];
        let launched = gate.launched.load(Ordering::Relaxed);
        let launches = launched.saturating_sub(d.launched_at_grant);
        gate.all_completed();
        d.last_obs = None;
        d.holding = None;
        d.idle_ticks = 0;
        let gpu = u32::try_from(i).unwrap_or(0);
        // `waiting` is read under the writer lock, which launchers hold while they
        // count themselves and send a demand: no demand is lost between the two.
        let mut ctl = self.g.ctl();
        let waiting = gate.waiting.load(Ordering::SeqCst) > 0;
        let msg = if idle {
            ShimMsg::Idle {
                gpu,
                generation,
                end_ns: end,
                launches,
            }
        } else {
            ShimMsg::Drained {
                gpu,
                generation,
                end_ns: end,
                launches,
                waiting,
            }
        };
        if let Some(w) = ctl.as_mut() {
            let _ = w.write_all(&encode(&msg));
        }
    }

    /// Fallback: a duty cycle at the share, over measured time.
    fn fallback_tick(&mut self) {
        let now = mono_ns();
        for i in 0..self.devs.len() {
            let gate = &self.g.gates[i];
            let d = &mut self.devs[i];
            let share = u64::from(d.settings.share_pct.clamp(1, 100));
            match d.holding {
                Some(_) if share >= 100 => {}
                Some(local) if now >= d.grant_at + LOCAL_QUANTUM_NS => {
                    let closed = (local.wrapping_add(1) & 0x7fff_ffff) << 1;
                    gate.local.store(closed, Ordering::SeqCst);
                    let t0 = Instant::now();
                    while gate.inflight.load(Ordering::SeqCst) != 0
                        && t0.elapsed() < Duration::from_millis(200)
                    {
                        std::thread::sleep(INFLIGHT_POLL);
                    }
                    sync_device(self.shim, i);
                    let end = mono_ns();
                    let used = end.saturating_sub(d.grant_at);
                    d.closed_until = end + used * (100 - share) / share;
                    d.local_gen = local.wrapping_add(1) & 0x7fff_ffff;
                    d.holding = None;
                    gate.all_completed();
                    d.last_obs = None;
                    let until = d.closed_until.saturating_sub(end) / 1000;
                    crate::state::log(self.shim, || {
                        format!(
                            "fallback: GPU {i} used {} µs, closed for {until} µs",
                            used / 1000
                        )
                    });
                }
                None if now >= d.closed_until => {
                    d.local_gen = d.local_gen.wrapping_add(1) & 0x7fff_ffff;
                    d.holding = Some(d.local_gen);
                    d.grant_at = now;
                    gate.local.store((d.local_gen << 1) | 1, Ordering::SeqCst);
                    futex_wake(&gate.local);
                }
                _ => {}
            }
        }
    }
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
        crate::hooks::sync_context(c);
    }
}

/// Context `ctx` is being destroyed (the caller holds [`CTX_LOCK`] for writing): its
/// marker events go with it.
pub fn forget_context(ctx: usize) {
    let Some(Some(g)) = GATES.get() else { return };
    for gate in &g.gates {
        let mut m = gate.markers();
        let before = m.pending.len() + m.free.len();
        m.pending.retain(|(c, _, _)| *c != ctx);
        m.free.retain(|(c, _)| *c != ctx);
        let gone = before - m.pending.len() - m.free.len();
        m.created -= gone.min(m.created);
    }
}

fn read_quota_file(shim: &Shim) -> Option<vgpu_core::container_quota::ContainerQuota> {
    let text = std::fs::read_to_string(shim.cfg.quota_file()).ok()?;
    vgpu_core::container_quota::ContainerQuota::from_json(&text).ok()
}

/// Receives bytes and at most one descriptor (`SCM_RIGHTS`).
fn recv_with_fd(sock: RawFd, buf: &mut [u8]) -> io::Result<(usize, Option<OwnedFd>)> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut cbuf = [0u64; 8];
    // SAFETY: a zeroed msghdr is valid; the fields are set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = size_of_val(&cbuf);
    // SAFETY: valid socket and buffers that outlive the call.
    let n = unsafe { libc::recvmsg(sock, &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut fd = None;
    // SAFETY: walking the control messages the kernel wrote into `cbuf`.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let raw = std::ptr::read_unaligned(libc::CMSG_DATA(c).cast::<RawFd>());
                if raw >= 0 && fd.is_none() {
                    fd = Some(OwnedFd::from_raw_fd(raw));
                } else if raw >= 0 {
                    libc::close(raw);
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    Ok((n as usize, fd))
}

fn futex_wait(word: &AtomicU32, val: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: libc::time_t::try_from(timeout.as_secs()).unwrap_or(libc::time_t::MAX),
        tv_nsec: libc::c_long::from(timeout.subsec_nanos()),
    };
    // SAFETY: `word` is a valid aligned u32 in a live mapping (process memory or a
    // shared board); FUTEX_WAIT only reads it. Shared (not private): the waker may be
    // another process (the daemon).
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word as *const AtomicU32,
            libc::FUTEX_WAIT,
            val,
            &ts as *const libc::timespec,
        );
    }
}

fn futex_wake(word: &AtomicU32) {
    // SAFETY: a valid aligned u32; waking has no other preconditions.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word as *const AtomicU32,
            libc::FUTEX_WAKE,
            i32::MAX,
        );
    }
}
