// A program that never uses CUDA but looks up names that begin with "cu"
// and "nvml" on libc's handle (ctypes-style). Prints whether the driver got
// loaded behind its back.
#include <dlfcn.h>

#include <cstdio>

int main() {
  void* libc = dlopen("libc.so.6", RTLD_NOW);
  if (libc == nullptr) return 2;
  void* cuserid = dlsym(libc, "cuserid");
  void* curl = dlsym(libc, "curl_easy_init");
  void* nvmlish = dlsym(libc, "nvmlish_helper");
  std::printf("nocuda cuserid=%d curl=%d nvmlish=%d driver_loaded=%d nvml_loaded=%d\n", cuserid != nullptr,
              curl != nullptr, nvmlish != nullptr, dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD) != nullptr,
              dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_NOLOAD) != nullptr);
  return 0;
}
