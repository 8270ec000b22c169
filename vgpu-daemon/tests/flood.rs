//! No tenant can exhaust the daemon (issue 39, item 4), with real processes: the
//! `vgpu-daemon` binary started with the default soft descriptor limit (1,024), a flood
//! of 1,100 idle connections from one cgroup (this test process), then a tenant in
//! another cgroup (a `cuda-probe` under the shim) registers, and the daemon is alive.
//! Before the fix the daemon exited on the first `EMFILE` ("Too many open files").
//!
//! Needs root and a cgroup2 mount (the tenant's cgroup is made under it): fails without
//! them (CI runs as root).

#![allow(clippy::unwrap_used)]
// test code: a failed step is the failure
// setrlimit(2) on this test process; the block says why it holds.
#![allow(unsafe_code)]

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use vgpu_tests::{Container, Probe, SimNode, probe_bin};

const UUID: &str = "GPU-f1000d00-0000-4000-8000-00000000f100";
/// Connections the flood opens (issue 39: 1,100 made the daemon exit).
const FLOOD: usize = 1100;

struct Daemon {
    child: Child,
    log: PathBuf,
}

impl Daemon {
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn alive(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }

    fn wait_log(&mut self, needle: &str) -> String {
        let end = Instant::now() + Duration::from_secs(30);
        loop {
            let l = self.log();
            if l.contains(needle) {
                return l;
            }
            if let Ok(Some(st)) = self.child.try_wait() {
                panic!("vgpu-daemon exited ({st}) before logging {needle:?}:\n{l}");
            }
            assert!(Instant::now() < end, "no {needle:?} in the log:\n{l}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A cgroup2 child directory, removed when dropped.
struct Cgroup(PathBuf);

impl Cgroup {
    fn new(test: &str) -> Cgroup {
        let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap();
        let root = vgpu_ebpf::preflight::cgroup2_mount(&mounts)
            .unwrap_or_else(|| panic!("{test} needs a cgroup2 mount (none in /proc/self/mounts)"));
        let dir = Path::new(root).join(format!("vgpu-test-{test}-{}", std::process::id()));
        std::fs::create_dir(&dir).unwrap_or_else(|e| {
            panic!(
                "{test} needs root to make a cgroup ({}): {e}",
                dir.display()
            )
        });
        Cgroup(dir)
    }

    /// `program` started inside this cgroup (a shell moves itself in, then execs it).
    fn command(&self, sim: &SimNode, program: &Path) -> Command {
        let mut c = sim.command("sh");
        c.arg("-c")
            .arg(r#"echo $$ > "$0/cgroup.procs" && shift && exec "$@""#)
            .arg(&self.0)
            .arg("--")
            .arg(program);
        c
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        for _ in 0..250 {
            if std::fs::remove_dir(&self.0).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Makes sure this process may hold the flood (its soft limit may be 1,024).
fn allow_descriptors(n: u64) {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into the valid, exclusive `lim`.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) }, 0);
    if lim.rlim_cur >= n {
        return;
    }
    assert!(
        lim.rlim_max >= n,
        "the test needs {n} descriptors; the hard limit is {}",
        lim.rlim_max
    );
    lim.rlim_cur = n;
    // SAFETY: setrlimit reads one valid rlimit (soft at most hard).
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) }, 0);
}

/// The daemon binary under `ulimit` (`-Sn 1024`: the default soft limit; `-n 1024`: soft
/// and hard, so that it cannot raise it).
fn start(sim: &SimNode, dir: &Path, ulimit: &str) -> Daemon {
    let log = dir.join("daemon.log");
    let f = std::fs::File::create(&log).unwrap();
    let child = sim
        .command("sh")
        .arg("-c")
        .arg(format!(r#"ulimit {ulimit} 1024 && exec "$@""#))
        .arg("sh")
        .arg(crate::daemon_bin())
        .args(["--ebpf", "off", "--ebpf-pin-dir", "off"])
        .arg("--socket")
        .arg(dir.join("daemon.sock"))
        .arg("--api-socket")
        .arg(dir.join("api.sock"))
        .args(["--metrics-addr", "127.0.0.1:0", "--gpu", UUID])
        .args(["--nvml-interval-ms", "0", "--sched-priority", "0"])
        .env("VGPU_DAEMON_LOG", "info")
        .env("NO_COLOR", "1")
        .stdout(Stdio::null())
        .stderr(f)
        .spawn()
        .unwrap();
    let mut d = Daemon { child, log };
    d.wait_log("vgpu-daemon serving");
    d
}

fn http_get(addr: &str, path: &str) -> String {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut r = String::new();
    s.read_to_string(&mut r).unwrap();
    r
}

fn metrics_addr(log: &str) -> String {
    let i = log
        .find("metrics on http://")
        .expect("metrics address logged")
        + 18;
    let rest = &log[i..];
    rest[..rest.find('/').unwrap()].to_owned()
}

/// The value of the sample `line` starts (`name{labels}`), from `/metrics`.
fn sample(metrics: &str, series: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("no {series} in\n{metrics}"))
        .trim()
        .parse()
        .unwrap()
}

/// Floods the socket from this process's cgroup, registers a tenant from another, and
/// returns (connections the daemon holds for the flood, the refusals it counted, /metrics).
fn flood_then_register(test: &str, ulimit: &str) -> (usize, f64, String) {
    allow_descriptors(FLOOD as u64 + 256);
    let sim = SimNode::new(&format!(
        "[[device]]\nuuid = \"{UUID}\"\nmemory = \"8Gi\"\n"
    ));
    let dir = tempfile::tempdir().unwrap();
    let mut daemon = start(&sim, dir.path(), ulimit);
    let socket = dir.path().join("daemon.sock");
    let t0 = Instant::now();
    let mut flood = Vec::with_capacity(FLOOD);
    for i in 0..FLOOD {
        match UnixStream::connect(&socket) {
            Ok(s) => flood.push(s),
            Err(e) => panic!("connection {i} of the flood: {e}\n{}", daemon.log()),
        }
    }
    let flood_ms = t0.elapsed().as_millis();
    // The daemon answers each connection over a cap with `Refused` and closes it; the
    // others it holds, waiting for a Hello (at most 5 s).
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        daemon.alive(),
        "the daemon exited under the flood:\n{}",
        daemon.log()
    );
    let mut held = 0;
    let mut refused_frames = 0;
    for s in &flood {
        s.set_nonblocking(true).unwrap();
        let mut buf = [0u8; 512];
        match (&*s).read(&mut buf) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => held += 1,
            Ok(n) if n > 0 => {
                let text = String::from_utf8_lossy(&buf[4..n]);
                assert!(text.contains("Refused"), "{text}");
                assert!(text.contains("the most per container"), "{text}");
                refused_frames += 1;
            }
            other => panic!("flood connection: {other:?}"),
        }
    }

    // A tenant of another container registers while the flood holds its connections.
    let cg = Cgroup::new(test);
    let container = Container::new("1Gi").with("VGPU_DAEMON_SOCKET", &socket.to_string_lossy());
    let mut cmd = cg.command(&sim, &probe_bin());
    container.apply(&mut cmd);
    let t1 = Instant::now();
    let tenant = Probe::start(
        cmd,
        &["init", "alloc", "64Mi", "ready", "wait"],
        Duration::from_secs(30),
    );
    let api = dir.path().join("api.sock");
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        let out = Command::new(crate::vgpuctl_bin())
            .arg("--api-socket")
            .arg(&api)
            .args(["--json", "tenants"])
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        let text = String::from_utf8_lossy(&out.stdout);
        if text.contains(&tenant.pid().to_string()) {
            break;
        }
        assert!(
            Instant::now() < end,
            "the other container's tenant never registered: {text}\n{}",
            daemon.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let register_ms = t1.elapsed().as_millis();
    let log = daemon.log();
    assert!(
        log.contains(&format!("pid={}", tenant.pid())) && log.contains("shim registered"),
        "{log}"
    );
    assert!(daemon.alive(), "{log}");
    let m = http_get(&metrics_addr(&log), "/metrics");
    let refused = sample(
        &m,
        "vgpu_daemon_connections_refused_total{reason=\"container\"}",
    );
    assert_eq!(refused as usize, refused_frames, "{m}");
    assert_eq!(held + refused_frames, FLOOD);
    println!(
        "FIGURE {test}: flood of {FLOOD} connections from one cgroup in {flood_ms} ms: \
         {held} held, {refused_frames} refused, daemon alive; another container's tenant \
         registered in {register_ms} ms; descriptor limit {}",
        sample(&m, "vgpu_daemon_descriptor_limit")
    );
    drop(flood);
    tenant.finish(Duration::from_secs(30));
    (held, refused, m)
}

#[test]
fn a_flood_from_one_container_leaves_the_daemon_alive_and_others_served() {
    let (held, refused, m) = flood_then_register("flood-soft", "-Sn");
    // The soft limit was raised (to the hard one at most): the container cap bites, not
    // the descriptors.
    let limit = sample(&m, "vgpu_daemon_descriptor_limit");
    assert!(limit > 1024.0, "the soft limit stayed at {limit}\n{m}");
    let per_container = sample(&m, "vgpu_daemon_connections_cap{scope=\"container\"}");
    assert_eq!(held, per_container as usize, "{m}");
    assert_eq!(refused as usize, FLOOD - held);
    assert_eq!(sample(&m, "vgpu_daemon_accept_errors_total"), 0.0, "{m}");
}

#[test]
fn a_flood_under_a_hard_limit_of_1024_leaves_the_daemon_alive_and_others_served() {
    let (held, _, m) = flood_then_register("flood-hard", "-n");
    assert_eq!(sample(&m, "vgpu_daemon_descriptor_limit"), 1024.0, "{m}");
    // Caps fitted to 1,024 descriptors: 192 connections, 48 per container.
    assert_eq!(
        sample(&m, "vgpu_daemon_connections_cap{scope=\"node\"}"),
        192.0
    );
    assert_eq!(held, 48, "{m}");
}
