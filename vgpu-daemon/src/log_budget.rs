//! A bound on the warning lines that clients can make the daemon write. Tenants are not
//! trusted and may open connections in a loop: each refused registration, garbage first
//! frame or protocol error was one `WARN` line (6,870 lines for 6,000 `Hello`s naming
//! made-up container keys, stop 37). Past [`CLIENT_WARNINGS_PER_WINDOW`] in a window of
//! [`CLIENT_WARNING_WINDOW`], such lines go to the debug level, and the first line of the
//! next window says how many were held back. What is counted per container (refusals,
//! fallbacks) is unchanged and stays visible in `vgpuctl health`.

use std::sync::Mutex;
use std::time::Duration;

use tracing::warn;

/// Warning lines about clients per window at most.
pub const CLIENT_WARNINGS_PER_WINDOW: u32 = 20;
/// The window.
pub const CLIENT_WARNING_WINDOW: Duration = Duration::from_secs(10);

/// A count of lines per window (pure: the caller passes the clock).
#[derive(Debug, Clone)]
pub struct LogBudget {
    window_ns: u64,
    per_window: u32,
    start_ns: Option<u64>,
    used: u32,
    held_back: u64,
}

/// Whether a line may be written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogVerdict {
    /// Write it; `held_back` lines of the window before were not written (say so first).
    Write {
        /// Lines held back in the previous window.
        held_back: u64,
    },
    /// Over the budget: write it at the debug level only.
    HoldBack,
}

impl LogBudget {
    /// `per_window` lines per `window`.
    pub const fn new(window: Duration, per_window: u32) -> LogBudget {
        LogBudget {
            window_ns: window.as_nanos() as u64,
            per_window,
            start_ns: None,
            used: 0,
            held_back: 0,
        }
    }

    /// A line is due at `now_ns` (monotonic).
    pub fn admit(&mut self, now_ns: u64) -> LogVerdict {
        let fresh = self
            .start_ns
            .is_none_or(|s| now_ns.saturating_sub(s) >= self.window_ns);
        if fresh {
            let held_back = std::mem::take(&mut self.held_back);
            self.start_ns = Some(now_ns);
            self.used = 1;
            return LogVerdict::Write { held_back };
        }
        if self.used < self.per_window {
            self.used += 1;
            LogVerdict::Write { held_back: 0 }
        } else {
            self.held_back += 1;
            LogVerdict::HoldBack
        }
    }
}

static CLIENTS: Mutex<LogBudget> = Mutex::new(LogBudget::new(
    CLIENT_WARNING_WINDOW,
    CLIENT_WARNINGS_PER_WINDOW,
));

/// Whether a warning about a client may be written now (else the caller logs it at the
/// debug level); says first how many the last window held back.
pub fn client_warning() -> bool {
    let verdict = CLIENTS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .admit(vgpu_sys::mono_ns());
    match verdict {
        LogVerdict::Write { held_back } => {
            if held_back > 0 {
                warn!(
                    held_back,
                    "{held_back} more warnings about clients were logged at the debug level only in the last window (at most {CLIENT_WARNINGS_PER_WINDOW} per {CLIENT_WARNING_WINDOW:?})"
                );
            }
            true
        }
        LogVerdict::HoldBack => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_past_the_budget_are_held_back_and_counted_in_the_next_window() {
        let mut b = LogBudget::new(Duration::from_secs(10), 3);
        let s = 1_000_000_000;
        assert_eq!(b.admit(s), LogVerdict::Write { held_back: 0 });
        assert_eq!(b.admit(s + 1), LogVerdict::Write { held_back: 0 });
        assert_eq!(b.admit(s + 2), LogVerdict::Write { held_back: 0 });
        for k in 0..1000 {
            assert_eq!(b.admit(s + 3 + k), LogVerdict::HoldBack);
        }
        // The next window's first line carries the count, once.
        let next = s + 10_000_000_000;
        assert_eq!(b.admit(next), LogVerdict::Write { held_back: 1000 });
        assert_eq!(b.admit(next + 1), LogVerdict::Write { held_back: 0 });
    }

    #[test]
    fn a_quiet_window_resets_nothing_it_did_not_hold_back() {
        let mut b = LogBudget::new(Duration::from_secs(1), 1);
        assert_eq!(b.admit(5), LogVerdict::Write { held_back: 0 });
        assert_eq!(b.admit(2_000_000_000), LogVerdict::Write { held_back: 0 });
        assert_eq!(b.admit(2_000_000_001), LogVerdict::HoldBack);
        assert_eq!(b.admit(9_000_000_000), LogVerdict::Write { held_back: 1 });
    }
}
