//! The workspace's binaries, for integration-test packages of their own (ADR 0064).
//!
//! Cargo hands a package's own binaries to its integration tests (`CARGO_BIN_EXE_*`), but
//! the integration tests of `vgpu-tests`, the daemon, the extender and the plugin are
//! packages of their own (built at opt-level 0) and find the binary where cargo put it:
//! `target/<profile>/<name>`, beside the running test binary's `deps/`. Cargo does not
//! rebuild another package's binary for them, so a binary older than one of the source
//! files it was built from is stale: an error that says what to build, never a test of
//! old code. The sources are the ones cargo itself rebuilds the binary for: those its
//! dep-info file (`target/<profile>/<name>.d`) lists.

use std::path::{Path, PathBuf};
use std::time::SystemTime;

/// A binary of the workspace: its name and its package.
#[derive(Clone, Copy, Debug)]
pub struct Bin {
    /// The binary's name (`[[bin]] name`).
    pub name: &'static str,
    /// Its package's name.
    pub package: &'static str,
}

impl Bin {
    /// `target/<profile>/<name>` of the running test binary's profile; panics, naming the
    /// command to run, when it is missing, when its dep-info is, or when it is older than
    /// one of the sources its dep-info lists (or one of them is gone).
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
        let info = dir.join(format!("{}.d", self.name));
        let Ok(text) = std::fs::read_to_string(&info) else {
            panic!(
                "{} has no dep-info at {}: run `{build}`",
                bin.display(),
                info.display()
            );
        };
        if let Some(why) = stale_because(&dep_info_sources(&text), built) {
            panic!("{} is stale ({why}): run `{build}`", bin.display());
        }
        bin
    }
}

/// The sources a dep-info file (`<target>: <source> <source> …`, spaces in a path escaped
/// as `\ `) lists for its target: the first line's, after the target.
pub fn dep_info_sources(text: &str) -> Vec<PathBuf> {
    let line = text.lines().next().unwrap_or("");
    // The target ends at the first unescaped ": ".
    let mut rest = None;
    let mut escaped = false;
    for (i, c) in line.char_indices() {
        if escaped {
            escaped = false;
        } else if c == '\\' {
            escaped = true;
        } else if c == ':' && line[i + 1..].starts_with(' ') {
            rest = Some(&line[i + 1..]);
            break;
        }
    }
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut escaped = false;
    for c in rest.unwrap_or("").chars() {
        match (escaped, c) {
            (true, c) => {
                cur.push(c);
                escaped = false;
            }
            (false, '\\') => escaped = true,
            (false, ' ') => {
                if !cur.is_empty() {
                    out.push(PathBuf::from(std::mem::take(&mut cur)));
                }
            }
            (false, c) => cur.push(c),
        }
    }
    if !cur.is_empty() {
        out.push(PathBuf::from(cur));
    }
    out
}

/// Why a binary built at `built` from `sources` is stale (None: it is not): a source
/// newer than it, or one that is gone.
fn stale_because(sources: &[PathBuf], built: SystemTime) -> Option<String> {
    sources.iter().find_map(|s| match modified(s) {
        None => Some(format!("{} is gone", s.display())),
        Some(t) if t > built => Some(format!("{} is newer", s.display())),
        Some(_) => None,
    })
}

fn modified(path: &Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dep_info_lists_the_targets_sources_with_escaped_spaces() {
        let text = "/t/release/probe: /r/core/src/lib.rs /r/my\\ dir/a.rs  /r/b.rs\n\n/r/core/src/lib.rs:\n";
        assert_eq!(
            dep_info_sources(text),
            vec![
                PathBuf::from("/r/core/src/lib.rs"),
                PathBuf::from("/r/my dir/a.rs"),
                PathBuf::from("/r/b.rs"),
            ]
        );
        // A target path with an escaped colon-space is not cut there.
        assert_eq!(
            dep_info_sources("/t/a\\: b: /s.rs"),
            vec![PathBuf::from("/s.rs")]
        );
        assert!(dep_info_sources("").is_empty());
        assert!(dep_info_sources("/t/x:").is_empty());
    }

    #[test]
    fn a_newer_or_missing_source_makes_the_binary_stale() {
        let dir = std::env::temp_dir().join(format!("vgpu-bins-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create the test directory");
        let old = dir.join("old.rs");
        std::fs::write(&old, "x").expect("write old.rs");
        let built = modified(&old).expect("old.rs's time");
        assert_eq!(stale_because(std::slice::from_ref(&old), built), None);
        let later = built + std::time::Duration::from_secs(5);
        let new = dir.join("new.rs");
        std::fs::write(&new, "x").expect("write new.rs");
        let f = std::fs::File::options()
            .write(true)
            .open(&new)
            .expect("open new.rs");
        f.set_modified(later).expect("set new.rs's time");
        let why = stale_because(&[old.clone(), new.clone()], built).expect("stale");
        assert!(why.contains("new.rs is newer"), "{why}");
        let gone = dir.join("gone.rs");
        let why = stale_because(&[old, gone], built).expect("stale");
        assert!(why.contains("gone.rs is gone"), "{why}");
        std::fs::remove_dir_all(&dir).expect("remove the test directory");
    }
}
