//! The simulated driver as an unmodified third-party Rust client uses it: `cudarc`.
//!
//! cudarc (features `driver`, `dynamic-loading`) `dlopen`s `libcuda.so` (then
//! `libcuda.so.1`, …) on first use and resolves each entry point by its exact name with
//! `dlsym`. To make it load the simulator rather than whatever the test process could
//! find, the scenario runs in a fresh copy of this test binary started with
//! `LD_LIBRARY_PATH=<repo>/target/cuda-sim` and its own `VGPU_SIM_DIR`; the parent test
//! only checks that the child passed. The libraries come from `cargo xtask sim`.

// cudarc's kernel launch is `unsafe` (it cannot check arguments against the kernel).
#![allow(unsafe_code)]

use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;

use cudarc::driver::sys::{CUdevice_attribute, CUevent_flags};
use cudarc::driver::{CudaContext, CudaStream, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;

/// One block of one thread: the spin kernel's launch.
const ONE_THREAD: LaunchConfig = LaunchConfig {
    grid_dim: (1, 1, 1),
    block_dim: (1, 1, 1),
    shared_mem_bytes: 0,
};

/// Set in the child: run the scenario instead of spawning it.
const CHILD: &str = "VGPU_CUDARC_CHILD";

/// The built-in kernels of the simulator, as a client would write them.
const PTX: &str = r#"
.version 8.0
.target sm_90
.address_size 64

.visible .entry vgpu_sim_spin(.param .u64 ns)
{
    ret;
}

.visible .entry vgpu_sim_fill_u32(.param .u64 ptr, .param .u32 value, .param .u64 count)
{
    ret;
}
"#;

fn sim_dir() -> PathBuf {
    // Where `cargo xtask sim` installs it: `$CARGO_TARGET_DIR/cuda-sim` (a relative
    // target directory is relative to the repository root), else `target/cuda-sim`.
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(|t| root.join(t))
        .unwrap_or_else(|| root.join("target"));
    target.join("cuda-sim")
}

#[test]
fn cudarc_drives_the_simulator() {
    if std::env::var_os(CHILD).is_some() {
        return;
    }
    let lib_dir = sim_dir();
    let lib = lib_dir.join("libcuda.so.1");
    assert!(
        lib.is_file() && lib_dir.join("libcuda.so").is_file(),
        "{} is missing: build the simulated driver first with `cargo xtask sim`",
        lib.display()
    );
    let lib_dir = lib_dir.canonicalize().expect("canonical target/cuda-sim");
    let state = tempfile::tempdir().expect("tempdir");
    let out = Command::new(std::env::current_exe().expect("test binary path"))
        .args([
            "cudarc_child_scenario",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, "1")
        .env("LD_LIBRARY_PATH", &lib_dir)
        .env("VGPU_SIM_DIR", state.path().join("state"))
        .env_remove("VGPU_SIM_CONFIG")
        .output()
        .expect("run the cudarc child");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "cudarc scenario failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    // The child really ran the scenario (not filtered out by name).
    assert!(
        stdout.contains("cudarc scenario done"),
        "the child did not run the scenario:\n{stdout}\n{stderr}"
    );
}

/// The scenario; does nothing unless started by [`cudarc_drives_the_simulator`].
#[test]
fn cudarc_child_scenario() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    scenario();
    // cudarc loaded the simulator, not some other libcuda.
    let maps = std::fs::read_to_string("/proc/self/maps").expect("read /proc/self/maps");
    let dir = sim_dir().canonicalize().expect("canonical target/cuda-sim");
    let loaded = maps
        .lines()
        .find(|l| l.contains("libcuda.so"))
        .expect("libcuda is mapped");
    assert!(
        loaded.contains(dir.to_str().expect("utf-8 path")),
        "cudarc loaded another libcuda: {loaded}"
    );
    println!(
        "cudarc scenario done, driver {}",
        loaded.rsplit(' ').next().unwrap_or("")
    );
}

fn scenario() {
    // Context, device queries.
    assert_eq!(CudaContext::device_count().expect("device count"), 1);
    let ctx = CudaContext::new(0).expect("primary context on device 0");
    assert_eq!(ctx.name().expect("name"), "NVIDIA H100 80GB HBM3");
    assert_eq!(ctx.compute_capability().expect("cc"), (9, 0));
    assert_eq!(ctx.total_mem().expect("total mem"), 80 << 30);
    let attr = |a| ctx.attribute(a).expect("attribute");
    assert_eq!(
        attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
        132
    );
    assert_eq!(attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_WARP_SIZE), 32);
    assert_eq!(
        attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK),
        1024
    );
    assert_eq!(ctx.uuid().expect("uuid").bytes.len(), 16);

    let (free0, total) = ctx.mem_get_info().expect("mem info");
    assert_eq!(total, 80 << 30);
    assert!(
        free0 < total,
        "the context itself costs device memory: free {free0}"
    );

    let stream = ctx.new_stream().expect("stream");
    round_trip(&stream);

    // A large allocation shows in cuMemGetInfo, and comes back when freed.
    const BIG: usize = 256 << 20;
    let big = stream.alloc_zeros::<u8>(BIG).expect("alloc 256 MiB");
    stream.synchronize().expect("sync");
    let (free1, _) = ctx.mem_get_info().expect("mem info");
    assert!(
        free0 - free1 >= BIG,
        "256 MiB allocated but free went {free0} -> {free1}"
    );
    drop(big);
    stream.synchronize().expect("sync");
    let (free2, _) = ctx.mem_get_info().expect("mem info");
    assert!(
        free2 > free1,
        "freeing 256 MiB did not raise free ({free1} -> {free2})"
    );

    kernels(&ctx, &stream);
    streams(&ctx);
    graph_host_node(&ctx, &stream);
    ctx.synchronize().expect("context synchronize");
    let (before, _) = ctx.mem_get_info().expect("mem info");
    non_primary(before);
    let (after, _) = ctx.mem_get_info().expect("mem info");
    assert_eq!(
        after, before,
        "destroying a created context gives its memory back"
    );
}

/// Set by [`late_host_fn`] when it has run to its end.
static HOST_FN_DONE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// A graph's host node that takes 200 ms of host time: far longer than the kernel
/// before it, so a synchronization that trusts the kernel's end returns before it.
unsafe extern "C" fn late_host_fn(_: *mut std::ffi::c_void) {
    std::thread::sleep(std::time::Duration::from_millis(200));
    HOST_FN_DONE.store(true, std::sync::atomic::Ordering::SeqCst);
}

/// A graph of a kernel then a host function: the stream's synchronization returns only
/// after the host function ran, whatever the kernel's end on the device's clock says
/// (the host node's effect is the host's; so are a fill's or a copy's after a kernel in
/// one unit of work, which this once raced under load).
fn graph_host_node(ctx: &Arc<CudaContext>, stream: &Arc<CudaStream>) {
    use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    let module = ctx
        .load_module(Ptx::from_src(PTX))
        .expect("load PTX module");
    let spin = module
        .load_function("vgpu_sim_spin")
        .expect("spin function");
    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .expect("begin capture");
    const NS: u64 = 20_000_000;
    let mut launch = stream.launch_builder(&spin);
    launch.arg(&NS);
    // SAFETY: one .u64 parameter, as the kernel declares.
    unsafe { launch.launch(ONE_THREAD) }.expect("capture spin");
    // SAFETY: a function that ignores its argument; the stream is live.
    unsafe {
        cudarc::driver::result::stream::launch_host_function(
            stream.cu_stream(),
            late_host_fn,
            std::ptr::null_mut(),
        )
    }
    .expect("capture host function");
    let graph = stream
        .end_capture(CUgraphInstantiate_flags(0))
        .expect("end capture")
        .expect("a graph was captured");
    graph.launch().expect("graph launch");
    stream.synchronize().expect("sync after graph");
    assert!(
        HOST_FN_DONE.load(std::sync::atomic::Ordering::SeqCst),
        "cuStreamSynchronize returned before the graph's host node ran"
    );
}

/// Ordering across streams through events, and queries of busy streams and events.
fn streams(ctx: &Arc<CudaContext>) {
    let module = ctx
        .load_module(Ptx::from_src(PTX))
        .expect("load PTX module");
    let spin = module
        .load_function("vgpu_sim_spin")
        .expect("spin function");
    let fill = module
        .load_function("vgpu_sim_fill_u32")
        .expect("fill function");

    // A 1 s spin on stream a; stream b joins a, then fills: the fill must not run
    // before the spin is done, and a busy event reports "not ready". (1 s, so that even
    // a heavily loaded machine does not stall this thread for the whole kernel between
    // the launch and the queries.)
    let a = ctx.new_stream().expect("stream a");
    let b = ctx.new_stream().expect("stream b");
    let mut buf = b.alloc_zeros::<u32>(1024).expect("alloc");
    b.synchronize().expect("sync");
    const NS: u64 = 1_000_000_000;
    let mut launch = a.launch_builder(&spin);
    launch.arg(&NS);
    // SAFETY: one .u64 parameter, as the kernel declares.
    unsafe { launch.launch(ONE_THREAD) }.expect("launch spin");
    let done = a.record_event(None).expect("record on a");
    assert!(
        !done.try_is_complete().expect("event query"),
        "an event behind a 1 s kernel is complete at once"
    );
    b.join(&a).expect("b waits for a");
    let value = 7u32;
    let count = 1024u64;
    let mut launch = b.launch_builder(&fill);
    launch.arg(&mut buf).arg(&value).arg(&count);
    // SAFETY: the arguments match the kernel's parameters; count is within buf.
    unsafe { launch.launch(LaunchConfig::for_num_elems(1024)) }.expect("launch fill");
    let fill_done = b.record_event(None).expect("record on b");
    assert!(
        !fill_done.try_is_complete().expect("event query"),
        "the fill on b ran before the spin on a that it waits for"
    );
    b.synchronize().expect("sync b");
    assert!(
        done.is_complete(),
        "b finished before the spin on a it waited for"
    );
    assert!(
        b.clone_dtoh(&buf)
            .expect("dtoh")
            .iter()
            .all(|&w| w == value)
    );

    // The per-thread default stream works as a stream.
    let pts = ctx.per_thread_stream();
    let data: Vec<u32> = (0..4096).collect();
    let dev = pts
        .clone_htod(&data)
        .expect("htod on the per-thread stream");
    assert_eq!(pts.clone_dtoh(&dev).expect("dtoh"), data);
    pts.synchronize().expect("sync per-thread stream");
}

/// A created (non-primary) context costs device memory and is destroyed on drop;
/// `free` is the device's free memory before it.
fn non_primary(free: usize) {
    let ctx = CudaContext::new_non_primary(0, 0).expect("cuCtxCreate");
    assert!(!ctx.is_primary());
    let (with_ctx, _) = ctx.mem_get_info().expect("mem info");
    assert!(
        with_ctx < free,
        "a second context costs device memory ({free} -> {with_ctx})"
    );
    let stream = ctx.default_stream();
    let data = vec![0xABu8; 1 << 16];
    let dev = stream.clone_htod(&data).expect("htod");
    assert_eq!(stream.clone_dtoh(&dev).expect("dtoh"), data);
    drop(dev);
    drop(stream);
    drop(ctx);
}

/// htod, dtoh, dtod and memset really move bytes.
fn round_trip(stream: &Arc<CudaStream>) {
    let data: Vec<u32> = (0..100_000u32)
        .map(|i| i.wrapping_mul(2_654_435_761))
        .collect();
    let dev = stream.clone_htod(&data).expect("htod");
    let back = stream.clone_dtoh(&dev).expect("dtoh");
    assert_eq!(back, data, "data round trip through device memory");

    let mut copy = stream.clone_dtod(&dev).expect("dtod");
    assert_eq!(stream.clone_dtoh(&copy).expect("dtoh"), data);
    stream.memset_zeros(&mut copy).expect("memset");
    let zeros = stream.clone_dtoh(&copy).expect("dtoh");
    assert!(zeros.iter().all(|&w| w == 0), "memset left non-zero words");
    // The source is untouched by the memset of the copy.
    assert_eq!(stream.clone_dtoh(&dev).expect("dtoh"), data);

    let mut host = vec![0u32; 1000];
    stream
        .memcpy_dtoh(&dev.slice(500..1500), &mut host)
        .expect("dtoh view");
    assert_eq!(host, data[500..1500]);
    stream.synchronize().expect("stream synchronize");
}

/// A PTX module, the fill kernel's output, and the spin kernel's device time.
fn kernels(ctx: &Arc<CudaContext>, stream: &Arc<CudaStream>) {
    let module = ctx
        .load_module(Ptx::from_src(PTX))
        .expect("load PTX module");
    let fill = module
        .load_function("vgpu_sim_fill_u32")
        .expect("fill function");
    let spin = module
        .load_function("vgpu_sim_spin")
        .expect("spin function");
    assert!(
        module.load_function("no_such_kernel").is_err(),
        "unknown kernel must fail"
    );

    const N: usize = 1 << 20;
    let mut buf = stream.alloc_zeros::<u32>(N).expect("alloc");
    let value = 0xC0FF_EE42u32;
    let count = (N / 2) as u64;
    let mut launch = stream.launch_builder(&fill);
    launch.arg(&mut buf).arg(&value).arg(&count);
    // SAFETY: the arguments match the kernel's parameters (.u64 ptr, .u32, .u64) and
    // `count` is within `buf`.
    unsafe { launch.launch(LaunchConfig::for_num_elems(count as u32)) }.expect("launch fill");
    let out = stream.clone_dtoh(&buf).expect("dtoh");
    assert!(
        out[..N / 2].iter().all(|&w| w == value),
        "fill wrote the first half"
    );
    assert!(
        out[N / 2..].iter().all(|&w| w == 0),
        "fill wrote past count"
    );

    // Spin for 20 ms of device time between two timing events.
    const NS: u64 = 20_000_000;
    let start = stream
        .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .expect("start event");
    let mut launch = stream.launch_builder(&spin);
    launch.arg(&NS);
    // SAFETY: one .u64 parameter, as the kernel declares.
    unsafe { launch.launch(ONE_THREAD) }.expect("launch spin");
    let end = stream
        .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .expect("end event");
    stream.synchronize().expect("stream synchronize");
    assert!(end.is_complete(), "the end event completed with the stream");
    let ms = start.elapsed_ms(&end).expect("elapsed");
    assert!(
        f64::from(ms) >= NS as f64 / 1e6,
        "events measured {ms} ms around a {NS} ns spin"
    );
}
