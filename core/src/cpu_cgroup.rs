//! A process's `cpu` cgroup and how long the kernel held it back: where the `cpu`
//! controller is mounted (cgroup2, or a v1 hierarchy), the process's group in it (from
//! `/proc/<pid>/cgroup`), its quota, and how much of the time its CFS bandwidth limit
//! (a container's CPU limit) kept it stopped (`cpu.stat`). The one reader of those formats: the daemon learns
//! from it which tenants are stopped most of the time (ADR 0029), the tests' CPU-limited
//! containers where to make their groups.

use std::path::{Path, PathBuf};

/// Where the `cpu` controller is, and which interface it has.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CpuController {
    /// cgroup2: `cpu.max` and `cpu.stat` in a directory under this mount, whose
    /// `cgroup.controllers` lists `cpu`.
    V2(PathBuf),
    /// cgroup v1: `cpu.cfs_period_us` / `cpu.cfs_quota_us` / `cpu.stat` under this mount.
    V1(PathBuf),
}

impl CpuController {
    /// The hierarchy's root directory.
    pub fn root(&self) -> &Path {
        match self {
            CpuController::V2(p) | CpuController::V1(p) => p,
        }
    }

    /// The file of a group's CPU quota ([`quota_ns`] reads it).
    pub fn quota_file(&self) -> &'static str {
        match self {
            CpuController::V2(_) => "cpu.max",
            CpuController::V1(_) => "cpu.cfs_quota_us",
        }
    }

    /// The file of a group's CFS period ([`CpuController::period_ns`] reads it).
    pub fn period_file(&self) -> &'static str {
        match self {
            CpuController::V2(_) => "cpu.max",
            CpuController::V1(_) => "cpu.cfs_period_us",
        }
    }

    /// A group's CFS period, ns, from the text of its [`CpuController::period_file`]:
    /// cgroup2's `cpu.max` second field (`"20000 100000"`), v1's `cpu.cfs_period_us`.
    /// None: unreadable or 0.
    pub fn period_ns(&self, text: &str) -> Option<u64> {
        let field = match self {
            CpuController::V2(_) => 1,
            CpuController::V1(_) => 0,
        };
        let us: u64 = text.split_whitespace().nth(field)?.parse().ok()?;
        (us > 0).then(|| us.saturating_mul(1000))
    }

    /// The directory of the group a `/proc/<pid>/cgroup` text puts the process in, in
    /// this hierarchy (None: no line for it, or a path outside this mount's view, as a
    /// reader in another cgroup namespace sees it: `/..`).
    pub fn group_of(&self, proc_cgroup: &str) -> Option<PathBuf> {
        let path = proc_cgroup.lines().find_map(|line| {
            let mut f = line.splitn(3, ':');
            let (id, controllers, path) = (f.next()?, f.next()?, f.next()?);
            let ours = match self {
                CpuController::V2(_) => id == "0" && controllers.is_empty(),
                CpuController::V1(_) => controllers.split(',').any(|c| c == "cpu"),
            };
            ours.then_some(path)
        })?;
        if !path.starts_with('/') || path.split('/').any(|p| p == "..") {
            return None;
        }
        Some(self.root().join(path.trim_start_matches('/')))
    }
}

/// Which `cpu` controller the text of `/proc/self/mounts` offers: cgroup2 when its root
/// offers `cpu` (a pure cgroup2 node; `controllers(root)` reads a cgroup2 root's
/// `cgroup.controllers`), else the v1 hierarchy that holds `cpu` (a hybrid node's v1
/// controllers take precedence: a controller is in one hierarchy only).
pub fn choose_cpu_controller(
    mounts: &str,
    controllers: impl Fn(&Path) -> Option<String>,
) -> Result<CpuController, String> {
    let mut v1 = None;
    let mut v2_roots = Vec::new();
    for line in mounts.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        let [_, dir, fstype, opts, ..] = f.as_slice() else {
            continue;
        };
        match *fstype {
            "cgroup2" => v2_roots.push(PathBuf::from(dir)),
            "cgroup" if opts.split(',').any(|o| o == "cpu") => {
                v1.get_or_insert_with(|| PathBuf::from(dir));
            }
            _ => {}
        }
    }
    for root in &v2_roots {
        if controllers(root).is_some_and(|c| c.split_whitespace().any(|x| x == "cpu")) {
            return Ok(CpuController::V2(root.clone()));
        }
    }
    v1.map(CpuController::V1).ok_or_else(|| {
        if v2_roots.is_empty() {
            "no cgroup mount offers the cpu controller".to_owned()
        } else {
            format!(
                "the cpu controller is not available in cgroup2 at {} and no v1 hierarchy holds it",
                v2_roots
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        }
    })
}

/// Finds the `cpu` controller from `/proc/self/mounts` ([`choose_cpu_controller`]).
pub fn find_cpu_controller() -> Result<CpuController, String> {
    let mounts = std::fs::read_to_string("/proc/self/mounts")
        .map_err(|e| format!("cannot read /proc/self/mounts: {e}"))?;
    choose_cpu_controller(&mounts, |root| {
        std::fs::read_to_string(root.join("cgroup.controllers")).ok()
    })
}

/// Where a thread writes its id to leave its process's `cpu` group for the hierarchy's
/// root, out of the group's CPU limit (`own`: the process's group, from
/// [`CpuController::group_of`]). `Ok(None)`: already at the root, nothing to do. A v1
/// hierarchy places threads one by one (`tasks`); cgroup2 moves a thread out of its
/// process's group only within a threaded subtree, which a container's group is not.
pub fn thread_escape(ctl: &CpuController, own: Option<&Path>) -> Result<Option<PathBuf>, String> {
    match ctl {
        CpuController::V2(_) => {
            Err("cgroup2 moves no single thread out of its process's group".to_owned())
        }
        CpuController::V1(root) => match own {
            None => Err(format!(
                "the process's group in the cpu hierarchy at {} is not known",
                root.display()
            )),
            Some(g) if g == root.as_path() => Ok(None),
            Some(_) => Ok(Some(root.join("tasks"))),
        },
    }
}

/// A group's CFS bandwidth statistics (`cpu.stat`, cgroup2 or v1).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Bandwidth {
    /// Enforcement periods that have elapsed (`nr_periods`).
    pub periods: u64,
    /// Periods in which the group was throttled (`nr_throttled`).
    pub throttled_periods: u64,
    /// Throttled time summed over the group's per-CPU queues, ns (`throttled_usec` on
    /// cgroup2, `throttled_time` on v1): a group throttled for 80 ms with threads queued
    /// on three CPUs adds 240 ms.
    pub throttled_ns: u64,
}

/// Reads a group's `cpu.stat` (None: no bandwidth statistics in it).
pub fn bandwidth(cpu_stat: &str) -> Option<Bandwidth> {
    let mut b = Bandwidth::default();
    let (mut periods, mut throttled) = (false, false);
    for line in cpu_stat.lines() {
        let Some((key, value)) = line.split_once(' ') else {
            continue;
        };
        let Ok(v) = value.trim().parse::<u64>() else {
            continue;
        };
        match key {
            "nr_periods" => {
                b.periods = v;
                periods = true;
            }
            "nr_throttled" => b.throttled_periods = v,
            "throttled_usec" => {
                b.throttled_ns = v.saturating_mul(1000);
                throttled = true;
            }
            "throttled_time" => {
                b.throttled_ns = v;
                throttled = true;
            }
            _ => {}
        }
    }
    (periods && throttled).then_some(b)
}

/// A group's CPU quota per period, ns, from cgroup2's `cpu.max` (`"max 100000"`: none) or
/// v1's `cpu.cfs_quota_us` (`-1`: none). None: no quota.
pub fn quota_ns(text: &str) -> Option<u64> {
    let first = text.split_whitespace().next()?;
    let us: i64 = first.parse().ok()?;
    u64::try_from(us).ok().filter(|q| *q > 0).map(|q| q * 1000)
}

/// The part of the wall time between two readings of a group's statistics that the group
/// spent stopped by its quota, 0..=1. In a throttled period the group ran its whole
/// quota `q` on `k` CPUs for `q / k` of wall time and was then stopped on the same `k`
/// CPUs, adding `k` times its stopped time to the throttled sum; so that period's stopped
/// part is `throttled / (throttled + q)`, whatever `k`. Unthrottled periods count as
/// running. 0 when no period elapsed, a counter went back (a new group) or there is no
/// quota.
pub fn stopped_part(before: Bandwidth, after: Bandwidth, quota_ns: Option<u64>) -> f64 {
    let (Some(q), Some(periods)) = (quota_ns, after.periods.checked_sub(before.periods)) else {
        return 0.0;
    };
    let (Some(n), Some(thr)) = (
        after
            .throttled_periods
            .checked_sub(before.throttled_periods),
        after.throttled_ns.checked_sub(before.throttled_ns),
    ) else {
        return 0.0;
    };
    if periods == 0 || n == 0 {
        return 0.0;
    }
    let n = n.min(periods);
    let in_throttled = thr as f64 / (thr as f64 + n as f64 * q as f64);
    (in_throttled * n as f64 / periods as f64).clamp(0.0, 1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_leaves_a_v1_group_through_the_roots_tasks_file() {
        let v1 = CpuController::V1(PathBuf::from("/sys/fs/cgroup/cpu"));
        let limited = v1.group_of("3:cpu,cpuacct:/kubepods/pod1/c1\n");
        assert_eq!(
            thread_escape(&v1, limited.as_deref()),
            Ok(Some(PathBuf::from("/sys/fs/cgroup/cpu/tasks")))
        );
        let at_root = v1.group_of("3:cpu,cpuacct:/\n");
        assert_eq!(thread_escape(&v1, at_root.as_deref()), Ok(None));
        assert!(
            thread_escape(&v1, None)
                .unwrap_err()
                .contains("/sys/fs/cgroup/cpu")
        );
        let v2 = CpuController::V2(PathBuf::from("/sys/fs/cgroup"));
        let g = v2.group_of("0::/kubepods/pod1/c1\n");
        assert!(
            thread_escape(&v2, g.as_deref())
                .unwrap_err()
                .contains("cgroup2")
        );
    }

    const HYBRID: &str = "\
tmpfs /sys/fs/cgroup tmpfs rw,relatime,mode=755 0 0
cgroup2 /sys/fs/cgroup/unified cgroup2 rw,nosuid,nodev,noexec,relatime 0 0
cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0
cgroup /sys/fs/cgroup/cpuacct cgroup rw,relatime,cpuacct 0 0
";
    const PURE_V2: &str = "cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid,nodev,noexec,relatime 0 0\n";

    #[test]
    fn a_pure_cgroup2_node_uses_cpu_max_and_a_hybrid_one_its_v1_cpu_hierarchy() {
        let v2 = |_: &Path| Some("cpuset cpu io memory pids".to_owned());
        assert_eq!(
            choose_cpu_controller(PURE_V2, v2),
            Ok(CpuController::V2("/sys/fs/cgroup".into()))
        );
        // Hybrid: the unified hierarchy offers no controller, v1 holds cpu.
        assert_eq!(
            choose_cpu_controller(HYBRID, |_| Some(String::new())),
            Ok(CpuController::V1("/sys/fs/cgroup/cpu".into()))
        );
        // `cpuacct` alone is not `cpu`.
        let only_acct = "cgroup /sys/fs/cgroup/cpuacct cgroup rw,relatime,cpuacct 0 0\n";
        assert!(choose_cpu_controller(only_acct, |_| None).is_err());
        let err = choose_cpu_controller(PURE_V2, |_| Some("memory pids".into()))
            .expect_err("no cpu controller");
        assert!(err.contains("/sys/fs/cgroup"), "{err}");
        // A v1 mount that co-mounts cpu and cpuacct holds cpu.
        let comount = "cgroup /sys/fs/cgroup/cpu,cpuacct cgroup rw,cpu,cpuacct 0 0\n";
        assert_eq!(
            choose_cpu_controller(comount, |_| None),
            Ok(CpuController::V1("/sys/fs/cgroup/cpu,cpuacct".into()))
        );
    }

    #[test]
    fn a_process_group_is_read_from_its_proc_cgroup_line() {
        let v1 = CpuController::V1("/sys/fs/cgroup/cpu,cpuacct".into());
        let text = "12:memory:/kubepods/pod1/abc\n4:cpu,cpuacct:/kubepods/pod1/abc\n0::/x\n";
        assert_eq!(
            v1.group_of(text),
            Some("/sys/fs/cgroup/cpu,cpuacct/kubepods/pod1/abc".into())
        );
        let v2 = CpuController::V2("/sys/fs/cgroup".into());
        assert_eq!(v2.group_of(text), Some("/sys/fs/cgroup/x".into()));
        assert_eq!(
            v2.group_of("0::/../../kubepods/a\n"),
            None,
            "another namespace"
        );
        assert_eq!(v2.group_of("garbage"), None);
        assert_eq!(v1.group_of("0::/x\n"), None);
    }

    #[test]
    fn bandwidth_statistics_are_read_in_either_unit() {
        let v2 = "usage_usec 100\nnr_periods 10\nnr_throttled 9\nthrottled_usec 81000\n";
        let b = Bandwidth {
            periods: 10,
            throttled_periods: 9,
            throttled_ns: 81_000_000,
        };
        assert_eq!(bandwidth(v2), Some(b));
        let v1 = "nr_periods 10\nnr_throttled 9\nthrottled_time 81000000\n";
        assert_eq!(bandwidth(v1), Some(b));
        assert_eq!(bandwidth("usage_usec 5\n"), None, "no bandwidth statistics");
        assert_eq!(bandwidth("nr_periods x\nthrottled_usec 1\n"), None);
        assert_eq!(quota_ns("20000 100000\n"), Some(20_000_000));
        assert_eq!(quota_ns("max 100000\n"), None);
        assert_eq!(quota_ns("-1\n"), None);
        assert_eq!(quota_ns("garbage"), None);
        let (v2, v1) = (
            CpuController::V2("/sys/fs/cgroup".into()),
            CpuController::V1("/sys/fs/cgroup/cpu".into()),
        );
        assert_eq!(v2.period_ns("20000 100000\n"), Some(100_000_000));
        assert_eq!(v2.period_ns("max 50000\n"), Some(50_000_000));
        assert_eq!(v1.period_ns("100000\n"), Some(100_000_000));
        assert_eq!(v2.period_ns("20000\n"), None);
        assert_eq!(v1.period_ns("0\n"), None);
        assert_eq!(v1.period_ns("-5\n"), None);
    }

    #[test]
    fn the_stopped_part_does_not_depend_on_how_many_cpus_the_group_ran_on() {
        let q = 50_000_000; // 0.5 CPU per 100 ms period
        let at = |periods, n, thr_ms: u64| Bandwidth {
            periods,
            throttled_periods: n,
            throttled_ns: thr_ms * 1_000_000,
        };
        // Three threads on three CPUs: the quota spent in 16.7 ms, stopped 83.3 ms on
        // each of the three CPUs, ten periods.
        let three = stopped_part(at(0, 0, 0), at(10, 10, 2500), Some(q));
        assert!((three - 0.833).abs() < 0.01, "{three}");
        // One thread: the quota in 50 ms, stopped 50 ms.
        let one = stopped_part(at(0, 0, 0), at(10, 10, 500), Some(q));
        assert!((one - 0.5).abs() < 1e-9, "{one}");
        // Throttled in half of the periods only.
        let half = stopped_part(at(0, 0, 0), at(10, 5, 250), Some(q));
        assert!((half - 0.25).abs() < 1e-9, "{half}");
        assert_eq!(stopped_part(at(0, 0, 0), at(10, 0, 0), Some(q)), 0.0);
        assert_eq!(
            stopped_part(at(5, 5, 5), at(4, 5, 5), Some(q)),
            0.0,
            "a new group"
        );
        assert_eq!(
            stopped_part(at(0, 0, 0), at(10, 10, 500), None),
            0.0,
            "no quota"
        );
        assert_eq!(stopped_part(at(0, 0, 0), at(0, 0, 0), Some(q)), 0.0);
    }
}
