"""Every GPU's memory as one process sees it, through CUDA and NVML, whatever its
CUDA_VISIBLE_DEVICES (`visible_views.py [DEV MIB]`):
  - per CUDA ordinal i: cuda_uuid_i, cuda_total_i, cuda_used_i (cuMemGetInfo),
    cuda_totalmem_i (cuDeviceTotalMem);
  - per NVML index j: nvml_uuid_j, nvml_total_j / nvml_used_j (memory info v1),
    nvml2_total_j / nvml2_used_j (v2), and byuuid_total_j / byuuid_used_j (the handle
    found by its UUID);
  - env_quota: VGPU_MEMORY_QUOTA_BYTES as the interpreter found it at its start (the
    quota the shim publishes, read before any CUDA call);
  - with DEV MIB: first allocates MIB MiB on CUDA device DEV, prints `ready` and holds it
    until stdin closes, then prints the views again (prefixed `after_`)."""
import os
import sys

import pynvml as n

from cu import d, ok, say

MIB = 1 << 20


def uuid(raw):
    h = bytes(raw).hex()
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


say(env_quota=os.environ.get("VGPU_MEMORY_QUOTA_BYTES", "unset"))
ok(d.cuInit(0))
count = ok(d.cuDeviceGetCount())
ctxs = []
for i in range(count):
    dev = ok(d.cuDeviceGet(i))
    ctxs.append((dev, ok(d.cuDevicePrimaryCtxRetain(dev))))
n.nvmlInit()


def views(prefix=""):
    say(**{f"{prefix}cuda_count": count})
    for i, (dev, ctx) in enumerate(ctxs):
        ok(d.cuCtxSetCurrent(ctx))
        free, total = ok(d.cuMemGetInfo())
        say(**{
            f"{prefix}cuda_uuid_{i}": uuid(ok(d.cuDeviceGetUuid(dev)).bytes),
            f"{prefix}cuda_total_{i}": int(total),
            f"{prefix}cuda_used_{i}": int(total) - int(free),
            f"{prefix}cuda_totalmem_{i}": int(ok(d.cuDeviceTotalMem(dev))),
        })
    for j in range(n.nvmlDeviceGetCount()):
        h = n.nvmlDeviceGetHandleByIndex(j)
        u = n.nvmlDeviceGetUUID(h)
        u = u.decode() if isinstance(u, bytes) else u
        m1 = n.nvmlDeviceGetMemoryInfo(h)
        m2 = n.nvmlDeviceGetMemoryInfo(h, version=n.nvmlMemory_v2)
        mu = n.nvmlDeviceGetMemoryInfo(n.nvmlDeviceGetHandleByUUID(u))
        say(**{
            f"{prefix}nvml_uuid_{j}": u,
            f"{prefix}nvml_total_{j}": m1.total,
            f"{prefix}nvml_used_{j}": m1.used,
            f"{prefix}nvml2_total_{j}": m2.total,
            f"{prefix}nvml2_used_{j}": m2.used,
            f"{prefix}byuuid_total_{j}": mu.total,
            f"{prefix}byuuid_used_{j}": mu.used,
        })


views()
if len(sys.argv) > 2:
    dev, mib = int(sys.argv[1]), int(sys.argv[2])
    ok(d.cuCtxSetCurrent(ctxs[dev][1]))
    p = ok(d.cuMemAlloc(mib * MIB))
    views("after_")
    print("ready", flush=True)
    sys.stdin.read()
    ok(d.cuMemFree(p))
