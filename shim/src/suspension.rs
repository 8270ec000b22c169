//! Resume on call (issue 43, ADRs 0066 and 0070): before each intercepted CUDA call, one
//! atomic load of the tenant's suspension word in the daemon's board
//! ([`vgpu_core::suspension`]). While it says the container is suspended, the calling
//! thread asks the daemon to resume it (a `Resume` frame on a short connection of its
//! own, as admission does) and waits for the answer: the call then goes on as if nothing
//! happened; it never fails for the suspension.
//!
//! A daemon that answers `Failed` (a restore that lacks GPU memory) is asked again every
//! [`RESUME_RETRY_MS`]: the call waits, as ADR 0066 says. A daemon that cannot be reached
//! (no socket, closed without an answer, nothing within [`RESUME_DEADLINE_MS`]) is asked
//! again every [`RESUME_RETRY_MS`] for at most [`RESUME_ABSENT_MS`], so a restarted daemon
//! resumes the container (it restores a process the driver holds checkpointed without
//! its books); then the call goes on into the driver, as the shim's other paths do
//! without a daemon: what follows is the driver's (a process still locked waits there
//! for a controller; the driver's own state query would wait too, so the shim asks it
//! nothing).

use std::io::Write;
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::{Duration, Instant};

use vgpu_core::sched_proto::{PROTO_VERSION, decode, encode};
use vgpu_core::suspension::{
    RESUME_ABSENT_MS, RESUME_DEADLINE_MS, RESUME_RETRY_MS, ResumeAnswer, ResumeMsg, is_suspended,
};

use crate::gate::peer::{connect_nonblocking, wait_readable};

/// Waits, if the container is suspended, until it runs again.
#[inline]
pub(crate) fn wait_if_suspended() {
    let Some(w) = crate::gate::suspension_word() else {
        return;
    };
    if is_suspended(w.load(Ordering::SeqCst)) {
        resume(w);
    }
}

#[cold]
fn resume(w: &AtomicU32) {
    static SAID: AtomicBool = AtomicBool::new(false);
    let Some(path) = crate::process::enforced().and_then(|s| s.cfg.daemon_socket.clone()) else {
        return;
    };
    let start = Instant::now();
    // Since when the daemon could not be reached (None: it answered last).
    let mut absent: Option<Instant> = None;
    loop {
        if !is_suspended(w.load(Ordering::SeqCst)) {
            return;
        }
        let deadline = Instant::now() + Duration::from_millis(RESUME_DEADLINE_MS);
        let why = match ask(&path, deadline) {
            Ok(ResumeAnswer::Resumed { .. }) => return,
            Ok(ResumeAnswer::Failed { reason }) => {
                absent = None;
                reason
            }
            Err(e) => {
                let since = *absent.get_or_insert_with(Instant::now);
                if since.elapsed() >= Duration::from_millis(RESUME_ABSENT_MS) {
                    crate::say!(
                        "vgpu: WARNING: the container is suspended and no daemon at {} answered for {RESUME_ABSENT_MS} ms ({e}); the call goes on to the driver",
                        path.display()
                    );
                    return;
                }
                format!("daemon at {} unavailable ({e})", path.display())
            }
        };
        if !SAID.swap(true, Ordering::Relaxed) {
            crate::say!(
                "vgpu: WARNING: the container is suspended and its resume failed: {why}; waiting (asked again every {RESUME_RETRY_MS} ms, {} ms so far)",
                start.elapsed().as_millis()
            );
        }
        std::thread::sleep(Duration::from_millis(RESUME_RETRY_MS));
    }
}

/// One `Resume` exchange, bounded by `deadline`.
fn ask(path: &std::path::Path, deadline: Instant) -> std::io::Result<ResumeAnswer> {
    let mut s = connect_nonblocking(path)?;
    s.set_write_timeout(Some(Duration::from_secs(1)))?;
    s.write_all(&encode(&ResumeMsg::Resume {
        proto: PROTO_VERSION,
    }))?;
    let mut buf = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || !wait_readable(s.as_fd(), left)? {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("no answer to the resume within {RESUME_DEADLINE_MS} ms"),
            ));
        }
        let mut chunk = [0u8; 1024];
        let n = std::io::Read::read(&mut s, &mut chunk)?;
        if n == 0 {
            // An older daemon closes on the unknown frame; a dying one too.
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "the daemon closed the connection without an answer",
            ));
        }
        buf.extend_from_slice(&chunk[..n]);
        match decode::<ResumeAnswer>(&mut buf) {
            Ok(Some(a)) => return Ok(a),
            Ok(None) => {}
            Err(e) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    e.to_string(),
                ));
            }
        }
    }
}
