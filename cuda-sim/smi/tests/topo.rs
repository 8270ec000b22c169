//! `vgpu-smi topo -m` on the simulated node presets: the matrix nvml-wrapper reads through
//! NVML's topology, NVLink and affinity queries must be the one `nvidia-smi topo -m`
//! prints on the machine each preset models (DGX A100: see docs/cuda-sim.md).
//!
//! Needs the simulated driver (`cargo xtask sim`).

use vgpu_tests::SimNode;

fn topo(preset: &str, json: bool) -> String {
    let node = SimNode::new(&format!("preset = \"{preset}\"\n"));
    let mut cmd = node.command(env!("CARGO_BIN_EXE_vgpu-smi"));
    cmd.args(["topo", "-m"]);
    if json {
        cmd.arg("--json");
    }
    let out = cmd.output().expect("run vgpu-smi");
    assert!(
        out.status.success(),
        "vgpu-smi topo -m failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8")
}

#[test]
fn dgx_a100_matrix_is_the_one_nvidia_smi_prints() {
    let text = topo("dgx-a100", false);
    let rows: Vec<&str> = text.lines().take(9).collect();
    assert_eq!(
        rows[0],
        "\tGPU0\tGPU1\tGPU2\tGPU3\tGPU4\tGPU5\tGPU6\tGPU7\tCPU Affinity\tNUMA Affinity"
    );
    // Rows as a DGX A100 (NPS4) prints them, NIC columns left out.
    let expect = [
        ("48-63,176-191", "3"),
        ("48-63,176-191", "3"),
        ("16-31,144-159", "1"),
        ("16-31,144-159", "1"),
        ("112-127,240-255", "7"),
        ("112-127,240-255", "7"),
        ("80-95,208-223", "5"),
        ("80-95,208-223", "5"),
    ];
    for (i, (cpus, numa)) in expect.iter().enumerate() {
        let cells: Vec<String> = (0..8)
            .map(|j| {
                if i == j {
                    " X ".to_owned()
                } else {
                    "NV12".to_owned()
                }
            })
            .collect();
        assert_eq!(
            rows[i + 1],
            format!("GPU{i}\t{}\t{cpus}\t{numa}", cells.join("\t"))
        );
    }
}

#[test]
fn pcie_and_t4_matrices_show_pix_node_phb_and_sys() {
    let v: serde_json::Value = serde_json::from_str(&topo("pcie-8gpu", true)).expect("json");
    let row0: Vec<&str> = v["gpus"][0]["links"]
        .as_array()
        .expect("links")
        .iter()
        .map(|l| l.as_str().expect("label"))
        .collect();
    assert_eq!(
        row0,
        ["X", "PIX", "NODE", "NODE", "SYS", "SYS", "SYS", "SYS"]
    );
    assert_eq!(v["gpus"][5]["cpu_affinity"], "32-63,96-127");
    let text = topo("t4-4gpu", false);
    assert!(
        text.contains("GPU2\tSYS\tSYS\t X \tPHB\t20-39,60-79\t1"),
        "{text}"
    );
    let h100 = topo("dgx-h100", false);
    assert!(
        h100.contains("GPU4\tNV18\tNV18\tNV18\tNV18\t X \tNV18\tNV18\tNV18\t56-111,168-223\t1"),
        "{h100}"
    );
}
