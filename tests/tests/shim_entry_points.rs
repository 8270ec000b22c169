//! Every entry point of CUDA 13's `cuda.h` that allocates, frees, reports memory or
//! launches work is decided (issue 41 item 2): intercepted (a row of the shim's one
//! table, reached through `cuGetProcAddress` by version like every other route) or
//! passed through with its reason. The names are those `cuda.h` 13.0 declares after
//! its version macros (`cuCtxCreate` → `cuCtxCreate_v4`, `cuMemAdvise` →
//! `cuMemAdvise_v2`, …), as cudarc's `cuda-13000` bindings list them. A real process
//! then resolves each intercepted one through `cuGetProcAddress_v2` at CUDA 13.0 (and
//! with the per-thread-stream flag where a `_ptsz` row exists) and must get the hook.

use vgpu_tests::{Container, SimNode, field};

/// A row of the shim's table (`shim/src/table.rs`, its `rows!` macro), read from the
/// source: linking the shim's library into this test binary would put its `dlsym` and
/// driver hooks into the test process itself.
#[derive(Debug, Clone)]
struct Row {
    symbol: String,
    cuda: bool,
    base: String,
    since: i32,
    per_thread: bool,
}

/// The rows of the shim's table, in order.
fn rows() -> Vec<Row> {
    let src = include_str!("../../shim/src/table.rs");
    src.lines()
        .filter_map(|l| {
            let (symbol, rest) = l.trim().split_once(": ")?;
            let mut f = rest.split_whitespace();
            let lib = f.next()?;
            let base = f.next()?.strip_prefix('"')?.strip_suffix('"')?;
            let since = f.next()?.parse().ok()?;
            let per_thread = f.next()?.parse().ok()?;
            f.next()?.strip_prefix("PFN_")?;
            Some(Row {
                symbol: symbol.to_owned(),
                cuda: lib == "Cuda",
                base: base.to_owned(),
                since,
                per_thread,
            })
        })
        .collect()
}

/// The row of exported symbol `name`.
fn find(rows: &[Row], name: &str) -> Option<Row> {
    rows.iter().find(|r| r.symbol == name).cloned()
}

/// What libvgpu.so does with an entry point of `cuda.h` 13.0.
enum Decision {
    /// Intercepted: a row of the shim's table of this exported symbol.
    Hooked,
    /// Passed through, and why.
    Passed(&'static str),
}
use Decision::{Hooked, Passed};

const HOST: &str = "host memory: no device memory";
const QUERY: &str = "a query or a setting: no memory, no launch";
const GRAPH_MEM: &str =
    "graph memory nodes are not simulated (a known limit in docs/shim.md): not charged";
const GREEN: &str = "green contexts are not simulated (a known limit): not counted";
const IMPORT: &str =
    "memory of another process: charged once, to the allocator (tests/tests/shim_ipc.rs)";
const MODULE: &str = "module images: the simulator charges no device memory for them";

/// `cuda.h` 13.0's allocation, free, memory-report and launch entry points.
const CUDA13: &[(&str, Decision)] = &[
    ("cuInit", Hooked),
    ("cuGetProcAddress_v2", Hooked),
    ("cuMemGetInfo_v2", Hooked),
    ("cuDeviceTotalMem_v2", Hooked),
    ("cuMemAlloc_v2", Hooked),
    ("cuMemAllocPitch_v2", Hooked),
    ("cuMemAllocManaged", Hooked),
    ("cuMemFree_v2", Hooked),
    ("cuMemAllocAsync", Hooked),
    ("cuMemAllocFromPoolAsync", Hooked),
    ("cuMemFreeAsync", Hooked),
    ("cuMemPoolCreate", Hooked),
    ("cuMemPoolDestroy", Hooked),
    ("cuMemPoolTrimTo", Hooked),
    ("cuMemPoolSetAttribute", Hooked),
    ("cuStreamSynchronize", Hooked),
    ("cuEventSynchronize", Hooked),
    ("cuCtxSynchronize", Hooked),
    ("cuCtxSynchronize_v2", Hooked),
    ("cuMemCreate", Hooked),
    ("cuMemRelease", Hooked),
    ("cuMemMap", Hooked),
    ("cuMemUnmap", Hooked),
    ("cuMemRetainAllocationHandle", Hooked),
    ("cuArrayCreate_v2", Hooked),
    ("cuArray3DCreate_v2", Hooked),
    ("cuArrayDestroy", Hooked),
    ("cuMipmappedArrayCreate", Hooked),
    ("cuMipmappedArrayDestroy", Hooked),
    ("cuDevicePrimaryCtxRetain", Hooked),
    ("cuDevicePrimaryCtxRelease_v2", Hooked),
    ("cuDevicePrimaryCtxReset_v2", Hooked),
    ("cuCtxCreate_v4", Hooked),
    ("cuCtxDestroy_v2", Hooked),
    ("cuLaunchKernel", Hooked),
    ("cuLaunchKernelEx", Hooked),
    ("cuLaunchCooperativeKernel", Hooked),
    ("cuGraphLaunch", Hooked),
    ("cuStreamBeginCapture_v2", Hooked),
    ("cuStreamBeginCaptureToGraph", Hooked),
    ("cuStreamEndCapture", Hooked),
    (
        "cuDeviceGetUuid_v2",
        Passed("identity, no memory: the CUDA ordinals are the container's already"),
    ),
    (
        "cuMemAdvise_v2",
        Passed("managed memory is charged in full at cuMemAllocManaged; advice moves no charge"),
    ),
    (
        "cuMemPrefetchAsync_v2",
        Passed("as cuMemAdvise_v2: a prefetch moves managed pages, already charged"),
    ),
    (
        "cuMemPrefetchBatchAsync",
        Passed("as cuMemPrefetchAsync_v2"),
    ),
    (
        "cuMemDiscardBatchAsync",
        Passed("discards managed pages' contents: no charge changes"),
    ),
    (
        "cuMemDiscardAndPrefetchBatchAsync",
        Passed("as cuMemDiscardBatchAsync"),
    ),
    ("cuMemAllocHost_v2", Passed(HOST)),
    ("cuMemHostAlloc", Passed(HOST)),
    ("cuMemFreeHost", Passed(HOST)),
    ("cuMemHostRegister_v2", Passed(HOST)),
    ("cuMemAddressReserve", Passed("virtual addresses only")),
    ("cuMemAddressFree", Passed("virtual addresses only")),
    (
        "cuMemSetAccess",
        Passed("access rights of mapped, charged memory"),
    ),
    ("cuMemGetAllocationGranularity", Passed(QUERY)),
    ("cuMemGetAllocationPropertiesFromHandle", Passed(QUERY)),
    ("cuMemGetAddressRange_v2", Passed(QUERY)),
    (
        "cuMemMapArrayAsync",
        Passed("maps cuMemCreate handles (charged there) into sparse arrays"),
    ),
    ("cuMipmappedArrayGetLevel", Passed(QUERY)),
    ("cuMipmappedArrayGetMemoryRequirements", Passed(QUERY)),
    ("cuMipmappedArrayGetSparseProperties", Passed(QUERY)),
    ("cuMemPoolGetAttribute", Passed(QUERY)),
    ("cuMemPoolSetAccess", Passed(QUERY)),
    ("cuMemPoolGetAccess", Passed(QUERY)),
    ("cuDeviceGetDefaultMemPool", Passed(QUERY)),
    ("cuDeviceGetMemPool", Passed(QUERY)),
    (
        "cuDeviceSetMemPool",
        Passed("a setting: the pool's device is read at each allocation"),
    ),
    ("cuDevicePrimaryCtxGetState", Passed(QUERY)),
    ("cuDevicePrimaryCtxSetFlags_v2", Passed(QUERY)),
    ("cuMemPoolExportPointer", Passed(IMPORT)),
    ("cuMemPoolImportPointer", Passed(IMPORT)),
    ("cuMemPoolExportToShareableHandle", Passed(IMPORT)),
    ("cuMemPoolImportFromShareableHandle", Passed(IMPORT)),
    (
        "cuIpcGetMemHandle",
        Passed("the exported allocation was charged at cuMemAlloc"),
    ),
    ("cuIpcOpenMemHandle_v2", Passed(IMPORT)),
    ("cuIpcCloseMemHandle", Passed(IMPORT)),
    (
        "cuIpcGetEventHandle",
        Passed("events: no memory, no launch"),
    ),
    (
        "cuIpcOpenEventHandle",
        Passed("events: no memory, no launch"),
    ),
    (
        "cuMemExportToShareableHandle",
        Passed("the exported allocation was charged at cuMemCreate"),
    ),
    ("cuMemImportFromShareableHandle", Passed(IMPORT)),
    (
        "cuMulticastCreate",
        Passed("multicast objects bind cuMemCreate memory, charged there; not simulated"),
    ),
    ("cuMulticastBindMem", Passed("as cuMulticastCreate")),
    ("cuMulticastBindAddr", Passed("as cuMulticastCreate")),
    ("cuGraphAddMemAllocNode", Passed(GRAPH_MEM)),
    ("cuGraphAddMemFreeNode", Passed(GRAPH_MEM)),
    ("cuDeviceGraphMemTrim", Passed(GRAPH_MEM)),
    (
        "cuGraphInstantiateWithFlags",
        Passed("instantiation runs nothing (and graph memory nodes are not simulated)"),
    ),
    (
        "cuGraphInstantiateWithParams",
        Passed("as cuGraphInstantiateWithFlags"),
    ),
    (
        "cuGraphExecUpdate_v2",
        Passed("updates an instantiated graph: runs nothing"),
    ),
    (
        "cuGraphUpload",
        Passed("uploads an instantiated graph: runs nothing"),
    ),
    ("cuGraphExecDestroy", Passed("no memory in the simulator")),
    ("cuLaunchHostFunc", Passed("a host callback: no kernel")),
    (
        "cuLaunch",
        Passed(
            "legacy launch (cuFuncSetBlockShape/cuParamSet*): not in the simulator, not gated (a known limit)",
        ),
    ),
    (
        "cuLaunchGrid",
        Passed("as cuLaunch: not gated (a known limit)"),
    ),
    (
        "cuLaunchGridAsync",
        Passed("as cuLaunch: not gated (a known limit)"),
    ),
    (
        "cuLaunchCooperativeKernelMultiDevice",
        Passed("deprecated, not in the simulator: not gated (a known limit)"),
    ),
    (
        "cuMemcpyPeer",
        Passed("a copy: copies are not gated, no memory"),
    ),
    ("cuMemcpyPeerAsync", Passed("as cuMemcpyPeer")),
    (
        "cuCtxEnablePeerAccess",
        Passed("peer mappings of memory charged where it was allocated"),
    ),
    (
        "cuMemBatchDecompressAsync",
        Passed("a copy engine operation: no memory, no kernel"),
    ),
    ("cuModuleLoad", Passed(MODULE)),
    ("cuModuleLoadData", Passed(MODULE)),
    ("cuModuleLoadDataEx", Passed(MODULE)),
    ("cuModuleLoadFatBinary", Passed(MODULE)),
    ("cuLibraryLoadData", Passed(MODULE)),
    ("cuLibraryLoadFromFile", Passed(MODULE)),
    ("cuGreenCtxCreate", Passed(GREEN)),
    ("cuGreenCtxDestroy", Passed(GREEN)),
    ("cuCtxFromGreenCtx", Passed(GREEN)),
    ("cuDevResourceGenerateDesc", Passed(GREEN)),
];

#[test]
fn every_cuda_13_memory_and_launch_entry_point_is_decided() {
    let table = rows();
    assert!(
        table.len() > 80,
        "the table's rows were not read: {}",
        table.len()
    );
    let mut missing = Vec::new();
    for (name, d) in CUDA13 {
        let row = find(&table, name);
        match d {
            Hooked if row.is_none() => missing.push(*name),
            Passed(why) => {
                assert!(
                    row.is_none(),
                    "{name} is hooked and listed as passed ({why})"
                );
                assert!(!why.is_empty());
            }
            Hooked => {}
        }
    }
    assert!(
        missing.is_empty(),
        "decided as hooked but not in the table: {missing:?}"
    );
    // No name twice.
    let mut names: Vec<&str> = CUDA13.iter().map(|(n, _)| *n).collect();
    names.sort_unstable();
    let before = names.len();
    names.dedup();
    assert_eq!(before, names.len(), "a name is listed twice");
    // Every CUDA row of the table is a name of cuda.h 13.0 or an older ABI of one.
    for e in table.iter().filter(|e| e.cuda) {
        assert!(
            CUDA13.iter().any(|(n, _)| n.starts_with(&e.base)),
            "table row {} has no entry point in cuda.h 13.0's list",
            e.symbol
        );
    }
}

#[test]
fn cu_get_proc_address_at_cuda_13_yields_every_hook() {
    let node = SimNode::new(
        r#"
        [[device]]
        memory = "8Gi"
        alloc_granularity = "2Mi"
        "#,
    );
    let c = Container::new("1Gi");
    // The newest row of each base name at CUDA 13.0 (what the driver resolves), in
    // both stream flavours where the table has them.
    let table = rows();
    let mut bases: Vec<String> = CUDA13
        .iter()
        .filter(|(_, d)| matches!(d, Hooked))
        .filter_map(|(n, _)| find(&table, n))
        .map(|r| r.base)
        .collect();
    bases.sort_unstable();
    bases.dedup();
    let mut args = vec!["init".to_owned()];
    let mut want = Vec::new();
    for base in bases {
        for (per_thread, flags) in [(false, "0"), (true, "2")] {
            let newest = table
                .iter()
                .filter(|e| e.cuda && e.base == base && e.per_thread == per_thread)
                .filter(|e| e.since <= 13000)
                .max_by_key(|e| e.since);
            let Some(e) = newest else { continue };
            args.extend([
                "procaddr".to_owned(),
                base.clone(),
                "13000".to_owned(),
                flags.to_owned(),
                "symaddr".to_owned(),
                e.symbol.clone(),
            ]);
            want.push((base.clone(), e.symbol.clone(), flags));
        }
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = node.probe_in(Some(&c), &args);
    // One line per command: a procaddr line, then its symaddr line.
    let lines: Vec<&str> = out
        .lines()
        .filter(|l| l.starts_with("procaddr_") || l.starts_with("symaddr_"))
        .collect();
    assert_eq!(lines.len(), want.len() * 2, "{out}");
    for (i, (base, sym, flags)) in want.iter().enumerate() {
        let got = field(lines[2 * i], &format!("procaddr_{base}")).expect("procaddr=");
        let hook = field(lines[2 * i + 1], &format!("symaddr_{sym}")).expect("symaddr=");
        assert_ne!(hook, "0x0", "{sym} is not exported by libvgpu.so");
        assert_eq!(
            got,
            hook,
            "cuGetProcAddress_v2({base}, 13000, flags {flags}) did not yield the hook {sym}: {}",
            lines[2 * i]
        );
    }
}
