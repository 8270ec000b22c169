//! `vgpu-daemon`: the node daemon. It time-slices kernels between containers by share,
//! policy and priority (one arbiter per GPU, fed by the shims' launch gates), measures
//! the GPU time each container really used, watches the GPUs through NVML, reconciles
//! what the shims report with what the driver reports, and exports per-pod usage.
//!
//! - [`arbiter`]: each GPU's grant protocol, one pure state machine (events in, effects
//!   out, explicit clock): who holds the GPU, for how long, and what it is charged.
//! - [`checkpoint`]: the CUDA driver's checkpoint API, loaded from libcuda: what moves a
//!   suspended container's GPU memory to host memory and back (issue 43).
//! - [`board`]: the shared-memory grant words the shims read on their fast path.
//! - [`daemon`]: the node's state: tenants, processes, one arbiter per GPU, and one timer
//!   thread for all of them; it carries out the arbiters' effects.
//! - [`server`]: the shims' unix socket (peer credentials, framing, registration).
//! - [`connections`]: the caps on that socket per node, container and UID, the descriptor
//!   limit they need, the back-off after an accept error (pure), and their counters.
//! - [`enforcement`]: the eBPF GPU device gate and exit watcher (`vgpu-ebpf`): admits the
//!   shim's processes, releases a process's slices at its exit, counts refusals per pod.
//! - [`log_budget`]: a bound on the warning lines clients can make the daemon write.
//! - [`gate_events`]: the gate's events attributed, the latest kept, one bounded queue
//!   per subscriber of the gRPC stream (a slow one loses events, counted).
//! - [`second_line`]: memory enforcement outside the tenant (ADR 0039): containers over
//!   their quota past a grace have their offending processes refused and killed.
//! - [`model`]: what is reported (gRPC, Prometheus, `vgpuctl`).
//! - [`nvml`]: the NVML watcher (GPU memory, utilization, processes; bypass detection).
//! - [`metrics`]: Prometheus text exposition on `/metrics`.
//! - [`api`]: the gRPC API (`vgpu.daemon.v1`), served on a unix socket and optionally TCP.
//! - [`realtime`]: the daemon's CPU scheduling class (SCHED_FIFO on a busy node).
//! - [`reporting`]: starts the three above next to the shims' server.
//! - [`run`]: the composition root: a validated configuration in, the whole node served.
//! - [`ctl`]: `vgpuctl`, the API's command-line client; [`columns`]: its text tables.
//! - [`top`]: `vgpuctl top`, the live terminal view.
//!
//! See `docs/vgpu-daemon.md`.

// The server reads peer credentials and passes file descriptors (SCM_RIGHTS), and the
// realtime module sets the scheduling class (the board's memfd, mapping, seals and futex
// wakes are `vgpu-sys`'s): each unsafe block carries its SAFETY argument.
#![allow(unsafe_code)]

pub mod api;
pub mod arbiter;
pub mod board;
pub mod checkpoint;
pub mod columns;
pub mod connections;
pub mod ctl;
pub mod daemon;
pub mod enforcement;
pub mod gate_events;
pub mod log_budget;
pub mod metrics;
pub mod model;
pub mod nvml;
pub mod realtime;
pub mod reporting;
pub mod run;
pub mod second_line;
pub mod server;
pub mod stopped;
pub mod top;
