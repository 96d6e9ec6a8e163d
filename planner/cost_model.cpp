// Closed-form step time and memory of a plan (PipeDream-2BW Appendix A, extended to uneven
// stages, co-located ranks and interleaving). Formulas: docs/formulas.md.
#include "planner/cost_model.hpp"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <map>

#include <fmt/format.h>

#include "common/limits.hpp"
#include "planner/order_walk.hpp"

namespace pw::planner {

using models::LayerKind;

std::int64_t optimizer_bytes_per_parameter(models::DType dtype) {
  return dtype == models::DType::fp32 ? 8 : 12;
}

void set_throughput(RunReport& r, const models::ModelSpec& model, const clusters::Cluster& cluster,
                    int gpus_used) {
  r.samples_per_s = double(r.plan.global_batch()) / r.iteration_time_s;
  r.tokens_per_s = r.samples_per_s * double(model.seq_len);
  r.model_flops_per_s = r.samples_per_s * models::derive_costs(model).flops_per_sample;
  const double peak = model.dtype == models::DType::fp32 ? cluster.device.peak_fp32_flops_per_s
                                                         : cluster.device.peak_fp16_flops_per_s;
  r.mfu = r.model_flops_per_s / (double(gpus_used) * peak);
}

double ring_allreduce_s(double bytes, int n, const clusters::Link& link) {
  if (n <= 1) return 0;
  return 2.0 * (n - 1) * (link.latency_s + bytes / (n * link.bandwidth_bytes_per_s));
}

double tp_time_s(const TpTraffic& tr, int t, const clusters::Link& link) {
  if (t <= 1 || tr.empty()) return 0;
  const double steps = double(tr.latency_steps(t));
  const double moved = 2.0 * (t - 1) / t * tr.equivalent_allreduce_bytes();
  return steps * link.latency_s + moved / link.bandwidth_bytes_per_s;
}

double tp_backward_s(const ChunkCost& ch, int t, const clusters::Link& link) {
  return tp_time_s(ch.tp_backward, t, link) +
         std::max(0.0, tp_time_s(ch.tp_backward_wgrad, t, link) - ch.backward_weight_s) +
         std::max(0.0, tp_time_s(ch.tp_backward_dgrad, t, link) - ch.backward_input_s);
}

namespace {

// Memory figures in checked arithmetic: a device's bytes stay at most kMaxBytes (8 PiB); a model
// or plan whose figures pass that is refused in one line, never wrapped to a negative size.
constexpr const char* kMemoryWhat = "plan: bytes per device";
std::int64_t bytes_mul(std::int64_t a, std::int64_t b) {
  return common::checked_mul(a, b, kMemoryWhat, common::kMaxBytes);
}
std::int64_t bytes_add(std::int64_t a, std::int64_t b) {
  return common::checked_add(a, b, kMemoryWhat, common::kMaxBytes);
}

}  // namespace

MemoryBreakdown static_memory(const models::ModelSpec& model, const Plan& p,
                              std::int64_t parameters) {
  const std::int64_t e = models::dtype_bytes(model.dtype);
  MemoryBreakdown m;
  m.weights = bytes_mul(parameters, e);
  m.gradients = bytes_mul(parameters, e);
  // The distributed optimizer shards master weights and Adam state over the w replicas: each
  // holds the state of ceil(P / w) parameters (the GPU's flat parameters split into w contiguous
  // shards, the last one padded, as Megatron pads its buffer to a multiple of w, and as the
  // executor allocates it).
  const std::int64_t sharded =
      p.distributed_optimizer && p.w > 1 ? (parameters + p.w - 1) / p.w : parameters;
  m.optimizer = bytes_mul(sharded, optimizer_bytes_per_parameter(model.dtype));
  return m;
}

std::int64_t message_piece_bytes(const Plan& p, std::int64_t bytes) {
  return p.t > 1 && !p.sp ? bytes / p.t : bytes;
}

int message_buffers(const Plan& p, int s) {
  if (p.d == 1 && p.v == 1) return 0;
  const bool receives = s > 0 || p.v > 1, sends = s < p.d - 1 || p.v > 1;
  // The previous compute op's sent message, held at the peak; not on GPipe's last stage, whose
  // peak (its last forward, its first backward) follows a forward, which sends nothing there.
  const bool held = !(p.schedule == Schedule::gpipe && s == p.d - 1);
  return int(receives) + int(sends) + int(held);
}

int backward_message_buffers(const Plan& p, int s) {
  const bool flush_last = (p.schedule == Schedule::one_f_one_b || p.schedule == Schedule::two_bw) &&
                          p.d > 1 && p.v == 1 && s == p.d - 1;
  return message_buffers(p, s) - int(flush_last);
}

int op_message_buffers(const Plan& p, int s, const std::vector<ComputeSlot>& order, std::size_t i) {
  if ((p.d == 1 && p.v == 1) || order.empty()) return 0;
  const int last = p.virtual_stages() - 1;
  const auto sends = [&](const ComputeSlot& op) {
    const int vs = op.chunk * p.d + s;
    return op.backward ? vs > 0 : vs < last;
  };
  const ComputeSlot& op = order[i];
  const int vs = op.chunk * p.d + s;
  const bool receives = op.backward ? vs < last : vs > 0;
  const ComputeSlot& previous = order[i == 0 ? order.size() - 1 : i - 1];
  return int(receives) + int(sends(op)) + int(sends(previous));
}

std::int64_t message_buffer_bytes(const Plan& p, const traces::Trace& trace, int s) {
  return bytes_mul(message_buffers(p, s), trace.at(p.b).layers[LayerKind::block].output_bytes);
}

clusters::Link tp_link(const clusters::Cluster& c, const Plan& p, int rank) {
  const auto& a = p.placement[std::size_t(rank)];
  return clusters::p2p_link(c, a.node, a.gpu, a.node, a.gpu + (p.t > 1 ? 1 : 0));
}

namespace {

// Microbatches (or, interleaved, microbatch-chunks) a device stashes at its peak.
std::int64_t in_flight(const Plan& p, int s) {
  switch (p.schedule) {
    case Schedule::gpipe:
      return p.m;
    case Schedule::one_f_one_b:
    case Schedule::two_bw:
      return std::min(p.d - s, p.m);
    case Schedule::dp:
      return 1;
    case Schedule::interleaved:
      return std::min<std::int64_t>(std::int64_t(p.d - s - 1) * 2 + std::int64_t(p.v - 1) * p.d + 1,
                                    std::int64_t(p.m) * p.v);
  }
  return p.m;
}

clusters::Link rank_link(const clusters::Cluster& c, const Plan& p, int ra, int rb) {
  const auto& a = p.placement[ra];
  const auto& b = p.placement[rb];
  return clusters::p2p_link(c, a.node, a.gpu, b.node, b.gpu);
}

// Slowest neighbour link of the ring over the w replicas of stage s.
clusters::Link replica_ring_link(const clusters::Cluster& c, const Plan& p, int s) {
  clusters::Link worst = rank_link(c, p, p.rank_of(s, 0), p.rank_of(s, 1 % p.w));
  for (int r = 1; r < p.w; ++r) {
    clusters::Link l = rank_link(c, p, p.rank_of(s, r), p.rank_of(s, (r + 1) % p.w));
    if (l.bandwidth_bytes_per_s < worst.bandwidth_bytes_per_s ||
        (l.bandwidth_bytes_per_s == worst.bandwidth_bytes_per_s && l.latency_s > worst.latency_s))
      worst = l;
  }
  return worst;
}

// Replicas of stage s whose activations leave replica 0's node through the same NIC at once (one
// NIC per node, next stage on another node); 1 otherwise.
int nic_sharers(const clusters::Cluster& c, const Plan& p, int s) {
  if (c.network.nic_per != clusters::NicPer::node) return 1;
  const int next = (s + 1) % p.d;
  const int node = p.placement[std::size_t(p.rank_of(s, 0))].node;
  int k = 0;
  for (int r = 0; r < p.w; ++r)
    if (p.placement[std::size_t(p.rank_of(s, r))].node == node &&
        p.placement[std::size_t(p.rank_of(next, r))].node != node)
      ++k;
  return std::max(k, 1);
}

void add_traffic(TpTraffic& tr, const std::vector<models::TpCollective>& list, std::int64_t count,
                 std::int64_t b) {
  for (const auto& c : list) {
    const double bytes = double(count) * double(b) * double(c.bytes);
    if (c.kind == models::CollectiveKind::all_reduce) {
      tr.allreduce_bytes += bytes;
      tr.allreduces += count;
    } else {
      tr.half_bytes += bytes;
      tr.halves += count;
    }
  }
}

// The t GPUs of a TP group whose flows over `link` share one NIC (a NIC per node, the link crosses
// the network); 1 otherwise.
int tp_nic_sharers(const clusters::Cluster& c, const Plan& p, const clusters::Link& link) {
  return link.via == "network" && c.network.nic_per == clusters::NicPer::node ? p.t : 1;
}

// The all-reduce of `bytes` over stage s's w replicas on the layout the simulator runs
// (sim/collectives.hpp, as NCCL picks it): replicas grouped by node; over N > 1 nodes of k > 1
// replicas each, hierarchical: intra-node reduce-scatter and all-gather (k - 1 steps of S/k each)
// around k inter-node rings at once (2(N - 1) steps of S/(kN)), the k rings (times the t TP rings)
// sharing a node's one NIC; otherwise a ring over the slowest neighbour link (docs/formulas.md
// §4). Each GPU of a TP group runs its own such all-reduce over its shard, the t at once.
struct ReplicaAllreduce {
  double network_s = 0;  // the inter-node ring's steps (through the nodes' NICs)
  double other_s = 0;    // the rest (intra-node steps, or a ring that does not leave a node)
  double total() const { return network_s + other_s; }
};
ReplicaAllreduce replica_allreduce(const clusters::Cluster& c, const Plan& p, int s, double bytes) {
  std::map<int, std::vector<int>> by_node;  // node -> replicas of stage s on it
  for (int r = 0; r < p.w; ++r)
    by_node[p.placement[std::size_t(p.rank_of(s, r))].node].push_back(r);
  const int N = int(by_node.size());
  const int k = int(by_node.begin()->second.size());
  const bool rectangular = std::all_of(by_node.begin(), by_node.end(),
                                       [k](const auto& g) { return int(g.second.size()) == k; });
  if (N > 1 && k > 1 && rectangular) {
    const std::vector<int>& first = by_node.begin()->second;
    const std::vector<int>& second = std::next(by_node.begin())->second;
    const clusters::Link intra = rank_link(c, p, p.rank_of(s, first[0]), p.rank_of(s, first[1]));
    const clusters::Link inter = rank_link(c, p, p.rank_of(s, first[0]), p.rank_of(s, second[0]));
    const double sharers =
        (c.network.nic_per == clusters::NicPer::node && inter.via == "network" ? k : 1) *
        tp_nic_sharers(c, p, inter);
    ReplicaAllreduce r;
    r.other_s = 2.0 * (k - 1) * (intra.latency_s + bytes / (k * intra.bandwidth_bytes_per_s));
    r.network_s =
        2.0 * (N - 1) *
        (inter.latency_s + sharers * bytes / (double(k) * N * inter.bandwidth_bytes_per_s));
    return r;
  }
  clusters::Link ring = replica_ring_link(c, p, s);
  ring.bandwidth_bytes_per_s /= tp_nic_sharers(c, p, ring);
  ReplicaAllreduce r;
  (N > 1 ? r.network_s : r.other_s) = ring_allreduce_s(bytes, p.w, ring);
  return r;
}

double replica_allreduce_s(const clusters::Cluster& c, const Plan& p, int s, double bytes) {
  return replica_allreduce(c, p, s, bytes).total();
}

// Adds `count` layers' per-microbatch costs (trace entry at b) to a chunk.
void add_layer(ChunkCost& ch, const traces::Trace& trace, const models::LayerCosts& lc,
               const traces::LayerTimes& t, LayerKind kind, std::int64_t count, std::int64_t b) {
  ch.forward_s += count * t.forward_s;
  ch.backward_s += count * t.backward_s;
  ch.backward_weight_s += count * t.backward_weight_s;
  ch.backward_input_s += count * t.backward_input_s;
  ch.recompute_s += count * t.recompute_s;
  ch.selective_recompute_s += count * t.selective_recompute_s;
  ch.optimizer_s += count * trace.statics[kind].optimizer_step_s;
  ch.parameters = bytes_add(ch.parameters, bytes_mul(count, lc.parameters));
  ch.stash_bytes = bytes_add(ch.stash_bytes, bytes_mul(count, t.activation_bytes));
  ch.selective_bytes =
      bytes_add(ch.selective_bytes, bytes_mul(count, t.activation_selective_bytes));
  ch.workspace_bytes = std::max(ch.workspace_bytes, t.workspace_bytes);
  add_traffic(ch.tp_forward, lc.tp_forward, count, b);
  add_traffic(ch.tp_backward, lc.tp_backward, count, b);
  add_traffic(ch.tp_backward_wgrad, lc.tp_backward_wgrad, count, b);
  add_traffic(ch.tp_backward_dgrad, lc.tp_backward_dgrad, count, b);
}

}  // namespace

double data_parallel_allreduce_s(const clusters::Cluster& c, const Plan& p, int stage,
                                 double bytes) {
  return replica_allreduce_s(c, p, stage, bytes);
}

ChunkCost layer_cost(const models::ModelCosts& mc, const traces::Trace& trace, const Plan& p,
                     LayerKind kind) {
  ChunkCost ch;
  add_layer(ch, trace, mc.layer(kind), trace.at(p.b).layers[kind], kind, 1, p.b);
  return ch;
}

ChunkCost chunk_cost(const models::ModelCosts& mc, const traces::Trace& trace, const Plan& p,
                     int stage, int chunk) {
  const traces::Entry& e = trace.at(p.b);
  ChunkCost ch;
  ch.stage = stage;
  ch.chunk = chunk;
  ch.virtual_stage = chunk * p.d + stage;
  ch.blocks = p.stage_blocks[ch.virtual_stage];
  const bool first = ch.virtual_stage == 0;
  const bool last = ch.virtual_stage == p.virtual_stages() - 1;
  if (first) {
    ch.has_embedding = true;
    add_layer(ch, trace, mc.embedding, e.layers[LayerKind::embedding], LayerKind::embedding, 1,
              p.b);
  }
  add_layer(ch, trace, mc.block, e.layers[LayerKind::block], LayerKind::block, ch.blocks, p.b);
  // With recomputation a chunk keeps only its input: the token ids on the first virtual stage,
  // the first block's input elsewhere.
  ch.input_bytes = first ? e.layers[LayerKind::embedding].activation_recompute_bytes
                         : e.layers[LayerKind::block].activation_recompute_bytes;
  ch.output_bytes = last ? 0 : e.layers[LayerKind::block].output_bytes;
  // Block recompute keeps each layer's input (recompute bytes: the embedding's are its stash).
  ch.layer_inputs_bytes =
      bytes_add(first ? e.layers[LayerKind::embedding].activation_recompute_bytes : 0,
                bytes_mul(ch.blocks, e.layers[LayerKind::block].activation_recompute_bytes));
  if (last) {
    ch.has_head = true;
    ch.layer_inputs_bytes =
        bytes_add(ch.layer_inputs_bytes, e.layers[LayerKind::head].activation_recompute_bytes);
    add_layer(ch, trace, mc.head, e.layers[LayerKind::head], LayerKind::head, 1, p.b);
    // The tied token embedding lives on stage 0; the head's stage keeps a synchronized copy.
    if (!first) ch.parameters = bytes_add(ch.parameters, mc.tied_copy_parameters);
  }
  // The distributed optimizer: each replica updates its 1/w of the chunk's parameters.
  if (p.distributed_optimizer && p.w > 1) ch.optimizer_s /= p.w;
  ch.swap_bytes = ch.stash_bytes;
  if (p.recomputes(stage)) {  // every layer of the chunk through the scratch
    if (first) ch.recompute_scratch_bytes = e.layers[LayerKind::embedding].activation_bytes;
    if (ch.blocks > 0)
      ch.recompute_scratch_bytes =
          std::max(ch.recompute_scratch_bytes, e.layers[LayerKind::block].activation_bytes);
    if (last)
      ch.recompute_scratch_bytes =
          std::max(ch.recompute_scratch_bytes, e.layers[LayerKind::head].activation_bytes);
    // Block recompute with SP: a layer's all-gathers fill full-width rows (b·T·C·e: the t ranks'
    // pieces of a block's output) beside it, not the workspace a backward is using when it
    // re-makes the layer.
    if (p.sp && p.t > 1 && p.recompute_of(stage) == Recompute::block)
      ch.recompute_scratch_bytes = bytes_add(
          ch.recompute_scratch_bytes, bytes_mul(p.t, e.layers[LayerKind::block].output_bytes));
  }
  if (p.mixed_activations(stage)) {
    // The chunk's blocks in the stage's list: those of the chunks before it come first.
    const std::vector<ActivationChoice> all = layer_choices(p, stage);
    std::size_t first_block = 0;
    for (int c = 0; c < chunk; ++c)
      first_block += std::size_t(p.stage_blocks[std::size_t(c * p.d + stage)]);
    const traces::LayerTimes& bt = e.layers[LayerKind::block];
    ch.swap_bytes = 0;
    bool in_run = false;
    for (std::int64_t k = 0; k < ch.blocks; ++k) {
      const bool rc = all[first_block + std::size_t(k)] == ActivationChoice::recompute;
      double rs = bt.recompute_s;
      std::int64_t stash = bt.activation_bytes;
      TpTraffic tp;  // the layer's forward collectives, run again by its recompute
      add_traffic(tp, mc.block.tp_forward, 1, p.b);
      if (k == 0 && first) {
        rs += e.layers[LayerKind::embedding].recompute_s;
        stash = bytes_add(stash, e.layers[LayerKind::embedding].activation_bytes);
        add_traffic(tp, mc.embedding.tp_forward, 1, p.b);
      }
      if (k == ch.blocks - 1 && last) {
        rs += e.layers[LayerKind::head].recompute_s;
        stash = bytes_add(stash, e.layers[LayerKind::head].activation_bytes);
        add_traffic(tp, mc.head.tp_forward, 1, p.b);
      }
      if (rc) {
        ch.recompute_scratch_bytes = std::max(ch.recompute_scratch_bytes, bt.activation_bytes);
        if (k == ch.blocks - 1 && last)
          ch.recompute_scratch_bytes =
              std::max(ch.recompute_scratch_bytes, e.layers[LayerKind::head].activation_bytes);
        ch.recompute_layers += 1;
        ch.layers_recompute_s += rs;
        ch.layers_recompute_tp += tp;
        ch.layers_recompute_bytes = bytes_add(ch.layers_recompute_bytes, stash);
        if (!in_run)  // a run's checkpoint: the chunk's input, or the block's input
          ch.checkpoint_bytes = bytes_add(ch.checkpoint_bytes,
                                          k == 0 ? ch.input_bytes : bt.activation_recompute_bytes);
      } else {
        ch.swap_bytes = bytes_add(ch.swap_bytes, stash);
      }
      in_run = rc;
    }
  }
  return ch;
}

std::int64_t offload_host_bytes_per_parameter(models::DType dtype, bool sharded) {
  // Sharded, fp32: the transfer buffer is the master copy itself (optimizer state is m, v only),
  // so the shard's gradient needs its own 4 B.
  const bool accumulator = !sharded || dtype == models::DType::fp32;
  return optimizer_bytes_per_parameter(dtype) + (accumulator ? 4 : 0) + models::dtype_bytes(dtype);
}

std::int64_t ChunkOffload::host_parameters() const {
  std::int64_t n = 0;
  for (std::int64_t t : tiles)
    n = bytes_add(n, t);
  return n;
}

std::int64_t ChunkOffload::largest_tile() const {
  return tiles.empty() ? 0 : *std::max_element(tiles.begin(), tiles.end());
}

ChunkOffload chunk_offload(const models::ModelCosts& mc, const Plan& p, const ChunkCost& ch,
                           int replica) {
  ChunkOffload o;
  if (ch.has_embedding) o.tiles.push_back(mc.embedding.parameters);
  o.tiles.insert(o.tiles.end(), std::size_t(ch.blocks), mc.block.parameters);
  if (ch.has_head) o.tiles.push_back(mc.head.parameters);
  if (p.offload_sharded()) {
    // ZeRO-Offload over w replicas: the backward keeps its gradients on the device (summed over
    // the microbatches); after the reduce-scatter the replica copies out and updates its shard of
    // each tile (the tied tensor's gradient, summed by the exchange on stage 0, is in stage 0's
    // embedding tile as for w = 1).
    for (std::int64_t& t : o.tiles) {
      const TiedShard sh = tile_shard(t, p.w, replica);
      t = sh.end - sh.begin;
    }
    o.shard_copy_out_parameters = o.host_parameters();
    return o;
  }
  // The tied tensor (d > 1): the embedding's on stage 0 (updated there), the head's copy on the
  // last stage (not updated there: it receives stage 0's new weights).
  const bool tied_end = p.d > 1 && mc.tied_copy_parameters > 0 && ch.has_embedding != ch.has_head;
  o.resident_parameters = tied_end ? mc.tied_copy_parameters : 0;
  o.streamed_parameters = ch.parameters - o.resident_parameters;
  o.tied_copy_out_parameters = tied_end && ch.has_embedding ? mc.tied_copy_parameters : 0;
  return o;
}

namespace {

// How many of rank j's t GPUs (placement.gpu .. + t - 1) are on `node` and pass `on`: with tensor
// parallelism each GPU of a TP group copies and updates its own shard.
int devices_where(const Plan& p, const Placement& pl, int node,
                  const std::function<bool(int gpu)>& on) {
  int n = 0;
  for (int k = 0; k < p.t; ++k)
    n += pl.node == node && on(pl.gpu + k) ? 1 : 0;
  return n;
}

// Rank j's GPUs on GPU g of `node`, and behind g's uplink (`per_uplink` GPUs to an uplink).
int devices_on_gpu(const Plan& p, const Placement& pl, int node, int g) {
  return devices_where(p, pl, node, [g](int x) { return x == g; });
}
int devices_behind_uplink(const Plan& p, const Placement& pl, int node, int g, int per_uplink) {
  return devices_where(p, pl, node,
                       [g, per_uplink](int x) { return x / per_uplink == g / per_uplink; });
}

}  // namespace

HostPath host_path(const clusters::Cluster& c, const Plan& p, int rank) {
  const Placement& me = p.placement[std::size_t(rank)];
  const int per_uplink = c.host.gpus_per_uplink;
  HostPath h;
  h.latency_s = c.host.pcie_latency_s;
  // With t > 1 the rank's figure is its TP group's most crowded GPU's.
  for (int k = 0; k < p.t; ++k) {
    const int g = me.gpu + k;
    int on_gpu = 0, on_uplink = 0;
    for (const Placement& pl : p.placement) {
      on_gpu += devices_on_gpu(p, pl, me.node, g);
      on_uplink += devices_behind_uplink(p, pl, me.node, g, per_uplink);
    }
    const double bw = std::min(c.host.pcie_bandwidth_bytes_per_s / on_gpu,
                               c.host.uplink_bandwidth_bytes_per_s / on_uplink);
    if (k == 0 || bw < h.bandwidth_bytes_per_s) h.bandwidth_bytes_per_s = bw;
  }
  return h;
}

std::vector<std::int64_t> host_parameters_by_rank(const models::ModelCosts& mc,
                                                  const traces::Trace& trace, const Plan& p) {
  std::vector<std::int64_t> out;
  for (int r = 0; r < p.ranks(); ++r) {
    std::int64_t n = 0;
    for (int c = 0; c < p.v; ++c)
      n = bytes_add(
          n, chunk_offload(mc, p, chunk_cost(mc, trace, p, p.stage_of(r), c), p.replica_of(r))
                 .host_parameters());
    out.push_back(n);
  }
  return out;
}

namespace {

// W_i / sum_j n_j min(W_j, W_i) over the ranks j, n_j = sharing(j) of rank j's devices sharing
// the resource (the t devices of a TP group each do the rank's work on their shard).
double ps_share(const Plan& p, int rank, const std::vector<std::int64_t>& work,
                const std::function<int(const Placement&)>& sharing) {
  const double mine = double(work[std::size_t(rank)]);
  double sum = 0;
  for (int j = 0; j < p.ranks(); ++j)
    sum += sharing(p.placement[std::size_t(j)]) * std::min(double(work[std::size_t(j)]), mine);
  return sum > 0 ? mine / sum : 1.0;
}

}  // namespace

double cpu_adam_rate(const clusters::Cluster& c, const Plan& p, int rank,
                     const std::vector<std::int64_t>& host_parameters) {
  const int node = p.placement[std::size_t(rank)].node;
  return c.host.cpu_adam_params_per_s() *
         ps_share(p, rank, host_parameters,
                  [node, &p](const Placement& pl) { return pl.node == node ? p.t : 0; });
}

HostPath upload_path(const clusters::Cluster& c, const Plan& p, int rank,
                     const std::vector<std::int64_t>& host_parameters) {
  const Placement me = p.placement[std::size_t(rank)];
  const int per_uplink = c.host.gpus_per_uplink;
  HostPath h;
  h.latency_s = c.host.pcie_latency_s;
  // With t > 1 the rank's figure is its TP group's most crowded GPU's.
  for (int k = 0; k < p.t; ++k) {
    const int g = me.gpu + k;
    const double gpu = ps_share(p, rank, host_parameters, [&p, me, g](const Placement& pl) {
      return devices_on_gpu(p, pl, me.node, g);
    });
    const double uplink =
        ps_share(p, rank, host_parameters, [&p, me, g, per_uplink](const Placement& pl) {
          return devices_behind_uplink(p, pl, me.node, g, per_uplink);
        });
    const double bw = std::min(c.host.pcie_bandwidth_bytes_per_s * gpu,
                               c.host.uplink_bandwidth_bytes_per_s * uplink);
    if (k == 0 || bw < h.bandwidth_bytes_per_s) h.bandwidth_bytes_per_s = bw;
  }
  return h;
}

double two_stage_pipeline_s(const std::vector<double>& a, const std::vector<double>& u) {
  double adam_end = 0, upload_end = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    adam_end += a[i];
    upload_end = std::max(adam_end, upload_end) + u[i];
  }
  return upload_end;
}

double swap_stall_s(const std::vector<ComputeSlot>& order, const SwapPlan& sp,
                    const std::vector<double>& durations, const std::vector<double>& copy_s,
                    const std::vector<double>& recompute_s) {
  const std::size_t n = order.size();
  std::vector<double> down_end(n, 0), up_end(n, 0);
  double t = 0, out_free = 0, in_free = 0, compute = 0;
  for (std::size_t i = 0; i < n; ++i) {
    if (!sp.prefetch.empty() && sp.prefetch[i] >= 0) {  // the upload, issued before op i
      const auto b = std::size_t(sp.prefetch[i]);
      const auto f = std::size_t(sp.forward_of[b]);
      in_free = std::max({t, down_end[f], in_free}) + copy_s[b];
      up_end[b] = in_free;
    }
    if (!recompute_s.empty() && recompute_s[i] > 0) {  // a mixed stage's recompute op
      t += recompute_s[i];
      compute += recompute_s[i];
    }
    double start = t;
    if (order[i].backward && !sp.forward_of.empty() && sp.forward_of[i] >= 0 &&
        sp.out[std::size_t(sp.forward_of[i])])
      start = std::max(start, up_end[i]);
    t = start + durations[i];
    compute += durations[i];
    if (!order[i].backward && !sp.out.empty() && sp.out[i]) {  // the download, after op i
      out_free = std::max(t, out_free) + copy_s[i];
      down_end[i] = out_free;
    }
  }
  return t - compute;
}

StageSwap stage_swap(const Plan& plan, int stage, const std::vector<ChunkCost>& chunks,
                     const HostPath& path, const clusters::Link& tp) {
  Plan p = plan;  // as if the stage swapped
  p.offload_activations = true;
  p.activations.assign(std::size_t(p.d), ActivationChoice::swap);
  p.recompute.clear();
  // 2BW has no flush: in its steady state a step's forwards run beside the previous step's
  // backwards, and a unit may swap there that would not in a lone 1F1B step. Its figures are those
  // of step 1 of a three-step stream (the fill before it, the drain after): per step, the units
  // whose forward is in step 1; the peaks, the stream's.
  const bool stream = p.schedule == Schedule::two_bw;
  const int counted_step = stream ? 1 : 0;
  const std::vector<ComputeSlot> order =
      stream ? run_compute_order(p, stage, 3) : step_compute_order(p, stage);
  const SwapPlan sp = swap_plan(p, stage, order);
  const std::size_t n = order.size();
  StageSwap sw;
  sw.choice = ActivationChoice::swap;
  // Per op of an order: its compute (with its TP collectives), its unit's copy, its recompute.
  struct OpTimes {
    std::vector<double> durations, copy, recompute;
  };
  const auto op_times = [&](const std::vector<ComputeSlot>& ops) {
    OpTimes o;
    for (const ComputeSlot& op : ops) {
      const ChunkCost& ch = chunks[std::size_t(op.chunk)];
      o.durations.push_back(op.backward ? ch.backward_s + tp_backward_s(ch, p.t, tp)
                                        : ch.forward_s + tp_time_s(ch.tp_forward, p.t, tp));
      o.copy.push_back(
          path.time_s(double(ch.recompute_layers > 0 ? ch.swap_bytes : ch.stash_bytes)));
      o.recompute.push_back(op.backward && ch.recompute_layers > 0
                                ? ch.layers_recompute_s + tp_time_s(ch.layers_recompute_tp, p.t, tp)
                                : 0.0);
    }
    return o;
  };
  const OpTimes times = op_times(order);
  const std::vector<double>& durations = times.durations;
  const std::vector<double>& copy = times.copy;
  std::vector<std::int64_t> bytes(n), kept(n, 0), remade(n, 0);
  sw.window_s = std::numeric_limits<double>::infinity();
  for (std::size_t i = 0; i < n; ++i) {
    const ChunkCost& ch = chunks[std::size_t(order[i].chunk)];
    // A mixed chunk (per-layer choices) swaps only its swapped layers' stash, keeps its
    // recomputed layers' checkpoints and re-makes their stash in a recompute op before the
    // backward (docs/formulas.md section 9, per-layer choices).
    bytes[i] = ch.recompute_layers > 0 ? ch.swap_bytes : ch.stash_bytes;
    kept[i] = ch.recompute_layers > 0 ? ch.checkpoint_bytes : 0;
    if (order[i].backward && ch.recompute_layers > 0) remade[i] = ch.layers_recompute_bytes;
    sw.window_s = std::min(sw.window_s, durations[i]);
  }
  // Where each unit is at compute op i: on the device from its forward to its backward, except
  // a swapped unit between the op after its forward (its download) and the op before its
  // backward (its upload), when it is on the host.
  std::vector<std::int64_t> device(n, 0), host(n, 0);
  for (std::size_t b = 0; b < n; ++b) {
    if (!order[b].backward || sp.forward_of[b] < 0) continue;
    const auto f = std::size_t(sp.forward_of[b]);
    const bool swapped = sp.out[f];
    device[b] = bytes_add(device[b], remade[b]);
    for (std::size_t i = f; i <= b; ++i) {
      const bool away = swapped && i > f + 1 && i + 1 < b;
      device[i] = bytes_add(device[i], kept[f]);
      if (!away) device[i] = bytes_add(device[i], bytes[f]);
      if (swapped && i > f && i < b) host[i] = bytes_add(host[i], bytes[f]);
    }
    if (swapped && order[f].step == counted_step) {
      sw.units_per_step += 1;
      sw.bytes_per_step = bytes_add(sw.bytes_per_step, bytes[f]);
      sw.copy_s = std::max(sw.copy_s, copy[f]);
    }
  }
  for (std::size_t i = 0; i < n; ++i) {
    sw.device_bytes = std::max(sw.device_bytes, device[i]);
    // A forward also holds its recomputed layers' scratch until it ends.
    sw.moments.emplace_back(
        order[i].backward
            ? device[i]
            : bytes_add(device[i], chunks[std::size_t(order[i].chunk)].recompute_scratch_bytes),
        op_message_buffers(p, stage, order, i));
    sw.host_bytes = std::max(sw.host_bytes, host[i]);
  }
  if (n == 0) sw.window_s = 0;
  sw.stall_s = swap_stall_s(order, sp, durations, copy, times.recompute);
  if (stream) {  // per step: the three-step stream's stall less the two-step stream's
    const std::vector<ComputeSlot> shorter = run_compute_order(p, stage, 2);
    const OpTimes t2 = op_times(shorter);
    sw.stall_s = std::max(0.0, sw.stall_s - swap_stall_s(shorter, swap_plan(p, stage, shorter),
                                                         t2.durations, t2.copy, t2.recompute));
  }
  return sw;
}

namespace {
StageCost stage_cost(const models::ModelSpec& model, const models::ModelCosts& mc,
                     const traces::Trace& trace, const clusters::Cluster& cluster, const Plan& p,
                     int s);  // below
}  // namespace

std::vector<std::vector<ActivationChoice>> choose_activations(
    const models::ModelSpec& model, const traces::Trace& trace, const clusters::Cluster& cluster,
    const Plan& plan, bool keep_unswappable, double capacity_bytes) {
  const models::ModelCosts mc = models::derive_costs(model, {plan.t, plan.sp});
  // Stage s with its first k blocks swapping and the rest recomputing, the other stages as chosen.
  auto with = [](const Plan& base, const std::vector<std::vector<ActivationChoice>>& layers, int s,
                 std::int64_t k) {
    std::vector<std::vector<ActivationChoice>> l = layers;
    auto& mine = l[std::size_t(s)];
    for (std::size_t i = 0; i < mine.size(); ++i)
      mine[i] = std::int64_t(i) < k ? ActivationChoice::swap : ActivationChoice::recompute;
    Plan q = base;
    set_activation_layers(q, l);
    return q;
  };
  std::vector<std::vector<ActivationChoice>> out;
  for (int s = 0; s < plan.d; ++s)
    out.emplace_back(std::size_t(stage_block_count(plan, s)), ActivationChoice::swap);
  std::vector<std::int64_t> swapped(std::size_t(plan.d), 0);
  for (int s = 0; s < plan.d; ++s) {
    const std::int64_t blocks = stage_block_count(plan, s);
    const HostPath path = host_path(cluster, plan, plan.rank_of(s, 0));
    std::vector<ChunkCost> chunks;
    for (int c = 0; c < plan.v; ++c)
      chunks.push_back(chunk_cost(mc, trace, plan, s, c));
    for (ChunkCost& ch : chunks) {  // as if every layer swapped
      ch.recompute_layers = 0;
      ch.swap_bytes = ch.stash_bytes;
    }
    const StageSwap sw =
        stage_swap(plan, s, chunks, path, tp_link(cluster, plan, plan.rank_of(s, 0)));
    std::int64_t k = 0;
    if (sw.units_per_step == 0) {
      k = keep_unswappable ? blocks : 0;
    } else {
      // The most leading blocks whose swap, one direction, hides behind the shortest compute op.
      for (k = blocks; k > 0; --k) {
        if (k == blocks && sw.copy_s <= sw.window_s) break;  // the whole stage swaps
        if (k == blocks) continue;
        const Plan q = with(plan, out, s, k);
        double copy = 0;
        for (int c = 0; c < plan.v; ++c) {
          const ChunkCost ch = chunk_cost(mc, trace, q, s, c);
          copy = std::max(
              copy, path.time_s(double(q.mixed_activations(s) ? ch.swap_bytes : ch.stash_bytes)));
        }
        if (copy <= sw.window_s) break;
      }
    }
    swapped[std::size_t(s)] = k;
    out = with(plan, out, s, k).activation_layers;
  }
  // Memory: a stage that would not fit on the device swaps fewer blocks (recomputing them: a
  // recomputed block keeps only a checkpoint, a swapped one up to three stashes there) until
  // it fits; when none fits it keeps its choice.
  const double capacity = capacity_bytes > 0 ? capacity_bytes : double(cluster.device.memory_bytes);
  for (int s = 0; s < plan.d; ++s) {
    const std::int64_t k0 = swapped[std::size_t(s)];
    if (k0 == 0) continue;
    if (double(stage_cost(model, mc, trace, cluster, with(plan, out, s, k0), s).memory.total()) <=
        capacity)
      continue;
    for (std::int64_t k = k0 - 1; k >= 0; --k) {
      const Plan q = with(plan, out, s, k);
      if (double(stage_cost(model, mc, trace, cluster, q, s).memory.total()) <= capacity) {
        out = q.activation_layers;
        swapped[std::size_t(s)] = k;
        break;
      }
    }
  }
  // Host memory: a node whose ranks' host bytes (the optimizer's, with optimizer offload, and the
  // swapped stashes' peak, pinned) exceed host.memory_bytes or host.pinned_memory_bytes swaps
  // fewer blocks, one at a time on its stage holding the most swapped bytes on the host, until it
  // fits or nothing on it swaps (then the check in the report says so).
  if (plan.placement.size() != std::size_t(plan.ranks())) return out;
  const auto fits = [&](const Plan& q, int node, int& worst) {
    std::vector<StageCost> st;
    for (int s = 0; s < q.d; ++s)
      st.push_back(stage_cost(model, mc, trace, cluster, q, s));
    std::int64_t host = 0, pinned = 0, most = 0;
    worst = -1;
    for (int r = 0; r < q.ranks(); ++r) {
      if (q.placement[std::size_t(r)].node != node) continue;
      const StageCost& c = st[std::size_t(q.stage_of(r))];
      const std::int64_t swap_host = q.swaps(c.stage) ? c.swap.host_bytes : 0;
      // Per device; a rank is t devices (TP).
      host = bytes_add(host, bytes_mul(bytes_add(c.offload.host_bytes, swap_host), q.t));
      pinned = bytes_add(pinned, bytes_mul(bytes_add(c.offload.pinned_bytes, swap_host), q.t));
      if (swap_host > most && swapped[std::size_t(c.stage)] > 0) {
        most = swap_host;
        worst = c.stage;
      }
    }
    return host <= cluster.host.memory_bytes && pinned <= cluster.host.pinned_memory_bytes;
  };
  std::vector<int> nodes;
  for (const Placement& pl : plan.placement)
    if (std::find(nodes.begin(), nodes.end(), pl.node) == nodes.end()) nodes.push_back(pl.node);
  for (int node : nodes) {
    for (;;) {
      Plan q = plan;
      set_activation_layers(q, out);
      int worst = -1;
      if (fits(q, node, worst) || worst < 0) break;
      std::int64_t& k = swapped[std::size_t(worst)];
      k -= 1;
      out = with(plan, out, worst, k).activation_layers;
    }
  }
  return out;
}

void check_offload_cluster(const clusters::Cluster& c, const Plan& p) {
  if (!p.any_offload()) return;
  if (p.offload != Offload::none && c.host.cpu_adam_params_per_s() <= 0)
    throw InputError(fmt::format(
        "cluster {}: {} offload needs the host's CPU Adam rate, and host.cpu_cores x "
        "host.cpu_adam_params_per_s_per_core = {} x {:g} is 0 (set both, e.g. --set "
        "host.cpu_cores=32 --set host.cpu_adam_params_per_s_per_core=9.5e7; docs/formats.md)",
        c.name, to_string(p.offload), c.host.cpu_cores, c.host.cpu_adam_params_per_s_per_core));
  if (c.host.pcie_bandwidth_bytes_per_s <= 0 || c.host.uplink_bandwidth_bytes_per_s <= 0)
    throw InputError(fmt::format(
        "cluster {}: offload needs a host link, and host.pcie_bandwidth_bytes_per_s is "
        "{:g} (uplink {:g})",
        c.name, c.host.pcie_bandwidth_bytes_per_s, c.host.uplink_bandwidth_bytes_per_s));
}

void time_host_step(RankOffload& r, double rate) {
  std::vector<double> adam;
  r.cpu_adam_s = 0;
  for (double t : r.tile_parameters) {
    adam.push_back(t / rate);
    r.cpu_adam_s += adam.back();
  }
  r.host_step_s =
      r.tied_copy_out_s + r.shard_copy_out_s + two_stage_pipeline_s(adam, r.tile_upload_s);
}

std::vector<std::vector<double>> processor_sharing(const std::vector<SharedEntry>& entries) {
  const std::size_t n = entries.size();
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> ends(n);
  std::vector<std::size_t> at(n, 0);  // the phase under way
  std::vector<double> left(n, 0);
  std::vector<bool> started(n, false);
  const auto finished = [&](std::size_t i) { return at[i] >= entries[i].phases.size(); };
  const auto working = [&](std::size_t i) { return entries[i].phases[at[i]].work; };
  double now = inf;
  for (std::size_t i = 0; i < n; ++i)
    if (!entries[i].phases.empty()) now = std::min(now, entries[i].release);
  std::map<int, double> weights;  // per group: the weights of its entries in a work phase
  std::vector<double> rate(n, 0), end(n, inf);
  for (;;) {
    // Start the released entries, and step over phases of nothing.
    for (std::size_t i = 0; i < n; ++i) {
      if (finished(i)) continue;
      if (!started[i] && entries[i].release <= now) {
        started[i] = true;
        left[i] = entries[i].phases[0].amount;
      }
      while (started[i] && !finished(i) && left[i] <= 0) {
        ends[i].push_back(now);
        if (++at[i] < entries[i].phases.size()) left[i] = entries[i].phases[at[i]].amount;
      }
    }
    weights.clear();
    double next = inf;
    for (std::size_t i = 0; i < n; ++i) {
      if (finished(i)) continue;
      if (!started[i]) {
        next = std::min(next, entries[i].release);
        continue;
      }
      if (working(i)) weights[entries[i].group] += entries[i].weight;
    }
    for (std::size_t i = 0; i < n; ++i) {
      end[i] = inf;
      if (!started[i] || finished(i)) continue;
      const SharedEntry& e = entries[i];
      rate[i] = working(i) ? std::min(e.cap, e.capacity / weights[e.group]) : 1.0;
      end[i] = now + left[i] / rate[i];
      next = std::min(next, end[i]);
    }
    if (next == inf) break;
    for (std::size_t i = 0; i < n; ++i)
      if (started[i] && !finished(i))
        left[i] = end[i] <= next ? 0.0 : left[i] - (next - now) * rate[i];
    now = next;
  }
  return ends;
}

std::vector<double> processor_sharing_finish(const std::vector<double>& work,
                                             const std::vector<double>& release, double capacity,
                                             const std::vector<double>& copies) {
  std::vector<SharedEntry> entries(work.size());
  for (std::size_t i = 0; i < work.size(); ++i) {
    entries[i].release = release[i];
    entries[i].phases = {{true, work[i]}};
    entries[i].weight = copies.empty() ? 1.0 : copies[i];
    entries[i].capacity = capacity;
  }
  std::vector<double> finish;
  for (const std::vector<double>& e : processor_sharing(entries))
    finish.push_back(e.back());
  return finish;
}

RankOffload rank_offload(const models::ModelSpec& model, const models::ModelCosts& mc,
                         const clusters::Cluster& cluster, const Plan& p, int rank,
                         const std::vector<ChunkCost>& chunks,
                         const std::vector<std::int64_t>& host_parameters) {
  const std::int64_t e = models::dtype_bytes(model.dtype);
  const HostPath path = host_path(cluster, p, rank);
  const HostPath up = upload_path(cluster, p, rank, host_parameters);
  const double rate = cpu_adam_rate(cluster, p, rank, host_parameters);
  RankOffload r;
  std::int64_t updated = 0, largest = 0, resident = 0, streamed = 0;
  const bool sharded = p.offload_sharded();
  for (const ChunkCost& ch : chunks) {
    ChunkOffload o = chunk_offload(mc, p, ch, p.replica_of(rank));
    r.copy_out_s.push_back(sharded ? 0.0
                                   : path.time_s(double(bytes_mul(o.streamed_parameters, e))));
    if (sharded) {  // the shard, once per step, on the copy engine the uploads use later
      r.shard_copy_out_s += up.time_s(double(bytes_mul(o.shard_copy_out_parameters, e)));
      r.copy_out_bytes_per_step =
          bytes_add(r.copy_out_bytes_per_step, bytes_mul(o.shard_copy_out_parameters, e));
    }
    if (o.tied_copy_out_parameters > 0)
      r.tied_copy_out_s = path.time_s(double(bytes_mul(o.tied_copy_out_parameters, e)));
    for (std::int64_t t : o.tiles) {
      r.tile_parameters.push_back(double(t));
      r.tile_upload_s.push_back(up.time_s(double(bytes_mul(t, e))));
    }
    updated = bytes_add(updated, o.host_parameters());
    largest = std::max(largest, o.largest_tile());
    resident = bytes_add(resident, o.resident_parameters);
    streamed = bytes_add(streamed, o.streamed_parameters);
    r.copy_out_bytes_per_step =
        bytes_add(r.copy_out_bytes_per_step, bytes_mul(o.tied_copy_out_parameters, e));
    r.chunks.push_back(std::move(o));
  }
  for (double u : r.tile_upload_s)
    r.upload_s += u;
  time_host_step(r, rate);
  // Gradients leave in layer-sized pieces, double-buffered: one filling, one on the copy engine.
  r.device_gradient_bytes = bytes_add(bytes_mul(bytes_mul(largest, 2), e), bytes_mul(resident, e));
  if (sharded) {  // the whole gradient, accumulated over the microbatches for the reduce-scatter
    std::int64_t parameters = 0;
    for (const ChunkCost& ch : chunks)
      parameters = bytes_add(parameters, ch.parameters);
    r.device_gradient_bytes = bytes_mul(parameters, e);
  }
  r.host_bytes = bytes_mul(updated, offload_host_bytes_per_parameter(model.dtype, sharded));
  r.pinned_bytes = bytes_mul(updated, e);
  r.copy_out_bytes_per_step =
      bytes_add(r.copy_out_bytes_per_step, bytes_mul(bytes_mul(streamed, e), p.m));
  r.copy_in_bytes_per_step = bytes_mul(updated, e);
  return r;
}

namespace {

StageCost stage_cost(const models::ModelSpec& model, const models::ModelCosts& mc,
                     const traces::Trace& trace, const clusters::Cluster& cluster, const Plan& p,
                     int s) {
  const traces::Entry& e = trace.at(p.b);
  StageCost st;
  st.stage = s;
  st.recompute = p.recompute_of(s);
  const clusters::Link tp = tp_link(cluster, p, p.rank_of(s, 0));
  std::vector<ChunkCost> chunks;
  std::vector<double> chunk_backward;   // per chunk, recompute and TP included
  std::vector<double> chunk_recompute;  // per chunk, the full recompute's part of it
  for (int c = 0; c < p.v; ++c) {
    const ChunkCost ch = chunk_cost(mc, trace, p, s, c);
    chunks.push_back(ch);
    const double backward_before = st.backward_s;
    const double tp_forward = tp_time_s(ch.tp_forward, p.t, tp);
    const double tp_backward = tp_backward_s(ch, p.t, tp);
    st.blocks += ch.blocks;
    st.has_embedding |= ch.has_embedding;
    st.has_head |= ch.has_head;
    st.forward_s += ch.forward_s + tp_forward;
    st.backward_s += ch.backward_s + tp_backward;
    st.tp_s += tp_forward + tp_backward;
    if (p.recomputes(s)) {  // the forward again, its TP collectives included
      st.backward_s += ch.recompute_s + tp_forward;
      st.tp_s += tp_forward;
    } else if (st.recompute == Recompute::selective) {
      st.backward_s += ch.selective_recompute_s;
    }
    chunk_backward.push_back(st.backward_s - backward_before);
    st.chunk_forward_s.push_back(ch.forward_s + tp_forward);
    chunk_recompute.push_back(p.recomputes(s) ? ch.recompute_s + tp_forward : 0.0);
    st.optimizer_s += ch.optimizer_s;
    st.parameters = bytes_add(st.parameters, ch.parameters);
    st.stash_bytes = bytes_add(st.stash_bytes, ch.stash_bytes);
    st.selective_bytes = bytes_add(st.selective_bytes, ch.selective_bytes);
    st.input_bytes = bytes_add(st.input_bytes, ch.input_bytes);
    st.layer_inputs_bytes = bytes_add(st.layer_inputs_bytes, ch.layer_inputs_bytes);
    st.memory.workspace = std::max(st.memory.workspace, ch.workspace_bytes);
  }
  st.chunk_backward_s = chunk_backward;
  const std::int64_t workspace = st.memory.workspace;
  st.memory = static_memory(model, p, st.parameters);
  st.memory.workspace = workspace;
  st.memory.weight_versions = p.schedule == Schedule::two_bw
                                  ? bytes_mul(st.parameters, models::dtype_bytes(model.dtype))
                                  : 0;
  if (p.offload == Offload::optimizer) {
    // Each backward streams its gradients out on the copy engine: a backward lasts as long as
    // the slower of the two (a full recompute before it produces no gradients: it stays in
    // front). Optimizer state lives on the host; the step is the host's.
    st.offload = rank_offload(model, mc, cluster, p, p.rank_of(s, 0), chunks,
                              host_parameters_by_rank(mc, trace, p));
    // Sharded (w > 1): nothing leaves during the backward; the shard's copy is in the host step.
    st.backward_s = 0;
    for (std::size_t c = 0; c < std::size_t(p.v); ++c)
      st.backward_s += chunk_recompute[c] +
                       std::max(chunk_backward[c] - chunk_recompute[c], st.offload.copy_out_s[c]);
    st.memory.gradients = st.offload.device_gradient_bytes;
    st.memory.optimizer = 0;
    st.optimizer_s = st.offload.host_step_s;
  }
  st.in_flight = in_flight(p, s);
  // Interleaved stashes microbatch-chunks: each is on average 1/v of the device's stash.
  const std::int64_t per_unit = p.v > 1 ? st.stash_bytes / p.v : st.stash_bytes;
  const std::int64_t selective_unit = p.v > 1 ? st.selective_bytes / p.v : st.selective_bytes;
  const std::int64_t input_unit = p.v > 1 ? st.input_bytes / p.v : st.input_bytes;
  const std::int64_t inputs_unit = p.v > 1 ? st.layer_inputs_bytes / p.v : st.layer_inputs_bytes;
  // The message buffers held beside the stashes (received, produced, the last one sent): a
  // forward's count, or a backward's where the peak is a backward (planner::message_buffers).
  const std::int64_t message = trace.at(p.b).layers[LayerKind::block].output_bytes;
  std::int64_t scratch = 0;
  for (const ChunkCost& ch : chunks)
    scratch = std::max(scratch, ch.recompute_scratch_bytes);
  const std::int64_t forward_messages = bytes_mul(message_buffers(p, s), message);
  const std::int64_t backward_messages = bytes_mul(backward_message_buffers(p, s), message);
  switch (st.recompute) {
    case Recompute::full:  // a forward with its scratch, or a backward with the stash re-made
      st.memory.activations = std::max(
          bytes_add(bytes_add(bytes_mul(st.in_flight, input_unit), scratch), forward_messages),
          bytes_add(bytes_add(bytes_mul(st.in_flight, input_unit), st.stash_bytes),
                    backward_messages));
      break;
    case Recompute::block:  // a forward with its scratch, or a backward re-making one layer in it
      st.memory.activations = bytes_add(bytes_add(bytes_mul(st.in_flight, inputs_unit), scratch),
                                        std::max(forward_messages, backward_messages));
      break;
    case Recompute::selective:
      st.memory.activations = bytes_add(bytes_mul(st.in_flight, selective_unit), forward_messages);
      break;
    case Recompute::none:  // the peak: the end of a forward
      st.memory.activations = bytes_add(bytes_mul(st.in_flight, per_unit), forward_messages);
      break;
  }
  // Activation offload (docs/formulas.md section 9, activation offload): a swapping stage holds
  // only the stashes not on the host, and its backwards wait for the uploads that do not hide (the
  // stage's stall, per microbatch).
  if (p.swaps(s)) {
    st.swap = stage_swap(p, s, chunks, host_path(cluster, p, p.rank_of(s, 0)), tp);
    st.memory.activations = 0;
    for (const auto& [bytes, buffers] : st.swap.moments)
      st.memory.activations =
          std::max(st.memory.activations, bytes_add(bytes, bytes_mul(buffers, message)));
    st.backward_s += st.swap.stall_s / p.m;
    // A mixed stage: its recomputed layers' forward again before each backward, their TP
    // collectives included.
    for (const ChunkCost& ch : chunks) {
      const double tp_recompute = tp_time_s(ch.layers_recompute_tp, p.t, tp);
      st.backward_s += ch.layers_recompute_s + tp_recompute;
      st.tp_s += tp_recompute;
    }
  }
  // Activation (forward) and gradient (backward) cross the link to s+1 once per microbatch-chunk;
  // replicas leaving a node through its one NIC at the same moment share it. With t > 1 each GPU
  // of the TP group sends its 1/t of the tensor to its counterpart (Megatron's scatter/gather;
  // with SP the output is already split), all through the node's NIC when there is one per node.
  if (p.d > 1 && (s < p.d - 1 || p.v > 1)) {
    const int next = p.rank_of((s + 1) % p.d, 0);
    const clusters::Link link = rank_link(cluster, p, p.rank_of(s, 0), next);
    const double piece = double(message_piece_bytes(p, e.layers[LayerKind::block].output_bytes));
    const int sharers = nic_sharers(cluster, p, s) * tp_nic_sharers(cluster, p, link);
    st.send_s = p.v * (link.latency_s + sharers * piece / link.bandwidth_bytes_per_s);
    st.send_bytes = sharers * piece;
  }
  // Each GPU of a TP group all-reduces its own shard over the stage's w replicas, the t rings at
  // once (sharing a node's NIC). The distributed optimizer's reduce-scatter of the gradients and
  // all-gather of the new parameters move what one all-reduce moves.
  if (p.w > 1) {
    const ReplicaAllreduce ar = replica_allreduce(cluster, p, s, double(st.memory.gradients));
    st.allreduce_s = ar.total();
    st.allreduce_network_s = ar.network_s;
  }
  return st;
}

// Steady-state period of one microbatch in 1F1B's and 2BW's one-forward-one-backward stream
// (v = 1). Stage i runs F(j + d - i - 1), B(j) in turn, so after B_i(j) comes F_i(j + d - i): for
// any span of stages s..e the events F_s(j) -> hop -> ... -> F_e(j) -> B_e(j - (d - e - 1)) ->
// hop -> ... -> B_s(j - (d - e - 1)) -> F_s(j + e - s + 1) form a cycle of e - s + 1 microbatches
// whose length is the span's compute plus a round trip over each of its boundaries. The stream
// can run no faster than its slowest cycle (max-plus algebra: the period is the largest cycle
// mean):
//   P = max over s <= e of (sum_{i=s..e} T_i + 2 sum_{i=s..e-1} c_i) / (e - s + 1)
// Spans of one stage give T_max; uniform stages and hops give T + 2c(d - 1)/d (the whole
// pipeline). With hops that differ (only some boundaries cross a node) the critical span is the
// one around the slow boundaries, not the whole pipeline charged the slowest hop everywhere.
double steady_period(const Plan& p, const std::vector<StageCost>& st) {
  double period = 0;
  for (int s = 0; s < p.d; ++s) {
    double span = 0;
    for (int e = s; e < p.d; ++e) {
      const StageCost& x = st[std::size_t(e)];
      span += x.forward_s + x.backward_s;
      if (e > s) span += 2 * st[std::size_t(e - 1)].send_s / p.v;
      period = std::max(period, span / (e - s + 1));
    }
  }
  return period;
}

namespace {

// Interleaved: one step of the schedule walked op by op (walk_compute_orders over each stage's
// step_compute_order: an op starts when its stage's previous op has ended and, but for the first
// virtual stage's forwards and the last one's backwards, one hop after the virtual stage before
// it (forward) or after it (backward) ended the same microbatch). A model chunk's forward and
// backward take their part of t_f(s) and t_b(s) (StageCost::chunk_forward_s, chunk_backward_s; a
// recompute is in its backward's). Exact without contention, whatever the model chunks and stages
// (layers not divisible by d v, uneven stage_blocks); (m + (d-1)/v)(t_f + t_b) + 2(d-1)c when all
// alike. chunk_pipeline (planner/chunks.cpp) walks the same way with offload chunks' moments.
double interleaved_walk(const Plan& p, const std::vector<StageCost>& st) {
  const std::size_t d = std::size_t(p.d), v = std::size_t(p.v);
  // `total` split over the model chunks in the proportions of `parts` (evenly without them).
  auto split = [v](double total, const std::vector<double>& parts) {
    double sum = 0;
    for (double x : parts)
      sum += x;
    std::vector<double> out(v, total / double(v));
    if (sum > 0 && parts.size() == v)
      for (std::size_t c = 0; c < v; ++c)
        out[c] = total * parts[c] / sum;
    return out;
  };
  std::vector<std::vector<ComputeSlot>> order(d);
  std::vector<std::vector<double>> duration(d);
  std::vector<double> hop(d);  // one message: send_s is a microbatch's v of them
  for (std::size_t s = 0; s < d; ++s) {
    const std::vector<double> forward = split(st[s].forward_s, st[s].chunk_forward_s);
    const std::vector<double> backward = split(st[s].backward_s, st[s].chunk_backward_s);
    order[s] = step_compute_order(p, int(s));
    for (const ComputeSlot& op : order[s])
      duration[s].push_back((op.backward ? backward : forward).at(std::size_t(op.chunk)));
    hop[s] = st[s].send_s / double(v);
  }
  const OrderWalk walk = walk_compute_orders(p, order, duration, hop, 1);
  return *std::max_element(walk.end.begin(), walk.end.end());
}

}  // namespace

// Forward/backward part of one steady-state step. Uniform stages and hop time c:
//   gpipe        (m + d - 1)(t_f + t_b) + 2(d - 1)c
//   1f1b         the same + (2(d-1)m/d - 2)c: in steady state a stage waits for a round trip to
//                its neighbour, 2c(d-1)/d per microbatch (fitted exactly to the event-by-event
//                reference in tests/test_simulator.cpp for d <= 8, m >= d)
//   2bw          m (t_f + t_b + 2c(d-1)/d)
//   interleaved  (m + (d-1)/v)(t_f + t_b) + 2(d - 1)c
// With stages or hops that differ, 2BW's period is the largest cycle mean P (steady_period) and
// 1F1B's exposed round trip per microbatch P - T_max; both reduce to the figures above.
// Interleaved walks its compute order (interleaved_walk, at least m L): exact without contention
// whatever its model chunks and stages, the figure above when they are alike.
double pipeline_time(const Plan& p, const std::vector<StageCost>& st) {
  double slowest = 0, sum = 0, comm = 0, hop = 0, link_bound = 0;
  for (const auto& s : st) {
    slowest = std::max(slowest, s.forward_s + s.backward_s);
    link_bound = std::max(link_bound, s.send_s);
    sum += s.forward_s + s.backward_s;
    if (s.stage < p.d - 1) comm += 2 * s.send_s / p.v;
    hop = std::max(hop, s.send_s / p.v);
  }
  const double round_trip = p.schedule == Schedule::two_bw || p.schedule == Schedule::one_f_one_b
                                ? steady_period(p, st) - slowest
                                : 0.0;
  switch (p.schedule) {
    case Schedule::dp:
      return p.m * slowest;
    case Schedule::two_bw:
      return p.m * std::max(slowest + round_trip, link_bound);
    case Schedule::interleaved:
      return std::max(interleaved_walk(p, st), p.m * link_bound);
    case Schedule::gpipe:
      return (p.m - 1) * std::max(slowest, link_bound) + sum + comm;
    case Schedule::one_f_one_b:
      return (p.m - 1) * std::max(slowest, link_bound) + sum + comm +
             std::max(0.0, p.m * round_trip - 2 * hop);
  }
  return 0;
}

// Exposed part of the tied-embedding exchange (d > 1): the last stage sends its head's gradient
// (w > 1: each replica its 1/w shard of the all-reduced gradient; with offload chunks of the
// reduce-scattered one) to stage 0 after its last backward and all-reduce; stage 0 needs it after
// its own last backward, up to d-1 backward slots later, then (w > 1) all-gathers the shards over
// its replicas. Flush schedules then wait for the new weights on the last stage, whose first
// forward of the next step comes d-1 forwards and hops after stage 0's; 2BW needs them one step
// later, where they hide. The last stage all-gathers the weights' shards (w > 1) before that
// forward, on its critical path either way.
double tied_exchange_time(const models::ModelSpec& model, const models::ModelCosts& mc,
                          const clusters::Cluster& cluster, const Plan& p,
                          const std::vector<StageCost>& st) {
  if (p.d == 1 || mc.tied_copy_parameters == 0) return 0;
  const int last = p.d - 1;
  const clusters::Link link = rank_link(cluster, p, p.rank_of(last, 0), p.rank_of(0, 0));
  const double bytes = double(mc.tied_copy_parameters * models::dtype_bytes(model.dtype));
  const double shard = std::ceil(bytes / p.w);
  const double transfer_s = link.latency_s + nic_sharers(cluster, p, last) *
                                                 tp_nic_sharers(cluster, p, link) * shard /
                                                 link.bandwidth_bytes_per_s;
  // All-gather over the stage's replica ring: (w-1) steps of ceil(S/w), the t rings at once.
  auto gather_s = [&](int s) {
    if (p.w == 1) return 0.0;
    clusters::Link ring = replica_ring_link(cluster, p, s);
    ring.bandwidth_bytes_per_s /= tp_nic_sharers(cluster, p, ring);
    return (p.w - 1) * (ring.latency_s + shard / ring.bandwidth_bytes_per_s);
  };
  // Flush schedules (v = 1) across nodes: while the new weights cross, the next step's fill sends
  // its activations over the same NICs (out of stage 0's node, into the last stage's). The stage
  // s before such a boundary ends its first forward at a_s (the forwards and hops before it) and
  // sends one activation per forward after it while the weights are under way (transfer_s), up
  // to its sends before it needs a gradient back, which cannot come until the last stage has the
  // weights (1f1b: min(d - s, m); gpipe: m). They share the NIC, so the weights take longer by
  // those bytes (docs/formulas.md §4, the tied exchange).
  double fill_bytes = 0;
  if (link.via == "network" && p.v == 1 && p.schedule != Schedule::two_bw) {
    const auto node_of = [&](int s) { return p.placement[std::size_t(p.rank_of(s, 0))].node; };
    double first_end = 0;  // a_s
    for (int s = 0; s + 1 < p.d; ++s) {
      const StageCost& x = st[std::size_t(s)];
      first_end += x.forward_s;
      const bool crossing = node_of(s) != node_of(s + 1) &&
                            (node_of(s) == node_of(0) || node_of(s + 1) == node_of(last));
      if (crossing && transfer_s > first_end && x.forward_s > 0) {
        const int most = p.schedule == Schedule::gpipe ? p.m : std::min(p.d - s, p.m);
        const double during = std::floor((transfer_s - first_end) / x.forward_s) + 1;
        fill_bytes = std::max(fill_bytes, std::min(double(most), during) * x.send_bytes);
      }
      first_end += x.send_s;
    }
  }
  const double weights_transfer_s = transfer_s + fill_bytes / link.bandwidth_bytes_per_s;
  double backwards = 0, forwards = 0;
  for (int s = 1; s < p.d; ++s)
    backwards += st[std::size_t(s)].backward_s / p.v;
  for (int s = 0; s < last; ++s)
    forwards += (st[std::size_t(s)].forward_s + st[std::size_t(s)].send_s) / p.v;
  // Offload chunks (w > 1): no all-reduce sums the last stage's tied copy (its chunk steps sum
  // only what they step), so its replicas reduce-scatter the copy's gradient before sending, a
  // ring as long as the all-gather's.
  const double copy_sum_s = p.offload == Offload::chunks ? gather_s(last) : 0.0;
  const double gradient_s = std::max(0.0, st[std::size_t(last)].allreduce_s + copy_sum_s +
                                              transfer_s - backwards - st[0].allreduce_s) +
                            gather_s(0);
  const double weights_s =
      (p.schedule == Schedule::two_bw ? 0.0 : std::max(0.0, weights_transfer_s - forwards)) +
      gather_s(last);
  return gradient_s + weights_s;
}

// CPU Adam of a node's ranks as processor sharing with the moments they reach it (section 9):
// stage s ends its step's last backward sum_{j<s} (backward slot_j + hop_j) before stage 0 (the
// cool-down's backwards run from the last stage down), stage 0 also copies its tied gradient
// first; each rank's rate is its work over the time processor sharing takes for it.
void share_host_cpus(std::vector<StageCost>& stages, const clusters::Cluster& cluster,
                     const Plan& p) {
  std::vector<double> release(std::size_t(p.ranks()), 0);
  for (int r = 0; r < p.ranks(); ++r) {
    double offset = 0;
    for (int j = 0; j < p.stage_of(r); ++j)
      offset += (stages[std::size_t(j)].backward_s + stages[std::size_t(j)].send_s) / p.v;
    const RankOffload& o = stages[std::size_t(p.stage_of(r))].offload;
    release[std::size_t(r)] = -offset + o.tied_copy_out_s + o.shard_copy_out_s;
  }
  std::map<int, std::vector<int>> by_node;
  for (int r = 0; r < p.ranks(); ++r)
    by_node[p.placement[std::size_t(r)].node].push_back(r);
  std::vector<RankOffload> timed(std::size_t(p.ranks()));
  for (const auto& [node, ranks] : by_node) {
    // One job per device: with t > 1 each GPU of a TP group updates its own shard (the rank's
    // job i * t is its first GPU's; the others are the same).
    std::vector<double> work, rel;
    for (int r : ranks) {
      double w = 0;
      for (double t : stages[std::size_t(p.stage_of(r))].offload.tile_parameters)
        w += t;
      work.insert(work.end(), std::size_t(p.t), w);
      rel.insert(rel.end(), std::size_t(p.t), release[std::size_t(r)]);
    }
    const std::vector<double> end =
        processor_sharing_finish(work, rel, cluster.host.cpu_adam_params_per_s());
    for (std::size_t i = 0; i < ranks.size(); ++i) {
      const std::size_t job = i * std::size_t(p.t);
      RankOffload o = stages[std::size_t(p.stage_of(ranks[i]))].offload;
      if (work[job] > 0 && end[job] > rel[job])
        time_host_step(o, work[job] / (end[job] - rel[job]));
      timed[std::size_t(ranks[i])] = std::move(o);
    }
  }
  // A stage's host step is its slowest replica's (w > 1: replicas on different nodes may share
  // their CPUs differently).
  for (StageCost& st : stages) {
    const RankOffload* slowest = nullptr;
    for (int r = 0; r < p.ranks(); ++r)
      if (p.stage_of(r) == st.stage &&
          (!slowest || timed[std::size_t(r)].host_step_s > slowest->host_step_s))
        slowest = &timed[std::size_t(r)];
    if (slowest) st.offload = *slowest;
    st.optimizer_s = st.offload.host_step_s;
  }
}

}  // namespace

common::Json chunk_report(const ChunkSchedule& cs) {
  double host_adam = 0, device_adam = 0;
  for (int c = 0; c < cs.layout.chunks(); ++c)
    (cs.device_resident(c) ? device_adam : host_adam) +=
        cs.device_resident(c) ? cs.device_adam_s[std::size_t(c)] : cs.host_adam_s[std::size_t(c)];
  common::Json j = {
      {"chunk_bytes", cs.layout.chunk_bytes},
      {"move_bytes", cs.layout.move_bytes},
      {"chunks", cs.layout.chunks()},
      {"optimizer_state_bytes_per_chunk", cs.layout.os_chunk_bytes},
      {"device_adam_chunks", cs.device_adam_chunks},
      {"uploads_per_step", cs.uploads},
      {"downloads_per_step", cs.downloads},
      {"copy_s", cs.copy_s},
      // No copies: rounding of the sums, not a negative stall.
      {"copy_stall_s", std::max(0.0, cs.forward_s + cs.backward_s - (cs.compute_s - device_adam))},
      {"cpu_adam_s", host_adam},
      {"device_adam_s", device_adam},
      {"optimizer_s", cs.optimizer_s},
      {"device_peak_bytes", cs.device_peak_bytes},
      {"peak_moment", cs.peak().label(cs.layout)},
      {"host_peak_bytes", cs.host_peak_bytes}};
  if (cs.layout.parts > 1) {  // 2bw: a chunk's version slots and gradient move on their own
    j["parts"] = cs.layout.parts;
    j["peak_segment"] = to_string(ChunkSegment(cs.peak_segment));
  }
  if (cs.layout.replicas > 1) {  // the optimizer state sharded over the stage's replicas
    j["replicas"] = cs.layout.replicas;
    j["collective_s"] = cs.collective_s;
  }
  if (cs.layout.part_bytes > 0) {  // sharded chunks: the replica's parts, and the drops
    int sharded = 0;
    for (int c = 0; c < cs.layout.chunks(); ++c)
      sharded += cs.layout.is_sharded(c) ? 1 : 0;
    j["sharded_chunks"] = sharded;
    j["part_bytes"] = cs.layout.part_bytes;
    j["part_uploads_per_step"] = cs.part_uploads;
    j["part_downloads_per_step"] = cs.part_downloads;
    j["drops_per_step"] = cs.drops;
    if (cs.layout.parts > 1) j["zero_fills_per_step"] = cs.zero_fills;
    j["part_copy_s"] = cs.part_copy_s;
  }
  return j;
}

namespace {

// offload chunks: each rank's stage's schedule's host memory (the ranks on one node share its host
// memory: their peaks add) and copy volumes.
void add_chunk_report(RunReport& rep, const std::vector<ChunkSchedule>& all,
                      const clusters::Cluster& cluster, const Plan& p) {
  std::map<int, HostReport> hosts;
  common::Json ranks = common::Json::array();
  std::int64_t out = 0, in = 0;
  for (int r = 0; r < p.ranks(); ++r) {
    const ChunkSchedule& cs = all[std::size_t(p.stage_of(r))];
    HostReport& h = hosts[p.placement[std::size_t(r)].node];
    h.node = p.placement[std::size_t(r)].node;
    // A rank's figures are one device's; with t > 1 the node and the totals have t of them.
    h.peak_memory_bytes = bytes_add(h.peak_memory_bytes, bytes_mul(p.t, cs.host_peak_bytes));
    h.pinned_bytes = bytes_add(h.pinned_bytes, bytes_mul(p.t, cs.host_chunk_peak_bytes));
    h.capacity_bytes = cluster.host.memory_bytes;
    h.pinned_capacity_bytes = cluster.host.pinned_memory_bytes;
    out = bytes_add(out, bytes_mul(p.t, cs.copy_out_bytes));
    in = bytes_add(in, bytes_mul(p.t, cs.copy_in_bytes));
    ranks.push_back({{"rank", r},
                     {"host_bytes", cs.host_peak_bytes},
                     {"pinned_bytes", cs.host_chunk_peak_bytes},
                     {"copy_out_bytes_per_step", cs.copy_out_bytes},
                     {"copy_in_bytes_per_step", cs.copy_in_bytes},
                     {"chunks", chunk_report(cs)}});
  }
  for (const auto& [node, h] : hosts)
    rep.hosts.push_back(h);
  rep.extra["offload"] = {{"mode", offload_name(p)},
                          {"copy_out_bytes_per_step", out},
                          {"copy_in_bytes_per_step", in},
                          {"activation_bytes_per_step", 0},
                          {"ranks", ranks}};
}

void add_offload_report(RunReport& rep, const std::vector<StageCost>& stages,
                        const clusters::Cluster& cluster, const Plan& p) {
  std::map<int, HostReport> hosts;
  common::Json ranks = common::Json::array();
  std::int64_t out = 0, in = 0, swapped = 0;
  for (int r = 0; r < p.ranks(); ++r) {
    const StageCost& st = stages[std::size_t(p.stage_of(r))];
    const RankOffload& o = st.offload;
    const bool swaps = p.swaps(st.stage);
    const std::int64_t swap_bytes = swaps ? st.swap.bytes_per_step : 0;
    const std::int64_t swap_host = swaps ? st.swap.host_bytes : 0;
    // A rank's figures are one device's; with t > 1 the node and the totals have t of them.
    HostReport& h = hosts[p.placement[std::size_t(r)].node];
    h.node = p.placement[std::size_t(r)].node;
    h.peak_memory_bytes =
        bytes_add(h.peak_memory_bytes, bytes_mul(bytes_add(o.host_bytes, swap_host), p.t));
    h.pinned_bytes =
        bytes_add(h.pinned_bytes, bytes_mul(bytes_add(o.pinned_bytes, swap_host), p.t));
    h.capacity_bytes = cluster.host.memory_bytes;
    h.pinned_capacity_bytes = cluster.host.pinned_memory_bytes;
    out = bytes_add(out, bytes_mul(bytes_add(o.copy_out_bytes_per_step, swap_bytes), p.t));
    in = bytes_add(in, bytes_mul(bytes_add(o.copy_in_bytes_per_step, swap_bytes), p.t));
    swapped = bytes_add(swapped, bytes_mul(swap_bytes, p.t));
    common::Json rank = {
        {"rank", r},
        {"host_bytes", bytes_add(o.host_bytes, swap_host)},
        {"pinned_bytes", bytes_add(o.pinned_bytes, swap_host)},
        {"copy_out_bytes_per_step", bytes_add(o.copy_out_bytes_per_step, swap_bytes)},
        {"copy_in_bytes_per_step", bytes_add(o.copy_in_bytes_per_step, swap_bytes)}};
    if (p.offload == Offload::optimizer) {
      rank["copy_out_s_per_microbatch"] = o.copy_out_s;
      if (p.offload_sharded()) rank["shard_copy_out_s"] = o.shard_copy_out_s;
      rank["cpu_adam_s"] = o.cpu_adam_s;
      rank["upload_s"] = o.upload_s;
      rank["host_step_s"] = o.host_step_s;
    }
    if (p.offload_activations) {
      rank["activations"] = {{"choice", to_string(p.activations[std::size_t(st.stage)])},
                             {"swapped_layers", p.swapped_layers(st.stage)},
                             {"recomputed_layers", p.recomputed_layers(st.stage)},
                             {"swapped_per_step", swaps ? st.swap.units_per_step : 0},
                             {"swapped_bytes_per_step", swap_bytes},
                             {"host_bytes", swap_host},
                             {"copy_s", swaps ? st.swap.copy_s : 0.0},
                             {"window_s", swaps ? st.swap.window_s : 0.0},
                             {"stall_s", swaps ? st.swap.stall_s : 0.0}};
    }
    ranks.push_back(rank);
  }
  for (const auto& [node, h] : hosts)
    rep.hosts.push_back(h);
  rep.extra["offload"] = {{"mode", offload_name(p)},
                          {"copy_out_bytes_per_step", out},
                          {"copy_in_bytes_per_step", in},
                          {"activation_bytes_per_step", swapped},
                          {"ranks", ranks}};
}

}  // namespace

// Exposed part of a collective of `total` seconds run in P = kOverlapPieces equal pieces one
// after the other, piece k starting when the k-th of P equal slices of `work` seconds of compute
// is done (gradient buckets behind a backward) or piece k's slice waiting for it (parameters
// ahead of a forward): max(total - work (P - 1) / P, total / P), less `slack` (time the step
// waits for other reasons meanwhile), at least 0 (docs/formulas.md §4).
static double overlapped_s(double total, double work, double slack) {
  if (total <= 0) return 0;
  constexpr double P = kOverlapPieces;
  return std::max(0.0, std::max(total - work * (P - 1) / P, total / P) - slack);
}

// Stages whose replicas' all-reduces leave a node through its one NIC share it: per stage the
// node of its replica 0 where its replica ring spans more than one node and the cluster has one
// NIC per node, else -1 (alone).
static std::vector<int> data_parallel_nic(const clusters::Cluster& c, const Plan& p) {
  std::vector<int> nic(std::size_t(p.d), -1);
  if (p.w == 1 || c.network.nic_per != clusters::NicPer::node) return nic;
  for (int s = 0; s < p.d; ++s) {
    const int node = p.placement[std::size_t(p.rank_of(s, 0))].node;
    for (int r = 1; r < p.w; ++r)
      if (p.placement[std::size_t(p.rank_of(s, r))].node != node) nic[std::size_t(s)] = node;
  }
  return nic;
}

// The exposed data-parallel time of the step (docs/formulas.md §4): each stage's gradient
// all-reduce (with the distributed optimizer its reduce-scatter, half of it) runs in buckets behind
// its last backward; stage s's last backward ends sum_{j<s} (backward_j + hop_j) / v before the
// step's end (the cool-down runs from the last stage down to stage 0). The distributed
// optimizer's parameter all-gather (the other half) follows the optimizer step: whole, or with
// overlap_param_gather in pieces ahead of the next step's first forward, which stage s starts
// sum_{j<s} (forward_j + hop_j) / v after stage 0 anyway. The slowest stage's sum.
static double exposed_data_parallel_s(const std::vector<StageCost>& stages,
                                      const clusters::Cluster& cluster, const Plan& p) {
  if (p.w == 1) return 0;
  const std::size_t d = stages.size();
  const bool sharded = p.distributed_optimizer;
  std::vector<double> reduce(d), gather(d), cool_down(d), warm_up(d), network(d, 0);
  double cool = 0, warm = 0;
  for (std::size_t s = 0; s < d; ++s) {
    const StageCost& st = stages[s];
    reduce[s] = sharded ? st.allreduce_s / 2 : st.allreduce_s;
    gather[s] = sharded ? st.allreduce_s / 2 : 0;
    // The share of it that crosses the NIC (the rest, intra-node, runs half before, half after).
    if (st.allreduce_s > 0) network[s] = st.allreduce_network_s / st.allreduce_s;
    cool_down[s] = cool;
    warm_up[s] = warm;
    cool += (st.backward_s + st.send_s) / p.v;
    warm += (st.forward_s + st.send_s) / p.v;
  }
  // Stages sharing a NIC (data_parallel_nic) share it as processor sharing: the reduces' network
  // steps from each stage's last backward's end (cool_down before the step's end) and its
  // intra-node half before them, then the gathers' the same way from each one's reduce's end;
  // each stage's phase lasts from its release to its network steps' finish and its other half.
  const std::vector<int> nic = data_parallel_nic(cluster, p);
  for (std::size_t s = 0; s < d; ++s) {
    if (nic[s] < 0) continue;
    std::vector<std::size_t> group;
    for (std::size_t j = 0; j < d; ++j)
      if (nic[j] == nic[s]) group.push_back(j);
    if (group.size() < 2 || group.front() != s) continue;  // alone, or done with its first stage
    // One phase (`phase`: each stage's time alone, released at `start`): the stages' time
    // shared, and each one's end.
    auto share = [&](std::vector<double>& phase, std::vector<double>& start) {
      std::vector<double> work, release;
      for (std::size_t k = 0; k < group.size(); ++k) {
        const std::size_t j = group[k];
        work.push_back(phase[j] * network[j]);
        release.push_back(start[k] + phase[j] * (1 - network[j]) / 2);
      }
      const std::vector<double> finish = processor_sharing_finish(work, release, 1.0);
      for (std::size_t k = 0; k < group.size(); ++k) {
        const std::size_t j = group[k];
        const double end = finish[k] + phase[j] * (1 - network[j]) / 2;
        phase[j] = end - start[k];
        start[k] = end;
      }
    };
    std::vector<double> start;
    for (std::size_t j : group)
      start.push_back(-cool_down[j]);
    share(reduce, start);
    if (sharded) share(gather, start);
  }
  double worst = 0;
  for (std::size_t s = 0; s < d; ++s) {
    const StageCost& st = stages[s];
    double exposed = overlapped_s(reduce[s], st.backward_s / p.v, cool_down[s]);
    if (p.overlap_param_gather)
      exposed += overlapped_s(gather[s], st.forward_s / p.v, warm_up[s]);
    else
      exposed += gather[s];
    worst = std::max(worst, exposed);
  }
  return worst;
}

Estimate estimate(const models::ModelSpec& model, const traces::Trace& trace,
                  const clusters::Cluster& cluster, const Plan& plan) {
  check(plan);
  Plan p = plan;
  if (int(p.placement.size()) != p.ranks())
    throw PlanError("plan: placement: the plan is not placed");
  if (int(p.stage_blocks.size()) != p.virtual_stages())
    throw PlanError("plan: stage_blocks: the plan's stages are not resolved");
  const models::Sharding sharding{p.t, p.sp};
  traces::check_sharding(trace, sharding);
  const models::ModelCosts mc = models::derive_costs(model, sharding);  // checks t against it
  check_offload_cluster(cluster, p);
  if (p.offload_activations && p.activations.empty())
    set_activation_layers(p, choose_activations(model, trace, cluster, p));
  Estimate est;
  for (int s = 0; s < p.d; ++s)
    est.stages.push_back(stage_cost(model, mc, trace, cluster, p, s));
  // offload chunks (docs/formulas.md section 9, chunks): each stage its own schedule; its
  // moments' copies are exposed (each layer waits for its uploads, each upload for its moment's
  // evictions), the optimizer step is the schedule's, the memory its peak moment's.
  if (p.offload == Offload::chunks) {
    auto all = std::make_shared<const std::vector<ChunkSchedule>>(
        chunk_schedules(model, trace, cluster, p));
    for (int s = 0; s < p.d; ++s) {
      const ChunkSchedule& cs = (*all)[std::size_t(s)];
      StageCost& st = est.stages[std::size_t(s)];
      const ChunkMoment& peak = cs.peak();
      // Per microbatch (the stage's m forwards and backwards: the pipeline formulas give m times
      // these back).
      st.forward_s = cs.forward_s / p.m;
      st.backward_s = cs.backward_s / p.m;
      st.optimizer_s = cs.optimizer_s;
      st.allreduce_s = 0;  // w > 1: the gradients' sums are the optimizer step's (collective_s)
      st.allreduce_network_s = 0;
      st.memory = MemoryBreakdown{};
      st.memory.weights = peak.weight_bytes;
      st.memory.gradients = peak.gradient_bytes;
      st.memory.optimizer = bytes_mul(cs.device_adam_chunks, cs.layout.os_chunk_bytes);
      st.memory.workspace = cs.workspace_bytes;
      st.memory.activations = peak.non_model_bytes - cs.workspace_bytes;
    }
    est.chunks = std::move(all);
  }

  // Ranks sharing a GPU serialize their work: a GPU can finish no sooner than its summed compute.
  std::map<std::pair<int, int>, double> gpu_work;
  std::map<std::pair<int, int>, MemoryBreakdown> gpu_memory;
  for (int r = 0; r < p.ranks(); ++r) {
    const auto& st = est.stages[p.stage_of(r)];
    auto key = std::make_pair(p.placement[r].node, p.placement[r].gpu);
    gpu_work[key] += p.m * (st.forward_s + st.backward_s);
    gpu_memory[key] += st.memory;
  }
  est.pipeline_s = pipeline_time(p, est.stages);
  for (const auto& [gpu, work] : gpu_work)
    est.pipeline_s = std::max(est.pipeline_s, work);
  if (p.offload == Offload::optimizer) share_host_cpus(est.stages, cluster, p);
  est.allreduce_s = exposed_data_parallel_s(est.stages, cluster, p);
  if (est.chunks) {
    // Each op as long as its moments, each stage in its order (section 9, chunks); a stage's next
    // step starts start_s after stage 0's, once its optimizer step is done.
    std::vector<double> hops;  // one message (send_s is a microbatch's v of them)
    for (const StageCost& st : est.stages)
      hops.push_back(st.send_s / p.v);
    const ChunkPipeline run = chunk_pipeline(*est.chunks, p, hops);
    // Ranks sharing a GPU that are not one stage's replicas in lockstep (stages of a pipeline on
    // one GPU) serialize their compute: the GPU's summed compute bounds the step, as above.
    std::map<std::pair<int, int>, double> gpu_compute;
    double busiest = 0;
    for (int r = 0; r < p.ranks(); ++r) {
      double& g = gpu_compute[{p.placement[std::size_t(r)].node, p.placement[std::size_t(r)].gpu}];
      for (const ChunkMoment& m : (*est.chunks)[std::size_t(p.stage_of(r))].moments)
        g += m.compute_s + m.tp_s;  // the layers (device Adam is the optimizer step's)
      busiest = std::max(busiest, g);
    }
    double period = 0;
    for (int s = 0; s < p.d; ++s)
      period = std::max(period, run.end[std::size_t(s)] + est.stages[std::size_t(s)].optimizer_s -
                                    run.start[std::size_t(s)]);
    est.pipeline_s = std::max(run.makespan, busiest);
    est.optimizer_s = std::max(0.0, period - run.makespan);
  } else {
    for (const auto& st : est.stages)
      est.optimizer_s = std::max(est.optimizer_s, st.optimizer_s);
  }
  est.tied_s = tied_exchange_time(model, mc, cluster, p, est.stages);

  RunReport& rep = est.report;
  rep.source = "analytic";
  rep.model = model.name;
  rep.cluster = fmt::format("{}:{}", cluster.name, cluster.nodes);  // preset:nodes
  rep.plan = p;
  rep.iteration_time_s = est.pipeline_s + est.allreduce_s + est.tied_s + est.optimizer_s;
  set_throughput(rep, model, cluster, int(gpu_work.size()) * p.t);
  for (int r = 0; r < p.ranks(); ++r) {
    const auto& st = est.stages[p.stage_of(r)];
    DeviceReport d;
    d.rank = r;
    d.node = p.placement[r].node;
    d.gpu = p.placement[r].gpu;
    d.stage = p.stage_of(r);
    d.replica = p.replica_of(r);
    d.memory = st.memory;
    d.peak_memory_bytes = gpu_memory[{d.node, d.gpu}].total();
    d.capacity_bytes = cluster.device.memory_bytes;
    d.fits = d.peak_memory_bytes <= d.capacity_bytes;
    // Compute only, as the simulator and the executors count it: not the TP collectives. With
    // offload the optimizer step runs on the host: the device is not busy then.
    d.busy_s = p.m * (st.forward_s + st.backward_s - st.tp_s) +
               (p.offload == Offload::none ? st.optimizer_s : 0.0);
    if (est.chunks) {  // layers and device Adam, no copies, no TP collectives
      const ChunkSchedule& cs = (*est.chunks)[std::size_t(d.stage)];
      d.busy_s = cs.compute_s;
      for (const ChunkMoment& k : cs.moments)
        d.busy_s -= k.tp_s;
    }
    d.bubble_fraction = 1.0 - d.busy_s / rep.iteration_time_s;
    rep.devices.push_back(d);
  }
  if (est.chunks)
    add_chunk_report(rep, *est.chunks, cluster, p);
  else if (p.any_offload())
    add_offload_report(rep, est.stages, cluster, p);
  common::Json stages = common::Json::array();
  for (const auto& st : est.stages)
    stages.push_back({{"stage", st.stage},
                      {"blocks", st.blocks},
                      {"embedding", st.has_embedding},
                      {"head", st.has_head},
                      {"recompute", to_string(st.recompute)},
                      {"parameters", st.parameters},
                      {"forward_s", st.forward_s},
                      {"backward_s", st.backward_s},
                      {"optimizer_s", st.optimizer_s},
                      {"tp_s", st.tp_s},
                      {"send_s", st.send_s},
                      {"allreduce_s", st.allreduce_s},
                      {"in_flight_microbatches", st.in_flight},
                      {"stash_bytes_per_microbatch", st.stash_bytes},
                      {"selective_bytes_per_microbatch", st.selective_bytes},
                      {"input_bytes_per_microbatch", st.input_bytes}});
  rep.extra["estimate"] = {
      {"pipeline_s", est.pipeline_s},   {"allreduce_s", est.allreduce_s},    {"tied_s", est.tied_s},
      {"optimizer_s", est.optimizer_s}, {"trace_source", trace.source.kind}, {"stages", stages}};
  return est;
}

}  // namespace pw::planner
