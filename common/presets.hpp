// Preset JSON files compiled into the binary (see cmake/embed_presets.cmake).
#pragma once

#include <string>
#include <vector>

namespace pw::common {

struct EmbeddedFile {
  const char* name;  // file name without ".json", e.g. "gpt2-124m"
  const char* text;  // the JSON text
};

const std::vector<EmbeddedFile>& embedded_models();
const std::vector<EmbeddedFile>& embedded_clusters();
const std::vector<EmbeddedFile>& embedded_devices();  // clusters/devices/*.json

// The embedded file called `name`, or nullptr.
const EmbeddedFile* find_embedded(const std::vector<EmbeddedFile>& files, const std::string& name);

// True when `spec` looks like a path rather than a preset name (contains '/' or ends in ".json").
bool looks_like_path(const std::string& spec);

}  // namespace pw::common
