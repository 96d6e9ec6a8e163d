// Internal to exec/: one rank's worker and the state the workers share.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <vector>

#include "exec/checkpoint.hpp"
#include "exec/chunk_book.hpp"
#include "exec/copy_engine.hpp"
#include "exec/data.hpp"
#include "exec/interpret.hpp"
#include "exec/memory.hpp"
#include "exec/offload.hpp"
#include "exec/optimizer_offload.hpp"
#include "exec/run_common.hpp"
#include "exec/runtime.hpp"
#include "exec/stage_compute.hpp"
#include "exec/tied_exchange.hpp"
#include "exec/transport.hpp"
#include "exec/weight_slots.hpp"
#include "planner/program.hpp"

namespace pw::exec::detail {

// The CPU run: the step book plus the transport (in-process between threads, or MPI between
// processes) and a byte counter per rank (each thread or process is its own device).
// Ranks whose threads share one CPU core take turns on it op by op, in the order their compute
// ops became ready (a ticket lock): one op runs to its end before the next starts, as a device
// runs the kernels queued on it, and as the simulator runs ops that share a device
// (docs/formulas.md, "Ranks sharing a device"). Without it the OS scheduler interleaves them
// mid-op in an order the programs do not know.
class CoreQueue {
 public:
  // Waits for the core; throws Error once abort() was called (a rank failed).
  void take() {
    std::unique_lock lock(mutex_);
    const std::uint64_t ticket = next_++;
    ready_.wait(lock, [&] { return aborted_ || serving_ == ticket; });
    if (aborted_) throw Error("the run was aborted while waiting for a shared core");
  }
  void release() {
    {
      std::lock_guard lock(mutex_);
      ++serving_;
    }
    ready_.notify_all();
  }
  void abort() {
    {
      std::lock_guard lock(mutex_);
      aborted_ = true;
    }
    ready_.notify_all();
  }

 private:
  std::mutex mutex_;
  std::condition_variable ready_;
  std::uint64_t next_ = 0, serving_ = 0;
  bool aborted_ = false;
};

struct Shared : StepBook {
  Transport* transport = nullptr;
  // Per device: the queue of the core it shares with others, or null (TrainOptions::cores).
  std::vector<std::shared_ptr<CoreQueue>> core_queues;
  std::vector<MemoryCounter> devices;
  const char* runs_on = "thread";  // in the timeline's labels: "thread" or "process"
  // Called before each op of a rank's program with its index (a test's fault injection); may be
  // empty.
  std::function<void(int rank, int op)> before_op;
};

// The CPU backend trains fp32 models only: an InputError naming the model otherwise.
void check_cpu_model(const models::ModelSpec& model);

// One worker per device: with tensor parallelism (t > 1) the t devices of pipeline rank r
// (device = r * t + TP index, planner/plan.hpp's order) run r's program alike, each with its shard
// of the layers; their point-to-point messages and data-parallel collectives go to the devices of
// the same TP index.
class Worker {
 public:
  Worker(Shared& shared, int device);
  void run();
  RankResult result() const;

 private:
  using Key = std::tuple<int, int, int>;  // (step, microbatch, chunk)
  struct Chunk {
    std::unique_ptr<StageCompute> stage;
    StageSizes sizes;
    Buffer slots[2];     // weight versions: slot 0 counted as weights, slot 1 as weight_versions
    Buffer grads, m, v;  // m, v: the plain optimizer's (the distributed one's are the rank's)
    // Where the optimizer state of the chunk's parameters [own_begin, own_end) (the rank's shard
    // of them; all with the plain optimizer) begins: element own_begin's moments.
    float* m_at = nullptr;
    float* v_at = nullptr;
    std::int64_t base = 0;  // the chunk's offset in the rank's flat parameters (chunks in order)
    std::int64_t own_begin = 0, own_end = 0;
    std::int64_t tied_offset = -1, tied_size = 0;  // "wte" or "lm_head" when shared across stages
    bool first = false, last = false;              // first / last virtual stage
    // A chunk of a stage mixing swapped and recomputed blocks with blocks of each kind
    // (activation offload per layer): which of its blocks recompute, and its stash's pieces.
    bool mixed = false;
    std::vector<bool> recomputed;
    MixedSizes mixed_sizes;
  };

  // Offload (docs/formulas.md section 9). The optimizer's host side of a chunk: its n
  // host-updated parameters (all but the last stage's tied copy; sharded, w > 1: the replica's
  // shard of each tile) as the master copy (the fp32 transfer buffer the new parameters leave
  // from), the gradient accumulator (sharded: the shard's reduced gradient) and the optimizer
  // state, in the host pool; its CPU Adam tiles (one per layer, forward order; shared with the
  // CUDA worker: exec/offload.hpp).
  struct HostChunk {
    std::int64_t n = 0;
    std::vector<Tile> tiles;  // the parameters each tile updates, in the chunk's layout
    // Where tile k's parameters begin in the host buffers: tiles[k].begin unsharded; sharded the
    // shards packed in tile order.
    std::vector<std::int64_t> host_at;
    std::vector<Tile> layers;          // sharded: the whole tiles (the collectives' ranges)
    Buffer master, accumulator, m, v;  // host
    Buffer resident;  // device: the tied tensor's gradient at a tied end (d > 1), summed there
  };
  // A swapped stash (activation offload): on the host between its download and its upload.
  struct Swap {
    Buffer host, device;
    std::int64_t floats = 0;
    CopyEngine::Ticket down = 0, up = 0;
  };
  class TileSink;
  void setup_offload();

  // Offload chunks (PatrickStar; docs/formulas.md section 9, chunks): the stage's parameters and
  // gradients (a gradient half beside the parameters) in the schedule's fixed-size chunks, each
  // on the device (counted by memory_) or in the host pool, and each chunk's Adam state where its
  // optimizer runs (chunks 0 .. K-1 on the device, the rest on the host). With 2bw a chunk holds
  // both live weight versions (version v in part v % 2) and its gradient (part 2), each moved on
  // its own (a unit, ChunkLayout::parts); without, one unit moves parts 0 and 2 together.
  struct DataChunk {
    Buffer part[3];          // chunk_elements each, where the unit holding it is now
    Buffer m, v;             // Adam's state of the replica's part (shard_elements)
    bool on_device[3] = {};  // per unit (one unit: [0])
    CopyEngine::Ticket down[3] = {}, up[3] = {};  // per unit: its last download, upload
    CopyEngine::Ticket adam = 0;                  // its last CPU Adam
    // Sharded chunks (ChunkLayout::sharded, host-Adam): the replica's part of the parameters,
    // always on the host (shard_elements; with 2bw one per version slot, host_part[slot]), and at
    // the optimizer step its gradient's part (downloaded after the reduce-scatter; held until the
    // step's end).
    Buffer host_part[2], grad_part;
  };
  int parts_ = 1;          // ChunkLayout::parts: 3 with 2bw
  int chunk_version_ = 0;  // the weight version of the compute op under way
  // The parts unit `unit` of its chunk moves, and where a version's weights and the gradient are.
  int weight_part(int version) const { return parts_ == 1 ? 0 : version % 2; }
  int gradient_unit() const { return parts_ == 1 ? 0 : 2; }  // the unit holding the gradient
  class ChunkMemory;
  void setup_chunks();
  void chunk(const planner::Op& op);  // the four chunk ops (interpret.hpp)
  // route_chunk_op's device calls (exec/chunk_book.hpp).
  template <class W>
  friend void route_chunk_op(W& w, ChunkBook& book, const planner::Op& op, int at, int rank);
  int chunk_parts() const { return parts_; }
  int chunk_count() const { return int(data_chunks_.size()); }
  bool unit_on_device(int chunk, int unit) const {
    return data_chunks_[std::size_t(chunk)].on_device[unit];
  }
  void download_for_adam(const planner::Op& op);
  void step_host(const planner::Op& op, int chunk);
  void step_device(const planner::Op& op, int chunk);
  void chunk_moment(int layer);  // the pending copies of the next compute op's `layer`
  // run_chunk_moment's device calls (exec/chunk_book.hpp), with the copies below.
  template <class W>
  friend void run_chunk_moment(W& w, ChunkBook& book, int layer);
  void evictions_done(bool) { d2h_->drain(); }  // the step's downloads too
  void uploads_done() { h2d_->drain(); }
  bool part_gathered(int u) const;
  void gather_parts(const std::vector<std::pair<int, int>>& units);
  void chunk_collective(int chunk, int step, bool gather, int op);
  void chunk_update(int chunk, int update);
  CopyEngine::Ticket download_chunk(int c, int op);
  void upload_chunk(int c, int op);
  // Sharded chunks, per unit u (a chunk; with 2bw a version's slot or the gradient part): a drop
  // (the device's buffers freed), the replica's part up (its all-gather follows on the rank's
  // thread: gather_part; with 2bw a gradient part comes up as zeros instead), the gradient's part
  // down at the optimizer step after its reduce-scatter (with 2bw a version's slot is dropped
  // there), and Adam on the replica's part in host memory.
  void drop_chunk(int u);
  void upload_part(int u, int op);
  void gather_part(int u, int op);
  void download_part(int u, int step, int op);
  void part_update(int chunk, int update);
  bool part_only(int chunk) const;  // sharded, with its parameters' part on the host
  DataChunk& sharded_chunk(int u, bool on_device, const char* what);
  void chunk_forward(const planner::Op& op);
  void chunk_forward_blocks(const planner::Op& op, Chunk& c);
  void chunk_recompute(const planner::Op& op);
  void chunk_backward(const planner::Op& op);
  void chunk_optimizer_step(const planner::Op& op);
  void chunk_tied(const planner::Op& op);  // the tied exchange's four ops (w = 1) on the chunks
  // Room among the pipeline messages (d > 1) for `producing` more (a compute op's output, a
  // receive): at most the book's message_buffers(), the planner's count, whose bytes setup_chunks
  // counts for the whole run; the oldest sends in flight are waited for and give up their buffers
  // first.
  void make_message_room(int producing);
  // Each model chunk's flat parameters (or Adam m, v: which 1, 2) gathered from the chunks, and
  // one model chunk's back.
  using Flats = std::vector<std::vector<float>>;  // per model chunk (chunks_)
  Flats gather_chunks(int which, int version = 0) const;
  using PartParams = std::vector<std::vector<float>>;  // per chunk (sharded on the host: whole)
  PartParams gather_parts(int version) const;
  Flats gather_chunks(int which, int version, const PartParams& params) const;
  void scatter_chunks(int which, const Chunk& c, const float* flat, int version = 0);
  bool chunked_ = false;
  // Block recompute on this rank's stage: forward_blocks keeps each layer's input; the recompute
  // op takes the scratch the backward re-makes each layer in.
  bool blocks_ = false;
  std::vector<int> part_gathers_;  // sharded chunks: per unit, its all-gathers in this step
  PartParams final_parts_;         // sharded chunks: gathered after the run's last step
  void offload_op(const planner::Op& op);
  void offload_step(const planner::Op& op);
  float* tied_grad(Chunk& c);  // the tied tensor's gradient (c.tied_offset >= 0)
  void copy_record(int stream, Clock::time_point a, Clock::time_point b, int op);

  // Communication beside compute (exec/README.md, "The device interface"). An event: done once
  // its engine has run the work it was issued with (null engine: done). With a transport that
  // takes calls from several threads (concurrent()), sends run on send_engine_ and the
  // data-parallel collectives on collective_engine_, FIFOs on their own threads as a GPU's send
  // and reduce streams; otherwise (MPI, funneled) inline on the rank's thread, in the same order.
  struct Event {
    CopyEngine* engine = nullptr;
    CopyEngine::Ticket ticket = 0;
    void wait() const {
      if (engine) engine->wait(ticket);
    }
  };
  Event issue(CopyEngine* engine, std::function<void()> work);
  // A point-to-point send of from[key]. Its buffer is held (and counted) while the message is in
  // flight and released, its send waited for, when the second compute slot after the compute op
  // that produced it begins (release_sends: the rule of an activation download's device buffer),
  // so a send overlaps the next compute op and the measured peak is deterministic. An inline send
  // (no engine) keeps its buffer to the same point: one peak for every mode, the planner's.
  void send(const planner::Op& op, Channel channel, std::map<Key, Buffer>& from);
  void release_sends(int compute_op);
  struct InFlight {
    int compute_op;  // the last compute op begun when the send was issued
    Event sent;
    Buffer buffer;
  };
  // Before the rank's thread reads or writes a chunk's gradients: the collectives and the tied
  // gradient's send over them have run.
  void wait_grads(std::size_t chunk);
  std::vector<Event> reduced_, tied_sent_;  // per chunk: the last collective, tied-gradient send

  // The program's ops, through the op switch the CUDA worker shares (interpret.hpp).
  template <class W>
  friend void interpret(W& w, const planner::Op& op);
  void send(const planner::Op& op, Channel channel);  // activation: outputs_, gradient: d_inputs_
  void recv(const planner::Op& op, Channel channel);
  void free_version(const planner::Op& op) { slots_.free_version(op.version); }
  void offload(const planner::Op& op);
  void forward(const planner::Op& op);
  void forward_mixed(const planner::Op& op, Chunk& c);
  void forward_blocks(const planner::Op& op, Chunk& c);
  float timed_compute(const std::function<float()>& op);
  void recompute(const planner::Op& op);
  void backward(const planner::Op& op);
  void all_reduce(const planner::Op& op);
  void reduce_scatter(const planner::Op& op, std::int64_t begin, std::int64_t end, int at);
  // The reduce-scatter's and all-gather's pieces of [a, b) of chunk `chunk` (outside a tied
  // tensor): the shared rule's (exec/offload.hpp, shard_pieces).
  std::vector<ShardPiece> shard_pieces(std::size_t chunk, std::int64_t a, std::int64_t b) const;
  void all_gather(int step, int target);
  std::vector<int> replica_group() const;
  void optimizer_step(const planner::Op& op);
  void tied(const planner::Op& op);
  // The tied exchange, the shared rule's (exec/tied_exchange.hpp); the device's part below.
  friend class TiedExchange<Worker>;
  TiedExchange<Worker> tied_{*this};
  void tied_gradient_out(const planner::Op& op, planner::TiedShard sh);
  void tied_gradient_in(const planner::Op& op, planner::TiedShard sh, bool hold);
  void tied_gradient_gather(const planner::Op& op, planner::TiedShard sh);
  void tied_weights_out(const planner::Op& op, planner::TiedShard sh);
  void tied_weights_in(const planner::Op& op, planner::TiedShard sh, bool hold);
  void tied_weights_gather(const planner::Op& op, planner::TiedShard sh);
  void sum_local_tied();
  ShardLayout shard_layout(const std::vector<int>& versions, bool whole) const;
  ShardLayout shard_tensors(const std::vector<int>& versions);
  void save_checkpoint(int step);
  void load_checkpoint(int step);
  void update(Chunk& c, int source, int target);
  const float* params(const Chunk& c, int version) const;
  void samples(const planner::Op& op, std::vector<std::int32_t>& tokens,
               std::vector<std::int32_t>& targets) const {
    microbatch_samples(s_, replica_, op.step, op.microbatch, tokens, targets);
  }
  Buffer to_buffer(std::vector<float> data);

  Shared& s_;
  int device_;  // this worker's device: its transport rank, memory, checkpoint shard and result
  int rank_, tp_, stage_, replica_;  // its pipeline rank (program), TP index, stage, replica
  int t_;
  int tp_calls_ = 0;
  std::vector<TpComm> tp_comms_;  // per chunk (t > 1)  // TP collectives so far (the same sequence
                                  // on every member of the group)
  int device_of(int rank) const { return rank * t_ + tp_; }  // pipeline rank -> device, my TP index
  MemoryCounter* memory_;
  BufferPool pool_;  // the activations' storage, reused (outlives every buffer below)
  std::vector<Chunk> chunks_;
  Buffer workspace_;
  bool sharded_ = false;      // the distributed optimizer (w > 1): this rank updates its shard only
  Buffer shard_m_, shard_v_;  // its optimizer state: ceil(P / w) floats each
  // Stage 0, w > 1: the head's gradient shards until gathered (with offload chunks, the gathered
  // gradient until the wte chunk's step adds it to its part: chunk_update).
  std::vector<float> tied_head_;
  // The weight slots and the reads their writes wait for, the shared rule's
  // (exec/weight_slots.hpp); the device's part: allocate_slot, before_slot_write, retire_reader.
  friend class WeightSlots<Worker, Event>;
  WeightSlots<Worker, Event> slots_{*this};
  void allocate_slot(int slot);
  void before_slot_write(int slot, SlotWriter writer, Event last_send);
  void retire_reader(Event) {}  // a later send on the same engine implies it
  int updates_ = 0;
  // stash_: the stash a forward keeps (the stage input with full recompute; a mixed chunk's
  // swapped layers), full_: a recompute's (a mixed chunk's recomputed layers), checkpoints_: a
  // mixed chunk's runs' inputs.
  std::map<Key, Buffer> inputs_, stash_, full_, checkpoints_, outputs_, d_outputs_, d_inputs_;
  double busy_s_ = 0;
  CoreQueue* core_ = nullptr;  // the core it shares with other ranks' threads, if it does
  bool holding_core_ = false;  // its turn on core_: from a compute op through the sends after it
  void take_core();
  void release_core();
  double tp_wait_s_ = 0;  // inside compute ops: the TP collectives (not counted as busy)
  int op_ = 0;            // index of the op being run
  std::vector<planner::TimedOp> ops_;  // the timeline
  void record(int stream, Clock::time_point a, Clock::time_point b);

  // Offload. The host pool's byte count, the bytes each copy engine moved, the state above.
  bool offload_optimizer_ = false, swaps_ = false;
  // ZeRO-Offload over w > 1 replicas (Plan::offload_sharded): the gradients stay on the device for
  // the reduce-scatter, each replica's shard of every tile goes to its host once per step.
  bool offload_sharded_ = false;
  MemoryCounter host_;
  std::vector<HostChunk> host_chunks_;
  Buffer grad_tiles_[2];  // device: a layer's gradients filling, the other's on the copy engine
  // Optimizer offload's ordering, the shared rule's (exec/optimizer_offload.hpp); the device's part
  // below (mark .. upload_tile). A mark is an engine's ticket (the compute's: none, it ran).
  using Mark = Event;
  friend class OptimizerOffload<Worker, WeightSlots<Worker, Event>>;
  OptimizerOffload<Worker, WeightSlots<Worker, Event>> optimizer_{*this, slots_};
  std::vector<Event> offload_waits_[4];  // per Engine: the marks its next work waits for
  Event mark(Engine e) const;
  void after(Engine e, Event m);
  void drop(Event) {}
  CopyEngine* engine_of(Engine e) const;  // the compute: none
  void issue_after(Engine e, std::function<void()> work);
  float* zero_tile(int buffer, std::int64_t n);
  float* tile_at(int buffer) { return grad_tiles_[buffer].data(); }
  void stream_tile(std::size_t chunk, int buffer, Tile t, const std::vector<Tile>& ranges, int op);
  void gradient_sums_done(std::size_t chunk) { wait_grads(chunk); }
  bool keeps_tied_gradient(std::size_t chunk) const;
  void download_tied_gradient(std::size_t chunk, int op);
  void download_gradient_shards(std::size_t chunk, int op);
  void host_adam(std::size_t chunk, int tile, int update, int op);
  void upload_tile(std::size_t chunk, int tile, int slot, int op);
  BufferPool host_buffers_;  // the swapped stashes' host storage, reused
  // The swapped stashes, their life the shared rule's (exec/offload.hpp, Swaps); the device's part
  // below (swap_out .. swap_back).
  friend class Swaps<Worker, Swap, Key>;
  Swaps<Worker, Swap, Key> swapped_{*this};
  void swap_out(Swap& sw, const Key& key, int op);
  void swap_done(Swap& sw);
  void swap_in(const std::shared_ptr<Swap>& sw, int op);
  bool swapped_in(const Swap& sw) const { return sw.up != 0; }
  void swap_back(Swap& sw, const Key& key);
  int compute_ops_ = 0;  // forwards and backwards begun
  std::atomic<std::int64_t> bytes_out_{0}, bytes_in_{0}, activation_bytes_out_{0},
      activation_bytes_in_{0};
  // Chunks with 2bw: the bytes of copies issued in the run's first or last segment.
  std::atomic<std::int64_t> edge_bytes_out_{0}, edge_bytes_in_{0};
  bool edge_segment() const;  // the copies issued now belong to the first or last segment
  mutable std::mutex copy_ops_mutex_;
  std::vector<planner::TimedOp> copy_ops_;  // the copy engines' and host CPU's intervals
  // Offload chunks (after pool_, host_ and host_buffers_: destroyed before them).
  std::shared_ptr<const planner::ChunkSchedule> schedule_;
  std::vector<DataChunk> data_chunks_;
  // Where the stage's tensors live in the chunks, each layer's activation bytes, the pipeline
  // messages the plan counts, the next compute op's copies: the shared rule's
  // (exec/chunk_book.hpp).
  ChunkBook book_;
  double copy_wait_s_ = 0;  // inside compute ops: waiting for the moments' copies (not busy)
  std::deque<InFlight> in_flight_;  // sends' buffers (after pool_: destroyed before it)
  // Last: destroyed first, while what their work touches still lives.
  std::unique_ptr<CopyEngine> d2h_, h2d_, host_cpu_, send_engine_, collective_engine_;
};

}  // namespace pw::exec::detail
