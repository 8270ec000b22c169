//! Hand-on: the GPU goes on from a holder too starved to report its drain.

use super::MS;
use super::shares::{burst, s};
use crate::arbiter::params::Params;
use crate::arbiter::rules::handoff_delay;
use crate::arbiter::stride::{Action, Scheduler};
use crate::model::SliceState;
use vgpu_core::sched_proto::{ComputePolicy, Priority};

/// The defaults with hand-on (the daemon's `--hand-on-margin-ms 1`, a 2 ms
/// queue-ahead bound).
pub(super) fn hand_on() -> Params {
    Params {
        handoff_queue_ns: 2 * MS,
        ..Params::default()
    }
}

/// Tenants 1 and 2 at 50/50, both asking; tenant 1 holds (generation 1) and has
/// measured `cost` ns of device time per launch.
pub(super) fn frozen_holder(cost: Option<u64>) -> Scheduler {
    let mut sched = Scheduler::new(hand_on());
    sched.add(1, burst(50), 0);
    sched.add(2, burst(50), 0);
    if let Some(c) = cost {
        sched.note_launches(1, Some(c * 100), 100);
    }
    sched.demand(1, 0);
    sched.demand(2, 0);
    assert_eq!(
        sched.tick(10 * MS),
        vec![Action::Revoke {
            tenant: 1,
            generation: 1
        }]
    );
    sched
}

#[test]
fn the_gpu_goes_on_from_a_holder_too_starved_to_report_its_drain() {
    // Its work (at most the 2 ms queue-ahead bound) is over on the GPU 2 ms after
    // the revoke whatever its CPU does; 1 ms margin.
    let mut sched = frozen_holder(Some(10_000));
    let at = 10 * MS + 3 * MS;
    assert_eq!(sched.next_deadline(), Some(at));
    assert!(sched.tick(at - 1).is_empty(), "not before its work is over");
    assert_eq!(
        sched.tick(at),
        vec![Action::Grant {
            tenant: 2,
            generation: 2
        }]
    );
    assert_eq!(sched.settling(), Some((1, 1)));
    assert_eq!(
        sched.stats(1, at).map(|s| s.state),
        Some(SliceState::Draining)
    );
    // It asks again before it reports: not granted, even when 2's slice ends.
    assert!(sched.demand(1, at + MS).is_empty());
    assert_eq!(
        sched.tick(at + 10 * MS),
        Vec::new(),
        "2 keeps the GPU: the only other waiter has not reported"
    );
    // Its report, 60 ms late (a throttled container), charges its slice as measured.
    let used_before = sched.stats(1, at).expect("known").used_ns;
    let late = 10 * MS + 60 * MS;
    // Still asking and owed (2 has run 57 ms since): it takes the lent slice back.
    assert_eq!(
        sched.release(1, 1, 10 * MS + MS, Some(9 * MS), true, late),
        vec![Action::Revoke {
            tenant: 2,
            generation: 2
        }]
    );
    assert_eq!(sched.settling(), None);
    let used = sched.stats(1, late).expect("known").used_ns - used_before;
    assert_eq!(
        used,
        9 * MS,
        "charged what it measured, not the wait for its report"
    );
    // 2 drains, having run its slice; 1 goes next.
    assert_eq!(
        sched.release(2, 2, late + MS, Some(57 * MS), true, late + MS),
        vec![Action::Grant {
            tenant: 1,
            generation: 3
        }]
    );
}

#[test]
fn without_a_measured_launch_cost_or_with_long_kernels_the_gpu_waits_for_the_report() {
    for cost in [None, Some(4 * MS)] {
        let mut sched = frozen_holder(cost);
        let t = sched.next_deadline().expect("drain deadline");
        assert_eq!(t, 10 * MS + Params::default().drain_timeout_ns, "{cost:?}");
        assert!(sched.tick(10 * MS + 50 * MS).is_empty(), "{cost:?}");
    }
    // Off: the same with a measured cost.
    assert_eq!(
        handoff_delay(&Params::default(), 10_000, 2 * MS),
        None,
        "off by default"
    );
    // Kernels of 2 ms: three of them may be queued.
    assert_eq!(
        handoff_delay(&hand_on(), 2 * MS, Params::default().queue_ahead_ns),
        Some(6 * MS + Params::default().handoff_margin_ns)
    );
}

#[test]
fn a_holder_the_gpu_went_on_from_that_never_reports_is_charged_at_the_drain_timeout() {
    let mut sched = frozen_holder(Some(10_000));
    sched.tick(13 * MS);
    assert_eq!(sched.settling(), Some((1, 1)));
    sched.demand(1, 14 * MS);
    // 2 renews its slices (1 cannot be granted); at the timeout 1 is settled.
    let timeout = 10 * MS + Params::default().drain_timeout_ns;
    let mut now = 13 * MS;
    while now < timeout {
        now = sched.next_deadline().expect("a deadline").min(timeout);
        sched.tick(now);
    }
    assert_eq!(sched.settling(), None);
    let used = sched.stats(1, now).expect("known").used_ns;
    assert!(
        used >= 10 * MS,
        "charged its whole slice, unmeasured: {used}"
    );
    // And it can hold again: 2's current slice ends with 1 waiting.
    let acts = sched.tick(sched.next_deadline().expect("2 holds"));
    assert!(
        matches!(acts.as_slice(), [Action::Revoke { tenant: 2, .. }]),
        "{acts:?}"
    );
}

#[test]
fn nobody_waiting_means_no_hand_on_and_a_later_demand_triggers_it() {
    // A capped tenant alone is revoked when its tokens run out, nobody waiting.
    let mut sched = Scheduler::new(hand_on());
    sched.add(1, s(50, ComputePolicy::Cap, Priority::BestEffort), 0);
    sched.add(2, burst(50), 0);
    sched.note_launches(1, Some(MS), 100);
    sched.demand(1, 0);
    let end = sched.next_deadline().expect("its slice");
    let acts = sched.tick(end);
    assert!(
        matches!(acts.as_slice(), [Action::Revoke { tenant: 1, .. }]),
        "{acts:?}"
    );
    assert_eq!(
        sched.next_deadline(),
        Some(end + Params::default().drain_timeout_ns),
        "no waiter: no hand-on deadline for the timer"
    );
    assert!(sched.tick(end + 5 * MS).is_empty());
    // A tenant asking after the hand-on time gets the GPU at once.
    let acts = sched.demand(2, end + 6 * MS);
    assert!(
        matches!(acts.as_slice(), [Action::Grant { tenant: 2, .. }]),
        "{acts:?}"
    );
    assert_eq!(sched.settling(), Some((1, 1)));
}
