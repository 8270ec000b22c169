//! The exported NVML entry points.
//!
//! Each one: enters `guard` (no panic crosses into C), checks and converts its pointer
//! arguments, calls [`crate::sim`], and maps the outcome to an `nvmlReturn_t`. The
//! pointer contracts are NVML's (`nvml.h`): output pointers are null or valid for a
//! write of their type, string buffers are valid for `length` bytes, arrays for the
//! count the caller passes.

// Parameter names are nvml.h's (`deviceCount`, `infoCount`), so the exports read like
// the header they implement.
#![allow(non_snake_case)]

use std::ffi::{CStr, c_char, c_int, c_uint, c_ulonglong};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::Duration;

use vgpu_cuda_abi::nvml::*;

use crate::sim::{self, ListOutcome, NvmlResult, Proc};

/// Runs `f`, turning its result into an `nvmlReturn_t` and a panic into
/// `NVML_ERROR_UNKNOWN`.
pub(crate) fn guard(f: impl FnOnce() -> NvmlResult<()>) -> nvmlReturn_t {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => NVML_SUCCESS,
        Ok(Err(e)) => e,
        Err(_) => NVML_ERROR_UNKNOWN,
    }
}

/// Writes `v` through an output pointer.
///
/// # Safety
/// `p` is null or valid for writing a `T` (the caller's NVML contract).
pub(crate) unsafe fn put<T>(p: *mut T, v: T) -> NvmlResult<()> {
    if p.is_null() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    // SAFETY: non-null, and valid for a write of `T` by this function's contract.
    unsafe { p.write_unaligned(v) };
    Ok(())
}

/// Reads an in/out argument.
///
/// # Safety
/// `p` is null or valid for reading a `T`.
pub(crate) unsafe fn get<T: Copy>(p: *const T) -> NvmlResult<T> {
    if p.is_null() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    // SAFETY: non-null, and valid for a read of `T` by this function's contract.
    Ok(unsafe { p.read_unaligned() })
}

/// Copies `s` and a NUL into a caller's buffer of `len` bytes; a buffer too small for
/// both is `NVML_ERROR_INSUFFICIENT_SIZE`, as NVML reports it.
///
/// # Safety
/// `buf` is null or valid for writing `len` bytes.
unsafe fn put_str(buf: *mut c_char, len: c_uint, s: &str) -> NvmlResult<()> {
    if buf.is_null() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    if (len as usize) < s.len() + 1 {
        return Err(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    // SAFETY: `buf` is valid for `len >= s.len() + 1` bytes; `s` cannot overlap a
    // buffer the caller owns.
    unsafe {
        std::ptr::copy_nonoverlapping(s.as_ptr().cast::<c_char>(), buf, s.len());
        buf.add(s.len()).write(0);
    }
    Ok(())
}

/// Writes `items` into a caller's array.
///
/// # Safety
/// `p` is null or valid for writing `items.len()` elements of `T`.
pub(crate) unsafe fn put_slice<T: Copy>(p: *mut T, items: &[T]) -> NvmlResult<()> {
    if items.is_empty() {
        return Ok(());
    }
    if p.is_null() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    for (i, v) in items.iter().enumerate() {
        // SAFETY: `i < items.len()`, for which `p` is valid by the contract.
        unsafe { p.add(i).write_unaligned(*v) };
    }
    Ok(())
}

/// Reads a C string argument.
///
/// # Safety
/// `s` is null or points to a NUL-terminated string.
unsafe fn get_str(s: *const c_char) -> NvmlResult<String> {
    if s.is_null() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    // SAFETY: non-null and NUL-terminated by the contract.
    let c = unsafe { CStr::from_ptr(s) };
    Ok(c.to_string_lossy().into_owned())
}

/// NVML's list protocol for the running-process queries.
///
/// # Safety
/// `count` is null or valid for reading and writing a `c_uint`; `infos` is null or valid
/// for writing `*count` elements.
unsafe fn process_list<T: Copy>(
    device: nvmlDevice_t,
    count: *mut c_uint,
    infos: *mut T,
    listed: impl FnOnce(&sim::Dev) -> Vec<Proc>,
    make: impl Fn(Proc) -> T,
) -> nvmlReturn_t {
    guard(|| {
        let dev = sim::live_device(device)?;
        // SAFETY: `count` is null (rejected) or valid, by this function's contract.
        let cap = unsafe { get(count) }?;
        let procs = listed(&dev);
        match sim::list_outcome(cap, procs.len()) {
            ListOutcome::TooSmall(n) => {
                // SAFETY: as above.
                unsafe { put(count, n as c_uint) }?;
                Err(NVML_ERROR_INSUFFICIENT_SIZE)
            }
            ListOutcome::Fill(n) => {
                let items: Vec<T> = procs.into_iter().map(make).collect();
                // SAFETY: `infos` holds `cap >= n` elements by the contract.
                unsafe { put_slice(infos, &items) }?;
                // SAFETY: as above.
                unsafe { put(count, n as c_uint) }
            }
        }
    })
}

fn compute_procs(dev: &sim::Dev) -> Vec<Proc> {
    dev.processes()
}

fn no_procs(_: &sim::Dev) -> Vec<Proc> {
    // The simulator runs compute work only: no graphics or MPS clients exist.
    Vec::new()
}

fn info_v1(p: Proc) -> nvmlProcessInfo_v1_t {
    nvmlProcessInfo_v1_t {
        pid: p.pid,
        usedGpuMemory: p.used,
    }
}

fn info_v2(p: Proc) -> nvmlProcessInfo_t {
    nvmlProcessInfo_t {
        pid: p.pid,
        usedGpuMemory: p.used,
        gpuInstanceId: NVML_INSTANCE_ID_NONE,
        computeInstanceId: NVML_INSTANCE_ID_NONE,
    }
}

// ---- init and system -----------------------------------------------------------------------

/// `nvmlInit` (v1): same as [`nvmlInit_v2`].
///
/// # Safety
/// None beyond NVML's: callable from any thread.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlInit() -> nvmlReturn_t {
    guard(sim::init)
}

/// `nvmlInit_v2`: maps the simulated node's state (ref-counted).
///
/// # Safety
/// None beyond NVML's.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlInit_v2() -> nvmlReturn_t {
    guard(sim::init)
}

/// `nvmlInitWithFlags`: flags are accepted; the simulated node always has devices.
///
/// # Safety
/// None beyond NVML's.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlInitWithFlags(_flags: c_uint) -> nvmlReturn_t {
    guard(sim::init)
}

/// `nvmlShutdown`.
///
/// # Safety
/// None beyond NVML's.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlShutdown() -> nvmlReturn_t {
    guard(sim::shutdown)
}

/// `nvmlErrorString`: a static string; works without init.
///
/// # Safety
/// None.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlErrorString(result: nvmlReturn_t) -> *const c_char {
    sim::error_string(result).as_ptr()
}

/// `nvmlSystemGetDriverVersion`.
///
/// # Safety
/// `version` is valid for `length` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetDriverVersion(
    version: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    guard(|| {
        sim::state()?;
        // SAFETY: `version` is valid for `length` bytes by NVML's contract.
        unsafe { put_str(version, length, sim::DRIVER_VERSION) }
    })
}

/// `nvmlSystemGetNVMLVersion`.
///
/// # Safety
/// `version` is valid for `length` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetNVMLVersion(
    version: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    guard(|| {
        // NVML answers this one without init.
        // SAFETY: `version` is valid for `length` bytes by NVML's contract.
        unsafe { put_str(version, length, sim::NVML_VERSION) }
    })
}

/// `nvmlSystemGetCudaDriverVersion`.
///
/// # Safety
/// `cudaDriverVersion` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion(
    cudaDriverVersion: *mut c_int,
) -> nvmlReturn_t {
    // SAFETY: forwarding the same contract.
    unsafe { nvmlSystemGetCudaDriverVersion_v2(cudaDriverVersion) }
}

/// `nvmlSystemGetCudaDriverVersion_v2`.
///
/// # Safety
/// `cudaDriverVersion` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion_v2(
    cudaDriverVersion: *mut c_int,
) -> nvmlReturn_t {
    guard(|| {
        // SAFETY: null (rejected) or valid for a write, by the contract.
        unsafe { put(cudaDriverVersion, sim::CUDA_DRIVER_VERSION) }
    })
}

/// `nvmlSystemGetProcessName`.
///
/// # Safety
/// `name` is valid for `length` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetProcessName(
    pid: c_uint,
    name: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    guard(|| {
        let n = sim::process_name(pid)?;
        // NVML truncates the name to the buffer rather than failing.
        let max = (length as usize).saturating_sub(1);
        let mut end = n.len().min(max);
        while !n.is_char_boundary(end) {
            end -= 1;
        }
        // SAFETY: `name` is valid for `length` bytes; we write at most `length`.
        unsafe { put_str(name, length, &n[..end]) }
    })
}

// ---- device enumeration ---------------------------------------------------------------------

/// `nvmlDeviceGetCount` (v1).
///
/// # Safety
/// `deviceCount` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCount(deviceCount: *mut c_uint) -> nvmlReturn_t {
    // SAFETY: same contract.
    unsafe { nvmlDeviceGetCount_v2(deviceCount) }
}

/// `nvmlDeviceGetCount_v2`.
///
/// # Safety
/// `deviceCount` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCount_v2(deviceCount: *mut c_uint) -> nvmlReturn_t {
    guard(|| {
        let n = sim::device_count()?;
        // SAFETY: null (rejected) or valid for a write.
        unsafe { put(deviceCount, n) }
    })
}

/// `nvmlDeviceGetHandleByIndex` (v1).
///
/// # Safety
/// `device` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex(
    index: c_uint,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    // SAFETY: same contract.
    unsafe { nvmlDeviceGetHandleByIndex_v2(index, device) }
}

/// `nvmlDeviceGetHandleByIndex_v2`.
///
/// # Safety
/// `device` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex_v2(
    index: c_uint,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    guard(|| {
        if device.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let h = sim::handle_by_index(index)?;
        // SAFETY: non-null and valid for a write.
        unsafe { put(device, h) }
    })
}

/// `nvmlDeviceGetHandleByUUID`.
///
/// # Safety
/// `uuid` is null or NUL-terminated; `device` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByUUID(
    uuid: *const c_char,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    guard(|| {
        // SAFETY: null (rejected) or NUL-terminated.
        let u = unsafe { get_str(uuid) }?;
        if device.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let h = sim::handle_by_uuid(&u)?;
        // SAFETY: non-null and valid for a write.
        unsafe { put(device, h) }
    })
}

/// `nvmlDeviceGetHandleByPciBusId` (v1).
///
/// # Safety
/// `pciBusId` is null or NUL-terminated; `device` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByPciBusId(
    pciBusId: *const c_char,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    // SAFETY: same contract.
    unsafe { nvmlDeviceGetHandleByPciBusId_v2(pciBusId, device) }
}

/// `nvmlDeviceGetHandleByPciBusId_v2`.
///
/// # Safety
/// `pciBusId` is null or NUL-terminated; `device` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByPciBusId_v2(
    pciBusId: *const c_char,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    guard(|| {
        // SAFETY: null (rejected) or NUL-terminated.
        let id = unsafe { get_str(pciBusId) }?;
        if device.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let h = sim::handle_by_pci_bus_id(&id)?;
        // SAFETY: non-null and valid for a write.
        unsafe { put(device, h) }
    })
}

/// `nvmlDeviceGetIndex` (answers for a lost device too).
///
/// # Safety
/// `index` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetIndex(
    device: nvmlDevice_t,
    index: *mut c_uint,
) -> nvmlReturn_t {
    guard(|| {
        let dev = sim::device(device)?;
        let i = sim::nvml_index(dev.d)?;
        // SAFETY: null (rejected) or valid for a write.
        unsafe { put(index, i) }
    })
}

// ---- device identity --------------------------------------------------------------------

/// `nvmlDeviceGetName`.
///
/// # Safety
/// `name` is valid for `length` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetName(
    device: nvmlDevice_t,
    name: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    guard(|| {
        let dev = sim::live_device(device)?;
        // SAFETY: valid for `length` bytes by the contract.
        unsafe { put_str(name, length, &dev.name()) }
    })
}

/// `nvmlDeviceGetUUID`.
///
/// # Safety
/// `uuid` is valid for `length` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetUUID(
    device: nvmlDevice_t,
    uuid: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    guard(|| {
        let dev = sim::live_device(device)?;
        // SAFETY: valid for `length` bytes by the contract.
        unsafe { put_str(uuid, length, &dev.uuid()) }
    })
}

/// `nvmlDeviceGetSerial`: 13 digits derived from the UUID.
///
/// # Safety
/// `serial` is valid for `length` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetSerial(
    device: nvmlDevice_t,
    serial: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    guard(|| {
        let dev = sim::live_device(device)?;
        // SAFETY: valid for `length` bytes by the contract.
        unsafe { put_str(serial, length, &dev.serial()) }
    })
}

/// `nvmlDeviceGetHandleBySerial`.
///
/// # Safety
/// `serial` is null or NUL-terminated; `device` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleBySerial(
    serial: *const c_char,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    guard(|| {
        // SAFETY: null (rejected) or NUL-terminated.
        let s = unsafe { get_str(serial) }?;
        if device.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let h = sim::handle_by_serial(&s)?;
        // SAFETY: non-null and valid for a write.
        unsafe { put(device, h) }
    })
}

pub(crate) fn bus_id_bytes<const N: usize>(s: &str) -> [c_char; N] {
    let mut out = [0 as c_char; N];
    for (o, b) in out.iter_mut().zip(s.bytes().take(N - 1)) {
        *o = b.cast_signed();
    }
    out
}

/// `pciDeviceId`: NVIDIA's vendor id in the low half; the PCI device id is not part of
/// the simulator's configuration, so the high half is 0.
pub(crate) const PCI_DEVICE_ID: c_uint = PCI_VENDOR_ID_NVIDIA;

/// `nvmlDeviceGetPciInfo` (v1): the 52-byte layout with the legacy bus id.
///
/// # Safety
/// `pci` is null or valid for writing an [`nvmlPciInfo_v2_t`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPciInfo(
    device: nvmlDevice_t,
    pci: *mut nvmlPciInfo_v2_t,
) -> nvmlReturn_t {
    // SAFETY: same contract.
    unsafe { nvmlDeviceGetPciInfo_v2(device, pci) }
}

/// A device's PCI address as NVML's `nvmlPciInfo_t` (v3 layout) reports it.
pub(crate) fn pci_info(p: &sim::Pci) -> nvmlPciInfo_t {
    nvmlPciInfo_t {
        busIdLegacy: bus_id_bytes(&p.bus_id_legacy),
        domain: p.domain,
        bus: p.bus,
        device: p.device,
        pciDeviceId: PCI_DEVICE_ID,
        pciSubSystemId: 0,
        busId: bus_id_bytes(&p.bus_id),
    }
}

/// A device's PCI address in the older 52-byte layout (the legacy bus id).
pub(crate) fn pci_info_v2(p: &sim::Pci) -> nvmlPciInfo_v2_t {
    nvmlPciInfo_v2_t {
        busId: bus_id_bytes(&p.bus_id_legacy),
        domain: p.domain,
        bus: p.bus,
        device: p.device,
        pciDeviceId: PCI_DEVICE_ID,
        pciSubSystemId: 0,
        reserved: [0; 4],
    }
}

/// `nvmlDeviceGetPciInfo_v2`: the 52-byte layout with the legacy bus id.
///
/// # Safety
/// `pci` is null or valid for writing an [`nvmlPciInfo_v2_t`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPciInfo_v2(
    device: nvmlDevice_t,
    pci: *mut nvmlPciInfo_v2_t,
) -> nvmlReturn_t {
    guard(|| {
        let p = sim::live_device(device)?.pci()?;
        let v = pci_info_v2(&p);
        // SAFETY: null (rejected) or valid for the write.
        unsafe { put(pci, v) }
    })
}

/// `nvmlDeviceGetPciInfo_v3`.
///
/// # Safety
/// `pci` is null or valid for writing an [`nvmlPciInfo_t`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPciInfo_v3(
    device: nvmlDevice_t,
    pci: *mut nvmlPciInfo_t,
) -> nvmlReturn_t {
    guard(|| {
        let p = sim::live_device(device)?.pci()?;
        let v = pci_info(&p);
        // SAFETY: null (rejected) or valid for the write.
        unsafe { put(pci, v) }
    })
}

/// `nvmlDeviceGetMinorNumber`: the simulator numbers `/dev/nvidiaN` by the node's device
/// index, which a GPU keeps in a process that has fewer GPUs (its NVML index changes).
///
/// # Safety
/// `minorNumber` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMinorNumber(
    device: nvmlDevice_t,
    minorNumber: *mut c_uint,
) -> nvmlReturn_t {
    guard(|| {
        let dev = sim::live_device(device)?;
        // SAFETY: null (rejected) or valid for a write.
        unsafe { put(minorNumber, dev.d as c_uint) }
    })
}

/// `nvmlDeviceGetCudaComputeCapability`.
///
/// # Safety
/// `major` and `minor` are null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCudaComputeCapability(
    device: nvmlDevice_t,
    major: *mut c_int,
    minor: *mut c_int,
) -> nvmlReturn_t {
    guard(|| {
        let dev = sim::live_device(device)?;
        if major.is_null() || minor.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let (ma, mi) = dev.cc();
        // SAFETY: both non-null and valid for a write.
        unsafe {
            put(major, c_int::try_from(ma).unwrap_or(c_int::MAX))?;
            put(minor, c_int::try_from(mi).unwrap_or(c_int::MAX))
        }
    })
}

/// `nvmlDeviceGetArchitecture`: from the compute capability.
///
/// # Safety
/// `arch` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetArchitecture(
    device: nvmlDevice_t,
    arch: *mut nvmlDeviceArchitecture_t,
) -> nvmlReturn_t {
    guard(|| {
        let (ma, mi) = sim::live_device(device)?.cc();
        // SAFETY: null (rejected) or valid for a write.
        unsafe { put(arch, sim::architecture(ma, mi)) }
    })
}

/// `nvmlDeviceGetNumGpuCores`: SMs × FP32 cores per SM of the architecture.
///
/// # Safety
/// `numCores` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNumGpuCores(
    device: nvmlDevice_t,
    numCores: *mut c_uint,
) -> nvmlReturn_t {
    guard(|| {
        let n = sim::live_device(device)?.num_cores()?;
        // SAFETY: null (rejected) or valid for a write.
        unsafe { put(numCores, n) }
    })
}

/// `nvmlDeviceGetBrand`: from the marketing name.
///
/// # Safety
/// `brand` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetBrand(
    device: nvmlDevice_t,
    brand: *mut nvmlBrandType_t,
) -> nvmlReturn_t {
    guard(|| {
        let b = sim::live_device(device)?.brand();
        // SAFETY: null (rejected) or valid for a write.
        unsafe { put(brand, b) }
    })
}

/// `nvmlDeviceGetComputeMode`: the simulated devices let any number of processes and
/// contexts share them, which is `NVML_COMPUTEMODE_DEFAULT`.
///
/// # Safety
/// `mode` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeMode(
    device: nvmlDevice_t,
    mode: *mut nvmlComputeMode_t,
) -> nvmlReturn_t {
    guard(|| {
        sim::live_device(device)?;
        // SAFETY: null (rejected) or valid for a write.
        unsafe { put(mode, NVML_COMPUTEMODE_DEFAULT) }
    })
}

/// `nvmlDeviceGetPersistenceMode`: enabled, because the simulated node's state outlives
/// its clients (it lives in the state file), which is what persistence mode means.
///
/// # Safety
/// `mode` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPersistenceMode(
    device: nvmlDevice_t,
    mode: *mut nvmlEnableState_t,
) -> nvmlReturn_t {
    guard(|| {
        sim::live_device(device)?;
        // SAFETY: null (rejected) or valid for a write.
        unsafe { put(mode, NVML_FEATURE_ENABLED) }
    })
}

/// `nvmlDeviceIsMigDeviceHandle`: our handles always name whole GPUs.
///
/// # Safety
/// `isMigDevice` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceIsMigDeviceHandle(
    device: nvmlDevice_t,
    isMigDevice: *mut c_uint,
) -> nvmlReturn_t {
    guard(|| {
        sim::device(device)?;
        // SAFETY: null (rejected) or valid for a write.
        unsafe { put(isMigDevice, 0) }
    })
}

/// `nvmlDeviceGetMigMode`: MIG is not simulated, so it is disabled (current and pending).
///
/// # Safety
/// `currentMode` and `pendingMode` are null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMigMode(
    device: nvmlDevice_t,
    currentMode: *mut c_uint,
    pendingMode: *mut c_uint,
) -> nvmlReturn_t {
    guard(|| {
        sim::live_device(device)?;
        if currentMode.is_null() || pendingMode.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        // SAFETY: both non-null and valid for a write.
        unsafe {
            put(currentMode, NVML_DEVICE_MIG_DISABLE)?;
            put(pendingMode, NVML_DEVICE_MIG_DISABLE)
        }
    })
}

// ---- memory, processes, utilization ------------------------------------------------------------

/// `nvmlDeviceGetMemoryInfo` (v1): `used` is everything allocated, contexts included.
///
/// # Safety
/// `memory` is null or valid for writing an [`nvmlMemory_t`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo(
    device: nvmlDevice_t,
    memory: *mut nvmlMemory_t,
) -> nvmlReturn_t {
    guard(|| {
        let dev = sim::live_device(device)?;
        if memory.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let (total, free, used) = dev.memory();
        // SAFETY: non-null and valid for the write.
        unsafe { put(memory, nvmlMemory_t { total, free, used }) }
    })
}

/// `nvmlDeviceGetMemoryInfo_v2`: `reserved` is 0 (the simulator reserves nothing for
/// the system; a context's cost is charged to its process and counted in `used`).
///
/// # Safety
/// `memory` is null or valid for reading and writing an [`nvmlMemory_v2_t`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    device: nvmlDevice_t,
    memory: *mut nvmlMemory_v2_t,
) -> nvmlReturn_t {
    guard(|| {
        let dev = sim::live_device(device)?;
        // SAFETY: null (rejected) or valid for reading its first field.
        let version = unsafe { get(memory.cast::<c_uint>().cast_const()) }?;
        if version != nvmlMemory_v2 {
            return Err(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
        }
        let (total, free, used) = dev.memory();
        let v = nvmlMemory_v2_t {
            version,
            total,
            reserved: 0,
            free,
            used,
        };
        // SAFETY: non-null and valid for the write.
        unsafe { put(memory, v) }
    })
}

/// `nvmlDeviceGetComputeRunningProcesses` (v1 struct).
///
/// # Safety
/// `infoCount` is null or valid for read/write; `infos` is null or holds `*infoCount`
/// elements.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses(
    device: nvmlDevice_t,
    infoCount: *mut c_uint,
    infos: *mut nvmlProcessInfo_v1_t,
) -> nvmlReturn_t {
    // SAFETY: same contract as `process_list`.
    unsafe { process_list(device, infoCount, infos, compute_procs, info_v1) }
}

/// `nvmlDeviceGetComputeRunningProcesses_v2`.
///
/// # Safety
/// As [`nvmlDeviceGetComputeRunningProcesses`], with [`nvmlProcessInfo_t`] elements.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses_v2(
    device: nvmlDevice_t,
    infoCount: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    // SAFETY: same contract as `process_list`.
    unsafe { process_list(device, infoCount, infos, compute_procs, info_v2) }
}

/// `nvmlDeviceGetComputeRunningProcesses_v3`.
///
/// # Safety
/// As [`nvmlDeviceGetComputeRunningProcesses`], with [`nvmlProcessInfo_t`] elements.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses_v3(
    device: nvmlDevice_t,
    infoCount: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    // SAFETY: same contract as `process_list`.
    unsafe { process_list(device, infoCount, infos, compute_procs, info_v2) }
}

/// `nvmlDeviceGetGraphicsRunningProcesses`: always empty (no graphics is simulated).
///
/// # Safety
/// As [`nvmlDeviceGetComputeRunningProcesses`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGraphicsRunningProcesses(
    device: nvmlDevice_t,
    infoCount: *mut c_uint,
    infos: *mut nvmlProcessInfo_v1_t,
) -> nvmlReturn_t {
    // SAFETY: same contract as `process_list`.
    unsafe { process_list(device, infoCount, infos, no_procs, info_v1) }
}

/// `nvmlDeviceGetGraphicsRunningProcesses_v2`: always empty.
///
/// # Safety
/// As [`nvmlDeviceGetComputeRunningProcesses_v2`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGraphicsRunningProcesses_v2(
    device: nvmlDevice_t,
    infoCount: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    // SAFETY: same contract as `process_list`.
    unsafe { process_list(device, infoCount, infos, no_procs, info_v2) }
}

/// `nvmlDeviceGetGraphicsRunningProcesses_v3`: always empty.
///
/// # Safety
/// As [`nvmlDeviceGetComputeRunningProcesses_v2`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGraphicsRunningProcesses_v3(
    device: nvmlDevice_t,
    infoCount: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    // SAFETY: same contract as `process_list`.
    unsafe { process_list(device, infoCount, infos, no_procs, info_v2) }
}

/// `nvmlDeviceGetMPSComputeRunningProcesses`: always empty (no MPS server is simulated).
///
/// # Safety
/// As [`nvmlDeviceGetComputeRunningProcesses`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMPSComputeRunningProcesses(
    device: nvmlDevice_t,
    infoCount: *mut c_uint,
    infos: *mut nvmlProcessInfo_v1_t,
) -> nvmlReturn_t {
    // SAFETY: same contract as `process_list`.
    unsafe { process_list(device, infoCount, infos, no_procs, info_v1) }
}

/// `nvmlDeviceGetMPSComputeRunningProcesses_v2`: always empty.
///
/// # Safety
/// As [`nvmlDeviceGetComputeRunningProcesses_v2`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMPSComputeRunningProcesses_v2(
    device: nvmlDevice_t,
    infoCount: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    // SAFETY: same contract as `process_list`.
    unsafe { process_list(device, infoCount, infos, no_procs, info_v2) }
}

/// `nvmlDeviceGetMPSComputeRunningProcesses_v3`: always empty.
///
/// # Safety
/// As [`nvmlDeviceGetComputeRunningProcesses_v2`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMPSComputeRunningProcesses_v3(
    device: nvmlDevice_t,
    infoCount: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    // SAFETY: same contract as `process_list`.
    unsafe { process_list(device, infoCount, infos, no_procs, info_v2) }
}

/// `nvmlDeviceGetUtilizationRates`: `gpu` is the share of the last second the execution
/// engine was busy; memory-controller activity is not modelled and reads 0.
///
/// # Safety
/// `utilization` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetUtilizationRates(
    device: nvmlDevice_t,
    utilization: *mut nvmlUtilization_t,
) -> nvmlReturn_t {
    guard(|| {
        let dev = sim::live_device(device)?;
        if utilization.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let v = nvmlUtilization_t {
            gpu: dev.gpu_utilization(),
            memory: 0,
        };
        // SAFETY: non-null and valid for the write.
        unsafe { put(utilization, v) }
    })
}

/// `nvmlDeviceGetProcessUtilization`: one sample per live process on the device since
/// `lastSeenTimeStamp` (µs). `utilization == NULL` queries the count
/// (`NVML_ERROR_INSUFFICIENT_SIZE` with the count set); no samples is `NOT_FOUND`.
///
/// # Safety
/// `processSamplesCount` is null or valid for read/write; `utilization` is null or holds
/// `*processSamplesCount` elements.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetProcessUtilization(
    device: nvmlDevice_t,
    utilization: *mut nvmlProcessUtilizationSample_t,
    processSamplesCount: *mut c_uint,
    lastSeenTimeStamp: c_ulonglong,
) -> nvmlReturn_t {
    guard(|| {
        let dev = sim::live_device(device)?;
        // SAFETY: null (rejected) or valid for a read.
        let cap = unsafe { get(processSamplesCount) }?;
        let samples = dev.process_samples(lastSeenTimeStamp);
        if samples.is_empty() {
            return Err(NVML_ERROR_NOT_FOUND);
        }
        let n = samples.len() as c_uint;
        if utilization.is_null() || cap < n {
            // SAFETY: valid for a write (checked non-null above).
            unsafe { put(processSamplesCount, n) }?;
            return Err(NVML_ERROR_INSUFFICIENT_SIZE);
        }
        // SAFETY: `utilization` holds `cap >= n` elements.
        unsafe { put_slice(utilization, &samples) }?;
        // SAFETY: as above.
        unsafe { put(processSamplesCount, n) }
    })
}

// ---- accounting ------------------------------------------------------------------------------

/// `nvmlDeviceGetAccountingMode`.
///
/// # Safety
/// `mode` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetAccountingMode(
    device: nvmlDevice_t,
    mode: *mut nvmlEnableState_t,
) -> nvmlReturn_t {
    guard(|| {
        let dev = sim::live_device(device)?;
        let m = if dev.accounting_enabled() {
            NVML_FEATURE_ENABLED
        } else {
            NVML_FEATURE_DISABLED
        };
        // SAFETY: null (rejected) or valid for a write.
        unsafe { put(mode, m) }
    })
}

/// `nvmlDeviceSetAccountingMode` (node-wide state; no root check in the simulator).
///
/// # Safety
/// None (no pointers).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceSetAccountingMode(
    device: nvmlDevice_t,
    mode: nvmlEnableState_t,
) -> nvmlReturn_t {
    guard(|| {
        let dev = sim::live_device(device)?;
        match mode {
            NVML_FEATURE_ENABLED => dev.set_accounting(true),
            NVML_FEATURE_DISABLED => dev.set_accounting(false),
            _ => return Err(NVML_ERROR_INVALID_ARGUMENT),
        }
        Ok(())
    })
}

/// `nvmlDeviceGetAccountingStats`.
///
/// # Safety
/// `stats` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetAccountingStats(
    device: nvmlDevice_t,
    pid: c_uint,
    stats: *mut nvmlAccountingStats_t,
) -> nvmlReturn_t {
    guard(|| {
        let dev = sim::live_device(device)?;
        if stats.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let a = dev.accounting_stats(pid)?;
        let v = nvmlAccountingStats_t {
            gpuUtilization: a.gpu_util_pct,
            // Memory-controller activity is not modelled: NVML's "not available" value.
            memoryUtilization: NVML_VALUE_NOT_AVAILABLE_UINT,
            maxMemoryUsage: a.max_memory,
            time: a.time_ms,
            startTime: a.start_us,
            isRunning: c_uint::from(a.running),
            reserved: [0; 5],
        };
        // SAFETY: non-null and valid for the write.
        unsafe { put(stats, v) }
    })
}

/// `nvmlDeviceGetAccountingPids`.
///
/// # Safety
/// `count` is null or valid for read/write; `pids` is null or holds `*count` elements.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetAccountingPids(
    device: nvmlDevice_t,
    count: *mut c_uint,
    pids: *mut c_uint,
) -> nvmlReturn_t {
    guard(|| {
        let dev = sim::live_device(device)?;
        // SAFETY: null (rejected) or valid for a read.
        let cap = unsafe { get(count) }?;
        let list = dev.accounting_pids()?;
        match sim::list_outcome(cap, list.len()) {
            ListOutcome::TooSmall(n) => {
                // SAFETY: valid for a write.
                unsafe { put(count, n as c_uint) }?;
                Err(NVML_ERROR_INSUFFICIENT_SIZE)
            }
            ListOutcome::Fill(n) => {
                // SAFETY: `pids` holds `cap >= n` elements.
                unsafe { put_slice(pids, &list) }?;
                // SAFETY: valid for a write.
                unsafe { put(count, n as c_uint) }
            }
        }
    })
}

/// `nvmlDeviceGetAccountingBufferSize`.
///
/// # Safety
/// `bufferSize` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetAccountingBufferSize(
    device: nvmlDevice_t,
    bufferSize: *mut c_uint,
) -> nvmlReturn_t {
    guard(|| {
        let n = sim::live_device(device)?.accounting_buffer_size()?;
        // SAFETY: null (rejected) or valid for a write.
        unsafe { put(bufferSize, n) }
    })
}

/// `nvmlDeviceClearAccountingPids`: forgets the device's exited processes.
///
/// # Safety
/// None (no pointers).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceClearAccountingPids(device: nvmlDevice_t) -> nvmlReturn_t {
    guard(|| {
        let dev = sim::live_device(device)?;
        dev.st.clear_exited_accounting_on(dev.d);
        Ok(())
    })
}

// ---- events and ECC ------------------------------------------------------------------------

/// `nvmlDeviceGetSupportedEventTypes`: single- and double-bit ECC, XID.
///
/// # Safety
/// `eventTypes` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetSupportedEventTypes(
    device: nvmlDevice_t,
    eventTypes: *mut c_ulonglong,
) -> nvmlReturn_t {
    guard(|| {
        sim::live_device(device)?;
        // SAFETY: null (rejected) or valid for a write.
        unsafe { put(eventTypes, sim::SUPPORTED_EVENTS) }
    })
}

/// `nvmlEventSetCreate`.
///
/// # Safety
/// `set` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetCreate(set: *mut nvmlEventSet_t) -> nvmlReturn_t {
    guard(|| {
        if set.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let h = sim::event_set_create()?;
        // SAFETY: non-null and valid for a write.
        unsafe { put(set, h) }
    })
}

/// `nvmlDeviceRegisterEvents`: unsupported types in the mask are `NOT_SUPPORTED`.
///
/// # Safety
/// None beyond NVML's (handles are validated).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceRegisterEvents(
    device: nvmlDevice_t,
    eventTypes: c_ulonglong,
    set: nvmlEventSet_t,
) -> nvmlReturn_t {
    guard(|| {
        let dev = sim::live_device(device)?;
        sim::register_events(&dev, eventTypes, set)
    })
}

/// `nvmlEventSetWait` (v1): fills the 24-byte pre-MIG `nvmlEventData_t`.
///
/// # Safety
/// `data` is null or valid for writing an [`nvmlEventData_v1_t`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetWait(
    set: nvmlEventSet_t,
    data: *mut nvmlEventData_v1_t,
    timeoutms: c_uint,
) -> nvmlReturn_t {
    guard(|| {
        if data.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let e = sim::event_wait(set, Duration::from_millis(timeoutms.into()))?;
        let v = nvmlEventData_v1_t {
            device: sim::handle_of(e.d),
            eventType: e.kind,
            eventData: e.data,
        };
        // SAFETY: non-null and valid for the write.
        unsafe { put(data, v) }
    })
}

/// `nvmlEventSetWait_v2`: the next event of a registered type, waiting at most
/// `timeoutms`; `NVML_ERROR_TIMEOUT` when none came.
///
/// # Safety
/// `data` is null or valid for writing an [`nvmlEventData_t`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetWait_v2(
    set: nvmlEventSet_t,
    data: *mut nvmlEventData_t,
    timeoutms: c_uint,
) -> nvmlReturn_t {
    guard(|| {
        if data.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let e = sim::event_wait(set, Duration::from_millis(timeoutms.into()))?;
        let v = nvmlEventData_t {
            device: sim::handle_of(e.d),
            eventType: e.kind,
            eventData: e.data,
            gpuInstanceId: NVML_INSTANCE_ID_NONE,
            computeInstanceId: NVML_INSTANCE_ID_NONE,
        };
        // SAFETY: non-null and valid for the write.
        unsafe { put(data, v) }
    })
}

/// `nvmlEventSetFree`.
///
/// # Safety
/// None beyond NVML's (the handle is validated).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetFree(set: nvmlEventSet_t) -> nvmlReturn_t {
    guard(|| sim::event_set_free(set))
}

/// `nvmlDeviceGetEccMode`: ECC is on (the simulator raises ECC error events).
///
/// # Safety
/// `current` and `pending` are null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetEccMode(
    device: nvmlDevice_t,
    current: *mut nvmlEnableState_t,
    pending: *mut nvmlEnableState_t,
) -> nvmlReturn_t {
    guard(|| {
        sim::live_device(device)?;
        if current.is_null() || pending.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        // SAFETY: both non-null and valid for a write.
        unsafe {
            put(current, NVML_FEATURE_ENABLED)?;
            put(pending, NVML_FEATURE_ENABLED)
        }
    })
}

/// `nvmlDeviceGetTotalEccErrors`: ECC error events raised on the device (corrected =
/// single-bit, uncorrected = double-bit) that are still in its event ring; volatile and
/// aggregate counters are the same.
///
/// # Safety
/// `eccCounts` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetTotalEccErrors(
    device: nvmlDevice_t,
    errorType: nvmlMemoryErrorType_t,
    counterType: nvmlEccCounterType_t,
    eccCounts: *mut c_ulonglong,
) -> nvmlReturn_t {
    guard(|| {
        let dev = sim::live_device(device)?;
        if counterType != NVML_VOLATILE_ECC && counterType != NVML_AGGREGATE_ECC {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let n = dev.ecc_errors(errorType)?;
        // SAFETY: null (rejected) or valid for a write.
        unsafe { put(eccCounts, n) }
    })
}

// ---- not simulated ---------------------------------------------------------------------------

/// Exports NVML queries the simulator has no model for: after the usual checks
/// (initialised, valid handle, device not lost) they return `NVML_ERROR_NOT_SUPPORTED`,
/// which clients already handle (it is what real GPUs answer for sensors they lack).
/// Nothing is written through their pointers.
macro_rules! not_simulated {
    ($( $(#[$doc:meta])* $name:ident ( $($arg:ident : $ty:ty),* ); )*) => {$(
        $(#[$doc])*
        ///
        /// Not simulated: `NVML_ERROR_NOT_SUPPORTED`.
        ///
        /// # Safety
        /// None (no pointer is dereferenced).
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(device: nvmlDevice_t, $($arg: $ty),*) -> nvmlReturn_t {
            $( let _ = $arg; )*
            guard(|| {
                sim::live_device(device)?;
                Err(NVML_ERROR_NOT_SUPPORTED)
            })
        }
    )*};
}

not_simulated! {
    /// `nvmlDeviceGetTemperature`.
    nvmlDeviceGetTemperature(sensor: c_uint, temp: *mut c_uint);
    /// `nvmlDeviceGetTemperatureThreshold`.
    nvmlDeviceGetTemperatureThreshold(threshold: c_uint, temp: *mut c_uint);
    /// `nvmlDeviceGetFanSpeed`.
    nvmlDeviceGetFanSpeed(speed: *mut c_uint);
    /// `nvmlDeviceGetFanSpeed_v2`.
    nvmlDeviceGetFanSpeed_v2(fan: c_uint, speed: *mut c_uint);
    /// `nvmlDeviceGetNumFans`.
    nvmlDeviceGetNumFans(num: *mut c_uint);
    /// `nvmlDeviceGetPowerUsage`.
    nvmlDeviceGetPowerUsage(power: *mut c_uint);
    /// `nvmlDeviceGetPowerState`.
    nvmlDeviceGetPowerState(state: *mut c_uint);
    /// `nvmlDeviceGetPerformanceState`.
    nvmlDeviceGetPerformanceState(state: *mut c_uint);
    /// `nvmlDeviceGetEnforcedPowerLimit`.
    nvmlDeviceGetEnforcedPowerLimit(limit: *mut c_uint);
    /// `nvmlDeviceGetPowerManagementLimit`.
    nvmlDeviceGetPowerManagementLimit(limit: *mut c_uint);
    /// `nvmlDeviceGetPowerManagementDefaultLimit`.
    nvmlDeviceGetPowerManagementDefaultLimit(limit: *mut c_uint);
    /// `nvmlDeviceGetTotalEnergyConsumption`.
    nvmlDeviceGetTotalEnergyConsumption(energy: *mut c_ulonglong);
    /// `nvmlDeviceGetClockInfo`.
    nvmlDeviceGetClockInfo(clock_type: c_uint, clock: *mut c_uint);
    /// `nvmlDeviceGetMaxClockInfo`.
    nvmlDeviceGetMaxClockInfo(clock_type: c_uint, clock: *mut c_uint);
    /// `nvmlDeviceGetClock`.
    nvmlDeviceGetClock(clock_type: c_uint, clock_id: c_uint, mhz: *mut c_uint);
    /// `nvmlDeviceGetEncoderUtilization`.
    nvmlDeviceGetEncoderUtilization(utilization: *mut c_uint, period_us: *mut c_uint);
    /// `nvmlDeviceGetDecoderUtilization`.
    nvmlDeviceGetDecoderUtilization(utilization: *mut c_uint, period_us: *mut c_uint);
    /// `nvmlDeviceGetPcieThroughput`.
    nvmlDeviceGetPcieThroughput(counter: c_uint, value: *mut c_uint);
    /// `nvmlDeviceGetCurrPcieLinkGeneration`.
    nvmlDeviceGetCurrPcieLinkGeneration(gen_: *mut c_uint);
    /// `nvmlDeviceGetCurrPcieLinkWidth`.
    nvmlDeviceGetCurrPcieLinkWidth(width: *mut c_uint);
    /// `nvmlDeviceGetMaxPcieLinkGeneration`.
    nvmlDeviceGetMaxPcieLinkGeneration(gen_: *mut c_uint);
    /// `nvmlDeviceGetMaxPcieLinkWidth`.
    nvmlDeviceGetMaxPcieLinkWidth(width: *mut c_uint);
    /// `nvmlDeviceGetBAR1MemoryInfo`.
    nvmlDeviceGetBAR1MemoryInfo(bar1: *mut c_ulonglong);
    /// `nvmlDeviceGetDisplayMode`.
    nvmlDeviceGetDisplayMode(mode: *mut c_uint);
    /// `nvmlDeviceGetDisplayActive`.
    nvmlDeviceGetDisplayActive(active: *mut c_uint);
    /// `nvmlDeviceGetCurrentClocksThrottleReasons`.
    nvmlDeviceGetCurrentClocksThrottleReasons(reasons: *mut c_ulonglong);
    /// `nvmlDeviceGetCurrentClocksEventReasons`.
    nvmlDeviceGetCurrentClocksEventReasons(reasons: *mut c_ulonglong);
    /// `nvmlDeviceGetDriverModel` (a Windows concept; Linux drivers answer not supported).
    nvmlDeviceGetDriverModel(current: *mut c_uint, pending: *mut c_uint);
    /// `nvmlDeviceGetDriverModel_v2`.
    nvmlDeviceGetDriverModel_v2(current: *mut c_uint, pending: *mut c_uint);
    /// `nvmlDeviceGetVbiosVersion`.
    nvmlDeviceGetVbiosVersion(version: *mut c_char, length: c_uint);
    /// `nvmlDeviceGetBoardPartNumber`.
    nvmlDeviceGetBoardPartNumber(part: *mut c_char, length: c_uint);
}
