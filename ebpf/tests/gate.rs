//! The gate and the exit watcher on the real kernel (root): a cgroup2 child, device nodes
//! made with mknod, the scripted ebpf-probe process inside the cgroup. A recorded skip
//! without the privileges (`vgpu-test-needs`), a failure instead under `CI=true`. Everything is detached and
//! unpinned at the end of each test.

#![allow(clippy::unwrap_used)] // test code: a failed step is the failure

mod support;

use std::time::{Duration, Instant};

use support::{Bpffs, ENXIO, EPERM, Nodes, Probe, TestCgroup, drain, privileged, wait_event};
use vgpu_ebpf::{EbpfConfig, EbpfError, Enforcer, EventKind, GpuDevice, Mode};

fn config(mode: Mode, cgroup: &TestCgroup) -> EbpfConfig {
    EbpfConfig {
        mode,
        cgroup_root: cgroup.path.clone(),
        pin_dir: None,
    }
}

const GPU: [GpuDevice; 1] = [GpuDevice {
    major: 195,
    minor: None,
}];

#[test]
fn enforce_refuses_unregistered_gpu_opens_and_allows_registered_ones() {
    if !privileged() {
        return;
    }
    let nodes = Nodes::new();
    let cgroup = TestCgroup::new();
    let mut enforcer = Enforcer::attach(&config(Mode::Enforce, &cgroup), &GPU).unwrap();
    let mut events = enforcer.take_gate_events().unwrap();
    {
        let mut probe = Probe::spawn_in(&cgroup);
        assert_eq!(probe.open(&nodes.path("nvidia0")), EPERM);
        assert_eq!(probe.open(&nodes.path("nvidiactl")), EPERM);
        assert_eq!(
            probe.open(&nodes.path("null")),
            "ok",
            "non-GPU devices always open"
        );
        // This test process is outside the gated cgroup: the driver-less node answers ENXIO.
        let outside = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(nodes.path("nvidia0"));
        assert_eq!(outside.unwrap_err().raw_os_error(), Some(6));

        let refused = wait_event(&mut events, EventKind::Refused, probe.pid).expect("an event");
        assert_eq!(refused.cgroup_id, cgroup.id());
        let root = support::cgroup2_mount().unwrap();
        let found = vgpu_ebpf::find_cgroup(&root, refused.cgroup_id).unwrap();
        assert_eq!(
            found.as_deref(),
            Some(cgroup.path.as_path()),
            "the event names its cgroup"
        );
        assert_eq!(refused.device, Some((195, 0)));
        assert_eq!(refused.pid, probe.pid);
        assert_eq!(refused.comm, "ebpf-probe");
        let second = wait_event(&mut events, EventKind::Refused, probe.pid).expect("an event");
        assert_eq!(second.device, Some((195, 255)));
        assert_eq!(
            drain(&mut events),
            vec![],
            "one event per refused open, none for /dev/null"
        );

        enforcer.allow_tgid(probe.pid).unwrap();
        assert_eq!(
            probe.open(&nodes.path("nvidia0")),
            ENXIO,
            "a registered process passes"
        );
        enforcer.forget_tgid(probe.pid).unwrap();
        assert_eq!(probe.open(&nodes.path("nvidia0")), EPERM);
        let counters = enforcer.counters().unwrap();
        assert_eq!(
            (counters.refused, counters.audited, counters.lost),
            (3, 0, 0)
        );
    }
    enforcer.detach().unwrap();
    let mut probe = Probe::spawn_in(&cgroup);
    assert_eq!(
        probe.open(&nodes.path("nvidia0")),
        ENXIO,
        "detached: nothing is gated"
    );
}

#[test]
fn audit_allows_and_reports_what_enforce_would_refuse() {
    if !privileged() {
        return;
    }
    let nodes = Nodes::new();
    let cgroup = TestCgroup::new();
    let mut enforcer = Enforcer::attach(&config(Mode::Audit, &cgroup), &GPU).unwrap();
    let mut events = enforcer.take_gate_events().unwrap();
    let mut probe = Probe::spawn_in(&cgroup);
    assert_eq!(probe.open(&nodes.path("nvidia0")), ENXIO);
    let audited = wait_event(&mut events, EventKind::Audited, probe.pid).expect("an event");
    assert_eq!(
        (audited.cgroup_id, audited.device),
        (cgroup.id(), Some((195, 0)))
    );
    enforcer.allow_tgid(probe.pid).unwrap();
    assert_eq!(probe.open(&nodes.path("nvidia0")), ENXIO);
    assert_eq!(
        drain(&mut events),
        vec![],
        "a registered open is not reported"
    );

    enforcer.forget_tgid(probe.pid).unwrap();
    enforcer.set_mode(Mode::Enforce).unwrap();
    assert_eq!(
        probe.open(&nodes.path("nvidia0")),
        EPERM,
        "switching to enforce needs no re-attach"
    );
    assert_eq!(enforcer.counters().unwrap().audited, 1);
    drop(probe);
    enforcer.detach().unwrap();
}

#[test]
fn a_trusted_cgroup_opens_gpu_nodes_without_registering() {
    if !privileged() {
        return;
    }
    let nodes = Nodes::new();
    let cgroup = TestCgroup::new();
    let mut enforcer = Enforcer::attach(&config(Mode::Enforce, &cgroup), &GPU).unwrap();
    let mut events = enforcer.take_gate_events().unwrap();
    let mut probe = Probe::spawn_in(&cgroup);
    enforcer.trust_cgroup(cgroup.id()).unwrap();
    assert_eq!(probe.open(&nodes.path("nvidia0")), ENXIO);
    enforcer.distrust_cgroup(cgroup.id()).unwrap();
    assert_eq!(probe.open(&nodes.path("nvidia0")), EPERM);
    assert_eq!(drain(&mut events).len(), 1);
    // Guarding only 195:255 leaves 195:0 open.
    enforcer
        .set_gpu_devices(&[GpuDevice {
            major: 195,
            minor: Some(255),
        }])
        .unwrap();
    assert_eq!(probe.open(&nodes.path("nvidia0")), ENXIO);
    assert_eq!(probe.open(&nodes.path("nvidiactl")), EPERM);
    // An empty set guards nothing; a major past 12 bits is refused by name.
    enforcer.set_gpu_devices(&[]).unwrap();
    assert_eq!(probe.open(&nodes.path("nvidiactl")), ENXIO);
    let error = enforcer
        .set_gpu_devices(&[GpuDevice {
            major: 4096,
            minor: None,
        }])
        .unwrap_err();
    assert!(error.to_string().contains("4096"), "{error}");
    drop(probe);
    enforcer.detach().unwrap();
}

#[test]
fn a_sigkilled_watched_process_is_reported_and_forgotten() {
    if !privileged() {
        return;
    }
    let cgroup = TestCgroup::new();
    let mut enforcer = Enforcer::attach(&config(Mode::Enforce, &cgroup), &GPU).unwrap();
    let mut events = enforcer.take_exit_events().unwrap();
    let mut probe = Probe::spawn_in(&cgroup);
    enforcer.allow_tgid(probe.pid).unwrap();
    let pid = probe.pid;
    let killed = Instant::now();
    probe.child.kill().unwrap();
    let exit = wait_event(&mut events, EventKind::Exit, pid).expect("an exit event");
    let latency = killed.elapsed();
    println!("exit event {latency:?} after SIGKILL");
    assert!(
        latency < Duration::from_secs(2),
        "generous bound: {latency:?}"
    );
    assert_eq!(
        (exit.tgid, exit.cgroup_id, exit.device),
        (pid, cgroup.id(), None)
    );
    assert!(
        !enforcer.is_allowed(pid),
        "a dead pid's registration must not outlive it"
    );
    assert_eq!(enforcer.counters().unwrap().exits, 1);
    drop(probe);
    enforcer.detach().unwrap();
}

#[test]
fn a_process_that_opened_a_gpu_node_is_watched_without_asking() {
    if !privileged() {
        return;
    }
    let nodes = Nodes::new();
    let cgroup = TestCgroup::new();
    let mut enforcer = Enforcer::attach(&config(Mode::Audit, &cgroup), &GPU).unwrap();
    let mut events = enforcer.take_exit_events().unwrap();
    let mut quiet = Probe::spawn_in(&cgroup);
    let mut user = Probe::spawn_in(&cgroup);
    assert_eq!(user.open(&nodes.path("nvidia0")), ENXIO);
    assert_eq!(quiet.open(&nodes.path("null")), "ok");
    let (quiet_pid, user_pid) = (quiet.pid, user.pid);
    drop(user);
    let exit = wait_event(&mut events, EventKind::Exit, user_pid).expect("exit of the GPU user");
    assert_eq!(exit.cgroup_id, cgroup.id());
    drop(quiet);
    let rest = drain(&mut events);
    assert!(rest.iter().all(|event| event.tgid != quiet_pid), "{rest:?}");
    enforcer.detach().unwrap();
}

#[test]
fn pinned_enforcement_outlives_the_enforcer_until_detached() {
    if !privileged() {
        return;
    }
    let nodes = Nodes::new();
    let cgroup = TestCgroup::new();
    let bpffs = Bpffs::new();
    let pinned = EbpfConfig {
        pin_dir: Some(bpffs.dir.path().to_owned()),
        ..config(Mode::Enforce, &cgroup)
    };
    let mut probe = Probe::spawn_in(&cgroup);
    let mut registered = Probe::spawn_in(&cgroup);
    let mut first = Enforcer::attach(&pinned, &GPU).unwrap();
    first.allow_tgid(registered.pid).unwrap();
    drop(first); // the daemon dies
    assert_eq!(
        probe.open(&nodes.path("nvidia0")),
        EPERM,
        "fail-closed while the daemon is down"
    );
    assert_eq!(
        registered.open(&nodes.path("nvidia0")),
        ENXIO,
        "registrations survive"
    );

    let second = Enforcer::attach(&pinned, &GPU).unwrap(); // the daemon restarts
    assert!(
        second.is_allowed(registered.pid),
        "the restarted daemon sees the pinned map"
    );
    assert_eq!(probe.open(&nodes.path("nvidia0")), EPERM);
    assert_eq!(second.counters().unwrap().refused, 2, "counters carry over");
    second.detach().unwrap();
    assert_eq!(bpffs.leftovers(), Vec::<std::path::PathBuf>::new());
    assert_eq!(
        probe.open(&nodes.path("nvidia0")),
        ENXIO,
        "detach removes the pinned gate"
    );
}

#[test]
fn attach_says_why_it_cannot() {
    if !privileged() {
        return;
    }
    let not_cgroup2 = tempfile::tempdir().unwrap();
    let bad = EbpfConfig {
        mode: Mode::Enforce,
        cgroup_root: not_cgroup2.path().to_owned(),
        pin_dir: None,
    };
    let error = Enforcer::attach(&bad, &GPU).unwrap_err();
    assert!(matches!(error, EbpfError::NotCgroup2(_)), "{error}");
    assert!(
        error
            .to_string()
            .contains(&not_cgroup2.path().display().to_string()),
        "{error}"
    );
    let cgroup = TestCgroup::new();
    let off = config(Mode::Off, &cgroup);
    assert!(matches!(
        Enforcer::attach(&off, &GPU),
        Err(EbpfError::ModeOff)
    ));
    let not_bpffs = EbpfConfig {
        pin_dir: Some(not_cgroup2.path().to_owned()),
        ..config(Mode::Audit, &cgroup)
    };
    let error = Enforcer::attach(&not_bpffs, &GPU).unwrap_err();
    assert!(matches!(error, EbpfError::NotBpffs(_)), "{error}");
}

#[test]
fn without_capabilities_attach_says_which_are_missing() {
    if !privileged() {
        return;
    }
    let cgroup = TestCgroup::new();
    // Root without any capability: what a daemon started without CAP_BPF/CAP_SYS_ADMIN sees.
    let output = std::process::Command::new("setpriv")
        .args([
            "--inh-caps=-all",
            "--ambient-caps=-all",
            "--bounding-set=-all",
            "--",
        ])
        .arg(env!("CARGO_BIN_EXE_ebpf-probe"))
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut child| {
            use std::io::Write;
            let mut stdin = child.stdin.take().unwrap();
            writeln!(stdin, "attach {}", cgroup.path.display())?;
            drop(stdin);
            child.wait_with_output()
        })
        .unwrap();
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(
        text.contains("error missing capabilities CAP_SYS_ADMIN or CAP_BPF CAP_PERFMON"),
        "{text}"
    );
    // The same request with the capabilities attaches (and detaches).
    let mut probe = Probe::spawn_in(&cgroup);
    assert_eq!(
        probe.ask(&format!("attach {}", cgroup.path.display())),
        "attached"
    );
}

#[test]
fn a_flood_of_refusals_does_not_crowd_out_exit_events() {
    if !privileged() {
        return;
    }
    let nodes = Nodes::new();
    let cgroup = TestCgroup::new();
    let mut enforcer = Enforcer::attach(&config(Mode::Enforce, &cgroup), &GPU).unwrap();
    let mut events = enforcer.take_exit_events().unwrap();
    let mut flooder = Probe::spawn_in(&cgroup);
    let mut watched = Probe::spawn_in(&cgroup);
    enforcer.watch_tgid(watched.pid).unwrap();
    // Nobody reads while a hostile tenant hammers the gate: its events overflow.
    assert!(
        flooder
            .ask(&format!("bench {} 20000", nodes.path("nvidia0")))
            .starts_with("ns ")
    );
    let lost = enforcer.counters().unwrap().lost;
    assert!(
        lost > 0,
        "the flood must overflow the gate's events for this test to mean anything"
    );
    let pid = watched.pid;
    watched.child.kill().unwrap();
    let exit = wait_event(&mut events, EventKind::Exit, pid);
    assert!(
        exit.is_some(),
        "the exit of pid {pid} was lost ({lost} gate events lost)"
    );
    assert_eq!(enforcer.counters().unwrap().exit_lost, 0);
    drop((flooder, watched));
    enforcer.detach().unwrap();
}

#[test]
fn a_registered_process_that_execs_must_register_again() {
    if !privileged() {
        return;
    }
    let nodes = Nodes::new();
    let cgroup = TestCgroup::new();
    let mut enforcer = Enforcer::attach(&config(Mode::Enforce, &cgroup), &GPU).unwrap();
    let mut probe = Probe::spawn_in(&cgroup);
    enforcer.allow_tgid(probe.pid).unwrap();
    assert_eq!(probe.open(&nodes.path("nvidia0")), ENXIO);
    assert!(enforcer.is_allowed(probe.pid), "allowed before exec");
    // A shimmed wrapper exec'ing a static binary: same pid, new program.
    assert_eq!(probe.ask("exec"), format!("ready {}", probe.pid));
    assert!(!enforcer.is_allowed(probe.pid));
    assert_eq!(probe.open(&nodes.path("nvidia0")), EPERM);
    enforcer.allow_tgid(probe.pid).unwrap(); // the new image's shim registers
    assert_eq!(probe.open(&nodes.path("nvidia0")), ENXIO);
    drop(probe);
    enforcer.detach().unwrap();
}

#[test]
fn creating_a_gpu_node_is_not_gated_only_opening_it() {
    if !privileged() {
        return;
    }
    // runc creates a container's /dev/nvidia* with mknod from inside the container's cgroup.
    let nodes = Nodes::new();
    let cgroup = TestCgroup::new();
    let enforcer = Enforcer::attach(&config(Mode::Enforce, &cgroup), &GPU).unwrap();
    let node = nodes.dir.path().join("nvidia1");
    let script = format!(
        "echo $$ > {}/cgroup.procs && exec mknod {} c 195 1",
        cgroup.path.display(),
        node.display()
    );
    let status = std::process::Command::new("sh")
        .args(["-c", &script])
        .status()
        .unwrap();
    assert!(
        status.success(),
        "mknod of a GPU node inside the gated cgroup"
    );
    let mut probe = Probe::spawn_in(&cgroup);
    assert_eq!(probe.open(&node.display().to_string()), EPERM);
    drop(probe);
    enforcer.detach().unwrap();
}

#[test]
fn a_program_attached_below_cannot_override_the_gate() {
    if !privileged() {
        return;
    }
    // As runc attaches its own device program to each container's cgroup under kubepods.
    let nodes = Nodes::new();
    let parent = TestCgroup::new();
    let child = TestCgroup {
        path: parent.path.join("container"),
    };
    std::fs::create_dir(&child.path).unwrap();
    let gate = Enforcer::attach(&config(Mode::Enforce, &parent), &GPU).unwrap();
    let below = Enforcer::attach(&config(Mode::Audit, &child), &GPU).unwrap();
    let mut probe = Probe::spawn_in(&child);
    assert_eq!(
        probe.open(&nodes.path("nvidia0")),
        EPERM,
        "every attached program must allow"
    );
    assert_eq!(probe.open(&nodes.path("null")), "ok");
    assert_eq!(gate.counters().unwrap().refused, 1);
    assert_eq!(
        below.counters().unwrap().audited,
        1,
        "the program below ran too"
    );
    drop(probe);
    below.detach().unwrap();
    gate.detach().unwrap();
    drop(child); // removed before its parent
}
