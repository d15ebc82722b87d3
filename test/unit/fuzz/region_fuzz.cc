// Fuzz target: the region header validator (what attach runs on any file it
// finds at GPUSLICE_REGION).
#include <cstring>
#include <string>

#include "fuzz_target.h"
#include "shm/region_file.h"

using gpuslice::fuzz::fail;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  gpuslice::shm::Error err;
  std::memset(err.message, 'X', sizeof err.message);
  const bool ok = gpuslice::shm::validate_header(data, size, &err);
  if (std::memchr(err.message, 0, sizeof err.message) == nullptr) fail("message not terminated");
  const std::string message = err.message;
  if (ok) {
    if (!message.empty()) fail("success with a message");
    if (size != sizeof(gpuslice::Region)) fail("accepted a wrong size");
    std::uint64_t magic;
    std::memcpy(&magic, data, sizeof magic);
    if (magic != gpuslice::kRegionMagic) fail("accepted a bad magic");
    std::uint32_t abi;
    std::memcpy(&abi, data + offsetof(gpuslice::RegionHeader, abi_version), sizeof abi);
    if (abi != gpuslice::kRegionAbiVersion) fail("accepted another ABI");
    const char* name = reinterpret_cast<const char*>(data + offsetof(gpuslice::RegionHeader, container_name));
    if (std::memchr(name, 0, 64) == nullptr) fail("accepted an unterminated name");
  } else {
    if (message.rfind("gpuslice: region header: ", 0) != 0) fail("message prefix");
    if (message.find("expected") == std::string::npos) fail("message lacks 'expected'");
    if (message.find('\n') != std::string::npos) fail("multi-line message");
  }
  return 0;
}

namespace gpuslice::fuzz {
std::vector<std::string> seeds() {
  std::string region(sizeof(gpuslice::Region), '\0');
  auto put = [&](std::size_t offset, auto value) { std::memcpy(&region[offset], &value, sizeof value); };
  put(offsetof(RegionHeader, magic), kRegionMagic);
  put(offsetof(RegionHeader, abi_version), kRegionAbiVersion);
  put(offsetof(RegionHeader, header_size), static_cast<std::uint32_t>(sizeof(RegionHeader)));
  put(offsetof(RegionHeader, total_size), static_cast<std::uint64_t>(sizeof(Region)));
  put(offsetof(RegionHeader, max_devices), kMaxDevices);
  put(offsetof(RegionHeader, max_slots), kMaxSlots);
  std::memcpy(&region[offsetof(RegionHeader, container_name)], "seed", 5);
  return {region.substr(0, sizeof(RegionHeader)), region.substr(0, 64), region.substr(0, 8), region, ""};
}
}  // namespace gpuslice::fuzz
