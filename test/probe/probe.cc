// gpuslice-probe: what the families share (probe.h): the checked setup calls,
// the two figures every family compares (counted, held), the pausable churn
// thread, and the reader of a scenario's arguments.
#include "probe.h"

#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <sstream>

#include "fakecuda_query.h"

namespace gpuslice::probe {

void check(CUresult rc, const char* what) {
  if (rc != CUDA_SUCCESS) {
    std::fprintf(stderr, "gpuslice-probe: %s failed: %d\n", what, static_cast<int>(rc));
    std::exit(2);
  }
}

CUcontext primary(CUdevice dev) {
  CUcontext ctx = nullptr;
  check(cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain");
  return ctx;
}

CUcontext use_primary(CUdevice dev) {
  CUcontext ctx = primary(dev);
  check(cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
  return ctx;
}

CUstream new_stream() {
  CUstream s = nullptr;
  check(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
  return s;
}

CUmemoryPool new_pool(int dev) {
  CUmemPoolProps props{};
  props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
  props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  props.location.id = dev;
  CUmemoryPool pool = nullptr;
  check(cuMemPoolCreate(&pool, &props), "cuMemPoolCreate");
  return pool;
}

CUmemoryPool new_pool(int dev, std::uint64_t release_threshold) {
  CUmemoryPool pool = new_pool(dev);
  set_release_threshold(pool, release_threshold);
  return pool;
}

void set_release_threshold(CUmemoryPool pool, std::uint64_t bytes) {
  cuuint64_t t = bytes;
  check(cuMemPoolSetAttribute(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &t), "cuMemPoolSetAttribute");
}

std::string image_with_global(std::size_t bytes) {
  return ".global .align 8 .b8 big[" + std::to_string(bytes) + "];\n.entry k\n";
}

CUfunction module_kernel(const std::string& image, const std::string& name) {
  CUmodule module = nullptr;
  check(cuModuleLoadData(&module, image.c_str()), "cuModuleLoadData");
  CUfunction f = nullptr;
  check(cuModuleGetFunction(&f, module, name.c_str()), "cuModuleGetFunction");
  return f;
}

long long counted_used() {
  size_t free_b = 0, total = 0;
  check(cuMemGetInfo(&free_b, &total), "cuMemGetInfo");
  return static_cast<long long>(total - free_b);
}

long long held(int dev) { return static_cast<long long>(fakecuda_process_used_bytes(dev, 0)); }

long long held_allocations(int dev) {
  return static_cast<long long>(fakecuda_process_used_bytes(dev, 0) - fakecuda_process_context_bytes(dev, 0));
}

bool Shortfall::observe() {
  const long long c = counted_used(), h = held();
  if (c < h) {
    ++rounds;
    if (h - c > max) max = h - c;
  }
  return c != h;
}

Churn::Churn(CUcontext ctx, std::function<void()> step)
    : thread_([this, ctx, step = std::move(step)] {
        cuCtxSetCurrent(ctx);
        while (!stop_.load()) {
          if (pause_.load()) {
            paused_.store(1);
            while (pause_.load() && !stop_.load()) std::this_thread::yield();
            paused_.store(0);
            continue;
          }
          step();
        }
      }) {}

Churn::~Churn() { stop(); }

void Churn::pause() {
  pause_.store(true);
  while (paused_.load() == 0) std::this_thread::yield();
}

void Churn::resume() {
  pause_.store(false);
  while (paused_.load() != 0) std::this_thread::yield();
}

void Churn::stop() {
  stop_.store(true);
  if (thread_.joinable()) thread_.join();
}

namespace {

std::vector<std::string> split(const char* usage) {
  std::istringstream in(usage);
  std::vector<std::string> out;
  for (std::string w; in >> w;) out.push_back(w);
  return out;
}

bool optional(const std::string& name) { return !name.empty() && name.front() == '['; }

}  // namespace

Args::Args(const char* usage, std::vector<std::string> words) : names_(split(usage)), words_(std::move(words)) {
  std::size_t required = 0;
  for (const std::string& n : names_) required += optional(n) ? 0 : 1;
  if (words_.size() < required || words_.size() > names_.size())
    throw BadArgument("expected " + std::string(*usage != '\0' ? usage : "no arguments") + ", got " +
                      std::to_string(words_.size()) + " argument(s)");
}

std::string Args::name(std::size_t i) const {
  return i < names_.size() ? names_[i] : "argument " + std::to_string(i + 1);
}

long long Args::whole(std::size_t i) const {
  const std::string& word = text(i);
  long long value = 0;
  const char* end = word.data() + word.size();
  const auto [ptr, ec] = std::from_chars(word.data(), end, value);
  if (word.empty() || ec != std::errc() || ptr != end)
    throw BadArgument(name(i) + ": expected a whole number, got '" + word + "'");
  return value;
}

void Args::out_of_range(std::size_t i, long long lo, unsigned long long hi) const {
  throw BadArgument(name(i) + ": expected a whole number from " + std::to_string(lo) + " to " + std::to_string(hi) +
                    ", got '" + text(i) + "'");
}

std::size_t Args::mib(std::size_t i) const {
  constexpr std::size_t kMost = std::numeric_limits<std::size_t>::max() / kMi;
  const std::size_t n = number<std::size_t>(i);
  if (n > kMost) out_of_range(i, 0, kMost);
  return n * kMi;
}

double Args::real(std::size_t i) const {
  const std::string& word = text(i);
  char* end = nullptr;
  const double value = std::strtod(word.c_str(), &end);
  if (word.empty() || *end != '\0') throw BadArgument(name(i) + ": expected a number, got '" + word + "'");
  return value;
}

const std::string& Args::text(std::size_t i) const {
  if (i >= words_.size()) throw BadArgument(name(i) + ": missing");
  return words_[i];
}

bool Args::flag(std::size_t i, const char* word) const {
  if (i >= words_.size()) return false;
  if (words_[i] != word) throw BadArgument(name(i) + ": expected '" + word + "' or nothing, got '" + words_[i] + "'");
  return true;
}

}  // namespace gpuslice::probe
