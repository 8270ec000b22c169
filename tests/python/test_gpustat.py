"""gpustat and nvitop, unmodified, showing the simulated GPU through libnvidia-ml.so.1."""

import json
import time

MiB = 1 << 20
GiB = 1 << 30


def test_gpustat_json_shows_device_memory_and_processes(node):
    p, free, total = node.gpu_process(3 * GiB)
    out = json.loads(node.run("gpustat", "--json").stdout)
    assert out["driver_version"] == "570.124.06"
    [gpu] = out["gpus"]
    assert gpu["index"] == 0
    assert gpu["name"] == "NVIDIA H100 80GB HBM3"
    assert gpu["uuid"] == "GPU-51570000-0000-4000-8000-000000000000"
    # gpustat reports MiB (integer division of NVML's bytes).
    assert gpu["memory.total"] == total // MiB == 81920
    assert gpu["memory.used"] == (total - free) // MiB
    assert gpu["utilization.gpu"] == 0
    # Not simulated: reported as unknown, not invented.
    assert gpu["temperature.gpu"] is None and gpu["power.draw"] is None
    [proc] = gpu["processes"]
    assert proc["pid"] == p.pid
    assert proc["gpu_memory_usage"] == (total - free) // MiB


def test_gpustat_text_output(node):
    _, free, total = node.gpu_process(1 * GiB)
    out = node.run("gpustat", "--no-color").stdout
    lines = out.splitlines()
    assert "570.124.06" in lines[0]
    assert lines[1].startswith("[0] NVIDIA H100 80GB HBM3")
    assert f"{(total - free) // MiB} / 81920 MB" in lines[1]


def test_nvitop_once(node):
    p, free, total = node.gpu_process(4 * GiB, busy=True)
    time.sleep(1.0)
    r = node.run("nvitop", "-1")
    assert "Traceback" not in r.stdout + r.stderr
    assert "Driver Version: 570.124.06" in r.stdout
    assert "CUDA Driver Version: 12.8" in r.stdout
    assert "H100 80GB HBM3" in r.stdout
    assert "00000000:18:00.0" in r.stdout
    used_mib = (total - free) // MiB
    assert f"{used_mib}MiB / 80.00GiB" in r.stdout
    # The process row: pid, its memory, and its SM share from the per-process samples.
    [row] = [line for line in r.stdout.splitlines() if f" {p.pid} " in line]
    fields = row.strip("│ ").split()
    assert f"{used_mib}MiB" in fields, row
    sm = fields[fields.index(f"{used_mib}MiB") + 1]
    assert int(sm) >= 80, row


def test_gpustat_two_devices_processes_per_device(node):
    node.configure(
        """
        [[device]]
        name = "NVIDIA A100-SXM4-40GB"
        memory = "40GiB"
        compute_capability = "8.0"
        [[device]]
        name = "NVIDIA A100-SXM4-40GB"
        memory = "40GiB"
        compute_capability = "8.0"
        """
    )
    p, free, total = node.gpu_process(5 * GiB, device=1)
    assert total == 40 * GiB
    out = json.loads(node.run("gpustat", "--json").stdout)
    g0, g1 = out["gpus"]
    assert (g0["index"], g1["index"]) == (0, 1)
    assert g0["uuid"] != g1["uuid"]
    assert g0["memory.total"] == g1["memory.total"] == 40960
    assert g0["memory.used"] == 0 and g0["processes"] == []
    assert g1["memory.used"] == (total - free) // MiB
    assert [q["pid"] for q in g1["processes"]] == [p.pid]
