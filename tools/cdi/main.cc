// gpuslice-cdi: prints (or writes) the CDI spec that injects gpuslice into a
// container with the given limits. See cdi_spec.h and docs/deploy.md.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <exception>
#include <optional>
#include <string>

#include "cdi_spec.h"
#include "cli.h"
#include "text.h"

using namespace std::string_literals;
using gpuslice::tools::usage_error;

namespace {

// Write then rename: a runtime watching the CDI directory never reads half a file.
// The temporary name is hidden and ends in neither .json nor .yaml, so that
// neither a runtime's CDI cache nor the agent ever reads it.
bool write_atomically(const std::string& path, const std::string& text, std::string* why) {
  const std::size_t slash = path.find_last_of('/');
  const std::string dir = slash == std::string::npos ? "" : path.substr(0, slash + 1);
  const std::string base = slash == std::string::npos ? path : path.substr(slash + 1);
  const std::string tmp = dir + "." + base + ".tmp." + std::to_string(getpid());
  unlink(tmp.c_str());  // a leftover of a killed run; O_EXCL: never through a planted link
  const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd < 0) {
    *why = tmp + ": " + std::strerror(errno);
    return false;
  }
  std::size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = write(fd, text.data() + done, text.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      *why = tmp + ": " + std::strerror(errno);
      close(fd);
      unlink(tmp.c_str());
      return false;
    }
    done += static_cast<std::size_t>(n);
  }
  if (fsync(fd) != 0 || close(fd) != 0 || rename(tmp.c_str(), path.c_str()) != 0) {
    *why = path + ": " + std::strerror(errno);
    unlink(tmp.c_str());
    return false;
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  gpuslice::cdi::SliceRequest req;
  std::string inject = "ld.so.preload", output, config_file;
  bool no_config_file = false;
  std::vector<std::string> annotations;
  CLI::App app{
      "gpuslice-cdi: emits a CDI spec (JSON, the lowest cdiVersion its content needs: 0.3.0, 0.5.0 or "
      "0.6.0) whose device injects gpuslice with the given limits: environment, library, region "
      "directory, the slice's configuration file and /etc/ld.so.preload; writes that configuration file.",
      "gpuslice-cdi"};
  gpuslice::tools::add_version_flag(app);
  app.add_option("--name", req.device_name, "CDI device name (e.g. the ResourceClaim's UID)")->required();
  app.add_option("--kind", req.kind, "CDI kind <vendor>/<class>")->capture_default_str();
  app.add_option("--memory", req.memory_limit, "Device-memory quota: 8Gi, or per device 0=8Gi,1=4Gi");
  app.add_option("--sm-limit", req.sm_limit, "Compute share 1-100, or per device 0=30,1=50");
  app.add_option("--sm-policy", req.sm_policy, "hard | elastic");
  app.add_option("--priority", req.priority, "high | normal | low");
  app.add_option("--container-name", req.container_name,
                 "Name shown in metrics (1-63 printable ASCII characters but '/' and '\\', no blank at either end)");
  app.add_option("--region-host-dir", req.region_host_dir,
                 "Host directory of the region: a directory of this slice alone, right below "
                 "--agent-region-dir (e.g. /run/gpuslice/regions/<uid>)")
      ->required();
  app.add_option("--agent-region-dir", req.agent_region_dir, "The node agent's --region-dir")->capture_default_str();
  app.add_option("--region-dir", req.region_container_dir, "Where the container sees it")->capture_default_str();
  app.add_option("--region-file", req.region_file,
                 "The region's file name (printable ASCII but '/' and '\\', not hidden, no blank at either end)")
      ->capture_default_str();
  app.add_option("--library-host", req.library_host, "libgpuslice.so on the host")->capture_default_str();
  app.add_option("--library", req.library_container, "Its path in the container")->capture_default_str();
  app.add_option("--inject", inject,
                 "ld.so.preload (mount a preload file; survives a cleared environment) | env "
                 "(LD_PRELOAD)")
      ->capture_default_str();
  app.add_option("--preload-host-file", req.preload_host_file,
                 "Host file naming the library (one line), mounted at /etc/ld.so.preload")
      ->capture_default_str();
  app.add_option("--config-host-file", config_file,
                 "The slice's configuration file to write on the host, mounted read-only at "
                 "/etc/gpuslice/gpuslice.conf (default: <parent of --region-host-dir>/.<its name>.conf)");
  app.add_flag("--no-config-file", no_config_file,
               "Write and mount no configuration file (a process that clears its environment is then unlimited)");
  app.add_option("--annotation", annotations, "key=value added to the spec's annotations (repeatable)");
  std::string driver_limit;
  app.add_option("--driver-memory-limit", driver_limit,
                 "GPU UUIDs (comma-separated) the container gets: also set the driver's per-cgroup memory limit "
                 "(R615+) to the quota through NVIDIA's container toolkit (NVIDIA_GPU_MEMORY_LIMIT and its "
                 "apply-cuda-memory-limits hook), for nodes where gpuslice-agent does not set it");
  app.add_option("--nvidia-cdi-hook", req.cdi_hook, "nvidia-cdi-hook on the host")->capture_default_str();
  app.add_option("--output", output,
                 "Write the spec here (atomically) instead of stdout, e.g. /var/run/cdi/gpuslice-<name>.json");
  if (const std::optional<int> stop = gpuslice::tools::parse(app, argc, argv)) return *stop;
  if (inject == "ld.so.preload") {
    req.inject = gpuslice::cdi::Inject::preload_file;
  } else if (inject == "env") {
    req.inject = gpuslice::cdi::Inject::env;
  } else {
    return usage_error(app,
                       "--inject '"s + gpuslice::tools::escape_untrusted(inject) + "': expected ld.so.preload or env");
  }
  for (const std::string& a : annotations) {
    const std::size_t eq = a.find('=');
    if (eq == std::string::npos || eq == 0)
      return usage_error(app, "--annotation '"s + gpuslice::tools::escape_untrusted(a) + "': expected key=value");
    if (!req.annotations.emplace(a.substr(0, eq), a.substr(eq + 1)).second) {
      return usage_error(app, "--annotation '"s + gpuslice::tools::escape_untrusted(a) + "': the key '" +
                                  gpuslice::tools::escape_untrusted(a.substr(0, eq)) +
                                  "' is given twice; expected each key once");
    }
  }
  for (std::size_t start = 0; !driver_limit.empty() && start <= driver_limit.size();) {
    const std::size_t comma = std::min(driver_limit.find(',', start), driver_limit.size());
    req.driver_limit_gpus.push_back(driver_limit.substr(start, comma - start));
    start = comma + 1;
  }
  if (no_config_file && !config_file.empty()) {
    return usage_error(app, "--no-config-file and --config-host-file: expected one of them");
  }
  if (!no_config_file) {
    req.config_host_file =
        config_file.empty() ? gpuslice::cdi::default_config_host_file(req.region_host_dir) : config_file;
  }
  std::string why;
  if (!gpuslice::cdi::validate(req, &why) || !gpuslice::cdi::check_host(req, &why)) return usage_error(app, why);
  std::string text;
  try {
    text = gpuslice::cdi::build_spec(req).dump(2) + "\n";
  } catch (const std::exception& e) {  // a string that is not UTF-8 slipped through
    return usage_error(app, "cannot write the spec as JSON: "s + e.what());
  }
  // The configuration file first: the spec never names a file that is not there.
  if (!req.config_host_file.empty() &&
      !write_atomically(req.config_host_file, gpuslice::cdi::config_file_text(req), &why)) {
    std::fprintf(stderr, "gpuslice-cdi: cannot write the configuration file: %s\n", why.c_str());
    return 1;
  }
  if (output.empty()) {
    std::fputs(text.c_str(), stdout);
    return 0;
  }
  if (!write_atomically(output, text, &why)) {
    std::fprintf(stderr, "gpuslice-cdi: cannot write the spec: %s\n", why.c_str());
    return 1;
  }
  std::printf("%s\n", gpuslice::cdi::qualified_name(req).c_str());
  return 0;
}
