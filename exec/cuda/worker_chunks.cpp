// Offload chunks (PatrickStar) in the CUDA worker (worker.hpp, DataChunk): the CPU worker's rules
// (exec/worker_chunks.cpp) on the device, through the same chunk book (exec/chunk_book.hpp): where
// each tensor lives, each layer's activation bytes as the planner's moments count them, the
// messages the plan counts and the program's copies held until the layer they run before. The
// moves are cudaMemcpyAsync between device tensors and each chunk's pinned host block on the two
// copy streams; Adam runs on the device (the optimizer kernel) for chunks 0 .. K-1 and as CPU Adam
// (exec/optimizer.cpp) in host functions on the host stream for the rest. docs/formulas.md
// section 9 (chunks); docs/formats.md, offload in the executors.
// Compile-checked only: no GPU has run this file (tests/test_cuda_offload.cpp's chunk tests skip
// without one).
#include <algorithm>
#include <cstring>

#include <fmt/format.h>

#include "exec/cuda/optimizer.cuh"
#include "exec/cuda/worker.hpp"
#include "exec/optimizer.hpp"
#include "planner/chunks.hpp"

namespace pw::exec::cuda::detail {

using planner::Op;
using planner::OpKind;

namespace {
Category part_category(int part) {
  return part == 2 ? Category::gradients : Category::weights;
}
}  // namespace

// The stage's view of the chunks during a compute op, the CPU worker's ChunkMemory on the device:
// before each layer its moment's copies run (chunk_moment), then its activations are counted as
// the planner's moments count them (ChunkBook::Pass); a tensor's address is its unit's device part
// (the layer's units are on the device: an upload's event is waited for by the compute stream).
class CudaWorker::ChunkMemory : public DeviceLayerMemory {
 public:
  using Kind = ChunkPass;
  ChunkMemory(CudaWorker& w, Kind kind, int c)
      : w_(w),
        kind_(kind),
        chunk_(c),
        first_(w.book_.first_layer(c)),
        base_(w.chunks_.at(std::size_t(c)).base) {
    // Selective recompute: the buffer a backward's blocks re-make their attention probabilities
    // in, one after another (an uncounted block: each block's moment counts its core).
    if (kind == Kind::backward && w.book_.largest_core_bytes() > 0)
      core_ = w.transient(Category::activations, w.book_.largest_core_bytes());
  }
  ~ChunkMemory() override { w_.retire(std::move(core_), w_.compute_); }
  ChunkMemory(const ChunkMemory&) = delete;
  ChunkMemory& operator=(const ChunkMemory&) = delete;
  void begin_layer(int layer, bool) override {
    w_.chunk_moment(first_ + layer);
    w_.memory_.add(Category::activations, w_.book_.begin_layer(kind_, chunk_, layer));
  }
  void end_layer(int layer, bool) override {
    w_.memory_.add(Category::activations, w_.book_.end_layer(kind_, chunk_, layer));
  }
  // The weights of the op's version (2bw: its part of the chunk) and the gradient.
  const bf16* parameters(std::int64_t offset) override {
    return find(offset, w_.weight_part(w_.chunk_version_));
  }
  bf16* gradients(std::int64_t offset) override { return find(offset, 2); }
  bf16* attention_core(int layer) override {
    const std::int64_t bytes = w_.book_.core_bytes(first_ + layer);
    if (bytes == 0) return nullptr;
    if (bytes != core_.bytes())
      throw Error(fmt::format("rank {}: layer {}'s attention core is {} B, its buffer {} B",
                              w_.rank_, first_ + layer, bytes, core_.bytes()));
    return core_.as<bf16>();
  }

 private:
  bf16* find(std::int64_t offset, int part) {
    const auto [k, at] = w_.book_.at(base_ + offset);
    DataChunk& d = w_.data_chunks_[std::size_t(k)];
    const int unit = w_.parts_ == 1 ? 0 : part;
    if (!d.on_device[unit])
      throw Error(fmt::format("rank {}: a layer uses chunk {}{}, which is on the host", w_.rank_, k,
                              w_.parts_ > 1 ? fmt::format(" (part {})", unit) : std::string()));
    return d.part[part].as<bf16>() + at;
  }
  CudaWorker& w_;
  Kind kind_;
  int chunk_, first_;  // the model chunk; its first layer in the stage's
  std::int64_t base_;
  Tensor core_;
};

bool CudaWorker::edge_segment() const {
  return exec::detail::edge_segment(parts_, updates_, s_.first_step, s_.programs->steps);
}

bf16* CudaWorker::host_part(DataChunk& d, int part) const {
  const int index = parts_ == 1 ? (part == 2 ? 1 : 0) : part;
  return d.host.as<bf16>() + index * schedule_->layout.chunk_elements;
}

// The chunks as the schedule starts a step (its fixed point): each unit on the device or in its
// pinned host block, each chunk's fp32 master (the initial weights, unrounded) and zero Adam
// moments on the device for chunks 0 .. K-1, else in host memory. `initial`: each model chunk's
// fp32 initial weights.
void CudaWorker::setup_chunks(const std::vector<std::vector<float>>& initial) {
  const planner::Plan& p = s_.plan();
  schedule_ = exec::detail::stage_chunk_schedule(*s_.programs, stage_, rank_);
  const planner::ChunkLayout& L = schedule_->layout;
  // What prepare_run lets through (w = 1, m > 1), checked against the schedule itself.
  if (L.replicas != 1 || L.part_bytes > 0)
    throw Error(
        fmt::format("rank {}: the cuda executor's chunks run one replica per stage", rank_));
  if (L.parts == 1 && L.move_bytes != 2 * L.chunk_bytes)
    throw Error(fmt::format(
        "rank {}: chunks without a gradient half (m = 1), which the cuda executor does not run",
        rank_));
  if (swaps_) throw Error(fmt::format("rank {}: offload chunks with swapped stashes", rank_));
  std::vector<exec::detail::BookChunk> book;
  for (const Chunk& c : chunks_)
    book.push_back({&c.stage->layout(), c.base, c.tied_offset, c.first, c.last, c.sizes, 0, 0});
  const auto [embedding, head] = exec::detail::tied_ends_on_one_device(chunks_);
  book_ = exec::detail::ChunkBook(
      *schedule_, book, embedding ? int(embedding - chunks_.data()) : -1,
      head ? int(head - chunks_.data()) : -1, *s_.model, p, stage_, rank_, int(sizeof(bf16)));
  // The pipeline messages the plan counts, on the device for the whole run (setup_chunks of the
  // CPU worker); the messages themselves are uncounted blocks, never more than that at once.
  memory_.add(Category::activations, book_.message_bytes());
  parts_ = L.parts;
  const std::int64_t e = L.chunk_elements, se = L.shard_elements;
  const int host_parts = parts_ == 1 ? 2 : 3;
  data_chunks_.resize(std::size_t(L.chunks()));
  // Each chunk's bf16 image (every live version's part, zero gradients) and fp32 master.
  std::vector<std::vector<bf16>> images(
      std::size_t(L.chunks()),
      std::vector<bf16>(std::size_t(host_parts * e), __float2bfloat16(0.0f)));
  std::vector<std::vector<float>> masters(std::size_t(L.chunks()),
                                          std::vector<float>(std::size_t(se), 0.0f));
  const std::vector<int> versions = planner::initial_versions(p, s_.first_step);
  for (std::size_t i = 0; i < chunks_.size(); ++i) {
    const Chunk& c = chunks_[i];
    for (const TensorSlot& slot : c.stage->layout()) {
      const auto [k, at] = book_.at(c.base + slot.offset);
      const float* from = initial.at(i).data() + slot.offset;
      const std::vector<bf16> rounded = to_bf16(from, slot.size);
      for (int version : versions) {
        const int index = parts_ == 1 ? 0 : weight_part(version);
        std::copy(rounded.begin(), rounded.end(), images[std::size_t(k)].begin() + index * e + at);
      }
      const std::int64_t end = std::min(at + slot.size, se);
      if (at < end) std::copy_n(from, end - at, masters[std::size_t(k)].begin() + at);
    }
  }
  for (int k = 0; k < L.chunks(); ++k) {
    DataChunk& d = data_chunks_[std::size_t(k)];
    d.host = PinnedBuffer(uncounted_, Category::weights, 2 * host_parts * e);
    std::memcpy(d.host.as<void>(), images[std::size_t(k)].data(), std::size_t(2 * host_parts * e));
    for (int u = 0; u < parts_; ++u) {
      d.on_device[u] = schedule_->start_on_device[std::size_t(k * parts_ + u)];
      for (int part : exec::detail::unit_parts(parts_, u)) {
        if (!d.on_device[u]) {
          host_.add(part_category(part), 2 * e);
          continue;
        }
        d.part[part] = tensor(part_category(part), 2 * e);
        CUDA_CHECK(cudaMemcpy(d.part[part].as<void>(), host_part(d, part), std::size_t(2 * e),
                              cudaMemcpyHostToDevice));
      }
    }
    if (schedule_->device_resident(k)) {
      d.master_d = tensor(Category::optimizer, 4 * se);
      d.m_d = tensor(Category::optimizer, 4 * se);
      d.v_d = tensor(Category::optimizer, 4 * se);
      CUDA_CHECK(cudaMemcpy(d.master_d.as<void>(), masters[std::size_t(k)].data(),
                            std::size_t(4 * se), cudaMemcpyHostToDevice));
      CUDA_CHECK(cudaMemset(d.m_d.as<void>(), 0, std::size_t(4 * se)));
      CUDA_CHECK(cudaMemset(d.v_d.as<void>(), 0, std::size_t(4 * se)));
    } else {
      d.master_h = Buffer(&host_, Category::optimizer, std::move(masters[std::size_t(k)]));
      d.m_h = Buffer(&host_, Category::optimizer, se);
      d.v_h = Buffer(&host_, Category::optimizer, se);
    }
  }
}

bf16* CudaWorker::chunk_tensor(std::int64_t flat, int part) {
  const auto [k, at] = book_.at(flat);
  DataChunk& d = data_chunks_[std::size_t(k)];
  const int unit = parts_ == 1 ? 0 : part;
  return (d.on_device[unit] ? d.part[part].as<bf16>() : host_part(d, part)) + at;
}

void CudaWorker::after_chunk_moves(std::int64_t flat) {
  const DataChunk& d = data_chunks_[std::size_t(book_.at(flat).first)];
  for (int u = 0; u < parts_; ++u) {
    wait(compute_, d.down[u]);
    wait(compute_, d.up[u]);
  }
  wait(compute_, d.adam);
}

// A unit to its pinned host block on the device-to-host stream, after the compute stream's work so
// far (the layers that used it, its device Adam, a tied exchange): the host block counted now, the
// device's tensors retired on the copy stream (back to the arena, and out of the counter, once it
// has passed them). `u`: the unit's index in the schedule (chunk * parts + unit).
void CudaWorker::download_chunk(int u, int op) {
  const int k = u / parts_, unit = u % parts_;
  DataChunk& d = data_chunks_.at(std::size_t(k));
  exec::detail::check_unit_move(rank_, parts_, u, d.on_device[unit], false);
  const std::int64_t e = schedule_->layout.chunk_elements;
  const std::vector<int> parts = exec::detail::unit_parts(parts_, unit);
  const cudaEvent_t before = record(compute_);
  wait(d2h_, before);
  pool_.push_back(before);
  timed(planner::kCopyOutStream, d2h_, op, [&] {
    for (int part : parts)
      CUDA_CHECK(cudaMemcpyAsync(host_part(d, part), d.part[part].as<void>(), std::size_t(2 * e),
                                 cudaMemcpyDeviceToHost, d2h_));
  });
  for (int part : parts) {
    host_.add(part_category(part), 2 * e);
    retire(std::move(d.part[part]), d2h_);
  }
  const std::int64_t bytes = std::int64_t(parts.size()) * 2 * e;
  bytes_out_ += bytes;
  if (edge_segment()) edge_bytes_out_ += bytes;
  d.on_device[unit] = false;
  if (d.down[unit]) pool_.push_back(d.down[unit]);
  d.down[unit] = record(d2h_);
}

// A unit back to the device on the host-to-device stream, after the compute stream's work so far,
// its download and its chunk's CPU Adam: the device's tensors taken now (the moment's evictions
// have given theirs back), the host block uncounted; the compute stream waits for the copy.
void CudaWorker::upload_chunk(int u, int op) {
  const int k = u / parts_, unit = u % parts_;
  DataChunk& d = data_chunks_.at(std::size_t(k));
  exec::detail::check_unit_move(rank_, parts_, u, d.on_device[unit], true);
  const std::int64_t e = schedule_->layout.chunk_elements;
  const std::vector<int> parts = exec::detail::unit_parts(parts_, unit);
  const cudaEvent_t before = record(compute_);
  wait(h2d_, before);
  pool_.push_back(before);
  wait(h2d_, d.down[unit]);
  wait(h2d_, d.adam);
  for (int part : parts)
    d.part[part] = tensor(part_category(part), 2 * e);
  timed(planner::kCopyInStream, h2d_, op, [&] {
    for (int part : parts)
      CUDA_CHECK(cudaMemcpyAsync(d.part[part].as<void>(), host_part(d, part), std::size_t(2 * e),
                                 cudaMemcpyHostToDevice, h2d_));
  });
  for (int part : parts)
    host_.add(part_category(part), -2 * e);
  const std::int64_t bytes = std::int64_t(parts.size()) * 2 * e;
  bytes_in_ += bytes;
  if (edge_segment()) edge_bytes_in_ += bytes;
  d.on_device[unit] = true;
  if (d.up[unit]) pool_.push_back(d.up[unit]);
  d.up[unit] = record(h2d_);
  wait(compute_, d.up[unit]);
}

// Before layer `layer` of the compute op under way, its moment in the shared order
// (run_chunk_moment, exec/chunk_book.hpp): the host waits for the evictions (their tensors back in
// the arena before the uploads take theirs, as the CPU worker drains its engine), the compute
// stream for the uploads (after_chunk_moves, per tensor).
void CudaWorker::chunk_moment(int layer) {
  exec::detail::run_chunk_moment(*this, book_, layer);
}

void CudaWorker::evictions_done(bool any) {
  if (!any) return;
  const cudaEvent_t evicted = record(d2h_);
  host_wait(evicted, "evict chunks");
  pool_.push_back(evicted);
  reclaim(false);
}

void CudaWorker::drop_chunk(int) {
  throw Error(fmt::format(
      "rank {}: a sharded chunk's drop; the cuda executor's chunks are not sharded", rank_));
}

void CudaWorker::upload_part(int, int) {
  throw Error(fmt::format(
      "rank {}: a sharded chunk's part upload; the cuda executor's chunks are not sharded", rank_));
}

void CudaWorker::chunk(const Op& op) {
  if (!chunked_)
    throw Error(fmt::format("rank {}: {} in a program without offload chunks", rank_,
                            planner::to_string(op.kind)));
  if (op.part)
    throw Error(
        fmt::format("rank {}: {} of a sharded chunk's part; the cuda executor's chunks are "
                    "not sharded",
                    rank_, planner::to_string(op.kind)));
  exec::detail::route_chunk_op(*this, book_, op, op_, rank_);  // exec/chunk_book.hpp
}

// Adam on the device for chunk k's stepped elements (chunk_owned: not the last stage's tied copy),
// update `update`: the fp32 master and moments, the new bf16 weights into the update's part (2bw:
// the older version's; else in place), the gradient half zeroed (the kernel's rule).
void CudaWorker::step_device(const Op& op, int k) {
  const int update = op.step + 1;
  const planner::ChunkLayout& L = schedule_->layout;
  DataChunk& d = data_chunks_[std::size_t(k)];
  begin_timed(planner::kComputeStream, compute_);
  adamw_update(d.master_d.as<float>(), d.part[weight_part(update)].as<bf16>(), d.part[2].as<bf16>(),
               d.m_d.as<float>(), d.v_d.as<float>(), L.chunk_owned[std::size_t(k)],
               adamw_params(*s_.options), update, compute_);
  end_timed(compute_);
}

// CPU Adam for chunk k on the host stream, after its units' downloads and the compute stream: the
// CPU worker's optimizer_update on the fp32 master and moments, the gradient read from the pinned
// block's bf16 half a tile at a time, the new weights rounded into the update's part there, the
// gradient zeroed.
void CudaWorker::step_host(const Op& step, int k) {
  const int update = step.step + 1, op = op_;
  const planner::ChunkLayout& L = schedule_->layout;
  DataChunk& d = data_chunks_[std::size_t(k)];
  for (int u = 0; u < parts_; ++u)
    wait(host_stream_, d.down[u]);
  // And after the compute stream's work so far: a tied gradient added into the chunk's host
  // block there (recv_tied_gradient after its download) is in the sum.
  const cudaEvent_t before = record(compute_);
  wait(host_stream_, before);
  pool_.push_back(before);
  const TrainOptions* options = s_.options;
  float* master = d.master_h.data();
  float* m = d.m_h.data();
  float* v = d.v_h.data();
  bf16* weights = host_part(d, weight_part(update));
  bf16* grads = host_part(d, 2);
  const std::int64_t n = L.chunk_owned[std::size_t(k)];
  timed(planner::kHostStream, host_stream_, op, [&] {
    host_function(host_stream_, [options, update, master, m, v, weights, grads, n] {
      constexpr std::int64_t kTile = 4096;
      float grad[kTile];
      for (std::int64_t i0 = 0; i0 < n; i0 += kTile) {
        const std::int64_t count = std::min(kTile, n - i0);
        for (std::int64_t j = 0; j < count; ++j)
          grad[j] = __bfloat162float(grads[i0 + j]);
        optimizer_update(*options, update, master + i0, master + i0, grad, m + i0, v + i0, count);
        for (std::int64_t j = 0; j < count; ++j) {
          weights[i0 + j] = __float2bfloat16(master[i0 + j]);
          grads[i0 + j] = __float2bfloat16(0.0f);
        }
      }
    });
  });
  if (d.adam) pool_.push_back(d.adam);
  d.adam = record(host_stream_);
}

// The messages a stage holds (received, produced): at most the book's buffers, the planner's
// count, or one line naming the rank and op.
void CudaWorker::check_messages(int producing) {
  const std::size_t held = inputs_.size() + outputs_.size() + d_outputs_.size() + d_inputs_.size() +
                           std::size_t(producing);
  book_.check_messages(held, op_,
                       s_.programs->devices[std::size_t(rank_)].ops[std::size_t(op_)].kind, stage_);
}

std::unique_ptr<DeviceLayerMemory> CudaWorker::chunk_memory(ChunkPass pass, const Op& op,
                                                            int producing) {
  if (!chunked_) return nullptr;
  chunk_version_ = op.version;
  check_messages(producing);
  return std::make_unique<ChunkMemory>(*this, pass, op.chunk);
}

// The step's Adam has been enqueued on the device (step_device) and the host stream (step_host):
// the optimizer step ends after the host's and the step's downloads (the CPU worker drains its
// engines here), and the chunks are where the next step starts.
void CudaWorker::chunk_optimizer_step(const Op& op) {
  if (book_.pending())
    throw Error(fmt::format("rank {}: chunk copies left before the optimizer step", rank_));
  for (cudaStream_t s : {host_stream_, d2h_}) {
    const cudaEvent_t done = record(s);
    wait(compute_, done);
    pool_.push_back(done);
  }
  ++updates_;
  slots_.advance(op.version);  // the weights are in the chunks
  end_of_step(op.step);
  reclaim(false);  // the step's downloads' device tensors (the compute stream passed them)
}

void CudaWorker::chunk_checkpoint(const ShardLayout& shard, bool save) {
  const std::int64_t se = schedule_->layout.shard_elements;
  const std::vector<int>& versions = shard.versions();
  for (std::size_t i = 0; i < chunks_.size(); ++i) {
    const Chunk& c = chunks_[i];
    for (std::size_t j = 0; j < versions.size(); ++j) {
      const int version = versions[j];
      float* flat = shard.weights(i, j).data;
      for (const TensorSlot& slot : c.stage->layout()) {
        bf16* at = chunk_tensor(c.base + slot.offset, weight_part(version));
        std::vector<bf16> w(std::size_t(slot.size));
        if (save) {
          // cudaMemcpyDefault: the unit's device tensor or its pinned host block (UVA).
          CUDA_CHECK(cudaMemcpy(w.data(), at, std::size_t(2 * slot.size), cudaMemcpyDefault));
          const std::vector<float> f = to_float(w.data(), slot.size);
          std::copy(f.begin(), f.end(), flat + slot.offset);
        } else {  // bf16 values stored as fp32: rounding them back is exact
          w = to_bf16(flat + slot.offset, slot.size);
          CUDA_CHECK(cudaMemcpy(at, w.data(), std::size_t(2 * slot.size), cudaMemcpyDefault));
        }
      }
    }
    // master, m, v: each tensor's elements of its chunk's state (a chunk's state covers its first
    // shard_elements, every parameter with w = 1).
    for (std::size_t which = 0; which < shard.states(); ++which) {
      float* flat = shard.state(i, which).data;
      for (const TensorSlot& slot : c.stage->layout()) {
        const auto [chunk, at] = book_.at(c.base + slot.offset);
        const std::int64_t n = std::min(at + slot.size, se) - at;
        if (n <= 0) continue;
        DataChunk& d = data_chunks_[std::size_t(chunk)];
        const bool device = schedule_->device_resident(chunk);
        float* state = device ? (which == 0   ? d.master_d.as<float>()
                                 : which == 1 ? d.m_d.as<float>()
                                              : d.v_d.as<float>())
                              : (which == 0   ? d.master_h.data()
                                 : which == 1 ? d.m_h.data()
                                              : d.v_h.data());
        float* from = save ? state + at : flat + slot.offset;
        float* to = save ? flat + slot.offset : state + at;
        if (device)
          CUDA_CHECK(cudaMemcpy(to, from, std::size_t(4 * n),
                                save ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice));
        else
          std::copy_n(from, n, to);
      }
    }
  }
}

// Each model chunk's newest weights out of the chunks (after the run: every stream is idle), as
// fp32 (bf16 values, exact).
std::vector<std::vector<float>> CudaWorker::chunk_weights() {
  std::vector<std::vector<float>> out;
  const int part = weight_part(slots_.newest());
  for (const Chunk& c : chunks_) {
    std::vector<bf16> w(std::size_t(c.sizes.parameters));
    for (const TensorSlot& slot : c.stage->layout())
      CUDA_CHECK(cudaMemcpy(w.data() + slot.offset, chunk_tensor(c.base + slot.offset, part),
                            std::size_t(2 * slot.size), cudaMemcpyDefault));
    out.push_back(to_float(w.data(), c.sizes.parameters));
  }
  return out;
}

}  // namespace pw::exec::cuda::detail
