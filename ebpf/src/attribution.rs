//! Which pod and container a cgroup path belongs to: the daemon resolves an event's cgroup
//! id to a path, this names the pod by its UID, and the daemon's pod registry turns the UID
//! into namespace/name. The reader of kubelet's cgroup names is `vgpu_core::kube_cgroup`
//! (shared with the device plugin's audit); this module names it for the loader's users.

pub use vgpu_core::kube_cgroup::{PodCgroup, QosClass, pod_of_cgroup};
