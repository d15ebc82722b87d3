#include "hook/real.h"

#include <atomic>
#include <dlfcn.h>
#include <time.h>

#include <cstring>

#include "hook/config.h"
#include "hook/log.h"
#include "platform/clock.h"
#include "platform/once.h"

namespace gpuslice::hook {

#define GPUSLICE_CU(symbol) decltype(&::symbol) real_##symbol = nullptr;
#define GPUSLICE_NVML(symbol) decltype(&::symbol) real_##symbol = nullptr;
#include "hook/symbols.def"
#define GPUSLICE_DEFINE_REAL(symbol) decltype(&::symbol) real_##symbol = nullptr;
GPUSLICE_CU_INTERNAL(GPUSLICE_DEFINE_REAL)
GPUSLICE_NVML_INTERNAL(GPUSLICE_DEFINE_REAL)
#undef GPUSLICE_DEFINE_REAL

namespace {

struct Hook {
  const char* name;
  void** real;
  void* wrapper;
  bool nvml;
};

// One row per symbols.def entry: the name the loader resolves, where the real
// pointer goes, and the exported wrapper that stands for it.
const Hook kHooks[] = {
#define GPUSLICE_CU(symbol) \
  {#symbol, reinterpret_cast<void**>(&real_##symbol), reinterpret_cast<void*>(&::symbol), false},
#define GPUSLICE_NVML(symbol) \
  {#symbol, reinterpret_cast<void**>(&real_##symbol), reinterpret_cast<void*>(&::symbol), true},
#include "hook/symbols.def"
};

struct Internal {
  const char* name;
  void** real;
};
#define GPUSLICE_INTERNAL_ROW(symbol) {#symbol, reinterpret_cast<void**>(&real_##symbol)},
const Internal kDriverInternal[] = {GPUSLICE_CU_INTERNAL(GPUSLICE_INTERNAL_ROW)};
const Internal kNvmlInternal[] = {GPUSLICE_NVML_INTERNAL(GPUSLICE_INTERNAL_ROW)};
#undef GPUSLICE_INTERNAL_ROW

// Where nodes install the driver when the loader's search path does not say:
// distribution multiarch dirs, the NVIDIA container runtime's mount, WSL, and
// the toolkit's forward-compatibility package.
const char* const kDriverPaths[] = {
    "libcuda.so.1",
    "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
    "/usr/lib/aarch64-linux-gnu/libcuda.so.1",
    "/usr/lib64/libcuda.so.1",
    "/usr/local/nvidia/lib64/libcuda.so.1",
    "/usr/lib/wsl/lib/libcuda.so.1",
    "/usr/local/cuda/compat/libcuda.so.1",
};
const char* const kNvmlPaths[] = {
    "libnvidia-ml.so.1",
    "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1",
    "/usr/lib/aarch64-linux-gnu/libnvidia-ml.so.1",
    "/usr/lib64/libnvidia-ml.so.1",
    "/usr/local/nvidia/lib64/libnvidia-ml.so.1",
    "/usr/lib/wsl/lib/libnvidia-ml.so.1",
};

std::atomic<void*> g_driver_handle{nullptr};
std::atomic<void*> g_nvml_handle{nullptr};
[[gnu::tls_model("initial-exec")]] thread_local bool t_loading = false;

// Threads that fail to load at the same moment report it once.
bool first_report(std::atomic<bool>& reported) noexcept { return !reported.exchange(true); }

void* open_first(const char* override_path, const options::OptionSource& source, const char* override_name,
                 const char* const* paths, size_t count) noexcept {
  if (std::strcmp(source.name, "default") != 0) {
    void* h = dlopen(override_path, RTLD_NOW | RTLD_LOCAL);
    static std::atomic<bool> reported[2];
    if (h == nullptr && first_report(reported[override_name[14] == 'N'])) {  // GPUSLICE_REAL_LIB{CUDA,NVML}
      const char* why = dlerror();
      GPUSLICE_LOG(error,
                   "%s=%s: cannot load it (%s), expected the path of the real library; CUDA calls fail "
                   "with CUDA_ERROR_NOT_INITIALIZED",
                   override_name, override_path, why ? why : "unknown error");
    }
    return h;  // an explicit override never falls back to a guess
  }
  for (size_t i = 0; i < count; ++i) {
    if (void* h = dlopen(paths[i], RTLD_NOW | RTLD_LOCAL)) return h;
  }
  return nullptr;
}

constexpr std::uint64_t kLoadWaitNs = 1'000'000'000;
// Running: loading; failed: unavailable (not retried).
platform::OnceFlag g_driver_state;
platform::OnceFlag g_nvml_state;

// Two threads resolve at once only when one of them could not wait for the
// other (see load_once). The first value wins; a thread stops as soon as the
// other has published everything (it then writes nothing at all), and never
// writes a pointer already set: the wrappers read these words plainly.
bool publish(void** slot, void* value, const platform::OnceFlag& state) noexcept {
  if (state.done()) return false;
  void* expected = nullptr;
  if (value != nullptr && __atomic_load_n(slot, __ATOMIC_ACQUIRE) == nullptr)
    __atomic_compare_exchange_n(slot, &expected, value, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
  return true;
}

void resolve(void* handle, bool nvml) noexcept {
  const platform::OnceFlag& state = nvml ? g_nvml_state : g_driver_state;
  for (const Hook& h : kHooks) {
    if (h.nvml == nvml && !publish(h.real, real_dlsym(handle, h.name), state)) return;
  }
  const Internal* table = nvml ? kNvmlInternal : kDriverInternal;
  size_t n = nvml ? sizeof kNvmlInternal / sizeof *kNvmlInternal : sizeof kDriverInternal / sizeof *kDriverInternal;
  for (size_t i = 0; i < n; ++i)
    if (!publish(table[i].real, real_dlsym(handle, table[i].name), state)) return;
}

// A library that loads but is not the one we need (a wrong path in an
// override): refused as a whole, never half-resolved with null entry points.
bool exports(void* handle, const char* symbol, const char* variable, const char* path, const char* what) noexcept {
  if (real_dlsym(handle, symbol) != nullptr) return true;
  static std::atomic<bool> reported{false};
  if (first_report(reported))
    GPUSLICE_LOG(error,
                 "%s=%s: the library has no %s, expected %s; CUDA calls fail with "
                 "CUDA_ERROR_NOT_INITIALIZED",
                 variable, path, symbol, what);
  return false;
}

bool load_driver_now() noexcept {
  const Config& cfg = config();
  void* h = open_first(cfg.options.real_libcuda, cfg.options.real_libcuda_source, "GPUSLICE_REAL_LIBCUDA", kDriverPaths,
                       sizeof kDriverPaths / sizeof *kDriverPaths);
  static std::atomic<bool> reported{false};
  if (h == nullptr && std::strcmp(cfg.options.real_libcuda_source.name, "default") == 0 && first_report(reported)) {
    GPUSLICE_LOG(error,
                 "no CUDA driver found (tried libcuda.so.1 on the loader's path and the usual "
                 "install locations); set GPUSLICE_REAL_LIBCUDA to its path");
  }
  if (h == nullptr || !exports(h, "cuInit", "GPUSLICE_REAL_LIBCUDA", cfg.options.real_libcuda, "the CUDA driver"))
    return false;
  resolve(h, false);
  g_driver_handle.store(h, std::memory_order_release);
  return true;
}

bool load_nvml_now() noexcept {
  const Config& cfg = config();
  void* h = open_first(cfg.options.real_libnvml, cfg.options.real_libnvml_source, "GPUSLICE_REAL_LIBNVML", kNvmlPaths,
                       sizeof kNvmlPaths / sizeof *kNvmlPaths);
  static std::atomic<bool> reported{false};
  if (h == nullptr) {
    if (std::strcmp(cfg.options.real_libnvml_source.name, "default") == 0 && first_report(reported))
      GPUSLICE_LOG(info,
                   "no NVML library found; NVML queries are not virtualised and context "
                   "memory is not measured");
    return false;
  }
  if (!exports(h, "nvmlInit_v2", "GPUSLICE_REAL_LIBNVML", cfg.options.real_libnvml, "NVML")) return false;
  resolve(h, true);
  g_nvml_handle.store(h, std::memory_order_release);
  return true;
}

using platform::monotonic_ns;

// Loading never waits unboundedly for another thread. A thread that finds
// the load in progress elsewhere may hold the loader lock (a library
// constructor calling cuInit, or looking a driver name up with dlsym) while
// the loading thread waits for that lock inside dlopen: waiting would
// deadlock. So a thread waits at most kLoadWaitNs, then loads for itself:
// dlopen is reference-counted and recursive under the loader lock, both get
// the same handle, and publish() keeps each pointer written once. A nested
// call on a loading thread (the driver's constructors calling dlsym) sees
// "unavailable".
bool load_once(platform::OnceFlag& state, bool (*load)() noexcept) noexcept {
  platform::OnceFlag::State s = state.state();
  if (s == platform::OnceFlag::kDone) return true;
  if (s == platform::OnceFlag::kFailed || t_loading) return false;
  if (!state.claim()) {
    // Usually the other thread is done in microseconds. If it is not, it may
    // be waiting for the loader lock this thread holds: stop waiting, load.
    s = state.wait(monotonic_ns, kLoadWaitNs);
    if (s == platform::OnceFlag::kDone) return true;
    if (s == platform::OnceFlag::kFailed) return false;
  }
  t_loading = true;
  const bool ok = load();
  t_loading = false;
  if (ok) {
    state.complete();
    return true;
  }
  state.fail();  // never overwrites another thread's success
  return state.done();
}

// A name resolved at load time, or nullptr (then glibc's dlsym answers).
void* preresolved(const char* name) noexcept {
  for (const Internal& row : kDriverInternal)
    if (std::strcmp(row.name, name) == 0) return __atomic_load_n(row.real, __ATOMIC_ACQUIRE);
  for (const Hook& h : kHooks)
    if (!h.nvml && std::strcmp(h.name, name) == 0) return __atomic_load_n(h.real, __ATOMIC_ACQUIRE);
  return nullptr;
}

}  // namespace

extern "C" {
[[gnu::visibility("hidden")]] void* (*gpuslice_real_dlsym)(void*, const char*) = nullptr;
}

#if defined(__x86_64__)
// In dlsym_x86_64.S: the sanitizer runtimes reach it before any instrumented code may run.
extern "C" void* gpuslice_resolve_real_dlsym() noexcept;
#else
extern "C" void* gpuslice_resolve_real_dlsym() noexcept {
  void* f = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
  if (f == nullptr) f = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
  __atomic_store_n(&gpuslice_real_dlsym, reinterpret_cast<void* (*)(void*, const char*)>(f), __ATOMIC_RELEASE);
  return f;
}
#endif

bool resolve_real_dlsym() noexcept {
  if (__atomic_load_n(&gpuslice_real_dlsym, __ATOMIC_ACQUIRE) != nullptr) return true;
  return gpuslice_resolve_real_dlsym() != nullptr;
}

void* real_dlsym(void* handle, const char* name) noexcept {
  // The driver's own entry points, once loaded, come from our table: glibc's
  // dlsym takes the loader lock, and a caller of ours may hold it.
  if (handle != nullptr && name != nullptr && g_driver_state.done() &&
      handle == g_driver_handle.load(std::memory_order_acquire)) {
    if (void* p = preresolved(name)) return p;
  }
  if (!resolve_real_dlsym()) return nullptr;
  return __atomic_load_n(&gpuslice_real_dlsym, __ATOMIC_ACQUIRE)(handle, name);
}

bool load_driver() noexcept { return load_once(g_driver_state, load_driver_now); }
bool load_nvml() noexcept { return load_once(g_nvml_state, load_nvml_now); }
void* driver_handle() noexcept { return g_driver_handle.load(std::memory_order_acquire); }
void* nvml_handle() noexcept { return g_nvml_handle.load(std::memory_order_acquire); }

void* wrapper_for_real(const void* real) noexcept {
  if (real == nullptr) return nullptr;
  const bool driver = g_driver_state.done();
  const bool nvml = g_nvml_state.done();
  for (const Hook& h : kHooks) {
    if ((h.nvml ? nvml : driver) && *h.real == real) return h.wrapper;
  }
  return nullptr;
}

}  // namespace gpuslice::hook
