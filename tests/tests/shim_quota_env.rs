//! The quota readable by engines (issue 41, ADR 0058): every process under the shim in a
//! container with a quota file finds `VGPU_MEMORY_QUOTA_BYTES` in its environment from
//! its start (a shell's `$VGPU_MEMORY_QUOTA_BYTES`, Python's `os.environ`), one figure per
//! GPU in its CUDA ordinal order, equal to what `cuMemGetInfo` later reports as total;
//! a value inherited from a parent with another `CUDA_VISIBLE_DEVICES` is replaced; an
//! environment limit that lowers a quota lowers the figure. Without a quota file nothing
//! is set.

use vgpu_tests::{Container, SimNode, field, num};

use super::shim_visible::container;
use super::workload_py as py;

const MIB: u64 = 1 << 20;
const G0: &str = "GPU-51570000-0000-4000-8000-000000000000";
const G1: &str = "GPU-51570000-0000-4000-8000-000000000001";
const G2: &str = "GPU-51570000-0000-4000-8000-000000000002";

fn node() -> SimNode {
    SimNode::new(&"[[device]]\nmemory = \"4Gi\"\n".repeat(3))
}

/// What `sh -c 'echo …'` prints of the variable in the container, with `env` added.
fn shell(node: &SimNode, c: &Container, env: &[(&str, &str)]) -> String {
    let mut cmd = node.command("sh");
    c.apply(&mut cmd);
    cmd.env_remove("CUDA_VISIBLE_DEVICES")
        .env_remove("VGPU_MEMORY_QUOTA_BYTES");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd
        .args(["-c", "echo \"q=${VGPU_MEMORY_QUOTA_BYTES-unset}\""])
        .output()
        .expect("run sh");
    assert!(out.status.success(), "sh failed: {out:?}");
    let s = String::from_utf8_lossy(&out.stdout);
    field(&s, "q").unwrap_or_else(|| panic!("no q= in {s:?}"))
}

fn bytes(mib: &[u64]) -> String {
    mib.iter()
        .map(|m| (m * MIB).to_string())
        .collect::<Vec<_>>()
        .join(",")
}

#[test]
fn a_shell_in_the_container_reads_each_gpus_quota_in_its_own_order() {
    let node = node();
    let c = container(&[(G2, 1000), (G0, 2000), (G1, 3000)]);
    assert_eq!(shell(&node, &c, &[]), bytes(&[1000, 2000, 3000]));
    assert_eq!(
        shell(&node, &c, &[("CUDA_VISIBLE_DEVICES", "2,0")]),
        bytes(&[3000, 1000])
    );
    assert_eq!(
        shell(&node, &c, &[("CUDA_VISIBLE_DEVICES", G0)]),
        bytes(&[2000])
    );
    // Inherited from a parent that saw all three GPUs: replaced.
    assert_eq!(
        shell(
            &node,
            &c,
            &[
                ("CUDA_VISIBLE_DEVICES", "1"),
                ("VGPU_MEMORY_QUOTA_BYTES", &bytes(&[1000, 2000, 3000]))
            ]
        ),
        bytes(&[2000])
    );
    // The environment lowers a quota (ordinal 1 of `2,1`: G0), never raises one.
    assert_eq!(
        shell(
            &node,
            &c,
            &[
                ("CUDA_VISIBLE_DEVICES", "2,1"),
                ("VGPU_MEMORY_LIMIT_1", "500Mi"),
                ("VGPU_MEMORY_LIMIT_0", "8Gi")
            ]
        ),
        bytes(&[3000, 500])
    );
}

#[test]
fn without_a_quota_file_nothing_is_published() {
    let node = node();
    let c = Container::new("1Gi");
    assert_eq!(shell(&node, &c, &[]), "unset");
}

#[test]
fn an_engine_reads_before_cuda_what_cuda_then_reports_as_total() {
    if !py::have_cuda_python() {
        return;
    }
    let node = node();
    let c = container(&[(G2, 1000), (G0, 2000), (G1, 3000)]);
    let mut cmd = py::command(&node, Some(&c), "visible_views.py", &[]);
    cmd.env("CUDA_VISIBLE_DEVICES", "2,0");
    let out = py::check("visible_views.py", &cmd.output().expect("run python3"));
    let totals: Vec<String> = (0..num(&out, "cuda_count"))
        .map(|i| num(&out, &format!("cuda_total_{i}")).to_string())
        .collect();
    assert_eq!(
        field(&out, "env_quota").as_deref(),
        Some(totals.join(",").as_str()),
        "{out}"
    );
    assert_eq!(totals.join(","), bytes(&[3000, 1000]), "{out}");
}
