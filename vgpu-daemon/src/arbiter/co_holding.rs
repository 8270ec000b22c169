//! Co-holding (ADR 0029): tenants that together leave the GPU mostly idle hold it at
//! once, granted beside the holder and revoked with it.

use vgpu_core::sched_proto::ComputePolicy;

use super::TenantId;
use super::params::CO_HOLD_MIN_STOPPED;
use super::rules::{co_fits, preemptible_queue};
use super::stride::{Action, CoGrant, Revoked, Scheduler, St};
use super::tenant::TenantState;

impl Scheduler {
    /// The tenants holding the GPU beside the holder, with their generations.
    pub fn co_holders(&self) -> Vec<(TenantId, u32)> {
        self.co.iter().map(|(t, c)| (*t, c.generation)).collect()
    }

    /// Grants waiting tenants the GPU beside the holder while their fills and those of
    /// the holder and the co-holders add up to at most [`Params::co_hold_fill_pct`](crate::arbiter::params::Params::co_hold_fill_pct)
    /// ([`co_fits`]), best first. Only `burst` tenants of the holder's class with a
    /// measured fill, whose containers are throttled at least [`CO_HOLD_MIN_STOPPED`] of
    /// the time, are co-held: a capped tenant's slice is its tokens', a tenant not
    /// measured yet gets an exclusive slice first, and a latency-sensitive tenant
    /// never shares with best-effort work.
    pub(super) fn co_grant(&mut self, now: u64, out: &mut Vec<Action>) {
        let St::Holding { t: h, .. } = self.st else {
            return;
        };
        let bound = self.p.co_hold_fill_pct;
        let Some(ht) = self.tenants.get(&h) else {
            return;
        };
        let class = ht.settings.priority;
        let mut fills = self.holding_uses(h);
        self.refill(now);
        loop {
            let next = self
                .tenants
                .iter()
                .filter(|(id, t)| self.grantable(**id, t) && t.settings.priority == class)
                .filter_map(|(id, t)| {
                    let f = self.co_use(t).filter(|f| co_fits(&fills, *f, bound))?;
                    Some((*id, t.vtime, f))
                })
                .max_by(|(a, va, _), (b, vb, _)| vb.total_cmp(va).then(b.cmp(a)))
                .map(|(id, _, f)| (id, f));
            let Some((id, fill)) = next else {
                return;
            };
            self.generation = self.generation.wrapping_add(1) & 0x7fff_ffff;
            let generation = self.generation;
            let queue_ns = if self.preemptible(&self.tenants[&id]) {
                preemptible_queue(&self.p)
            } else {
                self.p.queue_ahead_ns
            };
            let t = self.tenants.get_mut(&id).expect("chosen among tenants");
            if let Some(s) = t.demand_since.take() {
                t.throttled_ns += now.saturating_sub(s);
            }
            t.grants += 1;
            t.queue_ns = queue_ns;
            t.shared = true;
            if let Some(ht) = self.tenants.get_mut(&h) {
                ht.shared = true;
            }
            self.co.insert(
                id,
                CoGrant {
                    generation,
                    since: now,
                },
            );
            fills.push(fill);
            out.push(Action::Grant {
                tenant: id,
                generation,
            });
        }
    }

    /// Whether the holder's and the co-holders' expected uses still add up to at most the
    /// bound.
    pub(super) fn co_still_fits(&self) -> bool {
        let St::Holding { t: h, .. } = self.st else {
            return false;
        };
        co_fits(&self.holding_uses(h), 0.0, self.p.co_hold_fill_pct)
    }

    /// The expected uses of holder `h` and the co-holders (1 where not measured).
    pub(super) fn holding_uses(&self, h: TenantId) -> Vec<f64> {
        std::iter::once(&h)
            .chain(self.co.keys())
            .map(|id| {
                self.tenants
                    .get(id)
                    .and_then(|t| t.expected_use(t.queue_ns))
                    .unwrap_or(1.0)
            })
            .collect()
    }

    /// Revokes every co-holder: each reports its drain when it can, and is charged then
    /// (or at the drain timeout); the GPU does not wait for them.
    pub(super) fn revoke_co(&mut self, now: u64, out: &mut Vec<Action>) {
        self.co_slices = 0;
        for (t, c) in std::mem::take(&mut self.co) {
            self.settle_co(t, c, now, out);
        }
    }

    /// Revokes co-holder `t`'s grant alone.
    pub(super) fn revoke_co_one(&mut self, t: TenantId, now: u64, out: &mut Vec<Action>) {
        if let Some(c) = self.co.remove(&t) {
            self.settle_co(t, c, now, out);
        }
    }

    /// Revokes co-grant `c` of tenant `t`, taken out of the co-holders: settled when its
    /// report comes.
    pub(super) fn settle_co(&mut self, t: TenantId, c: CoGrant, now: u64, out: &mut Vec<Action>) {
        self.settling.insert(
            t,
            Revoked {
                t,
                generation: c.generation,
                since: c.since,
                revoked_at: now,
                granted: c.since,
                provisional: 0,
                co: true,
                unclaimed: false,
            },
        );
        out.push(Action::Revoke {
            tenant: t,
            generation: c.generation,
        });
    }

    /// The expected use of a tenant co-holding may grant beside a holder: a `burst`
    /// tenant whose container is throttled at least [`CO_HOLD_MIN_STOPPED`] of the time,
    /// its use measured (None otherwise).
    pub(super) fn co_use(&self, t: &TenantState) -> Option<f64> {
        if t.settings.policy != ComputePolicy::Burst || t.stopped < CO_HOLD_MIN_STOPPED {
            return None;
        }
        t.expected_use(self.p.queue_ahead_ns)
    }
}
