//! Memory shared between processes under the shim (issue 41 item 4): a `cuMemAlloc`
//! allocation exported with `cuIpcGetMemHandle` and a VMM allocation exported as a POSIX
//! file descriptor (`cuMemExportToShareableHandle`) are charged once, to the container
//! that allocated them; an importer in the same or another container, on the same or
//! another GPU, maps and reads them uncharged and cannot free them (`cuMemFree` of an
//! opened pointer is `CUDA_ERROR_INVALID_VALUE`); closing twice is an error, not a crash.
//! Real cuda-python processes on a simulated 2-GPU node (the simulator exported none of
//! these before: `cuIpcGetMemHandle` was missing).

use vgpu_tests::{Container, SimNode, field, num};

use super::workload_py as py;

const MIB: u64 = 1 << 20;
const INVALID_VALUE: u64 = 1;

fn node() -> SimNode {
    SimNode::new(
        r#"
        [[device]]
        memory = "8Gi"
        context_overhead = "300Mi"
        alloc_granularity = "2Mi"
        [[device]]
        memory = "8Gi"
        context_overhead = "300Mi"
        alloc_granularity = "2Mi"
        "#,
    )
}

/// The first line of `child`'s output that holds `key=`.
fn line_with(child: &mut std::process::Child, key: &str) -> String {
    use std::io::{BufRead, BufReader};
    let out = child.stdout.take().expect("piped stdout");
    let mut lines = BufReader::new(out).lines();
    let line = lines
        .by_ref()
        .map_while(Result::ok)
        .find(|l| l.contains(&format!("{key}=")))
        .unwrap_or_else(|| panic!("no {key}= from the exporter"));
    // Wait for `ready` (the memory is shared from then on).
    let ready = lines.map_while(Result::ok).any(|l| l.starts_with("ready"));
    assert!(ready, "the exporter did not become ready");
    line
}

#[test]
fn an_ipc_handle_is_charged_once_to_its_allocator_and_importers_cannot_free_it() {
    if !py::have_cuda_python() {
        return;
    }
    let node = node();
    let a = Container::new("256Mi");
    let b = Container::new("256Mi");
    let mut exporter = py::spawn(&node, Some(&a), "ipc_share.py", &["export-mem", "128", "0"]);
    let line = line_with(&mut exporter, "handle");
    let handle = field(&line, "handle").expect("handle=");
    assert_eq!(num(&line, "free"), 128 * MIB, "{line}");
    // A sibling of the exporter on the same GPU, and a process of another container on
    // the other GPU (peer access through the handle's lazy flag).
    for (c, dev, free) in [(&a, "0", 128 * MIB), (&b, "1", 256 * MIB)] {
        let out = py::run(
            &node,
            Some(c),
            "ipc_share.py",
            &["import-mem", &handle, dev],
        );
        for key in [
            "before_free",
            "opened_free",
            "after_free_attempt",
            "end_free",
        ] {
            assert_eq!(num(&out, key), free, "device {dev}, {key}: {out}");
        }
        assert_eq!(num(&out, "free_imported"), INVALID_VALUE, "{out}");
        assert_eq!(num(&out, "close"), 0, "{out}");
        assert_eq!(num(&out, "close_again"), INVALID_VALUE, "{out}");
    }
    // Still charged once, to the exporter's container.
    let out = py::run(&node, Some(&a), "meminfo_views.py", &[]);
    assert_eq!(num(&out, "cuda_free"), 128 * MIB, "{out}");
    py::stop(exporter);
}

#[test]
fn a_vmm_allocation_shared_as_a_file_descriptor_is_charged_once() {
    if !py::have_cuda_python() {
        return;
    }
    let node = node();
    let a = Container::new("256Mi");
    let b = Container::new("256Mi");
    let mut exporter = py::spawn(&node, Some(&a), "ipc_share.py", &["export-vmm", "64", "1"]);
    let line = line_with(&mut exporter, "fd");
    let fd = field(&line, "fd").expect("fd=");
    let pid = exporter.id().to_string();
    assert_eq!(num(&line, "free"), 192 * MIB, "{line}");
    for (c, dev, free) in [(&a, "1", 192 * MIB), (&b, "0", 256 * MIB)] {
        let out = py::run(
            &node,
            Some(c),
            "ipc_share.py",
            &["import-vmm", &pid, &fd, "64", dev],
        );
        for key in ["before_free", "imported_free", "end_free"] {
            assert_eq!(num(&out, key), free, "device {dev}, {key}: {out}");
        }
        assert_eq!(num(&out, "release"), 0, "{out}");
    }
    py::stop(exporter);
}
