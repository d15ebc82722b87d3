// Modules, libraries and functions. A module "contains" a function when the
// function's name appears in its image's bytes (image.cc reads PTX, cubin and
// fatbin images); its simulated run time is kernel_duration_ns (image.cc).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>

#include "driver.h"

using namespace gpuslice::fakecuda;

namespace {

HandlePool<CUmod_st> g_modules;  // runtime mutex
HandlePool<CUfunc_st> g_functions;
HandlePool<CUlib_st> g_libraries;

std::uint64_t round_up(std::uint64_t value, std::uint64_t to) { return (value + to - 1) / to * to; }

bool starts_statement(const std::string& text, std::size_t at) {
  if (at == 0) return true;
  char c = text[at - 1];
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == ';' || c == '{' || c == '}';
}

// PTX global declarations: `.global [.align A] .<b|u|s|f><bits> name[N]...;`
// (`ld.global` and friends are instructions, not declarations). Lays them out
// in order, each aligned, and returns the total size.
std::uint64_t parse_globals(const std::string& text, std::map<std::string, CUmod_st::Global>& out) {
  std::uint64_t total = 0;
  for (std::size_t pos = text.find(".global"); pos != std::string::npos; pos = text.find(".global", pos + 7)) {
    std::size_t after = pos + 7;
    if (!starts_statement(text, pos) || after >= text.size() || (text[after] != ' ' && text[after] != '\t')) {
      continue;
    }
    std::size_t end = text.find(';', after);
    if (end == std::string::npos) break;
    std::istringstream decl(text.substr(after, end - after));
    std::string token, name;
    std::uint64_t element = 0, align = 1;
    while (decl >> token) {
      if (token == ".align") {
        decl >> align;
      } else if (token.size() > 2 && token[0] == '.' && std::strchr("busf", token[1]) != nullptr && token[2] >= '0' &&
                 token[2] <= '9') {
        element = std::strtoull(token.c_str() + 2, nullptr, 10) / 8;
      } else if (token[0] != '.') {
        name = token;
        break;
      }
    }
    if (element == 0 || name.empty()) continue;
    std::uint64_t count = 1;
    std::size_t bracket = name.find('[');
    std::string base = name.substr(0, bracket);
    while (bracket != std::string::npos) {
      count *= std::strtoull(name.c_str() + bracket + 1, nullptr, 10);
      bracket = name.find('[', bracket + 1);
    }
    if (align == 0 || (align & (align - 1)) != 0) align = 1;
    total = round_up(total, align);
    out[base] = CUmod_st::Global{total, element * count};
    total += element * count;
  }
  return total;
}

// Charges the module's memory on `dev`: its globals plus the image (code),
// rounded up to 64 KiB. OUT_OF_MEMORY when the device is full.
CUresult place_locked(CUmod_st* module, std::uint32_t dev) {
  if (module->placed) return CUDA_SUCCESS;
  std::uint64_t held = 0;
  if (state().header().module_memory != 0) held = round_up(module->globals_bytes + module->image.size(), 64 * 1024);
  if (held > 0) {
    if (CUresult rc = charge_device(dev, held); rc != CUDA_SUCCESS) return rc;
  }
  module->device = dev;
  module->held = held;
  module->globals_base = reserve_address(dev, module->globals_bytes > 0 ? module->globals_bytes : 1, 512);
  module->placed = true;
  return CUDA_SUCCESS;
}

// Loads a library's module into `ctx` (its memory owner) at its first use
// there: its own globals and code on the context's device.
CUresult place_library_locked(CUmod_st* module, CUctx_st* ctx, CUdeviceptr* globals_base = nullptr) {
  CUctx_st* owner = memory_owner(ctx);
  for (const CUmod_st::Placement& p : module->placements) {
    if (p.ctx != owner) continue;
    if (globals_base != nullptr) *globals_base = p.globals_base;
    module->placed_ctx_id.store(owner->id, std::memory_order_release);
    return CUDA_SUCCESS;
  }
  std::uint64_t held = 0;
  if (state().header().module_memory != 0) held = round_up(module->globals_bytes + module->image.size(), 64 * 1024);
  if (held > 0) {
    if (CUresult rc = charge_device(owner->device, held); rc != CUDA_SUCCESS) return rc;
  }
  CUdeviceptr base = reserve_address(owner->device, module->globals_bytes > 0 ? module->globals_bytes : 1, 512);
  module->placements.push_back(CUmod_st::Placement{owner, owner->device, held, base});
  if (globals_base != nullptr) *globals_base = base;
  module->placed_ctx_id.store(owner->id, std::memory_order_release);
  return CUDA_SUCCESS;
}

void unplace_library_locked(CUmod_st* module, CUctx_st* ctx) {
  auto& list = module->placements;
  for (auto it = list.begin(); it != list.end();) {
    if (ctx != nullptr && it->ctx != ctx) {
      ++it;
      continue;
    }
    if (it->held > 0) uncharge_device(it->device, it->held);
    if (module->placed_ctx_id.load(std::memory_order_relaxed) == it->ctx->id) {
      module->placed_ctx_id.store(0, std::memory_order_release);
    }
    it = list.erase(it);
  }
}

CUmod_st* load_locked(std::string image, bool opaque, CUctx_st* ctx) {
  CUmod_st* module = g_modules.make();
  module->ctx = memory_owner(ctx);
  module->image = std::move(image);
  module->opaque = opaque;
  module->globals_bytes = parse_globals(module->image, module->globals);
  return module;
}

void unload_locked(CUmod_st* module) {
  if (module->placed) uncharge_device(module->device, module->held);
  unplace_library_locked(module, nullptr);  // a library: every context's copy
  module->placed = false;
  for (auto& entry : module->functions) g_functions.retire(entry.second);
  module->functions.clear();
  g_modules.retire(module);
}

CUresult get_function_locked(CUmod_st* module, const char* name, CUfunc_st** out) {
  auto it = module->functions.find(name);
  if (it != module->functions.end()) {
    *out = it->second;
    return CUDA_SUCCESS;
  }
  if (*name == '\0' || (!module->opaque && module->image.find(name) == std::string::npos)) {
    return CUDA_ERROR_NOT_FOUND;
  }
  CUfunc_st* function = g_functions.make();
  function->module = module;
  function->name = name;
  function->duration_ns = kernel_duration_ns(function->name);
  module->functions[name] = function;
  *out = function;
  return CUDA_SUCCESS;
}

CUresult module_load(CUmodule* module, const void* image, std::uint64_t limit = ~std::uint64_t{0}) {
  if (module == nullptr || image == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  CUctx_st* ctx = nullptr;
  if (CUresult rc = current_context(&ctx); rc != CUDA_SUCCESS) return rc;
  std::string text;
  bool opaque = false;
  if (CUresult rc = read_image(image, &text, &opaque, limit); rc != CUDA_SUCCESS) return rc;
  std::lock_guard guard(runtime().mu);
  CUmod_st* loaded = load_locked(std::move(text), opaque, ctx);
  if (CUresult rc = place_locked(loaded, ctx->device); rc != CUDA_SUCCESS) {
    unload_locked(loaded);
    return rc;
  }
  *module = loaded;
  return CUDA_SUCCESS;
}

CUresult get_global(CUdeviceptr* dptr, size_t* bytes, CUmod_st* module, const char* name, CUdeviceptr base) {
  auto it = module->globals.find(name);
  if (it == module->globals.end()) return CUDA_ERROR_NOT_FOUND;
  if (dptr != nullptr) *dptr = base + it->second.offset;
  if (bytes != nullptr) *bytes = it->second.size;
  return CUDA_SUCCESS;
}

}  // namespace

namespace gpuslice::fakecuda {

void modules_release_context_locked(CUctx_st* ctx) {
  g_modules.for_each_live([&](CUmod_st* module) {
    if (module->ctx == ctx) {
      unload_locked(module);
    } else if (module->ctx == nullptr) {
      unplace_library_locked(module, ctx);  // the context's copy of a library goes with it
    }
  });
}

CUfunc_st* function_from_handle(CUfunction f) { return alive(f) ? f : nullptr; }

CUresult place_library_at_launch(CUfunc_st* function, CUctx_st* ctx) {
  std::lock_guard guard(runtime().mu);
  if (!alive(function) || function->module == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  return place_library_locked(function->module, ctx);
}

// A library's copies are named by its CUlibrary, the handle its program
// holds (its module is the simulator's own object).
void holdings_modules_locked(std::string* out) {
  char line[160];
  std::set<const CUmod_st*> of_libraries;
  const auto copies = [&](const void* name, const CUmod_st* m) {
    for (const CUmod_st::Placement& p : m->placements) {
      if (p.held == 0) continue;
      std::snprintf(line, sizeof(line), "    library %p held %llu dev%u ctx %llu\n", name,
                    static_cast<unsigned long long>(p.held), p.device, static_cast<unsigned long long>(p.ctx->id));
      *out += line;
    }
  };
  g_libraries.for_each_live([&](CUlib_st* l) {
    if (l->module == nullptr) return;
    of_libraries.insert(l->module);
    copies(l, l->module);
  });
  g_modules.for_each_live([&](CUmod_st* m) {
    if (of_libraries.count(m) == 0) copies(m, m);
    if (!m->placed.load(std::memory_order_relaxed) || m->held == 0) return;
    std::snprintf(line, sizeof(line), "    module %p held %llu dev%u\n", static_cast<void*>(m),
                  static_cast<unsigned long long>(m->held), m->device);
    *out += line;
  });
}
}  // namespace gpuslice::fakecuda

extern "C" CUresult cuModuleLoadData(CUmodule* module, const void* image) { return module_load(module, image); }

extern "C" CUresult cuModuleLoadDataEx(CUmodule* module, const void* image, unsigned int numOptions,
                                       CUjit_option* options, void** optionValues) {
  if (numOptions > 0 && (options == nullptr || optionValues == nullptr)) return CUDA_ERROR_INVALID_VALUE;
  return module_load(module, image);
}

extern "C" CUresult cuModuleLoadFatBinary(CUmodule* module, const void* fatCubin) {
  return module_load(module, fatCubin);
}

extern "C" CUresult cuModuleLoad(CUmodule* module, const char* fname) {
  if (module == nullptr || fname == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  std::ifstream file(fname, std::ios::binary);
  if (!file) return CUDA_ERROR_FILE_NOT_FOUND;
  std::ostringstream text;
  text << file.rdbuf();
  std::string image = text.str();
  return module_load(module, image.c_str(), image.size() + 1);
}

extern "C" CUresult cuModuleUnload(CUmodule hmod) {
  if (!initialized()) return uninitialized_error();
  std::lock_guard guard(runtime().mu);
  if (!alive(hmod) || hmod->ctx == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  unload_locked(hmod);
  return CUDA_SUCCESS;
}

extern "C" CUresult cuModuleGetFunction(CUfunction* hfunc, CUmodule hmod, const char* name) {
  if (hfunc == nullptr || name == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  std::lock_guard guard(runtime().mu);
  if (!alive(hmod)) return CUDA_ERROR_INVALID_HANDLE;
  return get_function_locked(hmod, name, hfunc);
}

extern "C" CUresult cuModuleGetLoadingMode(CUmoduleLoadingMode* mode) {
  if (mode == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  *mode = CU_MODULE_LAZY_LOADING;
  return CUDA_SUCCESS;
}

extern "C" CUresult cuFuncGetName(const char** name, CUfunction hfunc) {
  if (name == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  if (!alive(hfunc)) return CUDA_ERROR_INVALID_HANDLE;
  *name = hfunc->name.c_str();
  return CUDA_SUCCESS;
}

extern "C" CUresult cuFuncGetModule(CUmodule* hmod, CUfunction hfunc) {
  if (hmod == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  if (!alive(hfunc)) return CUDA_ERROR_INVALID_HANDLE;
  *hmod = hfunc->module;
  return CUDA_SUCCESS;
}

extern "C" CUresult cuFuncGetAttribute(int* pi, CUfunction_attribute attrib, CUfunction hfunc) {
  if (pi == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  if (!alive(hfunc)) return CUDA_ERROR_INVALID_HANDLE;
  switch (attrib) {
    case CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *pi = 1024; break;
    case CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES: *pi = 0; break;
    case CU_FUNC_ATTRIBUTE_CONST_SIZE_BYTES: *pi = 0; break;
    case CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES: *pi = 0; break;
    case CU_FUNC_ATTRIBUTE_NUM_REGS: *pi = 32; break;
    case CU_FUNC_ATTRIBUTE_PTX_VERSION: *pi = 90; break;
    case CU_FUNC_ATTRIBUTE_BINARY_VERSION: *pi = 90; break;
    case CU_FUNC_ATTRIBUTE_CACHE_MODE_CA: *pi = 0; break;
    case CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES: *pi = hfunc->max_dynamic_shared; break;
    case CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT: *pi = -1; break;
    default:
      if (attrib < 0 || attrib >= CU_FUNC_ATTRIBUTE_MAX) return CUDA_ERROR_INVALID_VALUE;
      *pi = 0;
  }
  return CUDA_SUCCESS;
}

extern "C" CUresult cuFuncSetAttribute(CUfunction hfunc, CUfunction_attribute attrib, int value) {
  if (!initialized()) return uninitialized_error();
  if (!alive(hfunc)) return CUDA_ERROR_INVALID_HANDLE;
  if (attrib == CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES) {
    if (value < 0 || value > 232448) return CUDA_ERROR_INVALID_VALUE;
    hfunc->max_dynamic_shared = value;
  }
  return CUDA_SUCCESS;
}

extern "C" CUresult cuFuncSetCacheConfig(CUfunction hfunc, CUfunc_cache config) {
  (void)config;
  if (!initialized()) return uninitialized_error();
  return alive(hfunc) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

extern "C" CUresult cuOccupancyMaxActiveBlocksPerMultiprocessor(int* numBlocks, CUfunction func, int blockSize,
                                                                size_t dynamicSMemSize) {
  (void)dynamicSMemSize;
  if (numBlocks == nullptr || blockSize <= 0 || blockSize > 1024) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  if (!alive(func)) return CUDA_ERROR_INVALID_HANDLE;
  int warps = (blockSize + 31) / 32;
  *numBlocks = std::min(32, 64 / warps);  // 2048 threads = 64 warps per SM, 32 blocks max
  return CUDA_SUCCESS;
}

// Libraries are context-independent modules; a CUkernel is the same object as
// the CUfunction it resolves to, which is what lets a CUkernel be passed where a
// CUfunction is expected, as the driver allows.
extern "C" CUresult cuLibraryLoadData(CUlibrary* library, const void* code, CUjit_option* jitOptions,
                                      void** jitOptionsValues, unsigned int numJitOptions,
                                      CUlibraryOption* libraryOptions, void** libraryOptionValues,
                                      unsigned int numLibraryOptions) {
  (void)jitOptions;
  (void)jitOptionsValues;
  (void)numJitOptions;
  (void)libraryOptions;
  (void)libraryOptionValues;
  (void)numLibraryOptions;
  if (library == nullptr || code == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  std::string text;
  bool opaque = false;
  if (CUresult rc = read_image(code, &text, &opaque); rc != CUDA_SUCCESS) return rc;
  std::lock_guard guard(runtime().mu);
  CUmod_st* module = load_locked(std::move(text), opaque, nullptr);
  // Loaded into the current context now (the model's choice); into any other
  // context at its first use there (NVIDIA's lazy loading, README "Modules").
  CUctx_st* ctx = nullptr;
  if (current_context(&ctx) == CUDA_SUCCESS) {
    if (CUresult rc = place_library_locked(module, ctx); rc != CUDA_SUCCESS) {
      unload_locked(module);
      return rc;
    }
  }
  CUlib_st* created = g_libraries.make();
  created->module = module;
  *library = created;
  return CUDA_SUCCESS;
}

extern "C" CUresult cuLibraryLoadFromFile(CUlibrary* library, const char* fileName, CUjit_option* jitOptions,
                                          void** jitOptionsValues, unsigned int numJitOptions,
                                          CUlibraryOption* libraryOptions, void** libraryOptionValues,
                                          unsigned int numLibraryOptions) {
  if (library == nullptr || fileName == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  std::ifstream file(fileName, std::ios::binary);
  if (!file) return CUDA_ERROR_FILE_NOT_FOUND;
  std::ostringstream text;
  text << file.rdbuf();
  std::string image = text.str();
  // A binary image must fit in the file (cuLibraryLoadData cannot tell).
  std::string checked;
  bool opaque = false;
  if (CUresult rc = read_image(image.c_str(), &checked, &opaque, image.size() + 1); rc != CUDA_SUCCESS) return rc;
  return cuLibraryLoadData(library, image.c_str(), jitOptions, jitOptionsValues, numJitOptions, libraryOptions,
                           libraryOptionValues, numLibraryOptions);
}

extern "C" CUresult cuLibraryGetGlobal(CUdeviceptr* dptr, size_t* bytes, CUlibrary library, const char* name) {
  if (name == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  CUctx_st* ctx = nullptr;
  if (CUresult rc = current_context(&ctx); rc != CUDA_SUCCESS) return rc;
  std::lock_guard guard(runtime().mu);
  if (!alive(library)) return CUDA_ERROR_INVALID_HANDLE;
  CUdeviceptr base = 0;
  if (CUresult rc = place_library_locked(library->module, ctx, &base); rc != CUDA_SUCCESS) return rc;
  return get_global(dptr, bytes, library->module, name, base);
}

extern "C" CUresult cuModuleGetGlobal_v2(CUdeviceptr* dptr, size_t* bytes, CUmodule hmod, const char* name) {
  if (name == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  std::lock_guard guard(runtime().mu);
  if (!alive(hmod)) return CUDA_ERROR_INVALID_HANDLE;
  // A library's module: cuLibraryGetModule gave it for the current context
  // and placed the library there (a module's data is allocated at its load,
  // not lazily: cuModuleLoad), so this answers from the current context's copy
  // and places nothing. Without one, the handle belongs to no module of this
  // context (another context's, one gone with its context, or a handle the
  // program never got: one object serves every context, README "Modules").
  if (hmod->ctx == nullptr) {
    CUctx_st* ctx = nullptr;
    if (CUresult rc = current_context(&ctx); rc != CUDA_SUCCESS) return rc;
    const CUctx_st* owner = memory_owner(ctx);
    for (const CUmod_st::Placement& p : hmod->placements) {
      if (p.ctx == owner) return get_global(dptr, bytes, hmod, name, p.globals_base);
    }
    return CUDA_ERROR_INVALID_HANDLE;
  }
  return get_global(dptr, bytes, hmod, name, hmod->globals_base);
}

extern "C" CUresult cuLibraryUnload(CUlibrary library) {
  if (!initialized()) return uninitialized_error();
  {
    std::lock_guard guard(runtime().mu);
    if (!alive(library)) return CUDA_ERROR_INVALID_HANDLE;
    unload_locked(library->module);
    g_libraries.retire(library);
  }
  // A return point (README, "Chaos points"): the handle is free and the next
  // cuLibraryLoadData of another thread gets it back before this call returns.
  chaos_point("cuLibraryUnload");
  return CUDA_SUCCESS;
}

// The module of the library in the current context: a library loaded with no
// context current is placed there now (cuda.h: "for the current context").
extern "C" CUresult cuLibraryGetModule(CUmodule* pMod, CUlibrary library) {
  if (pMod == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  CUctx_st* ctx = nullptr;
  if (CUresult rc = current_context(&ctx); rc != CUDA_SUCCESS) return rc;
  std::lock_guard guard(runtime().mu);
  if (!alive(library)) return CUDA_ERROR_INVALID_HANDLE;
  if (CUresult rc = place_library_locked(library->module, ctx); rc != CUDA_SUCCESS) return rc;
  *pMod = library->module;
  return CUDA_SUCCESS;
}

extern "C" CUresult cuLibraryGetKernel(CUkernel* pKernel, CUlibrary library, const char* name) {
  if (pKernel == nullptr || name == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  std::lock_guard guard(runtime().mu);
  if (!alive(library)) return CUDA_ERROR_INVALID_HANDLE;
  CUfunc_st* function = nullptr;
  if (CUresult rc = get_function_locked(library->module, name, &function); rc != CUDA_SUCCESS) return rc;
  *pKernel = reinterpret_cast<CUkernel>(function);
  return CUDA_SUCCESS;
}

extern "C" CUresult cuKernelGetFunction(CUfunction* pFunc, CUkernel kernel) {
  if (pFunc == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  auto* function = reinterpret_cast<CUfunc_st*>(kernel);
  if (!alive(function)) return CUDA_ERROR_INVALID_HANDLE;
  CUctx_st* ctx = nullptr;
  if (CUresult rc = current_context(&ctx); rc != CUDA_SUCCESS) return rc;
  // The function in the current context: its lazily loaded library is placed now.
  std::lock_guard guard(runtime().mu);
  if (!alive(function) || function->module == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  if (function->module->ctx == nullptr) {
    if (CUresult rc = place_library_locked(function->module, ctx); rc != CUDA_SUCCESS) return rc;
  }
  *pFunc = function;
  return CUDA_SUCCESS;
}

extern "C" CUresult cuKernelGetName(const char** name, CUkernel hfunc) {
  return cuFuncGetName(name, reinterpret_cast<CUfunction>(hfunc));
}
