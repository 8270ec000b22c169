//! The arbiter driven through [`Arbiter::on`] with an explicit clock, by topic: a grant's
//! way from a demand to the next holder, drains reported by several processes, yields,
//! claims, expiries, departures. The scheduling rules themselves (shares, charging,
//! co-holding, slices) are tested on the scheduler, in the sibling modules.

use std::collections::{BTreeMap, BTreeSet, HashSet};

use vgpu_core::sched_proto::{ComputePolicy, ComputeSettings, Priority};

use super::MS;
use crate::arbiter::{ALONE_EXPIRY_MARGINS, Arbiter, Effect, Event, Params, TenantId};

fn burst(share: u32) -> ComputeSettings {
    ComputeSettings {
        share_pct: share,
        policy: ComputePolicy::Burst,
        priority: Priority::BestEffort,
    }
}

/// A GPU as the daemon keeps it: the arbiter, and what carrying out its effects left
/// (grant words, messages, claims), with the processes of each tenant.
struct Gpu {
    arbiter: Arbiter,
    /// Grant words: tenant → (generation, held).
    words: BTreeMap<TenantId, (u32, bool)>,
    /// Expiries written: tenant → (generation, at).
    expiries: BTreeMap<TenantId, (u32, u64)>,
    /// Messages sent, in order: (tenant, generation, grant or revoke).
    sent: Vec<(TenantId, u32, bool)>,
    /// The grant each tenant's claim names (a process launched under it): each grant,
    /// unless the tenant is `silent`.
    claims: BTreeMap<TenantId, u32>,
    silent: BTreeSet<TenantId>,
    /// Processes (connections) of each tenant.
    procs: BTreeMap<TenantId, HashSet<u64>>,
    wake: Option<u64>,
    /// Claim reads asked for.
    looks: u32,
}

impl Gpu {
    /// Tenants `(id, share)` registered at 0, with processes `procs` (connection `c` is
    /// tenant `c / 10`'s).
    fn new(p: Params, tenants: &[(TenantId, u32)], procs: &[u64]) -> Gpu {
        let mut gpu = Gpu {
            arbiter: Arbiter::new(p),
            words: BTreeMap::new(),
            expiries: BTreeMap::new(),
            sent: Vec::new(),
            claims: BTreeMap::new(),
            silent: BTreeSet::new(),
            procs: BTreeMap::new(),
            wake: None,
            looks: 0,
        };
        for &c in procs {
            gpu.procs.entry(c / 10).or_default().insert(c);
        }
        for &(tenant, share) in tenants {
            gpu.on(
                Event::Registered {
                    tenant,
                    settings: burst(share),
                },
                0,
            );
        }
        gpu
    }

    /// Carries out `event`'s effects as the daemon does, answering reads at once.
    fn on(&mut self, event: Event<'_>, now: u64) {
        let mut todo: Vec<Effect> = self.arbiter.on(event, now);
        todo.reverse();
        while let Some(e) = todo.pop() {
            let answer = match e {
                Effect::Grant {
                    tenant, generation, ..
                } => {
                    self.words.insert(tenant, (generation, true));
                    self.sent.push((tenant, generation, true));
                    if !self.silent.contains(&tenant) {
                        self.claims.insert(tenant, generation);
                    }
                    None
                }
                Effect::Revoke { tenant, generation } => {
                    self.words.insert(tenant, (generation, false));
                    self.sent.push((tenant, generation, false));
                    let claimed = self.claims.get(&tenant) == Some(&generation);
                    Some(Event::RevokeStored {
                        tenant,
                        generation,
                        claimed_at: claimed.then_some(0),
                        procs: self.procs[&tenant].clone(),
                    })
                }
                Effect::Release { tenant, generation } => {
                    self.words.insert(tenant, (generation, false));
                    None
                }
                Effect::Expiry {
                    tenant,
                    generation,
                    at,
                } => {
                    self.expiries.insert(tenant, (generation, at));
                    None
                }
                Effect::LookAtClaim { tenant, generation } => {
                    self.looks += 1;
                    Some(Event::ClaimSeen {
                        tenant,
                        generation,
                        claimed: self.claims.get(&tenant) == Some(&generation),
                    })
                }
                Effect::WakeAt(at) => {
                    self.wake = at;
                    None
                }
            };
            if let Some(answer) = answer {
                let mut more = self.arbiter.on(answer, now);
                more.reverse();
                todo.extend(more);
            }
        }
    }

    fn demand(&mut self, tenant: TenantId, conn: u64, now: u64) {
        let event = Event::Demand {
            tenant,
            conn,
            since_ns: Some(now),
        };
        self.on(event, now);
    }

    /// Process `conn` of `tenant` reports grant `generation` drained (or yielded).
    fn report(&mut self, tenant: TenantId, conn: u64, generation: u32, waiting: bool, now: u64) {
        let procs = self.procs[&tenant].clone();
        let event = Event::DrainReport {
            tenant,
            conn,
            generation,
            end_ns: now,
            busy_ns: Some(MS),
            launches: 10,
            waiting,
            procs: &procs,
        };
        self.on(event, now);
    }

    fn tick(&mut self, now: u64) {
        let unread = BTreeSet::new();
        self.on(Event::Tick { unread: &unread }, now);
    }

    /// The tenant whose word is held, with its generation.
    fn held(&self) -> Vec<(TenantId, u32)> {
        self.words
            .iter()
            .filter(|(_, (_, held))| *held)
            .map(|(t, (g, _))| (*t, *g))
            .collect()
    }
}

mod grant_way {
    use super::*;

    #[test]
    fn a_demand_is_granted_revoked_at_the_slice_end_and_the_gpu_goes_on_after_every_report() {
        let mut gpu = Gpu::new(Params::default(), &[(1, 50), (2, 50)], &[11, 12, 21]);
        gpu.demand(1, 11, 0);
        assert_eq!(
            gpu.held(),
            vec![(1, 1)],
            "granted at once: the GPU was free"
        );
        assert_eq!(gpu.sent, vec![(1, 1, true)]);
        assert_eq!(gpu.wake, Some(10 * MS), "the slice's end");
        gpu.demand(2, 21, MS);
        gpu.tick(10 * MS);
        assert_eq!(gpu.held(), vec![], "revoked: nobody holds while it drains");
        assert_eq!(gpu.sent.last(), Some(&(1, 1, false)));
        // One process of two reported: the GPU waits for the other.
        gpu.report(1, 11, 1, true, 10 * MS + 100_000);
        assert_eq!(gpu.held(), vec![]);
        gpu.report(1, 12, 1, true, 10 * MS + 200_000);
        assert_eq!(
            gpu.held(),
            vec![(2, 2)],
            "the next holder, after the last report"
        );
        let s1 = gpu.arbiter.stats(1, 11 * MS).expect("tenant 1");
        assert_eq!(s1.used_ns, 2 * MS, "charged the two processes' device time");
    }

    #[test]
    fn a_report_of_another_grant_changes_nothing() {
        let mut gpu = Gpu::new(Params::default(), &[(1, 50), (2, 50)], &[11, 21]);
        gpu.demand(1, 11, 0);
        gpu.demand(2, 21, MS);
        gpu.tick(10 * MS);
        gpu.report(1, 11, 7, true, 10 * MS + 100_000);
        assert_eq!(gpu.held(), vec![], "a stale report does not end the drain");
        gpu.report(1, 11, 1, true, 10 * MS + 200_000);
        assert_eq!(gpu.held(), vec![(2, 2)]);
    }

    #[test]
    fn a_closed_connection_completes_the_drain_charged_whole() {
        let mut gpu = Gpu::new(Params::default(), &[(1, 50), (2, 50)], &[11, 12, 21]);
        gpu.demand(1, 11, 0);
        gpu.demand(2, 21, MS);
        gpu.tick(10 * MS);
        gpu.report(1, 11, 1, false, 10 * MS + 100_000);
        gpu.procs.get_mut(&1).expect("tenant 1").remove(&12);
        let event = Event::ConnectionClosed {
            tenant: 1,
            conn: 12,
            last: false,
        };
        gpu.on(event, 11 * MS);
        assert_eq!(gpu.held(), vec![(2, 2)], "nobody left to report");
        let s1 = gpu.arbiter.stats(1, 11 * MS).expect("tenant 1");
        assert_eq!(
            s1.used_ns,
            11 * MS,
            "not measured: the whole grant to the close"
        );
    }

    #[test]
    fn the_last_process_leaving_frees_the_gpu_at_once() {
        let mut gpu = Gpu::new(Params::default(), &[(1, 50), (2, 50)], &[11, 21]);
        gpu.demand(1, 11, 0);
        gpu.demand(2, 21, MS);
        let event = Event::ConnectionClosed {
            tenant: 1,
            conn: 11,
            last: true,
        };
        gpu.on(event, 3 * MS);
        assert_eq!(gpu.arbiter.holder(), Some(2));
        assert_eq!(gpu.arbiter.stats(1, 3 * MS), None, "gone");
    }
}

mod yields {
    use super::*;

    #[test]
    fn a_yield_every_process_reported_releases_the_word_without_a_message() {
        let mut gpu = Gpu::new(Params::default(), &[(1, 50), (2, 50)], &[11, 12, 21]);
        gpu.demand(1, 11, 0);
        gpu.report(1, 11, 1, false, MS);
        assert_eq!(
            gpu.held(),
            vec![(1, 1)],
            "one process of two yielded: still held"
        );
        gpu.report(1, 12, 1, false, 2 * MS);
        assert_eq!(gpu.held(), vec![], "released");
        assert_eq!(gpu.sent, vec![(1, 1, true)], "no revoke sent for a yield");
        gpu.demand(2, 21, 3 * MS);
        assert_eq!(gpu.held(), vec![(2, 2)]);
    }

    #[test]
    fn a_process_that_yielded_and_asks_again_ends_the_slice_for_a_new_grant() {
        let mut gpu = Gpu::new(Params::default(), &[(1, 50)], &[11, 12]);
        gpu.demand(1, 11, 0);
        gpu.report(1, 11, 1, false, MS);
        // It may not launch under grant 1 any more: the slice ends, the others drain.
        gpu.demand(1, 11, 2 * MS);
        assert_eq!(gpu.sent, vec![(1, 1, true), (1, 1, false)]);
        gpu.report(1, 12, 1, true, 3 * MS);
        assert_eq!(
            gpu.held(),
            vec![(1, 2)],
            "granted again, under a new generation"
        );
    }
}

mod claims {
    use super::*;

    /// Tenant 1, its container throttled half the time and its launches measured, holds
    /// grant 3 from 20 ms while tenant 2 waits; its claim is looked at 2 ms later.
    fn throttled_holder() -> Gpu {
        let mut gpu = Gpu::new(Params::default(), &[(1, 50), (2, 50)], &[11, 21]);
        gpu.on(
            Event::Stopped {
                tenant: 1,
                stopped: 0.5,
                period_ns: Some(100 * MS),
            },
            0,
        );
        // A first slice alone measures its launches (0.1 ms each).
        gpu.demand(1, 11, 0);
        gpu.demand(2, 21, MS);
        gpu.tick(10 * MS);
        gpu.report(1, 11, 1, true, 10 * MS);
        assert_eq!(gpu.held(), vec![(2, 2)]);
        gpu.tick(20 * MS);
        gpu.silent.insert(1);
        // Tenant 2 still asks: it waits while tenant 1 holds.
        gpu.report(2, 21, 2, true, 20 * MS);
        assert_eq!(gpu.held(), vec![(1, 3)]);
        gpu
    }

    #[test]
    fn an_unclaimed_grant_is_withdrawn_at_the_look_and_the_gpu_goes_on() {
        let mut gpu = throttled_holder();
        assert!(gpu.wake.is_some_and(|w| w < 30 * MS), "woken for the look");
        let look = gpu.wake.expect("a look");
        gpu.tick(look);
        assert_eq!(gpu.looks, 1);
        assert_eq!(
            gpu.held(),
            vec![(2, 4)],
            "withdrawn, and nothing to wait for"
        );
        let s1 = gpu.arbiter.stats(1, look).expect("tenant 1");
        assert_eq!(s1.unclaimed, 1);
    }

    #[test]
    fn a_claimed_grant_is_held_to_its_slice_end() {
        let mut gpu = throttled_holder();
        gpu.claims.insert(1, 3);
        let look = gpu.wake.expect("a look");
        gpu.tick(look);
        assert_eq!(gpu.looks, 1);
        assert_eq!(gpu.held(), vec![(1, 3)], "claimed: kept");
        assert!(gpu.wake.is_some_and(|w| w > look), "next: the slice's end");
    }
}

mod expiries {
    use super::*;

    #[test]
    fn the_holders_expiry_moves_in_when_another_tenant_waits() {
        let margin = Params::default().grant_expiry_margin_ns;
        let mut gpu = Gpu::new(Params::default(), &[(1, 50), (2, 50)], &[11, 21]);
        gpu.demand(1, 11, 0);
        let alone = ALONE_EXPIRY_MARGINS * margin;
        assert_eq!(gpu.expiries.get(&1), Some(&(1, 10 * MS + alone)));
        gpu.demand(2, 21, MS);
        assert_eq!(gpu.expiries.get(&1), Some(&(1, 10 * MS + margin)));
        gpu.on(
            Event::Expired {
                tenant: 1,
                generation: 1,
            },
            70 * MS,
        );
        gpu.on(
            Event::Expired {
                tenant: 1,
                generation: 1,
            },
            70 * MS,
        );
        let s1 = gpu.arbiter.stats(1, 70 * MS).expect("tenant 1");
        assert_eq!(s1.expired, 1, "each process says so; the grant counts once");
    }

    #[test]
    fn a_settings_change_is_decided_at_once() {
        let mut gpu = Gpu::new(Params::default(), &[(1, 50), (2, 50)], &[11, 21]);
        gpu.demand(2, 21, 0);
        gpu.demand(1, 11, MS);
        let latency = ComputeSettings {
            priority: Priority::LatencySensitive,
            ..burst(50)
        };
        let event = Event::SettingsChanged {
            tenant: 1,
            settings: latency,
        };
        gpu.on(event, 2 * MS);
        assert_eq!(
            gpu.sent.last(),
            Some(&(2, 1, false)),
            "a waiting latency-sensitive tenant revokes the best-effort holder"
        );
    }
}
