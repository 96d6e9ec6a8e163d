// "--set dotted.path=value" overrides, applied to a cluster document before it is parsed.
#include <fmt/format.h>

#include "clusters/cluster.hpp"
#include "common/presets.hpp"

namespace pw::clusters {

namespace {

using common::Json;

std::vector<std::string> split_dots(const std::string& key) {
  std::vector<std::string> parts;
  std::size_t start = 0;
  while (true) {
    auto dot = key.find('.', start);
    parts.push_back(key.substr(start, dot - start));
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  return parts;
}

std::string member_names(const Json& object) {
  std::string out;
  for (const auto& [k, v] : object.items())
    out += (out.empty() ? "" : ", ") + k;
  return out;
}

// A number or bool when `text` parses as one, else the text itself as a string.
Json parse_value(const std::string& text) {
  Json v = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!v.is_discarded() && (v.is_number() || v.is_boolean())) return v;
  return Json(text);
}

// A device given by name (or path) becomes its full object, so its fields can be set.
void expand_device(Json& device) {
  if (!device.is_string()) return;
  std::string name = device.get<std::string>();
  device = common::looks_like_path(name) ? common::read_json_file(name) : device_preset_json(name);
}

// The optional network fields (cluster.hpp: a send's occupancy of its rank), written only when set.
bool is_optional_network_field(const std::string& key) {
  return key == "send_overhead_s" || key == "send_overhead_bytes_per_s";
}

bool is_optional_host_field(const std::string& key) {
  for (const char* k :
       {"link", "pinned_memory_bytes", "gpus_per_uplink", "uplink_bandwidth_bytes_per_s",
        "cpu_cores", "cpu_adam_params_per_s_per_core"})
    if (key == k) return true;
  return false;
}

}  // namespace

void apply_set(Json& doc, const std::string& set) {
  auto eq = set.find('=');
  if (eq == std::string::npos || eq == 0 || eq + 1 == set.size())
    throw InputError(fmt::format("--set {}: expected dotted.path=value", set));
  const std::string key = set.substr(0, eq);
  const auto parts = split_dots(key);
  auto fail = [&](const std::string& msg) {
    throw InputError(fmt::format("--set {}: {}", set, msg));
  };
  Json* cur = &doc;
  std::string walked;
  for (std::size_t i = 0; i < parts.size(); ++i) {
    if (parts[i].empty()) fail(fmt::format("empty component in key \"{}\"", key));
    if (walked == "device") expand_device(*cur);
    // The optional host fields (cluster.hpp) may be set on a file that leaves them out.
    const bool optional_host_field = i + 1 == parts.size() && cur->is_object() &&
                                     ((walked == "host" && is_optional_host_field(parts[i])) ||
                                      (walked == "network" && is_optional_network_field(parts[i])));
    if (!cur->is_object() || (!cur->contains(parts[i]) && !optional_host_field)) {
      std::string where = walked.empty() ? "the cluster" : walked;
      fail(fmt::format(
          "unknown key \"{}\"{}", key,
          cur->is_object() ? fmt::format(" ({} has: {})", where, member_names(*cur)) : ""));
    }
    walked += (walked.empty() ? "" : ".") + parts[i];
    cur = &(*cur)[parts[i]];
  }
  if (cur->is_object() && key != "device")
    fail(fmt::format("\"{}\" is an object; set one of its fields ({})", key, member_names(*cur)));
  *cur = parse_value(set.substr(eq + 1));
}

}  // namespace pw::clusters
