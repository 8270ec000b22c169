"""SGLang memory-saver shape (torch_memory_saver; issue 41 item 6): `memory_saver.py`.

Every tensor of a tagged region is its own cuMemCreate'd allocation mapped into its own
reserved range (the saver's cudaMalloc): weights (2 x 64 MiB, backed up to pinned host
memory at a pause) and a KV cache (8 x 64 MiB). A pause unmaps and releases the
physical memory and keeps every virtual range (tensors keep their addresses); a resume
creates new physical memory and maps it at the same addresses, the weights restored.

Protocol: prints `ready started` once loaded and `ready paused` once paused, then reads
commands from stdin, one a line:
  - `resume`: re-creates and maps everything; prints resume=<CUresult> used=<bytes>.
    When the quota refuses part of it, what this resume mapped is unmapped and
    released again (the process stays paused, nothing stays charged) and it prints
    `ready paused`; when it succeeds, weights_ok= and `ready resumed`.
  - `end`: frees everything and prints done=1."""
import sys

from cu import d, ok, code, init, prop, granularity, access_rw, meminfo, say, fail

MIB = 1 << 20
dev, ctx = init(0)
p = prop("device", 0)
assert (64 * MIB) % granularity(p) == 0


def used():
    free, t = meminfo()
    return t - free


class Tensor:
    def __init__(self, size, backup):
        self.size = size
        self.va = int(ok(d.cuMemAddressReserve(size, 0, 0, 0)))
        self.h = None
        self.backup = ok(d.cuMemAllocHost(size)) if backup else None

    def map(self):
        """Physical memory created and mapped at the tensor's address: 0 or the
        CUresult of a refused cuMemCreate (nothing mapped then)."""
        r = d.cuMemCreate(self.size, p, 0)
        if code(r) != 0:
            return code(r)
        self.h = r[1]
        ok(d.cuMemMap(self.va, self.size, 0, self.h, 0))
        access_rw(self.va, self.size, [0])
        return 0

    def unmap(self):
        ok(d.cuMemUnmap(self.va, self.size))
        ok(d.cuMemRelease(self.h))
        self.h = None


weights = [Tensor(64 * MIB, True) for _ in range(2)]
kv = [Tensor(64 * MIB, False) for _ in range(8)]
tensors = weights + kv
for t in tensors:
    if t.map() != 0:
        fail("start-up allocation refused")
for i, w in enumerate(weights):
    ok(d.cuMemsetD8(w.va, 0x40 + i, w.size))
say(started_used=used())
print("ready started", flush=True)
sys.stdin.readline()


def pause():
    for w in weights:
        ok(d.cuMemcpyDtoH(w.backup, w.va, w.size))
    for t in tensors:
        t.unmap()


def resume():
    done = []
    for t in tensors:
        r = t.map()
        if r != 0:
            for m in done:
                m.unmap()
            return r
        done.append(t)
    for w in weights:
        ok(d.cuMemcpyHtoD(w.va, w.backup, w.size))
    return 0


pause()
say(paused_used=used())
print("ready paused", flush=True)
resumed = False
for line in sys.stdin:
    cmd = line.strip()
    if cmd == "resume" and not resumed:
        r = resume()
        say(resume=r, used=used())
        if r == 0:
            resumed = True
            ok_all = 1
            for i, w in enumerate(weights):
                chk = bytearray(4096)
                ok(d.cuMemcpyDtoH(chk, w.va + w.size - 4096, 4096))
                ok_all &= int(all(b == 0x40 + i for b in chk))
            say(weights_ok=ok_all)
            print("ready resumed", flush=True)
        else:
            print("ready paused", flush=True)
    elif cmd == "end":
        break
    else:
        fail(f"unexpected command {cmd!r}")
for t in tensors:
    if t.h is not None:
        t.unmap()
    ok(d.cuMemAddressFree(t.va, t.size))
    if t.backup is not None:
        ok(d.cuMemFreeHost(t.backup))
say(end_used=used(), done=1)
