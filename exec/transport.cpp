// The in-process transport: mutex-protected FIFO queues and a deterministic sum.
#include "exec/transport.hpp"

#include <algorithm>

#include "common/error.hpp"

namespace pw::exec {

const char* channel_name(Channel c) {
  switch (c) {
    case Channel::activation:
      return "activation";
    case Channel::gradient:
      return "gradient";
    case Channel::tied:
      return "tied";
    case Channel::tied_weights:
      return "tied weights";
  }
  return "?";
}

void InProcessTransport::send(int src, int dst, Channel channel, std::vector<float> data) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queues_[{src, dst, channel}].push_back(std::move(data));
  }
  changed_.notify_all();
}

std::vector<float> InProcessTransport::recv(int src, int dst, Channel channel) {
  std::unique_lock<std::mutex> lock(mutex_);
  auto& q = queues_[{src, dst, channel}];
  changed_.wait(lock, [&] { return !q.empty() || aborted_; });
  check_aborted();
  std::vector<float> data = std::move(q.front());
  q.pop_front();
  return data;
}

void InProcessTransport::all_reduce_sum(const std::string& key, const std::vector<int>& group,
                                        int rank, float* data, std::int64_t n) {
  std::unique_lock<std::mutex> lock(mutex_);
  Reduction& r = reductions_[key];
  r.parts[rank].assign(data, data + n);
  if (r.parts.size() == group.size()) {
    r.sum.assign(std::size_t(n), 0.0f);
    for (int member : group) {  // group order: the same sum everywhere, every run
      const auto& part = r.parts.at(member);
      for (std::int64_t i = 0; i < n; ++i)
        r.sum[std::size_t(i)] += part[std::size_t(i)];
    }
    r.done = true;
    changed_.notify_all();
  }
  changed_.wait(lock, [&] { return r.done || aborted_; });
  check_aborted();
  std::copy(r.sum.begin(), r.sum.end(), data);
  if (++r.taken == int(group.size())) reductions_.erase(key);
}

void InProcessTransport::abort() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    aborted_ = true;
  }
  changed_.notify_all();
}

void InProcessTransport::check_aborted() const {
  if (aborted_) throw Error("transport aborted: another worker failed");
}

}  // namespace pw::exec
