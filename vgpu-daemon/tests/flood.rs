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

    /// `program` started inside this cgroup.
    fn command(&self, sim: &SimNode, program: &Path) -> Command {
        command_in(&self.0, sim, program)
    }
}

/// `program` started inside the cgroup `dir` (a shell moves itself in, then execs it).
fn command_in(dir: &Path, sim: &SimNode, program: &Path) -> Command {
    let mut c = sim.command("sh");
    c.arg("-c")
        .arg(r#"echo $$ > "$0/cgroup.procs" && shift && exec "$@""#)
        .arg(dir)
        .arg("--")
        .arg(program);
    c
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

/// Pod containers' cgroups as kubelet lays them out (cgroupfs driver) under a directory of
/// the test's: `top/kubepods/burstable/pod<uid>/<container id>`; removed when dropped.
struct PodCgroups {
    /// Every directory made, parents first.
    dirs: Vec<PathBuf>,
}

impl PodCgroups {
    fn new(test: &str, containers: &[(&str, &str)]) -> PodCgroups {
        let top = Cgroup::new(test);
        let mut dirs = vec![top.0.clone()];
        std::mem::forget(top);
        for (pod_uid, container_id) in containers {
            let mut dir = dirs[0].clone();
            for part in [
                "kubepods".to_owned(),
                "burstable".to_owned(),
                format!("pod{pod_uid}"),
                (*container_id).to_owned(),
            ] {
                dir = dir.join(part);
                if !dir.exists() {
                    std::fs::create_dir(&dir).unwrap();
                    dirs.push(dir.clone());
                }
            }
        }
        PodCgroups { dirs }
    }

    /// The container's directory (removed with the rest when dropped).
    fn container(&self, pod_uid: &str, container_id: &str) -> PathBuf {
        self.dirs[0]
            .join("kubepods/burstable")
            .join(format!("pod{pod_uid}"))
            .join(container_id)
    }
}

impl Drop for PodCgroups {
    fn drop(&mut self) {
        for dir in self.dirs.iter().rev() {
            for _ in 0..250 {
                if std::fs::remove_dir(dir).is_ok() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

/// Holders, killed when dropped (before their cgroups are removed).
struct Holders(Vec<Child>);

impl Drop for Holders {
    fn drop(&mut self) {
        for h in &mut self.0 {
            let _ = h.kill();
            let _ = h.wait();
        }
    }
}

/// A `sleep` in `cgroup` holding `n` connections to `socket`, opened after it moved there
/// (between fork and exec, so that its PID, in that cgroup, is each connection's peer).
fn holder(cgroup: &Path, socket: &Path, n: usize) -> Child {
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::process::CommandExt;
    let procs = std::ffi::CString::new(cgroup.join("cgroup.procs").as_os_str().as_bytes()).unwrap();
    // SAFETY: sockaddr_un is plain old data: all zeroes is a valid value.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let path = socket.as_os_str().as_bytes();
    assert!(path.len() < addr.sun_path.len(), "{}", socket.display());
    for (d, s) in addr.sun_path.iter_mut().zip(path) {
        *d = libc::c_char::from_ne_bytes([*s]);
    }
    let mut cmd = Command::new("sleep");
    cmd.arg("600").stdin(Stdio::null()).stdout(Stdio::null());
    let hold = move || -> std::io::Result<()> {
        // SAFETY: between fork and exec only async-signal-safe calls (open, write, close,
        // socket, connect) on memory made before the fork (`procs` a NUL-terminated path,
        // `addr` a filled sockaddr_un, its size passed); nothing is allocated.
        unsafe {
            let fd = libc::open(procs.as_ptr(), libc::O_WRONLY);
            if fd < 0 {
                return Err(std::io::Error::last_os_error());
            }
            let moved = libc::write(fd, b"0".as_ptr().cast(), 1) == 1;
            libc::close(fd);
            if !moved {
                return Err(std::io::Error::last_os_error());
            }
            for _ in 0..n {
                let s = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0);
                let len = size_of::<libc::sockaddr_un>() as libc::socklen_t;
                if s < 0 || libc::connect(s, (&raw const addr).cast(), len) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
        }
        Ok(())
    };
    // SAFETY: `hold` is async-signal-safe (above).
    unsafe { cmd.pre_exec(hold) };
    cmd.spawn()
        .unwrap_or_else(|e| panic!("a holder in {}: {e}", cgroup.display()))
}

/// Polls `/metrics` (at most 10 s) until `ok`; returns it.
fn metrics_until(daemon: &mut Daemon, what: &str, ok: impl Fn(&str) -> bool) -> String {
    let addr = metrics_addr(&daemon.log());
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        let m = http_get(&addr, "/metrics");
        if ok(&m) {
            return m;
        }
        assert!(daemon.alive(), "{}", daemon.log());
        assert!(Instant::now() < end, "{what}: not within 10 s\n{m}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A pod of three containers, all root, each at its connection cap: together as many
/// connections as root may hold outside pods (144 under a limit of 1,024 descriptors).
/// Before (one cap per UID for every peer), a root neighbour in another pod was refused
/// ("uid 0 holds 144 connections already"); after (ADR 0056), the UID cap bounds only
/// peers outside pods' containers and the neighbour registers and launches while the
/// flood is held.
#[test]
fn a_tenants_containers_at_their_caps_leave_a_same_uid_neighbour_served() {
    const HOSTILE: &str = "f100d000-0000-4000-8000-00000000000a";
    const NEIGHBOUR: &str = "f100d000-0000-4000-8000-00000000000b";
    const IDS: [&str; 3] = ["a1a1a1a1a1a1", "a2a2a2a2a2a2", "a3a3a3a3a3a3"];
    const NEIGHBOUR_ID: &str = "b1b1b1b1b1b1";
    let uid = std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|l| l.split_whitespace().next().map(str::to_owned))
        .unwrap();
    let sim = SimNode::new(&format!(
        "[[device]]\nuuid = \"{UUID}\"\nmemory = \"8Gi\"\n"
    ));
    let dir = tempfile::tempdir().unwrap();
    // Soft and hard limit 1,024: caps 192 per node, 48 per container, 144 per UID.
    let mut daemon = start(&sim, dir.path(), "-n");
    let socket = dir.path().join("daemon.sock");
    let mut all: Vec<(&str, &str)> = IDS.iter().map(|id| (HOSTILE, *id)).collect();
    all.push((NEIGHBOUR, NEIGHBOUR_ID));
    let cgroups = PodCgroups::new("flood-uid", &all);

    // Each container asks for 50: 48 held, 2 refused by its container's cap.
    let t0 = Instant::now();
    let _holders = Holders(
        IDS.iter()
            .map(|id| holder(&cgroups.container(HOSTILE, id), &socket, 50))
            .collect(),
    );
    let m = metrics_until(&mut daemon, "the flood counted", |m| {
        sample(m, "vgpu_daemon_connections_open") == 144.0
            && sample(
                m,
                "vgpu_daemon_connections_refused_total{reason=\"container\"}",
            ) == 6.0
    });
    let flood_ms = t0.elapsed().as_millis();
    assert_eq!(
        sample(&m, "vgpu_daemon_connections_cap{scope=\"uid\"}"),
        144.0,
        "{m}"
    );

    // A neighbour of the same UID in another pod registers and launches.
    let container = Container::new("1Gi").with("VGPU_DAEMON_SOCKET", &socket.to_string_lossy());
    let mut cmd = command_in(
        &cgroups.container(NEIGHBOUR, NEIGHBOUR_ID),
        &sim,
        &probe_bin(),
    );
    container.apply(&mut cmd);
    let t1 = Instant::now();
    let tenant = Probe::start(
        cmd,
        &[
            "init", "alloc", "64Mi", "spin", "kernel", "20", "1000", "ready", "wait",
        ],
        Duration::from_secs(30),
    );
    let pid = tenant.pid().to_string();
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
        if String::from_utf8_lossy(&out.stdout).contains(&pid) {
            break;
        }
        assert!(
            Instant::now() < end,
            "the same-UID neighbour never registered\n{}",
            daemon.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let register_ms = t1.elapsed().as_millis();
    // Registered while the flood was held (not after the pre-Hello timeout freed it).
    let m = http_get(&metrics_addr(&daemon.log()), "/metrics");
    let open = sample(&m, "vgpu_daemon_connections_open");
    assert!(open >= 145.0, "the flood was no longer held: {open}\n{m}");
    assert_eq!(
        sample(&m, "vgpu_daemon_connections_refused_total{reason=\"uid\"}"),
        0.0,
        "{m}\n{}",
        daemon.log()
    );
    let out = tenant.finish(Duration::from_secs(30)).join("\n");
    assert!(!out.contains("Error"), "the neighbour's launches: {out}");
    println!(
        "FIGURE flood-uid: 3 containers of one pod, uid {uid}, 150 connections in {flood_ms} ms: \
         144 held (48 each, the UID cap's worth), 6 refused by their containers' caps; a \
         same-UID neighbour in another pod registered in {register_ms} ms and launched; \
         {open} open then"
    );
}
