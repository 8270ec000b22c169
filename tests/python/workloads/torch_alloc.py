"""PyTorch caching-allocator shape (issue 41 item 6): `torch_alloc.py MODE`.

MODE `blocks`, the classic allocator: segments from cuMemAlloc (2 MiB for requests up to
1 MiB, 20 MiB for up to 10 MiB, larger ones rounded up to 2 MiB), freed tensors kept in
the cache (nothing given to the driver), `empty_cache` frees the segments no tensor
uses; a cuMemAlloc refused with CUDA_ERROR_OUT_OF_MEMORY frees the cache and retries
once, as c10's CUDACachingAllocator does, else raises its OutOfMemoryError.

MODE `expandable` (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True): one virtual range
of 9/8 x cuDeviceTotalMem reserved up front, grown by one cuMemCreate'd 20 MiB page
mapped after the last, shrunk (`empty_cache`) by cuMemUnmap + cuMemRelease of the pages
no tensor uses; a cuMemCreate refused mid-growth unmaps and releases what this growth
mapped.

Each step prints reserved= (what the allocator holds from the driver) beside used=
(total - free from cuMemGetInfo under the shim): the same, at every step. Prints
`ready` with the cache full and waits for a line on stdin (a sibling reads the
container's view meanwhile), then empties the cache and prints done=1."""
import sys

from cu import d, ok, code, init, prop, granularity, access_rw, meminfo, say, fail

MIB = 1 << 20
OOM = int(d.CUresult.CUDA_ERROR_OUT_OF_MEMORY)
mode = sys.argv[1]
dev, ctx = init(0)
_, total = meminfo()


def used():
    free, t = meminfo()
    return t - free


class OutOfMemory(Exception):
    pass


class Blocks:
    """The classic allocator: segments of cuMemAlloc, each split into blocks."""

    def __init__(self):
        self.segments = {}  # address -> [size, live bytes]

    def seg_size(self, n):
        if n <= MIB:
            return 2 * MIB
        if n <= 10 * MIB:
            return 20 * MIB
        return (n + 2 * MIB - 1) // (2 * MIB) * (2 * MIB)

    def reserved(self):
        return sum(s for s, _ in self.segments.values())

    def malloc(self, n):
        # The cache first: a segment of this size class with room (blocks of the small
        # and large pools never mix: a request fits a segment of its own class).
        want = self.seg_size(n)
        for a, seg in self.segments.items():
            if seg[0] == want and seg[0] - seg[1] >= n:
                seg[1] += n
                return a
        r = d.cuMemAlloc(want)
        if code(r) == OOM:
            self.empty_cache()
            r = d.cuMemAlloc(want)
            if code(r) == OOM:
                raise OutOfMemory(want)
        a = ok(r)
        self.segments[int(a)] = [want, n]
        return int(a)

    def free(self, a, n):
        self.segments[a][1] -= n  # cached, not given back

    def empty_cache(self):
        for a in [a for a, s in self.segments.items() if s[1] == 0]:
            ok(d.cuMemFree(a))
            del self.segments[a]


class Expandable:
    """expandable_segments: one reserved range, 20 MiB pages mapped at its end."""

    def __init__(self):
        self.p = prop("device", 0)
        self.page = 20 * MIB
        assert self.page % granularity(self.p) == 0
        totalmem = int(ok(d.cuDeviceTotalMem(dev)))
        self.max_pages = -(-(totalmem + totalmem // 8) // self.page)
        self.va = int(ok(d.cuMemAddressReserve(self.max_pages * self.page, 0, 0, 0)))
        self.handles = []  # page i -> handle
        self.top = 0  # bytes handed out (a bump allocator: tensors freed from the top)

    def reserved(self):
        return len(self.handles) * self.page

    def grow(self, pages):
        """Maps `pages` more pages, or none (rolled back) when the driver refuses one."""
        new = []
        for _ in range(pages):
            if len(self.handles) + len(new) >= self.max_pages:
                raise OutOfMemory("range")
            r = d.cuMemCreate(self.page, self.p, 0)
            if code(r) != 0:
                for i, h in reversed(list(enumerate(new))):
                    at = self.va + (len(self.handles) + i) * self.page
                    ok(d.cuMemUnmap(at, self.page))
                    ok(d.cuMemRelease(h))
                if code(r) != OOM:
                    fail(f"cuMemCreate: {code(r)}")
                return False
            at = self.va + (len(self.handles) + len(new)) * self.page
            ok(d.cuMemMap(at, self.page, 0, r[1], 0))
            access_rw(at, self.page, [0])
            new.append(r[1])
        self.handles += new
        return True

    def malloc(self, n):
        need = -(-(self.top + n - self.reserved()) // self.page)
        if need > 0 and not self.grow(need):
            self.empty_cache()
            need = -(-(self.top + n - self.reserved()) // self.page)
            if need > 0 and not self.grow(need):
                raise OutOfMemory(n)
        a = self.va + self.top
        self.top += n
        return a

    def free_top(self, n):
        self.top -= n

    def empty_cache(self, at_once=False):
        """Unmaps and releases the pages above the highest live byte; `at_once`: one
        cuMemUnmap over all of them (several mappings) rather than one per page."""
        keep = -(-self.top // self.page)
        gone = self.handles[keep:]
        if not gone:
            return
        if at_once:
            ok(d.cuMemUnmap(self.va + keep * self.page, len(gone) * self.page))
        else:
            for i in range(len(gone)):
                ok(d.cuMemUnmap(self.va + (keep + i) * self.page, self.page))
        for h in gone:
            ok(d.cuMemRelease(h))
        self.handles = self.handles[:keep]

    def close(self):
        self.top = 0
        self.empty_cache()
        ok(d.cuMemAddressFree(self.va, self.max_pages * self.page))


def check(step, a):
    u = used()
    say(step=step, reserved=a.reserved(), used=u)
    if u != a.reserved():
        fail(f"{step}: the allocator holds {a.reserved()} bytes, the container is charged {u}")


if mode == "blocks":
    a = Blocks()
    # A model's parameters and activations: small (512 KiB), medium (6 MiB), large.
    small = [(a.malloc(512 * 1024), 512 * 1024) for _ in range(40)]
    medium = [(a.malloc(6 * MIB), 6 * MIB) for _ in range(9)]
    large = [(a.malloc(100 * MIB), 100 * MIB) for _ in range(3)]
    check("loaded", a)
    # Activations freed: cached, still charged.
    for p, n in medium[3:] + large[1:]:
        a.free(p, n)
    check("cached", a)
    # A request the free quota cannot hold, but the cache can once emptied: the
    # allocator's OOM path (free the cache, retry) succeeds.
    big = total - a.reserved() + 150 * MIB
    big = (big + 2 * MIB - 1) // (2 * MIB) * (2 * MIB)
    b = a.malloc(big)
    check("retried", a)
    say(retried_big=big)
    # More than the quota can ever hold: a clean OutOfMemory, the process goes on.
    try:
        a.malloc(total)
        fail("an allocation of the whole quota beside live tensors succeeded")
    except OutOfMemory:
        say(oom_clean=1)
    check("after_oom", a)
    print("ready", flush=True)
    sys.stdin.readline()
    a.free(b, big)
    for p, n in small + medium[:3] + large[:1]:
        a.free(p, n)
    a.empty_cache()
    check("emptied", a)
elif mode == "expandable":
    a = Expandable()
    say(max_pages=a.max_pages, page=a.page)
    # Grow tensor by tensor (50 MiB: 2 or 3 pages each) until the quota refuses a page:
    # the last growth maps a page, is refused the next, and rolls back.
    n_tensors = 0
    try:
        while True:
            a.malloc(50 * MIB)
            n_tensors += 1
    except OutOfMemory:
        pass
    say(tensors=n_tensors, pages=len(a.handles))
    check("grown", a)
    # Free the top half of the tensors, shrink page by page.
    half = n_tensors // 2
    a.free_top((n_tensors - half) * 50 * MIB)
    a.empty_cache()
    check("shrunk", a)
    # Grow again, then shrink with one unmap over several pages.
    for _ in range(4):
        a.malloc(50 * MIB)
    check("regrown", a)
    a.free_top(4 * 50 * MIB)
    a.empty_cache(at_once=True)
    check("shrunk_at_once", a)
    print("ready", flush=True)
    sys.stdin.readline()
    a.close()
    check("closed", a)
else:
    fail(f"unknown mode {mode!r}")
say(done=1)
