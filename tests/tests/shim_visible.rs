//! A container sees exactly its GPUs (issue 11 item 2, ADR 0014): on a 2-GPU simulated
//! node, a container whose quota file grants GPU 1 only sees one device, numbered 0, which
//! is GPU 1 with its quota, in the driver API (through `dlsym` and `cuGetProcAddress`) and
//! in NVML; GPU 0 cannot be reached by index, UUID, PCI bus id or serial. Without a quota
//! file nothing is hidden. And the simulated driver itself honours `CUDA_VISIBLE_DEVICES`
//! as NVIDIA's does (NVML ignores it).

use std::process::Command;

use vgpu_tests::{Container, SimNode, device_probe_bin, field, num};

const MIB: u64 = 1 << 20;
const GPU0: &str = "GPU-51570000-0000-4000-8000-000000000000";
const GPU1: &str = "GPU-51570000-0000-4000-8000-000000000001";

/// Two 4 GiB devices with distinct PCI bus ids (UUIDs `GPU0`, `GPU1`).
fn node() -> SimNode {
    SimNode::new(
        r#"
        [[device]]
        memory = "4Gi"
        [[device]]
        memory = "4Gi"
        "#,
    )
}

pub(crate) fn quota_file(gpus: &[(&str, u64)]) -> String {
    let g: Vec<String> = gpus
        .iter()
        .map(|(u, m)| {
            format!(r#"{{"uuid":"{u}","memory_mib":{m},"compute_milli":500,"slices":5}}"#)
        })
        .collect();
    format!(
        r#"{{"version":1,"namespace":"ns","pod":"p","uid":"u","container":"main","init":false,"gpus":[{}],"device_ids":[]}}"#,
        g.join(",")
    )
}

/// A container whose quota file grants `gpus` (no environment limit, no daemon).
pub(crate) fn container(gpus: &[(&str, u64)]) -> Container {
    let mut c = Container::new("1Gi").with("VGPU_DAEMON_SOCKET", "off");
    c.limit = None;
    std::fs::create_dir_all(c.dir()).expect("container dir");
    std::fs::write(c.dir().join("vgpu.conf"), quota_file(gpus)).expect("write vgpu.conf");
    c
}

/// Runs `device-probe` (built next to `cuda-probe`) on `node`, in `container` if given,
/// with extra environment `env`; returns its stdout (panics with the output on failure).
fn devices(node: &SimNode, c: Option<&Container>, env: &[(&str, &str)], args: &[&str]) -> String {
    let bin = device_probe_bin();
    let mut cmd: Command = node.command(bin);
    if let Some(c) = c {
        c.apply(&mut cmd);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.args(args).output().expect("run device-probe");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "device-probe {args:?} failed ({}):\nstdout:\n{stdout}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

fn get(out: &str, key: &str) -> String {
    field(out, key).unwrap_or_else(|| panic!("no {key}= in:\n{out}"))
}

/// What the node shows a process without the shim: (uuid, CUDA pci, NVML pci, serial)
/// of both GPUs.
fn bare_identity(node: &SimNode) -> Vec<(String, String, String, String)> {
    let out = devices(node, None, &[], &["cuda", "nvml"]);
    assert_eq!(num(&out, "cuda_count"), 2, "{out}");
    assert_eq!(num(&out, "nvml_count"), 2, "{out}");
    (0..2)
        .map(|i| {
            (
                get(&out, &format!("cuda_uuid_{i}")),
                get(&out, &format!("cuda_pci_{i}")),
                get(&out, &format!("nvml_pci_{i}")),
                get(&out, &format!("nvml_serial_{i}")),
            )
        })
        .collect()
}

#[test]
fn a_container_granted_gpu_1_sees_it_as_device_0_in_cuda_and_nvml() {
    let node = node();
    let ids = bare_identity(&node);
    assert_eq!((ids[0].0.as_str(), ids[1].0.as_str()), (GPU0, GPU1));
    let c = container(&[(GPU1, 700)]);
    for route in ["dlsym", "procaddr"] {
        let out = devices(
            &node,
            Some(&c),
            &[],
            &[
                "route",
                route,
                "cuda",
                "cuda-pci",
                &ids[0].1,
                "nvml",
                "nvml-uuid",
                GPU0,
            ],
        );
        // The driver API: one device, ordinal 0, which is GPU 1.
        assert_eq!(num(&out, "cuda_count"), 1, "{route}: {out}");
        assert_eq!(get(&out, "cuda_uuid_0"), GPU1, "{route}: {out}");
        assert_eq!(get(&out, "cuda_pci_0"), ids[1].1, "{route}: {out}");
        assert_eq!(
            num(&out, "cuda_get_1"),
            101,
            "ordinal 1: INVALID_DEVICE; {out}"
        );
        assert_eq!(num(&out, "cuda_ctx_device"), 0, "{route}: {out}");
        assert_eq!(
            get(&out, "cuda_pci_lookup"),
            "err101",
            "GPU 0 by PCI id: {out}"
        );
        // NVML: the same single device, index 0.
        assert_eq!(num(&out, "nvml_count"), 1, "{out}");
        assert_eq!(num(&out, "nvml_count_v1"), 1, "{out}");
        assert_eq!(get(&out, "nvml_uuid_0"), GPU1, "{out}");
        assert_eq!(num(&out, "nvml_index_0"), 0, "{out}");
        assert_eq!(
            num(&out, "nvml_get_1"),
            2,
            "index 1: INVALID_ARGUMENT; {out}"
        );
        assert_eq!(
            get(&out, "nvml_lookup"),
            "err6",
            "GPU 0 by UUID: NOT_FOUND; {out}"
        );
    }
    // GPU 0 by NVML PCI id and serial: not found; GPU 1 by each: index 0.
    let out = devices(
        &node,
        Some(&c),
        &[],
        &[
            "nvml",
            "nvml-pci",
            &ids[0].2,
            "nvml-serial",
            &ids[0].3,
            "nvml-uuid",
            GPU1,
            "nvml-pci",
            &ids[1].2,
            "nvml-serial",
            &ids[1].3,
        ],
    );
    let lookups: Vec<&str> = out
        .split_whitespace()
        .filter_map(|kv| kv.strip_prefix("nvml_lookup="))
        .collect();
    assert_eq!(lookups, ["err6", "err6", "0", "0", "0"], "{out}");
    // Device 0 carries GPU 1's quota in the driver's and NVML's memory views.
    let out = node.probe_in(Some(&c), &["init", "meminfo", "totalmem", "nvml"]);
    assert!(out.contains(&format!("total={}", 700 * MIB)), "{out}");
    assert_eq!(num(&out, "totalmem"), 700 * MIB, "{out}");
    assert_eq!(num(&out, "nvml_total"), 700 * MIB, "{out}");
}

#[test]
fn two_granted_gpus_are_numbered_in_the_quota_files_order() {
    let node = node();
    let c = container(&[(GPU1, 300), (GPU0, 200)]);
    let out = devices(&node, Some(&c), &[], &["cuda", "nvml"]);
    assert_eq!(num(&out, "cuda_count"), 2, "{out}");
    assert_eq!(get(&out, "cuda_uuid_0"), GPU1, "{out}");
    assert_eq!(get(&out, "cuda_uuid_1"), GPU0, "{out}");
    assert_eq!(get(&out, "nvml_uuid_0"), GPU1, "{out}");
    assert_eq!(get(&out, "nvml_uuid_1"), GPU0, "{out}");
    assert_eq!(num(&out, "nvml_index_1"), 1, "{out}");
    let out = node.probe_in(Some(&c), &["device", "1", "init", "meminfo", "nvml"]);
    assert!(out.contains(&format!("total={}", 200 * MIB)), "{out}");
    assert_eq!(num(&out, "nvml_total"), 200 * MIB, "{out}");
    // The tenant's CUDA_VISIBLE_DEVICES counts the container's GPUs: "1" is GPU 0 here,
    // and a GPU of the node it was not given stays hidden.
    let out = devices(
        &node,
        Some(&c),
        &[("CUDA_VISIBLE_DEVICES", "1")],
        &["cuda", "nvml"],
    );
    assert_eq!(num(&out, "cuda_count"), 1, "{out}");
    assert_eq!(get(&out, "cuda_uuid_0"), GPU0, "{out}");
    assert_eq!(
        num(&out, "nvml_count"),
        2,
        "NVML ignores CUDA_VISIBLE_DEVICES: {out}"
    );
    let c1 = container(&[(GPU1, 300)]);
    let out = devices(
        &node,
        Some(&c1),
        &[("CUDA_VISIBLE_DEVICES", GPU0)],
        &["nvml"],
    );
    assert_eq!(num(&out, "nvml_count"), 1, "{out}");
    assert_eq!(get(&out, "nvml_uuid_0"), GPU1, "{out}");
}

#[test]
fn without_a_quota_file_nothing_is_hidden() {
    let node = node();
    let c = Container::new("1Gi").with("VGPU_DAEMON_SOCKET", "off");
    let out = devices(&node, Some(&c), &[], &["cuda", "nvml", "nvml-uuid", GPU0]);
    assert_eq!(num(&out, "cuda_count"), 2, "{out}");
    assert_eq!(num(&out, "nvml_count"), 2, "{out}");
    assert_eq!(get(&out, "cuda_uuid_1"), GPU1, "{out}");
    assert_eq!(get(&out, "nvml_lookup"), "0", "{out}");
}

#[test]
fn the_simulated_driver_honours_cuda_visible_devices_and_nvml_ignores_it() {
    let node = node();
    let run = |v: &str| {
        devices(
            &node,
            None,
            &[("CUDA_VISIBLE_DEVICES", v)],
            &["cuda", "nvml"],
        )
    };
    let out = run("1");
    assert_eq!(num(&out, "cuda_count"), 1, "{out}");
    assert_eq!(get(&out, "cuda_uuid_0"), GPU1, "{out}");
    assert_eq!(num(&out, "cuda_ctx_device"), 0, "{out}");
    assert_eq!(num(&out, "nvml_count"), 2, "NVML ignores it: {out}");
    let out = run(&format!("{GPU1},0"));
    assert_eq!(num(&out, "cuda_count"), 2, "{out}");
    assert_eq!(
        (get(&out, "cuda_uuid_0"), get(&out, "cuda_uuid_1")),
        (GPU1.to_owned(), GPU0.to_owned()),
        "{out}"
    );
    // A unique prefix; then the first invalid entry ends the list.
    let out = run("GPU-51570000-0000-4000-8000-000000000001,-1,0");
    assert_eq!(num(&out, "cuda_count"), 1, "{out}");
    assert_eq!(get(&out, "cuda_uuid_0"), GPU1, "{out}");
    // Nothing visible: cuInit fails with CUDA_ERROR_NO_DEVICE.
    let bin = device_probe_bin();
    let out = node
        .command(bin)
        .env("CUDA_VISIBLE_DEVICES", "")
        .arg("cuda")
        .output()
        .expect("run device-probe");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("cuInit failed with 100"),
        "{err}"
    );
}

/// Runs a Python snippet in `c` on `node`, or None (printing SKIPPED) when python3 lacks
/// `module`.
fn python(node: &SimNode, c: &Container, module: &'static str, code: &str) -> Option<String> {
    let ok = Command::new("python3")
        .args(["-c", &format!("import {module}")])
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        let why = "`python3 -c 'import …'` failed";
        vgpu_test_needs::skip(vgpu_test_needs::Need::Python(module), why);
        return None;
    }
    let mut cmd = node.command("python3");
    c.apply(&mut cmd);
    let out = cmd.args(["-c", code]).output().expect("run python3");
    let s = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "python failed:\n{s}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(s)
}

#[test]
fn nvidia_ml_py_and_cuda_python_see_only_the_granted_gpu() {
    let node = node();
    let ids = bare_identity(&node);
    let c = container(&[(GPU1, 700)]);
    let code = format!(
        r#"
import pynvml as n
n.nvmlInit()
print(f"count={{n.nvmlDeviceGetCount()}}")
h = n.nvmlDeviceGetHandleByIndex(0)
u = n.nvmlDeviceGetUUID(h)
print(f"uuid0={{u.decode() if isinstance(u, bytes) else u}} index0={{n.nvmlDeviceGetIndex(h)}}")
print(f"total={{n.nvmlDeviceGetMemoryInfo(h).total}}")
for name, f, key in [("uuid", n.nvmlDeviceGetHandleByUUID, "{GPU0}"),
                     ("pci", n.nvmlDeviceGetHandleByPciBusId, "{pci}"),
                     ("serial", n.nvmlDeviceGetHandleBySerial, "{serial}"),
                     ("index1", n.nvmlDeviceGetHandleByIndex, 1)]:
    try:
        f(key)
        print(f"{{name}}=found")
    except n.NVMLError as e:
        print(f"{{name}}=err{{e.value}}")
"#,
        pci = ids[0].2,
        serial = ids[0].3,
    );
    if let Some(out) = python(&node, &c, "pynvml", &code) {
        assert_eq!(num(&out, "count"), 1, "{out}");
        assert_eq!(get(&out, "uuid0"), GPU1, "{out}");
        assert_eq!(num(&out, "index0"), 0, "{out}");
        assert_eq!(num(&out, "total"), 700 * MIB, "{out}");
        for (k, v) in [
            ("uuid", "err6"),
            ("pci", "err6"),
            ("serial", "err6"),
            ("index1", "err2"),
        ] {
            assert_eq!(get(&out, k), v, "{k}: {out}");
        }
    }
    // cuda-python 13 resolves every entry point through cuGetProcAddress.
    let code = format!(
        r#"
from cuda.bindings import driver as d
assert d.cuInit(0)[0] == d.CUresult.CUDA_SUCCESS
err, n = d.cuDeviceGetCount()
print(f"count={{n}}")
err, dev = d.cuDeviceGet(0)
err, u = d.cuDeviceGetUuid(dev)
print("uuid0=GPU-" + "-".join(bytes(u.bytes).hex()[a:b] for a, b in [(0, 8), (8, 12), (12, 16), (16, 20), (20, 32)]))
err, dev = d.cuDeviceGetByPCIBusId(b"{pci}")
print(f"pci_lookup={{int(err)}}")
err, total = d.cuDeviceTotalMem(0)
print(f"totalmem={{total}}")
"#,
        pci = ids[0].1,
    );
    if let Some(out) = python(&node, &c, "cuda.bindings.driver", &code) {
        assert_eq!(num(&out, "count"), 1, "{out}");
        assert_eq!(get(&out, "uuid0"), GPU1, "{out}");
        assert_eq!(num(&out, "pci_lookup"), 101, "GPU 0 by PCI id: {out}");
        assert_eq!(num(&out, "totalmem"), 700 * MIB, "{out}");
    }
}
