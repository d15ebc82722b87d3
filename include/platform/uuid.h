// GPU UUIDs in NVML's text form ("GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"),
// which the region stores as 16 bytes (CUuuid). One heap-free conversion for
// the preload library, the limiter's NVML sampler and the node agent.
#pragma once

#include <cstddef>
#include <cstdint>

namespace gpuslice::platform {

inline constexpr std::size_t kUuidTextSize = 41;  // "GPU-" + 36 characters + NUL

// Writes the NVML text form of `uuid` into out[kUuidTextSize].
void format_uuid(const std::uint8_t uuid[16], char out[kUuidTextSize]) noexcept;
// Accepts an optional "GPU-" prefix, dashes anywhere and hex digits of either
// case; exactly 32 digits. False (out unspecified) otherwise.
bool parse_uuid(const char* text, std::uint8_t out[16]) noexcept;

}  // namespace gpuslice::platform
