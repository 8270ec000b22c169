//! The arithmetic of the grant protocol, as pure functions of numbers: what a slice is
//! charged, how long a slice and a queue are, when the GPU may go on without a report,
//! which tenants may hold the GPU together.

use super::params::{LAG_DECAY, PREEMPTIBLE_QUEUE_AHEAD_NS, Params, QUEUE_PER_LAG, SLICE_PER_LAG};

/// The next wait before a look at a tenant's claim (ADR 0030), its last grant having
/// been withdrawn at a look after `wait_ns` and its drain report having come `back_ns`
/// after that. Back within twice the wait, its container was running and its launcher
/// only slow to wake (CPU-starved, not throttled at that moment): the wait doubles, up
/// to a quantum (no look before the slice's end). Later, it was stopped: the wait
/// halves, down to `base_ns` (`--claim-timeout-ms`).
pub fn next_look_after(wait_ns: u64, back_ns: u64, base_ns: u64, quantum_ns: u64) -> u64 {
    if back_ns <= wait_ns.saturating_mul(2) {
        wait_ns.saturating_mul(2).min(quantum_ns)
    } else {
        (wait_ns / 2).max(base_ns)
    }
}

/// How long after revoking a holder whose processes measured `launch_cost_ns` of device
/// time per launch, under a grant whose queue-ahead bound was `queue_ns`, the GPU may go
/// on without their drain report: its queued work (the queue-ahead bound, or the two
/// launches the bound always allows, or three for a launch past the gate as the revoke
/// came) is over by then on the GPU, whatever the holder's CPU does. None (wait for the
/// report) when hand-on is off or the launches are as long as a slice.
pub fn handoff_delay(p: &Params, launch_cost_ns: u64, queue_ns: u64) -> Option<u64> {
    if p.handoff_queue_ns == 0 || !queued_work_is_short(p, launch_cost_ns) {
        return None;
    }
    Some(p.handoff_queue_ns.max(queue_ns).max(launch_cost_ns * 3) + p.handoff_margin_ns)
}

/// Whether the work a revoked holder may still have queued (up to three of its launches
/// of `launch_cost_ns`: the two the queue-ahead bound always lets through, and one past
/// the gate as the revoke came) is over within a quantum.
pub(super) fn queued_work_is_short(p: &Params, launch_cost_ns: u64) -> bool {
    launch_cost_ns.saturating_mul(3) <= p.quantum_ns
}

/// What a slice costs a tenant: the device time its processes measured (`busy_ns`) at
/// most the slice as they report it (`reported_ns`, grant → their drain end; all of it
/// when not measured), and at least `min_pct` percent of the time the tenant held the
/// grant, as the daemon knows it, while another tenant waited (`held_ns`: within grant →
/// the drain's end, never before the daemon's revoke; for a yield, grant → the daemon
/// reading it). The GPU idling in a slice because the tenant's launcher was starved of
/// CPU (or throttled) is then not charged as its share; what the tenant reports cannot
/// bring the charge under the floor, so the time a tenant can hold the GPU idle against
/// waiting neighbours, or lie about, stays bounded.
pub fn slice_charge(reported_ns: u64, held_ns: u64, busy_ns: Option<u64>, min_pct: u32) -> u64 {
    let floor = (u128::from(held_ns) * u128::from(min_pct.min(100)) / 100) as u64;
    busy_ns
        .map_or(reported_ns, |b| b.min(reported_ns))
        .max(floor)
}

/// The most a waking tenant may lag the virtual clock: one slice of credit (`credit`,
/// in its virtual time), or the lag it had when it stopped asking (`idle_lag`), if
/// larger. A sleep earns no credit, but it does not forfeit time the tenant was owed for
/// having waited while others ran over (a slice that a starved daemon ended late):
/// forfeiting it cost a 75 % tenant 3 ms of device time per 1 ms its 25 % neighbour
/// overran, and the 25 % tenant of `shares_hold_when_the_daemon_is_starved` got up to
/// 48 % (ADR 0024).
pub(super) fn wake_lag(credit: f64, idle_lag: f64) -> f64 {
    credit.max(idle_lag)
}

/// Whether a tenant of fill `fill` (0..=1) may hold the GPU beside tenants of fills
/// `holding`: together at most `bound_pct` percent (0: never). Fills are what each
/// tenant's work kept the GPU busy while it held it alone or beside others, so tenants
/// that together leave the GPU mostly idle run at once, and those that would fill it
/// take turns by their shares.
pub fn co_fits(holding: &[f64], fill: f64, bound_pct: u32) -> bool {
    bound_pct > 0 && (holding.iter().sum::<f64>() + fill) * 100.0 <= f64::from(bound_pct)
}

/// A decaying average `avg` after a new measure `v` ([`LAG_DECAY`]).
pub(super) fn averaged(avg: f64, v: f64) -> f64 {
    avg * LAG_DECAY + v * (1.0 - LAG_DECAY)
}

/// The slice of a holder whose hand-overs cost the GPU `hand_over_ns` (its launcher's
/// start after a grant plus its drain report's lag after its work: threads waiting for
/// a CPU): [`SLICE_PER_LAG`] times that, at least `quantum_ns`, at most `max_quanta`
/// quanta, and at most `runs_for_ns` (how long its container runs in one CFS period
/// when its CPU limit throttles it) unless that is under a quantum. A slice of one
/// quantum went mostly to those waits (ten 0.5-CPU tenants on two CPUs, starved but not
/// throttled: the GPU half idle); a launcher that waited for a CPU keeps it for a while
/// once it runs, while a throttled one is stopped again within its period, and a slice
/// past that would be held idle. Its charge is its device time, so a longer slice costs
/// the others time only where it holds the GPU idle, as any slice does (the floor,
/// [`Params::min_charge_pct`]).
pub fn stretched_slice(
    quantum_ns: u64,
    hand_over_ns: u64,
    max_quanta: u32,
    runs_for_ns: Option<u64>,
) -> u64 {
    let mut longest = quantum_ns.saturating_mul(u64::from(max_quanta.max(1)));
    if let Some(run) = runs_for_ns {
        longest = longest.min(run.max(quantum_ns));
    }
    hand_over_ns
        .saturating_mul(SLICE_PER_LAG)
        .clamp(quantum_ns, longest)
}

/// The queue-ahead bound of a holder whose hand-overs cost the GPU `hand_over_ns` and
/// whose slice is `slice_ns` ([`stretched_slice`]): [`QUEUE_PER_LAG`] times that cost,
/// at least `queue_ahead_ns`, at most `max_queue_ns` and half the slice (ADR 0032). A
/// launcher out of budget waits for its gate thread to see queued work complete and then
/// for a CPU of its own: a starved one, about a hand-over, while a 2 ms queue ran dry
/// (ten 0.5-CPU tenants on two CPUs: their 10 µs kernels kept the GPU busy a third of
/// the slices they held). Work queued at the revoke runs on, charged to the holder, for
/// at most the bound: a tenant prompt to start and to report keeps `queue_ahead_ns`.
/// `queue_ahead_ns` 0 (no bound) stays 0.
pub fn deepened_queue(
    queue_ahead_ns: u64,
    max_queue_ns: u64,
    hand_over_ns: u64,
    slice_ns: u64,
) -> u64 {
    if queue_ahead_ns == 0 {
        return 0;
    }
    let deepest = max_queue_ns.min(slice_ns / 2).max(queue_ahead_ns);
    hand_over_ns
        .saturating_mul(QUEUE_PER_LAG)
        .clamp(queue_ahead_ns, deepest)
}

/// [`PREEMPTIBLE_QUEUE_AHEAD_NS`], or the shims' bound where that is shorter.
pub(super) fn preemptible_queue(p: &Params) -> u64 {
    match p.queue_ahead_ns {
        0 => PREEMPTIBLE_QUEUE_AHEAD_NS,
        base => base.min(PREEMPTIBLE_QUEUE_AHEAD_NS),
    }
}
