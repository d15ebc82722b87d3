// Which slots of a region a cycle reads.
//
// A region holds 1,024 slots of 896 bytes: their state words lie on all 224
// pages of the slot array, so reading every state through the mapping each
// cycle made every page of every region resident in the agent (0.9 MB a
// region, 925 MB at 1,024 regions) and cost a cache and TLB miss per slot.
// Instead the states are read with one pread of the slot array (it maps
// nothing, and reading a hole of a tmpfs file allocates nothing) only when
// the set of busy slots may have changed, and each cycle reads only the busy
// slots through the mapping: the agent's resident share of a region is its
// header, its device entries and the pages of its busy slots.
//
// The set is re-read when the header's live-slot count differs from its value
// at the last read (a claim or a release changed it), when a listed slot is
// found free, and otherwise every kSlotRereadNs (spread over time), which
// catches what the count cannot show (a claimer killed before it counted
// itself, a count the container rewrote).
#pragma once

#include <cstdint>
#include <vector>

namespace gpuslice::agent {

inline constexpr std::uint64_t kSlotRereadNs = 10'000'000'000;

class SlotIndex {
 public:
  // No read yet, or the periodic one is due.
  bool due(std::uint64_t now_ns) const { return !built_ || now_ns >= next_read_ns_; }
  // What a read of the listed slots found contradicts the index: a listed
  // slot is free now, or the header's live count moved since the last read.
  bool stale(std::uint32_t busy_found, std::uint32_t header_live) const {
    return !built_ || busy_found != busy_.size() || header_live != live_at_read_;
  }
  // Reads the state of every slot from the region file (pread at the slot
  // array's offset into buffer, reused across regions). header_live: the
  // header's live count read just before. false: the file is shorter than a
  // region (truncated under us); the index is left as it was.
  bool reread(int fd, std::uint32_t header_live, std::uint64_t now_ns, std::uint64_t salt,
              std::vector<unsigned char>* buffer);
  // Forget the set (the reaper changed states): re-read before the next use.
  void invalidate() { built_ = false; }
  const std::vector<std::uint16_t>& busy() const { return busy_; }
  std::uint64_t rereads() const { return rereads_; }

 private:
  std::vector<std::uint16_t> busy_;
  std::uint32_t live_at_read_ = 0;
  std::uint64_t next_read_ns_ = 0;
  std::uint64_t rereads_ = 0;
  bool built_ = false;
};

}  // namespace gpuslice::agent
