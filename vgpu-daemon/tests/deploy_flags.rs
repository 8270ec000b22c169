//! The shipped manifests run `vgpu-daemon` only with flags it has, and `vgpuctl` in the
//! daemon's container finds the API socket the DaemonSet configures (the CI check of
//! `deploy/`, ADR 0052; the objects themselves: the device plugin's `deploy_manifests`).

use std::process::Command;

use vgpu_testkit::deploy;

fn help(bin: std::path::PathBuf) -> String {
    let out = Command::new(&bin)
        .arg("--help")
        .output()
        .unwrap_or_else(|e| panic!("run {} --help: {e}", bin.display()));
    assert!(out.status.success());
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn the_daemons_flags_exist_and_vgpuctl_reads_the_configured_api_socket() {
    let objects = deploy::objects();
    let found = deploy::containers_running(&objects, "vgpu-daemon");
    assert_eq!(found.len(), 1, "{found:?}");
    let daemon_help = help(crate::daemon_bin());
    let ctl_help = help(crate::vgpuctl_bin());
    for (id, c) in found {
        let unknown = deploy::unknown_flags(&deploy::arguments(c), &daemon_help);
        assert!(unknown.is_empty(), "{id}: vgpu-daemon has no {unknown:?}");
        // The DaemonSet sets the API socket through VGPU_API_SOCKET, which both the
        // daemon and vgpuctl (`kubectl exec … -c vgpu-daemon -- vgpuctl top`) read.
        let api = deploy::env_value(c, "VGPU_API_SOCKET").expect("VGPU_API_SOCKET set");
        assert!(api.starts_with('/'), "{api}");
        for (bin, h) in [("vgpu-daemon", &daemon_help), ("vgpuctl", &ctl_help)] {
            assert!(
                h.contains("env: VGPU_API_SOCKET"),
                "{bin} does not read VGPU_API_SOCKET:\n{h}"
            );
        }
    }
    assert_eq!(
        deploy::unknown_flags(&["--no-such-flag".into()], &daemon_help),
        ["--no-such-flag"]
    );
}

/// What the DaemonSet relies on: vgpuctl run with VGPU_API_SOCKET set and no flag talks
/// to that socket (a daemon there answers).
#[test]
fn vgpuctl_follows_vgpu_api_socket() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let api = dir.path().join("daemon-api/api.sock");
    let log = std::fs::File::create(dir.path().join("log")).expect("log");
    let mut d = Command::new(crate::daemon_bin())
        .args([
            "--ebpf",
            "off",
            "--ebpf-pin-dir",
            "off",
            "--nvml-interval-ms",
            "0",
        ])
        .args(["--metrics-addr", "off", "--sched-priority", "0"])
        .arg("--socket")
        .arg(dir.path().join("daemon/daemon.sock"))
        .env("VGPU_API_SOCKET", &api)
        .stderr(log)
        .spawn()
        .expect("spawn vgpu-daemon");
    let end = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !api.exists() {
        assert!(std::time::Instant::now() < end, "no API socket");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let out = Command::new(crate::vgpuctl_bin())
        .arg("tenants")
        .env("VGPU_API_SOCKET", &api)
        .output()
        .expect("run vgpuctl");
    let _ = d.kill();
    let _ = d.wait();
    assert!(
        out.status.success(),
        "vgpuctl did not reach {}: {}",
        api.display(),
        String::from_utf8_lossy(&out.stderr)
    );
}
