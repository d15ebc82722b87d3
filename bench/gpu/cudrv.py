"""The CUDA driver API and NVML through ctypes, for the evidence script's own probes.

Nothing here imports a framework: the same code runs on the real driver and on
the simulated one (test/fakecuda), which is what lets the driver-level steps run
under `run.sh --simulated` in CI. `ctypes.CDLL("libcuda.so.1")` is dlopen +
dlsym on the driver's handle, which is the path libgpuslice.so intercepts when
it is preloaded (docs/interception.md), so a probe sees what an application sees.
"""

import ctypes

CUDA_SUCCESS = 0
CUDA_ERROR_OUT_OF_MEMORY = 2
NVML_SUCCESS = 0
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_VALUE_NOT_AVAILABLE = 0xFFFFFFFFFFFFFFFF

# One kernel that waits on %globaltimer on a real GPU; the simulated driver
# runs a function named spin_<N>us for N us of device time (test/fakecuda/README.md).
SPIN_US = 200
SPIN_PTX = (
    ".version 7.0\n.target sm_50\n.address_size 64\n"
    ".visible .entry spin_%dus()\n{\n"
    "  .reg .pred %%p<2>;\n  .reg .b64 %%rd<4>;\n"
    "  mov.u64 %%rd1, %%globaltimer;\n  add.u64 %%rd2, %%rd1, %d;\n"
    "$Lspin:\n  mov.u64 %%rd3, %%globaltimer;\n  setp.lt.u64 %%p1, %%rd3, %%rd2;\n  @%%p1 bra $Lspin;\n"
    "  ret;\n}\n" % (SPIN_US, SPIN_US * 1000)
)


class CudaError(RuntimeError):
    def __init__(self, call, code, name):
        super().__init__("%s failed: %s (%d)" % (call, name, code))
        self.call = call
        self.code = code
        self.name = name


class Driver:
    """The few driver entry points the probes use, raw (versioned) names."""

    def __init__(self, path="libcuda.so.1"):
        self.lib = ctypes.CDLL(path)
        u64p = ctypes.POINTER(ctypes.c_uint64)
        sizep = ctypes.POINTER(ctypes.c_size_t)
        vp = ctypes.c_void_p
        self._sig("cuInit", [ctypes.c_uint])
        self._sig("cuDriverGetVersion", [ctypes.POINTER(ctypes.c_int)])
        self._sig("cuDeviceGet", [ctypes.POINTER(ctypes.c_int), ctypes.c_int])
        self._sig("cuDeviceGetName", [ctypes.c_char_p, ctypes.c_int, ctypes.c_int])
        self._sig("cuDeviceTotalMem_v2", [sizep, ctypes.c_int])
        self._sig("cuDevicePrimaryCtxRetain", [ctypes.POINTER(vp), ctypes.c_int])
        self._sig("cuCtxSetCurrent", [vp])
        self._sig("cuCtxSynchronize", [])
        self._sig("cuMemGetInfo_v2", [sizep, sizep])
        self._sig("cuMemAlloc_v2", [u64p, ctypes.c_size_t])
        self._sig("cuMemFree_v2", [ctypes.c_uint64])
        self._sig("cuModuleLoadData", [ctypes.POINTER(vp), ctypes.c_char_p])
        self._sig("cuModuleGetFunction", [ctypes.POINTER(vp), vp, ctypes.c_char_p])
        self._sig("cuLaunchKernel", [vp] + [ctypes.c_uint] * 7 + [vp, vp, vp])
        self.lib.cuGetErrorName.restype = ctypes.c_int
        self.lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        self.ctx = None
        self.spin = None

    def _sig(self, name, argtypes):
        fn = getattr(self.lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = argtypes

    def error_name(self, code):
        text = ctypes.c_char_p()
        if self.lib.cuGetErrorName(code, ctypes.byref(text)) == CUDA_SUCCESS and text.value:
            return text.value.decode()
        return "CUresult %d" % code

    def check(self, name, *args):
        code = getattr(self.lib, name)(*args)
        if code != CUDA_SUCCESS:
            raise CudaError(name, code, self.error_name(code))

    def open(self):
        """cuInit, device 0, its primary context made current."""
        self.check("cuInit", 0)
        device = ctypes.c_int()
        self.check("cuDeviceGet", ctypes.byref(device), 0)
        ctx = ctypes.c_void_p()
        self.check("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), device)
        self.check("cuCtxSetCurrent", ctx)
        self.ctx = ctx
        return self

    def driver_version(self):
        version = ctypes.c_int()
        self.check("cuDriverGetVersion", ctypes.byref(version))
        return version.value

    def device_name(self):
        name = ctypes.create_string_buffer(256)
        self.check("cuDeviceGetName", name, 256, 0)
        return name.value.decode(errors="replace")

    def mem_info(self):
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        self.check("cuMemGetInfo_v2", ctypes.byref(free), ctypes.byref(total))
        return free.value, total.value

    def total_mem(self):
        total = ctypes.c_size_t()
        self.check("cuDeviceTotalMem_v2", ctypes.byref(total), 0)
        return total.value

    def alloc(self, size):
        """Device pointer, or None on CUDA_ERROR_OUT_OF_MEMORY; other errors raise."""
        ptr = ctypes.c_uint64()
        code = self.lib.cuMemAlloc_v2(ctypes.byref(ptr), size)
        if code == CUDA_ERROR_OUT_OF_MEMORY:
            return None
        if code != CUDA_SUCCESS:
            raise CudaError("cuMemAlloc_v2", code, self.error_name(code))
        return ptr.value

    def free(self, ptr):
        self.check("cuMemFree_v2", ctypes.c_uint64(ptr))

    def load_spin(self):
        module = ctypes.c_void_p()
        self.check("cuModuleLoadData", ctypes.byref(module), SPIN_PTX.encode())
        fn = ctypes.c_void_p()
        self.check("cuModuleGetFunction", ctypes.byref(fn), module, b"spin_%dus" % SPIN_US)
        self.spin = fn

    def launch_spin(self):
        self.check("cuLaunchKernel", self.spin, 1, 1, 1, 1, 1, 1, 0, None, None, None)

    def synchronize(self):
        self.check("cuCtxSynchronize")


class NvmlMemory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


class NvmlProcessInfo(ctypes.Structure):  # the _v2/_v3 layout
    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong),
                ("gpuInstanceId", ctypes.c_uint), ("computeInstanceId", ctypes.c_uint)]


class Nvml:
    """Device 0's memory and compute processes, as nvidia-smi reads them."""

    def __init__(self, path="libnvidia-ml.so.1"):
        self.lib = ctypes.CDLL(path)
        for name in ("nvmlInit_v2", "nvmlShutdown", "nvmlDeviceGetHandleByIndex_v2", "nvmlDeviceGetMemoryInfo",
                     "nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2"):
            if hasattr(self.lib, name):
                getattr(self.lib, name).restype = ctypes.c_int
        code = self.lib.nvmlInit_v2()
        if code != NVML_SUCCESS:
            raise RuntimeError("nvmlInit_v2 failed: %d" % code)
        self.device = ctypes.c_void_p()
        code = self.lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(self.device))
        if code != NVML_SUCCESS:
            raise RuntimeError("nvmlDeviceGetHandleByIndex_v2(0) failed: %d" % code)
        self._procs = getattr(self.lib, "nvmlDeviceGetComputeRunningProcesses_v3", None) or \
            self.lib.nvmlDeviceGetComputeRunningProcesses_v2

    def memory(self):
        info = NvmlMemory()
        code = self.lib.nvmlDeviceGetMemoryInfo(self.device, ctypes.byref(info))
        if code != NVML_SUCCESS:
            raise RuntimeError("nvmlDeviceGetMemoryInfo failed: %d" % code)
        return {"total": info.total, "free": info.free, "used": info.used}

    def processes(self):
        """{pid: used bytes or None when NVML says not available}."""
        count = ctypes.c_uint(64)
        while True:
            infos = (NvmlProcessInfo * count.value)()
            asked = count.value
            code = self._procs(self.device, ctypes.byref(count), infos)
            if code == NVML_ERROR_INSUFFICIENT_SIZE:
                count = ctypes.c_uint(max(count.value, asked) * 2)
                continue
            if code != NVML_SUCCESS:
                raise RuntimeError("nvmlDeviceGetComputeRunningProcesses failed: %d" % code)
            out = {}
            for info in infos[:count.value]:
                used = info.usedGpuMemory
                out[info.pid] = None if used == NVML_VALUE_NOT_AVAILABLE else used
            return out

    def close(self):
        self.lib.nvmlShutdown()
