// gpuslice-smi and priority between tenants (docs/priority.md): the
// container's level as shown, and `set --priority`, which rewrites
// RegionHeader::priority. Every process of the container re-reads the word on
// its next launch and moves its activity file to that level's board directory
// (which the deployment may keep it out of: the board, not this word, is what
// neighbours trust).
#include <fcntl.h>

#include <cstdio>

#include "gpuslice/priority_board.h"
#include "limiter/options/options.h"
#include "limiter/priority.h"
#include "platform/text.h"
#include "region_io.h"
#include "smi.h"
#include "text.h"

using namespace std::string_literals;

namespace gpuslice::smi {

std::string priority_text(const agent::RegionView& v) {
  return limiter::priority_name(limiter::priority_from_word(v.priority, Priority::normal));
}

bool priority_held(const agent::RegionView& v, std::uint64_t now_ns) { return v.priority_held_until_ns > now_ns; }

int run_set_priority(const std::string& region, const std::string& text) {
  // GPUSLICE_PRIORITY's own grammar (options.def): what the variable accepts.
  Priority level = Priority::normal;
  if (!options::parse_word(options::words::priority, text.c_str(), &level)) {
    char expected[128];
    platform::Text t(expected, sizeof expected);
    options::list_words(t, options::words::priority);
    std::fprintf(stderr, "gpuslice-smi: set: --priority '%s': expected %s\n", text.c_str(), expected);
    return kExitUsage;
  }
  agent::MappedRegion map;
  std::string why;
  const std::string shown = tools::escape_untrusted(region);  // operator input: shown, never trusted
  if (!agent::open_region(AT_FDCWD, region.c_str(), true, true, &map, &why)) {
    std::fprintf(stderr, "gpuslice-smi: %s: %s\n", shown.c_str(), why.c_str());
    return kExitNoRegion;
  }
  agent::Grant grant;
  grant.lines.push_back({agent::GrantLine::priority, {}, static_cast<std::uint64_t>(level)});
  if (!record_grant(region, map, grant, shown)) return kExitFailed;
  Region* r = map.get();
  std::uint32_t old = 0;
  if (!agent::guarded([&] { old = r->header.priority.exchange(static_cast<std::uint32_t>(level)); })) {
    std::fprintf(stderr, "gpuslice-smi: %s: the file shrank while being written, expected a region of fixed size\n",
                 shown.c_str());
    return kExitNoRegion;
  }
  std::printf("gpuslice-smi: %s: priority %s -> %s\n", shown.c_str(),
              limiter::priority_name(limiter::priority_from_word(old, Priority::normal)),
              limiter::priority_name(level));
  return kExitOk;
}

}  // namespace gpuslice::smi
