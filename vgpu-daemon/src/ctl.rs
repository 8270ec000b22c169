//! `vgpuctl`: a small client of the daemon's gRPC API (the binary parses arguments and
//! calls [`run`]).
//!
//! ```text
//! vgpuctl [--api-socket PATH | --api-addr HOST:PORT] [--json] tenants
//! vgpuctl [...] tenant KEY
//! vgpuctl [...] gpus
//! vgpuctl [...] top [--once] [--interval SECONDS]
//! vgpuctl [...] set TENANT [--gpu UUID] [--share N] [--policy burst|cap]
//!                          [--priority best-effort|latency-sensitive]
//! vgpuctl [...] events [--follow] [--recent N]
//! vgpuctl [...] suspend TENANT
//! vgpuctl [...] resume TENANT
//! ```

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use serde_json::{Value, json};
use tonic::transport::{Channel, Endpoint};
use vgpu_core::bytes::Bytes;
use vgpu_core::sched_proto::{ComputePolicy, Priority};

use crate::api::{DaemonClient, pb};
use crate::columns::table;

pub mod events;

/// Lists the daemon's tenants and GPUs with their usage; changes a tenant's compute
/// settings live.
#[derive(Debug, Parser)]
#[command(name = "vgpuctl", version)]
pub struct Cli {
    /// The daemon's API socket.
    #[arg(long, env = "VGPU_API_SOCKET", default_value = crate::api::DEFAULT_SOCKET)]
    pub api_socket: PathBuf,
    /// Use the API on TCP instead (host:port, as given to the daemon's --api-addr).
    #[arg(long)]
    pub api_addr: Option<String>,
    /// Print JSON instead of a table.
    #[arg(long, global = true)]
    pub json: bool,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// `vgpuctl` subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Every tenant (container), one line per GPU it uses.
    Tenants,
    /// One tenant.
    Tenant {
        /// Tenant key.
        key: String,
    },
    /// Every GPU with its processes; bypass processes (no shim registered them) flagged.
    Gpus,
    /// A live view per GPU and container, redrawn in place (Ctrl-C quits).
    Top {
        /// Print one frame and exit (no terminal escapes).
        #[arg(long)]
        once: bool,
        /// Seconds between frames.
        #[arg(long, default_value_t = 1.0)]
        interval: f64,
    },
    /// Changes a tenant's share, policy or priority now (all of its GPUs unless --gpu).
    Set {
        /// Tenant key.
        tenant: String,
        /// Only this GPU (UUID).
        #[arg(long)]
        gpu: Option<String>,
        /// Compute share, percent (1–100).
        #[arg(long)]
        share: Option<u32>,
        /// burst (work-conserving) or cap (hard ceiling).
        #[arg(long)]
        policy: Option<ComputePolicy>,
        /// best-effort or latency-sensitive.
        #[arg(long)]
        priority: Option<Priority>,
    },
    /// The eBPF GPU device gate's events: refused (and, in audit mode, would-be refused)
    /// opens of GPU devices and exits of watched processes, one line each, naming the
    /// pod. The latest ones the daemon kept, then, with --follow, each new one.
    Events {
        /// Keep printing new events as they come.
        #[arg(long, short = 'f')]
        follow: bool,
        /// How many of the latest events to print first (the daemon keeps 1,024);
        /// default: all of them, or 10 with --follow.
        #[arg(long)]
        recent: Option<u32>,
    },
    /// Suspends a container: its processes' GPU memory moves to host memory (the
    /// driver's checkpoint API), all of them or none; its next CUDA call resumes it.
    Suspend {
        /// Tenant key.
        tenant: String,
    },
    /// Resumes a suspended container now.
    Resume {
        /// Tenant key.
        tenant: String,
    },
}

async fn connect(cli: &Cli) -> Result<DaemonClient<Channel>> {
    if let Some(addr) = &cli.api_addr {
        let uri = format!("http://{addr}");
        let ch = Endpoint::from_shared(uri)
            .with_context(|| format!("--api-addr {addr:?} is not host:port"))?
            .connect()
            .await
            .with_context(|| format!("cannot reach the daemon's API at {addr}"))?;
        return Ok(crate::api::client(ch));
    }
    crate::api::connect_unix(&cli.api_socket)
        .await
        .with_context(|| {
            format!(
                "cannot reach the daemon's API at {} (is vgpu-daemon running? --api-socket)",
                cli.api_socket.display()
            )
        })
}

/// Runs a command, writing what it prints to `out` as it comes (`events --follow` prints
/// until the daemon goes away).
pub async fn run_to(cli: &Cli, out: &mut (dyn std::io::Write + Send)) -> Result<()> {
    if let Command::Events { follow, recent } = &cli.command {
        let mut c = connect(cli).await?;
        let recent = recent.unwrap_or(if *follow { 10 } else { u32::MAX });
        return events::write_events(&mut c, *follow, recent, cli.json, out).await;
    }
    let text = run(cli).await?;
    out.write_all(text.as_bytes()).context("write to stdout")?;
    Ok(())
}

fn status_err(s: tonic::Status) -> anyhow::Error {
    anyhow::anyhow!("{} ({:?})", s.message(), s.code())
}

/// Runs a command; returns what to print.
pub async fn run(cli: &Cli) -> Result<String> {
    let mut c = connect(cli).await?;
    match &cli.command {
        Command::Events { follow, recent } => {
            let mut out = Vec::new();
            let recent = recent.unwrap_or(if *follow { 10 } else { u32::MAX });
            events::write_events(&mut c, *follow, recent, cli.json, &mut out).await?;
            Ok(String::from_utf8_lossy(&out).into_owned())
        }
        Command::Tenants => {
            let t = c
                .list_tenants(pb::ListTenantsRequest {})
                .await
                .map_err(status_err)?
                .into_inner();
            if cli.json {
                let health: Vec<Value> = t
                    .health
                    .iter()
                    .map(|h| {
                        json!({
                            "key": h.key,
                            "namespace": h.namespace,
                            "pod": h.pod,
                            "container": h.container,
                            "fallback_periods": h.fallback_periods,
                            "fallback_ms": h.fallback_ms,
                            "last_fallback_reason": h.last_fallback_reason,
                            "refused_registrations": h.refused_registrations,
                            "last_refusal": h.last_refusal,
                            "processes_in_fallback": h.processes_in_fallback,
                        })
                    })
                    .collect();
                return Ok(pretty(&json!({
                    "uptime_seconds": t.uptime_seconds,
                    "tenants": t.tenants.iter().map(tenant_json).collect::<Vec<_>>(),
                    "health": health,
                })));
            }
            let gpus = gpu_indices(&mut c).await?;
            Ok(tenants_table(&t.tenants, &gpus))
        }
        Command::Tenant { key } => {
            let t = c
                .get_tenant(pb::GetTenantRequest { key: key.clone() })
                .await
                .map_err(status_err)?
                .into_inner()
                .tenant
                .context("the daemon answered without a tenant")?;
            if cli.json {
                return Ok(pretty(&tenant_json(&t)));
            }
            let gpus = gpu_indices(&mut c).await?;
            Ok(tenants_table(std::slice::from_ref(&t), &gpus))
        }
        Command::Gpus => {
            let g = c
                .list_gpus(pb::ListGpusRequest {})
                .await
                .map_err(status_err)?
                .into_inner();
            if cli.json {
                return Ok(pretty(&json!({
                    "gpus": g.gpus.iter().map(gpu_json).collect::<Vec<_>>(),
                })));
            }
            Ok(gpus_table(&g.gpus))
        }
        Command::Top { once, interval } => {
            if *once {
                return crate::top::once(&mut c).await;
            }
            if !(interval.is_finite() && (0.05..=3600.0).contains(interval)) {
                bail!("--interval {interval} is out of range (0.05–3600 seconds)");
            }
            crate::top::live(&mut c, std::time::Duration::from_secs_f64(*interval)).await?;
            Ok(String::new())
        }
        Command::Set {
            tenant,
            gpu,
            share,
            policy,
            priority,
        } => {
            if share.is_none() && policy.is_none() && priority.is_none() {
                bail!("nothing to set: give --share, --policy or --priority");
            }
            let req = pb::SetSettingsRequest {
                tenant: tenant.clone(),
                gpu_uuid: gpu.clone(),
                share_pct: *share,
                policy: policy.map(|p| match p {
                    ComputePolicy::Burst => pb::ComputePolicy::Burst as i32,
                    ComputePolicy::Cap => pb::ComputePolicy::Cap as i32,
                }),
                priority: priority.map(|p| match p {
                    Priority::BestEffort => pb::Priority::BestEffort as i32,
                    Priority::LatencySensitive => pb::Priority::LatencySensitive as i32,
                }),
            };
            let r = c.set_settings(req).await.map_err(status_err)?.into_inner();
            let t = r.tenant.context("the daemon answered without a tenant")?;
            if cli.json {
                return Ok(pretty(&tenant_json(&t)));
            }
            let gpus = gpu_indices(&mut c).await?;
            Ok(tenants_table(std::slice::from_ref(&t), &gpus))
        }
        Command::Suspend { tenant } => {
            let r = c
                .suspend(pb::SuspendRequest {
                    tenant: tenant.clone(),
                })
                .await
                .map_err(status_err)?
                .into_inner();
            if cli.json {
                return Ok(pretty(&json!({
                    "tenant": tenant,
                    "pids": r.pids,
                    "bytes": r.bytes,
                    "took_ms": r.took_ms,
                })));
            }
            Ok(format!(
                "suspended {tenant}: {} moved to host memory from {} process(es) in {} ms\n",
                Bytes(r.bytes),
                r.pids.len(),
                r.took_ms
            ))
        }
        Command::Resume { tenant } => {
            let r = c
                .resume(pb::ResumeRequest {
                    tenant: tenant.clone(),
                })
                .await
                .map_err(status_err)?
                .into_inner();
            if cli.json {
                return Ok(pretty(&json!({
                    "tenant": tenant,
                    "was_suspended": r.was_suspended,
                    "took_ms": r.took_ms,
                })));
            }
            Ok(if r.was_suspended {
                format!("resumed {tenant} in {} ms\n", r.took_ms)
            } else {
                format!("{tenant} was not suspended\n")
            })
        }
    }
}

fn pretty(v: &Value) -> String {
    let mut s =
        serde_json::to_string_pretty(v).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"));
    s.push('\n');
    s
}

async fn gpu_indices(c: &mut DaemonClient<Channel>) -> Result<HashMap<String, u32>> {
    let g = c
        .list_gpus(pb::ListGpusRequest {})
        .await
        .map_err(status_err)?
        .into_inner();
    Ok(g.gpus
        .into_iter()
        .filter_map(|g| g.index.map(|i| (g.uuid, i)))
        .collect())
}

fn policy_name(v: i32) -> &'static str {
    match pb::ComputePolicy::try_from(v) {
        Ok(pb::ComputePolicy::Burst) => "burst",
        Ok(pb::ComputePolicy::Cap) => "cap",
        _ => "?",
    }
}

fn priority_name(v: i32) -> &'static str {
    match pb::Priority::try_from(v) {
        Ok(pb::Priority::BestEffort) => "best-effort",
        Ok(pb::Priority::LatencySensitive) => "latency-sensitive",
        _ => "?",
    }
}

fn source_name(v: i32) -> &'static str {
    match pb::SettingsSource::try_from(v) {
        Ok(pb::SettingsSource::Shim) => "shim",
        Ok(pb::SettingsSource::QuotaFile) => "quota-file",
        Ok(pb::SettingsSource::Api) => "api",
        Ok(pb::SettingsSource::Default) => "default",
        _ => "?",
    }
}

fn state_name(v: i32) -> &'static str {
    match pb::SliceState::try_from(v) {
        Ok(pb::SliceState::Holding) => "holding",
        Ok(pb::SliceState::Draining) => "draining",
        Ok(pb::SliceState::Waiting) => "waiting",
        Ok(pb::SliceState::Idle) => "idle",
        _ => "?",
    }
}

/// A tenant as JSON (enums as their names).
pub fn tenant_json(t: &pb::Tenant) -> Value {
    json!({
        "key": t.key,
        "namespace": t.namespace,
        "pod": t.pod,
        "container": t.container,
        "pids": t.pids,
        "gpus": t.gpus.iter().map(|g| {
            let s = g.settings.unwrap_or_default();
            json!({
                "uuid": g.uuid,
                "share_pct": s.share_pct,
                "policy": policy_name(s.policy),
                "priority": priority_name(s.priority),
                "source": source_name(g.source),
                "achieved_share_pct": g.achieved_share_pct,
                "gpu_time_ns": g.gpu_time_ns,
                "throttled_ns": g.throttled_ns,
                "grants": g.grants,
                "memory_used_bytes": g.memory_used_bytes,
                "memory_quota_bytes": g.memory_quota_bytes,
                "state": state_name(g.state),
                "co_held": g.co_held,
                "fill_pct": g.fill_pct,
                "cpu_stopped_pct": g.cpu_stopped_pct,
                "unclaimed_grants": g.unclaimed_grants,
                "expired_grants": g.expired_grants,
                "slice_ns": g.slice_ns,
                "queue_ahead_ns": g.queue_ahead_ns,
                "suspended_bytes": g.suspended_bytes,
                "suspensions": g.suspensions,
            })
        }).collect::<Vec<_>>(),
    })
}

/// A GPU as JSON.
pub fn gpu_json(g: &pb::Gpu) -> Value {
    json!({
        "uuid": g.uuid,
        "index": g.index,
        "name": g.name,
        "memory_total_bytes": g.memory_total_bytes,
        "memory_used_bytes": g.memory_used_bytes,
        "utilization_pct": g.utilization_pct,
        "scheduled_ns": g.scheduled_ns,
        "holder": g.holder,
        "observed_unix_ms": g.observed_unix_ms,
        "bypass_pids": g.bypass_pids,
        "processes": g.processes.iter().map(|p| json!({
            "pid": p.pid,
            "used_bytes": p.used_bytes,
            "tenant": p.tenant,
            "bypass": p.bypass,
        })).collect::<Vec<_>>(),
    })
}

fn secs(ns: u64) -> String {
    format!("{:.1}s", ns as f64 / 1e9)
}

fn dash(s: &str) -> String {
    if s.is_empty() {
        "-".into()
    } else {
        s.to_owned()
    }
}

/// The `tenants` table: one line per tenant and GPU.
pub fn tenants_table(tenants: &[pb::Tenant], gpu_index: &HashMap<String, u32>) -> String {
    let mut rows = vec![
        [
            "TENANT",
            "POD",
            "GPU",
            "SHARE(CFG/ACH)",
            "POLICY",
            "PRIORITY",
            "GPU-TIME",
            "THROTTLED",
            "MEMORY(USED/QUOTA)",
            "PIDS",
            "STATE",
        ]
        .map(String::from)
        .to_vec(),
    ];
    for t in tenants {
        let pod = if t.pod.is_empty() {
            "-".to_owned()
        } else if t.namespace.is_empty() {
            t.pod.clone()
        } else {
            format!("{}/{}", t.namespace, t.pod)
        };
        let pids = if t.pids.is_empty() {
            "-".to_owned()
        } else {
            t.pids
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(",")
        };
        for g in &t.gpus {
            let s = g.settings.unwrap_or_default();
            let gpu = gpu_index
                .get(&g.uuid)
                .map_or_else(|| g.uuid.clone(), |i| i.to_string());
            let quota = g
                .memory_quota_bytes
                .map_or_else(|| "unlimited".to_owned(), |q| Bytes(q).to_string());
            rows.push(vec![
                t.key.clone(),
                pod.clone(),
                gpu,
                format!("{}%/{:.1}%", s.share_pct, g.achieved_share_pct),
                policy_name(s.policy).to_owned(),
                priority_name(s.priority).to_owned(),
                secs(g.gpu_time_ns),
                secs(g.throttled_ns),
                format!("{}/{}", Bytes(g.memory_used_bytes), quota),
                pids.clone(),
                state_name(g.state).to_owned(),
            ]);
        }
        if t.gpus.is_empty() {
            let mut r = vec![t.key.clone(), pod, "-".into()];
            r.extend(std::iter::repeat_n("-".to_owned(), 6));
            r.extend([pids, "-".into()]);
            rows.push(r);
        }
    }
    table(&rows)
}

/// The `gpus` table, each GPU followed by its processes; bypasses flagged `BYPASS`.
pub fn gpus_table(gpus: &[pb::Gpu]) -> String {
    let mut rows = vec![
        [
            "GPU",
            "UUID",
            "NAME",
            "MEMORY(USED/TOTAL)",
            "UTIL",
            "SCHEDULED",
            "HOLDER",
            "BYPASS",
        ]
        .map(String::from)
        .to_vec(),
    ];
    for g in gpus {
        rows.push(vec![
            g.index.map_or_else(|| "-".into(), |i| i.to_string()),
            g.uuid.clone(),
            dash(&g.name),
            if g.observed_unix_ms == 0 {
                "-".into()
            } else {
                format!(
                    "{}/{}",
                    Bytes(g.memory_used_bytes),
                    Bytes(g.memory_total_bytes)
                )
            },
            g.utilization_pct
                .map_or_else(|| "-".into(), |u| format!("{u}%")),
            secs(g.scheduled_ns),
            dash(g.holder.as_deref().unwrap_or("")),
            g.bypass_pids.len().to_string(),
        ]);
    }
    let text = table(&rows);
    let mut lines = text.lines();
    let mut out = String::new();
    if let Some(h) = lines.next() {
        out.push_str(h);
        out.push('\n');
    }
    // Processes under their GPU, outside the columns (owners are long).
    for (g, line) in gpus.iter().zip(lines) {
        out.push_str(line);
        out.push('\n');
        for p in &g.processes {
            let owner = match &p.tenant {
                Some(t) => format!("tenant {t}"),
                None => "BYPASS (no shim registered this process)".to_owned(),
            };
            let _ = writeln!(
                out,
                "    pid {:<8} {:>9}  {owner}",
                p.pid,
                Bytes(p.used_bytes).to_string()
            );
        }
    }
    out
}
