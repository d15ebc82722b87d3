// Parsing of gpuslice's environment options (include/gpuslice/options.def)
// from an explicit environ-style array: no getenv, no heap, fixed buffers, so
// that it can run first thing in the preload library's constructor.
//
// Grammar (strict; anything else is an error that names the variable, the
// value and what was expected):
//   size     <digits>[unit], unit (case-sensitive) one of
//              B                      bytes
//              K k M G T              base 1000   (kilo may be K or k)
//              Ki Mi Gi Ti            base 1024
//            each optionally followed by "B" (8GB = 8G, 8GiB = 8Gi).
//            No sign, space, fraction or exponent; a quota of 0 is an error
//            (it would refuse every allocation: unset the variable for none).
//   percent  1-100, optionally followed by '%'.
//   per device  either one value for every device, or "<i>=<value>,..." with
//            distinct indices < kMaxDevices (CUDA ordinals as the application
//            sees them); devices not listed keep the default.
//   words    (policy, level, choice) one of the option's words (its
//            GPUSLICE_WORDs in options.def), any case.
//   flag     true | false | 1 | 0 | yes | no | on | off (any case).
//   duration <digits>[ms|s], within the range column's bounds.
//   Empty values are errors.
// Aliases (HAMi-core, gpuslice/options.h kOptionAliases): CUDA_DEVICE_MEMORY_LIMIT[_<i>]
// = bytes or k/m/g suffix (base 1024, either case), 0 = not set;
// CUDA_DEVICE_SM_LIMIT[_<i>] = 0-100, 0 = unlimited; scalar aliases map
// their values onto ours. Ours > CUDA_*_<i> > CUDA_* > default.
#pragma once

#include <cstddef>
#include <cstdint>

#include "gpuslice/options.h"
#include "gpuslice/priority_board.h"
#include "gpuslice/region.h"
#include "platform/text.h"
#include "shm/region_file.h"

namespace gpuslice::options {

struct OptionSource {
  char name[64];       // the variable that set it, or "default"
  std::uint32_t line;  // 0: the environment (or default); n: line n of the configuration file
};

// What the words of GPUSLICE_LOG_LEVEL and GPUSLICE_OVERSUBSCRIBE are read as
// (options.def pairs each word with its value). GPUSLICE_SM_POLICY is read as
// SmPolicy (gpuslice/region.h) and GPUSLICE_PRIORITY as the ABI's Priority
// (gpuslice/priority_board.h), the values the region stores.
enum LogLevel : int { kLogError = 0, kLogWarn = 1, kLogInfo = 2, kLogDebug = 3 };
enum Oversubscribe : int { kOversubscribeFail = 0, kOversubscribeSpill = 1, kOversubscribeWait = 2 };

// One word of a choice option and the value it is stored as.
template <class E>
struct Word {
  const char* text;
  E value;
};

// The words of each choice option, one table per option from its row of
// options.def: words::priority, words::sm_policy, ...
namespace words {
#define GPUSLICE_OPTION(id, env, kind, def, range, doc)
#define GPUSLICE_WORD(word, value) {word, value},
#define GPUSLICE_CHOICE(id, env, kind, Enum, def, words, doc) inline constexpr Word<Enum> id[] = {words};
#include "gpuslice/options.def"
#undef GPUSLICE_CHOICE
#undef GPUSLICE_WORD
#undef GPUSLICE_OPTION
}  // namespace words

constexpr char lower_ascii(char c) noexcept { return c >= 'A' && c <= 'Z' ? static_cast<char>(c - 'A' + 'a') : c; }

// `text` in the grammar of a choice option (one of its words, any case): the
// function that parses the variable, shared by tools that set the same thing
// (`gpuslice-smi set --priority`), so that they accept exactly what it does.
template <class E, std::size_t N>
constexpr bool parse_word(const Word<E> (&table)[N], const char* text, std::size_t n, E* out) noexcept {
  for (const Word<E>& w : table) {
    std::size_t i = 0;
    for (; i < n && w.text[i] != '\0'; ++i) {
      if (lower_ascii(text[i]) != lower_ascii(w.text[i])) break;
    }
    if (i == n && w.text[i] == '\0' && n > 0) {
      *out = w.value;
      return true;
    }
  }
  return false;
}
template <class E, std::size_t N>
constexpr bool parse_word(const Word<E> (&table)[N], const char* text, E* out) noexcept {
  std::size_t n = 0;
  while (text[n] != '\0') ++n;
  return parse_word(table, text, n, out);
}
// What a message says a choice expects: "high, normal or low".
template <class E, std::size_t N>
platform::Text& list_words(platform::Text& t, const Word<E> (&table)[N]) noexcept {
  for (std::size_t i = 0; i < N; ++i) t.str(i == 0 ? "" : i + 1 == N ? " or " : ", ").str(table[i].text);
  return t;
}
// The word of `value` ("?" if none: not a value of the option).
template <class E, std::size_t N>
constexpr const char* word_of(const Word<E> (&table)[N], E value) noexcept {
  for (const Word<E>& w : table) {
    if (w.value == value) return w.text;
  }
  return "?";
}

// How an option of each type is stored (fixed size, no heap); a choice is
// stored as the enum its words name.
template <OptionType>
struct OptionStorage;
template <>
struct OptionStorage<OptionType::per_device_size> {
  using value = std::uint64_t[kMaxDevices];  // kUnlimited where unset
  using source = OptionSource[kMaxDevices];
};
template <>
struct OptionStorage<OptionType::per_device_percent> {
  using value = std::uint32_t[kMaxDevices];
  using source = OptionSource[kMaxDevices];
};
template <>
struct OptionStorage<OptionType::flag> {
  using value = bool;
  using source = OptionSource;
};
template <>
struct OptionStorage<OptionType::duration_ms> {
  using value = std::uint32_t;
  using source = OptionSource;
};
template <>
struct OptionStorage<OptionType::path> {
  using value = char[4096];
  using source = OptionSource;
};
template <>
struct OptionStorage<OptionType::name> {
  using value = char[64];
  using source = OptionSource;
};

// One field `<id>` and one `<id>_source` per entry of options.def.
struct Options {
#define GPUSLICE_OPTION(id, env, kind, def, range, doc) \
  OptionStorage<OptionType::kind>::value id;            \
  OptionStorage<OptionType::kind>::source id##_source;
#define GPUSLICE_CHOICE(id, env, kind, Enum, def, words, doc) \
  Enum id;                                                    \
  OptionSource id##_source;
#include "gpuslice/options.def"
#undef GPUSLICE_CHOICE
#undef GPUSLICE_OPTION
  // First GPUSLICE_* variable that is no option (a typo?), "" if none: worth a warning.
  char unknown_variable[64];
  // A HAMi alias value with no meaning gpuslice keeps (an unknown log level,
  // priority or core policy), taken as its default: worth one warning. "" if none.
  char alias_warning[200];
  // Whether the configuration file (config_file) was read; false when the
  // default file is absent or only the environment was parsed.
  bool config_file_read;
};

// Parses every option from a NULL-terminated "NAME=VALUE" array (the first of
// duplicate names wins, as with getenv). On error returns false and err holds
// one line: "gpuslice: NAME='value': <what is wrong>, expected <what>".
// `out` is then filled with defaults plus whatever parsed before the error.
// The environment only: load_options (limiter/options/file.h) adds the
// configuration file.
bool parse_options(char* const* envp, Options* out, shm::Error* err) noexcept;
void default_options(Options* out) noexcept;

bool parse_size(const char* text, std::uint64_t* out) noexcept;       // our size grammar (0 accepted)
bool parse_hami_size(const char* text, std::uint64_t* out) noexcept;  // alias grammar
bool parse_percent(const char* text, std::uint32_t* out) noexcept;    // 1-100[%]

// The README's option table (Markdown, from options.def). Returns the length
// written (NUL-terminated) or -1 if cap is too small.
int format_options_markdown(char* buf, std::size_t cap) noexcept;
// "gpuslice: NAME=value (source)" lines, one per option (per device where
// set), for GPUSLICE_LOG_LEVEL=debug. Returns the length or -1 if cap is too small.
int format_effective_options(const Options& o, char* buf, std::size_t cap) noexcept;

}  // namespace gpuslice::options
