// Process-local map: device pointer / handle -> what was counted for it, so
// that a free releases exactly what its allocation reserved, exactly once.
// One PointerTable (include/platform/pointer_table.h) of AllocRecord.
#pragma once

#include <cstdint>

#include "platform/pointer_table.h"

namespace gpuslice::limiter {

enum class AllocKind : std::uint8_t { linear, pitch, managed, async, vmm, array, mipmapped, pool, context, spilled };

struct AllocRecord {
  std::uint64_t bytes;
  std::int32_t dev;  // region device entry
  AllocKind kind;
};

using AllocTable = platform::PointerTable<AllocRecord>;

// What was charged for a driver object that is not an allocation (a
// context, a module, a library's placement, a context's resource limit):
// bytes on a region device entry. One type for every table of them.
struct Counted {
  int entry;
  std::uint64_t bytes;
};

}  // namespace gpuslice::limiter
