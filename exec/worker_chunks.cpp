// Offload chunks (PatrickStar) in the CPU worker: the stage's model data in the chunk schedule's
// fixed-size chunks, moved whole between the emulated device and the host pool by the copy
// engines as the program's chunk ops say, Adam per chunk on the device (rank thread) or on the
// host CPU engine. With pipeline stages (d > 1) each rank runs its own stage's schedule; its
// pipeline messages and the tied embedding's exchange work on the chunks. With interleaving
// (v > 1) the rank's model chunks share its one set of chunks, each compute op counting its own
// model chunk's layers. docs/formulas.md section
// 9 (chunks); docs/formats.md, offload in the CPU executor.
#include <algorithm>
#include <cstring>
#include <memory>
#include <span>

#include <fmt/format.h>

#include "exec/optimizer.hpp"
#include "exec/worker.hpp"
#include "planner/chunks.hpp"
#include "planner/cost_model.hpp"

namespace pw::exec::detail {

using planner::Op;
using planner::OpKind;

// The stage's view of the chunks during a compute op: before each layer that moment's copies run
// (chunk_moment), then its activations are counted as the planner's moments count the non-model
// memory (N_k; ChunkMoment's alloc_bytes and free_bytes), the shared rule's (ChunkBook::Pass,
// exec/chunk_book.hpp). Tensors are where their chunk is now; a layer's chunks are on the device
// (its uploads waited for).
class Worker::ChunkMemory : public LayerMemory {
 public:
  using Kind = ChunkBook::Pass;
  // The compute op's model chunk `c` (chunks_[c]): its layers are the stage's layers
  // first_layer(c) .. + layers(c) - 1, its tensors at its base in the book.
  ChunkMemory(Worker& w, Kind kind, int c)
      : w_(w),
        kind_(kind),
        chunk_(c),
        first_(w.book_.first_layer(c)),
        base_(w.chunks_.at(std::size_t(c)).base) {}
  void begin_layer(int layer, bool) override {
    w_.chunk_moment(first_ + layer);
    w_.memory_->add(Category::activations, w_.book_.begin_layer(kind_, chunk_, layer));
  }
  void end_layer(int layer, bool) override {
    w_.memory_->add(Category::activations, w_.book_.end_layer(kind_, chunk_, layer));
  }
  // The weights of the op's version (2bw: its part of the chunk) and the gradient.
  const float* parameters(std::int64_t offset) override {
    const int part = w_.weight_part(w_.chunk_version_);
    const auto [c, at] = find(offset, part);
    return w_.data_chunks_[std::size_t(c)].part[part].data() + at;
  }
  float* gradients(std::int64_t offset) override {
    const auto [c, at] = find(offset, w_.gradient_unit());
    return w_.data_chunks_[std::size_t(c)].part[2].data() + at;
  }
  // Selective recompute: a block's backward re-makes its attention core whole in `core_`, which
  // its moment counts (begin_layer); the planner's backward moment takes the core's bytes back.
  float* attention_core(int layer) override {
    const std::int64_t bytes = w_.book_.core_bytes(first_ + layer);
    if (bytes == 0) return nullptr;
    if (bytes != std::int64_t(core_.size()) * std::int64_t(sizeof(float)))
      throw Error(fmt::format("rank {}: layer {}'s attention core is {} B, its buffer {} B",
                              w_.rank_, first_ + layer, bytes, core_.size() * sizeof(float)));
    return core_.data();
  }
  // The buffer a selective backward's layers re-make their attention core in, one after another.
  void set_core(Buffer& core) { core_ = std::span<float>(core.data(), std::size_t(core.size())); }

 private:
  std::pair<int, std::int64_t> find(std::int64_t offset, int unit) const {
    const auto found = w_.book_.at(base_ + offset);
    if (!w_.data_chunks_[std::size_t(found.first)].on_device[unit])
      throw Error(fmt::format("rank {}: a layer uses chunk {}{}, which is on the host", w_.rank_,
                              found.first,
                              w_.parts_ > 1 ? fmt::format(" (part {})", unit) : std::string()));
    return found;
  }
  Worker& w_;
  Kind kind_;
  int chunk_, first_;  // the model chunk; its first layer in the stage's
  std::int64_t base_;
  std::span<float> core_;
};

// The chunks as the schedule starts a step (its fixed point): each on the device or the host, its
// Adam state on the device for chunks 0 .. K-1, else on the host. The stage's initial (or resumed)
// parameters and Adam state come from the staging buffers the constructor filled, then those go.
void Worker::setup_chunks() {
  schedule_ = stage_chunk_schedule(*s_.programs, stage_, rank_);
  const planner::ChunkLayout& L = schedule_->layout;
  // Where each tensor lives, each layer's activation bytes, the messages (exec/chunk_book.hpp).
  std::vector<BookChunk> book;
  for (const Chunk& c : chunks_)
    book.push_back({&c.stage->layout(), c.base, c.tied_offset, c.first, c.last, c.sizes,
                    c.stage->layer_inputs(s_.plan().b), c.stage->blocks_scratch(s_.plan().b)});
  const auto [embedding, head] = tied_ends_on_one_device(chunks_);
  book_ = ChunkBook(*schedule_, book, embedding ? int(embedding - chunks_.data()) : -1,
                    head ? int(head - chunks_.data()) : -1, *s_.model, s_.plan(), stage_, rank_,
                    int(sizeof(float)));
  // Pipeline messages (d > 1, or one device's v > 1 model chunks handing them to each other): the
  // planner's count of them, on the device for the whole run as the schedule's non-model memory
  // counts them at every moment; the messages themselves live in uncounted buffers, never more at
  // once than that (make_message_room).
  memory_->add(Category::activations, book_.message_bytes());
  d2h_ = std::make_unique<CopyEngine>();
  h2d_ = std::make_unique<CopyEngine>();
  host_cpu_ = std::make_unique<CopyEngine>();
  const std::int64_t e = L.chunk_elements;
  parts_ = L.parts;
  data_chunks_.resize(std::size_t(L.chunks()));
  part_gathers_.assign(std::size_t(L.units()), 0);
  for (int k = 0; k < L.chunks(); ++k) {
    DataChunk& d = data_chunks_[std::size_t(k)];
    for (int u = 0; u < parts_; ++u) {
      d.on_device[u] = schedule_->start_on_device[std::size_t(k * parts_ + u)];
      MemoryCounter* where = d.on_device[u] ? memory_ : &host_;
      if (L.is_sharded(k) && !d.on_device[u]) continue;  // its part only, below
      for (int part : unit_parts(parts_, u))
        d.part[part] = Buffer(where, part == 2 ? Category::gradients : Category::weights, e);
    }
    for (int slot = 0; part_only(k) && slot < std::min(parts_, 2); ++slot)
      d.host_part[slot] = Buffer(&host_, Category::weights, L.shard_elements);
    // The Adam state of the replica's part of the chunk (all of it with w = 1).
    MemoryCounter* state = schedule_->device_resident(k) ? memory_ : &host_;
    d.m = Buffer(state, Category::optimizer, L.shard_elements);
    d.v = Buffer(state, Category::optimizer, L.shard_elements);
  }
  // The live versions' weights (2bw resumed: two) into their parts, each model chunk's.
  for (Chunk& c : chunks_) {
    for (int version : planner::initial_versions(s_.plan(), s_.first_step))
      scatter_chunks(0, c, c.slots[slots_.slot_of(version)].data(), version);
    scatter_chunks(1, c, c.m.data());
    scatter_chunks(2, c, c.v.data());
    c.slots[0] = Buffer();
    c.slots[1] = Buffer();
    c.m = Buffer();
    c.v = Buffer();
    c.m_at = c.v_at = nullptr;
  }
}

// Each model chunk's flat parameters (which 0), Adam m (1) or v (2) out of the chunks. With w > 1
// each replica holds its part of m and v, and with sharded chunks its part of the host chunks'
// parameters: the stage's replicas all-gather them (every replica calls this at the same point: a
// checkpoint, the run's end), so every replica returns the whole state, as without chunks.
Worker::Flats Worker::gather_chunks(int which, int version) const {
  return gather_chunks(which, version, which == 0 ? gather_parts(version) : PartParams{});
}

// Sharded chunks on the host: each one's parameters of `version` all-gathered from the replicas'
// parts (every replica calls this at the same point); empty for the others.
Worker::PartParams Worker::gather_parts(int version) const {
  const planner::ChunkLayout& L = schedule_->layout;
  PartParams params(std::size_t(L.chunks()));
  for (int k = 0; k < L.chunks(); ++k) {
    if (!part_only(k)) continue;
    const auto [pb, pe] = L.part(replica_);
    std::vector<float>& all = params[std::size_t(k)];
    all.assign(std::size_t(L.chunk_elements), 0.0f);
    std::copy_n(data_chunks_[std::size_t(k)].host_part[weight_part(version)].data(), pe - pb,
                all.data() + pb);
    s_.transport->all_gather(fmt::format("ck/{}.{}/w/{}/{}/{}", stage_, tp_, updates_, version, k),
                             replica_group(), device_, all.data(), L.part_bounds());
  }
  return params;
}

// gather_chunks with the sharded chunks' parameters gathered already (`params`, per chunk).
Worker::Flats Worker::gather_chunks(int which, int version, const PartParams& params) const {
  const planner::ChunkLayout& L = schedule_->layout;
  std::vector<std::vector<float>> whole;  // w > 1, state: each chunk's, all parts
  if (which != 0 && L.replicas > 1) {
    for (int k = 0; k < L.chunks(); ++k) {
      const DataChunk& d = data_chunks_[std::size_t(k)];
      const auto [lo, hi] = L.shard(k, replica_);
      std::vector<float> all(std::size_t(L.chunk_elements), 0.0f);
      std::copy_n((which == 1 ? d.m : d.v).data(), hi - lo, all.data() + lo);
      s_.transport->all_gather(
          fmt::format("ck/{}.{}/state{}/{}/{}", stage_, tp_, which, updates_, k), replica_group(),
          device_, all.data(), L.shard_bounds(k));
      whole.push_back(std::move(all));
    }
  }
  Flats flats;
  for (const Chunk& c : chunks_) {
    std::vector<float> flat(std::size_t(c.sizes.parameters), 0.0f);
    for (const TensorSlot& slot : c.stage->layout()) {
      const auto [k, at] = book_.at(c.base + slot.offset);
      const DataChunk& d = data_chunks_[std::size_t(k)];
      const float* from = which == 0 && part_only(k) ? params.at(std::size_t(k)).data()
                          : which == 0               ? d.part[weight_part(version)].data()
                          : !whole.empty()           ? whole[std::size_t(k)].data()
                          : which == 1               ? d.m.data()
                                                     : d.v.data();
      std::copy_n(from + at, slot.size, flat.data() + slot.offset);
    }
    flats.push_back(std::move(flat));
  }
  return flats;
}

// Into the chunks: model chunk c's flat parameters (which 0), or its Adam m (1) or v (2), of
// which each replica keeps its part (ChunkLayout::shard).
void Worker::scatter_chunks(int which, const Chunk& c, const float* flat, int version) {
  const planner::ChunkLayout& L = schedule_->layout;
  for (const TensorSlot& slot : c.stage->layout()) {
    const auto [k, at] = book_.at(c.base + slot.offset);
    DataChunk& d = data_chunks_[std::size_t(k)];
    if (which == 0 && part_only(k)) {  // its part of the tensor
      const auto [pb, pe] = L.part(replica_);
      const std::int64_t begin = std::max(at, pb), end = std::min(at + slot.size, pe);
      if (begin < end)
        std::copy_n(flat + slot.offset + (begin - at), end - begin,
                    d.host_part[weight_part(version)].data() + (begin - pb));
      continue;
    }
    if (which == 0) {
      std::copy_n(flat + slot.offset, slot.size, d.part[weight_part(version)].data() + at);
      continue;
    }
    const auto [lo, hi] = L.shard(k, replica_);
    const std::int64_t begin = std::max(at, lo), end = std::min(at + slot.size, hi);
    if (begin < end)
      std::copy_n(flat + slot.offset + (begin - at), end - begin,
                  (which == 1 ? d.m : d.v).data() + (begin - lo));
  }
}

// A chunk step's collectives with w > 1 (none with w = 1): the chunk's gradient reduce-scattered
// over the stage's replicas (`gather` false: the sum of the replica's part, in group order, the
// all-reduce's bits) or its parameters all-gathered (true); on the timeline's collective stream
// as op `op`.
void Worker::chunk_collective(int k, int step, bool gather, int op) {
  const planner::ChunkLayout& L = schedule_->layout;
  if (L.replicas == 1) return;
  DataChunk& d = data_chunks_[std::size_t(k)];
  const auto t0 = Clock::now();
  const std::string key =
      fmt::format("ck/{}.{}/{}/{}/{}", stage_, tp_, step, k, gather ? "ag" : "rs");
  // The new version's weights (the update's: step + 1) after Adam, the gradient before it.
  if (gather)
    s_.transport->all_gather(key, replica_group(), device_, d.part[weight_part(step + 1)].data(),
                             L.shard_bounds(k));
  else
    s_.transport->reduce_scatter_sum(key, replica_group(), device_, d.part[2].data(),
                                     L.shard_bounds(k));
  copy_record(planner::kCollectiveStream, t0, Clock::now(), op);
}

// Adam on the replica's part of chunk k (all of it with w = 1) for update `update`; with w > 1
// the rest of its gradient (other replicas' parts: this replica's unreduced sums) is zeroed too.
void Worker::chunk_update(int k, int update) {
  const planner::ChunkLayout& L = schedule_->layout;
  DataChunk& d = data_chunks_[std::size_t(k)];
  const auto [lo, hi] = L.shard(k, replica_);
  // Stage 0, w > 1: the head's gathered gradient joins wte's summed one (chunk_tied).
  if (!tied_head_.empty()) {
    const auto [tk, at] = book_.at(chunks_.front().base + chunks_.front().tied_offset);
    if (tk == k) {
      float* grad = d.part[2].data();
      const std::int64_t end = std::min(hi, at + std::int64_t(tied_head_.size()));
      for (std::int64_t i = std::max(lo, at); i < end; ++i)
        grad[i] = grad[i] + tied_head_[std::size_t(i - at)];
    }
  }
  // 2bw: W(t + 1) from W(t) (the newest version) into the older one's part, as the version
  // slots do without chunks; otherwise in place.
  const float* in = d.part[weight_part(update - 1)].data() + lo;
  float* out = d.part[weight_part(update)].data() + lo;
  optimizer_update(*s_.options, update, in, out, d.part[2].data() + lo, d.m.data(), d.v.data(),
                   hi - lo);
  if (L.replicas > 1) std::fill_n(d.part[2].data(), L.chunk_owned[std::size_t(k)], 0.0f);
}

bool Worker::part_only(int k) const {
  return schedule_->layout.is_sharded(k) && !schedule_->device_resident(k);
}

// Adam on the replica's part of sharded chunk k in host memory: its parameters' part (in place;
// with 2bw from the newest version's part into the older one's, as chunk_update), and the
// gradient's part that came down after the reduce-scatter on the device, or the whole gradient on
// the host (reduce-scattered there).
void Worker::part_update(int k, int update) {
  const planner::ChunkLayout& L = schedule_->layout;
  DataChunk& d = data_chunks_[std::size_t(k)];
  const auto [lo, hi] = L.shard(k, replica_);
  if (hi <= lo) return;
  const std::int64_t pb = L.part(replica_).first;  // lo == pb: the shard starts the part
  float* grad = d.grad_part.empty() ? d.part[2].data() + lo : d.grad_part.data() + (lo - pb);
  if (parts_ > 1) {
    const float* in = d.host_part[weight_part(update - 1)].data() + (lo - pb);
    float* out = d.host_part[weight_part(update)].data() + (lo - pb);
    optimizer_update(*s_.options, update, in, out, grad, d.m.data(), d.v.data(), hi - lo);
    return;
  }
  // Its parameters: the part, or in the whole chunk on the host (which holds the part then).
  float* params =
      d.host_part[0].empty() ? d.part[0].data() + lo : d.host_part[0].data() + (lo - pb);
  optimizer_update(*s_.options, update, params, params, grad, d.m.data(), d.v.data(), hi - lo);
}

bool Worker::edge_segment() const {
  return detail::edge_segment(parts_, updates_, s_.first_step, s_.programs->steps);
}

// A unit (a chunk, or with 2bw one of its parts) to the host on the device-to-host engine: the
// host buffers are taken now, the device's given back when the copy has ended. `u` is the unit's
// index in the schedule (chunk * parts + unit).
CopyEngine::Ticket Worker::download_chunk(int u, int op) {
  const int k = u / parts_, unit = u % parts_;
  DataChunk& d = data_chunks_.at(std::size_t(k));
  check_unit_move(rank_, parts_, u, d.on_device[unit], false);
  const std::int64_t e = schedule_->layout.chunk_elements;
  const std::vector<int> parts = unit_parts(parts_, unit);
  // A sharded chunk with its gradient comes down whole: its parameters' part is in it (the
  // parameters stay as they are beside the gradient half), so the host's part goes. (With 2bw
  // only a gradient part comes down whole; the versions' parts stay.)
  if (part_only(k) && parts_ == 1) {
    if (schedule_->layout.move_bytes == schedule_->layout.chunk_bytes)
      throw Error(fmt::format("rank {}: sharded chunk {} without a gradient half", rank_, k));
    d.host_part[0] = Buffer();
  }
  auto host = std::make_shared<std::vector<Buffer>>();
  for (int part : parts)
    host->emplace_back(&host_, part == 2 ? Category::gradients : Category::weights, e,
                       &host_buffers_);
  d.on_device[unit] = false;
  DataChunk* dc = &d;
  Worker* w = this;
  const bool edge = edge_segment();
  d.down[unit] = d2h_->submit([w, dc, host, parts, e, op, edge] {
    const auto t0 = Clock::now();
    for (std::size_t i = 0; i < parts.size(); ++i) {
      std::copy_n(dc->part[parts[i]].data(), e, (*host)[i].data());
      dc->part[parts[i]] = std::move((*host)[i]);  // the device's buffer goes back to the arena
    }
    w->bytes_out_ += std::int64_t(parts.size()) * e * std::int64_t(sizeof(float));
    if (edge) w->edge_bytes_out_ += std::int64_t(parts.size()) * e * std::int64_t(sizeof(float));
    w->copy_record(planner::kCopyOutStream, t0, Clock::now(), op);
  });
  return d.down[unit];
}

// A unit back to the device on the host-to-device engine, after its download and its chunk's CPU
// Adam: the device's buffers are taken now (the moment's evictions have made room), the host's
// given back when the copy has ended.
void Worker::upload_chunk(int u, int op) {
  const int k = u / parts_, unit = u % parts_;
  DataChunk& d = data_chunks_.at(std::size_t(k));
  check_unit_move(rank_, parts_, u, d.on_device[unit], true);
  const std::int64_t e = schedule_->layout.chunk_elements;
  const std::vector<int> parts = unit_parts(parts_, unit);
  auto device = std::make_shared<std::vector<Buffer>>();
  for (int part : parts)
    device->emplace_back(memory_, part == 2 ? Category::gradients : Category::weights, e, &pool_);
  d.on_device[unit] = true;
  DataChunk* dc = &d;
  Worker* w = this;
  const CopyEngine::Ticket down = d.down[unit], adam = d.adam;
  const bool edge = edge_segment();
  // A sharded chunk going up whole keeps its parameters' part on the host (2bw: a gradient part,
  // nothing to keep).
  const bool keep = part_only(k) && parts_ == 1;
  const auto [pb, pe] =
      keep ? schedule_->layout.part(replica_) : std::pair<std::int64_t, std::int64_t>{};
  d.up[unit] =
      h2d_->submit([w, dc, device, parts, e, down, adam, op, edge, keep, pb = pb, pe = pe] {
        w->d2h_->wait(down);
        w->host_cpu_->wait(adam);
        const auto t0 = Clock::now();
        for (std::size_t i = 0; i < parts.size(); ++i) {
          std::copy_n(dc->part[parts[i]].data(), e, (*device)[i].data());
          if (keep && parts[i] == 0) {
            Buffer part = std::move(dc->part[0]);
            part.keep(pb, pe);
            dc->host_part[0] = std::move(part);
          }
          dc->part[parts[i]] = std::move((*device)[i]);  // the host's buffer goes back to the pool
        }
        w->bytes_in_ += std::int64_t(parts.size()) * e * std::int64_t(sizeof(float));
        if (edge) w->edge_bytes_in_ += std::int64_t(parts.size()) * e * std::int64_t(sizeof(float));
        w->copy_record(planner::kCopyInStream, t0, Clock::now(), op);
      });
}

// Sharded chunk u's unit (a chunk; with 2bw a version's slot or the gradient part), checked to be
// one and on the device (`on_device`) or the host before `what` moves it.
Worker::DataChunk& Worker::sharded_chunk(int u, bool on_device, const char* what) {
  const int k = u / parts_;
  DataChunk& d = data_chunks_.at(std::size_t(k));
  if (!part_only(k) || d.on_device[u % parts_] != on_device)
    throw Error(fmt::format("rank {}: {} of chunk {}{}, which is not a sharded chunk on the {}",
                            rank_, what, k,
                            parts_ > 1 ? fmt::format(" (part {})", u % parts_) : std::string(),
                            on_device ? "device" : "host"));
  return d;
}

// A sharded unit without a gradient leaves the device: its buffers are freed (its parameters'
// part is on the host, the other parts on the other replicas' hosts; a 2bw gradient part without
// sums is zeros).
void Worker::drop_chunk(int u) {
  DataChunk& d = sharded_chunk(u, true, "a drop");
  d.on_device[u % parts_] = false;
  for (int part : unit_parts(parts_, u % parts_))
    d.part[part] = Buffer();
}

// A sharded unit's part to the device on the host-to-device engine: the device's buffers taken
// now, the replica's part of the parameters copied into its place, a gradient half zeroed (no
// gradient yet); gather_part then fills in the other replicas' parts. With 2bw a gradient part
// comes up as zeros, on the rank's thread (nothing to copy or gather).
void Worker::upload_part(int u, int op) {
  DataChunk& d = sharded_chunk(u, false, "a part upload");
  const planner::ChunkLayout& L = schedule_->layout;
  const std::int64_t e = L.chunk_elements;
  const int unit = u % parts_;
  for (int part : unit_parts(parts_, unit))
    d.part[part] = Buffer(memory_, part == 2 ? Category::gradients : Category::weights, e, &pool_);
  d.on_device[unit] = true;
  if (L.part_copy(u, true, false) == planner::ChunkLayout::PartCopy::zero_fill) {
    std::fill_n(d.part[2].data(), e, 0.0f);
    return;
  }
  DataChunk* dc = &d;
  Worker* w = this;
  const auto [pb, pe] = L.part(replica_);
  const CopyEngine::Ticket adam = d.adam;
  const bool edge = edge_segment(), half = parts_ == 1;
  d.up[unit] = h2d_->submit([w, dc, pb = pb, pe = pe, e, adam, op, unit, edge, half] {
    w->host_cpu_->wait(adam);
    const auto t0 = Clock::now();
    std::copy_n(dc->host_part[unit].data(), pe - pb, dc->part[unit].data() + pb);
    if (half) std::fill_n(dc->part[2].data(), e, 0.0f);
    const std::int64_t bytes = (pe - pb) * std::int64_t(sizeof(float));
    w->bytes_in_ += bytes;
    if (edge) w->edge_bytes_in_ += bytes;
    w->copy_record(planner::kCopyInStream, t0, Clock::now(), op);
  });
}

// After a part upload has ended: the unit's parameters all-gathered over the stage's replicas
// (each its part), on the rank's thread (in program order on every replica).
void Worker::gather_part(int u, int op) {
  const planner::ChunkLayout& L = schedule_->layout;
  DataChunk& d = data_chunks_.at(std::size_t(u / parts_));
  const auto t0 = Clock::now();
  s_.transport->all_gather(fmt::format("ck/{}.{}/{}/{}/ag{}", stage_, tp_, updates_, u,
                                       part_gathers_.at(std::size_t(u))++),
                           replica_group(), device_, d.part[u % parts_].data(), L.part_bounds());
  copy_record(planner::kCollectiveStream, t0, Clock::now(), op);
}

// At the optimizer step, a sharded chunk on the device: its gradient reduce-scattered over the
// stage's replicas there (on the rank's thread), then the replica's part of it down on the
// device-to-host engine; the device's buffers go when it has ended. With 2bw a version's slot is
// dropped (its part is on the host).
void Worker::download_part(int u, int step, int op) {
  if (schedule_->layout.part_copy(u, false, true) == planner::ChunkLayout::PartCopy::drop)
    return drop_chunk(u);  // 2bw: a version's slot
  DataChunk& d = sharded_chunk(u, true, "a gradient part download");
  const planner::ChunkLayout& L = schedule_->layout;
  const int k = u / parts_, unit = u % parts_;
  chunk_collective(k, step, false, op);
  const auto [pb, pe] = L.part(replica_);
  d.grad_part = Buffer(&host_, Category::gradients, L.shard_elements, &host_buffers_);
  d.on_device[unit] = false;
  DataChunk* dc = &d;
  Worker* w = this;
  const bool edge = edge_segment();
  const std::vector<int> parts = unit_parts(parts_, unit);
  d.down[unit] = d2h_->submit([w, dc, pb = pb, pe = pe, op, edge, parts] {
    const auto t0 = Clock::now();
    std::copy_n(dc->part[2].data() + pb, pe - pb, dc->grad_part.data());
    for (int part : parts)
      dc->part[part] = Buffer();  // the device's buffers go back to the arena
    const std::int64_t bytes = (pe - pb) * std::int64_t(sizeof(float));
    w->bytes_out_ += bytes;
    if (edge) w->edge_bytes_out_ += bytes;
    w->copy_record(planner::kCopyOutStream, t0, Clock::now(), op);
  });
}

// Before layer `layer` of the compute op under way: its moment's evictions (all of them ended:
// they make the room; a sharded chunk's drop at once), then its uploads (ended: the layer reads
// them), then the part uploads' all-gathers. Exposed, as the planner and the simulator run them.
// A layer's moment: the shared order (run_chunk_moment, exec/chunk_book.hpp) over the engines;
// the time the rank waits there counts as copy wait, not busy.
void Worker::chunk_moment(int layer) {
  const auto t0 = Clock::now();
  run_chunk_moment(*this, book_, layer);
  copy_wait_s_ += std::chrono::duration<double>(Clock::now() - t0).count();
}

bool Worker::part_gathered(int u) const {
  return schedule_->layout.part_copy(u, true, false) == planner::ChunkLayout::PartCopy::upload;
}

// The gathers wait for the other replicas without the core (ranks taking turns on a core would
// wait for each other's turn otherwise).
void Worker::gather_parts(const std::vector<std::pair<int, int>>& units) {
  release_core();
  for (const auto& [u, at] : units)
    gather_part(u, at);
  take_core();
}

void Worker::chunk(const Op& op) {
  if (!chunked_)
    throw Error(fmt::format("rank {}: {} in a program without offload chunks", rank_,
                            planner::to_string(op.kind)));
  route_chunk_op(*this, book_, op, op_, rank_);  // exec/chunk_book.hpp
}

void Worker::download_for_adam(const Op& op) {
  if (op.part)
    download_part(op.bucket, op.step, op_);  // its gradient's part, for CPU Adam
  else
    download_chunk(op.bucket, op_);  // for CPU Adam
}

void Worker::step_host(const Op& op, int k) {
  DataChunk& d = data_chunks_[std::size_t(k)];
  Worker* w = this;
  // The chunk's downloads (the engine runs them in order: the last one's ticket).
  const CopyEngine::Ticket down = std::max({d.down[0], d.down[1], d.down[2]});
  const int step = op.step, at = op_;
  if (op.part && d.grad_part.empty())
    throw Error(
        fmt::format("rank {}: CPU Adam of chunk {}'s part before its gradient's part "
                    "came down",
                    rank_, k));
  // A sharded chunk: the gradient's sum here only when it came down whole; Adam on the
  // replica's part; no all-gather (its next upload gathers).
  const bool sharded = part_only(k), reduced = op.part;
  const auto adam = [w, k, down, step, at, sharded, reduced] {
    w->d2h_->wait(down);
    const auto t0 = Clock::now();
    if (!reduced) w->chunk_collective(k, step, false, at);
    if (sharded) {
      w->part_update(k, step + 1);
    } else {
      w->chunk_update(k, step + 1);
      w->chunk_collective(k, step, true, at);
    }
    w->copy_record(planner::kHostStream, t0, Clock::now(), at);
  };
  // With w > 1 the replicas' collectives run on the host engine, or on the rank's thread
  // where the transport takes calls from it only (MPI).
  if (schedule_->layout.replicas > 1 && !s_.transport->concurrent()) {
    host_cpu_->drain();
    adam();
  } else {
    d.adam = host_cpu_->submit(adam);
  }
}

void Worker::step_device(const Op& op, int k) {
  // The collectives wait for the other replicas without the core (ranks taking turns on a
  // core would wait for each other's turn otherwise); Adam holds it.
  release_core();
  chunk_collective(k, op.step, false, op_);
  take_core();
  const auto t0 = Clock::now();
  chunk_update(k, op.step + 1);
  const auto t1 = Clock::now();
  busy_s_ += std::chrono::duration<double>(t1 - t0).count();
  record(planner::kComputeStream, t0, t1);
  release_core();
  chunk_collective(k, op.step, true, op_);
}

void Worker::chunk_forward(const Op& op) {
  const Key key{op.step, op.microbatch, op.chunk};
  chunk_version_ = op.version;
  release_sends(compute_ops_);
  ++compute_ops_;
  Chunk& c = chunks_.at(std::size_t(op.chunk));
  if (blocks_) return chunk_forward_blocks(op, c);
  const bool rc = s_.plan().recomputes(stage_);
  std::vector<std::int32_t> tokens, targets;
  if (c.first || c.last) samples(op, tokens, targets);
  // One stash buffer per microbatch (the stage's carving; with recompute the stage input it
  // keeps), a scratch with recompute, their bytes counted by ChunkMemory as the planner's moments
  // count them; the output to the next stage in a message buffer (counted by setup_chunks).
  Buffer stash(nullptr, Category::activations, rc ? c.sizes.stash_recompute : c.sizes.stash,
               &pool_);
  Buffer scratch(nullptr, Category::activations, rc ? c.sizes.scratch : 0, &pool_);
  Buffer out(nullptr, Category::activations, c.last ? 0 : c.sizes.output, &pool_);
  make_message_room(c.last ? 0 : 1);
  ChunkMemory memory(*this, rc ? ChunkMemory::Kind::forward_recompute : ChunkMemory::Kind::forward,
                     op.chunk);
  const float loss = timed_compute([&] {
    return c.stage->forward(memory, c.first ? tokens.data() : nullptr,
                            c.first ? nullptr : inputs_.at(key).data(),
                            c.last ? targets.data() : nullptr, s_.plan().b, rc, stash.data(),
                            c.last ? nullptr : out.data(), rc ? scratch.data() : nullptr);
  });
  book_.check_none_pending("forward");
  if (StepBook::reports_loss(c.last, tp_)) s_.add_loss(op.step, loss);
  inputs_.erase(key);
  stash_[key] = std::move(stash);
  if (!c.last) outputs_[key] = std::move(out);
}

// Block recompute: every layer's input kept (one buffer per microbatch, the stage's carving),
// the layers run through the scratch; counted by ChunkMemory as the planner's moments count them.
void Worker::chunk_forward_blocks(const Op& op, Chunk& c) {
  const Key key{op.step, op.microbatch, op.chunk};
  std::vector<std::int32_t> tokens, targets;
  if (c.first || c.last) samples(op, tokens, targets);
  Buffer kept(nullptr, Category::activations, c.stage->layer_inputs(s_.plan().b), &pool_);
  Buffer scratch(nullptr, Category::activations, c.stage->blocks_scratch(s_.plan().b), &pool_);
  Buffer out(nullptr, Category::activations, c.last ? 0 : c.sizes.output, &pool_);
  make_message_room(c.last ? 0 : 1);
  ChunkMemory memory(*this, ChunkMemory::Kind::forward_blocks, op.chunk);
  const float loss = timed_compute([&] {
    return c.stage->forward_blocks(memory, c.first ? tokens.data() : nullptr,
                                   c.first ? nullptr : inputs_.at(key).data(),
                                   c.last ? targets.data() : nullptr, s_.plan().b, kept.data(),
                                   c.last ? nullptr : out.data(), scratch.data());
  });
  book_.check_none_pending("forward");
  if (StepBook::reports_loss(c.last, tp_)) s_.add_loss(op.step, loss);
  inputs_.erase(key);
  stash_[key] = std::move(kept);
  if (!c.last) outputs_[key] = std::move(out);
}

// The recompute op of full recompute: the stash re-made layer by layer from the kept stage
// input, each layer after its moment's copies (the recompute moments of the backward after it).
// With block recompute it has no moments: each layer is re-made inside its backward's.
void Worker::chunk_recompute(const Op& op) {
  const Key key{op.step, op.microbatch, op.chunk};
  chunk_version_ = op.version;
  Chunk& c = chunks_.at(std::size_t(op.chunk));
  if (!s_.plan().recomputes(stage_))
    throw Error(fmt::format("rank {}: a recompute op on a stage without recompute", rank_));
  if (blocks_) return book_.check_none_pending("recompute");
  std::vector<std::int32_t> tokens, targets;
  if (c.last) samples(op, tokens, targets);
  Buffer full(nullptr, Category::activations, c.sizes.stash, &pool_);
  ChunkMemory memory(*this, ChunkMemory::Kind::recompute, op.chunk);
  timed_compute([&] {
    c.stage->recompute(memory, c.last ? targets.data() : nullptr, s_.plan().b,
                       stash_.at(key).data(), full.data());
    return 0.0f;
  });
  book_.check_none_pending("recompute");
  full_[key] = std::move(full);
}

void Worker::chunk_backward(const Op& op) {
  const Key key{op.step, op.microbatch, op.chunk};
  chunk_version_ = op.version;
  release_sends(compute_ops_);
  ++compute_ops_;
  Chunk& c = chunks_.at(std::size_t(op.chunk));
  const planner::Plan& p = s_.plan();
  const bool rc = p.recomputes(stage_);
  const float scale = 1.0f / float(double(p.global_batch()) * double(s_.model->seq_len));
  Buffer d_input(nullptr, Category::activations, c.first ? 0 : c.sizes.input, &pool_);
  make_message_room(c.first ? 0 : 1);
  if (blocks_) {  // each layer re-made from its kept input inside its backward's moment
    std::vector<std::int32_t> tokens, targets;
    if (c.last) samples(op, tokens, targets);
    Buffer scratch(nullptr, Category::activations, c.stage->blocks_scratch(s_.plan().b), &pool_);
    ChunkMemory memory(*this, ChunkMemory::Kind::backward_blocks, op.chunk);
    timed_compute([&] {
      c.stage->backward_blocks(memory, stash_.at(key).data(), c.last ? targets.data() : nullptr,
                               c.last ? nullptr : d_outputs_.at(key).data(), p.b, scale,
                               c.first ? nullptr : d_input.data(), workspace_.data(),
                               scratch.data());
      return 0.0f;
    });
  } else {
    ChunkMemory memory(*this, ChunkMemory::Kind::backward,
                       op.chunk);  // with recompute: the kept input too
    // Selective: the buffer each block re-makes its attention core in (its moment counts it).
    Buffer core(nullptr, Category::activations,
                book_.largest_core_bytes() / std::int64_t(sizeof(float)), &pool_);
    memory.set_core(core);
    timed_compute([&] {
      c.stage->backward(memory, (rc ? full_ : stash_).at(key).data(),
                        c.last ? nullptr : d_outputs_.at(key).data(), p.b, scale,
                        c.first ? nullptr : d_input.data(), workspace_.data());
      return 0.0f;
    });
  }
  book_.check_none_pending("backward");
  stash_.erase(key);
  full_.erase(key);
  d_outputs_.erase(key);
  if (!c.first) d_inputs_[key] = std::move(d_input);
}

// The message buffers are a pool of the book's message_buffers(): a compute op (or a receive) that
// needs one more than are free waits for the oldest sends still in flight and takes their buffers
// (the planner counts the messages a stage holds at its peak; elsewhere in the step, a gpipe last
// stage's backwards for one, a send is held no longer than a buffer is free). Received and
// produced messages are never given up: more of them than the pool holds is an error.
void Worker::make_message_room(int producing) {
  const auto held = [&] {
    std::size_t n = in_flight_.size() + std::size_t(producing);
    for (const std::map<Key, Buffer>* m : {&inputs_, &outputs_, &d_outputs_, &d_inputs_})
      n += m->size();
    return n;
  };
  const std::size_t buffers = std::size_t(book_.message_buffers());
  while (held() > buffers && !in_flight_.empty()) {
    in_flight_.front().sent.wait();
    in_flight_.pop_front();
  }
  book_.check_messages(held(), op_,
                       s_.programs->devices[std::size_t(rank_)].ops[std::size_t(op_)].kind, stage_);
  for (const std::map<Key, Buffer>* m : {&inputs_, &outputs_, &d_outputs_, &d_inputs_})
    for (const auto& [key, buffer] : *m)
      if (buffer.size() != book_.message_elements())
        throw Error(fmt::format("rank {}: a pipeline message of {} floats, not {}", rank_,
                                buffer.size(), book_.message_elements()));
}

// The tied embedding with chunks (d > 1): stage 0's wte and the last stage's copy are tensors of
// their chunks, read and written wherever the chunk is now. No copy of a chunk runs between
// compute ops (a moment's copies end inside its compute op, the step's downloads and CPU Adam in
// the optimizer step: drained here all the same), and a send takes its values out at the op, so a
// later copy or Adam of the chunk cannot race it. The last stage's copy sends its gradient (then
// zeroes it) and gets the new weights; stage 0 adds that gradient to its own (embedding + head,
// the order of the sum without chunks) and sends the weights after its Adam.
// With w > 1 the exchange is the one without chunks, shard by shard (shard_starts over the tensor):
// the last stage's replicas reduce-scatter the copy's gradient (the chunk steps sum only the
// stepped elements), replica r sends its summed shard to stage 0's replica r, whose replicas
// all-gather the head's gradient; the wte chunk's step adds it to the replica's part after that
// chunk's reduce-scatter (chunk_update), so each element is (sum of wte) + (sum of head) as without
// chunks. The weights go back shard by shard and the last stage's replicas all-gather them.
void Worker::chunk_tied(const Op& op) {
  Chunk& c = chunks_.at(std::size_t(op.chunk));  // tied(): it holds the tied tensor
  const auto [k, at] = book_.at(c.base + c.tied_offset);
  DataChunk& d = data_chunks_[std::size_t(k)];
  const std::int64_t n = c.tied_size;
  const int w = s_.plan().w;
  const planner::TiedShard sh = planner::tied_shard(n, w, replica_);
  d2h_->drain();
  h2d_->drain();
  host_cpu_->drain();
  Worker* self = this;
  const int op_at = op_, src = device_;
  const int dst = op.peer >= 0 ? device_of(op.peer) : -1;
  const auto send = [&](Channel channel, const float* from) {
    auto message = std::make_shared<std::vector<float>>(from + sh.begin, from + sh.end);
    issue(send_engine_.get(), [self, message, channel, op_at, src, dst] {
      const auto t1 = Clock::now();
      self->s_.transport->send(src, dst, channel, std::move(*message));
      self->copy_record(planner::kSendStream, t1, Clock::now(), op_at);
    });
  };
  const auto recv = [&](Channel channel) {
    std::vector<float> got = s_.transport->recv(dst, device_, channel);
    if (std::int64_t(got.size()) != sh.end - sh.begin)
      throw Error(fmt::format("rank {}: {} of {} floats, the tied tensor's shard has {}", rank_,
                              planner::to_string(op.kind), got.size(), sh.end - sh.begin));
    return got;
  };
  const auto t0 = Clock::now();
  switch (op.kind) {
    case OpKind::send_tied_gradient: {
      float* grad = d.part[2].data() + at;
      if (w > 1) {
        s_.transport->reduce_scatter_sum(fmt::format("ck/tg/{}.{}/{}", stage_, tp_, op.step),
                                         replica_group(), device_, grad, shard_starts(n, 0, w));
        record(planner::kCollectiveStream, t0, Clock::now());
      }
      send(Channel::tied, grad);
      std::fill_n(grad, n, 0.0f);  // the next step accumulates from zero
      return;
    }
    case OpKind::recv_tied_gradient: {
      const std::vector<float> head = recv(Channel::tied);
      if (w > 1) {
        tied_head_.assign(std::size_t(n), 0.0f);
        std::copy(head.begin(), head.end(), tied_head_.begin() + sh.begin);
      } else {
        float* grad = d.part[2].data() + at;
        for (std::int64_t i = 0; i < n; ++i)
          grad[i] = grad[i] + head[std::size_t(i)];
      }
      record(planner::kRecvStream, t0, Clock::now());
      return;
    }
    case OpKind::gather_tied_gradient:
      if (std::int64_t(tied_head_.size()) != n)
        throw Error(fmt::format("rank {}: gather_tied_gradient before recv_tied_gradient", rank_));
      s_.transport->all_gather(fmt::format("ck/tgg/{}.{}/{}", stage_, tp_, op.step),
                               replica_group(), device_, tied_head_.data(), shard_starts(n, 0, w));
      record(planner::kCollectiveStream, t0, Clock::now());
      return;
    case OpKind::send_tied_weights:
      send(Channel::tied_weights, d.part[weight_part(op.version)].data() + at);
      return;
    case OpKind::recv_tied_weights: {
      const std::vector<float> got = recv(Channel::tied_weights);
      float* out = d.part[weight_part(op.version)].data() + at;
      if (w > 1) std::fill_n(out, n, 0.0f);
      std::copy(got.begin(), got.end(), out + sh.begin);
      record(planner::kRecvStream, t0, Clock::now());
      return;
    }
    default:  // gather_tied_weights
      s_.transport->all_gather(fmt::format("ck/tgw/{}.{}/{}", stage_, tp_, op.version),
                               replica_group(), device_,
                               d.part[weight_part(op.version)].data() + at, shard_starts(n, 0, w));
      record(planner::kCollectiveStream, t0, Clock::now());
      return;
  }
}

// The step's Adam has run on the device (chunk_step_device) and is running on the host: the
// optimizer step waits for the host's, and the chunks are where the next step starts.
void Worker::chunk_optimizer_step(const Op& op) {
  if (book_.pending())
    throw Error(fmt::format("rank {}: chunk copies left before the optimizer step", rank_));
  d2h_->drain();
  host_cpu_->drain();
  tied_head_ = {};  // w > 1: added by the wte chunk's step
  // Sharded chunks: what the step held on the host beside their parts (the gradients' parts,
  // the chunks that came down whole with their gradients) goes.
  for (int k = 0; k < int(data_chunks_.size()); ++k) {
    DataChunk& d = data_chunks_[std::size_t(k)];
    if (!part_only(k)) continue;
    d.grad_part = Buffer();
    if (parts_ > 1) {  // 2bw: a gradient that came down whole goes (the next is zeros)
      if (!d.on_device[2]) d.part[2] = Buffer();
      continue;
    }
    if (!d.on_device[0] && d.host_part[0].empty()) {  // it came down whole: its part is kept
      const auto [pb, pe] = schedule_->layout.part(replica_);
      d.part[0].keep(pb, pe);
      d.host_part[0] = std::move(d.part[0]);
      d.part[2] = Buffer();
    }
  }
  std::fill(part_gathers_.begin(), part_gathers_.end(), 0);
  ++updates_;
  slots_.advance(op.version);  // the weights are in the chunks
  s_.end_step(op.step, [this](int done) { save_checkpoint(done); });
  // Sharded chunks: their final parameters gathered while every replica is here (result() cannot;
  // the last stage's tied copy, whole, may still arrive after this), after the step's end: they
  // are the run's result, not its training, so the last step's time leaves them out.
  if (schedule_->layout.part_bytes > 0 && op.step == s_.first_step + s_.programs->steps - 1)
    final_parts_ = gather_parts(updates_);
}

}  // namespace pw::exec::detail
