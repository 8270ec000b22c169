//! A process in a container as the device plugin makes one (ADR 0042): the container's
//! directory mounted read-only at `/etc/vgpu` in the process's own mount namespace, where
//! the shim, the daemon (trusted mode) and the plugin's audit read its quota through
//! `/proc/PID/root`. `/etc` itself is an overlay whose upper layer is on a tmpfs, so the
//! host's `/etc` is never written.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// Mounts, in the caller's (private) mount namespace, a tmpfs at `$1`, an overlay of
/// `/etc` with its upper layer there, the container directory `$2` read-only at
/// `/etc/vgpu`, then runs the rest, with the shim `$3` preloaded unless `$3` is empty.
const SCRIPT: &str = r#"set -e
t=$1; c=$2; shim=$3; shift 3
mount -t tmpfs tmpfs "$t"
mkdir "$t/up" "$t/work"
mount -t overlay overlay -o "lowerdir=/etc,upperdir=$t/up,workdir=$t/work" /etc
mkdir -p /etc/vgpu
mount --bind "$c" /etc/vgpu
mount -o remount,bind,ro /etc/vgpu
if [ -n "$shim" ]; then exec env LD_PRELOAD="$shim" "$@"; fi
exec env -u LD_PRELOAD "$@""#;

/// The scratch directory (the overlay's tmpfs mount point) of one container's processes.
#[derive(Debug)]
pub struct PluginMount {
    _root: tempfile::TempDir,
    scratch: PathBuf,
}

impl Default for PluginMount {
    fn default() -> PluginMount {
        PluginMount::new()
    }
}

impl PluginMount {
    /// A fresh scratch directory.
    pub fn new() -> PluginMount {
        let root = tempfile::tempdir().expect("temporary directory");
        let scratch = root.path().join("etc-overlay");
        std::fs::create_dir(&scratch).expect("overlay directory");
        PluginMount {
            _root: root,
            scratch,
        }
    }

    /// The arguments, after a command that enters a new mount namespace (`unshare
    /// --mount --propagation private`, or `--user --map-root-user --pid --fork
    /// --mount-proc`), that run `program` with `dir` at `/etc/vgpu`, under the shim
    /// `preload` when given (else with `LD_PRELOAD` removed). `program`'s own
    /// arguments follow. Each call is for one process: the scratch tmpfs is mounted
    /// afresh in that process's namespace.
    pub fn args(&self, dir: &Path, preload: Option<&Path>, program: &Path) -> Vec<OsString> {
        vec![
            "sh".into(),
            "-c".into(),
            SCRIPT.into(),
            "sh".into(),
            self.scratch.clone().into_os_string(),
            dir.as_os_str().to_owned(),
            preload.map_or_else(OsString::new, |p| p.as_os_str().to_owned()),
            program.as_os_str().to_owned(),
        ]
    }
}

impl PluginMount {
    /// Whether `enter` (a command entering a new mount namespace, e.g. `unshare --mount
    /// --propagation private`) can make such a container here: runs `/bin/true` in one.
    /// Err: why not (not root, no overlayfs), for the caller's visible skip.
    pub fn check(&self, mut enter: std::process::Command) -> Result<(), String> {
        let dir = tempfile::tempdir().map_err(|e| format!("temporary directory: {e}"))?;
        let out = enter
            .args(self.args(dir.path(), None, Path::new("/bin/true")))
            .output()
            .map_err(|e| format!("cannot run {:?}: {e}", enter.get_program()))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!(
                "cannot mount /etc/vgpu in a private mount namespace ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ))
        }
    }
}
