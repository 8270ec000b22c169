//! The workspace's binaries, for integration-test packages of their own (ADR 0064).
//!
//! Cargo hands a package's own binaries to its integration tests (`CARGO_BIN_EXE_*`), but
//! the extender's and the plugin's tests are packages of their own (built at opt-level 0)
//! and find the binary where cargo put it: `target/<profile>/<name>`, beside the running
//! test binary's `deps/`. Cargo does not rebuild another package's binary for them, so a
//! binary older than a source file of its package or of the workspace crates it links is
//! stale: an error that says what to build, never a test of old code.

use std::path::{Path, PathBuf};
use std::time::SystemTime;

/// A binary of the workspace: its name, its package, and the directories in the
/// repository whose `src/` it is built from (its package's and the workspace crates it
/// links).
#[derive(Clone, Copy, Debug)]
pub struct Bin {
    /// The binary's name (`[[bin]] name`).
    pub name: &'static str,
    /// Its package's name.
    pub package: &'static str,
    /// Its package's directory and those of the workspace crates it links, relative to
    /// the repository root.
    pub dirs: &'static [&'static str],
}

impl Bin {
    /// `target/<profile>/<name>` of the running test binary's profile; panics, naming the
    /// command to run, when it is missing or older than a file under the `src/` of one of
    /// [`Bin::dirs`]. (Not its library's `.rlib`: a build of one package alone may make a
    /// variant with other features, newer than a binary that is current.)
    pub fn path(self) -> PathBuf {
        let exe = std::env::current_exe().expect("path of the running test binary");
        let deps = exe
            .parent()
            .expect("test binaries live in target/<profile>/deps");
        let dir = deps.parent().expect("deps/ lives in target/<profile>");
        let bin = dir.join(self.name);
        let build = format!(
            "cargo build --release -p {} --bin {}",
            self.package, self.name
        );
        let Some(built) = modified(&bin) else {
            panic!("{} is not built: run `{build}`", bin.display());
        };
        let newer = self
            .dirs
            .iter()
            .filter_map(|d| newest_under(&repo_root().join(d).join("src")))
            .find(|(_, t)| *t > built);
        if let Some((path, _)) = newer {
            panic!(
                "{} is older than {}: stale, run `{build}`",
                bin.display(),
                path.display()
            );
        }
        bin
    }
}

/// The repository root (this crate is `tests/testkit`).
fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn modified(path: &Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

/// The newest file under `dir`, recursively.
fn newest_under(dir: &Path) -> Option<(PathBuf, SystemTime)> {
    let mut best: Option<(PathBuf, SystemTime)> = None;
    let mut todo = vec![dir.to_owned()];
    while let Some(d) = todo.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.filter_map(Result::ok) {
            let path = e.path();
            let Ok(meta) = e.metadata() else { continue };
            if meta.is_dir() {
                todo.push(path);
            } else if let Ok(t) = meta.modified()
                && best.as_ref().is_none_or(|(_, b)| t > *b)
            {
                best = Some((path, t));
            }
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn newest_under_finds_the_newest_file_in_subdirectories() {
        let dir = tempfile_dir();
        std::fs::create_dir_all(dir.join("a/b")).unwrap();
        std::fs::write(dir.join("old"), "x").unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        std::fs::write(dir.join("a/b/new"), "x").unwrap();
        let (path, _) = newest_under(&dir).unwrap();
        assert_eq!(path, dir.join("a/b/new"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn tempfile_dir() -> PathBuf {
        let d = std::env::temp_dir().join(format!("vgpu-bins-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }
}
