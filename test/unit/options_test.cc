// The option parser: every accepted and rejected form, aliases, messages.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "gpuslice/options.h"
#include "limiter/options/options.h"

namespace gpuslice::options {
namespace {

using ::testing::HasSubstr;

constexpr std::uint64_t kGi = std::uint64_t{1} << 30;

struct Env {
  explicit Env(std::vector<std::string> entries) : strings(std::move(entries)) {
    for (auto& s : strings) pointers.push_back(s.data());
    pointers.push_back(nullptr);
  }
  char* const* envp() { return pointers.data(); }
  std::vector<std::string> strings;
  std::vector<char*> pointers;
};

struct Parsed {
  bool ok;
  Options options;
  std::string error;
};

Parsed parse(std::vector<std::string> entries) {
  Env env(std::move(entries));
  Parsed p{};
  shm::Error err{};
  p.ok = parse_options(env.envp(), &p.options, &err);
  p.error = err.message;
  return p;
}

// ---- sizes ----

TEST(ParseSize, AcceptedForms) {
  struct Case {
    const char* text;
    std::uint64_t bytes;
  } cases[] = {
      {"0", 0},
      {"1", 1},
      {"123B", 123},
      {"8K", 8000},
      {"8k", 8000},
      {"8KB", 8000},
      {"8kB", 8000},
      {"8M", 8000000},
      {"8MB", 8000000},
      {"8G", 8000000000},
      {"8GB", 8000000000},
      {"2T", 2000000000000},
      {"2TB", 2000000000000},
      {"8Ki", 8192},
      {"8KiB", 8192},
      {"3Mi", 3 << 20},
      {"3MiB", 3 << 20},
      {"8Gi", 8 * kGi},
      {"8GiB", 8 * kGi},
      {"1Ti", kGi * 1024},
      {"1TiB", kGi * 1024},
      {"007Gi", 7 * kGi},
      {"18446744073709551615", ~std::uint64_t{0}},
      {"16777215Ti", 16777215 * kGi * 1024},
  };
  for (const Case& c : cases) {
    std::uint64_t v = 0;
    EXPECT_TRUE(parse_size(c.text, &v)) << c.text;
    EXPECT_EQ(v, c.bytes) << c.text;
  }
}

TEST(ParseSize, RejectedForms) {
  for (const char* text : {"",           " 8Gi",
                           "8Gi ",       "8 Gi",
                           "-1",         "+1",
                           "1.5Gi",      "1,5G",
                           "8gi",        "8g",
                           "8gb",        "8m",
                           "8Gib",       "8GiBB",
                           "8Ti2",       "Gi",
                           "0x10",       "1e9",
                           "8K i",       "18446744073709551616",
                           "16777216Ti", "99999999999999999999999",
                           "8\n",        "8Pi",
                           "8iB"}) {
    std::uint64_t v = 12345;
    EXPECT_FALSE(parse_size(text, &v)) << "'" << text << "'";
    EXPECT_EQ(v, 12345u) << "output untouched on error: '" << text << "'";
  }
  std::uint64_t v = 0;
  EXPECT_FALSE(parse_size(nullptr, &v));
}

TEST(ParseSize, HamiGrammar) {
  std::uint64_t v = 0;
  EXPECT_TRUE(parse_hami_size("4096m", &v));
  EXPECT_EQ(v, std::uint64_t{4096} << 20);
  EXPECT_TRUE(parse_hami_size("2G", &v));
  EXPECT_EQ(v, 2 * kGi);
  EXPECT_TRUE(parse_hami_size("10k", &v));
  EXPECT_EQ(v, 10240u);
  EXPECT_TRUE(parse_hami_size("1000", &v));
  EXPECT_EQ(v, 1000u);
  for (const char* text : {"", "4096mb", "4Gi", "1t", "-1", "4096 m", "1.5g"}) {
    EXPECT_FALSE(parse_hami_size(text, &v)) << text;
  }
}

TEST(ParsePercent, Forms) {
  std::uint32_t v = 0;
  for (const char* text : {"1", "30", "30%", "100", "100%", "050"}) EXPECT_TRUE(parse_percent(text, &v)) << text;
  EXPECT_TRUE(parse_percent("42%", &v));
  EXPECT_EQ(v, 42u);
  for (const char* text : {"", "0", "101", "1000", "-5", "50%%", "%", "5 ", "50.5", "abc"}) {
    EXPECT_FALSE(parse_percent(text, &v)) << text;
  }
}

// ---- whole environment ----

TEST(ParseOptions, Defaults) {
  const Parsed p = parse({"PATH=/usr/bin", "HOME=/root"});
  ASSERT_TRUE(p.ok) << p.error;
  for (std::uint32_t d = 0; d < kMaxDevices; ++d) {
    EXPECT_EQ(p.options.memory_limit[d], kUnlimited);
    EXPECT_EQ(p.options.sm_limit[d], 100u);
    EXPECT_STREQ(p.options.memory_limit_source[d].name, "default");
    EXPECT_STREQ(p.options.sm_limit_source[d].name, "default");
  }
  EXPECT_EQ(p.options.sm_policy, SmPolicy::hard);
  EXPECT_EQ(std::string(p.options.region), "/dev/shm/gpuslice.region");  // one per container, not per uid
  EXPECT_STREQ(p.options.container_name, "");
  EXPECT_STREQ(p.options.real_libcuda, "libcuda.so.1");
  EXPECT_STREQ(p.options.real_libnvml, "libnvidia-ml.so.1");
  EXPECT_EQ(p.options.log_level, kLogWarn);
  EXPECT_STREQ(p.options.region_source.name, "default");
  EXPECT_STREQ(p.options.unknown_variable, "");
  EXPECT_EQ(p.error, "");
}

TEST(ParseOptions, NullAndEmptyEnvironment) {
  Options o{};
  shm::Error err{};
  EXPECT_TRUE(parse_options(nullptr, &o, &err));
  EXPECT_EQ(o.memory_limit[0], kUnlimited);
  const Parsed p = parse({});
  EXPECT_TRUE(p.ok);
}

TEST(ParseOptions, EveryOption) {
  const Parsed p = parse({"GPUSLICE_MEMORY_LIMIT=8Gi", "GPUSLICE_SM_LIMIT=30%", "GPUSLICE_SM_POLICY=Elastic",
                          "GPUSLICE_REGION=/run/gpuslice/c1.region", "GPUSLICE_CONTAINER_NAME=team-a/job 7",
                          "GPUSLICE_REAL_LIBCUDA=/usr/lib64/libcuda.so.1", "GPUSLICE_REAL_LIBNVML=libnvidia-ml.so.1",
                          "GPUSLICE_LOG_LEVEL=DEBUG"});
  ASSERT_TRUE(p.ok) << p.error;
  for (std::uint32_t d = 0; d < kMaxDevices; ++d) {
    EXPECT_EQ(p.options.memory_limit[d], 8 * kGi);
    EXPECT_EQ(p.options.sm_limit[d], 30u);
    EXPECT_STREQ(p.options.memory_limit_source[d].name, "GPUSLICE_MEMORY_LIMIT");
    EXPECT_STREQ(p.options.sm_limit_source[d].name, "GPUSLICE_SM_LIMIT");
  }
  EXPECT_EQ(p.options.sm_policy, SmPolicy::elastic);
  EXPECT_STREQ(p.options.region, "/run/gpuslice/c1.region");
  EXPECT_STREQ(p.options.container_name, "team-a/job 7");
  EXPECT_STREQ(p.options.real_libcuda, "/usr/lib64/libcuda.so.1");
  EXPECT_STREQ(p.options.real_libnvml, "libnvidia-ml.so.1");
  EXPECT_EQ(p.options.log_level, kLogDebug);
  EXPECT_STREQ(p.options.log_level_source.name, "GPUSLICE_LOG_LEVEL");
  EXPECT_STREQ(p.options.region_source.name, "GPUSLICE_REGION");
  EXPECT_STREQ(p.options.sm_policy_source.name, "GPUSLICE_SM_POLICY");
}

TEST(ParseOptions, PerDeviceLists) {
  const Parsed p = parse({"GPUSLICE_MEMORY_LIMIT=0=8Gi,3=512Mi,15=1G", "GPUSLICE_SM_LIMIT=1=50,0=25%"});
  ASSERT_TRUE(p.ok) << p.error;
  EXPECT_EQ(p.options.memory_limit[0], 8 * kGi);
  EXPECT_EQ(p.options.memory_limit[3], 512u << 20);
  EXPECT_EQ(p.options.memory_limit[15], 1000000000u);
  EXPECT_EQ(p.options.memory_limit[1], kUnlimited);
  EXPECT_STREQ(p.options.memory_limit_source[1].name, "default");
  EXPECT_STREQ(p.options.memory_limit_source[3].name, "GPUSLICE_MEMORY_LIMIT");
  EXPECT_EQ(p.options.sm_limit[0], 25u);
  EXPECT_EQ(p.options.sm_limit[1], 50u);
  EXPECT_EQ(p.options.sm_limit[2], 100u);
}

TEST(ParseOptions, FirstDuplicateWinsLikeGetenv) {
  const Parsed p = parse({"GPUSLICE_MEMORY_LIMIT=1Gi", "GPUSLICE_MEMORY_LIMIT=2Gi"});
  ASSERT_TRUE(p.ok);
  EXPECT_EQ(p.options.memory_limit[0], kGi);
}

TEST(ParseOptions, AliasPrecedence) {
  // Ours beat aliases; a per-device alias beats the global alias.
  Parsed p = parse({"CUDA_DEVICE_MEMORY_LIMIT=1g", "CUDA_DEVICE_MEMORY_LIMIT_1=2048m", "CUDA_DEVICE_SM_LIMIT=40",
                    "CUDA_DEVICE_SM_LIMIT_2=10"});
  ASSERT_TRUE(p.ok) << p.error;
  EXPECT_EQ(p.options.memory_limit[0], kGi);
  EXPECT_STREQ(p.options.memory_limit_source[0].name, "CUDA_DEVICE_MEMORY_LIMIT");
  EXPECT_EQ(p.options.memory_limit[1], 2 * kGi);
  EXPECT_STREQ(p.options.memory_limit_source[1].name, "CUDA_DEVICE_MEMORY_LIMIT_1");
  EXPECT_EQ(p.options.sm_limit[0], 40u);
  EXPECT_EQ(p.options.sm_limit[2], 10u);
  EXPECT_STREQ(p.options.sm_limit_source[2].name, "CUDA_DEVICE_SM_LIMIT_2");

  p = parse({"CUDA_DEVICE_MEMORY_LIMIT_0=1g", "GPUSLICE_MEMORY_LIMIT=3Gi", "CUDA_DEVICE_MEMORY_LIMIT=2g"});
  ASSERT_TRUE(p.ok) << p.error;
  for (std::uint32_t d = 0; d < kMaxDevices; ++d) EXPECT_EQ(p.options.memory_limit[d], 3 * kGi);

  // Our list covers device 0 only: the aliases still speak for the others.
  p = parse({"GPUSLICE_MEMORY_LIMIT=0=3Gi", "CUDA_DEVICE_MEMORY_LIMIT_1=1g", "CUDA_DEVICE_MEMORY_LIMIT=2g"});
  ASSERT_TRUE(p.ok) << p.error;
  EXPECT_EQ(p.options.memory_limit[0], 3 * kGi);
  EXPECT_EQ(p.options.memory_limit[1], kGi);
  EXPECT_EQ(p.options.memory_limit[2], 2 * kGi);
}

TEST(ParseOptions, HamiZeroMeansNotSet) {
  const Parsed p = parse({"CUDA_DEVICE_MEMORY_LIMIT_0=0", "CUDA_DEVICE_MEMORY_LIMIT=2g", "CUDA_DEVICE_SM_LIMIT=0",
                          "CUDA_DEVICE_MEMORY_LIMIT_3=0"});
  ASSERT_TRUE(p.ok) << p.error;
  EXPECT_EQ(p.options.memory_limit[0], 2 * kGi);  // falls through to the global alias
  EXPECT_EQ(p.options.memory_limit[3], 2 * kGi);
  EXPECT_EQ(p.options.sm_limit[0], 100u);  // 0 = unlimited
  const Parsed q = parse({"CUDA_DEVICE_MEMORY_LIMIT=0"});
  ASSERT_TRUE(q.ok);
  EXPECT_EQ(q.options.memory_limit[0], kUnlimited);
  EXPECT_STREQ(q.options.memory_limit_source[0].name, "default");
}

TEST(ParseOptions, UnknownGpusliceVariableIsReported) {
  const Parsed p = parse({"GPUSLICE_MEMORY_LIMT=8Gi", "GPUSLICE_OTHER=1", "NOT_OURS=1"});
  ASSERT_TRUE(p.ok);
  EXPECT_STREQ(p.options.unknown_variable, "GPUSLICE_MEMORY_LIMT");
  EXPECT_EQ(p.options.memory_limit[0], kUnlimited);
}

TEST(ParseOptions, NamesThatOnlyLookAlike) {
  const Parsed p = parse({"GPUSLICE_MEMORY_LIMIT", "XGPUSLICE_MEMORY_LIMIT=0", "CUDA_DEVICE_MEMORY_LIMITS=junk",
                          "CUDA_DEVICE_MEMORY_SHARED_CACHE=/tmp/x", "CUDA_DEVICE_SM_LIMIT_3"});
  ASSERT_TRUE(p.ok) << p.error;
  EXPECT_EQ(p.options.memory_limit[0], kUnlimited);
}

// ---- errors: each names the variable, the value and what was expected ----

struct Rejected {
  std::vector<std::string> env;
  std::string variable;  // "NAME='value'"
  std::string what;
};

// Test listings show the variable, not the struct's bytes (pointers that
// change every run).
void PrintTo(const Rejected& r, std::ostream* os) { *os << r.variable; }

class ParseErrors : public ::testing::TestWithParam<Rejected> {};

TEST_P(ParseErrors, NamesVariableValueAndExpectation) {
  const Rejected& r = GetParam();
  const Parsed p = parse(r.env);
  EXPECT_FALSE(p.ok);
  EXPECT_THAT(p.error, HasSubstr("gpuslice: " + r.variable));
  EXPECT_THAT(p.error, HasSubstr("': "));
  EXPECT_THAT(p.error, HasSubstr(r.what));
  EXPECT_THAT(p.error, HasSubstr("expected"));
  EXPECT_EQ(p.error.find('\n'), std::string::npos);
  EXPECT_LT(p.error.size(), sizeof(shm::Error::message));
}

INSTANTIATE_TEST_SUITE_P(
    All, ParseErrors,
    ::testing::Values(
        Rejected{{"GPUSLICE_MEMORY_LIMIT=0"},
                 "GPUSLICE_MEMORY_LIMIT='0'",
                 "a quota of 0 bytes would refuse every allocation"},
        Rejected{{"GPUSLICE_MEMORY_LIMIT=0Gi"}, "GPUSLICE_MEMORY_LIMIT='0Gi'", "a quota of 0 bytes"},
        Rejected{{"GPUSLICE_MEMORY_LIMIT="}, "GPUSLICE_MEMORY_LIMIT=''", "empty value"},
        Rejected{
            {"GPUSLICE_MEMORY_LIMIT=8gb"}, "GPUSLICE_MEMORY_LIMIT='8gb'", "unknown unit or trailing characters 'gb'"},
        Rejected{{"GPUSLICE_MEMORY_LIMIT=8Gi "},
                 "GPUSLICE_MEMORY_LIMIT='8Gi '",
                 "unknown unit or trailing characters 'Gi '"},
        Rejected{{"GPUSLICE_MEMORY_LIMIT=-1"}, "GPUSLICE_MEMORY_LIMIT='-1'", "not a non-negative integer"},
        Rejected{{"GPUSLICE_MEMORY_LIMIT=1.5Gi"}, "GPUSLICE_MEMORY_LIMIT='1.5Gi'", "fractions are not accepted"},
        Rejected{{"GPUSLICE_MEMORY_LIMIT=99999999999Ti"}, "GPUSLICE_MEMORY_LIMIT='99999999999Ti'", "too large"},
        Rejected{
            {"GPUSLICE_MEMORY_LIMIT=0=8Gi,16=1Gi"}, "GPUSLICE_MEMORY_LIMIT='0=8Gi,16=1Gi'", "bad device index '16'"},
        Rejected{
            {"GPUSLICE_MEMORY_LIMIT=0=8Gi,01=1Gi"}, "GPUSLICE_MEMORY_LIMIT='0=8Gi,01=1Gi'", "bad device index '01'"},
        Rejected{{"GPUSLICE_MEMORY_LIMIT=x=1Gi"}, "GPUSLICE_MEMORY_LIMIT='x=1Gi'", "bad device index 'x'"},
        Rejected{{"GPUSLICE_MEMORY_LIMIT==1Gi"}, "GPUSLICE_MEMORY_LIMIT='=1Gi'", "bad device index ''"},
        Rejected{
            {"GPUSLICE_MEMORY_LIMIT=0=8Gi,0=1Gi"}, "GPUSLICE_MEMORY_LIMIT='0=8Gi,0=1Gi'", "device 0 is listed twice"},
        Rejected{{"GPUSLICE_MEMORY_LIMIT=0=8Gi,,1=1Gi"}, "GPUSLICE_MEMORY_LIMIT='0=8Gi,,1=1Gi'", "empty entry"},
        Rejected{{"GPUSLICE_MEMORY_LIMIT=0=8Gi,"}, "GPUSLICE_MEMORY_LIMIT='0=8Gi,'", "empty entry"},
        Rejected{{"GPUSLICE_MEMORY_LIMIT=0=8Gi,4Gi"},
                 "GPUSLICE_MEMORY_LIMIT='0=8Gi,4Gi'",
                 "entry '4Gi' has no device index"},
        Rejected{{"GPUSLICE_MEMORY_LIMIT=1=0"}, "GPUSLICE_MEMORY_LIMIT='1=0'", "device 1: a quota of 0 bytes"},
        Rejected{{"GPUSLICE_MEMORY_LIMIT=1="}, "GPUSLICE_MEMORY_LIMIT='1='", "device 1: empty value"},
        Rejected{{"GPUSLICE_MEMORY_LIMIT=2=8G8"}, "GPUSLICE_MEMORY_LIMIT='2=8G8'", "device 2: unknown unit"},
        Rejected{{"GPUSLICE_SM_LIMIT=0"}, "GPUSLICE_SM_LIMIT='0'", "0% would forbid all compute"},
        Rejected{{"GPUSLICE_SM_LIMIT=101"}, "GPUSLICE_SM_LIMIT='101'", "percentage 1-100"},
        Rejected{{"GPUSLICE_SM_LIMIT=50.5"}, "GPUSLICE_SM_LIMIT='50.5'", "percentage 1-100"},
        Rejected{{"GPUSLICE_SM_LIMIT="}, "GPUSLICE_SM_LIMIT=''", "empty value"},
        Rejected{{"GPUSLICE_SM_LIMIT=0=50,1=0"}, "GPUSLICE_SM_LIMIT='0=50,1=0'", "device 1: 0% would forbid"},
        Rejected{{"GPUSLICE_SM_POLICY=soft"}, "GPUSLICE_SM_POLICY='soft'", "unknown value, expected hard or elastic"},
        Rejected{{"GPUSLICE_SM_POLICY="}, "GPUSLICE_SM_POLICY=''", "empty value"},
        Rejected{{"GPUSLICE_REGION=relative/path"}, "GPUSLICE_REGION='relative/path'", "relative path"},
        Rejected{{"GPUSLICE_REGION=/dev/shm/"}, "GPUSLICE_REGION='/dev/shm/'", "ends with '/'"},
        Rejected{{"GPUSLICE_REGION="}, "GPUSLICE_REGION=''", "empty value"},
        Rejected{{"GPUSLICE_REGION=/" + std::string(4100, 'r')}, "GPUSLICE_REGION='/rrrr", "path too long"},
        Rejected{{"GPUSLICE_REGION=/tmp/a\tb"}, "GPUSLICE_REGION='/tmp/a\\x09b'", "control character"},
        Rejected{{"GPUSLICE_CONTAINER_NAME=" + std::string(64, 'c')}, "GPUSLICE_CONTAINER_NAME='cccc", "too long"},
        Rejected{
            {"GPUSLICE_CONTAINER_NAME=caf\xc3\xa9"}, "GPUSLICE_CONTAINER_NAME='caf\\xc3\\xa9'", "not printable ASCII"},
        Rejected{{"GPUSLICE_CONTAINER_NAME="}, "GPUSLICE_CONTAINER_NAME=''", "empty value"},
        Rejected{{"GPUSLICE_REAL_LIBCUDA="}, "GPUSLICE_REAL_LIBCUDA=''", "empty value"},
        Rejected{{"GPUSLICE_REAL_LIBNVML=lib\x01.so"}, "GPUSLICE_REAL_LIBNVML='lib\\x01.so'", "control character"},
        Rejected{{"GPUSLICE_LOG_LEVEL=verbose"}, "GPUSLICE_LOG_LEVEL='verbose'", "expected error, warn, info or debug"},
        Rejected{{"GPUSLICE_LOG_LEVEL=3"}, "GPUSLICE_LOG_LEVEL='3'", "unknown value"},
        Rejected{{"CUDA_DEVICE_MEMORY_LIMIT=4096mb"}, "CUDA_DEVICE_MEMORY_LIMIT='4096mb'", "k/m/g suffix (base 1024)"},
        Rejected{
            {"CUDA_DEVICE_MEMORY_LIMIT_2=lots"}, "CUDA_DEVICE_MEMORY_LIMIT_2='lots'", "not a non-negative integer"},
        Rejected{{"CUDA_DEVICE_MEMORY_LIMIT_16=1g"},
                 "CUDA_DEVICE_MEMORY_LIMIT_16='1g'",
                 "bad device index in the variable name"},
        Rejected{{"CUDA_DEVICE_MEMORY_LIMIT_x=1g"}, "CUDA_DEVICE_MEMORY_LIMIT_x='1g'", "bad device index"},
        Rejected{{"CUDA_DEVICE_MEMORY_LIMIT_=1g"}, "CUDA_DEVICE_MEMORY_LIMIT_='1g'", "bad device index"},
        Rejected{{"CUDA_DEVICE_SM_LIMIT_01=5"}, "CUDA_DEVICE_SM_LIMIT_01='5'", "bad device index"},
        Rejected{{"CUDA_DEVICE_SM_LIMIT=150"}, "CUDA_DEVICE_SM_LIMIT='150'", "expected an integer 0-100"},
        Rejected{{"CUDA_DEVICE_SM_LIMIT_1=-1"}, "CUDA_DEVICE_SM_LIMIT_1='-1'", "expected an integer 0-100"},
        // A malformed alias fails closed even when ours would win.
        Rejected{{"GPUSLICE_MEMORY_LIMIT=1Gi", "CUDA_DEVICE_MEMORY_LIMIT=junk"},
                 "CUDA_DEVICE_MEMORY_LIMIT='junk'",
                 "not a non-negative integer"}),
    [](const ::testing::TestParamInfo<Rejected>& info) { return "case" + std::to_string(info.index); });

// Found by libFuzzer: escapes of a long value pushed "expected" out of the
// 512-byte message. Values are cut by output width, not input length.
TEST(ParseOptions, LongEscapedValuesLeaveRoomForTheExpectation) {
  for (const std::string& value :
       {"5=8G" + std::string(200, '\x01'), std::string(300, '\xff'), "0=" + std::string(200, '\x7f') + "=1"}) {
    for (const char* name : {"GPUSLICE_MEMORY_LIMIT", "GPUSLICE_SM_LIMIT", "CUDA_DEVICE_MEMORY_LIMIT_15",
                             "GPUSLICE_REGION", "GPUSLICE_CONTAINER_NAME"}) {
      const Parsed p = parse({std::string(name) + "=" + value});
      EXPECT_FALSE(p.ok) << name;
      EXPECT_THAT(p.error, HasSubstr("expected")) << p.error;
    }
  }
}

TEST(ParseOptions, LongValuesAreCutInMessages) {
  const Parsed p = parse({"GPUSLICE_MEMORY_LIMIT=" + std::string(3000, '9') + "x"});
  EXPECT_FALSE(p.ok);
  EXPECT_THAT(p.error, HasSubstr("...'"));
  EXPECT_THAT(p.error, HasSubstr("expected"));
}

// ---- printing ----

TEST(FormatOptions, EffectiveValuesWithSources) {
  const Parsed p = parse({"GPUSLICE_MEMORY_LIMIT=0=8Gi", "CUDA_DEVICE_MEMORY_LIMIT_1=1000", "GPUSLICE_LOG_LEVEL=debug",
                          "GPUSLICE_TYPO=1"});
  ASSERT_TRUE(p.ok) << p.error;
  char buf[8192];
  const int n = format_effective_options(p.options, buf, sizeof buf);
  ASSERT_GT(n, 0);
  const std::string text(buf, static_cast<std::size_t>(n));
  EXPECT_THAT(
      text,
      HasSubstr("gpuslice: GPUSLICE_MEMORY_LIMIT[0]=8Gi (8589934592 bytes) (GPUSLICE_MEMORY_LIMIT, environment)\n"));
  EXPECT_THAT(
      text,
      HasSubstr("gpuslice: GPUSLICE_MEMORY_LIMIT[1]=1000 (1000 bytes) (CUDA_DEVICE_MEMORY_LIMIT_1, environment)\n"));
  EXPECT_THAT(text, HasSubstr("gpuslice: GPUSLICE_MEMORY_LIMIT[other devices]=unlimited (default)\n"));
  EXPECT_THAT(text, HasSubstr("gpuslice: GPUSLICE_SM_LIMIT=100 (default)\n"));
  EXPECT_THAT(text, HasSubstr("gpuslice: GPUSLICE_LOG_LEVEL=debug (GPUSLICE_LOG_LEVEL, environment)\n"));
  EXPECT_THAT(text, HasSubstr("gpuslice: GPUSLICE_REGION=/dev/shm/gpuslice.region"));
  EXPECT_THAT(text, HasSubstr("gpuslice: GPUSLICE_TYPO is not a gpuslice option"));
  for (std::size_t i = 0; i < kOptionCount; ++i) EXPECT_THAT(text, HasSubstr(kOptions[i].env));
  EXPECT_EQ(format_effective_options(p.options, buf, 64), -1);
}

TEST(FormatOptions, MarkdownTableCoversTheTable) {
  char buf[16384];
  const int n = format_options_markdown(buf, sizeof buf);
  ASSERT_GT(n, 0);
  const std::string text(buf, static_cast<std::size_t>(n));
  EXPECT_EQ(text.rfind("| Variable | Default | Accepted values | Description |\n|---|---|---|---|\n", 0), 0u);
  for (const OptionInfo& o : kOptions) EXPECT_THAT(text, HasSubstr(std::string("| `") + o.env + "` | "));
  EXPECT_THAT(text, HasSubstr("hard \\| elastic"));  // '|' escaped inside cells
  EXPECT_THAT(text, HasSubstr("`CUDA_DEVICE_MEMORY_LIMIT_<i>`"));
  EXPECT_EQ(format_options_markdown(buf, 100), -1);
}

TEST(OptionTable, ConstexprView) {
  static_assert(kOptions[0].type == OptionType::per_device_size);
  EXPECT_STREQ(kOptions[0].env, "GPUSLICE_MEMORY_LIMIT");
  EXPECT_STREQ(kOptions[0].id, "memory_limit");
  EXPECT_STREQ(kOptions[0].type_name, "per_device_size");
  for (const OptionInfo& o : kOptions) {
    EXPECT_EQ(std::string(o.env).rfind("GPUSLICE_", 0), 0u) << o.env;
    EXPECT_NE(std::string(o.doc), "");
    EXPECT_NE(std::string(o.range), "");
  }
}

// ---- options added with the generated table ----

TEST(NewOptions, DefaultsComeFromTheTable) {
  const Parsed p = parse({});
  ASSERT_TRUE(p.ok) << p.error;
  EXPECT_EQ(p.options.priority, Priority::normal);
  EXPECT_EQ(p.options.oversubscribe, kOversubscribeFail);
  EXPECT_EQ(p.options.oversubscribe_wait, 30000u);
  EXPECT_FALSE(p.options.passthrough);
  for (std::uint32_t d = 0; d < kMaxDevices; ++d) EXPECT_EQ(p.options.memory_resident[d], kUnlimited);
  EXPECT_STREQ(p.options.real_libcuda, "libcuda.so.1");  // the remark in parentheses is not part of the value
  EXPECT_EQ(std::string(p.options.region), "/dev/shm/gpuslice.region");  // one per container, not per uid
  EXPECT_STREQ(p.options.priority_source.name, "default");
}

TEST(NewOptions, WordsAnyCaseAndErrorsListTheWords) {
  Parsed p = parse({"GPUSLICE_PRIORITY=HIGH", "GPUSLICE_OVERSUBSCRIBE=Wait", "GPUSLICE_OVERSUBSCRIBE_WAIT=2s"});
  ASSERT_TRUE(p.ok) << p.error;
  EXPECT_EQ(p.options.priority, Priority::high);
  EXPECT_EQ(p.options.oversubscribe, kOversubscribeWait);
  EXPECT_EQ(p.options.oversubscribe_wait, 2000u);
  EXPECT_FALSE(p.options.passthrough);
  EXPECT_TRUE(parse({"GPUSLICE_PASSTHROUGH=yes"}).options.passthrough);
  EXPECT_STREQ(p.options.priority_source.name, "GPUSLICE_PRIORITY");
  p = parse({"GPUSLICE_PRIORITY=urgent"});
  EXPECT_FALSE(p.ok);
  EXPECT_THAT(p.error, HasSubstr("GPUSLICE_PRIORITY='urgent': unknown value, expected high, normal or low"));
  p = parse({"GPUSLICE_OVERSUBSCRIBE_WAIT=3601s"});
  EXPECT_FALSE(p.ok);
  EXPECT_THAT(p.error, HasSubstr("GPUSLICE_OVERSUBSCRIBE_WAIT='3601s': not a duration"));
  p = parse({"GPUSLICE_OVERSUBSCRIBE_WAIT=250"});
  ASSERT_TRUE(p.ok) << p.error;
  EXPECT_EQ(p.options.oversubscribe_wait, 250u);
  p = parse({"GPUSLICE_PASSTHROUGH=maybe"});
  EXPECT_FALSE(p.ok);
  EXPECT_THAT(p.error, HasSubstr("GPUSLICE_PASSTHROUGH='maybe'"));
  p = parse({"GPUSLICE_MEMORY_RESIDENT=0=2Gi"});
  ASSERT_TRUE(p.ok) << p.error;
  EXPECT_EQ(p.options.memory_resident[0], 2 * kGi);
  EXPECT_EQ(p.options.memory_resident[1], kUnlimited);
}

// GPUSLICE_PRIORITY_HANDOFF (docs/priority.md, "Many tenants"): off unless
// an operator turns it on; a flag's spellings; a bad value names the variable.
TEST(NewOptions, PriorityHandoffIsAFlagOffByDefault) {
  Parsed p = parse({});
  ASSERT_TRUE(p.ok) << p.error;
  EXPECT_FALSE(p.options.priority_handoff);
  EXPECT_STREQ(p.options.priority_handoff_source.name, "default");
  for (const char* on : {"GPUSLICE_PRIORITY_HANDOFF=true", "GPUSLICE_PRIORITY_HANDOFF=1",
                         "GPUSLICE_PRIORITY_HANDOFF=on", "GPUSLICE_PRIORITY_HANDOFF=YES"}) {
    p = parse({on});
    ASSERT_TRUE(p.ok) << on << ": " << p.error;
    EXPECT_TRUE(p.options.priority_handoff) << on;
    EXPECT_STREQ(p.options.priority_handoff_source.name, "GPUSLICE_PRIORITY_HANDOFF");
  }
  for (const char* off : {"GPUSLICE_PRIORITY_HANDOFF=false", "GPUSLICE_PRIORITY_HANDOFF=0",
                          "GPUSLICE_PRIORITY_HANDOFF=off", "GPUSLICE_PRIORITY_HANDOFF=No"}) {
    p = parse({off});
    ASSERT_TRUE(p.ok) << off << ": " << p.error;
    EXPECT_FALSE(p.options.priority_handoff) << off;
  }
  p = parse({"GPUSLICE_PRIORITY_HANDOFF=sometimes"});
  EXPECT_FALSE(p.ok);
  EXPECT_THAT(p.error, HasSubstr("GPUSLICE_PRIORITY_HANDOFF='sometimes'"));
  p = parse({"GPUSLICE_PRIORITY_HANDOFF=on"});
  char buf[16384];
  const int n = format_effective_options(p.options, buf, sizeof buf);
  ASSERT_GT(n, 0);
  EXPECT_THAT(std::string(buf, static_cast<std::size_t>(n)),
              HasSubstr("gpuslice: GPUSLICE_PRIORITY_HANDOFF=true (GPUSLICE_PRIORITY_HANDOFF, environment)\n"));
}

TEST(NewOptions, AllOnesIsNotAQuota) {
  Parsed p = parse({"GPUSLICE_MEMORY_LIMIT=18446744073709551615"});
  EXPECT_FALSE(p.ok);
  EXPECT_THAT(p.error, HasSubstr("GPUSLICE_MEMORY_LIMIT='18446744073709551615': 2^64-1 bytes is not a quota"));
  p = parse({"CUDA_DEVICE_MEMORY_LIMIT_0=18446744073709551615"});
  EXPECT_FALSE(p.ok);
  EXPECT_THAT(p.error, HasSubstr("CUDA_DEVICE_MEMORY_LIMIT_0="));
}

TEST(HamiAliases, ScalarAliasesMapOntoOurs) {
  Parsed p = parse({"CUDA_TASK_PRIORITY=0", "CUDA_OVERSUBSCRIBE=true",
                    "CUDA_DEVICE_MEMORY_SHARED_CACHE=/usr/local/vgpu/a.cache", "LIBCUDA_LOG_LEVEL=4",
                    "GPU_CORE_UTILIZATION_POLICY=force"});
  ASSERT_TRUE(p.ok) << p.error;
  EXPECT_EQ(p.options.priority, Priority::high);
  EXPECT_STREQ(p.options.priority_source.name, "CUDA_TASK_PRIORITY");
  EXPECT_EQ(p.options.oversubscribe, kOversubscribeSpill);
  EXPECT_FALSE(p.options.passthrough);
  EXPECT_STREQ(p.options.region, "/usr/local/vgpu/a.cache");
  EXPECT_STREQ(p.options.region_source.name, "CUDA_DEVICE_MEMORY_SHARED_CACHE");
  EXPECT_EQ(p.options.log_level, kLogDebug);
  EXPECT_EQ(p.options.sm_policy, SmPolicy::hard);

  p = parse({"CUDA_TASK_PRIORITY=1", "CUDA_OVERSUBSCRIBE=FALSE", "GPU_CORE_UTILIZATION_POLICY=default",
             "LIBCUDA_LOG_LEVEL=0"});
  ASSERT_TRUE(p.ok) << p.error;
  EXPECT_EQ(p.options.priority, Priority::low);
  EXPECT_EQ(p.options.oversubscribe, kOversubscribeFail);  // false = not set
  EXPECT_STREQ(p.options.oversubscribe_source.name, "default");
  EXPECT_EQ(p.options.sm_policy, SmPolicy::elastic);
  EXPECT_EQ(p.options.log_level, kLogError);
}

TEST(HamiAliases, OursWinAndBadValuesNameTheAlias) {
  Parsed p = parse({"CUDA_TASK_PRIORITY=0", "GPUSLICE_PRIORITY=low"});
  ASSERT_TRUE(p.ok) << p.error;
  EXPECT_EQ(p.options.priority, Priority::low);
  p = parse({"CUDA_DEVICE_MEMORY_SHARED_CACHE=relative.cache"});
  EXPECT_FALSE(p.ok);
  EXPECT_THAT(p.error, HasSubstr("CUDA_DEVICE_MEMORY_SHARED_CACHE='relative.cache': relative path"));
  // Something that limits (or lifts the limits) fails closed on a value HAMi does not know.
  p = parse({"CUDA_DISABLE_CONTROL=yes"});
  EXPECT_FALSE(p.ok);
  EXPECT_THAT(p.error, HasSubstr("CUDA_DISABLE_CONTROL='yes': unknown value, expected one of 1, t, true, 0, f, false"));
}

TEST(HamiAliases, CorePolicyDisableLiftsOnlyTheAliasSmLimit) {
  Parsed p = parse({"GPU_CORE_UTILIZATION_POLICY=disable", "CUDA_DEVICE_SM_LIMIT=30"});
  ASSERT_TRUE(p.ok) << p.error;
  EXPECT_EQ(p.options.sm_limit[0], 100u);
  EXPECT_STREQ(p.options.sm_limit_source[0].name, "GPU_CORE_UTILIZATION_POLICY");
  p = parse({"GPU_CORE_UTILIZATION_POLICY=disable", "GPUSLICE_SM_LIMIT=30"});
  ASSERT_TRUE(p.ok) << p.error;
  EXPECT_EQ(p.options.sm_limit[0], 30u);
}

TEST(NewOptions, PassthroughClearsEveryLimit) {
  const Parsed p = parse(
      {"CUDA_DISABLE_CONTROL=true", "GPUSLICE_MEMORY_LIMIT=1Gi", "GPUSLICE_SM_LIMIT=20", "GPUSLICE_PRIORITY=low"});
  ASSERT_TRUE(p.ok) << p.error;
  EXPECT_TRUE(p.options.passthrough);
  EXPECT_EQ(p.options.memory_limit[0], kUnlimited);
  EXPECT_EQ(p.options.sm_limit[0], 100u);
  EXPECT_EQ(p.options.priority, Priority::normal);
  EXPECT_STREQ(p.options.memory_limit_source[0].name, "CUDA_DISABLE_CONTROL");
}

TEST(FormatOptions, EveryNewOptionIsPrinted) {
  const Parsed p = parse({"GPUSLICE_PRIORITY=low", "GPUSLICE_OVERSUBSCRIBE_WAIT=1500ms"});
  ASSERT_TRUE(p.ok) << p.error;
  char buf[16384];
  const int n = format_effective_options(p.options, buf, sizeof buf);
  ASSERT_GT(n, 0);
  const std::string text(buf, static_cast<std::size_t>(n));
  EXPECT_THAT(text, HasSubstr("gpuslice: GPUSLICE_PRIORITY=low (GPUSLICE_PRIORITY, environment)\n"));
  EXPECT_THAT(text, HasSubstr("gpuslice: GPUSLICE_OVERSUBSCRIBE=fail (default)\n"));
  EXPECT_THAT(text,
              HasSubstr("gpuslice: GPUSLICE_OVERSUBSCRIBE_WAIT=1500ms (GPUSLICE_OVERSUBSCRIBE_WAIT, environment)\n"));
  EXPECT_THAT(text, HasSubstr("gpuslice: GPUSLICE_PASSTHROUGH=false (default)\n"));
  EXPECT_THAT(text, HasSubstr("gpuslice: GPUSLICE_MEMORY_RESIDENT=unlimited (default)\n"));
}

}  // namespace
}  // namespace gpuslice::options

// HAMi's own spellings of its variables (HAMi-core reads CUDA_TASK_PRIORITY and
// LIBCUDA_LOG_LEVEL with atoi and GPU_CORE_UTILIZATION_POLICY by strcmp with
// force/FORCE/disable/DISABLE, anything else its default; the device plugin
// reads CUDA_DISABLE_CONTROL with Go's strconv.ParseBool): every spelling
// with HAMi's meaning. Values of what does not limit that HAMi gives no meaning
// we keep are taken as not set (the default), with one warning line.
namespace gpuslice::options {
namespace {

struct Spelling {
  const char* entry;
  const char* option;  // the option it sets
  const char* value;   // as the debug listing prints it
  bool warns;
};

std::string effective(const Options& o, const char* option) {
  char text[16384];
  if (format_effective_options(o, text, sizeof text) < 0) return "";
  const std::string s = text;
  const std::string key = std::string("gpuslice: ") + option + "=";
  const auto at = s.find(key);
  if (at == std::string::npos) return "";
  const auto end = s.find(' ', at + key.size());
  return s.substr(at + key.size(), end - at - key.size());
}

TEST(HamiValues, EverySpellingHamiAccepts) {
  const Spelling spellings[] = {
      // CUDA_DISABLE_CONTROL: strconv.ParseBool.
      {"CUDA_DISABLE_CONTROL=1", "GPUSLICE_PASSTHROUGH", "true", false},
      {"CUDA_DISABLE_CONTROL=t", "GPUSLICE_PASSTHROUGH", "true", false},
      {"CUDA_DISABLE_CONTROL=T", "GPUSLICE_PASSTHROUGH", "true", false},
      {"CUDA_DISABLE_CONTROL=TRUE", "GPUSLICE_PASSTHROUGH", "true", false},
      {"CUDA_DISABLE_CONTROL=true", "GPUSLICE_PASSTHROUGH", "true", false},
      {"CUDA_DISABLE_CONTROL=True", "GPUSLICE_PASSTHROUGH", "true", false},
      {"CUDA_DISABLE_CONTROL=0", "GPUSLICE_PASSTHROUGH", "false", false},
      {"CUDA_DISABLE_CONTROL=f", "GPUSLICE_PASSTHROUGH", "false", false},
      {"CUDA_DISABLE_CONTROL=F", "GPUSLICE_PASSTHROUGH", "false", false},
      {"CUDA_DISABLE_CONTROL=FALSE", "GPUSLICE_PASSTHROUGH", "false", false},
      {"CUDA_DISABLE_CONTROL=false", "GPUSLICE_PASSTHROUGH", "false", false},
      {"CUDA_DISABLE_CONTROL=False", "GPUSLICE_PASSTHROUGH", "false", false},
      // CUDA_TASK_PRIORITY: atoi, a lower number first; HAMi's default is 1.
      {"CUDA_TASK_PRIORITY=0", "GPUSLICE_PRIORITY", "high", false},
      {"CUDA_TASK_PRIORITY=1", "GPUSLICE_PRIORITY", "low", false},
      {"CUDA_TASK_PRIORITY=2", "GPUSLICE_PRIORITY", "low", false},
      {"CUDA_TASK_PRIORITY=10", "GPUSLICE_PRIORITY", "low", false},
      {"CUDA_TASK_PRIORITY=00", "GPUSLICE_PRIORITY", "high", false},
      {"CUDA_TASK_PRIORITY=-1", "GPUSLICE_PRIORITY", "normal", true},
      {"CUDA_TASK_PRIORITY=high", "GPUSLICE_PRIORITY", "normal", true},
      {"CUDA_TASK_PRIORITY=", "GPUSLICE_PRIORITY", "normal", true},
      // LIBCUDA_LOG_LEVEL: atoi; HAMi-core logs errors always, warnings from 2,
      // info from 3, debug from 4.
      {"LIBCUDA_LOG_LEVEL=0", "GPUSLICE_LOG_LEVEL", "error", false},
      {"LIBCUDA_LOG_LEVEL=1", "GPUSLICE_LOG_LEVEL", "error", false},
      {"LIBCUDA_LOG_LEVEL=-1", "GPUSLICE_LOG_LEVEL", "error", false},
      {"LIBCUDA_LOG_LEVEL=2", "GPUSLICE_LOG_LEVEL", "warn", false},
      {"LIBCUDA_LOG_LEVEL=3", "GPUSLICE_LOG_LEVEL", "info", false},
      {"LIBCUDA_LOG_LEVEL=4", "GPUSLICE_LOG_LEVEL", "debug", false},
      {"LIBCUDA_LOG_LEVEL=5", "GPUSLICE_LOG_LEVEL", "debug", false},
      {"LIBCUDA_LOG_LEVEL=03", "GPUSLICE_LOG_LEVEL", "info", false},
      {"LIBCUDA_LOG_LEVEL=verbose", "GPUSLICE_LOG_LEVEL", "warn", true},
      {"LIBCUDA_LOG_LEVEL=", "GPUSLICE_LOG_LEVEL", "warn", true},
      // GPU_CORE_UTILIZATION_POLICY: force/FORCE, disable/DISABLE, else default.
      {"GPU_CORE_UTILIZATION_POLICY=force", "GPUSLICE_SM_POLICY", "hard", false},
      {"GPU_CORE_UTILIZATION_POLICY=FORCE", "GPUSLICE_SM_POLICY", "hard", false},
      {"GPU_CORE_UTILIZATION_POLICY=default", "GPUSLICE_SM_POLICY", "elastic", false},
      {"GPU_CORE_UTILIZATION_POLICY=DEFAULT", "GPUSLICE_SM_POLICY", "elastic", false},
      {"GPU_CORE_UTILIZATION_POLICY=disable", "GPUSLICE_SM_POLICY", "hard", false},  // lifts the alias SM limit instead
      {"GPU_CORE_UTILIZATION_POLICY=DISABLE", "GPUSLICE_SM_POLICY", "hard", false},
      {"GPU_CORE_UTILIZATION_POLICY=", "GPUSLICE_SM_POLICY", "elastic", true},
      {"GPU_CORE_UTILIZATION_POLICY=sometimes", "GPUSLICE_SM_POLICY", "elastic", true},
  };
  for (const Spelling& s : spellings) {
    const Parsed p = parse({s.entry});
    ASSERT_TRUE(p.ok) << s.entry << ": " << p.error;
    EXPECT_EQ(effective(p.options, s.option), s.value) << s.entry;
    if (s.warns) {
      const std::string name(s.entry, std::string(s.entry).find('='));
      EXPECT_THAT(std::string(p.options.alias_warning), HasSubstr(name + "=")) << s.entry;
      EXPECT_THAT(std::string(p.options.alias_warning), HasSubstr("(HAMi knows ")) << s.entry;
    } else {
      EXPECT_STREQ(p.options.alias_warning, "") << s.entry;
    }
  }
}

TEST(HamiValues, TheWarningIsOneLineOfTheListing) {
  const Parsed p = parse({"CUDA_TASK_PRIORITY=-3", "LIBCUDA_LOG_LEVEL=x"});
  ASSERT_TRUE(p.ok) << p.error;
  EXPECT_STREQ(p.options.alias_warning,
               "CUDA_TASK_PRIORITY='-3': unknown value (HAMi knows 0, 1 and above), taken as not set");
  char text[16384];
  ASSERT_GT(format_effective_options(p.options, text, sizeof text), 0);
  EXPECT_THAT(std::string(text), HasSubstr("gpuslice: CUDA_TASK_PRIORITY='-3': unknown value"));
}

TEST(HamiValues, OursStillWinAndKeepNoWarning) {
  const Parsed p = parse({"CUDA_TASK_PRIORITY=-3", "GPUSLICE_PRIORITY=high"});
  ASSERT_TRUE(p.ok) << p.error;
  EXPECT_EQ(p.options.priority, Priority::high);
  EXPECT_STREQ(p.options.alias_warning, "");
}

// Passthrough is what lifts every limit: a value HAMi does not accept fails closed.
TEST(HamiValues, UnknownDisableControlFailsClosed) {
  for (const char* v : {"yes", "on", "2", "", "tru"}) {
    const Parsed p = parse({std::string("CUDA_DISABLE_CONTROL=") + v});
    EXPECT_FALSE(p.ok) << v;
    EXPECT_THAT(p.error, HasSubstr("expected one of 1, t, true, 0, f, false")) << v;
  }
}

}  // namespace
}  // namespace gpuslice::options
