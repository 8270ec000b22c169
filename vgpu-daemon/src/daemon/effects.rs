//! The daemon as the executor of its arbiters' effects: an event goes to its GPU's
//! [`Arbiter`](crate::arbiter::Arbiter), and what the arbiter decides is carried out in
//! order (grant words stored, expiries written, messages sent, claims read and answered
//! with events). Nothing here decides a grant.

use std::collections::{HashSet, VecDeque};

use tracing::{debug, warn};
use vgpu_core::sched_proto::DaemonMsg;

use super::{Inner, TenantRec};
use crate::arbiter::{Effect, Event, TenantId};

/// Tenant `tid` and the index of its grant word for GPU `uuid` (None: it has no word there,
/// or it left).
fn tenant_word<'a>(g: &'a Inner, uuid: &str, tid: TenantId) -> Option<(&'a TenantRec, usize)> {
    let t = g.tenants.get(g.by_id.get(&tid)?)?;
    Some((t, t.gpus.get(uuid)?.word))
}

/// Hands `event` to GPU `uuid`'s arbiter and carries out its effects, in order. An effect
/// that reads (a claim) is answered with an event at once, and the effects of the answer
/// are carried out before the rest.
pub(super) fn execute(g: &mut Inner, uuid: &str, event: Event<'_>, now: u64) {
    let mut todo = VecDeque::new();
    if !decide(g, uuid, event, now, &mut todo) {
        return;
    }
    while let Some(e) = todo.pop_front() {
        if let Some(answer) = carry_out(g, uuid, e) {
            decide(g, uuid, answer, now, &mut todo);
        }
    }
}

/// Asks GPU `uuid`'s arbiter about `event`; its effects go first in `todo`, its wake-up
/// time is kept. False: no such GPU.
fn decide(
    g: &mut Inner,
    uuid: &str,
    event: Event<'_>,
    now: u64,
    todo: &mut VecDeque<Effect>,
) -> bool {
    let Some(rec) = g.gpus.get_mut(uuid) else {
        return false;
    };
    for e in rec.arbiter.on(event, now).into_iter().rev() {
        match e {
            Effect::WakeAt(at) => rec.wake_at = at,
            e => todo.push_front(e),
        }
    }
    true
}

/// Carries out one effect on GPU `uuid`: board words, then messages; the answer of a
/// read.
fn carry_out(g: &Inner, uuid: &str, e: Effect) -> Option<Event<'static>> {
    match e {
        Effect::Grant {
            tenant,
            generation,
            queue_ahead_ns,
        } => {
            let (t, word) = tenant_word(g, uuid, tenant)?;
            t.board.set(word, generation, true);
            debug!(tenant = %t.ident.key, gpu = %uuid, generation, held = true, "grant word");
            // 0 is unbounded, which the `Welcome` said.
            let queue_ahead_us = (queue_ahead_ns > 0).then(|| (queue_ahead_ns / 1000).max(1));
            send(g, t, uuid, |gpu| DaemonMsg::Grant {
                gpu,
                generation,
                queue_ahead_us,
            });
            None
        }
        Effect::Revoke { tenant, generation } => {
            let (t, word) = tenant_word(g, uuid, tenant)?;
            t.board.set(word, generation, false);
            // After the revocation's store: a claim that does not name the grant means no
            // process launched under it (ADR 0030). Read after the claim: the time the
            // tenant stored before it.
            let claimed_at = t
                .board
                .claimed(word, generation)
                .then(|| t.board.claimed_at(word));
            let unclaimed = claimed_at.is_none();
            debug!(tenant = %t.ident.key, gpu = %uuid, generation, held = false, unclaimed, "grant word");
            let procs = send(g, t, uuid, |gpu| DaemonMsg::Revoke { gpu, generation });
            Some(Event::RevokeStored {
                tenant,
                generation,
                claimed_at,
                procs,
            })
        }
        Effect::Release { tenant, generation } => {
            let (t, word) = tenant_word(g, uuid, tenant)?;
            t.board.set(word, generation, false);
            None
        }
        Effect::Expiry {
            tenant,
            generation,
            at,
        } => {
            let (t, word) = tenant_word(g, uuid, tenant)?;
            t.board.set_expiry(word, generation, at);
            None
        }
        Effect::LookAtClaim { tenant, generation } => {
            // A tenant without a word (leaving) counts as claimed: nothing to withdraw.
            let claimed = tenant_word(g, uuid, tenant)
                .is_none_or(|(t, word)| t.board.claimed(word, generation));
            Some(Event::ClaimSeen {
                tenant,
                generation,
                claimed,
            })
        }
        Effect::WakeAt(_) => None,
    }
}

/// Sends `msg` (for the process's index of GPU `uuid`) to each process of tenant `t` that
/// uses the GPU; returns them.
fn send(g: &Inner, t: &TenantRec, uuid: &str, msg: impl Fn(u32) -> DaemonMsg) -> HashSet<u64> {
    let mut procs = HashSet::new();
    for c in &t.conns {
        let Some(conn) = g.conns.get(c).filter(|conn| conn.uses(uuid)) else {
            continue;
        };
        let gpu = u32::try_from(conn.index_of(uuid).unwrap_or(0)).unwrap_or(0);
        if conn.out.send(msg(gpu)).is_err() {
            warn!(conn = c, "writer gone");
        }
        procs.insert(*c);
    }
    procs
}
