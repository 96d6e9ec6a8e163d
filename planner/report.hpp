// The run report, shared by estimate (analytic), simulate (simulated) and train (measured).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/json_reader.hpp"
#include "planner/plan.hpp"

namespace pw::planner {

// Bytes a device holds at its peak, by category.
struct MemoryBreakdown {
  std::int64_t weights = 0;          // the weight version in use (compute dtype)
  std::int64_t weight_versions = 0;  // 2BW's second (shadow) version
  std::int64_t gradients = 0;        // accumulated gradients
  std::int64_t optimizer = 0;        // AdamW m, v (+ fp32 master weights in mixed precision)
  std::int64_t activations = 0;      // stashed activations (+ the recompute buffer)
  std::int64_t workspace = 0;        // transient scratch
  std::int64_t total() const {
    return weights + weight_versions + gradients + optimizer + activations + workspace;
  }
  MemoryBreakdown& operator+=(const MemoryBreakdown& o);
};

struct DeviceReport {
  int rank = 0;
  int node = 0;
  int gpu = 0;
  int stage = 0;
  int replica = 0;
  std::int64_t peak_memory_bytes = 0;  // of the GPU the rank runs on (shared when co-located)
  std::int64_t capacity_bytes = 0;     // that GPU's memory
  bool fits = true;
  MemoryBreakdown memory;      // this rank's own share
  double busy_s = 0;           // compute time of this rank in one steady-state step
  double bubble_fraction = 0;  // 1 - busy / iteration time
};

// Host memory of one node under offload (plan.offload != none): what the node's ranks keep there.
struct HostReport {
  int node = 0;
  std::int64_t peak_memory_bytes = 0;      // fp32 master, Adam m and v, gradient buffers
  std::int64_t capacity_bytes = 0;         // cluster host.memory_bytes
  std::int64_t pinned_bytes = 0;           // the copy engines' transfer buffers (page-locked)
  std::int64_t pinned_capacity_bytes = 0;  // cluster host.pinned_memory_bytes
  bool fits() const {
    return peak_memory_bytes <= capacity_bytes && pinned_bytes <= pinned_capacity_bytes;
  }
};

struct RunReport {
  std::string source;  // "analytic", "simulated" or "measured"
  std::string model;
  std::string cluster;
  Plan plan;
  double iteration_time_s = 0;  // steady-state time of one optimizer step (one global batch)
  double samples_per_s = 0;
  double tokens_per_s = 0;
  double model_flops_per_s = 0;
  double mfu = 0;
  std::vector<DeviceReport> devices;
  std::vector<HostReport> hosts;  // per node, with offload only (JSON "hosts", absent otherwise)
  std::string timeline;           // path of the Chrome-trace timeline, empty when none
  common::Json extra = common::Json::object();  // source-specific sections (e.g. "estimate")
  bool fits() const;
};

// Format "pipewright.report/1"; see docs/formats.md.
common::Json to_json(const RunReport& r);
RunReport parse_report(const common::Json& json, const std::string& source);

// "rank 3 (stage 3) needs 17.2 GiB on node 0 gpu 3, which has 16.0 GiB (largest term: activations
// 9.1 GiB)" for the first device that does not fit, then "the host memory of node 0: offload needs
// 180 GiB, which has 128 GiB (short by 52 GiB)" for the first host, or "" when all fit.
std::string describe_oom(const RunReport& r);

}  // namespace pw::planner
