//! vgpu's node primitives: the operating-system calls that several processes of a node
//! must make the same way, each written once, with its `unsafe`, here. The shim inside
//! applications, the node daemon and the simulated driver call them.
//!
//! - [`clock`]: the node's monotonic clock in ns ([`mono_ns`]), the time base the shims,
//!   the daemon and cuda-sim compare across processes, the same in every time namespace,
//!   and absolute sleeps on it ([`clock::sleep_until`]).
//! - [`futex`]: waiting on a shared `u32` word and waking its waiters, across processes
//!   ([`futex_wait`], [`futex_wake`]).
//! - [`slot_lock`]: process-slot liveness from open-file-description locks: a slot's
//!   owner holds a lock on byte *i* of a file, the kernel drops it when the owner dies.
//! - [`poll`]: which descriptors have input to read ([`poll::readable`]).
//! - [`publish`]: a shared file published complete or not at all (build it under a
//!   private name, then `link(2)` it into place).
//! - [`shm`]: shared memory: an anonymous sized file ([`shm::memfd`]), sealed against
//!   later writers, and a shared mapping that unmaps itself ([`shm::SharedMap`]).
//!
//! Why a crate of its own, and why here: the shim runs inside other people's processes
//! and may depend on nothing heavy, so these primitives cannot live in the daemon or in
//! cuda-sim; `core` is I/O-free and forbids `unsafe`, so they cannot live there either.
//! Like `cuda-abi/`, it is a leaf crate shared by the shim and cuda-sim, and sits beside
//! it at the top level. It depends on `libc` only.

// The primitives are raw system calls (clock_gettime, futex, fcntl, mmap): this is the one
// crate of the node where they are made. Every unsafe block carries its SAFETY argument;
// every function exported here is safe to call.
#![allow(unsafe_code)]

pub mod clock;
pub mod futex;
pub mod poll;
pub mod publish;
pub mod shm;
pub mod slot_lock;

pub use clock::mono_ns;
pub use futex::{futex_wait, futex_wake};
