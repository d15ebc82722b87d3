// cuGetProcAddress: resolves (base name, cudaVersion, flags) the way the driver
// documents, from the table generated out of cudaTypedefs.h (entry_table.inc):
// the newest versioned symbol introduced at or before cudaVersion; with
// CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM the _ptsz/_ptds variant where
// one exists. Every symbol in the table resolves: the ones the simulator does
// not model are weak stubs answering CUDA_ERROR_NOT_SUPPORTED.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <cudaProfiler.h>

#include "driver.h"

namespace {

struct EntryPoint {
  const char* base;
  int version;
  int variant;  // 0 plain, 1 _ptsz, 2 _ptds
  void* function;
  const char* symbol;
};

const std::vector<EntryPoint>& table() {
  static const std::vector<EntryPoint> sorted = [] {
    std::vector<EntryPoint> rows = {
#include "entry_table.inc"
        // cuda.h maps cuGraphInstantiate to cuGraphInstantiateWithFlags from
        // CUDA 12.0 on, whose ABI the name has at that version.
        {"cuGraphInstantiate", 12000, 0, reinterpret_cast<void*>(&::cuGraphInstantiateWithFlags),
         "cuGraphInstantiateWithFlags"},
        // The profiler control API (cudaProfilerTypedefs.h, not cudaTypedefs.h).
        {"cuProfilerStart", 4000, 0, reinterpret_cast<void*>(&::cuProfilerStart), "cuProfilerStart"},
        {"cuProfilerStop", 4000, 0, reinterpret_cast<void*>(&::cuProfilerStop), "cuProfilerStop"},
    };
    std::stable_sort(rows.begin(), rows.end(), [](const EntryPoint& a, const EntryPoint& b) {
      int order = std::strcmp(a.base, b.base);
      return order != 0 ? order < 0 : a.version < b.version;
    });
    return rows;
  }();
  return sorted;
}

CUresult resolve(const char* symbol, void** pfn, int cudaVersion, cuuint64_t flags,
                 CUdriverProcAddressQueryResult* status) {
  constexpr cuuint64_t kKnownFlags = CU_GET_PROC_ADDRESS_LEGACY_STREAM | CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;
  if (symbol == nullptr || pfn == nullptr || (flags & ~kKnownFlags) != 0) return CUDA_ERROR_INVALID_VALUE;
  *pfn = nullptr;
  const std::vector<EntryPoint>& rows = table();
  auto first = std::lower_bound(rows.begin(), rows.end(), symbol,
                                [](const EntryPoint& e, const char* name) { return std::strcmp(e.base, name) < 0; });
  const EntryPoint* plain = nullptr;
  const EntryPoint* per_thread = nullptr;
  bool known = false;
  for (auto it = first; it != rows.end() && std::strcmp(it->base, symbol) == 0; ++it) {
    known = true;
    if (it->version > cudaVersion) continue;
    if (it->variant == 0) {
      if (plain == nullptr || it->version >= plain->version) plain = &*it;
    } else if (per_thread == nullptr || it->version >= per_thread->version) {
      per_thread = &*it;
    }
  }
  // Flags only choose between stream variants; DEFAULT means the legacy stream,
  // as for a program built without --default-stream per-thread.
  const EntryPoint* chosen = plain;
  if ((flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0 && per_thread != nullptr &&
      (plain == nullptr || per_thread->version >= plain->version)) {
    chosen = per_thread;
  }
  if (chosen == nullptr) {
    if (status != nullptr) {
      *status = known ? CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    }
    return CUDA_ERROR_NOT_FOUND;
  }
  *pfn = chosen->function;
  if (status != nullptr) *status = CU_GET_PROC_ADDRESS_SUCCESS;
  return CUDA_SUCCESS;
}

// FAKECUDA_TRACE_PROCADDR=1 prints every lookup: what a client resolves at
// which version (e.g. to see what cuda-bindings asks for at import).
void trace(const char* symbol, int cudaVersion, cuuint64_t flags, CUresult rc, void* pfn) {
  static const bool enabled = [] {
    const char* value = std::getenv("FAKECUDA_TRACE_PROCADDR");
    return value != nullptr && *value == '1';
  }();
  if (!enabled) return;
  const char* found = "-";
  if (rc == CUDA_SUCCESS) {
    for (const EntryPoint& e : table()) {
      if (e.function == pfn) found = e.symbol;
    }
  }
  std::fprintf(stderr, "fakecuda: cuGetProcAddress(\"%s\", %d, %llu) = %d %s\n", symbol != nullptr ? symbol : "(null)",
               cudaVersion, static_cast<unsigned long long>(flags), static_cast<int>(rc), found);
}

}  // namespace

extern "C" CUresult cuGetProcAddress_v2(const char* symbol, void** pfn, int cudaVersion, cuuint64_t flags,
                                        CUdriverProcAddressQueryResult* symbolStatus) {
  CUresult rc = resolve(symbol, pfn, cudaVersion, flags, symbolStatus);
  trace(symbol, cudaVersion, flags, rc, pfn != nullptr ? *pfn : nullptr);
  return rc;
}

extern "C" CUresult cuGetProcAddress(const char* symbol, void** pfn, int cudaVersion, cuuint64_t flags) {
  CUresult rc = resolve(symbol, pfn, cudaVersion, flags, nullptr);
  trace(symbol, cudaVersion, flags, rc, pfn != nullptr ? *pfn : nullptr);
  return rc;
}

// Test helper: whether an entry point is a generated stub (entry_stubs.c puts
// every stub in section fakecuda_stubs; the linker provides its bounds).
extern "C" const char __start_fakecuda_stubs[];
extern "C" const char __stop_fakecuda_stubs[];
extern "C" int fakecuda_symbol_is_stub(const void* function) {
  auto* p = static_cast<const char*>(function);
  return p >= __start_fakecuda_stubs && p < __stop_fakecuda_stubs ? 1 : 0;
}
