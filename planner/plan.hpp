// The plan: how a model is split and replicated over devices, and which schedule runs it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/json_reader.hpp"
#include "common/limits.hpp"

namespace pw::planner {

// gpipe: all forwards, all backwards, flush. one_f_one_b: PipeDream-Flush. two_bw: PipeDream-2BW
// (no flush, double-buffered weights). interleaved: Megatron, v chunks per device. dp: d == 1.
enum class Schedule { gpipe, one_f_one_b, two_bw, interleaved, dp };
std::string to_string(Schedule s);              // "gpipe", "1f1b", "2bw", "interleaved", "dp"
Schedule parse_schedule(const std::string& s);  // throws InputError listing the valid names

// Activation recomputation of a stage: none, selective (Korthikanti et al. 2022: the attention
// core's tensors are dropped and recomputed), full (only each chunk's input is kept; the recompute
// op before a backward re-makes the chunk's whole stash, GPipe's re-materialization), or block
// (Korthikanti et al.'s full recomputation, Megatron's uniform method with one layer per
// checkpoint: each layer's input is kept and the layers are re-made one at a time, so a backward
// holds one layer's stash; docs/formulas.md section 4).
enum class Recompute { none, selective, full, block };
std::string to_string(Recompute r);               // "none", "selective", "full", "block"
Recompute parse_recompute(const std::string& s);  // throws InputError listing the valid names
// The mode runs the forward again before each backward (a recompute op): full or block.
inline bool reruns_forward(Recompute r) {
  return r == Recompute::full || r == Recompute::block;
}

// Where model data lives between uses. none: on the device. optimizer: ZeRO-Offload (Ren et al.
// 2021) - fp16 parameters stay on the device, gradients stream to host memory during each
// backward, the fp32 master weights and Adam state live on the host and CPU Adam updates them,
// the new fp16 parameters are copied back. chunks: PatrickStar (Fang et al. 2021) - fp16
// parameters (their gradients in the same slots), fp32 master weights and Adam state live in
// fixed-size chunks that move whole between host and device by an eviction plan made from the
// model's costs (planner/chunks.hpp); Adam runs on the device for the chunks whose state fits
// there, on the host for the rest. Activation offload (KARMA) is Plan::offload_activations.
enum class Offload { none, optimizer, chunks };
std::string to_string(Offload o);  // "none", "optimizer", "chunks"

// PatrickStar's chunk size when the plan gives none: 64 Mi fp16 elements (128 MiB); a model
// whose largest tensor is larger gets that tensor's size rounded up to a MiB
// (planner/chunks.hpp, default_chunk_bytes), and a device too small for a layer's working set at
// that size the largest halving of it that fits (chunk_schedules).
inline constexpr std::int64_t kDefaultChunkElements = std::int64_t{64} << 20;

// Activation offload (KARMA, Wahib et al., SC 2020): per stage, its stashed activations are swapped
// to host memory during the forward and back before the backward, or dropped and recomputed.
enum class ActivationChoice { swap, recompute };
std::string to_string(ActivationChoice c);                       // "swap", "recompute"
ActivationChoice parse_activation_choice(const std::string& s);  // throws InputError

// --offload: "none", "optimizer", "activations" or "optimizer,activations" (either order).
// "chunks" alone (PatrickStar); it combines with neither. Throws InputError: "unknown offload
// mode" or, for chunks with another mode, a one-line refusal.
struct OffloadModes {
  Offload optimizer = Offload::none;
  bool activations = false;
};
OffloadModes parse_offload_modes(const std::string& s);

// Where a rank runs. Several ranks may share one (node, gpu): they share its compute and memory.
struct Placement {
  int node = 0;
  int gpu = 0;  // index inside the node
  bool operator==(const Placement&) const = default;
};

// Pipeline ranks (one program each) are numbered pipeline-major: rank = replica * d + stage.
// Stage s of every replica holds the same blocks. With interleaved, device stage s holds chunks
// c = 0..v-1, which are virtual stages c*d + s. Each pipeline rank is a tensor-parallel group of
// t GPUs running the same program on its shards: GPUs placement.gpu .. placement.gpu + t - 1 of
// its node, device rank = pipeline rank * t + TP index.
struct Plan {
  Schedule schedule = Schedule::one_f_one_b;
  int t = 1;        // tensor-parallel size (Megatron), GPUs of one TP group, inside one node
  bool sp = false;  // sequence parallelism (needs t > 1)
  // Optimizer state and fp32 master weights sharded over the w replicas of a stage (Megatron's
  // distributed optimizer, ZeRO-1): gradients reduce-scattered, parameters all-gathered.
  bool distributed_optimizer = false;
  // With the distributed optimizer: the new parameters' all-gather runs in pieces behind the next
  // step's forward instead of before it (Megatron's --overlap-param-gather; simulator and closed
  // form only: the executors refuse it).
  bool overlap_param_gather = false;
  int w = 1;  // data-parallel width (replicas of each stage)
  int d = 1;  // pipeline depth (stages)
  int b = 1;  // microbatch size (samples)
  int m = 1;  // microbatches per optimizer step per replica
  int v = 1;  // model chunks per device (interleaved only)
  // optimizer: with w > 1 needs the distributed optimizer (sharded), with w == 1 none (check()).
  Offload offload = Offload::none;
  // offload chunks: bytes of one parameter chunk in the compute dtype (0: default_chunk_bytes of
  // the model, or where a layer's working set passes the device with it the largest halving of it
  // that fits: chunk_schedules). Chunks need v = 1 (d > 1: each stage its own chunks; t > 1: each
  // GPU of a TP group its shard's; w > 1: each chunk's optimizer state sharded over the replicas),
  // no distributed optimizer, no other offload mode (not yet; check() says so in one line).
  std::int64_t chunk_bytes = 0;
  // offload chunks with w > 1: PatrickStar's data-parallel chunks. Each replica's host keeps only
  // its part (ChunkLayout::shard) of each host-Adam chunk's parameters: a chunk with no gradient
  // yet in the step is dropped from the device instead of copied down, and comes up as the
  // replica's part and an all-gather over the replicas; at the optimizer step the gradient is
  // reduce-scattered on the device and only the replica's part goes down. A chunk holding a tied
  // embedding exchanged between stages (d > 1) stays whole. Needs gpipe or 1f1b (check()).
  // docs/formulas.md section 9, chunks.
  bool chunk_shard = false;
  // Activation offload (KARMA): needs t == 1. `activations` holds each stage's choice (d
  // entries); empty: made by choose_activations (planner/cost_model.hpp) from the cluster. A
  // stage that swaps has no recomputation; one that recomputes has full recomputation.
  bool offload_activations = false;
  std::vector<ActivationChoice> activations;
  // Per-layer choices (KARMA decides per block): one list per stage (d entries), each with one
  // choice per block the stage holds (its chunks' blocks, chunk 0 first, in forward order). The
  // embedding goes with the first block of virtual stage 0, the head with the last block of the
  // last one. Empty: every block of stage s follows activations[s]. A stage whose blocks all make
  // one choice is that per-stage choice; a mixed stage has activations[s] = swap and recompute
  // none: its swapped blocks' stash is swapped, its recomputed blocks recompute before the
  // backward (planner/cost_model.hpp ChunkCost::recompute_layers). set_activation_layers keeps the
  // three lists consistent.
  std::vector<std::vector<ActivationChoice>> activation_layers;
  // Blocks per virtual stage, in pipeline order (d*v entries). Empty: balanced over the model.
  std::vector<std::int64_t> stage_blocks;
  // Recomputation of each stage (d entries). Empty: no recomputation anywhere.
  std::vector<Recompute> recompute;
  // pipeline rank -> device of its first TP member (w*d entries). Empty: not placed yet (place()
  // fills it from a cluster).
  std::vector<Placement> placement;

  int ranks() const { return w * d; }  // pipeline ranks (programs)
  int gpus() const { return t * w * d; }
  int virtual_stages() const { return d * v; }
  std::int64_t global_batch() const { return std::int64_t(w) * m * b; }
  int stage_of(int rank) const { return rank % d; }
  int replica_of(int rank) const { return rank / d; }
  int rank_of(int stage, int replica) const { return replica * d + stage; }
  Recompute recompute_of(int stage) const {
    return recompute.empty() ? Recompute::none : recompute[std::size_t(stage)];
  }
  // The stage runs its forward again before each backward (full or block recompute).
  bool recomputes(int stage) const { return reruns_forward(recompute_of(stage)); }
  // The stage swaps its activations to the host (activation offload, choice made).
  bool swaps(int stage) const {
    return offload_activations && !activations.empty() &&
           activations[std::size_t(stage)] == ActivationChoice::swap;
  }
  bool any_offload() const { return offload != Offload::none || offload_activations; }
  // The stage mixes swapped and recomputed blocks (per-layer activation offload choices).
  bool mixed_activations(int stage) const;
  // Blocks of `stage` that swap / recompute under activation offload (0 without it).
  std::int64_t swapped_layers(int stage) const;
  std::int64_t recomputed_layers(int stage) const;
  // The stage runs a recompute op before each backward: full recompute, or a mixed stage.
  bool has_recompute_op(int stage) const { return recomputes(stage) || mixed_activations(stage); }
  // Optimizer offload over w > 1 replicas (ZeRO-Offload's data parallelism, docs/formulas.md
  // section 9): the gradients accumulate on the device, are reduce-scattered, and each replica
  // copies out, updates on the host and uploads only its 1/w shard; an all-gather follows.
  bool offload_sharded() const { return offload == Offload::optimizer && w > 1; }
};

inline constexpr std::int64_t kMaxGpus = common::kMaxDevices;  // t*w*d

// Structural checks that need no model or cluster: t, w, d, b, m, v in 1 .. kMaxCount; t*w*d at
// most kMaxGpus, w*d at most kMaxRanks, d*v at most kMaxCount; d == 1 for dp; m >= d for 2bw; v > 1
// only for interleaved and m % d == 0 there; list lengths; offload optimizer with w > 1 only with
// the distributed optimizer (sharded) and with it only when w > 1; activation offload's choices d
// entries, each stage's recompute matching its choice; chunks with t = w = v = 1, no 2bw, no
// distributed optimizer, no recompute. Throws PlanError naming the field.
void check(const Plan& plan);

// "none", "optimizer", "activations" or "optimizer,activations".
std::string offload_name(const Plan& plan);

// Sets the activation choices and the recompute list that follows from them (full where a stage
// recomputes, none where it swaps); clears any per-layer choices.
void set_activations(Plan& plan, const std::vector<ActivationChoice>& choices);
// Sets per-layer choices (one list per stage, one entry per block of the stage) and the
// per-stage choices and recompute list that follow: a stage all of one choice is that choice; a
// mixed stage is swap with recompute none. The lists stay as given (written back by to_json).
void set_activation_layers(Plan& plan, const std::vector<std::vector<ActivationChoice>>& layers);
// The choice of each block of `stage` (its blocks in order): activation_layers[stage], or
// activations[stage] for every block. Needs stage_blocks resolved.
std::vector<ActivationChoice> layer_choices(const Plan& plan, int stage);
// Blocks stage s holds over its chunks (stage_blocks resolved).
std::int64_t stage_block_count(const Plan& plan, int stage);

// Balanced split of `layers` blocks into `parts` contiguous stages (the first layers % parts
// stages get one more block).
std::vector<std::int64_t> balanced_split(std::int64_t layers, int parts);

// Fills stage_blocks when empty (balanced) and checks it against the model: d*v entries, each
// >= 1, summing to `layers`. Throws PlanError naming the field.
void resolve_stages(Plan& plan, std::int64_t layers);

// Cluster shape needed to place ranks.
struct DeviceGrid {
  int nodes = 1;
  int gpus_per_node = 1;
  int devices() const { return nodes * gpus_per_node; }
};

// Fills placement when empty, as in the PipeDream-2BW paper: when w <= GPUs per node the w
// replicas of a stage sit inside one node (the all-reduce stays on NVLink); otherwise each
// pipeline's stages are packed into consecutive GPUs (pipelines inside nodes).
// ranks_per_gpu > 1 puts that many consecutive ranks on each GPU (a d-stage plan on one GPU).
// Checks w*d == devices * ranks_per_gpu and that every given placement exists on the grid.
// Throws PlanError naming the field.
void place(Plan& plan, const DeviceGrid& grid, int ranks_per_gpu = 1);

// JSON (format "pipewright.plan/1"); see docs/formats.md.
Plan parse_plan(const common::Json& json, const std::string& source);
common::Json to_json(const Plan& plan);
Plan load_plan(const std::string& path);

}  // namespace pw::planner
