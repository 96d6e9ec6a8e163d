// One accelerator's peak figures (FLOP/s by dtype, memory bandwidth, capacity), format
// "pipewright.device/1". Presets live in clusters/devices/*.json; figures and sources:
// docs/formats.md.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/json_reader.hpp"

namespace pw::clusters {

struct DeviceSpec {
  std::string name;                         // "H100-SXM"
  double peak_fp16_flops_per_s = 0;         // dense fp16/bf16 tensor-core peak
  double peak_fp32_flops_per_s = 0;         // fp32 (non-tensor) peak
  double memory_bandwidth_bytes_per_s = 0;  // HBM, read + write combined
  std::int64_t memory_bytes = 0;            // device memory capacity
  std::string notes;                        // where the figures come from (optional)
  bool operator==(const DeviceSpec&) const = default;
};

// Parses a device object. `require_format`: a device file must say "pipewright.device/1"; a
// device inline in a cluster file may leave "format" out (if present it must match).
DeviceSpec parse_device(const common::JsonReader& r, bool require_format = true);
common::Json to_json(const DeviceSpec& d);

// A preset name ("A100-80GB") or a path to a device JSON file.
DeviceSpec load_device(const std::string& name_or_path);
common::Json device_preset_json(const std::string& name);  // throws InputError listing presets
std::vector<std::string> device_preset_names();

}  // namespace pw::clusters
