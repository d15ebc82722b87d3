#include "legacy_alloc_table.h"

#include <sched.h>
#include <sys/mman.h>

#include <new>

#include "platform/pointer_table.h"

namespace gpuslice::legacy {
namespace {

constexpr std::uint64_t kResizing = std::uint64_t{1} << 63;
constexpr std::size_t kMinCapacity = 1024;

constexpr std::uint64_t kFree = 0;       // never inserted, or erased
constexpr std::uint64_t kInserting = 1;  // record being written
constexpr std::uint64_t kLive = 2;

std::uint64_t phase(std::uint64_t s) { return s & 0xff; }
std::uint64_t version(std::uint64_t s) { return s >> 32; }
std::uint64_t make_state(std::uint64_t version, std::int32_t dev, AllocKind kind, std::uint64_t phase) {
  return (version << 32) | (std::uint64_t{static_cast<std::uint16_t>(dev)} << 16) |
         (std::uint64_t{static_cast<std::uint8_t>(kind)} << 8) | phase;
}
AllocRecord record_of(std::uint64_t s, std::uint64_t bytes) {
  return {bytes, static_cast<std::int16_t>((s >> 16) & 0xffff), static_cast<AllocKind>((s >> 8) & 0xff)};
}

// Device pointers are aligned to 256 B..2 MiB: every bit mixed into the
// index, by the same function the pointer table uses.
std::uint64_t hash(std::uint64_t key) { return platform::table_detail::mix(key); }

}  // namespace

AllocTable::~AllocTable() { unmap_table(table_.load(std::memory_order_acquire)); }

AllocTable::Table* AllocTable::map_table(std::size_t capacity) noexcept {
  const std::size_t header = (sizeof(Table) + 63) & ~std::size_t{63};
  const std::size_t bytes = header + capacity * sizeof(Entry);
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return nullptr;
  // Fresh anonymous pages are zero: every entry is a valid empty entry.
  Table* t = new (p) Table{capacity, bytes, {0}, reinterpret_cast<Entry*>(static_cast<char*>(p) + header)};
  return t;
}

void AllocTable::unmap_table(Table* t) noexcept {
  if (t != nullptr) munmap(t, t->map_bytes);
}

void AllocTable::enter() const noexcept {
  for (;;) {
    const std::uint64_t g = gate_.fetch_add(1, std::memory_order_acquire);
    if ((g & kResizing) == 0) return;
    gate_.fetch_sub(1, std::memory_order_relaxed);
    while (gate_.load(std::memory_order_acquire) & kResizing) sched_yield();
  }
}

void AllocTable::leave() const noexcept { gate_.fetch_sub(1, std::memory_order_release); }

bool AllocTable::grow(const Table* seen) noexcept {
  std::uint64_t g = gate_.load(std::memory_order_relaxed);
  for (;;) {
    if (g & kResizing) {  // somebody else resizes: wait, then let the caller retry
      while (gate_.load(std::memory_order_acquire) & kResizing) sched_yield();
      return true;
    }
    if (gate_.compare_exchange_weak(g, g | kResizing, std::memory_order_acq_rel)) break;
  }
  while ((gate_.load(std::memory_order_acquire) & ~kResizing) != 0) sched_yield();

  bool ok = true;
  Table* old = table_.load(std::memory_order_relaxed);
  if (old == seen) {
    std::size_t live = 0;
    if (old != nullptr) {
      for (std::size_t i = 0; i < old->capacity; ++i) {
        if (phase(old->entries[i].state.load(std::memory_order_relaxed)) == kLive) ++live;
      }
    }
    std::size_t capacity = kMinCapacity;
    while (capacity / 2 < live + 1) capacity *= 2;  // at most half full after the resize
    Table* fresh = map_table(capacity);
    if (fresh == nullptr) {
      ok = false;
    } else {
      if (old != nullptr) {
        const std::size_t mask = capacity - 1;
        for (std::size_t i = 0; i < old->capacity; ++i) {
          const Entry& from = old->entries[i];
          const std::uint64_t s = from.state.load(std::memory_order_relaxed);
          if (phase(s) != kLive) continue;
          const std::uint64_t key = from.key.load(std::memory_order_relaxed);
          std::size_t j = hash(key) & mask;
          while (fresh->entries[j].key.load(std::memory_order_relaxed) != 0) j = (j + 1) & mask;
          Entry& to = fresh->entries[j];
          to.key.store(key, std::memory_order_relaxed);
          to.bytes.store(from.bytes.load(std::memory_order_relaxed), std::memory_order_relaxed);
          to.state.store(s, std::memory_order_relaxed);
        }
      }
      fresh->used_keys.store(live, std::memory_order_relaxed);
      table_.store(fresh, std::memory_order_release);
      unmap_table(old);
    }
  }
  gate_.fetch_and(~kResizing, std::memory_order_release);
  return ok;
}

bool AllocTable::insert(std::uint64_t key, AllocRecord rec) noexcept {
  if (key == 0 || key == ~std::uint64_t{0} || rec.dev < INT16_MIN || rec.dev > INT16_MAX) return false;
  for (;;) {
    enter();
    Table* t = table_.load(std::memory_order_acquire);
    if (t != nullptr) {
      const std::size_t mask = t->capacity - 1;
      std::size_t i = hash(key) & mask;
      for (std::size_t probe = 0; probe < t->capacity; ++probe, i = (i + 1) & mask) {
        Entry& e = t->entries[i];
        std::uint64_t k = e.key.load(std::memory_order_acquire);
        if (k == 0) {
          // A new key: only while the table is at most 3/4 full, so probes stay short.
          if (t->used_keys.load(std::memory_order_relaxed) + 1 > t->capacity / 4 * 3) break;
          if (e.key.compare_exchange_strong(k, key, std::memory_order_acq_rel)) {
            t->used_keys.fetch_add(1, std::memory_order_relaxed);
            k = key;
          }
        }
        if (k != key) continue;
        std::uint64_t s = e.state.load(std::memory_order_acquire);
        for (;;) {
          if (phase(s) != kFree) {  // present, or being inserted by another thread
            leave();
            return false;
          }
          const std::uint64_t v = version(s);
          if (e.state.compare_exchange_weak(s, make_state(v + 1, rec.dev, rec.kind, kInserting),
                                            std::memory_order_acq_rel)) {
            e.bytes.store(rec.bytes, std::memory_order_release);
            e.state.store(make_state(v + 2, rec.dev, rec.kind, kLive), std::memory_order_release);
            leave();
            return true;
          }
        }
      }
    }
    leave();
    if (!grow(t)) return false;
  }
}

bool AllocTable::take_live(Entry& e, std::uint64_t* key, AllocRecord* out) noexcept {
  std::uint64_t s = e.state.load(std::memory_order_acquire);
  for (;;) {
    if (phase(s) != kLive) return false;
    const std::uint64_t bytes = e.bytes.load(std::memory_order_acquire);
    // The version makes this exactly-once and the record untorn: any erase
    // or re-insert since `s` was read changed the word.
    if (e.state.compare_exchange_weak(s, make_state(version(s) + 1, 0, AllocKind{}, kFree),
                                      std::memory_order_acq_rel)) {
      if (key != nullptr) *key = e.key.load(std::memory_order_relaxed);
      if (out != nullptr) *out = record_of(s, bytes);
      return true;
    }
  }
}

bool AllocTable::read_live(const Entry& e, std::uint64_t* key, AllocRecord* out) noexcept {
  for (;;) {
    const std::uint64_t s = e.state.load(std::memory_order_acquire);
    if (phase(s) != kLive) return false;
    const std::uint64_t bytes = e.bytes.load(std::memory_order_acquire);
    if (e.state.load(std::memory_order_relaxed) != s) continue;  // changed under us: read again
    if (key != nullptr) *key = e.key.load(std::memory_order_relaxed);
    if (out != nullptr) *out = record_of(s, bytes);
    return true;
  }
}

bool AllocTable::erase(std::uint64_t key, AllocRecord* out) noexcept {
  if (key == 0 || key == ~std::uint64_t{0}) return false;
  enter();
  bool found = false;
  Table* t = table_.load(std::memory_order_acquire);
  if (t != nullptr) {
    const std::size_t mask = t->capacity - 1;
    std::size_t i = hash(key) & mask;
    for (std::size_t probe = 0; probe < t->capacity; ++probe, i = (i + 1) & mask) {
      Entry& e = t->entries[i];
      const std::uint64_t k = e.key.load(std::memory_order_acquire);
      if (k == 0) break;
      if (k != key) continue;
      found = take_live(e, nullptr, out);
      break;
    }
  }
  leave();
  return found;
}

bool AllocTable::find(std::uint64_t key, AllocRecord* out) const noexcept {
  if (key == 0 || key == ~std::uint64_t{0}) return false;
  enter();
  bool found = false;
  const Table* t = table_.load(std::memory_order_acquire);
  if (t != nullptr) {
    const std::size_t mask = t->capacity - 1;
    std::size_t i = hash(key) & mask;
    for (std::size_t probe = 0; probe < t->capacity; ++probe, i = (i + 1) & mask) {
      const Entry& e = t->entries[i];
      const std::uint64_t k = e.key.load(std::memory_order_acquire);
      if (k == 0) break;
      if (k != key) continue;
      found = read_live(e, nullptr, out);
      break;
    }
  }
  leave();
  return found;
}

std::size_t AllocTable::size() const noexcept {
  std::size_t n = 0;
  for_each([&n](std::uint64_t, const AllocRecord&) { ++n; });
  return n;
}

}  // namespace gpuslice::legacy
