//! The bpf() calls aya 0.14 does not offer for cgroup device programs: creating a link whose
//! fd we own (aya's cgroup link cannot become a pinnable `FdLink`), pinning it, opening a
//! pin, and detaching a link at once.
//! With `poll` in `event`, `RawEvent::from_bytes` and `Pod` in `abi`, the crate's only unsafe.

use std::ffi::CString;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use crate::error::EbpfError;

/// `BPF_OBJ_PIN` (include/uapi/linux/bpf.h, enum bpf_cmd).
const BPF_OBJ_PIN: libc::c_long = 6;
/// `BPF_OBJ_GET`.
const BPF_OBJ_GET: libc::c_long = 7;
/// `BPF_LINK_DETACH`.
const BPF_LINK_DETACH: libc::c_long = 34;
/// `BPF_LINK_CREATE`.
const BPF_LINK_CREATE: libc::c_long = 28;
/// `BPF_CGROUP_DEVICE` (enum bpf_attach_type).
const BPF_CGROUP_DEVICE: u32 = 6;

/// `union bpf_attr` as BPF_LINK_CREATE reads it (the fields we set; the kernel zero-fills
/// the rest because we pass this size).
#[repr(C)]
struct LinkCreateAttr {
    prog_fd: u32,
    target_fd: u32,
    attach_type: u32,
    flags: u32,
}

/// `union bpf_attr` as BPF_OBJ_PIN reads it.
#[repr(C)]
struct ObjPinAttr {
    pathname: u64,
    bpf_fd: u32,
    file_flags: u32,
}

/// Calls bpf(2) with `attr`.
fn bpf<T>(command: libc::c_long, attr: &mut T) -> std::io::Result<libc::c_long> {
    // SAFETY: `attr` is a live, initialised #[repr(C)] prefix of union bpf_attr for
    // `command`, and we pass its exact size, so the kernel reads only those bytes (and treats
    // the rest as zero). Pointers inside it (a path) are kept alive by the caller.
    let result = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            command,
            std::ptr::from_mut(attr),
            size_of::<T>() as u32,
        )
    };
    if result < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(result)
    }
}

/// Attaches `program` to the cgroup directory `cgroup` through a bpf link; the attachment
/// lasts while the returned fd (or a pin of it) lives. A cgroup link always attaches with
/// multi semantics (the kernel passes BPF_F_ALLOW_MULTI itself and refuses it as a flag):
/// our program runs beside those of other owners (runc's), and every one must allow.
pub fn cgroup_device_link(program: impl AsFd, cgroup: &Path) -> Result<OwnedFd, EbpfError> {
    let dir = std::fs::File::open(cgroup).map_err(|source| EbpfError::Io {
        operation: "open cgroup directory",
        path: cgroup.to_owned(),
        source,
    })?;
    let mut attr = LinkCreateAttr {
        prog_fd: fd_u32(program.as_fd()),
        target_fd: fd_u32(dir.as_fd()),
        attach_type: BPF_CGROUP_DEVICE,
        flags: 0,
    };
    let fd = bpf(BPF_LINK_CREATE, &mut attr).map_err(|source| EbpfError::Syscall {
        command: "BPF_LINK_CREATE",
        what: format!("cgroup/dev program on {}", cgroup.display()),
        source,
    })?;
    let fd = i32::try_from(fd).map_err(|_| EbpfError::Syscall {
        command: "BPF_LINK_CREATE",
        what: format!("cgroup/dev program on {}", cgroup.display()),
        source: std::io::Error::other(format!("fd {fd} out of range")),
    })?;
    // SAFETY: a successful BPF_LINK_CREATE returns a new file descriptor that nothing else
    // owns; we take ownership of it exactly once.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Pins the bpf object `fd` at `path` (on a bpf file system).
pub fn pin(fd: impl AsFd, path: &Path) -> Result<(), EbpfError> {
    let error = |source| EbpfError::Syscall {
        command: "BPF_OBJ_PIN",
        what: path.display().to_string(),
        source,
    };
    let name = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| error(std::io::Error::from(std::io::ErrorKind::InvalidInput)))?;
    let mut attr = ObjPinAttr {
        pathname: name.as_ptr() as u64,
        bpf_fd: fd_u32(fd.as_fd()),
        file_flags: 0,
    };
    bpf(BPF_OBJ_PIN, &mut attr).map(drop).map_err(error)
}

/// `union bpf_attr` as BPF_LINK_DETACH reads it.
#[repr(C)]
struct LinkDetachAttr {
    link_fd: u32,
}

/// Opens the bpf object pinned at `path`.
pub fn pinned(path: &Path) -> Result<OwnedFd, EbpfError> {
    let error = |source| EbpfError::Syscall {
        command: "BPF_OBJ_GET",
        what: path.display().to_string(),
        source,
    };
    let name = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| error(std::io::Error::from(std::io::ErrorKind::InvalidInput)))?;
    let mut attr = ObjPinAttr {
        pathname: name.as_ptr() as u64,
        bpf_fd: 0,
        file_flags: 0,
    };
    let fd = bpf(BPF_OBJ_GET, &mut attr).map_err(error)?;
    let fd = i32::try_from(fd).map_err(|_| error(std::io::Error::other("fd out of range")))?;
    // SAFETY: a successful BPF_OBJ_GET returns a new file descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Detaches the link `fd` now, whatever else (a pin, another fd) still refers to it: closing
/// or unpinning alone detaches only once the last reference is gone, after an RCU period.
pub fn detach_link(fd: impl AsFd) -> Result<(), EbpfError> {
    let mut attr = LinkDetachAttr {
        link_fd: fd_u32(fd.as_fd()),
    };
    bpf(BPF_LINK_DETACH, &mut attr)
        .map(drop)
        .map_err(|source| EbpfError::Syscall {
            command: "BPF_LINK_DETACH",
            what: format!("link fd {}", fd.as_fd().as_raw_fd()),
            source,
        })
}

/// A file descriptor as the u32 bpf_attr wants (fds are never negative once opened).
fn fd_u32(fd: std::os::fd::BorrowedFd<'_>) -> u32 {
    fd.as_raw_fd().unsigned_abs()
}
