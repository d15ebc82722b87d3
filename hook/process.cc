// This process's state (process.h).
#include "hook/process.h"

namespace gpuslice::hook {

std::atomic<int> g_ready{kReadyNo};
Process g_process{nullptr, {-1}, {}, {0}};

}  // namespace gpuslice::hook
