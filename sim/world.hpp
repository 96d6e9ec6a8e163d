// Internal to sim/: the shared state of one simulation (ranks, memory ledgers, collectives).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include <simgrid/s4u.hpp>

#include "planner/cost_model.hpp"
#include "planner/program.hpp"
#include "planner/timeline.hpp"
#include "sim/platform.hpp"
#include "sim/simulator.hpp"

namespace pw::sim::detail {

namespace sg4 = simgrid::s4u;

// Streams as the timeline numbers them (planner/timeline.hpp).
enum Stream {
  kCompute = planner::kComputeStream,
  kSend = planner::kSendStream,
  kRecv = planner::kRecvStream,
  kCollective = planner::kCollectiveStream,
  kTensorParallel = planner::kTensorParallelStream,
  kCopyOut = planner::kCopyOutStream,
  kCopyIn = planner::kCopyInStream,
  kHostCpu = planner::kHostStream
};

struct Event {
  int stream = kCompute;
  double start = 0;
  double end = 0;
  int op = 0;  // index into the rank's program
};

// One rank's memory, by category, at every allocation and free the program implies.
struct Ledger {
  planner::MemoryBreakdown now;
  planner::MemoryBreakdown at_peak;
  std::int64_t peak = 0;
  std::vector<std::pair<double, std::int64_t>> samples;  // (time, total), with a timeline
};

struct GpuMemory {
  std::int64_t now = 0;
  std::int64_t peak = 0;
};

// One all-reduce bucket of one chunk of one stage in one step, over the stage's w replicas.
struct Collective {
  int arrived = 0;
  bool done = false;
  double start = 0;
  double end = 0;
  sg4::MutexPtr mutex;
  sg4::ConditionVariablePtr finished;
};

struct RankState {
  int rank = 0, stage = 0, replica = 0, node = 0, gpu = 0;
  bool shares_gpu = false;  // another rank runs on the same GPU: compute shares it (execute)
  sg4::MutexPtr turn;       // SimOptions::device_turns: the shared GPU's, held by one op at a time
  sg4::Host* host = nullptr;
  std::vector<planner::ChunkCost> chunks;  // by chunk
  // offload chunks with t > 1: one layer of each kind (its TP collectives, run moment by moment)
  std::map<models::LayerKind, planner::ChunkCost> layer_costs;
  std::int64_t version_bytes = 0;  // one weight version of this rank
  std::int64_t tied_bytes = 0;     // the tied tensor (its gradient or weights)
  planner::Recompute recompute = planner::Recompute::none;
  // The message buffers a backward (and its recompute op) runs without: the held count's bytes
  // less planner::backward_message_buffers' (one buffer on 1F1B's and 2BW's last stage, else 0).
  std::int64_t backward_message_drop = 0;
  std::vector<sg4::Host*> tp_hosts;  // the TP group's GPUs (this rank's host first)
  double tp_latency_s = 0;           // latency of one step of the TP group's ring
  Ledger memory;
  // Optimizer offload (plan.offload != none): the closed form's per-rank figures (tile sizes,
  // host memory), the node's CPU host and Adam rate, and the bytes the replay moved.
  planner::RankOffload offload;
  sg4::Host* cpu = nullptr;
  double cpu_adam_params_per_s = 0;  // the node's, shared by its ranks' concurrent tiles
  std::int64_t copied_out_bytes = 0, copied_in_bytes = 0;
  // Activation offload (plan.swaps(stage)): the swapped bytes on the host now and at their peak.
  std::int64_t swap_host_now = 0, swap_host_peak = 0, swapped_bytes = 0;
  // With a timeline: (time, the rank's host bytes: offload's static ones plus the swapped stashes)
  // at every change.
  std::vector<std::pair<double, std::int64_t>> host_samples;
  // offload chunks: whole-chunk copies the replay ran (all steps). With 2bw the first and last
  // segments (between optimizer steps) move other amounts than the steady ones: theirs also here.
  std::int64_t chunk_uploads = 0, chunk_downloads = 0;
  // Sharded chunks: of those, the replica's parts; the drops (no bytes, not downloads); with 2bw
  // the zero fills (no bytes, not uploads); with 2bw the steady segments' only.
  std::int64_t chunk_part_uploads = 0, chunk_part_downloads = 0, chunk_drops = 0,
               chunk_zero_fills = 0;
  std::int64_t edge_in_bytes = 0, edge_out_bytes = 0, edge_uploads = 0, edge_downloads = 0;
  std::vector<Event> events;                         // every op that took time
  std::vector<double> optimizer_end;                 // per step
  std::vector<std::tuple<int, int, int>> triggered;  // (step, chunk, bucket) started
};

class LinkCounter {
 public:
  void count(sg4::Host* src, sg4::Host* dst, double bytes);
  std::vector<LinkStat> stats(const Platform& platform, double simulated_s) const;

 private:
  std::map<std::pair<sg4::Host*, sg4::Host*>, std::vector<sg4::Link*>> routes_;
  std::map<const sg4::Link*, double> bytes_;
};

struct World {
  const planner::Programs* programs = nullptr;
  const Platform* platform = nullptr;
  SimOptions options;
  std::vector<RankState> ranks;
  std::vector<GpuMemory> gpus;  // node * gpus_per_node + gpu
  // (stage, step, chunk, bucket); the tied gathers: (stage, step, 0, -1) and (stage, version, v-1,
  // -2)
  std::map<std::tuple<int, int, int, int>, Collective> collectives;
  std::vector<double> bucket_bytes;  // per (stage * v + chunk): gradient bytes of one bucket
  // weights, gradients, optimizer, workspace and the message buffers (activations)
  std::vector<planner::MemoryBreakdown> rank_static;
  std::int64_t timed_ops = 0;    // sleeps the actors ran
  std::int64_t dtype_bytes = 2;  // of the model's compute dtype
  LinkCounter links;
  clusters::Network network;  // the cluster's: a send's occupancy of its rank (send_overhead_*)

  const planner::Plan& plan() const { return programs->plan; }
};

// One copy between a rank's device memory and its node's host memory, or one CPU Adam step: with
// t > 1 each GPU of the TP group moves (updates) its own shard, all at once, each over its own
// host link (as its own job on the node's CPU); done when every part is.
struct HostWork {
  std::vector<sg4::ActivityPtr> parts;
  explicit operator bool() const { return !parts.empty(); }
  void wait() const;
  double start() const;   // the first part's start
  double finish() const;  // the last part's finish
};
// The copy of `bytes` per GPU, to the host (`down`) or to the device.
HostWork host_copy(const RankState& me, bool down, std::int64_t bytes);
// CPU Adam of `parameters` per GPU on the node's CPU host.
HostWork host_adam(const RankState& me, double parameters);

// A rank's optimizer-offload ops (sim/offload.cpp): gradient copies to the host that stream
// during each backward, CPU Adam tiles on the node's CPU host, and uploads, each copy direction a
// FIFO copy engine.
class OffloadReplay {
 public:
  OffloadReplay(World& w, RankState& me) : w_(w), me_(me) {}
  bool on() const;
  // Starts the (step, microbatch, chunk)'s gradient flow to the host as its backward starts.
  void begin_backward(const planner::Op& op);
  // copy_gradient_to_host, host_optimizer_step, copy_parameters_to_device (op index `index`).
  void run(const planner::Op& op, int index);
  // Before the device's optimizer_step: the last tile's upload has arrived.
  void wait_uploads();

 private:
  World& w_;
  RankState& me_;
  HostWork out_;  // the gradient copy of the running backward
  HostWork adam_;
  int adam_op_ = -1;
  HostWork upload_;
  int upload_op_ = -1;
};

// The body of rank `rank`'s actor: interprets its program (sim/replay.cpp).
void replay(World& world, int rank);

}  // namespace pw::sim::detail
