//! The kube-scheduler extender: HTTP filter/prioritize/bind over a live ledger
//! kept in sync with the API server through kube-rs watches.
//!
//! - [`types`]: the extender v1 JSON (PascalCase keys, embedded Kubernetes objects).
//! - [`http`]: the verbs as byte-level handlers, an axum router and the HTTP server.
//! - [`limits`]: request-body size, deadlines and memory budget; parse errors that
//!   never echo the body.
//! - [`cluster`]: the extender's view of the cluster: nodes, pods, bind assumptions
//!   (with TTL) and the derived ledger; read-decide-commit under one lock.
//! - [`api_objects`]: pods and nodes read in the ledger's terms (request, task, node
//!   spec from the inventory, assignment as placement).
//! - `filter_reasons`: filter's allocation-free fit and reasons, and which rejections
//!   preemption can resolve.
//! - [`policy`]: the policy core as the live extender drives it.
//! - [`quota`]: quota policies per namespace (the `VgpuQuotaPolicy` resource, its
//!   checks, status, events and metrics; ADR 0022).
//! - [`binder`]: the assignment annotation and the Binding, through kube-rs.
//! - [`sync`]: Node and Pod watches feeding [`cluster::State`].
//! - [`tls`]: TLS on the port and the client certificates that may call the verbs.
//! - [`run`]: the `serve` subcommand's configuration and its entry point (the
//!   composition root: client, watches, binder, HTTP server).
//! - [`bench`](mod@bench): the latency benchmark (`bench-extender`).
//!
//! Design and its reasons: `docs/adr/0007-extender-state-and-bind.md`.

pub mod api_objects;
pub mod bench;
pub mod binder;
pub mod cluster;
pub mod error;
mod filter_reasons;
pub mod http;
pub mod limits;
mod names;
pub mod policy;
pub mod quota;
pub mod run;
pub mod sync;
pub mod tls;
pub mod types;

pub use cluster::{State, StateConfig};
pub use error::{ExtenderError, Verb};
pub use http::Extender;
