//! The prepared claims, checkpointed to one file so that a restarted driver answers a
//! repeated `NodePrepareResources` with what it answered before (without the API
//! server) and can still unprepare what it prepared.
//!
//! The file is JSON, written atomically (temporary file, rename):
//!
//! ```json
//! {"version":1,"claims":{"<uid>":{"namespace":"ml","name":"c",
//!   "devices":[{"requestNames":["r"],"poolName":"n1","deviceName":"gpu-0",
//!               "cdiDeviceIds":["vgpu.io/gpu=<uid>-r"]}]}}}
//! ```
//!
//! Compatibility: unknown fields are ignored; another `version` is refused at start (the
//! driver does not guess at claims it cannot read).

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The current version of the checkpoint record.
pub const CHECKPOINT_VERSION: u32 = 1;
/// The checkpoint's file name in the state directory.
pub const CHECKPOINT_FILE: &str = "checkpoint.json";

/// One device of a prepared claim, as answered to kubelet.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PreparedDevice {
    /// The requests it serves.
    pub request_names: Vec<String>,
    /// Its pool.
    pub pool_name: String,
    /// Its name.
    pub device_name: String,
    /// The CDI device IDs kubelet hands the runtime.
    pub cdi_device_ids: Vec<String>,
}

/// One prepared claim.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PreparedClaim {
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
    /// What kubelet was told.
    pub devices: Vec<PreparedDevice>,
}

/// The checkpoint record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Checkpoint {
    /// [`CHECKPOINT_VERSION`].
    pub version: u32,
    /// Prepared claims by UID.
    pub claims: BTreeMap<String, PreparedClaim>,
}

impl Default for Checkpoint {
    fn default() -> Self {
        Checkpoint {
            version: CHECKPOINT_VERSION,
            claims: BTreeMap::new(),
        }
    }
}

/// Why the checkpoint could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// Reading or writing the file failed.
    #[error("checkpoint {path}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The file is not a checkpoint record.
    #[error("checkpoint {path}: malformed record")]
    Malformed {
        /// The file.
        path: PathBuf,
        /// The decoding error.
        #[source]
        source: serde_json::Error,
    },
    /// Written by an incompatible version.
    #[error(
        "checkpoint {path}: unsupported version {version} (this build reads version {CHECKPOINT_VERSION})"
    )]
    Version {
        /// The file.
        path: PathBuf,
        /// Its version.
        version: u32,
    },
}

impl Checkpoint {
    /// Reads the checkpoint at `path`; a missing file is an empty checkpoint.
    pub fn load(path: &Path) -> Result<Checkpoint, CheckpointError> {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Checkpoint::default()),
            Err(source) => {
                return Err(CheckpointError::Io {
                    path: path.to_owned(),
                    source,
                });
            }
        };
        #[derive(Deserialize)]
        struct Probe {
            version: u32,
        }
        let malformed = |source| CheckpointError::Malformed {
            path: path.to_owned(),
            source,
        };
        let probe: Probe = serde_json::from_str(&text).map_err(malformed)?;
        if probe.version != CHECKPOINT_VERSION {
            return Err(CheckpointError::Version {
                path: path.to_owned(),
                version: probe.version,
            });
        }
        serde_json::from_str(&text).map_err(malformed)
    }

    /// Writes the checkpoint to `path` atomically.
    pub fn save(&self, path: &Path) -> Result<(), CheckpointError> {
        let text = serde_json::to_vec(self).expect("plain structs always serialize");
        write_atomic(path, &text).map_err(|source| CheckpointError::Io {
            path: path.to_owned(),
            source,
        })
    }
}

/// Writes `data` to `path` through a temporary file in the same directory and a rename,
/// so a reader sees the old or the new content, never a part. The temporary name has
/// no `.json` suffix (the CDI cache ignores it) and is fsync'ed before the rename: the
/// checkpoint must survive a node crash that kubelet's own checkpoint survives.
pub fn write_atomic(path: &Path, data: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{name}.tmp"));
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(data)?;
    f.sync_all()?;
    drop(f);
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_missing_file_and_other_version() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join(CHECKPOINT_FILE);
        assert_eq!(Checkpoint::load(&p).unwrap(), Checkpoint::default());
        let mut c = Checkpoint::default();
        c.claims.insert(
            "u".into(),
            PreparedClaim {
                namespace: "ml".into(),
                name: "c".into(),
                devices: vec![PreparedDevice {
                    request_names: vec!["r".into()],
                    pool_name: "n".into(),
                    device_name: "gpu-0".into(),
                    cdi_device_ids: vec!["vgpu.io/gpu=u-r".into()],
                }],
            },
        );
        c.save(&p).unwrap();
        assert_eq!(Checkpoint::load(&p).unwrap(), c);
        std::fs::write(&p, r#"{"version":2,"claims":{}}"#).unwrap();
        let e = Checkpoint::load(&p).unwrap_err().to_string();
        assert!(
            e.contains("version 2") && e.contains(CHECKPOINT_FILE),
            "{e}"
        );
    }
}
