//! The `vgpu-daemon` binary with its eBPF GPU device gate, as a node runs it, on the real
//! kernel with real processes on cuda-sim:
//!
//! - SIGKILL and restart under `enforce` with pins (ADR 0018): while the daemon is down the
//!   pinned gate keeps refusing unregistered opens and a new GPU process, a registered
//!   process keeps its access, and the restarted daemon adopts the pinned maps (the
//!   refusals queued in the pinned ring buffer reach its event stream) and admits again;
//! - without CAP_BPF/CAP_SYS_ADMIN (`setpriv`) the daemon says in one line why eBPF is off
//!   and serves (a tenant registers);
//! - daemon CPU (the whole process, `/proc/<pid>/stat`) and exit-event latency at 1,000
//!   process exits per second, with the gate attached and a daemon without it alongside.
//!
//! Needs root, BTF, cgroup2, tracefs and `mount -t bpf` (pins go to a bpf file system
//! mounted on a temporary directory, never `/sys/fs/bpf`): a recorded skip without them
//! (`vgpu-test-needs`), a failure instead under `CI=true`. Every test detaches and unpins what it
//! attached.

#![allow(clippy::unwrap_used)]
// test code: a failed step is the failure
// fork(2) in the exit generator and kill(2); each block says why it holds.
#![allow(unsafe_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use vgpu_test_needs::Need;
use vgpu_tests::{Container, Probe, SimNode, probe_bin};

const NODE: &str =
    "[[device]]\nuuid = \"GPU-eb0f0000-0000-4000-8000-0000000b1a21\"\nmemory = \"8Gi\"\n";

/// A recorded skip for want of eBPF here (a failure under `CI=true`).
fn skip(reason: &str) {
    vgpu_test_needs::skip(Need::Ebpf, reason);
}

/// The cgroup2 mount when the gate can run here (and the simulator's device nodes exist).
fn ebpf_ready(sim: &SimNode) -> Option<PathBuf> {
    let why = (|| {
        vgpu_ebpf::preflight::check_capabilities().map_err(|e| e.to_string())?;
        vgpu_ebpf::preflight::check_btf().map_err(|e| e.to_string())?;
        vgpu_ebpf::preflight::check_tracefs().map_err(|e| e.to_string())?;
        let mounts = std::fs::read_to_string("/proc/self/mounts").map_err(|e| e.to_string())?;
        let root = vgpu_ebpf::preflight::cgroup2_mount(&mounts)
            .ok_or("no cgroup2 mount in /proc/self/mounts")?;
        match vgpu_cuda_sim::devnodes::ensure(&sim.state_dir(), 1) {
            Ok(true) => Ok(PathBuf::from(root)),
            Ok(false) => Err("mknod is not permitted: the simulator has no device nodes".into()),
            Err(e) => Err(format!("cannot make the simulator's device nodes: {e}")),
        }
    })();
    match why {
        Ok(root) => Some(root),
        Err(reason) => {
            skip(&reason);
            None
        }
    }
}

/// A cgroup2 child directory, removed when dropped.
struct Cgroup(PathBuf);

impl Cgroup {
    fn new(root: &Path, test: &str) -> Cgroup {
        let dir = root.join(format!("vgpu-test-{test}-{}", std::process::id()));
        std::fs::create_dir(&dir).unwrap();
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

/// A bpf file system mounted on a temporary directory: the pins go there. Dropped, it
/// detaches and removes every pin (`remove_pins`), then unmounts.
struct Bpffs {
    dir: tempfile::TempDir,
}

impl Bpffs {
    fn new() -> Option<Bpffs> {
        let dir = tempfile::tempdir().unwrap();
        let ok = Command::new("mount")
            .args(["-t", "bpf", "bpf"])
            .arg(dir.path())
            .status()
            .is_ok_and(|s| s.success());
        ok.then_some(Bpffs { dir })
    }

    fn pins(&self) -> PathBuf {
        self.dir.path().join("vgpu")
    }

    /// Pinned objects left (names without a dot: the kernel's own files have one).
    fn pinned(&self) -> Vec<String> {
        fn walk(dir: &Path, out: &mut Vec<String>) {
            for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
                if e.file_name().to_string_lossy().contains('.') {
                    continue;
                }
                if e.path().is_dir() {
                    walk(&e.path(), out);
                }
                out.push(e.path().display().to_string());
            }
        }
        let mut out = Vec::new();
        walk(self.dir.path(), &mut out);
        out
    }
}

impl Drop for Bpffs {
    fn drop(&mut self) {
        let _ = vgpu_ebpf::remove_pins(&self.pins());
        let _ = Command::new("umount").arg(self.dir.path()).status();
    }
}

/// A `vgpu-daemon` process; killed (SIGKILL) when dropped.
struct Daemon {
    child: Child,
    log: PathBuf,
}

impl Daemon {
    /// Starts `vgpu-daemon` (under `wrapper` when given, e.g. setpriv) with its sockets in
    /// `dir` and `args`; waits until it serves.
    fn start(sim: &SimNode, dir: &Path, name: &str, wrapper: &[&str], args: &[&str]) -> Daemon {
        let log = dir.join(format!("{name}.log"));
        let f = std::fs::File::create(&log).unwrap();
        let daemon = crate::daemon_bin();
        let mut cmd = match wrapper.split_first() {
            Some((first, rest)) => {
                let mut c = sim.command(first);
                c.args(rest).arg(daemon);
                c
            }
            None => sim.command(daemon),
        };
        let child = cmd
            .arg("--socket")
            .arg(dir.join(format!("{name}.sock")))
            .arg("--api-socket")
            .arg(dir.join(format!("{name}.api")))
            .args([
                "--nvml-interval-ms",
                "0",
                "--metrics-addr",
                "off",
                "--sched-priority",
                "0",
            ])
            .args(args)
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

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
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

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL, reaped.
    fn kill9(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `vgpuctl --api-socket API args…`: success, stdout, stderr.
fn vgpuctl(api: &Path, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(crate::vgpuctl_bin())
        .arg("--api-socket")
        .arg(api)
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Runs `cmd` to its end; its stdout and stderr together.
fn run(mut cmd: Command) -> String {
    let out = cmd.stdin(Stdio::null()).output().unwrap();
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// A raw open of the simulator's `nvidia0` node from cgroup `cg` (as a raw-ioctl client
/// opens it): `EPERM` when the gate refuses, `ENXIO` (no driver behind it) otherwise.
fn raw_open(cg: &Cgroup, sim: &SimNode) -> String {
    let node = vgpu_cuda_sim::devnodes::node_dir(&sim.state_dir()).join("nvidia0");
    let mut cmd = cg.command(sim, Path::new("/bin/sh"));
    cmd.arg("-c").arg(r#"exec 3<>"$0""#).arg(&node);
    run(cmd)
}

#[test]
fn enforce_survives_a_daemon_sigkill_and_the_restarted_daemon_adopts_the_pinned_gate() {
    let sim = SimNode::new(NODE);
    let Some(root) = ebpf_ready(&sim) else {
        return;
    };
    let Some(bpffs) = Bpffs::new() else {
        vgpu_test_needs::skip(Need::Mount, "mount -t bpf failed");
        return;
    };
    let cg = Cgroup::new(&root, "restart");
    let host = tempfile::tempdir().unwrap();
    let dev_dir = vgpu_cuda_sim::devnodes::node_dir(&sim.state_dir());
    let args: Vec<String> = [
        "--ebpf",
        "enforce",
        "--ebpf-cgroup-root",
        &cg.0.to_string_lossy(),
        "--ebpf-pin-dir",
        &bpffs.pins().to_string_lossy(),
        "--ebpf-dev-dir",
        &dev_dir.to_string_lossy(),
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut daemon = Daemon::start(&sim, host.path(), "daemon", &[], &args);
    daemon.wait_log("GPU device gate attached");
    let socket = host.path().join("daemon.sock");
    let api = host.path().join("daemon.api");
    let container = Container::new("1Gi").with("VGPU_DAEMON_SOCKET", &socket.to_string_lossy());
    let tenant = |script: &[&str]| {
        let mut cmd = cg.command(&sim, &probe_bin());
        container.apply(&mut cmd);
        Probe::start(cmd, script, Duration::from_secs(30))
    };
    let new_process = |script: &[&str]| {
        let mut cmd = cg.command(&sim, &probe_bin());
        container.apply(&mut cmd);
        cmd.args(script);
        run(cmd)
    };
    // Two registered tenants, each of which initialises NVML later (opening the nodes
    // again): one while the daemon is down, one after it is back.
    let during = tenant(&["init", "alloc", "64Mi", "ready", "wait", "nvml"]);
    let after = tenant(&["init", "alloc", "64Mi", "ready", "wait", "nvml"]);
    assert!(raw_open(&cg, &sim).contains("not permitted"));

    daemon.kill9();
    assert!(
        bpffs.pinned().iter().any(|p| p.ends_with("gate_link")),
        "the gate's link stays pinned: {:?}",
        bpffs.pinned()
    );
    // Down: unregistered opens are refused, a new GPU process cannot register and is
    // refused, a registered process keeps its access.
    assert!(
        raw_open(&cg, &sim).contains("not permitted"),
        "the pinned gate refuses while the daemon is down"
    );
    let out = new_process(&["init"]);
    assert!(
        out.contains("999"),
        "a new GPU process while the daemon is down (fail-closed): {out}"
    );
    let out = during.finish(Duration::from_secs(30)).join("\n");
    assert!(
        out.contains("nvml_total="),
        "a registered process keeps its access while the daemon is down: {out}"
    );

    // Back: it adopts the pinned maps (the refusals queued while it was down reach its
    // event stream), admits new processes and keeps refusing the others.
    let mut daemon = Daemon::start(&sim, host.path(), "daemon", &[], &args);
    daemon.wait_log("GPU device gate attached");
    let end = Instant::now() + Duration::from_secs(10);
    let events = loop {
        let (ok, out, err) = vgpuctl(&api, &["events"]);
        assert!(ok, "{err}");
        if out.matches("REFUSED").count() >= 2 || Instant::now() > end {
            break out;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(
        events.contains("REFUSED") && events.contains("(sh)"),
        "the raw open refused while the daemon was down, read from the pinned ring buffer by the new daemon:\n{events}"
    );
    assert!(
        events.contains("(cuda-probe)"),
        "the new process refused while the daemon was down:\n{events}"
    );
    let out = new_process(&["init", "alloc", "64Mi", "nvml"]);
    assert!(
        out.contains("alloc=ok") && out.contains("nvml_total="),
        "a new GPU process under the shim after the restart: {out}"
    );
    let out = after.finish(Duration::from_secs(30)).join("\n");
    assert!(
        out.contains("nvml_total="),
        "a process registered before the SIGKILL keeps working after the restart: {out}"
    );
    // `vgpuctl events --follow` prints a new refusal as it happens, and ends when the
    // daemon goes away.
    let mut follower = Command::new(crate::vgpuctl_bin())
        .arg("--api-socket")
        .arg(&api)
        .args(["events", "--follow", "--recent", "0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = follower.stdout.take().unwrap();
    let (tx, lines) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead as _;
        for l in std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
        {
            let _ = tx.send(l);
        }
    });
    std::thread::sleep(Duration::from_millis(500));
    assert!(raw_open(&cg, &sim).contains("not permitted"));
    let line = lines
        .recv_timeout(Duration::from_secs(10))
        .expect("vgpuctl events --follow prints the refusal");
    assert!(
        line.contains("REFUSED") && line.contains("(sh) of cgroup /"),
        "{line}"
    );
    println!("FIGURE vgpuctl events --follow: {line}");

    // Off: nothing stays attached or pinned.
    daemon.kill9();
    let end = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(st) = follower.try_wait().unwrap() {
            break st;
        }
        if Instant::now() > end {
            let _ = follower.kill();
            panic!("vgpuctl events --follow did not end with the daemon");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(!status.success(), "the follower says the stream ended");
    vgpu_ebpf::remove_pins(&bpffs.pins()).unwrap();
    assert_eq!(bpffs.pinned(), vec![bpffs.pins().display().to_string()]);
    let out = raw_open(&cg, &sim);
    assert!(
        out.contains("No such device or address"),
        "unpinned, nothing gates the cgroup: {out}"
    );
}

#[test]
fn without_bpf_capabilities_the_daemon_says_why_in_one_line_and_serves() {
    let setpriv = Command::new("setpriv").arg("--version").output();
    if !setpriv.is_ok_and(|o| o.status.success()) {
        vgpu_test_needs::skip(Need::Tool("setpriv"), "setpriv --version failed");
        return;
    }
    let sim = SimNode::new(NODE);
    let host = tempfile::tempdir().unwrap();
    let pins = host.path().join("pins");
    let mut daemon = Daemon::start(
        &sim,
        host.path(),
        "daemon",
        &["setpriv", "--inh-caps=-all", "--bounding-set=-all", "--"],
        &[
            "--ebpf",
            "enforce",
            // Fail open as the operator may choose (fail closed: ebpf_fail_closed.rs).
            "--ebpf-enforce-fallback",
            "serve",
            "--ebpf-pin-dir",
            &pins.to_string_lossy(),
        ],
    );
    let log = daemon.wait_log("vgpu-daemon serving");
    let ebpf: Vec<&str> = log.lines().filter(|l| l.contains("eBPF")).collect();
    assert_eq!(ebpf.len(), 1, "one line says why eBPF is off:\n{log}");
    assert!(
        ebpf[0].contains("not attached") && ebpf[0].contains("missing capabilities"),
        "{}",
        ebpf[0]
    );
    assert!(ebpf[0].contains("CAP_BPF"), "{}", ebpf[0]);
    let status = std::fs::read_to_string(format!("/proc/{}/status", daemon.pid())).unwrap();
    let eff = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .unwrap()
        .trim()
        .to_owned();
    assert_eq!(
        u64::from_str_radix(&eff, 16).unwrap(),
        0,
        "the daemon runs without capabilities"
    );
    println!("FIGURE no capabilities: {}", ebpf[0].trim());

    // It serves: a tenant registers.
    let socket = host.path().join("daemon.sock");
    let api = host.path().join("daemon.api");
    let container = Container::new("1Gi").with("VGPU_DAEMON_SOCKET", &socket.to_string_lossy());
    let mut cmd = sim.command(probe_bin());
    container.apply(&mut cmd);
    let tenant = Probe::start(
        cmd,
        &["init", "alloc", "64Mi", "ready", "wait"],
        Duration::from_secs(30),
    );
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        let (ok, out, err) = vgpuctl(&api, &["--json", "tenants"]);
        assert!(ok, "{err}");
        if out.contains(&format!("{}", tenant.pid())) {
            break;
        }
        assert!(Instant::now() < end, "the tenant never registered: {out}");
        std::thread::sleep(Duration::from_millis(50));
    }
    // The event stream is served without the gate (the second line's events come through
    // it): a note says why there is no gate, and enforce not delivered is an event.
    let (ok, out, err) = vgpuctl(&api, &["events"]);
    assert!(ok && err.contains("eBPF is not attached"), "{err}");
    assert!(
        out.contains("NOT ENFORCING") && out.contains("--ebpf-enforce-fallback serve"),
        "{out}"
    );
    tenant.finish(Duration::from_secs(30));
}

/// Environment of the exit generator (the re-executed test binary): `CGROUP NODE COUNT
/// RATE`.
const GENERATOR: &str = "VGPU_TEST_EXIT_GENERATOR";

/// Not a test: the exit generator [`daemon_cpu_and_exit_latency_at_1000_exits_per_second`]
/// starts (this binary again, with [`GENERATOR`] set). It moves into the cgroup, then forks
/// COUNT children at RATE per second; each opens the GPU node (so that the gate watches
/// it) and exits at once.
#[test]
#[ignore = "a helper process of daemon_cpu_and_exit_latency_at_1000_exits_per_second"]
fn exit_generator() {
    let Ok(spec) = std::env::var(GENERATOR) else {
        return;
    };
    let f: Vec<&str> = spec.split(' ').collect();
    let (cg, node) = (f[0], f[1]);
    let (count, rate): (u32, u32) = (f[2].parse().unwrap(), f[3].parse().unwrap());
    std::fs::write(
        Path::new(cg).join("cgroup.procs"),
        std::process::id().to_string(),
    )
    .unwrap();
    let path = std::ffi::CString::new(node).unwrap();
    let period = Duration::from_secs(1) / rate;
    let start = Instant::now();
    for i in 0..count {
        let due = start + period * i;
        if let Some(w) = due.checked_duration_since(Instant::now()) {
            std::thread::sleep(w);
        }
        // SAFETY: the child calls only open(2) and _exit(2), both async-signal-safe, on a
        // path made before the fork.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            // SAFETY: see above; `path` is a valid NUL-terminated string.
            unsafe {
                libc::open(path.as_ptr(), libc::O_RDWR);
                libc::_exit(0);
            }
        }
        // Reap whoever is done.
        // SAFETY: waitpid with a null status pointer and WNOHANG.
        while unsafe { libc::waitpid(-1, std::ptr::null_mut(), libc::WNOHANG) } > 0 {}
    }
    // SAFETY: as above, blocking until every child is reaped.
    while unsafe { libc::waitpid(-1, std::ptr::null_mut(), 0) } > 0 {}
    println!("generated {count} in {:?}", start.elapsed());
}

/// utime + stime of process `pid`, from `/proc/<pid>/stat` (fields 14 and 15, in clock
/// ticks).
fn cpu_of(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // The fields after the command name, which is in parentheses and may hold spaces.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split(' ').collect();
    // rest starts at field 3 (state): utime is field 14, stime 15.
    let ticks: u64 = f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap();
    // SAFETY: sysconf reads a constant.
    let hz = u64::try_from(unsafe { libc::sysconf(libc::_SC_CLK_TCK) }).unwrap();
    Duration::from_nanos(ticks * 1_000_000_000 / hz)
}

fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec for clock_gettime to write.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &raw mut ts) };
    u64::try_from(ts.tv_sec).unwrap() * 1_000_000_000 + u64::try_from(ts.tv_nsec).unwrap()
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

#[test]
fn daemon_cpu_and_exit_latency_at_1000_exits_per_second() {
    let sim = SimNode::new(NODE);
    let Some(root) = ebpf_ready(&sim) else {
        return;
    };
    let count: u32 = std::env::var("VGPU_BENCH_EXITS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5000);
    let rate = 1000;
    let cg = Cgroup::new(&root, "exits");
    let host = tempfile::tempdir().unwrap();
    let dev_dir = vgpu_cuda_sim::devnodes::node_dir(&sim.state_dir());
    // Audit: every child's open is reported and watched, so every exit is an event (the
    // daemon handles two events per child: the audited open and the exit).
    let mut gated = Daemon::start(
        &sim,
        host.path(),
        "gated",
        &[],
        &[
            "--ebpf",
            "audit",
            "--ebpf-pin-dir",
            "off",
            "--ebpf-cgroup-root",
            &cg.0.to_string_lossy(),
            "--ebpf-dev-dir",
            &dev_dir.to_string_lossy(),
        ],
    );
    gated.wait_log("GPU device gate attached");
    let baseline = Daemon::start(
        &sim,
        host.path(),
        "baseline",
        &[],
        &["--ebpf", "off", "--ebpf-pin-dir", "off"],
    );

    // A subscriber to the gated daemon's stream: the kernel's time of each exit against
    // the time the event reached it.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let api = host.path().join("gated.api");
    let (tx, rx) = std::sync::mpsc::channel();
    let subscriber = rt.spawn(async move {
        let mut c = vgpu_daemon::api::connect_unix(&api).await.unwrap();
        let mut s = c
            .watch_enforcement_events(vgpu_daemon::api::pb::WatchEnforcementEventsRequest {
                follow: true,
                recent: 0,
            })
            .await
            .unwrap()
            .into_inner();
        while let Ok(Some(e)) = s.message().await {
            let now = monotonic_ns();
            if e.kind == vgpu_daemon::api::pb::EnforcementEventKind::Exit as i32 {
                let _ = tx.send((now.saturating_sub(e.monotonic_ns), e.lost_before));
            }
        }
    });
    std::thread::sleep(Duration::from_millis(300));

    let (g0, b0, t0) = (cpu_of(gated.pid()), cpu_of(baseline.pid()), Instant::now());
    let node = dev_dir.join("nvidia0");
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "ebpf_binary::exit_generator",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(
            GENERATOR,
            format!("{} {} {count} {rate}", cg.0.display(), node.display()),
        )
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The last events' way through the daemon.
    let mut latencies = Vec::new();
    let mut lost = 0;
    let end = Instant::now() + Duration::from_secs(10);
    while latencies.len() < count as usize && Instant::now() < end {
        if let Ok((ns, l)) = rx.recv_timeout(Duration::from_millis(200)) {
            latencies.push(ns);
            lost += l;
        }
    }
    let wall = t0.elapsed();
    let (g1, b1) = (cpu_of(gated.pid()), cpu_of(baseline.pid()));
    subscriber.abort();
    latencies.sort_unstable();
    let pct = |d: Duration| d.as_secs_f64() / wall.as_secs_f64() * 100.0;
    let (gcpu, bcpu) = (pct(g1 - g0), pct(b1 - b0));
    let generated = String::from_utf8_lossy(&out.stdout);
    let generated = generated
        .lines()
        .find_map(|l| l.find("generated").map(|i| &l[i..]))
        .unwrap_or("?");
    println!(
        "FIGURE exit events at {rate}/s: {} of {count} received by a stream subscriber ({lost} lost by the stream); {generated}",
        latencies.len()
    );
    println!(
        "FIGURE exit-event latency kernel → daemon → gRPC subscriber: p50 {:.3} ms, p99 {:.3} ms, max {:.3} ms",
        percentile(&latencies, 0.50) as f64 / 1e6,
        percentile(&latencies, 0.99) as f64 / 1e6,
        latencies.last().copied().unwrap_or(0) as f64 / 1e6
    );
    println!(
        "FIGURE daemon CPU over {:.2} s (utime+stime of the whole process): gate attached {gcpu:.1} % of one core, without eBPF alongside {bcpu:.1} %; difference {:.1} points; ratio {}",
        wall.as_secs_f64(),
        gcpu - bcpu,
        if bcpu > 0.0 {
            format!("{:.1}×", gcpu / bcpu)
        } else {
            "∞ (baseline 0 ticks)".to_owned()
        }
    );
    // The promise: every exit reaches the subscriber, none lost on the way (before issue
    // 38 the test accepted 90 %, lost events counted as delivered). The latency bound has
    // the margin of a loaded machine: p50 measured 0.07 ms idle, bounded at 10 ms (was 1 s).
    assert!(
        latencies.len() as u64 >= u64::from(count) && lost == 0,
        "every exit reaches the subscriber: {} of {count} received, {lost} lost by the stream",
        latencies.len()
    );
    let p50 = percentile(&latencies, 0.50);
    assert!(
        p50 < 10_000_000,
        "exit-event p50 {:.3} ms, not under 10 ms",
        p50 as f64 / 1e6
    );
    assert!(gcpu < 100.0, "the daemon stays under one core: {gcpu:.1} %");
    drop(gated);
    drop(baseline);
}
