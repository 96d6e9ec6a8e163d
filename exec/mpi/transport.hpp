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
#pragma once

#if PW_HAVE_MPI

#define OMPI_SKIP_MPICXX 1  // the C API only: no deprecated C++ bindings
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <functional>
#include <list>
#include <memory>
#include <string>
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

 private:
  struct Pending {
    MPI_Request request = MPI_REQUEST_NULL;
    std::shared_ptr<const std::vector<float>> data;
    int peer = 0;
    std::string what;
  };
  void isend(std::shared_ptr<const std::vector<float>> data, int dst, int tag, std::string what);
  void progress();  // tests the pending sends, drops the completed ones
  // Polls done() (progressing the pending sends) until it is true; throws on timeout or abort.
  void wait(const std::string& op, int peer, const std::function<bool()>& done);
  void wait_request(MPI_Request& request, const std::string& op, int peer);
  // This rank's index in `group`; throws unless it is a member and bounds has one entry more.
  std::size_t member(const std::string& op, const std::vector<int>& group, int rank,
                     const std::vector<std::int64_t>& bounds) const;

  int rank_;
  double timeout_s_;
  bool aborted_ = false;
  std::list<Pending> pending_;
};

}  // namespace pw::exec

#endif  // PW_HAVE_MPI
