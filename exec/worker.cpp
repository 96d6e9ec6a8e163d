// One rank's worker: interprets its program op by op with real compute (see runtime.hpp).
#include "exec/worker.hpp"

#include "exec/optimizer.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

#include <fmt/format.h>

namespace pw::exec::detail {

using planner::Op;
using planner::OpKind;

Worker::Worker(Shared& s, int device)
    : s_(s),
      device_(device),
      rank_(device / s.plan().t),
      tp_(device % s.plan().t),
      stage_(s.plan().stage_of(rank_)),
      replica_(s.plan().replica_of(rank_)),
      t_(s.plan().t),
      memory_(&s.devices[std::size_t(device)]) {
  if (!s.core_queues.empty()) core_ = s.core_queues[std::size_t(device)].get();
  const planner::Plan& p = s.plan();
  std::int64_t workspace = 0;
  slots_.set_rank(device);
  // The TP group: the t devices of this pipeline rank, summing in group order under keys that
  // count the group's collectives (its members run the same program, so the same sequence).
  const std::vector<int> tp_group = detail::tp_group(rank_, t_);
  sharded_ = p.distributed_optimizer && p.w > 1;
  offload_optimizer_ = p.offload == planner::Offload::optimizer;
  offload_sharded_ = p.offload_sharded();
  swaps_ = p.swaps(stage_);
  chunked_ = p.offload == planner::Offload::chunks;
  blocks_ = p.recompute_of(stage_) == planner::Recompute::block;
  // Offload chunks: the weights and Adam state are staged here uncounted (initialised or read from
  // the checkpoint), then go into the chunks (setup_chunks).
  MemoryCounter* counted = chunked_ ? nullptr : memory_;
  std::int64_t flat = 0;  // the rank's parameters so far
  for (int c = 0; c < p.v; ++c) {
    const StageSpec spec = shard_spec(*s.model, p, stage_, c, tp_);
    Chunk ch;
    ch.stage = make_cpu_stage(spec);
    if (t_ > 1) {
      TpComm comm;
      // Keys count the group's collectives: its members run the same program, so the same
      // sequence. The waits inside compute ops are not busy time.
      const auto timed = [this](auto&& call) {
        const auto t0 = Clock::now();
        call(fmt::format("tp/{}/{}", rank_, tp_calls_++));
        tp_wait_s_ += std::chrono::duration<double>(Clock::now() - t0).count();
      };
      const auto parts = [this](std::int64_t n) { return equal_parts(n, t_); };
      comm.all_reduce = [this, tp_group, timed](float* data, std::int64_t n) {
        timed([&](const std::string& key) {
          s_.transport->all_reduce_sum(key, tp_group, device_, data, n);
        });
      };
      comm.all_gather = [this, tp_group, timed, parts](float* data, std::int64_t n) {
        timed([&](const std::string& key) {
          s_.transport->all_gather(key, tp_group, device_, data, parts(n));
        });
      };
      comm.reduce_scatter = [this, tp_group, timed, parts](float* data, std::int64_t n) {
        timed([&](const std::string& key) {
          s_.transport->reduce_scatter_sum(key, tp_group, device_, data, parts(n));
        });
      };
      tp_comms_.push_back(comm);
    }
    ch.sizes = ch.stage->sizes(p.b);
    ch.first = spec.has_embedding;
    ch.last = spec.has_head;
    if (p.mixed_activations(stage_)) {
      // This chunk's blocks in the stage's list of choices (the chunks before it first).
      const std::vector<planner::ActivationChoice> all = planner::layer_choices(p, stage_);
      std::size_t at = 0;
      for (int k = 0; k < c; ++k)
        at += std::size_t(p.stage_blocks[std::size_t(k * p.d + stage_)]);
      for (std::int64_t k = 0; k < spec.blocks; ++k)
        ch.recomputed.push_back(all.at(at + std::size_t(k)) ==
                                planner::ActivationChoice::recompute);
      // A chunk whose blocks all swap runs as a swapping stage's (its recompute op: nothing).
      ch.mixed = std::find(ch.recomputed.begin(), ch.recomputed.end(), true) != ch.recomputed.end();
      if (ch.mixed) ch.mixed_sizes = ch.stage->mixed_sizes(p.b, ch.recomputed);
    }
    const std::int64_t n = ch.sizes.parameters;
    ch.slots[0] = Buffer(counted, Category::weights, n);
    ch.stage->init_parameters(ch.slots[0].data(), s.options->seed);
    // Optimizer offload: gradients leave the device layer by layer (sharded, w > 1: summed on the
    // device for the reduce-scatter, as without offload) and the optimizer state lives on the
    // host (setup_offload); offload chunks: in the chunks.
    if ((!offload_optimizer_ || offload_sharded_) && !chunked_)
      ch.grads = Buffer(memory_, Category::gradients, n);
    if (!sharded_ && !offload_optimizer_) {
      ch.m = Buffer(counted, Category::optimizer, n);
      if (s.options->optimizer == "adamw") ch.v = Buffer(counted, Category::optimizer, n);
    }
    if (s.model->tied_embeddings && ch.first != ch.last)
      for (const auto& slot : ch.stage->layout())
        if (slot.name == (ch.first ? "wte" : "lm_head")) {
          ch.tied_offset = slot.offset;
          ch.tied_size = slot.size;
        }
    workspace = std::max(workspace, ch.sizes.workspace);
    ch.base = flat;
    flat += n;
    chunks_.push_back(std::move(ch));
  }
  // The distributed optimizer's shard rule: the rank's parameters, its chunks' in order, split
  // into w contiguous ranges of ceil(P / w) (planner::tied_shard's rule); replica r updates range
  // r. Its state buffers hold ceil(P / w) floats on every replica (the last one's padded, as
  // Megatron pads its buffer to a multiple of w), the planner's figure.
  const planner::TiedShard own = planner::tied_shard(flat, p.w, sharded_ ? replica_ : 0);
  const std::int64_t per = sharded_ ? (flat + p.w - 1) / p.w : 0;
  if (sharded_ && !offload_optimizer_) {
    shard_m_ = Buffer(memory_, Category::optimizer, per);
    if (s.options->optimizer == "adamw") shard_v_ = Buffer(memory_, Category::optimizer, per);
  }
  for (Chunk& ch : chunks_) {
    if (offload_optimizer_) break;  // setup_offload points the state at the host
    const std::int64_t n = ch.sizes.parameters;
    ch.own_begin = sharded_ ? std::clamp(own.begin - ch.base, std::int64_t(0), n) : 0;
    ch.own_end = sharded_ ? std::clamp(own.end - ch.base, std::int64_t(0), n) : n;
    if (ch.own_end < ch.own_begin) ch.own_end = ch.own_begin;
    Buffer& m = sharded_ ? shard_m_ : ch.m;
    Buffer& v = sharded_ ? shard_v_ : ch.v;
    // A chunk wholly before or after the shard owns nothing: its (empty) state at either end.
    const std::int64_t at =
        sharded_ ? std::clamp(ch.base + ch.own_begin - own.begin, std::int64_t(0), per) : 0;
    ch.m_at = m.data() + at;
    ch.v_at = v.empty() ? nullptr : v.data() + at;
  }
  workspace_ = Buffer(memory_, Category::workspace, workspace);
  // Forward and recompute gather (SP) into the workspace, and a selective forward makes its
  // attention probabilities there: free while they run.
  if (tp_comms_.empty() && p.recompute_of(stage_) == planner::Recompute::selective)
    tp_comms_.resize(chunks_.size());  // t = 1: the scratch only
  for (std::size_t c = 0; c < tp_comms_.size(); ++c) {
    tp_comms_[c].scratch = workspace_.data();
    tp_comms_[c].scratch_floats = workspace_.size();
    chunks_[c].stage->set_tp(tp_comms_[c]);
  }
  setup_offload();
  reduced_.resize(chunks_.size());
  tied_sent_.resize(chunks_.size());
  // A rank taking turns on a shared core sends inline, inside its turn: with more busy threads
  // than cores an engine thread would only wait for a core (docs/performance.md, "Ranks sharing a
  // core take turns on it").
  if (s.transport->concurrent() && s.options->async_comm && !core_) {
    send_engine_ = std::make_unique<CopyEngine>();
    collective_engine_ = std::make_unique<CopyEngine>();
  }
  if (s.first_step > 0) load_checkpoint(s.first_step);
  if (chunked_) setup_chunks();
  // The host's master copy starts as the device's newest version (the checkpoint's, resumed).
  for (std::size_t i = 0; i < host_chunks_.size(); ++i) {
    HostChunk& h = host_chunks_[i];
    const float* weights = chunks_[i].slots[slots_.newest()].data();
    for (std::size_t k = 0; k < h.tiles.size(); ++k)
      std::copy(weights + h.tiles[k].begin, weights + h.tiles[k].end,
                h.master.data() + h.host_at[k]);
  }
}

// Offload's state (see worker.hpp) and the copy engines: one per direction on a stage that swaps
// or offloads the optimizer, and the host CPU's for CPU Adam.
void Worker::setup_offload() {
  const planner::Plan& p = s_.plan();
  if (!offload_optimizer_ && !swaps_) return;
  d2h_ = std::make_unique<CopyEngine>();
  h2d_ = std::make_unique<CopyEngine>();
  // A growth past --device-memory first takes back the buffers of the stashes on their way out.
  if (swaps_) memory_->set_reclaim([this] { return swapped_.reclaim(); });
  if (!offload_optimizer_) return;
  host_cpu_ = std::make_unique<CopyEngine>();
  std::int64_t largest = 0;
  std::vector<int> tiles;  // per chunk: its CPU Adam tiles
  for (std::size_t i = 0; i < chunks_.size(); ++i) {
    Chunk& c = chunks_[i];
    HostChunk h;
    HostLayout host = host_layout(
        host_tiles(c.stage->layout(), c.sizes.parameters, c.last, c.tied_offset, c.tied_size,
                   planner::offload_tiles(p, stage_, int(i)), rank_, int(i)),
        offload_sharded_, p.w, replica_);  // sharded: ZeRO-Offload's shards, packed
    h.n = host.n;
    h.tiles = std::move(host.tiles);
    h.host_at = std::move(host.host_at);
    h.layers = std::move(host.layers);
    if (!offload_sharded_)
      for (const Tile& t : h.tiles)
        largest = std::max(largest, t.end - t.begin);
    h.master = Buffer(&host_, Category::weights, h.n);
    h.accumulator = Buffer(&host_, Category::gradients, h.n);
    h.m = Buffer(&host_, Category::optimizer, h.n);
    if (s_.options->optimizer == "adamw") h.v = Buffer(&host_, Category::optimizer, h.n);
    if (c.tied_offset >= 0 && !offload_sharded_)
      h.resident = Buffer(memory_, Category::gradients, c.tied_size);
    c.own_begin = 0;
    c.own_end = h.n;
    c.m_at = h.m.data();
    c.v_at = h.v.empty() ? nullptr : h.v.data();
    tiles.push_back(int(h.tiles.size()));
    host_chunks_.push_back(std::move(h));
  }
  optimizer_.setup(rank_, p, offload_sharded_, tiles);
  // Double-buffered: one layer's gradients fill while the previous one's are on the copy engine
  // (sharded: none, the backward keeps its gradients).
  if (!offload_sharded_)
    for (Buffer& b : grad_tiles_)
      b = Buffer(memory_, Category::gradients, largest);
}

// A swapped stash's device part (exec/offload.hpp, Swaps, has the rule of when each runs): the
// download on the device-to-host engine, the upload on the host-to-device engine after it.
void Worker::swap_out(Swap& sw, const Key& key, int op) {
  const auto it = stash_.find(key);
  if (it == stash_.end())
    throw Error(
        fmt::format("rank {}: copy_activation_to_host of a stash the forward did not keep", rank_));
  sw.device = std::move(it->second);
  stash_.erase(it);
  sw.floats = sw.device.size();
  sw.host = Buffer(&host_, Category::activations, sw.floats, &host_buffers_);
  const float* src = sw.device.data();
  float* dst = sw.host.data();
  const std::int64_t n = sw.floats;
  Worker* w = this;
  sw.down = d2h_->submit([w, src, dst, n, op] {
    const auto t0 = Clock::now();
    std::copy_n(src, n, dst);
    const std::int64_t bytes = n * std::int64_t(sizeof(float));
    w->bytes_out_ += bytes;
    w->activation_bytes_out_ += bytes;
    w->copy_record(planner::kCopyOutStream, t0, Clock::now(), op);
  });
}

void Worker::swap_done(Swap& sw) {
  d2h_->wait(sw.down);
  sw.device = Buffer();
}

// The host buffer goes on the engine once the upload has read it.
void Worker::swap_in(const std::shared_ptr<Swap>& sw, int op) {
  sw->device = Buffer(memory_, Category::activations, sw->floats, &pool_);
  Worker* w = this;
  const CopyEngine::Ticket down = sw->down;
  sw->up = h2d_->submit([w, s = sw, down, op] {
    w->d2h_->wait(down);
    const auto t0 = Clock::now();
    std::copy_n(s->host.data(), s->floats, s->device.data());
    const std::int64_t bytes = s->floats * std::int64_t(sizeof(float));
    w->bytes_in_ += bytes;
    w->activation_bytes_in_ += bytes;
    s->host = Buffer();
    w->copy_record(planner::kCopyInStream, t0, Clock::now(), op);
  });
}

void Worker::swap_back(Swap& sw, const Key& key) {
  h2d_->wait(sw.up);
  stash_[key] = std::move(sw.device);
}

float* Worker::tied_grad(Chunk& c) {
  if (!offload_optimizer_ || offload_sharded_) return c.grads.data() + c.tied_offset;
  return host_chunks_[std::size_t(&c - chunks_.data())].resident.data();
}

void Worker::copy_record(int stream, Clock::time_point a, Clock::time_point b, int op) {
  std::lock_guard<std::mutex> lock(copy_ops_mutex_);
  copy_ops_.push_back({stream, std::chrono::duration<double>(a - s_.start).count(),
                       std::chrono::duration<double>(b - s_.start).count(), op});
}

// Optimizer offload's gradient sink for one backward: where each gradient goes and when a layer's
// tile goes to the host are the shared rule's (exec/optimizer_offload.hpp); the device's part
// below (zero_tile .. upload_tile). Each gradient element is added to once per backward
// (exec/cpu/kernels.hpp), so the host's accumulator gets the bits the device's own accumulation
// would have.
class Worker::TileSink : public GradientSink {
 public:
  TileSink(Worker& w, std::size_t chunk, int op)
      : w_(w),
        b_(chunk, op, w.host_chunks_[chunk].tiles, w.chunks_[chunk].tied_offset,
           w.chunks_[chunk].tied_size, w.tied_grad(w.chunks_[chunk])) {}
  float* at(std::int64_t offset, std::int64_t size) override {
    return w_.optimizer_.gradient_at(b_, offset, size);
  }
  void layer_done(std::int64_t, std::int64_t) override { w_.optimizer_.layer_done(b_); }

 private:
  Worker& w_;
  StreamedBackward<float> b_;
};

// Optimizer offload's device calls (exec/optimizer_offload.hpp). A mark is an engine's ticket; the
// compute runs on the rank's thread, so its mark is none and its waits are the thread's.
Worker::Event Worker::mark(Engine e) const {
  CopyEngine* engine = engine_of(e);
  return engine ? Event{engine, engine->last()} : Event{};
}

void Worker::after(Engine e, Event m) {
  if (!m.engine) return;
  if (e == Engine::compute) return m.wait();
  offload_waits_[std::size_t(e)].push_back(m);
}

CopyEngine* Worker::engine_of(Engine e) const {
  switch (e) {
    case Engine::d2h:
      return d2h_.get();
    case Engine::h2d:
      return h2d_.get();
    case Engine::host:
      return host_cpu_.get();
    case Engine::compute:
      break;
  }
  return nullptr;
}

// `work` on engine `e`, after the marks `after` gave it.
void Worker::issue_after(Engine e, std::function<void()> work) {
  std::vector<Event> waits = std::move(offload_waits_[std::size_t(e)]);
  offload_waits_[std::size_t(e)].clear();
  engine_of(e)->submit([waits = std::move(waits), work = std::move(work)] {
    for (const Event& m : waits)
      m.wait();
    work();
  });
}

float* Worker::zero_tile(int buffer, std::int64_t n) {
  float* data = grad_tiles_[buffer].data();
  std::fill_n(data, n, 0.0f);
  return data;
}

void Worker::stream_tile(std::size_t chunk, int buffer, Tile t, const std::vector<Tile>& ranges,
                         int op) {
  const float* src = grad_tiles_[buffer].data();
  float* acc = host_chunks_[chunk].accumulator.data();
  Worker* w = this;
  issue_after(Engine::d2h, [w, ranges, t, src, acc, op] {
    const auto t0 = Clock::now();
    std::int64_t bytes = 0;
    for (const Tile& r : ranges) {
      for (std::int64_t i = r.begin; i < r.end; ++i)
        acc[i] = acc[i] + src[i - t.begin];
      bytes += (r.end - r.begin) * std::int64_t(sizeof(float));
    }
    w->bytes_out_ += bytes;
    w->copy_record(planner::kCopyOutStream, t0, Clock::now(), op);
  });
}

bool Worker::keeps_tied_gradient(std::size_t chunk) const {
  return chunks_[chunk].tied_offset >= 0 && !host_chunks_[chunk].resident.empty();
}

void Worker::download_tied_gradient(std::size_t chunk, int op) {
  const Chunk& c = chunks_[chunk];
  float* dst = host_chunks_[chunk].accumulator.data() + c.tied_offset;
  float* src = host_chunks_[chunk].resident.data();
  const std::int64_t n = c.tied_size;
  Worker* w = this;
  issue_after(Engine::d2h, [w, dst, src, n, op] {
    const auto t0 = Clock::now();
    std::copy_n(src, n, dst);
    std::fill_n(src, n, 0.0f);  // the next step accumulates from zero
    w->bytes_out_ += n * std::int64_t(sizeof(float));
    w->copy_record(planner::kCopyOutStream, t0, Clock::now(), op);
  });
}

// Sharded: the replica's shard of each tile, reduce-scattered (and on stage 0 the tied head's
// gradient added) on the device; the device's gradients are zeroed for the next step (the other
// shards hold this replica's unreduced sums).
void Worker::download_gradient_shards(std::size_t chunk, int op) {
  HostChunk* h = &host_chunks_[chunk];
  float* grads = chunks_[chunk].grads.data();
  const std::int64_t n = chunks_[chunk].grads.size();
  Worker* w = this;
  issue_after(Engine::d2h, [w, h, grads, n, op] {
    const auto t0 = Clock::now();
    for (std::size_t k = 0; k < h->tiles.size(); ++k)
      std::copy(grads + h->tiles[k].begin, grads + h->tiles[k].end,
                h->accumulator.data() + h->host_at[k]);
    std::fill_n(grads, n, 0.0f);
    w->bytes_out_ += h->n * std::int64_t(sizeof(float));
    w->copy_record(planner::kCopyOutStream, t0, Clock::now(), op);
  });
}

void Worker::host_adam(std::size_t chunk, int tile, int update, int op) {
  HostChunk* h = &host_chunks_[chunk];
  const std::int64_t n = h->tiles[std::size_t(tile)].size();
  const std::int64_t i = h->host_at[std::size_t(tile)];  // its parameters on the host
  Worker* w = this;
  issue_after(Engine::host, [w, h, i, n, update, op] {
    const auto t0 = Clock::now();
    float* master = h->master.data() + i;
    optimizer_update(*w->s_.options, update, master, master, h->accumulator.data() + i,
                     h->m.data() + i, h->v.empty() ? nullptr : h->v.data() + i, n);
    w->copy_record(planner::kHostStream, t0, Clock::now(), op);
  });
}

void Worker::upload_tile(std::size_t chunk, int tile, int slot, int op) {
  const HostChunk& h = host_chunks_[chunk];
  const Tile t = h.tiles[std::size_t(tile)];
  const float* src = h.master.data() + h.host_at[std::size_t(tile)];
  float* dst = chunks_[chunk].slots[slot].data() + t.begin;
  Worker* w = this;
  issue_after(Engine::h2d, [w, src, dst, t, op] {
    const auto t0 = Clock::now();
    std::copy_n(src, t.end - t.begin, dst);
    w->bytes_in_ += (t.end - t.begin) * std::int64_t(sizeof(float));
    w->copy_record(planner::kCopyInStream, t0, Clock::now(), op);
  });
}

// The copies and the host's CPU Adam (docs/formats.md, program ops): issued in program order on
// their engines; the dependencies are waits inside the work (an upload after its download or its
// tile's Adam, Adam after the step's gradient copies) and waits of the compute (a backward for its
// stash's upload, the optimizer step for the last parameter upload). The activations' by Swaps,
// the optimizer's by OptimizerOffload (exec/offload.hpp, exec/optimizer_offload.hpp).
void Worker::offload_op(const Op& op) {
  const Key key{op.step, op.microbatch, op.chunk};
  const int at = op_;
  switch (op.kind) {
    case OpKind::copy_activation_to_host:
      // The forward was compute op compute_ops_ - 1; its device buffer goes at Swaps' rule.
      swapped_.to_host(key, compute_ops_ - 1, at);
      return;
    case OpKind::copy_activation_to_device:
      release_sends(compute_ops_);  // this op begins compute slot compute_ops_
      swapped_.to_device(key, compute_ops_, at, rank_);
      return;
    case OpKind::copy_gradient_to_host:
    case OpKind::host_optimizer_step:
    case OpKind::copy_parameters_to_device:
      if (!offload_optimizer_) break;
      return optimizer_.run(op, at);  // exec/optimizer_offload.hpp
    default:
      break;
  }
  throw Error(fmt::format("rank {}: {} is not an offload op of this program", rank_,
                          planner::to_string(op.kind)));
}

// The device's optimizer step under optimizer offload: the uploads have written the new version
// (CPU Adam ran on the host); it only switches to it.
void Worker::offload_step(const Op& op) {
  const int slot = optimizer_.finish(op.version);
  ++updates_;
  // Sharded: the replicas' uploaded shards to one another, into the new version's slot.
  if (offload_sharded_) all_gather(op.step, slot);
  s_.end_step(op.step, [this](int done) { save_checkpoint(done); });
}

// The rank's shard (exec::ShardLayout, both workers' rule): per chunk every weight version held,
// then the optimizer's state (momentum; AdamW's second moment) of the parameters the rank updates
// (with the distributed optimizer its shard of the chunk, [own_begin, own_end); with offload
// chunks every parameter: gathered from the chunks, which each replica keeps its part of).
ShardLayout Worker::shard_layout(const std::vector<int>& versions, bool whole) const {
  std::vector<std::int64_t> parameters, state;
  for (const Chunk& c : chunks_) {
    parameters.push_back(c.sizes.parameters);
    state.push_back(whole ? c.sizes.parameters : c.own_end - c.own_begin);
  }
  std::vector<std::string> names = {"m"};
  if (s_.options->optimizer == "adamw") names.push_back("v");
  return ShardLayout(parameters, versions, names, state);
}

// The shard over the rank's own buffers: each version's slot, the state where m_at, v_at point.
ShardLayout Worker::shard_tensors(const std::vector<int>& versions) {
  ShardLayout shard = shard_layout(versions, false);
  for (std::size_t i = 0; i < chunks_.size(); ++i) {
    Chunk& c = chunks_[i];
    for (std::size_t j = 0; j < versions.size(); ++j)
      shard.weights(i, j).data = c.slots[slots_.slot_of(versions[j])].data();
    shard.state(i, 0).data = c.m_at;
    if (shard.states() > 1) shard.state(i, 1).data = c.v_at;
  }
  return shard;
}

// After `step` + 1 updates this rank holds what the next steps use: the newest version and, for
// 2BW, the shadow one (initial_versions of a run resumed there). Gradients are zero here.
void Worker::save_checkpoint(int step) {
  const int updates = step + 1;
  const std::vector<int> versions = planner::initial_versions(s_.plan(), updates);
  common::Json header = {{"format", "pipewright.checkpoint-shard/2"},
                         {"rank", device_},
                         {"stage", stage_},
                         {"replica", replica_},
                         {"tp", tp_},
                         {"step", updates},
                         {"versions", versions}};
  // Offload chunks: the same tensors as without (each model chunk's flat weights, m and v),
  // gathered.
  std::vector<Flats> gathered;  // the versions', then m, v
  ShardLayout shard = chunked_ ? shard_layout(versions, true) : shard_tensors(versions);
  if (chunked_) {
    for (int version : versions)  // 2bw: both live versions, each from its part
      gathered.push_back(gather_chunks(0, version));
    for (int which = 1; which < 3; ++which)
      gathered.push_back(gather_chunks(which));
    for (std::size_t c = 0; c < chunks_.size(); ++c) {
      for (std::size_t i = 0; i < versions.size(); ++i)
        shard.weights(c, i).data = gathered[i][c].data();
      for (std::size_t which = 0; which < shard.states(); ++which)
        shard.state(c, which).data = gathered[versions.size() + which][c].data();
    }
  }
  // The last stage's copy of the tied tensor: zeros (ShardLayout::zero_tied_copy), on copies of
  // the rank's live weights.
  std::vector<std::vector<float>> copies;
  const Chunk& last = chunks_.back();
  if (zeroed_tied_copy(s_.plan(), last.last, last.tied_offset))  // run_common.hpp
    shard.zero_tied_copy(chunks_.size() - 1, last.tied_offset, last.tied_size, &copies);
  write_shard(shard_path(checkpoint_path(s_.options->checkpoint_dir, updates), device_), header,
              shard.tensors());
}

void Worker::load_checkpoint(int step) {
  const std::vector<int> versions = planner::initial_versions(s_.plan(), step);
  slots_.resume(versions);
  if (versions.size() == 2)  // offload chunks: staged uncounted, then into the chunks' parts
    for (Chunk& c : chunks_)
      c.slots[1] =
          Buffer(chunked_ ? nullptr : memory_, Category::weight_versions, c.sizes.parameters);
  updates_ = step;
  ShardLayout shard = shard_tensors(versions);
  const std::string dir = checkpoint_path(s_.options->checkpoint_dir, step);
  read_shard(shard_path(dir, device_), shard.tensors());
  // The last stage's shard may hold stale copies of the tied tensor (versions whose weights had
  // not arrived when it was written); stage 0's shard of the same replica holds every version.
  const Chunk& c = chunks_.back();
  if (!zeroed_tied_copy(s_.plan(), c.last, c.tied_offset)) return;
  const TiedCopySource from = tied_copy_source(*s_.model, s_.plan(), replica_, tp_, dir);
  shard.read_tied_copy(chunks_.size() - 1, c.tied_offset, c.tied_size, from.shard, from.offset);
}

// A rank sharing its core keeps its turn from a compute op through the sends that follow it (so
// that its output leaves before a neighbour's op takes the core), and gives it up at anything else.
void Worker::take_core() {
  if (!core_ || holding_core_) return;
  core_->take();
  holding_core_ = true;
}

void Worker::release_core() {
  if (!holding_core_) return;
  holding_core_ = false;
  core_->release();
}

void Worker::run() {
  const auto& ops = s_.programs->devices[std::size_t(rank_)].ops;
  try {
    for (op_ = 0; op_ < int(ops.size()); ++op_) {
      if (s_.before_op) s_.before_op(device_, op_);
      const planner::Op& op = ops[std::size_t(op_)];
      if (op.kind != OpKind::send_activation && op.kind != OpKind::send_gradient) release_core();
      interpret(*this, op);
    }
  } catch (...) {
    release_core();
    throw;
  }
  release_core();
  // What the engines still run (nothing, in a program whose ops wait for their copies; the last
  // sends and collectives, which no op of the rank waits for).
  for (CopyEngine* e :
       {d2h_.get(), h2d_.get(), host_cpu_.get(), send_engine_.get(), collective_engine_.get()})
    if (e) e->drain();
  in_flight_.clear();
}

Worker::Event Worker::issue(CopyEngine* engine, std::function<void()> work) {
  if (!engine) {
    work();
    return {};
  }
  return {engine, engine->submit(std::move(work))};
}

void Worker::send(const Op& op, Channel channel, std::map<Key, Buffer>& from) {
  const Key key{op.step, op.microbatch, op.chunk};
  const auto it = from.find(key);
  if (it == from.end())
    throw Error(fmt::format("rank {}: {} of a tensor this rank does not hold", rank_,
                            planner::to_string(op.kind)));
  Buffer buffer = std::move(it->second);
  from.erase(it);
  const float* data = buffer.data();
  const std::int64_t n = buffer.size();
  Worker* w = this;
  const int at = op_, src = device_, dst = device_of(op.peer);
  const Event sent = issue(send_engine_.get(), [w, data, n, channel, at, src, dst] {
    const auto t0 = Clock::now();
    w->s_.transport->send(src, dst, channel, std::vector<float>(data, data + n));
    w->copy_record(planner::kSendStream, t0, Clock::now(), at);
  });
  // Inline (no engine: MPI, --no-async-comm, a rank taking turns on a shared core) the send has
  // run, but its buffer is kept to the same release point: the device peak is the same in every
  // mode, and the planner's (planner::send_buffer_bytes).
  in_flight_.push_back({compute_ops_ - 1, sent, std::move(buffer)});
}

void Worker::release_sends(int compute_op) {
  while (!in_flight_.empty() && in_flight_.front().compute_op + 2 <= compute_op) {
    in_flight_.front().sent.wait();
    in_flight_.pop_front();
  }
}

void Worker::wait_grads(std::size_t chunk) {
  reduced_[chunk].wait();
  tied_sent_[chunk].wait();
}

void Worker::record(int stream, Clock::time_point a, Clock::time_point b) {
  ops_.push_back({stream, std::chrono::duration<double>(a - s_.start).count(),
                  std::chrono::duration<double>(b - s_.start).count(), op_});
}

void Worker::send(const Op& op, Channel channel) {
  send(op, channel, channel == Channel::activation ? outputs_ : d_inputs_);
}

void Worker::recv(const Op& op, Channel channel) {
  const Key key{op.step, op.microbatch, op.chunk};
  if (swaps_) swapped_.release_due(compute_ops_);  // a compute slot begins
  release_sends(compute_ops_);
  if (chunked_) make_message_room(1);
  const auto t0 = Clock::now();
  (channel == Channel::activation ? inputs_ : d_outputs_)[key] =
      to_buffer(s_.transport->recv(device_of(op.peer), device_, channel));
  record(planner::kRecvStream, t0, Clock::now());
}

void Worker::offload(const Op& op) {
  if (!d2h_)
    throw Error(fmt::format("rank {}: {} in a program that does not offload", rank_,
                            planner::to_string(op.kind)));
  offload_op(op);
}

// Offload chunks: in one of the message buffers counted all along (setup_chunks).
Buffer Worker::to_buffer(std::vector<float> data) {
  return Buffer(chunked_ ? nullptr : memory_, Category::activations, std::move(data));
}

const float* Worker::params(const Chunk& c, int version) const {
  return c.slots[slots_.slot_of(version)].data();
}

void Worker::forward(const Op& op) {
  if (chunked_) return chunk_forward(op);
  const Key key{op.step, op.microbatch, op.chunk};
  if (swaps_) swapped_.release_due(compute_ops_);
  release_sends(compute_ops_);
  ++compute_ops_;
  Chunk& c = chunks_[std::size_t(op.chunk)];
  if (c.mixed) return forward_mixed(op, c);
  if (blocks_) return forward_blocks(op, c);
  const bool rc = s_.plan().recomputes(stage_);
  std::vector<std::int32_t> tokens, targets;
  if (c.first || c.last) samples(op, tokens, targets);
  // The stage overwrites all of these (pooled storage holds a previous microbatch's values).
  Buffer stash(memory_, Category::activations, rc ? c.sizes.stash_recompute : c.sizes.stash,
               &pool_);
  Buffer out(memory_, Category::activations, c.sizes.output, &pool_);
  // With recompute the layers run through a scratch as large as one layer's stash, freed at once.
  Buffer scratch(memory_, Category::activations, rc ? c.sizes.scratch : 0, &pool_);
  take_core();
  const auto t0 = Clock::now();
  const float loss = c.stage->forward(
      params(c, op.version), c.first ? tokens.data() : nullptr,
      c.first ? nullptr : inputs_.at(key).data(), c.last ? targets.data() : nullptr, s_.plan().b,
      rc, stash.data(), c.last ? nullptr : out.data(), rc ? scratch.data() : nullptr);
  const auto t1 = Clock::now();
  busy_s_ += std::chrono::duration<double>(t1 - t0).count();
  record(planner::kComputeStream, t0, t1);
  // Every TP member computes the loss; TP index 0 reports it.
  if (StepBook::reports_loss(c.last, tp_)) s_.add_loss(op.step, loss);
  inputs_.erase(key);
  stash_[key] = std::move(stash);
  if (!c.last) outputs_[key] = std::move(out);
}

// A compute op on the rank's core, timed: its busy time and its timeline entry.
float Worker::timed_compute(const std::function<float()>& op) {
  take_core();
  const auto t0 = Clock::now();
  const float result = op();
  const auto t1 = Clock::now();
  busy_s_ += std::chrono::duration<double>(t1 - t0).count();
  record(planner::kComputeStream, t0, t1);
  return result;
}

// A mixed chunk's forward (activation offload per layer): its swapped layers' stash is kept (and
// swapped by the copy ops, as a swapping stage's whole stash), its recomputed layers run through a
// scratch freed at once, their runs' inputs kept as checkpoints.
void Worker::forward_mixed(const Op& op, Chunk& c) {
  const Key key{op.step, op.microbatch, op.chunk};
  std::vector<std::int32_t> tokens, targets;
  if (c.first || c.last) samples(op, tokens, targets);
  Buffer stash(memory_, Category::activations, c.mixed_sizes.swapped, &pool_);
  Buffer kept(memory_, Category::activations, c.mixed_sizes.checkpoints, &pool_);
  Buffer out(memory_, Category::activations, c.sizes.output, &pool_);
  Buffer scratch(memory_, Category::activations, c.mixed_sizes.scratch, &pool_);
  const float loss = timed_compute([&] {
    return c.stage->forward_mixed(
        params(c, op.version), c.first ? tokens.data() : nullptr,
        c.first ? nullptr : inputs_.at(key).data(), c.last ? targets.data() : nullptr, s_.plan().b,
        c.recomputed, stash.data(), kept.data(), c.last ? nullptr : out.data(), scratch.data());
  });
  if (StepBook::reports_loss(c.last, tp_)) s_.add_loss(op.step, loss);
  inputs_.erase(key);
  stash_[key] = std::move(stash);
  checkpoints_[key] = std::move(kept);
  if (!c.last) outputs_[key] = std::move(out);
}

// Block recompute: the forward keeps every layer's input (the planner's L_s) and runs its layers
// through a scratch freed at once.
void Worker::forward_blocks(const Op& op, Chunk& c) {
  const Key key{op.step, op.microbatch, op.chunk};
  std::vector<std::int32_t> tokens, targets;
  if (c.first || c.last) samples(op, tokens, targets);
  Buffer kept(memory_, Category::activations, c.stage->layer_inputs(s_.plan().b), &pool_);
  Buffer out(memory_, Category::activations, c.sizes.output, &pool_);
  Buffer scratch(memory_, Category::activations, c.stage->blocks_scratch(s_.plan().b), &pool_);
  const float loss = timed_compute([&] {
    return c.stage->forward_blocks(params(c, op.version), c.first ? tokens.data() : nullptr,
                                   c.first ? nullptr : inputs_.at(key).data(),
                                   c.last ? targets.data() : nullptr, s_.plan().b, kept.data(),
                                   c.last ? nullptr : out.data(), scratch.data());
  });
  if (StepBook::reports_loss(c.last, tp_)) s_.add_loss(op.step, loss);
  inputs_.erase(key);
  stash_[key] = std::move(kept);
  if (!c.last) outputs_[key] = std::move(out);
}

void Worker::recompute(const Op& op) {
  if (chunked_) return chunk_recompute(op);
  const Key key{op.step, op.microbatch, op.chunk};
  Chunk& c = chunks_[std::size_t(op.chunk)];
  // Block recompute: the layers are re-made one at a time inside the backward after this op, in
  // the scratch taken here (the simulator's recompute op holds it from here to that backward's
  // end as well).
  if (blocks_) {
    full_[key] =
        Buffer(memory_, Category::activations, c.stage->blocks_scratch(s_.plan().b), &pool_);
    return;
  }
  // A mixed stage's chunk whose blocks all swap: nothing to re-make (as the simulator's op).
  if (!c.mixed && !s_.plan().recomputes(stage_)) return;
  std::vector<std::int32_t> tokens, targets;
  if (c.first || c.last) samples(op, tokens, targets);
  Buffer full(memory_, Category::activations, c.mixed ? c.mixed_sizes.remade : c.sizes.stash,
              &pool_);
  take_core();
  const auto t0 = Clock::now();
  if (c.mixed)
    c.stage->recompute_mixed(params(c, op.version), c.last ? targets.data() : nullptr, s_.plan().b,
                             c.recomputed, checkpoints_.at(key).data(), full.data());
  else
    c.stage->recompute(params(c, op.version), c.first ? tokens.data() : nullptr,
                       c.last ? targets.data() : nullptr, s_.plan().b, stash_.at(key).data(),
                       full.data());
  const auto t1 = Clock::now();
  busy_s_ += std::chrono::duration<double>(t1 - t0).count();
  record(planner::kComputeStream, t0, t1);
  full_[key] = std::move(full);
}

void Worker::backward(const Op& op) {
  if (chunked_) return chunk_backward(op);
  const Key key{op.step, op.microbatch, op.chunk};
  Chunk& c = chunks_[std::size_t(op.chunk)];
  const planner::Plan& p = s_.plan();
  const bool rc = p.recomputes(stage_);
  if (swaps_) swapped_.release_due(compute_ops_);
  release_sends(compute_ops_);
  ++compute_ops_;
  wait_grads(std::size_t(op.chunk));  // its gradients accumulate into what a collective may read
  if (swaps_) swapped_.back(key, rank_);  // a swapped stash: on the device again
  const float* full = c.mixed || blocks_ ? nullptr
                      : rc               ? full_.at(key).data()
                                         : stash_.at(key).data();
  Buffer d_input(memory_, Category::activations, c.first ? 0 : c.sizes.input, &pool_);
  // Gradients of the mean loss over the global batch: 1 / (B T) per token.
  const float scale = 1.0f / float(double(p.global_batch()) * double(s_.model->seq_len));
  // Optimizer offload streams the gradients out layer by layer (the copy_gradient_to_host after
  // the backward, for the timeline); otherwise they are added into the chunk's.
  std::unique_ptr<GradientSink> sink;
  if (offload_optimizer_ && !offload_sharded_) {
    sink = std::make_unique<TileSink>(
        *this, std::size_t(op.chunk),
        gradient_copy_op(s_.programs->devices[std::size_t(rank_)].ops, op_));
  } else if (const auto [embedding, head] = tied_ends_on_one_device(chunks_); head == &c) {
    // Both tied ends on this device (d = 1, v > 1): the head's gradient of the tied tensor adds
    // into the embedding's, one accumulator for both ends in program order, as one chunk holding
    // both (v = 1) and the offload chunks' one wte do; sum_local_tied then copies it back.
    wait_grads(std::size_t(embedding - chunks_.data()));
    sink = std::make_unique<TiedEndsSink<GradientSink, float>>(
        c.grads.data(), c.tied_offset, c.tied_size,
        embedding->grads.data() + embedding->tied_offset);
  }
  take_core();
  const auto t0 = Clock::now();
  if (blocks_) {  // each layer re-made from its kept input just before its backward
    std::vector<std::int32_t> tokens, targets;
    if (c.last) samples(op, tokens, targets);
    c.stage->backward_blocks(
        params(c, op.version), stash_.at(key).data(), c.last ? targets.data() : nullptr,
        c.last ? nullptr : d_outputs_.at(key).data(), p.b, scale, sink ? nullptr : c.grads.data(),
        sink.get(), c.first ? nullptr : d_input.data(), workspace_.data(), full_.at(key).data());
  } else if (c.mixed) {  // each layer's stash from the swapped piece or the recompute's
    c.stage->backward_mixed(params(c, op.version), c.recomputed, stash_.at(key).data(),
                            full_.at(key).data(), c.last ? nullptr : d_outputs_.at(key).data(), p.b,
                            scale, sink ? nullptr : c.grads.data(), sink.get(),
                            c.first ? nullptr : d_input.data(), workspace_.data());
  } else if (sink) {
    c.stage->backward(params(c, op.version), full, c.last ? nullptr : d_outputs_.at(key).data(),
                      p.b, scale, *sink, c.first ? nullptr : d_input.data(), workspace_.data());
  } else {
    c.stage->backward(params(c, op.version), full, c.last ? nullptr : d_outputs_.at(key).data(),
                      p.b, scale, c.grads.data(), c.first ? nullptr : d_input.data(),
                      workspace_.data());
  }
  const auto t1 = Clock::now();
  busy_s_ += std::chrono::duration<double>(t1 - t0).count();
  record(planner::kComputeStream, t0, t1);
  stash_.erase(key);
  full_.erase(key);
  checkpoints_.erase(key);
  d_outputs_.erase(key);
  if (!c.first) d_inputs_[key] = std::move(d_input);
}

void Worker::all_reduce(const Op& op) {
  Chunk& c = chunks_[std::size_t(op.chunk)];
  const auto range = bucket_range(c.grads.size(), s_.programs->buckets, op.bucket);
  const std::int64_t begin = range.first, end = range.second;
  // On the collective engine: the next ops (a backward of another chunk, a send, a receive) run
  // meanwhile; the rank's next use of the gradients waits for it (wait_grads).
  Event& reduced = reduced_[std::size_t(op.chunk)];
  if (sharded_) {
    reduced = issue(collective_engine_.get(),
                    [this, op, begin, end, at = op_] { reduce_scatter(op, begin, end, at); });
    return;
  }
  float* data = c.grads.data() + begin;
  const std::int64_t count = end - begin;
  reduced = issue(collective_engine_.get(), [this, op, data, count, at = op_] {
    const auto t0 = Clock::now();
    s_.transport->all_reduce_sum(
        fmt::format("ar/{}.{}/{}/{}/{}", stage_, tp_, op.step, op.chunk, op.bucket),
        replica_group(), device_, data, count);
    copy_record(planner::kCollectiveStream, t0, Clock::now(), at);
  });
}

std::vector<int> Worker::replica_group() const {
  return replica_devices(s_.plan(), stage_, tp_);
}

// The distributed optimizer's gradient sum of one bucket [begin, end) of a chunk: a reduce-scatter
// by the shard rule (each replica gets the sum over its shard, the only part its optimizer reads),
// except for the tied tensor where the chunk holds one:
// - the last stage's lm_head copy (d > 1), which its optimizer skips: by tied_shard over the
//   tensor, so that replica r holds the shard it sends stage 0 (send_tied_gradient);
// - both ends on one device (d == 1): all-reduced whole, as without sharding, since each end's
//   update adds the other's gradient (sum_local_tied) wherever its shard lies.
void Worker::reduce_scatter(const Op& op, std::int64_t begin, std::int64_t end, int at) {
  const planner::Plan& p = s_.plan();
  Chunk& c = chunks_[std::size_t(op.chunk)];
  const std::vector<int> group = replica_group();
  const auto t0 = Clock::now();
  for (const BucketPiece& piece :
       bucket_pieces(c.first, c.tied_offset, c.tied_size, p.d, p.w, begin, end)) {
    const std::int64_t a = piece.begin, b = piece.end;
    const std::string key =
        fmt::format("rs/{}.{}/{}/{}/{}/{}", stage_, tp_, op.step, op.chunk, op.bucket, piece.index);
    if (piece.kind == BucketPiece::tied_whole) {
      s_.transport->all_reduce_sum(key, group, device_, c.grads.data() + a, b - a);
    } else if (piece.kind == BucketPiece::tied_shards) {
      s_.transport->reduce_scatter_sum(key, group, device_, c.grads.data() + a, piece.bounds);
    } else {
      const std::vector<ShardPiece> parts = shard_pieces(std::size_t(op.chunk), a, b);
      for (std::size_t k = 0; k < parts.size(); ++k)
        s_.transport->reduce_scatter_sum(parts.size() > 1 ? fmt::format("{}.{}", key, k) : key,
                                         group, device_, c.grads.data() + parts[k].begin,
                                         parts[k].bounds);
    }
  }
  copy_record(planner::kCollectiveStream, t0, Clock::now(), at);
}

std::vector<ShardPiece> Worker::shard_pieces(std::size_t chunk, std::int64_t a,
                                             std::int64_t b) const {
  const std::int64_t flat = chunks_.back().base + chunks_.back().sizes.parameters;
  return detail::shard_pieces(offload_sharded_ ? &host_chunks_[chunk].layers : nullptr, flat,
                              chunks_[chunk].base, s_.plan().w, a, b);  // exec/offload.hpp
}

// After the sharded update: every replica's shard of the new version `target` to the others.
void Worker::all_gather(int step, int target) {
  const std::vector<int> group = replica_group();
  const auto t0 = Clock::now();
  for (std::size_t i = 0; i < chunks_.size(); ++i) {
    Chunk& c = chunks_[i];
    const std::string key = fmt::format("ag/{}.{}/{}/{}", stage_, tp_, step, i);
    const std::vector<ShardPiece> parts = shard_pieces(i, 0, c.sizes.parameters);
    for (std::size_t k = 0; k < parts.size(); ++k)
      s_.transport->all_gather(parts.size() > 1 ? fmt::format("{}.{}", key, k) : key, group,
                               device_, c.slots[target].data() + parts[k].begin, parts[k].bounds);
  }
  record(planner::kCollectiveStream, t0, Clock::now());
}

// The token embedding (stage 0) and the LM head's copy (last stage) are one parameter. Stage 0
// owns its update: it adds the head's gradient to its own (embedding + head, the order of the
// sum on one device) and sends the new weights back; the last stage's optimizer skips the copy.
// With w > 1 the head's gradient is the same on every replica after the all-reduce (with the
// distributed optimizer, replica r's shard of it after the reduce-scatter), so replica r sends
// only its shard (tied_shard) and the receiving stage's replicas all-gather the shards.
void Worker::tied(const Op& op) {
  Chunk& c = chunks_[std::size_t(op.chunk)];
  if (chunked_) {
    require_tied(op, c.tied_offset, rank_);
    return chunk_tied(op);
  }
  tied_.run(op, c.tied_offset, c.tied_size, s_.plan().w, replica_,
            rank_);  // exec/tied_exchange.hpp
}

// The tied exchange's device part (exec/tied_exchange.hpp). The gradient's ops read or write the
// chunk's gradients: after its collectives and its earlier tied-gradient send (wait_grads). The
// weights' ops need no wait: a slot's sends only read it.
void Worker::tied_gradient_out(const Op& op, planner::TiedShard sh) {
  wait_grads(std::size_t(op.chunk));
  Chunk& c = chunks_[std::size_t(op.chunk)];
  float* grad = tied_grad(c);
  const std::int64_t n = c.tied_size;
  const int at = op_, src = device_, dst = device_of(op.peer);
  Worker* self = this;
  // The gradient's next users (this step's optimizer, the next backward) wait for it.
  tied_sent_[std::size_t(op.chunk)] = issue(send_engine_.get(), [self, grad, sh, n, at, src, dst] {
    const auto t1 = Clock::now();
    self->s_.transport->send(src, dst, Channel::tied,
                             std::vector<float>(grad + sh.begin, grad + sh.end));
    std::fill(grad, grad + n, 0.0f);  // the next step accumulates from zero
    self->copy_record(planner::kSendStream, t1, Clock::now(), at);
  });
}

void Worker::tied_gradient_in(const Op& op, planner::TiedShard sh, bool hold) {
  wait_grads(std::size_t(op.chunk));
  const auto t0 = Clock::now();
  Chunk& c = chunks_[std::size_t(op.chunk)];
  const std::vector<float> head = s_.transport->recv(device_of(op.peer), device_, Channel::tied);
  if (hold) {
    tied_head_.assign(std::size_t(c.tied_size), 0.0f);
    std::copy(head.begin(), head.end(), tied_head_.begin() + sh.begin);
  } else {
    float* grad = tied_grad(c);
    for (std::int64_t i = 0; i < c.tied_size; ++i)
      grad[i] = grad[i] + head[std::size_t(i)];
  }
  record(planner::kRecvStream, t0, Clock::now());
}

void Worker::tied_gradient_gather(const Op& op, planner::TiedShard) {
  wait_grads(std::size_t(op.chunk));
  const auto t0 = Clock::now();
  Chunk& c = chunks_[std::size_t(op.chunk)];
  const std::int64_t n = c.tied_size;
  s_.transport->all_gather(fmt::format("tg/{}.{}/{}", stage_, tp_, op.step), replica_group(),
                           device_, tied_head_.data(), shard_starts(n, 0, s_.plan().w));
  float* grad = tied_grad(c);
  for (std::int64_t i = 0; i < n; ++i)
    grad[i] = grad[i] + tied_head_[std::size_t(i)];
  tied_head_ = {};
  record(planner::kCollectiveStream, t0, Clock::now());
}

void Worker::tied_weights_out(const Op& op, planner::TiedShard sh) {
  // Read out of the version's slot on the send engine: an update or upload that rewrites the
  // slot waits for it (slots_.read_by), the compute thread does not.
  const Chunk& c = chunks_[std::size_t(op.chunk)];
  const float* weights = params(c, op.version) + c.tied_offset;
  const int at = op_, src = device_, dst = device_of(op.peer);
  Worker* self = this;
  slots_.read_by(op.version, issue(send_engine_.get(), [self, weights, sh, at, src, dst] {
                   const auto t1 = Clock::now();
                   self->s_.transport->send(
                       src, dst, Channel::tied_weights,
                       std::vector<float>(weights + sh.begin, weights + sh.end));
                   self->copy_record(planner::kSendStream, t1, Clock::now(), at);
                 }));
}

void Worker::tied_weights_in(const Op& op, planner::TiedShard sh, bool hold) {
  const auto t0 = Clock::now();
  Chunk& c = chunks_[std::size_t(op.chunk)];
  const std::vector<float> w =
      s_.transport->recv(device_of(op.peer), device_, Channel::tied_weights);
  float* out = c.slots[slots_.slot_of(op.version)].data() + c.tied_offset;
  if (hold) std::fill(out, out + c.tied_size, 0.0f);
  std::copy(w.begin(), w.end(), out + sh.begin);
  record(planner::kRecvStream, t0, Clock::now());
}

void Worker::tied_weights_gather(const Op& op, planner::TiedShard) {
  const auto t0 = Clock::now();
  Chunk& c = chunks_[std::size_t(op.chunk)];
  float* out = c.slots[slots_.slot_of(op.version)].data() + c.tied_offset;
  s_.transport->all_gather(fmt::format("tw/{}.{}/{}", stage_, tp_, op.version), replica_group(),
                           device_, out, shard_starts(c.tied_size, 0, s_.plan().w));
  record(planner::kCollectiveStream, t0, Clock::now());
}

// One device holding both tied ends (d == 1, v > 1): the same sum, on both chunks, no messages.
void Worker::sum_local_tied() {
  const auto [embedding, head] = tied_ends_on_one_device(chunks_);  // exec/tied_exchange.hpp
  if (!embedding) return;
  // The head's backward added its gradient into the embedding's (TiedEndsSink): the sum of both.
  std::copy_n(embedding->grads.data() + embedding->tied_offset, embedding->tied_size,
              head->grads.data() + head->tied_offset);
}

void Worker::optimizer_step(const Op& op) {
  if (offload_optimizer_) return offload_step(op);
  if (chunked_) return chunk_optimizer_step(op);
  for (std::size_t i = 0; i < chunks_.size(); ++i)
    wait_grads(i);  // the step's gradient sums have arrived
  if (s_.plan().d == 1) sum_local_tied();
  ++updates_;
  const int target = slots_.begin_update(op.version);  // exec/weight_slots.hpp
  take_core();
  const auto t0 = Clock::now();
  for (Chunk& c : chunks_)
    update(c, slots_.newest(), target);
  const auto t1 = Clock::now();
  busy_s_ += std::chrono::duration<double>(t1 - t0).count();
  record(planner::kComputeStream, t0, t1);
  if (sharded_) all_gather(op.step, target);
  slots_.end_update(op.version, target);
  s_.end_step(op.step, [this](int done) { save_checkpoint(done); });
}

// The last stage's copy of the tied tensor (d > 1) is not updated here: stage 0 sends it
// (recv_tied_weights). Its optimizer state stays allocated, unused; its gradient is zero already.
// With the distributed optimizer only the rank's shard [own_begin, own_end) of those ranges, and
// the rest of the gradient (other replicas' shards: this replica's unreduced sums) is zeroed too.
void Worker::update(Chunk& c, int source, int target) {
  for (auto [begin, end] :
       updated_ranges(c.first, c.last, c.tied_offset, c.tied_size, s_.plan().d, c.grads.size())) {
    begin = std::max(begin, c.own_begin);
    end = std::min(end, c.own_end);
    if (begin >= end) continue;
    const std::int64_t at = begin - c.own_begin;
    optimizer_update(*s_.options, updates_, c.slots[source].data() + begin,
                     c.slots[target].data() + begin, c.grads.data() + begin, c.m_at + at,
                     c.v_at ? c.v_at + at : nullptr, end - begin);
  }
  if (sharded_) std::fill_n(c.grads.data(), c.grads.size(), 0.0f);
}

// The weight slots' device part (exec/weight_slots.hpp).
void Worker::allocate_slot(int slot) {
  for (Chunk& c : chunks_)
    c.slots[slot] = Buffer(memory_, Category::weight_versions, c.sizes.parameters);
}

// The rank's thread writes a slot (its update, or the copy engine's uploads issued from it) only
// once the send engine has read it: the compute thread waits here, not at the send.
void Worker::before_slot_write(int, SlotWriter, Event last_send) {
  last_send.wait();
}

RankResult Worker::result() const {
  RankResult r;
  r.rank = device_;
  r.peak_memory_bytes = memory_->peak();
  r.memory = memory_->at_peak();
  r.busy_s = busy_s_ - tp_wait_s_ - copy_wait_s_;
  r.host_peak_memory_bytes = host_.peak();
  r.copy_out_bytes = bytes_out_;
  r.copy_in_bytes = bytes_in_;
  r.edge_copy_out_bytes = edge_bytes_out_;
  r.edge_copy_in_bytes = edge_bytes_in_;
  r.edge_steps = chunked_ && parts_ > 1 ? std::min(s_.programs->steps, 2) : 0;
  r.activation_out_bytes = activation_bytes_out_;
  r.activation_in_bytes = activation_bytes_in_;
  // The newest version. Sharded chunks: from the parts gathered after the last step (none when
  // the run did not get there: no collective here, the other replicas may be gone).
  if (chunked_ && schedule_->layout.part_bytes > 0) {
    if (!final_parts_.empty()) r.weights = gather_chunks(0, updates_, final_parts_);
  } else if (chunked_) {
    r.weights = gather_chunks(0, updates_);
  }
  for (const Chunk& c : chunks_) {
    if (chunked_) break;
    r.weights.emplace_back(c.slots[slots_.newest()].data(),
                           c.slots[slots_.newest()].data() + c.slots[slots_.newest()].size());
  }
  for (const auto& slot : chunks_.front().stage->layout())
    r.slot_names.push_back(slot.name);
  r.timeline.rank = device_;
  r.timeline.label = t_ > 1 ? fmt::format("rank {} ({}, stage {}, replica {}, TP rank {})", device_,
                                          s_.runs_on, stage_, replica_, tp_)
                            : fmt::format("rank {} ({}, stage {}, replica {})", device_, s_.runs_on,
                                          stage_, replica_);
  r.timeline.ops = ops_;
  {
    std::lock_guard<std::mutex> lock(copy_ops_mutex_);
    r.timeline.ops.insert(r.timeline.ops.end(), copy_ops_.begin(), copy_ops_.end());
  }
  std::stable_sort(
      r.timeline.ops.begin(), r.timeline.ops.end(),
      [](const planner::TimedOp& a, const planner::TimedOp& b) { return a.start_s < b.start_s; });
  for (const auto& [t, bytes] : memory_->samples())
    r.timeline.memory.emplace_back(
        std::max(0.0, std::chrono::duration<double>(t - s_.start).count()), bytes);
  if (host_.peak() > 0)  // offload: the host pool over time, as the simulator's timeline has it
    for (const auto& [t, bytes] : host_.samples())
      r.timeline.host_memory.emplace_back(
          std::max(0.0, std::chrono::duration<double>(t - s_.start).count()), bytes);
  return r;
}

}  // namespace pw::exec::detail
