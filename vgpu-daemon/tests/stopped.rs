//! The daemon's reading of a tenant container's CPU throttling (ADR 0029), on this
//! machine's real `cpu` cgroup: a process in a group limited to 0.2 CPU beside two busy
//! loops reads as stopped most of the time, as does one in a group without a quota
//! inside such a group (a pod's limit); one outside them does not.

use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use vgpu_daemon::stopped::{find_controller, read, stopped_between};
use vgpu_tests::cpu_load::CpuLimited;

/// Kills its process when dropped (a failed assertion leaves no busy loop behind).
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The part of one second process `pid` spent throttled, once it is in a group whose
/// path ends with `inside` (None: not readable).
fn stopped_over_a_second(pid: u32, inside: &str) -> Option<f64> {
    let ctl = find_controller().ok()?;
    // The process joins its group as it starts (its shell writes `cgroup.procs`).
    let t0 = Instant::now();
    let before = loop {
        let r = read(&ctl, pid)?;
        if r.group().ends_with(inside) || t0.elapsed() > Duration::from_secs(2) {
            break r;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    std::thread::sleep(Duration::from_secs(1));
    let after = read(&ctl, pid)?;
    assert_eq!(
        before.group(),
        after.group(),
        "the process stayed in its group"
    );
    Some(stopped_between(&before, &after).part)
}

/// Asserts that a busy loop in group `g` (beside the group's own) reads as stopped
/// most of a second; `what` names the group in the messages. Two busy loops in 0.2
/// CPU: the quota of each 100 ms period is spent in at most 20 ms of it (10 ms when
/// both run at once).
fn two_loops_read_as_stopped(what: &str, g: &CpuLimited) {
    let busy = Killed(
        g.command(Path::new("/bin/sh"))
            .args(["-c", "while :; do :; done"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("a busy loop in the group"),
    );
    let inside = g
        .path()
        .file_name()
        .and_then(|n| n.to_str())
        .expect("the group's name")
        .to_owned();
    let stopped = stopped_over_a_second(busy.0.id(), &inside);
    drop(busy);
    let stopped = stopped.expect("the group's cpu.stat is readable");
    eprintln!("{what} with two busy loops: stopped {stopped:.2} of a second");
    assert!(
        stopped > 0.5,
        "{what} with two busy loops read as throttled {:.0} % of a second",
        stopped * 100.0
    );
}

#[test]
fn a_throttled_container_reads_as_stopped_and_an_unlimited_process_does_not() {
    if let Some(why) = CpuLimited::unavailable() {
        return vgpu_test_needs::skip(vgpu_test_needs::Need::CgroupV1Cpu, &why);
    }
    let g = CpuLimited::new("vgpu-test-stopped", 200).expect("cpu cgroup");
    two_loops_read_as_stopped("a 0.2-CPU group", &g);
    // This test's own process is in no limited group: never throttled (or no figure).
    if let Some(own) = stopped_over_a_second(std::process::id(), "") {
        assert!(own < 0.2, "an unlimited process read as throttled {own:.2}");
    }
}

/// A pod's limit: the container's own group has no quota, the group above it (the
/// pod's) 0.2 CPU. The daemon reads the groups above the container's too.
#[test]
fn a_container_whose_pod_is_throttled_reads_as_stopped() {
    if let Some(why) = CpuLimited::unavailable() {
        return vgpu_test_needs::skip(vgpu_test_needs::Need::CgroupV1Cpu, &why);
    }
    let g = CpuLimited::in_pod("vgpu-test-pod", 200).expect("cpu cgroups");
    two_loops_read_as_stopped("a container of a 0.2-CPU pod", &g);
}
