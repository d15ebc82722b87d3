// A start line for workers that must run at the same time (tenants, processes
// racing for one quota). Each worker finishes its set-up (context creation
// takes ~100 ms on a real GPU), says so with a file, and waits for the
// orchestrator to publish one CLOCK_MONOTONIC start time; every measurement
// window is then relative to that instant in every process.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

namespace gpuslice::bench {

// Worker side: mark `index` ready in `dir`, wait for the start time and return
// it. Throws std::runtime_error after `timeout_ns`.
std::uint64_t barrier_arrive_and_wait(const std::string& dir, int index, std::uint64_t timeout_ns);

// Orchestrator side: wait until `count` workers are ready (or one of `pids`
// has exited: false), then publish start = now + lead_ns. Returns the start.
bool barrier_release(const std::string& dir, int count, const std::vector<pid_t>& pids, std::uint64_t lead_ns,
                     std::uint64_t timeout_ns, std::uint64_t* start_ns);

}  // namespace gpuslice::bench
