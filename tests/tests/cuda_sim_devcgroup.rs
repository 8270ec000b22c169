//! cuda-sim inside a device cgroup, as kubelet confines a container (issue 40): a process
//! whose cgroup v1 `devices` controller refuses one GPU's node (195:1 of a 4-GPU node)
//! sees the other three, numbered 0..2 in order with their own UUIDs and PCI ids, through
//! the CUDA driver API and NVML; a process refused `/dev/nvidiactl` (195:255) fails
//! `cuInit` with 999 and `nvmlInit` with `NVML_ERROR_UNKNOWN`, as NVIDIA's driver does
//! (`vgpu_cuda_sim::devnodes` cites the sources).

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Output;

use vgpu_test_needs::{Need, skip};
use vgpu_tests::{SimNode, device_probe_bin, field};

const GPU: [&str; 4] = [
    "GPU-51570000-0000-4000-8000-000000000000",
    "GPU-51570000-0000-4000-8000-000000000001",
    "GPU-51570000-0000-4000-8000-000000000002",
    "GPU-51570000-0000-4000-8000-000000000003",
];

/// The cgroup v1 `devices` hierarchy.
const DEVICES: &str = "/sys/fs/cgroup/devices";

/// A cgroup v1 `devices` group that refuses some character devices, removed on drop.
struct DevGroup {
    path: PathBuf,
}

impl DevGroup {
    /// A group refusing `c MAJOR:MINOR rwm` for each of `deny`; `None` (with the reason)
    /// where this machine has no writable `devices` controller.
    fn new(name: &str, deny: &[(u32, u32)]) -> Result<DevGroup, String> {
        let path = Path::new(DEVICES).join(format!("vgpu-test-{name}-{}", std::process::id()));
        std::fs::create_dir(&path).map_err(|e| format!("mkdir {}: {e}", path.display()))?;
        let g = DevGroup { path };
        for (major, minor) in deny {
            let f = g.path.join("devices.deny");
            std::fs::write(&f, format!("c {major}:{minor} rwm"))
                .map_err(|e| format!("write {}: {e}", f.display()))?;
        }
        Ok(g)
    }

    /// Runs `device-probe args` on `node` inside the group from its first instruction.
    fn probe(&self, node: &SimNode, args: &[&str]) -> Output {
        node.command("sh")
            .arg("-c")
            .arg("echo $$ > \"$0\" && exec \"$@\"")
            .arg(self.path.join("cgroup.procs"))
            .arg(device_probe())
            .args(args)
            .output()
            .expect("run device-probe in the group")
    }
}

impl Drop for DevGroup {
    fn drop(&mut self) {
        for _ in 0..50 {
            if std::fs::remove_dir(&self.path).is_ok() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
}

fn device_probe() -> PathBuf {
    device_probe_bin()
}

/// Four 4 GiB GPUs with distinct PCI bus ids (UUIDs `GPU`).
fn node() -> SimNode {
    SimNode::new(&"[[device]]\nmemory = \"4Gi\"\n".repeat(4))
}

fn stdout_ok(out: &Output, what: &str) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{what} failed ({}):\nstdout:\n{stdout}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

fn get(out: &str, key: &str) -> String {
    field(out, key).unwrap_or_else(|| panic!("no {key}= in:\n{out}"))
}

/// The node with its device nodes made (by an unconfined process, as the node agent's
/// NVML makes them on a real node) and what that process sees; `None` where the
/// simulator makes no nodes or the machine has no `devices` controller (skipped).
fn prepared() -> Option<(SimNode, String)> {
    // `/proc/self` belongs to the process's effective user.
    let root = std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0);
    if !root {
        skip(
            Need::Root,
            "mknod of the simulated device nodes and a devices cgroup",
        );
        return None;
    }
    if !Path::new(DEVICES).join("devices.deny").exists() {
        skip(
            Need::Root,
            "no cgroup v1 devices controller at /sys/fs/cgroup/devices",
        );
        return None;
    }
    let node = node();
    let out = node
        .command(device_probe())
        .args(["cuda", "nvml"])
        .output()
        .expect("run device-probe");
    let all = stdout_ok(&out, "device-probe unconfined");
    assert_eq!(get(&all, "cuda_count"), "4", "{all}");
    assert!(
        node.state_dir().join("dev/nvidia1").exists(),
        "the simulator made no device nodes as root"
    );
    Some((node, all))
}

#[test]
fn a_gpu_refused_by_the_device_cgroup_is_absent_and_the_others_renumbered() {
    let Some((node, all)) = prepared() else {
        return;
    };
    let g = match DevGroup::new("gpu1", &[(195, 1)]) {
        Ok(g) => g,
        Err(why) => return skip(Need::Root, &why),
    };
    let out = stdout_ok(
        &g.probe(&node, &["cuda", "nvml"]),
        "device-probe denied GPU 1",
    );
    assert_eq!(get(&out, "cuda_count"), "3", "{out}");
    assert_eq!(get(&out, "nvml_count"), "3", "{out}");
    for (i, node_gpu) in [0, 2, 3].into_iter().enumerate() {
        assert_eq!(get(&out, &format!("cuda_uuid_{i}")), GPU[node_gpu], "{out}");
        assert_eq!(get(&out, &format!("nvml_uuid_{i}")), GPU[node_gpu], "{out}");
        assert_eq!(
            get(&out, &format!("nvml_index_{i}")),
            i.to_string(),
            "{out}"
        );
        // Each keeps its own PCI bus id.
        assert_eq!(
            get(&out, &format!("cuda_pci_{i}")),
            get(&all, &format!("cuda_pci_{node_gpu}")),
            "{out}"
        );
        assert_eq!(
            get(&out, &format!("nvml_pci_{i}")),
            get(&all, &format!("nvml_pci_{node_gpu}")),
            "{out}"
        );
    }
    // Ordinal 3 is past the end in both APIs (CUDA_ERROR_INVALID_DEVICE 101,
    // NVML_ERROR_INVALID_ARGUMENT 2), and GPU 1 cannot be found by UUID.
    assert_eq!(get(&out, "cuda_get_3"), "101", "{out}");
    assert_eq!(get(&out, "nvml_get_3"), "2", "{out}");
    let out = stdout_ok(
        &g.probe(&node, &["nvml", "nvml-uuid", GPU[1], "nvml-uuid", GPU[3]]),
        "device-probe nvml-uuid",
    );
    let lookups: Vec<&str> = out
        .lines()
        .filter(|l| l.starts_with("nvml_lookup="))
        .collect();
    // NVML_ERROR_NOT_FOUND (6) for GPU 1; GPU 3 is NVML index 2.
    assert_eq!(lookups, ["nvml_lookup=err6", "nvml_lookup=2"], "{out}");
}

#[test]
fn a_refused_control_node_fails_initialization_with_an_unknown_error() {
    let Some((node, _)) = prepared() else {
        return;
    };
    let g = match DevGroup::new("ctl", &[(195, 255)]) {
        Ok(g) => g,
        Err(why) => return skip(Need::Root, &why),
    };
    for (api, want) in [
        ("cuda", "cuInit failed with 999"),
        ("nvml", "nvmlInit_v2 failed with 999"),
    ] {
        let out = g.probe(&node, &[api]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{api} initialized without nvidiactl");
        assert!(stderr.contains(want), "{api}: {stderr}");
    }
    // Every GPU refused but the control node allowed: NVML initializes with no GPU,
    // CUDA has no device (CUDA_ERROR_NO_DEVICE, 100).
    let g = match DevGroup::new("gpus", &[(195, 0), (195, 1), (195, 2), (195, 3)]) {
        Ok(g) => g,
        Err(why) => return skip(Need::Root, &why),
    };
    let out = stdout_ok(&g.probe(&node, &["nvml"]), "device-probe nvml, no GPU");
    assert_eq!(get(&out, "nvml_count"), "0", "{out}");
    let out = g.probe(&node, &["cuda"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("cuInit failed with 100"), "{stderr}");
}
