// The device of a stream (launch_streams.h), for admission (launch.cc) and
// stream-ordered allocation (pools.cc).
// gpuslice: hot path (no heap, no locks)
#include "hook/launch_streams.h"

#include <atomic>
#include <cstdint>

#include "gpuslice/region.h"
#include "hook/launch_markers.h"

namespace gpuslice::hook::launch {
namespace {

// A stream belongs to one context, hence one device, for its whole life; the
// driver is asked once per stream handle and the answer cached here, lock-free:
// direct-mapped words of (handle << 8) | (ordinal + 1). A handle the driver
// destroys is forgotten (cuStreamDestroy), since its address may come back as
// a stream of another device.
constexpr unsigned kStreamCacheBits = 8;
constexpr unsigned kStreamCache = 1u << kStreamCacheBits;
std::atomic<std::uint64_t> g_stream_cache[kStreamCache];

unsigned stream_home(std::uintptr_t key) noexcept {
  return static_cast<unsigned>(((key >> 3) * 0x9e3779b97f4a7c15ull) >> (64 - kStreamCacheBits));
}

}  // namespace

int stream_ordinal(CUstream s, bool ptsz) noexcept {
  (void)ptsz;  // a _ptsz launch on the null stream goes to the per-thread stream: the current context's
  if (current_context_stream(s)) return current_ordinal();
  const auto key = reinterpret_cast<std::uintptr_t>(s);
  if ((key >> 56) != 0) return ask_stream_ordinal(s);  // does not fit a cache word
  std::atomic<std::uint64_t>& word = g_stream_cache[stream_home(key)];
  const std::uint64_t cached = word.load(std::memory_order_relaxed);
  if ((cached >> 8) == key && (cached & 0xff) != 0) return static_cast<int>(cached & 0xff) - 1;
  const int ordinal = ask_stream_ordinal(s);
  if (ordinal >= 0 && ordinal < static_cast<int>(kMaxDevices))
    word.store((std::uint64_t{key} << 8) | static_cast<std::uint64_t>(ordinal + 1), std::memory_order_relaxed);
  return ordinal;
}

void forget_stream(CUstream s) noexcept {
  const auto key = reinterpret_cast<std::uintptr_t>(s);
  if (current_context_stream(s) || (key >> 56) != 0) return;
  std::atomic<std::uint64_t>& word = g_stream_cache[stream_home(key)];
  std::uint64_t cached = word.load(std::memory_order_relaxed);
  if ((cached >> 8) == key) word.compare_exchange_strong(cached, 0, std::memory_order_relaxed);
}

void forget_all_streams() noexcept {
  for (auto& word : g_stream_cache) word.store(0, std::memory_order_relaxed);
}

}  // namespace gpuslice::hook::launch
