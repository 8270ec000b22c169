//! The CUDA driver as the daemon uses it: the checkpoint API (`cuCheckpointProcess*`,
//! driver r570, CUDA 12.8), loaded from `libcuda` (`--cuda-lib`) on the first
//! suspension, initialised with `cuInit`, and kept for the daemon's life. The one place
//! the daemon calls the CUDA driver (NVML is [`crate::nvml`]'s); the safe wrappers below
//! are all the suspension code ([`crate::daemon`]'s `suspension`) uses.
//!
//! Every call acts on another process by PID, as the driver's controller does: lock
//! (its new CUDA calls block, the calls and work in flight finish within the timeout),
//! checkpoint (its device memory to host memory), restore (back, at the same
//! addresses), unlock. A refusal is the driver's code ([`Code`]), named.

use std::ffi::{CStr, CString, OsStr, c_int, c_void};
use std::fmt;
use std::os::unix::ffi::OsStrExt;

use vgpu_cuda_abi::cuda::{
    CUDA_SUCCESS, CUcheckpointLockArgs, CUresult, process_state, result_name,
};
use vgpu_cuda_abi::fns::{
    PFN_cuCheckpointProcessCheckpoint, PFN_cuCheckpointProcessGetState,
    PFN_cuCheckpointProcessLock, PFN_cuCheckpointProcessRestore, PFN_cuCheckpointProcessUnlock,
    PFN_cuInit,
};

/// The driver's soname: what the daemon loads unless told otherwise (`--cuda-lib`).
pub const DEFAULT_LIB: &str = "libcuda.so.1";

/// A `CUresult` other than success, from one of the checkpoint calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Code(pub CUresult);

impl fmt::Display for Code {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match result_name(self.0) {
            Some(n) => write!(f, "{n} ({})", self.0),
            None => write!(f, "CUresult {}", self.0),
        }
    }
}

/// Why the driver's checkpoint API cannot be used.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum DriverError {
    /// `dlopen` failed.
    #[error("cannot load the CUDA driver {lib}: {why}")]
    Load {
        /// The library asked for.
        lib: String,
        /// `dlerror()`'s words.
        why: String,
    },
    /// The library lacks an entry point of the checkpoint API.
    #[error(
        "the CUDA driver {lib} has no {symbol} (the checkpoint API needs driver r570 or later)"
    )]
    Missing {
        /// The library.
        lib: String,
        /// The missing entry point.
        symbol: &'static str,
    },
    /// `cuInit` failed.
    #[error("cuInit of the CUDA driver {lib} failed: {code}")]
    Init {
        /// The library.
        lib: String,
        /// Its answer.
        code: Code,
    },
}

/// A process's state under the checkpoint API (`CUprocessState`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProcessState {
    /// Its CUDA calls run.
    Running,
    /// Locked: new calls block.
    Locked,
    /// Its device memory is in host memory.
    Checkpointed,
    /// An uncorrectable error during a checkpoint or restore.
    Failed,
    /// A value this daemon does not know.
    Other(u32),
}

/// The checkpoint API of a loaded, initialised driver.
#[derive(Debug)]
pub struct Driver {
    lib: String,
    lock: PFN_cuCheckpointProcessLock,
    checkpoint: PFN_cuCheckpointProcessCheckpoint,
    restore: PFN_cuCheckpointProcessRestore,
    unlock: PFN_cuCheckpointProcessUnlock,
    state: PFN_cuCheckpointProcessGetState,
}

fn dlerror() -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated string valid until the next dl*
    // call of this thread; it is copied at once.
    let p = unsafe { libc::dlerror() };
    if p.is_null() {
        return "unknown error".to_owned();
    }
    // SAFETY: non-NULL, NUL-terminated (above).
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// The address of `symbol` in `handle`, or the error naming it.
fn sym(handle: *mut c_void, lib: &str, symbol: &'static CStr) -> Result<*mut c_void, DriverError> {
    // SAFETY: `handle` is a live dlopen handle (never closed), `symbol` NUL-terminated.
    let p = unsafe { libc::dlsym(handle, symbol.as_ptr()) };
    if p.is_null() {
        return Err(DriverError::Missing {
            lib: lib.to_owned(),
            symbol: symbol.to_str().unwrap_or("?"),
        });
    }
    Ok(p)
}

fn pid_arg(pid: u32) -> Result<c_int, Code> {
    c_int::try_from(pid).map_err(|_| Code(vgpu_cuda_abi::cuda::CUDA_ERROR_INVALID_VALUE))
}

fn check(r: CUresult) -> Result<(), Code> {
    if r == CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Code(r))
    }
}

impl Driver {
    /// Loads `lib` (a soname searched as `dlopen` does, or a path), resolves the
    /// checkpoint API and calls `cuInit(0)`. The library stays loaded for the process's
    /// life.
    pub fn load(lib: &OsStr) -> Result<Driver, DriverError> {
        let name = lib.to_string_lossy().into_owned();
        let c = CString::new(lib.as_bytes()).map_err(|_| DriverError::Load {
            lib: name.clone(),
            why: "the name holds a NUL byte".to_owned(),
        })?;
        // SAFETY: a NUL-terminated name; the handle is never closed, so every symbol
        // taken from it stays valid.
        let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if h.is_null() {
            return Err(DriverError::Load {
                lib: name,
                why: dlerror(),
            });
        }
        let init = sym(h, &name, c"cuInit")?;
        let lock = sym(h, &name, c"cuCheckpointProcessLock")?;
        let checkpoint = sym(h, &name, c"cuCheckpointProcessCheckpoint")?;
        let restore = sym(h, &name, c"cuCheckpointProcessRestore")?;
        let unlock = sym(h, &name, c"cuCheckpointProcessUnlock")?;
        let state = sym(h, &name, c"cuCheckpointProcessGetState")?;
        // SAFETY: (all six) each address is the driver's export of that name, whose C
        // signature is the `vgpu_cuda_abi::fns` type it is cast to (CUDA 12.8 headers).
        let init: PFN_cuInit = unsafe { std::mem::transmute::<*mut c_void, PFN_cuInit>(init) };
        // SAFETY: as above.
        let d = unsafe {
            Driver {
                lib: name.clone(),
                lock: std::mem::transmute::<*mut c_void, PFN_cuCheckpointProcessLock>(lock),
                checkpoint: std::mem::transmute::<*mut c_void, PFN_cuCheckpointProcessCheckpoint>(
                    checkpoint,
                ),
                restore: std::mem::transmute::<*mut c_void, PFN_cuCheckpointProcessRestore>(
                    restore,
                ),
                unlock: std::mem::transmute::<*mut c_void, PFN_cuCheckpointProcessUnlock>(unlock),
                state: std::mem::transmute::<*mut c_void, PFN_cuCheckpointProcessGetState>(state),
            }
        };
        // SAFETY: cuInit takes flags by value; 0 is the only valid value.
        let r = unsafe { init(0) };
        check(r).map_err(|code| DriverError::Init { lib: name, code })?;
        Ok(d)
    }

    /// The library this was loaded from.
    pub fn lib(&self) -> &str {
        &self.lib
    }

    /// `cuCheckpointProcessLock(pid, {timeoutMs})`.
    pub fn lock(&self, pid: u32, timeout_ms: u32) -> Result<(), Code> {
        let mut args = CUcheckpointLockArgs {
            timeoutMs: timeout_ms,
            ..Default::default()
        };
        // SAFETY: a valid, zeroed-reserved argument struct that outlives the call.
        check(unsafe { (self.lock)(pid_arg(pid)?, &raw mut args) })
    }

    /// `cuCheckpointProcessCheckpoint(pid, NULL)`: to host memory.
    pub fn checkpoint(&self, pid: u32) -> Result<(), Code> {
        // SAFETY: NULL arguments are the driver's defaults (host memory).
        check(unsafe { (self.checkpoint)(pid_arg(pid)?, std::ptr::null_mut()) })
    }

    /// `cuCheckpointProcessRestore(pid, NULL)`: onto the same GPUs.
    pub fn restore(&self, pid: u32) -> Result<(), Code> {
        // SAFETY: NULL arguments are the driver's defaults (same GPUs, host memory).
        check(unsafe { (self.restore)(pid_arg(pid)?, std::ptr::null_mut()) })
    }

    /// `cuCheckpointProcessUnlock(pid, NULL)`.
    pub fn unlock(&self, pid: u32) -> Result<(), Code> {
        // SAFETY: NULL arguments are the driver's defaults.
        check(unsafe { (self.unlock)(pid_arg(pid)?, std::ptr::null_mut()) })
    }

    /// `cuCheckpointProcessGetState(pid)`.
    pub fn state(&self, pid: u32) -> Result<ProcessState, Code> {
        let mut s = 0;
        // SAFETY: `s` is a valid out-pointer for the call's duration.
        check(unsafe { (self.state)(pid_arg(pid)?, &raw mut s) })?;
        Ok(match s {
            process_state::RUNNING => ProcessState::Running,
            process_state::LOCKED => ProcessState::Locked,
            process_state::CHECKPOINTED => ProcessState::Checkpointed,
            process_state::FAILED => ProcessState::Failed,
            o => ProcessState::Other(o),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_named() {
        assert_eq!(Code(801).to_string(), "CUDA_ERROR_NOT_SUPPORTED (801)");
        assert_eq!(Code(123_456).to_string(), "CUresult 123456");
    }

    #[test]
    fn a_missing_library_is_named() {
        let e = Driver::load(OsStr::new("/nonexistent/libcuda.so.1")).expect_err("no driver");
        assert!(e.to_string().contains("/nonexistent/libcuda.so.1"), "{e}");
    }
}
