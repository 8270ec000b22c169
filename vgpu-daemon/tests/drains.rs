//! Drains of a tenant of several processes as the daemon carries them out, driven through
//! its own entry points with its timer running: what its processes reported of a grant
//! before the daemon revoked it counts, and the GPU waits only for the others.

use super::common;

use std::os::fd::AsFd;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use common::{GPU0, Proc, config, expect_slice, register};
use vgpu_core::sched_proto::{BOARD_BYTES, BOARD_STRIDE, ComputePolicy, DaemonMsg, GrantWord};
use vgpu_daemon::daemon::Daemon;
use vgpu_sys::mono_ns;
use vgpu_sys::shm::SharedMap;

const MS: u64 = 1_000_000;
/// Every tenant's registration: GPU 0, 50 %, burst.
const GPU: [(&str, u32, ComputePolicy, Option<u64>); 1] = [(GPU0, 50, ComputePolicy::Burst, None)];

/// A daemon with its timer (slices of `quantum_ms`, a 10 s drain timeout: waiting for a
/// report that never comes would show, exclusive slices), and tenant A (`ns/a/c`) of two
/// processes (`pid`, `pid + 1`), granted: both processes got the grant (its generation).
fn granted_two_process_tenant(quantum_ms: u64, pid: u32) -> (Arc<Daemon>, Proc, Proc, u32) {
    let mut c = config();
    c.params.quantum_ns = quantum_ms * MS;
    c.params.drain_timeout_ns = 10_000 * MS;
    c.params.co_hold_fill_pct = 0;
    let d = Daemon::new(c);
    d.spawn_timer().expect("timer thread");
    let mut a1 = register(&d, pid, "ns/a/c", "ns", "a", "c", &GPU);
    let mut a2 = register(&d, pid + 1, "ns/a/c", "ns", "a", "c", &GPU);
    let within = Duration::from_secs(5);
    d.demand(a1.reg.conn, 0, None).expect("demand");
    let g = expect_slice(&mut a1, true, within, "A's grant to its first process");
    assert_eq!(
        expect_slice(&mut a2, true, within, "A's grant to its second process"),
        g
    );
    (d, a1, a2, g)
}

/// One process of a two-process tenant yields the grant (it stopped launching), the
/// other still holds it when its slice ends with another tenant waiting. The revoke must
/// not forget the yield: that process reported the grant already and its shim does not
/// report it again, so a drain that waited for it waited for the drain timeout (the GPU
/// idle, the tenant charged the whole wait). A launcher off its CPU for two milliseconds
/// yields: on a busy node, any tenant of several processes.
#[test]
fn a_revoke_during_a_tenants_partial_yield_waits_only_for_its_processes_yet_to_report() {
    let (d, mut a1, mut a2, g) = granted_two_process_tenant(50, 5_000_001);
    let mut b = register(&d, 5_000_003, "ns/b/c", "ns", "b", "c", &GPU);
    let within = Duration::from_secs(5);
    // The first process launches under it: it claims the grant in the tenant's claim
    // page, as its shim does (ADR 0030; an unclaimed grant's revoke waits for nobody).
    claim(&a1, g);
    // The second process stops launching: it yields the grant; the first holds on.
    d.released(a2.reg.conn, 0, g, mono_ns(), Some(MS), 1, false)
        .expect("yield accepted");
    // B asks: A's slice ends in a revoke, sent to both of A's processes.
    d.demand(b.reg.conn, 0, None).expect("demand");
    assert_eq!(expect_slice(&mut a1, false, within, "A's revoke"), g);
    assert_eq!(
        expect_slice(&mut a2, false, within, "A's revoke, second process"),
        g
    );
    // Only the first process reports the revoke (the second reported this grant).
    d.released(a1.reg.conn, 0, g, mono_ns(), Some(20 * MS), 40, true)
        .expect("drain accepted");
    let gb = expect_slice(
        &mut b,
        true,
        Duration::from_secs(1),
        "B's grant once A's last process reported",
    );
    assert!(gb > g);
    // A is charged what its processes ran (21 ms reported, within the slice), not a
    // drain that waited.
    let a = d
        .snapshot()
        .tenants
        .into_iter()
        .find(|t| t.key == "ns/a/c")
        .expect("A listed");
    let charged = a.gpus[0].gpu_time_ns;
    assert!(
        charged <= 60 * MS,
        "A charged {} ms for a 50 ms slice of which its processes ran 21 ms",
        charged / MS
    );
}

/// Alone on the GPU, a tenant of two processes: one yields the grant (it paused), the
/// other keeps it. When the first asks again, it must get to launch again, though its
/// sibling never stops.
#[test]
fn a_process_that_yielded_its_tenants_grant_gets_back_in_while_its_sibling_holds() {
    let (d, mut a1, mut a2, g) = granted_two_process_tenant(20, 5_100_001);
    d.released(a2.reg.conn, 0, g, mono_ns(), Some(MS), 1, false)
        .expect("yield accepted");
    // Its launcher blocks again (its shim yielded g: it may not launch under it).
    d.demand(a2.reg.conn, 0, Some(mono_ns())).expect("demand");
    // Whatever the daemon does, the second process must be granted again; the first
    // reports what it is asked to (it never stops launching).
    granted_again(
        &d,
        &mut a2,
        g,
        Duration::from_secs(2),
        "the process that yielded",
        &mut [(&mut a1, 10 * MS)],
    );
}

/// Waits (at most `within`) for process `p` to be granted a generation after `after`,
/// the `others` meanwhile reporting each revoke they get, as busy as said (ns), as
/// processes that never stop launching do.
fn granted_again(
    d: &Daemon,
    p: &mut Proc,
    after: u32,
    within: Duration,
    what: &str,
    others: &mut [(&mut Proc, u64)],
) {
    let t0 = std::time::Instant::now();
    loop {
        assert!(
            t0.elapsed() < within,
            "{what} was not granted again within {within:?}"
        );
        if let Some((g2, true)) = common::next_slice_msg(p, Duration::from_millis(5)) {
            assert!(g2 > after);
            return;
        }
        for (o, busy) in others.iter_mut() {
            if let Some((gr, false)) = common::next_slice_msg(o, Duration::from_millis(1)) {
                d.released(o.reg.conn, 0, gr, mono_ns(), Some(*busy), 10, true)
                    .expect("drain accepted");
            }
        }
    }
}

/// Claims grant `g` in process `p`'s tenant's claim page, as its shim does when it
/// launches under it (ADR 0030).
fn claim(p: &Proc, g: u32) {
    let word = match p.reg.welcome {
        DaemonMsg::Welcome { ref words, .. } => words[0] as usize,
        _ => panic!("not welcomed"),
    };
    let claims = SharedMap::map(p.reg.board.claims_fd().as_fd(), BOARD_BYTES, true)
        .expect("the claim page maps writable");
    claims
        .atomic_u32(word * BOARD_STRIDE)
        .store(GrantWord::held(g).pack(), Ordering::SeqCst);
}

/// The same for a tenant co-held beside another (ADR 0029): both containers stopped by
/// their CPU limits most of the time, both of low measured use. One process of the
/// co-held tenant yields the co-grant, its sibling holds on, and the first asks again:
/// it must be granted again soon, not at the co-holders' refresh (ten of the holder's
/// slices, 2 s here) while the holder alone is renewed.
#[test]
fn a_process_that_yielded_its_co_held_tenants_grant_gets_back_in_while_its_sibling_holds() {
    let mut c = config();
    c.params.quantum_ns = 200 * MS;
    c.params.drain_timeout_ns = 10_000 * MS;
    c.params.queue_ahead_ns = 2 * MS;
    let d = Daemon::new(c);
    d.spawn_timer().expect("timer thread");
    let within = Duration::from_secs(5);
    let mut b = register(&d, 5_200_001, "ns/b/c", "ns", "b", "c", &GPU);
    let mut a1 = register(&d, 5_200_002, "ns/a/c", "ns", "a", "c", &GPU);
    let mut a2 = register(&d, 5_200_003, "ns/a/c", "ns", "a", "c", &GPU);
    let ids = d.tenant_pids();
    let tenant_id = |pid: u32| {
        ids.iter()
            .find(|(_, p)| *p == pid)
            .map(|(t, _)| *t)
            .expect("registered")
    };
    let (ta, tb) = (tenant_id(5_200_002), tenant_id(5_200_001));
    // Each tenant holds the GPU once alone and uses 1 ms of it: its use is measured.
    for p in [&mut b, &mut a1] {
        d.demand(p.reg.conn, 0, None).expect("demand");
    }
    let gb = expect_slice(&mut b, true, within, "B's first grant");
    claim(&b, gb);
    std::thread::sleep(Duration::from_millis(20));
    d.released(b.reg.conn, 0, gb, mono_ns(), Some(MS), 10, false)
        .expect("B's yield");
    let ga = expect_slice(&mut a1, true, within, "A's first grant");
    assert_eq!(
        expect_slice(&mut a2, true, within, "A's first grant, 2"),
        ga
    );
    claim(&a1, ga);
    std::thread::sleep(Duration::from_millis(20));
    for p in [&a1, &a2] {
        d.released(p.reg.conn, 0, ga, mono_ns(), Some(MS / 2), 5, false)
            .expect("A's yield");
    }
    // Both containers are stopped 80 % of each 100 ms period (the kernel's figure).
    for t in [ta, tb] {
        d.note_stopped(t, 0.8, Some(100 * MS));
    }
    // B holds, A is co-granted beside it.
    d.demand(b.reg.conn, 0, None).expect("demand");
    let gb = expect_slice(&mut b, true, within, "B's grant");
    claim(&b, gb);
    d.demand(a1.reg.conn, 0, None).expect("demand");
    let ga = expect_slice(&mut a1, true, within, "A's co-grant");
    assert_eq!(expect_slice(&mut a2, true, within, "A's co-grant, 2"), ga);
    claim(&a1, ga);
    let co = d.snapshot();
    assert!(
        co.tenants
            .iter()
            .any(|t| t.key == "ns/a/c" && t.gpus[0].co_held),
        "A not co-held beside B: {co:?}"
    );
    // The second process yields A's co-grant, then asks again.
    d.released(a2.reg.conn, 0, ga, mono_ns(), Some(MS / 4), 2, false)
        .expect("yield accepted");
    d.demand(a2.reg.conn, 0, Some(mono_ns())).expect("demand");
    granted_again(
        &d,
        &mut a2,
        ga,
        Duration::from_secs(1),
        "the process that yielded the co-grant",
        &mut [(&mut a1, MS), (&mut b, MS)],
    );
}
