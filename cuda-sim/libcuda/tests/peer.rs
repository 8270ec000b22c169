//! Peer-to-peer on the node presets, through the driver's exports as a C client calls
//! them: which pairs can access each other, the P2P attributes, enabling and disabling
//! peer access with the real error codes, `CUDA_VISIBLE_DEVICES` renumbering, and peer
//! copies whose device time follows the link class (NVLink ≫ same switch > across
//! sockets). Each scenario runs in a fresh copy of this binary (the driver is initialised
//! once per process) with its own `VGPU_SIM_DIR` and preset.

// The exports are `unsafe extern "C"` functions, called with pointers to locals.
#![allow(unsafe_code)]

use std::ffi::{c_int, c_void};
use std::process::Command;
use std::time::Instant;

use cuda::exports::*;
use vgpu_cuda_abi::cuda::*;

macro_rules! cu {
    ($e:expr) => {{
        // SAFETY: every call passes pointers to live locals or handles the driver gave.
        unsafe { $e }
    }};
}

const SCENARIO: &str = "CUDA_PEER_SCENARIO";

fn scenario(name: &str, preset: &str, visible: Option<&str>, body: fn()) {
    if std::env::var(SCENARIO).as_deref() == Ok(name) {
        assert_eq!(cu!(cuInit(0)), CUDA_SUCCESS);
        body();
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let p = dir.path().join("sim.toml");
    std::fs::write(&p, format!("preset = \"{preset}\"\n")).expect("write config");
    let mut cmd = Command::new(std::env::current_exe().expect("test binary path"));
    cmd.args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(SCENARIO, name)
        .env("VGPU_SIM_DIR", dir.path().join("state"))
        .env("VGPU_SIM_CONFIG", &p)
        .env_remove("CUDA_VISIBLE_DEVICES");
    if let Some(v) = visible {
        cmd.env("CUDA_VISIBLE_DEVICES", v);
    }
    let out = cmd.output().expect("run scenario");
    assert!(
        out.status.success(),
        "scenario {name} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn can(a: c_int, b: c_int) -> c_int {
    let mut v = -1;
    assert_eq!(cu!(cuDeviceCanAccessPeer(&mut v, a, b)), CUDA_SUCCESS);
    v
}

fn attr(a: c_int, b: c_int, which: c_int) -> c_int {
    let mut v = -1;
    assert_eq!(
        cu!(cuDeviceGetP2PAttribute(&mut v, which, a, b)),
        CUDA_SUCCESS
    );
    v
}

fn primary(dev: c_int) -> CUcontext {
    let mut c = std::ptr::null_mut();
    assert_eq!(cu!(cuDevicePrimaryCtxRetain(&mut c, dev)), CUDA_SUCCESS);
    c
}

fn alloc(ctx: CUcontext, n: usize) -> CUdeviceptr {
    assert_eq!(cu!(cuCtxSetCurrent(ctx)), CUDA_SUCCESS);
    let mut p = 0;
    assert_eq!(cu!(cuMemAlloc_v2(&mut p, n)), CUDA_SUCCESS);
    p
}

/// Seconds of device time the fastest of five synchronous peer copies of `n` bytes from
/// `src` to `dst` takes (after one that touches the pages), read from events on the
/// source's stream (the host's own copy of the bytes, slow on a loaded machine, is not
/// device time).
fn copy_time(dst: c_int, src: c_int, n: usize) -> f64 {
    let (dc, sc) = (primary(dst), primary(src));
    let (d, s) = (alloc(dc, n), alloc(sc, n));
    assert_eq!(cu!(cuMemcpyPeer(d, dc, s, sc, n)), CUDA_SUCCESS);
    assert_eq!(cu!(cuCtxSetCurrent(sc)), CUDA_SUCCESS);
    let (mut e0, mut e1) = (std::ptr::null_mut(), std::ptr::null_mut());
    assert_eq!(cu!(cuEventCreate(&mut e0, 0)), CUDA_SUCCESS);
    assert_eq!(cu!(cuEventCreate(&mut e1, 0)), CUDA_SUCCESS);
    let secs = (0..5)
        .map(|_| {
            let t = Instant::now();
            // Async, so that `e1` is queued right behind the copy: after a synchronous
            // copy it would be queued only when the call returned, and the simulator's
            // call returns after the host has moved the bytes (slower than the link on a
            // loaded host), which would time the host, not the link.
            assert_eq!(cu!(cuEventRecord(e0, std::ptr::null_mut())), CUDA_SUCCESS);
            assert_eq!(
                cu!(cuMemcpyPeerAsync(d, dc, s, sc, n, std::ptr::null_mut())),
                CUDA_SUCCESS
            );
            assert_eq!(cu!(cuEventRecord(e1, std::ptr::null_mut())), CUDA_SUCCESS);
            assert_eq!(cu!(cuEventSynchronize(e1)), CUDA_SUCCESS);
            let wall = t.elapsed().as_secs_f64();
            let mut ms = 0f32;
            assert_eq!(cu!(cuEventElapsedTime(&mut ms, e0, e1)), CUDA_SUCCESS);
            let dev = f64::from(ms) / 1e3;
            assert!(wall >= dev * 0.99, "wall {wall} s < device {dev} s");
            dev
        })
        .fold(f64::MAX, f64::min);
    assert_eq!(cu!(cuEventDestroy_v2(e0)), CUDA_SUCCESS);
    assert_eq!(cu!(cuEventDestroy_v2(e1)), CUDA_SUCCESS);
    secs
}

#[test]
fn pcie_node_peers_within_a_socket_only() {
    scenario(
        "pcie_node_peers_within_a_socket_only",
        "pcie-8gpu",
        None,
        || {
            assert_eq!((can(0, 1), can(0, 3), can(0, 4), can(2, 2)), (1, 1, 0, 0));
            assert_eq!(attr(0, 1, p2p_attr::ACCESS_SUPPORTED), 1);
            assert_eq!(attr(0, 5, p2p_attr::ACCESS_SUPPORTED), 0);
            assert_eq!(attr(0, 1, p2p_attr::NATIVE_ATOMIC_SUPPORTED), 0);
            assert!(
                attr(0, 1, p2p_attr::PERFORMANCE_RANK) < attr(0, 2, p2p_attr::PERFORMANCE_RANK)
            );
            let mut v = 0;
            assert_eq!(
                cu!(cuDeviceGetP2PAttribute(
                    &mut v,
                    p2p_attr::ACCESS_SUPPORTED,
                    1,
                    1
                )),
                CUDA_ERROR_INVALID_DEVICE
            );
            assert_eq!(
                cu!(cuDeviceGetP2PAttribute(&mut v, 99, 0, 1)),
                CUDA_ERROR_INVALID_VALUE
            );

            let (c0, c1, c4) = (primary(0), primary(1), primary(4));
            assert_eq!(cu!(cuCtxSetCurrent(c0)), CUDA_SUCCESS);
            assert_eq!(
                cu!(cuCtxDisablePeerAccess(c1)),
                CUDA_ERROR_PEER_ACCESS_NOT_ENABLED
            );
            assert_eq!(cu!(cuCtxEnablePeerAccess(c1, 0)), CUDA_SUCCESS);
            assert_eq!(
                cu!(cuCtxEnablePeerAccess(c1, 0)),
                CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
            );
            assert_eq!(
                cu!(cuCtxEnablePeerAccess(c4, 0)),
                CUDA_ERROR_PEER_ACCESS_UNSUPPORTED
            );
            assert_eq!(cu!(cuCtxEnablePeerAccess(c0, 0)), CUDA_ERROR_INVALID_DEVICE);
            assert_eq!(cu!(cuCtxDisablePeerAccess(c1)), CUDA_SUCCESS);
            assert_eq!(
                cu!(cuCtxDisablePeerAccess(c1)),
                CUDA_ERROR_PEER_ACCESS_NOT_ENABLED
            );

            // Data crosses, and time follows the link: same switch (PIX, 28 GB/s) beats
            // across sockets (SYS, 20 GB/s). 64 MiB: 2.4 ms vs 3.4 ms of device time.
            let n = 64 << 20;
            let (d, s) = (alloc(c1, n), alloc(c0, n));
            let pattern: Vec<u8> = (0..n).map(|i| (i * 7) as u8).collect();
            assert_eq!(cu!(cuCtxSetCurrent(c0)), CUDA_SUCCESS);
            assert_eq!(
                cu!(cuMemcpyHtoD_v2(s, pattern.as_ptr().cast::<c_void>(), n)),
                CUDA_SUCCESS
            );
            assert_eq!(cu!(cuMemcpyPeer(d, c1, s, c0, n)), CUDA_SUCCESS);
            let mut back = vec![0u8; n];
            assert_eq!(
                cu!(cuMemcpyDtoH_v2(back.as_mut_ptr().cast::<c_void>(), d, n)),
                CUDA_SUCCESS
            );
            assert!(back == pattern, "the peer copy moved the bytes");
            // A pointer of the wrong device for its context is refused.
            assert_eq!(
                cu!(cuMemcpyPeer(s, c1, d, c0, 16)),
                CUDA_ERROR_INVALID_VALUE
            );

            let pix = copy_time(1, 0, n);
            let node = copy_time(2, 0, n);
            let sys = copy_time(4, 0, n);
            assert!(pix >= 0.0023 && sys >= 0.0033, "pix {pix} s, sys {sys} s");
            assert!(
                pix < sys && node < sys && node >= 0.0026,
                "pix {pix} s, node {node} s, sys {sys} s"
            );
        },
    );
}

#[test]
fn dgx_h100_copies_over_nvlink_and_async_copies_take_device_time() {
    scenario("dgx_h100_nvlink", "dgx-h100", None, || {
        assert_eq!(can(0, 7), 1);
        assert_eq!(attr(3, 6, p2p_attr::NATIVE_ATOMIC_SUPPORTED), 1);
        assert_eq!(attr(3, 6, p2p_attr::PERFORMANCE_RANK), 0);
        // 450 GB/s over 18 NVLink4 links: 256 MiB in about 0.6 ms.
        let n = 256 << 20;
        let nv = copy_time(7, 0, n);
        assert!(nv >= 0.00059, "nvlink {nv} s");
        // Asynchronous: events on the stream see the link's time.
        let (c0, c1) = (primary(0), primary(1));
        let (d, s) = (alloc(c1, n), alloc(c0, n));
        assert_eq!(cu!(cuCtxSetCurrent(c0)), CUDA_SUCCESS);
        let (mut e0, mut e1) = (std::ptr::null_mut(), std::ptr::null_mut());
        assert_eq!(cu!(cuEventCreate(&mut e0, 0)), CUDA_SUCCESS);
        assert_eq!(cu!(cuEventCreate(&mut e1, 0)), CUDA_SUCCESS);
        assert_eq!(cu!(cuEventRecord(e0, std::ptr::null_mut())), CUDA_SUCCESS);
        for _ in 0..4 {
            assert_eq!(
                cu!(cuMemcpyPeerAsync(d, c1, s, c0, n, std::ptr::null_mut())),
                CUDA_SUCCESS
            );
        }
        assert_eq!(cu!(cuEventRecord(e1, std::ptr::null_mut())), CUDA_SUCCESS);
        assert_eq!(cu!(cuEventSynchronize(e1)), CUDA_SUCCESS);
        let mut ms = 0f32;
        assert_eq!(cu!(cuEventElapsedTime(&mut ms, e0, e1)), CUDA_SUCCESS);
        assert!(
            ms >= 2.3,
            "4 × 256 MiB at 450 GB/s is 2.4 ms; measured {ms} ms"
        );
    });
}

#[test]
fn visible_devices_renumber_peers() {
    // The process sees node GPUs 4 and 0 as its devices 0 and 1 (a container granted
    // them, say): on the PCIe node they are in different sockets.
    scenario(
        "visible_devices_renumber_peers",
        "pcie-8gpu",
        Some("4,0,5"),
        || {
            let mut n = 0;
            assert_eq!(cu!(cuDeviceGetCount(&mut n)), CUDA_SUCCESS);
            assert_eq!(n, 3);
            assert_eq!(can(0, 1), 0, "node GPUs 4 and 0: across sockets");
            assert_eq!(can(0, 2), 1, "node GPUs 4 and 5: one switch");
            let mut v = 0;
            assert_eq!(
                cu!(cuDeviceCanAccessPeer(&mut v, 0, 3)),
                CUDA_ERROR_INVALID_DEVICE
            );
        },
    );
}
