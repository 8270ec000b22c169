//! One memory truth per container and GPU under any `CUDA_VISIBLE_DEVICES` order or
//! subset (issue 41 item 2; HAMi-core #225's spurious OOMs): on a 3-GPU simulated node, a
//! container granted the three GPUs in a permuted order, with a different quota each,
//! runs processes that choose their own order and subset (by index and by UUID). Every
//! process reads every GPU's quota and the container's usage of it alike through CUDA
//! (`cuMemGetInfo`, `cuDeviceTotalMem`, per ordinal) and NVML (memory info v1 and v2, by
//! index and by UUID), and a process allocating on one of them gets exactly that GPU's
//! quota. Before, the container's accounts were kept by each process's CUDA ordinal: a
//! process of `2,0` charged GPU 1's usage to the account of the container's first GPU,
//! the quotas of the three mixed (the lowest won), and NVML showed a GPU the process had
//! left out at its physical size.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};

use vgpu_tests::{SimNode, field, num};

use super::shim_visible::container;
use super::workload_py as py;

const MIB: u64 = 1 << 20;
const G0: &str = "GPU-51570000-0000-4000-8000-000000000000";
const G1: &str = "GPU-51570000-0000-4000-8000-000000000001";
const G2: &str = "GPU-51570000-0000-4000-8000-000000000002";

/// Checks every GPU of `out` (the views of `visible_views.py`, keys after `prefix`)
/// against `truth` (UUID → (quota, container's usage)): `cuda` CUDA ordinals, and
/// all three granted GPUs through NVML.
fn assert_one_truth(out: &str, prefix: &str, cuda: usize, truth: &HashMap<&str, (u64, u64)>) {
    let get = |k: &str| {
        let key = format!("{prefix}{k}");
        field(out, &key).unwrap_or_else(|| panic!("no {key}= in:\n{out}"))
    };
    let n = |k: &str| num(out, &format!("{prefix}{k}"));
    assert_eq!(n("cuda_count"), cuda as u64, "{out}");
    for i in 0..cuda {
        let u = get(&format!("cuda_uuid_{i}"));
        let (q, used) = truth[u.as_str()];
        assert_eq!(n(&format!("cuda_total_{i}")), q, "CUDA {i} ({u}): {out}");
        assert_eq!(n(&format!("cuda_totalmem_{i}")), q, "CUDA {i} ({u}): {out}");
        assert_eq!(n(&format!("cuda_used_{i}")), used, "CUDA {i} ({u}): {out}");
    }
    // NVML shows the container's GPUs in its order, whatever CUDA_VISIBLE_DEVICES.
    for (j, want) in [G2, G0, G1].iter().enumerate() {
        let u = get(&format!("nvml_uuid_{j}"));
        assert_eq!(&u, want, "NVML {j}: {out}");
        let (q, used) = truth[u.as_str()];
        for api in ["nvml", "nvml2", "byuuid"] {
            assert_eq!(n(&format!("{api}_total_{j}")), q, "{api} {j} ({u}): {out}");
            assert_eq!(
                n(&format!("{api}_used_{j}")),
                used,
                "{api} {j} ({u}): {out}"
            );
        }
    }
}

/// Runs `visible_views.py` in the container with `CUDA_VISIBLE_DEVICES=cvd` (unset:
/// None), to completion.
fn views(node: &SimNode, c: &vgpu_tests::Container, cvd: Option<&str>) -> String {
    let mut cmd = py::command(node, Some(c), "visible_views.py", &[]);
    match cvd {
        Some(v) => cmd.env("CUDA_VISIBLE_DEVICES", v),
        None => cmd.env_remove("CUDA_VISIBLE_DEVICES"),
    };
    py::check("visible_views.py", &cmd.output().expect("run python3"))
}

/// Starts `script` in the container with `CUDA_VISIBLE_DEVICES=cvd` and returns it with
/// its output up to its `ready` line.
fn start(
    node: &SimNode,
    c: &vgpu_tests::Container,
    cvd: &str,
    script: &str,
    args: &[&str],
) -> (std::process::Child, String) {
    let mut cmd = py::command(node, Some(c), script, args);
    cmd.env("CUDA_VISIBLE_DEVICES", cvd)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit());
    let mut child = cmd.spawn().expect("spawn python3");
    let mut out = String::new();
    for l in BufReader::new(child.stdout.take().expect("piped stdout"))
        .lines()
        .map_while(Result::ok)
    {
        out.push_str(&l);
        out.push('\n');
        if l.starts_with("ready") {
            break;
        }
    }
    assert!(
        out.contains("ready"),
        "{script} did not become ready:\n{out}"
    );
    (child, out)
}

#[test]
fn every_process_sees_each_gpus_quota_and_usage_alike_whatever_its_visible_devices() {
    if !py::have_cuda_python() {
        return;
    }
    let node = SimNode::new(&"[[device]]\nmemory = \"4Gi\"\n".repeat(3));
    // The container's GPUs in the device plugin's order: G2, G0, G1 (container indices
    // 0, 1, 2), with 1000, 2000 and 3000 MiB.
    let c = container(&[(G2, 1000), (G0, 2000), (G1, 3000)]);
    let mut truth: HashMap<&str, (u64, u64)> = HashMap::from([
        (G2, (1000 * MIB, 0)),
        (G0, (2000 * MIB, 0)),
        (G1, (3000 * MIB, 0)),
    ]);
    // A process of `2,0` (the container's third and first GPUs: G1, G2) allocates
    // 100 MiB on its ordinal 0, G1.
    let (p1, out) = start(&node, &c, "2,0", "visible_views.py", &["0", "100"]);
    assert_one_truth(&out, "", 2, &truth);
    truth.get_mut(G1).expect("G1").1 = 100 * MIB;
    assert_one_truth(&out, "after_", 2, &truth);
    // A process of `1` (G0 alone) takes what it can there: G0's quota, exactly.
    let (p2, g) = start(&node, &c, "1", "grab.py", &["100"]);
    assert_eq!(num(&g, "grabbed"), 2000 * MIB, "{g}");
    assert_eq!(num(&g, "code"), 2, "{g}");
    truth.get_mut(G0).expect("G0").1 = 2000 * MIB;
    // Processes of every GPU (no variable), and of G1 then G0 by UUID, see it all alike.
    assert_one_truth(&views(&node, &c, None), "", 3, &truth);
    assert_one_truth(
        &views(&node, &c, Some(&format!("{G1},{G0}"))),
        "",
        2,
        &truth,
    );
    py::stop(p2);
    py::stop(p1);
    truth.get_mut(G0).expect("G0").1 = 0;
    truth.get_mut(G1).expect("G1").1 = 0;
    assert_one_truth(&views(&node, &c, Some("0")), "", 1, &truth);
}
