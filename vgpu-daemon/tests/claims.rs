//! Claims as the daemon carries them out (ADR 0030), driven through its own entry points
//! with its timer running: the claim page beside each tenant's board; a throttled
//! holder that launches nothing under its grant loses it before the slice ends, without
//! its drain report; one that claimed keeps it, and is waited for; a page of garbage
//! changes nothing for the tenant's neighbour; every grant names its queue-ahead bound.

use super::common;

use std::os::fd::AsFd;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::{
    GPU0, Proc, config, expect_slice as expect, gpu, ident, next_slice_msg, next_slice_msg_queue,
    register,
};
use vgpu_core::sched_proto::{
    BOARD_BYTES, BOARD_STRIDE, CLAIM_TIME_OFFSET, ComputePolicy, DaemonMsg, GrantWord,
    PROTO_VERSION, Priority,
};
use vgpu_daemon::arbiter::{DEFAULT_MAX_QUEUE_AHEAD_NS, PREEMPTIBLE_QUEUE_AHEAD_NS};
use vgpu_daemon::daemon::Daemon;
use vgpu_sys::mono_ns;
use vgpu_sys::shm::SharedMap;

const MS: u64 = 1_000_000;
/// Slices long enough that anything within half of one is not the slice's end.
const QUANTUM_MS: u64 = 1000;

/// The tenant's claim page, as its processes map it (writable).
fn claim_page(p: &Proc) -> SharedMap {
    SharedMap::map(p.reg.board.claims_fd().as_fd(), BOARD_BYTES, true)
        .expect("the claim page maps writable")
}

/// The daemon with its timer: 1 s slices, a 10 s drain timeout (waiting for a report
/// would show), exclusive slices.
fn daemon() -> std::sync::Arc<Daemon> {
    let mut c = config();
    c.params.quantum_ns = QUANTUM_MS * MS;
    c.params.drain_timeout_ns = 10_000 * MS;
    c.params.co_hold_fill_pct = 0;
    let d = Daemon::new(c);
    d.spawn_timer().expect("timer thread");
    d
}

/// Tenants A (`ns/a/c`, process `pid`) and B (`pid + 1`) at 50/50, both containers
/// throttled by their CPU limits half of the time. A has run one slice alone of ten
/// 100 µs launches (looks are for holders whose launches were measured short); B's
/// launches are not measured (the GPU waits for its drain report: no hand-on).
fn two_throttled_tenants(d: &Daemon, pid: u32) -> (Proc, Proc) {
    let gpu = [(GPU0, 50, ComputePolicy::Burst, None)];
    let mut a = register(d, pid, "ns/a/c", "ns", "a", "c", &gpu);
    let b = register(d, pid + 1, "ns/b/c", "ns", "b", "c", &gpu);
    for p in [pid, pid + 1] {
        d.note_stopped(tid_of(d, p), 0.5, Some(100 * MS));
    }
    d.demand(a.reg.conn, 0, None).expect("demand");
    let g = expect(&mut a, true, Duration::from_secs(5), "a slice alone");
    d.released(a.reg.conn, 0, g, mono_ns(), Some(MS), 10, false)
        .expect("report accepted");
    (a, b)
}

/// A asks and is granted; B asks; A launches nothing under its grant (its container
/// stopped, or its page says nothing of that grant): within half a slice A's grant is
/// taken back and B's comes, without A's report. Their generations.
fn a_withdrawn_for_b(d: &Daemon, a: &mut Proc, b: &mut Proc) -> (u32, u32) {
    d.demand(a.reg.conn, 0, None).expect("demand");
    let ga = expect(a, true, Duration::from_secs(5), "A's grant");
    d.demand(b.reg.conn, 0, None).expect("demand");
    let half = Duration::from_millis(QUANTUM_MS / 2);
    assert_eq!(expect(a, false, half, "A's withdrawal"), ga);
    let gb = expect(b, true, half, "B's grant without A's report");
    (ga, gb)
}

/// The byte offset of the process's claim word for its first GPU in its claim page.
fn claim_offset(p: &Proc) -> usize {
    match p.reg.welcome {
        DaemonMsg::Welcome { ref words, .. } => words[0] as usize * BOARD_STRIDE,
        _ => panic!("not welcomed"),
    }
}

fn tid_of(d: &Daemon, pid: u32) -> u64 {
    d.tenant_pids()
        .into_iter()
        .find(|(_, p)| *p == pid)
        .map(|(t, _)| t)
        .expect("registered")
}

fn unclaimed_grants(d: &Daemon, key: &str) -> u64 {
    d.snapshot()
        .tenants
        .iter()
        .find(|t| t.key == key)
        .map_or(0, |t| t.gpus[0].unclaimed_grants)
}

fn drained(d: &Daemon, p: &Proc, generation: u32, waiting: bool) {
    d.released(p.reg.conn, 0, generation, mono_ns(), Some(0), 0, waiting)
        .expect("report accepted");
}

#[test]
fn a_throttled_holder_that_launches_nothing_loses_its_grant_and_one_that_launched_keeps_it() {
    let d = daemon();
    let (mut a, mut b) = two_throttled_tenants(&d, 5_000_001);
    let (ga, gb) = a_withdrawn_for_b(&d, &mut a, &mut b);
    assert_eq!(unclaimed_grants(&d, "ns/a/c"), 1);
    let half = Duration::from_millis(QUANTUM_MS / 2);
    // A's launcher asks again before its report: it waits, whatever B does.
    d.demand(a.reg.conn, 0, None).expect("demand");
    // B launches (its claim names its grant): kept past the look, to its slice's end.
    let bp = claim_page(&b);
    bp.atomic_u32(claim_offset(&b))
        .store(GrantWord::held(gb).pack(), Ordering::SeqCst);
    assert_eq!(
        next_slice_msg(&mut b, half),
        None,
        "B, having launched, lost its grant before its slice ended"
    );
    // A's container runs: it reports nothing ran, still asking, and owed it takes the
    // lent slice back. B claimed: the GPU waits for B's report (no hand-on: B's
    // launches were never measured), and A is not granted before it.
    drained(&d, &a, ga, true);
    assert_eq!(
        expect(&mut b, false, Duration::from_secs(5), "B's revoke for A"),
        gb
    );
    assert_eq!(
        next_slice_msg(&mut a, Duration::from_millis(300)),
        None,
        "A was granted while B's claimed grant was still draining"
    );
    drained(&d, &b, gb, false);
    let ga2 = expect(
        &mut a,
        true,
        Duration::from_secs(5),
        "A's grant after B's report",
    );
    assert!(ga2 > gb);
    assert_eq!(unclaimed_grants(&d, "ns/b/c"), 0);
}

#[test]
fn a_claim_page_of_garbage_changes_nothing_for_the_neighbour() {
    let d = daemon();
    let (mut a, mut b) = two_throttled_tenants(&d, 5_000_011);
    // A scribbles over its whole page, every word a held word of some grant.
    let ap = claim_page(&a);
    for i in 0..BOARD_BYTES / 4 {
        ap.atomic_u32(i * 4)
            .store((i as u32).wrapping_mul(2_654_435_761) | 1, Ordering::SeqCst);
    }
    // No claim of A's grant in the garbage: A loses it, B gets the GPU.
    let (ga, gb) = a_withdrawn_for_b(&d, &mut a, &mut b);
    // A, having lied, ran 100 ms of work after all, and says so when its drain ends:
    // charged in full.
    let before = d.snapshot();
    std::thread::sleep(Duration::from_millis(120));
    let used = |s: &vgpu_daemon::model::NodeSnapshot, k: &str| {
        s.tenants
            .iter()
            .find(|t| t.key == k)
            .map_or(0, |t| t.gpus[0].gpu_time_ns)
    };
    let end = mono_ns();
    d.released(a.reg.conn, 0, ga, end, Some(100 * MS), 1, false)
        .expect("report accepted");
    assert_eq!(
        used(&d.snapshot(), "ns/a/c") - used(&before, "ns/a/c"),
        100 * MS
    );
    // B holds on, untouched.
    assert_eq!(next_slice_msg(&mut b, Duration::from_millis(100)), None);
    assert_eq!(
        d.snapshot()
            .tenants
            .iter()
            .find(|t| t.key == "ns/b/c")
            .map(|t| t.gpus[0].state),
        Some(vgpu_daemon::model::SliceState::Holding),
        "B granted {gb}"
    );
}

/// A tenant whose launches start late under its grants (each claim dated 15 ms after
/// its grant came, as a launcher waiting for a CPU dates it) gets longer slices: four
/// times that, up to four quanta, read through the daemon's own view (`vgpuctl`, the
/// API); its neighbour, which claims at once, keeps shorter ones. Its grants name a
/// deeper queue-ahead bound (twice its waits, at most the `Welcome`'s, ADR 0032); its
/// neighbour's stay near the shims' own.
#[test]
fn a_tenant_slow_to_start_under_its_grants_gets_longer_slices() {
    const Q: u64 = 20 * MS;
    let mut c = config();
    c.params.quantum_ns = Q;
    c.params.drain_timeout_ns = 10_000 * MS;
    c.params.co_hold_fill_pct = 0;
    let d = Daemon::new(c);
    d.spawn_timer().expect("timer thread");
    let gpu = [(GPU0, 50, ComputePolicy::Burst, None)];
    let mut a = register(&d, 5_000_031, "ns/a/c", "ns", "a", "c", &gpu);
    let mut b = register(&d, 5_000_032, "ns/b/c", "ns", "b", "c", &gpu);
    let (ap, bp) = (claim_page(&a), claim_page(&b));
    let (wa, wb) = (claim_offset(&a), claim_offset(&b));
    let slice = |key: &str| {
        d.snapshot()
            .tenants
            .iter()
            .find(|t| t.key == key)
            .map_or(0, |t| t.gpus[0].slice_ns)
    };
    assert_eq!(
        slice("ns/a/c"),
        Q,
        "one quantum before anything is measured"
    );
    d.demand(a.reg.conn, 0, None).expect("demand");
    d.demand(b.reg.conn, 0, None).expect("demand");
    let base = config().params.queue_ahead_ns / 1000;
    for p in [&a, &b] {
        match &p.reg.welcome {
            DaemonMsg::Welcome { queue_ahead_us, .. } => assert_eq!(
                *queue_ahead_us,
                DEFAULT_MAX_QUEUE_AHEAD_NS / 1000,
                "the Welcome names the deepest bound"
            ),
            other => panic!("not a Welcome: {other:?}"),
        }
    }
    let mut queues: [Vec<Option<u64>>; 2] = [Vec::new(), Vec::new()];
    let mut a_revoked = 0;
    let t0 = Instant::now();
    while a_revoked < 5 {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "A's grant was revoked {a_revoked} times in 30 s"
        );
        for (k, p, page, w, late) in [(0, &mut a, &ap, wa, 15 * MS), (1, &mut b, &bp, wb, 0)] {
            match next_slice_msg_queue(p, Duration::from_millis(2)) {
                Some((g, true, q)) => {
                    queues[k].push(q);
                    // The claim and, before it, its time.
                    page.atomic_u64(w + CLAIM_TIME_OFFSET)
                        .store(mono_ns() + late, Ordering::Relaxed);
                    page.atomic_u32(w)
                        .store(GrantWord::held(g).pack(), Ordering::SeqCst);
                }
                Some((g, false, _)) => {
                    a_revoked += u32::from(late > 0);
                    d.released(p.reg.conn, 0, g, mono_ns(), Some(MS), 10, true)
                        .expect("report accepted");
                }
                None => {}
            }
        }
    }
    let (sa, sb) = (slice("ns/a/c"), slice("ns/b/c"));
    assert!(
        (50 * MS..=4 * Q).contains(&sa),
        "A, its launches 15 ms late: slices of {sa} ns (quantum {Q})"
    );
    assert!(sb < sa, "B, claiming at once: slices of {sb} ns, A's {sa}");
    assert_eq!(
        queues[0].last(),
        Some(&Some(DEFAULT_MAX_QUEUE_AHEAD_NS / 1000)),
        "A's grants' bounds: {:?}",
        queues[0]
    );
    // B claims within this loop's polling (a few ms): its bounds stay under A's.
    assert_eq!(
        queues[1].first(),
        Some(&Some(base)),
        "B: nothing measured yet"
    );
    assert!(
        queues[1]
            .iter()
            .all(|q| q.is_some_and(|q| q < DEFAULT_MAX_QUEUE_AHEAD_NS / 1000)),
        "B's grants' bounds: {:?}",
        queues[1]
    );
}

/// A best-effort tenant granted the GPU while a latency-sensitive tenant is registered
/// on it (idle) is told the short bound (300 µs), by the scheduler that counts it, and
/// shown it.
#[test]
fn a_best_effort_grant_beside_a_latency_sensitive_tenant_names_the_short_bound() {
    let d = Daemon::new(config());
    let mut ls = gpu(GPU0, 0, 50);
    ls.settings.priority = Priority::LatencySensitive;
    let (tx, _ls_rx) = tokio::sync::mpsc::unbounded_channel();
    d.register(5_000_041, PROTO_VERSION, ident("ns/ls/c"), vec![ls], tx)
        .expect("registration accepted");
    let gpus = [(GPU0, 50, ComputePolicy::Burst, None)];
    let mut b = register(&d, 5_000_042, "ns/b/c", "ns", "b", "c", &gpus);
    d.demand(b.reg.conn, 0, None).expect("demand");
    match next_slice_msg_queue(&mut b, Duration::from_secs(2)) {
        Some((_, true, q)) => assert_eq!(
            q,
            Some(PREEMPTIBLE_QUEUE_AHEAD_NS / 1000),
            "the best-effort grant's bound"
        ),
        other => panic!("no grant to the best-effort tenant: {other:?}"),
    }
    let snap = d.snapshot();
    let shown = snap
        .tenants
        .iter()
        .find(|t| t.key == "ns/b/c")
        .map(|t| t.gpus[0].queue_ahead_ns);
    assert_eq!(shown, Some(PREEMPTIBLE_QUEUE_AHEAD_NS));
}
