//! The gRPC API (`vgpu.daemon.v1.Daemon`, `proto/vgpu_daemon_v1.proto`): tenants and
//! GPUs with their usage, and live changes of a tenant's settings. Served on a unix socket
//! (mode 0600: whoever may connect may change shares) and optionally on TCP.
//!
//! Reads are one [`Daemon::snapshot`] each; `SetSettings` is [`Daemon::set_settings`];
//! `WatchEnforcementEvents` is one subscription to the gate's
//! [`EventHub`](crate::gate_events::EventHub) (a bounded queue: a slow client loses
//! events, counted, and never slows the daemon).

use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, UnixListener, UnixStream};
use tokio_stream::wrappers::{TcpListenerStream, UnixListenerStream};
use tonic::transport::{Channel, Endpoint};
use tonic::{Request, Response, Status};
use vgpu_core::sched_proto::{ComputePolicy, ComputeSettings, Priority};

use crate::daemon::{Daemon, DaemonError};
use crate::gate_events::{Delivered, GateEventKind};
use crate::model::{self, SettingsChange, SettingsSource, SliceState};

/// The generated messages, client and server of `vgpu.daemon.v1`.
#[allow(
    missing_docs,
    clippy::all,
    unused_qualifications,
    missing_debug_implementations
)]
pub mod pb {
    tonic::include_proto!("vgpu.daemon.v1");
}

pub use pb::daemon_client::DaemonClient;
pub use pb::daemon_server::DaemonServer;

/// The API's default unix socket.
pub const DEFAULT_SOCKET: &str = "/run/vgpu/api.sock";

/// The service over a daemon.
#[derive(Debug, Clone)]
pub struct Api {
    daemon: Arc<Daemon>,
}

impl Api {
    /// The service for `daemon`.
    pub fn new(daemon: Arc<Daemon>) -> Api {
        Api { daemon }
    }

    /// The tonic server wrapping it.
    pub fn server(self) -> DaemonServer<Api> {
        DaemonServer::new(self)
    }
}

fn policy_to_pb(p: ComputePolicy) -> pb::ComputePolicy {
    match p {
        ComputePolicy::Burst => pb::ComputePolicy::Burst,
        ComputePolicy::Cap => pb::ComputePolicy::Cap,
    }
}

fn priority_to_pb(p: Priority) -> pb::Priority {
    match p {
        Priority::BestEffort => pb::Priority::BestEffort,
        Priority::LatencySensitive => pb::Priority::LatencySensitive,
    }
}

/// A wire policy as the daemon's, naming a bad value.
pub fn policy_from_pb(v: i32) -> Result<ComputePolicy, String> {
    match pb::ComputePolicy::try_from(v) {
        Ok(pb::ComputePolicy::Burst) => Ok(ComputePolicy::Burst),
        Ok(pb::ComputePolicy::Cap) => Ok(ComputePolicy::Cap),
        _ => Err(format!(
            "compute policy {v} is not valid (expected {} = burst or {} = cap)",
            pb::ComputePolicy::Burst as i32,
            pb::ComputePolicy::Cap as i32
        )),
    }
}

/// A wire priority as the daemon's, naming a bad value.
pub fn priority_from_pb(v: i32) -> Result<Priority, String> {
    match pb::Priority::try_from(v) {
        Ok(pb::Priority::BestEffort) => Ok(Priority::BestEffort),
        Ok(pb::Priority::LatencySensitive) => Ok(Priority::LatencySensitive),
        _ => Err(format!(
            "priority {v} is not valid (expected {} = best-effort or {} = latency-sensitive)",
            pb::Priority::BestEffort as i32,
            pb::Priority::LatencySensitive as i32
        )),
    }
}

fn settings_to_pb(s: &ComputeSettings) -> pb::ComputeSettings {
    pb::ComputeSettings {
        share_pct: s.share_pct,
        policy: policy_to_pb(s.policy) as i32,
        priority: priority_to_pb(s.priority) as i32,
    }
}

fn source_to_pb(s: SettingsSource) -> pb::SettingsSource {
    match s {
        SettingsSource::Shim => pb::SettingsSource::Shim,
        SettingsSource::QuotaFile => pb::SettingsSource::QuotaFile,
        SettingsSource::Api => pb::SettingsSource::Api,
        SettingsSource::Default => pb::SettingsSource::Default,
    }
}

fn state_to_pb(s: SliceState) -> pb::SliceState {
    match s {
        SliceState::Holding => pb::SliceState::Holding,
        SliceState::Draining => pb::SliceState::Draining,
        SliceState::Waiting => pb::SliceState::Waiting,
        SliceState::Idle => pb::SliceState::Idle,
    }
}

/// A reported tenant on the wire.
pub fn tenant_to_pb(t: &model::Tenant) -> pb::Tenant {
    pb::Tenant {
        key: t.key.clone(),
        namespace: t.namespace.clone(),
        pod: t.pod.clone(),
        container: t.container.clone(),
        pids: t.pids.clone(),
        gpus: t
            .gpus
            .iter()
            .map(|g| pb::TenantGpu {
                uuid: g.uuid.clone(),
                settings: Some(settings_to_pb(&g.settings)),
                source: source_to_pb(g.source) as i32,
                memory_used_bytes: g.memory_used,
                memory_quota_bytes: g.memory_quota,
                gpu_time_ns: g.gpu_time_ns,
                throttled_ns: g.throttled_ns,
                grants: g.grants,
                achieved_share_pct: g.recent_share_pct,
                state: state_to_pb(g.state) as i32,
                co_held: g.co_held,
                fill_pct: g.fill_pct,
                cpu_stopped_pct: g.cpu_stopped_pct,
                unclaimed_grants: g.unclaimed_grants,
                expired_grants: g.expired_grants,
                slice_ns: g.slice_ns,
                queue_ahead_ns: g.queue_ahead_ns,
                suspended_bytes: g.suspended_bytes,
                suspensions: g.suspensions,
            })
            .collect(),
    }
}

/// A container's health record on the wire.
pub fn health_to_pb(h: &model::ContainerHealth) -> pb::ContainerHealth {
    pb::ContainerHealth {
        key: h.key.clone(),
        namespace: h.namespace.clone(),
        pod: h.pod.clone(),
        container: h.container.clone(),
        fallback_periods: h.fallback_periods,
        fallback_ms: h.fallback_ms,
        last_fallback_reason: h.last_fallback_reason.clone(),
        refused_registrations: h.refused_registrations,
        last_refusal: h.last_refusal.clone(),
        memory_refusals: h
            .memory_refusals
            .iter()
            .map(|m| pb::MemoryRefusals {
                uuid: m.uuid.clone(),
                count: m.count,
                last_asked_bytes: m.last_asked,
                last_used_bytes: m.last_used,
                last_quota_bytes: m.last_quota,
                last_unix_ms: m.last_unix_ms,
            })
            .collect(),
        processes_in_fallback: h.processes_in_fallback,
    }
}

/// A reported GPU on the wire.
pub fn gpu_to_pb(g: &model::Gpu) -> pb::Gpu {
    let o = &g.observed;
    pb::Gpu {
        uuid: o.uuid.clone(),
        index: (o.index != u32::MAX).then_some(o.index),
        name: o.name.clone(),
        memory_total_bytes: o.memory_total,
        memory_used_bytes: o.memory_used,
        utilization_pct: o.utilization_pct,
        processes: g
            .processes
            .iter()
            .map(|p| pb::GpuProcess {
                pid: p.pid,
                used_bytes: p.used_bytes,
                tenant: p.tenant.clone(),
                bypass: p.tenant.is_none(),
            })
            .collect(),
        bypass_pids: g.bypass_pids.clone(),
        scheduled_ns: g.scheduled_ns,
        holder: g.holder.clone(),
        observed_unix_ms: o.observed_unix_ms,
    }
}

/// Checks a `SetSettings` request and turns it into a change; the error names the bad
/// value.
pub fn change_from_pb(r: &pb::SetSettingsRequest) -> Result<SettingsChange, String> {
    if r.tenant.is_empty() {
        return Err("tenant key is empty".into());
    }
    if let Some(s) = r.share_pct
        && !(1..=100).contains(&s)
    {
        return Err(format!("compute share {s} % is out of range (1–100)"));
    }
    if let Some(u) = &r.gpu_uuid
        && !u.starts_with("GPU-")
    {
        return Err(format!("GPU UUID {u:?} does not start with \"GPU-\""));
    }
    let change = SettingsChange {
        share_pct: r.share_pct,
        policy: r.policy.map(policy_from_pb).transpose()?,
        priority: r.priority.map(priority_from_pb).transpose()?,
    };
    if change == SettingsChange::default() {
        return Err("nothing to change: give a share, a policy or a priority".into());
    }
    Ok(change)
}

/// A gate event, as one subscriber receives it, on the wire.
pub fn event_to_pb(d: &Delivered) -> pb::EnforcementEvent {
    let e = &d.event;
    let kind = match e.kind {
        GateEventKind::Refused => pb::EnforcementEventKind::Refused,
        GateEventKind::Audited => pb::EnforcementEventKind::Audited,
        GateEventKind::Exit => pb::EnforcementEventKind::Exit,
        GateEventKind::Memory => pb::EnforcementEventKind::Memory,
        GateEventKind::NotEnforcing => pb::EnforcementEventKind::NotEnforcing,
    };
    let (device_major, device_minor) = e.device.unwrap_or_default();
    pb::EnforcementEvent {
        seq: e.seq,
        kind: kind as i32,
        tgid: e.tgid,
        pid: e.pid,
        comm: e.comm.clone(),
        cgroup_id: e.cgroup_id,
        cgroup: e.who.cgroup.clone(),
        device_major,
        device_minor,
        time_unix_ms: e.time_unix_ms,
        monotonic_ns: e.monotonic_ns,
        pod_uid: e.who.pod_uid.clone(),
        container_id: e.who.container_id.clone(),
        namespace: e.who.namespace.clone(),
        pod: e.who.pod.clone(),
        container: e.who.container.clone(),
        lost_before: d.lost_before,
        second_line: e.second_line.as_ref().map(|a| pb::SecondLineAction {
            action: a.action.to_owned(),
            reason: a.reason.to_owned(),
            second_driver: a.second_driver,
            unregistered: a.unregistered,
            gpu_uuid: a.gpu.clone(),
            held_bytes: a.held,
            quota_bytes: a.quota,
            limit_bytes: a.limit,
            over_ms: a.over_ms,
            process_held_bytes: a.process_held,
            refused_at_gate: a.refused_at_gate,
            killed: a.killed,
            tenant: a.tenant.clone(),
        }),
        not_enforcing: e.not_enforcing.as_ref().map(|n| pb::NotEnforcing {
            mode: n.mode.to_owned(),
            reason: n.reason.clone(),
            fail_closed: n.fail_closed,
        }),
    }
}

/// The response header of `WatchEnforcementEvents` that says why there is no eBPF gate
/// (absent when one is attached).
pub const GATE_HEADER: &str = "vgpu-gate";

/// The stream of `WatchEnforcementEvents`.
pub type EventStream = std::pin::Pin<
    Box<dyn tokio_stream::Stream<Item = Result<pb::EnforcementEvent, Status>> + Send + 'static>,
>;

fn status_of(e: DaemonError) -> Status {
    match e {
        DaemonError::NoTenant(_) => Status::not_found(e.to_string()),
        DaemonError::Invalid(_) | DaemonError::Version(_) => {
            Status::invalid_argument(e.to_string())
        }
    }
}

fn suspend_status(e: crate::daemon::SuspendError) -> Status {
    use crate::daemon::SuspendError as E;
    match e {
        E::NoTenant(_) => Status::not_found(e.to_string()),
        E::HostMemory { .. } | E::Off => Status::resource_exhausted(e.to_string()),
        E::Driver(_) | E::Restore { .. } => Status::unavailable(e.to_string()),
        E::NoProcesses(_) | E::AlreadySuspended(_) | E::Lock { .. } | E::Checkpoint { .. } => {
            Status::failed_precondition(e.to_string())
        }
    }
}

fn ms(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[tonic::async_trait]
impl pb::daemon_server::Daemon for Api {
    async fn suspend(
        &self,
        r: Request<pb::SuspendRequest>,
    ) -> Result<Response<pb::SuspendResponse>, Status> {
        let key = r.into_inner().tenant;
        let d = Arc::clone(&self.daemon);
        let s = tokio::task::spawn_blocking(move || d.suspend(&key))
            .await
            .map_err(|e| Status::internal(format!("the suspension task failed: {e}")))?
            .map_err(suspend_status)?;
        Ok(Response::new(pb::SuspendResponse {
            pids: s.pids,
            bytes: s.bytes.values().fold(0u64, |a, b| a.saturating_add(*b)),
            took_ms: ms(s.took),
        }))
    }

    async fn resume(
        &self,
        r: Request<pb::ResumeRequest>,
    ) -> Result<Response<pb::ResumeResponse>, Status> {
        let key = r.into_inner().tenant;
        let d = Arc::clone(&self.daemon);
        let s = tokio::task::spawn_blocking(move || d.resume(&key))
            .await
            .map_err(|e| Status::internal(format!("the resume task failed: {e}")))?
            .map_err(suspend_status)?;
        Ok(Response::new(pb::ResumeResponse {
            was_suspended: s.was_suspended,
            took_ms: ms(s.took),
        }))
    }

    type WatchEnforcementEventsStream = EventStream;

    async fn watch_enforcement_events(
        &self,
        r: Request<pb::WatchEnforcementEventsRequest>,
    ) -> Result<Response<EventStream>, Status> {
        let r = r.into_inner();
        // Served with or without the gate: the second line's events and enforce failing
        // closed come through here too; the header says why there is no gate.
        let rx = self.daemon.events().subscribe(r.recent as usize, r.follow);
        let stream =
            tokio_stream::StreamExt::map(tokio_stream::wrappers::ReceiverStream::new(rx), |d| {
                Ok(event_to_pb(&d))
            });
        let mut resp = Response::new(Box::pin(stream) as EventStream);
        if self.daemon.device_gate().is_none() {
            let why = self
                .daemon
                .no_device_gate()
                .replace(|c: char| !c.is_ascii() || c.is_ascii_control(), "?");
            if let Ok(v) = why.parse() {
                resp.metadata_mut().insert(GATE_HEADER, v);
            }
        }
        Ok(resp)
    }

    async fn list_tenants(
        &self,
        _: Request<pb::ListTenantsRequest>,
    ) -> Result<Response<pb::ListTenantsResponse>, Status> {
        let s = self.daemon.snapshot();
        Ok(Response::new(pb::ListTenantsResponse {
            tenants: s.tenants.iter().map(tenant_to_pb).collect(),
            uptime_seconds: s.uptime_s,
            health: s.health.iter().map(health_to_pb).collect(),
        }))
    }

    async fn get_tenant(
        &self,
        r: Request<pb::GetTenantRequest>,
    ) -> Result<Response<pb::GetTenantResponse>, Status> {
        let key = r.into_inner().key;
        let s = self.daemon.snapshot();
        let t = s
            .tenants
            .iter()
            .find(|t| t.key == key)
            .ok_or_else(|| Status::not_found(format!("no tenant {key:?}")))?;
        Ok(Response::new(pb::GetTenantResponse {
            tenant: Some(tenant_to_pb(t)),
        }))
    }

    async fn list_gpus(
        &self,
        _: Request<pb::ListGpusRequest>,
    ) -> Result<Response<pb::ListGpusResponse>, Status> {
        let s = self.daemon.snapshot();
        Ok(Response::new(pb::ListGpusResponse {
            gpus: s.gpus.iter().map(gpu_to_pb).collect(),
        }))
    }

    async fn set_settings(
        &self,
        r: Request<pb::SetSettingsRequest>,
    ) -> Result<Response<pb::SetSettingsResponse>, Status> {
        let r = r.into_inner();
        let change = change_from_pb(&r).map_err(Status::invalid_argument)?;
        self.daemon
            .set_settings(&r.tenant, r.gpu_uuid.as_deref(), change)
            .map_err(status_of)?;
        let s = self.daemon.snapshot();
        let tenant = s
            .tenants
            .iter()
            .find(|t| t.key == r.tenant)
            .map(tenant_to_pb);
        Ok(Response::new(pb::SetSettingsResponse { tenant }))
    }
}

/// Binds the API's unix socket (replacing a stale one), mode 0600.
pub fn bind_unix(path: &Path) -> io::Result<UnixListener> {
    let ctx = |e: io::Error, what: &str| {
        io::Error::new(e.kind(), format!("{what} {}: {e}", path.display()))
    };
    if let Some(dir) = path.parent()
        && !dir.as_os_str().is_empty()
    {
        std::fs::create_dir_all(dir).map_err(|e| ctx(e, "create the directory of"))?;
    }
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(ctx(e, "remove the stale socket")),
    }
    let l = UnixListener::bind(path).map_err(|e| ctx(e, "bind"))?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .map_err(|e| ctx(e, "chmod"))?;
    Ok(l)
}

/// Serves the API on a bound unix socket until the task is dropped.
pub async fn serve_unix(
    daemon: Arc<Daemon>,
    listener: UnixListener,
) -> Result<(), tonic::transport::Error> {
    tonic::transport::Server::builder()
        .add_service(Api::new(daemon).server())
        .serve_with_incoming(UnixListenerStream::new(listener))
        .await
}

/// Serves the API on a bound TCP listener until the task is dropped.
pub async fn serve_tcp(
    daemon: Arc<Daemon>,
    listener: TcpListener,
) -> Result<(), tonic::transport::Error> {
    tonic::transport::Server::builder()
        .add_service(Api::new(daemon).server())
        .serve_with_incoming(TcpListenerStream::new(listener))
        .await
}

/// Binds the API's TCP address.
pub async fn bind_tcp(addr: SocketAddr) -> io::Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .map_err(|e| io::Error::new(e.kind(), format!("API address {addr}: {e}")))
}

/// Largest answer a client of this crate accepts, bytes. The daemon's state is bounded
/// ([`crate::daemon::MAX_CONNECTIONS`] processes, names of at most 512 + 3 × 253 bytes,
/// 16 GPUs per tenant): its largest listing is about 16 MiB, above gRPC's default 4 MiB.
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;

/// A client of `ch` that accepts answers up to [`MAX_MESSAGE_BYTES`].
pub fn client(ch: Channel) -> DaemonClient<Channel> {
    DaemonClient::new(ch).max_decoding_message_size(MAX_MESSAGE_BYTES)
}

/// A client connected now to the API's unix socket (fails if nobody listens).
pub async fn connect_unix(path: &Path) -> Result<DaemonClient<Channel>, tonic::transport::Error> {
    let path: PathBuf = path.to_owned();
    // The URI is required by tonic but never resolved: the connector dials the socket.
    let ch = Endpoint::from_static("http://localhost")
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let path = path.clone();
            async move { UnixStream::connect(path).await.map(TokioIo::new) }
        }))
        .await?;
    Ok(client(ch))
}
