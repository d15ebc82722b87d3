// Printing options: the README table and the debug listing of effective values.
#include "gpuslice/options.h"
#include "limiter/options.h"
#include "shm/text.h"

namespace gpuslice::limiter {
namespace {

using shm::Text;

// A Markdown table cell: '|' would end the cell.
Text& cell(Text& t, const char* s) {
  for (; *s != '\0'; ++s) {
    if (*s == '|') t.ch('\\');
    t.ch(*s);
  }
  return t;
}

int finish(const Text& t) { return t.truncated() ? -1 : static_cast<int>(t.size()); }

Text& line(Text& t, const char* name) { return t.str("gpuslice: ").str(name); }

Text& tail(Text& t, const OptionSource& src) { return t.str(" (").str(src.name).str(")\n"); }

bool is_default(const OptionSource& s) {
  const char* d = "default";
  const char* p = s.name;
  for (; *d != '\0' && *p == *d; ++p, ++d) {
  }
  return *d == '\0' && *p == '\0';
}

bool all_set(const OptionSource (&sources)[kMaxDevices]) {
  for (const OptionSource& s : sources) {
    if (is_default(s)) return false;
  }
  return true;
}

}  // namespace

int format_options_markdown(char* buf, std::size_t cap) noexcept {
  Text t(buf, cap);
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
  t.str("\nAliases (HAMi-core names, so that gpuslice drops into existing deployments; ours win, and for one "
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

static_assert(kOptionCount == 8, "a new option in options.def: print it in format_effective_options");

int format_effective_options(const Options& o, char* buf, std::size_t cap) noexcept {
  Text t(buf, cap);
  bool any = false;
  for (std::uint32_t d = 0; d < kMaxDevices; ++d) {
    if (is_default(o.memory_limit_source[d])) continue;
    any = true;
    line(t, "GPUSLICE_MEMORY_LIMIT").ch('[').u64(d).str("]=");
    t.size(o.memory_limit[d]).str(" (").u64(o.memory_limit[d]).str(" bytes)");
    tail(t, o.memory_limit_source[d]);
  }
  if (!any || !all_set(o.memory_limit_source)) {
    line(t, "GPUSLICE_MEMORY_LIMIT").str(any ? "[other devices]" : "").str("=unlimited (default)\n");
  }
  any = false;
  for (std::uint32_t d = 0; d < kMaxDevices; ++d) {
    if (is_default(o.sm_limit_source[d])) continue;
    any = true;
    line(t, "GPUSLICE_SM_LIMIT").ch('[').u64(d).str("]=").u64(o.sm_limit[d]);
    tail(t, o.sm_limit_source[d]);
  }
  if (!any || !all_set(o.sm_limit_source)) {
    line(t, "GPUSLICE_SM_LIMIT").str(any ? "[other devices]" : "").str("=100 (default)\n");
  }
  line(t, "GPUSLICE_SM_POLICY").ch('=').str(o.sm_policy == SmPolicy::hard ? "hard" : "elastic");
  tail(t, o.sm_policy_source);
  line(t, "GPUSLICE_REGION").ch('=').escaped(o.region, sizeof o.region);
  tail(t, o.region_source);
  line(t, "GPUSLICE_CONTAINER_NAME").ch('=').escaped(o.container_name, sizeof o.container_name);
  tail(t, o.container_name_source);
  line(t, "GPUSLICE_REAL_LIBCUDA").ch('=').escaped(o.real_libcuda, sizeof o.real_libcuda);
  tail(t, o.real_libcuda_source);
  line(t, "GPUSLICE_REAL_LIBNVML").ch('=').escaped(o.real_libnvml, sizeof o.real_libnvml);
  tail(t, o.real_libnvml_source);
  static constexpr const char* kLevels[] = {"error", "warn", "info", "debug"};
  line(t, "GPUSLICE_LOG_LEVEL").ch('=')
      .str(o.log_level >= 0 && o.log_level <= 3 ? kLevels[o.log_level] : "?");
  tail(t, o.log_level_source);
  if (o.unknown_variable[0] != '\0') {
    t.str("gpuslice: ").escaped(o.unknown_variable).str(" is not a gpuslice option (ignored; a typo?)\n");
  }
  return finish(t);
}

}  // namespace gpuslice::limiter
