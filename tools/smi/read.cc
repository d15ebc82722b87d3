// Finding and reading regions for display: read-only, never blocking, never
// trusting the file (agent/region_io.h).
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "limiter/options/options.h"
#include "region_io.h"
#include "smi.h"
#include "text.h"

using namespace std::string_literals;

namespace gpuslice::smi {

std::string default_region_path() {
  const char* env = std::getenv("GPUSLICE_REGION");
  if (env != nullptr && *env != '\0') return env;
  static options::Options defaults;  // large: not on the stack
  options::default_options(&defaults);
  return defaults.region;
}

bool read_region(const std::string& path, Shown* out, std::string* error) {
  agent::MappedRegion map;
  std::string why;
  if (!agent::open_region(AT_FDCWD, path.c_str(), false, true, &map, &why)) {
    *error = "gpuslice-smi: "s + tools::escape_untrusted(path) + ": " + why;
    return false;
  }
  out->path = tools::escape_untrusted(path);
  if (!agent::take_view(map.get(), &out->view)) {
    *error = "gpuslice-smi: "s + out->path + ": the file shrank while being read, expected a region file of fixed size";
    return false;
  }
  return true;
}

namespace {

void consider(int dirfd, const std::string& dir, const std::string& rel, const char* name, std::vector<Shown>* out,
              std::vector<std::string>* skipped) {
  if (name[0] == '.') return;  // regions being created (or removed)
  struct stat st {};
  if (fstatat(dirfd, name, &st, AT_SYMLINK_NOFOLLOW) != 0 || S_ISDIR(st.st_mode)) return;
  agent::MappedRegion map;
  std::string why;
  if (!agent::open_region(dirfd, name, false, false, &map, &why)) {
    skipped->push_back("gpuslice-smi: "s + tools::escape_untrusted(dir + "/" + rel) + ": " + why + "; skipped");
    return;
  }
  Shown s;
  s.path = tools::escape_untrusted(rel);  // names from the directory: any bytes
  if (agent::take_view(map.get(), &s.view)) out->push_back(std::move(s));
}

template <class F>
void entries(int fd, F&& visit) {
  DIR* d = fdopendir(fd);
  if (d == nullptr) {
    close(fd);
    return;
  }
  std::vector<std::string> names;
  while (dirent* e = readdir(d)) {
    if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) names.push_back(e->d_name);
    if (names.size() > 65536) break;
  }
  std::sort(names.begin(), names.end());  // stable output
  for (const std::string& n : names) visit(dirfd(d), n);
  closedir(d);
}

}  // namespace

bool read_region_dir(const std::string& dir, std::vector<Shown>* out, std::vector<std::string>* skipped,
                     std::string* error) {
  const int root = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (root < 0) {
    *error = "gpuslice-smi: "s + tools::escape_untrusted(dir) + ": cannot open: " + std::strerror(errno) +
             ", expected a region directory";
    return false;
  }
  entries(root, [&](int rootfd, const std::string& name) {
    struct stat st {};
    if (fstatat(rootfd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) return;
    if (S_ISDIR(st.st_mode)) {
      if (name[0] == '.') return;
      const int sub = openat(rootfd, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
      if (sub < 0) return;
      entries(sub, [&](int subfd, const std::string& file) {
        consider(subfd, dir, name + "/" + file, file.c_str(), out, skipped);
      });
      return;
    }
    consider(rootfd, dir, name, name.c_str(), out, skipped);
  });
  return true;
}

}  // namespace gpuslice::smi
