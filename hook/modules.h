// What modules.cc (modules and libraries) gives the launch side: libraries
// placed by a kernel launch. With lazy loading (the CUDA 12+
// runtime's default) a library loaded with no context current is placed in a
// context at its first use there, and a launch of one of its kernels — a
// CUkernel cast to CUfunction, as the runtime launches them — is such a use.
// The launch wrappers (launch_wrappers.cc) test g_kernel_check first: while
// bit 0 is clear (no CUkernel handed out that may be launched where its
// library was never measured) that is one load and a predictable branch;
// while it is set, a launch looks its function up among the kernels
// cuLibraryGetKernel handed out and, the first time one is launched in a
// context, places its library there measured (cuKernelGetFunction in that
// context, place_counted) before the launch. Modules and libraries
// themselves: modules.cc.
#pragma once

#include <cuda.h>

#include <atomic>
#include <cstdint>

namespace gpuslice::hook {

// Bit 0: a launch must check (above); bits 1-63: a count of the changes that
// set it (a check that found every kernel placed clears bit 0 only if no
// change came in meanwhile).
extern std::atomic<std::uint64_t> g_kernel_check;
[[gnu::cold, gnu::noinline]] CUresult place_launched_kernel(CUfunction f, CUstream s) noexcept;
[[gnu::cold, gnu::noinline]] CUresult place_kernel_in_context(CUfunction f, CUcontext ctx) noexcept;

// Before every launch of `f` on `s`: CUDA_SUCCESS, or the launch's error
// (CUDA_ERROR_OUT_OF_MEMORY: the placement does not fit; the library is unloaded).
inline CUresult place_kernel(CUfunction f, CUstream s) noexcept {
  if (__builtin_expect((g_kernel_check.load(std::memory_order_relaxed) & 1) != 0, 0))
    return place_launched_kernel(f, s);
  return CUDA_SUCCESS;
}

// A graph's kernel node names `f` in `ctx` (NULL: the current context): its
// library placed there measured if it never was (graph.cc, before an
// instantiation or a node change). CUDA_SUCCESS, or CUDA_ERROR_OUT_OF_MEMORY.
inline CUresult place_node_kernel(CUfunction f, CUcontext ctx) noexcept {
  if (__builtin_expect((g_kernel_check.load(std::memory_order_relaxed) & 1) != 0, 0))
    return place_kernel_in_context(f, ctx);
  return CUDA_SUCCESS;
}

// context.cc: a context came to be (cuCtxCreate, a first primary retain), or
// went (cuCtxDestroy, a primary context's last release or reset). A new
// context is one where no library is placed yet.
void kernels_context_created() noexcept;
void kernels_context_destroyed() noexcept;
// A context's copies of libraries go with it (NVIDIA's driver loads a
// library into each context that uses it): what was charged for them in
// `ctx` is taken out before the driver destroys it, then released when it
// went (gone) or put back when the destroy was refused.
struct PlacedParts {
  static constexpr unsigned kMax = 64;  // beyond: left counted until the library's unload
  struct Part {
    std::uint64_t key;
    int entry;
    std::uint64_t bytes;
  };
  Part part[kMax];
  unsigned n = 0;
};
// A drop of library copies (a context destroyed, the primary context's last
// release or reset, a library unloaded: the driver frees copies and may give
// their context's or library's handle to the next one), bracketing the
// records' take and the driver call, after the operation's CountingOp: no
// use of a library found placed already (modules.cc, place_counted's
// shortcut and cuKernelGetFunction's, which go to the driver unmeasured) is
// in flight meanwhile. The drop waits for those in flight (bounded, kDrainNs:
// a warning then); those that begin while it is in flight are measured.
class PlacementDrop {
 public:
  explicit PlacementDrop(bool on = true) noexcept;
  ~PlacementDrop();
  PlacementDrop(const PlacementDrop&) = delete;
  PlacementDrop& operator=(const PlacementDrop&) = delete;

 private:
  bool on_;
};
void library_placements_take(CUcontext ctx, PlacedParts* out) noexcept;
void library_placements_put(CUcontext ctx, const PlacedParts& taken, bool gone) noexcept;
// After the driver freed memory implicitly (a context destroyed, the primary
// context reset or released for the last time): a module loaded in that
// context was unloaded with it, so every counted module the driver no longer
// knows is released (memory.cc's sweep_implicitly_freed calls it).
void sweep_implicitly_unloaded_modules() noexcept;

}  // namespace gpuslice::hook
