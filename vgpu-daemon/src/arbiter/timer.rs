//! Time passing: slices ending or renewed, drains timing out, reservations ending, and
//! the expiry each grant carries for a daemon too starved to revoke it (ADR 0036).

use std::collections::BTreeSet;

use vgpu_core::sched_proto::ComputePolicy;

use super::TenantId;
use super::params::{ALONE_EXPIRY_MARGINS, CO_REFRESH_SLICES, UNREAD_RECHECK_NS};
use super::stride::{Action, Revoked, Scheduler, St};
use super::tenant::{TenantState, cap_slice};

impl Scheduler {
    #[cfg(test)]
    /// Time passes: ends slices, times out drains, lets capped tenants back in.
    pub fn tick(&mut self, now: u64) -> Vec<Action> {
        self.tick_unread(now, &BTreeSet::new())
    }

    /// `Scheduler::tick`, knowing which tenants have sent messages the daemon has not
    /// read yet (`unread`). Two decisions rest on a tenant's absence, and are put off by
    /// [`UNREAD_RECHECK_NS`] while that tenant may have asked already: a holder alone is
    /// not renewed while another tenant has unread input (the slice goes on, uncharged
    /// until it ends), and the GPU kept free for a releasing tenant that is owed time is
    /// not given away while that tenant has unread input, for at most
    /// [`RESERVATION_RECHECKS`](crate::arbiter::params::RESERVATION_RECHECKS) looks (a tenant that floods the daemon cannot keep the
    /// GPU idle longer).
    /// A daemon starved of CPU read a tenant's demands 364 ms late while renewing its
    /// neighbour, and the shares drifted (issue 16).
    pub fn tick_unread(&mut self, now: u64, unread: &BTreeSet<TenantId>) -> Vec<Action> {
        let mut out = Vec::new();
        self.tick_into(now, unread, &mut out);
        out
    }

    /// Whether a tick at `now` would decide on a tenant's absence (renew a lone
    /// holder's slice, or end a reservation), so that unread input matters.
    pub fn absence_due(&self, now: u64) -> bool {
        match self.st {
            St::Holding { deadline, .. } => now >= deadline,
            St::Idle => self.reserved.is_some_and(|(_, until)| now >= until),
            St::Draining(_) => false,
        }
    }

    /// When `Scheduler::tick` must next run (None: only on an event).
    pub fn next_deadline(&self) -> Option<u64> {
        let settling = self
            .settling
            .values()
            .map(|x| x.revoked_at + self.p.drain_timeout_ns)
            .min();
        let st = match self.st {
            St::Holding { deadline, .. } => {
                let look = self.claim_check().map(|(_, _, at)| at);
                Some(look.map_or(deadline, |at| at.min(deadline)))
            }
            St::Draining(Revoked { revoked_at, t, .. }) => {
                // Only when the hand-on would happen: a waiter eligible even on the
                // last refill (a refill only adds tokens), else the timer would spin.
                let waiters = self.others_waiting(t);
                let on = self.handoff_at().filter(|_| waiters);
                Some((revoked_at + self.p.drain_timeout_ns).min(on.unwrap_or(u64::MAX)))
            }
            St::Idle => self
                .tenants
                .values()
                .filter(|t| t.demand_since.is_some() && t.settings.policy == ComputePolicy::Cap)
                .map(|t| {
                    let need = self.min_slice() - t.bucket_ns;
                    let rate = f64::from(t.settings.share_pct) / 100.0;
                    t.bucket_at + (need.max(0.0) / rate).ceil() as u64
                })
                .chain(self.reserved.map(|(_, until)| until))
                .min(),
        };
        st.into_iter().chain(settling).min()
    }

    /// When `id`'s grant in force expires in its shims without word from the daemon
    /// (ADR 0036): its generation, and the holder's slice end plus
    /// [`Params::grant_expiry_margin_ns`](crate::arbiter::params::Params::grant_expiry_margin_ns) while another tenant waits for the GPU (its
    /// slice then ends in a revoke) or for a capped holder (its tokens end with its
    /// slice); [`ALONE_EXPIRY_MARGINS`] margins when nobody waits (the daemon renews a
    /// lone holder's slice at its end, and moves the expiry with it; a tenant that
    /// starts waiting meanwhile may not be read by a stalled daemon). None: `id` holds
    /// no grant, or expiry is off. The daemon writes it beside the tenant's grant word
    /// whenever a decision may have changed it.
    pub fn expiry(&self, id: TenantId) -> Option<(u32, u64)> {
        let margin = self.p.grant_expiry_margin_ns;
        let St::Holding {
            t: h,
            generation,
            deadline,
            ..
        } = self.st
        else {
            return None;
        };
        if margin == 0 {
            return None;
        }
        let generation = if id == h {
            generation
        } else {
            self.co.get(&id)?.generation
        };
        let capped = id == h
            && self
                .tenants
                .get(&id)
                .is_some_and(|t| t.settings.policy == ComputePolicy::Cap);
        let margin = if capped || self.others_waiting(id) {
            margin
        } else {
            margin.saturating_mul(ALONE_EXPIRY_MARGINS)
        };
        Some((generation, deadline.saturating_add(margin)))
    }

    /// Counts grant `generation` of `id`, which its shims yielded at its expiry
    /// ([`Scheduler::expiry`]): the daemon did not revoke or renew it in time. Each of
    /// the tenant's processes says so; the grant counts once.
    pub fn note_expired(&mut self, id: TenantId, generation: u32) {
        if let Some(t) = self.tenants.get_mut(&id)
            && t.last_expired != Some(generation)
        {
            t.last_expired = Some(generation);
            t.expired += 1;
        }
    }

    /// The holder's slice end (None: nobody holds).
    pub(super) fn deadline(&self) -> Option<u64> {
        match self.st {
            St::Holding { deadline, .. } => Some(deadline),
            _ => None,
        }
    }

    /// What a renewal charges holder `id` for the `held` ns of its slice, provisionally:
    /// the device time it is expected to have used, `held` × its fill (all of it when
    /// its fill is not measured yet). The grant's end settles it against the device time
    /// reported. It is the best estimate, not an upper bound, because the virtual clock
    /// follows the holder's virtual time at renewals and a waking tenant is placed behind
    /// that clock: charged the wall time of a long hold it half used, the holder carried
    /// the clock ahead of its own use, and the tenants co-held beside it, placed there
    /// each time they woke from a CPU throttle, lost the lead to its later refund (a 75 %
    /// tenant got 34 % of the device time, waiting for its 25 % neighbour to catch up).
    pub(super) fn renewal_charge(&self, id: TenantId, held: u64) -> u64 {
        let fill = self
            .tenants
            .get(&id)
            .and_then(TenantState::fill)
            .unwrap_or(1.0);
        (held as f64 * fill).round() as u64
    }

    pub(super) fn tick_into(
        &mut self,
        now: u64,
        unread: &BTreeSet<TenantId>,
        out: &mut Vec<Action>,
    ) {
        let timed_out: Vec<Revoked> = self
            .settling
            .values()
            .filter(|x| now >= x.revoked_at + self.p.drain_timeout_ns)
            .copied()
            .collect();
        for x in timed_out {
            let waiting = self
                .tenants
                .get(&x.t)
                .is_some_and(|t| t.demand_since.is_some());
            let mut more = self.release(x.t, x.generation, now, None, waiting, now);
            out.append(&mut more);
        }
        match self.st {
            St::Holding {
                t,
                generation,
                since,
                deadline,
                granted,
                provisional,
                claimed,
            } if now >= deadline => {
                self.refill(now);
                let others = self.others_waiting(t);
                let capped = self.tenants.get(&t).is_some_and(|x| {
                    x.settings.policy == ComputePolicy::Cap
                        && x.bucket_ns - now.saturating_sub(since) as f64 <= 0.0
                });
                let maybe_others = unread
                    .iter()
                    .any(|u| *u != t && self.tenants.contains_key(u));
                if others || capped {
                    self.revoke(now, out);
                } else if maybe_others {
                    // Read first, decide after.
                    self.st = St::Holding {
                        t,
                        generation,
                        since,
                        deadline: now + UNREAD_RECHECK_NS,
                        granted,
                        provisional,
                        claimed,
                    };
                } else {
                    // Alone and allowed: the slice goes on; what it held so far is
                    // charged now, provisionally (settled against the device time the
                    // tenant reports when the grant ends).
                    let est = self.renewal_charge(t, now - since);
                    self.charge(t, est, now);
                    let q = self.p.quantum_ns;
                    let min_slice = self.min_slice();
                    let slice = match self.tenants.get(&t) {
                        Some(x) if x.settings.policy == ComputePolicy::Cap => {
                            cap_slice(x, min_slice, q)
                        }
                        _ => q,
                    };
                    if let Some(x) = self.tenants.get(&t) {
                        self.vclock = self.vclock.max(x.vtime);
                    }
                    self.st = St::Holding {
                        t,
                        generation,
                        since: now,
                        deadline: now + slice,
                        granted,
                        provisional: provisional + est,
                        claimed,
                    };
                    // Nobody waits: co-holders go on while their uses (the stopped
                    // parts are the kernel's latest) still fit, and at least every
                    // [`CO_REFRESH_SLICES`] slices report, which refreshes their fills.
                    self.co_slices += 1;
                    if self.co_slices >= CO_REFRESH_SLICES || !self.co_still_fits() {
                        self.revoke_co(now, out);
                    }
                    self.co_grant(now, out);
                }
            }
            St::Draining(Revoked {
                t,
                generation,
                revoked_at,
                ..
            }) if now >= revoked_at + self.p.drain_timeout_ns => {
                let waiting = self
                    .tenants
                    .get(&t)
                    .is_some_and(|x| x.demand_since.is_some());
                let mut more = self.release(t, generation, now, None, waiting, now);
                out.append(&mut more);
            }
            St::Idle => {
                if let Some((r, until)) = self.reserved
                    && now >= until
                    && self.reserved_rechecks > 0
                    && unread.contains(&r)
                {
                    self.reserved_rechecks -= 1;
                    self.reserved = Some((r, now + UNREAD_RECHECK_NS));
                    return;
                }
                self.pick(now, out)
            }
            St::Draining(_) => self.hand_on_if_due(now, out),
            St::Holding { .. } => {}
        }
    }
}
