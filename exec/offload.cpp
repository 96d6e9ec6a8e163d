// Offload's backend-independent rules (see offload.hpp).
#include "exec/offload.hpp"

#include <algorithm>
#include <string>

#include <fmt/format.h>

#include "common/error.hpp"
#include "exec/run_common.hpp"

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

HostLayout host_layout(const HostTiles& host, bool sharded, int w, int replica) {
  HostLayout h;
  h.tiles = host.tiles;
  if (!sharded) {
    h.n = host.host_n;
    for (const Tile& t : h.tiles)
      h.host_at.push_back(t.begin);
    return h;
  }
  h.layers = h.tiles;
  for (Tile& t : h.tiles) {
    const planner::TiedShard sh = planner::tile_shard(t.size(), w, replica);
    t = {t.begin + sh.begin, t.begin + sh.end};
    h.host_at.push_back(h.n);
    h.n += t.size();
  }
  return h;
}

std::vector<ShardPiece> shard_pieces(const std::vector<Tile>* layers, std::int64_t flat,
                                     std::int64_t base, int w, std::int64_t a, std::int64_t b) {
  if (!layers) return {{a, b, clip_bounds(shard_starts(flat, base, w), a, b)}};
  std::vector<ShardPiece> parts;
  for (const Tile& t : *layers) {
    const std::int64_t lo = std::max(a, t.begin), hi = std::min(b, t.end);
    if (lo >= hi) continue;
    std::vector<std::int64_t> starts;
    for (int r = 0; r < w; ++r)
      starts.push_back(t.begin + planner::tile_shard(t.size(), w, r).begin);
    starts.push_back(t.end);
    parts.push_back({lo, hi, clip_bounds(starts, lo, hi)});
  }
  return parts;
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
