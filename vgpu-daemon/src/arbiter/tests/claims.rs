//! Claims (ADR 0030): unclaimed grants withdrawn at a look, and the looks' pacing.

use super::MS;
use super::shares::burst;
use crate::arbiter::TenantId;
use crate::arbiter::params::{DEFAULT_CLAIM_TIMEOUT_NS, MAX_WITHDRAWN_IN_ROW, Params};
use crate::arbiter::rules::next_look_after;
use crate::arbiter::stride::{Action, Scheduler};

/// Tenants 1 and 2 at 50/50, 1's container throttled `stopped` of the time; 1 asks
/// and is granted (generation 1), then 2 asks.
pub(super) fn granted_to(stopped: f64) -> Scheduler {
    let mut sched = Scheduler::new(Params::default());
    sched.add(1, burst(50), 0);
    sched.add(2, burst(50), 0);
    sched.note_stopped(1, stopped, Some(100 * MS));
    sched.note_launches(1, Some(MS), 10);
    assert_eq!(
        sched.demand(1, 0),
        vec![Action::Grant {
            tenant: 1,
            generation: 1
        }]
    );
    assert!(sched.demand(2, 0).is_empty());
    sched
}

pub(super) fn used(sched: &Scheduler, id: TenantId, now: u64) -> u64 {
    sched.stats(id, now).expect("known").used_ns
}

#[test]
fn a_grant_its_throttled_holder_has_not_claimed_is_withdrawn_and_the_gpu_goes_on() {
    let mut sched = granted_to(0.3);
    let look = DEFAULT_CLAIM_TIMEOUT_NS;
    assert_eq!(
        sched.next_deadline(),
        Some(look),
        "the look, not the slice end"
    );
    assert_eq!(sched.claim_due(look - 1), None);
    assert_eq!(sched.claim_due(look), Some((1, 1)));
    assert_eq!(
        sched.withdraw(1, 1, look),
        vec![Action::Revoke {
            tenant: 1,
            generation: 1
        }]
    );
    // The daemon read the claim again after storing the revocation: still none.
    assert_eq!(
        sched.unclaimed(1, 1, look),
        vec![Action::Grant {
            tenant: 2,
            generation: 2
        }]
    );
    // Its launcher asks again: not granted before its drain report, not even when
    // 2's slice ends.
    assert!(sched.demand(1, look + MS).is_empty());
    assert!(
        !sched
            .tick(look + 10 * MS)
            .iter()
            .any(|a| matches!(a, Action::Grant { tenant: 1, .. })),
        "granted again before its report"
    );
    // Its container runs again 40 ms later: it reports nothing ran, still asking.
    // Not charged the 40 ms (nor its floor: nobody waited for the GPU meanwhile, 2
    // held it); owed, it takes the lent slice back.
    let back = 42 * MS;
    let acts = sched.release(1, 1, back, Some(0), true, back);
    assert_eq!(used(&sched, 1, back), 0);
    assert!(
        acts.contains(&Action::Revoke {
            tenant: 2,
            generation: 2
        }),
        "{acts:?}"
    );
    assert_eq!(
        sched.fill(1),
        None,
        "a grant nobody launched under says nothing of its fill"
    );
}

#[test]
fn a_claimed_grant_is_looked_at_once_and_held_to_its_slice_end() {
    let mut sched = granted_to(0.3);
    let look = DEFAULT_CLAIM_TIMEOUT_NS;
    assert_eq!(sched.claim_due(look), Some((1, 1)));
    sched.claimed(1, 1);
    assert_eq!(sched.claim_due(look), None);
    assert_eq!(sched.next_deadline(), Some(10 * MS));
    // A stale answer (another grant) changes nothing.
    sched.claimed(1, 7);
    assert!(sched.withdraw(1, 7, look).is_empty());
    assert!(sched.unclaimed(1, 7, look).is_empty());
    assert_eq!(sched.holder(), Some(1));
}

#[test]
fn holders_not_throttled_or_alone_are_not_looked_at_but_any_unclaimed_revoke_goes_on() {
    // Not throttled (a launcher slow to wake on a busy node keeps its grant).
    let mut sched = granted_to(0.0);
    assert_eq!(sched.claim_due(5 * MS), None);
    assert_eq!(sched.next_deadline(), Some(10 * MS));
    // At the slice's end the revoke finds no claim: the GPU goes on at once.
    assert_eq!(
        sched.tick(10 * MS),
        vec![Action::Revoke {
            tenant: 1,
            generation: 1
        }]
    );
    assert_eq!(
        sched.unclaimed(1, 1, 10 * MS),
        vec![Action::Grant {
            tenant: 2,
            generation: 2
        }]
    );
    // Alone: nobody to go on to, no look.
    let mut sched = Scheduler::new(Params::default());
    sched.add(1, burst(50), 0);
    sched.note_stopped(1, 0.9, Some(100 * MS));
    sched.demand(1, 0);
    assert_eq!(sched.claim_due(5 * MS), None);
    // Off: no look.
    let mut sched = granted_to(0.3);
    sched.p.claim_timeout_ns = 0;
    assert_eq!(sched.claim_due(5 * MS), None);
}

#[test]
fn a_tenant_whose_claims_lie_pays_what_it_reports_and_one_that_never_reports_the_hold() {
    // A tenant that scribbled over its claim page ran 30 ms of queued work after the
    // GPU went on: it says so in its report, and pays it.
    let mut sched = granted_to(0.3);
    let look = DEFAULT_CLAIM_TIMEOUT_NS;
    sched.withdraw(1, 1, look);
    sched.unclaimed(1, 1, look);
    sched.release(1, 1, 32 * MS, Some(30 * MS), false, 33 * MS);
    assert_eq!(used(&sched, 1, 33 * MS), 30 * MS);
    // One that never reports is charged the 2 ms it held, at the drain timeout, and
    // not granted before it.
    let mut sched = granted_to(0.3);
    sched.withdraw(1, 1, look);
    sched.unclaimed(1, 1, look);
    let timeout = look + Params::default().drain_timeout_ns;
    sched.tick(timeout);
    assert_eq!(used(&sched, 1, timeout), look);
}

#[test]
fn a_tenant_withdrawn_while_running_is_looked_at_later_and_one_stopped_sooner() {
    let (base, q) = (2 * MS, 10 * MS);
    assert_eq!(next_look_after(2 * MS, MS, base, q), 4 * MS, "back at once");
    assert_eq!(
        next_look_after(8 * MS, 3 * MS, base, q),
        q,
        "at most a quantum"
    );
    assert_eq!(next_look_after(8 * MS, 40 * MS, base, q), 4 * MS, "stopped");
    assert_eq!(
        next_look_after(2 * MS, 40 * MS, base, q),
        base,
        "not below the base"
    );
    // Through the scheduler: withdrawn at 2 ms, its report comes 1 ms later (its
    // launcher was only slow): its next grant is looked at 4 ms after it.
    let mut sched = granted_to(0.3);
    sched.withdraw(1, 1, 2 * MS);
    sched.unclaimed(1, 1, 2 * MS);
    assert_eq!(
        sched.release(1, 1, 3 * MS, Some(0), true, 3 * MS),
        vec![Action::Revoke {
            tenant: 2,
            generation: 2
        }],
        "owed, it takes the lent slice back"
    );
    assert_eq!(
        sched.release(2, 2, 4 * MS, Some(MS), true, 4 * MS),
        vec![Action::Grant {
            tenant: 1,
            generation: 3
        }]
    );
    assert_eq!(sched.claim_due(8 * MS - 1), None);
    assert_eq!(sched.claim_due(8 * MS), Some((1, 3)));
    // Withdrawn again, back 40 ms later (stopped): 2 ms again.
    sched.withdraw(1, 3, 8 * MS);
    sched.unclaimed(1, 3, 8 * MS);
    sched.release(1, 3, 48 * MS, Some(0), true, 48 * MS);
    assert_eq!(sched.tenants[&1].look_after_ns, base);
}

/// Withdraws holder 1's grant `g` at its look (taken at `at`, 2 ms after the
/// grant), has its report come 40 ms later (stopped) still asking, and tenant 2's
/// lent slice drain: tenant 1's next grant. Returns it and the time.
pub(super) fn withdrawn_and_granted_again(sched: &mut Scheduler, g: u32, at: u64) -> (u32, u64) {
    assert_eq!(sched.claim_due(at), Some((1, g)), "looked at");
    sched.withdraw(1, g, at);
    sched.unclaimed(1, g, at);
    let back = at + 40 * MS;
    sched.release(1, g, back, Some(0), true, back);
    let actions = sched.release(2, g + 1, back, Some(MS), true, back);
    let [
        Action::Grant {
            tenant: 1,
            generation,
        },
    ] = actions[..]
    else {
        panic!("tenant 1 not granted again: {actions:?}");
    };
    (generation, back)
}

/// Stop 27's CI: a 0.2-CPU tenant of 100 ms kernels lost every grant at looks and ran
/// nothing. A tenant loses at most [`MAX_WITHDRAWN_IN_ROW`] grants in a row; the next
/// is its to the slice's end, and a grant it claims starts the count again.
#[test]
fn a_tenant_withdrawn_grant_after_grant_keeps_every_fourth() {
    let mut sched = granted_to(0.7);
    let (mut g, mut at) = (1, DEFAULT_CLAIM_TIMEOUT_NS);
    for _ in 0..MAX_WITHDRAWN_IN_ROW {
        let (next, back) = withdrawn_and_granted_again(&mut sched, g, at);
        (g, at) = (next, back + DEFAULT_CLAIM_TIMEOUT_NS);
    }
    assert_eq!(sched.tenants[&1].unclaimed, u64::from(MAX_WITHDRAWN_IN_ROW));
    assert_eq!(sched.claim_due(at + 5 * MS), None, "not looked at");
    // It launched under this one: reported having run, the next is looked at again.
    let end = at - DEFAULT_CLAIM_TIMEOUT_NS + Params::default().quantum_ns;
    assert_eq!(
        sched.tick(end),
        vec![Action::Revoke {
            tenant: 1,
            generation: g
        }]
    );
    sched.release(1, g, end, Some(5 * MS), true, end);
    assert_eq!(sched.tenants[&1].withdrawn_in_row, 0);
}

/// A holder whose launches were never measured, or measured a slice or longer, is not
/// looked at: one launch of it can keep the GPU busy past the slice.
#[test]
fn a_holder_of_unmeasured_or_long_launches_is_not_looked_at() {
    for cost in [None, Some(Params::default().quantum_ns), Some(100 * MS)] {
        let mut sched = Scheduler::new(Params::default());
        sched.add(1, burst(50), 0);
        sched.add(2, burst(50), 0);
        sched.note_stopped(1, 0.7, Some(100 * MS));
        if let Some(c) = cost {
            sched.note_launches(1, Some(c), 1);
        }
        sched.demand(1, 0);
        sched.demand(2, 0);
        assert_eq!(sched.claim_due(5 * MS), None, "launches of {cost:?} ns");
    }
}

/// A report whose caller read its clock before the revoke it answers was decided (the
/// daemon's timer revoked meanwhile) panicked in a clamp (stop 30, found by the
/// stopped-containers test): it counts as read at the revoke.
#[test]
fn a_report_read_before_its_revoke_counts_as_read_at_it() {
    let mut sched = granted_to(0.3);
    sched.withdraw(1, 1, 5 * MS);
    sched.unclaimed(1, 1, 5 * MS);
    sched.release(1, 1, 4 * MS, Some(0), false, 4 * MS);
    assert_eq!(used(&sched, 1, 5 * MS), 0);
    assert_eq!(sched.settling(), None, "settled");
}
