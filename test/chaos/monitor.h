// The chaos suite's invariant monitor (monitor.cc; README.md): an observer of
// the simulated driver that checks, in every process of a container, that the
// device holds no more than the container's gpuslice quota and no more than
// gpuslice counts. A program that links it (target chaos_monitor) has it
// registered before main(); FAKECUDA_MONITOR=1 turns it on.
#pragma once

namespace gpuslice::chaos {

// The calling process is quiescent (no driver call and no gpuslice operation
// in flight in any of its threads): checks, exactly, that it holds no more on
// each device than gpuslice committed for it as possibly resident. Returns the
// violations found (each reported like any other), or -1 when the monitor is
// off.
int monitor_checkpoint();

}  // namespace gpuslice::chaos
