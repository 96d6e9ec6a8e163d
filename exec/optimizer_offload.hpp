// Optimizer offload's ordering (ZeRO-Offload; docs/formulas.md section 9), the one rule both
// workers (CPU and CUDA) give it (exec/README.md, "The device interface"): which copy, CPU Adam and
// compute waits for what. A backward streams each layer's gradients through two device tile
// buffers to the host (a buffer is reused once its previous layer's copy is done; the next compute
// op waits for the backward's last copy); a chunk's gradients kept on the device (the tied tensor's
// sum; sharded: every tile's shard after the reduce-scatter) go down once, after their sums; CPU
// Adam of a tile runs after the step's gradient copies, all of them; a tile's upload after its
// CPU Adam, into the slot the step's uploads write (WeightSlots); the device's optimizer step
// after the last upload and the last download.
// Host-only, backend-independent: tested on the CPU with a device that records its calls
// (tests/test_offload_exec.cpp) and through both workers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include <fmt/format.h>

#include "common/error.hpp"
#include "exec/offload.hpp"
#include "planner/plan.hpp"
#include "planner/program.hpp"

namespace pw::exec::detail {

// A rank's engines as optimizer offload uses them: the compute (stream, or the rank's thread), the
// device-to-host and host-to-device copy engines and the host CPU (CPU Adam).
enum class Engine { compute, d2h, h2d, host };

// One backward's gradients streamed to the host: the chunk, its CPU Adam tiles (one per layer) and
// its tied tensor (offset -1: none), whose gradient stays on the device in `tied` (T: the
// device's gradient element). `op`: the program's copy_gradient_to_host op of the backward (the
// timeline's op of its copies).
template <class T>
struct StreamedBackward {
  StreamedBackward(std::size_t chunk, int op, const std::vector<Tile>& tiles,
                   std::int64_t tied_offset, std::int64_t tied_size, T* tied)
      : chunk(chunk),
        op(op),
        tiles(&tiles),
        tied_offset(tied_offset),
        tied_size(tied_size),
        tied(tied) {}
  std::size_t chunk;
  int op;
  const std::vector<Tile>* tiles;
  std::int64_t tied_offset, tied_size;
  T* tied;
  int open = -1;   // the tile whose layer's gradients are being written (-1: none)
  int buffer = 0;  // the tile buffer they go into
};

// The rule. `Slots` is the rank's WeightSlots (upload_target, end_upload). The worker `W` does only
// what a device does, each copy and CPU Adam issued on its engine after the marks `after` gave it:
//   Mark mark(Engine)            the work issued on the engine so far (default-constructed: none;
//                                the CPU's compute runs on the calling thread: none)
//   void after(Engine, Mark)     the engine's next work waits for the mark (the compute: the
//                                rank's next op)
//   void drop(Mark)              a mark no longer held (a GPU event back to its pool)
//   T* zero_tile(int buffer, std::int64_t n)   tile buffer `buffer`, its first n elements
//                                zeroed on the compute
//   T* tile_at(int buffer)       tile buffer `buffer`
//   void stream_tile(std::size_t chunk, int buffer, Tile tile, const std::vector<Tile>& ranges,
//                    int op)     d2h: the buffer's `ranges` (of `tile`) added into the host's
//                                gradient accumulator
//   void gradient_sums_done(std::size_t chunk)  the compute waits for the chunk's gradient sums
//                                (all-reduce or reduce-scatter, the tied exchange)
//   bool keeps_tied_gradient(std::size_t chunk)
//   void download_tied_gradient(std::size_t chunk, int op)     d2h: the tied gradient to the
//                                host's accumulator, the device's zeroed for the next step
//   void download_gradient_shards(std::size_t chunk, int op)   sharded (w > 1): d2h, the replica's
//                                shard of each tile to the host, the device's gradients zeroed
//   void host_adam(std::size_t chunk, int tile, int update, int op)   host: CPU Adam of the tile
//   void upload_tile(std::size_t chunk, int tile, int slot, int op)   h2d: its new parameters into
//                                the weight slot
template <class W, class Slots>
class OptimizerOffload {
 public:
  using Mark = typename W::Mark;

  OptimizerOffload(W& w, Slots& slots) : w_(w), slots_(slots) {}
  OptimizerOffload(const OptimizerOffload&) = delete;
  OptimizerOffload& operator=(const OptimizerOffload&) = delete;

  // The rank, its plan (outliving this), whether its optimizer state is the replica's shard
  // (w > 1), and each chunk's CPU Adam tile count.
  void setup(int rank, const planner::Plan& plan, bool sharded, const std::vector<int>& tiles) {
    rank_ = rank;
    plan_ = &plan;
    sharded_ = sharded;
    adam_.clear();
    for (int n : tiles)
      adam_.emplace_back(std::size_t(n));
  }

  // A gradient of backward `b` at [offset, offset + size): where the device writes it. The tied
  // tensor's stays on the device; the others go into the tile buffer of their layer, opened
  // (waiting for that buffer's previous copy, then zeroed) at the layer's first gradient. Throws
  // naming the rank when the gradient is in no tile or a layer begins before the previous is done.
  template <class T>
  T* gradient_at(StreamedBackward<T>& b, std::int64_t offset, std::int64_t size) {
    if (b.tied_offset >= 0 && offset == b.tied_offset) return b.tied;
    const int k = tile_of(*b.tiles, offset, size);
    if (k < 0)
      throw Error(fmt::format("rank {}: gradients [{}, {}) of chunk {} are in no layer", rank_,
                              offset, offset + size, b.chunk));
    const Tile& t = (*b.tiles)[std::size_t(k)];
    if (k != b.open) {
      if (b.open >= 0)
        throw Error(fmt::format(
            "rank {}: a layer's gradients began before the previous layer's were done", rank_));
      b.buffer = next_tile_;
      next_tile_ ^= 1;
      w_.after(Engine::compute, tile_copied_[b.buffer]);  // its previous layer has left
      b.open = k;
      return w_.zero_tile(b.buffer, t.size()) + (offset - t.begin);
    }
    return w_.tile_at(b.buffer) + (offset - t.begin);
  }

  // Backward `b`'s layer is done: its streamed ranges (the tile less the tied tensor) go to the
  // host after the compute that wrote them. A layer whose every gradient stays on the device
  // opened no tile.
  template <class T>
  void layer_done(StreamedBackward<T>& b) {
    if (b.open < 0) return;
    const Tile t = (*b.tiles)[std::size_t(b.open)];
    follow(Engine::d2h, Engine::compute);
    w_.stream_tile(b.chunk, b.buffer, t, streamed_ranges(t, b.tied_offset, b.tied_size), b.op);
    Mark& copied = tile_copied_[b.buffer];
    w_.drop(copied);
    copied = w_.mark(Engine::d2h);
    last_copy_ = copied;  // an alias: the newest of the two
    b.open = -1;
  }

  // copy_gradient_to_host, host_optimizer_step and copy_parameters_to_device, program op `at`.
  void run(const planner::Op& op, int at) {
    const std::size_t chunk = checked_chunk(op);
    switch (op.kind) {
      case planner::OpKind::copy_gradient_to_host:
        if (op.microbatch >= 0) {  // the backward's layers: the next compute waits for the last
          w_.after(Engine::compute, last_copy_);
          return;
        }
        // The gradients the device keeps, once, after their sums.
        w_.gradient_sums_done(chunk);
        follow(Engine::d2h, Engine::compute);
        if (sharded_) return w_.download_gradient_shards(chunk, at);
        if (!w_.keeps_tied_gradient(chunk))
          throw Error(fmt::format("rank {}: tied gradient copy on chunk {}, which keeps none",
                                  rank_, op.chunk));
        return w_.download_tied_gradient(chunk, at);
      case planner::OpKind::host_optimizer_step: {
        Mark& done = adam_[chunk][checked_tile(op, chunk)];
        follow(Engine::host, Engine::d2h);  // the step's gradient copies, all of them
        w_.host_adam(chunk, op.bucket, op.step + 1, at);
        w_.drop(done);
        done = w_.mark(Engine::host);
        return;
      }
      case planner::OpKind::copy_parameters_to_device: {
        const Mark& adam = adam_[chunk][checked_tile(op, chunk)];
        const int slot = slots_.upload_target(*plan_);
        w_.after(Engine::h2d, adam);
        w_.upload_tile(chunk, op.bucket, slot, at);
        w_.drop(last_upload_);
        last_upload_ = w_.mark(Engine::h2d);
        return;
      }
      default:
        throw Error(fmt::format("rank {}: {} is not an optimizer offload op", rank_,
                                planner::to_string(op.kind)));
    }
  }

  // The device's optimizer step of `version` under optimizer offload: the compute waits for the
  // last upload (which waited for its CPU Adam, which waited for every download) and for the last
  // download (the tied gradient's zeroing); returns the slot the uploads wrote, now holding
  // `version` (throws naming the rank when no upload came).
  int finish(int version) {
    w_.after(Engine::compute, last_upload_);
    follow(Engine::compute, Engine::d2h);
    return slots_.end_upload(version);
  }

 private:
  // Engine `e`'s next work after what `f` has been given so far.
  void follow(Engine e, Engine f) {
    const Mark m = w_.mark(f);
    w_.after(e, m);
    w_.drop(m);
  }
  std::size_t checked_chunk(const planner::Op& op) const {
    if (op.chunk < 0 || std::size_t(op.chunk) >= adam_.size())
      throw Error(fmt::format("rank {}: {} of chunk {}, which the rank does not hold", rank_,
                              planner::to_string(op.kind), op.chunk));
    return std::size_t(op.chunk);
  }
  std::size_t checked_tile(const planner::Op& op, std::size_t chunk) const {
    if (op.bucket < 0 || std::size_t(op.bucket) >= adam_[chunk].size())
      throw Error(fmt::format("rank {}: {} of tile {} of chunk {}, which has {}", rank_,
                              planner::to_string(op.kind), op.bucket, op.chunk,
                              adam_[chunk].size()));
    return std::size_t(op.bucket);
  }
  W& w_;
  Slots& slots_;
  int rank_ = 0;
  const planner::Plan* plan_ = nullptr;
  bool sharded_ = false;
  Mark tile_copied_[2] = {};  // per tile buffer: its last copy
  int next_tile_ = 0;         // the buffer the next layer's gradients go into
  Mark last_copy_ = {};       // the last backward's last tile's copy (one of tile_copied_)
  std::vector<std::vector<Mark>> adam_;  // per chunk and tile: its CPU Adam of this step
  Mark last_upload_ = {};
};

}  // namespace pw::exec::detail
