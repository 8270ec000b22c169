//! Admission through the node's eBPF GPU device gate (`docs/ebpf.md`): before the real
//! driver opens a GPU device node (`cuInit`, `nvmlInit*`), the process asks the daemon to
//! let it through ([`vgpu_core::sched_proto::ShimMsg::Admit`]), so that an enforcing gate
//! refuses only processes that bypass the shim. Once per process: a `fork`ed child has
//! another PID and asks again, as itself. Bounded: at most
//! [`vgpu_core::sched_proto::HANDSHAKE_DEADLINE_MS`] on a frozen or slow daemon; any
//! failure (no daemon, an older daemon, no gate) lets the call go on, and the gate, if one
//! runs, decides.

use std::io::Write;
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use vgpu_core::sched_proto::{DaemonMsg, HANDSHAKE_DEADLINE_MS, PROTO_VERSION, ShimMsg};

use crate::gate::peer::{connect_nonblocking, wait_readable};

/// The PID that was admitted (0: none yet).
static ADMITTED: AtomicU32 = AtomicU32::new(0);

/// Asks the daemon named by `VGPU_DAEMON_SOCKET` to admit this process, once per PID.
pub fn admit() {
    let pid = std::process::id();
    if ADMITTED.load(Ordering::Acquire) == pid {
        return;
    }
    // The socket from the environment only: the rest of the configuration needs the
    // driver, which must not open anything before this.
    let Some(path) = crate::config::Config::from_env()
        .ok()
        .and_then(|c| c.daemon_socket)
    else {
        return;
    };
    let deadline = Instant::now() + Duration::from_millis(HANDSHAKE_DEADLINE_MS);
    if matches!(ask(&path, deadline), Ok(true)) {
        ADMITTED.store(pid, Ordering::Release);
    }
}

/// One `Admit` exchange; `Ok(true)`: the daemon answered (gate or not).
fn ask(path: &std::path::Path, deadline: Instant) -> std::io::Result<bool> {
    let mut s = connect_nonblocking(path)?;
    let left = deadline.saturating_duration_since(Instant::now());
    s.set_write_timeout(Some(left.max(Duration::from_millis(1))))?;
    s.write_all(&vgpu_core::sched_proto::encode(&ShimMsg::Admit {
        proto: PROTO_VERSION,
    }))?;
    let mut buf = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || !wait_readable(s.as_fd(), left)? {
            return Ok(false);
        }
        let mut chunk = [0u8; 256];
        let n = std::io::Read::read(&mut s, &mut chunk)?;
        if n == 0 {
            // An older daemon closes on the unknown message.
            return Ok(false);
        }
        buf.extend_from_slice(&chunk[..n]);
        match vgpu_core::sched_proto::decode::<DaemonMsg>(&mut buf) {
            Ok(Some(DaemonMsg::Admitted { .. })) => return Ok(true),
            Ok(Some(_)) | Err(_) => return Ok(false),
            Ok(None) => {}
        }
    }
}
