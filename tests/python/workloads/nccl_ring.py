"""NCCL-shaped ring all-reduce, one process per GPU (issue 41 item 6):
`nccl_ring.py RANK NRANKS DIR`. Each rank, on device RANK:
  - a user tensor (cuMemAlloc, 4 MiB of RANK+1), shared with cuIpcGetMemHandle;
  - a device communication buffer (cuMemCreate, exportable as a POSIX fd, 4 MiB) and a
    host-located staging buffer (cuMemCreate at CU_MEM_LOCATION_TYPE_HOST, 8 MiB), as
    NCCL >= 2.23 allocates them;
  - opens its next rank's IPC handle and imports its communication buffer (the fd,
    taken from /proc/PID/fd/N as SCM_RIGHTS would hand it over);
  - N-1 ring steps: read the next rank's buffer through the staging buffer, add its own
    tensor, publish; ends with the sum over all ranks;
  - a peer copy (cuCtxEnablePeerAccess, cuMemcpyPeer) into a scratch buffer on the
    next rank's GPU.
Barriers are files in DIR. Prints used= (quota - free on its device) once every rank has
imported (nothing imported may be charged), sum_ok=1, peer_ok=1, done=1."""
import ctypes
import os
import struct
import sys
import time

from cu import d, ok, init, prop, map_new, meminfo, say, fail, access_rw

MIB = 1 << 20
rank, n, sync_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
nxt = (rank + 1) % n
SIZE = 4 * MIB
WORDS = SIZE // 4


def barrier(name, timeout=60):
    open(os.path.join(sync_dir, f"{name}.{rank}"), "w").close()
    end = time.time() + timeout
    while not all(os.path.exists(os.path.join(sync_dir, f"{name}.{r}")) for r in range(n)):
        if time.time() > end:
            fail(f"rank {rank}: barrier {name} timed out")
        time.sleep(0.02)


def publish(name, text):
    tmp = os.path.join(sync_dir, f".{name}.{rank}")
    with open(tmp, "w") as f:
        f.write(text)
    os.rename(tmp, os.path.join(sync_dir, f"{name}.{rank}"))


def read(name, r):
    with open(os.path.join(sync_dir, f"{name}.{r}")) as f:
        return f.read()


dev, ctx = init(rank)
free0, quota = meminfo()
tensor = ok(d.cuMemAlloc(SIZE))
ok(d.cuMemsetD32(tensor, rank + 1, WORDS))
ipc = ok(d.cuIpcGetMemHandle(tensor))
comm_h = ok(d.cuMemCreate(SIZE, prop("device", rank, fd=True), 0))
comm = map_new(comm_h, SIZE, [rank])
ok(d.cuMemcpyDtoD(comm, tensor, SIZE))
stage_h = ok(d.cuMemCreate(2 * SIZE, prop("host"), 0))
stage = map_new(stage_h, 2 * SIZE, [rank])
fd = ok(d.cuMemExportToShareableHandle(
    comm_h, d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0))
publish("info", f"{os.getpid()} {int(fd)} {ctypes.string_at(ipc.getPtr(), 64).hex()}")
barrier("published")

pid, nfd, hexh = read("info", nxt).split()
h = d.CUipcMemHandle()
ctypes.memmove(h.getPtr(), bytes.fromhex(hexh), 64)
peer_tensor = ok(d.cuIpcOpenMemHandle(h, d.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS))
local = os.open(f"/proc/{pid}/fd/{nfd}", os.O_RDWR)
peer_h = ok(d.cuMemImportFromShareableHandle(
    local, d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
os.close(local)
peer_comm = map_new(peer_h, SIZE, [rank])
barrier("imported")
say(rank=rank, used=quota - meminfo()[0])
barrier("measured")

# The next rank's tensor, read through its IPC handle.
buf = bytearray(16)
ok(d.cuMemcpyDtoH(buf, peer_tensor, 16))
if struct.unpack("<I", buf[:4])[0] != nxt + 1:
    fail("the next rank's tensor does not hold its value")

# Ring: acc(comm) = own + next's comm of the previous step, N-1 times.
for step in range(n - 1):
    ok(d.cuMemcpyDtoD(stage, peer_comm, SIZE))
    barrier(f"read{step}")
    host = bytearray(SIZE)
    ok(d.cuMemcpyDtoH(host, stage, SIZE))
    v = struct.unpack_from("<I", host, 0)[0] + rank + 1
    ok(d.cuMemsetD32(comm, v, WORDS))
    barrier(f"wrote{step}")
out = bytearray(SIZE)
ok(d.cuMemcpyDtoH(out, comm, SIZE))
want = n * (n + 1) // 2
got = set(struct.unpack_from(f"<{WORDS}I", out))
say(rank=rank, sum_ok=int(got == {want}), sum=sorted(got)[0])

# Peer access and a peer copy into the next GPU.
if n > 1:
    nctx = ok(d.cuDevicePrimaryCtxRetain(ok(d.cuDeviceGet(nxt))))
    ok(d.cuCtxEnablePeerAccess(nctx, 0))
    ok(d.cuCtxPushCurrent(nctx))
    scratch = ok(d.cuMemAlloc(2 * MIB))
    ok(d.cuCtxPopCurrent())
    ok(d.cuMemcpyPeer(scratch, nctx, tensor, ctx, 2 * MIB))
    chk = bytearray(4)
    ok(d.cuMemcpyDtoH(chk, scratch, 4))
    say(rank=rank, peer_ok=int(struct.unpack("<I", chk)[0] == rank + 1))
    ok(d.cuMemFree(scratch))
barrier("peered")

ok(d.cuMemUnmap(peer_comm, SIZE))
ok(d.cuMemAddressFree(peer_comm, SIZE))
ok(d.cuMemRelease(peer_h))
ok(d.cuIpcCloseMemHandle(peer_tensor))
barrier("closed")
for va, size, hd in ((comm, SIZE, comm_h), (stage, 2 * SIZE, stage_h)):
    ok(d.cuMemUnmap(va, size))
    ok(d.cuMemAddressFree(va, size))
    ok(d.cuMemRelease(hd))
ok(d.cuMemFree(tensor))
say(rank=rank, end_used=quota - meminfo()[0], done=1)
