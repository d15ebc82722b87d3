// The option parser, first step: which variables of the environment set
// which option or alias (env.h).
#include "limiter/options/env.h"

#include "platform/text.h"

namespace gpuslice::options::env {
namespace {

using platform::Text;

constexpr std::size_t kValueShown = 100;  // output characters of a value quoted in a message

bool is_digit(char c) { return c >= '0' && c <= '9'; }

std::size_t length(const char* s) {
  std::size_t n = 0;
  while (s[n] != '\0') ++n;
  return n;
}

// If entry is "name=value", returns value.
const char* value_of(const char* entry, const char* name) {
  std::size_t i = 0;
  for (; name[i] != '\0'; ++i) {
    if (entry[i] != name[i]) return nullptr;
  }
  return entry[i] == '=' ? entry + i + 1 : nullptr;
}

// "CUDA_DEVICE_MEMORY_LIMIT_<i>=v": index (or -1 if malformed: an error) and value.
const char* per_device_alias(const char* entry, const char* alias, int* index) {
  const std::size_t n = length(alias);
  for (std::size_t i = 0; i < n; ++i) {
    if (entry[i] != alias[i]) return nullptr;
  }
  if (entry[n] != '_') return nullptr;
  std::size_t i = n + 1;
  std::uint32_t v = 0;
  std::size_t digits = 0;
  for (; is_digit(entry[i]); ++i, ++digits) v = v * 10 + static_cast<std::uint32_t>(entry[i] - '0');
  const char* eq = entry + i;
  while (*eq != '\0' && *eq != '=') ++eq;
  if (*eq != '=') return nullptr;  // no value at all: not a variable assignment
  const bool canonical = digits >= 1 && digits <= 2 && !(digits == 2 && entry[n + 1] == '0');
  *index = (canonical && entry[i] == '=' && v < kMaxDevices) ? static_cast<int>(v) : -1;
  return eq + 1;
}

}  // namespace

bool collect(char* const* envp, Found* f, Options* out, shm::Error* err) {
  for (std::size_t k = 0; k < kOptionCount; ++k) f->ours[k] = nullptr;
  for (std::size_t a = 0; a < kOptionAliasCount; ++a) {
    f->alias[a] = nullptr;
    for (std::uint32_t d = 0; d < kMaxDevices; ++d) f->alias_device[a][d] = f->alias_device_name[a][d] = nullptr;
  }
  if (envp == nullptr) return true;
  for (char* const* e = envp; *e != nullptr; ++e) {
    const char* entry = *e;
    bool known = false;
    for (std::size_t k = 0; k < kOptionCount && !known; ++k) {
      if (const char* v = value_of(entry, kOptions[k].env)) {
        if (f->ours[k] == nullptr) f->ours[k] = v;  // the first wins, as with getenv
        known = true;
      }
    }
    for (std::size_t a = 0; a < kOptionAliasCount && !known; ++a) {
      const OptionAlias& alias = kOptionAliases[a];
      if (const char* v = value_of(entry, alias.env)) {
        if (f->alias[a] == nullptr) f->alias[a] = v;
        known = true;
        continue;
      }
      if (!alias.per_device) continue;
      int index = 0;
      if (const char* v = per_device_alias(entry, alias.env, &index)) {
        if (index < 0) {
          platform::Text t(err->message, sizeof err->message);
          t.str("gpuslice: ");
          t.str(entry, static_cast<std::size_t>(v - 1 - entry) < 60 ? static_cast<std::size_t>(v - 1 - entry) : 60);
          t.ch('=')
              .quoted(v, kValueShown)
              .str(": bad device index in the variable name, expected ")
              .str(alias.env)
              .str("_<i> with i in 0-")
              .u64(kMaxDevices - 1);
          return false;
        }
        if (f->alias_device[a][index] == nullptr) {
          f->alias_device[a][index] = v;
          f->alias_device_name[a][index] = entry;
        }
        known = true;
      }
    }
    bool assignment = false;
    for (const char* c = entry; *c != '\0' && !assignment; ++c) assignment = *c == '=';
    if (!known && assignment && platform::starts_with(entry, "GPUSLICE_") && out->unknown_variable[0] == '\0') {
      std::size_t n = 0;
      while (entry[n] != '\0' && entry[n] != '=' && n + 1 < sizeof out->unknown_variable) {
        out->unknown_variable[n] = entry[n];
        ++n;
      }
      out->unknown_variable[n] = '\0';
    }
  }
  return true;
}

Name classify(const char* entry) {
  for (const OptionInfo& o : kOptions) {
    if (value_of(entry, o.env) != nullptr) return Name::option;
  }
  for (const OptionAlias& alias : kOptionAliases) {
    if (value_of(entry, alias.env) != nullptr) return Name::alias;
    int index = 0;
    if (alias.per_device && per_device_alias(entry, alias.env, &index) != nullptr)
      return index < 0 ? Name::bad_device_index : Name::alias;
  }
  return Name::unknown;
}

namespace {
bool targets(const OptionAlias& alias, std::size_t k) {
  const char* a = alias.target;
  const char* b = kOptions[k].env;
  while (*a != '\0' && *a == *b) ++a, ++b;
  return *a == *b;
}
}  // namespace

bool sets(const Found& f, std::size_t k) {
  if (f.ours[k] != nullptr) return true;
  for (std::size_t a = 0; a < kOptionAliasCount; ++a) {
    if (!targets(kOptionAliases[a], k)) continue;
    if (f.alias[a] != nullptr) return true;
    for (std::uint32_t d = 0; d < kMaxDevices; ++d) {
      if (f.alias_device[a][d] != nullptr) return true;
    }
  }
  return false;
}

void take(Found* to, const Found& from, std::size_t k) {
  to->ours[k] = from.ours[k];
  for (std::size_t a = 0; a < kOptionAliasCount; ++a) {
    if (!targets(kOptionAliases[a], k)) continue;
    to->alias[a] = from.alias[a];
    for (std::uint32_t d = 0; d < kMaxDevices; ++d) {
      to->alias_device[a][d] = from.alias_device[a][d];
      to->alias_device_name[a][d] = from.alias_device_name[a][d];
    }
  }
}

namespace {

char lower(char c) { return c >= 'A' && c <= 'Z' ? static_cast<char>(c - 'A' + 'a') : c; }

// value as a decimal integer with an optional '-': digits only otherwise.
bool integer(const char* value, bool* negative, std::uint64_t* magnitude) {
  *negative = value[0] == '-';
  const char* p = value + (*negative ? 1 : 0);
  if (!is_digit(*p)) return false;
  std::uint64_t v = 0;
  for (; is_digit(*p); ++p) {
    if (v > 1000000000000ull) v = 1000000000000ull;  // large enough for any key: saturate
    v = v * 10 + static_cast<std::uint64_t>(*p - '0');
  }
  *magnitude = v;
  return *p == '\0';
}

bool key_matches(const char* key, std::size_t key_len, const char* value, bool* fallback) {
  *fallback = false;
  if (key_len == 1 && key[0] == '*') return *fallback = true, true;
  bool negative = false;
  std::uint64_t magnitude = 0;
  const bool is_integer = integer(value, &negative, &magnitude);
  if (key_len == 1 && key[0] == '-') return is_integer && negative && magnitude > 0;
  if (key_len >= 2 && key[key_len - 1] == '+') {
    std::uint64_t min = 0;
    for (std::size_t i = 0; i + 1 < key_len; ++i) min = min * 10 + static_cast<std::uint64_t>(key[i] - '0');
    return is_integer && (!negative || magnitude == 0) && magnitude >= min;
  }
  bool digits = key_len > 0;
  std::uint64_t number = 0;
  for (std::size_t i = 0; i < key_len && digits; ++i) {
    digits = is_digit(key[i]);
    number = number * 10 + static_cast<std::uint64_t>(key[i] - '0');
  }
  if (digits) return is_integer && (!negative || magnitude == 0) && magnitude == number;  // "02" is 2, as atoi says
  std::size_t i = 0;
  for (; i < key_len; ++i) {
    if (value[i] == '\0' || lower(value[i]) != lower(key[i])) return false;
  }
  return value[i] == '\0';
}

}  // namespace

bool match_alias(const char* map, const char* value, const char** word, std::size_t* n, bool* fallback) {
  for (const char* p = map; *p != '\0';) {
    const char* eq = p;
    while (*eq != '=') ++eq;
    const char* end = eq + 1;
    while (*end != '\0' && *end != ',') ++end;
    if (key_matches(p, static_cast<std::size_t>(eq - p), value, fallback)) {
      *word = eq + 1;
      *n = static_cast<std::size_t>(end - eq - 1);
      return true;
    }
    p = *end == ',' ? end + 1 : end;
  }
  *fallback = false;
  return false;
}

void list_alias_keys(const char* map, char* buf, std::size_t cap) {
  platform::Text t(buf, cap);
  bool first = true;
  for (const char* p = map; *p != '\0';) {
    const char* eq = p;
    while (*eq != '=') ++eq;
    const std::size_t n = static_cast<std::size_t>(eq - p);
    if (!(n == 1 && p[0] == '*')) {
      if (!first) t.str(", ");
      first = false;
      if (n == 1 && p[0] == '-') {
        t.str("a negative integer");
      } else if (n >= 2 && p[n - 1] == '+') {
        t.str(p, n - 1).str(" and above");
      } else {
        t.str(p, n);
      }
    }
    while (*eq != '\0' && *eq != ',') ++eq;
    p = *eq == ',' ? eq + 1 : eq;
  }
}

void name_of(const char* entry, char* buf, std::size_t cap) {
  std::size_t n = 0;
  while (entry[n] != '\0' && entry[n] != '=' && n + 1 < cap) {
    buf[n] = entry[n];
    ++n;
  }
  buf[n] = '\0';
}

}  // namespace gpuslice::options::env
