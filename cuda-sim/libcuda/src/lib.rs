//! `libcuda.so.1` of the simulated driver: NVIDIA's CUDA driver API, with the real symbol
//! names and ABIs, over the simulated node of `vgpu-cuda-sim`.
//!
//! Every exported function is thin: it enters a guard (no panic may cross into the
//! application), checks its raw arguments, calls safe logic in [`rt`], [`mem`], [`ipc`] (memory shared between processes),
//! [`exec`], [`module`], [`peer`] (peer-to-peer, from the node's topology) and
//! [`checkpoint`] (the checkpoint API, one process acting on another by pid), and
//! maps the outcome to a `CUresult`. Entry points resolve three ways, as on the real
//! driver: by exported symbol (linking or `dlsym`) and through `cuGetProcAddress` by
//! (name, CUDA version, flags) from the table in [`procaddr`]. What is not implemented either is not exported (the loader or
//! `cuGetProcAddress` says so) or returns `CUDA_ERROR_NOT_SUPPORTED`. See
//! `docs/cuda-sim.md`.
//!
//! The exports the shim intercepts or calls are checked at compile time against their one
//! C signature in `vgpu_cuda_abi::fns` (`signatures.rs`).

// A C ABI library: exported functions take raw pointers from the application and the
// runtime maps memory with mmap. Every unsafe block carries its SAFETY argument.
#![allow(unsafe_code)]
#![allow(non_snake_case, clippy::missing_safety_doc)]
// Integers crossing the C ABI here are device ordinals, counts and attribute values,
// bounded by the validated configuration; `as` between C integer types is the ABI.
#![allow(clippy::cast_possible_wrap)]

pub mod checkpoint;
pub mod exec;
#[macro_use]
pub mod exports;
pub mod handle;
pub mod ipc;
pub mod mem;
pub mod module;
pub mod peer;
pub mod procaddr;
pub mod rt;
mod signatures;
