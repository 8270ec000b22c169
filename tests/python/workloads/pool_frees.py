"""Stream-ordered pools and frees of pointers the shim never charged (issue 41 item 3):
cuMemAllocFromPoolAsync from a created pool is charged; a free of an unknown, an
already freed or another API's pointer returns the driver's CUresult (an int the
application can read, never a crash) and changes no charge."""
from cu import d, ok, code, init, meminfo, say

MIB = 1 << 20
dev, _ = init(0)
props = d.CUmemPoolProps()
props.allocType = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
props.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
props.location.id = 0
pool = ok(d.cuMemPoolCreate(props))
stream = ok(d.cuStreamCreate(0))
say(free0=meminfo()[0])
p = ok(d.cuMemAllocFromPoolAsync(64 * MIB, pool, stream))
ok(d.cuStreamSynchronize(stream))
say(pool_alloc_free=meminfo()[0])
over = d.cuMemAllocFromPoolAsync(256 * MIB, pool, stream)
say(pool_over=code(over))
bogus = 0xDEAD0000
say(free_bogus=code(d.cuMemFree(bogus)))
say(free_async_bogus=code(d.cuMemFreeAsync(bogus, stream)))
say(release_bogus=code(d.cuMemRelease(0x1234)))
q = ok(d.cuMemAlloc(2 * MIB))
ok(d.cuMemFree(q))
say(double_free=code(d.cuMemFree(q)))
host = ok(d.cuMemAllocHost(2 * MIB))
say(free_host_as_device=code(d.cuMemFree(host)))
ok(d.cuMemFreeHost(host))
say(after_bad_frees=meminfo()[0])
ok(d.cuMemFreeAsync(p, stream))
ok(d.cuStreamSynchronize(stream))
ok(d.cuMemPoolTrimTo(pool, 0))
say(end_free=meminfo()[0])
