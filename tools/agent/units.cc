#include "units.h"

#include <cstring>

namespace gpuslice::agent {

bool parse_duration(const std::string& text, std::uint64_t* ns) {
  if (text == "0") {
    *ns = 0;
    return true;
  }
  std::size_t i = 0;
  std::uint64_t whole = 0, frac = 0, frac_scale = 1;
  bool digits = false;
  while (i < text.size() && text[i] >= '0' && text[i] <= '9') {
    if (whole > 1'000'000'000'000ull) return false;
    whole = whole * 10 + static_cast<std::uint64_t>(text[i++] - '0');
    digits = true;
  }
  if (i < text.size() && text[i] == '.') {
    ++i;
    while (i < text.size() && text[i] >= '0' && text[i] <= '9') {
      if (frac_scale < 1'000'000'000ull) {
        frac = frac * 10 + static_cast<std::uint64_t>(text[i] - '0');
        frac_scale *= 10;
      }
      ++i;
      digits = true;
    }
  }
  if (!digits) return false;
  static const std::pair<const char*, std::uint64_t> kUnits[] = {{"ns", 1},
                                                                 {"us", 1000},
                                                                 {"ms", 1'000'000},
                                                                 {"s", 1'000'000'000},
                                                                 {"m", 60'000'000'000},
                                                                 {"h", 3'600'000'000'000}};
  const std::string unit = text.substr(i);
  for (const auto& [name, scale] : kUnits) {
    if (unit == name) {
      if (whole > ~std::uint64_t{0} / scale) return false;
      *ns = whole * scale + frac * scale / frac_scale;
      return true;
    }
  }
  return false;
}

std::string format_duration(std::uint64_t ns) {
  static const std::pair<const char*, std::uint64_t> kUnits[] = {
      {"h", 3'600'000'000'000}, {"m", 60'000'000'000}, {"s", 1'000'000'000}, {"ms", 1'000'000}, {"us", 1000}};
  if (ns == 0) return "0";
  for (const auto& [name, scale] : kUnits) {
    if (ns % scale == 0) return std::to_string(ns / scale) + name;
  }
  return std::to_string(ns) + "ns";
}

}  // namespace gpuslice::agent
