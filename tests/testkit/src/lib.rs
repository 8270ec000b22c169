//! vgpu's test doubles of the components' peers, for the tests and the benchmarks only
//! (a dev-dependency: no production binary links them). Every wait has a deadline, so a
//! call that never comes fails fast instead of hanging.
//!
//! - [`fake_api`]: one scripted fake Kubernetes API server (nodes and pods: get, list,
//!   watch, merge patch; bindings; events), shared by the device plugin's and the
//!   extender's tests, with scripted failures and a record of every request.
//! - [`deploy`]: the shipped manifests read as `kubectl apply -f deploy/` would, for the
//!   CI check of their objects, order, flags and paths (ADR 0052).
//! - `fake_kubelet` (feature `plugin`): a fake kubelet speaking the real gRPC protocols
//!   over unix sockets (Registration server, DevicePlugin client, PodResources server,
//!   with kubelet's admission order and device reuse).
//! - `fake_dra_kubelet` (feature `dra`): kubelet's plugin watcher and DRA manager for the
//!   DRA driver, over unix sockets (registration, `NodePrepareResources`,
//!   `NodeUnprepareResources`).
//! - `node` (feature `plugin`): a whole node, the fakes plus the device plugin wired by
//!   its own composition root (`vgpu_device_plugin::run::start`).
//! - `topology_manager` (feature `plugin`): kubelet's Topology Manager reading the
//!   devices' `TopologyInfo` (hints, `single-numa-node`, the aligned devices).

pub mod deploy;
pub mod fake_api;
#[cfg(feature = "dra")]
pub mod fake_dra_kubelet;
#[cfg(feature = "plugin")]
pub mod fake_kubelet;
#[cfg(feature = "plugin")]
pub mod node;
#[cfg(feature = "plugin")]
pub mod topology_manager;
