//! The checkpoint API's part of the node's shared state: each process slot's checkpoint
//! state (`CUprocessState`), the gate its CUDA calls wait at while it is locked, the
//! request words through which another process (the daemon) asks the slot's own driver to
//! lock, checkpoint, restore or unlock it, and the node's host memory that checkpoints
//! hold (a bounded resource).
//!
//! The real driver acts on another process by pid through the kernel driver, which owns
//! that process's GPU state. The simulator has no kernel driver: a controller writes a
//! request into the target's [`CkptSlot`] and wakes the target's checkpoint thread (the
//! driver's "restore thread"), which does the work inside the target, where its device
//! memory is mapped, and posts the result. What is decided here is pure: which operation
//! a state allows ([`check_transition`]) and how long a copy takes ([`copy_ns`]).

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use vgpu_cuda_abi::cuda::{CUDA_ERROR_ILLEGAL_STATE, CUresult, process_state};

use crate::config::{HostConfig, MAX_DEVICES};
use crate::node_state::MAX_SLOTS;

/// An operation of the checkpoint API on a process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum CkptOp {
    /// `cuCheckpointProcessLock`.
    Lock = 1,
    /// `cuCheckpointProcessCheckpoint`.
    Checkpoint = 2,
    /// `cuCheckpointProcessRestore`.
    Restore = 3,
    /// `cuCheckpointProcessUnlock`.
    Unlock = 4,
}

impl CkptOp {
    /// The operation encoded as `v` in a request word.
    pub fn from_u32(v: u32) -> Option<CkptOp> {
        [Self::Lock, Self::Checkpoint, Self::Restore, Self::Unlock]
            .into_iter()
            .find(|o| *o as u32 == v)
    }

    /// The state the process must be in (the driver's documented precondition) and the
    /// state it is in after success.
    pub fn states(self) -> (u32, u32) {
        use process_state::*;
        match self {
            CkptOp::Lock => (RUNNING, LOCKED),
            CkptOp::Checkpoint => (LOCKED, CHECKPOINTED),
            // A restored process is LOCKED until it is unlocked, as with the driver.
            CkptOp::Restore => (CHECKPOINTED, LOCKED),
            CkptOp::Unlock => (LOCKED, RUNNING),
        }
    }
}

/// Whether `op` may run on a process in `state`: `CUDA_ERROR_ILLEGAL_STATE` otherwise,
/// as the driver answers an operation out of order (a FAILED process allows none).
pub fn check_transition(op: CkptOp, state: u32) -> Result<(), CUresult> {
    if op.states().0 == state {
        Ok(())
    } else {
        Err(CUDA_ERROR_ILLEGAL_STATE)
    }
}

/// Nanoseconds a copy of `bytes` over a link of `gbps` GB/s (10^9 bytes per second)
/// takes.
pub fn copy_ns(bytes: u64, gbps: u32) -> u64 {
    let gbps = u128::from(gbps.max(1));
    u64::try_from(u128::from(bytes) * 1_000_000_000 / (gbps * 1_000_000_000)).unwrap_or(u64::MAX)
}

/// One process slot's checkpoint state. All fields are atomics in the shared mapping.
#[repr(C)]
#[derive(Debug)]
pub struct CkptSlot {
    /// `CUprocessState` of the slot's process.
    pub state: AtomicU32,
    /// Non-zero while the process's CUDA calls must wait (a futex word: opening it
    /// wakes them).
    pub gate: AtomicU32,
    /// The process's CUDA calls in progress (a futex word the lock waits on).
    pub inflight: AtomicU32,
    /// The pid of the controller whose operation is in progress (0: none): one operation
    /// on a process at a time.
    pub busy: AtomicU32,
    /// Request sequence: bumped by the controller when `op`/`arg` are written (the
    /// checkpoint thread waits on it).
    pub req: AtomicU32,
    /// Completion sequence: set to `req` by the checkpoint thread when `result` is
    /// written (the controller waits on it).
    pub done: AtomicU32,
    /// The requested [`CkptOp`].
    pub op: AtomicU32,
    /// Its argument (the lock's timeout, ms).
    pub arg: AtomicU32,
    /// The `CUresult` of the last operation.
    pub result: AtomicU32,
    /// The checkpoint thread's id (0: none started: not a process that can be
    /// checkpointed).
    pub agent_tid: AtomicU32,
    /// Host bytes the process's checkpoint holds.
    pub host_bytes: AtomicU64,
    /// Device bytes released by the checkpoint, per device (taken back at restore).
    pub moved: [AtomicU64; MAX_DEVICES],
    /// How long the last checkpoint or restore took, ns.
    pub last_ns: AtomicU64,
}

/// The checkpoint part of the node's state.
#[repr(C)]
#[derive(Debug)]
pub struct CheckpointArea {
    host_capacity: AtomicU64,
    host_copy_gbps: AtomicU32,
    _pad: u32,
    host_used: AtomicU64,
    slots: [CkptSlot; MAX_SLOTS],
}

impl CheckpointArea {
    /// Writes the configuration into a fresh (zeroed) area.
    pub fn init(&self, host: &HostConfig) {
        self.host_capacity.store(host.memory, Ordering::Relaxed);
        self.host_copy_gbps.store(host.copy_gbps, Ordering::Relaxed);
    }

    /// Slot `i`'s checkpoint state.
    pub fn slot(&self, i: usize) -> &CkptSlot {
        &self.slots[i]
    }

    /// Host-link bandwidth of checkpoint copies, GB/s.
    pub fn copy_gbps(&self) -> u32 {
        self.host_copy_gbps.load(Ordering::Relaxed)
    }

    /// Host memory checkpoints may hold, and what they hold now, bytes.
    pub fn host_memory(&self) -> (u64, u64) {
        (
            self.host_capacity.load(Ordering::Relaxed),
            self.host_used.load(Ordering::Acquire),
        )
    }

    /// Takes `bytes` of host memory for a checkpoint: all or nothing.
    pub fn host_reserve(&self, bytes: u64) -> bool {
        let cap = self.host_capacity.load(Ordering::Relaxed);
        self.host_used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
                u.checked_add(bytes).filter(|&n| n <= cap)
            })
            .is_ok()
    }

    /// Gives `bytes` of host memory back.
    pub fn host_release(&self, bytes: u64) {
        let _ = self
            .host_used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
                Some(u.saturating_sub(bytes))
            });
    }

    /// Resets slot `i` for a new process: RUNNING, gate open, and the host memory a
    /// dead predecessor's checkpoint held given back.
    pub fn reset_slot(&self, i: usize) {
        let s = &self.slots[i];
        self.host_release(s.host_bytes.swap(0, Ordering::AcqRel));
        for m in &s.moved {
            m.store(0, Ordering::Relaxed);
        }
        s.state.store(process_state::RUNNING, Ordering::Release);
        s.gate.store(0, Ordering::Release);
        s.inflight.store(0, Ordering::Release);
        s.busy.store(0, Ordering::Release);
        s.agent_tid.store(0, Ordering::Release);
        s.last_ns.store(0, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vgpu_cuda_abi::cuda::process_state::*;

    #[test]
    fn each_operation_needs_the_documented_state() {
        let all = [RUNNING, LOCKED, CHECKPOINTED, FAILED];
        for op in [
            CkptOp::Lock,
            CkptOp::Checkpoint,
            CkptOp::Restore,
            CkptOp::Unlock,
        ] {
            let allowed: Vec<u32> = all
                .into_iter()
                .filter(|&s| check_transition(op, s).is_ok())
                .collect();
            let want = match op {
                CkptOp::Lock => RUNNING,
                CkptOp::Checkpoint | CkptOp::Unlock => LOCKED,
                CkptOp::Restore => CHECKPOINTED,
            };
            assert_eq!(allowed, vec![want], "{op:?}");
            assert_eq!(CkptOp::from_u32(op as u32), Some(op));
        }
        assert_eq!(
            check_transition(CkptOp::Unlock, CHECKPOINTED),
            Err(CUDA_ERROR_ILLEGAL_STATE)
        );
        assert_eq!(CkptOp::Restore.states().1, LOCKED);
        assert_eq!(CkptOp::from_u32(0), None);
    }

    #[test]
    fn copy_time_follows_the_bandwidth() {
        assert_eq!(copy_ns(25_000_000_000, 25), 1_000_000_000);
        assert_eq!(copy_ns(1 << 30, 25), 42_949_672);
        assert_eq!(copy_ns(0, 25), 0);
        assert_eq!(copy_ns(1000, 0), 1000, "a zero bandwidth counts as 1 GB/s");
    }
}
