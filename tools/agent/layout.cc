#include "layout.h"

#include <cctype>

namespace gpuslice::agent {

bool is_kubernetes_uid(const std::string& text) {
  static constexpr int kGroups[] = {8, 4, 4, 4, 12};
  if (text.size() != 36) return false;
  std::size_t pos = 0;
  for (int g = 0; g < 5; ++g) {
    if (g > 0) {
      if (text[pos] != '-') return false;
      ++pos;
    }
    for (int i = 0; i < kGroups[g]; ++i, ++pos) {
      if (!std::isxdigit(static_cast<unsigned char>(text[pos]))) return false;
    }
  }
  return true;
}

OwnerLabels owner_labels(Layout layout, const std::string& sub) {
  OwnerLabels out;
  if (sub.empty()) return out;
  switch (layout) {
    case Layout::gpuslice:
      if (is_kubernetes_uid(sub)) out.pod_uid = sub;
      break;
    case Layout::hami_containers: {
      // "<pod-uid>_<container>": a UID has no '_', and a container name (a DNS
      // label) has none either, so the first '_' splits them.
      const std::size_t cut = sub.find('_');
      if (cut != std::string::npos && is_kubernetes_uid(sub.substr(0, cut)) && cut + 1 < sub.size()) {
        out.pod_uid = sub.substr(0, cut);
        out.container = sub.substr(cut + 1);
      }
      break;
    }
    case Layout::hami_claims:
      if (is_kubernetes_uid(sub)) out.claim_uid = sub;
      break;
  }
  return out;
}

const char* layout_name(Layout layout) {
  switch (layout) {
    case Layout::gpuslice: return "gpuslice";
    case Layout::hami_containers: return "hami-containers";
    case Layout::hami_claims: return "hami-claims";
  }
  return "?";
}

}  // namespace gpuslice::agent
