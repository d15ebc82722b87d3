// The status page's data (tools/agent/status.h): the agent's exposition parsed
// back, and the history the page plots.
#include "status.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

namespace gpuslice::agent {
namespace {

TEST(StatusExposition, ParsesLabelsEscapesAndValues) {
  const auto s = parse_exposition(
      "# HELP gpuslice_x help\n# TYPE gpuslice_x gauge\n"
      "gpuslice_memory_used_bytes{container=\"a \\\"q\\\" \\\\ b\",region=\"p/c.region\",device=\"0\"} 50331648\n"
      "gpuslice_agent_cycles_total 12\n"
      "gpuslice_agent_cycle_seconds 0.00039863499999999999\n"
      "broken{container=\"x} 1\n"
      "gpuslice_sm_utilization_ratio{region=\"r\"} 0.25\n");
  ASSERT_EQ(s.size(), 4u);
  EXPECT_EQ(s[0].metric, "gpuslice_memory_used_bytes");
  EXPECT_EQ(s[0].labels.at("container"), "a \"q\" \\ b");
  EXPECT_EQ(s[0].labels.at("region"), "p/c.region");
  EXPECT_EQ(s[0].value, 50331648.0);
  EXPECT_TRUE(s[1].labels.empty());
  EXPECT_EQ(s[1].value, 12.0);
  EXPECT_NEAR(s[2].value, 0.000398635, 1e-12);
  EXPECT_EQ(s[3].labels.at("region"), "r");
}

TEST(StatusHistory, KeepsTheWindowOfPlottedSeriesAndDropsGoneOnes) {
  StatusHistory h(3, 1000);
  EXPECT_TRUE(h.due(1000));
  for (std::uint64_t t = 1; t <= 5; ++t) {
    h.record(t * 1000, "gpuslice_memory_used_bytes{region=\"a\",device=\"0\"} " + std::to_string(t) +
                           "\ngpuslice_launches_total{region=\"a\",device=\"0\"} 7\n");
  }
  EXPECT_FALSE(h.due(5500));
  EXPECT_TRUE(h.due(6000));
  auto doc = nlohmann::json::parse(h.json(5000, "gpuslice_agent_regions 1\n"));
  ASSERT_EQ(doc["history"].size(), 1u) << "launches are not plotted";
  EXPECT_EQ(doc["history"][0]["v"], nlohmann::json::parse("[3.0,4.0,5.0]")) << "the last 3 points";
  EXPECT_EQ(doc["history"][0]["t"], nlohmann::json::parse("[3000,4000,5000]"));
  ASSERT_EQ(doc["series"].size(), 1u);
  EXPECT_EQ(doc["series"][0]["metric"], "gpuslice_agent_regions");
  // The container is gone for longer than the window: its series is dropped.
  h.record(9000, "gpuslice_agent_regions 0\n");
  doc = nlohmann::json::parse(h.json(9000, ""));
  EXPECT_TRUE(doc["history"].empty());
}

TEST(StatusHistory, KeepsABoundedNumberOfSeries) {
  // Thousands of containers: the history plots the first 512 series
  // (kMaxHistorySeries) and grows no further (each holds up to 300 points).
  StatusHistory h;
  std::string exposition;
  for (std::size_t i = 0; i < 812; ++i) {
    exposition += "gpuslice_memory_used_bytes{region=\"pod-" + std::to_string(i) + "/c.region\",device=\"0\"} 1\n";
  }
  h.record(1000, exposition);
  h.record(3000, exposition);
  const auto doc = nlohmann::json::parse(h.json(3000, ""));
  EXPECT_EQ(doc["history"].size(), 512u);
  EXPECT_EQ(doc["history"][0]["v"].size(), 2u);
}

}  // namespace
}  // namespace gpuslice::agent
