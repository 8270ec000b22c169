//! The test packages' one-binary layout (ADR 0045): every `.rs` file beside a package's
//! `integration.rs` must be declared there as `mod name;`, or it silently never runs.

use std::path::Path;

/// The `.rs` files in `dir` (other than `integration.rs`) that `integration_rs`, the text
/// of that file, does not declare with a line `mod <name>;`.
pub fn undeclared_test_files(dir: &Path, integration_rs: &str) -> std::io::Result<Vec<String>> {
    let mut missing = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let name = entry?.file_name();
        let name = name.to_string_lossy();
        if let Some(module) = name.strip_suffix(".rs")
            && module != "integration"
            && !integration_rs
                .lines()
                .any(|l| l == format!("mod {module};"))
        {
            missing.push(name.into_owned());
        }
    }
    missing.sort();
    Ok(missing)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_undeclared_file_is_listed_and_declared_ones_and_integration_are_not() {
        let dir = std::env::temp_dir().join(format!("vgpu-needs-modules-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for f in ["integration.rs", "a.rs", "b.rs", "notes.txt"] {
            std::fs::write(dir.join(f), "").unwrap();
        }
        let missing = undeclared_test_files(&dir, "mod a;\n// mod b;\n").unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(missing, vec!["b.rs".to_string()]);
    }
}
