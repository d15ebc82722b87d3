#include "platform/text.h"

#include <cerrno>

namespace gpuslice::platform {

Text& Text::str(const char* s, std::size_t n) noexcept {
  if (cap_ == 0) {
    truncated_ = truncated_ || n != 0;
    return *this;
  }
  for (std::size_t i = 0; i < n; ++i) {
    if (len_ + 1 >= cap_) {
      truncated_ = true;
      break;
    }
    buf_[len_++] = s[i];
  }
  buf_[len_] = '\0';
  return *this;
}

Text& Text::str(const char* s) noexcept {
  if (s == nullptr) s = "(null)";
  std::size_t n = 0;
  while (s[n] != '\0') ++n;
  return str(s, n);
}

Text& Text::ch(char c) noexcept { return str(&c, 1); }

Text& Text::u64(std::uint64_t v) noexcept {
  char digits[20];
  int n = 0;
  do {
    digits[n++] = static_cast<char>('0' + v % 10);
    v /= 10;
  } while (v != 0);
  char out[20];
  for (int i = 0; i < n; ++i) out[i] = digits[n - 1 - i];
  return str(out, static_cast<std::size_t>(n));
}

Text& Text::i64(std::int64_t v) noexcept {
  if (v < 0) {
    ch('-');
    return u64(~static_cast<std::uint64_t>(v) + 1);
  }
  return u64(static_cast<std::uint64_t>(v));
}

Text& Text::hex(std::uint64_t v) noexcept {
  static constexpr char kDigits[] = "0123456789abcdef";
  char out[18] = {'0', 'x'};
  int n = 2;
  bool started = false;
  for (int shift = 60; shift >= 0; shift -= 4) {
    unsigned nibble = static_cast<unsigned>((v >> shift) & 0xf);
    if (nibble != 0 || started || shift == 0) {
      out[n++] = kDigits[nibble];
      started = true;
    }
  }
  return str(out, static_cast<std::size_t>(n));
}

Text& Text::size(std::uint64_t bytes) noexcept {
  static constexpr const char* kUnits[] = {"Ki", "Mi", "Gi", "Ti", "Pi", "Ei"};
  int unit = -1;
  std::uint64_t v = bytes;
  while (v != 0 && v % 1024 == 0 && unit < 5) {
    v /= 1024;
    ++unit;
  }
  u64(v);
  return unit < 0 ? *this : str(kUnits[unit]);
}

Text& Text::quoted(const char* s, std::size_t max_chars) noexcept {
  ch('\'');
  escaped(s, max_chars);
  return ch('\'');
}

Text& Text::escaped(const char* s, std::size_t max_chars) noexcept {
  static constexpr char kDigits[] = "0123456789abcdef";
  if (s == nullptr) s = "";
  std::size_t shown = 0;  // output characters, escapes included
  std::size_t i = 0;
  for (; s[i] != '\0'; ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    const bool plain = c >= 0x20 && c < 0x7f && c != '\\' && c != '\'';
    const std::size_t width = plain ? 1 : 4;
    if (shown + width > max_chars) break;
    if (plain) {
      ch(static_cast<char>(c));
    } else {
      char esc[4] = {'\\', 'x', kDigits[c >> 4], kDigits[c & 0xf]};
      str(esc, 4);
    }
    shown += width;
  }
  if (s[i] != '\0') str("...");
  return *this;
}

Text& Text::errno_text(int err) noexcept {
  // Our own table: strerror() may allocate for unknown codes, and
  // strerrordesc_np() would tie the preload library to glibc >= 2.32.
  struct Entry {
    int code;
    const char* name;
    const char* text;
  };
  static constexpr Entry kErrors[] = {
      {EACCES, "EACCES", "Permission denied"},
      {EPERM, "EPERM", "Operation not permitted"},
      {ENOENT, "ENOENT", "No such file or directory"},
      {ENOTDIR, "ENOTDIR", "Not a directory"},
      {EISDIR, "EISDIR", "Is a directory"},
      {EEXIST, "EEXIST", "File exists"},
      {EROFS, "EROFS", "Read-only file system"},
      {ENOSPC, "ENOSPC", "No space left on device"},
      {EDQUOT, "EDQUOT", "Disk quota exceeded"},
      {ENAMETOOLONG, "ENAMETOOLONG", "File name too long"},
      {ELOOP, "ELOOP", "Too many levels of symbolic links"},
      {EMFILE, "EMFILE", "Too many open files"},
      {ENFILE, "ENFILE", "Too many open files in system"},
      {ENOMEM, "ENOMEM", "Cannot allocate memory"},
      {EINVAL, "EINVAL", "Invalid argument"},
      {EIO, "EIO", "Input/output error"},
      {EBUSY, "EBUSY", "Device or resource busy"},
      {ETXTBSY, "ETXTBSY", "Text file busy"},
      {EMLINK, "EMLINK", "Too many links"},
      {EXDEV, "EXDEV", "Invalid cross-device link"},
      {EOPNOTSUPP, "EOPNOTSUPP", "Operation not supported"},
      {ENODEV, "ENODEV", "No such device"},
      {EFBIG, "EFBIG", "File too large"},
      {EINTR, "EINTR", "Interrupted system call"},
      {EAGAIN, "EAGAIN", "Resource temporarily unavailable"},
  };
  for (const Entry& e : kErrors) {
    if (e.code == err) return str(e.text).str(" (").str(e.name).ch(')');
  }
  return str("errno ").i64(err);
}

std::size_t bounded_len(const char* s, std::size_t max) noexcept {
  std::size_t n = 0;
  while (n < max && s[n] != '\0') ++n;
  return n;
}

bool copy_string(char* dst, std::size_t cap, const char* s) noexcept {
  if (cap == 0) return false;
  std::size_t n = 0;
  for (; s[n] != '\0'; ++n) {
    if (n + 1 >= cap) {
      dst[n] = '\0';
      return false;
    }
    dst[n] = s[n];
  }
  dst[n] = '\0';
  return true;
}

bool starts_with(const char* s, const char* prefix) noexcept {
  for (; *prefix != '\0'; ++s, ++prefix) {
    if (*s != *prefix) return false;
  }
  return true;
}

}  // namespace gpuslice::platform
