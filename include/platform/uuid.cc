#include "platform/uuid.h"

namespace gpuslice::platform {

void format_uuid(const std::uint8_t uuid[16], char out[kUuidTextSize]) noexcept {
  static const char kHex[] = "0123456789abcdef";
  char* p = out;
  *p++ = 'G';
  *p++ = 'P';
  *p++ = 'U';
  *p++ = '-';
  for (int i = 0; i < 16; ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) *p++ = '-';
    *p++ = kHex[uuid[i] >> 4];
    *p++ = kHex[uuid[i] & 0xf];
  }
  *p = '\0';
}

bool parse_uuid(const char* text, std::uint8_t out[16]) noexcept {
  if (text == nullptr) return false;
  if (text[0] == 'G' && text[1] == 'P' && text[2] == 'U' && text[3] == '-') text += 4;
  int digits = 0;
  for (const char* p = text; *p != '\0'; ++p) {
    if (*p == '-') continue;
    const int v = (*p >= '0' && *p <= '9')   ? *p - '0'
                  : (*p >= 'a' && *p <= 'f') ? *p - 'a' + 10
                  : (*p >= 'A' && *p <= 'F') ? *p - 'A' + 10
                                             : -1;
    if (v < 0 || digits >= 32) return false;
    if (digits % 2 == 0)
      out[digits / 2] = static_cast<std::uint8_t>(v << 4);
    else
      out[digits / 2] = static_cast<std::uint8_t>(out[digits / 2] | v);
    ++digits;
  }
  return digits == 32;
}

}  // namespace gpuslice::platform
