// Validation of a SliceRequest: what the CDI library accepts (names,
// annotation keys), what the preload library accepts (its own option parser
// on the environment the spec sets), and paths a container may safely get.
#include <fcntl.h>
#include <limits.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "cdi_spec.h"
#include "limiter/options/options.h"
#include "shm/region_file.h"
#include "text.h"

using namespace std::string_literals;

namespace gpuslice::cdi {
namespace {

bool is_alnum(char c) { return std::isalnum(static_cast<unsigned char>(c)) != 0; }

// Well-formed UTF-8 (nlohmann::json refuses to write anything else).
bool valid_utf8(const std::string& s) {
  std::size_t i = 0;
  while (i < s.size()) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    const std::size_t more = c < 0x80                 ? 0
                             : c >= 0xc2 && c <= 0xdf ? 1
                             : c >= 0xe0 && c <= 0xef ? 2
                             : c >= 0xf0 && c <= 0xf4 ? 3
                                                      : 9;
    if (more == 9 || i + more >= s.size()) return false;  // a bad lead byte, or cut short
    for (std::size_t k = 1; k <= more; ++k) {
      if ((static_cast<unsigned char>(s[i + k]) & 0xc0) != 0x80) return false;
    }
    i += more + 1;
  }
  return true;
}

// UTF-8 without control characters: what a mount path or a file name may hold.
bool clean_utf8(const std::string& s) {
  for (char c : s) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) return false;
  }
  return valid_utf8(s);
}

// "/a/b": absolute, no empty, "." or ".." component, no trailing '/'
// (except "/" itself). The components, or false.
bool components(const std::string& path, std::vector<std::string>* parts) {
  parts->clear();
  if (path.empty() || path[0] != '/') return false;
  if (path == "/") return true;
  std::size_t start = 1;
  while (true) {
    const std::size_t slash = path.find('/', start);
    const std::string part = path.substr(start, slash == std::string::npos ? std::string::npos : slash - start);
    if (part.empty() || part == "." || part == "..") return false;
    parts->push_back(part);
    if (slash == std::string::npos) return true;
    start = slash + 1;
  }
}

bool path_ok(const char* flag, const std::string& what, const std::string& path, std::string* why) {
  std::vector<std::string> parts;
  if (!clean_utf8(path) || !components(path, &parts)) {
    *why = flag + " '"s + tools::escape_untrusted(path) + "' (" + what +
           "): expected an absolute, normalised path (no '.', '..', '//' or trailing '/', no control characters)";
    return false;
  }
  return true;
}

// Trees of the host (or of the container's own system) that must never be
// bound read-write into a container, or shadowed in it.
bool system_tree(const std::string& top) {
  static const char* const kTrees[] = {"etc",    "usr",  "bin", "sbin", "lib", "lib32", "lib64",
                                       "libx32", "boot", "dev", "proc", "sys", "root"};
  for (const char* t : kTrees) {
    if (top == t) return true;
  }
  return false;
}

// a == b or a is a directory above b.
bool covers(const std::string& dir, const std::string& path) {
  return path == dir || (path.size() > dir.size() && path.compare(0, dir.size(), dir) == 0 && path[dir.size()] == '/');
}

bool region_dirs_ok(const SliceRequest& r, std::string* why) {
  if (!path_ok("--region-host-dir", "the region's host directory", r.region_host_dir, why) ||
      !path_ok("--region-dir", "the region directory in the container", r.region_container_dir, why)) {
    return false;
  }
  std::vector<std::string> host, ctr;
  components(r.region_host_dir, &host);
  components(r.region_container_dir, &ctr);
  // Bound read-write: the container can create, replace and delete anything
  // below it. Only a directory of its own is safe: never the root, a
  // top-level directory (/etc, /run, /var, /tmp, /home, ... are shared by the
  // whole host) or anything inside the system trees.
  if (host.size() < 2 || system_tree(host[0])) {
    *why = "--region-host-dir '" + r.region_host_dir +
           "': bound read-write into the container, so it must be a directory of this slice alone "
           "(e.g. /run/gpuslice/regions/<claim-uid>), not '/', a top-level directory or inside /etc, /usr, "
           "/bin, /sbin, /lib*, /boot, /dev, /proc, /sys or /root";
    return false;
  }
  if (ctr.empty() || system_tree(ctr[0])) {
    *why = "--region-dir '" + r.region_container_dir +
           "': would hide the container's own system files; expected a directory of its own (e.g. /run/gpuslice)";
    return false;
  }
  // Nothing the container must not change may live in what it can write.
  const std::pair<const char*, const std::string*> protected_files[] = {{"--library-host", &r.library_host},
                                                                        {"--preload-host-file", &r.preload_host_file},
                                                                        {"--config-host-file", &r.config_host_file}};
  for (const auto& [flag, file] : protected_files) {
    if (file->empty() || (flag == "--preload-host-file"s && r.inject != Inject::preload_file)) continue;
    if (covers(r.region_host_dir, *file)) {
      *why = "--region-host-dir '" + r.region_host_dir + "' holds " + flag + " '" + *file +
             "': the container could rewrite it through its read-write region mount; expected it outside";
      return false;
    }
  }
  // A directory of its own right below the agent's: never the agent's
  // directory itself (it holds every slice's directory), nothing deeper (a
  // directory inside another slice's), nothing elsewhere (/var/lib, ...).
  if (!path_ok("--agent-region-dir", "the agent's --region-dir", r.agent_region_dir, why)) return false;
  const std::size_t slash = r.region_host_dir.find_last_of('/');
  const std::string parent = r.region_host_dir.substr(0, slash == 0 ? 1 : slash);
  const std::string own = r.region_host_dir.substr(slash + 1);
  if (parent != r.agent_region_dir) {
    *why = "--region-host-dir '" + r.region_host_dir + "': bound read-write into the container, so it must be " +
           "a directory of this slice alone right below the agent's region directory, expected " + r.agent_region_dir +
           "/<name> (--agent-region-dir gives the agent's --region-dir)";
    return false;
  }
  std::string problem;
  if (!tools::valid_name(own, kMaxFileNameBytes, "its name", &problem) || own[0] == '.') {
    *why = "--region-host-dir '" + r.region_host_dir + "': " +
           (problem.empty() ? "its name is hidden (the agent skips hidden entries), expected a plain name"s : problem);
    return false;
  }
  if (!tools::valid_name(r.region_file, kMaxFileNameBytes, "--region-file (region file)", why)) return false;
  if (r.region_file[0] == '.') {
    *why = "--region-file '" + r.region_file +
           "' (region file): hidden (the agent skips hidden files), expected a "
           "plain file name";
    return false;
  }
  if (!r.container_name.empty() &&
      !tools::valid_name(r.container_name, kMaxContainerNameBytes, "--container-name (container name)", why)) {
    return false;
  }
  return true;
}

// The flag that sets a variable of the spec's environment, for messages.
std::string flag_of(const std::string& text) {
  static const struct {
    const char* var;
    const char* flag;
  } kFlags[] = {{"GPUSLICE_MEMORY_LIMIT", "--memory (memory limit)"},
                {"GPUSLICE_SM_LIMIT", "--sm-limit (SM limit)"},
                {"GPUSLICE_SM_POLICY", "--sm-policy (SM policy)"},
                {"GPUSLICE_PRIORITY", "--priority (priority)"},
                {"GPUSLICE_REGION", "--region-dir/--region-file (region file)"},
                {"GPUSLICE_CONTAINER_NAME", "--container-name (container name)"}};
  for (const auto& f : kFlags) {
    if (text.find(f.var + "="s) != std::string::npos) return f.flag;
  }
  return "a value";
}

// The library's own option parser on the environment the spec sets: any
// value it would refuse at the container's first CUDA call is refused here.
// Each value must also read back the same from the configuration file, which
// drops the blanks at either end of a line, its name and its value
// (limiter/options/file.h): "slice.region " would otherwise name one region
// in the environment and another in the file.
bool options_ok(const SliceRequest& r, std::string* why) {
  std::vector<std::string> env = slice_environment(r);
  for (const std::string& e : env) {
    const std::string value = e.substr(e.find('=') + 1);
    const auto blank = [](char c) { return c == ' ' || c == '\t' || c == '\r'; };
    bool control = false;
    for (char c : value) control = control || static_cast<unsigned char>(c) < 0x20 || c == 0x7f;
    if (!value.empty() && (blank(value.front()) || blank(value.back()) || control)) {
      *why = flag_of(e) + ": '" + tools::escape_untrusted(value) +
             "' has a blank at an end or a control character: the configuration file would read another value "
             "than the environment; expected none";
      return false;
    }
  }
  std::vector<char*> envp;
  for (std::string& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  options::Options opts;
  shm::Error err{};
  if (options::parse_options(envp.data(), &opts, &err)) return true;
  *why = flag_of(err.message) + ": the library would refuse it: " + err.message;
  return false;
}

bool annotations_ok(const SliceRequest& r, std::string* why) {
  std::size_t total = 0;
  for (const auto& [key, value] : r.annotations) {
    if (!valid_annotation_key(key, why)) return false;
    if (!valid_utf8(value)) {
      *why = "--annotation '" + key + "': the value must be UTF-8 text";
      return false;
    }
    total += key.size() + value.size();
  }
  if (total > 256 * 1024) {  // Kubernetes' TotalAnnotationSizeLimitB, which the CDI library applies
    *why = "--annotation: keys and values together hold " + std::to_string(total) + " bytes, expected at most 262144";
    return false;
  }
  return true;
}

// Reads a host file gpuslice-cdi (root) is told to trust: opened without
// blocking or following a final symbolic link (a FIFO must not hang it),
// regular (a device would never end), at most max_bytes. false + why.
bool read_host_file(const std::string& path, std::size_t max_bytes, std::string* text, std::string* why) {
  const int fd = open(path.c_str(), O_RDONLY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC | O_NOCTTY);
  if (fd < 0) {
    *why = std::strerror(errno);
    return false;
  }
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    close(fd);
    *why = "not a regular file";
    return false;
  }
  text->assign(max_bytes + 1, '\0');
  std::size_t got = 0;
  while (got <= max_bytes) {
    const ssize_t n = read(fd, text->data() + got, max_bytes + 1 - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    got += static_cast<std::size_t>(n);
  }
  close(fd);
  text->resize(got);
  if (got > max_bytes) {
    *why = "larger than " + std::to_string(max_bytes) + " bytes";
    return false;
  }
  return true;
}

// An existing configuration file is replaced only if it is this device's:
// never another slice's (its limits would change under it) nor any other
// file (gpuslice-cdi runs as root).
bool config_file_ours(const SliceRequest& r, std::string* why) {
  struct stat st {};
  if (lstat(r.config_host_file.c_str(), &st) != 0) return true;  // a new file
  const std::string header = config_file_header(r);
  std::string text, problem;
  read_host_file(r.config_host_file, 64 * 1024, &text, &problem);
  const std::string first = text.substr(0, text.find('\n'));
  if (text.rfind(header, 0) == 0) return true;
  const std::string prefix = "# gpuslice configuration of CDI device ";
  const std::string other =
      first.rfind(prefix, 0) == 0 ? first.substr(prefix.size(), first.find(", ") - prefix.size()) : "";
  *why = "--config-host-file '" + r.config_host_file + "' exists and is " +
         (other.empty() ? "not a configuration file gpuslice-cdi wrote"s
                        : "the configuration file of " + tools::escape_untrusted(other)) +
         " (--region-host-dir '" + r.region_host_dir +
         "' belongs to another slice?); expected a directory and "
         "configuration file of " +
         qualified_name(r) + " alone";
  return false;
}

}  // namespace

bool valid_annotation_key(const std::string& key, std::string* why) {
  std::string k = key;
  for (char& c : k) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  auto fail = [&](const std::string& what) {
    *why = "--annotation key '" + tools::escape_untrusted(key) + "': " + what +
           " (expected [<DNS subdomain>/]<name>, the name 1-63 letters, digits, '-', '_' or '.' starting and ending "
           "with a letter or digit: the CDI library refuses the spec otherwise)";
    return false;
  };
  std::string prefix, name = k;
  const std::size_t slash = k.find('/');
  if (slash != std::string::npos) {
    if (k.find('/', slash + 1) != std::string::npos) return fail("more than one '/'");
    prefix = k.substr(0, slash);
    name = k.substr(slash + 1);
    if (prefix.empty()) return fail("empty prefix");
    if (prefix.size() > 253) return fail("prefix longer than 253 characters");
    // DNS-1123 subdomain: labels [a-z0-9]([-a-z0-9]*[a-z0-9])? joined by '.'.
    std::size_t start = 0;
    while (true) {
      const std::size_t dot = prefix.find('.', start);
      const std::string label = prefix.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
      if (label.empty() || label.front() == '-' || label.back() == '-') return fail("prefix is not a DNS subdomain");
      for (char c : label) {
        if (!(std::islower(static_cast<unsigned char>(c)) || std::isdigit(static_cast<unsigned char>(c)) || c == '-')) {
          return fail("prefix is not a DNS subdomain");
        }
      }
      if (dot == std::string::npos) break;
      start = dot + 1;
    }
  }
  if (name.empty()) return fail("empty name");
  if (name.size() > 63) return fail("name longer than 63 characters");
  if (!is_alnum(name.front()) || !is_alnum(name.back())) return fail("name must start and end with a letter or digit");
  for (char c : name) {
    if (!is_alnum(c) && c != '-' && c != '_' && c != '.') return fail("name holds '"s + c + "'");
  }
  return true;
}

bool driver_limit_mib(const SliceRequest& r, std::uint64_t* mib, std::string* why) {
  if (r.memory_limit.empty()) {
    *why = "--driver-memory-limit: expected --memory too (the quota the driver's limit carries)";
    return false;
  }
  std::string env = "GPUSLICE_MEMORY_LIMIT=" + r.memory_limit;
  char* envp[] = {env.data(), nullptr};
  options::Options opts;
  shm::Error err{};
  if (!options::parse_options(envp, &opts, &err)) {
    *why = "--memory (memory limit): the library would refuse it: "s + err.message;
    return false;
  }
  std::uint64_t quota = kUnlimited;
  for (std::uint64_t v : opts.memory_limit) {
    if (v == kUnlimited) continue;
    if (quota != kUnlimited && v != quota) {
      *why =
          "--driver-memory-limit: the per-device quotas of --memory differ; NVIDIA's hook applies one "
          "NVIDIA_GPU_MEMORY_LIMIT to every GPU: expected one quota for all";
      return false;
    }
    quota = v;
  }
  if (quota == kUnlimited) {
    *why = "--driver-memory-limit: --memory sets no quota; expected one";
    return false;
  }
  *mib = (quota + (std::uint64_t{1} << 20) - 1) >> 20;  // up: gpuslice refuses first
  return true;
}

namespace {

bool driver_limit_ok(const SliceRequest& r, std::string* why) {
  if (r.driver_limit_gpus.empty()) return true;
  for (const std::string& uuid : r.driver_limit_gpus) {
    bool ok = uuid.size() > 4 && uuid.size() <= 96 && uuid.rfind("GPU-", 0) == 0;
    for (char c : uuid) ok = ok && (is_alnum(c) || c == '-');
    if (!ok) {
      *why = "--driver-memory-limit: '" + tools::escape_untrusted(uuid) +
             "': expected GPU UUIDs as NVML prints them (GPU-xxxxxxxx-...), comma-separated";
      return false;
    }
  }
  std::uint64_t mib = 0;
  return path_ok("--nvidia-cdi-hook", "the nvidia-cdi-hook path", r.cdi_hook, why) && driver_limit_mib(r, &mib, why);
}

}  // namespace

bool validate(const SliceRequest& r, std::string* why) {
  if (!valid_kind(r.kind, why) || !valid_device_name(r.device_name, why)) {
    *why = (why->find("kind") != std::string::npos ? "--kind: "s : "--name: "s) + *why;
    return false;
  }
  if (!path_ok("--library-host", "library host path", r.library_host, why) ||
      !path_ok("--library", "library container path", r.library_container, why)) {
    return false;
  }
  if (r.inject == Inject::preload_file &&
      !path_ok("--preload-host-file", "the ld.so.preload host file", r.preload_host_file, why)) {
    return false;
  }
  if (!region_dirs_ok(r, why)) return false;
  if (!r.config_host_file.empty() &&
      !path_ok("--config-host-file", "the slice's configuration file", r.config_host_file, why)) {
    return false;
  }
  return annotations_ok(r, why) && options_ok(r, why) && driver_limit_ok(r, why);
}

std::vector<std::string> preload_entries(const std::string& text) {
  // glibc elf/rtld.c: '#' starts a comment to the end of the line; entries
  // are separated by " \t\n:".
  std::vector<std::string> out;
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    line = line.substr(0, line.find('#'));
    std::size_t i = 0;
    while (i < line.size()) {
      const std::size_t start = line.find_first_not_of(" \t\r:", i);
      if (start == std::string::npos) break;
      const std::size_t end = line.find_first_of(" \t\r:", start);
      out.push_back(line.substr(start, end == std::string::npos ? std::string::npos : end - start));
      i = end == std::string::npos ? line.size() : end;
    }
  }
  return out;
}

bool check_host(const SliceRequest& r, std::string* why) {
  struct stat st {};
  if (stat(r.region_host_dir.c_str(), &st) != 0) {
    *why = "--region-host-dir '" + r.region_host_dir +
           "': " + (errno == ENOENT ? "no such directory"s : std::string(std::strerror(errno))) +
           " (expected the slice's directory, created before the spec: the runtime cannot bind a missing one)";
    return false;
  }
  if (!S_ISDIR(st.st_mode)) {
    *why = "--region-host-dir '" + r.region_host_dir + "': not a directory, expected the slice's directory";
    return false;
  }
  char resolved[PATH_MAX];
  if (realpath(r.region_host_dir.c_str(), resolved) == nullptr) {
    *why = "--region-host-dir '" + r.region_host_dir + "': cannot resolve it: " + std::strerror(errno);
    return false;
  }
  if (r.region_host_dir != resolved) {
    *why = "--region-host-dir '" + r.region_host_dir + "' resolves to '" + resolved +
           "' through a symbolic link: the runtime would bind that instead; expected the real path";
    return false;
  }
  if (stat(r.library_host.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) {
    *why = "--library-host '" + r.library_host + "': no such file (expected libgpuslice.so on the host)";
    return false;
  }
  if (!r.config_host_file.empty()) {
    const std::string parent = r.config_host_file.substr(0, r.config_host_file.find_last_of('/') + 1);
    if (stat(parent.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
      *why = "--config-host-file '" + r.config_host_file + "': its directory does not exist";
      return false;
    }
    if (!config_file_ours(r, why)) return false;
  }
  if (r.inject != Inject::preload_file) return true;
  std::string text, problem;
  if (!read_host_file(r.preload_host_file, 64 * 1024, &text, &problem)) {
    *why = "--preload-host-file '" + r.preload_host_file + "': cannot read it (" + problem +
           "); expected the file naming the library, mounted at /etc/ld.so.preload (--inject env does without)";
    return false;
  }
  const std::vector<std::string> entries = preload_entries(text);
  for (const std::string& e : entries) {
    if (e == r.library_container) return true;
  }
  std::string named;
  for (const std::string& e : entries) named += (named.empty() ? "'" : ", '") + tools::escape_untrusted(e) + "'";
  *why = "--library '" + r.library_container + "' is not what --preload-host-file '" + r.preload_host_file +
         "' names (" + (named.empty() ? "nothing"s : named) +
         "): ld.so would ignore the preload and the container would run unlimited; expected the same path in both";
  return false;
}

}  // namespace gpuslice::cdi
