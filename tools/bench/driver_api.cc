#include "driver_api.h"

#include <dlfcn.h>

namespace gpuslice::bench {

namespace {

using GetProcAddressV2 = CUresult (*)(const char*, void**, int, cuuint64_t, CUdriverProcAddressQueryResult*);
using GetProcAddressV1 = CUresult (*)(const char*, void**, int, cuuint64_t);

}  // namespace

DriverApi load_driver_api() {
  DriverApi api;
  api.handle = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (api.handle == nullptr) {
    const char* why = dlerror();
    throw std::runtime_error(std::string("cannot load libcuda.so.1: ") + (why != nullptr ? why : "unknown error"));
  }
  // cuGetProcAddress_v2 (CUDA 12.0+) or, on an 11.3+ driver, cuGetProcAddress.
  auto v2 = reinterpret_cast<GetProcAddressV2>(dlsym(api.handle, "cuGetProcAddress_v2"));
  auto v1 = reinterpret_cast<GetProcAddressV1>(dlsym(api.handle, "cuGetProcAddress"));
  if (v2 == nullptr && v1 == nullptr) {
    throw std::runtime_error("libcuda.so.1 exports no cuGetProcAddress: the driver predates CUDA 11.3");
  }
  auto resolve = [&](const char* name, void** out) {
    CUresult rc = v2 != nullptr ? v2(name, out, CUDA_VERSION, CU_GET_PROC_ADDRESS_DEFAULT, nullptr)
                                : v1(name, out, CUDA_VERSION, CU_GET_PROC_ADDRESS_DEFAULT);
    if (rc != CUDA_SUCCESS || *out == nullptr) {
      throw std::runtime_error(std::string("cuGetProcAddress(\"") + name + "\") failed with CUresult " +
                               std::to_string(static_cast<int>(rc)));
    }
  };
  // #name is the base name (not macro-expanded); the member has cuda.h's ABI.
#define GPUSLICE_BENCH_RESOLVE(name) resolve(#name, reinterpret_cast<void**>(&api.name));
  GPUSLICE_BENCH_DRIVER_API(GPUSLICE_BENCH_RESOLVE)
#undef GPUSLICE_BENCH_RESOLVE
  api.fake_busy_ns = reinterpret_cast<FakeBusyNs>(dlsym(api.handle, "fakecuda_busy_ns"));
  return api;
}

std::string error_name(const DriverApi& api, CUresult rc) {
  const char* name = nullptr;
  if (api.cuGetErrorName != nullptr && api.cuGetErrorName(rc, &name) == CUDA_SUCCESS && name != nullptr) {
    return name;
  }
  return "CUresult " + std::to_string(static_cast<int>(rc));
}

void check(const DriverApi& api, CUresult rc, const char* call) {
  if (rc == CUDA_SUCCESS) return;
  std::string text(call);
  if (auto paren = text.find('('); paren != std::string::npos) text.resize(paren);
  if (auto dot = text.rfind('.'); dot != std::string::npos) text = text.substr(dot + 1);
  throw DriverError(text + ": " + error_name(api, rc) + " (" + std::to_string(static_cast<int>(rc)) + ")", rc);
}

}  // namespace gpuslice::bench
