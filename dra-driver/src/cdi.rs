//! What a prepared claim hands the container runtime, as pure functions of the
//! configuration and the claim's [`ClaimPlan`]: one CDI device per request of the claim
//! (`<cdi_kind>=<claim-uid>-<request>`), whose edits are those of the device plugin's
//! `Allocate` (ADR 0071): the request's directory at `VGPU_CONTAINER_DIR` with its quota
//! file read-only over it, the same directory read-only at the fixed path
//! [`FIXED_DIR`] (ADR 0042), the shim and `/etc/ld.so.preload`, the daemon socket's
//! directory, `CUDA_VISIBLE_DEVICES`/`NVIDIA_VISIBLE_DEVICES` by UUID in node-index
//! order, and (in [`DeviceMode::Nodes`]) the GPUs' device nodes. The quota file is the
//! shim's record ([`ContainerQuota`], written by `vgpu_core`'s encoder).

use std::path::{Path, PathBuf};

use serde_json::{Value, json};
use vgpu_core::container_quota::{ContainerQuota, FIXED_DIR, GpuQuota, QUOTA_FILE, QUOTA_VERSION};

use crate::claim::{ClaimPlan, ClaimRef, RequestPlan};
use crate::config::{Config, DeviceMode};

/// The CDI specification version written (`deviceNodes[].hostPath` needs 0.5.0).
pub const CDI_VERSION: &str = "0.5.0";
/// File name of the generated preload list in the state directory.
pub const PRELOAD_FILE: &str = "ld.so.preload";
/// Control device nodes every CUDA container needs besides its GPUs' own.
pub const CONTROL_NODES: [&str; 3] = ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"];

/// The CDI device name of one request of a claim (CDI names allow `[A-Za-z0-9_.:-]`;
/// a subrequest's `/` becomes `_`).
pub fn device_name(claim_uid: &str, request: &str) -> String {
    format!("{claim_uid}-{}", request.replace('/', "_"))
}

/// The request's directory under `root` (the state directory as the driver or the host
/// sees it): `claims/<uid>/<request>`.
pub fn request_dir(root: &Path, claim_uid: &str, request: &str) -> PathBuf {
    root.join("claims")
        .join(claim_uid)
        .join(request.replace('/', "_"))
}

/// The claim's CDI spec file in the CDI directory (a transient spec, one per claim).
pub fn spec_path(cfg: &Config, claim_uid: &str) -> PathBuf {
    let vendor = cfg.cdi_kind.replace('/', "-");
    cfg.cdi_dir.join(format!("{vendor}_{claim_uid}.json"))
}

/// The quota record of one request: the claim is the tenant (ADR 0071), so the record
/// names the claim's first consumer pod and `claim/<name>/<request>` as its container.
pub fn quota(
    claim: &ClaimRef,
    plan: &ClaimPlan,
    req: &RequestPlan,
    cdi_id: &str,
) -> ContainerQuota {
    ContainerQuota {
        version: QUOTA_VERSION,
        namespace: claim.namespace.clone(),
        pod: plan.pod.0.clone(),
        uid: plan.pod.1.clone(),
        container: format!("claim/{}/{}", claim.name, req.request),
        init: false,
        gpus: req
            .devices
            .iter()
            .map(|d| GpuQuota {
                uuid: d.uuid.clone(),
                memory_mib: d.memory_mib,
                // The claim's memory is guaranteed: no burst above it (ADR 0066).
                memory_limit_mib: None,
                compute_milli: d.compute_milli,
                slices: d.slices(),
                compute_policy: req.compute_policy,
                priority: req.priority,
            })
            .collect(),
        device_ids: vec![cdi_id.to_owned()],
    }
}

fn mount(host: &Path, container: &Path, read_only: bool) -> Value {
    json!({
        "hostPath": host.display().to_string(),
        "containerPath": container.display().to_string(),
        "options": [if read_only { "ro" } else { "rw" }, "nosuid", "nodev", "bind"],
    })
}

/// The claim's CDI spec: one device per request. `control_nodes` are the
/// [`CONTROL_NODES`] present in the device directory; `daemon_dir` the daemon socket's
/// host directory and file name when it is there to mount.
pub fn spec(
    cfg: &Config,
    claim: &ClaimRef,
    plan: &ClaimPlan,
    control_nodes: &[&str],
    daemon_dir: Option<(&Path, &str)>,
) -> Value {
    let devices: Vec<Value> = plan
        .requests
        .iter()
        .map(|req| {
            let host_dir = request_dir(&cfg.host_state_dir, &claim.uid, &req.request);
            let cdir = &cfg.container_dir;
            let mut mounts = vec![
                mount(&host_dir, cdir, false),
                mount(&host_dir.join(QUOTA_FILE), &cdir.join(QUOTA_FILE), true),
                mount(&host_dir, Path::new(FIXED_DIR), true),
                mount(&cfg.shim_host_path, &cfg.shim_container_path, true),
            ];
            if cfg.preload {
                mounts.push(mount(
                    &cfg.host_state_dir.join(PRELOAD_FILE),
                    Path::new("/etc/ld.so.preload"),
                    true,
                ));
            }
            let uuids: Vec<&str> = req.devices.iter().map(|d| d.uuid.as_str()).collect();
            let list = uuids.join(",");
            let mut env = vec![
                format!("VGPU_CONTAINER_DIR={}", cdir.display()),
                format!("CUDA_VISIBLE_DEVICES={list}"),
                format!("NVIDIA_VISIBLE_DEVICES={list}"),
            ];
            if let Some((dir, file)) = daemon_dir {
                mounts.push(mount(dir, &cfg.daemon_container_dir, true));
                env.push(format!(
                    "VGPU_DAEMON_SOCKET={}",
                    cfg.daemon_container_dir.join(file).display()
                ));
            }
            let mut edits = json!({"env": env, "mounts": mounts});
            if cfg.device_mode == DeviceMode::Nodes {
                let mut nodes: Vec<Value> = req
                    .devices
                    .iter()
                    .map(|d| {
                        json!({
                            "path": format!("/dev/nvidia{}", d.index),
                            "hostPath": cfg.dev_dir.join(format!("nvidia{}", d.index)).display().to_string(),
                        })
                    })
                    .collect();
                for c in control_nodes {
                    nodes.push(json!({
                        "path": format!("/dev/{c}"),
                        "hostPath": cfg.dev_dir.join(c).display().to_string(),
                    }));
                }
                edits["deviceNodes"] = Value::Array(nodes);
            }
            json!({
                "name": device_name(&claim.uid, &req.request),
                "containerEdits": edits,
            })
        })
        .collect();
    json!({
        "cdiVersion": CDI_VERSION,
        "kind": cfg.cdi_kind,
        "devices": devices,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::claim::PlannedDevice;
    use vgpu_core::sched_proto::{ComputePolicy, Priority};

    fn plan() -> ClaimPlan {
        ClaimPlan {
            pod: ("p".into(), "pu".into()),
            requests: vec![RequestPlan {
                request: "gpu/small".into(),
                devices: vec![PlannedDevice {
                    pool: "n".into(),
                    device: "gpu-1".into(),
                    uuid: "GPU-1".into(),
                    index: 1,
                    memory_mib: 4096,
                    compute_milli: 250,
                }],
                compute_policy: ComputePolicy::Cap,
                priority: Priority::BestEffort,
            }],
        }
    }

    #[test]
    fn the_spec_carries_the_quota_dir_shim_gpu_and_nodes() {
        let mut cfg = Config::new("n");
        cfg.host_state_dir = PathBuf::from("/host/dra");
        let claim = ClaimRef {
            namespace: "ml".into(),
            name: "c".into(),
            uid: "u1".into(),
        };
        let s = spec(
            &cfg,
            &claim,
            &plan(),
            &["nvidiactl"],
            Some((Path::new("/host/d"), "d.sock")),
        );
        assert_eq!(s["kind"], "vgpu.io/gpu");
        let d = &s["devices"][0];
        assert_eq!(d["name"], "u1-gpu_small");
        let e = &d["containerEdits"];
        assert_eq!(e["mounts"][0]["hostPath"], "/host/dra/claims/u1/gpu_small");
        assert_eq!(e["mounts"][1]["options"][0], "ro");
        assert_eq!(e["mounts"][2]["containerPath"], "/etc/vgpu");
        let env: Vec<&str> = e["env"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect();
        assert!(env.contains(&"CUDA_VISIBLE_DEVICES=GPU-1"), "{env:?}");
        assert!(
            env.contains(&"VGPU_DAEMON_SOCKET=/run/vgpu-daemon/d.sock"),
            "{env:?}"
        );
        assert_eq!(e["deviceNodes"][0]["path"], "/dev/nvidia1");
        assert_eq!(e["deviceNodes"][1]["hostPath"], "/dev/nvidiactl");
        cfg.device_mode = DeviceMode::Cdi;
        let s = spec(&cfg, &claim, &plan(), &["nvidiactl"], None);
        assert!(
            s["devices"][0]["containerEdits"]
                .get("deviceNodes")
                .is_none()
        );

        let q = quota(
            &claim,
            &plan(),
            &plan().requests[0],
            "vgpu.io/gpu=u1-gpu_small",
        );
        q.validate().unwrap();
        assert_eq!(q.container, "claim/c/gpu/small");
        assert_eq!(
            (
                q.gpus[0].memory_mib,
                q.gpus[0].compute_milli,
                q.gpus[0].slices
            ),
            (4096, 250, 3)
        );
        assert_eq!(q.gpus[0].compute_policy, ComputePolicy::Cap);
    }
}
