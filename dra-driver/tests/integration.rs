//! `vgpu-dra-driver`'s integration tests as one test binary (ADR 0045): every file of this
//! directory is a module of it. A test is named `<file>::<test>`.
//! `every_file_here_is_a_module` fails when a file is added without its `mod` line.

mod kubelet;

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
