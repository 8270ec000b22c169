"""What one process of a container reads of device 0's memory, through CUDA
(cuMemGetInfo, cuDeviceTotalMem) and NVML (memory info v1 and v2): the figures engines
size themselves from (vLLM: gpu_memory_utilization x total)."""
import pynvml as n

from cu import d, ok, init, meminfo, say

dev, _ = init(0)
free, total = meminfo()
say(cuda_free=free, cuda_total=total, cuda_totalmem=int(ok(d.cuDeviceTotalMem(dev))))
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
m = n.nvmlDeviceGetMemoryInfo(h)
say(nvml_free=m.free, nvml_total=m.total, nvml_used=m.used)
m2 = n.nvmlDeviceGetMemoryInfo(h, version=n.nvmlMemory_v2)
say(nvml2_free=m2.free, nvml2_total=m2.total, nvml2_used=m2.used)
