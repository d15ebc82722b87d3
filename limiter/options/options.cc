// Option resolution: for each entry of options.def (a missing handler is a
// compile error), which variable sets it -- ours, a HAMi alias (per device or
// global), the configuration file, or the default -- in order of precedence,
// with errors that name the variable and value. The value grammars are
// limiter/options/values.cc.
#include "limiter/options/options.h"

#include <unistd.h>

#include "gpuslice/options.h"
#include "limiter/options/env.h"
#include "limiter/options/values.h"
#include "platform/text.h"

namespace gpuslice::options {
namespace {

using platform::Text;
using namespace values;
using env::Found;
using env::name_of;

std::size_t option_index(const char* env) {
  for (std::size_t k = 0; k < kOptionCount; ++k) {
    if (platform::starts_with(kOptions[k].env, env) && length(kOptions[k].env) == length(env)) return k;
  }
  return kOptionCount;
}

// The alias (index into kOptionAliases) of option k that the environment set,
// per form; kOptionAliasCount if none.
std::size_t alias_of(const Found& f, std::size_t k, bool per_device) {
  for (std::size_t a = 0; a < kOptionAliasCount; ++a) {
    if (option_index(kOptionAliases[a].target) != k || kOptionAliases[a].per_device != per_device) continue;
    if (f.alias[a] != nullptr) return a;
    if (per_device) {
      for (std::uint32_t d = 0; d < kMaxDevices; ++d) {
        if (f.alias_device[a][d] != nullptr) return a;
      }
    }
  }
  return kOptionAliasCount;
}

// A scalar alias's value translated through its map into our grammar, in buf.
// Returns false (err set) for a value the map does not know; *empty when the
// map says "not set". A value only the map's `*` key takes (one HAMi gives no
// meaning we keep: an unknown log level, priority or core policy) maps to
// that key's word and is reported by alias_fallback_warning.
bool map_alias(const OptionAlias& alias, const char* value, char* buf, std::size_t cap, bool* empty, shm::Error* err) {
  *empty = false;
  if (alias.map == nullptr) {
    platform::copy_string(buf, cap, value);
    return true;
  }
  const char* word = nullptr;
  std::size_t n = 0;
  bool fallback = false;
  if (env::match_alias(alias.map, value, &word, &n, &fallback)) {
    platform::copy_string(buf, n + 1 < cap ? n + 1 : cap, word);
    *empty = n == 0;
    return true;
  }
  char keys[160];
  env::list_alias_keys(alias.map, keys, sizeof keys);
  fail(err, alias.env, value)
      .str(value[0] == '\0' ? "empty value" : "unknown value")
      .str(", expected one of ")
      .str(keys)
      .str(" (")
      .str(alias.doc)
      .ch(')');
  return false;
}

// The first alias value of f that only a `*` key took (and that decided its
// option: ours not set), as a warning line in out->alias_warning.
void alias_fallback_warning(const Found& f, Options* out) {
  out->alias_warning[0] = '\0';
  for (std::size_t a = 0; a < kOptionAliasCount; ++a) {
    const OptionAlias& alias = kOptionAliases[a];
    if (alias.map == nullptr || f.alias[a] == nullptr || f.ours[option_index(alias.target)] != nullptr) continue;
    const char* word = nullptr;
    std::size_t n = 0;
    bool fallback = false;
    if (!env::match_alias(alias.map, f.alias[a], &word, &n, &fallback) || !fallback) continue;
    char keys[160];
    env::list_alias_keys(alias.map, keys, sizeof keys);
    platform::Text t(out->alias_warning, sizeof out->alias_warning);
    t.str(alias.env)
        .ch('=')
        .quoted(f.alias[a], kValueShown)
        .str(f.alias[a][0] == '\0' ? ": empty value" : ": unknown value")
        .str(" (HAMi knows ")
        .str(keys)
        .str("), taken as ");
    if (n == 0) {
      t.str("not set");
    } else {
      t.str(alias.target).ch('=').str(word, n);
    }
    return;
  }
}

// The default column of options.def: the value, optionally followed by a
// remark in parentheses; `<uid>` stands for the real user id.
void default_text(const OptionInfo& info, char* buf, std::size_t cap) {
  platform::Text t(buf, cap);
  for (const char* p = info.default_value; *p != '\0'; ++p) {
    if (p[0] == ' ' && p[1] == '(') break;
    if (platform::starts_with(p, "<uid>")) {
      t.u64(getuid());
      p += 4;
      continue;
    }
    t.ch(*p);
  }
}

// ---- resolving one option of each type ---------------------------------------

// A scalar (choice words, flags, durations): `parse(Span, Value*, Text&)`
// reads a value of its grammar.
template <class Value, class Parse>
bool resolve_scalar(const Found& f, std::size_t k, Parse parse, Value& dst, OptionSource& src, shm::Error* err) {
  const OptionInfo& info = kOptions[k];
  char text[128];
  default_text(info, text, sizeof text);
  platform::Text ignored(err->message, sizeof err->message);
  if (!parse(Span{text, length(text)}, &dst, ignored)) {
    fail(err, info.env, text).str("options.def default does not parse (a bug in the table)");
    return false;
  }
  set_source(&src, "default");
  const char* value = f.ours[k];
  const char* from = info.env;
  char mapped[128];
  if (value == nullptr) {
    const std::size_t a = alias_of(f, k, false);
    if (a == kOptionAliasCount) return true;
    bool empty = false;
    if (!map_alias(kOptionAliases[a], f.alias[a], mapped, sizeof mapped, &empty, err)) return false;
    if (empty) return true;
    value = mapped;
    from = kOptionAliases[a].env;
  }
  platform::Text t = fail(err, from, value == mapped ? f.alias[alias_of(f, k, false)] : value);
  if (!parse(Span{value, length(value)}, &dst, t)) return false;
  set_source(&src, from);
  return true;
}

template <OptionType T>
struct Resolve {  // flags and durations
  using Value = typename OptionStorage<T>::value;
  static bool run(const Found& f, std::size_t k, Value& dst, OptionSource& src, shm::Error* err) {
    const OptionInfo& info = kOptions[k];
    const auto parse = [&info](Span v, Value* out, platform::Text& t) { return Scalar<T>::parse(info, v, out, t); };
    return resolve_scalar(f, k, parse, dst, src, err);
  }
};

// A choice: its words (options.def) and nothing else.
template <class E, std::size_t N>
bool resolve_choice(const Found& f, std::size_t k, const Word<E> (&table)[N], E& dst, OptionSource& src,
                    shm::Error* err) {
  const auto parse = [&table](Span v, E* out, platform::Text& t) { return parse_choice(table, v, out, t); };
  return resolve_scalar(f, k, parse, dst, src, err);
}

template <OptionType T>
struct ResolveText {  // paths and names
  template <std::size_t N>
  static bool run(const Found& f, std::size_t k, char (&dst)[N], OptionSource& src, shm::Error* err) {
    const OptionInfo& info = kOptions[k];
    default_text(info, dst, N);
    set_source(&src, "default");
    const char* value = f.ours[k];
    const char* from = info.env;
    char mapped[N];
    if (value == nullptr) {
      const std::size_t a = alias_of(f, k, false);
      if (a == kOptionAliasCount) return true;
      bool empty = false;
      if (!map_alias(kOptionAliases[a], f.alias[a], mapped, N, &empty, err)) return false;
      if (empty) return true;
      value = mapped;
      from = kOptionAliases[a].env;
    }
    const bool ok = T == OptionType::path ? parse_path_into(info, value, dst, N, err, from)
                                          : parse_name_into(from, value, dst, N, err);
    if (ok) set_source(&src, from);
    return ok;
  }
};
template <>
struct Resolve<OptionType::path> : ResolveText<OptionType::path> {};
template <>
struct Resolve<OptionType::name> : ResolveText<OptionType::name> {};

// Per-device options: ours > per-device alias > global alias > default.
template <class V>
bool resolve_per_device(const Found& f, std::size_t k, ParseOne<V> ours_one, ParseOne<V> alias_one, V default_value,
                        V (&values)[kMaxDevices], OptionSource (&sources)[kMaxDevices], shm::Error* err) {
  const char* our_name = kOptions[k].env;
  for (std::uint32_t d = 0; d < kMaxDevices; ++d) {
    values[d] = default_value;
    set_source(&sources[d], "default");
  }
  PerDevice<V> ours{}, global{}, device{};
  for (std::uint32_t d = 0; d < kMaxDevices; ++d) ours.set[d] = global.set[d] = device.set[d] = false;
  const char* ours_value = f.ours[k];
  if (ours_value != nullptr && !parse_per_device(our_name, ours_value, ours_one, &ours, err)) return false;
  const std::size_t a = alias_of(f, k, true);
  if (a != kOptionAliasCount) {
    const char* alias_name = kOptionAliases[a].env;
    if (const char* v = f.alias[a]) {
      platform::Text t = fail(err, alias_name, v);
      V value{};
      if (!alias_one(Span{v, length(v)}, &value, t)) return false;
      if (value != 0) {  // CUDA_DEVICE_MEMORY_LIMIT=0: not set
        for (std::uint32_t d = 0; d < kMaxDevices; ++d) {
          global.value[d] = value;
          global.set[d] = true;
        }
      }
    }
    for (std::uint32_t d = 0; d < kMaxDevices; ++d) {
      const char* v = f.alias_device[a][d];
      if (v == nullptr) continue;
      char name[64];
      name_of(f.alias_device_name[a][d], name, sizeof name);
      platform::Text t = fail(err, name, v);
      if (!alias_one(Span{v, length(v)}, &device.value[d], t)) return false;
      device.set[d] = device.value[d] != 0;
    }
    for (std::uint32_t d = 0; d < kMaxDevices; ++d) {
      if (ours.set[d]) continue;
      if (device.set[d]) {
        values[d] = device.value[d];
        name_of(f.alias_device_name[a][d], sources[d].name, sizeof sources[d].name);
      } else if (global.set[d]) {
        values[d] = global.value[d];
        set_source(&sources[d], alias_name);
      }
    }
  }
  for (std::uint32_t d = 0; d < kMaxDevices; ++d) {
    if (!ours.set[d]) continue;
    values[d] = ours.value[d];
    set_source(&sources[d], our_name);
  }
  err->message[0] = '\0';
  return true;
}

template <>
struct Resolve<OptionType::per_device_size> {
  static bool run(const Found& f, std::size_t k, std::uint64_t (&dst)[kMaxDevices], OptionSource (&src)[kMaxDevices],
                  shm::Error* err) {
    return resolve_per_device<std::uint64_t>(f, k, parse_quota, parse_alias_memory, kUnlimited, dst, src, err);
  }
};
template <>
struct Resolve<OptionType::per_device_percent> {
  static bool run(const Found& f, std::size_t k, std::uint32_t (&dst)[kMaxDevices], OptionSource (&src)[kMaxDevices],
                  shm::Error* err) {
    char text[16];
    default_text(kOptions[k], text, sizeof text);
    std::uint32_t def = 100;
    parse_percent_span(Span{text, length(text)}, 1, true, &def);
    return resolve_per_device<std::uint32_t>(f, k, parse_sm, parse_alias_sm, def, dst, src, err);
  }
};

// HAMi's GPU_CORE_UTILIZATION_POLICY=disable: no SM limit from its own aliases.
void apply_core_policy_disable(const Found& f, Options* out) {
  for (std::size_t a = 0; a < kOptionAliasCount; ++a) {
    const OptionAlias& alias = kOptionAliases[a];
    if (!span_equals(Span{alias.env, length(alias.env)}, "GPU_CORE_UTILIZATION_POLICY", false)) continue;
    if (f.alias[a] == nullptr || !span_equals(Span{f.alias[a], length(f.alias[a])}, "disable", true)) return;
    for (std::uint32_t d = 0; d < kMaxDevices; ++d) {
      if (platform::starts_with(out->sm_limit_source[d].name, "CUDA_DEVICE_SM_LIMIT")) {
        out->sm_limit[d] = 100;
        set_source(&out->sm_limit_source[d], alias.env);
      }
    }
  }
}

enum class OptionId {
#define GPUSLICE_OPTION(id, env, type, def, range, doc) id,
#include "gpuslice/options.def"
#undef GPUSLICE_OPTION
};

bool resolve_all(const Found& f, Options* out, shm::Error* err) {
#define GPUSLICE_OPTION(id, env, kind, def, range, doc)                                                           \
  if (!Resolve<OptionType::kind>::run(f, static_cast<std::size_t>(OptionId::id), out->id, out->id##_source, err)) \
    return false;
#define GPUSLICE_CHOICE(id, env, kind, Enum, def, word_list, doc)                                            \
  if (!resolve_choice(f, static_cast<std::size_t>(OptionId::id), words::id, out->id, out->id##_source, err)) \
    return false;
#include "gpuslice/options.def"
#undef GPUSLICE_CHOICE
#undef GPUSLICE_OPTION
  apply_core_policy_disable(f, out);
  alias_fallback_warning(f, out);
  if (out->passthrough) {
    // Everything passes through: no limit of any kind applies.
    const char* why = out->passthrough_source.name;
    for (std::uint32_t d = 0; d < kMaxDevices; ++d) {
      out->memory_limit[d] = kUnlimited;
      out->memory_resident[d] = kUnlimited;
      out->sm_limit[d] = 100;
      set_source(&out->memory_limit_source[d], why);
      set_source(&out->memory_resident_source[d], why);
      set_source(&out->sm_limit_source[d], why);
    }
    out->priority = Priority::normal;
    out->oversubscribe = kOversubscribeFail;
    set_source(&out->priority_source, why);
    set_source(&out->oversubscribe_source, why);
  }
  return true;
}

}  // namespace

void default_options(Options* out) noexcept {
  Found f;
  shm::Error err;
  out->unknown_variable[0] = '\0';
  out->config_file_read = false;
  env::collect(nullptr, &f, out, &err);
  resolve_all(f, out, &err);  // the table's defaults always parse (tested)
}

bool resolve_found(const env::Found& f, Options* out, shm::Error* err) noexcept { return resolve_all(f, out, err); }

bool parse_options(char* const* envp, Options* out, shm::Error* err) noexcept {
  default_options(out);
  err->message[0] = '\0';
  Found f;
  if (!env::collect(envp, &f, out, err)) return false;
  if (!resolve_all(f, out, err)) return false;
  err->message[0] = '\0';
  return true;
}

}  // namespace gpuslice::options
