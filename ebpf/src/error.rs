//! Why the eBPF programs cannot be loaded, attached or used: one enum, each variant naming
//! the input (path, pid, device, map) that failed.

use std::path::PathBuf;

/// An error of the eBPF gate and exit watcher.
#[derive(Debug, thiserror::Error)]
pub enum EbpfError {
    /// The configuration asks for no eBPF at all.
    #[error("ebpf mode is off: nothing to attach")]
    ModeOff,
    /// A mode string is none of off, audit, enforce.
    #[error("unknown ebpf mode {0:?} (expected off, audit or enforce)")]
    UnknownMode(String),
    /// The process lacks the capabilities to load and attach programs.
    #[error(
        "missing capabilities {missing} (effective set {effective:#x}): run as root or grant CAP_BPF+CAP_PERFMON (or CAP_SYS_ADMIN)"
    )]
    MissingCapabilities {
        /// Names of the missing capabilities.
        missing: String,
        /// The effective capability mask (the `caps` crate's reading, as in `CapEff`).
        effective: u64,
    },
    /// The capability set could not be read.
    #[error("cannot read the effective capabilities of this process")]
    Capabilities(#[source] caps::errors::CapsError),
    /// The kernel exposes no BTF, which CO-RE relocation of the exit program needs.
    #[error("kernel has no BTF at {0} (CONFIG_DEBUG_INFO_BTF=y is needed)")]
    NoBtf(PathBuf),
    /// The attach point is not a cgroup2 directory.
    #[error(
        "{0} is not a cgroup2 directory (no cgroup.controllers): mount cgroup2 and point cgroup_root at the kubepods cgroup in it"
    )]
    NotCgroup2(PathBuf),
    /// tracefs is not mounted, so the exit tracepoint cannot be attached.
    #[error(
        "tracefs is not mounted at /sys/kernel/tracing or /sys/kernel/debug/tracing (mount -t tracefs tracefs /sys/kernel/tracing)"
    )]
    NoTracefs,
    /// The pin directory is not on a bpf file system.
    #[error("pin directory {0} is not on a bpf file system (mount -t bpf bpf /sys/fs/bpf)")]
    NotBpffs(PathBuf),
    /// A file or directory operation failed.
    #[error("{operation} {path}")]
    Io {
        /// What was being done.
        operation: &'static str,
        /// On what.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The kernel or aya refused to load the object (verifier, map creation, BTF).
    #[error("kernel refused to load the eBPF object")]
    Load(#[source] aya::EbpfError),
    /// The kernel refused a program.
    #[error("kernel refused program {program} ({operation})")]
    Program {
        /// Program name.
        program: &'static str,
        /// load, attach, pin.
        operation: &'static str,
        /// Why.
        #[source]
        source: aya::programs::ProgramError,
    },
    /// A map operation failed.
    #[error("{operation} in map {map}")]
    Map {
        /// Map name.
        map: &'static str,
        /// What was being done, with the key.
        operation: String,
        /// Why.
        #[source]
        source: aya::maps::MapError,
    },
    /// A map the programs need is missing from the object (a build mismatch).
    #[error("eBPF object has no map or program named {0}")]
    Missing(&'static str),
    /// A bpf() system call made outside aya failed.
    #[error("bpf({command}) on {what}")]
    Syscall {
        /// The bpf command.
        command: &'static str,
        /// Its object.
        what: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A device major outside Linux's 12-bit range.
    #[error("device major {0} is out of range (majors are below 4096)")]
    BadMajor(u32),
    /// A device number given to the gate is not a character device of a GPU.
    #[error("{0} is not a character device")]
    NotCharDevice(PathBuf),
}
