// Fuzz target: gpuslice-cdi's inputs (tools/cdi): the flag values it
// validates (names, limits, paths, annotations) and what it writes from them
// (the spec, the environment, the configuration file), plus the preload-file
// reader. The input is the request's fields separated by NUL bytes (no flag
// value can hold one), in SliceRequest's order:
//   kind, name, memory, sm-limit, sm-policy, priority, container-name,
//   region-host-dir, region-dir, region-file, library-host, library,
//   inject ("env" or other), preload-host-file, config-host-file, annotations (KEY=VALUE)...
// An empty field keeps the default.
#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "cdi_spec.h"
#include "checks.h"
#include "fuzz_target.h"
#include "limiter/options/file.h"

using gpuslice::fuzz::fail;
namespace cdi = gpuslice::cdi;
namespace options = gpuslice::options;

namespace {

void fail_with(const std::string& what) { fail(what.c_str()); }

// dir == path or dir is a directory above path.
bool covers(const std::string& dir, const std::string& path) {
  return path == dir || (path.size() > dir.size() && path.compare(0, dir.size(), dir) == 0 && path[dir.size()] == '/');
}

void check_preload_entries(const std::string& text) {
  for (const std::string& e : cdi::preload_entries(text)) {
    if (e.empty() || e.find_first_of(" \t\r\n:#") != std::string::npos) fail("a preload entry holds a separator");
  }
}

// The configuration file gpuslice-cdi writes, read by the library's own
// reader, against the spec's environment read by the library's parser: a
// process that clears its environment gets the same limits and region.
void check_config_roundtrip(const cdi::SliceRequest& req) {
  static const int fd = memfd_create("gpuslice-fuzz-cdi.conf", MFD_CLOEXEC);
  if (fd < 0) fail("memfd_create");
  const std::string text = cdi::config_file_text(req);
  if (ftruncate(fd, 0) != 0 || pwrite(fd, text.data(), text.size(), 0) != static_cast<ssize_t>(text.size()))
    fail("cannot write the file");
  char path[64];
  std::snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
  static options::ConfigFileBuffer buf;
  static options::Options from_file, from_env;
  char* empty_env[] = {nullptr};
  gpuslice::shm::Error err{};
  if (!options::load_options(empty_env, path, &buf, &from_file, &err))
    fail_with(std::string("the library refuses gpuslice-cdi's configuration file: ") + err.message);
  std::vector<std::string> env = cdi::slice_environment(req);
  std::vector<char*> envp;
  for (std::string& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  if (!options::parse_options(envp.data(), &from_env, &err)) fail("validate() passed what the library refuses");
  const std::string differs = gpuslice::fuzz::differing_option(from_file, from_env);
  if (!differs.empty()) fail_with("the configuration file and the spec's environment disagree on " + differs);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size > 16 * 1024) return 0;
  const std::string input(reinterpret_cast<const char*>(data), size);
  check_preload_entries(input);

  std::vector<std::string> f;
  std::size_t start = 0;
  while (true) {
    const std::size_t nul = input.find('\0', start);
    f.push_back(input.substr(start, nul == std::string::npos ? std::string::npos : nul - start));
    if (nul == std::string::npos) break;
    start = nul + 1;
  }
  f.resize(std::max<std::size_t>(f.size(), 15));
  cdi::SliceRequest req;
  std::string* const fields[] = {&req.kind,           &req.device_name,     &req.memory_limit,
                                 &req.sm_limit,       &req.sm_policy,       &req.priority,
                                 &req.container_name, &req.region_host_dir, &req.region_container_dir,
                                 &req.region_file,    &req.library_host,    &req.library_container};
  for (std::size_t i = 0; i < sizeof fields / sizeof fields[0]; ++i) {
    if (!f[i].empty()) *fields[i] = f[i];
  }
  req.inject = f[12] == "env" ? cdi::Inject::env : cdi::Inject::preload_file;
  if (!f[13].empty()) req.preload_host_file = f[13];
  req.config_host_file = f[14];
  for (std::size_t i = 15; i < f.size(); ++i) {
    const std::size_t eq = f[i].find('=');
    req.annotations[f[i].substr(0, eq)] = eq == std::string::npos ? "" : f[i].substr(eq + 1);
  }
  if (req.config_host_file == "default") req.config_host_file = cdi::default_config_host_file(req.region_host_dir);

  std::string why;
  if (!cdi::validate(req, &why)) {
    if (why.empty()) fail("refused without a message");
    return 0;
  }
  if (!why.empty()) fail("accepted with a message");
  // What validate() promises.
  std::string sub;
  if (!cdi::valid_kind(req.kind, &sub) || !cdi::valid_device_name(req.device_name, &sub)) fail("bad name accepted");
  for (const auto& [key, value] : req.annotations) {
    if (!cdi::valid_annotation_key(key, &sub)) fail("bad annotation key accepted");
  }
  if (req.region_file.empty() || req.region_file.find('/') != std::string::npos || req.region_file[0] == '.')
    fail("bad region file name accepted");
  for (const std::string* file : {&req.library_host, &req.preload_host_file, &req.config_host_file}) {
    if (file == &req.preload_host_file && req.inject != cdi::Inject::preload_file) continue;
    if (!file->empty() && covers(req.region_host_dir, *file))
      fail("a protected file lies in the directory bound read-write");
  }
  // The default configuration file lies outside the read-write directory.
  const std::string conf = cdi::default_config_host_file(req.region_host_dir);
  if (conf.empty() || covers(req.region_host_dir, conf))
    fail("the default configuration file is inside the region dir");
  // The spec: JSON that reads back as written, at a version that holds it.
  nlohmann::json spec;
  std::string text;
  try {
    spec = cdi::build_spec(req);
    text = spec.dump(2);
  } catch (const nlohmann::json::exception& e) {
    fail_with(std::string("the spec cannot be written: ") + e.what());
  }
  const nlohmann::json back = nlohmann::json::parse(text, nullptr, false);
  if (back.is_discarded() || back != spec) fail("the spec does not read back");
  const std::string version = cdi::required_version(req);
  if (version != "0.3.0" && version != "0.5.0" && version != "0.6.0") fail("unknown spec version");
  if (back["cdiVersion"] != version || back["kind"] != req.kind) fail("spec version or kind");
  for (const auto& m : back["devices"][0]["containerEdits"]["mounts"]) {
    const std::string host = m["hostPath"];
    if (host.empty() || host[0] != '/') fail("a relative host path in a mount");
  }
  for (const std::string& e : cdi::slice_environment(req)) {
    if (GPUSLICE_FUZZ_CHECK_CDI_ROUNDTRIP && e.find('\n') != std::string::npos)
      fail("an environment value holds a newline (a line of its own in the configuration file)");
  }
  if (GPUSLICE_FUZZ_CHECK_CDI_ROUNDTRIP) check_config_roundtrip(req);
  return 0;
}

namespace gpuslice::fuzz {
std::vector<std::string> seeds() {
  auto request = [](std::vector<std::string> fields) {
    std::string out;
    for (std::size_t i = 0; i < fields.size(); ++i) out += (i == 0 ? "" : std::string(1, '\0')) + fields[i];
    return out;
  };
  const std::string host = "/run/gpuslice/regions/claim-1";
  return {
      request({"", "claim-1", "8Gi", "30", "hard", "high", "trainer", host}),
      request({"", "0abc", "0=8Gi,1=4Gi", "0=30,1=50%", "elastic", "low", "", host, "/run/gpuslice", "slice.region",
               "/usr/local/gpuslice/lib/libgpuslice.so", "/usr/local/gpuslice/lib/libgpuslice.so", "env", "",
               "default"}),
      request({"example.com/gpu.slice", "claim:2", "", "", "", "", "c2", host, "", "slice.region ", "", "", "", "",
               "/etc/gpuslice/claim-2.conf", "example.com/owner=team-a", "note=x"}),
      request({"", "claim-3", "8Gi", "", "", "", "a\nGPUSLICE_MEMORY_LIMIT=64Gi", host}),
      request({"", "claim-4", "8Gi", "", "", "", "", "/var/lib"}),
      request({"", "claim-5", "8Gi", "", "", "", "", host, "/run/gpuslice", "slice.region", "", "", "", "",
               host + "/gpuslice.conf"}),
      "/usr/lib/libgpuslice.so:/x # comment\n\t/y\n",
  };
}
}  // namespace gpuslice::fuzz
