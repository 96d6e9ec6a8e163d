// Internal to exec/: what every backend's workers share, whatever memory their tensors live in —
// the checks and programs of a run, the step book (losses, step times, checkpoint manifests), the
// weight-version slots of 2BW, the samples of a microbatch, and the thread runner.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "exec/data.hpp"
#include "exec/runtime.hpp"
#include "exec/stage_compute.hpp"
#include "planner/program.hpp"

namespace pw::exec::detail {

using Clock = std::chrono::steady_clock;

// Keeps the memory of freed large blocks in the process for the next allocation (glibc: blocks
// up to 32 MiB from the heap instead of fresh mmaps, and no trimming of the heap's top below
// 1 GiB). A training process frees and allocates the same message, activation and gradient
// buffers every step; by default glibc maps each block of 128 KiB or more anew and unmaps it on
// free, so every such buffer page-faults and zero-fills again (measured: a 256 KiB message of
// the MPI transport 16x slower than with the memory kept; docs/performance.md, "Tensor
// parallelism under mpirun, and freed memory kept"). Process-wide, idempotent; prepare_run and the
// CPU profiler call it.
void keep_freed_memory();

// What a run needs before its workers start: the options checked, the checkpoint directory
// checked (and resumed from), the programs generated.
struct PreparedRun {
  int first_step = 0;  // the resumed checkpoint's step, else 0
  common::Json identity;
  planner::Programs programs;
  // Resumed at the final checkpoint of a finished run: its record; nothing is left to run.
  std::optional<TrainResult> finished;
};
// `backend` ("cpu", "cuda") goes into the identity a checkpoint must match. `tidy`: this process
// may rename damaged checkpoints (under mpirun only rank 0 does).
PreparedRun prepare_run(const models::ModelSpec& model, const planner::Plan& plan,
                        const TrainOptions& options, const std::string& backend, bool tidy = true);

// A finished run's record, kept in its final checkpoint's manifest ("result"): what its report is
// made of (steps' losses and times, ranks' memory and busy time), and back (errors name `source`
// and the JSON path).
common::Json result_record(const TrainResult& r);
TrainResult result_from_record(const common::Json& record, const std::string& source);

// Losses and step ends as ranks report them; the step log once every rank finished a step.
struct StepBook {
  const models::ModelSpec* model = nullptr;
  const planner::Programs* programs = nullptr;
  const TrainOptions* options = nullptr;
  const TokenSource* data = nullptr;
  int first_step = 0;
  common::Json identity;  // written into checkpoint manifests
  int ranks_here = 0;     // ranks reporting to this book (all, or this process's under mpirun)
  bool write_manifests = true;  // false where another process writes them (mpirun, rank > 0)
  // Called when every rank here finished a checkpoint step, before its manifest: under mpirun a
  // barrier, so that rank 0 writes the manifest after every process wrote its shard.
  std::function<void()> before_manifest;
  Clock::time_point start;
  std::function<void(const StepLog&)> on_step;

  std::mutex mutex;
  std::vector<int> finished;     // ranks done with each step (index: step - first_step)
  std::vector<double> loss_sum;  // microbatch mean losses of each step
  std::vector<StepLog> logs;
  double last_end_s = 0;

  void init(const models::ModelSpec& m, const PreparedRun& run, const TrainOptions& o,
            const TokenSource& tokens, int ranks);
  const planner::Plan& plan() const { return programs->plan; }
  // Devices (threads or processes) of the run: t per pipeline rank.
  int devices() const { return plan().ranks() * plan().t; }
  // A checkpoint is written after `step` (0-based) completes, i.e. holding step + 1 updates.
  bool checkpoint_after(int step) const;
  void add_loss(int step, double loss);
  // Whether a device's losses go into the book: the last stage's, TP index 0's only (every member
  // of a TP group computes the group's loss).
  static bool reports_loss(bool last_stage, int tp) { return last_stage && tp == 0; }
  // Called by each rank when its optimizer step of `step` is done (its shard written). The last
  // step's manifest waits for write_final_manifest.
  void finish_step(int step);
  // A rank's end of `step` in both workers: its checkpoint shard (`save(step)`) when one is due,
  // then finish_step.
  template <class Save>
  void end_step(int step, Save&& save) {
    if (checkpoint_after(step)) save(step);
    finish_step(step);
  }
  // After the run (every shard written): the final checkpoint's manifest, with the run's record.
  void write_final_manifest(const TrainResult& result) const;
  // The log line of `step` ending at `now_s` with these summed losses (finish_step's, and the
  // gathered logs of an mpirun job); its time is from last_end_s, which then becomes now_s.
  StepLog make_log(int step, double loss_sum_of_step, double now_s);
};

// The stage (chunk) of the model that `stage`'s chunk `chunk` holds.
StageSpec chunk_spec(const models::ModelSpec& model, const planner::Plan& plan, int stage,
                     int chunk);
// The same as TP rank `tp_rank`'s shard of it (the plan's t and SP): what each worker builds.
StageSpec shard_spec(const models::ModelSpec& model, const planner::Plan& plan, int stage,
                     int chunk, int tp_rank);

// The last stage's copy of a tied tensor in checkpoints (both workers): with d > 1 the model chunk
// holding the head (`last`) and a tied tensor (`tied_offset` >= 0) stores the copy as zeros (it may
// not have arrived for the versions written, and what its slot holds until then depends on the
// run's history: zeros are the same bytes however the run got there), and a resume reads it from
// `shard`, stage 0's shard of the same replica at the device of the same TP index, tensor
// "c0.w<version>" from element `offset` (where "wte" begins in that stage's layout, the same in
// elements for either backend).
bool zeroed_tied_copy(const planner::Plan& plan, bool last, std::int64_t tied_offset);
struct TiedCopySource {
  std::string shard;
  std::int64_t offset = 0;
};
TiedCopySource tied_copy_source(const models::ModelSpec& model, const planner::Plan& plan,
                                int replica, int tp, const std::string& checkpoint);

// Both workers' devices: device = pipeline rank · t + TP index (planner/plan.hpp's order). The TP
// group of pipeline rank `rank` (its t devices in TP order); the devices of TP index `tp` of
// stage `stage`'s w replicas (the data-parallel collectives' group, in replica order); `n`
// elements in `parts` equal parts (SP's all-gathers and reduce-scatters: part k at k n / parts).
std::vector<int> tp_group(int rank, int t);
std::vector<int> replica_devices(const planner::Plan& plan, int stage, int tp);
std::vector<std::int64_t> equal_parts(std::int64_t n, int parts);

// The ranges [begin, end) of a chunk's n parameters its optimizer updates: all, except on the last
// stage of a tied model split over stages (d > 1): stage 0 updates the tied tensor and sends it,
// so the last stage skips its copy [tied_offset, tied_offset + tied_size). Empty ranges left out.
std::vector<std::pair<std::int64_t, std::int64_t>> updated_ranges(bool first, bool last,
                                                                  std::int64_t tied_offset,
                                                                  std::int64_t tied_size, int d,
                                                                  std::int64_t n);

// The distributed optimizer's shard rule (docs/formulas.md; planner::tied_shard over the rank's
// parameters, its chunks' in order, split into w contiguous ranges of ceil(P / w)): for a chunk at
// `base` of the rank's `flat` parameters, replica r's range starts at [r] relative to the chunk
// (w + 1 values, the last flat - base; unclipped: clip_bounds cuts them to a range). With base 0
// over one tensor of n elements: its w shards' collective bounds (the tied exchange's).
std::vector<std::int64_t> shard_starts(std::int64_t flat, std::int64_t base, int w);
// `starts` (w + 1 ascending offsets) clipped to [a, b) and made relative to a: a collective's
// bounds over that range.
std::vector<std::int64_t> clip_bounds(const std::vector<std::int64_t>& starts, std::int64_t a,
                                      std::int64_t b);

// A bucket [begin, end) of a chunk's gradients under the distributed optimizer, cut where the tied
// tensor's rule differs from the shard rule. `index` (0, 1, 2: before, inside, after the tied
// tensor) names the piece in collective keys. Kinds:
//  - by_shards: reduce-scattered by the rank's shards (shard_starts; bounds left empty);
//  - tied_whole: both tied ends on one device (d == 1): all-reduced whole, as without sharding,
//    since each end's update adds the other's gradient wherever its shard lies;
//  - tied_shards: the last stage's lm_head copy (d > 1), which its optimizer skips: by tied_shard
//    over the tensor, so that replica r holds the shard it sends stage 0 (bounds given).
struct BucketPiece {
  enum Kind { by_shards, tied_whole, tied_shards };
  int index = 0;
  Kind kind = by_shards;
  std::int64_t begin = 0, end = 0;
  std::vector<std::int64_t> bounds;
};
std::vector<BucketPiece> bucket_pieces(bool first, std::int64_t tied_offset, std::int64_t tied_size,
                                       int d, int w, std::int64_t begin, std::int64_t end);

// The samples of (step, microbatch) for `replica`: the global batch of step t is samples
// [t B, (t+1) B); replica r takes its m*b consecutive ones, microbatch j the b after j*b.
void microbatch_samples(const StepBook& book, int replica, int step, int microbatch,
                        std::vector<std::int32_t>& tokens, std::vector<std::int32_t>& targets);

// The two weight slots of a rank: which version each holds, which are free and allocated. Flush
// schedules update in place (slot 0); 2BW's second version takes slot 1 the first time it needs it.
class VersionSlots {
 public:
  int slot_of(int version) const;  // throws naming the rank when the version is not held
  void free_version(int version);
  // The slot the update to `version` writes: a free one; `allocate` is set when it has no memory
  // yet (the caller allocates it before writing). Throws when none is free.
  int target_for(int version, bool& allocate) const;
  void place(int version, int slot);  // after the update: the slot holds the newest version
  // A resumed run: `versions` (ascending, as planner::initial_versions) in slots 1, 0.
  void resume(const std::vector<int>& versions);
  int newest() const { return newest_; }
  bool allocated(int slot) const { return allocated_[slot]; }
  void set_rank(int rank) { rank_ = rank; }

 private:
  int rank_ = 0;
  std::map<int, int> slot_of_{{0, 0}};
  bool free_[2] = {false, true};
  bool allocated_[2] = {true, false};
  int newest_ = 0;
};

// Runs body(i) for i in [0, n) on n threads; the first failure calls abort() (waking the others)
// and is rethrown once all joined — the first real one, not the "transport aborted" errors it
// caused elsewhere.
void run_threads(int n, const std::function<void(int)>& body, const std::function<void()>& abort);

}  // namespace pw::exec::detail
