//! `vgpu-scheduler-extender`'s integration tests as one test binary (ADR 0045): every file of this
//! directory is a module of it, so the crates they use are compiled and linked once, not
//! once per file. A test is named `<file>::<test>`. `every_file_here_is_a_module` fails
//! when a file is added without its `mod` line below (it would never be compiled).

mod common;
mod context_memory;
mod deploy_flags;
mod fine_sharing;
mod http_bounds;
mod http_fixtures;
mod http_props;
mod kube_serve;
mod kube_state;
mod lifecycle;
mod memory_limit;
mod policy_parity;
mod quota_policies;
mod topology_filter;

/// The extender's binary: this package is not the extender's, so cargo does not hand it
/// over (ADR 0064); a stale one fails the test that wants it.
fn extender_bin() -> std::path::PathBuf {
    vgpu_test_needs::bins::Bin {
        name: "vgpu-scheduler-extender",
        package: "vgpu-scheduler-extender",
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
