//! The kernel boundary: `#[repr(C)]` mirrors of `bpf/vgpu_ebpf.h` (map keys, values, ring
//! buffer records, indices). `tests/layout.rs` checks every size and offset against the C
//! compiler's; change both sides together and bump [`ABI_VERSION`].

use std::mem::size_of;

/// Layout version of the maps and records; pinned maps live under a directory named for it,
/// so a daemon never reuses maps written with another layout.
pub const ABI_VERSION: u32 = 1;

/// `vgpu_config` index of the gate mode.
pub const CONFIG_MODE: u32 = 0;
/// `vgpu_config` index of the ABI version the maps were written with.
pub const CONFIG_ABI: u32 = 1;
/// Entries in `vgpu_config`.
pub const CONFIG_LEN: u32 = 2;
/// Gate mode value: refuse unregistered opens (also what any unknown value means).
pub const MODE_ENFORCE: u32 = 0;
/// Gate mode value: allow and report unregistered opens.
pub const MODE_AUDIT: u32 = 1;
/// Entries of `vgpu_gpu_majors`: majors are 12 bits.
pub const MAJORS: u32 = 4096;
/// A [`DevKey`] minor that matches every minor of its major.
pub const ANY_MINOR: u32 = u32::MAX;

/// `vgpu_counters` index: gate events dropped because `vgpu_events` was full.
pub const COUNTER_LOST: u32 = 0;
/// `vgpu_counters` index: GPU opens refused.
pub const COUNTER_REFUSED: u32 = 1;
/// `vgpu_counters` index: GPU opens allowed only because the mode is audit.
pub const COUNTER_AUDITED: u32 = 2;
/// `vgpu_counters` index: exit events emitted.
pub const COUNTER_EXITS: u32 = 3;
/// `vgpu_counters` index: exit events dropped because `vgpu_exit_events` was full.
pub const COUNTER_EXIT_LOST: u32 = 4;
/// Entries in `vgpu_counters`.
pub const COUNTER_LEN: u32 = 5;

/// [`RawEvent::kind`]: an open refused by the gate.
pub const EVENT_REFUSED: u32 = 1;
/// [`RawEvent::kind`]: an open that enforce mode would have refused.
pub const EVENT_AUDITED: u32 = 2;
/// [`RawEvent::kind`]: the last thread of a watched process exited.
pub const EVENT_EXIT: u32 = 3;

/// Key of `vgpu_gpu_devices`: a character device number.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DevKey {
    /// Major number.
    pub major: u32,
    /// Minor number, or [`ANY_MINOR`].
    pub minor: u32,
}

/// One record of the `vgpu_events` ring buffer (`struct vgpu_event`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawEvent {
    /// `EVENT_*`.
    pub kind: u32,
    /// Thread-group id (process id) in the initial pid namespace.
    pub tgid: u32,
    /// Thread id in the initial pid namespace.
    pub pid: u32,
    /// Device major (0 for exits).
    pub major: u32,
    /// Device minor (0 for exits).
    pub minor: u32,
    /// `bpf_cgroup_dev_ctx.access_type`: device type in the low 16 bits, access bits above.
    pub access: u32,
    /// cgroup v2 id of the task (the inode number of its cgroup2 directory).
    pub cgroup_id: u64,
    /// `bpf_ktime_get_ns()`, i.e. CLOCK_MONOTONIC in nanoseconds.
    pub time_ns: u64,
    /// Task name, NUL-padded.
    pub comm: [u8; 16],
}

impl RawEvent {
    /// Reads a record from the bytes of one ring-buffer item; `None` when too short.
    pub fn from_bytes(bytes: &[u8]) -> Option<Self> {
        if bytes.len() < size_of::<Self>() {
            return None;
        }
        // SAFETY: `bytes` holds at least size_of::<RawEvent>() bytes (checked above);
        // read_unaligned needs no alignment; RawEvent is plain integers and a byte array, so
        // every bit pattern is a valid value.
        Some(unsafe { bytes.as_ptr().cast::<Self>().read_unaligned() })
    }
}

// SAFETY: DevKey is #[repr(C)], made only of u32 fields with no padding, valid for any bits.
unsafe impl aya::Pod for DevKey {}
