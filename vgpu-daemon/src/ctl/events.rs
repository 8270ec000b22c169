//! `vgpuctl events`: the eBPF gate's events as readable lines (or JSON lines), the latest
//! ones the daemon kept, then, with `--follow`, each new one as it comes.

use std::io::Write;

use anyhow::{Context, Result};
use serde_json::{Value, json};
use tonic::transport::Channel;

use crate::api::{DaemonClient, pb};

/// Writes the events to `out` (flushed after each): `recent` of the latest first, then
/// every new one while `follow`. Returns when the stream ends (without `follow`, after
/// the recent ones; with it, when the daemon goes away).
pub async fn write_events(
    c: &mut DaemonClient<Channel>,
    follow: bool,
    recent: u32,
    json: bool,
    out: &mut (dyn Write + Send),
) -> Result<()> {
    let stream = c
        .watch_enforcement_events(pb::WatchEnforcementEventsRequest { follow, recent })
        .await
        .map_err(super::status_err)?;
    if let Some(why) = stream
        .metadata()
        .get(crate::api::GATE_HEADER)
        .and_then(|v| v.to_str().ok())
    {
        // Not an error: the second line's events come without the gate.
        eprintln!(
            "note: no eBPF gate on this node ({why}): only the second line's events and enforce failures are shown"
        );
    }
    let mut stream = stream.into_inner();
    loop {
        let next = stream.message().await;
        let e = match next {
            Ok(Some(e)) => e,
            Ok(None) => return Ok(()),
            Err(s) if follow => {
                return Err(anyhow::anyhow!(
                    "the daemon ended the event stream: {} ({:?})",
                    s.message(),
                    s.code()
                ));
            }
            Err(s) => return Err(super::status_err(s)),
        };
        let text = if json {
            let mut s = event_json(&e).to_string();
            s.push('\n');
            s
        } else {
            event_line(&e)
        };
        out.write_all(text.as_bytes())
            .and_then(|()| out.flush())
            .context("write to stdout")?;
    }
}

fn kind_name(v: i32) -> &'static str {
    match pb::EnforcementEventKind::try_from(v) {
        Ok(pb::EnforcementEventKind::Refused) => "refused",
        Ok(pb::EnforcementEventKind::Audited) => "audited",
        Ok(pb::EnforcementEventKind::Exit) => "exit",
        Ok(pb::EnforcementEventKind::Memory) => "memory",
        Ok(pb::EnforcementEventKind::NotEnforcing) => "not_enforcing",
        _ => "unknown",
    }
}

/// Who the event's process is, as readable as the daemon knows it: `pod ns/name
/// container c`, else `pod uid <uid>`, else its cgroup.
pub fn who(e: &pb::EnforcementEvent) -> String {
    let mut s = if !e.pod.is_empty() {
        format!("pod {}/{}", e.namespace, e.pod)
    } else if !e.pod_uid.is_empty() {
        format!("pod uid {}", e.pod_uid)
    } else if !e.cgroup.is_empty() {
        return format!("cgroup {}", e.cgroup);
    } else {
        return format!("cgroup id {} (gone)", e.cgroup_id);
    };
    if !e.container.is_empty() {
        s.push_str(&format!(" container {}", e.container));
    } else if !e.container_id.is_empty() {
        let short: String = e.container_id.chars().take(12).collect();
        s.push_str(&format!(" container id {short}"));
    }
    s
}

/// One event as a line: UTC time, what, the process, the device, who.
pub fn event_line(e: &pb::EnforcementEvent) -> String {
    let mut line = String::new();
    if e.lost_before > 0 {
        line.push_str(&format!(
            "… {} event(s) lost here: this client read too slowly\n",
            e.lost_before
        ));
    }
    let what = match kind_name(e.kind) {
        "refused" => format!(
            "REFUSED  open of GPU device {}:{} (EPERM)",
            e.device_major, e.device_minor
        ),
        "audited" => format!(
            "AUDITED  open of GPU device {}:{} (enforce would refuse it)",
            e.device_major, e.device_minor
        ),
        "exit" => "EXIT     ".to_owned(),
        "memory" => {
            let a = e.second_line.clone().unwrap_or_default();
            format!(
                "MEMORY   {} ({}; container {} MiB held, quota {} MiB, limit {} MiB on {}, over {} ms)",
                a.action.to_uppercase(),
                a.reason,
                a.held_bytes >> 20,
                a.quota_bytes >> 20,
                a.limit_bytes >> 20,
                a.gpu_uuid,
                a.over_ms
            )
        }
        "not_enforcing" => {
            let n = e.not_enforcing.clone().unwrap_or_default();
            line.push_str(&format!(
                "{}  NOT ENFORCING  --ebpf {} asked for, the GPU device gate is not attached: {}{}\n",
                utc(e.time_unix_ms),
                n.mode,
                n.reason,
                if n.fail_closed { " (failing closed: new tenants refused)" } else { " (serving without it: --ebpf-enforce-fallback serve)" }
            ));
            return line;
        }
        _ => format!("kind {}", e.kind),
    };
    line.push_str(&format!(
        "{}  {} by pid {} ({}) of {}\n",
        utc(e.time_unix_ms),
        what.trim_end(),
        e.tgid,
        e.comm,
        who(e)
    ));
    line
}

/// One event as JSON (the kind by name).
pub fn event_json(e: &pb::EnforcementEvent) -> Value {
    json!({
        "seq": e.seq,
        "kind": kind_name(e.kind),
        "time_unix_ms": e.time_unix_ms,
        "tgid": e.tgid,
        "pid": e.pid,
        "comm": e.comm,
        "device": (e.kind == pb::EnforcementEventKind::Refused as i32
            || e.kind == pb::EnforcementEventKind::Audited as i32)
            .then(|| format!("{}:{}", e.device_major, e.device_minor)),
        "cgroup_id": e.cgroup_id,
        "cgroup": e.cgroup,
        "pod_uid": e.pod_uid,
        "container_id": e.container_id,
        "namespace": e.namespace,
        "pod": e.pod,
        "container": e.container,
        "lost_before": e.lost_before,
        "second_line": e.second_line.as_ref().map(|a| json!({
            "action": a.action,
            "reason": a.reason,
            "second_driver": a.second_driver,
            "unregistered": a.unregistered,
            "gpu": a.gpu_uuid,
            "held_bytes": a.held_bytes,
            "quota_bytes": a.quota_bytes,
            "limit_bytes": a.limit_bytes,
            "over_ms": a.over_ms,
            "process_held_bytes": a.process_held_bytes,
            "refused_at_gate": a.refused_at_gate,
            "killed": a.killed,
            "tenant": a.tenant,
        })),
        "not_enforcing": e.not_enforcing.as_ref().map(|n| json!({
            "mode": n.mode,
            "reason": n.reason,
            "fail_closed": n.fail_closed,
        })),
    })
}

/// `2026-11-26T14:50:01.123Z` for ms since the Unix epoch (UTC; proleptic Gregorian).
pub fn utc(unix_ms: u64) -> String {
    let secs = unix_ms / 1000;
    let days = i64::try_from(secs / 86_400).unwrap_or(i64::MAX / 2);
    let rem = secs % 86_400;
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        unix_ms % 1000
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_times() {
        assert_eq!(utc(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(utc(951_782_400_123), "2000-02-29T00:00:00.123Z");
        assert_eq!(utc(1_795_703_401_005), "2026-11-26T14:30:01.005Z");
    }

    #[test]
    fn a_refusal_is_one_line_naming_the_pod_and_the_process() {
        let mut e = pb::EnforcementEvent {
            seq: 3,
            kind: pb::EnforcementEventKind::Refused as i32,
            tgid: 4242,
            pid: 4242,
            comm: "python3".into(),
            cgroup_id: 99,
            cgroup: "/kubepods/pod0b5a/abc".into(),
            device_major: 195,
            device_minor: 255,
            time_unix_ms: 1_795_703_401_005,
            pod_uid: "0b5a".into(),
            container_id: "4f2c9e0d1b7a6c5e8d3f".into(),
            namespace: "ml".into(),
            pod: "train-0".into(),
            container: "main".into(),
            ..Default::default()
        };
        assert_eq!(
            event_line(&e),
            "2026-11-26T14:30:01.005Z  REFUSED  open of GPU device 195:255 (EPERM) by pid 4242 (python3) of pod ml/train-0 container main\n"
        );
        e.pod.clear();
        e.container.clear();
        e.lost_before = 2;
        let line = event_line(&e);
        assert!(line.starts_with("… 2 event(s) lost here"), "{line}");
        assert!(
            line.ends_with("of pod uid 0b5a container id 4f2c9e0d1b7a\n"),
            "{line}"
        );
        e.pod_uid.clear();
        e.kind = pb::EnforcementEventKind::Exit as i32;
        e.lost_before = 0;
        assert_eq!(
            event_line(&e),
            "2026-11-26T14:30:01.005Z  EXIT by pid 4242 (python3) of cgroup /kubepods/pod0b5a/abc\n"
        );
        assert_eq!(event_json(&e)["device"], Value::Null);
    }
}
