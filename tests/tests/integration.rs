//! `vgpu-tests`'s integration tests as one test binary (ADR 0045), a package of its own
//! built at opt-level 0 (ADR 0064): every file of this directory is a module of it, so
//! the crates they use are compiled and linked once, not once per file. A test is named `<file>::<test>`. `every_file_here_is_a_module` fails
//! when a file is added without its `mod` line below (it would never be compiled).

mod common;
mod cuda_sim;
mod cuda_sim_checkpoint;
mod cuda_sim_devcgroup;
mod cuda_sim_pidns;
mod device_plugin_audit;
mod device_plugin_daemon;
mod device_plugin_shim;
mod ebpf_daemon;
mod extender_init_reuse;
mod hostile_quota;
mod operators_view;
mod pidns_bypass;
mod shim;
mod shim_coverage;
mod shim_cudarc;
mod shim_entry_points;
mod shim_exit;
mod shim_fuzz;
mod shim_graph_cap;
mod shim_hostile_region;
mod shim_ipc;
mod shim_pidns;
mod shim_pools;
mod shim_pools_frees;
mod shim_quota_env;
mod shim_quota_file;
mod shim_topology;
mod shim_visible;
mod shim_visible_memory;
mod shim_vmm;
mod shim_workloads;
mod workload_py;

/// Every `.rs` file beside this one is declared above: a test file left out would
/// silently never run.
#[test]
fn every_file_here_is_a_module() {
    let missing = vgpu_test_needs::undeclared_test_files(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")),
        include_str!("integration.rs"),
    )
    .expect("read the tests directory");
    assert!(
        missing.is_empty(),
        "test files not declared in tests/integration.rs: {missing:?}"
    );
}

/// The shim is not linked into this binary. `libvgpu.so` interposes `dlsym`, so a program
/// that links the shim's crate runs its own `dlsym` calls through the shim's hook: NVML
/// loaded in-process (the daemon's watcher, the plugin's audit in these tests) then answers
/// as the shim's filtered view, and a bypass is never seen. Tests of the shim's own
/// functions belong in `shim/` (e.g. `shim/tests/quota_file_fuzz.rs`).
#[test]
#[allow(unsafe_code)] // dladdr, on libc's own function
fn dlsym_here_is_libcs_not_the_shims() {
    let f: unsafe extern "C" fn(*mut libc::c_void, *const libc::c_char) -> *mut libc::c_void =
        libc::dlsym;
    let mut info = std::mem::MaybeUninit::<libc::Dl_info>::zeroed();
    // SAFETY: `info` is writable for one Dl_info; dladdr only reads the address.
    let found = unsafe { libc::dladdr(f as *const libc::c_void, info.as_mut_ptr()) };
    assert_ne!(found, 0, "dladdr found no object for dlsym");
    // SAFETY: dladdr succeeded, so it initialised `info`; dli_fname is a C string.
    let object = unsafe { std::ffi::CStr::from_ptr(info.assume_init().dli_fname) };
    let object = object.to_string_lossy();
    assert!(
        object.contains("libc.so") || object.contains("libdl.so"),
        "dlsym resolves into {object}: a test module links the shim's crate (`vgpu::…`)"
    );
}
