"""cuda-python's driver bindings (``cuda.bindings.driver``), unmodified, on the simulated
driver. cuda-python dlopens ``libcuda.so.1``, looks up ``cuGetProcAddress_v2`` and resolves
every other entry point through it with the CUDA version of each binding."""

import json

PRELUDE = r"""
import ctypes, json, sys
from cuda.bindings import driver as cu

def ck(r):
    err = r[0]
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA call failed: {err!r}")
    return r[1] if len(r) == 2 else (r[1:] if len(r) > 2 else None)

PTX = b'''
.version 8.0
.target sm_90
.address_size 64
.visible .entry vgpu_sim_spin(.param .u64 ns) { ret; }
.visible .entry vgpu_sim_fill_u32(.param .u64 ptr, .param .u32 value, .param .u64 count) { ret; }
'''

def params(*vals):
    # kernelParams: an array of pointers, one per parameter value.
    keep = [ctypes.c_uint64(v) if isinstance(v, int) and not isinstance(v, bool) else v for v in vals]
    arr = (ctypes.c_void_p * len(keep))(*[ctypes.addressof(k) for k in keep])
    return arr, keep

ck(cu.cuInit(0))
dev = ck(cu.cuDeviceGet(0))
ctx = ck(cu.cuDevicePrimaryCtxRetain(dev))
ck(cu.cuCtxSetCurrent(ctx))
"""


def run(node, body):
    return node.python(PRELUDE + body)


def test_devices_and_attributes(node):
    node.configure(
        """
        [[device]]
        name = "NVIDIA A100-SXM4-40GB"
        memory = "40Gi"
        sm_count = 108
        compute_capability = "8.0"
        [[device]]
        """
    )
    out = run(
        node,
        r"""
A = cu.CUdevice_attribute
res = {
  "version": ck(cu.cuDriverGetVersion()),
  "count": ck(cu.cuDeviceGetCount()),
  "name": ck(cu.cuDeviceGetName(96, dev)).split(b"\0")[0].decode(),
  "mem": ck(cu.cuDeviceTotalMem(dev)),
  "sms": ck(cu.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev)),
  "cc": [ck(cu.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)),
         ck(cu.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev))],
  "dev1_mem": ck(cu.cuDeviceTotalMem(ck(cu.cuDeviceGet(1)))),
  "uuid": bytes(ck(cu.cuDeviceGetUuid(dev)).bytes).hex(),
}
print(json.dumps(res))
""",
    )
    r = json.loads(out)
    assert r["version"] == 13000
    assert r["count"] == 2
    assert r["name"] == "NVIDIA A100-SXM4-40GB"
    assert r["mem"] == 40 << 30
    assert r["sms"] == 108
    assert r["cc"] == [8, 0]
    assert r["dev1_mem"] == 80 << 30
    assert len(r["uuid"]) == 32


def test_memory_copies_and_accounting(node):
    out = run(
        node,
        r"""
free0, total = ck(cu.cuMemGetInfo())
buf = ck(cu.cuMemAlloc(3 << 20))
free1, _ = ck(cu.cuMemGetInfo())
src = (ctypes.c_uint8 * (3 << 20))(*[(i * 7) & 0xff for i in range(3 << 20)])
ck(cu.cuMemcpyHtoD(buf, ctypes.addressof(src), 3 << 20))
back = (ctypes.c_uint8 * (3 << 20))()
ck(cu.cuMemcpyDtoH(ctypes.addressof(back), buf, 3 << 20))
same = bytes(src) == bytes(back)
# async copies through pinned memory on a stream, and a memset
pinned = ck(cu.cuMemAllocHost(4096))
stream = ck(cu.cuStreamCreate(0))
ck(cu.cuMemsetD32Async(buf, 0xdeadbeef, 1024, stream))
ck(cu.cuMemcpyDtoHAsync(pinned, buf, 4096, stream))
ck(cu.cuStreamSynchronize(stream))
words = (ctypes.c_uint32 * 1024).from_address(int(pinned))
memset_ok = all(w == 0xdeadbeef for w in words)
ck(cu.cuMemFree(buf))
free2, _ = ck(cu.cuMemGetInfo())
err = cu.cuMemAlloc(total + 1)[0]
print(json.dumps({"free0": free0, "free1": free1, "free2": free2, "same": same,
                  "memset_ok": memset_ok, "oom": err == cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY}))
""",
    )
    r = json.loads(out)
    assert r["same"] and r["memset_ok"]
    # 3 MiB is charged as two 2 MiB granules, and given back on free.
    assert r["free0"] - r["free1"] == 4 << 20
    assert r["free2"] == r["free0"]
    assert r["oom"]


def test_ptx_module_launch_and_event_timing(node):
    out = run(
        node,
        r"""
mod = ck(cu.cuModuleLoadData(PTX))
spin = ck(cu.cuModuleGetFunction(mod, b"vgpu_sim_spin"))
fill = ck(cu.cuModuleGetFunction(mod, b"vgpu_sim_fill_u32"))
stream = ck(cu.cuStreamCreate(0))
buf = ck(cu.cuMemAlloc(4 * 1000))
p, keep = params(int(buf), ctypes.c_uint32(7), 1000)
ck(cu.cuLaunchKernel(fill, 4, 1, 1, 256, 1, 1, 0, stream, ctypes.addressof(p), 0))
start, end = ck(cu.cuEventCreate(0)), ck(cu.cuEventCreate(0))
ck(cu.cuEventRecord(start, stream))
p2, keep2 = params(20_000_000)
ck(cu.cuLaunchKernel(spin, 1, 1, 1, 1, 1, 1, 0, stream, ctypes.addressof(p2), 0))
ck(cu.cuEventRecord(end, stream))
pending = cu.cuEventQuery(end)[0] == cu.CUresult.CUDA_ERROR_NOT_READY
ck(cu.cuEventSynchronize(end))
ms = ck(cu.cuEventElapsedTime(start, end))
out = (ctypes.c_uint32 * 1000)()
ck(cu.cuMemcpyDtoH(ctypes.addressof(out), buf, 4000))
missing = cu.cuModuleGetFunction(mod, b"nope")[0] == cu.CUresult.CUDA_ERROR_NOT_FOUND
print(json.dumps({"ms": ms, "pending": pending, "filled": all(v == 7 for v in out), "missing": missing}))
""",
    )
    r = json.loads(out)
    assert r["filled"] and r["missing"]
    assert r["pending"], "a 20 ms kernel cannot have finished right after its launch"
    # Events measure device time: at least the kernel's 20 ms.
    assert r["ms"] >= 20.0


def test_stream_capture_and_graph_launch(node):
    out = run(
        node,
        r"""
mod = ck(cu.cuModuleLoadData(PTX))
fill = ck(cu.cuModuleGetFunction(mod, b"vgpu_sim_fill_u32"))
stream = ck(cu.cuStreamCreate(0))
buf = ck(cu.cuMemAlloc(4 * 64))
ck(cu.cuStreamBeginCapture(stream, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL))
p, keep = params(int(buf), ctypes.c_uint32(42), 64)
ck(cu.cuLaunchKernel(fill, 1, 1, 1, 64, 1, 1, 0, stream, ctypes.addressof(p), 0))
status = ck(cu.cuStreamIsCapturing(stream))
graph = ck(cu.cuStreamEndCapture(stream))
before = (ctypes.c_uint32 * 64)()
ck(cu.cuMemcpyDtoH(ctypes.addressof(before), buf, 256))
exe = ck(cu.cuGraphInstantiate(graph, 0))
ck(cu.cuGraphLaunch(exe, stream))
ck(cu.cuStreamSynchronize(stream))
after = (ctypes.c_uint32 * 64)()
ck(cu.cuMemcpyDtoH(ctypes.addressof(after), buf, 256))
print(json.dumps({"capturing": int(status), "before": list(before)[:2], "after": all(v == 42 for v in after)}))
""",
    )
    r = json.loads(out)
    assert r["capturing"] == 1
    assert r["before"] == [0, 0], "captured work must not run during capture"
    assert r["after"]


def test_a_capture_adds_to_the_graph_it_names(node):
    # cuStreamBeginCaptureToGraph (CUDA 12.3): the captured nodes go into an existing
    # graph, after the dependencies named, and cuStreamEndCapture returns that graph.
    out = run(
        node,
        r"""
mod = ck(cu.cuModuleLoadData(PTX))
fill = ck(cu.cuModuleGetFunction(mod, b"vgpu_sim_fill_u32"))
stream = ck(cu.cuStreamCreate(0))
a, b = ck(cu.cuMemAlloc(4 * 64)), ck(cu.cuMemAlloc(4 * 64))
GLOBAL = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL
graph = ck(cu.cuGraphCreate(0))
ck(cu.cuStreamBeginCaptureToGraph(stream, graph, None, None, 0, GLOBAL))
pa, keep_a = params(int(a), ctypes.c_uint32(7), 64)
ck(cu.cuLaunchKernel(fill, 1, 1, 1, 64, 1, 1, 0, stream, ctypes.addressof(pa), 0))
first = ck(cu.cuStreamEndCapture(stream))
nodes, n = ck(cu.cuGraphGetNodes(graph, 8))
# A second capture into the same graph, after the first one's node.
ck(cu.cuStreamBeginCaptureToGraph(stream, graph, [nodes[0]], None, 1, GLOBAL))
pb, keep_b = params(int(b), ctypes.c_uint32(9), 64)
ck(cu.cuLaunchKernel(fill, 1, 1, 1, 64, 1, 1, 0, stream, ctypes.addressof(pb), 0))
second = ck(cu.cuStreamEndCapture(stream))
_, n2 = ck(cu.cuGraphGetNodes(graph, 8))
exe = ck(cu.cuGraphInstantiate(graph, 0))
ck(cu.cuGraphLaunch(exe, stream))
ck(cu.cuStreamSynchronize(stream))
va, vb = (ctypes.c_uint32 * 64)(), (ctypes.c_uint32 * 64)()
ck(cu.cuMemcpyDtoH(ctypes.addressof(va), a, 256))
ck(cu.cuMemcpyDtoH(ctypes.addressof(vb), b, 256))
# A dependency that is no node of the graph, and no graph at all, are refused.
other = ck(cu.cuGraphCreate(0))
bad_dep = cu.cuStreamBeginCaptureToGraph(stream, other, [nodes[0]], None, 1, GLOBAL)[0].name
status = int(ck(cu.cuStreamIsCapturing(stream)))
print(json.dumps({
    "same": [int(first) == int(graph), int(second) == int(graph)],
    "nodes": [n, n2],
    "filled": [all(v == 7 for v in va), all(v == 9 for v in vb)],
    "bad_dep": bad_dep,
    "status_after_bad": status,
}))
""",
    )
    r = json.loads(out)
    assert r["same"] == [True, True], r
    assert r["nodes"] == [1, 2], r
    assert r["filled"] == [True, True], r
    assert r["bad_dep"] == "CUDA_ERROR_INVALID_VALUE", r
    assert r["status_after_bad"] == 0, r


def test_stream_memory_operations_wait_for_and_write_words(node):
    # cuStreamWaitValue32/64, cuStreamWriteValue32/64 and cuStreamBatchMemOp: a stream
    # waiting on a word of mapped host memory runs nothing after the wait until the host
    # writes the word; the writes land in order after the work before them.
    out = run(
        node,
        r"""
import time
A = cu.CUdevice_attribute
attrs = [ck(cu.cuDeviceGetAttribute(getattr(A, n), dev)) for n in (
    "CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS",
    "CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR")]
mod = ck(cu.cuModuleLoadData(PTX))
fill = ck(cu.cuModuleGetFunction(mod, b"vgpu_sim_fill_u32"))
stream = ck(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
host = ck(cu.cuMemHostAlloc(4096, 2))  # CU_MEMHOSTALLOC_DEVICEMAP
words = (ctypes.c_uint32 * 16).from_address(int(host))
dflag = int(ck(cu.cuMemHostGetDevicePointer(host, 0)))
buf = ck(cu.cuMemAlloc(4 * 64))
W = cu.CUstreamWaitValue_flags
ck(cu.cuStreamWaitValue32(stream, dflag, 1, W.CU_STREAM_WAIT_VALUE_GEQ))
pa, keep = params(int(buf), ctypes.c_uint32(5), 64)
ck(cu.cuLaunchKernel(fill, 1, 1, 1, 64, 1, 1, 0, stream, ctypes.addressof(pa), 0))
ck(cu.cuStreamWriteValue32(stream, dflag + 4, 42, 0))
time.sleep(0.1)
held = [cu.cuStreamQuery(stream)[0].name, words[1]]
words[0] = 1
ck(cu.cuStreamSynchronize(stream))
after = words[1]
# A batch: a 64-bit write, a wait on it, then a 32-bit write.
P = cu.CUstreamBatchMemOpType
ops = [cu.CUstreamBatchMemOpParams() for _ in range(3)]
ops[0].writeValue.operation = P.CU_STREAM_MEM_OP_WRITE_VALUE_64
ops[0].writeValue.address = dflag + 8
ops[0].writeValue.value64 = 0x1122334455667788
ops[1].waitValue.operation = P.CU_STREAM_MEM_OP_WAIT_VALUE_64
ops[1].waitValue.address = dflag + 8
ops[1].waitValue.value64 = 0x1122334455667788
ops[1].waitValue.flags = W.CU_STREAM_WAIT_VALUE_EQ
ops[2].writeValue.operation = P.CU_STREAM_MEM_OP_WRITE_VALUE_32
ops[2].writeValue.address = dflag + 16
ops[2].writeValue.value = 7
ck(cu.cuStreamBatchMemOp(stream, 3, ops, 0))
ck(cu.cuStreamSynchronize(stream))
wide = words[2] | (words[3] << 32)
filled = (ctypes.c_uint32 * 64)()
ck(cu.cuMemcpyDtoH(ctypes.addressof(filled), buf, 256))
pageable = (ctypes.c_uint32 * 4)()
errors = [
    cu.cuStreamWaitValue32(stream, dflag + 2, 1, 0)[0].name,
    cu.cuStreamWaitValue32(stream, ctypes.addressof(pageable), 1, 0)[0].name,
    cu.cuStreamWaitValue32(stream, dflag, 1, W.CU_STREAM_WAIT_VALUE_FLUSH)[0].name,
    cu.cuStreamWriteValue64(stream, dflag + 4, 1, 0)[0].name,
]
print(json.dumps({"attrs": attrs, "held": held, "after": after, "wide": wide,
                  "batch32": words[4], "filled": all(v == 5 for v in filled),
                  "errors": errors}))
""",
    )
    r = json.loads(out)
    assert r["attrs"] == [1, 1], r
    assert r["held"] == ["CUDA_ERROR_NOT_READY", 0], r
    assert r["after"] == 42, r
    assert r["wide"] == 0x1122334455667788, r
    assert r["batch32"] == 7, r
    assert r["filled"], r
    assert r["errors"] == [
        "CUDA_ERROR_INVALID_VALUE",
        "CUDA_ERROR_INVALID_VALUE",
        "CUDA_ERROR_NOT_SUPPORTED",
        "CUDA_ERROR_INVALID_VALUE",
    ], r


def test_a_device_synchronization_from_another_thread_invalidates_a_capture(node):
    # CUDA's behaviour (measured on NVIDIA hardware by others): a device-wide
    # synchronization while a stream of the device captures is refused and invalidates
    # the capture, whichever thread makes it and in whatever capture mode. An event last
    # recorded in a capture cannot be queried until it is recorded outside one.
    out = run(
        node,
        r"""
import threading
mod = ck(cu.cuModuleLoadData(PTX))
spin = ck(cu.cuModuleGetFunction(mod, b"vgpu_sim_spin"))
stream = ck(cu.cuStreamCreate(0))
ev = ck(cu.cuEventCreate(0))
res = {}
for mode in ("GLOBAL", "THREAD_LOCAL", "RELAXED"):
    ck(cu.cuStreamBeginCapture(stream, getattr(cu.CUstreamCaptureMode, "CU_STREAM_CAPTURE_MODE_" + mode)))
    p, keep = params(1000)
    ck(cu.cuLaunchKernel(spin, 1, 1, 1, 1, 1, 1, 0, stream, ctypes.addressof(p), 0))
    ck(cu.cuEventRecord(ev, stream))
    query = cu.cuEventQuery(ev)[0]
    def other():
        ck(cu.cuCtxSetCurrent(ctx))
        # The other thread in relaxed mode: its synchronization still invalidates.
        ck(cu.cuThreadExchangeStreamCaptureMode(cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED))
        res[mode + "_sync"] = cu.cuCtxSynchronize()[0].name
    t = threading.Thread(target=other)
    t.start(); t.join()
    res[mode + "_status"] = int(ck(cu.cuStreamIsCapturing(stream)))
    res[mode + "_end"] = cu.cuStreamEndCapture(stream)[0].name
    res[mode + "_query"] = query.name
ck(cu.cuEventRecord(ev, stream))
ck(cu.cuStreamSynchronize(stream))
res["query_after"] = cu.cuEventQuery(ev)[0].name
# The mode a thread sets is the one it gets back.
old = ck(cu.cuThreadExchangeStreamCaptureMode(cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED))
back = ck(cu.cuThreadExchangeStreamCaptureMode(old))
res["modes"] = [int(old), int(back)]
# Without a capture, a synchronization is a synchronization.
res["sync_idle"] = cu.cuCtxSynchronize()[0].name
print(json.dumps(res))
""",
    )
    r = json.loads(out)
    for mode in ("GLOBAL", "THREAD_LOCAL", "RELAXED"):
        assert r[mode + "_sync"] == "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", (mode, r)
        assert r[mode + "_status"] == 2, (mode, r)  # invalidated
        assert r[mode + "_end"] == "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED", (mode, r)
        assert r[mode + "_query"] == "CUDA_ERROR_CAPTURED_EVENT", (mode, r)
    assert r["query_after"] == "CUDA_SUCCESS", r
    assert r["modes"] == [0, 2], r
    assert r["sync_idle"] == "CUDA_SUCCESS", r


def test_out_of_memory_on_a_small_gpu(node):
    node.configure('[[device]]\nmemory = "1Gi"\ncontext_overhead = "256Mi"\n')
    out = run(
        node,
        r"""
bufs, err = [], None
while True:
    r = cu.cuMemAlloc(64 << 20)
    if r[0] != cu.CUresult.CUDA_SUCCESS:
        err = r[0]
        break
    bufs.append(r[1])
print(json.dumps({"n": len(bufs), "err": cu.cuGetErrorName(err)[1].decode()}))
""",
    )
    r = json.loads(out)
    assert r["n"] == (1024 - 256) // 64
    assert r["err"] == "CUDA_ERROR_OUT_OF_MEMORY"


def test_entry_points_resolve_through_cuGetProcAddress(node):
    node.env["VGPU_SIM_TRACE"] = "1"
    r = node.run(
        __import__("sys").executable,
        "-c",
        PRELUDE + "ck(cu.cuMemFree(ck(cu.cuMemAlloc(1 << 20))))\n",
    )
    trace = r.stderr
    # Each binding asks for the ABI version it was built against.
    assert "cuGetProcAddress(cuMemAlloc, 3020, 0) -> cuMemAlloc_v2" in trace
    assert "cuGetProcAddress(cuCtxCreate, 12050, 0) -> cuCtxCreate_v4" in trace
    assert "cuGetProcAddress(cuLaunchKernel, 4000, 0) -> cuLaunchKernel" in trace
