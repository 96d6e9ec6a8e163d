// One rank's GPU worker (see worker.hpp): the program's ops as stream-ordered GPU work.
#include "exec/cuda/worker.hpp"

#include <algorithm>
#include <cstring>
#include <thread>

#include <fmt/format.h>

#include "exec/checkpoint.hpp"
#include "exec/cuda/kernels.cuh"
#include "exec/cuda/optimizer.cuh"
#include "exec/optimizer.hpp"

namespace pw::exec::cuda::detail {

using planner::Op;
using planner::OpKind;

Tensor::Tensor(DeviceArena& arena, MemoryCounter& counter, Category category, std::int64_t bytes)
    : block_(arena, category, bytes), counter_(&counter), category_(category) {
  counter_->add(category_, bytes);
}

Tensor& Tensor::operator=(Tensor&& o) noexcept {
  if (this != &o) {
    release();
    block_ = std::move(o.block_);
    counter_ = o.counter_;
    category_ = o.category_;
    o.counter_ = nullptr;
  }
  return *this;
}

Tensor::~Tensor() {
  release();
}

void Tensor::release() {
  if (counter_ && block_.bytes() > 0) counter_->add(category_, -block_.bytes());
  counter_ = nullptr;
  block_ = DeviceBuffer();
}

PinnedBuffer::PinnedBuffer(MemoryCounter& counter, Category category, std::int64_t bytes)
    : bytes_(bytes), category_(category) {
  if (bytes > 0) CUDA_CHECK(cudaHostAlloc(&data_, std::size_t(bytes), cudaHostAllocDefault));
  counter_ = &counter;
  counter_->add(category_, bytes_);
}

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& o) noexcept {
  if (this != &o) {
    release();
    data_ = o.data_;
    bytes_ = o.bytes_;
    counter_ = o.counter_;
    category_ = o.category_;
    o.data_ = nullptr;
    o.counter_ = nullptr;
  }
  return *this;
}

PinnedBuffer::~PinnedBuffer() {
  release();
}

void PinnedBuffer::release() {
  if (counter_ && bytes_ > 0) counter_->add(category_, -bytes_);
  counter_ = nullptr;
  if (data_) (void)cudaFreeHost(data_);
  data_ = nullptr;
}

CudaWorker::CudaWorker(GpuShared& s, int device, MemoryCounter& counter)
    : s_(s),
      transport_(*s.transport),
      device_(device),
      rank_(device / s.plan().t),
      tp_(device % s.plan().t),
      t_(s.plan().t),
      stage_(s.plan().stage_of(rank_)),
      replica_(s.plan().replica_of(rank_)),
      memory_(counter) {
  CUDA_CHECK(cudaSetDevice(s.device));
  for (cudaStream_t* st : all_streams())
    CUDA_CHECK(cudaStreamCreateWithFlags(st, cudaStreamNonBlocking));
  slots_.set_rank(rank_);
  const planner::Plan& p = s.plan();
  offload_optimizer_ = p.offload == planner::Offload::optimizer;
  chunked_ = p.offload == planner::Offload::chunks;
  offload_sharded_ = p.offload_sharded();  // the distributed optimizer is on (planner::check)
  sharded_ = p.distributed_optimizer && p.w > 1;
  swaps_ = p.swaps(stage_);
  if (offload_sharded_ && !sharded_)
    throw Error(fmt::format(
        "rank {}: optimizer offload with w = {} without the distributed optimizer", rank_, p.w));
  std::int64_t workspace = 0;
  // Each chunk's fp32 initial weights (optimizer offload, the distributed optimizer's shards).
  std::vector<std::vector<float>> initial;
  for (int c = 0; c < p.v; ++c) {
    // t > 1: this device's shard (its heads, FFN columns, vocabulary rows; SP's rows).
    const StageSpec spec = exec::detail::shard_spec(*s.model, p, stage_, c, tp_);
    Chunk ch;
    ch.stage = std::make_unique<CudaGptStage>(spec, *s.arena, compute_);
    // The stage's cuBLASLt workspace and status word are this rank's memory too.
    memory_.add(Category::workspace, ch.stage->internal_bytes());
    ch.sizes = ch.stage->sizes(p.b);
    ch.first = spec.has_embedding;
    ch.last = spec.has_head;
    const std::int64_t n = ch.sizes.parameters;
    // Offload chunks: the weights, gradients and optimizer state live in the chunks (setup_chunks).
    if (!chunked_) ch.slots[0] = tensor(Category::weights, 2 * n);
    // Optimizer offload: gradients leave the device layer by layer (sharded, w > 1: summed on the
    // device for the reduce-scatter, as without offload) and the master weights and the optimizer
    // state live on the host (setup_offload). The distributed optimizer: the state of the rank's
    // shard only, allocated below.
    const bool grads = !chunked_ && (!offload_optimizer_ || offload_sharded_);
    if (grads) ch.grads = tensor(Category::gradients, 2 * n);
    const bool whole = !chunked_ && !offload_optimizer_ && !sharded_;
    if (whole) {
      ch.master = tensor(Category::optimizer, 4 * n);
      ch.m = tensor(Category::optimizer, 4 * n);
      if (s.options->optimizer == "adamw") ch.v = tensor(Category::optimizer, 4 * n);
      ch.own_end = n;
      ch.master_at = ch.master.as<float>();
      ch.m_at = ch.m.as<float>();
      ch.v_at = ch.v.bytes() > 0 ? ch.v.as<float>() : nullptr;
    }
    // The CPU backend's initialisation (fp32, deterministic in seed and tensor name), rounded.
    std::vector<float> host(std::size_t(n), 0.0f);
    make_cpu_stage(spec)->init_parameters(host.data(), s.options->seed);
    if (!chunked_)
      ch.stage->upload_parameters(host.data(), ch.slots[0].as<bf16>(),
                                  whole ? ch.master.as<float>() : nullptr);
    if (grads) CUDA_CHECK(cudaMemsetAsync(ch.grads.as<void>(), 0, std::size_t(2 * n), compute_));
    if (whole) {
      CUDA_CHECK(cudaMemsetAsync(ch.m.as<void>(), 0, std::size_t(4 * n), compute_));
      if (ch.v.bytes() > 0)
        CUDA_CHECK(cudaMemsetAsync(ch.v.as<void>(), 0, std::size_t(4 * n), compute_));
    } else {
      initial.push_back(std::move(host));
    }
    if (s.model->tied_embeddings && ch.first != ch.last)
      for (const auto& slot : ch.stage->layout())
        if (slot.name == (ch.first ? "wte" : "lm_head")) {
          ch.tied_offset = slot.offset;
          ch.tied_size = slot.size;
        }
    workspace = std::max(workspace, ch.sizes.workspace);
    ch.base = flat_;
    flat_ += n;
    chunks_.push_back(std::move(ch));
  }
  if (sharded_ && !offload_optimizer_ && !chunked_) setup_shards(initial);
  workspace_ = tensor(Category::workspace, 2 * workspace);
  // Tensor parallelism: the TP group's sums on the compute stream, in program order on every member
  // (the group: this pipeline rank's t devices); the cross-entropy's statistics in the workspace.
  const std::vector<int> tp_group = exec::detail::tp_group(rank_, t_);
  for (Chunk& ch : chunks_) {
    CudaGptStage::Tp tp;
    if (t_ > 1) {
      tp.sum = [this, tp_group](void* data, std::int64_t count, bool fp32) {
        transport_.all_reduce_sum(tp_group, device_, data, count, fp32 ? DType::fp32 : DType::bf16,
                                  compute_);
      };
      // SP: the group's equal parts of `count` elements, TP rank k's at k count / t.
      const auto parts = [t = t_](std::int64_t count) {
        return exec::detail::equal_parts(count, t);
      };
      tp.all_gather = [this, tp_group, parts](bf16* data, std::int64_t count) {
        transport_.all_gather(tp_group, device_, data, parts(count), DType::bf16, compute_);
      };
      tp.reduce_scatter = [this, tp_group, parts](bf16* data, std::int64_t count) {
        transport_.reduce_scatter_sum(tp_group, device_, data, parts(count), DType::bf16, compute_);
      };
    }
    tp.workspace = workspace_.as<bf16>();
    tp.workspace_elements = workspace;
    ch.stage->set_tp(std::move(tp));
  }
  if (chunks_.back().last) losses_ = tensor(Category::workspace, 4 * 2 * std::int64_t(p.m));
  setup_offload(initial);
  if (chunked_) setup_chunks(initial);
  // The memsets above run on compute_; the checkpoint's copies go through the legacy stream, which
  // does not order with it, and a pageable copy may return before its DMA ends: wait for both.
  synchronize(compute_, "set up the weights");
  if (s.first_step > 0) load_checkpoint(s.first_step);
  CUDA_CHECK(cudaDeviceSynchronize());
}

CudaWorker::~CudaWorker() {
  (void)cudaSetDevice(s_.device);
  // After an abort NCCL kernels may wait for peers that are gone: do not wait for them (the
  // communicators' abort ends them; the arena's cudaFree waits for the rest).
  if (!transport_.aborted())
    for (cudaStream_t* st : all_streams())
      if (*st) (void)cudaStreamSynchronize(*st);
  // Tensors go back to the arena before the events and streams they were ordered by.
  inputs_.clear();
  stash_.clear();
  full_.clear();
  outputs_.clear();
  d_outputs_.clear();
  d_inputs_.clear();
  to_self_.clear();
  retired_.clear();
  swapped_.clear();
  for (Tensor& t : grad_tiles_)
    t = Tensor();
  for (HostChunk& h : host_chunks_)
    h.resident = Tensor();
  // After an abort host functions may still wait behind stuck streams: their work stays (leaked),
  // never freed under them. Otherwise every stream was synchronised above.
  if (transport_.aborted()) {
    for (HostWork& w : host_work_)
      (void)w.work.release();
    // So are the host memory they read and write: the chunks' pinned blocks and host state (CPU
    // Adam, the tied add through UVA), optimizer offload's host chunks (CPU Adam, the transfer
    // buffers). Moved into vectors that are never freed (their device tensors go with the arena).
    (void)new std::vector<DataChunk>(std::move(data_chunks_));
    (void)new std::vector<HostChunk>(std::move(host_chunks_));
  }
  host_work_.clear();
  if (!transport_.aborted())
    for (void* block : pinned_all_)
      (void)cudaFreeHost(block);
  for (cudaEvent_t e : all_events_)
    (void)cudaEventDestroy(e);
  for (cudaStream_t* st : all_streams())
    if (*st) (void)cudaStreamDestroy(*st);
  (void)cudaGetLastError();
}

std::vector<cudaStream_t*> CudaWorker::all_streams() {
  std::vector<cudaStream_t*> out = {&compute_, &reduce_, &d2h_, &h2d_, &host_stream_};
  for (int c = 0; c < kChannels; ++c) {
    out.push_back(&send_[c]);
    out.push_back(&recv_[c]);
  }
  return out;
}

Tensor CudaWorker::tensor(Category c, std::int64_t bytes) {
  return Tensor(*s_.arena, memory_, c, bytes);
}

bf16* CudaWorker::params(const Chunk& c, int version) const {
  return c.slots[slots_.slot_of(version)].as<bf16>();
}

cudaEvent_t CudaWorker::event() {
  if (!pool_.empty()) {
    cudaEvent_t e = pool_.back();
    pool_.pop_back();
    return e;
  }
  cudaEvent_t e = nullptr;
  CUDA_CHECK(cudaEventCreate(&e));
  all_events_.push_back(e);
  return e;
}

cudaEvent_t CudaWorker::record(cudaStream_t s) {
  cudaEvent_t e = event();
  CUDA_CHECK(cudaEventRecord(e, s));
  return e;
}

void CudaWorker::wait(cudaStream_t s, cudaEvent_t e) {
  if (e) CUDA_CHECK(cudaStreamWaitEvent(s, e, 0));
}

void CudaWorker::begin_timed(int stream_id, cudaStream_t s, int op) {
  open_ = {stream_id, op < 0 ? op_ : op, record(s), nullptr};
}

void CudaWorker::end_timed(cudaStream_t s) {
  open_.end = record(s);
  pending_.push_back(open_);
}

void CudaWorker::retire(Tensor&& t, cudaStream_t last_use) {
  if (t.bytes() == 0) return;
  retired_.push_back(Retired{std::move(t), record(last_use), last_use});
}

void CudaWorker::reclaim(bool all) {
  for (auto it = retired_.begin(); it != retired_.end();) {
    const cudaError_t q = all ? cudaEventSynchronize(it->done) : cudaEventQuery(it->done);
    if (q == cudaErrorNotReady) {
      ++it;
      continue;
    }
    if (q != cudaSuccess) CUDA_CHECK(q);
    pool_.push_back(it->done);
    it = retired_.erase(it);  // the tensor goes back to the arena
  }
  // Host functions that have run (their stream passed the event after them): in order per
  // stream, so the front ones first.
  for (auto it = host_work_.begin(); it != host_work_.end();) {
    const cudaError_t q = all ? cudaEventSynchronize(it->done) : cudaEventQuery(it->done);
    if (q == cudaErrorNotReady) {
      ++it;
      continue;
    }
    if (q != cudaSuccess) CUDA_CHECK(q);
    pool_.push_back(it->done);
    it = host_work_.erase(it);
  }
}

void CudaWorker::drain_compute(const char* what) {
  cudaEvent_t newest = nullptr;
  for (const Retired& r : retired_)
    if (r.stream == compute_) newest = r.done;  // compute runs in order: the newest covers all
  if (!newest) return;
  host_wait(newest, what);
  reclaim(false);
}

void CudaWorker::host_wait(cudaEvent_t e, const char* what) {
  if (!e) return;
  const auto start = Clock::now();
  for (int spins = 0;; ++spins) {
    const cudaError_t q = cudaEventQuery(e);
    if (q == cudaSuccess) break;
    if (q != cudaErrorNotReady) CUDA_CHECK(q);
    if (transport_.aborted()) throw Error(aborted_message(rank_, what));
    const double waited = std::chrono::duration<double>(Clock::now() - start).count();
    if (transport_.timeout_seconds() > 0 && waited > transport_.timeout_seconds()) {
      transport_.abort();
      throw TransportTimeout(timeout_message(rank_, what, transport_.timeout_seconds()));
    }
    if (spins > 1000) std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

void CudaWorker::synchronize(cudaStream_t s, const std::string& what) {
  transport_.synchronize(device_, s, what);
}

void CudaWorker::resolve_timeline(bool all) {
  std::vector<Timed> left;
  for (const Timed& t : pending_) {
    if (!all && cudaEventQuery(t.end) == cudaErrorNotReady) {
      left.push_back(t);
      continue;
    }
    float a = 0, b = 0;
    CUDA_CHECK(cudaEventSynchronize(t.end));
    CUDA_CHECK(cudaEventElapsedTime(&a, origin_, t.begin));
    CUDA_CHECK(cudaEventElapsedTime(&b, origin_, t.end));
    ops_.push_back({t.stream, a / 1e3, b / 1e3, t.op});
    if (t.stream == planner::kComputeStream) busy_s_ += (b - a) / 1e3;
    pool_.push_back(t.begin);
    pool_.push_back(t.end);
  }
  pending_ = std::move(left);
}

void CudaWorker::start() {
  origin_ = record(compute_);
  synchronize(compute_, "start");
}

void CudaWorker::run() {
  CUDA_CHECK(cudaSetDevice(s_.device));
  const auto& ops = s_.programs->devices[std::size_t(rank_)].ops;
  for (op_ = 0; op_ < int(ops.size()); ++op_) {
    reclaim(false);
    exec::detail::interpret(*this, ops[std::size_t(op_)]);
  }
  for (cudaStream_t* st : all_streams())
    synchronize(*st, "finish the run");
  reclaim(true);
  resolve_timeline(true);
}

void CudaWorker::send(const Op& op, Channel channel) {
  send(op, channel, channel == Channel::activation ? outputs_ : d_inputs_);
}

void CudaWorker::recv(const Op& op, Channel channel) {
  if (swaps_) swapped_.release_due(compute_ops_);  // a compute slot begins
  const Chunk& c = chunks_[std::size_t(op.chunk)];
  if (chunked_) check_messages(1);
  if (channel == Channel::activation)
    recv(op, channel, inputs_, c.sizes.input);
  else
    recv(op, channel, d_outputs_, c.sizes.output);
}

Held take(std::map<std::tuple<int, int, int>, Held>& from, const std::tuple<int, int, int>& key,
          const char* what, int rank) {
  const auto it = from.find(key);
  if (it == from.end())
    throw Error(fmt::format("rank {}: no {} for step {} microbatch {} chunk {}", rank, what,
                            std::get<0>(key), std::get<1>(key), std::get<2>(key)));
  Held h = std::move(it->second);
  from.erase(it);
  return h;
}

Tensor CudaWorker::transient(Category c, std::int64_t bytes) {
  return chunked_ ? Tensor(*s_.arena, uncounted_, c, bytes) : tensor(c, bytes);
}

// Optimizer offload's gradient sink for one backward (the CPU worker's TileSink on the GPU): where
// each gradient goes and when a layer's tile goes to the host are the shared rule's
// (exec/optimizer_offload.hpp); the device's part below (zero_tile .. upload_tile).
class CudaWorker::TileSink : public DeviceGradientSink {
 public:
  TileSink(CudaWorker& w, std::size_t chunk, int op)
      : w_(w),
        b_(chunk, op, w.host_chunks_[chunk].tiles, w.chunks_[chunk].tied_offset,
           w.chunks_[chunk].tied_size, w.tied_grad(w.chunks_[chunk])) {}
  bf16* at(std::int64_t offset, std::int64_t size) override {
    return w_.optimizer_.gradient_at(b_, offset, size);
  }
  void layer_done(std::int64_t, std::int64_t) override { w_.optimizer_.layer_done(b_); }

 private:
  CudaWorker& w_;
  exec::detail::StreamedBackward<bf16> b_;
};

cudaStream_t CudaWorker::stream_of(Engine e) const {
  switch (e) {
    case Engine::d2h:
      return d2h_;
    case Engine::h2d:
      return h2d_;
    case Engine::host:
      return host_stream_;
    case Engine::compute:
      break;
  }
  return compute_;
}

// Zeroed on the compute stream, after its previous layer's copy (the rule's wait).
bf16* CudaWorker::zero_tile(int buffer, std::int64_t n) {
  CUDA_CHECK(cudaMemsetAsync(grad_tiles_[buffer].as<void>(), 0, std::size_t(2 * n), compute_));
  return grad_tiles_[buffer].as<bf16>();
}

// The streamed ranges into the pinned transfer buffer, then added into the host's fp32
// accumulator (a host function, in stream order: the next copy into the same range waits for the
// add).
void CudaWorker::stream_tile(std::size_t chunk, int buffer, exec::detail::Tile t,
                             const std::vector<exec::detail::Tile>& ranges, int op) {
  HostChunk& h = host_chunks_[chunk];
  const bf16* src = grad_tiles_[buffer].as<bf16>();
  bf16* transfer = h.transfer.as<bf16>();
  float* acc = h.accumulator.data();
  timed(planner::kCopyOutStream, d2h_, op, [&] {
    for (const exec::detail::Tile& r : ranges) {
      CUDA_CHECK(cudaMemcpyAsync(transfer + r.begin, src + (r.begin - t.begin),
                                 std::size_t(2 * r.size()), cudaMemcpyDeviceToHost, d2h_));
      bytes_out_ += 2 * r.size();
    }
    host_function(d2h_, [ranges, transfer, acc] {
      for (const exec::detail::Tile& r : ranges)
        for (std::int64_t i = r.begin; i < r.end; ++i)
          acc[i] = acc[i] + __bfloat162float(transfer[i]);
    });
  });
}

void CudaWorker::forward(const Op& op) {
  const Key key{op.step, op.microbatch, op.chunk};
  Chunk& c = chunks_[std::size_t(op.chunk)];
  const planner::Plan& p = s_.plan();
  const bool rc = p.recomputes(stage_);
  if (swaps_) swapped_.release_due(compute_ops_);
  ++compute_ops_;
  std::vector<std::int32_t> tokens, targets;
  if (c.first || c.last)
    exec::detail::microbatch_samples(s_, replica_, op.step, op.microbatch, tokens, targets);
  Held input;
  if (!c.first) {
    input = take(inputs_, key, "received activation", rank_);
    wait(compute_, input.ready);
    if (input.ready) pool_.push_back(input.ready);
  }
  drain_compute("forward");
  // With chunks the layers run layer by layer over them (chunk_memory), and the stash (with
  // recompute the stage input it keeps), scratch and output are uncounted: the moments count them.
  const auto memory =
      chunk_memory(rc ? ChunkPass::forward_recompute : ChunkPass::forward, op, c.last ? 0 : 1);
  Tensor stash =
      transient(Category::activations, 2 * (rc ? c.sizes.stash_recompute : c.sizes.stash));
  Tensor out = transient(Category::activations, c.last ? 0 : 2 * c.sizes.output);
  Tensor scratch = transient(Category::activations, rc ? 2 * c.sizes.scratch : 0);
  float* loss = c.last ? losses_.as<float>() + (op.step % 2) * p.m + op.microbatch : nullptr;
  const auto run = [&](auto&& weights) {
    c.stage->forward(weights, c.first ? tokens.data() : nullptr,
                     c.first ? nullptr : input.tensor.as<bf16>(), c.last ? targets.data() : nullptr,
                     p.b, rc, stash.as<bf16>(), c.last ? nullptr : out.as<bf16>(),
                     rc ? scratch.as<bf16>() : nullptr, loss);
  };
  begin_timed(planner::kComputeStream, compute_);
  if (memory)
    run(*memory);
  else
    run(params(c, op.version));
  end_timed(compute_);
  if (memory) book_.check_none_pending("forward");
  retire(std::move(scratch), compute_);
  retire(std::move(input), compute_);
  stash_[key] = Held{std::move(stash), nullptr};
  if (!c.last) outputs_[key] = Held{std::move(out), nullptr};
}

void CudaWorker::recompute(const Op& op) {
  const Key key{op.step, op.microbatch, op.chunk};
  Chunk& c = chunks_[std::size_t(op.chunk)];
  std::vector<std::int32_t> tokens, targets;
  if (c.last)
    exec::detail::microbatch_samples(s_, replica_, op.step, op.microbatch, tokens, targets);
  drain_compute("recompute");
  const auto kept = stash_.find(key);
  if (kept == stash_.end())
    throw Error(fmt::format("rank {}: recompute of step {} microbatch {} without its stash", rank_,
                            op.step, op.microbatch));
  const auto memory = chunk_memory(ChunkPass::recompute, op, 0);  // layer by layer (chunks)
  Tensor full = transient(Category::activations, 2 * c.sizes.stash);
  const auto run = [&](auto&& weights) {
    c.stage->recompute(weights, c.last ? targets.data() : nullptr, s_.plan().b,
                       kept->second.tensor.as<bf16>(), full.as<bf16>());
  };
  begin_timed(planner::kComputeStream, compute_);
  if (memory)
    run(*memory);
  else
    run(params(c, op.version));
  end_timed(compute_);
  if (memory) book_.check_none_pending("recompute");
  full_[key] = Held{std::move(full), nullptr};
}

void CudaWorker::backward(const Op& op) {
  const Key key{op.step, op.microbatch, op.chunk};
  Chunk& c = chunks_[std::size_t(op.chunk)];
  const planner::Plan& p = s_.plan();
  const bool rc = p.recomputes(stage_);
  if (swaps_) swapped_.release_due(compute_ops_);
  ++compute_ops_;
  if (swaps_) swapped_.back(key, rank_);  // a swapped stash: on the device again
  Held stash = take(stash_, key, "stash", rank_);
  Held full;
  if (rc) full = take(full_, key, "recomputed stash", rank_);
  Held d_output;
  if (!c.last) {
    d_output = take(d_outputs_, key, "received gradient", rank_);
    wait(compute_, d_output.ready);
    if (d_output.ready) pool_.push_back(d_output.ready);
  }
  drain_compute("backward");
  // With chunks: layer by layer over them, the gradients into their gradient halves.
  const auto memory = chunk_memory(ChunkPass::backward, op, c.first ? 0 : 1);
  Tensor d_input = transient(Category::activations, c.first ? 0 : 2 * c.sizes.input);
  // Gradients of the mean loss over the global batch: 1 / (B T) per token.
  const float scale = 1.0f / float(double(p.global_batch()) * double(s_.model->seq_len));
  begin_timed(planner::kComputeStream, compute_);
  if (memory) {
    c.stage->backward(*memory, (rc ? full : stash).tensor.as<bf16>(),
                      c.last ? nullptr : d_output.tensor.as<bf16>(), p.b, scale,
                      c.first ? nullptr : d_input.as<bf16>(), workspace_.as<bf16>());
  } else if (offload_optimizer_ && !offload_sharded_) {
    // Each layer's gradients to the host as it is done, timed as the copy_gradient_to_host after
    // the backward.
    TileSink sink(
        *this, std::size_t(op.chunk),
        exec::detail::gradient_copy_op(s_.programs->devices[std::size_t(rank_)].ops, op_));
    c.stage->backward(params(c, op.version), (rc ? full : stash).tensor.as<bf16>(),
                      c.last ? nullptr : d_output.tensor.as<bf16>(), p.b, scale, sink,
                      c.first ? nullptr : d_input.as<bf16>(), workspace_.as<bf16>());
  } else if (const auto [embedding, head] = exec::detail::tied_ends_on_one_device(chunks_);
             head == &c) {
    // Both tied ends on this device (d = 1, v > 1): the head's gradient of the tied tensor adds
    // into the embedding's (exec/tied_exchange.hpp); sum_local_tied copies it back.
    exec::detail::TiedEndsSink<DeviceGradientSink, bf16> sink(
        c.grads.as<bf16>(), c.tied_offset, c.tied_size,
        embedding->grads.as<bf16>() + embedding->tied_offset);
    c.stage->backward(params(c, op.version), (rc ? full : stash).tensor.as<bf16>(),
                      c.last ? nullptr : d_output.tensor.as<bf16>(), p.b, scale, sink,
                      c.first ? nullptr : d_input.as<bf16>(), workspace_.as<bf16>());
  } else {
    c.stage->backward(params(c, op.version), (rc ? full : stash).tensor.as<bf16>(),
                      c.last ? nullptr : d_output.tensor.as<bf16>(), p.b, scale, c.grads.as<bf16>(),
                      c.first ? nullptr : d_input.as<bf16>(), workspace_.as<bf16>());
  }
  end_timed(compute_);
  if (memory) book_.check_none_pending("backward");
  retire(std::move(stash), compute_);
  retire(std::move(full), compute_);
  retire(std::move(d_output), compute_);
  if (!c.first) d_inputs_[key] = Held{std::move(d_input), nullptr};
}

// The tensor was written on the compute stream: the send stream waits for it, and it goes back to
// the arena once the send stream has passed the send.
void CudaWorker::send(const Op& op, Channel channel, std::map<Key, Held>& from) {
  const cudaStream_t stream = send_[int(channel)];
  Held h = take(from, Key{op.step, op.microbatch, op.chunk},
                channel == Channel::activation ? "activation to send" : "gradient to send", rank_);
  if (op.peer == rank_) {  // the next chunk on this device: no copy, the block itself
    to_self_[channel].push_back(std::move(h));
    return;
  }
  const cudaEvent_t produced = record(compute_);
  wait(stream, produced);
  pool_.push_back(produced);
  begin_timed(planner::kSendStream, stream);
  transport_.send(device_, device_of(op.peer), channel, h.tensor.as<void>(), h.tensor.bytes(),
                  stream);
  end_timed(stream);
  retire(std::move(h), stream);
}

// Received on the recv stream into a new block; the consumer waits on `ready`. The block may reuse
// memory that compute-stream work released: retire() only frees after that work passed.
void CudaWorker::recv(const Op& op, Channel channel, std::map<Key, Held>& into,
                      std::int64_t elements) {
  const cudaStream_t stream = recv_[int(channel)];
  const Key key{op.step, op.microbatch, op.chunk};
  if (op.peer == rank_) {
    std::deque<Held>& queue = to_self_[channel];
    if (queue.empty() || queue.front().tensor.bytes() != 2 * elements)
      throw Error(fmt::format("rank {}: {} from itself: no message of {} bytes sent", rank_,
                              channel_name(channel), 2 * elements));
    into[key] = std::move(queue.front());  // written on compute: no event to wait for
    queue.pop_front();
    return;
  }
  Tensor t = transient(Category::activations, 2 * elements);
  begin_timed(planner::kRecvStream, stream);
  transport_.recv(device_of(op.peer), device_, channel, t.as<void>(), t.bytes(), stream);
  end_timed(stream);
  into[key] = Held{std::move(t), record(stream)};
}

void CudaWorker::all_reduce(const Op& op) {
  Chunk& c = chunks_[std::size_t(op.chunk)];
  const auto [begin, end] =
      exec::detail::bucket_range(c.sizes.parameters, s_.programs->buckets, op.bucket);
  const cudaEvent_t produced = record(compute_);
  wait(reduce_, produced);
  pool_.push_back(produced);
  begin_timed(planner::kCollectiveStream, reduce_);
  if (sharded_)
    reduce_scatter(c, begin, end);
  else
    transport_.all_reduce_sum_bf16(replica_group(), device_, c.grads.as<bf16>() + begin,
                                   end - begin, reduce_);
  end_timed(reduce_);
  if (reduced_) pool_.push_back(reduced_);
  reduced_ = record(reduce_);
}

std::vector<int> CudaWorker::replica_group() const {
  return exec::detail::replica_devices(s_.plan(), stage_, tp_);
}

// The distributed optimizer's state: ceil(P / w) fp32 values each of master, m and v on every
// replica (the last shard padded: the planner's figure), each chunk pointing at its part of the
// rank's shard; the master starts from the initial weights, unrounded.
void CudaWorker::setup_shards(const std::vector<std::vector<float>>& initial) {
  const planner::Plan& p = s_.plan();
  const planner::TiedShard own = planner::tied_shard(flat_, p.w, replica_);
  const std::int64_t per = (flat_ + p.w - 1) / p.w;
  shard_master_ = tensor(Category::optimizer, 4 * per);
  shard_m_ = tensor(Category::optimizer, 4 * per);
  CUDA_CHECK(cudaMemsetAsync(shard_m_.as<void>(), 0, std::size_t(4 * per), compute_));
  if (s_.options->optimizer == "adamw") {
    shard_v_ = tensor(Category::optimizer, 4 * per);
    CUDA_CHECK(cudaMemsetAsync(shard_v_.as<void>(), 0, std::size_t(4 * per), compute_));
  }
  for (std::size_t i = 0; i < chunks_.size(); ++i) {
    Chunk& c = chunks_[i];
    const std::int64_t n = c.sizes.parameters;
    c.own_begin = std::clamp(own.begin - c.base, std::int64_t(0), n);
    c.own_end = std::max(c.own_begin, std::clamp(own.end - c.base, std::int64_t(0), n));
    // A chunk wholly before or after the shard owns nothing: its (empty) state at either end.
    const std::int64_t at = std::clamp(c.base + c.own_begin - own.begin, std::int64_t(0), per);
    c.master_at = shard_master_.as<float>() + at;
    c.m_at = shard_m_.as<float>() + at;
    c.v_at = shard_v_.bytes() > 0 ? shard_v_.as<float>() + at : nullptr;
    CUDA_CHECK(cudaMemcpy(c.master_at, initial[i].data() + c.own_begin,
                          std::size_t(4 * (c.own_end - c.own_begin)), cudaMemcpyHostToDevice));
  }
}

// A bucket [begin, end) of chunk c's bf16 gradients, on the reduce stream: each replica gets the
// sum over its shard (the only part its optimizer reads), except where the tied tensor's rule
// differs (bucket_pieces). The transport's reduce-scatter sums as its all-reduce does, so each
// shard's bits are those of the plain data-parallel sum.
void CudaWorker::reduce_scatter(Chunk& c, std::int64_t begin, std::int64_t end) {
  const planner::Plan& p = s_.plan();
  const std::vector<int> group = replica_group();
  bf16* grads = c.grads.as<bf16>();
  for (const exec::detail::BucketPiece& piece :
       exec::detail::bucket_pieces(c.first, c.tied_offset, c.tied_size, p.d, p.w, begin, end)) {
    if (piece.kind == exec::detail::BucketPiece::tied_whole) {
      transport_.all_reduce_sum_bf16(group, device_, grads + piece.begin, piece.end - piece.begin,
                                     reduce_);
    } else if (piece.kind == exec::detail::BucketPiece::tied_shards) {
      transport_.reduce_scatter_sum(group, device_, grads + piece.begin, piece.bounds, DType::bf16,
                                    reduce_);
    } else {
      for (const exec::detail::ShardPiece& part : shard_pieces(c, piece.begin, piece.end))
        transport_.reduce_scatter_sum(group, device_, grads + part.begin, part.bounds, DType::bf16,
                                      reduce_);
    }
  }
}

std::vector<exec::detail::ShardPiece> CudaWorker::shard_pieces(const Chunk& c, std::int64_t a,
                                                               std::int64_t b) const {
  const std::size_t i = std::size_t(&c - chunks_.data());
  return exec::detail::shard_pieces(offload_sharded_ ? &host_chunks_[i].layers : nullptr, flat_,
                                    c.base, s_.plan().w, a, b);
}

// After the sharded update into slot `target` (enqueued on compute): every replica's shards of
// every chunk to the others, on the reduce stream; the compute stream's next work waits for it.
void CudaWorker::all_gather(int target) {
  const cudaEvent_t updated = record(compute_);
  wait(reduce_, updated);
  pool_.push_back(updated);
  begin_timed(planner::kCollectiveStream, reduce_);
  const std::vector<int> group = replica_group();
  for (Chunk& c : chunks_)
    for (const exec::detail::ShardPiece& part : shard_pieces(c, 0, c.sizes.parameters))
      transport_.all_gather(group, device_, c.slots[target].as<bf16>() + part.begin, part.bounds,
                            DType::bf16, reduce_);
  end_timed(reduce_);
  const cudaEvent_t gathered = record(reduce_);
  wait(compute_, gathered);
  pool_.push_back(gathered);
}

// The token embedding (stage 0) and the LM head's copy (last stage) are one parameter; stage 0
// owns its update (see exec/worker.cpp, whose order of the sums and shards this follows: with
// w > 1 each message carries the replica's shard, and an all-reduce of buffers that hold zeros
// outside each member's shard gathers them on the reduce stream).
void CudaWorker::tied(const Op& op) {
  const Chunk& c = chunks_[std::size_t(op.chunk)];
  tied_.run(op, c.tied_offset, c.tied_size, s_.plan().w, replica_, rank_);  // tied_exchange.hpp
}

// The tied exchange's device part (exec/tied_exchange.hpp).
void CudaWorker::tied_gradient_out(const Op& op, planner::TiedShard sh) {
  Chunk& c = chunks_[std::size_t(op.chunk)];
  const std::int64_t shard_bytes = 2 * (sh.end - sh.begin);
  bf16* grad = tied_grad(c);
  const cudaStream_t stream = send_[int(Channel::tied)];
  // A copy goes out, so the gradient is zeroed at once for the next step's sums: the compute
  // stream never waits for the receiver (NCCL's send waits for it).
  wait(compute_, reduced_);
  // With chunks the gradient may be in its chunk's pinned host block (cudaMemcpyDefault: UVA).
  Tensor copy = transient(Category::workspace, shard_bytes);
  CUDA_CHECK(cudaMemcpyAsync(copy.as<void>(), grad + sh.begin, std::size_t(shard_bytes),
                             cudaMemcpyDefault, compute_));
  zero_on_compute(grad, c.tied_size);
  const cudaEvent_t produced = record(compute_);
  wait(stream, produced);
  pool_.push_back(produced);
  begin_timed(planner::kSendStream, stream);
  transport_.send(device_, device_of(op.peer), Channel::tied, copy.as<void>(), shard_bytes, stream);
  end_timed(stream);
  retire(std::move(copy), stream);
}

void CudaWorker::tied_gradient_in(const Op& op, planner::TiedShard sh, bool hold) {
  Chunk& c = chunks_[std::size_t(op.chunk)];
  const std::int64_t n = c.tied_size, bytes = 2 * n;
  const cudaStream_t stream = recv_[int(Channel::tied)];
  Tensor head = transient(Category::workspace, bytes);
  if (hold) CUDA_CHECK(cudaMemsetAsync(head.as<void>(), 0, std::size_t(bytes), stream));
  begin_timed(planner::kRecvStream, stream);
  transport_.recv(device_of(op.peer), device_, Channel::tied, head.as<bf16>() + sh.begin,
                  2 * (sh.end - sh.begin), stream);
  end_timed(stream);
  const cudaEvent_t arrived = record(stream);
  if (hold) {
    tied_head_ = Held{std::move(head), arrived};
    return;
  }
  wait(compute_, arrived);
  wait(compute_, reduced_);
  pool_.push_back(arrived);
  bf16* grad = tied_grad(c);
  residual_add(grad, grad, head.as<bf16>(), n, compute_);
  retire(std::move(head), compute_);
}

// The shards gathered as a sum: each replica's buffer is zero outside its own shard.
void CudaWorker::tied_gradient_gather(const Op& op, planner::TiedShard) {
  Chunk& c = chunks_[std::size_t(op.chunk)];
  const std::int64_t n = c.tied_size;
  wait(reduce_, tied_head_.ready);
  pool_.push_back(tied_head_.ready);
  begin_timed(planner::kCollectiveStream, reduce_);
  transport_.all_reduce_sum_bf16(replica_group(), device_, tied_head_.tensor.as<bf16>(), n,
                                 reduce_);
  end_timed(reduce_);
  if (reduced_) pool_.push_back(reduced_);
  reduced_ = record(reduce_);
  wait(compute_, reduced_);
  bf16* grad = tied_grad(c);
  residual_add(grad, grad, tied_head_.tensor.as<bf16>(), n, compute_);
  retire(std::move(tied_head_.tensor), compute_);
  tied_head_ = {};
}

void CudaWorker::tied_weights_out(const Op& op, planner::TiedShard sh) {
  const Chunk& c = chunks_[std::size_t(op.chunk)];
  const cudaStream_t stream = send_[int(Channel::tied_weights)];
  if (chunked_) {  // out of its chunk, wherever that is, through a device copy (w = 1)
    const std::int64_t bytes = 2 * (sh.end - sh.begin);
    after_chunk_moves(c.base + c.tied_offset);
    Tensor copy = transient(Category::workspace, bytes);
    CUDA_CHECK(cudaMemcpyAsync(
        copy.as<void>(), chunk_tensor(c.base + c.tied_offset, weight_part(op.version)) + sh.begin,
        std::size_t(bytes), cudaMemcpyDefault, compute_));
    const cudaEvent_t produced = record(compute_);
    wait(stream, produced);
    pool_.push_back(produced);
    begin_timed(planner::kSendStream, stream);
    transport_.send(device_, device_of(op.peer), Channel::tied_weights, copy.as<void>(), bytes,
                    stream);
    end_timed(stream);
    retire(std::move(copy), stream);
    return;
  }
  const cudaEvent_t produced = record(compute_);
  wait(stream, produced);
  pool_.push_back(produced);
  begin_timed(planner::kSendStream, stream);
  transport_.send(device_, device_of(op.peer), Channel::tied_weights,
                  params(c, op.version) + c.tied_offset + sh.begin, 2 * (sh.end - sh.begin),
                  stream);
  end_timed(stream);
  // The update that next rewrites this slot must not do so before the send has read it;
  // waiting there, not here, keeps the compute stream free until then (2BW rewrites it two
  // steps later, flush schedules at the next step).
  slots_.read_by(op.version, record(stream));
}

void CudaWorker::tied_weights_in(const Op& op, planner::TiedShard sh, bool hold) {
  const Chunk& c = chunks_[std::size_t(op.chunk)];
  const cudaStream_t stream = recv_[int(Channel::tied_weights)];
  if (chunked_) {  // into a device copy, then into its chunk wherever that is (w = 1)
    const std::int64_t bytes = 2 * (sh.end - sh.begin);
    Tensor copy = transient(Category::workspace, bytes);
    const cudaEvent_t before = record(compute_);
    wait(stream, before);
    pool_.push_back(before);
    begin_timed(planner::kRecvStream, stream);
    transport_.recv(device_of(op.peer), device_, Channel::tied_weights, copy.as<void>(), bytes,
                    stream);
    end_timed(stream);
    const cudaEvent_t arrived = record(stream);
    wait(compute_, arrived);
    pool_.push_back(arrived);
    after_chunk_moves(c.base + c.tied_offset);
    CUDA_CHECK(
        cudaMemcpyAsync(chunk_tensor(c.base + c.tied_offset, weight_part(op.version)) + sh.begin,
                        copy.as<void>(), std::size_t(bytes), cudaMemcpyDefault, compute_));
    retire(std::move(copy), compute_);
    return;
  }
  // Written straight into the version's slot, after the optimizer filled the rest of it (and
  // after every earlier reader of the slot's previous version).
  const cudaEvent_t before = record(compute_);
  wait(stream, before);
  pool_.push_back(before);
  bf16* copy = params(c, op.version) + c.tied_offset;
  if (hold) CUDA_CHECK(cudaMemsetAsync(copy, 0, std::size_t(2 * c.tied_size), stream));
  begin_timed(planner::kRecvStream, stream);
  transport_.recv(device_of(op.peer), device_, Channel::tied_weights, copy + sh.begin,
                  2 * (sh.end - sh.begin), stream);
  end_timed(stream);
  const cudaEvent_t arrived = record(stream);
  if (hold) {
    tied_arrived_ = arrived;
    return;
  }
  wait(compute_, arrived);
  pool_.push_back(arrived);
}

// The version's copy, in place, gathered as a sum (zeros outside each replica's shard).
void CudaWorker::tied_weights_gather(const Op& op, planner::TiedShard) {
  const Chunk& c = chunks_[std::size_t(op.chunk)];
  wait(reduce_, tied_arrived_);
  pool_.push_back(tied_arrived_);
  tied_arrived_ = nullptr;
  begin_timed(planner::kCollectiveStream, reduce_);
  transport_.all_reduce_sum_bf16(replica_group(), device_, params(c, op.version) + c.tied_offset,
                                 c.tied_size, reduce_);
  end_timed(reduce_);
  const cudaEvent_t gathered = record(reduce_);
  wait(compute_, gathered);
  pool_.push_back(gathered);
}

// One device holding both tied ends (d == 1, v > 1): the same sum, on both chunks, no messages.
void CudaWorker::sum_local_tied() {
  const auto [embedding, head] = exec::detail::tied_ends_on_one_device(chunks_);
  if (!embedding) return;
  // The head's backward added its gradient into the embedding's (TiedEndsSink): the sum of both.
  CUDA_CHECK(cudaMemcpyAsync(head->grads.as<bf16>() + head->tied_offset,
                             embedding->grads.as<bf16>() + embedding->tied_offset,
                             std::size_t(2 * embedding->tied_size), cudaMemcpyDeviceToDevice,
                             compute_));
}

void CudaWorker::optimizer_step(const Op& op) {
  if (offload_optimizer_) return offload_step(op);
  if (chunked_) return chunk_optimizer_step(op);
  wait(compute_, reduced_);
  if (reduced_) pool_.push_back(reduced_);
  reduced_ = nullptr;
  if (s_.plan().d == 1) sum_local_tied();
  ++updates_;
  const int target = slots_.begin_update(op.version);  // exec/weight_slots.hpp
  begin_timed(planner::kComputeStream, compute_);
  for (Chunk& c : chunks_) {
    update(c, c.slots[target].as<bf16>());
    // The other replicas' shards hold this replica's unreduced sums: zeroed for the next step.
    if (sharded_)
      CUDA_CHECK(cudaMemsetAsync(c.grads.as<void>(), 0, std::size_t(c.grads.bytes()), compute_));
  }
  end_timed(compute_);
  if (sharded_) all_gather(target);
  slots_.end_update(op.version, target);
  end_of_step(op.step);
}

// The weight slots' device part (exec/weight_slots.hpp).
void CudaWorker::allocate_slot(int slot) {
  for (Chunk& c : chunks_)
    c.slots[slot] = tensor(Category::weight_versions, 2 * c.sizes.parameters);
}

// The writer's stream waits for the slot's last tied-weights send (on its send stream). An upload
// (h2d) also waits for every op enqueued on the compute stream so far, which may read the slot.
void CudaWorker::before_slot_write(int, exec::detail::SlotWriter writer, cudaEvent_t last_send) {
  const cudaStream_t stream = writer == exec::detail::SlotWriter::upload ? h2d_ : compute_;
  if (writer == exec::detail::SlotWriter::upload) {
    const cudaEvent_t before = record(compute_);
    wait(stream, before);
    pool_.push_back(before);
  }
  if (last_send) {
    wait(stream, last_send);
    pool_.push_back(last_send);
  }
}

// A slot's earlier send, implied by the later one on the same send stream: its event back.
void CudaWorker::retire_reader(cudaEvent_t sent) {
  if (sent) pool_.push_back(sent);
}

AdamWParams adamw_params(const TrainOptions& o) {
  AdamWParams a;
  a.lr = o.lr;
  a.beta1 = o.beta1;
  a.beta2 = o.beta2;
  a.eps = o.eps;
  a.weight_decay = o.weight_decay;
  return a;
}

// fp32 master weights (always the newest version) -> the target slot's bf16 copy, over the
// parameters the rank keeps the state of (the distributed optimizer: its shard). The last stage's
// copy of the tied tensor (d > 1) is not updated here: stage 0 sends it.
void CudaWorker::update(Chunk& c, bf16* target) {
  const TrainOptions& o = *s_.options;
  const AdamWParams a = adamw_params(o);
  for (auto [begin, end] : exec::detail::updated_ranges(c.first, c.last, c.tied_offset, c.tied_size,
                                                        s_.plan().d, c.sizes.parameters)) {
    begin = std::max(begin, c.own_begin);
    end = std::min(end, c.own_end);
    if (begin >= end) continue;
    const std::int64_t at = begin - c.own_begin;
    float* master = c.master_at + at;
    bf16* grads = c.grads.as<bf16>() + begin;
    float* m = c.m_at + at;
    if (o.optimizer == "adamw")
      adamw_update(master, target + begin, grads, m, c.v_at + at, end - begin, a, updates_,
                   compute_);
    else
      sgd_momentum_update(master, target + begin, grads, m, end - begin, o.lr, o.momentum,
                          compute_);
  }
}

// The host's one wait per step: the step's losses, the ids' check, the timeline so far, the
// checkpoint, the step's end in the book.
void CudaWorker::end_of_step(int step) {
  synchronize(compute_, fmt::format("optimizer step {}", step));
  for (Chunk& c : chunks_)
    if (c.first || c.last) c.stage->check_ids();
  // The TP group's losses are one (the group's sum): TP index 0 reports them.
  if (exec::detail::StepBook::reports_loss(chunks_.back().last, tp_)) {
    const int m = s_.plan().m;
    std::vector<float> losses(static_cast<std::size_t>(m));
    CUDA_CHECK(cudaMemcpy(losses.data(), losses_.as<float>() + (step % 2) * m,
                          std::size_t(m) * sizeof(float), cudaMemcpyDeviceToHost));
    double sum = 0;
    for (float l : losses)
      sum += l;
    s_.add_loss(step, sum);
  }
  resolve_timeline(false);
  s_.end_step(step, [this](int done) { save_checkpoint(done); });
}

// ---- offload (docs/formulas.md section 9; the CPU worker's rules: exec/offload.hpp) ----------

// The host side of optimizer offload and the device's tile buffers; the pool's reclaim for swaps.
// `initial`: each chunk's fp32 initial weights (the master copy's start; a checkpoint's replace
// them when resumed).
void CudaWorker::setup_offload(const std::vector<std::vector<float>>& initial) {
  const planner::Plan& p = s_.plan();
  // A growth past --device-memory first takes back the buffers of the stashes on their way out,
  // then waits for the oldest block retired on a stream (the CPU worker has none: it releases at
  // fixed points), before the counter gives up with its one line.
  memory_.set_reclaim([this] { return (swaps_ && swapped_.reclaim()) || reclaim_retired(); });
  if (!offload_optimizer_) return;
  std::int64_t largest = 0;
  std::vector<int> tiles;  // per chunk: its CPU Adam tiles
  for (std::size_t i = 0; i < chunks_.size(); ++i) {
    Chunk& c = chunks_[i];
    HostChunk h;
    exec::detail::HostLayout host = exec::detail::host_layout(
        exec::detail::host_tiles(c.stage->layout(), c.sizes.parameters, c.last, c.tied_offset,
                                 c.tied_size, planner::offload_tiles(p, stage_, int(i)), rank_,
                                 int(i)),
        offload_sharded_, p.w, replica_);  // sharded: ZeRO-Offload's shards, packed
    h.n = host.n;
    h.tiles = std::move(host.tiles);
    h.host_at = std::move(host.host_at);
    h.layers = std::move(host.layers);
    if (!offload_sharded_)
      for (const exec::detail::Tile& t : h.tiles)
        largest = std::max(largest, t.size());
    // The planner's (12 + 4 + e) bytes per host-updated parameter (sharded: of the replica's
    // parts): fp32 master, m, v, the fp32 accumulator and the bf16 transfer buffer (pinned).
    h.master = Buffer(&host_, Category::optimizer, h.n);
    for (std::size_t k = 0; k < h.tiles.size(); ++k)
      std::copy(initial.at(i).data() + h.tiles[k].begin, initial.at(i).data() + h.tiles[k].end,
                h.master.data() + h.host_at[k]);
    h.accumulator = Buffer(&host_, Category::gradients, h.n);
    h.m = Buffer(&host_, Category::optimizer, h.n);
    if (s_.options->optimizer == "adamw") h.v = Buffer(&host_, Category::optimizer, h.n);
    h.transfer = PinnedBuffer(host_, Category::weights, 2 * h.n);
    if (c.tied_offset >= 0 && !offload_sharded_) {  // sharded: in the chunk's gradients
      h.resident = tensor(Category::gradients, 2 * c.tied_size);
      CUDA_CHECK(cudaMemsetAsync(h.resident.as<void>(), 0, std::size_t(2 * c.tied_size), compute_));
    }
    tiles.push_back(int(h.tiles.size()));
    host_chunks_.push_back(std::move(h));
  }
  optimizer_.setup(rank_, p, offload_sharded_, tiles);
  // Double-buffered: one layer's gradients fill while the previous one's are on the copy stream
  // (sharded: none, the backward keeps its gradients).
  if (!offload_sharded_)
    for (Tensor& t : grad_tiles_)
      t = tensor(Category::gradients, 2 * largest);
}

void CudaWorker::zero_on_compute(bf16* at, std::int64_t n) {
  cudaPointerAttributes where{};
  CUDA_CHECK(cudaPointerGetAttributes(&where, at));
  if (where.type == cudaMemoryTypeHost)
    host_function(compute_,
                  [at, n] { std::memset(static_cast<void*>(at), 0, std::size_t(2 * n)); });
  else
    CUDA_CHECK(cudaMemsetAsync(at, 0, std::size_t(2 * n), compute_));
}

bf16* CudaWorker::tied_grad(Chunk& c) {
  if (chunked_) {  // in its chunk, on the device or in the pinned host block; moves done first
    after_chunk_moves(c.base + c.tied_offset);
    return chunk_tensor(c.base + c.tied_offset, 2);
  }
  if (!offload_optimizer_ || offload_sharded_) return c.grads.as<bf16>() + c.tied_offset;
  return host_chunks_[std::size_t(&c - chunks_.data())].resident.as<bf16>();
}

namespace {
void CUDART_CB run_host_work(void* work) {
  (*static_cast<std::function<void()>*>(work))();
}
}  // namespace

void CudaWorker::host_function(cudaStream_t stream, std::function<void()> work) {
  auto owned = std::make_unique<std::function<void()>>(std::move(work));
  CUDA_CHECK(cudaLaunchHostFunc(stream, run_host_work, owned.get()));
  host_work_.push_back({std::move(owned), record(stream)});
}

void CudaWorker::timed(int stream_id, cudaStream_t stream, int op,
                       const std::function<void()>& enqueue) {
  const cudaEvent_t begin = record(stream);
  enqueue();
  pending_.push_back({stream_id, op, begin, record(stream)});
}

bool CudaWorker::reclaim_retired() {
  if (retired_.empty()) return false;
  host_wait(retired_.front().done, "free a retired block");
  pool_.push_back(retired_.front().done);
  retired_.pop_front();  // the tensor goes back to the arena (and its counter)
  return true;
}

// A swapped stash's device part (exec/offload.hpp, Swaps, has the rule of when each runs): the
// download on the device-to-host stream after the forward, the upload on the host-to-device
// stream after the download, into pinned host blocks. Its device buffer goes when Swaps says,
// the host waiting for the download if it is still running.
void CudaWorker::swap_out(Swap& sw, const Key& key, int op) {
  Held stash = take(stash_, key, "stash to swap", rank_);
  sw.device = std::move(stash.tensor);
  sw.bytes = sw.device.bytes();
  sw.host = take_pinned(sw.bytes, d2h_);
  host_.add(Category::activations, sw.bytes);
  const cudaEvent_t produced = record(compute_);  // the forward wrote it
  wait(d2h_, produced);
  pool_.push_back(produced);
  timed(planner::kCopyOutStream, d2h_, op, [&] {
    CUDA_CHECK(cudaMemcpyAsync(sw.host, sw.device.as<void>(), std::size_t(sw.bytes),
                               cudaMemcpyDeviceToHost, d2h_));
  });
  sw.down = record(d2h_);
  bytes_out_ += sw.bytes;
  activation_bytes_out_ += sw.bytes;
}

void CudaWorker::swap_done(Swap& sw) {
  host_wait(sw.down, "copy a stash to the host");
  // The download has read it and the forward that wrote it is done: free at once.
  sw.device = Tensor();
}

void CudaWorker::swap_in(const std::shared_ptr<Swap>& sw, int op) {
  sw->device = tensor(Category::activations, sw->bytes);
  wait(h2d_, sw->down);
  pool_.push_back(sw->down);
  sw->down = nullptr;
  timed(planner::kCopyInStream, h2d_, op, [&] {
    CUDA_CHECK(cudaMemcpyAsync(sw->device.as<void>(), sw->host, std::size_t(sw->bytes),
                               cudaMemcpyHostToDevice, h2d_));
  });
  sw->up = record(h2d_);
  bytes_in_ += sw->bytes;
  activation_bytes_in_ += sw->bytes;
}

void CudaWorker::swap_back(Swap& sw, const Key& key) {
  wait(compute_, sw.up);  // the stash is back on the device
  stash_[key] = Held{std::move(sw.device), nullptr};
  // The host block is free once the upload has read it: the next download into it waits.
  give_pinned(sw.host, sw.bytes, sw.up);
  sw.up = nullptr;
  host_.add(Category::activations, -sw.bytes);
}

void* CudaWorker::take_pinned(std::int64_t bytes, cudaStream_t writer) {
  std::vector<PinnedBlock>& free = pinned_free_[bytes];
  if (free.empty()) {
    void* block = nullptr;
    CUDA_CHECK(cudaHostAlloc(&block, std::size_t(bytes), cudaHostAllocDefault));
    pinned_all_.push_back(block);
    return block;
  }
  const PinnedBlock b = free.back();
  free.pop_back();
  wait(writer, b.last_read);  // its last upload has read it
  if (b.last_read) pool_.push_back(b.last_read);
  return b.data;
}

void CudaWorker::give_pinned(void* block, std::int64_t bytes, cudaEvent_t last_read) {
  pinned_free_[bytes].push_back({block, last_read});
}

// The copies and the host's CPU Adam (docs/formats.md, program ops), issued in program order on
// their streams; every dependency an event: an upload after its tile's Adam, Adam after the
// step's gradient copies, a backward after its stash's upload, the optimizer step after the last
// parameter upload.
void CudaWorker::offload(const Op& op) {
  if (!offload_optimizer_ && !swaps_)
    throw Error(fmt::format("rank {}: {} in a program that does not offload", rank_,
                            planner::to_string(op.kind)));
  const Key key{op.step, op.microbatch, op.chunk};
  switch (op.kind) {
    case OpKind::copy_activation_to_host:
      // The forward was compute op compute_ops_ - 1; its device buffer goes at Swaps' rule.
      swapped_.to_host(key, compute_ops_ - 1, op_);
      return;
    case OpKind::copy_activation_to_device:  // begins compute slot compute_ops_
      swapped_.to_device(key, compute_ops_, op_, rank_);
      return;
    case OpKind::copy_gradient_to_host:
    case OpKind::host_optimizer_step:
    case OpKind::copy_parameters_to_device:
      if (!offload_optimizer_) break;
      return optimizer_.run(op, op_);  // exec/optimizer_offload.hpp
    default:
      break;
  }
  throw Error(fmt::format("rank {}: {} is not an offload op of this program", rank_,
                          planner::to_string(op.kind)));
}

bool CudaWorker::keeps_tied_gradient(std::size_t chunk) const {
  return chunks_[chunk].tied_offset >= 0 && host_chunks_[chunk].resident.bytes() > 0;
}

// Stage 0's tied gradient, summed on the device by the tied exchange: to the host once.
void CudaWorker::download_tied_gradient(std::size_t chunk, int op) {
  const Chunk& c = chunks_[chunk];
  HostChunk& h = host_chunks_[chunk];
  bf16* transfer = h.transfer.as<bf16>() + c.tied_offset;
  float* acc = h.accumulator.data() + c.tied_offset;
  const std::int64_t n = c.tied_size;
  timed(planner::kCopyOutStream, d2h_, op, [&] {
    CUDA_CHECK(cudaMemcpyAsync(transfer, h.resident.as<void>(), std::size_t(2 * n),
                               cudaMemcpyDeviceToHost, d2h_));
    // The next step accumulates from zero (its backward waits for this step's uploads).
    CUDA_CHECK(cudaMemsetAsync(h.resident.as<void>(), 0, std::size_t(2 * n), d2h_));
    host_function(d2h_, [transfer, acc, n] {
      for (std::int64_t i = 0; i < n; ++i)
        acc[i] = __bfloat162float(transfer[i]);
    });
  });
  bytes_out_ += 2 * n;
}

// Sharded (w > 1): the replica's shard of each tile, reduce-scattered (and on stage 0 the tied
// head's gradient added) on the device, into the pinned transfer buffer, then as fp32 into the
// host's accumulator (a host function, in stream order); the device's gradients zeroed for the
// next step (the other shards hold this replica's unreduced sums; the next backward waits for the
// step's last download, OptimizerOffload::finish).
void CudaWorker::download_gradient_shards(std::size_t chunk, int op) {
  HostChunk& h = host_chunks_[chunk];
  Chunk& c = chunks_[chunk];
  bf16* transfer = h.transfer.as<bf16>();
  float* acc = h.accumulator.data();
  const std::int64_t n = h.n;
  timed(planner::kCopyOutStream, d2h_, op, [&] {
    for (std::size_t k = 0; k < h.tiles.size(); ++k)
      CUDA_CHECK(cudaMemcpyAsync(transfer + h.host_at[k], c.grads.as<bf16>() + h.tiles[k].begin,
                                 std::size_t(2 * h.tiles[k].size()), cudaMemcpyDeviceToHost, d2h_));
    CUDA_CHECK(cudaMemsetAsync(c.grads.as<void>(), 0, std::size_t(c.grads.bytes()), d2h_));
    host_function(d2h_, [transfer, acc, n] {
      for (std::int64_t i = 0; i < n; ++i)
        acc[i] = __bfloat162float(transfer[i]);
    });
  });
  bytes_out_ += 2 * n;
}

// CPU Adam of the tile as a host function on the host stream: the CPU worker's optimizer on the
// fp32 master (zeroes the accumulator), then the new bf16 parameters, rounded to nearest even as
// the device's update writes them.
void CudaWorker::host_adam(std::size_t chunk, int tile, int update, int op) {
  HostChunk& h = host_chunks_[chunk];
  const exec::detail::Tile t = h.tiles[std::size_t(tile)];
  const std::int64_t at = h.host_at[std::size_t(tile)];  // its parameters on the host
  const TrainOptions* options = s_.options;
  float* master = h.master.data() + at;
  float* acc = h.accumulator.data() + at;
  float* m = h.m.data() + at;
  float* v = h.v.empty() ? nullptr : h.v.data() + at;
  bf16* transfer = h.transfer.as<bf16>() + at;
  const std::int64_t n = t.size();
  timed(planner::kHostStream, host_stream_, op, [&] {
    host_function(host_stream_, [options, update, master, acc, m, v, transfer, n] {
      optimizer_update(*options, update, master, master, acc, m, v, n);
      for (std::int64_t i = 0; i < n; ++i)
        transfer[i] = __float2bfloat16(master[i]);
    });
  });
}

void CudaWorker::upload_tile(std::size_t chunk, int tile, int slot, int op) {
  HostChunk& h = host_chunks_[chunk];
  const exec::detail::Tile t = h.tiles[std::size_t(tile)];
  bf16* dst = chunks_[chunk].slots[slot].as<bf16>() + t.begin;
  const bf16* src = h.transfer.as<bf16>() + h.host_at[std::size_t(tile)];
  timed(planner::kCopyInStream, h2d_, op, [&] {
    CUDA_CHECK(cudaMemcpyAsync(dst, src, std::size_t(2 * t.size()), cudaMemcpyHostToDevice, h2d_));
  });
  bytes_in_ += 2 * t.size();
}

// The device's optimizer step under optimizer offload: the uploads have written the new version
// (CPU Adam ran on the host); the compute stream waits for them, then the step ends as usual.
void CudaWorker::offload_step(const Op& op) {
  const int slot = optimizer_.finish(op.version);  // the uploads' slot (throws: none came)
  if (reduced_) pool_.push_back(reduced_);
  reduced_ = nullptr;
  ++updates_;
  // Sharded: the replicas' uploaded shards to one another, into the new version's slot.
  if (offload_sharded_) all_gather(slot);
  end_of_step(op.step);
}

// The rank's shard (exec::ShardLayout, both workers' rule) over host scratch (`host`): every
// weight version held (bf16 values as fp32, exact), then the fp32 master and moments of the
// parameters the rank keeps the state of (the distributed optimizer: its shard of the chunk; under
// optimizer offload the host's, its host-updated parameters [0, n_h); with offload chunks every
// parameter's, in the chunks' state: chunk_checkpoint).
ShardLayout CudaWorker::shard_tensors(const std::vector<int>& versions,
                                      std::vector<std::vector<float>>& host) {
  std::vector<std::int64_t> parameters, state;
  for (std::size_t i = 0; i < chunks_.size(); ++i) {
    const Chunk& c = chunks_[i];
    parameters.push_back(c.sizes.parameters);
    state.push_back(offload_optimizer_ ? host_chunks_[i].n
                    : chunked_         ? c.sizes.parameters
                                       : c.own_end - c.own_begin);
  }
  std::vector<std::string> names = {"master", "m"};
  if (s_.options->optimizer == "adamw") names.push_back("v");
  ShardLayout shard(parameters, versions, names, state);
  host.clear();
  host.reserve(shard.tensors().size());  // no reallocation: the tensors point into it
  for (std::size_t i = 0; i < chunks_.size(); ++i) {
    for (std::size_t j = 0; j < versions.size(); ++j) {
      host.emplace_back(std::size_t(parameters[i]));
      shard.weights(i, j).data = host.back().data();
    }
    for (std::size_t which = 0; which < shard.states(); ++which) {
      host.emplace_back(std::size_t(state[i]));
      shard.state(i, which).data = host.back().data();
    }
  }
  return shard;
}

void CudaWorker::save_checkpoint(int step) {
  const int updates = step + 1;
  const std::vector<int> versions = planner::initial_versions(s_.plan(), updates);
  std::vector<std::vector<float>> host;
  ShardLayout shard = shard_tensors(versions, host);
  if (chunked_) chunk_checkpoint(shard, true);  // read out of the chunks
  for (std::size_t i = 0; i < chunks_.size() && !chunked_; ++i) {
    const Chunk& c = chunks_[i];
    const std::int64_t n = c.sizes.parameters;
    for (std::size_t j = 0; j < versions.size(); ++j) {
      std::vector<bf16> w(static_cast<std::size_t>(n));
      CUDA_CHECK(
          cudaMemcpy(w.data(), params(c, versions[j]), std::size_t(2 * n), cudaMemcpyDeviceToHost));
      const std::vector<float> f = to_float(w.data(), n);
      std::copy(f.begin(), f.end(), shard.weights(i, j).data);
    }
    std::size_t which = 0;
    if (offload_optimizer_) {  // the host's (every host function of the step has run)
      const HostChunk& h = host_chunks_[i];
      for (const Buffer* b : {&h.master, &h.m, &h.v})
        if (!b->empty()) std::copy_n(b->data(), h.n, shard.state(i, which++).data);
      continue;
    }
    for (const float* t : {c.master_at, c.m_at, c.v_at}) {
      if (!t) continue;
      ShardTensor& to = shard.state(i, which++);
      CUDA_CHECK(cudaMemcpy(to.data, t, std::size_t(4 * to.size), cudaMemcpyDeviceToHost));
    }
  }
  // The last stage's copy of the tied tensor: zeros, as on the CPU (resume takes stage 0's).
  const Chunk& last = chunks_.back();
  if (exec::detail::zeroed_tied_copy(s_.plan(), last.last, last.tied_offset))
    shard.zero_tied_copy(chunks_.size() - 1, last.tied_offset, last.tied_size, nullptr);
  const common::Json header = {{"format", "pipewright.checkpoint-shard/2"},
                               {"backend", "cuda"},
                               {"rank", device_},
                               {"tp", tp_},
                               {"stage", stage_},
                               {"replica", replica_},
                               {"step", updates},
                               {"versions", versions}};
  write_shard(shard_path(checkpoint_path(s_.options->checkpoint_dir, updates), device_), header,
              shard.tensors());
}

void CudaWorker::load_checkpoint(int step) {
  const planner::Plan& p = s_.plan();
  const std::vector<int> versions = planner::initial_versions(p, step);
  slots_.resume(versions);
  if (versions.size() == 2 && !chunked_)
    for (Chunk& c : chunks_)
      c.slots[1] = tensor(Category::weight_versions, 2 * c.sizes.parameters);
  updates_ = step;
  std::vector<std::vector<float>> host;
  ShardLayout shard = shard_tensors(versions, host);
  const std::string dir = checkpoint_path(s_.options->checkpoint_dir, step);
  read_shard(shard_path(dir, device_), shard.tensors());
  // The last stage's tied copy comes from stage 0's shard of this replica and TP index.
  const Chunk& last = chunks_.back();
  if (exec::detail::zeroed_tied_copy(p, last.last, last.tied_offset)) {
    const exec::detail::TiedCopySource from =
        exec::detail::tied_copy_source(*s_.model, p, replica_, tp_, dir);
    shard.read_tied_copy(chunks_.size() - 1, last.tied_offset, last.tied_size, from.shard,
                         from.offset);
  }
  if (chunked_) return chunk_checkpoint(shard, false);
  for (std::size_t i = 0; i < chunks_.size(); ++i) {
    Chunk& c = chunks_[i];
    const std::int64_t n = c.sizes.parameters;
    for (std::size_t j = 0; j < versions.size(); ++j) {
      // bf16 values stored as fp32: rounding them back is exact.
      const std::vector<bf16> w = to_bf16(shard.weights(i, j).data, n);
      CUDA_CHECK(
          cudaMemcpy(params(c, versions[j]), w.data(), std::size_t(2 * n), cudaMemcpyHostToDevice));
    }
    std::size_t which = 0;
    if (offload_optimizer_) {
      HostChunk& h = host_chunks_[i];
      for (Buffer* b : {&h.master, &h.m, &h.v})
        if (!b->empty()) std::copy_n(shard.state(i, which++).data, h.n, b->data());
      continue;
    }
    for (float* t : {c.master_at, c.m_at, c.v_at}) {
      if (!t) continue;
      const ShardTensor& from = shard.state(i, which++);
      CUDA_CHECK(cudaMemcpy(t, from.data, std::size_t(4 * from.size), cudaMemcpyHostToDevice));
    }
  }
}

RankResult CudaWorker::result() {
  RankResult r;
  r.rank = device_;
  r.peak_memory_bytes = memory_.peak();
  r.memory = memory_.at_peak();
  r.busy_s = busy_s_;
  r.host_peak_memory_bytes = host_.peak();
  r.copy_out_bytes = bytes_out_;
  r.copy_in_bytes = bytes_in_;
  r.activation_out_bytes = activation_bytes_out_;
  r.activation_in_bytes = activation_bytes_in_;
  if (chunked_) r.weights = chunk_weights();
  for (const Chunk& c : chunks_) {
    if (chunked_) break;
    const std::int64_t n = c.sizes.parameters;
    std::vector<bf16> w(static_cast<std::size_t>(n));
    CUDA_CHECK(cudaMemcpy(w.data(), c.slots[slots_.newest()].as<bf16>(), std::size_t(2 * n),
                          cudaMemcpyDeviceToHost));
    r.weights.push_back(to_float(w.data(), n));
  }
  for (const auto& slot : chunks_.front().stage->layout())
    r.slot_names.push_back(slot.name);
  r.timeline.rank = device_;
  r.timeline.label = t_ > 1 ? fmt::format("device {} (GPU {}, stage {}, replica {}, TP {})",
                                          device_, s_.device, stage_, replica_, tp_)
                            : fmt::format("rank {} (GPU {}, stage {}, replica {})", rank_,
                                          s_.device, stage_, replica_);
  std::sort(ops_.begin(), ops_.end(),
            [](const planner::TimedOp& a, const planner::TimedOp& b) { return a.op < b.op; });
  r.timeline.ops = ops_;
  for (const auto& [t, bytes] : memory_.samples())
    r.timeline.memory.emplace_back(
        std::max(0.0, std::chrono::duration<double>(t - s_.start).count()), bytes);
  if (host_.peak() > 0)  // offload: the pinned host pool over time (the simulator's track)
    for (const auto& [t, bytes] : host_.samples())
      r.timeline.host_memory.emplace_back(
          std::max(0.0, std::chrono::duration<double>(t - s_.start).count()), bytes);
  return r;
}

}  // namespace pw::exec::cuda::detail
