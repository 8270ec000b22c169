//! The simulated NVIDIA node behind `libcuda.so.1` and `libnvidia-ml.so.1`.
//!
//! This crate holds what both simulated libraries share: the node's configuration
//! ([`config`], built from [`device`]s and machine [`presets`], failing with a
//! [`config_error::ConfigError`]), its [`topology`] (PCIe tree, NVLinks, NUMA
//! nodes), its GPU device nodes ([`devnodes`]) and its shared state ([`node_state`], with the
//! checkpoint API's part in [`checkpoint_area`]): device memory accounting across
//! processes, process liveness, the execution engine that time-slices the GPU between
//! processes, utilization and accounting counters, and device events for fault
//! injection. The libraries themselves (`cuda-sim/libcuda`, `cuda-sim/libnvml`) are thin
//! ABI layers over it. See `docs/cuda-sim.md`.

// This crate reads the shared layout through a raw pointer into its mapping: the unsafe
// is confined to `node_state.rs`, each block with its SAFETY argument. The mapping, the
// clock, futexes, slot locks and the publish by link(2) are `vgpu-sys`'s.
#![allow(unsafe_code)]

pub mod bench;
pub mod checkpoint_area;
pub mod config;
pub mod config_error;
pub mod device;
pub mod devnodes;
pub mod node_state;
pub mod presets;
pub mod topology;
