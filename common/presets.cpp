// Lookup over the preset JSON files compiled into the binary.
#include "common/presets.hpp"

namespace pw::common {

const EmbeddedFile* find_embedded(const std::vector<EmbeddedFile>& files, const std::string& name) {
  for (const auto& f : files)
    if (name == f.name) return &f;
  return nullptr;
}

bool looks_like_path(const std::string& spec) {
  return spec.find('/') != std::string::npos ||
         (spec.size() > 5 && spec.compare(spec.size() - 5, 5, ".json") == 0);
}

}  // namespace pw::common
