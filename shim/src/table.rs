//! The one table of intercepted entry points. It drives all three routes: each row is an
//! exported hook of the same name, the `dlsym` hook returns that hook for the row's
//! symbol, and the `cuGetProcAddress` hook returns it when the driver resolved a request
//! to the row's real function (so the requested version and the per-thread-stream flag
//! are decided exactly as the driver decides them).
//!
//! Columns: exported symbol, library, base name as `cuGetProcAddress` knows it, the CUDA
//! version that introduced this ABI, whether it is the per-thread-default-stream variant,
//! its C signature (a type of `vgpu_cuda_abi::fns`).
//!
//! The rows are written once, in the `rows!` macro; this file builds the table from them, and the
//! hooks layer builds its map from a row to its hook from the same rows (the table knows
//! nothing above it).

/// Which real library a row belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lib {
    /// `libcuda.so.1`.
    Cuda,
    /// `libnvidia-ml.so.1`.
    Nvml,
}

/// One intercepted entry point.
#[derive(Debug, Clone, Copy)]
pub struct Entry {
    /// Exported symbol name (the hook's and the real function's).
    pub symbol: &'static str,
    /// The real library.
    pub lib: Lib,
    /// Base name, as passed to `cuGetProcAddress` (NVML: the symbol).
    pub base: &'static str,
    /// CUDA version that introduced this ABI (NVML: 0).
    pub since: i32,
    /// The `_ptsz`/`_ptds` variant.
    pub per_thread: bool,
}

macro_rules! table {
    ($($id:ident : $lib:ident $base:literal $since:literal $pt:literal $pfn:ident;)*) => {
        /// Index of a row of [`TABLE`].
        #[allow(non_camel_case_types)]
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        #[repr(usize)]
        pub enum Id { $($id),* }

        /// The intercepted entry points.
        pub static TABLE: &[Entry] = &[$(Entry {
            symbol: stringify!($id),
            lib: Lib::$lib,
            base: $base,
            since: $since,
            per_thread: $pt,
        }),*];

        /// Every row's id, in table order.
        pub const IDS: &[Id] = &[$(Id::$id),*];
    };
}

/// Calls the macro `$then` with every row of the table, in order, as
/// `id: Lib "base" since per_thread PFN;`, where `PFN` names the row's C signature in
/// `vgpu_cuda_abi::fns` (the hooks are checked against it at compile time).
macro_rules! rows {
    ($then:ident) => {
        $then! {
            cuInit: Cuda "cuInit" 2000 false PFN_cuInit;
            cuGetProcAddress: Cuda "cuGetProcAddress" 11030 false PFN_cuGetProcAddress;
            cuGetProcAddress_v2: Cuda "cuGetProcAddress" 12000 false PFN_cuGetProcAddress_v2;
            cuMemGetInfo_v2: Cuda "cuMemGetInfo" 3020 false PFN_cuMemGetInfo_v2;
            cuDeviceTotalMem_v2: Cuda "cuDeviceTotalMem" 3020 false PFN_cuDeviceTotalMem_v2;
            cuMemAlloc_v2: Cuda "cuMemAlloc" 3020 false PFN_cuMemAlloc_v2;
            cuMemAllocPitch_v2: Cuda "cuMemAllocPitch" 3020 false PFN_cuMemAllocPitch_v2;
            cuMemAllocManaged: Cuda "cuMemAllocManaged" 6000 false PFN_cuMemAllocManaged;
            cuMemFree_v2: Cuda "cuMemFree" 3020 false PFN_cuMemFree_v2;
            cuMemAllocAsync: Cuda "cuMemAllocAsync" 11020 false PFN_cuMemAllocAsync;
            cuMemAllocAsync_ptsz: Cuda "cuMemAllocAsync" 11020 true PFN_cuMemAllocAsync;
            cuMemAllocFromPoolAsync: Cuda "cuMemAllocFromPoolAsync" 11020 false PFN_cuMemAllocFromPoolAsync;
            cuMemAllocFromPoolAsync_ptsz: Cuda "cuMemAllocFromPoolAsync" 11020 true PFN_cuMemAllocFromPoolAsync;
            cuMemFreeAsync: Cuda "cuMemFreeAsync" 11020 false PFN_cuMemFreeAsync;
            cuMemFreeAsync_ptsz: Cuda "cuMemFreeAsync" 11020 true PFN_cuMemFreeAsync;
            cuMemPoolCreate: Cuda "cuMemPoolCreate" 11020 false PFN_cuMemPoolCreate;
            cuMemPoolDestroy: Cuda "cuMemPoolDestroy" 11020 false PFN_cuMemPoolDestroy;
            cuMemPoolTrimTo: Cuda "cuMemPoolTrimTo" 11020 false PFN_cuMemPoolTrimTo;
            cuMemPoolSetAttribute: Cuda "cuMemPoolSetAttribute" 11020 false PFN_cuMemPoolSetAttribute;
            cuStreamSynchronize: Cuda "cuStreamSynchronize" 2000 false PFN_cuStreamSynchronize;
            cuStreamSynchronize_ptsz: Cuda "cuStreamSynchronize" 7000 true PFN_cuStreamSynchronize;
            cuEventSynchronize: Cuda "cuEventSynchronize" 2000 false PFN_cuEventSynchronize;
            cuCtxSynchronize: Cuda "cuCtxSynchronize" 2000 false PFN_cuCtxSynchronize;
            cuCtxSynchronize_v2: Cuda "cuCtxSynchronize" 13000 false PFN_cuCtxSynchronize_v2;
            cuMemCreate: Cuda "cuMemCreate" 10020 false PFN_cuMemCreate;
            cuMemRelease: Cuda "cuMemRelease" 10020 false PFN_cuMemRelease;
            cuMemRetainAllocationHandle: Cuda "cuMemRetainAllocationHandle" 11000 false PFN_cuMemRetainAllocationHandle;
            cuMemMap: Cuda "cuMemMap" 10020 false PFN_cuMemMap;
            cuMemUnmap: Cuda "cuMemUnmap" 10020 false PFN_cuMemUnmap;
            cuArrayCreate_v2: Cuda "cuArrayCreate" 3020 false PFN_cuArrayCreate_v2;
            cuArray3DCreate_v2: Cuda "cuArray3DCreate" 3020 false PFN_cuArray3DCreate_v2;
            cuArrayDestroy: Cuda "cuArrayDestroy" 2000 false PFN_cuArrayDestroy;
            cuMipmappedArrayCreate: Cuda "cuMipmappedArrayCreate" 5000 false PFN_cuMipmappedArrayCreate;
            cuMipmappedArrayDestroy: Cuda "cuMipmappedArrayDestroy" 5000 false PFN_cuMipmappedArrayDestroy;
            cuDevicePrimaryCtxRetain: Cuda "cuDevicePrimaryCtxRetain" 7000 false PFN_cuDevicePrimaryCtxRetain;
            cuDevicePrimaryCtxRelease: Cuda "cuDevicePrimaryCtxRelease" 7000 false PFN_cuDevicePrimaryCtxRelease_v2;
            cuDevicePrimaryCtxRelease_v2: Cuda "cuDevicePrimaryCtxRelease" 11000 false PFN_cuDevicePrimaryCtxRelease_v2;
            cuDevicePrimaryCtxReset: Cuda "cuDevicePrimaryCtxReset" 7000 false PFN_cuDevicePrimaryCtxReset_v2;
            cuDevicePrimaryCtxReset_v2: Cuda "cuDevicePrimaryCtxReset" 11000 false PFN_cuDevicePrimaryCtxReset_v2;
            cuCtxCreate_v2: Cuda "cuCtxCreate" 3020 false PFN_cuCtxCreate_v2;
            cuCtxCreate_v3: Cuda "cuCtxCreate" 11040 false PFN_cuCtxCreate_v3;
            cuCtxCreate_v4: Cuda "cuCtxCreate" 12050 false PFN_cuCtxCreate_v4;
            cuCtxDestroy: Cuda "cuCtxDestroy" 2000 false PFN_cuCtxDestroy_v2;
            cuCtxDestroy_v2: Cuda "cuCtxDestroy" 4000 false PFN_cuCtxDestroy_v2;
            cuLaunchKernel: Cuda "cuLaunchKernel" 4000 false PFN_cuLaunchKernel;
            cuLaunchKernel_ptsz: Cuda "cuLaunchKernel" 7000 true PFN_cuLaunchKernel;
            cuLaunchKernelEx: Cuda "cuLaunchKernelEx" 11060 false PFN_cuLaunchKernelEx;
            cuLaunchKernelEx_ptsz: Cuda "cuLaunchKernelEx" 11060 true PFN_cuLaunchKernelEx;
            cuLaunchCooperativeKernel: Cuda "cuLaunchCooperativeKernel" 9000 false PFN_cuLaunchCooperativeKernel;
            cuLaunchCooperativeKernel_ptsz: Cuda "cuLaunchCooperativeKernel" 9000 true PFN_cuLaunchCooperativeKernel;
            cuGraphLaunch: Cuda "cuGraphLaunch" 10000 false PFN_cuGraphLaunch;
            cuGraphLaunch_ptsz: Cuda "cuGraphLaunch" 10000 true PFN_cuGraphLaunch;
            cuStreamBeginCapture: Cuda "cuStreamBeginCapture" 10000 false PFN_cuStreamBeginCapture;
            cuStreamBeginCapture_ptsz: Cuda "cuStreamBeginCapture" 10000 true PFN_cuStreamBeginCapture;
            cuStreamBeginCapture_v2: Cuda "cuStreamBeginCapture" 10010 false PFN_cuStreamBeginCapture_v2;
            cuStreamBeginCapture_v2_ptsz: Cuda "cuStreamBeginCapture" 10010 true PFN_cuStreamBeginCapture_v2;
            cuStreamBeginCaptureToGraph: Cuda "cuStreamBeginCaptureToGraph" 12030 false PFN_cuStreamBeginCaptureToGraph;
            cuStreamBeginCaptureToGraph_ptsz: Cuda "cuStreamBeginCaptureToGraph" 12030 true PFN_cuStreamBeginCaptureToGraph;
            cuStreamEndCapture: Cuda "cuStreamEndCapture" 10000 false PFN_cuStreamEndCapture;
            cuStreamEndCapture_ptsz: Cuda "cuStreamEndCapture" 10000 true PFN_cuStreamEndCapture;
            nvmlInit: Nvml "nvmlInit" 0 false PFN_nvmlInit_v2;
            nvmlInit_v2: Nvml "nvmlInit_v2" 0 false PFN_nvmlInit_v2;
            nvmlInitWithFlags: Nvml "nvmlInitWithFlags" 0 false PFN_nvmlInitWithFlags;
            nvmlDeviceGetMemoryInfo: Nvml "nvmlDeviceGetMemoryInfo" 0 false PFN_nvmlDeviceGetMemoryInfo;
            nvmlDeviceGetMemoryInfo_v2: Nvml "nvmlDeviceGetMemoryInfo_v2" 0 false PFN_nvmlDeviceGetMemoryInfo_v2;
            nvmlDeviceGetComputeRunningProcesses: Nvml "nvmlDeviceGetComputeRunningProcesses" 0 false PFN_nvmlDeviceGetComputeRunningProcesses;
            nvmlDeviceGetComputeRunningProcesses_v2: Nvml "nvmlDeviceGetComputeRunningProcesses_v2" 0 false PFN_nvmlDeviceGetComputeRunningProcesses_v2;
            nvmlDeviceGetComputeRunningProcesses_v3: Nvml "nvmlDeviceGetComputeRunningProcesses_v3" 0 false PFN_nvmlDeviceGetComputeRunningProcesses_v3;
            nvmlDeviceGetGraphicsRunningProcesses: Nvml "nvmlDeviceGetGraphicsRunningProcesses" 0 false PFN_nvmlDeviceGetComputeRunningProcesses;
            nvmlDeviceGetGraphicsRunningProcesses_v2: Nvml "nvmlDeviceGetGraphicsRunningProcesses_v2" 0 false PFN_nvmlDeviceGetComputeRunningProcesses_v2;
            nvmlDeviceGetGraphicsRunningProcesses_v3: Nvml "nvmlDeviceGetGraphicsRunningProcesses_v3" 0 false PFN_nvmlDeviceGetComputeRunningProcesses_v3;
            nvmlDeviceGetMPSComputeRunningProcesses: Nvml "nvmlDeviceGetMPSComputeRunningProcesses" 0 false PFN_nvmlDeviceGetComputeRunningProcesses;
            nvmlDeviceGetMPSComputeRunningProcesses_v2: Nvml "nvmlDeviceGetMPSComputeRunningProcesses_v2" 0 false PFN_nvmlDeviceGetComputeRunningProcesses_v2;
            nvmlDeviceGetMPSComputeRunningProcesses_v3: Nvml "nvmlDeviceGetMPSComputeRunningProcesses_v3" 0 false PFN_nvmlDeviceGetComputeRunningProcesses_v3;
            nvmlDeviceGetProcessUtilization: Nvml "nvmlDeviceGetProcessUtilization" 0 false PFN_nvmlDeviceGetProcessUtilization;
            nvmlDeviceGetCount: Nvml "nvmlDeviceGetCount" 0 false PFN_nvmlDeviceGetCount_v2;
            nvmlDeviceGetCount_v2: Nvml "nvmlDeviceGetCount_v2" 0 false PFN_nvmlDeviceGetCount_v2;
            nvmlDeviceGetHandleByIndex: Nvml "nvmlDeviceGetHandleByIndex" 0 false PFN_nvmlDeviceGetHandleByIndex_v2;
            nvmlDeviceGetHandleByIndex_v2: Nvml "nvmlDeviceGetHandleByIndex_v2" 0 false PFN_nvmlDeviceGetHandleByIndex_v2;
            nvmlDeviceGetHandleByUUID: Nvml "nvmlDeviceGetHandleByUUID" 0 false PFN_nvmlDeviceGetHandleByUUID;
            nvmlDeviceGetHandleByPciBusId: Nvml "nvmlDeviceGetHandleByPciBusId" 0 false PFN_nvmlDeviceGetHandleByUUID;
            nvmlDeviceGetHandleByPciBusId_v2: Nvml "nvmlDeviceGetHandleByPciBusId_v2" 0 false PFN_nvmlDeviceGetHandleByUUID;
            nvmlDeviceGetHandleBySerial: Nvml "nvmlDeviceGetHandleBySerial" 0 false PFN_nvmlDeviceGetHandleByUUID;
            nvmlDeviceGetIndex: Nvml "nvmlDeviceGetIndex" 0 false PFN_nvmlDeviceGetIndex;
            nvmlDeviceGetTopologyNearestGpus: Nvml "nvmlDeviceGetTopologyNearestGpus" 0 false PFN_nvmlDeviceGetTopologyNearestGpus;
            nvmlSystemGetTopologyGpuSet: Nvml "nvmlSystemGetTopologyGpuSet" 0 false PFN_nvmlSystemGetTopologyGpuSet;
        }
    };
}
pub(crate) use rows;

rows!(table);

/// The row whose exported symbol is `name`.
pub fn find(name: &[u8]) -> Option<Id> {
    if !(name.starts_with(b"cu") || name.starts_with(b"nvml")) {
        return None;
    }
    TABLE
        .iter()
        .position(|e| e.symbol.as_bytes() == name)
        .and_then(|i| IDS.get(i).copied())
}

/// The row of `id`.
pub fn entry(id: Id) -> &'static Entry {
    &TABLE[id as usize]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_index_the_table() {
        assert_eq!(IDS.len(), TABLE.len());
        for (i, id) in IDS.iter().enumerate() {
            assert_eq!(*id as usize, i);
            assert_eq!(find(TABLE[i].symbol.as_bytes()), Some(*id));
        }
        assert_eq!(find(b"cuCtxGetCurrent"), None);
        assert_eq!(find(b"malloc"), None);
    }

    #[test]
    fn cuda_rows_name_their_abi() {
        for e in TABLE.iter().filter(|e| e.lib == Lib::Cuda) {
            assert!(e.symbol.starts_with(e.base), "{e:?}");
            assert!(e.since >= 2000, "{e:?}");
            assert_eq!(
                e.per_thread,
                e.symbol.ends_with("_ptsz") || e.symbol.ends_with("_ptds")
            );
        }
    }
}
