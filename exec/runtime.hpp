// The runtime: one worker per rank (a thread each on the CPU backend) interprets its program from
// planner/ — the same programs the simulator replays — with real compute, a transport, 2BW's
// double-buffered weights, gradient coalescing, data-parallel all-reduce and the optimizer.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "clusters/cluster.hpp"
#include "models/model.hpp"
#include "planner/chunks.hpp"
#include "planner/plan.hpp"
#include "planner/program.hpp"
#include "planner/report.hpp"
#include "planner/timeline.hpp"

namespace pw::exec {

// What --resume found in the checkpoint directory, told before anything runs (the CLI prints it).
struct ResumeInfo {
  int step = 0;            // the checkpoint resumed from; 0: none (the run starts from step 0)
  std::string checkpoint;  // its folder
  // The final checkpoint of a finished run of these steps: nothing runs, the result is the record
  // that checkpoint keeps (so that the report can be written again).
  bool finished = false;
  std::vector<std::string> warnings;  // one line per damaged newer checkpoint skipped
};

struct TrainOptions {
  int steps = 10;
  std::string optimizer = "adamw";  // "adamw" or "sgd" (with momentum)
  float lr = 1e-3f;
  float beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f;  // AdamW
  float weight_decay = 0.0f;                       // AdamW, decoupled, on every parameter
  float momentum = 0.9f;                           // SGD
  std::uint64_t seed = 1234;                       // weights and the synthetic corpus
  std::string data;                                // token file; empty: synthetic corpus
  int gradient_buckets = 1;                        // all-reduce buckets per chunk
  // Threads (CPU backend, one process): rank r's thread runs on CPU core cores[r] only (Linux
  // sched_setaffinity); empty: wherever the OS puts it.
  std::vector<int> cores;
  // With `cores`, ranks pinned to the same core take turns on it op by op, first ready first
  // (exec/worker.hpp, CoreQueue); false: the OS scheduler interleaves them. Not with t > 1 (a
  // TP group's members wait for each other inside their ops).
  bool core_turns = true;
  // Threads (CPU backend, one process): each rank's sends and data-parallel gradient sums run on
  // communication engines beside its compute (exec/README.md, "The device interface"); false:
  // inline on the rank's thread, as under MPI (and for ranks taking turns on a shared core,
  // core_turns). The same losses either way.
  bool async_comm = true;
  // Under mpirun (CPU backend): a progress thread per process moves MPI messages while the rank
  // computes (exec/mpi/transport.hpp, "Progress"). Off by default: on the emulated cluster it
  // slowed the rank's compute on its core more than it helped the messages (docs/performance.md).
  bool mpi_progress = false;
  // Checkpoints (exec/checkpoint.hpp): with a directory, every `checkpoint_every` steps and after
  // the last; `resume` continues from the newest complete one there (from step 0 if none).
  std::string checkpoint_dir;
  int checkpoint_every = 1;
  bool resume = false;
  std::function<void(const ResumeInfo&)> on_resume;  // called once when `resume` is set
  // The emulated device's size per rank (CPU backend): its tensors live in an arena of this many
  // bytes, and a run that would exceed it stops with one line naming the rank, what did not fit
  // and by how much. 0: unlimited.
  std::int64_t device_memory = 0;
};

struct StepLog {
  int step = 0;
  double loss = 0;     // mean cross-entropy over the global batch
  double seconds = 0;  // wall time from the previous step's end on every rank to this one's
  double tokens_per_s = 0;
  std::string checkpoint;  // the checkpoint completed after this step, if any
  // The first step of a later training run whose steps were appended to an earlier run's
  // (validate's blocks): left out of the steady state like the first step of a run.
  bool warm_up = false;
};

struct RankResult {
  int rank = 0;
  std::int64_t peak_memory_bytes = 0;  // the executor's own byte count (its device)
  planner::MemoryBreakdown memory;     // at that peak
  double busy_s = 0;                   // compute time over the whole run
  // Offload (docs/formulas.md section 9): the host pool's peak (master parameters, gradient
  // accumulator and optimizer state of optimizer offload; swapped stashes), and the bytes the
  // copy engines moved over the run, device to host (out) and back (in), all kinds together and
  // the swapped activations' part of them. 0 without offload.
  std::int64_t host_peak_memory_bytes = 0;
  std::int64_t copy_out_bytes = 0, copy_in_bytes = 0;
  std::int64_t activation_out_bytes = 0, activation_in_bytes = 0;
  // Offload chunks with 2bw: of copy_out/in_bytes, those of the run's first and last segments
  // (between optimizer steps), whose plans differ from the steady ones', and how many steps those
  // are (2, or 1 in a one-step run). 0 otherwise. The other steps are steady.
  std::int64_t edge_copy_out_bytes = 0, edge_copy_in_bytes = 0;
  int edge_steps = 0;
  std::vector<std::vector<float>> weights;  // newest weights per chunk, at the end
  std::vector<std::string> slot_names;      // of chunk 0's layout (for tests)
  planner::RankTimeline timeline;           // every op's wall-clock interval, memory over time
};

struct TrainResult {
  int first_step = 0;  // > 0 when resumed from a checkpoint of that step
  // Read back from the final checkpoint of a finished run (--resume with nothing left to run):
  // steps and ranks' figures as that run measured them; no programs, weights or timelines.
  bool from_checkpoint = false;
  planner::Programs programs;  // what ran (the timeline indexes its ops)
  std::vector<StepLog> steps;
  std::vector<RankResult> ranks;
  double wall_s = 0;
};

// Trains `plan` (resolved; placement not needed: every rank is a thread here) up to optimizer step
// options.steps (from step 0, or from the checkpoint resumed); `on_step` is called once per step,
// in order, when every rank has finished it.
// What a checkpoint must match to be resumed by this run: backend, model, plan, optimizer
// settings, seed, data (the manifest's "run" object).
common::Json run_identity(const models::ModelSpec& model, const planner::Plan& plan,
                          const TrainOptions& options, const std::string& backend = "cpu");

// Offload chunks (CPU backend, docs/formats.md): the node the executor makes its chunk schedule
// on for `plan`, devices of `device_memory` bytes each (the emulated device's --device-memory) on
// the v100-32gb-ws preset's node (its host link and CPU Adam rate; the moves depend only on the
// budget, the chunk layout and the layers' stash and workspace bytes, not on times), and the plan
// placed on it (chunk_placement): with t = 1 the node's one GPU holds every rank, with t > 1 the
// node has t w d GPUs on PCIe, each device on its own.
// estimate and simulate of the model's analytic trace at b (sharded at t) on this node and
// placement predict the run's moves, device peak and bytes exactly.
clusters::Cluster chunk_cluster(std::int64_t device_memory, const planner::Plan& plan);
planner::Plan chunk_placement(const planner::Plan& plan);
// The schedules the executor runs an offload-chunks plan by: planner::chunk_schedules of the
// model's analytic trace on chunk_cluster's node, the plan placed by chunk_placement.
std::vector<planner::ChunkSchedule> executor_chunk_schedules(const models::ModelSpec& model,
                                                             const planner::Plan& plan,
                                                             std::int64_t device_memory);
// The device budget an offload-chunks plan is scheduled in on `backend` ("cpu", "cuda"):
// `device_memory` (--device-memory), on the cuda backend less what its stages keep beside the
// planner's figures, which the rank's counter holds too (kCudaGemmWorkspaceBytes and
// kCudaStatusBytes per model chunk, the last stage's losses: 8 m bytes). Throws a one-line
// InputError when that leaves nothing.
std::int64_t chunk_budget(const std::string& backend, const planner::Plan& plan,
                          std::int64_t device_memory);
// `plan` with the chunk size it runs at written in: a chunks plan without one whose layers do not
// fit `device_memory` at the default size gets the smaller size the schedules take (so that its
// report, checkpoints and validate's predictions name it); any other plan as it is. Throws the
// schedules' one-line refusals.
planner::Plan with_chunk_size(const models::ModelSpec& model, planner::Plan plan,
                              std::int64_t device_memory);

TrainResult train_cpu(const models::ModelSpec& model, const planner::Plan& plan,
                      const TrainOptions& options,
                      const std::function<void(const StepLog&)>& on_step = {});

}  // namespace pw::exec
