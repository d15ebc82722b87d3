"""NVIDIA's cuda-bindings under libgpuslice.so: it resolves every driver entry
point through cuGetProcAddress_v2, as production code does. Checks the memory
quota on several allocation paths and the virtualised queries.

Run by CTest with LD_PRELOAD, LD_LIBRARY_PATH (simulated driver),
FAKECUDA_STATE, GPUSLICE_REGION and GPUSLICE_MEMORY_LIMIT=64Mi set."""
import sys

from cuda.bindings import driver as cu

MI = 1 << 20
QUOTA = 64 * MI
failures = []


def check(name, got, want):
    status = "ok" if got == want else "FAIL"
    print(f"{status} {name}: got {got!r}, want {want!r}")
    if got != want:
        failures.append(name)


def ok(result):
    err = result[0]
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"driver call failed: {err}")
    return result[1:] if len(result) > 2 else (result[1] if len(result) == 2 else None)


ok(cu.cuInit(0))
dev = ok(cu.cuDeviceGet(0))
ctx = ok(cu.cuDevicePrimaryCtxRetain(dev))
ok(cu.cuCtxSetCurrent(ctx))

free, total = ok(cu.cuMemGetInfo())
check("cuMemGetInfo total is the quota", total, QUOTA)
check("cuMemGetInfo free is the quota", free, QUOTA)
check("cuDeviceTotalMem is the quota", ok(cu.cuDeviceTotalMem(dev)), QUOTA)

a = ok(cu.cuMemAlloc(32 * MI))
err, _ = cu.cuMemAlloc(40 * MI)
check("cuMemAlloc beyond the quota", err, cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY)
free, total = ok(cu.cuMemGetInfo())
check("free after 32 MiB", free, 32 * MI)

stream = ok(cu.cuStreamCreate(0))
err, _ = cu.cuMemAllocAsync(48 * MI, stream)
check("cuMemAllocAsync beyond the quota", err, cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY)
b = ok(cu.cuMemAllocAsync(16 * MI, stream))
ok(cu.cuMemFreeAsync(b, stream))
ok(cu.cuStreamSynchronize(stream))

prop = cu.CUmemAllocationProp()
prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
prop.location.id = 0
err, _ = cu.cuMemCreate(34 * MI, prop, 0)
check("cuMemCreate beyond the quota", err, cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY)
h = ok(cu.cuMemCreate(32 * MI, prop, 0))
err, _ = cu.cuMemAlloc(MI)
check("quota full after VMM", err, cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY)
ok(cu.cuMemRelease(h))
ok(cu.cuMemFree(a))
free, total = ok(cu.cuMemGetInfo())
check("everything returned", free, QUOTA)

print("cuda-bindings", "FAILED: " + ", ".join(failures) if failures else "passed")
sys.exit(1 if failures else 0)
