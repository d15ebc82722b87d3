// `gpuslice-smi options`: every environment option with its default and doc,
// expanded from the one option table (include/gpuslice/options.def through
// gpuslice/options.h), as text, JSON or the README's Markdown table.
#include <nlohmann/json.hpp>
#include <vector>

#include "gpuslice/options.h"
#include "limiter/options/options.h"
#include "smi.h"

using namespace std::string_literals;

namespace gpuslice::smi {

std::string render_options_text() {
  std::string out;
  for (const OptionInfo& o : kOptions) {
    out += o.env;
    out += "\n    default: ";
    out += o.default_value[0] != '\0' ? o.default_value : "(empty)";
    out += "\n    values:  ";
    out += o.range;
    out += "\n    ";
    out += o.doc;
    out += "\n\n";
  }
  out += "Aliases (HAMi-core names; gpuslice's own names win):\n";
  for (const OptionAlias& a : kOptionAliases) {
    out += "  ";
    out += a.env;
    if (a.per_device) out += ", "s + a.env + "_<i>";
    out += " -> ";
    out += a.target;
    out += ": ";
    out += a.doc;
    out += "\n";
  }
  return out;
}

std::string render_options_json() {
  nlohmann::json options = nlohmann::json::array();
  for (const OptionInfo& o : kOptions) {
    options.push_back({{"name", o.env},
                       {"id", o.id},
                       {"type", o.type_name},
                       {"default", o.default_value},
                       {"values", o.range},
                       {"doc", o.doc}});
  }
  nlohmann::json aliases = nlohmann::json::array();
  for (const OptionAlias& a : kOptionAliases) {
    aliases.push_back({{"name", a.env}, {"same_as", a.target}, {"per_device", a.per_device}, {"values", a.doc}});
  }
  return nlohmann::json{{"options", options}, {"aliases", aliases}}.dump(2) + "\n";
}

std::string render_options_markdown() {
  std::vector<char> buf(1 << 16);
  while (buf.size() <= (std::size_t{1} << 24)) {
    const int n = options::format_options_markdown(buf.data(), buf.size());
    if (n >= 0) return std::string(buf.data(), static_cast<std::size_t>(n));
    buf.resize(buf.size() * 2);
  }
  return "";
}

}  // namespace gpuslice::smi
