//! NVML's topology, peer-to-peer, NVLink and affinity answers on the node presets, called
//! through the exports as a C client calls them. Each scenario runs in a fresh copy of this
//! test binary with its own `VGPU_SIM_DIR` and `VGPU_SIM_CONFIG` (NVML state is
//! process-wide).

// The exports under test are `unsafe extern "C"` functions, called with pointers to locals.
#![allow(unsafe_code)]

use std::ffi::{CStr, c_char, c_uint, c_ulong};
use std::process::Command;

use nvidia_ml::*;
use vgpu_cuda_abi::nvml::*;

/// Calls exported NVML functions.
macro_rules! nv {
    ($e:expr) => {{
        // SAFETY: every call in this file passes pointers to live locals and arrays at
        // least as long as the count it passes.
        unsafe { $e }
    }};
}

const SCENARIO: &str = "NVML_TOPO_SCENARIO";

/// Runs `body` in a fresh copy of this binary on a new node made from `config`.
fn scenario(name: &str, config: &str, body: fn()) {
    if std::env::var(SCENARIO).as_deref() == Ok(name) {
        assert_eq!(nv!(nvmlInit_v2()), NVML_SUCCESS);
        body();
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let p = dir.path().join("sim.toml");
    std::fs::write(&p, config).expect("write config");
    let out = Command::new(std::env::current_exe().expect("test binary path"))
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(SCENARIO, name)
        .env("VGPU_SIM_DIR", dir.path().join("state"))
        .env("VGPU_SIM_CONFIG", &p)
        .output()
        .expect("run scenario");
    assert!(
        out.status.success(),
        "scenario {name} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn dev(i: u32) -> nvmlDevice_t {
    let mut h = std::ptr::null_mut();
    assert_eq!(nv!(nvmlDeviceGetHandleByIndex_v2(i, &mut h)), NVML_SUCCESS);
    h
}

fn index(h: nvmlDevice_t) -> u32 {
    let mut i = 0;
    assert_eq!(nv!(nvmlDeviceGetIndex(h, &mut i)), NVML_SUCCESS);
    i
}

fn ancestor(a: u32, b: u32) -> u32 {
    let mut l = 99;
    assert_eq!(
        nv!(nvmlDeviceGetTopologyCommonAncestor(dev(a), dev(b), &mut l)),
        NVML_SUCCESS
    );
    l
}

fn nearest(a: u32, level: u32) -> Vec<u32> {
    let mut n: c_uint = 0;
    let r = nv!(nvmlDeviceGetTopologyNearestGpus(
        dev(a),
        level,
        &mut n,
        std::ptr::null_mut()
    ));
    assert_eq!(r, NVML_SUCCESS, "size query");
    let mut hs = vec![std::ptr::null_mut(); n as usize];
    if n > 0 {
        let r = nv!(nvmlDeviceGetTopologyNearestGpus(
            dev(a),
            level,
            &mut n,
            hs.as_mut_ptr()
        ));
        assert_eq!(r, NVML_SUCCESS);
    }
    hs.into_iter().map(index).collect()
}

fn gpu_set(cpu: u32) -> Vec<u32> {
    let mut n: c_uint = 0;
    assert_eq!(
        nv!(nvmlSystemGetTopologyGpuSet(
            cpu,
            &mut n,
            std::ptr::null_mut()
        )),
        NVML_SUCCESS
    );
    let mut hs = vec![std::ptr::null_mut(); n as usize];
    if n > 0 {
        assert_eq!(
            nv!(nvmlSystemGetTopologyGpuSet(cpu, &mut n, hs.as_mut_ptr())),
            NVML_SUCCESS
        );
    }
    hs.into_iter().map(index).collect()
}

fn p2p(a: u32, b: u32, idx: u32) -> u32 {
    let mut s = 99;
    assert_eq!(
        nv!(nvmlDeviceGetP2PStatus(dev(a), dev(b), idx, &mut s)),
        NVML_SUCCESS
    );
    s
}

fn cpus(a: u32, scope: Option<u32>) -> Vec<u32> {
    let mut set = [0 as c_ulong; 8];
    let r = match scope {
        None => nv!(nvmlDeviceGetCpuAffinity(dev(a), 8, set.as_mut_ptr())),
        Some(s) => nv!(nvmlDeviceGetCpuAffinityWithinScope(
            dev(a),
            8,
            set.as_mut_ptr(),
            s
        )),
    };
    assert_eq!(r, NVML_SUCCESS);
    bits(&set)
}

fn bits(set: &[c_ulong]) -> Vec<u32> {
    (0..set.len() as u32 * 64)
        .filter(|&b| set[(b / 64) as usize] >> (b % 64) & 1 == 1)
        .collect()
}

fn cpu_list(v: &[u32]) -> String {
    vgpu_cuda_sim::topology::format_cpu_list(v)
}

#[test]
fn dgx_h100_answers_as_nvidia_smi_shows_it() {
    scenario(
        "dgx_h100_answers_as_nvidia_smi_shows_it",
        "preset = \"dgx-h100\"",
        || {
            assert_eq!(ancestor(0, 0), NVML_TOPOLOGY_INTERNAL);
            assert_eq!(ancestor(0, 3), NVML_TOPOLOGY_NODE);
            assert_eq!(ancestor(0, 4), NVML_TOPOLOGY_SYSTEM);
            assert_eq!(nearest(1, NVML_TOPOLOGY_NODE), vec![0, 2, 3]);
            assert_eq!(nearest(1, NVML_TOPOLOGY_HOSTBRIDGE), Vec::<u32>::new());
            assert_eq!(gpu_set(60), vec![4, 5, 6, 7]);
            assert_eq!(gpu_set(112), vec![0, 1, 2, 3]);
            for idx in [
                NVML_P2P_CAPS_INDEX_READ,
                NVML_P2P_CAPS_INDEX_NVLINK,
                NVML_P2P_CAPS_INDEX_ATOMICS,
            ] {
                assert_eq!(p2p(0, 7, idx), NVML_P2P_STATUS_OK);
            }
            assert_eq!(
                p2p(0, 7, NVML_P2P_CAPS_INDEX_PCI),
                NVML_P2P_STATUS_CHIPSET_NOT_SUPPORTED
            );
            let d = dev(2);
            for link in 0..18 {
                let mut on = 0;
                assert_eq!(
                    nv!(nvmlDeviceGetNvLinkState(d, link, &mut on)),
                    NVML_SUCCESS
                );
                assert_eq!(on, NVML_FEATURE_ENABLED);
                let mut ty = 99;
                assert_eq!(
                    nv!(nvmlDeviceGetNvLinkRemoteDeviceType(d, link, &mut ty)),
                    NVML_SUCCESS
                );
                assert_eq!(ty, NVML_NVLINK_DEVICE_TYPE_SWITCH);
            }
            let mut on = 0;
            assert_eq!(
                nv!(nvmlDeviceGetNvLinkState(d, 18, &mut on)),
                NVML_ERROR_NOT_SUPPORTED,
                "a link number the GPU lacks (CUDA 13's nvml.h allows 36)"
            );
            assert_eq!(
                nv!(nvmlDeviceGetNvLinkState(d, 36, &mut on)),
                NVML_ERROR_INVALID_ARGUMENT
            );
            let mut v = 0;
            assert_eq!(nv!(nvmlDeviceGetNvLinkVersion(d, 0, &mut v)), NVML_SUCCESS);
            assert_eq!(v, NVML_NVLINK_VERSION_4_0);
            let mut cap = 9;
            assert_eq!(
                nv!(nvmlDeviceGetNvLinkCapability(
                    d,
                    3,
                    NVML_NVLINK_CAP_P2P_SUPPORTED,
                    &mut cap
                )),
                NVML_SUCCESS
            );
            assert_eq!(cap, 1);
            // SAFETY: all-zero is a valid nvmlPciInfo_t (integers and byte arrays).
            let mut pci: nvmlPciInfo_t = unsafe { std::mem::zeroed() };
            assert_eq!(
                nv!(nvmlDeviceGetNvLinkRemotePciInfo_v2(d, 5, &mut pci)),
                NVML_SUCCESS
            );
            // SAFETY: the export NUL-terminates the bus id.
            let id = unsafe { CStr::from_ptr(pci.busId.as_ptr().cast::<c_char>()) };
            assert_eq!(
                id.to_str().expect("ascii"),
                "00000001:01:00.0",
                "NVSwitch 1 of 4"
            );
            assert_eq!(cpu_list(&cpus(5, None)), "56-111,168-223");
            let mut node = 0;
            assert_eq!(
                nv!(nvmlDeviceGetNumaNodeId(d, &mut node)),
                NVML_ERROR_NOT_SUPPORTED
            );
        },
    );
}

#[test]
fn dgx_a100_has_nps4_affinity_and_pxb_pairs() {
    scenario(
        "dgx_a100_has_nps4_affinity_and_pxb_pairs",
        "preset = \"dgx-a100\"",
        || {
            assert_eq!(ancestor(0, 1), NVML_TOPOLOGY_MULTIPLE);
            assert_eq!(ancestor(0, 2), NVML_TOPOLOGY_NODE);
            assert_eq!(ancestor(6, 1), NVML_TOPOLOGY_SYSTEM);
            assert_eq!(cpu_list(&cpus(0, None)), "48-63,176-191");
            assert_eq!(
                cpu_list(&cpus(6, Some(NVML_AFFINITY_SCOPE_NODE))),
                "80-95,208-223"
            );
            assert_eq!(
                cpu_list(&cpus(0, Some(NVML_AFFINITY_SCOPE_SOCKET))),
                "0-63,128-191"
            );
            let mut nodes = [0 as c_ulong; 1];
            let r = nv!(nvmlDeviceGetMemoryAffinity(
                dev(4),
                1,
                nodes.as_mut_ptr(),
                NVML_AFFINITY_SCOPE_NODE
            ));
            assert_eq!(r, NVML_SUCCESS);
            assert_eq!(bits(&nodes), vec![7]);
            let r = nv!(nvmlDeviceGetMemoryAffinity(
                dev(4),
                1,
                nodes.as_mut_ptr(),
                NVML_AFFINITY_SCOPE_SOCKET
            ));
            assert_eq!(r, NVML_SUCCESS);
            assert_eq!(bits(&nodes), vec![4, 5, 6, 7]);
            let mut v = 0;
            assert_eq!(
                nv!(nvmlDeviceGetNvLinkVersion(dev(0), 11, &mut v)),
                NVML_SUCCESS
            );
            assert_eq!(v, NVML_NVLINK_VERSION_3_0);
            assert_eq!(
                nv!(nvmlDeviceGetNvLinkVersion(dev(0), 12, &mut v)),
                NVML_ERROR_NOT_SUPPORTED
            );
        },
    );
}

#[test]
fn pcie_and_t4_nodes_have_no_nvlink_and_no_p2p_across_sockets() {
    scenario("pcie_8gpu", "preset = \"pcie-8gpu\"", || {
        assert_eq!(ancestor(0, 1), NVML_TOPOLOGY_SINGLE);
        assert_eq!(ancestor(0, 2), NVML_TOPOLOGY_NODE);
        assert_eq!(nearest(4, NVML_TOPOLOGY_SINGLE), vec![5]);
        assert_eq!(p2p(0, 1, NVML_P2P_CAPS_INDEX_READ), NVML_P2P_STATUS_OK);
        assert_eq!(
            p2p(0, 1, NVML_P2P_CAPS_INDEX_NVLINK),
            NVML_P2P_STATUS_NOT_SUPPORTED
        );
        assert_eq!(
            p2p(0, 5, NVML_P2P_CAPS_INDEX_WRITE),
            NVML_P2P_STATUS_CHIPSET_NOT_SUPPORTED
        );
        let mut on = 0;
        assert_eq!(
            nv!(nvmlDeviceGetNvLinkState(dev(0), 0, &mut on)),
            NVML_ERROR_NOT_SUPPORTED
        );
    });
    scenario("t4_4gpu", "preset = \"t4-4gpu\"", || {
        assert_eq!(ancestor(2, 3), NVML_TOPOLOGY_HOSTBRIDGE);
        assert_eq!(ancestor(1, 2), NVML_TOPOLOGY_SYSTEM);
        assert_eq!(gpu_set(45), vec![0, 1]);
        // A count too small for the list says how many it needs.
        let mut n: c_uint = 1;
        let mut hs = [std::ptr::null_mut(); 1];
        let r = nv!(nvmlSystemGetTopologyGpuSet(45, &mut n, hs.as_mut_ptr()));
        assert_eq!((r, n), (NVML_ERROR_INSUFFICIENT_SIZE, 2));
    });
}

#[test]
fn the_default_node_keeps_its_one_gpu_and_answers_topology() {
    scenario("default_node", "", || {
        let mut n = 0;
        assert_eq!(nv!(nvmlDeviceGetCount_v2(&mut n)), NVML_SUCCESS);
        assert_eq!(n, 1);
        assert_eq!(nearest(0, NVML_TOPOLOGY_SYSTEM), Vec::<u32>::new());
        assert!(cpus(0, None).contains(&0));
    });
}
