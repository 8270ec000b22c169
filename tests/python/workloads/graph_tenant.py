"""A tenant that only launches CUDA graphs (issue 41 item 5), as vLLM and SGLang decode:
`graph_tenant.py KERNELS KERNEL_NS LAUNCHES`: one graph of KERNELS spin kernels captured
from a stream (global mode), instantiated, then launched LAUNCHES times back to back and
synchronized. Prints device_ns= (the kernels' device time) and wall_us= (the launches'
wall time), from which the test computes the share of the GPU it used."""
import sys
import time

from cu import d, ok, init, say, spin_function, capture_spins

kernels, ns, launches = (int(a) for a in sys.argv[1:4])
init(0)
fn = spin_function()
stream = ok(d.cuStreamCreate(1))
exe = capture_spins(fn, stream, kernels, ns)
# Warm-up launch (not measured): the gate registers the process.
ok(d.cuGraphLaunch(exe, stream))
ok(d.cuStreamSynchronize(stream))
t0 = time.monotonic()
for _ in range(launches):
    ok(d.cuGraphLaunch(exe, stream))
ok(d.cuStreamSynchronize(stream))
wall_us = int((time.monotonic() - t0) * 1e6)
say(device_ns=kernels * ns * launches, wall_us=wall_us)
