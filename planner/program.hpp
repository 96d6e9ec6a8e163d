// Schedule programs: the ordered list of ops each device runs. sim/ and exec/ interpret these.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "planner/plan.hpp"

namespace pw::planner {

enum class OpKind {
  forward,          // forward of (microbatch, chunk) with weight `version`
  backward,         // backward of (microbatch, chunk) with weight `version`
  recompute,        // re-run the forward of (microbatch, chunk) just before its backward
  send_activation,  // to `peer` (asynchronous, buffered)
  recv_activation,  // from `peer` (blocks until it arrives)
  send_gradient,    // to `peer`
  recv_gradient,    // from `peer`
  all_reduce,       // gradient `bucket` of `chunk`, a collective over the w replicas of the stage
  optimizer_step,   // applies the step's gradients, creating weight `version`
  free_version,     // drops weight `version`
  // Tied embeddings (d > 1): stage 0 (chunk 0, "wte") owns the update of the parameter the last
  // stage (chunk v-1, "lm_head") holds a copy of. Asynchronous and FIFO like the others. With w
  // replicas each message carries the replica's shard (tied_shard) of the tensor, and a gather
  // over the stage's w replicas completes it: the tensor crosses between the two stages once.
  send_tied_gradient,  // last stage -> stage 0: the replica's shard of the step's (all-reduced)
                       // lm_head gradient (then the whole gradient is zeroed)
  recv_tied_gradient,  // stage 0: the shard; w == 1: the whole, added to the wte gradient
  send_tied_weights,   // stage 0 -> last stage: the shard of wte of the `version` it created
  recv_tied_weights,   // last stage: into lm_head of `version`, before the first op that uses it
  // w > 1 only: collectives over the stage's w replicas, matched by (stage, kind, step / version).
  gather_tied_gradient,  // stage 0: all-gathers the shards received, adds them to the wte gradient
  gather_tied_weights,   // last stage: all-gathers the shards of `version` into lm_head
  // Optimizer offload (plan.offload == optimizer; ZeRO-Offload). On the device's copy engines and
  // the host's CPU, beside compute:
  copy_gradient_to_host,  // the (microbatch, chunk)'s gradients, streamed out during its backward;
                          // microbatch -1: stage 0's tied gradient after the tied exchange
  host_optimizer_step,    // CPU Adam on tile `bucket` (a layer) of `chunk`, creating `version`
  copy_parameters_to_device,  // that tile's new parameters back to the device (`version`)
  // Activation offload (plan.swaps(stage); KARMA). On the copy engines, one FIFO per direction:
  copy_activation_to_host,    // after the (microbatch, chunk)'s forward: its stash to the host;
                              // the device buffer is released when the copy has finished
  copy_activation_to_device,  // issued one compute op before its backward (prefetch): the stash
                              // back, after its copy to the host; the backward waits for it
  // Chunks (plan.offload == chunks; PatrickStar). Chunk `bucket` moves whole; with `layer` >= 0
  // the copy belongs to the next compute op and runs right before that op's layer `layer`
  // (the moment it makes room or brings the chunk for); the evictions of a moment finish before
  // its uploads start, and the layer waits for its uploads. `layer` -1: at the optimizer step.
  copy_chunk_to_host,    // the chunk's fp16 parameters (or gradients) to the host
  copy_chunk_to_device,  // the chunk back to the device
  // With w > 1 a chunk step reduce-scatters the chunk's gradient over the stage's replicas, steps
  // the replica's part (ChunkLayout::shard) and all-gathers the parameters, one after the other.
  chunk_step_host,    // CPU Adam on chunk `bucket` (after its download), creating `version`
  chunk_step_device,  // Adam on the device on chunk `bucket`, whose state lives there
};
// "forward", "send_activation", ...
std::string to_string(OpKind kind);

bool is_compute(OpKind kind);  // forward, backward, recompute
bool is_send(OpKind kind);     // the four point-to-point sends, tied ones included
bool is_recv(OpKind kind);
bool is_tied(OpKind kind);  // the six tied-embedding ops (per step: no microbatch)
// Ops every replica of a stage joins: all_reduce and the two tied gathers.
bool is_collective(OpKind kind);

// Elements [begin, end) of a tied tensor of n elements that replica r of w sends and receives:
// ceil(n / w) per replica, the last ones shorter (or empty).
struct TiedShard {
  std::int64_t begin = 0, end = 0;
};
inline TiedShard tied_shard(std::int64_t n, int w, int r) {
  const std::int64_t per = (n + w - 1) / w;
  const std::int64_t begin = per * r < n ? per * r : n;
  return {begin, begin + per < n ? begin + per : n};
}
// Elements [begin, end) of a CPU Adam tile of n parameters that replica r of w updates under
// ZeRO-Offload's sharding (Plan::offload_sharded, docs/formulas.md section 9): floor(n / w) + 1
// for the first n mod w replicas, floor(n / w) for the others, in replica order. The planner
// counts the shards by it, the executor reduce-scatters, copies, updates and all-gathers by it.
inline TiedShard tile_shard(std::int64_t n, int w, int r) {
  const std::int64_t q = n / w, extra = n % w;
  const std::int64_t begin = q * r + (r < extra ? r : extra);
  return {begin, begin + q + (r < extra ? 1 : 0)};
}
bool is_offload(OpKind kind);  // the three optimizer-offload ops
bool is_swap(OpKind kind);     // the two activation-offload ops
bool is_chunk(OpKind kind);    // the four chunk ops

// One compute slot of a schedule (a forward or a backward of a microbatch-chunk).
struct ComputeSlot {
  bool backward = false;
  int step = 0;
  int microbatch = 0;
  int chunk = 0;
};
// The compute order of `stage` in one step (2bw: a 1F1B step, as its steady state runs).
std::vector<ComputeSlot> step_compute_order(const Plan& plan, int stage, int step = 0);
// The compute order of `stage` over steps first_step .. first_step + steps - 1 as its program
// runs them: 2bw one continuous stream (no flush: a step's forwards run beside the previous step's
// backwards; a run from first_step > 0, resumed, fills the pipeline again), the flush schedules
// their steps back to back.
std::vector<ComputeSlot> run_compute_order(const Plan& plan, int stage, int steps,
                                           int first_step = 0);

// Activation offload on a stage that swaps: a microbatch-chunk is swapped when at least
// kSwapGap compute ops run between its forward and its backward (its download overlaps the first,
// its upload the last, and it is off the device in between); otherwise it stays on the device.
inline constexpr int kSwapGap = 3;
struct SwapPlan {
  std::vector<bool> out;      // per slot: a forward whose stash goes to the host after it
  std::vector<int> prefetch;  // per slot: the backward slot whose stash comes back before it, or -1
  std::vector<int> forward_of;  // per slot: a backward's forward slot (-1 for forwards)
};
SwapPlan swap_plan(const Plan& plan, int stage, const std::vector<ComputeSlot>& order);

// CPU Adam tiles of a chunk under optimizer offload: one per layer (embedding on virtual stage 0,
// each block, head on the last), in forward order. Needs resolved stage_blocks (PlanError).
int offload_tiles(const Plan& plan, int stage, int chunk);

struct Op {
  OpKind kind = OpKind::forward;
  int step = 0;         // optimizer step this op belongs to
  int microbatch = -1;  // 0-based within the step; -1 for per-step ops
  int chunk = 0;        // interleaved model chunk (virtual stage chunk*d + stage), else 0
  int peer = -1;        // rank at the other end of a send/recv, else -1
  int version = -1;     // weight version used (compute), created (optimizer), freed (free)
  int bucket = -1;      // all_reduce bucket, else -1; the chunk of a chunk op
  int layer = -1;       // chunk copies: the layer of the next compute op they precede, else -1
  // Sharded chunks (Plan::chunk_shard): a chunk copy of the replica's part (ChunkCopy::part: an
  // upload with its all-gather, a drop, or at the optimizer step a reduce-scatter and the
  // gradient's part down; with 2bw a version's slot down is a drop, also at the optimizer step,
  // and a gradient part up is a zero fill); a chunk_step_host whose gradient was reduce-scattered
  // on the device (its part downloaded), so CPU Adam neither reduce-scatters nor all-gathers.
  bool part = false;
  bool operator==(const Op&) const = default;
};

struct Program {
  int rank = 0;
  int stage = 0;
  int replica = 0;
  std::vector<Op> ops;
};

struct ChunkSchedule;  // planner/chunks.hpp

struct Programs {
  Plan plan;
  int steps = 0;                 // optimizer steps generated
  int first_step = 0;            // ops carry global steps first_step .. first_step + steps - 1
  bool tied_embeddings = false;  // the model ties its LM head to the token embedding
  int buckets = 0;               // gradient buckets per chunk
  std::vector<Program> devices;  // indexed by rank
  // offload chunks: per stage, the layout and eviction plan the chunk ops were written from (the
  // checker, the simulator and the executor read the layers' chunks, sizes and non-model memory
  // from it).
  std::shared_ptr<const std::vector<ChunkSchedule>> chunks;
};

// Global 1-based microbatch number k = step*m + microbatch + 1 (the 2BW version rule uses it).
inline int global_microbatch(const Plan& plan, int step, int microbatch) {
  return step * plan.m + microbatch + 1;
}

// Weight version a microbatch's forward, recompute and backward use. Flush schedules: the step.
// 2BW: max(floor((k-1)/m) - 1, 0) for global microbatch k.
int expected_version(const Plan& plan, int step, int microbatch);

// Most weight versions a stage may hold at once: 2 for 2BW, 1 for flush schedules.
int version_limit(const Plan& plan);

// Virtual stage (chunk*d + stage) of an op on `stage`.
inline int virtual_stage(const Plan& plan, int stage, int chunk) {
  return chunk * plan.d + stage;
}

// The per-device programs of `plan` over `steps` optimizer steps with `gradient_buckets` all-reduce
// buckets per chunk. Pure; calls check(plan). Throws PlanError for steps or buckets < 1.
// `first_step` > 0 generates a resumed segment: steps first_step .. first_step + steps - 1 with
// the global version rule, starting from the versions a run holds after first_step updates
// (version first_step; for 2BW also first_step - 1, the shadow its next step still uses). Only
// the pipeline's fill restarts; every microbatch uses the same weights as in an unbroken run.
Programs generate_programs(const Plan& plan, int steps = 3, int gradient_buckets = 1,
                           int first_step = 0);

struct ProgramOptions {
  int steps = 3;
  int gradient_buckets = 1;
  int first_step = 0;
  // With tied embeddings and d > 1, per replica: the last stage sends its tied gradient (w > 1:
  // its shard) to stage 0 after the step's all-reduces (send_tied_gradient); stage 0 receives it
  // (w > 1: then gather_tied_gradient) before its optimizer step and sends the new weights (its
  // shard) back (send_tied_weights); the last stage receives version v (w > 1: then
  // gather_tied_weights) right before its first forward that uses v, and the versions no op of
  // the segment uses (2BW: the last two; flush: the last one) after its last optimizer step, so
  // every send has its receive and the final weights of both copies agree.
  bool tied_embeddings = false;
  // offload chunks (needed then): per stage (chunk_schedules), the schedule whose copies and Adam
  // steps the programs carry.
  std::shared_ptr<const std::vector<ChunkSchedule>> chunks;
};
Programs generate_programs(const Plan& plan, const ProgramOptions& options);

// Weight versions a device holds before the first op of programs starting at `first_step`.
std::vector<int> initial_versions(const Plan& plan, int first_step);

// Compact op text, with k the global microbatch: "F3", "F3.1" (chunk 1, when v > 1), "B3", "R3",
// "sendA3->2", "recvA3<-1", "sendG3->0", "recvG3<-2", "AR0" (bucket), "opt(v2)", "free(v0)",
// "sendTG->0", "recvTG<-3", "sendTW(v2)->3", "recvTW(v2)<-0" (tied gradient / weights), "AGTG",
// "AGTW(v2)" (their gathers over the replicas), "D2H3", "D2H(tied)", "hostopt0(v2)", "H2D0(v2)"
// (offload; the number after hostopt and H2D is the tile, with ".chunk" before the version when
// v > 1), "A2H3", "A2D3" (activation offload: microbatch 3's stash to the host and back),
// "C2H4@5", "C2D4@5" (chunk 4 to the host / device before layer 5 of the next compute op; no @
// at the optimizer step; "C2Hp4@5", "C2Dp4@5": a sharded chunk's part, ChunkCopy::part),
// "hostadam4(v1)", "adam4(v1)" (chunk 4's Adam on the host / device).
std::string format_op(const Op& op, const Plan& plan);

std::int64_t total_ops(const Programs& programs);

}  // namespace pw::planner
