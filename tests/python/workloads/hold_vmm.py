"""Holds a mapped VMM allocation until stdin closes: `hold_vmm.py MIB [device|host]`.
Prints `ready pid=` once it is mapped (the shape of a sibling process of a container
that holds its weights in cuMem memory)."""
import os
import sys

from cu import d, ok, init, prop, map_new, meminfo, say

MIB = 1 << 20
size = int(sys.argv[1]) * MIB
where = sys.argv[2] if len(sys.argv) > 2 else "device"
init(0)
h = ok(d.cuMemCreate(size, prop(where, 0), 0))
va = map_new(h, size, [0])
ok(d.cuMemsetD8(va, 1, size))
say(held_free=meminfo()[0])
print(f"ready pid={os.getpid()}", flush=True)
sys.stdin.read()
