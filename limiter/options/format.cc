// Printing options: the README table and the debug listing of effective values.
#include "gpuslice/options.h"
#include "limiter/options/options.h"
#include "platform/text.h"

namespace gpuslice::options {
namespace {

using platform::Text;

// A Markdown table cell: '|' would end the cell.
platform::Text& cell(platform::Text& t, const char* s) {
  for (; *s != '\0'; ++s) {
    if (*s == '|') t.ch('\\');
    t.ch(*s);
  }
  return t;
}

int finish(const platform::Text& t) { return t.truncated() ? -1 : static_cast<int>(t.size()); }

platform::Text& line(platform::Text& t, const char* name) { return t.str("gpuslice: ").str(name); }

bool is_default(const OptionSource& s) {
  const char* d = "default";
  const char* p = s.name;
  for (; *d != '\0' && *p == *d; ++p, ++d) {}
  return *d == '\0' && *p == '\0';
}

// Where the value came from: "(default)", "(NAME, environment)" or
// "(NAME, FILE:LINE)" for a line of the configuration file.
platform::Text& tail(platform::Text& t, const OptionSource& src, const char* file) {
  if (is_default(src)) return t.str(" (default)\n");
  t.str(" (").str(src.name).str(", ");
  if (src.line == 0) return t.str("environment)\n");
  return t.escaped(file).ch(':').u64(src.line).str(")\n");
}

bool all_set(const OptionSource (&sources)[kMaxDevices]) {
  for (const OptionSource& s : sources) {
    if (is_default(s)) return false;
  }
  return true;
}

}  // namespace

int format_options_markdown(char* buf, std::size_t cap) noexcept {
  platform::Text t(buf, cap);
  t.str("| Variable | Default | Accepted values | Description |\n");
  t.str("|---|---|---|---|\n");
  for (const OptionInfo& o : kOptions) {
    t.str("| `").str(o.env).str("` | ");
    if (o.default_value[0] == '\0') {
      t.str("(empty)");
    } else {
      t.ch('`');
      cell(t, o.default_value).ch('`');
    }
    t.str(" | ");
    cell(t, o.range).str(" | ");
    cell(t, o.doc).str(" |\n");
  }
  t.str(
      "\nAliases (HAMi-core names, so that gpuslice drops into existing deployments; ours win, and for one "
      "device a per-device alias beats the global one):\n\n");
  t.str("| Alias | Same as | Accepted values |\n");
  t.str("|---|---|---|\n");
  for (const OptionAlias& a : kOptionAliases) {
    t.str("| `").str(a.env).str("`");
    if (a.per_device) t.str(", `").str(a.env).str("_<i>`");
    t.str(" | `").str(a.target).str("` | ");
    cell(t, a.doc).str(" |\n");
  }
  return finish(t);
}

namespace {

template <class V>
void per_device(platform::Text& t, const OptionInfo& info, const V (&values)[kMaxDevices],
                const OptionSource (&src)[kMaxDevices], bool size, const char* file) {
  bool any = false;
  for (std::uint32_t d = 0; d < kMaxDevices; ++d) {
    if (is_default(src[d])) continue;
    any = true;
    line(t, info.env).ch('[').u64(d).str("]=");
    if (size) {
      t.size(values[d]).str(" (").u64(values[d]).str(" bytes)");
    } else {
      t.u64(values[d]);
    }
    tail(t, src[d], file);
  }
  if (!any || !all_set(src)) {
    line(t, info.env).str(any ? "[other devices]" : "").ch('=');
    if (size && values[0] == kUnlimited) {
      t.str("unlimited");
    } else if (!any) {
      if (size)
        t.size(values[0]);
      else
        t.u64(values[0]);
    } else {
      t.str(info.default_value);
    }
    t.str(" (default)\n");
  }
}

template <OptionType T>
struct Print {
  template <class V, class S>
  static void run(platform::Text& t, const OptionInfo& info, const V& value, const S& src, const char* file) {
    line(t, info.env).ch('=');
    if constexpr (T == OptionType::flag) {
      t.str(value ? "true" : "false");
    } else if constexpr (T == OptionType::duration_ms) {
      t.u64(value).str("ms");
    } else {
      t.escaped(value, sizeof value);
    }
    tail(t, src, file);
  }
};
// A choice: the word of its value (options.def).
template <class E, std::size_t N>
void print_choice(platform::Text& t, const OptionInfo& info, const Word<E> (&table)[N], E value,
                  const OptionSource& src, const char* file) {
  line(t, info.env).ch('=').str(word_of(table, value));
  tail(t, src, file);
}
template <>
struct Print<OptionType::per_device_size> {
  static void run(platform::Text& t, const OptionInfo& info, const std::uint64_t (&v)[kMaxDevices],
                  const OptionSource (&s)[kMaxDevices], const char* file) {
    per_device(t, info, v, s, true, file);
  }
};
template <>
struct Print<OptionType::per_device_percent> {
  static void run(platform::Text& t, const OptionInfo& info, const std::uint32_t (&v)[kMaxDevices],
                  const OptionSource (&s)[kMaxDevices], const char* file) {
    per_device(t, info, v, s, false, file);
  }
};

}  // namespace

int format_effective_options(const Options& o, char* buf, std::size_t cap) noexcept {
  platform::Text t(buf, cap);
  std::size_t k = 0;
#define GPUSLICE_OPTION(id, env, kind, def, range, doc) \
  Print<OptionType::kind>::run(t, kOptions[k++], o.id, o.id##_source, o.config_file);
#define GPUSLICE_CHOICE(id, env, kind, Enum, def, word_list, doc) \
  print_choice(t, kOptions[k++], words::id, o.id, o.id##_source, o.config_file);
#include "gpuslice/options.def"
#undef GPUSLICE_CHOICE
#undef GPUSLICE_OPTION
  t.str("gpuslice: configuration file ")
      .escaped(o.config_file)
      .str(o.config_file_read ? ": read (the environment wins option by option)\n" : ": not read (absent)\n");
  if (o.alias_warning[0] != '\0') t.str("gpuslice: ").str(o.alias_warning).ch('\n');
  if (o.unknown_variable[0] != '\0') {
    t.str("gpuslice: ").escaped(o.unknown_variable).str(" is not a gpuslice option (ignored; a typo?)\n");
  }
  return finish(t);
}

}  // namespace gpuslice::options
