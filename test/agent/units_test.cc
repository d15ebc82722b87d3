// Small pure pieces of the tools: durations, listen addresses, label escaping,
// byte formatting, UUIDs, /proc parsing.
#include <gtest/gtest.h>
#include <unistd.h>

#include "http.h"
#include "metrics.h"
#include "pidmap.h"
#include "region_io.h"
#include "units.h"
#include "view.h"

using namespace gpuslice::agent;

TEST(Units, Durations) {
  std::uint64_t ns = 0;
  EXPECT_TRUE(parse_duration("100ms", &ns));
  EXPECT_EQ(ns, 100'000'000u);
  EXPECT_TRUE(parse_duration("1.5s", &ns));
  EXPECT_EQ(ns, 1'500'000'000u);
  EXPECT_TRUE(parse_duration("5m", &ns));
  EXPECT_EQ(ns, 300'000'000'000u);
  EXPECT_TRUE(parse_duration("0", &ns));
  EXPECT_EQ(ns, 0u);
  for (const char* bad : {"", "ms", "100", "1.5", "10 s", "-1s", "1sec", "1e3ms", "99999999999999999999h"}) {
    EXPECT_FALSE(parse_duration(bad, &ns)) << bad;
  }
  EXPECT_EQ(format_duration(300'000'000'000), "5m");
  EXPECT_EQ(format_duration(100'000'000), "100ms");
}

TEST(Units, ListenAddresses) {
  std::string host, why;
  int port = 0;
  EXPECT_TRUE(parse_listen("127.0.0.1:9477", &host, &port, &why));
  EXPECT_EQ(host, "127.0.0.1");
  EXPECT_EQ(port, 9477);
  EXPECT_TRUE(parse_listen(":80", &host, &port, &why));
  EXPECT_EQ(host, "127.0.0.1");
  EXPECT_TRUE(parse_listen("[::1]:9477", &host, &port, &why));
  EXPECT_EQ(host, "::1");
  EXPECT_TRUE(parse_listen("0.0.0.0:0", &host, &port, &why));
  EXPECT_EQ(port, 0);
  for (const char* bad : {"9477", "host:", "host:http", "host:70000", "[::1]9477"}) {
    EXPECT_FALSE(parse_listen(bad, &host, &port, &why)) << bad;
  }
}

TEST(Units, LabelsAndText) {
  EXPECT_EQ(escape_label("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
  const char hostile[] = {'o', 'k', '\n', '\x7f', static_cast<char>(0xc3), '\\', '\0'};
  EXPECT_EQ(printable(hostile, sizeof hostile), "ok\\x0a\\x7f\\xc3\\x5c");
  EXPECT_EQ(format_bytes(0), "0B");
  EXPECT_EQ(format_bytes(8ull << 30), "8GiB");
  EXPECT_EQ(format_bytes(3ull << 29), "1.5GiB");
  EXPECT_EQ(format_bytes(1023), "1023B");
  EXPECT_EQ(format_bytes(~0ull), "16EiB");
}

TEST(Units, Uuids) {
  std::uint8_t u[16];
  ASSERT_TRUE(parse_uuid("GPU-00112233-4455-6677-8899-aabbccddeeff", u));
  EXPECT_EQ(format_uuid(u), "GPU-00112233-4455-6677-8899-aabbccddeeff");
  ASSERT_TRUE(parse_uuid("00112233445566778899AABBCCDDEEFF", u));
  EXPECT_EQ(u[15], 0xff);
  for (const char* bad : {"", "GPU-", "GPU-0011", "GPU-00112233-4455-6677-8899-aabbccddeeff00",
                          "GPU-zz112233-4455-6677-8899-aabbccddeeff"}) {
    EXPECT_FALSE(parse_uuid(bad, u)) << bad;
  }
}

TEST(Units, ProcInfoOfThisProcess) {
  ProcInfo info;
  ASSERT_TRUE(read_proc_info(static_cast<std::uint32_t>(getpid()), true, &info));
  EXPECT_NE(info.facts.pidns_inode, 0u);
  EXPECT_NE(info.facts.stat.start_time, 0u);
  EXPECT_EQ(info.ns_pid, static_cast<std::uint32_t>(getpid()));
  EXPECT_NE(info.facts.stat.state, 'Z');
  EXPECT_FALSE(read_proc_info(0x7ffffff0u, false, &info));
}
