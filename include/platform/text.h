// Fixed-buffer text formatting for messages built during bootstrap: no heap,
// no locale, no stdio (snprintf may allocate for some conversions and is not
// async-signal-safe), so the preload library can format errors from anywhere.
#pragma once

#include <cstddef>
#include <cstdint>

namespace gpuslice::platform {

class Text {
 public:
  Text(char* buf, std::size_t cap) noexcept : buf_(buf), cap_(cap) {
    if (cap_ != 0) buf_[0] = '\0';
  }
  Text& str(const char* s) noexcept;
  Text& str(const char* s, std::size_t n) noexcept;
  Text& ch(char c) noexcept;
  Text& u64(std::uint64_t v) noexcept;
  Text& i64(std::int64_t v) noexcept;
  Text& hex(std::uint64_t v) noexcept;  // 0x prefix, lower case
  // Size with its binary unit when exact ("8Gi"), else plain bytes.
  Text& size(std::uint64_t bytes) noexcept;
  // s with control and non-ASCII bytes as \xNN, cut to max_chars output
  // characters (then "..."): user input (an environment value, a file name)
  // stays one printable line and leaves room for the rest of the message.
  Text& quoted(const char* s, std::size_t max_chars = 120) noexcept;
  // The same escaping without the quotes (paths in messages).
  Text& escaped(const char* s, std::size_t max_chars = 160) noexcept;
  Text& errno_text(int err) noexcept;  // "Permission denied (EACCES)"

  const char* c_str() const noexcept { return cap_ ? buf_ : ""; }
  std::size_t size() const noexcept { return len_; }
  bool truncated() const noexcept { return truncated_; }

 private:
  char* buf_;
  std::size_t cap_;
  std::size_t len_ = 0;
  bool truncated_ = false;
};

// Bounded string helpers (no heap; the libc ones are fine but these make the
// bounds explicit at every call site).
std::size_t bounded_len(const char* s, std::size_t max) noexcept;
// Copies s into dst[cap] NUL-terminated; false (dst holds a truncated copy) if it does not fit.
bool copy_string(char* dst, std::size_t cap, const char* s) noexcept;
bool starts_with(const char* s, const char* prefix) noexcept;

}  // namespace gpuslice::platform
