//! `vgpu-daemon`'s integration tests as one test binary (ADR 0045): every file of this
//! directory is a module of it, so the crates they use are compiled and linked once, not
//! once per file. A test is named `<file>::<test>`. `every_file_here_is_a_module` fails
//! when a file is added without its `mod` line below (it would never be compiled).

mod api;
mod binary;
mod claims;
mod common;
mod deploy_flags;
mod drains;
mod ebpf_binary;
mod ebpf_fail_closed;
mod flood;
mod hand_on;
mod lifecycle;
mod metrics;
mod nvml_watcher;
mod peers;
mod refusal_events;
mod registration;
mod scheduling;
mod second_line;
mod stopped;
mod suspension;
mod top;

/// The daemon's binary: this package is not the daemon's, so cargo does not hand it over
/// (ADR 0064); a stale one fails the test that wants it.
fn daemon_bin() -> std::path::PathBuf {
    vgpu_test_needs::bins::Bin {
        name: "vgpu-daemon",
        package: "vgpu-daemon",
    }
    .path()
}

/// `vgpuctl`, found as [`daemon_bin`] is.
fn vgpuctl_bin() -> std::path::PathBuf {
    vgpu_test_needs::bins::Bin {
        name: "vgpuctl",
        package: "vgpu-daemon",
    }
    .path()
}

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
