#!/usr/bin/env python3
"""A driver-API probe for images without a C++ runtime of this build's age
(the bullseye image): the interpreter of the image itself, ctypes, and
libcuda.so.1 through dlopen, as the CUDA runtime reaches it. The operations
and output lines are cuprobe's (test/integration/cuprobe.cc), a subset:

    cuda_probe.py init ctx 0 meminfo alloc BYTES ...

prints "init rc=0", "ctx rc=0", "meminfo rc=0 free=F total=T", "alloc rc=R"
(allocations are kept). Exit 0, or 2 if libcuda.so.1 cannot be loaded
("load rc=-1 <error>")."""
import ctypes
import sys


def main(argv):
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        print(f"load rc=-1 {e}", flush=True)
        return 2
    held = []
    i = 0
    while i < len(argv):
        op = argv[i]
        if op == "init":
            print(f"init rc={cuda.cuInit(0)}", flush=True)
        elif op == "ctx":
            i += 1
            dev = ctypes.c_int(0)
            ctx = ctypes.c_void_p(0)
            rc = cuda.cuDeviceGet(ctypes.byref(dev), int(argv[i]))
            if rc == 0:
                rc = cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)
            if rc == 0:
                rc = cuda.cuCtxSetCurrent(ctx)
            print(f"ctx rc={rc}", flush=True)
        elif op == "meminfo":
            free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
            rc = cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
            print(f"meminfo rc={rc} free={free.value} total={total.value}", flush=True)
        elif op == "alloc":
            i += 1
            ptr = ctypes.c_uint64(0)
            rc = cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(int(argv[i])))
            if rc == 0:
                held.append(ptr)
            print(f"alloc rc={rc}", flush=True)
        else:
            print(f"unknown op={op}", flush=True)
            return 3
        i += 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
