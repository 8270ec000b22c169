//! Memory shared between processes: legacy IPC handles (`cuIpcGetMemHandle`,
//! `cuIpcOpenMemHandle`, `cuIpcCloseMemHandle`) and the VMM API's shareable handles
//! (`cuMemExportToShareableHandle` / `cuMemImportFromShareableHandle`, as a POSIX file
//! descriptor or a 64-byte fabric handle).
//!
//! The memory lives in a memfd of the exporting process: a VMM allocation has one from
//! its creation; a `cuMemAlloc` allocation is moved into one (contents copied, mapped
//! shared at the same address) the first time it is exported. A 64-byte handle names the
//! exporter's PID, the descriptor number there and its inode; the importer opens
//! `/proc/PID/fd/N` (same user) and checks the inode, so a stale handle is refused rather
//! than mapping some other file. The memory is charged once, to the exporter (the node's
//! accounting, and a shim above); the importer's mapping is charged nothing and cannot be
//! freed with `cuMemFree` (`CUDA_ERROR_INVALID_VALUE`), only closed. When the exporter
//! frees it, the node's charge goes with it even while an importer still maps it (the
//! real driver keeps it until the last process lets go): see `docs/cuda-sim.md`.

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, OwnedFd};

use vgpu_cuda_abi::cuda::*;

use crate::mem::{Alloc, AllocKind, VmmHandle};
use crate::rt::{CuResult, Driver, Kind, new_handle};

const MAGIC: &[u8; 8] = b"vgsimipc";
/// A handle of a `cuMemAlloc` allocation.
const KIND_MEM: u32 = 1;
/// A fabric handle of a VMM allocation.
const KIND_FABRIC: u32 = 2;

/// What a 64-byte handle names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shared {
    /// Exporting process.
    pub pid: u32,
    /// The memfd's descriptor number in it.
    pub fd: i32,
    /// The memfd's inode.
    pub ino: u64,
    /// Bytes the application asked for.
    pub size: u64,
    /// Bytes of the mapping (page-rounded).
    pub map_len: u64,
    /// Node device index.
    pub dev: u32,
    /// `KIND_MEM` or `KIND_FABRIC`.
    pub kind: u32,
}

impl Shared {
    /// The 64 bytes of the handle.
    pub fn encode(&self) -> [u8; CU_IPC_HANDLE_SIZE] {
        let mut b = [0u8; CU_IPC_HANDLE_SIZE];
        b[0..8].copy_from_slice(MAGIC);
        b[8..12].copy_from_slice(&self.pid.to_le_bytes());
        b[12..16].copy_from_slice(&self.fd.to_le_bytes());
        b[16..24].copy_from_slice(&self.ino.to_le_bytes());
        b[24..32].copy_from_slice(&self.size.to_le_bytes());
        b[32..40].copy_from_slice(&self.map_len.to_le_bytes());
        b[40..44].copy_from_slice(&self.dev.to_le_bytes());
        b[44..48].copy_from_slice(&self.kind.to_le_bytes());
        b
    }

    /// Reads a handle; None when it is not one of ours (garbage, zeroes).
    pub fn decode(b: &[u8; CU_IPC_HANDLE_SIZE]) -> Option<Shared> {
        if &b[0..8] != MAGIC {
            return None;
        }
        let u32_at = |i: usize| b[i..i + 4].try_into().ok().map(u32::from_le_bytes);
        let u64_at = |i: usize| b[i..i + 8].try_into().ok().map(u64::from_le_bytes);
        Some(Shared {
            pid: u32_at(8)?,
            fd: i32::from_le_bytes(b[12..16].try_into().ok()?),
            ino: u64_at(16)?,
            size: u64_at(24)?,
            map_len: u64_at(32)?,
            dev: u32_at(40)?,
            kind: u32_at(44)?,
        })
    }
}

fn inode(fd: i32) -> CuResult<(u64, u64)> {
    // SAFETY: fstat of a descriptor we hold into a zeroed stat buffer.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    Ok((st.st_ino, u64::try_from(st.st_size).unwrap_or(0)))
}

/// Opens the memfd a handle names in its exporter, checked against its inode.
fn open_remote(s: &Shared) -> CuResult<OwnedFd> {
    let path = CString::new(format!("/proc/{}/fd/{}", s.pid, s.fd))
        .map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
    // SAFETY: a NUL-terminated path; the result is checked.
    let raw = unsafe { libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    if raw < 0 {
        // The exporter exited or freed it.
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: a fresh descriptor nobody else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let (ino, len) = inode(fd.as_raw_fd())?;
    if ino != s.ino || len < s.map_len {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    Ok(fd)
}

fn map_shared(fd: i32, len: usize, at: Option<usize>) -> CuResult<usize> {
    let (addr, fixed) = match at {
        Some(a) => (a as *mut libc::c_void, libc::MAP_FIXED),
        None => (std::ptr::null_mut(), 0),
    };
    // SAFETY: a shared mapping of a memfd we hold; with MAP_FIXED only over our own
    // allocation's mapping of exactly this length (the caller's precondition).
    let p = unsafe {
        libc::mmap(
            addr,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | fixed,
            fd,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        Err(CUDA_ERROR_OUT_OF_MEMORY)
    } else {
        Ok(p as usize)
    }
}

/// `cuIpcGetMemHandle`: `dptr` must be the base of a `cuMemAlloc` allocation.
pub fn get(drv: &'static Driver, dptr: u64) -> CuResult<CUipcMemHandle> {
    let dev = {
        let o = drv.objects();
        let a = o
            .allocs
            .get(&dptr)
            .filter(|a| a.kind == AllocKind::Device)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        a.dev
    };
    // Nothing of the device's queued work may write the old mapping after the move.
    drv.worker(dev).drain();
    let mut o = drv.objects();
    let a = o
        .allocs
        .get(&dptr)
        .filter(|a| a.kind == AllocKind::Device)
        .ok_or(CUDA_ERROR_INVALID_VALUE)?
        .clone();
    let (fd, ino) = match o.ipc.get(&dptr) {
        Some(&e) => e,
        None => {
            let fd = vgpu_sys::shm::memfd(c"cuda-sim-ipc", a.map_len, false)
                .map_err(|_| CUDA_ERROR_OUT_OF_MEMORY)?;
            let tmp = map_shared(fd.as_raw_fd(), a.map_len, None)?;
            // SAFETY: both ranges are `map_len` bytes we own (the allocation's mapping and
            // the fresh shared one), distinct mappings.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    a.base as usize as *const u8,
                    tmp as *mut u8,
                    a.map_len,
                )
            };
            // SAFETY: unmapping the temporary mapping made just above.
            unsafe { libc::munmap(tmp as *mut libc::c_void, a.map_len) };
            // The allocation now lives in the memfd, at the same address.
            map_shared(fd.as_raw_fd(), a.map_len, Some(a.base as usize))?;
            let (ino, _) = inode(fd.as_raw_fd())?;
            let raw = fd.into_raw_fd();
            o.ipc.insert(dptr, (raw, ino));
            (raw, ino)
        }
    };
    Ok(CUipcMemHandle {
        reserved: Shared {
            pid: std::process::id(),
            fd,
            ino,
            size: a.size,
            map_len: a.map_len as u64,
            dev: u32::try_from(dev).map_err(|_| CUDA_ERROR_INVALID_VALUE)?,
            kind: KIND_MEM,
        }
        .encode(),
    })
}

/// `cuIpcOpenMemHandle`: maps another process's allocation into this one (context
/// `ctx`), charged nothing here.
pub fn open(drv: &Driver, ctx: u64, h: &CUipcMemHandle, flags: u32) -> CuResult<u64> {
    if flags & !CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let s = Shared::decode(&h.reserved)
        .filter(|s| s.kind == KIND_MEM)
        .ok_or(CUDA_ERROR_INVALID_VALUE)?;
    // A process cannot open its own handles.
    if s.pid == std::process::id() {
        return Err(CUDA_ERROR_INVALID_CONTEXT);
    }
    let dev = usize::try_from(s.dev).map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
    if dev >= drv.device_count() {
        return Err(CUDA_ERROR_INVALID_DEVICE);
    }
    let fd = open_remote(&s)?;
    let len = usize::try_from(s.map_len).map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
    let base = map_shared(fd.as_raw_fd(), len, None)? as u64;
    drv.objects().allocs.insert(
        base,
        Alloc {
            base,
            size: s.size,
            map_len: len,
            charged: 0,
            dev,
            ctx,
            kind: AllocKind::IpcImport,
            maps: Vec::new(),
        },
    );
    Ok(base)
}

/// `cuIpcCloseMemHandle`: unmaps what [`open`] mapped.
pub fn close(drv: &'static Driver, dptr: u64) -> CuResult<()> {
    let dev = drv
        .objects()
        .allocs
        .get(&dptr)
        .filter(|a| a.kind == AllocKind::IpcImport)
        .map(|a| a.dev)
        .ok_or(CUDA_ERROR_INVALID_VALUE)?;
    drv.worker(dev).drain();
    crate::mem::free_now(drv, dptr);
    Ok(())
}

/// What `cuMemExportToShareableHandle` hands out.
#[derive(Debug, Clone, Copy)]
pub enum Exported {
    /// A new file descriptor of the allocation (`CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`).
    Fd(i32),
    /// A 64-byte fabric handle (`CU_MEM_HANDLE_TYPE_FABRIC`).
    Fabric([u8; CU_IPC_HANDLE_SIZE]),
}

/// `cuMemExportToShareableHandle`: only as a type the allocation was created to be
/// exported as (`requestedHandleTypes`), else `CUDA_ERROR_INVALID_VALUE`.
pub fn export(drv: &Driver, h: u64, ty: u32) -> CuResult<Exported> {
    let o = drv.objects();
    let v = o.vmm.get(&h).ok_or(CUDA_ERROR_INVALID_VALUE)?;
    if ty == 0 || v.handle_types & ty != ty {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let dev = v.dev.ok_or(CUDA_ERROR_INVALID_VALUE)?;
    match ty {
        CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR => {
            // SAFETY: duplicating a descriptor we hold; the copy is the caller's.
            let fd = unsafe { libc::dup(v.fd) };
            if fd < 0 {
                return Err(CUDA_ERROR_OUT_OF_MEMORY);
            }
            Ok(Exported::Fd(fd))
        }
        CU_MEM_HANDLE_TYPE_FABRIC => {
            let (ino, _) = inode(v.fd)?;
            Ok(Exported::Fabric(
                Shared {
                    pid: std::process::id(),
                    fd: v.fd,
                    ino,
                    size: v.size,
                    map_len: v.size,
                    dev: u32::try_from(dev).map_err(|_| CUDA_ERROR_INVALID_VALUE)?,
                    kind: KIND_FABRIC,
                }
                .encode(),
            ))
        }
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    }
}

/// The memfd name of a VMM allocation on node device `dev` (None: host memory): the
/// importer of a bare file descriptor reads its device from it.
pub fn vmm_memfd_name(dev: Option<usize>) -> CString {
    let name = match dev {
        Some(d) => format!("cuda-sim-vmm-d{d}"),
        None => "cuda-sim-vmm-host".to_owned(),
    };
    CString::new(name).unwrap_or_else(|_| c"cuda-sim-vmm".to_owned())
}

/// The node device of a VMM memfd, from its name (`/memfd:cuda-sim-vmm-dN (deleted)`).
fn device_of_fd(fd: i32) -> CuResult<usize> {
    let link =
        std::fs::read_link(format!("/proc/self/fd/{fd}")).map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
    let link = link.to_string_lossy();
    link.strip_prefix("/memfd:cuda-sim-vmm-d")
        .and_then(|r| r.split(' ').next())
        .and_then(|d| d.parse().ok())
        .ok_or(CUDA_ERROR_INVALID_VALUE)
}

/// `cuMemImportFromShareableHandle`: a new handle of another process's allocation,
/// charged nothing here. `fd`: a descriptor the caller holds (POSIX type), else the
/// fabric handle.
pub fn import(
    drv: &Driver,
    fd: Option<i32>,
    fabric: Option<&[u8; CU_IPC_HANDLE_SIZE]>,
) -> CuResult<u64> {
    let (own, size, dev, types) = match (fd, fabric) {
        (Some(fd), _) => {
            let dev = device_of_fd(fd)?;
            // SAFETY: duplicating the caller's descriptor (it keeps its own).
            let raw = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
            if raw < 0 {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            // SAFETY: a fresh descriptor nobody else owns.
            let own = unsafe { OwnedFd::from_raw_fd(raw) };
            let (_, size) = inode(own.as_raw_fd())?;
            (own, size, dev, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        }
        (None, Some(b)) => {
            let s = Shared::decode(b)
                .filter(|s| s.kind == KIND_FABRIC)
                .ok_or(CUDA_ERROR_INVALID_VALUE)?;
            let dev = usize::try_from(s.dev).map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
            (open_remote(&s)?, s.size, dev, CU_MEM_HANDLE_TYPE_FABRIC)
        }
        (None, None) => return Err(CUDA_ERROR_INVALID_VALUE),
    };
    if dev >= drv.device_count() || size == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let id = drv.ordinal(dev).unwrap_or(-1);
    let h = new_handle(Kind::Vmm);
    drv.objects().vmm.insert(
        h,
        VmmHandle {
            dev: Some(dev),
            location: CUmemLocation {
                type_: CU_MEM_LOCATION_TYPE_DEVICE,
                id,
            },
            handle_types: types,
            size,
            charged: 0,
            fd: own.into_raw_fd(),
            maps: 0,
            refs: 1,
        },
    );
    Ok(h)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_round_trip_and_garbage_is_refused() {
        let s = Shared {
            pid: 42,
            fd: 7,
            ino: 99,
            size: 1 << 20,
            map_len: 1 << 20,
            dev: 3,
            kind: KIND_MEM,
        };
        assert_eq!(Shared::decode(&s.encode()), Some(s));
        assert_eq!(Shared::decode(&[0; CU_IPC_HANDLE_SIZE]), None);
        assert_eq!(Shared::decode(&[0xff; CU_IPC_HANDLE_SIZE]), None);
    }
}
