// How workers exchange activations, gradients and gradient sums. One interface for the in-process
// transport (threads, here), NCCL (GPU) and MPI (CPU across processes).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

namespace pw::exec {

enum class Channel { activation, gradient, tied, tied_weights };  // point-to-point message kinds
// For messages and names: "activation", "gradient", "tied" (the tied gradient), "tied weights".
const char* channel_name(Channel c);

class Transport {
 public:
  virtual ~Transport() = default;
  // Asynchronous, buffered: returns at once. FIFO per (src, dst, channel), as the checker assumes.
  virtual void send(int src, int dst, Channel channel, std::vector<float> data) = 0;
  // Blocks until the next message of (src, dst, channel) arrives.
  virtual std::vector<float> recv(int src, int dst, Channel channel) = 0;
  // Sums `data` over the ranks of `group` (every member calls with the same key and size) in
  // group order, so the result is bit-identical on every member and across runs.
  virtual void all_reduce_sum(const std::string& key, const std::vector<int>& group, int rank,
                              float* data, std::int64_t n) = 0;
  // The distributed optimizer's collectives over `data`, a range every member of `group` passes
  // with the same key and the same `bounds`: group.size() + 1 ascending offsets into data from 0,
  // member i's part [bounds[i], bounds[i + 1]) (possibly empty).
  // reduce_scatter_sum: the caller's own part becomes the sum of every member's part, in group
  // order starting from zero (all_reduce_sum's arithmetic, element for element, so a sharded sum
  // is bit-identical to the whole one); the rest of data is left as it was.
  virtual void reduce_scatter_sum(const std::string& key, const std::vector<int>& group, int rank,
                                  float* data, const std::vector<std::int64_t>& bounds) = 0;
  // all_gather: every member's part of data is copied into the others' data (the caller's own part
  // is left as it was).
  virtual void all_gather(const std::string& key, const std::vector<int>& group, int rank,
                          float* data, const std::vector<std::int64_t>& bounds) = 0;
  // Wakes every blocked call, which then throws: a failing worker must not leave the others hung.
  virtual void abort() = 0;
  // Whether a rank may call it from several threads at once (its worker's communication engines
  // beside its compute thread: exec/worker.hpp). False: every call on the rank's own thread, in
  // program order (MPI initialised MPI_THREAD_FUNNELED).
  virtual bool concurrent() const { return false; }
};

// Threads in one process.
class InProcessTransport : public Transport {
 public:
  void send(int src, int dst, Channel channel, std::vector<float> data) override;
  std::vector<float> recv(int src, int dst, Channel channel) override;
  void all_reduce_sum(const std::string& key, const std::vector<int>& group, int rank, float* data,
                      std::int64_t n) override;
  void reduce_scatter_sum(const std::string& key, const std::vector<int>& group, int rank,
                          float* data, const std::vector<std::int64_t>& bounds) override;
  void all_gather(const std::string& key, const std::vector<int>& group, int rank, float* data,
                  const std::vector<std::int64_t>& bounds) override;
  void abort() override;
  bool concurrent() const override { return true; }  // one mutex; collectives matched by key

 private:
  // Where reduce_scatter_sum and all_gather leave the members' data (RS: all of it; AG: the
  // member's part) until every member has taken what it needs from the others.
  struct Exchange {
    std::map<int, const float*> parts;  // by rank: the member's data, alive while it waits
    int taken = 0;
  };
  // Deposits `data` under `key`, waits for every member's, runs `take` on them, then waits until
  // every member took (the members' buffers stay valid until then). An abort before every member
  // arrived throws; after, the exchange completes (the caller's next call throws).
  void exchange(const std::string& key, const std::vector<int>& group, int rank, const float* data,
                const std::function<void(const std::map<int, const float*>&)>& take);
  std::map<std::string, Exchange> exchanges_;
  void check_aborted() const;
  struct Reduction {
    std::map<int, std::vector<float>> parts;  // by rank
    std::vector<float> sum;
    int taken = 0;
    bool done = false;
  };
  std::mutex mutex_;
  std::condition_variable changed_;
  std::map<std::tuple<int, int, Channel>, std::deque<std::vector<float>>> queues_;
  std::map<std::string, Reduction> reductions_;
  bool aborted_ = false;
};

}  // namespace pw::exec
