// One rank's worker: interprets its program op by op with real compute (see runtime.hpp).
#include "exec/worker.hpp"

#include "exec/optimizer.hpp"

#include <cmath>
#include <cstring>

#include <fmt/format.h>

namespace pw::exec::detail {

using planner::Op;
using planner::OpKind;

Worker::Worker(Shared& s, int rank)
    : s_(s),
      rank_(rank),
      stage_(s.plan().stage_of(rank)),
      replica_(s.plan().replica_of(rank)),
      memory_(&s.devices[std::size_t(rank)]) {
  const planner::Plan& p = s.plan();
  std::int64_t workspace = 0;
  slots_.set_rank(rank);
  for (int c = 0; c < p.v; ++c) {
    const StageSpec spec = chunk_spec(*s.model, p, stage_, c);
    Chunk ch;
    ch.stage = make_cpu_stage(spec);
    ch.sizes = ch.stage->sizes(p.b);
    ch.first = spec.has_embedding;
    ch.last = spec.has_head;
    const std::int64_t n = ch.sizes.parameters;
    ch.slots[0] = Buffer(memory_, Category::weights, n);
    ch.stage->init_parameters(ch.slots[0].data(), s.options->seed);
    ch.grads = Buffer(memory_, Category::gradients, n);
    ch.m = Buffer(memory_, Category::optimizer, n);
    if (s.options->optimizer == "adamw") ch.v = Buffer(memory_, Category::optimizer, n);
    if (s.model->tied_embeddings && ch.first != ch.last)
      for (const auto& slot : ch.stage->layout())
        if (slot.name == (ch.first ? "wte" : "lm_head")) {
          ch.tied_offset = slot.offset;
          ch.tied_size = slot.size;
        }
    workspace = std::max(workspace, ch.sizes.workspace);
    chunks_.push_back(std::move(ch));
  }
  workspace_ = Buffer(memory_, Category::workspace, workspace);
  if (s.first_step > 0) load_checkpoint(s.first_step);
}

// The tensors of a shard: per chunk, every weight version held (ascending), then the optimizer's
// state (momentum; AdamW's second moment).
std::vector<ShardTensor> Worker::shard_tensors(const std::vector<int>& versions) {
  std::vector<ShardTensor> tensors;
  for (std::size_t i = 0; i < chunks_.size(); ++i) {
    Chunk& c = chunks_[i];
    for (int version : versions)
      tensors.push_back({fmt::format("c{}.w{}", i, version),
                         c.slots[slots_.slot_of(version)].data(), c.sizes.parameters});
    tensors.push_back({fmt::format("c{}.m", i), c.m.data(), c.m.size()});
    if (!c.v.empty()) tensors.push_back({fmt::format("c{}.v", i), c.v.data(), c.v.size()});
  }
  return tensors;
}

// After `step` + 1 updates this rank holds what the next steps use: the newest version and, for
// 2BW, the shadow one (initial_versions of a run resumed there). Gradients are zero here.
void Worker::save_checkpoint(int step) {
  const int updates = step + 1;
  const std::vector<int> versions = planner::initial_versions(s_.plan(), updates);
  common::Json header = {{"format", "pipewright.checkpoint-shard/2"},
                         {"rank", rank_},
                         {"stage", stage_},
                         {"replica", replica_},
                         {"step", updates},
                         {"versions", versions}};
  std::vector<ShardTensor> tensors = shard_tensors(versions);
  // The last stage's copy of the tied tensor may not have arrived yet for these versions, and what
  // its slot holds until then depends on the run's history. Resume takes the copy from stage 0's
  // shard, so this shard stores it as zeros: the same bytes however the run got here.
  std::vector<std::vector<float>> copies;
  const Chunk& last = chunks_.back();
  if (s_.plan().d > 1 && last.last && last.tied_offset >= 0) {
    const std::size_t chunk = chunks_.size() - 1;
    for (ShardTensor& t : tensors) {
      if (t.name.rfind(fmt::format("c{}.w", chunk), 0) != 0) continue;
      copies.emplace_back(t.data, t.data + t.size);  // moving a vector keeps its buffer
      std::fill_n(copies.back().begin() + last.tied_offset, last.tied_size, 0.0f);
      t.data = copies.back().data();
    }
  }
  write_shard(shard_path(checkpoint_path(s_.options->checkpoint_dir, updates), rank_), header,
              tensors);
}

void Worker::load_checkpoint(int step) {
  const std::vector<int> versions = planner::initial_versions(s_.plan(), step);
  slots_.resume(versions);
  if (versions.size() == 2)
    for (Chunk& c : chunks_)
      c.slots[1] = Buffer(memory_, Category::weight_versions, c.sizes.parameters);
  updates_ = step;
  read_shard(shard_path(checkpoint_path(s_.options->checkpoint_dir, step), rank_),
             shard_tensors(versions));
  load_tied_copy(step, versions);
}

// The last stage's shard may hold stale copies of the tied tensor (versions whose weights had not
// arrived when it was written); stage 0's shard of the same replica holds every version fully.
void Worker::load_tied_copy(int step, const std::vector<int>& versions) {
  const planner::Plan& p = s_.plan();
  Chunk& c = chunks_.back();
  if (p.d == 1 || stage_ != p.d - 1 || c.tied_offset < 0) return;
  const std::unique_ptr<StageCompute> first = make_cpu_stage(chunk_spec(*s_.model, p, 0, 0));
  std::int64_t offset = -1;
  for (const auto& slot : first->layout())
    if (slot.name == "wte") offset = slot.offset;
  const std::string shard =
      shard_path(checkpoint_path(s_.options->checkpoint_dir, step), p.rank_of(0, replica_));
  for (int version : versions)
    read_shard_slice(shard, fmt::format("c0.w{}", version), offset,
                     c.slots[slots_.slot_of(version)].data() + c.tied_offset, c.tied_size);
}

void Worker::run() {
  const auto& ops = s_.programs->devices[std::size_t(rank_)].ops;
  for (op_ = 0; op_ < int(ops.size()); ++op_) {
    if (s_.before_op) s_.before_op(rank_, op_);
    step(ops[std::size_t(op_)]);
  }
}

void Worker::record(int stream, Clock::time_point a, Clock::time_point b) {
  ops_.push_back({stream, std::chrono::duration<double>(a - s_.start).count(),
                  std::chrono::duration<double>(b - s_.start).count(), op_});
}

void Worker::step(const Op& op) {
  const Key key{op.step, op.microbatch, op.chunk};
  switch (op.kind) {
    case OpKind::forward:
      return forward(op);
    case OpKind::recompute:
      return recompute(op);
    case OpKind::backward:
      return backward(op);
    case OpKind::send_activation:
      record(planner::kSendStream, Clock::now(), Clock::now());
      s_.transport->send(
          rank_, op.peer, Channel::activation,
          std::vector<float>(outputs_[key].data(), outputs_[key].data() + outputs_[key].size()));
      outputs_.erase(key);
      return;
    case OpKind::send_gradient:
      record(planner::kSendStream, Clock::now(), Clock::now());
      s_.transport->send(
          rank_, op.peer, Channel::gradient,
          std::vector<float>(d_inputs_[key].data(), d_inputs_[key].data() + d_inputs_[key].size()));
      d_inputs_.erase(key);
      return;
    case OpKind::recv_activation: {
      const auto t0 = Clock::now();
      inputs_[key] = to_buffer(s_.transport->recv(op.peer, rank_, Channel::activation));
      record(planner::kRecvStream, t0, Clock::now());
      return;
    }
    case OpKind::recv_gradient: {
      const auto t0 = Clock::now();
      d_outputs_[key] = to_buffer(s_.transport->recv(op.peer, rank_, Channel::gradient));
      record(planner::kRecvStream, t0, Clock::now());
      return;
    }
    case OpKind::all_reduce:
      return all_reduce(op);
    case OpKind::free_version:
      slots_.free_version(op.version);
      return;
    case OpKind::optimizer_step:
      return optimizer_step(op);
    case OpKind::send_tied_gradient:
    case OpKind::recv_tied_gradient:
    case OpKind::send_tied_weights:
    case OpKind::recv_tied_weights:
    case OpKind::gather_tied_gradient:
    case OpKind::gather_tied_weights:
      return tied(op);
    case OpKind::copy_gradient_to_host:  // prepare_run refuses offload plans before any runs
    case OpKind::host_optimizer_step:
    case OpKind::copy_parameters_to_device:
      throw InputError("train does not support --offload yet");
  }
}

Buffer Worker::to_buffer(std::vector<float> data) {
  return Buffer(memory_, Category::activations, std::move(data));
}

const float* Worker::params(const Chunk& c, int version) const {
  return c.slots[slots_.slot_of(version)].data();
}

void Worker::forward(const Op& op) {
  const Key key{op.step, op.microbatch, op.chunk};
  Chunk& c = chunks_[std::size_t(op.chunk)];
  const bool rc = s_.plan().recomputes(stage_);
  std::vector<std::int32_t> tokens, targets;
  if (c.first || c.last) samples(op, tokens, targets);
  // The stage overwrites all of these (pooled storage holds a previous microbatch's values).
  Buffer stash(memory_, Category::activations, rc ? c.sizes.stash_recompute : c.sizes.stash,
               &pool_);
  Buffer out(memory_, Category::activations, c.sizes.output, &pool_);
  // With recompute the layers run through a scratch as large as one layer's stash, freed at once.
  Buffer scratch(memory_, Category::activations, rc ? c.sizes.scratch : 0, &pool_);
  const auto t0 = Clock::now();
  const float loss = c.stage->forward(
      params(c, op.version), c.first ? tokens.data() : nullptr,
      c.first ? nullptr : inputs_.at(key).data(), c.last ? targets.data() : nullptr, s_.plan().b,
      rc, stash.data(), c.last ? nullptr : out.data(), rc ? scratch.data() : nullptr);
  const auto t1 = Clock::now();
  busy_s_ += std::chrono::duration<double>(t1 - t0).count();
  record(planner::kComputeStream, t0, t1);
  if (c.last) s_.add_loss(op.step, loss);
  inputs_.erase(key);
  stash_[key] = std::move(stash);
  if (!c.last) outputs_[key] = std::move(out);
}

void Worker::recompute(const Op& op) {
  const Key key{op.step, op.microbatch, op.chunk};
  Chunk& c = chunks_[std::size_t(op.chunk)];
  std::vector<std::int32_t> tokens, targets;
  if (c.first || c.last) samples(op, tokens, targets);
  Buffer full(memory_, Category::activations, c.sizes.stash, &pool_);
  const auto t0 = Clock::now();
  c.stage->recompute(params(c, op.version), c.first ? tokens.data() : nullptr,
                     c.last ? targets.data() : nullptr, s_.plan().b, stash_.at(key).data(),
                     full.data());
  const auto t1 = Clock::now();
  busy_s_ += std::chrono::duration<double>(t1 - t0).count();
  record(planner::kComputeStream, t0, t1);
  full_[key] = std::move(full);
}

void Worker::backward(const Op& op) {
  const Key key{op.step, op.microbatch, op.chunk};
  Chunk& c = chunks_[std::size_t(op.chunk)];
  const planner::Plan& p = s_.plan();
  const bool rc = p.recomputes(stage_);
  const float* full = rc ? full_.at(key).data() : stash_.at(key).data();
  Buffer d_input(memory_, Category::activations, c.first ? 0 : c.sizes.input, &pool_);
  // Gradients of the mean loss over the global batch: 1 / (B T) per token.
  const float scale = 1.0f / float(double(p.global_batch()) * double(s_.model->seq_len));
  const auto t0 = Clock::now();
  c.stage->backward(params(c, op.version), full, c.last ? nullptr : d_outputs_.at(key).data(), p.b,
                    scale, c.grads.data(), c.first ? nullptr : d_input.data(), workspace_.data());
  const auto t1 = Clock::now();
  busy_s_ += std::chrono::duration<double>(t1 - t0).count();
  record(planner::kComputeStream, t0, t1);
  stash_.erase(key);
  full_.erase(key);
  d_outputs_.erase(key);
  if (!c.first) d_inputs_[key] = std::move(d_input);
}

void Worker::all_reduce(const Op& op) {
  const planner::Plan& p = s_.plan();
  Chunk& c = chunks_[std::size_t(op.chunk)];
  const int buckets = s_.programs->buckets;
  const std::int64_t n = c.grads.size(), per = (n + buckets - 1) / buckets;
  const std::int64_t begin = std::min(n, per * op.bucket), end = std::min(n, begin + per);
  std::vector<int> group;
  for (int r = 0; r < p.w; ++r)
    group.push_back(p.rank_of(stage_, r));
  s_.transport->all_reduce_sum(fmt::format("ar/{}/{}/{}/{}", stage_, op.step, op.chunk, op.bucket),
                               group, rank_, c.grads.data() + begin, end - begin);
}

// The token embedding (stage 0) and the LM head's copy (last stage) are one parameter. Stage 0
// owns its update: it adds the head's gradient to its own (embedding + head, the order of the
// sum on one device) and sends the new weights back; the last stage's optimizer skips the copy.
// With w > 1 the head's gradient is the same on every replica after the all-reduce, so replica r
// sends only its shard (tied_shard) and the receiving stage's replicas gather the shards: a sum
// over the group of buffers that hold zeros outside each member's shard. x + 0 = x for every
// float x but -0, so the result is what the whole tensor's message carried (an element equal to
// -0 arrives as +0, an equal value).
void Worker::tied(const Op& op) {
  Chunk& c = chunks_[std::size_t(op.chunk)];
  if (c.tied_offset < 0)
    throw Error(fmt::format("rank {}: {} on chunk {}, which holds no tied tensor", rank_,
                            planner::to_string(op.kind), op.chunk));
  const planner::Plan& p = s_.plan();
  const std::int64_t n = c.tied_size;
  const planner::TiedShard sh = planner::tied_shard(n, p.w, replica_);
  float* grad = c.grads.data() + c.tied_offset;
  std::vector<int> group;
  for (int r = 0; r < p.w; ++r)
    group.push_back(p.rank_of(stage_, r));
  const auto t0 = Clock::now();
  switch (op.kind) {
    case OpKind::send_tied_gradient:
      record(planner::kSendStream, t0, t0);
      s_.transport->send(rank_, op.peer, Channel::tied,
                         std::vector<float>(grad + sh.begin, grad + sh.end));
      std::fill(grad, grad + n, 0.0f);  // the next step accumulates from zero
      return;
    case OpKind::recv_tied_gradient: {
      const std::vector<float> head = s_.transport->recv(op.peer, rank_, Channel::tied);
      if (p.w > 1) {
        tied_head_.assign(std::size_t(n), 0.0f);
        std::copy(head.begin(), head.end(), tied_head_.begin() + sh.begin);
      } else {
        for (std::int64_t i = 0; i < n; ++i)
          grad[i] = grad[i] + head[std::size_t(i)];
      }
      record(planner::kRecvStream, t0, Clock::now());
      return;
    }
    case OpKind::gather_tied_gradient:
      s_.transport->all_reduce_sum(fmt::format("tg/{}/{}", stage_, op.step), group, rank_,
                                   tied_head_.data(), n);
      for (std::int64_t i = 0; i < n; ++i)
        grad[i] = grad[i] + tied_head_[std::size_t(i)];
      tied_head_ = {};
      record(planner::kCollectiveStream, t0, Clock::now());
      return;
    case OpKind::send_tied_weights: {
      const float* w = params(c, op.version) + c.tied_offset;
      record(planner::kSendStream, t0, t0);
      s_.transport->send(rank_, op.peer, Channel::tied_weights,
                         std::vector<float>(w + sh.begin, w + sh.end));
      return;
    }
    case OpKind::recv_tied_weights: {
      const std::vector<float> w = s_.transport->recv(op.peer, rank_, Channel::tied_weights);
      float* out = c.slots[slots_.slot_of(op.version)].data() + c.tied_offset;
      if (p.w > 1) std::fill(out, out + n, 0.0f);
      std::copy(w.begin(), w.end(), out + sh.begin);
      record(planner::kRecvStream, t0, Clock::now());
      return;
    }
    default: {  // gather_tied_weights
      float* out = c.slots[slots_.slot_of(op.version)].data() + c.tied_offset;
      s_.transport->all_reduce_sum(fmt::format("tw/{}/{}", stage_, op.version), group, rank_, out,
                                   n);
      record(planner::kCollectiveStream, t0, Clock::now());
      return;
    }
  }
}

// One device holding both tied ends (d == 1, v > 1): the same sum, on both chunks, no messages.
void Worker::sum_local_tied() {
  Chunk* embedding = nullptr;
  Chunk* head = nullptr;
  for (Chunk& c : chunks_) {
    if (c.tied_offset < 0) continue;
    (c.first ? embedding : head) = &c;
  }
  if (!embedding || !head) return;
  float* e = embedding->grads.data() + embedding->tied_offset;
  float* h = head->grads.data() + head->tied_offset;
  for (std::int64_t i = 0; i < embedding->tied_size; ++i)
    e[i] = h[i] = e[i] + h[i];
}

void Worker::optimizer_step(const Op& op) {
  if (s_.plan().d == 1) sum_local_tied();
  ++updates_;
  bool allocate = false;
  const int target = slots_.target_for(op.version, allocate);
  if (allocate)
    for (Chunk& c : chunks_)
      c.slots[target] = Buffer(memory_, Category::weight_versions, c.sizes.parameters);
  const auto t0 = Clock::now();
  for (Chunk& c : chunks_)
    update(c, slots_.newest(), target);
  const auto t1 = Clock::now();
  busy_s_ += std::chrono::duration<double>(t1 - t0).count();
  record(planner::kComputeStream, t0, t1);
  slots_.place(op.version, target);
  if (s_.checkpoint_after(op.step)) save_checkpoint(op.step);
  s_.finish_step(op.step);
}

// The last stage's copy of the tied tensor (d > 1) is not updated here: stage 0 sends it
// (recv_tied_weights). Its optimizer state stays allocated, unused; its gradient is zero already.
void Worker::update(Chunk& c, int source, int target) {
  for (const auto& [begin, end] :
       updated_ranges(c.first, c.last, c.tied_offset, c.tied_size, s_.plan().d, c.grads.size())) {
    float* v = c.v.empty() ? nullptr : c.v.data() + begin;
    optimizer_update(*s_.options, updates_, c.slots[source].data() + begin,
                     c.slots[target].data() + begin, c.grads.data() + begin, c.m.data() + begin, v,
                     end - begin);
  }
}

RankResult Worker::result() const {
  RankResult r;
  r.rank = rank_;
  r.peak_memory_bytes = memory_->peak();
  r.memory = memory_->at_peak();
  r.busy_s = busy_s_;
  for (const Chunk& c : chunks_)
    r.weights.emplace_back(c.slots[slots_.newest()].data(),
                           c.slots[slots_.newest()].data() + c.slots[slots_.newest()].size());
  for (const auto& slot : chunks_.front().stage->layout())
    r.slot_names.push_back(slot.name);
  r.timeline.rank = rank_;
  r.timeline.label =
      fmt::format("rank {} ({}, stage {}, replica {})", rank_, s_.runs_on, stage_, replica_);
  r.timeline.ops = ops_;
  for (const auto& [t, bytes] : memory_->samples())
    r.timeline.memory.emplace_back(
        std::max(0.0, std::chrono::duration<double>(t - s_.start).count()), bytes);
  return r;
}

}  // namespace pw::exec::detail
