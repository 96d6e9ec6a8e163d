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

void InProcessTransport::exchange(
    const std::string& key, const std::vector<int>& group, int rank, const float* data,
    const std::function<void(const std::map<int, const float*>&)>& take) {
  std::unique_lock<std::mutex> lock(mutex_);
  check_aborted();  // after an abort nobody deposits: a member who left may have freed its buffer
  Exchange& x = exchanges_[key];
  const std::size_t members = group.size();
  x.parts[rank] = data;
  if (x.parts.size() == members) changed_.notify_all();
  changed_.wait(lock, [&] { return x.parts.size() == members || aborted_; });
  // Once every member's buffer is here, every member takes and waits for the others, abort or
  // not (taking is a bounded copy): none may leave, and free its buffer, while another reads it.
  if (x.parts.size() != members) check_aborted();
  lock.unlock();
  take(x.parts);
  lock.lock();
  if (++x.taken == int(members)) changed_.notify_all();
  changed_.wait(lock, [&] { return x.taken >= int(members); });
  // The last one out erases the entry: the leavers counted in the same counter, past members.
  if (++x.taken == 2 * int(members)) exchanges_.erase(key);
}

void InProcessTransport::reduce_scatter_sum(const std::string& key, const std::vector<int>& group,
                                            int rank, float* data,
                                            const std::vector<std::int64_t>& bounds) {
  const std::size_t me = std::size_t(std::find(group.begin(), group.end(), rank) - group.begin());
  if (me == group.size() || bounds.size() != group.size() + 1)
    throw Error("reduce-scatter " + key + ": rank not in the group or bounds not one per member");
  const std::int64_t begin = bounds[me], n = bounds[me + 1] - begin;
  std::vector<float> sum;
  exchange(key, group, rank, data, [&](const std::map<int, const float*>& parts) {
    sum.assign(std::size_t(n), 0.0f);
    for (int member : group) {  // group order, from zero: all_reduce_sum's arithmetic
      const float* part = parts.at(member) + begin;
      for (std::int64_t i = 0; i < n; ++i)
        sum[std::size_t(i)] += part[i];
    }
  });
  // Written after every member read this part of ours (exchange returns then).
  std::copy(sum.begin(), sum.end(), data + begin);
}

void InProcessTransport::all_gather(const std::string& key, const std::vector<int>& group, int rank,
                                    float* data, const std::vector<std::int64_t>& bounds) {
  const std::size_t me = std::size_t(std::find(group.begin(), group.end(), rank) - group.begin());
  if (me == group.size() || bounds.size() != group.size() + 1)
    throw Error("all-gather " + key + ": rank not in the group or bounds not one per member");
  // Each member writes only the others' parts of its own data and reads only their parts of
  // theirs, which nobody writes: no copy needed.
  exchange(key, group, rank, data, [&](const std::map<int, const float*>& parts) {
    for (std::size_t i = 0; i < group.size(); ++i)
      if (i != me)
        std::copy(parts.at(group[i]) + bounds[i], parts.at(group[i]) + bounds[i + 1],
                  data + bounds[i]);
  });
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
