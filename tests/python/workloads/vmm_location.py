"""cuMemCreate by location (issue 41 item 1): host-located memory is never charged to
a GPU quota, device-located memory is charged to the device its location names, and
a handle released while still mapped stays charged until its last unmap.

Prints key=value lines: *_create= the CUresult of a 512 MiB cuMemCreate at each host
location (HOST_NUMA_CURRENT is CUDA_ERROR_INVALID_VALUE for cuMemCreate, as the driver
API documents), *_free= cuMemGetInfo's free while it is mapped and written, then the
free figure at each step of a device allocation's life."""
import sys

from cu import d, ok, code, init, prop, granularity, map_new, meminfo, say

MIB = 1 << 20
init(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
free0, total = meminfo()
say(free0=free0, total=total)

# Host locations: 512 MiB (twice the quota) each, mapped and written.
for kind in ("host", "host_numa", "host_numa_current"):
    p = prop(kind, 0)
    r = d.cuMemCreate(512 * MIB, p, 0)
    say(**{f"{kind}_create": code(r)})
    if code(r) != 0:
        continue
    h = r[1]
    va = map_new(h, 512 * MIB, [0])
    ok(d.cuMemsetD8(va, 7, 512 * MIB))
    say(**{f"{kind}_free": meminfo()[0]})
    ok(d.cuMemUnmap(va, 512 * MIB))
    ok(d.cuMemAddressFree(va, 512 * MIB))
    ok(d.cuMemRelease(h))

# Device location: 128 MiB charged; released while mapped stays charged until unmapped.
p = prop("device", 0)
g = granularity(p)
h = ok(d.cuMemCreate(128 * MIB, p, 0))
say(dev_free=meminfo()[0], gran=g)
va = map_new(h, 128 * MIB, [0])
ok(d.cuMemRelease(h))
say(released_mapped_free=meminfo()[0])
# What the release would have freed is not there to take.
r = d.cuMemAlloc(free0 - 64 * MIB)
say(over_while_mapped=code(r))
if code(r) == 0:
    ok(d.cuMemFree(r[1]))
ok(d.cuMemUnmap(va, 128 * MIB))
ok(d.cuMemAddressFree(va, 128 * MIB))
say(unmapped_free=meminfo()[0])

# Retain + release twice (NCCL's free): charged until the last reference and mapping go.
h = ok(d.cuMemCreate(64 * MIB, p, 0))
va = map_new(h, 64 * MIB, [0])
h2 = ok(d.cuMemRetainAllocationHandle(va))
ok(d.cuMemRelease(h2))
say(retained_released_free=meminfo()[0])
ok(d.cuMemUnmap(va, 64 * MIB))
say(unmapped_referenced_free=meminfo()[0])
ok(d.cuMemRelease(h))
ok(d.cuMemAddressFree(va, 64 * MIB))
say(end_free=meminfo()[0])
