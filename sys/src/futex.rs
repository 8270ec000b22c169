//! Futexes on a shared `u32` word: a waiter sleeps while the word holds the value it
//! saw, a writer changes the word and wakes every waiter. Shared (not `PRIVATE`)
//! futexes, so that waiter and waker may be different processes mapping the same page
//! (the daemon's board and the shims, the processes of cuda-sim's node).

use std::io;
use std::sync::atomic::AtomicU32;
use std::time::Duration;

/// Waits while `*word == expected`, at most `timeout`. Returns false when the timeout
/// passed, true otherwise (woken, the word already differed, or a signal): callers
/// re-read the word either way.
pub fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) -> bool {
    let ts = libc::timespec {
        tv_sec: libc::time_t::try_from(timeout.as_secs()).unwrap_or(libc::time_t::MAX),
        tv_nsec: libc::c_long::from(timeout.subsec_nanos()),
    };
    // SAFETY: `word` is a valid, aligned u32 for the whole call (a reference to it is
    // held), in process memory or a shared mapping; FUTEX_WAIT only reads it. `ts` is a
    // valid relative timeout. Not PRIVATE: the waker may be another process.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
        )
    };
    !(rc != 0 && io::Error::last_os_error().raw_os_error() == Some(libc::ETIMEDOUT))
}

/// Wakes every waiter on `word`.
pub fn futex_wake(word: &AtomicU32) {
    // SAFETY: `word` is a valid, aligned u32 for the whole call; FUTEX_WAKE does not
    // touch the memory and has no other preconditions.
    unsafe { libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX) };
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::Ordering;
    use std::time::Instant;

    use super::*;

    #[test]
    fn a_wait_on_an_unchanged_word_times_out() {
        let w = AtomicU32::new(7);
        let t = Instant::now();
        assert!(!futex_wait(&w, 7, Duration::from_millis(20)));
        assert!(t.elapsed() >= Duration::from_millis(19));
    }

    #[test]
    fn a_wait_on_a_changed_word_returns_at_once() {
        let w = AtomicU32::new(7);
        assert!(futex_wait(&w, 8, Duration::from_secs(10)));
    }

    #[test]
    fn a_wake_ends_the_wait() {
        let w = Arc::new(AtomicU32::new(0));
        let waker = {
            let w = Arc::clone(&w);
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(20));
                w.store(1, Ordering::SeqCst);
                futex_wake(&w);
            })
        };
        let t = Instant::now();
        while w.load(Ordering::SeqCst) == 0 {
            futex_wait(&w, 0, Duration::from_secs(10));
        }
        assert!(t.elapsed() < Duration::from_secs(5));
        waker.join().expect("waker");
    }
}
