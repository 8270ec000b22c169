//! One GPU's grant protocol as one pure state machine: [`Arbiter::on`] takes an
//! [`Event`] and the time (`now`, CLOCK_MONOTONIC ns) and returns the [`Effect`]s the
//! daemon carries out (store a grant word, write an expiry, read a claim, wake the timer).
//! No I/O, no clock, no threads: everything the daemon learns comes in as an event, every
//! decision goes out as an effect, and the tests drive it with an explicit clock.
//! (Not the cluster's placement of pods on nodes: that is `vgpu_core::packing`.)
//!
//! What a share means, how a grant moves and what is measured: `docs/scheduler.md`.
//!
//! - [`params`]: the tunables and the constants the rules are built on.
//! - [`rules`]: the arithmetic (charges, slice and queue lengths, hand-on delays, which
//!   tenants fit together), pure functions of numbers.
//! - [`tenant`]: what the scheduler knows of one tenant, and what it shows of it.
//! - `stride`: the scheduler's state (who holds, who drains, who is co-held) and its
//!   entry points; its rules by concern: `choice` (who goes next: stride scheduling over
//!   measured device time), `drains` (revokes, hand-on, the report that settles a grant),
//!   `co_holding`, `claims`, `timer` (slices' ends, drain timeouts, expiries).
//! - `reports`: a drain as the tenant's processes report it, one report per process,
//!   summed for the scheduler once all have reported.
//!
//! State is kept once: the grants in force and the revoked grants still to report are the
//! scheduler's; the arbiter adds only the per-process reports of drains under way (and a
//! tick waiting for the claim it asked to read).

use std::collections::{BTreeMap, BTreeSet, HashSet};

use vgpu_core::sched_proto::ComputeSettings;

mod choice;
mod claims;
mod co_holding;
mod drains;
pub mod params;
mod reports;
pub mod rules;
mod stride;
pub mod tenant;
mod timer;

pub use params::{
    ALONE_EXPIRY_MARGINS, CLAIM_MIN_STOPPED, CO_HOLD_FILL_PCT_MEASURED, CO_HOLD_MIN_STOPPED,
    CO_REFRESH_SLICES, DEFAULT_CLAIM_TIMEOUT_NS, DEFAULT_CO_HOLD_FILL_PCT,
    DEFAULT_GRANT_EXPIRY_MARGIN_NS, DEFAULT_MAX_QUEUE_AHEAD_NS, DEFAULT_MAX_SLICE_QUANTA,
    MAX_DEMAND_AGE_NS, MAX_WITHDRAWN_IN_ROW, PREEMPTIBLE_QUEUE_AHEAD_NS, Params, QUEUE_PER_LAG,
    RESERVATION_RECHECKS, SLICE_PER_LAG, UNREAD_RECHECK_NS, demand_time,
};
use reports::Reports;
pub use rules::{
    co_fits, deepened_queue, handoff_delay, next_look_after, slice_charge, stretched_slice,
};
use stride::{Action, Scheduler};
pub use tenant::TenantStats;

/// A tenant on this GPU (assigned by the daemon).
pub type TenantId = u64;

/// What the daemon learned about one GPU's tenants.
#[derive(Debug, Clone, PartialEq)]
pub enum Event<'a> {
    /// A process of `tenant` registered the GPU with these settings (the tenant is
    /// added, idle, if new; its settings are not changed if not).
    Registered {
        /// Tenant.
        tenant: TenantId,
        /// Its settings on this GPU.
        settings: ComputeSettings,
    },
    /// Process `conn` of `tenant` has launches blocked since `since_ns` (its shim's
    /// clock when the launcher blocked; None: an older shim, read now).
    Demand {
        /// Tenant.
        tenant: TenantId,
        /// The process's connection.
        conn: u64,
        /// When the launcher blocked ([`demand_time`]).
        since_ns: Option<u64>,
    },
    /// Process `conn` of `tenant` reports grant `generation` drained after a revoke, or
    /// yielded (`waiting` false); `procs`: the tenant's processes on this GPU (a yield
    /// waits for each of them).
    DrainReport {
        /// Tenant.
        tenant: TenantId,
        /// The process's connection.
        conn: u64,
        /// The grant.
        generation: u32,
        /// When its work drained (0: not said).
        end_ns: u64,
        /// Device time its work occupied (None: not measured).
        busy_ns: Option<u64>,
        /// Kernels it launched under the grant.
        launches: u64,
        /// Launches are still blocked.
        waiting: bool,
        /// The tenant's processes on this GPU.
        procs: &'a HashSet<u64>,
    },
    /// Process `conn` of `tenant` closed its connection; `last`: no process of the
    /// tenant is left on this GPU (the tenant leaves it).
    ConnectionClosed {
        /// Tenant.
        tenant: TenantId,
        /// The process's connection.
        conn: u64,
        /// The tenant's last process.
        last: bool,
    },
    /// The claim beside `tenant`'s grant word, read for [`Effect::LookAtClaim`]:
    /// whether it names grant `generation`.
    ClaimSeen {
        /// Tenant.
        tenant: TenantId,
        /// The grant looked at.
        generation: u32,
        /// Some process launched under it.
        claimed: bool,
    },
    /// [`Effect::Revoke`] carried out: the revocation stored, then the claim read
    /// (`claimed_at`: when the first launch under the grant was claimed, 0 if not said;
    /// None: no process launched under it), the revoke sent to `procs`, the tenant's
    /// processes on this GPU (each reports its drain).
    RevokeStored {
        /// Tenant.
        tenant: TenantId,
        /// The grant revoked.
        generation: u32,
        /// The claim read after the store.
        claimed_at: Option<u64>,
        /// The processes the revoke went to.
        procs: HashSet<u64>,
    },
    /// `tenant`'s shims yielded grant `generation` at its expiry (ADR 0036).
    Expired {
        /// Tenant.
        tenant: TenantId,
        /// The grant.
        generation: u32,
    },
    /// `tenant`'s container is stopped by its CPU limit this part of the time (0..=1),
    /// by a group of CFS period `period_ns`.
    Stopped {
        /// Tenant.
        tenant: TenantId,
        /// Part of the time stopped.
        stopped: f64,
        /// The group's CFS period, ns.
        period_ns: Option<u64>,
    },
    /// Time passes; `unread`: tenants with input the daemon has not read yet (looked at
    /// only when [`Arbiter::absence_due`]).
    Tick {
        /// Tenants that may have asked already.
        unread: &'a BTreeSet<TenantId>,
    },
    /// An operator changed `tenant`'s settings on this GPU.
    SettingsChanged {
        /// Tenant.
        tenant: TenantId,
        /// The new settings.
        settings: ComputeSettings,
    },
}

/// What the daemon carries out for one GPU, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Effect {
    /// Store `tenant`'s grant word held under `generation`, then send the grant to its
    /// processes, naming the queue-ahead bound (ns; 0: unbounded).
    Grant {
        /// Tenant.
        tenant: TenantId,
        /// The grant.
        generation: u32,
        /// Its queue-ahead bound, ns.
        queue_ahead_ns: u64,
    },
    /// Store `tenant`'s grant word not held (`generation`), read the claim beside it,
    /// send the revoke to its processes, and answer with [`Event::RevokeStored`] (no
    /// answer when the tenant has no word: it is leaving).
    Revoke {
        /// Tenant.
        tenant: TenantId,
        /// The grant.
        generation: u32,
    },
    /// Store `tenant`'s grant word not held: its processes yielded grant `generation`
    /// and none may launch under it any more (no message).
    Release {
        /// Tenant.
        tenant: TenantId,
        /// The grant.
        generation: u32,
    },
    /// Write beside `tenant`'s word that grant `generation` expires at `at` (0: never).
    Expiry {
        /// Tenant.
        tenant: TenantId,
        /// The grant.
        generation: u32,
        /// CLOCK_MONOTONIC ns; 0: it does not.
        at: u64,
    },
    /// Read the claim beside `tenant`'s word and answer with [`Event::ClaimSeen`]
    /// (claimed when the tenant has no word).
    LookAtClaim {
        /// Tenant.
        tenant: TenantId,
        /// The grant.
        generation: u32,
    },
    /// Tick again at this time at the latest (None: only on an event).
    WakeAt(Option<u64>),
}

/// One GPU's arbiter.
#[derive(Debug)]
pub struct Arbiter {
    sched: Scheduler,
    /// Drains being reported, by tenant: a revoked holder's or co-holder's (also one the
    /// GPU went on from), or a yield some of the tenant's processes reported.
    reports: BTreeMap<TenantId, Reports>,
    /// A tick put off until the claim it asked for is read ([`Effect::LookAtClaim`]),
    /// with its unread tenants.
    tick_after_claim: Option<BTreeSet<TenantId>>,
}

impl Arbiter {
    /// An arbiter with no tenants.
    pub fn new(p: Params) -> Arbiter {
        Arbiter {
            sched: Scheduler::new(p),
            reports: BTreeMap::new(),
            tick_after_claim: None,
        }
    }

    /// Handles `event` at `now`: the effects to carry out, in order, ending with the
    /// grants' expiries and [`Effect::WakeAt`].
    pub fn on(&mut self, event: Event<'_>, now: u64) -> Vec<Effect> {
        let mut out = Vec::new();
        match event {
            Event::Registered { tenant, settings } => self.sched.add(tenant, settings, now),
            Event::Demand {
                tenant,
                conn,
                since_ns,
            } => self.demand(tenant, conn, since_ns, now, &mut out),
            Event::DrainReport {
                tenant,
                conn,
                generation,
                end_ns,
                busy_ns,
                launches,
                waiting,
                procs,
            } => {
                let r = match self.reports.get_mut(&tenant) {
                    Some(r) if r.generation == generation => r,
                    Some(_) => return out,
                    // A yield of the grant in force: every process of the tenant reports it.
                    None if self.sched.grant_of(tenant) == Some(generation) => self
                        .reports
                        .entry(tenant)
                        .or_insert_with(|| Reports::new(tenant, generation, procs.clone())),
                    None => return out,
                };
                r.report(conn, end_ns, busy_ns, launches, waiting);
                let acts = self.finish_drain(tenant, now);
                if !self.reports.contains_key(&tenant) {
                    // Released (a yield leaves the word held): no process of the tenant
                    // may launch under this generation any more, including one
                    // registering later.
                    out.push(Effect::Release { tenant, generation });
                }
                self.effects(acts, &mut out);
            }
            Event::ConnectionClosed { tenant, conn, last } => {
                let acts = if last {
                    self.reports.remove(&tenant);
                    self.sched.remove(tenant, now)
                } else if let Some(r) = self.reports.get_mut(&tenant) {
                    r.closed(conn, now);
                    self.finish_drain(tenant, now)
                } else {
                    Vec::new()
                };
                self.effects(acts, &mut out);
            }
            Event::ClaimSeen {
                tenant,
                generation,
                claimed,
            } => {
                if claimed {
                    self.sched.claimed(tenant, generation);
                } else {
                    let acts = self.sched.withdraw(tenant, generation, now);
                    self.effects(acts, &mut out);
                }
                if let Some(unread) = self.tick_after_claim.take() {
                    let acts = self.sched.tick_unread(now, &unread);
                    self.effects(acts, &mut out);
                }
            }
            Event::RevokeStored {
                tenant,
                generation,
                claimed_at,
                procs,
            } => self.revoke_stored(tenant, generation, claimed_at, procs, now, &mut out),
            Event::Expired { tenant, generation } => self.sched.note_expired(tenant, generation),
            Event::Stopped {
                tenant,
                stopped,
                period_ns,
            } => self.sched.note_stopped(tenant, stopped, period_ns),
            Event::Tick { unread } => {
                // A holder's claim is looked at before the tick decides (ADR 0030).
                if let Some((tenant, generation)) = self.sched.claim_due(now) {
                    self.tick_after_claim = Some(unread.clone());
                    out.push(Effect::LookAtClaim { tenant, generation });
                    return out;
                }
                let acts = self.sched.tick_unread(now, unread);
                self.effects(acts, &mut out);
            }
            Event::SettingsChanged { tenant, settings } => {
                let acts = self.sched.set_settings(tenant, settings, now);
                self.effects(acts, &mut out);
            }
        }
        self.expiries(&mut out);
        out.push(Effect::WakeAt(self.sched.next_deadline()));
        out
    }

    /// A demand of process `conn`.
    fn demand(
        &mut self,
        tenant: TenantId,
        conn: u64,
        since_ns: Option<u64>,
        now: u64,
        out: &mut Vec<Effect>,
    ) {
        let asked = demand_time(since_ns, now);
        let mut acts = Vec::new();
        // A process that yielded its tenant's grant wants it back: if every process of
        // the tenant has yielded (the slice is being released), the tenant asks again. The
        // same for a holder the GPU went on from: a report that says nothing is blocked
        // may come after this demand.
        if let Some(r) = self.reports.get_mut(&tenant) {
            r.waiting = true;
            // This process yielded the grant in force and asks again while others of
            // its tenant hold on (a partial yield): it may not launch under that grant
            // any more, so the slice ends now and the tenant is granted again.
            if self.sched.grant_of(tenant) == Some(r.generation) && !r.pending.contains(&conn) {
                acts.extend(self.sched.end_slice(tenant, r.generation, now));
            }
        }
        acts.extend(self.sched.demand_asked(tenant, asked, now));
        self.effects(acts, out);
    }

    /// A revocation stored and its claim read.
    fn revoke_stored(
        &mut self,
        tenant: TenantId,
        generation: u32,
        claimed_at: Option<u64>,
        procs: HashSet<u64>,
        now: u64,
        out: &mut Vec<Effect>,
    ) {
        if let Some(at) = claimed_at {
            self.sched.claimed_at(tenant, generation, at, now);
        }
        // Some of the tenant's processes may have yielded this grant already (a partial
        // yield): their reports stand, and they will not report it again (their shims
        // drained it), so the drain waits only for the others. A new drain in its place
        // waited for the drain timeout.
        if self
            .reports
            .get(&tenant)
            .is_none_or(|r| r.generation != generation)
        {
            self.reports
                .insert(tenant, Reports::new(tenant, generation, procs));
        }
        // No process to drain: the GPU is free now.
        let mut acts = self.finish_drain(tenant, now);
        // Nothing launched: the GPU goes on without waiting for the report.
        if claimed_at.is_none() {
            acts.extend(self.sched.unclaimed(tenant, generation, now));
        }
        self.effects(acts, out);
    }

    /// Hands tenant `tenant`'s drain to the scheduler once every process of it has
    /// reported.
    fn finish_drain(&mut self, tenant: TenantId, now: u64) -> Vec<Action> {
        if self.reports.get(&tenant).is_none_or(|r| !r.complete()) {
            return Vec::new();
        }
        let Some(r) = self.reports.remove(&tenant) else {
            return Vec::new();
        };
        self.sched.note_launches(r.tenant, r.busy, r.launches);
        self.sched.release(
            r.tenant,
            r.generation,
            r.end_or(now),
            r.busy,
            r.waiting,
            now,
        )
    }

    /// The scheduler's decisions as effects.
    fn effects(&self, acts: Vec<Action>, out: &mut Vec<Effect>) {
        out.extend(acts.into_iter().map(|a| match a {
            Action::Grant { tenant, generation } => Effect::Grant {
                tenant,
                generation,
                // Every grant names its bound (ADR 0032), since the shims take the
                // `Welcome`'s as the deepest.
                queue_ahead_ns: self.sched.queue_ahead_ns(tenant).unwrap_or(0),
            },
            Action::Revoke { tenant, generation } => Effect::Revoke { tenant, generation },
        }));
    }

    /// The expiries of the grants in force (ADR 0036): a new waiter, a renewal or a new
    /// grant may have moved them. Only held words: an expiry beside a word that is not
    /// held, or that names another generation, is not read.
    fn expiries(&self, out: &mut Vec<Effect>) {
        for (tenant, generation) in self.sched.granted() {
            let (generation, at) = self.sched.expiry(tenant).unwrap_or((generation, 0));
            out.push(Effect::Expiry {
                tenant,
                generation,
                at,
            });
        }
    }

    /// Whether a tick at `now` would decide on a tenant's absence, so that unread input
    /// matters ([`Event::Tick`]).
    pub fn absence_due(&self, now: u64) -> bool {
        self.sched.absence_due(now)
    }

    /// The tenant holding (or draining) the GPU.
    pub fn holder(&self) -> Option<TenantId> {
        self.sched.holder()
    }

    /// GPU time charged to all tenants, ns.
    pub fn scheduled_ns(&self) -> u64 {
        self.sched.scheduled_ns()
    }

    /// A tenant's counters at `now`.
    pub fn stats(&self, tenant: TenantId, now: u64) -> Option<TenantStats> {
        self.sched.stats(tenant, now)
    }
}

#[cfg(test)]
mod tests;
