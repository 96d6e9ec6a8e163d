// The chunk book both workers share (see chunk_book.hpp).
#include "exec/chunk_book.hpp"

#include <algorithm>

#include <fmt/format.h>

#include "common/error.hpp"
#include "models/model.hpp"
#include "planner/cost_model.hpp"

namespace pw::exec::detail {

ChunkBook::ChunkBook(const planner::ChunkSchedule& schedule, const std::vector<BookChunk>& chunks,
                     int embedding, int head, const models::ModelSpec& model,
                     const planner::Plan& plan, int stage, int rank, int element_bytes)
    : layout_(&schedule.layout), rank_(rank), element_(element_bytes) {
  const planner::ChunkLayout& L = schedule.layout;
  if (int(L.chunk_bounds.size()) != int(chunks.size()) + 1)
    throw Error(fmt::format("rank {}: {} model chunks, the chunk layout {}", rank, chunks.size(),
                            int(L.chunk_bounds.size()) - 1));
  // The schedule's tensors are the stage's model chunks', one to one, in the same order (the
  // model chunks one after the other, the last stage's tied copy last; planner/chunks.hpp). Both
  // tied ends on this device (d = 1, v > 1): the layout holds one wte, which the head's copy is
  // (its forward reads it, its backward adds into its gradient: the executor without chunks adds
  // the head's gradient into the embedding's too, TiedEndsSink).
  std::size_t i = 0;
  for (int k = 0; k < int(chunks.size()); ++k) {
    const BookChunk& c = chunks[std::size_t(k)];
    for (const TensorSlot& slot : *c.layout) {
      if (k == head && embedding >= 0 && slot.offset == c.tied_offset) {
        const BookChunk& e = chunks[std::size_t(embedding)];
        tensor_at_[c.base + slot.offset] = tensor_at_.at(e.base + e.tied_offset);
        continue;
      }
      if (i >= L.tensors.size())
        throw Error(fmt::format("rank {}: the stage has more tensors than the chunk layout's {}",
                                rank, L.tensors.size()));
      const planner::ChunkTensor& t = L.tensors[i++];
      if (slot.size != t.elements || t.offset + t.elements > L.chunk_elements)
        throw Error(fmt::format("rank {}: tensor {} has {} elements, the chunk layout's {} {}",
                                rank, slot.name, slot.size, t.name, t.elements));
      tensor_at_[c.base + slot.offset] = {t.chunk, t.offset};
    }
  }
  if (i != L.tensors.size())
    throw Error(fmt::format("rank {}: the stage has {} tensors, the chunk layout {}", rank, i,
                            L.tensors.size()));
  // The last stage's copy of the tied wte (d > 1) gets no Adam step here: it is its chunk's last
  // tensor, so a chunk's Adam runs over its first chunk_owned elements.
  for (const planner::ChunkTensor& t : L.tensors)
    if (t.tied_copy && t.offset < L.chunk_owned[std::size_t(t.chunk)])
      throw Error(fmt::format("rank {}: the tied copy {} is not at the end of chunk {}", rank,
                              t.name, t.chunk));
  // Each of the stage's layers' stash in bytes (the stage's carving is exactly
  // models::derive_costs at the plan's t and SP): the embedding on stage 0, its blocks, the head on
  // the last stage; each layer's input slot, the first thing in its stash (the embedding's: its
  // token ids), which the layer before it writes.
  const models::ModelCosts mc = models::derive_costs(model, {plan.t, plan.sp});
  const std::int64_t b = plan.b;
  const bool selective = plan.recompute_of(stage) == planner::Recompute::selective;
  const bool blocks = plan.recompute_of(stage) == planner::Recompute::block;
  for (int l = 0; l < L.layers(); ++l) {
    const int g = L.model_layer(l);
    const models::LayerCosts& costs = g == 0                       ? mc.embedding
                                      : g == int(model.layers + 1) ? mc.head
                                                                   : mc.block;
    // Selective recompute: a block keeps its stash without the attention core, which its
    // backward re-makes (the core: the difference).
    const std::int64_t kept = selective ? costs.activation_selective_bytes : costs.activation_bytes;
    stash_.push_back(b * kept);
    core_.push_back(b * (costs.activation_bytes - kept));
    input_.push_back(b * costs.activation_recompute_bytes);
    // The core a block's backward re-makes: b x (heads / t) x T x T elements (the stage's carving).
    const std::int64_t T = model.seq_len, heads = model.heads / plan.t;
    const std::int64_t want = b * heads * T * T * element_;
    if (core_.back() != 0 && core_.back() != want)
      throw Error(fmt::format("rank {}: layer {}'s attention core is {} B, the stage's {} B", rank,
                              l, core_.back(), want));
    largest_core_ = std::max(largest_core_, core_.back());
  }
  for (std::size_t k = 0; k < chunks.size(); ++k) {
    const BookChunk& c = chunks[k];
    const auto lo = std::size_t(L.chunk_bounds[k]), hi = std::size_t(L.chunk_bounds[k + 1]);
    std::int64_t stash = 0, inputs = 0;
    for (std::size_t l = lo; l < hi; ++l) {
      stash += stash_[l];
      inputs += input_[l];
    }
    if (stash != c.sizes.stash * element_)
      throw Error(
          fmt::format("rank {}: model chunk {}'s layers' stashes ({} B) are not its "
                      "stage's ({} B)",
                      rank, k, stash, c.sizes.stash * element_));
    // Full recompute: the input a forward keeps and the scratch it runs its layers through.
    // Block recompute: the layers' inputs and the scratch the layers are made and re-made in.
    kept_.push_back(plan.recomputes(stage) ? c.sizes.stash_recompute * element_ : 0);
    scratch_.push_back(blocks                   ? c.blocks_scratch * element_
                       : plan.recomputes(stage) ? c.sizes.scratch * element_
                                                : 0);
    if (blocks && inputs != c.layer_inputs * element_)
      throw Error(
          fmt::format("rank {}: model chunk {}'s layers' inputs ({} B) are not its "
                      "stage's ({} B)",
                      rank, k, inputs, c.layer_inputs * element_));
  }
  // Pipeline messages (d > 1, or one device's v > 1 model chunks handing them to each other): the
  // planner's count of them, each a block's output (v > 1: received and sent by each model chunk).
  message_buffers_ = planner::message_buffers(plan, stage);
  if (message_buffers_ > 0)
    for (const BookChunk& c : chunks)
      for (std::int64_t n : {c.first ? 0 : c.sizes.input, c.last ? 0 : c.sizes.output}) {
        if (n > 0 && message_elements_ > 0 && n != message_elements_)
          throw Error(fmt::format("rank {}: pipeline messages of {} and {} elements", rank,
                                  message_elements_, n));
        if (n > 0) message_elements_ = n;
      }
}

void ChunkBook::check_messages(std::size_t held, int op, planner::OpKind kind, int stage) const {
  if (held <= std::size_t(message_buffers_)) return;
  throw Error(
      fmt::format("rank {}: op {} ({}) holds {} pipeline messages, more than the {} the plan "
                  "counts on stage {} "
                  "(planner::message_buffers)",
                  rank_, op, planner::to_string(kind), held, message_buffers_, stage));
}

std::pair<int, std::int64_t> ChunkBook::at(std::int64_t flat) const {
  const auto it = tensor_at_.find(flat);
  if (it == tensor_at_.end())
    throw Error(fmt::format("rank {}: no chunk holds the tensor at {}", rank_, flat));
  return it->second;
}

int ChunkBook::first_layer(int chunk) const {
  return layout_->chunk_bounds.at(std::size_t(chunk));
}

int ChunkBook::layers(int chunk) const {
  return layout_->chunk_bounds.at(std::size_t(chunk) + 1) - first_layer(chunk);
}

std::int64_t ChunkBook::begin_layer(Pass pass, int chunk, int layer) const {
  const int first = first_layer(chunk), last = layers(chunk) - 1, l = first + layer;
  const std::int64_t scratch = scratch_.at(std::size_t(chunk));
  switch (pass) {
    case Pass::forward:
    case Pass::recompute:  // it writes the next one's input
      return stash_.at(std::size_t(l)) - (layer > 0 ? input(l) : 0) +
             (layer < last ? input(l + 1) : 0);
    case Pass::forward_recompute:
      return layer == 0 ? kept_.at(std::size_t(chunk)) + scratch : 0;
    case Pass::forward_blocks:
      return (layer < last ? input(l + 1) : 0) + (layer == 0 ? input(l) + scratch : 0);
    case Pass::backward_blocks:
      return layer == last ? scratch : 0;
    case Pass::backward:  // selective: the attention core re-made (0 elsewhere)
      return core_bytes(l);
  }
  return 0;
}

std::int64_t ChunkBook::end_layer(Pass pass, int chunk, int layer) const {
  const int first = first_layer(chunk), last = layers(chunk) - 1, l = first + layer;
  const std::int64_t scratch = scratch_.at(std::size_t(chunk));
  switch (pass) {
    case Pass::backward:
      return -stash_.at(std::size_t(l)) - core_bytes(l) -
             (layer == 0 ? kept_.at(std::size_t(chunk)) : 0);
    case Pass::forward_recompute:
    case Pass::forward_blocks:
      return layer == last ? -scratch : 0;
    case Pass::backward_blocks:
      return -input(l) - (layer == 0 ? scratch : 0);
    case Pass::forward:
    case Pass::recompute:
      return 0;
  }
  return 0;
}

ChunkBook::Moment ChunkBook::take(int layer) {
  Moment m;
  while (!pending_.empty() && pending_.front().first.layer == layer) {
    auto& next = pending_.front();
    (next.first.kind == planner::OpKind::copy_chunk_to_host ? m.out : m.in).push_back(next);
    pending_.pop_front();
  }
  return m;
}

void ChunkBook::check_none_pending(const char* what) const {
  if (!pending_.empty())
    throw Error(fmt::format("rank {}: a chunk copy before layer {}, which the {} did not run",
                            rank_, pending_.front().first.layer, what));
}

std::shared_ptr<const planner::ChunkSchedule> stage_chunk_schedule(
    const planner::Programs& programs, int stage, int rank) {
  if (!programs.chunks || stage < 0 || int(programs.chunks->size()) <= stage)
    throw Error(fmt::format("rank {}: offload chunks without a chunk schedule", rank));
  return std::shared_ptr<const planner::ChunkSchedule>(programs.chunks,
                                                       &(*programs.chunks)[std::size_t(stage)]);
}

std::vector<int> unit_parts(int parts, int unit) {
  if (parts == 1) return {0, 2};  // the parameters and their gradient half
  return {unit};
}

bool edge_segment(int parts, int updates, int first_step, int steps) {
  return parts > 1 && (updates == first_step || updates == first_step + steps - 1);
}

void check_unit_move(int rank, int parts, int u, bool on_device, bool to_device) {
  if (on_device != to_device) return;
  throw Error(fmt::format("rank {}: chunk {}{} to the {}, where it is already", rank, u / parts,
                          parts > 1 ? fmt::format(" (part {})", u % parts) : std::string(),
                          to_device ? "device" : "host"));
}

}  // namespace pw::exec::detail
