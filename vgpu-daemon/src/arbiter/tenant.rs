//! What the scheduler knows of one tenant on the GPU (`TenantState`: its virtual time,
//! token bucket, measured fill and launch cost, how throttled its container is, how late
//! it starts and reports), and what it shows of it ([`TenantStats`]).

use std::collections::VecDeque;

use vgpu_core::sched_proto::{ComputePolicy, ComputeSettings};

use super::params::{CLAIM_MIN_STOPPED, FILL_DECAY, MIN_COST_SAMPLE_NS, Params};
use super::rules::{deepened_queue, preemptible_queue, stretched_slice};
use crate::model::SliceState;

/// Counters of one tenant.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TenantStats {
    /// Settings in force.
    pub settings: ComputeSettings,
    /// GPU time charged, ns.
    pub used_ns: u64,
    /// Time spent waiting with launches blocked, ns.
    pub throttled_ns: u64,
    /// Grants received.
    pub grants: u64,
    /// Charged time over the last window, percent of the window.
    pub recent_share_pct: f64,
    /// Current state.
    pub state: SliceState,
    /// Holding beside the holder (co-holding).
    pub co_held: bool,
    /// Its fill, 0..=1 (None: not measured).
    pub fill: Option<f64>,
    /// The part of the time its container is stopped by its CPU limit, 0..=1.
    pub stopped: f64,
    /// Grants revoked before any of its processes launched under them (ADR 0030).
    pub unclaimed: u64,
    /// Grants its shims yielded at their expiry, not revoked or renewed in time by the
    /// daemon (ADR 0036).
    pub expired: u64,
    /// How long its next slice lasts, ns: a quantum, longer for a tenant slow to start
    /// and to report ([`stretched_slice`]; a capped tenant's slice is its tokens').
    pub slice_ns: u64,
    /// The queue-ahead bound its next exclusive grant names, ns: the shims' bound, more
    /// for a tenant slow to start and to report ([`deepened_queue`]; ADR 0032).
    pub queue_ahead_ns: u64,
}

#[derive(Debug)]
pub(super) struct TenantState {
    pub(super) settings: ComputeSettings,
    pub(super) vtime: f64,
    pub(super) demand_since: Option<u64>,
    pub(super) bucket_ns: f64,
    pub(super) bucket_at: u64,
    pub(super) used_ns: u64,
    pub(super) throttled_ns: u64,
    pub(super) grants: u64,
    pub(super) recent: VecDeque<(u64, u64)>,
    /// When it last stopped demanding.
    pub(super) idle_since: u64,
    /// Its lag then (virtual clock minus its virtual time, at least 0): time it was owed
    /// for having waited, which a sleep does not forfeit.
    pub(super) idle_lag: f64,
    /// Device time per launch its processes last reported (busy / launches of a slice),
    /// ns; None until a slice that launched was measured.
    pub(super) launch_cost_ns: Option<u64>,
    /// Its current or last grant ran beside another tenant's (co-holding): its
    /// processes' markers then also timed the other contexts' kernels
    /// (`Scheduler::note_launches`).
    pub(super) shared: bool,
    /// The launches its processes reported with the drain now being settled (None: not
    /// reported).
    pub(super) reported_launches: Option<u64>,
    /// Device time of launches its shared grants counted that their measures did not
    /// cover yet (work queued at a grant's end runs in the next one), ns
    /// ([`shared_busy`]).
    pub(super) shared_carry_ns: u64,
    /// Device time and launches measured in its grants it did not share, each grant
    /// weighing [`FILL_DECAY`] of the one after it: their ratio is the device time per
    /// launch its shared grants are charged at ([`TenantState::unshared_cost`]).
    pub(super) unshared_busy: f64,
    pub(super) unshared_launches: f64,
    /// Device time and time held of its past grants, each grant weighing
    /// [`FILL_DECAY`] of the one after it; their ratio is its fill (None: never held).
    pub(super) fill_busy: f64,
    pub(super) fill_held: f64,
    /// The part of the time its container is stopped by its CPU limit, 0..=1 (the
    /// kernel's throttling statistics, `Scheduler::note_stopped`), and the CFS period
    /// of the group that stops it (a stop is at most that long), ns.
    pub(super) stopped: f64,
    pub(super) period_ns: Option<u64>,
    /// Grants revoked before any of its processes launched under them.
    pub(super) unclaimed: u64,
    pub(super) expired: u64,
    /// The last grant counted in `expired`.
    pub(super) last_expired: Option<u32>,
    /// How long after a grant its claim is looked at ([`next_look_after`](crate::arbiter::rules::next_look_after)), ns; and when
    /// its last grant was withdrawn at a look.
    pub(super) look_after_ns: u64,
    pub(super) withdrawn_at: Option<u64>,
    /// Its grants withdrawn at looks since one was claimed ([`MAX_WITHDRAWN_IN_ROW`](crate::arbiter::params::MAX_WITHDRAWN_IN_ROW)).
    pub(super) withdrawn_in_row: u32,
    /// How long after its work completed its drain reports reached the daemon, when the
    /// GPU waited for them, each measure weighing [`LAG_DECAY`](crate::arbiter::params::LAG_DECAY) of the one after it, ns
    /// ([`stretched_slice`]).
    pub(super) report_lag_ns: f64,
    /// How long after its grants its first launch under them came (the claim's time,
    /// ADR 0030), weighted as `report_lag_ns`, ns.
    pub(super) wake_ns: f64,
    /// The queue-ahead bound of its current or last grant ([`deepened_queue`]), ns.
    pub(super) queue_ns: u64,
}

impl TenantState {
    /// How much of the time it holds the GPU its work keeps the GPU busy, 0..=1 (None:
    /// not measured yet).
    pub(super) fn fill(&self) -> Option<f64> {
        (self.fill_held > 0.0).then(|| (self.fill_busy / self.fill_held).min(1.0))
    }

    /// How much of the GPU it would keep busy holding it all the time, its shims'
    /// queue-ahead bound being `queue_ahead_ns` (None: fill not measured yet): its fill
    /// for the part of the time its container runs, plus what its queued work runs on
    /// for in each stop. That is at most the queue-ahead bound, or two of its launches
    /// (the bound always lets two through), and at most the stop; a stop lasts at most
    /// the rest of a CFS period. Kernels long beside the period (a 100 ms kernel in a
    /// 100 ms period) keep the GPU busy through the stops: no discount then. Nor when
    /// its device time per launch or the period is not known. The queued work is not
    /// measured (a co-held tenant's device time counts the other contexts' kernels run
    /// between its markers): it is bounded.
    pub(super) fn expected_use(&self, queue_ahead_ns: u64) -> Option<f64> {
        let fill = self.fill()?;
        let run_on = match (self.period_ns, self.launch_cost_ns) {
            (Some(period), Some(cost)) if period > 0 => {
                let queued = queue_ahead_ns.max(cost.saturating_mul(2));
                (queued as f64 / period as f64).min(self.stopped)
            }
            _ => self.stopped,
        };
        Some((fill * (1.0 - self.stopped) + run_on).min(1.0))
    }

    /// The device time per launch its grants it did not share measured, ns, once they
    /// measured at least [`MIN_COST_SAMPLE_NS`] (None before: a first grant's measure
    /// can miss most of its launches; one read 0.3 µs per 10 µs kernel).
    pub(super) fn unshared_cost(&self) -> Option<u64> {
        (self.unshared_busy >= MIN_COST_SAMPLE_NS as f64 && self.unshared_launches > 0.0)
            .then(|| (self.unshared_busy / self.unshared_launches).round() as u64)
    }

    /// What a hand-over to and from it costs the GPU, ns: its launcher's start after a
    /// grant and its report's lag after its work ([`stretched_slice`]).
    pub(super) fn hand_over_ns(&self) -> u64 {
        (self.wake_ns + self.report_lag_ns) as u64
    }

    /// How long its container runs in one CFS period, ns, when its CPU limit throttles
    /// it at least [`CLAIM_MIN_STOPPED`] of the time (0 when the period is not known);
    /// None when it is not throttled.
    pub(super) fn runs_for_ns(&self) -> Option<u64> {
        (self.stopped >= CLAIM_MIN_STOPPED).then(|| {
            self.period_ns.map_or(0, |p| {
                (p as f64 * (1.0 - self.stopped).max(0.0)).round() as u64
            })
        })
    }

    /// Adds a grant's measure: `busy` ns of device time over `held` ns (`busy` None:
    /// not measured, counted as full).
    pub(super) fn note_fill(&mut self, busy: Option<u64>, held: u64) {
        let held = held.max(1) as f64;
        let busy = busy.map_or(held, |b| (b as f64).min(held));
        self.fill_busy = self.fill_busy * FILL_DECAY + busy;
        self.fill_held = self.fill_held * FILL_DECAY + held;
    }
}

/// The device time tenant `t`'s processes ran in the grant now settled (what it is
/// charged, and its fill), from what they measured (`busy_ns`). For a grant it shared
/// with another tenant's (co-holding, or the GPU going on from it at its revoke): at most
/// its launches at the device time per launch measured in grants it did not share, plus
/// what earlier shared grants' launches were owed and their measures did not cover (work
/// queued at a grant's end runs in the next: a grant of no launches measures its
/// predecessor's). What stays owed is carried to the next shared grant, at most the run-on
/// a queue allows (`queue_ahead_ns`, or two launches); an unshared grant's measure covers
/// it. Markers time the other contexts' kernels run between them too (the GPU
/// time-slices between contexts), which charged co-held tenants of 5 ms kernels 1.8–3.6×
/// their device time (`sched-bench --only load-stopped`). Takes the launches its
/// processes reported with the drain.
pub(super) fn shared_busy(
    t: &mut TenantState,
    busy_ns: Option<u64>,
    queue_ahead_ns: u64,
) -> Option<u64> {
    let launches = t.reported_launches.take();
    match (busy_ns, launches, t.unshared_cost()) {
        (Some(b), Some(n), Some(c)) if t.shared => {
            let owed = n.saturating_mul(c).saturating_add(t.shared_carry_ns);
            let ran = b.min(owed);
            t.shared_carry_ns = (owed - ran).min(queue_ahead_ns.max(c.saturating_mul(2)));
            Some(ran)
        }
        _ => {
            t.shared_carry_ns = 0;
            busy_ns
        }
    }
}

/// The queue-ahead bound a grant of `slice_ns` gives tenant `t`: a capped tenant's is
/// the shims' ([`Params::queue_ahead_ns`]: its tokens end its slice), any other's deepened by its
/// hand-overs ([`deepened_queue`]).
/// A best-effort tenant granted beside latency-sensitive ones (`preemptible`) gets
/// [`PREEMPTIBLE_QUEUE_AHEAD_NS`](crate::arbiter::params::PREEMPTIBLE_QUEUE_AHEAD_NS) instead, or the shims' bound if that is shorter, so that
/// a preemption drains quickly.
pub(super) fn queue_of(p: &Params, t: &TenantState, slice_ns: u64, preemptible: bool) -> u64 {
    if preemptible {
        preemptible_queue(p)
    } else if t.settings.policy == ComputePolicy::Cap {
        p.queue_ahead_ns
    } else {
        deepened_queue(
            p.queue_ahead_ns,
            p.max_queue_ahead_ns,
            t.hand_over_ns(),
            slice_ns,
        )
    }
}

/// The slice a grant gives tenant `t`: a capped tenant's tokens' ([`cap_slice`]),
/// any other's a quantum stretched by its hand-overs ([`stretched_slice`]).
pub(super) fn slice_of(p: &Params, t: &TenantState, min_slice: f64) -> u64 {
    if t.settings.policy == ComputePolicy::Cap {
        cap_slice(t, min_slice, p.quantum_ns)
    } else {
        stretched_slice(
            p.quantum_ns,
            t.hand_over_ns(),
            p.max_slice_quanta,
            t.runs_for_ns(),
        )
    }
}

/// A capped tenant's slice: its tokens last `bucket / (1 − rate)` while it runs, since
/// they keep accruing at `rate` meanwhile (at most a quantum).
pub(super) fn cap_slice(t: &TenantState, min_slice: f64, q: u64) -> u64 {
    let rate = f64::from(t.settings.share_pct.min(100)) / 100.0;
    let tokens = t.bucket_ns.max(min_slice);
    if rate >= 1.0 {
        return q;
    }
    ((tokens / (1.0 - rate)) as u64).min(q)
}
