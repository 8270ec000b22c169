//! `cuGetProcAddress`: entry points by (name, CUDA version, flags), as the driver
//! resolves them.
//!
//! Each base name maps to the ABI versions NVIDIA defined for it (the `_vNNNN` suffixes
//! of `cudaTypedefs.h`). A request gets the newest version not newer than the one it
//! asks for; with `CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM` it gets the `_ptsz` /
//! `_ptds` variant where one exists. A version whose ABI the simulator does not
//! implement (the 32-bit pointer ABIs of CUDA 2.x, say) is listed without a function,
//! so that an old caller gets "not found" rather than a function of another ABI.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void};
use std::sync::OnceLock;

use vgpu_cuda_abi::cuda::{
    CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_FOUND, CUDA_SUCCESS, CUresult, proc_flags, proc_status,
};

use crate::exports::*;

// `cuGetProcAddress` itself, beside the table it reads (the exports' `export!` and
// `out!` macros and argument checks are `exports.rs`'s).
export! {
    fn cuGetProcAddress_v2(symbol: *const c_char, pfn: *mut *mut c_void, cudaVersion: c_int, flags: u64, symbolStatus: *mut c_int) {
        let name = cstr(symbol)?;
        nn(pfn)?;
        let (r, status) = lookup(name, cudaVersion, flags);
        if !symbolStatus.is_null() {
            out!(symbolStatus, status)?;
        }
        match r {
            Some(f) => out!(pfn, f as *mut c_void),
            None => {
                out!(pfn, std::ptr::null_mut())?;
                Err(CUDA_ERROR_NOT_FOUND)
            }
        }
    }
    fn cuGetProcAddress(symbol: *const c_char, pfn: *mut *mut c_void, cudaVersion: c_int, flags: u64) {
        // SAFETY: same contract; the status out-pointer may be null.
        let r = unsafe { cuGetProcAddress_v2(symbol, pfn, cudaVersion, flags, std::ptr::null_mut()) };
        if r == CUDA_SUCCESS { Ok(()) } else { Err(r) }
    }
}

/// One ABI version of an entry point.
#[derive(Debug, Clone, Copy)]
pub struct Version {
    /// CUDA version that introduced this ABI (e.g. 3020).
    pub since: i32,
    /// Exported symbol name of the implementation.
    pub symbol: &'static str,
    /// The implementation (0 when the simulator lacks this ABI).
    pub legacy: usize,
    /// The per-thread default stream variant (0 if none).
    pub per_thread: usize,
}

macro_rules! table {
    ($($name:literal => [$($since:literal : $f:tt $(| $pt:ident)?),* $(,)?]),* $(,)?) => {{
        let mut m: HashMap<&'static str, Vec<Version>> = HashMap::new();
        $(
            m.insert($name, vec![$(Version {
                since: $since,
                symbol: table!(@sym $f),
                legacy: table!(@f $f),
                per_thread: 0 $(+ ($pt as *const () as usize))?,
            }),*]);
        )*
        m
    }};
    (@f none) => { 0 };
    (@f $f:ident) => { $f as *const () as usize };
    (@sym none) => { "" };
    (@sym $f:ident) => { stringify!($f) };
}

/// The entry-point table.
pub fn table() -> &'static HashMap<&'static str, Vec<Version>> {
    static T: OnceLock<HashMap<&'static str, Vec<Version>>> = OnceLock::new();
    T.get_or_init(|| {
        table! {
            "cuGetErrorString" => [6000: cuGetErrorString],
            "cuGetErrorName" => [6000: cuGetErrorName],
            "cuInit" => [2000: cuInit],
            "cuDriverGetVersion" => [2020: cuDriverGetVersion],
            "cuGetProcAddress" => [11030: cuGetProcAddress, 12000: cuGetProcAddress_v2],
            "cuGetExportTable" => [3000: cuGetExportTable],
            "cuDeviceGet" => [2000: cuDeviceGet],
            "cuDeviceGetCount" => [2000: cuDeviceGetCount],
            "cuDeviceGetName" => [2000: cuDeviceGetName],
            "cuDeviceGetUuid" => [9020: cuDeviceGetUuid, 11040: cuDeviceGetUuid_v2],
            "cuDeviceGetLuid" => [10000: cuDeviceGetLuid],
            "cuDeviceTotalMem" => [2000: none, 3020: cuDeviceTotalMem_v2],
            "cuDeviceGetAttribute" => [2000: cuDeviceGetAttribute],
            "cuDeviceComputeCapability" => [2000: cuDeviceComputeCapability],
            "cuDeviceGetPCIBusId" => [4010: cuDeviceGetPCIBusId],
            "cuDeviceGetByPCIBusId" => [4010: cuDeviceGetByPCIBusId],
            "cuDeviceCanAccessPeer" => [4000: cuDeviceCanAccessPeer],
            "cuDeviceGetP2PAttribute" => [8000: cuDeviceGetP2PAttribute],
            "cuDeviceGetDefaultMemPool" => [11020: cuDeviceGetDefaultMemPool],
            "cuDeviceGetMemPool" => [11020: cuDeviceGetMemPool],
            "cuDeviceSetMemPool" => [11020: cuDeviceSetMemPool],
            "cuDevicePrimaryCtxRetain" => [7000: cuDevicePrimaryCtxRetain],
            "cuDevicePrimaryCtxRelease" => [7000: cuDevicePrimaryCtxRelease, 11000: cuDevicePrimaryCtxRelease_v2],
            "cuDevicePrimaryCtxReset" => [7000: cuDevicePrimaryCtxReset, 11000: cuDevicePrimaryCtxReset_v2],
            "cuDevicePrimaryCtxSetFlags" => [7000: cuDevicePrimaryCtxSetFlags, 11000: cuDevicePrimaryCtxSetFlags_v2],
            "cuDevicePrimaryCtxGetState" => [7000: cuDevicePrimaryCtxGetState],
            "cuCtxCreate" => [2000: cuCtxCreate_v2, 3020: cuCtxCreate_v2, 11040: cuCtxCreate_v3, 12050: cuCtxCreate_v4],
            "cuCtxDestroy" => [2000: cuCtxDestroy, 4000: cuCtxDestroy_v2],
            "cuCtxPushCurrent" => [2000: cuCtxPushCurrent, 4000: cuCtxPushCurrent_v2],
            "cuCtxPopCurrent" => [2000: cuCtxPopCurrent, 4000: cuCtxPopCurrent_v2],
            "cuCtxSetCurrent" => [4000: cuCtxSetCurrent],
            "cuCtxGetCurrent" => [4000: cuCtxGetCurrent],
            "cuCtxGetDevice" => [2000: cuCtxGetDevice, 13000: cuCtxGetDevice_v2],
            "cuCtxGetFlags" => [7000: cuCtxGetFlags],
            "cuCtxSetFlags" => [12010: cuCtxSetFlags],
            "cuCtxGetId" => [12000: cuCtxGetId],
            "cuCtxGetApiVersion" => [3020: cuCtxGetApiVersion],
            "cuCtxSynchronize" => [2000: cuCtxSynchronize, 13000: cuCtxSynchronize_v2],
            "cuCtxGetLimit" => [3010: cuCtxGetLimit],
            "cuCtxSetLimit" => [3010: cuCtxSetLimit],
            "cuCtxGetCacheConfig" => [3020: cuCtxGetCacheConfig],
            "cuCtxSetCacheConfig" => [3020: cuCtxSetCacheConfig],
            "cuCtxGetStreamPriorityRange" => [5050: cuCtxGetStreamPriorityRange],
            "cuCtxEnablePeerAccess" => [4000: cuCtxEnablePeerAccess],
            "cuCtxDisablePeerAccess" => [4000: cuCtxDisablePeerAccess],
            "cuMemGetInfo" => [2000: none, 3020: cuMemGetInfo_v2],
            "cuMemAlloc" => [2000: none, 3020: cuMemAlloc_v2],
            "cuMemAllocPitch" => [2000: none, 3020: cuMemAllocPitch_v2],
            "cuMemAllocManaged" => [6000: cuMemAllocManaged],
            "cuMemFree" => [2000: none, 3020: cuMemFree_v2],
            "cuMemGetAddressRange" => [2000: none, 3020: cuMemGetAddressRange_v2],
            "cuMemAllocHost" => [2000: none, 3020: cuMemAllocHost_v2],
            "cuMemHostAlloc" => [2020: cuMemHostAlloc],
            "cuMemFreeHost" => [2000: cuMemFreeHost],
            "cuMemHostGetDevicePointer" => [2020: none, 3020: cuMemHostGetDevicePointer_v2],
            "cuMemHostGetFlags" => [2030: cuMemHostGetFlags],
            "cuMemHostRegister" => [4000: cuMemHostRegister, 6050: cuMemHostRegister_v2],
            "cuMemHostUnregister" => [4000: cuMemHostUnregister],
            "cuPointerGetAttribute" => [4000: cuPointerGetAttribute],
            "cuMemcpy" => [4000: cuMemcpy | cuMemcpy_ptds],
            "cuMemcpyPeer" => [4000: cuMemcpyPeer | cuMemcpyPeer_ptds],
            "cuMemcpyHtoD" => [2000: none, 3020: cuMemcpyHtoD_v2 | cuMemcpyHtoD_v2_ptds],
            "cuMemcpyDtoH" => [2000: none, 3020: cuMemcpyDtoH_v2 | cuMemcpyDtoH_v2_ptds],
            "cuMemcpyDtoD" => [2000: none, 3020: cuMemcpyDtoD_v2 | cuMemcpyDtoD_v2_ptds],
            "cuMemcpyHtoA" => [2000: none, 3020: cuMemcpyHtoA_v2 | cuMemcpyHtoA_v2_ptds],
            "cuMemcpyAtoH" => [2000: none, 3020: cuMemcpyAtoH_v2 | cuMemcpyAtoH_v2_ptds],
            "cuMemcpy2D" => [2000: none, 3020: cuMemcpy2D_v2 | cuMemcpy2D_v2_ptds],
            "cuMemcpy2DUnaligned" => [2000: none, 3020: cuMemcpy2DUnaligned_v2 | cuMemcpy2DUnaligned_v2_ptds],
            "cuMemcpyAsync" => [4000: cuMemcpyAsync | cuMemcpyAsync_ptsz],
            "cuMemcpyPeerAsync" => [4000: cuMemcpyPeerAsync | cuMemcpyPeerAsync_ptsz],
            "cuMemcpyHtoDAsync" => [2000: none, 3020: cuMemcpyHtoDAsync_v2 | cuMemcpyHtoDAsync_v2_ptsz],
            "cuMemcpyDtoHAsync" => [2000: none, 3020: cuMemcpyDtoHAsync_v2 | cuMemcpyDtoHAsync_v2_ptsz],
            "cuMemcpyDtoDAsync" => [3000: none, 3020: cuMemcpyDtoDAsync_v2 | cuMemcpyDtoDAsync_v2_ptsz],
            "cuMemcpy2DAsync" => [2000: none, 3020: cuMemcpy2DAsync_v2 | cuMemcpy2DAsync_v2_ptsz],
            "cuMemsetD8" => [2000: none, 3020: cuMemsetD8_v2 | cuMemsetD8_v2_ptds],
            "cuMemsetD16" => [2000: none, 3020: cuMemsetD16_v2 | cuMemsetD16_v2_ptds],
            "cuMemsetD32" => [2000: none, 3020: cuMemsetD32_v2 | cuMemsetD32_v2_ptds],
            "cuMemsetD2D8" => [2000: none, 3020: cuMemsetD2D8_v2 | cuMemsetD2D8_v2_ptds],
            "cuMemsetD2D16" => [2000: none, 3020: cuMemsetD2D16_v2 | cuMemsetD2D16_v2_ptds],
            "cuMemsetD2D32" => [2000: none, 3020: cuMemsetD2D32_v2 | cuMemsetD2D32_v2_ptds],
            "cuMemsetD8Async" => [3020: cuMemsetD8Async | cuMemsetD8Async_ptsz],
            "cuMemsetD16Async" => [3020: cuMemsetD16Async | cuMemsetD16Async_ptsz],
            "cuMemsetD32Async" => [3020: cuMemsetD32Async | cuMemsetD32Async_ptsz],
            "cuMemsetD2D8Async" => [3020: cuMemsetD2D8Async | cuMemsetD2D8Async_ptsz],
            "cuMemsetD2D32Async" => [3020: cuMemsetD2D32Async | cuMemsetD2D32Async_ptsz],
            "cuMemAllocAsync" => [11020: cuMemAllocAsync | cuMemAllocAsync_ptsz],
            "cuMemAllocFromPoolAsync" => [11020: cuMemAllocFromPoolAsync | cuMemAllocFromPoolAsync_ptsz],
            "cuMemFreeAsync" => [11020: cuMemFreeAsync | cuMemFreeAsync_ptsz],
            "cuMemPoolCreate" => [11020: cuMemPoolCreate],
            "cuMemPoolDestroy" => [11020: cuMemPoolDestroy],
            "cuMemPoolTrimTo" => [11020: cuMemPoolTrimTo],
            "cuMemPoolSetAttribute" => [11020: cuMemPoolSetAttribute],
            "cuMemPoolGetAttribute" => [11020: cuMemPoolGetAttribute],
            "cuMemGetAllocationGranularity" => [10020: cuMemGetAllocationGranularity],
            "cuMemAddressReserve" => [10020: cuMemAddressReserve],
            "cuMemAddressFree" => [10020: cuMemAddressFree],
            "cuMemCreate" => [10020: cuMemCreate],
            "cuMemRelease" => [10020: cuMemRelease],
            "cuMemMap" => [10020: cuMemMap],
            "cuMemExportToShareableHandle" => [10020: cuMemExportToShareableHandle],
            "cuMemImportFromShareableHandle" => [10020: cuMemImportFromShareableHandle],
            "cuIpcGetMemHandle" => [4010: cuIpcGetMemHandle],
            "cuIpcOpenMemHandle" => [4010: cuIpcOpenMemHandle, 11000: cuIpcOpenMemHandle_v2],
            "cuIpcCloseMemHandle" => [4010: cuIpcCloseMemHandle],
            "cuMemUnmap" => [10020: cuMemUnmap],
            "cuMemSetAccess" => [10020: cuMemSetAccess],
            "cuMemGetAccess" => [10020: cuMemGetAccess],
            "cuMemRetainAllocationHandle" => [11000: cuMemRetainAllocationHandle],
            "cuMemGetAllocationPropertiesFromHandle" => [10020: cuMemGetAllocationPropertiesFromHandle],
            "cuArrayCreate" => [2000: none, 3020: cuArrayCreate_v2],
            "cuArray3DCreate" => [2000: none, 3020: cuArray3DCreate_v2],
            "cuArrayGetDescriptor" => [2000: none, 3020: cuArrayGetDescriptor_v2],
            "cuArray3DGetDescriptor" => [2000: none, 3020: cuArray3DGetDescriptor_v2],
            "cuArrayDestroy" => [2000: cuArrayDestroy],
            "cuMipmappedArrayCreate" => [5000: cuMipmappedArrayCreate],
            "cuMipmappedArrayGetLevel" => [5000: cuMipmappedArrayGetLevel],
            "cuMipmappedArrayDestroy" => [5000: cuMipmappedArrayDestroy],
            "cuStreamCreate" => [2000: cuStreamCreate],
            "cuStreamCreateWithPriority" => [5050: cuStreamCreateWithPriority],
            "cuStreamDestroy" => [2000: cuStreamDestroy, 4000: cuStreamDestroy_v2],
            "cuStreamSynchronize" => [2000: cuStreamSynchronize | cuStreamSynchronize_ptsz],
            "cuStreamQuery" => [2000: cuStreamQuery | cuStreamQuery_ptsz],
            "cuStreamGetPriority" => [5050: cuStreamGetPriority | cuStreamGetPriority_ptsz],
            "cuStreamGetFlags" => [5050: cuStreamGetFlags | cuStreamGetFlags_ptsz],
            "cuStreamGetId" => [12000: cuStreamGetId | cuStreamGetId_ptsz],
            "cuStreamGetCtx" => [9020: cuStreamGetCtx | cuStreamGetCtx_ptsz, 12050: cuStreamGetCtx_v2 | cuStreamGetCtx_v2_ptsz],
            "cuStreamWaitEvent" => [3020: cuStreamWaitEvent | cuStreamWaitEvent_ptsz],
            "cuStreamWaitValue32" => [8000: cuStreamWaitValue32 | cuStreamWaitValue32_ptsz, 11070: cuStreamWaitValue32_v2 | cuStreamWaitValue32_v2_ptsz],
            "cuStreamWaitValue64" => [9000: cuStreamWaitValue64 | cuStreamWaitValue64_ptsz, 11070: cuStreamWaitValue64_v2 | cuStreamWaitValue64_v2_ptsz],
            "cuStreamWriteValue32" => [8000: cuStreamWriteValue32 | cuStreamWriteValue32_ptsz, 11070: cuStreamWriteValue32_v2 | cuStreamWriteValue32_v2_ptsz],
            "cuStreamWriteValue64" => [9000: cuStreamWriteValue64 | cuStreamWriteValue64_ptsz, 11070: cuStreamWriteValue64_v2 | cuStreamWriteValue64_v2_ptsz],
            "cuStreamBatchMemOp" => [8000: cuStreamBatchMemOp | cuStreamBatchMemOp_ptsz, 11070: cuStreamBatchMemOp_v2 | cuStreamBatchMemOp_v2_ptsz],
            "cuStreamAddCallback" => [5000: cuStreamAddCallback | cuStreamAddCallback_ptsz],
            "cuLaunchHostFunc" => [10000: cuLaunchHostFunc | cuLaunchHostFunc_ptsz],
            "cuStreamBeginCapture" => [10000: cuStreamBeginCapture | cuStreamBeginCapture_ptsz, 10010: cuStreamBeginCapture_v2 | cuStreamBeginCapture_v2_ptsz],
            "cuStreamBeginCaptureToGraph" => [12030: cuStreamBeginCaptureToGraph | cuStreamBeginCaptureToGraph_ptsz],
            "cuStreamEndCapture" => [10000: cuStreamEndCapture | cuStreamEndCapture_ptsz],
            "cuStreamIsCapturing" => [10000: cuStreamIsCapturing | cuStreamIsCapturing_ptsz],
            "cuStreamGetCaptureInfo" => [10010: cuStreamGetCaptureInfo | cuStreamGetCaptureInfo_ptsz, 11030: cuStreamGetCaptureInfo_v2 | cuStreamGetCaptureInfo_v2_ptsz, 12030: none],
            "cuThreadExchangeStreamCaptureMode" => [10010: cuThreadExchangeStreamCaptureMode],
            "cuEventCreate" => [2000: cuEventCreate],
            "cuEventRecord" => [2000: cuEventRecord | cuEventRecord_ptsz],
            "cuEventRecordWithFlags" => [11010: cuEventRecordWithFlags | cuEventRecordWithFlags_ptsz],
            "cuEventQuery" => [2000: cuEventQuery],
            "cuEventSynchronize" => [2000: cuEventSynchronize],
            "cuEventDestroy" => [2000: cuEventDestroy, 4000: cuEventDestroy_v2],
            "cuEventElapsedTime" => [2000: cuEventElapsedTime, 12080: cuEventElapsedTime_v2],
            "cuModuleLoad" => [2000: cuModuleLoad],
            "cuModuleLoadData" => [2000: cuModuleLoadData],
            "cuModuleLoadDataEx" => [2010: cuModuleLoadDataEx],
            "cuModuleLoadFatBinary" => [2000: cuModuleLoadFatBinary],
            "cuModuleUnload" => [2000: cuModuleUnload],
            "cuModuleGetFunction" => [2000: cuModuleGetFunction],
            "cuModuleGetFunctionCount" => [12040: cuModuleGetFunctionCount],
            "cuModuleGetGlobal" => [2000: none, 3020: cuModuleGetGlobal_v2],
            "cuModuleGetLoadingMode" => [11070: cuModuleGetLoadingMode],
            "cuLibraryLoadData" => [12000: cuLibraryLoadData],
            "cuLibraryUnload" => [12000: cuLibraryUnload],
            "cuLibraryGetKernel" => [12000: cuLibraryGetKernel],
            "cuLibraryGetModule" => [12000: cuLibraryGetModule],
            "cuKernelGetFunction" => [12000: cuKernelGetFunction],
            "cuFuncGetAttribute" => [2020: cuFuncGetAttribute],
            "cuFuncSetAttribute" => [9000: cuFuncSetAttribute],
            "cuFuncSetCacheConfig" => [3000: cuFuncSetCacheConfig],
            "cuFuncGetModule" => [11000: cuFuncGetModule],
            "cuFuncGetName" => [12030: cuFuncGetName],
            "cuOccupancyMaxActiveBlocksPerMultiprocessor" => [6050: cuOccupancyMaxActiveBlocksPerMultiprocessor],
            "cuLaunchKernel" => [4000: cuLaunchKernel | cuLaunchKernel_ptsz],
            "cuLaunchKernelEx" => [11060: cuLaunchKernelEx | cuLaunchKernelEx_ptsz],
            "cuLaunchCooperativeKernel" => [9000: cuLaunchCooperativeKernel | cuLaunchCooperativeKernel_ptsz],
            "cuGraphCreate" => [10000: cuGraphCreate],
            "cuGraphDestroy" => [10000: cuGraphDestroy],
            "cuGraphGetNodes" => [10000: cuGraphGetNodes],
            "cuGraphInstantiate" => [10000: cuGraphInstantiate_v2, 11000: cuGraphInstantiate_v2, 12000: cuGraphInstantiateWithFlags],
            "cuGraphInstantiateWithFlags" => [11040: cuGraphInstantiateWithFlags],
            "cuGraphExecDestroy" => [10000: cuGraphExecDestroy],
            "cuGraphLaunch" => [10000: cuGraphLaunch | cuGraphLaunch_ptsz],
            "cuGraphUpload" => [11010: cuGraphUpload | cuGraphUpload_ptsz],
            "cuProfilerStart" => [4000: cuProfilerStart],
            "cuProfilerStop" => [4000: cuProfilerStop],
            "cuCheckpointProcessLock" => [12080: cuCheckpointProcessLock],
            "cuCheckpointProcessCheckpoint" => [12080: cuCheckpointProcessCheckpoint],
            "cuCheckpointProcessRestore" => [12080: cuCheckpointProcessRestore],
            "cuCheckpointProcessUnlock" => [12080: cuCheckpointProcessUnlock],
            "cuCheckpointProcessGetState" => [12080: cuCheckpointProcessGetState],
            "cuCheckpointProcessGetRestoreThreadId" => [12080: cuCheckpointProcessGetRestoreThreadId],
        }
    })
}

/// Resolves `name` for a caller built against `version` with `flags`. Returns the
/// function address (if any) and the `CUdriverProcAddressQueryResult`.
pub fn lookup(name: &str, version: i32, flags: u64) -> (Option<usize>, i32) {
    let (r, status, symbol) = resolve(name, version, flags);
    static TRACE: OnceLock<bool> = OnceLock::new();
    if *TRACE.get_or_init(|| {
        std::env::var_os("VGPU_SIM_TRACE").is_some_and(|v| !v.is_empty() && v != "0")
    }) {
        eprintln!(
            "vgpu cuda-sim: cuGetProcAddress({name}, {version}, {flags}) -> {}",
            symbol.unwrap_or("not found")
        );
    }
    (r, status)
}

fn resolve(name: &str, version: i32, flags: u64) -> (Option<usize>, i32, Option<&'static str>) {
    let Some(versions) = table().get(name) else {
        return (None, proc_status::SYMBOL_NOT_FOUND, None);
    };
    let Some(v) = versions
        .iter()
        .filter(|v| v.since <= version)
        .max_by_key(|v| v.since)
    else {
        return (None, proc_status::VERSION_NOT_SUFFICIENT, None);
    };
    if v.legacy == 0 {
        return (None, proc_status::SYMBOL_NOT_FOUND, None);
    }
    let per_thread = flags & proc_flags::PER_THREAD_DEFAULT_STREAM != 0;
    let f = if per_thread && v.per_thread != 0 {
        v.per_thread
    } else {
        v.legacy
    };
    (Some(f), proc_status::SUCCESS, Some(v.symbol))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_the_abi_of_the_requested_version() {
        let (f, s) = lookup("cuMemAlloc", 12000, 0);
        assert_eq!(s, proc_status::SUCCESS);
        assert_eq!(f, Some(cuMemAlloc_v2 as *const () as usize));
        // The 32-bit ABI of CUDA 2.0 is not simulated: not found, never the v2 ABI.
        assert_eq!(
            lookup("cuMemAlloc", 2000, 0),
            (None, proc_status::SYMBOL_NOT_FOUND)
        );
        assert_eq!(
            lookup("cuLaunchKernelEx", 11000, 0),
            (None, proc_status::VERSION_NOT_SUFFICIENT)
        );
        assert_eq!(
            lookup("cuNoSuchThing", 13000, 0),
            (None, proc_status::SYMBOL_NOT_FOUND)
        );
        assert_eq!(
            lookup("cuCtxCreate", 11040, 0).0,
            Some(cuCtxCreate_v3 as *const () as usize)
        );
        assert_eq!(
            lookup("cuCtxCreate", 13000, 0).0,
            Some(cuCtxCreate_v4 as *const () as usize)
        );
        assert_eq!(
            lookup("cuGraphInstantiate", 12000, 0).0,
            Some(cuGraphInstantiateWithFlags as *const () as usize)
        );
    }

    #[test]
    fn per_thread_flag_selects_ptsz_variants() {
        assert_eq!(
            lookup("cuLaunchKernel", 12000, 0).0,
            Some(cuLaunchKernel as *const () as usize)
        );
        assert_eq!(
            lookup("cuLaunchKernel", 12000, 2).0,
            Some(cuLaunchKernel_ptsz as *const () as usize)
        );
        assert_eq!(
            lookup("cuLaunchKernel", 12000, 1).0,
            Some(cuLaunchKernel as *const () as usize)
        );
        assert_eq!(
            lookup("cuMemcpyHtoD", 12000, 2).0,
            Some(cuMemcpyHtoD_v2_ptds as *const () as usize)
        );
        // Functions without a per-thread variant are the same either way.
        assert_eq!(
            lookup("cuMemAlloc", 12000, 2).0,
            lookup("cuMemAlloc", 12000, 0).0
        );
    }
}
