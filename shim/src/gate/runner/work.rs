//! The gate thread's work between messages: it learns from the marker events which
//! launches completed (and the GPU time per launch), yields a slice the process stopped
//! using, drains the process's queued work when a slice ends, and runs the local
//! fallback's duty cycle.

use std::io::Write;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use vgpu_core::sched_proto::{GrantWord, ShimMsg, encode};
use vgpu_sys::{futex_wake, mono_ns};

use super::super::{
    CTX_LOCK, IDLE_TICKS, INFLIGHT_POLL, LOCAL_QUANTUM_NS, TICK, captures_open, sync_device,
};
use super::Runner;

/// Longest span between two completions seen that gives a host-polled sample of the GPU
/// time per launch (four ticks: a poll that ran late still counts).
const HOST_SAMPLE_MAX_NS: u64 = 4 * TICK.as_nanos() as u64;

/// Longest a drain waits for its markers while a capture is open ([`Runner::settle`]).
const SETTLE_MAX: Duration = Duration::from_secs(10);
/// Longest a revocation with device-side gating waits for the runs that started (ADR
/// 0034): the daemon's drain timeout.
const HELD_BACK_MAX: Duration = Duration::from_millis(500);

/// How a slice of this process ends ([`Runner::drain`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Ending {
    /// The daemon revoked it.
    Revoked,
    /// The process stopped launching: it yields the slice (reported as `Idle`).
    Idle,
    /// Past its expiry (ADR 0036), not revoked: the process yields it, reported as a
    /// drain with its blocked launches (`waiting`).
    Expired,
}

impl Runner {
    /// Learns which launches completed from the marker events (in order), and the GPU
    /// time per launch while the queue stayed busy.
    pub(super) fn poll_markers(&mut self) {
        for i in 0..self.devs.len() {
            self.poll_markers_of(i, false);
        }
    }

    /// [`Runner::poll_markers`] for GPU `i`. `synchronized`: called by a drain after its
    /// synchronization, when every marker is complete at once: the device-time samples
    /// of the slice's contiguous markers are taken (a slice of long kernels may end
    /// before the gate thread saw two of them complete), the host-polled ones are not
    /// (the poll time is the drain's, not the markers').
    fn poll_markers_of(&mut self, i: usize, synchronized: bool) {
        let gate = &self.g.gates[i];
        let mut advanced = false;
        // The observation of an earlier poll: a host-polled sample spans polls, never
        // completions this one finds together (see `host_sample`).
        let before = self.devs[i].last_obs;
        loop {
            let front = gate.markers().pending.front().copied();
            let Some(k) = front else {
                break;
            };
            let seq = k.seq;
            let (done, device) = {
                let _held = CTX_LOCK.read().unwrap_or_else(|p| p.into_inner());
                // A context destroyed since the copy took its markers, and their events,
                // away (`forget_context`, under the lock): look again.
                if gate
                    .markers()
                    .pending
                    .front()
                    .is_none_or(|f| f.event != k.event)
                {
                    continue;
                }
                let done = crate::driver::event_done(k.event);
                let last = gate.markers().last;
                // Device time between the previous marker's completion and this one's,
                // where no idle gap can be in it (see `Marker::contiguous`).
                let device = match last {
                    Some(a) if done && k.contiguous && k.seq > a.seq => {
                        crate::driver::event_elapsed_ns(a.event, k.event)
                            .map(|ns| (ns as f64, a.seq, k.seq - a.seq))
                    }
                    _ => None,
                };
                (done, device)
            };
            if !done {
                break;
            }
            {
                let mut m = gate.markers();
                if m.pending.front().is_some_and(|f| f.event == k.event) {
                    m.pending.pop_front();
                    if let Some(a) = m.last.replace(k) {
                        m.free.push((a.ctx, a.event));
                    }
                }
            }
            if let Some((span_ns, from, n)) = device {
                let d = &mut self.devs[i];
                let sample = span_ns / n as f64;
                // Launches of the grant held now (a pair across a grant's start spans
                // the wait for it, and is never contiguous; checked all the same).
                if d.holding.is_some() && from >= d.launched_at_grant {
                    d.measured.ns += span_ns;
                    d.measured.launches += n;
                }
                d.device_per_launch_ns = if d.device_per_launch_ns <= 0.0 {
                    sample
                } else {
                    0.8 * d.device_per_launch_ns + 0.2 * sample
                };
            }
            let now = mono_ns();
            let launched = gate.launched.load(Ordering::Relaxed);
            self.devs[i].last_obs = Some((now, seq, launched > seq));
            gate.completed.fetch_max(seq, Ordering::Relaxed);
            advanced = true;
        }
        if advanced && !synchronized {
            let d = &mut self.devs[i];
            if let Some(sample) = d
                .last_obs
                .and_then(|(now, seq, _)| host_sample(before, now, seq))
            {
                d.per_launch_ns = if d.per_launch_ns <= 0.0 {
                    sample
                } else {
                    0.8 * d.per_launch_ns + 0.2 * sample
                };
            }
        }
        if advanced {
            gate.markers_taken_off();
            // The queue ran dry at the bound: every launch made has completed (a launcher
            // out of budget marks its last launch), and the budget was spent; seen by this
            // poll, or by a launcher's look since the last one (`Gate::look`).
            let launched = gate.launched.load(Ordering::Relaxed);
            let looked_dry = gate.ran_dry.swap(false, Ordering::Relaxed);
            let ran_dry = !synchronized
                && (looked_dry
                    || (gate.markers().pending.is_empty()
                        && gate.completed.load(Ordering::Relaxed) >= launched
                        && launched >= gate.budget.load(Ordering::Relaxed)));
            self.set_allowed(i, ran_dry);
        }
        if cfg!(debug_assertions) && std::env::var_os("VGPU_GATE_DEBUG").is_some() {
            let m = gate.markers();
            crate::say!(
                "gate dbg: launched {} completed {} allowed {} budget {} next_mark {} every {} pending {} free {} created {} per {:.0}",
                gate.launched.load(Ordering::Relaxed),
                gate.completed.load(Ordering::Relaxed),
                gate.allowed.load(Ordering::Relaxed),
                gate.budget.load(Ordering::Relaxed),
                gate.next_mark.load(Ordering::Relaxed),
                gate.mark_every.load(Ordering::Relaxed),
                m.pending.len(),
                m.free.len(),
                m.created,
                self.devs[i].per_launch_ns
            );
        }
    }

    /// While holding: bound the queue, and yield a slice the process stopped using.
    pub(super) fn holding_tick(&mut self) {
        let now = mono_ns();
        for i in 0..self.devs.len() {
            let gate = &self.g.gates[i];
            let d = &mut self.devs[i];
            let Some(generation) = d.holding else {
                continue;
            };
            let launched = gate.launched.load(Ordering::Relaxed);
            if launched == d.last_launched
                && gate.waiting.load(Ordering::SeqCst) == 0
                && gate.budget_waiting.load(Ordering::SeqCst) == 0
                && gate.inflight.load(Ordering::SeqCst) == 0
                && gate.markers().pending.is_empty()
            {
                d.idle_ticks += 1;
            } else {
                d.idle_ticks = 0;
                d.last_launched = launched;
            }
            // Idle: no launch for IDLE_TICKS ticks and at least two launches' time.
            let ticks = IDLE_TICKS.max((2.0 * d.launch_cost_ns() / TICK.as_nanos() as f64) as u32);
            if d.idle_ticks >= ticks {
                self.drain(i, generation, Ending::Idle);
                continue;
            }
            // Past its expiry the daemon should have revoked it (another tenant waits) or
            // renewed it: a daemon starved of CPU or frozen does not keep the GPU for
            // this process (ADR 0036).
            if let Some(at) = gate.expiry(generation)
                && now >= at
            {
                let late = (now - at) / 1000;
                crate::process::log(self.shim, || {
                    format!(
                        "GPU {i} slice {generation}: expired {late} µs ago, not revoked by the daemon; yielding it"
                    )
                });
                self.drain(i, generation, Ending::Expired);
            }
        }
    }

    /// Ends this process's part of a slice: no new launches, in-flight ones finish,
    /// queued work completes; then reports when. With device-side gating (ADR 0034) a
    /// revocation closes the device-side word first and does not wait for the queue: the
    /// device stops each stream at its next wait (at most a run of launches on), the
    /// rest waits for the next grant, and the report says so (`waiting`: work queued).
    pub(super) fn drain(&mut self, i: usize, generation: u32, how: Ending) {
        let gate = &self.g.gates[i];
        let idle = how == Ending::Idle;
        // Ended here, not by the daemon: the word still says held.
        if how != Ending::Revoked {
            gate.yielded.store(generation, Ordering::SeqCst);
        }
        let held_back = !idle && gate.device_gated();
        if held_back {
            gate.set_device_open(false);
        }
        let t0 = Instant::now();
        while gate.inflight.load(Ordering::SeqCst) != 0 && t0.elapsed() < Duration::from_millis(200)
        {
            std::thread::sleep(INFLIGHT_POLL);
        }
        let inflight_wait = t0.elapsed();
        if held_back {
            // The runs that started on the device before the word closed go on to their
            // end (at most one per stream); the GPU is not handed over before they are
            // done. Bounded: a marker lost with its context, or (on the simulator, whose
            // streams share one queue) a run queued behind another stream's closed wait.
            while gate.started_work_pending() && t0.elapsed() < HELD_BACK_MAX {
                std::thread::sleep(INFLIGHT_POLL);
            }
            self.poll_markers_of(i, false);
            // The markers still pending whose runs did not start complete after the next
            // grant: the time between one of them and the marker before it spans the
            // wait for that grant, not the work's device time.
            gate.markers_not_contiguous();
        } else {
            self.settle(i);
        }
        let end = mono_ns();
        let sync_wait = t0.elapsed() - inflight_wait;
        if !held_back {
            self.poll_markers_of(i, true);
        }
        let gate = &self.g.gates[i];
        let d = &mut self.devs[i];
        let launched = gate.launched.load(Ordering::Relaxed);
        let held = end.saturating_sub(d.grant_at);
        // Held back on the device: the launches completed count (the rest belong to the
        // next grant, when they run). A grant that began with work held back counts that
        // work among its launches (`launched_at_grant` is where the revocation left the
        // count). Either way the busy time is the launches at their device time, as for
        // any grant: charging the whole hold charged a throttled tenant for the time its
        // gate thread took to report (device time per charged time 13-66 % for ten
        // CPU-limited tenants), and counted those grants full, which kept them from
        // co-holding.
        let counted = if held_back {
            gate.completed.load(Ordering::Relaxed).min(launched)
        } else {
            launched
        };
        let launches = counted.saturating_sub(d.launched_at_grant);
        let busy_ns = occupied_ns(launches, d.measured, d.device_per_launch_ns, held);
        d.measured = Measured::default();
        let per = d.device_per_launch_ns;
        crate::process::log(self.shim, || {
            format!(
                "GPU {i} slice {generation}: held {} µs, {launches} launches at {per:.0} ns of device time, busy {:?} µs; drain waited {} µs for launches in flight, {} µs to synchronize{}",
                held / 1000,
                busy_ns.map(|b| b / 1000),
                inflight_wait.as_micros(),
                sync_wait.as_micros(),
                match how {
                    Ending::Revoked => "",
                    Ending::Idle => " (yielded)",
                    Ending::Expired => " (expired)",
                }
            )
        });
        // Launches from now on belong to the next grant (none happen before it); so do
        // those held back on the device.
        d.launched_at_release = counted;
        d.reported = Some(generation);
        if !held_back {
            gate.all_completed();
        }
        d.last_obs = None;
        d.holding = None;
        d.idle_ticks = 0;
        let gpu = gate.proto.load(Ordering::Relaxed);
        // `waiting` is read under the writer lock, which launchers hold while they
        // count themselves and send a demand: no demand is lost between the two.
        let mut ctl = self.g.ctl();
        // Work held back on the device wants the GPU as a blocked launch does.
        let waiting = gate.waiting.load(Ordering::SeqCst) > 0
            || (held_back
                && gate.launched.load(Ordering::Relaxed) > gate.completed.load(Ordering::Relaxed));
        let msg = if idle {
            ShimMsg::Idle {
                gpu,
                generation,
                end_ns: end,
                launches,
                busy_ns,
            }
        } else {
            ShimMsg::Drained {
                gpu,
                generation,
                end_ns: end,
                launches,
                waiting,
                busy_ns,
                expired: how == Ending::Expired,
            }
        };
        if let Some(w) = ctl.as_mut() {
            let _ = w.write_all(&encode(&msg));
        }
    }

    /// Waits until the process's queued work on GPU `i` completed: the device
    /// synchronized, or, while an application's stream capture is open, every marker
    /// (a device synchronization would invalidate the capture, whichever thread makes
    /// it; every launch is marked meanwhile, ADR 0033). A marker that never completes
    /// is waited for at most `SETTLE_MAX`, then the drain goes on (and says so).
    fn settle(&mut self, i: usize) {
        if !captures_open() {
            sync_device(self.shim, i);
            return;
        }
        let gate = &self.g.gates[i];
        let t0 = Instant::now();
        loop {
            let done = {
                let _held = CTX_LOCK.read().unwrap_or_else(|p| p.into_inner());
                gate.markers()
                    .pending
                    .iter()
                    .all(|k| crate::driver::event_done(k.event))
            };
            if done {
                return;
            }
            if t0.elapsed() >= SETTLE_MAX {
                crate::process::log(self.shim, || {
                    format!(
                        "GPU {i}: queued work not complete after {SETTLE_MAX:?} during a capture; drained anyway"
                    )
                });
                return;
            }
            std::thread::sleep(INFLIGHT_POLL);
        }
    }

    /// Fallback: a duty cycle at the share, over measured time.
    pub(super) fn fallback_tick(&mut self) {
        let now = mono_ns();
        for i in 0..self.devs.len() {
            let gate = &self.g.gates[i];
            let d = &mut self.devs[i];
            let share = u64::from(d.settings.share_pct.clamp(1, 100));
            match d.holding {
                Some(_) if share >= 100 => {}
                Some(local) if now >= d.grant_at + LOCAL_QUANTUM_NS => {
                    let closed = GrantWord {
                        generation: GrantWord::next_generation(local),
                        held: false,
                    }
                    .pack();
                    gate.local.store(closed, Ordering::SeqCst);
                    let t0 = Instant::now();
                    while gate.inflight.load(Ordering::SeqCst) != 0
                        && t0.elapsed() < Duration::from_millis(200)
                    {
                        std::thread::sleep(INFLIGHT_POLL);
                    }
                    self.settle(i);
                    let d = &mut self.devs[i];
                    let end = mono_ns();
                    let used = end.saturating_sub(d.grant_at);
                    d.closed_until = end + used * (100 - share) / share;
                    d.local_gen = GrantWord::next_generation(local);
                    d.holding = None;
                    gate.all_completed();
                    d.last_obs = None;
                    let until = d.closed_until.saturating_sub(end) / 1000;
                    crate::process::log(self.shim, || {
                        format!(
                            "fallback: GPU {i} used {} µs, closed for {until} µs",
                            used / 1000
                        )
                    });
                }
                None if now >= d.closed_until => {
                    d.local_gen = GrantWord::next_generation(d.local_gen);
                    d.holding = Some(d.local_gen);
                    d.grant_at = now;
                    gate.local
                        .store(GrantWord::held(d.local_gen).pack(), Ordering::SeqCst);
                    futex_wake(&gate.local);
                }
                _ => {}
            }
        }
    }
}

/// A host-polled sample of the GPU time per launch, ns: from the completion an earlier
/// poll saw last (`before`: when, launch count, whether more was queued then) to the last
/// one this poll saw (`seq`, at `now`). None when there is no such earlier observation,
/// when the queue was empty at it (the span holds the launcher's pause), or over more
/// than `HOST_SAMPLE_MAX_NS` (a pause of the launcher, the GPU idle in it: such samples,
/// 5 to 30 times the GPU's time per launch in `shim-bench` on the simulator, shrank the
/// queue-ahead bound until launchers waited at it for a GPU that had nothing queued).
///
/// Never between two completions one poll finds together: their span is the poll's own
/// few microseconds, not the GPU's. A gate thread 5–10 ms late after a grant saw a graph's
/// first two markers at once, measured 3.2 µs for a 5 ms launch, allowed 625 launches
/// ahead, and the process queued 100 ms of work under a 20 % cap (ADR 0028).
pub(super) fn host_sample(before: Option<(u64, u64, bool)>, now: u64, seq: u64) -> Option<f64> {
    let (t0, s0, busy) = before?;
    let span = now.checked_sub(t0)?;
    (busy && seq > s0 && span > 0 && span <= HOST_SAMPLE_MAX_NS)
        .then(|| span as f64 / (seq - s0) as f64)
}

/// Device time measured between a grant's contiguous markers (see `Marker::contiguous`),
/// and the launches it covers.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(super) struct Measured {
    pub(super) ns: f64,
    pub(super) launches: u64,
}

/// Device time `launches` launches of one grant occupied: what was measured of them on
/// the device between the grant's own contiguous markers (`measured`), and the rest at
/// the grant's measured time per launch, or where it measured none at `per_launch_ns`
/// (the process's recent average; 0: not measured yet, None); at most the slice they ran
/// in (`held_ns`). Every launch counted ran within the grant: the drain completed them
/// before the report (or, device-side gating, counts only those complete). The GPU
/// idling between them (a launcher starved of CPU, a throttled container) is not in it.
/// The grant's own measure comes first: an average over past grants lags a tenant
/// turning from short kernels to long ones, and charged a capped tenant's first slices
/// of 5 ms kernels at 10 µs each (it then held 74 % of the GPU for 2.7 s).
pub(super) fn occupied_ns(
    launches: u64,
    measured: Measured,
    per_launch_ns: f64,
    held_ns: u64,
) -> Option<u64> {
    let valid = measured.ns.is_finite() && measured.ns >= 0.0;
    let covered = if valid {
        measured.launches.min(launches)
    } else {
        0
    };
    let (known, per) = if covered > 0 {
        let per = measured.ns / measured.launches as f64;
        (per * covered as f64, per)
    } else {
        (0.0, per_launch_ns)
    };
    let rest = launches - covered;
    if rest > 0 && (per <= 0.0 || !per.is_finite()) {
        return None;
    }
    let busy = (known + rest as f64 * per).min(held_ns as f64);
    Some(busy as u64)
}

#[cfg(test)]
mod tests {
    use super::{HOST_SAMPLE_MAX_NS, Measured, host_sample, occupied_ns};

    #[test]
    fn a_host_polled_sample_spans_two_polls_of_a_busy_queue() {
        // An earlier poll saw launch 10 complete at 1 ms with more queued; this one sees
        // launch 14 at 1.5 ms: 125 µs per launch.
        assert_eq!(
            host_sample(Some((1_000_000, 10, true)), 1_500_000, 14),
            Some(125_000.0)
        );
        // No earlier poll's observation: the first completions a poll finds give none,
        // however many it finds together.
        assert_eq!(host_sample(None, 1_500_000, 14), None);
        // The queue was empty at the earlier observation: the span holds a pause.
        assert_eq!(
            host_sample(Some((1_000_000, 10, false)), 1_500_000, 14),
            None
        );
        // Too long a span, no new completion, a clock that went backwards: none.
        let late = 1_000_000 + HOST_SAMPLE_MAX_NS + 1;
        assert_eq!(host_sample(Some((1_000_000, 10, true)), late, 14), None);
        assert_eq!(
            host_sample(Some((1_000_000, 14, true)), 1_500_000, 14),
            None
        );
        assert_eq!(
            host_sample(Some((1_500_000, 10, true)), 1_000_000, 14),
            None
        );
    }

    #[test]
    fn occupied_time_is_launches_at_their_device_time_within_the_slice() {
        let none = Measured::default();
        assert_eq!(
            occupied_ns(100, none, 10_000.0, 10_000_000),
            Some(1_000_000)
        );
        assert_eq!(
            occupied_ns(5_000, none, 10_000.0, 10_000_000),
            Some(10_000_000)
        );
        assert_eq!(occupied_ns(0, none, 10_000.0, 10_000_000), Some(0));
        assert_eq!(
            occupied_ns(100, none, 0.0, 10_000_000),
            None,
            "not measured"
        );
        assert_eq!(occupied_ns(100, none, f64::NAN, 10_000_000), None);
    }

    #[test]
    fn a_grants_own_measure_comes_before_the_average_of_past_grants() {
        // Eight 5 ms launches measured in this grant, the average still at 10 µs: all
        // eight at their measure, not 80 µs.
        let eight = Measured {
            ns: 40_000_000.0,
            launches: 8,
        };
        assert_eq!(
            occupied_ns(8, eight, 10_000.0, 45_000_000),
            Some(40_000_000)
        );
        // Launches the grant's markers did not cover go at the grant's own time per
        // launch (5 ms), within the slice.
        assert_eq!(
            occupied_ns(9, eight, 10_000.0, 60_000_000),
            Some(45_000_000)
        );
        assert_eq!(
            occupied_ns(16, eight, 10_000.0, 60_000_000),
            Some(60_000_000)
        );
        // Measured, the average unknown: known all the same.
        assert_eq!(occupied_ns(10, eight, 0.0, 60_000_000), Some(50_000_000));
        // More measured than counted (a marker counted by another path): the count's part.
        assert_eq!(
            occupied_ns(4, eight, 10_000.0, 60_000_000),
            Some(20_000_000)
        );
        // A garbage measure is ignored.
        let bad = Measured {
            ns: f64::NAN,
            launches: 8,
        };
        assert_eq!(occupied_ns(8, bad, 10_000.0, 60_000_000), Some(80_000));
    }
}
