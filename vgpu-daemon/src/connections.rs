//! Bounds on the shims' socket, so that no tenant can exhaust the daemon (issue 39, item
//! 4): how many connections the node, one container (cgroup) and one UID may hold open,
//! the descriptors those caps need (the daemon raises its soft `RLIMIT_NOFILE` to that at
//! start, and fits the caps to what it got), and how accepting backs off after an error.
//! The decisions are pure functions over explicit inputs; [`crate::server`] applies them
//! and [`SocketStats`] counts what happened for `/metrics`.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Connections open at once on the shims' socket, registered or not yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caps {
    /// The whole node.
    pub total: usize,
    /// One container (cgroup, [`container_key`]).
    pub per_container: usize,
    /// One UID (the peer's, `SO_PEERCRED`).
    pub per_uid: usize,
}

/// The caps when descriptors are not short: the node's registered processes
/// ([`crate::daemon::MAX_CONNECTIONS`]) plus a quarter for connections not registered
/// yet; a container its registered processes ([`crate::daemon::MAX_CONNS_PER_TENANT`]);
/// a UID as many as the node registers, so that one UID alone never takes the last
/// quarter.
pub const DEFAULT_CAPS: Caps = Caps {
    total: crate::daemon::MAX_CONNECTIONS + crate::daemon::MAX_CONNECTIONS / 4,
    per_container: crate::daemon::MAX_CONNS_PER_TENANT,
    per_uid: crate::daemon::MAX_CONNECTIONS,
};

/// Descriptors one open connection may cost at most: its socket, the duplicate the
/// scheduler watches for unread input, and (a first process of its container) the
/// container's board and claim page.
pub const FDS_PER_CONNECTION: u64 = 4;
/// Descriptors kept for everything else: NVML, eBPF maps and rings, the API's and
/// `/metrics`' listeners and clients, `/proc` reads, the log.
pub const FD_RESERVE: u64 = 256;

/// The descriptors `caps` need.
pub fn descriptors_needed(caps: &Caps) -> u64 {
    FD_RESERVE + FDS_PER_CONNECTION * caps.total as u64
}

/// The soft `RLIMIT_NOFILE` to set, given what the caps need and the current soft and
/// hard limits: `None` when the soft limit is enough already; else the need, at most the
/// hard limit (an unprivileged process cannot go past it).
pub fn soft_limit_target(needed: u64, soft: u64, hard: u64) -> Option<u64> {
    (soft < needed && soft < hard).then(|| needed.min(hard))
}

/// `wanted` shrunk to what `limit` descriptors allow: the node's cap to what fits beside
/// [`FD_RESERVE`], a container's to a quarter of that and a UID's to three quarters (so
/// that one container or one UID leaves the others room), each at least 1.
pub fn caps_within(limit: u64, wanted: Caps) -> Caps {
    if limit >= descriptors_needed(&wanted) {
        return wanted;
    }
    let total = (limit.saturating_sub(FD_RESERVE) / FDS_PER_CONNECTION).max(1) as usize;
    Caps {
        total,
        per_container: wanted.per_container.min(total / 4).max(1),
        per_uid: wanted.per_uid.min(total * 3 / 4).max(1),
    }
}

/// Why a connection was closed at once.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// The node's cap.
    #[error("the daemon holds {cap} connections already (the most it keeps)")]
    Node {
        /// The cap.
        cap: usize,
    },
    /// The container's cap.
    #[error("container {container} holds {cap} connections already (the most per container)")]
    Container {
        /// The container ([`container_key`]).
        container: String,
        /// The cap.
        cap: usize,
    },
    /// The UID's cap.
    #[error("uid {uid} holds {cap} connections already (the most per UID)")]
    Uid {
        /// The UID.
        uid: u32,
        /// The cap.
        cap: usize,
    },
}

impl Refusal {
    /// The `reason` label of `vgpu_daemon_connections_refused_total`.
    pub fn label(&self) -> &'static str {
        match self {
            Refusal::Node { .. } => "node",
            Refusal::Container { .. } => "container",
            Refusal::Uid { .. } => "uid",
        }
    }
}

/// The connections open now, by container and by UID.
#[derive(Debug)]
pub struct Table {
    caps: Caps,
    total: usize,
    by_container: HashMap<String, usize>,
    by_uid: HashMap<u32, usize>,
}

impl Table {
    /// An empty table with these caps.
    pub fn new(caps: Caps) -> Table {
        Table {
            caps,
            total: 0,
            by_container: HashMap::new(),
            by_uid: HashMap::new(),
        }
    }

    /// The caps.
    pub fn caps(&self) -> Caps {
        self.caps
    }

    /// Connections open now.
    pub fn open(&self) -> usize {
        self.total
    }

    /// Counts a new connection of `container` and `uid`, or refuses it (counting nothing).
    pub fn try_open(&mut self, container: &str, uid: u32) -> Result<(), Refusal> {
        if self.total >= self.caps.total {
            return Err(Refusal::Node {
                cap: self.caps.total,
            });
        }
        if self.by_container.get(container).copied().unwrap_or(0) >= self.caps.per_container {
            return Err(Refusal::Container {
                container: container.to_owned(),
                cap: self.caps.per_container,
            });
        }
        if self.by_uid.get(&uid).copied().unwrap_or(0) >= self.caps.per_uid {
            return Err(Refusal::Uid {
                uid,
                cap: self.caps.per_uid,
            });
        }
        self.total += 1;
        *self.by_container.entry(container.to_owned()).or_default() += 1;
        *self.by_uid.entry(uid).or_default() += 1;
        Ok(())
    }

    /// Forgets a connection [`Table::try_open`] counted (entries at 0 are dropped).
    pub fn close(&mut self, container: &str, uid: u32) {
        self.total = self.total.saturating_sub(1);
        if let Some(n) = self.by_container.get_mut(container) {
            *n -= 1;
            if *n == 0 {
                self.by_container.remove(container);
            }
        }
        if let Some(n) = self.by_uid.get_mut(&uid) {
            *n -= 1;
            if *n == 0 {
                self.by_uid.remove(&uid);
            }
        }
    }
}

/// The container a peer belongs to, from its `/proc/PID/cgroup` text: the pod and
/// container ids when the path is a Kubernetes pod's (so that sub-cgroups a container
/// made are still that container), else the cgroup2 (`0::`) path, else the first line's
/// path; `"unknown"` when there is none (the peer exited, or lives in a PID namespace the
/// daemon does not see: all such share one cap).
pub fn container_key(proc_cgroup: &str) -> String {
    let paths = || {
        proc_cgroup
            .lines()
            .filter_map(|l| l.splitn(3, ':').nth(2))
            .filter(|p| !p.is_empty())
    };
    if let Some(p) = paths().find_map(vgpu_core::kube_cgroup::pod_of_cgroup) {
        return match p.container_id {
            Some(c) => format!("pod {}/{c}", p.pod_uid),
            None => format!("pod {}", p.pod_uid),
        };
    }
    let unified = proc_cgroup
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .filter(|p| !p.is_empty());
    unified
        .or_else(|| paths().next())
        .map_or_else(|| "unknown".to_owned(), str::to_owned)
}

/// Which accept errors mean the daemon is short of a resource (descriptors, memory):
/// retrying at once would spin, so accepting pauses ([`accept_backoff`]).
pub fn accept_error_is_shortage(errno: Option<i32>) -> bool {
    matches!(
        errno,
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
    )
}

/// The pause after the `consecutive`-th accept error in a row (1 for the first): 1 ms,
/// doubling, at most 100 ms; none for an error that is not a shortage (a peer that left
/// before it was accepted).
pub fn accept_backoff(consecutive: u32, shortage: bool) -> Duration {
    if !shortage || consecutive == 0 {
        return Duration::ZERO;
    }
    let ms = 1u64 << consecutive.saturating_sub(1).min(7);
    Duration::from_millis(ms.min(100))
}

/// What the shims' socket saw, for `/metrics`.
#[derive(Debug, Default)]
pub struct SocketStats {
    accept_errors: AtomicU64,
    refused_node: AtomicU64,
    refused_container: AtomicU64,
    refused_uid: AtomicU64,
    open: AtomicU64,
    /// (caps, soft descriptor limit) once the server started.
    limits: Mutex<Option<(Caps, u64)>>,
}

impl SocketStats {
    /// An accept failed.
    pub fn accept_error(&self) {
        self.accept_errors.fetch_add(1, Ordering::Relaxed);
    }

    /// A connection was refused.
    pub fn refused(&self, r: &Refusal) {
        let c = match r {
            Refusal::Node { .. } => &self.refused_node,
            Refusal::Container { .. } => &self.refused_container,
            Refusal::Uid { .. } => &self.refused_uid,
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    /// Connections open now.
    pub fn set_open(&self, n: usize) {
        self.open.store(n as u64, Ordering::Relaxed);
    }

    /// The caps in force and the descriptor limit they were fitted to.
    pub fn set_limits(&self, caps: Caps, nofile: u64) {
        *self.limits.lock().unwrap_or_else(|p| p.into_inner()) = Some((caps, nofile));
    }

    /// Accept errors so far.
    pub fn accept_errors(&self) -> u64 {
        self.accept_errors.load(Ordering::Relaxed)
    }

    /// Prometheus text of the socket's families.
    pub fn metrics(&self) -> String {
        use vgpu_core::prom::{Family, Kind};
        let mut errors = Family::new(
            "vgpu_daemon_accept_errors_total",
            Kind::Counter,
            "Accepts on the shims' socket that failed (the daemon backs off and goes on).",
        );
        errors.sample(&[], self.accept_errors() as f64);
        let mut refused = Family::new(
            "vgpu_daemon_connections_refused_total",
            Kind::Counter,
            "Connections to the shims' socket closed at once, by the cap they hit (node, container, uid).",
        );
        for (reason, c) in [
            ("node", &self.refused_node),
            ("container", &self.refused_container),
            ("uid", &self.refused_uid),
        ] {
            refused.sample(&[("reason", reason)], c.load(Ordering::Relaxed) as f64);
        }
        let mut open = Family::new(
            "vgpu_daemon_connections_open",
            Kind::Gauge,
            "Connections open on the shims' socket (registered or not yet).",
        );
        open.sample(&[], self.open.load(Ordering::Relaxed) as f64);
        let mut cap = Family::new(
            "vgpu_daemon_connections_cap",
            Kind::Gauge,
            "Most connections open at once on the shims' socket, by scope (node, container, uid).",
        );
        let mut nofile = Family::new(
            "vgpu_daemon_descriptor_limit",
            Kind::Gauge,
            "The daemon's soft RLIMIT_NOFILE after it raised it at start.",
        );
        if let Some((c, n)) = *self.limits.lock().unwrap_or_else(|p| p.into_inner()) {
            cap.sample(&[("scope", "node")], c.total as f64);
            cap.sample(&[("scope", "container")], c.per_container as f64);
            cap.sample(&[("scope", "uid")], c.per_uid as f64);
            nofile.sample(&[], n as f64);
        }
        let mut s = String::new();
        for f in [&errors, &refused, &open, &cap, &nofile] {
            f.write(&mut s);
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_caps_need_about_twenty_thousand_descriptors() {
        assert_eq!(DEFAULT_CAPS.total, 5120);
        assert_eq!(descriptors_needed(&DEFAULT_CAPS), 256 + 4 * 5120);
    }

    // A container cannot take the node; one UID leaves a quarter to the others.
    const _: () = assert!(DEFAULT_CAPS.per_container < DEFAULT_CAPS.per_uid);
    const _: () = assert!(DEFAULT_CAPS.per_uid < DEFAULT_CAPS.total);

    #[test]
    fn the_soft_limit_is_raised_to_the_need_at_most_the_hard_limit() {
        assert_eq!(soft_limit_target(20_736, 1024, 1_048_576), Some(20_736));
        assert_eq!(soft_limit_target(20_736, 1024, 4096), Some(4096));
        assert_eq!(soft_limit_target(20_736, 65_536, 1_048_576), None);
        assert_eq!(soft_limit_target(20_736, 4096, 4096), None);
    }

    #[test]
    fn caps_fit_the_descriptors_there_are() {
        assert_eq!(caps_within(1 << 20, DEFAULT_CAPS), DEFAULT_CAPS);
        assert_eq!(
            caps_within(descriptors_needed(&DEFAULT_CAPS), DEFAULT_CAPS),
            DEFAULT_CAPS
        );
        // The default soft limit: 192 connections, 48 per container, 144 per UID.
        let c = caps_within(1024, DEFAULT_CAPS);
        assert_eq!(
            c,
            Caps {
                total: 192,
                per_container: 48,
                per_uid: 144
            }
        );
        assert!(descriptors_needed(&c) <= 1024);
        // Hard limit 20,000 (this machine): just short of the default.
        let c = caps_within(20_000, DEFAULT_CAPS);
        assert_eq!(c.total, 4936);
        assert_eq!(c.per_container, 1024);
        assert_eq!(c.per_uid, 3702);
        // Absurdly low: still one connection.
        let c = caps_within(10, DEFAULT_CAPS);
        assert_eq!((c.total, c.per_container, c.per_uid), (1, 1, 1));
    }

    #[test]
    fn a_container_at_its_cap_leaves_the_others_served() {
        let mut t = Table::new(Caps {
            total: 10,
            per_container: 3,
            per_uid: 5,
        });
        for _ in 0..3 {
            t.try_open("/a", 0).unwrap();
        }
        let r = t.try_open("/a", 0).unwrap_err();
        assert_eq!(
            r.to_string(),
            "container /a holds 3 connections already (the most per container)"
        );
        assert_eq!(r.label(), "container");
        t.try_open("/b", 0).unwrap();
        t.try_open("/b", 0).unwrap();
        // UID 0 is at 5: a third container of UID 0 is refused, another UID is not.
        assert_eq!(t.try_open("/c", 0), Err(Refusal::Uid { uid: 0, cap: 5 }));
        t.try_open("/c", 1000).unwrap();
        assert_eq!(t.open(), 6);
        t.close("/a", 0);
        t.try_open("/a", 0).unwrap();
        for u in 2000..2004 {
            t.try_open(&format!("/d{u}"), u).unwrap();
        }
        assert_eq!(t.try_open("/e", 7), Err(Refusal::Node { cap: 10 }));
        // A refusal counted nothing.
        assert_eq!(t.open(), 10);
        for u in 2000..2004 {
            t.close(&format!("/d{u}"), u);
        }
        assert_eq!(t.open(), 6);
        assert!(!t.by_uid.contains_key(&2000));
    }

    #[test]
    fn the_container_key_is_the_pod_container_or_the_cgroup_path() {
        let k8s = "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1234abcd_5678_90ef_1234_567890abcdef.slice/cri-containerd-0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef.scope\n";
        let key = container_key(k8s);
        assert!(
            key.starts_with("pod 1234abcd-5678-90ef-1234-567890abcdef/"),
            "{key}"
        );
        // A sub-cgroup the container made is still the container.
        let sub = k8s.trim_end().to_owned() + "/mine/deeper\n";
        assert_eq!(container_key(&sub), key);
        assert_eq!(
            container_key("0::/user.slice/session-1.scope\n"),
            "/user.slice/session-1.scope"
        );
        assert_eq!(
            container_key("4:memory:/docker/abc\n0::/\n"),
            "/",
            "the cgroup2 path wins over v1 ones"
        );
        assert_eq!(container_key("4:memory:/docker/abc\n"), "/docker/abc");
        assert_eq!(container_key(""), "unknown");
    }

    #[test]
    fn accept_backs_off_on_shortage_only() {
        assert!(accept_error_is_shortage(Some(libc::EMFILE)));
        assert!(accept_error_is_shortage(Some(libc::ENFILE)));
        assert!(!accept_error_is_shortage(Some(libc::ECONNABORTED)));
        assert!(!accept_error_is_shortage(None));
        assert_eq!(accept_backoff(1, true), Duration::from_millis(1));
        assert_eq!(accept_backoff(2, true), Duration::from_millis(2));
        assert_eq!(accept_backoff(7, true), Duration::from_millis(64));
        assert_eq!(accept_backoff(8, true), Duration::from_millis(100));
        assert_eq!(accept_backoff(1000, true), Duration::from_millis(100));
        assert_eq!(accept_backoff(5, false), Duration::ZERO);
    }

    #[test]
    fn metrics_name_every_cap_and_refusal_reason() {
        let s = SocketStats::default();
        s.accept_error();
        s.refused(&Refusal::Uid { uid: 1, cap: 1 });
        s.set_open(3);
        s.set_limits(DEFAULT_CAPS, 20_736);
        let m = s.metrics();
        for line in [
            "vgpu_daemon_accept_errors_total 1",
            "vgpu_daemon_connections_refused_total{reason=\"uid\"} 1",
            "vgpu_daemon_connections_refused_total{reason=\"container\"} 0",
            "vgpu_daemon_connections_open 3",
            "vgpu_daemon_connections_cap{scope=\"container\"} 1024",
            "vgpu_daemon_descriptor_limit 20736",
        ] {
            assert!(m.contains(line), "{line} missing from\n{m}");
        }
    }
}
