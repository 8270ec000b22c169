//! Helpers shared by the cross-component tests.

pub mod extender;
