// dlsym: the CUDA runtime opens libcuda.so.1 and looks symbols up on that
// handle (so our exported names are not what it gets), pynvml and nvidia-smi
// do the same with libnvidia-ml.so.1. For an explicit handle we run glibc's
// dlsym and, if the result is a real entry point we hook, return our wrapper.
//
// RTLD_NEXT and RTLD_DEFAULT are resolved relative to the *caller*, which
// glibc finds from its return address — so for those the assembly stub
// (dlsym_x86_64.S) tail-jumps into glibc's dlsym with the caller's return
// address intact, instead of calling it from here (HAMi-core's bug: RTLD_NEXT
// then resolves relative to the preload library and breaks other interposers).
#include <dlfcn.h>

#include <cstdint>

#include "hook/real.h"

namespace {

// Driver and NVML entry points are named cu[A-Z]… and nvml[A-Z]…: only
// those may load a library. libc's cuserid, libcurl's curl_* or a program's
// own nvmlish helper never do.
bool is_upper(char c) noexcept { return c >= 'A' && c <= 'Z'; }
bool may_be_hooked(const char* name) noexcept {
  return name != nullptr &&
         ((name[0] == 'c' && name[1] == 'u' && is_upper(name[2])) ||
          (name[0] == 'n' && name[1] == 'v' && name[2] == 'm' && name[3] == 'l' && is_upper(name[4])));
}

}  // namespace

// Called by the stub. Returns the answer when *handled is set; otherwise the
// stub jumps to glibc's dlsym with the original arguments.
extern "C" [[gnu::visibility("hidden"), gnu::no_sanitize_address, gnu::no_sanitize_undefined]] void*
gpuslice_dlsym_filter(void* handle, const char* name, int* handled) noexcept {
  using namespace gpuslice::hook;
  *handled = 0;
  if (handle == RTLD_NEXT || handle == RTLD_DEFAULT) return nullptr;  // the x86-64 stub never asks
  void* result = real_dlsym(handle, name);
  *handled = 1;
  if (result != nullptr && may_be_hooked(name)) {
    if (name[0] == 'c' ? load_driver() : load_nvml()) {
      if (void* wrapper = wrapper_for_real(result)) return wrapper;
    }
  }
  return result;
}

#if !defined(__x86_64__)
// Portable fallback: correct for explicit handles; RTLD_NEXT then resolves
// relative to this library, the limitation the x86-64 stub avoids.
extern "C" [[gnu::visibility("default")]] void* dlsym(void* handle, const char* name) noexcept {
  int handled = 0;
  gpuslice::hook::resolve_real_dlsym();
  void* r = gpuslice_dlsym_filter(handle, name, &handled);
  return handled ? r : gpuslice::hook::real_dlsym(handle, name);
}
#endif
