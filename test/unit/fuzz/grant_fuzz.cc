// Fuzz target: grant records (tools/agent/grant.h), what `gpuslice-smi set`
// writes into the agent's grant directory and the agent (root) reads back
// and acts on: parse_grant for the record's bytes, parse_grant_name for its
// file name. The input is the record's text; its first line (up to the first
// newline or NUL, at most 255 bytes: a file name) is also read as a name.
//
// Invariants: an accepted record is exactly the text smi writes for what was
// read (grant_text), with values smi can write (quota not 0, sm 1-100,
// policy 0-1, priority 1-3), and that text reads back the same; an accepted name is
// digits and '-' only, and the name smi writes for what was read reads back
// the same.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "fuzz_target.h"
#include "grant.h"

using gpuslice::fuzz::fail;
namespace agent = gpuslice::agent;

namespace {

bool same(const agent::Grant& a, const agent::Grant& b) {
  if (a.lines.size() != b.lines.size()) return false;
  for (std::size_t i = 0; i < a.lines.size(); ++i) {
    const agent::GrantLine& x = a.lines[i];
    const agent::GrantLine& y = b.lines[i];
    if (x.field != y.field || x.value != y.value || std::memcmp(x.uuid, y.uuid, sizeof x.uuid) != 0) return false;
  }
  return true;
}

void check_record(const std::string& text) {
  agent::Grant g;
  if (!agent::parse_grant(text, &g)) return;
  for (const agent::GrantLine& l : g.lines) {
    switch (l.field) {
      case agent::GrantLine::quota:
        if (l.value == 0) fail("a quota of 0 (smi never writes it) accepted");
        break;
      case agent::GrantLine::sm:
        if (l.value < 1 || l.value > 100) fail("an sm limit smi never writes accepted");
        break;
      case agent::GrantLine::policy:
        if (l.value > 1) fail("an sm policy smi never writes accepted");
        break;
      case agent::GrantLine::priority:
        if (l.value < 1 || l.value > 3) fail("a priority smi never writes accepted");
        if (std::memcmp(l.uuid, agent::GrantLine{}.uuid, sizeof l.uuid) != 0) fail("a priority with a device");
        break;
      default: fail("a field that is none of quota, sm, policy, priority");
    }
  }
  const std::string written = agent::grant_text(g);
  if (written != text) fail("an accepted record is not the text smi writes for it");
  agent::Grant again;
  if (!agent::parse_grant(written, &again)) fail("the text smi writes is refused");
  if (!same(g, again)) fail("the text smi writes reads back otherwise");
}

void check_name(const std::string& name) {
  dev_t dev = 0;
  ino_t ino = 0;
  std::uint64_t ns = 0;
  if (!agent::parse_grant_name(name.c_str(), &dev, &ino, &ns)) return;
  if (name.find_first_not_of("0123456789-") != std::string::npos) fail("a name with more than digits and '-' accepted");
  const std::string written = agent::grant_name(dev, ino, ns, 4242);
  dev_t dev2 = 0;
  ino_t ino2 = 0;
  std::uint64_t ns2 = 0;
  if (!agent::parse_grant_name(written.c_str(), &dev2, &ino2, &ns2)) fail("the name smi writes is refused");
  if (dev2 != dev || ino2 != ino || ns2 != ns) fail("the name smi writes reads back otherwise");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size > agent::kMaxGrantBytes) return 0;  // the agent reads no more
  const std::string text(reinterpret_cast<const char*>(data), size);
  check_record(text);
  std::string name = text.substr(0, text.find_first_of(std::string("\n\0", 2)));
  if (name.size() > 255) name.resize(255);
  check_name(name);
  return 0;
}

namespace gpuslice::fuzz {
std::vector<std::string> seeds() {
  const std::string uuid = "GPU-60616263-6465-6667-6869-6a6b6c6d6e6f";
  return {
      "gpuslice-grant 1\nquota " + uuid + " 536870912\nsm " + uuid + " 50\npolicy " + uuid + " 1\n",
      "gpuslice-grant 1\npriority 3\n",
      "gpuslice-grant 1\n",
      "gpuslice-grant 1\nquota " + uuid + " 18446744073709551615\n",
      "2049-1234567-01764412345678901234-4242\ngpuslice-grant 1\nsm " + uuid + " 100\n",
      "1-2-3-4",
      "gpuslice-grant 2\npriority 1\n",
      "gpuslice-grant 1\nquota " + uuid + " 1\r\n",
  };
}
}  // namespace gpuslice::fuzz
