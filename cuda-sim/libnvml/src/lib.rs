//! `libnvidia-ml.so.1` of the simulated driver: NVML with its real symbol names and ABIs,
//! every answer derived from the simulated node's shared state (`vgpu-cuda-sim`).
//!
//! The exported functions ([`ffi`]) are thin: each catches panics, checks its pointers,
//! calls the safe logic in [`sim`] and maps the result to an `nvmlReturn_t`. What the
//! simulator does not model returns `NVML_ERROR_NOT_SUPPORTED`; functions that are not
//! exported at all are what NVML clients see as `NVML_ERROR_FUNCTION_NOT_FOUND`.
//! See `docs/cuda-sim-nvml.md` for the list and for what each client needs.
//!
//! The exports the shim intercepts or calls are checked at compile time against their one
//! C signature in `vgpu_cuda_abi::fns` (`signatures.rs`).

// This crate is an FFI boundary: the exported functions receive raw pointers from C
// callers and must write through them. The unsafe is confined to `ffi.rs` and
// `ffi_topology.rs`, each block with its SAFETY argument; `sim.rs` and `topo.rs` are safe.
#![allow(unsafe_code)]

pub mod ffi;
pub mod ffi_topology;
mod signatures;
pub mod sim;
pub mod topo;

pub use ffi::*;
pub use ffi_topology::*;
