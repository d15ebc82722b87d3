"""cuda-bindings and nvidia-ml-py (NVIDIA's own Python bindings) against the fake.

cuda.bindings.driver resolves every entry point through cuGetProcAddress_v2, so
this checks the fake from a client nobody here wrote.
"""
import os

import pynvml
from cuda.bindings import driver

OK = driver.CUresult.CUDA_SUCCESS


def check(result):
    err, *values = result if isinstance(result, tuple) else (result,)
    assert err == OK, err
    return values[0] if len(values) == 1 else values


check(driver.cuInit(0))
assert check(driver.cuDriverGetVersion()) == 13000
assert check(driver.cuDeviceGetCount()) >= 1
dev = check(driver.cuDeviceGet(0))
ctx = check(driver.cuCtxCreate(None, 0, dev))
p = check(driver.cuMemAlloc(1 << 20))
free, total = check(driver.cuMemGetInfo())
assert total - free == 1 << 20, (free, total)
check(driver.cuMemFree(p))
check(driver.cuCtxDestroy(ctx))

primary = check(driver.cuDevicePrimaryCtxRetain(dev))
check(driver.cuCtxSetCurrent(primary))
p = check(driver.cuMemAlloc(1 << 20))

pynvml.nvmlInit()
h = pynvml.nvmlDeviceGetHandleByIndex(0)
mem = pynvml.nvmlDeviceGetMemoryInfo(h)
assert mem.used == 1 << 20, mem.used
mem2 = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
assert mem2.used == 1 << 20 and mem2.total == mem.total, (mem2.used, mem2.total)
procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
assert [(x.pid, x.usedGpuMemory) for x in procs] == [(os.getpid(), 1 << 20)], procs
pynvml.nvmlShutdown()

check(driver.cuMemFree(p))
check(driver.cuDevicePrimaryCtxRelease(dev))
print("python clients: 2 passed, 0 failed")
