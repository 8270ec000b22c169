//! The VMM API by location under the shim (issue 41 item 1, ADR 0049): `cuMemCreate` is
//! charged to the device its location names and never for host memory
//! (`CU_MEM_LOCATION_TYPE_HOST`, `_HOST_NUMA`, as NCCL ≥ 2.23 allocates), and the charge
//! follows the driver's life of the memory: a handle released while mapped stays
//! charged until its last unmap, a retained one until its last release. Real
//! cuda-python processes on the simulated node.

use vgpu_tests::{Container, SimNode, num};

use super::workload_py as py;

const MIB: u64 = 1 << 20;
const OOM: u64 = 2;
const INVALID_VALUE: u64 = 1;

fn node() -> SimNode {
    SimNode::new(
        r#"
        [[device]]
        memory = "8Gi"
        context_overhead = "300Mi"
        alloc_granularity = "2Mi"
        "#,
    )
}

#[test]
fn host_located_vmm_is_never_charged_and_released_mapped_memory_stays_charged() {
    if !py::have_cuda_python() {
        return;
    }
    let node = node();
    let c = Container::new("256Mi");
    let out = py::run(&node, Some(&c), "vmm_location.py", &[]);
    let q = 256 * MIB;
    assert_eq!(num(&out, "free0"), q, "{out}");
    // 512 MiB of host memory, twice the quota, mapped and written: not charged (before:
    // CUDA_ERROR_OUT_OF_MEMORY, the shim charged it to the current GPU).
    for kind in ["host", "host_numa"] {
        assert_eq!(num(&out, &format!("{kind}_create")), 0, "{kind}: {out}");
        assert_eq!(num(&out, &format!("{kind}_free")), q, "{kind}: {out}");
    }
    // The driver refuses this location for cuMemCreate; the shim does not turn it into
    // an out-of-memory.
    assert_eq!(
        num(&out, "host_numa_current_create"),
        INVALID_VALUE,
        "{out}"
    );
    assert_eq!(num(&out, "dev_free"), q - 128 * MIB, "{out}");
    // Released while mapped: the memory is still there, so is its charge (before: free
    // went back to 256 MiB and a 192 MiB cuMemAlloc beside the mapped 128 MiB
    // succeeded, 320 MiB on a 256 MiB quota).
    assert_eq!(num(&out, "released_mapped_free"), q - 128 * MIB, "{out}");
    assert_eq!(num(&out, "over_while_mapped"), OOM, "{out}");
    assert_eq!(num(&out, "unmapped_free"), q, "{out}");
    // NCCL's free: retain, release, unmap, release.
    assert_eq!(num(&out, "retained_released_free"), q - 64 * MIB, "{out}");
    assert_eq!(num(&out, "unmapped_referenced_free"), q - 64 * MIB, "{out}");
    assert_eq!(num(&out, "end_free"), q, "{out}");
}

#[test]
fn the_simulator_creates_host_located_vmm_as_the_driver_documents() {
    if !py::have_cuda_python() {
        return;
    }
    let node = node();
    let out = py::run(&node, None, "vmm_location.py", &[]);
    let free0 = num(&out, "free0");
    for kind in ["host", "host_numa"] {
        assert_eq!(num(&out, &format!("{kind}_create")), 0, "{kind}: {out}");
        assert_eq!(num(&out, &format!("{kind}_free")), free0, "{kind}: {out}");
    }
    assert_eq!(
        num(&out, "host_numa_current_create"),
        INVALID_VALUE,
        "{out}"
    );
    // The driver frees released memory at its last unmap.
    assert_eq!(
        num(&out, "released_mapped_free"),
        free0 - 128 * MIB,
        "{out}"
    );
    assert_eq!(num(&out, "unmapped_free"), free0, "{out}");
}

#[test]
fn a_sibling_sees_the_quota_as_total_and_the_vmm_it_holds_as_used() {
    if !py::have_cuda_python() {
        return;
    }
    let node = node();
    let c = Container::new("512Mi");
    // A sibling holds 128 MiB of device VMM memory and 512 MiB of host VMM memory.
    let held: Vec<_> = [("128", "device"), ("512", "host")]
        .into_iter()
        .map(|(mib, at)| py::spawn_ready(&node, Some(&c), "hold_vmm.py", &[mib, at]))
        .collect();
    let out = py::run(&node, Some(&c), "meminfo_views.py", &[]);
    let (q, used) = (512 * MIB, 128 * MIB);
    for key in ["cuda_total", "cuda_totalmem", "nvml_total", "nvml2_total"] {
        assert_eq!(num(&out, key), q, "{key}: {out}");
    }
    for key in ["cuda_free", "nvml_free", "nvml2_free"] {
        assert_eq!(num(&out, key), q - used, "{key}: {out}");
    }
    for key in ["nvml_used", "nvml2_used"] {
        assert_eq!(num(&out, key), used, "{key}: {out}");
    }
    held.into_iter().for_each(py::stop);
}
