//! Helpers shared by the cross-component tests. Each test binary uses some of them.
#![allow(dead_code)]

pub mod daemon;
pub mod extender;
