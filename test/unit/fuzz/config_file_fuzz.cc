// Fuzz target: the configuration file (limiter/options/file.cc), what every
// process of a container reads at its first CUDA call. The input is the
// file's text; the environment is empty.
//
// Invariants: a refusal is one terminated line "gpuslice: ... expected ...";
// an accepted file yields options within their ranges, and exactly the values
// that its NAME=VALUE lines give when set in the environment instead (the
// file's trimming aside, the two sources are one grammar).
#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <string>

#include "checks.h"
#include "fuzz_target.h"
#include "limiter/options/file.h"

using gpuslice::fuzz::fail;
namespace options = gpuslice::options;

namespace {

int file_fd() {
  static const int fd = memfd_create("gpuslice-fuzz.conf", MFD_CLOEXEC);
  if (fd < 0) fail("memfd_create");
  return fd;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size > options::kConfigFileMaxBytes + 16) return 0;
  const int fd = file_fd();
  if (ftruncate(fd, 0) != 0 || (size > 0 && pwrite(fd, data, size, 0) != static_cast<ssize_t>(size)))
    fail("cannot write the file");
  char path[64];
  std::snprintf(path, sizeof path, "/proc/self/fd/%d", fd);

  static options::ConfigFileBuffer buf;
  static options::Options from_file, from_env;
  char* empty_env[] = {nullptr};
  gpuslice::shm::Error err;
  std::memset(err.message, 'X', sizeof err.message);
  const bool ok = options::load_options(empty_env, path, &buf, &from_file, &err);
  if (std::memchr(err.message, 0, sizeof err.message) == nullptr) fail("message not terminated");
  const std::string message = err.message;
  if (!ok) {
    if (message.rfind("gpuslice: ", 0) != 0) fail("message prefix");
    if (message.find("expected") == std::string::npos) fail("message lacks 'expected'");
    if (message.find('\n') != std::string::npos) fail("multi-line message");
    return 0;
  }
  if (!message.empty()) fail("success with a message");
  for (std::uint32_t d = 0; d < gpuslice::kMaxDevices; ++d) {
    if (from_file.memory_limit[d] == 0) fail("zero quota accepted");
    if (from_file.sm_limit[d] < 1 || from_file.sm_limit[d] > 100) fail("sm limit out of range");
  }
  if (from_file.region[0] != '/') fail("relative region accepted");
  // The same entries as an environment: the same values.
  gpuslice::shm::Error env_err{};
  if (!options::parse_options(buf.entries, &from_env, &env_err)) fail("the file's entries fail as an environment");
  const std::string differs = gpuslice::fuzz::differing_option(from_file, from_env);
  if (!differs.empty()) fail(("file and environment disagree on " + differs).c_str());
  static char listing[1 << 16];
  const int len = options::format_effective_options(from_file, listing, sizeof listing);
  if (len < 0 || static_cast<std::size_t>(len) != std::strlen(listing)) fail("listing length");
  return 0;
}

namespace gpuslice::fuzz {
std::vector<std::string> seeds() {
  return {
      "# written by gpuslice-cdi\nGPUSLICE_MEMORY_LIMIT=8Gi\nGPUSLICE_SM_LIMIT=30\nGPUSLICE_REGION=/run/gpuslice/"
      "slice.region\n",
      "GPUSLICE_MEMORY_LIMIT = 0=8Gi,1=4Gi \r\n\n  # comment\nGPUSLICE_SM_POLICY=elastic\nGPUSLICE_PRIORITY=high\n",
      "CUDA_DEVICE_MEMORY_LIMIT=4096m\nCUDA_DEVICE_MEMORY_LIMIT_1=2g\nCUDA_DEVICE_SM_LIMIT=40\n",
      "GPUSLICE_CONTAINER_NAME=c1\nGPUSLICE_LOG_LEVEL=debug\nGPUSLICE_OVERSUBSCRIBE=spill\n",
      "GPUSLICE_CONFIG_FILE=/x\n",
      "GPUSLICE_MEMORY_LIMIT=1Gi\nGPUSLICE_MEMORY_LIMIT=2Gi\n",
      "NOT_AN_OPTION=1\n",
      "GPUSLICE_MEMORY_LIMIT",
      std::string("GPUSLICE_SM_LIMIT=5\0\n", 21),
  };
}
}  // namespace gpuslice::fuzz
