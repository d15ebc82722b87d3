#include "podman_world.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

namespace fs = std::filesystem;
using gpuslice::test::Result;
using namespace std::string_literals;

namespace gpuslice::container_test {
namespace {

constexpr char kCdiDir[] = "/var/run/cdi";  // podman 4.3 has no --cdi-spec-dir: /etc/cdi and this one
constexpr unsigned long long kMi = 1ull << 20;

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string which(const std::string& name) {
  for (const char* d : {"/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"}) {
    const std::string p = d + "/"s + name;
    if (access(p.c_str(), X_OK) == 0) return p;
  }
  return "";
}

// The shared libraries ldd lists for `file` (absolute paths), loader included.
bool libraries(const std::string& file, std::set<std::string>* out, std::string* why) {
  const Result r = gpuslice::test::run({which("ldd"), file}, {}, 30000);
  if (r.exit_code != 0) {
    *why = "ldd " + file + ": " + r.describe();
    return false;
  }
  std::istringstream lines(r.out);
  std::string line;
  while (std::getline(lines, line)) {
    const std::size_t arrow = line.find("=> ");
    std::string path = arrow != std::string::npos ? line.substr(arrow + 3) : line;
    path = path.substr(path.find_first_not_of(" \t"));
    path = path.substr(0, path.find(' '));
    if (!path.empty() && path[0] == '/') out->insert(path);
  }
  return true;
}

bool copy_into(const std::string& from, const std::string& root, const std::string& to, mode_t mode) {
  std::error_code ec;
  fs::create_directories(fs::path(root + to).parent_path(), ec);
  fs::copy_file(fs::canonical(from, ec), root + to, fs::copy_options::overwrite_existing, ec);
  if (ec) return false;
  return chmod((root + to).c_str(), mode) == 0;
}

}  // namespace

bool World::library_reads_config_file() {
  return slurp(gpuslice::test::preload_library()).find("/etc/gpuslice/gpuslice.conf") != std::string::npos;
}

World::World(Image image) : kind_(image) {
  if (!setup()) cleanup();
}

World::~World() { cleanup(); }

std::string World::podman_version() const {
  const Result r = podman({"version", "--format", "{{.Client.Version}}"}, 60000);
  return r.exit_code == 0 ? r.out.substr(0, r.out.find('\n')) : "";
}

Result World::podman(std::vector<std::string> args, int timeout_ms) const {
  std::vector<std::string> argv = podman_;
  argv.insert(argv.end(), args.begin(), args.end());
  return gpuslice::test::run(argv, {}, timeout_ms);
}

std::vector<std::string> World::run_argv(const std::vector<std::string>& devices,
                                         const std::vector<std::string>& cmd) const {
  std::vector<std::string> argv = podman_;
  // runc (crun fails on this hybrid cgroup layout); a private cgroup parent;
  // rlimits below the host's (podman's defaults exceed what root may set here,
  // and raising one needs CAP_SYS_RESOURCE); no network.
  for (const std::string& arg : {"run"s, "--rm"s, "--network"s, "none"s, "--cgroup-parent"s, cgroup_parent_,
                                 "--ulimit"s, "nofile=1024:1024"s, "--ulimit"s, "nproc=1024:1024"s}) {
    argv.push_back(arg);
  }
#if defined(__SANITIZE_ADDRESS__)
  // A sanitized build's programs and library in the container: the preload
  // library comes before libasan (as test/harness allows on the host).
  argv.push_back("--env");
  argv.push_back(kAsanOptions);
#endif
  for (const std::string& d : devices) {
    argv.push_back("--device");
    argv.push_back(d);
  }
  argv.push_back(image_);
  argv.insert(argv.end(), cmd.begin(), cmd.end());
  return argv;
}

Result World::run(const std::vector<std::string>& devices, const std::vector<std::string>& cmd, int timeout_ms) const {
  return gpuslice::test::run(run_argv(devices, cmd), {}, timeout_ms);
}

bool World::setup() {
  if (geteuid() != 0) {
    skip = "rootful podman needs root (this test runs containers with runc as root)";
    return false;
  }
  const std::string podman_bin = which("podman"), runc = which("runc");
  if (podman_bin.empty() || runc.empty()) {
    skip = "podman or runc not installed (tools/setup.sh installs both from Debian)";
    return false;
  }
  char tmpl[] = "/tmp/gpuslice-ctr-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) {
    error = "mkdtemp failed";
    return false;
  }
  dir = tmpl;
  const std::string tag = std::to_string(getpid());
  cgroup_parent_ = "/gpuslice-test-" + tag;
  image_ = (kind_ == Image::local ? "localhost/gpuslice-test:" : "localhost/gpuslice-test-bullseye:") + tag;
  // overlay first (containers share the image's files), then vfs (works on
  // any file system, copying the image for every container).
  std::vector<std::string> drivers = {"overlay", "vfs"};
  if (const char* d = std::getenv("GPUSLICE_PODMAN_STORAGE"); d != nullptr && *d != '\0') drivers = {d};
  std::string failures;
  bool ran = false;
  for (const std::string& driver : drivers) {
    skip.clear();
    podman_ = {podman_bin,
               "--root",
               dir + "/storage-" + driver,
               "--runroot",
               dir + "/run-" + driver,
               "--tmpdir",
               dir + "/tmp",
               "--storage-driver",
               driver,
               "--runtime",
               runc,
               "--cgroup-manager",
               "cgroupfs",
               "--events-backend",
               "none"};
    fs::create_directories(dir + "/tmp");
    if (!build_image()) {
      if (!error.empty()) return false;
      failures += "\n  " + driver + ": " + skip;
      continue;
    }
    // Can the runtime run anything at all? Otherwise skip, saying why.
    const Result probe = run({}, {"/bin/true"}, 120000);
    if (probe.exit_code == 0) {
      ran = true;
      break;
    }
    failures += "\n  " + driver + ": podman cannot run a container: " + probe.describe();
    podman({"rmi", "--all", "--force"}, 120000);
  }
  if (!ran) {
    skip = "podman cannot run a container here (storage drivers tried, and why):" + failures;
    return false;
  }
  skip.clear();
  return write_specs();
}

bool World::build_local_root(const std::string& root) {
  std::set<std::string> libs;
  const std::vector<std::string> elves = {gpuslice::test::bin("cuprobe_dl"), gpuslice::test::preload_library(),
                                          gpuslice::test::fakecuda_dir() + "/libcuda.so.1",
                                          gpuslice::test::fakecuda_dir() + "/libnvidia-ml.so.1"};
  for (const std::string& e : elves) {
    if (!libraries(e, &libs, &error)) return false;
  }
  for (const std::string& l : libs) {
    if (l.find("fakecuda") != std::string::npos) continue;  // the vendor device brings the driver
    // The loader under its absolute name, the others in the multiarch directory.
    const std::string to =
        l.find("ld-linux") != std::string::npos ? l : "/lib/x86_64-linux-gnu/" + fs::path(l).filename().string();
    if (!copy_into(l, root, to, 0755)) {
      error = "cannot copy " + l + " into the image";
      return false;
    }
  }
  const std::string busybox = which("busybox");
  if (busybox.empty() || !copy_into(busybox, root, "/bin/busybox", 0755) ||
      !copy_into(gpuslice::test::bin("cuprobe_dl"), root, "/usr/bin/cuprobe", 0755)) {
    error = "cannot copy busybox (busybox-static) or cuprobe_dl into the image";
    return false;
  }
  for (const char* applet : {"sh", "env", "cat", "true", "test", "echo", "sleep", "ls"}) {
    fs::create_symlink("busybox", root + "/bin/" + applet);
  }
  for (const char* d : {"/etc", "/proc", "/sys", "/dev", "/tmp", "/run", "/usr/lib/x86_64-linux-gnu"}) {
    fs::create_directories(root + d);
  }
  return true;
}

bool World::bullseye_root(std::string* root) {
  if (const char* given = std::getenv("GPUSLICE_BULLSEYE_ROOT"); given != nullptr && *given != '\0') {
    *root = given;
    if (!fs::exists(*root + "/usr/bin/python3")) {
      error = "GPUSLICE_BULLSEYE_ROOT=" + *root + ": no usr/bin/python3 there, expected a bullseye root";
      return false;
    }
    return true;
  }
  const std::string maker = GPUSLICE_SOURCE_DIR "/test/deploy/bullseye_rootfs.sh";
  if (access(maker.c_str(), X_OK) != 0) {
    skip =
        "no bullseye root: " + maker + " (which makes one) is not in this tree, and GPUSLICE_BULLSEYE_ROOT names none";
    return false;
  }
  const Result made = gpuslice::test::run({maker, gpuslice::test::build_dir() + "/bullseye-root"}, {}, 900000);
  if (made.exit_code == 77 || made.timed_out) {
    skip = "no bullseye root could be made: " + made.err;
    return false;
  }
  if (made.exit_code != 0) {
    error = "bullseye_rootfs.sh: " + made.describe();
    return false;
  }
  *root = made.out.substr(0, made.out.find('\n'));
  return true;
}

bool World::build_image() {
  const std::string tar = dir + "/image.tar";
  std::string root = dir + "/rootfs";
  if (kind_ == Image::local) {
    if (!build_local_root(root)) return false;
  } else if (!bullseye_root(&root)) {
    return false;
  }
  // The root's files, as root-owned files of the image; of a bullseye root,
  // less what no program in it reads (documentation, translations, apt's
  // package lists: ~95 of its ~200 MB, half of what podman import copies).
  std::vector<std::string> tar_argv = {which("tar"), "--numeric-owner", "-C", root};
  if (kind_ == Image::bullseye) {
    for (const char* unread :
         {"./usr/share/doc", "./usr/share/man", "./usr/share/info", "./usr/share/locale", "./var/lib/apt/lists"}) {
      tar_argv.push_back("--exclude="s + unread);
    }
  }
  tar_argv.insert(tar_argv.end(), {"-cf", tar, "."});
  const Result t = gpuslice::test::run(tar_argv, {}, 300000);
  if (t.exit_code != 0) {
    error = "tar: " + t.describe();
    return false;
  }
  if (kind_ == Image::bullseye) {  // plus the probe, without writing into the (cached) root
    const std::string extra = dir + "/extra";
    if (!copy_into(GPUSLICE_SOURCE_DIR "/test/container/cuda_probe.py", extra, "/usr/local/bin/cuda_probe.py", 0755)) {
      error = "cannot stage cuda_probe.py";
      return false;
    }
    const Result add = gpuslice::test::run({which("tar"), "--numeric-owner", "--owner=0", "--group=0", "-C", extra,
                                            "-rf", tar, "./usr/local/bin/cuda_probe.py"},
                                           {}, 60000);
    if (add.exit_code != 0) {
      error = "tar: " + add.describe();
      return false;
    }
  }
  const Result imp = podman({"import", tar, image_}, 300000);
  if (imp.exit_code != 0) {
    skip = "podman import failed (no usable container storage here): " + imp.describe();
    return false;
  }
  std::error_code ec;
  if (kind_ == Image::local) fs::remove_all(root, ec);
  fs::remove(tar, ec);
  return true;
}

bool World::write_specs() {
  using nlohmann::json;
  const std::string tag = "t" + std::to_string(getpid());
  if (!fs::exists(kCdiDir)) {
    fs::create_directories(kCdiDir);
    made_cdi_dir_ = true;
  }
  // The GPU vendor's device: the simulated driver and its state, mounted the
  // way the NVIDIA container toolkit's CDI spec mounts libcuda.so.1 and the
  // device nodes. The state also at the driver's default path, as device
  // nodes need no environment.
  state_file = dir + "/fakecuda/fakecuda.state";
  fs::create_directories(dir + "/fakecuda");
  const Result init =
      gpuslice::test::run({gpuslice::test::bin("cuprobe"), "init"},
                          {{"FAKECUDA_STATE", state_file}, {"LD_LIBRARY_PATH", gpuslice::test::fakecuda_dir()}}, 30000);
  if (init.exit_code != 0 || !fs::exists(state_file)) {
    error = "cannot create the simulated GPU's state: " + init.describe();
    return false;
  }
  const json ro = json::array({"ro", "nosuid", "nodev", "bind"});
  const json rw = json::array({"rw", "nosuid", "nodev", "bind"});
  const json vendor = {
      {"cdiVersion", "0.5.0"},
      {"kind", "fakecuda.example/gpu"},
      {"devices",
       {{{"name", tag},
         {"containerEdits",
          {{"env", {"FAKECUDA_STATE=/run/fakecuda/fakecuda.state"}},
           {"mounts",
            {{{"hostPath", gpuslice::test::fakecuda_dir() + "/libcuda.so.1"},
              {"containerPath", "/usr/lib/x86_64-linux-gnu/libcuda.so.1"},
              {"options", ro}},
             {{"hostPath", gpuslice::test::fakecuda_dir() + "/libnvidia-ml.so.1"},
              {"containerPath", "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"},
              {"options", ro}},
             {{"hostPath", dir + "/fakecuda"}, {"containerPath", "/run/fakecuda"}, {"options", rw}},
             {{"hostPath", state_file}, {"containerPath", "/dev/shm/fakecuda-0.state"}, {"options", rw}}}}}}}}}};
  const std::string vendor_file = kCdiDir + "/gpuslice-test-"s + tag + "-vendor.json";
  std::ofstream(vendor_file) << vendor.dump(2);
  spec_files_.push_back(vendor_file);
  vendor_device = "fakecuda.example/gpu=" + tag;

  // gpuslice's slices, from gpuslice-cdi: a by /etc/ld.so.preload, b by LD_PRELOAD.
  regions = dir + "/regions";
  fs::create_directories(dir + "/lib");
  const std::string preload = dir + "/lib/ld.so.preload";
  std::ofstream(preload) << "/usr/local/gpuslice/lib/libgpuslice.so\n";
  a = {tag + "-a", "", regions + "/a", "ctr-a", 256 * kMi};
  b = {tag + "-b", "", regions + "/b", "ctr-b", 128 * kMi};
  for (Slice* s : {&a, &b}) {
    fs::create_directories(s->region_dir);
    chmod(s->region_dir.c_str(), 01777);
    const std::string out = kCdiDir + "/gpuslice-test-"s + s->name + ".json";
    std::vector<std::string> argv = {gpuslice::test::bin("gpuslice-cdi"),
                                     "--name",
                                     s->name,
                                     "--memory",
                                     std::to_string(s->quota),
                                     "--container-name",
                                     s->container,
                                     "--region-host-dir",
                                     s->region_dir,
                                     "--agent-region-dir",
                                     regions,
                                     "--library-host",
                                     gpuslice::test::preload_library(),
                                     "--output",
                                     out};
    if (s == &a) {
      argv.insert(argv.end(), {"--preload-host-file", preload});
    } else {
      argv.insert(argv.end(), {"--inject", "env"});
    }
    const Result r = gpuslice::test::run(argv, {}, 30000);
    spec_files_.push_back(out);
    if (r.exit_code != 0) {
      error = "gpuslice-cdi: " + r.describe();
      return false;
    }
    s->device = r.out.substr(0, r.out.find('\n'));
  }
  return true;
}

void World::cleanup() {
  if (!podman_.empty()) {
    podman({"rm", "--all", "--force", "--time", "0"}, 120000);
    podman({"rmi", "--all", "--force"}, 120000);
  }
  std::error_code ec;
  for (const std::string& f : spec_files_) fs::remove(f, ec);
  spec_files_.clear();
  if (made_cdi_dir_) fs::remove(kCdiDir, ec);  // only if empty
  if (!cgroup_parent_.empty()) {
    // The private cgroup parent, in every hierarchy, deepest first.
    gpuslice::test::run({"/bin/sh", "-c",
                         "for h in /sys/fs/cgroup/*" + cgroup_parent_ + " /sys/fs/cgroup" + cgroup_parent_ +
                             "; do [ -d \"$h\" ] && find \"$h\" -depth -type d -exec rmdir {} + ; done; true"},
                        {}, 30000);
  }
  if (!dir.empty()) fs::remove_all(dir, ec);
  podman_.clear();
}

}  // namespace gpuslice::container_test
