// The region directory: finds region files, validates and maps them, notices
// files that appear, vanish or are replaced, and removes regions nobody has
// used for a grace period.
//
// Layout: one or more roots (layout.h), each <root>/<name> and
// <root>/<sub>/<name> (one subdirectory per pod, container or claim). Hidden files are skipped (a region being created is a
// hidden temporary file until it is complete), except our own
// ".<name>.gpuslice-removing". Symbolic links are never followed and nothing
// is opened in a way that could block, because a container owns its
// subdirectory and may plant anything there.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "layout.h"
#include "region_io.h"
#include "sample.h"
#include "slot_index.h"

namespace gpuslice::agent {

inline constexpr char kRemovingSuffix[] = ".gpuslice-removing";

// A directory of regions and how its subdirectories are named.
struct RegionRoot {
  std::string dir;
  Layout layout = Layout::gpuslice;
};

struct TrackedRegion {
  std::string rel;       // as shown: below --region-dir for gpuslice's layout ("pod/c.region"), else the full path
  std::size_t root = 0;  // index into the set's roots
  OwnerLabels owner;     // pod/container/claim from the path (layout.h)
  std::string sub;       // subdirectory ("" for the top level)
  std::string name;      // the file's name as processes open it
  std::string current;   // its name now (the hidden one while being removed)
  MappedRegion map;
  std::uint64_t empty_since_ns = 0;  // 0 while some slot is in use
  bool removing = false;             // renamed to the hidden name; unlinked if still empty next cycle
  bool dropped = false;              // forgotten at the end of the cycle
  SlotIndex slots;                   // the slots in use, read every cycle
  RegionSample sample;
  // Each device's count (used_bytes less spare leases), the larger of its
  // reads just before and just after the NVML sample (Agent::note_counts):
  // what Reconciler::write compares NVML with. Valid for one cycle.
  std::uint64_t counted_at_nvml[kMaxDevices] = {};
  bool counted_at_nvml_known = false;
};

class RegionSet {
 public:
  RegionSet(std::string dir, std::size_t max_regions);  // one root in gpuslice's layout
  RegionSet(std::vector<RegionRoot> roots, std::size_t max_regions);
  ~RegionSet();
  RegionSet(const RegionSet&) = delete;
  RegionSet& operator=(const RegionSet&) = delete;

  // Re-reads every root. false if some root cannot be read (logged once per
  // root; the regions already mapped stay).
  bool rescan();
  std::vector<std::unique_ptr<TrackedRegion>>& regions() { return regions_; }
  const std::vector<std::unique_ptr<TrackedRegion>>& regions() const { return regions_; }
  // Forgets regions marked dropped.
  void sweep();
  void drop(TrackedRegion& t, const std::string& why);

  // Once per cycle per region: empty = no slot in use. Removes the file once it
  // has been empty for grace_ns (0 = never): renames it to a hidden name first
  // (new processes then create a fresh region instead of attaching to it), and
  // unlinks it one cycle later if still nobody uses it; otherwise puts it back.
  void lifecycle(TrackedRegion& t, bool empty, std::uint64_t now_ns, std::uint64_t grace_ns);
  // Once per cycle: the pod directories whose last region was removed go
  // once empty and no longer in use: no mount namespace of the node has them
  // mounted (mounts.h). One still mounted is checked again every recheck_ns.
  // A directory with gpuslice-cdi's configuration file beside it
  // (".<name>.conf") is its DRA driver's, which removes it: never ours.
  void release_dirs(std::uint64_t now_ns, std::uint64_t recheck_ns);

  const std::string& dir() const { return roots_.front().dir; }
  const std::vector<RegionRoot>& roots() const { return roots_; }
  std::size_t invalid_files() const { return bad_.size(); }
  // Region files the last rescan found but did not watch: --max-regions was reached.
  std::size_t unwatched() const { return unwatched_; }
  std::size_t max_regions() const { return max_regions_; }
  // Warnings about invalid files left unwritten by the log budget (below).
  std::uint64_t log_suppressed() const { return log_suppressed_; }
  std::uint64_t removed_total() const { return removed_total_; }
  // Pod directories a rescan listed, and those it found unchanged and did
  // not list (DirMemo below).
  std::uint64_t dirs_listed() const { return dirs_listed_; }
  std::uint64_t dirs_unchanged() const { return dirs_unchanged_; }

 private:
  struct BadFile {
    dev_t dev;
    ino_t ino;
    off_t size;
    std::int64_t mtime_ns;
  };
  bool scan_root(std::size_t root, std::unordered_map<std::string, bool>& seen);
  // Lists one pod directory, or finds it unchanged (its keys then count as seen).
  void scan_sub(std::size_t root, int rootfd, const char* name, std::size_t limit,
                std::unordered_map<std::string, bool>& seen);
  // true: the file is a region watched under this name (nothing to re-check
  // while its directory is unchanged).
  bool consider(std::size_t root, int dirfd, const std::string& sub, const char* name,
                std::unordered_map<std::string, bool>& seen);
  int open_sub(std::size_t root, const std::string& sub) const;
  // The file's full path: the key of by_rel_, bad_ and a rescan's "seen".
  std::string key(std::size_t root, const std::string& sub, const std::string& name) const;
  void remove_now(TrackedRegion& t, int dirfd);
  // A warning about one invalid file, within the budget: kSkipLogBurst lines,
  // then one more every kSkipLogRefillNs; past it the line is counted, and a
  // summary of what was suppressed is logged at most once a minute. Files
  // renamed at every rescan are new files each time: without the budget
  // they would fill the node's log (issue 33).
  [[gnu::format(printf, 3, 4)]] void skip_warning(const std::string& key, const char* format, ...);
  void restore(TrackedRegion& t, int dirfd);

  std::vector<RegionRoot> roots_;
  std::size_t max_regions_;
  std::vector<std::unique_ptr<TrackedRegion>> regions_;
  struct PendingDir {
    std::size_t root;
    std::string sub;
    std::uint64_t due_ns;  // next check (0 = at once)
  };
  std::unordered_map<std::string, PendingDir> pending_dirs_;  // by root/sub
  std::unordered_map<std::string, TrackedRegion*> by_rel_;    // by key()
  struct FileId {
    dev_t dev;
    ino_t ino;
    bool operator==(const FileId&) const = default;
  };
  struct FileIdHash {
    std::size_t operator()(const FileId& f) const noexcept {
      return static_cast<std::size_t>(f.ino * 0x9E3779B97F4A7C15ull ^ f.dev);
    }
  };
  std::unordered_map<FileId, TrackedRegion*, FileIdHash> by_inode_;  // watched files, by (st_dev, st_ino)
  std::unordered_map<std::string, BadFile> bad_;
  // A pod directory whose every entry was a region watched under its name,
  // as last listed. Not listed again while its inode, mtime and ctime are
  // the same (a name added, removed or renamed changes both; ctime cannot be
  // set back), the listing began over kDirSettleNs after that mtime (a change
  // in the same timestamp tick is not missed) and its regions are all still
  // watched (one dropped, e.g. truncated, is looked at again).
  struct DirMemo {
    dev_t dev;
    ino_t ino;
    std::int64_t mtime_ns, ctime_ns;
    std::vector<std::string> keys;  // key() of each region in it
    bool visited;                   // by this rescan
  };
  std::unordered_map<std::string, DirMemo> dir_memo_;  // by root/sub
  std::uint64_t dirs_listed_ = 0, dirs_unchanged_ = 0;
  std::uint64_t removed_total_ = 0;
  std::vector<char> dir_error_logged_;  // per root
  std::size_t unwatched_ = 0, unwatched_counting_ = 0;
  std::uint64_t log_suppressed_ = 0, log_suppressed_reported_ = 0;
  double log_tokens_ = -1;  // < 0: full (first use)
  std::uint64_t log_refill_ns_ = 0, log_summary_ns_ = 0;
};

}  // namespace gpuslice::agent
