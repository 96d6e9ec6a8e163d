// Device specs: JSON reading/writing and the embedded presets (clusters/devices/*.json).
#include "clusters/device.hpp"

#include <fmt/format.h>

#include "common/limits.hpp"
#include "common/presets.hpp"

namespace pw::clusters {

namespace {

constexpr const char* kDeviceFormat = "pipewright.device/1";

std::string joined_names(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names)
    out += (out.empty() ? "" : ", ") + n;
  return out;
}

}  // namespace

DeviceEfficiency parse_efficiency(const common::JsonReader& r) {
  if (!r.value().is_object()) r.fail("expected an object");
  for (const auto& [key, value] : r.value().items())
    if (key != "gemm_max" && key != "gemm_half_dim" && key != "attention" && key != "elementwise" &&
        key != "optimizer" && key != "layer_overhead_s" && key != "overhead_exponent")
      r.fail_member(key,
                    "unknown efficiency parameter; expected gemm_max, gemm_half_dim, "
                    "attention, elementwise, optimizer, layer_overhead_s or overhead_exponent");
  DeviceEfficiency e;
  auto positive = [&](const char* key, double& field) {
    if (r.has(key)) field = r.get_positive(key);
  };
  auto nonnegative = [&](const char* key, double& field) {
    if (r.has(key)) field = r.get_nonnegative(key);
  };
  positive("gemm_max", e.gemm_max);
  if (e.gemm_max > 1)
    r.fail_member("gemm_max", fmt::format("must be in (0, 1], found {}", e.gemm_max));
  nonnegative("gemm_half_dim", e.gemm_half_dim);
  positive("attention", e.attention);
  positive("elementwise", e.elementwise);
  positive("optimizer", e.optimizer);
  nonnegative("layer_overhead_s", e.layer_overhead_s);
  nonnegative("overhead_exponent", e.overhead_exponent);
  if (e.overhead_exponent > 0 && e.overhead_exponent < 1)
    r.fail_member("overhead_exponent",
                  fmt::format("must be 0 (max of GPU time and floor) or >= 1, found {}",
                              e.overhead_exponent));
  return e;
}

common::Json to_json(const DeviceEfficiency& e) {
  return {{"gemm_max", e.gemm_max},
          {"gemm_half_dim", e.gemm_half_dim},
          {"attention", e.attention},
          {"elementwise", e.elementwise},
          {"optimizer", e.optimizer},
          {"layer_overhead_s", e.layer_overhead_s},
          {"overhead_exponent", e.overhead_exponent}};
}

DeviceSpec parse_device(const common::JsonReader& r, bool require_format) {
  if (require_format || r.has("format")) r.expect_format(kDeviceFormat);
  DeviceSpec d;
  d.name = r.get_string("name");
  d.peak_fp16_flops_per_s = r.get_positive("peak_fp16_flops_per_s");
  d.peak_fp32_flops_per_s = r.get_positive("peak_fp32_flops_per_s");
  d.memory_bandwidth_bytes_per_s = r.get_positive("memory_bandwidth_bytes_per_s");
  d.memory_bytes = r.get_int_in("memory_bytes", 1, common::kMaxBytes);
  if (auto eff = r.find("efficiency")) d.efficiency = parse_efficiency(*eff);
  if (auto notes = r.find("notes")) d.notes = notes->as_string();
  return d;
}

common::Json to_json(const DeviceSpec& d) {
  common::Json j = common::Json::object();
  j["format"] = kDeviceFormat;
  j["name"] = d.name;
  j["peak_fp16_flops_per_s"] = d.peak_fp16_flops_per_s;
  j["peak_fp32_flops_per_s"] = d.peak_fp32_flops_per_s;
  j["memory_bandwidth_bytes_per_s"] = d.memory_bandwidth_bytes_per_s;
  j["memory_bytes"] = d.memory_bytes;
  if (d.efficiency != DeviceEfficiency{}) j["efficiency"] = to_json(d.efficiency);
  if (!d.notes.empty()) j["notes"] = d.notes;
  return j;
}

std::vector<std::string> device_preset_names() {
  std::vector<std::string> names;
  for (const auto& f : common::embedded_devices())
    names.push_back(f.name);
  return names;
}

common::Json device_preset_json(const std::string& name) {
  const auto* file = common::find_embedded(common::embedded_devices(), name);
  if (file == nullptr)
    throw InputError(fmt::format("unknown device \"{}\"; presets: {} (or a path to a .json file)",
                                 name, joined_names(device_preset_names())));
  return common::parse_json(file->text, "device preset " + name);
}

DeviceSpec load_device(const std::string& name_or_path) {
  if (common::looks_like_path(name_or_path)) {
    common::Json doc = common::read_json_file(name_or_path);
    return parse_device(common::JsonReader(doc, name_or_path));
  }
  common::Json doc = device_preset_json(name_or_path);
  return parse_device(common::JsonReader(doc, "device preset " + name_or_path));
}

}  // namespace pw::clusters
