//! How much of the time each tenant's container is stopped by its CPU limit: every
//! [`INTERVAL`] the daemon reads, for one process of each tenant, its `cpu` cgroup's
//! bandwidth statistics and quota (`cpu.stat`, `cpu.max` or `cpu.cfs_quota_us`; formats
//! and arithmetic in [`vgpu_core::cpu_cgroup`]) and hands the part of the interval the
//! group spent stopped ([`vgpu_core::cpu_cgroup::stopped_part`]) to the scheduler
//! ([`crate::time_slicing::Scheduler::note_stopped`]), which co-holds tenants that cannot
//! fill the GPU (ADR 0029). The kernel's figure, not the tenant's: a container cannot
//! make itself look stopped. A group the daemon cannot see (another cgroup namespace, no
//! `cpu` controller, no bandwidth statistics) reads as never stopped.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tracing::{debug, info};
use vgpu_core::cpu_cgroup::{
    Bandwidth, CpuController, bandwidth, choose_cpu_controller, quota_ns, stopped_part,
};

use crate::daemon::Daemon;
use crate::time_slicing::TenantId;

/// How often the groups are read.
pub const INTERVAL: Duration = Duration::from_millis(250);

/// Weight of the newest interval in a tenant's stopped part (the rest is the past's).
const NEWEST: f64 = 0.5;

/// The `cpu` controller as the daemon's `/proc/self/mounts` shows it.
pub fn find_controller() -> Result<CpuController, String> {
    let mounts = std::fs::read_to_string("/proc/self/mounts")
        .map_err(|e| format!("cannot read /proc/self/mounts: {e}"))?;
    choose_cpu_controller(&mounts, |root| {
        std::fs::read_to_string(root.join("cgroup.controllers")).ok()
    })
}

/// What the daemon reads of process `pid`'s group: its directory, its bandwidth
/// statistics and its quota per period, ns (None: none).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reading {
    /// The group's directory.
    pub group: PathBuf,
    /// Its `cpu.stat`.
    pub stat: Bandwidth,
    /// Its quota per period, ns.
    pub quota_ns: Option<u64>,
}

/// Reads process `pid`'s group (None: not readable, or no bandwidth statistics).
pub fn read(ctl: &CpuController, pid: u32) -> Option<Reading> {
    read_at(ctl, Path::new("/proc"), pid)
}

/// Process `pid`'s group directory, `proc` being procfs: in the daemon's view of the
/// hierarchy; or, when the daemon is in a cgroup namespace of its own (a pod's, on
/// cgroup2) and sees the group as `/../…`, in the process's own view,
/// `/proc/PID/root/sys/fs/cgroup`, which is its group when its namespace is rooted there
/// (a container's is): taken only if the group's `cgroup.procs` lists the process.
fn group_dir(ctl: &CpuController, proc: &Path, pid: u32) -> Option<PathBuf> {
    let text = std::fs::read_to_string(proc.join(format!("{pid}/cgroup"))).ok()?;
    if let Some(g) = ctl.group_of(&text) {
        return Some(g);
    }
    if !matches!(ctl, CpuController::V2(_)) {
        return None;
    }
    let own = proc.join(format!("{pid}/root/sys/fs/cgroup"));
    let procs = std::fs::read_to_string(own.join("cgroup.procs")).ok()?;
    let me = pid.to_string();
    procs.split_whitespace().any(|p| p == me).then_some(own)
}

/// [`read`] with procfs at `proc`.
fn read_at(ctl: &CpuController, proc: &Path, pid: u32) -> Option<Reading> {
    let group = group_dir(ctl, proc, pid)?;
    let stat = bandwidth(&std::fs::read_to_string(group.join("cpu.stat")).ok()?)?;
    let quota_ns = std::fs::read_to_string(group.join(ctl.quota_file()))
        .ok()
        .and_then(|q| quota_ns(&q));
    Some(Reading {
        group,
        stat,
        quota_ns,
    })
}

/// A tenant's last reading and its stopped part so far.
struct Last {
    reading: Reading,
    stopped: f64,
}

/// Starts the thread that reads the tenants' groups (nothing when the node has no `cpu`
/// controller: said once).
pub fn spawn(daemon: &Arc<Daemon>) -> Option<std::thread::JoinHandle<()>> {
    let ctl = match find_controller() {
        Ok(c) => c,
        Err(why) => {
            info!("tenants' CPU throttling not read ({why}): no tenant counts as stopped");
            return None;
        }
    };
    let d = Arc::clone(daemon);
    std::thread::Builder::new()
        .name("vgpu-stopped".into())
        .spawn(move || {
            let mut last: HashMap<TenantId, Last> = HashMap::new();
            loop {
                std::thread::sleep(INTERVAL);
                let tenants = d.tenant_pids();
                last.retain(|t, _| tenants.iter().any(|(id, _)| id == t));
                for (tid, pid) in tenants {
                    let Some(reading) = read(&ctl, pid) else {
                        continue;
                    };
                    let stopped = match last.get(&tid).filter(|l| l.reading.group == reading.group)
                    {
                        Some(l) => {
                            let f = stopped_part(l.reading.stat, reading.stat, reading.quota_ns);
                            NEWEST * f + (1.0 - NEWEST) * l.stopped
                        }
                        None => 0.0,
                    };
                    debug!(tenant = tid, pid, stopped, "container throttled part");
                    d.note_stopped(tid, stopped);
                    last.insert(tid, Last { reading, stopped });
                }
            }
        })
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake procfs: process `pid` whose `/proc/PID/cgroup` says `line`, with the
    /// group its own namespace sees (listing `listed`) holding `cpu.stat` and `cpu.max`.
    fn fake_proc(pid: u32, line: &str, listed: u32) -> tempfile::TempDir {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join(pid.to_string());
        let own = p.join("root/sys/fs/cgroup");
        std::fs::create_dir_all(&own).expect("mkdir");
        std::fs::write(p.join("cgroup"), line).expect("write");
        std::fs::write(own.join("cgroup.procs"), format!("1\n{listed}\n")).expect("write");
        std::fs::write(
            own.join("cpu.stat"),
            "usage_usec 9\nnr_periods 10\nnr_throttled 9\nthrottled_usec 900000\n",
        )
        .expect("write");
        std::fs::write(own.join("cpu.max"), "20000 100000\n").expect("write");
        dir
    }

    #[test]
    fn a_group_outside_the_daemons_namespace_is_read_through_the_process_root() {
        let v2 = CpuController::V2("/nonexistent-cgroup2".into());
        let proc = fake_proc(4242, "0::/../../kubepods/pod1/c1\n", 4242);
        let r = read_at(&v2, proc.path(), 4242).expect("read through its root");
        assert_eq!(r.group, proc.path().join("4242/root/sys/fs/cgroup"));
        assert_eq!(r.stat.throttled_periods, 9);
        assert_eq!(r.quota_ns, Some(20_000_000));
        // Not listed there (its namespace is not rooted at its group): not read.
        let other = fake_proc(4242, "0::/../../kubepods/pod1/c1\n", 77);
        assert_eq!(read_at(&v2, other.path(), 4242), None);
        // cgroup v1 has no such view.
        let v1 = CpuController::V1("/nonexistent-cpu".into());
        assert_eq!(read_at(&v1, proc.path(), 4242), None);
        // No such process.
        assert_eq!(read_at(&v2, proc.path(), 1), None);
    }
}
