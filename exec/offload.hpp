// What both workers (CPU and CUDA) share of offload's rules (docs/formulas.md section 9,
// exec/README.md "The device interface"): which parameters the host updates and in which CPU Adam
// tiles, which of a layer's gradients stream to the host, which weight slot the uploads write,
// when a swapped stash's device buffer goes, and the timeline op a backward's copies belong to.
// Host-only, backend-independent: tested on the CPU (tests/test_offload_exec.cpp).
#pragma once

#include <cstdint>
#include <deque>
#include <utility>
#include <vector>

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

}  // namespace pw::exec::detail
