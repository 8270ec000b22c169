"""nvidia-ml-py (``import pynvml``), unmodified, reading the simulated node's topology.

Each test gives a fresh node a machine preset (``preset = "..."``) and checks what
pynvml reports against the machine the preset models: the PCIe common ancestors, the
nearest GPUs, the GPUs near a CPU, P2P status, NVLinks and CPU/memory affinity.
"""

import json

TOPOLOGY = """
import json, pynvml as N
N.nvmlInit()
n = N.nvmlDeviceGetCount()
hs = [N.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
idx = N.nvmlDeviceGetIndex
def cpus(h, scope=None):
    words = N.nvmlDeviceGetCpuAffinity(h, 4) if scope is None else N.nvmlDeviceGetCpuAffinityWithinScope(h, 4, scope)
    return [w * 64 + b for w, m in enumerate(words) for b in range(64) if m >> b & 1]
def nvlinks(h):
    out = []
    for l in range(N.NVML_NVLINK_MAX_LINKS):
        try:
            if N.nvmlDeviceGetNvLinkState(h, l) == N.NVML_FEATURE_ENABLED:
                out.append(N.nvmlDeviceGetNvLinkRemotePciInfo(h, l).busId)
        except N.NVMLError_NotSupported:
            pass
    return out
try:
    numa = N.nvmlDeviceGetNumaNodeId(hs[0])
except N.NVMLError_NotSupported:
    numa = "not supported"
print(json.dumps({
    "ancestor": [[N.nvmlDeviceGetTopologyCommonAncestor(a, b) for b in hs] for a in hs],
    "nearest_node_0": [idx(h) for h in N.nvmlDeviceGetTopologyNearestGpus(hs[0], N.NVML_TOPOLOGY_NODE)],
    "gpu_set_cpu_0": [idx(h) for h in N.nvmlSystemGetTopologyGpuSet(0)],
    # pynvml spells NVML_P2P_CAPS_INDEX_READ as a tuple ("= 0,"): pass the header's ints.
    "p2p_read_0_last": N.nvmlDeviceGetP2PStatus(hs[0], hs[-1], 0),
    "p2p_nvlink_0_1": N.nvmlDeviceGetP2PStatus(hs[0], hs[1], 2),
    "nvlinks_0": nvlinks(hs[0]),
    "nvlink_version_0": N.nvmlDeviceGetNvLinkVersion(hs[0], 0) if nvlinks(hs[0]) else None,
    "cpus_0": cpus(hs[0]),
    "cpus_0_socket": cpus(hs[0], N.NVML_AFFINITY_SCOPE_SOCKET),
    "mem_affinity_last": N.nvmlDeviceGetMemoryAffinity(hs[-1], 1, N.NVML_AFFINITY_SCOPE_NODE)[0],
    "numa_node_id_0": numa,
}))
N.nvmlShutdown()
"""


def topology(node, preset):
    node.configure(f'preset = "{preset}"\n')
    return json.loads(node.python(TOPOLOGY))


def test_dgx_a100(node):
    t = topology(node, "dgx-a100")
    # PXB within a pair, NODE within a socket (NPS4), SYS across sockets.
    assert t["ancestor"][0][:5] == [0, 20, 40, 40, 50]
    assert t["nearest_node_0"] == [1, 2, 3]
    assert t["gpu_set_cpu_0"] == []  # CPU 0 is NUMA node 0: no GPU there
    assert t["p2p_read_0_last"] == 0 and t["p2p_nvlink_0_1"] == 0
    # 12 NVLink3 links, all into the NVSwitch fabric (not a GPU's bus id).
    assert len(t["nvlinks_0"]) == 12
    assert all(b.startswith("00000001:") for b in t["nvlinks_0"])
    assert t["nvlink_version_0"] == 4  # NVML_NVLINK_VERSION_3_0
    assert t["cpus_0"] == list(range(48, 64)) + list(range(176, 192))
    assert t["cpus_0_socket"] == list(range(0, 64)) + list(range(128, 192))
    assert t["mem_affinity_last"] == 1 << 5
    assert t["numa_node_id_0"] == "not supported"


def test_pcie_node(node):
    t = topology(node, "pcie-8gpu")
    assert t["ancestor"][0] == [0, 10, 40, 40, 50, 50, 50, 50]
    assert t["gpu_set_cpu_0"] == [0, 1, 2, 3]
    assert t["p2p_read_0_last"] == 1  # NVML_P2P_STATUS_CHIPSET_NOT_SUPPORTED: across sockets
    assert t["p2p_nvlink_0_1"] == 5  # NVML_P2P_STATUS_NOT_SUPPORTED
    assert t["nvlinks_0"] == []


def test_t4_node(node):
    t = topology(node, "t4-4gpu")
    assert t["ancestor"][2] == [50, 50, 0, 30]
    assert t["gpu_set_cpu_0"] == [0, 1]
    assert t["mem_affinity_last"] == 1 << 1
