//! Reports GPU processes that run without the shim: their memory and compute are not
//! limited, and nobody would know.
//!
//! The shim reaches a container through `/etc/ld.so.preload`, which some programs never
//! read: static binaries, musl-based images (Alpine's loader ignores `ld.so.preload`), a
//! process that execs with a cleared environment and its own loader, or an image that
//! mounts over `/etc`. Every [`Config::audit_interval`](crate::config::Config::audit_interval) the plugin asks NVML for each
//! GPU's processes and, for each one, reads `/proc/<pid>/maps`: a process that uses a GPU
//! and has no `libvgpu.so` mapped is *unenforced*. It is attributed to its container by
//! the quota file the plugin wrote for it (`/proc/<pid>/root` + the fixed
//! `/etc/vgpu/vgpu.conf` of ADR 0042, never a path from the process's environment),
//! cross-checked with the pod UID of its cgroup (`/proc/<pid>/cgroup`, which the process
//! cannot change); each one is logged, counted in the metrics
//! (`vgpu_plugin_unenforced_processes`) and reported once as a `Warning` event
//! `VgpuShimNotLoaded` on its pod.
//!
//! The plugin must see host PIDs (the DaemonSet runs with `hostPID`), like NVML.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Event, EventSource, ObjectReference, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use kube::Api;
use kube::api::PostParams;
use nvml_wrapper::Nvml;
use nvml_wrapper::enums::device::UsedGpuMemory;
use tokio::sync::watch;
use tracing::{info, warn};
use vgpu_core::container_quota::{ContainerQuota, QUOTA_FILE};
use vgpu_core::kube_cgroup::pod_uid_of_proc_cgroup;

use crate::config::Config;
use crate::error::error_chain;
use crate::handshake::Handshake;

/// The event reason posted on a pod with an unenforced process.
pub const EVENT_REASON: &str = "VgpuShimNotLoaded";
/// The event reason posted on a pod whose container holds more GPU memory than its quota.
pub const EVENT_OVER_QUOTA: &str = "VgpuMemoryOverQuota";

/// The container a process belongs to.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Owner {
    /// Namespace.
    pub namespace: String,
    /// Pod name.
    pub pod: String,
    /// Pod UID.
    pub uid: String,
    /// Container name.
    pub container: String,
}

/// A GPU process without the shim.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Unenforced {
    /// Host PID.
    pub pid: u32,
    /// Its command name (`/proc/<pid>/comm`).
    pub comm: String,
    /// The GPU it uses.
    pub gpu: String,
    /// GPU memory it holds, bytes (0 when NVML does not say).
    pub used_bytes: u64,
    /// Its container, when the plugin handed it one.
    pub owner: Option<Owner>,
    /// Its pod's UID per its cgroup, when it runs in a pod.
    pub cgroup_pod_uid: Option<String>,
}

/// A container whose processes hold more GPU memory (NVML's count, which the tenant
/// cannot touch) than its quota plus one context allowance per process: the shim's
/// shared counters were tampered with, or processes escaped it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct OverQuota {
    /// The container.
    pub owner: Owner,
    /// The GPU.
    pub gpu: String,
    /// GPU memory its processes hold per NVML, bytes.
    pub used_bytes: u64,
    /// Its memory quota on that GPU, bytes.
    pub quota_bytes: u64,
    /// Its processes on that GPU.
    pub processes: u32,
}

/// One audit.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Audit {
    /// GPU processes looked at (one per process and GPU).
    pub checked: usize,
    /// Those without the shim.
    pub unenforced: Vec<Unenforced>,
    /// Containers over their memory quota.
    pub over_quota: Vec<OverQuota>,
}

/// Whether a process has a file named one of `names` (e.g. `libvgpu.so`) mapped; `None`
/// when its maps cannot be read (it exited, or no permission).
pub fn shim_loaded(proc_root: &Path, pid: u32, names: &[&str]) -> Option<bool> {
    let maps = std::fs::read_to_string(proc_root.join(pid.to_string()).join("maps")).ok()?;
    Some(vgpu_core::proc_maps::maps_file_named(&maps, names))
}

/// The quota record of a process's container, read through its own root: the fixed
/// `/etc/vgpu/vgpu.conf` (ADR 0042), else (a container started by an older plugin)
/// `vgpu.conf` in `plugin_dir`, the directory the plugin mounts. Never a path from the
/// process's environment, which is the tenant's: a forged file there would hide the
/// container's excess from the audit.
pub fn quota_of(proc_root: &Path, pid: u32, plugin_dir: &Path) -> Option<ContainerQuota> {
    let root = proc_root.join(pid.to_string()).join("root");
    let fixed = Path::new(vgpu_core::container_quota::FIXED_QUOTA_FILE);
    let older = plugin_dir.join(QUOTA_FILE);
    let text = [fixed, older.as_path()].into_iter().find_map(|p| {
        let rel = p.strip_prefix("/").ok()?;
        std::fs::read_to_string(root.join(rel)).ok()
    })?;
    ContainerQuota::from_json(&text).ok()
}

/// Audits GPU processes `(pid, gpu uuid, bytes)` through `proc_root` (`/proc`).
pub fn audit(procs: &[(u32, String, u64)], proc_root: &Path, cfg: &Config) -> Audit {
    let shim_name = cfg.shim_container_path.file_name().map_or_else(
        || "libvgpu.so".to_owned(),
        |f| f.to_string_lossy().into_owned(),
    );
    let mut out = Audit::default();
    // Per container and GPU: (bytes, processes, quota bytes).
    let mut held: BTreeMap<(Owner, String), (u64, u32, u64)> = BTreeMap::new();
    for (pid, gpu, used) in procs {
        out.checked += 1;
        // Unreadable maps: the process exited meanwhile; nothing to report.
        let Some(loaded) = shim_loaded(proc_root, *pid, &[&shim_name, "libvgpu.so"]) else {
            continue;
        };
        let pdir = proc_root.join(pid.to_string());
        let cgroup_pod_uid = std::fs::read_to_string(pdir.join("cgroup"))
            .ok()
            .and_then(|t| pod_uid_of_proc_cgroup(&t));
        let quota = quota_of(proc_root, *pid, &cfg.container_dir)
            // A quota file of another pod than the cgroup's is not this process's.
            .filter(|q| cgroup_pod_uid.as_ref().is_none_or(|u| *u == q.uid));
        let owner = quota.as_ref().map(|q| Owner {
            namespace: q.namespace.clone(),
            pod: q.pod.clone(),
            uid: q.uid.clone(),
            container: q.container.clone(),
        });
        if let (Some(o), Some(q)) = (&owner, &quota) {
            // A GPU the quota file does not list has a quota of 0.
            let quota_bytes = q
                .gpus
                .iter()
                .find(|g| g.uuid == *gpu)
                .map_or(0, |g| g.memory_mib.saturating_mul(1 << 20));
            let e = held
                .entry((o.clone(), gpu.clone()))
                .or_insert((0, 0, quota_bytes));
            e.0 = e.0.saturating_add(*used);
            e.1 += 1;
        }
        if loaded {
            continue;
        }
        let comm = std::fs::read_to_string(pdir.join("comm"))
            .map(|c| c.trim().to_owned())
            .unwrap_or_default();
        out.unenforced.push(Unenforced {
            pid: *pid,
            comm,
            gpu: gpu.clone(),
            used_bytes: *used,
            owner,
            cgroup_pod_uid,
        });
    }
    for ((owner, gpu), (used_bytes, processes, quota_bytes)) in held {
        let allowance = cfg.context_allowance.saturating_mul(u64::from(processes));
        if used_bytes > quota_bytes.saturating_add(allowance) {
            out.over_quota.push(OverQuota {
                owner,
                gpu,
                used_bytes,
                quota_bytes,
                processes,
            });
        }
    }
    out.unenforced.sort();
    out
}

/// GPU processes `(pid, gpu uuid, bytes)`, and the GPUs left out (with the reason).
pub type GpuProcesses = (Vec<(u32, String, u64)>, Vec<String>);

/// Every GPU's compute and graphics processes `(pid, uuid, bytes)`. A GPU that does not
/// answer (lost, or its process list fails) is left out of this audit, with the reason;
/// only failing to count the GPUs fails the whole audit.
pub fn gpu_processes(nvml: &Nvml) -> Result<GpuProcesses, nvml_wrapper::error::NvmlError> {
    let mut out = Vec::new();
    let mut skipped = Vec::new();
    for i in 0..nvml.device_count()? {
        let listed = nvml.device_by_index(i).and_then(|d| {
            let uuid = d.uuid()?;
            let mut procs = d.running_compute_processes()?;
            procs.extend(d.running_graphics_processes().unwrap_or_default());
            Ok((uuid, procs))
        });
        let (uuid, procs) = match listed {
            Ok(x) => x,
            Err(e) => {
                skipped.push(format!("GPU {i}: {e}"));
                continue;
            }
        };
        let mut seen = BTreeSet::new();
        for p in procs {
            if seen.insert(p.pid) {
                let used = match p.used_gpu_memory {
                    UsedGpuMemory::Used(b) => b,
                    UsedGpuMemory::Unavailable => 0,
                };
                out.push((p.pid, uuid.clone(), used));
            }
        }
    }
    Ok((out, skipped))
}

/// Starts the audit thread: every `interval`, the GPU processes from NVML (`lib`, or the
/// system's `libnvidia-ml.so.1`) are audited and the result sent.
pub fn spawn(
    cfg: Arc<Config>,
    lib: Option<PathBuf>,
    interval: Duration,
) -> std::io::Result<watch::Receiver<Option<Audit>>> {
    let (tx, rx) = watch::channel(None);
    std::thread::Builder::new()
        .name("vgpu-audit".into())
        .spawn(move || {
            let lib = lib.unwrap_or_else(|| PathBuf::from("libnvidia-ml.so.1"));
            let mut nvml = None;
            let proc_root = Path::new("/proc");
            // Each distinct trouble is logged once (at warn), not every interval.
            let mut last_trouble = String::new();
            let mut trouble = |what: String| {
                if what != last_trouble {
                    warn!("audit: {what}");
                    last_trouble = what;
                }
            };
            loop {
                if nvml.is_none() {
                    match Nvml::builder().lib_path(lib.as_os_str()).init() {
                        Ok(n) => nvml = Some(n),
                        Err(e) => trouble(format!(
                            "NVML ({}) does not start: {e}; retrying every {interval:?}",
                            lib.display()
                        )),
                    }
                }
                if let Some(n) = &nvml {
                    match gpu_processes(n) {
                        Ok((p, skipped)) => {
                            if !skipped.is_empty() {
                                trouble(format!("GPUs left out: {}", skipped.join("; ")));
                            }
                            if tx.send(Some(audit(&p, proc_root, &cfg))).is_err() {
                                return;
                            }
                        }
                        Err(e) => trouble(format!("NVML cannot count the GPUs: {e}")),
                    }
                }
                std::thread::sleep(interval);
                if tx.is_closed() {
                    return;
                }
            }
        })?;
    Ok(rx)
}

/// A `Warning` event on `owner`'s pod (and container, when known).
pub(crate) fn pod_event(owner: &Owner, reason: &str, message: String, node: &str) -> Event {
    let now = Time(k8s_openapi::jiff::Timestamp::now());
    Event {
        metadata: ObjectMeta {
            generate_name: Some(format!("{}.vgpu-", owner.pod)),
            namespace: Some(owner.namespace.clone()),
            ..Default::default()
        },
        involved_object: ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Pod".into()),
            name: Some(owner.pod.clone()),
            namespace: Some(owner.namespace.clone()),
            uid: Some(owner.uid.clone()),
            field_path: (!owner.container.is_empty())
                .then(|| format!("spec.containers{{{}}}", owner.container)),
            ..Default::default()
        },
        reason: Some(reason.into()),
        type_: Some("Warning".into()),
        message: Some(message),
        source: Some(EventSource {
            component: Some("vgpu-device-plugin".into()),
            host: Some(node.to_owned()),
        }),
        first_timestamp: Some(now.clone()),
        last_timestamp: Some(now),
        count: Some(1),
        ..Default::default()
    }
}

fn event_for(u: &Unenforced, owner: &Owner, node: &str) -> Event {
    let message = format!(
        "process {} ({}) of container {:?} uses GPU {} ({} MiB) without the vgpu shim loaded: its GPU memory and compute are not limited (static binary, musl image or cleared preload?)",
        u.pid,
        u.comm,
        owner.container,
        u.gpu,
        u.used_bytes >> 20
    );
    pod_event(owner, EVENT_REASON, message, node)
}

fn over_quota_event(o: &OverQuota, node: &str) -> Event {
    let message = format!(
        "container {:?} holds {} MiB on GPU {} per NVML ({} processes), over its quota of {} MiB plus a context allowance per process: its limit was bypassed",
        o.owner.container,
        o.used_bytes >> 20,
        o.gpu,
        o.processes,
        o.quota_bytes >> 20
    );
    pod_event(&o.owner, EVENT_OVER_QUOTA, message, node)
}

/// The owner of a finding: its quota file's container, else the pod of its cgroup's UID
/// in the node's pod watch (container unknown).
fn resolve(u: &Unenforced, hs: &Handshake) -> Option<Owner> {
    if let Some(o) = &u.owner {
        return Some(o.clone());
    }
    let uid = u.cgroup_pod_uid.as_ref()?;
    let pod: Arc<Pod> = hs
        .pods()?
        .state()
        .into_iter()
        .find(|p| p.metadata.uid.as_ref() == Some(uid))?;
    Some(Owner {
        namespace: pod.metadata.namespace.clone().unwrap_or_default(),
        pod: pod.metadata.name.clone().unwrap_or_default(),
        uid: uid.clone(),
        container: String::new(),
    })
}

/// What the reporter has seen, for the metrics.
#[derive(Debug, Default, Clone)]
pub struct AuditState {
    /// The latest audit, with each finding's resolved owner.
    pub latest: Vec<(Unenforced, Option<Owner>)>,
    /// Containers over their memory quota in the latest audit.
    pub over_quota: Vec<OverQuota>,
    /// GPU processes looked at in the latest audit.
    pub checked: usize,
    /// Audits so far.
    pub audits: u64,
    /// Events posted so far (both reasons).
    pub events: u64,
}

/// Logs each new unenforced process, posts one event on its pod, and keeps `state`
/// current, for every audit `rx` delivers.
pub async fn report(
    hs: Handshake,
    mut rx: watch::Receiver<Option<Audit>>,
    state: Arc<Mutex<AuditState>>,
) {
    let mut reported: BTreeMap<(u32, String), ()> = BTreeMap::new();
    let mut over_reported: BTreeSet<(String, String, String)> = BTreeSet::new();
    while rx.changed().await.is_ok() {
        let Some(a) = rx.borrow_and_update().clone() else {
            continue;
        };
        let mut latest = Vec::new();
        let mut now_seen = BTreeMap::new();
        let mut posted = 0;
        for u in a.unenforced {
            let owner = resolve(&u, &hs);
            let key = (u.pid, u.gpu.clone());
            now_seen.insert(key.clone(), ());
            if !reported.contains_key(&key) {
                let who = owner
                    .as_ref()
                    .map(|o| format!("{}/{}:{}", o.namespace, o.pod, o.container))
                    .unwrap_or_else(|| "no vgpu container".into());
                warn!(pid = u.pid, comm = %u.comm, gpu = %u.gpu, container = %who, "a GPU process runs without the vgpu shim: not limited");
                if let Some(o) = &owner {
                    let api: Api<Event> = Api::namespaced(hs.client().clone(), &o.namespace);
                    let ev = event_for(&u, o, &hs.config().node_name);
                    match api.create(&PostParams::default(), &ev).await {
                        Ok(_) => posted += 1,
                        Err(e) => warn!(error = %error_chain(&e), "could not post the event"),
                    }
                }
            }
            latest.push((u, owner));
        }
        // A process that is gone (or now has the shim) may be reported again later.
        reported = now_seen;
        let mut over_now = BTreeSet::new();
        for o in &a.over_quota {
            let key = (
                o.owner.uid.clone(),
                o.owner.container.clone(),
                o.gpu.clone(),
            );
            if !over_reported.contains(&key) {
                warn!(
                    container = %format!("{}/{}:{}", o.owner.namespace, o.owner.pod, o.owner.container),
                    gpu = %o.gpu, used = o.used_bytes, quota = o.quota_bytes,
                    "a container holds more GPU memory than its quota"
                );
                let api: Api<Event> = Api::namespaced(hs.client().clone(), &o.owner.namespace);
                match api
                    .create(
                        &PostParams::default(),
                        &over_quota_event(o, &hs.config().node_name),
                    )
                    .await
                {
                    Ok(_) => posted += 1,
                    Err(e) => warn!(error = %error_chain(&e), "could not post the event"),
                }
            }
            over_now.insert(key);
        }
        over_reported = over_now;
        let mut st = state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        st.latest = latest;
        st.over_quota = a.over_quota;
        st.checked = a.checked;
        st.audits += 1;
        st.events += posted;
        if posted > 0 {
            info!(events = posted, "reported unenforced GPU processes");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_name_the_shim_even_when_its_file_was_replaced() {
        let root = tempfile::tempdir().unwrap();
        let p = root.path().join("42");
        std::fs::create_dir_all(&p).unwrap();
        std::fs::write(
            p.join("maps"),
            "7f00-7f10 r-xp 00000000 08:01 123   /usr/lib/libc.so.6\n7f20-7f30 r-xp 00000000 08:01 456   /usr/local/vgpu/libvgpu.so (deleted)\n7f40-7f50 rw-p 00000000 00:00 0 \n",
        )
        .unwrap();
        assert_eq!(shim_loaded(root.path(), 42, &["libvgpu.so"]), Some(true));
        std::fs::write(
            p.join("maps"),
            "7f00-7f10 r-xp 00000000 08:01 123   /usr/lib/libvgpu.so.bak\n",
        )
        .unwrap();
        assert_eq!(shim_loaded(root.path(), 42, &["libvgpu.so"]), Some(false));
        assert_eq!(shim_loaded(root.path(), 43, &["libvgpu.so"]), None);
    }

    #[test]
    fn the_quota_is_the_fixed_file_else_the_plugins_never_the_environments() {
        let proc_root = tempfile::tempdir().unwrap();
        let root = proc_root.path().join("7/root");
        let record = |pod: &str| {
            ContainerQuota {
                version: vgpu_core::container_quota::QUOTA_VERSION,
                namespace: "ns".into(),
                pod: pod.into(),
                uid: "u".into(),
                container: "c".into(),
                init: false,
                gpus: Vec::new(),
                device_ids: Vec::new(),
            }
            .to_json()
        };
        for (dir, pod) in [
            ("etc/vgpu", "fixed"),
            ("var/run/vgpu", "plugin"),
            ("tmp/forged", "forged"),
        ] {
            std::fs::create_dir_all(root.join(dir)).unwrap();
            std::fs::write(root.join(dir).join(QUOTA_FILE), record(pod)).unwrap();
        }
        std::fs::write(
            proc_root.path().join("7/environ"),
            b"VGPU_CONTAINER_DIR=/tmp/forged\0",
        )
        .unwrap();
        let pod = || quota_of(proc_root.path(), 7, Path::new("/var/run/vgpu")).map(|q| q.pod);
        assert_eq!(pod().as_deref(), Some("fixed"));
        std::fs::remove_file(root.join("etc/vgpu").join(QUOTA_FILE)).unwrap();
        assert_eq!(
            pod().as_deref(),
            Some("plugin"),
            "a container of an older plugin"
        );
        std::fs::remove_file(root.join("var/run/vgpu").join(QUOTA_FILE)).unwrap();
        assert_eq!(pod(), None, "the environment's directory is never read");
    }

    #[test]
    fn this_test_process_has_no_shim_and_is_attributed_by_its_quota_file() {
        // The test runs without the shim: a GPU "process" that is this one is unenforced;
        // its quota file is found through /proc/<pid>/root and the plugin's directory.
        let dir = tempfile::tempdir().unwrap();
        let q = ContainerQuota {
            version: vgpu_core::container_quota::QUOTA_VERSION,
            namespace: "ns".into(),
            pod: "p".into(),
            uid: "u".into(),
            container: "c".into(),
            init: false,
            gpus: Vec::new(),
            device_ids: Vec::new(),
        };
        std::fs::write(dir.path().join(QUOTA_FILE), q.to_json()).unwrap();
        let mut cfg = Config::new("n");
        cfg.container_dir = dir.path().to_owned();
        let me = std::process::id();
        let a = audit(&[(me, "GPU-x".into(), 1 << 20)], Path::new("/proc"), &cfg);
        assert_eq!(a.checked, 1);
        assert_eq!(a.unenforced.len(), 1);
        let u = &a.unenforced[0];
        assert_eq!(u.pid, me);
        assert_eq!(u.gpu, "GPU-x");
        // Outside a pod the cgroup has no pod UID, so the quota file decides.
        if u.cgroup_pod_uid.is_none() {
            assert_eq!(u.owner.as_ref().map(|o| o.pod.as_str()), Some("p"));
        }
        // A process that is gone is not reported.
        let gone = audit(
            &[(u32::MAX - 1, "GPU-x".into(), 0)],
            Path::new("/proc"),
            &cfg,
        );
        assert_eq!((gone.checked, gone.unenforced.len()), (1, 0));
    }
}
