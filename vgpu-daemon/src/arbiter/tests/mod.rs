//! The arbiter's tests, by topic, each driven with an explicit clock: `protocol` drives
//! the arbiter through [`super::Arbiter::on`] (a grant's way, drains reported by several
//! processes, yields, claims, expiries); the others test the scheduler's rules.

mod charging;
mod claims;
mod co_holding;
mod hand_on;
mod protocol;
mod shared_charging;
mod shares;
mod slices;

/// A millisecond, ns.
const MS: u64 = 1_000_000;
