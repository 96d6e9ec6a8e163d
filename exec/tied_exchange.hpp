// The tied-embedding exchange (docs/formulas.md section 4, tied embeddings), the one rule both
// workers (CPU and CUDA) give its six ops: the head's gradient from the last stage to stage 0 and
// the new weights back, each replica r moving only its shard (planner::tied_shard of the tensor's
// n elements over the w replicas); with w > 1 what arrives is held, zeros around it, until the
// stage's replicas gather it (the gradient then added to stage 0's, the weights in place in the
// version's slot); with w = 1 the gradient is added at once and the weights are whole.
// Host-only, backend-independent: tested on the CPU with a device that records its calls
// (tests/test_offload_exec.cpp) and through both workers.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "common/error.hpp"
#include "planner/program.hpp"

namespace pw::exec::detail {

// Throws naming `rank` when the op's chunk holds no tied tensor (`tied_offset` < 0).
inline void require_tied(const planner::Op& op, std::int64_t tied_offset, int rank) {
  if (tied_offset < 0)
    throw Error(fmt::format("rank {}: {} on chunk {}, which holds no tied tensor", rank,
                            planner::to_string(op.kind), op.chunk));
}

// One device holding both tied ends (d == 1, v > 1; its model chunks `chunks`, each with `first`
// and `tied_offset`): the chunk of the embedding and the chunk of the head, whose gradients add
// into one accumulator (TiedEndsSink), with no messages. {nullptr, nullptr} when the device holds
// fewer.
template <class Chunk>
std::pair<Chunk*, Chunk*> tied_ends_on_one_device(std::vector<Chunk>& chunks) {
  Chunk* embedding = nullptr;
  Chunk* head = nullptr;
  for (Chunk& c : chunks) {
    if (c.tied_offset < 0) continue;
    (c.first ? embedding : head) = &c;
  }
  if (!embedding || !head) return {nullptr, nullptr};
  return {embedding, head};
}

// The head chunk's gradient sink when one device holds both tied ends (tied_ends_on_one_device):
// its copy of the tied tensor's gradient is added into the embedding chunk's, so both ends add into
// one accumulator in program order, as one chunk holding both ends (v = 1) and the offload chunks'
// one wte do (their bits); the optimizer step then copies the sum into the head's copy. Its other
// gradients go where they are. `Sink` is the backend's gradient sink (exec/stage_compute.hpp's
// GradientSink, or the CUDA stage's), `T` its gradient element.
template <class Sink, class T>
class TiedEndsSink : public Sink {
 public:
  // The head chunk's gradients, its tied tensor [tied_offset, tied_offset + tied_size) of them, and
  // the embedding chunk's gradient of the tied tensor.
  TiedEndsSink(T* head_grads, std::int64_t tied_offset, std::int64_t tied_size, T* embedding_tied)
      : head_grads_(head_grads),
        tied_offset_(tied_offset),
        tied_size_(tied_size),
        embedding_tied_(embedding_tied) {}
  T* at(std::int64_t offset, std::int64_t) override {
    const std::int64_t into = offset - tied_offset_;
    if (into >= 0 && into < tied_size_) return embedding_tied_ + into;
    return head_grads_ + offset;
  }
  void layer_done(std::int64_t, std::int64_t) override {}

 private:
  T* head_grads_;
  std::int64_t tied_offset_, tied_size_;
  T* embedding_tied_;
};

// The worker `W` does only what a device does with the shard `sh` of the op's chunk's tied tensor
// (exec/README.md, "The device interface"):
//   void tied_gradient_out(const Op&, TiedShard sh)   sends the shard of the tied gradient to
//       op.peer, then zeroes the whole gradient (the next step sums from zero); the gradient's
//       next users wait for the send
//   void tied_gradient_in(const Op&, TiedShard sh, bool hold)   receives the head's shard from
//       op.peer; hold: keeps it, zeros around it, for the gather; else adds it to the gradient
//   void tied_gradient_gather(const Op&, TiedShard sh)   gathers the kept head over the stage's
//       replicas and adds it to the gradient
//   void tied_weights_out(const Op&, TiedShard sh)   sends the shard of version op.version's
//       tied tensor, read out of its weight slot (WeightSlots::read_by)
//   void tied_weights_in(const Op&, TiedShard sh, bool hold)   receives the shard into version
//       op.version's slot; hold: zeros around it until the gather
//   void tied_weights_gather(const Op&, TiedShard sh)   gathers the version's tensor in place
template <class W>
class TiedExchange {
 public:
  explicit TiedExchange(W& w) : w_(w) {}
  TiedExchange(const TiedExchange&) = delete;
  TiedExchange& operator=(const TiedExchange&) = delete;

  // One of the six tied ops on a chunk whose tied tensor (n elements) is at `tied_offset` (-1:
  // none), on replica `replica` of `w`. Throws naming `rank` when the chunk holds none, or when a
  // gather finds nothing received or a receive finds its last shard not yet gathered.
  void run(const planner::Op& op, std::int64_t tied_offset, std::int64_t n, int w, int replica,
           int rank) {
    using planner::OpKind;
    require_tied(op, tied_offset, rank);
    const planner::TiedShard sh = planner::tied_shard(n, w, replica);
    const bool hold = w > 1;
    switch (op.kind) {
      case OpKind::send_tied_gradient:
        return w_.tied_gradient_out(op, sh);
      case OpKind::recv_tied_gradient:
        if (hold) receive(gradient_held_, op, rank);
        return w_.tied_gradient_in(op, sh, hold);
      case OpKind::gather_tied_gradient:
        gather(gradient_held_, op, rank);
        return w_.tied_gradient_gather(op, sh);
      case OpKind::send_tied_weights:
        return w_.tied_weights_out(op, sh);
      case OpKind::recv_tied_weights:
        if (hold) receive(weights_held_, op, rank);
        return w_.tied_weights_in(op, sh, hold);
      case OpKind::gather_tied_weights:
        gather(weights_held_, op, rank);
        return w_.tied_weights_gather(op, sh);
      default:
        throw Error(fmt::format("rank {}: {} is not a tied op", rank, planner::to_string(op.kind)));
    }
  }

 private:
  static void receive(bool& held, const planner::Op& op, int rank) {
    if (held)
      throw Error(fmt::format("rank {}: {} before the last received shard was gathered", rank,
                              planner::to_string(op.kind)));
    held = true;
  }
  static void gather(bool& held, const planner::Op& op, int rank) {
    if (!held)
      throw Error(fmt::format("rank {}: {} without a received shard to gather", rank,
                              planner::to_string(op.kind)));
    held = false;
  }

  W& w_;
  bool gradient_held_ = false, weights_held_ = false;
};

}  // namespace pw::exec::detail
