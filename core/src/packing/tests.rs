//! Unit and property tests of the policy core.
