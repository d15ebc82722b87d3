// The node status page's data: the agent's own exposition (/metrics) parsed
// back into samples, and a short history of the series a person wants to see
// plotted (memory against quota, SM share against limit, spill, priority
// holds). Served as JSON at /api/status; the page (status_page.cc) draws it.
// Built from the exposition, not from the regions, so the page can never show
// a number that /metrics does not.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace gpuslice::agent {

struct ExpositionSample {
  std::string metric;
  std::map<std::string, std::string> labels;
  double value = 0;
};

// Parses Prometheus text format 0.0.4 as the agent writes it (comments
// skipped, label values unescaped). Lines that do not parse are skipped.
std::vector<ExpositionSample> parse_exposition(const std::string& text);

// The most series the history keeps (a few MiB of points).
inline constexpr std::size_t kMaxHistorySeries = 512;

class StatusHistory {
 public:
  // points: how many samples each series keeps; every_ms: the least time
  // between two recorded samples (record() is called every agent cycle).
  explicit StatusHistory(std::size_t points = 300, std::uint64_t every_ms = 2000)
      : points_(points), every_ms_(every_ms) {}

  // True when this call recorded (at least every_ms after the last one).
  bool due(std::uint64_t wall_ms) const;
  void record(std::uint64_t wall_ms, const std::string& exposition);
  // {"time_ms", "every_ms", "series": [{metric, labels, value}], "history":
  //  [{metric, labels, t: [ms...], v: [...]}]} with the current exposition.
  std::string json(std::uint64_t wall_ms, const std::string& exposition) const;

 private:
  struct Series {
    std::string metric;
    std::map<std::string, std::string> labels;
    std::deque<std::pair<std::uint64_t, double>> points;
    std::uint64_t last_ms = 0;
  };
  mutable std::mutex mu_;
  std::size_t points_;
  std::uint64_t every_ms_;
  std::uint64_t last_ms_ = 0;
  std::map<std::string, Series> series_;  // key: metric + labels
};

// The self-contained HTML page (no external assets: nodes have no internet).
const char* status_page_html();

}  // namespace gpuslice::agent
