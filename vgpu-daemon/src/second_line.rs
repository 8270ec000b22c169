//! The second line (issue 39, ADR 0039): memory enforcement outside the tenant, the GPU's
//! equivalent of the memory cgroup's OOM killer. On every NVML reading the daemon charges
//! each container (cgroup) with what NVML says its processes hold on each GPU — shimmed,
//! unshimmed, unregistered, or a registered process with a second driver mapped after
//! admission — and a container over its quota plus a context allowance per process for
//! longer than the grace has its offending processes refused by the eBPF gate and, per
//! policy, killed. The decisions (who is over, since when, who offends, what to do) are
//! pure functions over explicit inputs and the clock; `nvml` gathers the inputs and acts.

use std::collections::{HashMap, HashSet};
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::gate_events::{Attribution, GateEvent, GateEventKind, SecondLineInfo};

/// What the daemon does to the offending processes of a container over its quota.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Nothing (no second line).
    Off,
    /// Log and count only.
    Report,
    /// Also withdraw their admission at the eBPF gate (no new GPU device opens).
    Refuse,
    /// Also SIGKILL them (their memory is freed by the driver).
    Kill,
}

impl FromStr for Action {
    type Err = String;

    fn from_str(v: &str) -> Result<Self, Self::Err> {
        match v.trim() {
            "off" => Ok(Action::Off),
            "report" => Ok(Action::Report),
            "refuse" => Ok(Action::Refuse),
            "kill" => Ok(Action::Kill),
            other => Err(format!(
                "{other:?} is not a memory enforcement action (off, report, refuse or kill)"
            )),
        }
    }
}

impl Action {
    /// Its name, as the flag spells it (the `action` label).
    pub fn name(self) -> &'static str {
        match self {
            Action::Off => "off",
            Action::Report => "report",
            Action::Refuse => "refuse",
            Action::Kill => "kill",
        }
    }
}

/// The second line's knobs (ADR 0039).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    /// What is done to offenders (`--memory-enforce`).
    pub action: Action,
    /// How long a container may stay over before the action (`--memory-enforce-grace-ms`);
    /// `None`: two NVML intervals.
    pub grace: Option<Duration>,
    /// Device memory per process not charged against the quota (its context, which the
    /// shim does not count), bytes (`--memory-context-allowance-mib`).
    pub context_allowance: u64,
}

/// Default context allowance: above ADR 0008's 100–500 MiB per context.
pub const DEFAULT_CONTEXT_ALLOWANCE: u64 = 512 << 20;

impl Default for Policy {
    fn default() -> Self {
        Policy {
            action: Action::Kill,
            grace: None,
            context_allowance: DEFAULT_CONTEXT_ALLOWANCE,
        }
    }
}

impl Policy {
    /// The grace in force with NVML reading every `interval`.
    pub fn grace_for(&self, interval: Duration) -> Duration {
        self.grace.unwrap_or(interval * 2)
    }
}

/// One process of a container on one GPU, as the daemon sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcUse {
    /// Host PID.
    pub pid: u32,
    /// What NVML says it holds, bytes.
    pub held: u64,
    /// What its shim reported it holds (0: not registered, no shim).
    pub reported: u64,
    /// A registered process that mapped a second driver after admission (its shim does
    /// not see what that driver allocates): a bypass.
    pub second_driver: bool,
}

/// A container's use of one GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerUse {
    /// The container (tenant key).
    pub container: String,
    /// The GPU.
    pub gpu: String,
    /// Its memory quota on the GPU, bytes.
    pub quota: u64,
    /// Its processes on the GPU (registered or not).
    pub procs: Vec<ProcUse>,
}

impl ContainerUse {
    /// What it holds, bytes.
    pub fn held(&self) -> u64 {
        self.procs.iter().map(|p| p.held).sum()
    }

    /// What it may hold: the quota and a context allowance per process.
    pub fn limit(&self, allowance: u64) -> u64 {
        self.quota
            .saturating_add(allowance.saturating_mul(self.procs.len() as u64))
    }
}

/// The processes to act on in a container over its limit: each whose holding exceeds
/// what its shim reported plus the context allowance (unregistered ones: all of it), or
/// that mapped a second driver; largest excess first. When none does (the container is
/// over with every process within its shim's count), the largest holder.
pub fn offenders(c: &ContainerUse, allowance: u64) -> Vec<u32> {
    let mut by_excess: Vec<(u64, u32)> = c
        .procs
        .iter()
        .filter_map(|p| {
            let excess = p.held.saturating_sub(p.reported.saturating_add(allowance));
            (excess > 0 || p.second_driver).then_some((excess, p.pid))
        })
        .collect();
    if by_excess.is_empty() {
        return c
            .procs
            .iter()
            .max_by_key(|p| (p.held, p.pid))
            .map(|p| vec![p.pid])
            .unwrap_or_default();
    }
    by_excess.sort_by(|a, b| b.cmp(a));
    by_excess.into_iter().map(|(_, pid)| pid).collect()
}

/// A decision: a container over its limit for `over_for`, and what to do to whom.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// The container.
    pub container: String,
    /// The GPU.
    pub gpu: String,
    /// What it holds, bytes.
    pub held: u64,
    /// Its quota, bytes.
    pub quota: u64,
    /// Its limit (quota and allowances), bytes.
    pub limit: u64,
    /// How long it has been over.
    pub over_for: Duration,
    /// The processes acted on (not acted on before).
    pub pids: Vec<u32>,
    /// What is done.
    pub action: Action,
}

/// Since when each container has been over on each GPU, and which processes were acted on.
#[derive(Debug, Default)]
pub struct Tracker {
    over_since: HashMap<(String, String), u64>,
    acted: HashSet<u32>,
}

impl Tracker {
    /// Takes one reading at `now_ns` (monotonic): returns the verdicts due now. A
    /// container is due once it has been over in every reading for at least `grace`;
    /// each process is acted on once (forgotten when it no longer holds memory).
    pub fn judge(
        &mut self,
        now_ns: u64,
        uses: &[ContainerUse],
        policy: &Policy,
        grace: Duration,
    ) -> Vec<Verdict> {
        if policy.action == Action::Off {
            self.over_since.clear();
            return Vec::new();
        }
        let present: HashSet<u32> = uses
            .iter()
            .flat_map(|c| c.procs.iter().map(|p| p.pid))
            .collect();
        self.acted.retain(|p| present.contains(p));
        let mut over = HashMap::new();
        let mut out = Vec::new();
        for c in uses {
            let limit = c.limit(policy.context_allowance);
            let held = c.held();
            if held <= limit {
                continue;
            }
            let key = (c.container.clone(), c.gpu.clone());
            let since = self.over_since.get(&key).copied().unwrap_or(now_ns);
            over.insert(key, since);
            let over_for = Duration::from_nanos(now_ns.saturating_sub(since));
            if over_for < grace {
                continue;
            }
            let pids: Vec<u32> = offenders(c, policy.context_allowance)
                .into_iter()
                .filter(|p| !self.acted.contains(p))
                .collect();
            if pids.is_empty() {
                continue;
            }
            self.acted.extend(&pids);
            out.push(Verdict {
                container: c.container.clone(),
                gpu: c.gpu.clone(),
                held,
                quota: c.quota,
                limit,
                over_for,
                pids,
                action: policy.action,
            });
        }
        // A container under its limit in this reading starts again.
        self.over_since = over;
        out
    }
}

/// What the second line did, for `/metrics`.
#[derive(Debug, Default)]
pub struct Stats {
    reported: AtomicU64,
    refused: AtomicU64,
    killed: AtomicU64,
    second_drivers: AtomicU64,
    unregistered_charged: AtomicU64,
}

impl Stats {
    /// A process was acted on with `action` (each step of it counted).
    pub fn acted(&self, action: Action) {
        self.reported.fetch_add(1, Ordering::Relaxed);
        if matches!(action, Action::Refuse | Action::Kill) {
            self.refused.fetch_add(1, Ordering::Relaxed);
        }
        if action == Action::Kill {
            self.killed.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A registered process with a second driver mapped was found.
    pub fn second_driver(&self) {
        self.second_drivers.fetch_add(1, Ordering::Relaxed);
    }

    /// Unregistered processes charged to a container in the last reading.
    pub fn set_unregistered_charged(&self, n: usize) {
        self.unregistered_charged.store(n as u64, Ordering::Relaxed);
    }

    /// Prometheus text.
    pub fn metrics(&self) -> String {
        use vgpu_core::prom::{Family, Kind};
        let mut acted = Family::new(
            "vgpu_memory_enforcement_processes_total",
            Kind::Counter,
            "Processes of containers over their GPU memory quota (plus context allowance) past the grace, by step taken (reported, refused at the gate, killed).",
        );
        for (step, c) in [
            ("reported", &self.reported),
            ("refused", &self.refused),
            ("killed", &self.killed),
        ] {
            acted.sample(&[("step", step)], c.load(Ordering::Relaxed) as f64);
        }
        let mut second = Family::new(
            "vgpu_memory_second_driver_processes_total",
            Kind::Counter,
            "Registered processes found with the CUDA driver mapped twice (a second driver loaded after admission: a bypass).",
        );
        second.sample(&[], self.second_drivers.load(Ordering::Relaxed) as f64);
        let mut charged = Family::new(
            "vgpu_memory_unregistered_charged_processes",
            Kind::Gauge,
            "Processes no shim registered that hold GPU memory in a container's cgroup, charged to it (last reading).",
        );
        charged.sample(
            &[],
            self.unregistered_charged.load(Ordering::Relaxed) as f64,
        );
        let mut s = String::new();
        for f in [&acted, &second, &charged] {
            f.write(&mut s);
        }
        s
    }
}

/// The driver around [`Tracker::judge`], run by the NVML watcher after each reading:
/// gathers each container's processes (registered ones from the daemon, unregistered ones
/// by their `/proc/PID/cgroup`), looks for a second driver in registered ones, judges,
/// and acts (gate, `SIGKILL`), logging each action with its figures.
#[derive(Debug, Default)]
pub struct Enforcer {
    tracker: Tracker,
    second_drivers: HashSet<u32>,
    /// Whether each mapped object (device, inode) is a CUDA driver, by its exports: read
    /// once per object while the daemon runs.
    drivers: HashMap<(String, u64), bool>,
}

/// Objects judged in [`Enforcer`]'s cache before it starts again.
const MAX_JUDGED_OBJECTS: usize = 16_384;

/// Whether a mapped object is a CUDA driver (ADR 0055): one that exports `cuInit` and not
/// `dlsym` (the shim exports both; no driver exports `dlsym`), whatever its file is named,
/// so that a renamed copy of the driver counts; when its exports cannot be read, by its
/// name (`libcuda.so*`), as before.
pub fn is_driver(exports: Result<&[bool], &vgpu_core::elf_exports::ElfError>, path: &str) -> bool {
    match exports {
        Ok([cu_init, dlsym]) => *cu_init && !*dlsym,
        _ => std::path::Path::new(path.trim_end_matches(" (deleted)"))
            .file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with("libcuda.so")),
    }
}

/// The names [`is_driver`] looks for, in its order.
const DRIVER_EXPORTS: [&str; 2] = ["cuInit", "dlsym"];

/// The exports [`is_driver`] needs of one object `pid` has mapped: read through
/// `/proc/PID/map_files` (the very object mapped, even deleted or in another mount
/// namespace), else `/proc/PID/root` and its path.
fn exports_of(
    pid: u32,
    o: &vgpu_core::proc_maps::LoadedObject<'_>,
) -> Result<Vec<bool>, vgpu_core::elf_exports::ElfError> {
    use std::os::unix::fs::FileExt;
    let file = std::fs::File::open(format!("/proc/{pid}/map_files/{}", o.range)).or_else(|_| {
        std::fs::File::open(format!(
            "/proc/{pid}/root{}",
            o.path.trim_end_matches(" (deleted)")
        ))
    });
    let Ok(file) = file else {
        return Err(vgpu_core::elf_exports::ElfError::Truncated("the file"));
    };
    vgpu_core::elf_exports::defines(
        |off, len| {
            let mut b = vec![0; len];
            file.read_exact_at(&mut b, off).ok().map(|()| b)
        },
        &DRIVER_EXPORTS,
    )
}

impl Enforcer {
    /// How many CUDA drivers `pid` has loaded ([`is_driver`]; one per load).
    fn driver_loads(&mut self, pid: u32, maps: &str) -> usize {
        let mut n = 0;
        for o in vgpu_core::proc_maps::loaded_objects(maps) {
            let key = (o.dev.to_owned(), o.inode);
            let driver = match self.drivers.get(&key) {
                Some(d) => *d,
                None => {
                    let exports = exports_of(pid, &o);
                    let d = is_driver(exports.as_deref(), o.path);
                    if self.drivers.len() >= MAX_JUDGED_OBJECTS {
                        self.drivers.clear();
                    }
                    self.drivers.insert(key, d);
                    d
                }
            };
            n += usize::from(driver);
        }
        n
    }
}

/// The container a process belongs to for charging: its cgroup key
/// ([`crate::connections::container_key`]); `None` for the host's root cgroup or an
/// unreadable one (such processes are charged to no container).
fn charge_key(pid: u32) -> Option<String> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    let key = crate::connections::container_key(&text);
    (key != "/" && key != "unknown").then_some(key)
}

impl Enforcer {
    /// One reading's work (`grace` from the NVML interval).
    pub fn check(
        &mut self,
        daemon: &crate::daemon::Daemon,
        obs: &[crate::model::GpuObservation],
        policy: &Policy,
        grace: Duration,
    ) {
        if policy.action == Action::Off {
            return;
        }
        let ledger = daemon.memory_ledger();
        let registered: HashMap<u32, usize> = ledger
            .iter()
            .enumerate()
            .flat_map(|(i, t)| t.pids.iter().map(move |p| (*p, i)))
            .collect();
        // A tenant's container: the cgroup of its registered processes.
        let mut by_cgroup: HashMap<String, usize> = HashMap::new();
        for (pid, i) in &registered {
            if let Some(k) = charge_key(*pid) {
                by_cgroup.entry(k).or_insert(*i);
            }
        }
        // A second driver mapped after admission (dlmopen into a new link namespace).
        self.second_drivers.retain(|p| registered.contains_key(p));
        for pid in registered.keys() {
            let Ok(maps) = std::fs::read_to_string(format!("/proc/{pid}/maps")) else {
                continue;
            };
            if self.driver_loads(*pid, &maps) >= 2 && self.second_drivers.insert(*pid) {
                daemon.second_line().second_driver();
                tracing::warn!(
                    pid,
                    tenant = %ledger[registered[pid]].key,
                    "second line: a registered process mapped the CUDA driver twice (a second driver loaded after admission, or a copy of it under another name): a bypass, charged to its container"
                );
            }
        }
        let mut uses = Vec::new();
        let mut charged = HashSet::new();
        for o in obs {
            let mut per_tenant: HashMap<usize, Vec<ProcUse>> = HashMap::new();
            for (pid, held) in &o.processes {
                let (tenant, reported) = match registered.get(pid) {
                    Some(i) => {
                        let reported = ledger[*i]
                            .gpus
                            .iter()
                            .find(|(u, ..)| vgpu_core::container_quota::same_gpu(u, &o.uuid))
                            .and_then(|(_, _, r)| r.get(pid).copied())
                            .unwrap_or(0);
                        (*i, reported)
                    }
                    None => match charge_key(*pid).and_then(|k| by_cgroup.get(&k).copied()) {
                        Some(i) => {
                            charged.insert(*pid);
                            (i, 0)
                        }
                        None => continue,
                    },
                };
                per_tenant.entry(tenant).or_default().push(ProcUse {
                    pid: *pid,
                    held: *held,
                    reported,
                    second_driver: self.second_drivers.contains(pid),
                });
            }
            for (i, procs) in per_tenant {
                let quota = ledger[i]
                    .gpus
                    .iter()
                    .find(|(u, ..)| vgpu_core::container_quota::same_gpu(u, &o.uuid))
                    .and_then(|(_, q, _)| *q);
                if let Some(quota) = quota {
                    uses.push(ContainerUse {
                        container: ledger[i].key.clone(),
                        gpu: o.uuid.clone(),
                        quota,
                        procs,
                    });
                }
            }
        }
        daemon.second_line().set_unregistered_charged(charged.len());
        for v in self
            .tracker
            .judge(vgpu_sys::mono_ns(), &uses, policy, grace)
        {
            for pid in &v.pids {
                let process_held = uses
                    .iter()
                    .filter(|c| c.container == v.container && c.gpu == v.gpu)
                    .flat_map(|c| c.procs.iter())
                    .find(|p| p.pid == *pid)
                    .map_or(0, |p| p.held);
                act(
                    daemon,
                    &v,
                    Offender {
                        pid: *pid,
                        held: process_held,
                        unregistered: charged.contains(pid),
                        second_driver: self.second_drivers.contains(pid),
                    },
                );
            }
        }
    }
}

/// One process acted on, as [`act`] needs it.
struct Offender {
    pid: u32,
    /// What NVML said it held, bytes.
    held: u64,
    unregistered: bool,
    second_driver: bool,
}

fn act(daemon: &crate::daemon::Daemon, v: &Verdict, o: Offender) {
    let pid = o.pid;
    let why = if o.second_driver {
        "a second CUDA driver mapped after admission"
    } else if o.unregistered {
        "GPU memory no shim registered, in the container's cgroup"
    } else {
        "more GPU memory than its shim reported"
    };
    // Who it is, read before the kill (its /proc entry goes with it).
    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .map(|c| c.trim_end().to_owned())
        .unwrap_or_default();
    let who = attribution(daemon, pid);
    let refused = matches!(v.action, Action::Refuse | Action::Kill)
        && daemon.device_gate().is_some_and(|g| g.revoke(pid));
    let killed = v.action == Action::Kill && kill(pid);
    daemon.second_line().acted(v.action);
    tracing::warn!(
        pid,
        tenant = %v.container,
        gpu = %v.gpu,
        held_bytes = v.held,
        quota_bytes = v.quota,
        limit_bytes = v.limit,
        over_ms = v.over_for.as_millis() as u64,
        action = v.action.name(),
        refused_at_gate = refused,
        killed,
        "second line: container over its GPU memory quota (plus context allowance) past the grace: {why}"
    );
    // The device plugin posts it on the pod (ADR 0055).
    let mut ev = GateEvent::now(GateEventKind::Memory, pid, comm, who);
    ev.second_line = Some(SecondLineInfo {
        action: v.action.name(),
        reason: why,
        second_driver: o.second_driver,
        unregistered: o.unregistered,
        gpu: v.gpu.clone(),
        held: v.held,
        quota: v.quota,
        limit: v.limit,
        over_ms: u64::try_from(v.over_for.as_millis()).unwrap_or(u64::MAX),
        process_held: o.held,
        refused_at_gate: refused,
        killed,
        tenant: v.container.clone(),
    });
    daemon.events().publish(ev);
}

/// `pid`'s cgroup, pod and container (names from the daemon's tenants of the same pod).
fn attribution(daemon: &crate::daemon::Daemon, pid: u32) -> Attribution {
    let mut a = Attribution::default();
    let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/cgroup")) else {
        return a;
    };
    let Some(rel) = text.lines().find_map(|l| l.strip_prefix("0::")) else {
        return a;
    };
    a.cgroup = rel.to_owned();
    if let Some(p) = vgpu_ebpf::attribution::pod_of_cgroup(rel) {
        a.pod_uid = p.pod_uid;
        a.container_id = p.container_id.unwrap_or_default();
        crate::enforcement::names_from_tenants(&mut a, daemon);
    }
    a
}

/// SIGKILL `pid`; whether the signal was sent.
fn kill(pid: u32) -> bool {
    let Ok(p) = libc::pid_t::try_from(pid) else {
        return false;
    };
    if p <= 0 {
        return false;
    }
    // SAFETY: kill(2) with a positive PID and a valid signal number touches no memory of
    // this process.
    unsafe { libc::kill(p, libc::SIGKILL) == 0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn p(pid: u32, held_mib: u64, reported_mib: u64) -> ProcUse {
        ProcUse {
            pid,
            held: held_mib * MIB,
            reported: reported_mib * MIB,
            second_driver: false,
        }
    }

    fn c(procs: Vec<ProcUse>) -> ContainerUse {
        ContainerUse {
            container: "ns/pod/c".into(),
            gpu: "GPU-0".into(),
            quota: 256 * MIB,
            procs,
        }
    }

    fn policy(action: Action) -> Policy {
        Policy {
            action,
            grace: None,
            context_allowance: 512 * MIB,
        }
    }

    #[test]
    fn a_container_within_quota_and_contexts_is_never_acted_on() {
        let mut t = Tracker::default();
        // Two shimmed processes, 128 MiB each reported, plus a 300 MiB context each.
        let u = [c(vec![p(1, 428, 128), p(2, 428, 128)])];
        for s in 0..10 {
            assert!(
                t.judge(
                    s * 1_000_000_000,
                    &u,
                    &policy(Action::Kill),
                    Duration::from_secs(2)
                )
                .is_empty()
            );
        }
    }

    #[test]
    fn an_unregistered_process_is_charged_and_acted_on_after_the_grace_only() {
        let mut t = Tracker::default();
        let pol = policy(Action::Kill);
        let grace = pol.grace_for(Duration::from_millis(100));
        assert_eq!(grace, Duration::from_millis(200));
        // A shimmed process within its quota and a raw one holding 1 GiB + context.
        let u = [c(vec![p(10, 556, 256), p(11, 1324, 0)])];
        assert!(t.judge(0, &u, &pol, grace).is_empty());
        assert!(t.judge(100_000_000, &u, &pol, grace).is_empty());
        let v = t.judge(200_000_000, &u, &pol, grace);
        assert_eq!(v.len(), 1);
        assert_eq!(v[0].pids, vec![11]);
        assert_eq!(v[0].held, 1880 * MIB);
        assert_eq!(v[0].limit, (256 + 2 * 512) * MIB);
        assert_eq!(v[0].over_for, Duration::from_millis(200));
        assert_eq!(v[0].action, Action::Kill);
        // Once per process.
        assert!(t.judge(300_000_000, &u, &pol, grace).is_empty());
    }

    #[test]
    fn a_dip_under_the_limit_restarts_the_grace() {
        let mut t = Tracker::default();
        let pol = policy(Action::Refuse);
        let grace = Duration::from_millis(200);
        let over = [c(vec![p(11, 2048, 0)])];
        let under = [c(vec![p(11, 100, 0)])];
        assert!(t.judge(0, &over, &pol, grace).is_empty());
        assert!(t.judge(100_000_000, &under, &pol, grace).is_empty());
        assert!(t.judge(200_000_000, &over, &pol, grace).is_empty());
        assert!(t.judge(300_000_000, &over, &pol, grace).is_empty());
        assert_eq!(t.judge(400_000_000, &over, &pol, grace)[0].pids, vec![11]);
    }

    #[test]
    fn a_second_driver_is_an_offender_even_within_its_allowance() {
        let mut u = c(vec![p(1, 600, 256), p(2, 1500, 256)]);
        u.procs[0].second_driver = true;
        // pid 2 exceeds reported + allowance by 732 MiB; pid 1 mapped a second driver.
        assert_eq!(offenders(&u, 512 * MIB), vec![2, 1]);
        // Over with everyone within their shims' counts (a quota the shim did not hold):
        // the largest holder.
        let u = c(vec![p(1, 700, 600), p(2, 800, 700)]);
        assert_eq!(offenders(&u, 512 * MIB), vec![2]);
    }

    #[test]
    fn a_driver_is_told_by_its_exports_whatever_its_name() {
        use vgpu_core::elf_exports::ElfError;
        // A renamed copy of the driver.
        assert!(is_driver(Ok(&[true, false]), "/tmp/x/libgpuhelper.so"));
        // The shim exports cuInit and dlsym.
        assert!(!is_driver(Ok(&[true, true]), "/usr/local/vgpu/libvgpu.so"));
        // A library named like the driver that does not export it (a wrapper, a stub
        // without cuInit) is not one.
        assert!(!is_driver(Ok(&[false, false]), "/usr/lib/libcuda.so.1"));
        // Unreadable: by name, as before.
        let e = ElfError::NoDynsym;
        assert!(is_driver(
            Err(&e),
            "/usr/lib/libcuda.so.535.104.05 (deleted)"
        ));
        assert!(!is_driver(Err(&e), "/usr/lib/libc.so.6"));
    }

    #[test]
    fn off_decides_nothing_and_the_action_parses_its_names() {
        let mut t = Tracker::default();
        let u = [c(vec![p(11, 4096, 0)])];
        assert!(
            t.judge(10_000_000_000, &u, &policy(Action::Off), Duration::ZERO)
                .is_empty()
        );
        for a in [Action::Off, Action::Report, Action::Refuse, Action::Kill] {
            assert_eq!(a.name().parse::<Action>(), Ok(a));
        }
        let e = "oom".parse::<Action>().unwrap_err();
        assert!(e.contains("\"oom\""), "{e}");
        assert_eq!(Policy::default().action, Action::Kill);
    }
}
