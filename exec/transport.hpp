// How workers exchange activations, gradients and gradient sums. One interface for the in-process
// transport (threads, here), NCCL (GPU) and MPI (CPU across processes).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
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
  // Wakes every blocked call, which then throws: a failing worker must not leave the others hung.
  virtual void abort() = 0;
};

// Threads in one process.
class InProcessTransport : public Transport {
 public:
  void send(int src, int dst, Channel channel, std::vector<float> data) override;
  std::vector<float> recv(int src, int dst, Channel channel) override;
  void all_reduce_sum(const std::string& key, const std::vector<int>& group, int rank, float* data,
                      std::int64_t n) override;
  void abort() override;

 private:
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
