//! vgpu's cluster half: the kube-scheduler extender and the packing-benchmark replay.
//!
//! The policy itself (ledger, filter, score, GPU choice) lives in
//! [`vgpu_core::packing`], which has no I/O; this crate drives it from a trace
//! ([`replay`]) and from kube-scheduler's HTTP extender protocol.

pub mod extender;
pub mod replay;
