// One measurement in one process. The orchestrator re-executes gpuslice-bench
// as a worker (natively, or with libgpuslice.so preloaded) with a JSON spec;
// the worker measures and prints one JSON object on stdout. Keeping every
// measurement in a fresh process is what lets each run have its own
// environment (quota, SM limit, region, simulated device), as containers do.
#pragma once

#include <nlohmann/json.hpp>

namespace gpuslice::bench {

// Spec fields by task (times in ns, sizes in bytes):
//  probe   -
//  launch  batches, batch, roundtrips, throughput_launches
//  memops  alloc_bytes, batches, batch
//  quota   chunk, min_chunk, hold_ns; barrier {dir, index} optional
//  spin    kernel_us, depth, streams, run_ns, delay_ns, windows [[begin, end], ...],
//          all relative to the start; barrier {dir, index} optional (with
//          several streams on a real GPU the event-timed share counts
//          overlapping kernels twice; the simulated timeline does not);
//          bin_ns optional: also the share in bins of bin_ns from the start
//          to the end of the last window ("timeline": {bin_ns, shares})
//  memplan, memwatch: see oversub.h
// Throws on failure; the caller prints {"error": ...} and exits non-zero.
nlohmann::json run_worker(const nlohmann::json& spec);

}  // namespace gpuslice::bench
