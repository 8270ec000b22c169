//! The exports' C signatures checked at compile time against the one definition in
//! `vgpu_cuda_abi::fns`, which the shim's hooks are checked against too: an export whose
//! signature drifts from `cuda.h` (or from what the shim expects) fails the build.

use vgpu_cuda_abi::fns::*;

use crate::exports::*;
use crate::procaddr::{cuGetProcAddress, cuGetProcAddress_v2};

/// `const _: PFN = export;` for each export of each type.
macro_rules! check {
    ($($pfn:ident: $($f:ident),+;)*) => {
        $($(const _: $pfn = $f;)+)*
    };
}

check! {
    PFN_cuInit: cuInit;
    PFN_cuCheckpointProcessLock: cuCheckpointProcessLock;
    PFN_cuCheckpointProcessCheckpoint: cuCheckpointProcessCheckpoint;
    PFN_cuCheckpointProcessRestore: cuCheckpointProcessRestore;
    PFN_cuCheckpointProcessUnlock: cuCheckpointProcessUnlock;
    PFN_cuCheckpointProcessGetState: cuCheckpointProcessGetState;
    PFN_cuCheckpointProcessGetRestoreThreadId: cuCheckpointProcessGetRestoreThreadId;
    PFN_cuStreamWaitValue32_v2: cuStreamWaitValue32_v2, cuStreamWaitValue32_v2_ptsz, cuStreamWaitValue32,
        cuStreamWaitValue32_ptsz, cuStreamWriteValue32_v2, cuStreamWriteValue32_v2_ptsz,
        cuStreamWriteValue32, cuStreamWriteValue32_ptsz;
    PFN_cuStreamWaitValue64_v2: cuStreamWaitValue64_v2, cuStreamWaitValue64_v2_ptsz, cuStreamWaitValue64,
        cuStreamWaitValue64_ptsz, cuStreamWriteValue64_v2, cuStreamWriteValue64_v2_ptsz,
        cuStreamWriteValue64, cuStreamWriteValue64_ptsz;
    PFN_cuStreamBatchMemOp_v2: cuStreamBatchMemOp_v2, cuStreamBatchMemOp_v2_ptsz, cuStreamBatchMemOp,
        cuStreamBatchMemOp_ptsz;
    PFN_cuGetProcAddress: cuGetProcAddress;
    PFN_cuGetProcAddress_v2: cuGetProcAddress_v2;
    PFN_cuDeviceGetCount: cuDeviceGetCount;
    PFN_cuDeviceGetUuid: cuDeviceGetUuid, cuDeviceGetUuid_v2;
    PFN_cuDeviceTotalMem_v2: cuDeviceTotalMem_v2;
    PFN_cuDeviceGetMemPool: cuDeviceGetMemPool;
    PFN_cuDeviceCanAccessPeer: cuDeviceCanAccessPeer;
    PFN_cuDeviceGetP2PAttribute: cuDeviceGetP2PAttribute;
    PFN_cuCtxEnablePeerAccess: cuCtxEnablePeerAccess;
    PFN_cuCtxDisablePeerAccess: cuCtxDisablePeerAccess;
    PFN_cuMemcpyPeer: cuMemcpyPeer, cuMemcpyPeer_ptds;
    PFN_cuMemcpyPeerAsync: cuMemcpyPeerAsync, cuMemcpyPeerAsync_ptsz;
    PFN_cuMemGetInfo_v2: cuMemGetInfo_v2;
    PFN_cuMemAlloc_v2: cuMemAlloc_v2;
    PFN_cuMemAllocPitch_v2: cuMemAllocPitch_v2;
    PFN_cuMemAllocManaged: cuMemAllocManaged;
    PFN_cuMemFree_v2: cuMemFree_v2;
    PFN_cuMemAllocAsync: cuMemAllocAsync, cuMemAllocAsync_ptsz;
    PFN_cuMemAllocFromPoolAsync: cuMemAllocFromPoolAsync, cuMemAllocFromPoolAsync_ptsz;
    PFN_cuMemFreeAsync: cuMemFreeAsync, cuMemFreeAsync_ptsz;
    PFN_cuMemPoolCreate: cuMemPoolCreate;
    PFN_cuMemPoolDestroy: cuMemPoolDestroy;
    PFN_cuMemPoolTrimTo: cuMemPoolTrimTo;
    PFN_cuMemPoolSetAttribute: cuMemPoolSetAttribute;
    PFN_cuMemPoolGetAttribute: cuMemPoolGetAttribute;
    PFN_cuMemCreate: cuMemCreate;
    PFN_cuMemRelease: cuMemRelease;
    PFN_cuMemMap: cuMemMap;
    PFN_cuMemUnmap: cuMemUnmap;
    PFN_cuMemRetainAllocationHandle: cuMemRetainAllocationHandle;
    PFN_cuMemExportToShareableHandle: cuMemExportToShareableHandle;
    PFN_cuMemImportFromShareableHandle: cuMemImportFromShareableHandle;
    PFN_cuIpcGetMemHandle: cuIpcGetMemHandle;
    PFN_cuIpcOpenMemHandle_v2: cuIpcOpenMemHandle_v2, cuIpcOpenMemHandle;
    PFN_cuIpcCloseMemHandle: cuIpcCloseMemHandle;
    PFN_cuMemGetAllocationGranularity: cuMemGetAllocationGranularity;
    PFN_cuArrayCreate_v2: cuArrayCreate_v2;
    PFN_cuArray3DCreate_v2: cuArray3DCreate_v2;
    PFN_cuArrayDestroy: cuArrayDestroy;
    PFN_cuMipmappedArrayCreate: cuMipmappedArrayCreate;
    PFN_cuMipmappedArrayDestroy: cuMipmappedArrayDestroy;
    PFN_cuDevicePrimaryCtxRetain: cuDevicePrimaryCtxRetain;
    PFN_cuDevicePrimaryCtxRelease_v2: cuDevicePrimaryCtxRelease_v2, cuDevicePrimaryCtxRelease;
    PFN_cuDevicePrimaryCtxReset_v2: cuDevicePrimaryCtxReset_v2, cuDevicePrimaryCtxReset;
    PFN_cuCtxCreate_v2: cuCtxCreate_v2;
    PFN_cuCtxCreate_v3: cuCtxCreate_v3;
    PFN_cuCtxCreate_v4: cuCtxCreate_v4;
    PFN_cuCtxDestroy_v2: cuCtxDestroy_v2, cuCtxDestroy;
    PFN_cuCtxGetCurrent: cuCtxGetCurrent;
    PFN_cuCtxGetDevice: cuCtxGetDevice;
    PFN_cuCtxPushCurrent_v2: cuCtxPushCurrent_v2;
    PFN_cuCtxPopCurrent_v2: cuCtxPopCurrent_v2;
    PFN_cuCtxSynchronize: cuCtxSynchronize;
    PFN_cuCtxSynchronize_v2: cuCtxSynchronize_v2;
    PFN_cuStreamSynchronize: cuStreamSynchronize, cuStreamSynchronize_ptsz;
    PFN_cuEventCreate: cuEventCreate;
    PFN_cuEventRecord: cuEventRecord, cuEventRecord_ptsz;
    PFN_cuEventQuery: cuEventQuery;
    PFN_cuEventSynchronize: cuEventSynchronize;
    PFN_cuLaunchKernel: cuLaunchKernel, cuLaunchKernel_ptsz;
    PFN_cuLaunchKernelEx: cuLaunchKernelEx, cuLaunchKernelEx_ptsz;
    PFN_cuLaunchCooperativeKernel: cuLaunchCooperativeKernel, cuLaunchCooperativeKernel_ptsz;
    PFN_cuGraphLaunch: cuGraphLaunch, cuGraphLaunch_ptsz;
    PFN_cuStreamBeginCapture: cuStreamBeginCapture, cuStreamBeginCapture_ptsz;
    PFN_cuStreamBeginCapture_v2: cuStreamBeginCapture_v2, cuStreamBeginCapture_v2_ptsz;
    PFN_cuStreamBeginCaptureToGraph: cuStreamBeginCaptureToGraph, cuStreamBeginCaptureToGraph_ptsz;
    PFN_cuStreamEndCapture: cuStreamEndCapture, cuStreamEndCapture_ptsz;
    PFN_cuStreamIsCapturing: cuStreamIsCapturing, cuStreamIsCapturing_ptsz;
    PFN_cuThreadExchangeStreamCaptureMode: cuThreadExchangeStreamCaptureMode;
}
