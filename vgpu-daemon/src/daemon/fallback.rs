//! Processes in local fallback, as the daemon sees them: a registered process whose
//! connection closed while it still runs has a shim that now enforces its share on its
//! own (ADR 0013: a tenant in fallback is never silent). The daemon says so once, when
//! the connection closes, and counts it (`vgpu_container_processes_in_fallback`) until
//! the process registers again or exits.

use std::collections::BTreeMap;

use tracing::warn;

use super::{Daemon, Inner};

/// Most processes remembered in fallback (the oldest make room).
const MAX_DETACHED: usize = 4096;

/// A process whose connection closed while it ran.
#[derive(Debug, Clone)]
pub(super) struct Detached {
    /// Tenant key of the container.
    key: String,
    /// Its start time (`/proc/PID/stat` field 22), which names it with the PID.
    start_ticks: u64,
}

/// A process whose connection closed as it exited (or after, in fallback).
#[derive(Debug, Clone)]
pub(super) struct Exited {
    /// Host PID.
    pub(super) pid: u32,
    /// Tenant key of the container.
    pub(super) key: String,
    /// When it was seen exiting (mono ns).
    pub(super) at: u64,
    /// Its start time, if it was still there (exiting, a zombie).
    pub(super) start_ticks: Option<u64>,
}

/// `PF_EXITING` in `/proc/PID/stat`'s flags: the process is exiting (its files, the
/// socket among them, close before it becomes a zombie).
const PF_EXITING: u64 = 0x4;

/// From the text of `/proc/PID/stat`: the process's start time and whether it runs
/// (false: a zombie, a dead or an exiting process). None: not a stat line.
fn stat_start_ticks(stat: &str) -> Option<(u64, bool)> {
    // The command name (field 2) may hold spaces and parentheses: fields start after
    // the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // f[0] is field 3 (state), f[6] field 9 (flags), f[19] field 22 (start time).
    let state = *f.first()?;
    let flags: u64 = f.get(6)?.parse().ok()?;
    let start: u64 = f.get(19)?.parse().ok()?;
    let runs = !matches!(state, "Z" | "X" | "x") && flags & PF_EXITING == 0;
    Some((start, runs))
}

/// From the text of `/proc/PID/stat`: the start time of a process that runs (None: a
/// zombie, a dead or an exiting process, or text that is not a stat line).
pub(crate) fn running_start_ticks(stat: &str) -> Option<u64> {
    stat_start_ticks(stat).and_then(|(start, runs)| runs.then_some(start))
}

fn stat_of(pid: u32) -> Option<String> {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()
}

fn running(pid: u32) -> Option<u64> {
    running_start_ticks(&stat_of(pid)?)
}

/// The start time of process `pid`, running, exiting or a zombie (None: no such
/// process).
pub(super) fn start_of(pid: u32) -> Option<u64> {
    stat_start_ticks(&stat_of(pid)?).map(|(start, _)| start)
}

/// Whether an exited process's PID still names it: no process has the PID now, or the
/// one that has it started when it did (still exiting). A process that started since
/// took the PID over: its GPU memory is not the exited tenant's. `recorded`: the exited
/// process's start time when it was seen exiting (None: already gone then).
pub(super) fn still_the_exited(recorded: Option<u64>, now: Option<u64>) -> bool {
    now.is_none() || now == recorded
}

impl Daemon {
    /// A registered process's connection closed: if the process still runs and holds no
    /// other connection, it is in fallback from now on (said once, counted until it
    /// registers again or exits). A process that registered again before its old
    /// connection's close was seen (both queued while the daemon was stopped or busy) is
    /// not in fallback.
    ///
    /// Returns whether the process still runs (false: it is exiting or gone).
    pub(super) fn note_detached(g: &mut Inner, pid: u32, key: &str) -> bool {
        if g.conns.values().any(|c| c.pid == pid) {
            return true;
        }
        let Some(start_ticks) = running(pid) else {
            return false;
        };
        warn!(
            tenant = %key,
            pid,
            "a running process lost its connection to the daemon: its shim enforces the container's share locally (fallback) until it registers again"
        );
        if g.detached.len() >= MAX_DETACHED
            && let Some(&oldest) = g.detached.keys().next()
        {
            g.detached.remove(&oldest);
        }
        g.detached.insert(
            pid,
            Detached {
                key: key.to_owned(),
                start_ticks,
            },
        );
        true
    }

    /// Forgets the processes in fallback that exited (at `now`, mono ns): they join the
    /// exited ones, their tenant's for [`EXIT_GRACE_NS`](super::EXIT_GRACE_NS) more.
    pub(super) fn prune_detached(g: &mut Inner, now: u64) {
        let gone: Vec<u32> = g
            .detached
            .iter()
            .filter(|(pid, d)| running(**pid) != Some(d.start_ticks))
            .map(|(pid, _)| *pid)
            .collect();
        for pid in gone {
            if let Some(d) = g.detached.remove(&pid) {
                Daemon::note_exited(g, pid, d.key, now, Some(d.start_ticks));
            }
        }
    }

    /// (host PID, tenant key) of the processes in fallback (their shims enforce the
    /// share: not bypasses); call [`Daemon::prune_detached`] first.
    pub(super) fn detached_pids(g: &Inner) -> impl Iterator<Item = (u32, String)> + '_ {
        g.detached.iter().map(|(pid, d)| (*pid, d.key.clone()))
    }

    /// Processes in fallback per tenant key; forgets those that exited.
    pub(super) fn in_fallback(g: &mut Inner, now: u64) -> BTreeMap<String, u64> {
        Daemon::prune_detached(g, now);
        let mut out = BTreeMap::new();
        for d in g.detached.values() {
            *out.entry(d.key.clone()).or_insert(0) += 1;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_running_process_has_a_start_time_an_exiting_or_dead_one_none() {
        // Field 22 is 4242; the name holds a space and a parenthesis.
        let line = |state: &str, flags: u64| {
            format!(
                "77 (cuda (probe) x) {state} 1 77 77 0 -1 {flags} 0 0 0 0 3 4 0 0 20 0 5 0 4242 1000 100"
            )
        };
        assert_eq!(running_start_ticks(&line("R", 0x400040)), Some(4242));
        assert_eq!(running_start_ticks(&line("S", 0x400000)), Some(4242));
        assert_eq!(running_start_ticks(&line("R", 0x400044)), None, "exiting");
        assert_eq!(running_start_ticks(&line("Z", 0x400000)), None, "zombie");
        assert_eq!(running_start_ticks("garbage"), None);
    }

    #[test]
    fn this_process_runs() {
        let me = std::process::id();
        assert!(running(me).is_some());
        assert_eq!(start_of(me), running(me));
        assert!(running(u32::MAX / 2).is_none());
        assert!(start_of(u32::MAX / 2).is_none());
    }

    #[test]
    fn an_exiting_process_has_a_start_time_and_a_reused_pid_is_not_the_exited_process() {
        let line = |state: &str, flags: u64, start: u64| {
            format!("77 (a) {state} 1 77 77 0 -1 {flags} 0 0 0 0 3 4 0 0 20 0 5 0 {start} 1 1")
        };
        assert_eq!(stat_start_ticks(&line("R", 0x400044, 9)), Some((9, false)));
        assert_eq!(stat_start_ticks(&line("Z", 0, 9)), Some((9, false)));
        assert_eq!(stat_start_ticks(&line("S", 0, 9)), Some((9, true)));
        // Gone since: still the exited process's (NVML may list it a while).
        assert!(still_the_exited(Some(9), None));
        assert!(still_the_exited(None, None));
        // Still exiting: the same start time.
        assert!(still_the_exited(Some(9), Some(9)));
        // Another process took the PID over.
        assert!(!still_the_exited(Some(9), Some(12)));
        assert!(!still_the_exited(None, Some(12)));
    }
}
