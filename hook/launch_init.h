// The launch path's initialisation (launch_init.cc): at the first launch
// (limited or not), again in a forked child, the compute feedback thread's
// wiring, the recheck of limits set at run time, and a thread's credit of
// prices taken ahead, given back when it exits.
#pragma once

#include <cuda.h>

#include <cstdint>

namespace gpuslice::hook::launch {

[[gnu::noinline, gnu::cold]] CUresult init_launch_path() noexcept;

// The pid of the process whose buckets the thread's credit came from, once
// its return at thread exit is armed (0: not armed). Armed at the thread's
// first credit (the hook's thread-exit key: arm_thread_exit, hook/account.h),
// disarmed when the credit went back; a child forked without our handlers (_Fork, clone) finds
// another pid there and drops the parent's credit instead of returning it.
[[gnu::tls_model("initial-exec")]] extern constinit thread_local std::uint32_t t_credit_owner;
[[gnu::noinline, gnu::cold]] void arm_credit_return() noexcept;

// Every kRecheckEvery unlimited launches of a thread, the region's limits are
// read again: a limit set at run time (gpuslice-smi set, the agent) reaches a
// process that started without any, which has no feedback thread to see it.
inline constexpr std::uint32_t kRecheckEvery = 256;
[[gnu::tls_model("initial-exec")]] extern constinit thread_local std::uint32_t t_unlimited_launches;
// Re-reads the limits; true if the process is (now) limited.
[[gnu::cold, gnu::noinline]] bool recheck_limits() noexcept;

}  // namespace gpuslice::hook::launch
