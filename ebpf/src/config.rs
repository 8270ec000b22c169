//! What the daemon asks of the eBPF part: the mode, where to attach, where to pin, and the
//! GPU device numbers (read from /proc/devices or from the device nodes).

use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::str::FromStr;

use crate::abi::ANY_MINOR;
use crate::error::EbpfError;

/// `--ebpf off|audit|enforce`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Load nothing.
    Off,
    /// Allow every GPU open, report those enforce would refuse.
    Audit,
    /// Refuse GPU opens of unregistered processes outside trusted cgroups.
    Enforce,
}

impl FromStr for Mode {
    type Err = EbpfError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text.trim() {
            "off" => Ok(Self::Off),
            "audit" => Ok(Self::Audit),
            "enforce" => Ok(Self::Enforce),
            other => Err(EbpfError::UnknownMode(other.to_owned())),
        }
    }
}

/// Where and how to attach.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EbpfConfig {
    /// The gate's mode.
    pub mode: Mode,
    /// cgroup2 directory whose descendants the gate covers (the node's kubepods cgroup).
    pub cgroup_root: PathBuf,
    /// Directory on a bpf file system where maps and links are pinned so that the gate and
    /// the exit watcher outlive the daemon (ADR 0018); `None`: everything detaches on drop.
    pub pin_dir: Option<PathBuf>,
}

/// A GPU character device number (or a whole major) the gate guards.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GpuDevice {
    /// Major number.
    pub major: u32,
    /// One minor, or `None` for every minor of the major.
    pub minor: Option<u32>,
}

impl GpuDevice {
    /// The map's minor value.
    pub(crate) fn key_minor(self) -> u32 {
        self.minor.unwrap_or(ANY_MINOR)
    }

    /// The device number of a character device node (e.g. /dev/nvidia0).
    pub fn from_node(path: &Path) -> Result<Self, EbpfError> {
        let metadata = std::fs::metadata(path).map_err(|source| EbpfError::Io {
            operation: "stat device node",
            path: path.to_owned(),
            source,
        })?;
        if !metadata.file_type().is_char_device() {
            return Err(EbpfError::NotCharDevice(path.to_owned()));
        }
        let rdev = metadata.rdev();
        Ok(Self {
            major: libc::major(rdev),
            minor: Some(libc::minor(rdev)),
        })
    }
}

/// The major that NVIDIA's driver registers for `/dev/nvidia<N>`, `nvidiactl` (minor 255) and
/// nvidia-modeset (254); fixed by the driver.
pub const NVIDIA_MAJOR: u32 = 195;

/// The GPU device majors named in the "Character devices:" part of `/proc/devices`:
/// 195 always, plus the dynamic majors of nvidia-uvm, nvidia-caps, nvidia-nvlink,
/// nvidia-nvswitch (every minor of each).
pub fn gpu_devices_from_proc_devices(text: &str) -> Vec<GpuDevice> {
    let mut devices = vec![GpuDevice {
        major: NVIDIA_MAJOR,
        minor: None,
    }];
    let mut in_char = false;
    for line in text.lines() {
        let line = line.trim();
        if line.ends_with(':') {
            in_char = line == "Character devices:";
            continue;
        }
        let mut fields = line.split_whitespace();
        let (Some(major), Some(name)) = (fields.next(), fields.next()) else {
            continue;
        };
        let Ok(major) = major.parse::<u32>() else {
            continue;
        };
        let gpu = name == "nvidia-frontend" || name == "nvidia" || name.starts_with("nvidia-");
        if in_char && gpu && !devices.iter().any(|device| device.major == major) {
            devices.push(GpuDevice { major, minor: None });
        }
    }
    devices
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mode_parses_the_three_names_and_names_a_bad_one() {
        assert_eq!("off".parse::<Mode>().unwrap(), Mode::Off);
        assert_eq!(" audit\n".parse::<Mode>().unwrap(), Mode::Audit);
        assert_eq!("enforce".parse::<Mode>().unwrap(), Mode::Enforce);
        let error = "Enforce".parse::<Mode>().unwrap_err().to_string();
        assert!(error.contains("\"Enforce\""), "{error}");
    }

    #[test]
    fn proc_devices_yields_nvidia_char_majors_only() {
        let text = "Character devices:\n  1 mem\n195 nvidia-frontend\n234 nvidia-uvm\n\
                    235 nvidia-caps\n236 nvidiax\n\nBlock devices:\n 240 nvidia-fake-block\n";
        let majors: Vec<u32> = gpu_devices_from_proc_devices(text)
            .iter()
            .map(|d| d.major)
            .collect();
        assert_eq!(majors, vec![195, 234, 235]);
        assert!(
            gpu_devices_from_proc_devices(text)
                .iter()
                .all(|d| d.minor.is_none())
        );
    }

    #[test]
    fn proc_devices_without_a_driver_still_guards_major_195() {
        let devices = gpu_devices_from_proc_devices("Character devices:\n  1 mem\n");
        assert_eq!(
            devices,
            vec![GpuDevice {
                major: 195,
                minor: None
            }]
        );
    }

    #[test]
    fn from_node_reads_dev_null_and_refuses_a_regular_file() {
        let null = GpuDevice::from_node(Path::new("/dev/null")).unwrap();
        assert_eq!((null.major, null.minor), (1, Some(3)));
        let file = tempfile::NamedTempFile::new().unwrap();
        let error = GpuDevice::from_node(file.path()).unwrap_err().to_string();
        assert!(
            error.contains(&file.path().display().to_string()),
            "{error}"
        );
    }
}
