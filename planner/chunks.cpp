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

std::vector<ChunkTensor> model_tensors(const models::ModelSpec& s) {
  const models::ModelCosts mc = models::derive_costs(s);
  const std::int64_t C = s.hidden, F = s.ffn, V = models::padded_vocab(s, 1);
  const std::int64_t hd = C / s.heads, Q = (s.heads + 2 * models::key_value_heads(s)) * hd;
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
    put(layer, h + "proj.w", C * C);
    if (bias) put(layer, h + "proj.b", C);
    norm(layer, h + "ln2");
    for (const char* in : s.mlp == models::Mlp::gelu ? std::vector<const char*>{"fc"}
                                                     : std::vector<const char*>{"gate", "up"}) {
      put(layer, h + in + ".w", C * F);
      if (bias) put(layer, h + in + ".b", F);
    }
    put(layer, h + "fc2.w", F * C);
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

// The layout of `tensors` (model layers first_layer .. first_layer + names.size() - 1, in
// first-use order), renumbered from 0. `tied_head`: the head computes with the embedding's wte
// (the whole model on one stage).
ChunkLayout layout_of(const models::ModelSpec& model, std::int64_t chunk_bytes,
                      std::vector<ChunkTensor> tensors, int first_layer,
                      std::vector<std::string> names, bool tied_head) {
  const std::int64_t e = models::dtype_bytes(model.dtype);
  ChunkLayout L;
  L.first_layer = first_layer;
  L.chunk_bytes = chunk_bytes;
  L.move_bytes = chunk_bytes;
  L.chunk_elements = chunk_bytes / e;
  L.shard_elements = L.chunk_elements;
  L.os_chunk_bytes = mul(L.chunk_elements, optimizer_bytes_per_parameter(model.dtype));
  L.tensors = std::move(tensors);
  for (ChunkTensor& t : L.tensors)
    t.layer -= first_layer;
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

std::string layer_name(const models::ModelSpec& model, int layer) {
  return layer == 0                       ? std::string("embedding")
         : layer == int(model.layers + 1) ? std::string("head")
                                          : fmt::format("block {}", layer - 1);
}

}  // namespace

std::pair<std::int64_t, std::int64_t> ChunkLayout::shard(int chunk, int replica) const {
  const std::int64_t owned = chunk_owned.at(std::size_t(chunk));
  return {std::min(owned, mul(replica, shard_elements)),
          std::min(owned, mul(replica + 1, shard_elements))};
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

ChunkLayout chunk_layout(const models::ModelSpec& model, std::int64_t chunk_bytes) {
  std::vector<std::string> names;
  for (int l = 0; l < int(model.layers + 2); ++l)
    names.push_back(layer_name(model, l));
  return layout_of(model, chunk_bytes, model_tensors(model), 0, std::move(names),
                   model.tied_embeddings);
}

namespace {

ChunkLayout stage_layout(const models::ModelSpec& model, std::int64_t chunk_bytes, const Plan& p,
                         int stage) {
  if (p.d == 1) return chunk_layout(model, chunk_bytes);
  if (int(p.stage_blocks.size()) != p.virtual_stages() || stage < 0 || stage >= p.d)
    throw std::logic_error("chunk_layout: the plan's stages are not resolved");
  std::int64_t before = 0;
  for (int s = 0; s < stage; ++s)
    before += p.stage_blocks[std::size_t(s)];
  const bool first = stage == 0, last = stage == p.d - 1;
  // Model layers lo .. hi: the stage's blocks, with the embedding before and the head after.
  const int lo = first ? 0 : int(before + 1);
  const int hi = int(before + p.stage_blocks[std::size_t(stage)]) + (last ? 1 : 0);
  std::vector<ChunkTensor> tensors;
  for (const ChunkTensor& t : model_tensors(model))
    if (t.layer >= lo && t.layer <= hi) tensors.push_back(t);
  if (last && model.tied_embeddings) {
    ChunkTensor copy = model_tensors(model).front();  // wte
    copy.layer = hi;
    copy.tied_copy = true;
    tensors.push_back(copy);
  }
  std::vector<std::string> names;
  for (int l = lo; l <= hi; ++l)
    names.push_back(layer_name(model, l));
  ChunkLayout L = layout_of(model, chunk_bytes, std::move(tensors), lo, std::move(names), false);
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
  return L;
}

namespace {

models::LayerKind layer_kind(const models::ModelSpec& model, const ChunkLayout& L, int layer) {
  const int g = L.first_layer + layer;
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
std::vector<ChunkMoment> step_moments(const models::ModelSpec& model, const traces::Trace& trace,
                                      const Plan& p, const ChunkLayout& L, std::int64_t workspace) {
  const traces::Entry& e = trace.at(p.b);
  const int layers = L.layers();
  auto kind = [&](int l) { return layer_kind(model, L, l); };
  const bool rc = p.recomputes(L.stage);
  // The stage's I and X, as §4 counts them for the stage without chunks (v = 1: one chunk).
  std::int64_t input = 0, scratch = 0;
  if (rc) {
    if (int(p.stage_blocks.size()) != p.virtual_stages())
      throw std::logic_error("step_moments: the plan's stages are not resolved");
    const ChunkCost ch = chunk_cost(models::derive_costs(model), trace, p, L.stage, 0);
    input = ch.input_bytes;
    scratch = ch.recompute_scratch_bytes;
  }
  std::vector<ChunkMoment> out;
  std::int64_t held = 0;
  const std::int64_t messages = message_buffer_bytes(p, trace, L.stage);
  const std::vector<ComputeSlot> order = step_compute_order(p, L.stage);
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
    m.compute_s = back ? t.backward_s : again ? t.recompute_s : t.forward_s;
    out.push_back(m);
    held -= give;
  };
  for (int i = 0; i < int(order.size()); ++i) {
    const bool back = order[std::size_t(i)].backward;
    if (!back) {
      for (int l = 0; l < layers; ++l) {
        const std::int64_t stash = e.layers[kind(l)].activation_bytes;
        if (rc)
          moment(i, false, false, l, l == 0 ? add(input, scratch) : 0,
                 l == layers - 1 ? scratch : 0);
        else
          moment(i, false, false, l, stash, 0);
      }
      continue;
    }
    if (rc)
      for (int l = 0; l < layers; ++l)
        moment(i, false, true, l, e.layers[kind(l)].activation_bytes, 0);
    for (int l = layers - 1; l >= 0; --l)
      moment(i, true, false, l, 0,
             add(e.layers[kind(l)].activation_bytes, rc && l == 0 ? input : 0));
  }
  return out;
}

// The optimizer step: the host-Adam chunks' downloads (one engine, in order) and CPU Adam (one
// chunk after the other, each after its download) as a two-stage pipeline, beside Adam on the
// device for chunks 0 .. K-1. With w > 1 each chunk's Adam (of its part) sits between the
// reduce-scatter of its gradient and the all-gather of its parameters, the three one after the
// other on the engine (host or device) that runs it.
double optimizer_time(const ChunkSchedule& s) {
  std::vector<double> down, adam;
  double device_adam = 0;
  for (int c = 0; c < s.layout.chunks(); ++c) {
    if (s.device_resident(c)) {
      device_adam += s.device_adam_s[std::size_t(c)] * s.gpu_sharers + s.collective_s;
      continue;
    }
    down.push_back(s.adam_download[std::size_t(c)] ? s.copy_s : 0.0);
    adam.push_back(s.host_adam_s[std::size_t(c)] + s.collective_s);
  }
  return std::max(device_adam, two_stage_pipeline_s(down, adam));
}

// Runs one step's eviction plan from `resident` (updated to the step's end). Belady: before
// moment k, while the resident chunks and the moment's missing ones pass the room left by the
// non-model memory and the device-resident optimizer state, the resident chunk not needed at k
// whose next use on the device is furthest (this step's remaining moments, then the next step's,
// cyclically; device-Adam chunks are used at the optimizer step) goes to the host, the larger
// chunk index first on a tie. Then the missing chunks come up, ascending.
// `where`: "stage s: " in a pipeline (each stage's device has its own plan), else empty.
void run_step(ChunkSchedule& s, std::set<int>& resident, const std::string& where) {
  const ChunkLayout& L = s.layout;
  const int n = L.chunks(), moments = int(s.moments.size());
  const std::int64_t os = mul(s.device_adam_chunks, L.os_chunk_bytes);
  // uses[c]: the moments (0 .. moments-1, and `moments` for the optimizer step) using c.
  std::vector<std::vector<int>> uses(static_cast<std::size_t>(n));
  for (int k = 0; k < moments; ++k)
    for (int c : L.layer_chunks[std::size_t(s.moments[std::size_t(k)].layer)])
      uses[std::size_t(c)].push_back(k);
  for (int c = 0; c < s.device_adam_chunks; ++c)
    uses[std::size_t(c)].push_back(moments);
  auto next_use = [&](int c, int k) {  // distance from moment k to c's next use after it
    for (int u : uses[std::size_t(c)])
      if (u > k) return u - k;
    return uses[std::size_t(c)].empty() ? std::numeric_limits<int>::max()
                                        : uses[std::size_t(c)].front() + moments + 1 - k;
  };
  for (int k = 0; k < moments; ++k) {
    ChunkMoment& m = s.moments[std::size_t(k)];
    m.copies.clear();
    const std::vector<int>& need = L.layer_chunks[std::size_t(m.layer)];
    const std::int64_t room = s.budget_bytes - m.non_model_bytes - os;
    const std::int64_t working = mul(std::int64_t(need.size()), L.move_bytes);
    if (working > room)
      throw InputError(fmt::format(
          "offload chunks: {}the device's {} is smaller than the working set of the {} "
          "({} chunks of {} = {}, non-model memory {}{}) by {}",
          where, gib(s.budget_bytes), m.label(L), need.size(), gib(L.move_bytes), gib(working),
          gib(m.non_model_bytes), os > 0 ? fmt::format(", device optimizer state {}", gib(os)) : "",
          gib(working - room)));
    std::vector<int> missing;
    for (int c : need)
      if (!resident.count(c)) missing.push_back(c);
    while (mul(std::int64_t(resident.size() + missing.size()), L.move_bytes) > room) {
      int victim = -1, far = -1;
      for (int c : resident) {
        if (std::binary_search(need.begin(), need.end(), c)) continue;
        const int d = next_use(c, k);
        if (d >= far) far = d, victim = c;  // ascending: a tie goes to the larger index
      }
      m.copies.push_back({false, victim});
      resident.erase(victim);
    }
    for (int c : missing) {
      m.copies.push_back({true, c});
      resident.insert(c);
    }
    m.resident = int(resident.size());
  }
  // The optimizer step: host-Adam chunks on the device go to the host (their gradients are in the
  // parameters' slots); device-Adam chunks stay (K > 0 only when every chunk fits).
  s.adam_download.assign(std::size_t(n), false);
  for (int c = s.device_adam_chunks; c < n; ++c)
    if (resident.erase(c)) s.adam_download[std::size_t(c)] = true;
  for (int c = 0; c < s.device_adam_chunks; ++c)
    if (!resident.count(c))
      throw std::logic_error("chunk_schedule: a device-Adam chunk is not on the device");
}

}  // namespace

ChunkSchedule chunk_schedule(const models::ModelSpec& model, const traces::Trace& trace,
                             const clusters::Cluster& cluster, const Plan& p, int stage) {
  if (p.offload != Offload::chunks) throw std::logic_error("chunk_schedule: not a chunks plan");
  check(p);
  ChunkSchedule s;
  s.layout =
      chunk_layout(model, p.chunk_bytes > 0 ? p.chunk_bytes : default_chunk_bytes(model), p, stage);
  // A gradient half beside the parameters when m > 1 (later microbatches still need them), and
  // always for fp32: no separate fp32 master keeps the weights, so a gradient written over its
  // parameter would lose them (the optimizer state is m and v only, 8 B).
  if (p.m > 1 || model.dtype == models::DType::fp32)
    s.layout.move_bytes = mul(2, s.layout.chunk_bytes);
  const ChunkLayout& L = s.layout;
  const int n = L.chunks();
  const traces::Entry& e = trace.at(p.b);
  s.budget_bytes = cluster.device.memory_bytes;
  for (int l = 0; l < s.layout.layers(); ++l)  // the stage's own layers
    s.workspace_bytes =
        std::max(s.workspace_bytes, e.layers[layer_kind(model, s.layout, l)].workspace_bytes);
  s.moments = step_moments(model, trace, p, s.layout, s.workspace_bytes);
  std::int64_t non_model_peak = 0;
  for (const ChunkMoment& m : s.moments)
    non_model_peak = std::max(non_model_peak, m.non_model_bytes);
  // K: optimizer state on the device only in the margin left by every parameter chunk and the
  // peak non-model memory (PatrickStar's device-aware placement of the OS chunks).
  const std::int64_t margin = s.budget_bytes - mul(n, L.move_bytes) - non_model_peak;
  s.device_adam_chunks = margin > 0 ? int(std::min<std::int64_t>(n, margin / L.os_chunk_bytes)) : 0;
  // The fixed point: from every chunk on the host, steps until one ends where it started (two at
  // most: host-Adam chunks always end on the host, device-Adam ones on the device).
  std::set<int> start;
  for (int round = 0;; ++round) {
    std::set<int> resident = start;
    run_step(s, resident, p.d > 1 ? fmt::format("stage {}: ", stage) : std::string());
    if (resident == start) break;
    if (round == 8) throw std::logic_error("chunk_schedule: no fixed point");
    start = resident;
  }
  s.start_on_device.assign(std::size_t(n), false);
  for (int c : start)
    s.start_on_device[std::size_t(c)] = true;

  // Times and figures (docs/formulas.md, section 9, chunks).
  HostPath path = host_path(cluster, p, p.rank_of(stage, 0));
  // A copy at the GPU's own link, its shared uplink to itself: the stages' copies are short and
  // come right before their layers, so two on one uplink seldom overlap (one microbatch passes
  // the stages one after the other: never; against the simulator, which shares an uplink only
  // while two copies overlap, 1% at most: docs/formulas.md section 9, chunks).
  // The stage's w replicas, though, run the same plan in lockstep: their copies overlap, sharing
  // a GPU's link and an uplink where they share them (the most crowded replica's share).
  int on_gpu = 1, on_uplink = 1;
  if (!p.placement.empty())
    for (int r = 0; r < p.w; ++r) {
      const Placement& me = p.placement[std::size_t(p.rank_of(stage, r))];
      int gpu = 0, uplink = 0;
      for (int q = 0; q < p.w; ++q) {
        const Placement& other = p.placement[std::size_t(p.rank_of(stage, q))];
        if (other.node != me.node) continue;
        gpu += other.gpu == me.gpu ? 1 : 0;
        uplink += other.gpu / cluster.host.gpus_per_uplink == me.gpu / cluster.host.gpus_per_uplink
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
  // The node's CPU Adam rate, shared by the ranks (stages) it holds as if their optimizer steps
  // ran at the same time (chunk_schedules then shares it from when each stage reaches its step).
  int sharing = 0;
  const int node = p.placement.empty() ? 0 : p.placement[std::size_t(p.rank_of(stage, 0))].node;
  for (const Placement& at : p.placement)
    sharing += at.node == node ? 1 : 0;
  const double rate = cluster.host.cpu_adam_params_per_s() / std::max(1, sharing);
  s.device_adam_s.assign(std::size_t(n), 0);
  s.host_adam_s.assign(std::size_t(n), 0);
  const models::ModelCosts mc = models::derive_costs(model);
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
  for (int c = 0; c < n; ++c)
    s.host_adam_s[std::size_t(c)] =
        rate > 0 ? double(L.adam_elements(c)) / rate : std::numeric_limits<double>::infinity();
  if (p.w > 1) s.collective_s = data_parallel_allreduce_s(cluster, p, stage, double(L.chunk_bytes));
  const std::int64_t os = mul(s.device_adam_chunks, L.os_chunk_bytes);
  int most_host = 0;
  for (std::size_t k = 0; k < s.moments.size(); ++k) {
    const ChunkMoment& m = s.moments[k];
    int in = 0, out = 0;
    for (const ChunkCopy& c : m.copies)
      (c.to_device ? in : out) += 1;
    s.uploads += in;
    s.downloads += out;
    const double t = m.compute_s * s.gpu_sharers + (in + out) * s.copy_s;
    (m.backward || m.recompute ? s.backward_s : s.forward_s) += t;
    s.compute_s += m.compute_s;
    const std::int64_t device = add(add(mul(m.resident, L.move_bytes), m.non_model_bytes), os);
    if (device > s.device_peak_bytes) {
      s.device_peak_bytes = device;
      s.peak_moment = int(k);
    }
    most_host = std::max(most_host, n - m.resident);
  }
  double device_adam = 0;
  for (int c = 0; c < n; ++c) {
    if (s.device_resident(c))
      device_adam += s.device_adam_s[std::size_t(c)];
    else
      s.downloads += s.adam_download[std::size_t(c)] ? 1 : 0;
  }
  most_host = std::max(most_host, n - s.device_adam_chunks);
  s.optimizer_s = optimizer_time(s);
  s.compute_s += device_adam;
  s.copy_in_bytes = mul(s.uploads, L.move_bytes);
  s.copy_out_bytes = mul(s.downloads, L.move_bytes);
  s.host_chunk_peak_bytes = mul(most_host, L.move_bytes);
  s.host_peak_bytes = add(mul(n - s.device_adam_chunks, L.os_chunk_bytes), s.host_chunk_peak_bytes);
  return s;
}

ChunkPipeline chunk_pipeline(const std::vector<ChunkSchedule>& all, const Plan& p,
                             const std::vector<double>& hop_s) {
  const std::size_t d = all.size();
  if (hop_s.size() != d) throw std::logic_error("chunk_pipeline: one hop per stage");
  std::vector<std::vector<ComputeSlot>> order(d);
  std::vector<std::vector<double>> dur(d);
  // When stage s's forward and backward of microbatch j end (-1: not yet).
  std::vector<std::vector<double>> forward_end(d, std::vector<double>(std::size_t(p.m), -1.0));
  std::vector<std::vector<double>> backward_end = forward_end;
  for (std::size_t s = 0; s < d; ++s) {
    order[s] = step_compute_order(p, int(s));
    dur[s].assign(order[s].size(), 0.0);
    for (const ChunkMoment& m : all[s].moments)
      dur[s].at(std::size_t(m.slot)) +=
          m.compute_s * all[s].gpu_sharers + double(m.copies.size()) * all[s].copy_s;
  }
  ChunkPipeline out;
  out.start.assign(d, -1.0);
  out.end.assign(d, 0.0);
  std::vector<std::size_t> next(d, 0);
  for (bool moved = true; moved;) {
    moved = false;
    for (std::size_t s = 0; s < d; ++s)
      for (std::size_t& i = next[s]; i < order[s].size(); ++i) {
        const ComputeSlot& op = order[s][i];
        const std::size_t j = std::size_t(op.microbatch);
        double ready = out.end[s];
        const std::size_t from = op.backward ? s + 1 : s - 1;  // the stage it receives from
        if (op.backward ? s + 1 < d : s > 0) {
          const double sent = (op.backward ? backward_end : forward_end)[from][j];
          if (sent < 0) break;
          ready = std::max(ready, sent + hop_s[from]);
        }
        if (out.start[s] < 0) out.start[s] = ready;
        out.end[s] = ready + dur[s][i];
        (op.backward ? backward_end : forward_end)[s][j] = out.end[s];
        moved = true;
      }
  }
  for (std::size_t s = 0; s < d; ++s) {
    if (next[s] < order[s].size())
      throw std::logic_error("chunk_pipeline: the stages' orders wait for each other");
    out.makespan = std::max(out.makespan, out.end[s]);
  }
  return out;
}

std::vector<ChunkSchedule> chunk_schedules(const models::ModelSpec& model,
                                           const traces::Trace& trace,
                                           const clusters::Cluster& cluster, const Plan& p) {
  std::vector<ChunkSchedule> out;
  for (int s = 0; s < p.d; ++s)
    out.push_back(chunk_schedule(model, trace, cluster, p, s));
  // The stages of a node share its CPU by processor sharing from the moments they reach their
  // optimizer steps (docs/formulas.md section 9, chunks): when their last compute op ends in one
  // step of the pipeline (chunk_pipeline, the hops between stages left out), then their first
  // host chunk's download. Each stage's rate is its work over the time it takes.
  const double capacity = cluster.host.cpu_adam_params_per_s();
  if (capacity <= 0 || p.d == 1) return out;
  const ChunkPipeline run = chunk_pipeline(out, p, std::vector<double>(out.size(), 0.0));
  std::map<int, std::vector<std::size_t>> by_node;
  std::vector<double> work(out.size(), 0), release(out.size(), 0);
  for (std::size_t s = 0; s < out.size(); ++s) {
    const ChunkSchedule& cs = out[s];
    by_node[p.placement.empty() ? 0 : p.placement[std::size_t(p.rank_of(int(s), 0))].node]
        .push_back(s);
    release[s] = run.end[s];
    for (int c = cs.device_adam_chunks; c < cs.layout.chunks(); ++c) {
      if (c == cs.device_adam_chunks && cs.adam_download[std::size_t(c)]) release[s] += cs.copy_s;
      work[s] += double(cs.layout.adam_elements(c));
    }
  }
  for (const auto& [node, stages] : by_node) {
    std::vector<double> w, rel;
    for (std::size_t s : stages) {
      w.push_back(work[s]);
      rel.push_back(release[s]);
    }
    const std::vector<double> end = processor_sharing_finish(w, rel, capacity);
    for (std::size_t i = 0; i < stages.size(); ++i) {
      if (w[i] <= 0 || end[i] <= rel[i]) continue;
      ChunkSchedule& cs = out[stages[i]];
      const double rate = w[i] / (end[i] - rel[i]);
      for (int c = 0; c < cs.layout.chunks(); ++c)
        cs.host_adam_s[std::size_t(c)] = double(cs.layout.adam_elements(c)) / rate;
      cs.optimizer_s = optimizer_time(cs);
    }
  }
  return out;
}

}  // namespace pw::planner
