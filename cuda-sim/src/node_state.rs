//! The simulated node's shared GPU state: one memory-mapped file that every process of
//! the simulated node maps, as every process of a real node shares its GPUs.
//!
//! Layout: a [`Header`], then [`MAX_DEVICES`] × ([`DeviceInfo`], [`DeviceState`]), then
//! [`MAX_SLOTS`] process [`Slot`]s, then a ring of [`ExitedRec`] accounting records. All
//! mutable fields are atomics, so no cross-process lock is ever held; a process that dies
//! at any instruction leaves the state consistent, and its slot is reclaimed by whoever
//! notices first (see [`State::reap`]).
//!
//! Liveness: each process holds an open-file-description lock (`F_OFD_SETLK`) on byte
//! *i* of `slots.lock` for its slot *i*. The kernel drops it when the process dies,
//! SIGKILL included; `F_OFD_GETLK` from any other process then reports the byte free.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use vgpu_sys::publish::publish_by_link;
use vgpu_sys::shm::SharedMap;
use vgpu_sys::slot_lock::{self, Hold};
use vgpu_sys::{futex_wait, futex_wake, mono_ns};

use crate::config::{DeviceConfig, MAX_DEVICES, SimConfig};

/// Process slots on one node.
pub const MAX_SLOTS: usize = 512;
/// Accounting records kept for exited processes (NVML keeps a bounded buffer too).
pub const EXITED_RING: usize = 1024;
/// Events kept per device.
pub const EVENT_RING: usize = 64;
/// Width of one utilization bucket.
pub const BUCKET_NS: u64 = 100_000_000;
/// Utilization buckets per device (3.2 s of history).
pub const DEV_BUCKETS: usize = 32;
/// Utilization buckets per process and device (1.6 s of history).
pub const SLOT_BUCKETS: usize = 16;

const MAGIC: [u8; 8] = *b"VGPUSIM\0";
/// Bumped whenever the layout changes; part of the file name, so that old and new
/// simulators never map each other's state.
pub const LAYOUT_VERSION: u32 = 5;

/// How long past an engine owner's claim a waiting process takes the engine over, ns:
/// an owner whose worker runs on time releases it first.
const TAKEOVER_GRACE_NS: u64 = 200_000;

const SLOT_FREE: u32 = 0;
const SLOT_CLAIMING: u32 = 1;
const SLOT_LIVE: u32 = 2;
const SLOT_REAPING: u32 = 3;

/// NVML event type bits (nvml.h).
pub mod event_type {
    /// Single-bit ECC error.
    pub const SINGLE_BIT_ECC: u64 = 0x1;
    /// Double-bit ECC error.
    pub const DOUBLE_BIT_ECC: u64 = 0x2;
    /// XID critical error; the event data is the XID.
    pub const XID_CRITICAL: u64 = 0x8;
}

/// The state file's header.
#[repr(C)]
#[derive(Debug)]
pub struct Header {
    magic: [u8; 8],
    layout_version: u32,
    device_count: u32,
    size: u64,
    timeslice_ns: u64,
    /// Fail the Nth allocation counted from when it was set (0 = off).
    pub fail_alloc_nth: AtomicU64,
    /// Device allocations made on the node since `fail_alloc_nth` was set.
    pub alloc_counter: AtomicU64,
    last_reap_ns: AtomicU64,
    exited_next: AtomicU64,
    created_unix_us: u64,
}

/// Immutable description of one device, written when the state is created.
#[repr(C)]
#[derive(Debug)]
pub struct DeviceInfo {
    name: [u8; 96],
    /// UUID bytes.
    pub uuid: [u8; 16],
    pci_bus_id: [u8; 32],
    /// Device memory in bytes.
    pub memory: u64,
    /// Memory one context costs.
    pub context_overhead: u64,
    /// Allocation granularity.
    pub alloc_granularity: u64,
    /// SMs.
    pub sm_count: u32,
    /// Compute capability major.
    pub cc_major: u32,
    /// Compute capability minor.
    pub cc_minor: u32,
    /// Copy bandwidth in GB/s.
    pub bandwidth_gbps: u32,
}

impl DeviceInfo {
    /// Marketing name.
    pub fn name(&self) -> &str {
        cstr_field(&self.name)
    }
    /// PCI bus id in NVML's form.
    pub fn pci_bus_id(&self) -> &str {
        cstr_field(&self.pci_bus_id)
    }
}

fn cstr_field(b: &[u8]) -> &str {
    let n = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    std::str::from_utf8(&b[..n]).unwrap_or("")
}

fn put_cstr(dst: &mut [u8], s: &str) {
    let n = s.len().min(dst.len() - 1);
    dst[..n].copy_from_slice(&s.as_bytes()[..n]);
    dst[n] = 0;
}

/// Time-bucketed busy counters. Each word packs the bucket's epoch (high 24 bits) and
/// the busy nanoseconds in it (low 40 bits), so one CAS both resets and adds.
#[repr(C)]
#[derive(Debug)]
pub struct Buckets<const N: usize> {
    words: [AtomicU64; N],
}

const EPOCH_BITS: u32 = 24;
const BUSY_BITS: u32 = 40;
const BUSY_MASK: u64 = (1 << BUSY_BITS) - 1;
const EPOCH_MASK: u64 = (1 << EPOCH_BITS) - 1;

impl<const N: usize> Buckets<N> {
    fn add_at(&self, epoch: u64, ns: u64) {
        let w = &self.words[(epoch % N as u64) as usize];
        let e = epoch & EPOCH_MASK;
        let mut cur = w.load(Ordering::Relaxed);
        loop {
            let held = cur >> BUSY_BITS;
            let new = if held == e {
                (e << BUSY_BITS) | ((cur & BUSY_MASK) + ns).min(BUSY_MASK)
            } else if cur != 0 && e.wrapping_sub(held) & EPOCH_MASK > EPOCH_MASK / 2 {
                // Older than the bucket's epoch (device time placed in the past by a
                // worker catching up): that bucket has left the ring, nothing to add to.
                return;
            } else {
                (e << BUSY_BITS) | ns.min(BUSY_MASK)
            };
            match w.compare_exchange_weak(cur, new, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => return,
                Err(c) => cur = c,
            }
        }
    }

    /// Adds the busy interval `[start, end)` (monotonic ns), split across buckets.
    pub fn add_interval(&self, start: u64, end: u64) {
        let mut t = start;
        while t < end {
            let epoch = t / BUCKET_NS;
            let edge = ((epoch + 1) * BUCKET_NS).min(end);
            self.add_at(epoch, edge - t);
            t = edge;
        }
    }

    /// Busy nanoseconds in the complete buckets of the window `[now - window, now)`,
    /// and the length of those buckets in ns.
    pub fn busy_in_window(&self, now: u64, window_ns: u64) -> (u64, u64) {
        let cur = now / BUCKET_NS;
        let n = (window_ns / BUCKET_NS).clamp(1, N as u64 - 1);
        let mut busy = 0;
        for epoch in cur.saturating_sub(n)..cur {
            let v = self.words[(epoch % N as u64) as usize].load(Ordering::Acquire);
            if v >> BUSY_BITS == epoch & EPOCH_MASK {
                busy += v & BUSY_MASK;
            }
        }
        (busy, n * BUCKET_NS)
    }
}

/// One recorded device event (XID, ECC).
#[repr(C)]
#[derive(Debug)]
pub struct EventRec {
    seq: AtomicU64,
    kind: AtomicU64,
    data: AtomicU64,
    unix_us: AtomicU64,
}

/// Mutable state of one device.
#[repr(C)]
#[derive(Debug)]
pub struct DeviceState {
    /// Bytes of device memory in use by all processes.
    pub used: AtomicU64,
    /// Non-zero once the device has fallen off the bus.
    pub lost: AtomicU32,
    /// NVML accounting mode (0/1).
    pub accounting_mode: AtomicU32,
    engine_owner: AtomicU32,
    engine_seq: AtomicU32,
    engine_wanting: AtomicU32,
    _pad: u32,
    /// Total device time spent executing work, ns.
    pub busy_total_ns: AtomicU64,
    /// The engine's virtual clock: when the work run on it so far ends (monotonic ns).
    /// Device time is placed on this clock, not measured on the host (see
    /// [`State::engine_clock`]).
    engine_free_at: AtomicU64,
    /// The engine owner's claim: when the work it has queued so far ends on the engine's
    /// clock (`u64::MAX`: not known). Once the clock passes it, a waiting process may take
    /// the engine over without the owner's worker ([`State::engine_acquire`]).
    engine_claim: AtomicU64,
    /// Busy time by 100 ms bucket.
    pub util: Buckets<DEV_BUCKETS>,
    event_seq: AtomicU64,
    events: [EventRec; EVENT_RING],
}

/// One process's use of one device.
#[repr(C)]
#[derive(Debug)]
pub struct SlotDev {
    /// Bytes this process holds on the device.
    pub used: AtomicU64,
    /// High-water mark of `used`.
    pub max_used: AtomicU64,
    /// Contexts this process has on the device.
    pub contexts: AtomicU32,
    want: AtomicU32,
    /// Device time this process's work ran, ns.
    pub busy_ns: AtomicU64,
    /// The claim another process took this process's engine over at: its work queued
    /// up to then ran before the take-over ([`State::engine_lost_claim`]).
    lost_claim: AtomicU64,
    /// Busy time by 100 ms bucket.
    pub util: Buckets<SLOT_BUCKETS>,
}

/// One process of the node.
#[repr(C)]
#[derive(Debug)]
pub struct Slot {
    state: AtomicU32,
    /// The process's host PID (the initial PID namespace's), 0 until known: see
    /// [`State::pid_of`].
    pub pid: AtomicU32,
    /// When the process attached, µs since the Unix epoch.
    pub start_unix_us: AtomicU64,
    /// Inode of the process's PID namespace (`/proc/self/ns/pid`).
    pub ns_ino: AtomicU64,
    /// Its PID in that namespace (`getpid`).
    pub ns_pid: AtomicU32,
    _pad: u32,
    /// Its start time, clock ticks after boot (`/proc/self/stat` field 22): with the
    /// namespace and the PID it names the process for a reader in the initial namespace.
    pub start_ticks: AtomicU64,
    /// Per-device use.
    pub devs: [SlotDev; MAX_DEVICES],
}

/// Accounting of a process that has exited (for `nvmlDeviceGetAccountingStats`).
#[repr(C)]
#[derive(Debug)]
pub struct ExitedRec {
    seq: AtomicU64,
    pid: AtomicU32,
    device: AtomicU32,
    start_unix_us: AtomicU64,
    end_unix_us: AtomicU64,
    busy_ns: AtomicU64,
    max_used: AtomicU64,
}

#[repr(C)]
struct Layout {
    header: Header,
    info: [DeviceInfo; MAX_DEVICES],
    devs: [DeviceState; MAX_DEVICES],
    slots: [Slot; MAX_SLOTS],
    exited: [ExitedRec; EXITED_RING],
    checkpoint: crate::checkpoint_area::CheckpointArea,
}

/// Why the shared state could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// A file operation failed.
    #[error("{op} {path}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The state file is not ours or is damaged.
    #[error("state file {0} is not a vgpu simulator state of layout {LAYOUT_VERSION}")]
    BadFile(PathBuf),
    /// Every process slot is taken by a live process.
    #[error("all {MAX_SLOTS} process slots of the simulated node are in use")]
    SlotsFull,
}

/// Why an allocation was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AllocError {
    /// Not enough free device memory.
    OutOfMemory,
    /// The allocation was failed on purpose (fault injection).
    Injected,
    /// The device is lost.
    DeviceLost,
}

/// A process's accounting record on one device, live or exited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AccountingRecord {
    /// Process id.
    pub pid: u32,
    /// Whether it is still running.
    pub running: bool,
    /// Start, µs since the Unix epoch.
    pub start_unix_us: u64,
    /// Lifetime so far (or in total), µs.
    pub lifetime_us: u64,
    /// Device time its work ran, ns.
    pub busy_ns: u64,
    /// Peak device memory, bytes.
    pub max_used: u64,
}

/// A live process on a device, as NVML lists it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcessOnDevice {
    /// Slot index.
    pub slot: usize,
    /// Process id.
    pub pid: u32,
    /// Device memory it holds, bytes.
    pub used: u64,
    /// Contexts it has on the device.
    pub contexts: u32,
}

/// A device event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceEvent {
    /// Sequence number, increasing per device from 1.
    pub seq: u64,
    /// NVML event type bit.
    pub kind: u64,
    /// Event data (the XID for XID events).
    pub data: u64,
    /// When, µs since the Unix epoch.
    pub unix_us: u64,
}

/// Wall clock in µs since the Unix epoch.
pub fn unix_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

/// The directory holding the node's state: `VGPU_SIM_DIR`, or `/tmp/vgpu-sim-<uid>`.
pub fn state_dir() -> PathBuf {
    match std::env::var_os("VGPU_SIM_DIR") {
        Some(d) if !d.is_empty() => PathBuf::from(d),
        _ => {
            // SAFETY: getuid has no preconditions and cannot fail.
            let uid = unsafe { libc::getuid() };
            PathBuf::from(format!("/tmp/vgpu-sim-{uid}"))
        }
    }
}

/// A process's handle on the shared state.
#[derive(Debug)]
pub struct State {
    map: SharedMap,
    lock_file: File,
    dir: PathBuf,
}

fn io_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> StateError + 'a {
    move |source| StateError::Io {
        op,
        path: path.to_owned(),
        source,
    }
}

impl State {
    /// Opens (creating it from `config` if absent) the state in `dir`.
    pub fn open(dir: &Path, config: &SimConfig) -> Result<State, StateError> {
        std::fs::create_dir_all(dir).map_err(io_err("create state directory", dir))?;
        let path = dir.join(format!("state-v{LAYOUT_VERSION}.bin"));
        let len = size_of::<Layout>();
        let file = match OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(&path)
        {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => Self::create(dir, &path, len, config)?,
            Err(e) => return Err(io_err("open state file", &path)(e)),
        };
        let flen = file
            .metadata()
            .map_err(io_err("stat state file", &path))?
            .len();
        if flen != len as u64 {
            return Err(StateError::BadFile(path));
        }
        let map =
            SharedMap::map(file.as_fd(), len, true).map_err(io_err("map state file", &path))?;
        let lock_path = dir.join("slots.lock");
        let lock_file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o666)
            .custom_flags(libc::O_CLOEXEC)
            .open(&lock_path)
            .map_err(io_err("open slot lock file", &lock_path))?;
        let st = State {
            map,
            lock_file,
            dir: dir.to_owned(),
        };
        let h = &st.layout().header;
        if h.magic != MAGIC || h.layout_version != LAYOUT_VERSION || h.size != len as u64 {
            return Err(StateError::BadFile(path));
        }
        Ok(st)
    }

    /// Opens the state named by the environment (`VGPU_SIM_DIR`, `VGPU_SIM_CONFIG`).
    pub fn open_from_env() -> Result<State, String> {
        let config = SimConfig::from_env().map_err(|e| error_chain(&e))?;
        State::open(&state_dir(), &config).map_err(|e| error_chain(&e))
    }

    fn create(dir: &Path, path: &Path, len: usize, config: &SimConfig) -> Result<File, StateError> {
        // Build the whole file under a private name, then link it into place: a racing
        // process either sees no file or a complete one.
        let tmp = dir.join(format!(
            ".state-v{LAYOUT_VERSION}.{}.tmp",
            std::process::id()
        ));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o666)
            .custom_flags(libc::O_CLOEXEC)
            .open(&tmp)
            .map_err(io_err("create state file", &tmp))?;
        file.set_len(len as u64)
            .map_err(io_err("size state file", &tmp))?;
        let map =
            SharedMap::map(file.as_fd(), len, true).map_err(io_err("map state file", &tmp))?;
        // SAFETY: `map` is a fresh, zero-filled, writable mapping of `len` bytes, which is
        // the size of `Layout` (page aligned, so aligned for it); nobody else can see the
        // file yet, and the reference ends before `map` is dropped. All-zero is a valid
        // bit pattern for every field of `Layout` (integers, atomics and byte arrays).
        let layout = unsafe { &mut *map.as_ptr().cast::<Layout>() };
        init_layout(layout, config, len);
        drop(map);
        // The topology goes first: whoever sees the state file also finds it.
        crate::topology::publish(dir, &config.topology).map_err(|e| StateError::Io {
            op: "publish topology of",
            path: path.to_owned(),
            source: io::Error::other(error_chain(&e)),
        })?;
        publish_by_link(&tmp, path).map_err(io_err("publish state file", path))?;
        OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(path)
            .map_err(io_err("open state file", path))
    }

    fn layout(&self) -> &Layout {
        // SAFETY: `map` maps `size_of::<Layout>()` bytes, page aligned, for as long as
        // `self` lives, and all mutation goes through atomics.
        unsafe { &*self.map.as_ptr().cast::<Layout>() }
    }

    /// The checkpoint API's shared state (see [`crate::checkpoint_area`]).
    pub fn checkpoint(&self) -> &crate::checkpoint_area::CheckpointArea {
        &self.layout().checkpoint
    }

    /// The state directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Number of devices.
    pub fn device_count(&self) -> usize {
        self.layout().header.device_count as usize
    }

    /// The header (fault-injection counters).
    pub fn header(&self) -> &Header {
        &self.layout().header
    }

    /// Time slice of the execution engine.
    pub fn timeslice(&self) -> Duration {
        Duration::from_nanos(self.layout().header.timeslice_ns)
    }

    /// Immutable facts of device `d` (must be < `device_count`).
    pub fn info(&self, d: usize) -> &DeviceInfo {
        &self.layout().info[d]
    }

    /// Mutable state of device `d`.
    pub fn dev(&self, d: usize) -> &DeviceState {
        &self.layout().devs[d]
    }

    /// Slot `i`.
    pub fn slot(&self, i: usize) -> &Slot {
        &self.layout().slots[i]
    }

    /// Whether device `d` is lost.
    pub fn is_lost(&self, d: usize) -> bool {
        self.dev(d).lost.load(Ordering::Acquire) != 0
    }

    /// When the state was created, µs since the Unix epoch.
    pub fn created_unix_us(&self) -> u64 {
        self.layout().header.created_unix_us
    }

    // ---- process slots -------------------------------------------------------------

    /// Whether the process owning slot `i` still holds its liveness lock.
    fn slot_owner_alive(&self, i: usize) -> bool {
        // If we cannot tell, alive: never reclaim a live process's memory.
        slot_lock::owner_alive(&self.lock_file, i)
    }

    /// Claims a slot for this process. The slot stays claimed until the process dies
    /// (or [`State::release_slot`]); reclaiming it is then automatic.
    pub fn claim_slot(&self) -> Result<usize, StateError> {
        for attempt in 0..2 {
            for i in 0..MAX_SLOTS {
                let s = self.slot(i);
                if s.state
                    .compare_exchange(
                        SLOT_FREE,
                        SLOT_CLAIMING,
                        Ordering::AcqRel,
                        Ordering::Relaxed,
                    )
                    .is_err()
                {
                    continue;
                }
                if slot_lock::hold(&self.lock_file, i, Hold::Write).is_err() {
                    s.state.store(SLOT_FREE, Ordering::Release);
                    continue;
                }
                self.checkpoint().reset_slot(i);
                for d in &s.devs {
                    d.used.store(0, Ordering::Relaxed);
                    d.max_used.store(0, Ordering::Relaxed);
                    d.contexts.store(0, Ordering::Relaxed);
                    d.want.store(0, Ordering::Relaxed);
                    d.busy_ns.store(0, Ordering::Relaxed);
                }
                let me = ProcIdentity::of_self();
                s.ns_ino.store(me.ns_ino, Ordering::Relaxed);
                s.ns_pid.store(me.ns_pid, Ordering::Relaxed);
                s.start_ticks.store(me.start_ticks, Ordering::Relaxed);
                s.pid.store(me.host_pid.unwrap_or(0), Ordering::Relaxed);
                s.start_unix_us.store(unix_us(), Ordering::Relaxed);
                s.state.store(SLOT_LIVE, Ordering::Release);
                return Ok(i);
            }
            if attempt == 0 {
                self.reap(None);
            }
        }
        Err(StateError::SlotsFull)
    }

    /// Gives slot `i` back (the process is done with the GPU). Frees what it holds.
    pub fn release_slot(&self, i: usize) {
        let s = self.slot(i);
        if s.state
            .compare_exchange(SLOT_LIVE, SLOT_REAPING, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            self.retire(i);
            let _ = slot_lock::release(&self.lock_file, i);
        }
    }

    /// Reclaims the slots of processes that have died: their memory, contexts and any
    /// engine they held go back to the node. `own` is skipped (this process's slot,
    /// whose lock our own file description holds). Returns how many were reclaimed.
    pub fn reap(&self, own: Option<usize>) -> usize {
        self.layout()
            .header
            .last_reap_ns
            .store(mono_ns(), Ordering::Relaxed);
        let mut n = 0;
        for i in 0..MAX_SLOTS {
            if Some(i) == own || self.slot(i).state.load(Ordering::Acquire) != SLOT_LIVE {
                continue;
            }
            if self.slot_owner_alive(i) {
                continue;
            }
            if self
                .slot(i)
                .state
                .compare_exchange(SLOT_LIVE, SLOT_REAPING, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
            {
                self.retire(i);
                n += 1;
            }
        }
        n
    }

    /// Like [`State::reap`], but at most once per `min_interval_ns` across the node.
    pub fn reap_if_due(&self, own: Option<usize>, min_interval_ns: u64) {
        let last = self.layout().header.last_reap_ns.load(Ordering::Relaxed);
        if mono_ns().saturating_sub(last) >= min_interval_ns {
            self.reap(own);
        }
    }

    /// Frees everything slot `i` holds and marks it free. Caller owns it in REAPING.
    fn retire(&self, i: usize) {
        let s = self.slot(i);
        let pid = match s.pid.load(Ordering::Relaxed) {
            0 => s.ns_pid.load(Ordering::Relaxed),
            p => p,
        };
        let start = s.start_unix_us.load(Ordering::Relaxed);
        let now = unix_us();
        for d in 0..self.device_count() {
            let sd = &s.devs[d];
            let used = sd.used.swap(0, Ordering::AcqRel);
            sub_saturating(&self.dev(d).used, used);
            let had_ctx = sd.contexts.swap(0, Ordering::AcqRel) > 0;
            if sd.want.swap(0, Ordering::AcqRel) != 0 {
                sub_saturating_u32(&self.dev(d).engine_wanting, 1);
            }
            let owner_tag = (i + 1) as u32;
            let e = self.dev(d);
            if e.engine_owner
                .compare_exchange(owner_tag, 0, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
            {
                e.engine_seq.fetch_add(1, Ordering::Release);
                futex_wake(&e.engine_seq);
            }
            let busy = sd.busy_ns.load(Ordering::Relaxed);
            if had_ctx || busy > 0 || sd.max_used.load(Ordering::Relaxed) > 0 {
                let h = &self.layout().header;
                let seq = h.exited_next.fetch_add(1, Ordering::AcqRel) + 1;
                let r = &self.layout().exited[(seq % EXITED_RING as u64) as usize];
                r.seq.store(0, Ordering::Release);
                r.pid.store(pid, Ordering::Relaxed);
                r.device.store(d as u32, Ordering::Relaxed);
                r.start_unix_us.store(start, Ordering::Relaxed);
                r.end_unix_us.store(now, Ordering::Relaxed);
                r.busy_ns.store(busy, Ordering::Relaxed);
                r.max_used
                    .store(sd.max_used.load(Ordering::Relaxed), Ordering::Relaxed);
                r.seq.store(seq, Ordering::Release);
            }
        }
        s.pid.store(0, Ordering::Relaxed);
        s.state.store(SLOT_FREE, Ordering::Release);
    }

    /// The host PID of the process in slot `i`, as a kernel driver reports it wherever
    /// the caller runs. Known at attach for a process of the initial PID namespace (or
    /// one whose `/proc` is the host's); for a process in a container with its own
    /// `/proc`, resolved by the first reader in the initial namespace (its namespace
    /// inode, PID there and start time found in the host's `/proc`) and kept in the
    /// slot for every later reader. A reader that cannot resolve it gets the PID in
    /// the process's own namespace (ADR 0014, `docs/cuda-sim.md`).
    pub fn pid_of(&self, i: usize) -> u32 {
        let s = self.slot(i);
        let pid = s.pid.load(Ordering::Acquire);
        if pid != 0 {
            return pid;
        }
        let who = ProcIdentity {
            ns_ino: s.ns_ino.load(Ordering::Relaxed),
            ns_pid: s.ns_pid.load(Ordering::Relaxed),
            start_ticks: s.start_ticks.load(Ordering::Relaxed),
            host_pid: None,
        };
        if let Some(host) = who.resolve_in_host_proc() {
            // A slot reused meanwhile names another process: keep nothing for it.
            if s.pid
                .compare_exchange(0, host, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
                && (s.ns_pid.load(Ordering::Relaxed) != who.ns_pid
                    || s.start_ticks.load(Ordering::Relaxed) != who.start_ticks)
            {
                let _ = s
                    .pid
                    .compare_exchange(host, 0, Ordering::AcqRel, Ordering::Relaxed);
            }
            return host;
        }
        who.ns_pid
    }

    /// Live processes with a context or memory on device `d`.
    pub fn processes(&self, d: usize) -> Vec<ProcessOnDevice> {
        let mut out = Vec::new();
        for i in 0..MAX_SLOTS {
            let s = self.slot(i);
            if s.state.load(Ordering::Acquire) != SLOT_LIVE {
                continue;
            }
            let sd = &s.devs[d];
            let contexts = sd.contexts.load(Ordering::Acquire);
            let used = sd.used.load(Ordering::Acquire);
            if contexts > 0 || used > 0 {
                out.push(ProcessOnDevice {
                    slot: i,
                    pid: self.pid_of(i),
                    used,
                    contexts,
                });
            }
        }
        out
    }

    /// Slots of live processes (any device).
    pub fn live_slots(&self) -> Vec<usize> {
        (0..MAX_SLOTS)
            .filter(|&i| self.slot(i).state.load(Ordering::Acquire) == SLOT_LIVE)
            .collect()
    }

    /// Accounting records on device `d`: live processes that used it, then exited ones
    /// (newest first, a pid at most once).
    pub fn accounting(&self, d: usize) -> Vec<AccountingRecord> {
        let now = unix_us();
        let mut out = Vec::new();
        for i in 0..MAX_SLOTS {
            let s = self.slot(i);
            if s.state.load(Ordering::Acquire) != SLOT_LIVE {
                continue;
            }
            let sd = &s.devs[d];
            if sd.contexts.load(Ordering::Acquire) == 0 && sd.busy_ns.load(Ordering::Relaxed) == 0 {
                continue;
            }
            let start = s.start_unix_us.load(Ordering::Relaxed);
            out.push(AccountingRecord {
                pid: self.pid_of(i),
                running: true,
                start_unix_us: start,
                lifetime_us: now.saturating_sub(start),
                busy_ns: sd.busy_ns.load(Ordering::Relaxed),
                max_used: sd.max_used.load(Ordering::Relaxed),
            });
        }
        let h = &self.layout().header;
        let last = h.exited_next.load(Ordering::Acquire);
        let first = last.saturating_sub(EXITED_RING as u64 - 1).max(1);
        for seq in (first..=last).rev() {
            let r = &self.layout().exited[(seq % EXITED_RING as u64) as usize];
            if r.seq.load(Ordering::Acquire) != seq
                || r.device.load(Ordering::Relaxed) as usize != d
            {
                continue;
            }
            let pid = r.pid.load(Ordering::Relaxed);
            if out.iter().any(|a| a.pid == pid) {
                continue;
            }
            let start = r.start_unix_us.load(Ordering::Relaxed);
            out.push(AccountingRecord {
                pid,
                running: false,
                start_unix_us: start,
                lifetime_us: r.end_unix_us.load(Ordering::Relaxed).saturating_sub(start),
                busy_ns: r.busy_ns.load(Ordering::Relaxed),
                max_used: r.max_used.load(Ordering::Relaxed),
            });
        }
        out
    }

    /// Forgets the accounting of exited processes on every device.
    pub fn clear_exited_accounting(&self) {
        for r in &self.layout().exited {
            r.seq.store(0, Ordering::Release);
        }
    }

    /// Forgets the accounting of exited processes on device `d`.
    pub fn clear_exited_accounting_on(&self, d: usize) {
        for r in &self.layout().exited {
            if r.device.load(Ordering::Relaxed) as usize == d {
                r.seq.store(0, Ordering::Release);
            }
        }
    }

    // ---- memory ----------------------------------------------------------------------

    /// Rounds `bytes` up to device `d`'s allocation granularity.
    pub fn granular(&self, d: usize, bytes: u64) -> Option<u64> {
        let g = self.info(d).alloc_granularity.max(1);
        bytes.checked_add(g - 1).map(|b| b / g * g)
    }

    /// Charges `bytes` (already rounded) of device `d` to `slot`, atomically: either the
    /// whole amount fits under the device's capacity or nothing is charged. Dead
    /// processes are reaped before out-of-memory is declared. `counted` says whether this
    /// is an allocation that fault injection counts (contexts are not).
    pub fn reserve(
        &self,
        slot: usize,
        d: usize,
        bytes: u64,
        counted: bool,
    ) -> Result<(), AllocError> {
        if self.is_lost(d) {
            return Err(AllocError::DeviceLost);
        }
        if counted {
            let h = &self.layout().header;
            let nth = h.fail_alloc_nth.load(Ordering::Acquire);
            let n = h.alloc_counter.fetch_add(1, Ordering::AcqRel) + 1;
            if nth != 0 && n == nth {
                return Err(AllocError::Injected);
            }
        }
        let dev = self.dev(d);
        let cap = self.info(d).memory;
        for attempt in 0..2 {
            let mut cur = dev.used.load(Ordering::Acquire);
            while let Some(new) = cur.checked_add(bytes).filter(|&n| n <= cap) {
                match dev
                    .used
                    .compare_exchange_weak(cur, new, Ordering::AcqRel, Ordering::Acquire)
                {
                    Ok(_) => {
                        let sd = &self.slot(slot).devs[d];
                        let mine = sd.used.fetch_add(bytes, Ordering::AcqRel) + bytes;
                        sd.max_used.fetch_max(mine, Ordering::AcqRel);
                        return Ok(());
                    }
                    Err(c) => cur = c,
                }
            }
            if attempt == 0 && self.reap(Some(slot)) == 0 {
                break;
            }
        }
        Err(AllocError::OutOfMemory)
    }

    /// Returns `bytes` of device `d` charged to `slot`.
    pub fn release(&self, slot: usize, d: usize, bytes: u64) {
        sub_saturating(&self.slot(slot).devs[d].used, bytes);
        sub_saturating(&self.dev(d).used, bytes);
    }

    /// Free and total memory of device `d`, as `cuMemGetInfo` reports them.
    pub fn mem_info(&self, d: usize) -> (u64, u64) {
        let total = self.info(d).memory;
        let used = self.dev(d).used.load(Ordering::Acquire).min(total);
        (total - used, total)
    }

    // ---- execution engine --------------------------------------------------------------

    /// Blocks until `slot` owns device `d`'s execution engine. The engine is handed
    /// round-robin between processes with pending work; a dead owner is detected and
    /// its engine taken back within a few milliseconds.
    pub fn engine_acquire(&self, slot: usize, d: usize) {
        let e = self.dev(d);
        let me = (slot + 1) as u32;
        let sd = &self.slot(slot).devs[d];
        if e.engine_owner
            .compare_exchange(0, me, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            e.engine_claim.store(u64::MAX, Ordering::Release);
            return;
        }
        if sd.want.swap(1, Ordering::AcqRel) == 0 {
            e.engine_wanting.fetch_add(1, Ordering::AcqRel);
        }
        loop {
            let seq = e.engine_seq.load(Ordering::Acquire);
            let owner = e.engine_owner.load(Ordering::Acquire);
            let got = owner == me
                || (owner == 0
                    && e.engine_owner
                        .compare_exchange(0, me, Ordering::AcqRel, Ordering::Acquire)
                        .is_ok());
            if got {
                e.engine_claim.store(u64::MAX, Ordering::Release);
                if sd.want.swap(0, Ordering::AcqRel) != 0 {
                    sub_saturating_u32(&e.engine_wanting, 1);
                }
                return;
            }
            // The owner's queued work is over on the engine's clock: take the engine over,
            // as a real GPU runs the next context whatever the owner's host threads do (a
            // stopped or throttled owner's worker would hand nothing over).
            let claim = e.engine_claim.load(Ordering::Acquire);
            let now = mono_ns();
            if owner != 0 && claim != u64::MAX && now >= claim + TAKEOVER_GRACE_NS {
                let o = owner as usize - 1;
                self.slot(o).devs[d]
                    .lost_claim
                    .store(claim, Ordering::Release);
                if e.engine_owner
                    .compare_exchange(owner, me, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
                {
                    self.engine_clock_advance(d, claim);
                    e.engine_seq.fetch_add(1, Ordering::Release);
                    futex_wake(&e.engine_seq);
                    continue;
                }
            }
            let wait = if owner != 0 && claim != u64::MAX {
                Duration::from_nanos((claim + TAKEOVER_GRACE_NS).saturating_sub(now))
                    .clamp(Duration::from_micros(50), Duration::from_millis(5))
            } else {
                Duration::from_millis(5)
            };
            if !futex_wait(&e.engine_seq, seq, wait) {
                // Timed out: is the owner still there?
                let owner = e.engine_owner.load(Ordering::Acquire);
                if owner != 0 && owner != me {
                    let o = owner as usize - 1;
                    let dead = self.slot(o).state.load(Ordering::Acquire) != SLOT_LIVE
                        || !self.slot_owner_alive(o);
                    if dead {
                        // Reclaim the dead process (its engine turn, its "want" flag so
                        // that nobody hands it the engine again, its memory).
                        self.reap(Some(slot));
                        if e.engine_owner
                            .compare_exchange(owner, 0, Ordering::AcqRel, Ordering::Acquire)
                            .is_ok()
                        {
                            e.engine_seq.fetch_add(1, Ordering::Release);
                            futex_wake(&e.engine_seq);
                        }
                    }
                }
            }
        }
    }

    /// Publishes the owner's claim on device `d`'s engine: its queued work ends at `t` on
    /// the engine's clock (`u64::MAX`: not known). Only while `slot` owns the engine.
    pub fn engine_claim_set(&self, slot: usize, d: usize, t: u64) {
        if self.engine_owned(slot, d) {
            self.dev(d).engine_claim.store(t, Ordering::Release);
        }
    }

    /// Whether `slot` owns device `d`'s engine.
    pub fn engine_owned(&self, slot: usize, d: usize) -> bool {
        self.dev(d).engine_owner.load(Ordering::Acquire) == (slot + 1) as u32
    }

    /// The claim at which another process last took `slot`'s engine on device `d` over:
    /// work of `slot` placed to end by then ran before the take-over.
    pub fn engine_lost_claim(&self, slot: usize, d: usize) -> u64 {
        self.slot(slot).devs[d].lost_claim.load(Ordering::Acquire)
    }

    /// Whether another process is waiting for device `d`'s engine.
    pub fn engine_contended(&self, d: usize) -> bool {
        self.dev(d).engine_wanting.load(Ordering::Acquire) > 0
    }

    /// Gives device `d`'s engine up: to the next waiting process after `slot` in
    /// round-robin order, or back to free.
    pub fn engine_release(&self, slot: usize, d: usize) {
        let e = self.dev(d);
        let me = (slot + 1) as u32;
        if e.engine_owner.load(Ordering::Acquire) == me {
            e.engine_claim.store(u64::MAX, Ordering::Release);
        }
        let mut next = 0u32;
        if e.engine_wanting.load(Ordering::Acquire) > 0 {
            for k in 1..=MAX_SLOTS {
                let j = (slot + k) % MAX_SLOTS;
                if j != slot
                    && self.slot(j).devs[d].want.load(Ordering::Acquire) != 0
                    && self.slot(j).state.load(Ordering::Acquire) == SLOT_LIVE
                {
                    next = (j + 1) as u32;
                    break;
                }
            }
        }
        if e.engine_owner
            .compare_exchange(me, next, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            e.engine_seq.fetch_add(1, Ordering::Release);
            futex_wake(&e.engine_seq);
        }
    }

    /// Device `d`'s engine clock: when the work run on the engine so far ends
    /// (monotonic ns). The owner of the engine places its next work at or after it and
    /// moves it on ([`State::engine_clock_advance`]) before giving the engine up, so
    /// that device time is exact whatever the host's CPUs do: a real GPU does not slow
    /// down when the host is busy.
    pub fn engine_clock(&self, d: usize) -> u64 {
        self.dev(d).engine_free_at.load(Ordering::Acquire)
    }

    /// Moves device `d`'s engine clock on to `t` (never back).
    pub fn engine_clock_advance(&self, d: usize, t: u64) {
        self.dev(d).engine_free_at.fetch_max(t, Ordering::AcqRel);
    }

    /// Records that `slot`'s work ran on device `d` during `[start, end)` (monotonic ns).
    pub fn add_busy(&self, slot: usize, d: usize, start: u64, end: u64) {
        if end <= start {
            return;
        }
        let ns = end - start;
        let dev = self.dev(d);
        dev.busy_total_ns.fetch_add(ns, Ordering::AcqRel);
        dev.util.add_interval(start, end);
        let sd = &self.slot(slot).devs[d];
        sd.busy_ns.fetch_add(ns, Ordering::AcqRel);
        sd.util.add_interval(start, end);
    }

    /// Device `d`'s utilization over the last `window`, in percent (0–100).
    pub fn utilization_pct(&self, d: usize, window: Duration) -> u32 {
        let (busy, span) = self
            .dev(d)
            .util
            .busy_in_window(mono_ns(), window.as_nanos() as u64);
        ((busy * 100 + span / 2) / span).min(100) as u32
    }

    /// Slot `s`'s utilization of device `d` over the last `window`, in percent.
    pub fn slot_utilization_pct(&self, s: usize, d: usize, window: Duration) -> u32 {
        let (busy, span) = self.slot(s).devs[d]
            .util
            .busy_in_window(mono_ns(), window.as_nanos() as u64);
        ((busy * 100 + span / 2) / span).min(100) as u32
    }

    // ---- events and faults ---------------------------------------------------------

    /// Appends an event to device `d`'s event ring.
    pub fn push_event(&self, d: usize, kind: u64, data: u64) -> u64 {
        let dev = self.dev(d);
        let seq = dev.event_seq.fetch_add(1, Ordering::AcqRel) + 1;
        let r = &dev.events[(seq % EVENT_RING as u64) as usize];
        r.seq.store(0, Ordering::Release);
        r.kind.store(kind, Ordering::Relaxed);
        r.data.store(data, Ordering::Relaxed);
        r.unix_us.store(unix_us(), Ordering::Relaxed);
        r.seq.store(seq, Ordering::Release);
        seq
    }

    /// The newest event sequence number of device `d` (0 = none yet).
    pub fn last_event_seq(&self, d: usize) -> u64 {
        self.dev(d).event_seq.load(Ordering::Acquire)
    }

    /// Events of device `d` with a sequence number greater than `after`, oldest first
    /// (events that have been overwritten in the ring are skipped).
    pub fn events_after(&self, d: usize, after: u64) -> Vec<DeviceEvent> {
        let dev = self.dev(d);
        let last = dev.event_seq.load(Ordering::Acquire);
        let first = (after + 1).max(last.saturating_sub(EVENT_RING as u64 - 1));
        let mut out = Vec::new();
        for seq in first..=last {
            let r = &dev.events[(seq % EVENT_RING as u64) as usize];
            if r.seq.load(Ordering::Acquire) == seq {
                out.push(DeviceEvent {
                    seq,
                    kind: r.kind.load(Ordering::Relaxed),
                    data: r.data.load(Ordering::Relaxed),
                    unix_us: r.unix_us.load(Ordering::Relaxed),
                });
            }
        }
        out
    }

    /// Marks device `d` lost (XID 79, fallen off the bus) or back.
    pub fn set_lost(&self, d: usize, lost: bool) {
        self.dev(d).lost.store(u32::from(lost), Ordering::Release);
        if lost {
            self.push_event(d, event_type::XID_CRITICAL, 79);
        }
    }

    /// Makes the `nth` next device allocation on the node fail (0 turns it off).
    pub fn fail_nth_alloc(&self, nth: u64) {
        let h = &self.layout().header;
        h.fail_alloc_nth.store(0, Ordering::Release);
        h.alloc_counter.store(0, Ordering::Release);
        h.fail_alloc_nth.store(nth, Ordering::Release);
    }
}

fn init_layout(l: &mut Layout, config: &SimConfig, len: usize) {
    l.header.magic = MAGIC;
    l.header.layout_version = LAYOUT_VERSION;
    l.header.device_count = config.devices.len() as u32;
    l.header.size = len as u64;
    l.header.timeslice_ns = config.engine.timeslice_us * 1000;
    l.header.created_unix_us = unix_us();
    l.header
        .fail_alloc_nth
        .store(config.faults.fail_alloc_nth, Ordering::Relaxed);
    for (i, d) in config.devices.iter().enumerate() {
        write_info(&mut l.info[i], d);
        l.devs[i]
            .accounting_mode
            .store(u32::from(config.faults.accounting_mode), Ordering::Relaxed);
    }
    for &lost in &config.faults.lost_devices {
        l.devs[lost as usize].lost.store(1, Ordering::Relaxed);
    }
    l.checkpoint.init(&config.host);
}

fn write_info(info: &mut DeviceInfo, d: &DeviceConfig) {
    put_cstr(&mut info.name, &d.name);
    info.uuid = d.uuid;
    put_cstr(&mut info.pci_bus_id, &d.pci_bus_id);
    info.memory = d.memory;
    info.context_overhead = d.context_overhead;
    info.alloc_granularity = d.alloc_granularity;
    info.sm_count = d.sm_count;
    info.cc_major = d.cc_major;
    info.cc_minor = d.cc_minor;
    info.bandwidth_gbps = d.memory_bandwidth_gbps;
}

fn sub_saturating(a: &AtomicU64, v: u64) {
    let _ = a.fetch_update(Ordering::AcqRel, Ordering::Acquire, |x| {
        Some(x.saturating_sub(v))
    });
}

fn sub_saturating_u32(a: &AtomicU32, v: u32) {
    let _ = a.fetch_update(Ordering::AcqRel, Ordering::Acquire, |x| {
        Some(x.saturating_sub(v))
    });
}

/// Renders an error with its chain of causes, for messages on stderr.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        s.push_str(": ");
        s.push_str(&c.to_string());
        src = c.source();
    }
    s
}

/// Inode of the initial PID namespace (the kernel's `PROC_PID_INIT_INO`).
pub const INIT_PID_NS_INO: u64 = 0xEFFF_FFFC;

/// What names a process across PID namespaces: its namespace, its PID there and its
/// start time; and its host PID when the process itself can tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcIdentity {
    /// Inode of its PID namespace (0: unknown).
    pub ns_ino: u64,
    /// PID in its own namespace.
    pub ns_pid: u32,
    /// Start time, clock ticks after boot (0: unknown).
    pub start_ticks: u64,
    /// Host PID, when known.
    pub host_pid: Option<u32>,
}

/// The PID namespace inode of `/proc/<who>/ns/pid` (`who` = `self` or a PID).
fn pid_ns_ino(who: &str) -> Option<u64> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(format!("/proc/{who}/ns/pid"))
        .ok()
        .map(|m| m.ino())
}

/// Field 22 of `/proc/<who>/stat` (start time, clock ticks after boot).
fn start_ticks(who: &str) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{who}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: count after the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// The `NSpid` fields of `/proc/<who>/status` (outermost namespace `/proc` shows first).
fn nspids(who: &str) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{who}/status"))
        .ok()
        .and_then(|s| {
            let line = s.lines().find_map(|l| l.strip_prefix("NSpid:"))?.to_owned();
            Some(
                line.split_whitespace()
                    .filter_map(|v| v.parse().ok())
                    .collect(),
            )
        })
        .unwrap_or_default()
}

impl ProcIdentity {
    /// This process. Its host PID is known when it runs in the initial PID namespace
    /// (`getpid`), or when its `/proc` is an outer namespace's (the first `NSpid` field
    /// of several); in a container with its own `/proc` it is not.
    pub fn of_self() -> ProcIdentity {
        let ns_ino = pid_ns_ino("self").unwrap_or(0);
        let ns_pid = std::process::id();
        let host_pid = if ns_ino == INIT_PID_NS_INO {
            Some(ns_pid)
        } else {
            match nspids("self").as_slice() {
                [outer, _, ..] => Some(*outer),
                _ => None,
            }
        };
        ProcIdentity {
            ns_ino,
            ns_pid,
            start_ticks: start_ticks("self").unwrap_or(0),
            host_pid,
        }
    }

    /// The host PID of this identity, found in `/proc` by a caller in the initial PID
    /// namespace (None elsewhere, or if no live process matches: namespace, innermost
    /// PID and start time).
    pub fn resolve_in_host_proc(&self) -> Option<u32> {
        if self.ns_ino == 0 || pid_ns_ino("self") != Some(INIT_PID_NS_INO) {
            return None;
        }
        let dir = std::fs::read_dir("/proc").ok()?;
        for e in dir.flatten() {
            let name = e.file_name();
            let Some(pid) = name.to_str().and_then(|n| n.parse::<u32>().ok()) else {
                continue;
            };
            let who = pid.to_string();
            if pid_ns_ino(&who) != Some(self.ns_ino) {
                continue;
            }
            if nspids(&who).last() == Some(&self.ns_pid)
                && (self.start_ticks == 0 || start_ticks(&who) == Some(self.start_ticks))
            {
                return Some(pid);
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_names_itself_and_a_host_reader_finds_it() {
        let me = ProcIdentity::of_self();
        assert_eq!(me.ns_pid, std::process::id());
        assert!(me.ns_ino != 0 && me.start_ticks > 0, "{me:?}");
        if me.ns_ino == INIT_PID_NS_INO {
            assert_eq!(me.host_pid, Some(std::process::id()));
            let unknown = ProcIdentity {
                host_pid: None,
                ..me
            };
            assert_eq!(unknown.resolve_in_host_proc(), Some(std::process::id()));
            let restarted = ProcIdentity {
                start_ticks: me.start_ticks + 1,
                ..unknown
            };
            assert_eq!(
                restarted.resolve_in_host_proc(),
                None,
                "a reused PID is not it"
            );
        }
    }

    fn open_tmp(cfg: &SimConfig) -> (tempfile::TempDir, State) {
        let dir = tempfile::tempdir().expect("tempdir");
        let st = State::open(dir.path(), cfg).expect("open state");
        (dir, st)
    }

    #[test]
    fn two_handles_share_capacity_and_oom_is_exact() {
        let cfg = SimConfig::default();
        let (dir, a) = open_tmp(&cfg);
        let b = State::open(dir.path(), &cfg).expect("second handle");
        let sa = a.claim_slot().expect("slot");
        let sb = b.claim_slot().expect("slot");
        assert_ne!(sa, sb);
        let cap = a.info(0).memory;
        a.reserve(sa, 0, cap - 4096, true).expect("fits");
        assert_eq!(b.mem_info(0), (4096, cap));
        assert_eq!(b.reserve(sb, 0, 4097, true), Err(AllocError::OutOfMemory));
        b.reserve(sb, 0, 4096, true).expect("exactly the rest fits");
        assert_eq!(a.mem_info(0).0, 0);
        a.release(sa, 0, cap - 4096);
        assert_eq!(b.mem_info(0).0, cap - 4096);
        // Released twice: saturates, never wraps.
        a.release(sa, 0, cap);
        assert!(a.dev(0).used.load(Ordering::Relaxed) <= cap);
    }

    #[test]
    fn racing_reservations_never_exceed_capacity() {
        let cfg = SimConfig::from_toml(
            "[[device]]\nmemory = \"64Mi\"\ncontext_overhead = \"0\"",
            "t",
        )
        .expect("cfg");
        let (dir, first) = open_tmp(&cfg);
        let granted = AtomicU64::new(0);
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| {
                    let st = State::open(dir.path(), &cfg).expect("handle");
                    let slot = st.claim_slot().expect("slot");
                    // Odd sizes, so that the last reservations only partly fit.
                    for i in 0..10_000u64 {
                        let n = 4096 + (i % 7) * 1000;
                        if st.reserve(slot, 0, n, false).is_ok() {
                            granted.fetch_add(n, Ordering::Relaxed);
                        }
                    }
                    std::mem::forget(st); // keep the slot: its charges must stay counted
                });
            }
        });
        let total = granted.load(Ordering::Relaxed);
        assert!(
            total <= 64 << 20,
            "granted {total} bytes of a 64 MiB device"
        );
        assert!(
            total > (64 << 20) - 10_000,
            "the device should have been filled: {total}"
        );
        assert_eq!(first.dev(0).used.load(Ordering::Relaxed), total);
    }

    #[test]
    fn released_slot_returns_memory_and_records_accounting() {
        let (_d, st) = open_tmp(&SimConfig::default());
        let s = st.claim_slot().expect("slot");
        st.slot(s).devs[0].contexts.store(1, Ordering::Relaxed);
        st.reserve(s, 0, 1 << 30, true).expect("fits");
        st.release_slot(s);
        assert_eq!(st.dev(0).used.load(Ordering::Relaxed), 0);
        let acc = st.accounting(0);
        assert_eq!(acc.len(), 1);
        assert!(!acc[0].running);
        assert_eq!(acc[0].max_used, 1 << 30);
    }

    #[test]
    fn injected_failure_hits_exactly_the_nth() {
        let (_d, st) = open_tmp(&SimConfig::default());
        let s = st.claim_slot().expect("slot");
        st.fail_nth_alloc(3);
        assert!(st.reserve(s, 0, 4096, true).is_ok());
        assert!(st.reserve(s, 0, 4096, false).is_ok(), "uncounted");
        assert!(st.reserve(s, 0, 4096, true).is_ok());
        assert_eq!(st.reserve(s, 0, 4096, true), Err(AllocError::Injected));
        assert!(st.reserve(s, 0, 4096, true).is_ok());
    }

    #[test]
    fn buckets_split_intervals() {
        let b: Buckets<8> = Buckets {
            words: Default::default(),
        };
        let t0 = 10 * BUCKET_NS;
        b.add_interval(t0 + BUCKET_NS / 2, t0 + BUCKET_NS + BUCKET_NS / 4);
        let (busy, span) = b.busy_in_window(t0 + 2 * BUCKET_NS, 2 * BUCKET_NS);
        assert_eq!(span, 2 * BUCKET_NS);
        assert_eq!(busy, BUCKET_NS / 2 + BUCKET_NS / 4);
    }

    #[test]
    fn events_ring() {
        let (_d, st) = open_tmp(&SimConfig::default());
        assert_eq!(st.last_event_seq(0), 0);
        st.push_event(0, event_type::XID_CRITICAL, 48);
        st.set_lost(0, true);
        let ev = st.events_after(0, 0);
        assert_eq!(ev.len(), 2);
        assert_eq!((ev[0].data, ev[1].data), (48, 79));
        assert!(st.events_after(0, 2).is_empty());
        assert_eq!(st.reserve(0, 0, 1, true), Err(AllocError::DeviceLost));
    }

    #[test]
    fn engine_hand_off_between_handles() {
        let cfg = SimConfig::default();
        let (dir, a) = open_tmp(&cfg);
        let b = std::sync::Arc::new(State::open(dir.path(), &cfg).expect("b"));
        let sa = a.claim_slot().expect("slot");
        let sb = b.claim_slot().expect("slot");
        a.engine_acquire(sa, 0);
        let b2 = b.clone();
        let t = std::thread::spawn(move || {
            b2.engine_acquire(sb, 0);
            b2.engine_release(sb, 0);
        });
        while !a.engine_contended(0) {
            std::thread::yield_now();
        }
        a.engine_release(sa, 0);
        t.join().expect("waiter got the engine");
        assert_eq!(a.dev(0).engine_owner.load(Ordering::Relaxed), 0);
    }
}
