//! `cargo xtask demo`: vgpu's node daemon sharing one simulated GPU between four tenants,
//! each a real CUDA process under the shim (`libvgpu.so`), with different compute shares,
//! policies and memory quotas.
//!
//! The demo starts `vgpu-daemon` on a fresh simulated node and four `cuda-probe`
//! processes, each with its own container directory, `LD_PRELOAD=libvgpu.so` and its
//! settings in the shim's environment (standalone mode). Three saturate GPU 0 with 1 ms
//! kernels; the fourth tries to allocate beyond its memory quota and gets
//! `CUDA_ERROR_OUT_OF_MEMORY`. It then measures, over fixed windows, each tenant's share
//! of the GPU's time twice: from the simulated driver's own per-process device-time
//! counters (read through NVML by `vgpu-smi`: the ground truth) and from what the daemon
//! charged (`vgpuctl`), and prints them side by side with the memory quota and use. Then
//! one tenant leaves (the `burst` tenant takes its time, the `cap` tenant does not) and a
//! share is changed live with `vgpuctl set`. No figure is scripted: every one is read from
//! the simulator or the daemon in this run. Every child process (daemon and tenants) is
//! killed and reaped when the demo ends, on success or error.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};
use serde_json::Value;

const CONFIG: &str = r#"# The demo node: two GPUs of different models.
[[device]]
name = "NVIDIA H100 80GB HBM3"
memory = "80Gi"
sm_count = 132
compute_capability = "9.0"
context_overhead = "300Mi"

[[device]]
name = "NVIDIA A100-SXM4-40GB"
memory = "40Gi"
sm_count = 108
compute_capability = "8.0"
context_overhead = "300Mi"
"#;

/// Device time of each kernel the busy tenants launch: 1 ms.
const KERNEL_NS: u64 = 1_000_000;
/// NVML's per-process samples cover the last 1.5 s (15 buckets of 100 ms); sampling at
/// this period tiles a window without gaps or overlaps.
const SAMPLE_S: f64 = 1.5;

/// The timeline, in seconds after the busy tenants start launching (`t = 0`). Every
/// window ends at least 0.5 s before a tenant stops, so that none leaves mid-reading.
mod at {
    /// Phase 1 (A, B and C saturate the GPU): measured over [0.5, 9.5).
    pub const P1: (f64, usize) = (0.5, 6);
    /// The greedy tenant starts after this many samples of phase 1.
    pub const GREEDY_AFTER_SAMPLE: usize = 1;
    /// train-b stops launching.
    pub const B_ENDS: u64 = 10;
    /// Phase 2 (A and C): measured over [10.5, 13.5).
    pub const P2: (f64, usize) = (10.5, 2);
    /// The live share change.
    pub const CHANGE: f64 = 13.5;
    /// Phase 3 (A and C, C's share raised): measured over [14, 17).
    pub const P3: (f64, usize) = (14.0, 2);
    /// A and C stop launching.
    pub const END: u64 = 18;
}

/// A tenant: its name (the daemon's tenant key, `VGPU_TENANT`), settings and workload.
struct Spec {
    name: &'static str,
    share: u32,
    policy: &'static str,
    quota: &'static str,
    /// What the tenant does, for the reader.
    what: &'static str,
}

const NOTEBOOK: Spec = Spec {
    name: "notebook-a",
    share: 20,
    policy: "burst",
    quota: "4Gi",
    what: "allocates 3 GiB, launches 1 ms kernels non-stop for 18 s",
};
const TRAIN: Spec = Spec {
    name: "train-b",
    share: 50,
    policy: "burst",
    quota: "16Gi",
    what: "allocates 12 GiB, launches 1 ms kernels non-stop for 10 s",
};
const BATCH: Spec = Spec {
    name: "batch-c",
    share: 30,
    policy: "cap",
    quota: "8Gi",
    what: "allocates 6 GiB, launches 1 ms kernels non-stop for 18 s",
};
const GREEDY: Spec = Spec {
    name: "greedy-d",
    share: 10,
    policy: "burst",
    quota: "2Gi",
    what: "starts at t = 2 s, allocates 1.5 GiB, then 1 GiB more (over its quota); idle",
};

/// greedy-d's `cuda-probe` commands (then `ready wait`), each with what it does.
const GREEDY_SCRIPT: [(&str, &str); 6] = [
    ("init", "cuInit, primary context"),
    ("alloc 1536Mi", "cuMemAlloc 1.5 GiB"),
    ("meminfo", "cuMemGetInfo"),
    ("alloc 1Gi", "cuMemAlloc 1 GiB more"),
    ("meminfo", "cuMemGetInfo"),
    (
        "spin kernel 1 1000",
        "one 1 µs kernel (registers it with the daemon)",
    ),
];

fn now_ms() -> Result<u64> {
    Ok(SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .context("the system clock is before 1970")?
        .as_millis() as u64)
}

/// A fresh simulated node: a temporary state directory and the device configuration.
struct Node {
    dir: tempfile::TempDir,
    libs: PathBuf,
    bin: PathBuf,
}

impl Node {
    /// `program` from the release binaries, on the simulated node.
    fn command(&self, program: &str) -> Command {
        let mut c = Command::new(self.bin.join(program));
        c.env("LD_LIBRARY_PATH", &self.libs)
            .env("VGPU_SIM_DIR", self.dir.path().join("state"))
            .env("VGPU_SIM_CONFIG", self.dir.path().join("config.toml"));
        c
    }

    fn daemon_socket(&self) -> PathBuf {
        self.dir.path().join("daemon.sock")
    }

    fn api_socket(&self) -> PathBuf {
        self.dir.path().join("api.sock")
    }

    fn daemon_log(&self) -> PathBuf {
        self.dir.path().join("daemon.log")
    }

    /// The last lines of the daemon's log, for error messages.
    fn daemon_log_tail(&self) -> String {
        let text = std::fs::read_to_string(self.daemon_log()).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(15)..].join("\n")
    }

    /// The output of a command that must succeed.
    fn output(&self, mut cmd: Command) -> Result<String> {
        let out = cmd.output().with_context(|| format!("run {cmd:?}"))?;
        if !out.status.success() {
            bail!(
                "{cmd:?} failed with {}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        String::from_utf8(out.stdout).with_context(|| format!("{cmd:?} printed non-UTF-8"))
    }

    /// `vgpuctl` with the daemon's API socket and `args`.
    fn vgpuctl(&self, args: &[&str]) -> Result<String> {
        let mut c = self.command("vgpuctl");
        c.arg("--api-socket").arg(self.api_socket()).args(args);
        self.output(c)
    }

    /// The daemon's view of each tenant on GPU `uuid` (`vgpuctl --json tenants`).
    fn daemon_view(&self, uuid: &str) -> Result<HashMap<String, DaemonTenant>> {
        let text = self.vgpuctl(&["--json", "tenants"])?;
        let v: Value = serde_json::from_str(&text)
            .with_context(|| format!("parse `vgpuctl --json tenants`: {text}"))?;
        let mut out = HashMap::new();
        for t in v["tenants"].as_array().into_iter().flatten() {
            let key = t["key"].as_str().context("a tenant without a key")?;
            let Some(g) = t["gpus"]
                .as_array()
                .and_then(|gs| gs.iter().find(|g| g["uuid"] == uuid))
            else {
                continue;
            };
            let num = |f: &str| {
                g[f].as_u64()
                    .with_context(|| format!("tenant {key}: no {f} in {g}"))
            };
            out.insert(
                key.to_owned(),
                DaemonTenant {
                    share: num("share_pct")?,
                    policy: g["policy"].as_str().unwrap_or("?").to_owned(),
                    gpu_time_ns: num("gpu_time_ns")?,
                    memory_used: num("memory_used_bytes")?,
                    memory_quota: g["memory_quota_bytes"].as_u64(),
                },
            );
        }
        Ok(out)
    }

    /// GPU 0 as NVML shows it (`vgpu-smi --json`).
    fn nvml_gpu0(&self) -> Result<NvmlGpu> {
        let text = self.output({
            let mut c = self.command("vgpu-smi");
            c.arg("--json");
            c
        })?;
        let v: Value = serde_json::from_str(&text)
            .with_context(|| format!("parse `vgpu-smi --json`: {text}"))?;
        let g = &v["gpus"][0];
        let uuid = g["uuid"]
            .as_str()
            .with_context(|| format!("vgpu-smi shows no GPU 0: {text}"))?
            .to_owned();
        let mut procs = HashMap::new();
        for p in g["processes"].as_array().into_iter().flatten() {
            let pid = p["pid"].as_u64().context("a process without a pid")? as u32;
            procs.insert(
                pid,
                (
                    p["sm_pct"].as_u64().map(|x| x as f64),
                    p["memory_used"].as_u64(),
                ),
            );
        }
        Ok(NvmlGpu {
            uuid,
            name: g["name"].as_str().unwrap_or("?").to_owned(),
            procs,
        })
    }
}

/// One tenant on one GPU as the daemon reports it.
struct DaemonTenant {
    share: u64,
    policy: String,
    gpu_time_ns: u64,
    memory_used: u64,
    memory_quota: Option<u64>,
}

/// GPU 0 as NVML reports it: per pid, SM utilization over the last 1.5 s (percent of
/// the GPU's time) and memory.
struct NvmlGpu {
    uuid: String,
    name: String,
    procs: HashMap<u32, (Option<f64>, Option<u64>)>,
}

/// A running tenant.
struct Tenant {
    spec: &'static Spec,
    pid: u32,
    /// The lines it printed before `ready`.
    said: Vec<String>,
}

/// Every child of the demo: each is killed (SIGKILL) and reaped when this is dropped,
/// youngest first, so no process outlives the demo, whatever path it leaves by.
#[derive(Default)]
struct Children {
    running: Vec<(String, Child, Option<ChildStdin>)>,
}

impl Drop for Children {
    fn drop(&mut self) {
        while let Some((_, mut child, stdin)) = self.running.pop() {
            drop(stdin);
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Children {
    /// Starts the daemon and waits until both of its sockets exist.
    fn daemon(&mut self, node: &Node) -> Result<u32> {
        let log = std::fs::File::create(node.daemon_log())
            .with_context(|| format!("create {}", node.daemon_log().display()))?;
        let mut c = node.command("vgpu-daemon");
        // The demo is about sharing; it leaves nothing attached or pinned behind.
        c.args(["--ebpf", "off", "--ebpf-pin-dir", "off"])
            .arg("--socket")
            .arg(node.daemon_socket())
            .arg("--api-socket")
            .arg(node.api_socket())
            .args(["--metrics-addr", "off", "--nvml-lib"])
            .arg(node.libs.join("libnvidia-ml.so.1"))
            .env("VGPU_DAEMON_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        let child = c.spawn().with_context(|| format!("start {c:?}"))?;
        let pid = child.id();
        self.running.push(("vgpu-daemon".into(), child, None));
        let t0 = Instant::now();
        while !(node.daemon_socket().exists() && node.api_socket().exists()) {
            if let Some((_, child, _)) = self.running.last_mut()
                && let Some(status) = child.try_wait().context("poll vgpu-daemon")?
            {
                bail!(
                    "vgpu-daemon exited with {status} at start; its log:\n{}",
                    node.daemon_log_tail()
                );
            }
            if t0.elapsed() > Duration::from_secs(10) {
                bail!(
                    "vgpu-daemon did not create {} and {} within 10 s; its log:\n{}",
                    node.daemon_socket().display(),
                    node.api_socket().display(),
                    node.daemon_log_tail()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(pid)
    }

    /// Starts tenant `spec` under the shim running `script`, and waits until it reports
    /// `ready`.
    fn tenant(&mut self, node: &Node, spec: &'static Spec, script: &[String]) -> Result<Tenant> {
        let dir = node.dir.path().join("containers").join(spec.name);
        std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
        let mut child = node
            .command("cuda-probe")
            .args(script)
            .env("LD_PRELOAD", node.bin.join("libvgpu.so"))
            .env("VGPU_CONTAINER_DIR", &dir)
            .env("VGPU_TENANT", spec.name)
            .env("VGPU_DAEMON_SOCKET", node.daemon_socket())
            .env("VGPU_COMPUTE_SHARE", spec.share.to_string())
            .env("VGPU_COMPUTE_POLICY", spec.policy)
            .env("VGPU_PRIORITY", "best-effort")
            .env("VGPU_MEMORY_LIMIT", spec.quota)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("start tenant {} (cuda-probe)", spec.name))?;
        let stdout = child.stdout.take().context("cuda-probe's stdout")?;
        let stdin = child.stdin.take();
        let pid = child.id();
        self.running.push((spec.name.to_owned(), child, stdin));
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut said = Vec::new();
        loop {
            match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(line) if line.starts_with("ready") => {
                    return Ok(Tenant { spec, pid, said });
                }
                Ok(line) => said.push(line),
                Err(_) => bail!(
                    "tenant {} (pid {pid}) did not become ready within 30 s; it printed {said:?}",
                    spec.name
                ),
            }
        }
    }
}

/// Where the demo is on its timeline.
struct Clock {
    zero: Instant,
}

impl Clock {
    fn sleep_until(&self, t: f64) {
        let due = self.zero + Duration::from_secs_f64(t);
        std::thread::sleep(due.saturating_duration_since(Instant::now()));
    }

    fn now(&self) -> f64 {
        Instant::now()
            .checked_duration_since(self.zero)
            .map_or(0.0, |d| d.as_secs_f64())
    }
}

/// What one measurement window found.
struct Window {
    from: f64,
    to: f64,
    /// Per pid: mean NVML SM utilization over the window, percent of the GPU's time.
    nvml: HashMap<u32, f64>,
    /// Per tenant key: GPU time the daemon charged in the window, percent of the window.
    daemon: HashMap<String, f64>,
    /// The daemon's view at the end of the window.
    last: HashMap<String, DaemonTenant>,
    /// NVML's view at the end of the window.
    last_nvml: NvmlGpu,
}

/// Measures the window that starts at `from` and lasts `samples` NVML samples; `during`
/// runs after each sample (its index, from 1) and may take a little time.
fn measure(
    node: &Node,
    clock: &Clock,
    uuid: &str,
    (from, samples): (f64, usize),
    mut during: impl FnMut(usize) -> Result<()>,
) -> Result<Window> {
    clock.sleep_until(from);
    let t0 = clock.now();
    let d0 = node.daemon_view(uuid)?;
    let mut sums: HashMap<u32, (f64, usize)> = HashMap::new();
    let mut last_nvml = None;
    for k in 1..=samples {
        clock.sleep_until(from + SAMPLE_S * k as f64);
        let g = node.nvml_gpu0()?;
        for (pid, (sm, _)) in &g.procs {
            if let Some(sm) = sm {
                let e = sums.entry(*pid).or_default();
                e.0 += sm;
                e.1 += 1;
            }
        }
        last_nvml = Some(g);
        if k < samples {
            during(k)?;
        }
    }
    let d1 = node.daemon_view(uuid)?;
    let t1 = clock.now();
    let secs = (t1 - t0).max(1e-3);
    let daemon = d1
        .iter()
        .map(|(k, v)| {
            let before = d0.get(k).map_or(0, |d| d.gpu_time_ns);
            let pct = v.gpu_time_ns.saturating_sub(before) as f64 / 1e9 / secs * 100.0;
            (k.clone(), pct)
        })
        .collect();
    // A process present in only some samples was idle (0 %) in the others.
    let nvml = sums
        .into_iter()
        .map(|(pid, (sum, _))| (pid, sum / samples as f64))
        .collect();
    Ok(Window {
        from,
        to: from + SAMPLE_S * samples as f64,
        nvml,
        daemon,
        last: d1,
        last_nvml: last_nvml.context("a window without samples")?,
    })
}

/// What each busy tenant should get of a saturated GPU: shares are relative among the
/// tenants that want the GPU, and a `cap` tenant gets at most its share (water-filling).
fn expected(busy: &[(u32, bool)]) -> Vec<f64> {
    let mut got: Vec<Option<f64>> = vec![None; busy.len()];
    loop {
        let free = 100.0 - got.iter().flatten().sum::<f64>();
        let weight: f64 = busy
            .iter()
            .zip(&got)
            .filter(|(_, g)| g.is_none())
            .map(|((s, _), _)| f64::from(*s))
            .sum();
        let mut capped = false;
        for (i, (share, cap)) in busy.iter().enumerate() {
            let fair = free * f64::from(*share) / weight.max(1.0);
            if got[i].is_none() && *cap && fair > f64::from(*share) {
                got[i] = Some(f64::from(*share));
                capped = true;
            }
        }
        if !capped {
            return busy
                .iter()
                .zip(got)
                .map(|((s, _), g)| g.unwrap_or(free * f64::from(*s) / weight.max(1.0)))
                .collect();
        }
    }
}

/// Left-aligned columns separated by two spaces, indented.
fn table(rows: &[Vec<String>]) {
    let cols = rows.iter().map(Vec::len).max().unwrap_or(0);
    let mut w = vec![0usize; cols];
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            w[i] = w[i].max(c.chars().count());
        }
    }
    for r in rows {
        let mut line = String::from("  ");
        for (i, c) in r.iter().enumerate() {
            line.push_str(&format!("{c:<width$}  ", width = w[i]));
        }
        println!("{}", line.trim_end());
    }
}

fn gib(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / f64::from(1u32 << 30))
}

fn section(title: &str) {
    println!(
        "\n---- {title} {}",
        "-".repeat(84usize.saturating_sub(title.len()))
    );
}

/// The compute table of a window: configured share, expected and achieved share of the
/// GPU's time, measured by the simulator (NVML) and by the daemon.
/// Returns the simulator's and the daemon's figures (percent of the window), busy
/// tenants first.
fn compute_table(w: &Window, busy: &[&Tenant], idle: &[&Tenant]) -> Vec<(f64, f64)> {
    let settings: Vec<(u32, bool)> = busy
        .iter()
        .map(|t| {
            let d = w.last.get(t.spec.name);
            let share = d.map_or(t.spec.share, |d| d.share as u32);
            let cap = d.map_or(t.spec.policy, |d| d.policy.as_str()) == "cap";
            (share, cap)
        })
        .collect();
    let want = expected(&settings);
    let rows_of = |source: &dyn Fn(&Tenant) -> f64| -> (Vec<f64>, f64) {
        let v: Vec<f64> = busy.iter().chain(idle).map(|t| source(t)).collect();
        let total = v.iter().sum();
        (v, total)
    };
    let (sim, sim_total) = rows_of(&|t| w.nvml.get(&t.pid).copied().unwrap_or(0.0));
    let (charged, charged_total) = rows_of(&|t| w.daemon.get(t.spec.name).copied().unwrap_or(0.0));
    let mut rows = vec![
        vec![
            String::new(),
            String::new(),
            String::new(),
            "EXPECTED".into(),
            "SIMULATOR (truth)".into(),
            String::new(),
            "DAEMON (charged)".into(),
        ],
        [
            "TENANT", "SHARE", "POLICY", "of time", "of time", "of busy", "of time", "of busy",
        ]
        .map(String::from)
        .to_vec(),
    ];
    let pct = |x: f64| format!("{x:.1} %");
    for (i, (t, e)) in busy
        .iter()
        .zip(want.iter().map(Some))
        .chain(idle.iter().map(|t| (t, None)))
        .enumerate()
    {
        let d = w.last.get(t.spec.name);
        rows.push(vec![
            t.spec.name.to_owned(),
            format!("{} %", d.map_or(u64::from(t.spec.share), |d| d.share)),
            d.map_or(t.spec.policy, |d| d.policy.as_str()).to_owned(),
            e.map_or_else(|| "0 % (idle)".to_owned(), |e| pct(*e)),
            pct(sim[i]),
            pct(sim[i] * 100.0 / sim_total.max(1e-9)),
            pct(charged[i]),
            pct(charged[i] * 100.0 / charged_total.max(1e-9)),
        ]);
    }
    rows.push(vec![
        "GPU 0 busy".into(),
        String::new(),
        String::new(),
        "100 %".into(),
        pct(sim_total),
        String::new(),
        pct(charged_total),
    ]);
    println!(
        "Share of GPU 0's time over t = {:.1}–{:.1} s ({:.1} s):",
        w.from,
        w.to,
        w.to - w.from
    );
    table(&rows);
    sim.into_iter().zip(charged).collect()
}

/// Runs the demo with the built simulator in `libs` and the release binaries in `bin`.
pub fn demo(libs: &Path, bin: &Path) -> Result<()> {
    let dir = tempfile::Builder::new()
        .prefix("vgpu-demo-")
        .tempdir()
        .context("create the demo node's directory")?;
    std::fs::write(dir.path().join("config.toml"), CONFIG).context("write the node config")?;
    let node = Node {
        dir,
        libs: libs.to_owned(),
        bin: bin.to_owned(),
    };
    let mut children = Children::default();
    let r = run(&node, &mut children);
    drop(children);
    if let Err(e) = r {
        return Err(e.context(format!(
            "the demo failed; the daemon's last log lines:\n{}",
            node.daemon_log_tail()
        )));
    }
    let path = node.dir.path().to_owned();
    node.dir
        .close()
        .with_context(|| format!("remove {}", path.display()))?;
    println!("Done.");
    Ok(())
}

fn run(node: &Node, children: &mut Children) -> Result<()> {
    println!("\n==== vgpu demo: four containers share one GPU under vgpu-daemon ====\n");
    println!(
        "A simulated node (two GPUs; state in {}): every process below loads\n\
         `libcuda.so.1` and `libnvidia-ml.so.1` through LD_LIBRARY_PATH={},\n\
         as it would load NVIDIA's driver; here they are the simulator.",
        node.dir.path().display(),
        node.libs.display()
    );
    let daemon = children.daemon(node)?;
    println!(
        "\nvgpu-daemon (pid {daemon}) serves the shims on {}\n\
         and its API (vgpuctl) on {};\n\
         it watches the GPUs through NVML ({}).",
        node.daemon_socket().display(),
        node.api_socket().display(),
        node.libs.join("libnvidia-ml.so.1").display()
    );
    println!(
        "\nFour tenants, each a `cuda-probe` process (CUDA driver API) with LD_PRELOAD=libvgpu.so,\n\
         its own VGPU_CONTAINER_DIR, and its settings in VGPU_COMPUTE_SHARE, VGPU_COMPUTE_POLICY\n\
         and VGPU_MEMORY_LIMIT (standalone mode: in Kubernetes the device plugin's quota file sets them):"
    );
    let mut rows = vec![
        ["TENANT", "SHARE", "POLICY", "MEMORY QUOTA", "WORKLOAD"]
            .map(String::from)
            .to_vec(),
    ];
    for s in [&NOTEBOOK, &TRAIN, &BATCH, &GREEDY] {
        rows.push(vec![
            s.name.to_owned(),
            format!("{} %", s.share),
            s.policy.to_owned(),
            s.quota.replace("Gi", " GiB"),
            s.what.to_owned(),
        ]);
    }
    table(&rows);

    // The busy tenants start launching together, at unix time `at_ms` (t = 0).
    let at_ms = now_ms()? + 2500;
    let busy_script = |alloc: &str, secs: u64| -> Vec<String> {
        [
            "init",
            "alloc",
            alloc,
            "ready",
            "load",
            &secs.to_string(),
            &KERNEL_NS.to_string(),
            &at_ms.to_string(),
            "1",
        ]
        .map(String::from)
        .to_vec()
    };
    let a = children.tenant(node, &NOTEBOOK, &busy_script("3Gi", at::END))?;
    let b = children.tenant(node, &TRAIN, &busy_script("12Gi", at::B_ENDS))?;
    let c = children.tenant(node, &BATCH, &busy_script("6Gi", at::END))?;
    let until_ms = at_ms.saturating_sub(now_ms()?);
    let clock = Clock {
        zero: Instant::now() + Duration::from_millis(until_ms),
    };
    println!(
        "\nStarted notebook-a (pid {}), train-b (pid {}) and batch-c (pid {}). They have allocated\n\
         their memory and start launching together in {:.1} s (t = 0); the run lasts {} s.",
        a.pid,
        b.pid,
        c.pid,
        until_ms as f64 / 1000.0,
        at::END
    );
    let uuid = node.nvml_gpu0()?.uuid;

    // ---- phase 1 ----
    let mut greedy = None;
    let w1 = measure(node, &clock, &uuid, at::P1, |k| {
        if k == at::GREEDY_AFTER_SAMPLE {
            let script: Vec<String> = GREEDY_SCRIPT
                .iter()
                .flat_map(|(cmd, _)| cmd.split(' '))
                .chain(["ready", "wait"])
                .map(String::from)
                .collect();
            greedy = Some(children.tenant(node, &GREEDY, &script)?);
        }
        Ok(())
    })?;
    let d = greedy.context("the greedy tenant was not started")?;
    let tenants_table = node.vgpuctl(&["tenants"])?;

    section("1. greedy-d asks for more memory than its quota");
    println!(
        "At t = {:.1} s greedy-d (pid {}, quota 2 GiB) started; its cuda-probe commands and output:",
        at::P1.0 + SAMPLE_S * at::GREEDY_AFTER_SAMPLE as f64,
        d.pid
    );
    if d.said.len() != GREEDY_SCRIPT.len() {
        bail!(
            "greedy-d printed {} lines for its {} commands: {:?}",
            d.said.len(),
            GREEDY_SCRIPT.len(),
            d.said
        );
    }
    let rows: Vec<Vec<String>> = GREEDY_SCRIPT
        .iter()
        .zip(&d.said)
        .map(|((cmd, what), said)| vec![(*cmd).to_owned(), (*what).to_owned(), said.clone()])
        .collect();
    table(&rows);
    // The answers to `alloc 1536Mi` and `alloc 1Gi`; CUDA_ERROR_OUT_OF_MEMORY is 2.
    if !d.said[1].starts_with("alloc=ok") || d.said[3] != "alloc=err code=2" {
        bail!(
            "greedy-d's allocations were not granted within its quota and refused beyond it \
             with CUDA_ERROR_OUT_OF_MEMORY (code 2): {:?}",
            d.said
        );
    }
    println!(
        "The second cuMemAlloc failed with code 2, CUDA_ERROR_OUT_OF_MEMORY, although GPU 0 has\n\
         over 50 GiB free: the shim refused it, 1.5 + 1 GiB being over greedy-d's 2 GiB quota;\n\
         cuMemGetInfo shows greedy-d a GPU of 2 GiB. The other tenants carried on: they kept\n\
         launching (the window below spans this moment) and kept their memory."
    );

    section("2. compute: three tenants saturate GPU 0 (t = 0–10 s)");
    let _ = compute_table(&w1, &[&a, &b, &c], &[&d]);
    println!(
        "EXPECTED: what the shares promise on a saturated GPU. Shares are relative among the\n\
         tenants that want the GPU, so 20/50/30 of its time (greedy-d's 10 % goes to the\n\
         others while it launches nothing); batch-c is `cap` 30 %, and here its fair share and\n\
         its cap coincide. SIMULATOR: the ground truth, the simulated driver's own count of\n\
         the device time each process got (NVML per-process utilization, read every 1.5 s by\n\
         `vgpu-smi --json`). DAEMON: the GPU time vgpu-daemon measured and charged to each\n\
         tenant in the same window (`vgpuctl --json tenants`, GPU-TIME at its end minus at\n\
         its start). `of time`: percent of the window; `of busy`: percent of the time the GPU\n\
         was busy, which is what the scheduler divides (switching slices leaves it idle a\n\
         little, more so on a loaded machine: tenants are CPU processes that must keep it fed)."
    );
    println!(
        "\n`vgpuctl tenants` at t = {:.1} s (ACH: the daemon's own figure over its last 10 s,\n\
         which began {:.1} s before the tenants started launching):",
        at::P1.0 + SAMPLE_S * at::P1.1 as f64,
        10.0 - (at::P1.0 + SAMPLE_S * at::P1.1 as f64)
    );
    for l in tenants_table.lines() {
        println!("  {l}");
    }

    section(&format!(
        "3. memory: quota vs use (t = {:.1} s)",
        at::P1.0 + SAMPLE_S * at::P1.1 as f64
    ));
    let mut rows = vec![
        [
            "TENANT",
            "QUOTA",
            "ALLOCATED (daemon, from the shims)",
            "NVML (process, incl. its 300 MiB context)",
        ]
        .map(String::from)
        .to_vec(),
    ];
    for t in [&a, &b, &c, &d] {
        let dv = w1.last.get(t.spec.name);
        rows.push(vec![
            t.spec.name.to_owned(),
            dv.and_then(|d| d.memory_quota)
                .map_or_else(|| "unlimited".to_owned(), gib),
            dv.map_or_else(|| "not registered".to_owned(), |d| gib(d.memory_used)),
            w1.last_nvml
                .procs
                .get(&t.pid)
                .and_then(|p| p.1)
                .map_or_else(|| "n/a".to_owned(), gib),
        ]);
    }
    table(&rows);
    println!(
        "A quota bounds what a container allocates; its CUDA contexts are counted apart (NVML's\n\
         figure includes one: 300 MiB on this simulated {}). ALLOCATED is what\n\
         the shims report to the daemon every second.",
        w1.last_nvml.name
    );

    // ---- phase 2 ----
    let w2 = measure(node, &clock, &uuid, at::P2, |_| Ok(()))?;
    section("4. train-b has finished (t = 10 s): burst vs cap");
    let p2 = compute_table(&w2, &[&a, &c], &[&d]);
    println!(
        "train-b's time is free. notebook-a is `burst` (work-conserving): it takes what the\n\
         others leave, {:.1} % of the GPU's time for a 20 % share. batch-c is `cap` 30 %: it gets\n\
         {:.1} % although the GPU has time to spare; `burst`, it would get 30/(20+30) = 60 %.",
        p2[0].0, p2[1].0
    );

    // ---- phase 3 ----
    clock.sleep_until(at::CHANGE);
    let after = node.vgpuctl(&["set", BATCH.name, "--share", "50"])?;
    let w3 = measure(node, &clock, &uuid, at::P3, |_| Ok(()))?;
    section(&format!(
        "5. live change at t = {:.1} s: vgpuctl set batch-c --share 50",
        at::CHANGE
    ));
    println!("vgpuctl printed the tenant after the change:");
    for l in after.lines() {
        println!("  {l}");
    }
    let p3 = compute_table(&w3, &[&a, &c], &[&d]);
    println!(
        "Measured from {:.1} s after the change, nothing restarted: batch-c gets {:.1} % (was\n\
         {:.1} %), notebook-a, still `burst`, what is left: {:.1} %.",
        at::P3.0 - at::CHANGE,
        p3[1].0,
        p2[1].0,
        p3[0].0
    );
    if p3[1].0 < 48.0 {
        println!(
            "batch-c stays below its new 50 % ceiling: a cap is a ceiling, not a reservation,\n\
             and beside a busy `burst` tenant the scheduler gives it less\n\
             ({}).",
            if (p3[1].0 - p3[1].1).abs() <= 2.0 {
                "the daemon's own charge agrees with the simulator"
            } else {
                "the daemon's charge differs from the simulator's count"
            }
        );
    }

    println!("\nStopping the tenants and the daemon, removing the node...");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::expected;

    #[test]
    fn expected_shares_are_proportional_then_capped() {
        let near = |a: &[f64], b: &[f64]| a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-9);
        assert!(near(
            &expected(&[(20, false), (50, false), (30, true)]),
            &[20.0, 50.0, 30.0]
        ));
        assert!(near(&expected(&[(20, false), (30, true)]), &[70.0, 30.0]));
        assert!(near(&expected(&[(20, false), (50, true)]), &[50.0, 50.0]));
        assert!(near(&expected(&[(30, false), (70, false)]), &[30.0, 70.0]));
        assert!(near(&expected(&[(30, true)]), &[30.0]));
    }
}
