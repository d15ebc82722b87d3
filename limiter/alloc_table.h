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

using AllocTable = PointerTable<AllocRecord>;

}  // namespace gpuslice::limiter
