//! The node's state: tenants (containers), their processes (connections), one
//! [`Arbiter`] per GPU and one timer thread for all of them, and the NVML observations.
//! The daemon carries out what the arbiters decide: it stores grant words,
//! sends messages and reads claims (`effects`); it decides nothing about grants itself.
//!
//! One mutex guards tenants, connections and arbiters together: events are few
//! (hundreds per second per GPU) and every one of them touches all three, so a single
//! short critical section is both simplest and fastest. No I/O happens under it except
//! non-blocking channel sends and futex wakes.
//!
//! Registration (the quota file's rule, the node's GPUs, the bounds on client state, the
//! containers' health records) lives in the child module `registration`; suspending
//! and resuming containers by the driver's checkpoint API in `suspension`.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::mpsc::UnboundedSender;
use tracing::{info, warn};
use vgpu_core::container_quota::same_gpu;
use vgpu_core::sched_proto::{ComputeSettings, ContainerIdent, DaemonMsg, PROTO_VERSION};
use vgpu_sys::mono_ns;

use crate::arbiter::{Arbiter, Event, Params, TenantId};
use crate::board::Board;
use crate::model::{
    ContainerHealth, Gpu, GpuObservation, GpuProcess, NodeSnapshot, SettingsChange, SettingsSource,
    SliceState, Tenant, TenantGpu,
};

mod effects;
mod fallback;
mod refusals;
mod registration;
mod suspension;

pub use suspension::{
    Checkpoints, Resumed, Settings as SuspensionSettings, SuspendError, Suspended, fits_host,
    resume_all, suspend_all,
};

use effects::execute;

/// The daemon's configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// The shims' socket.
    pub socket: PathBuf,
    /// Scheduling tunables.
    pub params: Params,
    /// If set, the quota file's path inside containers: the daemon reads it through
    /// `/proc/<pid>/root` and takes compute settings from it, ignoring the shim's.
    pub trusted_quota_file: Option<PathBuf>,
    /// Settings for a process with no trusted settings (when `trusted_quota_file` is
    /// set and the file is absent).
    pub default_settings: ComputeSettings,
    /// Where operators' live settings (API) are kept across daemon restarts (None: not
    /// kept).
    pub state_file: Option<PathBuf>,
    /// The node's GPUs (UUIDs, `--gpu`). Empty: the GPUs the NVML watcher reads; before
    /// (or without) a reading the daemon cannot tell a real GPU from a made-up one and
    /// keeps at most [`MAX_UNVERIFIED_GPUS`].
    pub gpus: Vec<String>,
}

/// A configuration value the daemon cannot run with.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{setting} {value}: {reason}")]
pub struct ConfigError {
    /// The setting (its flag).
    pub setting: &'static str,
    /// Its value.
    pub value: String,
    /// What is wrong with it.
    pub reason: String,
}

impl Config {
    /// The queue-ahead bound the `Welcome` names, µs: the deepest any grant may give
    /// (ADR 0032). The shims take each grant's bound at most this; every grant names its
    /// own, so a process registering while its tenant holds the GPU may queue up to this
    /// until the next grant (charged to it as any of its work). 0: unbounded.
    pub fn deepest_queue_ahead_us(&self) -> u64 {
        let p = &self.params;
        if p.queue_ahead_ns == 0 {
            return 0;
        }
        (p.queue_ahead_ns.max(p.max_queue_ahead_ns) / 1000).max(1)
    }

    /// Checks every value, naming the first bad one.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |setting, value: String, reason: &str| ConfigError {
            setting,
            value,
            reason: reason.to_owned(),
        };
        let q = self.params.quantum_ns;
        if !(500_000..=1_000_000_000).contains(&q) {
            return Err(bad(
                "--quantum-ms",
                format!("{}", q as f64 / 1e6),
                "out of range (0.5–1000)",
            ));
        }
        if self.params.drain_timeout_ns > 60_000_000_000 {
            return Err(bad(
                "--drain-timeout-ms",
                (self.params.drain_timeout_ns / 1_000_000).to_string(),
                "out of range (0–60000)",
            ));
        }
        if !(1..=100).contains(&self.params.min_charge_pct) {
            return Err(bad(
                "--min-charge-pct",
                self.params.min_charge_pct.to_string(),
                "out of range (1–100)",
            ));
        }
        if self.params.co_hold_fill_pct > 100 {
            return Err(bad(
                "--co-hold-fill-pct",
                self.params.co_hold_fill_pct.to_string(),
                "out of range (0–100)",
            ));
        }
        if self.params.queue_ahead_ns > 10_000_000_000 {
            return Err(bad(
                "--queue-ahead-us",
                (self.params.queue_ahead_ns / 1000).to_string(),
                "out of range (0–10000000)",
            ));
        }
        if let Err(e) = self.default_settings.validate() {
            return Err(bad(
                "--default-share",
                self.default_settings.share_pct.to_string(),
                &e,
            ));
        }
        for (i, u) in self.gpus.iter().enumerate() {
            if !valid_uuid(u) {
                return Err(bad("--gpu", u.clone(), "not a GPU UUID (GPU-…)"));
            }
            if self.gpus[..i].iter().any(|o| same_gpu(o, u)) {
                return Err(bad("--gpu", u.clone(), "listed twice"));
            }
        }
        if let Some(p) = &self.trusted_quota_file
            && !p.is_absolute()
        {
            return Err(bad(
                "--trusted-quota-file",
                p.display().to_string(),
                "must be an absolute path (inside the container)",
            ));
        }
        Ok(())
    }
}

/// Whether `uuid` looks like a GPU UUID (`GPU-…`, at most 96 bytes).
fn valid_uuid(uuid: &str) -> bool {
    let u = uuid.trim();
    u.len() > 4 && u.len() <= 96 && u.starts_with("GPU-")
}

/// Most processes registered at once (the whole node).
pub const MAX_CONNECTIONS: usize = 4096;
/// Most processes of one tenant (container) registered at once.
pub const MAX_CONNS_PER_TENANT: usize = 1024;
/// Most distinct GPUs kept while the daemon does not know the node's GPUs (no `--gpu`,
/// no NVML reading yet): far above any node, far below what would cost memory or time.
pub const MAX_UNVERIFIED_GPUS: usize = 64;
/// Longest namespace, pod or container name (Kubernetes allows 253).
pub const MAX_NAME: usize = 253;
/// Longest container directory path.
pub const MAX_CONTAINER_DIR: usize = 4096;
/// Most containers whose fallbacks and refusals are remembered ([`ContainerHealth`]).
pub const MAX_HEALTH_RECORDS: usize = 4096;

/// Operators' settings: tenant key → GPU UUID → settings.
type Overrides = BTreeMap<String, BTreeMap<String, ComputeSettings>>;

/// A message queue to one connection's writer.
pub type Outbox = UnboundedSender<DaemonMsg>;

#[derive(Debug)]
struct Conn {
    pid: u32,
    tenant: String,
    /// Process GPU index → GPU UUID (None: not granted, not scheduled).
    gpus: Vec<Option<String>>,
    out: Outbox,
    /// A duplicate of its socket, to see whether it sent what the daemon has not read
    /// yet ([`Daemon::watch_input`]; None: not watched).
    input: Option<OwnedFd>,
}

impl Conn {
    fn uses(&self, uuid: &str) -> bool {
        self.gpus.iter().any(|u| u.as_deref() == Some(uuid))
    }

    fn index_of(&self, uuid: &str) -> Option<usize> {
        self.gpus.iter().position(|u| u.as_deref() == Some(uuid))
    }
}

/// What a registered GPU gets.
#[derive(Debug, Clone, Copy)]
enum Resolved {
    /// Scheduled with these settings.
    Scheduled(ComputeSettings, SettingsSource),
    /// The container was not granted it: not scheduled.
    NotGranted,
}

#[derive(Debug)]
struct TenantGpuRec {
    word: usize,
    settings: ComputeSettings,
    source: SettingsSource,
    memory_quota: Option<u64>,
    /// Memory reported per connection.
    memory: HashMap<u64, u64>,
    /// Refused allocations each connection reported last (a running count).
    refused: HashMap<u64, u64>,
}

#[derive(Debug)]
struct TenantRec {
    id: TenantId,
    ident: ContainerIdent,
    board: Arc<Board>,
    gpus: BTreeMap<String, TenantGpuRec>,
    conns: HashSet<u64>,
}

/// One GPU: its arbiter, and when it asked to be ticked next.
#[derive(Debug)]
struct GpuRec {
    arbiter: Arbiter,
    /// The arbiter's latest [`WakeAt`](crate::arbiter::Effect::WakeAt).
    wake_at: Option<u64>,
}

#[derive(Debug, Default)]
struct Inner {
    tenants: HashMap<String, TenantRec>,
    by_id: HashMap<TenantId, String>,
    gpus: BTreeMap<String, GpuRec>,
    conns: HashMap<u64, Conn>,
    next_id: u64,
    observations: Vec<GpuObservation>,
    /// Host PID → tenant of every process registered while the observations were taken
    /// (before or after the NVML reading): a process that exits after the reading is
    /// still in it, and is not a bypass.
    observed_tenants: HashMap<u32, String>,
    overrides: Overrides,
    /// Fallbacks and refused registrations per container (tenant key).
    health: BTreeMap<String, ContainerHealth>,
    /// Processes in local fallback now (their connection closed while they ran), by
    /// host PID.
    detached: BTreeMap<u32, fallback::Detached>,
    /// Processes whose connection closed as they exited: oldest first, kept
    /// [`EXIT_GRACE_NS`] (at most [`MAX_EXITED`]).
    exited: VecDeque<fallback::Exited>,
}

/// How long a process that exited stays attributed to its tenant in NVML readings: the
/// driver frees an exiting process's memory after its shim said goodbye, and on an H200 a
/// reading taken in between listed two tenants' processes as bypasses (their containers
/// throttled to 0.5 CPU exited slowly).
pub const EXIT_GRACE_NS: u64 = 5_000_000_000;
/// Most exited processes remembered for [`EXIT_GRACE_NS`] (the oldest make room).
const MAX_EXITED: usize = 4096;

/// The daemon: shared by the server tasks, the timer threads and the API.
#[derive(Debug)]
pub struct Daemon {
    cfg: Config,
    started: Instant,
    inner: Mutex<Inner>,
    /// Woken when any scheduler's deadline may have moved.
    timer: Condvar,
    /// The eBPF device gate and exit watcher, when attached.
    gate: std::sync::OnceLock<Arc<dyn DeviceGate>>,
    /// Why there is no gate (`--ebpf off`, or why eBPF cannot run), when there is none.
    no_gate: std::sync::OnceLock<String>,
    /// What the shims' socket saw (accept errors, connections refused by a cap).
    sockets: crate::connections::SocketStats,
    /// eBPF asked for and not attached (what `/metrics`, `/readyz` and registration say).
    ebpf_failure: std::sync::OnceLock<crate::enforcement::EbpfFailure>,
    /// What the second line did (ADR 0039).
    second_line: crate::second_line::Stats,
    /// The node's enforcement events: the gate's, the second line's, enforce failing
    /// closed (the gRPC API's event stream; the device plugin posts them).
    events: Arc<crate::gate_events::EventHub>,
    /// Suspended containers and the driver's checkpoint API (issue 43).
    susp: suspension::Suspensions,
}

/// Why a registration or an API call was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DaemonError {
    /// The shim speaks another protocol version.
    #[error("protocol version {0} is not supported (this daemon speaks {PROTO_VERSION})")]
    Version(u32),
    /// Bad settings or request.
    #[error("{0}")]
    Invalid(String),
    /// No such tenant.
    #[error("no tenant {0:?}")]
    NoTenant(String),
}

/// The node's GPU device gate as the daemon uses it: the eBPF gate
/// ([`crate::enforcement::Enforcement`]) implements it, and calls back into the daemon
/// ([`Daemon::process_exited`]) when a process exits.
pub trait DeviceGate: Send + Sync + std::fmt::Debug {
    /// Lets process `pid` (host PID) open GPU device nodes; whether the gate took it.
    fn admit(&self, pid: u32) -> bool;
    /// The gate's Prometheus families, for `/metrics`.
    fn metrics(&self) -> String;
    /// Withdraws process `pid`'s admission (the second line: no new GPU device opens);
    /// whether the gate took it.
    fn revoke(&self, _pid: u32) -> bool {
        false
    }
}

/// One tenant as the second line charges it (ADR 0039).
#[derive(Debug, Clone)]
pub struct LedgerTenant {
    /// The tenant key.
    pub key: String,
    /// Its registered processes (host PIDs).
    pub pids: Vec<u32>,
    /// Per GPU: its memory quota, and what each registered process's shim reported, by PID.
    pub gpus: Vec<(String, Option<u64>, HashMap<u32, u64>)>,
}

/// What a registration returns to the server.
#[derive(Debug)]
pub struct Registered {
    /// The connection's id.
    pub conn: u64,
    /// The tenant's board (its descriptor goes to the process).
    pub board: Arc<Board>,
    /// The welcome message.
    pub welcome: DaemonMsg,
}

impl Daemon {
    /// A daemon with no tenants; call [`Daemon::spawn_timer`] to start scheduling.
    pub fn new(cfg: Config) -> Arc<Daemon> {
        Arc::new(Daemon {
            cfg,
            started: Instant::now(),
            inner: Mutex::new(Inner::default()),
            timer: Condvar::new(),
            gate: std::sync::OnceLock::new(),
            no_gate: std::sync::OnceLock::new(),
            sockets: crate::connections::SocketStats::default(),
            ebpf_failure: std::sync::OnceLock::new(),
            second_line: crate::second_line::Stats::default(),
            events: Arc::new(crate::gate_events::EventHub::new()),
            susp: suspension::Suspensions::default(),
        })
    }

    /// What the shims' socket saw, for `/metrics`.
    pub fn sockets(&self) -> &crate::connections::SocketStats {
        &self.sockets
    }

    /// Loads operators' settings saved by an earlier run (`state_file`); returns how
    /// many tenant GPUs they cover. A missing file is an empty state; a malformed one is
    /// an error naming the file.
    pub fn load_state(&self) -> Result<usize, String> {
        let Some(path) = &self.cfg.state_file else {
            return Ok(0);
        };
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
            Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
        };
        let o: Overrides = serde_json::from_str(&text)
            .map_err(|e| format!("{}: not a vgpu-daemon state file: {e}", path.display()))?;
        for (k, m) in &o {
            for (u, st) in m {
                st.validate()
                    .map_err(|e| format!("{}: tenant {k} GPU {u}: {e}", path.display()))?;
            }
        }
        let n = o.values().map(BTreeMap::len).sum();
        self.lock().overrides = o;
        Ok(n)
    }

    fn save_state(&self, o: &Overrides) {
        let Some(path) = &self.cfg.state_file else {
            return;
        };
        let tmp = path.with_extension("tmp");
        let text = serde_json::to_string_pretty(o).unwrap_or_default();
        let r = std::fs::write(&tmp, text).and_then(|()| std::fs::rename(&tmp, path));
        if let Err(e) = r {
            warn!(
                "cannot save the live settings to {}: {e} (they hold until a restart)",
                path.display()
            );
        }
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// One process of each tenant (its first registered), host PIDs: whose cgroup says
    /// whether the container is stopped ([`crate::stopped`]).
    pub fn tenant_pids(&self) -> Vec<(TenantId, u32)> {
        let g = self.lock();
        g.tenants
            .values()
            .filter_map(|t| {
                let conn = t.conns.iter().min()?;
                Some((t.id, g.conns.get(conn)?.pid))
            })
            .collect()
    }

    /// Tenant `tid`'s container was stopped by its CPU limit for this part of the
    /// recent time (0..=1), by a group of CFS period `period_ns`, on every GPU it uses.
    pub fn note_stopped(&self, tid: TenantId, stopped: f64, period_ns: Option<u64>) {
        let mut g = self.lock();
        let now = mono_ns();
        let uuids: Vec<String> = g.gpus.keys().cloned().collect();
        for u in uuids {
            let event = Event::Stopped {
                tenant: tid,
                stopped,
                period_ns,
            };
            execute(&mut g, &u, event, now);
        }
    }

    /// Starts the timer thread that ends slices and times out drains.
    pub fn spawn_timer(self: &Arc<Self>) -> std::io::Result<std::thread::JoinHandle<()>> {
        let d = Arc::clone(self);
        std::thread::Builder::new()
            .name("vgpu-sched-timer".into())
            .spawn(move || d.timer_loop())
    }

    fn timer_loop(&self) {
        let mut g = self.lock();
        loop {
            let now = mono_ns();
            let uuids: Vec<String> = g.gpus.keys().cloned().collect();
            let mut next = u64::MAX;
            // Before deciding on a tenant's absence, what the tenants sent is looked at (not
            // read).
            let unread = if g.gpus.values().any(|r| r.arbiter.absence_due(now)) {
                unread_tenants(&g)
            } else {
                BTreeSet::new()
            };
            for u in uuids {
                execute(&mut g, &u, Event::Tick { unread: &unread }, now);
                if let Some(dl) = g.gpus.get(&u).and_then(|r| r.wake_at) {
                    next = next.min(dl);
                }
            }
            let wait = if next == u64::MAX {
                Duration::from_millis(100)
            } else {
                Duration::from_nanos(next.saturating_sub(mono_ns()).max(20_000))
            };
            g = self
                .timer
                .wait_timeout(g, wait)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Watches connection `conn`'s socket (`fd`, a duplicate) for input the daemon has
    /// not read yet: the arbiter looks at it before deciding on a tenant's absence
    /// ([`Event::Tick`]).
    pub fn watch_input(&self, conn: u64, fd: OwnedFd) {
        if let Some(c) = self.lock().conns.get_mut(&conn) {
            c.input = Some(fd);
        }
    }

    /// GPU `gpu` of connection `conn`: its UUID and the tenant (None: the container was
    /// not granted it, nothing to do); an index the process did not register is an error.
    fn conn_gpu(
        &self,
        g: &Inner,
        conn: u64,
        gpu: u32,
    ) -> Result<Option<(String, TenantId)>, DaemonError> {
        let not_registered = || DaemonError::Invalid(format!("GPU index {gpu} not registered"));
        let c = g.conns.get(&conn).ok_or_else(not_registered)?;
        let Some(uuid) = c.gpus.get(gpu as usize).ok_or_else(not_registered)? else {
            return Ok(None);
        };
        let t = g.tenants.get(&c.tenant).ok_or_else(not_registered)?;
        Ok(Some((uuid.clone(), t.id)))
    }

    /// A process has launches blocked on its GPU `gpu` since `since_ns` (its shim's
    /// clock reading when the launcher blocked; believed within
    /// [`crate::arbiter::MAX_DEMAND_AGE_NS`]).
    pub fn demand(&self, conn: u64, gpu: u32, since_ns: Option<u64>) -> Result<(), DaemonError> {
        // Read under the lock (see `released`).
        let mut g = self.lock();
        let now = mono_ns();
        let Some((uuid, tid)) = self.conn_gpu(&g, conn, gpu)? else {
            return Ok(());
        };
        let event = Event::Demand {
            tenant: tid,
            conn,
            since_ns,
        };
        execute(&mut g, &uuid, event, now);
        drop(g);
        self.timer.notify_all();
        Ok(())
    }

    /// A process yielded grant `generation` on its GPU `gpu` at its expiry (ADR 0036):
    /// counted once per grant ([`Event::Expired`]). Its drain report follows, and
    /// [`Daemon::released`] answers a GPU index the process did not register.
    pub fn expired(&self, conn: u64, gpu: u32, generation: u32) {
        let mut g = self.lock();
        let now = mono_ns();
        if let Ok(Some((uuid, tid))) = self.conn_gpu(&g, conn, gpu) {
            let event = Event::Expired {
                tenant: tid,
                generation,
            };
            execute(&mut g, &uuid, event, now);
        }
    }

    /// A process reports its work drained after a revoke, or that it yielded its grant
    /// (an `Idle`, with `waiting` false), with the device time its work occupied
    /// (`busy_ns`, None: not measured).
    pub fn released(
        &self,
        conn: u64,
        gpu: u32,
        generation: u32,
        end_ns: u64,
        busy_ns: Option<u64>,
        launches: u64,
        waiting: bool,
    ) -> Result<(), DaemonError> {
        // Read under the lock: a decision taken meanwhile by another holder of it (the
        // timer's revoke) is never later than this event's time.
        let mut g = self.lock();
        let now = mono_ns();
        let Some((uuid, tid)) = self.conn_gpu(&g, conn, gpu)? else {
            return Ok(());
        };
        let procs: HashSet<u64> = g
            .by_id
            .get(&tid)
            .and_then(|k| g.tenants.get(k))
            .map(|t| {
                t.conns
                    .iter()
                    .copied()
                    .filter(|c| g.conns.get(c).is_some_and(|c| c.uses(&uuid)))
                    .collect()
            })
            .unwrap_or_default();
        let event = Event::DrainReport {
            tenant: tid,
            conn,
            generation,
            end_ns,
            busy_ns,
            launches,
            waiting,
            procs: &procs,
        };
        execute(&mut g, &uuid, event, now);
        drop(g);
        self.timer.notify_all();
        Ok(())
    }

    /// A process reports the container's memory use on `gpu`.
    pub fn usage(&self, conn: u64, gpu: u32, memory_used: u64) -> Result<(), DaemonError> {
        let mut g = self.lock();
        let Some((uuid, _)) = self.conn_gpu(&g, conn, gpu)? else {
            return Ok(());
        };
        let key = g
            .conns
            .get(&conn)
            .map(|c| c.tenant.clone())
            .unwrap_or_default();
        if let Some(r) = g.tenants.get_mut(&key).and_then(|t| t.gpus.get_mut(&uuid)) {
            r.memory.insert(conn, memory_used);
        }
        Ok(())
    }

    /// Hands the daemon the node's device gate (once, at start).
    pub fn set_device_gate(&self, g: Arc<dyn DeviceGate>) {
        let _ = self.gate.set(g);
    }

    /// The node's device gate, if one is attached.
    pub fn device_gate(&self) -> Option<&Arc<dyn DeviceGate>> {
        self.gate.get()
    }

    /// Records why the node runs without a device gate (once, at start).
    pub fn set_no_device_gate(&self, why: String) {
        let _ = self.no_gate.set(why);
    }

    /// What the second line charges: every tenant, its processes, quotas and reports.
    pub fn memory_ledger(&self) -> Vec<LedgerTenant> {
        let g = self.lock();
        g.tenants
            .iter()
            .map(|(key, t)| {
                let pid_of = |conn: &u64| g.conns.get(conn).map(|c| c.pid);
                LedgerTenant {
                    key: key.clone(),
                    pids: t.conns.iter().filter_map(pid_of).collect(),
                    gpus: t
                        .gpus
                        .iter()
                        .map(|(uuid, r)| {
                            let mut by_pid: HashMap<u32, u64> = HashMap::new();
                            for (conn, bytes) in &r.memory {
                                if let Some(pid) = pid_of(conn) {
                                    *by_pid.entry(pid).or_default() += bytes;
                                }
                            }
                            (uuid.clone(), r.memory_quota, by_pid)
                        })
                        .collect(),
                }
            })
            .collect()
    }

    /// The node's enforcement events (the gate publishes its own here too).
    pub fn events(&self) -> &Arc<crate::gate_events::EventHub> {
        &self.events
    }

    /// What the second line did, for `/metrics`.
    pub fn second_line(&self) -> &crate::second_line::Stats {
        &self.second_line
    }

    /// Records that eBPF was asked for and could not be attached (once, at start).
    pub fn set_ebpf_failure(&self, f: crate::enforcement::EbpfFailure) {
        let _ = self.ebpf_failure.set(f);
    }

    /// eBPF asked for and not attached, as recorded at start.
    pub fn ebpf_failure(&self) -> Option<&crate::enforcement::EbpfFailure> {
        self.ebpf_failure.get()
    }

    /// Why new tenants are refused and the node is not ready: `--ebpf enforce` asked for,
    /// the gate not attached, and the fallback `refuse` (fail closed).
    pub fn not_ready(&self) -> Option<String> {
        self.ebpf_failure
            .get()
            .filter(|f| f.fail_closed)
            .map(crate::enforcement::EbpfFailure::refusal)
    }

    /// Why the node runs without a device gate, as recorded at start.
    pub fn no_device_gate(&self) -> &str {
        self.no_gate
            .get()
            .map_or("the GPU device gate was not started", String::as_str)
    }

    /// Process `pid` (host PID) exited, as the kernel reports it: every connection it
    /// registered is released now, even one a child inherited and keeps open. Returns how
    /// many were.
    pub fn process_exited(&self, pid: u32) -> usize {
        let conns: Vec<u64> = self
            .lock()
            .conns
            .iter()
            .filter(|(_, c)| c.pid == pid)
            .map(|(&id, _)| id)
            .collect();
        for &conn in &conns {
            self.disconnect(conn);
        }
        conns.len()
    }

    /// A connection closed: its process's charges and slice are released now.
    pub fn disconnect(&self, conn: u64) {
        // Read under the lock: a decision taken meanwhile by another holder of it (the
        // timer's revoke) is never later than this event's time.
        let mut g = self.lock();
        let now = mono_ns();
        let Some(c) = g.conns.remove(&conn) else {
            return;
        };
        let key = c.tenant.clone();
        if !Daemon::note_detached(&mut g, c.pid, &key) {
            let start = fallback::start_of(c.pid);
            Daemon::note_exited(&mut g, c.pid, key.clone(), now, start);
        }
        let (tid, last, gpus) = match g.tenants.get_mut(&key) {
            Some(t) => {
                t.conns.remove(&conn);
                for r in t.gpus.values_mut() {
                    r.memory.remove(&conn);
                    r.refused.remove(&conn);
                }
                let last = t.conns.is_empty();
                // The last process takes the tenant off every GPU it used, including
                // those only processes gone before had registered.
                let gpus: Vec<String> = if last {
                    t.gpus.keys().cloned().collect()
                } else {
                    c.gpus.iter().flatten().cloned().collect()
                };
                (t.id, last, gpus)
            }
            None => return,
        };
        for uuid in &gpus {
            let event = Event::ConnectionClosed {
                tenant: tid,
                conn,
                last,
            };
            execute(&mut g, uuid, event, now);
        }
        if last {
            g.tenants.remove(&key);
            g.by_id.remove(&tid);
            info!(tenant = %key, pid = c.pid, "tenant left");
            // A GPU no tenant uses any more is forgotten: what the daemon keeps is
            // bounded by what is registered now, whatever clients named before.
            for uuid in &gpus {
                if !g.tenants.values().any(|t| t.gpus.contains_key(uuid)) {
                    g.gpus.remove(uuid);
                }
            }
        }
        drop(g);
        self.timer.notify_all();
    }

    /// Changes a tenant's settings live, on one GPU or all of its GPUs.
    pub fn set_settings(
        &self,
        tenant: &str,
        gpu_uuid: Option<&str>,
        change: SettingsChange,
    ) -> Result<(), DaemonError> {
        if let Some(s) = change.share_pct
            && !(1..=100).contains(&s)
        {
            return Err(DaemonError::Invalid(format!(
                "compute share {s} % is out of range (1–100)"
            )));
        }
        // Read under the lock: a decision taken meanwhile by another holder of it (the
        // timer's revoke) is never later than this event's time.
        let mut g = self.lock();
        let now = mono_ns();
        let inner = &mut *g;
        let t = inner
            .tenants
            .get_mut(tenant)
            .ok_or_else(|| DaemonError::NoTenant(tenant.to_owned()))?;
        if let Some(u) = gpu_uuid
            && !t.gpus.contains_key(u)
        {
            return Err(DaemonError::Invalid(format!(
                "tenant {tenant} does not use GPU {u}"
            )));
        }
        let tid = t.id;
        let mut changed = Vec::new();
        for (uuid, r) in t.gpus.iter_mut() {
            if gpu_uuid.is_some_and(|u| u != uuid) {
                continue;
            }
            if let Some(s) = change.share_pct {
                r.settings.share_pct = s;
            }
            if let Some(p) = change.policy {
                r.settings.policy = p;
            }
            if let Some(p) = change.priority {
                r.settings.priority = p;
            }
            r.source = SettingsSource::Api;
            changed.push((uuid.clone(), r.settings));
        }
        let conns: Vec<u64> = t.conns.iter().copied().collect();
        for (uuid, s) in &changed {
            for c in &conns {
                if let Some(conn) = inner.conns.get(c)
                    && let Some(i) = conn.index_of(uuid)
                {
                    let _ = conn.out.send(DaemonMsg::Settings {
                        gpu: u32::try_from(i).unwrap_or(0),
                        settings: *s,
                    });
                }
            }
            let event = Event::SettingsChanged {
                tenant: tid,
                settings: *s,
            };
            execute(inner, uuid, event, now);
        }
        let ov = inner.overrides.entry(tenant.to_owned()).or_default();
        for (uuid, st) in &changed {
            ov.insert(uuid.clone(), *st);
        }
        let snapshot = inner.overrides.clone();
        info!(tenant, ?change, "settings changed");
        drop(g);
        self.save_state(&snapshot);
        self.timer.notify_all();
        Ok(())
    }

    /// Stores the NVML watcher's latest observations, with `registered`: the processes
    /// registered ([`Daemon::registered_pids`]) while the reading was taken. With those
    /// registered when a view is made, they attribute the reading's processes to
    /// tenants, so a tenant's process that exits (and unregisters) between the reading
    /// and a view of it is not shown as a bypass.
    pub fn record_observations(&self, obs: Vec<GpuObservation>, registered: HashMap<u32, String>) {
        let mut g = self.lock();
        g.observations = obs;
        g.observed_tenants = registered;
    }

    /// Host PIDs of the processes of tenants: registered, in local fallback, or exited
    /// less than [`EXIT_GRACE_NS`] ago. The NVML watcher attributes a reading's
    /// processes by them.
    pub fn registered_pids(&self) -> HashMap<u32, String> {
        self.registered_pids_at(mono_ns())
    }

    /// A process of tenant `key` exited at `now` (mono ns), its start time being
    /// `start_ticks` (None: already gone): its tenant's for [`EXIT_GRACE_NS`] in NVML
    /// readings, as long as its PID is not another process's.
    fn note_exited(g: &mut Inner, pid: u32, key: String, now: u64, start_ticks: Option<u64>) {
        if g.exited.len() >= MAX_EXITED {
            g.exited.pop_front();
        }
        g.exited.push_back(fallback::Exited {
            pid,
            key,
            at: now,
            start_ticks,
        });
    }

    /// [`Daemon::registered_pids`] as of `now` (mono ns).
    pub fn registered_pids_at(&self, now: u64) -> HashMap<u32, String> {
        let mut g = self.lock();
        Daemon::prune_detached(&mut g, now);
        while g
            .exited
            .front()
            .is_some_and(|e| now.saturating_sub(e.at) > EXIT_GRACE_NS)
        {
            g.exited.pop_front();
        }
        let exited = g
            .exited
            .iter()
            .filter(|e| fallback::still_the_exited(e.start_ticks, fallback::start_of(e.pid)))
            .map(|e| (e.pid, e.key.clone()));
        let detached = Daemon::detached_pids(&g);
        let conns = g.conns.values().map(|c| (c.pid, c.tenant.clone()));
        exited.chain(detached).chain(conns).collect()
    }

    /// Everything, at one instant.
    pub fn snapshot(&self) -> NodeSnapshot {
        // Read under the lock: a decision taken meanwhile by another holder of it (the
        // timer's revoke) is never later than this event's time.
        let mut g = self.lock();
        let now = mono_ns();
        let mut tenants: Vec<Tenant> = g
            .tenants
            .values()
            .map(|t| {
                let mut pids: Vec<u32> = t
                    .conns
                    .iter()
                    .filter_map(|c| g.conns.get(c).map(|c| c.pid))
                    .collect();
                pids.sort_unstable();
                pids.dedup();
                let gpus = t
                    .gpus
                    .iter()
                    .map(|(uuid, r)| {
                        let st = g.gpus.get(uuid).and_then(|x| x.arbiter.stats(t.id, now));
                        let (suspended_bytes, suspensions) = self.susp.view(&t.ident.key, uuid);
                        TenantGpu {
                            uuid: uuid.clone(),
                            settings: r.settings,
                            source: r.source,
                            memory_used: r.memory.values().copied().max().unwrap_or(0),
                            memory_quota: r.memory_quota,
                            gpu_time_ns: st.map_or(0, |s| s.used_ns),
                            throttled_ns: st.map_or(0, |s| s.throttled_ns),
                            grants: st.map_or(0, |s| s.grants),
                            recent_share_pct: st.map_or(0.0, |s| s.recent_share_pct),
                            state: st.map_or(SliceState::Idle, |s| s.state),
                            co_held: st.is_some_and(|s| s.co_held),
                            fill_pct: st.and_then(|s| s.fill).map(|f| f * 100.0),
                            cpu_stopped_pct: st.map_or(0.0, |s| s.stopped * 100.0),
                            unclaimed_grants: st.map_or(0, |s| s.unclaimed),
                            expired_grants: st.map_or(0, |s| s.expired),
                            slice_ns: st.map_or(0, |s| s.slice_ns),
                            queue_ahead_ns: st.map_or(0, |s| s.queue_ahead_ns),
                            suspended_bytes,
                            suspensions,
                        }
                    })
                    .collect();
                Tenant {
                    key: t.ident.key.clone(),
                    namespace: t.ident.namespace.clone(),
                    pod: t.ident.pod.clone(),
                    container: t.ident.container.clone(),
                    pids,
                    gpus,
                }
            })
            .collect();
        tenants.sort_by(|a, b| a.key.cmp(&b.key));
        // Registered now, else registered when the reading was taken.
        let mut pid_tenant: HashMap<u32, &str> = g
            .observed_tenants
            .iter()
            .map(|(pid, t)| (*pid, t.as_str()))
            .collect();
        pid_tenant.extend(g.conns.values().map(|c| (c.pid, c.tenant.as_str())));
        let mut gpus: Vec<Gpu> = Vec::new();
        let mut seen = HashSet::new();
        for o in &g.observations {
            seen.insert(o.uuid.clone());
            let processes: Vec<GpuProcess> = o
                .processes
                .iter()
                .map(|&(pid, used)| GpuProcess {
                    pid,
                    used_bytes: used,
                    tenant: pid_tenant.get(&pid).map(|s| (*s).to_owned()),
                })
                .collect();
            let bypass_pids = processes
                .iter()
                .filter(|p| p.tenant.is_none())
                .map(|p| p.pid)
                .collect();
            gpus.push(Gpu {
                observed: o.clone(),
                processes,
                bypass_pids,
                scheduled_ns: g.gpus.get(&o.uuid).map_or(0, |r| r.arbiter.scheduled_ns()),
                holder: holder_key(&g, &o.uuid),
            });
        }
        for (uuid, r) in &g.gpus {
            if seen.contains(uuid) {
                continue;
            }
            gpus.push(Gpu {
                observed: GpuObservation {
                    uuid: uuid.clone(),
                    index: u32::MAX,
                    ..GpuObservation::default()
                },
                processes: Vec::new(),
                bypass_pids: Vec::new(),
                scheduled_ns: r.arbiter.scheduled_ns(),
                holder: holder_key(&g, uuid),
            });
        }
        gpus.sort_by(|a, b| {
            (a.observed.index, &a.observed.uuid).cmp(&(b.observed.index, &b.observed.uuid))
        });
        NodeSnapshot {
            uptime_s: self.started.elapsed().as_secs_f64(),
            tenants,
            gpus,
            health: {
                let in_fallback = Daemon::in_fallback(&mut g, now);
                let mut health = g.health.clone();
                for (key, n) in in_fallback {
                    health
                        .entry(key.clone())
                        .or_insert_with(|| ContainerHealth {
                            key,
                            ..ContainerHealth::default()
                        })
                        .processes_in_fallback = n;
                }
                health.into_values().collect()
            },
        }
    }
}

/// The tenants with a connection whose socket holds input not read yet (or a hang-up
/// not seen yet). A failed look says none.
fn unread_tenants(g: &Inner) -> BTreeSet<TenantId> {
    let watched: Vec<(&Conn, BorrowedFd<'_>)> = g
        .conns
        .values()
        .filter_map(|c| c.input.as_ref().map(|fd| (c, fd.as_fd())))
        .collect();
    let fds: Vec<BorrowedFd<'_>> = watched.iter().map(|(_, fd)| *fd).collect();
    let Ok(ready) = vgpu_sys::poll::readable(&fds, Duration::ZERO) else {
        return BTreeSet::new();
    };
    watched
        .iter()
        .zip(ready)
        .filter(|(_, r)| *r)
        .filter_map(|((c, _), _)| g.tenants.get(&c.tenant).map(|t| t.id))
        .collect()
}

fn holder_key(g: &Inner, uuid: &str) -> Option<String> {
    let id = g.gpus.get(uuid)?.arbiter.holder()?;
    g.by_id.get(&id).cloned()
}
