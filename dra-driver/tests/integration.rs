//! `vgpu-dra-driver`'s integration tests as one test binary (ADR 0045): every file of this
//! directory is a module of it. A test is named `<file>::<test>`.
//! `every_file_here_is_a_module` fails when a file is added without its `mod` line.

mod kubelet;

/// Every `.rs` file beside this one is declared above: a test file left out would
/// silently never run.
#[test]
fn every_file_here_is_a_module() {
    let me = include_str!("integration.rs");
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut missing = Vec::new();
    for entry in std::fs::read_dir(dir).expect("read the tests directory") {
        let name = entry.expect("a directory entry").file_name();
        let name = name.to_string_lossy();
        if let Some(module) = name.strip_suffix(".rs")
            && module != "integration"
            && !me.lines().any(|l| l == format!("mod {module};"))
        {
            missing.push(name.into_owned());
        }
    }
    assert!(
        missing.is_empty(),
        "test files not declared in tests/integration.rs: {missing:?}"
    );
}
