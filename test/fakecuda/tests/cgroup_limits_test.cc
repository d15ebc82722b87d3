// Per-cgroup device-memory limits (R615+): nvmlDeviceSetMemoryLimits_v1 and
// nvmlDeviceGetMemoryLimits_v1 as NVML's reference documents them, the hard
// limit enforced at every allocation of the cgroup's processes, and the
// partition's view of nvmlDeviceGetMemoryInfo_v2 (README "Per-cgroup memory
// limits"). The test process moves itself into a cgroup v2 directory it
// creates (root and a writable cgroup v2 mount needed; skipped otherwise).
#include <sys/stat.h>
#include <sys/wait.h>

#include <fstream>
#include <sstream>

#include "common.h"
#include "nvml_abi.h"

using namespace fakecuda_test;

namespace {

// The first cgroup2 mount point of this mount namespace ("" if none).
std::string Cgroup2Mount() {
  std::ifstream in("/proc/self/mountinfo");
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    std::string f, mount_point;
    for (int i = 0; i < 5 && fields >> f; ++i) {
      if (i == 4) mount_point = f;
    }
    const auto dash = line.find(" - ");
    if (dash != std::string::npos && line.compare(dash + 3, 8, "cgroup2 ") == 0) return mount_point;
  }
  return "";
}

std::string OwnCgroup() {
  std::ifstream in("/proc/self/cgroup");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("0::", 0) == 0) return line.substr(3);
  }
  return "";
}

bool WriteFile(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
  out.flush();
  return out.good();
}

class CgroupLimits : public FakeCuda {
 protected:
  void SetUp() override {
    FakeCuda::SetUp();
    if (IsSkipped()) return;
    setenv("FAKECUDA_CONTEXT_MEMORY", "8Mi", 1);
    unsetenv("FAKECUDA_DRIVER_VERSION");
  }
  // Creates a cgroup v2 directory and moves this process into it.
  void EnterCgroup() {
    if (geteuid() != 0) GTEST_SKIP() << "needs root to create a cgroup";
    root_ = Cgroup2Mount();
    if (root_.empty()) GTEST_SKIP() << "no cgroup v2 mount";
    home_ = OwnCgroup();
    cgroup_ = root_ + "/fakecuda-test-" + std::to_string(getpid());
    if (mkdir(cgroup_.c_str(), 0755) != 0) GTEST_SKIP() << "cannot create " << cgroup_ << ": " << strerror(errno);
    ASSERT_TRUE(WriteFile(cgroup_ + "/cgroup.procs", std::to_string(getpid())));
    setenv("FAKECUDA_CGROUP_ROOT", root_.c_str(), 1);
  }
  void TearDown() override {
    if (!cgroup_.empty()) {
      WriteFile(root_ + home_ + "/cgroup.procs", std::to_string(getpid()));
      rmdir(cgroup_.c_str());
    }
    FakeCuda::TearDown();
  }
  nvmlDevice_t Device0() {
    nvmlDevice_t device = nullptr;
    EXPECT_EQ(nvmlInit_v2(), NVML_SUCCESS);
    EXPECT_EQ(nvmlDeviceGetHandleByIndex_v2(0, &device), NVML_SUCCESS);
    return device;
  }
  nvmlReturn_t Set(nvmlDevice_t device, unsigned long long soft, unsigned long long hard) {
    nvmlSetMemoryLimits_v1_t limits{cgroup_.c_str(), soft, hard};
    return nvmlDeviceSetMemoryLimits_v1(device, &limits);
  }
  nvmlGetMemoryLimits_v1_t Get(nvmlDevice_t device) {
    nvmlGetMemoryLimits_v1_t limits{cgroup_.c_str(), 1, 1, 1};
    EXPECT_EQ(nvmlDeviceGetMemoryLimits_v1(device, &limits), NVML_SUCCESS);
    return limits;
  }
  std::string root_, home_, cgroup_;
};

TEST_F(CgroupLimits, OlderDriverSaysNotSupported) {
  InitWithContext();
  nvmlDevice_t device = Device0();
  char version[80];
  ASSERT_EQ(nvmlSystemGetDriverVersion(version, sizeof(version)), NVML_SUCCESS);
  EXPECT_STREQ(version, "580.65.06");
  nvmlSetMemoryLimits_v1_t set{"/sys/fs/cgroup", 0, 64 * kMiB};
  EXPECT_EQ(nvmlDeviceSetMemoryLimits_v1(device, &set), NVML_ERROR_NOT_SUPPORTED);
  nvmlGetMemoryLimits_v1_t get{"/sys/fs/cgroup", 0, 0, 0};
  EXPECT_EQ(nvmlDeviceGetMemoryLimits_v1(device, &get), NVML_ERROR_NOT_SUPPORTED);
}

TEST_F(CgroupLimits, DriverVersionIsValidated) {
  setenv("FAKECUDA_DRIVER_VERSION", "615", 1);
  EXPECT_EQ(cuInit(0), CUDA_ERROR_INVALID_VALUE);
}

TEST_F(CgroupLimits, HardLimitRefusesEveryAllocationOfTheCgroup) {
  setenv("FAKECUDA_DRIVER_VERSION", "615.20", 1);
  EnterCgroup();
  if (IsSkipped()) return;
  ASSERT_CU(cuInit(0));
  nvmlDevice_t device = Device0();
  char version[80];
  ASSERT_EQ(nvmlSystemGetDriverVersion(version, sizeof(version)), NVML_SUCCESS);
  EXPECT_STREQ(version, "615.20");
  ASSERT_EQ(Set(device, 0, 64 * kMiB), NVML_SUCCESS);
  CUcontext ctx = nullptr;
  ASSERT_CU(cuCtxCreate(&ctx, nullptr, 0, 0));  // 8 MiB of context memory counts
  CUdeviceptr a = 0, b = 0, m = 0;
  ASSERT_CU(cuMemAlloc(&a, 56 * kMiB));  // exactly the limit
  EXPECT_EQ(cuMemAlloc(&b, 1), CUDA_ERROR_OUT_OF_MEMORY);
  nvmlGetMemoryLimits_v1_t got = Get(device);
  EXPECT_EQ(got.softLimit, 0u);
  EXPECT_EQ(got.hardLimit, 64 * kMiB);
  EXPECT_EQ(got.currentUsed, 64 * kMiB);
  nvmlMemory_v2_t info{};
  info.version = nvmlMemory_v2;
  ASSERT_EQ(nvmlDeviceGetMemoryInfo_v2(device, &info), NVML_SUCCESS);
  EXPECT_EQ(info.total, 64 * kMiB);
  EXPECT_EQ(info.used, 64 * kMiB);
  EXPECT_EQ(info.free, 0u);
  nvmlMemory_t v1{};
  ASSERT_EQ(nvmlDeviceGetMemoryInfo(device, &v1), NVML_SUCCESS);
  EXPECT_EQ(v1.total, 1024 * kMiB);  // the device as before: only _v2 is documented as the partition's view
  // Managed memory is outside the partition's count.
  ASSERT_CU(cuMemAllocManaged(&m, 16 * kMiB, CU_MEM_ATTACH_GLOBAL));
  EXPECT_EQ(Get(device).currentUsed, 64 * kMiB);
  EXPECT_CU(cuMemFree(m));
  // Device 1 has no limit.
  nvmlDevice_t other = nullptr;
  ASSERT_EQ(nvmlDeviceGetHandleByIndex_v2(1, &other), NVML_SUCCESS);
  nvmlGetMemoryLimits_v1_t free_device{cgroup_.c_str(), 1, 1, 1};
  ASSERT_EQ(nvmlDeviceGetMemoryLimits_v1(other, &free_device), NVML_SUCCESS);
  EXPECT_EQ(free_device.hardLimit, NVML_DEVICE_MEMORY_LIMIT_MAX);
  EXPECT_EQ(free_device.softLimit, 0u);
  // A raised limit admits more; a freed byte is free again.
  ASSERT_EQ(Set(device, 32 * kMiB, 80 * kMiB), NVML_SUCCESS);
  ASSERT_CU(cuMemAlloc(&b, 16 * kMiB));
  EXPECT_EQ(cuMemAlloc(&m, 1), CUDA_ERROR_OUT_OF_MEMORY);
  EXPECT_EQ(Get(device).softLimit, 32 * kMiB);
  EXPECT_CU(cuMemFree(b));
  ASSERT_CU(cuMemAlloc(&b, 16 * kMiB));
  EXPECT_CU(cuMemFree(a));
  EXPECT_CU(cuMemFree(b));
  EXPECT_CU(cuCtxDestroy(ctx));
}

TEST_F(CgroupLimits, ClearingRestoresTheDevice) {
  setenv("FAKECUDA_DRIVER_VERSION", "615.20", 1);
  EnterCgroup();
  if (IsSkipped()) return;
  InitWithContext();
  nvmlDevice_t device = Device0();
  ASSERT_EQ(Set(device, 0, 16 * kMiB), NVML_SUCCESS);
  CUdeviceptr a = 0;
  EXPECT_EQ(cuMemAlloc(&a, 16 * kMiB), CUDA_ERROR_OUT_OF_MEMORY);
  ASSERT_EQ(Set(device, 0, NVML_DEVICE_MEMORY_LIMIT_MAX), NVML_SUCCESS);
  nvmlGetMemoryLimits_v1_t got = Get(device);
  EXPECT_EQ(got.hardLimit, NVML_DEVICE_MEMORY_LIMIT_MAX);
  EXPECT_EQ(got.softLimit, 0u);
  EXPECT_EQ(got.currentUsed, 8 * kMiB);
  ASSERT_CU(cuMemAlloc(&a, 512 * kMiB));
  nvmlMemory_v2_t info{};
  info.version = nvmlMemory_v2;
  ASSERT_EQ(nvmlDeviceGetMemoryInfo_v2(device, &info), NVML_SUCCESS);
  EXPECT_EQ(info.total, 1024 * kMiB);
}

TEST_F(CgroupLimits, ArgumentsAndPrivilege) {
  setenv("FAKECUDA_DRIVER_VERSION", "615.20", 1);
  EnterCgroup();
  if (IsSkipped()) return;
  InitWithContext();
  nvmlDevice_t device = Device0();
  EXPECT_EQ(nvmlDeviceSetMemoryLimits_v1(device, nullptr), NVML_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(nvmlDeviceGetMemoryLimits_v1(device, nullptr), NVML_ERROR_INVALID_ARGUMENT);
  nvmlSetMemoryLimits_v1_t outside{"/tmp", 0, kMiB};
  EXPECT_EQ(nvmlDeviceSetMemoryLimits_v1(device, &outside), NVML_ERROR_INVALID_ARGUMENT);
  const std::string missing = cgroup_ + "/none";
  nvmlSetMemoryLimits_v1_t absent{missing.c_str(), 0, kMiB};
  EXPECT_EQ(nvmlDeviceSetMemoryLimits_v1(device, &absent), NVML_ERROR_NOT_FOUND);
  EXPECT_EQ(Set(device, 2 * kMiB, kMiB), NVML_ERROR_INVALID_ARGUMENT);  // soft above hard
  EXPECT_EQ(Get(device).hardLimit, NVML_DEVICE_MEMORY_LIMIT_MAX);
  // Unprivileged: setting is refused, reading is not.
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    if (setresuid(65534, 65534, 65534) != 0) _exit(10);
    nvmlSetMemoryLimits_v1_t set{cgroup_.c_str(), 0, kMiB};
    if (nvmlDeviceSetMemoryLimits_v1(device, &set) != NVML_ERROR_NO_PERMISSION) _exit(11);
    nvmlGetMemoryLimits_v1_t get{cgroup_.c_str(), 0, 0, 0};
    if (nvmlDeviceGetMemoryLimits_v1(device, &get) != NVML_SUCCESS) _exit(12);
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
}

}  // namespace
