//! The shim's process state and its safe logic: configuration, the container's region,
//! this process's slot, the allocations it made (to uncharge them when freed), and the
//! failure policy. Nothing here holds a lock across a call into the real driver.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::Instant;

use crate::config::{Config, MAX_DEVICES, OnError};
use crate::region::Region;
use crate::table::Lib;

/// Minimum interval between reaps triggered by memory queries.
const REAP_INTERVAL_NS: u64 = 10_000_000;

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

fn early_on_error() -> OnError {
    match std::env::var("VGPU_ON_ERROR").as_deref() {
        Ok("unenforced") => OnError::Unenforced,
        _ => OnError::Fail,
    }
}

fn init() -> Result<Shim, (OnError, String)> {
    let cfg = Config::from_env().map_err(|e| (early_on_error(), e.to_string()))?;
    let region = Region::open(&cfg.container_dir).map_err(|e| {
        (
            cfg.on_error,
            format!("cannot open the container's accounting region: {e}"),
        )
    })?;
    for d in 0..MAX_DEVICES {
        let q = region.init_quota(d, cfg.limit(d));
        if cfg.limit(d).is_some() && q != cfg.limit(d) && cfg.log {
            eprintln!(
                "vgpu: device {d}: the container's quota is {q:?} bytes (set by its first process), not {:?}",
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
    })
}

/// The mode, initialising on first use. An error is reported on stderr once, loudly,
/// whatever `VGPU_LOG` says.
pub fn mode() -> Mode {
    let m = MODE.get_or_init(|| {
        let r = init();
        if let Err((policy, msg)) = &r {
            let what = match policy {
                OnError::Fail => "CUDA initialisation fails (VGPU_ON_ERROR=fail)",
                OnError::Unenforced => {
                    "running WITHOUT GPU memory isolation (VGPU_ON_ERROR=unenforced)"
                }
            };
            eprintln!("vgpu: ERROR: cannot enforce GPU memory limits: {msg}; {what}");
        }
        r
    });
    match m {
        Ok(s) => Mode::Enforce(s),
        Err((OnError::Unenforced, _)) => Mode::Unenforced,
        Err((OnError::Fail, _)) => Mode::Fail,
    }
}

/// The real library name to load for `lib` (configuration, else the default).
pub fn lib_name(lib: Lib) -> String {
    let (var, default) = match lib {
        Lib::Cuda => ("VGPU_REAL_LIBCUDA", "libcuda.so.1"),
        Lib::Nvml => ("VGPU_REAL_LIBNVML", "libnvidia-ml.so.1"),
    };
    match std::env::var(var) {
        Ok(v) if !v.is_empty() => v,
        _ => default.to_owned(),
    }
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
        eprintln!("vgpu[{}]: {}", std::process::id(), msg());
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
        if self.region.try_charge(self.slot, dev, bytes) {
            return true;
        }
        if self.region.reap(Some(self.slot)) > 0 && self.region.try_charge(self.slot, dev, bytes) {
            return true;
        }
        log(self, || {
            let quota = self
                .region
                .quota(dev)
                .map_or_else(|| "no quota".to_owned(), |q| format!("a quota of {q}"));
            format!(
                "device {dev}: {bytes} bytes refused (out of memory): the container uses {} bytes of {quota}",
                self.region.used(dev)
            )
        });
        false
    }

    /// Gives back a reservation.
    pub fn unreserve(&self, dev: usize, bytes: u64) {
        self.region.uncharge(self.slot, dev, bytes);
    }

    /// Records a charged allocation.
    pub fn track(&self, kind: Kind, key: u64, c: Charge) {
        if let Some(old) = self.allocs().insert((kind, key), c) {
            // The driver reused a handle we thought live: its old charge is gone.
            self.unreserve(old.dev, old.bytes);
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

    /// Uncharges everything that belonged to context `ctx` (destroyed with it).
    pub fn drop_context_allocs(&self, ctx: usize) {
        if ctx == 0 {
            return;
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
        for c in gone {
            self.unreserve(c.dev, c.bytes);
        }
    }

    /// The quota of `dev` in force (None: unlimited).
    pub fn quota(&self, dev: usize) -> Option<u64> {
        self.region.quota(dev)
    }

    /// The container's usage of `dev`, after reaping dead processes if due.
    pub fn used(&self, dev: usize) -> u64 {
        self.region.reap_if_due(Some(self.slot), REAP_INTERVAL_NS);
        self.region.used(dev)
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
