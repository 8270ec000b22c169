//! The container's shared accounting region: atomics in a SysV shared memory segment
//! keyed by the container directory (ADR 0015, after ADR 0008 and the simulator's ADR
//! 0002), attached by every process of the container.
//!
//! - Per device: the quota and the bytes charged. A charge is one compare-and-swap that
//!   either fits entirely under the quota or charges nothing, so racing processes can
//!   never exceed the quota by a byte; arithmetic saturates and never wraps.
//! - Per process: a slot with its own charges. Liveness comes from the kernel: the owner
//!   of slot *i* holds an open-file-description read lock on byte *i* of the container
//!   directory itself, which the kernel drops when the process dies (SIGKILL included).
//!   Whoever needs the truth (before declaring out-of-memory, on every memory query)
//!   reaps dead slots: a CAS from LIVE to REAPING makes that exactly-once.
//! - No cross-process lock exists, so a process killed at any instruction cannot wedge
//!   the others; no file a tenant can truncate, replace or delete is mapped or locked.
//! - A segment whose header is damaged is reported and repaired (header rewritten, the
//!   device totals rebuilt from the live slots); one of another size is removed when
//!   nobody has it attached.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::config::MAX_DEVICES;
use crate::segment::{self, DirId};

const MAGIC: u64 = 0x4d49_4853_5550_4756; // "VGPUSHIM", little-endian
/// Layout version (3: SysV segment, liveness on the directory); part of the segment key,
/// so different layouts never attach each other's region.
pub use vgpu_core::region_key::LAYOUT_VERSION;
/// Words of the header that hold the container directory's path (for the removal of
/// segments whose directory is gone).
const PATH_WORDS: usize = 32;
/// How long an attaching process waits for the creator to initialise a segment.
const INIT_WAIT: Duration = Duration::from_millis(200);
/// Process slots per container.
pub const MAX_SLOTS: usize = 256;

const SLOT_FREE: u32 = 0;
const SLOT_CLAIMING: u32 = 1;
const SLOT_LIVE: u32 = 2;
const SLOT_REAPING: u32 = 3;

/// Atomics all: a tenant can write the segment while others read it.
#[repr(C)]
struct Header {
    /// [`MAGIC`], stored last by the creator.
    magic: AtomicU64,
    layout_version: AtomicU64,
    size: AtomicU64,
    dir_dev: AtomicU64,
    dir_ino: AtomicU64,
    dir_born: AtomicU64,
    dir_path_len: AtomicU64,
    dir_path: [AtomicU64; PATH_WORDS],
}

/// The container's account on one device.
#[repr(C)]
struct DevAcct {
    /// Quota in bytes; 0 = none (unlimited).
    quota: AtomicU64,
    /// Bytes charged by all live processes.
    used: AtomicU64,
    /// Contexts held by all live processes.
    contexts: AtomicU64,
}

#[repr(C)]
struct Slot {
    state: AtomicU32,
    pid: AtomicU32,
    /// The process's PID in the host's namespace (what NVML reports), once the daemon
    /// told it; 0: unknown (then `pid` is assumed to be what NVML reports).
    host_pid: AtomicU32,
    used: [AtomicU64; MAX_DEVICES],
    contexts: [AtomicU64; MAX_DEVICES],
}

#[repr(C)]
struct Layout {
    header: Header,
    devs: [DevAcct; MAX_DEVICES],
    slots: [Slot; MAX_SLOTS],
}

/// The SysV shared memory keys the region of the container directory `dir` may have, in
/// the order they are tried (for tools and tests that look at the region from outside).
pub fn segment_keys(dir: &Path) -> io::Result<Vec<libc::key_t>> {
    Ok(vgpu_core::region_key::keys(segment::dir_id(dir)?))
}

/// An attached accounting region.
#[derive(Debug)]
pub struct Region {
    base: *mut Layout,
    /// The container directory, open: its byte locks are the slots' liveness.
    dir_file: File,
    dir: PathBuf,
    key: libc::key_t,
    shmid: libc::c_int,
    /// What was found wrong (and done) while attaching, for the caller to report.
    notes: Vec<String>,
}

// SAFETY: the segment is shared memory whose every field is an atomic; the pointer
// stays valid for the life of `Region` (detached only in Drop).
unsafe impl Send for Region {}
// SAFETY: as above, all access through `&Layout` is to atomics or immutable fields.
unsafe impl Sync for Region {}

fn ctx_err(op: &str, path: &Path) -> impl FnOnce(io::Error) -> io::Error {
    let msg = format!("{op} {}", path.display());
    move |e| io::Error::new(e.kind(), format!("{msg}: {e}"))
}

/// Subtracts `n` from `a`, stopping at zero (never wraps).
fn sub_saturating(a: &AtomicU64, n: u64) {
    let _ = a.fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
        Some(v.saturating_sub(n))
    });
}

fn add_saturating(a: &AtomicU64, n: u64) {
    let _ = a.fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
        Some(v.saturating_add(n))
    });
}

impl Region {
    /// Attaches (creating it if absent) the region of the container directory `dir`.
    /// A damaged region found on the way is repaired or replaced, and said in
    /// [`Region::notes`].
    pub fn open(dir: &Path) -> io::Result<Region> {
        if !dir.exists() {
            std::fs::create_dir_all(dir).map_err(ctx_err("create container directory", dir))?;
            // Every user of the container shares one budget.
            let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o1777));
        }
        let dir_file = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECTORY | libc::O_CLOEXEC)
            .open(dir)
            .map_err(ctx_err("open container directory", dir))?;
        let id = segment::dir_id(dir).map_err(ctx_err("stat container directory", dir))?;
        let len = size_of::<Layout>();
        let mut notes = Vec::new();
        for probe in 0..segment::PROBES {
            let key = segment::key(id, probe);
            // A segment removed under us (dead garbage, or by a tenant) is tried again.
            for _ in 0..4 {
                let Some(seg) = segment::create_or_attach(key, len)
                    .map_err(ctx_err("attach the accounting region of", dir))?
                else {
                    continue;
                };
                let base = seg.base.cast::<Layout>();
                // SAFETY: `seg` is an attachment of `len` = size_of::<Layout>() bytes
                // (created so, or its size checked), detached only by `Region::drop` or
                // below; every field is an atomic, all-zero valid.
                let l = unsafe { &*base };
                let what = format!(
                    "accounting region of {} (SysV shared memory key {key:#010x}, id {})",
                    dir.display(),
                    seg.id
                );
                let alive = |i: usize| owner_alive(&dir_file, i);
                let verdict = if seg.created {
                    write_header(l, id, dir);
                    remove_dead_segments(len);
                    Verdict::Ours
                } else {
                    wait_verdict(l, id)
                };
                match verdict {
                    Verdict::Ours => {}
                    Verdict::Foreign => {
                        // SAFETY: `l` is not used after this.
                        unsafe { segment::detach(seg.base) };
                        break;
                    }
                    Verdict::Damaged(wrong) => {
                        let attached = segment::stat(seg.id).map_or(u64::MAX, |s| s.attached);
                        if attached <= 1 {
                            // Nobody else uses it: replaced by a fresh one.
                            notes.push(format!(
                                "{what}: {wrong}; nobody uses it: replaced by a fresh region"
                            ));
                            let _ = segment::remove(seg.id);
                            // SAFETY: `l` is not used after this.
                            unsafe { segment::detach(seg.base) };
                            continue;
                        }
                        // Processes use it (this container's, or a tenant's garbage
                        // held open): repaired in place, so that they and we keep one
                        // budget.
                        repair(l, id, dir, alive);
                        notes.push(format!(
                            "{what}: {wrong}; {} other processes have it attached: header rewritten, device totals rebuilt from the live processes' slots",
                            attached.saturating_sub(1)
                        ));
                    }
                }
                if segment::stat(seg.id).is_ok_and(|s| s.removed) {
                    // Removed while we attached (by a process that found it damaged and
                    // unused a moment ago): new processes will not find it; neither may we.
                    // SAFETY: `l` is not used after this.
                    unsafe { segment::detach(seg.base) };
                    continue;
                }
                return Ok(Region {
                    base,
                    dir_file,
                    dir: dir.to_owned(),
                    key,
                    shmid: seg.id,
                    notes,
                });
            }
        }
        Err(io::Error::other(format!(
            "no usable accounting region for {}: the {} shared memory keys derived from it are taken by segments of others{}",
            dir.display(),
            segment::PROBES,
            if notes.is_empty() {
                String::new()
            } else {
                format!(" ({})", notes.join("; "))
            }
        )))
    }

    /// What was found wrong while attaching (and what was done), for the caller to
    /// report.
    pub fn notes(&self) -> &[String] {
        &self.notes
    }

    fn layout(&self) -> &Layout {
        // SAFETY: `base` maps size_of::<Layout>() bytes for as long as `self` lives and
        // all mutation goes through atomics.
        unsafe { &*self.base }
    }

    /// The region, for messages: the container directory and the segment.
    pub fn describe(&self) -> String {
        format!(
            "the accounting region of {} (SysV shared memory key {:#010x}, id {})",
            self.dir.display(),
            self.key,
            self.shmid
        )
    }

    fn dev(&self, d: usize) -> Option<&DevAcct> {
        self.layout().devs.get(d)
    }

    /// Brings device `d`'s quota down to `quota` if it is unset or higher; returns the
    /// quota in force (`None`: unlimited). The lowest quota any process of the container
    /// brought wins: a process can only lower it (the region file is writable by the
    /// tenant, so each process also caps its own charges at its quota, see
    /// [`Region::try_charge`]).
    pub fn init_quota(&self, d: usize, quota: Option<u64>) -> Option<u64> {
        let dev = self.dev(d)?;
        if let Some(q) = quota {
            let _ = dev
                .quota
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |cur| {
                    (cur == 0 || cur > q).then_some(q)
                });
        }
        self.quota(d)
    }

    /// Device `d`'s quota (`None`: unlimited).
    pub fn quota(&self, d: usize) -> Option<u64> {
        match self.dev(d)?.quota.load(Ordering::Acquire) {
            0 => None,
            q => Some(q),
        }
    }

    /// Bytes the container has charged on device `d`.
    pub fn used(&self, d: usize) -> u64 {
        self.dev(d).map_or(0, |x| x.used.load(Ordering::Acquire))
    }

    /// Contexts the container holds on device `d`.
    pub fn contexts(&self, d: usize) -> u64 {
        self.dev(d)
            .map_or(0, |x| x.contexts.load(Ordering::Acquire))
    }

    fn ofd_lock(&self, slot: usize, cmd: libc::c_int, ty: libc::c_int) -> io::Result<libc::flock> {
        ofd_lock(&self.dir_file, slot, cmd, ty)
    }

    fn owner_alive(&self, i: usize) -> bool {
        owner_alive(&self.dir_file, i)
    }

    /// Claims a slot for this process until it dies (or [`Region::release_slot`]).
    pub fn claim_slot(&self) -> io::Result<usize> {
        for attempt in 0..2 {
            for (i, s) in self.layout().slots.iter().enumerate() {
                // A state no shim writes (a tenant's) is free once nobody holds the slot.
                let st = s.state.load(Ordering::Acquire);
                let from = if st > SLOT_REAPING && !self.owner_alive(i) {
                    st
                } else {
                    SLOT_FREE
                };
                if s.state
                    .compare_exchange(from, SLOT_CLAIMING, Ordering::AcqRel, Ordering::Relaxed)
                    .is_err()
                {
                    continue;
                }
                if self.ofd_lock(i, libc::F_OFD_SETLK, libc::F_RDLCK).is_err() {
                    s.state.store(SLOT_FREE, Ordering::Release);
                    continue;
                }
                for d in 0..MAX_DEVICES {
                    s.used[d].store(0, Ordering::Relaxed);
                    s.contexts[d].store(0, Ordering::Relaxed);
                }
                s.pid.store(std::process::id(), Ordering::Relaxed);
                s.host_pid.store(0, Ordering::Relaxed);
                s.state.store(SLOT_LIVE, Ordering::Release);
                return Ok(i);
            }
            if attempt == 0 {
                self.reap(None);
            }
        }
        Err(io::Error::other(format!(
            "all {MAX_SLOTS} process slots of {} are taken",
            self.describe()
        )))
    }

    /// Gives slot `i` back, returning what it holds to the container.
    pub fn release_slot(&self, i: usize) {
        let Some(s) = self.layout().slots.get(i) else {
            return;
        };
        if s.state
            .compare_exchange(SLOT_LIVE, SLOT_REAPING, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            self.retire(i);
            let _ = self.ofd_lock(i, libc::F_OFD_SETLK, libc::F_UNLCK);
        }
    }

    /// Reclaims the slots of dead processes (`own`, whose lock we hold, is skipped).
    /// Returns how many were reclaimed.
    pub fn reap(&self, own: Option<usize>) -> usize {
        let mut n = 0;
        for (i, s) in self.layout().slots.iter().enumerate() {
            if Some(i) == own || s.state.load(Ordering::Acquire) != SLOT_LIVE {
                continue;
            }
            if self.owner_alive(i) {
                continue;
            }
            if s.state
                .compare_exchange(SLOT_LIVE, SLOT_REAPING, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
            {
                self.retire(i);
                n += 1;
            }
        }
        n
    }

    fn retire(&self, i: usize) {
        let s = &self.layout().slots[i];
        for d in 0..MAX_DEVICES {
            let used = s.used[d].swap(0, Ordering::AcqRel);
            sub_saturating(&self.layout().devs[d].used, used);
            let ctxs = s.contexts[d].swap(0, Ordering::AcqRel);
            sub_saturating(&self.layout().devs[d].contexts, ctxs);
        }
        s.pid.store(0, Ordering::Relaxed);
        s.state.store(SLOT_FREE, Ordering::Release);
    }

    /// Charges `bytes` on device `d` to slot `slot`: all or nothing, never over the
    /// quota. Returns false (charging nothing) if it does not fit.
    pub fn try_charge(&self, slot: usize, d: usize, bytes: u64, cap: Option<u64>) -> bool {
        let (Some(dev), Some(s)) = (self.dev(d), self.layout().slots.get(slot)) else {
            return false;
        };
        // The region's quota can be raised by anyone who can write the file (the tenant):
        // the process's own quota (from the read-only quota file or its environment) caps it.
        let quota = match (dev.quota.load(Ordering::Acquire), cap) {
            (0, Some(c)) => c,
            (q, Some(c)) => q.min(c),
            (q, None) => q,
        };
        let ok = dev
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                let new = used.checked_add(bytes)?;
                (quota == 0 || new <= quota).then_some(new)
            })
            .is_ok();
        if ok {
            // The device total first: a process dying between the two steps leaks the
            // charge (the container sees less) rather than exceeding the quota.
            add_saturating(&s.used[d], bytes);
        }
        ok
    }

    /// Returns `bytes` on device `d` from slot `slot` to the container.
    pub fn uncharge(&self, slot: usize, d: usize, bytes: u64) {
        let (Some(dev), Some(s)) = (self.dev(d), self.layout().slots.get(slot)) else {
            return;
        };
        sub_saturating(&s.used[d], bytes);
        sub_saturating(&dev.used, bytes);
    }

    /// Counts a context created (`+1`) or destroyed (`-1`) on device `d`.
    pub fn count_context(&self, slot: usize, d: usize, created: bool) {
        let (Some(dev), Some(s)) = (self.dev(d), self.layout().slots.get(slot)) else {
            return;
        };
        if created {
            add_saturating(&s.contexts[d], 1);
            add_saturating(&dev.contexts, 1);
        } else {
            sub_saturating(&s.contexts[d], 1);
            sub_saturating(&dev.contexts, 1);
        }
    }

    /// Records the host PID of slot `slot`'s process (from the daemon).
    pub fn set_host_pid(&self, slot: usize, host_pid: u32) {
        if let Some(s) = self.layout().slots.get(slot) {
            s.host_pid.store(host_pid, Ordering::Relaxed);
        }
    }

    /// The live slot of the process NVML reports as `nvml_pid`: matched on its host PID
    /// when known (a container's PID namespace), else on its own PID.
    fn slot_of_nvml_pid(&self, nvml_pid: u32) -> Option<&Slot> {
        if nvml_pid == 0 {
            return None;
        }
        self.layout().slots.iter().find(|s| {
            if s.state.load(Ordering::Acquire) != SLOT_LIVE {
                return false;
            }
            match s.host_pid.load(Ordering::Relaxed) {
                0 => s.pid.load(Ordering::Relaxed) == nvml_pid,
                h => h == nvml_pid,
            }
        })
    }

    /// The container's own PID of the process NVML reports as `nvml_pid` (None: not one
    /// of the container's processes).
    pub fn container_pid(&self, nvml_pid: u32) -> Option<u32> {
        self.slot_of_nvml_pid(nvml_pid)
            .map(|s| s.pid.load(Ordering::Relaxed))
    }

    /// Bytes the live process NVML reports as `nvml_pid` holds on device `d` (None: not
    /// one of ours).
    pub fn pid_used(&self, nvml_pid: u32, d: usize) -> Option<u64> {
        self.slot_of_nvml_pid(nvml_pid)
            .and_then(|s| s.used.get(d))
            .map(|u| u.load(Ordering::Acquire))
    }

    /// Bytes slot `slot` holds on device `d`.
    pub fn slot_used(&self, slot: usize, d: usize) -> u64 {
        self.layout()
            .slots
            .get(slot)
            .and_then(|s| s.used.get(d))
            .map_or(0, |u| u.load(Ordering::Acquire))
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: detaching our own attachment; no reference into it outlives `self`.
        unsafe { segment::detach(self.base.cast()) };
    }
}

/// An open-file-description lock command on byte `slot` of `file`.
fn ofd_lock(
    file: &File,
    slot: usize,
    cmd: libc::c_int,
    ty: libc::c_int,
) -> io::Result<libc::flock> {
    // SAFETY: flock is plain old data; all-zero is valid.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = ty as libc::c_short;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    fl.l_start = libc::off_t::try_from(slot).unwrap_or(libc::off_t::MAX);
    fl.l_len = 1;
    // SAFETY: `file` is open; `fl` is a valid flock.
    let rc = unsafe { libc::fcntl(file.as_raw_fd(), cmd, &mut fl) };
    if rc == 0 {
        Ok(fl)
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Whether another open file description holds a lock on byte `i` of the container
/// directory `dir_file` (the owner of slot `i` holds a read lock there; a write lock is
/// what conflicts with it).
fn owner_alive(dir_file: &File, i: usize) -> bool {
    match ofd_lock(dir_file, i, libc::F_OFD_GETLK, libc::F_WRLCK) {
        Ok(fl) => fl.l_type != libc::F_UNLCK as libc::c_short,
        // When in doubt, alive: never reclaim a live process's memory.
        Err(_) => true,
    }
}

fn write_header(l: &Layout, id: DirId, dir: &Path) {
    let h = &l.header;
    h.layout_version
        .store(u64::from(LAYOUT_VERSION), Ordering::Relaxed);
    h.size.store(size_of::<Layout>() as u64, Ordering::Relaxed);
    h.dir_dev.store(id.dev, Ordering::Relaxed);
    h.dir_ino.store(id.ino, Ordering::Relaxed);
    h.dir_born.store(id.born, Ordering::Relaxed);
    let bytes = dir.as_os_str().as_encoded_bytes();
    let n = bytes.len().min(PATH_WORDS * 8);
    h.dir_path_len.store(n as u64, Ordering::Relaxed);
    for (w, chunk) in h.dir_path.iter().zip(bytes[..n].chunks(8)) {
        let mut b = [0u8; 8];
        b[..chunk.len()].copy_from_slice(chunk);
        w.store(u64::from_le_bytes(b), Ordering::Relaxed);
    }
    h.magic.store(MAGIC, Ordering::Release);
}

/// Whose the attached segment is, waiting (bounded) for its creator to initialise it.
fn wait_verdict(l: &Layout, id: DirId) -> Verdict {
    let start = Instant::now();
    loop {
        let blank = l.header.magic.load(Ordering::Acquire) == 0
            && l.header.size.load(Ordering::Relaxed) == 0;
        match verdict(l, id) {
            Verdict::Damaged(_) if blank && start.elapsed() < INIT_WAIT => {
                std::thread::sleep(Duration::from_millis(1));
            }
            v => return v,
        }
    }
}

/// Makes a damaged region usable again: a fresh header; slots in no known state freed
/// when their owner is dead, else live again (counted, and reaped at its death); each
/// device's total rebuilt as the sum of its live slots (the counters a tenant wrote are
/// not trusted; a charge in flight at this instant may be missed, at most one
/// allocation per process).
fn repair(l: &Layout, id: DirId, dir: &Path, alive: impl Fn(usize) -> bool) {
    for (i, s) in l.slots.iter().enumerate() {
        let st = s.state.load(Ordering::Acquire);
        if st > SLOT_REAPING {
            let to = if alive(i) { SLOT_LIVE } else { SLOT_FREE };
            let _ = s
                .state
                .compare_exchange(st, to, Ordering::AcqRel, Ordering::Relaxed);
        }
    }
    for d in 0..MAX_DEVICES {
        let sum = l
            .slots
            .iter()
            .filter(|s| s.state.load(Ordering::Acquire) == SLOT_LIVE)
            .fold(0u64, |a, s| {
                a.saturating_add(s.used[d].load(Ordering::Acquire))
            });
        l.devs[d].used.store(sum, Ordering::Release);
    }
    write_header(l, id, dir);
}

/// Whose an attached segment of the right size is.
enum Verdict {
    /// This container's region.
    Ours,
    /// A valid region of another directory (a key collision): try the next key.
    Foreign,
    /// Not a valid region: what is wrong.
    Damaged(String),
}

fn verdict(l: &Layout, id: DirId) -> Verdict {
    let h = &l.header;
    let magic = h.magic.load(Ordering::Acquire);
    if magic != MAGIC {
        return Verdict::Damaged(format!("bad magic number {magic:#018x}"));
    }
    let v = h.layout_version.load(Ordering::Relaxed);
    if v != u64::from(LAYOUT_VERSION) {
        return Verdict::Damaged(format!("layout version {v}, expected {LAYOUT_VERSION}"));
    }
    let size = h.size.load(Ordering::Relaxed);
    if size != size_of::<Layout>() as u64 {
        return Verdict::Damaged(format!(
            "header says {size} bytes, expected {}",
            size_of::<Layout>()
        ));
    }
    let recorded = DirId {
        dev: h.dir_dev.load(Ordering::Relaxed),
        ino: h.dir_ino.load(Ordering::Relaxed),
        born: h.dir_born.load(Ordering::Relaxed),
    };
    if recorded != id {
        return Verdict::Foreign;
    }
    Verdict::Ours
}

/// The directory path a region's header records.
fn recorded_dir(h: &Header) -> Option<PathBuf> {
    let n = usize::try_from(h.dir_path_len.load(Ordering::Relaxed)).ok()?;
    if n == 0 || n > PATH_WORDS * 8 {
        return None;
    }
    let mut bytes: Vec<u8> = h
        .dir_path
        .iter()
        .flat_map(|w| w.load(Ordering::Relaxed).to_le_bytes())
        .collect();
    bytes.truncate(n);
    Some(PathBuf::from(std::ffi::OsString::from(
        String::from_utf8_lossy(&bytes).into_owned(),
    )))
}

/// Removes the regions nobody has attached whose container directory is gone (a new
/// directory, a new key): segments outlive their processes, and a node or a test run
/// creates many containers.
fn remove_dead_segments(len: usize) {
    for id in segment::unattached_of_size(len) {
        let Ok(base) = segment::attach_read_only(id) else {
            continue;
        };
        // SAFETY: `base` is a read-only attachment of `len` = size_of::<Layout>() bytes
        // (the size was checked); every field is an atomic, and only loaded here.
        let l = unsafe { &*base.cast::<Layout>() };
        let dead = l.header.magic.load(Ordering::Acquire) == MAGIC
            && l.header.layout_version.load(Ordering::Relaxed) == u64::from(LAYOUT_VERSION)
            && recorded_dir(&l.header).is_some_and(|p| {
                segment::dir_id(&p).ok()
                    != Some(DirId {
                        dev: l.header.dir_dev.load(Ordering::Relaxed),
                        ino: l.header.dir_ino.load(Ordering::Relaxed),
                        born: l.header.dir_born.load(Ordering::Relaxed),
                    })
            });
        // Only we have it attached (ours is the one attachment): nobody uses it.
        let alone = segment::stat(id).is_ok_and(|s| s.attached == 1);
        if dead && alone {
            let _ = segment::remove(id);
        }
        // SAFETY: `l` is not used after this.
        unsafe { segment::detach(base) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The region's words, as a tenant who attached it sees them.
    fn words(r: &Region) -> &[AtomicU64] {
        // SAFETY: the attachment is size_of::<Layout>() bytes, a multiple of 8, aligned
        // to a page; every field is an atomic, so any word view is valid.
        unsafe { std::slice::from_raw_parts(r.base.cast::<AtomicU64>(), size_of::<Layout>() / 8) }
    }

    #[test]
    fn no_file_of_the_directory_is_needed_nor_touched() {
        let dir = tempfile::tempdir().unwrap();
        let r = Region::open(dir.path()).unwrap();
        r.init_quota(0, Some(8 << 20));
        let s = r.claim_slot().unwrap();
        assert!(r.try_charge(s, 0, 6 << 20, None));
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
        // A second process of the container attaches the same accounts.
        let r2 = Region::open(dir.path()).unwrap();
        assert!(r2.notes().is_empty(), "{:?}", r2.notes());
        assert_eq!(r2.used(0), 6 << 20);
        let s2 = r2.claim_slot().unwrap();
        assert_ne!(s, s2);
        assert!(!r2.try_charge(s2, 0, 4 << 20, None));
        assert!(r2.try_charge(s2, 0, 2 << 20, None));
        // Another directory has its own.
        let other = tempfile::tempdir().unwrap();
        assert_eq!(Region::open(other.path()).unwrap().used(0), 0);
    }

    #[test]
    fn a_damaged_header_is_reported_and_repaired_or_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let r = Region::open(dir.path()).unwrap();
        r.init_quota(0, Some(8 << 20));
        let s = r.claim_slot().unwrap();
        assert!(r.try_charge(s, 0, 6 << 20, None));
        // The tenant zeroes the header and forges the device total.
        for w in &words(&r)[..4] {
            w.store(0, Ordering::Relaxed);
        }
        r.layout().devs[0].used.store(u64::MAX, Ordering::Relaxed);
        // In use by `r`: repaired in place, the total rebuilt from the live slot.
        let r2 = Region::open(dir.path()).unwrap();
        assert_eq!(r2.notes().len(), 1, "{:?}", r2.notes());
        let note = &r2.notes()[0];
        assert!(note.contains(&dir.path().display().to_string()), "{note}");
        assert!(note.contains("bad magic number"), "{note}");
        assert_eq!(r2.used(0), 6 << 20);
        assert_eq!(r.used(0), 6 << 20, "one budget for both");
        drop(r2);
        drop(r);
        // Nobody attached: a damaged region is replaced by a fresh one.
        let r = Region::open(dir.path()).unwrap();
        for w in &words(&r)[..2] {
            w.store(7, Ordering::Relaxed);
        }
        let keep = r.shmid;
        drop(r);
        let r = Region::open(dir.path()).unwrap();
        assert_ne!(r.shmid, keep);
        assert!(
            r.notes()[0].contains("replaced by a fresh region"),
            "{:?}",
            r.notes()
        );
        assert_eq!(r.used(0), 0);
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]
        /// Whatever a tenant writes into the region, at any word, no operation of a
        /// process already attached, nor of one attaching afterwards, panics or hangs;
        /// a process that brings its own quota never charges past it.
        #[test]
        fn arbitrary_region_contents_crash_nothing(
            writes in proptest::collection::vec((0usize..(size_of::<Layout>() / 8), proptest::num::u64::ANY), 0..400),
            fill in proptest::option::of(proptest::num::u64::ANY),
        ) {
            let dir = tempfile::tempdir().unwrap();
            let r = Region::open(dir.path()).unwrap();
            let s = r.claim_slot().unwrap();
            let w = words(&r);
            if let Some(f) = fill {
                for x in w {
                    x.store(f, Ordering::Relaxed);
                }
            }
            for (i, v) in writes {
                w[i].store(v, Ordering::Relaxed);
            }
            let exercise = |r: &Region, s: usize| {
                for d in [0, MAX_DEVICES - 1, MAX_DEVICES] {
                    let before = r.slot_used(s, d);
                    let _ = r.try_charge(s, d, 4096, Some(1 << 20));
                    r.uncharge(s, d, 4096);
                    r.count_context(s, d, true);
                    r.count_context(s, d, false);
                    let _ = (r.quota(d), r.used(d), r.contexts(d), before);
                    let _ = (r.pid_used(std::process::id(), d), r.container_pid(1));
                }
                r.reap(Some(s));
            };
            exercise(&r, s);
            let r2 = Region::open(dir.path()).unwrap();
            let s2 = r2.claim_slot().unwrap();
            exercise(&r2, s2);
            // Its own quota holds whatever the region says.
            let mut n = 0u64;
            while r2.try_charge(s2, 1, 1 << 20, Some(4 << 20)) {
                n += 1;
                proptest::prop_assert!(n <= 4);
            }
            r2.release_slot(s2);
            r.release_slot(s);
        }
    }

    #[test]
    fn charges_are_all_or_nothing_under_the_quota() {
        let dir = tempfile::tempdir().unwrap();
        let r = Region::open(dir.path()).unwrap();
        assert_eq!(r.init_quota(0, Some(10 << 20)), Some(10 << 20));
        // A second process cannot raise it.
        assert_eq!(r.init_quota(0, Some(1 << 30)), Some(10 << 20));
        let s = r.claim_slot().unwrap();
        assert!(r.try_charge(s, 0, 6 << 20, None));
        assert!(!r.try_charge(s, 0, (4 << 20) + 1, None));
        assert!(r.try_charge(s, 0, 4 << 20, None));
        assert_eq!(r.used(0), 10 << 20);
        assert!(!r.try_charge(s, 0, 1, None));
        assert!(!r.try_charge(s, 0, u64::MAX, None));
        r.uncharge(s, 0, 4 << 20);
        r.uncharge(s, 0, u64::MAX);
        assert_eq!(r.used(0), 0);
        // Unlimited device: charges always fit, saturating.
        assert!(r.try_charge(s, 1, u64::MAX - 1, None));
        assert!(!r.try_charge(s, 1, 2, None));
    }

    #[test]
    fn a_tampered_region_cannot_raise_a_process_quota() {
        let dir = tempfile::tempdir().unwrap();
        let r = Region::open(dir.path()).unwrap();
        assert_eq!(r.init_quota(0, Some(8 << 20)), Some(8 << 20));
        // The tenant (who can write the file) sets the quota to unlimited, then higher.
        for forged in [0, 1 << 40] {
            r.layout().devs[0].quota.store(forged, Ordering::Release);
            let s = r.claim_slot().unwrap();
            // A process that brought an 8 MiB quota still stops at 8 MiB.
            assert!(r.try_charge(s, 0, 8 << 20, Some(8 << 20)));
            assert!(!r.try_charge(s, 0, 1, Some(8 << 20)), "forged {forged}");
            r.release_slot(s);
        }
        // A process that comes later lowers a forged quota again, never raises it.
        r.layout().devs[0].quota.store(1 << 40, Ordering::Release);
        assert_eq!(r.init_quota(0, Some(8 << 20)), Some(8 << 20));
        assert_eq!(
            r.init_quota(0, Some(4 << 20)),
            Some(4 << 20),
            "a lower quota wins"
        );
    }

    #[test]
    fn nvml_pids_map_to_the_container_pids_once_the_host_pid_is_known() {
        let dir = tempfile::tempdir().unwrap();
        let r = Region::open(dir.path()).unwrap();
        let me = std::process::id();
        let s = r.claim_slot().unwrap();
        assert!(r.try_charge(s, 0, 4096, None));
        // Same PID namespace as NVML: matched on its own PID.
        assert_eq!(r.container_pid(me), Some(me));
        assert_eq!(r.pid_used(me, 0), Some(4096));
        // In a container's PID namespace the daemon tells the host PID; NVML's host PID
        // then maps to the container's, and the container PID alone no longer matches
        // (it could be another process's host PID).
        r.set_host_pid(s, 4_000_000);
        assert_eq!(r.container_pid(4_000_000), Some(me));
        assert_eq!(r.pid_used(4_000_000, 0), Some(4096));
        assert_eq!(r.container_pid(me), None);
        assert_eq!(r.container_pid(0), None);
        r.release_slot(s);
        assert_eq!(r.container_pid(4_000_000), None);
    }

    #[test]
    fn racing_threads_never_exceed() {
        let dir = tempfile::tempdir().unwrap();
        let r = std::sync::Arc::new(Region::open(dir.path()).unwrap());
        r.init_quota(0, Some(1000));
        let s = r.claim_slot().unwrap();
        let hs: Vec<_> = (0..8)
            .map(|_| {
                let r = r.clone();
                std::thread::spawn(move || {
                    (0..1000).filter(|_| r.try_charge(s, 0, 7, None)).count()
                })
            })
            .collect();
        let n: usize = hs.into_iter().map(|h| h.join().unwrap()).sum();
        assert_eq!(n, 1000 / 7);
        assert_eq!(r.used(0), (1000 / 7) * 7);
    }

    #[test]
    fn released_slot_returns_its_charges() {
        let dir = tempfile::tempdir().unwrap();
        let r = Region::open(dir.path()).unwrap();
        let s = r.claim_slot().unwrap();
        assert!(r.try_charge(s, 2, 4096, None));
        r.count_context(s, 2, true);
        assert_eq!(
            r.container_pid(std::process::id()),
            Some(std::process::id())
        );
        r.release_slot(s);
        assert_eq!(r.used(2), 0);
        assert_eq!(r.contexts(2), 0);
        assert_eq!(r.container_pid(std::process::id()), None);
    }

    proptest::proptest! {
        /// Any interleaving of charges and uncharges from several slots keeps the
        /// container at or under its quota, equal to the sum of its slots, and never
        /// wraps; releasing every slot brings it back to zero.
        #[test]
        fn accounting_never_exceeds_or_wraps(
            quota in 1u64..(1 << 40),
            ops in proptest::collection::vec((0usize..4, proptest::bool::ANY, 0u64..(1 << 38)), 1..200),
        ) {
            let dir = tempfile::tempdir().unwrap();
            let r = Region::open(dir.path()).unwrap();
            r.init_quota(0, Some(quota));
            let slots: Vec<usize> = (0..4).map(|_| r.claim_slot().unwrap()).collect();
            let mut model = [0u64; 4];
            for (i, charge, bytes) in ops {
                let s = slots[i];
                if charge {
                    let fits = model.iter().sum::<u64>().checked_add(bytes).is_some_and(|n| n <= quota);
                    proptest::prop_assert_eq!(r.try_charge(s, 0, bytes, None), fits);
                    if fits {
                        model[i] += bytes;
                    }
                } else {
                    let b = bytes.min(model[i]);
                    r.uncharge(s, 0, b);
                    model[i] -= b;
                }
                proptest::prop_assert!(r.used(0) <= quota);
                proptest::prop_assert_eq!(r.used(0), model.iter().sum::<u64>());
                proptest::prop_assert_eq!(r.slot_used(s, 0), model[i]);
            }
            for s in slots {
                r.release_slot(s);
            }
            proptest::prop_assert_eq!(r.used(0), 0);
        }
    }
}
