//! Stream-ordered memory pools: what the container is charged for each pool this
//! process allocates from (ADR 0008, "Memory pools").
//!
//! A pool keeps freed memory reserved on the device up to its release threshold
//! (`CU_MEMPOOL_ATTR_RELEASE_THRESHOLD`; PyTorch sets it to `u64::MAX`), so a
//! `cuMemFreeAsync` does not give memory back. The shim therefore never uncharges at a
//! free: the freed bytes become the pool's *credit* (charged, not in use), a later
//! allocation from the same pool is served from the credit first (no second charge),
//! and the credit is lowered to what the driver really keeps
//! (`CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`) only at the points where the driver can
//! have released memory: synchronisation, trims, threshold changes, pool destruction,
//! and before an allocation is refused. Invariant: for every live pool,
//! `charged ≥ reserved by the driver` (physical ≤ charged ≤ quota).
//!
//! This module is the bookkeeping alone (pure, under the shim's short in-process lock);
//! the driver queries and the region's charges happen outside it, in the hooks. A
//! generation counter makes a reconciliation that raced with an allocation retry rather
//! than lower the charge on a stale reading.

use std::collections::HashMap;

/// One pool's account in this process.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PoolAcct {
    /// Device of the pool.
    pub dev: usize,
    /// Bytes charged to the container for this pool.
    pub charged: u64,
    /// Charges of its allocations not yet freed.
    pub live: u64,
    /// Fresh charges whose allocation has not returned from the driver yet (not in
    /// the driver's reserved figure yet).
    pub inflight: u64,
    /// Bumped by every change of `charged`, `live` or `inflight` by an allocation.
    pub epoch: u64,
    /// Destroyed by `cuMemPoolDestroy` (its reserved figure can no longer be asked).
    pub destroyed: bool,
}

impl PoolAcct {
    /// Charged bytes not in use: what the pool may keep cached.
    pub fn credit(&self) -> u64 {
        self.charged.saturating_sub(self.live)
    }
}

/// The pools of this process.
#[derive(Debug, Default)]
pub struct Pools {
    map: HashMap<u64, PoolAcct>,
}

impl Pools {
    /// The account of `pool`, if known.
    pub fn get(&self, pool: u64) -> Option<PoolAcct> {
        self.map.get(&pool).copied()
    }

    fn entry(&mut self, pool: u64, dev: usize) -> &mut PoolAcct {
        self.map.entry(pool).or_insert(PoolAcct {
            dev,
            ..PoolAcct::default()
        })
    }

    /// Records the device of a pool (`cuMemPoolCreate`). A handle the driver reuses
    /// after a destruction keeps what is still charged for the old pool (the safe
    /// direction).
    pub fn register(&mut self, pool: u64, dev: usize) {
        let a = self.entry(pool, dev);
        a.dev = dev;
        a.destroyed = false;
    }

    /// Serves `need` bytes of an allocation from the pool's credit, if it covers them
    /// and so does what the driver has cached right now (`cached`: its reserved minus
    /// used figures). Credit of frees the driver has not executed yet is no cache: the
    /// simulator (and a driver without stream-ordered reuse) reserves such a request
    /// anew.
    pub fn take_credit(&mut self, pool: u64, dev: usize, need: u64, cached: u64) -> bool {
        let a = self.entry(pool, dev);
        if a.destroyed || a.credit() < need || cached < need {
            return false;
        }
        a.live = a.live.saturating_add(need);
        a.epoch = a.epoch.wrapping_add(1);
        true
    }

    /// Records a fresh charge of `need` bytes (already charged to the region) for an
    /// allocation about to be made.
    pub fn add_fresh(&mut self, pool: u64, dev: usize, need: u64) {
        let a = self.entry(pool, dev);
        a.charged = a.charged.saturating_add(need);
        a.live = a.live.saturating_add(need);
        a.inflight = a.inflight.saturating_add(need);
        a.epoch = a.epoch.wrapping_add(1);
    }

    /// The allocation begun with [`Pools::take_credit`] (`fresh` false) or
    /// [`Pools::add_fresh`] returned from the driver. Returns `(device, bytes to
    /// uncharge)`: a failed fresh allocation gives its charge back.
    pub fn finish(&mut self, pool: u64, need: u64, fresh: bool, ok: bool) -> (usize, u64) {
        let Some(a) = self.map.get_mut(&pool) else {
            return (0, 0);
        };
        a.epoch = a.epoch.wrapping_add(1);
        if fresh {
            a.inflight = a.inflight.saturating_sub(need);
        }
        if ok {
            return (a.dev, 0);
        }
        a.live = a.live.saturating_sub(need);
        if fresh {
            a.charged = a.charged.saturating_sub(need);
            return (a.dev, need);
        }
        (a.dev, 0)
    }

    /// Bytes the driver reserves for `pool` beyond its charge (`reserved`: the driver's
    /// `RESERVED_MEM_CURRENT`, read after an allocation returned).
    pub fn growth(&self, pool: u64, reserved: u64) -> u64 {
        self.map
            .get(&pool)
            .map_or(0, |a| reserved.saturating_sub(a.charged))
    }

    /// Adds `bytes` (already charged to the region) to the pool's charge.
    pub fn add_charge(&mut self, pool: u64, bytes: u64) {
        if let Some(a) = self.map.get_mut(&pool) {
            a.charged = a.charged.saturating_add(bytes);
            a.epoch = a.epoch.wrapping_add(1);
        }
    }

    /// An allocation of `bytes` from `pool` was freed: its charge becomes credit. For a
    /// destroyed pool, a synchronous free (`cuMemFree`, a context's destruction) gives
    /// the charge back at once. Returns `(device, bytes to uncharge)`.
    pub fn freed(&mut self, pool: u64, bytes: u64, synchronous: bool) -> (usize, u64) {
        let Some(a) = self.map.get_mut(&pool) else {
            return (0, 0);
        };
        a.live = a.live.saturating_sub(bytes);
        let dev = a.dev;
        let mut back = 0;
        if a.destroyed && synchronous {
            back = bytes.min(a.charged);
            a.charged -= back;
        }
        self.forget_if_empty(pool);
        (dev, back)
    }

    fn forget_if_empty(&mut self, pool: u64) {
        if self
            .map
            .get(&pool)
            .is_some_and(|a| a.destroyed && a.charged == 0 && a.live == 0 && a.inflight == 0)
        {
            self.map.remove(&pool);
        }
    }

    /// Live pools (on `dev`, or on any device) that hold credit: those a
    /// reconciliation can lower.
    pub fn with_credit(&self, dev: Option<usize>) -> Vec<u64> {
        self.map
            .iter()
            .filter(|(_, a)| !a.destroyed && a.credit() > 0 && dev.is_none_or(|d| d == a.dev))
            .map(|(p, _)| *p)
            .collect()
    }

    /// The generation of a live pool, taken before asking the driver what it reserves.
    pub fn snapshot(&self, pool: u64) -> Option<u64> {
        self.map
            .get(&pool)
            .filter(|a| !a.destroyed)
            .map(|a| a.epoch)
    }

    /// Lowers the charge of `pool` to what the driver reserves (`reserved`, read after
    /// [`Pools::snapshot`] returned `epoch`) plus the fresh charges still in flight.
    /// `None` if an allocation changed the account meanwhile (the reading may be
    /// stale: retry); else `Some((device, bytes to uncharge))`. Never raises a charge.
    pub fn settle(&mut self, pool: u64, epoch: u64, reserved: u64) -> Option<(usize, u64)> {
        let a = self.map.get_mut(&pool)?;
        if a.epoch != epoch || a.destroyed {
            return None;
        }
        let target = reserved.saturating_add(a.inflight);
        let back = a.charged.saturating_sub(target);
        a.charged -= back;
        Some((a.dev, back))
    }

    /// `cuMemPoolDestroy` succeeded; `used` is the driver's `USED_MEM_CURRENT` read just
    /// before (the allocations still outstanding, stream-ordered frees not yet executed
    /// included: the driver releases those when they execute). The cache is gone; what
    /// stays charged is the outstanding memory. Returns `(device, bytes to uncharge)`.
    pub fn destroyed(&mut self, pool: u64, used: Option<u64>) -> (usize, u64) {
        let Some(a) = self.map.get_mut(&pool) else {
            return (0, 0);
        };
        let keep = used
            .unwrap_or(a.charged)
            .max(a.live)
            .saturating_add(a.inflight);
        let back = a.charged.saturating_sub(keep);
        a.charged -= back;
        a.destroyed = true;
        let dev = a.dev;
        self.forget_if_empty(pool);
        (dev, back)
    }

    /// The whole context is synchronised (`cuCtxSynchronize`): the stream-ordered frees
    /// of destroyed pools have executed, so those pools keep only their live charges.
    /// Returns `(device, bytes to uncharge)` per pool.
    pub fn ctx_synchronized(&mut self) -> Vec<(usize, u64)> {
        let mut out = Vec::new();
        let mut gone = Vec::new();
        for (p, a) in &mut self.map {
            if !a.destroyed {
                continue;
            }
            let back = a.charged.saturating_sub(a.live.saturating_add(a.inflight));
            a.charged -= back;
            if back > 0 {
                out.push((a.dev, back));
            }
            gone.push(*p);
        }
        for p in gone {
            self.forget_if_empty(p);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: u64 = 2 << 20;

    #[test]
    fn freed_memory_stays_charged_as_credit_and_is_reused_without_a_second_charge() {
        let mut p = Pools::default();
        assert!(!p.take_credit(7, 0, 4 * G, u64::MAX));
        p.add_fresh(7, 0, 4 * G);
        assert_eq!(p.finish(7, 4 * G, true, true), (0, 0));
        assert_eq!(p.freed(7, 4 * G, false), (0, 0));
        let a = p.get(7).expect("known");
        assert_eq!((a.charged, a.live, a.credit()), (4 * G, 0, 4 * G));
        // Reuse: from the credit, nothing charged again.
        assert!(p.take_credit(7, 0, 3 * G, u64::MAX));
        assert_eq!(p.finish(7, 3 * G, false, true), (0, 0));
        assert!(
            !p.take_credit(7, 0, 2 * G, u64::MAX),
            "only 1 granule of credit left"
        );
        assert_eq!(p.get(7).map(|a| a.charged), Some(4 * G));
    }

    #[test]
    fn a_failed_allocation_gives_back_exactly_what_it_took() {
        let mut p = Pools::default();
        p.add_fresh(1, 2, G);
        assert_eq!(p.finish(1, G, true, false), (2, G));
        let a = p.get(1).expect("known");
        assert_eq!((a.charged, a.live, a.inflight), (0, 0, 0));
        p.add_fresh(1, 2, G);
        p.finish(1, G, true, true);
        p.freed(1, G, false);
        assert!(p.take_credit(1, 2, G, u64::MAX));
        assert_eq!(p.finish(1, G, false, false), (2, 0));
        assert_eq!(p.get(1).map(|a| (a.charged, a.live)), Some((G, 0)));
    }

    #[test]
    fn settling_lowers_to_the_driver_and_never_below_allocations_in_flight() {
        let mut p = Pools::default();
        p.add_fresh(1, 0, 4 * G);
        p.finish(1, 4 * G, true, true);
        p.freed(1, 4 * G, false);
        // A fresh allocation in flight (charged, not yet reserved by the driver).
        p.add_fresh(1, 0, G);
        let g = p.snapshot(1).expect("live");
        assert_eq!(p.settle(1, g, 0), Some((0, 4 * G)));
        assert_eq!(p.get(1).map(|a| a.charged), Some(G));
        // A reading raced by an allocation is not used.
        let g = p.snapshot(1).expect("live");
        p.finish(1, G, true, true);
        assert_eq!(p.settle(1, g, 0), None);
        // Never raises.
        let g = p.snapshot(1).expect("live");
        assert_eq!(p.settle(1, g, 10 * G), Some((0, 0)));
        assert_eq!(p.get(1).map(|a| a.charged), Some(G));
    }

    #[test]
    fn destroyed_pools_keep_outstanding_memory_until_freed_or_synchronised() {
        let mut p = Pools::default();
        p.register(9, 1);
        for _ in 0..3 {
            p.add_fresh(9, 1, G);
            p.finish(9, G, true, true);
        }
        p.freed(9, G, false); // cached
        p.freed(9, G, false); // a stream-ordered free not yet executed (driver: used)
        assert_eq!(p.destroyed(9, Some(2 * G)), (1, G));
        assert!(p.with_credit(None).is_empty());
        assert_eq!(p.snapshot(9), None);
        assert!(!p.take_credit(9, 1, G, u64::MAX));
        assert_eq!(p.freed(9, G, true), (1, G), "a synchronous free gives back");
        assert_eq!(p.ctx_synchronized(), vec![(1, G)]);
        assert_eq!(p.get(9), None, "forgotten once empty");
    }

    #[test]
    fn growth_is_what_the_driver_reserves_beyond_the_charge() {
        let mut p = Pools::default();
        p.add_fresh(3, 0, G);
        p.finish(3, G, true, true);
        assert_eq!(p.growth(3, G), 0);
        assert_eq!(p.growth(3, 3 * G), 2 * G);
        p.add_charge(3, 2 * G);
        assert_eq!(p.growth(3, 3 * G), 0);
        // The growth is charged but not in use: credit, lowered at the next settle.
        assert_eq!(p.with_credit(Some(0)), vec![3]);
        assert_eq!(p.with_credit(Some(1)), Vec::<u64>::new());
        let e = p.snapshot(3).expect("live");
        assert_eq!(p.settle(3, e, G), Some((0, 2 * G)));
        assert_eq!(p.with_credit(None), Vec::<u64>::new());
    }

    /// The simulator's pool: a cache counter, frees that execute later (then trim to
    /// the threshold), allocations from the cache when it covers them, else fresh.
    #[derive(Debug, Default)]
    struct DriverPool {
        used: u64,
        cached: u64,
        threshold: u64,
        pending: Vec<u64>,
        physical: u64,
    }

    impl DriverPool {
        fn reserved(&self) -> u64 {
            self.used + self.cached
        }
        fn alloc(&mut self, need: u64) {
            if self.cached >= need {
                self.cached -= need;
            } else {
                self.physical += need;
            }
            self.used += need;
        }
        fn trim(&mut self, keep: u64) {
            if self.cached > keep {
                self.physical -= self.cached - keep;
                self.cached = keep;
            }
        }
        fn execute_one(&mut self) {
            if let Some(b) = self.pending.pop() {
                self.used -= b;
                self.cached += b;
                self.trim(self.threshold);
            }
        }
    }

    /// The container's region, for one device.
    struct Quota {
        quota: u64,
        charged: u64,
    }

    fn reconcile(p: &mut Pools, q: &mut Quota, d: &DriverPool) {
        if let Some(e) = p.snapshot(1)
            && let Some((_, back)) = p.settle(1, e, d.reserved())
        {
            q.charged -= back;
        }
    }

    fn reserve(p: &mut Pools, q: &mut Quota, d: &DriverPool, bytes: u64) -> bool {
        if q.charged + bytes > q.quota {
            reconcile(p, q, d);
        }
        if q.charged + bytes > q.quota {
            return false;
        }
        q.charged += bytes;
        true
    }

    proptest::proptest! {
        /// Any sequence of pool allocations, stream-ordered frees, executions of the
        /// frees, synchronisations, trims and threshold changes, run through the hooks'
        /// order of operations against the simulator's pool model, keeps the driver's
        /// physical memory ≤ the charge ≤ the quota, and a trim to 0 after everything is
        /// freed and synchronised brings the charge back to 0.
        #[test]
        fn physical_never_exceeds_the_charge_nor_the_charge_the_quota(
            quota_g in 1u64..64,
            ops in proptest::collection::vec((0u8..6, 1u64..16), 1..120),
        ) {
            let mut p = Pools::default();
            let mut q = Quota { quota: quota_g * G, charged: 0 };
            let mut d = DriverPool::default();
            let mut live: Vec<u64> = Vec::new();
            for (op, n) in ops {
                match op {
                    0 => {
                        let need = n * G;
                        let mut cached = 0;
                        if p.get(1).is_some_and(|a| a.credit() >= need) {
                            reconcile(&mut p, &mut q, &d);
                            cached = d.cached;
                        }
                        let fresh = if p.take_credit(1, 0, need, cached) {
                            false
                        } else if reserve(&mut p, &mut q, &d, need) {
                            p.add_fresh(1, 0, need);
                            true
                        } else {
                            continue;
                        };
                        d.alloc(need);
                        let (_, back) = p.finish(1, need, fresh, true);
                        q.charged -= back;
                        let grow = p.growth(1, d.reserved());
                        if grow > 0 {
                            if reserve(&mut p, &mut q, &d, grow) {
                                p.add_charge(1, grow);
                            } else {
                                // Undone: freed in stream order, and executed before
                                // anything else runs (the physical excess is the
                                // documented transient of this path).
                                d.pending.push(need);
                                d.execute_one();
                                let (_, back) = p.freed(1, need, false);
                                q.charged -= back;
                                continue;
                            }
                        }
                        live.push(need);
                    }
                    1 => {
                        if let Some(b) = live.pop() {
                            let (_, back) = p.freed(1, b, false);
                            q.charged -= back;
                            d.pending.push(b);
                        }
                    }
                    2 => d.execute_one(),
                    3 => {
                        while !d.pending.is_empty() {
                            d.execute_one();
                        }
                        reconcile(&mut p, &mut q, &d);
                    }
                    4 => {
                        d.threshold = if n > 12 { u64::MAX } else { n * G };
                        d.trim(d.threshold);
                        reconcile(&mut p, &mut q, &d);
                    }
                    _ => {
                        d.trim((n % 4) * G);
                        reconcile(&mut p, &mut q, &d);
                    }
                }
                proptest::prop_assert!(d.physical <= q.charged, "{d:?} {:?} {}", p.get(1), q.charged);
                proptest::prop_assert!(q.charged <= q.quota);
                proptest::prop_assert_eq!(p.get(1).map_or(0, |a| a.charged), q.charged);
            }
            while let Some(b) = live.pop() {
                let (_, back) = p.freed(1, b, false);
                q.charged -= back;
                d.pending.push(b);
            }
            while !d.pending.is_empty() {
                d.execute_one();
            }
            d.trim(0);
            reconcile(&mut p, &mut q, &d);
            proptest::prop_assert_eq!(q.charged, 0);
            proptest::prop_assert_eq!(d.physical, 0);
        }
    }
}
