//! Checks at start (and at `Allocate`) that the node can do what the configuration asks,
//! so that a setup that cannot work is refused at once, naming what is missing, instead
//! of failing later in the container runtime (`failed to generate spec: lstat
//! /dev/nvidia0`) or silently (CDI devices that kubelet drops).
//!
//! The decisions are pure ([`cdi_support`], [`parse_version`]); [`device_nodes`] and
//! [`node_versions`] are the thin I/O around them.

use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use vgpu_core::inventory::GpuInfo;

/// The first kubelet that passes a device plugin's CDI devices to the runtime by
/// default (`DevicePluginCDIDevices` beta and on in 1.29; alpha and off in 1.28).
pub const KUBELET_CDI_DEFAULT: (u32, u32) = (1, 29);
/// The first kubelet that has the `DevicePluginCDIDevices` gate at all.
pub const KUBELET_CDI_GATE: (u32, u32) = (1, 28);
/// The first containerd that reads CDI devices from the CRI (with `enable_cdi = true`
/// in 1.7; on by default from 2.0).
pub const CONTAINERD_CDI: (u32, u32) = (1, 7);

/// Why the plugin refuses to start.
#[derive(Debug, thiserror::Error)]
pub enum PreflightError {
    /// A GPU's device node is missing (device-node mode).
    #[error(
        "device node {path} of GPU {uuid} (index {index}) does not exist: the runtime could not give it to a container; point --dev-dir at the host's device directory as the plugin sees it, or use --cdi"
    )]
    DeviceNode {
        /// The missing path.
        path: PathBuf,
        /// The GPU.
        uuid: String,
        /// Its NVML index.
        index: u32,
    },
    /// The node's kubelet would drop CDI devices.
    #[error(
        "--cdi: kubelet {version} on node {node} does not pass CDI devices to the runtime (needs kubelet >= 1.29, or 1.28 with --feature-gates=DevicePluginCDIDevices=true and --kubelet-cdi-gate); the container would get no GPU"
    )]
    KubeletTooOld {
        /// The node.
        node: String,
        /// Kubelet's version as the Node reports it.
        version: String,
    },
    /// The node's container runtime cannot read CDI devices.
    #[error(
        "--cdi: container runtime {version} on node {node} cannot inject CDI devices (needs containerd >= 1.7 with enable_cdi = true, or 2.0+)"
    )]
    RuntimeTooOld {
        /// The node.
        node: String,
        /// The runtime's version as the Node reports it.
        version: String,
    },
}

/// The `(major, minor)` of a version string as the Node reports them: `v1.28.4`,
/// `v1.29.0-gke.1`, `v1.30.1+k3s1`, `1.7.2`; `None` when it does not start like one.
pub fn parse_version(text: &str) -> Option<(u32, u32)> {
    let t = text.trim().trim_start_matches('v');
    let mut parts = t.split(|c: char| !c.is_ascii_digit());
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

/// Whether CDI devices reach the container on a node with this kubelet and container
/// runtime (`status.nodeInfo`: `kubeletVersion`, `containerRuntimeVersion` such as
/// `containerd://1.7.2`). `gate`: the operator says kubelet 1.28 runs with
/// `DevicePluginCDIDevices`. `Ok` carries notes to log (what cannot be checked from
/// here); a version that cannot be read is such a note, not a refusal.
pub fn cdi_support(
    node: &str,
    kubelet: &str,
    runtime: &str,
    gate: bool,
) -> Result<Vec<String>, PreflightError> {
    let mut notes = Vec::new();
    match parse_version(kubelet) {
        Some(v) if v >= KUBELET_CDI_DEFAULT => {}
        Some(v) if v >= KUBELET_CDI_GATE && gate => notes.push(format!(
            "kubelet {kubelet}: CDI devices need its DevicePluginCDIDevices feature gate on (--kubelet-cdi-gate says it is)"
        )),
        Some(_) => {
            return Err(PreflightError::KubeletTooOld {
                node: node.to_owned(),
                version: kubelet.to_owned(),
            });
        }
        None => notes.push(format!(
            "kubelet version {kubelet:?} not understood: cannot check that it passes CDI devices"
        )),
    }
    if let Some(v) = runtime.strip_prefix("containerd://") {
        match parse_version(v) {
            Some(x) if x < CONTAINERD_CDI => {
                return Err(PreflightError::RuntimeTooOld {
                    node: node.to_owned(),
                    version: runtime.to_owned(),
                });
            }
            Some((1, _)) => notes.push(format!(
                "{runtime}: CDI needs enable_cdi = true in containerd's CRI plugin configuration"
            )),
            Some(_) => {}
            None => notes.push(format!(
                "container runtime version {runtime:?} not understood: cannot check CDI support"
            )),
        }
    } else {
        notes.push(format!(
            "container runtime {runtime:?}: its CDI support is not checked (CRI-O has it from 1.23)"
        ));
    }
    Ok(notes)
}

/// The host path of GPU `g`'s device node under `dev_dir`.
pub fn device_node(dev_dir: &Path, g: &GpuInfo) -> PathBuf {
    dev_dir.join(format!("nvidia{}", g.index))
}

/// Refuses the first GPU whose device node does not exist under `dev_dir`.
pub fn device_nodes(dev_dir: &Path, gpus: &[GpuInfo]) -> Result<(), PreflightError> {
    for g in gpus {
        let path = device_node(dev_dir, g);
        if std::fs::metadata(&path).is_err() {
            return Err(PreflightError::DeviceNode {
                path,
                uuid: g.uuid.clone(),
                index: g.index,
            });
        }
    }
    Ok(())
}

/// Kubelet's and the runtime's versions from this node's `status.nodeInfo`; `Err` says in
/// words why they could not be read (the caller logs it and goes on).
pub async fn node_versions(
    client: &kube::Client,
    node: &str,
    timeout: Duration,
) -> Result<(String, String), String> {
    let api: kube::Api<Node> = kube::Api::all(client.clone());
    match tokio::time::timeout(timeout, api.get_opt(node)).await {
        Err(_) => Err(format!("no answer from the API server within {timeout:?}")),
        Ok(Err(e)) => Err(crate::error::error_chain(&e)),
        Ok(Ok(None)) => Err(format!("node {node} not found")),
        Ok(Ok(Some(n))) => n
            .status
            .and_then(|s| s.node_info)
            .map(|i| (i.kubelet_version, i.container_runtime_version))
            .ok_or_else(|| format!("node {node} has no status.nodeInfo")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_as_nodes_report_them() {
        assert_eq!(parse_version("v1.28.4"), Some((1, 28)));
        assert_eq!(parse_version("v1.29.0-gke.1"), Some((1, 29)));
        assert_eq!(parse_version("v1.30.1+k3s1"), Some((1, 30)));
        assert_eq!(parse_version("1.7.2"), Some((1, 7)));
        assert_eq!(parse_version("2.0.0-rc.1"), Some((2, 0)));
        assert_eq!(parse_version(""), None);
        assert_eq!(parse_version("vx"), None);
        assert_eq!(parse_version("v1"), None);
    }

    #[test]
    fn cdi_is_refused_where_kubelet_or_containerd_would_drop_the_devices() {
        let ok = |k: &str, r: &str, gate: bool| cdi_support("n", k, r, gate);
        // Kubelet 1.28 (the cluster): refused, naming the version and the gate.
        let e = ok("v1.28.4", "containerd://1.7.13", false)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("v1.28.4") && e.contains("DevicePluginCDIDevices"),
            "{e}"
        );
        // ... unless the operator says the gate is on.
        assert!(ok("v1.28.4", "containerd://2.0.0", true).is_ok());
        // Older than 1.28: no gate to turn on.
        assert!(ok("v1.27.9", "containerd://2.0.0", true).is_err());
        // containerd 1.6 (the cluster) has no CDI in its CRI.
        let e = ok("v1.29.1", "containerd://1.6.20", false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("containerd://1.6.20"), "{e}");
        // containerd 1.7: works only with enable_cdi, which cannot be seen from here.
        let notes = ok("v1.29.1", "containerd://1.7.13", false).unwrap();
        assert!(notes.iter().any(|n| n.contains("enable_cdi")), "{notes:?}");
        assert!(
            ok("v1.31.0", "containerd://2.0.2", false)
                .unwrap()
                .is_empty()
        );
        // Unreadable versions are noted, not refused.
        assert_eq!(ok("weird", "cri-o://1.30.0", false).unwrap().len(), 2);
    }

    #[test]
    fn a_missing_device_node_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let g = |index: u32| GpuInfo {
            index,
            uuid: format!("GPU-{index}"),
            model: "m".into(),
            memory_mib: 1,
            healthy: true,
            topology: None,
        };
        std::fs::write(dir.path().join("nvidia0"), b"").unwrap();
        assert!(device_nodes(dir.path(), &[g(0)]).is_ok());
        let e = device_nodes(dir.path(), &[g(0), g(1)])
            .unwrap_err()
            .to_string();
        let want = dir.path().join("nvidia1");
        assert!(
            e.contains(&want.display().to_string()) && e.contains("GPU-1"),
            "{e}"
        );
        assert!(e.contains("--dev-dir"), "{e}");
    }
}
