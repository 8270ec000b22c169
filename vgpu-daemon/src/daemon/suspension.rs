//! Suspending and resuming containers (issue 43, ADRs 0066 and 0070): a container's
//! processes are moved off the GPU with the driver's checkpoint API
//! ([`crate::checkpoint`]) and back. All or none: lock every process, then checkpoint
//! each; on any failure the checkpointed ones are restored and every locked one
//! unlocked ([`suspend_all`], a pure sequence over the [`Checkpoints`] seam).
//!
//! While a container is suspended its memory stays in the books: its quota is still its
//! own (no neighbour's quota grows), and the bytes it had are shown as suspended bytes;
//! they are held in host memory, bounded node-wide by `--suspend-host-memory`
//! ([`fits_host`]). The tenant's board says it is suspended ([`vgpu_core::suspension`]):
//! its shims, before their next CUDA call, ask the daemon to resume it
//! ([`Daemon::resume_pid`]) and wait.
//!
//! One operation at a time per container (a per-key mutex, held across the driver's
//! calls); the books have their own short lock, so snapshots never wait for a copy.

use std::collections::{BTreeMap, HashMap};
use std::ffi::OsString;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use tracing::{info, warn};
use vgpu_cuda_abi::cuda::{
    CUDA_ERROR_ILLEGAL_STATE, CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_READY,
    CUDA_ERROR_NOT_SUPPORTED, CUDA_ERROR_OUT_OF_MEMORY,
};

use super::Daemon;
use crate::board::Board;
use crate::checkpoint::{Code, Driver, DriverError, ProcessState};

/// The suspension settings (`--cuda-lib`, `--suspend-host-memory`, ...).
#[derive(Debug, Clone)]
pub struct Settings {
    /// The CUDA driver library whose checkpoint API moves the memory.
    pub cuda_lib: OsString,
    /// Host memory checkpoints may hold, node-wide, bytes (0: suspension is off).
    pub host_memory: u64,
    /// How long a process's lock may wait for its calls and work in flight, ms.
    pub lock_timeout_ms: u32,
    /// Burstable containers untouched this long are suspended (None: never).
    pub idle_after: Option<Duration>,
}

impl Default for Settings {
    fn default() -> Settings {
        Settings {
            cuda_lib: crate::checkpoint::DEFAULT_LIB.into(),
            host_memory: 0,
            lock_timeout_ms: 2000,
            idle_after: None,
        }
    }
}

/// Why a suspension or a resume was refused or failed.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum SuspendError {
    /// No such tenant.
    #[error("no tenant {0:?}")]
    NoTenant(String),
    /// The tenant has no registered process: nothing on the GPU to move.
    #[error("tenant {0:?} has no registered process to suspend")]
    NoProcesses(String),
    /// Already suspended.
    #[error("tenant {0:?} is already suspended")]
    AlreadySuspended(String),
    /// `--suspend-host-memory` is 0.
    #[error("suspension is off on this node (--suspend-host-memory 0)")]
    Off,
    /// The checkpoint would not fit in the host memory checkpoints may hold.
    #[error(
        "suspending tenant {key:?} would hold {asked} B in host memory beside the {held} B held, over --suspend-host-memory {limit} B"
    )]
    HostMemory {
        /// The tenant.
        key: String,
        /// Its bytes.
        asked: u64,
        /// Held by other suspensions.
        held: u64,
        /// The bound.
        limit: u64,
    },
    /// The driver's checkpoint API cannot be used.
    #[error(transparent)]
    Driver(#[from] DriverError),
    /// A process could not be locked (nothing was moved).
    #[error("cannot lock process {pid}: {code}{}", lock_hint(*code))]
    Lock {
        /// Host PID.
        pid: u32,
        /// The driver's answer.
        code: Code,
    },
    /// A process could not be checkpointed (the others were restored and unlocked).
    #[error("cannot checkpoint process {pid}: {code}{}", checkpoint_hint(*code))]
    Checkpoint {
        /// Host PID.
        pid: u32,
        /// The driver's answer.
        code: Code,
    },
    /// A process could not be restored (the tenant stays suspended; ask again).
    #[error("cannot restore process {pid}: {code}{}", restore_hint(*code))]
    Restore {
        /// Host PID.
        pid: u32,
        /// The driver's answer.
        code: Code,
    },
}

fn lock_hint(c: Code) -> &'static str {
    match c.0 {
        CUDA_ERROR_NOT_READY => {
            ": its CUDA calls or GPU work did not finish within the lock timeout"
        }
        _ => "",
    }
}

fn checkpoint_hint(c: Code) -> &'static str {
    match c.0 {
        CUDA_ERROR_NOT_SUPPORTED => {
            ": the driver cannot checkpoint it (unified memory, memory shared with another process by IPC, or VMM memory)"
        }
        CUDA_ERROR_OUT_OF_MEMORY => ": the host has not the memory to hold it",
        _ => "",
    }
}

fn restore_hint(c: Code) -> &'static str {
    match c.0 {
        CUDA_ERROR_OUT_OF_MEMORY => ": the GPU has not the memory to take it back",
        _ => "",
    }
}

/// The driver calls a suspension makes (the seam: [`Driver`] in production, a script
/// in the unit tests).
pub trait Checkpoints {
    /// Locks `pid` (its new CUDA calls block).
    fn lock(&self, pid: u32, timeout_ms: u32) -> Result<(), Code>;
    /// Moves `pid`'s device memory to host memory.
    fn checkpoint(&self, pid: u32) -> Result<(), Code>;
    /// Moves it back.
    fn restore(&self, pid: u32) -> Result<(), Code>;
    /// Unlocks `pid`.
    fn unlock(&self, pid: u32) -> Result<(), Code>;
}

impl Checkpoints for Driver {
    fn lock(&self, pid: u32, timeout_ms: u32) -> Result<(), Code> {
        Driver::lock(self, pid, timeout_ms)
    }
    fn checkpoint(&self, pid: u32) -> Result<(), Code> {
        Driver::checkpoint(self, pid)
    }
    fn restore(&self, pid: u32) -> Result<(), Code> {
        Driver::restore(self, pid)
    }
    fn unlock(&self, pid: u32) -> Result<(), Code> {
        Driver::unlock(self, pid)
    }
}

/// Suspends every process of `pids`, all or none: locks each, then checkpoints each; on
/// a failure, restores those checkpointed and unlocks those locked, and says which
/// process failed how.
pub fn suspend_all(c: &dyn Checkpoints, pids: &[u32], timeout_ms: u32) -> Result<(), SuspendError> {
    let mut locked = Vec::with_capacity(pids.len());
    let undo = |done: &[u32], locked: &[u32]| {
        for &p in done {
            let _ = c.restore(p);
        }
        for &p in locked {
            let _ = c.unlock(p);
        }
    };
    for &pid in pids {
        if let Err(code) = c.lock(pid, timeout_ms) {
            undo(&[], &locked);
            return Err(SuspendError::Lock { pid, code });
        }
        locked.push(pid);
    }
    let mut done = Vec::with_capacity(pids.len());
    for &pid in pids {
        if let Err(code) = c.checkpoint(pid) {
            undo(&done, &locked);
            return Err(SuspendError::Checkpoint { pid, code });
        }
        done.push(pid);
    }
    Ok(())
}

/// Resumes every process of `pids`: restores each, then unlocks each. A process that is
/// gone (`CUDA_ERROR_INVALID_VALUE`: no such CUDA process) is passed over; one already
/// restored by an earlier, interrupted resume (`CUDA_ERROR_ILLEGAL_STATE`) too. A restore
/// that fails otherwise stops the resume before any unlock: the processes stay locked
/// and the caller may ask again.
pub fn resume_all(c: &dyn Checkpoints, pids: &[u32]) -> Result<(), SuspendError> {
    for &pid in pids {
        match c.restore(pid) {
            Ok(()) => {}
            Err(Code(CUDA_ERROR_INVALID_VALUE | CUDA_ERROR_ILLEGAL_STATE)) => {}
            Err(code) => return Err(SuspendError::Restore { pid, code }),
        }
    }
    for &pid in pids {
        let _ = c.unlock(pid);
    }
    Ok(())
}

/// Whether `asked` bytes more fit in host memory beside `held` under `limit` (0: off).
pub fn fits_host(key: &str, asked: u64, held: u64, limit: u64) -> Result<(), SuspendError> {
    if limit == 0 {
        return Err(SuspendError::Off);
    }
    if held.saturating_add(asked) > limit {
        return Err(SuspendError::HostMemory {
            key: key.to_owned(),
            asked,
            held,
            limit,
        });
    }
    Ok(())
}

/// What a suspension did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Suspended {
    /// The processes moved (host PIDs).
    pub pids: Vec<u32>,
    /// The bytes moved to host memory, per GPU (as the shims reported them).
    pub bytes: BTreeMap<String, u64>,
    /// How long it took.
    pub took: Duration,
}

/// What a resume did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resumed {
    /// Whether the tenant was suspended (else nothing was done).
    pub was_suspended: bool,
    /// How long the restore took.
    pub took: Duration,
}

/// What a suspension moves: the tenant's processes (host PIDs), its bytes per GPU, and
/// its board.
type Target = (Vec<u32>, BTreeMap<String, u64>, Arc<Board>);

/// A suspended tenant, in the books.
#[derive(Debug)]
struct Held {
    pids: Vec<u32>,
    bytes: BTreeMap<String, u64>,
    board: Arc<Board>,
}

impl Held {
    fn total(&self) -> u64 {
        self.bytes.values().fold(0u64, |a, b| a.saturating_add(*b))
    }
}

#[derive(Debug, Default)]
struct Books {
    held: HashMap<String, Held>,
    /// Suspensions per tenant, since the daemon started.
    counts: HashMap<String, u64>,
    /// Host memory held or being filled by checkpoints, bytes.
    host_held: u64,
}

/// The daemon's suspension state.
#[derive(Debug, Default)]
pub(crate) struct Suspensions {
    settings: OnceLock<Settings>,
    driver: OnceLock<Result<Arc<Driver>, DriverError>>,
    /// One operation at a time per tenant.
    ops: Mutex<HashMap<String, Arc<Mutex<()>>>>,
    books: Mutex<Books>,
}

fn relock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every critical section leaves the books consistent.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Suspensions {
    fn settings(&self) -> &Settings {
        self.settings.get_or_init(Settings::default)
    }

    fn driver(&self) -> Result<Arc<Driver>, DriverError> {
        self.driver
            .get_or_init(|| {
                let lib = self.settings().cuda_lib.clone();
                let d = Driver::load(&lib).map(Arc::new);
                match &d {
                    Ok(d) => info!(lib = d.lib(), "the driver's checkpoint API is loaded"),
                    Err(e) => warn!("suspension unavailable: {e}"),
                }
                d
            })
            .clone()
    }

    fn op(&self, key: &str) -> Arc<Mutex<()>> {
        Arc::clone(relock(&self.ops).entry(key.to_owned()).or_default())
    }

    /// The bytes of `key` suspended on `uuid` now, and its suspensions so far.
    pub(crate) fn view(&self, key: &str, uuid: &str) -> (u64, u64) {
        let b = relock(&self.books);
        let bytes = b
            .held
            .get(key)
            .and_then(|h| h.bytes.get(uuid).copied())
            .unwrap_or(0);
        (bytes, b.counts.get(key).copied().unwrap_or(0))
    }
}

impl Daemon {
    /// Sets the suspension settings (once, at start; later calls are ignored).
    pub fn set_suspension_settings(&self, s: Settings) {
        let _ = self.susp.settings.set(s);
    }

    /// The pids, bytes per GPU and board of tenant `key`.
    fn suspension_target(&self, key: &str) -> Result<Target, SuspendError> {
        let g = self.lock();
        let t = g
            .tenants
            .get(key)
            .ok_or_else(|| SuspendError::NoTenant(key.to_owned()))?;
        let mut pids: Vec<u32> = t
            .conns
            .iter()
            .filter_map(|c| g.conns.get(c).map(|c| c.pid))
            .collect();
        pids.sort_unstable();
        pids.dedup();
        let bytes = t
            .gpus
            .iter()
            .map(|(u, r)| (u.clone(), r.memory.values().copied().max().unwrap_or(0)))
            .collect();
        Ok((pids, bytes, Arc::clone(&t.board)))
    }

    /// Suspends tenant `key`: every registered process of it, all or none.
    pub fn suspend(&self, key: &str) -> Result<Suspended, SuspendError> {
        let start = Instant::now();
        let op = self.susp.op(key);
        let _op = relock(&op);
        if relock(&self.susp.books).held.contains_key(key) {
            return Err(SuspendError::AlreadySuspended(key.to_owned()));
        }
        let (pids, bytes, board) = self.suspension_target(key)?;
        if pids.is_empty() {
            return Err(SuspendError::NoProcesses(key.to_owned()));
        }
        let total = bytes.values().fold(0u64, |a, b| a.saturating_add(*b));
        let limit = self.susp.settings().host_memory;
        {
            let mut b = relock(&self.susp.books);
            fits_host(key, total, b.host_held, limit)?;
            b.host_held = b.host_held.saturating_add(total);
        }
        let release = || {
            let mut b = relock(&self.susp.books);
            b.host_held = b.host_held.saturating_sub(total);
        };
        let driver = match self.susp.driver() {
            Ok(d) => d,
            Err(e) => {
                release();
                return Err(e.into());
            }
        };
        // The board first: a shim call that starts now asks for the resume, which
        // waits for this operation.
        board.set_suspended(true);
        if let Err(e) = suspend_all(driver.as_ref(), &pids, self.susp.settings().lock_timeout_ms) {
            board.set_suspended(false);
            release();
            warn!(tenant = key, "suspension refused: {e}");
            return Err(e);
        }
        let took = start.elapsed();
        {
            let mut b = relock(&self.susp.books);
            *b.counts.entry(key.to_owned()).or_default() += 1;
            b.held.insert(
                key.to_owned(),
                Held {
                    pids: pids.clone(),
                    bytes: bytes.clone(),
                    board,
                },
            );
        }
        info!(
            tenant = key,
            ?pids,
            bytes = total,
            ms = took.as_millis() as u64,
            "suspended"
        );
        Ok(Suspended { pids, bytes, took })
    }

    /// Resumes tenant `key` (nothing to do if it is not suspended).
    pub fn resume(&self, key: &str) -> Result<Resumed, SuspendError> {
        let start = Instant::now();
        let op = self.susp.op(key);
        let _op = relock(&op);
        let Some((pids, board, total)) = relock(&self.susp.books)
            .held
            .get(key)
            .map(|h| (h.pids.clone(), Arc::clone(&h.board), h.total()))
        else {
            if !self.lock().tenants.contains_key(key) {
                return Err(SuspendError::NoTenant(key.to_owned()));
            }
            return Ok(Resumed {
                was_suspended: false,
                took: Duration::ZERO,
            });
        };
        let driver = self.susp.driver()?;
        resume_all(driver.as_ref(), &pids)?;
        board.set_suspended(false);
        {
            let mut b = relock(&self.susp.books);
            b.held.remove(key);
            b.host_held = b.host_held.saturating_sub(total);
        }
        let took = start.elapsed();
        info!(
            tenant = key,
            ?pids,
            bytes = total,
            ms = took.as_millis() as u64,
            "resumed"
        );
        Ok(Resumed {
            was_suspended: true,
            took,
        })
    }

    /// Resumes the container of process `pid` (host PID, from the shim's peer
    /// credentials). A process the books do not hold suspended but the driver does (a
    /// daemon restarted while its container was suspended) is restored and unlocked
    /// alone.
    pub fn resume_pid(&self, pid: u32) -> Result<Resumed, SuspendError> {
        let key = {
            let g = self.lock();
            g.conns
                .values()
                .find(|c| c.pid == pid)
                .map(|c| c.tenant.clone())
        };
        if let Some(k) = &key
            && relock(&self.susp.books).held.contains_key(k)
        {
            return self.resume(k);
        }
        let start = Instant::now();
        let driver = self.susp.driver()?;
        let was_suspended = match driver.state(pid) {
            Ok(ProcessState::Checkpointed) => {
                resume_all(driver.as_ref(), &[pid])?;
                true
            }
            Ok(ProcessState::Locked) => {
                let _ = driver.unlock(pid);
                true
            }
            _ => false,
        };
        if was_suspended {
            info!(pid, tenant = ?key, "resumed a process the books did not hold suspended");
        }
        Ok(Resumed {
            was_suspended,
            took: start.elapsed(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;

    /// A scripted driver: fails `fail` (operation, pid) with its code, records every
    /// call.
    struct Script {
        fail: Vec<(&'static str, u32, u32)>,
        calls: RefCell<Vec<(&'static str, u32)>>,
    }

    impl Script {
        fn new(fail: &[(&'static str, u32, u32)]) -> Script {
            Script {
                fail: fail.to_vec(),
                calls: RefCell::new(Vec::new()),
            }
        }
        fn call(&self, op: &'static str, pid: u32) -> Result<(), Code> {
            self.calls.borrow_mut().push((op, pid));
            match self.fail.iter().find(|f| f.0 == op && f.1 == pid) {
                Some(f) => Err(Code(f.2)),
                None => Ok(()),
            }
        }
        fn calls(&self) -> Vec<(&'static str, u32)> {
            self.calls.borrow().clone()
        }
    }

    impl Checkpoints for Script {
        fn lock(&self, pid: u32, _t: u32) -> Result<(), Code> {
            self.call("lock", pid)
        }
        fn checkpoint(&self, pid: u32) -> Result<(), Code> {
            self.call("checkpoint", pid)
        }
        fn restore(&self, pid: u32) -> Result<(), Code> {
            self.call("restore", pid)
        }
        fn unlock(&self, pid: u32) -> Result<(), Code> {
            self.call("unlock", pid)
        }
    }

    #[test]
    fn every_process_is_locked_before_any_is_checkpointed() {
        let s = Script::new(&[]);
        suspend_all(&s, &[1, 2], 2000).expect("suspended");
        assert_eq!(
            s.calls(),
            [
                ("lock", 1),
                ("lock", 2),
                ("checkpoint", 1),
                ("checkpoint", 2)
            ]
        );
    }

    #[test]
    fn a_refused_checkpoint_restores_and_unlocks_all() {
        let s = Script::new(&[("checkpoint", 3, CUDA_ERROR_NOT_SUPPORTED)]);
        let e = suspend_all(&s, &[1, 3, 5], 2000).expect_err("refused");
        assert_eq!(
            e,
            SuspendError::Checkpoint {
                pid: 3,
                code: Code(CUDA_ERROR_NOT_SUPPORTED)
            }
        );
        assert!(e.to_string().contains("unified memory"), "{e}");
        assert_eq!(
            s.calls(),
            [
                ("lock", 1),
                ("lock", 3),
                ("lock", 5),
                ("checkpoint", 1),
                ("checkpoint", 3),
                ("restore", 1),
                ("unlock", 1),
                ("unlock", 3),
                ("unlock", 5)
            ]
        );
    }

    #[test]
    fn a_lock_timeout_unlocks_the_locked_and_moves_nothing() {
        let s = Script::new(&[("lock", 2, CUDA_ERROR_NOT_READY)]);
        let e = suspend_all(&s, &[1, 2, 3], 2000).expect_err("refused");
        assert!(e.to_string().contains("lock timeout"), "{e}");
        assert_eq!(s.calls(), [("lock", 1), ("lock", 2), ("unlock", 1)]);
    }

    #[test]
    fn a_resume_passes_over_gone_processes_and_stops_at_a_failed_restore() {
        let s = Script::new(&[("restore", 1, CUDA_ERROR_INVALID_VALUE)]);
        resume_all(&s, &[1, 2]).expect("resumed");
        assert_eq!(
            s.calls(),
            [("restore", 1), ("restore", 2), ("unlock", 1), ("unlock", 2)]
        );
        let s = Script::new(&[("restore", 2, CUDA_ERROR_OUT_OF_MEMORY)]);
        let e = resume_all(&s, &[1, 2]).expect_err("no memory");
        assert!(e.to_string().contains("GPU has not the memory"), "{e}");
        assert_eq!(s.calls(), [("restore", 1), ("restore", 2)]);
    }

    #[test]
    fn host_memory_is_a_bound() {
        assert_eq!(fits_host("t", 1, 0, 0), Err(SuspendError::Off));
        fits_host("t", 6, 4, 10).expect("fits exactly");
        let e = fits_host("t", 7, 4, 10).expect_err("over");
        assert_eq!(
            e.to_string(),
            "suspending tenant \"t\" would hold 7 B in host memory beside the 4 B held, over --suspend-host-memory 10 B"
        );
    }
}
