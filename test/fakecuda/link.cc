// The JIT linker (cuLinkCreate/AddData/AddFile/Complete/Destroy). Nothing is
// compiled: the output is a fatbin whose entries are the inputs (PTX as PTX,
// cubins as ELF; a fatbin input contributes its own bytes), so the module
// loaded from it contains every kernel its inputs name. Host objects and
// archives (CU_JIT_INPUT_OBJECT/LIBRARY) are not parsed: they make the output
// opaque (image.cc: any kernel name is accepted). The info/error log buffers
// the caller passed are left empty (a successful link logs nothing here).
#include <cstring>
#include <fstream>
#include <sstream>
#include <vector>

#include "driver.h"

using namespace gpuslice::fakecuda;

struct CUlinkState_st {
  static constexpr std::uint32_t kAlive = 0x11A11A11;
  std::string output;
  bool inputs = false;
  bool lto = false;
  std::vector<std::pair<char*, std::size_t>> logs;  // caller's log buffers
};

namespace {

HandlePool<CUlinkState_st> g_links;  // runtime mutex

bool options_valid(unsigned n, const CUjit_option* options, void** values) {
  return n == 0 || (options != nullptr && values != nullptr);
}

}  // namespace

extern "C" CUresult cuLinkCreate_v2(unsigned int numOptions, CUjit_option* options, void** optionValues,
                                    CUlinkState* stateOut) {
  if (stateOut == nullptr || !options_valid(numOptions, options, optionValues)) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  CUctx_st* ctx = nullptr;
  if (CUresult rc = current_context(&ctx); rc != CUDA_SUCCESS) return rc;
  std::lock_guard guard(runtime().mu);
  CUlinkState_st* link = g_links.make();
  std::size_t info_size = 0, error_size = 0;
  char *info = nullptr, *error = nullptr;
  for (unsigned i = 0; i < numOptions; ++i) {
    const auto value = reinterpret_cast<std::uintptr_t>(optionValues[i]);
    switch (options[i]) {
      case CU_JIT_LTO: link->lto = value != 0; break;
      case CU_JIT_INFO_LOG_BUFFER: info = static_cast<char*>(optionValues[i]); break;
      case CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES: info_size = value; break;
      case CU_JIT_ERROR_LOG_BUFFER: error = static_cast<char*>(optionValues[i]); break;
      case CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES: error_size = value; break;
      default:
        if (options[i] < 0 || options[i] >= CU_JIT_NUM_OPTIONS) {
          g_links.retire(link);
          return CUDA_ERROR_INVALID_VALUE;
        }
    }
  }
  if (info != nullptr && info_size > 0) link->logs.emplace_back(info, info_size);
  if (error != nullptr && error_size > 0) link->logs.emplace_back(error, error_size);
  for (auto& log : link->logs) log.first[0] = '\0';
  *stateOut = link;
  return CUDA_SUCCESS;
}
extern "C" CUresult cuLinkCreate(unsigned int numOptions, CUjit_option* options, void** optionValues,
                                 CUlinkState* stateOut) {
  return cuLinkCreate_v2(numOptions, options, optionValues, stateOut);
}

extern "C" CUresult cuLinkAddData_v2(CUlinkState state, CUjitInputType type, void* data, size_t size, const char* name,
                                     unsigned int numOptions, CUjit_option* options, void** optionValues) {
  (void)name;
  if (data == nullptr || size == 0 || !options_valid(numOptions, options, optionValues)) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (!initialized()) return uninitialized_error();
  std::string bytes;
  bool opaque = false;
  std::uint16_t kind = 2;
  switch (type) {
    case CU_JIT_INPUT_PTX:
      bytes.assign(static_cast<const char*>(data), strnlen(static_cast<const char*>(data), size));
      kind = 1;
      break;
    case CU_JIT_INPUT_CUBIN:
    case CU_JIT_INPUT_FATBINARY: {
      if (CUresult rc = read_image(data, &bytes, &opaque, size); rc != CUDA_SUCCESS) return rc;
      break;
    }
    case CU_JIT_INPUT_NVVM:  // LTO-IR: only with CU_JIT_LTO (cuda.h)
      bytes.assign(static_cast<const char*>(data), size);
      break;
    case CU_JIT_INPUT_OBJECT:
    case CU_JIT_INPUT_LIBRARY:
      bytes.assign(static_cast<const char*>(data), size);
      opaque = true;
      break;
    default: return CUDA_ERROR_INVALID_VALUE;
  }
  std::lock_guard guard(runtime().mu);
  if (!alive(state)) return CUDA_ERROR_INVALID_HANDLE;
  if (type == CU_JIT_INPUT_NVVM && !state->lto) return CUDA_ERROR_INVALID_VALUE;
  fatbin_append_entry(&state->output, kind, bytes, opaque);
  state->inputs = true;
  return CUDA_SUCCESS;
}
extern "C" CUresult cuLinkAddData(CUlinkState state, CUjitInputType type, void* data, size_t size, const char* name,
                                  unsigned int numOptions, CUjit_option* options, void** optionValues) {
  return cuLinkAddData_v2(state, type, data, size, name, numOptions, options, optionValues);
}

extern "C" CUresult cuLinkAddFile_v2(CUlinkState state, CUjitInputType type, const char* path, unsigned int numOptions,
                                     CUjit_option* options, void** optionValues) {
  if (path == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  std::ifstream file(path, std::ios::binary);
  if (!file) return CUDA_ERROR_FILE_NOT_FOUND;
  std::ostringstream text;
  text << file.rdbuf();
  std::string bytes = text.str();
  if (bytes.empty()) return CUDA_ERROR_INVALID_IMAGE;
  return cuLinkAddData_v2(state, type, bytes.data(), bytes.size() + 1, path, numOptions, options, optionValues);
}
extern "C" CUresult cuLinkAddFile(CUlinkState state, CUjitInputType type, const char* path, unsigned int numOptions,
                                  CUjit_option* options, void** optionValues) {
  return cuLinkAddFile_v2(state, type, path, numOptions, options, optionValues);
}

// The image stays valid until cuLinkDestroy (cuda.h).
extern "C" CUresult cuLinkComplete(CUlinkState state, void** cubinOut, size_t* sizeOut) {
  if (cubinOut == nullptr || sizeOut == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  std::lock_guard guard(runtime().mu);
  if (!alive(state)) return CUDA_ERROR_INVALID_HANDLE;
  if (!state->inputs) return CUDA_ERROR_INVALID_VALUE;  // nothing to link
  *cubinOut = state->output.data();
  *sizeOut = state->output.size();
  return CUDA_SUCCESS;
}

extern "C" CUresult cuLinkDestroy(CUlinkState state) {
  if (!initialized()) return uninitialized_error();
  std::lock_guard guard(runtime().mu);
  if (!alive(state)) return CUDA_ERROR_INVALID_HANDLE;
  state->output.clear();
  state->output.shrink_to_fit();
  g_links.retire(state);
  return CUDA_SUCCESS;
}
