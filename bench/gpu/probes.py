"""Small probes run as their own process (under libgpuslice.so or natively):
each prints one JSON line. Used by the steps to decide whether gpuslice was
really in effect in a process configured like the one measured.

  probes.py driver     cuMemGetInfo / cuDeviceTotalMem through dlopen("libcuda.so.1")
  probes.py nvml       nvmlDeviceGetMemoryInfo through dlopen("libnvidia-ml.so.1")
  probes.py libcuda    the files of libcuda.so.1 and libnvidia-ml.so.1 the loader finds (no preload)
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
    probes = {"driver": probe_driver, "nvml": probe_nvml, "libcuda": probe_libcuda}
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
