// Prediction against measurement: two run reports of the same plan (a simulated or analytic one
// and a measured one), subtracted field by field. Format "pipewright.validation/1"
// (docs/formats.md).
#pragma once

#include <string>
#include <vector>

#include "common/json_reader.hpp"
#include "planner/report.hpp"

namespace pw::planner {

// A predicted and a measured figure; error = (predicted - measured) / measured: 0 when both are 0,
// NaN (null in JSON, "n/a" for people) when only the measured one is 0.
struct Compared {
  double predicted = 0;
  double measured = 0;
  double error = 0;
};
Compared compare(double predicted, double measured);

struct DeviceValidation {
  int rank = 0;
  // t > 1: one row per GPU of the rank's TP group, its TP index (the prediction is the rank's, one
  // GPU's; the measurement that GPU's: device rank * t + tp).
  int tp = 0;
  int stage = 0;
  int replica = 0;
  Compared busy_s;
  Compared bubble_fraction;  // error: predicted - measured (an absolute difference of fractions)
  // The rank's own peak (memory_breakdown_bytes summed): comparable when ranks share a device.
  Compared peak_memory_bytes;
  MemoryBreakdown predicted_memory, measured_memory;
};

struct Validation {
  std::string model;
  Plan plan;  // the predicted report's (placed when it was simulated)
  std::string predicted_source, measured_source;
  std::string predicted_cluster, measured_cluster;
  Compared iteration_time_s;
  Compared samples_per_s;
  std::vector<double> measured_step_times_s;  // every measured step, when the report has them
  // The predicted step against the median measured step after the first (robust to a slow spell
  // of the machine); has_median_step is false without at least two measured step times.
  bool has_median_step = false;
  Compared median_step_time_s;
  // Offload plans (both reports with an "offload" section): the bytes the copies moved per step,
  // both directions, summed over the ranks.
  bool has_copies = false;
  Compared copy_bytes_per_step;
  std::vector<DeviceValidation> devices;  // by rank
  double max_abs_busy_error = 0;
  double max_abs_memory_error = 0;
};

// The first field where two plans differ, as a JSON path ("/plan/d: 2 in A but 4 in B"), or "" when
// they are the same plan. Placement is not compared (a measured CPU run has none); recompute
// [false, false] equals no recompute list.
std::string plan_difference(const Plan& a, const Plan& b, const std::string& name_a,
                            const std::string& name_b);

// Compares `predicted` (source analytic or simulated) with `measured` (source measured); the
// names label the two in errors ("sim.json"). Throws InputError naming the file and field when
// the sources are the wrong kinds, the models or plans differ, or the ranks do not match.
Validation validate(const RunReport& predicted, const RunReport& measured,
                    const std::string& predicted_name = "predicted",
                    const std::string& measured_name = "measured");

// Format "pipewright.validation/1"; `machine` (the measured cluster and probe figures, or null)
// and `files` (paths of the inputs and intermediate outputs) are written as given.
common::Json to_json(const Validation& v, const common::Json& machine = nullptr,
                     const common::Json& files = common::Json::object());

}  // namespace pw::planner
