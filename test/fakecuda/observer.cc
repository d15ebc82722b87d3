// The simulator's test probes at cuInit and at every change of device memory
// (chaos.h): chaos mode (chaos.cc) and one registered observer
// (fakecuda_query.h, "Observers"), such as the chaos suite's invariant
// monitor (test/chaos/monitor.cc), with the ground truth it reads. The
// simulator includes nothing of any observer: it calls it through the table
// it registered and answers its queries from the state file.
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "chaos.h"
#include "driver.h"
#include "fakecuda_query.h"

namespace gpuslice::fakecuda {

static_assert(FAKECUDA_MAX_DEVICES == kMaxDevices && FAKECUDA_MAX_SLOTS == kMaxSlots,
              "fakecuda_query.h states the machine's limits");

namespace {

std::atomic<const fakecuda_observer*> g_observer{nullptr};
bool g_observed = false;  // the observer asked for events (attach)
State* g_state = nullptr;
int g_slot = -1;

void on_charge(State&, int slot, std::uint32_t dev, std::uint64_t bytes, bool context) {
  const char* call = last_call();
  ring_record(context ? OpKind::context_charge : OpKind::charge, call, dev, bytes);
  if (g_observed) g_observer.load(std::memory_order_relaxed)->charged(slot, dev, bytes, context, call, previous_call());
  chaos_point(call);
}

void on_uncharge(State&, int slot, std::uint32_t dev, std::uint64_t bytes, bool context) {
  const char* call = last_call();
  ring_record(context ? OpKind::context_uncharge : OpKind::uncharge, call, dev, bytes);
  if (g_observed) g_observer.load(std::memory_order_relaxed)->uncharged(slot, dev, bytes, context, call);
  chaos_point(call);
}

}  // namespace

bool probes_configure(const char* state_path, char* error, std::size_t len) {
  ChaosConfig chaos;
  if (!chaos_configure(chaos, error, len)) return false;
  const fakecuda_observer* observer = g_observer.load(std::memory_order_acquire);
  if (observer != nullptr) return observer->configure == nullptr || observer->configure(state_path, error, len) == 0;
  // The invariant monitor is an observer (test/chaos/monitor.cc): asked for
  // in a program that does not link it, it would silently check nothing.
  const char* monitor = std::getenv("FAKECUDA_MONITOR");
  if (monitor != nullptr && monitor[0] != '\0' && std::strcmp(monitor, "0") != 0) {
    std::snprintf(error, len,
                  "FAKECUDA_MONITOR='%s': this program registers no invariant monitor (link test/chaos's "
                  "chaos_monitor)",
                  monitor);
    return false;
  }
  return true;
}

void probes_attach(State* state, int slot) {
  g_state = state;
  g_slot = slot;
  const fakecuda_observer* observer = g_observer.load(std::memory_order_acquire);
  g_observed = observer != nullptr && observer->attach != nullptr &&
               observer->attach(slot, state->device_count()) != 0 && observer->charged != nullptr &&
               observer->uncharged != nullptr;
  if (g_observed || chaos_on()) {
    g_charge_probe.store(on_charge, std::memory_order_release);
    g_uncharge_probe.store(on_uncharge, std::memory_order_release);
    g_probes_on.store(true, std::memory_order_release);
  }
}

}  // namespace gpuslice::fakecuda

using namespace gpuslice::fakecuda;

// The observer's queries read the runtime directly: unlike the driver's entry
// points (initialized()), they record no operation and add no chaos point.
namespace {

bool ready() { return runtime().init_state.load(std::memory_order_acquire) == static_cast<int>(InitState::ok); }

}  // namespace

extern "C" int fakecuda_set_observer(const fakecuda_observer* observer) {
  if (observer == nullptr) return -1;
  Runtime& r = runtime();
  std::lock_guard guard(r.mu);  // cuInit holds it from start to end
  if (r.init_state.load(std::memory_order_acquire) != static_cast<int>(InitState::none)) return -1;
  const fakecuda_observer* none = nullptr;
  return g_observer.compare_exchange_strong(none, observer, std::memory_order_acq_rel) ? 0 : -1;
}

extern "C" int fakecuda_initialized(void) { return ready() ? 1 : 0; }

extern "C" int fakecuda_state_lock(void) { return g_state != nullptr && g_state->lock() ? 1 : 0; }

extern "C" void fakecuda_state_unlock(void) {
  if (g_state != nullptr) g_state->unlock();
}

extern "C" int fakecuda_reap_locked(void) { return g_state != nullptr ? g_state->reap_locked(g_slot) : 0; }

extern "C" int fakecuda_slots_high_locked(void) { return g_state != nullptr ? g_state->slots_high() : 0; }

extern "C" int fakecuda_slot_info_get(int slot, unsigned dev, fakecuda_slot_info* out) {
  if (g_state == nullptr || out == nullptr || slot < 0 || slot >= static_cast<int>(kMaxSlots) ||
      dev >= g_state->device_count()) {
    return 0;
  }
  const ProcSlot& s = g_state->header().slot[slot];
  out->claimed = s.state.load(std::memory_order_acquire) == 1 ? 1 : 0;
  out->generation = s.generation.load(std::memory_order_relaxed);
  out->pid = s.pid.load(std::memory_order_relaxed);
  out->held_bytes =
      s.alloc_bytes[dev].load(std::memory_order_relaxed) + s.context_bytes[dev].load(std::memory_order_relaxed);
  return 1;
}

extern "C" int fakecuda_slot_alive(int slot) {
  if (g_state == nullptr || slot < 0 || slot >= static_cast<int>(kMaxSlots)) return 1;
  return g_state->slot_alive(slot) ? 1 : 0;
}

extern "C" int fakecuda_device_uuid(int dev, unsigned char out[16]) {
  if (g_state == nullptr || out == nullptr || dev < 0 || static_cast<std::uint32_t>(dev) >= g_state->device_count())
    return 0;
  device_uuid(g_state->header(), static_cast<std::uint32_t>(dev), out);
  return 1;
}

extern "C" uint64_t fakecuda_chaos_seed(void) { return chaos_config().seed; }

extern "C" uint64_t fakecuda_chaos_stream(void) { return chaos_config().stream; }

extern "C" uint32_t fakecuda_thread_ordinal(void) { return chaos_thread_ordinal(); }

extern "C" uint64_t fakecuda_call_began_ns(void) { return call_began_ns(); }

extern "C" void fakecuda_recent_operations(char* out, size_t len, int count) {
  if (out == nullptr || len == 0) return;
  ring_format(out, len, count);
}

extern "C" void fakecuda_holdings(char* out, size_t len) {
  if (out == nullptr || len == 0) return;
  out[0] = '\0';
  Runtime& r = runtime();
  // try_lock: the registries' lock is taken before the state lock elsewhere.
  if (!r.mu.try_lock()) {
    std::snprintf(out, len, "    (busy)\n");
    return;
  }
  std::string text;
  char line[160];
  r.contexts.for_each_live([&](CUctx_st* c) {
    if (c->primary && c->retain_count == 0) return;  // not active: holds nothing
    std::snprintf(line, sizeof(line), "    context %p id %llu%s dev%u\n", static_cast<void*>(c),
                  static_cast<unsigned long long>(c->id), c->primary ? " (primary)" : "", c->device);
    text += line;
  });
  holdings_allocations_locked(&text);
  holdings_modules_locked(&text);
  holdings_arrays_locked(&text);
  holdings_pools_locked(&text);
  r.mu.unlock();
  std::snprintf(out, len, "%s", text.c_str());
}
