// NVML's UUID text form, shared by the preload library, limiter and agent.
#include <gtest/gtest.h>

#include <cstring>

#include "platform/uuid.h"

namespace platform = gpuslice::platform;

TEST(Uuid, FormatsNvmlTextForm) {
  const std::uint8_t u[16] = {0x00, 0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77,
                              0x88, 0x99, 0xaa, 0xbb, 0xcc, 0xdd, 0xee, 0xff};
  char text[platform::kUuidTextSize];
  platform::format_uuid(u, text);
  EXPECT_STREQ(text, "GPU-00112233-4455-6677-8899-aabbccddeeff");
  std::uint8_t back[16] = {};
  ASSERT_TRUE(platform::parse_uuid(text, back));
  EXPECT_EQ(0, std::memcmp(u, back, 16));
}

TEST(Uuid, ParsesWithoutPrefixAndInEitherCase) {
  std::uint8_t u[16] = {};
  ASSERT_TRUE(platform::parse_uuid("00112233445566778899AABBCCDDEEFF", u));
  EXPECT_EQ(u[15], 0xff);
  EXPECT_EQ(u[10], 0xaa);
}

TEST(Uuid, RejectsWrongLengthAndJunk) {
  std::uint8_t u[16];
  for (const char* bad : {"", "GPU-", "GPU-0011", "GPU-00112233-4455-6677-8899-aabbccddeeff00",
                          "GPU-00112233-4455-6677-8899-aabbccddeefg", "MIG-00112233-4455-6677-8899-aabbccddeeff"}) {
    EXPECT_FALSE(platform::parse_uuid(bad, u)) << bad;
  }
  EXPECT_FALSE(platform::parse_uuid(nullptr, u));
}
