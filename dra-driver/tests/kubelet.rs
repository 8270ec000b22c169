//! The driver against a fake kubelet over real unix sockets and a fake API server:
//! registration, prepare (CDI spec and quota file), unprepare, a restart answered from
//! the checkpoint, claims refused naming the bad value, and the node's ResourceSlice.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::sync::watch;
use vgpu_core::container_quota::{ContainerQuota, QUOTA_FILE};
use vgpu_core::inventory::GpuInfo;
use vgpu_core::sched_proto::{ComputePolicy, Priority};
use vgpu_dra_driver::config::Config;
use vgpu_dra_driver::run::{Started, start};
use vgpu_testkit::fake_api::FakeApi;
use vgpu_testkit::fake_dra_kubelet::{FakeDraKubelet, Registered};

const NODE: &str = "n1";
const WAIT: Duration = Duration::from_secs(10);
const GPU1: &str = "GPU-11111111-2222-3333-4444-555555555551";

fn gpus() -> Vec<GpuInfo> {
    (0..2)
        .map(|i| GpuInfo {
            index: i,
            uuid: format!("GPU-11111111-2222-3333-4444-55555555555{i}"),
            model: "Sim A100".into(),
            memory_mib: 40960,
            healthy: true,
            topology: None,
        })
        .collect()
}

struct Node {
    root: tempfile::TempDir,
    api: FakeApi,
    cfg: Config,
}

impl Node {
    async fn new() -> Node {
        let root = tempfile::tempdir().expect("a temporary directory");
        let r = root.path();
        let mut cfg = Config::new(NODE);
        cfg.registry_dir = r.join("plugins_registry");
        cfg.plugin_dir = r.join("plugins/vgpu.io");
        cfg.cdi_dir = r.join("cdi");
        cfg.state_dir = r.join("state");
        cfg.host_state_dir = r.join("state");
        cfg.dev_dir = r.join("dev");
        cfg.daemon_socket = Some(r.join("daemon/daemon.sock"));
        std::fs::create_dir_all(&cfg.dev_dir).expect("make the device directory");
        std::fs::create_dir_all(r.join("daemon")).expect("make the daemon directory");
        for n in ["nvidia0", "nvidia1", "nvidiactl"] {
            std::fs::write(cfg.dev_dir.join(n), b"").expect("make a device node stand-in");
        }
        let api = FakeApi::start().await.expect("start the fake API server");
        Node { root, api, cfg }
    }

    async fn start(&self) -> Started {
        let (_tx, rx) = watch::channel(gpus());
        let client = self.api.client().expect("a client of the fake API server");
        start(self.cfg.clone(), client, rx)
            .await
            .expect("the driver starts")
    }

    async fn kubelet(&self) -> Registered {
        FakeDraKubelet::new(&self.cfg.registry_dir)
            .register(WAIT)
            .await
            .expect("kubelet registers the driver")
    }

    fn spec(&self, uid: &str) -> PathBuf {
        self.cfg.cdi_dir.join(format!("vgpu.io-gpu_{uid}.json"))
    }

    fn claim_gets(&self, name: &str) -> usize {
        self.api
            .calls_matching("GET", &format!("/resourceclaims/{name}"))
            .len()
    }
}

/// A claim allocated by the scheduler: `results` in `status.allocation.devices`.
fn claim(name: &str, uid: &str, results: Value, config: Value) -> Value {
    json!({
        "metadata": {"name": name, "namespace": "ml", "uid": uid},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "vgpu.io"}}]}},
        "status": {
            "allocation": {"devices": {"results": results, "config": config}},
            "reservedFor": [{"resource": "pods", "name": "trainer", "uid": "pod-uid-1"}]
        }
    })
}

fn shared(device: &str, memory: &str, compute: &str) -> Value {
    json!([{"request": "gpu", "driver": "vgpu.io", "pool": NODE, "device": device,
            "shareID": "7f0c", "consumedCapacity": {"memory": memory, "compute": compute}}])
}

fn read_json(p: &Path) -> Value {
    let text = std::fs::read_to_string(p).expect("read the file");
    serde_json::from_str(&text).expect("JSON")
}

#[tokio::test]
async fn registers_as_a_dra_plugin_serving_v1() {
    let node = Node::new().await;
    let driver = node.start().await;
    let mut status = driver.registration();
    let k = node.kubelet().await;
    assert_eq!(k.info.r#type, "DRAPlugin");
    assert_eq!(k.info.name, "vgpu.io");
    assert_eq!(PathBuf::from(&k.info.endpoint), node.cfg.dra_socket());
    assert_eq!(k.service, "v1.DRAPlugin");
    assert_eq!(k.socket, node.cfg.registry_dir.join("vgpu.io-reg.sock"));
    let told = tokio::time::timeout(WAIT, status.wait_for(Option::is_some))
        .await
        .expect("NotifyRegistrationStatus reached the driver")
        .unwrap()
        .clone();
    assert_eq!(told, Some(Ok(())));
    driver.stop().await;
    assert!(!node.cfg.registration_socket().exists());
}

#[tokio::test]
async fn publishes_one_shareable_device_per_gpu_by_server_side_apply() {
    let node = Node::new().await;
    let driver = node.start().await;
    let deadline = tokio::time::Instant::now() + WAIT;
    let slice = loop {
        if let Some(s) = node.api.resource_slice("n1-vgpu.io") {
            break s;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no ResourceSlice applied within {WAIT:?}: {:?}",
            node.api
                .calls_matching("PATCH", "/resourceslices/n1-vgpu.io")
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(slice["spec"]["driver"], "vgpu.io");
    assert_eq!(slice["spec"]["nodeName"], NODE);
    assert_eq!(slice["spec"]["pool"]["name"], NODE);
    let devices = slice["spec"]["devices"].as_array().unwrap();
    let names: Vec<&str> = devices.iter().filter_map(|d| d["name"].as_str()).collect();
    assert_eq!(names, ["gpu-0", "gpu-1"]);
    assert_eq!(devices[1]["attributes"]["uuid"]["string"], GPU1);
    assert_eq!(devices[1]["allowMultipleAllocations"], true);
    assert_eq!(devices[1]["capacity"]["memory"]["value"], "40960Mi");
    assert_eq!(devices[1]["capacity"]["compute"]["value"], "1");
    driver.stop().await;
}

#[tokio::test]
async fn prepare_writes_the_cdi_spec_and_quota_and_unprepare_removes_them() {
    let node = Node::new().await;
    node.api.put_resource_claim(claim(
        "c1",
        "uid-1",
        shared("gpu-1", "4Gi", "300m"),
        json!([{"source": "FromClaim", "opaque": {"driver": "vgpu.io", "parameters":
            {"apiVersion": "vgpu.io/v1alpha1", "kind": "GpuConfig",
             "computePolicy": "cap", "priority": "latency-sensitive"}}}]),
    ));
    let driver = node.start().await;
    let mut k = node.kubelet().await;
    let r = k.prepare(&[("ml", "c1", "uid-1")]).await.unwrap();
    let entry = &r.claims["uid-1"];
    assert_eq!(entry.error, "");
    assert_eq!(entry.devices.len(), 1);
    let d = &entry.devices[0];
    assert_eq!(
        (d.pool_name.as_str(), d.device_name.as_str()),
        (NODE, "gpu-1")
    );
    assert_eq!(d.request_names, ["gpu"]);
    assert_eq!(d.cdi_device_ids, ["vgpu.io/gpu=uid-1-gpu"]);

    // The CDI spec: the device kubelet named, with the quota directory, the shim, the GPU.
    let spec = read_json(&node.spec("uid-1"));
    assert_eq!(spec["kind"], "vgpu.io/gpu");
    let dev = &spec["devices"][0];
    assert_eq!(dev["name"], "uid-1-gpu");
    let edits = &dev["containerEdits"];
    let env: Vec<&str> = edits["env"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert!(
        env.contains(&format!("CUDA_VISIBLE_DEVICES={GPU1}").as_str()),
        "{env:?}"
    );
    assert!(env.contains(&"VGPU_CONTAINER_DIR=/var/run/vgpu"), "{env:?}");
    assert!(
        env.contains(&"VGPU_DAEMON_SOCKET=/run/vgpu-daemon/daemon.sock"),
        "{env:?}"
    );
    let mounts = edits["mounts"].as_array().unwrap();
    let to = |c: &str| {
        mounts
            .iter()
            .find(|m| m["containerPath"] == c)
            .unwrap_or_else(|| panic!("no mount at {c}: {mounts:?}"))
            .clone()
    };
    assert_eq!(to("/usr/local/vgpu/libvgpu.so")["options"][0], "ro");
    assert_eq!(to("/etc/ld.so.preload")["options"][0], "ro");
    let fixed = to("/etc/vgpu");
    assert_eq!(fixed["options"][0], "ro");
    let nodes: Vec<&str> = edits["deviceNodes"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|n| n["path"].as_str())
        .collect();
    assert_eq!(nodes, ["/dev/nvidia1", "/dev/nvidiactl"]);

    // The quota file at the mount's source: the claim's share of the GPU, the shim's format.
    let dir = PathBuf::from(fixed["hostPath"].as_str().unwrap());
    let q =
        ContainerQuota::from_json(&std::fs::read_to_string(dir.join(QUOTA_FILE)).unwrap()).unwrap();
    assert_eq!(q.namespace, "ml");
    assert_eq!((q.pod.as_str(), q.uid.as_str()), ("trainer", "pod-uid-1"));
    assert_eq!(q.gpus.len(), 1);
    let g = &q.gpus[0];
    assert_eq!(g.uuid, GPU1);
    assert_eq!((g.memory_mib, g.compute_milli, g.slices), (4096, 300, 3));
    assert_eq!(
        (g.compute_policy, g.priority),
        (ComputePolicy::Cap, Priority::LatencySensitive)
    );
    assert_eq!(
        std::fs::read_to_string(node.cfg.state_dir.join("ld.so.preload")).unwrap(),
        "/usr/local/vgpu/libvgpu.so\n"
    );

    let u = k.unprepare(&[("ml", "c1", "uid-1")]).await.unwrap();
    assert_eq!(u.claims["uid-1"].error, "");
    assert!(!node.spec("uid-1").exists());
    assert!(!dir.exists());
    assert!(driver.driver.prepared().await.is_empty());
    // Again: nothing left to do is not an error (kubelet repeats unprepare).
    let u = k.unprepare(&[("ml", "c1", "uid-1")]).await.unwrap();
    assert_eq!(u.claims["uid-1"].error, "");
    driver.stop().await;
}

#[tokio::test]
async fn a_restarted_driver_answers_re_prepare_from_its_checkpoint_and_unprepares() {
    let node = Node::new().await;
    node.api.put_resource_claim(claim(
        "c1",
        "uid-1",
        shared("gpu-0", "8Gi", "500m"),
        json!([]),
    ));
    let driver = node.start().await;
    let mut k = node.kubelet().await;
    let first = k.prepare(&[("ml", "c1", "uid-1")]).await.unwrap();
    assert_eq!(first.claims["uid-1"].error, "");
    assert_eq!(node.claim_gets("c1"), 1);
    // kubelet repeats a prepare it did not see answered: the same answer, no new read.
    let again = k.prepare(&[("ml", "c1", "uid-1")]).await.unwrap();
    assert_eq!(again.claims["uid-1"], first.claims["uid-1"]);
    assert_eq!(node.claim_gets("c1"), 1);

    driver.stop().await;
    // The claim is gone from the API server: only the checkpoint can answer now.
    assert!(node.api.delete_resource_claim("ml", "c1"));
    let driver = node.start().await;
    let mut k = node.kubelet().await;
    let after = k.prepare(&[("ml", "c1", "uid-1")]).await.unwrap();
    assert_eq!(after.claims["uid-1"], first.claims["uid-1"]);
    assert_eq!(node.claim_gets("c1"), 1, "answered from the checkpoint");
    assert_eq!(driver.driver.prepared().await, ["uid-1"]);

    let u = k.unprepare(&[("ml", "c1", "uid-1")]).await.unwrap();
    assert_eq!(u.claims["uid-1"].error, "");
    assert!(!node.spec("uid-1").exists());
    driver.stop().await;
    // And the unprepare is checkpointed too.
    let driver = node.start().await;
    assert!(driver.driver.prepared().await.is_empty());
    driver.stop().await;
}

#[tokio::test]
async fn bad_claims_get_an_error_naming_the_value_and_good_ones_are_prepared() {
    let node = Node::new().await;
    node.api.put_resource_claim(claim(
        "nvidia",
        "uid-n",
        json!([{"request": "gpu", "driver": "gpu.nvidia.com", "pool": NODE, "device": "gpu-0"}]),
        json!([]),
    ));
    node.api.put_resource_claim(claim(
        "big",
        "uid-b",
        shared("gpu-0", "48Gi", "200m"),
        json!([]),
    ));
    node.api.put_resource_claim(claim(
        "fast",
        "uid-f",
        shared("gpu-0", "1Gi", "1500m"),
        json!([]),
    ));
    node.api.put_resource_claim(claim(
        "ok",
        "uid-ok",
        shared("gpu-0", "1Gi", "100m"),
        json!([]),
    ));
    let mut unallocated = claim("pending", "uid-p", json!([]), json!([]));
    unallocated["status"] = json!({});
    node.api.put_resource_claim(unallocated);
    let driver = node.start().await;
    let mut k = node.kubelet().await;
    let r = k
        .prepare(&[
            ("ml", "ghost", "uid-g"),
            ("ml", "nvidia", "uid-n"),
            ("ml", "big", "uid-b"),
            ("ml", "fast", "uid-f"),
            ("ml", "pending", "uid-p"),
            ("ml", "ok", "other-uid"),
            ("ml", "ok", "uid-ok"),
        ])
        .await
        .unwrap();
    let err = |uid: &str| r.claims[uid].error.clone();
    assert!(
        err("uid-g").contains("ml/ghost") && err("uid-g").contains("not found"),
        "{}",
        err("uid-g")
    );
    assert!(
        err("uid-n").contains("\"vgpu.io\"") && err("uid-n").contains("gpu.nvidia.com"),
        "{}",
        err("uid-n")
    );
    assert!(
        err("uid-b").contains("memory \"48Gi\"") && err("uid-b").contains("40960 MiB"),
        "{}",
        err("uid-b")
    );
    assert!(
        err("uid-f").contains("compute \"1500m\""),
        "{}",
        err("uid-f")
    );
    assert!(err("uid-p").contains("not allocated"), "{}", err("uid-p"));
    assert!(
        err("other-uid").contains("\"uid-ok\""),
        "{}",
        err("other-uid")
    );
    for uid in ["uid-g", "uid-n", "uid-b", "uid-f", "uid-p", "other-uid"] {
        assert!(r.claims[uid].devices.is_empty());
        assert!(
            !node.spec(uid).exists(),
            "{uid}: no spec for a refused claim"
        );
    }
    assert_eq!(err("uid-ok"), "");
    assert_eq!(r.claims["uid-ok"].devices.len(), 1);
    assert_eq!(driver.driver.prepared().await, ["uid-ok"]);
    driver.stop().await;
    drop(node.root);
}
