//! The simulated GPU does not run on the container's CPUs. A real GPU goes on with the
//! work queued to it while the process that queued it is off the CPU, throttled by its
//! container's CPU limit or starved on a saturated node; here the device is the worker
//! thread of each process, which that limit would hold back with the process: a
//! throttled container's queued kernels would stop, its closed stream waits would not
//! see the word open (device-side gating, ADR 0034), and the unshared baseline of every
//! CPU-limited benchmark would be a GPU that stalls with its tenant's CPU. So each worker
//! thread leaves its process's `cpu` group for the hierarchy's root when it starts
//! (cgroup v1 places threads one by one; it needs the right to write the root's `tasks`,
//! which the benchmarks' and tests' CPU-limited containers have, being made by root).
//! `VGPU_SIM_DEVICE_CPU=inherit` keeps the worker in its process's group (the simulator
//! before 2026-11-29); `outside` (the default) says so when the worker cannot leave.
//! cgroup2 moves no single thread out of a container's group: there the worker stays.

use vgpu_core::cpu_cgroup::{find_cpu_controller, thread_escape};

/// What `VGPU_SIM_DEVICE_CPU` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Leave the process's group, silently where that is not possible (the default).
    Default,
    /// Leave it, and say so when that is not possible.
    Outside,
    /// Stay in the process's group.
    Inherit,
}

/// The mode a value of `VGPU_SIM_DEVICE_CPU` names (Err: the value, not one of them).
fn mode(value: Option<&str>) -> Result<Mode, String> {
    match value {
        None | Some("") => Ok(Mode::Default),
        Some("outside") => Ok(Mode::Outside),
        Some("inherit") => Ok(Mode::Inherit),
        Some(v) => Err(v.to_owned()),
    }
}

/// Moves the calling thread (a device worker) out of its process's CPU limit, as the
/// module says.
pub(super) fn leave_cpu_limit() {
    let value = std::env::var("VGPU_SIM_DEVICE_CPU").ok();
    let mode = mode(value.as_deref()).unwrap_or_else(|v| {
        eprintln!(
            "vgpu cuda-sim: VGPU_SIM_DEVICE_CPU={v:?} is not one of outside, inherit: the device worker leaves the process's CPU limit (the default)"
        );
        Mode::Default
    });
    if mode == Mode::Inherit {
        return;
    }
    if let Err(why) = escape()
        && mode == Mode::Outside
    {
        eprintln!(
            "vgpu cuda-sim: the device worker thread stays in its process's CPU limit: {why}"
        );
    }
}

fn escape() -> Result<(), String> {
    let ctl = find_cpu_controller()?;
    let own = std::fs::read_to_string("/proc/thread-self/cgroup")
        .ok()
        .and_then(|t| ctl.group_of(&t));
    let Some(tasks) = thread_escape(&ctl, own.as_deref())? else {
        return Ok(());
    };
    // SAFETY: gettid takes no argument and cannot fail.
    let tid = unsafe { libc::gettid() };
    std::fs::write(&tasks, tid.to_string()).map_err(|e| format!("{}: {e}", tasks.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mode_is_named_or_the_bad_value_is_returned() {
        assert_eq!(mode(None), Ok(Mode::Default));
        assert_eq!(mode(Some("")), Ok(Mode::Default));
        assert_eq!(mode(Some("outside")), Ok(Mode::Outside));
        assert_eq!(mode(Some("inherit")), Ok(Mode::Inherit));
        assert_eq!(mode(Some("Outside ")), Err("Outside ".to_owned()));
    }
}
