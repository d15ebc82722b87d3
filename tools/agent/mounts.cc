#include "mounts.h"

#include <dirent.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <unordered_set>

namespace gpuslice::agent {
namespace {

struct Mount {
  dev_t dev = 0;
  std::string root;   // path inside its file system
  std::string point;  // where it is mounted
};

// Parses the fields we need of one mountinfo line:
// "<id> <parent> <major>:<minor> <root> <mount point> <options> ...".
bool parse_line(const char* line, Mount* out) {
  char root[PATH_MAX * 4 + 1], point[PATH_MAX * 4 + 1];
  unsigned major = 0, minor = 0;
  static_assert(PATH_MAX * 4 == 16384);
  if (std::sscanf(line, "%*u %*u %u:%u %16384s %16384s", &major, &minor, root, point) != 4) return false;
  out->dev = makedev(major, minor);
  out->root = mountinfo_unescape(root);
  out->point = mountinfo_unescape(point);
  return true;
}

// Every mount of a mountinfo file; false (errno set) if it cannot be read.
bool read_mounts(const std::string& path, std::vector<Mount>* out) {
  out->clear();
  FILE* f = std::fopen(path.c_str(), "re");
  if (f == nullptr) return false;
  char* line = nullptr;
  std::size_t cap = 0;
  while (getline(&line, &cap, f) > 0) {
    Mount m;
    if (parse_line(line, &m)) out->push_back(std::move(m));
  }
  std::free(line);
  std::fclose(f);
  return true;
}

bool below_or_at(const std::string& path, const std::string& top) {
  if (top == "/") return true;
  return path.compare(0, top.size(), top) == 0 && (path.size() == top.size() || path[top.size()] == '/');
}

struct Target {
  bool known = false;  // found in our own mount table
  dev_t dev = 0;
  std::string fs_path;  // the directory's path inside its file system
};

// The directory's file system and path inside it, from our own mount table:
// the last (topmost) of the mounts at the longest mount point above it.
Target locate(const std::string& dir, const std::vector<Mount>& own) {
  Target t;
  char real[PATH_MAX];
  struct stat st {};
  if (realpath(dir.c_str(), real) == nullptr || stat(real, &st) != 0) return t;
  const std::string path = real;
  const Mount* best = nullptr;
  for (const Mount& m : own) {
    if (below_or_at(path, m.point) && (best == nullptr || m.point.size() >= best->point.size())) best = &m;
  }
  if (best == nullptr || best->dev != st.st_dev) return t;  // a file system we cannot name (btrfs subvolume ...)
  const std::string rel = best->point == "/" ? path : path.substr(best->point.size());
  t.fs_path = best->root == "/" ? (rel.empty() ? "/" : rel) : best->root + rel;
  t.dev = st.st_dev;
  t.known = true;
  return t;
}

// The process exited, or is exiting (a zombie has no mount namespace left:
// its mountinfo fails with EINVAL).
bool gone(int error) { return error == ENOENT || error == ESRCH || error == EINVAL; }

}  // namespace

std::string mountinfo_unescape(const std::string& field) {
  std::string out;
  out.reserve(field.size());
  for (std::size_t i = 0; i < field.size(); ++i) {
    if (field[i] == '\\' && i + 3 < field.size() && field[i + 1] >= '0' && field[i + 1] <= '3' && field[i + 2] >= '0' &&
        field[i + 2] <= '7' && field[i + 3] >= '0' && field[i + 3] <= '7') {
      out.push_back(static_cast<char>((field[i + 1] - '0') * 64 + (field[i + 2] - '0') * 8 + (field[i + 3] - '0')));
      i += 3;
    } else {
      out.push_back(field[i]);
    }
  }
  return out;
}

std::vector<bool> mounted_somewhere(const std::vector<std::string>& dirs, const std::string& proc) {
  std::vector<bool> used(dirs.size(), true);  // unknown = in use
  std::vector<Mount> mounts;
  if (dirs.empty() || !read_mounts(proc + "/self/mountinfo", &mounts)) return used;
  std::vector<Target> targets;
  bool any = false;
  for (std::size_t i = 0; i < dirs.size(); ++i) {
    targets.push_back(locate(dirs[i], mounts));
    if (targets.back().known) used[i] = false, any = true;
  }
  if (!any) return used;
  DIR* d = opendir(proc.c_str());
  if (d == nullptr) return std::vector<bool>(dirs.size(), true);
  std::unordered_set<std::string> seen;  // mount namespaces read
  bool unknown = false;
  while (dirent* e = readdir(d)) {
    char* end = nullptr;
    const unsigned long pid = std::strtoul(e->d_name, &end, 10);
    if (pid == 0 || *end != '\0') continue;
    const std::string base = proc + "/" + e->d_name;
    // The namespace's name needs ptrace access to the process, its mount
    // table does not: a process whose namespace we may not name is read
    // anyway (once per such process instead of once per namespace).
    char ns[64];
    const ssize_t n = readlink((base + "/ns/mnt").c_str(), ns, sizeof ns - 1);
    if (n < 0 && gone(errno)) continue;
    const std::string name = n < 0 ? "" : std::string(ns, static_cast<std::size_t>(n));
    if (!name.empty() && seen.count(name) != 0) continue;
    if (!read_mounts(base + "/mountinfo", &mounts)) {
      if (!gone(errno)) unknown = true;
      continue;
    }
    if (!name.empty()) seen.insert(name);
    for (const Mount& m : mounts) {
      for (std::size_t i = 0; i < targets.size(); ++i) {
        if (!used[i] && m.dev == targets[i].dev && below_or_at(m.root, targets[i].fs_path)) used[i] = true;
      }
    }
  }
  closedir(d);
  if (unknown) return std::vector<bool>(dirs.size(), true);
  return used;
}

}  // namespace gpuslice::agent
