// The configuration file (limiter/options/file.h): which file, precedence
// against the environment option by option, the line grammar, and the
// errors, each naming the file, the line and what was expected.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "limiter/options/options.h"
#include "limiter/options/file.h"
#include "support.h"

namespace gpuslice::options {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

constexpr std::uint64_t kMi = std::uint64_t{1} << 20;

struct Loaded {
  bool ok;
  Options options;
  std::string error;
};

class OptionsFile : public ::testing::Test {
 protected:
  // Writes `text` to a file of the temporary directory; returns its path.
  std::string write(const std::string& name, const std::string& text) {
    const std::string path = dir_.file(name);
    std::ofstream(path, std::ios::binary) << text;
    return path;
  }
  // load_options with `env` and `default_file` (the library passes /etc/gpuslice/gpuslice.conf).
  Loaded load(std::vector<std::string> env, const std::string& default_file) {
    std::vector<char*> envp;
    for (auto& s : env) envp.push_back(s.data());
    envp.push_back(nullptr);
    auto loaded = std::make_unique<Loaded>();
    shm::Error err{};
    loaded->ok = load_options(envp.data(), default_file.c_str(), buffer_.get(), &loaded->options, &err);
    loaded->error = err.message;
    Loaded out = std::move(*loaded);
    return out;
  }
  std::string missing() const { return dir_.file("absent.conf"); }

  test::TempDir dir_;
  std::unique_ptr<ConfigFileBuffer> buffer_ = std::make_unique<ConfigFileBuffer>();
};

TEST(OptionsFileDefault, IsTheFixedPath) {
  EXPECT_STREQ(kDefaultConfigFile, "/etc/gpuslice/gpuslice.conf");
  Options o;
  default_options(&o);
  EXPECT_STREQ(o.config_file, kDefaultConfigFile);  // options.def's default says the same
  EXPECT_STREQ(o.config_file_source.name, "default");
}

TEST_F(OptionsFile, MissingDefaultFileIsNoError) {
  const Loaded l = load({"GPUSLICE_MEMORY_LIMIT=1Gi"}, missing());
  ASSERT_TRUE(l.ok) << l.error;
  EXPECT_FALSE(l.options.config_file_read);
  EXPECT_EQ(l.options.memory_limit[0], 1024 * kMi);
  EXPECT_STREQ(l.options.config_file, missing().c_str());
}

TEST_F(OptionsFile, DefaultFileLimitsAProcessWithoutEnvironment) {
  const std::string conf = write("gpuslice.conf",
                                 "# written by gpuslice-cdi\n"
                                 "GPUSLICE_MEMORY_LIMIT=256Mi\n"
                                 "GPUSLICE_REGION=/run/gpuslice/c.region\n");
  const Loaded l = load({}, conf);
  ASSERT_TRUE(l.ok) << l.error;
  EXPECT_TRUE(l.options.config_file_read);
  EXPECT_STREQ(l.options.config_file, conf.c_str());
  for (std::uint32_t d = 0; d < kMaxDevices; ++d) {
    EXPECT_EQ(l.options.memory_limit[d], 256 * kMi);
    EXPECT_STREQ(l.options.memory_limit_source[d].name, "GPUSLICE_MEMORY_LIMIT");
    EXPECT_EQ(l.options.memory_limit_source[d].line, 2u);
  }
  EXPECT_STREQ(l.options.region, "/run/gpuslice/c.region");
  EXPECT_EQ(l.options.region_source.line, 3u);
  EXPECT_STREQ(l.options.sm_limit_source[0].name, "default");
  EXPECT_EQ(l.options.sm_limit_source[0].line, 0u);
}

TEST_F(OptionsFile, NamedFileBeatsTheDefault) {
  const std::string named = write("named.conf", "GPUSLICE_MEMORY_LIMIT=100Mi\n");
  const std::string def = write("default.conf", "GPUSLICE_MEMORY_LIMIT=200Mi\n");
  const Loaded l = load({"GPUSLICE_CONFIG_FILE=" + named}, def);
  ASSERT_TRUE(l.ok) << l.error;
  EXPECT_EQ(l.options.memory_limit[0], 100 * kMi);
  EXPECT_STREQ(l.options.config_file, named.c_str());
  EXPECT_STREQ(l.options.config_file_source.name, "GPUSLICE_CONFIG_FILE");
}

TEST_F(OptionsFile, EnvironmentWinsOptionByOption) {
  const std::string conf = write("c.conf",
                                 "GPUSLICE_MEMORY_LIMIT=256Mi\n"
                                 "GPUSLICE_SM_LIMIT=30\n"
                                 "GPUSLICE_PRIORITY=low\n");
  const Loaded l = load({"GPUSLICE_MEMORY_LIMIT=1Gi", "GPUSLICE_PRIORITY=high"}, conf);
  ASSERT_TRUE(l.ok) << l.error;
  EXPECT_EQ(l.options.memory_limit[0], 1024 * kMi);
  EXPECT_EQ(l.options.memory_limit_source[0].line, 0u);
  EXPECT_EQ(l.options.sm_limit[0], 30u);
  EXPECT_EQ(l.options.sm_limit_source[0].line, 2u);
  EXPECT_EQ(l.options.priority, Priority::high);
}

// An option the environment sets by any name (here a HAMi per-device alias for
// device 0) takes nothing from the file, not even for the other devices.
TEST_F(OptionsFile, AnAliasInTheEnvironmentSetsTheWholeOption) {
  const std::string conf = write("c.conf", "GPUSLICE_MEMORY_LIMIT=256Mi\nCUDA_DEVICE_SM_LIMIT=40\n");
  const Loaded l = load({"CUDA_DEVICE_MEMORY_LIMIT_0=1024m"}, conf);
  ASSERT_TRUE(l.ok) << l.error;
  EXPECT_EQ(l.options.memory_limit[0], 1024 * kMi);
  EXPECT_EQ(l.options.memory_limit[1], kUnlimited);
  EXPECT_EQ(l.options.sm_limit[1], 40u);  // the file's HAMi alias: accepted as in the environment
  EXPECT_STREQ(l.options.sm_limit_source[1].name, "CUDA_DEVICE_SM_LIMIT");
  EXPECT_EQ(l.options.sm_limit_source[1].line, 2u);
}

TEST_F(OptionsFile, CommentsBlanksAndSurroundingWhitespace) {
  const std::string conf = write("c.conf",
                                 "\n   # a comment\n\t\n  GPUSLICE_MEMORY_LIMIT \t=  256Mi  \r\n"
                                 "#GPUSLICE_SM_LIMIT=10\nGPUSLICE_CONTAINER_NAME= a b \n"
                                 "GPUSLICE_LOG_LEVEL=error");  // no final newline
  const Loaded l = load({}, conf);
  ASSERT_TRUE(l.ok) << l.error;
  EXPECT_EQ(l.options.memory_limit[0], 256 * kMi);
  EXPECT_EQ(l.options.memory_limit_source[0].line, 4u);
  EXPECT_EQ(l.options.sm_limit[0], 100u);
  EXPECT_STREQ(l.options.container_name, "a b");
  EXPECT_EQ(l.options.log_level, kLogError);
  EXPECT_EQ(l.options.log_level_source.line, 7u);
}

TEST_F(OptionsFile, DebugListingSaysWhereEachValueCameFrom) {
  const std::string conf = write("c.conf", "GPUSLICE_SM_LIMIT=30\n");
  const Loaded l = load({"GPUSLICE_MEMORY_LIMIT=1Gi"}, conf);
  ASSERT_TRUE(l.ok) << l.error;
  char text[16384];
  ASSERT_GT(format_effective_options(l.options, text, sizeof text), 0);
  const std::string s = text;
  EXPECT_THAT(s, HasSubstr("GPUSLICE_MEMORY_LIMIT[0]=1Gi (1073741824 bytes) (GPUSLICE_MEMORY_LIMIT, environment)\n"));
  EXPECT_THAT(s, HasSubstr("GPUSLICE_SM_LIMIT[0]=30 (GPUSLICE_SM_LIMIT, " + conf + ":1)\n"));
  EXPECT_THAT(s, HasSubstr("GPUSLICE_PRIORITY=normal (default)\n"));
  EXPECT_THAT(s, HasSubstr("gpuslice: configuration file " + conf + ": read"));
}

// ---- errors: every one names the file (and the line where there is one) ----

TEST_F(OptionsFile, NamedFileMissingIsAnError) {
  const Loaded l = load({"GPUSLICE_CONFIG_FILE=" + missing()}, missing());
  ASSERT_FALSE(l.ok);
  EXPECT_THAT(l.error,
              StartsWith("gpuslice: GPUSLICE_CONFIG_FILE='" + missing() + "': cannot open the configuration file"));
  EXPECT_THAT(l.error, HasSubstr("No such file or directory (ENOENT)"));
}

TEST_F(OptionsFile, NamedFileMustBeAbsolute) {
  const Loaded l = load({"GPUSLICE_CONFIG_FILE=gpuslice.conf"}, missing());
  ASSERT_FALSE(l.ok);
  EXPECT_THAT(l.error, StartsWith("gpuslice: GPUSLICE_CONFIG_FILE='gpuslice.conf': relative path"));
}

TEST_F(OptionsFile, DefaultThatIsNotAFileIsAnError) {
  const Loaded l = load({}, dir_.path());
  ASSERT_FALSE(l.ok);
  EXPECT_THAT(l.error, HasSubstr("is not a regular file"));
}

TEST_F(OptionsFile, UnreadableDefaultIsAnError) {
  if (geteuid() == 0) GTEST_SKIP() << "root reads a mode-000 file";
  const std::string conf = write("c.conf", "GPUSLICE_MEMORY_LIMIT=1Gi\n");
  chmod(conf.c_str(), 0);
  const Loaded l = load({}, conf);
  ASSERT_FALSE(l.ok);
  EXPECT_THAT(l.error, HasSubstr("Permission denied"));
}

struct Malformed {
  const char* text;
  const char* error;  // after "gpuslice: <file>"
};

TEST_F(OptionsFile, MalformedFilesAreRefusedNamingFileAndLine) {
  const Malformed cases[] = {
      {"GPUSLICE_MEMORY_LIMIT\n",
       ":1: 'GPUSLICE_MEMORY_LIMIT' has no '=', expected NAME=VALUE (a gpuslice option or "
       "HAMi alias), a # comment or a blank line"},
      {"# ok\n = 5\n", ":2: '= 5' has no name before '=', expected NAME=VALUE"},
      {"GPUSLICE_MEMORY_LIMT=1Gi\n",
       ":1: 'GPUSLICE_MEMORY_LIMT' is not a gpuslice option or HAMi alias, expected a "
       "name from the README's option table"},
      {"export GPUSLICE_MEMORY_LIMIT=1Gi\n", ":1: 'export GPUSLICE_MEMORY_LIMIT' is not a gpuslice option"},
      {"CUDA_DEVICE_MEMORY_LIMIT_16=1g\n",
       ":1: 'CUDA_DEVICE_MEMORY_LIMIT_16': bad device index in the name, expected "
       "<alias>_<i> with i in 0-15"},
      {"GPUSLICE_SM_LIMIT=30\nGPUSLICE_SM_LIMIT=40\n",
       ":2: GPUSLICE_SM_LIMIT is already set on line 1, expected each "
       "name at most once"},
      {"GPUSLICE_CONFIG_FILE=/etc/other.conf\n",
       ":1: GPUSLICE_CONFIG_FILE names the file itself, expected it in the "
       "environment only"},
      // A malformed quota in the file fails closed as in the environment, located.
      {"\nGPUSLICE_MEMORY_LIMIT=0\n",
       ":2: GPUSLICE_MEMORY_LIMIT='0': a quota of 0 bytes would refuse every allocation"},
      {"GPUSLICE_MEMORY_LIMIT=\"1Gi\"\n", ":1: GPUSLICE_MEMORY_LIMIT='\"1Gi\"': not a non-negative integer"},
      {"CUDA_DEVICE_MEMORY_LIMIT_1=12x\n", ":1: CUDA_DEVICE_MEMORY_LIMIT_1='12x': unknown unit"},
  };
  for (const Malformed& c : cases) {
    const std::string conf = write("bad.conf", c.text);
    const Loaded l = load({}, conf);
    EXPECT_FALSE(l.ok) << c.text;
    EXPECT_THAT(l.error, StartsWith(std::string("gpuslice: ") + conf + c.error)) << c.text;
  }
}

TEST_F(OptionsFile, NulByteIsRefused) {
  const std::string conf = write("nul.conf", std::string("GPUSLICE_SM_LIMIT=30\nGPUSLICE_MEMORY_LIMIT=1G\0i\n", 46));
  const Loaded l = load({}, conf);
  ASSERT_FALSE(l.ok);
  EXPECT_THAT(l.error, StartsWith("gpuslice: " + conf + ":2: NUL byte in the line"));
}

TEST_F(OptionsFile, LargerThan64KiBIsRefused) {
  std::string text(kConfigFileMaxBytes, '\n');
  EXPECT_TRUE(load({}, write("max.conf", text)).ok);
  text += "\n";
  const Loaded l = load({}, write("big.conf", text));
  ASSERT_FALSE(l.ok);
  EXPECT_THAT(l.error, HasSubstr("is larger than 65536 bytes"));
}

// The environment's errors come first: they hold whatever the file says.
TEST_F(OptionsFile, EnvironmentErrorsStand) {
  const std::string conf = write("c.conf", "GPUSLICE_MEMORY_LIMIT=1Gi\n");
  const Loaded l = load({"GPUSLICE_MEMORY_LIMIT=0"}, conf);
  ASSERT_FALSE(l.ok);
  EXPECT_THAT(l.error, StartsWith("gpuslice: GPUSLICE_MEMORY_LIMIT='0': a quota of 0"));
}

}  // namespace
}  // namespace gpuslice::options
