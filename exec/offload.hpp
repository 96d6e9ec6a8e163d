// What both workers (CPU and CUDA) share of offload's rules (docs/formulas.md section 9,
// exec/README.md "The device interface"): which parameters the host updates and in which CPU Adam
// tiles, which of a layer's gradients stream to the host, which weight slot the uploads write,
// when a swapped stash's device buffer goes (and the whole life of a swap: `Swaps`), and the
// timeline op a backward's copies belong to.
// Host-only, backend-independent: tested on the CPU (tests/test_offload_exec.cpp).
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
#include "planner/plan.hpp"
#include "planner/program.hpp"

namespace pw::exec::detail {

// A range of a chunk's parameters [begin, end), in elements of its layout.
struct Tile {
  std::int64_t begin = 0, end = 0;
  std::int64_t size() const { return end - begin; }
};

// Optimizer offload's host side of one chunk: its host-updated parameters [0, host_n) (all but
// the last stage's copy of the tied tensor, which stage 0's weights replace) and their CPU Adam
// tiles, one per layer in forward order: the embedding (wte, wpe), each block (h<k>.*), the final
// norm with the head; they cover [0, host_n).
struct HostTiles {
  std::int64_t host_n = 0;
  std::vector<Tile> tiles;
};

// The tiles of a chunk of `n` parameters laid out as `layout`; `tied_offset` (-1: none) and
// `tied_size` its tied tensor; `last` whether it is the last virtual stage. Throws Error naming
// `rank` and `chunk` when the tied copy is not the last tensor or the tile count is not
// `expected_tiles` (planner::offload_tiles, the program's host steps).
HostTiles host_tiles(const std::vector<TensorSlot>& layout, std::int64_t n, bool last,
                     std::int64_t tied_offset, std::int64_t tied_size, int expected_tiles, int rank,
                     int chunk);

// Where a chunk's CPU Adam tiles live in the host buffers. Unsharded: each tile whole, at its own
// offset (host_at[k] = tiles[k].begin, n = host_n). Sharded (w > 1, ZeRO-Offload's shards, the
// distributed optimizer on): replica `replica`'s part of each tile (planner::tile_shard, the
// planner's count), packed in tile order from 0; `layers` keeps the whole tiles (the
// collectives' ranges). Both workers' host layout.
struct HostLayout {
  std::int64_t n = 0;                 // host elements of master, m, v, the accumulator
  std::vector<Tile> tiles;            // what the replica's CPU Adam updates, in the chunk's layout
  std::vector<std::int64_t> host_at;  // where tile k begins in the host buffers
  std::vector<Tile> layers;           // sharded: the whole tiles (empty unsharded)
};
HostLayout host_layout(const HostTiles& host, bool sharded, int w, int replica);

// A range [begin, end) of a chunk's gradients that the distributed optimizer reduce-scatters (or
// all-gathers) in one collective, with the replicas' bounds over it (relative to begin).
struct ShardPiece {
  std::int64_t begin = 0, end = 0;
  std::vector<std::int64_t> bounds;
};
// The pieces of [a, b) of the chunk at `base` of a rank's `flat` parameters: one, by the rank's
// shards (shard_starts); with sharded optimizer offload (`layers`: the chunk's whole CPU Adam
// tiles, non-null) one per tile it meets, split by planner::tile_shard (the last stage's tied copy,
// in no tile, takes no part: it receives stage 0's weights). Both workers'.
std::vector<ShardPiece> shard_pieces(const std::vector<Tile>* layers, std::int64_t flat,
                                     std::int64_t base, int w, std::int64_t a, std::int64_t b);

// The tile holding gradients [offset, offset + size), or -1.
int tile_of(const std::vector<Tile>& tiles, std::int64_t offset, std::int64_t size);

// The parts of tile `t` whose gradients go to the host after its layer's backward: the tile less
// the tied tensor (its gradient stays on the device at both tied ends, summed there by the tied
// exchange; stage 0 copies the sum once per step). `tied_offset` -1: the whole tile.
std::vector<Tile> streamed_ranges(Tile t, std::int64_t tied_offset, std::int64_t tied_size);

// The weight slot a step's parameter uploads write (the first copy_parameters_to_device of the
// step picks it): in place for flush schedules; for 2BW the one the shadow version leaves
// (free_version comes after the uploads: no op reads it any more), or the second slot the first
// time.
int upload_slot(const planner::Plan& plan, int newest_slot);

// The copy_gradient_to_host op after the backward at `backward_op` of `ops` (the timeline's op of
// its layers' copies), or the last op if there is none.
int gradient_copy_op(const std::vector<planner::Op>& ops, int backward_op);

// Swapped stashes whose download was issued and whose device buffer is still held, oldest first,
// with the compute op (forward or backward index, counted from 0) that preceded the download. A
// buffer goes, its download done, when the second compute slot after that one begins (its upload,
// receive or compute op): the planner's account, so the measured device peak is the predicted
// one. Earlier only when an allocation would not fit the budget (the oldest first).
template <class T>
class HeldDownloads {
 public:
  void push(int compute_op, T item) { held_.emplace_back(compute_op, std::move(item)); }
  bool empty() const { return held_.empty(); }
  // Whether the oldest is due when compute slot `compute_op` begins.
  bool due(int compute_op) const { return !held_.empty() && held_.front().first + 2 <= compute_op; }
  T pop() {
    T item = std::move(held_.front().second);
    held_.pop_front();
    return item;
  }
  // Whether `item` is still held (an upload must wait until its download's buffer is gone).
  bool holds(const T& item) const {
    for (const auto& h : held_)
      if (h.second == item) return true;
    return false;
  }

 private:
  std::deque<std::pair<int, T>> held_;
};

// Activation offload's swapped stashes (KARMA's swap; docs/formulas.md section 9), the one life
// both workers give them: out after the forward, the device buffer released at the rule of
// HeldDownloads (or earlier under a budget, oldest first), back on an upload issued at its op
// after its own download's buffer is gone, and the stage's stash again at the backward. The rule
// is here once; the worker `W` does only what a device does (exec/README.md, "The device
// interface"), for its `Swap` (a device buffer, a host copy, the copies' events):
//   void swap_out(Swap&, const Key&, int op)  takes the stage's stash of the key into the swap,
//       gives it a host buffer and issues the download after the forward that wrote it
//   void swap_done(Swap&)                     waits for the download, frees the device buffer
//   void swap_in(const std::shared_ptr<Swap>&, int op)  a device buffer from now, the upload
//                                             issued after the download (the copy may keep it)
//   bool swapped_in(const Swap&)              whether the upload was issued
//   void swap_back(Swap&, const Key&)         the upload waited for, the device buffer the stage's
//                                             stash of the key again, the host buffer given back
// `op` is the program op (the timeline's). Tested with a device that records its calls
// (tests/test_offload_exec.cpp) and through both workers.
template <class W, class Swap, class Key>
class Swaps {
 public:
  explicit Swaps(W& w) : w_(w) {}
  Swaps(const Swaps&) = delete;
  Swaps& operator=(const Swaps&) = delete;

  // copy_activation_to_host of `key`, whose forward was compute op `forward` (counted from 0).
  void to_host(const Key& key, int forward, int op) {
    auto sw = std::make_shared<Swap>();
    w_.swap_out(*sw, key, op);
    downloads_.push(forward, sw);
    by_key_[key] = std::move(sw);
  }
  // The downloads due when compute slot `compute_op` begins (its upload, receive or compute op):
  // their device buffers go.
  void release_due(int compute_op) {
    while (downloads_.due(compute_op))
      reclaim();
  }
  // The oldest held download's device buffer, early (an allocation over the budget); false: none.
  bool reclaim() {
    if (downloads_.empty()) return false;
    const std::shared_ptr<Swap> sw = downloads_.pop();
    w_.swap_done(*sw);
    return true;
  }
  // copy_activation_to_device of `key`, beginning compute slot `compute_op`. Throws Error naming
  // `rank` when the stash never went to the host.
  void to_device(const Key& key, int compute_op, int op, int rank) {
    const auto it = by_key_.find(key);
    if (it == by_key_.end())
      throw Error(fmt::format(
          "rank {}: copy_activation_to_device of a stash that never went to the host", rank));
    const std::shared_ptr<Swap> sw = it->second;
    release_due(compute_op);
    // Its download's device buffer gone (always, with the schedule's gap between the two)...
    while (downloads_.holds(sw))
      reclaim();
    // ...it is on the device again from the upload's issue.
    w_.swap_in(sw, op);
  }
  // At the backward of `key`: its stash back from the host; false when it never went there.
  // Throws Error naming `rank` when the upload was not issued.
  bool back(const Key& key, int rank) {
    const auto it = by_key_.find(key);
    if (it == by_key_.end()) return false;
    const std::shared_ptr<Swap> sw = it->second;
    by_key_.erase(it);
    if (!w_.swapped_in(*sw))
      throw Error(fmt::format("rank {}: backward before its stash is back on the device", rank));
    w_.swap_back(*sw, key);
    return true;
  }
  // Forgets every swap (the worker's teardown), without waiting for their copies.
  void clear() {
    by_key_.clear();
    while (!downloads_.empty())
      downloads_.pop();
  }

 private:
  W& w_;
  std::map<Key, std::shared_ptr<Swap>> by_key_;
  HeldDownloads<std::shared_ptr<Swap>> downloads_;
};

}  // namespace pw::exec::detail
