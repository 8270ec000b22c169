//! CUDA driver API (`cuda.h`) types: result codes, handles, enums and structs.
//!
//! Handles are opaque pointers in C; here they are `*mut c_void` aliases. Only what
//! vgpu needs is declared; every value is NVIDIA's.

use std::ffi::{c_uint, c_void};

/// `CUresult`.
pub type CUresult = u32;
/// `CUdevice` (an ordinal).
pub type CUdevice = i32;
/// `CUdeviceptr` (v2: 64-bit).
pub type CUdeviceptr = u64;
/// `CUcontext`.
pub type CUcontext = *mut c_void;
/// `CUmodule`.
pub type CUmodule = *mut c_void;
/// `CUfunction`.
pub type CUfunction = *mut c_void;
/// `CUlibrary`.
pub type CUlibrary = *mut c_void;
/// `CUkernel`.
pub type CUkernel = *mut c_void;
/// `CUstream`.
pub type CUstream = *mut c_void;
/// `CUevent`.
pub type CUevent = *mut c_void;
/// `CUarray`.
pub type CUarray = *mut c_void;
/// `CUmipmappedArray`.
pub type CUmipmappedArray = *mut c_void;
/// `CUgraph`.
pub type CUgraph = *mut c_void;
/// `CUgraphNode`.
pub type CUgraphNode = *mut c_void;
/// `CUgraphExec`.
pub type CUgraphExec = *mut c_void;
/// `CUmemoryPool`.
pub type CUmemoryPool = *mut c_void;
/// `CUmemGenericAllocationHandle`.
pub type CUmemGenericAllocationHandle = u64;
/// `CUhostFn`.
pub type CUhostFn = Option<unsafe extern "C" fn(user_data: *mut c_void)>;
/// `CUstreamCallback`.
pub type CUstreamCallback =
    Option<unsafe extern "C" fn(stream: CUstream, status: CUresult, user_data: *mut c_void)>;

/// The legacy default stream handle (`CU_STREAM_LEGACY`).
pub const CU_STREAM_LEGACY: usize = 0x1;
/// The per-thread default stream handle (`CU_STREAM_PER_THREAD`).
pub const CU_STREAM_PER_THREAD: usize = 0x2;

/// Declares `CUresult` constants together with their names and descriptions.
macro_rules! results {
    ($($name:ident = $v:expr, $desc:expr;)*) => {
        $(#[doc = $desc] pub const $name: CUresult = $v;)*
        /// `(code, name, description)` of every result code, as `cuGetErrorName` and
        /// `cuGetErrorString` report them.
        pub const RESULTS: &[(CUresult, &str, &str)] = &[$(($v, stringify!($name), $desc)),*];
    };
}

results! {
    CUDA_SUCCESS = 0, "no error";
    CUDA_ERROR_INVALID_VALUE = 1, "invalid argument";
    CUDA_ERROR_OUT_OF_MEMORY = 2, "out of memory";
    CUDA_ERROR_NOT_INITIALIZED = 3, "initialization error";
    CUDA_ERROR_DEINITIALIZED = 4, "driver shutting down";
    CUDA_ERROR_PROFILER_DISABLED = 5, "profiler disabled while using external profiling tool";
    CUDA_ERROR_STUB_LIBRARY = 34, "CUDA driver is a stub library";
    CUDA_ERROR_DEVICE_UNAVAILABLE = 46, "CUDA-capable device(s) is/are busy or unavailable";
    CUDA_ERROR_NO_DEVICE = 100, "no CUDA-capable device is detected";
    CUDA_ERROR_INVALID_DEVICE = 101, "invalid device ordinal";
    CUDA_ERROR_DEVICE_NOT_LICENSED = 102, "device doesn't have valid Grid license";
    CUDA_ERROR_INVALID_IMAGE = 200, "device kernel image is invalid";
    CUDA_ERROR_INVALID_CONTEXT = 201, "invalid device context";
    CUDA_ERROR_CONTEXT_ALREADY_CURRENT = 202, "context already current";
    CUDA_ERROR_MAP_FAILED = 205, "mapping of buffer object failed";
    CUDA_ERROR_UNMAP_FAILED = 206, "unmapping of buffer object failed";
    CUDA_ERROR_ARRAY_IS_MAPPED = 207, "array is mapped";
    CUDA_ERROR_ALREADY_MAPPED = 208, "resource already mapped";
    CUDA_ERROR_NO_BINARY_FOR_GPU = 209, "no kernel image is available for execution on the device";
    CUDA_ERROR_ALREADY_ACQUIRED = 210, "resource already acquired";
    CUDA_ERROR_NOT_MAPPED = 211, "resource not mapped";
    CUDA_ERROR_NOT_MAPPED_AS_ARRAY = 212, "resource not mapped as array";
    CUDA_ERROR_NOT_MAPPED_AS_POINTER = 213, "resource not mapped as pointer";
    CUDA_ERROR_ECC_UNCORRECTABLE = 214, "uncorrectable ECC error encountered";
    CUDA_ERROR_UNSUPPORTED_LIMIT = 215, "limit is not supported on this architecture";
    CUDA_ERROR_CONTEXT_ALREADY_IN_USE = 216, "exclusive-thread device already in use by a different thread";
    CUDA_ERROR_PEER_ACCESS_UNSUPPORTED = 217, "peer access is not supported between these two devices";
    CUDA_ERROR_INVALID_PTX = 218, "a PTX JIT compilation failed";
    CUDA_ERROR_INVALID_GRAPHICS_CONTEXT = 219, "invalid OpenGL or DirectX context";
    CUDA_ERROR_NVLINK_UNCORRECTABLE = 220, "uncorrectable NVLink error detected during the execution";
    CUDA_ERROR_JIT_COMPILER_NOT_FOUND = 221, "PTX JIT compiler library not found";
    CUDA_ERROR_UNSUPPORTED_PTX_VERSION = 222, "the provided PTX was compiled with an unsupported toolchain.";
    CUDA_ERROR_JIT_COMPILATION_DISABLED = 223, "PTX JIT compilation was disabled";
    CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY = 224, "the provided execution affinity is not supported";
    CUDA_ERROR_INVALID_SOURCE = 300, "device kernel image is invalid";
    CUDA_ERROR_FILE_NOT_FOUND = 301, "file not found";
    CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND = 302, "shared object symbol not found";
    CUDA_ERROR_SHARED_OBJECT_INIT_FAILED = 303, "shared object initialization failed";
    CUDA_ERROR_OPERATING_SYSTEM = 304, "OS call failed or operation not supported on this OS";
    CUDA_ERROR_INVALID_HANDLE = 400, "invalid resource handle";
    CUDA_ERROR_ILLEGAL_STATE = 401, "the operation cannot be performed in the present state";
    CUDA_ERROR_LOSSY_QUERY = 402, "attempted introspection would be semantically lossy";
    CUDA_ERROR_NOT_FOUND = 500, "named symbol not found";
    CUDA_ERROR_NOT_READY = 600, "device not ready";
    CUDA_ERROR_ILLEGAL_ADDRESS = 700, "an illegal memory access was encountered";
    CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES = 701, "too many resources requested for launch";
    CUDA_ERROR_LAUNCH_TIMEOUT = 702, "the launch timed out and was terminated";
    CUDA_ERROR_LAUNCH_INCOMPATIBLE_TEXTURING = 703, "launch uses incompatible texturing mode";
    CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704, "peer access is already enabled";
    CUDA_ERROR_PEER_ACCESS_NOT_ENABLED = 705, "peer access has not been enabled";
    CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE = 708, "cannot set while device is active in this process";
    CUDA_ERROR_CONTEXT_IS_DESTROYED = 709, "context is destroyed";
    CUDA_ERROR_ASSERT = 710, "device-side assert triggered";
    CUDA_ERROR_TOO_MANY_PEERS = 711, "peer mapping resources exhausted";
    CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712, "part or all of the requested memory range is already mapped";
    CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713, "pointer does not correspond to a registered memory region";
    CUDA_ERROR_HARDWARE_STACK_ERROR = 714, "hardware stack error";
    CUDA_ERROR_ILLEGAL_INSTRUCTION = 715, "an illegal instruction was encountered";
    CUDA_ERROR_MISALIGNED_ADDRESS = 716, "misaligned address";
    CUDA_ERROR_INVALID_ADDRESS_SPACE = 717, "operation not supported on global/shared address space";
    CUDA_ERROR_INVALID_PC = 718, "invalid program counter";
    CUDA_ERROR_LAUNCH_FAILED = 719, "unspecified launch failure";
    CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE = 720, "too many blocks in cooperative launch";
    CUDA_ERROR_NOT_PERMITTED = 800, "operation not permitted";
    CUDA_ERROR_NOT_SUPPORTED = 801, "operation not supported";
    CUDA_ERROR_SYSTEM_NOT_READY = 802, "system not yet initialized";
    CUDA_ERROR_SYSTEM_DRIVER_MISMATCH = 803, "system has unsupported display driver / cuda driver combination";
    CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE = 804, "forward compatibility was attempted on non supported HW";
    CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900, "operation not permitted when stream is capturing";
    CUDA_ERROR_STREAM_CAPTURE_INVALIDATED = 901, "operation failed due to a previous error during capture";
    CUDA_ERROR_STREAM_CAPTURE_MERGE = 902, "operation would result in a merge of separate capture sequences";
    CUDA_ERROR_STREAM_CAPTURE_UNMATCHED = 903, "capture was not ended in the same stream as it began";
    CUDA_ERROR_STREAM_CAPTURE_UNJOINED = 904, "capturing stream has unjoined work";
    CUDA_ERROR_STREAM_CAPTURE_ISOLATION = 905, "dependency created on uncaptured work in another stream";
    CUDA_ERROR_STREAM_CAPTURE_IMPLICIT = 906, "operation would make the legacy stream depend on a capturing blocking stream";
    CUDA_ERROR_CAPTURED_EVENT = 907, "operation not permitted on an event last recorded in a capturing stream";
    CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD = 908, "attempt to terminate a thread-local capture sequence from another thread";
    CUDA_ERROR_TIMEOUT = 909, "wait operation timed out";
    CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE = 910, "the graph update was not performed because it included changes which violated constraints specific to instantiated graph update";
    CUDA_ERROR_UNKNOWN = 999, "unknown error";
}

/// Name of a result code (`CUDA_ERROR_...`), if it is one.
pub fn result_name(r: CUresult) -> Option<&'static str> {
    RESULTS.iter().find(|e| e.0 == r).map(|e| e.1)
}

/// `CUmemorytype`.
pub mod memorytype {
    /// Host memory.
    pub const HOST: u32 = 1;
    /// Device memory.
    pub const DEVICE: u32 = 2;
    /// A CUDA array.
    pub const ARRAY: u32 = 3;
    /// Unified (either, by address).
    pub const UNIFIED: u32 = 4;
}

/// `CUpointer_attribute` values.
pub mod pointer_attribute {
    /// `CU_POINTER_ATTRIBUTE_CONTEXT`.
    pub const CONTEXT: u32 = 1;
    /// `CU_POINTER_ATTRIBUTE_MEMORY_TYPE`.
    pub const MEMORY_TYPE: u32 = 2;
    /// `CU_POINTER_ATTRIBUTE_DEVICE_POINTER`.
    pub const DEVICE_POINTER: u32 = 3;
    /// `CU_POINTER_ATTRIBUTE_HOST_POINTER`.
    pub const HOST_POINTER: u32 = 4;
    /// `CU_POINTER_ATTRIBUTE_IS_MANAGED`.
    pub const IS_MANAGED: u32 = 8;
    /// `CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL`.
    pub const DEVICE_ORDINAL: u32 = 9;
    /// `CU_POINTER_ATTRIBUTE_RANGE_START_ADDR`.
    pub const RANGE_START_ADDR: u32 = 11;
    /// `CU_POINTER_ATTRIBUTE_RANGE_SIZE`.
    pub const RANGE_SIZE: u32 = 12;
    /// `CU_POINTER_ATTRIBUTE_MAPPED`.
    pub const MAPPED: u32 = 13;
}

/// `CUdevice_P2PAttribute` (`cuDeviceGetP2PAttribute`).
pub mod p2p_attr {
    /// `CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK`: relative performance of the link.
    pub const PERFORMANCE_RANK: i32 = 1;
    /// `CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED`: peer access can be enabled.
    pub const ACCESS_SUPPORTED: i32 = 2;
    /// `CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED`: native atomics over the link.
    pub const NATIVE_ATOMIC_SUPPORTED: i32 = 3;
    /// `CU_DEVICE_P2P_ATTRIBUTE_CUDA_ARRAY_ACCESS_SUPPORTED` (formerly
    /// `…_ACCESS_ACCESS_SUPPORTED`): CUDA arrays can be accessed over the link.
    pub const CUDA_ARRAY_ACCESS_SUPPORTED: i32 = 4;
    /// `CU_DEVICE_P2P_ATTRIBUTE_ONLY_PARTIAL_NATIVE_ATOMIC_SUPPORTED` (CUDA 12.8+).
    pub const ONLY_PARTIAL_NATIVE_ATOMIC_SUPPORTED: i32 = 5;
}

/// `CUdevice_attribute` values the simulator models (others read as 0).
pub mod attr {
    #![allow(missing_docs)]
    pub const MAX_THREADS_PER_BLOCK: i32 = 1;
    pub const MAX_BLOCK_DIM_X: i32 = 2;
    pub const MAX_BLOCK_DIM_Y: i32 = 3;
    pub const MAX_BLOCK_DIM_Z: i32 = 4;
    pub const MAX_GRID_DIM_X: i32 = 5;
    pub const MAX_GRID_DIM_Y: i32 = 6;
    pub const MAX_GRID_DIM_Z: i32 = 7;
    pub const MAX_SHARED_MEMORY_PER_BLOCK: i32 = 8;
    pub const TOTAL_CONSTANT_MEMORY: i32 = 9;
    pub const WARP_SIZE: i32 = 10;
    pub const MAX_PITCH: i32 = 11;
    pub const MAX_REGISTERS_PER_BLOCK: i32 = 12;
    pub const CLOCK_RATE: i32 = 13;
    pub const TEXTURE_ALIGNMENT: i32 = 14;
    pub const GPU_OVERLAP: i32 = 15;
    pub const MULTIPROCESSOR_COUNT: i32 = 16;
    pub const KERNEL_EXEC_TIMEOUT: i32 = 17;
    pub const INTEGRATED: i32 = 18;
    pub const CAN_MAP_HOST_MEMORY: i32 = 19;
    pub const COMPUTE_MODE: i32 = 20;
    pub const MAXIMUM_TEXTURE1D_WIDTH: i32 = 21;
    pub const MAXIMUM_TEXTURE2D_WIDTH: i32 = 22;
    pub const MAXIMUM_TEXTURE2D_HEIGHT: i32 = 23;
    pub const MAXIMUM_TEXTURE3D_WIDTH: i32 = 24;
    pub const MAXIMUM_TEXTURE3D_HEIGHT: i32 = 25;
    pub const MAXIMUM_TEXTURE3D_DEPTH: i32 = 26;
    pub const CONCURRENT_KERNELS: i32 = 31;
    pub const ECC_ENABLED: i32 = 32;
    pub const PCI_BUS_ID: i32 = 33;
    pub const PCI_DEVICE_ID: i32 = 34;
    pub const TCC_DRIVER: i32 = 35;
    pub const MEMORY_CLOCK_RATE: i32 = 36;
    pub const GLOBAL_MEMORY_BUS_WIDTH: i32 = 37;
    pub const L2_CACHE_SIZE: i32 = 38;
    pub const MAX_THREADS_PER_MULTIPROCESSOR: i32 = 39;
    pub const ASYNC_ENGINE_COUNT: i32 = 40;
    pub const UNIFIED_ADDRESSING: i32 = 41;
    pub const PCI_DOMAIN_ID: i32 = 50;
    pub const COMPUTE_CAPABILITY_MAJOR: i32 = 75;
    pub const COMPUTE_CAPABILITY_MINOR: i32 = 76;
    pub const STREAM_PRIORITIES_SUPPORTED: i32 = 78;
    pub const GLOBAL_L1_CACHE_SUPPORTED: i32 = 79;
    pub const LOCAL_L1_CACHE_SUPPORTED: i32 = 80;
    pub const MAXIMUM_TEXTURE2D_MIPMAPPED_WIDTH: i32 = 73;
    pub const MAXIMUM_TEXTURE2D_MIPMAPPED_HEIGHT: i32 = 74;
    pub const MAXIMUM_TEXTURE1D_MIPMAPPED_WIDTH: i32 = 77;
    pub const MAX_SHARED_MEMORY_PER_MULTIPROCESSOR: i32 = 81;
    pub const MAX_REGISTERS_PER_MULTIPROCESSOR: i32 = 82;
    pub const MANAGED_MEMORY: i32 = 83;
    pub const MULTI_GPU_BOARD: i32 = 84;
    pub const CONCURRENT_MANAGED_ACCESS: i32 = 89;
    pub const COMPUTE_PREEMPTION_SUPPORTED: i32 = 90;
    pub const COOPERATIVE_LAUNCH: i32 = 95;
    pub const MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: i32 = 97;
    pub const VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: i32 = 102;
    pub const HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED: i32 = 103;
    pub const MAX_BLOCKS_PER_MULTIPROCESSOR: i32 = 106;
    pub const MEMORY_POOLS_SUPPORTED: i32 = 115;
    pub const CLUSTER_LAUNCH: i32 = 120;
    /// `CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1` (the v1 memory operations).
    pub const CAN_USE_STREAM_MEM_OPS_V1: i32 = 92;
    /// `CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS_V1`.
    pub const CAN_USE_64_BIT_STREAM_MEM_OPS_V1: i32 = 93;
    /// `CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR_V1`.
    pub const CAN_USE_STREAM_WAIT_VALUE_NOR_V1: i32 = 94;
    pub const CAN_FLUSH_REMOTE_WRITES: i32 = 98;
    /// `CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS` (CUDA 12).
    pub const CAN_USE_64_BIT_STREAM_MEM_OPS: i32 = 122;
    /// `CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR` (CUDA 12).
    pub const CAN_USE_STREAM_WAIT_VALUE_NOR: i32 = 123;
    /// One past the highest attribute value the simulator accepts.
    pub const MAX: i32 = 160;
}

/// Stream memory operations (`cuStreamWaitValue32`, `cuStreamWriteValue32`,
/// `cuStreamBatchMemOp` and their 64-bit forms): `CUstreamWaitValue_flags`,
/// `CUstreamWriteValue_flags` and `CUstreamBatchMemOpType`.
pub mod memop {
    #![allow(missing_docs)]
    /// Wait until `(int32_t)(*addr - value) >= 0` (cyclic; `int64_t` for 64 bits).
    pub const WAIT_VALUE_GEQ: u32 = 0;
    /// Wait until `*addr == value`.
    pub const WAIT_VALUE_EQ: u32 = 1;
    /// Wait until `(*addr & value) != 0`.
    pub const WAIT_VALUE_AND: u32 = 2;
    /// Wait until `~(*addr | value) != 0`.
    pub const WAIT_VALUE_NOR: u32 = 3;
    /// Flush outstanding remote writes after the wait.
    pub const WAIT_VALUE_FLUSH: u32 = 1 << 30;
    pub const WRITE_VALUE_DEFAULT: u32 = 0;
    /// v1 only: the write may be reordered with earlier writes.
    pub const WRITE_VALUE_NO_MEMORY_BARRIER: u32 = 1;
    pub const OP_WAIT_VALUE_32: u32 = 1;
    pub const OP_WRITE_VALUE_32: u32 = 2;
    pub const OP_FLUSH_REMOTE_WRITES: u32 = 3;
    pub const OP_WAIT_VALUE_64: u32 = 4;
    pub const OP_WRITE_VALUE_64: u32 = 5;
    pub const OP_BARRIER: u32 = 6;
}

/// `CUstreamBatchMemOpParams` (48 bytes): a union whose wait and write members share one
/// layout (`operation`, `address`, `value`/`value64`, `flags`, `alias`); the barrier
/// and flush members keep their flags in `word1`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct CUstreamBatchMemOpParams {
    /// `CUstreamBatchMemOpType`.
    pub operation: u32,
    /// `memoryBarrier.flags` / `flushRemoteWrites.flags`.
    pub word1: u32,
    /// `waitValue.address` / `writeValue.address`.
    pub address: CUdeviceptr,
    /// `value` (low 32 bits) or `value64`.
    pub value: u64,
    /// `waitValue.flags` / `writeValue.flags`.
    pub flags: u32,
    pub pad0: u32,
    /// `alias` (unused by the driver).
    pub alias: CUdeviceptr,
    pub pad1: u64,
}

/// `CUDA_MEMCPY2D` (v2).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CUDA_MEMCPY2D {
    pub srcXInBytes: usize,
    pub srcY: usize,
    pub srcMemoryType: u32,
    pub srcHost: *const c_void,
    pub srcDevice: CUdeviceptr,
    pub srcArray: CUarray,
    pub srcPitch: usize,
    pub dstXInBytes: usize,
    pub dstY: usize,
    pub dstMemoryType: u32,
    pub dstHost: *mut c_void,
    pub dstDevice: CUdeviceptr,
    pub dstArray: CUarray,
    pub dstPitch: usize,
    pub WidthInBytes: usize,
    pub Height: usize,
}

/// `CUDA_ARRAY_DESCRIPTOR` (v2).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CUDA_ARRAY_DESCRIPTOR {
    pub Width: usize,
    pub Height: usize,
    pub Format: u32,
    pub NumChannels: c_uint,
}

/// `CUDA_ARRAY3D_DESCRIPTOR` (v2).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CUDA_ARRAY3D_DESCRIPTOR {
    pub Width: usize,
    pub Height: usize,
    pub Depth: usize,
    pub Format: u32,
    pub NumChannels: c_uint,
    pub Flags: c_uint,
}

/// Bytes per channel element of a `CUarray_format`, if it is a plain format.
pub fn array_format_bytes(f: u32) -> Option<u64> {
    match f {
        0x01 | 0x08 => Some(1),        // UNSIGNED_INT8, SIGNED_INT8
        0x02 | 0x09 | 0x10 => Some(2), // UNSIGNED_INT16, SIGNED_INT16, HALF
        0x03 | 0x0a | 0x20 => Some(4), // UNSIGNED_INT32, SIGNED_INT32, FLOAT
        _ => None,
    }
}

/// `CUmemLocation`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CUmemLocation {
    /// `CU_MEM_LOCATION_TYPE_DEVICE` = 1.
    pub type_: u32,
    pub id: i32,
}

/// `CU_MEM_LOCATION_TYPE_DEVICE`: `id` is a device ordinal.
pub const CU_MEM_LOCATION_TYPE_DEVICE: u32 = 1;
/// `CU_MEM_LOCATION_TYPE_HOST` (CUDA 12.2): host memory of no particular NUMA node
/// (`id` ignored).
pub const CU_MEM_LOCATION_TYPE_HOST: u32 = 2;
/// `CU_MEM_LOCATION_TYPE_HOST_NUMA` (CUDA 12.2): host memory of NUMA node `id`.
pub const CU_MEM_LOCATION_TYPE_HOST_NUMA: u32 = 3;
/// `CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT` (CUDA 12.2): the calling thread's NUMA node.
pub const CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT: u32 = 4;
/// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`: a VMM allocation exportable as a file
/// descriptor (`CUmemAllocationHandleType`).
pub const CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR: u32 = 1;
/// `CU_MEM_HANDLE_TYPE_FABRIC` (CUDA 12.3): exportable as a 64-byte fabric handle.
pub const CU_MEM_HANDLE_TYPE_FABRIC: u32 = 8;
/// `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`, the one flag of `cuIpcOpenMemHandle`.
pub const CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS: u32 = 1;
/// `CU_IPC_HANDLE_SIZE`: bytes of a `CUipcMemHandle`.
pub const CU_IPC_HANDLE_SIZE: usize = 64;

/// `CUipcMemHandle`: an opaque 64-byte handle passed by value.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CUipcMemHandle {
    pub reserved: [u8; CU_IPC_HANDLE_SIZE],
}
/// `CU_MEM_ALLOCATION_TYPE_PINNED`.
pub const CU_MEM_ALLOCATION_TYPE_PINNED: u32 = 1;

/// `CUmemAllocationProp` (v1).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CUmemAllocationProp {
    pub type_: u32,
    pub requestedHandleTypes: u32,
    pub location: CUmemLocation,
    pub win32HandleMetaData: *mut c_void,
    pub allocFlags: [u8; 8],
}

/// `CUmemAccessDesc`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CUmemAccessDesc {
    pub location: CUmemLocation,
    /// `CU_MEM_ACCESS_FLAGS_PROT_NONE` 0, `_READ` 1, `_READWRITE` 3.
    pub flags: u32,
}

/// `CUmemPoolProps` (v1); only the leading fields are read.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CUmemPoolProps {
    pub allocType: u32,
    pub handleTypes: u32,
    pub location: CUmemLocation,
    pub win32SecurityAttributes: *mut c_void,
    pub maxSize: usize,
    pub usage: u16,
    pub reserved: [u8; 54],
}

/// `CUmemPool_attribute` values.
pub mod mempool_attr {
    #![allow(missing_docs)]
    pub const REUSE_FOLLOW_EVENT_DEPENDENCIES: i32 = 1;
    pub const REUSE_ALLOW_OPPORTUNISTIC: i32 = 2;
    pub const REUSE_ALLOW_INTERNAL_DEPENDENCIES: i32 = 3;
    pub const RELEASE_THRESHOLD: i32 = 4;
    pub const RESERVED_MEM_CURRENT: i32 = 5;
    pub const RESERVED_MEM_HIGH: i32 = 6;
    pub const USED_MEM_CURRENT: i32 = 7;
    pub const USED_MEM_HIGH: i32 = 8;
}

/// `CUlaunchAttribute` (id, padding, 64-byte value union).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CUlaunchAttribute {
    pub id: u32,
    pub pad: [u8; 4],
    pub value: [u8; 64],
}

/// `CU_LAUNCH_ATTRIBUTE_COOPERATIVE`.
pub const CU_LAUNCH_ATTRIBUTE_COOPERATIVE: u32 = 2;

/// `CUlaunchConfig`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CUlaunchConfig {
    pub gridDimX: c_uint,
    pub gridDimY: c_uint,
    pub gridDimZ: c_uint,
    pub blockDimX: c_uint,
    pub blockDimY: c_uint,
    pub blockDimZ: c_uint,
    pub sharedMemBytes: c_uint,
    pub hStream: CUstream,
    pub attrs: *mut CUlaunchAttribute,
    pub numAttrs: c_uint,
}

/// `CUuuid`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct CUuuid {
    pub bytes: [u8; 16],
}

/// `CUprocessState` (CUDA 12.8): a process's state under the checkpoint API.
pub mod process_state {
    /// `CU_PROCESS_STATE_RUNNING`: the default; CUDA calls run.
    pub const RUNNING: u32 = 0;
    /// `CU_PROCESS_STATE_LOCKED`: CUDA API locks are taken, further calls block.
    pub const LOCKED: u32 = 1;
    /// `CU_PROCESS_STATE_CHECKPOINTED`: device memory is in host memory, device
    /// allocations and handles are released.
    pub const CHECKPOINTED: u32 = 2;
    /// `CU_PROCESS_STATE_FAILED`: an uncorrectable error during checkpoint or restore.
    pub const FAILED: u32 = 3;
}

/// `CUcheckpointLockArgs` (CUDA 12.8).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct CUcheckpointLockArgs {
    /// Milliseconds to try to lock the process for; 0: no timeout.
    pub timeoutMs: c_uint,
    /// Must be zero.
    pub reserved0: c_uint,
    /// Must be zeroed.
    pub reserved1: [u64; 7],
}

/// `CUcheckpointCheckpointArgs` (CUDA 13: the custom-storage out-pointer first; CUDA
/// 12.8 had 64 reserved bytes, so a zeroed 12.8 struct reads as no custom storage).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CUcheckpointCheckpointArgs {
    /// `CUcheckpointCustomStorageInfo **customStorageInfo_out`: NULL checkpoints to host.
    pub customStorageInfo_out: *mut *mut c_void,
    /// Must be zeroed.
    pub reserved: [u8; 56],
}

/// `CUcheckpointGpuPair`: a GPU to restore onto another.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct CUcheckpointGpuPair {
    /// The GPU that was checkpointed.
    pub oldUuid: CUuuid,
    /// The GPU to restore onto.
    pub newUuid: CUuuid,
}

/// `CUcheckpointRestoreArgs` (CUDA 13 layout, 64 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CUcheckpointRestoreArgs {
    /// GPU remapping pairs (NULL: restore onto the same GPUs).
    pub gpuPairs: *mut CUcheckpointGpuPair,
    /// Number of pairs.
    pub gpuPairsCount: c_uint,
    /// Alignment padding.
    pub padding0: c_uint,
    /// `CUcheckpointCustomStorageInfo **customStorageInfo_out`: NULL restores from host.
    pub customStorageInfo_out: *mut *mut c_void,
    /// Must be zeroed.
    pub reserved: [u8; 40],
}

/// `CUcheckpointUnlockArgs` (CUDA 12.8).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct CUcheckpointUnlockArgs {
    /// Must be zeroed.
    pub reserved: [u64; 8],
}

/// `cuGetProcAddress` flags.
pub mod proc_flags {
    /// `CU_GET_PROC_ADDRESS_DEFAULT`.
    pub const DEFAULT: u64 = 0;
    /// `CU_GET_PROC_ADDRESS_LEGACY_STREAM`.
    pub const LEGACY_STREAM: u64 = 1;
    /// `CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM`.
    pub const PER_THREAD_DEFAULT_STREAM: u64 = 2;
}

/// `CUdriverProcAddressQueryResult`.
pub mod proc_status {
    /// `CU_GET_PROC_ADDRESS_SUCCESS`.
    pub const SUCCESS: i32 = 0;
    /// `CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND`.
    pub const SYMBOL_NOT_FOUND: i32 = 1;
    /// `CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT`.
    pub const VERSION_NOT_SUFFICIENT: i32 = 2;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_match_cuda_h() {
        assert_eq!(size_of::<CUDA_MEMCPY2D>(), 128);
        assert_eq!(size_of::<CUDA_ARRAY_DESCRIPTOR>(), 24);
        assert_eq!(size_of::<CUDA_ARRAY3D_DESCRIPTOR>(), 40);
        assert_eq!(size_of::<CUmemAllocationProp>(), 32);
        assert_eq!(size_of::<CUmemAccessDesc>(), 12);
        assert_eq!(size_of::<CUmemPoolProps>(), 88);
        assert_eq!(size_of::<CUlaunchAttribute>(), 72);
        assert_eq!(std::mem::offset_of!(CUlaunchConfig, hStream), 32);
        assert_eq!(size_of::<CUlaunchConfig>(), 56);
        assert_eq!(size_of::<CUstreamBatchMemOpParams>(), 48);
        assert_eq!(std::mem::offset_of!(CUstreamBatchMemOpParams, flags), 24);
        // The checkpoint API's argument structs are 64 bytes each.
        assert_eq!(size_of::<CUcheckpointLockArgs>(), 64);
        assert_eq!(size_of::<CUcheckpointCheckpointArgs>(), 64);
        assert_eq!(size_of::<CUcheckpointRestoreArgs>(), 64);
        assert_eq!(
            std::mem::offset_of!(CUcheckpointRestoreArgs, customStorageInfo_out),
            16
        );
        assert_eq!(size_of::<CUcheckpointUnlockArgs>(), 64);
        assert_eq!(size_of::<CUcheckpointGpuPair>(), 32);
    }

    #[test]
    fn result_names_are_unique() {
        for (i, a) in RESULTS.iter().enumerate() {
            for b in &RESULTS[i + 1..] {
                assert_ne!(a.0, b.0, "{} and {}", a.1, b.1);
            }
        }
        assert_eq!(
            result_name(CUDA_ERROR_OUT_OF_MEMORY),
            Some("CUDA_ERROR_OUT_OF_MEMORY")
        );
    }
}
