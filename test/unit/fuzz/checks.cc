#include "checks.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <type_traits>

// Sanitizer reports go to the real stderr while a capture runs.
#if defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(undefined_behavior_sanitizer)
#define GPUSLICE_FUZZ_HAVE_SANITIZER_API 1
#endif
#endif
#if !defined(GPUSLICE_FUZZ_HAVE_SANITIZER_API) && defined(__SANITIZE_ADDRESS__)
#define GPUSLICE_FUZZ_HAVE_SANITIZER_API 1
#endif
#ifdef GPUSLICE_FUZZ_HAVE_SANITIZER_API
#include <sanitizer/common_interface_defs.h>
#endif

namespace gpuslice::fuzz {
namespace {

int g_report_fd = 2;

bool metric_start(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':'; }
bool metric_char(char c) { return metric_start(c) || (c >= '0' && c <= '9'); }
bool label_start(char c) { return metric_start(c) && c != ':'; }
bool label_char(char c) { return label_start(c) || (c >= '0' && c <= '9'); }

bool sample_value(const std::string& v) {
  if (v == "+Inf" || v == "-Inf" || v == "NaN") return true;
  if (v.empty()) return false;
  char* end = nullptr;
  std::strtod(v.c_str(), &end);
  return end == v.c_str() + v.size();
}

std::string check_sample(const std::string& line, bool utf8) {
  std::size_t i = 0;
  if (line.empty() || !metric_start(line[0])) return "a sample line must start with a metric name";
  while (i < line.size() && metric_char(line[i])) ++i;
  if (i < line.size() && line[i] == '{') {
    ++i;
    while (i < line.size() && line[i] != '}') {
      if (!label_start(line[i])) return "a label name must start with [a-zA-Z_]";
      while (i < line.size() && label_char(line[i])) ++i;
      if (i + 1 >= line.size() || line[i] != '=' || line[i + 1] != '"') return "a label needs =\"value\"";
      i += 2;
      std::string value;
      for (; i < line.size() && line[i] != '"'; ++i) {
        if (line[i] == '\\') {
          if (i + 1 >= line.size() || (line[i + 1] != '\\' && line[i + 1] != '"' && line[i + 1] != 'n'))
            return "a label value holds an escape other than \\\\, \\\" or \\n";
          value += line[++i];
        } else {
          value += line[i];
        }
      }
      if (i >= line.size()) return "a label value is not closed on its line (raw newline?)";
      if (utf8 && !valid_utf8(value)) return "a label value is not UTF-8";
      ++i;  // closing quote
      if (i < line.size() && line[i] == ',') ++i;
    }
    if (i >= line.size()) return "labels not closed with '}'";
    ++i;
  }
  if (i >= line.size() || line[i] != ' ') return "no ' ' before the value";
  std::string rest = line.substr(i + 1);
  const std::size_t space = rest.find(' ');
  if (space != std::string::npos) {  // an optional timestamp
    const std::string ts = rest.substr(space + 1);
    rest.resize(space);
    if (ts.empty() || ts.find_first_not_of("-0123456789") != std::string::npos) return "bad timestamp";
  }
  if (!sample_value(rest)) return "the value is not a float";
  return "";
}

template <class T>
bool same_value(const T& a, const T& b) {
  if constexpr (std::is_array_v<T>) {
    if constexpr (std::is_same_v<std::remove_extent_t<T>, char>) {
      return std::strncmp(a, b, sizeof a) == 0;
    } else {
      return std::equal(std::begin(a), std::end(a), std::begin(b));
    }
  } else {
    return a == b;
  }
}

}  // namespace

bool valid_utf8(const std::string& s) {
  std::size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    std::size_t more;
    if (c < 0x80) {
      more = 0;
    } else if (c >= 0xc2 && c <= 0xdf) {
      more = 1;
    } else if (c >= 0xe0 && c <= 0xef) {
      more = 2;
    } else if (c >= 0xf0 && c <= 0xf4) {
      more = 3;
    } else {
      return false;
    }
    if (more != 0 && i + more >= s.size()) return false;  // cut short
    for (std::size_t k = 1; k <= more; ++k) {
      if ((static_cast<unsigned char>(s[i + k]) & 0xc0) != 0x80) return false;
    }
    if (more >= 2) {  // no overlong forms, surrogates or code points past U+10FFFF
      const auto c1 = static_cast<unsigned char>(s[i + 1]);
      if (c == 0xe0 && c1 < 0xa0) return false;
      if (c == 0xed && c1 >= 0xa0) return false;
      if (c == 0xf0 && c1 < 0x90) return false;
      if (c == 0xf4 && c1 >= 0x90) return false;
    }
    i += more + 1;
  }
  return true;
}

std::string check_exposition(const std::string& text, bool utf8, std::size_t* samples) {
  *samples = 0;
  if (!text.empty() && text.back() != '\n') return "the exposition does not end with a newline";
  std::size_t pos = 0;
  while (pos < text.size()) {
    const std::size_t nl = text.find('\n', pos);
    const std::string line = text.substr(pos, nl - pos);
    pos = nl + 1;
    if (line.rfind("# HELP ", 0) == 0 || line.rfind("# TYPE ", 0) == 0) continue;
    if (line.empty() || line[0] == '#') return "an empty or unknown comment line";
    const std::string why = check_sample(line, utf8);
    if (!why.empty()) return why + ": " + line;
    ++*samples;
  }
  return "";
}

std::string check_lines(const std::string& log, const char* prefix) {
  if (!log.empty() && log.back() != '\n') return "the log does not end with a newline";
  std::size_t pos = 0;
  while (pos < log.size()) {
    const std::size_t nl = log.find('\n', pos);
    if (log.compare(pos, std::strlen(prefix), prefix) != 0)
      return "a log line without the prefix: " + log.substr(pos, nl - pos);
    pos = nl + 1;
  }
  return "";
}

std::string differing_option(const options::Options& a, const options::Options& b) {
#define GPUSLICE_OPTION(id, env, kind, def, range, doc) \
  if (std::strcmp(env, "GPUSLICE_CONFIG_FILE") != 0 && !same_value(a.id, b.id)) return env;
#define GPUSLICE_CHOICE(id, env, kind, Enum, def, words, doc) \
  if (!same_value(a.id, b.id)) return env;
#include "gpuslice/options.def"
#undef GPUSLICE_CHOICE
#undef GPUSLICE_OPTION
  return "";
}

StderrCapture::StderrCapture() {
  const char* show = std::getenv("GPUSLICE_FUZZ_SHOW_STDERR");
  if (show != nullptr && *show != '\0' && *show != '0') return;
  memfd_ = memfd_create("fuzz-stderr", MFD_CLOEXEC);
  saved_ = memfd_ < 0 ? -1 : dup(2);
  if (saved_ < 0 || dup2(memfd_, 2) < 0) {
    if (memfd_ >= 0) close(memfd_);
    if (saved_ >= 0) close(saved_);
    memfd_ = saved_ = -1;
    return;
  }
  g_report_fd = saved_;
#ifdef GPUSLICE_FUZZ_HAVE_SANITIZER_API
  __sanitizer_set_report_fd(reinterpret_cast<void*>(static_cast<long>(saved_)));
#endif
}

StderrCapture::~StderrCapture() { finish(); }

std::string StderrCapture::finish() {
  if (memfd_ < 0) return "";
  dup2(saved_, 2);
#ifdef GPUSLICE_FUZZ_HAVE_SANITIZER_API
  __sanitizer_set_report_fd(reinterpret_cast<void*>(2L));
#endif
  g_report_fd = 2;
  close(saved_);
  std::string out;
  char buf[4096];
  off_t off = 0;
  for (ssize_t n; (n = pread(memfd_, buf, sizeof buf, off)) > 0; off += n) out.append(buf, static_cast<std::size_t>(n));
  close(memfd_);
  memfd_ = saved_ = -1;
  return out;
}

int report_fd() { return g_report_fd; }

namespace {
void (*g_fail_cleanup)() = nullptr;
}  // namespace

void on_fail(void (*cleanup)()) { g_fail_cleanup = cleanup; }

void run_fail_cleanup() {
  if (void (*cleanup)() = g_fail_cleanup; cleanup != nullptr) {
    g_fail_cleanup = nullptr;
    cleanup();
  }
}

}  // namespace gpuslice::fuzz
