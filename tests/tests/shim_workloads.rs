//! The workloads people run on shared GPUs, as real multi-process programs on the
//! simulated node under quotas (issue 41 item 6; scripts in `tests/python/workloads`):
//! an NCCL-shaped ring all-reduce over 2 and 4 GPUs (cuMem device and host buffers, IPC
//! handles, POSIX-fd shareable handles, peer copies, one process per GPU), and a
//! vLLM-shaped start-up (KV cache sized from CUDA's and NVML's total, a CUDA graph of 500
//! kernels captured and replayed, sleep and wake through unmap/release/re-create) beside a
//! neighbour that tries to take the slept memory; PyTorch's caching allocator (the
//! classic cuMemAlloc block cache with `empty_cache` and its free-and-retry on a refusal,
//! and expandable segments: one reserved range grown and shrunk by 20 MiB VMM pages); and
//! SGLang's memory saver (pause: unmap and release keeping the addresses; resume:
//! re-create and re-map there) beside a neighbour and a sibling. Each: no crash, memory
//! charged exactly once, nothing over quota, a refusal clean.

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

/// A script's output lines, read as it goes.
type Lines = std::io::Lines<BufReader<std::process::ChildStdout>>;

/// Starts `script` and reads its output up to (and with) its next line starting with
/// `ready`: (the child, its output lines to come, what it printed so far).
fn start(
    node: &SimNode,
    c: &Container,
    script: &str,
    args: &[&str],
) -> (std::process::Child, Lines, String) {
    let mut child = py::spawn(node, Some(c), script, args);
    let mut lines = BufReader::new(child.stdout.take().expect("piped stdout")).lines();
    let out = until_ready(&mut lines);
    (child, lines, out)
}

/// The lines up to (and with) the next one starting with `ready` (all that is left if
/// none does).
fn until_ready(lines: &mut Lines) -> String {
    let mut out = String::new();
    for l in lines.by_ref().map_while(Result::ok) {
        out.push_str(&l);
        out.push('\n');
        if l.starts_with("ready") {
            break;
        }
    }
    out
}

/// The value of `key` on the line of step `step` (`step=NAME reserved=… used=…`).
fn at_step(out: &str, step: &str, key: &str) -> u64 {
    let line = out
        .lines()
        .find(|l| l.starts_with(&format!("step={step} ")))
        .unwrap_or_else(|| panic!("no step={step} in:\n{out}"));
    num(line, key)
}

/// Closes the script's stdin, reads the rest of its output, and checks it succeeded.
fn finish(mut child: std::process::Child, lines: Lines, script: &str) -> String {
    drop(child.stdin.take());
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    let out = child.wait_with_output().expect("wait for the script");
    assert!(
        out.status.success(),
        "{script} failed ({}):\n{}\nstderr:\n{}",
        out.status,
        rest.join("\n"),
        String::from_utf8_lossy(&out.stderr)
    );
    rest.join("\n")
}

/// What a sibling in the container reads of device 0 through CUDA and NVML (v1, v2):
/// (CUDA used, NVML v1 used, NVML v2 used), each total being the quota `q`.
fn sibling_view(node: &SimNode, c: &Container, q: u64) -> (u64, u64, u64) {
    let v = py::run(node, Some(c), "meminfo_views.py", &[]);
    for k in ["cuda_total", "cuda_totalmem", "nvml_total", "nvml2_total"] {
        assert_eq!(num(&v, k), q, "{k}: {v}");
    }
    (
        q - num(&v, "cuda_free"),
        num(&v, "nvml_used"),
        num(&v, "nvml2_used"),
    )
}

#[test]
fn a_pytorch_caching_allocator_is_charged_what_it_caches_and_empty_cache_gives_it_back() {
    if !py::have_cuda_python() {
        return;
    }
    let node = node(1, "4Gi");
    let c = Container::new("1Gi");
    let q = 1 << 30;
    let (child, lines, out) = start(&node, &c, "torch_alloc.py", &["blocks"]);
    // 40 × 512 KiB in 2 MiB segments (20 MiB), 9 × 6 MiB in 20 MiB segments (60 MiB),
    // 3 × 100 MiB: 380 MiB held from the driver, charged exactly that.
    assert_eq!(at_step(&out, "loaded", "used"), 380 * MIB, "{out}");
    // Freed tensors stay in the cache: still charged.
    assert_eq!(at_step(&out, "cached", "used"), 380 * MIB, "{out}");
    // A request beyond the free quota: refused, the cache emptied (240 MiB given back),
    // the retry served.
    let big = num(&out, "retried_big");
    assert_eq!(at_step(&out, "retried", "used"), 140 * MIB + big, "{out}");
    // The whole quota beside live tensors: a clean CUDA_ERROR_OUT_OF_MEMORY, nothing
    // charged for it.
    assert_eq!(num(&out, "oom_clean"), 1, "{out}");
    assert_eq!(at_step(&out, "after_oom", "used"), 140 * MIB + big, "{out}");
    // A sibling of the container sees the allocator's memory, once, through both APIs.
    let held = 140 * MIB + big;
    assert_eq!(sibling_view(&node, &c, q), (held, held, held));
    let rest = finish(child, lines, "torch_alloc.py blocks");
    assert_eq!(at_step(&rest, "emptied", "used"), 0, "{rest}");
    assert_eq!(num(&rest, "done"), 1, "{rest}");
    assert_eq!(sibling_view(&node, &c, q), (0, 0, 0));
}

#[test]
fn pytorch_expandable_segments_grow_and_shrink_charged_exactly() {
    if !py::have_cuda_python() {
        return;
    }
    let node = node(1, "4Gi");
    let c = Container::new("1Gi");
    let q = 1 << 30;
    let (child, lines, out) = start(&node, &c, "torch_alloc.py", &["expandable"]);
    // A range of 9/8 of the quota reserved: virtual, not charged.
    assert_eq!(num(&out, "max_pages"), 58, "{out}");
    // 20 tensors of 50 MiB: 50 pages of 20 MiB; the 21st growth mapped page 51, was
    // refused page 52 and rolled back: 1000 MiB charged, not 1020.
    assert_eq!(num(&out, "tensors"), 20, "{out}");
    assert_eq!(at_step(&out, "grown", "used"), 1000 * MIB, "{out}");
    // Shrunk page by page (unmap, release) to the live half: 25 pages.
    assert_eq!(at_step(&out, "shrunk", "used"), 500 * MIB, "{out}");
    assert_eq!(at_step(&out, "regrown", "used"), 700 * MIB, "{out}");
    // One cuMemUnmap over ten pages, then their releases.
    assert_eq!(at_step(&out, "shrunk_at_once", "used"), 500 * MIB, "{out}");
    assert_eq!(
        sibling_view(&node, &c, q),
        (500 * MIB, 500 * MIB, 500 * MIB)
    );
    let rest = finish(child, lines, "torch_alloc.py expandable");
    assert_eq!(at_step(&rest, "closed", "used"), 0, "{rest}");
    assert_eq!(num(&rest, "done"), 1, "{rest}");
}

#[test]
fn an_sglang_memory_saver_pauses_and_resumes_beside_a_neighbour_and_a_sibling() {
    if !py::have_cuda_python() {
        return;
    }
    let node = node(1, "4Gi");
    let server_c = Container::new("1Gi");
    let neighbour_c = Container::new("1Gi");
    let (mut server, mut lines, out) = start(&node, &server_c, "memory_saver.py", &[]);
    // Weights 2 × 64 MiB and a KV cache of 8 × 64 MiB, each its own handle and range.
    assert_eq!(num(&out, "started_used"), 640 * MIB, "{out}");
    let mut stdin = server.stdin.take().expect("piped stdin");
    writeln!(stdin, "pause").expect("tell the server to pause");
    let out = until_ready(&mut lines);
    // Paused: the physical memory released, the addresses kept, nothing charged.
    assert_eq!(num(&out, "paused_used"), 0, "{out}");
    // A neighbour container takes what it can while the server is paused: its own
    // slice, not the server's.
    let (grab, _grab_lines, g) = start(&node, &neighbour_c, "grab.py", &["64"]);
    assert_eq!(num(&g, "grabbed"), 1 << 30, "{g}");
    assert_eq!(num(&g, "code"), 2, "{g}");
    // A sibling in the server's own container takes 512 MiB of its quota meanwhile.
    let (sibling, _sib_lines, s) = start(&node, &server_c, "grab.py", &["64", "512"]);
    assert_eq!(num(&s, "grabbed"), 512 * MIB, "{s}");
    // Resume over the quota: refused (CUDA_ERROR_OUT_OF_MEMORY) part way; what it mapped
    // is given back, so only the sibling's 512 MiB stays charged.
    writeln!(stdin, "resume").expect("ask for a resume");
    let out = until_ready(&mut lines);
    assert_eq!(num(&out, "resume"), 2, "{out}");
    assert_eq!(num(&out, "used"), 512 * MIB, "{out}");
    assert!(out.contains("ready paused"), "{out}");
    // The sibling gone, the resume succeeds, at the same addresses, weights restored.
    py::stop(sibling);
    writeln!(stdin, "resume").expect("ask for a resume");
    let out = until_ready(&mut lines);
    assert_eq!(num(&out, "resume"), 0, "{out}");
    assert_eq!(num(&out, "used"), 640 * MIB, "{out}");
    assert_eq!(num(&out, "weights_ok"), 1, "{out}");
    writeln!(stdin, "end").expect("tell the server to end");
    drop(stdin);
    let rest = finish(server, lines, "memory_saver.py");
    assert_eq!(num(&rest, "end_used"), 0, "{rest}");
    assert_eq!(num(&rest, "done"), 1, "{rest}");
    py::stop(grab);
}
