//! This process's enforcement state: its configuration, the container's region and this
//! process's slot in it, the allocations it made (to uncharge them when freed), and the
//! failure policy, with [`enforcing`] and [`enforced`], the one place that decides what
//! a hook does when the shim cannot enforce. Nothing here holds a lock across a call
//! into the real driver.

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::Instant;

use crate::config::{Config, MAX_DEVICES, OnError};
use crate::pools::Pools;
use crate::region::Region;

/// What kind of handle an allocation is known by (separate namespaces).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    /// A device pointer (`cuMemAlloc*`, pitch, managed, stream-ordered).
    Ptr,
    /// A VMM allocation handle (`cuMemCreate`).
    Vmm,
    /// A `CUarray`.
    Array,
    /// A `CUmipmappedArray`.
    Mipmap,
}

/// One charged allocation.
#[derive(Debug, Clone, Copy)]
pub struct Charge {
    /// Device ordinal.
    pub dev: usize,
    /// Bytes charged.
    pub bytes: u64,
    /// The context it belongs to (freed with it), 0 if not tied to one.
    pub ctx: usize,
    /// The memory pool it came from (its charge becomes the pool's credit when freed),
    /// 0 if none.
    pub pool: u64,
}

/// The enforcing state.
#[derive(Debug)]
pub struct Shim {
    /// The configuration.
    pub cfg: Config,
    /// The container's accounting region.
    pub region: Region,
    /// This process's slot in it.
    pub slot: usize,
    allocs: Mutex<HashMap<(Kind, u64), Charge>>,
    granularity: [AtomicU64; MAX_DEVICES],
    /// Primary context retain count per device (this process).
    pub primary_refs: [AtomicU32; MAX_DEVICES],
    /// Primary context handle per device.
    pub primary_ctx: [AtomicUsize; MAX_DEVICES],
    /// Device of each non-primary context this process created.
    pub ctx_dev: Mutex<HashMap<usize, usize>>,
    /// The memory pools this process allocates from (bookkeeping only; never held
    /// across a driver call).
    pools: Mutex<Pools>,
    /// The charged VMM handles and their mappings (bookkeeping only; never held across
    /// a driver call).
    vmm: Mutex<crate::vmm::Vmm>,
    /// Whether this process has used a memory pool at all (spares the lock otherwise).
    pools_used: AtomicBool,
    /// Set when a pool may have gained credit since the last reconciliation of all
    /// pools (spares the lock and the driver queries otherwise).
    pool_credit: AtomicBool,
    /// Allocations refused over the quota (reported to the daemon with the usage).
    pub refusals: crate::refusals::Refusals,
}

/// How hooks behave.
#[derive(Debug, Clone, Copy)]
pub enum Mode {
    /// Enforce the quota.
    Enforce(&'static Shim),
    /// Pass everything through (`VGPU_ON_ERROR=unenforced` after an error).
    Unenforced,
    /// Refuse (`VGPU_ON_ERROR=fail` after an error).
    Fail,
}

static MODE: OnceLock<Result<Shim, (OnError, String)>> = OnceLock::new();

/// The failure policy before the configuration is known: the environment's, except in a
/// container with a fixed quota file (ADR 0042), where a tenant's `unenforced` plus a bad
/// value would otherwise let the process run unlimited.
fn early_on_error(held: bool) -> OnError {
    match std::env::var("VGPU_ON_ERROR").as_deref() {
        Ok("unenforced") if !held => OnError::Unenforced,
        _ => OnError::Fail,
    }
}

/// Whether the container's fixed quota file exists (ADR 0042): anything at the path
/// counts, so that an unreadable or odd one is a loud error, not the environment's rule.
fn fixed_quota_file_exists() -> bool {
    std::fs::symlink_metadata(vgpu_core::container_quota::FIXED_QUOTA_FILE).is_ok()
}

/// Whether directories `a` and `b` are the same directory (device and inode).
fn same_dir(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(x), Ok(y)) => x.dev() == y.dev() && x.ino() == y.ino(),
        _ => false,
    }
}

/// The environment's configuration, held to the container where its fixed quota file
/// exists (ADR 0042), and the text of the container's quota file (None without one).
/// `quiet`: what the hold overrides is not said (the load-time publication of the quota,
/// [`crate::quota_env`], runs in every process; the configuration says it once enforcing).
pub(crate) fn environment_and_quota_file(
    quiet: bool,
) -> Result<(Config, Option<String>), (OnError, String)> {
    let held = fixed_quota_file_exists();
    let mut cfg = Config::from_env().map_err(|e| (early_on_error(held), e.to_string()))?;
    if held {
        let fixed = Path::new(vgpu_core::container_quota::FIXED_DIR);
        let same = same_dir(&cfg.container_dir, fixed);
        // Said whatever VGPU_LOG says: a process held to a quota it did not ask for
        // must not find out from a refused allocation alone.
        let notes = cfg.hold_to_container(fixed, same);
        if !quiet {
            for n in notes {
                crate::say!("vgpu: WARNING: {n}");
            }
        }
    }
    let path = cfg.quota_file();
    match read_regular_file(&path) {
        Ok(t) => Ok((cfg, Some(t))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok((cfg, None)),
        Err(e) => Err((
            cfg.on_error,
            format!("cannot read the quota file {}: {e}", path.display()),
        )),
    }
}

/// The text of `path` if it is a regular file. Opened without blocking and refused
/// otherwise: a FIFO or device put where the quota file belongs (the container directory
/// of a bare run is the tenant's) must not hang every process the shim is loaded into.
fn read_regular_file(path: &Path) -> std::io::Result<String> {
    use std::io::Read as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)?;
    if !f.metadata()?.is_file() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a regular file",
        ));
    }
    let mut text = String::new();
    f.read_to_string(&mut text)?;
    Ok(text)
}

/// The configuration: the environment, held to the container where its fixed quota file
/// exists (ADR 0042), then the quota file if the container has one. Runs outside any
/// lock: with a quota file it calls the real driver (to map the file's GPU UUIDs to CUDA
/// ordinals).
fn configure() -> Result<Config, (OnError, String)> {
    let (mut cfg, text) = environment_and_quota_file(false)?;
    let Some(text) = text else {
        return Ok(cfg);
    };
    let path = cfg.quota_file();
    // Only the container's GPUs are shown to the driver (ADR 0014), before it starts.
    crate::devices::restrict_driver(&text);
    let uuids = crate::driver::device_uuids().map_err(|e| {
        (
            cfg.on_error,
            format!(
                "quota file {}: cannot map its GPUs to devices: {e}",
                path.display()
            ),
        )
    })?;
    let uuids = crate::devices::driver_view(&uuids);
    let notes = cfg
        .apply_quota_file(&path, &text, &uuids)
        .map_err(|e| (cfg.on_error, e))?;
    for n in notes {
        if cfg.held {
            crate::say!("vgpu: WARNING: {n}");
        } else if cfg.log {
            crate::say!("vgpu: {n}");
        }
    }
    Ok(cfg)
}

fn init(cfg: Result<Config, (OnError, String)>) -> Result<Shim, (OnError, String)> {
    let cfg = cfg?;
    let region = Region::open(&cfg.container_dir).map_err(|e| {
        (
            cfg.on_error,
            format!("cannot open the container's accounting region: {e}"),
        )
    })?;
    // A damaged region is rare and matters (a tenant tampered with it): said whatever
    // VGPU_LOG says, once per process.
    for n in region.notes() {
        crate::say!("vgpu: WARNING: {n}");
    }
    for d in 0..MAX_DEVICES {
        // A quota of 0 (a device the quota file does not list) is this process's to
        // enforce: in the region 0 means unlimited.
        let want = cfg.limit(d).filter(|&q| q > 0);
        let q = region.init_quota(cfg.region_dev(d), want);
        if want.is_some() && q != want && cfg.log {
            crate::say!(
                "vgpu: device {d}: the container's quota is {q:?} bytes (lowered by another of its processes), not {:?}",
                cfg.limit(d)
            );
        }
    }
    let slot = region
        .claim_slot()
        .map_err(|e| (cfg.on_error, e.to_string()))?;
    Ok(Shim {
        cfg,
        region,
        slot,
        allocs: Mutex::new(HashMap::new()),
        granularity: std::array::from_fn(|_| AtomicU64::new(0)),
        primary_refs: std::array::from_fn(|_| AtomicU32::new(0)),
        primary_ctx: std::array::from_fn(|_| AtomicUsize::new(0)),
        ctx_dev: Mutex::new(HashMap::new()),
        pools: Mutex::new(Pools::default()),
        vmm: Mutex::new(crate::vmm::Vmm::default()),
        pools_used: AtomicBool::new(false),
        pool_credit: AtomicBool::new(false),
        refusals: crate::refusals::Refusals::default(),
    })
}

/// The mode, initialising on first use. An error is reported on stderr once, loudly,
/// whatever `VGPU_LOG` says.
pub fn mode() -> Mode {
    let m = match MODE.get() {
        Some(m) => m,
        None => {
            // The driver queries of `configure` run before, not inside, the once-lock.
            let cfg = configure();
            init_mode(cfg)
        }
    };
    match m {
        Ok(s) => Mode::Enforce(s),
        Err((OnError::Unenforced, _)) => Mode::Unenforced,
        Err((OnError::Fail, _)) => Mode::Fail,
    }
}

/// Runs `body` with the enforcing state and the real call `call`; without one, runs
/// `call` alone (`VGPU_ON_ERROR=unenforced` after an error) or returns `refused`
/// (`VGPU_ON_ERROR=fail`). Initialises on first use, like [`mode`].
pub fn enforcing<R, F: FnOnce() -> R>(
    refused: R,
    call: F,
    body: impl FnOnce(&'static Shim, F) -> R,
) -> R {
    match mode() {
        Mode::Enforce(shim) => body(shim, call),
        Mode::Unenforced => call(),
        Mode::Fail => refused,
    }
}

/// The enforcing state (None: the shim does not enforce, and the caller lets the call
/// through as it is).
pub fn enforced() -> Option<&'static Shim> {
    match mode() {
        Mode::Enforce(shim) => Some(shim),
        Mode::Unenforced | Mode::Fail => None,
    }
}

impl Mode {
    /// Whether everything passes through untouched (`VGPU_ON_ERROR=unenforced` after an
    /// error).
    pub fn passes_through(self) -> bool {
        matches!(self, Mode::Unenforced)
    }
}

fn init_mode(cfg: Result<Config, (OnError, String)>) -> &'static Result<Shim, (OnError, String)> {
    MODE.get_or_init(|| {
        let r = init(cfg);
        if let Err((policy, msg)) = &r {
            let what = match policy {
                OnError::Fail => "CUDA initialisation fails (VGPU_ON_ERROR=fail)",
                OnError::Unenforced => {
                    "running WITHOUT GPU memory isolation (VGPU_ON_ERROR=unenforced)"
                }
            };
            crate::say!("vgpu: ERROR: cannot enforce GPU memory limits: {msg}; {what}");
        }
        r
    })
}

/// Rate-limited log line to stderr when `VGPU_LOG` is on (at most 20 per second).
pub fn log(shim: &Shim, msg: impl FnOnce() -> String) {
    if !shim.cfg.log {
        return;
    }
    static WINDOW: AtomicU64 = AtomicU64::new(0);
    static COUNT: AtomicU64 = AtomicU64::new(0);
    static START: OnceLock<Instant> = OnceLock::new();
    let sec = START.get_or_init(Instant::now).elapsed().as_secs();
    if WINDOW.swap(sec, Ordering::Relaxed) != sec {
        COUNT.store(0, Ordering::Relaxed);
    }
    if COUNT.fetch_add(1, Ordering::Relaxed) < 20 {
        crate::say!("vgpu[{}]: {}", std::process::id(), msg());
    }
}

/// Rounds `bytes` up to a multiple of `gran` (saturating).
pub fn round_up(bytes: u64, gran: u64) -> u64 {
    if gran <= 1 {
        return bytes;
    }
    match bytes % gran {
        0 => bytes,
        r => bytes.saturating_add(gran - r),
    }
}

impl Shim {
    fn allocs(&self) -> MutexGuard<'_, HashMap<(Kind, u64), Charge>> {
        self.allocs.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The cached allocation granularity of `dev` (0 = unknown yet).
    pub fn granularity(&self, dev: usize) -> u64 {
        self.granularity
            .get(dev)
            .map_or(0, |g| g.load(Ordering::Relaxed))
    }

    /// Caches the allocation granularity of `dev`.
    pub fn set_granularity(&self, dev: usize, g: u64) {
        if let Some(a) = self.granularity.get(dev) {
            a.store(g, Ordering::Relaxed);
        }
    }

    /// Reserves `bytes` on `dev`: all or nothing, never over the quota. Reaps dead
    /// processes of the container before declaring out-of-memory.
    pub fn reserve(&self, dev: usize, bytes: u64) -> bool {
        self.reserve_or(dev, bytes, || false)
    }

    /// Like [`Shim::reserve`], and before declaring out-of-memory also runs `reclaim`
    /// (which gives back what this process's pools no longer hold, and says whether it
    /// gave anything back).
    pub fn reserve_or(&self, dev: usize, bytes: u64, reclaim: impl FnOnce() -> bool) -> bool {
        let rd = self.rdev(dev);
        if self.denied(dev) {
            self.refusals.record(
                dev,
                vgpu_core::sched_proto::MemoryRefusal {
                    asked: bytes,
                    used: self.region.used(rd),
                    quota: 0,
                },
            );
            log(self, || {
                format!(
                    "device {dev}: {bytes} bytes refused: the container's quota file does not list this GPU (quota 0)"
                )
            });
            return false;
        }
        let cap = self.cfg.limit(dev).filter(|&q| q > 0);
        if self.region.try_charge(self.slot, rd, bytes, cap) {
            return true;
        }
        if self.region.reap(Some(self.slot)) > 0
            && self.region.try_charge(self.slot, rd, bytes, cap)
        {
            return true;
        }
        if reclaim() && self.region.try_charge(self.slot, rd, bytes, cap) {
            return true;
        }
        self.refusals.record(
            dev,
            vgpu_core::sched_proto::MemoryRefusal {
                asked: bytes,
                used: self.region.used(rd),
                quota: self.region.quota(rd).or(cap).unwrap_or(0),
            },
        );
        log(self, || {
            let quota = self
                .region
                .quota(rd)
                .map_or_else(|| "no quota".to_owned(), |q| format!("a quota of {q}"));
            format!(
                "device {dev}: {bytes} bytes refused (out of memory): the container uses {} bytes of {quota}",
                self.region.used(rd)
            )
        });
        false
    }

    /// Gives back a reservation.
    pub fn unreserve(&self, dev: usize, bytes: u64) {
        self.region.uncharge(self.slot, self.rdev(dev), bytes);
    }

    /// Records a charged allocation.
    pub fn track(&self, kind: Kind, key: u64, c: Charge) {
        if let Some(old) = self.allocs().insert((kind, key), c) {
            // The driver reused a handle we thought live: its old charge is gone.
            self.release(old, true);
        }
    }

    /// Takes the record of an allocation about to be freed.
    pub fn untrack(&self, kind: Kind, key: u64) -> Option<Charge> {
        self.allocs().remove(&(kind, key))
    }

    /// Puts a record back (the free failed).
    pub fn retrack(&self, kind: Kind, key: u64, c: Charge) {
        self.allocs().insert((kind, key), c);
    }

    /// Gives back the charge of a freed allocation: at once, or, for an allocation from
    /// a memory pool, into the pool's credit (the pool may keep the memory).
    /// `synchronous`: freed at once (not stream-ordered).
    pub fn release(&self, c: Charge, synchronous: bool) {
        if c.pool == 0 {
            self.unreserve(c.dev, c.bytes);
        } else {
            let (dev, back) = self.pools().freed(c.pool, c.bytes, synchronous);
            self.mark_credit();
            self.unreserve(dev, back);
        }
    }

    /// Uncharges everything that belonged to context `ctx` (destroyed with it); returns
    /// the pools whose allocations went back to them (to reconcile).
    pub fn drop_context_allocs(&self, ctx: usize) -> Vec<u64> {
        if ctx == 0 {
            return Vec::new();
        }
        let gone: Vec<Charge> = {
            let mut m = self.allocs();
            let keys: Vec<_> = m
                .iter()
                .filter(|(_, c)| c.ctx == ctx)
                .map(|(k, _)| *k)
                .collect();
            keys.iter().filter_map(|k| m.remove(k)).collect()
        };
        let mut pools = Vec::new();
        for c in gone {
            if c.pool != 0 && !pools.contains(&c.pool) {
                pools.push(c.pool);
            }
            self.release(c, true);
        }
        pools
    }

    /// The pools' bookkeeping (a short in-process lock; never held across a driver
    /// call).
    pub fn pools(&self) -> MutexGuard<'_, Pools> {
        self.pools_used.store(true, Ordering::Relaxed);
        self.pools.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The VMM handles' bookkeeping (a short in-process lock; never held across a
    /// driver call).
    pub fn vmm(&self) -> MutexGuard<'_, crate::vmm::Vmm> {
        self.vmm.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether this process has used a memory pool at all.
    pub fn pools_used(&self) -> bool {
        self.pools_used.load(Ordering::Relaxed)
    }

    /// Notes that a pool may hold credit (after the change is in the bookkeeping).
    pub fn mark_credit(&self) {
        self.pool_credit.store(true, Ordering::Release);
    }

    /// Takes the note of [`Shim::mark_credit`]: whether a pool may hold credit. A
    /// caller that leaves credit in place marks it again.
    pub fn take_credit_mark(&self) -> bool {
        self.pool_credit.swap(false, Ordering::AcqRel)
    }

    /// Where CUDA ordinal `dev` of this process keeps its quota and usage in the
    /// container's region: the container's device, the same in all its processes
    /// whatever their `CUDA_VISIBLE_DEVICES` ([`crate::config::region_indices`]).
    pub fn rdev(&self, dev: usize) -> usize {
        self.cfg.region_dev(dev)
    }

    /// Whether nothing may be allocated on `dev` (a quota file that does not list it).
    pub fn denied(&self, dev: usize) -> bool {
        self.cfg.limit(dev) == Some(0)
    }

    /// The quota of `dev` in force (None: unlimited): the container's, capped by this
    /// process's own (the region file is writable by the tenant).
    pub fn quota(&self, dev: usize) -> Option<u64> {
        if self.denied(dev) {
            return Some(0);
        }
        match (
            self.region.quota(self.rdev(dev)),
            self.cfg.limit(dev).filter(|&q| q > 0),
        ) {
            (Some(r), Some(own)) => Some(r.min(own)),
            (r, own) => r.or(own),
        }
    }

    /// The container's usage of `dev`, after reaping dead processes: a process never
    /// sees the charges of one that has exited (one liveness probe per live slot; a
    /// reap rate-limited across the container showed the next process a dead one's
    /// memory, issue 11 item 4).
    pub fn used(&self, dev: usize) -> u64 {
        self.region.reap(Some(self.slot));
        self.region.used(self.rdev(dev))
    }
}

/// The memory view of a device under a quota: `(free, total)` from the real ones.
pub fn virtual_meminfo(quota: u64, used: u64, real_free: u64, real_total: u64) -> (u64, u64) {
    let total = quota.min(real_total);
    let free = total.saturating_sub(used).min(real_free);
    (free, total)
}

/// Bytes of a (mipmapped) array as the driver lays it out: the sum of its levels.
pub fn array_bytes(width: u64, height: u64, depth: u64, elem: u64, levels: u32) -> Option<u64> {
    let mut total = 0u64;
    for l in 0..levels.max(1) {
        let w = (width >> l).max(1);
        let h = if height == 0 { 1 } else { (height >> l).max(1) };
        let d = if depth == 0 { 1 } else { (depth >> l).max(1) };
        total = total.checked_add(w.checked_mul(elem)?.checked_mul(h)?.checked_mul(d)?)?;
    }
    Some(total)
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_fifo_in_place_of_the_quota_file_is_refused_without_blocking() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let fifo = dir.path().join("vgpu.conf");
        let c = std::ffi::CString::new(fifo.to_string_lossy().as_bytes()).expect("no NUL");
        // SAFETY: a NUL-terminated path; mkfifo only creates the node.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let e = read_regular_file(&fifo).expect_err("a FIFO is not a quota file");
        assert!(e.to_string().contains("not a regular file"), "{e}");
        let file = dir.path().join("f");
        std::fs::write(&file, "{}").expect("write");
        assert_eq!(read_regular_file(&file).expect("a regular file"), "{}");
    }

    use super::*;

    #[test]
    fn rounding_and_views_never_wrap() {
        assert_eq!(round_up(1, 2 << 20), 2 << 20);
        assert_eq!(round_up(2 << 20, 2 << 20), 2 << 20);
        assert_eq!(round_up(u64::MAX, 2 << 20), u64::MAX);
        assert_eq!(round_up(7, 0), 7);
        assert_eq!(
            virtual_meminfo(256 << 20, 0, 80 << 30, 80 << 30),
            (256 << 20, 256 << 20)
        );
        assert_eq!(
            virtual_meminfo(256 << 20, 300 << 20, 1 << 30, 80 << 30),
            (0, 256 << 20)
        );
        assert_eq!(virtual_meminfo(1 << 30, 0, 100, 80 << 30), (100, 1 << 30));
        assert_eq!(
            virtual_meminfo(1 << 40, 0, 1 << 30, 8 << 30),
            (1 << 30, 8 << 30)
        );
    }

    #[test]
    fn array_sizes() {
        assert_eq!(array_bytes(1024, 0, 0, 4, 0), Some(4096));
        assert_eq!(array_bytes(16, 16, 0, 1, 1), Some(256));
        // 3 levels: 16x16 + 8x8 + 4x4 bytes.
        assert_eq!(array_bytes(16, 16, 0, 1, 3), Some(256 + 64 + 16));
        assert_eq!(array_bytes(u64::MAX, 2, 0, 4, 0), None);
    }
}
