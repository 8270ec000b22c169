//! Which pod and container a cgroup belongs to, read from the names kubelet and the
//! container runtimes give cgroups: cgroup v1 and v2; the cgroupfs driver
//! (`kubepods/burstable/pod<uid>/<id>`) and the systemd driver
//! (`kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid_with_>.slice/
//! cri-containerd-<id>.scope`), with containerd, CRI-O and Docker scopes. The one reader
//! of that format: the daemon names the pod of an eBPF event's cgroup with it, the device
//! plugin's audit the pod of a process's `/proc/<pid>/cgroup`.

/// A pod's QoS class, from the kubepods sub-tree the pod lives in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QosClass {
    /// Directly under kubepods.
    Guaranteed,
    /// Under kubepods/burstable.
    Burstable,
    /// Under kubepods/besteffort.
    BestEffort,
}

/// The pod (and container) a cgroup path names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodCgroup {
    /// QoS class.
    pub qos: QosClass,
    /// Pod UID with dashes (`0b5a…-…`), as the API server spells it.
    pub pod_uid: String,
    /// Container id (64 hex digits for containerd/CRI-O/Docker), when the path goes that deep.
    pub container_id: Option<String>,
}

/// Parses a cgroup path — absolute under a mount (`/sys/fs/cgroup/memory/kubepods/…`), as in
/// `/proc/<pid>/cgroup` (`/kubepods.slice/…`), or relative — into its pod; `None` when the
/// path is not under kubepods. A kubelet with a cgroup root of its own nests the tree
/// (`kubelet.slice/kubelet-kubepods.slice/…`, `/kubelet/kubepods/…`); that is read too.
pub fn pod_of_cgroup(path: &str) -> Option<PodCgroup> {
    let parts: Vec<&str> = path.split('/').filter(|part| !part.is_empty()).collect();
    let root = parts.iter().position(|part| is_kubepods(part))?;
    let mut rest = parts[root + 1..].iter().copied();
    let mut next = rest.next()?;
    let qos = match qos_of(next) {
        Some(qos) => {
            next = rest.next()?;
            qos
        }
        None => QosClass::Guaranteed,
    };
    let pod_uid = pod_uid_of(next)?;
    let container_id = rest.next().and_then(container_id_of);
    Some(PodCgroup {
        qos,
        pod_uid,
        container_id,
    })
}

/// The pod UID in a `/proc/<pid>/cgroup` text (`hierarchy:controllers:path` lines, one
/// for cgroup v2, one per hierarchy for v1): that of the first line whose path is a pod's.
pub fn pod_uid_of_proc_cgroup(text: &str) -> Option<String> {
    text.lines().find_map(|line| {
        let path = line.splitn(3, ':').nth(2)?;
        pod_of_cgroup(path).map(|p| p.pod_uid)
    })
}

/// `kubepods` (cgroupfs) or `kubepods.slice` (systemd), also under a cgroup root of
/// kubelet's own (`kubelet-kubepods.slice`).
fn is_kubepods(part: &str) -> bool {
    part == "kubepods" || part == "kubepods.slice" || part.ends_with("-kubepods.slice")
}

fn qos_of(part: &str) -> Option<QosClass> {
    match part {
        "burstable" => Some(QosClass::Burstable),
        "besteffort" => Some(QosClass::BestEffort),
        unit if unit.ends_with("kubepods-burstable.slice") => Some(QosClass::Burstable),
        unit if unit.ends_with("kubepods-besteffort.slice") => Some(QosClass::BestEffort),
        _ => None,
    }
}

/// `pod<uid>` (cgroupfs) or `kubepods[-qos]-pod<uid_with_underscores>.slice` (systemd).
fn pod_uid_of(part: &str) -> Option<String> {
    let uid = match part.strip_suffix(".slice") {
        Some(unit) => unit.rsplit_once("-pod")?.1.replace('_', "-"),
        None => part.strip_prefix("pod")?.to_owned(),
    };
    let valid = !uid.is_empty() && uid.chars().all(|c| c.is_ascii_hexdigit() || c == '-');
    valid.then_some(uid)
}

/// `<id>` (cgroupfs) or `cri-containerd-<id>.scope`, `crio-<id>.scope`, `docker-<id>.scope`.
fn container_id_of(part: &str) -> Option<String> {
    let id = match part.strip_suffix(".scope") {
        Some(unit) => unit.rsplit_once('-')?.1,
        None => part,
    };
    let valid = !id.is_empty() && id.chars().all(|c| c.is_ascii_hexdigit());
    valid.then(|| id.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    const UID: &str = "0b5a2c1e-3f4d-4e5f-8a9b-0c1d2e3f4a5b";
    const CID: &str = "4f2c9e0d1b7a6c5e8d3f2a1b0c9d8e7f6a5b4c3d2e1f0a9b8c7d6e5f4a3b2c1d";

    fn pod(qos: QosClass, container: bool) -> Option<PodCgroup> {
        Some(PodCgroup {
            qos,
            pod_uid: UID.to_owned(),
            container_id: container.then(|| CID.to_owned()),
        })
    }

    #[test]
    fn cgroupfs_driver_v1_and_v2() {
        let v1 = format!("/sys/fs/cgroup/memory/kubepods/burstable/pod{UID}/{CID}");
        assert_eq!(pod_of_cgroup(&v1), pod(QosClass::Burstable, true));
        let v2 = format!("/kubepods/pod{UID}/{CID}");
        assert_eq!(pod_of_cgroup(&v2), pod(QosClass::Guaranteed, true));
        let besteffort = format!("/sys/fs/cgroup/kubepods/besteffort/pod{UID}");
        assert_eq!(pod_of_cgroup(&besteffort), pod(QosClass::BestEffort, false));
    }

    #[test]
    fn systemd_driver_with_containerd_crio_and_docker_scopes() {
        let uid = UID.replace('-', "_");
        let containerd = format!(
            "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid}.slice/\
             cri-containerd-{CID}.scope"
        );
        assert_eq!(pod_of_cgroup(&containerd), pod(QosClass::Burstable, true));
        let crio = format!(
            "/sys/fs/cgroup/unified/kubepods.slice/kubepods-pod{uid}.slice/crio-{CID}.scope"
        );
        assert_eq!(pod_of_cgroup(&crio), pod(QosClass::Guaranteed, true));
        let docker = format!(
            "kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{uid}.slice/\
             docker-{CID}.scope"
        );
        assert_eq!(pod_of_cgroup(&docker), pod(QosClass::BestEffort, true));
    }

    #[test]
    fn a_cgroup_root_of_kubelets_own_nests_the_tree() {
        let uid = UID.replace('-', "_");
        let systemd = format!(
            "/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-burstable.slice/\
             kubelet-kubepods-burstable-pod{uid}.slice/cri-containerd-{CID}.scope"
        );
        assert_eq!(pod_of_cgroup(&systemd), pod(QosClass::Burstable, true));
        let cgroupfs = format!("/kubelet/kubepods/besteffort/pod{UID}/{CID}");
        assert_eq!(pod_of_cgroup(&cgroupfs), pod(QosClass::BestEffort, true));
    }

    #[test]
    fn paths_outside_kubepods_or_malformed_name_no_pod() {
        assert_eq!(pod_of_cgroup("/system.slice/containerd.service"), None);
        assert_eq!(pod_of_cgroup("/kubepods"), None);
        assert_eq!(pod_of_cgroup("/kubepods/burstable"), None);
        assert_eq!(pod_of_cgroup("/kubepods/burstable/notapod"), None);
        assert_eq!(
            pod_of_cgroup("/kubepods.slice/kubepods-podXYZ!.slice"),
            None
        );
        let sandbox = format!("/kubepods/pod{UID}/not-hex");
        assert_eq!(pod_of_cgroup(&sandbox), pod(QosClass::Guaranteed, false));
    }

    #[test]
    fn pod_uids_come_from_both_cgroup_drivers() {
        let systemd = "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod0c5a1c2e_59c1_4c3e_9d51_1f0e4d7a8b9c.slice/cri-containerd-abc.scope\n";
        assert_eq!(
            pod_uid_of_proc_cgroup(systemd).as_deref(),
            Some("0c5a1c2e-59c1-4c3e-9d51-1f0e4d7a8b9c")
        );
        let cgroupfs =
            "12:memory:/kubepods/besteffort/pod0c5a1c2e-59c1-4c3e-9d51-1f0e4d7a8b9c/3f1e\n0::/\n";
        assert_eq!(
            pod_uid_of_proc_cgroup(cgroupfs).as_deref(),
            Some("0c5a1c2e-59c1-4c3e-9d51-1f0e4d7a8b9c")
        );
        assert_eq!(
            pod_uid_of_proc_cgroup("0::/user.slice/user-1000.slice\n"),
            None
        );
        assert_eq!(
            pod_uid_of_proc_cgroup("0::/kubepods/podnot-a-uid/x\n"),
            None
        );
    }
}
