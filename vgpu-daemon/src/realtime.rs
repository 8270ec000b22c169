//! The daemon's CPU scheduling class: its threads decide who may use the GPU next, so
//! on a node whose CPUs are saturated they must not queue behind the load (ADR 0013).
//! One call at start-up, before any thread exists, so that every thread inherits it.

use thiserror::Error;

/// Highest real-time priority accepted (`sched_get_priority_max(SCHED_FIFO)` is 99).
pub const MAX_PRIORITY: u32 = 99;

/// What `--sched-priority` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SchedClass {
    /// Stay in the default time-sharing class (`--sched-priority 0`).
    TimeSharing,
    /// `SCHED_FIFO` at this priority (1–99), children reset to the default class.
    Fifo(u32),
}

/// A bad `--sched-priority` or a refusal by the kernel.
#[derive(Debug, Error)]
pub enum RealtimeError {
    /// The value is not 0–99.
    #[error("--sched-priority {0} is out of range (0: time-sharing, 1–99: SCHED_FIFO)")]
    OutOfRange(u32),
    /// `sched_setscheduler` failed (typically EPERM: no CAP_SYS_NICE, or a cgroup
    /// without real-time runtime).
    #[error("cannot switch to SCHED_FIFO priority {priority}")]
    Refused {
        /// The priority asked for.
        priority: u32,
        /// The kernel's answer.
        #[source]
        source: std::io::Error,
    },
}

impl SchedClass {
    /// The class for a `--sched-priority` value.
    pub fn from_priority(p: u32) -> Result<SchedClass, RealtimeError> {
        match p {
            0 => Ok(SchedClass::TimeSharing),
            1..=MAX_PRIORITY => Ok(SchedClass::Fifo(p)),
            _ => Err(RealtimeError::OutOfRange(p)),
        }
    }
}

/// Puts the calling thread (and the threads it creates later) in `class`.
pub fn apply(class: SchedClass) -> Result<(), RealtimeError> {
    let SchedClass::Fifo(priority) = class else {
        return Ok(());
    };
    let param = libc::sched_param {
        sched_priority: i32::try_from(priority).unwrap_or(1),
    };
    // SAFETY: pid 0 is the calling thread; `param` is a valid, initialised struct that
    // outlives the call. SCHED_RESET_ON_FORK keeps processes we might spawn out of the
    // real-time class.
    let r = unsafe {
        libc::sched_setscheduler(0, libc::SCHED_FIFO | libc::SCHED_RESET_ON_FORK, &param)
    };
    if r != 0 {
        return Err(RealtimeError::Refused {
            priority,
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn priorities_map_to_classes_and_bad_ones_are_named() {
        assert_eq!(
            SchedClass::from_priority(0).ok(),
            Some(SchedClass::TimeSharing)
        );
        assert_eq!(SchedClass::from_priority(1).ok(), Some(SchedClass::Fifo(1)));
        assert_eq!(
            SchedClass::from_priority(99).ok(),
            Some(SchedClass::Fifo(99))
        );
        let e = SchedClass::from_priority(100).expect_err("out of range");
        assert!(e.to_string().contains("100"), "{e}");
        assert!(apply(SchedClass::TimeSharing).is_ok());
    }
}
