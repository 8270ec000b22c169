//! Processes in local fallback, as the daemon sees them: a registered process whose
//! connection closed while it still runs has a shim that now enforces its share on its
//! own (ADR 0013: a tenant in fallback is never silent). The daemon says so once, when
//! the connection closes, and counts it (`vgpu_container_processes_in_fallback`) until
//! the process registers again or exits.

use super::*;

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

/// `PF_EXITING` in `/proc/PID/stat`'s flags: the process is exiting (its files, the
/// socket among them, close before it becomes a zombie).
const PF_EXITING: u64 = 0x4;

/// From the text of `/proc/PID/stat`: the start time of a process that runs (None: a
/// zombie, a dead or an exiting process, or text that is not a stat line).
pub(crate) fn running_start_ticks(stat: &str) -> Option<u64> {
    // The command name (field 2) may hold spaces and parentheses: fields start after
    // the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // f[0] is field 3 (state), f[6] field 9 (flags), f[19] field 22 (start time).
    let state = *f.first()?;
    let flags: u64 = f.get(6)?.parse().ok()?;
    let start: u64 = f.get(19)?.parse().ok()?;
    if matches!(state, "Z" | "X" | "x") || flags & PF_EXITING != 0 {
        return None;
    }
    Some(start)
}

fn running(pid: u32) -> Option<u64> {
    running_start_ticks(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
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
    /// exited ones, their tenant's for [`EXIT_GRACE_NS`] more.
    pub(super) fn prune_detached(g: &mut Inner, now: u64) {
        let gone: Vec<u32> = g
            .detached
            .iter()
            .filter(|(pid, d)| running(**pid) != Some(d.start_ticks))
            .map(|(pid, _)| *pid)
            .collect();
        for pid in gone {
            if let Some(d) = g.detached.remove(&pid) {
                Daemon::note_exited(g, pid, d.key, now);
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
        assert!(running(std::process::id()).is_some());
        assert!(running(u32::MAX / 2).is_none());
    }
}
