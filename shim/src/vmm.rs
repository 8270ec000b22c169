//! What keeps a VMM allocation (`cuMemCreate`) charged: as in the driver, its memory
//! lives while a reference (the creation, each `cuMemRetainAllocationHandle`) or a
//! mapping (`cuMemMap`) holds it, so a handle released while still mapped stays charged
//! until its last unmap (ADR 0049). Bookkeeping only: no I/O, no driver call; the
//! accounting calls it after the driver succeeded and gives back what it returns.
//! Host-located and imported handles are never recorded here (nothing charged).

use std::collections::{BTreeMap, HashMap};

use crate::process::Charge;

/// One charged handle.
#[derive(Debug, Clone, Copy)]
struct Held {
    charge: Charge,
    refs: u32,
    maps: u32,
}

/// This process's charged VMM handles and their mappings.
#[derive(Debug, Default)]
pub struct Vmm {
    handles: HashMap<u64, Held>,
    /// Mappings by address: (length, handle).
    maps: BTreeMap<u64, (u64, u64)>,
}

impl Vmm {
    /// A handle created with `charge`. Returns the charge of a stale record of the same
    /// handle value (the driver reused it: that memory is gone), to give back.
    pub fn created(&mut self, handle: u64, charge: Charge) -> Option<Charge> {
        let old = self.handles.insert(
            handle,
            Held {
                charge,
                refs: 1,
                maps: 0,
            },
        );
        if old.is_some() {
            self.maps.retain(|_, m| m.1 != handle);
        }
        old.map(|h| h.charge)
    }

    /// One more reference (`cuMemRetainAllocationHandle`).
    pub fn retained(&mut self, handle: u64) {
        if let Some(h) = self.handles.get_mut(&handle) {
            h.refs = h.refs.saturating_add(1);
        }
    }

    /// One reference fewer (`cuMemRelease`); the charge to give back when nothing holds
    /// the memory any more.
    pub fn released(&mut self, handle: u64) -> Option<Charge> {
        let h = self.handles.get_mut(&handle)?;
        h.refs = h.refs.saturating_sub(1);
        self.gone(handle)
    }

    /// `handle` mapped at `[va, va + len)`.
    pub fn mapped(&mut self, va: u64, len: u64, handle: u64) {
        if let Some(h) = self.handles.get_mut(&handle) {
            h.maps = h.maps.saturating_add(1);
            self.maps.insert(va, (len, handle));
        }
    }

    /// The mappings inside `[va, va + len)` unmapped; the charges of handles that
    /// nothing holds any more, to give back.
    pub fn unmapped(&mut self, va: u64, len: u64) -> Vec<Charge> {
        let end = va.saturating_add(len);
        let inside: Vec<u64> = self
            .maps
            .range(va..end)
            .filter(|(a, m)| a.saturating_add(m.0) <= end)
            .map(|(a, _)| *a)
            .collect();
        let mut back = Vec::new();
        for a in inside {
            let Some((_, handle)) = self.maps.remove(&a) else {
                continue;
            };
            if let Some(h) = self.handles.get_mut(&handle) {
                h.maps = h.maps.saturating_sub(1);
            }
            back.extend(self.gone(handle));
        }
        back
    }

    /// Whether `handle` is a charged handle of this process.
    pub fn holds(&self, handle: u64) -> bool {
        self.handles.contains_key(&handle)
    }

    /// Bytes charged for the handles held (for tests and logs).
    pub fn charged(&self) -> u64 {
        self.handles.values().map(|h| h.charge.bytes).sum()
    }

    fn gone(&mut self, handle: u64) -> Option<Charge> {
        match self.handles.get(&handle) {
            Some(h) if h.refs == 0 && h.maps == 0 => self.handles.remove(&handle).map(|h| h.charge),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn charge(bytes: u64) -> Charge {
        Charge {
            dev: 0,
            bytes,
            ctx: 0,
            pool: 0,
        }
    }

    #[test]
    fn release_then_unmap_gives_back_at_the_unmap() {
        let mut v = Vmm::default();
        assert!(v.created(7, charge(64)).is_none());
        v.mapped(0x1000, 64, 7);
        assert!(v.released(7).is_none(), "still mapped");
        assert_eq!(v.charged(), 64);
        let back = v.unmapped(0x1000, 64);
        assert_eq!(back.iter().map(|c| c.bytes).sum::<u64>(), 64);
        assert_eq!(v.charged(), 0);
        assert!(!v.holds(7));
    }

    #[test]
    fn unmap_then_release_gives_back_at_the_release() {
        let mut v = Vmm::default();
        v.created(7, charge(64));
        v.mapped(0x1000, 32, 7);
        v.mapped(0x1000 + 32, 32, 7);
        assert!(v.unmapped(0x1000, 64).is_empty(), "still referenced");
        assert_eq!(v.released(7).map(|c| c.bytes), Some(64));
    }

    #[test]
    fn retains_are_references() {
        // NCCL's free: retain, release, unmap, release.
        let mut v = Vmm::default();
        v.created(7, charge(64));
        v.mapped(0x1000, 64, 7);
        v.retained(7);
        assert!(v.released(7).is_none());
        assert!(v.unmapped(0x1000, 64).is_empty());
        assert_eq!(v.released(7).map(|c| c.bytes), Some(64));
        assert!(
            v.released(7).is_none(),
            "a second release gives nothing back"
        );
    }

    #[test]
    fn partial_unmaps_leave_the_rest() {
        let mut v = Vmm::default();
        v.created(1, charge(64));
        v.created(2, charge(64));
        v.mapped(0x1000, 64, 1);
        v.mapped(0x2000, 64, 2);
        v.released(1);
        v.released(2);
        // A range covering only the first mapping, and one covering half of the second.
        assert_eq!(v.unmapped(0x1000, 0x1000).len(), 1);
        assert!(v.unmapped(0x2000, 32).is_empty());
        assert_eq!(v.charged(), 64);
    }

    #[test]
    fn unknown_handles_are_ignored() {
        let mut v = Vmm::default();
        v.retained(9);
        v.mapped(0x1000, 64, 9);
        assert!(v.released(9).is_none());
        assert!(v.unmapped(0, u64::MAX).is_empty());
    }

    #[test]
    fn a_reused_handle_value_returns_the_stale_charge() {
        let mut v = Vmm::default();
        v.created(7, charge(64));
        v.mapped(0x1000, 64, 7);
        assert_eq!(v.created(7, charge(32)).map(|c| c.bytes), Some(64));
        assert!(v.unmapped(0x1000, 64).is_empty());
        assert_eq!(v.charged(), 32);
    }
}
