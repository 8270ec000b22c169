//! Handles: the kinds of driver object, a new handle value of a kind, the pointer form
//! applications hold, and the check that a pointer is a live handle of the right kind;
//! and [`CuResult`], what every driver call returns. Below the runtime ([`crate::rt`])
//! and every object file, which all name objects by handle.

use std::sync::atomic::{AtomicU64, Ordering};

use vgpu_cuda_abi::cuda::{CUDA_ERROR_INVALID_HANDLE, CUresult};

/// What a driver call returns on failure.
pub type CuResult<T> = Result<T, CUresult>;

/// Kinds of handle, kept in the low byte of every handle value so that a handle of the
/// wrong kind (or a stale one) is rejected instead of misused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// `CUcontext`.
    Ctx = 0x11,
    /// `CUmodule` / `CUlibrary`.
    Module = 0x12,
    /// `CUfunction` / `CUkernel`.
    Func = 0x13,
    /// `CUstream`.
    Stream = 0x14,
    /// `CUevent`.
    Event = 0x15,
    /// `CUgraph`.
    Graph = 0x16,
    /// `CUgraphExec`.
    GraphExec = 0x17,
    /// `CUmemoryPool`.
    Pool = 0x18,
    /// `CUarray` / `CUmipmappedArray`.
    Array = 0x19,
    /// `CUgraphNode`.
    GraphNode = 0x1a,
    /// `CUmemGenericAllocationHandle`.
    Vmm = 0x1b,
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// A new handle value of `kind`.
pub fn new_handle(kind: Kind) -> u64 {
    (NEXT_ID.fetch_add(1, Ordering::Relaxed) << 8) | kind as u64
}

/// The raw pointer form of a handle.
pub fn to_ptr(h: u64) -> *mut std::ffi::c_void {
    h as usize as *mut std::ffi::c_void
}

/// Checks that `p` is a handle of `kind` and returns its value.
pub fn from_ptr(p: *mut std::ffi::c_void, kind: Kind) -> CuResult<u64> {
    let h = p as usize as u64;
    if h == 0 || (h & 0xff) as u8 != kind as u8 {
        return Err(CUDA_ERROR_INVALID_HANDLE);
    }
    Ok(h)
}
