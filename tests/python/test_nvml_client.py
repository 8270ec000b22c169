"""nvidia-ml-py (``import pynvml``), unmodified, on the simulated libnvidia-ml.so.1.

Every figure NVML reports must come from the simulated node: memory and processes are
checked against what a real CUDA program (``gpu_process.py``, on the simulated
libcuda) sees, and against each other.
"""

import json
import subprocess
import time

MiB = 1 << 20
GiB = 1 << 30

# Prints a JSON snapshot of device 0 as pynvml reports it.
SNAPSHOT = """
import json, pynvml as N
N.nvmlInit()
h = N.nvmlDeviceGetHandleByIndex(0)
m1 = N.nvmlDeviceGetMemoryInfo(h)
m2 = N.nvmlDeviceGetMemoryInfo(h, version=N.nvmlMemory_v2)
procs = N.nvmlDeviceGetComputeRunningProcesses(h)
print(json.dumps({
    "count": N.nvmlDeviceGetCount(),
    "name": N.nvmlDeviceGetName(h),
    "uuid": N.nvmlDeviceGetUUID(h),
    "mem_v1": [m1.total, m1.free, m1.used],
    "mem_v2": [m2.total, m2.reserved, m2.free, m2.used],
    "procs": [[p.pid, p.usedGpuMemory] for p in procs],
    "gpu_util": N.nvmlDeviceGetUtilizationRates(h).gpu,
}))
N.nvmlShutdown()
"""


def snapshot(node):
    return json.loads(node.python(SNAPSHOT))


def test_init_devices_and_versions(node):
    out = node.python(
        """
        import pynvml as N
        N.nvmlInit()
        h = N.nvmlDeviceGetHandleByIndex(0)
        uuid = N.nvmlDeviceGetUUID(h)
        assert N.nvmlDeviceGetIndex(N.nvmlDeviceGetHandleByUUID(uuid)) == 0
        bus = N.nvmlDeviceGetPciInfo(h).busId
        assert N.nvmlDeviceGetIndex(N.nvmlDeviceGetHandleByPciBusId(bus)) == 0
        print(N.nvmlDeviceGetCount(), N.nvmlDeviceGetName(h), uuid, bus)
        print(N.nvmlSystemGetDriverVersion(), N.nvmlSystemGetCudaDriverVersion())
        print(N.nvmlDeviceGetCudaComputeCapability(h), N.nvmlDeviceGetArchitecture(h))
        try:
            N.nvmlDeviceGetTemperature(h, N.NVML_TEMPERATURE_GPU)
        except N.NVMLError_NotSupported:
            print("temperature not supported")
        N.nvmlShutdown()
        try:
            N.nvmlDeviceGetCount()
        except N.NVMLError_Uninitialized:
            print("uninitialized after shutdown")
        """
    ).splitlines()
    assert out[0] == (
        "1 NVIDIA H100 80GB HBM3 GPU-51570000-0000-4000-8000-000000000000 00000000:18:00.0"
    )
    assert out[1] == "570.124.06 12080"
    assert out[2] == f"(9, 0) 9"  # NVML_DEVICE_ARCH_HOPPER
    assert out[3:] == ["temperature not supported", "uninitialized after shutdown"]


def test_memory_and_processes_follow_a_cuda_program(node):
    idle = snapshot(node)
    total = 80 * GiB
    assert idle["mem_v1"] == [total, total, 0]
    assert idle["mem_v2"] == [total, 0, total, 0]
    assert idle["procs"] == []

    p, free, drv_total = node.gpu_process(2 * GiB)
    assert drv_total == total
    used = total - free  # what the driver told the CUDA program
    assert used >= 2 * GiB
    s = snapshot(node)
    assert s["mem_v1"] == [total, free, used]
    assert s["mem_v2"] == [total, 0, free, used]
    assert s["procs"] == [[p.pid, used]]

    q, free2, _ = node.gpu_process(1 * GiB)
    s = snapshot(node)
    assert s["mem_v1"] == [total, free2, total - free2]
    assert sorted(s["procs"]) == sorted([[p.pid, used], [q.pid, free - free2]])

    # SIGKILL: the driver frees the process's memory; NVML no longer lists it.
    p.kill()
    p.wait()
    s = snapshot(node)
    assert s["procs"] == [[q.pid, free - free2]]
    assert s["mem_v1"] == [total, total - (free - free2), free - free2]
    q.kill()
    q.wait()
    s = snapshot(node)
    assert s["procs"] == [] and s["mem_v1"] == [total, total, 0]


def test_utilization_and_process_samples(node):
    assert snapshot(node)["gpu_util"] == 0
    p, _, _ = node.gpu_process(64 * MiB, busy=True)
    time.sleep(1.5)
    out = node.python(
        """
        import time, pynvml as N
        N.nvmlInit()
        h = N.nvmlDeviceGetHandleByIndex(0)
        print(N.nvmlDeviceGetUtilizationRates(h).gpu)
        samples = N.nvmlDeviceGetProcessUtilization(h, 0)
        print(" ".join(f"{s.pid}:{s.smUtil}" for s in samples))
        last = samples[0].timeStamp
        time.sleep(0.3)
        samples = N.nvmlDeviceGetProcessUtilization(h, last)
        print(" ".join(f"{s.pid}:{s.smUtil}:{int(s.timeStamp > last)}" for s in samples))
        """
    ).splitlines()
    assert int(out[0]) >= 80, out
    pid, sm = out[1].split(":")
    assert int(pid) == p.pid and int(sm) >= 80, out
    pid, sm, newer = out[2].split(":")
    assert int(pid) == p.pid and int(sm) >= 70 and newer == "1", out


def test_accounting_stats_over_a_process_lifetime(node):
    node.python(
        """
        import pynvml as N
        N.nvmlInit()
        h = N.nvmlDeviceGetHandleByIndex(0)
        try:
            N.nvmlDeviceGetAccountingStats(h, 1)
            raise SystemExit("stats with accounting disabled")
        except N.NVMLError_NotSupported:
            pass
        N.nvmlDeviceSetAccountingMode(h, N.NVML_FEATURE_ENABLED)
        assert N.nvmlDeviceGetAccountingMode(h) == N.NVML_FEATURE_ENABLED
        """
    )
    p, free, total = node.gpu_process(1 * GiB, busy=True)
    time.sleep(1.0)
    query = """
        import json, pynvml as N
        N.nvmlInit()
        h = N.nvmlDeviceGetHandleByIndex(0)
        pids = N.nvmlDeviceGetAccountingPids(h)
        s = N.nvmlDeviceGetAccountingStats(h, %d)
        print(json.dumps({"pids": pids, "util": s.gpuUtilization, "max": s.maxMemoryUsage,
                          "time": s.time, "start": s.startTime, "running": s.isRunning}))
        """ % p.pid
    live = json.loads(node.python(query))
    assert live["pids"] == [p.pid]
    assert live["running"] == 1 and live["time"] == 0
    assert live["max"] == total - free
    assert live["util"] >= 50, live
    p.kill()
    p.wait()
    done = json.loads(node.python(query))
    assert done["running"] == 0
    assert done["time"] >= 1000, done  # ms: it lived at least the 1 s we waited
    assert done["start"] == live["start"]
    assert 50 <= done["util"] <= 100, done
    out = node.python(
        """
        import pynvml as N
        N.nvmlInit()
        h = N.nvmlDeviceGetHandleByIndex(0)
        try:
            N.nvmlDeviceGetAccountingStats(h, 2147483000)
        except N.NVMLError_NotFound:
            print("unknown pid: not found")
        """
    )
    assert out.strip() == "unknown pid: not found"


def test_xid_event_from_fault_injection(node):
    waiter = node.spawn(
        "python3",
        "-c",
        """
import pynvml as N
N.nvmlInit()
h = N.nvmlDeviceGetHandleByIndex(0)
s = N.nvmlEventSetCreate()
N.nvmlDeviceRegisterEvents(h, N.nvmlEventTypeXidCriticalError, s)
try:
    N.nvmlEventSetWait(s, 0)
except N.NVMLError_Timeout:
    print("timeout", flush=True)
print("registered", flush=True)
e = N.nvmlEventSetWait(s, 20000)
print(e.eventType, e.eventData, N.nvmlDeviceGetIndex(e.device), flush=True)
N.nvmlEventSetFree(s)
""",
    )
    assert waiter.stdout.readline().strip() == "timeout"
    assert waiter.stdout.readline().strip() == "registered"
    node.vgpu_sim("xid", "48")
    out, err = waiter.communicate(timeout=30)
    assert waiter.returncode == 0, err
    assert out.split() == ["8", "48", "0"]


def test_lost_device(node):
    node.vgpu_sim("lost")
    out = node.python(
        """
        import pynvml as N
        N.nvmlInit()
        try:
            N.nvmlDeviceGetHandleByIndex(0)
        except N.NVMLError_GpuIsLost:
            print("lost")
        """
    )
    assert out.strip() == "lost"
    node.vgpu_sim("lost", "--restore")
    assert snapshot(node)["count"] == 1
