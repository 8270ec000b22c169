//! The safe logic behind the exported NVML functions: library init ref-counting, device
//! handles, event sets, and every answer derived from the node's shared state.
//!
//! Nothing here touches a raw pointer; [`crate::ffi`] turns C arguments into these calls.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use vgpu_core::gpu_uuid::{format_uuid, parse_uuid};
use vgpu_cuda_abi::nvml::*;
use vgpu_cuda_sim::config::{MAX_DEVICES, normalize_pci_bus_id};
use vgpu_cuda_sim::node_state::{BUCKET_NS, EXITED_RING, SLOT_BUCKETS, State, event_type, unix_us};

/// An NVML result: the value, or the `nvmlReturn_t` error code.
pub type NvmlResult<T> = Result<T, nvmlReturn_t>;

/// The driver version the simulated node reports (`nvmlSystemGetDriverVersion`). It is a
/// real R570 version string, chosen because R570 drivers ship CUDA 12.8, the version the
/// simulated `libcuda` reports; nothing else about that driver is implied.
pub const DRIVER_VERSION: &str = "570.124.06";
/// The NVML version (`nvmlSystemGetNVMLVersion`): CUDA major, then the driver version.
pub const NVML_VERSION: &str = "12.570.124.06";
/// The CUDA driver API version (`nvmlSystemGetCudaDriverVersion`), as `cuDriverGetVersion`
/// of the simulated `libcuda` reports it: 12.8.
pub const CUDA_DRIVER_VERSION: i32 = 12080;

/// Event types the simulator raises (see `vgpu-sim xid`/`ecc`/`lost`).
pub const SUPPORTED_EVENTS: u64 =
    nvmlEventTypeSingleBitEccError | nvmlEventTypeDoubleBitEccError | nvmlEventTypeXidCriticalError;

/// How often a waiting `nvmlEventSetWait` looks at the event rings.
const EVENT_POLL: Duration = Duration::from_millis(5);

// ---- library initialisation ----------------------------------------------------------------

#[derive(Debug)]
struct Lib {
    refs: u32,
    state: Option<Arc<State>>,
    /// The device nodes opened by the first `nvmlInit*`, closed by the last shutdown.
    nodes: Vec<std::os::fd::OwnedFd>,
    /// The node's GPUs this process has (node indices, ascending; NVML index `i` is
    /// `gpus[i]`): those whose device node opened (see `vgpu_cuda_sim::devnodes`).
    gpus: Vec<usize>,
}

static LIB: Mutex<Lib> = Mutex::new(Lib {
    refs: 0,
    state: None,
    nodes: Vec::new(),
    gpus: Vec::new(),
});

fn lib() -> MutexGuard<'static, Lib> {
    // A panic while holding the lock leaves `Lib` consistent (two plain fields).
    LIB.lock().unwrap_or_else(|p| p.into_inner())
}

/// `nvmlInit*`: the first call maps the node's state; later calls only count.
pub fn init() -> NvmlResult<()> {
    let mut l = lib();
    if l.refs == 0 {
        let st = State::open_from_env().map_err(|e| {
            // Without this line a broken VGPU_SIM_CONFIG would only show as "driver not
            // loaded"; NVML itself is silent, but the simulator's user needs the reason.
            eprintln!("libnvidia-ml (vgpu cuda-sim): cannot open the simulated node: {e}");
            NVML_ERROR_DRIVER_NOT_LOADED
        })?;
        // NVIDIA's NVML opens the device nodes at init: a GPU whose node the device
        // cgroup refuses is not there, a refused `nvidiactl` is "Unknown Error" (see
        // `vgpu_cuda_sim::devnodes`).
        let opened = vgpu_cuda_sim::devnodes::open_all(
            st.dir(),
            st.device_count(),
            vgpu_cuda_sim::devnodes::Client::Nvml,
        )
        .map_err(|_| NVML_ERROR_UNKNOWN)?;
        l.nodes = opened.fds;
        l.gpus = opened.gpus;
        l.state = Some(Arc::new(st));
    }
    l.refs = l.refs.saturating_add(1);
    Ok(())
}

/// `nvmlShutdown`: undoes one `nvmlInit*`; the last one unmaps the state.
pub fn shutdown() -> NvmlResult<()> {
    let mut l = lib();
    if l.refs == 0 {
        return Err(NVML_ERROR_UNINITIALIZED);
    }
    l.refs -= 1;
    if l.refs == 0 {
        l.state = None;
        l.nodes.clear();
        l.gpus.clear();
    }
    Ok(())
}

/// The node's state, if the library is initialised.
pub fn state() -> NvmlResult<Arc<State>> {
    lib().state.clone().ok_or(NVML_ERROR_UNINITIALIZED)
}

/// The node's state and the GPUs this process has (node indices by NVML index), if the
/// library is initialised.
pub fn state_and_gpus() -> NvmlResult<(Arc<State>, Vec<usize>)> {
    let l = lib();
    let st = l.state.clone().ok_or(NVML_ERROR_UNINITIALIZED)?;
    Ok((st, l.gpus.clone()))
}

// ---- device handles --------------------------------------------------------------------

/// What an `nvmlDevice_t` points at: one element of a static array, so handles are
/// stable for the life of the process and can be validated by address.
#[derive(Debug, Clone, Copy)]
pub struct DeviceSlot {
    index: usize,
}

static DEVICES: [DeviceSlot; MAX_DEVICES] = {
    let mut a = [DeviceSlot { index: 0 }; MAX_DEVICES];
    let mut i = 0;
    while i < MAX_DEVICES {
        a[i].index = i;
        i += 1;
    }
    a
};

/// The handle of device `i` (`i < MAX_DEVICES`).
pub fn handle_of(i: usize) -> nvmlDevice_t {
    std::ptr::from_ref(&DEVICES[i]).cast_mut().cast()
}

/// Which device a handle names, if it is one of ours.
pub fn index_of(h: nvmlDevice_t) -> Option<usize> {
    DEVICES
        .iter()
        .find(|d| std::ptr::from_ref(*d).addr() == h.addr())
        .map(|d| d.index)
}

/// A validated device of an initialised library.
#[derive(Debug)]
pub struct Dev {
    /// The node's state.
    pub st: Arc<State>,
    /// Device index.
    pub d: usize,
}

/// Validates a handle (initialised library, one of our handles, a device this process
/// has).
pub fn device(h: nvmlDevice_t) -> NvmlResult<Dev> {
    let (st, gpus) = state_and_gpus()?;
    let d = index_of(h)
        .filter(|d| gpus.contains(d))
        .ok_or(NVML_ERROR_INVALID_ARGUMENT)?;
    Ok(Dev { st, d })
}

/// The NVML index of the node's device `d` in this process (`nvmlDeviceGetIndex`).
pub fn nvml_index(d: usize) -> NvmlResult<u32> {
    let (_, gpus) = state_and_gpus()?;
    gpus.iter()
        .position(|&g| g == d)
        .and_then(|i| u32::try_from(i).ok())
        .ok_or(NVML_ERROR_INVALID_ARGUMENT)
}

/// Like [`device`], and the device must not have fallen off the bus.
pub fn live_device(h: nvmlDevice_t) -> NvmlResult<Dev> {
    let dv = device(h)?;
    if dv.st.is_lost(dv.d) {
        return Err(NVML_ERROR_GPU_IS_LOST);
    }
    Ok(dv)
}

/// Number of devices this process has.
pub fn device_count() -> NvmlResult<u32> {
    let (_, gpus) = state_and_gpus()?;
    Ok(u32::try_from(gpus.len()).expect("at most MAX_DEVICES devices"))
}

fn handle_checked(st: &State, d: usize) -> NvmlResult<nvmlDevice_t> {
    if st.is_lost(d) {
        return Err(NVML_ERROR_GPU_IS_LOST);
    }
    Ok(handle_of(d))
}

/// `nvmlDeviceGetHandleByIndex`.
pub fn handle_by_index(i: u32) -> NvmlResult<nvmlDevice_t> {
    let (st, gpus) = state_and_gpus()?;
    let d = *gpus.get(i as usize).ok_or(NVML_ERROR_INVALID_ARGUMENT)?;
    handle_checked(&st, d)
}

/// `nvmlDeviceGetHandleByUUID`.
pub fn handle_by_uuid(uuid: &str) -> NvmlResult<nvmlDevice_t> {
    let (st, gpus) = state_and_gpus()?;
    // Only `GPU-` UUIDs name whole GPUs (`MIG-` ones name MIG devices, which we lack).
    let wanted = uuid
        .trim()
        .starts_with("GPU-")
        .then(|| parse_uuid(uuid))
        .flatten();
    let wanted = wanted.ok_or(NVML_ERROR_NOT_FOUND)?;
    let d = gpus
        .into_iter()
        .find(|&d| st.info(d).uuid == wanted)
        .ok_or(NVML_ERROR_NOT_FOUND)?;
    handle_checked(&st, d)
}

/// The board serial number of device `d`: 13 digits, derived from its UUID (the
/// simulated boards have no other identity to derive one from).
pub fn serial_of(st: &State, d: usize) -> String {
    let u = st.info(d).uuid;
    let n = u.iter().fold(0u64, |acc, &b| {
        acc.wrapping_mul(31).wrapping_add(u64::from(b))
    });
    format!("{:013}", 1_650_000_000_000 + n % 100_000_000_000)
}

/// `nvmlDeviceGetHandleBySerial`.
pub fn handle_by_serial(serial: &str) -> NvmlResult<nvmlDevice_t> {
    let (st, gpus) = state_and_gpus()?;
    let d = gpus
        .into_iter()
        .find(|&d| serial_of(&st, d) == serial.trim())
        .ok_or(NVML_ERROR_NOT_FOUND)?;
    handle_checked(&st, d)
}

/// `nvmlDeviceGetHandleByPciBusId`.
pub fn handle_by_pci_bus_id(id: &str) -> NvmlResult<nvmlDevice_t> {
    let (st, gpus) = state_and_gpus()?;
    let wanted = normalize_pci_bus_id(id).ok_or(NVML_ERROR_NOT_FOUND)?;
    let d = gpus
        .into_iter()
        .find(|&d| st.info(d).pci_bus_id().eq_ignore_ascii_case(&wanted))
        .ok_or(NVML_ERROR_NOT_FOUND)?;
    handle_checked(&st, d)
}

/// The parts of a PCI bus id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pci {
    /// PCI domain.
    pub domain: u32,
    /// Bus.
    pub bus: u32,
    /// Device on the bus.
    pub device: u32,
    /// `%08X:%02X:%02X.0`.
    pub bus_id: String,
    /// `%04X:%02X:%02X.0`.
    pub bus_id_legacy: String,
}

/// A live process on a device, as the running-process queries list it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Proc {
    /// Process id.
    pub pid: u32,
    /// Device memory it holds, contexts included, bytes.
    pub used: u64,
}

/// Accounting statistics of one process, in NVML's units.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Accounting {
    /// Device time its work ran over its lifetime, in percent.
    pub gpu_util_pct: u32,
    /// Peak device memory, bytes.
    pub max_memory: u64,
    /// Lifetime in ms once it has exited; 0 while running (as NVML reports it).
    pub time_ms: u64,
    /// Start, µs since the Unix epoch.
    pub start_us: u64,
    /// Still running.
    pub running: bool,
}

/// A delivered event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Event {
    /// Device index.
    pub d: usize,
    /// Event type bit.
    pub kind: u64,
    /// XID for XID events, 0 otherwise.
    pub data: u64,
}

/// Architecture from the compute capability (the CUDA programming guide's table).
pub fn architecture(major: u32, minor: u32) -> nvmlDeviceArchitecture_t {
    match (major, minor) {
        (3, _) => NVML_DEVICE_ARCH_KEPLER,
        (5, _) => NVML_DEVICE_ARCH_MAXWELL,
        (6, _) => NVML_DEVICE_ARCH_PASCAL,
        (7, 0 | 2) => NVML_DEVICE_ARCH_VOLTA,
        (7, 5) => NVML_DEVICE_ARCH_TURING,
        (8, 9) => NVML_DEVICE_ARCH_ADA,
        (8, _) => NVML_DEVICE_ARCH_AMPERE,
        (9, _) => NVML_DEVICE_ARCH_HOPPER,
        (10 | 12, _) => NVML_DEVICE_ARCH_BLACKWELL,
        _ => NVML_DEVICE_ARCH_UNKNOWN,
    }
}

/// FP32 cores per SM by compute capability (the CUDA programming guide's arithmetic
/// throughput table), or `None` where the table has no entry.
pub fn cores_per_sm(major: u32, minor: u32) -> Option<u32> {
    match (major, minor) {
        (3, _) => Some(192),
        (5, _) => Some(128),
        (6, 0) => Some(64),
        (6, _) => Some(128),
        (7, _) => Some(64),
        (8, 0) => Some(64),
        (8, _) => Some(128),
        (9, 0) => Some(128),
        (10 | 12, _) => Some(128),
        _ => None,
    }
}

impl Dev {
    /// Marketing name.
    pub fn name(&self) -> String {
        self.st.info(self.d).name().to_owned()
    }

    /// The board serial number.
    pub fn serial(&self) -> String {
        serial_of(&self.st, self.d)
    }

    /// `GPU-xxxxxxxx-...`.
    pub fn uuid(&self) -> String {
        format_uuid(&self.st.info(self.d).uuid)
    }

    /// PCI location, parsed from the configured bus id.
    pub fn pci(&self) -> NvmlResult<Pci> {
        let id = self.st.info(self.d).pci_bus_id();
        let parse = || -> Option<Pci> {
            let (domain, rest) = id.split_once(':')?;
            let (bus, rest) = rest.split_once(':')?;
            let (dev, _func) = rest.split_once('.')?;
            let domain = u32::from_str_radix(domain, 16).ok()?;
            let bus = u32::from_str_radix(bus, 16).ok()?;
            let device = u32::from_str_radix(dev, 16).ok()?;
            Some(Pci {
                domain,
                bus,
                device,
                bus_id: format!("{domain:08X}:{bus:02X}:{device:02X}.0"),
                bus_id_legacy: format!("{:04X}:{bus:02X}:{device:02X}.0", domain & 0xffff),
            })
        };
        parse().ok_or(NVML_ERROR_UNKNOWN)
    }

    /// Compute capability.
    pub fn cc(&self) -> (u32, u32) {
        let i = self.st.info(self.d);
        (i.cc_major, i.cc_minor)
    }

    /// (total, free, used) bytes, after reclaiming dead processes.
    pub fn memory(&self) -> (u64, u64, u64) {
        self.st.reap(None);
        let (free, total) = self.st.mem_info(self.d);
        (total, free, total - free)
    }

    /// Live processes with a context or memory on the device, one entry per process as
    /// the real NVML lists them: a process with two slots (a second copy of the driver
    /// loaded with `dlmopen`) is one entry holding what both hold.
    pub fn processes(&self) -> Vec<Proc> {
        self.st.reap(None);
        let mut out: Vec<Proc> = Vec::new();
        for p in self.st.processes(self.d) {
            match out.iter_mut().find(|q| q.pid == p.pid) {
                Some(q) => q.used = q.used.saturating_add(p.used),
                None => out.push(Proc {
                    pid: p.pid,
                    used: p.used,
                }),
            }
        }
        out
    }

    /// Device utilization over the last second, in percent.
    pub fn gpu_utilization(&self) -> u32 {
        self.st.utilization_pct(self.d, Duration::from_secs(1))
    }

    /// Per-process SM utilization samples since `last_seen_us` (µs since the Unix epoch;
    /// 0 = all the history the state keeps, 1.5 s). Each live process on the device gets
    /// one sample stamped now, with its share of the device's time over that window (or
    /// over its life, if it is younger).
    pub fn process_samples(&self, last_seen_us: u64) -> Vec<nvmlProcessUtilizationSample_t> {
        let now = unix_us();
        if last_seen_us >= now {
            return Vec::new();
        }
        let history_ns = (SLOT_BUCKETS as u64 - 1) * BUCKET_NS;
        let window_ns = if last_seen_us == 0 {
            history_ns
        } else {
            (now - last_seen_us).saturating_mul(1000).min(history_ns)
        };
        self.st.reap(None);
        self.st
            .processes(self.d)
            .into_iter()
            .map(|p| {
                // A process younger than the window is measured over its own life.
                let start_us = self.st.slot(p.slot).start_unix_us.load(Ordering::Relaxed);
                let life_ns = now.saturating_sub(start_us).saturating_mul(1000);
                let window = Duration::from_nanos(window_ns.min(life_ns));
                nvmlProcessUtilizationSample_t {
                    pid: p.pid,
                    timeStamp: now,
                    smUtil: self.st.slot_utilization_pct(p.slot, self.d, window),
                    // Memory-controller, encoder and decoder activity are not modelled.
                    memUtil: 0,
                    encUtil: 0,
                    decUtil: 0,
                }
            })
            .collect()
    }

    /// Whether accounting mode is on.
    pub fn accounting_enabled(&self) -> bool {
        self.st.dev(self.d).accounting_mode.load(Ordering::Acquire) != 0
    }

    /// Turns accounting mode on or off; turning it off forgets exited processes, as
    /// NVML documents.
    pub fn set_accounting(&self, on: bool) {
        self.st
            .dev(self.d)
            .accounting_mode
            .store(u32::from(on), Ordering::Release);
        if !on {
            self.st.clear_exited_accounting_on(self.d);
        }
    }

    fn require_accounting(&self) -> NvmlResult<()> {
        if self.accounting_enabled() {
            Ok(())
        } else {
            Err(NVML_ERROR_NOT_SUPPORTED)
        }
    }

    /// Accounting statistics of `pid` on the device.
    pub fn accounting_stats(&self, pid: u32) -> NvmlResult<Accounting> {
        self.require_accounting()?;
        self.st.reap(None);
        let r = self
            .st
            .accounting(self.d)
            .into_iter()
            .find(|r| r.pid == pid)
            .ok_or(NVML_ERROR_NOT_FOUND)?;
        let lifetime_ns = u128::from(r.lifetime_us) * 1000;
        let gpu_util_pct = (u128::from(r.busy_ns) * 100 + lifetime_ns / 2)
            .checked_div(lifetime_ns)
            .map_or(0, |p| p.min(100) as u32);
        Ok(Accounting {
            gpu_util_pct,
            max_memory: r.max_used,
            time_ms: if r.running { 0 } else { r.lifetime_us / 1000 },
            start_us: r.start_unix_us,
            running: r.running,
        })
    }

    /// Pids with accounting records on the device (live first, then exited, newest first).
    pub fn accounting_pids(&self) -> NvmlResult<Vec<u32>> {
        self.require_accounting()?;
        self.st.reap(None);
        Ok(self
            .st
            .accounting(self.d)
            .into_iter()
            .map(|r| r.pid)
            .collect())
    }

    /// How many exited processes the accounting buffer holds.
    pub fn accounting_buffer_size(&self) -> NvmlResult<u32> {
        self.require_accounting()?;
        Ok(EXITED_RING as u32)
    }

    /// ECC errors of a kind seen on the device (those still in its event ring).
    pub fn ecc_errors(&self, error_type: nvmlMemoryErrorType_t) -> NvmlResult<u64> {
        let kind = match error_type {
            NVML_MEMORY_ERROR_TYPE_CORRECTED => event_type::SINGLE_BIT_ECC,
            NVML_MEMORY_ERROR_TYPE_UNCORRECTED => event_type::DOUBLE_BIT_ECC,
            _ => return Err(NVML_ERROR_INVALID_ARGUMENT),
        };
        Ok(self
            .st
            .events_after(self.d, 0)
            .iter()
            .filter(|e| e.kind == kind)
            .count() as u64)
    }

    /// Brand, from the marketing name.
    pub fn brand(&self) -> nvmlBrandType_t {
        let n = self.name();
        if n.contains("GeForce") {
            NVML_BRAND_GEFORCE
        } else if n.contains("Tesla") {
            NVML_BRAND_TESLA
        } else {
            NVML_BRAND_NVIDIA
        }
    }

    /// FP32 cores: SMs × cores per SM of the architecture.
    pub fn num_cores(&self) -> NvmlResult<u32> {
        let (ma, mi) = self.cc();
        let per_sm = cores_per_sm(ma, mi).ok_or(NVML_ERROR_NOT_SUPPORTED)?;
        Ok(self.st.info(self.d).sm_count.saturating_mul(per_sm))
    }
}

// ---- running-process lists -------------------------------------------------------------------

/// What a `nvmlDevice*RunningProcesses*` call does with the caller's array of `capacity`
/// entries, given `n` processes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ListOutcome {
    /// Write all `n` entries and set the count to `n`.
    Fill(usize),
    /// Set the count to `n` and return `NVML_ERROR_INSUFFICIENT_SIZE`.
    TooSmall(usize),
}

/// NVML's list protocol: a count smaller than the list gets `INSUFFICIENT_SIZE` and the
/// needed count (so `*count = 0` queries the size); an empty list succeeds with 0.
pub fn list_outcome(capacity: u32, n: usize) -> ListOutcome {
    if (capacity as usize) < n {
        ListOutcome::TooSmall(n)
    } else {
        ListOutcome::Fill(n)
    }
}

// ---- events ------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy)]
struct Registration {
    d: usize,
    mask: u64,
    /// Events up to this sequence number are delivered (or predate the registration).
    seen: u64,
}

/// An event set: devices registered with the event types wanted from each.
#[derive(Debug, Default)]
pub struct EventSet {
    regs: Mutex<Vec<Registration>>,
}

impl EventSet {
    fn regs(&self) -> MutexGuard<'_, Vec<Registration>> {
        self.regs.lock().unwrap_or_else(|p| p.into_inner())
    }
}

static SETS: Mutex<Vec<Arc<EventSet>>> = Mutex::new(Vec::new());

fn sets() -> MutexGuard<'static, Vec<Arc<EventSet>>> {
    SETS.lock().unwrap_or_else(|p| p.into_inner())
}

/// `nvmlEventSetCreate`: a new set, named by its address.
pub fn event_set_create() -> NvmlResult<nvmlEventSet_t> {
    state()?;
    let set = Arc::new(EventSet::default());
    let h: nvmlEventSet_t = Arc::as_ptr(&set).cast_mut().cast();
    sets().push(set);
    Ok(h)
}

fn event_set(h: nvmlEventSet_t) -> NvmlResult<Arc<EventSet>> {
    sets()
        .iter()
        .find(|s| Arc::as_ptr(s).addr() == h.addr())
        .cloned()
        .ok_or(NVML_ERROR_INVALID_ARGUMENT)
}

/// `nvmlEventSetFree`.
pub fn event_set_free(h: nvmlEventSet_t) -> NvmlResult<()> {
    state()?;
    let mut s = sets();
    let i = s
        .iter()
        .position(|s| Arc::as_ptr(s).addr() == h.addr())
        .ok_or(NVML_ERROR_INVALID_ARGUMENT)?;
    s.swap_remove(i);
    Ok(())
}

/// `nvmlDeviceRegisterEvents`: events of `types` raised on the device from now on are
/// delivered through the set.
pub fn register_events(dev: &Dev, types: u64, h: nvmlEventSet_t) -> NvmlResult<()> {
    let set = event_set(h)?;
    if types & !SUPPORTED_EVENTS != 0 {
        return Err(NVML_ERROR_NOT_SUPPORTED);
    }
    let mut regs = set.regs();
    match regs.iter_mut().find(|r| r.d == dev.d) {
        Some(r) => r.mask |= types,
        None => regs.push(Registration {
            d: dev.d,
            mask: types,
            seen: dev.st.last_event_seq(dev.d),
        }),
    }
    Ok(())
}

/// `nvmlEventSetWait`: the next event of a registered type, waiting at most `timeout`.
/// A registered device that is lost (after its XID 79 has been delivered) makes the
/// wait fail with `NVML_ERROR_GPU_IS_LOST`.
pub fn event_wait(h: nvmlEventSet_t, timeout: Duration) -> NvmlResult<Event> {
    let st = state()?;
    let set = event_set(h)?;
    let deadline = Instant::now() + timeout;
    loop {
        {
            let mut regs = set.regs();
            for r in regs.iter_mut() {
                for e in st.events_after(r.d, r.seen) {
                    r.seen = e.seq;
                    if e.kind & r.mask != 0 {
                        let data = if e.kind == event_type::XID_CRITICAL {
                            e.data
                        } else {
                            0
                        };
                        return Ok(Event {
                            d: r.d,
                            kind: e.kind,
                            data,
                        });
                    }
                }
            }
            if regs.iter().any(|r| st.is_lost(r.d)) {
                return Err(NVML_ERROR_GPU_IS_LOST);
            }
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(NVML_ERROR_TIMEOUT);
        }
        std::thread::sleep(EVENT_POLL.min(deadline - now));
    }
}

// ---- system ------------------------------------------------------------------------------

/// `nvmlSystemGetProcessName`: the process's command (argv\[0\], else its comm name).
pub fn process_name(pid: u32) -> NvmlResult<String> {
    state()?;
    let cmdline =
        std::fs::read(format!("/proc/{pid}/cmdline")).map_err(|_| NVML_ERROR_NOT_FOUND)?;
    let argv0 = cmdline.split(|&b| b == 0).next().unwrap_or_default();
    if !argv0.is_empty() {
        return Ok(String::from_utf8_lossy(argv0).into_owned());
    }
    let comm =
        std::fs::read_to_string(format!("/proc/{pid}/comm")).map_err(|_| NVML_ERROR_NOT_FOUND)?;
    Ok(comm.trim_end().to_owned())
}

/// `nvmlErrorString`: NVML's description of a return code.
pub fn error_string(r: nvmlReturn_t) -> &'static std::ffi::CStr {
    match r {
        NVML_SUCCESS => c"Success",
        NVML_ERROR_UNINITIALIZED => c"Uninitialized",
        NVML_ERROR_INVALID_ARGUMENT => c"Invalid Argument",
        NVML_ERROR_NOT_SUPPORTED => c"Not Supported",
        NVML_ERROR_NO_PERMISSION => c"Insufficient Permissions",
        NVML_ERROR_ALREADY_INITIALIZED => c"Already Initialized",
        NVML_ERROR_NOT_FOUND => c"Not Found",
        NVML_ERROR_INSUFFICIENT_SIZE => c"Insufficient Size",
        NVML_ERROR_INSUFFICIENT_POWER => c"Insufficient External Power",
        NVML_ERROR_DRIVER_NOT_LOADED => c"Driver Not Loaded",
        NVML_ERROR_TIMEOUT => c"Timeout",
        NVML_ERROR_IRQ_ISSUE => c"Interrupt request issue",
        NVML_ERROR_LIBRARY_NOT_FOUND => c"NVML Shared Library Not Found",
        NVML_ERROR_FUNCTION_NOT_FOUND => c"Function Not Found",
        NVML_ERROR_CORRUPTED_INFOROM => c"Corrupted infoROM",
        NVML_ERROR_GPU_IS_LOST => c"GPU is lost",
        NVML_ERROR_RESET_REQUIRED => c"GPU requires restart",
        NVML_ERROR_OPERATING_SYSTEM => c"The operating system has blocked the request.",
        NVML_ERROR_LIB_RM_VERSION_MISMATCH => c"RM has detected an NVML/RM version mismatch.",
        NVML_ERROR_IN_USE => c"In use by another client",
        NVML_ERROR_MEMORY => c"Insufficient Memory",
        NVML_ERROR_NO_DATA => c"No data",
        NVML_ERROR_INSUFFICIENT_RESOURCES => c"Insufficient resources",
        NVML_ERROR_ARGUMENT_VERSION_MISMATCH => c"Version mismatch",
        NVML_ERROR_DEPRECATED => c"Deprecated",
        NVML_ERROR_NOT_READY => c"Not ready",
        NVML_ERROR_GPU_NOT_FOUND => c"GPU not found",
        _ => c"Unknown Error",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_round_trip_and_foreign_pointers_are_rejected() {
        for i in 0..MAX_DEVICES {
            assert_eq!(index_of(handle_of(i)), Some(i));
        }
        assert_eq!(index_of(std::ptr::null_mut()), None);
        let mut x = 0u64;
        assert_eq!(index_of(std::ptr::from_mut(&mut x).cast()), None);
    }

    #[test]
    fn list_protocol() {
        assert_eq!(list_outcome(0, 0), ListOutcome::Fill(0));
        assert_eq!(list_outcome(0, 2), ListOutcome::TooSmall(2));
        assert_eq!(list_outcome(1, 2), ListOutcome::TooSmall(2));
        assert_eq!(list_outcome(9, 2), ListOutcome::Fill(2));
    }

    #[test]
    fn architectures_and_cores() {
        assert_eq!(architecture(9, 0), NVML_DEVICE_ARCH_HOPPER);
        assert_eq!(architecture(8, 0), NVML_DEVICE_ARCH_AMPERE);
        assert_eq!(architecture(8, 9), NVML_DEVICE_ARCH_ADA);
        assert_eq!(architecture(7, 5), NVML_DEVICE_ARCH_TURING);
        assert_eq!(architecture(4, 0), NVML_DEVICE_ARCH_UNKNOWN);
        // H100 SXM5: 132 SMs × 128 = 16896 CUDA cores, as NVIDIA's datasheet says.
        assert_eq!(cores_per_sm(9, 0).map(|c| c * 132), Some(16896));
        // A100: 108 SMs × 64 = 6912.
        assert_eq!(cores_per_sm(8, 0).map(|c| c * 108), Some(6912));
    }

    #[test]
    fn error_strings() {
        assert_eq!(
            error_string(NVML_ERROR_GPU_IS_LOST).to_str().ok(),
            Some("GPU is lost")
        );
        assert_eq!(error_string(12345).to_str().ok(), Some("Unknown Error"));
    }
}
