//! Slices and queues stretched for tenants slow to start and to report (ADRs 0031, 0032).

use super::MS;
use super::shares::{burst, s};
use crate::arbiter::TenantId;
use crate::arbiter::params::{PREEMPTIBLE_QUEUE_AHEAD_NS, Params};
use crate::arbiter::rules::{deepened_queue, preemptible_queue, stretched_slice};
use crate::arbiter::stride::{Action, Scheduler};
use std::collections::BTreeMap;
use vgpu_core::sched_proto::{ComputePolicy, Priority};

/// What [`run_lagging`] measured: per tenant, its device time and its slices (grant
/// to revoke), and the queue-ahead bounds of its grants; the GPU's busy time.
pub(super) struct Lagging {
    pub(super) got: BTreeMap<TenantId, (u64, Vec<u64>)>,
    pub(super) queues: BTreeMap<TenantId, Vec<u64>>,
    pub(super) busy: u64,
}

/// Tenants `(id, share, wake, lag)` saturating from 0 until `total`: a holder's work
/// starts `wake` after its grant (its launcher waiting for a CPU) and ends at the
/// revoke; its drain report reaches the daemon `lag` after that (its gate thread
/// waiting for a CPU). The GPU idles meanwhile.
pub(super) fn run_lagging(p: Params, tenants: &[(TenantId, u32, u64, u64)], total: u64) -> Lagging {
    let mut sched = Scheduler::new(p);
    let wake: BTreeMap<TenantId, (u64, u64)> =
        tenants.iter().map(|&(i, _, w, l)| (i, (w, l))).collect();
    let mut acts = Vec::new();
    for &(i, share, _, _) in tenants {
        sched.add(i, burst(share), 0);
        acts.extend(sched.demand(i, 0));
    }
    let mut run = Lagging {
        got: BTreeMap::new(),
        queues: BTreeMap::new(),
        busy: 0,
    };
    let mut granted: BTreeMap<TenantId, u64> = BTreeMap::new();
    // (when the report is read, tenant, generation, end, busy)
    let mut reports: Vec<(u64, TenantId, u32, u64, u64)> = Vec::new();
    let mut now = 0;
    loop {
        for a in acts.drain(..) {
            match a {
                Action::Grant { tenant, .. } => {
                    granted.insert(tenant, now);
                    let q = sched.queue_ahead_ns(tenant).expect("a tenant");
                    run.queues.entry(tenant).or_default().push(q);
                }
                Action::Revoke { tenant, generation } => {
                    let g0 = granted.remove(&tenant).expect("revoked a holder");
                    let (w, lag) = wake[&tenant];
                    assert!(g0 + w < now, "tenant {tenant} revoked before it started");
                    sched.claimed_at(tenant, generation, g0 + w, now);
                    let busy = now.saturating_sub(g0 + w);
                    run.busy += busy;
                    let e = run.got.entry(tenant).or_default();
                    e.0 += busy;
                    e.1.push(now - g0);
                    reports.push((now + lag, tenant, generation, now, busy));
                }
            }
        }
        let report = reports.iter().map(|r| r.0).min();
        let deadline = sched.next_deadline();
        let next = match (report, deadline) {
            (Some(r), Some(d)) => r.min(d),
            (r, d) => r.or(d).expect("a holder, a drain or a report"),
        };
        if next >= total {
            return run;
        }
        now = next;
        if report == Some(now) {
            let k = reports.iter().position(|r| r.0 == now).expect("due");
            let (_, t, g, end, busy) = reports.swap_remove(k);
            acts = sched.release(t, g, end, Some(busy), true, now);
        } else {
            acts = sched.tick(now);
        }
    }
}

#[test]
fn stretched_slices_are_four_lags_within_one_quantum_and_the_bound() {
    let q = 10 * MS;
    assert_eq!(stretched_slice(q, 0, 4, None), q);
    assert_eq!(
        stretched_slice(q, MS, 4, None),
        q,
        "a short wait keeps a quantum"
    );
    assert_eq!(stretched_slice(q, 6 * MS, 4, None), 24 * MS);
    assert_eq!(
        stretched_slice(q, u64::MAX, 4, None),
        40 * MS,
        "at most the bound"
    );
    assert_eq!(stretched_slice(q, 6 * MS, 1, None), q, "1: off");
    assert_eq!(stretched_slice(q, 6 * MS, 0, None), q, "0 counts as 1");
    // Throttled: no longer than its container runs in a period, nor under a quantum.
    assert_eq!(stretched_slice(q, 10 * MS, 4, Some(20 * MS)), 20 * MS);
    assert_eq!(stretched_slice(q, 10 * MS, 4, Some(60 * MS)), 40 * MS);
    assert_eq!(stretched_slice(q, 10 * MS, 4, Some(0)), q);
}

/// Three tenants whose launchers start 4 ms after each grant and whose drain reports
/// come 4 ms after their work ended (containers starved of CPU, not throttled): with
/// slices of one quantum the GPU is busy 6 ms in 14; stretched to four times the
/// 8 ms of each hand-over, 28 in 36, and the split still follows the shares.
#[test]
fn holders_slow_to_start_and_to_report_get_slices_that_amortize_it() {
    let tenants = [
        (1, 20, 4 * MS, 4 * MS),
        (2, 30, 4 * MS, 4 * MS),
        (3, 50, 4 * MS, 4 * MS),
    ];
    let total = 10_000 * MS;
    let off = run_lagging(
        Params {
            max_slice_quanta: 1,
            ..Params::default()
        },
        &tenants,
        total,
    );
    let on = run_lagging(Params::default(), &tenants, total);
    let busy = |r: &Lagging| r.busy as f64 / total as f64;
    assert!(
        busy(&on) >= 1.5 * busy(&off),
        "GPU busy {:.3} stretched against {:.3} in quanta",
        busy(&on),
        busy(&off)
    );
    let longest = on.got.values().flat_map(|v| v.1.iter()).max().copied();
    assert!(longest <= Some(40 * MS), "longest slice {longest:?}");
    for (id, share, _, _) in tenants {
        let got = on.got[&id].0 as f64 * 100.0 / on.busy as f64;
        assert!(
            (got - f64::from(share)).abs() <= 2.0,
            "tenant {id} ({share} %) got {got:.2} % of the device time"
        );
        let slices = &on.got[&id].1;
        let typical =
            slices[slices.len() / 2..].iter().sum::<u64>() / (slices.len() / 2).max(1) as u64;
        assert!(
            (30 * MS..=34 * MS).contains(&typical),
            "tenant {id}: slices of {typical} ns once its lag was measured"
        );
    }
}

/// A tenant that reports at once keeps slices of one quantum beside one whose reports
/// come late, and each still gets its share of the device time.
#[test]
fn a_prompt_tenant_keeps_one_quantum_beside_a_late_one() {
    let total = 10_000 * MS;
    let run = run_lagging(
        Params::default(),
        &[(1, 50, 0, 0), (2, 50, 3 * MS, 15 * MS)],
        total,
    );
    let prompt = &run.got[&1].1;
    assert!(
        prompt.iter().all(|s| *s == 10 * MS),
        "prompt tenant's slices {:?}",
        &prompt[..prompt.len().min(8)]
    );
    let late = &run.got[&2].1;
    assert_eq!(late.last(), Some(&(40 * MS)), "late tenant's last slice");
    for id in [1, 2] {
        let got = run.got[&id].0 as f64 * 100.0 / run.busy as f64;
        assert!((got - 50.0).abs() <= 2.0, "tenant {id} got {got:.2} %");
    }
}

#[test]
fn deepened_queues_are_two_lags_within_the_bound_and_half_the_slice() {
    let (base, max) = (2 * MS, 20 * MS);
    assert_eq!(deepened_queue(base, max, 0, 10 * MS), base, "prompt");
    assert_eq!(
        deepened_queue(base, max, MS / 2, 10 * MS),
        base,
        "a short wait keeps the base"
    );
    assert_eq!(deepened_queue(base, max, 2 * MS, 10 * MS), 4 * MS);
    assert_eq!(
        deepened_queue(base, max, 4 * MS, 10 * MS),
        5 * MS,
        "at most half the slice"
    );
    assert_eq!(deepened_queue(base, max, 6 * MS, 24 * MS), 12 * MS);
    assert_eq!(
        deepened_queue(base, max, u64::MAX, 40 * MS),
        max,
        "at most the bound"
    );
    assert_eq!(
        deepened_queue(base, 0, 6 * MS, 24 * MS),
        base,
        "a bound at most the base: off"
    );
    assert_eq!(
        deepened_queue(base, max, 6 * MS, MS),
        base,
        "never under the base"
    );
    assert_eq!(deepened_queue(0, max, 6 * MS, 24 * MS), 0, "unbounded");
}

/// A holder slow to start and to report queues more under each grant; a prompt one,
/// a capped one, and every holder with the bound off keep the shims' bound.
#[test]
fn a_late_holders_grants_queue_more_and_a_prompt_ones_do_not() {
    let total = 3_000 * MS;
    let base = Params::default().queue_ahead_ns;
    let run = run_lagging(
        Params::default(),
        &[(1, 50, 0, 0), (2, 50, 3 * MS, 15 * MS)],
        total,
    );
    let prompt = &run.queues[&1];
    assert!(prompt.iter().all(|q| *q == base), "prompt: {prompt:?}");
    let late = &run.queues[&2];
    assert_eq!(late.first(), Some(&base), "nothing measured yet");
    assert_eq!(
        late.last(),
        Some(&(20 * MS)),
        "18 ms hand-overs: twice that, at most half a 40 ms slice"
    );
    let off = run_lagging(
        Params {
            max_queue_ahead_ns: 0,
            ..Params::default()
        },
        &[(1, 50, 0, 0), (2, 50, 3 * MS, 15 * MS)],
        total,
    );
    assert!(off.queues.values().flatten().all(|q| *q == base), "off");
    // A capped tenant's slice ends with its tokens: its queue stays the base.
    let mut sched = Scheduler::new(Params::default());
    sched.add(1, s(50, ComputePolicy::Cap, Priority::BestEffort), 0);
    sched.demand(1, 0);
    let (mut now, mut revoked) = (0, 0);
    for _ in 0..12 {
        let granted = now;
        let g;
        (now, g) = tick_to_next_deadline(&mut sched);
        let Some((t, gen_)) = g else {
            continue;
        };
        revoked += 1;
        sched.claimed_at(t, gen_, granted + 4 * MS, now);
        sched.release(t, gen_, now + 15 * MS, Some(MS), true, now + 15 * MS);
        now += 15 * MS;
        sched.demand(1, now);
        assert_eq!(sched.queue_ahead_ns(1), Some(base), "capped");
    }
    assert!(
        revoked >= 3,
        "the capped tenant was revoked {revoked} times"
    );
    let st = sched.stats(1, now).expect("tenant");
    assert_eq!(st.queue_ahead_ns, base, "capped, as shown");
}

#[test]
fn a_best_effort_grant_beside_a_latency_sensitive_tenant_keeps_a_short_queue() {
    let base = Params::default().queue_ahead_ns;
    let mut sched = Scheduler::new(Params::default());
    // Two best-effort tenants late to start and to report, as the late tenant above,
    // whose queue deepened; and a latency-sensitive one, registered, never launching:
    // its presence alone keeps best-effort queues short.
    sched.add(1, burst(50), 0);
    sched.add(2, burst(50), 0);
    sched.add(
        9,
        s(10, ComputePolicy::Burst, Priority::LatencySensitive),
        0,
    );
    sched.demand(1, 0);
    sched.demand(2, 0);
    // Runs until `grants` more grants were made; each one's bound.
    let run = |sched: &mut Scheduler, now: &mut u64, grants: usize| {
        let mut queues = Vec::new();
        let mut granted_at = *now;
        while queues.len() < grants {
            let (at, revoked) = tick_to_next_deadline(sched);
            *now = at;
            if let Some((t, gen_)) = revoked {
                sched.claimed_at(t, gen_, granted_at + 3 * MS, *now);
                let acts = sched.release(t, gen_, *now + 15 * MS, Some(MS), true, *now + 15 * MS);
                *now += 15 * MS;
                granted_at = *now;
                for a in acts {
                    if let Action::Grant { tenant, .. } = a {
                        queues.push(sched.queue_ahead_ns(tenant).expect("tenant"));
                    }
                }
            }
        }
        queues
    };
    let mut now = 0;
    let tight = run(&mut sched, &mut now, 8);
    assert!(
        tight.iter().all(|q| *q == PREEMPTIBLE_QUEUE_AHEAD_NS),
        "beside a latency-sensitive tenant: {tight:?}"
    );
    let st = sched.stats(1, now).expect("tenant");
    assert_eq!(st.queue_ahead_ns, PREEMPTIBLE_QUEUE_AHEAD_NS, "as shown");
    sched.remove(9, now);
    let alone = run(&mut sched, &mut now, 4);
    assert!(
        alone.iter().all(|q| *q > base),
        "without it, their hand-overs deepen their queues: {alone:?}"
    );
    // The shims' own bound, where shorter, stays.
    let short = preemptible_queue(&Params {
        queue_ahead_ns: 100_000,
        ..Params::default()
    });
    assert_eq!(short, 100_000);
}

/// Ticks `sched` at its next deadline: that time, and the grant it revoked then.
pub(super) fn tick_to_next_deadline(sched: &mut Scheduler) -> (u64, Option<(TenantId, u32)>) {
    let now = sched.next_deadline().expect("a slice end or a refill");
    let revoked = sched.tick(now).into_iter().find_map(|a| match a {
        Action::Revoke { tenant, generation } => Some((tenant, generation)),
        Action::Grant { .. } => None,
    });
    (now, revoked)
}

/// The slice a tenant gets after grants whose first launches came 15 ms after them
/// (the claims' times, as the daemon reads them at the revoke); `stopped` of its CFS
/// period of 100 ms.
pub(super) fn slice_after_late_starts(stopped: f64) -> u64 {
    let mut sched = Scheduler::new(Params::default());
    sched.add(1, burst(50), 0);
    sched.add(2, burst(50), 0);
    sched.note_stopped(1, stopped, Some(100 * MS));
    sched.demand(1, 0);
    sched.demand(2, 0);
    let mut now = 0;
    for _ in 0..6 {
        // Tenant 1 holds; its slice ends and it is revoked; its report comes at
        // once; tenant 2's slice, likewise.
        let h = sched.holder().expect("a holder");
        let granted = now;
        let g;
        (now, g) = tick_to_next_deadline(&mut sched);
        let (t, gen_) = g.expect("revoked at its slice's end");
        assert_eq!(t, h);
        if t == 1 {
            sched.claimed_at(1, gen_, granted + 15 * MS, now);
        }
        sched.release(t, gen_, now, Some(now - granted), true, now);
    }
    sched.stats(1, now).expect("tenant").slice_ns
}

/// A throttled container's late starts are its stops: its slice is no longer than
/// its container runs in a period (20 ms of 100 at 80 % stopped), where a tenant
/// starved of CPU but not throttled gets four times its wait, up to four quanta.
#[test]
fn a_throttled_tenants_slice_is_no_longer_than_its_container_runs() {
    assert_eq!(slice_after_late_starts(0.0), 40 * MS);
    assert_eq!(slice_after_late_starts(0.8), 20 * MS);
    assert_eq!(
        slice_after_late_starts(0.95),
        10 * MS,
        "never under a quantum"
    );
}
