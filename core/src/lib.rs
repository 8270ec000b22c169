//! vgpu's core: policy and arithmetic with no I/O and no `unsafe`.
//!
//! Everything here is a pure function of its inputs so that it can be unit- and
//! property-tested in isolation and shared by the shim, the daemon, the device
//! plugin, the scheduler extender and the simulated driver.

#![forbid(unsafe_code)]

pub mod bytes;
pub mod container_quota;
pub mod cpu_cgroup;
pub mod elf_exports;
pub mod gpu_uuid;
pub mod inventory;
pub mod kube_cgroup;
pub mod memory_limit;
pub mod packing;
pub mod pod_request;
pub mod proc_maps;
pub mod prom;
pub mod region_key;
pub mod resources;
pub mod sched_proto;
pub mod suspension;
pub mod topology;
pub mod visible;
