// The README's option table is generated from options.def: this test fails
// when they differ. To regenerate the block after changing options.def:
//   GPUSLICE_UPDATE_README=1 ctest -R ReadmeOptions
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "limiter/options/options.h"

namespace {

constexpr const char* kBegin = "<!-- options:begin -->\n";
constexpr const char* kEnd = "<!-- options:end -->";

TEST(ReadmeOptions, TableMatchesOptionsDef) {
  const std::string path = std::string(GPUSLICE_SOURCE_DIR) + "/README.md";
  std::ifstream in(path);
  ASSERT_TRUE(in) << "cannot read " << path;
  std::stringstream buffer;
  buffer << in.rdbuf();
  const std::string readme = buffer.str();
  const std::size_t begin = readme.find(kBegin);
  ASSERT_NE(begin, std::string::npos) << path << " lacks the line " << kBegin;
  const std::size_t start = begin + std::string(kBegin).size();
  const std::size_t end = readme.find(kEnd, start);
  ASSERT_NE(end, std::string::npos) << path << " lacks the line " << kEnd;

  char table[16384];
  const int n = gpuslice::options::format_options_markdown(table, sizeof table);
  ASSERT_GT(n, 0);
  const std::string expected(table, static_cast<std::size_t>(n));
  const std::string actual = readme.substr(start, end - start);
  if (actual != expected && std::getenv("GPUSLICE_UPDATE_README") != nullptr) {
    std::ofstream out(path, std::ios::trunc);
    out << readme.substr(0, start) << expected << readme.substr(end);
    GTEST_SKIP() << "rewrote the option table of " << path;
  }
  EXPECT_EQ(actual, expected) << "the option table of " << path
                              << " is stale: run GPUSLICE_UPDATE_README=1 ctest -R ReadmeOptions";
}

}  // namespace
