#include "setup.h"

#include <dlfcn.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <stdexcept>
#include <system_error>

namespace gpuslice::bench {

namespace fs = std::filesystem;

namespace {

std::string fake_dir() { return (fs::path(exe_dir()) / ".." / "fakecuda").lexically_normal().string(); }

bool has_fake_driver() { return fs::exists(fs::path(fake_dir()) / "libcuda.so.1"); }

std::string prepend_path(const std::string& dir) {
  const char* current = std::getenv("LD_LIBRARY_PATH");
  return current != nullptr && *current != '\0' ? dir + ":" + current : dir;
}

std::string inherited_path() {
  const char* current = std::getenv("LD_LIBRARY_PATH");
  return current != nullptr ? current : "";
}

// What dlopen("libcuda.so.1") finds here: 0 none, 1 a real driver, 2 the simulator.
int probe_loader() {
  void* handle = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
  if (handle == nullptr) return 0;
  const bool fake = dlsym(handle, "fakecuda_busy_ns") != nullptr;
  dlclose(handle);
  return fake ? 2 : 1;
}

}  // namespace

std::string self_exe() {
  std::error_code ec;
  fs::path path = fs::read_symlink("/proc/self/exe", ec);
  if (ec) throw std::runtime_error("cannot resolve /proc/self/exe: " + ec.message());
  return path.string();
}

std::string exe_dir() { return fs::path(self_exe()).parent_path().string(); }

std::string find_library(const std::string& option) {
  std::string path = option;
  if (path.empty()) {
    const char* env = std::getenv("GPUSLICE_BENCH_LIB");
    path = env != nullptr && *env != '\0'
               ? env
               : (fs::path(exe_dir()) / ".." / "lib" / "libgpuslice.so").lexically_normal().string();
  }
  if (!fs::exists(path)) {
    throw std::runtime_error("libgpuslice.so not found at " + path + " (build it, or pass --lib PATH)");
  }
  return fs::absolute(path).string();
}

DriverChoice choose_driver(DriverMode mode) {
  const int found = mode == DriverMode::simulated ? 0 : probe_loader();
  if (mode == DriverMode::real) {
    if (found == 1) return {inherited_path(), "libcuda.so.1 (loader search)", ""};
    throw std::runtime_error(found == 2 ? "--driver real: the libcuda.so.1 found is the simulated driver"
                                        : "--driver real: no libcuda.so.1 found (is the NVIDIA driver installed?)");
  }
  if (found == 1) return {inherited_path(), "libcuda.so.1 (loader search)", ""};
  if (found == 2) return {inherited_path(), "libcuda.so.1 (loader search: the simulated driver)", ""};
  if (!has_fake_driver()) {
    throw std::runtime_error(mode == DriverMode::simulated
                                 ? "--driver simulated: no simulated driver at " + fake_dir()
                                 : "no CUDA driver (libcuda.so.1) found, and no simulated driver at " + fake_dir());
  }
  const std::string dir = fake_dir();
  std::string notice =
      mode == DriverMode::simulated
          ? ""
          : "gpuslice-bench: no CUDA driver (libcuda.so.1) found; using the simulated driver in " + dir;
  return {prepend_path(dir), dir + "/libcuda.so.1 (simulated)", notice};
}

std::string make_private_dir() {
  std::string base = "/dev/shm";
  if (access(base.c_str(), W_OK | X_OK) != 0) {
    const char* tmp = std::getenv("TMPDIR");
    base = tmp != nullptr && *tmp != '\0' ? tmp : "/tmp";
  }
  std::string pattern = base + "/gpuslice-bench.XXXXXX";
  if (mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("cannot create a directory under " + base);
  return pattern;
}

void remove_tree(const std::string& dir) {
  std::error_code ec;
  fs::remove_all(dir, ec);
}

}  // namespace gpuslice::bench
