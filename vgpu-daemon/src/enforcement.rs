//! The daemon's side of the eBPF GPU device gate and exit watcher (`vgpu-ebpf`): attaches
//! them at start in the configured mode (or says in one line why it cannot and runs on
//! without them), admits the processes that register through the shim, releases a
//! process's slices the moment the kernel reports its exit, and counts refused and audited
//! opens per pod for `/metrics`. Decisions: ADR 0018; design: `docs/ebpf.md`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tracing::{info, warn};
use vgpu_ebpf::{EbpfConfig, Enforcer, Event, EventKind, EventReader, GpuDevice, Mode};

use crate::daemon::Daemon;
use crate::gate_events::{Attribution, EventHub, GateEvent, GateEventKind};

/// The default pin directory (ADR 0018: pinned, fail-closed across restarts).
pub const DEFAULT_PIN_DIR: &str = "/sys/fs/bpf/vgpu";
/// Pods (or cgroups) whose opens are counted apart; beyond it they count as `other`.
const MAX_PODS: usize = 4096;
/// The shim's file name, looked for in an admitted process's memory map.
const SHIM_FILE: &str = "libvgpu.so";
/// How often the containers of the daemon's pod are looked for (a restarted plugin).
const POD_RESCAN: Duration = Duration::from_secs(10);
/// How long an event reader waits before it looks at the stop flag again.
const POLL: Duration = Duration::from_millis(100);
/// cgroups whose attribution is remembered; beyond, the memory starts again.
const MAX_ATTRIBUTIONS: usize = 4096;
/// How often a pod's names are looked for again among the tenants while unknown.
const NAMES_RETRY: Duration = Duration::from_secs(5);

/// What the daemon asks of eBPF (`--ebpf*` flags).
#[derive(Debug, Clone)]
pub struct EbpfSettings {
    /// `off`, `audit` or `enforce`.
    pub mode: Mode,
    /// The cgroup2 directory whose processes the gate judges; `None`: kubelet's pod tree
    /// (`kubepods.slice` or `kubepods` under the cgroup2 mount), else the whole mount.
    pub cgroup_root: Option<PathBuf>,
    /// Where maps and links are pinned; `None`: not pinned (fail-open on exit; tests).
    pub pin_dir: Option<PathBuf>,
    /// Where the GPU device nodes are (`/dev`); their numbers are read from the nodes,
    /// beside NVIDIA's majors in `/proc/devices`.
    pub dev_dir: PathBuf,
    /// cgroup2 directories trusted to open GPU nodes (the node's agents); the daemon's own
    /// cgroup is always trusted.
    pub trusted_cgroups: Vec<PathBuf>,
    /// What `enforce` does when the gate cannot be attached (`--ebpf-enforce-fallback`).
    pub enforce_fallback: EnforceFallback,
}

/// `--ebpf-enforce-fallback`: what the daemon does when `--ebpf enforce` is asked for and
/// the gate cannot be attached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EnforceFallback {
    /// Fail closed (the default): keep a gate an earlier run pinned, report not ready
    /// (`/readyz` 503), refuse new tenants, and say so in `/metrics`.
    #[default]
    Refuse,
    /// Fail open, as the operator chose: remove a gate an earlier run pinned (nobody would
    /// admit processes through it) and serve without one (`/metrics` still says 0).
    Serve,
}

impl std::str::FromStr for EnforceFallback {
    type Err = String;

    fn from_str(v: &str) -> Result<Self, Self::Err> {
        match v.trim() {
            "refuse" => Ok(EnforceFallback::Refuse),
            "serve" => Ok(EnforceFallback::Serve),
            other => Err(format!(
                "{other:?} is not an eBPF enforce fallback (refuse or serve)"
            )),
        }
    }
}

/// What the daemon does when the gate of `mode` could not be attached, by the fallback
/// the operator chose: whether a gate an earlier run pinned stays, and whether the node
/// fails closed (not ready, new tenants refused).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FailureAction {
    /// Leave the pinned gate (and its maps) as they are.
    pub keep_pins: bool,
    /// Not ready, new tenants refused.
    pub fail_closed: bool,
}

/// The decision behind [`FailureAction`]: enforce with `refuse` fails closed and keeps a
/// standing gate (never removed when it cannot be replaced); enforce with `serve` and
/// audit (which never refuses) run on, removing a pinned gate nobody would feed.
pub fn on_attach_failure(mode: Mode, fallback: EnforceFallback) -> FailureAction {
    let closed = mode == Mode::Enforce && fallback == EnforceFallback::Refuse;
    FailureAction {
        keep_pins: closed,
        fail_closed: closed,
    }
}

/// eBPF asked for and not attached: what `/metrics`, `/readyz` and registration say.
#[derive(Debug, Clone)]
pub struct EbpfFailure {
    /// The mode asked for.
    pub mode: Mode,
    /// Why it is not attached (the attach error).
    pub reason: String,
    /// Whether the node fails closed ([`FailureAction::fail_closed`]).
    pub fail_closed: bool,
}

impl EbpfFailure {
    /// `vgpu_ebpf_program_attached` at 0 for both programs, with the mode asked for, so
    /// that an alert on `== 0` fires.
    pub fn metrics(&self) -> String {
        use vgpu_core::prom::{Family, Kind};
        let mut attached = Family::new(
            "vgpu_ebpf_program_attached",
            Kind::Gauge,
            "1 when the eBPF program is attached (with the gate's mode).",
        );
        for program in ["gpu_gate", "exit_watch"] {
            attached.sample(&[("program", program), ("mode", mode_name(self.mode))], 0.0);
        }
        let mut s = String::new();
        attached.write(&mut s);
        s
    }

    /// The refusal a new tenant gets while the node fails closed.
    pub fn refusal(&self) -> String {
        format!(
            "eBPF {} was asked for and the GPU device gate is not attached ({}): new tenants are refused (--ebpf-enforce-fallback refuse)",
            mode_name(self.mode),
            self.reason
        )
    }
}

/// The event that says the node does not enforce although `--ebpf enforce` was asked for
/// (the device plugin posts it on the node, ADR 0055); `None` for other modes (audit
/// failing is said in the log and metrics only: nothing was being refused).
pub fn not_enforcing_event(f: &EbpfFailure) -> Option<GateEvent> {
    if f.mode != Mode::Enforce {
        return None;
    }
    let mut ev = GateEvent::now(
        GateEventKind::NotEnforcing,
        0,
        String::new(),
        Attribution::default(),
    );
    ev.not_enforcing = Some(crate::gate_events::NotEnforcingInfo {
        mode: mode_name(f.mode),
        reason: f.reason.clone(),
        fail_closed: f.fail_closed,
    });
    Some(ev)
}

impl Default for EbpfSettings {
    /// Off and not pinned: the library default, which touches nothing a node daemon
    /// pinned (tests and embedders opt in; the binary's flags default to audit, pinned
    /// under [`DEFAULT_PIN_DIR`]).
    fn default() -> Self {
        Self {
            mode: Mode::Off,
            cgroup_root: None,
            pin_dir: None,
            dev_dir: PathBuf::from("/dev"),
            trusted_cgroups: Vec::new(),
            enforce_fallback: EnforceFallback::Refuse,
        }
    }
}

/// Opens refused or audited, per pod or cgroup (`other` beyond [`MAX_PODS`]).
#[derive(Debug, Default, Clone, Copy)]
struct PodCount {
    refused: u64,
    audited: u64,
}

/// The attached gate and watcher, and what they reported.
#[derive(Debug)]
pub struct Enforcement {
    enforcer: Mutex<Enforcer>,
    /// Why the exit watcher is not attached (no tracefs), when it is not.
    exit_watch_missing: Option<String>,
    mode: Mode,
    cgroup2: PathBuf,
    per_pod: Mutex<HashMap<String, PodCount>>,
    exits: AtomicU64,
    exits_released: AtomicU64,
    stop: Arc<AtomicBool>,
    readers: Mutex<Vec<JoinHandle<()>>>,
    /// The node's events (the daemon's hub, [`Daemon::events`]), for the gRPC stream.
    hub: Arc<EventHub>,
    /// cgroup id → who, and when the names were last looked for.
    attributions: Mutex<HashMap<u64, (Attribution, Instant)>>,
}

/// Why eBPF is not running: the one line the daemon logs.
#[derive(Debug, thiserror::Error)]
pub enum EnforcementError {
    /// A prerequisite or the attach failed.
    #[error(transparent)]
    Ebpf(#[from] vgpu_ebpf::EbpfError),
    /// No cgroup2 mount to attach to.
    #[error("no cgroup2 file system is mounted (/proc/self/mounts)")]
    NoCgroup2,
    /// A configured path could not be read.
    #[error("{what} {}: {source}", path.display())]
    Path {
        /// Which setting.
        what: &'static str,
        /// The path.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

impl Enforcement {
    /// Attaches what `settings` asks for. `Ok(None)` for `off` (after removing what a
    /// pinned earlier run left). On error nothing of this run stays attached; a gate
    /// pinned by an earlier run stays when enforce fails closed ([`on_attach_failure`]:
    /// never removed when it cannot be replaced), and is removed otherwise (ADR 0018: a
    /// gate nobody feeds would refuse every new GPU process); the caller logs the error
    /// and records an [`EbpfFailure`].
    pub fn start(
        settings: &EbpfSettings,
        daemon: &Arc<Daemon>,
    ) -> Result<Option<Arc<Enforcement>>, EnforcementError> {
        if settings.mode == Mode::Off {
            if let Some(pins) = &settings.pin_dir
                && pins.exists()
            {
                vgpu_ebpf::remove_pins(pins)?;
                info!(pins = %pins.display(), "eBPF off: removed the gate an earlier run pinned");
            }
            return Ok(None);
        }
        match Self::attach(settings, daemon) {
            Ok(e) => Ok(Some(e)),
            Err(e) => {
                let action = on_attach_failure(settings.mode, settings.enforce_fallback);
                if let Some(pins) = &settings.pin_dir
                    && pins.exists()
                {
                    if action.keep_pins {
                        warn!(pins = %pins.display(), "eBPF enforce: a gate an earlier run pinned stays in place (it refuses every process this daemon cannot admit)");
                    } else if vgpu_ebpf::remove_pins(pins).is_ok() {
                        warn!(pins = %pins.display(), "removed the gate an earlier run pinned: nobody would register processes with it");
                    }
                }
                Err(e)
            }
        }
    }

    fn attach(
        settings: &EbpfSettings,
        daemon: &Arc<Daemon>,
    ) -> Result<Arc<Enforcement>, EnforcementError> {
        // Capabilities, BTF, tracefs and bpffs are checked by `Enforcer::attach`, which
        // names what is missing.
        let mounts = read("/proc/self/mounts", Path::new("/proc/self/mounts"))?;
        let cgroup2 = vgpu_ebpf::preflight::cgroup2_mount(&mounts)
            .map(PathBuf::from)
            .ok_or(EnforcementError::NoCgroup2)?;
        let cgroup_root = match &settings.cgroup_root {
            Some(p) => p.clone(),
            None => ["kubepods.slice", "kubepods"]
                .iter()
                .map(|k| cgroup2.join(k))
                .find(|p| p.is_dir())
                .unwrap_or_else(|| cgroup2.clone()),
        };
        let devices = gpu_devices(&settings.dev_dir)?;
        let cfg = EbpfConfig {
            mode: settings.mode,
            cgroup_root: cgroup_root.clone(),
            pin_dir: settings.pin_dir.clone(),
        };
        let mut enforcer = Enforcer::attach(&cfg, &devices)?;
        // The daemon's own cgroup (its NVML watcher opens the nodes), then the operator's.
        let own = own_cgroup(&cgroup2);
        for dir in own.iter().chain(&settings.trusted_cgroups) {
            let id = vgpu_ebpf::cgroup_id(dir)?;
            enforcer.trust_cgroup(id)?;
            info!(cgroup = %dir.display(), "eBPF gate: cgroup trusted");
        }
        // In a pod, the pod's other containers (the device plugin's NVML health checks)
        // are the node's agents too; they are trusted now and whenever they restart.
        let pod_dir = own
            .as_deref()
            .and_then(Path::parent)
            .filter(|p| vgpu_ebpf::attribution::pod_of_cgroup(&p.to_string_lossy()).is_some())
            .map(Path::to_path_buf);
        let gate_events = enforcer.take_gate_events();
        let exit_events = enforcer.take_exit_events();
        info!(
            "eBPF: GPU device gate attached to {} in {} mode ({} device major(s){})",
            cgroup_root.display(),
            mode_name(settings.mode),
            devices.len(),
            settings
                .pin_dir
                .as_ref()
                .map_or(String::from(", not pinned"), |p| format!(
                    ", pinned under {}",
                    p.display()
                )),
        );
        let exit_watch_missing = enforcer.exit_watch().err().map(str::to_owned);
        match &exit_watch_missing {
            None => info!("eBPF: exit watcher attached (sched_process_exit)"),
            Some(why) => warn!(
                "eBPF: the gate runs without exit events ({why}): a process's slices are released when its connection closes, and admitted PIDs are forgotten by the daemon's sweep"
            ),
        }
        let e = Arc::new(Enforcement {
            exit_watch_missing,
            enforcer: Mutex::new(enforcer),
            mode: settings.mode,
            cgroup2,
            per_pod: Mutex::new(HashMap::new()),
            exits: AtomicU64::new(0),
            exits_released: AtomicU64::new(0),
            stop: Arc::new(AtomicBool::new(false)),
            readers: Mutex::new(Vec::new()),
            hub: Arc::clone(daemon.events()),
            attributions: Mutex::new(HashMap::new()),
        });
        let mut readers = Vec::new();
        if let Some(r) = gate_events {
            let weak = Arc::downgrade(&e);
            let d: Weak<Daemon> = Arc::downgrade(daemon);
            readers.push(spawn_reader(
                "vgpu-ebpf-gate",
                r,
                Arc::clone(&e.stop),
                move |ev| {
                    if let (Some(e), Some(d)) = (weak.upgrade(), d.upgrade()) {
                        e.gate_event(&ev, &d);
                    }
                },
            )?);
        }
        if let Some(r) = exit_events {
            let weak = Arc::downgrade(&e);
            let d: Weak<Daemon> = Arc::downgrade(daemon);
            readers.push(spawn_reader(
                "vgpu-ebpf-exit",
                r,
                Arc::clone(&e.stop),
                move |ev| {
                    if let (Some(e), Some(d)) = (weak.upgrade(), d.upgrade()) {
                        e.exit_event(&ev, &d);
                    }
                },
            )?);
        }
        if let Some(pod) = pod_dir {
            let weak = Arc::downgrade(&e);
            let stop = Arc::clone(&e.stop);
            let trust = std::thread::Builder::new()
                .name("vgpu-ebpf-pod".into())
                .spawn(move || {
                    let mut known = Vec::new();
                    while !stop.load(Ordering::Relaxed) {
                        let Some(e) = weak.upgrade() else { return };
                        e.trust_containers_of(&pod, &mut known);
                        drop(e);
                        for _ in 0..(POD_RESCAN.as_millis() / POLL.as_millis()) {
                            if stop.load(Ordering::Relaxed) {
                                return;
                            }
                            std::thread::sleep(POLL);
                        }
                    }
                })
                .map_err(|source| EnforcementError::Path {
                    what: "thread",
                    path: PathBuf::from("vgpu-ebpf-pod"),
                    source,
                })?;
            readers.push(trust);
        }
        *lock(&e.readers) = readers;
        Ok(e)
    }

    /// The mode the gate runs in.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Lets process `pid` (host PID) open GPU nodes and watches its exit: called when it
    /// asks through the shim (`Admit`, `Hello`). A process whose memory map shows no
    /// `libvgpu.so` is not admitted (it speaks the protocol without the shim); one whose map
    /// cannot be read (gone, or the daemon lacks the permission) is. Returns whether the
    /// gate took it.
    pub fn admit(&self, pid: u32) -> bool {
        let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"));
        if let Ok(m) = &maps
            && !vgpu_core::proc_maps::maps_file_named(m, &[SHIM_FILE])
        {
            warn!(
                pid,
                "eBPF gate: not admitting a process without {SHIM_FILE} mapped"
            );
            return false;
        }
        match lock(&self.enforcer).allow_tgid(pid) {
            Ok(()) => true,
            Err(e) => {
                warn!(pid, "eBPF gate: cannot admit the process: {e}");
                false
            }
        }
    }

    /// Trusts every container cgroup of the daemon's pod not trusted yet (`known`).
    fn trust_containers_of(&self, pod: &Path, known: &mut Vec<u64>) {
        let Ok(entries) = std::fs::read_dir(pod) else {
            return;
        };
        for dir in entries.flatten().map(|e| e.path()).filter(|p| p.is_dir()) {
            let Ok(id) = vgpu_ebpf::cgroup_id(&dir) else {
                continue;
            };
            if known.contains(&id) {
                continue;
            }
            match lock(&self.enforcer).trust_cgroup(id) {
                Ok(()) => {
                    info!(cgroup = %dir.display(), "eBPF gate: a container of the daemon's pod trusted");
                    known.push(id);
                }
                Err(e) => warn!(cgroup = %dir.display(), "eBPF gate: cannot trust: {e}"),
            }
        }
    }

    fn gate_event(&self, ev: &Event, daemon: &Daemon) {
        let (what, kind) = match ev.kind {
            EventKind::Refused => ("refused", GateEventKind::Refused),
            EventKind::Audited => ("would refuse (audit)", GateEventKind::Audited),
            EventKind::Exit => return,
        };
        let attribution = self.attribution(ev.cgroup_id, daemon);
        let who = attribution.metrics_key();
        // On the stream first: whoever saw the count saw the event published.
        self.hub.publish(attributed(ev, kind, attribution));
        let mut per_pod = lock(&self.per_pod);
        let first = !per_pod.contains_key(&who);
        let key = if first && per_pod.len() >= MAX_PODS {
            "other".to_owned()
        } else {
            who.clone()
        };
        let c = per_pod.entry(key).or_default();
        if kind == GateEventKind::Refused {
            c.refused += 1;
        } else {
            c.audited += 1;
        }
        drop(per_pod);
        // Once per pod: every event is counted, the log names the pod.
        if first {
            let (major, minor) = ev.device.unwrap_or_default();
            warn!(
                pid = ev.tgid,
                comm = %ev.comm,
                cgroup_id = ev.cgroup_id,
                who = %who,
                "eBPF gate {what} an open of GPU device {major}:{minor} by a process not registered through the shim"
            );
        }
    }

    fn exit_event(&self, ev: &Event, daemon: &Daemon) {
        self.exits.fetch_add(1, Ordering::Relaxed);
        let released = daemon.process_exited(ev.tgid);
        if released > 0 {
            self.exits_released.fetch_add(1, Ordering::Relaxed);
            let now = vgpu_sys::mono_ns();
            let lag_us = now.saturating_sub(ev.time.as_nanos() as u64) / 1000;
            info!(
                pid = ev.tgid,
                connections = released,
                lag_us,
                "process exit seen by eBPF: its slices and charges released"
            );
        }
        let attribution = self.attribution(ev.cgroup_id, daemon);
        self.hub
            .publish(attributed(ev, GateEventKind::Exit, attribution));
    }

    /// Who the processes of cgroup `cgroup_id` are: its path and pod (remembered per
    /// cgroup: ids are not reused), and the pod's names when a registered process of the
    /// same pod gave them (looked for again every [`NAMES_RETRY`] while unknown).
    fn attribution(&self, cgroup_id: u64, daemon: &Daemon) -> Attribution {
        let now = Instant::now();
        if let Some((a, checked)) = lock(&self.attributions).get(&cgroup_id)
            && (a.pod_uid.is_empty()
                || !a.pod.is_empty()
                || now.duration_since(*checked) < NAMES_RETRY)
        {
            return a.clone();
        }
        let mut a = Attribution::default();
        if let Some(path) = vgpu_ebpf::find_cgroup(&self.cgroup2, cgroup_id)
            .ok()
            .flatten()
        {
            let rel = path.strip_prefix(&self.cgroup2).unwrap_or(&path);
            a.cgroup = format!("/{}", rel.display());
            if let Some(p) = vgpu_ebpf::attribution::pod_of_cgroup(&a.cgroup) {
                a.pod_uid = p.pod_uid;
                a.container_id = p.container_id.unwrap_or_default();
                names_from_tenants(&mut a, daemon);
            }
        }
        let mut cache = lock(&self.attributions);
        if cache.len() >= MAX_ATTRIBUTIONS {
            cache.clear();
        }
        cache.insert(cgroup_id, (a.clone(), now));
        a
    }

    /// The gate's events (the gRPC stream subscribes here).
    pub fn events(&self) -> &EventHub {
        &self.hub
    }

    /// Opens refused and audited so far for `who` (see [`Enforcement::metrics`]).
    pub fn opens_of(&self, who: &str) -> (u64, u64) {
        lock(&self.per_pod)
            .get(who)
            .map_or((0, 0), |c| (c.refused, c.audited))
    }

    /// Prometheus text of the eBPF families (appended to `/metrics`).
    pub fn metrics(&self) -> String {
        use vgpu_core::prom::{Family, Kind};
        let mode = mode_name(self.mode);
        let mut attached = Family::new(
            "vgpu_ebpf_program_attached",
            Kind::Gauge,
            "1 when the eBPF program is attached (with the gate's mode).",
        );
        attached.sample(&[("program", "gpu_gate"), ("mode", mode)], 1.0);
        let exit = if self.exit_watch_missing.is_some() {
            0.0
        } else {
            1.0
        };
        attached.sample(&[("program", "exit_watch"), ("mode", mode)], exit);
        let mut refused = Family::new(
            "vgpu_ebpf_refused_opens_total",
            Kind::Counter,
            "GPU device opens the gate refused, by pod (or cgroup outside pods).",
        );
        let mut audited = Family::new(
            "vgpu_ebpf_audited_opens_total",
            Kind::Counter,
            "GPU device opens the gate would refuse in enforce mode (audit), by pod (or cgroup outside pods).",
        );
        let mut pods: Vec<_> = lock(&self.per_pod)
            .iter()
            .map(|(k, v)| (k.clone(), *v))
            .collect();
        pods.sort_by(|a, b| a.0.cmp(&b.0));
        for (who, c) in &pods {
            let (pod, cgroup) = match who.split_once(' ') {
                Some(("pod", uid)) => (uid, ""),
                Some((_, path)) => ("", path),
                None => ("", who.as_str()),
            };
            let l = [("pod_uid", pod), ("cgroup", cgroup)];
            refused.sample(&l, c.refused as f64);
            audited.sample(&l, c.audited as f64);
        }
        let mut exits = Family::new(
            "vgpu_ebpf_exit_events_total",
            Kind::Counter,
            "Process exits the kernel reported (registered or GPU-opening processes).",
        );
        exits.sample(&[], self.exits.load(Ordering::Relaxed) as f64);
        let mut releases = Family::new(
            "vgpu_ebpf_exit_releases_total",
            Kind::Counter,
            "Exits of registered processes whose slices and charges the exit event released.",
        );
        releases.sample(&[], self.exits_released.load(Ordering::Relaxed) as f64);
        let mut lost = Family::new(
            "vgpu_ebpf_events_lost_total",
            Kind::Counter,
            "Events dropped because a ring buffer was full.",
        );
        let counters = lock(&self.enforcer).counters().ok();
        let (lost_gate, lost_exit) = counters.map_or((0, 0), |c| (c.lost, c.exit_lost));
        lost.sample(&[("ring", "gate")], lost_gate as f64);
        lost.sample(&[("ring", "exit")], lost_exit as f64);
        let mut stream_lost = Family::new(
            "vgpu_ebpf_stream_events_dropped_total",
            Kind::Counter,
            "Events the gRPC event stream dropped for subscribers that read too slowly (once per subscriber).",
        );
        stream_lost.sample(&[], self.hub.dropped() as f64);
        let mut s = String::new();
        for f in [
            &attached,
            &refused,
            &audited,
            &exits,
            &releases,
            &lost,
            &stream_lost,
        ] {
            f.write(&mut s);
        }
        s
    }
}

impl crate::daemon::DeviceGate for Enforcement {
    fn admit(&self, pid: u32) -> bool {
        Enforcement::admit(self, pid)
    }

    fn metrics(&self) -> String {
        Enforcement::metrics(self)
    }

    fn revoke(&self, pid: u32) -> bool {
        match lock(&self.enforcer).forget_tgid(pid) {
            Ok(()) => true,
            Err(e) => {
                warn!(
                    pid,
                    "eBPF gate: cannot withdraw the process's admission: {e}"
                );
                false
            }
        }
    }
}

impl Drop for Enforcement {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for r in lock(&self.readers).drain(..) {
            let _ = r.join();
        }
    }
}

fn spawn_reader(
    name: &str,
    mut reader: EventReader,
    stop: Arc<AtomicBool>,
    mut on_event: impl FnMut(Event) + Send + 'static,
) -> Result<JoinHandle<()>, EnforcementError> {
    std::thread::Builder::new()
        .name(name.to_owned())
        .spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                match reader.next_timeout(POLL) {
                    Ok(Some(ev)) => on_event(ev),
                    Ok(None) => {}
                    Err(e) => {
                        warn!("eBPF event reader stopped: {e}");
                        return;
                    }
                }
            }
        })
        .map_err(|source| EnforcementError::Path {
            what: "thread",
            path: PathBuf::from(name),
            source,
        })
}

/// `ev` as the daemon hands it on.
fn attributed(ev: &Event, kind: GateEventKind, who: Attribution) -> GateEvent {
    let monotonic_ns = u64::try_from(ev.time.as_nanos()).unwrap_or(u64::MAX);
    // The kernel's time is CLOCK_MONOTONIC; the wall clock is now less the age.
    let age_ns = vgpu_sys::mono_ns().saturating_sub(monotonic_ns);
    let unix_ns = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
    GateEvent {
        seq: 0,
        kind,
        tgid: ev.tgid,
        pid: ev.pid,
        comm: ev.comm.clone(),
        cgroup_id: ev.cgroup_id,
        device: ev.device,
        time_unix_ms: unix_ns.saturating_sub(age_ns) / 1_000_000,
        monotonic_ns,
        who,
        second_line: None,
        not_enforcing: None,
    }
}

/// Fills the names of `a`'s pod from a tenant whose registered process runs in the same
/// pod (the container's name too when it is the same container).
pub(crate) fn names_from_tenants(a: &mut Attribution, daemon: &Daemon) {
    for t in daemon.snapshot().tenants {
        if t.pod.is_empty() {
            continue;
        }
        for pid in &t.pids {
            let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/cgroup")) else {
                continue;
            };
            let Some(rel) = text.lines().find_map(|l| l.strip_prefix("0::")) else {
                continue;
            };
            let Some(p) = vgpu_ebpf::attribution::pod_of_cgroup(rel) else {
                continue;
            };
            if p.pod_uid != a.pod_uid {
                continue;
            }
            a.namespace.clone_from(&t.namespace);
            a.pod.clone_from(&t.pod);
            if !a.container_id.is_empty() && p.container_id.as_deref() == Some(&a.container_id) {
                a.container.clone_from(&t.container);
                return;
            }
        }
    }
}

/// NVIDIA's majors from `/proc/devices` and the numbers of every `nvidia*` character
/// node in `dev_dir`.
fn gpu_devices(dev_dir: &Path) -> Result<Vec<GpuDevice>, EnforcementError> {
    let proc_devices = read("/proc/devices", Path::new("/proc/devices"))?;
    let mut devices = vgpu_ebpf::config::gpu_devices_from_proc_devices(&proc_devices);
    let entries = std::fs::read_dir(dev_dir).map_err(|source| EnforcementError::Path {
        what: "--ebpf-dev-dir",
        path: dev_dir.to_owned(),
        source,
    })?;
    for entry in entries.flatten() {
        if !entry.file_name().to_string_lossy().starts_with("nvidia") {
            continue;
        }
        if let Ok(d) = GpuDevice::from_node(&entry.path()) {
            // A whole major already covers its minors.
            let major = GpuDevice {
                major: d.major,
                minor: None,
            };
            if !devices.contains(&major) {
                devices.push(major);
            }
        }
    }
    Ok(devices)
}

/// The daemon's own cgroup2 directory (`0::` line of `/proc/self/cgroup`).
fn own_cgroup(cgroup2: &Path) -> Option<PathBuf> {
    let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let rel = text.lines().find_map(|l| l.strip_prefix("0::"))?;
    let dir = cgroup2.join(rel.trim_start_matches('/'));
    dir.is_dir().then_some(dir)
}

fn read(what: &'static str, path: &Path) -> Result<String, EnforcementError> {
    std::fs::read_to_string(path).map_err(|source| EnforcementError::Path {
        what,
        path: path.to_owned(),
        source,
    })
}

fn mode_name(m: Mode) -> &'static str {
    match m {
        Mode::Off => "off",
        Mode::Audit => "audit",
        Mode::Enforce => "enforce",
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every critical section leaves its data consistent (counters, a map insert).
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enforce_fails_closed_and_keeps_a_standing_gate_unless_told_to_serve() {
        let closed = on_attach_failure(Mode::Enforce, EnforceFallback::Refuse);
        assert!(closed.keep_pins && closed.fail_closed);
        let open = on_attach_failure(Mode::Enforce, EnforceFallback::Serve);
        assert!(!open.keep_pins && !open.fail_closed);
        // Audit never refuses an open: it runs on, whatever the fallback.
        for f in [EnforceFallback::Refuse, EnforceFallback::Serve] {
            let a = on_attach_failure(Mode::Audit, f);
            assert!(!a.keep_pins && !a.fail_closed);
        }
    }

    #[test]
    fn the_fallback_parses_its_two_names_and_names_a_bad_one() {
        assert_eq!("refuse".parse(), Ok(EnforceFallback::Refuse));
        assert_eq!(" serve\n".parse(), Ok(EnforceFallback::Serve));
        assert_eq!(EnforceFallback::default(), EnforceFallback::Refuse);
        let e = "open".parse::<EnforceFallback>().unwrap_err();
        assert!(e.contains("\"open\""), "{e}");
    }

    #[test]
    fn a_failure_shows_both_programs_at_0_with_the_mode_asked_for() {
        let f = EbpfFailure {
            mode: Mode::Enforce,
            reason: "missing capabilities".into(),
            fail_closed: true,
        };
        let m = f.metrics();
        assert!(
            m.contains("vgpu_ebpf_program_attached{program=\"gpu_gate\",mode=\"enforce\"} 0"),
            "{m}"
        );
        assert!(
            m.contains("vgpu_ebpf_program_attached{program=\"exit_watch\",mode=\"enforce\"} 0"),
            "{m}"
        );
        let r = f.refusal();
        assert!(
            r.contains("missing capabilities") && r.contains("refused"),
            "{r}"
        );
    }
}
