//! The C signatures of the driver API and NVML entry points that the shim intercepts or
//! calls, as function-pointer types (`PFN_` and the exported symbol, as in NVIDIA's
//! `cudaTypedefs.h`), from `cuda.h` and `nvml.h`.
//!
//! Both sides are checked against them at compile time: the shim's hooks and the real
//! functions it calls, and the simulated driver's exports (`const _: PFN_x = x;`), so a
//! signature that drifts on either side fails the build. A `_ptsz`/`_ptds` variant has
//! its base symbol's signature, and so has the first version of a symbol whose `_v2`
//! only changed behaviour (`cuCtxDestroy`, `cuDevicePrimaryCtxRelease`, ...): those use
//! the one type named here. Compatibility rule: a published type never changes; a new
//! ABI version gets a new type.

use std::ffi::{c_char, c_int, c_uint, c_ulong, c_void};

use crate::cuda::{
    CUDA_ARRAY_DESCRIPTOR, CUDA_ARRAY3D_DESCRIPTOR, CUarray, CUcontext, CUdevice, CUdeviceptr,
    CUevent, CUfunction, CUgraph, CUgraphExec, CUgraphNode, CUhostFn, CUipcMemHandle,
    CUlaunchConfig, CUmemAllocationProp, CUmemGenericAllocationHandle, CUmemPoolProps,
    CUmemoryPool, CUmipmappedArray, CUresult, CUstream, CUstreamBatchMemOpParams, CUuuid,
};
use crate::nvml::{
    nvmlAffinityScope_t, nvmlDevice_t, nvmlEnableState_t, nvmlGpuP2PCapsIndex_t,
    nvmlGpuP2PStatus_t, nvmlGpuTopologyLevel_t, nvmlIntNvLinkDeviceType_t, nvmlMemory_t,
    nvmlMemory_v2_t, nvmlNvLinkCapability_t, nvmlPciInfo_t, nvmlPciInfo_v2_t, nvmlProcessInfo_t,
    nvmlProcessInfo_v1_t, nvmlProcessInfo_v2_t, nvmlProcessUtilizationSample_t, nvmlReturn_t,
};

// ---- CUDA driver API: initialisation and entry points ---------------------------------

/// `cuInit(unsigned int Flags)`.
pub type PFN_cuInit = unsafe extern "C" fn(c_uint) -> CUresult;
/// `cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags)`.
pub type PFN_cuGetProcAddress =
    unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64) -> CUresult;
/// `cuGetProcAddress_v2(symbol, pfn, cudaVersion, flags,
/// CUdriverProcAddressQueryResult *symbolStatus)`.
pub type PFN_cuGetProcAddress_v2 =
    unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int) -> CUresult;

// ---- devices -----------------------------------------------------------------------------

/// `cuDeviceGetCount(int *count)`.
pub type PFN_cuDeviceGetCount = unsafe extern "C" fn(*mut c_int) -> CUresult;
/// `cuDeviceGetUuid(CUuuid *uuid, CUdevice dev)` (also `_v2`).
pub type PFN_cuDeviceGetUuid = unsafe extern "C" fn(*mut CUuuid, CUdevice) -> CUresult;
/// `cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)`.
pub type PFN_cuDeviceTotalMem_v2 = unsafe extern "C" fn(*mut usize, CUdevice) -> CUresult;
/// `cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice dev)`.
pub type PFN_cuDeviceGetMemPool = unsafe extern "C" fn(*mut CUmemoryPool, CUdevice) -> CUresult;

/// `cuDeviceCanAccessPeer(int *canAccessPeer, CUdevice dev, CUdevice peerDev)`.
pub type PFN_cuDeviceCanAccessPeer =
    unsafe extern "C" fn(*mut c_int, CUdevice, CUdevice) -> CUresult;
/// `cuDeviceGetP2PAttribute(int *value, CUdevice_P2PAttribute attrib, CUdevice srcDevice,
/// CUdevice dstDevice)`.
pub type PFN_cuDeviceGetP2PAttribute =
    unsafe extern "C" fn(*mut c_int, c_int, CUdevice, CUdevice) -> CUresult;

// ---- memory ------------------------------------------------------------------------------

/// `cuMemGetInfo_v2(size_t *free, size_t *total)`.
pub type PFN_cuMemGetInfo_v2 = unsafe extern "C" fn(*mut usize, *mut usize) -> CUresult;
/// `cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)`.
pub type PFN_cuMemAlloc_v2 = unsafe extern "C" fn(*mut CUdeviceptr, usize) -> CUresult;
/// `cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes,
/// size_t Height, unsigned int ElementSizeBytes)`.
pub type PFN_cuMemAllocPitch_v2 =
    unsafe extern "C" fn(*mut CUdeviceptr, *mut usize, usize, usize, c_uint) -> CUresult;
/// `cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags)`.
pub type PFN_cuMemAllocManaged = unsafe extern "C" fn(*mut CUdeviceptr, usize, c_uint) -> CUresult;
/// `cuMemFree_v2(CUdeviceptr dptr)`.
pub type PFN_cuMemFree_v2 = unsafe extern "C" fn(CUdeviceptr) -> CUresult;
/// `cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)` (also `_ptsz`).
pub type PFN_cuMemAllocAsync = unsafe extern "C" fn(*mut CUdeviceptr, usize, CUstream) -> CUresult;
/// `cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
/// CUstream hStream)` (also `_ptsz`).
pub type PFN_cuMemAllocFromPoolAsync =
    unsafe extern "C" fn(*mut CUdeviceptr, usize, CUmemoryPool, CUstream) -> CUresult;
/// `cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream)` (also `_ptsz`).
pub type PFN_cuMemFreeAsync = unsafe extern "C" fn(CUdeviceptr, CUstream) -> CUresult;
/// `cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *poolProps)`.
pub type PFN_cuMemPoolCreate =
    unsafe extern "C" fn(*mut CUmemoryPool, *const CUmemPoolProps) -> CUresult;
/// `cuMemPoolDestroy(CUmemoryPool pool)`.
pub type PFN_cuMemPoolDestroy = unsafe extern "C" fn(CUmemoryPool) -> CUresult;
/// `cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep)`.
pub type PFN_cuMemPoolTrimTo = unsafe extern "C" fn(CUmemoryPool, usize) -> CUresult;
/// `cuMemPoolSetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value)`.
pub type PFN_cuMemPoolSetAttribute =
    unsafe extern "C" fn(CUmemoryPool, c_int, *mut c_void) -> CUresult;
/// `cuMemPoolGetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value)`.
pub type PFN_cuMemPoolGetAttribute =
    unsafe extern "C" fn(CUmemoryPool, c_int, *mut c_void) -> CUresult;
/// `cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
/// const CUmemAllocationProp *prop, unsigned long long flags)`.
pub type PFN_cuMemCreate = unsafe extern "C" fn(
    *mut CUmemGenericAllocationHandle,
    usize,
    *const CUmemAllocationProp,
    u64,
) -> CUresult;
/// `cuMemRelease(CUmemGenericAllocationHandle handle)`.
pub type PFN_cuMemRelease = unsafe extern "C" fn(CUmemGenericAllocationHandle) -> CUresult;
/// `cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
/// CUmemGenericAllocationHandle handle, unsigned long long flags)`.
pub type PFN_cuMemMap =
    unsafe extern "C" fn(CUdeviceptr, usize, usize, CUmemGenericAllocationHandle, u64) -> CUresult;
/// `cuMemUnmap(CUdeviceptr ptr, size_t size)`.
pub type PFN_cuMemUnmap = unsafe extern "C" fn(CUdeviceptr, usize) -> CUresult;
/// `cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr)`.
pub type PFN_cuMemRetainAllocationHandle =
    unsafe extern "C" fn(*mut CUmemGenericAllocationHandle, *mut c_void) -> CUresult;
/// `cuMemExportToShareableHandle(void *shareableHandle, CUmemGenericAllocationHandle
/// handle, CUmemAllocationHandleType handleType, unsigned long long flags)`.
pub type PFN_cuMemExportToShareableHandle =
    unsafe extern "C" fn(*mut c_void, CUmemGenericAllocationHandle, c_uint, u64) -> CUresult;
/// `cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle,
/// void *osHandle, CUmemAllocationHandleType shHandleType)`.
pub type PFN_cuMemImportFromShareableHandle =
    unsafe extern "C" fn(*mut CUmemGenericAllocationHandle, *mut c_void, c_uint) -> CUresult;
/// `cuIpcGetMemHandle(CUipcMemHandle *pHandle, CUdeviceptr dptr)`.
pub type PFN_cuIpcGetMemHandle = unsafe extern "C" fn(*mut CUipcMemHandle, CUdeviceptr) -> CUresult;
/// `cuIpcOpenMemHandle_v2(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int
/// Flags)` (the handle by value; also the unversioned symbol).
pub type PFN_cuIpcOpenMemHandle_v2 =
    unsafe extern "C" fn(*mut CUdeviceptr, CUipcMemHandle, c_uint) -> CUresult;
/// `cuIpcCloseMemHandle(CUdeviceptr dptr)`.
pub type PFN_cuIpcCloseMemHandle = unsafe extern "C" fn(CUdeviceptr) -> CUresult;
/// `cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
/// CUmemAllocationGranularity_flags option)`.
pub type PFN_cuMemGetAllocationGranularity =
    unsafe extern "C" fn(*mut usize, *const CUmemAllocationProp, c_int) -> CUresult;
/// `cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *pAllocateArray)`.
pub type PFN_cuArrayCreate_v2 =
    unsafe extern "C" fn(*mut CUarray, *const CUDA_ARRAY_DESCRIPTOR) -> CUresult;
/// `cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *pAllocateArray)`.
pub type PFN_cuArray3DCreate_v2 =
    unsafe extern "C" fn(*mut CUarray, *const CUDA_ARRAY3D_DESCRIPTOR) -> CUresult;
/// `cuArrayDestroy(CUarray hArray)`.
pub type PFN_cuArrayDestroy = unsafe extern "C" fn(CUarray) -> CUresult;
/// `cuMipmappedArrayCreate(CUmipmappedArray *pHandle,
/// const CUDA_ARRAY3D_DESCRIPTOR *pMipmappedArrayDesc, unsigned int numMipmapLevels)`.
pub type PFN_cuMipmappedArrayCreate =
    unsafe extern "C" fn(*mut CUmipmappedArray, *const CUDA_ARRAY3D_DESCRIPTOR, c_uint) -> CUresult;
/// `cuMipmappedArrayDestroy(CUmipmappedArray hMipmappedArray)`.
pub type PFN_cuMipmappedArrayDestroy = unsafe extern "C" fn(CUmipmappedArray) -> CUresult;

// ---- contexts ----------------------------------------------------------------------------

/// `cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)`.
pub type PFN_cuDevicePrimaryCtxRetain = unsafe extern "C" fn(*mut CUcontext, CUdevice) -> CUresult;
/// `cuDevicePrimaryCtxRelease_v2(CUdevice dev)` (and the first version).
pub type PFN_cuDevicePrimaryCtxRelease_v2 = unsafe extern "C" fn(CUdevice) -> CUresult;
/// `cuDevicePrimaryCtxReset_v2(CUdevice dev)` (and the first version).
pub type PFN_cuDevicePrimaryCtxReset_v2 = unsafe extern "C" fn(CUdevice) -> CUresult;
/// `cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev)`.
pub type PFN_cuCtxCreate_v2 = unsafe extern "C" fn(*mut CUcontext, c_uint, CUdevice) -> CUresult;
/// `cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *paramsArray, int numParams,
/// unsigned int flags, CUdevice dev)`.
pub type PFN_cuCtxCreate_v3 =
    unsafe extern "C" fn(*mut CUcontext, *mut c_void, c_int, c_uint, CUdevice) -> CUresult;
/// `cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *ctxCreateParams,
/// unsigned int flags, CUdevice dev)`.
pub type PFN_cuCtxCreate_v4 =
    unsafe extern "C" fn(*mut CUcontext, *mut c_void, c_uint, CUdevice) -> CUresult;
/// `cuCtxDestroy_v2(CUcontext ctx)` (and the first version).
pub type PFN_cuCtxDestroy_v2 = unsafe extern "C" fn(CUcontext) -> CUresult;
/// `cuCtxGetCurrent(CUcontext *pctx)`.
pub type PFN_cuCtxGetCurrent = unsafe extern "C" fn(*mut CUcontext) -> CUresult;
/// `cuCtxGetDevice(CUdevice *device)`.
pub type PFN_cuCtxGetDevice = unsafe extern "C" fn(*mut CUdevice) -> CUresult;
/// `cuCtxPushCurrent_v2(CUcontext ctx)`.
pub type PFN_cuCtxPushCurrent_v2 = unsafe extern "C" fn(CUcontext) -> CUresult;
/// `cuCtxPopCurrent_v2(CUcontext *pctx)`.
pub type PFN_cuCtxPopCurrent_v2 = unsafe extern "C" fn(*mut CUcontext) -> CUresult;
/// `cuCtxSetCurrent(CUcontext ctx)`.
pub type PFN_cuCtxSetCurrent = unsafe extern "C" fn(CUcontext) -> CUresult;
/// `cuCtxSynchronize(void)`.
pub type PFN_cuCtxSynchronize = unsafe extern "C" fn() -> CUresult;
/// `cuCtxSynchronize_v2(CUcontext ctx)` (CUDA 13).
pub type PFN_cuCtxSynchronize_v2 = unsafe extern "C" fn(CUcontext) -> CUresult;

/// `cuCtxEnablePeerAccess(CUcontext peerContext, unsigned int Flags)`.
pub type PFN_cuCtxEnablePeerAccess = unsafe extern "C" fn(CUcontext, c_uint) -> CUresult;
/// `cuCtxDisablePeerAccess(CUcontext peerContext)`.
pub type PFN_cuCtxDisablePeerAccess = unsafe extern "C" fn(CUcontext) -> CUresult;
/// `cuMemcpyPeer(CUdeviceptr dstDevice, CUcontext dstContext, CUdeviceptr srcDevice,
/// CUcontext srcContext, size_t ByteCount)` (also `_ptds`).
pub type PFN_cuMemcpyPeer =
    unsafe extern "C" fn(CUdeviceptr, CUcontext, CUdeviceptr, CUcontext, usize) -> CUresult;
/// `cuMemcpyPeerAsync(dstDevice, dstContext, srcDevice, srcContext, ByteCount,
/// CUstream hStream)` (also `_ptsz`).
pub type PFN_cuMemcpyPeerAsync = unsafe extern "C" fn(
    CUdeviceptr,
    CUcontext,
    CUdeviceptr,
    CUcontext,
    usize,
    CUstream,
) -> CUresult;

// ---- streams, events, launches -------------------------------------------------------------

/// `cuStreamSynchronize(CUstream hStream)` (also `_ptsz`).
pub type PFN_cuStreamSynchronize = unsafe extern "C" fn(CUstream) -> CUresult;
/// `cuStreamCreate(CUstream *phStream, unsigned int Flags)`.
pub type PFN_cuStreamCreate = unsafe extern "C" fn(*mut CUstream, c_uint) -> CUresult;
/// `cuLaunchHostFunc(CUstream hStream, CUhostFn fn, void *userData)` (also `_ptsz`).
pub type PFN_cuLaunchHostFunc = unsafe extern "C" fn(CUstream, CUhostFn, *mut c_void) -> CUresult;
/// `cuStreamWaitValue32_v2(CUstream stream, CUdeviceptr addr, cuuint32_t value, unsigned
/// int flags)` (also `_ptsz`, and the v1 `cuStreamWaitValue32`), and
/// `cuStreamWriteValue32_v2` (and v1) of the same signature.
pub type PFN_cuStreamWaitValue32_v2 =
    unsafe extern "C" fn(CUstream, CUdeviceptr, u32, c_uint) -> CUresult;
/// `cuStreamWaitValue64_v2(CUstream stream, CUdeviceptr addr, cuuint64_t value, unsigned
/// int flags)` (also `_ptsz`, v1), and `cuStreamWriteValue64_v2` (and v1).
pub type PFN_cuStreamWaitValue64_v2 =
    unsafe extern "C" fn(CUstream, CUdeviceptr, u64, c_uint) -> CUresult;
/// `cuStreamBatchMemOp_v2(CUstream stream, unsigned int count, CUstreamBatchMemOpParams
/// *paramArray, unsigned int flags)` (also `_ptsz`, v1).
pub type PFN_cuStreamBatchMemOp_v2 =
    unsafe extern "C" fn(CUstream, c_uint, *mut CUstreamBatchMemOpParams, c_uint) -> CUresult;
/// `cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount, CUstream
/// hStream)` (also `_ptsz`).
pub type PFN_cuMemcpyDtoDAsync_v2 =
    unsafe extern "C" fn(CUdeviceptr, CUdeviceptr, usize, CUstream) -> CUresult;
/// `cuEventElapsedTime(float *pMilliseconds, CUevent hStart, CUevent hEnd)` (also `_v2`).
pub type PFN_cuEventElapsedTime = unsafe extern "C" fn(*mut f32, CUevent, CUevent) -> CUresult;
/// `cuEventCreate(CUevent *phEvent, unsigned int Flags)`.
pub type PFN_cuEventCreate = unsafe extern "C" fn(*mut CUevent, c_uint) -> CUresult;
/// `cuEventRecord(CUevent hEvent, CUstream hStream)` (also `_ptsz`).
pub type PFN_cuEventRecord = unsafe extern "C" fn(CUevent, CUstream) -> CUresult;
/// `cuEventQuery(CUevent hEvent)`.
pub type PFN_cuEventQuery = unsafe extern "C" fn(CUevent) -> CUresult;
/// `cuEventSynchronize(CUevent hEvent)`.
pub type PFN_cuEventSynchronize = unsafe extern "C" fn(CUevent) -> CUresult;
/// `cuLaunchKernel(CUfunction f, unsigned int gridDimX, gridDimY, gridDimZ,
/// blockDimX, blockDimY, blockDimZ, sharedMemBytes, CUstream hStream,
/// void **kernelParams, void **extra)` (also `_ptsz`).
pub type PFN_cuLaunchKernel = unsafe extern "C" fn(
    CUfunction,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    CUstream,
    *mut *mut c_void,
    *mut *mut c_void,
) -> CUresult;
/// `cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
/// void **extra)` (also `_ptsz`).
pub type PFN_cuLaunchKernelEx = unsafe extern "C" fn(
    *const CUlaunchConfig,
    CUfunction,
    *mut *mut c_void,
    *mut *mut c_void,
) -> CUresult;
/// `cuLaunchCooperativeKernel(CUfunction f, unsigned int gridDimX, gridDimY, gridDimZ,
/// blockDimX, blockDimY, blockDimZ, sharedMemBytes, CUstream hStream,
/// void **kernelParams)` (also `_ptsz`).
pub type PFN_cuLaunchCooperativeKernel = unsafe extern "C" fn(
    CUfunction,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    CUstream,
    *mut *mut c_void,
) -> CUresult;
/// `cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream)` (also `_ptsz`).
pub type PFN_cuGraphLaunch = unsafe extern "C" fn(CUgraphExec, CUstream) -> CUresult;
/// `cuStreamBeginCapture(CUstream hStream)` (CUDA 10.0; also `_ptsz`).
pub type PFN_cuStreamBeginCapture = unsafe extern "C" fn(CUstream) -> CUresult;
/// `cuStreamBeginCapture_v2(CUstream hStream, CUstreamCaptureMode mode)` (also `_ptsz`).
pub type PFN_cuStreamBeginCapture_v2 = unsafe extern "C" fn(CUstream, c_uint) -> CUresult;
/// `cuStreamBeginCaptureToGraph(CUstream hStream, CUgraph hGraph, const CUgraphNode
/// *dependencies, const CUgraphEdgeData *dependencyData, size_t numDependencies,
/// CUstreamCaptureMode mode)` (CUDA 12.3; also `_ptsz`).
pub type PFN_cuStreamBeginCaptureToGraph = unsafe extern "C" fn(
    CUstream,
    CUgraph,
    *const CUgraphNode,
    *const c_void,
    usize,
    c_uint,
) -> CUresult;
/// `cuStreamEndCapture(CUstream hStream, CUgraph *phGraph)` (also `_ptsz`).
pub type PFN_cuStreamEndCapture = unsafe extern "C" fn(CUstream, *mut CUgraph) -> CUresult;
/// `cuStreamIsCapturing(CUstream hStream, CUstreamCaptureStatus *captureStatus)` (also
/// `_ptsz`).
pub type PFN_cuStreamIsCapturing = unsafe extern "C" fn(CUstream, *mut c_uint) -> CUresult;
/// `cuThreadExchangeStreamCaptureMode(CUstreamCaptureMode *mode)`.
pub type PFN_cuThreadExchangeStreamCaptureMode = unsafe extern "C" fn(*mut c_uint) -> CUresult;

// ---- NVML ----------------------------------------------------------------------------------

/// `nvmlInit_v2(void)` (and the first version).
pub type PFN_nvmlInit_v2 = unsafe extern "C" fn() -> nvmlReturn_t;
/// `nvmlInitWithFlags(unsigned int flags)`.
pub type PFN_nvmlInitWithFlags = unsafe extern "C" fn(c_uint) -> nvmlReturn_t;
/// `nvmlDeviceGetCount_v2(unsigned int *deviceCount)` (and the first version).
pub type PFN_nvmlDeviceGetCount_v2 = unsafe extern "C" fn(*mut c_uint) -> nvmlReturn_t;
/// `nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)` (and the
/// first version).
pub type PFN_nvmlDeviceGetHandleByIndex_v2 =
    unsafe extern "C" fn(c_uint, *mut nvmlDevice_t) -> nvmlReturn_t;
/// `nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device)`; the lookups by
/// PCI bus id (both versions) and by serial have the same signature.
pub type PFN_nvmlDeviceGetHandleByUUID =
    unsafe extern "C" fn(*const c_char, *mut nvmlDevice_t) -> nvmlReturn_t;
/// `nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index)`.
pub type PFN_nvmlDeviceGetIndex = unsafe extern "C" fn(nvmlDevice_t, *mut c_uint) -> nvmlReturn_t;
/// `nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)`.
pub type PFN_nvmlDeviceGetUUID =
    unsafe extern "C" fn(nvmlDevice_t, *mut c_char, c_uint) -> nvmlReturn_t;
/// `nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)`.
pub type PFN_nvmlDeviceGetMemoryInfo =
    unsafe extern "C" fn(nvmlDevice_t, *mut nvmlMemory_t) -> nvmlReturn_t;
/// `nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)`.
pub type PFN_nvmlDeviceGetMemoryInfo_v2 =
    unsafe extern "C" fn(nvmlDevice_t, *mut nvmlMemory_v2_t) -> nvmlReturn_t;
/// `nvmlDeviceGetProcessUtilization(nvmlDevice_t device,
/// nvmlProcessUtilizationSample_t *utilization, unsigned int *processSamplesCount,
/// unsigned long long lastSeenTimeStamp)`.
pub type PFN_nvmlDeviceGetProcessUtilization = unsafe extern "C" fn(
    nvmlDevice_t,
    *mut nvmlProcessUtilizationSample_t,
    *mut c_uint,
    u64,
) -> nvmlReturn_t;
/// `nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t device, unsigned int *infoCount,
/// nvmlProcessInfo_v1_t *infos)`; the graphics and MPS lists have the same signature.
pub type PFN_nvmlDeviceGetComputeRunningProcesses =
    unsafe extern "C" fn(nvmlDevice_t, *mut c_uint, *mut nvmlProcessInfo_v1_t) -> nvmlReturn_t;
/// `nvmlDeviceGetComputeRunningProcesses_v2(device, infoCount, nvmlProcessInfo_v2_t *infos)`;
/// the graphics and MPS lists have the same signature.
pub type PFN_nvmlDeviceGetComputeRunningProcesses_v2 =
    unsafe extern "C" fn(nvmlDevice_t, *mut c_uint, *mut nvmlProcessInfo_v2_t) -> nvmlReturn_t;
/// `nvmlDeviceGetComputeRunningProcesses_v3(device, infoCount, nvmlProcessInfo_t *infos)`;
/// the graphics and MPS lists have the same signature.
pub type PFN_nvmlDeviceGetComputeRunningProcesses_v3 =
    unsafe extern "C" fn(nvmlDevice_t, *mut c_uint, *mut nvmlProcessInfo_t) -> nvmlReturn_t;

// ---- NVML topology, peer-to-peer and NVLink ------------------------------------------------

/// `nvmlDeviceGetTopologyCommonAncestor(nvmlDevice_t device1, nvmlDevice_t device2,
/// nvmlGpuTopologyLevel_t *pathInfo)`.
pub type PFN_nvmlDeviceGetTopologyCommonAncestor =
    unsafe extern "C" fn(nvmlDevice_t, nvmlDevice_t, *mut nvmlGpuTopologyLevel_t) -> nvmlReturn_t;
/// `nvmlDeviceGetTopologyNearestGpus(nvmlDevice_t device, nvmlGpuTopologyLevel_t level,
/// unsigned int *count, nvmlDevice_t *deviceArray)`.
pub type PFN_nvmlDeviceGetTopologyNearestGpus = unsafe extern "C" fn(
    nvmlDevice_t,
    nvmlGpuTopologyLevel_t,
    *mut c_uint,
    *mut nvmlDevice_t,
) -> nvmlReturn_t;
/// `nvmlSystemGetTopologyGpuSet(unsigned int cpuNumber, unsigned int *count,
/// nvmlDevice_t *deviceArray)`.
pub type PFN_nvmlSystemGetTopologyGpuSet =
    unsafe extern "C" fn(c_uint, *mut c_uint, *mut nvmlDevice_t) -> nvmlReturn_t;
/// `nvmlDeviceGetP2PStatus(nvmlDevice_t device1, nvmlDevice_t device2,
/// nvmlGpuP2PCapsIndex_t p2pIndex, nvmlGpuP2PStatus_t *p2pStatus)`.
pub type PFN_nvmlDeviceGetP2PStatus = unsafe extern "C" fn(
    nvmlDevice_t,
    nvmlDevice_t,
    nvmlGpuP2PCapsIndex_t,
    *mut nvmlGpuP2PStatus_t,
) -> nvmlReturn_t;
/// `nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned int link,
/// nvmlEnableState_t *isActive)`.
pub type PFN_nvmlDeviceGetNvLinkState =
    unsafe extern "C" fn(nvmlDevice_t, c_uint, *mut nvmlEnableState_t) -> nvmlReturn_t;
/// `nvmlDeviceGetNvLinkVersion(nvmlDevice_t device, unsigned int link, unsigned int *version)`.
pub type PFN_nvmlDeviceGetNvLinkVersion =
    unsafe extern "C" fn(nvmlDevice_t, c_uint, *mut c_uint) -> nvmlReturn_t;
/// `nvmlDeviceGetNvLinkCapability(nvmlDevice_t device, unsigned int link,
/// nvmlNvLinkCapability_t capability, unsigned int *capResult)`.
pub type PFN_nvmlDeviceGetNvLinkCapability =
    unsafe extern "C" fn(nvmlDevice_t, c_uint, nvmlNvLinkCapability_t, *mut c_uint) -> nvmlReturn_t;
/// `nvmlDeviceGetNvLinkRemotePciInfo_v2(nvmlDevice_t device, unsigned int link,
/// nvmlPciInfo_t *pci)`.
pub type PFN_nvmlDeviceGetNvLinkRemotePciInfo_v2 =
    unsafe extern "C" fn(nvmlDevice_t, c_uint, *mut nvmlPciInfo_t) -> nvmlReturn_t;
/// `nvmlDeviceGetNvLinkRemotePciInfo` (first version): the older 52-byte `nvmlPciInfo_t`.
pub type PFN_nvmlDeviceGetNvLinkRemotePciInfo =
    unsafe extern "C" fn(nvmlDevice_t, c_uint, *mut nvmlPciInfo_v2_t) -> nvmlReturn_t;
/// `nvmlDeviceGetNvLinkRemoteDeviceType(nvmlDevice_t device, unsigned int link,
/// nvmlIntNvLinkDeviceType_t *pNvLinkDeviceType)`.
pub type PFN_nvmlDeviceGetNvLinkRemoteDeviceType =
    unsafe extern "C" fn(nvmlDevice_t, c_uint, *mut nvmlIntNvLinkDeviceType_t) -> nvmlReturn_t;
/// `nvmlDeviceGetCpuAffinity(nvmlDevice_t device, unsigned int cpuSetSize,
/// unsigned long *cpuSet)`.
pub type PFN_nvmlDeviceGetCpuAffinity =
    unsafe extern "C" fn(nvmlDevice_t, c_uint, *mut c_ulong) -> nvmlReturn_t;
/// `nvmlDeviceGetCpuAffinityWithinScope(nvmlDevice_t device, unsigned int cpuSetSize,
/// unsigned long *cpuSet, nvmlAffinityScope_t scope)`; `nvmlDeviceGetMemoryAffinity(device,
/// nodeSetSize, nodeSet, scope)` has the same signature.
pub type PFN_nvmlDeviceGetCpuAffinityWithinScope =
    unsafe extern "C" fn(nvmlDevice_t, c_uint, *mut c_ulong, nvmlAffinityScope_t) -> nvmlReturn_t;
/// `nvmlDeviceGetNumaNodeId(nvmlDevice_t device, unsigned int *node)`.
pub type PFN_nvmlDeviceGetNumaNodeId =
    unsafe extern "C" fn(nvmlDevice_t, *mut c_uint) -> nvmlReturn_t;

// ---- checkpoint (CUDA 12.8, driver r570) ----------------------------------------------

/// `cuCheckpointProcessLock(int pid, CUcheckpointLockArgs *args)`.
pub type PFN_cuCheckpointProcessLock =
    unsafe extern "C" fn(c_int, *mut crate::cuda::CUcheckpointLockArgs) -> CUresult;
/// `cuCheckpointProcessCheckpoint(int pid, CUcheckpointCheckpointArgs *args)`.
pub type PFN_cuCheckpointProcessCheckpoint =
    unsafe extern "C" fn(c_int, *mut crate::cuda::CUcheckpointCheckpointArgs) -> CUresult;
/// `cuCheckpointProcessRestore(int pid, CUcheckpointRestoreArgs *args)`.
pub type PFN_cuCheckpointProcessRestore =
    unsafe extern "C" fn(c_int, *mut crate::cuda::CUcheckpointRestoreArgs) -> CUresult;
/// `cuCheckpointProcessUnlock(int pid, CUcheckpointUnlockArgs *args)`.
pub type PFN_cuCheckpointProcessUnlock =
    unsafe extern "C" fn(c_int, *mut crate::cuda::CUcheckpointUnlockArgs) -> CUresult;
/// `cuCheckpointProcessGetState(int pid, CUprocessState *state)`.
pub type PFN_cuCheckpointProcessGetState = unsafe extern "C" fn(c_int, *mut c_uint) -> CUresult;
/// `cuCheckpointProcessGetRestoreThreadId(int pid, int *tid)`.
pub type PFN_cuCheckpointProcessGetRestoreThreadId =
    unsafe extern "C" fn(c_int, *mut c_int) -> CUresult;
