// The CPU ranks' transport under `mpirun -np N pipewright train --backend cpu`: one rank per
// process, messages over MPI (built with PW_HAVE_MPI only).
//
// - send: MPI_Isend of the message, kept alive until the request completes; one tag per channel, so
//   MPI's non-overtaking rule (per source, tag, communicator) gives FIFO per (src, dst, channel).
// - recv: MPI_Improbe polled until the message is there (its size is not known in advance), then
//   MPI_Imrecv polled to completion.
// - all_reduce_sum: the group's first rank receives every member's part, sums them in group order
//   starting from zero (exactly InProcessTransport's arithmetic, so losses are bit-identical to the
//   threaded run) and sends the sum back. MPI_Allreduce is not used: its order is unspecified.
// - reduce_scatter_sum: each member sends every other member that member's part of its data and
//   sums the parts it receives for its own, in group order from zero (the same arithmetic again).
//   all_gather: each member sends its part to every other member and receives theirs in place.
//   Direct exchanges (w - 1 messages of one part each way per member), not rings: the byte count
//   per member is a ring's, and the CPU ranks' w is small.
// - Every wait polls (MPI_Test / MPI_Improbe, pending sends progressed meanwhile) until done or
//   timeout_s passed: then a one-line Error naming this rank, the op and the peer; the caller ends
//   the job (MPI_Abort). A dead or hung peer is an error, never a hang.
// - Progress: MPI moves a message only inside MPI calls, and a message above the eager limit
//   (64 KiB over Open MPI's TCP BTL) needs both ends to call in after its first fragment. Without
//   help, a message sent just before a compute op waits for the sender's next call, and one not yet
//   asked for waits for the receiver's. With `start_progress()` (train --mpi-progress) a progress
//   thread makes those calls while the rank computes: it completes the pending sends and takes
//   every arriving point-to-point message into an inbox (MPI_Improbe on each channel's tag, then
//   MPI_Imrecv), napping 20 us while anything is in flight and 100 us otherwise. Every MPI call of
//   the transport holds one mutex (MPI_THREAD_SERIALIZED), and recv takes its message from the
//   inbox, so the order per (source, channel) is MPI's matching order either way.
#pragma once

#if PW_HAVE_MPI

#define OMPI_SKIP_MPICXX 1  // the C API only: no deprecated C++ bindings
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <atomic>
#include <deque>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "exec/transport.hpp"

namespace pw::exec {

class MpiTransport : public Transport {
 public:
  // `timeout_s` <= 0: wait forever.
  MpiTransport(int rank, double timeout_s);
  ~MpiTransport() override;  // cancels what is still pending (after an error); never throws

  void send(int src, int dst, Channel channel, std::vector<float> data) override;
  std::vector<float> recv(int src, int dst, Channel channel) override;
  void all_reduce_sum(const std::string& key, const std::vector<int>& group, int rank, float* data,
                      std::int64_t n) override;
  void reduce_scatter_sum(const std::string& key, const std::vector<int>& group, int rank,
                          float* data, const std::vector<std::int64_t>& bounds) override;
  void all_gather(const std::string& key, const std::vector<int>& group, int rank, float* data,
                  const std::vector<std::int64_t>& bounds) override;
  void abort() override;

  // MPI_Ibarrier over every process, polled with the timeout; `op` names it in errors.
  void barrier(const std::string& op);
  // Waits until every send issued completed (their receivers took them).
  void flush();

  // The progress thread (above). Needs MPI_THREAD_SERIALIZED or more (MpiSession::threads());
  // stop it before making MPI calls outside this transport. start_progress() returns false (and
  // starts nothing) where the MPI library does not give that level.
  bool start_progress(int provided_thread_level);
  void stop_progress();
  bool progressing() const { return progress_thread_.joinable(); }

 private:
  struct Pending {
    MPI_Request request = MPI_REQUEST_NULL;
    std::shared_ptr<const std::vector<float>> data;
    int peer = 0;
    std::string what;
  };
  // A point-to-point message taken in from MPI: its receive completes into `data`.
  struct Incoming {
    MPI_Request request = MPI_REQUEST_NULL;
    std::vector<float> data;
  };
  // Every function below is called with mutex_ held.
  void isend(std::shared_ptr<const std::vector<float>> data, int dst, int tag, std::string what);
  // Tests the pending sends (dropping the completed ones), takes in every point-to-point message
  // MPI has matched for us and tests the receives in flight; true while anything is in flight.
  bool progress();
  // Polls done() (progressing the pending sends) until it is true; throws on timeout or abort.
  void wait(const std::string& op, int peer, const std::function<bool()>& done);
  void wait_request(MPI_Request& request, const std::string& op, int peer);
  // This rank's index in `group`; throws unless it is a member and bounds has one entry more.
  std::size_t member(const std::string& op, const std::vector<int>& group, int rank,
                     const std::vector<std::int64_t>& bounds) const;

  void progress_loop();

  int rank_;
  double timeout_s_;
  std::atomic<bool> aborted_{false};
  std::mutex mutex_;  // every MPI call of this transport, and the state below
  std::list<Pending> pending_;
  std::map<std::pair<int, int>, std::deque<Incoming>> inbox_;  // (source, tag) -> in order
  std::string progress_error_;  // the progress thread's error, thrown by the next wait
  std::atomic<bool> stop_{false};
  std::thread progress_thread_;
};

}  // namespace pw::exec

#endif  // PW_HAVE_MPI
