// Grant records (tools/agent/grant.h): the agent, as root, acts on what it
// reads from the grant directory, so it takes exactly the text and the
// values gpuslice-smi writes and nothing else (test/unit/fuzz/grant_fuzz.cc
// checks the same over mutated inputs).
#include <gtest/gtest.h>

#include <string>

#include "agent_test_util.h"
#include "grant.h"

using namespace gpuslice;
using namespace gpuslice::agent_test;

namespace {

const std::string kUuid = "GPU-60616263-6465-6667-6869-6a6b6c6d6e6f";

bool parses(const std::string& text) {
  agent::Grant g;
  return agent::parse_grant(text, &g);
}

TEST(GrantRecord, WhatSmiWritesReadsBack) {
  agent::Grant g;
  g.lines = {grant_line(agent::GrantLine::quota, 0x60, 512 * kMi), grant_line(agent::GrantLine::sm, 0x60, 100),
             grant_line(agent::GrantLine::policy, 0x60, 1), grant_line(agent::GrantLine::priority, 0, 3)};
  const std::string text = agent::grant_text(g);
  EXPECT_EQ(text, "gpuslice-grant 1\nquota " + kUuid + " 536870912\nsm " + kUuid + " 100\npolicy " + kUuid +
                      " 1\npriority 3\n");
  agent::Grant back;
  ASSERT_TRUE(agent::parse_grant(text, &back));
  ASSERT_EQ(back.lines.size(), 4u);
  EXPECT_EQ(back.lines[0].value, 512 * kMi);
  EXPECT_EQ(back.lines[3].field, agent::GrantLine::priority);
  EXPECT_TRUE(parses("gpuslice-grant 1\n"));
  EXPECT_TRUE(parses("gpuslice-grant 1\nquota " + kUuid + " 18446744073709551615\n")) << "unlimited";
}

// Found by the grant fuzz target: the reader took any blank between words,
// a final line without its newline, other spellings of a UUID and of a number.
TEST(GrantRecord, OnlyTheTextSmiWritesIsTaken) {
  const std::string line = "quota " + kUuid + " 5\n";
  ASSERT_TRUE(parses("gpuslice-grant 1\n" + line));
  EXPECT_FALSE(parses("gpuslice-grant 1\nquota " + kUuid + " 5\r\n"));
  EXPECT_FALSE(parses("gpuslice-grant 1\nquota  " + kUuid + " 5\n"));
  EXPECT_FALSE(parses("gpuslice-grant 1\nquota\t" + kUuid + " 5\n"));
  EXPECT_FALSE(parses("gpuslice-grant 1\nquota " + kUuid + " 5 \n"));
  EXPECT_FALSE(parses("gpuslice-grant 1\nquota " + kUuid + " 5"));
  EXPECT_FALSE(parses("gpuslice-grant 1\nquota " + kUuid + " 05\n"));
  EXPECT_FALSE(parses("gpuslice-grant 1\nquota GPU-60616263-6465-6667-6869-6A6B6C6D6E6F 5\n"));
  EXPECT_FALSE(parses("gpuslice-grant 1\nquota 60616263-6465-6667-6869-6a6b6c6d6e6f 5\n"));
  EXPECT_FALSE(parses("gpuslice-grant 1\nquota " + kUuid + std::string("\0x", 2) + " 5\n"))
      << "a NUL ends the UUID for its parser, not the word";
  EXPECT_FALSE(parses("gpuslice-grant 1\n\n" + line));
  EXPECT_FALSE(parses(" gpuslice-grant 1\n" + line));
}

TEST(GrantRecord, ValuesSmiNeverWritesAreRefused) {
  EXPECT_FALSE(parses("gpuslice-grant 1\nquota " + kUuid + " 0\n")) << "smi refuses --memory 0";
  EXPECT_FALSE(parses("gpuslice-grant 1\nsm " + kUuid + " 0\n"));
  EXPECT_FALSE(parses("gpuslice-grant 1\nsm " + kUuid + " 101\n"));
  EXPECT_FALSE(parses("gpuslice-grant 1\nsm " + kUuid + " 4294967295\n"));
  EXPECT_FALSE(parses("gpuslice-grant 1\npolicy " + kUuid + " 2\n")) << "hard (0) or elastic (1)";
  EXPECT_FALSE(parses("gpuslice-grant 1\npriority 0\n"));
  EXPECT_FALSE(parses("gpuslice-grant 1\npriority 4\n"));
  EXPECT_TRUE(parses("gpuslice-grant 1\nsm " + kUuid + " 1\npolicy " + kUuid + " 0\npriority 1\n"));
}

// A record's name: <dev>-<ino>-<ns>-<pid>, digits and '-' only.
TEST(GrantRecord, NamesAreDigitsAndDashesOnly) {
  dev_t dev = 0;
  ino_t ino = 0;
  std::uint64_t ns = 0;
  const std::string name = agent::grant_name(2049, 77, 1764412345678901234, 4242);
  EXPECT_EQ(name, "2049-77-01764412345678901234-4242");
  ASSERT_TRUE(agent::parse_grant_name(name.c_str(), &dev, &ino, &ns));
  EXPECT_EQ(dev, 2049u);
  EXPECT_EQ(ino, 77u);
  EXPECT_EQ(ns, 1764412345678901234u);
  EXPECT_TRUE(agent::parse_grant_name("1-2-3-4", &dev, &ino, &ns));
  EXPECT_EQ(ns, 3u);
  EXPECT_FALSE(agent::parse_grant_name("1--2-3-4", &dev, &ino, &ns)) << "a sign";
  EXPECT_FALSE(agent::parse_grant_name("1-+2-3-4", &dev, &ino, &ns));
  EXPECT_FALSE(agent::parse_grant_name("1- 2-3-4", &dev, &ino, &ns));
  EXPECT_FALSE(agent::parse_grant_name("1-2-3-4-", &dev, &ino, &ns));
  EXPECT_FALSE(agent::parse_grant_name("1-2-3", &dev, &ino, &ns));
}

}  // namespace
