// The process-local allocation table: exactly-once erase under races, growth.
#include <atomic>
#include <random>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "limiter/alloc_table.h"

namespace gpuslice::limiter {
namespace {

AllocRecord rec(std::uint64_t bytes, std::int32_t dev = 0, AllocKind kind = AllocKind::linear) {
  return AllocRecord{bytes, dev, kind};
}

// Device pointers look like this: aligned, clustered.
std::uint64_t ptr(std::uint64_t i) { return 0x7f0000000000ull + i * 512; }

TEST(AllocTable, InsertFindErase) {
  AllocTable t;
  AllocRecord out{};
  EXPECT_FALSE(t.find(ptr(1), &out));
  EXPECT_FALSE(t.erase(ptr(1), &out));
  EXPECT_TRUE(t.insert(ptr(1), rec(100, 3, AllocKind::vmm)));
  EXPECT_FALSE(t.insert(ptr(1), rec(5)));  // double insert
  ASSERT_TRUE(t.find(ptr(1), &out));
  EXPECT_EQ(out.bytes, 100u);
  EXPECT_EQ(out.dev, 3);
  EXPECT_EQ(out.kind, AllocKind::vmm);
  EXPECT_EQ(t.size(), 1u);
  ASSERT_TRUE(t.erase(ptr(1), &out));
  EXPECT_EQ(out.bytes, 100u);
  EXPECT_EQ(out.kind, AllocKind::vmm);
  EXPECT_FALSE(t.erase(ptr(1), &out));  // exactly once
  EXPECT_FALSE(t.find(ptr(1), &out));
  // The driver hands the same address out again.
  EXPECT_TRUE(t.insert(ptr(1), rec(7, -1, AllocKind::context)));
  ASSERT_TRUE(t.find(ptr(1), &out));
  EXPECT_EQ(out.bytes, 7u);
  EXPECT_EQ(out.dev, -1);
  EXPECT_EQ(out.kind, AllocKind::context);
  EXPECT_EQ(t.size(), 1u);
}

TEST(AllocTable, RefusesReservedKeysAndWideDevices) {
  AllocTable t;
  EXPECT_FALSE(t.insert(0, rec(1)));
  EXPECT_FALSE(t.insert(~std::uint64_t{0}, rec(1)));
  EXPECT_FALSE(t.insert(1, rec(1, 40000)));
  EXPECT_FALSE(t.erase(0, nullptr));
  EXPECT_FALSE(t.find(~std::uint64_t{0}, nullptr));
  EXPECT_TRUE(t.insert(1, rec(1, 32767)));
  EXPECT_TRUE(t.erase(1, nullptr));
}

#if defined(__SANITIZE_THREAD__)
constexpr std::uint64_t kFindStride = 97;  // TSan makes each atomic ~50x dearer: sample fewer lookups
#else
constexpr std::uint64_t kFindStride = 7;
#endif

TEST(AllocTable, GrowsToAMillionEntries) {
  AllocTable t;
  constexpr std::uint64_t kEntries = 1'000'000;
  for (std::uint64_t i = 1; i <= kEntries; ++i) ASSERT_TRUE(t.insert(ptr(i), rec(i, static_cast<int>(i % 16))));
  EXPECT_EQ(t.size(), kEntries);
  AllocRecord out{};
  for (std::uint64_t i = 1; i <= kEntries; i += kFindStride) {
    ASSERT_TRUE(t.find(ptr(i), &out));
    ASSERT_EQ(out.bytes, i);
    ASSERT_EQ(out.dev, static_cast<int>(i % 16));
  }
  EXPECT_FALSE(t.find(ptr(kEntries + 1), &out));
  std::uint64_t sum = 0;
  t.for_each([&](std::uint64_t, const AllocRecord& r) { sum += r.bytes; });
  EXPECT_EQ(sum, kEntries * (kEntries + 1) / 2);
  for (std::uint64_t i = 1; i <= kEntries; ++i) ASSERT_TRUE(t.erase(ptr(i), &out));
  EXPECT_EQ(t.size(), 0u);
}

// Churn through many distinct keys with few live: erased keys are purged by
// rehashing, the table does not grow without bound.
TEST(AllocTable, ChurnOfDistinctKeys) {
  AllocTable t;
  for (std::uint64_t i = 1; i <= 300'000; ++i) {
    ASSERT_TRUE(t.insert(ptr(i), rec(i)));
    if (i > 10) {
      ASSERT_TRUE(t.erase(ptr(i - 10), nullptr));
    }
  }
  EXPECT_EQ(t.size(), 10u);
}

TEST(AllocTable, ThreadsWithDisjointKeys) {
  AllocTable t;
  constexpr int kThreads = 8;
  constexpr std::uint64_t kPerThread = 40'000;
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int th = 0; th < kThreads; ++th) {
    threads.emplace_back([&, th] {
      const std::uint64_t base = static_cast<std::uint64_t>(th) * 10'000'000;
      AllocRecord out{};
      for (std::uint64_t i = 1; i <= kPerThread; ++i) {
        if (!t.insert(ptr(base + i), rec(i, th))) failures.fetch_add(1);
        if (!t.find(ptr(base + i), &out) || out.bytes != i || out.dev != th) failures.fetch_add(1);
        if (i % 3 == 0 && !t.erase(ptr(base + i - 1), &out)) failures.fetch_add(1);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(t.size(), kThreads * (kPerThread - kPerThread / 3));
}

// All threads fight over the same keys: for every key, exactly one insert and
// exactly one erase win, and the erased bytes are the inserted ones.
TEST(AllocTable, ThreadsWithCollidingKeys) {
  AllocTable t;
  constexpr int kThreads = 8;
  constexpr std::uint64_t kKeys = 20'000;
  std::atomic<int> ready{0};
  std::vector<std::uint64_t> inserted(kThreads, 0), erased(kThreads, 0);
  std::vector<std::uint64_t> insert_wins(kThreads, 0), erase_wins(kThreads, 0);
  std::vector<std::thread> threads;
  for (int th = 0; th < kThreads; ++th) {
    threads.emplace_back([&, th] {
      ready.fetch_add(1);
      while (ready.load() < kThreads) {
      }
      for (std::uint64_t i = 1; i <= kKeys; ++i) {
        if (t.insert(ptr(i), rec(i * 10 + static_cast<std::uint64_t>(th)))) {
          ++insert_wins[th];
          inserted[th] += i * 10 + static_cast<std::uint64_t>(th);
        }
      }
      for (std::uint64_t i = 1; i <= kKeys; ++i) {
        AllocRecord out{};
        if (t.erase(ptr(i), &out)) {
          ++erase_wins[th];
          erased[th] += out.bytes;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  std::uint64_t ins = 0, era = 0, ins_bytes = 0, era_bytes = 0;
  for (int th = 0; th < kThreads; ++th) {
    ins += insert_wins[th];
    era += erase_wins[th];
    ins_bytes += inserted[th];
    era_bytes += erased[th];
  }
  // A key erased early may be re-inserted by a slower thread: every insert
  // that won is matched by exactly one erase.
  EXPECT_GE(ins, kKeys);
  EXPECT_EQ(era, ins - t.size());
  std::uint64_t left = 0;
  t.for_each([&](std::uint64_t, const AllocRecord& r) { left += r.bytes; });
  EXPECT_EQ(era_bytes + left, ins_bytes);
}

// Lookups of stable keys never miss while other threads force resizes.
TEST(AllocTable, FindsDuringGrowth) {
  AllocTable t;
  for (std::uint64_t i = 1; i <= 1000; ++i) ASSERT_TRUE(t.insert(ptr(i), rec(i)));
  std::atomic<bool> stop{false};
  std::atomic<int> misses{0};
  std::vector<std::thread> readers;
  for (int r = 0; r < 3; ++r) {
    readers.emplace_back([&, r] {
      std::mt19937_64 rng(static_cast<std::uint64_t>(r));
      AllocRecord out{};
      while (!stop.load()) {
        const std::uint64_t i = 1 + rng() % 1000;
        if (!t.find(ptr(i), &out) || out.bytes != i) misses.fetch_add(1);
      }
    });
  }
  for (std::uint64_t i = 2000; i < 200'000; ++i) ASSERT_TRUE(t.insert(ptr(i), rec(i)));
  stop.store(true);
  for (auto& r : readers) r.join();
  EXPECT_EQ(misses.load(), 0);
}

TEST(AllocTable, DrainRacingErasesIsExactlyOnce) {
  AllocTable t;
  constexpr std::uint64_t kKeys = 50'000;
  for (std::uint64_t i = 1; i <= kKeys; ++i) ASSERT_TRUE(t.insert(ptr(i), rec(1)));
  std::atomic<std::uint64_t> taken{0};
  std::thread eraser([&] {
    for (std::uint64_t i = kKeys; i >= 1; --i) {
      if (t.erase(ptr(i), nullptr)) taken.fetch_add(1);
    }
  });
  std::uint64_t drained = 0;
  t.drain([&](std::uint64_t, const AllocRecord& r) { drained += r.bytes; });
  eraser.join();
  EXPECT_EQ(drained + taken.load(), kKeys);
  EXPECT_EQ(t.size(), 0u);
}

}  // namespace
}  // namespace gpuslice::limiter
