//! The simulated node's GPU character devices: created with `mknod` where the simulator
//! may, opened by `cuInit` and `nvmlInit*` as NVIDIA's driver opens its nodes.
//!
//! NVIDIA's kernel driver exposes `/dev/nvidiactl` (195:255), `/dev/nvidia<N>` (195:N) and
//! `/dev/nvidia-uvm`, `/dev/nvidia-uvm-tools` (a dynamic major, minors 0 and 1); its
//! user-space libraries open them at initialization. What they do when the process may
//! not open some of them (a container's device cgroup, as kubelet and the NVIDIA
//! container toolkit set it, or a node a container was not given), [`decide`] does:
//!
//! - a GPU whose node is refused (`EPERM`, `EACCES`) or absent is not there for the
//!   process: CUDA and NVML count only the GPUs left and number them from 0 in order,
//!   each keeping its UUID and PCI id. "CUDA, nvidia-smi and NVML […] will report the
//!   right number of GPUs by ignoring the ones they don't have permission to use"
//!   (NVIDIA's flx42 in NVIDIA/nvidia-docker#170); `nvidia-smi` in a cgroup denied 2 of 4
//!   GPUs lists 2 (NVIDIA/nvidia-docker#393); NVML sees 4 GPUs in a pod whose other 4
//!   nodes answer `EPERM` (NVIDIA/DCGM#90). NVML's reference says the same of the v1
//!   count (`nvmlDeviceGetCount` "doesn't count devices that NVML has no permission to
//!   talk to"); the simulator's `_v2` count does too, as containers see it, where the
//!   toolkit also hides the other GPUs from `/proc/driver/nvidia/gpus`.
//! - `/dev/nvidiactl` refused: initialization fails with an unknown error (`cuInit` →
//!   `CUDA_ERROR_UNKNOWN`, `nvmlInit` → `NVML_ERROR_UNKNOWN`: "Failed to initialize NVML:
//!   Unknown Error" after `open("/dev/nvidiactl") = -1 EPERM`, strace in
//!   NVIDIA/nvidia-docker#966; `cuInit` returning 999 in a container without access to the
//!   nodes, NVIDIA/nvidia-container-toolkit#1246); no other node is opened then. CUDA
//!   also fails so without `nvidia-uvm`; NVML does not open it (NVIDIA's
//!   libnvidia-container mounts no UVM node into a container with only the `utility`
//!   capability, nvidia-smi's: "Only compute libraries require specific devices (e.g.
//!   UVM)", `src/nvc_mount.c`).
//! - every GPU node refused but `nvidiactl` allowed: NVML initializes and finds no GPU
//!   ("NVML initializing successfully but enumerating zero GPUs", `nvidia-smi -L` → "No
//!   devices found", confidential-dot-ai/confidential-os-builder#73); CUDA answers as with
//!   no GPU at all, `CUDA_ERROR_NO_DEVICE`.
//!
//! The simulator keeps its nodes in `<state dir>/dev/`, so it never touches the host's
//! `/dev`. No kernel driver answers them: an allowed open fails with `ENXIO`, which counts
//! as the device answering. Where `mknod` is not permitted (unprivileged), no node is made,
//! initialization opens nothing and every GPU is there, as before this module existed.

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
/// nothing is left behind and initialization opens nothing). A node that a device
/// cgroup forbids making while the control node could be made is left absent.
pub fn ensure(state_dir: &Path, gpus: usize) -> io::Result<bool> {
    let dir = node_dir(state_dir);
    if dir.join("nvidiactl").exists() {
        // Made by an earlier process: the GPUs it lacks (a node reconfigured with more
        // GPUs) are made below with the UVM major it chose.
        // (`nvidia-uvm` itself may be missing where a device cgroup forbade making it.)
        if let Ok(uvm) = rustix::fs::stat(dir.join("nvidia-uvm")) {
            return make_all(&dir, &nodes(gpus, rustix::fs::major(uvm.st_rdev)));
        }
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
            // No `mknod` at all (unprivileged): the control node, made first, fails.
            Err(rustix::io::Errno::PERM) if n.name == "nvidiactl" => return Ok(false),
            // The control node could be made (or was): a device cgroup refuses this one.
            // It stays absent, so the process does not have that GPU.
            Err(rustix::io::Errno::PERM) => {}
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

/// How one device node answered the process's open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    /// It opened, or the kernel let the open through to a missing driver (`ENXIO`,
    /// `ENODEV`: no kernel module answers the simulated nodes), or it failed in a way that
    /// says nothing about this process's access (the simulator then behaves as without
    /// nodes).
    Answered,
    /// The node does not exist here (`ENOENT`): a container given other GPUs' nodes only.
    Absent,
    /// The device cgroup (or the node's mode) refused the open: `EPERM`, `EACCES`.
    Refused,
}

impl Answer {
    /// The answer a failed open's error gives.
    pub fn of(e: rustix::io::Errno) -> Answer {
        match e {
            rustix::io::Errno::NOENT => Answer::Absent,
            rustix::io::Errno::PERM | rustix::io::Errno::ACCESS => Answer::Refused,
            _ => Answer::Answered,
        }
    }
}

/// Which library initializes: CUDA's driver needs `nvidia-uvm` (unified memory), NVML
/// does not open it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Client {
    /// `cuInit`.
    Cuda,
    /// `nvmlInit*`.
    Nvml,
}

/// Why initialization fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Denied {
    /// `/dev/nvidiactl` is refused or absent: no driver at all (`cuInit` →
    /// `CUDA_ERROR_UNKNOWN`, `nvmlInit` → `NVML_ERROR_UNKNOWN`).
    #[error("/dev/nvidiactl is {0:?}")]
    Control(Answer),
    /// `/dev/nvidia-uvm` or `-tools` is refused or absent (CUDA only: `cuInit` →
    /// `CUDA_ERROR_UNKNOWN`).
    #[error("/dev/nvidia-uvm is {0:?}")]
    Uvm(Answer),
}

/// What a process sees, given how its nodes answered: the node's GPUs it may use (node
/// indices, ascending: its ordinals are their positions), or why initialization fails.
/// A GPU whose node is absent or refused is not there for this process; an empty list
/// is a driver with no GPU (CUDA: `CUDA_ERROR_NO_DEVICE`, NVML: a count of 0).
pub fn decide(
    client: Client,
    ctl: Answer,
    gpus: &[Answer],
    uvm: &[Answer],
) -> Result<Vec<usize>, Denied> {
    if ctl != Answer::Answered {
        return Err(Denied::Control(ctl));
    }
    if client == Client::Cuda
        && let Some(&a) = uvm.iter().find(|&&a| a != Answer::Answered)
    {
        return Err(Denied::Uvm(a));
    }
    Ok(gpus
        .iter()
        .enumerate()
        .filter(|(_, a)| **a == Answer::Answered)
        .map(|(i, _)| i)
        .collect())
}

/// What opening the node's device nodes gave.
#[derive(Debug)]
pub struct Opened {
    /// The node's GPUs this process may use (node indices, ascending): all of them where
    /// the simulator made no nodes (unprivileged).
    pub gpus: Vec<usize>,
    /// The descriptors of the nodes that opened (none without a kernel driver behind
    /// them: those answer `ENXIO`), kept for the process's life as the driver keeps its
    /// own.
    pub fds: Vec<OwnedFd>,
    /// Whether the simulator's nodes exist (false: unprivileged, nothing was opened).
    pub nodes: bool,
}

/// Opens the device nodes of a node with `gpus` GPUs, as the driver's initialization
/// does, and tells which GPUs this process has ([`decide`]). Where the simulator cannot
/// make nodes (unprivileged), nothing is opened and every GPU is there.
pub fn open_all(state_dir: &Path, gpus: usize, client: Client) -> Result<Opened, Denied> {
    let dir = node_dir(state_dir);
    match ensure(state_dir, gpus) {
        Ok(true) => {}
        // No nodes (unprivileged), or none could be made: keep today's behaviour.
        Ok(false) | Err(_) => {
            return Ok(Opened {
                gpus: (0..gpus).collect(),
                fds: Vec::new(),
                nodes: false,
            });
        }
    }
    let uvm_major = rustix::fs::stat(dir.join("nvidia-uvm"))
        .map(|s| rustix::fs::major(s.st_rdev))
        .unwrap_or(0);
    let mut fds = Vec::new();
    let mut open = |name: &str| match rustix::fs::open(
        dir.join(name),
        OFlags::RDWR | OFlags::CLOEXEC,
        Mode::empty(),
    ) {
        Ok(fd) => {
            fds.push(fd);
            Answer::Answered
        }
        Err(e) => Answer::of(e),
    };
    let all = nodes(gpus, uvm_major);
    let ctl = open(&all[0].name);
    if ctl != Answer::Answered {
        // The driver goes no further without its control node: it opens no GPU node
        // (one refused open per process, as the eBPF gate counts it).
        return Err(Denied::Control(ctl));
    }
    let gpu_answers: Vec<Answer> = all[1..=gpus].iter().map(|n| open(&n.name)).collect();
    let uvm: Vec<Answer> = match client {
        Client::Cuda => all[gpus + 1..].iter().map(|n| open(&n.name)).collect(),
        Client::Nvml => Vec::new(),
    };
    let present = decide(client, ctl, &gpu_answers, &uvm)?;
    Ok(Opened {
        gpus: present,
        fds,
        nodes: true,
    })
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
    fn a_refused_or_absent_gpu_is_not_there_and_the_rest_keep_their_order() {
        use Answer::*;
        let gpus = [Answered, Refused, Answered, Answered];
        assert_eq!(
            decide(Client::Cuda, Answered, &gpus, &[Answered, Answered]),
            Ok(vec![0, 2, 3])
        );
        assert_eq!(
            decide(
                Client::Nvml,
                Answered,
                &[Absent, Answered, Refused, Answered],
                &[]
            ),
            Ok(vec![1, 3])
        );
        // No GPU left: a driver without devices, not a failure of the library.
        assert_eq!(
            decide(Client::Nvml, Answered, &[Refused, Absent], &[]),
            Ok(vec![])
        );
    }

    #[test]
    fn a_refused_control_node_fails_initialization() {
        use Answer::*;
        for ctl in [Refused, Absent] {
            for client in [Client::Cuda, Client::Nvml] {
                assert_eq!(
                    decide(client, ctl, &[Answered, Answered], &[Answered, Answered]),
                    Err(Denied::Control(ctl))
                );
            }
        }
    }

    #[test]
    fn only_cuda_needs_the_uvm_nodes() {
        use Answer::*;
        assert_eq!(
            decide(Client::Cuda, Answered, &[Answered], &[Answered, Refused]),
            Err(Denied::Uvm(Refused))
        );
        assert_eq!(
            decide(Client::Nvml, Answered, &[Answered], &[]),
            Ok(vec![0])
        );
    }

    #[test]
    fn errors_map_to_answers() {
        use rustix::io::Errno;
        assert_eq!(Answer::of(Errno::PERM), Answer::Refused);
        assert_eq!(Answer::of(Errno::ACCESS), Answer::Refused);
        assert_eq!(Answer::of(Errno::NOENT), Answer::Absent);
        // No kernel driver behind the simulated node: the device answered.
        assert_eq!(Answer::of(Errno::NXIO), Answer::Answered);
        assert_eq!(Answer::of(Errno::NODEV), Answer::Answered);
    }

    #[test]
    fn nodes_are_made_and_answer_where_mknod_is_permitted() {
        let dir = tempfile::tempdir().expect("temp dir");
        let o = open_all(dir.path(), 2, Client::Cuda).expect("no device cgroup refuses here");
        assert_eq!(o.gpus, [0, 1]);
        if !o.nodes {
            // Unprivileged: nothing may be left behind.
            assert!(!node_dir(dir.path()).join("nvidiactl").exists());
            vgpu_test_needs::skip(vgpu_test_needs::Need::Root, "mknod is not permitted here");
            return;
        }
        let st = rustix::fs::stat(node_dir(dir.path()).join("nvidia1")).expect("stat");
        assert_eq!(
            FileType::from_raw_mode(st.st_mode),
            FileType::CharacterDevice
        );
        assert_eq!(rustix::fs::major(st.st_rdev), NVIDIA_MAJOR);
        assert_eq!(rustix::fs::minor(st.st_rdev), 1);
        assert_eq!(st.st_mode & 0o777, 0o666);
        // A second process finds them and answers the same way.
        let again = open_all(dir.path(), 2, Client::Nvml).expect("open again");
        assert!(again.nodes);
        assert_eq!(again.gpus, [0, 1]);
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
