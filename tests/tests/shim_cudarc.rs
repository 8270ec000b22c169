//! cudarc, an unmodified third-party Rust client that `dlopen`s the driver and resolves
//! every entry point with `dlsym`, inside a container with a 256 MiB quota: the quota is
//! what it sees and where its allocations stop.
//!
//! The scenario runs in a fresh copy of this test binary started with `LD_PRELOAD` of
//! libvgpu.so over the simulator; the parent only checks that the child passed.

use std::process::Command;

use cudarc::driver::sys::cudaError_enum;
use cudarc::driver::{CudaContext, DriverError};
use vgpu_tests::{shim_lib, sim_lib_dir};

const CHILD: &str = "VGPU_SHIM_CUDARC_CHILD";
const MIB: usize = 1 << 20;

#[test]
fn cudarc_is_enforced_through_dlsym() {
    if std::env::var_os(CHILD).is_some() {
        return;
    }
    let state = tempfile::tempdir().expect("tempdir");
    let out = Command::new(std::env::current_exe().expect("test binary path"))
        .args([
            "shim_cudarc::cudarc_child",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, "1")
        .env("LD_LIBRARY_PATH", sim_lib_dir())
        .env("LD_PRELOAD", shim_lib())
        .env("VGPU_SIM_DIR", state.path().join("sim"))
        .env("VGPU_CONTAINER_DIR", state.path().join("container"))
        .env("VGPU_MEMORY_LIMIT", "256Mi")
        .env_remove("VGPU_SIM_CONFIG")
        .output()
        .expect("run the cudarc child");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "cudarc scenario failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    assert!(
        stdout.contains("cudarc under the shim: done"),
        "the child did not run the scenario:\n{stdout}\n{stderr}"
    );
}

fn is_oom(e: &DriverError) -> bool {
    e.0 == cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY
}

/// The scenario; does nothing unless started by [`cudarc_is_enforced_through_dlsym`].
#[test]
fn cudarc_child() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    let ctx = CudaContext::new(0).expect("primary context on device 0");
    assert_eq!(ctx.total_mem().expect("total mem"), 256 * MIB);
    assert_eq!(
        ctx.mem_get_info().expect("mem info"),
        (256 * MIB, 256 * MIB)
    );
    let stream = ctx.default_stream();
    let a = stream.alloc_zeros::<u8>(254 * MIB).expect("254 MiB fit");
    let e = stream
        .alloc_zeros::<u8>(2 * MIB + 1)
        .expect_err("2 MiB + 1 byte is over the quota");
    assert!(is_oom(&e), "{e:?}");
    let b = stream
        .alloc_zeros::<u8>(2 * MIB)
        .expect("the last 2 MiB fit");
    assert_eq!(ctx.mem_get_info().expect("mem info").0, 0);
    drop(a);
    drop(b);
    stream.synchronize().expect("synchronize");
    assert_eq!(ctx.mem_get_info().expect("mem info").0, 256 * MIB);
    println!("cudarc under the shim: done");
}
