//! `vgpuctl top`: a live view of the node per GPU and container (share configured and
//! achieved, memory used and quota, throttling, state, allocations refused), redrawn in
//! place like `htop`: ANSI escapes only (alternate screen, cursor home, erase to end of
//! line), so it works over ssh in any terminal; the terminal is restored on exit, Ctrl-C
//! and SIGTERM. `--once` prints one frame, without escapes.
//!
//! [`frame`] is pure (two readings of the API in, text out); [`live`] is the loop.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::io::Write as _;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use tonic::transport::Channel;
use vgpu_core::bytes::Bytes;

use crate::api::{DaemonClient, pb};

/// Enter the alternate screen, hide the cursor.
pub const ENTER: &str = "\x1b[?1049h\x1b[?25l";
/// Show the cursor, leave the alternate screen (what the terminal had is back).
pub const LEAVE: &str = "\x1b[?25h\x1b[?1049l";

/// One reading of the daemon's API.
#[derive(Debug, Clone, Default)]
pub struct Reading {
    /// `ListTenants`.
    pub tenants: pb::ListTenantsResponse,
    /// `ListGpus`.
    pub gpus: pb::ListGpusResponse,
    /// When it was taken.
    pub at: Option<Instant>,
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

/// Percent of the time between `prev` and `now` that the counter (ns) grew by.
fn rate_pct(prev: Option<(u64, Instant)>, now: (u64, Instant)) -> Option<f64> {
    let (p, at) = prev?;
    let dt = now.1.checked_duration_since(at)?.as_nanos() as f64;
    (dt > 0.0).then(|| now.0.saturating_sub(p) as f64 / dt * 100.0)
}

/// A frame: per GPU a line, then one line per container on it. `prev` (the reading
/// before) gives the throttled fraction since then; without it the column shows the
/// total throttled time.
pub fn frame(now: &Reading, prev: Option<&Reading>) -> String {
    let mut out = String::new();
    let t = &now.tenants;
    let containers = t.tenants.len();
    let _ = writeln!(
        out,
        "vgpuctl top — {} GPU(s), {containers} container(s), daemon up {:.0}s",
        now.gpus.gpus.len(),
        t.uptime_seconds
    );
    let mut refused: HashMap<(&str, &str), u64> = HashMap::new();
    for h in &t.health {
        for m in &h.memory_refusals {
            refused.insert((h.key.as_str(), m.uuid.as_str()), m.count);
        }
    }
    let mut prev_throttled: HashMap<(&str, &str), (u64, Instant)> = HashMap::new();
    if let Some(p) = prev
        && let Some(at) = p.at
    {
        for x in &p.tenants.tenants {
            for g in &x.gpus {
                prev_throttled.insert((x.key.as_str(), g.uuid.as_str()), (g.throttled_ns, at));
            }
        }
    }
    let mut uuids: Vec<&str> = now.gpus.gpus.iter().map(|g| g.uuid.as_str()).collect();
    for x in &t.tenants {
        for g in &x.gpus {
            if !uuids.contains(&g.uuid.as_str()) {
                uuids.push(g.uuid.as_str());
            }
        }
    }
    for uuid in uuids {
        let gpu = now.gpus.gpus.iter().find(|g| g.uuid == uuid);
        let on: Vec<(&pb::Tenant, &pb::TenantGpu)> = t
            .tenants
            .iter()
            .flat_map(|x| {
                x.gpus
                    .iter()
                    .filter(|g| g.uuid == uuid)
                    .map(move |g| (x, g))
            })
            .collect();
        let granted: u32 = on
            .iter()
            .map(|(_, g)| g.settings.unwrap_or_default().share_pct)
            .sum();
        let achieved: f64 = on.iter().map(|(_, g)| g.achieved_share_pct).sum();
        let _ = writeln!(out);
        let _ = writeln!(
            out,
            "GPU {} {} {}  mem {}  util {}  granted {granted}%  achieved {achieved:.1}%  holder {}",
            gpu.and_then(|g| g.index)
                .map_or_else(|| "-".to_owned(), |i| i.to_string()),
            uuid,
            gpu.map_or("", |g| g.name.as_str()),
            gpu.filter(|g| g.observed_unix_ms != 0).map_or_else(
                || "-".to_owned(),
                |g| format!(
                    "{}/{}",
                    Bytes(g.memory_used_bytes),
                    Bytes(g.memory_total_bytes)
                )
            ),
            gpu.and_then(|g| g.utilization_pct)
                .map_or_else(|| "-".to_owned(), |u| format!("{u}%")),
            gpu.and_then(|g| g.holder.as_deref()).unwrap_or("-"),
        );
        let mut rows = vec![
            [
                "  POD/CONTAINER",
                "SHARE(CFG/ACH)",
                "MEMORY(USED/QUOTA)",
                "THROTTLED",
                "REFUSED",
                "STATE",
            ]
            .map(String::from)
            .to_vec(),
        ];
        for (x, g) in on {
            let s = g.settings.unwrap_or_default();
            let who = if x.pod.is_empty() {
                x.key.clone()
            } else {
                format!("{}/{}:{}", x.namespace, x.pod, x.container)
            };
            let total = || format!("{:.1}s", g.throttled_ns as f64 / 1e9);
            let throttled = now
                .at
                .and_then(|at| {
                    rate_pct(
                        prev_throttled.get(&(x.key.as_str(), uuid)).copied(),
                        (g.throttled_ns, at),
                    )
                })
                .map_or_else(total, |p| format!("{p:.0}%"));
            rows.push(vec![
                format!("  {who}"),
                format!("{}%/{:.1}%", s.share_pct, g.achieved_share_pct),
                format!(
                    "{}/{}",
                    Bytes(g.memory_used_bytes),
                    g.memory_quota_bytes
                        .map_or_else(|| "unlimited".to_owned(), |q| Bytes(q).to_string())
                ),
                throttled,
                refused
                    .get(&(x.key.as_str(), uuid))
                    .copied()
                    .unwrap_or(0)
                    .to_string(),
                state_name(g.state).to_owned(),
            ]);
        }
        if rows.len() == 1 {
            let _ = writeln!(out, "  (no containers)");
        } else {
            out.push_str(&crate::columns::table(&rows));
        }
    }
    out
}

async fn read(c: &mut DaemonClient<Channel>) -> Result<Reading> {
    let tenants = c
        .list_tenants(pb::ListTenantsRequest {})
        .await
        .map_err(|s| anyhow::anyhow!("{} ({:?})", s.message(), s.code()))?
        .into_inner();
    let gpus = c
        .list_gpus(pb::ListGpusRequest {})
        .await
        .map_err(|s| anyhow::anyhow!("{} ({:?})", s.message(), s.code()))?
        .into_inner();
    Ok(Reading {
        tenants,
        gpus,
        at: Some(Instant::now()),
    })
}

/// One frame now, without escapes (`--once`).
pub async fn once(c: &mut DaemonClient<Channel>) -> Result<String> {
    Ok(frame(&read(c).await?, None))
}

/// Puts each line of `text` at the top of the screen, clearing what the last frame left.
fn paint(text: &str) -> String {
    let mut s = String::from("\x1b[H");
    for line in text.lines() {
        s.push_str(line);
        s.push_str("\x1b[K\r\n");
    }
    s.push_str("\x1b[J");
    s
}

/// Restores the terminal when dropped (also on an error or a panic).
struct Screen;

impl Screen {
    fn enter() -> std::io::Result<Screen> {
        let mut o = std::io::stdout();
        o.write_all(ENTER.as_bytes())?;
        o.flush()?;
        Ok(Screen)
    }
}

impl Drop for Screen {
    fn drop(&mut self) {
        let mut o = std::io::stdout();
        let _ = o.write_all(LEAVE.as_bytes());
        let _ = o.flush();
    }
}

/// Redraws every `every` until Ctrl-C (SIGINT), SIGTERM or SIGHUP; the daemon going
/// away is shown in the frame and retried.
pub async fn live(c: &mut DaemonClient<Channel>, every: Duration) -> Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).context("SIGTERM handler")?;
    let mut hup = signal(SignalKind::hangup()).context("SIGHUP handler")?;
    let screen = Screen::enter().context("write to the terminal")?;
    let mut prev: Option<Reading> = None;
    loop {
        let text = match read(c).await {
            Ok(r) => {
                let t = frame(&r, prev.as_ref());
                prev = Some(r);
                t
            }
            Err(e) => format!("vgpuctl top: the daemon does not answer: {e:#}\n(retrying)\n"),
        };
        {
            let mut o = std::io::stdout();
            o.write_all(paint(&text).as_bytes())
                .and_then(|()| o.flush())
                .context("write to the terminal")?;
        }
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = tokio::signal::ctrl_c() => break,
            _ = term.recv() => break,
            _ = hup.recv() => break,
        }
    }
    drop(screen);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reading(throttled_ns: u64, at: Instant) -> Reading {
        Reading {
            tenants: pb::ListTenantsResponse {
                tenants: vec![pb::Tenant {
                    key: "k".into(),
                    namespace: "ns".into(),
                    pod: "p".into(),
                    container: "c".into(),
                    pids: vec![1],
                    gpus: vec![pb::TenantGpu {
                        uuid: "GPU-1".into(),
                        settings: Some(pb::ComputeSettings {
                            share_pct: 30,
                            policy: 1,
                            priority: 1,
                        }),
                        memory_used_bytes: 1 << 30,
                        memory_quota_bytes: Some(2 << 30),
                        throttled_ns,
                        achieved_share_pct: 29.5,
                        state: pb::SliceState::Waiting as i32,
                        ..Default::default()
                    }],
                }],
                uptime_seconds: 12.0,
                health: vec![pb::ContainerHealth {
                    key: "k".into(),
                    memory_refusals: vec![pb::MemoryRefusals {
                        uuid: "GPU-1".into(),
                        count: 3,
                        ..Default::default()
                    }],
                    ..Default::default()
                }],
            },
            gpus: pb::ListGpusResponse {
                gpus: vec![pb::Gpu {
                    uuid: "GPU-1".into(),
                    index: Some(0),
                    name: "NVIDIA H100".into(),
                    memory_total_bytes: 80 << 30,
                    memory_used_bytes: 1 << 30,
                    utilization_pct: Some(50),
                    observed_unix_ms: 1,
                    ..Default::default()
                }],
            },
            at: Some(at),
        }
    }

    #[test]
    fn a_frame_shows_each_gpu_and_its_containers() {
        let t0 = Instant::now();
        let f = frame(&reading(500_000_000, t0), None);
        assert!(
            f.contains("GPU 0 GPU-1 NVIDIA H100  mem 1Gi/80Gi  util 50%  granted 30%"),
            "{f}"
        );
        let row = f.lines().find(|l| l.contains("ns/p:c")).expect(&f);
        for want in ["30%/29.5%", "1Gi/2Gi", "0.5s", " 3 ", "waiting"] {
            assert!(row.contains(want), "{want} in {row:?}");
        }
        // With the reading before: the throttled fraction of the time between.
        let f2 = frame(
            &reading(1_000_000_000, t0 + Duration::from_secs(1)),
            Some(&reading(500_000_000, t0)),
        );
        let row = f2.lines().find(|l| l.contains("ns/p:c")).expect(&f2);
        assert!(row.contains("50%"), "{row:?}");
    }

    #[test]
    fn painting_clears_each_line_and_the_rest_of_the_screen() {
        let p = paint("a\nb\n");
        assert_eq!(p, "\x1b[Ha\x1b[K\r\nb\x1b[K\r\n\x1b[J");
    }
}
