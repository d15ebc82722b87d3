#include "grant.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <sstream>

#include "region_io.h"

namespace gpuslice::agent {
namespace {

const char* field_name(GrantLine::Field f) {
  switch (f) {
    case GrantLine::quota: return "quota";
    case GrantLine::sm: return "sm";
    case GrantLine::policy: return "policy";
    case GrantLine::priority: return "priority";
  }
  return "?";
}

bool parse_u64(const std::string& s, std::uint64_t* out) {
  if (s.empty() || s.size() > 20 || s.find_first_not_of("0123456789") != std::string::npos) return false;
  errno = 0;
  char* end = nullptr;
  const unsigned long long v = std::strtoull(s.c_str(), &end, 10);
  if (errno != 0 || *end != '\0') return false;
  *out = v;
  return true;
}

}  // namespace

std::string grant_text(const Grant& g) {
  std::string out = "gpuslice-grant 1\n";
  for (const GrantLine& l : g.lines) {
    out += field_name(l.field);
    if (l.field != GrantLine::priority) {
      out += ' ';
      out += format_uuid(l.uuid);
    }
    out += ' ';
    out += std::to_string(l.value);
    out += '\n';
  }
  return out;
}

bool parse_grant(const std::string& text, Grant* out) {
  std::istringstream in(text);
  std::string line;
  if (!std::getline(in, line) || line != "gpuslice-grant 1") return false;
  Grant g;
  while (std::getline(in, line)) {
    std::istringstream words(line);
    std::string key, a, b, extra;
    words >> key >> a >> b >> extra;
    if (!extra.empty()) return false;
    GrantLine l{};
    if (key == "priority" && b.empty()) {
      l.field = GrantLine::priority;
      if (!parse_u64(a, &l.value) || l.value < 1 || l.value > 3) return false;
    } else if (key == "quota" || key == "sm" || key == "policy") {
      l.field = key == "quota" ? GrantLine::quota : key == "sm" ? GrantLine::sm : GrantLine::policy;
      if (!parse_uuid(a.c_str(), l.uuid) || !parse_u64(b, &l.value)) return false;
      if (l.field != GrantLine::quota && l.value > 0xffffffffu) return false;
    } else {
      return false;
    }
    if (l.field == GrantLine::quota && l.value == 0) return false;                 // smi refuses --memory 0
    if (l.field == GrantLine::sm && (l.value < 1 || l.value > 100)) return false;  // a percentage
    if (l.field == GrantLine::policy && l.value > 1) return false;                 // hard or elastic
    g.lines.push_back(l);
  }
  // The agent acts as root on what it takes: exactly the text smi writes
  // (not another blank, spelling of a UUID or number, or a line cut short).
  if (grant_text(g) != text) return false;
  *out = std::move(g);
  return true;
}

std::string grant_name(dev_t dev, ino_t ino, std::uint64_t realtime_ns, std::uint32_t pid) {
  char buf[96];
  std::snprintf(buf, sizeof buf, "%" PRIu64 "-%" PRIu64 "-%020" PRIu64 "-%" PRIu32, static_cast<std::uint64_t>(dev),
                static_cast<std::uint64_t>(ino), realtime_ns, pid);
  return buf;
}

bool parse_grant_name(const char* name, dev_t* dev, ino_t* ino, std::uint64_t* realtime_ns) {
  // Four runs of digits joined by '-' and nothing else (a conversion such as
  // sscanf's would take a sign or a blank before a number).
  std::uint64_t field[4] = {};
  const char* p = name;
  for (int i = 0; i < 4; ++i) {
    if (i > 0 && *p++ != '-') return false;
    const char* start = p;
    while (*p >= '0' && *p <= '9') ++p;
    if (!parse_u64(std::string(start, p), &field[i])) return false;
  }
  if (*p != '\0' || field[3] > 0xffffffffu) return false;  // the pid
  *dev = static_cast<dev_t>(field[0]);
  *ino = static_cast<ino_t>(field[1]);
  *realtime_ns = field[2];
  return true;
}

int open_grant_dir(int at, const char* path, std::string* why) {
  const int fd = openat(at, path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) {
    const int e = errno;
    *why = std::string("cannot open it: ") + std::strerror(e);
    errno = e;
    return -1;
  }
  struct stat st {};
  if (fstat(fd, &st) != 0 || st.st_uid != geteuid() || (st.st_mode & 022) != 0) {
    close(fd);
    *why = "it is not owned by uid " + std::to_string(geteuid()) + " and writable by its owner only";
    errno = EPERM;
    return -1;
  }
  return fd;
}

bool grant_dir_still_fit(int fd, const char* path, std::string* why) {
  struct stat held {
  }, named{};
  if (fstat(fd, &held) != 0 || held.st_uid != geteuid() || (held.st_mode & 022) != 0 || held.st_nlink == 0) {
    *why = "it is no longer owned by uid " + std::to_string(geteuid()) + " and writable by its owner only";
    return false;
  }
  if (fstatat(AT_FDCWD, path, &named, AT_SYMLINK_NOFOLLOW) != 0 || named.st_dev != held.st_dev ||
      named.st_ino != held.st_ino) {
    *why = "it was removed, renamed or replaced";
    return false;
  }
  return true;
}

std::string find_grant_dir(const std::string& region_path, std::string* refused) {
  std::string dir = region_path.substr(0, region_path.find_last_of('/') + 1);
  if (dir.empty()) dir = "./";
  std::string parent = dir.size() > 1 ? dir.substr(0, dir.find_last_of('/', dir.size() - 2) + 1) : "";
  std::string unfit;
  for (const std::string& d : {parent, dir}) {
    if (d.empty()) continue;
    std::string why;
    std::string path = d;
    path += kGrantDirName;
    const int fd = open_grant_dir(AT_FDCWD, path.c_str(), &why);
    if (fd >= 0) {
      close(fd);
      return path;
    }
    if (errno != ENOENT && unfit.empty()) unfit = path + ": " + why;
  }
  if (refused != nullptr) *refused = unfit;
  return "";
}

bool write_grant(const std::string& dir, dev_t dev, ino_t ino, const Grant& g, std::string* why) {
  const int dfd = open_grant_dir(AT_FDCWD, dir.c_str(), why);
  if (dfd < 0) return false;
  timespec now{};
  clock_gettime(CLOCK_REALTIME, &now);
  const std::uint64_t ns =
      static_cast<std::uint64_t>(now.tv_sec) * 1'000'000'000u + static_cast<std::uint64_t>(now.tv_nsec);
  const std::string name = grant_name(dev, ino, ns, static_cast<std::uint32_t>(getpid()));
  std::string tmp = ".";
  tmp += name;
  tmp += ".tmp";
  const std::string text = grant_text(g);
  bool ok = false;
  const int fd = openat(dfd, tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd >= 0) {
    ok = write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
    ok = close(fd) == 0 && ok;
    ok = ok && renameat(dfd, tmp.c_str(), dfd, name.c_str()) == 0;
    if (!ok) unlinkat(dfd, tmp.c_str(), 0);
  }
  if (!ok) {
    *why = dir;
    *why += '/';
    *why += name;
    *why += ": ";
    *why += std::strerror(errno);
  }
  close(dfd);
  return ok;
}

}  // namespace gpuslice::agent
