// Process-lifetime storage for the preload library's tables (inline only).
#pragma once

namespace gpuslice::hook {

// Process-lifetime storage: the object is never destroyed, so a CUDA call made
// during exit (the runtime's own teardown frees memory after our static
// destructors would have run) never touches a destroyed table.
template <class T>
union NoDestroy {
  T value;
  constexpr NoDestroy() : value() {}
  ~NoDestroy() {}
  T& operator*() noexcept { return value; }
  T* operator->() noexcept { return &value; }
};

}  // namespace gpuslice::hook
