#include "kernels.h"

namespace gpuslice::bench {

std::string spin_kernel_name(unsigned micros) { return "spin_" + std::to_string(micros) + "us"; }

std::string kernels_ptx(const std::vector<unsigned>& spin_micros) {
  // PTX ISA 7.0 / sm_50: every driver since CUDA 11.0 JIT-compiles it for its
  // GPU. %globaltimer is a nanosecond clock common to all SMs, so the kernel
  // runs for a wall-clock duration whatever the clock speed.
  std::string ptx =
      ".version 7.0\n"
      ".target sm_50\n"
      ".address_size 64\n"
      "\n"
      ".visible .entry empty()\n"
      "{\n"
      "  ret;\n"
      "}\n";
  for (unsigned micros : spin_micros) {
    ptx += "\n.visible .entry " + spin_kernel_name(micros) +
           "(.param .u64 duration_ns)\n"
           "{\n"
           "  .reg .pred %p<2>;\n"
           "  .reg .b64 %rd<5>;\n"
           "  ld.param.u64 %rd1, [duration_ns];\n"
           "  mov.u64 %rd2, %globaltimer;\n"
           "  add.u64 %rd3, %rd2, %rd1;\n"
           "$Lspin_" +
           std::to_string(micros) +
           ":\n"
           "  mov.u64 %rd4, %globaltimer;\n"
           "  setp.lt.u64 %p1, %rd4, %rd3;\n"
           "  @%p1 bra $Lspin_" +
           std::to_string(micros) +
           ";\n"
           "  ret;\n"
           "}\n";
  }
  return ptx;
}

}  // namespace gpuslice::bench
