// libFuzzer's entry point, implemented by each target; fuzz_main.cc drives it
// over a deterministic corpus when libFuzzer is not available (gcc, CTest).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size);

namespace gpuslice::fuzz {
// Seeds the deterministic driver mutates (also written out as a libFuzzer corpus).
std::vector<std::string> seeds();
// Aborts with a message: a fuzz invariant failed.
[[noreturn]] void fail(const char* what);
}  // namespace gpuslice::fuzz
