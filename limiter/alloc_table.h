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

// After the driver freed objects implicitly (a context destroyed with its
// allocations): release(record) for every record of `table` for which
// gone(key, record) says the driver no longer knows the handle. gone() asks
// the driver, so it runs on copies with no table lock held (a driver calling
// back into a hooked entry point must not wait on one); each record is then
// erased exactly once, and gone() asked again about the record taken:
//  - another thread may have allocated at the same address (the driver
//    reuses addresses) between gone() and the erase, and committed its
//    record under the key, releasing the gone one as stale: the record taken
//    is then the new one, known to the driver, and goes back;
//  - a free of it meanwhile found no record and was forwarded uncounted:
//    gone then, and released here;
//  - known again, but a record holds the key once more: another thread
//    allocated at the address after the erase and committed (nothing to
//    displace). That record counts the memory there now; the one taken is of
//    memory gone (the destroyed context's, or a free's forwarded uncounted
//    since): released here, never put back over it nor dropped uncounted;
//  - known at the second question, but freed again before the put-back (an
//    allocation there whose record was committed and erased meanwhile, or a
//    pool allocation's, kept in another table): put back into an empty slot,
//    a record of nothing. So once it went back, gone() is asked again and
//    the same settles it (at most 3 rounds; a record at an address the
//    driver does not know is stale: a free erases its record first). A pool
//    free still in the driver after the last round settles the address
//    itself once done (it saw the freed-behind word change: hook/memory.h).
// A record that cannot go back for want of memory stays counted (never short).
// settle_record: the same for one key (`rec`: what the caller saw there, or
// {} when it saw nothing; gone() of the linear table ignores it).
// Any table of records (the pools' too: hook/pool_state.cc).
template <class Record, class Gone, class Release>
void settle_record(platform::PointerTable<Record>& table, std::uint64_t key, const Record& rec, Gone&& gone,
                   Release&& release) noexcept {
  if (!gone(key, rec)) return;
  for (int round = 0; round < 3; ++round) {
    Record taken{};
    if (!table.erase(key, &taken)) return;
    if (gone(key, taken)) return release(static_cast<const Record&>(taken));
    bool newer = false;  // allocated again at this address since: ours goes back, unless a newer record is there
    if (!table.upsert(key, taken, [&](Record&, bool inserted) { newer = !inserted; })) return;
    if (newer) return release(static_cast<const Record&>(taken));
    if (!gone(key, taken)) return;  // put back: still known, or freed again since (asked once more)
  }
}
template <class Gone, class Release>
void sweep_records(AllocTable& table, Gone&& gone, Release&& release) noexcept {
  table.for_each_unlocked(
      [&](std::uint64_t key, const AllocRecord& rec) { settle_record(table, key, rec, gone, release); });
}

// What was charged for a driver object that is not an allocation (a
// context, a module, a library's placement, a context's resource limit):
// bytes on a region device entry. One type for every table of them.
struct Counted {
  int entry;
  std::uint64_t bytes;
};

}  // namespace gpuslice::limiter
