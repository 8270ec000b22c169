//! The `vgpu-daemon` process's lifecycle as kubelet drives it: SIGTERM (the pod deleted,
//! a rolling update) ends it with exit 0 and removes the sockets it bound; a socket a
//! successor already re-bound is left alone.

use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// Longest a SIGTERM may take to end the daemon (kubelet's grace period is 30 s; the
/// daemon has nothing to flush).
const STOP: Duration = Duration::from_secs(5);

struct Kill(Child);
impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn(dir: &Path) -> Kill {
    let log = std::fs::File::create(dir.join("daemon.log")).expect("log file");
    let child = Command::new(crate::daemon_bin())
        .args(["--ebpf", "off", "--ebpf-pin-dir", "off"])
        .args(["--nvml-interval-ms", "0", "--metrics-addr", "off"])
        .args(["--sched-priority", "0"])
        .arg("--socket")
        .arg(dir.join("daemon/daemon.sock"))
        .arg("--api-socket")
        .arg(dir.join("daemon-api/api.sock"))
        .env("VGPU_DAEMON_LOG", "info")
        .env("NO_COLOR", "1")
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("spawn vgpu-daemon");
    let mut k = Kill(child);
    let end = Instant::now() + Duration::from_secs(20);
    while !(dir.join("daemon/daemon.sock").exists() && dir.join("daemon-api/api.sock").exists()) {
        if let Ok(Some(st)) = k.0.try_wait() {
            panic!("vgpu-daemon exited ({st}):\n{}", log_of(dir));
        }
        assert!(Instant::now() < end, "no sockets:\n{}", log_of(dir));
        std::thread::sleep(Duration::from_millis(20));
    }
    // Bound: "serving" is logged after the API socket too.
    while !log_of(dir).contains("vgpu-daemon serving") {
        assert!(Instant::now() < end, "never serving:\n{}", log_of(dir));
        std::thread::sleep(Duration::from_millis(20));
    }
    k
}

fn log_of(dir: &Path) -> String {
    std::fs::read_to_string(dir.join("daemon.log")).unwrap_or_default()
}

/// Sends `sig` to the child and waits (bounded by [`STOP`]) for its exit.
fn signal_and_wait(k: &mut Kill, sig: &str, dir: &Path) -> ExitStatus {
    let ok = Command::new("kill")
        .args([sig, &k.0.id().to_string()])
        .status()
        .expect("run kill");
    assert!(ok.success(), "kill {sig} failed");
    let end = Instant::now() + STOP;
    loop {
        if let Some(st) = k.0.try_wait().expect("wait") {
            return st;
        }
        assert!(
            Instant::now() < end,
            "vgpu-daemon still running {STOP:?} after {sig}:\n{}",
            log_of(dir)
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn sigterm_exits_zero_and_removes_both_sockets() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let mut d = spawn(dir.path());
    let st = signal_and_wait(&mut d, "-TERM", dir.path());
    assert_eq!(
        st.code(),
        Some(0),
        "exit status {st}:\n{}",
        log_of(dir.path())
    );
    for s in ["daemon/daemon.sock", "daemon-api/api.sock"] {
        assert!(
            !dir.path().join(s).exists(),
            "{s} left behind:\n{}",
            log_of(dir.path())
        );
    }
}

#[test]
fn sigint_too() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let mut d = spawn(dir.path());
    let st = signal_and_wait(&mut d, "-INT", dir.path());
    assert_eq!(
        st.code(),
        Some(0),
        "exit status {st}:\n{}",
        log_of(dir.path())
    );
    assert!(!dir.path().join("daemon/daemon.sock").exists());
}

#[test]
fn a_socket_a_successor_rebound_is_kept() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let mut d = spawn(dir.path());
    // A successor replaced the shims' socket (a new file at the same path).
    let sock = dir.path().join("daemon/daemon.sock");
    std::fs::remove_file(&sock).expect("remove");
    let _successor = std::os::unix::net::UnixListener::bind(&sock).expect("rebind");
    let st = signal_and_wait(&mut d, "-TERM", dir.path());
    assert_eq!(st.code(), Some(0), "exit status {st}");
    assert!(sock.exists(), "the successor's socket was removed");
    assert!(!dir.path().join("daemon-api/api.sock").exists());
}
