//! `libvgpu.so`: loaded into every CUDA process of a container (`LD_PRELOAD`), it
//! enforces the container's GPU memory quota and shows the container its own GPU.
//!
//! - [`table`]: the one table of intercepted entry points, which drives all three
//!   routes: exported symbols, the `dlsym` hook and the `cuGetProcAddress` hook.
//! - [`hooks`]: the exported functions: guard, pointer checks, one call into the safe
//!   logic below, result.
//! - [`dlsym`]: the `dlsym` route to the hooks (the exported `dlsym`, resolved at load).
//! - [`memory_view`]: what the container sees of a GPU's memory under its quota.
//! - [`nvml_procs`]: NVML's process lists filtered to the container's processes.
//! - [`accounting`]: what each allocation is charged, reservation and rollback, memory
//!   pools reconciled with the driver, contexts and the allocations that die with them.
//! - [`driver`]: safe wrappers of the real-driver calls the shim makes for itself.
//! - [`real`]: the real driver and NVML, resolved once, never through ourselves.
//! - [`admission`]: asks the daemon to admit this process through the node's eBPF device
//!   gate before the driver opens a GPU node (`cuInit`, `nvmlInit*`).
//! - [`devices`]: which devices the container sees (its GPUs only, numbered from 0).
//! - [`process`]: this process's enforcement state: configuration, failure policy (the
//!   one "am I enforcing?" decision), its slot and allocations.
//! - [`pools`]: what is charged for each stream-ordered memory pool (its cache stays
//!   charged until the driver releases it).
//! - [`vmm`]: what keeps a VMM allocation charged (references and mappings).
//! - [`refusals`]: allocations refused over the quota, per device, for the daemon.
//! - [`region`]: the container's shared accounting (atomics in a SysV shared-memory
//!   segment, [`segment`], ADR 0015; kernel liveness locks, no cross-process lock).
//! - [`gate`]: the launch gate (compute time-slicing with the daemon, local fallback);
//!   its gate thread, the daemon client with deadlines, is `gate::runner`.
//! - [`suspension`]: resume on call: a suspended container's next CUDA call asks the
//!   daemon to resume it and waits (issue 43).
//! - [`config`]: the environment, parsed and validated.
//! - [`quota_env`]: the quota published to the application in its environment
//!   (`VGPU_MEMORY_QUOTA_BYTES`), set as the shim is loaded.
//!
//! See `docs/shim.md` and ADR 0008.

// An LD_PRELOAD library: it exports C functions that take raw pointers from the
// application, calls the real driver through function pointers from dlsym, and maps
// shared memory. Every unsafe block carries its SAFETY argument.
#![allow(unsafe_code)]

/// `eprintln!` that never panics: a closed or full stderr must not take the
/// application (or the gate thread) down.
#[macro_export]
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

pub mod accounting;
pub mod admission;
pub mod config;
pub mod devices;
pub mod dlsym;
pub mod driver;
pub mod gate;
pub mod hooks;
pub mod memory_view;
pub mod nvml_procs;
pub mod pools;
pub mod process;
pub mod quota_env;
pub mod real;
pub mod refusals;
pub mod region;
pub mod segment;
pub mod suspension;
pub mod table;
pub mod vmm;
