// A worker process of the torture container: its threads perform the seed's
// mix of operations of the enabled classes on device 0, holding at most a
// few resources each, ignoring refusals (a refusal at the quota is expected:
// the monitor judges the device, not the return codes), and release
// everything before a clean exit. Every result is legal; only a crash, a hang
// or a monitor violation fails a schedule.
#include <cuda.h>
#include <dirent.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "fakecuda_query.h"
#include "monitor.h"
#include "torture.h"

namespace gpuslice::chaos {
namespace {

constexpr std::size_t kMi = std::size_t{1} << 20;
constexpr std::size_t kMaxHeld = 12;

enum class Kind { linear, pool_ptr, vmm, array, mipmap, ctx, primary_ref, module, library, ipc_open, ext };

struct Held {
  Kind kind;
  CUdeviceptr ptr = 0;
  std::size_t size = 0;
  CUstream stream = nullptr;
  CUmemGenericAllocationHandle handle = 0;
  CUarray array = nullptr;
  CUmipmappedArray mipmap = nullptr;
  CUcontext ctx = nullptr;
  CUmodule module = nullptr;
  CUlibrary library = nullptr;
  CUexternalMemory ext = nullptr;  // interop: the import (ptr: its mapped buffer, or 0)
  std::uint64_t graphics = 0;      // interop: the graphics allocation
  std::vector<int> absorbed;       // measured objects: outside allocations during their creation (Absorbed)
};

// Memory allocated outside CUDA (interop's graphics allocations) while this
// process creates an object gpuslice measures (NVML usage after minus before
// the call: contexts, modules, libraries, arrays, the primary context) is
// counted in that object until it is destroyed, and once imported a second
// time: a documented transient (monitor_absorbed, monitor.h). Memory freed
// outside CUDA (a graphics free that takes its memory off the device) during
// such a creation leaves that object counted short by it until it is
// destroyed (monitor_measured_short). Each graphics allocation or free is an
// event; an event counts while a measured object whose creation overlapped
// it lives (or a measured call overlapping it is in flight): the bytes are in
// at most one of them, gone when all are.
class Absorbed {
 public:
  explicit Absorbed(CUdevice& dev) : dev_(dev) {}
  std::uint64_t measured_begin() {
    std::lock_guard<std::mutex> g(mu_);
    const std::uint64_t token = ++next_;
    std::vector<int>& events = measuring_[token];
    for (int e : graphics_) attach(e, &events);
    return token;
  }
  // The measured call returned: its events go to `into` (the object made),
  // or are dropped (nothing made).
  void measured_end(std::uint64_t token, std::vector<int>* into) {
    std::lock_guard<std::mutex> g(mu_);
    auto it = measuring_.find(token);
    if (it == measuring_.end()) return;
    if (into != nullptr) {
      into->insert(into->end(), it->second.begin(), it->second.end());
    } else {
      drop_locked(it->second);
    }
    measuring_.erase(it);
    publish_locked();
  }
  // freed: a graphics free that takes `bytes` off the device.
  int graphics_begin(std::uint64_t bytes, bool freed = false) {
    std::lock_guard<std::mutex> g(mu_);
    const int e = static_cast<int>(events_.size());
    events_.push_back({bytes, 0, freed});
    graphics_.push_back(e);
    for (auto& [token, events] : measuring_) attach(e, &events);
    publish_locked();
    return e;
  }
  void graphics_end(int e) {
    std::lock_guard<std::mutex> g(mu_);
    graphics_.erase(std::find(graphics_.begin(), graphics_.end(), e));
  }
  // The object that held `events` was destroyed.
  void destroyed(std::vector<int>& events) {
    std::lock_guard<std::mutex> g(mu_);
    drop_locked(events);
    publish_locked();
  }
  std::vector<int> primary;  // the primary context's (dropped at its reset); guarded by the callers' order

 private:
  struct Event {
    std::uint64_t bytes;
    int refs;
    bool freed;  // a graphics free (else an allocation)
  };
  void attach(int e, std::vector<int>* to) {
    to->push_back(e);
    ++events_[static_cast<std::size_t>(e)].refs;
  }
  void drop_locked(std::vector<int>& events) {
    for (int e : events) --events_[static_cast<std::size_t>(e)].refs;
    events.clear();
  }
  void publish_locked() {
    std::uint64_t total = 0, freed = 0;
    for (const Event& ev : events_) {
      if (ev.refs > 0) (ev.freed ? freed : total) += ev.bytes;
    }
    monitor_absorbed(static_cast<unsigned>(dev_), total);
    monitor_measured_short(static_cast<unsigned>(dev_), freed);
  }
  CUdevice& dev_;
  std::mutex mu_;
  std::uint64_t next_ = 0;
  std::map<std::uint64_t, std::vector<int>> measuring_;
  std::vector<int> graphics_;  // graphics allocations in flight
  std::vector<Event> events_;
};

// A call of the program through gpuslice, or an operation made of such
// calls (monitor_call_begin/end): what the driver grants inside it may stay
// uncounted until it returns, and no longer (FAKECUDA_MONITOR_CALLS=1).
struct InCall {
  InCall() { monitor_call_begin(); }
  ~InCall() { monitor_call_end(); }
  InCall(const InCall&) = delete;
  InCall& operator=(const InCall&) = delete;
};

// All threads of the worker meet every kCheckpointEvery operations; the last
// to arrive, with every other thread parked, asks the monitor for its exact
// per-process check (monitor_checkpoint, monitor.h).
constexpr int kCheckpointEvery = 40;
class Barrier {
 public:
  explicit Barrier(int n) : n_(n) {}
  void arrive_and_check() {
    std::unique_lock<std::mutex> lock(mu_);
    const unsigned long gen = generation_;
    if (++arrived_ == n_) {
      if (monitor_checkpoint() > 0) violations_.fetch_add(1);
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return;
    }
    cv_.wait(lock, [&] { return generation_ != gen; });
  }
  static std::atomic<int> violations_;

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int n_;
  int arrived_ = 0;
  unsigned long generation_ = 0;
};
std::atomic<int> Barrier::violations_{0};

struct Shared {
  explicit Shared(int threads) : barrier(threads) {}
  Barrier barrier;
  CUdevice dev = 0;
  CUcontext primary = nullptr;
  std::mutex mu;                    // guards pools
  std::vector<CUmemoryPool> pools;  // created pools (setpool and from-pool allocations)
  CUmemoryPool default_pool = nullptr;
  bool pool_allocs = false;  // the "pool" class: allocations from pools (monitor_pools)
  Absorbed absorbed{dev};
  std::mutex primary_mu;  // Absorbed::primary
};

std::string image_with_global(std::size_t bytes, unsigned tag) {
  char text[256];
  std::snprintf(text, sizeof(text),
                ".version 8.0\n.target sm_90\n.address_size 64\n.global .align 8 .b8 torture_g%u[%zu];\n"
                ".visible .entry torture_k%u() { ret; }\n",
                tag, bytes, tag);
  return text;
}

class Worker {
 public:
  Worker(Shared& shared, const WorkerOptions& options, int thread, const char* self)
      : s_(shared), o_(options), rng_(options.seed * 1000003 + options.index * 101 + thread), self_(self) {
    // Threads that hold little leave headroom, so their processes take large
    // quota leases (spare): what a lowered quota must still bound.
    max_held_ = 1 + rng_.below(kMaxHeld);
    // "lease": every thread holds one or two small allocations, so the
    // container stays far below the quota and each process keeps a large
    // spare lease when the launcher lowers the quota ("smi").
    for (const std::string& c : options.classes) {
      if (c == "lease") max_held_ = 1 + rng_.below(2);
    }
  }

  // The program's view for the monitor's checkpoint reports (monitor_describer).
  void describe(std::string* out) const {
    static const char* const kKinds[] = {"linear",      "pool_ptr", "vmm",     "array",    "mipmap", "ctx",
                                         "primary_ref", "module",   "library", "ipc_open", "ext"};
    char line[200];
    for (const Held& h : held_) {
      const void* handle = h.array != nullptr    ? static_cast<const void*>(h.array)
                           : h.mipmap != nullptr ? static_cast<const void*>(h.mipmap)
                           : h.ctx != nullptr    ? static_cast<const void*>(h.ctx)
                           : h.module != nullptr ? static_cast<const void*>(h.module)
                                                 : static_cast<const void*>(h.library);
      std::snprintf(line, sizeof(line), "    t%d %s 0x%llx size %zu handle %p\n", ordinal_,
                    kKinds[static_cast<int>(h.kind)], static_cast<unsigned long long>(h.ptr), h.size, handle);
      *out += line;
    }
  }

  void run() {
    ordinal_ = static_cast<int>(fakecuda_thread_ordinal());
    {
      InCall call;
      cuCtxSetCurrent(s_.primary);
      cuStreamCreate(&stream_, CU_STREAM_NON_BLOCKING);
    }
    for (int i = 0; i < o_.ops; ++i) {
      if (i % kCheckpointEvery == kCheckpointEvery - 1) s_.barrier.arrive_and_check();
      if (held_.size() >= max_held_ || (!held_.empty() && rng_.chance(40))) {
        release_one();
        continue;
      }
      const std::string& c = o_.classes[rng_.below(o_.classes.size())];
      op(c);
    }
    while (!held_.empty()) release_one();
    InCall call;
    cuCtxSetCurrent(s_.primary);
    sync_stream(stream_);
    released(0, [&] { cuStreamDestroy(stream_); });
  }

 private:
  std::size_t size() { return (1 + rng_.below(16)) * kMi - rng_.below(2) * 4096; }

  // An explicit request of known size, reported to the monitor, which judges
  // a refusal against what the container holds (monitor_request_end).
  template <class Call>
  CUresult requested(std::size_t bytes, const char* what, Call call) {
    monitor_request_begin(static_cast<unsigned>(s_.dev), bytes);
    const CUresult rc = call();
    if (monitor_request_end(rc == CUDA_ERROR_OUT_OF_MEMORY, what) > 0) Barrier::violations_.fetch_add(1);
    return rc;
  }
  // A free the monitor must know of (monitor_release_begin): bytes 0 = unknown.
  template <class Call>
  void released(std::size_t bytes, Call call) {
    monitor_release_begin(static_cast<unsigned>(s_.dev), bytes);
    call();
    monitor_release_end();
  }
  // Synchronisation may trim pools (the device shrinks before gpuslice's
  // count): a free of unknown size when pools are in use.
  void sync_stream(CUstream stream) {
    released(0, [&] { cuStreamSynchronize(stream); });
  }
  CUresult alloc(CUdeviceptr* ptr, std::size_t bytes) {
    return requested(bytes, "cuMemAlloc", [&] { return cuMemAlloc(ptr, bytes); });
  }
  void hold(const Held& h) { held_.push_back(h); }

  void op(const std::string& c) {
    InCall call;
    const std::size_t before = held_.size();
    // Operations whose device memory the worker cannot size (implicit memory,
    // reserved before the call and settled to a measurement after it; pitch
    // estimated then settled; arrays sized by the driver): a refusal
    // overlapping one is not judged (monitor_release_begin with 0 bytes).
    // Interop: graphics memory the device holds before gpuslice counts its import.
    const bool unknown = c == "pitch" || c == "array" || c == "context" || c == "primary" || c == "module" ||
                         c == "library" || c == "interop";
    if (unknown) monitor_release_begin(static_cast<unsigned>(s_.dev), 0);
    // Objects gpuslice measures: what the program allocates outside CUDA
    // meanwhile is counted in them (Absorbed).
    const bool measured = c == "context" || c == "module" || c == "library" || c == "array" || c == "primary";
    const std::uint64_t token = measured ? s_.absorbed.measured_begin() : 0;
    op_inner(c);
    if (measured) {
      if (c == "primary") {  // the primary context lives until a reset (the worker keeps a reference)
        std::lock_guard<std::mutex> g(s_.primary_mu);
        s_.absorbed.measured_end(token, &s_.absorbed.primary);
      } else {
        s_.absorbed.measured_end(token, held_.size() > before ? &held_.back().absorbed : nullptr);
      }
    }
    if (unknown) monitor_release_end();
    if (held_.size() > before) ++granted_;
  }

  void op_inner(const std::string& c) {
    Held h;
    if (c == "alloc") {
      h.kind = Kind::linear;
      h.size = size();
      if (alloc(&h.ptr, h.size) == CUDA_SUCCESS) hold(h);
    } else if (c == "lease") {
      h.kind = Kind::linear;
      h.size = (1 + rng_.below(4)) * kMi;
      if (alloc(&h.ptr, h.size) == CUDA_SUCCESS) hold(h);
      usleep(500);  // long enough for the launcher's quota changes to land between operations
    } else if (c == "pitch") {
      h.kind = Kind::linear;
      std::size_t pitch = 0;
      const std::size_t width = 1000 + rng_.below(5000), height = 256 + rng_.below(2048);
      if (cuMemAllocPitch(&h.ptr, &pitch, width, height, 4) == CUDA_SUCCESS) {
        h.size = pitch * height;
        hold(h);
      }
    } else if (c == "managed") {
      h.kind = Kind::linear;
      const std::size_t bytes = h.size = size();
      if (requested(bytes, "cuMemAllocManaged",
                    [&] { return cuMemAllocManaged(&h.ptr, bytes, CU_MEM_ATTACH_GLOBAL); }) == CUDA_SUCCESS)
        hold(h);
    } else if (c == "pool") {
      h.kind = Kind::pool_ptr;
      h.stream = stream_;
      CUmemoryPool pool = pick_pool();
      const std::size_t bytes = size();
      const bool from_pool = pool != nullptr && rng_.chance(50);
      CUresult rc = requested(bytes, from_pool ? "cuMemAllocFromPoolAsync" : "cuMemAllocAsync", [&] {
        return from_pool ? cuMemAllocFromPoolAsync(&h.ptr, bytes, pool, stream_)
                         : cuMemAllocAsync(&h.ptr, bytes, stream_);
      });
      if (rc == CUDA_SUCCESS) hold(h);
      if (rng_.chance(30)) sync_stream(stream_);
    } else if (c == "trim") {
      CUmemoryPool pool = rng_.chance(50) ? s_.default_pool : pick_pool();
      if (pool != nullptr) released(0, [&] { cuMemPoolTrimTo(pool, rng_.below(3) * 2 * kMi); });
      if (rng_.chance(50)) released(0, [&] { cuCtxSynchronize(); });
    } else if (c == "setpool") {
      std::lock_guard<std::mutex> guard(s_.mu);
      if (s_.pools.size() < 3 && rng_.chance(30)) {
        CUmemPoolProps props{};
        props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
        props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        props.location.id = s_.dev;
        CUmemoryPool pool = nullptr;
        if (cuMemPoolCreate(&pool, &props) == CUDA_SUCCESS) {
          s_.pools.push_back(pool);
          if (s_.pool_allocs) monitor_pools(1 + static_cast<unsigned>(s_.pools.size()));
        }
      }
      CUmemoryPool next = s_.default_pool;
      if (!s_.pools.empty() && rng_.chance(70)) next = s_.pools[rng_.below(s_.pools.size())];
      cuDeviceSetMemPool(s_.dev, next);
    } else if (c == "vmm") {
      vmm_create();
    } else if (c == "array") {
      if (rng_.chance(70)) {
        CUDA_ARRAY3D_DESCRIPTOR d{};
        d.Width = 1024;
        d.Height = 256 * (1 + rng_.below(12));
        d.Depth = rng_.chance(50) ? 0 : 2;
        d.Format = CU_AD_FORMAT_FLOAT;
        d.NumChannels = 1;
        h.kind = Kind::array;
        if (cuArray3DCreate(&h.array, &d) == CUDA_SUCCESS) hold(h);
      } else {
        CUDA_ARRAY3D_DESCRIPTOR d{};
        d.Width = 1024;
        d.Height = 1024;
        d.Format = CU_AD_FORMAT_UNSIGNED_INT32;
        d.NumChannels = 1;
        h.kind = Kind::mipmap;
        if (cuMipmappedArrayCreate(&h.mipmap, &d, 1 + static_cast<unsigned>(rng_.below(4))) == CUDA_SUCCESS) hold(h);
      }
    } else if (c == "context") {
      h.kind = Kind::ctx;
      if (cuCtxCreate(&h.ctx, nullptr, 0, s_.dev) == CUDA_SUCCESS) {
        CUdeviceptr p = 0;
        alloc(&p, size());  // freed by the destroy
        hold(h);
      }
      cuCtxSetCurrent(s_.primary);
    } else if (c == "primary") {
      if (rng_.chance(10)) {
        cuDevicePrimaryCtxReset(s_.dev);
        {
          std::lock_guard<std::mutex> g(s_.primary_mu);
          s_.absorbed.destroyed(s_.absorbed.primary);  // went with the context
        }
        CUcontext ctx = nullptr;
        cuDevicePrimaryCtxRetain(&ctx, s_.dev);  // the worker's own reference again
        cuCtxSetCurrent(s_.primary);
      } else {
        h.kind = Kind::primary_ref;
        if (cuDevicePrimaryCtxRetain(&h.ctx, s_.dev) == CUDA_SUCCESS) hold(h);
      }
    } else if (c == "module") {
      h.kind = Kind::module;
      const std::string image = image_with_global(size(), static_cast<unsigned>(rng_.below(1000)));
      if (cuModuleLoadData(&h.module, image.c_str()) == CUDA_SUCCESS) {
        CUdeviceptr g = 0;
        std::size_t bytes = 0;
        cuModuleGetGlobal(&g, &bytes, h.module, "torture_g0");
        hold(h);
      }
    } else if (c == "library") {
      // Loaded with no current context (lazy, as the CUDA 12+ runtime does), placed at first use.
      h.kind = Kind::library;
      const unsigned tag = static_cast<unsigned>(rng_.below(1000));
      const std::string image = image_with_global(size(), tag);
      CUcontext saved = nullptr;
      cuCtxPopCurrent(&saved);
      CUresult rc = cuLibraryLoadData(&h.library, image.c_str(), nullptr, nullptr, 0, nullptr, nullptr, 0);
      cuCtxSetCurrent(s_.primary);
      if (rc == CUDA_SUCCESS) {
        char name[32];
        std::snprintf(name, sizeof(name), "torture_g%u", tag);
        CUdeviceptr g = 0;
        std::size_t bytes = 0;
        cuLibraryGetGlobal(&g, &bytes, h.library, name);
        hold(h);
      }
    } else if (c == "fill") {
      std::vector<CUdeviceptr> ptrs;
      for (int i = 0; i < 64; ++i) {
        CUdeviceptr p = 0;
        if (alloc(&p, 8 * kMi) != CUDA_SUCCESS) break;
        ptrs.push_back(p);
      }
      for (CUdeviceptr p : ptrs) released(8 * kMi, [&] { cuMemFree(p); });
    } else if (c == "fork") {
      if (forks_ < 2) fork_child();  // a process start costs ~10 ms here: at most 2 per thread
      ++forks_;
    } else if (c == "ipc") {
      ipc_op();
    } else if (c == "interop") {
      interop_op();
    }
  }

  // Legacy CUDA IPC between the container's workers (vLLM, torch.multiprocessing):
  // an exporter allocates, publishes the handle in the seed's directory; an
  // importer opens another process's handle (maybe stale: the driver's
  // error), sometimes cuMemFree's the opened pointer (the driver refuses it),
  // and closes it at release. The memory is the exporter's alone.
  void ipc_op() {
    Held h;
    if (rng_.chance(50)) {
      h.kind = Kind::linear;
      h.size = size();
      if (alloc(&h.ptr, h.size) != CUDA_SUCCESS) return;
      CUipcMemHandle handle{};
      if (cuIpcGetMemHandle(&handle, h.ptr) == CUDA_SUCCESS) publish(handle);
      hold(h);
      return;
    }
    CUipcMemHandle handle{};
    if (!pick_published(&handle)) return;
    h.kind = Kind::ipc_open;
    if (cuIpcOpenMemHandle(&h.ptr, handle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS) != CUDA_SUCCESS) return;
    if (rng_.chance(20)) released(0, [&] { cuMemFree(h.ptr); });
    hold(h);
  }
  std::string ipc_dir() const {
    const char* state = std::getenv("FAKECUDA_STATE");
    std::string dir = state != nullptr ? state : "/tmp/fakecuda";
    dir = dir.substr(0, dir.rfind('/') == std::string::npos ? 0 : dir.rfind('/'));
    return (dir.empty() ? std::string(".") : dir) + "/ipc-handles";
  }
  void publish(const CUipcMemHandle& handle) {
    const std::string dir = ipc_dir();
    mkdir(dir.c_str(), 0700);
    const std::string name = dir + "/h-" + std::to_string(getpid()) + "-" + std::to_string(rng_.next());
    const std::string tmp = name + ".tmp";
    const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0) return;
    const bool ok = write(fd, &handle, sizeof handle) == static_cast<ssize_t>(sizeof handle);
    close(fd);
    if (!ok || rename(tmp.c_str(), name.c_str()) != 0) unlink(tmp.c_str());
  }
  bool pick_published(CUipcMemHandle* handle) {
    const std::string dir = ipc_dir();
    const std::string own = "h-" + std::to_string(getpid()) + "-";
    std::vector<std::string> names;
    if (DIR* d = opendir(dir.c_str()); d != nullptr) {
      for (dirent* e = readdir(d); e != nullptr; e = readdir(d)) {
        const std::string n = e->d_name;
        if (n.rfind("h-", 0) == 0 && n.rfind(own, 0) != 0 && n.find(".tmp") == std::string::npos) names.push_back(n);
      }
      closedir(d);
    }
    if (names.empty()) return false;
    const int fd = open((dir + "/" + names[rng_.below(names.size())]).c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return false;
    const bool ok = read(fd, handle, sizeof *handle) == static_cast<ssize_t>(sizeof *handle);
    close(fd);
    return ok;
  }

  // Graphics interop (Vulkan, OptiX): memory a graphics API allocated,
  // imported (counted by gpuslice) and sometimes mapped as a buffer; released
  // in either order (the import or the graphics API first).
  void interop_op() {
    Held h;
    h.kind = Kind::ext;
    h.size = size();
    // Outside CUDA until its import returned (monitor_outside_begin): gpuslice cannot know of it before.
    const unsigned dev = static_cast<unsigned>(s_.dev);
    monitor_outside_begin(dev, h.size);
    struct Outside {
      unsigned dev;
      std::size_t bytes;
      ~Outside() { monitor_outside_end(dev, bytes); }
    } outside{dev, h.size};
    const int event = s_.absorbed.graphics_begin(h.size);
    h.graphics = fakecuda_graphics_alloc(s_.dev, h.size);
    s_.absorbed.graphics_end(event);
    if (h.graphics == 0) return;
    CUDA_EXTERNAL_MEMORY_HANDLE_DESC d{};
    d.type = CU_EXTERNAL_MEMORY_HANDLE_TYPE_OPAQUE_FD;
    d.handle.fd = fakecuda_graphics_export_fd(h.graphics);
    d.size = h.size;
    if (d.handle.fd < 0 || cuImportExternalMemory(&h.ext, &d) != CUDA_SUCCESS) {
      if (d.handle.fd >= 0) close(d.handle.fd);                 // still the caller's on failure
      released(0, [&] { graphics_free(h.graphics, h.size); });  // nothing imported holds it
      return;
    }
    if (rng_.chance(50)) {
      CUDA_EXTERNAL_MEMORY_BUFFER_DESC b{};
      b.size = h.size;
      if (cuExternalMemoryGetMappedBuffer(&h.ptr, h.ext, &b) != CUDA_SUCCESS) h.ptr = 0;
    }
    hold(h);
  }

  // A graphics free that takes `bytes` off the device (no import holds the
  // memory): an event for the measurements it overlaps (Absorbed).
  void graphics_free(std::uint64_t graphics, std::uint64_t bytes) {
    const int event = s_.absorbed.graphics_begin(bytes, /*freed=*/true);
    fakecuda_graphics_free(graphics);
    s_.absorbed.graphics_end(event);
  }

  CUmemoryPool pick_pool() {
    std::lock_guard<std::mutex> guard(s_.mu);
    if (s_.pools.empty()) return nullptr;
    return s_.pools[rng_.below(s_.pools.size())];
  }

  void vmm_create() {
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = s_.dev;
    Held h;
    h.kind = Kind::vmm;
    h.size = 2 * kMi * (1 + rng_.below(6));
    if (requested(h.size, "cuMemCreate", [&] { return cuMemCreate(&h.handle, h.size, &prop, 0); }) != CUDA_SUCCESS)
      return;
    if (cuMemAddressReserve(&h.ptr, h.size, 0, 0, 0) != CUDA_SUCCESS) {
      cuMemRelease(h.handle);
      return;
    }
    if (cuMemMap(h.ptr, h.size, 0, h.handle, 0) == CUDA_SUCCESS) {
      CUmemAccessDesc access{};
      access.location = prop.location;
      access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
      cuMemSetAccess(h.ptr, h.size, &access, 1);
      // Half the time the handle goes at once: the mapping keeps the memory.
      if (rng_.chance(50)) {
        cuMemRelease(h.handle);
        h.handle = 0;
      }
    }
    hold(h);
  }

  void fork_child() {
    std::fflush(nullptr);
    const bool exec = rng_.chance(50);
    pid_t pid = fork();
    if (pid == 0) {
      if (exec) {
        std::string seed = std::to_string(rng_.next() % 1000000);
        std::string classes;
        for (const std::string& c : o_.classes) {
          if (c == "fork") continue;
          classes += (classes.empty() ? "" : ",") + c;
        }
        if (classes.empty()) classes = "alloc";
        std::string quota = std::to_string(o_.quota);
        execl(self_, self_, "--worker", "99", "--seed", seed.c_str(), "--threads", "1", "--ops", "20", "--classes",
              classes.c_str(), "--quota", quota.c_str(), static_cast<char*>(nullptr));
        _exit(127);
      }
      // Without exec: a forked child may not use the driver (CUDA_ERROR_NOT_INITIALIZED) and exits.
      // A request all the same: gpuslice reserves it (in the child's own slot) before the driver refuses it.
      CUdeviceptr p = 0;
      alloc(&p, kMi);
      _exit(0);
    }
    if (pid > 0) {
      int status = 0;
      waitpid(pid, &status, 0);
      if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) child_failures_.fetch_add(1);
    }
  }

  void release_one() {
    InCall call;
    const std::size_t i = rng_.below(held_.size());
    Held h = held_[i];
    held_.erase(held_.begin() + static_cast<std::ptrdiff_t>(i));
    switch (h.kind) {
      case Kind::linear: released(h.size, [&] { cuMemFree(h.ptr); }); break;
      case Kind::pool_ptr:
        // The reserve stays with the pool (and counted) until a trim.
        if (rng_.chance(50)) {
          released(0, [&] { cuMemFreeAsync(h.ptr, h.stream); });
          if (rng_.chance(40)) sync_stream(h.stream);
        } else {
          released(0, [&] { cuMemFree(h.ptr); });
        }
        break;
      case Kind::vmm: released(h.size, [&] { release_vmm(h); }); break;
      default: released(0, [&] { release_other(h); }); break;
    }
    if (!h.absorbed.empty()) s_.absorbed.destroyed(h.absorbed);  // gone with the object
  }

  void release_vmm(Held& h) {
    switch (h.kind) {
      case Kind::vmm:
        if (h.handle != 0 && rng_.chance(50)) {
          cuMemRelease(h.handle);
          h.handle = 0;
        }
        cuMemUnmap(h.ptr, h.size);
        if (h.handle != 0) cuMemRelease(h.handle);
        cuMemAddressFree(h.ptr, h.size);
        break;
      default: break;
    }
  }

  // Arrays, contexts, primary references, modules, libraries: frees whose
  // size the worker does not know.
  void release_other(Held& h) {
    switch (h.kind) {
      case Kind::array: cuArrayDestroy(h.array); break;
      case Kind::mipmap: cuMipmappedArrayDestroy(h.mipmap); break;
      case Kind::ctx:
        cuCtxDestroy(h.ctx);
        cuCtxSetCurrent(s_.primary);
        break;
      case Kind::primary_ref: cuDevicePrimaryCtxRelease(s_.dev); break;
      case Kind::module: cuModuleUnload(h.module); break;
      case Kind::library: cuLibraryUnload(h.library); break;
      case Kind::ipc_open: cuIpcCloseMemHandle(h.ptr); break;
      case Kind::ext:
        if (h.ptr != 0) cuMemFree(h.ptr);
        if (rng_.chance(50)) {
          // Outside CUDA from the import's destruction to the graphics free.
          monitor_outside_begin(static_cast<unsigned>(s_.dev), h.size);
          cuDestroyExternalMemory(h.ext);
          graphics_free(h.graphics, h.size);  // the import gone: the memory leaves the device
          monitor_outside_end(static_cast<unsigned>(s_.dev), h.size);
        } else {
          fakecuda_graphics_free(h.graphics);
          cuDestroyExternalMemory(h.ext);
        }
        break;
      default: break;
    }
  }

 public:
  static std::atomic<int> child_failures_;

 private:
  Shared& s_;
  const WorkerOptions& o_;
  Rng rng_;
  const char* self_;
  CUstream stream_ = nullptr;
  std::vector<Held> held_;
  int forks_ = 0;
  std::size_t max_held_ = kMaxHeld;
  int ordinal_ = 0;  // the simulator's name of the thread (t1, t2, ...)

 public:
  int granted_ = 0;  // operations that acquired a resource
};

std::atomic<int> Worker::child_failures_{0};

// The workers while they run, for the monitor's checkpoint reports (called
// by the last thread at the barrier, every other one parked).
std::vector<Worker>* g_workers = nullptr;
void describe_workers(char* out, std::size_t len) {
  std::string text;
  if (g_workers != nullptr)
    for (const Worker& w : *g_workers) w.describe(&text);
  std::snprintf(out, len, "%s", text.c_str());
}

// A worker meant to run under gpuslice (LD_PRELOAD names libgpuslice.so)
// that ld.so could not preload runs anyway: ld.so prints a warning and
// starts the program without it. Its allocations are then unlimited and
// uncounted, which the monitor reports as the container above its quota
// with a live process holding memory and no gpuslice slot ("slot none") —
// a gpuslice defect in appearance. That is what a library rebuilt while a
// long run_many.sh runs does (the linker replaces the file). Say so instead.
bool preload_missing(const char** loaded_from) {
  const char* preload = std::getenv("LD_PRELOAD");
  if (preload == nullptr || std::strstr(preload, "libgpuslice.so") == nullptr) return false;
  void* alloc = dlsym(RTLD_DEFAULT, "cuMemAlloc_v2");  // the first definition: gpuslice's when preloaded
  Dl_info info{};
  *loaded_from = alloc != nullptr && dladdr(alloc, &info) != 0 && info.dli_fname != nullptr ? info.dli_fname : "?";
  return std::strstr(*loaded_from, "libgpuslice.so") == nullptr;
}

}  // namespace

int run_worker(const WorkerOptions& options, const char* self) {
  if (options.classes.empty()) return 0;
  if (const char* from = nullptr; preload_missing(&from)) {
    std::fprintf(stderr,
                 "torture worker %d: LD_PRELOAD=%s but libgpuslice.so is not loaded (cuMemAlloc_v2 comes from %s): "
                 "ld.so could not preload it (rebuilt during the run?); the schedule is not a test of gpuslice\n",
                 options.index, std::getenv("LD_PRELOAD"), from);
    return 4;
  }
  std::optional<InCall> start(std::in_place);  // the start's calls (the primary context's memory)
  if (cuInit(0) != CUDA_SUCCESS) {
    std::fprintf(stderr, "torture worker %d: cuInit failed\n", options.index);
    return 2;
  }
  Shared shared(options.threads);
  monitor_release_begin(0, 0);  // the primary context: implicit memory of unknown size
  const bool primary = cuDeviceGet(&shared.dev, 0) == CUDA_SUCCESS &&
                       cuDevicePrimaryCtxRetain(&shared.primary, shared.dev) == CUDA_SUCCESS;
  monitor_release_end();
  if (!primary) {
    // The primary context may be refused at the quota (its memory is counted): a legal outcome.
    std::fprintf(stderr, "torture worker %d: no primary context (refused)\n", options.index);
    return 0;
  }
  cuCtxSetCurrent(shared.primary);
  cuDeviceGetDefaultMemPool(&shared.default_pool, shared.dev);
  start.reset();
  shared.pool_allocs = std::find(options.classes.begin(), options.classes.end(), "pool") != options.classes.end();
  if (shared.pool_allocs) monitor_pools(1);  // the default pool (each may be counted a chunk above its reserve)
  std::vector<std::thread> threads;
  std::vector<Worker> workers;
  workers.reserve(static_cast<std::size_t>(options.threads));
  for (int t = 0; t < options.threads; ++t) workers.emplace_back(shared, options, t, self);
  g_workers = &workers;
  monitor_describer(describe_workers);
  for (int t = 0; t < options.threads; ++t)
    threads.emplace_back([&workers, t] { workers[static_cast<std::size_t>(t)].run(); });
  for (std::thread& t : threads) t.join();
  monitor_describer(nullptr);
  g_workers = nullptr;
  int granted = 0;
  for (const Worker& w : workers) granted += w.granted_;
  std::printf("torture worker %d: %d of %d operations acquired a resource\n", options.index, granted,
              options.ops * options.threads);
  InCall teardown;
  cuDeviceSetMemPool(shared.dev, shared.default_pool);
  // Teardown frees of unknown size (monitor_release_begin): pools, the primary context.
  monitor_release_begin(static_cast<unsigned>(shared.dev), 0);
  cuCtxSynchronize();
  for (CUmemoryPool pool : shared.pools) cuMemPoolDestroy(pool);
  cuDevicePrimaryCtxRelease(shared.dev);
  monitor_release_end();
  if (Worker::child_failures_.load() != 0) {
    std::fprintf(stderr, "torture worker %d: %d forked children failed\n", options.index,
                 Worker::child_failures_.load());
    return 3;
  }
  return 0;
}

}  // namespace gpuslice::chaos
