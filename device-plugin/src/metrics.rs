//! The plugin's Prometheus metrics (`GET /metrics`, `GET /healthz`, with
//! `--metrics-addr`): GPU health, GPU processes running without the shim, and the
//! allocation-directory clean-up. The list is in `docs/device-plugin.md`.

use std::sync::{Arc, Mutex, MutexGuard};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use tokio::net::TcpListener;
use tokio::sync::watch;
use vgpu_core::inventory::GpuInfo;
use vgpu_core::prom::{CONTENT_TYPE, Family, Kind};

use crate::audit::AuditState;
use crate::gc::GcRound;

/// Allocation-directory clean-up figures.
#[derive(Debug, Default, Clone, Copy)]
pub struct GcState {
    /// Rounds so far.
    pub rounds: u64,
    /// Directories removed so far.
    pub removed: u64,
    /// Directories in place after the latest round.
    pub kept: u64,
}

/// Everything the metrics show.
#[derive(Debug, Clone)]
pub struct Metrics {
    gpus: watch::Receiver<Vec<GpuInfo>>,
    /// Filled by the audit reporter.
    pub audit: Arc<Mutex<AuditState>>,
    /// Filled by the follower of the daemon's eBPF gate events.
    pub gate: Arc<Mutex<crate::gate_events::GateWatchState>>,
    gc: Arc<Mutex<GcState>>,
    /// `VgpuMemoryQuotaExceeded` events posted (by `refusal_events`).
    pub refusal_events: Arc<std::sync::atomic::AtomicU64>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Metrics {
    /// Metrics over these GPUs.
    pub fn new(gpus: watch::Receiver<Vec<GpuInfo>>) -> Metrics {
        Metrics {
            gpus,
            audit: Arc::default(),
            gate: Arc::default(),
            gc: Arc::default(),
            refusal_events: Arc::default(),
        }
    }

    /// Records a clean-up round.
    pub fn gc_round(&self, r: &GcRound) {
        let mut g = lock(&self.gc);
        g.rounds += 1;
        g.removed += r.removed.len() as u64;
        g.kept = r.kept as u64;
    }

    /// The text exposition of every metric now.
    pub fn render(&self) -> String {
        let mut healthy = Family::new(
            "vgpu_plugin_gpu_healthy",
            Kind::Gauge,
            "Whether the GPU is advertised healthy to kubelet (1) or not (0).",
        );
        for g in self.gpus.borrow().iter() {
            let idx = g.index.to_string();
            healthy.sample(
                &[("gpu", &g.uuid), ("index", &idx), ("model", &g.model)],
                if g.healthy { 1.0 } else { 0.0 },
            );
        }
        let mut unenforced = Family::new(
            "vgpu_plugin_unenforced_processes",
            Kind::Gauge,
            "GPU processes running without the vgpu shim loaded (their memory and compute are not limited), by container and GPU, as of the latest audit.",
        );
        let mut unenforced_mem = Family::new(
            "vgpu_plugin_unenforced_memory_bytes",
            Kind::Gauge,
            "GPU memory held by processes without the vgpu shim, by container and GPU.",
        );
        let mut over = Family::new(
            "vgpu_plugin_over_quota_memory_bytes",
            Kind::Gauge,
            "GPU memory (per NVML) held by a container that is over its memory quota plus a context allowance per process, as of the latest audit.",
        );
        let mut over_quota = Family::new(
            "vgpu_plugin_over_quota_limit_bytes",
            Kind::Gauge,
            "The memory quota of each container reported in vgpu_plugin_over_quota_memory_bytes.",
        );
        let mut checked = Family::new(
            "vgpu_plugin_audited_processes",
            Kind::Gauge,
            "GPU processes (per GPU) looked at by the latest audit.",
        );
        let mut audits = Family::new(
            "vgpu_plugin_audits_total",
            Kind::Counter,
            "Audits of GPU processes so far.",
        );
        let mut events = Family::new(
            "vgpu_plugin_unenforced_events_total",
            Kind::Counter,
            "VgpuShimNotLoaded and VgpuMemoryOverQuota events posted on pods so far.",
        );
        {
            let a = lock(&self.audit);
            // Several processes of one container on one GPU add up.
            let mut sums: std::collections::BTreeMap<[String; 4], (f64, f64)> =
                std::collections::BTreeMap::new();
            for (u, owner) in &a.latest {
                let (ns, pod, c) = owner
                    .as_ref()
                    .map_or((String::new(), String::new(), String::new()), |o| {
                        (o.namespace.clone(), o.pod.clone(), o.container.clone())
                    });
                let e = sums.entry([ns, pod, c, u.gpu.clone()]).or_default();
                e.0 += 1.0;
                e.1 += u.used_bytes as f64;
            }
            for ([ns, pod, c, gpu], (n, bytes)) in &sums {
                let l = [
                    ("namespace", ns.as_str()),
                    ("pod", pod),
                    ("container", c),
                    ("gpu", gpu),
                ];
                unenforced.sample(&l, *n);
                unenforced_mem.sample(&l, *bytes);
            }
            for o in &a.over_quota {
                let l = [
                    ("namespace", o.owner.namespace.as_str()),
                    ("pod", o.owner.pod.as_str()),
                    ("container", o.owner.container.as_str()),
                    ("gpu", o.gpu.as_str()),
                ];
                over.sample(&l, o.used_bytes as f64);
                over_quota.sample(&l, o.quota_bytes as f64);
            }
            checked.sample(&[], a.checked as f64);
            audits.sample(&[], a.audits as f64);
            events.sample(&[], a.events as f64);
        }
        let gate = lock(&self.gate).clone();
        let mut following = Family::new(
            "vgpu_plugin_gate_events_connected",
            Kind::Gauge,
            "1 while the plugin follows the node daemon's eBPF gate events.",
        );
        following.sample(&[], if gate.connected { 1.0 } else { 0.0 });
        let mut refused = Family::new(
            "vgpu_plugin_gate_refused_events_total",
            Kind::Counter,
            "VgpuGpuOpenRefused events posted on pods (one per pod and refused process).",
        );
        refused.sample(&[], gate.posted as f64);
        let mut enforcement = Family::new(
            "vgpu_plugin_enforcement_events_posted_total",
            Kind::Counter,
            "Events posted for the node daemon's second line (per pod, process and action) and for enforce not delivered (on the node), ADR 0055.",
        );
        enforcement.sample(&[("kind", "memory")], gate.memory_posted as f64);
        enforcement.sample(&[("kind", "not_enforcing")], gate.node_posted as f64);
        let g = *lock(&self.gc);
        let mut rounds = Family::new(
            "vgpu_plugin_alloc_gc_rounds_total",
            Kind::Counter,
            "Allocation-directory clean-up rounds completed.",
        );
        rounds.sample(&[], g.rounds as f64);
        let mut removed = Family::new(
            "vgpu_plugin_alloc_dirs_removed_total",
            Kind::Counter,
            "Allocation directories removed because no container holds them.",
        );
        removed.sample(&[], g.removed as f64);
        let mut kept = Family::new(
            "vgpu_plugin_alloc_dirs",
            Kind::Gauge,
            "Allocation directories in place after the latest clean-up round.",
        );
        kept.sample(&[], g.kept as f64);
        let mut refusal_events = Family::new(
            "vgpu_plugin_memory_refusal_events_total",
            Kind::Counter,
            "VgpuMemoryQuotaExceeded events posted on pods so far (one per container, GPU and burst of allocations refused over quota).",
        );
        refusal_events.sample(
            &[],
            self.refusal_events
                .load(std::sync::atomic::Ordering::Relaxed) as f64,
        );
        let mut out = String::new();
        for f in [
            &healthy,
            &unenforced,
            &unenforced_mem,
            &over,
            &over_quota,
            &checked,
            &audits,
            &events,
            &following,
            &refused,
            &enforcement,
            &rounds,
            &removed,
            &kept,
            &refusal_events,
        ] {
            f.write(&mut out);
        }
        out
    }
}

async fn metrics(State(m): State<Metrics>) -> impl IntoResponse {
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, CONTENT_TYPE)],
        m.render(),
    )
}

async fn healthz() -> impl IntoResponse {
    (StatusCode::OK, "ok\n")
}

/// Serves `/metrics` and `/healthz` on `listener` until the task is dropped.
pub async fn serve(m: Metrics, listener: TcpListener) -> std::io::Result<()> {
    let app = Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .with_state(m);
    axum::serve(listener, app).await
}
