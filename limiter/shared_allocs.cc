// Shared allocations of a container, counted once (limiter/shared_allocs.h).
#include "limiter/shared_allocs.h"

#include <sched.h>

#include "shm/region_file.h"

namespace gpuslice::limiter {
namespace {

constexpr std::uint64_t kPhaseMask = 0xff;

std::uint64_t pack(std::uint64_t gen, int owner_slot, SharedPhase phase) {
  return gen << 32 | static_cast<std::uint64_t>(owner_slot + 1) << 8 | phase;
}
std::uint64_t gen_of(std::uint64_t state) { return state >> 32; }
SharedPhase phase_of(std::uint64_t state) { return static_cast<SharedPhase>(state & kPhaseMask); }
int owner_of(std::uint64_t state) { return static_cast<int>((state >> 8) & 0xffffff) - 1; }

bool valid(const Region* r, int slot, int e) {
  return r != nullptr && slot >= 0 && static_cast<std::uint32_t>(slot) < kMaxSlots && e >= 0 &&
         static_cast<std::uint32_t>(e) < kMaxShared;
}

// The accounting bracket on a slot's seq (limiter/memory_accounting.cc).
class Bracket {
 public:
  explicit Bracket(Slot& s) : seq_(s.seq) { seq_.fetch_add(1); }
  ~Bracket() { seq_.fetch_add(shm::kSeqGeneration - 1); }
  Bracket(const Bracket&) = delete;
  Bracket& operator=(const Bracket&) = delete;

 private:
  std::atomic<std::uint64_t>& seq_;
};

// `i` may come from the region, which the container writes: never an index
// past the set (kMaxSlots bits).
bool in(const std::uint64_t* set, std::uint32_t i) {
  return set != nullptr && i < kMaxSlots && ((set[i / 64] >> (i % 64)) & 1) != 0;
}

// Whether a live slot (not in `dead`, not being reaped) holds entry e.
bool held(const Region* r, int e, const std::uint64_t* dead) {
  const std::uint64_t bit = std::uint64_t{1} << e;
  for (std::uint32_t i = 0; i < kMaxSlots; ++i) {
    const Slot& s = r->slots[i];
    if ((s.shared_held.load() & bit) == 0 || in(dead, i)) continue;
    const std::uint32_t st = s.state.load();
    if (st == kSlotLive || st == kSlotClaiming) return true;
  }
  return false;
}

void uncount_used(DeviceState& d, std::uint64_t bytes) {
  std::uint64_t used = d.used_bytes.load();
  std::uint64_t sub;
  do {
    sub = used < bytes ? used : bytes;
  } while (!d.used_bytes.compare_exchange_weak(used, used - sub));
  if (sub != bytes) d.accounting_errors.fetch_add(1, std::memory_order_relaxed);
  d.free_generation.fetch_add(1);
}

// Closes entry e from state `from` (ACTIVE, or an abandoned CLAIMING/CLOSING)
// if no live slot holds it. `closer` is the live slot releasing the bytes
// (inside its bracket), or -1: the reaper, whose snapshot then takes them
// out of used_bytes. Returns the bytes released.
std::uint64_t try_close(Region* r, int e, std::uint64_t from, int closer, const std::uint64_t* dead) {
  SharedAlloc& a = r->shared[e];
  const std::uint64_t closing = pack(gen_of(from), closer, kSharedClosing);
  if (from != closing && !a.state.compare_exchange_strong(from, closing)) return 0;
  if (held(r, e, dead)) {
    // A holder joined (or had not left): it closes the entry when it leaves.
    std::uint64_t mine = closing;
    a.state.compare_exchange_strong(mine, pack(gen_of(closing), -1, kSharedActive));
    return 0;
  }
  std::uint64_t bytes = 0;
  if (closer >= 0) {
    Bracket bracket(r->slots[closer]);
    bytes = a.charged_bytes.exchange(0);
    const std::uint32_t dev = a.device.load();
    if (dev < kMaxDevices) uncount_used(r->devices[dev], bytes);
  } else {
    a.charged_bytes.store(0);
  }
  a.key.store(0);
  a.state.store(pack(gen_of(closing) + 1, -1, kSharedFree));
  return bytes;
}

}  // namespace

int shared_publish(Region* r, int slot, int dev, std::uint64_t key, std::uint64_t bytes) noexcept {
  if (!valid(r, slot, 0) || key == 0 || bytes == 0 || static_cast<std::uint32_t>(dev) >= kMaxDevices) return -1;
  for (std::uint32_t e = 0; e < kMaxShared; ++e) {
    const std::uint64_t st = r->shared[e].state.load();
    if (phase_of(st) != kSharedFree && r->shared[e].key.load() == key) return -1;  // taken (a hash collision)
  }
  Slot& s = r->slots[slot];
  for (std::uint32_t i = 0; i < kMaxShared; ++i) {
    SharedAlloc& a = r->shared[i];
    std::uint64_t st = a.state.load();
    if (phase_of(st) != kSharedFree) continue;
    const std::uint64_t claiming = pack(gen_of(st), slot, kSharedClaiming);
    if (!a.state.compare_exchange_strong(st, claiming)) continue;
    a.key.store(key);
    a.device.store(static_cast<std::uint32_t>(dev));
    s.shared_held.fetch_or(std::uint64_t{1} << i);
    bool moved = false;
    {
      Bracket bracket(s);
      // The bytes are the entry's before they leave the slot: the reaper's
      // sum (slots + entries) never falls short of used_bytes.
      std::uint64_t committed = s.committed_bytes[dev].load();
      a.charged_bytes.store(bytes);
      while (committed >= bytes && !s.committed_bytes[dev].compare_exchange_weak(committed, committed - bytes)) {}
      moved = committed >= bytes;
      if (!moved) a.charged_bytes.store(0);
    }
    if (!moved) {
      s.shared_held.fetch_and(~(std::uint64_t{1} << i));
      a.key.store(0);
      a.state.store(pack(gen_of(st) + 1, -1, kSharedFree));
      return -1;
    }
    a.state.store(pack(gen_of(st), -1, kSharedActive));
    return static_cast<int>(i);
  }
  return -1;
}

int shared_join(Region* r, int slot, int dev, std::uint64_t key) noexcept {
  if (!valid(r, slot, 0) || key == 0) return -1;
  Slot& s = r->slots[slot];
  for (std::uint32_t e = 0; e < kMaxShared; ++e) {
    SharedAlloc& a = r->shared[e];
    const std::uint64_t st = a.state.load();
    if (phase_of(st) != kSharedActive || a.key.load() != key || a.device.load() != static_cast<std::uint32_t>(dev))
      continue;
    const std::uint64_t bit = std::uint64_t{1} << e;
    const bool had = (s.shared_held.fetch_or(bit) & bit) != 0;
    // Still the same active entry once our bit is visible? A closer in
    // between either saw the bit (and reopens it) or freed it (we are out).
    for (int spin = 0; spin < 10000; ++spin) {
      const std::uint64_t now = a.state.load();
      if (now == st && a.key.load() == key) return static_cast<int>(e);
      if (phase_of(now) != kSharedClosing || gen_of(now) != gen_of(st)) break;
      sched_yield();
    }
    if (!had) s.shared_held.fetch_and(~bit);
    return -1;
  }
  return -1;
}

std::uint64_t shared_leave(Region* r, int slot, int e) noexcept {
  if (!valid(r, slot, e)) return 0;
  r->slots[slot].shared_held.fetch_and(~(std::uint64_t{1} << e));
  // Another holder closing it at the same time may have seen our bit: wait
  // for it to close or reopen, then look again (bounded: it is a live
  // process between two stores; a dead one is the reaper's).
  for (int spin = 0; spin < 10000; ++spin) {
    const std::uint64_t st = r->shared[e].state.load();
    if (phase_of(st) == kSharedClosing) {
      sched_yield();
      continue;
    }
    if (phase_of(st) != kSharedActive || held(r, e, nullptr)) return 0;
    const std::uint64_t bytes = try_close(r, e, st, slot, nullptr);
    if (bytes != 0 || r->shared[e].state.load() != st) return bytes;
  }
  return 0;
}

void shared_leave_all(Region* r, int slot) noexcept {
  if (!valid(r, slot, 0)) return;
  for (std::uint64_t bits = r->slots[slot].shared_held.load(); bits != 0; bits &= bits - 1)
    shared_leave(r, slot, __builtin_ctzll(bits));
}

void shared_reap(Region* r, const std::uint64_t* dead) noexcept {
  if (r == nullptr) return;
  for (std::uint32_t e = 0; e < kMaxShared; ++e) {
    const std::uint64_t st = r->shared[e].state.load();
    const SharedPhase phase = phase_of(st);
    if (phase == kSharedFree) continue;
    const int owner = owner_of(st);
    // Claimed or being closed by a dead process, or being closed by a reaper
    // (owner -1: reapers exclude each other, so that one died): finish it.
    // Nobody joins a claiming entry, so it closes; a closing one closes or
    // reopens.
    // An owner past the slots (a region the container scribbled on) can never
    // finish it either: abandoned.
    const bool abandoned =
        owner < 0 ? phase == kSharedClosing
                  : static_cast<std::uint32_t>(owner) >= kMaxSlots || in(dead, static_cast<std::uint32_t>(owner));
    if (phase != kSharedActive && !abandoned) continue;
    if (!held(r, static_cast<int>(e), dead))
      try_close(r, static_cast<int>(e), st, -1, dead);
    else if (phase == kSharedClosing) {
      std::uint64_t from = st;
      r->shared[e].state.compare_exchange_strong(from, pack(gen_of(st), -1, kSharedActive));
    }
  }
  for (std::uint32_t i = 0; i < kMaxSlots; ++i) {
    if (in(dead, i)) r->slots[i].shared_held.store(0);
  }
}

std::uint64_t shared_charged(const Region* r, int dev) noexcept {
  std::uint64_t sum = 0;
  for (const SharedAlloc& a : r->shared) {
    if (a.device.load() == static_cast<std::uint32_t>(dev)) sum += a.charged_bytes.load();
  }
  return sum;
}

std::uint64_t shared_held_bytes(const Region* r, int slot, int dev) noexcept {
  if (!valid(r, slot, 0)) return 0;
  std::uint64_t sum = 0;
  for (std::uint64_t bits = r->slots[slot].shared_held.load(); bits != 0; bits &= bits - 1) {
    const SharedAlloc& a = r->shared[__builtin_ctzll(bits)];
    if (a.device.load() == static_cast<std::uint32_t>(dev)) sum += a.charged_bytes.load();
  }
  return sum;
}

}  // namespace gpuslice::limiter
