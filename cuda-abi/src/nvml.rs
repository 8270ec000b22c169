//! NVML (`nvml.h`) types: return codes, enums, constants and `#[repr(C)]` structs.
//!
//! Only what the simulator and the shim use is defined here; every value and layout is
//! taken from NVIDIA's `nvml.h` (the names are the header's, so they can be searched
//! for). Struct layouts are checked by the tests at the bottom against the sizes and
//! offsets the header implies on x86-64 / aarch64 Linux (LP64).
//!
//! Versioned structs carry their version in the first field, built as NVML's
//! `NVML_STRUCT_VERSION(name, ver)` macro does: `sizeof(struct) | ver << 24`.

// nvml.h spells its event-type and struct-version constants in camel case
// (`nvmlEventTypeXidCriticalError`, `nvmlMemory_v2`); keeping the header's names makes
// them searchable.
#![allow(non_upper_case_globals)]

use std::ffi::{c_char, c_uint, c_ulonglong};

// ---- return codes ------------------------------------------------------------------------

/// `nvmlReturn_t`: every NVML entry point returns one of the `NVML_*` codes below.
///
/// A plain integer rather than a Rust enum: values come back from C and newer drivers
/// add codes, and an out-of-range Rust enum would be undefined behaviour.
pub type nvmlReturn_t = c_uint;

/// The operation was successful.
pub const NVML_SUCCESS: nvmlReturn_t = 0;
/// NVML was not first initialized with `nvmlInit()`.
pub const NVML_ERROR_UNINITIALIZED: nvmlReturn_t = 1;
/// A supplied argument is invalid.
pub const NVML_ERROR_INVALID_ARGUMENT: nvmlReturn_t = 2;
/// The requested operation is not available on the target device.
pub const NVML_ERROR_NOT_SUPPORTED: nvmlReturn_t = 3;
/// The current user does not have permission for the operation.
pub const NVML_ERROR_NO_PERMISSION: nvmlReturn_t = 4;
/// Deprecated: multiple initializations are now allowed through ref counting.
pub const NVML_ERROR_ALREADY_INITIALIZED: nvmlReturn_t = 5;
/// A query to find an object was unsuccessful.
pub const NVML_ERROR_NOT_FOUND: nvmlReturn_t = 6;
/// An input argument is not large enough.
pub const NVML_ERROR_INSUFFICIENT_SIZE: nvmlReturn_t = 7;
/// A device's external power cables are not properly attached.
pub const NVML_ERROR_INSUFFICIENT_POWER: nvmlReturn_t = 8;
/// NVIDIA driver is not loaded.
pub const NVML_ERROR_DRIVER_NOT_LOADED: nvmlReturn_t = 9;
/// User provided timeout passed.
pub const NVML_ERROR_TIMEOUT: nvmlReturn_t = 10;
/// NVIDIA kernel detected an interrupt issue with a GPU.
pub const NVML_ERROR_IRQ_ISSUE: nvmlReturn_t = 11;
/// NVML shared library couldn't be found or loaded.
pub const NVML_ERROR_LIBRARY_NOT_FOUND: nvmlReturn_t = 12;
/// Local version of NVML doesn't implement this function.
pub const NVML_ERROR_FUNCTION_NOT_FOUND: nvmlReturn_t = 13;
/// infoROM is corrupted.
pub const NVML_ERROR_CORRUPTED_INFOROM: nvmlReturn_t = 14;
/// The GPU has fallen off the bus or has otherwise become inaccessible.
pub const NVML_ERROR_GPU_IS_LOST: nvmlReturn_t = 15;
/// The GPU requires a reset before it can be used again.
pub const NVML_ERROR_RESET_REQUIRED: nvmlReturn_t = 16;
/// The GPU control device has been blocked by the operating system/cgroups.
pub const NVML_ERROR_OPERATING_SYSTEM: nvmlReturn_t = 17;
/// RM detects a driver/library version mismatch.
pub const NVML_ERROR_LIB_RM_VERSION_MISMATCH: nvmlReturn_t = 18;
/// An operation cannot be performed because the GPU is currently in use.
pub const NVML_ERROR_IN_USE: nvmlReturn_t = 19;
/// Insufficient memory.
pub const NVML_ERROR_MEMORY: nvmlReturn_t = 20;
/// No data.
pub const NVML_ERROR_NO_DATA: nvmlReturn_t = 21;
/// The requested vGPU operation is not available because ECC is enabled.
pub const NVML_ERROR_VGPU_ECC_NOT_SUPPORTED: nvmlReturn_t = 22;
/// Ran out of critical resources, other than memory.
pub const NVML_ERROR_INSUFFICIENT_RESOURCES: nvmlReturn_t = 23;
/// The requested frequency is not supported.
pub const NVML_ERROR_FREQ_NOT_SUPPORTED: nvmlReturn_t = 24;
/// The provided version is invalid/unsupported.
pub const NVML_ERROR_ARGUMENT_VERSION_MISMATCH: nvmlReturn_t = 25;
/// The requested functionality has been deprecated.
pub const NVML_ERROR_DEPRECATED: nvmlReturn_t = 26;
/// The system is not ready for the request.
pub const NVML_ERROR_NOT_READY: nvmlReturn_t = 27;
/// No GPUs were found.
pub const NVML_ERROR_GPU_NOT_FOUND: nvmlReturn_t = 28;
/// Resource not in correct state to perform requested operation.
pub const NVML_ERROR_INVALID_STATE: nvmlReturn_t = 29;
/// An internal driver error occurred.
pub const NVML_ERROR_UNKNOWN: nvmlReturn_t = 999;

// ---- handles -----------------------------------------------------------------------------

/// Opaque target of an [`nvmlDevice_t`] (`struct nvmlDevice_st`).
#[repr(C)]
#[derive(Debug)]
pub struct nvmlDevice_st {
    _opaque: [u8; 0],
}

/// `nvmlDevice_t`: a device handle.
pub type nvmlDevice_t = *mut nvmlDevice_st;

/// Opaque target of an [`nvmlEventSet_t`] (`struct nvmlEventSet_st`).
#[repr(C)]
#[derive(Debug)]
pub struct nvmlEventSet_st {
    _opaque: [u8; 0],
}

/// `nvmlEventSet_t`: a handle to an event set.
pub type nvmlEventSet_t = *mut nvmlEventSet_st;

// ---- enums (as plain integers, see `nvmlReturn_t`) ---------------------------------------

/// `nvmlEnableState_t`.
pub type nvmlEnableState_t = c_uint;
/// Feature disabled.
pub const NVML_FEATURE_DISABLED: nvmlEnableState_t = 0;
/// Feature enabled.
pub const NVML_FEATURE_ENABLED: nvmlEnableState_t = 1;

/// `nvmlComputeMode_t`.
pub type nvmlComputeMode_t = c_uint;
/// Default compute mode: multiple contexts per device.
pub const NVML_COMPUTEMODE_DEFAULT: nvmlComputeMode_t = 0;
/// Support removed.
pub const NVML_COMPUTEMODE_EXCLUSIVE_THREAD: nvmlComputeMode_t = 1;
/// Compute-prohibited mode: no contexts per device.
pub const NVML_COMPUTEMODE_PROHIBITED: nvmlComputeMode_t = 2;
/// Compute-exclusive-process mode: only one context per device, usable from multiple threads.
pub const NVML_COMPUTEMODE_EXCLUSIVE_PROCESS: nvmlComputeMode_t = 3;

/// `nvmlBrandType_t` (only the values the simulator reports).
pub type nvmlBrandType_t = c_uint;
/// Unknown brand.
pub const NVML_BRAND_UNKNOWN: nvmlBrandType_t = 0;
/// Tesla (data-centre) brand.
pub const NVML_BRAND_TESLA: nvmlBrandType_t = 2;
/// GeForce brand.
pub const NVML_BRAND_GEFORCE: nvmlBrandType_t = 5;
/// NVIDIA brand.
pub const NVML_BRAND_NVIDIA: nvmlBrandType_t = 14;

/// `nvmlDeviceArchitecture_t`.
pub type nvmlDeviceArchitecture_t = c_uint;
/// Kepler (compute capability 3.x).
pub const NVML_DEVICE_ARCH_KEPLER: nvmlDeviceArchitecture_t = 2;
/// Maxwell (5.x).
pub const NVML_DEVICE_ARCH_MAXWELL: nvmlDeviceArchitecture_t = 3;
/// Pascal (6.x).
pub const NVML_DEVICE_ARCH_PASCAL: nvmlDeviceArchitecture_t = 4;
/// Volta (7.0, 7.2).
pub const NVML_DEVICE_ARCH_VOLTA: nvmlDeviceArchitecture_t = 5;
/// Turing (7.5).
pub const NVML_DEVICE_ARCH_TURING: nvmlDeviceArchitecture_t = 6;
/// Ampere (8.0, 8.6, 8.7).
pub const NVML_DEVICE_ARCH_AMPERE: nvmlDeviceArchitecture_t = 7;
/// Ada (8.9).
pub const NVML_DEVICE_ARCH_ADA: nvmlDeviceArchitecture_t = 8;
/// Hopper (9.0).
pub const NVML_DEVICE_ARCH_HOPPER: nvmlDeviceArchitecture_t = 9;
/// Blackwell (10.x, 12.x).
pub const NVML_DEVICE_ARCH_BLACKWELL: nvmlDeviceArchitecture_t = 10;
/// Unknown architecture.
pub const NVML_DEVICE_ARCH_UNKNOWN: nvmlDeviceArchitecture_t = 0xffff_ffff;

/// `nvmlMemoryErrorType_t`.
pub type nvmlMemoryErrorType_t = c_uint;
/// A memory error that was corrected (single-bit ECC).
pub const NVML_MEMORY_ERROR_TYPE_CORRECTED: nvmlMemoryErrorType_t = 0;
/// A memory error that was not corrected (double-bit ECC).
pub const NVML_MEMORY_ERROR_TYPE_UNCORRECTED: nvmlMemoryErrorType_t = 1;

/// `nvmlEccCounterType_t`.
pub type nvmlEccCounterType_t = c_uint;
/// Volatile counts are reset each time the driver loads.
pub const NVML_VOLATILE_ECC: nvmlEccCounterType_t = 0;
/// Aggregate counts persist across reboots.
pub const NVML_AGGREGATE_ECC: nvmlEccCounterType_t = 1;

/// MIG mode disabled (`NVML_DEVICE_MIG_DISABLE`).
pub const NVML_DEVICE_MIG_DISABLE: c_uint = 0;
/// MIG mode enabled (`NVML_DEVICE_MIG_ENABLE`).
pub const NVML_DEVICE_MIG_ENABLE: c_uint = 1;

// ---- init flags, buffer sizes and special values -------------------------------------------

/// `nvmlInitWithFlags`: don't fail `nvmlInit()` when no GPUs are found.
pub const NVML_INIT_FLAG_NO_GPUS: c_uint = 1;
/// `nvmlInitWithFlags`: don't attach GPUs.
pub const NVML_INIT_FLAG_NO_ATTACH: c_uint = 2;

/// Buffer size guaranteed to be large enough for `nvmlDeviceGetInforomVersion`.
pub const NVML_DEVICE_INFOROM_VERSION_BUFFER_SIZE: usize = 16;
/// Buffer size guaranteed to be large enough for `nvmlDeviceGetUUID`.
pub const NVML_DEVICE_UUID_BUFFER_SIZE: usize = 80;
/// Buffer size guaranteed to be large enough for `nvmlDeviceGetUUID` (v2 UUIDs).
pub const NVML_DEVICE_UUID_V2_BUFFER_SIZE: usize = 96;
/// Buffer size guaranteed to be large enough for `nvmlSystemGetDriverVersion`.
pub const NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE: usize = 80;
/// Buffer size guaranteed to be large enough for `nvmlSystemGetNVMLVersion`.
pub const NVML_SYSTEM_NVML_VERSION_BUFFER_SIZE: usize = 80;
/// Buffer size guaranteed to be large enough for `nvmlDeviceGetName` (legacy).
pub const NVML_DEVICE_NAME_BUFFER_SIZE: usize = 64;
/// Buffer size guaranteed to be large enough for `nvmlDeviceGetName`.
pub const NVML_DEVICE_NAME_V2_BUFFER_SIZE: usize = 96;
/// Buffer size guaranteed to be large enough for `nvmlDeviceGetSerial`.
pub const NVML_DEVICE_SERIAL_BUFFER_SIZE: usize = 30;
/// Buffer size guaranteed to be large enough for pci bus id.
pub const NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE: usize = 32;
/// Buffer size guaranteed to be large enough for pci bus id for `busIdLegacy`.
pub const NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE: usize = 16;

/// `NVML_VALUE_NOT_AVAILABLE` (`-1`) as an `unsigned long long` field holds it.
pub const NVML_VALUE_NOT_AVAILABLE: c_ulonglong = c_ulonglong::MAX;
/// `NVML_VALUE_NOT_AVAILABLE` (`-1`) as an `unsigned int` field holds it.
pub const NVML_VALUE_NOT_AVAILABLE_UINT: c_uint = c_uint::MAX;

/// What `gpuInstanceId` / `computeInstanceId` hold when MIG is not enabled.
pub const NVML_INSTANCE_ID_NONE: c_uint = 0xffff_ffff;

// ---- event types -------------------------------------------------------------------------

/// Event about single bit ECC errors.
pub const nvmlEventTypeSingleBitEccError: c_ulonglong = 0x1;
/// Event about double bit ECC errors.
pub const nvmlEventTypeDoubleBitEccError: c_ulonglong = 0x2;
/// Event about PState changes.
pub const nvmlEventTypePState: c_ulonglong = 0x4;
/// Event that Xid critical error occurred.
pub const nvmlEventTypeXidCriticalError: c_ulonglong = 0x8;
/// Event about clock changes.
pub const nvmlEventTypeClock: c_ulonglong = 0x10;
/// Event about AC/Battery power source changes.
pub const nvmlEventTypePowerSourceChange: c_ulonglong = 0x80;
/// Event about MIG configuration changes.
pub const nvmlEventMigConfigChange: c_ulonglong = 0x100;
/// Mask with no events.
pub const nvmlEventTypeNone: c_ulonglong = 0;
/// Mask of all events (as `nvml.h` defines it).
pub const nvmlEventTypeAll: c_ulonglong = nvmlEventTypeSingleBitEccError
    | nvmlEventTypeDoubleBitEccError
    | nvmlEventTypePState
    | nvmlEventTypeClock
    | nvmlEventTypeXidCriticalError
    | nvmlEventTypePowerSourceChange
    | nvmlEventMigConfigChange;

// ---- structs -----------------------------------------------------------------------------

/// `NVML_STRUCT_VERSION(name, ver)`: `sizeof(struct) | ver << 24`.
pub const fn nvml_struct_version(size: usize, ver: u32) -> c_uint {
    // Every versioned NVML struct is far smaller than 16 MiB, so the size fits the low 24 bits.
    (size as c_uint) | (ver << 24)
}

/// `nvmlMemory_t`: memory allocation information for a device (v1).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct nvmlMemory_t {
    /// Total physical device memory (in bytes).
    pub total: c_ulonglong,
    /// Unallocated device memory (in bytes).
    pub free: c_ulonglong,
    /// Sum of reserved and allocated device memory (in bytes).
    pub used: c_ulonglong,
}

/// `nvmlMemory_v2_t`: memory allocation information for a device (v2).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct nvmlMemory_v2_t {
    /// Structure format version (must be [`nvmlMemory_v2`]).
    pub version: c_uint,
    /// Total physical device memory (in bytes).
    pub total: c_ulonglong,
    /// Device memory (in bytes) reserved for system use (driver or firmware).
    pub reserved: c_ulonglong,
    /// Unallocated device memory (in bytes).
    pub free: c_ulonglong,
    /// Allocated device memory (in bytes).
    pub used: c_ulonglong,
}

/// `nvmlMemory_v2`: the version value of [`nvmlMemory_v2_t`] (`0x02000028`).
pub const nvmlMemory_v2: c_uint = nvml_struct_version(size_of::<nvmlMemory_v2_t>(), 2);

/// `nvmlProcessInfo_v1_t`: a running process (filled by the unversioned
/// `nvmlDeviceGet*RunningProcesses`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct nvmlProcessInfo_v1_t {
    /// Process ID.
    pub pid: c_uint,
    /// Amount of used GPU memory in bytes.
    pub usedGpuMemory: c_ulonglong,
}

/// `nvmlProcessInfo_t` (= `nvmlProcessInfo_v2_t` = the v3 layout): a running process,
/// filled by `nvmlDeviceGet*RunningProcesses_v2` and `_v3`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct nvmlProcessInfo_t {
    /// Process ID.
    pub pid: c_uint,
    /// Amount of used GPU memory in bytes.
    pub usedGpuMemory: c_ulonglong,
    /// GPU instance ID if MIG is enabled, else `0xFFFFFFFF`.
    pub gpuInstanceId: c_uint,
    /// Compute instance ID if MIG is enabled, else `0xFFFFFFFF`.
    pub computeInstanceId: c_uint,
}

/// `nvmlProcessInfo_v2_t`: same layout as [`nvmlProcessInfo_t`].
pub type nvmlProcessInfo_v2_t = nvmlProcessInfo_t;

/// `nvmlUtilization_t`: utilization over the past sample period.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct nvmlUtilization_t {
    /// Percent of time one or more kernels was executing on the GPU.
    pub gpu: c_uint,
    /// Percent of time global (device) memory was being read or written.
    pub memory: c_uint,
}

/// `nvmlProcessUtilizationSample_t`: one process's utilization sample.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct nvmlProcessUtilizationSample_t {
    /// PID of process.
    pub pid: c_uint,
    /// CPU timestamp in microseconds.
    pub timeStamp: c_ulonglong,
    /// SM (3D/compute) utilization.
    pub smUtil: c_uint,
    /// Frame buffer memory utilization.
    pub memUtil: c_uint,
    /// Encoder utilization.
    pub encUtil: c_uint,
    /// Decoder utilization.
    pub decUtil: c_uint,
}

/// `nvmlAccountingStats_t`: a process's accounting statistics.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct nvmlAccountingStats_t {
    /// Percent of time over the process's lifetime during which one or more kernels was
    /// executing on the GPU.
    pub gpuUtilization: c_uint,
    /// Percent of time over the process's lifetime during which global (device) memory
    /// was being read or written.
    pub memoryUtilization: c_uint,
    /// Maximum total memory in bytes that was ever allocated by the process.
    pub maxMemoryUsage: c_ulonglong,
    /// Amount of time in ms during which the compute context was active (0 while the
    /// process is running).
    pub time: c_ulonglong,
    /// CPU timestamp in µs representing the start time of the process.
    pub startTime: c_ulonglong,
    /// Flag to represent if the process is running (1 for running, 0 for terminated).
    pub isRunning: c_uint,
    /// Reserved for future use.
    pub reserved: [c_uint; 5],
}

/// `nvmlPciInfo_t` (v3 layout, filled by `nvmlDeviceGetPciInfo_v3`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct nvmlPciInfo_t {
    /// The legacy tuple domain:bus:device.function PCI identifier (`%04X:%02X:%02X.0`).
    pub busIdLegacy: [c_char; NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE],
    /// The PCI domain on which the device's bus resides, 0 to 0xffffffff.
    pub domain: c_uint,
    /// The bus on which the device resides, 0 to 0xff.
    pub bus: c_uint,
    /// The device's id on the bus, 0 to 31.
    pub device: c_uint,
    /// The combined 16-bit device id and 16-bit vendor id.
    pub pciDeviceId: c_uint,
    /// The 32-bit Sub System Device ID.
    pub pciSubSystemId: c_uint,
    /// The tuple domain:bus:device.function PCI identifier (`%08X:%02X:%02X.0`).
    pub busId: [c_char; NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE],
}

/// The older `nvmlPciInfo_t` layout filled by `nvmlDeviceGetPciInfo` and
/// `nvmlDeviceGetPciInfo_v2` (the header of that era had the 16-byte `busId` first and
/// four reserved words where v3 has its 32-byte `busId`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct nvmlPciInfo_v2_t {
    /// The tuple domain:bus:device.function PCI identifier (`%04X:%02X:%02X.0`).
    pub busId: [c_char; NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE],
    /// The PCI domain.
    pub domain: c_uint,
    /// The bus.
    pub bus: c_uint,
    /// The device's id on the bus.
    pub device: c_uint,
    /// The combined 16-bit device id and 16-bit vendor id.
    pub pciDeviceId: c_uint,
    /// The 32-bit Sub System Device ID.
    pub pciSubSystemId: c_uint,
    /// Reserved.
    pub reserved: [c_uint; 4],
}

/// `nvmlEventData_t`: information about an occurred event.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct nvmlEventData_t {
    /// Specific device where the event occurred.
    pub device: nvmlDevice_t,
    /// Information about what specific event occurred.
    pub eventType: c_ulonglong,
    /// The XID for `nvmlEventTypeXidCriticalError` (999 for an unknown XID); 0 otherwise.
    pub eventData: c_ulonglong,
    /// GPU instance the event is attributable to under MIG, else `0xFFFFFFFF`.
    pub gpuInstanceId: c_uint,
    /// Compute instance the event is attributable to under MIG, else `0xFFFFFFFF`.
    pub computeInstanceId: c_uint,
}

/// `nvmlEventData_t` as it was before the MIG fields were added: what the unversioned
/// `nvmlEventSetWait` fills (callers built against that header pass a 24-byte buffer).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct nvmlEventData_v1_t {
    /// Specific device where the event occurred.
    pub device: nvmlDevice_t,
    /// Information about what specific event occurred.
    pub eventType: c_ulonglong,
    /// The XID for `nvmlEventTypeXidCriticalError`; 0 otherwise.
    pub eventData: c_ulonglong,
}

/// PCI vendor id of NVIDIA (low 16 bits of `pciDeviceId`).
pub const PCI_VENDOR_ID_NVIDIA: c_uint = 0x10de;

// ---- topology, peer-to-peer and NVLink ---------------------------------------------------

/// `nvmlGpuTopologyLevel_t`: the common ancestor of two GPUs on the PCIe tree.
pub type nvmlGpuTopologyLevel_t = c_uint;
/// The same board (e.g. Tesla K80).
pub const NVML_TOPOLOGY_INTERNAL: nvmlGpuTopologyLevel_t = 0;
/// Devices that only need to traverse a single PCIe switch.
pub const NVML_TOPOLOGY_SINGLE: nvmlGpuTopologyLevel_t = 10;
/// Devices that need not traverse a host bridge.
pub const NVML_TOPOLOGY_MULTIPLE: nvmlGpuTopologyLevel_t = 20;
/// Devices connected to the same host bridge.
pub const NVML_TOPOLOGY_HOSTBRIDGE: nvmlGpuTopologyLevel_t = 30;
/// Devices connected to the same NUMA node, possibly through several host bridges.
pub const NVML_TOPOLOGY_NODE: nvmlGpuTopologyLevel_t = 40;
/// All devices in the system.
pub const NVML_TOPOLOGY_SYSTEM: nvmlGpuTopologyLevel_t = 50;

/// `nvmlGpuP2PCapsIndex_t`: which peer-to-peer capability `nvmlDeviceGetP2PStatus` checks.
pub type nvmlGpuP2PCapsIndex_t = c_uint;
/// Peer reads.
pub const NVML_P2P_CAPS_INDEX_READ: nvmlGpuP2PCapsIndex_t = 0;
/// Peer writes.
pub const NVML_P2P_CAPS_INDEX_WRITE: nvmlGpuP2PCapsIndex_t = 1;
/// Peer access over NVLink.
pub const NVML_P2P_CAPS_INDEX_NVLINK: nvmlGpuP2PCapsIndex_t = 2;
/// Peer atomics.
pub const NVML_P2P_CAPS_INDEX_ATOMICS: nvmlGpuP2PCapsIndex_t = 3;
/// Peer access over PCIe (`NVML_P2P_CAPS_INDEX_PROP` is its deprecated name).
pub const NVML_P2P_CAPS_INDEX_PCI: nvmlGpuP2PCapsIndex_t = 4;
/// Unknown.
pub const NVML_P2P_CAPS_INDEX_UNKNOWN: nvmlGpuP2PCapsIndex_t = 5;

/// `nvmlGpuP2PStatus_t`: the answer of `nvmlDeviceGetP2PStatus`.
pub type nvmlGpuP2PStatus_t = c_uint;
/// Supported.
pub const NVML_P2P_STATUS_OK: nvmlGpuP2PStatus_t = 0;
/// The chipset does not support it (`…_CHIPSET_NOT_SUPPORED` in the header, sic).
pub const NVML_P2P_STATUS_CHIPSET_NOT_SUPPORTED: nvmlGpuP2PStatus_t = 1;
/// The GPU does not support it.
pub const NVML_P2P_STATUS_GPU_NOT_SUPPORTED: nvmlGpuP2PStatus_t = 2;
/// The IOH topology does not support it.
pub const NVML_P2P_STATUS_IOH_TOPOLOGY_NOT_SUPPORTED: nvmlGpuP2PStatus_t = 3;
/// Disabled by a registry key.
pub const NVML_P2P_STATUS_DISABLED_BY_REGKEY: nvmlGpuP2PStatus_t = 4;
/// Not supported.
pub const NVML_P2P_STATUS_NOT_SUPPORTED: nvmlGpuP2PStatus_t = 5;
/// Unknown.
pub const NVML_P2P_STATUS_UNKNOWN: nvmlGpuP2PStatus_t = 6;

/// Most NVLinks one GPU has (`NVML_NVLINK_MAX_LINKS` up to CUDA 12; CUDA 13's header says 36).
pub const NVML_NVLINK_MAX_LINKS: c_uint = 18;

/// `nvmlNvLinkCapability_t`: what `nvmlDeviceGetNvLinkCapability` asks about a link.
pub type nvmlNvLinkCapability_t = c_uint;
/// P2P over the link is supported.
pub const NVML_NVLINK_CAP_P2P_SUPPORTED: nvmlNvLinkCapability_t = 0;
/// Access to system memory is supported.
pub const NVML_NVLINK_CAP_SYSMEM_ACCESS: nvmlNvLinkCapability_t = 1;
/// P2P atomics are supported.
pub const NVML_NVLINK_CAP_P2P_ATOMICS: nvmlNvLinkCapability_t = 2;
/// System memory atomics are supported.
pub const NVML_NVLINK_CAP_SYSMEM_ATOMICS: nvmlNvLinkCapability_t = 3;
/// SLI is supported over the link.
pub const NVML_NVLINK_CAP_SLI_BRIDGE: nvmlNvLinkCapability_t = 4;
/// The link is supported on this device.
pub const NVML_NVLINK_CAP_VALID: nvmlNvLinkCapability_t = 5;

/// `nvmlNvlinkVersion_t`: what `nvmlDeviceGetNvLinkVersion` reports.
pub type nvmlNvlinkVersion_t = c_uint;
/// NVLink 1.0.
pub const NVML_NVLINK_VERSION_1_0: nvmlNvlinkVersion_t = 1;
/// NVLink 2.0.
pub const NVML_NVLINK_VERSION_2_0: nvmlNvlinkVersion_t = 2;
/// NVLink 2.2.
pub const NVML_NVLINK_VERSION_2_2: nvmlNvlinkVersion_t = 3;
/// NVLink 3.0 (A100).
pub const NVML_NVLINK_VERSION_3_0: nvmlNvlinkVersion_t = 4;
/// NVLink 3.1.
pub const NVML_NVLINK_VERSION_3_1: nvmlNvlinkVersion_t = 5;
/// NVLink 4.0 (H100).
pub const NVML_NVLINK_VERSION_4_0: nvmlNvlinkVersion_t = 6;
/// NVLink 5.0 (B200).
pub const NVML_NVLINK_VERSION_5_0: nvmlNvlinkVersion_t = 7;

/// `nvmlIntNvLinkDeviceType_t`: what is at the far end of a link.
pub type nvmlIntNvLinkDeviceType_t = c_uint;
/// A GPU.
pub const NVML_NVLINK_DEVICE_TYPE_GPU: nvmlIntNvLinkDeviceType_t = 0;
/// An IBM NPU.
pub const NVML_NVLINK_DEVICE_TYPE_IBMNPU: nvmlIntNvLinkDeviceType_t = 1;
/// An NVSwitch.
pub const NVML_NVLINK_DEVICE_TYPE_SWITCH: nvmlIntNvLinkDeviceType_t = 2;
/// Unknown.
pub const NVML_NVLINK_DEVICE_TYPE_UNKNOWN: nvmlIntNvLinkDeviceType_t = 255;

/// `nvmlAffinityScope_t`: the scope of the CPU and memory affinity queries.
pub type nvmlAffinityScope_t = c_uint;
/// The GPU's NUMA node.
pub const NVML_AFFINITY_SCOPE_NODE: nvmlAffinityScope_t = 0;
/// The GPU's CPU socket.
pub const NVML_AFFINITY_SCOPE_SOCKET: nvmlAffinityScope_t = 1;

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{align_of, offset_of, size_of};

    #[test]
    fn memory_layouts() {
        assert_eq!(size_of::<nvmlMemory_t>(), 24);
        assert_eq!(size_of::<nvmlMemory_v2_t>(), 40);
        assert_eq!(offset_of!(nvmlMemory_v2_t, total), 8);
        assert_eq!(offset_of!(nvmlMemory_v2_t, reserved), 16);
        assert_eq!(offset_of!(nvmlMemory_v2_t, free), 24);
        assert_eq!(offset_of!(nvmlMemory_v2_t, used), 32);
        // The value nvml.h's NVML_STRUCT_VERSION(Memory, 2) yields (and pynvml hard-codes).
        assert_eq!(nvmlMemory_v2, 0x0200_0028);
    }

    #[test]
    fn process_layouts() {
        assert_eq!(size_of::<nvmlProcessInfo_v1_t>(), 16);
        assert_eq!(offset_of!(nvmlProcessInfo_v1_t, usedGpuMemory), 8);
        assert_eq!(size_of::<nvmlProcessInfo_t>(), 24);
        assert_eq!(offset_of!(nvmlProcessInfo_t, usedGpuMemory), 8);
        assert_eq!(offset_of!(nvmlProcessInfo_t, gpuInstanceId), 16);
        assert_eq!(offset_of!(nvmlProcessInfo_t, computeInstanceId), 20);
        assert_eq!(size_of::<nvmlProcessUtilizationSample_t>(), 32);
        assert_eq!(offset_of!(nvmlProcessUtilizationSample_t, timeStamp), 8);
        assert_eq!(offset_of!(nvmlProcessUtilizationSample_t, smUtil), 16);
        assert_eq!(offset_of!(nvmlProcessUtilizationSample_t, decUtil), 28);
    }

    #[test]
    fn utilization_and_accounting_layouts() {
        assert_eq!(size_of::<nvmlUtilization_t>(), 8);
        assert_eq!(size_of::<nvmlAccountingStats_t>(), 56);
        assert_eq!(offset_of!(nvmlAccountingStats_t, maxMemoryUsage), 8);
        assert_eq!(offset_of!(nvmlAccountingStats_t, time), 16);
        assert_eq!(offset_of!(nvmlAccountingStats_t, startTime), 24);
        assert_eq!(offset_of!(nvmlAccountingStats_t, isRunning), 32);
        assert_eq!(offset_of!(nvmlAccountingStats_t, reserved), 36);
    }

    #[test]
    fn pci_layouts() {
        assert_eq!(size_of::<nvmlPciInfo_t>(), 68);
        assert_eq!(align_of::<nvmlPciInfo_t>(), 4);
        assert_eq!(offset_of!(nvmlPciInfo_t, domain), 16);
        assert_eq!(offset_of!(nvmlPciInfo_t, pciSubSystemId), 32);
        assert_eq!(offset_of!(nvmlPciInfo_t, busId), 36);
        assert_eq!(size_of::<nvmlPciInfo_v2_t>(), 52);
        assert_eq!(offset_of!(nvmlPciInfo_v2_t, reserved), 36);
    }

    #[test]
    fn event_layouts() {
        assert_eq!(size_of::<nvmlEventData_t>(), 32);
        assert_eq!(offset_of!(nvmlEventData_t, eventType), 8);
        assert_eq!(offset_of!(nvmlEventData_t, eventData), 16);
        assert_eq!(offset_of!(nvmlEventData_t, gpuInstanceId), 24);
        assert_eq!(offset_of!(nvmlEventData_t, computeInstanceId), 28);
        assert_eq!(size_of::<nvmlEventData_v1_t>(), 24);
        assert_eq!(nvmlEventTypeAll, 0x19f);
    }
}
