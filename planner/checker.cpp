// Schedule checker: per-device invariants of a set of programs, then the abstract run.
#include "planner/checker.hpp"

#include <algorithm>
#include <string>

#include "planner/chunks.hpp"
#include "planner/op_errors.hpp"

namespace pw::planner {

using detail::fail;
using detail::in_range;

int stash_limit(const Plan& plan) {
  switch (plan.schedule) {
    case Schedule::gpipe:
      return plan.m;
    case Schedule::interleaved:
      return plan.m * plan.v;
    default:
      return plan.d;
  }
}

namespace {

enum Flag : std::uint8_t {
  kRecvA = 1,
  kForward = 2,
  kSentA = 4,
  kRecvG = 8,
  kRecompute = 16,
  kBackward = 32,
  kSentG = 64,
  kCopiedOut = 128,  // offload: the slot's gradients copied to the host
};
enum SwapFlag : std::uint8_t {
  kSwapOut = 1,  // activation offload: the stash copied to the host
  kSwapIn = 2,   // and back to the device
};

// Walks one device's program in order and checks the per-device invariants.
class DeviceChecker {
 public:
  DeviceChecker(const Programs& p, int rank)
      : p_(p), plan_(p.plan), prog_(p.devices[std::size_t(rank)]) {
    const std::size_t slots = std::size_t(p.steps) * std::size_t(plan_.m) * std::size_t(plan_.v);
    flags_.assign(slots, 0);
    swap_flags_.assign(slots, 0);
    version_of_.assign(slots, -1);
    live_.assign(std::size_t(p.first_step + p.steps) + 2, 0);
    for (int version : initial_versions(plan_, p.first_step))
      live_[std::size_t(version)] = 1;
    live_count_ = max_live_ = int(initial_versions(plan_, p.first_step).size());
    users_.assign(live_.size(), 0);
    backwards_.assign(std::size_t(p.steps) * std::size_t(plan_.v), 0);
    all_reduces_.assign(std::size_t(p.steps), 0);
    tied_gradient_.assign(std::size_t(p.steps), 0);
    tied_weights_.assign(live_.size(), 0);
    copied_out_.assign(std::size_t(p.steps), 0);
    tied_copied_.assign(std::size_t(p.steps), 0);
    steps_done_ = 0;
    if (offload()) {
      for (int c = 0; c < plan_.v; ++c)
        tiles_ += offload_tiles(plan_, prog_.stage, c);
    }
    if (plan_.offload == Offload::chunks) {
      if (!p.chunks) throw ScheduleError("offload chunks programs without their chunk schedule");
      if (int(p.chunks->size()) != plan_.d)
        throw ScheduleError("offload chunks programs without a chunk schedule per stage");
      chunks_ = &(*p.chunks)[std::size_t(prog_.stage)];
      on_device_ = chunks_->start_on_device;
      stepped_.assign(std::size_t(chunks_->layout.chunks()), 0);
      dirty_.assign(std::size_t(chunks_->layout.chunks()), 0);
      reduced_.assign(std::size_t(chunks_->layout.chunks()), 0);
      if (int(on_device_.size()) != chunks_->layout.units())
        throw ScheduleError("offload chunks programs with a chunk schedule of another layout");
    }
  }

  DeviceCheck run() {
    for (index_ = 0; index_ < prog_.ops.size(); ++index_)
      visit(prog_.ops[index_]);
    check_complete();
    return {prog_.rank, max_stash_, max_live_, std::int64_t(prog_.ops.size())};
  }

 private:
  [[noreturn]] void bad(const std::string& what) const { fail(p_, prog_.rank, index_, what); }
  int vs(const Op& op) const { return virtual_stage(plan_, prog_.stage, op.chunk); }
  bool first(const Op& op) const { return vs(op) == 0; }
  bool last(const Op& op) const { return vs(op) == plan_.virtual_stages() - 1; }
  std::uint8_t& flags(const Op& op) { return flags_[slot(op)]; }
  // Step index within the programs (ops carry global steps).
  std::size_t local(int step) const { return std::size_t(step - p_.first_step); }
  std::size_t slot(const Op& op) const {
    return (local(op.step) * std::size_t(plan_.m) + std::size_t(op.microbatch)) *
               std::size_t(plan_.v) +
           std::size_t(op.chunk);
  }

  void require(const Op& op, std::uint8_t need, const std::string& what) {
    if ((flags(op) & need) != need) bad(what);
  }
  void set_once(const Op& op, std::uint8_t flag, const std::string& what) {
    if (flags(op) & flag) bad(what + " twice");
    flags(op) |= flag;
  }

  void visit(const Op& op) {
    if (!in_range(op.step - p_.first_step, p_.steps) || !in_range(op.chunk, plan_.v)) {
      bad("step or chunk out of range");
    }
    if (op.kind == OpKind::all_reduce && !in_range(op.bucket, p_.buckets)) {
      bad("bucket out of range");
    }
    if (!pending_.empty() && !is_chunk(op.kind) && !is_compute(op.kind))
      bad(to_string(op.kind) + " between chunk copies and the compute op they precede");
    if (is_tied(op.kind)) return tied(op);
    if (is_offload(op.kind)) return offload_op(op);
    if (is_chunk(op.kind)) return chunk_op(op);
    if (op.microbatch >= 0 || is_compute(op.kind) || is_send(op.kind) || is_recv(op.kind)) {
      if (!in_range(op.microbatch, plan_.m)) bad("microbatch out of range");
    }
    switch (op.kind) {
      case OpKind::recv_activation:
        if (first(op)) bad("receives an activation at the first virtual stage");
        return set_once(op, kRecvA, "activation received");
      case OpKind::forward:
        return forward(op);
      case OpKind::send_activation:
        if (last(op)) bad("sends an activation from the last virtual stage");
        require(op, kForward, "sends an activation before its forward");
        return set_once(op, kSentA, "activation sent");
      case OpKind::recv_gradient:
        if (last(op)) bad("receives a gradient at the last virtual stage");
        require(op, kForward, "receives a gradient before its forward");
        return set_once(op, kRecvG, "gradient received");
      case OpKind::recompute:
        return recompute(op);
      case OpKind::backward:
        return backward(op);
      case OpKind::send_gradient:
        if (first(op)) bad("sends a gradient from the first virtual stage");
        require(op, kBackward, "sends a gradient before its backward");
        return set_once(op, kSentG, "gradient sent");
      case OpKind::all_reduce:
        return all_reduce(op);
      case OpKind::optimizer_step:
        return optimizer_step(op);
      case OpKind::free_version:
        return free_version(op);
      case OpKind::copy_activation_to_host:
      case OpKind::copy_activation_to_device:
        return swap(op);
      default:
        return;  // tied ops: above
    }
  }

  bool offload() const { return plan_.offload == Offload::optimizer; }

  // Chunks: a copy with a layer waits for the next compute op and runs right before that layer;
  // one without (the optimizer step's) runs at once. An upload needs the chunk on the host, an
  // eviction the chunk on the device and not used by its layer.
  void chunk_op(const Op& op) {
    const std::string name = to_string(op.kind);
    if (!chunks_) bad(name + " in a plan without offload chunks");
    const bool copy =
        op.kind == OpKind::copy_chunk_to_host || op.kind == OpKind::copy_chunk_to_device;
    // A copy moves a unit (with 2bw a chunk's part), an Adam step a chunk.
    const int n = copy ? chunks_->layout.units() : chunks_->layout.chunks();
    if (!in_range(op.bucket, n))
      bad(name + " of " + unit_name(copy) + " " + std::to_string(op.bucket) + ", out of range (" +
          std::to_string(n) + " " + unit_name(copy) + "s)");
    if (copy && op.layer >= 0) {
      if (!in_range(op.layer, chunks_->layout.layers())) bad(name + " before a layer out of range");
      pending_.push_back(op);
      return;
    }
    if (!pending_.empty()) bad(name + " while chunk copies wait for a compute op");
    if (copy) return move_chunk(op);
    if (op.microbatch != -1) bad(name + " with a microbatch");
    if (op.step != p_.first_step + steps_done_) bad(name + " out of step order");
    if (op.version != op.step + 1) bad(name + " must create version step+1");
    if (backwards_of(op.step, 0) != plan_.m) bad(name + " before the step's backward");
    const bool host = op.kind == OpKind::chunk_step_host;
    const int c = op.bucket;
    if (host == chunks_->device_resident(c))
      bad(name + " of chunk " + std::to_string(c) + ", whose optimizer state is on the " +
          (host ? "device" : "host"));
    const int parts = chunks_->layout.parts;
    for (int u = c * parts; u < (c + 1) * parts; ++u)
      if (host == bool(on_device_[std::size_t(u)]))
        bad(name + " of chunk " + std::to_string(c) + " while it" +
            (parts > 1 ? " (part " + std::to_string(u % parts) + ")" : std::string()) +
            " is on the " + (host ? "device" : "host"));
    if (stepped_[std::size_t(c)]++) bad(name + " of chunk " + std::to_string(c) + " twice");
    // Sharded chunks: CPU Adam after the gradient's part came down (op.part), or of the whole
    // chunk the step's moments left on the host with its gradient.
    const ChunkLayout& L = chunks_->layout;
    if (op.part && (!host || !L.is_sharded(c) || !reduced_[std::size_t(c)]))
      bad(name + " of chunk " + std::to_string(c) + " as a reduce-scattered part, but " +
          (!host || !L.is_sharded(c) ? std::string("the chunk is not sharded")
                                     : std::string("no part of its gradient came down")));
    if (!op.part && host && L.is_sharded(c) &&
        (reduced_[std::size_t(c)] || !dirty_[std::size_t(c)]))
      bad(name + " of sharded chunk " + std::to_string(c) + " as a whole, but " +
          (reduced_[std::size_t(c)] ? "its gradient's part came down"
                                    : "it has no gradient on the host"));
  }

  // "chunk", or with 2bw (a copy moves one of a chunk's three parts) "chunk part".
  std::string unit_name(bool copy) const {
    return copy && chunks_->layout.parts > 1 ? "chunk part" : "chunk";
  }

  // Sharded chunks (ChunkLayout::sharded): before the chunk has a gradient in the step (its first
  // backward layer) it (with 2bw its gradient part) moves as the replica's part, a drop on the way
  // down; after, whole; at the optimizer step its gradient's part goes down. With 2bw a weight
  // version's slot always moves as its part. An unsharded chunk never moves as a part.
  void move_chunk(const Op& op) {
    const bool up = op.kind == OpKind::copy_chunk_to_device;
    const std::string name =
        to_string(op.kind) + " of " + unit_name(true) + " " + std::to_string(op.bucket);
    auto here = on_device_[std::size_t(op.bucket)];
    if (bool(here) == up) bad(name + ", already on the " + (up ? "device" : "host"));
    on_device_[std::size_t(op.bucket)] = up;
    const ChunkLayout& L = chunks_->layout;
    const int c = op.bucket / L.parts;
    if (!L.is_sharded(c)) {
      if (op.part) bad(name + " as a part, but the chunk is not sharded");
      return;
    }
    if (L.version_unit(op.bucket)) {
      if (!op.part) bad(name + " whole, but a sharded chunk's weight version moves as its part");
      return;
    }
    const bool dirty = dirty_[std::size_t(c)];
    if (op.layer < 0) {  // the optimizer step's download
      if (!op.part) bad(name + " whole at the optimizer step, but the chunk is sharded");
      reduced_[std::size_t(c)] = 1;
      return;
    }
    if (op.part && dirty)
      bad(name + (up ? " as a part" : " dropped") + ", but it holds a gradient (" +
          (up ? "whole on the host" : "it must go down whole") + ")");
    if (!op.part && !dirty)
      bad(name + " whole, but it has no gradient yet (" +
          (up ? "its host holds only the replica's part" : "it is dropped, not copied") + ")");
  }

  // A compute op's layers in order (forward and recompute ascending, backward descending): each
  // layer's copies, then its chunks must be on the device and the resident chunks, the
  // device-resident optimizer state and the moment's non-model memory within the device's memory.
  // A recompute op has the moments of the backward that follows it (the same slot). With 2bw a
  // layer uses its chunks' part of the op's version (version % 2) and a backward their gradients,
  // and the moments are those of the segment under way.
  void chunk_compute(const Op& op) {
    const ChunkLayout& L = chunks_->layout;
    const bool back = op.kind == OpKind::backward, again = op.kind == OpKind::recompute;
    const int index = again ? chunk_slot_ : chunk_slot_++;
    std::vector<int> used;
    std::size_t next = 0;
    const int segment = p_.first_step + steps_done_;
    if (L.parts > 1 && op.version < 0) bad(to_string(op.kind) + " without its weight version");
    for (const ChunkMoment& m : chunks_->moments_of(
             p_.first_step, p_.steps, std::min(segment, p_.first_step + p_.steps - 1))) {
      if (m.slot != index) continue;
      // A forward's slot has forward moments; a backward's the recompute op's, then its own.
      const bool backward_slot = m.backward || m.recompute;
      if (backward_slot != (back || again))
        bad(to_string(op.kind) + " where the chunk schedule has a " +
            (backward_slot ? "backward" : "forward"));
      if (m.backward != back || m.recompute != again) continue;  // the other op of the slot
      used.clear();
      for (int c : L.layer_chunks[std::size_t(m.layer)]) {
        used.push_back(L.parts == 1 ? c : c * L.parts + op.version % 2);
        if (L.parts > 1 && back) used.push_back(c * L.parts + 2);
      }
      for (; next < pending_.size() && pending_[next].layer == m.layer; ++next) {
        for (int u : used)
          if (pending_[next].kind == OpKind::copy_chunk_to_host && pending_[next].bucket == u)
            bad("evicts " + unit_name(true) + " " + std::to_string(u) + " before layer " +
                std::to_string(m.layer) + ", which uses it");
        move_chunk(pending_[next]);
      }
      int resident = 0;
      for (auto d : on_device_)
        resident += d ? 1 : 0;
      for (int u : used)
        if (!on_device_[std::size_t(u)])
          bad(m.label(L) + " uses " + unit_name(true) + " " + std::to_string(u) +
              ", which is on the host");
      if (back)  // its chunks have a gradient from now on in the step
        for (int u : used)
          dirty_[std::size_t(u / L.parts)] = 1;
      const std::int64_t device = std::int64_t(resident) * L.move_bytes + m.non_model_bytes +
                                  std::int64_t(chunks_->device_adam_chunks) * L.os_chunk_bytes;
      if (device > chunks_->budget_bytes)
        bad(m.label(L) + " holds " + std::to_string(device) +
            " bytes on the device, more than its " + std::to_string(chunks_->budget_bytes));
    }
    if (next != pending_.size())
      bad("chunk copy before layer " + std::to_string(pending_[next].layer) +
          " out of the compute op's layer order");
    pending_.clear();
  }

  // Activation offload: a stash goes to the host after its forward and comes back before its
  // backward, once each, only on a stage that swaps; the backward needs it back.
  void swap(const Op& op) {
    const std::string name = to_string(op.kind);
    if (!plan_.swaps(prog_.stage)) bad(name + " on a stage that does not swap its activations");
    std::uint8_t& f = swap_flags_[slot(op)];
    if (op.kind == OpKind::copy_activation_to_host) {
      require(op, kForward, name + " before its forward");
      if (f & kSwapOut) bad("activation copied to the host twice");
      f |= kSwapOut;
    } else {
      if (!(f & kSwapOut)) bad(name + " before its copy_activation_to_host");
      if (f & kSwapIn) bad("activation copied back to the device twice");
      f |= kSwapIn;
    }
    if (flags(op) & kBackward) bad(name + " after its backward");
  }

  // Optimizer offload: every backward's gradients go to the host (and stage 0's tied gradient
  // after the exchange) before CPU Adam runs the step's tiles in order, each tile's upload right
  // behind it; the device's optimizer_step then switches to the uploaded version.
  void offload_op(const Op& op) {
    const std::string name = to_string(op.kind);
    if (!offload()) bad(name + " in a plan without offload");
    const std::size_t step = local(op.step);
    if (op.kind == OpKind::copy_gradient_to_host) {
      if (plan_.offload_sharded()) {  // w > 1: each chunk's shard, once, after the collectives
        if (op.microbatch != -1) bad(name + " of a microbatch with w > 1 (the shard goes once)");
        if (!in_range(op.chunk, plan_.v)) bad("chunk out of range");
        if (op.step != p_.first_step + steps_done_) bad(name + " out of step order");
        if (copied_out_[step] != op.chunk)
          bad(name + " of chunk " + std::to_string(op.chunk) + " out of order");
        for (int c = 0; c < plan_.v; ++c)
          if (backwards_of(op.step, c) != plan_.m) bad(name + " before the step's last backward");
        if (all_reduces_[step] != p_.buckets * plan_.v)
          bad(name + " before the step's reduce-scatters (all_reduce)");
        if (tied_first() && tied_gradient_[step] != tied_complete_at(true))
          bad(name + " before the tied gradient is received and gathered");
        ++copied_out_[step];
        return;
      }
      if (op.microbatch == -1) {
        if (!tied_first() || op.chunk != 0)
          bad(name + " of a tied gradient off stage 0's tied embedding");
        if (!tied_gradient_[step]) bad(name + " of the tied gradient before recv_tied_gradient");
        if (tied_copied_[step]++) bad(name + " of the tied gradient twice in a step");
        return;
      }
      if (!in_range(op.microbatch, plan_.m)) bad("microbatch out of range");
      require(op, kBackward, name + " before its backward");
      set_once(op, kCopiedOut, "gradient copied to the host");
      ++copied_out_[step];
      return;
    }
    if (op.microbatch != -1) bad(name + " with a microbatch");
    if (op.step != p_.first_step + steps_done_) bad(name + " out of step order");
    if (op.version != op.step + 1) bad(name + " must create version step+1");
    // Tiles in order: (chunk, tile) flattened; host step k, then its upload.
    int flat = op.bucket;
    for (int c = 0; c < op.chunk; ++c)
      flat += offload_tiles(plan_, prog_.stage, c);
    if (op.bucket < 0 || op.bucket >= offload_tiles(plan_, prog_.stage, op.chunk))
      bad(name + " of tile " + std::to_string(op.bucket) + ", out of range");
    if (op.kind == OpKind::host_optimizer_step) {
      const int copies = plan_.offload_sharded() ? plan_.v : plan_.m * plan_.v;
      if (copied_out_[step] != copies)
        bad(name + " after " + std::to_string(copied_out_[step]) + " gradient copies, expected " +
            std::to_string(copies));
      if (tied_first() && !plan_.offload_sharded() && !tied_copied_[step])
        bad(name + " before the tied gradient is copied");
      if (flat != host_steps_ || uploads_ != host_steps_)
        bad(name + " of tile " + std::to_string(flat) + " out of order");
      ++host_steps_;
      return;
    }
    if (flat != uploads_ || host_steps_ != uploads_ + 1)
      bad(name + " of tile " + std::to_string(flat) + " before its host_optimizer_step");
    ++uploads_;
  }

  // Tied embeddings: stage 0 holds the embedding (chunk 0) and owns its update; the last stage
  // holds the head's copy (chunk v-1).
  bool tied_first() const { return p_.tied_embeddings && plan_.d > 1 && prog_.stage == 0; }
  bool tied_last() const { return p_.tied_embeddings && plan_.d > 1 && prog_.stage == plan_.d - 1; }
  int backwards_of(int step, int chunk) const {
    return backwards_[local(step) * std::size_t(plan_.v) + std::size_t(chunk)];
  }
  // Versions this segment creates (initial ones come from the checkpoint, never sent).
  bool created_here(int version) const {
    return version > p_.first_step && version <= p_.first_step + p_.steps;
  }

  // Tied messages done per step (gradient) or version (weights) on this device: the send or the
  // receive counts 1, the gather after a receive (w > 1) 1 more.
  // The all_reduce ops a step has: none with w = 1, or with chunks (each chunk step reduce-scatters
  // its chunk's gradient).
  int step_reduces() const { return plan_.w > 1 && !chunks_ ? p_.buckets * plan_.v : 0; }
  int tied_complete_at(bool receiver) const { return receiver && plan_.w > 1 ? 2 : 1; }

  void tied(const Op& op) {
    const std::string name = to_string(op.kind);
    const bool gather =
        op.kind == OpKind::gather_tied_gradient || op.kind == OpKind::gather_tied_weights;
    const bool to_first = op.kind == OpKind::send_tied_gradient ||
                          op.kind == OpKind::recv_tied_weights ||
                          op.kind == OpKind::gather_tied_weights;  // ops of the last stage
    if (!(to_first ? tied_last() : tied_first()))
      bad(name + " on stage " + std::to_string(prog_.stage) +
          (p_.tied_embeddings && plan_.d > 1 ? ", not its tied end" : " of an untied program"));
    const int partner = gather ? -1 : plan_.rank_of(to_first ? 0 : plan_.d - 1, prog_.replica);
    const int chunk = to_first ? plan_.v - 1 : 0;
    if (gather && plan_.w == 1) bad(name + " with one replica");
    if (op.peer != partner)
      bad(name + " with rank " + std::to_string(op.peer) +
          (gather ? ", a gather has no peer"
                  : ", the tied partner is rank " + std::to_string(partner)));
    if (op.chunk != chunk)
      bad(name + " of chunk " + std::to_string(op.chunk) + ", the tied tensor is in chunk " +
          std::to_string(chunk));
    if (op.microbatch != -1) bad(name + " with a microbatch");
    const bool weights = op.kind == OpKind::send_tied_weights ||
                         op.kind == OpKind::recv_tied_weights ||
                         op.kind == OpKind::gather_tied_weights;
    if (!weights) {
      if (backwards_of(op.step, op.chunk) != plan_.m) bad(name + " before the step's backwards");
      const int reduces = step_reduces();
      if (all_reduces_[local(op.step)] != reduces) bad(name + " before the step's all_reduces");
      int& done = tied_gradient_[local(op.step)];
      if (gather && done != 1)
        bad(name + (done ? " twice in a step" : " before recv_tied_gradient"));
      if (!gather && done) bad(name + " twice in a step");
      ++done;
      return;
    }
    if (!in_range(op.version, int(live_.size())) || !created_here(op.version))
      bad(name + " of version " + std::to_string(op.version) + ", not created by this segment");
    if (op.version > p_.first_step + steps_done_)
      bad(name + " of version " + std::to_string(op.version) +
          " before the optimizer step that creates it");
    if (!live_[std::size_t(op.version)])
      bad(name + " of version " + std::to_string(op.version) + ", which is not live");
    int& done = tied_weights_[std::size_t(op.version)];
    if (gather && done != 1)
      bad(name + " of version " + std::to_string(op.version) +
          (done ? " twice" : " before recv_tied_weights"));
    if (!gather && done) bad(name + " of version " + std::to_string(op.version) + " twice");
    ++done;
  }

  void use_version(const Op& op) {
    if (!in_range(op.version, int(live_.size()))) bad("weight version out of range");
    if (tied_last() && op.chunk == plan_.v - 1 && created_here(op.version) &&
        tied_weights_[std::size_t(op.version)] != tied_complete_at(true)) {
      bad("uses weight version " + std::to_string(op.version) +
          " before its tied weights are received (recv_tied_weights" +
          (plan_.w > 1 ? ", gather_tied_weights)" : ")"));
    }
    const int want = expected_version(plan_, op.step, op.microbatch);
    if (op.version != want) {
      bad("uses weight version " + std::to_string(op.version) + ", the rule gives " +
          std::to_string(want));
    }
    if (!live_[std::size_t(op.version)]) {
      bad("uses weight version " + std::to_string(op.version) + ", which is not live");
    }
  }

  void forward(const Op& op) {
    if (chunks_) chunk_compute(op);
    if (!first(op)) require(op, kRecvA, "forward before its activation is received");
    set_once(op, kForward, "forward");
    use_version(op);
    version_of_[slot(op)] = op.version;
    ++users_[std::size_t(op.version)];
    max_stash_ = std::max(max_stash_, ++stash_);
    if (stash_ > stash_limit(plan_)) {
      bad("stashes " + std::to_string(stash_) + " microbatches (limit " +
          std::to_string(stash_limit(plan_)) + ")");
    }
  }

  void same_version_as_forward(const Op& op, const char* what) {
    if (op.version != version_of_[slot(op)]) {
      bad(std::string(what) + " uses weight version " + std::to_string(op.version) +
          ", its forward used " + std::to_string(version_of_[slot(op)]));
    }
    use_version(op);
  }

  void recompute(const Op& op) {
    if (chunks_) chunk_compute(op);
    require(op, kForward, "recompute before its forward");
    if (flags(op) & kBackward) bad("recompute after its backward");
    set_once(op, kRecompute, "recompute");
    same_version_as_forward(op, "recompute");
  }

  void backward(const Op& op) {
    if (chunks_) chunk_compute(op);
    require(op, kForward, "backward before its forward");
    if (!last(op)) require(op, kRecvG, "backward before its gradient is received");
    if (plan_.has_recompute_op(prog_.stage))
      require(op, kRecompute, "backward without a recompute");
    const std::uint8_t sf = swap_flags_[slot(op)];
    if ((sf & kSwapOut) && !(sf & kSwapIn))
      bad("backward before its stash is back on the device (copy_activation_to_device)");
    set_once(op, kBackward, "backward");
    same_version_as_forward(op, "backward");
    --users_[std::size_t(op.version)];
    --stash_;
    ++backwards_[local(op.step) * std::size_t(plan_.v) + std::size_t(op.chunk)];
  }

  void all_reduce(const Op& op) {
    if (chunks_) bad("all_reduce in an offload chunks program (its chunk steps reduce-scatter)");
    if (backwards_[local(op.step) * std::size_t(plan_.v) + std::size_t(op.chunk)] != plan_.m) {
      bad("all_reduce before the step's backwards of this chunk");
    }
    ++all_reduces_[local(op.step)];
  }

  void optimizer_step(const Op& op) {
    if (op.step != p_.first_step + steps_done_) bad("optimizer step out of order");
    for (int chunk = 0; chunk < plan_.v; ++chunk) {
      if (backwards_[local(op.step) * std::size_t(plan_.v) + std::size_t(chunk)] != plan_.m) {
        bad("optimizer step before the step's backwards");
      }
    }
    const int reduces = step_reduces();
    if (all_reduces_[local(op.step)] != reduces) {
      bad("optimizer step after " + std::to_string(all_reduces_[local(op.step)]) +
          " all_reduces, expected " + std::to_string(reduces));
    }
    if ((tied_first() || tied_last()) &&
        tied_gradient_[local(op.step)] != tied_complete_at(tied_first())) {
      bad(std::string("optimizer step before the tied gradient is ") +
          (tied_first() ? (plan_.w > 1 ? "received and gathered (gather_tied_gradient)"
                                       : "received (recv_tied_gradient)")
                        : "sent (send_tied_gradient)"));
    }
    if (op.version != op.step + 1) bad("optimizer step must create version step+1");
    if (offload()) {
      if (uploads_ != tiles_)
        bad("optimizer step after " + std::to_string(uploads_) + " of " + std::to_string(tiles_) +
            " tiles copied back from the host");
      host_steps_ = uploads_ = 0;
    }
    if (chunks_) {
      for (std::size_t c = 0; c < stepped_.size(); ++c)
        if (stepped_[c] != 1)
          bad("optimizer step without chunk " + std::to_string(c) + "'s Adam step");
      if (on_device_ != chunks_->start_on_device)
        bad("optimizer step with the chunks not where the step started (the next step's plan "
            "assumes them there)");
      std::fill(stepped_.begin(), stepped_.end(), 0);
      std::fill(dirty_.begin(), dirty_.end(), 0);
      std::fill(reduced_.begin(), reduced_.end(), 0);
      chunk_slot_ = 0;
    }
    live_[std::size_t(op.version)] = 1;
    ++live_count_;
    ++steps_done_;
    max_live_ = std::max(max_live_, live_count_);
    if (live_count_ > version_limit(plan_)) {
      bad(std::to_string(live_count_) + " weight versions live (limit " +
          std::to_string(version_limit(plan_)) + ")");
    }
  }

  void free_version(const Op& op) {
    if (!in_range(op.version, int(live_.size())) || !live_[std::size_t(op.version)]) {
      bad("frees weight version " + std::to_string(op.version) + ", which is not live");
    }
    if (users_[std::size_t(op.version)] > 0) {
      bad("frees weight version " + std::to_string(op.version) + " still used by " +
          std::to_string(users_[std::size_t(op.version)]) + " stashed microbatches");
    }
    live_[std::size_t(op.version)] = 0;
    --live_count_;
  }

  void check_complete() const {
    if (!pending_.empty())
      throw ScheduleError("rank " + std::to_string(prog_.rank) +
                          ": chunk copies at the end of the program, before no compute op");
    if (steps_done_ != p_.steps) {
      throw ScheduleError("rank " + std::to_string(prog_.rank) + ": " +
                          std::to_string(steps_done_) + " optimizer steps, expected " +
                          std::to_string(p_.steps));
    }
    // Every version the segment creates is sent and received, the last ones after the last step.
    for (int version = p_.first_step + 1; version <= p_.first_step + p_.steps; ++version) {
      if ((tied_first() || tied_last()) &&
          tied_weights_[std::size_t(version)] != tied_complete_at(tied_last())) {
        throw ScheduleError("rank " + std::to_string(prog_.rank) + ": tied weights of version " +
                            std::to_string(version) + " never " +
                            (tied_first()  ? "sent (send_tied_weights)"
                             : plan_.w > 1 ? "received and gathered (gather_tied_weights)"
                                           : "received (recv_tied_weights)"));
      }
    }
    for (int step = p_.first_step; step < p_.first_step + p_.steps; ++step) {
      for (int mb = 0; mb < plan_.m; ++mb) {
        for (int chunk = 0; chunk < plan_.v; ++chunk)
          check_slot(Op{OpKind::forward, step, mb, chunk});
      }
    }
  }

  void check_slot(const Op& op) const {
    std::uint8_t need = kForward | kBackward;
    if (!first(op)) need |= kRecvA | kSentG;
    if (!last(op)) need |= kSentA | kRecvG;
    if (plan_.has_recompute_op(prog_.stage)) need |= kRecompute;
    if (offload() && !plan_.offload_sharded()) need |= kCopiedOut;
    if ((flags_[slot(op)] & need) != need) {
      throw ScheduleError("rank " + std::to_string(prog_.rank) + ": step " +
                          std::to_string(op.step) + " microbatch " + std::to_string(op.microbatch) +
                          " chunk " + std::to_string(op.chunk) +
                          " misses a forward, backward, recompute, send, receive or gradient "
                          "copy to the host");
    }
  }

  const Programs& p_;
  const Plan& plan_;
  const Program& prog_;
  std::size_t index_ = 0;
  std::vector<std::uint8_t> flags_;
  std::vector<std::uint8_t> swap_flags_;  // activation offload, per slot
  std::vector<int> version_of_;
  std::vector<char> live_;
  std::vector<int> users_;            // stashed microbatches per weight version
  std::vector<int> backwards_;        // per (step, chunk)
  std::vector<int> all_reduces_;      // per step
  std::vector<int> tied_gradient_;    // tied gradient sent, or received (+1 gathered), per step
  std::vector<int> tied_weights_;     // tied weights sent, or received (+1 gathered), per version
  std::vector<int> copied_out_;       // offload: gradient copies to the host, per step
  std::vector<int> tied_copied_;      // offload: tied gradient copies, per step
  int tiles_ = 0;                     // offload: CPU Adam tiles per step
  int host_steps_ = 0, uploads_ = 0;  // offload: of the current step
  const ChunkSchedule* chunks_ = nullptr;  // offload chunks
  std::vector<bool> on_device_;            // chunks: per chunk, now
  std::vector<Op> pending_;                // chunks: copies waiting for the next compute op
  std::vector<int> stepped_;               // chunks: Adam steps per chunk in this step
  std::vector<char> dirty_;                // chunks: per chunk, a backward has used it in this step
  std::vector<char> reduced_;  // sharded chunks: its gradient's part came down at this step
  int chunk_slot_ = 0;         // chunks: compute ops of this step so far
  int steps_done_ = 0;
  int live_count_ = 1;
  int max_live_ = 1;
  int stash_ = 0;
  int max_stash_ = 0;
};

}  // namespace

CheckReport check_programs(const Programs& programs) {
  CheckReport report;
  for (std::size_t r = 0; r < programs.devices.size(); ++r) {
    if (programs.devices[r].rank != int(r)) {
      throw ScheduleError("program " + std::to_string(r) + " names rank " +
                          std::to_string(programs.devices[r].rank));
    }
    DeviceCheck device = DeviceChecker(programs, int(r)).run();
    report.max_stash = std::max(report.max_stash, device.max_stash);
    report.max_live_versions = std::max(report.max_live_versions, device.max_live_versions);
    report.ops += device.ops;
    report.devices.push_back(device);
  }
  // Local invariants first: their messages are the most precise.
  const Execution ex = execute(programs);
  for (std::int64_t m : ex.match)
    report.messages += m >= 0 ? 1 : 0;
  report.collectives = std::int64_t(ex.groups.size());
  std::int64_t grouped = 0;
  for (const auto& g : ex.groups)
    grouped += std::int64_t(g.size());
  report.messages -= grouped;
  return report;
}

}  // namespace pw::planner
