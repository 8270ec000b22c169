//! Prometheus metrics over HTTP: `GET /metrics` (text exposition format 0.0.4, written
//! here by hand) and `GET /healthz`.
//!
//! Every scrape renders one [`Daemon::snapshot`]: the figures are the ones the gRPC API and
//! `vgpuctl` show. Names follow Prometheus conventions (base units, `_total` counters,
//! `_bytes`, `_seconds`, ratios in 0–1). The list is in `docs/vgpu-daemon.md` and
//! `docs/operations.md`.
//!
//! Labels (ADR 0020): per-container series carry `namespace`, `pod`, `container` and, per
//! GPU, `gpu` (its UUID, vgpu's label since the start) plus DCGM exporter's own `UUID`,
//! `modelName` and `Hostname`, so that the joins of DCGM dashboards work on vgpu's series;
//! `vgpu_gpu_info` carries them for the per-GPU series.

use std::io;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use tokio::net::TcpListener;

use crate::daemon::Daemon;
use crate::model::{NodeSnapshot, SliceState, Tenant};

pub use vgpu_core::prom::{
    CONTENT_TYPE, Family, Kind, escape_label_value, format_value, render_labels,
};

fn ns_to_s(ns: u64) -> f64 {
    ns as f64 / 1e9
}

fn tenant_labels(t: &Tenant) -> [(&'static str, &str); 4] {
    [
        ("tenant", t.key.as_str()),
        ("namespace", t.namespace.as_str()),
        ("pod", t.pod.as_str()),
        ("container", t.container.as_str()),
    ]
}

/// The node's name as DCGM exporter writes it in `Hostname`: `NODE_NAME` (the downward
/// API in a DaemonSet), else the host name.
pub fn hostname() -> &'static str {
    static NAME: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    NAME.get_or_init(|| {
        if let Ok(n) = std::env::var("NODE_NAME")
            && !n.is_empty()
        {
            return n;
        }
        std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_owned())
            .unwrap_or_default()
    })
}

fn state_str(s: SliceState) -> &'static str {
    match s {
        SliceState::Holding => "holding",
        SliceState::Draining => "draining",
        SliceState::Waiting => "waiting",
        SliceState::Idle => "idle",
    }
}

/// Renders a snapshot in the Prometheus text format, `Hostname` being [`hostname`].
pub fn render(snap: &NodeSnapshot) -> String {
    render_on(snap, hostname())
}

/// Renders a snapshot in the Prometheus text format for the node `host` (`Hostname`).
pub fn render_on(snap: &NodeSnapshot, host: &str) -> String {
    use Kind::{Counter, Gauge};
    let model_of = |uuid: &str| -> String {
        snap.gpus
            .iter()
            .find(|g| g.observed.uuid == uuid)
            .map(|g| g.observed.name.clone())
            .unwrap_or_default()
    };
    let mut up = Family::new("vgpu_daemon_up", Gauge, "1 while the daemon serves.");
    up.sample(&[], 1.0);
    let mut uptime = Family::new(
        "vgpu_daemon_uptime_seconds",
        Gauge,
        "Seconds since the daemon started.",
    );
    uptime.sample(&[], snap.uptime_s);
    let mut tenants = Family::new(
        "vgpu_daemon_tenants",
        Gauge,
        "Tenants (containers) with at least one registered process.",
    );
    tenants.sample(&[], snap.tenants.len() as f64);

    let mut share = Family::new(
        "vgpu_tenant_compute_share_ratio",
        Gauge,
        "Configured compute share of the GPU (0-1).",
    );
    let mut achieved = Family::new(
        "vgpu_tenant_compute_share_achieved_ratio",
        Gauge,
        "Share of the GPU's time charged to the tenant over the recent window (0-1).",
    );
    let mut settings = Family::new(
        "vgpu_tenant_settings_info",
        Gauge,
        "Compute policy, priority and where the settings came from (value 1).",
    );
    let mut gpu_time = Family::new(
        "vgpu_tenant_gpu_time_seconds_total",
        Counter,
        "Measured GPU time charged to the tenant.",
    );
    let mut throttled = Family::new(
        "vgpu_tenant_throttled_seconds_total",
        Counter,
        "Time the tenant had launches blocked while another tenant held the GPU.",
    );
    let mut grants = Family::new(
        "vgpu_tenant_grants_total",
        Counter,
        "Time slices granted to the tenant.",
    );
    let mut unclaimed = Family::new(
        "vgpu_tenant_unclaimed_grants_total",
        Counter,
        "Time slices taken back before any of the tenant's processes launched under them (granted while its container was stopped).",
    );
    let mut expired = Family::new(
        "vgpu_tenant_expired_grants_total",
        Counter,
        "Time slices the tenant's shims yielded at their expiry because the daemon had not revoked or renewed them in time (the daemon starved of CPU or frozen).",
    );
    let mut mem_used = Family::new(
        "vgpu_tenant_memory_used_bytes",
        Gauge,
        "GPU memory charged to the container, as its shims report.",
    );
    let mut mem_quota = Family::new(
        "vgpu_tenant_memory_quota_bytes",
        Gauge,
        "The container's GPU memory quota (absent: unlimited).",
    );
    let mut state = Family::new(
        "vgpu_tenant_slice_state",
        Gauge,
        "Scheduling state of the tenant on the GPU (1 for the current state).",
    );
    let mut co_held = Family::new(
        "vgpu_tenant_co_held",
        Gauge,
        "1 while the tenant holds the GPU beside another tenant (co-holding, ADR 0029).",
    );
    let mut cpu_stopped = Family::new(
        "vgpu_tenant_cpu_stopped_ratio",
        Gauge,
        "Part of the recent time the container was stopped by its CPU limit (the kernel's CFS throttling, 0-1).",
    );
    let mut slice = Family::new(
        "vgpu_tenant_slice_seconds",
        Gauge,
        "How long the tenant's next exclusive slice lasts: the quantum, longer for a tenant slow to start under its grants and to report its drains (its container starved or throttled of CPU).",
    );
    let mut queue = Family::new(
        "vgpu_tenant_queue_ahead_seconds",
        Gauge,
        "GPU time the tenant's processes may queue ahead under its next exclusive grant: the shims' bound, more for a tenant slow to start under its grants and to report its drains.",
    );
    let mut suspended = Family::new(
        "vgpu_tenant_suspended_bytes",
        Gauge,
        "GPU memory of the suspended container held in host memory (its quota stays its own meanwhile).",
    );
    let mut suspensions = Family::new(
        "vgpu_tenant_suspensions_total",
        Counter,
        "Times the container was suspended since the daemon started.",
    );
    let mut procs = Family::new(
        "vgpu_tenant_processes",
        Gauge,
        "Processes of the tenant registered with the daemon (all of its GPUs).",
    );
    for t in &snap.tenants {
        let base = tenant_labels(t);
        for g in &t.gpus {
            let model = model_of(&g.uuid);
            let mut l: Vec<(&str, &str)> = base.to_vec();
            l.extend([
                ("gpu", g.uuid.as_str()),
                ("UUID", g.uuid.as_str()),
                ("modelName", model.as_str()),
                ("Hostname", host),
            ]);
            share.sample(&l, f64::from(g.settings.share_pct) / 100.0);
            achieved.sample(&l, g.recent_share_pct / 100.0);
            let policy = g.settings.policy.to_string();
            let priority = g.settings.priority.to_string();
            let source = match g.source {
                crate::model::SettingsSource::Shim => "shim",
                crate::model::SettingsSource::QuotaFile => "quota-file",
                crate::model::SettingsSource::Api => "api",
                crate::model::SettingsSource::Default => "default",
            };
            let mut li = l.clone();
            li.extend([
                ("policy", policy.as_str()),
                ("priority", priority.as_str()),
                ("source", source),
            ]);
            settings.sample(&li, 1.0);
            gpu_time.sample(&l, ns_to_s(g.gpu_time_ns));
            throttled.sample(&l, ns_to_s(g.throttled_ns));
            grants.sample(&l, g.grants as f64);
            unclaimed.sample(&l, g.unclaimed_grants as f64);
            expired.sample(&l, g.expired_grants as f64);
            mem_used.sample(&l, g.memory_used as f64);
            co_held.sample(&l, if g.co_held { 1.0 } else { 0.0 });
            cpu_stopped.sample(&l, g.cpu_stopped_pct / 100.0);
            slice.sample(&l, ns_to_s(g.slice_ns));
            queue.sample(&l, ns_to_s(g.queue_ahead_ns));
            suspended.sample(&l, g.suspended_bytes as f64);
            suspensions.sample(&l, g.suspensions as f64);
            if let Some(q) = g.memory_quota {
                mem_quota.sample(&l, q as f64);
            }
            for s in [
                SliceState::Holding,
                SliceState::Draining,
                SliceState::Waiting,
                SliceState::Idle,
            ] {
                let mut ls = l.clone();
                ls.push(("state", state_str(s)));
                state.sample(&ls, if s == g.state { 1.0 } else { 0.0 });
            }
        }
        procs.sample(&base, t.pids.len() as f64);
    }

    // What the GPU's registered containers were granted, against its capacity.
    let mut granted_compute = Family::new(
        "vgpu_gpu_granted_compute_ratio",
        Gauge,
        "Sum of the configured compute shares of the containers registered on the GPU (capacity 1; above 1: overcommitted).",
    );
    let mut granted_memory = Family::new(
        "vgpu_gpu_granted_memory_bytes",
        Gauge,
        "Sum of the memory quotas of the containers registered on the GPU (capacity: vgpu_gpu_memory_total_bytes).",
    );
    let mut granted_containers = Family::new(
        "vgpu_gpu_containers",
        Gauge,
        "Containers registered on the GPU.",
    );
    let mut sums: std::collections::BTreeMap<&str, (f64, f64, f64)> =
        std::collections::BTreeMap::new();
    for g in &snap.gpus {
        sums.entry(g.observed.uuid.as_str()).or_default();
    }
    for t in &snap.tenants {
        for g in &t.gpus {
            let e = sums.entry(g.uuid.as_str()).or_default();
            e.0 += f64::from(g.settings.share_pct) / 100.0;
            e.1 += g.memory_quota.unwrap_or(0) as f64;
            e.2 += 1.0;
        }
    }
    for (uuid, (c, m, n)) in &sums {
        let l = [("gpu", *uuid)];
        granted_compute.sample(&l, *c);
        granted_memory.sample(&l, *m);
        granted_containers.sample(&l, *n);
    }

    let mut info = Family::new(
        "vgpu_gpu_info",
        Gauge,
        "A GPU as NVML names it (value 1; index -1: not seen by NVML).",
    );
    let mut g_total = Family::new(
        "vgpu_gpu_memory_total_bytes",
        Gauge,
        "GPU memory, total (NVML).",
    );
    let mut g_used = Family::new(
        "vgpu_gpu_memory_used_bytes",
        Gauge,
        "GPU memory in use, all processes (NVML).",
    );
    let mut g_util = Family::new(
        "vgpu_gpu_utilization_ratio",
        Gauge,
        "GPU utilization over NVML's last sample period (0-1; absent: not supported).",
    );
    let mut g_procs = Family::new(
        "vgpu_gpu_processes",
        Gauge,
        "Processes using GPU memory (NVML).",
    );
    let mut g_bypass = Family::new(
        "vgpu_gpu_bypass_processes",
        Gauge,
        "Processes using GPU memory that no shim registered (bypassing vgpu).",
    );
    let mut g_bypass_mem = Family::new(
        "vgpu_gpu_bypass_memory_bytes",
        Gauge,
        "GPU memory used by bypass processes.",
    );
    let mut g_sched = Family::new(
        "vgpu_gpu_scheduled_seconds_total",
        Counter,
        "GPU time the daemon charged to tenants since it started.",
    );
    let mut g_obs = Family::new(
        "vgpu_gpu_last_observation_timestamp_seconds",
        Gauge,
        "When NVML last reported the GPU (Unix time; absent: never).",
    );
    for g in &snap.gpus {
        let o = &g.observed;
        let l = [("gpu", o.uuid.as_str())];
        let index = if o.index == u32::MAX {
            "-1".to_owned()
        } else {
            o.index.to_string()
        };
        info.sample(
            &[
                ("gpu", o.uuid.as_str()),
                ("index", index.as_str()),
                ("name", o.name.as_str()),
                ("UUID", o.uuid.as_str()),
                ("modelName", o.name.as_str()),
                ("Hostname", host),
            ],
            1.0,
        );
        g_sched.sample(&l, ns_to_s(g.scheduled_ns));
        if o.observed_unix_ms == 0 {
            continue;
        }
        g_total.sample(&l, o.memory_total as f64);
        g_used.sample(&l, o.memory_used as f64);
        if let Some(u) = o.utilization_pct {
            g_util.sample(&l, f64::from(u) / 100.0);
        }
        g_procs.sample(&l, g.processes.len() as f64);
        g_bypass.sample(&l, g.bypass_pids.len() as f64);
        let bypass_bytes: u64 = g
            .processes
            .iter()
            .filter(|p| p.tenant.is_none())
            .map(|p| p.used_bytes)
            .sum();
        g_bypass_mem.sample(&l, bypass_bytes as f64);
        g_obs.sample(&l, o.observed_unix_ms as f64 / 1000.0);
    }

    let mut fb_periods = Family::new(
        "vgpu_container_fallback_periods_total",
        Counter,
        "Periods a container's processes enforced their share locally (no daemon), as they reported on registering again.",
    );
    let mut fb_secs = Family::new(
        "vgpu_container_fallback_seconds_total",
        Counter,
        "Total length of those periods.",
    );
    let mut fb_now = Family::new(
        "vgpu_container_processes_in_fallback",
        Gauge,
        "The container's processes that enforce their share locally now: their connection to the daemon closed while they ran, and they have not registered again.",
    );
    let mut refused = Family::new(
        "vgpu_container_registrations_refused_total",
        Counter,
        "Registrations of the container's processes the daemon refused.",
    );
    let mut mem_refused = Family::new(
        "vgpu_container_memory_refused_allocations_total",
        Counter,
        "GPU memory allocations the container's shims refused because they would have taken it over its memory quota.",
    );
    let mut mem_refused_at = Family::new(
        "vgpu_container_memory_last_refusal_timestamp_seconds",
        Gauge,
        "When the daemon heard of the container's latest refused allocation (Unix time).",
    );
    for h in &snap.health {
        let l = [
            ("tenant", h.key.as_str()),
            ("namespace", h.namespace.as_str()),
            ("pod", h.pod.as_str()),
            ("container", h.container.as_str()),
        ];
        fb_periods.sample(&l, h.fallback_periods as f64);
        fb_secs.sample(&l, h.fallback_ms as f64 / 1000.0);
        refused.sample(&l, h.refused_registrations as f64);
        fb_now.sample(&l, h.processes_in_fallback as f64);
        for m in &h.memory_refusals {
            let model = model_of(&m.uuid);
            let mut lg: Vec<(&str, &str)> = l.to_vec();
            lg.extend([
                ("gpu", m.uuid.as_str()),
                ("UUID", m.uuid.as_str()),
                ("modelName", model.as_str()),
                ("Hostname", host),
            ]);
            mem_refused.sample(&lg, m.count as f64);
            mem_refused_at.sample(&lg, m.last_unix_ms as f64 / 1000.0);
        }
    }

    let mut out = String::with_capacity(4096 + 2048 * snap.tenants.len());
    for f in [
        &up,
        &uptime,
        &tenants,
        &share,
        &achieved,
        &settings,
        &gpu_time,
        &throttled,
        &grants,
        &unclaimed,
        &expired,
        &mem_used,
        &mem_quota,
        &state,
        &co_held,
        &cpu_stopped,
        &slice,
        &queue,
        &suspended,
        &suspensions,
        &procs,
        &info,
        &g_total,
        &g_used,
        &g_util,
        &g_procs,
        &g_bypass,
        &g_bypass_mem,
        &g_sched,
        &g_obs,
        &granted_compute,
        &granted_memory,
        &granted_containers,
        &fb_periods,
        &fb_secs,
        &fb_now,
        &refused,
        &mem_refused,
        &mem_refused_at,
    ] {
        f.write(&mut out);
    }
    out
}

/// The HTTP routes: `/metrics`, `/healthz` (liveness) and `/readyz` (readiness).
pub fn router(daemon: Arc<Daemon>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(daemon)
}

async fn metrics(State(d): State<Arc<Daemon>>) -> impl IntoResponse {
    // The snapshot takes the daemon's lock briefly; rendering happens outside it.
    let mut text = render(&d.snapshot());
    text.push_str(&d.sockets().metrics());
    text.push_str(&d.second_line().metrics());
    if let Some(f) = d.ebpf_failure() {
        text.push_str(&f.metrics());
    }
    if let Some(g) = d.device_gate() {
        text.push_str(&g.metrics());
    }
    (StatusCode::OK, [(header::CONTENT_TYPE, CONTENT_TYPE)], text)
}

async fn healthz() -> impl IntoResponse {
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        "ok\n",
    )
}

/// Readiness: 503 with the reason while the node fails closed (`--ebpf enforce` asked for,
/// the gate not attached, fallback `refuse`); 200 `ready` otherwise. `/healthz` stays the
/// liveness answer (the daemon serves either way).
async fn readyz(State(d): State<Arc<Daemon>>) -> impl IntoResponse {
    let (status, body) = match d.not_ready() {
        Some(why) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {why}\n"),
        ),
        None => (StatusCode::OK, "ready\n".to_owned()),
    };
    (
        status,
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        body,
    )
}

/// Binds the metrics address (`host:port`).
pub async fn bind(addr: &str) -> io::Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .map_err(|e| io::Error::new(e.kind(), format!("metrics address {addr}: {e}")))
}

/// Serves `/metrics` and `/healthz` on `listener` until the task is dropped.
pub async fn serve(daemon: Arc<Daemon>, listener: TcpListener) -> io::Result<()> {
    axum::serve(listener, router(daemon)).await
}
