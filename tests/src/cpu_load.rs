//! CPU load for tests and benchmarks of a busy node: hogs that saturate every CPU, and a
//! CPU-limited "container" (a cgroup with a CFS quota: `cpu.max` on cgroup2, as on most
//! production nodes, or `cpu.cfs_quota_us` where the `cpu` controller is a v1 hierarchy)
//! holding a tenant process and its own busy loop. Everything started here is stopped
//! by PID on drop.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use anyhow::{Context, Result, bail};

pub use vgpu_core::cpu_cgroup::{CpuController, choose_cpu_controller, find_cpu_controller};

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
/// added to it and one busy loop of its own; or a group without a quota inside one with
/// it (a Kubernetes pod's limit over its container, [`CpuLimited::in_pod`]).
#[derive(Debug)]
pub struct CpuLimited {
    controller: CpuController,
    /// The group the processes are in.
    path: PathBuf,
    /// The group with the quota: `path`, or the group above it.
    limited: PathBuf,
    hog: Child,
}

/// The CFS period of a limited group, µs (Kubernetes' default).
const PERIOD_US: u64 = 100_000;

impl CpuLimited {
    /// Why a CPU-limited group cannot be made here (no `cpu` controller, not root), or
    /// None.
    pub fn unavailable() -> Option<String> {
        let c = match find_cpu_controller() {
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
        CpuLimited::make(name, millicpu, false)
    }

    /// A new group `name` limited to `millicpu` holding one group without a quota of
    /// its own (a pod's limit over its container), where the processes and the busy
    /// loop go.
    pub fn in_pod(name: &str, millicpu: u32) -> Result<CpuLimited> {
        CpuLimited::make(name, millicpu, true)
    }

    fn make(name: &str, millicpu: u32, pod: bool) -> Result<CpuLimited> {
        if millicpu == 0 {
            bail!("a CPU limit of 0 millicpu would stop the group");
        }
        let controller = find_cpu_controller().map_err(anyhow::Error::msg)?;
        if let CpuController::V2(root) = &controller {
            enable_cpu_below(root)?;
        }
        let limited = controller
            .root()
            .join(format!("{name}-{}", std::process::id()));
        std::fs::create_dir_all(&limited)
            .with_context(|| format!("create {}", limited.display()))?;
        let write = |file: &str, v: String| {
            std::fs::write(limited.join(file), &v)
                .with_context(|| format!("write {v} to {}", limited.join(file).display()))
        };
        let quota = u64::from(millicpu) * PERIOD_US / 1000;
        match controller {
            CpuController::V2(_) => write("cpu.max", format!("{quota} {PERIOD_US}"))?,
            CpuController::V1(_) => {
                write("cpu.cfs_period_us", PERIOD_US.to_string())?;
                write("cpu.cfs_quota_us", quota.to_string())?;
            }
        }
        let path = if pod {
            if let CpuController::V2(_) = &controller {
                enable_cpu_below(&limited)?;
            }
            let c = limited.join("container");
            std::fs::create_dir_all(&c).with_context(|| format!("create {}", c.display()))?;
            c
        } else {
            limited.clone()
        };
        let hog = hog()?;
        let g = CpuLimited {
            controller,
            path,
            limited,
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
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        if self.limited != self.path {
            let _ = std::fs::remove_dir(&self.limited);
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
