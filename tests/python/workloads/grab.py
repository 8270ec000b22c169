"""A neighbour that takes what it can (`grab.py CHUNK_MIB [MAX_MIB]`): cuMemAlloc chunks
until out of memory (or MAX_MIB taken); prints grabbed= and code=, then holds them until
stdin closes."""
import os
import sys

from cu import d, code, init, say

MIB = 1 << 20
chunk = int(sys.argv[1]) * MIB
most = int(sys.argv[2]) * MIB if len(sys.argv) > 2 else None
init(0)
held, r = [], (0,)
while most is None or (len(held) + 1) * chunk <= most:
    r = d.cuMemAlloc(chunk)
    if code(r) != 0:
        break
    held.append(r[1])
say(grabbed=len(held) * chunk, code=code(r))
print(f"ready pid={os.getpid()}", flush=True)
sys.stdin.read()
