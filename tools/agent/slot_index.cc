#include "slot_index.h"

#include <unistd.h>

#include <cstddef>
#include <cstring>

#include "gpuslice/region.h"

namespace gpuslice::agent {

bool SlotIndex::reread(int fd, std::uint32_t header_live, std::uint64_t now_ns, std::uint64_t salt,
                       std::vector<unsigned char>* buffer) {
  constexpr std::size_t kBytes = sizeof(Slot) * kMaxSlots;
  buffer->resize(kBytes);
  std::size_t got = 0;
  while (got < kBytes) {
    const ssize_t n = pread(fd, buffer->data() + got, kBytes - got, static_cast<off_t>(offsetof(Region, slots) + got));
    if (n <= 0) return false;
    got += static_cast<std::size_t>(n);
  }
  busy_.clear();
  for (std::uint32_t i = 0; i < kMaxSlots; ++i) {
    // The state word is a slot's first field; its values (0-3) live in the
    // low byte, so a copy racing with a claim cannot tear it into a wrong one.
    std::uint32_t state = 0;
    std::memcpy(&state, buffer->data() + std::size_t{i} * sizeof(Slot), sizeof state);
    if (state != kSlotFree) busy_.push_back(static_cast<std::uint16_t>(i));
  }
  live_at_read_ = header_live;
  // The next periodic read between 1/2 and 3/2 of the period away, so that
  // regions found in one cycle are not all re-read in the same later one.
  const std::uint64_t spread = ((salt + rereads_) * 0x9E3779B97F4A7C15ull) >> 44;  // 0 .. 2^20-1
  next_read_ns_ = now_ns + kSlotRereadNs / 2 + (kSlotRereadNs >> 20) * spread;
  built_ = true;
  ++rereads_;
  return true;
}

}  // namespace gpuslice::agent
