// Scanning the environment for gpuslice's options and their aliases (part of
// the option parser, limiter/options.cc): which variable set what, without
// parsing values yet.
#pragma once

#include <cstddef>

#include "gpuslice/options.h"
#include "limiter/options.h"

namespace gpuslice::limiter::env {

struct Found {
  const char* ours[kOptionCount];
  const char* alias[kOptionAliasCount];  // the global (or only) form
  const char* alias_device[kOptionAliasCount][kMaxDevices];
  const char* alias_device_name[kOptionAliasCount][kMaxDevices];
};

// Records every option and alias assignment of envp (the first of duplicates
// wins, as with getenv) and the first unknown GPUSLICE_* name. False (err set)
// for a per-device alias with a malformed index.
bool collect(char* const* envp, Found* f, Options* out, shm::Error* err);
// "CUDA_DEVICE_MEMORY_LIMIT_3" from the entry "CUDA_DEVICE_MEMORY_LIMIT_3=..."
void name_of(const char* entry, char* buf, std::size_t cap);

}  // namespace gpuslice::limiter::env
