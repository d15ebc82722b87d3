// Hostile names read by the node tools (docs/security.md): a container names
// its region file, its directory's entries and the container name in its
// region header as it likes. One such name must not blind the monitoring of
// every other container (a 500 from /api/status, an exposition Prometheus
// refuses), forge a line in the agent's log or reach a terminal as control
// bytes, and two names must never be shown alike.
//
// The hostile files are valid regions made under a plain name and renamed:
// a container needs no library to write one.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "agent_test_util.h"
#include "text.h"

using namespace std::string_literals;
using namespace gpuslice;
using namespace gpuslice::agent_test;
using gpuslice::test::Env;
using gpuslice::test::Sandbox;
using nlohmann::json;

namespace {

// A valid region with one device, made under a plain name, then renamed to
// `hostile` (a path below the region directory).
void plant_region(const Sandbox& box, const std::string& hostile, const std::string& container_name,
                  std::uint8_t uuid_byte, std::uint64_t quota) {
  static int n = 0;
  const std::string staging = box.path("staging-" + std::to_string(n++) + ".region");
  Region* r = make_region(staging, container_name);
  ASSERT_NE(r, nullptr);
  ASSERT_GE(add_device(r, uuid_byte, quota), 0);
  shm::detach(r);
  ASSERT_EQ(std::rename(staging.c_str(), hostile.c_str()), 0) << hostile;
}

// Only printable ASCII and newlines.
bool printable_lines(const std::string& text) {
  for (char c : text) {
    const auto u = static_cast<unsigned char>(c);
    if (c != '\n' && (u < 0x20 || u >= 0x7f)) return false;
  }
  return true;
}

// The legitimate container: a real process under the library holding 8 MiB.
struct Node {
  Sandbox box;
  std::string regions = region_dir(box);
  pid_t probe = -1;
  pid_t agent = -1;
  int port = -1;

  void start_container() {
    mkdir(regions.c_str(), 0755);
    const Env env = test::merge(box.env(), {{"GPUSLICE_REGION", container_region(box)},
                                            {"GPUSLICE_MEMORY_LIMIT", "64Mi"},
                                            {"GPUSLICE_CONTAINER_NAME", "web"}});
    probe = test::spawn({test::bin("cuprobe"), "init", "ctx", "0", "alloc", std::to_string(8 * kMi), "touch",
                         box.path("held"), "waitfile", box.path("end")},
                        env, "/dev/null");
    ASSERT_TRUE(eventually([&] { return file_exists(box.path("held")); }, 20000));
  }
  void start_agent(const std::string& log_path) {
    port = free_port();
    ASSERT_GT(port, 0);
    // The log on stderr: spawn() sends stdout to log_path; the agent logs to stderr.
    agent = test::spawn(
        {"/bin/sh", "-c", "exec \"$0\" \"$@\" 2>&1", test::bin("gpuslice-agent"), "--region-dir", regions, "--nvml",
         fake_nvml(), "--interval", "20ms", "--rescan", "50ms", "--listen", "127.0.0.1:"s + std::to_string(port)},
        box.env(false), log_path);
  }
  ~Node() {
    write_file(box.path("end"), "");
    if (agent > 0) {
      kill(agent, SIGTERM);
      test::wait(agent);
    }
    if (probe > 0) test::wait(probe);
  }
};

// /metrics once the agent watches `regions` regions.
std::string metrics_with(httplib::Client& client, int regions) {
  std::string body;
  eventually(
      [&] {
        auto res = client.Get("/metrics");
        if (!res || res->status != 200) return false;
        body = res->body;
        return body.find("\ngpuslice_agent_regions " + std::to_string(regions) + "\n") != std::string::npos &&
               body.find("gpuslice_memory_counted_bytes{container=\"web\"") != std::string::npos;
      },
      20000);
  return body;
}

TEST(AgentHostileNames, NonUtf8RegionNamesLeaveStatusAndMetricsValidForEveryone) {
  Node node;
  node.start_container();
  mkdir((node.regions + "/pod-2").c_str(), 0755);
  // Two names that a lossy conversion (U+FFFD) would show alike, and a
  // container name that is not UTF-8 either.
  plant_region(node.box, node.regions + "/pod-2/\xff\xfe.region", "evil\xff", 0x21, 32 * kMi);
  plant_region(node.box, node.regions + "/pod-2/\xfe\xff.region", "", 0x22, 16 * kMi);
  node.start_agent("/dev/null");
  httplib::Client client("127.0.0.1", node.port);
  client.set_connection_timeout(1, 0);
  client.set_read_timeout(5, 0);
  const std::string exposition = metrics_with(client, 3);
  ASSERT_NE(exposition.find("\ngpuslice_agent_regions 3\n"), std::string::npos) << exposition;

  // The exposition, through the real Prometheus text parser (promtool).
  if (std::string(GPUSLICE_PROMTOOL).empty()) {
    // Without Debian's prometheus package (tools/setup.sh installs it) only
    // the checks below run; agent.prometheus_scrape is then skipped too.
    std::fprintf(stderr, "promtool not found: the exposition is not checked by Prometheus's parser\n");
  } else {
    write_file(node.box.path("metrics.txt"), exposition);
    const test::Result check = test::run(
        {"/bin/sh", "-c", "exec \"$0\" check metrics < \"$1\"", GPUSLICE_PROMTOOL, node.box.path("metrics.txt")}, {},
        60000);
    EXPECT_EQ(check.exit_code, 0) << check.describe();
  }
  EXPECT_TRUE(printable_lines(exposition)) << "bytes outside printable ASCII in /metrics";

  auto res = client.Get("/api/status");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  json doc;
  ASSERT_NO_THROW(doc = json::parse(res->body)) << res->body;  // strict: rejects ill-formed UTF-8
  std::map<std::string, double> quota;                         // region label -> quota
  std::set<std::string> containers;
  double web_used = -1;
  for (const json& s : doc["series"]) {
    if (!s["labels"].contains("region")) continue;
    const std::string region = s["labels"]["region"];
    if (s["metric"] == "gpuslice_memory_quota_bytes") quota[region] = s["value"];
    if (s["metric"] == "gpuslice_memory_used_bytes" && region == "pod-1/c.region") web_used = s["value"];
    containers.insert(s["labels"].value("container", ""));
  }
  // Every container's series, each hostile name shown escaped and apart.
  EXPECT_EQ(web_used, 8.0 * kMi);
  EXPECT_EQ(quota["pod-1/c.region"], 64.0 * kMi);
  EXPECT_EQ(quota["pod-2/\\xff\\xfe.region"], 32.0 * kMi);
  EXPECT_EQ(quota["pod-2/\\xfe\\xff.region"], 16.0 * kMi);
  EXPECT_EQ(quota.size(), 3u) << res->body;
  EXPECT_TRUE(containers.count("evil\\xff")) << res->body;
}

TEST(AgentHostileNames, NewlineInAFileNameForgesNoLogLine) {
  Node node;
  node.start_container();
  mkdir((node.regions + "/pod-2").c_str(), 0755);
  const std::string forged = "gpuslice: agent: warning: region of web: possible bypass by pid 1";  // no slash
  // A valid region and a junk file, each named to end the agent's line early
  // and start a line of the attacker's (with a terminal escape for good measure).
  plant_region(node.box, node.regions + "/pod-2/x\n" + forged + "\n\x1b[2J.region", "a\nb", 0x23, 8 * kMi);
  write_file(node.regions + "/pod-2/y\n" + forged + "\n.region", "junk");
  const std::string log = node.box.path("agent.log");
  node.start_agent(log);
  httplib::Client client("127.0.0.1", node.port);
  client.set_connection_timeout(1, 0);
  client.set_read_timeout(5, 0);
  metrics_with(client, 2);
  ASSERT_TRUE(eventually([&] { return read_file(log).find("skipping") != std::string::npos; }, 10000))
      << read_file(log);
  const std::string text = read_file(log);
  std::istringstream lines(text);
  std::string line;
  int count = 0;
  while (std::getline(lines, line)) {
    ++count;
    EXPECT_EQ(line.rfind(forged, 0), std::string::npos) << "forged line in the log:\n" << text;
    EXPECT_EQ(line.rfind("gpuslice: agent: ", 0), 0u) << "a line the agent did not start:\n" << text;
  }
  EXPECT_GE(count, 2);
  EXPECT_TRUE(printable_lines(text)) << text;
  EXPECT_NE(text.find("pod-2/x\\x0a" + forged + "\\x0a\\x1b[2J.region"), std::string::npos) << text;
}

// HAMi's layout names the container by a directory (<pod-uid>_<container>):
// that name reaches the container label through the same escape.
TEST(AgentHostileNames, HamiDirectoryNameIsEscapedInTheContainerLabel) {
  Sandbox box;
  const std::string pod = "0f4e8c2a-1b3d-4e5f-8a9b-0c1d2e3f4a5b";
  const std::string dir = box.path("vgpu/containers/" + pod + "_tr\xff\"ainer\n");
  mkdir(box.path("vgpu").c_str(), 0755);
  mkdir(box.path("vgpu/containers").c_str(), 0755);
  mkdir(dir.c_str(), 0755);
  mkdir(box.path("regions").c_str(), 0755);
  plant_region(box, dir + "/u.cache", "", 0x31, 512 * kMi);
  const test::Result r = test::run({test::bin("gpuslice-agent"), "--region-dir", box.path("regions"), "--hami-root",
                                    box.path("vgpu"), "--once", "--no-nvml"},
                                   {}, 30000);
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_TRUE(printable_lines(r.out)) << r.out;
  EXPECT_NE(r.out.find("gpuslice_memory_quota_bytes{container=\"tr\\\\xff\\\"ainer\\\\x0a\""), std::string::npos)
      << r.out;
  if (!std::string(GPUSLICE_PROMTOOL).empty()) {
    write_file(box.path("metrics.txt"), r.out);
    const test::Result check = test::run(
        {"/bin/sh", "-c", "exec \"$0\" check metrics < \"$1\"", GPUSLICE_PROMTOOL, box.path("metrics.txt")}, {}, 60000);
    EXPECT_EQ(check.exit_code, 0) << check.describe();
  }
}

// gpuslice-smi (the table, its JSON, its messages about skipped files) shows
// the same escaped names.
TEST(SmiHostileNames, TableJsonAndMessagesShowNamesEscapedAndApart) {
  Sandbox box;
  const std::string regions = region_dir(box);
  mkdir(regions.c_str(), 0755);
  mkdir((regions + "/pod-2").c_str(), 0755);
  plant_region(box, regions + "/pod-2/\xff.region", "", 0x21, 32 * kMi);
  plant_region(box, regions + "/pod-2/\xfe.region", "", 0x22, 16 * kMi);
  plant_region(box, regions + "/pod-2/t\x1b]0;owned\x07.region", "", 0x23, 8 * kMi);
  write_file(regions + "/pod-2/j\n\x1b[31m.region", "junk");
  const test::Result js = test::run({test::bin("gpuslice-smi"), "--region-dir", regions, "--json"}, {}, 30000);
  ASSERT_EQ(js.exit_code, 0) << js.describe();
  json doc;
  ASSERT_NO_THROW(doc = json::parse(js.out)) << js.out;
  std::set<std::string> paths;
  for (const json& r : doc["regions"]) paths.insert(r["path"].get<std::string>());
  EXPECT_EQ(paths,
            (std::set<std::string>{"pod-2/\\xff.region", "pod-2/\\xfe.region", "pod-2/t\\x1b]0;owned\\x07.region"}))
      << js.out;
  const test::Result table = test::run({test::bin("gpuslice-smi"), "--region-dir", regions}, {}, 30000);
  ASSERT_EQ(table.exit_code, 0) << table.describe();
  EXPECT_TRUE(printable_lines(table.out)) << table.out;
  EXPECT_NE(table.out.find("| pod-2/t\\x1b]0;owned"), std::string::npos) << table.out;  // the column cuts the rest
  EXPECT_TRUE(printable_lines(table.err)) << table.err;
  EXPECT_NE(table.err.find("pod-2/j\\x0a\\x1b[31m.region"), std::string::npos) << table.err;
  // A path given on the command line (or by $GPUSLICE_REGION) is shown escaped too.
  const test::Result one =
      test::run({test::bin("gpuslice-smi"), "--region", regions + "/pod-2/j\n\x1b[31m.region"}, {}, 30000);
  EXPECT_EQ(one.exit_code, 2) << one.describe();
  EXPECT_TRUE(printable_lines(one.err)) << one.err;
  EXPECT_NE(one.err.find("pod-2/j\\x0a\\x1b[31m.region: "), std::string::npos) << one.err;
}

TEST(UntrustedText, EscapesEverythingButPrintableAsciiAndIsInjective) {
  using tools::escape_untrusted;
  EXPECT_EQ(escape_untrusted("plain name-1.region"), "plain name-1.region");
  EXPECT_EQ(escape_untrusted("a\nb\x7f\xff\\"), "a\\x0ab\\x7f\\xff\\x5c");
  EXPECT_EQ(escape_untrusted(std::string("\0x", 2)), "\\x00x");
  // A name that looks like an escape is told apart from the bytes it mimics.
  EXPECT_NE(escape_untrusted("\\x0a"), escape_untrusted("\n"));
  EXPECT_NE(escape_untrusted("\xff"), escape_untrusted("\xfe"));
  // Every byte value, each alone: 256 distinct, printable results.
  std::set<std::string> seen;
  for (int b = 0; b < 256; ++b) {
    const std::string e = escape_untrusted(std::string(1, static_cast<char>(b)));
    EXPECT_TRUE(printable_lines(e) && e.find('\n') == std::string::npos) << b;
    seen.insert(e);
  }
  EXPECT_EQ(seen.size(), 256u);
  // The fixed-buffer form never cuts an escape in half.
  char out[6];
  EXPECT_EQ(tools::escape_untrusted_to("a\nb", 3, out, sizeof out), 5u);
  EXPECT_STREQ(out, "a\\x0a");
  EXPECT_EQ(tools::escape_untrusted_to("\n\n", 2, out, sizeof out), 4u);
  EXPECT_STREQ(out, "\\x0a");
}

}  // namespace
