// The plan search of PipeDream-2BW, extended: every (w, d, b, recompute, schedule) for a global
// batch on a cluster, filtered by the closed-form memory model and ranked by closed-form
// throughput. The CLI simulates the best few (sim/ is not visible from here).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "clusters/cluster.hpp"
#include "models/model.hpp"
#include "planner/cost_model.hpp"
#include "planner/plan.hpp"
#include "traces/trace.hpp"

namespace pw::planner {

struct SearchOptions {
  std::int64_t global_batch = 0;  // B = w * m * b, required
  std::vector<Schedule> schedules = {Schedule::two_bw, Schedule::one_f_one_b, Schedule::gpipe};
  int max_microbatch = 32;        // b in 1, 2, 4, ... up to this
  double memory_headroom = 0;     // keep this fraction of device memory free, in [0, 1)
  std::optional<int> depth;       // only this d
  std::optional<int> width;       // only this w
  std::vector<int> chunks = {2};  // v tried for interleaved
  int ranks_per_gpu = 1;          // ranks sharing each GPU (w * d = devices * this)
  // Tensor-parallel sizes tried; empty: every t dividing the GPUs per node that the model
  // allows (models::check_sharding). Pipeline depths and widths tried; empty: all that divide.
  std::vector<int> tensor_parallel;
  std::vector<int> depths, widths;
  std::vector<bool> sequence_parallel = {false, true};  // tried where t > 1 (t = 1: off)
  std::vector<Recompute> recompute = {Recompute::none, Recompute::selective, Recompute::full,
                                      Recompute::block};
  std::vector<bool> distributed_optimizer = {false, true};  // true tried where w > 1
  // When no candidate fits on the devices alone, search again with offload (optimizer: with w > 1
  // sharded, the distributed optimizer; activations; both; chunks with t = 1; a cluster with
  // a CPU Adam rate and a host link).
  bool offload_when_nothing_fits = true;
};

// The trace of the model on the cluster's device for one GPU of a TP group (every microbatch
// size the search may try); called once per sharding.
using TraceFn = std::function<traces::Trace(const models::Sharding&)>;

struct Candidate {
  Plan plan;          // resolved and placed
  Estimate estimate;  // closed form
  bool fits = false;  // closed-form peak <= (1 - headroom) x capacity on every GPU
  std::string
      memory_note;  // when it does not fit: "rank 0 needs 17.2 GiB of 16 GiB (activations 9.1 GiB)"
  double samples_per_s() const { return estimate.report.samples_per_s; }
  std::int64_t peak_memory_bytes() const;  // largest over devices
};

struct SearchResult {
  std::vector<Candidate>
      fitting;  // best closed-form throughput first (ties: fewer stages, smaller b)
  std::vector<Candidate> rejected;  // do not fit, best closed-form throughput first
  std::int64_t considered = 0;      // candidates enumerated (valid plans)
  // Set when nothing fit without offload and the search went on with optimizer offload: why the
  // devices alone were not enough (explain_no_fit of that first search). The candidates above are
  // then the offload ones (those considered without offload are counted in `considered`).
  std::string offload_reason;
  // Set when every plan that fit without offload recomputed and the search also tried activation
  // offload beside them (its candidates are among `fitting` / `rejected`): what it found.
  std::string swap_reason;
};

// Enumerates candidates (w * d = devices * ranks_per_gpu, d <= layers, b a power of two <= cap
// that the trace has, m = B / (w b) integral, schedule constraints such as m >= d for 2bw),
// estimates each, splits them into fitting and rejected. Throws InputError when no candidate is
// valid at all (e.g. B not divisible), naming why.
SearchResult search_plans(const models::ModelSpec& model, const TraceFn& trace_for,
                          const clusters::Cluster& cluster, const SearchOptions& options);
// With one trace: only plans of its sharding.
SearchResult search_plans(const models::ModelSpec& model, const traces::Trace& trace,
                          const clusters::Cluster& cluster, const SearchOptions& options);

// Blocks per virtual stage (d*v entries, each >= 1) that minimize the slowest virtual stage's time
// for one microbatch: a block costs its forward + backward (+ recompute with full recomputation)
// from the trace at plan.b, virtual stage 0 also the embedding's, the last also the head's. Greedy
// (optimal for these separable costs): one block each, then each further block to the stage whose
// time stays lowest (the first such stage on ties). Uniform costs give balanced_split's counts.
std::vector<std::int64_t> time_balanced_split(const Plan& plan, std::int64_t layers,
                                              const traces::Trace& trace);

// One line for people: why the best rejected candidate does not fit (its largest memory term).
std::string explain_no_fit(const SearchResult& result);

// Sort key shared by the closed-form and simulated rankings: higher throughput first, then
// fewer stages, smaller t, smaller b, less recompute, no SP, no distributed optimizer, no
// offload, and the schedule order gpipe, 1f1b, 2bw, interleaved.
bool better(double throughput_a, const Plan& a, double throughput_b, const Plan& b);

}  // namespace pw::planner

namespace pw::planner {

// What a simulation said about one candidate (the planner cannot see sim/: the CLI and the tests
// pass a function that simulates).
struct Simulated {
  bool ok = false;    // the simulation ran
  std::string error;  // when it did not
  double samples_per_s = 0;
  double iteration_time_s = 0;
  std::int64_t peak_memory_bytes = 0;  // largest over GPUs
  bool fits = false;                   // within (1 - headroom) x capacity on every GPU
};
using SimulateFn = std::function<std::vector<Simulated>(const std::vector<Plan>&)>;

struct Ranked {
  Candidate candidate;
  std::optional<Simulated> simulated;  // for the top-K only
};

// How many of the fitting candidates (best first) `plan` simulates: the best `top`, and beyond them
// every candidate whose closed-form throughput is within `within` (a fraction, e.g. 0.1) of the
// best's, at most max(top, cap) in all; none when top is 0. The closed form's error on
// cross-node plans (docs/formulas.md 5, docs/performance.md "Plan search") can reorder plans
// that close, so they all get simulated.
int simulated_count(const SearchResult& result, int top, double within, int cap);

// Simulates the best `top_k` fitting candidates and ranks them by simulated throughput (those the
// simulation finds over capacity or failing go last, in closed-form order); the remaining fitting
// candidates follow in closed-form order, unsimulated. Empty when nothing fits.
std::vector<Ranked> rank_by_simulation(const SearchResult& result, int top_k,
                                       const SimulateFn& simulate);

// Spearman's rank correlation of two equally long lists of figures (ties get their mean rank).
double spearman(const std::vector<double>& a, const std::vector<double>& b);

}  // namespace pw::planner
