// Small statistics used by the workers and the report.
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

namespace gpuslice::bench {

// q-quantile (0..1) by nearest rank; 0 for an empty sample.
inline double quantile(std::vector<double> values, double q) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  auto rank = static_cast<std::size_t>(std::lround(q * static_cast<double>(values.size() - 1)));
  return values[std::min(rank, values.size() - 1)];
}

inline double median(const std::vector<double>& values) { return quantile(values, 0.5); }

// Jain's fairness index (sum x)^2 / (n sum x^2): 1 when every x is equal,
// 1/n when one tenant gets everything. 0 for an empty or all-zero sample.
inline double jain_index(const std::vector<double>& x) {
  double sum = 0;
  double squares = 0;
  for (double v : x) {
    sum += v;
    squares += v * v;
  }
  if (x.empty() || squares == 0) return 0;
  return sum * sum / (static_cast<double>(x.size()) * squares);
}

}  // namespace gpuslice::bench
