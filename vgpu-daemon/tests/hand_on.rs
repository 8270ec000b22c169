//! Hand-on as the daemon carries it out (ADR 0026), driven through its own entry points
//! with its timer running: a revoked holder that has not reported its drain is passed
//! over after its queued work, and what it says while it is settling is not lost.

use super::common;

use std::time::{Duration, Instant};

use common::{GPU0, Proc, config, expect_slice, next_slice_msg, register};
use vgpu_core::sched_proto::ComputePolicy;
use vgpu_daemon::daemon::Daemon;
use vgpu_sys::mono_ns;

const MS: u64 = 1_000_000;

fn expect(p: &mut Proc, grant: bool, what: &str) -> u32 {
    expect_slice(p, grant, Duration::from_secs(5), what)
}

/// Reports the drain (or a yield) of grant `generation` of `p`: 2 launches of 1 ms.
fn drained(d: &Daemon, p: &Proc, generation: u32, waiting: bool) {
    d.released(
        p.reg.conn,
        0,
        generation,
        mono_ns(),
        Some(2 * MS),
        2,
        waiting,
    )
    .expect("report accepted");
}

#[test]
fn a_demand_made_while_the_holder_settles_survives_its_report() {
    let mut c = config();
    c.params.quantum_ns = 10 * MS;
    c.params.drain_timeout_ns = 10_000 * MS;
    c.params.handoff_queue_ns = MS;
    c.params.handoff_margin_ns = MS;
    // Exclusive slices: the reports below fill a fifth of each slice, which co-holding
    // (ADR 0029) would let the two tenants hold together.
    c.params.co_hold_fill_pct = 0;
    let d = Daemon::new(c);
    d.spawn_timer().expect("timer thread");
    let gpu = [(GPU0, 50, ComputePolicy::Burst, None)];
    let mut a = register(&d, 4_000_001, "ns/a/c", "ns", "a", "c", &gpu);
    let mut b = register(&d, 4_000_002, "ns/b/c", "ns", "b", "c", &gpu);

    // A slice each, reported on time: the daemon learns A's device time per launch.
    d.demand(a.reg.conn, 0, None).expect("demand");
    let g1 = expect(&mut a, true, "A's first grant");
    d.demand(b.reg.conn, 0, None).expect("demand");
    assert_eq!(expect(&mut a, false, "A's first revoke"), g1);
    drained(&d, &a, g1, true);
    let g2 = expect(&mut b, true, "B's first grant");
    assert_eq!(expect(&mut b, false, "B's first revoke"), g2);
    drained(&d, &b, g2, true);
    let g3 = expect(&mut a, true, "A's second grant");
    // A is revoked and does not report (its container is throttled): B gets the GPU
    // once A's queued work must be over.
    assert_eq!(expect(&mut a, false, "A's second revoke"), g3);
    let g4 = expect(&mut b, true, "B's grant without A's report");
    assert!(g4 > g3);
    // A's launcher blocks and asks; then its late report says nothing is blocked (the
    // launcher between two tries). Its demand must stand: A is granted again.
    d.demand(a.reg.conn, 0, Some(mono_ns())).expect("demand");
    drained(&d, &a, g3, false);
    let t0 = Instant::now();
    loop {
        assert!(
            t0.elapsed() < Duration::from_secs(2),
            "A, still asking, was not granted again within 2 s"
        );
        if let Some((g, true)) = next_slice_msg(&mut a, Duration::from_millis(20)) {
            assert!(g > g4);
            break;
        }
        if let Some((g, false)) = next_slice_msg(&mut b, Duration::from_millis(1)) {
            drained(&d, &b, g, true);
        }
    }
}
