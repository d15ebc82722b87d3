/* Test-only queries exported by the simulated driver (libcuda.so.1 built from
 * test/fakecuda). They read the shared state named by FAKECUDA_STATE (or the
 * state this process attached to in cuInit) without needing cuInit, a context
 * or NVML, so a test can check what the "device" holds from outside the code
 * under test. Resolve them with dlsym() on the libcuda.so.1 handle, or link the
 * fakecuda target. pid arguments match either the pid a process has in its own
 * namespace or its host pid; 0 means the calling process (or, for busy time,
 * every process). Sizes in bytes, times in CLOCK_MONOTONIC nanoseconds. */
#ifndef GPUSLICE_FAKECUDA_QUERY_H
#define GPUSLICE_FAKECUDA_QUERY_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Devices in the state; -1 if there is no state file. */
int fakecuda_device_count(void);
uint64_t fakecuda_device_total_bytes(int dev);
/* Bytes held on the device by every live process (dead processes are reaped first). */
uint64_t fakecuda_device_used_bytes(int dev);
/* Bytes held on the device by one process: allocations + context memory. */
uint64_t fakecuda_process_used_bytes(int dev, int pid_or_0);
/* The context-memory part of fakecuda_process_used_bytes. */
uint64_t fakecuda_process_context_bytes(int dev, int pid_or_0);
/* Live processes with a context or memory on the device. */
int fakecuda_process_count(int dev);
/* Device time within [t0_ns, t1_ns) spent on kernels of pid (0 = all processes). */
uint64_t fakecuda_busy_ns(int dev, int pid_or_0, uint64_t t0_ns, uint64_t t1_ns);
/* When the last kernel submitted to the device ends. */
uint64_t fakecuda_busy_until_ns(int dev);
/* CLOCK_MONOTONIC now, in ns: the timeline's clock. */
uint64_t fakecuda_now_ns(void);
/* Frees the holdings of dead processes now; returns how many were reaped. */
int fakecuda_reap(void);
/* The state's timing profile, "ideal" or "realistic" ("" if there is no state),
 * so a benchmark can print which simulated device it ran on. */
const char* fakecuda_profile(void);
/* Path of the state file these queries read ("" if none). */
const char* fakecuda_state_path(void);
/* 1 if a driver entry point (from dlsym/cuGetProcAddress) is a generated
 * CUDA_ERROR_NOT_SUPPORTED stub rather than a modelled function. */
int fakecuda_symbol_is_stub(const void* function);
/* Invariant monitor (README "Chaos mode and invariant monitor"): the calling
 * process is quiescent; checks that it holds no more on each device than
 * gpuslice committed for it. Violations found, or -1 if FAKECUDA_MONITOR is off. */
int fakecuda_monitor_checkpoint(void);

#ifdef __cplusplus
}
#endif

#endif /* GPUSLICE_FAKECUDA_QUERY_H */
