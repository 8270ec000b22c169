//! The workloads people run on shared GPUs, as real multi-process programs on the
//! simulated node under quotas (issue 41 item 6; scripts in `tests/python/workloads`):
//! an NCCL-shaped ring all-reduce over 2 and 4 GPUs (cuMem device and host buffers, IPC
//! handles, POSIX-fd shareable handles, peer copies, one process per GPU), and a
//! vLLM-shaped start-up (KV cache sized from CUDA's and NVML's total, a CUDA graph of 500
//! kernels captured and replayed, sleep and wake through unmap/release/re-create) beside a
//! neighbour that tries to take the slept memory. Each: no crash, memory charged exactly
//! once, nothing over quota.

use std::io::{BufRead, BufReader, Write};

use vgpu_tests::{Container, SimNode, num};

use super::workload_py as py;

const MIB: u64 = 1 << 20;

fn node(gpus: usize, memory: &str) -> SimNode {
    let dev = format!(
        "[[device]]\nmemory = \"{memory}\"\ncontext_overhead = \"300Mi\"\nalloc_granularity = \"2Mi\"\n"
    );
    SimNode::new(&dev.repeat(gpus))
}

fn ring(n: usize) {
    if !py::have_cuda_python() {
        return;
    }
    let node = node(n, "4Gi");
    let c = Container::new("256Mi");
    let sync = tempfile::tempdir().expect("a barrier directory");
    let dir = sync.path().to_string_lossy().into_owned();
    let (ns, ranks): (String, Vec<String>) =
        (n.to_string(), (0..n).map(|r| r.to_string()).collect());
    let children: Vec<_> = ranks
        .iter()
        .map(|r| py::spawn(&node, Some(&c), "nccl_ring.py", &[r, &ns, &dir]))
        .collect();
    for (r, child) in children.into_iter().enumerate() {
        let out = child.wait_with_output().expect("wait for a rank");
        let out = py::check(&format!("nccl_ring.py rank {r}"), &out);
        // Its tensor (4 MiB) and communication buffer (4 MiB) on its GPU; the host
        // staging buffer (8 MiB), the next rank's IPC tensor and imported buffer: not
        // charged (before: the host buffer was charged to the GPU).
        assert_eq!(num(&out, "used"), 8 * MIB, "rank {r}: {out}");
        assert_eq!(num(&out, "sum_ok"), 1, "rank {r}: {out}");
        assert_eq!(
            num(&out, "sum"),
            (n * (n + 1) / 2) as u64,
            "rank {r}: {out}"
        );
        assert_eq!(num(&out, "peer_ok"), 1, "rank {r}: {out}");
        assert_eq!(num(&out, "end_used"), 0, "rank {r}: {out}");
        assert_eq!(num(&out, "done"), 1, "rank {r}: {out}");
    }
}

#[test]
fn an_nccl_shaped_ring_all_reduce_over_2_gpus_is_charged_once() {
    ring(2);
}

#[test]
fn an_nccl_shaped_ring_all_reduce_over_4_gpus_is_charged_once() {
    ring(4);
}

#[test]
fn a_vllm_shaped_server_sleeps_and_wakes_beside_a_neighbour_on_a_25_percent_slice() {
    if !py::have_cuda_python() {
        return;
    }
    // A 4 GiB GPU; the server's container and its neighbour each get 1 GiB (25 %).
    let node = node(1, "4Gi");
    let server_c = Container::new("1Gi");
    let neighbour_c = Container::new("1Gi");
    let mut server = py::spawn(&node, Some(&server_c), "vllm_shape.py", &["0.9"]);
    let mut lines = BufReader::new(server.stdout.take().expect("piped stdout")).lines();
    let mut before = String::new();
    for l in lines.by_ref().map_while(Result::ok) {
        before.push_str(&l);
        before.push('\n');
        if l.starts_with("ready") {
            break;
        }
    }
    let q = 1 << 30;
    assert_eq!(num(&before, "cuda_total"), q, "{before}");
    assert_eq!(num(&before, "nvml_total"), q, "{before}");
    let budget = num(&before, "budget");
    assert_eq!(
        budget,
        (q as f64 * 0.9) as u64 / (2 * MIB) * (2 * MIB),
        "{before}"
    );
    assert_eq!(num(&before, "started_free"), q - budget, "{before}");
    assert_eq!(num(&before, "graph_kernels"), 500, "{before}");
    // Asleep: everything given back.
    assert_eq!(num(&before, "slept_free"), q, "{before}");
    // The neighbour takes what it can: its own slice, not the slept memory.
    let grab = py::spawn_ready(&node, Some(&neighbour_c), "grab.py", &["64"]);
    // Wake.
    let mut stdin = server.stdin.take().expect("piped stdin");
    writeln!(stdin, "wake").expect("tell the server to wake");
    drop(stdin);
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    let after = rest.join("\n");
    let status = server.wait().expect("wait for the server");
    assert!(
        status.success(),
        "vllm_shape.py failed: {status}\n{before}{after}"
    );
    assert_eq!(num(&after, "wake"), 0, "{after}");
    assert_eq!(num(&after, "woke_free"), q - budget, "{after}");
    assert_eq!(num(&after, "weights_ok"), 1, "{after}");
    assert_eq!(num(&after, "done"), 1, "{after}");
    py::stop(grab);
}

#[test]
fn the_neighbour_gets_exactly_its_slice() {
    if !py::have_cuda_python() {
        return;
    }
    let node = node(1, "4Gi");
    let c = Container::new("1Gi");
    let mut grab = py::spawn(&node, Some(&c), "grab.py", &["64"]);
    let out = BufReader::new(grab.stdout.take().expect("piped stdout"))
        .lines()
        .map_while(Result::ok)
        .find(|l| l.contains("grabbed="))
        .expect("grabbed=");
    assert_eq!(num(&out, "grabbed"), 1 << 30, "{out}");
    assert_eq!(num(&out, "code"), 2, "{out}");
    py::stop(grab);
}
