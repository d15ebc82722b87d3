// The grammars of option values, shared by the resolution of options
// (limiter/options/options.cc) and the public parse_size/parse_percent helpers
// (limiter/options/options.h): each parser takes a span of text and, on
// failure, appends "<what>, expected <what>" to the message it is given.
// Internal to gpuslice_limiter. Heap-free.
#pragma once

#include <cstddef>
#include <cstdint>

#include "gpuslice/options.h"
#include "gpuslice/region.h"
#include "limiter/options/options.h"
#include "platform/text.h"
#include "shm/region_file.h"

namespace gpuslice::options::values {

inline constexpr std::size_t kValueShown = 100;  // output characters of a value quoted in a message

struct Span {
  const char* p;
  std::size_t n;
};

constexpr char lower(char c) { return c >= 'A' && c <= 'Z' ? static_cast<char>(c - 'A' + 'a') : c; }
bool span_equals(Span s, const char* word, bool any_case);
constexpr std::size_t length(const char* s) {
  std::size_t n = 0;
  while (s[n] != '\0') ++n;
  return n;
}

// "gpuslice: NAME='value': " -- the caller appends "<what>, expected <what>".
platform::Text fail(shm::Error* err, const char* name, const char* value);
void set_source(OptionSource* s, const char* name);

// 1-100 (or min-100), optionally followed by '%' where allowed.
bool parse_percent_span(Span s, std::uint32_t min, bool allow_percent_sign, std::uint32_t* out);

// One parsed value per device, or one for all.
template <class T>
struct PerDevice {
  T value[kMaxDevices];
  bool set[kMaxDevices];
};

// Parses one element; on failure appends "<what>, expected <what>" to t.
template <class T>
using ParseOne = bool (*)(Span, T*, platform::Text&);

bool parse_quota(Span s, std::uint64_t* out, platform::Text& t);         // our size grammar, > 0
bool parse_sm(Span s, std::uint32_t* out, platform::Text& t);            // 1-100[%]
bool parse_alias_memory(Span s, std::uint64_t* out, platform::Text& t);  // HAMi-core: bytes or k/m/g (base 1024)
bool parse_alias_sm(Span s, std::uint32_t* out, platform::Text& t);      // HAMi-core: 0-100, 0 = 100

// "8Gi" (every device) or "0=8Gi,1=4Gi". Instantiated for std::uint64_t and
// std::uint32_t (values.cc).
template <class T>
bool parse_per_device(const char* name, const char* value, ParseOne<T> one, PerDevice<T>* out, shm::Error* err);

// Parses `value` for option `info` into `dst`; on failure appends
// "<what>, expected <what>" to t.
template <OptionType T>
struct Scalar;

// A choice: one of its words (options.h parse_word).
template <class E, std::size_t N>
bool parse_choice(const Word<E> (&table)[N], Span v, E* dst, platform::Text& t) {
  if (parse_word(table, v.p, v.n, dst)) return true;
  list_words(t.str(v.n == 0 ? "empty value" : "unknown value").str(", expected "), table);
  return false;
}
template <>
struct Scalar<OptionType::flag> {
  static bool parse(const OptionInfo&, Span v, bool* dst, platform::Text& t);
};
template <>
struct Scalar<OptionType::duration_ms> {
  static bool parse(const OptionInfo&, Span v, std::uint32_t* dst, platform::Text& t);
};

// Paths (absolute where the range column says so) and names.
bool parse_path_into(const OptionInfo& info, const char* value, char* dst, std::size_t cap, shm::Error* err,
                     const char* name);
bool parse_name_into(const char* name, const char* value, char* dst, std::size_t cap, shm::Error* err);

}  // namespace gpuslice::options::values
