//! GPU health from NVML events on the simulated driver: faults injected with `vgpu-sim`
//! make a GPU unhealthy, ignored XIDs do not, and a GPU becomes healthy again.
//!
//! Needs the simulated driver (`cargo xtask sim`, which also builds `vgpu-sim`).

use std::io::{BufRead, BufReader};
use std::process::{Child, Stdio};
use std::sync::mpsc::{Receiver, channel};
use std::time::{Duration, Instant};

use vgpu_core::inventory::NodeInventory;
use vgpu_tests::{SimNode, sim_lib_dir};

struct Plugin {
    child: Child,
    lines: Receiver<String>,
}

impl Drop for Plugin {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Plugin {
    /// The next inventory line within `timeout`, if any.
    fn next(&self, timeout: Duration) -> Option<NodeInventory> {
        let line = self.lines.recv_timeout(timeout).ok()?;
        Some(NodeInventory::from_json(&line).expect("an inventory line"))
    }

    /// Waits for an inventory where `pred` holds.
    fn wait(&self, what: &str, pred: impl Fn(&NodeInventory) -> bool) -> NodeInventory {
        let end = Instant::now() + Duration::from_secs(10);
        loop {
            let left = end.saturating_duration_since(Instant::now());
            match self.next(left) {
                Some(inv) if pred(&inv) => return inv,
                Some(_) => {}
                None => panic!("timed out after 10 s waiting for {what}"),
            }
        }
    }
}

fn health(inv: &NodeInventory) -> Vec<bool> {
    inv.gpus.iter().map(|g| g.healthy).collect()
}

fn sim(node: &SimNode, args: &[&str]) {
    let bin = vgpu_tests::sim_tool_bin();
    let out = node
        .command(&bin)
        .args(args)
        .output()
        .expect("run vgpu-sim");
    assert!(
        out.status.success(),
        "vgpu-sim {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn nvml_faults_flip_health_both_ways() {
    let node = SimNode::new(
        r#"
        [[device]]
        name = "NVIDIA H100 80GB HBM3"
        memory = "8Gi"
        [[device]]
        name = "NVIDIA A100-SXM4-40GB"
        memory = "4Gi"
        "#,
    );
    let lib = sim_lib_dir().join("libnvidia-ml.so.1");
    let mut child = node
        .command(crate::plugin_bin())
        .args([
            "health",
            "--health-recovery-ms",
            "400",
            "--health-poll-ms",
            "50",
            "--nvml-lib",
        ])
        .arg(&lib)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn the plugin's health command");
    let stdout = child.stdout.take().expect("piped");
    let (tx, rx) = channel();
    std::thread::spawn(move || {
        for l in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    let p = Plugin { child, lines: rx };
    let inv = p.wait("the inventory", |_| true);
    assert_eq!(inv.gpus.len(), 2);
    assert_eq!(inv.gpus[0].model, "NVIDIA H100 80GB HBM3");
    assert_eq!(inv.gpus[0].memory_mib, 8192);
    assert!(inv.gpus[0].uuid.starts_with("GPU-"));
    assert_eq!(health(&inv), [true, true]);

    // An application XID (13) changes nothing.
    sim(&node, &["xid", "--device", "1", "13"]);
    assert!(
        p.next(Duration::from_millis(600)).is_none(),
        "XID 13 is ignored"
    );

    // A critical XID: unhealthy, then healthy again after the recovery time.
    sim(&node, &["xid", "--device", "1", "48"]);
    p.wait("GPU 1 unhealthy after XID 48", |i| {
        health(i) == [true, false]
    });
    p.wait("GPU 1 healthy again", |i| health(i) == [true, true]);

    // A double-bit ECC error on GPU 0.
    sim(&node, &["ecc", "--device", "0"]);
    p.wait("GPU 0 unhealthy after ECC", |i| health(i) == [false, true]);
    p.wait("GPU 0 healthy again", |i| health(i) == [true, true]);

    // Fallen off the bus, and back.
    sim(&node, &["lost", "--device", "1"]);
    p.wait("GPU 1 unhealthy while lost", |i| health(i) == [true, false]);
    // Past the recovery time it stays unhealthy while NVML cannot reach it.
    if let Some(i) = p.next(Duration::from_millis(900)) {
        assert_eq!(
            health(&i),
            [true, false],
            "a lost GPU must not come back by itself"
        );
    }
    sim(&node, &["lost", "--device", "1", "--restore"]);
    p.wait("GPU 1 healthy after restore", |i| health(i) == [true, true]);
}
