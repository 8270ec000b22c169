//! The node's monotonic clock: `CLOCK_MONOTONIC` in ns as the host reads it, so that times
//! taken in different processes (a shim's report, the daemon's scheduler, cuda-sim's
//! engine) compare directly.
//!
//! A process in a time namespace (`time_namespaces(7)`; a container runtime may give one
//! a monotonic offset) reads `CLOCK_MONOTONIC` shifted by its namespace's offset. The
//! offset is read once per process from `/proc/self/timens_offsets` and taken off, so
//! every process of the node reads the same clock ([`mono_ns`]), and absolute sleeps on
//! that clock are put back into the process's own ([`sleep_until`]) (ADR 0038). Without
//! the file (no time namespaces, no `/proc`) the offset is 0. A process that unshared a
//! time namespace itself and has not yet executed or forked still runs in its former one,
//! whose offset it cannot read: 0 is taken then.

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};

/// The offset of this process's time namespace's `CLOCK_MONOTONIC` from the host's, ns,
/// once [`OFFSET_READ`] says it was read. Two atomics, not a `OnceLock`: a lock held by a
/// thread that another one forks beside would leave the child waiting on it forever,
/// and the shim runs in applications that fork; racing readers compute the same value.
static OFFSET_NS: AtomicI64 = AtomicI64::new(0);
/// Whether [`OFFSET_NS`] was read.
static OFFSET_READ: AtomicBool = AtomicBool::new(false);

/// The host's `CLOCK_MONOTONIC`, ns: this process's reading less its time namespace's
/// offset.
pub fn mono_ns() -> u64 {
    local_ns().saturating_add_signed(offset_ns().saturating_neg())
}

/// Sleeps until the host's monotonic clock ([`mono_ns`]) reads `deadline` ns, or a
/// signal comes: callers that must not wake early check [`mono_ns`] and sleep again.
pub fn sleep_until(deadline: u64) {
    let local = deadline.saturating_add_signed(offset_ns());
    let ts = libc::timespec {
        tv_sec: libc::time_t::try_from(local / 1_000_000_000).unwrap_or(libc::time_t::MAX),
        tv_nsec: libc::c_long::try_from(local % 1_000_000_000).unwrap_or(0),
    };
    // SAFETY: a valid absolute timespec on CLOCK_MONOTONIC (the process's own reading,
    // which the kernel takes in its time namespace); a null remainder is allowed.
    unsafe {
        libc::clock_nanosleep(
            libc::CLOCK_MONOTONIC,
            libc::TIMER_ABSTIME,
            &ts,
            std::ptr::null_mut(),
        )
    };
}

/// `CLOCK_MONOTONIC` as this process reads it, ns.
fn local_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_MONOTONIC always exists on
    // Linux, so the call cannot fail and fills `ts`.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    u64::try_from(ts.tv_sec).unwrap_or(0) * 1_000_000_000 + u64::try_from(ts.tv_nsec).unwrap_or(0)
}

/// This process's time namespace's monotonic offset, ns (read once, never waited for).
fn offset_ns() -> i64 {
    if OFFSET_READ.load(Ordering::Acquire) {
        return OFFSET_NS.load(Ordering::Relaxed);
    }
    let v = read_offset_ns();
    OFFSET_NS.store(v, Ordering::Relaxed);
    OFFSET_READ.store(true, Ordering::Release);
    v
}

/// Reads the offset from `/proc/self/timens_offsets`, which shows the namespace of the
/// process's future children: its own only while the two are the same namespace.
fn read_offset_ns() -> i64 {
    let ns = |name: &str| std::fs::read_link(format!("/proc/self/ns/{name}")).ok();
    let own = ns("time");
    if own.is_none() || own != ns("time_for_children") {
        return 0;
    }
    std::fs::read_to_string("/proc/self/timens_offsets")
        .ok()
        .and_then(|s| monotonic_offset_ns(&s).ok())
        .unwrap_or(0)
}

/// The monotonic offset in the text of a `timens_offsets` file, ns: the line
/// `monotonic <seconds> <nanoseconds>` (the kernel names the clock; a number, 1 for
/// `CLOCK_MONOTONIC`, is taken too). An error names what is wrong.
pub fn monotonic_offset_ns(text: &str) -> Result<i64, String> {
    for line in text.lines() {
        let mut f = line.split_whitespace();
        let clock = f.next();
        if !matches!(clock, Some("monotonic" | "1")) {
            continue;
        }
        let num = |v: Option<&str>, what: &str| -> Result<i64, String> {
            let v = v.ok_or_else(|| format!("timens_offsets line {line:?}: no {what}"))?;
            v.parse::<i64>()
                .map_err(|_| format!("timens_offsets line {line:?}: bad {what} {v:?}"))
        };
        let secs = num(f.next(), "seconds")?;
        let nanos = num(f.next(), "nanoseconds")?;
        if !(0..1_000_000_000).contains(&nanos) {
            return Err(format!(
                "timens_offsets line {line:?}: nanoseconds {nanos} out of 0..1e9"
            ));
        }
        return secs
            .checked_mul(1_000_000_000)
            .and_then(|s| s.checked_add(nanos))
            .ok_or_else(|| format!("timens_offsets line {line:?}: offset {secs} s overflows"));
    }
    Err("timens_offsets: no monotonic line".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn never_goes_back_and_keeps_pace_with_std() {
        let a = mono_ns();
        let t = std::time::Instant::now();
        std::thread::sleep(std::time::Duration::from_millis(5));
        let b = mono_ns();
        assert!(b >= a + 5_000_000, "{a} then {b}");
        assert!(b - a <= t.elapsed().as_nanos() as u64 + 1_000_000);
    }

    #[test]
    fn sleeps_until_the_deadline_on_the_nodes_clock() {
        let deadline = mono_ns() + 3_000_000;
        while mono_ns() < deadline {
            sleep_until(deadline);
        }
        // Not long after it either (a loaded machine may be late by a scheduling delay).
        assert!(mono_ns() < deadline + 1_000_000_000);
    }

    #[test]
    fn reads_the_monotonic_offset_and_names_what_is_wrong() {
        let ok = "monotonic        1000         0\nboottime            0         0\n";
        assert_eq!(monotonic_offset_ns(ok), Ok(1_000_000_000_000));
        assert_eq!(
            monotonic_offset_ns("boottime 5 0\nmonotonic -100 250\n"),
            Ok(-99_999_999_750)
        );
        assert_eq!(monotonic_offset_ns("1 2 3"), Ok(2_000_000_003));
        for (bad, says) in [
            ("", "no monotonic line"),
            ("boottime 1 0", "no monotonic line"),
            ("monotonic x 0", "bad seconds \"x\""),
            ("monotonic 1", "no nanoseconds"),
            ("monotonic 1 1000000000", "out of 0..1e9"),
            ("monotonic 9223372036854775807 0", "overflows"),
        ] {
            let e = monotonic_offset_ns(bad).expect_err(bad);
            assert!(e.contains(says), "{bad:?}: {e}");
        }
    }
}
