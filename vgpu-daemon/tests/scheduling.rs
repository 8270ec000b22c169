//! The daemon and the shim's launch gate together, with real processes on the
//! simulated GPU: shares, every launch path gated, SIGKILL, daemon restart, a socket
//! flooded with garbage, live share changes, trusted settings, CPU-limited tenant
//! containers. Device time comes from the simulator's own per-process counters; bounds
//! are generous because CI machines are loaded (they check that enforcement happens,
//! not how fast anything is); `cargo xtask busy` runs them with every CPU saturated.

use std::collections::HashMap;
use std::io::Write;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::Value;
use vgpu_cuda_sim::config::SimConfig;
use vgpu_cuda_sim::node_state::State;
use vgpu_tests::{Container, SimNode, probe_bin};

/// These tests measure scheduling against the simulator's device time; run in parallel
/// on a small machine they would mostly measure each other's CPU contention. One at a
/// time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

const SIM: &str = r#"
[[device]]
name = "NVIDIA H100 80GB HBM3"
memory = "16Gi"
context_overhead = "256Mi"
alloc_granularity = "2Mi"
"#;

struct Node {
    sim: SimNode,
    dir: tempfile::TempDir,
}

struct Daemon {
    child: Child,
    socket: PathBuf,
    api: PathBuf,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn signal(pid: u32, sig: &str) {
    let ok = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "kill {sig} {pid}");
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl Node {
    fn new() -> Node {
        Node {
            sim: SimNode::new(SIM),
            dir: tempfile::tempdir().expect("temp dir"),
        }
    }

    fn state(&self) -> State {
        let cfg = SimConfig::from_toml(SIM, "test").expect("valid config");
        State::open(&self.sim.state_dir(), &cfg).expect("sim state")
    }

    fn busy(&self) -> HashMap<u32, u64> {
        self.state()
            .accounting(0)
            .into_iter()
            .map(|r| (r.pid, r.busy_ns))
            .collect()
    }

    fn daemon(&self, extra: &[&str]) -> Daemon {
        let socket = self.dir.path().join("daemon.sock");
        let api = self.dir.path().join("api.sock");
        self.daemon_at(&socket, &api, extra)
    }

    /// A daemon without real-time priority in a cgroup of its own limited to 0.2 CPU
    /// (named `group`; the caller checked that CPU limits are available).
    fn starved_daemon(&self, group: &str) -> (Daemon, vgpu_tests::cpu_load::CpuLimited) {
        let d = self.daemon(&["--sched-priority", "0"]);
        let g = vgpu_tests::cpu_load::CpuLimited::new(group, 200).expect("cpu cgroup");
        g.add(d.child.id()).expect("move the daemon");
        (d, g)
    }

    fn daemon_at(&self, socket: &Path, api: &Path, extra: &[&str]) -> Daemon {
        // A killed daemon leaves its socket files behind: wait for the new ones.
        let _ = std::fs::remove_file(socket);
        let _ = std::fs::remove_file(api);
        let child = Command::new(crate::daemon_bin())
            .args(["--ebpf", "off", "--ebpf-pin-dir", "off"])
            .arg("--socket")
            .arg(socket)
            .arg("--api-socket")
            .arg(api)
            .args(["--metrics-addr", "off", "--nvml-interval-ms", "0"])
            .args(extra)
            .env("VGPU_DAEMON_LOG", "warn")
            .stdout(Stdio::null())
            .spawn()
            .expect("start vgpu-daemon");
        let t0 = Instant::now();
        while !(socket.exists() && api.exists()) {
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "vgpu-daemon did not create its sockets"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        Daemon {
            child,
            socket: socket.to_owned(),
            api: api.to_owned(),
        }
    }

    /// A probe under the shim in `c`, registered with `d` (or with the daemon socket
    /// path `socket` when given).
    fn tenant(&self, c: &Container, socket: &Path, args: &[&str]) -> Child {
        self.tenant_in(None, c, socket, args)
    }

    /// [`Node::tenant`], started inside a CPU-limited group when given.
    fn tenant_in(
        &self,
        group: Option<&vgpu_tests::cpu_load::CpuLimited>,
        c: &Container,
        socket: &Path,
        args: &[&str],
    ) -> Child {
        let cmd = match group {
            Some(g) => {
                let mut w = self.sim.command(Path::new("sh"));
                let inner = g.command(&probe_bin());
                w.args(inner.get_args());
                w
            }
            None => self.sim.command(probe_bin()),
        };
        self.spawn_tenant(cmd, c, socket, args)
    }

    /// [`Node::tenant`], started in a time namespace whose monotonic clock is
    /// `offset_s` seconds ahead of the node's (`unshare --time`, which executes the probe
    /// in it: same PID).
    fn tenant_in_time_namespace(
        &self,
        offset_s: u32,
        c: &Container,
        socket: &Path,
        args: &[&str],
    ) -> Child {
        let mut cmd = self.sim.command(Path::new("unshare"));
        cmd.args(["--time", "--monotonic", &offset_s.to_string()])
            .arg(probe_bin());
        self.spawn_tenant(cmd, c, socket, args)
    }

    /// Starts `cmd` (the probe, maybe wrapped) as a tenant in `c` with `args`.
    fn spawn_tenant(&self, mut cmd: Command, c: &Container, socket: &Path, args: &[&str]) -> Child {
        c.apply(&mut cmd);
        cmd.env("VGPU_DAEMON_SOCKET", socket)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start cuda-probe")
    }
}

fn container(share: u32, policy: &str) -> Container {
    Container::new("4Gi")
        .with("VGPU_COMPUTE_SHARE", &share.to_string())
        .with("VGPU_COMPUTE_POLICY", policy)
}

fn key(c: &Container) -> String {
    c.dir().display().to_string()
}

fn vgpuctl(api: &Path, args: &[&str]) -> std::process::Output {
    Command::new(crate::vgpuctl_bin())
        .arg("--api-socket")
        .arg(api)
        .args(args)
        .output()
        .expect("run vgpuctl")
}

fn tenants(api: &Path) -> Vec<Value> {
    let out = vgpuctl(api, &["--json", "tenants"]);
    assert!(
        out.status.success(),
        "vgpuctl tenants: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    v["tenants"].as_array().cloned().unwrap_or_default()
}

fn tenant(api: &Path, k: &str) -> Option<Value> {
    tenants(api).into_iter().find(|t| t["key"] == k)
}

/// A tenant's charged GPU time on its first GPU, ns.
fn gpu_time(t: &Value) -> u64 {
    t["gpus"][0]["gpu_time_ns"].as_u64().expect("gpu_time_ns")
}

/// The daemon's health records (fallbacks, refusals) of every container.
fn health(api: &Path) -> Vec<Value> {
    let out = vgpuctl(api, &["--json", "tenants"]);
    let v: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    v["health"].as_array().cloned().unwrap_or_default()
}

/// Asserts that no process of `c` ever enforced its share locally: the daemon knows of
/// no fallback (reported or ongoing) for it.
fn assert_never_fell_back(api: &Path, c: &Container, what: &str) {
    let k = key(c);
    if let Some(h) = health(api).into_iter().find(|h| h["key"] == k.as_str()) {
        assert_eq!(h["fallback_periods"].as_u64(), Some(0), "{what}: {h}");
        assert_eq!(h["processes_in_fallback"].as_u64(), Some(0), "{what}: {h}");
    }
}

/// [`finish`], and the process never said it fell back to local enforcement.
fn finish_registered(c: Child, what: &str) -> String {
    let out = c.wait_with_output().expect("wait for cuda-probe");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "cuda-probe failed ({}): {stdout}\n{stderr}",
        out.status
    );
    assert!(
        !stderr.contains("enforced locally"),
        "{what}: a tenant fell back to local enforcement:\n{stderr}"
    );
    stdout
}

fn wait_for(what: &str, timeout: Duration, mut ok: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !ok() {
        assert!(t0.elapsed() < timeout, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn finish(c: Child) -> String {
    finish_with_log(c).0
}

/// Waits for a tenant that must succeed: its stdout and its stderr (the shim's log).
fn finish_with_log(c: Child) -> (String, String) {
    let out = c.wait_with_output().expect("wait for cuda-probe");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "cuda-probe failed ({}): {stdout}\n{stderr}",
        out.status
    );
    (stdout, stderr)
}

/// Device time of each pid over `window`, starting now.
fn window(node: &Node, pids: &[u32], window: Duration) -> Vec<u64> {
    let b0 = node.busy();
    std::thread::sleep(window);
    let b1 = node.busy();
    pids.iter()
        .map(|p| b1.get(p).copied().unwrap_or(0) - b0.get(p).copied().unwrap_or(0))
        .collect()
}

fn load_args(secs: u64, kernel_ns: u64, at: u64) -> Vec<String> {
    vec![
        "init".into(),
        "load".into(),
        secs.to_string(),
        kernel_ns.to_string(),
        at.to_string(),
        "1".into(),
    ]
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

#[test]
fn saturating_tenants_get_their_shares() {
    let _serial = serial();
    let node = Node::new();
    let d = node.daemon(&[]);
    let at = now_ms() + 1500;
    let args = load_args(5, 1_000_000, at);
    let (c1, c2) = (container(25, "burst"), container(75, "burst"));
    let t1 = node.tenant(&c1, &d.socket, &strs(&args));
    let t2 = node.tenant(&c2, &d.socket, &strs(&args));
    std::thread::sleep(Duration::from_millis((at + 1000).saturating_sub(now_ms())));
    let busy = window(&node, &[t1.id(), t2.id()], Duration::from_secs(3));
    let share1 = busy[0] as f64 * 100.0 / (busy[0] + busy[1]).max(1) as f64;
    assert!(
        (share1 - 25.0).abs() < 8.0,
        "25/75 split measured {share1:.1} % for the 25 % tenant ({busy:?} ns)"
    );
    // What the daemon reports agrees with the simulator about who got more.
    let t = tenants(&d.api);
    let used = |k: &str| gpu_time(t.iter().find(|x| x["key"] == k).expect("listed"));
    assert!(used(&key(&c2)) > 2 * used(&key(&c1)), "{t:?}");
    // Their shims claim the grants they launch under (ADR 0030): running tenants'
    // grants are almost never taken back unclaimed (a shim that never claimed would
    // have every revoked grant counted).
    for c in [&c1, &c2] {
        let g = &t.iter().find(|x| x["key"] == key(c)).expect("listed")["gpus"][0];
        let (grants, unclaimed) = (
            g["grants"].as_u64().unwrap_or(0),
            g["unclaimed_grants"].as_u64().unwrap_or(u64::MAX),
        );
        assert!(
            grants >= 10 && unclaimed * 10 <= grants,
            "a saturating tenant had {unclaimed} of {grants} grants taken back unclaimed"
        );
    }
    finish(t1);
    finish(t2);
}

/// Issue 16 (b): each tenant in its own CPU-limited container (cgroup `cpu` quota of
/// 0.5 CPU) with a busy loop of its own beside it, so the shim's gate thread runs
/// throttled and time-sharing (no real-time runtime in the group).
///
/// Such tenants may not keep the GPU busy by themselves, and work conservation then
/// gives one what the other cannot use: the split follows their CPU as well as their
/// shares. What holds, measured by the simulator alone (its per-process device time):
/// the 75 % tenant keeps more than half of what the two got, and the 25 % tenant still
/// gets time. How far the 75 % tenant falls short of its 75 % is a figure, not a bound:
/// 73–76 % on an idle machine, 57–75 % with three CPU hogs on the 2-core VM (issue 16's
/// parked corner; `docs/specification.md`). Before issue 38 the first assertion let the
/// daemon's own waiting counter excuse any split (`share > 50 || daemon-waited < 10 %`).
#[test]
fn shares_hold_for_cpu_limited_tenant_containers() {
    use vgpu_tests::cpu_load::CpuLimited;
    if let Some(why) = CpuLimited::unavailable() {
        return vgpu_test_needs::skip(vgpu_test_needs::Need::CgroupV1Cpu, &why);
    }
    let _serial = serial();
    let node = Node::new();
    let d = node.daemon(&[]);
    let at = now_ms() + 1500;
    let args = load_args(5, 1_000_000, at);
    let (c1, c2) = (container(25, "burst"), container(75, "burst"));
    let g1 = CpuLimited::new("vgpu-test-t1", 500).expect("cpu cgroup");
    let g2 = CpuLimited::new("vgpu-test-t2", 500).expect("cpu cgroup");
    let t1 = node.tenant_in(Some(&g1), &c1, &d.socket, &strs(&args));
    let t2 = node.tenant_in(Some(&g2), &c2, &d.socket, &strs(&args));
    std::thread::sleep(Duration::from_millis((at + 1000).saturating_sub(now_ms())));
    let busy = window(&node, &[t1.id(), t2.id()], Duration::from_secs(3));
    let share2 = busy[1] as f64 * 100.0 / (busy[0] + busy[1]).max(1) as f64;
    eprintln!(
        "CPU-limited containers: the 75 % tenant got {share2:.1} % of the device time ({busy:?} ns, GPU busy {:.1} %)",
        (busy[0] + busy[1]) as f64 * 100.0 / 3e9
    );
    assert!(
        share2 > 50.0,
        "CPU-limited containers: the 75 % tenant got {share2:.1} % of the device time, not more than half ({busy:?} ns)"
    );
    assert!(
        busy[0] > 0,
        "CPU-limited containers: the 25 % tenant got no GPU time ({busy:?} ns)"
    );
    // A throttled gate thread answers late, but never loses its daemon.
    for c in [&c1, &c2] {
        assert_never_fell_back(&d.api, c, "CPU-limited containers");
    }
    finish_registered(t1, "CPU-limited containers");
    finish_registered(t2, "CPU-limited containers");
}

/// What three tenants of `kernel_ns` kernels in containers stopped most of each CFS
/// period (0.1 CPU beside a busy loop each) did over 3 s with co-holding on (at the
/// bound it was measured with): in how many of the looks several held the GPU at once
/// (one co-held), of how many; each one's device time, ns; the most each container was
/// stopped, as the API showed it, percent.
struct Stopped {
    together: usize,
    looks: usize,
    busy: Vec<u64>,
    stopped_max: [f64; 3],
    /// Grants taken back before the tenant launched under them (ADR 0030).
    unclaimed: Vec<u64>,
}

fn stopped_tenants(kernel_ns: u64) -> Stopped {
    use vgpu_tests::cpu_load::CpuLimited;
    let node = Node::new();
    let d = node.daemon(&["--co-hold-fill-pct", "80"]);
    let at = now_ms() + 1500;
    let args = load_args(6, kernel_ns, at);
    let cs = [20, 30, 50].map(|s| container(s, "burst"));
    let groups: Vec<CpuLimited> = (0..3)
        .map(|i| CpuLimited::new(&format!("vgpu-test-stopped{i}"), 100).expect("cpu cgroup"))
        .collect();
    let ts: Vec<Child> = cs
        .iter()
        .zip(&groups)
        .map(|(c, g)| node.tenant_in(Some(g), c, &d.socket, &strs(&args)))
        .collect();
    // Warm-up: each tenant measured, its throttling read.
    std::thread::sleep(Duration::from_millis((at + 2000).saturating_sub(now_ms())));
    let pids: Vec<u32> = ts.iter().map(Child::id).collect();
    let b0 = node.busy();
    let mut together = 0;
    let mut looks = 0;
    let mut stopped_max = [0.0f64; 3];
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(3) {
        let gpus: Vec<Value> = cs
            .iter()
            .filter_map(|c| tenant(&d.api, &key(c)).map(|t| t["gpus"][0].clone()))
            .collect();
        let holding = gpus.iter().filter(|g| g["state"] == "holding").count();
        // What the API says of each: its container's stopped part (the kernel's).
        for (m, g) in stopped_max.iter_mut().zip(&gpus) {
            *m = m.max(g["cpu_stopped_pct"].as_f64().unwrap_or(0.0));
        }
        together += usize::from(holding >= 2 && gpus.iter().any(|g| g["co_held"] == true));
        looks += 1;
        std::thread::sleep(Duration::from_millis(20));
    }
    let unclaimed: Vec<u64> = cs
        .iter()
        .map(|c| {
            tenant(&d.api, &key(c)).map_or(0, |t| {
                t["gpus"][0]["unclaimed_grants"].as_u64().unwrap_or(0)
            })
        })
        .collect();
    let b1 = node.busy();
    let busy: Vec<u64> = pids
        .iter()
        .map(|p| b1.get(p).copied().unwrap_or(0) - b0.get(p).copied().unwrap_or(0))
        .collect();
    for c in &cs {
        assert_never_fell_back(&d.api, c, "stopped containers");
    }
    for t in ts {
        finish_registered(t, "stopped containers");
    }
    Stopped {
        together,
        looks,
        busy,
        stopped_max,
        unclaimed,
    }
}

impl Stopped {
    /// Says what happened (`what`: the kernels) and asserts what holds either way: the
    /// API showed every container stopped most of the time, and every tenant got
    /// device time.
    fn said_and_served(&self, what: &str) {
        let Stopped {
            together,
            looks,
            busy,
            stopped_max,
            unclaimed,
        } = self;
        eprintln!(
            "stopped containers, {what}: several tenants holding in {together} of {looks} looks; device time {busy:?} ns; stopped {stopped_max:.0?} %; grants taken back unclaimed {unclaimed:?}"
        );
        assert!(
            stopped_max.iter().all(|s| *s > 60.0),
            "{what}: the API showed the containers stopped at most {stopped_max:.0?} % of the time"
        );
        assert!(
            busy.iter().all(|b| *b > 0),
            "{what}: a stopped tenant got no device time: {busy:?} ns"
        );
    }
}

/// ADR 0029: tenants whose containers are stopped most of each CFS period (0.1 CPU
/// beside a busy loop each) cannot fill the GPU: the daemon reads their throttling from
/// the kernel and lets them hold the GPU together, so each runs when its container does.
/// Before, granted one at a time mostly while stopped, they got 12–27 % of what they use
/// unshared, and the phases could lock one out entirely. Asserted: behaviour (several
/// tenants holding at once, none left without device time), not a figure.
#[test]
fn tenants_stopped_most_of_the_time_hold_the_gpu_together() {
    if let Some(why) = vgpu_tests::cpu_load::CpuLimited::unavailable() {
        return vgpu_test_needs::skip(vgpu_test_needs::Need::CgroupV1Cpu, &why);
    }
    let _serial = serial();
    let r = stopped_tenants(10_000);
    r.said_and_served("10 µs kernels");
    assert!(
        r.together > 0,
        "three tenants stopped most of the time never held the GPU together ({} looks; device time {:?} ns)",
        r.looks,
        r.busy
    );
}

/// ADR 0029, run-on: the same containers launching 100 ms kernels keep the GPU busy
/// through their stops (queued work runs on while the CPU is stopped), so they are never
/// co-held, however stopped: they take turns by their shares. Without the run-on term
/// they were co-held (9 of 108 looks) and the 50 % tenant got 154 ms of device time
/// against the 20 % tenant's 1108.
#[test]
fn stopped_tenants_whose_kernels_run_through_their_stops_take_turns() {
    if let Some(why) = vgpu_tests::cpu_load::CpuLimited::unavailable() {
        return vgpu_test_needs::skip(vgpu_test_needs::Need::CgroupV1Cpu, &why);
    }
    let _serial = serial();
    let r = stopped_tenants(100_000_000);
    r.said_and_served("100 ms kernels");
    assert_eq!(
        r.together, 0,
        "tenants of 100 ms kernels were co-held ({} looks; device time {:?} ns)",
        r.looks, r.busy
    );
}

/// Issue 16 (c): the daemon itself starved: time-sharing (`--sched-priority 0`) inside a
/// cgroup limited to 0.2 CPU beside a busy loop of its own, so it wakes late for every
/// slice end and every drain, and reads demands late (they carry their own time, ADR
/// 0027). Charges come from the shims' drain times, so the split still holds; slices
/// only get longer. Beside saturated CPUs a tenant's launcher is at times off its CPU and
/// asks for nothing: the other may then get more than its share (work conservation),
/// and the bound allows exactly that, measured by the kernel: the launcher's run-queue
/// delay (before issue 38, by the daemon's own waiting counter; with it, the 75 % tenant
/// at 1,284 ms of device time and 423 ms waiting in a 3 s window left 1.3 s unasked, and
/// the 25 % tenant got 43.9 %).
#[test]
fn shares_hold_when_the_daemon_is_starved() {
    use vgpu_tests::cpu_load::CpuLimited;
    if let Some(why) = CpuLimited::unavailable() {
        return vgpu_test_needs::skip(vgpu_test_needs::Need::CgroupV1Cpu, &why);
    }
    let _serial = serial();
    let node = Node::new();
    let (d, _g) = node.starved_daemon("vgpu-test-daemon");
    let at = now_ms() + 1500;
    let args = load_args(5, 1_000_000, at);
    let (c1, c2) = (container(25, "burst"), container(75, "burst"));
    let t1 = node.tenant(&c1, &d.socket, &strs(&args));
    let t2 = node.tenant(&c2, &d.socket, &strs(&args));
    std::thread::sleep(Duration::from_millis((at + 1000).saturating_sub(now_ms())));
    // What the daemon charged over the same window: equal to the device share when the
    // scheduler's decisions are what drifted, different when the busy times are.
    // Each tenant's charged time, grants and time waited for the GPU (ns).
    let counters = || {
        [&c1, &c2].map(|c| {
            tenant(&d.api, &key(c)).map_or([0; 3], |t| {
                let g = &t["gpus"][0];
                [
                    gpu_time(&t),
                    g["grants"].as_u64().unwrap_or(0),
                    g["throttled_ns"].as_u64().unwrap_or(0),
                ]
            })
        })
    };
    let before = counters();
    let offcpu = || [t1.id(), t2.id()].map(vgpu_tests::runqueue_wait_ns);
    let off0 = offcpu();
    let busy = window(&node, &[t1.id(), t2.id()], Duration::from_secs(3));
    let off1 = offcpu();
    let after = counters();
    let delta = |i: usize, k: usize| after[i][k].saturating_sub(before[i][k]);
    let (u1, u2) = (delta(0, 0), delta(1, 0));
    let charged1 = u1 as f64 * 100.0 / (u1 + u2).max(1) as f64;
    let share1 = busy[0] as f64 * 100.0 / (busy[0] + busy[1]).max(1) as f64;
    let detail = format!(
        "device time {} / {} ms of the 3 s window, grants {} / {}, waited {} / {} ms",
        busy[0] / 1_000_000,
        busy[1] / 1_000_000,
        delta(0, 1),
        delta(1, 1),
        delta(0, 2) / 1_000_000,
        delta(1, 2) / 1_000_000
    );
    eprintln!(
        "starved daemon: the 25 % tenant got {share1:.1} % of device time, charged {charged1:.1} % (25 % / 75 % tenant: {detail})"
    );
    // A slow daemon is not a lost one: no tenant fell back to local enforcement.
    for c in [&c1, &c2] {
        assert_never_fell_back(&d.api, c, "starved daemon");
    }
    // Shares are owed under contention: a tenant may get more than its share by what the
    // other did not ask for (work conservation). Beside saturated CPUs a launcher is at
    // times off its CPU and asks for nothing; what the 25 % tenant got beyond 33 % of the
    // device time (25 + 8 pp) must fit in the time the 75 % tenant's launcher waited for
    // a CPU, and what it got below 17 % in its own. That time is the kernel's count (the
    // launcher's run-queue delay), not the daemon's: before issue 38 it was the window
    // less the device time less the daemon's own waiting counter.
    let not_asking = |i: usize| off1[i].saturating_sub(off0[i]);
    let total = (busy[0] + busy[1]) as f64;
    let over = busy[0] as f64 - 0.33 * total;
    let under = 0.17 * total - busy[0] as f64;
    assert!(
        over <= not_asking(1) as f64 && under <= not_asking(0) as f64,
        "starved daemon: the 25 % tenant got {share1:.1} %, charged {charged1:.1} % ({detail}; \
         launchers waiting for a CPU: {} / {} ms)",
        not_asking(0) / 1_000_000,
        not_asking(1) / 1_000_000
    );
    finish_registered(t1, "starved daemon");
    finish_registered(t2, "starved daemon");
}

/// A daemon frozen (SIGSTOP) while two tenants saturate the GPU does not leave it to the
/// holder for the freeze: the grant, which the daemon would have revoked at its slice's
/// end since the other tenant waits, expires in the holder's shims (ADR 0036). The
/// freeze (1.2 s) is shorter than the shims' peer deadline: both go on with the daemon,
/// nobody falls back. With expiry off (`--grant-expiry-ms 0`) the holder ran the whole
/// freeze (1,200 ms of device time, twice; checked by hand).
#[test]
fn a_holders_grant_expires_when_the_daemon_freezes() {
    let _serial = serial();
    let node = Node::new();
    let d = node.daemon(&[]);
    let at = now_ms() + 1500;
    let args = load_args(5, 1_000_000, at);
    let (c1, c2) = (container(50, "burst"), container(50, "burst"));
    let t1 = node.tenant(&c1, &d.socket, &strs(&args));
    let t2 = node.tenant(&c2, &d.socket, &strs(&args));
    std::thread::sleep(Duration::from_millis((at + 1000).saturating_sub(now_ms())));
    signal(d.child.id(), "-STOP");
    let busy = window(&node, &[t1.id(), t2.id()], Duration::from_millis(1200));
    signal(d.child.id(), "-CONT");
    let most = busy.iter().copied().max().unwrap_or(0);
    eprintln!(
        "figure: device time during a 1.2 s daemon freeze: {} / {} ms",
        busy[0] / 1_000_000,
        busy[1] / 1_000_000
    );
    // The slice (10-40 ms), the expiry margin (50 ms) and the drain bound it; 400 ms
    // leaves room for a loaded machine, a third of the freeze.
    assert!(
        most < 400_000_000,
        "a holder ran {} ms of a 1.2 s daemon freeze ({busy:?} ns)",
        most / 1_000_000
    );
    // A grant held into the freeze (someone ran a good part of a slice meanwhile)
    // expired: the daemon counts it when it reads the report.
    if most >= 20_000_000 {
        let expired = || {
            [&c1, &c2]
                .iter()
                .filter_map(|c| tenant(&d.api, &key(c)))
                .map(|t| t["gpus"][0]["expired_grants"].as_u64().unwrap_or(0))
                .sum::<u64>()
        };
        wait_for("the expired grant counted", Duration::from_secs(10), || {
            expired() >= 1
        });
    }
    for c in [&c1, &c2] {
        assert_never_fell_back(&d.api, c, "frozen daemon");
    }
    finish_registered(t1, "frozen daemon");
    finish_registered(t2, "frozen daemon");
}

/// A tenant whose container runs in a time namespace with a monotonic offset (a runtime
/// may give one; ADR 0038): its shim's clock is the node's, so its grants' expiries
/// (ADR 0036), claims and reports mean what they say. With its namespace's own clock,
/// 1000 s ahead, every grant it got had expired already: it yielded each at once.
#[test]
fn a_tenant_in_a_time_namespace_gets_its_share() {
    let probe = Command::new("unshare")
        .args(["--time", "--monotonic", "1000", "true"])
        .output();
    if !probe.as_ref().is_ok_and(|o| o.status.success()) {
        let why = format!("`unshare --time` failed: {probe:?}");
        return vgpu_test_needs::skip(vgpu_test_needs::Need::TimeNamespaces, &why);
    }
    let _serial = serial();
    let node = Node::new();
    let d = node.daemon(&[]);
    let at = now_ms() + 1500;
    let args = load_args(5, 1_000_000, at);
    let (c1, c2) = (container(50, "burst"), container(50, "burst"));
    let t1 = node.tenant_in_time_namespace(1000, &c1, &d.socket, &strs(&args));
    let t2 = node.tenant(&c2, &d.socket, &strs(&args));
    // The probe runs in the namespace asked for, once `unshare` made it and executed the
    // probe (same PID; its children's namespace is its own).
    let offsets =
        || std::fs::read_to_string(format!("/proc/{}/timens_offsets", t1.id())).unwrap_or_default();
    wait_for(
        "the tenant in a time namespace 1000 s ahead",
        Duration::from_secs(10),
        || {
            offsets()
                .lines()
                .any(|l| l.split_whitespace().collect::<Vec<_>>() == ["monotonic", "1000", "0"])
        },
    );
    std::thread::sleep(Duration::from_millis((at + 1000).saturating_sub(now_ms())));
    let busy = window(&node, &[t1.id(), t2.id()], Duration::from_secs(3));
    let share1 = busy[0] as f64 * 100.0 / (busy[0] + busy[1]).max(1) as f64;
    let t = tenant(&d.api, &key(&c1)).expect("listed");
    let (grants, expired) = (
        t["gpus"][0]["grants"].as_u64().unwrap_or(0),
        t["gpus"][0]["expired_grants"].as_u64().unwrap_or(u64::MAX),
    );
    eprintln!(
        "figure: tenant in a time namespace: {share1:.1} % of the device time, \
         {expired} of {grants} grants expired"
    );
    assert!(
        (share1 - 50.0).abs() < 8.0,
        "the tenant in a time namespace got {share1:.1} % at 50/50 ({busy:?} ns)"
    );
    assert!(
        expired * 10 <= grants,
        "{expired} of its {grants} grants expired in its shim, the daemon running"
    );
    for c in [&c1, &c2] {
        assert_never_fell_back(&d.api, c, "time namespace");
    }
    finish(t1);
    finish(t2);
}

/// A holder too starved of CPU to report its drain (here: stopped) does not keep the GPU
/// from a waiting tenant beyond its queued work: the daemon hands the GPU on, and charges
/// the holder when it reports (issue 16: throttled containers held the GPU idle). What
/// is asserted is the daemon's side: the waiting tenant is granted while the holder is
/// stopped, and the holder, back, is charged and granted again. (The waiting tenant's
/// kernels also run: the simulator's engine is taken over from a stopped owner once its
/// claimed work is over, `docs/cuda-sim.md`.)
#[test]
fn a_frozen_holders_slice_goes_on_to_the_waiting_tenant() {
    let _serial = serial();
    let node = Node::new();
    // A drain timeout far longer than the test: only the hand-on (on) can move the GPU on.
    let d = node.daemon(&["--drain-timeout-ms", "20000", "--hand-on-margin-ms", "1"]);
    let (c1, c2) = (container(50, "burst"), container(50, "burst"));
    // Tenant 1 alone: a first load, then idle (its report tells the daemon its device
    // time per launch), then a load it holds the GPU for, slice after slice.
    let t1 = node.tenant(
        &c1,
        &d.socket,
        &[
            "init", "load", "1", "1000000", "0", "1", "sleep", "300", "load", "12", "1000000", "0",
            "1",
        ],
    );
    let grants = |c: &Container| {
        tenant(&d.api, &key(c)).map_or(0, |t| t["gpus"][0]["grants"].as_u64().unwrap_or(0))
    };
    // Its second grant is its second load's (the first load's ended with its idle report).
    wait_for(
        "tenant 1 holding its second load",
        Duration::from_secs(20),
        || {
            grants(&c1) >= 2
                && tenant(&d.api, &key(&c1)).is_some_and(|t| t["gpus"][0]["state"] == "holding")
        },
    );
    std::thread::sleep(Duration::from_millis(300));
    signal(t1.id(), "-STOP");
    let args = load_args(6, 1_000_000, 0);
    let t2 = node.tenant(&c2, &d.socket, &strs(&args));
    wait_for(
        "the waiting tenant granted the GPU while the holder is stopped",
        Duration::from_secs(10),
        || grants(&c2) > 0,
    );
    let t1_grants = grants(&c1);
    let t1_time = tenant(&d.api, &key(&c1)).map_or(0, |t| gpu_time(&t));
    signal(t1.id(), "-CONT");
    // Back, it reports late, is charged what it ran, and is granted again.
    wait_for(
        "the holder, back, charged and granted again",
        Duration::from_secs(10),
        || {
            grants(&c1) > t1_grants
                && tenant(&d.api, &key(&c1)).is_some_and(|t| gpu_time(&t) > t1_time)
        },
    );
    for c in [&c1, &c2] {
        assert_never_fell_back(&d.api, c, "frozen holder");
    }
    finish_registered(t2, "frozen holder");
    finish_registered(t1, "frozen holder");
}

#[test]
fn every_launch_path_is_gated() {
    let _serial = serial();
    every_launch_path_stays_under_its_cap(None, "idle");
}

/// The same, in a container stopped most of each CFS period (0.2 CPU, a busy loop of its
/// own): the gate thread, stopped with the launcher, finds several markers complete at
/// once when the container runs again. (It did not catch ADR 0028's failure, a poll 5–10
/// ms late while the launcher ran: 0 of 3 runs with the library before the fix; a delayed
/// poll reproduced that one.)
#[test]
fn every_launch_path_is_gated_in_a_cpu_limited_container() {
    use vgpu_tests::cpu_load::CpuLimited;
    if let Some(why) = CpuLimited::unavailable() {
        return vgpu_test_needs::skip(vgpu_test_needs::Need::CgroupV1Cpu, &why);
    }
    let _serial = serial();
    let g = CpuLimited::new("vgpu-test-paths", 200).expect("cpu cgroup");
    every_launch_path_stays_under_its_cap(Some(&g), "CPU-limited");
}

/// A process that leaves a stream capture open: its drains wait for its markers instead of
/// synchronizing the device (ADR 0033), and its launches on other streams still stay under
/// its cap (24 % measured). A guard of that path: the library of before it passed too
/// (its refused synchronizations returned at once; the queue-ahead bound held the cap).
#[test]
fn a_capture_left_open_does_not_lift_the_cap() {
    let _serial = serial();
    let outs = launch_paths_stay_under_a_cap(
        None,
        "a capture left open",
        &["capture-open"],
        &["kernel", "graph"],
    );
    for out in outs {
        assert!(out.contains("capture_open=ok"), "{out}");
    }
}

/// Each launch path, 20 kernels of 5 ms (100 ms of device time) under a 20 % cap, one
/// process each in one container (in `group` when given): none may use 30 % of the GPU
/// over its run, the cap and 10 points for a run of a few slices (16–25 % measured;
/// ungated they take 100 ms: 100 %). The bound was 40 % before issue 38.
fn every_launch_path_stays_under_its_cap(
    group: Option<&vgpu_tests::cpu_load::CpuLimited>,
    what: &str,
) {
    launch_paths_stay_under_a_cap(
        group,
        what,
        &[],
        &[
            "kernel",
            "kernel-ptsz",
            "ex",
            "ex-ptsz",
            "coop",
            "coop-ptsz",
            "graph",
            "graph-ptsz",
        ],
    );
}

/// Launch paths `paths`, 20 kernels of 5 ms each after the probe commands `before`, as in
/// [`every_launch_path_stays_under_its_cap`]; each tenant's stdout.
fn launch_paths_stay_under_a_cap(
    group: Option<&vgpu_tests::cpu_load::CpuLimited>,
    what: &str,
    before: &[&str],
    paths: &[&str],
) -> Vec<String> {
    let node = Node::new();
    let d = node.daemon(&[]);
    let mut c = container(20, "cap");
    // The shim's log (its slices, drains) goes with a failure: the one seen in CI (a
    // graph's first two markers found by one late poll) was rare and timing-bound.
    c.env.push(("VGPU_LOG".into(), "1".into()));
    let mut outs = Vec::new();
    for &path in paths {
        let args: Vec<&str> = ["init"]
            .into_iter()
            .chain(before.iter().copied())
            .chain(["spin", path, "20", "5000000"])
            .collect();
        let t = node.tenant_in(group, &c, &d.socket, &args);
        let pid = t.id();
        let (out, log) = finish_with_log(t);
        let wall_us = vgpu_tests::num(&out, "wall_us");
        let busy = node.busy().get(&pid).copied().unwrap_or(0);
        assert!(
            busy >= 100_000_000,
            "{what}, {path}: only {busy} ns ran\n{log}"
        );
        let frac = busy as f64 / (wall_us as f64 * 1000.0);
        eprintln!(
            "{what}, {path}: {:.1} % of the GPU over {wall_us} µs",
            frac * 100.0
        );
        assert!(
            frac < 0.30,
            "{what}, {path}: {:.0} % of the GPU under a 20 % cap ({out})\n{log}",
            frac * 100.0
        );
        outs.push(out);
    }
    outs
}

/// An application that captures a CUDA graph after real work (PyTorch synchronizes after
/// its warm-up, then captures on a side stream, in global mode): the gate thread drains
/// the slice it held while the capture is open. A device synchronization then would
/// invalidate the capture (CUDA's rule, simulated), and the application would fail at
/// `cuStreamEndCapture`; the launches into the capture run nothing and must not wait for
/// the GPU or count as the tenant's work.
#[test]
fn a_graph_captured_after_real_work_is_not_broken_by_the_gate() {
    let _serial = serial();
    let node = Node::new();
    let d = node.daemon(&[]);
    let mut c = container(50, "burst");
    c.env.push(("VGPU_LOG".into(), "1".into()));
    // A second tenant keeps the GPU contended: grants are revoked and drained too.
    let other = node.tenant(
        &container(50, "burst"),
        &d.socket,
        &strs(&load_args(3, 1_000_000, now_ms())),
    );
    // The capture begun with `cuStreamBeginCapture_v2`, and with
    // `cuStreamBeginCaptureToGraph` into a graph made first (CUDA 12.3).
    for (how, pause_ms) in [
        ("capture", "5"),
        ("capture", "30"),
        ("capture-to-graph", "30"),
    ] {
        let t = node.tenant(&c, &d.socket, &["init", how, "8", "1000000", pause_ms]);
        let (out, log) = finish_with_log(t);
        assert!(
            out.contains("capture=ok") && out.contains("graph=ok"),
            "{how}, a pause of {pause_ms} ms in the capture: {out}\n{log}"
        );
        if how == "capture-to-graph" {
            assert!(out.contains("graph_same=1"), "{out}");
        }
        // The slices' launches, as the shim logged them at each drain: the 8 real ones
        // and the graph's (when its slice drained before the process exited), never the
        // 8 captured.
        let launches: u64 = log
            .lines()
            .filter_map(|l| {
                l.split(" launches at ")
                    .next()?
                    .rsplit(' ')
                    .next()?
                    .parse::<u64>()
                    .ok()
            })
            .sum();
        assert!(
            (8..=9).contains(&launches),
            "{how}: {launches} launches counted under grants:\n{log}"
        );
    }
    finish(other);
}

#[test]
fn a_killed_tenant_releases_its_slice_at_once() {
    let _serial = serial();
    let node = Node::new();
    let d = node.daemon(&[]);
    let at = now_ms() + 1500;
    let (c1, c2) = (container(50, "burst"), container(50, "burst"));
    let victim = node.tenant(&c1, &d.socket, &strs(&load_args(30, 1_000_000, at)));
    let survivor = node.tenant(&c2, &d.socket, &strs(&load_args(4, 1_000_000, at)));
    std::thread::sleep(Duration::from_millis((at + 200).saturating_sub(now_ms())));
    // Sharing: the survivor's rate of device time with the victim alive.
    let shared = window(&node, &[survivor.id()], Duration::from_millis(800))[0] as f64 / 0.8e9;
    let mut victim = victim;
    victim.kill().expect("SIGKILL");
    victim.wait().expect("reaped");
    wait_for("the killed tenant to leave", Duration::from_secs(5), || {
        tenant(&d.api, &key(&c1)).is_none()
    });
    // The survivor now has the GPU to itself: its rate about doubles. Compared with
    // its own rate before, not with 100 %: on saturated CPUs the simulated GPU itself
    // runs slower (its engine threads compete for the CPU).
    let alone = window(&node, &[survivor.id()], Duration::from_millis(1500))[0] as f64 / 1.5e9;
    assert!(
        alone > 1.3 * shared && alone > 0.3,
        "the survivor ran {:.0} % of the time after the kill, {:.0} % before",
        alone * 100.0,
        shared * 100.0
    );
    finish(survivor);
}

#[test]
fn daemon_restart_loses_no_tenant_and_the_fallback_holds_the_cap() {
    let _serial = serial();
    let node = Node::new();
    let d = node.daemon(&[]);
    let (socket, api) = (d.socket.clone(), d.api.clone());
    let c = container(30, "cap");
    let at = now_ms() + 1000;
    let t = node.tenant(&c, &socket, &strs(&load_args(9, 1_000_000, at)));
    wait_for("registration", Duration::from_secs(10), || {
        tenant(&api, &key(&c)).is_some()
    });
    std::thread::sleep(Duration::from_millis((at + 500).saturating_sub(now_ms())));
    drop(d); // SIGKILL
    // Without the daemon, the shim enforces the cap locally: its duty cycle (29.6–29.8 %
    // measured, idle or with three CPU hogs; 21 % when the gate thread reopened the
    // gate up to 20 ms late, 2 % when it then polled markers 20 ms late).
    std::thread::sleep(Duration::from_millis(300));
    let busy = window(&node, &[t.id()], Duration::from_secs(2));
    let frac = busy[0] as f64 / 2e9;
    assert!(
        frac > 0.22 && frac < 0.38,
        "local fallback at a 30 % cap ran {:.0} % of the time",
        frac * 100.0
    );
    // A new daemon on the same socket gets the tenant back.
    let d2 = node.daemon_at(&socket, &api, &[]);
    wait_for("re-registration", Duration::from_secs(10), || {
        tenant(&d2.api, &key(&c)).is_some()
    });
    let busy = window(&node, &[t.id()], Duration::from_secs(2));
    let frac = busy[0] as f64 / 2e9;
    eprintln!(
        "under the restarted daemon a lone 30 % cap tenant ran {:.1} % of the GPU",
        frac * 100.0
    );
    // A lone capped tenant that saturates runs at its cap: 30 ± 8 %, as under the fallback
    // (the bound was 5–45 % before issue 38).
    assert!(
        frac > 0.22 && frac < 0.38,
        "under the restarted daemon a 30 % cap ran {:.1} %",
        frac * 100.0
    );
    finish(t);
}

#[test]
fn garbage_on_the_socket_does_not_disturb_other_tenants() {
    let _serial = serial();
    let node = Node::new();
    let d = node.daemon(&[]);
    let c = container(100, "burst");
    let at = now_ms() + 1000;
    let t = node.tenant(&c, &d.socket, &strs(&load_args(6, 1_000_000, at)));
    wait_for("registration", Duration::from_secs(10), || {
        tenant(&d.api, &key(&c)).is_some()
    });
    // Floods: random bytes, an oversized frame, bad JSON, a second Hello, a frame for
    // a GPU never registered, half a frame then close; many connections at once.
    let mut floods = Vec::new();
    for i in 0..40u32 {
        let socket = d.socket.clone();
        floods.push(std::thread::spawn(move || {
            let Ok(mut s) = UnixStream::connect(&socket) else {
                return;
            };
            let junk: Vec<u8> = (0..65_536u32)
                .map(|k| (k.wrapping_mul(2_654_435_761).wrapping_add(i) >> 13) as u8)
                .collect();
            let frames: Vec<Vec<u8>> = vec![
                junk,
                u32::MAX.to_le_bytes().to_vec(),
                [&5u32.to_le_bytes()[..], b"{{{{{"].concat(),
                vgpu_core::sched_proto::encode(&"Demand"),
                [&100u32.to_le_bytes()[..], b"{\"Hello\""].concat(),
            ];
            let _ = s.write_all(&frames[(i as usize) % frames.len()]);
            if i % 3 == 0 {
                // A valid Hello, then nonsense after it.
                let hello = vgpu_core::sched_proto::ShimMsg::Hello {
                    proto: vgpu_core::sched_proto::PROTO_VERSION,
                    pid: 1,
                    ident: vgpu_core::sched_proto::ContainerIdent {
                        key: format!("flood-{i}"),
                        ..Default::default()
                    },
                    gpus: vec![vgpu_core::sched_proto::GpuRegistration {
                        uuid: "GPU-00000000-0000-4000-8000-00000000dead".into(),
                        ordinal: 0,
                        settings: vgpu_core::sched_proto::ComputeSettings {
                            share_pct: 100,
                            policy: Default::default(),
                            priority: Default::default(),
                        },
                        memory_quota: None,
                    }],
                };
                if let Ok(mut s2) = UnixStream::connect(&socket) {
                    let _ = s2.write_all(&vgpu_core::sched_proto::encode(&hello));
                    let _ = s2.write_all(&vgpu_core::sched_proto::encode(
                        &vgpu_core::sched_proto::ShimMsg::Demand {
                            gpu: 7,
                            since_ns: None,
                        },
                    ));
                    let _ = s2.write_all(&[0xde, 0xad, 0xbe, 0xef, 1, 2, 3]);
                }
            }
        }));
    }
    for f in floods {
        f.join().expect("flood thread");
    }
    // The daemon is alive, serves the API, keeps the real tenant and lets it run (once
    // its load has started).
    std::thread::sleep(Duration::from_millis((at + 300).saturating_sub(now_ms())));
    let busy = window(&node, &[t.id()], Duration::from_secs(1));
    assert!(busy[0] > 200_000_000, "tenant starved: {busy:?}");
    assert!(tenant(&d.api, &key(&c)).is_some());
    wait_for(
        "flood tenants to be dropped",
        Duration::from_secs(10),
        || {
            tenants(&d.api)
                .iter()
                .all(|t| !t["key"].as_str().unwrap_or("").starts_with("flood-"))
        },
    );
    let mut d = d;
    assert!(d.child.try_wait().expect("status").is_none(), "daemon died");
    // And a new tenant can still register and run.
    let c2 = container(50, "burst");
    let out = finish(node.tenant(&c2, &d.socket, &["init", "spin", "kernel", "4", "1000000"]));
    assert!(out.contains("spin=ok"), "{out}");
    finish(t);
}

#[test]
fn a_live_share_change_takes_effect() {
    let _serial = serial();
    let node = Node::new();
    let d = node.daemon(&[]);
    let at = now_ms() + 1500;
    let args = load_args(7, 1_000_000, at);
    let (c1, c2) = (container(50, "burst"), container(50, "burst"));
    let t1 = node.tenant(&c1, &d.socket, &strs(&args));
    let t2 = node.tenant(&c2, &d.socket, &strs(&args));
    std::thread::sleep(Duration::from_millis((at + 1000).saturating_sub(now_ms())));
    let before = window(&node, &[t1.id(), t2.id()], Duration::from_secs(1));
    let s_before = before[0] as f64 * 100.0 / (before[0] + before[1]).max(1) as f64;
    for (k, s) in [(key(&c1), "80"), (key(&c2), "20")] {
        let out = vgpuctl(&d.api, &["set", &k, "--share", s]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    std::thread::sleep(Duration::from_millis(100));
    let after = window(&node, &[t1.id(), t2.id()], Duration::from_secs(2));
    let s_after = after[0] as f64 * 100.0 / (after[0] + after[1]).max(1) as f64;
    assert!(
        (s_before - 50.0).abs() < 12.0,
        "before the change: {s_before:.1} %"
    );
    // The change takes effect: the split moves from about 50 to about 80 (how exactly,
    // and how fast, is measured by sched-bench: on saturated CPUs the 20 % tenant's
    // slices start cold and it fills them less well).
    assert!(
        (s_after - 80.0).abs() < 12.0 && s_after - s_before > 15.0,
        "after 50/50 → 80/20 the first tenant got {s_after:.1} % ({s_before:.1} % before)"
    );
    let t = tenant(&d.api, &key(&c1)).expect("listed");
    assert_eq!(t["gpus"][0]["share_pct"], 80);
    assert_eq!(t["gpus"][0]["source"], "api");
    // Bad values are refused, naming them.
    let out = vgpuctl(&d.api, &["set", &key(&c1), "--share", "0"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains('0'));
    finish(t1);
    finish(t2);
}

#[test]
fn trusted_mode_takes_the_share_from_the_quota_file_not_the_environment() {
    let _serial = serial();
    let node = Node::new();
    let c = container(100, "burst");
    let uuid = vgpu_core::gpu_uuid::format_uuid(&node.state().info(0).uuid);
    std::fs::create_dir_all(c.dir()).expect("container directory");
    let conf = c.dir().join("vgpu.conf");
    std::fs::write(
        &conf,
        format!(
            r#"{{"version":1,"namespace":"ml","pod":"nb","uid":"u","container":"main","init":false,
               "gpus":[{{"uuid":"{uuid}","memory_mib":2048,"compute_milli":300,"slices":3,"compute_policy":"cap"}}],
               "device_ids":[]}}"#
        ),
    )
    .expect("write quota file");
    // Outside a container /proc/PID/root is "/", so the in-container path is the host
    // path of this container's file.
    let d = node.daemon(&["--trusted-quota-file", conf.to_str().expect("utf-8")]);
    let t = node.tenant(
        &c,
        &d.socket,
        &["init", "spin", "kernel", "1", "1000", "sleep", "3000"],
    );
    wait_for("registration", Duration::from_secs(10), || {
        tenant(&d.api, "ml/nb/main").is_some()
    });
    let v = tenant(&d.api, "ml/nb/main").expect("listed");
    assert_eq!(v["gpus"][0]["share_pct"], 30, "{v}");
    assert_eq!(v["gpus"][0]["policy"], "cap", "{v}");
    assert_eq!(v["gpus"][0]["source"], "quota-file", "{v}");
    assert_eq!(v["pod"], "nb");
    finish(t);
}

#[test]
fn a_tenant_of_several_processes_shares_as_one() {
    let _serial = serial();
    let node = Node::new();
    let d = node.daemon(&[]);
    let at = now_ms() + 1500;
    let args = load_args(5, 1_000_000, at);
    // Two processes in one container (one tenant, 25 %), one process in another (75 %).
    let (c1, c2) = (container(25, "burst"), container(75, "burst"));
    let a1 = node.tenant(&c1, &d.socket, &strs(&args));
    let a2 = node.tenant(&c1, &d.socket, &strs(&args));
    let b = node.tenant(&c2, &d.socket, &strs(&args));
    std::thread::sleep(Duration::from_millis((at + 1000).saturating_sub(now_ms())));
    let busy = window(&node, &[a1.id(), a2.id(), b.id()], Duration::from_secs(3));
    let a = busy[0] + busy[1];
    let share_a = a as f64 * 100.0 / (a + busy[2]).max(1) as f64;
    assert!(
        (share_a - 25.0).abs() < 8.0,
        "the two-process 25 % tenant got {share_a:.1} % ({busy:?} ns)"
    );
    assert!(busy[0] > 0 && busy[1] > 0, "both processes ran: {busy:?}");
    let t = tenant(&d.api, &key(&c1)).expect("listed");
    assert_eq!(t["pids"].as_array().map(Vec::len), Some(2), "{t}");
    finish(a1);
    finish(a2);
    finish(b);
}

/// A tenant of two processes alone on the GPU: one saturates it, the other sends a
/// request (one 1 ms kernel, waited for) every 50 ms and yields the grant between them.
/// Each request must run promptly: a process that yielded the tenant's grant may not
/// launch under it again, and the tenant kept it while its sibling launched, renewed
/// slice after slice (nobody else waits), so the requests waited for the sibling's whole
/// load (the daemon now ends such a slice when the process asks again).
#[test]
fn a_paused_process_of_a_tenant_gets_back_in_beside_a_saturating_sibling() {
    let _serial = serial();
    let node = Node::new();
    let d = node.daemon(&[]);
    let c = container(50, "burst");
    let at = now_ms() + 1500;
    let load = load_args(4, 1_000_000, at);
    let busy = node.tenant(&c, &d.socket, &strs(&load));
    let requests = node.tenant(
        &c,
        &d.socket,
        &["init", "latency", "50", "1000000", "50000", &at.to_string()],
    );
    let out = finish(requests);
    finish(busy);
    let max_us = vgpu_tests::num(&out, "lat_max_us");
    eprintln!("figure: worst request latency beside a saturating sibling: {max_us} µs");
    assert!(
        max_us < 500_000,
        "a request of the paused process waited {max_us} µs beside its sibling's load"
    );
}

#[test]
fn operators_settings_survive_a_daemon_restart() {
    let _serial = serial();
    let node = Node::new();
    let state = node.dir.path().join("state.json");
    let state_arg = state.to_str().expect("utf-8").to_owned();
    let d = node.daemon(&["--state-file", &state_arg]);
    let (socket, api) = (d.socket.clone(), d.api.clone());
    let c = container(50, "burst");
    let t = node.tenant(
        &c,
        &socket,
        &["init", "spin", "kernel", "1", "1000", "sleep", "6000"],
    );
    wait_for("registration", Duration::from_secs(10), || {
        tenant(&api, &key(&c)).is_some()
    });
    let out = vgpuctl(&api, &["set", &key(&c), "--share", "35", "--policy", "cap"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    drop(d);
    let d2 = node.daemon_at(&socket, &api, &["--state-file", &state_arg]);
    wait_for("re-registration", Duration::from_secs(10), || {
        tenant(&d2.api, &key(&c)).is_some()
    });
    let v = tenant(&d2.api, &key(&c)).expect("listed");
    assert_eq!(v["gpus"][0]["share_pct"], 35, "{v}");
    assert_eq!(v["gpus"][0]["policy"], "cap", "{v}");
    assert_eq!(v["gpus"][0]["source"], "api", "{v}");
    finish(t);
    // A malformed state file stops the daemon with an error naming it.
    std::fs::write(&state, "{not json").expect("write");
    let out = Command::new(crate::daemon_bin())
        .args(["--ebpf", "off", "--ebpf-pin-dir", "off"])
        .args([
            "--socket",
            "/nonexistent/x.sock",
            "--state-file",
            &state_arg,
        ])
        .args([
            "--metrics-addr",
            "off",
            "--api-socket",
            "off",
            "--nvml-interval-ms",
            "0",
        ])
        .output()
        .expect("run vgpu-daemon");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("state.json"), "{err}");
}

/// A tenant that yields its slices when idle, beside one that keeps the GPU contended:
/// its idle yields and the daemon's revocations at slice ends cross now and then. A
/// process drains and reports each slice once: a revocation of a generation it already
/// yielded is not drained again (it logged the slice twice, and reported it twice).
#[test]
fn a_revocation_crossing_an_idle_yield_is_not_drained_twice() {
    use vgpu_tests::cpu_load::CpuLimited;
    if let Some(why) = CpuLimited::unavailable() {
        return vgpu_test_needs::skip(vgpu_test_needs::Need::CgroupV1Cpu, &why);
    }
    let _serial = serial();
    let node = Node::new();
    // A starved daemon (saturated CPUs besides) reads the yield's report late: the window
    // in which its revocation crosses the report is wider.
    let (d, _g) = node.starved_daemon("vgpu-test-crossing");
    let _hogs = vgpu_tests::cpu_load::CpuHogs::saturate().expect("CPU hogs");
    let at = now_ms() + 500;
    let at_s = at.to_string();
    let mut c = container(50, "burst");
    c.env.push(("VGPU_LOG".into(), "1".into()));
    let other = node.tenant(
        &container(50, "burst"),
        &d.socket,
        &strs(&load_args(4, 1_000_000, at)),
    );
    // Rounds of eight 1 ms kernels, synchronized, then 4 ms without a launch: the
    // process yields its slice 2 ms into the pause, about when the slice (10 ms) ends.
    let mut args = vec!["init", "at", &at_s];
    for _ in 0..120 {
        args.extend(["spin", "kernel", "8", "1000000", "sleep", "4"]);
    }
    let t = node.tenant(&c, &d.socket, &args);
    let (_, log) = finish_with_log(t);
    finish(other);
    let mut seen = HashMap::new();
    for l in log.lines() {
        if let Some(g) = l
            .split("GPU 0 slice ")
            .nth(1)
            .and_then(|r| r.split(':').next())
            .and_then(|g| g.parse::<u32>().ok())
        {
            *seen.entry(g).or_insert(0u32) += 1;
        }
    }
    let twice: Vec<_> = seen.iter().filter(|(_, n)| **n > 1).collect();
    eprintln!(
        "{} slices drained, {} of them more than once",
        seen.len(),
        twice.len()
    );
    assert!(seen.len() > 20, "too few slices to tell:\n{log}");
    assert!(
        twice.is_empty(),
        "slices drained more than once: {twice:?}\n{log}"
    );
}

/// Device-side gating (ADR 0034, `VGPU_DEVICE_GATE`): a tenant capped at 20 % turns from
/// 10 µs kernels to 400 of 5 ms beside a saturating neighbour. The host gate's count,
/// measured on the short kernels, let it queue about 200 of the long ones: one slice then
/// ran 1.2-1.3 s (stop 37, without it). With the device holding its runs (at most 8
/// launches each, the runs that started finish before the GPU is handed over), no slice
/// of it may last 300 ms, it stays under its cap over its run, the work held back at
/// each revocation completes after the next grant (its synchronization returns), and its
/// slices' reports charge what the device ran of it.
#[test]
fn a_capped_tenant_turning_to_long_kernels_is_held_on_the_device() {
    let _serial = serial();
    let node = Node::new();
    let d = node.daemon(&[]);
    let (neighbour, mut c) = gated_cap_beside_a_neighbour(&node, &d, 14);
    c.env.push(("VGPU_LOG".into(), "1".into()));
    let t = node.tenant(
        &c,
        &d.socket,
        &[
            "init", "spin", "kernel", "2000", "10000", "spin", "kernel", "400", "5000000",
        ],
    );
    let pid = t.id();
    let (out, log) = finish_with_log(t);
    let busy = node.busy().get(&pid).copied().unwrap_or(0);
    let mut neighbour = neighbour;
    let _ = neighbour.kill();
    let _ = neighbour.wait();
    let wall_us: u64 = out
        .split_whitespace()
        .filter_map(|w| w.strip_prefix("wall_us="))
        .filter_map(|v| v.parse::<u64>().ok())
        .sum();
    let longest_us = log
        .split("held ")
        .skip(1)
        .filter_map(|s| s.split(' ').next()?.parse::<u64>().ok())
        .max()
        .unwrap_or(0);
    // What its slices' reports charged (µs each), against what the device ran of it.
    let charged_us: u64 = log
        .split("busy Some(")
        .skip(1)
        .filter_map(|s| s.split(')').next()?.parse::<u64>().ok())
        .sum();
    let charged = charged_us as f64 * 1000.0 / busy.max(1) as f64;
    let frac = busy as f64 / (wall_us.max(1) as f64 * 1000.0);
    eprintln!(
        "capped tenant: {:.1} % of the GPU over {wall_us} µs, longest slice {longest_us} µs, charged {:.3} of its device time",
        frac * 100.0,
        charged
    );
    assert!(
        busy >= 2_000_000_000,
        "only {busy} ns of its 2.02 s ran ({out})"
    );
    assert!(
        longest_us < 300_000,
        "a slice of the capped tenant lasted {longest_us} µs ({out})\n{log}"
    );
    // The cap and 10 points (20.0–24.6 % measured; the bound was 35 %, then 40 %, before
    // issue 38).
    assert!(
        frac < 0.30,
        "{:.0} % of the GPU under a 20 % cap ({out})\n{log}",
        frac * 100.0
    );
    // Every run timed and marked (ADR 0034, stop 39): before, runs held back at a
    // revocation were charged at the short kernels' time, and runs queued without
    // markers not at all (0.52-0.76 of its device time charged).
    assert!(
        (0.9..=1.1).contains(&charged),
        "its slices charged {charged:.3} of the {busy} ns it ran ({out})\n{log}"
    );
}

/// Device-side gating: work held back on the device at a revocation waits for the next
/// grant; if the daemon dies instead, or freezes, the process falls back and opens the
/// device for good, and its work completes (the daemon killed, or stopped, while the
/// capped tenant's long kernels are held back; without the fallback's opening, or the
/// frozen daemon's ping while only the device waits, it waited until the 60 s bound).
#[test]
fn work_held_back_on_the_device_completes_when_the_daemon_dies() {
    let _serial = serial();
    held_back_work_completes_without_the_daemon("-KILL");
}

/// [`work_held_back_on_the_device_completes_when_the_daemon_dies`], the daemon frozen:
/// the tenant has no launch blocked (it synchronizes), yet it pings the daemon and falls
/// back after the peer deadline (ADR 0016).
#[test]
fn work_held_back_on_the_device_completes_when_the_daemon_freezes() {
    let _serial = serial();
    held_back_work_completes_without_the_daemon("-STOP");
}

fn held_back_work_completes_without_the_daemon(sig: &str) {
    let node = Node::new();
    let d = node.daemon(&[]);
    let (neighbour, c) = gated_cap_beside_a_neighbour(&node, &d, 8);
    // The short kernels raise the queue-ahead count: the 40 long ones are then all
    // queued at once, and the application waits in its synchronization, not in a launch.
    let mut t = node.tenant(
        &c,
        &d.socket,
        &[
            "init", "spin", "kernel", "2000", "10000", "spin", "kernel", "40", "5000000",
        ],
    );
    let pid = t.id();
    std::thread::sleep(Duration::from_millis(400));
    signal(d.child.id(), sig);
    let t0 = Instant::now();
    // Work left behind a closed device-side word would never complete: bounded here.
    while !matches!(t.try_wait(), Ok(Some(_))) {
        if t0.elapsed() > Duration::from_secs(60) {
            let _ = t.kill();
            signal(d.child.id(), "-CONT");
            panic!("the tenant did not finish within 60 s of the daemon's {sig}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    signal(d.child.id(), "-CONT");
    let (out, log) = finish_with_log(t);
    let mut neighbour = neighbour;
    let _ = neighbour.kill();
    let _ = neighbour.wait();
    let busy = node.busy().get(&pid).copied().unwrap_or(0);
    assert!(out.contains("spin=ok"), "{out}\n{log}");
    assert!(
        busy >= 220_000_000,
        "only {busy} ns of its 220 ms ran\n{log}"
    );
    // It falls back when its work was held back at the signal (most runs); a tenant
    // that held the GPU then may finish before it would need the daemon again.
    eprintln!(
        "finished {:.1} s after the daemon's {sig}; fell back: {}",
        t0.elapsed().as_secs_f64(),
        log.contains("enforced locally")
    );
}

/// A saturating 80 % neighbour (1 ms kernels for `secs` seconds, from one second on) and,
/// once it runs, the container of a tenant capped at 20 % with device-side gating
/// (N = 8) to start beside it.
fn gated_cap_beside_a_neighbour(node: &Node, d: &Daemon, secs: u64) -> (Child, Container) {
    let at = now_ms() + 1000;
    let neighbour = node.tenant(
        &container(80, "burst"),
        &d.socket,
        &strs(&load_args(secs, 1_000_000, at)),
    );
    let mut c = container(20, "cap");
    c.env.push(("VGPU_DEVICE_GATE".into(), "8".into()));
    std::thread::sleep(Duration::from_millis(at.saturating_sub(now_ms())));
    (neighbour, c)
}
