//! `cargo xtask demo`: a simulated GPU node with real CUDA processes on it, shown through
//! a real NVML client (`vgpu-smi`, built on the unmodified `nvml-wrapper` crate).
//!
//! Three tenants share a 2-GPU node: A and B hold memory on GPU 0 and both keep it busy,
//! so the GPU's time-slicer splits it between them; C holds memory on GPU 1 and idles.
//! Then B is killed with SIGKILL and its memory comes back. Every figure shown is read
//! from the simulated driver's accounting and measurement, none is scripted. Every child
//! process is killed and reaped when the demo ends, on success or error.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

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

/// How long tenants A and B keep launching kernels; far longer than the demo runs.
const BUSY_SECS: &str = "60";
/// Device time of each kernel they launch: 2 ms.
const KERNEL_NS: &str = "2000000";

/// A fresh simulated node: a temporary state directory and the device configuration.
struct Node {
    dir: tempfile::TempDir,
    libs: PathBuf,
    bin: PathBuf,
}

impl Node {
    fn command(&self, program: &str) -> Command {
        let mut c = Command::new(self.bin.join(program));
        c.env("LD_LIBRARY_PATH", &self.libs)
            .env("VGPU_SIM_DIR", self.dir.path().join("state"))
            .env("VGPU_SIM_CONFIG", self.dir.path().join("config.toml"));
        c
    }

    /// Runs `vgpu-smi` with its output on the terminal.
    fn show(&self) -> Result<()> {
        let status = self.command("vgpu-smi").status().context("run vgpu-smi")?;
        if !status.success() {
            bail!("vgpu-smi failed with {status}");
        }
        Ok(())
    }

    /// The node's view as `vgpu-smi --json` prints it.
    fn json(&self) -> Result<serde_json::Value> {
        let out = self
            .command("vgpu-smi")
            .arg("--json")
            .output()
            .context("run vgpu-smi --json")?;
        if !out.status.success() {
            bail!(
                "vgpu-smi --json failed with {}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        serde_json::from_slice(&out.stdout).context("parse vgpu-smi --json")
    }
}

/// The tenants' processes: each is killed (SIGKILL) and reaped when this is dropped, so
/// no process outlives the demo, whatever path it leaves by.
#[derive(Default)]
struct Tenants {
    running: Vec<(&'static str, Child)>,
}

impl Drop for Tenants {
    fn drop(&mut self) {
        for (_, child) in &mut self.running {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Tenants {
    /// Starts `cuda-probe` with `script` and waits until it reports `ready`.
    fn start(&mut self, node: &Node, name: &'static str, script: &[&str]) -> Result<u32> {
        let mut child = node
            .command("cuda-probe")
            .args(script)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("start tenant {name} (cuda-probe)"))?;
        let stdout = child.stdout.take().context("cuda-probe's stdout")?;
        let pid = child.id();
        self.running.push((name, child));
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut seen = Vec::new();
        loop {
            match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(line) if line.starts_with("ready") => return Ok(pid),
                Ok(line) => seen.push(line),
                Err(_) => bail!("tenant {name} did not become ready within 30 s: {seen:?}"),
            }
        }
    }

    /// Sends SIGKILL to tenant `name` and reaps it.
    fn kill(&mut self, name: &str) -> Result<()> {
        let i = self
            .running
            .iter()
            .position(|(n, _)| *n == name)
            .with_context(|| format!("no tenant {name}"))?;
        let (_, mut child) = self.running.swap_remove(i);
        child
            .kill()
            .with_context(|| format!("kill tenant {name}"))?;
        child
            .wait()
            .with_context(|| format!("reap tenant {name}"))?;
        Ok(())
    }
}

fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / f64::from(1u32 << 30))
}

fn section(title: &str) {
    println!(
        "\n---- {title} {}",
        "-".repeat(70usize.saturating_sub(title.len()))
    );
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
    let mut tenants = Tenants::default();

    println!(
        "\n==== vgpu demo: a simulated GPU node, real CUDA processes, a real NVML client ====\n"
    );
    println!(
        "The node has two simulated GPUs (an H100 80 GiB and an A100 40 GiB); its state lives in\n\
         {}. Every process below is an ordinary program that loads `libcuda.so.1`\n\
         and `libnvidia-ml.so.1` through LD_LIBRARY_PATH={}, exactly as it\n\
         would load NVIDIA's driver: here they are the simulator, shared by all processes of the node.",
        node.dir.path().display(),
        node.libs.display()
    );
    println!(
        "\nStarting three tenants, each a separate `cuda-probe` process using the CUDA driver API:"
    );
    let busy = ["saturate", BUSY_SECS, KERNEL_NS, "0"];
    let a = tenants.start(
        &node,
        "A",
        &[&["init", "alloc", "20Gi", "ready"][..], &busy].concat(),
    )?;
    println!("  tenant A  pid {a:>7}  allocates 20 GiB on GPU 0 and launches kernels non-stop");
    let b = tenants.start(
        &node,
        "B",
        &[&["init", "alloc", "8Gi", "ready"][..], &busy].concat(),
    )?;
    println!("  tenant B  pid {b:>7}  allocates  8 GiB on GPU 0 and launches kernels non-stop");
    let c = tenants.start(
        &node,
        "C",
        &["device", "1", "init", "alloc", "30Gi", "ready", "wait"],
    )?;
    println!("  tenant C  pid {c:>7}  allocates 30 GiB on GPU 1 and then sits idle");
    println!("\nLetting them run for 3 s, so that the driver has measured utilization...");
    std::thread::sleep(Duration::from_secs(3));

    section("view 1: vgpu-smi (an NVML client on the nvml-wrapper crate)");
    node.show()?;
    println!(
        "What you see: each tenant's memory is its allocation plus its CUDA context (300 MiB\n\
         on this node; a few hundred MiB on real GPUs). GPU 0 is (nearly) always busy, and A\n\
         and B get about half of it each: nothing regulates them, so the GPU's time-slicer\n\
         alternates between their contexts. C holds 30 GiB of GPU 1 but computes nothing\n\
         (0 %). The SM column is each process's share of the device's time over the last\n\
         1.5 s, from NVML's per-process utilization samples."
    );

    println!(
        "\nKilling tenant B with SIGKILL (as the kernel's OOM killer or a force-deleted pod would)..."
    );
    let before = node.json()?;
    let freed = before["gpus"][0]["processes"]
        .as_array()
        .and_then(|ps| ps.iter().find(|p| p["pid"] == b))
        .and_then(|p| p["memory_used"].as_u64())
        .context("tenant B is not listed on GPU 0")?;
    let t0 = Instant::now();
    tenants.kill("B")?;
    let gone = loop {
        let v = node.json()?;
        let listed = v["gpus"][0]["processes"]
            .as_array()
            .is_some_and(|ps| ps.iter().any(|p| p["pid"] == b));
        if !listed {
            break t0.elapsed();
        }
        if t0.elapsed() > Duration::from_secs(5) {
            bail!("tenant B (pid {b}) is still listed 5 s after SIGKILL: {v}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    println!(
        "Measured: B vanished from NVML {} ms after the signal, and its {} are free again.",
        gone.as_millis(),
        gib(freed)
    );

    section("view 2: right after the kill");
    node.show()?;
    println!(
        "The driver released B's memory and context when the process died, without its help,\n\
         as NVIDIA's driver does. A's share still averages the time it shared the GPU with B."
    );
    println!("\nWaiting 2 s more...");
    std::thread::sleep(Duration::from_secs(2));

    section("view 3: A has GPU 0 to itself");
    node.show()?;
    println!(
        "A now gets (nearly) the whole GPU: time-slicing is work-conserving, an idle or\n\
         absent tenant leaves its time to the others. What it cannot do is enforce limits: A\n\
         could also have taken all 80 GiB, or kept B to a sliver of the GPU. Enforcing each\n\
         tenant's memory and compute share is vgpu's job (the shim and the node daemon)."
    );

    println!("\nStopping the tenants and removing the node...");
    drop(tenants);
    let dir = node.dir.path().to_owned();
    node.dir
        .close()
        .with_context(|| format!("remove {}", dir.display()))?;
    println!("Done.");
    Ok(())
}
