// Schedule generators: a plan -> per-device programs (compute order, then communication around it).
#include <algorithm>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include <fmt/format.h>

#include "common/error.hpp"
#include "common/limits.hpp"
#include "planner/chunks.hpp"
#include "planner/program.hpp"

namespace pw::planner {

std::string to_string(OpKind kind) {
  switch (kind) {
    case OpKind::forward:
      return "forward";
    case OpKind::backward:
      return "backward";
    case OpKind::recompute:
      return "recompute";
    case OpKind::send_activation:
      return "send_activation";
    case OpKind::recv_activation:
      return "recv_activation";
    case OpKind::send_gradient:
      return "send_gradient";
    case OpKind::recv_gradient:
      return "recv_gradient";
    case OpKind::all_reduce:
      return "all_reduce";
    case OpKind::optimizer_step:
      return "optimizer_step";
    case OpKind::free_version:
      return "free_version";
    case OpKind::send_tied_gradient:
      return "send_tied_gradient";
    case OpKind::recv_tied_gradient:
      return "recv_tied_gradient";
    case OpKind::send_tied_weights:
      return "send_tied_weights";
    case OpKind::recv_tied_weights:
      return "recv_tied_weights";
    case OpKind::gather_tied_gradient:
      return "gather_tied_gradient";
    case OpKind::gather_tied_weights:
      return "gather_tied_weights";
    case OpKind::copy_gradient_to_host:
      return "copy_gradient_to_host";
    case OpKind::host_optimizer_step:
      return "host_optimizer_step";
    case OpKind::copy_parameters_to_device:
      return "copy_parameters_to_device";
    case OpKind::copy_activation_to_host:
      return "copy_activation_to_host";
    case OpKind::copy_activation_to_device:
      return "copy_activation_to_device";
    case OpKind::copy_chunk_to_host:
      return "copy_chunk_to_host";
    case OpKind::copy_chunk_to_device:
      return "copy_chunk_to_device";
    case OpKind::chunk_step_host:
      return "chunk_step_host";
    case OpKind::chunk_step_device:
      return "chunk_step_device";
  }
  return "unknown";
}

bool is_compute(OpKind kind) {
  return kind == OpKind::forward || kind == OpKind::backward || kind == OpKind::recompute;
}
bool is_send(OpKind kind) {
  return kind == OpKind::send_activation || kind == OpKind::send_gradient ||
         kind == OpKind::send_tied_gradient || kind == OpKind::send_tied_weights;
}
bool is_recv(OpKind kind) {
  return kind == OpKind::recv_activation || kind == OpKind::recv_gradient ||
         kind == OpKind::recv_tied_gradient || kind == OpKind::recv_tied_weights;
}
bool is_tied(OpKind kind) {
  return kind == OpKind::send_tied_gradient || kind == OpKind::recv_tied_gradient ||
         kind == OpKind::send_tied_weights || kind == OpKind::recv_tied_weights ||
         kind == OpKind::gather_tied_gradient || kind == OpKind::gather_tied_weights;
}
bool is_collective(OpKind kind) {
  return kind == OpKind::all_reduce || kind == OpKind::gather_tied_gradient ||
         kind == OpKind::gather_tied_weights;
}

bool is_offload(OpKind kind) {
  return kind == OpKind::copy_gradient_to_host || kind == OpKind::host_optimizer_step ||
         kind == OpKind::copy_parameters_to_device;
}

bool is_swap(OpKind kind) {
  return kind == OpKind::copy_activation_to_host || kind == OpKind::copy_activation_to_device;
}

bool is_chunk(OpKind kind) {
  return kind == OpKind::copy_chunk_to_host || kind == OpKind::copy_chunk_to_device ||
         kind == OpKind::chunk_step_host || kind == OpKind::chunk_step_device;
}

int offload_tiles(const Plan& plan, int stage, int chunk) {
  if (int(plan.stage_blocks.size()) != plan.virtual_stages())
    throw PlanError(
        "plan: stage_blocks: offload programs need the stages resolved against a "
        "model (one CPU Adam tile per layer)");
  const int vs = virtual_stage(plan, stage, chunk);
  return int(plan.stage_blocks[std::size_t(vs)]) + (vs == 0 ? 1 : 0) +
         (vs == plan.virtual_stages() - 1 ? 1 : 0);
}

int expected_version(const Plan& plan, int step, int microbatch) {
  if (plan.schedule != Schedule::two_bw) return step;
  const int k = global_microbatch(plan, step, microbatch);
  return std::max((k - 1) / plan.m - 1, 0);
}

int version_limit(const Plan& plan) {
  return plan.schedule == Schedule::two_bw ? 2 : 1;
}

std::string format_op(const Op& op, const Plan& plan) {
  const std::string mb =
      op.microbatch >= 0 ? std::to_string(global_microbatch(plan, op.step, op.microbatch)) : "";
  const std::string chunk = plan.v > 1 ? "." + std::to_string(op.chunk) : "";
  const std::string peer = std::to_string(op.peer);
  switch (op.kind) {
    case OpKind::forward:
      return "F" + mb + chunk;
    case OpKind::backward:
      return "B" + mb + chunk;
    case OpKind::recompute:
      return "R" + mb + chunk;
    case OpKind::send_activation:
      return "sendA" + mb + chunk + "->" + peer;
    case OpKind::recv_activation:
      return "recvA" + mb + chunk + "<-" + peer;
    case OpKind::send_gradient:
      return "sendG" + mb + chunk + "->" + peer;
    case OpKind::recv_gradient:
      return "recvG" + mb + chunk + "<-" + peer;
    case OpKind::all_reduce:
      return "AR" + std::to_string(op.bucket) + chunk;
    case OpKind::optimizer_step:
      return "opt(v" + std::to_string(op.version) + ")";
    case OpKind::free_version:
      return "free(v" + std::to_string(op.version) + ")";
    case OpKind::send_tied_gradient:
      return "sendTG->" + peer;
    case OpKind::recv_tied_gradient:
      return "recvTG<-" + peer;
    case OpKind::send_tied_weights:
      return "sendTW(v" + std::to_string(op.version) + ")->" + peer;
    case OpKind::recv_tied_weights:
      return "recvTW(v" + std::to_string(op.version) + ")<-" + peer;
    case OpKind::gather_tied_gradient:
      return "AGTG";
    case OpKind::gather_tied_weights:
      return "AGTW(v" + std::to_string(op.version) + ")";
    case OpKind::copy_gradient_to_host:
      if (op.microbatch >= 0) return "D2H" + mb + chunk;
      return plan.offload_sharded() ? "D2H(shard" + chunk + ")" : "D2H(tied)";
    case OpKind::host_optimizer_step:
      return "hostopt" + std::to_string(op.bucket) + chunk + "(v" + std::to_string(op.version) +
             ")";
    case OpKind::copy_parameters_to_device:
      return "H2D" + std::to_string(op.bucket) + chunk + "(v" + std::to_string(op.version) + ")";
    case OpKind::copy_activation_to_host:
      return "A2H" + mb + chunk;
    case OpKind::copy_activation_to_device:
      return "A2D" + mb + chunk;
    case OpKind::copy_chunk_to_host:
    case OpKind::copy_chunk_to_device:
      return (op.kind == OpKind::copy_chunk_to_host ? "C2H" : "C2D") +
             std::string(op.part ? "p" : "") + std::to_string(op.bucket) +
             (op.layer >= 0 ? "@" + std::to_string(op.layer) : "");
    case OpKind::chunk_step_host:
      return "hostadam" + std::to_string(op.bucket) + "(v" + std::to_string(op.version) + ")";
    case OpKind::chunk_step_device:
      return "adam" + std::to_string(op.bucket) + "(v" + std::to_string(op.version) + ")";
  }
  return "?";
}

std::int64_t total_ops(const Programs& programs) {
  std::int64_t n = 0;
  for (const auto& device : programs.devices)
    n += std::int64_t(device.ops.size());
  return n;
}

namespace {

// One compute slot of a schedule, before communication is added around it.
using Slot = ComputeSlot;

// The one-forward-one-backward pattern over n forwards: `warmup` forwards, then pairs (forward
// warmup+j, backward j), then the remaining backwards. Returns (is_backward, index) pairs.
std::vector<std::pair<bool, int>> one_f_one_b_pattern(int n, int warmup) {
  std::vector<std::pair<bool, int>> order;
  order.reserve(2 * std::size_t(n));
  for (int i = 0; i < warmup; ++i)
    order.emplace_back(false, i);
  for (int j = 0; j + warmup < n; ++j) {
    order.emplace_back(false, warmup + j);
    order.emplace_back(true, j);
  }
  for (int j = n - warmup; j < n; ++j)
    order.emplace_back(true, j);
  return order;
}

// GPipe: all m forwards, then all m backwards.
std::vector<Slot> gpipe_step(const Plan& plan, int step) {
  std::vector<Slot> slots;
  for (int mb = 0; mb < plan.m; ++mb)
    slots.push_back({false, step, mb, 0});
  for (int mb = 0; mb < plan.m; ++mb)
    slots.push_back({true, step, mb, 0});
  return slots;
}

// PipeDream-Flush (and dp, d == 1): min(d-s-1, m) warm-up forwards, 1F1B, cool-down backwards.
std::vector<Slot> one_f_one_b_step(const Plan& plan, int stage, int step) {
  std::vector<Slot> slots;
  for (auto [backward, i] : one_f_one_b_pattern(plan.m, std::min(plan.d - stage - 1, plan.m))) {
    slots.push_back({backward, step, i, 0});
  }
  return slots;
}

// Megatron interleaved: the i-th forward runs chunk (i/d)%v of microbatch (i/(d*v))*d + i%d; the
// i-th backward runs chunk v-1-(i/d)%v of the same microbatch. Warm-up (d-s-1)*2 + (v-1)*d.
std::vector<Slot> interleaved_step(const Plan& plan, int stage, int step) {
  const int d = plan.d, v = plan.v, n = plan.m * plan.v;
  const int warmup = std::min((d - stage - 1) * 2 + (v - 1) * d, n);
  std::vector<Slot> slots;
  for (auto [backward, i] : one_f_one_b_pattern(n, warmup)) {
    const int mb = (i / (d * v)) * d + i % d;
    const int chunk = backward ? v - 1 - (i / d) % v : (i / d) % v;
    slots.push_back({backward, step, mb, chunk});
  }
  return slots;
}

// PipeDream-2BW: one continuous 1F1B stream over steps*m microbatches (no flush).
std::vector<Slot> two_bw_stream(const Plan& plan, int stage, int first_step, int steps) {
  const int n = steps * plan.m;
  std::vector<Slot> slots;
  for (auto [backward, k] : one_f_one_b_pattern(n, std::min(plan.d - stage - 1, n))) {
    slots.push_back({backward, first_step + k / plan.m, k % plan.m, 0});
  }
  return slots;
}

// Appends the ops of one device: communication around compute, per-step tails.
class ProgramBuilder {
 public:
  ProgramBuilder(const Plan& plan, int first_step, int steps, int buckets, bool tied,
                 Program& program, const ChunkSchedule* chunks = nullptr)
      : plan_(plan),
        buckets_(buckets),
        tied_(tied),
        program_(program),
        chunks_(chunks),
        first_step_(first_step),
        steps_(steps),
        segment_step_(first_step) {}

  // `out`: the forward's stash goes to the host; `prefetch`: a stash to bring back first.
  void compute(const Slot& slot, bool out = false, const Slot* prefetch = nullptr) {
    const int s = program_.stage, d = plan_.d;
    if (prefetch) add(OpKind::copy_activation_to_device, *prefetch, -1);
    const int vs = virtual_stage(plan_, s, slot.chunk);
    const bool first = vs == 0, last = vs == plan_.virtual_stages() - 1;
    const int prev = peer((s - 1 + d) % d), next = peer((s + 1) % d);
    const int version = expected_version(plan_, slot.step, slot.microbatch);
    if (!slot.backward) {
      if (!first) add(OpKind::recv_activation, slot, prev);
      if (tied_last() && slot.chunk == plan_.v - 1) receive_tied_weights(slot.step, version);
      if (chunks_) chunk_copies(slot);  // right before the compute op they serve
      add(OpKind::forward, slot, -1, version);
      if (!last) add(OpKind::send_activation, slot, next);
      if (out) add(OpKind::copy_activation_to_host, slot, -1);
      return;
    }
    if (!last) add(OpKind::recv_gradient, slot, next);
    if (plan_.has_recompute_op(s)) {
      if (chunks_) chunk_copies(slot, true);  // the recompute op's layers need their chunks too
      add(OpKind::recompute, slot, -1, version);
    }
    if (chunks_) chunk_copies(slot);
    add(OpKind::backward, slot, -1, version);
    if (!first) add(OpKind::send_gradient, slot, prev);
    if (offload() && !plan_.offload_sharded()) add(OpKind::copy_gradient_to_host, slot, -1);
  }

  // Gradient all-reduce (w > 1; with chunks each chunk's Adam op reduce-scatters its gradient),
  // then the weight update creating version step+1. Flush schedules free the step's version
  // first; 2BW frees the shadow version step-1, whose last user is done.
  void step_tail(int step) {
    if (plan_.w > 1 && !chunks_) {
      for (int chunk = plan_.v - 1; chunk >= 0; --chunk) {
        for (int bucket = 0; bucket < buckets_; ++bucket) {
          Op op{OpKind::all_reduce, step, -1, chunk, -1, -1, bucket};
          program_.ops.push_back(op);
        }
      }
    }
    // The tied embedding (stage 0, chunk 0) owns the update; the LM head's copy (stage d-1,
    // chunk v-1) sends its gradient there and gets the new weights back. With w > 1 the
    // gradient is the same on every replica after the all-reduce: each replica sends only its
    // shard, and stage 0's replicas gather the shards among themselves.
    const int v = plan_.v, d = plan_.d;
    if (tied_last())
      program_.ops.push_back(Op{OpKind::send_tied_gradient, step, -1, v - 1, peer(0), -1, -1});
    if (tied_first()) {
      program_.ops.push_back(Op{OpKind::recv_tied_gradient, step, -1, 0, peer(d - 1), -1, -1});
      if (plan_.w > 1)
        program_.ops.push_back(Op{OpKind::gather_tied_gradient, step, -1, 0, -1, -1, -1});
    }
    if (offload()) host_step(step);
    if (chunks_) chunk_steps(step);
    const int freed = plan_.schedule == Schedule::two_bw ? step - 1 : step;
    if (freed >= 0) program_.ops.push_back(Op{OpKind::free_version, step, -1, 0, -1, freed, -1});
    program_.ops.push_back(Op{OpKind::optimizer_step, step, -1, 0, -1, step + 1, -1});
    if (tied_first())
      program_.ops.push_back(Op{OpKind::send_tied_weights, step, -1, 0, peer(d - 1), step + 1, -1});
    if (tied_last()) unreceived_.push_back(step + 1);
  }

  // After the last step: the versions no op used still arrive, so every send has its receive.
  void finish(int last_step) { receive_tied_weights(last_step, -1); }

 private:
  int peer(int stage) const { return plan_.rank_of(stage, program_.replica); }
  bool offload() const { return plan_.offload == Offload::optimizer; }

  // Chunks (the stage's own schedule: each compute op holds the stage's layers): the copies of
  // each of its moments (the op's index in the stage's step, its layers in order), tagged with
  // the moment's layer. `recompute`: those of the recompute op before the backward of the slot
  // (the backward's come after it and advance the index).
  void chunk_copies(const Slot& slot, bool recompute = false) {
    const int index = recompute ? chunk_slot_ : chunk_slot_++;
    const int t = segment_step_;
    for (const ChunkMoment& m : chunks_->moments_of(first_step_, steps_, t)) {
      if (m.slot != index || m.recompute != recompute) continue;
      for (const ChunkCopy& c : m.copies) {
        Op op{c.to_device ? OpKind::copy_chunk_to_device : OpKind::copy_chunk_to_host,
              slot.step,
              slot.microbatch,
              slot.chunk,
              -1,
              -1,
              chunks_->unit_in(c.unit, t)};
        op.layer = m.layer;
        op.part = c.part;
        program_.ops.push_back(op);
      }
    }
  }

  // The optimizer step of the chunks: each host-Adam chunk (to the host first when it ended the
  // backward on the device) on the host CPU, then the device-Adam chunks on the device.
  // With 2bw a chunk's parts on the device go down one by one (those of the segment's plan).
  void chunk_steps(int step) {
    const std::vector<bool>& down = chunks_->adam_download_of(first_step_, steps_, step);
    chunk_slot_ = 0;
    ++segment_step_;
    const int n = chunks_->layout.chunks(), parts = chunks_->layout.parts;
    // A sharded chunk on the device goes down as its gradient's part (reduce-scattered there); with
    // 2bw its versions' slots are dropped.
    for (int c = chunks_->device_adam_chunks; c < n; ++c) {
      const bool sharded = chunks_->layout.is_sharded(c);
      bool part = false;
      for (int u = c * parts; u < (c + 1) * parts; ++u)
        if (down[std::size_t(u)]) {
          Op op{OpKind::copy_chunk_to_host, step, -1, 0, -1, -1, chunks_->unit_in(u, step)};
          op.part = sharded;  // 2bw: a version's slot dropped, the gradient part's part down
          if (u == chunks_->layout.gradient_unit(c)) part = sharded;
          program_.ops.push_back(op);
        }
      Op adam{OpKind::chunk_step_host, step, -1, 0, -1, step + 1, c};
      adam.part = part;
      program_.ops.push_back(adam);
    }
    for (int c = 0; c < chunks_->device_adam_chunks; ++c)
      program_.ops.push_back(Op{OpKind::chunk_step_device, step, -1, 0, -1, step + 1, c});
  }

  // Optimizer offload: stage 0's tied gradient (summed on the device by the tied exchange) goes
  // out too; then CPU Adam tile by tile, each tile's new parameters copied back behind it. With
  // w > 1 (sharded) the backwards copied nothing: each chunk's shard of the reduce-scattered
  // gradient goes out now (stage 0's holds the tied tensor's share), and the device's
  // optimizer_step all-gathers the new parameters.
  void host_step(int step) {
    if (plan_.offload_sharded()) {
      for (int chunk = 0; chunk < plan_.v; ++chunk)
        program_.ops.push_back(Op{OpKind::copy_gradient_to_host, step, -1, chunk, -1, -1, -1});
    } else if (tied_first()) {
      program_.ops.push_back(Op{OpKind::copy_gradient_to_host, step, -1, 0, -1, -1, -1});
    }
    for (int chunk = 0; chunk < plan_.v; ++chunk)
      for (int tile = 0; tile < offload_tiles(plan_, program_.stage, chunk); ++tile) {
        program_.ops.push_back(
            Op{OpKind::host_optimizer_step, step, -1, chunk, -1, step + 1, tile});
        program_.ops.push_back(
            Op{OpKind::copy_parameters_to_device, step, -1, chunk, -1, step + 1, tile});
      }
  }
  bool tied_first() const { return tied_ && plan_.d > 1 && program_.stage == 0; }
  bool tied_last() const { return tied_ && plan_.d > 1 && program_.stage == plan_.d - 1; }

  // Receives the tied weights of every version up to `version` (all when -1) not received yet;
  // with w > 1 each received shard is gathered over the replicas at once.
  void receive_tied_weights(int step, int version) {
    while (!unreceived_.empty() && (version < 0 || unreceived_.front() <= version)) {
      const int v = unreceived_.front();
      program_.ops.push_back(Op{OpKind::recv_tied_weights, step, -1, plan_.v - 1, peer(0), v, -1});
      if (plan_.w > 1)
        program_.ops.push_back(Op{OpKind::gather_tied_weights, step, -1, plan_.v - 1, -1, v, -1});
      unreceived_.erase(unreceived_.begin());
    }
  }

  void add(OpKind kind, const Slot& slot, int peer, int version = -1) {
    program_.ops.push_back(Op{kind, slot.step, slot.microbatch, slot.chunk, peer, version, -1});
  }

  const Plan& plan_;
  int buckets_;
  bool tied_;
  Program& program_;
  const ChunkSchedule* chunks_;
  int first_step_ = 0, steps_ = 1;  // the run's
  int chunk_slot_ = 0;              // chunks: compute ops of the current step (segment) so far
  int segment_step_ = 0;            // chunks: the step whose optimizer step ends the segment
  std::vector<int> unreceived_;     // tied weight versions created here, not yet received
};

// The compute slots in order, with their activation swaps.
void run_slots(const Plan& plan, int stage, const std::vector<Slot>& slots, ProgramBuilder& builder,
               bool two_bw_tails) {
  const SwapPlan sp = swap_plan(plan, stage, slots);
  for (std::size_t i = 0; i < slots.size(); ++i) {
    const Slot& slot = slots[i];
    const int pf = sp.prefetch.empty() ? -1 : sp.prefetch[i];
    builder.compute(slot, !sp.out.empty() && sp.out[i],
                    pf >= 0 ? &slots[std::size_t(pf)] : nullptr);
    if (two_bw_tails && slot.backward && slot.microbatch == plan.m - 1)
      builder.step_tail(slot.step);
  }
}

void generate_device(const Plan& plan, int first_step, int steps, int buckets, bool tied,
                     Program& program, const ChunkSchedule* chunks) {
  ProgramBuilder builder(plan, first_step, steps, buckets, tied, program, chunks);
  const int s = program.stage;
  if (plan.schedule == Schedule::two_bw) {
    run_slots(plan, s, two_bw_stream(plan, s, first_step, steps), builder, true);
    builder.finish(first_step + steps - 1);
    return;
  }
  for (int step = first_step; step < first_step + steps; ++step) {
    std::vector<Slot> slots;
    switch (plan.schedule) {
      case Schedule::gpipe:
        slots = gpipe_step(plan, step);
        break;
      case Schedule::interleaved:
        slots = interleaved_step(plan, s, step);
        break;
      default:
        slots = one_f_one_b_step(plan, s, step);
        break;
    }
    run_slots(plan, s, slots, builder, false);
    builder.step_tail(step);
  }
  builder.finish(first_step + steps - 1);
}

}  // namespace

std::vector<ComputeSlot> step_compute_order(const Plan& plan, int stage, int step) {
  switch (plan.schedule) {
    case Schedule::gpipe:
      return gpipe_step(plan, step);
    case Schedule::interleaved:
      return interleaved_step(plan, stage, step);
    default:
      return one_f_one_b_step(plan, stage, step);
  }
}

std::vector<ComputeSlot> run_compute_order(const Plan& plan, int stage, int steps, int first_step) {
  if (plan.schedule == Schedule::two_bw) return two_bw_stream(plan, stage, first_step, steps);
  std::vector<ComputeSlot> order;
  for (int step = first_step; step < first_step + steps; ++step) {
    const std::vector<ComputeSlot> one = step_compute_order(plan, stage, step);
    order.insert(order.end(), one.begin(), one.end());
  }
  return order;
}

SwapPlan swap_plan(const Plan& plan, int stage, const std::vector<ComputeSlot>& order) {
  SwapPlan sp;
  if (!plan.swaps(stage)) return sp;
  sp.out.assign(order.size(), false);
  sp.prefetch.assign(order.size(), -1);
  sp.forward_of.assign(order.size(), -1);
  std::map<std::tuple<int, int, int>, int> forward;  // (step, microbatch, chunk) -> slot
  // Per-layer choices: a chunk none of whose blocks swap has nothing to copy (its units stay).
  std::vector<bool> chunk_swaps(std::size_t(plan.v), true);
  if (plan.mixed_activations(stage)) {
    const std::vector<ActivationChoice> layers = layer_choices(plan, stage);
    std::size_t at = 0;
    for (int c = 0; c < plan.v; ++c) {
      const auto n = std::size_t(plan.stage_blocks[std::size_t(c * plan.d + stage)]);
      chunk_swaps[std::size_t(c)] =
          std::find(layers.begin() + std::ptrdiff_t(at), layers.begin() + std::ptrdiff_t(at + n),
                    ActivationChoice::swap) != layers.begin() + std::ptrdiff_t(at + n);
      at += n;
    }
  }
  for (int i = 0; i < int(order.size()); ++i) {
    const ComputeSlot& c = order[std::size_t(i)];
    const auto key = std::make_tuple(c.step, c.microbatch, c.chunk);
    if (!c.backward) {
      forward[key] = i;
      continue;
    }
    auto it = forward.find(key);
    if (it == forward.end()) continue;  // its forward is before this order (resumed 2bw)
    const int f = it->second;
    sp.forward_of[std::size_t(i)] = f;
    if (i - f - 1 >= kSwapGap && chunk_swaps[std::size_t(c.chunk)]) {
      sp.out[std::size_t(f)] = true;
      sp.prefetch[std::size_t(i - 1)] = i;
    }
    forward.erase(it);
  }
  return sp;
}

std::vector<int> initial_versions(const Plan& plan, int first_step) {
  if (plan.schedule == Schedule::two_bw && first_step > 0) return {first_step - 1, first_step};
  return {first_step};
}

Programs generate_programs(const Plan& plan, int steps, int gradient_buckets, int first_step) {
  return generate_programs(plan, ProgramOptions{steps, gradient_buckets, first_step, false, {}});
}

Programs generate_programs(const Plan& plan, const ProgramOptions& options) {
  const int steps = options.steps, gradient_buckets = options.gradient_buckets,
            first_step = options.first_step;
  check(plan);
  if (steps < 1)
    throw PlanError("generate_programs: steps must be >= 1, got " + std::to_string(steps));
  if (first_step < 0)
    throw PlanError("generate_programs: first_step must be >= 0, got " +
                    std::to_string(first_step));
  if (gradient_buckets < 1) {
    throw PlanError("generate_programs: gradient_buckets must be >= 1, got " +
                    std::to_string(gradient_buckets));
  }
  // Refuse, before allocating, a run whose programs would pass kMaxProgramOps. Per rank and step:
  // at most 8 ops per (microbatch, chunk) (forward, backward, recompute, sends, receives) and 2 per
  // gradient bucket plus a few for the optimizer step and tied weights. In double: no overflow.
  // Offload adds a copy per (microbatch, chunk) and two ops per CPU Adam tile (a layer).
  double offload_ops = 0;
  if (plan.offload == Offload::optimizer) {
    for (int s = 0; s < plan.d; ++s) {
      double tiles = 0;
      for (int c = 0; c < plan.v; ++c)
        tiles += offload_tiles(plan, s, c);
      offload_ops = std::max(offload_ops, double(plan.m) * plan.v + 2.0 * tiles + 1.0);
    }
  }
  if (plan.offload_activations) offload_ops += 2.0 * plan.m * plan.v;
  if (plan.offload == Offload::chunks) {
    if (!options.chunks)
      throw PlanError(
          "plan: offload chunks: programs need the chunk schedule, made from a model and a "
          "cluster (estimate and simulate make it; schedule cannot)");
    if (int(options.chunks->size()) != plan.d ||
        int(plan.stage_blocks.size()) != plan.virtual_stages())
      throw PlanError("plan: offload chunks: the chunk schedule is of another plan");
    double most = 0;
    for (int s = 0; s < plan.d; ++s) {
      const ChunkSchedule& cs = (*options.chunks)[std::size_t(s)];
      std::int64_t layers = 0;  // its model chunks' blocks, the embedding and the head
      for (int vs = s; vs < plan.virtual_stages(); vs += plan.d)
        layers += plan.stage_blocks[std::size_t(vs)] + (vs == 0 ? 1 : 0) +
                  (vs == plan.virtual_stages() - 1 ? 1 : 0);
      if (cs.layout.layers() != int(layers) || cs.layout.stage != s)
        throw PlanError("plan: offload chunks: the chunk schedule is of another model");
      // Per step: the moments' copies (at most one per unit and moment each way; 2bw: the
      // segment with the most) and two ops per unit at the optimizer step.
      double copies = cs.uploads + cs.downloads + cs.drops;  // drops: sharded chunks
      for (const ChunkSegmentPlan& g : cs.segments) {
        double here = 0;
        for (const ChunkMoment& m : g.moments)
          here += double(m.copies.size());
        copies = std::max(copies, here + cs.layout.units());
      }
      most = std::max(most, copies + 2.0 * cs.layout.units());
    }
    offload_ops += most;
  }
  const double ops_bound =
      double(plan.ranks()) * double(steps) *
      (8.0 * double(plan.m) * double(plan.v) + 2.0 * gradient_buckets + 8.0 + offload_ops);
  if (ops_bound > double(common::kMaxProgramOps))
    throw PlanError(fmt::format(
        "plan: w*d = {} ranks x {} steps x m = {}{} would make about {:.3g} ops, more than the "
        "limit of {} (docs/formats.md, Limits): use fewer microbatches, ranks or steps",
        plan.ranks(), steps, plan.m, plan.v > 1 ? fmt::format(" x v = {}", plan.v) : "", ops_bound,
        common::kMaxProgramOps));
  Programs programs{plan, steps, first_step, options.tied_embeddings, gradient_buckets, {}, {}};
  if (plan.offload == Offload::chunks) programs.chunks = options.chunks;
  programs.devices.resize(std::size_t(plan.ranks()));
  for (int rank = 0; rank < plan.ranks(); ++rank) {
    Program& program = programs.devices[std::size_t(rank)];
    program.rank = rank;
    program.stage = plan.stage_of(rank);
    program.replica = plan.replica_of(rank);
    generate_device(
        plan, first_step, steps, gradient_buckets, options.tied_embeddings, program,
        plan.offload == Offload::chunks ? &(*options.chunks)[std::size_t(program.stage)] : nullptr);
  }
  return programs;
}

}  // namespace pw::planner
