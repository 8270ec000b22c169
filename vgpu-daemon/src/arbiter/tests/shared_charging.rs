//! What a grant shared with another tenant's is charged: its launches at their unshared
//! device time, once that was measured enough.

use super::MS;
use super::co_holding::{PERIOD, co_holding};
use super::shares::{burst, s};
use crate::arbiter::TenantId;
use crate::arbiter::stride::{Action, Scheduler};
use crate::model::SliceState;
use vgpu_core::sched_proto::{ComputePolicy, Priority};

/// Tenant `id` held one measured grant alone: `busy` of `held` ns busy.
pub(super) fn measured(sched: &mut Scheduler, id: TenantId, busy: u64, held: u64, now: u64) -> u64 {
    let acts = sched.demand(id, now);
    let Some(Action::Grant { generation, .. }) = acts.first().copied() else {
        panic!("tenant {id} not granted: {acts:?}");
    };
    // Kernels of 100 µs.
    sched.note_launches(id, Some(busy), (busy / (MS / 10)).max(1));
    sched.release(id, generation, now + held, Some(busy), false, now + held);
    now + held
}

#[test]
fn only_tenants_that_leave_the_gpu_mostly_idle_are_co_held() {
    let mut sched = Scheduler::new(co_holding());
    sched.add(1, burst(50), 0);
    sched.add(2, burst(30), 0);
    sched.add(3, burst(20), 0);
    sched.add(4, s(20, ComputePolicy::Cap, Priority::BestEffort), 0);
    sched.add(
        5,
        s(20, ComputePolicy::Burst, Priority::LatencySensitive),
        0,
    );
    sched.add(6, burst(20), 0);
    let mut now = 0;
    now = measured(&mut sched, 1, 9 * MS, 10 * MS, now);
    now = measured(&mut sched, 2, 3 * MS, 10 * MS, now);
    now = measured(&mut sched, 3, 10 * MS, 10 * MS, now);
    now = measured(&mut sched, 4, MS, 10 * MS, now);
    now = measured(&mut sched, 5, MS, 10 * MS, now);
    assert!((sched.fill(1).expect("measured") - 0.9).abs() < 1e-9);
    // Tenant 2 fills a third of its slices, but its container is not throttled
    // (starved of CPU by other processes, say): it takes turns.
    sched.add(7, burst(30), now);
    now = measured(&mut sched, 7, 3 * MS, 10 * MS, now);
    for id in 1..=7 {
        sched.note_stopped(id, if id == 7 { 0.0 } else { 0.6 }, PERIOD);
    }
    assert_eq!(sched.fill(6), None);
    now += 100 * MS;
    let acts = sched.demand(1, now);
    assert!(matches!(acts.as_slice(), [Action::Grant { tenant: 1, .. }]));
    // (90 % + 30 %) for the 40 % of the time they run: fits under 80 %.
    let acts = sched.demand(2, now);
    assert!(
        matches!(acts.as_slice(), [Action::Grant { tenant: 2, .. }]),
        "{acts:?}"
    );
    assert_eq!(sched.holder(), Some(1));
    assert_eq!(
        sched.stats(2, now).expect("known").state,
        SliceState::Holding
    );
    // 3 (+ 40 %: too much), capped, not measured yet, or not throttled: never beside
    // the holder.
    for id in [3, 4, 6, 7] {
        let acts = sched.demand(id, now);
        assert!(acts.is_empty(), "tenant {id}: {acts:?}");
        assert_eq!(
            sched.stats(id, now).expect("known").state,
            SliceState::Waiting
        );
    }
    assert_eq!(sched.co_holders().len(), 1);
    // A latency-sensitive tenant (10 % fill) takes the GPU from best-effort ones as
    // before, and holds it without them: at once, since the holder could hold beside
    // others (its container is stopped, its use is low), as its co-holder could.
    let acts = sched.demand(5, now + MS);
    assert_eq!(acts.len(), 3, "{acts:?}");
    assert!(
        matches!(acts[2], Action::Grant { tenant: 5, .. }),
        "{acts:?}"
    );
    for a in &acts[..2] {
        let Action::Revoke { tenant, generation } = *a else {
            panic!("{a:?}");
        };
        sched.release(
            tenant,
            generation,
            now + 2 * MS,
            Some(0),
            true,
            now + 2 * MS,
        );
    }
    assert_eq!(sched.holder(), Some(5));
    assert!(sched.co_holders().is_empty(), "{:?}", sched.co_holders());
}

#[test]
fn a_shared_grant_is_charged_its_launches_at_their_unshared_device_time() {
    let mut sched = Scheduler::new(co_holding());
    for id in 1..=2 {
        sched.add(id, burst(50), 0);
        sched.note_stopped(id, 0.8, PERIOD);
    }
    // Alone, each measured 100 µs per launch (10 of them in 1 ms of 10 ms held).
    let mut now = measured(&mut sched, 1, MS, 10 * MS, 0);
    now = measured(&mut sched, 2, MS, 10 * MS, now);
    now += 100 * MS;
    let acts = sched.demand(1, now);
    let [Action::Grant { generation: g1, .. }] = acts[..] else {
        panic!("tenant 1 not granted: {acts:?}");
    };
    let acts = sched.demand(2, now);
    let [Action::Grant { generation: g2, .. }] = acts[..] else {
        panic!("tenant 2 not co-held: {acts:?}");
    };
    let used = |s: &Scheduler, id| s.stats(id, 0).expect("known").used_ns;
    let before = used(&sched, 2);
    // Beside the holder, its markers also timed the holder's kernels: 6 ms for 20
    // launches. It is charged the 20 launches at 100 µs, and its device time per
    // launch is not taken from that report.
    sched.note_launches(2, Some(6 * MS), 20);
    sched.release(2, g2, now + 5 * MS, Some(6 * MS), false, now + 5 * MS);
    assert_eq!(used(&sched, 2) - before, 2 * MS);
    assert_eq!(sched.tenants[&2].unshared_cost(), Some(MS / 10));
    // Measured less than its launches at that cost (kernels grew shorter): the
    // measure, as for a grant it did not share.
    now += 6 * MS;
    let acts = sched.demand(2, now);
    let [Action::Grant { generation: g2, .. }] = acts[..] else {
        panic!("tenant 2 not co-held again: {acts:?}");
    };
    let before = used(&sched, 2);
    sched.note_launches(2, Some(MS / 2), 20);
    sched.release(2, g2, now + MS, Some(MS / 2), false, now + MS);
    assert_eq!(used(&sched, 2) - before, MS / 2);
    // A grant of no launches measures what was queued at the last one's end: it is
    // charged what that grant's launches were owed and did not measure (1.5 ms), at
    // most its measure.
    now += 2 * MS;
    let acts = sched.demand(2, now);
    let [Action::Grant { generation: g2, .. }] = acts[..] else {
        panic!("tenant 2 not co-held a third time: {acts:?}");
    };
    let before = used(&sched, 2);
    sched.note_launches(2, Some(MS), 0);
    sched.release(2, g2, now + MS, Some(MS), false, now + MS);
    assert_eq!(used(&sched, 2) - before, MS);
    // The holder shared its grant too; a report without launches (none reported)
    // is charged as measured.
    assert_eq!(sched.holder(), Some(1));
    let before = used(&sched, 1);
    sched.release(1, g1, now + MS, Some(3 * MS), false, now + MS);
    assert_eq!(used(&sched, 1) - before, 3 * MS);
}

#[test]
fn a_shared_grant_is_charged_its_measure_until_unshared_grants_measured_enough() {
    let mut sched = Scheduler::new(co_holding());
    for id in 1..=2 {
        sched.add(id, burst(50), 0);
        sched.note_stopped(id, 0.8, PERIOD);
    }
    // Tenant 2's only unshared grant measured 18 µs for 61 launches (a first
    // grant's measure missing most of them): not a cost to charge at.
    let mut now = measured(&mut sched, 1, MS, 10 * MS, 0);
    let acts = sched.demand(2, now);
    let [Action::Grant { generation, .. }] = acts[..] else {
        panic!("tenant 2 not granted: {acts:?}");
    };
    sched.note_launches(2, Some(18_000), 61);
    sched.release(
        2,
        generation,
        now + 10 * MS,
        Some(18_000),
        false,
        now + 10 * MS,
    );
    assert_eq!(sched.tenants[&2].unshared_cost(), None);
    now += 110 * MS;
    sched.demand(1, now);
    let acts = sched.demand(2, now);
    let [Action::Grant { generation, .. }] = acts[..] else {
        panic!("tenant 2 not co-held: {acts:?}");
    };
    let before = sched.stats(2, 0).expect("known").used_ns;
    sched.note_launches(2, Some(3 * MS), 200);
    sched.release(
        2,
        generation,
        now + 5 * MS,
        Some(3 * MS),
        false,
        now + 5 * MS,
    );
    assert_eq!(sched.stats(2, 0).expect("known").used_ns - before, 3 * MS);
}
