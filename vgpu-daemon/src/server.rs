//! The shims' unix socket. One task per connection: the first frame must be a `Hello`
//! (within [`HELLO_TIMEOUT`]); the process's host PID comes from the socket's peer
//! credentials, never from the message. A connection whose first frame is `Admit` lets
//! the process through the eBPF device gate and closes. The `Welcome` carries the tenant's board
//! descriptor (`SCM_RIGHTS`). A framing or protocol error closes that connection only;
//! a closed connection releases the process's charges and slice at once. A `Ping` is
//! answered by the connection's own task, at once. A connection whose first frame is a
//! `Resume` ([`vgpu_core::suspension`]) resumes the process's suspended container,
//! answers and closes.
//!
//! No tenant can exhaust it (issue 39): an accept error is never fatal (accepting backs
//! off on a shortage, counts it and logs within the clients' log budget); connections are
//! capped per container (cgroup of the peer's PID), per UID outside pods' containers and
//! for the node ([`crate::connections`]), a connection over a cap is answered `Refused` naming the cap
//! and closed at once; the descriptor limit is raised at start to what the caps need
//! ([`raise_descriptor_limit`]).

use std::io;
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt, Interest};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::mpsc;
use tracing::{debug, info, warn};
use vgpu_core::sched_proto::{DaemonMsg, ShimMsg, decode, encode};
use vgpu_core::suspension::{ResumeAnswer, ResumeMsg};

use crate::connections::{Caps, DEFAULT_CAPS, Peer, Table, caps_within, peer_of};
use crate::daemon::Daemon;

/// How long a new connection may take to say `Hello`.
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(5);

/// Binds the socket (replacing a stale one) with mode 0666: any local process may
/// register; what it gets is decided by the daemon.
pub fn bind(path: &Path) -> io::Result<UnixListener> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let l = UnixListener::bind(path)?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666))?;
    Ok(l)
}

/// What [`raise_descriptor_limit`] found and did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DescriptorLimit {
    /// The soft limit before.
    pub before: u64,
    /// The soft limit now.
    pub soft: u64,
    /// The hard limit.
    pub hard: u64,
    /// The caps the soft limit allows ([`DEFAULT_CAPS`] fitted to it).
    pub caps: Caps,
}

/// Raises the soft `RLIMIT_NOFILE` to what [`DEFAULT_CAPS`] need (at most the hard limit)
/// and fits the caps to what it got.
pub fn raise_descriptor_limit() -> io::Result<DescriptorLimit> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into the valid, exclusive `lim`.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let before = lim.rlim_cur;
    let needed = crate::connections::descriptors_needed(&DEFAULT_CAPS);
    if let Some(target) = crate::connections::soft_limit_target(needed, before, lim.rlim_max) {
        let new = libc::rlimit {
            rlim_cur: target,
            rlim_max: lim.rlim_max,
        };
        // SAFETY: setrlimit reads one valid rlimit; the soft limit is at most the hard one.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &new) } != 0 {
            let e = io::Error::last_os_error();
            return Err(io::Error::new(
                e.kind(),
                format!("setrlimit(RLIMIT_NOFILE, {target}): {e}"),
            ));
        }
        lim.rlim_cur = target;
    }
    Ok(DescriptorLimit {
        before,
        soft: lim.rlim_cur,
        hard: lim.rlim_max,
        caps: caps_within(lim.rlim_cur, DEFAULT_CAPS),
    })
}

/// Accepts connections forever, within `caps`. An accept error never ends it.
pub async fn serve(daemon: Arc<Daemon>, listener: UnixListener, caps: Caps) -> io::Result<()> {
    let table = Arc::new(Mutex::new(Table::new(caps)));
    let mut consecutive = 0u32;
    loop {
        let stream = match listener.accept().await {
            Ok((s, _)) => {
                consecutive = 0;
                s
            }
            Err(e) => {
                consecutive = consecutive.saturating_add(1);
                daemon.sockets().accept_error();
                let shortage = crate::connections::accept_error_is_shortage(e.raw_os_error());
                let pause = crate::connections::accept_backoff(consecutive, shortage);
                if crate::log_budget::client_warning() {
                    warn!(
                        errors = daemon.sockets().accept_errors(),
                        "accepting on the shims' socket failed: {e}; retrying in {pause:?}"
                    );
                } else {
                    debug!("accepting on the shims' socket failed: {e}");
                }
                tokio::time::sleep(pause).await;
                continue;
            }
        };
        // Who it is, before anything is kept for it: the kernel's word (SO_PEERCRED), and
        // the container from the peer's /proc/PID/cgroup.
        let (uid, pid) = match stream.peer_cred() {
            Ok(c) => (c.uid(), c.pid().and_then(|p| u32::try_from(p).ok())),
            Err(e) => {
                debug!("peer credentials: {e}: closing");
                continue;
            }
        };
        let cgroup = pid
            .filter(|p| *p > 0)
            .and_then(|p| std::fs::read_to_string(format!("/proc/{p}/cgroup")).ok());
        let peer = peer_of(cgroup.as_deref());
        let admitted = {
            let mut t = lock(&table);
            let r = t.try_open(&peer, uid);
            daemon.sockets().set_open(t.open());
            r
        };
        if let Err(refusal) = admitted {
            daemon.sockets().refused(&refusal);
            if crate::log_budget::client_warning() {
                warn!(?pid, uid, "connection refused: {refusal}");
            } else {
                debug!(?pid, uid, "connection refused: {refusal}");
            }
            // A clear refusal, if the socket takes it now; never a wait.
            let _ = stream.try_write(&encode(&DaemonMsg::Refused {
                reason: refusal.to_string(),
            }));
            continue;
        }
        let counted = Counted {
            table: Arc::clone(&table),
            daemon: Arc::clone(&daemon),
            peer,
            uid,
        };
        let d = Arc::clone(&daemon);
        tokio::spawn(async move {
            let _counted = counted;
            if let Err(e) = connection(d, stream).await {
                debug!("connection ended: {e}");
            }
        });
    }
}

/// A connection counted in the table; dropped (the task ended, however), it is not.
struct Counted {
    table: Arc<Mutex<Table>>,
    daemon: Arc<Daemon>,
    peer: Peer,
    uid: u32,
}

impl Drop for Counted {
    fn drop(&mut self) {
        let mut t = lock(&self.table);
        t.close(&self.peer, self.uid);
        self.daemon.sockets().set_open(t.open());
    }
}

fn lock(t: &Mutex<Table>) -> std::sync::MutexGuard<'_, Table> {
    // Every critical section leaves the counts consistent.
    t.lock().unwrap_or_else(|p| p.into_inner())
}

/// The first frame of a connection: a shim message, or a suspended container's
/// request to be resumed ([`vgpu_core::suspension`], on a connection of its own).
#[derive(Debug, serde::Deserialize)]
#[serde(untagged)]
enum First {
    Shim(ShimMsg),
    Resume(ResumeMsg),
}

async fn read_frame<T: for<'de> serde::Deserialize<'de>>(
    stream: &mut UnixStream,
    buf: &mut Vec<u8>,
) -> io::Result<Option<T>> {
    loop {
        match decode::<T>(buf) {
            Ok(Some(m)) => return Ok(Some(m)),
            Ok(None) => {}
            Err(e) => return Err(io::Error::new(io::ErrorKind::InvalidData, e.to_string())),
        }
        let mut chunk = [0u8; 4096];
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Ok(None);
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

async fn connection(daemon: Arc<Daemon>, mut stream: UnixStream) -> io::Result<()> {
    let cred = stream.peer_cred()?;
    let pid = cred
        .pid()
        .and_then(|p| u32::try_from(p).ok())
        .ok_or_else(|| io::Error::other("peer credentials carry no PID"))?;
    let mut buf = Vec::new();
    let first =
        match tokio::time::timeout(HELLO_TIMEOUT, read_frame::<First>(&mut stream, &mut buf)).await
        {
            Ok(r) => r?,
            Err(_) => {
                if crate::log_budget::client_warning() {
                    warn!(pid, "no Hello within {HELLO_TIMEOUT:?}: closing");
                } else {
                    debug!(pid, "no Hello within {HELLO_TIMEOUT:?}: closing");
                }
                return Ok(());
            }
        };
    let hello = match first {
        Some(First::Resume(ResumeMsg::Resume { .. })) => {
            // A suspended container's process, before its next CUDA call: resumed (even
            // when enforcement failed closed: it was admitted before), then answered.
            let d = Arc::clone(&daemon);
            let answer = match tokio::task::spawn_blocking(move || d.resume_pid(pid)).await {
                Ok(Ok(r)) => ResumeAnswer::Resumed {
                    restore_ms: u64::try_from(r.took.as_millis()).unwrap_or(u64::MAX),
                },
                Ok(Err(e)) => ResumeAnswer::Failed {
                    reason: e.to_string(),
                },
                Err(e) => ResumeAnswer::Failed {
                    reason: format!("the resume task failed: {e}"),
                },
            };
            debug!(pid, ?answer, "resume asked");
            stream.write_all(&encode(&answer)).await?;
            return Ok(());
        }
        Some(First::Shim(m)) => Some(m),
        None => None,
    };
    // Enforcement asked for and not delivered (fail closed): no new tenant, no admission.
    if let Some(why) = daemon.not_ready()
        && matches!(hello, Some(ShimMsg::Hello { .. } | ShimMsg::Admit { .. }))
    {
        if crate::log_budget::client_warning() {
            warn!(pid, "refused: {why}");
        }
        stream
            .write_all(&encode(&DaemonMsg::Refused { reason: why }))
            .await?;
        return Ok(());
    }
    let (proto, ident, gpus) = match hello {
        Some(ShimMsg::Hello {
            proto, ident, gpus, ..
        }) => (proto, ident, gpus),
        Some(ShimMsg::Admit { .. }) => {
            // Before the process's driver opens a GPU node: through the gate, then done.
            let gate = daemon.device_gate().is_some_and(|g| g.admit(pid));
            debug!(pid, gate, "admitted");
            stream
                .write_all(&encode(&DaemonMsg::Admitted { gate }))
                .await?;
            return Ok(());
        }
        _ => {
            if crate::log_budget::client_warning() {
                warn!(pid, "first frame is not Hello: closing");
            } else {
                debug!(pid, "first frame is not Hello: closing");
            }
            return Ok(());
        }
    };
    let (tx, mut rx) = mpsc::unbounded_channel::<DaemonMsg>();
    let pong = tx.clone();
    let reg = match daemon.register(pid, proto, ident, gpus, tx) {
        Ok(r) => r,
        Err(e) => {
            // The daemon counts and logs refusals per container (once per reason).
            let frame = encode(&DaemonMsg::Refused {
                reason: e.to_string(),
            });
            stream.write_all(&frame).await?;
            return Ok(());
        }
    };
    let conn = reg.conn;
    // The scheduler looks at the socket (without reading it) before deciding on this
    // tenant's absence.
    match stream.as_fd().try_clone_to_owned() {
        Ok(fd) => daemon.watch_input(conn, fd),
        Err(e) => warn!(
            pid,
            conn, "cannot watch the connection for unread input: {e}"
        ),
    }
    let frame = encode(&reg.welcome);
    let fds = [
        reg.board.fd().as_raw_fd(),
        reg.board.claims_fd().as_raw_fd(),
    ];
    let sent = send_with_fds(&stream, &frame, &fds).await;
    if let Err(e) = sent {
        daemon.disconnect(conn);
        return Err(e);
    }
    // A registered process may open GPU nodes (a shim that did not say Admit first: an
    // older one, or one whose Admit failed), and its exit is watched.
    if let Some(g) = daemon.device_gate() {
        g.admit(pid);
    }
    info!(pid, conn, "shim registered");
    let (mut rd, mut wr) = stream.into_split();
    let writer = tokio::spawn(async move {
        while let Some(m) = rx.recv().await {
            if wr.write_all(&encode(&m)).await.is_err() {
                break;
            }
        }
    });
    let result = async {
        loop {
            let msg = loop {
                match decode::<ShimMsg>(&mut buf) {
                    Ok(Some(m)) => break m,
                    Ok(None) => {}
                    Err(e) => {
                        return Err(io::Error::new(io::ErrorKind::InvalidData, e.to_string()));
                    }
                }
                let mut chunk = [0u8; 4096];
                let n = rd.read(&mut chunk).await?;
                if n == 0 {
                    return Ok(());
                }
                buf.extend_from_slice(&chunk[..n]);
            };
            let r = match msg {
                ShimMsg::Hello { .. } | ShimMsg::Admit { .. } => Err(
                    crate::daemon::DaemonError::Invalid("Hello or Admit after Hello".into()),
                ),
                ShimMsg::Demand { gpu, since_ns } => daemon.demand(conn, gpu, since_ns),
                ShimMsg::Drained {
                    gpu,
                    generation,
                    end_ns,
                    waiting,
                    busy_ns,
                    launches,
                    expired,
                } => {
                    if expired {
                        daemon.expired(conn, gpu, generation);
                    }
                    daemon.released(conn, gpu, generation, end_ns, busy_ns, launches, waiting)
                }
                ShimMsg::Idle {
                    gpu,
                    generation,
                    end_ns,
                    busy_ns,
                    launches,
                } => daemon.released(conn, gpu, generation, end_ns, busy_ns, launches, false),
                ShimMsg::Usage {
                    gpu,
                    memory_used,
                    refused,
                    last_refusal,
                } => daemon
                    .usage(conn, gpu, memory_used)
                    .and_then(|()| daemon.memory_refusals(conn, gpu, refused, last_refusal)),
                // Answered at once, by this task: the shim's liveness check measures the
                // daemon's responsiveness, not the scheduler's decisions.
                ShimMsg::Ping { seq } => {
                    let _ = pong.send(DaemonMsg::Pong { seq });
                    Ok(())
                }
                ShimMsg::Fallback {
                    periods,
                    total_ms,
                    reason,
                } => daemon.fallback_report(conn, periods, total_ms, &reason),
            };
            if let Err(e) = r {
                return Err(io::Error::new(io::ErrorKind::InvalidData, e.to_string()));
            }
        }
    }
    .await;
    if let Err(e) = &result {
        if crate::log_budget::client_warning() {
            warn!(pid, conn, "protocol error, closing: {e}");
        } else {
            debug!(pid, conn, "protocol error, closing: {e}");
        }
    }
    daemon.disconnect(conn);
    writer.abort();
    info!(pid, conn, "shim disconnected");
    Ok(())
}

/// Sends `bytes` with `fds` attached (`SCM_RIGHTS`, at most [`MAX_FDS`]), then the rest
/// if the first send was short.
async fn send_with_fds(stream: &UnixStream, bytes: &[u8], fds: &[RawFd]) -> io::Result<()> {
    let raw = stream.as_raw_fd();
    let n = loop {
        stream.writable().await?;
        match stream.try_io(Interest::WRITABLE, || sendmsg_fds(raw, bytes, fds)) {
            Ok(n) => break n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    };
    let mut rest = &bytes[n..];
    while !rest.is_empty() {
        stream.writable().await?;
        match stream.try_write(rest) {
            Ok(k) => rest = &rest[k..],
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Most descriptors one message carries (the board and the claim page).
const MAX_FDS: usize = 2;

fn sendmsg_fds(sock: RawFd, bytes: &[u8], fds: &[RawFd]) -> io::Result<usize> {
    let fds = &fds[..fds.len().min(MAX_FDS)];
    let data = size_of_val(fds) as u32;
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr() as *mut libc::c_void,
        iov_len: bytes.len(),
    };
    // Room for MAX_FDS descriptors, aligned as cmsghdr requires.
    let mut cbuf = [0u64; 8];
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(data) } as usize;
    // SAFETY: zeroed msghdr is a valid "empty" value; fields set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = space;
    // SAFETY: `msg` points at a control buffer of `space` bytes (≤ 64), so the first
    // header exists and its data has room for `fds`.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(data) as usize;
        let at = libc::CMSG_DATA(c).cast::<RawFd>();
        for (i, fd) in fds.iter().enumerate() {
            std::ptr::write_unaligned(at.add(i), *fd);
        }
    }
    // SAFETY: a valid socket, message and buffers that outlive the call.
    let n = unsafe { libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}
