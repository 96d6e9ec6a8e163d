// `pipewright sweep`: a what-if study. The cross product of --vary lists (cluster fields, model,
// schedule, plan sizes), each point planned (fixed plan with overrides, or the planner's best),
// simulated, and written as one CSV row / JSON object. Formats: docs/formats.md ("Sweep").
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "cli/options.hpp"
#include "common/json_reader.hpp"
#include "planner/report.hpp"

namespace pw::cli::sweep {

// What a --vary key changes: a cluster field (as --set), or the model / a plan field.
enum class KeyKind { cluster, model, schedule, b, m, B, t, w, d, recompute };

struct Axis {
  std::string key;
  KeyKind kind = KeyKind::cluster;
  std::vector<std::string> values;  // as given on the command line
};

// "KEY=v1,v2,..." -> an axis. The key's kind is decided by name (anything that is not a plan key
// is a cluster field, checked later by validate). Throws InputError on syntax.
Axis parse_vary(const std::string& text);

// One combination: the value of each axis, in axis order.
using Point = std::vector<std::string>;
// Every combination, first axis outermost (it changes slowest), last axis innermost.
std::vector<Point> cross_product(const std::vector<Axis>& axes);

struct SweepSpec {
  std::string model;
  ClusterOptions cluster;
  PlanOptions plan;
  bool plan_best = false;
  std::optional<std::int64_t> batch;  // --batch: global batch B (plan-best, or m = B/(w b))
  std::vector<Axis> axes;
  int steps = 3;
  int parallel = 0;  // 0: one per core
};

// Checks the base scenario, every key and every value before anything runs: a bad key or a value
// that does not parse is an InputError "sweep: --vary KEY...: ...".
void validate(const SweepSpec& spec);

// The outcome of one point.
struct Row {
  Point point;
  bool planned = false;    // plan is set
  planner::Plan plan;      // resolved and placed
  bool simulated = false;  // report is set
  planner::RunReport report;
  bool fits = false;
  std::string note;   // e.g. why it does not fit
  std::string error;  // one line: why this point could not be planned or simulated
};

// Plans every point and simulates them with sim::simulate_batch, `spec.parallel` at once.
// `progress(done, total)` counts points. Rows are in cross-product order.
std::vector<Row> run_sweep(const SweepSpec& spec,
                           const std::function<void(int, int)>& progress = {});

// Outputs (sweep_output.cpp). Deterministic: the same rows give byte-identical text.
std::string to_csv(const SweepSpec& spec, const std::vector<Row>& rows);
common::Json to_json(const SweepSpec& spec, const std::vector<Row>& rows);
void print_table(const SweepSpec& spec, const std::vector<Row>& rows);

}  // namespace pw::cli::sweep
