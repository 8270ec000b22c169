//! NVML as a client sees it, on a simulated node driven by real processes.
//!
//! Each scenario runs in a fresh copy of this test binary (its own NVML init, its own
//! `VGPU_SIM_DIR`); processes that use the GPU are further copies running
//! [`helper_gpu_process`], which claims a slot, creates a "context", holds memory and,
//! if asked, keeps the execution engine busy, through the same state API the simulated
//! `libcuda` uses. They are killed with SIGKILL, as a crashing CUDA program would be.

// The exports under test are `unsafe extern "C"` functions, called here with pointers
// to locals; the cdylib check uses dlopen.
#![allow(unsafe_code)]

use std::ffi::{CStr, c_char, c_int, c_uint, c_ulonglong};
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use nvidia_ml::*;
use vgpu_cuda_abi::nvml::*;
use vgpu_cuda_sim::node_state::{State, event_type};
use vgpu_sys::mono_ns;

/// Calls exported NVML functions.
macro_rules! nv {
    ($e:expr) => {{
        // SAFETY: every call in this file passes pointers to live locals, arrays at least
        // as long as the count it passes, or null on purpose (which the exports reject).
        unsafe { $e }
    }};
}

const SCENARIO: &str = "NVML_TEST_SCENARIO";
const HOLD_BYTES: &str = "NVML_TEST_HOLD_BYTES";
const HOLD_BUSY: &str = "NVML_TEST_HOLD_BUSY";
const READY: &str = "NVML-TEST-GPU-PROCESS-READY";

/// Runs `body` in a fresh copy of this binary with its own state directory (and
/// simulator config, if given).
fn scenario(name: &str, config: Option<&str>, body: fn()) {
    if std::env::var(SCENARIO).as_deref() == Ok(name) {
        body();
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cmd = Command::new(std::env::current_exe().expect("test binary path"));
    cmd.args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(SCENARIO, name)
        .env("VGPU_SIM_DIR", dir.path().join("state"))
        .env_remove("VGPU_SIM_CONFIG");
    if let Some(c) = config {
        let p = dir.path().join("sim.toml");
        std::fs::write(&p, c).expect("write config");
        cmd.env("VGPU_SIM_CONFIG", p);
    }
    let out = cmd.output().expect("run scenario");
    assert!(
        out.status.success(),
        "scenario {name} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A process using the GPU (see [`helper_gpu_process`]); killed with SIGKILL on drop.
struct GpuProcess {
    child: Child,
}

impl GpuProcess {
    fn start(bytes: u64, busy: bool) -> GpuProcess {
        let mut child = Command::new(std::env::current_exe().expect("test binary path"))
            .args([
                "helper_gpu_process",
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env_remove(SCENARIO)
            .env(HOLD_BYTES, bytes.to_string())
            .env(HOLD_BUSY, if busy { "1" } else { "0" })
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn gpu process");
        let out = child.stdout.take().expect("piped stdout");
        let mut lines = BufReader::new(out).lines();
        loop {
            match lines.next() {
                Some(Ok(l)) if l.contains(READY) => break,
                Some(Ok(_)) => continue,
                _ => panic!("gpu process exited before it was ready: {:?}", child.wait()),
            }
        }
        GpuProcess { child }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for GpuProcess {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// Not a test: the body of a GPU-using process, when [`GpuProcess`] starts one.
#[test]
fn helper_gpu_process() {
    let Ok(bytes) = std::env::var(HOLD_BYTES) else {
        return;
    };
    let bytes: u64 = bytes.parse().expect("byte count");
    let busy = std::env::var(HOLD_BUSY).as_deref() == Ok("1");
    let st = State::open_from_env().expect("open state");
    let slot = st.claim_slot().expect("claim slot");
    // A context, as libcuda creates one: counted on the device and charged its overhead.
    st.slot(slot).devs[0].contexts.store(1, Ordering::Release);
    st.reserve(slot, 0, st.info(0).context_overhead, false)
        .expect("context memory");
    st.reserve(slot, 0, st.granular(0, bytes).expect("size"), true)
        .expect("allocation");
    println!("{READY}");
    loop {
        if busy {
            st.engine_acquire(slot, 0);
            let t0 = mono_ns();
            std::thread::sleep(Duration::from_millis(20));
            st.add_busy(slot, 0, t0, mono_ns());
            st.engine_release(slot, 0);
        } else {
            std::thread::sleep(Duration::from_secs(1));
        }
    }
}

fn init() {
    assert_eq!(nv!(nvmlInit_v2()), NVML_SUCCESS);
}

fn handle(i: u32) -> nvmlDevice_t {
    let mut h: nvmlDevice_t = std::ptr::null_mut();
    assert_eq!(nv!(nvmlDeviceGetHandleByIndex_v2(i, &mut h)), NVML_SUCCESS);
    h
}

fn c_buf_str(b: &[c_char]) -> String {
    let bytes: Vec<u8> = b
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8(bytes).expect("utf-8")
}

fn name(h: nvmlDevice_t) -> Result<String, nvmlReturn_t> {
    let mut buf = [0 as c_char; NVML_DEVICE_NAME_V2_BUFFER_SIZE];
    match nv!(nvmlDeviceGetName(h, buf.as_mut_ptr(), buf.len() as c_uint)) {
        NVML_SUCCESS => Ok(c_buf_str(&buf)),
        e => Err(e),
    }
}

fn uuid(h: nvmlDevice_t) -> String {
    let mut buf = [0 as c_char; NVML_DEVICE_UUID_V2_BUFFER_SIZE];
    assert_eq!(
        nv!(nvmlDeviceGetUUID(h, buf.as_mut_ptr(), buf.len() as c_uint)),
        NVML_SUCCESS
    );
    c_buf_str(&buf)
}

fn memory(h: nvmlDevice_t) -> nvmlMemory_t {
    let mut m = nvmlMemory_t::default();
    assert_eq!(nv!(nvmlDeviceGetMemoryInfo(h, &mut m)), NVML_SUCCESS);
    m
}

/// The v3 running-process query, done the way pynvml does it (size query, then fill).
fn processes(h: nvmlDevice_t) -> Vec<nvmlProcessInfo_t> {
    let mut n: c_uint = 0;
    match nv!(nvmlDeviceGetComputeRunningProcesses_v3(
        h,
        &mut n,
        std::ptr::null_mut()
    )) {
        NVML_SUCCESS => {
            assert_eq!(n, 0);
            return Vec::new();
        }
        NVML_ERROR_INSUFFICIENT_SIZE => assert!(n > 0),
        e => panic!("size query failed: {e}"),
    }
    let mut v = vec![nvmlProcessInfo_t::default(); n as usize + 2];
    let mut cap = v.len() as c_uint;
    assert_eq!(
        nv!(nvmlDeviceGetComputeRunningProcesses_v3(
            h,
            &mut cap,
            v.as_mut_ptr()
        )),
        NVML_SUCCESS
    );
    v.truncate(cap as usize);
    v
}

// ---- scenarios -------------------------------------------------------------------------------

#[test]
fn init_is_ref_counted() {
    scenario("init_is_ref_counted", None, || {
        let mut n: c_uint = 0;
        assert_eq!(nv!(nvmlDeviceGetCount_v2(&mut n)), NVML_ERROR_UNINITIALIZED);
        assert_eq!(nv!(nvmlShutdown()), NVML_ERROR_UNINITIALIZED);
        // nvmlErrorString works without init.
        let s = nv!(CStr::from_ptr(nvmlErrorString(NVML_ERROR_UNINITIALIZED)));
        assert_eq!(s.to_str().ok(), Some("Uninitialized"));
        init();
        assert_eq!(nv!(nvmlInitWithFlags(0)), NVML_SUCCESS);
        assert_eq!(nv!(nvmlShutdown()), NVML_SUCCESS);
        assert_eq!(
            nv!(nvmlDeviceGetCount_v2(&mut n)),
            NVML_SUCCESS,
            "one init still outstanding"
        );
        assert_eq!(n, 1);
        assert_eq!(nv!(nvmlShutdown()), NVML_SUCCESS);
        assert_eq!(nv!(nvmlDeviceGetCount(&mut n)), NVML_ERROR_UNINITIALIZED);
        assert_eq!(nv!(nvmlShutdown()), NVML_ERROR_UNINITIALIZED);
        // Versions.
        init();
        let mut buf = [0 as c_char; NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE];
        assert_eq!(
            nv!(nvmlSystemGetDriverVersion(
                buf.as_mut_ptr(),
                buf.len() as c_uint
            )),
            NVML_SUCCESS
        );
        assert_eq!(c_buf_str(&buf), "570.124.06");
        assert_eq!(
            nv!(nvmlSystemGetDriverVersion(buf.as_mut_ptr(), 4)),
            NVML_ERROR_INSUFFICIENT_SIZE
        );
        let mut v: c_int = 0;
        assert_eq!(nv!(nvmlSystemGetCudaDriverVersion_v2(&mut v)), NVML_SUCCESS);
        assert_eq!(v, 12080);
        let mut name = [0 as c_char; 64];
        let pid = std::process::id();
        assert_eq!(
            nv!(nvmlSystemGetProcessName(pid, name.as_mut_ptr(), 64)),
            NVML_SUCCESS
        );
        assert!(c_buf_str(&name).contains("nvml"), "{}", c_buf_str(&name));
    });
}

#[test]
fn unusable_config_fails_init_as_driver_not_loaded() {
    scenario(
        "unusable_config_fails_init_as_driver_not_loaded",
        Some("[[device]]\nmemory = \"8G\"\n"),
        || {
            assert_eq!(nv!(nvmlInit_v2()), NVML_ERROR_DRIVER_NOT_LOADED);
            let mut n: c_uint = 0;
            assert_eq!(nv!(nvmlDeviceGetCount_v2(&mut n)), NVML_ERROR_UNINITIALIZED);
            assert_eq!(nv!(nvmlShutdown()), NVML_ERROR_UNINITIALIZED);
        },
    );
}

#[test]
fn handles_identity_and_argument_checks() {
    let config = r#"
        [[device]]
        name = "NVIDIA A100-SXM4-40GB"
        memory = "40GiB"
        sm_count = 108
        compute_capability = "8.0"
        pci_bus_id = "0000:07:00.0"
        [[device]]
        uuid = "GPU-11111111-2222-3333-4444-555555555555"
    "#;
    scenario("handles_identity_and_argument_checks", Some(config), || {
        init();
        let mut n: c_uint = 0;
        assert_eq!(nv!(nvmlDeviceGetCount_v2(&mut n)), NVML_SUCCESS);
        assert_eq!(n, 2);
        let (h0, h1) = (handle(0), handle(1));
        assert_ne!(h0, h1);
        assert_eq!(handle(0), h0, "handles are stable");
        let mut h: nvmlDevice_t = std::ptr::null_mut();
        assert_eq!(
            nv!(nvmlDeviceGetHandleByIndex_v2(2, &mut h)),
            NVML_ERROR_INVALID_ARGUMENT
        );
        assert_eq!(
            nv!(nvmlDeviceGetHandleByIndex_v2(0, std::ptr::null_mut())),
            NVML_ERROR_INVALID_ARGUMENT
        );

        assert_eq!(name(h0).as_deref(), Ok("NVIDIA A100-SXM4-40GB"));
        assert_eq!(name(h1).as_deref(), Ok("NVIDIA H100 80GB HBM3"));
        let mut small = [0 as c_char; 8];
        assert_eq!(
            nv!(nvmlDeviceGetName(h0, small.as_mut_ptr(), 8)),
            NVML_ERROR_INSUFFICIENT_SIZE
        );
        // A pointer that is not one of our handles.
        let mut bogus = 0u64;
        let bogus_h: nvmlDevice_t = std::ptr::from_mut(&mut bogus).cast();
        assert_eq!(name(bogus_h), Err(NVML_ERROR_INVALID_ARGUMENT));

        // By UUID and by PCI bus id (both spellings).
        assert_eq!(uuid(h1), "GPU-11111111-2222-3333-4444-555555555555");
        let u = std::ffi::CString::new(uuid(h1)).expect("no NUL");
        assert_eq!(
            nv!(nvmlDeviceGetHandleByUUID(u.as_ptr(), &mut h)),
            NVML_SUCCESS
        );
        assert_eq!(h, h1);
        let unknown = c"GPU-99999999-2222-3333-4444-555555555555";
        assert_eq!(
            nv!(nvmlDeviceGetHandleByUUID(unknown.as_ptr(), &mut h)),
            NVML_ERROR_NOT_FOUND
        );
        for id in [c"0000:07:00.0", c"00000000:07:00.0", c"07:00.0"] {
            h = std::ptr::null_mut();
            assert_eq!(
                nv!(nvmlDeviceGetHandleByPciBusId_v2(id.as_ptr(), &mut h)),
                NVML_SUCCESS,
                "{id:?}"
            );
            assert_eq!(h, h0);
        }
        let mut idx: c_uint = 9;
        assert_eq!(nv!(nvmlDeviceGetIndex(h1, &mut idx)), NVML_SUCCESS);
        assert_eq!(idx, 1);

        // PCI info: v3 layout and the legacy v2 layout.
        let mut pci: nvmlPciInfo_t = nv!(std::mem::zeroed());
        assert_eq!(nv!(nvmlDeviceGetPciInfo_v3(h0, &mut pci)), NVML_SUCCESS);
        assert_eq!(c_buf_str(&pci.busId), "00000000:07:00.0");
        assert_eq!(c_buf_str(&pci.busIdLegacy), "0000:07:00.0");
        assert_eq!((pci.domain, pci.bus, pci.device), (0, 7, 0));
        assert_eq!(pci.pciDeviceId & 0xffff, 0x10de);
        let mut pci2: nvmlPciInfo_v2_t = nv!(std::mem::zeroed());
        assert_eq!(nv!(nvmlDeviceGetPciInfo_v2(h0, &mut pci2)), NVML_SUCCESS);
        assert_eq!(c_buf_str(&pci2.busId), "0000:07:00.0");

        // Derived from the configuration.
        let (mut ma, mut mi): (c_int, c_int) = (0, 0);
        assert_eq!(
            nv!(nvmlDeviceGetCudaComputeCapability(h0, &mut ma, &mut mi)),
            NVML_SUCCESS
        );
        assert_eq!((ma, mi), (8, 0));
        let mut arch: nvmlDeviceArchitecture_t = 0;
        assert_eq!(nv!(nvmlDeviceGetArchitecture(h0, &mut arch)), NVML_SUCCESS);
        assert_eq!(arch, NVML_DEVICE_ARCH_AMPERE);
        assert_eq!(nv!(nvmlDeviceGetArchitecture(h1, &mut arch)), NVML_SUCCESS);
        assert_eq!(arch, NVML_DEVICE_ARCH_HOPPER);
        let mut cores: c_uint = 0;
        assert_eq!(nv!(nvmlDeviceGetNumGpuCores(h0, &mut cores)), NVML_SUCCESS);
        assert_eq!(cores, 108 * 64);
        assert_eq!(memory(h0).total, 40 << 30);
        assert_eq!(memory(h1).total, 80 << 30);

        // Version check of the v2 memory struct.
        let mut m2 = nvmlMemory_v2_t {
            version: 1,
            ..Default::default()
        };
        assert_eq!(
            nv!(nvmlDeviceGetMemoryInfo_v2(h0, &mut m2)),
            NVML_ERROR_ARGUMENT_VERSION_MISMATCH
        );
        assert_eq!(
            nv!(nvmlDeviceGetMemoryInfo(h0, std::ptr::null_mut())),
            NVML_ERROR_INVALID_ARGUMENT
        );

        // Not simulated: an honest NOT_SUPPORTED.
        let mut t: c_uint = 0;
        assert_eq!(
            nv!(nvmlDeviceGetTemperature(h0, 0, &mut t)),
            NVML_ERROR_NOT_SUPPORTED
        );
        assert_eq!(
            nv!(nvmlDeviceGetPowerUsage(h0, &mut t)),
            NVML_ERROR_NOT_SUPPORTED
        );
        let (mut cur, mut pend): (c_uint, c_uint) = (9, 9);
        assert_eq!(
            nv!(nvmlDeviceGetMigMode(h0, &mut cur, &mut pend)),
            NVML_SUCCESS
        );
        assert_eq!(
            (cur, pend),
            (NVML_DEVICE_MIG_DISABLE, NVML_DEVICE_MIG_DISABLE)
        );
        assert_eq!(nv!(nvmlShutdown()), NVML_SUCCESS);
    });
}

#[test]
fn memory_and_processes_follow_a_real_process() {
    scenario("memory_and_processes_follow_a_real_process", None, || {
        init();
        let h = handle(0);
        let st = State::open_from_env().expect("state");
        let overhead = st.info(0).context_overhead;
        let total = st.info(0).memory;
        assert_eq!(
            memory(h),
            nvmlMemory_t {
                total,
                free: total,
                used: 0
            }
        );
        assert!(processes(h).is_empty());

        let bytes = 3 << 30;
        let mut p = GpuProcess::start(bytes, false);
        let used = bytes + overhead;
        assert_eq!(
            memory(h),
            nvmlMemory_t {
                total,
                free: total - used,
                used
            }
        );
        assert_eq!(
            st.mem_info(0),
            (total - used, total),
            "NVML agrees with the driver-side state"
        );
        let mut m2 = nvmlMemory_v2_t {
            version: nvmlMemory_v2,
            ..Default::default()
        };
        assert_eq!(nv!(nvmlDeviceGetMemoryInfo_v2(h, &mut m2)), NVML_SUCCESS);
        assert_eq!(
            (m2.total, m2.reserved, m2.free, m2.used),
            (total, 0, total - used, used)
        );

        // The list protocol: too small a count gets INSUFFICIENT_SIZE and the needed count.
        let mut n: c_uint = 0;
        let mut one = [nvmlProcessInfo_t::default(); 1];
        assert_eq!(
            nv!(nvmlDeviceGetComputeRunningProcesses_v3(
                h,
                &mut n,
                one.as_mut_ptr()
            )),
            NVML_ERROR_INSUFFICIENT_SIZE
        );
        assert_eq!(n, 1);
        let procs = processes(h);
        assert_eq!(procs.len(), 1);
        assert_eq!((procs[0].pid, procs[0].usedGpuMemory), (p.pid(), used));
        assert_eq!(
            (procs[0].gpuInstanceId, procs[0].computeInstanceId),
            (NVML_INSTANCE_ID_NONE, NVML_INSTANCE_ID_NONE)
        );
        // The v1 struct (16 bytes per entry).
        let mut v1 = [nvmlProcessInfo_v1_t::default(); 2];
        let mut n1: c_uint = 2;
        assert_eq!(
            nv!(nvmlDeviceGetComputeRunningProcesses(
                h,
                &mut n1,
                v1.as_mut_ptr()
            )),
            NVML_SUCCESS
        );
        assert_eq!((n1, v1[0].pid, v1[0].usedGpuMemory), (1, p.pid(), used));
        // No graphics or MPS clients exist.
        let mut ng: c_uint = 0;
        assert_eq!(
            nv!(nvmlDeviceGetGraphicsRunningProcesses_v3(
                h,
                &mut ng,
                std::ptr::null_mut()
            )),
            NVML_SUCCESS
        );
        assert_eq!(ng, 0);

        // A second process adds up.
        let q = GpuProcess::start(1 << 30, false);
        assert_eq!(memory(h).used, used + (1 << 30) + overhead);
        let mut pids: Vec<u32> = processes(h).iter().map(|p| p.pid).collect();
        pids.sort_unstable();
        let mut want = vec![p.pid(), q.pid()];
        want.sort_unstable();
        assert_eq!(pids, want);

        // SIGKILL: the process disappears and its memory comes back.
        p.kill9();
        assert_eq!(memory(h).used, (1 << 30) + overhead);
        let procs = processes(h);
        assert_eq!(procs.len(), 1);
        assert_eq!(procs[0].pid, q.pid());
        drop(q);
        assert_eq!(
            memory(h),
            nvmlMemory_t {
                total,
                free: total,
                used: 0
            }
        );
        assert!(processes(h).is_empty());
    });
}

#[test]
fn a_process_with_the_driver_loaded_twice_is_one_entry() {
    scenario(
        "a_process_with_the_driver_loaded_twice_is_one_entry",
        None,
        || {
            init();
            let h = handle(0);
            let st = State::open_from_env().expect("state");
            let overhead = st.info(0).context_overhead;
            // Two slots of this process, as two copies of libcuda (the second loaded
            // with dlmopen) claim them: each with a context and an allocation.
            let mut held = 0;
            for bytes in [64 << 20, 1 << 30] {
                let slot = st.claim_slot().expect("claim slot");
                st.slot(slot).devs[0].contexts.store(1, Ordering::Release);
                st.reserve(slot, 0, overhead, false)
                    .expect("context memory");
                st.reserve(slot, 0, st.granular(0, bytes).expect("size"), true)
                    .expect("allocation");
                held += overhead + bytes;
            }
            // One entry per process with what both copies hold, as the real NVML lists
            // processes (not one per context).
            let procs = processes(h);
            assert_eq!(procs.len(), 1, "{procs:?}");
            assert_eq!(
                (procs[0].pid, procs[0].usedGpuMemory),
                (std::process::id(), held)
            );
            assert_eq!(memory(h).used, held);
        },
    );
}

#[test]
fn utilization_follows_engine_time() {
    scenario("utilization_follows_engine_time", None, || {
        init();
        let h = handle(0);
        let mut u = nvmlUtilization_t::default();
        assert_eq!(nv!(nvmlDeviceGetUtilizationRates(h, &mut u)), NVML_SUCCESS);
        assert_eq!(u, nvmlUtilization_t { gpu: 0, memory: 0 });
        let mut n: c_uint = 0;
        assert_eq!(
            nv!(nvmlDeviceGetProcessUtilization(
                h,
                std::ptr::null_mut(),
                &mut n,
                0
            )),
            NVML_ERROR_NOT_FOUND,
            "no processes, no samples"
        );

        let p = GpuProcess::start(1 << 20, true);
        std::thread::sleep(Duration::from_millis(1500));
        assert_eq!(nv!(nvmlDeviceGetUtilizationRates(h, &mut u)), NVML_SUCCESS);
        assert!(u.gpu >= 80, "a saturating process shows as busy: {u:?}");

        // Size query, then the samples.
        assert_eq!(
            nv!(nvmlDeviceGetProcessUtilization(
                h,
                std::ptr::null_mut(),
                &mut n,
                0
            )),
            NVML_ERROR_INSUFFICIENT_SIZE
        );
        assert_eq!(n, 1);
        let mut s = vec![nvmlProcessUtilizationSample_t::default(); n as usize];
        assert_eq!(
            nv!(nvmlDeviceGetProcessUtilization(
                h,
                s.as_mut_ptr(),
                &mut n,
                0
            )),
            NVML_SUCCESS
        );
        assert_eq!(s[0].pid, p.pid());
        assert!(s[0].smUtil >= 80, "{:?}", s[0]);
        // Since the last sample: still busy.
        let last = s[0].timeStamp;
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(
            nv!(nvmlDeviceGetProcessUtilization(
                h,
                s.as_mut_ptr(),
                &mut n,
                last
            )),
            NVML_SUCCESS
        );
        assert!(s[0].timeStamp > last && s[0].smUtil >= 70, "{:?}", s[0]);
        drop(p);
        std::thread::sleep(Duration::from_millis(1200));
        assert_eq!(nv!(nvmlDeviceGetUtilizationRates(h, &mut u)), NVML_SUCCESS);
        assert_eq!(u.gpu, 0, "idle again once the process is gone");
    });
}

#[test]
fn accounting_over_a_process_lifetime() {
    scenario("accounting_over_a_process_lifetime", None, || {
        init();
        let h = handle(0);
        let st = State::open_from_env().expect("state");
        let mut mode: nvmlEnableState_t = 9;
        assert_eq!(nv!(nvmlDeviceGetAccountingMode(h, &mut mode)), NVML_SUCCESS);
        assert_eq!(mode, NVML_FEATURE_DISABLED);
        let mut stats = nvmlAccountingStats_t::default();
        assert_eq!(
            nv!(nvmlDeviceGetAccountingStats(h, 1, &mut stats)),
            NVML_ERROR_NOT_SUPPORTED
        );
        assert_eq!(
            nv!(nvmlDeviceSetAccountingMode(h, NVML_FEATURE_ENABLED)),
            NVML_SUCCESS
        );
        assert_eq!(nv!(nvmlDeviceGetAccountingMode(h, &mut mode)), NVML_SUCCESS);
        assert_eq!(mode, NVML_FEATURE_ENABLED);
        let mut size: c_uint = 0;
        assert_eq!(
            nv!(nvmlDeviceGetAccountingBufferSize(h, &mut size)),
            NVML_SUCCESS
        );
        assert!(size > 0);

        let bytes = 2 << 30;
        let before_us = vgpu_cuda_sim::node_state::unix_us();
        let mut p = GpuProcess::start(bytes, true);
        let pid = p.pid();
        std::thread::sleep(Duration::from_millis(800));
        assert_eq!(
            nv!(nvmlDeviceGetAccountingStats(h, pid, &mut stats)),
            NVML_SUCCESS
        );
        assert_eq!(stats.isRunning, 1);
        assert_eq!(stats.time, 0, "NVML reports time 0 while the process runs");
        assert_eq!(stats.maxMemoryUsage, bytes + st.info(0).context_overhead);
        assert!(
            stats.startTime >= before_us,
            "start {} before {before_us}",
            stats.startTime
        );
        assert!(
            stats.gpuUtilization >= 50,
            "busy most of its life: {stats:?}"
        );

        p.kill9();
        let after_us = vgpu_cuda_sim::node_state::unix_us();
        assert_eq!(
            nv!(nvmlDeviceGetAccountingStats(h, pid, &mut stats)),
            NVML_SUCCESS
        );
        assert_eq!(stats.isRunning, 0);
        assert!(
            stats.time >= 800 && stats.time <= (after_us - before_us) / 1000 + 1,
            "{stats:?}"
        );
        assert!(
            stats.gpuUtilization >= 50 && stats.gpuUtilization <= 100,
            "{stats:?}"
        );
        assert_eq!(stats.memoryUtilization, NVML_VALUE_NOT_AVAILABLE_UINT);

        // The pid list (size query, then fill).
        let mut n: c_uint = 0;
        assert_eq!(
            nv!(nvmlDeviceGetAccountingPids(h, &mut n, std::ptr::null_mut())),
            NVML_ERROR_INSUFFICIENT_SIZE
        );
        let mut pids = vec![0 as c_uint; n as usize];
        assert_eq!(
            nv!(nvmlDeviceGetAccountingPids(h, &mut n, pids.as_mut_ptr())),
            NVML_SUCCESS
        );
        assert_eq!(pids, vec![pid]);

        assert_eq!(
            nv!(nvmlDeviceGetAccountingStats(h, 0x7fff_fff0, &mut stats)),
            NVML_ERROR_NOT_FOUND
        );
        assert_eq!(nv!(nvmlDeviceClearAccountingPids(h)), NVML_SUCCESS);
        assert_eq!(
            nv!(nvmlDeviceGetAccountingStats(h, pid, &mut stats)),
            NVML_ERROR_NOT_FOUND
        );
    });
}

#[test]
fn events_xid_ecc_and_lost_device() {
    scenario("events_xid_ecc_and_lost_device", None, || {
        init();
        let h = handle(0);
        let st = State::open_from_env().expect("state");
        st.push_event(0, event_type::XID_CRITICAL, 31); // before registration: not delivered
        let mut supported: c_ulonglong = 0;
        assert_eq!(
            nv!(nvmlDeviceGetSupportedEventTypes(h, &mut supported)),
            NVML_SUCCESS
        );
        assert_eq!(
            supported,
            nvmlEventTypeXidCriticalError
                | nvmlEventTypeSingleBitEccError
                | nvmlEventTypeDoubleBitEccError
        );
        let mut set: nvmlEventSet_t = std::ptr::null_mut();
        assert_eq!(nv!(nvmlEventSetCreate(&mut set)), NVML_SUCCESS);
        assert_eq!(
            nv!(nvmlDeviceRegisterEvents(h, nvmlEventTypePState, set)),
            NVML_ERROR_NOT_SUPPORTED
        );
        let wanted = nvmlEventTypeXidCriticalError | nvmlEventTypeDoubleBitEccError;
        assert_eq!(nv!(nvmlDeviceRegisterEvents(h, wanted, set)), NVML_SUCCESS);
        let mut data: nvmlEventData_t = nv!(std::mem::zeroed());
        let t0 = Instant::now();
        assert_eq!(
            nv!(nvmlEventSetWait_v2(set, &mut data, 100)),
            NVML_ERROR_TIMEOUT
        );
        assert!(t0.elapsed() >= Duration::from_millis(100));

        // An XID raised by another process (the node's state is shared) wakes a waiter.
        let raiser = std::thread::spawn(|| {
            std::thread::sleep(Duration::from_millis(100));
            let st = State::open_from_env().expect("state");
            st.push_event(0, event_type::SINGLE_BIT_ECC, 0); // not registered: skipped
            st.push_event(0, event_type::XID_CRITICAL, 48);
        });
        assert_eq!(nv!(nvmlEventSetWait_v2(set, &mut data, 5000)), NVML_SUCCESS);
        raiser.join().expect("raiser");
        assert_eq!(
            (data.device, data.eventType, data.eventData),
            (h, nvmlEventTypeXidCriticalError, 48)
        );
        assert_eq!(data.gpuInstanceId, NVML_INSTANCE_ID_NONE);

        st.push_event(0, event_type::DOUBLE_BIT_ECC, 0);
        let mut v1: nvmlEventData_v1_t = nv!(std::mem::zeroed());
        assert_eq!(nv!(nvmlEventSetWait(set, &mut v1, 0)), NVML_SUCCESS);
        assert_eq!(
            (v1.eventType, v1.eventData),
            (nvmlEventTypeDoubleBitEccError, 0)
        );
        let mut count: c_ulonglong = 9;
        let uncorrected = NVML_MEMORY_ERROR_TYPE_UNCORRECTED;
        assert_eq!(
            nv!(nvmlDeviceGetTotalEccErrors(
                h,
                uncorrected,
                NVML_VOLATILE_ECC,
                &mut count
            )),
            NVML_SUCCESS
        );
        assert_eq!(count, 1);
        let corrected = NVML_MEMORY_ERROR_TYPE_CORRECTED;
        assert_eq!(
            nv!(nvmlDeviceGetTotalEccErrors(
                h,
                corrected,
                NVML_AGGREGATE_ECC,
                &mut count
            )),
            NVML_SUCCESS
        );
        assert_eq!(count, 1);

        // The device falls off the bus: XID 79, then GPU_IS_LOST everywhere.
        st.set_lost(0, true);
        assert_eq!(nv!(nvmlEventSetWait_v2(set, &mut data, 1000)), NVML_SUCCESS);
        assert_eq!(
            (data.eventType, data.eventData),
            (nvmlEventTypeXidCriticalError, 79)
        );
        assert_eq!(
            nv!(nvmlEventSetWait_v2(set, &mut data, 1000)),
            NVML_ERROR_GPU_IS_LOST
        );
        assert_eq!(name(h), Err(NVML_ERROR_GPU_IS_LOST));
        let mut m = nvmlMemory_t::default();
        assert_eq!(
            nv!(nvmlDeviceGetMemoryInfo(h, &mut m)),
            NVML_ERROR_GPU_IS_LOST
        );
        let mut h2: nvmlDevice_t = std::ptr::null_mut();
        assert_eq!(
            nv!(nvmlDeviceGetHandleByIndex_v2(0, &mut h2)),
            NVML_ERROR_GPU_IS_LOST
        );
        let mut idx: c_uint = 9;
        assert_eq!(nv!(nvmlDeviceGetIndex(h, &mut idx)), NVML_SUCCESS);
        st.set_lost(0, false);
        assert!(name(h).is_ok());

        assert_eq!(nv!(nvmlEventSetFree(set)), NVML_SUCCESS);
        assert_eq!(nv!(nvmlEventSetFree(set)), NVML_ERROR_INVALID_ARGUMENT);
    });
}

/// The cdylib cargo built for this test run: `target/<profile>/deps/libnvidia_ml.so`,
/// next to this test binary (the copy one level up is only refreshed by `cargo build`).
fn cdylib_path() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    exe.parent()
        .map(|d| d.join("libnvidia_ml.so"))
        .expect("test binary has a directory")
}

/// The symbols gpustat 1.1.1, nvitop 1.7.2 and nvidia-ml-py 13 resolved in
/// `tests/python`, as `docs/cuda-sim-nvml.md` lists them.
const CLIENT_SYMBOLS: &[&str] = &[
    "nvmlInitWithFlags",
    "nvmlInit_v2",
    "nvmlShutdown",
    "nvmlErrorString",
    "nvmlSystemGetDriverVersion",
    "nvmlSystemGetCudaDriverVersion",
    "nvmlDeviceGetCount_v2",
    "nvmlDeviceGetHandleByIndex_v2",
    "nvmlDeviceGetName",
    "nvmlDeviceGetUUID",
    "nvmlDeviceGetIndex",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetMemoryInfo_v2",
    "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceGetComputeRunningProcesses_v3",
    "nvmlDeviceGetGraphicsRunningProcesses_v3",
    "nvmlDeviceGetPciInfo_v3",
    "nvmlDeviceGetMigMode",
    "nvmlDeviceIsMigDeviceHandle",
    "nvmlDeviceGetPersistenceMode",
    "nvmlDeviceGetComputeMode",
    "nvmlDeviceGetTotalEccErrors",
    "nvmlDeviceGetProcessUtilization",
    "nvmlDeviceGetAccountingStats",
    "nvmlEventSetWait_v2",
];

#[test]
fn cdylib_exports_client_symbols_and_soname() {
    let path = cdylib_path();
    // SAFETY: loading our own library runs no initialisers beyond Rust's std.
    let lib = unsafe { libloading::Library::new(&path) }
        .unwrap_or_else(|e| panic!("dlopen {}: {e}", path.display()));
    for s in CLIENT_SYMBOLS {
        // SAFETY: only the symbol's presence is checked; it is never called through this type.
        let f = unsafe { lib.get::<unsafe extern "C" fn()>(s.as_bytes()) };
        assert!(f.is_ok(), "{s} is not exported");
    }
    // SAFETY: looked up with its real signature.
    let err_string = unsafe {
        lib.get::<unsafe extern "C" fn(nvmlReturn_t) -> *const c_char>(b"nvmlErrorString")
    }
    .expect("nvmlErrorString");
    // SAFETY: nvmlErrorString returns a static NUL-terminated string.
    let s = unsafe { CStr::from_ptr(err_string(NVML_ERROR_TIMEOUT)) };
    assert_eq!(s.to_str().ok(), Some("Timeout"));
    let elf = std::fs::read(&path).expect("read cdylib");
    assert!(
        elf.windows(17).any(|w| w == b"libnvidia-ml.so.1"),
        "soname libnvidia-ml.so.1 is set"
    );
}
