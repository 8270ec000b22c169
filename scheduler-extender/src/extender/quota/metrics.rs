//! The extender's Prometheus text (`GET /metrics`): each namespace's use as the ledger
//! holds it and each quota policy's totals, so a dashboard can draw use against policy
//! totals (`deploy/60-grafana-dashboard.yaml`). Names follow the daemon's
//! (`vgpu_*`, base units: bytes, ratio of one GPU; ADR 0020).

use std::fmt::Write as _;

use crate::extender::cluster::State;

const MIB: u64 = 1 << 20;

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn family(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

/// Renders the metrics of `state`.
#[must_use]
pub fn render(state: &State) -> String {
    let usage = state.quota_usage();
    let policies = state.quota().all();
    let refusals = state.quota().refusals();
    let mut out = String::new();
    type Pick = fn(&super::rules::Usage) -> String;
    let used: [(&str, &str, Pick); 4] = [
        (
            "vgpu_namespace_gpu_memory_used_bytes",
            "GPU memory the namespace's pods hold (bound or being bound), bytes",
            |u| (u.memory_mib * MIB).to_string(),
        ),
        (
            "vgpu_namespace_gpu_compute_used_ratio",
            "compute the namespace's pods hold over all GPUs, in GPUs (1 = one whole GPU)",
            |u| (u.compute_milli as f64 / 1000.0).to_string(),
        ),
        (
            "vgpu_namespace_gpus_used",
            "distinct GPUs the namespace's pods hold a share of",
            |u| u.gpus.to_string(),
        ),
        (
            "vgpu_namespace_gpu_pods",
            "the namespace's pods holding GPUs",
            |u| u.pods.to_string(),
        ),
    ];
    for (name, help, pick) in used {
        family(&mut out, name, "gauge", help);
        for (ns, u) in &usage {
            let _ = writeln!(out, "{name}{{namespace=\"{}\"}} {}", escape(ns), pick(u));
        }
    }
    type Total = fn(&super::rules::Rules) -> Option<String>;
    let totals: [(&str, &str, Total); 3] = [
        (
            "vgpu_quota_policy_memory_total_bytes",
            "a quota policy's namespace total of GPU memory, bytes (spec.totals.memory)",
            |r| r.total_memory_mib.map(|m| (m * MIB).to_string()),
        ),
        (
            "vgpu_quota_policy_compute_total_ratio",
            "a quota policy's namespace total of compute, in GPUs (spec.totals.computePercent / 100)",
            |r| {
                r.total_compute_milli
                    .map(|m| (m as f64 / 1000.0).to_string())
            },
        ),
        (
            "vgpu_quota_policy_total_gpus",
            "a quota policy's namespace total of distinct GPUs (spec.totals.gpus)",
            |r| r.total_gpus.map(|g| g.to_string()),
        ),
    ];
    for (name, help, pick) in totals {
        family(&mut out, name, "gauge", help);
        for (ns, list) in &policies {
            for e in list {
                if let Some(v) = e.rules.as_ref().ok().and_then(pick) {
                    let _ = writeln!(
                        out,
                        "{name}{{namespace=\"{}\",policy=\"{}\"}} {v}",
                        escape(ns),
                        escape(&e.name)
                    );
                }
            }
        }
    }
    family(
        &mut out,
        "vgpu_quota_policy_valid",
        "gauge",
        "1 if the quota policy is valid, 0 if a field is bad (the namespace then takes no new GPU pod)",
    );
    for (ns, list) in &policies {
        for e in list {
            let _ = writeln!(
                out,
                "vgpu_quota_policy_valid{{namespace=\"{}\",policy=\"{}\"}} {}",
                escape(ns),
                escape(&e.name),
                u8::from(e.rules.is_ok())
            );
        }
    }
    family(
        &mut out,
        "vgpu_quota_policy_refusals_total",
        "counter",
        "filter and bind decisions that refused a pod because of the quota policy",
    );
    for (key, n) in &refusals {
        let (ns, name) = key.split_once('/').unwrap_or(("", key));
        let _ = writeln!(
            out,
            "vgpu_quota_policy_refusals_total{{namespace=\"{}\",policy=\"{}\"}} {n}",
            escape(ns),
            escape(name)
        );
    }
    out
}
