//! vgpu-ebpf: the node's enforcement outside the process. Two eBPF programs written in C
//! (`bpf/vgpu.bpf.c`, compiled by build.rs) and their loader (aya 0.14):
//!
//! - the **GPU device gate** (`cgroup/dev`), attached with `BPF_F_ALLOW_MULTI` to a cgroup2
//!   directory, lets a process open NVIDIA's character devices only when the daemon
//!   registered its tgid, when its cgroup is trusted, or when the mode is audit;
//! - the **exit watcher** (tracepoint `sched/sched_process_exit`) reports the end of every
//!   registered or watched process, and of every process that opened a GPU node, and forgets
//!   its registration; `sched/sched_process_exec` drops the registration of a process that
//!   runs a new program.
//!
//! Module map: [`abi`] (the `#[repr(C)]` kernel boundary), [`config`] (mode, attach point,
//! GPU device numbers), [`enforcer`] (load, attach, maps, detach, pins), [`event`] (ring
//! buffer records and reader), [`attribution`] (cgroup path → pod, read by `vgpu_core::kube_cgroup`), [`preflight`] (why eBPF
//! cannot run here), `sys` (the raw bpf() calls aya lacks). See docs/ebpf.md.
//!
//! `unsafe` is allowed in this crate only for the kernel boundary: the two bpf() system calls
//! in `sys`, `poll` on the ring buffer, reading a ring-buffer record, and `aya::Pod` for the
//! map key type. Each block says why it holds.
#![allow(unsafe_code)]

pub mod abi;
pub mod attribution;
pub mod config;
pub mod enforcer;
mod error;
pub mod event;
pub mod preflight;
mod sys;

pub use config::{EbpfConfig, GpuDevice, Mode};
pub use enforcer::{Counters, Enforcer, cgroup_id, find_cgroup, remove_pins};
pub use error::EbpfError;
pub use event::{Event, EventKind, EventReader};
