"""Small probes run as their own process (under libgpuslice.so or natively):
each prints one JSON line. Used by the steps to decide whether gpuslice was
really in effect in a process configured like the one measured.

  probes.py driver     cuMemGetInfo / cuDeviceTotalMem through dlopen("libcuda.so.1")
  probes.py nvml       nvmlDeviceGetMemoryInfo through dlopen("libnvidia-ml.so.1")
  probes.py libcuda    the files of libcuda.so.1 and libnvidia-ml.so.1 the loader finds (no preload)
  probes.py green      a green context (CUDA 12.4+) on device 0: what cuMemGetInfo and NVML say once it
                       is created, and the device share of spin kernels launched on its stream for 2 s
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import cudrv  # noqa: E402


def probe_driver():
    drv = cudrv.Driver().open()
    free, total = drv.mem_info()
    return {"free": free, "total": total, "device_total": drv.total_mem(), "name": drv.device_name(),
            "driver_version": drv.driver_version(), "preloaded": common.library_mapped()}


def probe_nvml():
    nvml = cudrv.Nvml()
    try:
        memory = nvml.memory()
    finally:
        nvml.close()
    memory["preloaded"] = common.library_mapped()
    return memory


def probe_green():
    """A green context of 8 SMs on device 0 (its primary context retained by the
    driver), current; then spin kernels on a stream of it for 2 s."""
    import ctypes
    import time
    drv = cudrv.Driver()
    if not hasattr(drv.lib, "cuGreenCtxCreate"):
        return {"skipped": "the driver has no green contexts (CUDA 12.4+)"}
    drv.check("cuInit", 0)
    resource = ctypes.create_string_buffer(144)  # CUdevResource (RESOURCE_ABI_VERSION 1)
    drv.check("cuDeviceGetDevResource", 0, resource, 1)  # CU_DEV_RESOURCE_TYPE_SM
    part = ctypes.create_string_buffer(144)
    groups = ctypes.c_uint(1)
    drv.check("cuDevSmResourceSplitByCount", part, ctypes.byref(groups), resource, None, 0, 8)
    desc = ctypes.c_void_p()
    drv.check("cuDevResourceGenerateDesc", ctypes.byref(desc), part, 1)
    green = ctypes.c_void_p()
    drv.check("cuGreenCtxCreate", ctypes.byref(green), desc, 0, 1)  # CU_GREEN_CTX_DEFAULT_STREAM
    ctx = ctypes.c_void_p()
    drv.check("cuCtxFromGreenCtx", ctypes.byref(ctx), green)
    drv.check("cuCtxSetCurrent", ctx)
    free, total = drv.mem_info()
    out = {"device_sms": int.from_bytes(resource.raw[96:100], "little"),
           "green_sms": int.from_bytes(part.raw[96:100], "little"), "total": total, "counted": total - free,
           "preloaded": common.library_mapped()}
    try:
        nvml = cudrv.Nvml()
        out["nvml_process"] = nvml.processes().get(os.getpid())
        nvml.close()
    except Exception as e:  # no NVML, or it gives no per-process figure
        out["nvml_error"] = str(e)
    stream = ctypes.c_void_p()
    drv.check("cuGreenCtxStreamCreate", ctypes.byref(stream), green, 1, 0)  # CU_STREAM_NON_BLOCKING
    drv.load_spin()
    launches = 0
    start = time.monotonic()
    while time.monotonic() - start < 2.0 and launches < 20000:
        drv.check("cuLaunchKernel", drv.spin, 1, 1, 1, 1, 1, 1, 0, stream, None, None)
        launches += 1
    drv.check("cuStreamSynchronize", stream)
    wall = time.monotonic() - start
    out.update({"launches": launches, "wall_s": round(wall, 3),
                "share": round(launches * cudrv.SPIN_US * 1e-6 / wall, 4)})
    return out


def probe_libcuda():
    """The files the loader finds for libcuda.so.1 and libnvidia-ml.so.1."""
    import ctypes
    cudrv.Driver()
    out = {}
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError as e:
        out["nvml_error"] = str(e)
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            name = os.path.basename(fields[-1]) if len(fields) >= 6 else ""
            if name.startswith("libcuda.so"):
                out["path"] = fields[-1]
            elif name.startswith("libnvidia-ml.so"):
                out["nvml_path"] = fields[-1]
    if "path" not in out:
        out["error"] = "libcuda.so.1 loaded but not found in /proc/self/maps"
    return out


def main():
    probes = {"driver": probe_driver, "nvml": probe_nvml, "libcuda": probe_libcuda, "green": probe_green}
    if len(sys.argv) != 2 or sys.argv[1] not in probes:
        sys.exit("usage: probes.py %s" % "|".join(sorted(probes)))
    try:
        common.emit(probes[sys.argv[1]]())
    except Exception as e:  # reported, not raised: the caller reads the JSON line
        common.emit({"error": "%s: %s" % (type(e).__name__, e)})
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
