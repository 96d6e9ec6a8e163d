// Internal to exec/cuda: one rank's GPU worker, the CUDA twin of exec/worker.hpp. It interprets
// its program op by op, enqueueing work on streams of its own: compute (forward, recompute,
// backward, optimizer), a send and a recv stream per channel, and all-reduce (with offload also a
// device-to-host, a host-to-device and a host stream), ordered by events exactly where one op
// consumes what another stream produced. The host thread waits for the GPU once per step (after
// the optimizer, for the loss and the step's end) and never between ops, except for a swapped
// stash's download at its release point (as the CPU worker waits there).
#pragma once

#include <cuda_runtime.h>

#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <tuple>
#include <vector>

#include "exec/checkpoint.hpp"
#include "exec/chunk_book.hpp"
#include "exec/cuda/arena.hpp"
#include "exec/cuda/device_transport.hpp"
#include "exec/cuda/gpt_stage.hpp"
#include "exec/cuda/optimizer.cuh"
#include "exec/interpret.hpp"
#include "exec/memory.hpp"
#include "exec/offload.hpp"
#include "exec/optimizer_offload.hpp"
#include "exec/run_common.hpp"
#include "exec/tied_exchange.hpp"
#include "exec/weight_slots.hpp"

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

// Pinned host memory (cudaHostAlloc: the copy engines' DMA reads and writes it while the host goes
// on), counted in a MemoryCounter (the rank's host pool) while it lives.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  PinnedBuffer(MemoryCounter& counter, Category category, std::int64_t bytes);
  PinnedBuffer(PinnedBuffer&& o) noexcept
      : data_(o.data_), bytes_(o.bytes_), counter_(o.counter_), category_(o.category_) {
    o.data_ = nullptr;
    o.counter_ = nullptr;
  }
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  ~PinnedBuffer();

  template <class T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  std::int64_t bytes() const { return bytes_; }

 private:
  void release();
  void* data_ = nullptr;
  std::int64_t bytes_ = 0;
  MemoryCounter* counter_ = nullptr;
  Category category_ = Category::activations;
};

// An activation or gradient held between ops, with the event after which it is valid (null: it was
// written on the compute stream, which every consumer runs on).
struct Held {
  Tensor tensor;
  cudaEvent_t ready = nullptr;
};

// Takes the tensor of `key` out of `from`, or throws naming the rank and `what`.
Held take(std::map<std::tuple<int, int, int>, Held>& from, const std::tuple<int, int, int>& key,
          const char* what, int rank);

// The run's AdamW settings as the optimizer kernel takes them.
AdamWParams adamw_params(const TrainOptions& o);

// What the workers of one process share: the step book, the arena, the transport.
struct GpuShared : exec::detail::StepBook {
  DeviceArena* arena = nullptr;
  DeviceTransport* transport = nullptr;
  std::vector<MemoryCounter> counters;  // one per rank of this process
  int device = 0;
};

class CudaWorker {
 public:
  // One worker per device: with tensor parallelism (t > 1) the t devices of pipeline rank r (device
  // = r * t + TP index, the plan's order) run r's program alike, each with its shard of the layers;
  // their messages and data-parallel collectives go to the devices of the same TP index.
  CudaWorker(GpuShared& shared, int device, MemoryCounter& counter);
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
    Tensor master, m, v;  // fp32 (optimizer); the distributed optimizer's: shard_master_ etc.
    std::int64_t tied_offset = -1, tied_size = 0;  // elements; "wte" or "lm_head" across stages
    bool first = false, last = false;
    std::int64_t base = 0;  // its first parameter among the rank's (the chunks' in order)
    // The parameters [own_begin, own_end) whose optimizer state this rank keeps on the device:
    // all, or under the distributed optimizer its shard of them (shard_starts' rule), with that
    // state at master_at, m_at, v_at (v_at null for SGD; none under optimizer offload).
    std::int64_t own_begin = 0, own_end = 0;
    float *master_at = nullptr, *m_at = nullptr, *v_at = nullptr;
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
  void offload(const planner::Op& op);
  void forward(const planner::Op& op);
  void recompute(const planner::Op& op);
  void backward(const planner::Op& op);
  void send(const planner::Op& op, Channel channel, std::map<Key, Held>& from);
  void recv(const planner::Op& op, Channel channel, std::map<Key, Held>& into,
            std::int64_t elements);
  void all_reduce(const planner::Op& op);
  // The distributed optimizer (ZeRO-1, w > 1; the CPU worker's rules, exec/run_common.hpp): each
  // bucket's gradients reduce-scattered by the shard rule (bucket_pieces), the update of the
  // rank's shard, then every chunk's new version all-gathered into the target slot.
  void setup_shards(const std::vector<std::vector<float>>& initial);
  void reduce_scatter(Chunk& c, std::int64_t begin, std::int64_t end);
  void all_gather(int target);
  // The distributed optimizer's collectives' pieces of [a, b) of chunk `c` (exec/offload.hpp).
  std::vector<exec::detail::ShardPiece> shard_pieces(const Chunk& c, std::int64_t a,
                                                     std::int64_t b) const;
  std::vector<int> replica_group() const;
  void tied(const planner::Op& op);
  // The tied exchange, the shared rule's (exec/tied_exchange.hpp); the device's part below.
  friend class exec::detail::TiedExchange<CudaWorker>;
  exec::detail::TiedExchange<CudaWorker> tied_{*this};
  void tied_gradient_out(const planner::Op& op, planner::TiedShard sh);
  void tied_gradient_in(const planner::Op& op, planner::TiedShard sh, bool hold);
  void tied_gradient_gather(const planner::Op& op, planner::TiedShard sh);
  void tied_weights_out(const planner::Op& op, planner::TiedShard sh);
  void tied_weights_in(const planner::Op& op, planner::TiedShard sh, bool hold);
  void tied_weights_gather(const planner::Op& op, planner::TiedShard sh);
  void sum_local_tied();
  void optimizer_step(const planner::Op& op);
  void update(Chunk& c, bf16* target);
  void end_of_step(int step);

  // Offload (docs/formulas.md section 9; the CPU worker's rules, exec/offload.hpp): gradients
  // leave the device layer by layer on the device-to-host stream into the pinned transfer buffer
  // and are added into the host's fp32 accumulator there (a host function on that stream, in
  // stream order); CPU Adam (exec/optimizer.cpp, the CPU worker's code) runs tile by tile as host
  // functions on the host stream after the step's gradient copies, rounding the new master
  // weights into the transfer buffer; each tile goes back on the host-to-device stream after its
  // Adam; swapped stashes go out and back on the same two streams. Every dependency is an event.
  struct HostChunk {
    // The host layout (exec/offload.hpp, host_layout): unsharded the host-updated parameters
    // [0, n) at their own offsets; sharded (w > 1) the replica's part of each tile, packed.
    std::int64_t n = 0;
    std::vector<exec::detail::Tile> tiles;
    std::vector<std::int64_t> host_at;       // where tile k begins in master, m, v, transfer
    std::vector<exec::detail::Tile> layers;  // sharded: the whole tiles (the collectives' ranges)
    Buffer master, accumulator, m, v;        // host fp32 (exec/memory.hpp's counted buffers)
    PinnedBuffer transfer;                   // pinned bf16: gradients arrive, new parameters leave
    Tensor resident;  // device: the tied tensor's bf16 gradient at a tied end, summed there
  };
  // A swapped stash: on the host between its download and its upload.
  struct Swap {
    Tensor device;
    void* host = nullptr;  // from pinned_free_
    std::int64_t bytes = 0;
    cudaEvent_t down = nullptr, up = nullptr;
  };
  class TileSink;
  void setup_offload(const std::vector<std::vector<float>>& initial);
  void offload_step(const planner::Op& op);
  bf16* tied_grad(Chunk& c);  // the tied tensor's gradient (c.tied_offset >= 0)
  // Zeroes n bf16 values on the compute stream: device memory, or with chunks the pinned host
  // block (a host function in the stream's order).
  void zero_on_compute(bf16* at, std::int64_t n);
  // Runs `work` on the host, in `stream`'s order (cudaLaunchHostFunc); it must not call CUDA.
  void host_function(cudaStream_t stream, std::function<void()> work);
  // Enqueues on `stream` between two events, timed as program op `op` on the timeline's
  // `stream_id` (beside an open compute interval).
  void timed(int stream_id, cudaStream_t stream, int op, const std::function<void()>& enqueue);
  // The swapped stashes, their life the shared rule's (exec/offload.hpp, Swaps): the device's
  // part, on the copy streams.
  void swap_out(Swap& sw, const Key& key, int op);
  void swap_done(Swap& sw);
  void swap_in(const std::shared_ptr<Swap>& sw, int op);
  bool swapped_in(const Swap& sw) const { return sw.up != nullptr; }
  void swap_back(Swap& sw, const Key& key);
  bool reclaim_retired();  // waits for the oldest retired block and frees it; false: none
  // Waits on the host (polled, with the transport's timeout and abort) for `e`.
  void host_wait(cudaEvent_t e, const char* what);
  // Pinned host blocks of swapped stashes, reused by size; each with the event after its last
  // reader (an upload), which a download into it waits for.
  void* take_pinned(std::int64_t bytes, cudaStream_t writer);
  void give_pinned(void* block, std::int64_t bytes, cudaEvent_t last_read);

  ShardLayout shard_tensors(const std::vector<int>& versions,
                            std::vector<std::vector<float>>& host);
  void save_checkpoint(int step);
  void load_checkpoint(int step);
  // Offload chunks: the shard's tensors (each model chunk's versions, then master, m, v, each
  // whole) read out of the chunks (`save`) or written into them, wherever each tensor and its
  // chunk's state are (every stream idle).
  void chunk_checkpoint(const ShardLayout& shard, bool save);

  Tensor tensor(Category c, std::int64_t bytes);
  // Activations, messages and staging copies: counted, or with chunks (whose book counts the
  // activations and messages as the planner does) from uncounted_.
  Tensor transient(Category c, std::int64_t bytes);
  bf16* params(const Chunk& c, int version) const;
  cudaEvent_t event();  // from the pool (timing enabled)
  cudaEvent_t record(cudaStream_t s);
  void wait(cudaStream_t s, cudaEvent_t e);                      // no-op for null
  void begin_timed(int stream_id, cudaStream_t s, int op = -1);  // op -1: the current op
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
  int device_;         // its transport rank, memory, checkpoint shard and result
  int rank_, tp_, t_;  // its pipeline rank (program), TP index, the TP degree
  int stage_, replica_;
  int device_of(int rank) const { return rank * t_ + tp_; }  // pipeline rank -> device, my TP index
  MemoryCounter& memory_;
  // A send and a recv stream per channel: NCCL's sends wait for their receiver, so one stream for
  // every send would chain the activation and gradient directions into waits the checker's
  // buffered model does not have; per channel both ends see the same FIFO sequence.
  static constexpr int kChannels = 4;  // activation, gradient, tied, tied_weights
  cudaStream_t compute_ = nullptr, reduce_ = nullptr;
  // Offload's copy streams (device to host, host to device) and the host stream of CPU Adam.
  cudaStream_t d2h_ = nullptr, h2d_ = nullptr, host_stream_ = nullptr;
  cudaStream_t send_[kChannels] = {}, recv_[kChannels] = {};
  std::vector<cudaStream_t*> all_streams();
  std::vector<Chunk> chunks_;
  bool sharded_ = false;                     // the distributed optimizer, w > 1
  std::int64_t flat_ = 0;                    // the rank's parameters, every chunk's
  Tensor shard_master_, shard_m_, shard_v_;  // fp32, ceil(flat_ / w) each: the planner's figure
  Tensor workspace_, losses_;  // losses_: 2 x m floats (by step parity), on the last stage
  // The weight slots and the reads their writes wait for (the last tied-weights send out of each,
  // stage 0), the shared rule's (exec/weight_slots.hpp); the device's part: allocate_slot,
  // before_slot_write, retire_reader.
  friend class exec::detail::WeightSlots<CudaWorker, cudaEvent_t>;
  exec::detail::WeightSlots<CudaWorker, cudaEvent_t> slots_{*this};
  void allocate_slot(int slot);
  void before_slot_write(int slot, exec::detail::SlotWriter writer, cudaEvent_t last_send);
  void retire_reader(cudaEvent_t sent);
  int updates_ = 0;
  cudaEvent_t reduced_ = nullptr;  // after the last all-reduce enqueued (null: none pending)
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

  // Offload's state (above). Host work waiting to run, freed once its event has passed.
  bool offload_optimizer_ = false, swaps_ = false;
  bool offload_sharded_ = false;  // optimizer offload with w > 1: ZeRO-Offload's shards
  MemoryCounter host_;  // the host pool: optimizer state, accumulator, transfer, swapped stashes
  std::vector<HostChunk> host_chunks_;
  Tensor grad_tiles_[2];  // device: a layer's gradients filling, the other's on the copy stream
  // Optimizer offload's ordering, the shared rule's (exec/optimizer_offload.hpp); the device's part
  // below (mark .. upload_tile): a mark is an event recorded on the engine's stream.
  using Mark = cudaEvent_t;
  using Engine = exec::detail::Engine;
  using Slots = exec::detail::WeightSlots<CudaWorker, cudaEvent_t>;
  friend class exec::detail::OptimizerOffload<CudaWorker, Slots>;
  exec::detail::OptimizerOffload<CudaWorker, Slots> optimizer_{*this, slots_};
  cudaStream_t stream_of(Engine e) const;
  cudaEvent_t mark(Engine e) { return record(stream_of(e)); }
  void after(Engine e, cudaEvent_t m) { wait(stream_of(e), m); }
  void drop(cudaEvent_t m) {
    if (m) pool_.push_back(m);
  }
  bf16* zero_tile(int buffer, std::int64_t n);
  bf16* tile_at(int buffer) { return grad_tiles_[buffer].as<bf16>(); }
  void stream_tile(std::size_t chunk, int buffer, exec::detail::Tile t,
                   const std::vector<exec::detail::Tile>& ranges, int op);
  void gradient_sums_done(std::size_t) { wait(compute_, reduced_); }
  bool keeps_tied_gradient(std::size_t chunk) const;
  void download_tied_gradient(std::size_t chunk, int op);
  void download_gradient_shards(std::size_t chunk, int op);
  void host_adam(std::size_t chunk, int tile, int update, int op);
  void upload_tile(std::size_t chunk, int tile, int slot, int op);
  friend class exec::detail::Swaps<CudaWorker, Swap, Key>;
  exec::detail::Swaps<CudaWorker, Swap, Key> swapped_{*this};
  int compute_ops_ = 0;  // forwards and backwards begun
  struct PinnedBlock {
    void* data;
    cudaEvent_t last_read;
  };
  std::map<std::int64_t, std::vector<PinnedBlock>> pinned_free_;
  std::vector<void*> pinned_all_;  // every swap block, freed at the end
  struct HostWork {
    std::unique_ptr<std::function<void()>> work;
    cudaEvent_t done;
  };
  std::deque<HostWork> host_work_;
  std::int64_t bytes_out_ = 0, bytes_in_ = 0, activation_bytes_out_ = 0, activation_bytes_in_ = 0;

  // Offload chunks (PatrickStar; docs/formulas.md section 9, chunks): the CPU worker's rules
  // (exec/worker_chunks.cpp, the shared chunk book exec/chunk_book.hpp) on the device. The stage's
  // bf16 parameters and gradients live in the schedule's fixed-size chunks, each unit (a whole
  // chunk: its weights and gradient halves; with 2bw each of its three parts) in device tensors
  // while on the device, else in the chunk's pinned host block (allocated once, counted in the
  // host pool while the unit is there); each chunk's fp32 master, Adam m and v (its first
  // shard_elements) on the device for chunks 0 .. K-1 (device Adam, the existing kernel), else in
  // host memory (CPU Adam, exec/optimizer.cpp, on the host stream). Copies run on the two copy
  // streams, each after the compute stream's work so far (a moment's evictions end before its
  // uploads take their memory: the host waits for them, as the CPU worker drains its engine);
  // the compute stream waits for a layer's uploads. A stage's activations, messages and scratch
  // come from the arena uncounted; the book's moments count them, as the planner does.
  // What it does not run yet (prepare_run refuses it in one line): w > 1, m = 1.
  struct DataChunk {
    Tensor part[3];          // device bf16, chunk_elements each, while its unit is on the device
    PinnedBuffer host;       // bf16 parts 0 .. 2 at part * chunk_elements (pinned, UVA-mapped)
    bool on_device[3] = {};  // per unit (flush schedules: unit 0 only)
    cudaEvent_t down[3] = {}, up[3] = {};  // the unit's last download, upload (null: none)
    cudaEvent_t adam = nullptr;            // after its last CPU Adam
    Tensor master_d, m_d, v_d;             // fp32 state, device-resident chunks (K)
    Buffer master_h, m_h, v_h;             // fp32 state, host-Adam chunks
  };
  class ChunkMemory;
  bool chunked_ = false;
  int parts_ = 1;          // ChunkLayout::parts: 3 with 2bw
  int chunk_version_ = 0;  // the weight version of the compute op under way
  std::shared_ptr<const planner::ChunkSchedule> schedule_;
  std::vector<DataChunk> data_chunks_;
  exec::detail::ChunkBook book_;
  MemoryCounter uncounted_;  // the arena blocks the book counts instead (activations, messages)
  std::int64_t edge_bytes_out_ = 0, edge_bytes_in_ = 0;  // 2bw: the run's first and last segments
  int weight_part(int version) const { return parts_ == 1 ? 0 : version % 2; }
  int gradient_unit() const { return parts_ == 1 ? 0 : 2; }
  bool edge_segment() const;
  void setup_chunks(const std::vector<std::vector<float>>& initial);
  void chunk(const planner::Op& op);  // the four chunk ops (interpret.hpp)
  // route_chunk_op's device calls (exec/chunk_book.hpp).
  template <class W>
  friend void exec::detail::route_chunk_op(W& w, exec::detail::ChunkBook& book,
                                           const planner::Op& op, int at, int rank);
  int chunk_parts() const { return parts_; }
  int chunk_count() const { return int(data_chunks_.size()); }
  bool unit_on_device(int chunk, int unit) const {
    return data_chunks_[std::size_t(chunk)].on_device[unit];
  }
  void download_for_adam(const planner::Op& op) { download_chunk(op.bucket, op_); }
  void step_host(const planner::Op& op, int chunk);    // CPU Adam on the host stream
  void step_device(const planner::Op& op, int chunk);  // the optimizer kernel
  void chunk_moment(int layer);
  // run_chunk_moment's device calls (exec/chunk_book.hpp): no sharded chunks here (a part's drop
  // or upload throws; prepare_run refuses such plans first).
  template <class W>
  friend void exec::detail::run_chunk_moment(W& w, exec::detail::ChunkBook& book, int layer);
  void download_chunk(int u, int op);
  void upload_chunk(int u, int op);
  void evictions_done(bool any);
  void uploads_done() {}  // the compute stream waits for each tensor's (after_chunk_moves)
  void drop_chunk(int u);
  void upload_part(int u, int op);
  bool part_gathered(int) const { return false; }
  void gather_parts(const std::vector<std::pair<int, int>>&) {}
  // A compute op's view of the chunks (null without chunks): its weight version set, its
  // messages checked (`producing`: the one it makes), each layer's copies and activations on the
  // way (ChunkBook's `pass`).
  using ChunkPass = exec::detail::ChunkBook::Pass;
  std::unique_ptr<DeviceLayerMemory> chunk_memory(ChunkPass pass, const planner::Op& op,
                                                  int producing);
  void chunk_optimizer_step(const planner::Op& op);
  void check_messages(int producing);  // at most the book's message buffers held
  // Where the tensor at the rank's flat offset `flat` is now: its unit's device part or its place
  // in the pinned host block (UVA: kernels and copies take either), in part `part`.
  bf16* chunk_tensor(std::int64_t flat, int part);
  // The compute stream waits for every copy and CPU Adam of the chunk holding `flat` so far.
  void after_chunk_moves(std::int64_t flat);
  std::vector<std::vector<float>> chunk_weights();  // per model chunk, the newest version
  // Part `part` of a chunk in its pinned host block (flush schedules: parts 0 and 2 only).
  bf16* host_part(DataChunk& d, int part) const;
};

}  // namespace pw::exec::cuda::detail
