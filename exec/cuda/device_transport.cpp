// Messages and the polling wait of the device transports (exec/cuda/device_transport.hpp).
#include "exec/cuda/device_transport.hpp"

#include <chrono>
#include <cstdio>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace pw::exec::cuda {

std::int64_t dtype_bytes(DType t) {
  return t == DType::bf16 ? 2 : 4;
}

const char* dtype_name(DType t) {
  return t == DType::bf16 ? "bf16" : "fp32";
}

std::string p2p_op_name(const char* verb, Channel c, const char* dir, int peer) {
  return std::string(verb) + " " + channel_name(c) + " " + dir + " " + std::to_string(peer);
}

std::string group_text(const std::vector<int>& group) {
  return fmt::format("{{{}}}", fmt::join(group, ","));
}

void check_bounds(int rank, const std::string& op, const std::vector<int>& group,
                  const std::vector<std::int64_t>& bounds) {
  bool ok = bounds.size() == group.size() + 1 && bounds.front() == 0;
  for (std::size_t k = 1; ok && k < bounds.size(); ++k)
    ok = bounds[k] >= bounds[k - 1];
  if (!ok)
    throw Error(fmt::format("rank {}: {}: bounds [{}] are not {} ascending offsets from 0", rank,
                            op, fmt::join(bounds, ","), group.size() + 1));
}

std::string timeout_message(int rank, const std::string& op, double seconds) {
  char s[32];
  std::snprintf(s, sizeof s, "%g", seconds);
  return "rank " + std::to_string(rank) + ": " + op + " timed out after " + s + "s";
}

std::string aborted_message(int rank, const std::string& op) {
  return "transport aborted: rank " + std::to_string(rank) + ": " + op;
}

std::string cuda_op_message(int rank, const std::string& op, const char* call, cudaError_t e) {
  return "rank " + std::to_string(rank) + ": " + op + ": " + call +
         " failed: " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e);
}

void throw_cuda_op(int rank, const std::string& op, const char* call, cudaError_t e) {
  throw Error(cuda_op_message(rank, op, call, e));
}

void poll_until(int rank, const std::string& op, double timeout_s, const std::atomic<bool>& aborted,
                const std::function<bool()>& done, const std::function<void()>& on_timeout) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  auto nap = std::chrono::microseconds(0);
  for (int polls = 0;; ++polls) {
    if (aborted.load()) throw Error(aborted_message(rank, op));
    if (done()) return;
    if (timeout_s > 0 && std::chrono::duration<double>(Clock::now() - start).count() > timeout_s) {
      if (on_timeout) on_timeout();
      throw TransportTimeout(timeout_message(rank, op, timeout_s));
    }
    if (polls < 64) {
      std::this_thread::yield();  // most waits end within microseconds
    } else {
      nap = std::min(std::chrono::microseconds(1000), nap + std::chrono::microseconds(20));
      std::this_thread::sleep_for(nap);
    }
  }
}

}  // namespace pw::exec::cuda
