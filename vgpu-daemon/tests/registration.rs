//! Registration as the daemon decides it: the quota file read by its one rule in trusted
//! mode (UUIDs matched ignoring case and white space; a GPU the container can see but
//! was not granted is not scheduled, never a refusal of the whole process), GPUs the
//! node does not have refused, and bounds on what any client can make the daemon keep.

use super::common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::{config, daemon, gpu, ident};
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};
use vgpu_core::sched_proto::{ComputePolicy, DaemonMsg, GpuRegistration, MAX_GPUS, PROTO_VERSION};
use vgpu_daemon::daemon::{Daemon, DaemonError, EXIT_GRACE_NS, Registered};
use vgpu_daemon::model::{GpuObservation, SettingsSource};

const A: &str = "GPU-aaaaaaaa-0000-4000-8000-000000000000";
const B: &str = "GPU-bbbbbbbb-0000-4000-8000-000000000000";

/// Writes a quota file listing `gpus` (UUID as written, milli-GPU, policy).
fn quota_file(dir: &Path, gpus: &[(&str, u32, &str)]) -> PathBuf {
    let g: Vec<String> = gpus
        .iter()
        .map(|(u, milli, policy)| {
            format!(
                r#"{{"uuid":"{u}","memory_mib":1024,"compute_milli":{milli},"slices":1,"compute_policy":"{policy}"}}"#
            )
        })
        .collect();
    let path = dir.join("vgpu.conf");
    std::fs::write(
        &path,
        format!(
            r#"{{"version":1,"namespace":"ml","pod":"nb","uid":"u","container":"main","init":false,"gpus":[{}],"device_ids":[]}}"#,
            g.join(",")
        ),
    )
    .expect("write the quota file");
    path
}

/// A daemon in trusted mode reading `conf`: outside a container `/proc/PID/root` is
/// `/`, so with this process's PID the in-container path is the host path.
fn trusted(conf: &Path) -> Arc<Daemon> {
    let mut c = config();
    c.trusted_quota_file = Some(conf.to_owned());
    Daemon::new(c)
}

fn register(
    d: &Daemon,
    key: &str,
    gpus: Vec<GpuRegistration>,
) -> (
    Result<Registered, DaemonError>,
    UnboundedReceiver<DaemonMsg>,
) {
    let (tx, rx) = unbounded_channel();
    let r = d.register(std::process::id(), PROTO_VERSION, ident(key), gpus, tx);
    (r, rx)
}

#[test]
fn the_daemon_matches_a_gpu_as_the_quota_file_rule_does() {
    let dir = tempfile::tempdir().expect("temp dir");
    // The file spells the UUID in another case, with white space around it.
    let conf = quota_file(
        dir.path(),
        &[(
            &format!("  {} ", A.to_uppercase().replace("GPU-", "gpu-")),
            300,
            "cap",
        )],
    );
    let d = trusted(&conf);
    let (r, _rx) = register(&d, "ml/nb/main", vec![gpu(A, 0, 100)]);
    let r = r.expect("registered: the file lists this GPU");
    let t = &d.snapshot().tenants[0];
    assert_eq!(t.gpus.len(), 1);
    assert_eq!(t.gpus[0].settings.share_pct, 30, "{t:?}");
    assert_eq!(t.gpus[0].settings.policy, ComputePolicy::Cap);
    assert_eq!(t.gpus[0].source, SettingsSource::QuotaFile);
    drop(r);
}

#[test]
fn a_gpu_the_file_does_not_list_is_not_granted_and_the_process_stays_registered() {
    let dir = tempfile::tempdir().expect("temp dir");
    let conf = quota_file(dir.path(), &[(A, 300, "burst")]);
    let d = trusted(&conf);
    // An older shim registers every GPU it can see.
    let (r, _rx) = register(&d, "ml/nb/main", vec![gpu(B, 0, 100), gpu(A, 1, 100)]);
    let r = r.expect("the whole process is never refused for a GPU it was not granted");
    let DaemonMsg::Welcome {
        words, settings, ..
    } = &r.welcome
    else {
        panic!("not a Welcome: {:?}", r.welcome);
    };
    assert_eq!(words.len(), 2, "one word per registered GPU");
    assert_eq!(settings[1].share_pct, 30);
    // The GPU it was not given is not scheduled: the tenant does not use it, and a
    // launch blocked on it never gets a grant (its word is never held).
    let t = &d.snapshot().tenants[0];
    let used: Vec<&str> = t.gpus.iter().map(|g| g.uuid.as_str()).collect();
    assert_eq!(used, vec![A], "{t:?}");
    d.demand(r.conn, 0, None)
        .expect("a demand on it is not a protocol error");
    d.demand(r.conn, 1, None)
        .expect("demand on the granted GPU");
    assert_eq!(
        r.board
            .word(words[0] as usize)
            .load(std::sync::atomic::Ordering::SeqCst)
            & 1,
        0,
        "the GPU it was not granted is never held"
    );
    assert_eq!(
        r.board
            .word(words[1] as usize)
            .load(std::sync::atomic::Ordering::SeqCst)
            & 1,
        1,
        "the granted GPU is held (no other tenant)"
    );
    assert_ne!(words[0], words[1]);
}

/// Issue 39 item 1 (ADR 0042): a tenant whose environment asks for 79 GiB registers
/// with that quota in its `Hello`; in trusted mode the daemon shows and meters the
/// file's 1 GiB (before: 79 GiB), and with no file, no quota (never the `Hello`'s).
/// Without trusted mode (a bare machine) the `Hello` is all there is.
#[test]
fn the_memory_quota_shown_is_the_files_never_the_one_the_tenant_wrote() {
    let forged = |uuid: &str| GpuRegistration {
        memory_quota: Some(79 << 30),
        ..gpu(uuid, 0, 100)
    };
    let dir = tempfile::tempdir().expect("temp dir");
    let conf = quota_file(dir.path(), &[(A, 300, "burst")]);
    let d = trusted(&conf);
    let (r, _rx) = register(&d, "ml/nb/main", vec![forged(A)]);
    r.expect("registered");
    let quota = |d: &Daemon| d.snapshot().tenants[0].gpus[0].memory_quota;
    assert_eq!(quota(&d), Some(1 << 30), "the file's 1024 MiB");
    let d = trusted(&dir.path().join("absent.conf"));
    let (r, _rx) = register(&d, "ml/nb/main", vec![forged(A)]);
    r.expect("registered with the default settings");
    assert_eq!(quota(&d), None, "no file: no quota shown, not the Hello's");
    let d = Daemon::new(config());
    let (r, _rx) = register(&d, "ml/nb/main", vec![forged(A)]);
    r.expect("registered");
    assert_eq!(quota(&d), Some(79 << 30), "untrusted mode: the shim's");
}

/// What the environment asked that the quota file overrode comes with the `Hello`
/// (bounded: a Hello with more lines than the protocol allows is refused by name).
#[test]
fn overridden_lines_are_accepted_within_their_bounds() {
    use vgpu_core::sched_proto::{MAX_OVERRIDDEN, MAX_OVERRIDDEN_LEN};
    let d = Daemon::new(config());
    let with = |lines: Vec<String>| {
        let (tx, _rx) = unbounded_channel();
        let mut id = ident("ml/nb/main");
        id.overridden = lines;
        d.register(
            std::process::id(),
            PROTO_VERSION,
            id,
            vec![gpu(A, 0, 100)],
            tx,
        )
    };
    with(vec![
        "VGPU_CONTAINER_DIR=/tmp/x is not this container's directory".into(),
    ])
    .expect("one line");
    let e = with(vec!["x".into(); MAX_OVERRIDDEN + 1])
        .expect_err("too many lines")
        .to_string();
    assert!(e.contains("overridden"), "{e}");
    let e = with(vec!["x".repeat(MAX_OVERRIDDEN_LEN + 1)])
        .expect_err("too long a line")
        .to_string();
    assert!(e.contains("overridden"), "{e}");
}

#[test]
fn a_process_granted_no_gpu_it_registers_is_refused_naming_the_file() {
    let dir = tempfile::tempdir().expect("temp dir");
    let conf = quota_file(dir.path(), &[(A, 300, "burst")]);
    let d = trusted(&conf);
    let (r, _rx) = register(&d, "ml/nb/main", vec![gpu(B, 0, 100)]);
    let e = r.expect_err("nothing to schedule").to_string();
    assert!(e.contains(B) && e.contains("vgpu.conf"), "{e}");
    assert!(d.snapshot().tenants.is_empty(), "a refusal keeps nothing");
}

fn observed(uuids: &[&str]) -> Vec<GpuObservation> {
    uuids
        .iter()
        .enumerate()
        .map(|(i, u)| GpuObservation {
            uuid: (*u).to_owned(),
            index: u32::try_from(i).expect("few"),
            ..GpuObservation::default()
        })
        .collect()
}

#[test]
fn gpus_the_node_does_not_have_are_refused() {
    let d = daemon();
    d.record_observations(observed(&[A, B]), HashMap::new());
    let made_up = "GPU-deadbeef-0000-4000-8000-000000000000";
    let (r, _rx) = register(&d, "t", vec![gpu(A, 0, 50), gpu(made_up, 1, 50)]);
    let e = r.expect_err("a GPU NVML does not list").to_string();
    assert!(e.contains(made_up), "{e}");
    let (r, _rx) = register(&d, "t", vec![gpu(&A.to_uppercase(), 0, 50)]);
    r.expect("a GPU of the node, in another case");
    let snap = d.snapshot();
    assert_eq!(snap.gpus.len(), 2, "{:?}", snap.gpus);
}

#[test]
fn a_tenant_process_that_exits_after_an_nvml_reading_is_not_a_bypass() {
    // Seen on a real H100: vgpuctl gpus flagged two tenants' processes BYPASS right after
    // they exited, because the last reading (up to one interval old) still listed them.
    let d = daemon();
    d.record_observations(observed(&[A]), HashMap::new());
    let (tx, _rx) = unbounded_channel();
    let r = d
        .register(
            4242,
            PROTO_VERSION,
            ident("ml/nb/main"),
            vec![gpu(A, 0, 50)],
            tx,
        )
        .expect("registered");
    let before = d.registered_pids();
    let mut reading = observed(&[A]);
    reading[0].processes = vec![(4242, 600 << 20), (4343, 500 << 20)];
    d.disconnect(r.conn);
    d.record_observations(reading.clone(), before);
    let g = &d.snapshot().gpus[0];
    let exited = g.processes.iter().find(|p| p.pid == 4242).expect("listed");
    assert_eq!(exited.tenant.as_deref(), Some("ml/nb/main"), "{g:?}");
    assert_eq!(
        g.bypass_pids,
        vec![4343],
        "only the unregistered process: {g:?}"
    );
    // A reading taken after it unregistered still lists it while the driver frees an
    // exiting process's memory (seen on an H200, containers throttled to 0.5 CPU): within
    // the exit grace it is the tenant's (4242 is no process here: gone, not running).
    d.record_observations(reading.clone(), d.registered_pids());
    let g = &d.snapshot().gpus[0];
    assert_eq!(g.bypass_pids, vec![4343], "within the exit grace: {g:?}");
    // Past the grace, a process still listed is a bypass.
    let later = vgpu_sys::mono_ns() + EXIT_GRACE_NS + 1;
    d.record_observations(reading, d.registered_pids_at(later));
    assert_eq!(d.snapshot().gpus[0].bypass_pids, vec![4242, 4343]);
}

/// Process `pid` of tenant `ml/nb/main` on GPU A registers, then its connection closes.
fn registered_then_gone(d: &Daemon, pid: u32) {
    let (tx, _rx) = unbounded_channel();
    let r = d
        .register(
            pid,
            PROTO_VERSION,
            ident("ml/nb/main"),
            vec![gpu(A, 0, 50)],
            tx,
        )
        .expect("registered");
    d.disconnect(r.conn);
}

#[test]
fn a_process_in_local_fallback_is_not_a_bypass() {
    // A process that runs on after its connection closed enforces its share with its own
    // shim: its memory in an NVML reading is its tenant's, however long it runs.
    let d = daemon();
    let me = std::process::id();
    registered_then_gone(&d, me);
    let mut reading = observed(&[A]);
    reading[0].processes = vec![(me, 600 << 20)];
    let later = vgpu_sys::mono_ns() + EXIT_GRACE_NS + 1;
    d.record_observations(reading, d.registered_pids_at(later));
    let g = &d.snapshot().gpus[0];
    assert!(g.bypass_pids.is_empty(), "{g:?}");
    assert_eq!(
        g.processes[0].tenant.as_deref(),
        Some("ml/nb/main"),
        "{g:?}"
    );
}

#[test]
fn a_process_in_fallback_that_exits_stays_its_tenants_for_the_exit_grace() {
    let d = daemon();
    let mut child = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .expect("start sleep");
    let pid = child.id();
    registered_then_gone(&d, pid);
    let tenant_of = |m: HashMap<u32, String>| m.get(&pid).cloned();
    assert_eq!(
        tenant_of(d.registered_pids()).as_deref(),
        Some("ml/nb/main"),
        "runs on in fallback"
    );
    child.kill().expect("kill sleep");
    child.wait().expect("reap sleep");
    let now = vgpu_sys::mono_ns();
    assert_eq!(
        tenant_of(d.registered_pids_at(now)).as_deref(),
        Some("ml/nb/main"),
        "exited: its tenant's within the grace"
    );
    assert_eq!(
        tenant_of(d.registered_pids_at(now + EXIT_GRACE_NS + 1)),
        None,
        "past the grace"
    );
}

#[test]
fn what_hellos_naming_made_up_gpus_leave_behind_is_bounded() {
    // No NVML reading and no configured list: the daemon cannot tell real GPUs from made-up
    // ones, so what it keeps must be bounded by what is registered now.
    let d = daemon();
    for round in 0..200u32 {
        let gpus: Vec<GpuRegistration> = (0..MAX_GPUS as u32)
            .map(|i| {
                gpu(
                    &format!("GPU-{round:08x}-{i:04x}-4000-8000-000000000000"),
                    i,
                    10,
                )
            })
            .collect();
        let (r, _rx) = register(&d, &format!("t{round}"), gpus);
        if let Ok(r) = r {
            d.disconnect(r.conn);
        }
    }
    let snap = d.snapshot();
    assert!(snap.tenants.is_empty());
    assert!(
        snap.gpus.is_empty(),
        "{} GPUs kept after every process left",
        snap.gpus.len()
    );
    // While registered, distinct GPUs are capped.
    let mut live = Vec::new();
    let mut refused = 0;
    for round in 0..40u32 {
        let gpus: Vec<GpuRegistration> = (0..MAX_GPUS as u32)
            .map(|i| {
                gpu(
                    &format!("GPU-{round:08x}-{i:04x}-4000-8000-000000000001"),
                    i,
                    10,
                )
            })
            .collect();
        match register(&d, &format!("t{round}"), gpus) {
            (Ok(r), rx) => live.push((r, rx)),
            (Err(e), _) => {
                assert!(e.to_string().contains("GPU"), "{e}");
                refused += 1;
            }
        }
    }
    assert!(refused > 0, "640 distinct GPUs accepted");
    assert!(d.snapshot().gpus.len() <= 64, "{}", d.snapshot().gpus.len());
}

#[test]
fn connections_per_tenant_are_capped_and_a_refusal_keeps_nothing() {
    let d = daemon();
    let mut live = Vec::new();
    let mut refused = None;
    for _ in 0..1100 {
        match register(&d, "one-tenant", vec![gpu(A, 0, 10)]) {
            (Ok(r), rx) => live.push((r, rx)),
            (Err(e), _) => {
                refused = Some(e.to_string());
                break;
            }
        }
    }
    let e = refused.expect("a tenant cannot register without bound");
    assert!(e.contains("one-tenant"), "{e}");
    assert_eq!(d.snapshot().tenants[0].pids.len(), 1, "one PID, many conns");
    // Identity fields longer than Kubernetes allows are refused, naming the field.
    let mut id = ident("long");
    id.pod = "p".repeat(300);
    let (tx, _rx) = unbounded_channel();
    let e = d
        .register(
            std::process::id(),
            PROTO_VERSION,
            id,
            vec![gpu(A, 0, 10)],
            tx,
        )
        .expect_err("a 300-byte pod name")
        .to_string();
    assert!(e.contains("pod"), "{e}");
    assert_eq!(
        d.snapshot().tenants.len(),
        1,
        "nothing kept for the refused one"
    );
}

#[test]
fn a_tenant_whose_last_process_leaves_is_off_every_gpu_it_used() {
    // Two processes of one container, each on its own GPU; the first leaves, then the
    // last: nothing of the tenant, nor of either GPU, stays behind.
    let d = daemon();
    let (r1, _rx1) = register(&d, "two-gpus", vec![gpu(A, 0, 10)]);
    let (r2, _rx2) = register(&d, "two-gpus", vec![gpu(B, 0, 10)]);
    let (r1, r2) = (r1.expect("first"), r2.expect("second"));
    assert_eq!(d.snapshot().gpus.len(), 2);
    d.disconnect(r1.conn);
    assert_eq!(
        d.snapshot().tenants[0].gpus.len(),
        2,
        "the tenant still has both"
    );
    d.disconnect(r2.conn);
    let snap = d.snapshot();
    assert!(snap.tenants.is_empty());
    assert!(snap.gpus.is_empty(), "{:?}", snap.gpus);
}

/// A process whose old connection's close is seen only after it registered again (both
/// queued while the daemon was stopped) is not in fallback; once its last connection
/// closes while it runs, it is.
#[test]
fn a_process_registered_again_before_its_old_close_is_seen_is_not_in_fallback() {
    let d = daemon();
    let me = std::process::id();
    let uuid = "GPU-51570000-0000-4000-8000-00000000f0b1";
    let gpus = [(uuid, 50, ComputePolicy::Burst, None)];
    let old = common::register(&d, me, "ns/p/c", "ns", "p", "c", &gpus);
    let new = common::register(&d, me, "ns/p/c", "ns", "p", "c", &gpus);
    let in_fallback = |d: &Daemon| {
        d.snapshot()
            .health
            .iter()
            .find(|h| h.key == "ns/p/c")
            .map_or(0, |h| h.processes_in_fallback)
    };
    d.disconnect(old.reg.conn);
    assert_eq!(in_fallback(&d), 0, "still registered on its new connection");
    d.disconnect(new.reg.conn);
    assert_eq!(
        in_fallback(&d),
        1,
        "its last connection closed while it runs"
    );
}
