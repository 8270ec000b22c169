//! libvgpu.so reads the container's quota file (`$VGPU_CONTAINER_DIR/vgpu.conf`, written
//! by the device plugin): the file's quota is enforced and shown by `cuMemGetInfo` and
//! NVML; the environment (tenant-editable) can lower it but never raise it; a GPU the
//! file does not list gets nothing; a bad file is a loud error naming the file and the
//! value, and `cuInit` fails under the default policy.

use std::process::Output;

use vgpu_tests::{Container, SimNode, field, num, probe_bin};

const MIB: u64 = 1 << 20;
const A: &str = "GPU-51570000-0000-4000-8000-000000000000";
const B: &str = "GPU-51570000-0000-4000-8000-000000000001";

/// Two 4 GiB devices (UUIDs `A` and `B`, as cuda-sim numbers them).
fn node() -> SimNode {
    SimNode::new(
        r#"
        [[device]]
        memory = "4Gi"
        alloc_granularity = "2Mi"
        [[device]]
        memory = "4Gi"
        alloc_granularity = "2Mi"
        "#,
    )
}

fn record(version: u32, gpus: &[(&str, u64)]) -> String {
    let g: Vec<String> = gpus
        .iter()
        .map(|(u, m)| {
            format!(r#"{{"uuid":"{u}","memory_mib":{m},"compute_milli":100,"slices":1}}"#)
        })
        .collect();
    format!(
        r#"{{"version":{version},"namespace":"ns","pod":"p","uid":"u","container":"main","init":false,"gpus":[{}],"device_ids":[]}}"#,
        g.join(",")
    )
}

/// A container with the quota file `text` and no environment limit.
fn container(text: &str) -> Container {
    let mut c = Container::new("1Gi");
    c.limit = None;
    std::fs::create_dir_all(c.dir()).expect("container dir");
    std::fs::write(c.dir().join("vgpu.conf"), text).expect("write vgpu.conf");
    c
}

fn run(node: &SimNode, c: &Container, args: &[&str]) -> Output {
    let mut cmd = node.command(probe_bin());
    c.apply(&mut cmd);
    cmd.args(args).output().expect("run cuda-probe")
}

#[test]
fn the_file_quota_is_enforced_and_shown_by_cuda_and_nvml() {
    let node = node();
    let c = container(&record(1, &[(A, 300), (B, 200)]));
    let out = node.probe_in(
        Some(&c),
        &[
            "init",
            "meminfo",
            "totalmem",
            "nvml",
            "alloc-until-oom",
            "2Mi",
        ],
    );
    assert!(out.contains(&format!("total={}", 300 * MIB)), "{out}");
    assert_eq!(num(&out, "totalmem"), 300 * MIB, "{out}");
    assert_eq!(num(&out, "nvml_total"), 300 * MIB, "{out}");
    let allocated = num(&out, "allocated");
    assert!(allocated > 0 && allocated <= 300 * MIB, "{out}");
    assert_eq!(field(&out, "code").as_deref(), Some("2"), "{out}");
    let out = node.probe_in(Some(&c), &["device", "1", "init", "meminfo", "nvml"]);
    assert!(out.contains(&format!("total={}", 200 * MIB)), "{out}");
    assert_eq!(num(&out, "nvml_total"), 200 * MIB, "{out}");
}

#[test]
fn the_environment_can_lower_the_file_quota_but_not_raise_it() {
    let node = node();
    let text = record(1, &[(A, 300), (B, 300)]);
    let mut c = container(&text).with("VGPU_MEMORY_LIMIT", "2Gi");
    let out = node.probe_in(Some(&c), &["init", "meminfo", "alloc", "400Mi"]);
    assert!(out.contains(&format!("total={}", 300 * MIB)), "{out}");
    assert!(out.contains("alloc=err code=2"), "raised by the env: {out}");
    // Another container, lowered on device 1.
    c = container(&text).with("VGPU_MEMORY_LIMIT_1", "100Mi");
    let out = node.probe_in(Some(&c), &["device", "1", "init", "meminfo", "nvml"]);
    assert!(out.contains(&format!("total={}", 100 * MIB)), "{out}");
    assert_eq!(num(&out, "nvml_total"), 100 * MIB, "{out}");
    let out = node.probe_in(Some(&c), &["init", "meminfo"]);
    assert!(out.contains(&format!("total={}", 300 * MIB)), "{out}");
}

#[test]
fn a_gpu_the_file_does_not_list_is_not_there() {
    // ADR 0014: the container sees its GPUs only (tests/tests/shim_visible.rs has the
    // rest); a GPU the driver shows although it was not granted gets quota 0 (config.rs).
    let node = node();
    let c = container(&record(1, &[(A, 300)]));
    let out = run(&node, &c, &["device", "1", "init"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("CUresult 101"),
        "device 1 is not a device: {err}"
    );
    let out = run(&node, &c, &["device", "1", "nvml"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("failed with 2"), "nor an NVML index: {err}");
    // Device 0 works.
    let out = node.probe_in(Some(&c), &["init", "alloc", "2Mi"]);
    assert!(out.contains("alloc=ok"), "{out}");
}

#[test]
fn a_bad_quota_file_is_a_loud_error_and_cuinit_fails() {
    let node = node();
    let unknown = "GPU-51570000-0000-4000-8000-0000000000ff";
    for (text, value) in [
        (
            "{\"version\":1,\"gpus\":",
            "{\\\"version\\\":1,\\\"gpus\\\":",
        ),
        (&*record(2, &[(A, 300)]), "version 2"),
        (&*record(1, &[(A, 300), (unknown, 100)]), unknown),
    ] {
        let c = container(text);
        let out = run(&node, &c, &["init", "alloc", "1Mi"]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{text} was accepted");
        let file = c.dir().join("vgpu.conf");
        assert!(err.contains(&file.display().to_string()), "{err}");
        assert!(err.contains(value), "{value}: {err}");
        assert!(err.contains("cuInit failed with CUresult 800"), "{err}");
        // Even with a generous environment limit: never silently unlimited.
        let c = container(text).with("VGPU_MEMORY_LIMIT", "1Gi");
        let out = run(&node, &c, &["init"]);
        assert!(!out.status.success(), "{text} was accepted");
    }
}
