//! The real `vgpu-device-plugin` binary, end to end on one simulated node: NVML from
//! cuda-sim, a fake kubelet over unix sockets, a fake API server through a kubeconfig.
//! Registration, the device list from NVML, the inventory on the Node, a pod's quota,
//! and a fault injected with `vgpu-sim` reaching kubelet and the Node.
//!
//! Needs the simulated driver (`cargo xtask sim`).

use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use vgpu_core::container_quota::{ContainerQuota, QUOTA_FILE};
use vgpu_core::inventory::NodeInventory;
use vgpu_device_plugin::ids::allocation_key;
use vgpu_device_plugin::kubelet::UNHEALTHY;
use vgpu_testkit::fake_api::FakeApi;
use vgpu_testkit::fake_kubelet::FakeKubelet;
use vgpu_testkit::node::{NODE, PodContainer, fake_containers, pod_json};
use vgpu_tests::{SimNode, sim_lib_dir};

const T: Duration = Duration::from_secs(20);

struct Kill(Child);
impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn inventory(api: &FakeApi) -> Option<NodeInventory> {
    let n = api.node(NODE)?;
    let t = n["metadata"]["annotations"]["vgpu.io/gpu-inventory"].as_str()?;
    Some(NodeInventory::from_json(t).expect("valid inventory"))
}

async fn wait_inventory(
    api: &FakeApi,
    what: &str,
    pred: impl Fn(&NodeInventory) -> bool,
) -> NodeInventory {
    let end = Instant::now() + T;
    loop {
        if let Some(i) = inventory(api).filter(|i| pred(i)) {
            return i;
        }
        assert!(
            Instant::now() < end,
            "timed out waiting for {what}: {:?}",
            inventory(api)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_on_a_simulated_node() {
    let sim = SimNode::new(
        r#"
        [[device]]
        name = "NVIDIA H100 80GB HBM3"
        memory = "8Gi"
        [[device]]
        name = "NVIDIA H100 80GB HBM3"
        memory = "8Gi"
        "#,
    );
    let root = tempfile::tempdir().expect("tempdir");
    let dp_dir = root.path().join("device-plugins");
    let pr_sock = root.path().join("pod-resources/kubelet.sock");
    let state = root.path().join("state");
    // The simulated GPUs' device nodes (plain files: the plugin checks they exist).
    let dev = root.path().join("dev");
    std::fs::create_dir_all(&dev).expect("dev dir");
    for i in 0..2 {
        std::fs::write(dev.join(format!("nvidia{i}")), b"").expect("device node");
    }
    let api = FakeApi::start().await.expect("fake API");
    let kubeconfig = root.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: http://{}\ncontexts:\n- name: fake\n  context: {{cluster: fake, user: fake}}\ncurrent-context: fake\nusers:\n- name: fake\n  user: {{}}\n",
            api.addr
        ),
    )
    .expect("kubeconfig");
    // The simulator's UUIDs: GPU-51570000-0000-4000-8000-<index>.
    let gpu1 = "GPU-51570000-0000-4000-8000-000000000001";
    let cs: Vec<PodContainer<'_>> = vec![("main", false, vec![(gpu1.to_owned(), 3000, 400, 4)])];
    api.put_pod(pod_json("ns", "p", "uid-p", 0, &cs));
    let mut kubelet = FakeKubelet::start(&dp_dir, &pr_sock)
        .await
        .expect("fake kubelet");
    let child = sim
        .command(crate::plugin_bin())
        .args(["--node-name", NODE, "--health-recovery-s", "0"])
        .arg("--device-plugin-dir")
        .arg(&dp_dir)
        .arg("--pod-resources-socket")
        .arg(&pr_sock)
        .arg("--state-dir")
        .arg(&state)
        .arg("--dev-dir")
        .arg(&dev)
        .arg("--nvml-lib")
        .arg(sim_lib_dir().join("libnvidia-ml.so.1"))
        .env("KUBECONFIG", &kubeconfig)
        .env_remove("KUBERNETES_SERVICE_HOST")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn vgpu-device-plugin");
    let _child = Kill(child);
    let (_, reg) = kubelet.wait_registered(1, T).await.expect("registered");
    let mut client = kubelet.connect(&reg.endpoint).await.expect("connect");
    kubelet
        .wait_devices("20 devices from NVML", T, |d| d.len() == 20)
        .await
        .expect("devices");
    let inv = wait_inventory(&api, "the inventory", |i| i.gpus.len() == 2).await;
    assert_eq!(inv.gpus[1].uuid, gpu1);
    assert_eq!(inv.gpus[1].memory_mib, 8192);
    // The pod was on the API server before the plugin started: its watch has it, so
    // GetPreferredAllocation steers kubelet to GPU 1.
    let end = Instant::now() + T;
    let adm = loop {
        let adm = kubelet
            .admit(&mut client, "ns", "p", &fake_containers(&cs))
            .await
            .expect("admit");
        if adm.containers[0].2.iter().all(|i| i.starts_with(gpu1)) || Instant::now() > end {
            break adm;
        }
        kubelet.remove_pod("ns", "p");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let ids = adm.containers[0].2.clone();
    assert!(
        ids.iter().all(|i| i.starts_with(gpu1)),
        "steered to GPU 1: {ids:?}"
    );
    FakeKubelet::prestart(&mut client, &ids)
        .await
        .expect("PreStartContainer");
    let file = state
        .join("alloc")
        .join(allocation_key(ids.iter().map(String::as_str)))
        .join(QUOTA_FILE);
    let q = ContainerQuota::from_json(&std::fs::read_to_string(&file).expect("quota file"))
        .expect("quota");
    assert_eq!(
        (
            q.pod.as_str(),
            q.gpus[0].uuid.as_str(),
            q.gpus[0].memory_mib
        ),
        ("p", gpu1, 3000)
    );
    assert_eq!(
        std::fs::read_to_string(state.join("ld.so.preload")).expect("preload"),
        "/usr/local/vgpu/libvgpu.so\n"
    );
    // A critical XID on GPU 1 reaches kubelet and the Node.
    let bin = vgpu_tests::sim_tool_bin();
    let out = sim
        .command(&bin)
        .args(["xid", "--device", "1", "48"])
        .output()
        .expect("vgpu-sim");
    assert!(out.status.success());
    kubelet
        .wait_devices("GPU 1 unhealthy", T, |d| {
            d.iter().filter(|x| x.health == UNHEALTHY).count() == 10
        })
        .await
        .expect("unhealthy");
    wait_inventory(&api, "GPU 1 unhealthy on the Node", |i| {
        !i.gpus[1].healthy && i.gpus[0].healthy
    })
    .await;
    // Kubelet restarts: the binary re-registers.
    kubelet.restart().expect("restart");
    kubelet.wait_registered(2, T).await.expect("re-registered");
}

fn write_kubeconfig(path: &std::path::Path, api: &FakeApi) {
    std::fs::write(
        path,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: http://{}\ncontexts:\n- name: fake\n  context: {{cluster: fake, user: fake}}\ncurrent-context: fake\nusers:\n- name: fake\n  user: {{}}\n",
            api.addr
        ),
    )
    .expect("kubeconfig");
}

/// Runs the binary on the simulated node with `args` until it exits (at most `T`):
/// its exit status and standard error.
async fn run_until_exit(
    sim: &SimNode,
    root: &std::path::Path,
    kubeconfig: &std::path::Path,
    args: &[&std::ffi::OsStr],
) -> (std::process::ExitStatus, String) {
    let mut child = sim
        .command(crate::plugin_bin())
        .args(["--node-name", NODE])
        .arg("--device-plugin-dir")
        .arg(root.join("device-plugins"))
        .arg("--pod-resources-socket")
        .arg(root.join("pod-resources/kubelet.sock"))
        .arg("--state-dir")
        .arg(root.join("state"))
        .arg("--nvml-lib")
        .arg(sim_lib_dir().join("libnvidia-ml.so.1"))
        .args(args)
        .env("KUBECONFIG", kubeconfig)
        .env_remove("KUBERNETES_SERVICE_HOST")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn vgpu-device-plugin");
    let end = Instant::now() + T;
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        if Instant::now() > end {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the plugin did not refuse to start within {T:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        use std::io::Read as _;
        let _ = e.read_to_string(&mut err);
    }
    (status, err)
}

/// Issue 11 item 6: what cannot work is refused at start, naming it: a GPU without its
/// device node (the default mode), and `--cdi` on a kubelet that drops CDI devices
/// (1.28 without its feature gate) or on containerd 1.6.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_refuses_to_start_what_cannot_work_on_the_node() {
    let sim = SimNode::new(
        r#"
        [[device]]
        name = "NVIDIA H100 80GB HBM3"
        memory = "8Gi"
        "#,
    );
    let root = tempfile::tempdir().expect("tempdir");
    std::fs::create_dir_all(root.path().join("device-plugins")).expect("dir");
    let dev = root.path().join("empty-dev");
    std::fs::create_dir_all(&dev).expect("dev dir");
    let api = FakeApi::start().await.expect("fake API");
    let kubeconfig = root.path().join("kubeconfig");
    write_kubeconfig(&kubeconfig, &api);
    let (status, err) = run_until_exit(
        &sim,
        root.path(),
        &kubeconfig,
        &["--dev-dir".as_ref(), dev.as_os_str()],
    )
    .await;
    let missing = dev.join("nvidia0").display().to_string();
    assert!(!status.success());
    assert!(err.contains(&missing) && err.contains("--dev-dir"), "{err}");

    // --cdi on the issue's cluster: kubelet v1.28.4 without the gate, containerd 1.6.
    let node_info = |kubelet: &str, runtime: &str| {
        serde_json::json!({"metadata": {"name": NODE}, "status": {"nodeInfo": {
            "kubeletVersion": kubelet, "containerRuntimeVersion": runtime,
            "architecture": "amd64", "bootID": "", "kernelVersion": "", "kubeProxyVersion": "",
            "machineID": "", "operatingSystem": "linux", "osImage": "", "systemUUID": ""}}})
    };
    api.put_node(node_info("v1.28.4", "containerd://1.7.13"));
    let (status, err) = run_until_exit(&sim, root.path(), &kubeconfig, &["--cdi".as_ref()]).await;
    assert!(!status.success());
    assert!(
        err.contains("v1.28.4") && err.contains("DevicePluginCDIDevices"),
        "{err}"
    );
    api.put_node(node_info("v1.29.2", "containerd://1.6.20"));
    let (status, err) = run_until_exit(&sim, root.path(), &kubeconfig, &["--cdi".as_ref()]).await;
    assert!(!status.success());
    assert!(err.contains("containerd://1.6.20"), "{err}");
}
