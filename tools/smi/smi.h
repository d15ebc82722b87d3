// gpuslice-smi: what the regions hold, as a table (like nvidia-smi) or JSON;
// `set` changes a running container's limits; `options` lists the environment
// options. See docs/agent.md.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "grant.h"
#include "region_io.h"
#include "view.h"

namespace gpuslice::smi {

// Exit codes.
inline constexpr int kExitOk = 0;
inline constexpr int kExitFailed = 1;    // could not do what was asked (e.g. write refused)
inline constexpr int kExitNoRegion = 2;  // the region is missing or not a valid region
inline constexpr int kExitUsage = 64;    // bad command line (EX_USAGE)

struct Shown {
  std::string path;  // as given, or relative to --region-dir; escaped (tools/common/text.h)
  agent::RegionView view;
};

struct Snapshot {
  std::vector<Shown> regions;
  std::uint64_t now_ns = 0;  // CLOCK_MONOTONIC when taken (for ages)
};

// The region a process of this container uses: GPUSLICE_REGION, else the
// documented default (/dev/shm/gpuslice.region).
std::string default_region_path();

// Reads one region (read-only). false + one-line message ("gpuslice-smi:
// PATH: <what is wrong>, expected ...").
bool read_region(const std::string& path, Shown* out, std::string* error);
// Reads every valid region below dir (depth 2, like the agent). Invalid files
// are listed in `skipped` as messages. false + message if dir is unreadable.
bool read_region_dir(const std::string& dir, std::vector<Shown>* out, std::vector<std::string>* skipped,
                     std::string* error);

std::string render_table(const Snapshot& s);
// A region's priority ("high", "normal", "low"; "normal" before any process
// recorded one) and whether its launches are being held right now.
std::string priority_text(const agent::RegionView& v);
bool priority_held(const agent::RegionView& v, std::uint64_t now_ns);
std::string render_json(const Snapshot& s);  // one line

std::string render_options_text();
std::string render_options_json();
std::string render_options_markdown();

struct SetRequest {
  std::string region;
  std::string device;    // "" = every device entry; digits = entry index; else a UUID
  std::string memory;    // "" = unchanged; size or "unlimited"
  std::string sm_limit;  // "" = unchanged; 1-100[%] or "unlimited"
  std::string policy;    // "" = unchanged; hard | elastic
  std::string priority;  // "" = unchanged; high | normal | low (the whole container)
};
// Applies the request; prints what changed on stdout; returns an exit code.
int run_set(const SetRequest& req);
// Records an operator's change for the agent, which keeps a region's limits
// (tools/agent/grant.h); false (printed) when it could not.
bool record_grant(const std::string& region, const agent::MappedRegion& map, const agent::Grant& g,
                  const std::string& shown);
// `set --priority`: rewrites the region's priority word (priority.cc).
int run_set_priority(const std::string& region, const std::string& level);

}  // namespace gpuslice::smi
