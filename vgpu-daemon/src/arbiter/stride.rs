//! One GPU's scheduler, who may launch kernels and for how long: the arbiter's core
//! (the arbiter turns its [`Action`]s into effects and feeds it the tenants' reports).
//! Its methods are kept by concern: `choice` (who goes next), `drains` (revokes, hand-on,
//! charging at the report), `co_holding`, `claims`, `timer` (slices' ends, expiries).
//! Pure: every input carries the time (`now`, CLOCK_MONOTONIC ns), every decision is
//! returned as [`Action`]s, so the algorithm is unit-tested without threads or clocks.
//!
//! The GPU runs one tenant at a time (time-slicing, as the hardware does between
//! contexts), except that tenants which together leave it mostly idle hold it at once
//! (*co-holding*, [`Params::co_hold_fill_pct`], ADR 0029: co-holders are granted beside
//! the holder and revoked with it). A tenant *holds* the GPU under a numbered grant;
//! when the grant is revoked, its processes stop launching, wait for their queued work
//! to finish and report when it did (*drained*). The scheduler charges the tenant the device time its
//! work occupied during the slice, as its processes measured it (`busy_ns` of their
//! reports), overrun included; never more than the time from the grant to the drain,
//! never less than [`Params::min_charge_pct`] of it ([`slice_charge`](crate::arbiter::rules::slice_charge)). A process that
//! does not measure is charged the whole slice. (Charging grant → drain alone charged
//! a tenant whose launcher was starved of CPU for the GPU idling in its slice: its share
//! of device time fell below its configured one by that idle, issue 16, ADR 0024.)
//!
//! Choice (stride scheduling over measured time):
//! - each tenant has a virtual time `vtime`, advanced by `charged_ns * 100 / share`;
//!   among waiting tenants the smallest `vtime` goes next, so over any window the
//!   charged times are proportional to the shares, and an overrun (a slice that
//!   drained late) is a deficit repaid by waiting longer next round;
//! - a tenant that wakes up is brought forward to at most one slice of credit before
//!   the current virtual clock (no banking of idle time, but waking tenants go first),
//!   or to the lag it had when it stopped asking if that is more (time it was owed for
//!   having waited is not forfeited by a short absence);
//! - latency-sensitive tenants go before best-effort ones, and a waking
//!   latency-sensitive tenant revokes a best-effort holder at once, as long as it is not
//!   more than two of its own slices ahead of the best-effort tenants (so priority
//!   orders work but does not erase shares);
//! - `burst` (work-conserving): a holder alone keeps the GPU, slice after slice;
//! - a slice is one quantum, longer for a tenant slow to start under its grants and to
//!   report its drains (its threads waiting for a CPU): [`stretched_slice`](crate::arbiter::rules::stretched_slice), ADR 0031;
//! - `cap`: a token bucket filled at `share`% of wall time (at most one quantum deep):
//!   the tenant is eligible only with at least a quarter quantum of tokens and its slice
//!   ends when they run out, so it never exceeds its share even on an idle GPU;
//! - a holder that releases the GPU with nothing blocked (`waiting` false: its launcher
//!   was between launches when the drain was reported, which a loaded CPU makes common)
//!   while it is still owed time (its `vtime` is the smallest among eligible tenants) is
//!   given [`Params::regrant_grace_ns`] to ask again before the GPU goes to someone else.
//!   Without it, the owed time is only collectable when the demand happens to be present
//!   at a decision, and a 80/20 split degrades towards 50/50 (issue 16).

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use vgpu_core::sched_proto::ComputeSettings;

use super::TenantId;
use super::params::{FILL_DECAY, Params};
use super::rules::wake_lag;
use super::tenant::{TenantState, TenantStats, queue_of, slice_of};
use crate::model::SliceState;

/// A decision for the arbiter to carry out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Action {
    /// Give the GPU to `tenant` under generation `generation`.
    Grant {
        /// Tenant.
        tenant: TenantId,
        /// Generation.
        generation: u32,
    },
    /// Take it back: the tenant must drain and report.
    Revoke {
        /// Tenant.
        tenant: TenantId,
        /// Generation.
        generation: u32,
    },
}

/// A revoked grant whose drain is still to be reported: the draining holder's, or that of
/// a holder the GPU went on from before it reported (charged when its report comes, or at
/// the drain timeout, and not granted again before).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Revoked {
    pub(super) t: TenantId,
    pub(super) generation: u32,
    pub(super) since: u64,
    pub(super) revoked_at: u64,
    /// The grant's time and what was charged since at renewals
    /// ([`Scheduler::renewal_charge`]).
    pub(super) granted: u64,
    pub(super) provisional: u64,
    /// A co-holder's grant ([`Params::co_hold_fill_pct`]): nothing was lent to it, so
    /// its report does not take the GPU back from the holder.
    pub(super) co: bool,
    /// No process launched under it (its claim did not name it after the revoke; ADR
    /// 0030): it held the GPU up to the revoke only, and says nothing of its fill.
    pub(super) unclaimed: bool,
}

/// A grant beside the holder's (co-holding).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct CoGrant {
    pub(super) generation: u32,
    pub(super) since: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum St {
    Idle,
    Holding {
        t: TenantId,
        generation: u32,
        since: u64,
        deadline: u64,
        /// The grant's time and what was charged since at renewals
        /// ([`Scheduler::renewal_charge`]).
        granted: u64,
        provisional: u64,
        /// The daemon saw a process of the holder claim the grant (ADR 0030).
        claimed: bool,
    },
    Draining(Revoked),
}

/// One GPU's scheduler.
#[derive(Debug)]
pub(crate) struct Scheduler {
    pub(super) p: Params,
    pub(super) tenants: BTreeMap<TenantId, TenantState>,
    pub(super) st: St,
    pub(super) generation: u32,
    pub(super) vclock: f64,
    pub(super) scheduled_ns: u64,
    /// The GPU is kept free for this tenant until this time (it released while owed).
    pub(super) reserved: Option<(TenantId, u64)>,
    /// How many more times a reservation may be extended while its tenant has unread
    /// input.
    pub(super) reserved_rechecks: u32,
    /// Revoked grants whose drain report is still to come while the GPU went on: a
    /// holder the GPU went on from (at most one), co-holders (one per tenant).
    pub(super) settling: BTreeMap<TenantId, Revoked>,
    /// Tenants granted the GPU beside the holder (only while `st` is `Holding`).
    pub(super) co: BTreeMap<TenantId, CoGrant>,
    /// The holder's renewals since the co-holders were last revoked.
    pub(super) co_slices: u32,
    /// The highest virtual time a waking tenant was placed at (the clock, less its lag)
    /// during the current holder's grant: the holder's refund at the grant's end does
    /// not take it below that ([`Scheduler::release`]). None: nobody was placed.
    pub(super) placed_max: Option<f64>,
}

impl Scheduler {
    /// An empty scheduler.
    pub fn new(p: Params) -> Scheduler {
        Scheduler {
            p,
            tenants: BTreeMap::new(),
            st: St::Idle,
            generation: 0,
            vclock: 0.0,
            scheduled_ns: 0,
            reserved: None,
            reserved_rechecks: 0,
            settling: BTreeMap::new(),
            co: BTreeMap::new(),
            co_slices: 0,
            placed_max: None,
        }
    }

    /// Adds a tenant (no-op if present). It starts idle, at the current virtual clock.
    pub fn add(&mut self, id: TenantId, settings: ComputeSettings, now: u64) {
        let q = self.p.quantum_ns as f64;
        let vclock = self.vclock;
        self.tenants.entry(id).or_insert(TenantState {
            settings,
            vtime: vclock,
            demand_since: None,
            bucket_ns: q,
            bucket_at: now,
            used_ns: 0,
            throttled_ns: 0,
            grants: 0,
            recent: VecDeque::new(),
            idle_since: 0,
            idle_lag: 0.0,
            launch_cost_ns: None,
            shared: false,
            reported_launches: None,
            shared_carry_ns: 0,
            unshared_busy: 0.0,
            unshared_launches: 0.0,
            fill_busy: 0.0,
            fill_held: 0.0,
            stopped: 0.0,
            period_ns: None,
            unclaimed: 0,
            expired: 0,
            last_expired: None,
            look_after_ns: self.p.claim_timeout_ns,
            withdrawn_at: None,
            withdrawn_in_row: 0,
            report_lag_ns: 0.0,
            wake_ns: 0.0,
            queue_ns: self.p.queue_ahead_ns,
        });
    }

    /// Removes a tenant (its last process left). If it held the GPU, the GPU is free
    /// from `now` (charged up to now).
    pub fn remove(&mut self, id: TenantId, now: u64) -> Vec<Action> {
        let mut out = Vec::new();
        match self.st {
            St::Holding { t, since, .. } | St::Draining(Revoked { t, since, .. }) if t == id => {
                self.charge(id, now.saturating_sub(since), now);
                self.revoke_co(now, &mut out);
                self.st = St::Idle;
            }
            _ => {}
        }
        if let Some(c) = self.co.remove(&id) {
            self.charge(id, now.saturating_sub(c.since), now);
        }
        if let Some(x) = self.settling.remove(&id) {
            self.charge(id, x.revoked_at.saturating_sub(x.since), x.revoked_at);
        }
        self.tenants.remove(&id);
        if self.reserved.is_some_and(|(r, _)| r == id) {
            self.reserved = None;
        }
        self.pick(now, &mut out);
        out
    }

    #[cfg(test)]
    /// Whether the tenant is known.
    pub fn contains(&self, id: TenantId) -> bool {
        self.tenants.contains_key(&id)
    }

    /// Changes a tenant's settings live (takes effect at the next decision; a holder
    /// whose new settings make it ineligible or lower-priority than a waiter is revoked;
    /// a change to a co-holder or to the holder ends co-holding, which is decided again
    /// on the new settings).
    pub fn set_settings(&mut self, id: TenantId, s: ComputeSettings, now: u64) -> Vec<Action> {
        let mut out = Vec::new();
        if let Some(t) = self.tenants.get_mut(&id) {
            t.settings = s;
            let cap = self.p.quantum_ns as f64;
            t.bucket_ns = t.bucket_ns.min(cap);
        }
        if self.co.contains_key(&id) || (!self.co.is_empty() && self.holder() == Some(id)) {
            self.revoke_co(now, &mut out);
        }
        self.preempt_if_needed(now, &mut out);
        self.tick_into(now, &BTreeSet::new(), &mut out);
        out
    }

    #[cfg(test)]
    /// A process of `id` has launches blocked (read now).
    pub fn demand(&mut self, id: TenantId, now: u64) -> Vec<Action> {
        self.demand_asked(id, now, now)
    }

    /// A process of `id` has launches blocked since `asked` ([`demand_time`](crate::arbiter::params::demand_time)), read at
    /// `now`: whether the tenant slept (and is brought forward) is judged at `asked`,
    /// so a demand a starved daemon read late keeps the time the tenant is owed. Its
    /// wait counts from `now` (what it costs a holder).
    pub fn demand_asked(&mut self, id: TenantId, asked: u64, now: u64) -> Vec<Action> {
        let mut out = Vec::new();
        let q = self.p.quantum_ns as f64;
        let holding = self.holder() == Some(id) || self.co.contains_key(&id);
        let vclock = self.vclock;
        let Some(t) = self.tenants.get_mut(&id) else {
            return out;
        };
        let mut placed = None;
        if t.demand_since.is_none() && !holding {
            // Only a tenant that really slept (longer than a quantum) is brought forward:
            // one that merely paused between batches keeps its lag (or its lead).
            if asked.saturating_sub(t.idle_since) > self.p.quantum_ns {
                let credit = q * 100.0 / f64::from(t.settings.share_pct.max(1));
                let at = vclock - wake_lag(credit, t.idle_lag);
                if at > t.vtime {
                    t.vtime = at;
                    placed = Some(at);
                }
            }
            t.demand_since = Some(now);
        }
        if let Some(at) = placed
            && !matches!(self.st, St::Idle)
        {
            self.placed_max = Some(self.placed_max.map_or(at, |m| m.max(at)));
        }
        if matches!(self.st, St::Idle) {
            self.pick(now, &mut out);
        } else {
            self.preempt_if_needed(now, &mut out);
            self.hand_on_if_due(now, &mut out);
            self.co_grant(now, &mut out);
        }
        out
    }

    /// What a slice of `id`'s processes measured: `busy_ns` of device time for
    /// `launches` kernels (the daemon passes it with their drain reports). Sets the
    /// tenant's device time per launch, which bounds how long its queued work can take
    /// after a revoke ([`handoff_delay`](crate::arbiter::rules::handoff_delay)).
    pub fn note_launches(&mut self, id: TenantId, busy_ns: Option<u64>, launches: u64) {
        let Some(t) = self.tenants.get_mut(&id) else {
            return;
        };
        t.reported_launches = Some(launches);
        if let Some(busy) = busy_ns
            && launches > 0
        {
            t.launch_cost_ns = Some(busy / launches);
            if !t.shared {
                t.unshared_busy = t.unshared_busy * FILL_DECAY + busy as f64;
                t.unshared_launches = t.unshared_launches * FILL_DECAY + launches as f64;
            }
        }
    }

    /// The queue-ahead bound of tenant `id`'s current or last grant, ns (None: no such
    /// tenant): what the daemon tells its shims with the grant ([`deepened_queue`](crate::arbiter::rules::deepened_queue)).
    pub fn queue_ahead_ns(&self, id: TenantId) -> Option<u64> {
        self.tenants.get(&id).map(|t| t.queue_ns)
    }

    /// The part of the time tenant `id`'s container is stopped by its CPU limit, as the
    /// kernel counts it (0..=1; clamped), and the CFS period of the group that stops
    /// it, ns (None: not known).
    pub fn note_stopped(&mut self, id: TenantId, stopped: f64, period_ns: Option<u64>) {
        if let Some(t) = self.tenants.get_mut(&id) {
            t.stopped = if stopped.is_finite() {
                stopped.clamp(0.0, 1.0)
            } else {
                0.0
            };
            t.period_ns = period_ns.filter(|p| *p > 0);
        }
    }

    #[cfg(test)]
    /// A tenant's fill: device time over time held, of its recent grants (None: not
    /// measured yet).
    pub fn fill(&self, id: TenantId) -> Option<f64> {
        self.tenants.get(&id)?.fill()
    }

    /// The generation of `id`'s grant in force (held, not revoked): the holder's or a
    /// co-holder's.
    pub fn grant_of(&self, id: TenantId) -> Option<u32> {
        match self.st {
            St::Holding { t, generation, .. } if t == id => Some(generation),
            _ => self.co.get(&id).map(|c| c.generation),
        }
    }

    /// The grants in force (held, not revoked): the holder's, then the co-holders'.
    pub fn granted(&self) -> Vec<(TenantId, u32)> {
        let holder = match self.st {
            St::Holding { t, generation, .. } => Some((t, generation)),
            _ => None,
        };
        holder.into_iter().chain(self.co_holders()).collect()
    }

    /// The tenant holding (or draining) the GPU.
    pub fn holder(&self) -> Option<TenantId> {
        match self.st {
            St::Holding { t, .. } | St::Draining(Revoked { t, .. }) => Some(t),
            St::Idle => None,
        }
    }

    /// GPU time charged to all tenants, ns.
    pub fn scheduled_ns(&self) -> u64 {
        self.scheduled_ns
    }

    /// A tenant's counters at `now`.
    pub fn stats(&self, id: TenantId, now: u64) -> Option<TenantStats> {
        let t = self.tenants.get(&id)?;
        let state = match self.st {
            St::Holding { t: h, .. } if h == id => SliceState::Holding,
            St::Draining(Revoked { t: h, .. }) if h == id => SliceState::Draining,
            _ if self.co.contains_key(&id) => SliceState::Holding,
            _ if self.settling.contains_key(&id) => SliceState::Draining,
            _ if t.demand_since.is_some() => SliceState::Waiting,
            _ => SliceState::Idle,
        };
        let from = now.saturating_sub(self.p.window_ns);
        let slice = slice_of(&self.p, t, self.min_slice());
        let recent: u64 = t
            .recent
            .iter()
            .filter(|(end, _)| *end >= from)
            .map(|(_, ns)| ns)
            .sum();
        let throttled = t.throttled_ns
            + match (state, t.demand_since) {
                (SliceState::Waiting, Some(s)) => now.saturating_sub(s),
                _ => 0,
            };
        Some(TenantStats {
            settings: t.settings,
            used_ns: t.used_ns,
            throttled_ns: throttled,
            grants: t.grants,
            recent_share_pct: recent as f64 * 100.0 / self.p.window_ns as f64,
            state,
            co_held: self.co.contains_key(&id),
            fill: t.fill(),
            stopped: t.stopped,
            unclaimed: t.unclaimed,
            expired: t.expired,
            slice_ns: slice,
            queue_ahead_ns: queue_of(&self.p, t, slice, self.preemptible(t)),
        })
    }
}
