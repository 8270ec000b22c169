//! The gRPC API end to end over a unix socket against a populated daemon, its
//! validation errors, and `vgpuctl` (the real binary) against it.

use super::common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use common::{GPU0, GPU1, Proc, daemon, register};
use tonic::Code;
use vgpu_core::sched_proto::{ComputePolicy, DaemonMsg, Priority};
use vgpu_daemon::api::{DaemonClient, connect_unix, pb};
use vgpu_daemon::daemon::Daemon;
use vgpu_daemon::model::GpuObservation;
use vgpu_daemon::reporting::{Reporting, ReportingConfig, start};

const WEB: &str = "default/web-0/app";
const BATCH: &str = "ml/train-0/worker";
const WEB_PID: u32 = 5001;
const BATCH_PID: u32 = 5002;
const BYPASS_PID: u32 = 5999;

struct Node {
    d: Arc<Daemon>,
    web: Proc,
    _batch: Proc,
    _rep: Reporting,
    _dir: tempfile::TempDir,
    socket: PathBuf,
}

/// Two tenants (web on GPU0 with a quota; batch on both GPUs, cap), NVML observations with
/// one bypass process, and the API on a unix socket.
async fn node() -> Node {
    let d = daemon();
    let web = register(
        &d,
        WEB_PID,
        WEB,
        "default",
        "web-0",
        "app",
        &[(GPU0, 50, ComputePolicy::Burst, Some(4 << 30))],
    );
    let batch = register(
        &d,
        BATCH_PID,
        BATCH,
        "ml",
        "train-0",
        "worker",
        &[
            (GPU0, 30, ComputePolicy::Cap, None),
            (GPU1, 100, ComputePolicy::Burst, None),
        ],
    );
    d.usage(web.reg.conn, 0, 1 << 30).expect("usage accepted");
    d.record_observations(
        vec![
            GpuObservation {
                uuid: GPU0.into(),
                index: 0,
                name: "NVIDIA H100 80GB HBM3".into(),
                memory_total: 80 << 30,
                memory_used: 4 << 30,
                utilization_pct: Some(40),
                processes: vec![(WEB_PID, 1 << 30), (BYPASS_PID, 3 << 30)],
                observed_unix_ms: 1_700_000_000_000,
            },
            GpuObservation {
                uuid: GPU1.into(),
                index: 1,
                name: "NVIDIA H100 80GB HBM3".into(),
                memory_total: 80 << 30,
                memory_used: 0,
                utilization_pct: Some(0),
                processes: vec![],
                observed_unix_ms: 1_700_000_000_000,
            },
        ],
        d.registered_pids(),
    );
    let dir = tempfile::tempdir().expect("temporary directory");
    // A directory that does not exist yet: the daemon creates it.
    let socket = dir.path().join("run/vgpu/api.sock");
    let rep = start(
        d.clone(),
        &ReportingConfig {
            nvml: None,
            metrics_addr: None,
            api_socket: Some(socket.clone()),
            api_addr: None,
        },
    )
    .await
    .expect("start the API");
    Node {
        d,
        web,
        _batch: batch,
        _rep: rep,
        _dir: dir,
        socket,
    }
}

async fn client(socket: &Path) -> DaemonClient<tonic::transport::Channel> {
    connect_unix(socket).await.expect("connect to the API")
}

fn set(tenant: &str) -> pb::SetSettingsRequest {
    pb::SetSettingsRequest {
        tenant: tenant.into(),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_get_and_gpus() {
    let n = node().await;
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&n.socket)
        .expect("socket exists")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600, "the API socket is owner-only");
    let mut c = client(&n.socket).await;

    let t = c
        .list_tenants(pb::ListTenantsRequest {})
        .await
        .expect("ListTenants")
        .into_inner();
    let keys: Vec<&str> = t.tenants.iter().map(|t| t.key.as_str()).collect();
    // Sorted by key.
    assert_eq!(keys, [WEB, BATCH]);
    let web = t.tenants.iter().find(|t| t.key == WEB).expect("web listed");
    assert_eq!(
        (
            web.namespace.as_str(),
            web.pod.as_str(),
            web.container.as_str()
        ),
        ("default", "web-0", "app")
    );
    assert_eq!(web.pids, [WEB_PID]);
    assert_eq!(web.gpus.len(), 1);
    let g = &web.gpus[0];
    assert_eq!(g.uuid, GPU0);
    let s = g.settings.expect("settings");
    assert_eq!(s.share_pct, 50);
    assert_eq!(s.policy, pb::ComputePolicy::Burst as i32);
    assert_eq!(s.priority, pb::Priority::BestEffort as i32);
    assert_eq!(g.source, pb::SettingsSource::Shim as i32);
    assert_eq!(g.memory_used_bytes, 1 << 30);
    assert_eq!(g.memory_quota_bytes, Some(4 << 30));
    let batch = t
        .tenants
        .iter()
        .find(|t| t.key == BATCH)
        .expect("batch listed");
    assert_eq!(batch.gpus.len(), 2);
    assert_eq!(batch.gpus[0].memory_quota_bytes, None);
    assert!(t.uptime_seconds >= 0.0);

    let one = c
        .get_tenant(pb::GetTenantRequest { key: BATCH.into() })
        .await
        .expect("GetTenant")
        .into_inner()
        .tenant
        .expect("a tenant");
    assert_eq!(&one, batch);
    let e = c
        .get_tenant(pb::GetTenantRequest {
            key: "nobody".into(),
        })
        .await
        .expect_err("unknown tenant");
    assert_eq!(e.code(), Code::NotFound);
    assert!(e.message().contains("nobody"), "{}", e.message());

    let gpus = c
        .list_gpus(pb::ListGpusRequest {})
        .await
        .expect("ListGpus")
        .into_inner()
        .gpus;
    assert_eq!(gpus.len(), 2);
    let g0 = &gpus[0];
    assert_eq!((g0.uuid.as_str(), g0.index), (GPU0, Some(0)));
    assert_eq!(g0.name, "NVIDIA H100 80GB HBM3");
    assert_eq!(g0.utilization_pct, Some(40));
    assert_eq!(g0.bypass_pids, [BYPASS_PID]);
    let p = |pid| g0.processes.iter().find(|p| p.pid == pid).expect("process");
    assert_eq!(p(WEB_PID).tenant.as_deref(), Some(WEB));
    assert!(!p(WEB_PID).bypass);
    assert_eq!(p(BYPASS_PID).tenant, None);
    assert!(p(BYPASS_PID).bypass);
    assert_eq!(p(BYPASS_PID).used_bytes, 3 << 30);
    assert!(gpus[1].bypass_pids.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn set_settings_changes_live_and_tells_the_shim() {
    let mut n = node().await;
    let mut c = client(&n.socket).await;
    let r = c
        .set_settings(pb::SetSettingsRequest {
            share_pct: Some(20),
            policy: Some(pb::ComputePolicy::Cap as i32),
            priority: Some(pb::Priority::LatencySensitive as i32),
            ..set(WEB)
        })
        .await
        .expect("SetSettings")
        .into_inner()
        .tenant
        .expect("the tenant after the change");
    let s = r.gpus[0].settings.expect("settings");
    assert_eq!(s.share_pct, 20);
    assert_eq!(s.policy, pb::ComputePolicy::Cap as i32);
    assert_eq!(s.priority, pb::Priority::LatencySensitive as i32);
    assert_eq!(r.gpus[0].source, pb::SettingsSource::Api as i32);
    // The daemon's own view agrees, and the shim was told.
    let snap = n.d.snapshot();
    let web = snap.tenants.iter().find(|t| t.key == WEB).expect("web");
    assert_eq!(web.gpus[0].settings.share_pct, 20);
    let mut told = None;
    while let Ok(m) = n.web.rx.try_recv() {
        if let DaemonMsg::Settings { gpu, settings } = m {
            told = Some((gpu, settings));
        }
    }
    let (gpu, settings) = told.expect("a Settings message to the shim");
    assert_eq!(gpu, 0);
    assert_eq!(settings.share_pct, 20);
    assert_eq!(settings.priority, Priority::LatencySensitive);

    // One GPU of two: the other keeps its settings.
    let r = c
        .set_settings(pb::SetSettingsRequest {
            gpu_uuid: Some(GPU1.into()),
            share_pct: Some(70),
            ..set(BATCH)
        })
        .await
        .expect("SetSettings on one GPU")
        .into_inner()
        .tenant
        .expect("tenant");
    let by = |u: &str| r.gpus.iter().find(|g| g.uuid == u).expect("gpu");
    assert_eq!(by(GPU1).settings.expect("s").share_pct, 70);
    assert_eq!(by(GPU0).settings.expect("s").share_pct, 30);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn set_settings_rejects_bad_values_naming_them() {
    let n = node().await;
    let mut c = client(&n.socket).await;
    let cases: Vec<(pb::SetSettingsRequest, Code, &str)> = vec![
        (
            pb::SetSettingsRequest {
                share_pct: Some(0),
                ..set(WEB)
            },
            Code::InvalidArgument,
            "compute share 0 %",
        ),
        (
            pb::SetSettingsRequest {
                share_pct: Some(101),
                ..set(WEB)
            },
            Code::InvalidArgument,
            "compute share 101 %",
        ),
        (
            pb::SetSettingsRequest {
                policy: Some(7),
                ..set(WEB)
            },
            Code::InvalidArgument,
            "compute policy 7",
        ),
        (
            pb::SetSettingsRequest {
                policy: Some(0),
                ..set(WEB)
            },
            Code::InvalidArgument,
            "compute policy 0",
        ),
        (
            pb::SetSettingsRequest {
                priority: Some(-3),
                ..set(WEB)
            },
            Code::InvalidArgument,
            "priority -3",
        ),
        (set(WEB), Code::InvalidArgument, "nothing to change"),
        (
            pb::SetSettingsRequest {
                share_pct: Some(10),
                ..set("")
            },
            Code::InvalidArgument,
            "tenant key is empty",
        ),
        (
            pb::SetSettingsRequest {
                share_pct: Some(10),
                gpu_uuid: Some("gpu0".into()),
                ..set(WEB)
            },
            Code::InvalidArgument,
            "\"gpu0\"",
        ),
        (
            pb::SetSettingsRequest {
                share_pct: Some(10),
                gpu_uuid: Some(GPU1.into()),
                ..set(WEB)
            },
            Code::InvalidArgument,
            GPU1,
        ),
        (
            pb::SetSettingsRequest {
                share_pct: Some(10),
                ..set("ghost/pod/c")
            },
            Code::NotFound,
            "ghost/pod/c",
        ),
    ];
    for (req, code, needle) in cases {
        let e = c
            .set_settings(req.clone())
            .await
            .expect_err(&format!("{req:?} is refused"));
        assert_eq!(e.code(), code, "{req:?}: {e:?}");
        assert!(
            e.message().contains(needle),
            "{req:?}: message {:?} does not name {needle:?}",
            e.message()
        );
    }
    // Nothing changed.
    let snap = n.d.snapshot();
    let web = snap.tenants.iter().find(|t| t.key == WEB).expect("web");
    assert_eq!(web.gpus[0].settings.share_pct, 50);
    assert_eq!(web.gpus[0].settings.policy, ComputePolicy::Burst);
}

fn vgpuctl(socket: &Path, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(crate::vgpuctl_bin())
        .arg("--api-socket")
        .arg(socket)
        .args(args)
        .env_remove("VGPU_API_SOCKET")
        .output()
        .expect("run vgpuctl");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

async fn ctl(socket: &Path, args: &[&str]) -> (bool, String, String) {
    let socket = socket.to_owned();
    let args: Vec<String> = args.iter().map(|s| (*s).to_owned()).collect();
    tokio::task::spawn_blocking(move || {
        let a: Vec<&str> = args.iter().map(String::as_str).collect();
        vgpuctl(&socket, &a)
    })
    .await
    .expect("vgpuctl task")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vgpuctl_against_the_api() {
    let n = node().await;
    let s = &n.socket;

    let (ok, out, err) = ctl(s, &["tenants"]).await;
    assert!(ok, "{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert!(lines[0].starts_with("TENANT"), "{out}");
    assert!(lines[0].contains("SHARE(CFG/ACH)") && lines[0].contains("MEMORY(USED/QUOTA)"));
    let web = lines
        .iter()
        .find(|l| l.starts_with(WEB))
        .unwrap_or_else(|| panic!("no web line in\n{out}"));
    for want in [
        "default/web-0",
        "50%/0.0%",
        "burst",
        "best-effort",
        "1Gi/4Gi",
        "5001",
        "idle",
    ] {
        assert!(web.contains(want), "{want:?} missing from {web:?}");
    }
    // batch: one line per GPU, GPU shown by NVML index.
    let batch: Vec<&&str> = lines.iter().filter(|l| l.starts_with(BATCH)).collect();
    assert_eq!(batch.len(), 2, "{out}");
    assert!(
        batch
            .iter()
            .any(|l| l.contains("30%/") && l.contains("cap") && l.contains("unlimited"))
    );

    let (ok, out, err) = ctl(s, &["gpus"]).await;
    assert!(ok, "{err}");
    let bypass = out
        .lines()
        .find(|l| l.contains(&format!("pid {BYPASS_PID}")))
        .unwrap_or_else(|| panic!("no bypass process line in\n{out}"));
    assert!(bypass.contains("BYPASS"), "{bypass}");
    let registered = out
        .lines()
        .find(|l| l.contains(&format!("pid {WEB_PID}")))
        .expect("web's process");
    assert!(registered.contains(&format!("tenant {WEB}")) && !registered.contains("BYPASS"));

    let (ok, out, err) = ctl(s, &["--json", "gpus"]).await;
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("JSON output");
    assert_eq!(v["gpus"][0]["bypass_pids"][0], BYPASS_PID);

    let (ok, out, err) = ctl(s, &["set", WEB, "--share", "35", "--policy", "cap"]).await;
    assert!(ok, "{err}");
    assert!(out.contains("35%/") && out.contains("cap"), "{out}");
    let (ok, out, err) = ctl(s, &["--json", "tenant", WEB]).await;
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("JSON output");
    assert_eq!(v["gpus"][0]["share_pct"], 35);
    assert_eq!(v["gpus"][0]["policy"], "cap");
    assert_eq!(v["gpus"][0]["source"], "api");
    let (ok, _, err) = ctl(
        s,
        &["set", WEB, "--priority", "latency-sensitive", "--gpu", GPU0],
    )
    .await;
    assert!(ok, "{err}");
    let (ok, out, _) = ctl(s, &["--json", "tenants"]).await;
    assert!(ok);
    let v: serde_json::Value = serde_json::from_str(&out).expect("JSON output");
    let web = v["tenants"]
        .as_array()
        .expect("tenants")
        .iter()
        .find(|t| t["key"] == WEB)
        .expect("web in JSON")
        .clone();
    assert_eq!(web["gpus"][0]["priority"], "latency-sensitive");

    // Errors: named, non-zero exit, nothing on stdout.
    let (ok, out, err) = ctl(s, &["set", WEB, "--share", "0"]).await;
    assert!(!ok && out.is_empty());
    assert!(
        err.contains("compute share 0 %") && err.contains("InvalidArgument"),
        "{err}"
    );
    let (ok, _, err) = ctl(s, &["set", "ghost", "--share", "10"]).await;
    assert!(!ok);
    assert!(err.contains("ghost") && err.contains("NotFound"), "{err}");
    let (ok, _, err) = ctl(s, &["set", WEB, "--policy", "fast"]).await;
    assert!(!ok);
    assert!(err.contains("fast"), "{err}");
    let (ok, _, err) = ctl(s, &["set", WEB]).await;
    assert!(!ok);
    assert!(err.contains("nothing to set"), "{err}");
    let (ok, _, err) = ctl(s, &["tenant", "ghost"]).await;
    assert!(!ok);
    assert!(err.contains("ghost"), "{err}");
    let missing = n._dir.path().join("absent.sock");
    let (ok, _, err) = ctl(&missing, &["tenants"]).await;
    assert!(!ok);
    assert!(err.contains(&missing.display().to_string()), "{err}");
}

/// As many tenants as the daemon keeps at most, each with long names and 16 GPUs: the
/// listing is larger than gRPC's default 4 MiB message, and `vgpuctl` still shows it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vgpuctl_lists_as_many_tenants_as_the_daemon_keeps() {
    let d = daemon();
    let gpus: Vec<String> = (0..16)
        .map(|i| format!("GPU-{i:08x}-0000-4000-8000-000000000000"))
        .collect();
    let mut keep = Vec::new();
    for t in 0..3000u32 {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let ident = vgpu_core::sched_proto::ContainerIdent {
            key: format!("{t:06}/{}", "k".repeat(500)),
            namespace: "n".repeat(253),
            pod: "p".repeat(253),
            container: "c".repeat(253),
            container_dir: String::new(),
            overridden: Vec::new(),
        };
        let regs = gpus
            .iter()
            .enumerate()
            .map(|(i, u)| common::gpu(u, u32::try_from(i).expect("16"), 5))
            .collect();
        let r = d
            .register(
                6000 + t,
                vgpu_core::sched_proto::PROTO_VERSION,
                ident,
                regs,
                tx,
            )
            .expect("registered");
        keep.push((r, rx));
    }
    let dir = tempfile::tempdir().expect("temporary directory");
    let socket = dir.path().join("api.sock");
    let _rep = start(
        d.clone(),
        &ReportingConfig {
            nvml: None,
            metrics_addr: None,
            api_socket: Some(socket.clone()),
            api_addr: None,
        },
    )
    .await
    .expect("start the API");
    let (ok, out, err) = ctl(&socket, &["--json", "tenants"]).await;
    assert!(ok, "vgpuctl tenants failed: {err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    assert_eq!(v["tenants"].as_array().map(Vec::len), Some(3000));
}
