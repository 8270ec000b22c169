//! CPU load for tests and benchmarks of a busy node: hogs that saturate every CPU, and a
//! CPU-limited "container" (a cgroup with a CFS quota: `cpu.max` on cgroup2, as on most
//! production nodes, or `cpu.cfs_quota_us` where the `cpu` controller is a v1 hierarchy)
//! holding a tenant process and its own busy loop. Everything started here is stopped
//! by PID on drop.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use anyhow::{Context, Result, bail};

/// Where the `cpu` controller is, and which interface it has.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CpuController {
    /// cgroup2: `cpu.max` in a directory under this mount, whose `cgroup.controllers`
    /// lists `cpu`.
    V2(PathBuf),
    /// cgroup v1: `cpu.cfs_period_us` / `cpu.cfs_quota_us` under this mount.
    V1(PathBuf),
}

impl CpuController {
    /// The hierarchy's root directory.
    pub fn root(&self) -> &Path {
        match self {
            CpuController::V2(p) | CpuController::V1(p) => p,
        }
    }

    /// Finds the `cpu` controller from `/proc/self/mounts`: cgroup2 when its root offers
    /// `cpu` (a pure cgroup2 node), else the v1 hierarchy that holds `cpu` (a hybrid
    /// node's v1 controllers take precedence: a controller is in one hierarchy only).
    pub fn find() -> std::result::Result<CpuController, String> {
        let mounts = std::fs::read_to_string("/proc/self/mounts")
            .map_err(|e| format!("cannot read /proc/self/mounts: {e}"))?;
        choose_cpu_controller(&mounts, |root| {
            std::fs::read_to_string(root.join("cgroup.controllers")).ok()
        })
    }
}

/// The choice of [`CpuController::find`] over the text of `/proc/self/mounts`;
/// `controllers(root)` reads a cgroup2 root's `cgroup.controllers`.
pub fn choose_cpu_controller(
    mounts: &str,
    controllers: impl Fn(&Path) -> Option<String>,
) -> std::result::Result<CpuController, String> {
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

fn hog() -> Result<Child> {
    Command::new("sh")
        .args(["-c", "while :; do :; done"])
        .stdin(Stdio::null())
        .spawn()
        .context("start a CPU hog (sh)")
}

/// `n` busy loops at normal priority.
#[derive(Debug)]
pub struct CpuHogs {
    children: Vec<Child>,
}

impl CpuHogs {
    /// One more busy loop than there are CPUs: every CPU is saturated.
    pub fn saturate() -> Result<CpuHogs> {
        CpuHogs::start(std::thread::available_parallelism().map_or(2, |n| n.get()) + 1)
    }

    /// `n` busy loops.
    pub fn start(n: usize) -> Result<CpuHogs> {
        let children = (0..n).map(|_| hog()).collect::<Result<Vec<_>>>()?;
        Ok(CpuHogs { children })
    }

    /// How many run.
    pub fn len(&self) -> usize {
        self.children.len()
    }

    /// Whether none runs.
    pub fn is_empty(&self) -> bool {
        self.children.is_empty()
    }
}

impl Drop for CpuHogs {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A `cpu` cgroup with a CFS quota (a container's CPU limit), holding the processes
/// added to it and one busy loop of its own.
#[derive(Debug)]
pub struct CpuLimited {
    controller: CpuController,
    path: PathBuf,
    hog: Child,
}

/// The CFS period of a limited group, µs (Kubernetes' default).
const PERIOD_US: u64 = 100_000;

impl CpuLimited {
    /// Why a CPU-limited group cannot be made here (no `cpu` controller, not root), or
    /// None.
    pub fn unavailable() -> Option<String> {
        let c = match CpuController::find() {
            Ok(c) => c,
            Err(why) => return Some(why),
        };
        if let CpuController::V2(root) = &c
            && let Err(e) = enable_cpu_below(root)
        {
            return Some(e.to_string());
        }
        let probe = c.root().join(format!("vgpu-probe-{}", std::process::id()));
        match std::fs::create_dir(&probe) {
            Ok(()) => {
                let _ = std::fs::remove_dir(&probe);
                None
            }
            Err(e) => Some(format!("cannot create {}: {e}", probe.display())),
        }
    }

    /// A new group `name` limited to `millicpu` (1000 = one CPU per 100 ms period),
    /// with its busy loop already inside.
    pub fn new(name: &str, millicpu: u32) -> Result<CpuLimited> {
        if millicpu == 0 {
            bail!("a CPU limit of 0 millicpu would stop the group");
        }
        let controller = CpuController::find().map_err(anyhow::Error::msg)?;
        if let CpuController::V2(root) = &controller {
            enable_cpu_below(root)?;
        }
        let path = controller
            .root()
            .join(format!("{name}-{}", std::process::id()));
        std::fs::create_dir_all(&path).with_context(|| format!("create {}", path.display()))?;
        let write = |file: &str, v: String| {
            std::fs::write(path.join(file), &v)
                .with_context(|| format!("write {v} to {}", path.join(file).display()))
        };
        let quota = u64::from(millicpu) * PERIOD_US / 1000;
        match controller {
            CpuController::V2(_) => write("cpu.max", format!("{quota} {PERIOD_US}"))?,
            CpuController::V1(_) => {
                write("cpu.cfs_period_us", PERIOD_US.to_string())?;
                write("cpu.cfs_quota_us", quota.to_string())?;
            }
        }
        let hog = hog()?;
        let g = CpuLimited {
            controller,
            path,
            hog,
        };
        g.add(g.hog.id())?;
        Ok(g)
    }

    /// The group's directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A command that runs `program` inside the group from its first instruction: a
    /// process must join before it creates real-time threads (the shim's gate thread),
    /// which a group without real-time runtime refuses (EINVAL). Arguments added later
    /// go to `program`.
    pub fn command(&self, program: &Path) -> Command {
        let mut c = Command::new("sh");
        c.arg("-c")
            .arg("echo $$ > \"$0\" && exec \"$@\"")
            .arg(self.path.join("cgroup.procs"))
            .arg(program);
        c
    }

    /// Moves process `pid` (all its threads) into the group (which refuses a process
    /// with real-time threads: start those with [`CpuLimited::command`]).
    pub fn add(&self, pid: u32) -> Result<()> {
        let procs = self.path.join("cgroup.procs");
        std::fs::write(&procs, pid.to_string())
            .with_context(|| format!("move pid {pid} into {}", procs.display()))
    }
}

impl Drop for CpuLimited {
    fn drop(&mut self) {
        let _ = self.hog.kill();
        let _ = self.hog.wait();
        // Whatever is left goes back to the root group, so that the group can go.
        if let Ok(s) = std::fs::read_to_string(self.path.join("cgroup.procs")) {
            for pid in s.split_whitespace() {
                let _ = std::fs::write(self.controller.root().join("cgroup.procs"), pid);
            }
        }
        for _ in 0..50 {
            if std::fs::remove_dir(&self.path).is_ok() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
}

/// Makes the `cpu` controller available to the children of cgroup2 `root` (a group
/// created below it then has `cpu.max`).
fn enable_cpu_below(root: &Path) -> Result<()> {
    let ctl = root.join("cgroup.subtree_control");
    let on = std::fs::read_to_string(&ctl)
        .with_context(|| format!("read {}", ctl.display()))?
        .split_whitespace()
        .any(|c| c == "cpu");
    if !on {
        std::fs::write(&ctl, "+cpu").with_context(|| format!("write +cpu to {}", ctl.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
