// Offload's backend-independent rules (see offload.hpp).
#include "exec/offload.hpp"

#include <algorithm>
#include <string>

#include <fmt/format.h>

#include "common/error.hpp"

namespace pw::exec::detail {

HostTiles host_tiles(const std::vector<TensorSlot>& layout, std::int64_t n, bool last,
                     std::int64_t tied_offset, std::int64_t tied_size, int expected_tiles, int rank,
                     int chunk) {
  HostTiles h;
  // The last stage's copy of the tied tensor (the layout's last slot) is not updated there.
  h.host_n = last && tied_offset >= 0 ? tied_offset : n;
  if (h.host_n != n && tied_offset + tied_size != n)
    throw Error(
        fmt::format("rank {}: the tied copy is not the last tensor of chunk {}", rank, chunk));
  std::string current;
  for (const TensorSlot& slot : layout) {
    if (slot.offset >= h.host_n) break;
    const std::size_t dot = slot.name.find('.');
    const std::string key = slot.name == "wte" || slot.name == "wpe" ? "embedding"
                            : dot != std::string::npos               ? slot.name.substr(0, dot)
                                                                     : "head";
    if (h.tiles.empty() || key != current) h.tiles.push_back({slot.offset, slot.offset});
    current = key;
    h.tiles.back().end = slot.offset + slot.size;
  }
  if (int(h.tiles.size()) != expected_tiles)
    throw Error(fmt::format("rank {}: chunk {} has {} layers, the program {} CPU Adam tiles", rank,
                            chunk, h.tiles.size(), expected_tiles));
  return h;
}

int tile_of(const std::vector<Tile>& tiles, std::int64_t offset, std::int64_t size) {
  for (std::size_t k = 0; k < tiles.size(); ++k)
    if (offset >= tiles[k].begin && offset + size <= tiles[k].end) return int(k);
  return -1;
}

std::vector<Tile> streamed_ranges(Tile t, std::int64_t tied_offset, std::int64_t tied_size) {
  std::vector<Tile> ranges;
  const std::int64_t r0 = tied_offset >= 0 ? tied_offset : t.end;
  const std::int64_t r1 = tied_offset >= 0 ? tied_offset + tied_size : t.end;
  if (t.begin < std::min(r0, t.end)) ranges.push_back({t.begin, std::min(r0, t.end)});
  if (std::max(r1, t.begin) < t.end) ranges.push_back({std::max(r1, t.begin), t.end});
  return ranges;
}

int upload_slot(const planner::Plan& plan, int newest_slot) {
  return planner::version_limit(plan) == 1 ? newest_slot : 1 - newest_slot;
}

int gradient_copy_op(const std::vector<planner::Op>& ops, int backward_op) {
  int at = backward_op;
  while (at + 1 < int(ops.size()) &&
         ops[std::size_t(at)].kind != planner::OpKind::copy_gradient_to_host)
    ++at;
  return at;
}

}  // namespace pw::exec::detail
