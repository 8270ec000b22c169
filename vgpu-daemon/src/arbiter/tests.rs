//! The arbiter driven through [`Arbiter::on`] with an explicit clock.

use super::*;
