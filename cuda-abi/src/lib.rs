//! The CUDA driver API and NVML ABIs as Rust types: result codes, enums and `#[repr(C)]`
//! structs with the layouts of NVIDIA's `cuda.h` and `nvml.h`.
//!
//! This crate is the one place where these types are defined; the shim and the
//! simulated driver both use it, so they cannot disagree about an ABI. Values are
//! facts from NVIDIA's public headers. Compatibility rule: constants and struct
//! layouts never change once published; new ones are only added.

#![forbid(unsafe_code)]
#![allow(non_camel_case_types, non_snake_case)]

pub mod cuda;
pub mod fns;
pub mod nvml;
