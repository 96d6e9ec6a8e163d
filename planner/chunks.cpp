// PatrickStar's chunks planned from the model's costs: layout, the fixed-point eviction plan
// (Belady: furthest next use first) and its figures. docs/formulas.md, section 9 (chunks).
#include "planner/chunks.hpp"

#include <algorithm>
#include <limits>
#include <map>
#include <set>
#include <stdexcept>

#include <fmt/format.h>

#include "common/error.hpp"
#include "common/format.hpp"
#include "common/limits.hpp"
#include "planner/cost_model.hpp"
#include "planner/order_walk.hpp"

namespace pw::planner {

namespace {

constexpr const char* kWhat = "offload chunks: bytes";
std::int64_t mul(std::int64_t a, std::int64_t b) {
  return common::checked_mul(a, b, kWhat, common::kMaxBytes);
}
std::int64_t add(std::int64_t a, std::int64_t b) {
  return common::checked_add(a, b, kWhat, common::kMaxBytes);
}

std::string gib(std::int64_t bytes) {
  return common::human_bytes(double(bytes));
}

}  // namespace

std::string ChunkMoment::label(const ChunkLayout& layout) const {
  return fmt::format("{} of {}",
                     backward    ? "backward"
                     : recompute ? "recompute"
                                 : "forward",
                     layout.layer_names.at(std::size_t(layer)));
}

std::vector<ChunkTensor> model_tensors(const models::ModelSpec& s, int tp) {
  if (tp < 1 || s.heads % tp != 0 || s.hidden % tp != 0 || s.ffn % tp != 0)
    throw std::logic_error("model_tensors: t does not divide the model");
  const models::ModelCosts mc = models::derive_costs(s, {tp, false});
  // One rank of a TP group (Megatron): column-parallel QKV and MLP inputs (weights and biases
  // split), row-parallel projections (weights split, biases replicated), the vocabulary split,
  // norms and positions replicated.
  const std::int64_t C = s.hidden, F = s.ffn / tp, V = models::padded_vocab(s, tp) / tp;
  const std::int64_t hd = C / s.heads, Q = (s.heads + 2 * models::key_value_heads(s)) * hd / tp;
  const bool layernorm = s.norm == models::Norm::layernorm, bias = s.bias;
  std::vector<ChunkTensor> out;
  auto put = [&](int layer, std::string name, std::int64_t n) {
    if (n > 0) out.push_back({std::move(name), layer, n, -1, 0});
  };
  auto norm = [&](int layer, const std::string& name) {
    put(layer, name + ".w", C);
    if (layernorm) put(layer, name + ".b", C);
  };
  put(0, "wte", V * C);
  if (s.positions == models::Positions::learned) put(0, "wpe", s.max_positions * C);
  put(0, "wtt", s.type_vocab * C);
  if (s.arch == models::Arch::bert) norm(0, "emb_ln");
  for (std::int64_t i = 0; i < s.layers; ++i) {
    const int layer = int(i + 1);
    const std::string h = fmt::format("h.{}.", i);
    norm(layer, h + "ln1");
    put(layer, h + "qkv.w", C * Q);
    if (bias) put(layer, h + "qkv.b", Q);
    put(layer, h + "proj.w", C / tp * C);
    if (bias) put(layer, h + "proj.b", C);
    norm(layer, h + "ln2");
    for (const char* in : s.mlp == models::Mlp::gelu ? std::vector<const char*>{"fc"}
                                                     : std::vector<const char*>{"gate", "up"}) {
      put(layer, h + in + ".w", C * F);
      if (bias) put(layer, h + in + ".b", F);
    }
    put(layer, h + "fc2.w", F * C);  // F: this rank's
    if (bias) put(layer, h + "fc2.b", C);
  }
  const int head = int(s.layers + 1);
  if (s.arch == models::Arch::bert) {
    put(head, "mlm.dense.w", C * C);
    if (bias) put(head, "mlm.dense.b", C);
    norm(head, "mlm.ln");
    put(head, "mlm.bias", V);
  } else {
    norm(head, "lnf");
  }
  if (!s.tied_embeddings) put(head, "lm_head", V * C);
  // The layer sums are the cost model's parameters (section 1): a mismatch is a bug here.
  std::vector<std::int64_t> sum(std::size_t(s.layers + 2), 0);
  for (const ChunkTensor& t : out)
    sum[std::size_t(t.layer)] += t.elements;
  for (std::size_t l = 0; l < sum.size(); ++l) {
    const std::int64_t want = l == 0                ? mc.embedding.parameters
                              : l + 1 == sum.size() ? mc.head.parameters
                                                    : mc.block.parameters;
    if (sum[l] != want)
      throw std::logic_error(
          fmt::format("model_tensors: layer {} has {} parameters, costs say {}", l, sum[l], want));
  }
  return out;
}

std::int64_t default_chunk_bytes(const models::ModelSpec& model) {
  const std::int64_t e = models::dtype_bytes(model.dtype);
  std::int64_t largest = 0;
  for (const ChunkTensor& t : model_tensors(model))
    largest = std::max(largest, t.elements);
  const std::int64_t mib = std::int64_t{1} << 20;
  const std::int64_t need = (mul(largest, e) + mib - 1) / mib * mib;
  return std::max(mul(kDefaultChunkElements, e), need);
}

namespace {

std::string layer_name(const models::ModelSpec& model, int layer) {
  return layer == 0                       ? std::string("embedding")
         : layer == int(model.layers + 1) ? std::string("head")
                                          : fmt::format("block {}", layer - 1);
}

// The layout of `tensors` (of model layers `layers`, ascending, in first-use order), their layers
// renumbered from 0 in that order. `tied_head`: the head computes with the embedding's wte (the
// whole model on one stage). `bounds`: the model chunks' first layers and the count (v + 1).
ChunkLayout layout_of(const models::ModelSpec& model, std::int64_t chunk_bytes,
                      std::vector<ChunkTensor> tensors, std::vector<int> layers,
                      std::vector<int> bounds, bool tied_head) {
  const std::int64_t e = models::dtype_bytes(model.dtype);
  ChunkLayout L;
  L.model_layers = layers;
  L.chunk_bounds = std::move(bounds);
  std::vector<std::string> names;
  for (int g : layers)
    names.push_back(layer_name(model, g));
  L.chunk_bytes = chunk_bytes;
  L.move_bytes = chunk_bytes;
  L.chunk_elements = chunk_bytes / e;
  L.shard_elements = L.chunk_elements;
  L.os_chunk_bytes = mul(L.chunk_elements, optimizer_bytes_per_parameter(model.dtype));
  L.tensors = std::move(tensors);
  for (ChunkTensor& t : L.tensors) {
    const auto at = std::find(layers.begin(), layers.end(), t.layer);
    if (at == layers.end())
      throw std::logic_error(fmt::format("chunk layout: tensor {} of a layer not here", t.name));
    t.layer = int(at - layers.begin());
  }
  const ChunkTensor* largest = &L.tensors.front();
  for (const ChunkTensor& t : L.tensors)
    if (t.elements > largest->elements) largest = &t;
  if (largest->elements > L.chunk_elements)
    throw InputError(fmt::format(
        "offload chunks: chunk size {} B ({} elements of {} B) is smaller than tensor {} ({} "
        "elements, {} B) by {} B; use --chunk-size {} or more",
        chunk_bytes, L.chunk_elements, e, largest->name, largest->elements,
        mul(largest->elements, e), mul(largest->elements, e) - chunk_bytes,
        mul(largest->elements, e)));
  L.layer_names = std::move(names);
  L.layer_chunks.assign(L.layer_names.size(), {});
  std::int64_t used = L.chunk_elements;  // no chunk open yet
  for (ChunkTensor& t : L.tensors) {
    if (used + t.elements > L.chunk_elements) {
      L.chunk_parameters.push_back(0);
      L.chunk_owned.push_back(0);
      used = 0;
    }
    t.chunk = L.chunks() - 1;
    t.offset = used;
    used += t.elements;
    L.chunk_parameters.back() += t.elements;
    if (!t.tied_copy) L.chunk_owned.back() += t.elements;
  }
  for (const ChunkTensor& t : L.tensors)
    L.layer_chunks[std::size_t(t.layer)].push_back(t.chunk);
  // Tied embeddings: the head computes with wte.
  if (tied_head) L.layer_chunks.back().push_back(L.tensors.front().chunk);
  for (auto& cs : L.layer_chunks) {
    std::sort(cs.begin(), cs.end());
    cs.erase(std::unique(cs.begin(), cs.end()), cs.end());
  }
  return L;
}

}  // namespace

std::pair<std::int64_t, std::int64_t> ChunkLayout::shard(int chunk, int replica) const {
  const std::int64_t owned = chunk_owned.at(std::size_t(chunk));
  return {std::min(owned, mul(replica, shard_elements)),
          std::min(owned, mul(replica + 1, shard_elements))};
}

std::pair<std::int64_t, std::int64_t> ChunkLayout::part(int replica) const {
  return {std::min(chunk_elements, mul(replica, shard_elements)),
          std::min(chunk_elements, mul(replica + 1, shard_elements))};
}

std::vector<std::int64_t> ChunkLayout::part_bounds() const {
  std::vector<std::int64_t> out;
  for (int r = 0; r < replicas; ++r)
    out.push_back(part(r).first);
  out.push_back(chunk_elements);
  return out;
}

std::vector<std::int64_t> ChunkLayout::shard_bounds(int chunk) const {
  std::vector<std::int64_t> out;
  for (int r = 0; r < replicas; ++r)
    out.push_back(shard(chunk, r).first);
  out.push_back(shard(chunk, replicas - 1).second);
  return out;
}

std::int64_t ChunkLayout::adam_elements(int chunk) const {
  const auto [b, e] = shard(chunk, 0);
  return e - b;
}

std::int64_t ChunkLayout::unit_weight_bytes(int unit) const {
  return parts == 1 ? chunk_bytes : unit % parts < 2 ? move_bytes : 0;
}

std::int64_t ChunkLayout::unit_gradient_bytes(int unit) const {
  return parts == 1 ? move_bytes - chunk_bytes : unit % parts == 2 ? move_bytes : 0;
}

ChunkSegment chunk_segment(int first_step, int steps, int step) {
  if (steps < 1 || step < first_step || step >= first_step + steps)
    throw std::logic_error("chunk_segment: a step outside the run");
  const bool last = step == first_step + steps - 1;
  if (step > first_step) return last ? ChunkSegment::last : ChunkSegment::steady;
  if (first_step == 0) return last ? ChunkSegment::fill_last : ChunkSegment::fill;
  return last ? ChunkSegment::resumed_last : ChunkSegment::resumed;
}

const char* to_string(ChunkSegment segment) {
  switch (segment) {
    case ChunkSegment::fill:
      return "fill";
    case ChunkSegment::fill_last:
      return "fill and last";
    case ChunkSegment::resumed:
      return "resumed fill";
    case ChunkSegment::resumed_last:
      return "resumed fill and last";
    case ChunkSegment::steady:
      return "steady";
    case ChunkSegment::last:
      return "last";
  }
  return "?";
}

const std::vector<ChunkMoment>& ChunkSchedule::moments_of(int first_step, int steps,
                                                          int step) const {
  if (segments.empty()) return moments;
  return segments.at(std::size_t(chunk_segment(first_step, steps, step))).moments;
}

const std::vector<bool>& ChunkSchedule::adam_download_of(int first_step, int steps,
                                                         int step) const {
  if (segments.empty()) return adam_download;
  return segments.at(std::size_t(chunk_segment(first_step, steps, step))).adam_download;
}

int ChunkSchedule::unit_in(int unit, int step) const {
  const int parts = layout.parts;
  if (parts == 1 || unit % parts == 2) return unit;
  const int chunk = unit / parts, newer = unit % parts;
  return chunk * parts + (newer ? step % 2 : (step + 1) % 2);
}

const ChunkMoment& ChunkSchedule::peak() const {
  const std::vector<ChunkMoment>& from =
      peak_segment < 0 ? moments : segments.at(std::size_t(peak_segment)).moments;
  return from.at(std::size_t(peak_moment));
}

ChunkLayout chunk_layout(const models::ModelSpec& model, std::int64_t chunk_bytes, int tp) {
  std::vector<int> layers;
  for (int l = 0; l < int(model.layers + 2); ++l)
    layers.push_back(l);
  const int n = int(layers.size());
  return layout_of(model, chunk_bytes, model_tensors(model, tp), std::move(layers), {0, n},
                   model.tied_embeddings);
}

namespace {

ChunkLayout stage_layout(const models::ModelSpec& model, std::int64_t chunk_bytes, const Plan& p,
                         int stage) {
  if (p.d == 1 && p.v == 1) return chunk_layout(model, chunk_bytes, p.t);
  if (int(p.stage_blocks.size()) != p.virtual_stages() || stage < 0 || stage >= p.d)
    throw std::logic_error("chunk_layout: the plan's stages are not resolved");
  const int stages = p.virtual_stages();
  const int head = int(model.layers + 1);
  // Model layers lo .. hi of each of the device's model chunks (virtual stage k d + stage): its
  // blocks, with the embedding before on virtual stage 0 and the head after on the last.
  std::vector<int> layers, bounds;
  std::int64_t before = 0;
  for (int vs = 0; vs < stages; ++vs) {
    const std::int64_t blocks = p.stage_blocks[std::size_t(vs)];
    if (vs % p.d == stage) {
      bounds.push_back(int(layers.size()));
      const int lo = vs == 0 ? 0 : int(before + 1);
      const int hi = int(before + blocks) + (vs == stages - 1 ? 1 : 0);
      for (int l = lo; l <= hi; ++l)
        layers.push_back(l);
    }
    before += blocks;
  }
  bounds.push_back(int(layers.size()));
  const bool has_head = layers.back() == head;
  std::vector<ChunkTensor> tensors;
  const std::vector<ChunkTensor> all = model_tensors(model, p.t);
  for (const ChunkTensor& t : all)
    if (std::binary_search(layers.begin(), layers.end(), t.layer)) tensors.push_back(t);
  // d > 1: the last stage computes its head with its own copy of wte (the tied exchange keeps it
  // equal to stage 0's); d = 1 (v > 1): with stage 0's, on the same device.
  if (has_head && model.tied_embeddings && p.d > 1) {
    ChunkTensor copy = all.front();  // wte
    copy.layer = head;
    copy.tied_copy = true;
    tensors.push_back(copy);
  }
  ChunkLayout L = layout_of(model, chunk_bytes, std::move(tensors), std::move(layers),
                            std::move(bounds), has_head && model.tied_embeddings && p.d == 1);
  L.stage = stage;
  return L;
}

}  // namespace

ChunkLayout chunk_layout(const models::ModelSpec& model, std::int64_t chunk_bytes, const Plan& p,
                         int stage) {
  ChunkLayout L = stage_layout(model, chunk_bytes, p, stage);
  if (p.w > 1) {
    L.replicas = p.w;
    L.shard_elements = (L.chunk_elements + p.w - 1) / p.w;
    L.os_chunk_bytes = mul(L.shard_elements, optimizer_bytes_per_parameter(model.dtype));
  }
  if (p.chunk_shard && p.w > 1) {
    L.part_bytes = mul(L.shard_elements, models::dtype_bytes(model.dtype));
    L.sharded.assign(std::size_t(L.chunks()), true);
    // A tied embedding exchanged between stages (stage 0's wte, the last stage's copy) is read
    // and written at the exchange wherever its chunk is: that chunk stays whole.
    if (p.d > 1 && model.tied_embeddings)
      for (const ChunkTensor& t : L.tensors)
        if (t.tied_copy || (L.model_layer(t.layer) == 0 && t.name == "wte"))
          L.sharded[std::size_t(t.chunk)] = false;
  }
  return L;
}

namespace {

models::LayerKind layer_kind(const models::ModelSpec& model, const ChunkLayout& L, int layer) {
  const int g = L.model_layer(layer);
  return g == 0                       ? models::LayerKind::embedding
         : g == int(model.layers + 1) ? models::LayerKind::head
                                      : models::LayerKind::block;
}

// One step's moments without copies: per compute op of the stage's step (its order: gpipe all
// forwards then all backwards, 1f1b interleaved), its layers, with full recompute the recompute
// op's before each backward's, with the activations each takes and gives back and the non-model
// bytes (the activations held: every microbatch in flight, the current one up to its layer; the
// pipeline message buffers the device holds beside them, planner::message_buffer_bytes, none with
// d = 1; the workspace) and the compute time. Full recompute (docs/formulas.md section 9, chunks):
// a forward keeps the stage input I (ChunkCost::input_bytes) and runs its layers through one
// scratch X (recompute_scratch_bytes), taken at its first layer and given back after its last; the
// recompute op re-makes the layers' stashes one by one; the backward gives each back, and I last.
// Without full or block recompute the forward's layer l takes its stash less its input slot and
// the next layer's input slot, which it writes (the first layer its whole stash; the recompute op
// of full recompute does the same). Block recompute: the forward's layer l takes the input of
// layer l + 1 it writes (layer 0 also its own and X), its last layer gives X back; the recompute op
// has no moments; each backward moment re-makes its layer from its input into X (taken at the
// first, given back after the last) and gives that input back. Selective recompute: a forward keeps
// its layer's stash without the attention core (activation_selective_bytes); the backward re-makes
// the core first (its selective_recompute_s, taking the core's bytes back) and gives the whole
// stash back.
std::vector<ChunkMoment> order_moments(const models::ModelSpec& model, const traces::Trace& trace,
                                       const Plan& p, const ChunkLayout& L, std::int64_t workspace,
                                       const std::vector<ComputeSlot>& order) {
  const traces::Entry& e = trace.at(p.b);
  const int layers = L.layers();
  auto kind = [&](int l) { return layer_kind(model, L, l); };
  const bool rc = p.recomputes(L.stage);
  const bool block = p.recompute_of(L.stage) == Recompute::block;
  const bool selective = p.recompute_of(L.stage) == Recompute::selective;
  // What a forward of layer l keeps for its backward without full recompute.
  auto kept = [&](int l) {
    const traces::LayerTimes& t = e.layers[kind(l)];
    return selective ? t.activation_selective_bytes : t.activation_bytes;
  };
  // Each model chunk's I and X, as §4 counts them for it without chunks (v = 1: one).
  const int model_chunks = int(L.chunk_bounds.size()) - 1;
  if (model_chunks < 1 || L.chunk_bounds.back() != layers)
    throw std::logic_error("order_moments: the layout's model chunks do not cover its layers");
  std::vector<std::int64_t> inputs(std::size_t(model_chunks), 0), scratches = inputs;
  if (rc) {
    if (int(p.stage_blocks.size()) != p.virtual_stages())
      throw std::logic_error("order_moments: the plan's stages are not resolved");
    const models::ModelCosts costs = models::derive_costs(model);
    for (int c = 0; c < model_chunks; ++c) {
      const ChunkCost ch = chunk_cost(costs, trace, p, L.stage, c);
      inputs[std::size_t(c)] = ch.input_bytes;
      scratches[std::size_t(c)] = ch.recompute_scratch_bytes;
    }
  }
  // The op's model chunk's layers [lo, hi) (set per op below).
  int lo = 0, hi = layers;
  std::vector<ChunkMoment> out;
  out.reserve(order.size() * std::size_t(layers) * (rc && !block ? 2 : 1));  // at most
  std::int64_t held = 0;
  const std::int64_t messages = message_buffer_bytes(p, trace, L.stage);
  auto moment = [&](int slot, bool back, bool again, int l, std::int64_t take, std::int64_t give) {
    const traces::LayerTimes& t = e.layers[kind(l)];
    held = add(held, take);
    ChunkMoment m;
    m.slot = slot;
    m.backward = back;
    m.recompute = again;
    m.layer = l;
    m.alloc_bytes = take;
    m.free_bytes = give;
    m.non_model_bytes = add(add(held, workspace), messages);
    m.kind = kind(l);
    m.remake = back && block && m.kind != models::LayerKind::embedding;  // its input is its stash
    m.compute_s = back    ? t.backward_s + (selective  ? t.selective_recompute_s
                                            : m.remake ? t.recompute_s
                                                       : 0.0)
                  : again ? t.recompute_s
                          : t.forward_s;
    out.push_back(std::move(m));
    held -= give;
  };
  // Layer l's input slot (what the layer before it writes; 0 past the model chunk's last layer,
  // whose output is the pipeline message or the loss).
  auto input_of = [&](int l) {
    return l < hi ? e.layers[kind(l)].activation_recompute_bytes : std::int64_t(0);
  };
  // A layer that fills its stash (a forward without recompute, or the recompute op) writes its
  // output into the next layer's input slot, the first thing in that layer's stash: its moment
  // takes that slot with its own stash less its own input slot (which the layer before it took;
  // the stage's first layer takes its own: it copies its input in). A slot is never more than
  // its layer's stash (a trace may say so): the moments' sum is the stashes' sum.
  auto written = [&](int l, auto stash_of) {
    auto slot = [&](int k) { return std::min(input_of(k), stash_of(k)); };
    return add(stash_of(l) - (l > lo ? slot(l) : 0), l + 1 < hi ? slot(l + 1) : 0);
  };
  auto whole = [&](int l) { return e.layers[kind(l)].activation_bytes; };
  for (int i = 0; i < int(order.size()); ++i) {
    const bool back = order[std::size_t(i)].backward;
    const int chunk = order[std::size_t(i)].chunk;
    if (chunk < 0 || chunk >= model_chunks)
      throw std::logic_error("order_moments: a compute op of a model chunk the layout lacks");
    lo = L.chunk_bounds[std::size_t(chunk)];
    hi = L.chunk_bounds[std::size_t(chunk) + 1];
    const std::int64_t input = inputs[std::size_t(chunk)], scratch = scratches[std::size_t(chunk)];
    if (block && !back) {
      for (int l = lo; l < hi; ++l)
        moment(i, false, false, l, add(input_of(l + 1), l == lo ? add(input_of(lo), scratch) : 0),
               l == hi - 1 ? scratch : 0);
      continue;
    }
    if (block) {
      for (int l = hi - 1; l >= lo; --l)
        moment(i, true, false, l, l == hi - 1 ? scratch : 0,
               add(input_of(l), l == lo ? scratch : 0));
      continue;
    }
    if (!back) {
      for (int l = lo; l < hi; ++l) {
        if (rc)
          moment(i, false, false, l, l == lo ? add(input, scratch) : 0, l == hi - 1 ? scratch : 0);
        else
          moment(i, false, false, l, written(l, kept), 0);
      }
      continue;
    }
    if (rc)
      for (int l = lo; l < hi; ++l)
        moment(i, false, true, l, written(l, whole), 0);
    for (int l = hi - 1; l >= lo; --l) {
      const std::int64_t stash = e.layers[kind(l)].activation_bytes;
      if (rc)
        moment(i, true, false, l, 0, add(stash, l == lo ? input : 0));
      else
        moment(i, true, false, l, stash - kept(l), stash);  // selective: the core re-made
    }
  }
  return out;
}

// 2bw: each segment shape's moments (ChunkSegment), cut out of a run that has that segment, so
// that the stashes in flight across an optimizer step are held where the segment starts; slots
// numbered within the segment, and each moment's version role (the newer version: the one made at
// the segment's opening optimizer step).
std::vector<std::vector<ChunkMoment>> segment_moments(const models::ModelSpec& model,
                                                      const traces::Trace& trace, const Plan& p,
                                                      const ChunkLayout& L,
                                                      std::int64_t workspace) {
  std::vector<std::vector<ChunkMoment>> out(kChunkSegments);
  std::vector<bool> filled(kChunkSegments, false);
  // (first step, steps): fill, steady, last; fill_last; resumed, last; resumed_last.
  const std::pair<int, int> runs[] = {{0, 3}, {0, 1}, {1, 2}, {1, 1}};
  for (const auto& [first, steps] : runs) {
    const std::vector<ComputeSlot> order = run_compute_order(p, L.stage, steps, first);
    std::vector<int> segment(order.size()), index(order.size());
    for (int i = 0, t = first, at = 0; i < int(order.size()); ++i) {
      segment[std::size_t(i)] = t;
      index[std::size_t(i)] = at++;
      if (order[std::size_t(i)].backward && order[std::size_t(i)].microbatch == p.m - 1) {
        ++t;
        at = 0;
      }
    }
    std::vector<std::vector<ChunkMoment>> run(static_cast<std::size_t>(steps));
    std::vector<ChunkMoment> all = order_moments(model, trace, p, L, workspace, order);
    std::vector<std::size_t> count(static_cast<std::size_t>(steps), 0);
    for (const ChunkMoment& m : all)
      ++count[std::size_t(segment[std::size_t(m.slot)] - first)];
    for (int t = 0; t < steps; ++t)
      run[std::size_t(t)].reserve(count[std::size_t(t)]);
    for (ChunkMoment& m : all) {
      const ComputeSlot& slot = order[std::size_t(m.slot)];
      const int t = segment[std::size_t(m.slot)];
      m.newer = expected_version(p, slot.step, slot.microbatch) == t;
      m.slot = index[std::size_t(m.slot)];
      run[std::size_t(t - first)].push_back(std::move(m));
    }
    for (int t = first; t < first + steps; ++t) {
      const auto kind = std::size_t(chunk_segment(first, steps, t));
      if (filled[kind]) continue;
      out[kind] = std::move(run[std::size_t(t - first)]);
      filled[kind] = true;
    }
  }
  return out;
}

// Appends the units moment m uses, ascending: its layer's chunks (with 2bw each chunk's part of the
// moment's version role, and for a backward its gradient part).
void append_moment_units(const ChunkLayout& L, const ChunkMoment& m, std::vector<int>& out) {
  for (int c : L.layer_chunks[std::size_t(m.layer)]) {
    if (L.parts == 1) {
      out.push_back(c);
      continue;
    }
    out.push_back(c * L.parts + (m.newer ? 1 : 0));
    if (m.backward) out.push_back(c * L.parts + 2);
  }
}

// The optimizer step: the host-Adam chunks' downloads (one engine, in order) and CPU Adam (one
// chunk after the other, each after its download) as a two-stage pipeline, beside Adam on the
// device for chunks 0 .. K-1. With w > 1 each chunk's Adam (of its part) sits between the
// reduce-scatter of its gradient and the all-gather of its parameters, the three one after the
// other on the engine (host or device) that runs it.
double optimizer_time(const ChunkSchedule& s) {
  std::vector<double> down, adam;
  double device_adam = 0;
  const int parts = s.layout.parts;
  for (int c = 0; c < s.layout.chunks(); ++c) {
    if (s.device_resident(c)) {
      device_adam += s.device_adam_s[std::size_t(c)] * s.gpu_sharers + s.collective_s;
      continue;
    }
    if (s.layout.is_sharded(c)) {
      // Its gradient (with 2bw its gradient part; the version slots' drops take no time): the
      // reduce-scatter on the device and the gradient's part down, or (it went to the host whole
      // during the step) the reduce-scatter on the host; no all-gather (the next step's upload
      // gathers).
      const bool gradient_down = s.adam_download[std::size_t(s.layout.gradient_unit(c))];
      const double part = s.step_copy(s.layout.part_bytes, s.part_copy_s);
      down.push_back(gradient_down ? s.collective_s / 2 + part : 0.0);
      adam.push_back(s.host_adam_s[std::size_t(c)] + (gradient_down ? 0.0 : s.collective_s / 2));
      continue;
    }
    int units = 0;  // of the chunk's parts on the device at the step's end: each goes down
    for (int u = c * parts; u < (c + 1) * parts; ++u)
      units += s.adam_download[std::size_t(u)] ? 1 : 0;
    down.push_back(units * s.step_copy(s.layout.move_bytes, s.copy_s));
    adam.push_back(s.host_adam_s[std::size_t(c)] + s.collective_s);
  }
  return std::max(device_adam, two_stage_pipeline_s(down, adam));
}

// The replicas of stage `stage` placed on node `node` (all of them without a placement).
std::vector<int> replicas_on(const Plan& p, int stage, int node) {
  std::vector<int> out;
  for (int r = 0; r < p.w; ++r)
    if (p.placement.empty() || p.placement[std::size_t(p.rank_of(stage, r))].node == node)
      out.push_back(r);
  return out;
}

// Chunk c's CPU Adam work on those replicas' GPUs: their parts of it, t GPUs each.
double replicas_adam_work(const ChunkLayout& L, int c, const std::vector<int>& replicas, int t) {
  double work = 0;
  for (int r : replicas) {
    const auto [lo, hi] = L.shard(c, r);
    work += double(t) * double(hi - lo);
  }
  return work;
}

// The step's forward and backward (each moment's compute and the copies before it) and
// optimizer step, from copy_s.
void time_copies(ChunkSchedule& s) {
  s.forward_s = s.backward_s = 0;
  for (const ChunkMoment& m : s.moments)
    (m.backward || m.recompute ? s.backward_s : s.forward_s) +=
        m.compute_s * s.gpu_sharers + m.tp_s + s.copies_s(m);
  s.optimizer_s = optimizer_time(s);
}

// Runs one step's (2bw: one segment's) eviction plan from `resident` (updated to its end), over
// units (ChunkLayout::parts: whole chunks, or with 2bw each chunk's two version slots and its
// gradient). Belady: before moment k, while the resident units and the moment's missing ones pass
// the room left by the non-model memory and the device-resident optimizer state, the resident
// unit not needed at k whose next use on the device is furthest (this step's remaining moments,
// then the next step's, cyclically; device-Adam chunks' units are used at the optimizer step)
// goes to the host, the larger unit index first on a tie. Then the missing units come up,
// ascending. At the optimizer step every host-Adam chunk's unit still on the device goes down.
// `where`: "stage s: " in a pipeline (each stage's device has its own plan), else empty.
// Sharded chunks (ChunkLayout::sharded): a chunk (with 2bw its gradient part) has a gradient from
// its first backward moment of the step on; before that its copies are parts (ChunkCopy::part),
// after it whole; with 2bw a version's slot always moves as its part.
// `host_peak`: the most bytes the chunks then take on the host (ChunkSchedule::host_peak_bytes'
// chunk part; 0 without sharding).
void run_step(const ChunkSchedule& s, std::vector<ChunkMoment>& plan,
              std::vector<bool>& adam_download, std::set<int>& resident, const std::string& where,
              std::int64_t& host_peak) {
  const ChunkLayout& L = s.layout;
  const int units = L.units(), moments = int(plan.size());
  const std::int64_t os = mul(s.device_adam_chunks, L.os_chunk_bytes);
  // need: moment k's units, need[need_from[k] .. need_from[k + 1]).
  std::vector<int> need;
  std::vector<std::size_t> need_from(std::size_t(moments) + 1, 0);
  for (int k = 0; k < moments; ++k) {
    append_moment_units(L, plan[std::size_t(k)], need);
    need_from[std::size_t(k) + 1] = need.size();
  }
  auto needs = [&](int k) {  // [first, last) of moment k's units
    return std::pair<const int*, const int*>{need.data() + need_from[std::size_t(k)],
                                             need.data() + need_from[std::size_t(k) + 1]};
  };
  // uses[u]: the moments (0 .. moments-1, and `moments` for the optimizer step) using u, ascending.
  std::vector<std::vector<int>> uses(static_cast<std::size_t>(units));
  for (int k = 0; k < moments; ++k)
    for (auto [u, end] = needs(k); u != end; ++u)
      uses[std::size_t(*u)].push_back(k);
  for (int u = 0; u < s.device_adam_chunks * L.parts; ++u)
    uses[std::size_t(u)].push_back(moments);
  auto next_use = [&](int u, int k) {  // distance from moment k to u's next use after it
    const std::vector<int>& at = uses[std::size_t(u)];
    const auto later = std::upper_bound(at.begin(), at.end(), k);
    if (later != at.end()) return *later - k;
    return at.empty() ? std::numeric_limits<int>::max() : at.front() + moments + 1 - k;
  };
  // A moment whose working set (its units, its non-model memory, the device optimizer state)
  // passes the device: the one that passes it most, so "by" is what the device lacks.
  int worst = -1;
  std::int64_t short_by = 0;
  for (int k = 0; k < moments; ++k) {
    const std::int64_t room = s.budget_bytes - plan[std::size_t(k)].non_model_bytes - os;
    const auto [first, last] = needs(k);
    const std::int64_t over = mul(std::int64_t(last - first), L.move_bytes) - room;
    if (over > short_by) worst = k, short_by = over;
  }
  if (worst >= 0) {
    const ChunkMoment& m = plan[std::size_t(worst)];
    const auto [first, last] = needs(worst);
    const auto n = std::int64_t(last - first);
    const char* what = L.parts == 1 ? "chunk" : "chunk part";
    throw ChunkWorkingSetError(
        fmt::format("offload chunks: {}the device's {} is smaller than the working set of the {} "
                    "({} {}{} of {} = {}, non-model memory {}{}) by {}",
                    where, gib(s.budget_bytes), m.label(L), n, what, n == 1 ? "" : "s",
                    gib(L.move_bytes), gib(mul(n, L.move_bytes)), gib(m.non_model_bytes),
                    os > 0 ? fmt::format(", device optimizer state {}", gib(os)) : "",
                    gib(short_by)),
        0);
  }
  // The units on the device (a flag per unit), how many, and their weight and gradient bytes.
  std::vector<char> on(std::size_t(units), 0);
  int count = 0;
  std::int64_t weights = 0, gradients = 0;
  auto put = [&](int u) {
    on[std::size_t(u)] = 1;
    ++count;
    weights = add(weights, L.unit_weight_bytes(u));
    gradients = add(gradients, L.unit_gradient_bytes(u));
  };
  auto drop = [&](int u) {
    on[std::size_t(u)] = 0;
    --count;
    weights -= L.unit_weight_bytes(u);
    gradients -= L.unit_gradient_bytes(u);
  };
  for (int u : resident)
    put(u);
  // Sharded chunks: which units have a gradient, and the units' bytes on the host (a host-Adam
  // chunk's part; with a gradient and on the host, the unit whole instead; an unsharded chunk's
  // unit whole while on the host; with 2bw a gradient part without a gradient nothing: its zeros
  // are made on the device). A whole chunk with a gradient half holds its parameters unchanged,
  // the part among them; without one (fp16, m = 1) the gradient overwrote them, and the part is
  // not kept either: nothing reads it before the optimizer step, whose CPU Adam writes the new
  // parameters from the fp32 master into the part's place in the chunk (PatrickStar's
  // regeneration).
  const bool sharding = L.part_bytes > 0;
  std::vector<char> dirty(std::size_t(units), 0);
  auto host_of = [&](int u) -> std::int64_t {
    const int c = u / L.parts;
    if (!L.is_sharded(c)) return on[std::size_t(u)] ? 0 : L.move_bytes;
    if (dirty[std::size_t(u)] && !on[std::size_t(u)]) return L.move_bytes;  // whole
    if (L.parts > 1 && !L.version_unit(u)) return 0;
    return s.device_resident(c) ? 0 : L.part_bytes;
  };
  std::int64_t host = 0;
  host_peak = 0;
  if (sharding) {
    for (int u = 0; u < units; ++u)
      host = add(host, host_of(u));
    host_peak = host;
  }
  auto moved = [&](int u, bool up) {  // a unit's copy, with the host's bytes
    if (sharding) host -= host_of(u);
    up ? put(u) : drop(u);
    if (sharding) host = add(host, host_of(u));
  };
  std::vector<int> missing;
  for (int k = 0; k < moments; ++k) {
    ChunkMoment& m = plan[std::size_t(k)];
    m.copies.clear();
    const auto [here, here_end] = needs(k);
    const std::int64_t room = s.budget_bytes - m.non_model_bytes - os;
    missing.clear();
    for (const int* u = here; u != here_end; ++u)
      if (!on[std::size_t(*u)]) missing.push_back(*u);
    while (mul(std::int64_t(count) + std::int64_t(missing.size()), L.move_bytes) > room) {
      int victim = -1, far = -1;
      for (int u = 0; u < units; ++u) {
        if (!on[std::size_t(u)] || std::binary_search(here, here_end, u)) continue;
        const int d = next_use(u, k);
        if (d >= far) far = d, victim = u;  // ascending: a tie goes to the larger index
      }
      m.copies.push_back(
          {false, victim,
           sharding && L.is_sharded(victim / L.parts) && !dirty[std::size_t(victim)]});
      moved(victim, false);
    }
    host_peak = std::max(host_peak, host);  // the evictions' whole chunks before the uploads
    for (int u : missing) {
      m.copies.push_back(
          {true, u, sharding && L.is_sharded(u / L.parts) && !dirty[std::size_t(u)]});
      moved(u, true);
    }
    if (sharding && m.backward)
      for (const int* u = here; u != here_end; ++u)
        if (!L.version_unit(*u)) dirty[std::size_t(*u)] = 1;  // on the device: the host's stay
    m.resident = count;
    m.weight_bytes = weights;
    m.gradient_bytes = gradients;
  }
  // The optimizer step: host-Adam chunks' units on the device go to the host (CPU Adam reads the
  // gradients and, with 2bw, writes the new version into the older one's slot there);
  // device-Adam chunks stay (K > 0 only when every unit fits). A sharded chunk's download is its
  // gradient's part (P), held until the step's end; the whole chunks of the step go then too.
  // With 2bw a sharded version's slot is dropped (its part is on the host).
  adam_download.assign(std::size_t(units), false);
  std::int64_t downloaded = 0;
  for (int u = s.device_adam_chunks * L.parts; u < units; ++u)
    if (on[std::size_t(u)]) {
      drop(u);
      adam_download[std::size_t(u)] = true;
      const bool part = L.is_sharded(u / L.parts);
      downloaded =
          add(downloaded, !part ? L.move_bytes
                          : L.part_copy(u, false, true) == ChunkLayout::PartCopy::gradient_down
                              ? L.part_bytes
                              : 0);
    }
  if (sharding) {
    // Until the step's end: every unit as the step's moments left it (a downloaded sharded one
    // its parameters' part: none for a 2bw gradient part), and the downloads. Then each sharded
    // unit is its part again.
    std::int64_t at_step = downloaded;
    for (int u = 0; u < units; ++u)
      if (!adam_download[std::size_t(u)])
        at_step = add(at_step, host_of(u));
      else if (L.is_sharded(u / L.parts) && (L.parts == 1 || L.version_unit(u)))
        at_step = add(at_step, L.part_bytes);
    host_peak = std::max(host_peak, at_step);
  }
  for (int u = 0; u < s.device_adam_chunks * L.parts; ++u)
    if (!on[std::size_t(u)])
      throw std::logic_error("chunk_schedule: a device-Adam chunk is not on the device");
  resident.clear();
  for (int u = 0; u < units; ++u)
    if (on[std::size_t(u)]) resident.insert(resident.end(), u);
}

}  // namespace

ChunkSchedule chunk_schedule(const models::ModelSpec& model, const traces::Trace& trace,
                             const clusters::Cluster& cluster, const Plan& p, int stage) {
  if (p.offload != Offload::chunks) throw std::logic_error("chunk_schedule: not a chunks plan");
  check(p);
  ChunkSchedule s;
  s.layout =
      chunk_layout(model, p.chunk_bytes > 0 ? p.chunk_bytes : default_chunk_bytes(model), p, stage);
  const bool two_bw = p.schedule == Schedule::two_bw;
  if (two_bw) {
    // Two live weight versions and the gradient, each moving on its own (ChunkLayout::parts).
    s.layout.parts = 3;
  } else if (p.m > 1 || model.dtype == models::DType::fp32) {
    // A gradient half beside the parameters when m > 1 (later microbatches still need them), and
    // always for fp32: no separate fp32 master keeps the weights, so a gradient written over its
    // parameter would lose them (the optimizer state is m and v only, 8 B).
    s.layout.move_bytes = mul(2, s.layout.chunk_bytes);
  }
  const ChunkLayout& L = s.layout;
  const int n = L.chunks(), units = L.units();
  const traces::Entry& e = trace.at(p.b);
  s.budget_bytes = cluster.device.memory_bytes;
  for (int l = 0; l < s.layout.layers(); ++l)  // the stage's own layers
    s.workspace_bytes =
        std::max(s.workspace_bytes, e.layers[layer_kind(model, s.layout, l)].workspace_bytes);
  if (two_bw) {
    for (std::vector<ChunkMoment>& m : segment_moments(model, trace, p, L, s.workspace_bytes))
      s.segments.push_back({std::move(m), {}, 0, 0});
  } else {
    s.moments = order_moments(model, trace, p, L, s.workspace_bytes, step_compute_order(p, stage));
  }
  // t > 1: each moment's TP collectives on the group's link (§4's, layer by layer).
  if (p.t > 1) {
    const models::ModelCosts tmc = models::derive_costs(model, {p.t, p.sp});
    const clusters::Link tp = p.placement.empty() ? clusters::p2p_link(cluster, 0, 0, 0, 1)
                                                  : tp_link(cluster, p, p.rank_of(stage, 0));
    std::map<models::LayerKind, ChunkCost> per;
    for (models::LayerKind k : traces::kLayerKinds)
      per[k] = layer_cost(tmc, trace, p, k);
    auto add_tp = [&](std::vector<ChunkMoment>& moments) {
      for (ChunkMoment& m : moments) {
        const ChunkCost& c = per.at(m.kind);
        m.tp_s = m.backward ? tp_backward_s(c, p.t, tp) : tp_time_s(c.tp_forward, p.t, tp);
        if (m.remake) m.tp_s += tp_time_s(c.tp_forward, p.t, tp);  // the layer's forward again
      }
    };
    add_tp(s.moments);
    for (ChunkSegmentPlan& g : s.segments)
      add_tp(g.moments);
  }
  std::int64_t non_model_peak = 0;
  for (const ChunkMoment& m : s.moments)
    non_model_peak = std::max(non_model_peak, m.non_model_bytes);
  for (const ChunkSegmentPlan& g : s.segments)
    for (const ChunkMoment& m : g.moments)
      non_model_peak = std::max(non_model_peak, m.non_model_bytes);
  // K: optimizer state on the device only in the margin left by every unit and the peak
  // non-model memory (PatrickStar's device-aware placement of the OS chunks).
  const std::int64_t margin = s.budget_bytes - mul(units, L.move_bytes) - non_model_peak;
  s.device_adam_chunks = margin > 0 ? int(std::min<std::int64_t>(n, margin / L.os_chunk_bytes)) : 0;
  // The fixed point: from the device-Adam chunks' units on the device and the rest on the host,
  // steps (2bw: steady segments) until one ends where it started (host-Adam chunks always end on
  // the host, device-Adam ones on the device). With 2bw every segment then runs from it and must
  // end there.
  const std::string where = p.d > 1 ? fmt::format("stage {}: ", stage) : std::string();
  std::vector<ChunkMoment>& basis =
      two_bw ? s.segments[std::size_t(ChunkSegment::steady)].moments : s.moments;
  std::set<int> start;
  std::int64_t host_sharded = 0;  // sharded chunks: run_step's host peak
  for (int u = 0; u < s.device_adam_chunks * L.parts; ++u)
    start.insert(u);
  for (int round = 0;; ++round) {
    std::set<int> resident = start;
    run_step(s, basis, s.adam_download, resident, where, host_sharded);
    if (resident == start) break;
    if (round == 8) throw std::logic_error("chunk_schedule: no fixed point");
    start = resident;
  }
  for (ChunkSegmentPlan& g : s.segments) {
    std::set<int> resident = start;
    run_step(s, g.moments, g.adam_download, resident, where, host_sharded);
    if (resident != start)
      throw std::logic_error("chunk_schedule: a 2bw segment off the fixed point");
  }
  if (two_bw) {
    const ChunkSegmentPlan& steady = s.segments[std::size_t(ChunkSegment::steady)];
    s.moments = steady.moments;
    s.adam_download = steady.adam_download;
  }
  s.start_on_device.assign(std::size_t(units), false);
  for (int u : start)
    s.start_on_device[std::size_t(u)] = true;

  // Times and figures (docs/formulas.md, section 9, chunks).
  HostPath path = host_path(cluster, p, p.rank_of(stage, 0));
  // A copy at the GPU's own link, its shared uplink to itself: the stages' copies are short and
  // come right before their layers, so two on one uplink seldom overlap (one microbatch passes
  // the stages one after the other: never; against the simulator, which shares an uplink only
  // while two copies overlap, 1% at most: docs/formulas.md section 9, chunks).
  // The stage's w replicas, though, run the same plan in lockstep: their copies overlap, sharing
  // a GPU's link and an uplink where they share them (the most crowded replica's share).
  // With t > 1 every GPU of each replica's TP group copies its own chunks, in lockstep too.
  int on_gpu = 1, on_uplink = 1;
  if (!p.placement.empty())
    for (int r = 0; r < p.w; ++r)
      for (int i = 0; i < p.t; ++i) {
        const Placement& me = p.placement[std::size_t(p.rank_of(stage, r))];
        const int mine = me.gpu + i;
        int gpu = 0, uplink = 0;
        for (int q = 0; q < p.w; ++q)
          for (int j = 0; j < p.t; ++j) {
            const Placement& other = p.placement[std::size_t(p.rank_of(stage, q))];
            if (other.node != me.node) continue;
            const int theirs = other.gpu + j;
            gpu += theirs == mine ? 1 : 0;
            uplink += theirs / cluster.host.gpus_per_uplink == mine / cluster.host.gpus_per_uplink
                          ? 1
                          : 0;
          }
        on_gpu = std::max(on_gpu, gpu);
        on_uplink = std::max(on_uplink, uplink);
      }
  path.bandwidth_bytes_per_s = std::min(cluster.host.pcie_bandwidth_bytes_per_s / on_gpu,
                                        cluster.host.uplink_bandwidth_bytes_per_s / on_uplink);
  s.gpu_sharers = on_gpu;  // and their compute its GPU (--ranks-per-gpu)
  s.copy_s = path.time_s(double(L.move_bytes));
  if (L.part_bytes > 0) s.part_copy_s = path.time_s(double(L.part_bytes));
  s.copy_latency_s = path.latency_s;
  s.link_bytes_per_s = cluster.host.pcie_bandwidth_bytes_per_s / on_gpu;
  s.uplink_bytes_per_s = cluster.host.uplink_bandwidth_bytes_per_s;
  s.uplink_sharers = on_uplink;
  // The node's CPU Adam, shared by the GPUs it holds (every GPU of a TP group steps its own
  // chunks) as if their optimizer steps ran at the same time (chunk_schedules then shares it from
  // when each stage reaches its step).
  int sharing = 0;
  const int node = p.placement.empty() ? 0 : p.placement[std::size_t(p.rank_of(stage, 0))].node;
  for (const Placement& at : p.placement)
    sharing += at.node == node ? p.t : 0;
  s.device_adam_s.assign(std::size_t(n), 0);
  s.host_adam_s.assign(std::size_t(n), 0);
  const models::ModelCosts mc = models::derive_costs(model, {p.t, p.sp});
  auto device_rate = [&](int layer) {  // seconds per parameter of Adam on the device
    const auto kind = layer_kind(model, L, layer);
    const std::int64_t params = mc.layer(kind).parameters;
    return params > 0 ? trace.statics[kind].optimizer_step_s / double(params) : 0.0;
  };
  // Replica 0's part of each chunk (all of it with w = 1): the elements of each tensor inside it.
  for (const ChunkTensor& t : L.tensors) {
    if (t.tied_copy) continue;
    const auto [lo, hi] = L.shard(t.chunk, 0);
    const std::int64_t in =
        std::max<std::int64_t>(0, std::min(hi, t.offset + t.elements) - std::max(lo, t.offset));
    s.device_adam_s[std::size_t(t.chunk)] += double(in) * device_rate(t.layer);
  }
  // Replica 0's part is the largest: the stage's replicas on the node step their parts of chunk c
  // in lockstep (each chunk's reduce-scatter starts them together), so with processor sharing it
  // ends when the node's CPU has done all of their parts (t jobs each) beside the other stages'
  // jobs, each as long as replica 0's. With w = 1 (or even parts): adam_elements / (capacity /
  // sharing).
  const std::vector<int> mine = replicas_on(p, stage, node);
  const int others = std::max(0, sharing - int(mine.size()) * p.t);
  const double capacity = cluster.host.cpu_adam_params_per_s();
  for (int c = 0; c < n; ++c)
    s.host_adam_s[std::size_t(c)] =
        capacity > 0
            ? (double(others) * double(L.adam_elements(c)) + replicas_adam_work(L, c, mine, p.t)) /
                  capacity
            : std::numeric_limits<double>::infinity();
  if (p.w > 1) s.collective_s = data_parallel_allreduce_s(cluster, p, stage, double(L.chunk_bytes));
  const std::int64_t os = mul(s.device_adam_chunks, L.os_chunk_bytes);
  int most_host = 0;
  // The peaks: of the step (2bw: of every segment; the first segment's on a tie).
  auto peak_of = [&](const std::vector<ChunkMoment>& moments, std::int64_t& peak, int& at) {
    for (std::size_t k = 0; k < moments.size(); ++k) {
      const ChunkMoment& m = moments[k];
      const std::int64_t device = add(add(mul(m.resident, L.move_bytes), m.non_model_bytes), os);
      if (device > peak) {
        peak = device;
        at = int(k);
      }
      most_host = std::max(most_host, units - m.resident);
    }
  };
  if (!two_bw) peak_of(s.moments, s.device_peak_bytes, s.peak_moment);
  for (int g = 0; g < int(s.segments.size()); ++g) {
    ChunkSegmentPlan& seg = s.segments[std::size_t(g)];
    peak_of(seg.moments, seg.device_peak_bytes, seg.peak_moment);
    if (seg.device_peak_bytes > s.device_peak_bytes) {
      s.device_peak_bytes = seg.device_peak_bytes;
      s.peak_moment = seg.peak_moment;
      s.peak_segment = g;
    }
  }
  // One step's copies and times: the step's (2bw: the steady segment's).
  // A whole copy moves move_bytes, a part P, a drop or a zero fill nothing (sharded chunks).
  using PartCopy = ChunkLayout::PartCopy;
  for (const ChunkMoment& m : s.moments) {
    for (const ChunkCopy& c : m.copies) {
      const PartCopy what = c.part ? L.part_copy(c.unit, c.to_device, false) : PartCopy::upload;
      if (what == PartCopy::drop || what == PartCopy::zero_fill) {
        ++(what == PartCopy::drop ? s.drops : s.zero_fills);
        continue;
      }
      (c.to_device ? s.uploads : s.downloads) += 1;
      if (c.part) ++s.part_uploads;
      std::int64_t& bytes = c.to_device ? s.copy_in_bytes : s.copy_out_bytes;
      bytes = add(bytes, c.part ? L.part_bytes : L.move_bytes);
    }
    s.compute_s += m.compute_s + m.tp_s;
  }
  double device_adam = 0;
  for (int c = 0; c < n; ++c)
    if (s.device_resident(c)) device_adam += s.device_adam_s[std::size_t(c)];
  for (int u = 0; u < units; ++u)
    if (s.adam_download[std::size_t(u)]) {
      const bool part = L.is_sharded(u / L.parts);
      if (part && L.part_copy(u, false, true) == PartCopy::drop) {  // 2bw: a version's slot
        ++s.drops;
        continue;
      }
      ++s.downloads;
      if (part) ++s.part_downloads;
      s.copy_out_bytes = add(s.copy_out_bytes, part ? L.part_bytes : L.move_bytes);
    }
  most_host = std::max(most_host, units - s.device_adam_chunks * L.parts);
  time_copies(s);
  s.compute_s += device_adam;
  s.host_chunk_peak_bytes = L.part_bytes > 0 ? host_sharded : mul(most_host, L.move_bytes);
  s.host_peak_bytes = add(mul(n - s.device_adam_chunks, L.os_chunk_bytes), s.host_chunk_peak_bytes);
  return s;
}

ChunkPipeline chunk_pipeline(const std::vector<ChunkSchedule>& all, const Plan& p,
                             const std::vector<double>& hop_s) {
  const std::size_t d = all.size();
  if (hop_s.size() != d) throw std::logic_error("chunk_pipeline: one hop per stage");
  // 2bw has no flush: a run of four steps (fill, two steady segments, last), each stage's
  // optimizer step after its step's last backward; the steady period is between the optimizer
  // steps ending steps 1 and 2.
  const bool two_bw = p.schedule == Schedule::two_bw;
  const int steps = two_bw ? 4 : 1;
  std::vector<std::vector<ComputeSlot>> order(d);
  std::vector<std::vector<double>> dur(d);
  for (std::size_t s = 0; s < d; ++s) {
    order[s] = two_bw ? run_compute_order(p, int(s), steps) : step_compute_order(p, int(s));
    dur[s].assign(order[s].size(), 0.0);
    // The ops of each segment (a step) are numbered from 0 in its moments.
    std::size_t first = 0;
    for (int t = 0; t < steps; ++t) {
      std::size_t ops = 0;
      for (const ChunkMoment& m : all[s].moments_of(0, steps, t)) {
        const std::size_t at = first + std::size_t(m.slot);
        dur[s].at(at) += m.compute_s * all[s].gpu_sharers + m.tp_s + all[s].copies_s(m);
        ops = std::max(ops, std::size_t(m.slot) + 1);
      }
      first += ops;
    }
  }
  std::vector<std::vector<double>> tail_end(d);
  AfterOp optimizer_step;  // 2bw: the step's optimizer step after its last backward
  if (two_bw)
    optimizer_step = [&](std::size_t s, const ComputeSlot& op, double end) {
      if (!op.backward || op.microbatch != p.m - 1) return end;
      tail_end[s].push_back(end + all[s].optimizer_s);
      return tail_end[s].back();
    };
  const OrderWalk walk = walk_compute_orders(p, order, dur, hop_s, steps, optimizer_step);
  ChunkPipeline out;
  out.start = walk.start;
  out.end = walk.end;
  for (std::size_t s = 0; s < d; ++s) {
    if (two_bw) {  // the steady step: from the end of step 1's optimizer step to step 2's compute
      out.start[s] = tail_end[s].at(1);
      out.end[s] = tail_end[s].at(2) - all[s].optimizer_s;
      out.makespan = std::max(out.makespan, out.end[s] - out.start[s]);
    } else {
      out.makespan = std::max(out.makespan, out.end[s]);
    }
  }
  return out;
}

namespace {

// Flush schedules: the stages behind one uplink each download their host-Adam chunks (or their
// gradients' parts) at their optimizer step, from the moment their last compute op ends
// (chunk_pipeline). Those downloads share the uplink: each of the n stages downloading at a time
// gets min(its own link, uplink / (its replicas behind it x n)) until its bytes are down. Where
// that is slower than alone, a stage's downloads then move at its bytes over the time they took
// (step_bytes_per_s): each one its latency plus its own bytes at that rate, a sharded chunk's part
// as a whole chunk's (docs/formulas.md section 9, chunks, "Time").
void share_step_downloads(std::vector<ChunkSchedule>& all, const Plan& p,
                          const std::vector<std::pair<int, int>>& uplink) {
  const std::size_t d = all.size();
  const ChunkPipeline run = chunk_pipeline(all, p, std::vector<double>(d, 0.0));
  std::vector<double> left(d, 0), finish(d, 0), rate_alone(d, 0);
  std::vector<int> copies(d, 0);
  for (std::size_t s = 0; s < d; ++s) {
    const ChunkSchedule& cs = all[s];
    const ChunkLayout& L = cs.layout;
    for (int c = cs.device_adam_chunks; c < L.chunks(); ++c)
      for (int u = c * L.parts; u < (c + 1) * L.parts; ++u)
        if (cs.adam_download[std::size_t(u)]) {
          if (L.is_sharded(c) && L.version_unit(u)) continue;  // 2bw: a drop
          ++copies[s];
          left[s] += double(L.is_sharded(c) ? L.part_bytes : L.move_bytes);
          if (L.is_sharded(c)) break;  // its gradient's part, once
        }
    rate_alone[s] = std::min(cs.link_bytes_per_s, cs.uplink_bytes_per_s / cs.uplink_sharers);
  }
  // Processor sharing per uplink, from the releases on (event by event: a release or an end).
  std::vector<SharedEntry> jobs(d);
  std::map<std::pair<int, int>, int> groups;  // an uplink's group
  for (std::size_t s = 0; s < d; ++s) {
    jobs[s].release = run.end[s];
    if (left[s] > 0) jobs[s].phases = {{true, left[s]}};
    jobs[s].group = groups.emplace(uplink[s], int(groups.size())).first->second;
    jobs[s].weight = double(all[s].uplink_sharers);
    jobs[s].capacity = all[s].uplink_bytes_per_s;
    jobs[s].cap = all[s].link_bytes_per_s;
  }
  const std::vector<std::vector<double>> ends = processor_sharing(jobs);
  for (std::size_t s = 0; s < d; ++s)
    if (!ends[s].empty()) finish[s] = ends[s].back();
  for (std::size_t s = 0; s < d; ++s) {
    ChunkSchedule& cs = all[s];
    if (copies[s] == 0) continue;
    // The copies' latencies are outside the sharing (each copy pays its own).
    const double moving = finish[s] - run.end[s];
    if (moving <= 0) continue;
    const double rate = left[s] / moving;
    if (rate < rate_alone[s] * (1 - 1e-9)) {
      cs.step_bytes_per_s = rate;
      cs.optimizer_s = optimizer_time(cs);
    }
  }
}

// 2bw has no flush: in its steady state the stages copy at the same time, so stages behind one
// uplink share it. Each copy is taken at the uplink's share left by the other stages' copying the
// same way (a link carries each direction at its bandwidth), each busy for its fraction of the
// step (the larger of its uploads and downloads x copy_s / the step): bandwidth
// uplink / (replicas in lockstep + the others' busy fractions), from the stages' step in the
// closed form (chunk_pipeline), eight rounds toward a fixed point (docs/formulas.md section 9,
// chunks with 2bw). Flush schedules: only their optimizer steps' downloads share it
// (share_step_downloads).
void share_uplinks(std::vector<ChunkSchedule>& all, const clusters::Cluster& cluster,
                   const Plan& p) {
  if (p.d == 1 || p.placement.empty()) return;
  const std::size_t d = all.size();
  std::vector<std::pair<int, int>> uplink(d);  // (node, uplink) of the stage's replica 0
  for (std::size_t s = 0; s < d; ++s) {
    const Placement& at = p.placement[std::size_t(p.rank_of(int(s), 0))];
    uplink[s] = {at.node, at.gpu / cluster.host.gpus_per_uplink};
  }
  bool shared = false;
  for (std::size_t s = 0; s < d; ++s)
    for (std::size_t j = s + 1; j < d; ++j)
      shared = shared || uplink[s] == uplink[j];
  if (!shared) return;
  if (p.schedule != Schedule::two_bw) return share_step_downloads(all, p, uplink);
  for (int round = 0; round < 8; ++round) {
    const ChunkPipeline run = chunk_pipeline(all, p, std::vector<double>(d, 0.0));
    double step = 0;
    for (std::size_t s = 0; s < d; ++s)
      step = std::max(step, run.end[s] + all[s].optimizer_s - run.start[s]);
    if (step <= 0) return;
    std::vector<double> busy(d);
    for (std::size_t s = 0; s < d; ++s)
      busy[s] = std::min(1.0, std::max(all[s].uploads, all[s].downloads) * all[s].copy_s / step);
    for (std::size_t s = 0; s < d; ++s) {
      double others = 0;
      for (std::size_t j = 0; j < d; ++j)
        if (j != s && uplink[j] == uplink[s]) others += busy[j] * all[j].uplink_sharers;
      ChunkSchedule& cs = all[s];
      const double bandwidth =
          std::min(cs.link_bytes_per_s, cs.uplink_bytes_per_s / (cs.uplink_sharers + others));
      cs.copy_s = cs.copy_latency_s + double(cs.layout.move_bytes) / bandwidth;
      time_copies(cs);
    }
  }
}

// The halvings of the plan's chunk size (a MiB multiple while >= 1 MiB, else a multiple of e) down
// to the largest tensor's bytes: the largest at which every stage's working sets fit, with its
// stages' schedules in `out`, or 0.
std::int64_t fitting_ladder(const models::ModelSpec& model, const traces::Trace& trace,
                            const clusters::Cluster& cluster, const Plan& p,
                            std::vector<ChunkSchedule>& out) {
  const std::int64_t e = models::dtype_bytes(model.dtype), mib = std::int64_t{1} << 20;
  std::int64_t floor = 0;  // the largest tensor's bytes: no chunk can be smaller
  for (const ChunkTensor& t : model_tensors(model, p.t))
    floor = std::max(floor, mul(t.elements, e));
  const std::int64_t from = p.chunk_bytes > 0 ? p.chunk_bytes : default_chunk_bytes(model);
  Plan q = p;
  for (std::int64_t half = from / 2, tried = from; tried > floor; half /= 2) {
    std::int64_t rung = half >= mib ? half / mib * mib : half / e * e;
    rung = std::max(rung, floor);
    if (rung >= tried) break;
    tried = rung;
    q.chunk_bytes = rung;
    out.clear();
    try {
      for (int s = 0; s < p.d; ++s)
        out.push_back(chunk_schedule(model, trace, cluster, q, s));
      return rung;
    } catch (const ChunkWorkingSetError&) {
    }
  }
  out.clear();
  return 0;
}

}  // namespace

double ChunkSchedule::copies_s(const ChunkMoment& moment) const {
  double t = 0;
  for (const ChunkCopy& c : moment.copies)
    t += !c.part ? copy_s
         : layout.part_copy(c.unit, c.to_device, false) == ChunkLayout::PartCopy::upload
             ? part_copy_s + collective_s / 2
             : 0.0;
  return t;
}

std::int64_t smaller_fitting_chunk_bytes(const models::ModelSpec& model, const traces::Trace& trace,
                                         const clusters::Cluster& cluster, const Plan& p) {
  std::vector<ChunkSchedule> unused;
  return fitting_ladder(model, trace, cluster, p, unused);
}

std::vector<ChunkSchedule> chunk_schedules(const models::ModelSpec& model,
                                           const traces::Trace& trace,
                                           const clusters::Cluster& cluster, const Plan& p) {
  std::vector<ChunkSchedule> out;
  try {
    for (int s = 0; s < p.d; ++s)
      out.push_back(chunk_schedule(model, trace, cluster, p, s));
  } catch (const ChunkWorkingSetError& e) {
    const std::int64_t fits = fitting_ladder(model, trace, cluster, p, out);
    // No chunk size given: the default is the one that fits, whose schedules the ladder made.
    if (p.chunk_bytes != 0 || fits <= 0)
      throw ChunkWorkingSetError(
          fits > 0 ? fmt::format("{}; a chunk size of {} ({} B: --chunk-size, or the plan's "
                                 "chunk_bytes) lets every working set fit",
                                 e.what(), gib(fits), fits)
                   : fmt::format("{}; no smaller chunk size fits either", e.what()),
          fits);
  }
  // The stages of a node share its CPU by processor sharing from the moments they reach their
  // optimizer steps (docs/formulas.md section 9, chunks): when their last compute op ends in one
  // step of the pipeline (chunk_pipeline, the hops between stages left out), then their first
  // host chunk's download. Each stage's rate is its work over the time it takes.
  share_uplinks(out, cluster, p);
  const double capacity = cluster.host.cpu_adam_params_per_s();
  if (capacity <= 0 || p.d == 1) return out;
  const ChunkPipeline run = chunk_pipeline(out, p, std::vector<double>(out.size(), 0.0));
  const auto node_of = [&](int rank) {
    return p.placement.empty() ? 0 : p.placement[std::size_t(rank)].node;
  };
  // Per node, the stages with replicas on it: each such stage's t x (its replicas there) CPU Adam
  // jobs, one per GPU, in lockstep chunk by chunk (each chunk's reduce-scatter starts them
  // together), and per host chunk their work together (every replica's part, t times).
  struct Entry {
    std::size_t stage = 0;
    int jobs = 0;
    std::vector<double> chunk_work;  // per chunk (0 for device-Adam chunks)
    double work = 0;                 // summed
  };
  std::map<int, std::vector<Entry>> by_node;
  std::vector<double> release(out.size(), 0);
  for (std::size_t s = 0; s < out.size(); ++s) {
    const ChunkSchedule& cs = out[s];
    const ChunkLayout& L = cs.layout;
    std::set<int> nodes;
    for (int r = 0; r < p.w; ++r)
      nodes.insert(node_of(p.rank_of(int(s), r)));
    for (int node : nodes) {
      const std::vector<int> here = replicas_on(p, int(s), node);
      Entry e{s, p.t * int(here.size()), std::vector<double>(std::size_t(L.chunks()), 0.0), 0};
      for (int c = cs.device_adam_chunks; c < L.chunks(); ++c) {
        e.chunk_work[std::size_t(c)] = replicas_adam_work(L, c, here, p.t);
        e.work += e.chunk_work[std::size_t(c)];
      }
      by_node[node].push_back(std::move(e));
    }
    release[s] = run.end[s];
    const int c = cs.device_adam_chunks;  // the first host chunk's units on the device go down
    for (int u = c * L.parts; c < L.chunks() && u < (c + 1) * L.parts; ++u)
      release[s] += !cs.adam_download[std::size_t(u)] || (L.is_sharded(c) && L.version_unit(u))
                        ? 0.0
                    : L.is_sharded(c) ? cs.step_copy(L.part_bytes, cs.part_copy_s)
                                      : cs.step_copy(L.move_bytes, cs.copy_s);
  }
  // Processor sharing among the entries, chunk by chunk: each entry's jobs run its host chunks'
  // CPU Adam in order, each chunk's between its collectives (w > 1: the gradient's reduce-scatter
  // before, the parameters' all-gather after, half of collective_s each; a sharded chunk's gradient
  // reduce-scattered on the device has none before, and no all-gather after), which use no CPU:
  // the other entries' jobs share it without them meanwhile, as in the simulator. A stage's Adam
  // of chunk c takes the time its CPU phase took; its replica 0's node's entry sets it.
  for (const auto& [node, entries] : by_node) {
    std::vector<SharedEntry> shared;
    for (const Entry& e : entries) {
      const ChunkSchedule& cs = out[e.stage];
      const ChunkLayout& L = cs.layout;
      SharedEntry& se = shared.emplace_back();
      se.release = release[e.stage];
      se.weight = double(e.jobs);
      se.capacity = capacity;
      std::vector<SharedPhase>& mine = se.phases;
      for (int c = cs.device_adam_chunks; c < L.chunks(); ++c) {
        // A sharded chunk's gradient part came down after its reduce-scatter.
        const bool down = cs.adam_download[std::size_t(L.gradient_unit(c))];
        const bool sharded = L.is_sharded(c);
        mine.push_back({false, sharded && down ? 0.0 : cs.collective_s / 2});
        mine.push_back({true, e.chunk_work[std::size_t(c)] / double(e.jobs)});
        mine.push_back({false, sharded ? 0.0 : cs.collective_s / 2});
      }
    }
    const std::vector<std::vector<double>> ends = processor_sharing(shared);
    for (std::size_t i = 0; i < entries.size(); ++i) {
      const Entry& e = entries[i];
      if (e.work <= 0 || node_of(p.rank_of(int(e.stage), 0)) != node) continue;
      ChunkSchedule& cs = out[e.stage];
      // Chunk k's CPU phase is phase 3k + 1: from the end of the pause before it to its own end.
      for (int c = cs.device_adam_chunks, k = 0; c < cs.layout.chunks(); ++c, ++k)
        cs.host_adam_s[std::size_t(c)] =
            ends[i][std::size_t(3 * k + 1)] - ends[i][std::size_t(3 * k)];
      cs.optimizer_s = optimizer_time(cs);
    }
  }
  return out;
}

}  // namespace pw::planner
