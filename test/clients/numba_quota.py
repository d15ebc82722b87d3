"""numba-cuda under a gpuslice memory quota (issue 22), on the simulated driver.

Run by run_client.sh (GPUSLICE_MEMORY_LIMIT=64Mi, libgpuslice.so preloaded),
with NUMBA_QUOTA_MODE:
  default   numba's own memory manager (cuMemAlloc) and its deallocation queue
  emm       an External Memory Management plugin backed by
                           cuMemAllocAsync/cuMemFreeAsync (stream-ordered pools)
Checks: get_memory_info() shows the quota; device arrays allocate until the
quota is reached exactly and the next one fails with numba's own
out-of-memory error (CudaAPIError, CUDA_ERROR_OUT_OF_MEMORY); arrays whose
frees numba has queued still count until numba flushes its queue, which it
does by itself when an allocation fails, so the next full round fits again.
"""
import os
import sys
import weakref

try:
    import numpy as np
    from numba import cuda
    from numba.cuda.cudadrv import driver as numba_driver
    from cuda.bindings import driver as drv
except ImportError as e:
    print(f"SKIP: numba-cuda is not installed in this venv ({e}); run tools/setup.sh")
    sys.exit(77)

QUOTA = 64 << 20
MIB = 1 << 20
OOM = drv.CUresult.CUDA_ERROR_OUT_OF_MEMORY


class AsyncPoolEMM(cuda.HostOnlyCUDAMemoryManager):
    """EMM plugin: every allocation from the device's default pool, on the legacy stream."""

    def initialize(self):
        pass

    def memalloc(self, size):
        err, ptr = drv.cuMemAllocAsync(size, drv.CUstream(0))
        if err != drv.CUresult.CUDA_SUCCESS:
            raise numba_driver.CudaAPIError(err, "cuMemAllocAsync")
        address = int(ptr)

        def finalizer():
            drv.cuMemFreeAsync(drv.CUdeviceptr(address), drv.CUstream(0))
            drv.cuStreamSynchronize(drv.CUstream(0))  # a synchronisation point trims the pool

        ctx = weakref.proxy(self.context)
        return numba_driver.MemoryPointer(ctx, drv.CUdeviceptr(address), size, finalizer=finalizer)

    def get_memory_info(self):
        err, free, total = drv.cuMemGetInfo()
        assert err == drv.CUresult.CUDA_SUCCESS, err
        return numba_driver.MemoryInfo(free=free, total=total)

    def get_ipc_handle(self, memory):
        raise NotImplementedError("IPC is not modelled by the simulator")

    def reset(self):
        pass

    @property
    def interface_version(self):
        return 1


def fill(label):
    """Allocates 1 MiB arrays until refused; returns them and the error's code
    and text (not the exception: its tracebacks would keep the arrays alive)."""
    arrays = []
    try:
        while len(arrays) <= QUOTA // MIB:
            arrays.append(cuda.device_array(MIB, dtype=np.uint8))
    except numba_driver.CudaAPIError as e:
        return arrays, e.code, str(e)
    sys.exit(f"FAIL {label}: {len(arrays)} MiB allocated under a {QUOTA >> 20} MiB quota, never refused")


def main(mode):
    if mode == "emm":
        cuda.set_memory_manager(AsyncPoolEMM)
    ctx = cuda.current_context()
    free, total = ctx.get_memory_info()
    if total != QUOTA:
        sys.exit(f"FAIL: get_memory_info total {total}, expected the quota {QUOTA}")
    used_before = total - free

    arrays, code, error = fill("first round")
    if code != OOM:
        sys.exit(f"FAIL: refusal {error}, expected CUDA_ERROR_OUT_OF_MEMORY")
    if len(arrays) * MIB + used_before != QUOTA:
        sys.exit(f"FAIL: refused after {len(arrays)} MiB (+{used_before} B already used); quota {QUOTA} B")
    # Contents survive: the simulated driver keeps bytes.
    arrays[-1].copy_to_device(np.full(MIB, 7, dtype=np.uint8))
    if int(arrays[-1].copy_to_host()[MIB - 1]) != 7:
        sys.exit("FAIL: a device array did not keep what was copied into it")
    first = len(arrays)

    # numba queues frees (its memory manager's deallocation queue, flushed
    # every few frees);
    # queued arrays are not freed yet, so they still count against the quota.
    with cuda.defer_cleanup():
        del arrays
        pending = len(ctx.memory_manager.deallocations._cons) if mode == "default" else 0
        free_pending, _ = ctx.get_memory_info()
        if mode == "default" and (pending != first or free_pending > QUOTA - first * MIB):
            sys.exit(f"FAIL: {pending} queued frees, {free_pending} B free while they are queued")
    # A full round again: numba flushes its queue when an allocation fails and retries.
    arrays, code, error = fill("second round")
    if code != OOM or len(arrays) != first:
        sys.exit(f"FAIL: second round {len(arrays)} MiB then {error}; first round {first} MiB")
    del arrays
    if mode == "default":
        ctx.memory_manager.deallocations.clear()
    free_after, _ = ctx.get_memory_info()
    if free_after != QUOTA - used_before:
        sys.exit(f"FAIL: {free_after} B free after every array is freed, expected {QUOTA - used_before}")
    print(f"OK {mode}: quota {QUOTA >> 20} MiB shown; refused with {error} after {first} MiB, twice")


if __name__ == "__main__":
    main(os.environ.get("NUMBA_QUOTA_MODE", "default"))
