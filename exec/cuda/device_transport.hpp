// Transports of device buffers for GPU workers: the interface, its error messages and the polling
// wait with a deadline. Implementations: LocalTransport (ranks of one process on one GPU) and
// NcclTransport (one process per GPU). exec/transport.hpp is the host-vector twin for the CPU.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "exec/cuda/device.hpp"
#include "exec/transport.hpp"

namespace pw::exec::cuda {

enum class DType { bf16, fp32 };
std::int64_t dtype_bytes(DType t);
const char* dtype_name(DType t);

// A transport op that passed its deadline: what() is "rank R: OP timed out after Ns". Thrown after
// the transport was aborted, so every other blocked call of the job fails too (with the "transport
// aborted" prefix, which the runtime treats as a consequence, not the cause).
class TransportTimeout : public Error {
 public:
  using Error::Error;
};

// "send activation to 3", "recv gradient from 1": the op in messages.
std::string p2p_op_name(const char* verb, Channel c, const char* dir, int peer);
std::string group_text(const std::vector<int>& group);  // "{0,2,4}"

// Throws "rank R: OP: ..." unless `bounds` has group.size() + 1 ascending offsets from 0.
void check_bounds(int rank, const std::string& op, const std::vector<int>& group,
                  const std::vector<std::int64_t>& bounds);

// The one-line messages (tested on their own, so the formats stay stable).
std::string timeout_message(int rank, const std::string& op, double seconds);
std::string aborted_message(int rank, const std::string& op);  // "transport aborted: rank R: OP"
// "rank R: OP: CALL failed: NAME: TEXT" for a CUDA error inside a transport op.
std::string cuda_op_message(int rank, const std::string& op, const char* call, cudaError_t e);
[[noreturn]] void throw_cuda_op(int rank, const std::string& op, const char* call, cudaError_t e);

// Polls `done()` (it may throw) until it returns true: a short spin, then sleeps growing to 1 ms.
// Throws aborted_message when `aborted` becomes true, and, when `timeout_s` (> 0) passes, calls
// `on_timeout()` (abort the transport) and throws TransportTimeout. timeout_s <= 0: no deadline.
void poll_until(int rank, const std::string& op, double timeout_s, const std::atomic<bool>& aborted,
                const std::function<bool()>& done, const std::function<void()>& on_timeout);

// How a GPU worker moves activations, gradients and gradient sums between ranks.
//
// Everything is stream-ordered: send, recv and all_reduce enqueue work on the caller's stream and
// return; they neither wait for it nor synchronise the device. Contracts:
//  - send(src, dst, ch, p, bytes, s): the bytes p holds at that point of stream s go to dst. Keep p
//    alive and unchanged until s has passed the send (record an event on s after the call; reuse
//    or release the block only after it): the arena rule.
//  - recv(src, dst, ch, p, bytes, s): work enqueued on s after the call sees the data in p. bytes
//    must equal the sender's. May block the calling thread until the matching send was issued
//    (LocalTransport; never until the data arrives), bounded by the timeout.
//  - FIFO per (src, dst, channel), as the checker assumes; nothing is ordered across channels.
//  - all_reduce_sum(group, rank, p, count, t, s): every member of `group` calls it, with the same
//    count and type; the k-th call of each member on a group forms the k-th reduction. Afterwards
//    p holds the sum for work enqueued on s. Determinism: see each implementation.
//  - reduce_scatter_sum / all_gather(group, rank, p, bounds, t, s): the distributed optimizer's
//    collectives, exec/transport.hpp's on a stream. Every member passes the same `bounds`
//    (group.size() + 1 ascending element offsets from 0; member k's part [bounds[k],
//    bounds[k + 1]), possibly empty). reduce_scatter_sum: the caller's part of p becomes the sum of
//    every member's part (the rest of p is unspecified afterwards); all_gather: every member's part
//    is copied into the others' p. Call order per group as for all_reduce_sum.
//  - Rendezvous: an NCCL send completes only when the receiver runs the recv. Issue sends and
//    recvs on their own streams (not the compute stream) and put a send and a recv that wait on
//    each other (the tied-weights exchange) between group_start() and group_end().
//  - Errors are one-line pw::Error naming the rank and the op. A blocked call throws after abort()
//    (another worker failed) or after the timeout (which aborts the transport first).
class DeviceTransport {
 public:
  explicit DeviceTransport(double timeout_s) : timeout_s_(timeout_s) {}
  virtual ~DeviceTransport() = default;
  DeviceTransport(const DeviceTransport&) = delete;
  DeviceTransport& operator=(const DeviceTransport&) = delete;

  virtual void send(int src, int dst, Channel channel, const void* data, std::int64_t bytes,
                    cudaStream_t stream) = 0;
  virtual void recv(int src, int dst, Channel channel, void* data, std::int64_t bytes,
                    cudaStream_t stream) = 0;
  virtual void all_reduce_sum(const std::vector<int>& group, int rank, void* data,
                              std::int64_t count, DType type, cudaStream_t stream) = 0;
  virtual void reduce_scatter_sum(const std::vector<int>& group, int rank, void* data,
                                  const std::vector<std::int64_t>& bounds, DType type,
                                  cudaStream_t stream) = 0;
  virtual void all_gather(const std::vector<int>& group, int rank, void* data,
                          const std::vector<std::int64_t>& bounds, DType type,
                          cudaStream_t stream) = 0;
  void all_reduce_sum_bf16(const std::vector<int>& group, int rank, bf16* data, std::int64_t count,
                           cudaStream_t stream) {
    all_reduce_sum(group, rank, data, count, DType::bf16, stream);
  }
  void all_reduce_sum_fp32(const std::vector<int>& group, int rank, float* data, std::int64_t count,
                           cudaStream_t stream) {
    all_reduce_sum(group, rank, data, count, DType::fp32, stream);
  }

  // Brackets p2p ops that must progress together (NCCL group); no-ops where sends are buffered.
  // One thread issues a whole group.
  virtual void group_start() {}
  virtual void group_end() {}

  // Blocks until the work enqueued on `stream` so far has finished, polling (cudaEventQuery and
  // the transport's own error state) with the timeout: the only way a worker should wait for
  // transport work, so that a dead peer becomes an error instead of a hang.
  virtual void synchronize(int rank, cudaStream_t stream, const std::string& op) = 0;

  // Makes every blocked or later call throw aborted_message. Idempotent, any thread.
  virtual void abort() = 0;
  bool aborted() const { return aborted_.load(); }
  double timeout_seconds() const { return timeout_s_; }

 protected:
  std::atomic<bool> aborted_{false};
  double timeout_s_;
};

// group_start() now; group_end() at end(), or when unwinding (errors then swallowed: the
// exception in flight says what went wrong), so a throwing send cannot leave a group open.
class TransportGroup {
 public:
  explicit TransportGroup(DeviceTransport& t) : t_(t) { t_.group_start(); }
  ~TransportGroup() {
    if (open_) try {
        t_.group_end();
      } catch (...) {
      }
  }
  TransportGroup(const TransportGroup&) = delete;
  TransportGroup& operator=(const TransportGroup&) = delete;
  void end() {
    open_ = false;
    t_.group_end();
  }

 private:
  DeviceTransport& t_;
  bool open_ = true;
};

}  // namespace pw::exec::cuda

// A CUDA call inside a transport op: on failure, "rank R: OP: CALL failed: NAME: TEXT".
#define PW_TRANSPORT_CUDA(rank, op, call)                                     \
  do {                                                                        \
    const cudaError_t pw_transport_status_ = (call);                          \
    if (pw_transport_status_ != cudaSuccess)                                  \
      ::pw::exec::cuda::throw_cuda_op(rank, op, #call, pw_transport_status_); \
  } while (0)
