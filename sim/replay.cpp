// One actor per rank replays its program: compute ops take their trace duration, activations and
// gradients travel as SimGrid communications, all-reduce buckets overlap the last backward.
#include <algorithm>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <tuple>

#include <fmt/format.h>

#include "planner/chunks.hpp"
#include "sim/collectives.hpp"
#include "sim/observer.hpp"
#include "sim/world.hpp"

namespace pw::sim::detail {

namespace {

using planner::Op;
using planner::OpKind;

int kToken = 0;  // SimGrid needs a real payload pointer; only the simulated size matters

// One mailbox per (dst, kind, src), as the checker's FIFO channels: activations (A), gradients (G),
// tied gradients (T) and tied weights (W).
char channel_letter(OpKind k) {
  switch (k) {
    case OpKind::send_gradient:
    case OpKind::recv_gradient:
      return 'G';
    case OpKind::send_tied_gradient:
    case OpKind::recv_tied_gradient:
      return 'T';
    case OpKind::send_tied_weights:
    case OpKind::recv_tied_weights:
      return 'W';
    default:
      return 'A';
  }
}

std::string mailbox_name(int dst, OpKind kind, int src) {
  return fmt::format("{}{}<{}", dst, channel_letter(kind), src);
}

class Replayer {
 public:
  Replayer(World& w, int rank)
      : w_(w), me_(w.ranks[std::size_t(rank)]), program_(w.programs->devices[std::size_t(rank)]) {}

  void run() {
    claim_mailboxes(true);
    mark_bucketed_backwards();
    allocate_static();
    if (w_.plan().swaps(me_.stage)) open_copy_engines();
    if (w_.programs->chunks) open_chunk_engines();
    for (op_ = 0; op_ < int(program_.ops.size()); ++op_)
      step(program_.ops[std::size_t(op_)]);
    if (ck_.mutex) {
      {
        std::unique_lock<sg4::Mutex> lock(*ck_.mutex);
        ck_.closing = true;
        ck_.cv->notify_all();
      }
      for (auto& a : ck_.actors)
        a->join();
    }
    for (CopyEngine* e : {&down_, &up_}) {
      if (!e->actor) continue;
      {
        std::unique_lock<sg4::Mutex> lock(*e->mutex);
        e->closing = true;
        e->wake->notify_all();
      }
      e->actor->join();
    }
    for (auto& [name, ch] : channels_) {
      {
        std::unique_lock<sg4::Mutex> lock(*ch.mutex);
        ch.closing = true;
        ch.wake->notify_all();
      }
      ch.sender->join();
    }
    claim_mailboxes(false);
  }

 private:
  const planner::ChunkCost& chunk(const Op& op) const { return me_.chunks[std::size_t(op.chunk)]; }
  // offload chunks: this rank's stage's schedule.
  const planner::ChunkSchedule& schedule() const {
    return (*w_.programs->chunks)[std::size_t(me_.stage)];
  }

  // Mailboxes this rank receives on are eager: a send starts at once, as into a posted buffer.
  void claim_mailboxes(bool claim) {
    for (const Op& op : program_.ops)
      if (planner::is_recv(op.kind))
        sg4::Mailbox::by_name(mailbox_name(me_.rank, op.kind, op.peer))
            ->set_receiver(claim ? sg4::Actor::self() : nullptr);
  }

  // The last backward of each (step, chunk) that is followed by its all-reduces runs in bucket
  // slices, each slice starting its bucket's all-reduce (gradients are ready layer by layer).
  void mark_bucketed_backwards() {
    bucketed_.assign(program_.ops.size(), false);
    for (int i = int(program_.ops.size()) - 1, pending_step = -1, pending_chunk = -1; i >= 0; --i) {
      const Op& op = program_.ops[std::size_t(i)];
      if (op.kind == OpKind::all_reduce) {
        pending_step = op.step;
        pending_chunk = op.chunk;
      } else if (op.kind == OpKind::backward && op.step == pending_step &&
                 op.chunk == pending_chunk) {
        bucketed_[std::size_t(i)] = true;
        pending_step = -1;
      }
    }
  }

  void step(const Op& op) {
    if (w_.programs->chunks && planner::is_compute(op.kind)) return chunk_compute(op);
    switch (op.kind) {
      case OpKind::forward:
        allocate(&planner::MemoryBreakdown::activations, kept_bytes(chunk(op)));
        // A recomputing forward's scratch (ChunkCost::recompute_scratch_bytes), while it runs.
        allocate(&planner::MemoryBreakdown::activations, chunk(op).recompute_scratch_bytes);
        if (gather_step_ >= 0)
          forward_behind_gather(chunk(op).forward_s);
        else
          compute(chunk(op).forward_s);
        tensor_parallel(chunk(op).tp_forward);
        allocate(&planner::MemoryBreakdown::activations, -chunk(op).recompute_scratch_bytes);
        break;
      case OpKind::recompute:
        lower_messages();                               // as in the backward it comes before
        if (!planner::reruns_forward(me_.recompute)) {  // a mixed stage: its recomputed layers
          // only (none in a chunk whose blocks all swap)
          allocate(&planner::MemoryBreakdown::activations, chunk(op).layers_recompute_bytes);
          compute(chunk(op).layers_recompute_s);
          tensor_parallel(chunk(op).layers_recompute_tp);
          break;
        }
        // Full: the chunk's stash re-made; block: one layer at a time in the scratch (the layers'
        // backwards, in the op after, run between them: the same compute in the same slot).
        allocate(&planner::MemoryBreakdown::activations, remade_bytes(chunk(op)));
        compute(chunk(op).recompute_s);
        tensor_parallel(chunk(op).tp_forward);
        break;
      case OpKind::copy_activation_to_host:
        swapped_out_.insert(unit_of(op));
        enqueue(down_, op);
        break;
      case OpKind::copy_activation_to_device:
        enqueue(up_, op);
        break;
      case OpKind::backward:
        wait_uploaded(op);  // a swapped stash must be back on the device
        if (offload_.on()) offload_.begin_backward(op);  // gradients stream out meanwhile
        lower_messages();
        backward(op);
        allocate(&planner::MemoryBreakdown::activations,
                 -(kept_bytes(chunk(op)) + (planner::reruns_forward(me_.recompute)
                                                ? remade_bytes(chunk(op))
                                                : chunk(op).layers_recompute_bytes)));
        if (messages_lowered_) {  // the next forward holds them again
          allocate(&planner::MemoryBreakdown::activations, me_.backward_message_drop);
          messages_lowered_ = false;
        }
        break;
      case OpKind::send_tied_gradient:
        wait_collectives(op.step);  // as the executor: the head's gradient summed over replicas
        tied_reduce_scatter(op);    // chunks: the copy's gradient is not in any chunk's sum
        send(op);
        break;
      case OpKind::send_activation:
      case OpKind::send_gradient:
      case OpKind::send_tied_weights:
        send(op);
        break;
      case OpKind::recv_activation:
      case OpKind::recv_gradient:
      case OpKind::recv_tied_gradient:
      case OpKind::recv_tied_weights:
        receive(op);  // a tied message sent long ago is there already: no wait
        break;
      case OpKind::gather_tied_gradient:
        wait_collectives(op.step);  // as the executor: after the step's all-reduces
        gather(op);
        break;
      case OpKind::gather_tied_weights:
        gather(op);
        break;
      case OpKind::all_reduce:
        trigger(op.step, op.chunk, op.bucket);
        break;
      case OpKind::free_version:
        versions_ -= 1;
        set_versions();
        break;
      case OpKind::optimizer_step:
        optimizer_step(op);
        break;
      case OpKind::copy_gradient_to_host:
        // w > 1: the shard is there once the step's reduce-scatters are done
        if (op.microbatch < 0 && w_.plan().offload_sharded()) wait_collectives(op.step);
        offload_.run(op, op_);  // sim/offload.cpp
        break;
      case OpKind::host_optimizer_step:
      case OpKind::copy_parameters_to_device:
        offload_.run(op, op_);  // sim/offload.cpp
        break;
      case OpKind::copy_chunk_to_host:
      case OpKind::copy_chunk_to_device:
        if (op.layer >= 0)
          pending_chunks_.push_back(op_);  // runs before that layer of the next compute op
        else
          chunk_enqueue(op, op_);
        break;
      case OpKind::chunk_step_host:
        chunk_enqueue(op, op_);
        break;
      case OpKind::chunk_step_device:
        chunk_collective(op.step, op.bucket, false, op_);  // w > 1: the gradient's sum first
        compute(schedule().device_adam_s[std::size_t(op.bucket)]);
        chunk_collective(op.step, op.bucket, true, op_);  // and the parameters after
        break;
    }
  }

  // offload chunks (PatrickStar; docs/formulas.md section 9, chunks): three engines per rank,
  // each an actor working through its FIFO: device-to-host copies, host-to-device copies and CPU
  // Adam on the node's CPU host. An upload starts when the downloads issued before it are done
  // (they make its room) and takes its chunk's device memory as it starts; a download releases it
  // when done; a chunk's CPU Adam starts after the downloads issued before it. A compute op runs
  // layer by layer, each layer after its copies, its stash held from its forward to its
  // backward; optimizer_step waits for the host's Adam steps.
  struct ChunkJob {
    int kind = 0;  // 0 download, 1 upload, 2 CPU Adam
    int chunk = 0;
    int op = 0;
    int step = 0;
    std::int64_t after_downs = 0;  // downloads issued before it
    bool edge = false;             // in the run's first or last segment (2bw)
    // Sharded chunks (Op::part): a part copy (a drop, when a download before a layer or with 2bw
    // of a version's slot; a zero fill, when a 2bw gradient part's upload), or a CPU Adam whose
    // gradient was reduce-scattered on the device; `sharded`: the chunk is.
    bool part = false, drop = false, zero = false, sharded = false;
    int gather = 0;  // a part upload: the chunk's all-gathers of the step before it (the key)
  };
  struct ChunkEngines {
    sg4::MutexPtr mutex;
    sg4::ConditionVariablePtr cv;
    std::deque<ChunkJob> queue[3];
    std::int64_t issued[3] = {0, 0, 0}, done[3] = {0, 0, 0};
    bool closing = false;
    std::vector<sg4::ActorPtr> actors;
  };

  void open_chunk_engines() {
    chunk_step_ = w_.programs->first_step;
    ck_.mutex = sg4::Mutex::create();
    ck_.cv = sg4::ConditionVariable::create();
    const char* names[] = {"chunk-d2h", "chunk-h2d", "chunk-adam"};
    for (int k = 0; k < 3; ++k)
      ck_.actors.push_back(sg4::Actor::create(fmt::format("{}:{}", names[k], me_.rank), me_.host,
                                              [this, k] { chunk_loop(k); }));
  }

  void chunk_enqueue(const Op& op, int index) {
    const int kind = op.kind == OpKind::copy_chunk_to_host     ? 0
                     : op.kind == OpKind::copy_chunk_to_device ? 1
                                                               : 2;
    std::unique_lock<sg4::Mutex> lock(*ck_.mutex);
    const int first = w_.programs->first_step, last = first + w_.programs->steps - 1;
    ChunkJob job{kind,    op.bucket,     index,
                 op.step, ck_.issued[0], chunk_step_ == first || chunk_step_ == last};
    job.part = op.part;
    using PartCopy = planner::ChunkLayout::PartCopy;
    const PartCopy what = op.part && kind != 2
                              ? schedule().layout.part_copy(op.bucket, kind == 1, op.layer < 0)
                              : PartCopy::upload;
    job.drop = what == PartCopy::drop;
    job.zero = what == PartCopy::zero_fill;
    job.sharded = kind == 2 && schedule().layout.is_sharded(op.bucket);
    if (op.part && kind == 1) job.gather = ck_gathers_[{op.step, op.bucket}]++;
    ck_.queue[kind].push_back(job);
    ++ck_.issued[kind];
    ck_.cv->notify_all();
  }

  void chunk_loop(int kind) {
    const planner::ChunkSchedule& cs = schedule();
    // A unit: a chunk's parameters and, with m > 1, its gradient half; with 2bw one of its parts
    // (a weight version's slot or the gradient; docs/formulas.md section 9, chunks).
    const std::int64_t bytes = cs.layout.move_bytes;
    for (;;) {
      ChunkJob job;
      {
        std::unique_lock<sg4::Mutex> lock(*ck_.mutex);
        while (ck_.queue[kind].empty() && !ck_.closing)
          ck_.cv->wait(lock);
        if (ck_.queue[kind].empty()) return;
        job = ck_.queue[kind].front();
        ck_.queue[kind].pop_front();
        while (kind != 0 && ck_.done[0] < job.after_downs)
          ck_.cv->wait(lock);
      }
      // Sharded chunks' part counts: with 2bw the steady segments' only (the report's per step).
      const bool steady = !job.edge || cs.layout.parts == 1;
      if (kind == 2) {
        // w > 1: the gradient's sum first (a sharded chunk's, on the host only when it came down
        // whole: else on the device before its part's download).
        if (!job.part) chunk_collective(job.step, job.chunk, false, job.op);
        const double start = sg4::Engine::get_clock();
        // The replica's part of the chunk (all of its stepped elements with w = 1); with t > 1
        // every GPU of the TP group steps its own shard's chunk on the node's CPU.
        const auto [lo, hi] = cs.layout.shard(job.chunk, me_.replica);
        host_adam(me_, double(hi - lo)).wait();
        record(kHostCpu, start, sg4::Engine::get_clock(), job.op);
        // The new parameters to all (a sharded chunk's at its next upload).
        if (!job.sharded) chunk_collective(job.step, job.chunk, true, job.op);
      } else if (job.drop || job.zero) {
        // A sharded chunk without a gradient (with 2bw a version's slot) freed, or a 2bw
        // gradient part without one made as zeros on the device: nothing copied.
        const int sign = job.drop ? -1 : 1;
        allocate(&planner::MemoryBreakdown::weights, sign * cs.layout.unit_weight_bytes(job.chunk));
        allocate(&planner::MemoryBreakdown::gradients,
                 sign * cs.layout.unit_gradient_bytes(job.chunk));
        if (steady) ++(job.drop ? me_.chunk_drops : me_.chunk_zero_fills);
      } else {
        const bool down = kind == 0;
        const std::int64_t params = cs.layout.unit_weight_bytes(job.chunk),
                           grads = cs.layout.unit_gradient_bytes(job.chunk);
        if (!down) {
          allocate(&planner::MemoryBreakdown::weights, params);
          allocate(&planner::MemoryBreakdown::gradients, grads);
        }
        // A sharded chunk's part at the optimizer step: its gradient reduce-scattered on the
        // device first.
        if (down && job.part) chunk_collective(job.step, job.chunk, false, job.op);
        // Every GPU of the TP group moves its own shard's unit (t flows; one with t = 1); a part
        // is P bytes.
        const std::int64_t moved = job.part ? cs.layout.part_bytes : bytes;
        const HostWork c = host_copy(me_, down, moved);
        c.wait();
        record(down ? kCopyOut : kCopyIn, c.start(), c.finish(), job.op);
        (down ? me_.copied_out_bytes : me_.copied_in_bytes) += moved;
        (down ? me_.chunk_downloads : me_.chunk_uploads) += 1;
        if (job.part && steady) (down ? me_.chunk_part_downloads : me_.chunk_part_uploads) += 1;
        if (job.edge) {
          (down ? me_.edge_out_bytes : me_.edge_in_bytes) += moved;
          (down ? me_.edge_downloads : me_.edge_uploads) += 1;
        }
        // A part upload: the chunk all-gathered over the replicas (S_p) after it.
        if (!down && job.part)
          all_gather(collective(job.step, job.chunk, -100 - job.gather),
                     double(cs.layout.chunk_bytes), "chunk-allgather", job.op);
        if (down) {
          allocate(&planner::MemoryBreakdown::weights, -params);
          allocate(&planner::MemoryBreakdown::gradients, -grads);
        }
      }
      std::unique_lock<sg4::Mutex> lock(*ck_.mutex);
      ++ck_.done[kind];
      ck_.cv->notify_all();
    }
  }

  // w > 1 (else nothing): blocks until the stage's replicas have all reached chunk `chunk`'s
  // reduce-scatter of its gradient (`gather` false) or all-gather of its parameters in step
  // `step`, and the last to arrive has run it: a ring over S_p bytes, as an all-gather's.
  void chunk_collective(int step, int chunk, bool gather, int op) {
    if (w_.plan().w == 1) return;
    all_gather(collective(step, chunk, gather ? -21 : -20), double(schedule().layout.chunk_bytes),
               gather ? "chunk-allgather" : "chunk-reducescatter", op);
  }

  // Offload chunks with w > 1 (else nothing): the last stage's tied copy gets no chunk step, so
  // its replicas reduce-scatter its gradient before each sends its shard (as the executor):
  // blocks until every replica arrived and the last has run a ring over the tied tensor's bytes.
  void tied_reduce_scatter(const Op& op) {
    if (w_.plan().offload != planner::Offload::chunks || w_.plan().w == 1) return;
    all_gather(collective(op.step, op.chunk, -22), double(me_.tied_bytes),
               "chunk-tied-reducescatter", op_);
  }

  // Waits until every job of `kind` issued so far is done.
  void chunk_wait(int kind) {
    std::unique_lock<sg4::Mutex> lock(*ck_.mutex);
    while (ck_.done[kind] < ck_.issued[kind])
      ck_.cv->wait(lock);
  }

  // A forward, recompute or backward with chunks: its layers in the schedule's moment order, each
  // after the copies tagged with it (in program order) are done: evictions and uploads; the
  // moment's activations taken before the layer runs and given back after it. A recompute op has
  // the recompute moments of the backward after it (the same slot).
  void chunk_compute(const Op& op) {
    const planner::ChunkSchedule& cs = schedule();
    const bool back = op.kind == OpKind::backward, again = op.kind == OpKind::recompute;
    const int index = again ? chunk_slot_ : chunk_slot_++;
    std::size_t next = 0;
    // The step's moments (2bw: of the segment before step chunk_step_'s optimizer step).
    const std::vector<planner::ChunkMoment>& moments =
        cs.moments_of(w_.programs->first_step, w_.programs->steps, chunk_step_);
    for (std::size_t k = 0; k < moments.size(); ++k) {
      const planner::ChunkMoment& m = moments[k];
      if (m.slot != index || m.recompute != again || m.backward != back) continue;
      for (; next < pending_chunks_.size() &&
             program_.ops[std::size_t(pending_chunks_[next])].layer == m.layer;
           ++next)
        chunk_enqueue(program_.ops[std::size_t(pending_chunks_[next])], pending_chunks_[next]);
      chunk_wait(0);  // the evictions make room for the layer's stash too
      chunk_wait(1);
      allocate(&planner::MemoryBreakdown::activations, m.alloc_bytes);
      if (me_.layer_costs.empty()) {
        compute(m.compute_s);
      } else if (back) {  // t > 1: as a backward without chunks, for this layer
        const planner::ChunkCost& lc = me_.layer_costs.at(m.kind);
        if (m.remake) tensor_parallel(lc.tp_forward);  // block recompute: its forward again first
        tensor_parallel(lc.tp_backward);
        compute(std::max(0.0, m.compute_s - overlapped_tensor_parallel(lc)));
      } else {
        compute(m.compute_s);
        tensor_parallel(me_.layer_costs.at(m.kind).tp_forward);
      }
      allocate(&planner::MemoryBreakdown::activations, -m.free_bytes);
    }
    pending_chunks_.clear();
  }

  // Activation offload (KARMA, docs/formulas.md section 9, activation offload): one copy engine per
  // direction, each an actor running its copies in FIFO order over the GPU's host link. A download
  // releases the stash on the device when it has finished; an upload starts after its download and
  // the uploads before it, and takes the stash's device memory back as it starts.
  using Unit = std::tuple<int, int, int>;  // (step, microbatch, chunk)
  struct CopyJob {
    Unit unit;
    std::int64_t bytes = 0;
    int op = 0;
  };
  struct CopyEngine {
    std::deque<CopyJob> queue;
    bool closing = false;
    sg4::MutexPtr mutex;
    sg4::ConditionVariablePtr wake;
    sg4::ActorPtr actor;
  };

  static Unit unit_of(const Op& op) { return {op.step, op.microbatch, op.chunk}; }

  void open_copy_engines() {
    swap_mutex_ = sg4::Mutex::create();
    swap_done_ = sg4::ConditionVariable::create();
    for (CopyEngine* e : {&down_, &up_}) {
      e->mutex = sg4::Mutex::create();
      e->wake = sg4::ConditionVariable::create();
    }
    down_.actor = sg4::Actor::create(fmt::format("d2h:{}", me_.rank), me_.host,
                                     [this] { copy_loop(down_, true); });
    up_.actor = sg4::Actor::create(fmt::format("h2d:{}", me_.rank), me_.host,
                                   [this] { copy_loop(up_, false); });
  }

  void enqueue(CopyEngine& e, const Op& op) {
    std::unique_lock<sg4::Mutex> lock(*e.mutex);
    e.queue.push_back({unit_of(op), chunk(op).swap_bytes, op_});
    e.wake->notify_all();
  }

  void copy_loop(CopyEngine& e, bool down) {
    for (;;) {
      CopyJob job;
      {
        std::unique_lock<sg4::Mutex> lock(*e.mutex);
        while (e.queue.empty() && !e.closing)
          e.wake->wait(lock);
        if (e.queue.empty()) return;
        job = e.queue.front();
        e.queue.pop_front();
      }
      if (!down) {  // the stash must be on the host first
        std::unique_lock<sg4::Mutex> lock(*swap_mutex_);
        while (downloaded_.count(job.unit) == 0)
          swap_done_->wait(lock);
        downloaded_.erase(job.unit);
        allocate(&planner::MemoryBreakdown::activations, job.bytes);
      } else {
        host_swap(job.bytes);
      }
      const HostWork c = host_copy(me_, down, job.bytes);  // each GPU of a TP group its shard
      c.wait();
      record(down ? kCopyOut : kCopyIn, c.start(), c.finish(), job.op);
      (down ? me_.copied_out_bytes : me_.copied_in_bytes) += job.bytes;
      if (down) {
        me_.swapped_bytes += job.bytes;
        allocate(&planner::MemoryBreakdown::activations, -job.bytes);
      } else {
        host_swap(-job.bytes);
      }
      std::unique_lock<sg4::Mutex> lock(*swap_mutex_);
      (down ? downloaded_ : uploaded_).insert(job.unit);
      swap_done_->notify_all();
    }
  }

  void host_swap(std::int64_t bytes) {
    me_.swap_host_now += bytes;
    me_.swap_host_peak = std::max(me_.swap_host_peak, me_.swap_host_now);
    if (w_.options.timeline)
      me_.host_samples.emplace_back(sg4::Engine::get_clock(),
                                    me_.offload.host_bytes + me_.swap_host_now);
  }

  // A backward whose stash went to the host waits for its upload.
  void wait_uploaded(const Op& op) {
    if (!swap_mutex_) return;
    const Unit u = unit_of(op);
    if (swapped_out_.erase(u) == 0) return;
    std::unique_lock<sg4::Mutex> lock(*swap_mutex_);
    while (uploaded_.count(u) == 0)
      swap_done_->wait(lock);
    uploaded_.erase(u);
  }

  // Waits for the step's all-reduces (started by the bucketed backwards), once per step.
  void wait_collectives(int step) {
    // Chunks have no all-reduce buckets: each chunk step sums its chunk (chunk_collective).
    if (w_.plan().offload == planner::Offload::chunks) return;
    if (step <= waited_through_) return;  // the tail ops of a step come in step order
    waited_through_ = step;
    for (int chunk = 0; chunk < w_.plan().v && w_.plan().w > 1; ++chunk)
      for (int b = 0; b < w_.programs->buckets; ++b) {
        trigger(step, chunk, b);
        Collective& c = collective(step, chunk, b);
        std::unique_lock<sg4::Mutex> lock(*c.mutex);
        while (!c.done)
          c.finished->wait(lock);
        record(kCollective, c.start, c.end, op_);
      }
  }

  // Alone on its GPU a rank replays the duration (sleep_for: no resource to share). Ranks sharing
  // a GPU execute on its host, which SimGrid shares max-min fairly: two busy ranks each run at
  // half speed, as two streams contending for one GPU. With device turns (the CPU executor's
  // --core-turns) they take the device's mutex instead, first come first served, and run alone.
  void compute(double seconds) {
    if (me_.turn && seconds > 0) {
      std::unique_lock<sg4::Mutex> turn(*me_.turn, std::defer_lock);
      if (!holding_turn_) turn.lock();
      const double start = sg4::Engine::get_clock();
      sg4::this_actor::sleep_for(seconds);
      ++w_.timed_ops;
      record(kCompute, start, sg4::Engine::get_clock(), op_);
      return;
    }
    const double start = sg4::Engine::get_clock();
    if (seconds > 0) {
      if (me_.shares_gpu) {
        sg4::this_actor::execute(seconds * kGpuSpeed);
      } else {
        sg4::this_actor::sleep_for(seconds);
        ++w_.timed_ops;  // executions are counted with the transfers, sleeps here
      }
    }
    record(kCompute, start, sg4::Engine::get_clock(), op_);
  }

  // What a forward keeps for its backward: the input (full recompute), the stash without the
  // attention cores (selective), or everything.
  // A backward (from its recompute op, when it has one) holds backward_message_drop bytes of
  // message buffers fewer than the static count (planner::backward_message_buffers).
  void lower_messages() {
    if (messages_lowered_ || me_.backward_message_drop == 0) return;
    allocate(&planner::MemoryBreakdown::activations, -me_.backward_message_drop);
    messages_lowered_ = true;
  }

  // What a recompute op re-makes and holds until its backward ends: the chunk's stash (full), or
  // the scratch each layer is re-made in, the largest one's stash and with SP its all-gathers'
  // rows (block).
  std::int64_t remade_bytes(const planner::ChunkCost& ch) const {
    return me_.recompute == planner::Recompute::block ? ch.recompute_scratch_bytes : ch.stash_bytes;
  }

  std::int64_t kept_bytes(const planner::ChunkCost& ch) const {
    if (ch.recompute_layers > 0) return ch.mixed_kept_bytes();  // a mixed stage (per layer)
    switch (me_.recompute) {
      case planner::Recompute::full:
        return ch.input_bytes;
      case planner::Recompute::block:
        return ch.layer_inputs_bytes;
      case planner::Recompute::selective:
        return ch.selective_bytes;
      case planner::Recompute::none:
        break;
    }
    return ch.stash_bytes;
  }

  // A pass's TP collectives: blocking, as Megatron's are, one ring over the group's GPUs moving
  // what they all move, plus the latencies of the collectives beyond the first.
  void tensor_parallel(const planner::TpTraffic& traffic) {
    const int t = int(me_.tp_hosts.size());
    if (t <= 1 || traffic.empty()) return;
    const double start = sg4::Engine::get_clock();
    const std::int64_t extra = traffic.latency_steps(t) - 2 * (t - 1);
    if (extra > 0) sg4::this_actor::sleep_for(double(extra) * me_.tp_latency_s);
    ring_allreduce(me_.tp_hosts, traffic.equivalent_allreduce_bytes());
    record(kTensorParallel, start, sg4::Engine::get_clock(), op_);
  }

  // The backward's asynchronous TP collectives, which Megatron runs beside its GEMMs: replayed
  // first on their links, each group hiding up to its GEMMs' time, which the backward's compute
  // then no longer needs (total: compute + what each group takes beyond its GEMMs, as
  // planner::tp_backward_s). Returns the compute time they hid, which the timeline shows on the
  // compute stream too (the GEMMs ran then), so a rank's busy time is its compute with them.
  double overlapped_tensor_parallel(const planner::ChunkCost& ch) {
    double hidden = 0;
    for (const auto& [traffic, gemm_s] : {std::pair{&ch.tp_backward_wgrad, ch.backward_weight_s},
                                          std::pair{&ch.tp_backward_dgrad, ch.backward_input_s}}) {
      const double start = sg4::Engine::get_clock();
      tensor_parallel(*traffic);
      const double gemms = std::min(sg4::Engine::get_clock() - start, gemm_s);
      if (gemms > 0) record(kCompute, start, start + gemms, op_);
      hidden += gemms;
    }
    return hidden;
  }

  void backward(const Op& op) {
    const planner::ChunkCost& ch = chunk(op);
    tensor_parallel(ch.tp_backward);
    const double hidden = overlapped_tensor_parallel(ch);
    const double t =
        std::max(0.0, ch.backward_s - hidden) +
        (me_.recompute == planner::Recompute::selective ? ch.selective_recompute_s : 0.0);
    if (!bucketed_[std::size_t(op_)]) return compute(t);
    const int buckets = w_.programs->buckets;
    // With device turns the backward holds the device throughout, as the executor's one op does.
    std::unique_lock<sg4::Mutex> turn;
    if (me_.turn && t > 0) {
      turn = std::unique_lock<sg4::Mutex>(*me_.turn);
      holding_turn_ = true;
    }
    for (int b = 0; b < buckets; ++b) {
      compute(t / buckets);
      trigger(op.step, op.chunk, b);
    }
    holding_turn_ = false;
  }

  void send(const Op& op) {
    // An activation is the chunk's output; a gradient is that of its input (the last chunk has no
    // output, but sends the gradient of its input like every other); tied messages are this
    // replica's shard of the tied tensor (its gradient or its new weights; w == 1: the whole).
    const std::int64_t size = planner::is_tied(op.kind)          ? tied_shard_bytes()
                              : op.kind == OpKind::send_gradient ? chunk(op).input_bytes
                                                                 : chunk(op).output_bytes;
    // With t > 1 each GPU of the group sends its 1/t to its counterpart in the peer's group
    // (Megatron's scatter/gather; the tied tensor and SP activations are per-GPU shards already).
    // The message carries GPU 0's piece; the others travel beside it on their own paths, equal
    // flows that end together with it when they share a bottleneck.
    const std::int64_t piece =
        planner::is_tied(op.kind) ? size : planner::message_piece_bytes(w_.plan(), size);
    const auto bytes = std::uint64_t(std::max<std::int64_t>(piece, 1));
    const std::string name = mailbox_name(op.peer, op.kind, me_.rank);
    auto [it, fresh] = channels_.try_emplace(name);
    SendChannel& ch = it->second;
    if (fresh) open_channel(ch, name, op.peer);
    {
      std::unique_lock<sg4::Mutex> lock(*ch.mutex);
      ch.queue.emplace_back(bytes, op_);
      ch.wake->notify_all();
    }
    // A message to another node occupies this rank for the host's own work of sending it (the
    // cluster's send_overhead_*; LogGP's o): the rank goes on after it, the message travels
    // meanwhile. Not compute: the rank's busy time does not count it.
    if (w_.ranks[std::size_t(op.peer)].node != me_.node) {
      const double o = w_.network.send_overhead_time_s(double(piece));
      if (o > 0) {
        sg4::this_actor::sleep_for(o);
        ++w_.timed_ops;
      }
    }
  }

  // The messages of one channel (sender, receiver, kind) leave one after the other, as over MPI's
  // one TCP connection per pair or on one CUDA stream with NCCL: a message starts when the one
  // before it has arrived, not beside it sharing the link. Each channel has a sender actor (the
  // rank's send stream), so the rank never waits for its sends.
  struct SendChannel {
    std::deque<std::pair<std::uint64_t, int>> queue;  // (bytes, op)
    bool closing = false;
    sg4::MutexPtr mutex;
    sg4::ConditionVariablePtr wake;
    sg4::ActorPtr sender;
  };

  void open_channel(SendChannel& ch, const std::string& name, int peer) {
    ch.mutex = sg4::Mutex::create();
    ch.wake = sg4::ConditionVariable::create();
    sg4::Mailbox* box = sg4::Mailbox::by_name(name);
    ch.sender = sg4::Actor::create("send:" + name, me_.host,
                                   [this, &ch, box, peer] { drain(ch, box, peer); });
  }

  void drain(SendChannel& ch, sg4::Mailbox* box, int peer_rank) {
    const RankState& peer = w_.ranks[std::size_t(peer_rank)];
    const int t = int(me_.tp_hosts.size());
    std::vector<sg4::CommPtr> pieces;
    for (;;) {
      std::pair<std::uint64_t, int> message;
      {
        std::unique_lock<sg4::Mutex> lock(*ch.mutex);
        while (ch.queue.empty() && !ch.closing)
          ch.wake->wait(lock);
        if (ch.queue.empty()) return;
        message = ch.queue.front();
        ch.queue.pop_front();
      }
      const auto [bytes, op] = message;
      sg4::CommPtr comm = box->put_async(&kToken, bytes);
      observe_transfer(me_.host, peer.host, double(bytes));
      pieces.clear();
      for (int i = 1; i < t; ++i) {
        pieces.push_back(
            start_flow(me_.tp_hosts[std::size_t(i)], peer.tp_hosts[std::size_t(i)], bytes));
        observe_transfer(me_.tp_hosts[std::size_t(i)], peer.tp_hosts[std::size_t(i)],
                         double(bytes));
      }
      comm->wait();
      for (auto& p : pieces)
        p->wait();
      record(kSend, comm->get_start_time(), comm->get_finish_time(), op);
    }
  }

  void receive(const Op& op) {
    sg4::Mailbox* box = sg4::Mailbox::by_name(mailbox_name(me_.rank, op.kind, op.peer));
    int* data = nullptr;
    sg4::CommPtr comm = box->get_async<int>(&data);
    comm->wait();
    record(kRecv, comm->get_start_time(), comm->get_finish_time(), op_);
  }

  std::int64_t tied_shard_bytes() const {
    const planner::TiedShard sh = planner::tied_shard(me_.tied_bytes, w_.plan().w, me_.replica);
    return sh.end - sh.begin;
  }

  // The members of this stage's data-parallel collectives: GPU i of every replica's TP group, per
  // i (t groups, all at once).
  std::vector<std::vector<Member>> replica_groups() const {
    const int t = w_.plan().t;
    std::vector<std::vector<Member>> groups(static_cast<std::size_t>(t));
    for (int r = 0; r < w_.plan().w; ++r) {
      const RankState& m = w_.ranks[std::size_t(w_.plan().rank_of(me_.stage, r))];
      for (int i = 0; i < t; ++i)
        groups[std::size_t(i)].emplace_back(m.node, m.gpu + i);
    }
    return groups;
  }

  // A tied gather (w > 1): blocks until every replica of the stage has its shard and the last to
  // arrive has all-gathered the tensor among them. Keyed apart from the all-reduce buckets: the
  // gradient's by step (bucket -1), the weights' by version (bucket -2).
  void gather(const Op& op) {
    const bool weights = op.kind == OpKind::gather_tied_weights;
    all_gather(collective(weights ? op.version : op.step, op.chunk, weights ? -2 : -1),
               double(me_.tied_bytes));
  }

  // Blocks until every replica of the stage arrived at `c` and the last to arrive has
  // all-gathered `bytes` (the whole tensor) among them: a ring, which a reduce-scatter of the same
  // bytes takes as long as (named `name`, recorded as op `op`, the current one when -1).
  void all_gather(Collective& c, double bytes, const char* name = "allgather", int op = -1) {
    if (++c.arrived == w_.plan().w) launch(c, name, allgather, replica_groups(), bytes);
    std::unique_lock<sg4::Mutex> lock(*c.mutex);
    while (!c.done)
      c.finished->wait(lock);
    record(kCollective, c.start, c.end, op < 0 ? op_ : op);
  }

  Collective& collective(int step, int chunk, int bucket) {
    Collective& c = w_.collectives[{me_.stage, step, chunk, bucket}];
    if (!c.mutex) {
      c.mutex = sg4::Mutex::create();
      c.finished = sg4::ConditionVariable::create();
    }
    return c;
  }

  // This rank's gradients of the bucket are ready; the last replica to get there starts the
  // all-reduce on its own actor (the collective stream), so compute goes on meanwhile.
  void trigger(int step, int chunk, int bucket) {
    const auto key = std::make_tuple(step, chunk, bucket);
    if (std::find(me_.triggered.begin(), me_.triggered.end(), key) != me_.triggered.end()) return;
    me_.triggered.push_back(key);
    Collective& c = collective(step, chunk, bucket);
    if (++c.arrived < w_.plan().w) return;
    // Each GPU of a TP group all-reduces its own shard with its counterparts in the other
    // replicas: t all-reduces at once.
    const auto groups = replica_groups();
    const double bytes = w_.bucket_bytes[std::size_t(me_.stage * w_.plan().v + chunk)];
    // With the distributed optimizer the executor reduce-scatters the bucket instead: a ring
    // reduce-scatter takes an all-gather's steps and bytes (the parameters' all-gather follows
    // the optimizer step).
    launch(c, "allreduce", w_.plan().distributed_optimizer ? allgather : allreduce, groups, bytes);
  }

  // Runs `collective` over each group at once (the first on the launching actor, the others on
  // actors of their own) on an actor of this rank's host (the collective stream), then marks `c`
  // done and wakes its waiters.
  using GroupCollective = void (*)(const Platform&, const std::vector<Member>&, double);
  void launch(Collective& c, const char* name, GroupCollective collective,
              const std::vector<std::vector<Member>>& groups, double bytes) {
    const Platform* platform = w_.platform;
    sg4::Actor::create(name, me_.host, [&c, name, collective, groups, bytes, platform] {
      run_collective(c, name, collective, groups, bytes, *platform);
    });
  }

  // On the calling actor: `collective` over each group at once (the first here, the others on
  // actors of their own), then `c` marked done and its waiters woken.
  static void run_collective(Collective& c, const char* name, GroupCollective collective,
                             const std::vector<std::vector<Member>>& groups, double bytes,
                             const Platform& platform) {
    c.start = sg4::Engine::get_clock();
    std::vector<sg4::ActorPtr> rings;
    for (std::size_t i = 1; i < groups.size(); ++i)
      rings.push_back(sg4::Actor::create(name, sg4::this_actor::get_host(),
                                         [members = groups[i], collective, bytes, &platform] {
                                           collective(platform, members, bytes);
                                         }));
    collective(platform, groups[0], bytes);
    for (const auto& a : rings)
      a->join();
    c.end = sg4::Engine::get_clock();
    std::unique_lock<sg4::Mutex> lock(*c.mutex);
    c.done = true;
    c.finished->notify_all();
  }

  void optimizer_step(const Op& op) {
    wait_collectives(op.step);
    double opt = 0;
    for (const auto& ch : me_.chunks)
      opt += ch.optimizer_s;
    if (offload_.on())
      offload_.wait_uploads();  // the host ran the step: the device takes the new parameters
    else if (ck_.mutex) {
      chunk_wait(2);  // chunks: the host's Adam steps (the device's ran as their own ops)
      chunk_slot_ = 0;
      ++chunk_step_;
    } else
      compute(opt);
    // The distributed optimizer: each replica updated its 1/w; the stage's replicas all-gather
    // the new version (one weight version of the rank) before anything uses it, as the executor;
    // with overlap_param_gather in pieces behind the next forward, as Megatron.
    if (w_.plan().distributed_optimizer && w_.plan().w > 1) {
      if (w_.plan().overlap_param_gather)
        start_param_gather(op.step);
      else
        all_gather(collective(op.step, 0, -3), double(me_.version_bytes));
    }
    versions_ += 1;  // the step's update becomes a new weight version
    set_versions();
    me_.optimizer_end[std::size_t(op.step)] = sg4::Engine::get_clock();
  }

  // Megatron's --overlap-param-gather: the new parameters are all-gathered in as many pieces as
  // there are gradient buckets, one after the other on the collective stream; the last replica to
  // finish its optimizer step starts them. Keyed (stage, step, 0, -10 - piece).
  int gather_pieces() const { return std::max(1, w_.programs->buckets); }
  Collective& gather_piece(int step, int piece) { return collective(step, 0, -10 - piece); }

  void start_param_gather(int step) {
    gather_step_ = step;
    const int pieces = gather_pieces();
    std::vector<Collective*> cs;
    for (int k = 0; k < pieces; ++k)
      cs.push_back(&gather_piece(step, k));
    if (++cs.front()->arrived < w_.plan().w) return;
    const auto groups = replica_groups();
    const double bytes = double(me_.version_bytes) / pieces;
    const Platform* platform = w_.platform;
    sg4::Actor::create("paramgather", me_.host, [cs, groups, bytes, platform] {
      for (Collective* c : cs)
        run_collective(*c, "paramgather", allgather, groups, bytes, *platform);
    });
  }

  // The first forward after an overlapped parameter gather: piece k of its compute waits for
  // piece k of the parameters (the layers in order, each piece an equal share).
  void forward_behind_gather(double seconds) {
    const int pieces = gather_pieces();
    for (int k = 0; k < pieces; ++k) {
      Collective& c = gather_piece(gather_step_, k);
      {
        std::unique_lock<sg4::Mutex> lock(*c.mutex);
        while (!c.done)
          c.finished->wait(lock);
      }
      record(kCollective, c.start, c.end, op_);
      compute(seconds / pieces);
    }
    gather_step_ = -1;
  }

  void set_versions() {
    if (w_.programs->chunks) return;  // offload chunks: both versions live in the chunks' parts
    const std::int64_t extra = std::max<std::int64_t>(versions_ - 1, 0) * me_.version_bytes;
    allocate(&planner::MemoryBreakdown::weight_versions, extra - me_.memory.now.weight_versions);
  }

  void allocate_static() {
    const planner::MemoryBreakdown& m = w_.rank_static[std::size_t(me_.rank)];
    allocate(&planner::MemoryBreakdown::weights, m.weights);
    allocate(&planner::MemoryBreakdown::gradients, m.gradients);
    allocate(&planner::MemoryBreakdown::optimizer, m.optimizer);
    allocate(&planner::MemoryBreakdown::workspace, m.workspace);
    allocate(&planner::MemoryBreakdown::activations, m.activations);  // message buffers
  }

  void allocate(std::int64_t planner::MemoryBreakdown::*category, std::int64_t bytes) {
    if (bytes == 0) return;
    Ledger& l = me_.memory;
    l.now.*category += bytes;
    const std::int64_t total = l.now.total();
    if (total > l.peak) {
      l.peak = total;
      l.at_peak = l.now;
    }
    GpuMemory& g = w_.gpus[std::size_t(me_.node * w_.platform->gpus_per_node + me_.gpu)];
    g.now += bytes;
    g.peak = std::max(g.peak, g.now);
    if (w_.options.timeline) l.samples.emplace_back(sg4::Engine::get_clock(), total);
  }

  void record(int stream, double start, double end, int op) {
    me_.events.push_back({stream, start, end, op});
  }

  World& w_;
  RankState& me_;
  const planner::Program& program_;
  int waited_through_ = -1;  // the last step whose all-reduces this rank has waited for
  int gather_step_ = -1;     // the step whose overlapped parameter gather a forward must wait for
  std::vector<bool> bucketed_;
  std::map<std::string, SendChannel> channels_;  // by mailbox name (map: stable references)
  std::int64_t versions_ = 1;
  int op_ = 0;
  bool messages_lowered_ = false;  // lower_messages(): until the backward ends
  bool holding_turn_ = false;      // backward(): the device turn is held across its bucket pieces
  OffloadReplay offload_{w_, me_};
  CopyEngine down_, up_;  // activation offload
  sg4::MutexPtr swap_mutex_;
  sg4::ConditionVariablePtr swap_done_;
  std::set<Unit> swapped_out_, downloaded_, uploaded_;
  ChunkEngines ck_;                                // offload chunks
  std::map<std::pair<int, int>, int> ck_gathers_;  // sharded chunks: per (step, chunk) gathers
  std::vector<int> pending_chunks_;  // chunk copies (op indices) waiting for their compute op
  int chunk_slot_ = 0;               // chunks: compute ops of this step (2bw: segment) so far
  int chunk_step_ = 0;               // chunks: the step whose optimizer step ends the segment
};

}  // namespace

void replay(World& world, int rank) {
  Replayer(world, rank).run();
}

}  // namespace pw::sim::detail
