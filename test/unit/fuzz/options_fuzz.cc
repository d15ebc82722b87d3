// Fuzz target: the option parser (parse_options over an environment made of
// the input's lines) and parse_size against a reference implementation.
#include <cstring>
#include <string>

#include "fuzz_target.h"
#include "limiter/options/options.h"

using gpuslice::fuzz::fail;
namespace options = gpuslice::options;

namespace {

// Independent reading of the documented size grammar.
bool reference_size(const std::string& s, std::uint64_t* out) {
  std::size_t i = 0;
  while (i < s.size() && s[i] >= '0' && s[i] <= '9') ++i;
  if (i == 0) return false;
  const std::string unit = s.substr(i);
  static const struct {
    const char* suffix;
    unsigned __int128 factor;
  } kUnits[] = {{"", 1},
                {"B", 1},
                {"K", 1000},
                {"KB", 1000},
                {"k", 1000},
                {"kB", 1000},
                {"M", 1000000},
                {"MB", 1000000},
                {"G", 1000000000},
                {"GB", 1000000000},
                {"T", 1000000000000ull},
                {"TB", 1000000000000ull},
                {"Ki", 1024},
                {"KiB", 1024},
                {"Mi", 1u << 20},
                {"MiB", 1u << 20},
                {"Gi", 1u << 30},
                {"GiB", 1u << 30},
                {"Ti", 1ull << 40},
                {"TiB", 1ull << 40}};
  for (const auto& u : kUnits) {
    if (unit != u.suffix) continue;
    unsigned __int128 v = 0;
    for (std::size_t k = 0; k < i; ++k) {
      v = v * 10 + static_cast<unsigned>(s[k] - '0');
      if (v > ~std::uint64_t{0}) return false;
    }
    v *= u.factor;
    if (v > ~std::uint64_t{0}) return false;
    *out = static_cast<std::uint64_t>(v);
    return true;
  }
  return false;
}

bool terminated(const char* s, std::size_t cap) { return std::memchr(s, 0, cap) != nullptr; }

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size > 64 * 1024) return 0;
  std::string text(reinterpret_cast<const char*>(data), size);
  // Environment entries: one per line (NUL bytes end an entry early, as in C).
  std::string storage = text;
  char* envp[129];
  std::size_t n = 0;
  std::size_t start = 0;
  for (std::size_t i = 0; i <= storage.size() && n < 128; ++i) {
    if (i == storage.size() || storage[i] == '\n') {
      if (i < storage.size()) storage[i] = '\0';
      envp[n++] = &storage[start];
      start = i + 1;
    }
  }
  envp[n] = nullptr;

  static options::Options options;
  gpuslice::shm::Error err;
  std::memset(err.message, 'X', sizeof err.message);
  const bool ok = options::parse_options(envp, &options, &err);
  if (!terminated(err.message, sizeof err.message)) fail("error message not terminated");
  const std::string message = err.message;
  if (ok) {
    if (!message.empty()) fail("success with a message");
    for (std::uint32_t d = 0; d < gpuslice::kMaxDevices; ++d) {
      if (options.memory_limit[d] == 0) fail("zero quota accepted");
      if (options.sm_limit[d] < 1 || options.sm_limit[d] > 100) fail("sm limit out of range");
      if (!terminated(options.memory_limit_source[d].name, 64)) fail("source not terminated");
    }
    if (options.region[0] != '/') fail("relative region accepted");
    if (options.log_level < 0 || options.log_level > 3) fail("log level out of range");
    if (!terminated(options.container_name, 64) || !terminated(options.real_libcuda, 4096)) fail("unterminated string");
    static char listing[1 << 16];
    const int len = options::format_effective_options(options, listing, sizeof listing);
    if (len < 0 || static_cast<std::size_t>(len) != std::strlen(listing)) fail("listing length");
  } else {
    if (message.rfind("gpuslice: ", 0) != 0) fail("message prefix");
    if (message.find("expected") == std::string::npos) fail("message lacks 'expected'");
    if (message.find('\n') != std::string::npos) fail("multi-line message");
  }

  // parse_size on every line agrees with the reference grammar.
  for (std::size_t i = 0; i < n; ++i) {
    std::uint64_t got = 0, want = 0;
    const bool a = options::parse_size(envp[i], &got);
    const bool b = reference_size(envp[i], &want);
    if (a != b || (a && got != want)) fail("parse_size disagrees with the reference grammar");
    std::uint32_t pct = 0;
    if (options::parse_percent(envp[i], &pct) && (pct < 1 || pct > 100)) fail("percent out of range");
  }
  return 0;
}

namespace gpuslice::fuzz {
std::vector<std::string> seeds() {
  return {
      "GPUSLICE_MEMORY_LIMIT=8Gi",
      "GPUSLICE_MEMORY_LIMIT=0=8Gi,1=4Gi,15=1T\nGPUSLICE_SM_LIMIT=0=30,1=50%",
      "CUDA_DEVICE_MEMORY_LIMIT=4096m\nCUDA_DEVICE_MEMORY_LIMIT_1=2g\nCUDA_DEVICE_SM_LIMIT=40\nCUDA_DEVICE_SM_LIMIT_3="
      "0",
      "GPUSLICE_SM_POLICY=elastic\nGPUSLICE_LOG_LEVEL=debug\nGPUSLICE_CONTAINER_NAME=c1",
      "GPUSLICE_REGION=/dev/shm/x.region\nGPUSLICE_REAL_LIBCUDA=/usr/lib/"
      "libcuda.so.1\nGPUSLICE_REAL_LIBNVML=libnvidia-ml.so.1",
      "8Gi\n18446744073709551615\n16777215TiB\n1000kB\n12\n0",
      "GPUSLICE_MEMORY_LIMIT=1.5Gi\nGPUSLICE_SM_LIMIT=101\nPATH=/bin",
      "GPUSLICE_MEMORY_LIMIT=5=8G" + std::string(90, '\x01') + "i,CUD1=4GiA_0Y_",
  };
}
}  // namespace gpuslice::fuzz
