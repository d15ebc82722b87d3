#include "status.h"

#include <cctype>
#include <cstdlib>
#include <nlohmann/json.hpp>

namespace gpuslice::agent {
namespace {

// The series worth a plot on the page.
bool plotted(const std::string& metric) {
  return metric == "gpuslice_memory_used_bytes" || metric == "gpuslice_memory_quota_bytes" ||
         metric == "gpuslice_memory_spilled_bytes" || metric == "gpuslice_sm_utilization_ratio" ||
         metric == "gpuslice_sm_limit_percent" || metric == "gpuslice_priority_held" ||
         metric == "gpuslice_device_sm_utilization_ratio";
}

std::string key_of(const ExpositionSample& s) {
  std::string key = s.metric;
  for (const auto& [k, v] : s.labels) {
    key += '\x1f';
    key += k;
    key += '=';
    key += v;
  }
  return key;
}

// name{k="v",...} value   or   name value
bool parse_line(const std::string& line, ExpositionSample* out) {
  std::size_t i = 0;
  while (i < line.size() && (std::isalnum(static_cast<unsigned char>(line[i])) || line[i] == '_' || line[i] == ':'))
    ++i;
  if (i == 0) return false;
  out->metric = line.substr(0, i);
  out->labels.clear();
  if (i < line.size() && line[i] == '{') {
    ++i;
    while (i < line.size() && line[i] != '}') {
      const std::size_t eq = line.find('=', i);
      if (eq == std::string::npos || eq + 1 >= line.size() || line[eq + 1] != '"') return false;
      std::string name = line.substr(i, eq - i), value;
      std::size_t j = eq + 2;
      for (; j < line.size() && line[j] != '"'; ++j) {
        if (line[j] == '\\' && j + 1 < line.size()) {
          ++j;
          value += line[j] == 'n' ? '\n' : line[j];
        } else {
          value += line[j];
        }
      }
      if (j >= line.size()) return false;
      out->labels[name] = value;
      i = j + 1;
      if (i < line.size() && line[i] == ',') ++i;
    }
    if (i >= line.size()) return false;
    ++i;  // '}'
  }
  if (i >= line.size() || line[i] != ' ') return false;
  const char* start = line.c_str() + i + 1;
  char* end = nullptr;
  out->value = std::strtod(start, &end);
  return end != start;
}

nlohmann::json labels_json(const std::map<std::string, std::string>& labels) {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& [k, v] : labels) j[k] = v;
  return j;
}

}  // namespace

std::vector<ExpositionSample> parse_exposition(const std::string& text) {
  std::vector<ExpositionSample> out;
  std::size_t pos = 0;
  ExpositionSample s;
  while (pos < text.size()) {
    std::size_t nl = text.find('\n', pos);
    if (nl == std::string::npos) nl = text.size();
    const std::string line = text.substr(pos, nl - pos);
    pos = nl + 1;
    if (line.empty() || line[0] == '#') continue;
    if (parse_line(line, &s)) out.push_back(s);
  }
  return out;
}

bool StatusHistory::due(std::uint64_t wall_ms) const {
  std::lock_guard<std::mutex> lock(mu_);
  return last_ms_ == 0 || wall_ms >= last_ms_ + every_ms_;
}

void StatusHistory::record(std::uint64_t wall_ms, const std::string& exposition) {
  // Only the plotted families' lines are parsed: at thousands of regions the
  // whole exposition is some 100,000 samples (docs/agent.md, "Scale").
  std::string wanted;
  for (std::size_t pos = 0; pos < exposition.size();) {
    std::size_t nl = exposition.find('\n', pos);
    if (nl == std::string::npos) nl = exposition.size();
    const std::size_t name_end = exposition.find_first_of("{ ", pos);
    if (name_end < nl && plotted(exposition.substr(pos, name_end - pos))) wanted.append(exposition, pos, nl + 1 - pos);
    pos = nl + 1;
  }
  const std::vector<ExpositionSample> samples = parse_exposition(wanted);
  std::lock_guard<std::mutex> lock(mu_);
  last_ms_ = wall_ms;
  for (const ExpositionSample& s : samples) {
    if (!plotted(s.metric)) continue;
    const std::string key = key_of(s);
    // Bounded: thousands of containers would keep 300 points of each of
    // their series (docs/agent.md, "Scale"); the first kMaxSeries are plotted.
    if (series_.size() >= kMaxHistorySeries && series_.count(key) == 0) continue;
    Series& series = series_[key];
    if (series.metric.empty()) {
      series.metric = s.metric;
      series.labels = s.labels;
    }
    series.points.emplace_back(wall_ms, s.value);
    while (series.points.size() > points_) series.points.pop_front();
    series.last_ms = wall_ms;
  }
  // Series gone for longer than the window (a removed container) are dropped.
  const std::uint64_t window = points_ * every_ms_;
  for (auto it = series_.begin(); it != series_.end();) {
    if (wall_ms > it->second.last_ms + window) {
      it = series_.erase(it);
    } else {
      ++it;
    }
  }
}

std::string StatusHistory::json(std::uint64_t wall_ms, const std::string& exposition) const {
  nlohmann::json doc;
  doc["time_ms"] = wall_ms;
  doc["every_ms"] = every_ms_;
  nlohmann::json& series = doc["series"] = nlohmann::json::array();
  for (const ExpositionSample& s : parse_exposition(exposition)) {
    series.push_back({{"metric", s.metric}, {"labels", labels_json(s.labels)}, {"value", s.value}});
  }
  nlohmann::json& history = doc["history"] = nlohmann::json::array();
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [key, s] : series_) {
    nlohmann::json t = nlohmann::json::array(), v = nlohmann::json::array();
    for (const auto& [ms, value] : s.points) {
      t.push_back(ms);
      v.push_back(value);
    }
    history.push_back({{"metric", s.metric}, {"labels", labels_json(s.labels)}, {"t", t}, {"v", v}});
  }
  // The labels are ASCII (names escaped once, where /metrics writes them:
  // tools/common/text.h). Should an unescaped byte ever reach here, it is
  // replaced rather than thrown: one container's name must never turn the
  // node's whole status into a 500.
  return doc.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace gpuslice::agent
