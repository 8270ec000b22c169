//! Containers' PID namespaces for the tests: whether this kernel lets an unprivileged
//! user make one (`unshare --user --map-root-user --pid --fork`), and who a process's
//! children are by the host's `/proc` (their host PIDs).

use std::process::{Command, Stdio};

/// Whether `unshare --user --map-root-user --pid --fork` works here, with a fresh `/proc`
/// (`--mount-proc`) when `mount_proc`.
pub fn unshare_allowed(mount_proc: bool) -> bool {
    let mut c = Command::new("unshare");
    c.args(["--user", "--map-root-user", "--pid", "--fork"]);
    if mount_proc {
        c.arg("--mount-proc");
    }
    c.arg("true")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// The children of process `pid`, by the host's `/proc`.
pub fn children(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}
