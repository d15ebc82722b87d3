// The invariant monitor's over-count check at quiescent checkpoints
// (monitor_checkpoint, FAKECUDA_MONITOR_OVERCOUNT=1; README.md, "The
// invariant monitor"): a quiescent process's slot counts no more than the
// process holds plus the slack the library documents as conservative, each
// part bounded and named. A count above that is what later refuses an
// allocation while the container has room (issue 32: a process counting a
// torture size it does not hold, seeds 1,051,802, 2364, 405), seen here
// without the quota being reached.
//
// The slack, per process and device (docs/memory-accounting.md):
//   lease     its lease word's amount: spare bytes (admitted, not allocated;
//             STALE ones too) or, OWED, bytes a thief took back into
//             used_bytes that committed_bytes still holds until the owner
//             settles; limiter/lease.h. A word of another claim: 0.
//   pools     2 MiB per memory pool the process uses (monitor_pools): a pool
//             is counted up to one chunk above its reserve ("Pools").
//   absorbed  memory allocated outside CUDA while an object gpuslice
//             measures was created, counted in that object while it lives
//             and again once imported (monitor_absorbed).
// Spilled bytes (host memory) are left out of the count as the count
// direction leaves them out. What the process holds outside CUDA is in what
// it holds: the check is then less sensitive, never wrong.
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdio>

#include <gpuslice/region.h>

#include "fakecuda_query.h"
#include "limiter/lease.h"
#include "monitor_internal.h"

namespace gpuslice::chaos::internal {

int overcount_at_checkpoint(std::uint32_t dev, int rd, std::uint64_t held, const Region& r, const Slot& own) {
  std::uint64_t committed = own.committed_bytes[rd].load(std::memory_order_acquire);
  const std::uint64_t spilled = own.spilled_bytes[rd].load(std::memory_order_acquire);
  committed = committed > spilled ? committed - spilled : 0;
  const std::uint64_t word = own.lease[rd].word.load(std::memory_order_acquire);
  const std::uint64_t tag = limiter::lease_tag_of(own.claim_generation.load(std::memory_order_acquire));
  const std::uint64_t lease =
      word >> limiter::kLeaseTagShift == tag >> limiter::kLeaseTagShift ? limiter::lease_amount(word) : 0;
  const std::uint64_t pools = std::uint64_t{g_shared->pools[g_slot].load(std::memory_order_relaxed)} << 21;
  const std::uint64_t absorbed = g_shared->absorbed[g_slot][dev].load(std::memory_order_relaxed);
  const std::uint64_t slack = lease + pools + absorbed;
  if (committed <= held + slack) return 0;
  char detail[480];
  std::snprintf(detail, sizeof(detail),
                "the quiescent process counts %llu bytes more than it holds beyond the documented slack: it holds "
                "%llu on the device; its slot's committed_bytes less spilled is %llu (spilled %llu, contexts %llu); "
                "slack %llu (lease spare or owed %llu, pools %llu, absorbed %llu)",
                static_cast<unsigned long long>(committed - held - slack), static_cast<unsigned long long>(held),
                static_cast<unsigned long long>(committed), static_cast<unsigned long long>(spilled),
                static_cast<unsigned long long>(own.context_bytes[rd].load(std::memory_order_relaxed)),
                static_cast<unsigned long long>(slack), static_cast<unsigned long long>(lease),
                static_cast<unsigned long long>(pools), static_cast<unsigned long long>(absorbed));
  const DeviceState& d = r.devices[rd];
  Watch* w = watch_for(dev, d.quota_bytes.load(std::memory_order_relaxed), 0);
  report("over-count at checkpoint", detail, dev, rd, container_total(dev, nullptr), held,
         w != nullptr ? w->ceiling.load(std::memory_order_relaxed) : 0, d, nullptr);
  return 1;
}

}  // namespace gpuslice::chaos::internal
