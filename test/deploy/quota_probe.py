# Runs inside the old-glibc root (old_glibc_test.cc): the root's own python3
# loads the simulated driver through ctypes, under the preload library, and
# reports what it sees as key=value lines. Arguments: the allocation sizes to
# try, in bytes; each is freed again when it was admitted.
import ctypes
import sys

libc = ctypes.CDLL("libc.so.6")
libc.gnu_get_libc_version.restype = ctypes.c_char_p
print("glibc=%s" % libc.gnu_get_libc_version().decode())
with open("/proc/self/maps") as maps:
    print("preloaded=%d" % any(line.rstrip().endswith("/libgpuslice.so") for line in maps))

cuda = ctypes.CDLL("libcuda.so.1")
print("cuInit=%d" % cuda.cuInit(0))
dev = ctypes.c_int()
print("cuDeviceGet=%d" % cuda.cuDeviceGet(ctypes.byref(dev), 0))
ctx = ctypes.c_void_p()
print("cuCtxCreate=%d" % cuda.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev))
free = ctypes.c_size_t()
total = ctypes.c_size_t()
print("cuMemGetInfo=%d" % cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)))
print("total=%d" % total.value)
for size in sys.argv[1:]:
    ptr = ctypes.c_uint64()
    rc = cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(int(size)))
    print("alloc_%s=%d" % (size, rc))
    if rc == 0:
        cuda.cuMemFree_v2(ptr)
sys.stdout.flush()
