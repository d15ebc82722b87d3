// The device of a stream (launch_streams.cc): a stream belongs to one
// context, hence one device, for its whole life; the driver is asked once per
// stream handle and the answer cached.
#pragma once

#include <cuda.h>

namespace gpuslice::hook::launch {

// The device ordinal a launch on `s` runs on (cached per stream), or -1 when
// the driver cannot tell (no current context for a default stream).
int stream_ordinal(CUstream s, bool ptsz) noexcept;
// A stream handle the driver destroyed: its address may come back as a
// stream of another device.
void forget_stream(CUstream s) noexcept;
// Every stream of a destroyed context is gone too.
void forget_all_streams() noexcept;

}  // namespace gpuslice::hook::launch
