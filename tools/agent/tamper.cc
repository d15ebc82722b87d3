#include "tamper.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "grant.h"
#include "limiter/memory_accounting.h"
#include "limiter/priority.h"
#include "log.h"
#include "region_io.h"
#include "text.h"
#include "view.h"

using namespace std::string_literals;

namespace gpuslice::agent {
namespace {

constexpr std::uint64_t kStaleGrantNs = 30'000'000'000;  // a record no watched region claims is dropped after this
constexpr std::uint64_t kDirRetryNs = 1'000'000'000;

std::uint64_t realtime_ns() {
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<std::uint64_t>(ts.tv_sec) * 1'000'000'000u + static_cast<std::uint64_t>(ts.tv_nsec);
}

std::string quota_text(std::uint64_t q) { return q == kUnlimited ? "unlimited" : format_bytes(q); }
std::string sm_text(std::uint32_t pct) { return sm_unlimited(pct) ? "unlimited" : std::to_string(pct) + "%"; }
std::string priority_text(std::uint32_t p) {
  return limiter::priority_name(limiter::priority_from_word(p, Priority::normal));
}

bool read_record(int dirfd, const char* name, std::string* text) {
  const int fd = openat(dirfd, name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return false;
  struct stat st {};
  bool ok = fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_uid == geteuid() &&
            static_cast<std::size_t>(st.st_size) <= kMaxGrantBytes;
  if (ok) {
    text->assign(kMaxGrantBytes, '\0');
    const ssize_t n = read(fd, text->data(), kMaxGrantBytes);
    ok = n >= 0;
    text->resize(ok ? static_cast<std::size_t>(n) : 0);
  }
  close(fd);
  return ok;
}

}  // namespace

TamperGuard::TamperGuard(const std::vector<std::string>& roots) {
  for (const std::string& r : roots) dirs_.push_back(r + "/" + kGrantDirName);
  fds_.assign(dirs_.size(), -1);
  warned_.assign(dirs_.size(), false);
}

TamperGuard::~TamperGuard() {
  for (int fd : fds_) {
    if (fd >= 0) close(fd);
  }
}

void TamperGuard::open_grant_dirs() {
  // What is held is checked every cycle: a directory made writable by others,
  // or no longer at its path, is given up (and looked for again below).
  for (std::size_t i = 0; i < dirs_.size(); ++i) {
    std::string why;
    if (fds_[i] < 0 || grant_dir_still_fit(fds_[i], dirs_[i].c_str(), &why)) continue;
    close(fds_[i]);
    fds_[i] = -1;
    warned_[i] = false;
    last_dir_try_ns_ = 0;
    log(LogLevel::error, "grant directory %s: %s: its records are no longer read", dirs_[i].c_str(), why.c_str());
  }
  if (last_dir_try_ns_ != 0 && now_ns_ - last_dir_try_ns_ < kDirRetryNs) return;
  last_dir_try_ns_ = now_ns_;
  for (std::size_t i = 0; i < dirs_.size(); ++i) {
    if (fds_[i] >= 0) continue;
    if (mkdir(dirs_[i].c_str(), 0700) != 0 && errno != EEXIST) continue;  // the region directory is not there yet
    std::string why;
    fds_[i] = open_grant_dir(AT_FDCWD, dirs_[i].c_str(), &why);
    if (fds_[i] < 0 && !warned_[i]) {
      warned_[i] = true;
      log(LogLevel::error,
          "grant directory %s: %s: gpuslice-smi set cannot record operator changes there, so the agent will put "
          "back any change of a region's limits (remove it; the agent makes it again)",
          dirs_[i].c_str(), why.c_str());
    }
    if (fds_[i] >= 0) log(LogLevel::info, "operator changes of limits are read from %s", dirs_[i].c_str());
  }
}

void TamperGuard::run(const std::vector<TrackedRegion*>& regions, std::uint64_t now_ns) {
  now_ns_ = now_ns;
  open_grant_dirs();
  // 1. The regions' values, read before the grant records: smi writes its
  // record before the region, so a change found here has its record below.
  // Only the entries of each region's sample are written and read (check()
  // looks at no other): not all 16 of every region, each cycle.
  std::vector<Found>& found = found_;
  if (found.size() < regions.size()) found.resize(regions.size());
  for (std::size_t i = 0; i < regions.size(); ++i) {
    TrackedRegion* t = regions[i];
    if (t->dropped) continue;
    const Region* r = t->map.get();
    Found& f = found[i];
    f.priority = 0;
    for (const DeviceSample& d : t->sample.devices) f.devices[d.index] = Limits{};
    const bool ok = guarded([&] {
      f.priority = r->header.priority.load(std::memory_order_relaxed);
      for (const DeviceSample& d : t->sample.devices) {
        const DeviceState& s = r->devices[d.index];
        Limits& l = f.devices[d.index];
        l.known = true;
        std::memcpy(l.uuid, d.uuid, sizeof l.uuid);
        l.quota = s.quota_bytes.load(std::memory_order_relaxed);
        l.sm = s.sm_limit_pct.load(std::memory_order_relaxed);
        l.policy = s.sm_policy.load(std::memory_order_relaxed);
      }
    });
    if (!ok) continue;
    Kept& k = kept_[t];
    if (k.seen_ns == 0 || k.dev != t->map.device() || k.ino != t->map.inode()) {
      k = Kept{};
      k.dev = t->map.device();
      k.ino = t->map.inode();
    }
    k.seen_ns = now_ns;
    // First sight of an entry (or of the priority): the limits it was given.
    // Kept by device: an entry published again for a UUID already kept (the
    // old one marked abandoned, or its UUID rewritten) keeps that UUID's limits.
    for (const DeviceSample& d : t->sample.devices) {
      Limits& kl = k.devices[d.index];
      if (kl.known && std::memcmp(kl.uuid, d.uuid, sizeof kl.uuid) == 0) continue;
      const Limits* given = k.given_for(d.uuid);
      kl = given != nullptr ? *given : f.devices[d.index];
      if (given == nullptr && k.given.size() < kMaxKeptDevices) k.given.push_back(kl);
    }
    if (k.priority == 0 && f.priority >= 1 && f.priority <= 3) k.priority = f.priority;
    for (const DeviceSample& d : t->sample.devices) k.before[d.index] = k.devices[d.index];
    k.priority_before = k.priority;
  }
  // 2. The operator's changes (a directory read per cycle; usually empty).
  if (list_records()) {
    std::map<std::pair<dev_t, ino_t>, std::pair<TrackedRegion*, Kept*>> by_file;
    for (TrackedRegion* t : regions) {
      auto it = kept_.find(t);
      if (!t->dropped && it != kept_.end() && it->second.seen_ns == now_ns) {
        by_file[{it->second.dev, it->second.ino}] = {t, &it->second};
      }
    }
    apply_grants(by_file);
  }
  // 3. Anything else is the container's: put back.
  for (std::size_t i = 0; i < regions.size(); ++i) {
    TrackedRegion* t = regions[i];
    auto it = kept_.find(t);
    if (t->dropped || it == kept_.end() || it->second.seen_ns != now_ns) continue;
    check(*t, it->second, found[i]);
  }
  for (auto it = kept_.begin(); it != kept_.end();) {
    it = it->second.seen_ns != now_ns ? kept_.erase(it) : std::next(it);
  }
}

bool TamperGuard::list_records() {
  bool any = false;
  records_.resize(fds_.size());
  for (std::size_t i = 0; i < fds_.size(); ++i) {
    records_[i].clear();
    if (fds_[i] < 0) continue;
    const int dup_fd = fcntl(fds_[i], F_DUPFD_CLOEXEC, 0);
    DIR* dir = dup_fd >= 0 ? fdopendir(dup_fd) : nullptr;
    if (dir == nullptr) {
      if (dup_fd >= 0) close(dup_fd);
      continue;
    }
    rewinddir(dir);
    while (const dirent* e = readdir(dir)) {
      if (e->d_name[0] == '.') continue;  // ".", "..", smi's temporary files
      Record rec{e->d_name, 0, 0, 0};
      if (!parse_grant_name(e->d_name, &rec.dev, &rec.ino, &rec.written_ns)) {
        unlinkat(fds_[i], e->d_name, 0);
        continue;
      }
      records_[i].push_back(std::move(rec));
    }
    closedir(dir);
    // In the order they were written.
    std::sort(records_[i].begin(), records_[i].end(),
              [](const Record& x, const Record& y) { return x.written_ns < y.written_ns; });
    any = any || !records_[i].empty();
  }
  return any;
}

void TamperGuard::apply_grants(const std::map<std::pair<dev_t, ino_t>, std::pair<TrackedRegion*, Kept*>>& by_file) {
  for (std::size_t i = 0; i < records_.size(); ++i) {
    for (const Record& rec : records_[i]) {
      const std::string& name = rec.name;
      const dev_t dev = rec.dev;
      const ino_t ino = rec.ino;
      const std::uint64_t written_ns = rec.written_ns;
      auto owner = by_file.find({dev, ino});
      if (owner == by_file.end()) {
        const std::uint64_t now = realtime_ns();
        if (now > written_ns && now - written_ns > kStaleGrantNs) unlinkat(fds_[i], name.c_str(), 0);
        continue;  // a region not watched yet (it is in a moment)
      }
      std::string text;
      Grant g;
      if (!read_record(fds_[i], name.c_str(), &text) || !parse_grant(text, &g)) {
        log(LogLevel::warn, "grant record %s/%s is not one gpuslice-smi writes: removed", dirs_[i].c_str(),
            name.c_str());
        unlinkat(fds_[i], name.c_str(), 0);
        continue;
      }
      TrackedRegion& t = *owner->second.first;
      Kept& k = *owner->second.second;
      bool pending = false;
      for (const GrantLine& l : g.lines) {
        if (l.field == GrantLine::priority) {
          k.priority = static_cast<std::uint32_t>(l.value);
          continue;
        }
        Limits* given = k.given_for(l.uuid);
        if (given == nullptr) {
          pending = true;  // an entry smi made that this cycle did not read yet: taken at first sight
          continue;
        }
        if (l.field == GrantLine::quota) given->quota = l.value;
        if (l.field == GrantLine::sm) given->sm = static_cast<std::uint32_t>(l.value);
        if (l.field == GrantLine::policy) given->policy = static_cast<std::uint32_t>(l.value);
        for (Limits& c : k.devices) {
          if (c.known && std::memcmp(c.uuid, l.uuid, sizeof c.uuid) == 0) c = *given;
        }
      }
      if (pending) {
        const std::uint64_t now = realtime_ns();
        if (!(now > written_ns && now - written_ns > kStaleGrantNs)) continue;
      }
      ++counters_.grants_applied;
      log(LogLevel::info, "region %s: limits changed by the operator (gpuslice-smi set) are kept", t.rel.c_str());
      unlinkat(fds_[i], name.c_str(), 0);
    }
  }
}

void TamperGuard::check(TrackedRegion& t, Kept& k, const Found& f) {
  Region* r = t.map.get();
  std::vector<std::string> what;
  std::uint32_t fields = 0;
  const bool ok = guarded([&] {
    for (const DeviceSample& d : t.sample.devices) {
      const Limits& kl = k.devices[d.index];
      const Limits& fl = f.devices[d.index];
      const Limits& bl = k.before[d.index];
      if (!kl.known || !fl.known) continue;
      DeviceState& s = r->devices[d.index];
      if (fl.quota != kl.quota && !(fl.quota == bl.quota && bl.known)) {
        std::uint64_t expected = fl.quota;
        // Only from the value judged: a change since (smi's, recorded) is judged next cycle.
        if (s.quota_bytes.compare_exchange_strong(expected, kl.quota)) {
          if (kl.quota < fl.quota) limiter::invalidate_leases(r, d.index);
          ++fields;
          what.push_back("entry "s + std::to_string(d.index) + " memory quota " + quota_text(fl.quota) + " (given " +
                         quota_text(kl.quota) + ")");
        }
      }
      if (fl.sm != kl.sm && !(fl.sm == bl.sm && bl.known)) {
        std::uint32_t expected = fl.sm;
        if (s.sm_limit_pct.compare_exchange_strong(expected, kl.sm)) {
          ++fields;
          what.push_back("entry "s + std::to_string(d.index) + " SM limit " + sm_text(fl.sm) + " (given " +
                         sm_text(kl.sm) + ")");
        }
      }
      if (fl.policy != kl.policy && !(fl.policy == bl.policy && bl.known)) {
        std::uint32_t expected = fl.policy;
        if (s.sm_policy.compare_exchange_strong(expected, kl.policy)) {
          ++fields;
          what.push_back("entry "s + std::to_string(d.index) + " SM policy " + sm_policy_name(fl.policy) + " (given " +
                         sm_policy_name(kl.policy) + ")");
        }
      }
    }
    if (k.priority != 0 && f.priority != k.priority && f.priority != k.priority_before) {
      std::uint32_t expected = f.priority;
      if (r->header.priority.compare_exchange_strong(expected, k.priority)) {
        ++fields;
        what.push_back("priority "s + priority_text(f.priority) + " (given " + priority_text(k.priority) + ")");
      }
    }
  });
  if (!ok || fields == 0) return;
  std::string container = printable(t.sample.container_name, sizeof t.sample.container_name);
  if (container.empty()) container = tools::escape_untrusted(t.owner.container);
  std::string list;
  for (const std::string& w : what) list += (list.empty() ? "" : ", ") + w;
  counters_.repairs += fields;
  repairs_[{container, t.rel}] += fields;
  log(LogLevel::warn,
      "container \"%s\" (region %s): limits rewritten in the region, not by gpuslice-smi set: %s; restored to the "
      "limits it was given",
      container.c_str(), t.rel.c_str(), list.c_str());
}

std::vector<RegionCount> TamperGuard::repairs_by_region() const {
  std::vector<RegionCount> out;
  for (const auto& [k, n] : repairs_) out.push_back({k.first, k.second, n});
  return out;
}

}  // namespace gpuslice::agent
