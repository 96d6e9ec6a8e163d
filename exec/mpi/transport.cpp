// The CPU ranks' MPI transport (exec/mpi/transport.hpp).
#include "exec/mpi/transport.hpp"

#if PW_HAVE_MPI

#include <algorithm>
#include <chrono>
#include <thread>

#include <fmt/format.h>

#include "exec/mpi/launch.hpp"

namespace pw::exec {

namespace {

// Tags: one per point-to-point channel, then the all-reduce's parts and sums.
int channel_tag(Channel c) {
  return 1 + int(c);
}
constexpr int kPartTag = 16, kSumTag = 17, kScatterTag = 18, kGatherTag = 19;

}  // namespace

constexpr Channel kChannels[] = {Channel::activation, Channel::gradient, Channel::tied,
                                 Channel::tied_weights};

MpiTransport::MpiTransport(int rank, double timeout_s) : rank_(rank), timeout_s_(timeout_s) {}

MpiTransport::~MpiTransport() {
  stop_progress();
  // Normally empty (flush() ran). After an error the job is being aborted: cancel, do not wait.
  for (Pending& p : pending_)
    if (p.request != MPI_REQUEST_NULL) {
      MPI_Cancel(&p.request);
      MPI_Request_free(&p.request);
    }
  for (auto& [key, queue] : inbox_)
    for (Incoming& in : queue)
      if (in.request != MPI_REQUEST_NULL) {
        MPI_Cancel(&in.request);
        MPI_Request_free(&in.request);
      }
}

bool MpiTransport::start_progress(int provided_thread_level) {
  if (provided_thread_level < MPI_THREAD_SERIALIZED) return false;
  if (progress_thread_.joinable()) return true;
  stop_ = false;
  progress_thread_ = std::thread([this] { progress_loop(); });
  return true;
}

void MpiTransport::stop_progress() {
  if (!progress_thread_.joinable()) return;
  stop_ = true;
  progress_thread_.join();
}

void MpiTransport::progress_loop() {
  while (!stop_) {
    bool busy = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!progress_error_.empty()) return;
      try {
        busy = progress();
      } catch (const std::exception& e) {
        progress_error_ = e.what();  // the rank's next wait throws it
        return;
      }
    }
    std::this_thread::sleep_for(std::chrono::microseconds(busy ? 20 : 100));
  }
}

void MpiTransport::isend(std::shared_ptr<const std::vector<float>> data, int dst, int tag,
                         std::string what) {
  Pending& p = pending_.emplace_back();
  p.data = std::move(data);
  p.peer = dst;
  p.what = std::move(what);
  check_mpi(rank_, fmt::format("{} to rank {}: MPI_Isend", p.what, dst),
            MPI_Isend(p.data->data(), int(p.data->size()), MPI_FLOAT, dst, tag, MPI_COMM_WORLD,
                      &p.request));
  progress();
}

bool MpiTransport::progress() {
  // Called on every poll: an error's text is made only when a call fails.
  const auto check = [this](int code, auto&& what) {
    if (code != MPI_SUCCESS) check_mpi(rank_, what(), code);
  };
  for (auto it = pending_.begin(); it != pending_.end();) {
    int done = 0;
    check(MPI_Test(&it->request, &done, MPI_STATUS_IGNORE),
          [&] { return fmt::format("{} to rank {}: MPI_Test", it->what, it->peer); });
    it = done ? pending_.erase(it) : std::next(it);
  }
  // Every point-to-point message MPI has matched, taken in as it arrives (per source and tag in
  // MPI's order), whether or not the rank has asked for it yet.
  bool receiving = false;
  for (const Channel channel : kChannels) {
    const int tag = channel_tag(channel);
    for (;;) {
      int found = 0;
      MPI_Message message = MPI_MESSAGE_NULL;
      MPI_Status status;
      check(MPI_Improbe(MPI_ANY_SOURCE, tag, MPI_COMM_WORLD, &found, &message, &status),
            [&] { return fmt::format("receive {}: MPI_Improbe", channel_name(channel)); });
      if (!found) break;
      const auto what = [&](const char* call) {
        return fmt::format("receive {} from rank {}: {}", channel_name(channel), status.MPI_SOURCE,
                           call);
      };
      int count = 0;
      check(MPI_Get_count(&status, MPI_FLOAT, &count), [&] { return what("MPI_Get_count"); });
      Incoming& in = inbox_[{status.MPI_SOURCE, tag}].emplace_back();
      in.data.resize(std::size_t(std::max(count, 0)));
      check(MPI_Imrecv(in.data.data(), count, MPI_FLOAT, &message, &in.request),
            [&] { return what("MPI_Imrecv"); });
    }
  }
  for (auto& entry : inbox_) {
    // A named copy: clang 14 does not let a lambda capture a structured binding.
    const int source = entry.first.first;
    for (Incoming& in : entry.second) {
      if (in.request == MPI_REQUEST_NULL) continue;
      int done = 0;
      check(MPI_Test(&in.request, &done, MPI_STATUS_IGNORE),
            [&] { return fmt::format("receive from rank {}: MPI_Test", source); });
      receiving = receiving || !done;
    }
  }
  return receiving || !pending_.empty();
}

void MpiTransport::wait(const std::string& op, int peer, const std::function<bool()>& done) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  auto nap = std::chrono::microseconds(0);
  note_waiting(op);
  struct Done {
    ~Done() { note_done_waiting(); }
  } done_waiting;
  for (int polls = 0;; ++polls) {
    if (aborted_) throw Error(fmt::format("transport aborted: rank {}: {}", rank_, op));
    if (!progress_error_.empty()) throw Error(progress_error_);
    progress();
    if (done()) return;
    if (timeout_s_ > 0 && std::chrono::duration<double>(Clock::now() - start).count() > timeout_s_)
      throw Error(fmt::format(
          "rank {}: {} timed out after {:g}s (--comm-timeout): {} is dead or hung", rank_, op,
          timeout_s_, peer < 0 ? std::string("a peer") : fmt::format("rank {}", peer)));
    // Most waits end within microseconds; longer ones nap (up to 100 us) so that a waiting rank
    // leaves the core to the ranks computing beside it. The progress thread waits meanwhile: the
    // waiting rank progresses everything itself.
    if (polls < 64) {
      std::this_thread::yield();
    } else {
      nap = std::min(std::chrono::microseconds(100), nap + std::chrono::microseconds(10));
      std::this_thread::sleep_for(nap);
    }
  }
}

void MpiTransport::wait_request(MPI_Request& request, const std::string& op, int peer) {
  wait(op, peer, [&] {
    int done = 0;
    check_mpi(rank_, op + ": MPI_Test", MPI_Test(&request, &done, MPI_STATUS_IGNORE));
    return done != 0;
  });
}

void MpiTransport::send(int src, int dst, Channel channel, std::vector<float> data) {
  if (src != rank_)
    throw Error(fmt::format("rank {}: send from rank {}: not this process's rank", rank_, src));
  std::lock_guard<std::mutex> lock(mutex_);
  isend(std::make_shared<const std::vector<float>>(std::move(data)), dst, channel_tag(channel),
        fmt::format("send {}", channel_name(channel)));
}

std::vector<float> MpiTransport::recv(int src, int dst, Channel channel) {
  if (dst != rank_)
    throw Error(fmt::format("rank {}: receive for rank {}: not this process's rank", rank_, dst));
  const std::string op = fmt::format("receive {} from rank {}", channel_name(channel), src);
  std::lock_guard<std::mutex> lock(mutex_);
  std::deque<Incoming>& queue = inbox_[{src, channel_tag(channel)}];
  // progress() takes the message in and completes its receive.
  wait(op, src, [&] { return !queue.empty() && queue.front().request == MPI_REQUEST_NULL; });
  std::vector<float> data = std::move(queue.front().data);
  queue.pop_front();
  return data;
}

void MpiTransport::all_reduce_sum(const std::string& key, const std::vector<int>& group, int rank,
                                  float* data, std::int64_t n) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (rank != rank_ || std::find(group.begin(), group.end(), rank) == group.end())
    throw Error(fmt::format("rank {}: all-reduce {} for rank {}", rank_, key, rank));
  const int root = group.front();
  const int count = int(n);
  if (rank_ != root) {
    // The part to the group's first rank, the sum back from it.
    isend(std::make_shared<const std::vector<float>>(data, data + n), root, kPartTag,
          fmt::format("all-reduce {}: send part", key));
    MPI_Request request = MPI_REQUEST_NULL;
    check_mpi(rank_, fmt::format("all-reduce {}: MPI_Irecv", key),
              MPI_Irecv(data, count, MPI_FLOAT, root, kSumTag, MPI_COMM_WORLD, &request));
    wait_request(request, fmt::format("all-reduce {}: receive the sum from rank {}", key, root),
                 root);
    return;
  }
  // Every part's receive posted at once (they arrive concurrently), then waited for in turn.
  std::vector<std::vector<float>> parts(group.size());
  std::vector<MPI_Request> requests(group.size(), MPI_REQUEST_NULL);
  for (std::size_t i = 1; i < group.size(); ++i) {
    parts[i].resize(std::size_t(n));
    check_mpi(rank_, fmt::format("all-reduce {}: MPI_Irecv", key),
              MPI_Irecv(parts[i].data(), count, MPI_FLOAT, group[i], kPartTag, MPI_COMM_WORLD,
                        &requests[i]));
  }
  for (std::size_t i = 1; i < group.size(); ++i)
    wait_request(requests[i],
                 fmt::format("all-reduce {}: receive the part of rank {}", key, group[i]),
                 group[i]);
  // InProcessTransport's sum: from zero, member after member in group order.
  auto sum = std::make_shared<std::vector<float>>(std::size_t(n), 0.0f);
  for (std::size_t i = 0; i < group.size(); ++i) {
    const float* part = i == 0 ? data : parts[i].data();
    for (std::int64_t j = 0; j < n; ++j)
      (*sum)[std::size_t(j)] += part[j];
  }
  std::copy(sum->begin(), sum->end(), data);
  for (std::size_t i = 1; i < group.size(); ++i)
    isend(sum, group[i], kSumTag, fmt::format("all-reduce {}: send the sum", key));
}

std::size_t MpiTransport::member(const std::string& op, const std::vector<int>& group, int rank,
                                 const std::vector<std::int64_t>& bounds) const {
  const std::size_t me = std::size_t(std::find(group.begin(), group.end(), rank) - group.begin());
  if (rank != rank_ || me == group.size() || bounds.size() != group.size() + 1)
    throw Error(fmt::format("rank {}: {} for rank {}: not a member, or bounds not one per member",
                            rank_, op, rank));
  return me;
}

void MpiTransport::reduce_scatter_sum(const std::string& key, const std::vector<int>& group,
                                      int rank, float* data,
                                      const std::vector<std::int64_t>& bounds) {
  const std::string op = fmt::format("reduce-scatter {}", key);
  const std::size_t me = member(op, group, rank, bounds);
  std::lock_guard<std::mutex> lock(mutex_);
  const std::int64_t begin = bounds[me], n = bounds[me + 1] - begin;
  // The others' parts of ours go out first, then ours of theirs come in, all posted at once.
  for (std::size_t i = 0; i < group.size(); ++i)
    if (i != me)
      isend(std::make_shared<const std::vector<float>>(data + bounds[i], data + bounds[i + 1]),
            group[i], kScatterTag, op + ": send part");
  std::vector<std::vector<float>> parts(group.size());
  std::vector<MPI_Request> requests(group.size(), MPI_REQUEST_NULL);
  for (std::size_t i = 0; i < group.size(); ++i) {
    if (i == me) continue;
    parts[i].resize(std::size_t(n));
    check_mpi(rank_, op + ": MPI_Irecv",
              MPI_Irecv(parts[i].data(), int(n), MPI_FLOAT, group[i], kScatterTag, MPI_COMM_WORLD,
                        &requests[i]));
  }
  for (std::size_t i = 0; i < group.size(); ++i)
    if (i != me)
      wait_request(requests[i], fmt::format("{}: receive the part of rank {}", op, group[i]),
                   group[i]);
  // InProcessTransport's sum: from zero, member after member in group order.
  std::vector<float> sum(std::size_t(n), 0.0f);
  for (std::size_t i = 0; i < group.size(); ++i) {
    const float* part = i == me ? data + begin : parts[i].data();
    for (std::int64_t j = 0; j < n; ++j)
      sum[std::size_t(j)] += part[j];
  }
  std::copy(sum.begin(), sum.end(), data + begin);
}

void MpiTransport::all_gather(const std::string& key, const std::vector<int>& group, int rank,
                              float* data, const std::vector<std::int64_t>& bounds) {
  const std::string op = fmt::format("all-gather {}", key);
  const std::size_t me = member(op, group, rank, bounds);
  std::lock_guard<std::mutex> lock(mutex_);
  auto mine = std::make_shared<const std::vector<float>>(data + bounds[me], data + bounds[me + 1]);
  for (std::size_t i = 0; i < group.size(); ++i)
    if (i != me) isend(mine, group[i], kGatherTag, op + ": send part");
  std::vector<MPI_Request> requests(group.size(), MPI_REQUEST_NULL);
  for (std::size_t i = 0; i < group.size(); ++i) {
    if (i == me) continue;
    check_mpi(rank_, op + ": MPI_Irecv",
              MPI_Irecv(data + bounds[i], int(bounds[i + 1] - bounds[i]), MPI_FLOAT, group[i],
                        kGatherTag, MPI_COMM_WORLD, &requests[i]));
  }
  for (std::size_t i = 0; i < group.size(); ++i)
    if (i != me)
      wait_request(requests[i], fmt::format("{}: receive the part of rank {}", op, group[i]),
                   group[i]);
}

void MpiTransport::abort() {
  aborted_ = true;
}

void MpiTransport::barrier(const std::string& op) {
  std::lock_guard<std::mutex> lock(mutex_);
  MPI_Request request = MPI_REQUEST_NULL;
  check_mpi(rank_, op + ": MPI_Ibarrier", MPI_Ibarrier(MPI_COMM_WORLD, &request));
  wait_request(request, op, -1);
}

void MpiTransport::flush() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (pending_.empty()) return;
  const Pending& first = pending_.front();
  wait(fmt::format("{} to rank {} (completing the sends)", first.what, first.peer), first.peer,
       [&] { return pending_.empty(); });
}

}  // namespace pw::exec

#endif  // PW_HAVE_MPI
