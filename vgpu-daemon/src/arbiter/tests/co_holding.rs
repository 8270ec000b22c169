//! Co-holding (ADR 0029): tenants stopped most of the time hold the GPU together; who
//! is co-held, and how co-holders' grants end.

use super::MS;
use super::shared_charging::measured;
use super::shares::{burst, s};
use crate::arbiter::TenantId;
use crate::arbiter::params::{CO_HOLD_FILL_PCT_MEASURED, CO_REFRESH_SLICES, Params};
use crate::arbiter::rules::co_fits;
use crate::arbiter::stride::{Action, Scheduler};
use crate::model::SliceState;
use std::collections::BTreeMap;
use vgpu_core::sched_proto::{ComputePolicy, Priority};

/// The CFS period of the tests' stopped containers (Kubernetes' default).
pub(super) const PERIOD: Option<u64> = Some(100 * MS);

/// The defaults with co-holding on, as measured (ADR 0029).
/// Co-holding on; no looks at claims (the daemon's, tested apart).
pub(super) fn co_holding() -> Params {
    Params {
        co_hold_fill_pct: CO_HOLD_FILL_PCT_MEASURED,
        claim_timeout_ns: 0,
        ..Params::default()
    }
}

/// Per tenant, what a stopped container can do with the GPU: (ms it ran, ms it ran
/// holding a grant, so that its launches went through).
pub(super) type RunHeld = BTreeMap<TenantId, (u64, u64)>;

/// Tenants stopped most of each 100 ms CFS period: tenant `i + 1` runs the 20 ms
/// of each period from `phases[i]` on. While it runs it launches if it holds a grant
/// (its work keeps the GPU busy) and asks for one if not; a revoke is seen, drained
/// and reported (with the device time its work used) at its next running ms. With
/// `claims`, the daemon's side of ADR 0030 too: a tenant that launched under its
/// grant has claimed it; the scheduler's looks are answered, and a revoke of a grant
/// nobody launched under is said to be unclaimed.
pub(super) fn run_stopped(p: Params, shares: &[u32], phases: &[u64], total_ms: u64) -> RunHeld {
    run_stopped_claims(p, shares, phases, total_ms, false)
}

pub(super) fn run_stopped_claims(
    p: Params,
    shares: &[u32],
    phases: &[u64],
    total_ms: u64,
    claims: bool,
) -> RunHeld {
    #[derive(Default)]
    struct Tn {
        held: Option<u32>,
        busy: u64,
        revoked: Option<(u32, u64)>,
    }
    fn apply(
        sched: &mut Scheduler,
        acts: Vec<Action>,
        ts: &mut BTreeMap<TenantId, Tn>,
        claims: bool,
        now: u64,
    ) {
        let mut unclaimed = Vec::new();
        for a in acts {
            match a {
                Action::Grant { tenant, generation } => {
                    let t = ts.get_mut(&tenant).expect("a known tenant");
                    assert!(t.held.is_none() && t.revoked.is_none(), "granted twice");
                    t.held = Some(generation);
                    t.busy = 0;
                }
                Action::Revoke { tenant, generation } => {
                    let t = ts.get_mut(&tenant).expect("a known tenant");
                    assert_eq!(t.held.take(), Some(generation), "revoked a non-holder");
                    t.revoked = Some((generation, t.busy));
                    if claims && t.busy == 0 {
                        unclaimed.push((tenant, generation));
                    }
                }
            }
        }
        for (tenant, generation) in unclaimed {
            let acts = sched.unclaimed(tenant, generation, now);
            apply(sched, acts, ts, claims, now);
        }
    }
    let mut sched = Scheduler::new(p);
    let mut ts: BTreeMap<TenantId, Tn> = BTreeMap::new();
    let mut out = RunHeld::new();
    for (i, &share) in shares.iter().enumerate() {
        sched.add(i as u64 + 1, burst(share), 0);
        // What the kernel reports for them: stopped 80 % of the time.
        sched.note_stopped(i as u64 + 1, 0.8, PERIOD);
        ts.insert(i as u64 + 1, Tn::default());
    }
    for ms in 0..total_ms {
        let now = ms * MS;
        if claims && let Some((id, generation)) = sched.claim_due(now) {
            if ts[&id].busy > 0 {
                sched.claimed(id, generation);
            } else {
                let acts = sched.withdraw(id, generation, now);
                apply(&mut sched, acts, &mut ts, claims, now);
            }
        }
        let acts = sched.tick(now);
        apply(&mut sched, acts, &mut ts, claims, now);
        for (i, phase) in phases.iter().enumerate() {
            let id = i as u64 + 1;
            if (ms + 100 - phase % 100) % 100 >= 20 {
                continue;
            }
            if let Some((generation, busy)) = ts.get_mut(&id).and_then(|t| t.revoked.take()) {
                // Kernels of 10 µs.
                sched.note_launches(id, Some(busy * MS), busy * 100);
                let acts = sched.release(id, generation, now, Some(busy * MS), true, now);
                apply(&mut sched, acts, &mut ts, claims, now);
            }
            let e = out.entry(id).or_insert((0, 0));
            e.0 += 1;
            let t = &mut ts.get_mut(&id).expect("a known tenant");
            if t.held.is_some() {
                t.busy += 1;
                e.1 += 1;
            } else {
                let acts = sched.demand(id, now);
                apply(&mut sched, acts, &mut ts, claims, now);
            }
        }
    }
    out
}

/// The three tenants of [`run_stopped`] in turn (20/30/50 %, running from 0, 37
/// and 71 ms of each period, 20 s): per tenant, the percent of the time it ran in
/// which it could launch, under `a` (the daemon answering looks at claims when
/// `claims`), and under `b` (without).
pub(super) fn launch_pcts(a: Params, claims: bool, b: Params) -> Vec<(f64, f64)> {
    let (shares, phases) = ([20, 30, 50], [0, 37, 71]);
    let ra = run_stopped_claims(a, &shares, &phases, 20_000, claims);
    let rb = run_stopped(b, &shares, &phases, 20_000);
    let pct = |r: &RunHeld, id| r[&id].1 as f64 * 100.0 / r[&id].0 as f64;
    (1..=3).map(|id| (pct(&ra, id), pct(&rb, id))).collect()
}

/// Exclusive slices as before ADR 0030: no looks at claims, no throttled hand-on.
pub(super) fn exclusive_waiting() -> Params {
    Params {
        co_hold_fill_pct: 0,
        claim_timeout_ns: 0,
        ..Params::default()
    }
}

#[test]
fn tenants_stopped_most_of_the_time_hold_the_gpu_together_while_they_run() {
    let pcts = launch_pcts(co_holding(), false, exclusive_waiting());
    for (id, (together, alone)) in (1..).zip(pcts) {
        assert!(
            together > 90.0,
            "co-held, tenant {id} could launch in {together:.1} % of the time it ran (alone: {alone:.1} %)"
        );
        // The mechanism: granted one at a time, a grant mostly comes while the
        // tenant is stopped, and its slice passes unused.
        assert!(
            alone < 60.0,
            "exclusive slices let tenant {id} launch in {alone:.1} % of the time it ran"
        );
    }
}

/// ADR 0030 with exclusive slices: three tenants stopped 80 % of each period, in
/// turn, never running at once. Granted while stopped, a tenant used to hold the GPU
/// idle to its slice's end and to its report a period later; now a grant nobody
/// launched under is withdrawn after 2 ms, and a revoked holder is passed over once
/// its queued work is over (several at once). Without: each launched in 0.3–13 % of
/// the time it ran; with: 65–84 %.
#[test]
fn tenants_stopped_most_of_the_time_are_not_waited_for_when_they_take_turns() {
    let exclusive = Params {
        co_hold_fill_pct: 0,
        ..Params::default()
    };
    let pcts = launch_pcts(exclusive, true, exclusive_waiting());
    for (id, (with, without)) in (1..).zip(pcts) {
        assert!(
            with > 60.0,
            "tenant {id} could launch in {with:.1} % of the time it ran (without looks at claims and throttled hand-on: {without:.1} %)"
        );
        assert!(
            without < 15.0,
            "without, tenant {id} launched in {without:.1} % of the time it ran"
        );
    }
}

/// Tenants 1..=`n` of `share` % each, stopped 80 % of the time; 1 and 2 measured at
/// 1 ms of device time in 10, then both asking: 1 holds, 2 is co-held beside it.
/// Returns the scheduler, the time and 2's generation.
pub(super) fn co_held_pair(n: TenantId, share: u32) -> (Scheduler, u64, u32) {
    let mut sched = Scheduler::new(co_holding());
    for id in 1..=n {
        sched.add(id, burst(share), 0);
        sched.note_stopped(id, 0.8, PERIOD);
    }
    let mut now = measured(&mut sched, 1, MS, 10 * MS, 0);
    now = measured(&mut sched, 2, MS, 10 * MS, now);
    now += 100 * MS;
    sched.demand(1, now);
    let acts = sched.demand(2, now);
    let [Action::Grant { generation: g2, .. }] = acts[..] else {
        panic!("tenant 2 not co-held: {acts:?}");
    };
    (sched, now, g2)
}

#[test]
fn co_holders_end_with_the_holders_slice_and_never_hold_up_the_next_grant() {
    let (mut sched, now, g2) = co_held_pair(3, 30);
    // A tenant that fills the GPU (not measured yet) waits; at the holder's slice
    // end both holders are revoked, and the GPU goes on at once: neither is waited
    // for (both stopped, of low use: each could have held beside the next holder).
    assert!(sched.demand(3, now + MS).is_empty());
    let end = sched.next_deadline().expect("the holder's slice");
    let acts = sched.tick(end);
    assert_eq!(acts.len(), 3, "{acts:?}");
    assert!(acts.contains(&Action::Revoke {
        tenant: 2,
        generation: g2
    }));
    let g1 = match acts[0] {
        Action::Revoke {
            tenant: 1,
            generation,
        } => generation,
        _ => panic!("{acts:?}"),
    };
    assert!(
        matches!(acts[2], Action::Grant { tenant: 3, .. }),
        "{acts:?}"
    );
    assert_eq!(sched.holder(), Some(3));
    // The holder's report comes later: it is charged its device time then.
    let used1 = sched.stats(1, end).expect("known").used_ns;
    let acts = sched.release(1, g1, end + MS, Some(MS), false, end + MS);
    assert!(acts.is_empty(), "{acts:?}");
    assert_eq!(sched.stats(1, end).expect("known").used_ns - used1, MS);
    // Until it reports, it is not granted again; its report charges its device
    // time and updates its fill.
    assert!(sched.demand(2, end + 2 * MS).is_empty());
    let used = sched.stats(2, end).expect("known").used_ns;
    let late = end + 80 * MS;
    sched.release(2, g2, late, Some(2 * MS), true, late);
    let after = sched.stats(2, late).expect("known").used_ns;
    assert_eq!(after - used, 2 * MS, "charged its device time");
    // Its fill fell: 1 ms in 10, then 2 ms over the 90 ms it held its last grant.
    let fill = sched.fill(2).expect("measured");
    assert!(fill < 0.05, "fill {fill}");
    assert_eq!(
        sched.stats(2, late).expect("known").state,
        SliceState::Waiting
    );
}

/// ADR 0037 for a co-holder: one of its processes yielded the co-grant and asks
/// again. The co-grant ends alone (the holder goes on), and the tenant is co-granted
/// again once its other processes drained, rather than at the co-holders' refresh.
#[test]
fn a_co_holders_slice_ends_alone_when_a_process_that_yielded_asks_again() {
    let (mut sched, now, g2) = co_held_pair(2, 50);
    assert_eq!(sched.holder(), Some(1));
    // A stale generation or the holder's tenant under another generation: nothing.
    assert!(sched.end_slice(2, g2 + 1, now + MS).is_empty());
    let acts = sched.end_slice(2, g2, now + MS);
    assert_eq!(
        acts,
        vec![Action::Revoke {
            tenant: 2,
            generation: g2
        }]
    );
    assert_eq!(sched.holder(), Some(1), "the holder goes on");
    assert!(sched.co_holders().is_empty());
    // The process asks (the daemon's demand after the end), its siblings drain: the
    // tenant is co-granted again, under a new generation.
    assert!(sched.demand(2, now + MS).is_empty(), "not before its drain");
    let acts = sched.release(2, g2, now + 2 * MS, Some(MS / 2), true, now + 2 * MS);
    let [
        Action::Grant {
            tenant: 2,
            generation,
        },
    ] = acts[..]
    else {
        panic!("not co-granted again: {acts:?}");
    };
    assert_ne!(generation, g2);
    assert_eq!(sched.co_holders(), vec![(2, generation)]);
}

#[test]
fn a_co_holder_that_never_reports_is_charged_at_the_drain_timeout_and_may_leave() {
    let p = co_holding();
    let mut sched = Scheduler::new(p);
    for id in 1..=2 {
        sched.add(id, burst(50), 0);
        sched.note_stopped(id, 0.8, PERIOD);
    }
    let mut now = measured(&mut sched, 1, MS, 10 * MS, 0);
    now = measured(&mut sched, 2, MS, 10 * MS, now);
    sched.demand(1, now);
    assert_eq!(sched.demand(2, now).len(), 1);
    // Nobody else waits: the holder renews and the co-holder goes on, until it is
    // revoked to report (its fill refreshed) after CO_REFRESH_SLICES slices.
    let mut end = now;
    for i in 1..=CO_REFRESH_SLICES {
        end = sched.next_deadline().expect("the holder's slice");
        let acts = sched.tick(end);
        if i < CO_REFRESH_SLICES {
            assert!(acts.is_empty(), "slice {i}: {acts:?}");
            assert_eq!(sched.co_holders().len(), 1);
        } else {
            assert!(
                matches!(acts.as_slice(), [Action::Revoke { tenant: 2, .. }]),
                "{acts:?}"
            );
        }
    }
    assert_eq!(sched.holder(), Some(1));
    let timeout = end + p.drain_timeout_ns;
    assert!(sched.next_deadline().expect("deadlines") <= timeout);
    let before = sched.stats(2, end).expect("known").used_ns;
    let mut t = end;
    while t < timeout {
        t = sched.next_deadline().expect("deadlines").min(timeout);
        sched.tick(t);
    }
    let charged = sched.stats(2, timeout).expect("known").used_ns - before;
    assert_eq!(
        charged,
        timeout - now,
        "charged its whole grant, unmeasured"
    );
    assert_eq!(
        sched.stats(2, timeout).expect("known").state,
        SliceState::Idle
    );
    // A co-holder's tenant leaving is charged and forgotten.
    sched.demand(2, timeout);
    let acts = sched.remove(2, timeout + MS);
    assert!(acts.is_empty(), "{acts:?}");
    assert!(!sched.contains(2));
}

#[test]
fn tenants_that_fill_their_slices_are_co_held_when_their_containers_are_stopped() {
    let mut sched = Scheduler::new(co_holding());
    for id in 1..=3 {
        sched.add(id, burst(30), 0);
    }
    // Each fills every slice it holds: alone, they would fill the GPU.
    let mut now = 0;
    for id in 1..=3 {
        now = measured(&mut sched, id, 10 * MS, 10 * MS, now);
    }
    sched.demand(1, now);
    assert!(
        sched.demand(2, now).is_empty(),
        "running containers take turns"
    );
    // Their containers are stopped 85 % of the time (the kernel's throttling
    // figures): each keeps the GPU busy 15 % of the time at most.
    for id in 1..=3 {
        sched.note_stopped(id, 0.85, PERIOD);
    }
    let acts = sched.demand(3, now + MS);
    assert_eq!(acts.len(), 2, "both waiters beside the holder: {acts:?}");
    assert_eq!(sched.co_holders().len(), 2);
    // One container no longer throttled would fill the GPU: at the holder's slice
    // end the co-holders are revoked.
    sched.note_stopped(2, 0.0, PERIOD);
    let end = sched.next_deadline().expect("the holder's slice");
    let revoked = sched.tick(end);
    assert_eq!(revoked.len(), 2, "{revoked:?}");
    assert!(revoked.iter().all(|a| matches!(a, Action::Revoke { .. })));
    assert!(sched.co_holders().is_empty());
    // An operator caps a co-holder: co-holding ends at once (a capped tenant's slice
    // is its tokens').
    sched.note_stopped(2, 0.85, PERIOD);
    let acts = sched.demand(2, end);
    assert!(acts.is_empty(), "still settling: {acts:?}");
    for a in revoked {
        if let Action::Revoke { tenant, generation } = a {
            sched.release(tenant, generation, end + MS, Some(MS), true, end + MS);
        }
    }
    assert_eq!(sched.co_holders().len(), 2, "co-held again once reported");
    let acts = sched.set_settings(3, s(30, ComputePolicy::Cap, Priority::BestEffort), end + MS);
    assert_eq!(acts.len(), 2, "{acts:?}");
    assert!(acts.iter().all(|a| matches!(a, Action::Revoke { .. })));
    assert!(sched.co_holders().is_empty());
    // Garbage is clamped: a stopped part above 1 is 1, a NaN is 0.
    sched.note_stopped(2, f64::NAN, PERIOD);
    sched.note_stopped(3, 7.0, PERIOD);
    let t = |id| &sched.tenants[&id];
    assert_eq!((t(2).stopped, t(3).stopped), (0.0, 1.0));
}

/// What a stopped tenant's queued work does through its stops: at most the
/// queue-ahead bound or two launches, each stop. Short kernels stop with its CPU
/// (co-held on its fill for the part of the time it runs); kernels as long as the
/// period keep the GPU busy through the stops (never co-held).
#[test]
fn a_stopped_tenant_whose_kernels_run_on_through_its_stops_is_not_co_held() {
    let q = Params::default().queue_ahead_ns;
    let use_with = |cost: Option<u64>, period: Option<u64>| {
        let mut sched = Scheduler::new(co_holding());
        sched.add(1, burst(50), 0);
        measured(&mut sched, 1, 10 * MS, 10 * MS, 0);
        let t = sched.tenants.get_mut(&1).expect("known");
        t.launch_cost_ns = cost;
        t.stopped = 0.9;
        t.period_ns = period;
        t.expected_use(q).expect("measured")
    };
    // Its fill (1) for the tenth it runs, plus the 2 ms queued per 100 ms stop.
    let short = use_with(Some(10_000), PERIOD);
    assert!((short - 0.12).abs() < 1e-9, "{short}");
    // 5 ms kernels: two of them (10 ms) run on in each stop.
    let five = use_with(Some(5 * MS), PERIOD);
    assert!((five - 0.2).abs() < 1e-9, "{five}");
    // 100 ms kernels in a 100 ms period: busy through the stops.
    assert_eq!(use_with(Some(100 * MS), PERIOD), 1.0);
    // Not known: no discount.
    assert_eq!(use_with(None, PERIOD), 1.0);
    assert_eq!(use_with(Some(10_000), None), 1.0);
    // Beside a holder of the same kind, the short-kernel tenant is co-held, the
    // long-kernel one is not.
    for (cost, co_held) in [(10_000, true), (100 * MS, false)] {
        let mut sched = Scheduler::new(co_holding());
        sched.add(1, burst(50), 0);
        sched.add(2, burst(50), 0);
        let mut now = measured(&mut sched, 1, MS, 10 * MS, 0);
        now = measured(&mut sched, 2, 10 * MS, 10 * MS, now);
        for id in 1..=2 {
            sched.note_stopped(id, 0.9, PERIOD);
        }
        sched.tenants.get_mut(&2).expect("known").launch_cost_ns = Some(cost);
        sched.demand(1, now);
        let acts = sched.demand(2, now);
        assert_eq!(!acts.is_empty(), co_held, "kernels of {cost} ns: {acts:?}");
    }
}

#[test]
fn co_fits_adds_up_fills_under_the_bound() {
    assert!(co_fits(&[0.2, 0.3], 0.3, 80));
    assert!(!co_fits(&[0.2, 0.3], 0.31, 80));
    assert!(!co_fits(&[], 0.0, 0), "0: never");
    assert!(co_fits(&[0.0], 1.0, 100));
}
