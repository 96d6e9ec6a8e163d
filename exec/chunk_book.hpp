// What a worker needs to run one stage's offload chunks (PatrickStar; docs/formulas.md section 9,
// chunks) besides moving bytes, written once for every backend (exec/README.md, "The device
// interface"): where each of the stage's tensors lives in the chunk schedule's chunks, each
// layer's activation bytes as the planner's moments count them (so a worker's measured device
// peak is the schedule's), the pipeline messages the plan counts, and the program's chunk copies
// held until the layer they run before. The bytes are the layout's elements times the backend's
// element bytes (4 on the CPU); the buffers, copies and Adam steps are the worker's.
// Host-only, backend-independent: the CPU worker runs it (tests/test_chunks_exec.cpp).
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "common/error.hpp"
#include "exec/stage_compute.hpp"
#include "models/model.hpp"
#include "planner/chunks.hpp"
#include "planner/plan.hpp"
#include "planner/program.hpp"

namespace pw::exec::detail {

// One model chunk of the stage (v of them with interleaving) as the book needs it: its layout, its
// base in the rank's flat parameters, its tied tensor (-1: none), whether it holds the embedding
// or the head, and its sizes for the plan's b in elements (`layer_inputs` and `blocks_scratch`:
// block recompute's, StageCompute::layer_inputs and blocks_scratch).
struct BookChunk {
  const std::vector<TensorSlot>* layout = nullptr;
  std::int64_t base = 0, tied_offset = -1;
  bool first = false, last = false;
  StageSizes sizes;
  std::int64_t layer_inputs = 0, blocks_scratch = 0;
};

class ChunkBook {
 public:
  ChunkBook() = default;
  // Checks the stage's tensors against the schedule's (one to one, in order; both tied ends on one
  // device share the one "wte", `embedding` and `head` their model chunks or -1), every layer's
  // stash against the stage's, and throws Error naming `rank` at the first mismatch.
  ChunkBook(const planner::ChunkSchedule& schedule, const std::vector<BookChunk>& chunks,
            int embedding, int head, const models::ModelSpec& model, const planner::Plan& plan,
            int stage, int rank, int element_bytes);

  // Where the tensor at `flat` (a model chunk's base + a slot's offset) lives: its data chunk and
  // its element offset there. Throws naming the rank when no chunk holds it.
  std::pair<int, std::int64_t> at(std::int64_t flat) const;

  // A compute op's passes over its layers (the planner's moments, planner/chunks.cpp,
  // order_moments): without recompute a forward fills the stash layer by layer, each layer taking
  // its stash less its input slot and the next layer's input slot, which it writes; the backward
  // empties it (selective recompute: each block's attention core taken for its backward too).
  // Full recompute: the forward takes the kept stage input and the scratch at its first layer and
  // gives the scratch back after its last; the recompute op fills the stash as a forward without
  // recompute; the backward empties it and gives the kept input back after its last layer. Block
  // recompute: a forward's layer takes the input of the layer after it (its first its own and the
  // scratch, its last gives the scratch back), a backward's gives its input back (its first takes
  // the scratch, its last gives it back).
  enum class Pass {
    forward,
    forward_recompute,
    recompute,
    backward,
    forward_blocks,
    backward_blocks
  };
  // The activation bytes to add before layer `layer` (local to model chunk `chunk`) of a pass
  // runs, and after it (negative: given back).
  std::int64_t begin_layer(Pass pass, int chunk, int layer) const;
  std::int64_t end_layer(Pass pass, int chunk, int layer) const;
  // Selective recompute: the attention core a block's backward re-makes (0 for other layers and
  // without selective), the stage's layer `layer`; the largest of them (one buffer serves all).
  std::int64_t core_bytes(int layer) const { return core_.at(std::size_t(layer)); }
  std::int64_t largest_core_bytes() const { return largest_core_; }
  // Model chunk `chunk`'s layers: the stage's [first_layer, first_layer + layers).
  int first_layer(int chunk) const;
  int layers(int chunk) const;

  // The pipeline messages the plan counts on this stage (planner::message_buffers: received,
  // produced, the last one sent), each a block's output of `message_elements` elements; their
  // bytes are on the device for the whole run.
  int message_buffers() const { return message_buffers_; }
  std::int64_t message_elements() const { return message_elements_; }
  std::int64_t message_bytes() const { return message_buffers_ * message_elements_ * element_; }
  // A stage holding `held` pipeline messages at program op `op` (of kind `kind`) on `stage`:
  // throws naming the rank, the op and both counts when they are more than the plan counts.
  void check_messages(std::size_t held, int op, planner::OpKind kind, int stage) const;

  // The program's copies that run before a layer of the next compute op (`op.layer` >= 0), held in
  // program order with their op index; take(layer) gives that layer's, evictions (to the host)
  // first, then uploads, each in program order.
  void hold(const planner::Op& op, int at) { pending_.emplace_back(op, at); }
  struct Moment {
    std::vector<std::pair<planner::Op, int>> out, in;
  };
  Moment take(int layer);
  bool pending() const { return !pending_.empty(); }
  // A compute op has run every moment of its layers: throws naming the rank, the layer and `what`
  // when a copy still waits for a layer it did not run.
  void check_none_pending(const char* what) const;

 private:
  std::int64_t input(int layer) const { return input_.at(std::size_t(layer)); }
  const planner::ChunkLayout* layout_ = nullptr;
  int rank_ = 0;
  std::int64_t element_ = 4;
  std::map<std::int64_t, std::pair<int, std::int64_t>> tensor_at_;
  // Per layer of the stage: its stash (without the core with selective), its attention core, its
  // input slot (the first thing in its stash, written by the layer before it).
  std::vector<std::int64_t> stash_, core_, input_;
  std::int64_t largest_core_ = 0;
  // Per model chunk: full recompute's kept input and scratch; block recompute's scratch.
  std::vector<std::int64_t> kept_, scratch_;
  int message_buffers_ = 0;
  std::int64_t message_elements_ = 0;
  std::deque<std::pair<planner::Op, int>> pending_;
};

// Stage `stage`'s chunk schedule in `programs` (sharing their ownership); throws "rank R: offload
// chunks without a chunk schedule" when the programs have none for it.
std::shared_ptr<const planner::ChunkSchedule> stage_chunk_schedule(
    const planner::Programs& programs, int stage, int rank);

// The parts of a chunk that unit `unit`'s copy moves: with the flush schedules (parts = 1) the
// chunk's parameters (part 0) and gradient half (part 2); with 2bw (parts = 3) the unit's own part.
std::vector<int> unit_parts(int parts, int unit);
// 2bw: whether the copies issued now belong to the run's first or last segment (the one ending
// with the optimizer step of update `updates`, the run's steps [first_step, first_step + steps)),
// whose bytes the report gives apart; false with the flush schedules.
bool edge_segment(int parts, int updates, int first_step, int steps);
// Unit u (chunk * parts + unit) about to move to the device (`to_device`) or the host while it is
// `on_device`: throws "rank R: chunk K (part P) to the host, where it is already" when it is there.
void check_unit_move(int rank, int parts, int u, bool on_device, bool to_device);

// The four chunk ops' checks and routing (interpret.hpp's `chunk`), the one rule both workers give
// them: a copy names a unit (chunk * parts + unit), an Adam step a chunk; a copy tagged with a
// layer is held in `book` (op index `at`) until that layer; an untagged one is the optimizer
// step's download for CPU Adam (an upload there is an error); CPU Adam needs every unit of its
// chunk on the host, device Adam every unit on the device. The worker `W` provides:
//   int chunk_parts() const, int chunk_count() const, bool unit_on_device(int chunk, int unit)
//   void download_for_adam(const Op&)      the unit (or a sharded chunk's gradient part) down
//   void step_host(const Op&, int chunk)   CPU Adam of the chunk
//   void step_device(const Op&, int chunk) Adam on the device
// Throws naming `rank` at the first mismatch.
template <class W>
void route_chunk_op(W& w, ChunkBook& book, const planner::Op& op, int at, int rank) {
  using planner::OpKind;
  const bool copy =
      op.kind == OpKind::copy_chunk_to_host || op.kind == OpKind::copy_chunk_to_device;
  const int k = copy ? op.bucket / w.chunk_parts() : op.bucket;
  if (op.bucket < 0 || k >= w.chunk_count())
    throw Error(fmt::format("rank {}: {} of chunk {}, which does not exist", rank,
                            planner::to_string(op.kind), k));
  bool any_on_device = false, all_on_device = true;
  for (int u = 0; u < w.chunk_parts(); ++u) {
    const bool on = w.unit_on_device(k, u);
    any_on_device = any_on_device || on;
    all_on_device = all_on_device && on;
  }
  switch (op.kind) {
    case OpKind::copy_chunk_to_host:
    case OpKind::copy_chunk_to_device:
      if (op.layer >= 0) {  // runs right before that layer of the next compute op
        book.hold(op, at);
        return;
      }
      if (op.kind == OpKind::copy_chunk_to_device)
        throw Error(fmt::format("rank {}: an upload of chunk {} at the optimizer step", rank, k));
      return w.download_for_adam(op);
    case OpKind::chunk_step_host:
      if (any_on_device)
        throw Error(fmt::format("rank {}: CPU Adam of chunk {}, which is on the device", rank, k));
      return w.step_host(op, k);
    case OpKind::chunk_step_device:
      if (!all_on_device)
        throw Error(
            fmt::format("rank {}: Adam on the device of chunk {}, which is on the host", rank, k));
      return w.step_device(op, k);
    default:
      throw Error(fmt::format("rank {}: {} is not a chunk op", rank, planner::to_string(op.kind)));
  }
}

// A layer's moment (ChunkBook::take), the one order both workers run its copies in: the evictions
// in program order (a sharded unit without a gradient dropped, any other unit downloaded), then
// `evictions_done(any)` (their device memory back before the uploads take theirs), the uploads
// in program order (a sharded unit's part, or a whole unit), `uploads_done()`, and last the
// uploaded parts that need the other replicas' parts (`part_gathered`) gathered, all at once. The
// worker `W` provides (a unit u is chunk * parts + unit, `at` the op's index):
//   void drop_chunk(int u), void download_chunk(int u, int at), void evictions_done(bool any)
//   void upload_part(int u, int at), void upload_chunk(int u, int at), void uploads_done()
//   bool part_gathered(int u) const, void gather_parts(const std::vector<std::pair<int, int>>&)
template <class W>
void run_chunk_moment(W& w, ChunkBook& book, int layer) {
  const ChunkBook::Moment moment = book.take(layer);
  for (const auto& [op, at] : moment.out) {
    if (op.part)
      w.drop_chunk(op.bucket);
    else
      w.download_chunk(op.bucket, at);
  }
  w.evictions_done(!moment.out.empty());
  for (const auto& [op, at] : moment.in) {
    if (op.part)
      w.upload_part(op.bucket, at);
    else
      w.upload_chunk(op.bucket, at);
  }
  w.uploads_done();
  std::vector<std::pair<int, int>> gathers;  // (unit, op index)
  for (const auto& [op, at] : moment.in)
    if (op.part && w.part_gathered(op.bucket)) gathers.emplace_back(op.bucket, at);
  if (!gathers.empty()) w.gather_parts(gathers);
}

}  // namespace pw::exec::detail
