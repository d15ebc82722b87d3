// Removal of stale priority-board files. See board_cleanup.h.
#include "board_cleanup.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>

#include "shm/priority_board.h"

namespace gpuslice::agent {
namespace {

bool ends_with_act(const char* name) {
  const std::size_t n = std::strlen(name);
  return n > 4 && std::strcmp(name + n - 4, ".act") == 0;
}

std::uint64_t mtime_ns(const struct stat& st) {
  return static_cast<std::uint64_t>(st.st_mtim.tv_sec) * 1'000'000'000ull +
         static_cast<std::uint64_t>(st.st_mtim.tv_nsec);
}

void clean_level(const std::string& board, const char* level, std::uint64_t now, std::uint64_t grace,
                 BoardCleanup* out) {
  const std::string path = board + "/" + level;
  const int dfd = open(path.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (dfd < 0) return;
  DIR* dir = fdopendir(dfd);
  if (dir == nullptr) {
    close(dfd);
    return;
  }
  while (const dirent* e = readdir(dir)) {
    if (!ends_with_act(e->d_name)) continue;
    const int fd = openat(dfd, e->d_name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) continue;
    struct stat st;
    const bool regular = fstat(fd, &st) == 0 && S_ISREG(st.st_mode);
    if (regular) ++out->examined;
    const bool stale = regular && mtime_ns(st) + grace < now && !shm::any_writer_alive(fd);
    // Unlink only the file we judged: it may have been replaced meanwhile.
    struct stat now_st;
    if (stale && fstatat(dfd, e->d_name, &now_st, AT_SYMLINK_NOFOLLOW) == 0 && now_st.st_dev == st.st_dev &&
        now_st.st_ino == st.st_ino && unlinkat(dfd, e->d_name, 0) == 0)
      ++out->removed;
    close(fd);
  }
  closedir(dir);
}

}  // namespace

BoardCleanup clean_priority_board(const std::string& board, std::uint64_t now_realtime_ns, std::uint64_t grace_ns) {
  BoardCleanup out;
  if (board.empty()) return out;
  for (const char* level : {"high", "normal", "low"}) clean_level(board, level, now_realtime_ns, grace_ns, &out);
  return out;
}

}  // namespace gpuslice::agent
