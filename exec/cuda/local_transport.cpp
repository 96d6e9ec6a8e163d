// The single-GPU transport: staged device copies ordered by events (exec/cuda/local_transport.hpp).
#include "exec/cuda/local_transport.hpp"

#include <algorithm>
#include <chrono>
#include <set>

#include "exec/cuda/transport_kernels.cuh"

namespace pw::exec::cuda {

LocalTransport::LocalTransport(DeviceArena& arena, int ranks, double timeout_s, Category staging)
    : DeviceTransport(timeout_s),
      arena_(arena),
      device_(arena.device()),
      ranks_(ranks),
      category_(staging) {
  if (ranks < 1) throw Error("LocalTransport: " + std::to_string(ranks) + " ranks");
}

LocalTransport::~LocalTransport() {
  // Wait for the copies that still read or write staging blocks, then give the blocks back.
  // Errors are ignored: after a failure the device may be unusable, and a destructor cannot throw.
  (void)cudaSetDevice(device_);
  for (auto& [key, q] : queues_)
    for (Message& m : q) {
      (void)cudaEventSynchronize(m.sent);
      arena_.release(m.staging);
    }
  for (Retiring& r : retiring_) {
    (void)cudaEventSynchronize(r.done);
    arena_.release(r.staging);
  }
  for (cudaEvent_t e : all_events_)
    (void)cudaEventDestroy(e);
  (void)cudaGetLastError();
}

void LocalTransport::check_rank(int rank, int self, const std::string& op) const {
  if (rank < 0 || rank >= ranks_)
    throw Error("rank " + std::to_string(self) + ": " + op + ": rank " + std::to_string(rank) +
                " is not in 0.." + std::to_string(ranks_ - 1));
}

cudaEvent_t LocalTransport::take_event(int rank, const std::string& op) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!free_events_.empty()) {
      const cudaEvent_t e = free_events_.back();
      free_events_.pop_back();
      return e;
    }
  }
  cudaEvent_t e = nullptr;
  PW_TRANSPORT_CUDA(rank, op, cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  std::lock_guard<std::mutex> lock(mutex_);
  all_events_.push_back(e);
  return e;
}

void LocalTransport::reclaim_locked(int rank, const std::string& op) {
  for (auto it = retiring_.begin(); it != retiring_.end();) {
    const cudaError_t q = cudaEventQuery(it->done);
    if (q == cudaErrorNotReady) {
      ++it;
      continue;
    }
    if (q != cudaSuccess) throw_cuda_op(rank, op, "cudaEventQuery(staging copy)", q);
    arena_.release(it->staging);
    free_events_.push_back(it->done);
    it = retiring_.erase(it);
  }
}

void* LocalTransport::allocate_staging(int rank, const std::string& op, std::int64_t bytes) {
  if (bytes == 0) return nullptr;
  void* p = nullptr;
  std::string last_error;
  // Memory held by staging blocks whose copies are still running comes back as they finish; when
  // nothing is retiring, waiting cannot help (the bytes sit in unreceived messages).
  poll_until(
      rank, op, timeout_s_, aborted_,
      [&] {
        std::lock_guard<std::mutex> lock(mutex_);
        reclaim_locked(rank, op);
        try {
          p = arena_.allocate(bytes, category_);
          return true;
        } catch (const Error& e) {
          if (retiring_.empty())
            throw Error("rank " + std::to_string(rank) + ": " + op +
                        ": no device memory to stage " + std::to_string(bytes) + " bytes (" +
                        std::to_string(queued_locked()) +
                        " messages not received yet): " + e.what());
          return false;
        }
      },
      [this] { abort(); });
  return p;
}

template <class Pred>
void LocalTransport::wait_locked(std::unique_lock<std::mutex>& lock, int rank,
                                 const std::string& op, Pred pred) {
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(timeout_s_));
  const auto ready = [&] { return aborted_.load() || pred(); };
  if (timeout_s_ > 0) {
    if (!changed_.wait_until(lock, deadline, ready)) {
      lock.unlock();
      abort();
      throw TransportTimeout(timeout_message(rank, op, timeout_s_));
    }
  } else {
    changed_.wait(lock, ready);
  }
  if (aborted_.load()) throw Error(aborted_message(rank, op));
}

void LocalTransport::send(int src, int dst, Channel channel, const void* data, std::int64_t bytes,
                          cudaStream_t stream) {
  const std::string op = p2p_op_name("send", channel, "to", dst);
  check_rank(src, src, op);
  check_rank(dst, src, op);
  if (bytes < 0) throw Error("rank " + std::to_string(src) + ": " + op + ": negative size");
  if (aborted_.load()) throw Error(aborted_message(src, op));
  PW_TRANSPORT_CUDA(src, op, cudaSetDevice(device_));

  void* staging = allocate_staging(src, op, bytes);
  cudaEvent_t sent = nullptr;
  try {
    sent = take_event(src, op);
    if (bytes > 0)
      PW_TRANSPORT_CUDA(
          src, op,
          cudaMemcpyAsync(staging, data, std::size_t(bytes), cudaMemcpyDeviceToDevice, stream));
    PW_TRANSPORT_CUDA(src, op, cudaEventRecord(sent, stream));
  } catch (...) {
    // If the copy was enqueued, it may still write the block: retire it behind the copy's stream.
    std::lock_guard<std::mutex> lock(mutex_);
    if (sent && staging && cudaEventRecord(sent, stream) == cudaSuccess)
      retiring_.push_back({staging, sent});
    else if (staging)
      arena_.release(staging);  // nothing was enqueued (or the stream is broken anyway)
    throw;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queues_[{src, dst, channel}].push_back({staging, bytes, sent});
  }
  changed_.notify_all();
}

void LocalTransport::recv(int src, int dst, Channel channel, void* data, std::int64_t bytes,
                          cudaStream_t stream) {
  const std::string op = p2p_op_name("recv", channel, "from", src);
  check_rank(src, dst, op);
  check_rank(dst, dst, op);
  PW_TRANSPORT_CUDA(dst, op, cudaSetDevice(device_));

  Message m{};
  {
    std::unique_lock<std::mutex> lock(mutex_);
    auto& q = queues_[{src, dst, channel}];
    wait_locked(lock, dst, op, [&] { return !q.empty(); });
    m = q.front();
    q.pop_front();
  }
  // From here the block is ours: whatever happens, it retires behind the last copy touching it.
  cudaEvent_t read = nullptr;
  try {
    if (m.bytes != bytes)
      throw Error("rank " + std::to_string(dst) + ": " + op + ": the message has " +
                  std::to_string(m.bytes) + " bytes, the receive buffer " + std::to_string(bytes));
    read = take_event(dst, op);
    PW_TRANSPORT_CUDA(dst, op, cudaStreamWaitEvent(stream, m.sent, 0));
    if (bytes > 0)
      PW_TRANSPORT_CUDA(
          dst, op,
          cudaMemcpyAsync(data, m.staging, std::size_t(bytes), cudaMemcpyDeviceToDevice, stream));
    PW_TRANSPORT_CUDA(dst, op, cudaEventRecord(read, stream));
  } catch (...) {
    // Behind the sender's copy (if our copy was enqueued and not recorded, the stream is broken).
    std::lock_guard<std::mutex> lock(mutex_);
    if (read) give_event_locked(read);
    retiring_.push_back({m.staging, m.sent});
    throw;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  // The wait on `sent` is enqueued, so the event may be recorded again by a later send.
  give_event_locked(m.sent);
  retiring_.push_back({m.staging, read});
}

void LocalTransport::all_reduce_sum(const std::vector<int>& group, int rank, void* data,
                                    std::int64_t count, DType type, cudaStream_t stream) {
  collective(Collective::all_reduce,
             std::string("all_reduce ") + dtype_name(type) + " over " + group_text(group), group,
             rank, data, count, {}, type, stream);
}

void LocalTransport::reduce_scatter_sum(const std::vector<int>& group, int rank, void* data,
                                        const std::vector<std::int64_t>& bounds, DType type,
                                        cudaStream_t stream) {
  const std::string op =
      std::string("reduce_scatter ") + dtype_name(type) + " over " + group_text(group);
  check_bounds(rank, op, group, bounds);
  collective(Collective::reduce_scatter, op, group, rank, data, bounds.back(), bounds, type,
             stream);
}

void LocalTransport::all_gather(const std::vector<int>& group, int rank, void* data,
                                const std::vector<std::int64_t>& bounds, DType type,
                                cudaStream_t stream) {
  const std::string op =
      std::string("all_gather ") + dtype_name(type) + " over " + group_text(group);
  check_bounds(rank, op, group, bounds);
  collective(Collective::all_gather, op, group, rank, data, bounds.back(), bounds, type, stream);
}

void LocalTransport::collective(Collective kind, const std::string& op,
                                const std::vector<int>& group, int rank, void* data,
                                std::int64_t count, const std::vector<std::int64_t>& bounds,
                                DType type, cudaStream_t stream) {
  const std::set<int> members(group.begin(), group.end());
  if (group.empty() || members.size() != group.size() || !members.count(rank))
    throw Error("rank " + std::to_string(rank) + ": " + op +
                ": the group must list distinct ranks including the caller");
  if (int(group.size()) > kMaxGroup)
    throw Error("rank " + std::to_string(rank) + ": " + op + ": more than " +
                std::to_string(kMaxGroup) + " ranks on one device");
  for (int r : group)
    check_rank(r, rank, op);
  if (count < 0) throw Error("rank " + std::to_string(rank) + ": " + op + ": negative count");
  if (aborted_.load()) throw Error(aborted_message(rank, op));
  if (group.size() == 1) return;  // one member: its sum, and its parts, are its own
  PW_TRANSPORT_CUDA(rank, op, cudaSetDevice(device_));

  cudaEvent_t ready = take_event(rank, op);
  {
    const cudaError_t e = cudaEventRecord(ready, stream);
    if (e != cudaSuccess) {
      std::lock_guard<std::mutex> lock(mutex_);
      give_event_locked(ready);
      throw_cuda_op(rank, op, "cudaEventRecord(ready, stream)", e);
    }
  }
  // Events for the launch are taken before locking (take_event locks on its own).
  cudaEvent_t done = take_event(rank, op);

  std::unique_lock<std::mutex> lock(mutex_);
  Group& g = groups_[group];
  const std::int64_t seq = g.next[rank]++;
  Reduction& r = g.pending[seq];
  if (r.members.empty()) {
    r.count = count;
    r.type = type;
    r.kind = kind;
    r.bounds = bounds;
  } else if (r.count != count || r.type != type || r.kind != kind || r.bounds != bounds) {
    give_event_locked(ready);
    give_event_locked(done);
    fail_locked();  // the other members would wait for a collective that cannot happen
    throw Error("rank " + std::to_string(rank) + ": " + op + ": " + std::to_string(count) + " " +
                dtype_name(type) + " values" + (bounds.empty() ? "" : " in its parts") +
                ", another member passed " + std::to_string(r.count) + " " + dtype_name(r.type) +
                (r.kind == kind ? "" : " to another collective") +
                (r.kind == kind && r.bounds != bounds ? " in other parts" : ""));
  }
  r.members[rank] = {data, ready};

  if (r.members.size() == group.size()) {
    // The last member launches on its own stream, after every member's work so far.
    try {
      void* buffers[kMaxGroup];
      for (std::size_t k = 0; k < group.size(); ++k) {
        const Member& m = r.members.at(group[k]);
        buffers[k] = m.data;
        PW_TRANSPORT_CUDA(rank, op, cudaStreamWaitEvent(stream, m.ready, 0));
      }
      const std::int64_t* parts = bounds.empty() ? nullptr : bounds.data();
      const cudaError_t launched =
          type == DType::bf16
              ? collective_bf16(kind, buffers, int(group.size()), parts, count, stream)
              : collective_fp32(kind, buffers, int(group.size()), parts, count, stream);
      if (launched != cudaSuccess) throw_cuda_op(rank, op, "group_collective<<<>>>", launched);
      PW_TRANSPORT_CUDA(rank, op, cudaEventRecord(done, stream));
    } catch (...) {
      fail_locked();
      throw;
    }
    for (auto& [member, m] : r.members)
      give_event_locked(m.ready);  // every wait on them is enqueued
    r.done = done;
    r.launched_on = stream;
    r.launched = true;
    changed_.notify_all();
  } else {
    give_event_locked(done);  // not the launcher
    wait_locked(lock, rank, op, [&] { return r.launched; });
    if (stream != r.launched_on)
      PW_TRANSPORT_CUDA(rank, op, cudaStreamWaitEvent(stream, r.done, 0));
  }
  if (++r.taken == int(group.size())) {
    give_event_locked(r.done);
    g.pending.erase(seq);
  }
}

void LocalTransport::synchronize(int rank, cudaStream_t stream, const std::string& op) {
  PW_TRANSPORT_CUDA(rank, op, cudaSetDevice(device_));
  cudaEvent_t e = take_event(rank, op);
  struct Give {
    LocalTransport* t;
    cudaEvent_t e;
    ~Give() {
      std::lock_guard<std::mutex> lock(t->mutex_);
      t->give_event_locked(e);
    }
  } give{this, e};
  PW_TRANSPORT_CUDA(rank, op, cudaEventRecord(e, stream));
  poll_until(
      rank, op, timeout_s_, aborted_,
      [&] {
        const cudaError_t q = cudaEventQuery(e);
        if (q == cudaErrorNotReady) return false;
        if (q != cudaSuccess) throw_cuda_op(rank, op, "cudaEventQuery", q);
        return true;
      },
      [this] { abort(); });
}

void LocalTransport::fail_locked() {
  aborted_.store(true);
  changed_.notify_all();
}

void LocalTransport::abort() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    aborted_.store(true);
  }
  changed_.notify_all();
}

std::int64_t LocalTransport::queued_messages() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return queued_locked();
}

std::int64_t LocalTransport::queued_locked() const {
  std::int64_t n = 0;
  for (const auto& [key, q] : queues_)
    n += std::int64_t(q.size());
  return n;
}

std::int64_t LocalTransport::staging_blocks() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::int64_t n = std::int64_t(retiring_.size());
  for (const auto& [key, q] : queues_)
    for (const Message& m : q)
      n += m.staging ? 1 : 0;
  return n;
}

}  // namespace pw::exec::cuda
