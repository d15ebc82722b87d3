"""NVIDIA's nvidia-ml-py (pynvml) under libgpuslice.so: it dlopen()s
libnvidia-ml.so.1 and looks functions up with dlsym on that handle, as
nvidia-smi does. Inside the container NVML must show the quota as the card's
memory and the container's usage as used — v1 and v2 structures alike.

A helper process (cuprobe) holds 24 MiB in the same container while this runs."""
import sys

import pynvml

MI = 1 << 20
QUOTA = 64 * MI
HELD = int(sys.argv[1]) if len(sys.argv) > 1 else 24 * MI
failures = []


def check(name, got, want):
    status = "ok" if got == want else "FAIL"
    print(f"{status} {name}: got {got!r}, want {want!r}")
    if got != want:
        failures.append(name)


pynvml.nvmlInit()
handle = pynvml.nvmlDeviceGetHandleByIndex(0)
mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
check("nvmlDeviceGetMemoryInfo total", mem.total, QUOTA)
check("nvmlDeviceGetMemoryInfo used", mem.used, HELD)
check("nvmlDeviceGetMemoryInfo free", mem.free, QUOTA - HELD)
mem2 = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
check("nvmlDeviceGetMemoryInfo_v2 total", mem2.total, QUOTA)
check("nvmlDeviceGetMemoryInfo_v2 used", mem2.used, HELD)
check("nvmlDeviceGetMemoryInfo_v2 free", mem2.free, QUOTA - HELD)
pynvml.nvmlShutdown()

print("nvidia-ml-py", "FAILED: " + ", ".join(failures) if failures else "passed")
sys.exit(1 if failures else 0)
