#include "scan.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstring>

#include "log.h"
#include "mounts.h"
#include "region_io.h"
#include "shm/region_file.h"

using namespace std::string_literals;

namespace gpuslice::agent {
namespace {

constexpr unsigned kRenameNoReplace = 1;  // RENAME_NOREPLACE
constexpr double kSkipLogBurst = 32;
constexpr std::uint64_t kSkipLogRefillNs = 2'000'000'000;  // 30 lines a minute after the burst
constexpr std::uint64_t kSkipLogSummaryNs = 60'000'000'000;

int rename_noreplace(int dirfd, const char* from, const char* to) {
  return static_cast<int>(syscall(SYS_renameat2, dirfd, from, dirfd, to, kRenameNoReplace));
}

bool ends_with(const std::string& s, const char* suffix) {
  const std::size_t n = std::strlen(suffix);
  return s.size() >= n && s.compare(s.size() - n, n, suffix) == 0;
}

std::string join(const std::string& sub, const std::string& name) { return sub.empty() ? name : sub + "/" + name; }

std::int64_t mtime_ns(const struct stat& st) {
  return static_cast<std::int64_t>(st.st_mtim.tv_sec) * 1'000'000'000 + st.st_mtim.tv_nsec;
}

// Visits the entries of an open directory (takes ownership of fd); at most
// `limit` entries, so a directory stuffed with millions of files cannot stall
// a cycle. Read with getdents64 into a buffer on the stack: opendir's DIR
// costs an fstat, an fcntl and a 32 KiB allocation per directory, and a
// re-read opens one directory per region.
struct Entry {
  const char* d_name;
  unsigned char d_type;
};

template <class F>
bool for_each_entry(int fd, std::size_t limit, F&& visit) {  // false: stopped at the limit or an error
  alignas(8) char buf[8192];
  std::size_t n = 0;
  for (;;) {
    const ssize_t got = getdents64(fd, buf, sizeof buf);
    if (got < 0) {
      close(fd);
      return false;
    }
    if (got == 0) break;
    for (ssize_t off = 0; off < got;) {
      const auto* d = reinterpret_cast<const dirent64*>(buf + off);
      off += d->d_reclen;
      if (std::strcmp(d->d_name, ".") == 0 || std::strcmp(d->d_name, "..") == 0) continue;
      if (++n > limit) {
        log_once(LogLevel::warn, "too-many-entries",
                 "a directory below the region directory holds more than %zu entries; "
                 "the rest are ignored",
                 limit);
        close(fd);
        return false;
      }
      const Entry e{d->d_name, d->d_type};
      visit(fd, &e);
    }
  }
  close(fd);
  return true;
}

constexpr std::int64_t kDirSettleNs = 3'000'000'000;  // above any file system's timestamp granularity (FAT: 2 s)

std::int64_t realtime_ns() {
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<std::int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

std::int64_t ctime_ns(const struct stat& st) {
  return static_cast<std::int64_t>(st.st_ctim.tv_sec) * 1'000'000'000 + st.st_ctim.tv_nsec;
}

// Whether an open directory holds nothing (takes ownership of fd).
bool empty_dir(int fd) {
  alignas(8) char buf[1024];
  bool empty = true;
  ssize_t got = 0;
  while (empty && (got = getdents64(fd, buf, sizeof buf)) > 0) {
    for (ssize_t off = 0; off < got && empty;) {
      const auto* d = reinterpret_cast<const dirent64*>(buf + off);
      off += d->d_reclen;
      empty = std::strcmp(d->d_name, ".") == 0 || std::strcmp(d->d_name, "..") == 0;
    }
  }
  close(fd);
  return empty && got == 0;  // an error reading it: not known to be empty
}

}  // namespace

RegionSet::RegionSet(std::string dir, std::size_t max_regions)
    : RegionSet(std::vector<RegionRoot>{RegionRoot{std::move(dir), Layout::gpuslice}}, max_regions) {}

RegionSet::RegionSet(std::vector<RegionRoot> roots, std::size_t max_regions)
    : roots_(std::move(roots)), max_regions_(max_regions), dir_error_logged_(roots_.size(), 0) {}

RegionSet::~RegionSet() = default;

std::string RegionSet::key(std::size_t root, const std::string& sub, const std::string& name) const {
  return roots_[root].dir + "/" + join(sub, name);
}

int RegionSet::open_sub(std::size_t root, const std::string& sub) const {
  const int rootfd = open(roots_[root].dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (rootfd < 0 || sub.empty()) return rootfd;
  const int fd = openat(rootfd, sub.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
  close(rootfd);
  return fd;
}

bool RegionSet::rescan() {
  std::unordered_map<std::string, bool> seen;
  bool all = true;
  std::vector<char> unreadable(roots_.size(), 0);
  unwatched_counting_ = 0;
  for (auto& [k, m] : dir_memo_) m.visited = false;
  for (std::size_t r = 0; r < roots_.size(); ++r) {
    if (!scan_root(r, seen)) {
      all = false;
      unreadable[r] = 1;
    }
  }
  for (auto it = dir_memo_.begin(); it != dir_memo_.end();)
    it = it->second.visited ? std::next(it) : dir_memo_.erase(it);
  for (auto& t : regions_) {
    // An unreadable root keeps its regions mapped (as documented in rescan()).
    if (!t->dropped && !unreadable[t->root] && seen.count(key(t->root, t->sub, t->current)) == 0) {
      if (!log_once(LogLevel::info, "gone:"s + t->rel, "region %s is gone", t->rel.c_str())) {
        log(LogLevel::debug, "region %s is gone", t->rel.c_str());
      }
      t->dropped = true;
    }
  }
  auto below_unreadable = [&](const std::string& path) {
    for (std::size_t r = 0; r < roots_.size(); ++r) {
      if (unreadable[r] && path.compare(0, roots_[r].dir.size() + 1, roots_[r].dir + "/") == 0) return true;
    }
    return false;
  };
  for (auto it = bad_.begin(); it != bad_.end();) {
    if (seen.count(it->first) == 0 && !below_unreadable(it->first)) {
      forget_once("skip:"s + it->first);
      it = bad_.erase(it);
    } else {
      ++it;
    }
  }
  sweep();
  if (unwatched_counting_ == 0 && unwatched_ != 0) {
    log(LogLevel::info, "every region file is watched again (--max-regions %zu)", max_regions_);
    forget_once("max-regions");
  }
  unwatched_ = unwatched_counting_;
  return all;
}

void RegionSet::skip_warning(const std::string& key, const char* format, ...) {
  const std::uint64_t now = monotonic_ns();
  if (log_tokens_ < 0) {
    log_tokens_ = kSkipLogBurst;
    log_refill_ns_ = now;
  }
  if (now - log_refill_ns_ >= kSkipLogRefillNs) {
    const std::uint64_t add = (now - log_refill_ns_) / kSkipLogRefillNs;
    log_tokens_ = std::min(kSkipLogBurst, log_tokens_ + static_cast<double>(add));
    log_refill_ns_ += add * kSkipLogRefillNs;
  }
  char line[768];
  va_list args;
  va_start(args, format);
  std::vsnprintf(line, sizeof line, format, args);
  va_end(args);
  if (log_tokens_ >= 1) {
    if (log_once(LogLevel::warn, key, "%s", line)) log_tokens_ -= 1;
  } else {
    ++log_suppressed_;
  }
  if (log_suppressed_ != log_suppressed_reported_ &&
      (log_summary_ns_ == 0 || now - log_summary_ns_ >= kSkipLogSummaryNs)) {
    log(LogLevel::warn,
        "%llu more warning(s) about invalid files were not logged (at most %d, then one every %llu s; "
        "gpuslice_agent_log_suppressed_total counts them)",
        static_cast<unsigned long long>(log_suppressed_ - log_suppressed_reported_), static_cast<int>(kSkipLogBurst),
        static_cast<unsigned long long>(kSkipLogRefillNs / 1'000'000'000));
    log_suppressed_reported_ = log_suppressed_;
    log_summary_ns_ = now;
  }
}

bool RegionSet::scan_root(std::size_t r, std::unordered_map<std::string, bool>& seen) {
  const std::string& dir = roots_[r].dir;
  const int root = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (root < 0) {
    if (!dir_error_logged_[r]) {
      // HAMi's directories appear with the first HAMi container or claim.
      log(roots_[r].layout == Layout::gpuslice ? LogLevel::warn : LogLevel::info,
          "cannot read the region directory %s (%s layout): %s; waiting for it", dir.c_str(),
          layout_name(roots_[r].layout), std::strerror(errno));
      dir_error_logged_[r] = 1;
    }
    return false;
  }
  if (dir_error_logged_[r]) log(LogLevel::info, "region directory %s is readable again", dir.c_str());
  dir_error_logged_[r] = 0;
  const std::size_t limit = 4 * max_regions_ + 64;
  for_each_entry(root, limit, [&](int rootfd, const Entry* e) {
    if (e->d_type == DT_DIR || e->d_type == DT_UNKNOWN) {
      // The file system's d_type is the file's type (a link says DT_LNK):
      // only DT_UNKNOWN needs an fstatat to tell.
      struct stat st {};
      if (e->d_type == DT_UNKNOWN && fstatat(rootfd, e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0) return;
      if (e->d_type == DT_DIR || S_ISDIR(st.st_mode)) {
        if (e->d_name[0] == '.') return;
        scan_sub(r, rootfd, e->d_name, limit, seen);
        return;
      }
    }
    consider(r, rootfd, "", e->d_name, seen);
  });
  return true;
}

void RegionSet::scan_sub(std::size_t r, int rootfd, const char* name, std::size_t limit,
                         std::unordered_map<std::string, bool>& seen) {
  const std::string subname = name;
  const std::string memo_key = roots_[r].dir + "/" + subname;
  struct stat ds {};
  const bool stat_ok = fstatat(rootfd, name, &ds, AT_SYMLINK_NOFOLLOW) == 0 && S_ISDIR(ds.st_mode);
  if (stat_ok) {
    if (auto it = dir_memo_.find(memo_key); it != dir_memo_.end()) {
      DirMemo& m = it->second;
      bool same = m.dev == ds.st_dev && m.ino == ds.st_ino && m.mtime_ns == mtime_ns(ds) && m.ctime_ns == ctime_ns(ds);
      for (std::size_t i = 0; same && i < m.keys.size(); ++i) {
        const auto t = by_rel_.find(m.keys[i]);
        same = t != by_rel_.end() && !t->second->dropped && !t->second->removing &&
               key(t->second->root, t->second->sub, t->second->current) == m.keys[i];
      }
      if (same) {
        for (const std::string& k : m.keys) seen[k] = true;
        m.visited = true;
        ++dirs_unchanged_;
        return;
      }
      dir_memo_.erase(it);
    }
  }
  const std::int64_t listed_ns = realtime_ns();  // before the listing: a change during it moves the mtime past this
  const int sub = openat(rootfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
  if (sub < 0) return;
  ++dirs_listed_;
  bool settled = stat_ok && mtime_ns(ds) + kDirSettleNs < listed_ns;
  std::vector<std::string> keys;
  const bool complete = for_each_entry(sub, limit, [&](int subfd, const Entry* f) {
    if (consider(r, subfd, subname, f->d_name, seen)) {
      if (settled) keys.push_back(key(r, subname, f->d_name));
    } else {
      settled = false;
    }
  });
  if (settled && complete)
    dir_memo_[memo_key] = {ds.st_dev, ds.st_ino, mtime_ns(ds), ctime_ns(ds), std::move(keys), true};
}

bool RegionSet::consider(std::size_t r, int dirfd, const std::string& sub, const char* name,
                         std::unordered_map<std::string, bool>& seen) {
  std::string file = name;
  const bool hidden = file[0] == '.';
  if (hidden && !ends_with(file, kRemovingSuffix)) return false;  // temporary files of region creation, editors, ...
  // In HAMi's directories only the shared-cache files can be regions: the
  // container runtime also leaves there the empty mount point of
  // /usr/local/vgpu/libvgpu.so (HAMi mounts the library inside that directory).
  if (roots_[r].layout != Layout::gpuslice && !ends_with(file, ".cache") &&
      !(hidden && ends_with(file, (std::string(".cache") + kRemovingSuffix).c_str()))) {
    return false;
  }
  const std::string rel = key(r, sub, file);  // the full path
  struct stat st {};
  if (fstatat(dirfd, name, &st, AT_SYMLINK_NOFOLLOW) != 0) return false;
  seen[rel] = true;
  if (!S_ISREG(st.st_mode)) {
    if (!S_ISDIR(st.st_mode)) {
      skip_warning("skip:"s + rel, "skipping %s: %s, expected a regular region file", rel.c_str(),
                   S_ISLNK(st.st_mode) ? "a symbolic link (never followed)" : "not a regular file");
    }
    return false;
  }
  // A second name (hard link) of a file already watched is the same region:
  // watched once, and never counted against --max-regions again.
  if (st.st_nlink > 1) {
    auto same = by_inode_.find(FileId{st.st_dev, st.st_ino});
    if (same != by_inode_.end() && !same->second->dropped &&
        key(same->second->root, same->second->sub, same->second->current) != rel) {
      log_once(LogLevel::info, "links:"s + same->second->rel,
               "region %s has other names (hard links, e.g. %s): it is watched once, under its first name",
               same->second->rel.c_str(), rel.c_str());
      return false;
    }
  }
  if (auto it = by_rel_.find(rel); it != by_rel_.end()) {
    TrackedRegion& t = *it->second;
    if (t.map.device() == st.st_dev && t.map.inode() == st.st_ino && !t.map.unlinked()) return true;
    drop(t, "replaced by another file");
    sweep();
  }
  if (auto it = bad_.find(rel); it != bad_.end()) {
    const BadFile& b = it->second;
    if (b.dev == st.st_dev && b.ino == st.st_ino && b.size == st.st_size && b.mtime_ns == mtime_ns(st)) return false;
  }
  if (regions_.size() >= max_regions_) {
    ++unwatched_counting_;
    log_once(LogLevel::warn, "max-regions",
             "more than %zu region files below %s: the rest are not watched, reaped or removed (--max-regions; "
             "gpuslice_agent_regions_unwatched counts them)",
             max_regions_, roots_[r].dir.c_str());
    return false;
  }
  MappedRegion map;
  std::string why;
  if (!open_region(dirfd, name, true, false, &map, &why)) {
    bad_[rel] = {st.st_dev, st.st_ino, st.st_size, mtime_ns(st)};
    skip_warning("skip:"s + rel, "skipping %s: %s", rel.c_str(), why.c_str());
    return false;
  }
  bad_.erase(rel);
  forget_once("skip:"s + rel);
  auto t = std::make_unique<TrackedRegion>();
  t->root = r;
  t->owner = owner_labels(roots_[r].layout, sub);
  t->sub = sub;
  t->current = file;
  t->name = file;
  if (hidden) {
    // Left by an agent that died between renaming and unlinking it.
    t->name = file.substr(1, file.size() - 1 - (sizeof kRemovingSuffix - 1));
    t->removing = true;
  }
  // gpuslice's layout shows paths below --region-dir, as before; other roots
  // show the full path, which cannot be mistaken for one of ours.
  t->rel = roots_[r].layout == Layout::gpuslice && r == 0 ? join(sub, t->name) : key(r, sub, t->name);
  t->map = std::move(map);
  char container[sizeof(RegionHeader::container_name)] = {};
  guarded([&] { std::memcpy(container, t->map.get()->header.container_name, sizeof container); });
  container[sizeof container - 1] = '\0';
  // Info the first time a path is watched; a container that keeps replacing
  // its file only shows up at debug level.
  const std::string name_text = printable(container, sizeof container);
  if (!log_once(LogLevel::info, "watch:"s + t->rel, "watching region %s (container \"%s\")", t->rel.c_str(),
                name_text.c_str())) {
    log(LogLevel::debug, "watching region %s (container \"%s\")", t->rel.c_str(), name_text.c_str());
  }
  by_rel_[rel] = t.get();
  by_inode_[FileId{t->map.device(), t->map.inode()}] = t.get();
  regions_.push_back(std::move(t));
  return true;
}

void RegionSet::drop(TrackedRegion& t, const std::string& why) {
  if (t.dropped) return;
  t.dropped = true;
  if (!log_once(LogLevel::info, "drop:"s + t.rel, "no longer watching region %s: %s", t.rel.c_str(), why.c_str())) {
    log(LogLevel::debug, "no longer watching region %s: %s", t.rel.c_str(), why.c_str());
  }
}

void RegionSet::sweep() {
  for (auto it = regions_.begin(); it != regions_.end();) {
    if ((*it)->dropped) {
      auto found = by_rel_.find(key((*it)->root, (*it)->sub, (*it)->current));
      if (found != by_rel_.end() && found->second == it->get()) by_rel_.erase(found);
      auto inode = by_inode_.find(FileId{(*it)->map.device(), (*it)->map.inode()});
      if (inode != by_inode_.end() && inode->second == it->get()) by_inode_.erase(inode);
      it = regions_.erase(it);
    } else {
      ++it;
    }
  }
}

namespace {

// A slot claimed or live: read from the mapping (a file truncated under us
// counts as in use: never removed on a guess).
bool slots_in_use(const Region* r) {
  bool used = false;
  const bool read = guarded([&] {
    for (const Slot& s : r->slots) {
      const std::uint32_t state = s.state.load(std::memory_order_acquire);
      if (state == kSlotLive || state == kSlotClaiming) {
        used = true;
        return;
      }
    }
  });
  return used || !read;
}

}  // namespace

void RegionSet::lifecycle(TrackedRegion& t, bool empty, std::uint64_t now_ns, std::uint64_t grace_ns) {
  if (t.dropped) return;
  if (!empty) {
    t.empty_since_ns = 0;
    if (t.removing) {
      const int dirfd = open_sub(t.root, t.sub);
      if (dirfd >= 0) {
        restore(t, dirfd);
        close(dirfd);
      }
    }
    return;
  }
  if (t.empty_since_ns == 0) t.empty_since_ns = now_ns;
  if (grace_ns == 0) return;  // never remove
  if (!t.removing && now_ns - t.empty_since_ns < grace_ns) return;
  const int dirfd = open_sub(t.root, t.sub);
  if (dirfd < 0) return;
  struct stat st {};
  if (fstatat(dirfd, t.current.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0 || st.st_dev != t.map.device() ||
      st.st_ino != t.map.inode()) {
    close(dirfd);
    drop(t, "replaced while empty");
    return;
  }
  // Under the joining lock no process is between its attach and its claim,
  // and none starts one; a claim since the slots were read keeps the region.
  if (!shm::lock_for_removal(t.map.fd())) {
    close(dirfd);  // a process is joining it: its slot comes
    return;
  }
  if (slots_in_use(t.map.get())) {
    shm::unlock_for_removal(t.map.fd());
    t.empty_since_ns = 0;
    if (t.removing) restore(t, dirfd);
    close(dirfd);
    return;
  }
  if (t.removing) {
    // Renamed at least one cycle ago and still unused: nobody can reach it by
    // name any more, and whoever opened it before joins it no more
    // (shm::attach checks the name under the joining lock).
    remove_now(t, dirfd);
  } else if (t.current != t.name) {
    t.removing = true;  // already under a hidden name (its name was taken by a new region)
  } else {
    const std::string hidden = "."s + t.name + kRemovingSuffix;
    if (rename_noreplace(dirfd, t.current.c_str(), hidden.c_str()) == 0) {
      by_rel_.erase(key(t.root, t.sub, t.current));
      t.current = hidden;
      t.removing = true;
      by_rel_[key(t.root, t.sub, t.current)] = &t;
    } else {
      log_once(LogLevel::warn, "rename:"s + t.rel, "cannot remove unused region %s: rename: %s", t.rel.c_str(),
               std::strerror(errno));
    }
  }
  shm::unlock_for_removal(t.map.fd());
  close(dirfd);
}

void RegionSet::remove_now(TrackedRegion& t, int dirfd) {
  if (unlinkat(dirfd, t.current.c_str(), 0) != 0) {
    log_once(LogLevel::warn, "unlink:"s + t.rel, "cannot remove unused region %s: %s", t.rel.c_str(),
             std::strerror(errno));
    return;
  }
  ++removed_total_;
  log(LogLevel::info, "removed region %s: no process used it for the grace period", t.rel.c_str());
  by_rel_.erase(key(t.root, t.sub, t.current));
  t.dropped = true;
  if (!t.sub.empty() && removes_empty_subdirs(roots_[t.root].layout)) {
    // The pod's directory too, once nothing uses it (release_dirs). HAMi's
    // directories are HAMi's.
    pending_dirs_.insert_or_assign(roots_[t.root].dir + "/" + t.sub, PendingDir{t.root, t.sub, 0});
  }
}

void RegionSet::release_dirs(std::uint64_t now_ns, std::uint64_t recheck_ns) {
  std::vector<std::string> check;  // empty directories due, by key
  for (auto it = pending_dirs_.begin(); it != pending_dirs_.end();) {
    PendingDir& p = it->second;
    if (p.due_ns > now_ns) {
      ++it;
      continue;
    }
    const int root = open(roots_[p.root].dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (root < 0) {
      ++it;
      continue;
    }
    struct stat st {};
    const bool cdi = fstatat(root, ("."s + p.sub + ".conf").c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0;
    bool empty = false;
    const int fd = openat(root, p.sub.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
    close(root);
    if (fd >= 0) empty = empty_dir(fd);
    // Gone, not empty (a new region: its removal brings the directory back
    // here) or a DRA driver's: not ours to remove.
    if (!empty || cdi) {
      it = pending_dirs_.erase(it);
      continue;
    }
    check.push_back(it->first);
    ++it;
  }
  if (check.empty()) return;
  const std::vector<bool> mounted = mounted_somewhere(check);
  for (std::size_t i = 0; i < check.size(); ++i) {
    auto it = pending_dirs_.find(check[i]);
    if (mounted[i]) {
      it->second.due_ns = now_ns + recheck_ns;
      continue;
    }
    const int root = open(roots_[it->second.root].dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (root >= 0) {
      if (unlinkat(root, it->second.sub.c_str(), AT_REMOVEDIR) == 0) {
        log(LogLevel::info, "removed the directory %s: empty, and no container has it mounted", check[i].c_str());
      }
      close(root);
    }
    pending_dirs_.erase(it);
  }
}

void RegionSet::restore(TrackedRegion& t, int dirfd) {
  t.removing = false;
  if (t.current == t.name) return;
  if (rename_noreplace(dirfd, t.current.c_str(), t.name.c_str()) == 0) {
    by_rel_.erase(key(t.root, t.sub, t.current));
    t.current = t.name;
    by_rel_[key(t.root, t.sub, t.current)] = &t;
    log(LogLevel::info, "region %s is in use again; kept", t.rel.c_str());
    return;
  }
  // A new process created a fresh region under the name meanwhile: both are
  // real now. The old one is watched (and removed once unused) as it is.
  log(LogLevel::warn,
      "region %s was re-created while its unused predecessor was being removed, and a process "
      "attached to the old one; it keeps the old file's quota until it exits",
      t.rel.c_str());
}

}  // namespace gpuslice::agent
