// The chaos suite's invariant monitor (monitor.cc; README.md): an observer of
// the simulated driver that checks, in every process of a container, that the
// device holds no more than the container's gpuslice quota and no more than
// gpuslice counts. A program that links it (target chaos_monitor) has it
// registered before main(); FAKECUDA_MONITOR=1 turns it on.
#pragma once

#include <cstddef>
#include <cstdint>

namespace gpuslice::chaos {

// The calling process is quiescent (no driver call and no gpuslice operation
// in flight in any of its threads): checks, exactly, that it holds no more on
// each device than gpuslice committed for it as possibly resident. Returns the
// violations found (each reported like any other), or -1 when the monitor is
// off.
int monitor_checkpoint();

// The refusal direction: the calling thread is about to ask for `bytes` of
// device memory on `dev` (an explicit allocation whose size it knows) ...
void monitor_request_begin(unsigned dev, std::uint64_t bytes);
// ... and the call returned; `refused` for CUDA_ERROR_OUT_OF_MEMORY. A
// refusal while the container holds no more than the limit less the request
// and the documented conservative transients (README.md, "The invariant
// monitor") is a violation ("refusal"); returns 1 then. Not judged when the
// limit changed or a process of the container ended during the request.
int monitor_request_end(bool refused, const char* what);
// A free of `bytes` the calling thread is about to make, and its end: the
// driver frees before gpuslice uncounts, so a free in flight is counted
// memory the device no longer holds. bytes 0: unknown (a refusal whose
// request overlaps it is not judged).
void monitor_release_begin(unsigned dev, std::uint64_t bytes);
void monitor_release_end();
// How many memory pools (the device's default included) this process uses:
// each may be counted up to one 2 MiB chunk above its reserve.
void monitor_pools(unsigned count);
// The program's own view of what it holds, for the reports of the quiescent
// checks (monitor_checkpoint: its threads parked): `describe` writes one
// indented line per object, NUL-terminated, beside the simulator's list
// (fakecuda_holdings), so a count above what the device holds names the
// object the device no longer has. nullptr: none.
void monitor_describer(void (*describe)(char* out, std::size_t len));
// Memory this process allocated outside CUDA (a graphics API: interop) while
// it created an object whose memory gpuslice measures (a context, module,
// library or array: NVML's usage of the process after minus before the call)
// and that still exists: gpuslice counts it in that object, once imported a
// second time, until the object is destroyed (docs/memory-accounting.md,
// "Chaos testing"). `bytes` is the whole amount for the process on `dev`.
void monitor_absorbed(unsigned dev, std::uint64_t bytes);
// The other way: memory this process's graphics API freed off the device (no
// CUDA call) while it created such an object that still exists. NVML's usage
// fell by it inside the measured call, so gpuslice counts that object short
// by up to these bytes (NVML cannot tell the graphics free from the object's
// size: docs/memory.md) until it is destroyed. monitor_checkpoint() allows
// exactly these bytes above the count; `bytes` is the whole amount for the
// process on `dev`. The background count check excuses them too.
void monitor_measured_short(unsigned dev, std::uint64_t bytes);

// The count direction (calls.cc): the calling thread begins, and ends, a
// call of the program through gpuslice (or an operation made of such calls;
// nested brackets count as one). gpuslice counts what a call made by the
// time it returns: bytes granted to the thread inside the bracket are
// excused from the count until it ends. With FAKECUDA_MONITOR_CALLS=1 (every
// process brackets every call) a deficit beyond the excuses is a violation
// at once; without it, one that lasts longer than FAKECUDA_MONITOR_LAG_MS.
void monitor_call_begin();
void monitor_call_end();
// Device memory this process is about to hold, and no longer holds, outside
// CUDA without gpuslice knowing of it (a graphics allocation before its
// import, or after its import was destroyed): excused by its bytes between.
void monitor_outside_begin(unsigned dev, std::uint64_t bytes);
void monitor_outside_end(unsigned dev, std::uint64_t bytes);

}  // namespace gpuslice::chaos
