//! Who goes next (stride scheduling over measured device time): tokens, charges and
//! refunds, class ranks, the best waiter, the grant itself, and the preemptions a waiter
//! may cause.

use vgpu_core::sched_proto::{ComputePolicy, Priority};

use super::TenantId;
use super::stride::{Action, Scheduler, St};
use super::tenant::{TenantState, queue_of, slice_of};

impl Scheduler {
    pub(super) fn min_slice(&self) -> f64 {
        self.p.quantum_ns as f64 / 4.0
    }

    pub(super) fn refill(&mut self, now: u64) {
        let cap = self.p.quantum_ns as f64;
        for t in self.tenants.values_mut() {
            if now > t.bucket_at {
                let rate = f64::from(t.settings.share_pct) / 100.0;
                t.bucket_ns = (t.bucket_ns + (now - t.bucket_at) as f64 * rate).min(cap);
            }
            t.bucket_at = t.bucket_at.max(now);
        }
    }

    pub(super) fn eligible(&self, t: &TenantState) -> bool {
        t.settings.policy == ComputePolicy::Burst || t.bucket_ns >= self.min_slice()
    }

    pub(super) fn charge(&mut self, id: TenantId, ns: u64, end: u64) {
        let window = self.p.window_ns;
        if let Some(t) = self.tenants.get_mut(&id) {
            t.used_ns += ns;
            t.vtime += ns as f64 * 100.0 / f64::from(t.settings.share_pct.max(1));
            t.bucket_ns -= ns as f64;
            t.recent.push_back((end, ns));
            while t.recent.front().is_some_and(|(e, _)| *e + window < end) {
                t.recent.pop_front();
            }
            self.scheduled_ns += ns;
        }
    }

    /// Gives back `ns` charged provisionally (renewals) beyond what the grant cost. The
    /// virtual time goes back no lower than `floor` (where a tenant was placed, waking,
    /// during the grant; not above the holder's virtual time before the refund): that
    /// tenant was placed at a clock the renewals' estimate had carried, and the holder's
    /// refund would otherwise put it behind them for time neither waited for.
    pub(super) fn refund(&mut self, id: TenantId, ns: u64, floor: Option<f64>) {
        if let Some(t) = self.tenants.get_mut(&id) {
            t.used_ns = t.used_ns.saturating_sub(ns);
            let before = t.vtime;
            t.vtime -= ns as f64 * 100.0 / f64::from(t.settings.share_pct.max(1));
            if let Some(f) = floor {
                t.vtime = t.vtime.max(f.min(before));
            }
            t.bucket_ns = (t.bucket_ns + ns as f64).min(self.p.quantum_ns as f64);
            self.scheduled_ns = self.scheduled_ns.saturating_sub(ns);
        }
    }

    /// Whether `t` is best-effort beside a latency-sensitive tenant: its grants keep a
    /// short queue ([`PREEMPTIBLE_QUEUE_AHEAD_NS`](crate::arbiter::params::PREEMPTIBLE_QUEUE_AHEAD_NS)).
    pub(super) fn preemptible(&self, t: &TenantState) -> bool {
        t.settings.priority == Priority::BestEffort
            && self
                .tenants
                .values()
                .any(|o| o.settings.priority == Priority::LatencySensitive)
    }

    /// Class rank for the choice: latency-sensitive first unless it ran too far ahead.
    pub(super) fn rank(&self, id: TenantId, t: &TenantState) -> u8 {
        if t.settings.priority != Priority::LatencySensitive {
            return 0;
        }
        let lead = 2.0 * self.p.quantum_ns as f64 * 100.0 / f64::from(t.settings.share_pct.max(1));
        let best_effort_min = self
            .tenants
            .iter()
            .filter(|(k, o)| {
                **k != id
                    && o.settings.priority == Priority::BestEffort
                    && (o.demand_since.is_some() || self.holder() == Some(**k))
            })
            .map(|(_, o)| o.vtime)
            .fold(f64::INFINITY, f64::min);
        u8::from(t.vtime <= best_effort_min + lead)
    }

    pub(super) fn best_waiter(&self) -> Option<TenantId> {
        self.tenants
            .iter()
            .filter(|(id, t)| self.grantable(**id, t))
            .max_by(|(a, ta), (b, tb)| {
                self.rank(**a, ta)
                    .cmp(&self.rank(**b, tb))
                    .then(tb.vtime.total_cmp(&ta.vtime))
                    .then(b.cmp(a))
            })
            .map(|(id, _)| *id)
    }

    /// Whether tenant `id` waits and could be granted now: it asks, it is eligible (on
    /// the last refill), and it is not a revoked holder still to report its drain.
    pub(super) fn grantable(&self, id: TenantId, t: &TenantState) -> bool {
        t.demand_since.is_some()
            && self.eligible(t)
            && !self.settling.contains_key(&id)
            && !self.co.contains_key(&id)
    }

    /// Whether a tenant other than `id` is [grantable](Scheduler::grantable).
    pub(super) fn others_waiting(&self, id: TenantId) -> bool {
        self.tenants
            .iter()
            .any(|(k, o)| *k != id && self.grantable(*k, o))
    }

    /// Whether `id`, if it asked now, would be chosen before every other eligible
    /// waiter: same class and no larger virtual time.
    pub(super) fn owed(&mut self, id: TenantId, now: u64) -> bool {
        self.refill(now);
        let Some(t) = self.tenants.get(&id) else {
            return false;
        };
        if !self.eligible(t) {
            return false;
        }
        let rank = self.rank(id, t);
        let others: Vec<(u8, f64)> = self
            .tenants
            .iter()
            .filter(|(k, o)| **k != id && o.demand_since.is_some() && self.eligible(o))
            .map(|(k, o)| (self.rank(*k, o), o.vtime))
            .collect();
        !others.is_empty()
            && others
                .iter()
                .all(|&(r, v)| r < rank || (r == rank && t.vtime <= v))
    }

    /// Since when another tenant has been waiting for the GPU that `id` holds since
    /// `granted` (`u64::MAX`: nobody waits). A demand is only taken back by its grant,
    /// so a tenant waiting now has waited since its `demand_since`.
    pub(super) fn contended_from(&self, id: TenantId, granted: u64) -> u64 {
        self.tenants
            .iter()
            .filter(|(k, _)| **k != id)
            .filter_map(|(_, o)| o.demand_since)
            .min()
            .map_or(u64::MAX, |s| s.max(granted))
    }

    pub(super) fn pick(&mut self, now: u64, out: &mut Vec<Action>) {
        if !matches!(self.st, St::Idle) {
            return;
        }
        if let Some((r, until)) = self.reserved {
            let back = self
                .tenants
                .get(&r)
                .is_some_and(|t| t.demand_since.is_some());
            if now < until && !back {
                return;
            }
            self.reserved = None;
        }
        self.refill(now);
        let Some(id) = self.best_waiter() else {
            return;
        };
        self.generation = self.generation.wrapping_add(1) & 0x7fff_ffff;
        let generation = self.generation;
        let min_slice = self.min_slice();
        let preemptible = self.preemptible(&self.tenants[&id]);
        let t = self.tenants.get_mut(&id).expect("chosen among tenants");
        if let Some(s) = t.demand_since.take() {
            t.throttled_ns += now.saturating_sub(s);
        }
        t.grants += 1;
        // Granted while revoked grants' queued work may still run (the GPU did not wait
        // for their reports): its markers may time that work too. A grant revoked
        // unclaimed has nothing on the GPU.
        t.shared = self.settling.values().any(|r| !r.unclaimed);
        self.vclock = self.vclock.max(t.vtime);
        self.placed_max = None;
        let slice = slice_of(&self.p, t, min_slice);
        t.queue_ns = queue_of(&self.p, t, slice, preemptible);
        self.st = St::Holding {
            t: id,
            generation,
            since: now,
            deadline: now + slice,
            granted: now,
            provisional: 0,
            claimed: false,
        };
        out.push(Action::Grant {
            tenant: id,
            generation,
        });
        self.co_grant(now, out);
    }

    /// Revokes the holder if `id`, waiting, would be chosen before it (a higher class, or
    /// the same class and no larger virtual time).
    pub(super) fn reclaim_for(&mut self, id: TenantId, now: u64, out: &mut Vec<Action>) {
        let St::Holding { t: h, .. } = self.st else {
            return;
        };
        self.refill(now);
        let (Some(ht), Some(it)) = (self.tenants.get(&h), self.tenants.get(&id)) else {
            return;
        };
        if h == id || !self.eligible(it) {
            return;
        }
        let (hr, ir) = (self.rank(h, ht), self.rank(id, it));
        if ir > hr || (ir == hr && it.vtime <= ht.vtime) {
            self.revoke(now, out);
        }
    }

    /// Revokes a holder that a waiting latency-sensitive tenant outranks, or whose own
    /// settings no longer let it hold.
    pub(super) fn preempt_if_needed(&mut self, now: u64, out: &mut Vec<Action>) {
        let St::Holding { t: h, .. } = self.st else {
            return;
        };
        self.refill(now);
        let Some(ht) = self.tenants.get(&h) else {
            return;
        };
        let h_rank = self.rank(h, ht);
        if let Some(w) = self.best_waiter()
            && w != h
        {
            let wt = &self.tenants[&w];
            if self.rank(w, wt) > h_rank {
                self.revoke(now, out);
            }
        }
    }
}
