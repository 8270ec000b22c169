"""vLLM-shaped start-up and sleep/wake (issue 41 item 6): `vllm_shape.py UTIL`.
  - sizes itself from total memory read through CUDA (cuMemGetInfo) and NVML
    (nvmlDeviceGetMemoryInfo v2), which must agree: budget = UTIL x total;
  - weights (64 MiB) and a KV cache (the rest of the budget) in cuMemCreate memory
    mapped into reserved ranges, as vLLM's CuMemAllocator does;
  - captures a CUDA graph of 500 kernels and replays it 3 times;
  - sleeps: weights backed up to pinned host memory, every mapping unmapped and released;
    prints `slept free=` and `ready`, then waits for a line on stdin (the test lets a
    neighbour try to take the memory meanwhile);
  - wakes: re-creates and maps the same sizes, restores the weights; prints wake=<CUresult>
    and, when it woke, weights_ok=1."""
import sys

import pynvml as nv

from cu import (d, ok, code, init, prop, granularity, map_new, meminfo, say, fail,
                spin_function, capture_spins)

MIB = 1 << 20
util = float(sys.argv[1])
dev, ctx = init(0)
free, total = meminfo()
nv.nvmlInit()
m2 = nv.nvmlDeviceGetMemoryInfo(nv.nvmlDeviceGetHandleByIndex(0), version=nv.nvmlMemory_v2)
say(cuda_total=total, nvml_total=m2.total, cuda_free=free, nvml_free=m2.free)
if m2.total != total:
    fail(f"CUDA says total={total}, NVML says {m2.total}")
p = prop("device", 0)
g = granularity(p)
budget = int(util * total) // g * g
weights = 64 * MIB
kv = (budget - weights) // g * g
say(budget=budget, kv=kv)


def create(sizes):
    out = []
    for size in sizes:
        r = d.cuMemCreate(size, p, 0)
        if code(r) != 0:
            return code(r), out
        h = r[1]
        out.append((map_new(h, size, [0]), size, h))
    return 0, out


r, maps = create([weights, kv])
if r != 0:
    fail(f"start-up allocation failed: {r}")
ok(d.cuMemsetD8(maps[0][0], 0x77, weights))
say(started_free=meminfo()[0])

# A decode step as a CUDA graph of 500 kernels, captured and replayed.
fn = spin_function()
stream = ok(d.cuStreamCreate(1))
exe = capture_spins(fn, stream, 500, 1000)
for _ in range(3):
    ok(d.cuGraphLaunch(exe, stream))
ok(d.cuStreamSynchronize(stream))
say(graph_replays=3, graph_kernels=500)

# Sleep: back the weights up to pinned host memory, let go of everything.
backup = ok(d.cuMemAllocHost(weights))
ok(d.cuMemcpyDtoH(backup, maps[0][0], weights))
for va, size, h in maps:
    ok(d.cuMemUnmap(va, size))
    ok(d.cuMemAddressFree(va, size))
    ok(d.cuMemRelease(h))
say(slept_free=meminfo()[0])
print("ready slept", flush=True)
sys.stdin.readline()

# Wake: the same sizes again.
r, maps = create([weights, kv])
say(wake=r, woke_free=meminfo()[0])
if r == 0:
    ok(d.cuMemcpyHtoD(maps[0][0], backup, weights))
    chk = bytearray(4096)
    ok(d.cuMemcpyDtoH(chk, maps[0][0], 4096))
    say(weights_ok=int(all(b == 0x77 for b in chk)))
    for _ in range(3):
        ok(d.cuGraphLaunch(exe, stream))
    ok(d.cuStreamSynchronize(stream))
for va, size, h in maps:
    ok(d.cuMemUnmap(va, size))
    ok(d.cuMemAddressFree(va, size))
    ok(d.cuMemRelease(h))
ok(d.cuMemFreeHost(backup))
say(done=1)
