//! The exports' C signatures checked at compile time against the one definition in
//! `vgpu_cuda_abi::fns`, which the shim's hooks are checked against too: an export whose
//! signature drifts from `nvml.h` (or from what the shim expects) fails the build.

use vgpu_cuda_abi::fns::*;

use crate::ffi::*;
use crate::ffi_topology::*;

/// `const _: PFN = export;` for each export of each type.
macro_rules! check {
    ($($pfn:ident: $($f:ident),+;)*) => {
        $($(const _: $pfn = $f;)+)*
    };
}

check! {
    PFN_nvmlInit_v2: nvmlInit, nvmlInit_v2;
    PFN_nvmlInitWithFlags: nvmlInitWithFlags;
    PFN_nvmlDeviceGetCount_v2: nvmlDeviceGetCount, nvmlDeviceGetCount_v2;
    PFN_nvmlDeviceGetHandleByIndex_v2: nvmlDeviceGetHandleByIndex, nvmlDeviceGetHandleByIndex_v2;
    PFN_nvmlDeviceGetHandleByUUID: nvmlDeviceGetHandleByUUID, nvmlDeviceGetHandleByPciBusId,
        nvmlDeviceGetHandleByPciBusId_v2, nvmlDeviceGetHandleBySerial;
    PFN_nvmlDeviceGetIndex: nvmlDeviceGetIndex;
    PFN_nvmlDeviceGetUUID: nvmlDeviceGetUUID;
    PFN_nvmlDeviceGetMemoryInfo: nvmlDeviceGetMemoryInfo;
    PFN_nvmlDeviceGetMemoryInfo_v2: nvmlDeviceGetMemoryInfo_v2;
    PFN_nvmlDeviceGetProcessUtilization: nvmlDeviceGetProcessUtilization;
    PFN_nvmlDeviceGetComputeRunningProcesses: nvmlDeviceGetComputeRunningProcesses,
        nvmlDeviceGetGraphicsRunningProcesses, nvmlDeviceGetMPSComputeRunningProcesses;
    PFN_nvmlDeviceGetComputeRunningProcesses_v2: nvmlDeviceGetComputeRunningProcesses_v2,
        nvmlDeviceGetGraphicsRunningProcesses_v2, nvmlDeviceGetMPSComputeRunningProcesses_v2;
    PFN_nvmlDeviceGetComputeRunningProcesses_v3: nvmlDeviceGetComputeRunningProcesses_v3,
        nvmlDeviceGetGraphicsRunningProcesses_v3, nvmlDeviceGetMPSComputeRunningProcesses_v3;
    PFN_nvmlDeviceGetTopologyCommonAncestor: nvmlDeviceGetTopologyCommonAncestor;
    PFN_nvmlDeviceGetTopologyNearestGpus: nvmlDeviceGetTopologyNearestGpus;
    PFN_nvmlSystemGetTopologyGpuSet: nvmlSystemGetTopologyGpuSet;
    PFN_nvmlDeviceGetP2PStatus: nvmlDeviceGetP2PStatus;
    PFN_nvmlDeviceGetNvLinkState: nvmlDeviceGetNvLinkState;
    PFN_nvmlDeviceGetNvLinkVersion: nvmlDeviceGetNvLinkVersion;
    PFN_nvmlDeviceGetNvLinkCapability: nvmlDeviceGetNvLinkCapability;
    PFN_nvmlDeviceGetNvLinkRemotePciInfo_v2: nvmlDeviceGetNvLinkRemotePciInfo_v2;
    PFN_nvmlDeviceGetNvLinkRemotePciInfo: nvmlDeviceGetNvLinkRemotePciInfo;
    PFN_nvmlDeviceGetNvLinkRemoteDeviceType: nvmlDeviceGetNvLinkRemoteDeviceType;
    PFN_nvmlDeviceGetCpuAffinity: nvmlDeviceGetCpuAffinity;
    PFN_nvmlDeviceGetCpuAffinityWithinScope: nvmlDeviceGetCpuAffinityWithinScope,
        nvmlDeviceGetMemoryAffinity;
    PFN_nvmlDeviceGetNumaNodeId: nvmlDeviceGetNumaNodeId;
}
