//! The gate thread ([`Runner`]): registers the process with the daemon (within the
//! handshake deadline), follows its grants and revocations, measures completed work with
//! marker events, drains and yields slices, pings a silent daemon, and runs the local
//! fallback (a duty cycle at the share) whenever there is no daemon to follow; it tells
//! the daemon about its fallback periods when it registers again. Its work between
//! messages (markers, idle yield, drain, fallback duty cycle) is `work`. See the parent
//! module for the fast path it serves.

use std::io::{self, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use vgpu_core::sched_proto::{
    BOARD_BYTES, BOARD_STRIDE, ComputeSettings, ContainerIdent, DaemonMsg, GpuRegistration,
    GrantWord, HANDSHAKE_DEADLINE_MS, MAX_REASON, PEER_DEADLINE_MS, PROTO_VERSION, ShimMsg, decode,
    encode,
};
use vgpu_core::suspension::SUSPEND_OFFSET;
use vgpu_sys::{futex_wait, futex_wake, mono_ns};

use super::peer::{connect_nonblocking, cut, recv_with_fds, wait_readable};
use super::{
    Gates, NONE, PING_AFTER, RECONNECT, RECONNECT_MAX, TICK, UNBOUNDED, UNMEASURED_ALLOWED,
    UNREGISTERED,
};
use crate::config::DeviceGrant;
use crate::process::Shim;

mod work;

/// Per-device state of the gate thread.
#[derive(Debug)]
struct Dev {
    uuid: String,
    /// The quota file grants this GPU (or there is no quota file): it is registered.
    granted: bool,
    settings: ComputeSettings,
    /// Generation held (daemon grant, or local open).
    holding: Option<u32>,
    /// The generation this process last drained and reported since the last grant it
    /// was sent: a revocation of it that crossed the report (an idle yield) is not
    /// drained and reported twice.
    reported: Option<u32>,
    grant_at: u64,
    launched_at_grant: u64,
    last_launched: u64,
    idle_ticks: u32,
    /// Measured GPU time per launch, ns (0: unknown yet), from marker completions as
    /// the gate thread polls them (the queue-ahead bound's estimate).
    per_launch_ns: f64,
    /// Device time per launch, ns (0: unknown yet), from the device's timestamps of two
    /// markers with no idle gap between them (the busy time reported at a drain).
    device_per_launch_ns: f64,
    /// The device time measured between contiguous markers of the grant held now, and
    /// the launches it covers: the grant's busy time, where it has them (see
    /// [`work::occupied_ns`]).
    measured: work::Measured,
    /// Launch count when the last grant ended (or at registration): launches after it
    /// belong to the next grant, even those made before the gate thread saw it. After a
    /// revocation that held work back on the device (ADR 0034), the launches completed by
    /// then: each launch is reported once it is known complete.
    launched_at_release: u64,
    /// Last marker completion seen: (when, launch count, whether more was queued).
    last_obs: Option<(u64, u64, bool)>,
    /// Queue-ahead bound in force, ns (the Welcome's, or a tighter one of the grant).
    queue_ahead_ns: u64,
    /// Fallback: closed until (mono ns).
    closed_until: u64,
    local_gen: u32,
    word_index: usize,
}

impl Dev {
    /// GPU time one launch costs, ns (0: unknown yet): the device's measure when there
    /// is one, else the host-polled one. The device's is what a queue-ahead bound in
    /// GPU time needs; the host-polled one holds the launcher's idle gaps, and a late
    /// poll that finds several markers complete reads near zero (ADR 0024).
    fn launch_cost_ns(&self) -> f64 {
        if self.device_per_launch_ns > 0.0 {
            self.device_per_launch_ns
        } else {
            self.per_launch_ns
        }
    }
}

pub(super) struct Conn {
    stream: UnixStream,
    buf: Vec<u8>,
}

pub(super) struct Runner {
    g: &'static Gates,
    shim: &'static Shim,
    devs: Vec<Dev>,
    /// Protocol GPU index (position in the `Hello`) → device ordinal.
    registered: Vec<usize>,
    pub(super) conn: Option<Conn>,
    queue_ahead_ns: u64,
    next_connect: Instant,
    /// Wait before the next reconnection attempt.
    retry: Duration,
    last_usage: Instant,
    /// Refused allocations as of the last usage report (a new one is reported at once).
    refusals_reported: u64,
    /// The current fallback period was said on stderr.
    warned: bool,
    /// The daemon answers pings and takes fallback reports.
    peer_checks: bool,
    /// When the daemon last sent anything.
    last_heard: Instant,
    /// A ping sent, not answered yet: when.
    ping_sent: Option<Instant>,
    ping_seq: u32,
    /// Local fallback: since when (None: registered), and what to report.
    fallback_since: Option<Instant>,
    fallback_periods: u32,
    fallback_total: Duration,
    fallback_reason: String,
}

impl std::fmt::Debug for Runner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runner").field("devs", &self.devs).finish()
    }
}

impl Runner {
    pub(super) fn new(g: &'static Gates, shim: &'static Shim, uuids: Vec<String>) -> Runner {
        let devs: Vec<Dev> = uuids
            .into_iter()
            .enumerate()
            .map(|(i, uuid)| {
                let (granted, settings) = match shim.cfg.device_grant(&uuid) {
                    DeviceGrant::Granted(st) => (true, st),
                    DeviceGrant::NotGranted => (false, shim.cfg.compute_settings(None)),
                };
                g.gates[i].not_granted.store(!granted, Ordering::Relaxed);
                Dev {
                    uuid,
                    granted,
                    settings,
                    holding: None,
                    reported: None,
                    grant_at: 0,
                    launched_at_grant: 0,
                    last_launched: 0,
                    idle_ticks: 0,
                    per_launch_ns: 0.0,
                    device_per_launch_ns: 0.0,
                    measured: work::Measured::default(),
                    launched_at_release: 0,
                    last_obs: None,
                    queue_ahead_ns: 2_000_000,
                    closed_until: 0,
                    local_gen: 0,
                    word_index: 0,
                }
            })
            .collect();
        let registered = (0..devs.len()).filter(|&i| devs[i].granted).collect();
        let now = Instant::now();
        Runner {
            g,
            shim,
            devs,
            registered,
            conn: None,
            queue_ahead_ns: 2_000_000,
            next_connect: now,
            retry: RECONNECT,
            last_usage: now,
            refusals_reported: 0,
            warned: false,
            peer_checks: false,
            last_heard: now,
            ping_sent: None,
            ping_seq: 0,
            fallback_since: None,
            fallback_periods: 0,
            fallback_total: Duration::ZERO,
            fallback_reason: String::new(),
        }
    }

    fn ident(&self) -> ContainerIdent {
        let dir = self.shim.cfg.container_dir.display().to_string();
        let file = self.shim.cfg.quota.as_ref();
        let key = match (&self.shim.cfg.tenant, file) {
            (Some(t), _) => t.clone(),
            (None, Some(q)) => format!("{}/{}/{}", q.namespace, q.pod, q.container),
            (None, None) => dir.clone(),
        };
        ContainerIdent {
            key,
            namespace: file.map(|q| q.namespace.clone()).unwrap_or_default(),
            pod: file.map(|q| q.pod.clone()).unwrap_or_default(),
            container: file.map(|q| q.container.clone()).unwrap_or_default(),
            container_dir: dir,
            // Bounded: the daemon refuses a Hello with more (it cannot bound its log
            // otherwise); what the environment asked is cut, never what was held.
            overridden: self
                .shim
                .cfg
                .overridden
                .iter()
                .take(vgpu_core::sched_proto::MAX_OVERRIDDEN)
                .map(|n| cut(n, vgpu_core::sched_proto::MAX_OVERRIDDEN_LEN))
                .collect(),
        }
    }

    fn log(&self, msg: impl FnOnce() -> String) {
        crate::process::log(self.shim, msg);
    }

    /// Tries to register with the daemon; on success the gates follow its board. A
    /// failure is said once per fallback period (a missing socket, no daemon on this
    /// node, only in the log); the next attempt waits twice as long, up to 2 s.
    pub(super) fn connect(&mut self) {
        let Some(path) = self.shim.cfg.daemon_socket.clone() else {
            self.next_connect = Instant::now() + RECONNECT_MAX;
            return;
        };
        if self.registered.is_empty() {
            // The quota file grants none of the visible GPUs: nothing to schedule.
            self.next_connect = Instant::now() + RECONNECT_MAX;
            return;
        }
        match self.try_connect(&path) {
            Ok(conn) => {
                self.conn = Some(conn);
                self.retry = RECONNECT;
                self.warned = false;
                self.last_heard = Instant::now();
                self.ping_sent = None;
                self.g.lost.store(false, Ordering::SeqCst);
                if let Some(since) = self.fallback_since.take() {
                    self.fallback_total += since.elapsed();
                }
                let report = (self.fallback_periods > 0).then(|| ShimMsg::Fallback {
                    periods: self.fallback_periods,
                    total_ms: u64::try_from(self.fallback_total.as_millis()).unwrap_or(u64::MAX),
                    reason: cut(&self.fallback_reason, MAX_REASON),
                });
                if let Some(m) = report
                    && self.peer_checks
                {
                    self.send(&m);
                    self.fallback_periods = 0;
                    self.fallback_total = Duration::ZERO;
                }
                self.log(|| format!("registered with the daemon at {}", path.display()));
            }
            Err(e) => {
                self.next_connect = Instant::now() + self.retry;
                self.retry = (self.retry * 2).min(RECONNECT_MAX);
                let reason = match e.kind() {
                    io::ErrorKind::PermissionDenied => {
                        format!("the daemon at {} refused this process: {e}", path.display())
                    }
                    _ => format!("daemon at {} unavailable ({e})", path.display()),
                };
                if e.kind() == io::ErrorKind::NotFound {
                    self.log(|| reason.clone());
                } else if !self.warned {
                    crate::say!("vgpu: WARNING: {reason}; compute share enforced locally");
                    self.warned = true;
                }
                if self.fallback_since.is_none() {
                    self.fallback_reason = reason;
                }
            }
        }
    }

    /// One registration, within [`HANDSHAKE_DEADLINE_MS`] whatever the peer does.
    fn try_connect(&mut self, path: &std::path::Path) -> io::Result<Conn> {
        let deadline = Instant::now() + Duration::from_millis(HANDSHAKE_DEADLINE_MS);
        let mut s = connect_nonblocking(path)?;
        s.set_write_timeout(Some(Duration::from_millis(HANDSHAKE_DEADLINE_MS)))?;
        let gpus: Vec<GpuRegistration> = self
            .registered
            .iter()
            .map(|&i| GpuRegistration {
                uuid: self.devs[i].uuid.clone(),
                ordinal: u32::try_from(i).unwrap_or(0),
                settings: self.devs[i].settings,
                memory_quota: self.shim.quota(i),
            })
            .collect();
        let hello = ShimMsg::Hello {
            proto: PROTO_VERSION,
            pid: std::process::id(),
            ident: self.ident(),
            gpus,
        };
        s.write_all(&encode(&hello))?;
        let mut buf = Vec::new();
        let mut fds: Vec<OwnedFd> = Vec::new();
        let msg = loop {
            if let Some(m) = decode::<DaemonMsg>(&mut buf)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?
            {
                break m;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || !wait_readable(s.as_fd(), left)? {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("no answer to the registration within {HANDSHAKE_DEADLINE_MS} ms"),
                ));
            }
            let mut chunk = [0u8; 4096];
            let (n, got) = recv_with_fds(s.as_raw_fd(), &mut chunk)?;
            if !got.is_empty() {
                fds = got;
            }
            if n == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "daemon closed the connection",
                ));
            }
            buf.extend_from_slice(&chunk[..n]);
        };
        let (settings, words, queue_ahead_us, not_granted, peer_checks) = match msg {
            DaemonMsg::Welcome {
                settings,
                words,
                queue_ahead_us,
                host_pid,
                not_granted,
                peer_checks,
                ..
            } => {
                if let Some(p) = host_pid {
                    self.shim.region.set_host_pid(self.shim.slot, p);
                }
                (settings, words, queue_ahead_us, not_granted, peer_checks)
            }
            DaemonMsg::Refused { reason } => {
                return Err(io::Error::new(io::ErrorKind::PermissionDenied, reason));
            }
            other => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("unexpected first message {other:?}"),
                ));
            }
        };
        let mut fds = fds.into_iter();
        let fd = fds
            .next()
            .ok_or_else(|| io::Error::other("Welcome without a board descriptor"))?;
        // The claim page, when the daemon sends one (ADR 0030): mapped writable. Without
        // it (an older daemon, or a page refused), launches claim nothing and every
        // revoke waits for the drain report.
        let claims = fds.next().and_then(|c| map_for_life(&c, true).ok());
        let n = self.registered.len();
        if words.len() != n || settings.len() != n || not_granted.iter().any(|&i| i as usize >= n) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "Welcome does not match the registered GPUs",
            ));
        }
        // The board: a page of the descriptor we received, read-only.
        let base = map_for_life(&fd, false)?;
        drop(fd);
        // A daemon that stops reading must not hang a launcher: writes give up after 1 s
        // (the connection is then treated as lost).
        s.set_write_timeout(Some(Duration::from_secs(1)))?;
        let writer = s.try_clone()?;
        let ahead = queue_ahead_us.saturating_mul(1000);
        self.queue_ahead_ns = ahead;
        for d in &mut self.devs {
            d.queue_ahead_ns = ahead;
        }
        for (k, (w, st)) in words.iter().zip(settings).enumerate() {
            let i = self.registered[k];
            let d = &mut self.devs[i];
            if not_granted.contains(&u32::try_from(k).unwrap_or(u32::MAX)) {
                // The daemon says the container was not granted it (this shim read
                // an older or different file): refused here too.
                d.granted = false;
                self.g.gates[i].not_granted.store(true, Ordering::SeqCst);
            }
            self.g.gates[i]
                .proto
                .store(u32::try_from(k).unwrap_or(UNREGISTERED), Ordering::SeqCst);
            let w = usize::try_from(*w).unwrap_or(usize::MAX);
            if w >= BOARD_BYTES / BOARD_STRIDE {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("board word {w} out of range"),
                ));
            }
            d.word_index = w;
            d.settings = st;
            d.holding = None;
            d.reported = None;
            let gate = &self.g.gates[i];
            // SAFETY: `w * BOARD_STRIDE` is inside the page-sized mapping, u32-aligned;
            // the mapping is never unmapped (see `Gate::word`).
            let p = unsafe { base.cast::<u8>().add(w * BOARD_STRIDE) }.cast::<AtomicU32>();
            let c = claims.map_or(std::ptr::null_mut(), |b| {
                // SAFETY: as for the board: inside the page, aligned, never unmapped.
                unsafe { b.add(w * BOARD_STRIDE) }.cast::<AtomicU32>()
            });
            let launched = gate.launched.load(Ordering::Relaxed);
            gate.completed.fetch_max(launched, Ordering::Relaxed);
            gate.next_mark.store(launched + 1, Ordering::Relaxed);
            d.launched_at_release = launched;
            let old = gate.word();
            // The claim word first: a launcher that sees the new grant word claims on
            // the new page.
            gate.claimed.store(0, Ordering::Release);
            gate.claim.store(c, Ordering::Release);
            gate.word.store(p, Ordering::Release);
            // Launchers waiting on the local word look again, at the board.
            futex_wake(old);
        }
        // SAFETY: SUSPEND_OFFSET is inside the page-sized mapping, u32-aligned; the
        // mapping is never unmapped.
        let suspension = unsafe { base.cast::<u8>().add(SUSPEND_OFFSET) }.cast::<AtomicU32>();
        self.g.suspension.store(suspension, Ordering::Release);
        for i in 0..self.devs.len() {
            self.set_allowed(i, false);
        }
        self.peer_checks = peer_checks;
        *self.g.ctl() = Some(writer);
        // Launchers that were already waiting must be asked for.
        for (k, &i) in self.registered.iter().enumerate() {
            if self.g.gates[i].waiting.load(Ordering::SeqCst) > 0 {
                let mut ctl = self.g.ctl();
                if let Some(w) = ctl.as_mut() {
                    let _ = w.write_all(&encode(&ShimMsg::Demand {
                        gpu: u32::try_from(k).unwrap_or(0),
                        since_ns: Some(mono_ns()),
                    }));
                }
            }
        }
        Ok(Conn { stream: s, buf })
    }

    /// The daemon is gone (or never answered): every gate follows its local word from
    /// now on. `why` (a lost or frozen daemon) is said once per fallback period.
    pub(super) fn enter_fallback(&mut self, why: Option<String>) {
        *self.g.ctl() = None;
        // Dropping the connection closes it: a daemon that comes back releases the
        // process's slice and registers it again when it reconnects.
        self.conn = None;
        self.ping_sent = None;
        if self.fallback_since.is_none() {
            self.fallback_since = Some(Instant::now());
            self.fallback_periods = self.fallback_periods.saturating_add(1);
            if let Some(w) = &why {
                self.fallback_reason = w.clone();
            }
        }
        if let Some(w) = why
            && !self.warned
        {
            crate::say!("vgpu: WARNING: {w}; compute share enforced locally until it answers");
            self.warned = true;
        }
        self.next_connect = Instant::now() + self.retry;
        let now = mono_ns();
        for (i, d) in self.devs.iter_mut().enumerate() {
            let gate = &self.g.gates[i];
            d.local_gen = GrantWord::next_generation(d.local_gen);
            d.holding = Some(d.local_gen);
            d.grant_at = now;
            d.launched_at_grant = gate.launched.load(Ordering::Relaxed);
            d.measured = work::Measured::default();
            gate.yielded.store(NONE, Ordering::SeqCst);
            // The local duty cycle drains by synchronizing: nothing waits on the
            // device-side word meanwhile (ADR 0034).
            gate.set_device_open(true);
            gate.local
                .store(GrantWord::held(d.local_gen).pack(), Ordering::SeqCst);
            let old = gate.word();
            gate.word.store(std::ptr::null_mut(), Ordering::Release);
            futex_wake(old);
            futex_wake(&gate.local);
        }
        for i in 0..self.devs.len() {
            self.set_allowed(i, false);
        }
    }

    fn send(&mut self, msg: &ShimMsg) {
        let mut ctl = self.g.ctl();
        if let Some(w) = ctl.as_mut()
            && w.write_all(&encode(msg)).is_err()
        {
            // The write timeout passed or the connection broke: the loop falls back.
            *ctl = None;
            self.g.lost.store(true, Ordering::SeqCst);
        }
    }

    /// Whether a launcher waits on a registered GPU, or work waits on the device for the
    /// next grant (device-side gating, ADR 0034: the application may be synchronizing
    /// on it, without a launch to block).
    fn launchers_waiting(&self) -> bool {
        self.registered.iter().any(|&i| {
            let gate = &self.g.gates[i];
            gate.waiting.load(Ordering::SeqCst) > 0
                || (self.devs[i].holding.is_none() && gate.device_held_back())
        })
    }

    /// With launches blocked, a daemon that stays silent is pinged, then given
    /// [`PEER_DEADLINE_MS`]; the reason to fall back if it let that pass.
    fn check_peer(&mut self) -> Option<String> {
        let path = self
            .shim
            .cfg
            .daemon_socket
            .as_ref()
            .map(|p| p.display().to_string())
            .unwrap_or_default();
        if self.g.lost.load(Ordering::SeqCst) {
            return Some(format!(
                "the daemon at {path} did not take a message within 1 s"
            ));
        }
        if !self.peer_checks {
            return None;
        }
        if let Some(sent) = self.ping_sent {
            if self.last_heard >= sent {
                self.ping_sent = None;
            } else if sent.elapsed() >= Duration::from_millis(PEER_DEADLINE_MS) {
                return Some(format!(
                    "the daemon at {path} did not answer within {PEER_DEADLINE_MS} ms"
                ));
            }
            return None;
        }
        if self.launchers_waiting() && self.last_heard.elapsed() >= PING_AFTER {
            self.ping_seq = self.ping_seq.wrapping_add(1);
            self.ping_sent = Some(Instant::now());
            let seq = self.ping_seq;
            self.send(&ShimMsg::Ping { seq });
        }
        None
    }

    pub(super) fn run(mut self) {
        loop {
            let holding = self.devs.iter().any(|d| d.holding.is_some());
            if self.conn.is_none() {
                if Instant::now() >= self.next_connect {
                    self.connect();
                    if self.conn.is_some() {
                        continue;
                    }
                }
                self.poll_markers();
                self.fallback_tick();
                // Whether a gate holds now: one the tick just opened needs its markers
                // polled every tick too (its launchers wait for them once the
                // queue-ahead budget is spent).
                let holding = self.devs.iter().any(|d| d.holding.is_some());
                let seq = self.g.doorbell.load(Ordering::Acquire);
                let wait = if holding {
                    TICK
                } else {
                    // Closed: reopen when the duty cycle says, not up to 20 ms late
                    // (a late reopening lengthened every cycle: a 30 % cap ran 21 %).
                    let now = mono_ns();
                    let reopen = self
                        .devs
                        .iter()
                        .map(|d| d.closed_until.saturating_sub(now))
                        .min()
                        .unwrap_or(u64::MAX);
                    Duration::from_nanos(reopen.clamp(TICK.as_nanos() as u64, 20_000_000))
                };
                futex_wait(&self.g.doorbell, seq, wait);
                continue;
            }
            let timeout = if holding {
                TICK
            } else {
                Duration::from_millis(200)
            };
            match self.poll_daemon(timeout) {
                Ok(msgs) => {
                    for m in msgs {
                        self.handle(m);
                    }
                }
                Err(e) => {
                    let path = self
                        .shim
                        .cfg
                        .daemon_socket
                        .as_ref()
                        .map(|p| p.display().to_string())
                        .unwrap_or_default();
                    self.enter_fallback(Some(format!(
                        "connection to the daemon at {path} lost ({e})"
                    )));
                    continue;
                }
            }
            if let Some(why) = self.check_peer() {
                self.enter_fallback(Some(why));
                continue;
            }
            self.poll_markers();
            self.holding_tick();
            // A refused allocation is reported at once: the application may exit on it.
            let refusals = self.shim.refusals.total();
            if self.last_usage.elapsed() >= Duration::from_secs(1)
                || refusals != self.refusals_reported
            {
                self.last_usage = Instant::now();
                self.refusals_reported = refusals;
                for k in 0..self.registered.len() {
                    let memory_used = self.shim.region.used(self.shim.rdev(self.registered[k]));
                    let (refused, last_refusal) = self.shim.refusals.get(self.registered[k]);
                    self.send(&ShimMsg::Usage {
                        gpu: u32::try_from(k).unwrap_or(0),
                        memory_used,
                        refused,
                        last_refusal,
                    });
                }
            }
        }
    }

    fn poll_daemon(&mut self, timeout: Duration) -> io::Result<Vec<DaemonMsg>> {
        let conn = self
            .conn
            .as_mut()
            .ok_or_else(|| io::Error::other("no connection"))?;
        let ready = vgpu_sys::poll::readable(
            &[conn.stream.as_fd()],
            timeout.max(Duration::from_millis(1)),
        )?;
        let r = i32::from(ready.first().copied().unwrap_or(false));
        let mut out = Vec::new();
        if r > 0 {
            let mut chunk = [0u8; 4096];
            loop {
                // SAFETY: a valid socket and buffer; MSG_DONTWAIT keeps the (blocking)
                // socket's reads non-blocking without changing the shared file
                // description that launchers write through.
                let n = unsafe {
                    libc::recv(
                        conn.stream.as_raw_fd(),
                        chunk.as_mut_ptr().cast(),
                        chunk.len(),
                        libc::MSG_DONTWAIT,
                    )
                };
                if n == 0 {
                    return Err(io::Error::from(io::ErrorKind::UnexpectedEof));
                }
                if n < 0 {
                    let e = io::Error::last_os_error();
                    match e.kind() {
                        io::ErrorKind::WouldBlock => break,
                        io::ErrorKind::Interrupted => continue,
                        _ => return Err(e),
                    }
                }
                conn.buf.extend_from_slice(&chunk[..n as usize]);
                self.last_heard = Instant::now();
            }
            while let Some(m) = decode::<DaemonMsg>(&mut conn.buf)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?
            {
                out.push(m);
            }
        }
        Ok(out)
    }

    /// The device ordinal of protocol GPU index `gpu` (None: not one this process
    /// registered; the message is ignored).
    fn dev_of(&self, gpu: u32) -> Option<usize> {
        self.registered.get(gpu as usize).copied()
    }

    fn handle(&mut self, m: DaemonMsg) {
        match m {
            DaemonMsg::Grant {
                gpu,
                generation,
                queue_ahead_us,
            } => {
                let Some(i) = self.dev_of(gpu) else {
                    return;
                };
                let base = self.queue_ahead_ns;
                let Some(d) = self.devs.get_mut(i) else {
                    return;
                };
                let ahead = queue_ahead_us.map_or(base, |q| q.saturating_mul(1000).min(base));
                if ahead != d.queue_ahead_ns {
                    d.queue_ahead_ns = ahead;
                    self.set_allowed(i, false);
                }
                let Some(d) = self.devs.get_mut(i) else {
                    return;
                };
                let gate = &self.g.gates[i];
                // What a revocation held back on the device goes on (ADR 0034), under
                // this grant: claimed as a launch would claim it (ADR 0030), since no
                // launch may come (the application may be synchronizing on that work),
                // and a grant nobody claims is taken back.
                if gate.device_held_back() {
                    gate.claim_for_held_back();
                }
                gate.set_device_open(true);
                d.holding = Some(generation);
                d.reported = None;
                d.grant_at = mono_ns();
                d.measured = work::Measured::default();
                d.launched_at_grant = d
                    .launched_at_release
                    .min(gate.launched.load(Ordering::Relaxed));
                d.last_launched = gate.launched.load(Ordering::Relaxed);
                d.idle_ticks = 0;
            }
            DaemonMsg::Revoke { gpu, generation } => {
                if let Some(i) = self.dev_of(gpu)
                    && self.devs[i].reported != Some(generation)
                {
                    self.drain(i, generation, work::Ending::Revoked);
                }
            }
            DaemonMsg::Settings { gpu, settings } => {
                if let Some(i) = self.dev_of(gpu) {
                    self.devs[i].settings = settings;
                }
            }
            // Any message counts as an answer (`last_heard`).
            DaemonMsg::Pong { .. }
            | DaemonMsg::Welcome { .. }
            | DaemonMsg::Refused { .. }
            | DaemonMsg::Admitted { .. } => {}
        }
    }

    /// How many launches may be outstanding on GPU `i` ([`allowed_launches`]); `ran_dry`:
    /// a poll found the queue empty with launchers at the bound.
    pub(super) fn set_allowed(&mut self, i: usize, ran_dry: bool) {
        let gate = &self.g.gates[i];
        let d = &self.devs[i];
        let (mut allowed, mut every) = allowed_launches(
            d.queue_ahead_ns,
            d.launch_cost_ns(),
            d.device_per_launch_ns > 0.0,
            gate.allowed.load(Ordering::Relaxed),
            ran_dry,
        );
        // While a capture is open, every launch is marked, so that a drain can wait for
        // the markers instead of synchronizing the device ([`super::captures_open`]).
        if super::captures_open() {
            (allowed, every) = (allowed.min(super::MAX_MARKERS as u64), 1);
        }
        // With device-side gating, a marker at least every run of launches between two
        // waits: a revocation's report counts what completed (ADR 0034).
        let runs = u64::from(gate.device_every());
        if runs > 0 {
            every = every.min(runs);
            // Every run starts and ends with a marker, so that a revocation waits for
            // each run that started and its report charges it: at most the markers'
            // worth queued (kernels shorter than the queue-ahead bound over this many
            // launches queue less than the bound).
            allowed = allowed.min(super::MAX_MARKERS as u64 / 4 * every);
            gate.set_device_estimate(d.launch_cost_ns());
        }
        gate.allowed.store(allowed, Ordering::Relaxed);
        gate.mark_every.store(every, Ordering::Relaxed);
        let launched = gate.launched.load(Ordering::Relaxed);
        let next = gate.next_mark.load(Ordering::Relaxed);
        if next > launched + every {
            gate.next_mark.store(launched + every, Ordering::Relaxed);
        }
        gate.publish_budget();
    }
}

/// How many launches may be outstanding, and a marker every how many (a quarter of them):
/// the queue-ahead bound (`ahead_ns`; 0: unbounded) over the GPU time per launch
/// (`per_ns`; 0: not measured).
///
/// - Measured on the device (`device_measured`): taken as it is, up or down.
/// - Polled on the host only: it raises the count in force (`prev`) at most twofold per
///   update. Such an estimate can read far below the GPU's time (a late poll, two polls
///   microseconds apart): one that read 3.2 µs for 5 ms launches let 100 ms be queued
///   under a 20 % cap (ADR 0028).
/// - Not measured: `UNMEASURED_ALLOWED`, with a marker after each launch, so that two
///   consecutive ones give the first sample within one slice even for long kernels; the
///   count in force stays until a measure comes, and doubles each time a poll found the
///   queue empty with launchers at the bound (`ran_dry`): the GPU finished all of it
///   before the gate thread looked, which is the case (no contiguous markers, no host
///   sample over a queue that is never busy) of kernels shorter than their launches.
fn allowed_launches(
    ahead_ns: u64,
    per_ns: f64,
    device_measured: bool,
    prev: u64,
    ran_dry: bool,
) -> (u64, u64) {
    if ahead_ns == 0 {
        return (UNBOUNDED, u64::MAX / 4);
    }
    let prev = if prev >= UNBOUNDED {
        UNMEASURED_ALLOWED
    } else {
        prev.max(UNMEASURED_ALLOWED)
    };
    // No launch is ever counted as less than MIN_LAUNCH_NS of GPU time: a count past
    // the bound over it buys no throughput (launches take longer than that on the host),
    // and is what a process that turns to long kernels could queue at once.
    let ceiling = (ahead_ns / MIN_LAUNCH_NS).clamp(2, MAX_ALLOWED);
    let a = if per_ns > 0.0 && per_ns.is_finite() {
        let a = ((ahead_ns as f64 / per_ns).ceil() as u64).clamp(2, ceiling);
        if device_measured {
            a
        } else {
            a.min(prev.saturating_mul(2))
        }
    } else if ran_dry {
        prev.saturating_mul(2).min(ceiling)
    } else {
        prev.min(ceiling.max(UNMEASURED_ALLOWED))
    };
    let every = if a <= UNMEASURED_ALLOWED && !device_measured && per_ns <= 0.0 {
        1
    } else {
        (a / 4).max(1)
    };
    (a, every)
}

/// Most launches ever allowed ahead.
const MAX_ALLOWED: u64 = 1 << 20;
/// The least GPU time a launch is counted for in the queue-ahead bound, ns: no driver
/// launches faster than one a microsecond from one thread, so a count above the bound
/// over it only lets a process queue more long kernels at once after short ones.
const MIN_LAUNCH_NS: u64 = 1_000;

/// Maps the first page of a descriptor the daemon sent (the board, the claim page),
/// shared, for the process's life: the gates keep pointers into it (see `Gate::word`),
/// so the mapping is leaked on purpose. A descriptor that could shrink under the
/// mapping would fault the application on its next launch: refused.
fn map_for_life(fd: &OwnedFd, writable: bool) -> io::Result<*mut u8> {
    if !vgpu_sys::shm::cannot_shrink_below(fd.as_fd(), BOARD_BYTES) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "a descriptor from the daemon is not a page sealed against shrinking",
        ));
    }
    let m = vgpu_sys::shm::SharedMap::map(fd.as_fd(), BOARD_BYTES, writable)?;
    let base = m.as_ptr();
    std::mem::forget(m);
    Ok(base)
}

#[cfg(test)]
mod tests {
    use super::{UNBOUNDED, UNMEASURED_ALLOWED, allowed_launches};

    #[test]
    fn the_queue_ahead_count_follows_the_device_measure_and_a_host_estimate_only_slowly() {
        let b = 2_000_000;
        // No bound: unbounded, no markers.
        assert_eq!(allowed_launches(0, 5e6, true, 4, false).0, UNBOUNDED);
        // Not measured yet: a few launches, a marker after each.
        assert_eq!(
            allowed_launches(b, 0.0, false, UNBOUNDED, false),
            (UNMEASURED_ALLOWED, 1)
        );
        assert_eq!(
            allowed_launches(b, f64::NAN, false, 4, false),
            (UNMEASURED_ALLOWED, 1)
        );
        // Measured on the device: the bound over the time per launch, at once.
        assert_eq!(allowed_launches(b, 10_000.0, true, 4, false), (200, 50));
        assert_eq!(allowed_launches(b, 5e6, true, 625, false), (2, 1));
        // A host-polled estimate far too low (3.2 µs for 5 ms launches, one late poll)
        // doubles the count in force, no more.
        assert_eq!(allowed_launches(b, 3_205.0, false, 4, false), (8, 2));
        assert_eq!(allowed_launches(b, 3_205.0, false, 8, false), (16, 4));
        // From unbounded (a bound of 0 before), it starts over from the unmeasured count.
        assert_eq!(
            allowed_launches(b, 3_205.0, false, UNBOUNDED, false),
            (8, 2)
        );
        // Lowering is never slowed.
        assert_eq!(allowed_launches(b, 1e6, false, 200, false), (2, 1));
    }

    #[test]
    fn without_a_measure_the_count_doubles_only_when_the_queue_ran_dry_at_the_bound() {
        let b = 2_000_000;
        // The GPU finished everything before the poll, launchers waiting: twice as many.
        assert_eq!(allowed_launches(b, 0.0, false, 4, true), (8, 2));
        assert_eq!(allowed_launches(b, 0.0, false, 8, true), (16, 4));
        // A poll that found work still queued keeps the count in force.
        assert_eq!(allowed_launches(b, 0.0, false, 16, false), (16, 4));
        // Never past the bound over a microsecond a launch (2,000 for 2 ms): before, empty
        // kernels doubled it to 2^20, and a process that then turned to 5 ms kernels
        // queued all of them at once.
        assert_eq!(allowed_launches(b, 0.0, false, 1024, true).0, 2_000);
        assert_eq!(allowed_launches(b, 0.0, false, 2_000, true).0, 2_000);
        assert_eq!(allowed_launches(b, 0.0, false, 1 << 20, false).0, 2_000);
        // Nor for a measure below a microsecond (851 ns measured for empty kernels).
        assert_eq!(allowed_launches(b, 851.0, true, 4, false).0, 2_000);
        assert_eq!(
            allowed_launches(20_000_000, 851.0, true, 4, false).0,
            20_000
        );
        // A measure, once there, decides (dry or not).
        assert_eq!(allowed_launches(b, 5e6, true, 1024, true), (2, 1));
    }
}
