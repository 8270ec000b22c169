//! Bounds on the shims' socket, so that no tenant can exhaust the daemon (issue 39, item
//! 4): how many connections the node, one container (cgroup) and one UID may hold open,
//! the descriptors those caps need (the daemon raises its soft `RLIMIT_NOFILE` to that at
//! start, and fits the caps to what it got), and how accepting backs off after an error.
//! The decisions are pure functions over explicit inputs ([`admit`], [`peer_of`]);
//! [`crate::server`] applies them and [`SocketStats`] counts what happened for `/metrics`.
//!
//! The UID cap bounds only peers outside a Kubernetes pod's container (ADR 0056): many
//! containers run as the same UID (root, 1000), and a UID cap they shared would let one
//! tenant's containers starve their same-UID neighbours. A pod's container is bounded by
//! its own cap, and the node's last quarter ([`reserve`]) goes only to containers holding
//! few connections, so that a few full containers leave the others served.

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

/// Who a peer is, for the caps ([`peer_of`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peer {
    /// The key its connections are counted under ([`container_key`]).
    pub container: String,
    /// A Kubernetes pod's container: bounded by its container's cap (and the node's), not
    /// by its UID's.
    pub in_pod_container: bool,
}

/// Connections held now, as a new peer sees them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Held {
    /// On the node.
    pub node: usize,
    /// By the peer's container.
    pub container: usize,
    /// By the peer's UID outside pods' containers.
    pub uid: usize,
}

/// The node's reserve: once `caps.total - reserve.0` connections are open, a new one is
/// admitted only when its container holds fewer than `reserve.1`. A quarter of the node,
/// for containers holding fewer than a sixteenth of a container's cap (each at least 1).
pub fn reserve(caps: &Caps) -> (usize, usize) {
    ((caps.total / 4).max(1), (caps.per_container / 16).max(1))
}

/// Whether `peer` (UID `uid`) may open one more connection, given what is `held`; the
/// refusal names the cap. Its UID's cap applies only outside pods' containers.
pub fn admit(caps: &Caps, peer: &Peer, uid: u32, held: Held) -> Result<(), Refusal> {
    if held.node >= caps.total {
        return Err(Refusal::Node { cap: caps.total });
    }
    if held.container >= caps.per_container {
        return Err(Refusal::Container {
            container: peer.container.clone(),
            cap: caps.per_container,
        });
    }
    if !peer.in_pod_container && held.uid >= caps.per_uid {
        return Err(Refusal::Uid {
            uid,
            cap: caps.per_uid,
        });
    }
    let (reserved, small) = reserve(caps);
    if held.node >= caps.total.saturating_sub(reserved) && held.container >= small {
        return Err(Refusal::Reserve {
            container: peer.container.clone(),
            reserved,
            small,
        });
    }
    Ok(())
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
    /// The node's reserve ([`reserve`]): the node nearly full, the container not small.
    #[error(
        "container {container} holds {small} connections or more and the node's last {reserved} are kept for containers holding fewer"
    )]
    Reserve {
        /// The container ([`container_key`]).
        container: String,
        /// Connections kept.
        reserved: usize,
        /// Fewer than this, a container may take one of them.
        small: usize,
    },
    /// The UID's cap (peers outside pods' containers only).
    #[error(
        "uid {uid} holds {cap} connections already outside pods' containers (the most per UID)"
    )]
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
            Refusal::Reserve { .. } => "reserve",
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

    /// Counts a new connection of `peer` and `uid`, or refuses it ([`admit`]; counting
    /// nothing). A peer in a pod's container is not counted under its UID.
    pub fn try_open(&mut self, peer: &Peer, uid: u32) -> Result<(), Refusal> {
        let held = Held {
            node: self.total,
            container: self.by_container.get(&peer.container).copied().unwrap_or(0),
            uid: self.by_uid.get(&uid).copied().unwrap_or(0),
        };
        admit(&self.caps, peer, uid, held)?;
        self.total += 1;
        *self.by_container.entry(peer.container.clone()).or_default() += 1;
        if !peer.in_pod_container {
            *self.by_uid.entry(uid).or_default() += 1;
        }
        Ok(())
    }

    /// Forgets a connection [`Table::try_open`] counted (entries at 0 are dropped).
    pub fn close(&mut self, peer: &Peer, uid: u32) {
        self.total = self.total.saturating_sub(1);
        if let Some(n) = self.by_container.get_mut(&peer.container) {
            *n -= 1;
            if *n == 0 {
                self.by_container.remove(&peer.container);
            }
        }
        if peer.in_pod_container {
            return;
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

/// Who a peer is, from its `/proc/PID/cgroup` text (`None`: unreadable, the peer gone):
/// its [`container_key`], and whether it is a Kubernetes pod's container. That is, the
/// path [`container_key`] took the pod from names a container id (a process in the pod's
/// own cgroup could make sub-cgroups named like containers) and its `kubepods` directory
/// is at most one level below the cgroup root (kubelet's layouts, also under a cgroup
/// root of its own, `kubelet.slice/kubelet-kubepods.slice`; `..` parts, seen from a
/// daemon in a cgroup namespace, skipped). A `kubepods` deeper down is one a process made
/// in a cgroup delegated to it (`user.slice/…/user@UID.service/…`): not a container, so
/// that minting pod-shaped cgroups does not escape the UID cap.
pub fn peer_of(proc_cgroup: Option<&str>) -> Peer {
    let Some(text) = proc_cgroup else {
        return Peer {
            container: "unknown".to_owned(),
            in_pod_container: false,
        };
    };
    let in_pod_container = text
        .lines()
        .filter_map(|l| l.splitn(3, ':').nth(2))
        .find_map(|path| Some((path, vgpu_core::kube_cgroup::pod_of_cgroup(path)?)))
        .is_some_and(|(path, pod)| {
            // Without its first two parts the path is no pod's when `kubepods` was one
            // of them.
            let below: Vec<&str> = path
                .split('/')
                .filter(|part| !part.is_empty() && *part != "..")
                .skip(2)
                .collect();
            pod.container_id.is_some()
                && vgpu_core::kube_cgroup::pod_of_cgroup(&below.join("/")).is_none()
        });
    Peer {
        container: container_key(text),
        in_pod_container,
    }
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
    refused_reserve: AtomicU64,
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
            Refusal::Reserve { .. } => &self.refused_reserve,
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
            "Connections to the shims' socket closed at once, by the cap they hit (node, container, reserve, uid).",
        );
        for (reason, c) in [
            ("node", &self.refused_node),
            ("container", &self.refused_container),
            ("reserve", &self.refused_reserve),
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

    /// A peer outside pods (its UID's cap applies).
    fn host(key: &str) -> Peer {
        Peer {
            container: key.to_owned(),
            in_pod_container: false,
        }
    }

    /// A pod's container (its UID's cap does not apply).
    fn pod(key: &str) -> Peer {
        Peer {
            container: key.to_owned(),
            in_pod_container: true,
        }
    }

    #[test]
    fn a_container_at_its_cap_leaves_the_others_served() {
        let mut t = Table::new(Caps {
            total: 20,
            per_container: 3,
            per_uid: 5,
        });
        for _ in 0..3 {
            t.try_open(&host("/a"), 0).unwrap();
        }
        let r = t.try_open(&host("/a"), 0).unwrap_err();
        assert_eq!(
            r.to_string(),
            "container /a holds 3 connections already (the most per container)"
        );
        assert_eq!(r.label(), "container");
        t.try_open(&host("/b"), 0).unwrap();
        t.try_open(&host("/b"), 0).unwrap();
        // UID 0 is at 5 outside pods: a third cgroup of UID 0 is refused, another UID is
        // not.
        assert_eq!(
            t.try_open(&host("/c"), 0),
            Err(Refusal::Uid { uid: 0, cap: 5 })
        );
        t.try_open(&host("/c"), 1000).unwrap();
        assert_eq!(t.open(), 6);
        t.close(&host("/a"), 0);
        t.try_open(&host("/a"), 0).unwrap();
        for u in 2000..2009 {
            t.try_open(&host(&format!("/d{u}")), u).unwrap();
        }
        assert_eq!(t.open(), 15);
        // The node's last 5 (a quarter) go to containers holding none (3 / 16, at least 1).
        assert_eq!(reserve(&t.caps()), (5, 1));
        let r = t.try_open(&host("/c"), 1000).unwrap_err();
        assert_eq!(
            r,
            Refusal::Reserve {
                container: "/c".into(),
                reserved: 5,
                small: 1
            }
        );
        assert_eq!(r.label(), "reserve");
        for u in 3000..3005 {
            t.try_open(&host(&format!("/e{u}")), u).unwrap();
        }
        assert_eq!(t.try_open(&host("/f"), 7), Err(Refusal::Node { cap: 20 }));
        // A refusal counted nothing.
        assert_eq!(t.open(), 20);
        for u in 2000..2009 {
            t.close(&host(&format!("/d{u}")), u);
        }
        assert_eq!(t.open(), 11);
        assert!(!t.by_uid.contains_key(&2000));
    }

    #[test]
    fn same_uid_pod_containers_do_not_share_a_uid_cap() {
        let caps = Caps {
            total: 100,
            per_container: 4,
            per_uid: 6,
        };
        let mut t = Table::new(caps);
        // Three containers of one tenant, all root, at their caps: 12 connections, more
        // than the UID's 6.
        for c in ["pod a/1", "pod a/2", "pod a/3"] {
            for _ in 0..4 {
                t.try_open(&pod(c), 0).unwrap();
            }
            assert!(matches!(
                t.try_open(&pod(c), 0),
                Err(Refusal::Container { .. })
            ));
        }
        assert!(!t.by_uid.contains_key(&0), "pods' containers count no UID");
        // A root neighbour in another pod is served; so is a root process on the host.
        t.try_open(&pod("pod b/1"), 0).unwrap();
        t.try_open(&host("/system.slice/x"), 0).unwrap();
        assert_eq!(t.by_uid[&0], 1);
        t.close(&pod("pod a/1"), 0);
        t.close(&host("/system.slice/x"), 0);
        assert!(!t.by_uid.contains_key(&0));
        // The pure decision: the UID's count matters only outside pods' containers.
        let held = Held {
            node: 10,
            container: 0,
            uid: 6,
        };
        assert_eq!(admit(&caps, &pod("pod c/1"), 0, held), Ok(()));
        assert_eq!(
            admit(&caps, &host("/c"), 0, held),
            Err(Refusal::Uid { uid: 0, cap: 6 })
        );
    }

    #[test]
    fn a_peer_is_a_pods_container_only_where_kubelet_puts_them() {
        let cgroupfs =
            "0::/kubepods/burstable/pod1234abcd-5678-90ef-1234-567890abcdef/0123456789abcdef\n";
        let p = peer_of(Some(cgroupfs));
        assert!(p.in_pod_container, "{p:?}");
        assert_eq!(p.container, container_key(cgroupfs));
        for known in [
            "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1234abcd_5678_90ef_1234_567890abcdef.slice/cri-containerd-0123456789abcdef.scope\n",
            "0::/kubepods.slice/kubepods-pod1234abcd_5678_90ef_1234_567890abcdef.slice/crio-0123456789abcdef.scope\n",
            // kubelet's own cgroup root, and a daemon in a cgroup namespace.
            "0::/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/kubelet-kubepods-besteffort-pod1234abcd_5678_90ef_1234_567890abcdef.slice/cri-containerd-0123456789abcdef.scope\n",
            "0::/../../kubepods/pod1234abcd-5678-90ef-1234-567890abcdef/0123456789abcdef\n",
            // A sub-cgroup the container made.
            "0::/kubepods/pod1234abcd-5678-90ef-1234-567890abcdef/0123456789abcdef/mine\n",
            // The tests' layout: one directory above kubelet's.
            "0::/vgpu-test-x-1/kubepods/burstable/pod1234abcd-5678-90ef-1234-567890abcdef/0123456789abcdef\n",
        ] {
            assert!(peer_of(Some(known)).in_pod_container, "{known}");
        }
        for unknown in [
            // No container: the pod's own cgroup.
            "0::/kubepods/burstable/pod1234abcd-5678-90ef-1234-567890abcdef\n",
            // Pod-shaped cgroups made in a delegated subtree.
            "0::/user.slice/user-1000.slice/user@1000.service/app.slice/kubepods/pod1234abcd-5678-90ef-1234-567890abcdef/0123456789abcdef\n",
            "0::/a/b/kubepods/pod1234abcd-5678-90ef-1234-567890abcdef/0123456789abcdef\n",
            "0::/user.slice/session-1.scope\n",
            "0::/\n",
            "",
        ] {
            assert!(!peer_of(Some(unknown)).in_pod_container, "{unknown}");
        }
        assert_eq!(
            peer_of(None),
            Peer {
                container: "unknown".into(),
                in_pod_container: false
            }
        );
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
            "vgpu_daemon_connections_refused_total{reason=\"reserve\"} 0",
            "vgpu_daemon_connections_open 3",
            "vgpu_daemon_connections_cap{scope=\"container\"} 1024",
            "vgpu_daemon_descriptor_limit 20736",
        ] {
            assert!(m.contains(line), "{line} missing from\n{m}");
        }
    }
}
