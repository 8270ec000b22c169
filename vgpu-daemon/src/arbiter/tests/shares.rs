//! Shares: saturating tenants get their shares, over- and late-running ones included;
//! priorities, caps, live changes, and demands a starved daemon reads late.

use super::MS;
use crate::arbiter::TenantId;
use crate::arbiter::params::{ALONE_EXPIRY_MARGINS, Params, demand_time};
use crate::arbiter::stride::{Action, Scheduler};
use std::collections::{BTreeMap, BTreeSet};
use vgpu_core::sched_proto::{ComputePolicy, ComputeSettings, Priority};

pub(super) fn s(share: u32, policy: ComputePolicy, priority: Priority) -> ComputeSettings {
    ComputeSettings {
        share_pct: share,
        policy,
        priority,
    }
}

pub(super) fn burst(share: u32) -> ComputeSettings {
    s(share, ComputePolicy::Burst, Priority::BestEffort)
}

/// Simulates saturating tenants that always drain `overrun` after each revoke.
pub(super) fn run_saturated(
    sched: &mut Scheduler,
    ids: &[TenantId],
    total: u64,
    overrun: u64,
) -> BTreeMap<TenantId, u64> {
    let mut now = 0;
    for &i in ids {
        for a in sched.demand(i, now) {
            assert!(matches!(a, Action::Grant { .. }));
        }
    }
    let mut used = BTreeMap::new();
    let mut pending: Option<(TenantId, u32, u64)> = None;
    let mut grant_at: Option<(TenantId, u64)> = None;
    if let Some(h) = sched.holder() {
        grant_at = Some((h, now));
    }
    while now < total {
        now = match pending {
            Some((_, _, at)) => at,
            None => sched.next_deadline().expect("a holder has a deadline"),
        };
        let acts = if let Some((t, generation, at)) = pending.take() {
            sched.release(t, generation, at, None, true, at)
        } else {
            sched.tick(now)
        };
        for a in acts {
            match a {
                Action::Revoke { tenant, generation } => {
                    let (h, g0) = grant_at.take().expect("revoked a holder");
                    assert_eq!(h, tenant);
                    *used.entry(tenant).or_insert(0) += now + overrun - g0;
                    pending = Some((tenant, generation, now + overrun));
                }
                Action::Grant { tenant, .. } => grant_at = Some((tenant, now)),
            }
        }
    }
    used
}

#[test]
fn saturating_tenants_get_their_shares_despite_overruns() {
    let mut sched = Scheduler::new(Params::default());
    for (i, share) in [(1, 10), (2, 30), (3, 60)] {
        sched.add(i, burst(share), 0);
    }
    let used = run_saturated(&mut sched, &[1, 2, 3], 10_000 * MS, 3 * MS);
    let total: u64 = used.values().sum();
    for (i, share) in [(1, 10.0), (2, 30.0), (3, 60.0)] {
        let got = used[&i] as f64 * 100.0 / total as f64;
        assert!(
            (got - share).abs() < 1.0,
            "tenant {i}: {got:.2} % vs {share} %"
        );
    }
}

#[test]
fn ten_equal_tenants_are_fair() {
    let mut sched = Scheduler::new(Params::default());
    let ids: Vec<_> = (1..=10).collect();
    for &i in &ids {
        sched.add(i, burst(10), 0);
    }
    let used = run_saturated(&mut sched, &ids, 10_000 * MS, MS);
    let x: Vec<f64> = used.values().map(|&v| v as f64).collect();
    let jain =
        x.iter().sum::<f64>().powi(2) / (x.len() as f64 * x.iter().map(|v| v * v).sum::<f64>());
    assert!(jain > 0.999, "Jain {jain}");
    assert_eq!(x.len(), 10);
}

#[test]
fn burst_alone_keeps_the_gpu_and_cap_alone_is_limited() {
    let mut sched = Scheduler::new(Params::default());
    sched.add(1, burst(20), 0);
    let acts = sched.demand(1, 0);
    assert_eq!(
        acts,
        vec![Action::Grant {
            tenant: 1,
            generation: 1
        }]
    );
    for k in 1..100 {
        assert!(sched.tick(k * 10 * MS).is_empty(), "renewed, never revoked");
    }
    assert_eq!(sched.holder(), Some(1));

    let mut sched = Scheduler::new(Params::default());
    sched.add(1, s(30, ComputePolicy::Cap, Priority::BestEffort), 0);
    let used = run_saturated(&mut sched, &[1], 10_000 * MS, 0);
    let pct = used[&1] as f64 * 100.0 / (10_000 * MS) as f64;
    assert!((pct - 30.0).abs() < 1.0, "cap 30 % alone got {pct:.2} %");
}

#[test]
fn a_grant_expires_a_margin_past_its_slice_while_another_tenant_waits_or_when_capped() {
    let margin = Params::default().grant_expiry_margin_ns;
    let mut sched = Scheduler::new(Params::default());
    sched.add(1, burst(50), 0);
    sched.add(2, burst(50), 0);
    sched.demand(1, 0);
    let alone = ALONE_EXPIRY_MARGINS * margin;
    assert_eq!(sched.expiry(1), Some((1, 10 * MS + alone)), "alone");
    assert_eq!(sched.expiry(2), None, "no grant");
    // Renewed alone: the expiry moves on with the slice.
    assert!(sched.tick(10 * MS).is_empty());
    assert_eq!(sched.expiry(1), Some((1, 20 * MS + alone)));
    // A waiter: the holder's grant expires at its slice's end plus the margin.
    assert!(sched.demand(2, 13 * MS).is_empty());
    assert_eq!(sched.expiry(1), Some((1, 20 * MS + margin)));
    // Revoked at the slice's end: no grant of its in force any more; the next
    // holder's expires while the first one waits again.
    let acts = sched.tick(20 * MS);
    assert_eq!(
        acts,
        vec![Action::Revoke {
            tenant: 1,
            generation: 1
        }]
    );
    assert_eq!(sched.expiry(1), None);
    let acts = sched.release(1, 1, 20 * MS, Some(10 * MS), true, 20 * MS);
    assert_eq!(
        acts,
        vec![Action::Grant {
            tenant: 2,
            generation: 2
        }]
    );
    let (g, at) = sched.expiry(2).expect("tenant 1 waits");
    assert_eq!(g, 2);
    assert_eq!(at, sched.next_deadline().expect("a slice") + margin);
    // Off: never.
    let mut off = Scheduler::new(Params {
        grant_expiry_margin_ns: 0,
        ..Params::default()
    });
    off.add(1, burst(50), 0);
    off.add(2, burst(50), 0);
    off.demand(1, 0);
    off.demand(2, 0);
    assert_eq!(off.expiry(1), None);
    // A capped holder's tokens end with its slice: its grant expires even alone.
    let mut cap = Scheduler::new(Params::default());
    cap.add(1, s(30, ComputePolicy::Cap, Priority::BestEffort), 0);
    cap.demand(1, 0);
    let end = cap.next_deadline().expect("its slice");
    assert_eq!(cap.expiry(1), Some((1, end + margin)));
    // Each process of a tenant says its grant expired: the grant counts once.
    for g in [1, 1, 2] {
        sched.note_expired(1, g);
    }
    assert_eq!(sched.stats(1, 30 * MS).map(|s| s.expired), Some(2));
}

#[test]
fn a_cap_tenant_beside_a_busy_burst_tenant_reaches_its_cap() {
    let mut sched = Scheduler::new(Params::default());
    sched.add(1, burst(20), 0);
    sched.add(2, s(50, ComputePolicy::Cap, Priority::BestEffort), 0);
    let used = run_saturated(&mut sched, &[1, 2], 10_000 * MS, MS);
    let total: u64 = used.values().sum();
    let cap = used[&2] as f64 * 100.0 / total as f64;
    assert!(
        (cap - 50.0).abs() < 2.0,
        "cap 50 % beside burst got {cap:.2} %"
    );
}

#[test]
fn a_waking_latency_sensitive_tenant_preempts_best_effort() {
    let mut sched = Scheduler::new(Params::default());
    sched.add(1, burst(50), 0);
    sched.add(
        2,
        s(50, ComputePolicy::Burst, Priority::LatencySensitive),
        0,
    );
    assert_eq!(
        sched.demand(1, 0),
        vec![Action::Grant {
            tenant: 1,
            generation: 1
        }]
    );
    assert_eq!(
        sched.demand(2, MS),
        vec![Action::Revoke {
            tenant: 1,
            generation: 1
        }]
    );
    assert_eq!(
        sched.release(1, 1, 2 * MS, None, true, 2 * MS),
        vec![Action::Grant {
            tenant: 2,
            generation: 2
        }]
    );
    assert_eq!(sched.stats(1, 2 * MS).expect("known").used_ns, 2 * MS);
}

#[test]
fn live_share_change_and_departure() {
    let mut sched = Scheduler::new(Params::default());
    sched.add(1, burst(50), 0);
    sched.add(2, burst(50), 0);
    let used = run_saturated(&mut sched, &[1, 2], 2_000 * MS, 0);
    assert!((used[&1] as f64 / used[&2] as f64 - 1.0).abs() < 0.05);
    sched.set_settings(1, burst(80), 2_000 * MS);
    sched.set_settings(2, burst(20), 2_000 * MS);
    assert_eq!(sched.stats(1, 0).expect("known").settings.share_pct, 80);
    // The holder leaves: the other one gets the GPU at once.
    let h = sched.holder().expect("someone holds");
    let other = if h == 1 { 2 } else { 1 };
    let acts = sched.remove(h, 2_001 * MS);
    assert!(
        matches!(acts.as_slice(), [Action::Grant { tenant, .. }] if *tenant == other)
            || sched.holder() == Some(other)
    );
    assert!(!sched.contains(h));
}

/// Two saturating tenants where tenant 1's drain always reports nothing blocked
/// (its launcher is between launches) and it asks again `back` ns later; tenant 2
/// reports its launches blocked. Returns tenant 1's share of the charged time.
/// The 80 % tenant's share when it drains with nothing blocked and asks again
/// `back` later, its demand read by the daemon `read_delay` after it was sent (a
/// starved daemon); `look`: the daemon sees the unread demand on the socket meanwhile.
pub(super) fn late_redemand_share(p: Params, back: u64, read_delay: u64, look: bool) -> f64 {
    let mut sched = Scheduler::new(p);
    sched.add(1, burst(80), 0);
    sched.add(2, burst(20), 0);
    let mut now = 0;
    sched.demand(1, now);
    sched.demand(2, now);
    let mut redemand: Option<u64> = None;
    let mut sent: Option<u64> = None;
    while now < 20_000 * MS {
        let next = [sched.next_deadline(), redemand]
            .into_iter()
            .flatten()
            .min()
            .expect("something is pending");
        now = next.max(now);
        let acts = if redemand == Some(now) {
            redemand = None;
            sent = None;
            sched.demand(1, now)
        } else {
            let unread: BTreeSet<TenantId> = sent
                .filter(|s| look && now >= *s)
                .map(|_| 1)
                .into_iter()
                .collect();
            sched.tick_unread(now, &unread)
        };
        for a in acts {
            if let Action::Revoke { tenant, generation } = a {
                // Drains at once; tenant 1 reports nothing waiting.
                let waiting = tenant == 2;
                let more = sched.release(tenant, generation, now, None, waiting, now);
                if tenant == 1 {
                    sent = Some(now + back);
                    redemand = Some(now + back + read_delay);
                }
                assert!(more.iter().all(|a| matches!(a, Action::Grant { .. })));
            }
        }
    }
    let u1 = sched.stats(1, now).expect("known").used_ns as f64;
    let u2 = sched.stats(2, now).expect("known").used_ns as f64;
    u1 * 100.0 / (u1 + u2)
}

#[test]
fn an_owed_tenant_that_asks_again_just_after_its_drain_keeps_its_share() {
    // 100 µs: what a launcher woken by the drain takes on an idle CPU; 1.5 ms: a
    // busy one.
    for back in [100_000, 1_500_000] {
        let got = late_redemand_share(Params::default(), back, 0, false);
        assert!(
            (got - 80.0).abs() < 2.0,
            "80 % tenant asking again {back} ns after its drains got {got:.1} %"
        );
    }
    // The mechanism: without the grace, the demand comes after the decision and the
    // owed time is lost at every slice.
    let none = Params {
        regrant_grace_ns: 0,
        ..Params::default()
    };
    let got = late_redemand_share(none, 100_000, 0, false);
    assert!(got < 60.0, "without grace the 80 % tenant got {got:.1} %");
}

#[test]
fn a_demand_the_daemon_has_not_read_yet_keeps_the_gpu_for_its_tenant() {
    // The demand is sent 100 µs after the drain and read 5 ms later (the daemon
    // starved of CPU): past the 2 ms grace. Seeing it on the socket, the scheduler
    // waits for it; not seeing it, it gives the GPU away at every slice.
    let p = Params::default();
    let got = late_redemand_share(p, 100_000, 5 * MS, true);
    assert!(
        (got - 80.0).abs() < 2.0,
        "demand read 5 ms late, seen unread: the 80 % tenant got {got:.1} %"
    );
    let got = late_redemand_share(p, 100_000, 5 * MS, false);
    assert!(got < 60.0, "demand read 5 ms late, unseen: {got:.1} %");
    // A daemon that does not look meanwhile (throttled) waits for a demand however
    // late it reads it; one that looks every millisecond, for ten looks at most.
    let got = late_redemand_share(p, 100_000, 30 * MS, true);
    assert!(
        got < 60.0,
        "demand read 30 ms late, seen unread at every look: {got:.1} %"
    );
    // Throttled: the first look, 50 ms after the drain, finds the demand unread.
    let mut sched = Scheduler::new(p);
    sched.add(1, burst(80), 0);
    sched.add(2, burst(20), 0);
    sched.demand(2, 0);
    sched.demand(1, 0);
    assert_eq!(sched.tick(10 * MS).len(), 1, "2 revoked");
    let grant1 = sched.release(2, 1, 10 * MS, None, true, 10 * MS);
    assert_eq!(grant1.len(), 1, "{grant1:?}");
    assert_eq!(sched.tick(20 * MS).len(), 1, "1 revoked");
    // 1 drains with nothing blocked, still owed (80 % against 20 %): kept free.
    assert!(
        sched
            .release(1, 2, 21 * MS, None, false, 21 * MS)
            .is_empty()
    );
    assert!(sched.tick_unread(71 * MS, &BTreeSet::from([1])).is_empty());
    assert_eq!(
        sched.demand(1, 71 * MS + 100_000),
        vec![Action::Grant {
            tenant: 1,
            generation: 3
        }]
    );
    // The same look without the unread demand gives the GPU to 2.
    let mut sched = Scheduler::new(p);
    sched.add(1, burst(80), 0);
    sched.add(2, burst(20), 0);
    sched.demand(2, 0);
    sched.demand(1, 0);
    sched.tick(10 * MS);
    sched.release(2, 1, 10 * MS, None, true, 10 * MS);
    sched.tick(20 * MS);
    sched.release(1, 2, 21 * MS, None, false, 21 * MS);
    assert_eq!(
        sched.tick_unread(71 * MS, &BTreeSet::new()),
        vec![Action::Grant {
            tenant: 2,
            generation: 3
        }]
    );
}

/// Grants and releases of two saturating tenants from `now` to `until`: every slice
/// ends at its deadline, drains at once, fully busy, launches still blocked.
pub(super) fn saturate_until(sched: &mut Scheduler, now: u64, until: u64) {
    saturate_reporting(sched, now, until, MS * 10);
}

/// [`saturate_until`], each drain reporting `busy` ns of device time (`u64::MAX`:
/// busy for the whole grant, renewals included).
pub(super) fn saturate_reporting(sched: &mut Scheduler, mut now: u64, until: u64, busy: u64) {
    while now < until {
        let deadline = sched.next_deadline().expect("a holder or a grace");
        now = deadline.max(now);
        for a in sched.tick(now) {
            if let Action::Revoke { tenant, generation } = a {
                sched.release(tenant, generation, now, Some(busy), true, now);
            }
        }
    }
}

/// Both tenants saturating from 0; the 75 % tenant drains between two launches at
/// 100 ms and asks again at once, but the daemon (throttled) reads its demand only
/// `read_late` later, dated `asked_after` the drain; then both saturate until 2 s.
/// The 25 % tenant's part of the charged time.
pub(super) fn late_read_demand_share(read_late: u64, asked_after: u64) -> f64 {
    let mut sched = Scheduler::new(Params::default());
    sched.add(1, burst(25), 0);
    sched.add(2, burst(75), 0);
    sched.demand(1, 0);
    sched.demand(2, 0);
    saturate_until(&mut sched, 0, 100 * MS);
    // Run until the 75 % tenant holds, then it drains not waiting.
    let mut now = 100 * MS;
    while sched.holder() != Some(2) {
        saturate_until(&mut sched, now, now + 1);
        now = sched.next_deadline().expect("a holder").max(now + 1);
    }
    let gen2 = sched.generation;
    let drained = now + 5 * MS;
    sched.release(2, gen2, drained, Some(5 * MS), false, drained);
    // The lone 25 % tenant keeps the GPU busy while the demand sits unread.
    let read = drained + read_late;
    saturate_reporting(&mut sched, drained, read, u64::MAX);
    sched.demand_asked(2, demand_time(Some(drained + asked_after), read), read);
    saturate_reporting(&mut sched, read, 2_000 * MS, u64::MAX);
    let small = sched.stats(1, 2_000 * MS).expect("known").used_ns as f64;
    let big = sched.stats(2, 2_000 * MS).expect("known").used_ns as f64;
    small * 100.0 / (small + big)
}

#[test]
fn a_demand_a_starved_daemon_read_late_is_not_taken_for_a_sleep() {
    // Asked 1 ms after its drain, read 80 ms later: it keeps what it is owed.
    let got = late_read_demand_share(80 * MS, MS);
    assert!(
        (got - 25.0).abs() < 1.0,
        "the 25 % tenant got {got:.1} % of the charged time"
    );
    // Dated at the read (an older shim), the 80 ms pass for a sleep and the 25 %
    // tenant keeps the GPU time it took meanwhile.
    let undated = late_read_demand_share(80 * MS, 80 * MS);
    assert!(
        undated > got + 2.0,
        "dated at the read: {undated:.1} %, dated by the shim: {got:.1} %"
    );
    // A date older than the bound is not believed: a real sleep is still one.
    assert_eq!(demand_time(Some(0), 500 * MS), 400 * MS);
    assert_eq!(demand_time(Some(600 * MS), 500 * MS), 500 * MS);
    assert_eq!(demand_time(None, 500 * MS), 500 * MS);
}

#[test]
fn a_short_sleep_does_not_forfeit_time_owed_for_a_neighbours_overrun() {
    // The starved-daemon case (ADR 0024): the 25 % tenant's slice ends 300 ms late
    // (the daemon's timer did not run), fully busy, charged as such, while the 75 %
    // tenant waited. The 75 % tenant then runs, drains between two launches and asks
    // again 16 ms later (its launcher starved of CPU); the daemon, late, has given
    // the GPU to the 25 % tenant meanwhile. The 75 % tenant is owed 900 ms; a sleep
    // of 16 ms must not cancel that debt.
    let mut sched = Scheduler::new(Params::default());
    sched.add(1, burst(25), 0);
    sched.add(2, burst(75), 0);
    assert_eq!(sched.demand(1, 0).len(), 1);
    sched.demand(2, 0);
    let late = 300 * MS;
    assert_eq!(
        sched.tick(late),
        vec![Action::Revoke {
            tenant: 1,
            generation: 1
        }]
    );
    let acts = sched.release(1, 1, late, Some(late), true, late);
    assert_eq!(
        acts,
        vec![Action::Grant {
            tenant: 2,
            generation: 2
        }]
    );
    let end = late + 10 * MS;
    sched.tick(end);
    assert!(
        sched
            .release(2, 2, end, Some(10 * MS), false, end)
            .is_empty()
    );
    // The grace (2 ms) is over when the late daemon looks again.
    assert_eq!(
        sched.tick(end + 8 * MS),
        vec![Action::Grant {
            tenant: 1,
            generation: 3
        }]
    );
    sched.demand(2, end + 16 * MS);
    saturate_until(&mut sched, end + 16 * MS, 2_000 * MS);
    let now = 2_000 * MS;
    let small = sched.stats(1, now).expect("known").used_ns as f64;
    let big = sched.stats(2, now).expect("known").used_ns as f64;
    let got = small * 100.0 / (small + big);
    // Forfeiting the debt: 25 % of the time after the overrun on top of it, 37 %.
    assert!(
        (got - 25.0).abs() < 2.0,
        "the 25 % tenant got {got:.1} % of the charged time"
    );
}

#[test]
fn a_tenant_that_really_stopped_delays_the_others_by_the_grace_at_most() {
    let p = Params::default();
    let mut sched = Scheduler::new(p);
    sched.add(1, burst(80), 0);
    sched.add(2, burst(20), 0);
    sched.demand(2, 0);
    sched.demand(1, MS);
    assert_eq!(
        sched.tick(10 * MS),
        vec![Action::Revoke {
            tenant: 2,
            generation: 1
        }]
    );
    assert_eq!(
        sched.release(2, 1, 10 * MS, None, true, 10 * MS),
        vec![Action::Grant {
            tenant: 1,
            generation: 2
        }]
    );
    // Tenant 1 (owed: 3 ms at 80 % against 10 ms at 20 %) releases with nothing
    // blocked: the GPU waits for it, but only for the grace.
    assert!(
        sched
            .release(1, 2, 13 * MS, None, false, 13 * MS)
            .is_empty()
    );
    assert_eq!(sched.holder(), None);
    let t = sched.next_deadline().expect("the grace ends");
    assert_eq!(t, 13 * MS + p.regrant_grace_ns);
    assert!(sched.tick(t - 1).is_empty());
    assert_eq!(
        sched.tick(t),
        vec![Action::Grant {
            tenant: 2,
            generation: 3
        }]
    );
    // Coming back within the grace, it gets the GPU at once.
    sched.demand(1, t + MS);
    sched.tick(t + 10 * MS);
    assert_eq!(
        sched.release(2, 3, t + 10 * MS, None, true, t + 10 * MS),
        vec![Action::Grant {
            tenant: 1,
            generation: 4
        }]
    );
    assert!(
        sched
            .release(1, 4, t + 11 * MS, None, false, t + 11 * MS)
            .is_empty()
    );
    assert_eq!(
        sched.demand(1, t + 12 * MS),
        vec![Action::Grant {
            tenant: 1,
            generation: 5
        }]
    );
}
