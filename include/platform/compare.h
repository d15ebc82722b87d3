// A relaxed atomic load compared at once, for the preload library's hot
// paths (issue 35: the allocation pair in instructions). GCC loads an
// atomic into a register and compares that (two instructions); on x86-64
// this is one compare with the word as its memory operand: the same single
// aligned load, with no register kept for it. Elsewhere, and under the
// sanitizers (which see only the atomic's load), the load and compare.
// Ordering: relaxed, as the load it replaces; the compiler keeps it where it
// is written (volatile), not across an asm "memory" barrier or a call.
#pragma once

#include <atomic>
#include <cstdint>
#include <type_traits>

namespace gpuslice::platform {

#if defined(__x86_64__) && !defined(__SANITIZE_THREAD__) && !defined(__SANITIZE_ADDRESS__)
#define GPUSLICE_COMPARE_ASM 1
#endif

// word == value, read relaxed.
template <class T>
inline bool relaxed_equals(const std::atomic<T>& word, std::type_identity_t<T> value) noexcept {
  static_assert(std::is_integral_v<T> && (sizeof(T) == 4 || sizeof(T) == 8), "a 4- or 8-byte integer word");
  static_assert(sizeof(std::atomic<T>) == sizeof(T), "the atomic is its word");
#if GPUSLICE_COMPARE_ASM
  bool equal;
  if constexpr (sizeof(T) == 8) {
    asm volatile("cmpq %2, %1" : "=@cce"(equal) : "m"(*reinterpret_cast<const T*>(&word)), "er"(value));
  } else {
    asm volatile("cmpl %2, %1" : "=@cce"(equal) : "m"(*reinterpret_cast<const T*>(&word)), "ir"(value));
  }
  return equal;
#else
  return word.load(std::memory_order_relaxed) == value;
#endif
}

// word == value, read seq_cst: on x86-64 a seq_cst load is a plain load
// (the fences go with the stores), so the same compare, kept by the
// compiler in order with every other access ("memory").
template <class T>
inline bool seq_cst_equals(const std::atomic<T>& word, std::type_identity_t<T> value) noexcept {
  static_assert(std::is_integral_v<T> && (sizeof(T) == 4 || sizeof(T) == 8), "a 4- or 8-byte integer word");
  static_assert(sizeof(std::atomic<T>) == sizeof(T), "the atomic is its word");
#if GPUSLICE_COMPARE_ASM
  bool equal;
  if constexpr (sizeof(T) == 8) {
    asm volatile("cmpq %2, %1" : "=@cce"(equal) : "m"(*reinterpret_cast<const T*>(&word)), "er"(value) : "memory");
  } else {
    asm volatile("cmpl %2, %1" : "=@cce"(equal) : "m"(*reinterpret_cast<const T*>(&word)), "ir"(value) : "memory");
  }
  return equal;
#else
  return word.load(std::memory_order_seq_cst) == value;
#endif
}

}  // namespace gpuslice::platform
