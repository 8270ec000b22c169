//! vgpu's kubelet device plugin.
//!
//! It advertises every physical GPU as 10 device IDs `<gpu-uuid>-<slot>` of the resource
//! `vgpu.io/gpu` (0.1-GPU slices, ADR 0005), keeps their health from NVML events, and hands
//! each container exactly the GPU share that the scheduler extender recorded for it at bind
//! (`vgpu.io/assignment`, ADR 0007) through the race-free handshake of ADR 0009:
//!
//! - `Allocate` (no pod identity) mounts a per-allocation directory, named after the set
//!   of device IDs, plus the shim and an `ld.so.preload` generated from the configured path;
//! - `PreStartContainer` finds the one container that kubelet's PodResources API lists
//!   with exactly those device IDs, reads its pod's assignment from the API server and
//!   writes that container's quota file (`vgpu_core::container_quota`) into the per-allocation directory.
//!
//! The library is driven by `main.rs` and by the tests, which use a fake kubelet speaking
//! the real gRPC protocol over unix sockets and a fake API server.

// Module map. Kubelet-facing I/O: `server` (serve, register, re-register), `plugin` (the
// DevicePlugin service: ListAndWatch, Allocate), `podresources` (the shared List).
// The PreStartContainer handshake: `handshake` (the thin I/O driver and the quota file
// writer), `identify` (pure: which container a call is for), `error` (its error and
// gRPC mapping). `preferred` (GetPreferredAllocation), `visible` (the GPU order and the
// visibility variables), `ids` (device IDs), `preflight` (what cannot work is refused
// at start / Allocate). Node side: `health` (NVML), `topology` (each GPU's NUMA node,
// switch and NVLink peers, from NVML), `inventory` (the Node annotation), `audit`
// (processes without the shim), `gate_events` (the daemon's eBPF refusals as pod
// events), `refusal_events` (allocations refused over quota, from the daemon, as pod
// events), `gc` (allocation directories), `metrics`.
// `config` (one validated struct) and `run` (the composition root main.rs calls).
// The fakes of kubelet and the API server live in `vgpu-testkit` (tests/testkit), a
// dev-dependency; the benchmark is `examples/bench.rs`.

pub mod audit;
pub mod config;
pub mod error;
pub mod gate_events;
pub mod gc;
pub mod handshake;
pub mod health;
pub mod identify;
pub mod ids;
pub mod inventory;
pub mod kubelet;
pub mod metrics;
pub mod plugin;
pub mod podresources;
pub mod preferred;
pub mod preflight;
pub mod refusal_events;
pub mod run;
pub mod server;
pub mod topology;
pub mod visible;

pub use config::Config;
