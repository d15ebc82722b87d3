// Fuzz target: what the node agent and gpuslice-smi make of a file a container
// planted in the region directory, its name and its bytes: the agent's scan,
// validation and cycle (tools/agent: scan, region_io, reconcile, reaping),
// /metrics, /api/status and its log; smi's directory reading, --json and table.
//
// Input: [flags][name length N][N name bytes][bytes laid over a region the
// library wrote]. The bytes fill, in this order, the header, device entry 0,
// slots 0 and 1, the other device entries, the other slots (what the library
// wrote stays where the input ends: short inputs reach every kind of field).
//   flags bit 0: the file is cut to as many bytes as the input laid over (a wrong size)
//   flags bit 1: the cycle gets an NVML sample (our process on the region's device)
// In the name, the first '/' puts the file in a subdirectory of that name
// (the per-pod layout); NUL and any further '/' become '_'.
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "agent.h"
#include "checks.h"
#include "fuzz_target.h"
#include "log.h"
#include "shm/region_file.h"
#include "smi.h"
#include "status.h"

using gpuslice::fuzz::fail;
namespace agent = gpuslice::agent;
namespace shm = gpuslice::shm;

namespace {

struct Fixture {
  std::string dir;                  // the region directory
  std::vector<unsigned char> base;  // a region as the library writes it
  std::uint8_t uuid[16] = {};
};

void remove_tree(int dirfd, int depth) {
  DIR* d = fdopendir(dirfd);
  if (d == nullptr) return;
  std::vector<std::string> names;
  while (dirent* e = readdir(d)) {
    if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) names.push_back(e->d_name);
  }
  for (const std::string& n : names) {
    if (unlinkat(::dirfd(d), n.c_str(), 0) == 0) continue;
    if (depth > 0) {
      const int sub = openat(::dirfd(d), n.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
      if (sub >= 0) remove_tree(sub, depth - 1);
    }
    unlinkat(::dirfd(d), n.c_str(), AT_REMOVEDIR);
  }
  closedir(d);
}

void clear_dir(const std::string& dir) {
  const int fd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) remove_tree(fd, 2);
}

// Where the input's bytes go in the region, in order.
std::vector<std::pair<std::size_t, std::size_t>> overlay_segments() {
  using gpuslice::Region;
  std::vector<std::pair<std::size_t, std::size_t>> out;
  out.emplace_back(0, sizeof(gpuslice::RegionHeader));
  out.emplace_back(offsetof(Region, devices), sizeof(gpuslice::DeviceState));
  out.emplace_back(offsetof(Region, slots), 2 * sizeof(gpuslice::Slot));
  out.emplace_back(offsetof(Region, devices) + sizeof(gpuslice::DeviceState),
                   (gpuslice::kMaxDevices - 1) * sizeof(gpuslice::DeviceState));
  out.emplace_back(offsetof(Region, slots) + 2 * sizeof(gpuslice::Slot),
                   sizeof(Region) - offsetof(Region, slots) - 2 * sizeof(gpuslice::Slot));
  return out;
}

// Lays `data` over `region` by overlay_segments(); the bytes used.
std::size_t lay_over(unsigned char* region, const std::uint8_t* data, std::size_t size) {
  static const std::vector<std::pair<std::size_t, std::size_t>> segments = overlay_segments();
  std::size_t used = 0;
  for (const auto& [offset, len] : segments) {
    const std::size_t n = std::min(len, size - used);
    std::memcpy(region + offset, data + used, n);
    used += n;
    if (used == size) break;
  }
  return used;
}

Fixture* g_fixture = nullptr;

void cleanup_at_exit() {
  if (g_fixture == nullptr) return;
  clear_dir(g_fixture->dir);
  rmdir(g_fixture->dir.c_str());
}

// Directories of fuzzers that crashed (gpuslice-fuzz-<pid>-*, the pid gone).
void remove_stale(const std::string& parent) {
  DIR* d = opendir(parent.c_str());
  if (d == nullptr) return;
  std::vector<std::string> stale;
  while (dirent* e = readdir(d)) {
    unsigned pid = 0;
    if (std::sscanf(e->d_name, "gpuslice-fuzz-%u-", &pid) == 1 && pid != 0 && kill(static_cast<pid_t>(pid), 0) != 0 &&
        errno == ESRCH) {
      stale.push_back(parent + "/" + e->d_name);
    }
  }
  closedir(d);
  for (const std::string& dir : stale) {
    clear_dir(dir);
    rmdir(dir.c_str());
  }
}

Fixture make_fixture() {
  Fixture f;
  const char* tmp = std::getenv("TMPDIR");
  const std::string parent = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : (tmp != nullptr ? tmp : "/tmp");
  remove_stale(parent);
  std::string templ = parent + "/gpuslice-fuzz-" + std::to_string(getpid()) + "-XXXXXX";
  if (mkdtemp(templ.data()) == nullptr) fail("mkdtemp");
  f.dir = templ;
  // A region the library creates and uses: one process, one device with a
  // quota, an SM limit and memory in use.
  const std::string seed = f.dir + "/.seed";
  shm::Error err{};
  gpuslice::Region* r = shm::attach(seed.c_str(), "seed-container", &err);
  if (r == nullptr) fail(err.message);
  shm::ProcessIdentity self{};
  if (!shm::read_identity(0, &self)) fail("read_identity");
  const int slot = shm::claim_slot(r, self);
  for (int i = 0; i < 16; ++i) f.uuid[i] = static_cast<std::uint8_t>(0xa0 + i);
  const int dev = shm::device_index(r, f.uuid, std::uint64_t{8} << 30, 50, gpuslice::SmPolicy::hard);
  if (slot < 0 || dev < 0) fail("seed region: no slot or device entry");
  r->devices[dev].used_bytes.store(std::uint64_t{256} << 20);
  r->slots[slot].committed_bytes[dev].store(std::uint64_t{256} << 20);
  const auto* bytes = reinterpret_cast<const unsigned char*>(r);
  f.base.assign(bytes, bytes + sizeof(gpuslice::Region));
  shm::detach(r);
  unlink(seed.c_str());
  return f;
}

Fixture& fixture() {
  static Fixture f = [] {
    Fixture made = make_fixture();
    return made;
  }();
  if (g_fixture == nullptr) {
    g_fixture = &f;
    std::atexit(cleanup_at_exit);
    gpuslice::fuzz::on_fail(cleanup_at_exit);
    agent::set_log_level(agent::LogLevel::debug);
  }
  return f;
}

// The name as a file name: sub/name or name.
bool split_name(std::string raw, std::string* sub, std::string* name) {
  for (char& c : raw) {
    if (c == '\0') c = '_';
  }
  const std::size_t slash = raw.find('/');
  *sub = slash == std::string::npos ? "" : raw.substr(0, slash);
  *name = slash == std::string::npos ? raw : raw.substr(slash + 1);
  for (char& c : *name) {
    if (c == '/') c = '_';
  }
  auto bad = [](const std::string& n) { return n.empty() || n == "." || n == ".." || n.size() > 255; };
  return !bad(*name) && (slash == std::string::npos || !bad(*sub));
}

// Writes the file sparse: only its 4 KiB blocks that hold a non-zero byte
// (most of a region is zero; tmpfs then allocates a few pages, not 900 KiB).
bool write_file(int dirfd, const char* name, const unsigned char* data, std::size_t size) {
  const int fd = openat(dirfd, name, O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) return false;
  bool ok = ftruncate(fd, static_cast<off_t>(size)) == 0;
  constexpr std::size_t kBlock = 4096;
  for (std::size_t at = 0; ok && at < size; at += kBlock) {
    const std::size_t n = std::min(kBlock, size - at);
    bool zero = true;
    for (std::size_t i = 0; i < n && zero; ++i) zero = data[at + i] == 0;
    if (!zero) ok = pwrite(fd, data + at, n, static_cast<off_t>(at)) == static_cast<ssize_t>(n);
  }
  close(fd);
  return ok;
}

std::size_t count_lines(const std::string& s) {
  std::size_t n = 0;
  for (char c : s) n += c == '\n';
  return n;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 2) return 0;
  Fixture& f = fixture();
  const std::uint8_t flags = data[0];
  const std::size_t name_len = std::min<std::size_t>(data[1], size - 2);
  std::string sub, name;
  if (!split_name(std::string(reinterpret_cast<const char*>(data + 2), name_len), &sub, &name)) return 0;
  static std::vector<unsigned char> file;
  file = f.base;
  const std::size_t over_len = lay_over(file.data(), data + 2 + name_len, size - 2 - name_len);
  const std::size_t file_size = (flags & 1) != 0 ? std::min(over_len, file.size()) : file.size();

  clear_dir(f.dir);
  int dirfd = open(f.dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dirfd < 0) fail("cannot open the region directory");
  if (!sub.empty()) {
    if (mkdirat(dirfd, sub.c_str(), 0700) != 0) {
      close(dirfd);
      return 0;
    }
    const int subfd = openat(dirfd, sub.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    close(dirfd);
    dirfd = subfd;
    if (dirfd < 0) fail("cannot open the subdirectory");
  }
  const bool written = write_file(dirfd, name.c_str(), file.data(), file_size);
  close(dirfd);
  if (!written) return 0;
  const std::string rel = sub.empty() ? name : sub + "/" + name;

  std::string metrics, status, smi_json, smi_table, log;
  std::vector<gpuslice::smi::Shown> shown;
  std::vector<std::string> skipped;
  std::string smi_error;
  bool status_threw = false, smi_json_threw = false, one_ok = false;
  std::uint64_t agent_regions = 0;
  {
    gpuslice::fuzz::StderrCapture capture;
    agent::AgentConfig config;
    config.region_dir = f.dir;
    config.use_nvml = false;
    config.priority_board = "";
    config.grace_ns = 0;
    config.max_regions = 16;
    agent::Agent a(config);
    a.start();
    agent::GpuSample gpu;
    if ((flags & 2) != 0) {
      agent::GpuDevice d;
      std::memcpy(d.uuid, f.uuid, sizeof d.uuid);
      d.uuid_text = agent::format_uuid(f.uuid);
      d.processes.push_back({static_cast<std::uint32_t>(getpid()), std::uint64_t{3} << 30, true});
      d.processes_known = true;
      gpu.devices.push_back(d);
    }
    a.cycle_with((flags & 2) != 0 ? &gpu : nullptr);
    metrics = a.metrics_text();
    agent_regions = a.stats().regions;
    agent::StatusHistory history(4, 1);
    history.record(1000, metrics);
    try {
      status = history.json(1001, metrics);
    } catch (const nlohmann::json::exception&) {
      status_threw = true;
    }
    if (!gpuslice::smi::read_region_dir(f.dir, &shown, &skipped, &smi_error)) fail("smi cannot read the directory");
    gpuslice::smi::Shown one;
    one_ok = gpuslice::smi::read_region(f.dir + "/" + rel, &one, &smi_error);
    gpuslice::smi::Snapshot snap;
    snap.regions = shown;
    snap.now_ns = agent::monotonic_ns();
    try {
      smi_json = gpuslice::smi::render_json(snap);
    } catch (const nlohmann::json::exception&) {
      smi_json_threw = true;
    }
    smi_table = gpuslice::smi::render_table(snap);
    log = capture.finish();
  }

  // /metrics: the text format, every line a Prometheus scraper accepts.
  std::size_t samples = 0;
  const std::string why = gpuslice::fuzz::check_exposition(metrics, GPUSLICE_FUZZ_CHECK_UTF8_NAMES != 0, &samples);
  if (!why.empty()) fail(("/metrics: " + why).c_str());
  // /api/status: JSON, with every sample of /metrics (the page never shows a
  // number that /metrics does not, and none goes missing).
  if (status_threw) {
    if (GPUSLICE_FUZZ_CHECK_UTF8_NAMES) fail("/api/status threw (a 500 for the whole node)");
  } else {
    const nlohmann::json doc = nlohmann::json::parse(status, nullptr, false);
    if (doc.is_discarded()) fail("/api/status is not JSON");
    if (doc["series"].size() != samples) fail("/api/status does not hold every sample of /metrics");
  }
  // smi and the agent read the directory alike.
  if (shown.size() != agent_regions) fail("smi and the agent disagree on the number of regions");
  if (shown.size() > 1) fail("more than one region from one file");
  // gpuslice-smi --region PATH reads what the directory listing shows (hidden names aside).
  if (name[0] != '.' && (sub.empty() || sub[0] != '.') && one_ok != (shown.size() == 1))
    fail("smi reads the file by path and in its directory differently");
  // A plain name is shown as it is (others are shown escaped).
  const bool plain =
      rel.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-/") == std::string::npos;
  if (!shown.empty() && plain && shown[0].path != rel) fail("smi names the region differently");
  if (smi_json_threw) {
    if (GPUSLICE_FUZZ_CHECK_UTF8_NAMES) fail("gpuslice-smi --json threw");
  } else if (nlohmann::json::parse(smi_json, nullptr, false).is_discarded()) {
    fail("gpuslice-smi --json is not JSON");
  } else if (smi_json.empty() || smi_json.find('\n') != smi_json.size() - 1) {
    fail("gpuslice-smi --json is not one line");
  }
  if (GPUSLICE_FUZZ_CHECK_TABLE_TEXT) {
    for (char c : smi_table) {
      const auto u = static_cast<unsigned char>(c);
      if ((u < 0x20 && c != '\n') || u == 0x7f) fail("gpuslice-smi's table holds a control byte");
    }
  }
  if (GPUSLICE_FUZZ_CHECK_LOG_LINES) {
    const std::string lines = gpuslice::fuzz::check_lines(log, "gpuslice: ");
    if (!lines.empty()) fail(("agent log: " + lines).c_str());
    for (const std::string& s : skipped) {
      if (s.find('\n') != std::string::npos) fail("gpuslice-smi: a skip message of more than one line");
    }
  }
  // Bounded: a file's name and content never make the log grow beyond a few
  // lines per file (each problem is logged once). The newlines of a name
  // logged raw are GPUSLICE_FUZZ_CHECK_LOG_LINES's, not counted here.
  std::string entries = log;
  if (!GPUSLICE_FUZZ_CHECK_LOG_LINES) {
    for (const std::string& raw : {rel, name, sub}) {
      if (raw.find('\n') == std::string::npos) continue;
      for (std::size_t at; (at = entries.find(raw)) != std::string::npos;) entries.erase(at, raw.size());
    }
  }
  if (count_lines(entries) > 16) fail(("more than 16 log lines for one file:\n" + log.substr(0, 4096)).c_str());
  return 0;
}

namespace gpuslice::fuzz {
std::vector<std::string> seeds() {
  Fixture& f = fixture();
  // The header, device entry 0 and slots 0 and 1 the library wrote (in the
  // order lay_over() takes them).
  const auto* base = reinterpret_cast<const char*>(f.base.data());
  const std::string region = std::string(base, sizeof(gpuslice::RegionHeader)) +
                             std::string(base + offsetof(gpuslice::Region, devices), sizeof(gpuslice::DeviceState)) +
                             std::string(base + offsetof(gpuslice::Region, slots), 2 * sizeof(gpuslice::Slot));
  auto input = [&](std::uint8_t flags, const std::string& name, const std::string& bytes) {
    return std::string(1, static_cast<char>(flags)) + std::string(1, static_cast<char>(name.size())) + name + bytes;
  };
  return {
      input(0, "c1.region", region),
      input(2, "pod-1/c1.region", region),
      input(0, "\xff\xfe.region", region),
      input(2, "c\nwarning: possible bypass", region),
      input(1, "short.region", region.substr(0, 512)),
      input(0, ".hidden.region", region),
      input(0, "junk", "not a region"),
      input(2, "pod\x1b[31m/c.region", region),
  };
}
}  // namespace gpuslice::fuzz
