#include "text.h"

namespace gpuslice::tools {
namespace {

bool shown_as_is(unsigned char c) { return c >= 0x20 && c < 0x7f && c != '\\'; }

}  // namespace

std::size_t escape_untrusted_to(const char* in, std::size_t n, char* out, std::size_t cap) noexcept {
  static constexpr char kHex[] = "0123456789abcdef";
  if (cap == 0) return 0;
  std::size_t used = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const auto c = static_cast<unsigned char>(in[i]);
    if (shown_as_is(c)) {
      if (used + 1 >= cap) break;
      out[used++] = static_cast<char>(c);
    } else {
      if (used + 4 >= cap) break;
      out[used++] = '\\';
      out[used++] = 'x';
      out[used++] = kHex[c >> 4];
      out[used++] = kHex[c & 0xf];
    }
  }
  out[used] = '\0';
  return used;
}

std::string escape_untrusted(std::string_view raw) {
  std::string out(raw.size() * 4 + 1, '\0');
  out.resize(escape_untrusted_to(raw.data(), raw.size(), out.data(), out.size()));
  return out;
}

bool valid_name(std::string_view name, std::size_t max_bytes, const char* what, std::string* why) {
  auto fail = [&](const char* problem) {
    *why = std::string(what) + " '" + escape_untrusted(name) + "': " + problem + ", expected 1-" +
           std::to_string(max_bytes) +
           " printable ASCII characters other than '/' and '\\', with no blank at either end";
    return false;
  };
  if (name.empty()) return fail("empty");
  if (name.size() > max_bytes) return fail("too long");
  for (char c : name) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x20 || u == 0x7f) return fail("holds a control character");
    if (u >= 0x80) return fail("holds a byte that is not ASCII");
    if (c == '/' || c == '\\') return fail(c == '/' ? "holds '/'" : "holds '\\'");
  }
  if (name.front() == ' ' || name.back() == ' ') return fail("starts or ends with a blank");
  if (name == "." || name == "..") return fail("is a directory reference");
  return true;
}

}  // namespace gpuslice::tools
