"""Memory shared between processes (issue 41 item 4), one role per process:

  export-mem MIB DEV      cuMemAlloc + pattern, cuIpcGetMemHandle: prints handle=<hex>
  export-vmm MIB DEV      cuMemCreate (POSIX fd exportable) mapped + pattern,
                          cuMemExportToShareableHandle: prints fd= (and pid= in ready)
  import-mem HEX DEV      cuIpcOpenMemHandle, checks the pattern, tries cuMemFree on it,
                          cuIpcCloseMemHandle
  import-vmm PID FD MIB DEV  opens the exporter's descriptor (/proc/PID/fd/FD, what a
                          unix-socket SCM_RIGHTS transfer gives), cuMemImportFromShareableHandle,
                          maps, checks the pattern, releases
Exporters print `ready pid=` and hold the memory until stdin closes. Every role prints
free= (cuMemGetInfo) before and after, so the test sees who is charged."""
import ctypes
import os
import sys

from cu import d, ok, code, init, prop, map_new, meminfo, say, fail

MIB = 1 << 20
PATTERN = 0x5A


def check_pattern(ptr, size):
    buf = bytearray(size)
    ok(d.cuMemcpyDtoH(buf, ptr, size))
    if any(b != PATTERN for b in buf[:: 4096]):
        fail("the imported memory does not hold the exporter's pattern")


role = sys.argv[1]
if role == "export-mem":
    size, dev = int(sys.argv[2]) * MIB, int(sys.argv[3])
    init(dev)
    p = ok(d.cuMemAlloc(size))
    ok(d.cuMemsetD8(p, PATTERN, size))
    h = ok(d.cuIpcGetMemHandle(p))
    say(handle=ctypes.string_at(h.getPtr(), 64).hex(), free=meminfo()[0])
    print(f"ready pid={os.getpid()}", flush=True)
    sys.stdin.read()
elif role == "export-vmm":
    size, dev = int(sys.argv[2]) * MIB, int(sys.argv[3])
    init(dev)
    h = ok(d.cuMemCreate(size, prop("device", dev, fd=True), 0))
    va = map_new(h, size, [dev])
    ok(d.cuMemsetD8(va, PATTERN, size))
    fd = ok(d.cuMemExportToShareableHandle(
        h, d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0))
    say(fd=int(fd), free=meminfo()[0])
    print(f"ready pid={os.getpid()}", flush=True)
    sys.stdin.read()
elif role == "import-mem":
    raw, dev = bytes.fromhex(sys.argv[2]), int(sys.argv[3])
    init(dev)
    say(before_free=meminfo()[0])
    h = d.CUipcMemHandle()
    ctypes.memmove(h.getPtr(), raw, 64)
    p = ok(d.cuIpcOpenMemHandle(h, d.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS))
    check_pattern(p, 1 * MIB)
    say(opened_free=meminfo()[0])
    say(free_imported=code(d.cuMemFree(p)))
    say(after_free_attempt=meminfo()[0])
    say(close=code(d.cuIpcCloseMemHandle(p)))
    say(close_again=code(d.cuIpcCloseMemHandle(p)))
    say(end_free=meminfo()[0])
elif role == "import-vmm":
    pid, fd, size, dev = (int(a) for a in sys.argv[2:6])
    size *= MIB
    init(dev)
    say(before_free=meminfo()[0])
    local = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
    h = ok(d.cuMemImportFromShareableHandle(
        local, d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
    os.close(local)
    va = map_new(h, size, [dev])
    check_pattern(va, 1 * MIB)
    say(imported_free=meminfo()[0])
    ok(d.cuMemUnmap(va, size))
    ok(d.cuMemAddressFree(va, size))
    say(release=code(d.cuMemRelease(h)))
    say(end_free=meminfo()[0])
else:
    fail(f"unknown role {role}")
