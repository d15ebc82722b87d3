/* Test-only queries exported by the simulated driver (libcuda.so.1 built from
 * test/fakecuda). They read the shared state named by FAKECUDA_STATE (or the
 * state this process attached to in cuInit) without needing cuInit, a context
 * or NVML, so a test can check what the "device" holds from outside the code
 * under test. Resolve them with dlsym() on the libcuda.so.1 handle, or link the
 * fakecuda target. pid arguments match either the pid a process has in its own
 * namespace or its host pid; 0 means the calling process (or, for busy time,
 * every process). Sizes in bytes, times in CLOCK_MONOTONIC nanoseconds. */
#ifndef FAKECUDA_QUERY_H
#define FAKECUDA_QUERY_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Limits of the simulated machine: devices and process slots per state. */
#define FAKECUDA_MAX_DEVICES 16
#define FAKECUDA_MAX_SLOTS 512

/* Devices in the state; -1 if there is no state file. */
int fakecuda_device_count(void);
uint64_t fakecuda_device_total_bytes(int dev);
/* Bytes held on the device by every live process (dead processes are reaped first). */
uint64_t fakecuda_device_used_bytes(int dev);
/* Of those, managed memory (held where it fits from its allocation until
 * advised to the host or freed); *used (if not NULL) gets the device's held
 * bytes read in the same pass, under the state lock: the managed figure is
 * never more than the managed part of *used (an advice or free, which takes
 * no lock, lowers the held bytes before this figure). */
uint64_t fakecuda_device_managed_bytes(int dev, uint64_t* used);
/* Bytes held on the device by one process: allocations + context memory. */
uint64_t fakecuda_process_used_bytes(int dev, int pid_or_0);
/* The context-memory part of fakecuda_process_used_bytes. */
uint64_t fakecuda_process_context_bytes(int dev, int pid_or_0);
/* Live processes with a context or memory on the device. */
int fakecuda_process_count(int dev);
/* Device time within [t0_ns, t1_ns) spent on kernels of pid (0 = all processes). */
uint64_t fakecuda_busy_ns(int dev, int pid_or_0, uint64_t t0_ns, uint64_t t1_ns);
/* The busy intervals the device's ring holds that overlap [t0_ns, t1_ns):
 * up to max of them into out as (start_ns, end_ns, host pid) triples, clipped
 * to the window, in ring order; returns how many overlap (may exceed max). */
size_t fakecuda_busy_segments(int dev, uint64_t t0_ns, uint64_t t1_ns, uint64_t* out, size_t max);
/* When the last kernel submitted to the device ends (the realistic profile:
 * the simulated now, see fakecuda_pending_ns). */
uint64_t fakecuda_busy_until_ns(int dev);
/* The device time still owed to the work submitted to the device and not yet
 * run (ns): the ideal profile's busy_until - now, the realistic profile's
 * pending launches' remaining run time (advanced to now first). */
uint64_t fakecuda_pending_ns(int dev);
/* Kernel launches submitted to the device and not yet run to their end, of
 * processes other than except_pid (0: of every process); the realistic
 * profile only (the ideal one's timeline keeps no queue: 0). Advances the
 * simulation to now first. */
uint64_t fakecuda_pending_kernels(int dev, int except_pid);
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

/* --- Observers (README "Contract": "Query API") ---------------------------
 * A program that links the simulator may register one observer before cuInit:
 * the chaos suite's invariant monitor (test/chaos/monitor.cc) is one. The
 * simulator calls it at cuInit and at every change of this process's device
 * memory, and knows nothing of what it checks. The functions below it give an
 * observer the simulator's ground truth; none of them is a driver entry point
 * (none records an operation or perturbs the schedule). */
typedef struct fakecuda_observer {
  /* cuInit, after the simulator's own variables (FAKECUDA_CHAOS_*) were read:
   * 0 to go on, else nonzero with one line naming the bad variable in
   * error (cuInit prints it and fails with CUDA_ERROR_INVALID_VALUE). */
  int (*configure)(const char* state_path, char* error, size_t error_len);
  /* cuInit, once this process owns process slot `slot` of a state with
   * `devices` devices (0 .. devices-1, fixed for its life): nonzero to receive
   * charged/uncharged (then every entry point also records its name in the
   * operation ring, fakecuda_recent_operations). */
  int (*attach)(int slot, unsigned devices);
  /* After each grant of device memory to a process of this program (slot),
   * under the state lock: every grant of every process is seen in one order.
   * context: context memory rather than an allocation; call/previous_call:
   * the entry points (or helpers) the granting thread entered last. */
  void (*charged)(int slot, unsigned dev, uint64_t bytes, int context, const char* call, const char* previous_call);
  /* After each release of device memory by this program (no lock held). */
  void (*uncharged)(int slot, unsigned dev, uint64_t bytes, int context, const char* call);
} fakecuda_observer;
/* 0 on success; -1 if one is registered already or cuInit has begun. The
 * observer must outlive the process's driver use. Without one, cuInit refuses
 * FAKECUDA_MONITOR=1 (the monitor is an observer the program must link). */
int fakecuda_set_observer(const fakecuda_observer* observer);

/* 1 while cuInit has succeeded in this process (not forked, not torn down). */
int fakecuda_initialized(void);
/* The state lock, under which every grant is made: 1 if taken (then call
 * fakecuda_state_unlock), 0 if not. Only after a successful cuInit. */
int fakecuda_state_lock(void);
void fakecuda_state_unlock(void);
/* With the state lock held: frees the holdings of dead processes (not this
 * one's); returns how many were reaped. */
int fakecuda_reap_locked(void);
/* With the state lock held: one past the highest process slot ever claimed. */
int fakecuda_slots_high_locked(void);
/* One process slot as the state holds it (held_bytes: allocations + context
 * memory on dev). 0 if slot or dev is out of range. */
typedef struct fakecuda_slot_info {
  int claimed;         /* a process owns the slot (or its dead owner is not reaped yet) */
  uint32_t generation; /* changes every time the slot is claimed */
  uint32_t pid;        /* in the owner's namespace */
  uint64_t held_bytes;
} fakecuda_slot_info;
int fakecuda_slot_info_get(int slot, unsigned dev, fakecuda_slot_info* out);
/* Whether the slot's owner still lives (holds its liveness lock); 1 when it
 * cannot tell. Not for this process's own slot. */
int fakecuda_slot_alive(int slot);
/* The device's 16 UUID bytes, as cuDeviceGetUuid gives them; 0 if none. */
int fakecuda_device_uuid(int dev, unsigned char out[16]);
/* Chaos mode's seed (0: off) and this process's stream (FAKECUDA_CHAOS_*). */
uint64_t fakecuda_chaos_seed(void);
uint64_t fakecuda_chaos_stream(void);
/* The calling thread's ordinal in this process (t1, t2, ...: the ring's names). */
uint32_t fakecuda_thread_ordinal(void);
/* When (fakecuda_now_ns) the calling thread entered its last driver entry
 * point (an observer's grant: the call that granted began then); 0 if none,
 * or with chaos and observer off. */
uint64_t fakecuda_call_began_ns(void);
/* This process's last `count` operations (entry points, charges, chaos
 * decisions), oldest first, one indented line each, NUL-terminated. */
void fakecuda_recent_operations(char* out, size_t len, int count);
/* This process's objects holding device memory (allocations, placed modules
 * and libraries, arrays, pools' reserves), one indented line each,
 * NUL-terminated; "    (busy)" when another thread holds the simulator's
 * registries (never waits for them: callable with the state lock held). */
void fakecuda_holdings(char* out, size_t len);

/* The simulated graphics allocator (interop.cc): device memory a graphics API
 * allocates for this process, charged to it (NVML shows it as the process's)
 * without a CUDA allocation call. After cuInit. alloc: an id, 0 on failure
 * (no room: as vkAllocateMemory's out-of-device-memory). export_fd: a new
 * OPAQUE_FD for cuImportExternalMemory, -1 if none. free: the graphics API's
 * free; the bytes leave the device once no import holds them. semaphore: an
 * OPAQUE_FD for cuImportExternalSemaphore. */
uint64_t fakecuda_graphics_alloc(int dev, uint64_t bytes);
int fakecuda_graphics_export_fd(uint64_t id);
int fakecuda_graphics_free(uint64_t id);
int fakecuda_graphics_semaphore(void);

#ifdef __cplusplus
}
#endif

#endif /* FAKECUDA_QUERY_H */
