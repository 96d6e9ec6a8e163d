// One accelerator's peak figures (FLOP/s by dtype, memory bandwidth, capacity), format
// "pipewright.device/1". Presets live in clusters/devices/*.json; figures and sources:
// docs/formats.md.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/json_reader.hpp"

namespace pw::clusters {

// Free parameters of the analytic device model (traces/analytic.cpp), the optional "efficiency"
// object of a device file. The defaults are the uncalibrated model; `pipewright calibrate` fits
// them to measured runs. Where each enters the formulas: docs/formulas.md ("Device efficiency").
struct DeviceEfficiency {
  double gemm_max = 0.84;       // GEMM efficiency of an infinitely large GEMM, (0, 1]
  double gemm_half_dim = 128;   // h(x) = x / (x + gemm_half_dim) per GEMM dimension, >= 0
  double attention = 1;         // multiplies the efficiency of attention's activation matmuls, > 0
  double elementwise = 1;       // fraction of HBM bandwidth non-GEMM traffic reaches, > 0
  double optimizer = 1;         // fraction of HBM bandwidth AdamW reaches, > 0
  double layer_overhead_s = 0;  // fixed time per layer forward (twice per backward), >= 0
  // How GPU time g and that floor o combine: (g^p + o^p)^(1/p); 0 means max(g, o) (p -> inf).
  double overhead_exponent = 0;  // 0 or >= 1
  bool operator==(const DeviceEfficiency&) const = default;
};

struct DeviceSpec {
  std::string name;                         // "H100-SXM"
  double peak_fp16_flops_per_s = 0;         // dense fp16/bf16 tensor-core peak
  double peak_fp32_flops_per_s = 0;         // fp32 (non-tensor) peak
  double memory_bandwidth_bytes_per_s = 0;  // HBM, read + write combined
  std::int64_t memory_bytes = 0;            // device memory capacity
  DeviceEfficiency efficiency;              // analytic model parameters (optional in JSON)
  std::string notes;                        // where the figures come from (optional)
  bool operator==(const DeviceSpec&) const = default;
};

// Parses a device object. `require_format`: a device file must say "pipewright.device/1"; a
// device inline in a cluster file may leave "format" out (if present it must match).
DeviceSpec parse_device(const common::JsonReader& r, bool require_format = true);
// "efficiency" is written only when it differs from the defaults.
common::Json to_json(const DeviceSpec& d);
DeviceEfficiency parse_efficiency(const common::JsonReader& r);  // missing fields: defaults
common::Json to_json(const DeviceEfficiency& e);

// A preset name ("A100-80GB") or a path to a device JSON file.
DeviceSpec load_device(const std::string& name_or_path);
common::Json device_preset_json(const std::string& name);  // throws InputError listing presets
std::vector<std::string> device_preset_names();

}  // namespace pw::clusters
