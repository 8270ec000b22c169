//! `vgpu-device-plugin`'s integration tests as one test binary (ADR 0045): every file of this
//! directory is a module of it, so the crates they use are compiled and linked once, not
//! once per file. A test is named `<file>::<test>`. `every_file_here_is_a_module` fails
//! when a file is added without its `mod` line below (it would never be compiled).

mod binary;
mod deploy_manifests;
mod kubelet;
mod kubelet_fine;
mod kubelet_topology;
mod lifecycle;
mod nvml_health;
mod topology;

/// The plugin's binary: this package is not the plugin's, so cargo does not hand it over
/// (ADR 0064); a stale one fails the test that wants it.
fn plugin_bin() -> std::path::PathBuf {
    vgpu_test_needs::bins::Bin {
        name: "vgpu-device-plugin",
        package: "vgpu-device-plugin",
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
