//! The scheduler's policy core: a ledger of every node's GPUs, filter with precise
//! reasons, scores, and the concrete GPU choice. No I/O, no `unsafe`.
//!
//! - [`ledger`]: nodes, GPUs, what is free, who holds what; commits are checked so that
//!   no GPU is ever over-assigned (compute, memory or slices).
//! - [`policy`]: `random`, `bestfit`, `gpupacking`, `fgd` (as published), `spread` and
//!   the default `vgpu`.
//! - [`context`]: the GPU memory reserved for CUDA contexts, so that granted quotas
//!   can be allocated (ADR 0012).
//! - [`fgd`]: the fragmentation measure over the workload's typical tasks.
//! - [`reuse`]: kubelet's device reuse between a pod's containers: which containers
//!   must share GPUs, and what they hold together.
//! - [`node_choice`]: filter/score/choose a node over the ledger with per-node caching
//!   and a fixed tie-breaking node order (cluster placement; the daemon's GPU time
//!   slicing is another scheduler).

pub mod context;
pub mod fgd;
pub mod ledger;
pub mod node_choice;
pub mod policy;
pub mod reuse;

pub use context::{ContextReserve, ContextReserveError};
pub use fgd::{Fragmentation, RareShapes, TypicalTask, typical_tasks, typical_tasks_with_classes};
pub use ledger::{
    GpuFree, GpuSpec, Grant, Ledger, LedgerError, NodeSpec, NodeState, Placement, Reject, Task,
};
pub use node_choice::{NodeVerdict, Rank, Scheduler};
pub use policy::{
    Eval, Policy, PolicyName, Scale, TieKey, UnknownPolicy, VgpuParams, fragmentation_for,
};
pub use reuse::ReuseSlot;

#[cfg(test)]
mod tests;
