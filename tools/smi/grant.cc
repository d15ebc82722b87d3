// gpuslice-smi's record of an operator's change for the agent that keeps a
// region's limits (docs/enforcement.md "Tampered regions"): written before the
// region is changed, by `set` and `priority set` alike.
#include <cstdio>

#include "grant.h"
#include "region_io.h"
#include "smi.h"
#include "text.h"

namespace gpuslice::smi {

bool record_grant(const std::string& region, const agent::MappedRegion& map, const agent::Grant& g,
                  const std::string& shown) {
  std::string why;
  const std::string dir = agent::find_grant_dir(region, &why);
  if (dir.empty() && !why.empty() && !g.lines.empty()) {
    // One is there but not fit to hold records (another user's link, FIFO or
    // directory): the agent would put the change back.
    std::fprintf(stderr,
                 "gpuslice-smi: %s: cannot record the change for the agent (grant directory %s), expected a "
                 "directory of this user's that only it may write; nothing changed\n",
                 shown.c_str(), tools::escape_untrusted(why).c_str());
    return false;
  }
  if (dir.empty() || g.lines.empty()) return true;  // no agent keeps this region's limits
  if (agent::write_grant(dir, map.device(), map.inode(), g, &why)) return true;
  std::fprintf(stderr,
               "gpuslice-smi: %s: cannot record the change for the agent (%s), expected a writable grant directory; "
               "nothing changed\n",
               shown.c_str(), tools::escape_untrusted(why).c_str());
  return false;
}

}  // namespace gpuslice::smi
