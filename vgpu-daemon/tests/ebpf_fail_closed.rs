//! Enforcement requested is enforcement delivered (issue 39, item 5), on the real kernel
//! with the `vgpu-daemon` binary and real processes on cuda-sim:
//!
//! - `--ebpf enforce` with tracefs not mounted (unmounted in a private mount namespace,
//!   `unshare --mount`, never for the node) attaches the `cgroup/dev` gate and runs without
//!   exit events, saying so: a raw open is refused, a shimmed tenant registers, `/metrics`
//!   shows the gate at 1 and the exit watcher at 0. Before: one WARN, no gate, no series.
//! - When enforce cannot attach (here: its device directory is missing) after an earlier
//!   run pinned a gate, the pinned gate stays and keeps refusing, `/readyz` is 503, the
//!   `vgpu_ebpf_program_attached{mode="enforce"} 0` series is there and a new tenant is
//!   refused; with `--ebpf-enforce-fallback serve` the daemon removes the pinned gate and
//!   serves. Before: the pinned gate was removed and the daemon served, `/healthz` ok.
//!
//! Needs root, BTF, cgroup2, `mount -t bpf`, `unshare` and mknod (the simulator's device
//! nodes): fails without them (CI runs as root). Every test unpins what it pinned.

#![allow(clippy::unwrap_used)] // test code: a failed step is the failure

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use vgpu_tests::{Container, Probe, SimNode, probe_bin};

const NODE: &str =
    "[[device]]\nuuid = \"GPU-eb0f0000-0000-4000-8000-0000000fa11c\"\nmemory = \"8Gi\"\n";

/// The cgroup2 mount; panics naming what is missing.
fn ebpf_ready(sim: &SimNode) -> PathBuf {
    vgpu_ebpf::preflight::check_capabilities().unwrap();
    vgpu_ebpf::preflight::check_btf().unwrap();
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap();
    let root = vgpu_ebpf::preflight::cgroup2_mount(&mounts).expect("a cgroup2 mount");
    assert!(
        vgpu_cuda_sim::devnodes::ensure(&sim.state_dir(), 1).unwrap(),
        "mknod is not permitted: the simulator has no device nodes"
    );
    PathBuf::from(root)
}

/// A cgroup2 child directory, removed when dropped.
struct Cgroup(PathBuf);

impl Cgroup {
    fn new(root: &Path, test: &str) -> Cgroup {
        let dir = root.join(format!("vgpu-test-{test}-{}", std::process::id()));
        std::fs::create_dir(&dir).unwrap();
        Cgroup(dir)
    }

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

/// A bpf file system on a temporary directory; dropped, every pin removed, unmounted.
struct Bpffs {
    dir: tempfile::TempDir,
}

impl Bpffs {
    fn new() -> Bpffs {
        let dir = tempfile::tempdir().unwrap();
        let ok = Command::new("mount")
            .args(["-t", "bpf", "bpf"])
            .arg(dir.path())
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "mount -t bpf failed");
        Bpffs { dir }
    }

    fn pins(&self) -> PathBuf {
        self.dir.path().join("vgpu")
    }

    fn gate_pinned(&self) -> bool {
        std::fs::read_dir(self.pins())
            .into_iter()
            .flatten()
            .flatten()
            .any(|v| v.path().join("gate_link").exists())
    }
}

impl Drop for Bpffs {
    fn drop(&mut self) {
        let _ = vgpu_ebpf::remove_pins(&self.pins());
        let _ = Command::new("umount").arg(self.dir.path()).status();
    }
}

struct Daemon {
    child: Child,
    log: PathBuf,
}

impl Daemon {
    /// `vgpu-daemon` under `wrapper` (a shell script run by `sh -c`, ending in `exec "$@"`)
    /// with its sockets in `dir`; waits until it serves.
    fn start(sim: &SimNode, dir: &Path, wrapper: &str, args: &[String]) -> Daemon {
        let log = dir.join("daemon.log");
        let f = std::fs::File::create(&log).unwrap();
        let child = sim
            .command("sh")
            .arg("-c")
            .arg(wrapper)
            .arg("sh")
            .arg(crate::daemon_bin())
            .arg("--socket")
            .arg(dir.join("daemon.sock"))
            .arg("--api-socket")
            .arg(dir.join("daemon.api"))
            .args(["--nvml-interval-ms", "0", "--metrics-addr", "127.0.0.1:0"])
            .args(["--sched-priority", "0"])
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

    fn http(&self, path: &str) -> String {
        let log = self.log();
        let i = log
            .find("metrics on http://")
            .expect("metrics address logged")
            + 18;
        let addr = &log[i..][..log[i..].find('/').unwrap()];
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
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn run(mut cmd: Command) -> String {
    let out = cmd.stdin(Stdio::null()).output().unwrap();
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// A raw open of the simulator's `nvidia0` from `cg`: `EPERM` when the gate refuses,
/// `ENXIO` (no driver behind the node) otherwise.
fn raw_open(cg: &Cgroup, sim: &SimNode) -> String {
    let node = vgpu_cuda_sim::devnodes::node_dir(&sim.state_dir()).join("nvidia0");
    let mut cmd = cg.command(sim, Path::new("/bin/sh"));
    cmd.arg("-c").arg(r#"exec 3<>"$0""#).arg(&node);
    run(cmd)
}

fn args(mode: &str, cg: &Cgroup, pins: &Path, dev: &Path, extra: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = ["--ebpf", mode, "--ebpf-cgroup-root"]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
    a.push(cg.0.display().to_string());
    a.push("--ebpf-pin-dir".into());
    a.push(pins.display().to_string());
    a.push("--ebpf-dev-dir".into());
    a.push(dev.display().to_string());
    a.extend(extra.iter().map(|s| (*s).to_owned()));
    a
}

/// Unmounts tracefs in the daemon's own mount namespace (private: the node keeps its
/// mounts), checks it is gone (exit 97 otherwise), then runs the daemon.
const WITHOUT_TRACEFS: &str = r#"
for d in /sys/kernel/tracing /sys/kernel/debug/tracing; do umount -l "$d" 2>/dev/null; done
for d in /sys/kernel/tracing /sys/kernel/debug/tracing; do
    [ -e "$d/events/sched/sched_process_exit" ] && exit 97
done
exec "$@""#;

#[test]
fn enforce_without_tracefs_attaches_the_gate_and_runs_without_exit_events() {
    let sim = SimNode::new(NODE);
    let root = ebpf_ready(&sim);
    let bpffs = Bpffs::new();
    let cg = Cgroup::new(&root, "no-tracefs");
    let host = tempfile::tempdir().unwrap();
    let dev = vgpu_cuda_sim::devnodes::node_dir(&sim.state_dir());
    let wrapper = format!(
        "exec unshare --mount --propagation private sh -c '{}' sh \"$@\"",
        WITHOUT_TRACEFS.replace('\'', r"'\''")
    );
    let mut daemon = Daemon::start(
        &sim,
        host.path(),
        &wrapper,
        &args("enforce", &cg, &bpffs.pins(), &dev, &[]),
    );
    let log = daemon.wait_log("GPU device gate attached");
    assert!(log.contains("without exit events"), "{log}");
    assert!(log.contains("tracefs is not mounted"), "{log}");

    // The gate refuses a raw open; a shimmed tenant is admitted and registers.
    let raw = raw_open(&cg, &sim);
    assert!(raw.contains("not permitted"), "the gate refuses: {raw}");
    let socket = host.path().join("daemon.sock");
    let container = Container::new("1Gi").with("VGPU_DAEMON_SOCKET", &socket.to_string_lossy());
    let mut cmd = cg.command(&sim, &probe_bin());
    container.apply(&mut cmd);
    let tenant = Probe::start(
        cmd,
        &["init", "alloc", "64Mi", "ready", "wait"],
        Duration::from_secs(30),
    );
    let raw_process = run({
        let mut c = cg.command(&sim, &probe_bin());
        c.args(["init", "alloc", "1Gi"]);
        c
    });
    assert!(
        raw_process.contains("999"),
        "a raw CUDA process is refused: {raw_process}"
    );

    let m = daemon.http("/metrics");
    assert!(
        m.contains("vgpu_ebpf_program_attached{program=\"gpu_gate\",mode=\"enforce\"} 1"),
        "{m}"
    );
    assert!(
        m.contains("vgpu_ebpf_program_attached{program=\"exit_watch\",mode=\"enforce\"} 0"),
        "{m}"
    );
    let ready = daemon.http("/readyz");
    assert!(ready.starts_with("HTTP/1.1 200"), "{ready}");
    println!(
        "FIGURE enforce without tracefs: gate attached (exit watcher 0), raw open: {}, raw cuInit: {}",
        raw.trim(),
        raw_process
            .lines()
            .find(|l| l.contains("999"))
            .unwrap_or_default()
    );
    tenant.finish(Duration::from_secs(30));
    drop(daemon);
}

#[test]
fn enforce_that_cannot_attach_keeps_the_pinned_gate_and_fails_closed() {
    let sim = SimNode::new(NODE);
    let root = ebpf_ready(&sim);
    let bpffs = Bpffs::new();
    let cg = Cgroup::new(&root, "fail-closed");
    let host = tempfile::tempdir().unwrap();
    let dev = vgpu_cuda_sim::devnodes::node_dir(&sim.state_dir());
    // An earlier run pinned its gate, then died.
    let mut first = Daemon::start(
        &sim,
        host.path(),
        r#"exec "$@""#,
        &args("enforce", &cg, &bpffs.pins(), &dev, &[]),
    );
    first.wait_log("GPU device gate attached");
    drop(first);
    assert!(bpffs.gate_pinned());

    // This run cannot attach (its device directory is missing).
    let missing = host.path().join("no-such-dev");
    let daemon = Daemon::start(
        &sim,
        host.path(),
        r#"exec "$@""#,
        &args("enforce", &cg, &bpffs.pins(), &missing, &[]),
    );
    let log = daemon.log();
    assert!(log.contains("failing closed"), "{log}");
    assert!(bpffs.gate_pinned(), "the standing gate stays:\n{log}");
    let raw = raw_open(&cg, &sim);
    assert!(raw.contains("not permitted"), "it keeps refusing: {raw}");
    let ready = daemon.http("/readyz");
    assert!(ready.starts_with("HTTP/1.1 503"), "{ready}");
    assert!(ready.contains("no-such-dev"), "{ready}");
    assert!(daemon.http("/healthz").ends_with("ok\n"));
    let m = daemon.http("/metrics");
    assert!(
        m.contains("vgpu_ebpf_program_attached{program=\"gpu_gate\",mode=\"enforce\"} 0"),
        "{m}"
    );
    // A new tenant is refused (and, not admitted, the standing gate refuses its cuInit).
    let socket = host.path().join("daemon.sock");
    let container = Container::new("1Gi").with("VGPU_DAEMON_SOCKET", &socket.to_string_lossy());
    let mut cmd = cg.command(&sim, &probe_bin());
    container.apply(&mut cmd);
    cmd.args(["init", "alloc", "64Mi"]);
    let out = run(cmd);
    assert!(out.contains("999"), "a new tenant is refused: {out}");
    let api = host.path().join("daemon.api");
    let tenants = Command::new(crate::vgpuctl_bin())
        .arg("--api-socket")
        .arg(&api)
        .args(["--json", "tenants"])
        .output()
        .unwrap();
    let tenants = String::from_utf8_lossy(&tenants.stdout);
    assert!(
        !tenants.contains("\"pid"),
        "no tenant registered: {tenants}"
    );
    println!(
        "FIGURE enforce cannot attach: pinned gate kept, raw open: {}, /readyz: {}",
        raw.trim(),
        ready.lines().last().unwrap_or_default()
    );
    drop(daemon);

    // The operator's fall-back: serve without the gate, removing the pinned one.
    let daemon = Daemon::start(
        &sim,
        host.path(),
        r#"exec "$@""#,
        &args(
            "enforce",
            &cg,
            &bpffs.pins(),
            &missing,
            &["--ebpf-enforce-fallback", "serve"],
        ),
    );
    assert!(!bpffs.gate_pinned(), "{}", daemon.log());
    let ready = daemon.http("/readyz");
    assert!(ready.starts_with("HTTP/1.1 200"), "{ready}");
    let m = daemon.http("/metrics");
    assert!(
        m.contains("vgpu_ebpf_program_attached{program=\"gpu_gate\",mode=\"enforce\"} 0"),
        "the series says 0 when serving without the gate too: {m}"
    );
    let raw = raw_open(&cg, &sim);
    assert!(raw.contains("No such device"), "nothing gates: {raw}");
}
