// The grammars of option values (include/gpuslice/options.def, the grammar
// in limiter/options/options.h): sizes, percentages, per-device lists, flags,
// durations, paths and names, ours and HAMi-core's (a choice's words are
// options.h parse_word). Which variable sets an option, and in what order they
// win, is limiter/options/options.cc.
#include "limiter/options/values.h"

#include "platform/text.h"

namespace gpuslice::options {
namespace values {

using platform::Text;

namespace {

constexpr std::size_t kMaxRegionPath = 4000;  // attach needs room for a temporary name next to it

bool is_digit(char c) { return c >= '0' && c <= '9'; }

platform::Text& quote_span(platform::Text& t, Span s, std::size_t max) {
  char shown[72];
  const std::size_t n = s.n < sizeof shown - 1 ? s.n : sizeof shown - 1;
  for (std::size_t i = 0; i < n; ++i) shown[i] = s.p[i];
  shown[n] = '\0';
  return t.quoted(shown, max);  // callers pass max < sizeof shown - 1
}

// ---- sizes ---------------------------------------------------------------

enum class SizeStatus { ok, empty, not_a_number, overflow, bad_unit, fraction };

struct Unit {
  const char* suffix;
  std::uint64_t factor;
};
constexpr std::uint64_t kKi = 1024;
constexpr Unit kUnits[] = {
    {"", 1},
    {"B", 1},
    {"K", 1000},
    {"KB", 1000},
    {"k", 1000},
    {"kB", 1000},
    {"M", 1000000},
    {"MB", 1000000},
    {"G", 1000000000},
    {"GB", 1000000000},
    {"T", 1000000000000},
    {"TB", 1000000000000},
    {"Ki", kKi},
    {"KiB", kKi},
    {"Mi", kKi* kKi},
    {"MiB", kKi* kKi},
    {"Gi", kKi* kKi* kKi},
    {"GiB", kKi* kKi* kKi},
    {"Ti", kKi* kKi* kKi* kKi},
    {"TiB", kKi* kKi* kKi* kKi},
};
constexpr Unit kHamiUnits[] = {
    {"", 1}, {"k", kKi}, {"K", kKi}, {"m", kKi* kKi}, {"M", kKi* kKi}, {"g", kKi* kKi* kKi}, {"G", kKi* kKi* kKi},
};

template <std::size_t N>
SizeStatus parse_size_span(Span s, const Unit (&units)[N], std::uint64_t* out, Span* unit) {
  if (s.n == 0) return SizeStatus::empty;
  std::uint64_t v = 0;
  std::size_t i = 0;
  bool overflow = false;
  for (; i < s.n && is_digit(s.p[i]); ++i) {
    const unsigned d = static_cast<unsigned>(s.p[i] - '0');
    if (v > (~std::uint64_t{0} - d) / 10) overflow = true;
    v = v * 10 + d;
  }
  if (i == 0) return SizeStatus::not_a_number;
  if (i < s.n && (s.p[i] == '.' || s.p[i] == ',')) return SizeStatus::fraction;
  *unit = {s.p + i, s.n - i};
  const Unit* found = nullptr;
  for (const Unit& u : units) {
    if (span_equals(*unit, u.suffix, false)) found = &u;
  }
  if (found == nullptr) return SizeStatus::bad_unit;
  if (overflow || (v != 0 && found->factor > ~std::uint64_t{0} / v)) return SizeStatus::overflow;
  *out = v * found->factor;
  return SizeStatus::ok;
}

constexpr const char* kSizeExpected =
    "expected a size: an integer with an optional unit B, K/M/G/T (base 1000) or Ki/Mi/Gi/Ti (base 1024), "
    "optionally followed by B, e.g. 8Gi or 8000M";
constexpr const char* kHamiExpected = "expected bytes or an integer with a k/m/g suffix (base 1024), e.g. 4096m";

void explain_size(platform::Text& t, SizeStatus st, Span unit, const char* expected) {
  switch (st) {
    case SizeStatus::ok: break;
    case SizeStatus::empty: t.str("empty value, "); break;
    case SizeStatus::not_a_number: t.str("not a non-negative integer, "); break;
    case SizeStatus::overflow: t.str("too large (over 2^64-1 bytes), "); break;
    case SizeStatus::fraction: t.str("fractions are not accepted (use a smaller unit: 1536Mi, not 1.5Gi), "); break;
    case SizeStatus::bad_unit:
      t.str("unknown unit or trailing characters ");
      quote_span(t, unit, 32).str(" (units are case-sensitive), ");
      break;
  }
  t.str(expected);
}

bool parse_path(const char* name, const char* value, bool absolute, std::size_t max, char* dst, std::size_t cap,
                shm::Error* err) {
  const std::size_t n = platform::bounded_len(value, max + 1);
  if (n == 0) {
    fail(err, name, value)
        .str("empty value, expected ")
        .str(absolute ? "an absolute file path" : "a library path or name")
        .str(" (unset the variable for the default)");
    return false;
  }
  if (n > max || n >= cap) {
    fail(err, name, value).str("path too long, expected at most ").u64(max).str(" bytes");
    return false;
  }
  for (std::size_t i = 0; i < n; ++i) {
    if (static_cast<unsigned char>(value[i]) < 0x20 || value[i] == 0x7f) {
      fail(err, name, value).str("control character in the path, expected a plain path");
      return false;
    }
  }
  if (absolute && (value[0] != '/' || value[n - 1] == '/')) {
    fail(err, name, value)
        .str(value[0] != '/' ? "relative path (processes with another working directory would not share it)"
                             : "ends with '/'")
        .str(", expected an absolute path such as /dev/shm/gpuslice.region");
    return false;
  }
  platform::copy_string(dst, cap, value);
  return true;
}

// ---- flags, durations -----------------------------------------------------------

bool parse_flag_span(Span s, bool* out) {
  static constexpr const char* kTrue[] = {"true", "1", "yes", "on"};
  static constexpr const char* kFalse[] = {"false", "0", "no", "off"};
  for (const char* w : kTrue) {
    if (span_equals(s, w, true)) return *out = true, true;
  }
  for (const char* w : kFalse) {
    if (span_equals(s, w, true)) return *out = false, true;
  }
  return false;
}

constexpr std::uint64_t kMaxDurationMs = 3600000;  // one hour

bool parse_duration_span(Span s, std::uint32_t* out) {
  std::uint64_t v = 0;
  std::size_t i = 0;
  for (; i < s.n && is_digit(s.p[i]); ++i) {
    v = v * 10 + static_cast<std::uint64_t>(s.p[i] - '0');
    if (v > kMaxDurationMs * 1000) return false;
  }
  if (i == 0) return false;
  const Span unit{s.p + i, s.n - i};
  if (span_equals(unit, "s", false)) {
    v *= 1000;
  } else if (!span_equals(unit, "", false) && !span_equals(unit, "ms", false)) {
    return false;
  }
  if (v > kMaxDurationMs) return false;
  *out = static_cast<std::uint32_t>(v);
  return true;
}

constexpr std::size_t kMaxRegionPathLength = kMaxRegionPath;

}  // namespace

bool span_equals(Span s, const char* word, bool any_case) {
  std::size_t i = 0;
  for (; i < s.n; ++i) {
    if (word[i] == '\0') return false;
    if (any_case ? lower(s.p[i]) != lower(word[i]) : s.p[i] != word[i]) return false;
  }
  return word[i] == '\0';
}

// "gpuslice: NAME='value': " -- the caller appends "<what>, expected <what>".
platform::Text fail(shm::Error* err, const char* name, const char* value) {
  platform::Text t(err->message, sizeof err->message);
  t.str("gpuslice: ").str(name).ch('=').quoted(value, kValueShown).str(": ");
  return t;
}

void set_source(OptionSource* s, const char* name) {
  platform::copy_string(s->name, sizeof s->name, name);
  s->line = 0;
}

// ---- percentages -----------------------------------------------------------

bool parse_percent_span(Span s, std::uint32_t min, bool allow_percent_sign, std::uint32_t* out) {
  if (allow_percent_sign && s.n > 0 && s.p[s.n - 1] == '%') --s.n;
  if (s.n == 0 || s.n > 3) return false;
  std::uint32_t v = 0;
  for (std::size_t i = 0; i < s.n; ++i) {
    if (!is_digit(s.p[i])) return false;
    v = v * 10 + static_cast<std::uint32_t>(s.p[i] - '0');
  }
  if (v < min || v > 100) return false;
  *out = v;
  return true;
}

bool parse_quota(Span s, std::uint64_t* out, platform::Text& t) {
  Span unit{};
  const SizeStatus st = parse_size_span(s, kUnits, out, &unit);
  if (st != SizeStatus::ok) {
    explain_size(t, st, unit, kSizeExpected);
    return false;
  }
  if (*out == 0) {
    t.str(
        "a quota of 0 bytes would refuse every allocation, expected a positive size "
        "(unset the variable for no quota)");
    return false;
  }
  if (*out == kUnlimited) {  // the region's word for "no quota": never a quota by accident
    t.str("2^64-1 bytes is not a quota, expected a smaller size (unset the variable for no quota)");
    return false;
  }
  return true;
}

bool parse_sm(Span s, std::uint32_t* out, platform::Text& t) {
  if (parse_percent_span(s, 1, true, out)) return true;
  if (s.n == 1 && s.p[0] == '0') {
    t.str("0% would forbid all compute, ");
  } else if (s.n == 0) {
    t.str("empty value, ");
  }
  t.str("expected an integer percentage 1-100 (optionally followed by %; 100 = unlimited)");
  return false;
}

// "8Gi" (every device) or "0=8Gi,1=4Gi".
template <class T>
bool parse_per_device(const char* name, const char* value, ParseOne<T> one, PerDevice<T>* out, shm::Error* err) {
  for (std::uint32_t d = 0; d < kMaxDevices; ++d) out->set[d] = false;
  const std::size_t n = length(value);
  bool list = false;
  for (std::size_t i = 0; i < n; ++i) list = list || value[i] == '=';
  if (!list) {
    platform::Text t = fail(err, name, value);
    T v{};
    if (!one(Span{value, n}, &v, t)) return false;
    for (std::uint32_t d = 0; d < kMaxDevices; ++d) {
      out->value[d] = v;
      out->set[d] = true;
    }
    err->message[0] = '\0';
    return true;
  }
  std::size_t pos = 0;
  for (;;) {
    std::size_t end = pos;
    while (end < n && value[end] != ',') ++end;
    const Span entry{value + pos, end - pos};
    std::size_t eq = 0;
    while (eq < entry.n && entry.p[eq] != '=') ++eq;
    if (entry.n == 0) {
      fail(err, name, value).str("empty entry in the list, expected <device>=<value> entries separated by commas");
      return false;
    }
    if (eq == entry.n) {
      platform::Text t = fail(err, name, value);
      t.str("entry ");
      quote_span(t, entry, 60)
          .str(
              " has no device index, expected <device>=<value> for every entry "
              "(or a single value for all devices)");
      return false;
    }
    std::uint32_t index = 0;
    bool index_ok = eq > 0 && eq <= 2 && !(eq == 2 && entry.p[0] == '0');
    for (std::size_t i = 0; i < eq && index_ok; ++i) {
      index_ok = is_digit(entry.p[i]);
      index = index * 10 + static_cast<std::uint32_t>(entry.p[i] - '0');
    }
    if (!index_ok || index >= kMaxDevices) {
      platform::Text t = fail(err, name, value);
      t.str("bad device index ");
      quote_span(t, Span{entry.p, eq}, 12).str(", expected a device index 0-").u64(kMaxDevices - 1);
      return false;
    }
    if (out->set[index]) {
      fail(err, name, value).str("device ").u64(index).str(" is listed twice, expected each device at most once");
      return false;
    }
    platform::Text t = fail(err, name, value);
    t.str("device ").u64(index).str(": ");
    if (!one(Span{entry.p + eq + 1, entry.n - eq - 1}, &out->value[index], t)) return false;
    out->set[index] = true;
    if (end == n) break;
    pos = end + 1;
  }
  err->message[0] = '\0';
  return true;
}
template bool parse_per_device<std::uint64_t>(const char*, const char*, ParseOne<std::uint64_t>,
                                              PerDevice<std::uint64_t>*, shm::Error*);
template bool parse_per_device<std::uint32_t>(const char*, const char*, ParseOne<std::uint32_t>,
                                              PerDevice<std::uint32_t>*, shm::Error*);

// ---- one value of each type ---------------------------------------------------

bool Scalar<OptionType::flag>::parse(const OptionInfo&, Span v, bool* dst, platform::Text& t) {
  if (parse_flag_span(v, dst)) return true;
  t.str(v.n == 0 ? "empty value" : "unknown value").str(", expected true or false (also 1/0, yes/no, on/off)");
  return false;
}

bool Scalar<OptionType::duration_ms>::parse(const OptionInfo&, Span v, std::uint32_t* dst, platform::Text& t) {
  if (parse_duration_span(v, dst)) return true;
  t.str(v.n == 0 ? "empty value" : "not a duration")
      .str(", expected milliseconds 0-3600000, or a number followed by ms or s (at most 3600s), e.g. 30s");
  return false;
}

bool parse_path_into(const OptionInfo& info, const char* value, char* dst, std::size_t cap, shm::Error* err,
                     const char* name) {
  const bool absolute = platform::starts_with(info.range, "absolute");
  return parse_path(name, value, absolute, absolute ? kMaxRegionPathLength : cap - 1, dst, cap, err);
}

bool parse_name_into(const char* name, const char* value, char* dst, std::size_t cap, shm::Error* err) {
  const std::size_t n = platform::bounded_len(value, cap);
  if (n == 0 || n >= cap) {
    fail(err, name, value)
        .str(n == 0 ? "empty value" : "too long")
        .str(", expected 1 to ")
        .u64(cap - 1)
        .str(" printable ASCII characters (unset the variable for none)");
    return false;
  }
  for (std::size_t i = 0; i < n; ++i) {
    const auto c = static_cast<unsigned char>(value[i]);
    if (c < 0x20 || c >= 0x7f) {
      fail(err, name, value)
          .str("character ")
          .u64(i)
          .str(" is not printable ASCII, expected 1 to ")
          .u64(cap - 1)
          .str(" printable ASCII characters");
      return false;
    }
  }
  platform::copy_string(dst, cap, value);
  return true;
}

// ---- HAMi-core's grammars (the aliases) -------------------------------------

bool parse_alias_memory(Span s, std::uint64_t* out, platform::Text& t) {
  Span unit{};
  const SizeStatus st = parse_size_span(s, kHamiUnits, out, &unit);
  if (st == SizeStatus::ok) {
    if (*out != kUnlimited) return true;
    t.str("2^64-1 bytes is not a quota, expected a smaller size (or 0 for none)");
    return false;
  }
  explain_size(t, st, unit, kHamiExpected);
  return false;
}

bool parse_alias_sm(Span s, std::uint32_t* out, platform::Text& t) {
  if (parse_percent_span(s, 0, false, out)) {
    if (*out == 0) *out = 100;  // HAMi-core: 0 = no limit
    return true;
  }
  if (s.n == 0) t.str("empty value, ");
  t.str("expected an integer 0-100 (0 = unlimited)");
  return false;
}

}  // namespace values

using namespace values;

bool parse_size(const char* text, std::uint64_t* out) noexcept {
  if (text == nullptr) return false;
  Span unit{};
  std::uint64_t v = 0;
  if (parse_size_span(Span{text, length(text)}, kUnits, &v, &unit) != SizeStatus::ok) return false;
  *out = v;
  return true;
}

bool parse_hami_size(const char* text, std::uint64_t* out) noexcept {
  if (text == nullptr) return false;
  Span unit{};
  std::uint64_t v = 0;
  if (parse_size_span(Span{text, length(text)}, kHamiUnits, &v, &unit) != SizeStatus::ok) return false;
  *out = v;
  return true;
}

bool parse_percent(const char* text, std::uint32_t* out) noexcept {
  return text != nullptr && parse_percent_span(Span{text, length(text)}, 1, true, out);
}

}  // namespace gpuslice::options
