//! Stream-ordered pools and frees the shim did not charge (issue 41 item 3): an
//! allocation from a created pool (`cuMemAllocFromPoolAsync`) is charged and refused
//! over the quota; a free of an unknown pointer, a double free, a free of host memory
//! with `cuMemFree` and a release of an unknown handle return the driver's
//! `CUDA_ERROR_INVALID_VALUE` (HAMi-core returned non-`CUresult` values there) and change
//! no charge. cuda-python, unmodified (`cuGetProcAddress` route). This held before issue
//! 41 too; the test keeps it.

use vgpu_tests::{Container, SimNode, num};

use super::workload_py as py;

const MIB: u64 = 1 << 20;

#[test]
fn pool_allocations_are_charged_and_bad_frees_return_invalid_value() {
    if !py::have_cuda_python() {
        return;
    }
    let node = SimNode::new(
        r#"
        [[device]]
        memory = "8Gi"
        context_overhead = "300Mi"
        alloc_granularity = "2Mi"
        "#,
    );
    let c = Container::new("256Mi");
    let out = py::run(&node, Some(&c), "pool_frees.py", &[]);
    assert_eq!(num(&out, "free0"), 256 * MIB, "{out}");
    assert_eq!(num(&out, "pool_alloc_free"), 192 * MIB, "{out}");
    assert_eq!(num(&out, "pool_over"), 2, "{out}");
    for key in [
        "free_bogus",
        "free_async_bogus",
        "release_bogus",
        "double_free",
        "free_host_as_device",
    ] {
        assert_eq!(num(&out, key), 1, "{key}: {out}");
    }
    assert_eq!(num(&out, "after_bad_frees"), 192 * MIB, "{out}");
    assert_eq!(num(&out, "end_free"), 256 * MIB, "{out}");
}
