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
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use vgpu_sys::slot_lock::{self, Hold};

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
    /// Bit *i*: slot *i* may be live (set once it is, cleared before it is freed), so
    /// that a reap, on every memory query, probes only those slots instead of loading
    /// all 256 (a tenant who clears bits only keeps its own dead processes charged).
    live_bits: [AtomicU64; MAX_SLOTS / 64],
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
        // A region a tenant removed (`IPC_RMID`) while processes use it keeps their
        // charges; new processes join the oldest of it and the keyed one, so that the
        // container keeps one budget (ADR 0015).
        let removed = attach_removed_in_use(id, len);
        let keyed = attach_keyed(dir, &dir_file, id, len, &mut notes);
        let describe = |shmid: libc::c_int| {
            format!(
                "accounting region of {} (SysV shared memory id {shmid})",
                dir.display()
            )
        };
        let (key, shmid, base) = match (keyed, removed) {
            (Ok(Some(k)), Some(r)) if r.0 < k.1 => {
                // SAFETY: nothing refers into the keyed attachment (not used after this).
                unsafe { segment::detach(k.2) };
                notes.push(joined_note(&describe(r.0), r.0, k.1));
                (k.0, r.0, r.1)
            }
            (Ok(Some(k)), removed) => {
                if let Some(r) = removed {
                    // SAFETY: nothing refers into this attachment (only looked at).
                    unsafe { segment::detach(r.1) };
                }
                k
            }
            (Ok(None) | Err(_), Some(r)) => {
                notes.push(joined_note(&describe(r.0), r.0, 0));
                (segment::key(id, 0), r.0, r.1)
            }
            (Err(e), None) => return Err(e),
            (Ok(None), None) => {
                return Err(io::Error::other(format!(
                    "no usable accounting region for {}: the {} shared memory keys derived from it are taken by segments of others{}",
                    dir.display(),
                    segment::PROBES,
                    if notes.is_empty() {
                        String::new()
                    } else {
                        format!(" ({})", notes.join("; "))
                    }
                )));
            }
        };
        Ok(Region {
            base: base.cast(),
            dir_file,
            dir: dir.to_owned(),
            key,
            shmid,
            notes,
        })
    }
}

/// What a process says when it joins a removed region: `keyed` is the id of the keyed
/// segment it found beside it (0: none).
fn joined_note(what: &str, removed: libc::c_int, keyed: libc::c_int) -> String {
    let users = segment::stat(removed).map_or(0, |s| s.attached.saturating_sub(1));
    format!(
        "{what}: removed (IPC_RMID) while {users} other processes of the container use it: joined it{}, so that the container keeps one budget",
        if keyed == 0 {
            String::new()
        } else {
            format!(" rather than the newer segment id {keyed} under its key")
        }
    )
}

/// The oldest segment marked for removal that processes still have attached and whose
/// header says it is the region of the directory `id`, attached read-write: (its id, where).
fn attach_removed_in_use(id: DirId, len: usize) -> Option<(libc::c_int, *mut u8)> {
    for sid in segment::removed_in_use_of_size(len) {
        // One this process may not read (its mode changed too) gets its mode back when
        // this process may give it (ADR 0042); else it is skipped: whose it is cannot
        // be told.
        let ro = segment::attach_read_only(sid).or_else(|e| match e.raw_os_error() {
            Some(libc::EACCES | libc::EPERM) => {
                segment::restore_mode(sid).and_then(|_| segment::attach_read_only(sid))
            }
            _ => Err(e),
        });
        let Ok(ro) = ro else {
            continue;
        };
        // SAFETY: a read-only attachment of `len` = size_of::<Layout>() bytes (the size
        // was checked); every field is an atomic, and only loaded here.
        let ours = matches!(verdict(unsafe { &*ro.cast::<Layout>() }, id), Verdict::Ours);
        // SAFETY: nothing refers into the read-only attachment after this.
        unsafe { segment::detach(ro) };
        if ours && let Ok(base) = segment::attach(sid) {
            return Some((sid, base));
        }
    }
    None
}

/// Attaches (creating it if absent) the segment under the directory's keys, repairing or
/// replacing a damaged one (said in `notes`): (its key, its id, where); None when every
/// key is taken by segments of others.
fn attach_keyed(
    dir: &Path,
    dir_file: &File,
    id: DirId,
    len: usize,
    notes: &mut Vec<String>,
) -> io::Result<Option<(libc::key_t, libc::c_int, *mut u8)>> {
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
            if let Some(mode) = seg.restored_from {
                notes.push(format!(
                    "{what}: its mode was {mode:03o} (changed with shmctl IPC_SET), which would have kept this process out of the container's budget: mode 0666 restored"
                ));
            }
            let alive = |i: usize| slot_lock::owner_alive(dir_file, i);
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
            return Ok(Some((key, seg.id, seg.base)));
        }
    }
    Ok(None)
}

impl Region {
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

    /// Whether another open file description holds a lock on byte `i` of the container
    /// directory (the owner of slot `i` holds a read lock there). When in doubt, alive:
    /// never reclaim a live process's memory.
    fn owner_alive(&self, i: usize) -> bool {
        slot_lock::owner_alive(&self.dir_file, i)
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
                if slot_lock::hold(&self.dir_file, i, Hold::Read).is_err() {
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
                self.mark_live(i, true);
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
            let _ = slot_lock::release(&self.dir_file, i);
        }
    }

    /// Reclaims the slots of dead processes (`own`, whose lock we hold, is skipped).
    /// Returns how many were reclaimed.
    pub fn reap(&self, own: Option<usize>) -> usize {
        let mut n = 0;
        let l = self.layout();
        let candidates = l.header.live_bits.iter().enumerate().flat_map(|(w, bits)| {
            let mut b = bits.load(Ordering::Acquire);
            std::iter::from_fn(move || {
                (b != 0).then(|| {
                    let i = b.trailing_zeros() as usize;
                    b &= b - 1;
                    w * 64 + i
                })
            })
        });
        for i in candidates {
            let Some(s) = l.slots.get(i) else { continue };
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

    /// Sets or clears slot `i`'s bit in the live set.
    fn mark_live(&self, i: usize, live: bool) {
        if let Some(w) = self.layout().header.live_bits.get(i / 64) {
            let bit = 1u64 << (i % 64);
            if live {
                w.fetch_or(bit, Ordering::AcqRel);
            } else {
                w.fetch_and(!bit, Ordering::AcqRel);
            }
        }
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
        self.mark_live(i, false);
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
    for (w, bits) in l.header.live_bits.iter().enumerate() {
        let mut v = 0u64;
        for (b, s) in l.slots.iter().skip(w * 64).take(64).enumerate() {
            if s.state.load(Ordering::Acquire) == SLOT_LIVE {
                v |= 1 << b;
            }
        }
        bits.store(v, Ordering::Release);
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
#[path = "region_tests.rs"]
mod tests;
