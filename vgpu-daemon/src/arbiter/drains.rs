//! Revokes and drains: a grant taken back, the GPU going on before a late report
//! (hand-on), and the report that settles what the grant is charged.

use super::TenantId;
use super::params::{CLAIM_MIN_STOPPED, RESERVATION_RECHECKS, THROTTLED_HAND_ON_MARGIN_NS};
use super::rules::{
    averaged, co_fits, handoff_delay, next_look_after, queued_work_is_short, slice_charge,
};
use super::stride::{Action, Revoked, Scheduler, St};
use super::tenant::{TenantState, shared_busy};

impl Scheduler {
    /// Ends holder `id`'s slice `generation` now, as at its end, whoever waits: one of
    /// the tenant's processes yielded the grant and asks again. A process that yielded a
    /// grant does not launch under it any more, and the tenant keeps it while another
    /// of its processes holds on: with nobody else waiting, it was renewed for as long
    /// as that process launched, and the one that yielded waited all that time. Revoked,
    /// the others drain, and the tenant, still asking, is granted again (at once if it
    /// is the best waiter; ADR 0037). A co-holder's grant ends alone: the holder and
    /// the other co-holders go on, and the tenant is co-granted again after its drain if
    /// it still fits.
    pub fn end_slice(&mut self, id: TenantId, generation: u32, now: u64) -> Vec<Action> {
        let mut out = Vec::new();
        if matches!(self.st, St::Holding { t, generation: g, .. } if t == id && g == generation) {
            self.revoke(now, &mut out);
        } else if self.co.get(&id).is_some_and(|c| c.generation == generation) {
            self.revoke_co_one(id, now, &mut out);
        }
        out
    }

    #[cfg(test)]
    /// A revoked holder the GPU went on from, still to report its drain: (tenant,
    /// generation); the first by tenant if there are several.
    pub fn settling(&self) -> Option<(TenantId, u32)> {
        self.handed_on().map(|x| (x.t, x.generation))
    }

    #[cfg(test)]
    /// A revoked holder the GPU went on from (not a co-holder), if any.
    pub(super) fn handed_on(&self) -> Option<&Revoked> {
        self.settling.values().find(|x| !x.co)
    }

    /// When the GPU may go on from the draining holder without its report (None: not
    /// before its report or the drain timeout).
    pub(super) fn handoff_at(&self) -> Option<u64> {
        let St::Draining(Revoked { t, revoked_at, .. }) = self.st else {
            return None;
        };
        let t = self.tenants.get(&t)?;
        let cost = t.launch_cost_ns?;
        handoff_delay(&self.p, cost, t.queue_ns)
            .or_else(|| self.throttled_handoff_delay(t, cost))
            .map(|d| revoked_at + d)
    }

    /// When the GPU goes on from a revoked holder whose container its CPU limit
    /// throttles (at least [`CLAIM_MIN_STOPPED`] of the time), with hand-on off: its
    /// report comes when its container runs again, up to most of a CFS period later,
    /// while its queued work is over once the queue-ahead bound (or three of its
    /// launches) has run (ADR 0030). None: looks at claims are off, or its launches are
    /// long (three beyond a quantum: going on after them too was tried, and tenants of
    /// 5 ms kernels got less of what they were owed, 0.40–0.44 against 0.50–0.61).
    pub(super) fn throttled_handoff_delay(&self, t: &TenantState, cost: u64) -> Option<u64> {
        (self.p.claim_timeout_ns > 0
            && t.stopped >= CLAIM_MIN_STOPPED
            && queued_work_is_short(&self.p, cost))
        .then(|| t.queue_ns.max(cost * 3) + THROTTLED_HAND_ON_MARGIN_NS)
    }

    /// Hands the GPU on from a draining holder whose queued work must be over (its
    /// report late: its gate thread starved of CPU, its container throttled) to the
    /// waiting tenant that goes next. The holder is charged when it reports.
    pub(super) fn hand_on_if_due(&mut self, now: u64, out: &mut Vec<Action>) {
        let Some(at) = self.handoff_at() else {
            return;
        };
        let St::Draining(r) = self.st else {
            return;
        };
        self.refill(now);
        if now < at || !self.others_waiting(r.t) {
            return;
        }
        self.settling.insert(r.t, r);
        self.st = St::Idle;
        self.pick(now, out);
    }

    /// The tenant's processes report the grant `generation` over: work drained at `end_ns`
    /// (0: unknown, taken as `now`), having occupied the GPU `busy_ns` (None: not
    /// measured; see [`slice_charge`]). `waiting`: launches are still blocked.
    pub fn release(
        &mut self,
        id: TenantId,
        generation: u32,
        end_ns: u64,
        busy_ns: Option<u64>,
        waiting: bool,
        now: u64,
    ) -> Vec<Action> {
        let mut out = Vec::new();
        // `revoked`: when the daemon took the grant back (None: the tenant yields it);
        // `deadline`: the end of the slice it yields.
        let this = |r: &Revoked| r.t == id && r.generation == generation;
        let settled = self.settling.get(&id).filter(|r| this(r)).copied();
        let co_held = self
            .co
            .get(&id)
            .filter(|c| c.generation == generation)
            .copied();
        let revoked = match self.st {
            St::Draining(r) if this(&r) => Some(r),
            _ => settled,
        };
        let unclaimed = revoked.is_some_and(|r| r.unclaimed);
        let (since, granted, provisional, revoked, deadline) = match self.st {
            St::Holding {
                t,
                generation: g,
                since,
                granted,
                provisional,
                deadline,
                ..
            } if t == id && g == generation => (since, granted, provisional, None, deadline),
            // The draining holder, the holder the GPU went on from, or a revoked
            // co-holder; or a co-holder that yields (its slice is the holder's).
            _ => match (revoked, co_held) {
                (Some(r), _) => (r.since, r.granted, r.provisional, Some(r.revoked_at), now),
                (None, Some(c)) => (c.since, c.since, 0, None, self.deadline().unwrap_or(now)),
                (None, None) => return out,
            },
        };
        // Only past a report of one of its grants (a stale one changes nothing).
        let busy_ns = self
            .tenants
            .get_mut(&id)
            .map_or(busy_ns, |t| shared_busy(t, busy_ns, self.p.queue_ahead_ns));
        // A report read before the revoke it answers (a caller's clock read before the
        // revoke was decided) counts as read at the revoke.
        let now = now.max(since).max(revoked.unwrap_or(since));
        // The tenant may launch until the daemon takes the grant back: a drain cannot
        // end before the revoke, whatever the report says (a shim reporting its drain
        // at the grant was charged nothing before).
        let end = if end_ns == 0 {
            now
        } else {
            end_ns.clamp(since.max(revoked.unwrap_or(since)), now)
        };
        let pct = self.p.min_charge_pct;
        match busy_ns {
            // The busy time covers the whole grant: what renewals charged as wall time
            // is settled against it. The floor is a part of what the tenant held while
            // another tenant waited for the GPU (holding it idle costs nobody else
            // anything otherwise): up to its drain's end, or to the revoke if that was
            // later; a yield, which the daemon alone ends, up to the daemon reading it,
            // but not past the slice's end (a yield read late by a starved daemon would
            // otherwise be overcharged by its lateness). Not up to a drain's report as
            // a starved daemon read it late: that floor, tried, made the starved-daemon
            // test fail 3 runs in 8 instead of 1.
            Some(_) => {
                let held = match revoked {
                    // Nobody launched under it: it held the GPU up to the revoke only.
                    Some(at) if unclaimed => end.min(at),
                    Some(_) => end,
                    None => now.min(deadline).max(end),
                };
                let contended = held - self.contended_from(id, granted).min(held);
                let total = slice_charge(end - granted, contended, busy_ns, pct);
                if total >= provisional {
                    self.charge(id, total - provisional, end);
                } else {
                    // Only the current grant's own settlement: a settled one's
                    // placements were the next grant's.
                    let own = co_held.is_none() && settled.is_none();
                    let floor = if own { self.placed_max } else { None };
                    self.refund(id, provisional - total, floor);
                }
            }
            // Not measured: the whole grant counts as busy, the renewals' estimate
            // included.
            None => {
                let renewed = since.saturating_sub(granted).saturating_sub(provisional);
                let (end, held) = match revoked {
                    Some(at) if unclaimed => (end.min(at), end.min(at)),
                    _ => (end, now),
                };
                let charged = slice_charge(end - since, held - since, None, pct);
                self.charge(id, charged + renewed, end);
            }
        }
        // The GPU waited for this report (not a co-holder's, nor one it went on from).
        let waited = matches!(self.st, St::Draining(r) if this(&r));
        if let Some(t) = self.tenants.get_mut(&id) {
            if !unclaimed {
                t.note_fill(busy_ns, end - granted);
                t.withdrawn_in_row = 0;
                if waited {
                    t.report_lag_ns = averaged(t.report_lag_ns, now.saturating_sub(end) as f64);
                }
            }
            // A grant withdrawn at a look: how soon its report came says whether the
            // tenant was stopped or only slow to launch.
            if let Some(r) = settled
                && t.withdrawn_at.take() == Some(r.revoked_at)
            {
                t.look_after_ns = next_look_after(
                    t.look_after_ns,
                    now.saturating_sub(r.revoked_at),
                    self.p.claim_timeout_ns,
                    self.p.quantum_ns,
                );
            }
        }
        if settled.is_some() {
            self.settling.remove(&id);
        } else if co_held.is_some() {
            self.co.remove(&id);
        } else {
            self.revoke_co(now, &mut out);
            self.st = St::Idle;
        }
        // What it is owed if it stops asking now: how far its virtual time is behind
        // the clock, or behind the least advanced other tenant waiting if that is more.
        let waiters_min = self
            .tenants
            .iter()
            .filter(|(k, o)| **k != id && o.demand_since.is_some())
            .map(|(_, o)| o.vtime)
            .fold(f64::INFINITY, f64::min);
        let reference = if waiters_min.is_finite() {
            self.vclock.max(waiters_min)
        } else {
            self.vclock
        };
        if let Some(t) = self.tenants.get_mut(&id) {
            t.demand_since = waiting.then_some(now);
            t.idle_since = now;
            t.idle_lag = (reference - t.vtime).max(0.0);
        }
        if let Some(r) = settled {
            // The GPU went on meanwhile: nothing to keep free. The slice it went on with
            // was lent: a tenant that comes back owed time (still asking, and it would be
            // chosen before the holder) takes it back now rather than at the slice's end,
            // or a throttled tenant would spend its short runs waiting for the borrower.
            // A co-holder lent nothing: it may hold beside the holder again.
            if waiting && !r.co {
                self.reclaim_for(id, now, &mut out);
            }
            self.pick(now, &mut out);
            self.co_grant(now, &mut out);
            return out;
        }
        if co_held.is_some() {
            self.co_grant(now, &mut out);
            return out;
        }
        self.reserved = None;
        if !waiting && self.p.regrant_grace_ns > 0 && self.owed(id, now) {
            self.reserved = Some((id, now + self.p.regrant_grace_ns));
            self.reserved_rechecks = RESERVATION_RECHECKS;
        }
        self.pick(now, &mut out);
        out
    }

    pub(super) fn revoke(&mut self, now: u64, out: &mut Vec<Action>) {
        if let St::Holding {
            t,
            generation,
            since,
            granted,
            provisional,
            ..
        } = self.st
        {
            let go_on = self.goes_on_at_revoke(t);
            let r = Revoked {
                t,
                generation,
                since,
                revoked_at: now,
                granted,
                provisional,
                co: go_on,
                unclaimed: false,
            };
            out.push(Action::Revoke {
                tenant: t,
                generation,
            });
            self.revoke_co(now, out);
            if go_on {
                // A holder that could hold beside others is not waited for: settled like
                // a co-holder, when its report comes (its markers may time the next
                // holder's first kernels).
                if let Some(x) = self.tenants.get_mut(&t) {
                    x.shared = true;
                }
                self.settling.insert(t, r);
                self.st = St::Idle;
                self.pick(now, out);
            } else {
                self.st = St::Draining(r);
            }
        }
    }

    /// Whether the GPU goes on from holder `id` at its revoke, without waiting for its
    /// drain report (which it sends only when its container runs again, up to most of a
    /// CFS period later, the GPU idle meanwhile): a tenant co-holding would grant beside
    /// a holder (`burst`, its container throttled at least [`CO_HOLD_MIN_STOPPED`](crate::arbiter::params::CO_HOLD_MIN_STOPPED) of
    /// the time, a measured expected use within the bound) whose queued work is short:
    /// three of its launches within a quantum, as for hand-on ([`handoff_delay`]). Its
    /// queued work then overlaps the next holder's first milliseconds at most, and its
    /// report, which counts what ran between its markers, is not swollen by the next
    /// holder's work (5 ms kernels going on so were charged 4-5× their device time).
    pub(super) fn goes_on_at_revoke(&self, id: TenantId) -> bool {
        let bound = self.p.co_hold_fill_pct;
        self.tenants.get(&id).is_some_and(|t| {
            t.launch_cost_ns
                .is_some_and(|c| queued_work_is_short(&self.p, c))
                && self.co_use(t).is_some_and(|f| co_fits(&[], f, bound))
        })
    }
}
