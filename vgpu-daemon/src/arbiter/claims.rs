//! Claims (ADR 0030): whether a holder's processes launched under its grant, looked at
//! while another tenant waits; a grant nobody claimed is withdrawn and the GPU goes on.

use super::TenantId;
use super::params::{CLAIM_MIN_STOPPED, MAX_WITHDRAWN_IN_ROW};
use super::rules::averaged;
use super::stride::{Action, Revoked, Scheduler, St};

impl Scheduler {
    /// The holder whose claim the daemon should look at now (ADR 0030): (tenant,
    /// generation). Only while another tenant waits, [`Params::claim_timeout_ns`](crate::arbiter::params::Params::claim_timeout_ns) after
    /// the grant, for a holder not seen to claim it whose container is throttled at
    /// least [`CLAIM_MIN_STOPPED`] of the time, whose launches were measured shorter
    /// than a quantum (one launch under a grant keeps the GPU busy past the slice
    /// otherwise: a look gains the others at most the slice, and costs the holder its
    /// turn), and which has not lost [`MAX_WITHDRAWN_IN_ROW`] grants in a row at looks.
    /// The daemon answers with
    /// [`Scheduler::claimed`] or [`Scheduler::withdraw`].
    pub fn claim_due(&self, now: u64) -> Option<(TenantId, u32)> {
        let (t, generation, at) = self.claim_check()?;
        (now >= at).then_some((t, generation))
    }

    /// The holder whose claim is to be looked at, and when (see [`Scheduler::claim_due`]).
    pub(super) fn claim_check(&self) -> Option<(TenantId, u32, u64)> {
        let St::Holding {
            t,
            generation,
            granted,
            claimed: false,
            ..
        } = self.st
        else {
            return None;
        };
        let x = self.tenants.get(&t)?;
        let after = x.look_after_ns;
        (self.p.claim_timeout_ns > 0
            && after < self.p.quantum_ns
            && x.stopped >= CLAIM_MIN_STOPPED
            && x.launch_cost_ns.is_some_and(|c| c < self.p.quantum_ns)
            && x.withdrawn_in_row < MAX_WITHDRAWN_IN_ROW
            && self.others_waiting(t))
        .then_some((t, generation, granted + after))
    }

    /// A process of holder `id` claimed grant `generation`: no more looks at it.
    pub fn claimed(&mut self, id: TenantId, generation: u32) {
        if let St::Holding {
            t,
            generation: g,
            ref mut claimed,
            ..
        } = self.st
            && t == id
            && g == generation
        {
            *claimed = true;
        }
    }

    /// The first launch under grant `generation` of tenant `id` was claimed at `at_ns`
    /// (CLOCK_MONOTONIC, the tenant's own figure: taken within the grant and `now`; 0,
    /// an older shim: nothing learned). How long its launcher took to start is part of
    /// what its slices must amortize ([`stretched_slice`](crate::arbiter::rules::stretched_slice)).
    pub fn claimed_at(&mut self, id: TenantId, generation: u32, at_ns: u64, now: u64) {
        if at_ns == 0 {
            return;
        }
        let granted = match self.st {
            St::Holding {
                t,
                generation: g,
                granted,
                ..
            } if t == id && g == generation => Some(granted),
            St::Draining(r) if r.t == id && r.generation == generation => Some(r.granted),
            _ => self
                .settling
                .get(&id)
                .filter(|r| r.generation == generation)
                .map(|r| r.granted)
                .or_else(|| {
                    self.co
                        .get(&id)
                        .filter(|c| c.generation == generation)
                        .map(|c| c.since)
                }),
        };
        let Some(granted) = granted else {
            return;
        };
        let wake = at_ns.clamp(granted, now.max(granted)) - granted;
        if let Some(t) = self.tenants.get_mut(&id) {
            t.wake_ns = averaged(t.wake_ns, wake as f64);
        }
    }

    /// Holder `id` had not claimed grant `generation` when the daemon looked: the grant
    /// is revoked. The daemon stores the revocation and then reads the claim again:
    /// still unclaimed, it says so ([`Scheduler::unclaimed`]) and the GPU goes on; a
    /// claim that came meanwhile means a launch did, and the drain is waited for.
    pub fn withdraw(&mut self, id: TenantId, generation: u32, now: u64) -> Vec<Action> {
        let mut out = Vec::new();
        if let St::Holding {
            t, generation: g, ..
        } = self.st
            && t == id
            && g == generation
        {
            if let Some(x) = self.tenants.get_mut(&id) {
                x.withdrawn_at = Some(now);
                x.withdrawn_in_row += 1;
            }
            self.revoke(now, &mut out);
        }
        out
    }

    /// No process of `id` launched under grant `generation`, revoked (its claim, read
    /// after the revocation was stored, names another grant): nothing of it can be on
    /// the GPU, which goes on now. The tenant is settling: not granted again before its
    /// drain report (a container stopped by its CPU limit reports when it runs), charged
    /// then up to the revoke only; a report still asking takes a lent slice back, as
    /// after a hand-on.
    pub fn unclaimed(&mut self, id: TenantId, generation: u32, now: u64) -> Vec<Action> {
        let mut out = Vec::new();
        match self.st {
            St::Draining(r) if r.t == id && r.generation == generation => {
                if let Some(t) = self.tenants.get_mut(&id) {
                    t.unclaimed += 1;
                }
                // A holder the GPU went on from (lent, as after a hand-on).
                self.settling.insert(
                    id,
                    Revoked {
                        unclaimed: true,
                        ..r
                    },
                );
                self.st = St::Idle;
                self.pick(now, &mut out);
            }
            _ => {
                if let Some(r) = self
                    .settling
                    .get_mut(&id)
                    .filter(|r| r.generation == generation && !r.unclaimed)
                {
                    r.unclaimed = true;
                    if let Some(t) = self.tenants.get_mut(&id) {
                        t.unclaimed += 1;
                    }
                }
            }
        }
        out
    }
}
