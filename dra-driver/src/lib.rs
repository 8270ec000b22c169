//! vgpu's Dynamic Resource Allocation driver (kubelet plugin side).
//!
//! Kubelet finds the driver through its plugin registration socket and calls its DRA
//! service (`k8s.io/kubelet/pkg/apis/dra/v1`). `NodePrepareResources` reads each
//! ResourceClaim's allocation from the API server (the GPU and, with consumable
//! capacity, the memory and compute it takes), writes the quota file the shim reads
//! (`vgpu_core::container_quota`, the device plugin's format) and a CDI spec whose
//! device hands the container that quota, the shim and its GPU; prepared claims are
//! checkpointed so that a restarted driver answers kubelet idempotently. The node's GPUs
//! are published as one `ResourceSlice` (one shareable device per GPU with `memory` and
//! `compute` capacities)
//! (`docs/dra.md`, ADRs 0071–0073).

// Module map. Pure: `claim` (what a claim's allocation gives each request: the device
// model, capacities, configuration, the errors naming bad values), `cdi` (the CDI spec
// and the quota record of a prepared claim). `slice` (the node's ResourceSlice and its
// publishing). I/O: `driver` (the DRA service), `checkpoint`
// (the prepared claims' file), `registration` (the Registration service), `kubelet`
// (generated gRPC code and the unix-socket channel), `inventory` (the GPUs from NVML),
// `run` (the composition root main.rs calls), `config` (one validated struct).
// kubelet's test double lives in `vgpu-testkit` (feature `dra`).

pub mod cdi;
pub mod checkpoint;
pub mod claim;
pub mod config;
pub mod driver;
pub mod inventory;
pub mod kubelet;
pub mod registration;
pub mod run;
pub mod slice;

pub use config::Config;
