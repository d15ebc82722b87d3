// The driver's per-cgroup memory limit as a backstop behind gpuslice's quota
// (docs/agent.md, "Driver backstop"), with real parts: cuprobe under the
// preload library and cuprobe without it (LD_PRELOAD unset: a process that
// goes around the library), each moved into a cgroup v2 directory this test
// creates (the container's cgroup as a runtime would make it), the simulated
// driver of branch R615 (FAKECUDA_DRIVER_VERSION) or older, and the agent in
// this process. Needs root and a writable cgroup v2 mount; skipped otherwise.
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <memory>
#include <sstream>

#include "agent.h"
#include "agent_test_util.h"
#include "backstop.h"
#include "gpuslice/nvml_abi.h"
#include "limiter/lease.h"
#include "limiter/memory_accounting.h"

using namespace std::string_literals;
using namespace gpuslice;
using namespace gpuslice::agent_test;
using gpuslice::test::Env;
using gpuslice::test::Sandbox;

namespace {

constexpr std::uint64_t kQuota = 128 * kMi;

std::string cgroup2() { return agent::cgroup2_mount(read_file("/proc/self/mountinfo")); }

// A cgroup v2 directory for the test's "container", removed at the end (its
// processes killed first).
class Container {
 public:
  explicit Container(const std::string& name) {
    mount_ = cgroup2();
    if (geteuid() != 0 || mount_.empty()) return;
    dir_ = mount_ + "/gpuslice-backstop-" + std::to_string(getpid()) + "-" + name;
    if (mkdir(dir_.c_str(), 0755) != 0) dir_.clear();
  }
  ~Container() {
    for (pid_t p : pids_) kill(p, SIGKILL);
    for (pid_t p : pids_) test::wait(p, "", 10000);
    if (!dir_.empty()) rmdir(dir_.c_str());
  }
  bool usable() const { return !dir_.empty(); }
  const std::string& dir() const { return dir_; }
  const std::string& mount() const { return mount_; }
  // Starts argv waiting on `go`, moves it into the cgroup, then lets it run.
  pid_t start(const std::vector<std::string>& argv, const Env& env, const std::string& go, const std::string& out) {
    std::vector<std::string> args{test::bin("cuprobe"), "waitfile", go};
    args.insert(args.end(), argv.begin(), argv.end());
    return start_waiting(args, env, go, out);
  }
  // Starts a program that itself waits for `go`, moves it in, lets it run.
  pid_t start_waiting(const std::vector<std::string>& args, const Env& env, const std::string& go,
                      const std::string& out) {
    const pid_t pid = test::spawn(args, env, out);
    pids_.push_back(pid);
    std::ofstream(dir_ + "/cgroup.procs") << pid << std::flush;
    write_file(go, "");
    return pid;
  }
  void forget(pid_t pid) { pids_.erase(std::remove(pids_.begin(), pids_.end(), pid), pids_.end()); }

 private:
  std::string mount_, dir_;
  std::vector<pid_t> pids_;
};

// The limits the driver holds for a cgroup on device 0.
struct Limits {
  unsigned long long soft = 0, hard = 0, used = 0;
  int rc = -1;
};

// The value of a series of /metrics whose text starts with `prefix`, or -1.
double metric(const std::string& text, const std::string& prefix) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(prefix, 0) == 0) return std::stod(line.substr(line.rfind(' ') + 1));
  }
  return -1;
}

unsigned long long fill_bytes(const std::string& out) {
  for (const std::string& line : test::lines_with(read_file(out), "fill "))
    return std::stoull(test::field(line, "bytes"));
  return 0;
}

class Backstop : public ::testing::Test {
 protected:
  ~Backstop() override {
    if (nvml_ != nullptr) dlclose(nvml_);
  }
  // driver: FAKECUDA_DRIVER_VERSION for every process of the machine.
  void Setup(const std::string& driver) {
    if (!container_.usable()) GTEST_SKIP() << "needs root and a writable cgroup v2 mount";
    machine_ = {{"FAKECUDA_DRIVER_VERSION", driver},
                {"FAKECUDA_CGROUP_ROOT", container_.mount()},
                {"FAKECUDA_MEMORY", "1Gi"},
                {"FAKECUDA_CONTEXT_MEMORY", "16Mi"},
                {"FAKECUDA_MODULE_MEMORY", "1"}};
    for (const auto& [k, v] : machine_) setenv(k.c_str(), v.c_str(), 1);
    cfg_ = config_for(box_);
  }
  Env library_env() const {
    return test::merge(box_.env(), test::merge(machine_, {{"GPUSLICE_REGION", container_region(box_)},
                                                          {"GPUSLICE_MEMORY_LIMIT", "128Mi"}}));
  }
  Env bypass_env() const {  // the same container, around the library
    return test::merge(box_.env(false), machine_);
  }
  // The container's first process, under the library: "init ctx 0", `steps`,
  // then it says it is ready (waited for here) and holds on until end_.
  pid_t library_process(const std::vector<std::string>& steps) {
    std::vector<std::string> argv{"init", "ctx", "0"};
    argv.insert(argv.end(), steps.begin(), steps.end());
    argv.insert(argv.end(), {"touch", ready_, "waitfile", end_});
    const pid_t pid = container_.start(argv, library_env(), box_.path("go1"), box_.path("lib.out"));
    EXPECT_TRUE(eventually([&] { return file_exists(ready_); }, 20000)) << "the library's process is not ready";
    return pid;
  }
  agent::Agent& start_agent() {
    agent_ = std::make_unique<agent::Agent>(cfg_);
    agent_->start();
    return *agent_;
  }
  // What the bypass tests meet: on a driver of R615, the library's process
  // holding its context and 32 MiB, the agent cycled until the driver's hard
  // limit on the cgroup is the quota.
  void Walled() {
    Setup("615.20");
    if (IsSkipped()) return;
    library_process({"alloc", std::to_string(32 * kMi)});
    ASSERT_FALSE(HasFailure());
    agent::Agent& a = start_agent();
    ASSERT_TRUE(cycle_until(a, [&] { return limits().hard == kQuota; })) << "hard limit " << limits().hard;
  }
  // The simulated NVML, loaded here as an operator's tool would: the limits
  // the driver holds for the container's cgroup on device 0.
  Limits limits() {
    if (nvml_ == nullptr) nvml_ = dlopen(fake_nvml().c_str(), RTLD_NOW | RTLD_LOCAL);
    Limits l;
    if (nvml_ == nullptr) return l;
    auto init = reinterpret_cast<decltype(&nvmlInit_v2)>(dlsym(nvml_, "nvmlInit_v2"));
    auto handle =
        reinterpret_cast<decltype(&nvmlDeviceGetHandleByIndex_v2)>(dlsym(nvml_, "nvmlDeviceGetHandleByIndex_v2"));
    auto get = reinterpret_cast<decltype(&nvmlDeviceGetMemoryLimits_v1)>(dlsym(nvml_, "nvmlDeviceGetMemoryLimits_v1"));
    nvmlDevice_t dev = nullptr;
    if (init == nullptr || handle == nullptr || get == nullptr || init() != NVML_SUCCESS ||
        handle(0, &dev) != NVML_SUCCESS)
      return l;
    nvmlGetMemoryLimits_v1_t q{container_.dir().c_str(), 0, 0, 0};
    l.rc = get(dev, &q);
    l.soft = q.softLimit;
    l.hard = q.hardLimit;
    l.used = q.currentUsed;
    return l;
  }
  // Cycles until pred holds (bounded).
  bool cycle_until(agent::Agent& a, const std::function<bool()>& pred) {
    return eventually(
        [&] {
          a.cycle();
          return pred();
        },
        20000);
  }
  double backstop(agent::Agent& a, const std::string& kind) {
    const std::string text = a.metrics_text();
    std::istringstream in(text);
    std::string line;
    while (std::getline(in, line)) {
      if (line.rfind("gpuslice_memory_backstop{", 0) == 0 &&
          line.find("region=\"pod-1/c.region\"") != std::string::npos &&
          line.find("kind=\"" + kind + "\"") != std::string::npos)
        return std::stod(line.substr(line.rfind(' ') + 1));
    }
    return -1;
  }

  Sandbox box_;
  const std::string ready_ = box_.path("ready"), end_ = box_.path("end");
  Container container_{"c"};
  Env machine_;
  agent::AgentConfig cfg_;
  void* nvml_ = nullptr;                 // the simulated NVML, loaded by limits()
  std::unique_ptr<agent::Agent> agent_;  // before the container's processes are killed
};

// A container whose processes all go through the library: the agent sets the
// driver's hard limit on its cgroup to the quota; a process of the same
// container that unsets LD_PRELOAD is then refused by the driver at the
// quota, whatever the library knows.
TEST_F(Backstop, ABypassingProcessIsRefusedByTheDriverAtTheQuota) {
  ASSERT_NO_FATAL_FAILURE(Walled());
  if (IsSkipped()) return;
  agent::Agent& a = *agent_;
  EXPECT_EQ(limits().soft, 0u);
  EXPECT_EQ(backstop(a, "driver"), 1);

  const std::string out = box_.path("bypass.out");
  const pid_t bypass = container_.start({"init", "ctx", "0", "fill", "alloc", std::to_string(4 * kMi)}, bypass_env(),
                                        box_.path("go2"), out);
  const test::Result res = test::wait(bypass, out, 30000);
  container_.forget(bypass);
  ASSERT_EQ(res.exit_code, 0) << res.describe();
  // The library's process holds 16 (context) + 32; the bypass its context and
  // whatever the wall left: never past the quota.
  EXPECT_EQ(fill_bytes(out), kQuota - 16 * kMi - 32 * kMi - 16 * kMi) << res.out;
  EXPECT_NE(res.out.find("rc=2"), std::string::npos) << "refused with CUDA_ERROR_OUT_OF_MEMORY: " << res.out;
  write_file(end_, "");
}

// A process with its own copy of the driver (statically linked, or, here, the
// driver loaded into a new link-map namespace with dlmopen, where LD_PRELOAD
// does not apply) goes around the library although it is preloaded: the
// library never counts it, and the driver's wall still stops it at the quota.
TEST_F(Backstop, AProcessWithItsOwnCopyOfTheDriverIsRefusedByTheDriverAtTheQuota) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "a sanitizer's runtime cannot be loaded again into a second link-map namespace";
#endif
  ASSERT_NO_FATAL_FAILURE(Walled());
  if (IsSkipped()) return;

  const std::string out = box_.path("own.out"), go = box_.path("go2");
  const pid_t own = container_.start_waiting({test::bin("own_driver"), go, "4"}, library_env(), go, out);
  const test::Result res = test::wait(own, out, 30000);
  container_.forget(own);
  ASSERT_EQ(res.exit_code, 0) << res.describe();
  // The library's process holds 16 (context) + 32; the other its context and
  // what the wall left.
  EXPECT_EQ(fill_bytes(out), kQuota - 16 * kMi - 32 * kMi - 16 * kMi) << res.out;
  EXPECT_NE(res.out.find("rc=2"), std::string::npos) << "refused with CUDA_ERROR_OUT_OF_MEMORY: " << res.out;
  Region* r = attach(container_region(box_));
  ASSERT_NE(r, nullptr);
  const int dev = first_device(r);
  ASSERT_GE(dev, 0);
  EXPECT_EQ(limiter::used_bytes(r, dev), 16 * kMi + 32 * kMi) << "the library never saw the other copy's calls";
  shm::detach(r);
  write_file(end_, "");
}

// The same with the driver older than R615: no wall, the bypass runs past
// the quota, and the agent says so (gauge kind="none").
TEST_F(Backstop, OnAnOlderDriverTheBypassRunsPastAndTheGaugeSaysNone) {
  Setup("580.65.06");
  if (IsSkipped()) return;
  library_process({});
  ASSERT_FALSE(HasFailure());
  agent::Agent& a = start_agent();
  ASSERT_TRUE(cycle_until(a, [&] { return backstop(a, "none") == 1; }));
  EXPECT_EQ(backstop(a, "driver"), -1);
  EXPECT_EQ(limits().rc, NVML_ERROR_NOT_SUPPORTED);
  const std::string out = box_.path("bypass.out");
  const pid_t bypass = container_.start({"init", "ctx", "0", "fill", "alloc", std::to_string(64 * kMi)}, bypass_env(),
                                        box_.path("go2"), out);
  const test::Result res = test::wait(bypass, out, 30000);
  container_.forget(bypass);
  EXPECT_GT(fill_bytes(out), 4 * kQuota) << res.out;
  write_file(end_, "");
}

// A container filling its quota through the library (a context and a module
// included) is refused by gpuslice, never by the driver: the two count the
// same bytes.
TEST_F(Backstop, FillingTheQuotaThroughTheLibraryIsNeverRefusedByTheDriver) {
  Setup("615.20");
  if (IsSkipped()) return;
  const std::string go = box_.path("go3"), done = box_.path("done"), out = box_.path("lib.out");
  container_.start({"init", "ctx", "0", "function", "k", "touch", ready_, "waitfile", go, "fill", "alloc",
                    std::to_string(kMi), "touch", done, "waitfile", end_},
                   library_env(), box_.path("go1"), out);
  ASSERT_TRUE(eventually([&] { return file_exists(ready_); }, 20000));
  agent::Agent& a = start_agent();
  ASSERT_TRUE(cycle_until(a, [&] { return limits().hard == kQuota; }));
  write_file(go, "");
  ASSERT_TRUE(eventually([&] { return file_exists(done); }, 20000));
  a.cycle();
  Region* r = attach(container_region(box_));
  ASSERT_NE(r, nullptr);
  const int dev = first_device(r);
  ASSERT_GE(dev, 0);
  EXPECT_EQ(r->devices[dev].oom_refusals.load(), 1u) << "the one refusal that ended the fill is gpuslice's";
  const Limits l = limits();
  EXPECT_LE(l.used, kQuota);
  EXPECT_GT(l.used + kMi, kQuota) << "filled to within one chunk";
  EXPECT_EQ(l.used, limiter::used_bytes(r, dev) - limiter::spare_lease_bytes(r, dev))
      << "the driver counts what gpuslice counts (context and module included); " << read_file(out);
  write_file(end_, "");
}

// gpuslice-smi set moves both limits; the region's removal clears the driver's.
TEST_F(Backstop, SmiSetMovesTheDriverLimitAndRemovalClearsIt) {
  Setup("615.20");
  if (IsSkipped()) return;
  const pid_t lib = library_process({});
  ASSERT_FALSE(HasFailure());
  cfg_.grace_ns = 1;
  agent::Agent& a = start_agent();
  ASSERT_TRUE(cycle_until(a, [&] { return limits().hard == kQuota; }));
  const test::Result set =
      test::run({test::bin("gpuslice-smi"), "set", "--region", container_region(box_), "--memory", "96Mi"}, {});
  ASSERT_EQ(set.exit_code, 0) << set.describe();
  ASSERT_TRUE(cycle_until(a, [&] { return limits().hard == 96 * kMi; }));
  EXPECT_EQ(metric(a.metrics_text(),
                   "gpuslice_memory_backstop_limit_bytes{container=\"\",region=\"pod-1/c.region\",device=\"0\""),
            96.0 * kMi);
  // The container ends: its region goes after the grace period, and the limit with it.
  write_file(end_, "");
  const test::Result done = test::wait(lib, box_.path("lib.out"), 30000);
  container_.forget(lib);
  ASSERT_EQ(done.exit_code, 0) << done.describe();
  ASSERT_TRUE(cycle_until(a, [&] { return !file_exists(container_region(box_)); }));
  ASSERT_TRUE(cycle_until(a, [&] { return limits().hard == NVML_DEVICE_MEMORY_LIMIT_MAX; })) << limits().hard;
  EXPECT_EQ(a.stats().backstop_limits_cleared, 1u);
}

// The container's cgroup: the one its processes share, never the root, the
// agent's own or an ancestor of it, never one outside the agent's namespace.
TEST(BackstopCgroup, TheContainersCgroupIsTheOneItsProcessesShare) {
  std::string why;
  const std::string pod = "/kubepods.slice/kubepods-pod1.slice/cri-containerd-abc.scope";
  EXPECT_EQ(agent::common_cgroup({pod, pod}, "/system.slice/agent.service", &why), pod);
  EXPECT_EQ(agent::common_cgroup({}, "/a", &why), "");
  EXPECT_NE(why.find("no process"), std::string::npos);
  EXPECT_EQ(agent::common_cgroup({pod, pod + "x"}, "/a", &why), "");
  EXPECT_NE(why.find("more than one cgroup"), std::string::npos);
  EXPECT_EQ(agent::common_cgroup({"/"}, "/a", &why), "");
  EXPECT_EQ(agent::common_cgroup({"/a"}, "/a/b", &why), "") << "an ancestor of the agent's cgroup";
  EXPECT_EQ(agent::common_cgroup({"/a"}, "/a", &why), "");
  EXPECT_EQ(agent::common_cgroup({"/ab"}, "/a/b", &why), "/ab");
  EXPECT_EQ(agent::common_cgroup({"/../other"}, "/a", &why), "");
  EXPECT_NE(why.find("namespace"), std::string::npos);
  EXPECT_EQ(agent::common_cgroup({""}, "/a", &why), "");
  EXPECT_NE(why.find("cgroup v1"), std::string::npos);

  std::string path;
  EXPECT_TRUE(agent::cgroup_v2_line("12:memory:/x\n0::/machine.slice/libpod-1.scope/container\n", &path));
  EXPECT_EQ(path, "/machine.slice/libpod-1.scope/container");
  EXPECT_FALSE(agent::cgroup_v2_line("4:memory:/x\n1:name=systemd:/y\n", &path));
  EXPECT_EQ(agent::cgroup2_mount("30 1 0:26 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n"
                                 "31 1 0:27 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n"),
            "/sys/fs/cgroup");
  EXPECT_EQ(agent::cgroup2_mount("30 1 0:26 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n"),
            "/sys/fs/cgroup/unified");
  EXPECT_EQ(agent::cgroup2_mount("30 1 0:26 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"), "");
}

}  // namespace
