"""Helpers shared by the workload-shape scripts: cuda-python's driver API with every
result checked, and the VMM calls the workloads make (create, reserve, map, access)."""
import os
import sys

from cuda.bindings import driver as d

SUCCESS = d.CUresult.CUDA_SUCCESS


def ok(r):
    """The values of a cuda-python result tuple, or an exception naming the error."""
    if r[0] != SUCCESS:
        raise RuntimeError(f"CUDA error {int(r[0])} ({r[0]!r})")
    rest = r[1:]
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


def code(r):
    """The CUresult of a call as an int."""
    return int(r[0])


def init(dev_index=0):
    """cuInit, the device's primary context retained and made current: (dev, ctx)."""
    ok(d.cuInit(0))
    dev = ok(d.cuDeviceGet(dev_index))
    ctx = ok(d.cuDevicePrimaryCtxRetain(dev))
    ok(d.cuCtxSetCurrent(ctx))
    return dev, ctx


def prop(kind, loc_id=0, fd=False):
    """A pinned CUmemAllocationProp at location `kind` ('device', 'host', 'host_numa',
    'host_numa_current'); `fd`: exportable as a POSIX file descriptor."""
    p = d.CUmemAllocationProp()
    p.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    p.location.type = {
        "device": d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE,
        "host": d.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST,
        "host_numa": d.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST_NUMA,
        "host_numa_current": d.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT,
    }[kind]
    p.location.id = loc_id
    if fd:
        p.requestedHandleTypes = (
            d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        )
    return p


def granularity(p):
    return ok(d.cuMemGetAllocationGranularity(
        p, d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM))


def access_rw(ptr, size, devices):
    """Read-write access to [ptr, ptr+size) from each device ordinal in `devices`."""
    descs = []
    for dv in devices:
        a = d.CUmemAccessDesc()
        a.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        a.location.id = dv
        a.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        descs.append(a)
    ok(d.cuMemSetAccess(ptr, size, descs, len(descs)))


def map_new(handle, size, devices):
    """Reserves a range, maps `handle` there, gives `devices` access: the address."""
    va = ok(d.cuMemAddressReserve(size, 0, 0, 0))
    ok(d.cuMemMap(va, size, 0, handle, 0))
    access_rw(va, size, devices)
    return va


def meminfo():
    free, total = ok(d.cuMemGetInfo())
    return int(free), int(total)


def say(**kv):
    print(" ".join(f"{k}={v}" for k, v in kv.items()), flush=True)


def fail(msg):
    print(f"FAILED: {msg}", file=sys.stderr, flush=True)
    os._exit(1)


# The simulator's spin kernel (vgpu_cuda_sim::bench::SPIN_PTX): runs for its u64
# argument's nanoseconds of device time.
SPIN_PTX = b""".version 8.0
.target sm_90
.address_size 64

.visible .entry vgpu_sim_spin(.param .u64 vgpu_sim_spin_param_0)
{
    .reg .pred %p<2>;
    .reg .b64 %rd<5>;

    ld.param.u64 %rd1, [vgpu_sim_spin_param_0];
    mov.u64 %rd2, %globaltimer;
    add.s64 %rd3, %rd2, %rd1;
$L_spin:
    mov.u64 %rd4, %globaltimer;
    setp.lt.u64 %p1, %rd4, %rd3;
    @%p1 bra $L_spin;
    ret;
}
\0"""


def spin_function():
    """The spin kernel, loaded into the current context."""
    mod = ok(d.cuModuleLoadData(SPIN_PTX))
    return ok(d.cuModuleGetFunction(mod, b"vgpu_sim_spin"))


def launch_spin(fn, stream, ns):
    """One spin kernel of `ns` nanoseconds on `stream`."""
    import ctypes
    arg = ctypes.c_uint64(ns)
    params = (ctypes.c_void_p * 1)(ctypes.addressof(arg))
    ok(d.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, stream, ctypes.addressof(params), 0))


def capture_spins(fn, stream, count, ns):
    """A graph of `count` spin kernels captured on `stream` (global mode), instantiated."""
    ok(d.cuStreamBeginCapture(stream, d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL))
    for _ in range(count):
        launch_spin(fn, stream, ns)
    graph = ok(d.cuStreamEndCapture(stream))
    return ok(d.cuGraphInstantiate(graph, 0))
