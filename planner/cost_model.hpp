// The closed-form cost model (PipeDream-2BW, Appendix A): step time, throughput and per-device
// memory of a plan from a trace and a cluster. Every formula: docs/formulas.md.
#pragma once

#include <cstdint>
#include <limits>
#include <memory>
#include <vector>

#include "clusters/cluster.hpp"
#include "models/model.hpp"
#include "planner/chunks.hpp"
#include "planner/plan.hpp"
#include "planner/program.hpp"
#include "planner/report.hpp"
#include "traces/trace.hpp"

namespace pw::planner {

// The tensor-parallel collectives of one pass (forward or backward) of a chunk over its TP group,
// for one microbatch, summed by kind: all-reduces, and all-gathers + reduce-scatters (each half an
// all-reduce in a ring). Bytes are whole (unsharded) tensors.
struct TpTraffic {
  double allreduce_bytes = 0;
  std::int64_t allreduces = 0;
  double half_bytes = 0;  // all-gathers and reduce-scatters
  std::int64_t halves = 0;
  bool empty() const { return allreduces == 0 && halves == 0; }
  TpTraffic& operator+=(const TpTraffic& o) {
    allreduce_bytes += o.allreduce_bytes;
    allreduces += o.allreduces;
    half_bytes += o.half_bytes;
    halves += o.halves;
    return *this;
  }
  // As one ring all-reduce: the bytes whose ring all-reduce moves the same data (a half counts
  // half), and the extra latencies of the collectives beyond the first (in ring steps of t - 1).
  double equivalent_allreduce_bytes() const { return allreduce_bytes + half_bytes / 2; }
  std::int64_t latency_steps(int t) const { return (2 * allreduces + halves) * (t - 1); }
};

// Ring time of a chunk's TP collectives over t GPUs on `link` (closed form):
// all-reduce 2(t-1)(alpha + S/(t beta)), all-gather / reduce-scatter (t-1)(alpha + S/(t beta)).
double tp_time_s(const TpTraffic& traffic, int t, const clusters::Link& link);

struct ChunkCost;
// What a chunk's backward TP collectives add to its backward: the blocking ones, plus what each
// asynchronous group takes beyond the GEMMs it hides behind (docs/formulas.md section 4).
double tp_backward_s(const ChunkCost& ch, int t, const clusters::Link& link);

// What one model chunk (the layers of one virtual stage) costs for one microbatch of size b on
// one GPU of its TP group. The simulator replays these; the closed form sums them per stage.
// Compute times exclude the TP collectives, which are in tp_forward / tp_backward.
struct ChunkCost {
  int stage = 0;
  int chunk = 0;
  int virtual_stage = 0;
  std::int64_t blocks = 0;
  bool has_embedding = false;
  bool has_head = false;
  double forward_s = 0;
  double backward_s = 0;             // without the recompute forward
  double recompute_s = 0;            // the recompute forward before the backward
  double selective_recompute_s = 0;  // the attention cores recomputed before the backward
  double optimizer_s = 0;
  TpTraffic tp_forward, tp_backward;  // per microbatch (a full recompute repeats tp_forward)
  // The backward's asynchronous TP collectives (models::LayerCosts) and the GEMM time they hide
  // behind: the backward's weight-gradient and input-gradient GEMMs (0 in a measured trace, which
  // does not separate them: nothing hides there).
  TpTraffic tp_backward_wgrad, tp_backward_dgrad;
  double backward_weight_s = 0, backward_input_s = 0;
  std::int64_t parameters = 0;       // including the tied-embedding copy on the last stage
  std::int64_t stash_bytes = 0;      // one microbatch's stash without recompute
  std::int64_t selective_bytes = 0;  // one microbatch's stash with selective recompute
  std::int64_t input_bytes = 0;      // the chunk's input (all it keeps with recompute)
  // Every layer's input (the embedding's whole stash): what a forward keeps with block recompute.
  std::int64_t layer_inputs_bytes = 0;
  std::int64_t output_bytes = 0;     // activation sent to the next virtual stage (0 for the last)
  std::int64_t workspace_bytes = 0;  // largest transient of its layers
  // Activation offload with per-layer choices on a mixed stage (Plan::mixed_activations; all 0
  // elsewhere): the chunk's blocks that recompute (the embedding with the first block of virtual
  // stage 0, the head with the last block of the last). Their stash is dropped after the forward,
  // one checkpoint kept per run of them (the run's input), and re-made by a recompute op before the
  // backward; the other layers' stash (swap_bytes) is what a swapped unit copies.
  std::int64_t recompute_layers = 0;
  double layers_recompute_s = 0;            // the recompute op: the recomputed layers' forward
  TpTraffic layers_recompute_tp;            // and their TP collectives (t > 1)
  std::int64_t layers_recompute_bytes = 0;  // their stash, re-made before the backward
  std::int64_t checkpoint_bytes = 0;        // their checkpoints, kept from forward to backward
  std::int64_t swap_bytes = 0;              // the swapped layers' stash (stash_bytes if none)
  // A recomputing chunk's forward (full recompute, or a mixed stage's recomputed layers) runs
  // those layers through one scratch as large as the largest one's stash (a mixed stage's
  // embedding runs in its first block's place: not counted), freed when the forward ends. Block
  // recompute: the same, re-made layers in it too, plus with SP the full-width rows (b·T·C·e)
  // its layers' all-gathers fill.
  std::int64_t recompute_scratch_bytes = 0;
  // What a forward of this chunk keeps on the device until its backward on a mixed stage.
  std::int64_t mixed_kept_bytes() const { return swap_bytes + checkpoint_bytes; }
};

ChunkCost chunk_cost(const models::ModelCosts& mc, const traces::Trace& trace, const Plan& plan,
                     int stage, int chunk);
// What one layer of kind `kind` costs for one microbatch of size p.b on one GPU of its TP group
// (a ChunkCost of that layer alone: its times, bytes and TP collectives; offload chunks run their
// moments layer by layer).
ChunkCost layer_cost(const models::ModelCosts& mc, const traces::Trace& trace, const Plan& p,
                     models::LayerKind kind);

// The all-reduce of `bytes` over stage `stage`'s w replicas as the simulator runs it (a ring, or
// hierarchical over nodes; docs/formulas.md §4). A ring reduce-scatter or all-gather takes half.
double data_parallel_allreduce_s(const clusters::Cluster& c, const Plan& p, int stage,
                                 double bytes);

// --- Optimizer offload (ZeRO-Offload, plan.offload == optimizer): docs/formulas.md, section 9 ---

// Host bytes per parameter whose optimizer lives on the host: the optimizer state
// (optimizer_bytes_per_parameter: fp32 master + Adam m, v), an fp32 gradient accumulator (4) and
// the transfer buffer in the compute dtype (the fp16 gradient arrives there; the new fp16
// parameters leave from it). 18 for fp16/bf16, 16 for fp32.
// Sharded (w > 1): no fp32 accumulator (the microbatches' gradients are summed on the device,
// before the reduce-scatter; the shard's gradient arrives in the transfer buffer): 14 for
// fp16/bf16. fp32 has no separate master (optimizer state m, v): its transfer buffer is the master
// copy, and the shard's gradient lands beside it (4 B): 16 for fp32, as unsharded.
std::int64_t offload_host_bytes_per_parameter(models::DType dtype, bool sharded = false);

// One chunk's offload: the gradients its backward streams to the host, the parameters CPU Adam
// updates there, in tiles of one layer each (forward order) that pipeline with their upload.
struct ChunkOffload {
  std::int64_t streamed_parameters = 0;  // gradients sent to the host by each backward
  // With tied embeddings and d > 1 the tied tensor's gradient stays on the device (the tied
  // exchange sums it there); stage 0 copies it to the host once per step, after the exchange.
  std::int64_t resident_parameters = 0;
  std::int64_t tied_copy_out_parameters = 0;
  std::vector<std::int64_t> tiles;  // parameters CPU Adam updates, one tile per layer
  // Sharded (w > 1): the replica's shard of the chunk's reduce-scattered gradient, copied to the
  // host once per step (streamed_parameters is 0 then: the backward keeps its gradients).
  std::int64_t shard_copy_out_parameters = 0;
  std::int64_t host_parameters() const;
  std::int64_t largest_tile() const;
};
// With w > 1 (Plan::offload_sharded) `replica`'s shard: each layer's tile split over the w
// replicas, replica r taking floor(n / w) + (r < n mod w ? 1 : 0) of a tile of n parameters.
ChunkOffload chunk_offload(const models::ModelCosts& mc, const Plan& p, const ChunkCost& ch,
                           int replica = 0);

// A rank's path to host memory for its gradient copies, with every rank copying at once: its
// GPU's link shared by the ranks on that GPU, the uplink shared by the ranks behind it (cluster
// host.gpus_per_uplink).
struct HostPath {
  double bandwidth_bytes_per_s = 0;  // one direction
  double latency_s = 0;
  double time_s(double bytes) const { return latency_s + bytes / bandwidth_bytes_per_s; }
};
HostPath host_path(const clusters::Cluster& c, const Plan& p, int rank);

// The host parameters P_h of every rank (by rank): what its CPU Adam updates and uploads.
std::vector<std::int64_t> host_parameters_by_rank(const models::ModelCosts& mc,
                                                  const traces::Trace& trace, const Plan& p);
// Processor sharing with simultaneous starts (section 9): ranks sharing a resource each get an
// equal share while they work, so rank i's work W_i ends after sum_j min(W_j, W_i) / capacity.
// Its effective share of the capacity: W_i / sum_j min(W_j, W_i), over the ranks j sharing it.
// CPU Adam parameters/s of a rank: the node's rate (cores x rate per core) so shared.
double cpu_adam_rate(const clusters::Cluster& c, const Plan& p, int rank,
                     const std::vector<std::int64_t>& host_parameters);
// The upload path of a rank (host step: new parameters to the device), its GPU's link and uplink
// so shared among the ranks whose uploads use them.
HostPath upload_path(const clusters::Cluster& c, const Plan& p, int rank,
                     const std::vector<std::int64_t>& host_parameters);

// Everything offload costs one rank per step.
struct RankOffload {
  std::vector<ChunkOffload> chunks;
  std::vector<double> copy_out_s;       // per chunk: one microbatch's gradients to the host
  std::vector<double> tile_parameters;  // CPU Adam tiles in order (all chunks)
  std::vector<double> tile_upload_s;    // their uploads
  double tied_copy_out_s = 0;           // stage 0's tied gradient, once per step
  double shard_copy_out_s = 0;          // sharded (w > 1): the gradient shards, once per step
  double cpu_adam_s = 0;                // sum over the tiles
  double upload_s = 0;                  // sum over the tiles (each with its latency)
  double host_step_s = 0;  // tied or shard copy + the tiles' two-stage pipeline (Adam, upload)
  std::int64_t device_gradient_bytes = 0;  // staging (2 x largest tile) + resident tied gradient
  std::int64_t host_bytes = 0;
  std::int64_t pinned_bytes = 0;
  std::int64_t copy_out_bytes_per_step = 0;  // device -> host
  std::int64_t copy_in_bytes_per_step = 0;   // host -> device
};
RankOffload rank_offload(const models::ModelSpec& model, const models::ModelCosts& mc,
                         const clusters::Cluster& cluster, const Plan& p, int rank,
                         const std::vector<ChunkCost>& chunks,
                         const std::vector<std::int64_t>& host_parameters);
// The host step's makespan: tile i's Adam (a_i) starts when tile i-1's ends; its upload (u_i)
// when both its Adam and upload i-1 are done (one copy engine per direction).
double two_stage_pipeline_s(const std::vector<double>& a, const std::vector<double>& u);
// Sets a rank's CPU Adam rate (parameters/s) and times its host step with it: cpu_adam_s and
// host_step_s.
void time_host_step(RankOffload& r, double cpu_adam_params_per_s);
// Processor sharing, event by event (docs/formulas.md section 9): entry i, from `release` on, runs
// its phases in order, each either `amount` units of work on its group's shared resource or a
// pause of `amount` seconds that uses none of it. While entries of one group are in a work phase,
// each runs at min(cap, capacity / the weights of those entries summed): `weight` identical jobs
// in lockstep (copies of one CPU Adam, a stage's replicas behind one uplink), `capacity` the
// group's units/s as the entry sees it, `cap` what the entry could take alone.
struct SharedPhase {
  bool work = false;
  double amount = 0;
};
struct SharedEntry {
  double release = 0;
  std::vector<SharedPhase> phases;
  int group = 0;
  double weight = 1;
  double capacity = 1;
  double cap = std::numeric_limits<double>::infinity();
};
// Per entry, the time at which each of its phases ended.
std::vector<std::vector<double>> processor_sharing(const std::vector<SharedEntry>& entries);
// One resource of `capacity` units/s among jobs of `work` units released at `release` (s): while k
// jobs are active each runs at capacity / k. Returns each job's finish time. With `copies` (one
// per entry, else 1 each) entry i is copies[i] identical jobs in lockstep (each of work[i] units),
// and while entries are active each of their jobs runs at capacity / (the active entries' copies
// summed).
std::vector<double> processor_sharing_finish(const std::vector<double>& work,
                                             const std::vector<double>& release, double capacity,
                                             const std::vector<double>& copies = {});
// Throws InputError when optimizer offload cannot run on the cluster (no CPU Adam rate, no host
// link).
void check_offload_cluster(const clusters::Cluster& cluster, const Plan& p);

// --- Activation offload (KARMA, plan.offload_activations): docs/formulas.md, section 9, activation
// offload ---

// One stage's activation swapping over one step (its compute order, step_compute_order), with
// the copies on one copy engine per direction (FIFO) over the rank's host path (host_path).
struct StageSwap {
  ActivationChoice choice = ActivationChoice::recompute;
  int units_per_step = 0;           // microbatch-chunks swapped per step (swap_plan)
  std::int64_t bytes_per_step = 0;  // copied each way per step
  std::int64_t device_bytes = 0;    // peak stash bytes on the device, the copies hiding
  // Per compute op of the step order: the stash bytes on the device while it runs (a forward's
  // with its recomputed layers' scratch, a backward's with its re-made stash) and the message
  // buffers held then (op_message_buffers): the device peak is the largest bytes + buffers x O.
  std::vector<std::pair<std::int64_t, int>> moments;
  std::int64_t host_bytes = 0;  // peak swapped bytes on the host (pinned buffers)
  double copy_s = 0;            // the largest unit's copy, one direction
  double window_s = 0;          // the shortest compute op a copy hides behind
  double stall_s = 0;           // per step: the stage alone, back to back, with its copies
};
// The figures of stage `stage` swapping (plan.swaps(stage) need not hold: computed as if it did).
// `tp`: the TP group's link (tp_link; used when t > 1), whose collectives lengthen each compute op.
StageSwap stage_swap(const Plan& p, int stage, const std::vector<ChunkCost>& chunks,
                     const HostPath& path, const clusters::Link& tp);
// The stall of a compute order with swaps (docs/formulas.md section 9, activation offload): compute
// ops back to back, each download after its forward, each upload issued with the op before its
// backward, after its download, and each backward after its upload; durations[i] is slot i's
// compute, copy_s[i] the copy of slot i's unit (one direction). Returns the makespan minus the
// summed compute.
// recompute_s[i] (may be empty): a mixed stage's recompute op run before backward slot i, before
// it waits for its upload.
double swap_stall_s(const std::vector<ComputeSlot>& order, const SwapPlan& sp,
                    const std::vector<double>& durations, const std::vector<double>& copy_s,
                    const std::vector<double>& recompute_s = {});
// KARMA's choice per layer (docs/formulas.md section 9, per-layer choices), one list per stage
// with one entry per block (Plan::activation_layers). For each stage, with the window W the
// shortest compute op of its step (forward or backward with its TP collectives, without
// recompute; 2bw: its stream's steady state) and the copy of a
// unit's swapped layers over the host path: the most leading blocks k whose swap, one direction,
// hides behind W (copy_s(k) <= W) swap, the rest recompute (k = 0: the whole stage recomputes).
// A stage where nothing can swap (1F1B's last stage: each backward right after its forward) gets
// all `swap` when keep_unswappable (it keeps its stash, as without offload: no recompute time) and
// all `recompute` otherwise (less memory); the planner tries both. Then memory: a stage whose
// choice would not fit on the device (its peak above capacity_bytes; 0: the device's memory)
// swaps fewer blocks, recomputing them, until it fits (unchanged when nothing fits). Then host
// memory: a node whose ranks' host bytes (optimizer offload's and the swapped stashes', pinned)
// exceed host.memory_bytes or host.pinned_memory_bytes (t GPUs' each per rank) swaps one block
// fewer on its stage with the most swapped host bytes until it fits or nothing there swaps. `plan`
// placed and resolved. set_activation_layers(plan, choose_activations(...)) applies it.
std::vector<std::vector<ActivationChoice>> choose_activations(
    const models::ModelSpec& model, const traces::Trace& trace, const clusters::Cluster& cluster,
    const Plan& plan, bool keep_unswappable = true, double capacity_bytes = 0);

// The "chunks" object of a report's offload rank (docs/formats.md): the schedule's figures.
common::Json chunk_report(const ChunkSchedule& cs);

// What one pipeline stage (all chunks a device holds) costs for one microbatch of size b.
struct StageCost {
  int stage = 0;
  std::int64_t blocks = 0;
  bool has_embedding = false;
  bool has_head = false;
  Recompute recompute = Recompute::none;
  std::int64_t parameters = 0;  // per GPU, including the tied-embedding copy on the last stage
  double forward_s = 0;         // t_f(s), TP collectives included
  double backward_s = 0;        // t_b(s), including the recompute forward when recomputing
  double tp_s = 0;              // TP collectives inside forward_s + backward_s
  // Per model chunk: its part of one microbatch's forward (TP collectives included) and backward
  // (recompute and TP included), before offload and swaps; the interleaved closed form walks its
  // compute order with t_f(s) and t_b(s) split in these proportions (pipeline_time).
  std::vector<double> chunk_forward_s, chunk_backward_s;
  double optimizer_s = 0;  // AdamW over the stage's parameters (its shard with the
                           // distributed optimizer); with offload the host step
  RankOffload offload;     // offload figures of one rank (plan.offload != none)
  StageSwap swap;          // activation offload of one rank (plan.swaps(stage))
  double send_s = 0;       // activation to stage s+1 (and gradient back), one microbatch
  // What that send moves through its link's bottleneck: the activation piece times the replicas
  // (and TP GPUs) sharing a node's NIC with it.
  double send_bytes = 0;
  double allreduce_s = 0;            // ring all-reduce of the stage's gradients over w replicas
  double allreduce_network_s = 0;    // the part of it through the nodes' NICs (inter-node steps)
  std::int64_t in_flight = 0;        // microbatches stashed at once (n_s)
  std::int64_t stash_bytes = 0;      // A_s(b): one microbatch's stash without recompute
  std::int64_t selective_bytes = 0;  // one microbatch's stash with selective recompute
  std::int64_t input_bytes = 0;      // I_s(b): one microbatch's stage input (kept with recompute)
  std::int64_t layer_inputs_bytes = 0;  // L_s(b): its layers' inputs (kept with block recompute)
  MemoryBreakdown memory;               // one rank of this stage
};

struct Estimate {
  std::vector<StageCost> stages;
  double pipeline_s = 0;   // forward/backward part of a step, communication included
  double allreduce_s = 0;  // exposed data-parallel collectives (slowest stage; §4's overlap)
  double tied_s = 0;       // exposed tied-embedding exchange (gradient, then new weights)
  double optimizer_s = 0;  // slowest stage's optimizer step
  RunReport report;        // source "analytic", with "estimate" details in report.extra
  // offload chunks: per stage, its layout and eviction plan (planner/chunks.hpp).
  std::shared_ptr<const std::vector<ChunkSchedule>> chunks;
};

// Pieces of the data-parallel collectives that overlap compute in the closed form (gradient
// buckets behind the last backward, parameter pieces ahead of the first forward): the simulator's
// default number of gradient buckets.
inline constexpr int kOverlapPieces = 4;

// `plan` must be placed (place()) and resolved (resolve_stages()); `trace` must hold plan.b.
// Throws InputError when the trace lacks the microbatch size, PlanError when the plan does not
// match the model or cluster.
Estimate estimate(const models::ModelSpec& model, const traces::Trace& trace,
                  const clusters::Cluster& cluster, const Plan& plan);

// Bytes of optimizer state per parameter: AdamW m and v in fp32, plus an fp32 master copy when
// the compute dtype is 16-bit.
std::int64_t optimizer_bytes_per_parameter(models::DType dtype);

// Weights, gradients and optimizer state of one GPU holding `parameters` (its shard): the
// optimizer state split over the w replicas with the distributed optimizer. Activations and
// workspace are left 0.
MemoryBreakdown static_memory(const models::ModelSpec& model, const Plan& p,
                              std::int64_t parameters);

// What each GPU of a TP group sends of a pipeline message of `bytes` (one GPU's activation or
// gradient): its 1/t (Megatron's scatter/gather); with SP the tensor is already the GPU's shard.
std::int64_t message_piece_bytes(const Plan& p, std::int64_t bytes);

// The pipeline message buffers a device of stage s holds at its peak beside its stashes (docs/
// formulas.md section 4, "messages"), each a block's output (or input gradient) at b: b T C
// elements, the GPU's shard with SP. As the executors hold them: the message a compute op
// received (an activation before a forward, a gradient before a backward; not on virtual stage
// 0's forwards), the one it produces for the next or previous stage (not on the last virtual
// stage's forwards), and the previous compute op's sent message, kept until the second compute
// op after the one that produced it begins (the send overlaps the next compute op; none on
// gpipe's last stage, whose peak follows a forward that sends nothing). 0 with d = 1 and v = 1
// (with v > 1 one device's model chunks hand their messages to each other: counted the same).
int message_buffers(const Plan& p, int s);
std::int64_t message_buffer_bytes(const Plan& p, const traces::Trace& trace, int s);
// The buffers held while a backward of stage s runs (and the recompute op before it), by the
// same rules: message_buffers less one on the last stage of 1F1B and 2BW (d > 1, v = 1), whose
// backward receives nothing and follows a forward that sent nothing. Where a stage's peak is a
// backward (full recompute, a mixed stage's re-made stash) it is the count at the peak.
int backward_message_buffers(const Plan& p, int s);
// The buffers held while compute op i of a stage's step order runs, as the executors hold them:
// the message it received (an activation before a forward of a virtual stage > 0, a gradient
// before a backward of one before the last), the one it produces (a forward's activation for the
// next virtual stage, a backward's gradient for the previous one) and the previous compute op's
// sent message (the order is cyclic: op 0 follows the step's last). 0 with d = 1 and v = 1.
int op_message_buffers(const Plan& p, int s, const std::vector<ComputeSlot>& order, std::size_t i);

// The link a TP group's ring runs over: between the group's first two GPUs (a group stays inside
// a node, on a uniform intra-node fabric).
clusters::Link tp_link(const clusters::Cluster& c, const Plan& p, int rank);

// Fills samples/s, tokens/s, model FLOP/s and MFU of a report from its iteration time and plan.
void set_throughput(RunReport& r, const models::ModelSpec& model, const clusters::Cluster& cluster,
                    int gpus_used);

// Ring all-reduce time of `bytes` over n participants on a link: 2(n-1)(alpha + bytes/(n*beta)).
double ring_allreduce_s(double bytes, int n, const clusters::Link& link);

}  // namespace pw::planner
