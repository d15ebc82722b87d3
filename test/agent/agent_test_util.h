// Helpers of the agent and gpuslice-smi tests: synthetic regions, processes
// in their own pid namespace, the agent configured for a sandbox.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "agent.h"
#include "grant.h"
#include "gpuslice/region.h"
#include "harness.h"
#include "shm/region_file.h"

namespace gpuslice::agent_test {

inline constexpr std::uint64_t kMi = std::uint64_t{1} << 20;

std::string fake_nvml();  // <build>/fakecuda/libnvidia-ml.so.1

// The agent's configuration for a sandbox: regions below <box>/regions, fast
// cycles, the simulated NVML (whose state this process is pointed at).
agent::AgentConfig config_for(const test::Sandbox& box, bool nvml = true);
// FAKECUDA_STATE for NVML loaded in this process (each test is its own process).
void use_fake_state(const test::Sandbox& box);
std::string region_dir(const test::Sandbox& box);
// The region of one container below the sandbox's region directory.
std::string container_region(const test::Sandbox& box, const std::string& pod = "pod-1");
// The first published device entry of a region, or -1.
int first_device(const Region* r);

// Maps (creating) a region file; fails the test on error.
Region* make_region(const std::string& path, const std::string& container_name);
int add_device(Region* r, std::uint8_t uuid_byte, std::uint64_t quota, std::uint32_t sm_limit = 100);
void uuid_bytes(std::uint8_t fill, std::uint8_t out[16]);
// Claims a slot for an identity (pid, namespace, start time) as the library would.
int add_slot(Region* r, std::uint32_t pid, std::uint64_t pidns, std::uint64_t start_time);
Region* attach(const std::string& path);  // an existing region, writable
// A grant record's line for the device uuid_bytes(uuid_byte) (a priority: no device).
agent::GrantLine grant_line(agent::GrantLine::Field field, std::uint8_t uuid_byte, std::uint64_t value);

// What /proc says about a host pid, as the process sees itself.
struct Identity {
  std::uint32_t host_pid = 0;
  std::uint32_t ns_pid = 0;
  std::uint64_t pidns = 0;
  std::uint64_t start_time = 0;
};
bool identity(std::uint32_t host_pid, Identity* out);
std::uint64_t own_pidns();

// unshare(1) can make a pid namespace here (root, or user namespaces).
bool can_unshare_pid();
// Host pids of the processes whose pid namespace is `pidns`.
std::vector<std::uint32_t> processes_in(std::uint64_t pidns);
// The direct children of a host pid.
std::vector<std::uint32_t> children_of(std::uint32_t pid);

// Polls pred every 5 ms until true or timeout; returns pred's last value.
bool eventually(const std::function<bool()>& pred, int timeout_ms = 5000);
bool file_exists(const std::string& path);
std::string read_file(const std::string& path);
void write_file(const std::string& path, const std::string& data);
// A loopback TCP port free when asked (for the agent's --listen), or -1.
int free_port();

}  // namespace gpuslice::agent_test
