// One rank's GPU worker (see worker.hpp): the program's ops as stream-ordered GPU work.
#include "exec/cuda/worker.hpp"

#include <algorithm>
#include <cstring>
#include <thread>

#include <fmt/format.h>

#include "exec/checkpoint.hpp"
#include "exec/cuda/kernels.cuh"
#include "exec/cuda/optimizer.cuh"

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

CudaWorker::CudaWorker(GpuShared& s, int rank, MemoryCounter& counter)
    : s_(s),
      transport_(*s.transport),
      rank_(rank),
      stage_(s.plan().stage_of(rank)),
      replica_(s.plan().replica_of(rank)),
      memory_(counter) {
  CUDA_CHECK(cudaSetDevice(s.device));
  for (cudaStream_t* st : all_streams())
    CUDA_CHECK(cudaStreamCreateWithFlags(st, cudaStreamNonBlocking));
  slots_.set_rank(rank);
  const planner::Plan& p = s.plan();
  std::int64_t workspace = 0;
  for (int c = 0; c < p.v; ++c) {
    const StageSpec spec = exec::detail::chunk_spec(*s.model, p, stage_, c);
    Chunk ch;
    ch.stage = std::make_unique<CudaGptStage>(spec, *s.arena, compute_);
    // The stage's cuBLASLt workspace and status word are this rank's memory too.
    memory_.add(Category::workspace, ch.stage->internal_bytes());
    ch.sizes = ch.stage->sizes(p.b);
    ch.first = spec.has_embedding;
    ch.last = spec.has_head;
    const std::int64_t n = ch.sizes.parameters;
    ch.slots[0] = tensor(Category::weights, 2 * n);
    ch.grads = tensor(Category::gradients, 2 * n);
    ch.master = tensor(Category::optimizer, 4 * n);
    ch.m = tensor(Category::optimizer, 4 * n);
    if (s.options->optimizer == "adamw") ch.v = tensor(Category::optimizer, 4 * n);
    // The CPU backend's initialisation (fp32, deterministic in seed and tensor name), rounded.
    std::vector<float> host(std::size_t(n), 0.0f);
    make_cpu_stage(spec)->init_parameters(host.data(), s.options->seed);
    ch.stage->upload_parameters(host.data(), ch.slots[0].as<bf16>(), ch.master.as<float>());
    CUDA_CHECK(cudaMemsetAsync(ch.grads.as<void>(), 0, std::size_t(2 * n), compute_));
    CUDA_CHECK(cudaMemsetAsync(ch.m.as<void>(), 0, std::size_t(4 * n), compute_));
    if (ch.v.bytes() > 0)
      CUDA_CHECK(cudaMemsetAsync(ch.v.as<void>(), 0, std::size_t(4 * n), compute_));
    if (s.model->tied_embeddings && ch.first != ch.last)
      for (const auto& slot : ch.stage->layout())
        if (slot.name == (ch.first ? "wte" : "lm_head")) {
          ch.tied_offset = slot.offset;
          ch.tied_size = slot.size;
        }
    workspace = std::max(workspace, ch.sizes.workspace);
    chunks_.push_back(std::move(ch));
  }
  workspace_ = tensor(Category::workspace, 2 * workspace);
  if (chunks_.back().last) losses_ = tensor(Category::workspace, 4 * 2 * std::int64_t(p.m));
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
  for (cudaEvent_t e : all_events_)
    (void)cudaEventDestroy(e);
  for (cudaStream_t* st : all_streams())
    if (*st) (void)cudaStreamDestroy(*st);
  (void)cudaGetLastError();
}

std::vector<cudaStream_t*> CudaWorker::all_streams() {
  std::vector<cudaStream_t*> out = {&compute_, &reduce_};
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

void CudaWorker::begin_timed(int stream_id, cudaStream_t s) {
  open_ = {stream_id, op_, record(s), nullptr};
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
}

void CudaWorker::drain_compute(const char* what) {
  cudaEvent_t newest = nullptr;
  for (const Retired& r : retired_)
    if (r.stream == compute_) newest = r.done;  // compute runs in order: the newest covers all
  if (!newest) return;
  const auto start = Clock::now();
  for (int spins = 0;; ++spins) {
    const cudaError_t q = cudaEventQuery(newest);
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
  reclaim(false);
}

void CudaWorker::synchronize(cudaStream_t s, const std::string& what) {
  transport_.synchronize(rank_, s, what);
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
  const Chunk& c = chunks_[std::size_t(op.chunk)];
  if (channel == Channel::activation)
    recv(op, channel, inputs_, c.sizes.input);
  else
    recv(op, channel, d_outputs_, c.sizes.output);
}

void CudaWorker::offload(const Op&) {  // prepare_run refuses offload plans before any runs
  throw InputError("train does not support --offload yet");
}

// Takes the tensor of `key` out of `from` and makes `s` wait until it is valid.
static Held take(std::map<std::tuple<int, int, int>, Held>& from,
                 const std::tuple<int, int, int>& key, const char* what, int rank) {
  const auto it = from.find(key);
  if (it == from.end())
    throw Error(fmt::format("rank {}: no {} for step {} microbatch {} chunk {}", rank, what,
                            std::get<0>(key), std::get<1>(key), std::get<2>(key)));
  Held h = std::move(it->second);
  from.erase(it);
  return h;
}

void CudaWorker::forward(const Op& op) {
  const Key key{op.step, op.microbatch, op.chunk};
  Chunk& c = chunks_[std::size_t(op.chunk)];
  const planner::Plan& p = s_.plan();
  const bool rc = p.recomputes(stage_);
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
  Tensor stash = tensor(Category::activations, 2 * (rc ? c.sizes.stash_recompute : c.sizes.stash));
  Tensor out = tensor(Category::activations, c.last ? 0 : 2 * c.sizes.output);
  Tensor scratch = tensor(Category::activations, rc ? 2 * c.sizes.scratch : 0);
  float* loss = c.last ? losses_.as<float>() + (op.step % 2) * p.m + op.microbatch : nullptr;
  begin_timed(planner::kComputeStream, compute_);
  c.stage->forward(params(c, op.version), c.first ? tokens.data() : nullptr,
                   c.first ? nullptr : input.tensor.as<bf16>(), c.last ? targets.data() : nullptr,
                   p.b, rc, stash.as<bf16>(), c.last ? nullptr : out.as<bf16>(),
                   rc ? scratch.as<bf16>() : nullptr, loss);
  end_timed(compute_);
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
  Tensor full = tensor(Category::activations, 2 * c.sizes.stash);
  const auto kept = stash_.find(key);
  if (kept == stash_.end())
    throw Error(fmt::format("rank {}: recompute of step {} microbatch {} without its stash", rank_,
                            op.step, op.microbatch));
  begin_timed(planner::kComputeStream, compute_);
  c.stage->recompute(params(c, op.version), c.last ? targets.data() : nullptr, s_.plan().b,
                     kept->second.tensor.as<bf16>(), full.as<bf16>());
  end_timed(compute_);
  full_[key] = Held{std::move(full), nullptr};
}

void CudaWorker::backward(const Op& op) {
  const Key key{op.step, op.microbatch, op.chunk};
  Chunk& c = chunks_[std::size_t(op.chunk)];
  const planner::Plan& p = s_.plan();
  const bool rc = p.recomputes(stage_);
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
  Tensor d_input = tensor(Category::activations, c.first ? 0 : 2 * c.sizes.input);
  // Gradients of the mean loss over the global batch: 1 / (B T) per token.
  const float scale = 1.0f / float(double(p.global_batch()) * double(s_.model->seq_len));
  begin_timed(planner::kComputeStream, compute_);
  c.stage->backward(params(c, op.version), (rc ? full : stash).tensor.as<bf16>(),
                    c.last ? nullptr : d_output.tensor.as<bf16>(), p.b, scale, c.grads.as<bf16>(),
                    c.first ? nullptr : d_input.as<bf16>(), workspace_.as<bf16>());
  end_timed(compute_);
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
  transport_.send(rank_, op.peer, channel, h.tensor.as<void>(), h.tensor.bytes(), stream);
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
  Tensor t = tensor(Category::activations, 2 * elements);
  begin_timed(planner::kRecvStream, stream);
  transport_.recv(op.peer, rank_, channel, t.as<void>(), t.bytes(), stream);
  end_timed(stream);
  into[key] = Held{std::move(t), record(stream)};
}

void CudaWorker::all_reduce(const Op& op) {
  const planner::Plan& p = s_.plan();
  Chunk& c = chunks_[std::size_t(op.chunk)];
  const auto [begin, end] =
      exec::detail::bucket_range(c.sizes.parameters, s_.programs->buckets, op.bucket);
  std::vector<int> group;
  for (int r = 0; r < p.w; ++r)
    group.push_back(p.rank_of(stage_, r));
  const cudaEvent_t produced = record(compute_);
  wait(reduce_, produced);
  pool_.push_back(produced);
  begin_timed(planner::kCollectiveStream, reduce_);
  transport_.all_reduce_sum_bf16(group, rank_, c.grads.as<bf16>() + begin, end - begin, reduce_);
  end_timed(reduce_);
  if (reduced_) pool_.push_back(reduced_);
  reduced_ = record(reduce_);
}

// The token embedding (stage 0) and the LM head's copy (last stage) are one parameter; stage 0
// owns its update (see exec/worker.cpp, whose order of the sums and shards this follows: with
// w > 1 each message carries the replica's shard, and an all-reduce of buffers that hold zeros
// outside each member's shard gathers them on the reduce stream).
void CudaWorker::tied(const Op& op) {
  Chunk& c = chunks_[std::size_t(op.chunk)];
  if (c.tied_offset < 0)
    throw Error(fmt::format("rank {}: {} on chunk {}, which holds no tied tensor", rank_,
                            planner::to_string(op.kind), op.chunk));
  const planner::Plan& p = s_.plan();
  const std::int64_t n = c.tied_size, bytes = 2 * n;
  const planner::TiedShard sh = planner::tied_shard(n, p.w, replica_);
  const std::int64_t shard_bytes = 2 * (sh.end - sh.begin);
  bf16* grad = c.grads.as<bf16>() + c.tied_offset;
  std::vector<int> group;
  for (int r = 0; r < p.w; ++r)
    group.push_back(p.rank_of(stage_, r));
  switch (op.kind) {
    case OpKind::send_tied_gradient: {
      const cudaStream_t stream = send_[int(Channel::tied)];
      // A copy goes out, so the slice is zeroed at once for the next step's sums: the compute
      // stream never waits for the receiver (NCCL's send waits for it).
      wait(compute_, reduced_);
      Tensor copy = tensor(Category::workspace, shard_bytes);
      CUDA_CHECK(cudaMemcpyAsync(copy.as<void>(), grad + sh.begin, std::size_t(shard_bytes),
                                 cudaMemcpyDeviceToDevice, compute_));
      CUDA_CHECK(cudaMemsetAsync(grad, 0, std::size_t(bytes), compute_));
      const cudaEvent_t produced = record(compute_);
      wait(stream, produced);
      pool_.push_back(produced);
      begin_timed(planner::kSendStream, stream);
      transport_.send(rank_, op.peer, Channel::tied, copy.as<void>(), shard_bytes, stream);
      end_timed(stream);
      retire(std::move(copy), stream);
      return;
    }
    case OpKind::recv_tied_gradient: {
      const cudaStream_t stream = recv_[int(Channel::tied)];
      Tensor head = tensor(Category::workspace, bytes);
      if (p.w > 1) CUDA_CHECK(cudaMemsetAsync(head.as<void>(), 0, std::size_t(bytes), stream));
      begin_timed(planner::kRecvStream, stream);
      transport_.recv(op.peer, rank_, Channel::tied, head.as<bf16>() + sh.begin, shard_bytes,
                      stream);
      end_timed(stream);
      const cudaEvent_t arrived = record(stream);
      if (p.w > 1) {
        tied_head_ = Held{std::move(head), arrived};
        return;
      }
      wait(compute_, arrived);
      wait(compute_, reduced_);
      pool_.push_back(arrived);
      residual_add(grad, grad, head.as<bf16>(), n, compute_);
      retire(std::move(head), compute_);
      return;
    }
    case OpKind::gather_tied_gradient: {
      wait(reduce_, tied_head_.ready);
      pool_.push_back(tied_head_.ready);
      begin_timed(planner::kCollectiveStream, reduce_);
      transport_.all_reduce_sum_bf16(group, rank_, tied_head_.tensor.as<bf16>(), n, reduce_);
      end_timed(reduce_);
      if (reduced_) pool_.push_back(reduced_);
      reduced_ = record(reduce_);
      wait(compute_, reduced_);
      residual_add(grad, grad, tied_head_.tensor.as<bf16>(), n, compute_);
      retire(std::move(tied_head_.tensor), compute_);
      tied_head_ = {};
      return;
    }
    case OpKind::send_tied_weights: {
      const cudaStream_t stream = send_[int(Channel::tied_weights)];
      const cudaEvent_t produced = record(compute_);
      wait(stream, produced);
      pool_.push_back(produced);
      begin_timed(planner::kSendStream, stream);
      transport_.send(rank_, op.peer, Channel::tied_weights,
                      params(c, op.version) + c.tied_offset + sh.begin, shard_bytes, stream);
      end_timed(stream);
      // The update that next rewrites this slot must not do so before the send has read it;
      // waiting there, not here, keeps the compute stream free until then (2BW rewrites it two
      // steps later, flush schedules at the next step).
      cudaEvent_t& sent = slot_sent_[slots_.slot_of(op.version)];
      if (sent) pool_.push_back(sent);
      sent = record(stream);
      return;
    }
    case OpKind::recv_tied_weights: {
      const cudaStream_t stream = recv_[int(Channel::tied_weights)];
      // Written straight into the version's slot, after the optimizer filled the rest of it (and
      // after every earlier reader of the slot's previous version).
      const cudaEvent_t before = record(compute_);
      wait(stream, before);
      pool_.push_back(before);
      bf16* copy = params(c, op.version) + c.tied_offset;
      if (p.w > 1) CUDA_CHECK(cudaMemsetAsync(copy, 0, std::size_t(bytes), stream));
      begin_timed(planner::kRecvStream, stream);
      transport_.recv(op.peer, rank_, Channel::tied_weights, copy + sh.begin, shard_bytes, stream);
      end_timed(stream);
      const cudaEvent_t arrived = record(stream);
      if (p.w > 1) {
        tied_arrived_ = arrived;
        return;
      }
      wait(compute_, arrived);
      pool_.push_back(arrived);
      return;
    }
    default: {  // gather_tied_weights: the version's copy, in place
      wait(reduce_, tied_arrived_);
      pool_.push_back(tied_arrived_);
      tied_arrived_ = nullptr;
      begin_timed(planner::kCollectiveStream, reduce_);
      transport_.all_reduce_sum_bf16(group, rank_, params(c, op.version) + c.tied_offset, n,
                                     reduce_);
      end_timed(reduce_);
      const cudaEvent_t gathered = record(reduce_);
      wait(compute_, gathered);
      pool_.push_back(gathered);
      return;
    }
  }
}

// One device holding both tied ends (d == 1, v > 1): the same sum, on both chunks, no messages.
void CudaWorker::sum_local_tied() {
  Chunk* embedding = nullptr;
  Chunk* head = nullptr;
  for (Chunk& c : chunks_) {
    if (c.tied_offset < 0) continue;
    (c.first ? embedding : head) = &c;
  }
  if (!embedding || !head) return;
  bf16* e = embedding->grads.as<bf16>() + embedding->tied_offset;
  bf16* h = head->grads.as<bf16>() + head->tied_offset;
  residual_add(e, e, h, embedding->tied_size, compute_);
  CUDA_CHECK(cudaMemcpyAsync(h, e, std::size_t(2 * embedding->tied_size), cudaMemcpyDeviceToDevice,
                             compute_));
}

void CudaWorker::optimizer_step(const Op& op) {
  wait(compute_, reduced_);
  if (reduced_) pool_.push_back(reduced_);
  reduced_ = nullptr;
  if (s_.plan().d == 1) sum_local_tied();
  ++updates_;
  bool allocate = false;
  const int target = slots_.target_for(op.version, allocate);
  if (allocate)
    for (Chunk& c : chunks_)
      c.slots[target] = tensor(Category::weight_versions, 2 * c.sizes.parameters);
  if (slot_sent_[target]) {
    wait(compute_, slot_sent_[target]);
    pool_.push_back(slot_sent_[target]);
    slot_sent_[target] = nullptr;
  }
  begin_timed(planner::kComputeStream, compute_);
  for (Chunk& c : chunks_)
    update(c, c.slots[target].as<bf16>());
  end_timed(compute_);
  slots_.place(op.version, target);
  end_of_step(op.step);
}

// fp32 master weights (always the newest version) -> the target slot's bf16 copy. The last
// stage's copy of the tied tensor (d > 1) is not updated here: stage 0 sends it.
void CudaWorker::update(Chunk& c, bf16* target) {
  const TrainOptions& o = *s_.options;
  AdamWParams a;
  a.lr = o.lr;
  a.beta1 = o.beta1;
  a.beta2 = o.beta2;
  a.eps = o.eps;
  a.weight_decay = o.weight_decay;
  for (const auto& [begin, end] : exec::detail::updated_ranges(
           c.first, c.last, c.tied_offset, c.tied_size, s_.plan().d, c.sizes.parameters)) {
    float* master = c.master.as<float>() + begin;
    bf16* grads = c.grads.as<bf16>() + begin;
    float* m = c.m.as<float>() + begin;
    if (o.optimizer == "adamw")
      adamw_update(master, target + begin, grads, m, c.v.as<float>() + begin, end - begin, a,
                   updates_, compute_);
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
  if (chunks_.back().last) {
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
  if (s_.checkpoint_after(step)) save_checkpoint(step);
  s_.finish_step(step);
}

// Every weight version held (bf16 values as fp32, exact), then the fp32 master and moments.
std::vector<ShardTensor> CudaWorker::shard_tensors(const std::vector<int>& versions,
                                                   std::vector<std::vector<float>>& host) {
  std::vector<ShardTensor> tensors;
  host.clear();
  host.reserve(chunks_.size() * (versions.size() + 3));
  for (std::size_t i = 0; i < chunks_.size(); ++i) {
    const Chunk& c = chunks_[i];
    const std::int64_t n = c.sizes.parameters;
    for (int version : versions) {
      host.emplace_back(std::size_t(n));
      tensors.push_back({fmt::format("c{}.w{}", i, version), host.back().data(), n});
    }
    for (const char* name : {"master", "m", "v"}) {
      if (std::string(name) == "v" && c.v.bytes() == 0) continue;
      host.emplace_back(std::size_t(n));
      tensors.push_back({fmt::format("c{}.{}", i, name), host.back().data(), n});
    }
  }
  return tensors;
}

void CudaWorker::save_checkpoint(int step) {
  const int updates = step + 1;
  const std::vector<int> versions = planner::initial_versions(s_.plan(), updates);
  std::vector<std::vector<float>> host;
  const std::vector<ShardTensor> tensors = shard_tensors(versions, host);
  std::size_t k = 0;
  for (std::size_t i = 0; i < chunks_.size(); ++i) {
    const Chunk& c = chunks_[i];
    const std::int64_t n = c.sizes.parameters;
    for (int version : versions) {
      std::vector<bf16> w(static_cast<std::size_t>(n));
      CUDA_CHECK(
          cudaMemcpy(w.data(), params(c, version), std::size_t(2 * n), cudaMemcpyDeviceToHost));
      const std::vector<float> f = to_float(w.data(), n);
      std::copy(f.begin(), f.end(), tensors[k].data);
      // The last stage's copy of the tied tensor: zeros, as on the CPU (resume takes stage 0's).
      if (s_.plan().d > 1 && c.last && c.tied_offset >= 0)
        std::fill_n(tensors[k].data + c.tied_offset, c.tied_size, 0.0f);
      ++k;
    }
    for (const Tensor* t : {&c.master, &c.m, &c.v}) {
      if (t->bytes() == 0) continue;
      CUDA_CHECK(
          cudaMemcpy(tensors[k].data, t->as<float>(), std::size_t(4 * n), cudaMemcpyDeviceToHost));
      ++k;
    }
  }
  const common::Json header = {{"format", "pipewright.checkpoint-shard/2"},
                               {"backend", "cuda"},
                               {"rank", rank_},
                               {"stage", stage_},
                               {"replica", replica_},
                               {"step", updates},
                               {"versions", versions}};
  write_shard(shard_path(checkpoint_path(s_.options->checkpoint_dir, updates), rank_), header,
              tensors);
}

void CudaWorker::load_checkpoint(int step) {
  const planner::Plan& p = s_.plan();
  const std::vector<int> versions = planner::initial_versions(p, step);
  slots_.resume(versions);
  if (versions.size() == 2)
    for (Chunk& c : chunks_)
      c.slots[1] = tensor(Category::weight_versions, 2 * c.sizes.parameters);
  updates_ = step;
  std::vector<std::vector<float>> host;
  const std::vector<ShardTensor> tensors = shard_tensors(versions, host);
  const std::string dir = checkpoint_path(s_.options->checkpoint_dir, step);
  read_shard(shard_path(dir, rank_), tensors);
  // The last stage's tied copy comes from stage 0's shard of this replica.
  Chunk& last = chunks_.back();
  if (p.d > 1 && last.last && last.tied_offset >= 0) {
    const exec::GptLayout first(exec::detail::chunk_spec(*s_.model, p, 0, 0), models::DType::bf16,
                                "cuda");
    const std::string shard = shard_path(dir, p.rank_of(0, replica_));
    const std::size_t base = (chunks_.size() - 1) * (versions.size() + (last.v.bytes() ? 3 : 2));
    for (std::size_t j = 0; j < versions.size(); ++j)
      read_shard_slice(shard, fmt::format("c0.w{}", versions[j]), first.wte,
                       tensors[base + j].data + last.tied_offset, last.tied_size);
  }
  std::size_t k = 0;
  for (Chunk& c : chunks_) {
    const std::int64_t n = c.sizes.parameters;
    for (int version : versions) {
      // bf16 values stored as fp32: rounding them back is exact.
      const std::vector<bf16> w = to_bf16(tensors[k].data, n);
      CUDA_CHECK(
          cudaMemcpy(params(c, version), w.data(), std::size_t(2 * n), cudaMemcpyHostToDevice));
      ++k;
    }
    for (Tensor* t : {&c.master, &c.m, &c.v}) {
      if (t->bytes() == 0) continue;
      CUDA_CHECK(
          cudaMemcpy(t->as<float>(), tensors[k].data, std::size_t(4 * n), cudaMemcpyHostToDevice));
      ++k;
    }
  }
}

RankResult CudaWorker::result() {
  RankResult r;
  r.rank = rank_;
  r.peak_memory_bytes = memory_.peak();
  r.memory = memory_.at_peak();
  r.busy_s = busy_s_;
  for (const Chunk& c : chunks_) {
    const std::int64_t n = c.sizes.parameters;
    std::vector<bf16> w(static_cast<std::size_t>(n));
    CUDA_CHECK(cudaMemcpy(w.data(), c.slots[slots_.newest()].as<bf16>(), std::size_t(2 * n),
                          cudaMemcpyDeviceToHost));
    r.weights.push_back(to_float(w.data(), n));
  }
  for (const auto& slot : chunks_.front().stage->layout())
    r.slot_names.push_back(slot.name);
  r.timeline.rank = rank_;
  r.timeline.label =
      fmt::format("rank {} (GPU {}, stage {}, replica {})", rank_, s_.device, stage_, replica_);
  std::sort(ops_.begin(), ops_.end(),
            [](const planner::TimedOp& a, const planner::TimedOp& b) { return a.op < b.op; });
  r.timeline.ops = ops_;
  for (const auto& [t, bytes] : memory_.samples())
    r.timeline.memory.emplace_back(
        std::max(0.0, std::chrono::duration<double>(t - s_.start).count()), bytes);
  return r;
}

}  // namespace pw::exec::cuda::detail
