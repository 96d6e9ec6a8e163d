// PatrickStar's chunk-based model data (Fang et al., "PatrickStar: Parallel Training of
// Pre-trained Models via Chunk-based Dynamic Memory Management", arXiv 2108.05818), planned
// from the model's costs: the chunk layout, and an eviction plan per moment (each layer's forward
// and backward) that the programs carry as explicit copy ops. Formulas: docs/formulas.md, section
// 9 (chunks).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "clusters/cluster.hpp"
#include "common/error.hpp"
#include "models/model.hpp"
#include "planner/plan.hpp"
#include "traces/trace.hpp"

namespace pw::planner {

// One parameter tensor of the model, in first-use (forward) order. Layers are numbered in forward
// order: 0 the embedding, 1 .. L the blocks, L + 1 the head.
struct ChunkTensor {
  std::string name;  // "wte", "h.3.qkv.w", "lnf.w", ...
  int layer = 0;
  std::int64_t elements = 0;
  int chunk = -1;           // the chunk it lives in (chunk_layout)
  std::int64_t offset = 0;  // elements before it in that chunk
  // d > 1 with tied embeddings: the last stage's copy of "wte" (in its head layer). Stage 0 owns
  // the update; this copy gets no Adam step here (the tied exchange brings its new weights).
  bool tied_copy = false;
};

// The parameter tensors one rank of a TP group of t holds (all of them with t = 1), in first-use
// order; each layer's sum is its LayerCosts::parameters at t (tested). Tied embeddings: "wte"
// once (the head uses it too).
std::vector<ChunkTensor> model_tensors(const models::ModelSpec& model, int t = 1);

// A moment's working set (its layer's chunks and the non-model memory) passes the device. With
// `fitting_chunk_bytes` > 0 a smaller chunk size (smaller_fitting_chunk_bytes) lets every stage's
// working set fit, and the message says so.
class ChunkWorkingSetError : public InputError {
 public:
  ChunkWorkingSetError(const std::string& what, std::int64_t fitting)
      : InputError(what), fitting_chunk_bytes(fitting) {}
  std::int64_t fitting_chunk_bytes = 0;
};

// The chunk size a plan without chunk_bytes gets: kDefaultChunkElements elements of the compute
// dtype, or, when a tensor is larger, that tensor's bytes rounded up to a MiB.
std::int64_t default_chunk_bytes(const models::ModelSpec& model);

struct ChunkLayout {
  int stage = 0;  // the pipeline stage (the device's rank in the pipeline) whose layers these are
  // Per layer of the stage, its model layer (0 embedding, 1 .. L blocks, L + 1 head): consecutive
  // with v = 1; with interleaving (v > 1) the device's model chunks' layers one after the other
  // (model chunk k is virtual stage k d + stage), so they jump between its model chunks.
  std::vector<int> model_layers;
  // Per model chunk k of the device (v of them; one with v = 1), its first layer; v + 1 bounds, the
  // last the stage's layer count.
  std::vector<int> chunk_bounds;
  int model_layer(int layer) const { return model_layers.at(std::size_t(layer)); }
  std::int64_t chunk_bytes = 0;  // S_p: one parameter chunk in the compute dtype
  // What one chunk holds on the device and moves: S_p, or 2 S_p with a gradient half beside the
  // parameters when m > 1 (a gradient cannot reuse its parameter's slot while later microbatches
  // still need the parameter) or the model is fp32 (no fp32 master beside the parameters to keep
  // the weights a gradient would overwrite). Set by chunk_schedule.
  std::int64_t move_bytes = 0;
  // What one copy moves (a unit): with the flush schedules the whole chunk (parts = 1: its
  // parameters and gradient half, move_bytes); with 2bw three parts of S_p each (parts = 3,
  // move_bytes = S_p): the slots of the two live weight versions (version v in part v % 2) and the
  // gradient. Unit u is part u % parts of chunk u / parts. Set by chunk_schedule.
  int parts = 1;
  std::int64_t chunk_elements = 0;  // S_p / e
  // Data parallelism (w > 1 replicas of the stage): every replica holds every parameter chunk and
  // its gradient; each chunk's Adam-stepped elements (its first chunk_owned) are split into w
  // contiguous parts of shard_elements = ceil(chunk_elements / w), and replica r keeps the
  // optimizer state of part r only and steps it (the distributed optimizer's rule, per chunk).
  int replicas = 1;
  std::int64_t shard_elements = 0;  // chunk_elements / replicas, rounded up
  // S_os: one replica's fp32 master + Adam m, v of a chunk (shard_elements x 12; fp32 models
  // m, v: x 8)
  std::int64_t os_chunk_bytes = 0;
  std::vector<ChunkTensor> tensors;
  std::vector<std::int64_t> chunk_parameters;  // elements filled, per chunk
  // Per layer of the stage (layer k is model layer model_layer(k)): the chunks its tensors use,
  // ascending, and its name ("embedding", "block 0", ..., "head").
  std::vector<std::vector<int>> layer_chunks;
  std::vector<std::string> layer_names;
  std::vector<std::int64_t> chunk_owned;  // per chunk: parameters Adam steps here (no tied copy)
  // Sharded chunks (Plan::chunk_shard): per chunk, whether each replica's host keeps only its part
  // of the parameters (every chunk but one holding a tied embedding exchanged between stages), and
  // the bytes of one part, P = shard_elements x e (0 without sharding).
  std::vector<bool> sharded;
  std::int64_t part_bytes = 0;
  bool is_sharded(int chunk) const { return !sharded.empty() && sharded[std::size_t(chunk)]; }
  // Replica r's part of a sharded chunk's capacity, elements [first, second): [r x shard_elements,
  // (r + 1) x shard_elements) inside [0, chunk_elements) (replica 0's is P's, the largest). It
  // holds the replica's Adam shard (`shard`) from its start. part_bounds: the replicas + 1 bounds.
  std::pair<std::int64_t, std::int64_t> part(int replica) const;
  std::vector<std::int64_t> part_bounds() const;
  int chunks() const { return int(chunk_parameters.size()); }
  int units() const { return chunks() * parts; }
  // With 2bw (parts = 3): unit u is a weight version's slot (or role), not the gradient.
  bool version_unit(int unit) const { return parts > 1 && unit % parts != 2; }
  // The unit that holds chunk c's gradient: the chunk itself, or with 2bw its gradient part.
  int gradient_unit(int chunk) const { return parts == 1 ? chunk : chunk * parts + 2; }
  // What a part-marked copy (ChunkCopy::part, Op::part) of a sharded chunk's unit does (the one
  // rule the planner's figures, the simulator and the executor follow; chunk_layout's comment
  // below): up, the replica's part and an all-gather, or with 2bw a gradient part's zeros made on
  // the device; down, nothing, or at the optimizer step the gradient's part after its
  // reduce-scatter (a 2bw version's slot is a drop there too).
  enum class PartCopy { upload, zero_fill, drop, gradient_down };
  PartCopy part_copy(int unit, bool to_device, bool at_step) const {
    if (to_device) return parts > 1 && !version_unit(unit) ? PartCopy::zero_fill : PartCopy::upload;
    return at_step && !version_unit(unit) ? PartCopy::gradient_down : PartCopy::drop;
  }
  int layers() const { return int(layer_chunks.size()); }
  // The bytes of unit u that are weights and gradients (the report's categories): a whole chunk's
  // S_p and move_bytes - S_p; with 2bw a version slot's S_p or the gradient's.
  std::int64_t unit_weight_bytes(int unit) const;
  std::int64_t unit_gradient_bytes(int unit) const;
  // Replica r's part of chunk c: elements [first, second) of it, inside [0, chunk_owned[c]).
  std::pair<std::int64_t, std::int64_t> shard(int chunk, int replica) const;
  // The parts' replicas + 1 ascending bounds (what the transport's reduce-scatter and all-gather
  // take); {0, chunk_owned[c]} with one replica.
  std::vector<std::int64_t> shard_bounds(int chunk) const;
  // The elements Adam steps on the replica with the most (replica 0): chunk_owned with w = 1.
  std::int64_t adam_elements(int chunk) const;
};

// Tensors enter chunks in first-use order; one that does not fit in the current chunk's free
// space opens a new chunk (PatrickStar's chunk list). Throws InputError naming the largest tensor
// and by how much it passes the chunk when chunk_bytes is too small.
ChunkLayout chunk_layout(const models::ModelSpec& model, std::int64_t chunk_bytes, int t = 1);

// The layout of one pipeline stage of a resolved plan: its layers only (its blocks, the embedding
// on stage 0, the head on stage d-1; with v > 1 those of each of its model chunks, in model
// order), renumbered from 0, with, when the model ties its embeddings and d > 1, the last
// stage's copy of "wte" after the head's own tensors; its optimizer state sharded over the plan's
// w replicas.
ChunkLayout chunk_layout(const models::ModelSpec& model, std::int64_t chunk_bytes, const Plan& plan,
                         int stage);

// A copy of one unit (ChunkLayout::parts: a whole chunk, or with 2bw one of its three parts)
// between host and device, move_bytes. In a 2bw segment's plan the unit's part is a role (0 the
// older live version, 1 the newer, 2 the gradient); the programs carry the part it is in that
// segment (ChunkSchedule::unit_in).
//
// Sharded chunks (ChunkLayout::sharded, `part`): the replica's part only. To the device: its part
// of the parameters up (P), then an all-gather of the chunk over the stage's replicas (its
// gradient half, if any, starts at zero). To the host before a layer: a drop (no bytes: the chunk
// has no gradient yet in the step, its parameters' part is on the host). To the host at the
// optimizer step: its gradient reduce-scattered over the replicas on the device, then the
// replica's part of it down (P). A sharded chunk with a gradient moves whole (part false).
// With 2bw (parts = 3) a version's slot is always its part (its weights never change while
// live): up as the part and an all-gather, down as a drop (at the optimizer step too; CPU Adam
// writes the new version's part into the older slot's on the host). The gradient part, before
// its first backward of the segment, comes up as zeros (a zero fill: no bytes, no all-gather) and
// goes down as a drop; afterwards it moves whole, and at the optimizer step its part comes down
// after its reduce-scatter, as a flush schedule's chunk.
struct ChunkCopy {
  bool to_device = false;
  int unit = 0;
  bool part = false;
  bool operator==(const ChunkCopy&) const = default;
};

// One moment of the step: a layer's forward, recompute or backward, with the copies that run
// before it (evictions to the host first, furthest next use first, then the uploads of its
// missing chunks).
struct ChunkMoment {
  int slot = 0;  // the compute op of the step (step_compute_order) it belongs to
  bool backward = false;
  // With full recompute: a layer of the recompute op that comes right before the backward of
  // `slot` (its forward again, ascending; backward false).
  bool recompute = false;
  // With block recompute: a backward that re-makes its layer's stash from the layer's kept input
  // (its forward again, into the scratch X) before it back-propagates it; compute_s is both. Not
  // the embedding's, whose kept input (the token ids) is its whole stash.
  bool remake = false;
  int layer = 0;
  // 2bw: the op computes with the newer of the two live weight versions (the one the segment's
  // opening optimizer step made), else the older; a backward also uses the gradient.
  bool newer = false;
  // Activations taken after the moment's copies, before its layer runs, and given back after it
  // (docs/formulas.md section 9, chunks): without recompute a forward takes its layer's stash
  // less its input slot (which the layer before it took) and the next layer's input slot, which it
  // writes (a model chunk's first layer its whole stash, its last no slot), and the backward gives
  // the stash back; with full recompute a forward's first layer takes the stage
  // input I and the scratch X, its last layer gives X back, the recompute op's layers take their
  // stashes (as a forward without recompute: each writes the next one's input slot), the backward's
  // layers give them back and its last one I too. With block recompute a forward's layer takes the
  // input of the layer after it (its first its own and X too, its last gives X back), and a
  // backward's gives its input back (its first takes X, its last gives it back).
  std::int64_t alloc_bytes = 0, free_bytes = 0;
  std::vector<ChunkCopy> copies;
  std::int64_t non_model_bytes = 0;  // N_k: activations held (alloc_bytes in) + workspace
  int resident = 0;                  // units on the device during the moment
  std::int64_t weight_bytes = 0, gradient_bytes = 0;  // of those units (resident x move_bytes)
  double compute_s = 0;  // the layer's forward, recompute or backward (trace)
  // t > 1: the layer's TP collectives (the forward's for a forward or recompute; a backward's
  // blocking ones plus what its asynchronous ones take beyond the GEMMs they hide behind: §4's
  // tp_backward_s of the layer), on the TP group's link; 0 with t = 1.
  double tp_s = 0;
  models::LayerKind kind = models::LayerKind::block;  // the layer's kind
  // "forward of block 3", "recompute of head", ...
  std::string label(const ChunkLayout& layout) const;
};

// 2bw: the stream of compute ops between two optimizer steps (a segment: the backwards of step t
// beside the forwards of step t + 1 on the stages before the last) has one of these shapes, each
// with its own eviction plan from the same fixed point: the first segment of a run from step 0
// (one live version), or of a resumed run (two, and the warm-up's forwards), each also as the
// run's only segment; the steady state; the run's last segment (no forwards of a next step).
enum class ChunkSegment { fill, fill_last, resumed, resumed_last, steady, last };
inline constexpr int kChunkSegments = 6;
// The shape of segment `step` (the ops before step's optimizer step, after the previous one's) in
// a run of steps first_step .. first_step + steps - 1.
ChunkSegment chunk_segment(int first_step, int steps, int step);
const char* to_string(ChunkSegment segment);

// One segment's plan (2bw): its moments with their copies (parts as roles), and per unit whether
// it goes to the host for CPU Adam at the segment's optimizer step.
struct ChunkSegmentPlan {
  std::vector<ChunkMoment> moments;
  std::vector<bool> adam_download;
  std::int64_t device_peak_bytes = 0;
  int peak_moment = 0;
};

// The eviction plan of one rank (one pipeline stage: each stage has its own) for one step (every
// step the same: it starts from where the step ends, its fixed point). With 2bw one plan per
// segment shape (ChunkSegment), each from and back to the same fixed point; the figures of one
// step are the steady segment's, the peaks the largest of any segment's.
struct ChunkSchedule {
  ChunkLayout layout;
  std::int64_t budget_bytes = 0;      // B: the device's memory
  std::int64_t workspace_bytes = 0;   // W: the largest layer workspace, held throughout
  int device_adam_chunks = 0;         // K: chunks 0 .. K-1 keep their state on the device
  std::vector<bool> start_on_device;  // per unit, at each step's start and end
  // Per compute op of the stage's step (m forwards and m backwards in its order,
  // step_compute_order: 1f1b interleaves them), its layers: forward ascending, backward descending,
  // with full recompute the recompute op's (ascending) before each backward's. 2bw: the steady
  // segment's (the others' in `segments`).
  std::vector<ChunkMoment> moments;
  std::vector<bool> adam_download;  // per unit of a host-Adam chunk: on the device at the end
  std::vector<ChunkSegmentPlan> segments;  // 2bw: per ChunkSegment
  // The moments and downloads of the segment that ends with step `step`'s optimizer step in a run
  // of steps first_step .. first_step + steps - 1 (flush schedules: every step's).
  const std::vector<ChunkMoment>& moments_of(int first_step, int steps, int step) const;
  const std::vector<bool>& adam_download_of(int first_step, int steps, int step) const;
  // The unit a plan's (role) unit is in the segment of step `step`: with 2bw the older version of
  // that segment is in part (step + 1) % 2, the newer in step % 2; else the unit itself.
  int unit_in(int unit, int step) const;
  // Per chunk, of replica 0's part (the largest; the whole chunk with w = 1):
  std::vector<double> device_adam_s;  // Adam on the device (trace's rate)
  std::vector<double> host_adam_s;    // CPU Adam (the node's rate, shared)
  double copy_s = 0;                  // one chunk copy, one direction: alpha_h + S_p / beta_h
  double part_copy_s = 0;             // sharded chunks: one part's copy, alpha_h + P / beta_h
  // The copy's path: its latency, its GPU link's share (pcie / replicas on the GPU) and the
  // uplink's bandwidth, and the stage's replicas behind that uplink (copying in lockstep).
  double copy_latency_s = 0, link_bytes_per_s = 0, uplink_bytes_per_s = 0;
  int uplink_sharers = 1;
  // Flush schedules with stages behind one uplink: the optimizer step's downloads while they share
  // it from each stage's release (chunk_schedules): the stage's bytes per second then
  // (0: not shared, copy_s and part_copy_s).
  double step_bytes_per_s = 0;
  // One of the optimizer step's downloads of `bytes`: at the shared rate, or `alone` (copy_s,
  // part_copy_s) where it is not shared.
  double step_copy(std::int64_t bytes, double alone) const {
    return step_bytes_per_s > 0 ? copy_latency_s + double(bytes) / step_bytes_per_s : alone;
  }
  // w > 1: a chunk's gradient reduce-scattered and its parameters all-gathered over the stage's
  // replicas, each a ring over S_p (half an all-reduce of S_p: docs/formulas.md section 9).
  double collective_s = 0;
  // The most replicas of the stage on one GPU (ranks per GPU > 1): in lockstep, they share its
  // compute (each layer and device Adam takes this many times its time) and its link.
  int gpu_sharers = 1;
  // Figures of one step.
  int uploads = 0, downloads = 0;  // chunk copies host -> device, device -> host
  // Sharded chunks: of those, the parts (uploads with an all-gather, downloads of a gradient part
  // after a reduce-scatter), and the drops (evictions that copy nothing; not in downloads).
  // 2bw: the gradient parts zero-filled on the device (no copy; not in uploads).
  int part_uploads = 0, part_downloads = 0, drops = 0, zero_fills = 0;
  std::int64_t copy_in_bytes = 0, copy_out_bytes = 0;
  std::int64_t device_peak_bytes = 0;  // max_k (resident_k move_bytes + N_k) + K S_os
  int peak_moment = 0;                 // the moment of that peak
  int peak_segment = -1;               // 2bw: in that segment's moments, else in `moments`
  const ChunkMoment& peak() const;
  // (n - K) S_os + max_k (n - resident_k) S_p; sharded: (n - K) S_os + max over the step of
  // (the host-Adam chunks' parts + the chunks with a gradient on the host, whole (in place of
  // their part when they have a gradient half) + the gradient parts downloaded at the optimizer
  // step)
  std::int64_t host_peak_bytes = 0;
  std::int64_t host_chunk_peak_bytes = 0;  // its parameter-chunk part (pinned)
  double forward_s = 0, backward_s = 0;    // compute + the copies before each moment
  double compute_s = 0;                    // compute only (with t > 1 the TP collectives too)
  double optimizer_s = 0;  // max(device Adam, host pipeline of downloads and CPU Adam)
  bool device_resident(int chunk) const { return chunk < device_adam_chunks; }
  // What a moment's copies take (their engine time, one after the other): copy_s per whole copy,
  // part_copy_s and half of collective_s (the all-gather) per part upload, nothing per drop or
  // (2bw) zero fill.
  double copies_s(const ChunkMoment& moment) const;
};

// The chunk schedule of stage `stage` of a placed, resolved plan with offload chunks on `cluster`
// (its device's memory as the budget, its host link for copies, its CPU Adam rate): layout, K (the
// optimizer state of as many chunks as fit beside all parameter chunks and the peak non-model
// memory), and the Belady eviction plan. Throws InputError when a moment's working set (its layer's
// chunks and the non-model memory) passes the device's memory, naming the layer (and the stage,
// d > 1) and by how much.
ChunkSchedule chunk_schedule(const models::ModelSpec& model, const traces::Trace& trace,
                             const clusters::Cluster& cluster, const Plan& plan, int stage = 0);

// The largest chunk size smaller than the plan's (its chunk_bytes, or the default) at which every
// stage's working set fits the device, from the halvings of it (a MiB multiple while at least a
// MiB) down to the largest tensor's bytes; 0 when none does. docs/formulas.md section 9 (chunks).
std::int64_t smaller_fitting_chunk_bytes(const models::ModelSpec& model, const traces::Trace& trace,
                                         const clusters::Cluster& cluster, const Plan& plan);

// One step of a chunks pipeline (docs/formulas.md section 9, chunks): each compute op as long as
// its moments (its layers and the copies before them), every stage in its step order, a forward
// after the previous stage's forward of its microbatch plus that stage's hop_s, a backward after
// the next stage's backward of it plus its own hop_s (hop_s[s]: one message between stage s and
// s + 1, or stage 0 for the last with v > 1). Per stage the start of its first op and
// the end of its last, from the step's start; makespan: the latest end. 2bw (no flush): a run of
// four steps, each stage's optimizer step (optimizer_s) after its step's last backward; per stage
// the steady step's start (the end of step 1's optimizer step) and the end of its last compute op
// (step 2's), makespan the longest of those.
struct ChunkPipeline {
  std::vector<double> start, end;
  double makespan = 0;
};
ChunkPipeline chunk_pipeline(const std::vector<ChunkSchedule>& all, const Plan& p,
                             const std::vector<double>& hop_s);

// Every stage's schedule, indexed by stage (what Programs::chunks holds). With d > 1 each stage's
// CPU Adam rate is its share of its node's CPU by processor sharing from the moment the stage
// reaches its optimizer step (docs/formulas.md section 9, chunks); chunk_schedule alone divides
// the node's rate by the stages on it. A plan without a chunk size whose working set passes the
// device at the default gets the smaller fitting one (the schedules' layouts say which); a working
// set that passes the device otherwise throws ChunkWorkingSetError with
// smaller_fitting_chunk_bytes in it and in its message.
std::vector<ChunkSchedule> chunk_schedules(const models::ModelSpec& model,
                                           const traces::Trace& trace,
                                           const clusters::Cluster& cluster, const Plan& plan);

}  // namespace pw::planner
