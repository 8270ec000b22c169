//! The `vgpu-device-plugin` process's lifecycle as kubelet drives it: registered with a
//! (fake) kubelet on a simulated node, SIGTERM ends it with exit 0 and removes its socket
//! from kubelet's device-plugins directory.
//!
//! Needs the simulated driver (`cargo xtask sim`).

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use vgpu_testkit::fake_api::FakeApi;
use vgpu_testkit::fake_kubelet::FakeKubelet;
use vgpu_testkit::node::NODE;
use vgpu_tests::{SimNode, sim_lib_dir};

const T: Duration = Duration::from_secs(20);
/// Longest a SIGTERM may take to end the plugin (kubelet's grace period is 30 s).
const STOP: Duration = Duration::from_secs(5);

struct Kill(Child);
impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_exits_zero_and_removes_the_plugin_socket() {
    let sim = SimNode::new("[[device]]\nmemory = \"8Gi\"\n");
    let root = tempfile::tempdir().expect("tempdir");
    let dp_dir = root.path().join("device-plugins");
    let pr_sock = root.path().join("pod-resources/kubelet.sock");
    let dev = root.path().join("dev");
    std::fs::create_dir_all(&dev).expect("dev dir");
    std::fs::write(dev.join("nvidia0"), b"").expect("device node");
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
    let kubelet = FakeKubelet::start(&dp_dir, &pr_sock)
        .await
        .expect("fake kubelet");
    let child = sim
        .command(crate::plugin_bin())
        .args(["--node-name", NODE, "--daemon-socket", "off"])
        .args(["--daemon-api-socket", "off"])
        .arg("--device-plugin-dir")
        .arg(&dp_dir)
        .arg("--pod-resources-socket")
        .arg(&pr_sock)
        .arg("--state-dir")
        .arg(root.path().join("state"))
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
    let mut child = Kill(child);
    let (_, reg) = kubelet.wait_registered(1, T).await.expect("registered");
    let socket = dp_dir.join(&reg.endpoint);
    assert!(socket.exists(), "{} not there", socket.display());

    let sent = Command::new("kill")
        .args(["-TERM", &child.0.id().to_string()])
        .status()
        .expect("run kill");
    assert!(sent.success());
    let end = Instant::now() + STOP;
    let st = loop {
        if let Some(st) = child.0.try_wait().expect("wait") {
            break st;
        }
        assert!(Instant::now() < end, "still running {STOP:?} after SIGTERM");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert_eq!(st.code(), Some(0), "exit status {st}");
    assert!(!socket.exists(), "{} left behind", socket.display());
    // kubelet's own socket is kubelet's: untouched.
    assert!(dp_dir.join("kubelet.sock").exists());
}
