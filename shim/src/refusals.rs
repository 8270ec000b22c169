//! Allocations this process refused over the container's memory quota, per device: a
//! running count and the figures of the latest, which the gate's runner thread reports to
//! the daemon with the periodic usage (the daemon counts them per container; the device
//! plugin turns a burst of them into one `Warning` event on the pod). Recording is a
//! counter increment and a short lock that never spans a driver call.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

use vgpu_core::sched_proto::MemoryRefusal;

use crate::config::MAX_DEVICES;

/// Per device: how many allocations were refused, and the latest one.
#[derive(Debug)]
pub struct Refusals {
    count: [AtomicU64; MAX_DEVICES],
    last: Mutex<[Option<MemoryRefusal>; MAX_DEVICES]>,
}

impl Default for Refusals {
    fn default() -> Refusals {
        Refusals {
            count: std::array::from_fn(|_| AtomicU64::new(0)),
            last: Mutex::new([None; MAX_DEVICES]),
        }
    }
}

impl Refusals {
    /// Records a refused allocation on `dev`.
    pub fn record(&self, dev: usize, r: MemoryRefusal) {
        let Some(c) = self.count.get(dev) else {
            return;
        };
        let mut last = self.last.lock().unwrap_or_else(PoisonError::into_inner);
        last[dev] = Some(r);
        c.fetch_add(1, Ordering::Relaxed);
    }

    /// How many allocations were refused on all devices (no lock).
    pub fn total(&self) -> u64 {
        self.count.iter().map(|c| c.load(Ordering::Relaxed)).sum()
    }

    /// How many allocations were refused on `dev`, and the latest.
    pub fn get(&self, dev: usize) -> (u64, Option<MemoryRefusal>) {
        let Some(c) = self.count.get(dev) else {
            return (0, None);
        };
        let last = self.last.lock().unwrap_or_else(PoisonError::into_inner);
        (c.load(Ordering::Relaxed), last[dev])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_and_keeps_the_latest_per_device() {
        let r = Refusals::default();
        assert_eq!(r.get(0), (0, None));
        let a = MemoryRefusal {
            asked: 1,
            used: 2,
            quota: 3,
        };
        let b = MemoryRefusal { asked: 4, ..a };
        r.record(1, a);
        r.record(1, b);
        assert_eq!(r.get(1), (2, Some(b)));
        assert_eq!(r.total(), 2);
        assert_eq!(r.get(0), (0, None));
        r.record(MAX_DEVICES, a);
        assert_eq!(r.get(MAX_DEVICES), (0, None));
    }
}
