#include "probe.h"

#include <unistd.h>

#include <nlohmann/json.hpp>

namespace gpuslice::test {

unsigned long long device_used(const Sandbox& box, int device) {
  // No state file: no process ever initialised the simulated machine, so its
  // devices hold nothing.
  if (access(box.path("fakecuda.state").c_str(), F_OK) != 0) return 0;
  Result r = run({bin("fakecuda-ctl"), "status"}, box.env(false));
  if (r.exit_code != 0) ADD_FAILURE() << "fakecuda-ctl status failed: " << r.describe();
  auto j = nlohmann::json::parse(r.out, nullptr, false);
  if (j.is_discarded()) {
    ADD_FAILURE() << "fakecuda-ctl status printed no JSON: " << r.out;
    return ~0ull;
  }
  for (const auto& d : j["devices"])
    if (d["index"].get<int>() == device) return d["used"].get<unsigned long long>();
  ADD_FAILURE() << "no device " << device << " in " << r.out;
  return ~0ull;
}

}  // namespace gpuslice::test
