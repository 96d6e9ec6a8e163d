// Internal to exec/cuda: one rank's GPU worker, the CUDA twin of exec/worker.hpp. It interprets
// its program op by op, enqueueing work on streams of its own: compute (forward, recompute,
// backward, optimizer), a send and a recv stream per channel, and all-reduce, ordered by events
// exactly where one op consumes what another stream produced. The host thread waits for the GPU
// once per step (after the optimizer, for the loss and the step's end) and never between ops.
#pragma once

#include <cuda_runtime.h>

#include <deque>
#include <map>
#include <memory>
#include <tuple>
#include <vector>

#include "exec/checkpoint.hpp"
#include "exec/cuda/arena.hpp"
#include "exec/cuda/device_transport.hpp"
#include "exec/cuda/gpt_stage.hpp"
#include "exec/interpret.hpp"
#include "exec/memory.hpp"
#include "exec/run_common.hpp"

namespace pw::exec::cuda::detail {

using exec::detail::Clock;

// A block of the device's arena counted in this rank's MemoryCounter too (the planner's and the
// simulator's per-rank figures; the arena counts the whole device).
class Tensor {
 public:
  Tensor() = default;
  Tensor(DeviceArena& arena, MemoryCounter& counter, Category category, std::int64_t bytes);
  Tensor(Tensor&& o) noexcept
      : block_(std::move(o.block_)), counter_(o.counter_), category_(o.category_) {
    o.counter_ = nullptr;
  }
  Tensor& operator=(Tensor&& o) noexcept;
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;
  ~Tensor();

  template <class T>
  T* as() const {
    return block_.as<T>();
  }
  std::int64_t bytes() const { return block_.bytes(); }

 private:
  void release();
  DeviceBuffer block_;
  MemoryCounter* counter_ = nullptr;
  Category category_ = Category::activations;
};

// An activation or gradient held between ops, with the event after which it is valid (null: it was
// written on the compute stream, which every consumer runs on).
struct Held {
  Tensor tensor;
  cudaEvent_t ready = nullptr;
};

// What the workers of one process share: the step book, the arena, the transport.
struct GpuShared : exec::detail::StepBook {
  DeviceArena* arena = nullptr;
  DeviceTransport* transport = nullptr;
  std::vector<MemoryCounter> counters;  // one per rank of this process
  int device = 0;
};

class CudaWorker {
 public:
  CudaWorker(GpuShared& shared, int rank, MemoryCounter& counter);
  ~CudaWorker();
  CudaWorker(const CudaWorker&) = delete;
  CudaWorker& operator=(const CudaWorker&) = delete;
  // Records the run's time origin on the compute stream (call on every worker, then run()).
  void start();
  void run();
  RankResult result();

 private:
  using Key = std::tuple<int, int, int>;  // (step, microbatch, chunk)
  struct Chunk {
    std::unique_ptr<CudaGptStage> stage;
    StageSizes sizes;     // bf16 elements
    Tensor slots[2];      // bf16 weight versions: slot 0 counted as weights, 1 as versions
    Tensor grads;         // bf16
    Tensor master, m, v;  // fp32 (optimizer)
    std::int64_t tied_offset = -1, tied_size = 0;  // elements; "wte" or "lm_head" across stages
    bool first = false, last = false;
  };
  struct Timed {
    int stream, op;
    cudaEvent_t begin, end;
  };

  // The program's ops, through the op switch the CPU worker shares (exec/interpret.hpp).
  template <class W>
  friend void exec::detail::interpret(W& w, const planner::Op& op);
  void send(const planner::Op& op, Channel channel);  // activation: outputs_, gradient: d_inputs_
  void recv(const planner::Op& op, Channel channel);
  void free_version(const planner::Op& op) { slots_.free_version(op.version); }
  [[noreturn]] void offload(const planner::Op& op);
  void forward(const planner::Op& op);
  void recompute(const planner::Op& op);
  void backward(const planner::Op& op);
  void send(const planner::Op& op, Channel channel, std::map<Key, Held>& from);
  void recv(const planner::Op& op, Channel channel, std::map<Key, Held>& into,
            std::int64_t elements);
  void all_reduce(const planner::Op& op);
  void tied(const planner::Op& op);
  void sum_local_tied();
  void optimizer_step(const planner::Op& op);
  void update(Chunk& c, bf16* target);
  void end_of_step(int step);

  std::vector<ShardTensor> shard_tensors(const std::vector<int>& versions,
                                         std::vector<std::vector<float>>& host);
  void save_checkpoint(int step);
  void load_checkpoint(int step);

  Tensor tensor(Category c, std::int64_t bytes);
  bf16* params(const Chunk& c, int version) const;
  cudaEvent_t event();  // from the pool (timing enabled)
  cudaEvent_t record(cudaStream_t s);
  void wait(cudaStream_t s, cudaEvent_t e);  // no-op for null
  void begin_timed(int stream_id, cudaStream_t s);
  void end_timed(cudaStream_t s);
  // Gives a tensor back once `last_use` has passed the work enqueued so far.
  void retire(Tensor&& t, cudaStream_t last_use);
  void retire(Held&& h, cudaStream_t last_use) { retire(std::move(h.tensor), last_use); }
  void reclaim(bool all);  // frees retired tensors whose event completed (all: wait first)
  // Waits (polled, with the transport's timeout) until the compute stream has passed every tensor
  // retired on it, and frees them: the host then runs at most one op ahead of the GPU, so device
  // memory holds what the CPU's sequential model (and the planner) counts, not several ops' worth.
  void drain_compute(const char* what);
  void resolve_timeline(bool all);  // turns completed op events into timeline intervals
  void synchronize(cudaStream_t s, const std::string& what);

  GpuShared& s_;
  DeviceTransport& transport_;
  int rank_, stage_, replica_;
  MemoryCounter& memory_;
  // A send and a recv stream per channel: NCCL's sends wait for their receiver, so one stream for
  // every send would chain the activation and gradient directions into waits the checker's
  // buffered model does not have; per channel both ends see the same FIFO sequence.
  static constexpr int kChannels = 4;  // activation, gradient, tied, tied_weights
  cudaStream_t compute_ = nullptr, reduce_ = nullptr;
  cudaStream_t send_[kChannels] = {}, recv_[kChannels] = {};
  std::vector<cudaStream_t*> all_streams();
  std::vector<Chunk> chunks_;
  Tensor workspace_, losses_;  // losses_: 2 x m floats (by step parity), on the last stage
  exec::detail::VersionSlots slots_;
  int updates_ = 0;
  cudaEvent_t reduced_ = nullptr;  // after the last all-reduce enqueued (null: none pending)
  // After the last tied-weights send out of each weight slot (stage 0): an update that rewrites
  // the slot waits for it.
  cudaEvent_t slot_sent_[2] = {nullptr, nullptr};
  // w > 1: stage 0's received shard of the head's gradient (zeros elsewhere) until gathered; the
  // last stage's event after a received shard of tied weights, until gathered.
  Held tied_head_;
  cudaEvent_t tied_arrived_ = nullptr;
  std::map<Key, Held> inputs_, stash_, full_, outputs_, d_outputs_, d_inputs_;
  struct Retired {
    Tensor tensor;
    cudaEvent_t done;
    cudaStream_t stream;
  };
  std::deque<Retired> retired_;
  // Messages to this rank itself (d == 1 with several chunks), per channel, in send order.
  std::map<Channel, std::deque<Held>> to_self_;
  std::vector<cudaEvent_t> pool_, all_events_;
  cudaEvent_t origin_ = nullptr;
  std::vector<Timed> pending_;
  Timed open_{};
  std::vector<planner::TimedOp> ops_;
  double busy_s_ = 0;
  int op_ = 0;
};

}  // namespace pw::exec::cuda::detail
