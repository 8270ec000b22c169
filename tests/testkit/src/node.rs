//! A whole simulated node for tests and the benchmark: a fake API server, a fake kubelet,
//! and the plugin wired by its own composition root (`run::start`, as `run` wires it)
//! over the fake's client and a GPU list the test controls, served and registered.

use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tonic::transport::Channel;
use vgpu_core::container_quota::{ContainerQuota, QUOTA_FILE};
use vgpu_core::inventory::GpuInfo;
use vgpu_core::resources::{
    ASSIGNMENT_VERSION, Assignment, ContainerAssignment, GpuGrant, RESOURCE_GPU,
};
use vgpu_device_plugin::config::Config;
use vgpu_device_plugin::handshake::Handshake;
use vgpu_device_plugin::kubelet::v1beta1::device_plugin_client::DevicePluginClient;
use vgpu_device_plugin::run::{Deps, prepare, start};

use crate::fake_api::FakeApi;
use crate::fake_kubelet::{Admitted, FakeContainer, FakeKubelet};

/// The node's name in every test.
pub const NODE: &str = "node-a";

/// `n` GPUs `GPU-<i>…` of `memory_mib` each, healthy.
pub fn gpus(n: u32, memory_mib: u64) -> Vec<GpuInfo> {
    (0..n)
        .map(|i| GpuInfo {
            index: i,
            uuid: format!("GPU-{i:08x}-1111-2222-3333-444444444444"),
            model: "NVIDIA A100-SXM4-80GB".into(),
            memory_mib,
            healthy: true,
            topology: None,
        })
        .collect()
}

/// A running node.
#[derive(Debug)]
pub struct TestNode {
    /// Keeps the directory alive.
    pub root: tempfile::TempDir,
    /// The plugin's configuration.
    pub cfg: Arc<Config>,
    /// The fake API server.
    pub api: FakeApi,
    /// The fake kubelet.
    pub kubelet: FakeKubelet,
    /// The GPU list the plugin serves (send to change health).
    pub gpus: watch::Sender<Vec<GpuInfo>>,
    /// The plugin's handshake (to read its List call count).
    pub handshake: Handshake,
    /// The kubelet's client of the plugin.
    pub client: DevicePluginClient<Channel>,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for TestNode {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// One container of a test pod: name, slices, init, and its grants (uuid, memory MiB,
/// compute milli, slices) — empty grants for a container without GPU.
pub type PodContainer<'a> = (&'a str, bool, Vec<(String, u64, u32, u32)>);

/// A bound pod JSON with requests and the assignment for `containers`.
pub fn pod_json(
    namespace: &str,
    name: &str,
    uid: &str,
    seq: u32,
    containers: &[PodContainer<'_>],
) -> Value {
    let mut assignment = Assignment {
        version: ASSIGNMENT_VERSION,
        node: NODE.into(),
        containers: Vec::new(),
    };
    let mut init = Vec::new();
    let mut app = Vec::new();
    for (cname, is_init, grants) in containers {
        let slices: u32 = grants.iter().map(|g| g.3).sum();
        let mut c = json!({"name": cname, "image": "x"});
        if slices > 0 {
            c["resources"] = json!({"requests": {RESOURCE_GPU: slices.to_string()},
                                    "limits": {RESOURCE_GPU: slices.to_string()}});
            assignment.containers.push(ContainerAssignment {
                name: (*cname).to_owned(),
                gpus: grants
                    .iter()
                    .map(|(uuid, mem, milli, s)| GpuGrant {
                        uuid: uuid.clone(),
                        memory_mib: *mem,
                        compute_milli: *milli,
                        slices: *s,
                    })
                    .collect(),
            });
        }
        if *is_init { init.push(c) } else { app.push(c) }
    }
    json!({
        "metadata": {
            "namespace": namespace, "name": name, "uid": uid,
            "creationTimestamp": format!("2026-01-01T00:{:02}:{:02}Z", (seq / 60) % 60, seq % 60),
            "annotations": {vgpu_core::resources::ANNOTATION_ASSIGNMENT: assignment.to_json()},
        },
        "spec": {"nodeName": NODE, "containers": app, "initContainers": init},
        "status": {"phase": "Pending"},
    })
}

/// The fake kubelet's view of the same containers.
pub fn fake_containers(containers: &[PodContainer<'_>]) -> Vec<FakeContainer> {
    containers
        .iter()
        .map(|(n, init, g)| FakeContainer {
            name: (*n).to_owned(),
            slices: g.iter().map(|x| x.3 as usize).sum(),
            init: *init,
            sidecar: false,
        })
        .collect()
}

impl TestNode {
    /// Starts the fakes and the plugin, waits for registration and connects.
    pub async fn start(gpu_list: Vec<GpuInfo>) -> anyhow::Result<TestNode> {
        TestNode::start_with(gpu_list, |_| {}).await
    }

    /// [`TestNode::start`], with the plugin's configuration adjusted by `tune` (paths are
    /// set already, the audit, the clean-up and the daemon's event stream off; it is
    /// validated after).
    pub async fn start_with(
        gpu_list: Vec<GpuInfo>,
        tune: impl FnOnce(&mut Config),
    ) -> anyhow::Result<TestNode> {
        let root = tempfile::tempdir()?;
        let mut cfg = Config::new(NODE);
        cfg.device_plugin_dir = root.path().join("device-plugins");
        cfg.pod_resources_socket = root.path().join("pod-resources/kubelet.sock");
        cfg.state_dir = root.path().join("state");
        cfg.host_state_dir = root.path().join("state");
        cfg.dev_dir = root.path().join("dev");
        cfg.call_timeout = Duration::from_secs(5);
        cfg.kubelet_poll = Duration::from_millis(20);
        cfg.audit_interval = None;
        cfg.daemon_api_socket = None;
        cfg.gc_interval = None;
        tune(&mut cfg);
        let cfg = prepare(cfg)?;
        // The GPUs' device nodes, as a host with the driver has them (plain files here:
        // the plugin only checks that they exist and names them to the runtime).
        std::fs::create_dir_all(&cfg.dev_dir)?;
        for g in &gpu_list {
            std::fs::write(
                vgpu_device_plugin::preflight::device_node(&cfg.dev_dir, g),
                b"",
            )?;
        }
        let api = FakeApi::start().await?;
        let mut kubelet =
            FakeKubelet::start(&cfg.device_plugin_dir, &cfg.pod_resources_socket).await?;
        let (tx, rx) = watch::channel(gpu_list);
        let deps = Deps {
            client: api.client()?,
            gpus: rx,
            inventory_retry: Duration::from_millis(100),
        };
        let plugin = start(cfg.clone(), deps).await?;
        let handshake = plugin.handshake().clone();
        let tasks = vec![tokio::spawn(plugin.serve(std::future::pending()))];
        let (_, reg) = kubelet.wait_registered(1, Duration::from_secs(10)).await?;
        let dp = kubelet.connect(&reg.endpoint).await?;
        kubelet
            .wait_devices("the first device list", Duration::from_secs(10), |d| {
                !d.is_empty()
            })
            .await?;
        let store = handshake
            .pods()
            .ok_or_else(|| anyhow::anyhow!("the plugin has no pod watch"))?;
        tokio::time::timeout(Duration::from_secs(10), store.wait_until_ready()).await??;
        Ok(TestNode {
            root,
            cfg,
            api,
            kubelet,
            gpus: tx,
            handshake,
            client: dp,
            tasks,
        })
    }

    /// The quota record the plugin wrote for the container holding `ids` (`vgpu.conf` in
    /// its allocation directory); `None` while it is absent or empty (not started yet).
    pub fn read_quota(&self, ids: &[String]) -> Option<ContainerQuota> {
        let dir = self
            .handshake
            .allocation_dir(ids.iter().map(String::as_str));
        let text = std::fs::read_to_string(dir.join(QUOTA_FILE)).ok()?;
        if text.is_empty() {
            return None;
        }
        Some(ContainerQuota::from_json(&text).expect("a valid quota record"))
    }

    /// The way most tests start a pod: [`pod_json`] of `containers` put on the API server
    /// ([`TestNode::put_pod`]), then kubelet's admission of it through `client`.
    pub async fn place(
        &self,
        client: &mut DevicePluginClient<Channel>,
        (namespace, name, uid, index): (&str, &str, &str, u32),
        containers: &[PodContainer<'_>],
    ) -> anyhow::Result<Admitted> {
        self.put_pod(pod_json(namespace, name, uid, index, containers))
            .await?;
        Ok(self
            .kubelet
            .admit(client, namespace, name, &fake_containers(containers))
            .await?)
    }

    /// Puts a pod on the API server and waits (at most 10 s) until the plugin's pod watch
    /// has it, as it would long before kubelet admits the pod.
    pub async fn put_pod(&self, pod: Value) -> anyhow::Result<()> {
        let ns = pod["metadata"]["namespace"]
            .as_str()
            .unwrap_or("default")
            .to_owned();
        let name = pod["metadata"]["name"].as_str().unwrap_or("").to_owned();
        self.api.put_pod(pod);
        let end = tokio::time::Instant::now() + Duration::from_secs(10);
        while !self.handshake.watch_has(&ns, &name) {
            anyhow::ensure!(
                tokio::time::Instant::now() < end,
                "the plugin's pod watch never showed {ns}/{name}"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        Ok(())
    }
}
