// The allocation table before issue 14 (commit 04aeaed), kept only so that
// table_bench compares it with platform::PointerTable in one run.
//
// Process-local map: device pointer / handle -> what was counted for it, so
// that a free releases exactly what its allocation reserved, exactly once.
//
// Open addressing with linear probing over mmap'd memory (never malloc: the
// table may grow inside an allocation wrapper of a process whose malloc is
// itself being interposed). A key keeps its entry until the next resize, so
// probing never races with removal; each entry carries a versioned state word
// so that erase is exactly-once and find never returns a torn record.
// insert/erase/find are lock-free; growth is stop-the-world: operations enter
// a gate (one atomic add), and a resize waits for those in flight to leave,
// rehashes the live entries into a fresh mapping and reopens the gate.
// Keys 0 and ~0 are reserved (insert refuses them).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace gpuslice::legacy {

enum class AllocKind : std::uint8_t { linear, pitch, managed, async, vmm, array, mipmapped, pool, context, spilled };

struct AllocRecord {
  std::uint64_t bytes;
  std::int32_t dev;  // must fit in 16 bits (device indices are < kMaxDevices)
  AllocKind kind;
};

class AllocTable {
 public:
  constexpr AllocTable() noexcept = default;
  ~AllocTable();
  AllocTable(const AllocTable&) = delete;
  AllocTable& operator=(const AllocTable&) = delete;

  // false if the key is present (double insert), reserved, dev out of range,
  // or no memory for growth.
  bool insert(std::uint64_t key, AllocRecord rec) noexcept;
  // Exactly-once: of two racing erases of one key, one returns true.
  bool erase(std::uint64_t key, AllocRecord* out) noexcept;
  bool find(std::uint64_t key, AllocRecord* out) const noexcept;
  std::size_t size() const noexcept;  // live entries (exact when quiescent)

  // Calls f(key, const AllocRecord&) for each live entry. f must not call this
  // table (a concurrent resize would wait for it forever).
  template <class F>
  void for_each(F&& f) const {
    enter();
    const Table* t = table_.load(std::memory_order_acquire);
    if (t != nullptr) {
      for (std::size_t i = 0; i < t->capacity; ++i) {
        std::uint64_t key;
        AllocRecord rec;
        if (read_live(t->entries[i], &key, &rec)) f(key, static_cast<const AllocRecord&>(rec));
      }
    }
    leave();
  }
  // Erases every live entry exactly once (racing erases included) and calls
  // f(key, const AllocRecord&) for each entry this call erased: at-exit release.
  template <class F>
  void drain(F&& f) {
    enter();
    Table* t = table_.load(std::memory_order_acquire);
    if (t != nullptr) {
      for (std::size_t i = 0; i < t->capacity; ++i) {
        std::uint64_t key;
        AllocRecord rec;
        if (take_live(t->entries[i], &key, &rec)) f(key, static_cast<const AllocRecord&>(rec));
      }
    }
    leave();
  }

 private:
  struct Entry {
    std::atomic<std::uint64_t> key;    // 0 = never used; else owned by that key until resize
    std::atomic<std::uint64_t> state;  // version:32 | dev:16 | kind:8 | phase:8
    std::atomic<std::uint64_t> bytes;
  };
  struct Table {
    std::size_t capacity;  // power of two
    std::size_t map_bytes;
    std::atomic<std::size_t> used_keys;
    Entry* entries;  // capacity entries, in the same mapping
  };

  static bool read_live(const Entry& e, std::uint64_t* key, AllocRecord* out) noexcept;
  static bool take_live(Entry& e, std::uint64_t* key, AllocRecord* out) noexcept;
  void enter() const noexcept;
  void leave() const noexcept;
  bool grow(const Table* seen) noexcept;
  static Table* map_table(std::size_t capacity) noexcept;
  static void unmap_table(Table* t) noexcept;

  std::atomic<Table*> table_{nullptr};
  // Operations in flight (low bits) and the resize flag (top bit).
  mutable std::atomic<std::uint64_t> gate_{0};
};

}  // namespace gpuslice::legacy
