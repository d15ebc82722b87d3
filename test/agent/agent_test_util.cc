#include "agent_test_util.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include "pidmap.h"

using namespace std::string_literals;

namespace gpuslice::agent_test {

std::string fake_nvml() { return test::fakecuda_dir() + "/libnvidia-ml.so.1"; }

std::string region_dir(const test::Sandbox& box) { return box.path("regions"); }

std::string container_region(const test::Sandbox& box, const std::string& pod) {
  return region_dir(box) + "/" + pod + "/c.region";
}

int first_device(const Region* r) {
  for (std::uint32_t i = 0; i < kMaxDevices; ++i) {
    if (r->devices[i].uuid_state.load() == shm::kDevicePublished) return static_cast<int>(i);
  }
  return -1;
}

void use_fake_state(const test::Sandbox& box) { setenv("FAKECUDA_STATE", box.path("fakecuda.state").c_str(), 1); }

agent::AgentConfig config_for(const test::Sandbox& box, bool nvml) {
  agent::AgentConfig c;
  c.region_dir = region_dir(box);
  mkdir(c.region_dir.c_str(), 0755);
  c.interval_ns = 50'000'000;
  c.rescan_ns = 0;  // every cycle
  c.verify_ns = 0;
  c.grace_ns = 0;  // never remove unless a test says so
  c.unseen_grace_ns = 0;
  c.use_nvml = nvml;
  c.nvml_library = fake_nvml();
  if (nvml) use_fake_state(box);
  return c;
}

Region* make_region(const std::string& path, const std::string& container_name) {
  shm::Error err{};
  Region* r = shm::attach(path.c_str(), container_name.c_str(), &err);
  EXPECT_NE(r, nullptr) << err.message;
  return r;
}

Region* attach(const std::string& path) {
  shm::Error err{};
  Region* r = shm::attach_existing(path.c_str(), true, &err);
  EXPECT_NE(r, nullptr) << err.message;
  return r;
}

void uuid_bytes(std::uint8_t fill, std::uint8_t out[16]) {
  for (int i = 0; i < 16; ++i) out[i] = static_cast<std::uint8_t>(fill + i);
}

int add_device(Region* r, std::uint8_t uuid_byte, std::uint64_t quota, std::uint32_t sm_limit) {
  std::uint8_t uuid[16];
  uuid_bytes(uuid_byte, uuid);
  return shm::device_index(r, uuid, quota, sm_limit, SmPolicy::hard);
}

agent::GrantLine grant_line(agent::GrantLine::Field field, std::uint8_t uuid_byte, std::uint64_t value) {
  agent::GrantLine l{};
  l.field = field;
  if (field != agent::GrantLine::priority) uuid_bytes(uuid_byte, l.uuid);
  l.value = value;
  return l;
}

int add_slot(Region* r, std::uint32_t pid, std::uint64_t pidns, std::uint64_t start_time) {
  return shm::claim_slot(r, shm::ProcessIdentity{pid, pidns, start_time});
}

bool identity(std::uint32_t host_pid, Identity* out) {
  agent::ProcInfo info;
  if (!agent::read_proc_info(host_pid, true, &info)) return false;
  *out = {host_pid, info.ns_pid, info.facts.pidns_inode, info.facts.stat.start_time};
  return true;
}

std::uint64_t own_pidns() {
  struct stat st {};
  return stat("/proc/self/ns/pid", &st) == 0 ? st.st_ino : 0;
}

bool can_unshare_pid() {
  test::Result r = test::run({"/usr/bin/unshare", "--pid", "--fork", "--mount-proc", "/bin/true"}, {}, 10000);
  return r.exit_code == 0;
}

namespace {

std::vector<std::uint32_t> all_pids() {
  std::vector<std::uint32_t> out;
  DIR* d = opendir("/proc");
  if (d == nullptr) return out;
  while (dirent* e = readdir(d)) {
    char* end = nullptr;
    const unsigned long v = std::strtoul(e->d_name, &end, 10);
    if (*end == '\0' && v > 0) out.push_back(static_cast<std::uint32_t>(v));
  }
  closedir(d);
  return out;
}

}  // namespace

std::vector<std::uint32_t> processes_in(std::uint64_t pidns) {
  std::vector<std::uint32_t> out;
  for (std::uint32_t pid : all_pids()) {
    Identity id;
    if (identity(pid, &id) && id.pidns == pidns) out.push_back(pid);
  }
  return out;
}

std::vector<std::uint32_t> children_of(std::uint32_t parent) {
  std::vector<std::uint32_t> out;
  for (std::uint32_t pid : all_pids()) {
    const std::string stat = read_file("/proc/"s + std::to_string(pid) + "/stat");
    const auto close = stat.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream in(stat.substr(close + 2));
    std::string state;
    unsigned long ppid = 0;
    in >> state >> ppid;
    if (ppid == parent) out.push_back(pid);
  }
  return out;
}

bool eventually(const std::function<bool()>& pred, int timeout_ms) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (std::chrono::steady_clock::now() < deadline) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return pred();
}

bool file_exists(const std::string& path) { return access(path.c_str(), F_OK) == 0; }

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void write_file(const std::string& path, const std::string& data) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << data;
}

int free_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    close(fd);
    return -1;
  }
  close(fd);
  return ntohs(a.sin_port);
}

}  // namespace gpuslice::agent_test
