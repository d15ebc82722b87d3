// Process-private map from a 64-bit key (device pointer, handle) to a small
// trivially-copyable record: the one table design of hook/ (allocations,
// arrays, VMM handles and mappings, contexts, modules, pools).
//
// Sharded: 64 shards chosen by the key's hash, each an open-addressing array
// with linear probing in Robin Hood order and backward-shift deletion (an
// erase moves back the records after it that are away from their homes, so
// there are no tombstones: erased slots are reused at
// once and churn of distinct addresses never forces a rehash). A slot holds
// its key's hash in place of the key (the hash is a bijection: table_unhash
// gives the key back), so neither a walk nor a growth hashes again (issue
// 35: a pair's cost flat in the number of records). Each shard has
// a one-word spin lock (one lock bts to take, a release store to drop;
// spins, then sleeps on the word, woken by the unlock: a preempted holder
// gets the core) and grows, under that lock, into a fresh mmap'd
// array (never malloc: the table may grow inside an allocation wrapper of a
// process whose malloc is itself interposed). Memory is bounded by the peak
// live count: at most half full after growth (short clusters: a lookup's
// walk stays short at any size, issue 35), never shrunk.
//
// fork: CUDA does not survive fork(), and the records describe the parent's
// allocations, which a child does not own. A child however made (fork with
// its handlers, _Fork, raw clone) sees a new process epoch (a word in a
// MADV_WIPEONFORK page) and drops the inherited contents at its first
// operation, lock words included, so a child forked while another thread of
// the parent held a shard lock does not deadlock.
//
// Constant-initialised (declare globals constinit): usable from any library
// constructor, before or after this library's own static initialisation.
// Keys 0 and ~0 are reserved: insert refuses them, erase/find miss them.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace gpuslice::platform {

namespace table_detail {

void* map_pages(std::size_t bytes) noexcept;  // zeroed anonymous memory, or nullptr
void unmap_pages(void* p, std::size_t bytes) noexcept;
// Lock words: 0 free, 1 held, kLockWaiters held with (perhaps) sleepers:
// bit 0 is "held" in both, so that taking it is one bit test-and-set.
inline constexpr std::uint32_t kLockWaiters = 3;
[[gnu::cold, gnu::noinline]] void lock_slow(std::atomic<std::uint32_t>& word) noexcept;  // spins, then futex sleeps
[[gnu::cold, gnu::noinline]] void wake_one(std::atomic<std::uint32_t>& word) noexcept;
void backoff(unsigned* round) noexcept;  // a pause while round < 64, then sched_yield

// Growth that failed (issue 35). A shard past its load limit whose growth
// mmap failed (the address space is exhausted: RLIMIT_AS) is stuck until a
// growth succeeds or, erasures having brought it back under the limit, a
// retry finds it there; it keeps half its capacity for what was admitted
// already. While any shard of any table is stuck, new allocations are
// refused before the driver makes them (hook/account.cc): a record is what
// lets a free release its bytes, so none is admitted that could not be
// recorded. regrow_stuck retries the growth of every stuck shard and
// unsticks those back under their limit (cold): true when none is left stuck.
[[gnu::visibility("hidden")]] extern std::atomic<std::uint32_t> g_stuck_shards;  // read PC-relative
using RegrowFn = bool (*)(void* table) noexcept;
// Run (cold, under the stuck shard's lock: it must not use a table) each
// time a shard becomes stuck, after g_stuck_shards counted it (seq_cst): a
// fast path that vouched for "no stuck shard" once takes that back
// (hook/memory.cc). One function per process; set before it is relied on.
using StuckFn = void (*)() noexcept;
void set_on_stuck(StuckFn fn) noexcept;
void note_stuck(void* table, RegrowFn regrow) noexcept;  // remembered for regrow_stuck (32 tables at most)
[[gnu::cold, gnu::noinline]] bool regrow_stuck() noexcept;

// The process epoch: never 0; different in every forked child than in its parent.
// g_epoch_word is never null: until the first epoch_slow() it points to a
// word that stays 0, so the fast path is two loads and one test.
[[gnu::visibility("hidden")]] extern std::atomic<std::atomic<std::uint64_t>*> g_epoch_word;
[[gnu::cold, gnu::noinline]] std::uint64_t epoch_slow() noexcept;
inline std::uint64_t process_epoch() noexcept {
  const std::uint64_t e = g_epoch_word.load(std::memory_order_acquire)->load(std::memory_order_relaxed);
  if (__builtin_expect(e != 0, 1)) return e;
  return epoch_slow();
}

// Device pointers are aligned to 256 B..2 MiB: mix every bit into the hash.
inline std::uint64_t mix(std::uint64_t key) noexcept {
  key ^= key >> 30;
  key *= 0xbf58476d1ce4e5b9ull;
  key ^= key >> 27;
  key *= 0x94d049bb133111ebull;
  key ^= key >> 31;
  return key;
}

// The table's hash, on every operation (mix() above is the general-purpose
// one): two multiplies with a fold between (five instructions where mix()
// takes twelve), whose top bits depend on every bit of the key. The shard is
// the top kShardBits, the home slot within the shard the next log2(capacity)
// bits (PointerTable::home). Taking the home from the low bits of one
// multiply folded with bits 32 up instead (issue 35) left long clusters for
// aligned pointers handed out in sequence (a pair beside 100,000 live
// records paid ~230 instructions more than beside 99,000), and one multiply
// alone clusters power-of-two strides: this spreads every stride from 1 B to
// 2 MiB like a random hash (tests: AlignedPointersInSequenceKeepClustersShort).
inline std::uint64_t table_hash(std::uint64_t key) noexcept {
  key *= 0x9e3779b97f4a7c15ull;
  key ^= key >> 32;
  return key * 0xbf58476d1ce4e5b9ull;
}
// table_hash, tested for 0 after it (GCC otherwise tests the fold's two
// halves for equality, which keeps both in registers: one move more).
inline std::uint64_t table_hash_opaque(std::uint64_t key) noexcept {
  std::uint64_t h = table_hash(key);
  asm("" : "+r"(h));
  return h;
}
// table_hash is a bijection (odd multipliers, a fold of the high half into
// the low): the table stores the hash in place of the key, and gives the
// key back (cold paths: walks, copies) with the inverse. 0 hashes to 0.
inline std::uint64_t table_unhash(std::uint64_t h) noexcept {
  h *= 0x96de1b173f119089ull;  // the inverse of 0xbf58476d1ce4e5b9 mod 2^64
  h ^= h >> 32;
  return h * 0xf1de83e19937733dull;  // the inverse of 0x9e3779b97f4a7c15
}

}  // namespace table_detail

template <class V>
class PointerTable {
  static_assert(std::is_trivially_copyable_v<V>, "records are copied with their bytes");
  static_assert(sizeof(std::atomic<std::uint32_t>) == sizeof(std::uint32_t), "the lock word is a futex word");

 public:
  static constexpr unsigned kShardBits = 6;
  static constexpr unsigned kShards = 1u << kShardBits;

  constexpr PointerTable() noexcept = default;
  ~PointerTable() {
    for (Shard& s : shards_) free_slots(s);
    drop_first_pages();
  }
  PointerTable(const PointerTable&) = delete;
  PointerTable& operator=(const PointerTable&) = delete;

  // false if the key is present, reserved, or no memory is left for growth.
  // Inline, the common case: room without growth, one walk from the home
  // to the key, an empty slot or the first record nearer its own home (whose
  // run then moves one slot on, open()); else insert_slow (growth, full).
  bool insert(std::uint64_t key, const V& value) noexcept {
    enter();
    if (key == ~std::uint64_t{0}) return false;
    return insert_entered(key, value);
  }
  // insert() and erase() for a caller that knows this process entered the
  // table already (entered(), below, returned true in this process: a flag
  // kept in a page a forked child finds zeroed, hook/lifecycle.h): no
  // epoch check (issue 35: the allocation pair's fast path).
  // (Of the reserved keys only 0 is tested, by its hash, as in erase_entered:
  // ~0, which insert() refuses, is no device pointer, and its record would
  // be a record like any other.)
  bool insert_entered(std::uint64_t key, const V& value) noexcept {
    const std::uint64_t h = table_detail::table_hash_opaque(key);
    if (__builtin_expect(h == 0, 0)) return false;
    Shard& s = shard_of(h);
    // Every call below ends the operation (its result returned as it is):
    // nothing of the table is kept across a call, so a caller's frame saves
    // no register for it (issue 35).
    if (__builtin_expect(!try_take(s.lock), 0)) return insert_contended(s, h, value);
    return insert_held(s, h, value);
  }
  // Records `value` under `key`, displacing the record the key held, if any
  // (copied to *displaced). One probe of the key's cluster.
  enum class Put { inserted, replaced, full };
  Put put(std::uint64_t key, const V& value, V* displaced) noexcept {
    if (reserved(key)) return Put::full;
    const std::uint64_t h = table_detail::table_hash(key);
    Shard& s = locked_shard(h);
    const std::size_t i = probe(s, h);
    Put result = Put::full;
    if (i != kMissing && s.slots[i].hash == h) {
      if (displaced != nullptr) *displaced = s.slots[i].value;
      s.slots[i].value = value;
      result = Put::replaced;
    } else if (i != kMissing) {
      fill(s, i, h, value);
      result = Put::inserted;
    }
    unlock(s);
    return result;
  }

  // Exactly-once: of two racing erases of one key, one returns true (and the record).
  // (One walk to the key or the first empty slot, the record copied and
  // removed where it is found.)
  bool erase(std::uint64_t key, V* out) noexcept {
    enter();
    return erase_entered(key, out);
  }
  bool erase_entered(std::uint64_t key, V* out) noexcept {
    // Of the reserved keys only 0 needs a test (its hash, 0, would match an
    // empty slot); ~0 is never inserted, so a walk for it finds nothing.
    const std::uint64_t h = table_detail::table_hash_opaque(key);
    if (__builtin_expect(h == 0, 0)) return false;
    Shard& s = shard_of(h);
    if (__builtin_expect(!try_take(s.lock), 0)) return erase_contended(s, h, out);  // (as insert_entered)
    return erase_held(s, h, out);
  }

  bool find(std::uint64_t key, V* out) const noexcept {
    if (reserved(key)) return false;
    const std::uint64_t h = table_detail::table_hash(key);
    Shard& s = locked_shard(h);
    const std::size_t i = lookup(s, h);
    if (i != kMissing && out != nullptr) *out = s.slots[i].value;
    unlock(s);
    return i != kMissing;
  }

  // Calls f(V&) on the record of `key` under its shard's lock; f returns true
  // to erase the record. False if the key is absent.
  template <class F>
  bool update(std::uint64_t key, F&& f) noexcept {
    if (reserved(key)) return false;
    const std::uint64_t h = table_detail::table_hash(key);
    Shard& s = locked_shard(h);
    const std::size_t i = lookup(s, h);
    if (i != kMissing && f(s.slots[i].value)) remove(s, i);
    unlock(s);
    return i != kMissing;
  }

  // Inserts `init` if `key` is absent, then calls f(V&, bool inserted) on the
  // record under its shard's lock. False (f not called) if the key is
  // reserved or no memory is left for growth.
  template <class F>
  bool upsert(std::uint64_t key, const V& init, F&& f) noexcept {
    if (reserved(key)) return false;
    const std::uint64_t h = table_detail::table_hash(key);
    Shard& s = locked_shard(h);
    const std::size_t i = probe(s, h);
    if (i != kMissing) {
      const bool inserted = s.slots[i].hash == 0;
      if (inserted) fill(s, i, h, init);
      f(s.slots[i].value, inserted);
    }
    unlock(s);
    return i != kMissing;
  }

  // This process's first use of the table done (its contents dropped if a
  // parent's): from now on, in this process, the *_entered operations may
  // be used. Cold.
  void enter_process() const noexcept { enter(); }

  // Live entries (exact when no other thread changes the table).
  std::size_t size() const noexcept {
    enter();
    std::size_t n = 0;
    for (Shard& s : shards_) {
      lock(s);
      n += count(s);
      unlock(s);
    }
    return n;
  }
  // Bytes of slot arrays mapped now (bounded by the peak live count).
  std::size_t mapped_bytes() const noexcept { return sum(&Shard::map_bytes); }

  // How far entries sit from their home slots (cold: walks every shard under
  // its lock). The mean bounds what a lookup costs on average; a long
  // cluster shows as a large longest.
  struct Probes {
    std::size_t entries = 0, total = 0, longest = 0;  // displacement in slots
  };
  Probes probes() const noexcept {
    enter();
    Probes p;
    for (Shard& s : shards_) {
      lock(s);
      for (std::size_t i = 0; has_slots(s) && i <= s.mask; ++i) {
        if (s.slots[i].hash == 0) continue;
        const std::size_t d = (i - home(s, s.slots[i].hash)) & s.mask;
        ++p.entries;
        p.total += d;
        if (d > p.longest) p.longest = d;
      }
      unlock(s);
    }
    return p;
  }

  // Calls f(key, const V&) for each entry, one shard at a time under its
  // lock: f must be short and must not call this table or the driver (a
  // driver that calls back into a hooked entry point would then wait on
  // the lock). Use for_each_unlocked for anything longer.
  template <class F>
  void for_each(F&& f) const {
    enter();
    for (Shard& s : shards_) {
      lock(s);
      for (std::size_t i = 0; has_slots(s) && i <= s.mask; ++i) {
        if (s.slots[i].hash != 0)
          f(table_detail::table_unhash(s.slots[i].hash), static_cast<const V&>(s.slots[i].value));
      }
      unlock(s);
    }
  }

  // Calls f(key, const V&) on copies of the entries, taken shard by shard
  // (every entry present for the whole walk is seen exactly once); f runs
  // with no lock held and may call the table and the driver. Copies go
  // through a stack buffer, or an mmap'd one for a large shard; an entry
  // of a shard whose copy cannot be mapped is skipped (returns false then).
  template <class F>
  bool for_each_unlocked(F&& f) {
    enter();
    constexpr std::size_t kStack = sizeof(Slot) > 512 ? 4 : 2048 / sizeof(Slot);  // at most ~2 KiB of stack
    Slot stack[kStack];
    bool complete = true;
    for (Shard& s : shards_) {
      Slot* copy = stack;
      std::size_t map_bytes = 0, n = 0;
      lock(s);
      if (count(s) > kStack) {
        map_bytes = count(s) * sizeof(Slot);
        copy = static_cast<Slot*>(table_detail::map_pages(map_bytes));
      }
      if (copy == nullptr) {
        complete = false;
      } else {
        for (std::size_t i = 0; has_slots(s) && i <= s.mask; ++i) {
          if (s.slots[i].hash != 0) copy[n++] = s.slots[i];
        }
      }
      unlock(s);
      for (std::size_t i = 0; i < n; ++i)
        f(table_detail::table_unhash(copy[i].hash), static_cast<const V&>(copy[i].value));
      if (map_bytes != 0 && copy != nullptr) table_detail::unmap_pages(copy, map_bytes);
    }
    return complete;
  }

  // Erases every entry exactly once (racing erases included) and calls
  // f(key, const V&) for each one this call erased, with no lock held:
  // each shard's array is detached under its lock and walked afterwards.
  template <class F>
  void drain(F&& f) {
    enter();
    for (Shard& s : shards_) {
      lock(s);
      Slot* slots = has_slots(s) ? s.slots : nullptr;
      const std::size_t mask = s.mask, map_bytes = s.map_bytes;
      forget_slots(s);
      unstick(s);
      unlock(s);
      if (slots == nullptr) continue;
      for (std::size_t i = 0; i <= mask; ++i) {
        if (slots[i].hash != 0) f(table_detail::table_unhash(slots[i].hash), static_cast<const V&>(slots[i].value));
      }
      table_detail::unmap_pages(slots, map_bytes);
    }
  }

 private:
  struct Slot {
    std::uint64_t hash;  // table_hash(key); 0 = empty (fresh anonymous pages are all-empty)
    V value;
  };
  // What a shard without slots points to: two empty slots (shift 63 makes
  // every home 0 or 1), never written (such a shard's room is 0, so an
  // insert grows it first), so that a walk needs no test for "no slots"
  // (issue 35: the free's erase).
  static inline Slot no_slots_[2] = {};
  struct alignas(64) Shard {
    std::atomic<std::uint32_t> lock{0};
    // grow_at minus the live count (count()): what may be inserted before
    // growth; below 0 in a stuck shard filled past its limit. One field,
    // so that an insert's growth test and count are one subtract (issue 35).
    std::ptrdiff_t room = 0;
    std::size_t mask = 0;     // capacity - 1 (capacity a power of two), 0 without slots
    unsigned shift = 63;      // 64 - log2(capacity): home() takes the hash's bits below the shard's
    std::size_t grow_at = 0;  // the count that one more entry would take past half full (0 without slots)
    std::size_t map_bytes = 0;
    Slot* slots = no_slots_;   // no_slots_ until the first growth
    bool stuck = false;        // past its load limit, its growth failed (g_stuck_shards counts it)
    bool first_taken = false;  // its page of first_pages_ was taken (and is its own to unmap)
  };
  // Every shard's first page, mapped at once by the table's first insert:
  // past it no shard is left without room because one page could not be had.
  static constexpr std::size_t first_capacity() noexcept {
    std::size_t capacity = 8;
    while (capacity * 2 * sizeof(Slot) <= 4096) capacity *= 2;
    return capacity;
  }
  static constexpr std::size_t kFirstStride = (first_capacity() * sizeof(Slot) + 4095) / 4096 * 4096;
  static constexpr std::size_t kMissing = ~std::size_t{0};
  // Set in epoch_, with the adopting process's epoch in the other bits, while
  // one thread clears the table (epochs are counters: bit 63 is never theirs).
  static constexpr std::uint64_t kAdopting = std::uint64_t{1} << 63;
  // epoch_ of a table no process has used yet: neither an epoch nor 0.
  static constexpr std::uint64_t kFresh = ~std::uint64_t{0};

  static bool reserved(std::uint64_t key) noexcept { return key == 0 || key == ~std::uint64_t{0}; }
  static bool has_slots(const Shard& s) noexcept { return s.slots != no_slots_; }
  static std::size_t count(const Shard& s) noexcept { return s.grow_at - static_cast<std::size_t>(s.room); }
  // The shard without slots (what was mapped is the caller's to unmap).
  static void forget_slots(Shard& s) noexcept {
    s.slots = no_slots_;
    s.mask = s.grow_at = s.map_bytes = 0;
    s.room = 0;
    s.shift = 63;
  }
  // The home slot of hash h in shard s (which has slots): the log2(capacity)
  // bits of h just below the shard bits.
  static std::size_t home(const Shard& s, std::uint64_t h) noexcept { return (h << kShardBits) >> s.shift; }

  // A field added up over the shards, each read under its lock.
  std::size_t sum(std::size_t Shard::*field) const noexcept {
    enter();
    std::size_t n = 0;
    for (Shard& s : shards_) {
      lock(s);
      n += s.*field;
      unlock(s);
    }
    return n;
  }

  // One `lock bts` and a branch (bit 0 was clear: taken, the word now 1;
  // GCC makes a CAS loop of fetch_or(1) & 1, hence the asm).
  static bool try_take(std::atomic<std::uint32_t>& word) noexcept {
#if defined(__x86_64__) && !defined(__SANITIZE_THREAD__) && !defined(__SANITIZE_ADDRESS__)
    bool held;
    asm volatile("lock btsl $0, %0" : "+m"(*reinterpret_cast<std::uint32_t*>(&word)), "=@ccc"(held) : : "memory");
    return !held;
#else
    return (word.fetch_or(1, std::memory_order_acquire) & 1) == 0;
#endif
  }
  static void lock(Shard& s) noexcept {
    if (__builtin_expect(try_take(s.lock), 1)) return;
    table_detail::lock_slow(s.lock);
  }
  // A plain store (the holder owns the line: the load costs nothing); a
  // futex wake only when a waiter marked the word. (On x86-64 the compare
  // reads the word itself and the store leaves its flags: two instructions
  // before the branch, where GCC loads, stores and compares.)
  static void unlock(Shard& s) noexcept {
#if defined(__x86_64__) && !defined(__SANITIZE_THREAD__) && !defined(__SANITIZE_ADDRESS__)
    bool waiters;
    asm volatile("cmpl %2, %0\n\tmovl $0, %0"
                 : "+m"(*reinterpret_cast<std::uint32_t*>(&s.lock)), "=@ccz"(waiters)
                 : "i"(table_detail::kLockWaiters)
                 : "memory");
#else
    const bool waiters = s.lock.load(std::memory_order_relaxed) == table_detail::kLockWaiters;
    s.lock.store(0, std::memory_order_release);
#endif
    if (__builtin_expect(waiters, 0)) table_detail::wake_one(s.lock);
  }

  // Every operation first checks it runs in the process that filled the table:
  // the epoch word's value against the table's, one compare. The word reads 0
  // before the process took an epoch (and in a child until it takes its
  // own), which no table holds (kFresh before its first adoption): that
  // goes the slow way too, where process_epoch() takes the epoch.
  void enter() const noexcept {
    const std::uint64_t e = table_detail::g_epoch_word.load(std::memory_order_acquire)->load(std::memory_order_relaxed);
    if (__builtin_expect(epoch_.load(std::memory_order_acquire) != e, 0)) adopt(table_detail::process_epoch());
  }
  // The shard of hash h, its address computed once (GCC otherwise computes
  // it again after the lock is taken: three instructions more an operation).
  Shard& shard_of(std::uint64_t h) const noexcept {
    Shard* s = &shards_[h >> (64 - kShardBits)];
    asm("" : "+r"(s));
    return *s;
  }
  Shard& locked_shard(std::uint64_t h) const noexcept {
    enter();
    Shard& s = shards_[h >> (64 - kShardBits)];
    lock(s);
    return s;
  }

  // First operation in a new process (or of a fresh table): whatever the
  // table holds belongs to the parent. One thread clears it; others wait.
  // A fork while a parent's thread was clearing leaves that thread's marker,
  // which nobody in the child would ever end: the child takes it over, and
  // forgets the shards without unmapping them (which of them the interrupted
  // clear already unmapped is unknown; the child may have mapped something
  // at those addresses since).
  [[gnu::cold, gnu::noinline]] void adopt(std::uint64_t e) const noexcept {
    const std::uint64_t mine = kAdopting | e;
    for (unsigned round = 0;;) {
      std::uint64_t seen = epoch_.load(std::memory_order_acquire);
      if (seen == e) return;
      if (seen != mine && epoch_.compare_exchange_strong(seen, mine, std::memory_order_acq_rel)) {
        const bool interrupted = seen != kFresh && (seen & kAdopting) != 0;
        if (seen != kFresh) {
          for (Shard& s : shards_) {
            if (interrupted) {
              forget_slots(s);
            } else {
              free_slots(s);
            }
            unstick(s);
            s.lock.store(0, std::memory_order_relaxed);  // a parent's thread may have held it at fork
          }
          if (!interrupted) drop_first_pages();
          first_pages_.store(nullptr, std::memory_order_relaxed);
          for (Shard& s : shards_) s.first_taken = false;
        }
        epoch_.store(e, std::memory_order_release);
        return;
      }
      table_detail::backoff(&round);
    }
  }

  static void free_slots(Shard& s) noexcept {
    if (has_slots(s)) table_detail::unmap_pages(s.slots, s.map_bytes);
    forget_slots(s);
  }

  // insert_entered() and erase_entered() with the shard's lock held (taken
  // by try_take, or by lock_slow in the *_contended call): the operation,
  // then the unlock. Inline on the common path, the walk included (a key
  // away from its home costs no call: flat in the number of records).
  [[gnu::always_inline]] bool insert_held(Shard& s, std::uint64_t h, const V& value) noexcept {
    if (__builtin_expect(!take_room(s), 0)) return insert_slow(s, h, value);
    Slot* const slots = s.slots;
    bool ok = false;
    // (d, the walk's distance from the home, counted: fewer registers than
    // computing it from the home slot at every step.)
    for (std::size_t i = home(s, h), d = 0;; i = (i + 1) & s.mask, ++d) {
      const std::uint64_t k = slots[i].hash;
      if (__builtin_expect(k == 0, 1)) {  // (expected: the home slot free)
        put_slot(s, i, h, value);
        ok = true;
        break;
      }
      if (k == h) {
        ++s.room;  // (present: the room taken back)
        break;
      }
      if (distance(s, k, i) < d) {
        open(s, i);
        put_slot(s, i, h, value);
        ok = true;
        break;
      }
    }
    unlock(s);
    return ok;
  }
  [[gnu::cold, gnu::noinline]] bool insert_contended(Shard& s, std::uint64_t h, const V& value) noexcept {
    table_detail::lock_slow(s.lock);
    return insert_held(s, h, value);
  }
  [[gnu::always_inline]] static bool erase_held(Shard& s, std::uint64_t h, V* out) noexcept {
    bool found = false;
    Slot* const slots = s.slots;  // (no_slots_ without slots: its walk ends at once)
    const std::size_t at = home(s, h);
    for (std::size_t i = at;; i = (i + 1) & s.mask) {
      const std::uint64_t k = slots[i].hash;
      if (__builtin_expect(k == h, 1)) {  // (expected: the key at its home)
        if (out != nullptr) *out = slots[i].value;
        remove(s, i);
        found = true;
        break;
      }
      if (k == 0 || distance(s, k, i) < ((i - at) & s.mask)) break;  // the key would be here
    }
    unlock(s);
    return found;
  }
  [[gnu::cold, gnu::noinline]] static bool erase_contended(Shard& s, std::uint64_t h, V* out) noexcept {
    table_detail::lock_slow(s.lock);
    return erase_held(s, h, out);
  }

  // How far the record of hash k at slot i sits from its home.
  // (Computed as -(home - i): in the home's register. GCC's i - home takes
  // a copy of i in one more register, which the walks inline in the pair's
  // wrappers then save in their frames.)
  static std::size_t distance(const Shard& s, std::uint64_t k, std::size_t i) noexcept {
    std::size_t ahead = home(s, k) - i;
    asm("" : "+r"(ahead));
    return (0 - ahead) & s.mask;
  }

  // Robin Hood order: along a run of records their homes never decrease, so
  // a walk for h ends at the first record nearer its own home than h would
  // be at that slot (h is not further on), and a removal shifts back only
  // the records after the hole that are away from their homes, stopping at
  // the first one at its home (issue 35: an erase does not walk the rest
  // of the cluster, whatever the number of records).
  static std::size_t lookup(const Shard& s, std::uint64_t h) noexcept {
    if (!has_slots(s)) return kMissing;
    for (std::size_t i = home(s, h), d = 0;; i = (i + 1) & s.mask, ++d) {
      const std::uint64_t k = s.slots[i].hash;
      if (k == h) return i;
      if (k == 0 || distance(s, k, i) < d) return kMissing;  // never full: growth keeps half free
    }
  }

  // Empties slot i (a record's) by moving its run, up to the next empty
  // slot, one slot on: each record moves one further from its home, in
  // order (the new record then goes to i). Out of line: the insert's walk
  // inline keeps few registers (a caller's frame saves none for it).
  [[gnu::noinline]] static void open(Shard& s, std::size_t i) noexcept {
    std::size_t e = (i + 1) & s.mask;
    while (s.slots[e].hash != 0) e = (e + 1) & s.mask;
    for (; e != i; e = (e - 1) & s.mask) s.slots[e] = s.slots[(e - 1) & s.mask];
    s.slots[i].hash = 0;
  }

  // The slot of `key`, or else the empty slot where it goes (opened: the
  // run from there moved one slot on), after growing the shard if one more
  // entry would fill it past half: one walk from the key's home. Without
  // memory for growth the shard fills up to one slot short of full;
  // kMissing when even that is reached and the key is absent.
  std::size_t probe(Shard& s, std::uint64_t h) noexcept {
    if (__builtin_expect(s.room <= 0, 0) && !grow(s)) {
      const std::size_t capacity = has_slots(s) ? s.mask + 1 : 0;
      const std::size_t at = lookup(s, h);
      if (at != kMissing || count(s) + 1 >= capacity) return at;
    }
    for (std::size_t i = home(s, h), d = 0;; i = (i + 1) & s.mask, ++d) {
      const std::uint64_t k = s.slots[i].hash;
      if (k == h || k == 0) return i;
      if (distance(s, k, i) < d) {
        open(s, i);
        return i;
      }
    }
  }

  // insert() past the growth threshold (its shard locked; unlocked here).
  [[gnu::noinline]] bool insert_slow(Shard& s, std::uint64_t h, const V& value) noexcept {
    const std::size_t i = probe(s, h);
    const bool ok = i != kMissing && s.slots[i].hash == 0;
    if (ok) fill(s, i, h, value);
    unlock(s);
    return ok;
  }

  static void fill(Shard& s, std::size_t i, std::uint64_t h, const V& value) noexcept {
    put_slot(s, i, h, value);
    --s.room;
  }
  // fill() for an insert that took its room already (take_room).
  static void put_slot(Shard& s, std::size_t i, std::uint64_t h, const V& value) noexcept {
    s.slots[i].hash = h;
    std::memcpy(&s.slots[i].value, &value, sizeof(V));  // (its bytes at once: GCC copies a field at a time)
  }
  // One entry's room taken (the growth test and the count in one subtract,
  // its flag the branch; GCC loads, subtracts and stores): false, the room
  // as it was, when none was left (growth due, or the shard stuck).
  static bool take_room(Shard& s) noexcept {
#if defined(__x86_64__) && !defined(__SANITIZE_THREAD__) && !defined(__SANITIZE_ADDRESS__)
    bool none;
    asm("subq $1, %0" : "+m"(s.room), "=@ccs"(none));
#else
    const bool none = --s.room < 0;
#endif
    if (__builtin_expect(none, 0)) ++s.room;
    return !none;
  }

  [[gnu::noinline]] bool grow(Shard& s) noexcept {
    std::size_t capacity = has_slots(s) ? 2 * (s.mask + 1) : first_capacity();
    std::size_t bytes = capacity * sizeof(Slot);
    Slot* fresh = nullptr;
    if (!has_slots(s) && !s.first_taken) {  // one page to start: this shard's of the first pages
      if (char* block = first_pages()) {
        s.first_taken = true;
        fresh = reinterpret_cast<Slot*>(block + static_cast<std::size_t>(&s - shards_) * kFirstStride);
        bytes = kFirstStride;
      }
    }
    if (fresh == nullptr) fresh = static_cast<Slot*>(table_detail::map_pages(bytes));
    if (fresh == nullptr) {
      if (!s.stuck) {
        s.stuck = true;
        table_detail::g_stuck_shards.fetch_add(1, std::memory_order_seq_cst);
        table_detail::note_stuck(this, &PointerTable::regrow);
      }
      return false;
    }
    unstick(s);
    const std::size_t mask = capacity - 1;
    const unsigned shift = 64 - static_cast<unsigned>(__builtin_ctzll(capacity));
    for (std::size_t i = 0; has_slots(s) && i <= s.mask; ++i) {
      if (s.slots[i].hash == 0) continue;
      // Robin Hood insertion: the record carried takes the place of the
      // first one nearer its home, which is carried on.
      Slot carried = s.slots[i];
      for (std::size_t j = (carried.hash << kShardBits) >> shift, d = 0;; j = (j + 1) & mask, ++d) {
        if (fresh[j].hash == 0) {
          fresh[j] = carried;
          break;
        }
        const std::size_t kd = (j - ((fresh[j].hash << kShardBits) >> shift)) & mask;
        if (kd < d) {
          const Slot next = fresh[j];
          fresh[j] = carried;
          carried = next;
          d = kd;
        }
      }
    }
    const std::size_t live = count(s);
    if (has_slots(s)) table_detail::unmap_pages(s.slots, s.map_bytes);
    s.slots = fresh;
    s.mask = mask;
    s.shift = shift;
    s.grow_at = capacity / 2;  // (count + 1) * 2 > capacity exactly when count >= this
    s.room = static_cast<std::ptrdiff_t>(s.grow_at - live);
    s.map_bytes = bytes;
    return true;
  }

  // Backward-shift deletion: the records after the hole that are away from
  // their homes move back one slot each, up to the first empty slot or
  // record at its home (Robin Hood order: none after it could move), so
  // every key stays reachable from its home without tombstones.
  static void remove(Shard& s, std::size_t hole) noexcept {
    const std::size_t mask = s.mask;
    for (std::size_t j = (hole + 1) & mask;; j = (j + 1) & mask) {
      const std::uint64_t k = s.slots[j].hash;
      if (__builtin_expect(k == 0, 1) || distance(s, k, j) == 0) break;  // (expected: a cluster of one)
      s.slots[hole] = s.slots[j];
      hole = j;
    }
    s.slots[hole].hash = 0;
    ++s.room;
  }

  static void unstick(Shard& s) noexcept {
    if (!s.stuck) return;
    s.stuck = false;
    table_detail::g_stuck_shards.fetch_sub(1, std::memory_order_relaxed);
  }

  // The growth of every stuck shard, again (table_detail::regrow_stuck).
  static bool regrow(void* table) noexcept {
    auto* t = static_cast<PointerTable*>(table);
    t->enter();
    bool all = true;
    for (Shard& s : t->shards_) {
      lock(s);
      // A shard erasures brought back under its load limit is stuck no
      // more, grown or not (tested here, not in every erase).
      if (s.stuck && !t->grow(s)) {
        if ((count(s) + 1) * 2 <= s.mask + 1)
          unstick(s);
        else
          all = false;
      }
      unlock(s);
    }
    return all;
  }

  char* first_pages() noexcept {
    char* block = first_pages_.load(std::memory_order_acquire);
    if (block != nullptr) return block;
    auto* fresh = static_cast<char*>(table_detail::map_pages(kShards * kFirstStride));
    if (fresh == nullptr) return nullptr;
    if (first_pages_.compare_exchange_strong(block, fresh, std::memory_order_acq_rel)) return fresh;
    table_detail::unmap_pages(fresh, kShards * kFirstStride);  // another thread's came first
    return block;
  }

  // The first pages no shard took (those taken are their shards' own).
  void drop_first_pages() const noexcept {
    char* block = first_pages_.load(std::memory_order_acquire);
    if (block == nullptr) return;
    for (Shard& s : shards_) {
      if (!s.first_taken)
        table_detail::unmap_pages(block + static_cast<std::size_t>(&s - shards_) * kFirstStride, kFirstStride);
    }
  }

  mutable Shard shards_[kShards];
  mutable std::atomic<std::uint64_t> epoch_{kFresh};  // process epoch of the contents; kAdopting while cleared
  mutable std::atomic<char*> first_pages_{nullptr};
};

// The stale-record rule, the one place it is written: when the driver hands
// out a key (a device pointer, a handle) we still hold a record for, the
// object that record describes is gone (freed behind our back: a context
// destroyed with it, an untracked path, a free racing this allocation whose
// settle we did not see), and what it held went with it. The new record
// takes the key, and settle_stale(old) returns what the old one counted;
// it runs after the table's lock is dropped, so it may use this table and
// others. False (nothing recorded, nothing settled) when no memory is left
// for the record: the caller decides what an untracked object costs.
template <class V, class Settle>
bool record(PointerTable<V>& table, std::uint64_t key, const V& value, Settle&& settle_stale) noexcept {
  V stale{};
  switch (table.put(key, value, &stale)) {
    case PointerTable<V>::Put::inserted: return true;
    case PointerTable<V>::Put::replaced: settle_stale(static_cast<const V&>(stale)); return true;
    case PointerTable<V>::Put::full: break;
  }
  return false;
}

}  // namespace gpuslice::platform
