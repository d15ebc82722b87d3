// Where things are: this executable, libgpuslice.so, the CUDA driver (a real
// one, or the simulated one built next to the bench), and a private scratch
// directory for the run's regions and simulated devices.
#pragma once

#include <string>

namespace gpuslice::bench {

std::string self_exe();
std::string exe_dir();

// --lib, else $GPUSLICE_BENCH_LIB, else <exe dir>/../lib/libgpuslice.so.
// Throws std::runtime_error if the file does not exist.
std::string find_library(const std::string& option);

enum class DriverMode { automatic, real, simulated };

struct DriverChoice {
  std::string ld_library_path;  // for the workers
  std::string description;      // for the report
  std::string notice;           // one line for stderr, or empty
};

// automatic: libcuda.so.1 from the loader's search if there is one, else the
// simulated driver at <exe dir>/../fakecuda (said on stderr). real: a real
// driver or fail. simulated: the simulated driver even if a GPU is present.
DriverChoice choose_driver(DriverMode mode);

// A new private directory: under /dev/shm when usable (regions live there in
// deployments), else $TMPDIR or /tmp. remove_tree() deletes it afterwards.
std::string make_private_dir();
void remove_tree(const std::string& dir);

}  // namespace gpuslice::bench
