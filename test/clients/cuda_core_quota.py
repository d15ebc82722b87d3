"""cuda-core under a gpuslice memory quota and SM limit (issue 22), on the
simulated driver. Run by run_client.sh (GPUSLICE_MEMORY_LIMIT=64Mi, libgpuslice
preloaded) with GPUSLICE_SM_LIMIT set by CTest.

Checks: one quota holds exactly across cuda-core's stream-ordered pool resource
(DeviceMemoryResource: cuMemPool*/cuMemAllocFromPoolAsync) and its legacy
synchronous resource (cuMemAlloc); a refusal is cuda-core's own CUDAError
naming CUDA_ERROR_OUT_OF_MEMORY; kernels compiled by NVRTC (Program) and
launched with launch() on a Stream are throttled by the SM limit: simulated
device time measured with timing Events, wall time on the host.
"""
import ctypes
import os
import sys
import time

try:
    from cuda.core import Device, EventOptions, LaunchConfig, Program, ProgramOptions, launch
    from cuda.core import DeviceMemoryResource
    from cuda.core._memory._legacy import _SynchronousMemoryResource
    from cuda.core._utils.cuda_utils import CUDAError
    from cuda.bindings import driver
except ImportError as e:
    print(f"SKIP: cuda-core is not installed in this venv ({e}); run tools/setup.sh")
    sys.exit(77)

QUOTA = 64 << 20
MIB = 1 << 20
KERNEL_MS = 10
LAUNCHES = 100


def fail(message):
    sys.exit(f"FAIL: {message}")


def main():
    limit = int(os.environ.get("GPUSLICE_SM_LIMIT", "100"))
    dev = Device(0)
    dev.set_current()
    stream = dev.create_stream()

    # --- one quota across both resources ---
    pool = DeviceMemoryResource(dev)
    legacy = _SynchronousMemoryResource(0)
    pooled = [pool.allocate(16 * MIB, stream=stream) for _ in range(2)]  # 32 MiB from the pool
    stream.sync()
    buffers = []
    try:
        while len(buffers) <= QUOTA // MIB:
            buffers.append(legacy.allocate(MIB))
    except CUDAError as e:
        refusal = str(e)
    else:
        fail(f"{len(buffers)} MiB of cuMemAlloc beside 32 MiB of pool under a 64 MiB quota, never refused")
    if "CUDA_ERROR_OUT_OF_MEMORY" not in refusal:
        fail(f"refusal {refusal!r}, expected CUDA_ERROR_OUT_OF_MEMORY")
    if len(buffers) != 32:
        fail(f"legacy resource refused after {len(buffers)} MiB beside 32 MiB of pool; quota 64 MiB")
    try:
        pool.allocate(2 * MIB, stream=stream)
        stream.sync()
        fail("the pool allocated past a full quota")
    except CUDAError as e:
        if "CUDA_ERROR_OUT_OF_MEMORY" not in str(e):
            fail(f"pool refusal {e}, expected CUDA_ERROR_OUT_OF_MEMORY")
    # Bytes move through cuda-core's buffers (the simulator keeps them).
    pooled[0].fill(0x5A, stream=stream)
    stream.sync()
    host = (ctypes.c_ubyte * 16)()
    (err,) = driver.cuMemcpyDtoH(ctypes.addressof(host), int(pooled[0].handle) + 16 * MIB - 16, 16)
    if err != driver.CUresult.CUDA_SUCCESS or list(host) != [0x5A] * 16:
        fail(f"a pool buffer filled with 0x5A reads back {list(host)} ({err})")
    for b in buffers:
        b.close()
    for b in pooled:
        b.close(stream)
    stream.sync()
    again = [legacy.allocate(MIB) for _ in range(64)]  # everything was given back
    for b in again:
        b.close()

    # --- NVRTC kernels, launched and timed ---
    code = f'extern "C" __global__ void spin_{KERNEL_MS * 1000}us(int *p) {{}}'
    try:
        program = Program(code, code_type="c++", options=ProgramOptions(arch=f"sm_{dev.arch}"))
        cubin = program.compile("cubin")
    except Exception as e:  # cuda-pathfinder: no NVRTC (wheel, conda or CUDA_HOME) here
        if "nvrtc" not in str(e).lower():
            raise
        print(f"SKIP: the quota part passed; NVRTC is not available to compile kernels ({e})")
        sys.exit(77)
    kernel = cubin.get_kernel(f"spin_{KERNEL_MS * 1000}us")
    arg = legacy.allocate(MIB)
    timing = EventOptions(timing_enabled=True)
    start = stream.record(options=timing)
    t0 = time.monotonic()
    for _ in range(LAUNCHES):
        launch(stream, LaunchConfig(grid=1, block=32), kernel, arg)
    end = stream.record(options=timing)
    end.sync()
    wall_ms = (time.monotonic() - t0) * 1000
    device_ms = end - start
    busy_ms = LAUNCHES * KERNEL_MS
    if device_ms < busy_ms * 0.999:
        fail(f"events measured {device_ms:.1f} ms for {busy_ms} ms of kernels")
    # At L% the kernels may hold the device L% of the time: the work takes
    # busy/L of wall time, less at most one bucket capacity (share x 50 ms).
    floor_ms = busy_ms * 100 / limit - 50
    if limit < 100 and wall_ms < floor_ms:
        fail(f"{busy_ms} ms of kernels at a {limit}% SM limit took {wall_ms:.0f} ms (< {floor_ms:.0f})")
    print(f"OK: quota exact across pool + legacy resources; {busy_ms} ms of NVRTC kernels "
          f"(events: {device_ms:.1f} ms) took {wall_ms:.0f} ms wall at SM limit {limit}%")


if __name__ == "__main__":
    main()
