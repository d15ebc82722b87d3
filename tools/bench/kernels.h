// The bench's kernels, as a PTX text image loaded with cuModuleLoadData: no
// nvcc at build time, JIT-compiled by any NVIDIA driver at run time. The
// simulated driver treats the image as text and gives a kernel named
// spin_<N>us N microseconds of device time; on a real GPU the same kernel
// spins on %globaltimer for the duration passed as its parameter. So every
// spin kernel is named after the duration it is launched with.
#pragma once

#include <string>
#include <vector>

namespace gpuslice::bench {

inline constexpr const char* kEmptyKernel = "empty";

// "spin_1000us"
std::string spin_kernel_name(unsigned micros);

// PTX with `empty` and one spin_<N>us entry per duration.
std::string kernels_ptx(const std::vector<unsigned>& spin_micros);

}  // namespace gpuslice::bench
