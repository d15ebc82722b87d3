// Process-local side of the simulated driver: the handle objects (contexts,
// streams, events, modules, functions) and the runtime every entry point uses.
// Shared, cross-process state lives in state.h; this is what one process's
// driver instance keeps for itself, as the real driver does.
#pragma once

#include <pthread.h>

#include <cuda.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <vector>

#include "chaos.h"
#include "state.h"
#include "scheduler.h"
#include "timeline.h"

// Handle objects. cuda.h only declares these structs, so the fake defines them.
// They are never freed (see HandlePool): a destroyed handle is marked dead (in
// the validity word the pool keeps beside it) and later recycled, which makes
// stale handles detectable and lets the lock-free launch path dereference
// handles without taking a lock. kAlive is the word's value while live.
struct CUctx_st {
  static constexpr std::uint32_t kAlive = 0xC7C7C7C7;
  std::uint32_t device = 0;
  unsigned flags = 0;
  bool primary = false;
  std::atomic<bool> active{false};  // primary: retained at least once; created: until destroyed
  int retain_count = 0;             // primary only, under the runtime mutex
  std::uint64_t id = 0;
  std::atomic<std::uint64_t> last_end_ns{0};  // end of all work submitted in this context
  std::atomic<std::uint64_t> last_ticket{0};  // realistic profile: newest scheduler ticket of this context
  CUstream_st* null_stream = nullptr;
  std::size_t limits[16] = {};
  std::uint64_t heap_extra = 0;  // device bytes held for a malloc heap above the default (cuCtxSetLimit)
  // A green context's CUcontext (cuCtxFromGreenCtx, green.cc): "a normal
  // primary context but with the resources of the green context", so what it
  // allocates belongs to `base`, the device's primary context; sm_count is
  // its SM partition.
  CUctx_st* base = nullptr;
  unsigned sm_count = 0;
  CUgreenCtx green = nullptr;
  // Contexts whose allocations this one may access (cuCtxEnablePeerAccess,
  // peer.cc), by id (a destroyed peer's id never matches a live context).
  // Runtime mutex held.
  std::vector<std::uint64_t> peers;
};

struct CUstream_st {
  static constexpr std::uint32_t kAlive = 0x57575757;
  CUctx_st* ctx = nullptr;
  unsigned flags = 0;
  int priority = 0;
  bool special = false;  // a context's legacy/null stream or a per-thread stream
  std::uint64_t id = 0;
  std::atomic<std::uint64_t> last_end_ns{0};
  std::atomic<std::uint64_t> last_ticket{0};  // realistic profile: newest scheduler ticket on this stream
  std::atomic<CUgraph_st*> capture{nullptr};  // graph being captured into, if any
  std::uint64_t capture_id = 0;
};

struct CUevent_st {
  static constexpr std::uint32_t kAlive = 0xE7E7E7E7;
  CUctx_st* ctx = nullptr;
  unsigned flags = 0;
  std::atomic<std::uint64_t> time_ns{0};  // completion time of the recorded work; 0 = never recorded
  std::atomic<std::uint64_t> ticket{0};   // realistic profile: the marker's ticket until time_ns is known
  std::uint32_t device = 0;
  gpuslice::fakecuda::SchedTarget where{};  // ... and where it was queued
};

struct CUmod_st;
struct CUfunc_st {
  static constexpr std::uint32_t kAlive = 0xF7F7F7F7;
  CUmod_st* module = nullptr;
  std::string name;
  std::uint64_t duration_ns = 0;  // kernel_duration_ns(name)
  int max_dynamic_shared = 0;
  // Deprecated execution control (cuFuncSetBlockShape / cuFuncSetSharedSize)
  // for cuLaunch / cuLaunchGrid[Async]: 0 until set, and a launch fails then.
  std::atomic<unsigned> legacy_block[3] = {0, 0, 0};
  std::atomic<unsigned> legacy_shared{0};
};

struct CUmod_st {
  static constexpr std::uint32_t kAlive = 0x30303030;
  CUctx_st* ctx = nullptr;  // nullptr for a library's module (context-independent)
  std::string image;
  bool opaque = false;  // holds compressed fatbin entries: every kernel name is accepted (image.cc)
  std::map<std::string, CUfunc_st*> functions;
  // Device memory the loaded image holds (globals + code, README "Modules").
  struct Global {
    std::uint64_t offset;
    std::uint64_t size;
  };
  std::map<std::string, Global> globals;
  std::uint64_t globals_bytes = 0;
  // A module's memory, charged on `device` (a library's module: unused, see below).
  std::atomic<bool> placed{false};
  std::uint32_t device = 0;
  std::uint64_t held = 0;
  CUdeviceptr globals_base = 0;
  // A library's module (ctx == nullptr) is loaded into each context that uses
  // it, at its first use there, and that copy goes with the context (NVIDIA's
  // context-independent loading, README "Modules"). Runtime mutex.
  struct Placement {
    CUctx_st* ctx;  // memory_owner() of the context it was used in
    std::uint32_t device;
    std::uint64_t held;
    CUdeviceptr globals_base;
  };
  std::vector<Placement> placements;
  // The id of a context holding a copy (0: none known): a launch checks it
  // without the lock; cleared when that context's copy goes.
  std::atomic<std::uint64_t> placed_ctx_id{0};
};

struct CUlib_st {
  static constexpr std::uint32_t kAlive = 0x1B1B1B1B;
  CUmod_st* module = nullptr;
};

namespace gpuslice::fakecuda {

// Owns every object of one handle type for the life of the process.
//
// A handle's validity is a word beside the object, not in it: alive() reads
// it without a lock (the launch path, and any thread holding a stale handle
// while another destroys it and a third creates a new object at the same
// address, which a real driver does too). Recycling destroys and re-creates
// only the object; the word itself is never destroyed, re-constructed or
// written other than atomically, so a concurrent alive() reads either "dead"
// or, once the new object is complete (release/acquire), "alive" — never a
// half-built object (ThreadSanitizer found the former placement-new of the
// whole object, word included, racing with alive()).
template <typename T>
struct HandleCell {
  std::atomic<std::uint32_t> magic{0};  // T::kAlive while the object is live
  alignas(T) unsigned char storage[sizeof(T)];
};

template <typename T>
class HandlePool {
 public:
  T* make() {
    HandleCell<T>* cell;
    if (!free_.empty()) {
      cell = free_.back();
      free_.pop_back();
      std::launder(reinterpret_cast<T*>(cell->storage))->~T();
    } else {
      all_.push_back(std::make_unique<HandleCell<T>>());
      cell = all_.back().get();
    }
    T* object = new (cell->storage) T();
    cell->magic.store(T::kAlive, std::memory_order_release);
    return object;
  }
  void retire(T* object) {
    HandleCell<T>* cell = cell_of(object);
    cell->magic.store(0, std::memory_order_release);
    free_.push_back(cell);
  }
  template <typename Visit>
  void for_each_live(Visit&& visit) {
    for (auto& cell : all_) {
      if (cell->magic.load(std::memory_order_relaxed) == T::kAlive)
        visit(std::launder(reinterpret_cast<T*>(cell->storage)));
    }
  }
  // Every cell holds a constructed object (retire only marks it dead).
  ~HandlePool() {
    for (auto& cell : all_) std::launder(reinterpret_cast<T*>(cell->storage))->~T();
  }

  static HandleCell<T>* cell_of(const T* object) {
    return reinterpret_cast<HandleCell<T>*>(
        const_cast<unsigned char*>(reinterpret_cast<const unsigned char*>(object) - offsetof(HandleCell<T>, storage)));
  }

 private:
  std::vector<std::unique_ptr<HandleCell<T>>> all_;
  std::vector<HandleCell<T>*> free_;
};

template <typename T>
inline bool alive(const T* object) {
  return object != nullptr && HandlePool<T>::cell_of(object)->magic.load(std::memory_order_acquire) == T::kAlive;
}

enum class InitState : int { none = 0, ok = 1, failed = 2, forked = 3, deinitialized = 4 };

// The registry lock: glibc's adaptive mutex, which spins a little before it
// sleeps. A driver's calls hold it for well under a microsecond; with
// std::mutex (no spin) a program's 32 threads on 2 cores queued on it in the
// kernel (a futex wait and wake per call: 68% of such a run's CPU time in
// futex calls, the simulated pair 12-28x its one-thread cost).
class RegistryMutex {
 public:
  // Constant-initialised, like the std::mutex it replaces: usable from any
  // constructor, never destroyed under a thread still running at exit.
  constexpr RegistryMutex() noexcept = default;
  RegistryMutex(const RegistryMutex&) = delete;
  RegistryMutex& operator=(const RegistryMutex&) = delete;
  void lock() noexcept { pthread_mutex_lock(&m_); }
  void unlock() noexcept { pthread_mutex_unlock(&m_); }
  bool try_lock() noexcept { return pthread_mutex_trylock(&m_) == 0; }

 private:
  pthread_mutex_t m_ = PTHREAD_ADAPTIVE_MUTEX_INITIALIZER_NP;
};

struct Runtime {
  RegistryMutex mu;  // guards every process-local registry below and in the modules
  std::atomic<int> init_state{0};
  std::atomic<bool> initializing{false};  // a cuInit is running (under mu)
  CUresult init_result = CUDA_SUCCESS;
  State* state = nullptr;
  int slot = -1;
  Submitter submitter{-1, 0, 0};
  std::uint64_t next_object_id = 1;
  HandlePool<CUctx_st> contexts;
  HandlePool<CUstream_st> streams;
  HandlePool<CUevent_st> events;
  CUctx_st* primary[kMaxDevices] = {};  // by this process's ordinal
  // CUDA_VISIBLE_DEVICES at cuInit: this process's ordinal -> the state's
  // (physical) device index. Every CUdevice the API takes or returns is an
  // ordinal; everything in the state (and ctx->device) is physical.
  std::uint32_t visible[kMaxDevices] = {};
  std::uint32_t visible_count = 0;
  char state_path[1024] = {};
};

Runtime& runtime();

// Every entry point starts here: the chaos mode's and the monitor's entry
// probe (chaos.h; one predictable branch when off).
inline bool initialized(const char* call = __builtin_FUNCTION()) {
  probe_entry(call);
  return runtime().init_state.load(std::memory_order_acquire) == static_cast<int>(InitState::ok);
}
// What an entry point returns when the driver is not usable: after the
// driver's exit-time teardown, CUDA_ERROR_DEINITIALIZED ("driver shutting down").
inline CUresult uninitialized_error() {
  return runtime().init_state.load(std::memory_order_acquire) == static_cast<int>(InitState::deinitialized)
             ? CUDA_ERROR_DEINITIALIZED
             : CUDA_ERROR_NOT_INITIALIZED;
}
inline State& state() { return *runtime().state; }
inline bool valid_device(CUdevice dev) { return dev >= 0 && static_cast<std::uint32_t>(dev) < runtime().visible_count; }
// A valid ordinal's physical device, and back (-1: not visible to this process).
inline std::uint32_t physical_device(CUdevice dev) { return runtime().visible[dev]; }
inline CUdevice device_ordinal(std::uint32_t physical) {
  for (std::uint32_t i = 0; i < runtime().visible_count; ++i)
    if (runtime().visible[i] == physical) return static_cast<CUdevice>(i);
  return -1;
}

// --- contexts (context.cc) ---
// The calling thread's current context, or an error: INVALID_CONTEXT when none,
// CONTEXT_IS_DESTROYED when it was destroyed (e.g. by another thread).
CUresult current_context(CUctx_st** out);
// Validates a context argument; nullptr means "the current one".
CUresult resolve_context(CUcontext ctx, CUctx_st** out);
// The context that owns what `ctx` allocates: a green context's primary one.
inline CUctx_st* memory_owner(CUctx_st* ctx) { return ctx != nullptr && ctx->base != nullptr ? ctx->base : ctx; }
// cuDevicePrimaryCtxRetain / Release without going through the exported entry
// points (green.cc retains the primary context as the driver documents).
CUresult primary_retain(CUdevice dev, CUctx_st** out);
CUresult primary_release(CUdevice dev, bool reset);
// A new legacy (null) stream of `ctx`. Runtime mutex held.
CUstream_st* make_null_stream_locked(CUctx_st* ctx);
// Waits until every launch submitted in `ctx` has run.
void context_wait_idle(CUctx_st* ctx);

// --- memory bookkeeping (memory.cc) ---
// Charges `bytes` of device `dev` to this process if the device has room
// (reaping dead processes first); CUDA_ERROR_OUT_OF_MEMORY otherwise.
// managed: managed memory, counted on the device but outside cgroup limits.
CUresult charge_device(std::uint32_t dev, std::uint64_t bytes, bool managed = false);
void uncharge_device(std::uint32_t dev, std::uint64_t bytes, bool managed = false);
// A device address range of `bytes`: a freed one that fits, else a fresh one.
CUdeviceptr reserve_address(std::uint32_t dev, std::uint64_t bytes, std::uint64_t alignment);
// Frees a context's linear allocations (the real driver frees everything a
// context owns when it is destroyed). Runtime mutex held.
void memory_release_context_locked(CUctx_st* ctx);
void arrays_release_context_locked(CUctx_st* ctx);
void modules_release_context_locked(CUctx_st* ctx);

enum class AllocKind { linear, pitch, managed, legacy32, pool };
// One linear allocation, keyed by its base address in memory.cc's map.
struct Allocation {
  std::uint64_t size = 0;  // what the caller asked for (pitch: pitch * height)
  std::uint64_t held = 0;  // bytes charged to the device (0 for pool allocations: the pool's reserve is)
  std::uint32_t device = 0;
  CUctx_st* ctx = nullptr;
  AllocKind kind = AllocKind::linear;
  CUmemPoolHandle_st* pool = nullptr;
  // The allocation's bytes (bytes.cc): an anonymous MAP_NORESERVE mapping of
  // `size` bytes made at first access (managed: at allocation, and its base is
  // this host address), so untouched memory costs nothing.
  void* host = nullptr;
  std::uint64_t buffer_id = 0;
};
// The objects of this process holding device memory, one line each (the
// chaos monitor's reports: fakecuda_holdings). Runtime mutex held.
void holdings_allocations_locked(std::string* out);
void holdings_modules_locked(std::string* out);
void holdings_arrays_locked(std::string* out);
void holdings_pools_locked(std::string* out);
// Runtime mutex held for all of these.
void register_allocation_locked(CUdeviceptr base, const Allocation& allocation);
bool remove_allocation_locked(CUdeviceptr base, Allocation* out);
// The live allocation containing ptr (base and a reference to it), if any.
Allocation* find_allocation_locked(CUdeviceptr ptr, CUdeviceptr* base);
// Reserves and maps `bytes` of host memory for a managed allocation at an
// address below every device window (bytes.cc); nullptr when none is left.
void* managed_map(std::uint64_t bytes);
// Drops an allocation's bytes (its mapping), when it is freed (bytes.cc).
void release_bytes(const Allocation& allocation);
// Pinned/registered host memory (hostmem.cc): the range containing p, if any.
bool host_range_find_locked(const void* p, std::uintptr_t* base, std::uint64_t* size, unsigned* flags,
                            bool* registered);
// Gives a freed pool allocation's bytes back to its pool (pools.cc).
void pool_return_locked(CUmemPoolHandle_st* pool, std::uint64_t size);
// The VMM mapping containing ptr, if any (vmm.cc).
bool vmm_find_mapping_locked(CUdeviceptr ptr, CUdeviceptr* base, std::uint64_t* size);
// The bytes behind [ptr, ptr+len) of a VMM mapping (the physical allocation's,
// shared by every mapping of it); NOT_FOUND when ptr is not mapped,
// INVALID_VALUE when the range leaves the mapping (vmm.cc).
CUresult vmm_bytes_locked(CUdeviceptr ptr, std::uint64_t len, unsigned char** out);
// A synchronisation observed the stream-ordered frees of `stream` (nullptr:
// of every stream) on `dev`: a trim may release them (pools.cc).
void pools_observe_frees(std::uint32_t dev, const void* stream);
// Synchronisation points let every pool of the device trim to its release threshold.
void pools_trim_at_sync(std::uint32_t dev);

// --- module images (image.cc) ---
// The bytes of an image (PTX text, cubin, fatbin or fatbin wrapper), sized
// from its headers; INVALID_IMAGE when it is none of these, INVALID_VALUE when
// FAKECUDA_KERNEL_US is malformed. `limit`: how many bytes the caller has
// (a file's size, cuLinkAddData's size); a binary image claiming more is invalid.
CUresult read_image(const void* image, std::string* bytes, bool* opaque, std::uint64_t limit = ~std::uint64_t{0});
// Appends an entry (kind 1 PTX, 2 cubin/other) to a fatbin being built (the linker's output).
void fatbin_append_entry(std::string* out, std::uint16_t kind, const std::string& payload, bool opaque);
// Simulated run time of a kernel: spin_<N>us = N us, else FAKECUDA_KERNEL_US.
std::uint64_t kernel_duration_ns(const std::string& name);

// --- streams (stream.cc) ---
// Resolves a stream argument (0, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD or a
// handle) against the current context. per_thread_default: the _ptsz entry point.
CUresult resolve_stream(CUstream stream, bool per_thread_default, CUstream_st** out);
void streams_release_context_locked(CUctx_st* ctx);
// Sleeps (CLOCK_MONOTONIC, absolute) until `end_ns`.
void sleep_until(std::uint64_t end_ns);
// Records work ending at end_ns on a stream and its context.
void note_stream_work(CUstream_st* stream, std::uint64_t end_ns);
// Waits until the work submitted to the stream so far has run (no pool trimming:
// not a synchronisation point of the API, e.g. before a synchronous copy).
void stream_wait_idle(CUstream_st* stream);

// --- launch (launch.cc) and graphs (graph.cc) ---
CUresult launch_on_stream(CUfunc_st* function, CUstream_st* stream, std::uint64_t blocks);

// --- the realistic profile's scheduler, driver side (scheduler_driver.cc) ---
inline bool realistic() { return sched_enabled(runtime().state->header()); }
// Queues a kernel (blocking while the stream's hardware queue is full).
CUresult sched_launch(CUstream_st* stream, std::uint64_t duration_ns, std::uint64_t blocks);
void sched_stream_wait(CUstream_st* stream);
void sched_context_wait(CUctx_st* ctx);
// What synchronising a stream waits for, copied with the runtime mutex held:
// once it is dropped another thread's cuDevicePrimaryCtxReset may retire the
// stream and a create recycle its cell. The legacy stream waits for its context.
struct SchedWait {
  std::uint32_t device;
  bool legacy;
  std::uint64_t key;    // the stream's scheduler key (legacy: its context's)
  std::uint64_t up_to;  // newest ticket submitted before the call
};
SchedWait sched_wait_of_locked(const CUstream_st* stream);
bool sched_wait_done(const SchedWait& wait);
void sched_wait(const SchedWait& wait);
// Events are zero-length markers; a stream wait is a zero-length entry that waits on one.
void sched_event_record(CUevent_st* event, CUstream_st* stream);
bool sched_event_done(CUevent_st* event);  // also resolves event->time_ns
void sched_event_wait(CUevent_st* event);
void sched_stream_wait_event(CUstream_st* stream, CUevent_st* event);
CUresult capture_kernel_node(CUstream_st* stream, const CUDA_KERNEL_NODE_PARAMS& params);
// A CUfunction or a CUkernel (which is the same object here).
CUfunc_st* function_from_handle(CUfunction f);
// A launch of a CUkernel whose library is not placed in the launch's context
// (memory_owner(ctx)) yet places it there (module.cc): OUT_OF_MEMORY when the
// device cannot hold it.
CUresult place_library_at_launch(CUfunc_st* function, CUctx_st* ctx);
// Whether a launch in `ctx` may skip place_library_at_launch (no lock).
inline bool library_placed_in(const CUmod_st* module, const CUctx_st* ctx) {
  const CUctx_st* owner = ctx->base != nullptr ? ctx->base : ctx;
  return module->placed_ctx_id.load(std::memory_order_acquire) == owner->id;
}

std::uint64_t next_object_id_locked();

// A test knob of microseconds (README, "Test knobs") from the environment
// variable `name`: 0 when unset or empty; a value that is not 0 to 10000000
// is reported on stderr and read as 0 (pools.cc).
unsigned delay_knob(const char* name);

}  // namespace gpuslice::fakecuda
