// One process (or thread) per GPU: NCCL point-to-point between stages and all-reduce across a
// stage's replicas, on non-blocking communicators polled with a deadline. Built when NCCL is found
// (PW_HAVE_NCCL).
#pragma once

#include <nccl.h>

#include <array>
#include <mutex>
#include <string>
#include <vector>

#include "exec/cuda/device_transport.hpp"

namespace pw::exec::cuda {

// ncclGetVersion (works without a GPU): e.g. 22809, and "2.28.9".
int nccl_version();
std::string nccl_version_string();
// "rank R: OP: CALL failed: NAME: TEXT" plus " (LAST)" when NCCL's last-error text is not empty.
std::string nccl_error_message(int rank, const std::string& op, const char* call, ncclResult_t r,
                               const char* last_error);
// ncclGetUniqueId, on the one rank that creates the communicator (then broadcast, e.g. over MPI).
ncclUniqueId nccl_unique_id();

// Communicators (all non-blocking, ncclConfig_t::blocking = 0, each NCCL call followed by polling
// ncclCommGetAsyncError with the deadline, so a peer that never comes is a TransportTimeout):
//  - world: ncclCommInitRankConfig over every rank;
//  - per channel (activation, gradient, tied, tied_weights) and direction (to a higher stage, to
//    a lower or the same one): ncclCommSplit(world, 0, rank). NCCL runs the operations of one
//    communicator in issue order, whatever stream they are on, so a communicator must never carry
//    two flows whose orders can disagree: one per channel keeps activations and gradients apart,
//    and one per direction keeps an interleaved pipeline's wrap-around (the last stage's
//    activations back to stage 0 for the next chunk) from queueing against the forward flow
//    between the same two ranks. On each communicator each pair of ranks then sees one flow in
//    program order, FIFO per (src, dst, channel) as the checker assumes;
//  - stage: ncclCommSplit(world, color = stage_of[rank], key = rank): the replicas of this rank's
//    stage, for all_reduce_sum (the group passed must be exactly those ranks).
// Every rank of the world constructs one, collectively, with its device current.
//
// Deadlocks: NCCL sends are rendezvous, not buffered, and NCCL promises no concurrent progress of
// two operations on one communicator. So: issue sends on a send stream and recvs on a recv stream
// (events to and from the compute stream); channels and directions use their own communicators;
// and a send
// and a recv that wait on each other on one communicator (the tied-weights exchange, a send to and
// recv from the same peer) go between group_start() and group_end(). A send to this rank itself is
// only allowed inside a group (with its recv).
//
// Determinism: NCCL's sum is the same on every member and from run to run for a fixed world,
// topology, NCCL version, message size and algorithm/protocol choice (pin with NCCL_ALGO=Ring
// NCCL_PROTO=Simple to be independent of the tuner); it is not the group-order sum of
// LocalTransport and the CPU transport, and bf16 sums are rounded to bf16 at every step.
//
// Threads: calls are serialised by a mutex (NCCL allows one thread per communicator at a time);
// a group is held by the thread that started it. abort() from another thread sets a flag that the
// owner's next poll sees; it then aborts the communicators (ncclCommAbort ends running kernels).
class NcclTransport : public DeviceTransport {
 public:
  // stage_of[r]: the replica group of world rank r (its collectives' communicator; with tensor
  // parallelism the stage and TP index, stage · t + TP index, so that p2p between stages of one TP
  // index still goes up and down by it); tp_of[r] (empty: none): its TP group, a second
  // communicator for the TP sums, all-gathers and reduce-scatters.
  NcclTransport(const ncclUniqueId& id, int world, int rank, std::vector<int> stage_of,
                double timeout_s = 300, std::vector<int> tp_of = {});
  // Finalizes the communicators (polled with the deadline; aborted if it passes); never throws.
  ~NcclTransport() override;

  void send(int src, int dst, Channel channel, const void* data, std::int64_t bytes,
            cudaStream_t stream) override;
  void recv(int src, int dst, Channel channel, void* data, std::int64_t bytes,
            cudaStream_t stream) override;
  void all_reduce_sum(const std::vector<int>& group, int rank, void* data, std::int64_t count,
                      DType type, cudaStream_t stream) override;
  // Sets up this rank's NCCL connections on `channel` to `peers` now, with a grouped 1-byte
  // exchange each way, so that no later send or recv waits on the host for a peer to connect (NCCL
  // connects lazily, at the first operation between two ranks). Collective between the peers: if
  // A lists B, B lists A. E.g. activation and gradient: the previous and next stage's ranks; tied:
  // the partner. Before the step loop (it allocates 2 x peers bytes with cudaMalloc).
  void connect(Channel channel, const std::vector<int>& peers);
  // Parts of any size: a grouped ncclReduce (reduce-scatter) or ncclBroadcast (all-gather) per
  // member, rooted at the part's owner.
  void reduce_scatter_sum(const std::vector<int>& group, int rank, void* data,
                          const std::vector<std::int64_t>& bounds, DType type,
                          cudaStream_t stream) override;
  void all_gather(const std::vector<int>& group, int rank, void* data,
                  const std::vector<std::int64_t>& bounds, DType type,
                  cudaStream_t stream) override;
  void group_start() override;
  void group_end() override;
  // Polls cudaEventQuery and every communicator's async error: a peer that died or hangs becomes
  // a TransportTimeout (after ncclCommAbort) or a one-line NCCL error.
  void synchronize(int rank, cudaStream_t stream, const std::string& op) override;
  void abort() override;

  int rank() const { return rank_; }
  int world() const { return world_; }
  int device() const { return device_; }
  const std::vector<int>& stage_members() const { return stage_members_; }
  const std::vector<int>& tp_members() const { return tp_members_; }

 private:
  ncclComm_t comm_for(Channel c, int src, int dst) const {
    const bool up = stage_of_[std::size_t(dst)] > stage_of_[std::size_t(src)];
    return channel_comms_[2 * std::size_t(c) + (up ? 1 : 0)];
  }
  // Checks a call's result: errors throw (after aborting); ncclInProgress (or any success in the
  // non-blocking mode) is polled until every communicator is idle. mutex_ held.
  void check(const std::string& op, const char* call, ncclResult_t r, ncclComm_t comm);
  void wait_idle(const std::string& op);
  // Throws the first communicator's async error; false while one is still in progress.
  bool comms_idle(const std::string& op);
  [[noreturn]] void fail(const std::string& op, const char* call, ncclResult_t r, ncclComm_t comm);
  void entry_check(const std::string& op);
  // reduce_scatter_sum (reduce true) and all_gather: the checks, then one rooted op per part.
  void rooted(bool reduce, const std::vector<int>& group, int rank, void* data,
              const std::vector<std::int64_t>& bounds, DType type,
              cudaStream_t stream);  // throws once aborted (aborting the comms first)
  void abort_comms_locked() noexcept;
  std::vector<ncclComm_t> comms() const;  // the distinct live ones, children first

  std::recursive_mutex mutex_;
  int group_depth_ = 0;
  int world_, rank_, device_ = 0;
  // The communicator of a collective's group (the replicas' or the TP group's) and its members in
  // ascending world rank; throws naming both when the group is neither.
  std::pair<ncclComm_t, const std::vector<int>*> group_comm(const std::vector<int>& group,
                                                            const std::string& op) const;
  std::vector<int> stage_of_, stage_members_, tp_of_, tp_members_;
  ncclComm_t world_comm_ = nullptr, stage_comm_ = nullptr, tp_comm_ = nullptr;
  std::array<ncclComm_t, 8> channel_comms_{};  // by 2 x Channel + (1: to a higher stage)
  cudaEvent_t sync_event_ = nullptr;
  bool comms_aborted_ = false;
};

}  // namespace pw::exec::cuda
