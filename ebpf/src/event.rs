//! Events from the programs: decoding ring-buffer records and reading them, blocking with a
//! timeout or driven by the caller's poller through the ring buffer's fd.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::time::Duration;

use aya::maps::{MapData, RingBuf};

use crate::abi::{EVENT_AUDITED, EVENT_EXIT, EVENT_REFUSED, RawEvent};
use crate::error::EbpfError;

/// What happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventKind {
    /// The gate refused a GPU open (EPERM).
    Refused,
    /// The gate allowed a GPU open only because the mode is audit.
    Audited,
    /// The last thread of a watched process exited.
    Exit,
}

/// One event, decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// What happened.
    pub kind: EventKind,
    /// Process id in the initial pid namespace.
    pub tgid: u32,
    /// Thread id in the initial pid namespace.
    pub pid: u32,
    /// cgroup v2 id of the task: the inode number of its cgroup2 directory.
    pub cgroup_id: u64,
    /// The device (major, minor) for gate events; `None` for exits.
    pub device: Option<(u32, u32)>,
    /// `bpf_cgroup_dev_ctx.access_type` (BPF_DEVCG_ACC_* << 16 | BPF_DEVCG_DEV_*).
    pub access: u32,
    /// CLOCK_MONOTONIC time of the event.
    pub time: Duration,
    /// Task name.
    pub comm: String,
}

impl Event {
    /// Decodes one ring-buffer record; `None` for a short record or an unknown kind.
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        let raw = RawEvent::from_bytes(bytes)?;
        let kind = match raw.kind {
            EVENT_REFUSED => EventKind::Refused,
            EVENT_AUDITED => EventKind::Audited,
            EVENT_EXIT => EventKind::Exit,
            _ => return None,
        };
        let name_len = raw
            .comm
            .iter()
            .position(|&byte| byte == 0)
            .unwrap_or(raw.comm.len());
        Some(Self {
            kind,
            tgid: raw.tgid,
            pid: raw.pid,
            cgroup_id: raw.cgroup_id,
            device: (kind != EventKind::Exit).then_some((raw.major, raw.minor)),
            access: raw.access,
            time: Duration::from_nanos(raw.time_ns),
            comm: String::from_utf8_lossy(&raw.comm[..name_len]).into_owned(),
        })
    }
}

/// Reads the programs' ring buffer. Owned apart from the `Enforcer` so that one thread can
/// read while another updates the maps; register [`AsFd`] with a poller (e.g. tokio's
/// `AsyncFd`) and call [`EventReader::try_next`] when readable, or block in
/// [`EventReader::next_timeout`].
pub struct EventReader {
    ring: RingBuf<MapData>,
}

impl std::fmt::Debug for EventReader {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("EventReader")
            .field("fd", &self.ring.as_raw_fd())
            .finish()
    }
}

impl EventReader {
    pub(crate) fn new(ring: RingBuf<MapData>) -> Self {
        Self { ring }
    }

    /// The next event if one is ready (records of unknown kinds are skipped).
    pub fn try_next(&mut self) -> Option<Event> {
        while let Some(item) = self.ring.next() {
            if let Some(event) = Event::decode(&item) {
                return Some(event);
            }
        }
        None
    }

    /// The next event, waiting at most `timeout`; `Ok(None)` when none came.
    pub fn next_timeout(&mut self, timeout: Duration) -> Result<Option<Event>, EbpfError> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            if let Some(event) = self.try_next() {
                return Ok(Some(event));
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Ok(None);
            }
            let mut poll = libc::pollfd {
                fd: self.ring.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            let millis = i32::try_from(left.as_millis().max(1)).unwrap_or(i32::MAX);
            // SAFETY: `poll` is one valid pollfd for the duration of the call, and the count
            // passed is 1.
            let ready = unsafe { libc::poll(&raw mut poll, 1, millis) };
            if ready < 0 {
                let source = std::io::Error::last_os_error();
                if source.kind() != std::io::ErrorKind::Interrupted {
                    return Err(EbpfError::Syscall {
                        command: "poll",
                        what: "vgpu_events ring buffer".to_owned(),
                        source,
                    });
                }
            }
        }
    }
}

impl AsFd for EventReader {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.ring.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(raw: &RawEvent) -> Vec<u8> {
        let mut out = Vec::new();
        for word in [
            raw.kind, raw.tgid, raw.pid, raw.major, raw.minor, raw.access,
        ] {
            out.extend_from_slice(&word.to_ne_bytes());
        }
        out.extend_from_slice(&raw.cgroup_id.to_ne_bytes());
        out.extend_from_slice(&raw.time_ns.to_ne_bytes());
        out.extend_from_slice(&raw.comm);
        out
    }

    #[test]
    fn decodes_a_refusal_and_an_exit() {
        let mut comm = [0u8; 16];
        comm[..5].copy_from_slice(b"pytho");
        let raw = RawEvent {
            kind: EVENT_REFUSED,
            tgid: 42,
            pid: 43,
            major: 195,
            minor: 255,
            access: 6 << 16 | 2,
            cgroup_id: 9,
            time_ns: 1_500,
            comm,
        };
        let event = Event::decode(&bytes(&raw)).unwrap();
        assert_eq!(event.kind, EventKind::Refused);
        assert_eq!((event.tgid, event.pid, event.cgroup_id), (42, 43, 9));
        assert_eq!(event.device, Some((195, 255)));
        assert_eq!(event.comm, "pytho");
        assert_eq!(event.time, Duration::from_nanos(1_500));
        let exit = Event::decode(&bytes(&RawEvent {
            kind: EVENT_EXIT,
            ..raw
        }))
        .unwrap();
        assert_eq!((exit.kind, exit.device), (EventKind::Exit, None));
    }

    #[test]
    fn short_records_and_unknown_kinds_are_not_events() {
        let raw = RawEvent {
            kind: 77,
            tgid: 1,
            pid: 1,
            major: 0,
            minor: 0,
            access: 0,
            cgroup_id: 0,
            time_ns: 0,
            comm: [b'x'; 16],
        };
        assert_eq!(Event::decode(&bytes(&raw)), None);
        let good = bytes(&RawEvent {
            kind: EVENT_EXIT,
            ..raw
        });
        assert_eq!(Event::decode(&good[..good.len() - 1]), None);
        assert_eq!(Event::decode(&good).unwrap().comm, "x".repeat(16));
    }
}
