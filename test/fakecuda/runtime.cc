// Driver initialisation, version, fork handling and the process's runtime.
#include <pthread.h>

#include <cstdio>
#include <cstdlib>
#include <new>

#include "driver.h"

namespace gpuslice::fakecuda {

Runtime& runtime() {
  // Never destroyed: other threads may still call in while the process exits.
  static Runtime* instance = new Runtime();
  return *instance;
}

std::uint64_t next_object_id_locked() { return runtime().next_object_id++; }

namespace {

void after_fork_in_child() {
  Runtime& r = runtime();
  // The real driver cannot be used in a child forked after cuInit. The child
  // keeps the parent's state-file descriptor (unused) until exec or exit, as
  // it keeps the real driver's device files: a parent SIGKILLed meanwhile
  // keeps its device memory until then.
  if (r.state != nullptr) r.state->forget_fd_after_fork();
  // The child has one thread: a lock another parent thread held at fork (a
  // cuInit in progress holds it throughout) would never be released. A child
  // forked during the parent's cuInit is a child of an initialising driver:
  // like one forked after cuInit, it cannot use the parent's CUDA state.
  new (&r.mu) RegistryMutex();
  if (r.init_state.load(std::memory_order_relaxed) == static_cast<int>(InitState::ok) ||
      r.initializing.load(std::memory_order_relaxed)) {
    r.initializing.store(false, std::memory_order_relaxed);
    r.init_state.store(static_cast<int>(InitState::forked), std::memory_order_release);
  }
}

[[gnu::constructor]] void register_fork_handler() { pthread_atfork(nullptr, nullptr, after_fork_in_child); }

// The driver's exit-time teardown, registered with atexit by cuInit (so it runs
// after atexit handlers registered later, before every ELF destructor) and also
// run if the library is unloaded: the process's memory is freed and its queued
// kernels are discarded, as when a real process exits; calls made afterwards
// (from destructors, other libraries' exit paths) return
// CUDA_ERROR_DEINITIALIZED ("driver shutting down") instead of crashing.
[[gnu::destructor]] void driver_teardown() {
  Runtime& r = runtime();
  int expected = static_cast<int>(InitState::ok);
  if (!r.init_state.compare_exchange_strong(expected, static_cast<int>(InitState::deinitialized),
                                            std::memory_order_acq_rel)) {
    return;
  }
  if (r.state != nullptr) r.state->release_slot(r.slot);
}

CUresult fail_init(Runtime& r, CUresult result) {
  r.init_result = result;
  r.init_state.store(static_cast<int>(InitState::failed), std::memory_order_release);
  return result;
}

}  // namespace

}  // namespace gpuslice::fakecuda

using namespace gpuslice::fakecuda;

extern "C" CUresult cuInit(unsigned int Flags) {
  if (Flags != 0) return CUDA_ERROR_INVALID_VALUE;
  Runtime& r = runtime();
  auto current = static_cast<InitState>(r.init_state.load(std::memory_order_acquire));
  if (current == InitState::ok) return CUDA_SUCCESS;
  if (current == InitState::forked) return CUDA_ERROR_NOT_INITIALIZED;
  if (current == InitState::deinitialized) return CUDA_ERROR_DEINITIALIZED;
  std::lock_guard guard(r.mu);
  current = static_cast<InitState>(r.init_state.load(std::memory_order_acquire));
  if (current == InitState::ok) return CUDA_SUCCESS;
  if (current != InitState::none) return current == InitState::failed ? r.init_result : uninitialized_error();
  struct Initializing {
    std::atomic<bool>& flag;
    explicit Initializing(std::atomic<bool>& f) : flag(f) { flag.store(true, std::memory_order_relaxed); }
    ~Initializing() { flag.store(false, std::memory_order_relaxed); }
  } initializing(r.initializing);

  Config config;
  char error[1400];
  if (!parse_config(config, error, sizeof(error))) {
    std::fprintf(stderr, "fakecuda: %s\n", error);
    return fail_init(r, CUDA_ERROR_INVALID_VALUE);
  }
  if (!probes_configure(config.state_path, error, sizeof(error))) {
    std::fprintf(stderr, "fakecuda: %s\n", error);
    return fail_init(r, CUDA_ERROR_INVALID_VALUE);
  }
  State* state = State::open_or_create(config, error, sizeof(error));
  if (state == nullptr) {
    std::fprintf(stderr, "%s\n", error);
    return fail_init(r, CUDA_ERROR_OPERATING_SYSTEM);
  }
  r.visible_count =
      parse_visible_devices(std::getenv("CUDA_VISIBLE_DEVICES"), state->header(), state->device_count(), r.visible);
  if (r.visible_count == 0) {  // none configured, or none named by CUDA_VISIBLE_DEVICES
    delete state;
    return fail_init(r, CUDA_ERROR_NO_DEVICE);
  }
  ProcessIdentity id = current_process_identity();
  int slot = -1;
  {
    State::Lock lock(*state);
    if (lock.ok()) slot = state->claim_slot_locked(id.pid, id.host_pid, id.start_time, id.pidns_inode, id.cgroup_ino);
  }
  if (slot < 0) {
    std::fprintf(stderr, "fakecuda: no free process slot in %s (%u in use)\n", config.state_path, kMaxSlots);
    delete state;
    return fail_init(r, CUDA_ERROR_OPERATING_SYSTEM);
  }
  r.state = state;
  std::snprintf(r.state_path, sizeof(r.state_path), "%s", config.state_path);
  r.slot = slot;
  r.submitter = Submitter{slot, id.pid, id.host_pid};
  std::atexit(driver_teardown);
  probes_attach(state, slot);
  r.init_state.store(static_cast<int>(InitState::ok), std::memory_order_release);
  return CUDA_SUCCESS;
}

extern "C" CUresult cuDriverGetVersion(int* driverVersion) {
  if (driverVersion == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *driverVersion = kDriverVersion;
  return CUDA_SUCCESS;
}

// Private tables of the real driver (used by libcudart): not simulated, which is
// why the real runtime cannot run on the fake.
extern "C" CUresult cuGetExportTable(const void** ppExportTable, const CUuuid* pExportTableId) {
  if (ppExportTable == nullptr || pExportTableId == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *ppExportTable = nullptr;
  return CUDA_ERROR_NOT_SUPPORTED;
}
