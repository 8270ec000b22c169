//! The container's shared accounting region: one memory-mapped file of atomics in
//! `VGPU_CONTAINER_DIR`, mapped by every process of the container (ADR 0008, after the
//! simulator's ADR 0002).
//!
//! - Per device: the quota and the bytes charged. A charge is one compare-and-swap that
//!   either fits entirely under the quota or charges nothing, so racing processes can
//!   never exceed the quota by a byte; arithmetic saturates and never wraps.
//! - Per process: a slot with its own charges. Liveness comes from the kernel: the owner
//!   of slot *i* holds an open-file-description lock on byte *i* of `slots.lock`, which
//!   the kernel drops when the process dies (SIGKILL included). Whoever needs the truth
//!   (before declaring out-of-memory, when reporting memory, at most every 10 ms) reaps
//!   dead slots: a CAS from LIVE to REAPING makes that exactly-once.
//! - No cross-process lock exists, so a process killed at any instruction cannot wedge
//!   the others.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use crate::config::MAX_DEVICES;

const MAGIC: u64 = 0x4d49_4853_5550_4756; // "VGPUSHIM", little-endian
/// Layout version; part of the file name, so different layouts never map each other.
pub const LAYOUT_VERSION: u32 = 2;
/// Process slots per container.
pub const MAX_SLOTS: usize = 256;

const SLOT_FREE: u32 = 0;
const SLOT_CLAIMING: u32 = 1;
const SLOT_LIVE: u32 = 2;
const SLOT_REAPING: u32 = 3;

#[repr(C)]
struct Header {
    magic: u64,
    layout_version: u32,
    _pad: u32,
    size: u64,
    last_reap_ns: AtomicU64,
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

/// A mapped accounting region.
#[derive(Debug)]
pub struct Region {
    base: *mut Layout,
    lock_file: File,
    path: PathBuf,
}

// SAFETY: the mapping is shared memory whose every mutable field is an atomic; the
// pointer stays valid for the life of `Region` (unmapped only in Drop).
unsafe impl Send for Region {}
// SAFETY: as above, all access through `&Layout` is to atomics or immutable fields.
unsafe impl Sync for Region {}

/// CLOCK_MONOTONIC in ns: one clock for every process of the machine (never 0).
fn mono_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    u64::try_from(ts.tv_sec)
        .unwrap_or(0)
        .saturating_mul(1_000_000_000)
        .saturating_add(u64::try_from(ts.tv_nsec).unwrap_or(0))
        .max(1)
}

fn map(file: &File, len: usize) -> io::Result<*mut Layout> {
    // SAFETY: mapping `len` bytes of an open file that is at least `len` long, shared,
    // read-write; the result is checked against MAP_FAILED.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(p.cast())
}

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
    /// Opens (creating it if absent) the region in `dir`.
    pub fn open(dir: &Path) -> io::Result<Region> {
        if !dir.exists() {
            std::fs::create_dir_all(dir).map_err(ctx_err("create container directory", dir))?;
            // Every user of the container shares one budget.
            let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o1777));
        }
        let path = dir.join(format!("shim-v{LAYOUT_VERSION}.bin"));
        let len = size_of::<Layout>();
        let file = match OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(&path)
        {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => Self::create(dir, &path, len)?,
            Err(e) => return Err(ctx_err("open accounting region", &path)(e)),
        };
        let flen = file.metadata().map_err(ctx_err("stat", &path))?.len();
        if flen != len as u64 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{} has {flen} bytes, expected {len}", path.display()),
            ));
        }
        let base = map(&file, len).map_err(ctx_err("map accounting region", &path))?;
        let lock_path = dir.join("slots.lock");
        let lock_file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o666)
            .custom_flags(libc::O_CLOEXEC)
            .open(&lock_path)
            .map_err(ctx_err("open slot lock file", &lock_path))?;
        let _ = lock_file.set_permissions(std::fs::Permissions::from_mode(0o666));
        let r = Region {
            base,
            lock_file,
            path: path.clone(),
        };
        let h = &r.layout().header;
        if h.magic != MAGIC || h.layout_version != LAYOUT_VERSION || h.size != len as u64 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{} is not a vgpu accounting region", path.display()),
            ));
        }
        Ok(r)
    }

    fn create(dir: &Path, path: &Path, len: usize) -> io::Result<File> {
        // Build the file under a private name, then link it into place: a racing process
        // sees either no region or a complete one.
        let tmp = dir.join(format!(
            ".shim-v{LAYOUT_VERSION}.{}.tmp",
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
            .map_err(ctx_err("create accounting region", &tmp))?;
        let _ = file.set_permissions(std::fs::Permissions::from_mode(0o666));
        file.set_len(len as u64).map_err(ctx_err("size", &tmp))?;
        let base = map(&file, len).map_err(ctx_err("map", &tmp))?;
        // SAFETY: `base` is a fresh zero-filled writable mapping of `len` =
        // size_of::<Layout>() bytes that nobody else can see yet; all-zero is a valid
        // bit pattern for every field (integers and atomics).
        let layout = unsafe { &mut *base };
        layout.header.magic = MAGIC;
        layout.header.layout_version = LAYOUT_VERSION;
        layout.header.size = len as u64;
        // SAFETY: unmapping the mapping created above; `layout` is not used afterwards.
        unsafe { libc::munmap(base.cast(), len) };
        let ctmp = std::ffi::CString::new(tmp.as_os_str().as_encoded_bytes())
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        let cpath = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        // SAFETY: both are valid NUL-terminated paths.
        let rc = unsafe { libc::link(ctmp.as_ptr(), cpath.as_ptr()) };
        let err = io::Error::last_os_error();
        let _ = std::fs::remove_file(&tmp);
        if rc != 0 && err.kind() != io::ErrorKind::AlreadyExists {
            return Err(ctx_err("publish accounting region", path)(err));
        }
        OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(path)
            .map_err(ctx_err("open accounting region", path))
    }

    fn layout(&self) -> &Layout {
        // SAFETY: `base` maps size_of::<Layout>() bytes for as long as `self` lives and
        // all mutation goes through atomics.
        unsafe { &*self.base }
    }

    /// The region's file.
    pub fn path(&self) -> &Path {
        &self.path
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
        // SAFETY: flock is plain old data; all-zero is valid.
        let mut fl: libc::flock = unsafe { std::mem::zeroed() };
        fl.l_type = ty as libc::c_short;
        fl.l_whence = libc::SEEK_SET as libc::c_short;
        fl.l_start = libc::off_t::try_from(slot).unwrap_or(libc::off_t::MAX);
        fl.l_len = 1;
        // SAFETY: the fd is open for the life of `self`; `fl` is a valid flock.
        let rc = unsafe { libc::fcntl(self.lock_file.as_raw_fd(), cmd, &mut fl) };
        if rc == 0 {
            Ok(fl)
        } else {
            Err(io::Error::last_os_error())
        }
    }

    fn owner_alive(&self, i: usize) -> bool {
        match self.ofd_lock(i, libc::F_OFD_GETLK, libc::F_WRLCK) {
            Ok(fl) => fl.l_type != libc::F_UNLCK as libc::c_short,
            // When in doubt, alive: never reclaim a live process's memory.
            Err(_) => true,
        }
    }

    /// Claims a slot for this process until it dies (or [`Region::release_slot`]).
    pub fn claim_slot(&self) -> io::Result<usize> {
        for attempt in 0..2 {
            for (i, s) in self.layout().slots.iter().enumerate() {
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
                if self.ofd_lock(i, libc::F_OFD_SETLK, libc::F_WRLCK).is_err() {
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
            self.path.display()
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
        self.layout()
            .header
            .last_reap_ns
            .store(mono_ns(), Ordering::Relaxed);
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
        // SAFETY: unmapping our own mapping of size_of::<Layout>() bytes; no reference
        // into it outlives `self`.
        unsafe { libc::munmap(self.base.cast(), size_of::<Layout>()) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
