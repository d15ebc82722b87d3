// `gpuslice-smi set`: resizes a running container's slice through its region.
// The library reads DeviceState::quota_bytes / sm_limit_pct / sm_policy from
// the region on every admission and refill, so a store here takes effect at
// the container's next allocation or launch, without a restart.
#include <fcntl.h>

#include <cstdio>
#include <cstring>

#include "grant.h"
#include "limiter/lease.h"
#include "limiter/memory_accounting.h"
#include "limiter/options/options.h"
#include "region_io.h"
#include "shm/region_file.h"
#include "smi.h"
#include "text.h"
#include "view.h"

using namespace std::string_literals;

namespace gpuslice::smi {
namespace {

struct Values {
  bool memory = false, sm = false, policy = false;
  std::uint64_t quota = kUnlimited;
  std::uint32_t sm_limit = 100;
  SmPolicy sm_policy = SmPolicy::hard;
};

int usage(const std::string& message) {
  std::fprintf(stderr, "gpuslice-smi: set: %s\n", message.c_str());
  return kExitUsage;
}

bool all_digits(const std::string& s) {
  return !s.empty() && s.size() < 4 && s.find_first_not_of("0123456789") == std::string::npos;
}

std::string describe_quota(std::uint64_t q) { return q == kUnlimited ? "unlimited" : agent::format_bytes(q); }
std::string describe_sm(std::uint32_t pct) {
  return agent::sm_unlimited(pct) ? "unlimited" : std::to_string(pct) + "%";
}

// What one entry held before the change (plain data: filled under the guard).
struct Change {
  int index;
  std::uint8_t uuid[16];
  std::uint64_t old_quota;
  std::uint32_t old_sm;
  std::uint32_t old_policy;
  std::uint64_t used;
};

// Region accesses only: runs under the SIGBUS guard.
void apply(Region* r, int index, const Values& v, Change* c) {
  DeviceState& d = r->devices[index];
  c->index = index;
  std::memcpy(c->uuid, d.uuid, sizeof c->uuid);
  c->old_quota = v.memory ? d.quota_bytes.exchange(v.quota) : d.quota_bytes.load();
  // Spare leases admitted under a higher quota must not be spent under this one.
  if (v.memory && v.quota < c->old_quota) limiter::invalidate_leases(r, index);
  c->old_sm = v.sm ? d.sm_limit_pct.exchange(v.sm_limit) : d.sm_limit_pct.load();
  c->old_policy = v.policy ? d.sm_policy.exchange(static_cast<std::uint32_t>(v.sm_policy)) : d.sm_policy.load();
  const std::uint64_t counted = d.used_bytes.load();
  const std::uint64_t spare = limiter::spare_lease_bytes(r, index);  // admitted, not allocated
  c->used = (counted > spare ? counted - spare : 0) + d.agent_extra_bytes.load();
}

void report(const Change& c, const Values& v, const std::string& path) {
  std::string changes;
  auto add = [&](const std::string& what) { changes += (changes.empty() ? "" : ", ") + what; };
  if (v.memory) add("memory quota "s + describe_quota(c.old_quota) + " -> " + describe_quota(v.quota));
  if (v.sm) add("SM limit "s + describe_sm(c.old_sm) + " -> " + describe_sm(v.sm_limit));
  if (v.policy) {
    add("SM policy "s + agent::sm_policy_name(c.old_policy) + " -> " +
        agent::sm_policy_name(static_cast<std::uint32_t>(v.sm_policy)));
  }
  std::printf("gpuslice-smi: %s: device %d (%s): %s\n", path.c_str(), c.index, agent::format_uuid(c.uuid).c_str(),
              changes.c_str());
  if (v.memory && v.quota != kUnlimited && c.used > v.quota) {
    std::printf(
        "gpuslice-smi: %s: device %d uses %s, above the new quota: allocations are refused until usage "
        "drops below it (nothing already allocated is taken away)\n",
        path.c_str(), c.index, agent::format_bytes(c.used).c_str());
  }
}

}  // namespace

int run_set(const SetRequest& req) {
  Values v;
  if (!req.memory.empty()) {
    v.memory = true;
    if (req.memory != "unlimited") {
      if (!options::parse_size(req.memory.c_str(), &v.quota)) {
        return usage(
            "--memory '"s + req.memory +
            "': expected a size: digits and B, K/M/G/T (base 1000) or Ki/Mi/Gi/Ti (base 1024), or 'unlimited'");
      }
      if (v.quota == 0) return usage("--memory 0 would refuse every allocation; use 'unlimited' for no quota");
    }
  }
  if (!req.sm_limit.empty()) {
    v.sm = true;
    if (req.sm_limit != "unlimited" && !options::parse_percent(req.sm_limit.c_str(), &v.sm_limit)) {
      return usage("--sm-limit '"s + req.sm_limit + "': expected an integer percentage 1-100 or 'unlimited'");
    }
  }
  if (!req.policy.empty()) {
    v.policy = true;
    if (req.policy == "hard")
      v.sm_policy = SmPolicy::hard;
    else if (req.policy == "elastic")
      v.sm_policy = SmPolicy::elastic;
    else
      return usage("--sm-policy '"s + req.policy + "': expected hard or elastic");
  }
  if (!v.memory && !v.sm && !v.policy) {
    if (!req.priority.empty()) return run_set_priority(req.region, req.priority);
    return usage("nothing to change: give --memory, --sm-limit, --sm-policy and/or --priority");
  }
  if (!req.priority.empty()) {
    const int rc = run_set_priority(req.region, req.priority);
    if (rc != kExitOk) return rc;
  }
  std::uint8_t uuid[16];
  const bool by_uuid = !req.device.empty() && !all_digits(req.device);
  if (by_uuid && !agent::parse_uuid(req.device.c_str(), uuid)) {
    return usage("--device '"s + req.device + "': expected a device entry number or a UUID (GPU-xxxxxxxx-...)");
  }

  agent::MappedRegion map;
  std::string why;
  const std::string shown = tools::escape_untrusted(req.region);  // operator input: shown, never trusted
  if (!agent::open_region(AT_FDCWD, req.region.c_str(), true, true, &map, &why)) {
    std::fprintf(stderr, "gpuslice-smi: %s: %s\n", shown.c_str(), why.c_str());
    return kExitNoRegion;
  }
  Region* r = map.get();
  Change changes[kMaxDevices];
  int changed = 0;
  int index = -1;
  if (!req.device.empty() && !by_uuid) {
    index = std::atoi(req.device.c_str());
    if (index >= static_cast<int>(kMaxDevices)) index = -2;
  }
  // The agent keeps the limits a container was given and puts back any other
  // (tools/agent/tamper.h): the change is recorded for it first.
  agent::Grant grant;
  auto add_lines = [&](const std::uint8_t* id) {
    auto add = [&](agent::GrantLine::Field f, std::uint64_t value) {
      agent::GrantLine l{};
      l.field = f;
      std::memcpy(l.uuid, id, sizeof l.uuid);
      l.value = value;
      grant.lines.push_back(l);
    };
    if (v.memory) add(agent::GrantLine::quota, v.quota);
    if (v.sm) add(agent::GrantLine::sm, v.sm_limit);
    if (v.policy) add(agent::GrantLine::policy, static_cast<std::uint64_t>(v.sm_policy));
  };
  if (by_uuid) {
    add_lines(uuid);
  } else if (!agent::guarded([&] {
               for (std::uint32_t i = 0; i < kMaxDevices; ++i) {
                 const DeviceState& d = r->devices[i];
                 if ((req.device.empty() || static_cast<int>(i) == index) &&
                     d.uuid_state.load(std::memory_order_acquire) == shm::kDevicePublished) {
                   add_lines(d.uuid);
                 }
               }
             })) {
    grant.lines.clear();
  }
  if (!record_grant(req.region, map, grant, shown)) return kExitFailed;
  const bool ok = agent::guarded([&] {
    if (req.device.empty()) {
      for (std::uint32_t i = 0; i < kMaxDevices; ++i) {
        if (r->devices[i].uuid_state.load(std::memory_order_acquire) == shm::kDevicePublished) {
          apply(r, static_cast<int>(i), v, &changes[changed++]);
        }
      }
      return;
    }
    if (by_uuid) {
      // An entry the container has not used yet is created with these values
      // (the first process to use the device then keeps them).
      index = shm::device_index(r, uuid, v.memory ? v.quota : kUnlimited, v.sm ? v.sm_limit : 100,
                                v.policy ? v.sm_policy : SmPolicy::hard);
    } else if (index >= 0 && r->devices[index].uuid_state.load(std::memory_order_acquire) != shm::kDevicePublished) {
      index = -2;
    }
    if (index >= 0) apply(r, index, v, &changes[changed++]);
  });
  if (!ok) {
    std::fprintf(stderr, "gpuslice-smi: %s: the file shrank while being written, expected a region of fixed size\n",
                 shown.c_str());
    return kExitNoRegion;
  }
  for (int i = 0; i < changed; ++i) report(changes[i], v, shown);
  if (changed > 0) return kExitOk;
  if (req.device.empty()) {
    std::fprintf(stderr,
                 "gpuslice-smi: %s: no device in use yet, expected --device UUID to set a device's limits "
                 "before its first use\n",
                 shown.c_str());
  } else if (by_uuid) {
    std::fprintf(stderr, "gpuslice-smi: %s: every device entry is taken, expected a free one for %s\n", shown.c_str(),
                 req.device.c_str());
  } else {
    std::fprintf(stderr, "gpuslice-smi: %s: no device entry %s, expected an entry listed by gpuslice-smi --json\n",
                 shown.c_str(), req.device.c_str());
  }
  return kExitFailed;
}

}  // namespace gpuslice::smi
