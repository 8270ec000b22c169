//! Topology through the shim (issue 14): a container granted node GPUs 4 and 5 of the
//! simulated 8-GPU PCIe server sees them as its devices 0 and 1, and the topology it reads
//! through unmodified nvidia-ml-py and the driver API is theirs: one PCIe switch between
//! them (PIX), peer access between them, the nearest-GPU and CPU-set lists holding only
//! its own GPUs (the shim filters the real lists), their socket's CPUs.

use vgpu_tests::{Container, SimNode};

fn uuid(i: u32) -> String {
    format!("GPU-51570000-0000-4000-8000-{i:012x}")
}

/// A container whose quota file grants node GPUs 4 and 5 (no daemon).
fn container() -> Container {
    let mut c = Container::new("1Gi").with("VGPU_DAEMON_SOCKET", "off");
    c.limit = None;
    std::fs::create_dir_all(c.dir()).expect("container dir");
    let gpus: Vec<String> = [4, 5]
        .iter()
        .map(|&i| {
            format!(
                r#"{{"uuid":"{}","memory_mib":1024,"compute_milli":500,"slices":5}}"#,
                uuid(i)
            )
        })
        .collect();
    let quota = format!(
        r#"{{"version":1,"namespace":"ns","pod":"p","uid":"u","container":"main","init":false,"gpus":[{}],"device_ids":[]}}"#,
        gpus.join(",")
    );
    std::fs::write(c.dir().join("vgpu.conf"), quota).expect("write vgpu.conf");
    c
}

const CLIENT: &str = r#"
import ctypes, json, pynvml as N
N.nvmlInit()
hs = [N.nvmlDeviceGetHandleByIndex(i) for i in range(N.nvmlDeviceGetCount())]
idx = N.nvmlDeviceGetIndex
cu = ctypes.CDLL("libcuda.so.1")
assert cu.cuInit(0) == 0
can = ctypes.c_int(-1)
assert cu.cuDeviceCanAccessPeer(ctypes.byref(can), 0, 1) == 0
words = N.nvmlDeviceGetCpuAffinity(hs[0], 4)
print(json.dumps({
    "uuids": [N.nvmlDeviceGetUUID(h) for h in hs],
    "ancestor": N.nvmlDeviceGetTopologyCommonAncestor(hs[0], hs[1]),
    "nearest": [idx(h) for h in N.nvmlDeviceGetTopologyNearestGpus(hs[0], N.NVML_TOPOLOGY_SYSTEM)],
    "gpu_set_cpu_32": [idx(h) for h in N.nvmlSystemGetTopologyGpuSet(32)],
    "gpu_set_cpu_0": [idx(h) for h in N.nvmlSystemGetTopologyGpuSet(0)],
    "p2p_read": N.nvmlDeviceGetP2PStatus(hs[0], hs[1], 0),
    "cuda_can_access_peer": can.value,
    "cpus": [w * 64 + b for w, m in enumerate(words) for b in range(64) if m >> b & 1],
}))
"#;

#[test]
fn a_container_reads_the_topology_of_its_own_gpus_only() {
    let node = SimNode::new("preset = \"pcie-8gpu\"\n");
    let c = container();
    let mut cmd = node.command("python3");
    c.apply(&mut cmd);
    let out = cmd.args(["-c", CLIENT]).output().expect("run python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "client failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).expect("one JSON line");
    assert_eq!(v["uuids"], serde_json::json!([uuid(4), uuid(5)]));
    assert_eq!(v["ancestor"], 10, "PIX: one switch");
    assert_eq!(
        v["nearest"],
        serde_json::json!([1]),
        "not node GPUs 0-3, 6, 7"
    );
    assert_eq!(v["gpu_set_cpu_32"], serde_json::json!([0, 1]));
    assert_eq!(v["gpu_set_cpu_0"], serde_json::json!([]));
    assert_eq!(v["p2p_read"], 0);
    assert_eq!(v["cuda_can_access_peer"], 1);
    let cpus: Vec<u64> = (32..64).chain(96..128).collect();
    assert_eq!(v["cpus"], serde_json::json!(cpus));
}
