//! The node's monotonic clock: `CLOCK_MONOTONIC` in ns, system-wide, so that times taken
//! in different processes (a shim's report, the daemon's scheduler, cuda-sim's engine)
//! compare directly.

/// `CLOCK_MONOTONIC`, ns.
pub fn mono_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_MONOTONIC always exists on
    // Linux, so the call cannot fail and fills `ts`.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    u64::try_from(ts.tv_sec).unwrap_or(0) * 1_000_000_000 + u64::try_from(ts.tv_nsec).unwrap_or(0)
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
}
