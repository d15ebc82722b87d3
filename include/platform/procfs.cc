// /proc readers. See procfs.h.
#include "platform/procfs.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include "platform/fs.h"
#include "platform/text.h"

namespace gpuslice::platform::procfs {
namespace {

bool digit(char c) noexcept { return c >= '0' && c <= '9'; }

// A decimal number at text[*i..len), at least one digit, ending at a
// separator (or the end); *i moves past it. False on overflow or junk.
bool number(const char* text, std::size_t len, std::size_t* i, std::uint64_t* out) noexcept {
  std::size_t p = *i;
  std::uint64_t v = 0;
  if (p >= len || !digit(text[p])) return false;
  for (; p < len && digit(text[p]); ++p) {
    const auto d = static_cast<std::uint64_t>(text[p] - '0');
    if (v > (~0ull - d) / 10) return false;
    v = v * 10 + d;
  }
  if (p < len && text[p] != ' ' && text[p] != '\n' && text[p] != '\t' && text[p] != '\0') return false;
  *i = p;
  *out = v;
  return true;
}

}  // namespace

void path(char* buf, std::size_t cap, std::uint32_t pid, const char* leaf) noexcept {
  Text t(buf, cap);
  t.str("/proc/");
  if (pid == 0) {
    t.str("self");
  } else {
    t.u64(pid);
  }
  t.ch('/').str(leaf);
}

long read_file(const char* path, char* buf, std::size_t cap) noexcept {
  if (cap == 0) return -EINVAL;
  const int fd = open_at(AT_FDCWD, path, O_RDONLY);  // never 0-2 (fs.h)
  if (fd < 0) return -errno;
  std::size_t len = 0;
  while (len < cap - 1) {
    const ssize_t n = read(fd, buf + len, cap - 1 - len);
    if (n < 0) {
      if (errno == EINTR) continue;
      const int e = errno;
      close(fd);
      buf[len] = '\0';
      return -e;
    }
    if (n == 0) break;
    len += static_cast<std::size_t>(n);
  }
  close(fd);
  buf[len] = '\0';
  return static_cast<long>(len);
}

bool parse_stat(const char* text, std::size_t len, Stat* out) noexcept {
  std::size_t i = 0;
  std::uint64_t pid = 0;
  if (!number(text, len, &i, &pid) || pid > 0xffffffffull) return false;
  if (i + 1 >= len || text[i] != ' ' || text[i + 1] != '(') return false;
  std::size_t close_paren = len;
  for (std::size_t j = len; j > i + 1; --j) {
    if (text[j - 1] == ')') {
      close_paren = j - 1;
      break;
    }
  }
  if (close_paren == len) return false;
  std::size_t p = close_paren + 1;
  // ") S ": the state is one character between single spaces.
  if (p + 2 >= len || text[p] != ' ' || text[p + 1] == ' ' || text[p + 2] != ' ') return false;
  const char state = text[p + 1];
  p += 2;
  std::uint64_t threads = 0, flags = 0;
  for (int field = 3; field < 22; ++field) {  // p is at the space before field + 1
    if (p >= len || text[p] != ' ') return false;
    ++p;
    if (field + 1 == 22) break;
    if (field + 1 == 9 || field + 1 == 20) {
      if (!number(text, len, &p, field + 1 == 9 ? &flags : &threads)) return false;
      continue;
    }
    while (p < len && text[p] != ' ' && text[p] != '\n' && text[p] != '\0') ++p;
  }
  std::uint64_t start = 0;
  if (!number(text, len, &p, &start)) return false;
  out->pid = static_cast<std::uint32_t>(pid);
  out->state = state;
  out->num_threads = threads;
  out->flags = flags;
  out->start_time = start;
  return true;
}

bool in_exit(const Stat& st) noexcept {
  constexpr std::uint64_t kPfExiting = 0x4;  // include/linux/sched.h
  if (st.state == 'Z') return st.num_threads > 1;
  return st.state != 'X' && st.state != 'x' && (st.flags & kPfExiting) != 0;
}
int read_stat(std::uint32_t pid, Stat* out) noexcept {
  char file[64];
  path(file, sizeof file, pid, "stat");
  // comm is at most 16 bytes and the other 50 fields are numbers: 1 KiB holds
  // the line up to field 22 with a wide margin.
  char buf[1024];
  const long len = read_file(file, buf, sizeof buf);
  if (len < 0) return static_cast<int>(-len);
  return parse_stat(buf, static_cast<std::size_t>(len), out) ? 0 : EINVAL;
}

int read_process(std::uint32_t pid, bool want_pidns, Process* out) noexcept {
  *out = Process{};
  if (want_pidns) {
    char ns[64];
    path(ns, sizeof ns, pid, "ns/pid");
    struct stat st;
    if (stat(ns, &st) == 0) {
      out->pidns_inode = static_cast<std::uint64_t>(st.st_ino);
    } else if (errno == ENOENT || errno == ESRCH) {
      return out->error = errno;
    }  // else (EACCES: no ptrace access): namespace unknown
  }
  out->error = read_stat(pid, &out->stat);
  return out->error;
}

bool parse_nspid(const char* text, std::size_t len, NsPids* out) noexcept {
  static constexpr char kKey[] = "NSpid:";
  constexpr std::size_t kKeyLen = sizeof kKey - 1;
  for (std::size_t line = 0; line < len;) {
    std::size_t end = line;
    while (end < len && text[end] != '\n' && text[end] != '\0') ++end;
    bool match = end - line >= kKeyLen;
    for (std::size_t k = 0; match && k < kKeyLen; ++k) match = text[line + k] == kKey[k];
    if (match) {
      NsPids pids;
      std::size_t p = line + kKeyLen;
      bool any = false;
      while (p < end) {
        while (p < end && (text[p] == ' ' || text[p] == '\t')) ++p;
        if (p == end) break;
        std::uint64_t v = 0;
        if (!number(text, end, &p, &v) || v == 0 || v > 0xffffffffull) return false;
        if (!any) pids.outermost = static_cast<std::uint32_t>(v);
        pids.innermost = static_cast<std::uint32_t>(v);
        any = true;
      }
      if (!any) return false;
      *out = pids;
      return true;
    }
    if (end < len && text[end] == '\0') break;
    line = end + 1;
  }
  return false;
}

int read_nspid(std::uint32_t pid, NsPids* out) noexcept {
  char file[64];
  path(file, sizeof file, pid, "status");
  // status is ~1.5 KiB; NSpid comes in its first half (after Name, Umask,
  // State, Tgid, Ngid, Pid, PPid, TracerPid, Uid, Gid, FDSize, Groups, NStgid).
  // Groups can be long: 4 KiB.
  char buf[4096];
  const long len = read_file(file, buf, sizeof buf);
  if (len < 0) return static_cast<int>(-len);
  return parse_nspid(buf, static_cast<std::size_t>(len), out) ? 0 : EINVAL;
}

}  // namespace gpuslice::platform::procfs
