//! The node daemon with its eBPF GPU device gate and exit watcher, on the real kernel, with
//! real processes on cuda-sim (whose `cuInit`/`nvmlInit` open the node's device nodes, made
//! with mknod under its state directory). The gate covers a cgroup2 child made for each
//! test; the processes under test are moved into it; this test process stays outside.
//! Needs root, BTF, cgroup2 and tracefs: a recorded skip without them (`vgpu-test-needs`),
//! a failure instead under `CI=true`. Nothing is pinned; everything detaches when the daemon is
//! dropped.

#![allow(clippy::unwrap_used)] // test code: a failed step is the failure

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use vgpu_daemon::enforcement::EbpfSettings;
use vgpu_ebpf::Mode;
use vgpu_tests::{Container, Probe, SimNode, probe_bin, shim_lib};

use super::common;

const NODE: &str =
    "[[device]]\nuuid = \"GPU-eb0f0000-0000-4000-8000-00000000ca7e\"\nmemory = \"8Gi\"\n";

/// The cgroup2 mount when this machine can run the test; a recorded skip (a failure under
/// `CI=true`) otherwise.
fn ebpf_ready(sim: &SimNode) -> Option<PathBuf> {
    let why = (|| {
        vgpu_ebpf::preflight::check_capabilities().map_err(|e| e.to_string())?;
        vgpu_ebpf::preflight::check_btf().map_err(|e| e.to_string())?;
        vgpu_ebpf::preflight::check_tracefs().map_err(|e| e.to_string())?;
        let mounts = std::fs::read_to_string("/proc/self/mounts").map_err(|e| e.to_string())?;
        let root = vgpu_ebpf::preflight::cgroup2_mount(&mounts)
            .ok_or("no cgroup2 mount in /proc/self/mounts")?;
        // The simulator's device nodes (made by its first cuInit otherwise).
        match vgpu_cuda_sim::devnodes::ensure(&sim.state_dir(), 1) {
            Ok(true) => Ok(PathBuf::from(root)),
            Ok(false) => Err("mknod is not permitted: the simulator has no device nodes".into()),
            Err(e) => Err(format!("cannot make the simulator's device nodes: {e}")),
        }
    })();
    match why {
        Ok(root) => Some(root),
        Err(reason) => {
            vgpu_test_needs::skip(vgpu_test_needs::Need::Ebpf, &reason);
            None
        }
    }
}

/// A cgroup2 child directory, removed when dropped (its processes gone by then).
struct Cgroup(PathBuf);

impl Cgroup {
    fn new(root: &Path, test: &str) -> Cgroup {
        let dir = root.join(format!("vgpu-test-{test}-{}", std::process::id()));
        std::fs::create_dir(&dir).unwrap();
        Cgroup(dir)
    }

    /// `program` started inside this cgroup (a shell moves itself in, then execs it).
    fn command(&self, sim: &SimNode, program: &Path) -> Command {
        command_in(&self.0, sim, program)
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        remove_cgroup_tree(&self.0);
    }
}

/// Removes a cgroup2 directory and the ones below it, deepest first (each once its
/// processes are gone).
fn remove_cgroup_tree(dir: &Path) {
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                remove_cgroup_tree(&e.path());
            }
        }
    }
    for _ in 0..100 {
        if std::fs::remove_dir(dir).is_ok() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `program` started inside cgroup2 directory `dir`.
fn command_in(dir: &Path, sim: &SimNode, program: &Path) -> Command {
    let mut c = sim.command("sh");
    c.arg("-c")
        .arg(r#"echo $$ > "$0/cgroup.procs" && shift && exec "$@""#)
        .arg(dir)
        .arg("--")
        .arg(program);
    c
}

fn settings(mode: Mode, cgroup: &Cgroup, sim: &SimNode) -> EbpfSettings {
    EbpfSettings {
        mode,
        cgroup_root: Some(cgroup.0.clone()),
        pin_dir: None,
        dev_dir: vgpu_cuda_sim::devnodes::node_dir(&sim.state_dir()),
        trusted_cgroups: Vec::new(),
        ..EbpfSettings::default()
    }
}

/// Runs `cmd` to its end; its stdout and stderr together.
fn run(mut cmd: Command) -> String {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .expect("run the process in the cgroup");
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enforce_lets_the_shims_processes_through_and_refuses_the_others() {
    let sim = SimNode::new(NODE);
    let Some(root) = ebpf_ready(&sim) else {
        return;
    };
    let cg = Cgroup::new(&root, "enforce");
    let host = tempfile::tempdir().unwrap();
    let socket = host.path().join("daemon.sock");
    let served = common::daemon::serve_with_ebpf(&socket, settings(Mode::Enforce, &cg, &sim)).await;
    let gate = served.enforcement.clone().expect("the gate attached");
    let who = format!("cgroup /{}", cg.0.strip_prefix(&root).unwrap().display());

    // Under the shim: CUDA and NVML work (the shim asked the daemon before the driver
    // opened its nodes).
    let container = Container::new("1Gi").with("VGPU_DAEMON_SOCKET", &socket.to_string_lossy());
    let mut cmd = cg.command(&sim, &probe_bin());
    container.apply(&mut cmd);
    cmd.args(["init", "alloc", "64Mi", "nvml"]);
    let out = run(cmd);
    assert!(out.contains("alloc=ok"), "CUDA under the shim: {out}");
    assert!(out.contains("nvml_total="), "NVML under the shim: {out}");
    assert_eq!(gate.opens_of(&who), (0, 0), "nothing refused: {out}");

    // Without the shim: cuInit and nvmlInit fail with the codes NVIDIA's libraries give
    // for a refused node (999), each refusal counted once for the cgroup.
    let mut cmd = cg.command(&sim, &probe_bin());
    cmd.arg("init");
    let out = run(cmd);
    assert!(out.contains("999"), "cuInit without the shim: {out}");
    let mut cmd = cg.command(&sim, &probe_bin());
    cmd.arg("nvml");
    let out = run(cmd);
    assert!(
        out.contains("nvmlInit_v2 failed with 999"),
        "nvmlInit without the shim: {out}"
    );
    // A client that opens the device node itself (as a raw-ioctl client does).
    let node = vgpu_cuda_sim::devnodes::node_dir(&sim.state_dir()).join("nvidia0");
    let mut cmd = cg.command(&sim, Path::new("/bin/sh"));
    cmd.arg("-c").arg(r#"exec 3<>"$0""#).arg(&node);
    let out = run(cmd);
    assert!(
        out.contains("not permitted"),
        "a raw open of {}: {out}",
        node.display()
    );
    let end = Instant::now() + Duration::from_secs(5);
    while gate.opens_of(&who).0 < 3 && Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        gate.opens_of(&who),
        (3, 0),
        "one refusal each, named by the cgroup"
    );
    let metrics = gate.metrics();
    assert!(
        metrics.contains(&format!(
            "vgpu_ebpf_refused_opens_total{{pod_uid=\"\",cgroup=\"{}\"}} 3",
            who.trim_start_matches("cgroup ")
        )),
        "{metrics}"
    );
    assert!(
        metrics.contains("vgpu_ebpf_program_attached{program=\"gpu_gate\",mode=\"enforce\"} 1"),
        "{metrics}"
    );

    // The same three refusals on the API's event stream, as `vgpuctl events` shows them
    // (counted above, so published already).
    let out = vgpuctl_events(&socket).await;
    let cgroup = who.trim_start_matches("cgroup ");
    let refused: Vec<&str> = out.lines().filter(|l| l.contains("REFUSED")).collect();
    assert_eq!(refused.len(), 3, "{out}");
    for line in &refused {
        assert!(line.contains(&format!("of cgroup {cgroup}")), "{line}");
        assert!(line.contains("open of GPU device 195:"), "{line}");
    }
    assert!(refused[2].contains("(sh)"), "the raw open's comm: {out}");
}

/// `vgpuctl events` (the events the daemon serving `socket` kept) as it prints them.
async fn vgpuctl_events(socket: &Path) -> String {
    let cli = vgpu_daemon::ctl::Cli {
        api_socket: common::daemon::api_socket(socket),
        api_addr: None,
        json: false,
        command: vgpu_daemon::ctl::Command::Events {
            follow: false,
            recent: None,
        },
    };
    vgpu_daemon::ctl::run(&cli).await.expect("vgpuctl events")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn audit_allows_every_open_and_counts_what_enforce_would_refuse() {
    let sim = SimNode::new(NODE);
    let Some(root) = ebpf_ready(&sim) else {
        return;
    };
    let cg = Cgroup::new(&root, "audit");
    let host = tempfile::tempdir().unwrap();
    let socket = host.path().join("daemon.sock");
    let served = common::daemon::serve_with_ebpf(&socket, settings(Mode::Audit, &cg, &sim)).await;
    let gate = served.enforcement.clone().expect("the gate attached");
    let who = format!("cgroup /{}", cg.0.strip_prefix(&root).unwrap().display());
    let mut cmd = cg.command(&sim, &probe_bin());
    cmd.args(["init", "alloc", "64Mi", "nvml"]);
    let out = run(cmd);
    assert!(
        out.contains("alloc=ok") && out.contains("nvml_total="),
        "audit allows: {out}"
    );
    // Every node cuInit opens, then every node nvmlInit opens, each reported once: CUDA
    // opens them all, NVML all but the UVM nodes, as NVIDIA's (a container given only
    // the `utility` capability, nvidia-smi's, gets no UVM node from libnvidia-container:
    // "Only compute libraries require specific devices (e.g. UVM)", nvc_mount.c).
    let nodes = vgpu_cuda_sim::devnodes::nodes(1, 0);
    let nvml = nodes
        .iter()
        .filter(|n| !n.name.starts_with("nvidia-uvm"))
        .count();
    let expected = (nodes.len() + nvml) as u64;
    let end = Instant::now() + Duration::from_secs(5);
    while gate.opens_of(&who).1 < expected && Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        gate.opens_of(&who),
        (0, expected),
        "the would-be refusals of cuInit and nvmlInit are reported"
    );
}

/// Python with cuda-python and nvidia-ml-py (installed by `.ci/run`), or why not.
fn python_clients() -> Result<(), String> {
    let ok = Command::new("python3")
        .args(["-c", "import cuda.bindings.driver, pynvml"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if ok {
        Ok(())
    } else {
        Err("python3 with cuda-python and nvidia-ml-py is not installed".into())
    }
}

/// A tenant that initialises CUDA, registers (first context), then forks a child that
/// inherits its daemon socket and, in `nvml_in_child` mode, initialises NVML itself.
const FORKING_TENANT: &str = r#"
import os, sys, time
from cuda.bindings import driver as cu
def ck(r):
    if r[0] != cu.CUresult.CUDA_SUCCESS:
        print(f"error {r[0]}", flush=True); sys.exit(1)
    return r[1] if len(r) == 2 else r[1:]
ck(cu.cuInit(0) + (None,))
dev = ck(cu.cuDeviceGet(0))
ctx = ck(cu.cuDevicePrimaryCtxRetain(dev))
ck(cu.cuCtxSetCurrent(ctx) + (None,))
ck(cu.cuMemAlloc(64 << 20))
child = os.fork()
if child == 0:
    if sys.argv[1] == "nvml_in_child":
        import pynvml
        try:
            pynvml.nvmlInit()
            n = pynvml.nvmlDeviceGetCount()
            print(f"child nvml=ok count={n}", flush=True)
        except pynvml.NVMLError as e:
            print(f"child nvml=err {e}", flush=True)
    time.sleep(120)
    os._exit(0)
print(f"ready parent={os.getpid()} child={child}", flush=True)
time.sleep(120)
"#;

fn field_u32(line: &str, key: &str) -> u32 {
    vgpu_tests::field(line, key).unwrap().parse().unwrap()
}

/// Waits (bounded) until the daemon holds a process `pid` or, with `gone`, no longer does.
async fn wait_registered(daemon: &vgpu_daemon::daemon::Daemon, pid: u32, gone: bool) -> bool {
    let end = Instant::now() + Duration::from_secs(30);
    loop {
        let held = daemon
            .snapshot()
            .tenants
            .iter()
            .any(|t| t.pids.contains(&pid));
        if held != gone {
            return true;
        }
        if Instant::now() > end {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forked_child_registers_as_itself_and_a_killed_tenant_is_released_at_once() {
    let sim = SimNode::new(NODE);
    let Some(root) = ebpf_ready(&sim) else {
        return;
    };
    if let Err(why) = python_clients() {
        let need = vgpu_test_needs::Need::Python("cuda.bindings, pynvml");
        return vgpu_test_needs::skip(need, &why);
    }
    let host = tempfile::tempdir().unwrap();
    let tenant = |cg: &Cgroup, socket: &Path, mode: &str| {
        let container = Container::new("1Gi").with("VGPU_DAEMON_SOCKET", &socket.to_string_lossy());
        let mut cmd = cg.command(&sim, Path::new("python3"));
        container.apply(&mut cmd);
        cmd.env("LD_PRELOAD", shim_lib())
            .args(["-c", FORKING_TENANT, mode]);
        Probe::start(cmd, &[], Duration::from_secs(60))
    };

    // Without eBPF the daemon learns of the parent's death only from its socket, which
    // the child still holds: the tenant stays registered.
    let cg_off = Cgroup::new(&root, "fork-off");
    let socket_off = host.path().join("off.sock");
    let served = common::daemon::serve(&socket_off).await;
    let t = tenant(&cg_off, &socket_off, "sleep");
    let ready = t.seen.last().unwrap().clone();
    let (parent, child) = (field_u32(&ready, "parent"), field_u32(&ready, "child"));
    assert!(wait_registered(&served.daemon, parent, false).await);
    sigkill(parent);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        served
            .daemon
            .snapshot()
            .tenants
            .iter()
            .any(|t| t.pids.contains(&parent)),
        "without eBPF the killed tenant stays while its child holds the socket (the case the exit watcher exists for)"
    );
    sigkill(child);
    t.kill9();
    drop(served);

    // With the gate (enforce): the child initialises NVML as itself (admitted by its own
    // PID), and the parent's SIGKILL releases its slices at once.
    let cg = Cgroup::new(&root, "fork-enforce");
    let socket = host.path().join("daemon.sock");
    let served = common::daemon::serve_with_ebpf(&socket, settings(Mode::Enforce, &cg, &sim)).await;
    let mut t = tenant(&cg, &socket, "nvml_in_child");
    let ready = t.seen.last().unwrap().clone();
    let (parent, child) = (field_u32(&ready, "parent"), field_u32(&ready, "child"));
    assert!(wait_registered(&served.daemon, parent, false).await);
    let line = t
        .next_line(Duration::from_secs(30))
        .expect("the child's NVML line");
    assert!(
        line.starts_with("child nvml=ok count=1"),
        "a forked child doing NVML under enforce: {line}"
    );
    let killed = Instant::now();
    sigkill(parent);
    assert!(
        wait_registered(&served.daemon, parent, true).await,
        "the killed tenant is released although its child holds the socket"
    );
    let released = killed.elapsed();
    println!(
        "FIGURE exit release: a SIGKILLed tenant whose child holds its socket released {:.2} ms after kill(2)",
        released.as_secs_f64() * 1e3
    );
    assert!(released < Duration::from_secs(2), "{released:?}");
    sigkill(child);
    t.kill9();
}

#[allow(unsafe_code)]
fn sigkill(pid: u32) {
    let pid = libc::pid_t::try_from(pid).unwrap();
    // SAFETY: kill(2) with a PID this test started and SIGKILL; no memory is involved.
    let r = unsafe { libc::kill(pid, libc::SIGKILL) };
    assert_eq!(r, 0, "kill -9 {pid}");
}

/// A pod's cgroup and container, as kubelet and containerd lay them out (cgroupfs driver),
/// under the gate's test cgroup.
const POD_UID: &str = "7e57ab1e-0000-4000-8000-00000000e13f";
const CONTAINER_ID: &str = "c0ffee00d15ea5e0000000000000000000000000000000000000000000000013";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_open_in_a_pod_is_posted_on_the_pod_once_per_process_across_a_daemon_restart() {
    let sim = SimNode::new(NODE);
    let Some(root) = ebpf_ready(&sim) else {
        return;
    };
    let cg = Cgroup::new(&root, "plugin");
    let container =
        cg.0.join(format!("kubepods/burstable/pod{POD_UID}/{CONTAINER_ID}"));
    std::fs::create_dir_all(&container).unwrap();
    let host = tempfile::tempdir().unwrap();
    let socket = host.path().join("daemon.sock");
    let served = common::daemon::serve_with_ebpf(&socket, settings(Mode::Enforce, &cg, &sim)).await;

    // The device plugin, following the daemon's API socket, with the pod in its watch.
    let api_socket = common::daemon::api_socket(&socket);
    let node = vgpu_testkit::node::TestNode::start_with(vgpu_testkit::node::gpus(1, 8192), |c| {
        c.daemon_api_socket = Some(api_socket.clone());
    })
    .await
    .expect("the plugin's node");
    let mut pod =
        vgpu_testkit::node::pod_json("ml", "escaper", POD_UID, 0, &[("main", false, vec![])]);
    pod["status"]["containerStatuses"] = serde_json::json!([{
        "name": "main", "containerID": format!("containerd://{CONTAINER_ID}"),
        "image": "x", "imageID": "x", "ready": true, "restartCount": 0,
    }]);
    node.put_pod(pod).await.unwrap();
    let subscribed = |served: &common::daemon::Served| {
        served
            .enforcement
            .as_ref()
            .is_some_and(|e| e.events().subscribers() > 0)
    };
    wait_until("the plugin follows the daemon's events", || {
        subscribed(&served)
    })
    .await;

    // A process of the pod's container opens the GPU node five times, refused each time.
    let node_path = vgpu_cuda_sim::devnodes::node_dir(&sim.state_dir()).join("nvidia0");
    let refused_five_times = || {
        let mut cmd = command_in(&container, &sim, Path::new("/bin/sh"));
        cmd.arg("-c")
            .arg(r#"for i in 1 2 3 4 5; do true 3<>"$0"; done; echo done"#)
            .arg(&node_path);
        let out = run(cmd);
        assert_eq!(out.matches("not permitted").count(), 5, "{out}");
    };
    let posted = |n: usize| {
        let events: Vec<serde_json::Value> = node
            .api
            .events()
            .into_iter()
            .filter(|e| e["reason"] == vgpu_device_plugin::gate_events::EVENT_REFUSED)
            .collect();
        (events.len() >= n).then_some(events)
    };
    refused_five_times();
    let events = wait_for("the plugin's first event", || posted(1)).await;
    let e = &events[0];
    assert_eq!(e["type"], "Warning");
    assert_eq!(e["involvedObject"]["kind"], "Pod");
    assert_eq!(e["involvedObject"]["namespace"], "ml");
    assert_eq!(e["involvedObject"]["name"], "escaper");
    assert_eq!(e["involvedObject"]["uid"], POD_UID);
    assert_eq!(e["involvedObject"]["fieldPath"], "spec.containers{main}");
    let message = e["message"].as_str().unwrap();
    assert!(
        message.contains("(sh) of container \"main\" was refused access to GPU device 195:"),
        "{message}"
    );

    // vgpuctl names the pod by its UID and the container by its id (the daemon has no
    // registered process of the pod to learn its names from).
    let mut out = String::new();
    for _ in 0..100 {
        out = vgpuctl_events(&socket).await;
        if out.matches("REFUSED").count() >= 5 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let lines: Vec<&str> = out.lines().filter(|l| l.contains("REFUSED")).collect();
    assert_eq!(lines.len(), 5, "{out}");
    assert!(
        lines[0].contains(&format!(
            "of pod uid {POD_UID} container id {}",
            &CONTAINER_ID[..12]
        )),
        "{out}"
    );

    // A second process: a second event; never one per refused open.
    refused_five_times();
    wait_for("the plugin's second event", || posted(2)).await;

    // The daemon restarts: the plugin reconnects, nothing is posted twice, and the next
    // refused process is posted.
    drop(served);
    let served = common::daemon::serve_with_ebpf(&socket, settings(Mode::Enforce, &cg, &sim)).await;
    wait_until("the plugin follows the restarted daemon", || {
        subscribed(&served)
    })
    .await;
    refused_five_times();
    let events = wait_for("the plugin's third event", || posted(3)).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        posted(1).unwrap().len(),
        3,
        "one event per process: {events:#?}"
    );
}

async fn wait_until(what: &str, mut ok: impl FnMut() -> bool) {
    wait_for(what, || ok().then_some(())).await;
}

/// Polls `f` (at most 10 s) until it gives a value.
async fn wait_for<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < end, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
