"""A CUDA program for the NVML tests: it uses the simulated GPU through the driver API
(ctypes on ``libcuda.so.1``), the way any CUDA application does, so NVML sees a real
process with a context and memory.

Usage: ``gpu_process.py BYTES [busy] [dev=N]``. It creates a context on device N
(default 0), allocates
BYTES, prints ``READY <free> <total>`` (``cuMemGetInfo`` after the allocation) and then
sleeps, or with ``busy`` keeps the GPU saturated with ``vgpu_sim_spin`` launches, until
it is killed.
"""

import ctypes
import sys
import time

PTX = b"""
.version 8.0
.target sm_90
.address_size 64
.visible .entry vgpu_sim_spin(
    .param .u64 vgpu_sim_spin_param_0
)
{
    ret;
}
"""


def check(rc, what):
    if rc != 0:
        sys.exit(f"{what} failed: CUresult {rc}")


def main():
    nbytes = int(sys.argv[1])
    busy = "busy" in sys.argv[2:]
    ordinal = next((int(a[4:]) for a in sys.argv[2:] if a.startswith("dev=")), 0)
    cu = ctypes.CDLL("libcuda.so.1")
    check(cu.cuInit(0), "cuInit")
    dev = ctypes.c_int()
    check(cu.cuDeviceGet(ctypes.byref(dev), ordinal), "cuDeviceGet")
    ctx = ctypes.c_void_p()
    check(cu.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev), "cuCtxCreate_v2")
    ptr = ctypes.c_uint64()
    check(cu.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(nbytes)), "cuMemAlloc_v2")
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    check(cu.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)), "cuMemGetInfo_v2")
    func = None
    if busy:
        mod = ctypes.c_void_p()
        check(cu.cuModuleLoadData(ctypes.byref(mod), ctypes.c_char_p(PTX)), "cuModuleLoadData")
        func = ctypes.c_void_p()
        check(cu.cuModuleGetFunction(ctypes.byref(func), mod, b"vgpu_sim_spin"), "cuModuleGetFunction")
    print(f"READY {free.value} {total.value}", flush=True)
    if not busy:
        while True:
            time.sleep(1)
    ns = ctypes.c_uint64(50_000_000)  # 50 ms of device time per launch
    params = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.byref(ns), ctypes.c_void_p))
    while True:
        check(
            cu.cuLaunchKernel(func, 1, 1, 1, 1, 1, 1, 0, None, params, None),
            "cuLaunchKernel",
        )
        check(cu.cuCtxSynchronize(), "cuCtxSynchronize")


if __name__ == "__main__":
    main()
