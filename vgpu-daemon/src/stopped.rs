//! How much of the time each tenant's container is stopped by its CPU limit: every
//! [`INTERVAL`] the daemon reads, for one process of each tenant, its `cpu` cgroup's
//! bandwidth statistics and quota (`cpu.stat`, `cpu.max` or `cpu.cfs_quota_us`; formats
//! and arithmetic in [`vgpu_core::cpu_cgroup`]), and those of the groups above it (a
//! pod's limit stops all its containers), and hands the part of the interval the
//! process was stopped ([`stopped_between`]) to the scheduler
//! ([`crate::arbiter::Event::Stopped`]), which co-holds tenants that cannot
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

use crate::arbiter::TenantId;
use crate::daemon::Daemon;

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

/// What the daemon reads of process `pid`'s group and the groups above it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reading {
    /// The group (first, always there), then each group above it below the hierarchy's
    /// root (a Kubernetes container's pod, its QoS class), those with bandwidth
    /// statistics.
    pub levels: Vec<Level>,
}

impl Reading {
    /// The process's own group's directory.
    pub fn group(&self) -> &Path {
        &self.levels[0].dir
    }
}

/// One group of a [`Reading`]: its directory, its bandwidth statistics, its quota and
/// its period, ns (None: none, or not readable).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Level {
    /// The group's directory.
    pub dir: PathBuf,
    /// Its `cpu.stat`.
    pub stat: Bandwidth,
    /// Its quota per period, ns.
    pub quota_ns: Option<u64>,
    /// Its CFS period, ns.
    pub period_ns: Option<u64>,
}

/// How much of the time a process was stopped by a CPU limit, and the CFS period of
/// the group that stopped it most (its stops are at most that long).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Stopped {
    /// The part of the time, 0..=1.
    pub part: f64,
    /// The period of the group it was read from, ns (None: not stopped, or unknown).
    pub period_ns: Option<u64>,
}

/// The part of the time between two readings of a process's groups that it spent
/// stopped: the most that any of its groups (its own, its pod's…) was throttled, each
/// by [`stopped_part`]. A throttled group stops every process below it, so each level
/// is a lower bound; the largest is taken (not their sum: their stops may overlap).
pub fn stopped_between(before: &Reading, after: &Reading) -> Stopped {
    after
        .levels
        .iter()
        .filter_map(|a| {
            let b = before.levels.iter().find(|b| b.dir == a.dir)?;
            Some(Stopped {
                part: stopped_part(b.stat, a.stat, a.quota_ns),
                period_ns: a.period_ns,
            })
        })
        .filter(|s| s.part > 0.0)
        .max_by(|x, y| x.part.total_cmp(&y.part))
        .unwrap_or_default()
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

/// [`read`] with procfs at `proc`: None when the process's own group has no readable
/// bandwidth statistics. Groups above it are read up to, not including, the
/// hierarchy's root, and only in the daemon's view of the hierarchy (a container's own
/// view, [`group_dir`], shows nothing above its group).
fn read_at(ctl: &CpuController, proc: &Path, pid: u32) -> Option<Reading> {
    let group = group_dir(ctl, proc, pid)?;
    let level = |dir: &Path| {
        let read = |file: &str| std::fs::read_to_string(dir.join(file)).ok();
        let stat = bandwidth(&read("cpu.stat")?)?;
        let quota = read(ctl.quota_file());
        // cgroup2 keeps both in `cpu.max`: read once.
        let period = if ctl.period_file() == ctl.quota_file() {
            quota.clone()
        } else {
            read(ctl.period_file())
        };
        let quota_ns = quota.and_then(|q| quota_ns(&q));
        let period_ns = period.and_then(|p| ctl.period_ns(&p));
        Some(Level {
            dir: dir.to_path_buf(),
            stat,
            quota_ns,
            period_ns,
        })
    };
    let mut levels = vec![level(&group)?];
    if group.starts_with(ctl.root()) {
        levels.extend(
            group
                .ancestors()
                .skip(1)
                .take_while(|d| *d != ctl.root() && d.starts_with(ctl.root()))
                .filter_map(level),
        );
    }
    Some(Reading { levels })
}

/// A tenant's last reading and its stopped part so far.
struct Last {
    reading: Reading,
    stopped: Stopped,
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
                    let stopped = match last
                        .get(&tid)
                        .filter(|l| l.reading.group() == reading.group())
                    {
                        Some(l) => {
                            let now = stopped_between(&l.reading, &reading);
                            Stopped {
                                part: NEWEST * now.part + (1.0 - NEWEST) * l.stopped.part,
                                period_ns: now.period_ns.or(l.stopped.period_ns),
                            }
                        }
                        None => Stopped::default(),
                    };
                    debug!(
                        tenant = tid,
                        pid,
                        stopped = stopped.part,
                        "container throttled part"
                    );
                    d.note_stopped(tid, stopped.part, stopped.period_ns);
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
        assert_eq!(r.group(), proc.path().join("4242/root/sys/fs/cgroup"));
        assert_eq!(r.levels.len(), 1, "nothing above a container's own view");
        assert_eq!(r.levels[0].stat.throttled_periods, 9);
        assert_eq!(r.levels[0].quota_ns, Some(20_000_000));
        assert_eq!(r.levels[0].period_ns, Some(100_000_000));
        // Not listed there (its namespace is not rooted at its group): not read.
        let other = fake_proc(4242, "0::/../../kubepods/pod1/c1\n", 77);
        assert_eq!(read_at(&v2, other.path(), 4242), None);
        // cgroup v1 has no such view.
        let v1 = CpuController::V1("/nonexistent-cpu".into());
        assert_eq!(read_at(&v1, proc.path(), 4242), None);
        // No such process.
        assert_eq!(read_at(&v2, proc.path(), 1), None);
    }

    /// Writes a v1 group at `dir` with `cpu.stat` figures and a quota (µs, -1: none).
    fn group(dir: &Path, periods: u64, throttled: u64, throttled_ms: u64, quota_us: i64) {
        std::fs::create_dir_all(dir).expect("mkdir");
        std::fs::write(
            dir.join("cpu.stat"),
            format!(
                "nr_periods {periods}\nnr_throttled {throttled}\nthrottled_time {}\n",
                throttled_ms * 1_000_000
            ),
        )
        .expect("write");
        std::fs::write(dir.join("cpu.cfs_quota_us"), format!("{quota_us}\n")).expect("write");
        std::fs::write(dir.join("cpu.cfs_period_us"), "100000\n").expect("write");
    }

    #[test]
    fn a_container_is_as_stopped_as_the_most_throttled_group_above_it() {
        let root = tempfile::tempdir().expect("tempdir");
        let v1 = CpuController::V1(root.path().to_path_buf());
        let proc = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir_all(proc.path().join("7")).expect("mkdir");
        std::fs::write(
            proc.path().join("7/cgroup"),
            "4:cpu,cpuacct:/kubepods/pod1/c1\n",
        )
        .expect("write");
        let (qos, pod, ctr) = (
            root.path().join("kubepods"),
            root.path().join("kubepods/pod1"),
            root.path().join("kubepods/pod1/c1"),
        );
        // The hierarchy's root is never read; the QoS group has no quota.
        group(root.path(), 0, 0, 0, -1);
        group(&qos, 0, 0, 0, -1);
        group(&pod, 0, 0, 0, 50_000);
        group(&ctr, 0, 0, 0, 20_000);
        let before = read_at(&v1, proc.path(), 7).expect("readable");
        assert_eq!(before.group(), ctr);
        let dirs: Vec<&Path> = before.levels.iter().map(|l| l.dir.as_path()).collect();
        assert_eq!(dirs, [ctr.as_path(), pod.as_path(), qos.as_path()]);
        // Ten periods: the container's own limit (0.2 CPU) throttled it in none; the
        // pod's (0.5 CPU, threads on two CPUs) in all, 75 ms stopped of each 100.
        group(&ctr, 10, 0, 0, 20_000);
        group(&pod, 10, 10, 1500, 50_000);
        let after = read_at(&v1, proc.path(), 7).expect("readable");
        let stopped = stopped_between(&before, &after);
        assert!((stopped.part - 0.75).abs() < 1e-9, "{stopped:?}");
        assert_eq!(stopped.period_ns, Some(100_000_000));
        // Ten more: its own limit stops it 90 % of each period (90 ms on each of two
        // CPUs, 1.8 s in all), more than the pod's: that is the figure.
        group(&ctr, 20, 10, 1800, 20_000);
        group(&pod, 20, 10, 1500, 50_000);
        let last = read_at(&v1, proc.path(), 7).expect("readable");
        let own = stopped_between(&after, &last).part;
        assert!((own - 0.9).abs() < 1e-9, "{own}");
        // A group that went between two readings is not compared.
        group(&ctr, 30, 10, 1800, 20_000);
        std::fs::remove_file(pod.join("cpu.stat")).expect("rm");
        let gone = read_at(&v1, proc.path(), 7).expect("readable");
        assert_eq!(gone.levels.len(), 2);
        assert_eq!(stopped_between(&last, &gone), Stopped::default());
    }
}
