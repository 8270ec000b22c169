//! The simulated node's GPU character devices: created with `mknod` where the simulator
//! may, opened by `cuInit` and `nvmlInit*` as NVIDIA's driver opens its nodes.
//!
//! NVIDIA's kernel driver exposes `/dev/nvidiactl` (195:255), `/dev/nvidia<N>` (195:N) and
//! `/dev/nvidia-uvm`, `/dev/nvidia-uvm-tools` (a dynamic major, minors 0 and 1); its
//! user-space libraries open them at initialization. A device cgroup that refuses the
//! open makes the open fail with `EPERM`, which the libraries report as an unknown error
//! (`cuInit` → `CUDA_ERROR_UNKNOWN`, `nvmlInit` → `NVML_ERROR_UNKNOWN`: "Failed to
//! initialize NVML: Unknown Error" after `open("/dev/nvidiactl") = -1 EPERM`, strace in
//! NVIDIA/nvidia-docker#966; `cuInit` returning 999 in a container without access to the
//! nodes, NVIDIA/nvidia-container-toolkit#1246).
//!
//! The simulator keeps its nodes in `<state dir>/dev/`, so it never touches the host's
//! `/dev`. No kernel driver answers them: an allowed open fails with `ENXIO`, which counts
//! as the device answering. Where `mknod` is not permitted (unprivileged), no node is made
//! and initialization opens nothing, as before this module existed.

use std::fs;
use std::io;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

use rustix::fs::{FileType, Mode, OFlags};

/// NVIDIA's character major (`nvidia-frontend` in `/proc/devices`).
pub const NVIDIA_MAJOR: u32 = 195;
/// Minor of `/dev/nvidiactl`.
pub const NVIDIACTL_MINOR: u32 = 255;
/// The kernel's second range of dynamic character majors (`CHRDEV_MAJOR_DYN_EXT_*`),
/// searched from the top, where the simulated `nvidia-uvm` takes the first free major.
const DYNAMIC_MAJORS: std::ops::RangeInclusive<u32> = 384..=511;

/// Where the simulated node's device nodes live, under its state directory.
pub fn node_dir(state_dir: &Path) -> PathBuf {
    state_dir.join("dev")
}

/// One device node: its file name under [`node_dir`] and its numbers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Node {
    /// File name (`nvidiactl`, `nvidia0`, `nvidia-uvm`, …).
    pub name: String,
    /// Major number.
    pub major: u32,
    /// Minor number.
    pub minor: u32,
}

/// The nodes of a node with `gpus` GPUs, `uvm_major` being the major its `nvidia-uvm`
/// takes: the control node, one per GPU, then the two UVM nodes (the order the driver
/// opens them in).
pub fn nodes(gpus: usize, uvm_major: u32) -> Vec<Node> {
    let mut v = vec![Node {
        name: "nvidiactl".into(),
        major: NVIDIA_MAJOR,
        minor: NVIDIACTL_MINOR,
    }];
    for (i, minor) in (0..gpus).zip(0u32..) {
        v.push(Node {
            name: format!("nvidia{i}"),
            major: NVIDIA_MAJOR,
            minor,
        });
    }
    for (name, minor) in [("nvidia-uvm", 0), ("nvidia-uvm-tools", 1)] {
        v.push(Node {
            name: name.into(),
            major: uvm_major,
            minor,
        });
    }
    v
}

/// The major a new `nvidia-uvm` takes, given the text of `/proc/devices`: the highest of
/// the kernel's extended dynamic range that no character driver holds. `None` if every
/// one is taken.
pub fn free_dynamic_major(proc_devices: &str) -> Option<u32> {
    let mut taken = Vec::new();
    for line in proc_devices.lines() {
        if line.starts_with("Block devices") {
            break;
        }
        if let Some(Ok(major)) = line.split_whitespace().next().map(str::parse::<u32>) {
            taken.push(major);
        }
    }
    DYNAMIC_MAJORS.rev().find(|m| !taken.contains(m))
}

/// Creates the node's device nodes under [`node_dir`] where they are missing. Returns
/// whether the nodes exist afterwards: `false` where `mknod` is not permitted (then
/// nothing is left behind and initialization opens nothing).
pub fn ensure(state_dir: &Path, gpus: usize) -> io::Result<bool> {
    let dir = node_dir(state_dir);
    if dir.join("nvidiactl").exists() {
        // Made by an earlier process: the GPUs it lacks (a node reconfigured with more
        // GPUs) are made below with the UVM major it chose.
        let uvm = rustix::fs::stat(dir.join("nvidia-uvm")).map_err(io::Error::from)?;
        return make_all(&dir, &nodes(gpus, rustix::fs::major(uvm.st_rdev)));
    }
    let proc_devices = fs::read_to_string("/proc/devices")?;
    let Some(uvm_major) = free_dynamic_major(&proc_devices) else {
        return Ok(false);
    };
    fs::create_dir_all(&dir)?;
    make_all(&dir, &nodes(gpus, uvm_major))
}

fn make_all(dir: &Path, nodes: &[Node]) -> io::Result<bool> {
    for n in nodes {
        let dev = rustix::fs::makedev(n.major, n.minor);
        // 0666, as NVIDIA's installer makes them: the device cgroup decides who opens.
        let mode = Mode::from_raw_mode(0o666);
        match rustix::fs::mknodat(
            rustix::fs::CWD,
            dir.join(&n.name),
            FileType::CharacterDevice,
            mode,
            dev,
        ) {
            // The umask may have narrowed the mode of a node made here.
            Ok(()) => rustix::fs::chmod(dir.join(&n.name), mode).map_err(io::Error::from)?,
            Err(rustix::io::Errno::EXIST) => {}
            Err(rustix::io::Errno::PERM) => return Ok(false),
            Err(e) => {
                return Err(io::Error::new(
                    io::Error::from(e).kind(),
                    format!("mknod {}: {e}", dir.join(&n.name).display()),
                ));
            }
        }
    }
    Ok(true)
}

/// A device node the caller may not open (the device cgroup refused it).
#[derive(Debug, thiserror::Error)]
#[error("open {}: {source}", path.display())]
pub struct Refused {
    /// The node.
    pub path: PathBuf,
    /// The error of the open (`EPERM` from a device cgroup).
    #[source]
    pub source: io::Error,
}

/// What opening the node's device nodes gave.
#[derive(Debug)]
pub enum Opened {
    /// The simulator made no nodes (unprivileged): nothing was opened.
    NoNodes,
    /// Every node answered; the descriptors of those that opened (none without a kernel
    /// driver behind them: those answer `ENXIO`), kept for the process's life as the
    /// driver keeps its own.
    Answered(Vec<OwnedFd>),
}

/// Opens every device node of a node with `gpus` GPUs, as the driver's initialization
/// does: `EPERM` (what a device cgroup answers) is a refusal; `ENXIO` and `ENODEV` (no
/// driver behind the node) count as the device answering; any other error (a node
/// removed meanwhile, a `nodev` mount) leaves the simulator as it was without nodes.
pub fn open_all(state_dir: &Path, gpus: usize) -> Result<Opened, Refused> {
    let dir = node_dir(state_dir);
    match ensure(state_dir, gpus) {
        Ok(true) => {}
        // No nodes (unprivileged), or none could be made: keep today's behaviour.
        Ok(false) | Err(_) => return Ok(Opened::NoNodes),
    }
    let uvm_major = rustix::fs::stat(dir.join("nvidia-uvm"))
        .map(|s| rustix::fs::major(s.st_rdev))
        .unwrap_or(0);
    let mut fds = Vec::new();
    for n in nodes(gpus, uvm_major) {
        let path = dir.join(&n.name);
        match rustix::fs::open(&path, OFlags::RDWR | OFlags::CLOEXEC, Mode::empty()) {
            Ok(fd) => fds.push(fd),
            Err(rustix::io::Errno::NXIO | rustix::io::Errno::NODEV) => {}
            Err(e @ rustix::io::Errno::PERM) => {
                return Err(Refused {
                    path,
                    source: e.into(),
                });
            }
            Err(_) => {}
        }
    }
    Ok(Opened::Answered(fds))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_control_node_then_one_per_gpu_then_uvm() {
        let v = nodes(2, 510);
        let names: Vec<_> = v.iter().map(|n| n.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "nvidiactl",
                "nvidia0",
                "nvidia1",
                "nvidia-uvm",
                "nvidia-uvm-tools"
            ]
        );
        assert_eq!((v[0].major, v[0].minor), (195, 255));
        assert_eq!((v[2].major, v[2].minor), (195, 1));
        assert_eq!((v[4].major, v[4].minor), (510, 1));
    }

    #[test]
    fn uvm_takes_the_highest_free_dynamic_major() {
        let text = "Character devices:\n  1 mem\n195 nvidia-frontend\n511 hidraw\n510 nvidia-uvm\n\nBlock devices:\n509 blk\n";
        // Block majors are another namespace.
        assert_eq!(free_dynamic_major(text), Some(509));
        let full: String = (384..=511).map(|m| format!("{m} x\n")).collect();
        assert_eq!(free_dynamic_major(&full), None);
    }

    #[test]
    fn nodes_are_made_and_answer_where_mknod_is_permitted() {
        let dir = tempfile::tempdir().expect("temp dir");
        match open_all(dir.path(), 2).expect("no device cgroup refuses here") {
            Opened::NoNodes => {
                // Unprivileged: nothing may be left behind.
                assert!(!node_dir(dir.path()).join("nvidiactl").exists());
                vgpu_test_needs::skip(vgpu_test_needs::Need::Root, "mknod is not permitted here");
            }
            Opened::Answered(_) => {
                let st = rustix::fs::stat(node_dir(dir.path()).join("nvidia1")).expect("stat");
                assert_eq!(
                    FileType::from_raw_mode(st.st_mode),
                    FileType::CharacterDevice
                );
                assert_eq!(rustix::fs::major(st.st_rdev), NVIDIA_MAJOR);
                assert_eq!(rustix::fs::minor(st.st_rdev), 1);
                assert_eq!(st.st_mode & 0o777, 0o666);
                // A second process finds them and answers the same way.
                assert!(matches!(open_all(dir.path(), 2), Ok(Opened::Answered(_))));
                // A node grown to 3 GPUs gets its third node with the same UVM major.
                let uvm = |p: &Path| {
                    rustix::fs::major(
                        rustix::fs::stat(node_dir(p).join("nvidia-uvm"))
                            .expect("stat")
                            .st_rdev,
                    )
                };
                let before = uvm(dir.path());
                assert!(ensure(dir.path(), 3).expect("ensure"));
                assert!(node_dir(dir.path()).join("nvidia2").exists());
                assert_eq!(uvm(dir.path()), before);
            }
        }
    }
}
