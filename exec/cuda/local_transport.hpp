// Ranks of one process on one GPU (several stages, or replicas, on a device): messages move by
// device-to-device copies ordered with events, never with a host synchronisation.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

#include "exec/cuda/arena.hpp"
#include "exec/cuda/device_transport.hpp"
#include "exec/cuda/transport_kernels.cuh"

namespace pw::exec::cuda {

// A send copies the payload on the sender's stream into a staging block of the arena and records
// an event; the receiver's stream waits on that event (cudaStreamWaitEvent) and copies the block
// into the receive buffer. The staging block goes back to the arena once that copy has finished
// (checked with cudaEventQuery on later calls), so a sender may run ahead of its receiver as on the
// CPU, with the in-flight bytes counted in the arena under `staging` (default workspace).
//
// recv and all_reduce_sum block the calling thread until the matching send / the last member has
// been issued (a stream cannot wait on an event that is not recorded yet), with the timeout.
//
// all_reduce_sum: the last member to arrive makes its stream wait on every member's "ready" event
// and launches one kernel that sums the members' buffers in group order in fp32 (one rounding for
// bf16) and writes the sum into every member's buffer; every other member's stream waits on its
// "done" event. reduce_scatter_sum and all_gather meet the same way and launch the same kernel,
// which writes each part's sum only into its owner's buffer, or copies each owner's part into the
// others' (transport_kernels.cuh): a reduce-scatter's part is bit-identical to the all-reduce's.
// Bit-identical on every member and every run, and for fp32 equal to the CPU InProcessTransport's
// sum. Groups of up to kMaxGroup ranks; a group of one is the identity.
//
// Thread-safe: one thread per rank (each with its own streams, the device current) calls it at
// once. The arena must outlive the transport.
class LocalTransport : public DeviceTransport {
 public:
  static constexpr int kMaxGroup = 16;

  LocalTransport(DeviceArena& arena, int ranks, double timeout_s = 300,
                 Category staging = Category::workspace);
  ~LocalTransport() override;

  void send(int src, int dst, Channel channel, const void* data, std::int64_t bytes,
            cudaStream_t stream) override;
  void recv(int src, int dst, Channel channel, void* data, std::int64_t bytes,
            cudaStream_t stream) override;
  void all_reduce_sum(const std::vector<int>& group, int rank, void* data, std::int64_t count,
                      DType type, cudaStream_t stream) override;
  void reduce_scatter_sum(const std::vector<int>& group, int rank, void* data,
                          const std::vector<std::int64_t>& bounds, DType type,
                          cudaStream_t stream) override;
  void all_gather(const std::vector<int>& group, int rank, void* data,
                  const std::vector<std::int64_t>& bounds, DType type,
                  cudaStream_t stream) override;
  void synchronize(int rank, cudaStream_t stream, const std::string& op) override;
  void abort() override;

  int ranks() const { return ranks_; }
  // Test hooks: messages sent and not yet received; staging blocks still held (queued + retiring).
  std::int64_t queued_messages() const;
  std::int64_t staging_blocks() const;

 private:
  struct Message {
    void* staging;
    std::int64_t bytes;
    cudaEvent_t sent;  // recorded on the sender's stream after the copy into `staging`
  };
  struct Retiring {
    void* staging;
    cudaEvent_t done;  // after the last read of `staging`
  };
  struct Member {
    void* data;
    cudaEvent_t ready;
  };
  struct Reduction {
    std::map<int, Member> members;
    std::int64_t count = 0;
    DType type = DType::fp32;
    Collective kind = Collective::all_reduce;
    std::vector<std::int64_t> bounds;  // reduce-scatter and all-gather
    cudaStream_t launched_on = nullptr;
    cudaEvent_t done = nullptr;
    bool launched = false;
    int taken = 0;
  };
  struct Group {
    std::map<int, std::int64_t> next;  // each member's next sequence number
    std::map<std::int64_t, Reduction> pending;
  };

  void check_rank(int rank, int self, const std::string& op) const;
  // The three collectives; bounds empty for the all-reduce.
  void collective(Collective kind, const std::string& op, const std::vector<int>& group, int rank,
                  void* data, std::int64_t count, const std::vector<std::int64_t>& bounds,
                  DType type, cudaStream_t stream);
  void fail_locked();  // abort() with mutex_ held: a reduction the others wait for cannot happen
  std::int64_t queued_locked() const;
  cudaEvent_t take_event(int rank, const std::string& op);  // from the pool; mutex_ not held
  void give_event_locked(cudaEvent_t e) { free_events_.push_back(e); }
  // Releases staging blocks whose last reader finished; mutex_ held.
  void reclaim_locked(int rank, const std::string& op);
  void* allocate_staging(int rank, const std::string& op, std::int64_t bytes);
  // Waits on changed_ until pred() or abort; on timeout aborts and throws TransportTimeout.
  template <class Pred>
  void wait_locked(std::unique_lock<std::mutex>& lock, int rank, const std::string& op, Pred pred);

  DeviceArena& arena_;
  int device_ = 0;
  int ranks_;
  Category category_;
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::map<std::tuple<int, int, Channel>, std::deque<Message>> queues_;
  std::deque<Retiring> retiring_;
  std::vector<cudaEvent_t> free_events_;
  std::vector<cudaEvent_t> all_events_;  // destroyed with the transport
  std::map<std::vector<int>, Group> groups_;
};

}  // namespace pw::exec::cuda
