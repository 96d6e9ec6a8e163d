// NCCL point-to-point and all-reduce on polled non-blocking communicators
// (exec/cuda/nccl_transport.hpp).
#include "exec/cuda/nccl_transport.hpp"

#include <algorithm>

namespace pw::exec::cuda {

namespace {

ncclConfig_t nonblocking_config(const char* name) {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  config.commName = name;
  return config;
}

ncclDataType_t nccl_type(DType t) {
  return t == DType::bf16 ? ncclBfloat16 : ncclFloat32;
}

}  // namespace

int nccl_version() {
  int v = 0;
  const ncclResult_t r = ncclGetVersion(&v);
  if (r != ncclSuccess) throw Error(std::string("ncclGetVersion failed: ") + ncclGetErrorString(r));
  return v;
}

std::string nccl_version_string() {
  const int v = nccl_version();  // NCCL_VERSION(X, Y, Z) = X * 10000 + Y * 100 + Z since 2.9
  return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." +
         std::to_string(v % 100);
}

std::string nccl_error_message(int rank, const std::string& op, const char* call, ncclResult_t r,
                               const char* last_error) {
  static const char* const names[] = {
      "ncclSuccess",         "ncclUnhandledCudaError", "ncclSystemError", "ncclInternalError",
      "ncclInvalidArgument", "ncclInvalidUsage",       "ncclRemoteError", "ncclInProgress"};
  const int i = int(r);
  std::string s = "rank " + std::to_string(rank) + ": " + op + ": " + call +
                  " failed: " + (i >= 0 && i < 8 ? names[i] : "ncclResult " + std::to_string(i)) +
                  ": " + ncclGetErrorString(r);
  std::string last = last_error ? last_error : "";
  std::replace(last.begin(), last.end(), '\n', ' ');  // one line
  while (!last.empty() && last.back() == ' ')
    last.pop_back();
  if (!last.empty()) s += " (" + last + ")";
  return s;
}

ncclUniqueId nccl_unique_id() {
  ncclUniqueId id;
  const ncclResult_t r = ncclGetUniqueId(&id);
  if (r != ncclSuccess)
    throw Error(nccl_error_message(0, "create the NCCL id", "ncclGetUniqueId", r,
                                   ncclGetLastError(nullptr)));
  return id;
}

NcclTransport::NcclTransport(const ncclUniqueId& id, int world, int rank, std::vector<int> stage_of,
                             double timeout_s, std::vector<int> tp_of)
    : DeviceTransport(timeout_s),
      world_(world),
      rank_(rank),
      stage_of_(std::move(stage_of)),
      tp_of_(std::move(tp_of)) {
  const std::string op = "create the NCCL communicators";
  if (world < 1 || rank < 0 || rank >= world || int(stage_of_.size()) != world ||
      (!tp_of_.empty() && int(tp_of_.size()) != world))
    throw Error("rank " + std::to_string(rank) + ": " + op + ": world " + std::to_string(world) +
                " with " + std::to_string(stage_of_.size()) + " stage and " +
                std::to_string(tp_of_.size()) + " TP entries");
  for (int r = 0; r < world; ++r) {
    if (stage_of_[std::size_t(r)] == stage_of_[std::size_t(rank)]) stage_members_.push_back(r);
    if (!tp_of_.empty() && tp_of_[std::size_t(r)] == tp_of_[std::size_t(rank)])
      tp_members_.push_back(r);
  }
  PW_TRANSPORT_CUDA(rank, op, cudaGetDevice(&device_));
  PW_TRANSPORT_CUDA(rank, op, cudaEventCreateWithFlags(&sync_event_, cudaEventDisableTiming));

  std::lock_guard<std::recursive_mutex> lock(mutex_);
  try {
    // Sequential, each one polled to completion: with non-blocking communicators no NCCL call may
    // follow one that is still in progress.
    ncclConfig_t config = nonblocking_config("pipewright-world");
    ncclResult_t r = ncclCommInitRankConfig(&world_comm_, world, id, rank, &config);
    check(op, "ncclCommInitRankConfig", r, world_comm_);
    // One communicator per (channel, direction): see the header.
    for (std::size_t i = 0; i < channel_comms_.size(); ++i) {
      const std::string name =
          std::string("pipewright-") + channel_name(Channel(i / 2)) + (i % 2 ? "-up" : "-down");
      ncclConfig_t c = nonblocking_config(name.c_str());
      r = ncclCommSplit(world_comm_, 0, rank, &channel_comms_[i], &c);
      check(op, "ncclCommSplit", r, world_comm_);
    }
    ncclConfig_t c = nonblocking_config("pipewright-stage");
    r = ncclCommSplit(world_comm_, stage_of_[std::size_t(rank)], rank, &stage_comm_, &c);
    check(op, "ncclCommSplit", r, world_comm_);
    if (!tp_of_.empty()) {
      ncclConfig_t ct = nonblocking_config("pipewright-tp");
      r = ncclCommSplit(world_comm_, tp_of_[std::size_t(rank)], rank, &tp_comm_, &ct);
      check(op, "ncclCommSplit", r, world_comm_);
    }
  } catch (...) {
    abort_comms_locked();
    (void)cudaEventDestroy(sync_event_);
    throw;
  }
}

NcclTransport::~NcclTransport() {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  (void)cudaSetDevice(device_);
  if (!comms_aborted_) {
    try {
      // Finalize flushes what was issued and waits for the peers (polled: a dead peer is a
      // timeout, then an abort, not a hang); then destroy frees the rest locally.
      for (ncclComm_t c : comms()) {
        const ncclResult_t r = ncclCommFinalize(c);
        if (r != ncclSuccess && r != ncclInProgress) throw Error("ncclCommFinalize");
        poll_until(
            rank_, "finalize the NCCL communicators", timeout_s_, aborted_,
            [&] {
              ncclResult_t state = ncclSuccess;
              if (ncclCommGetAsyncError(c, &state) != ncclSuccess)
                throw Error("ncclCommGetAsyncError");
              if (state == ncclInProgress) return false;
              if (state != ncclSuccess) throw Error("ncclCommFinalize");
              return true;
            },
            nullptr);
      }
      for (ncclComm_t c : comms())
        (void)ncclCommDestroy(c);
      world_comm_ = stage_comm_ = tp_comm_ = nullptr;
      channel_comms_ = {};
    } catch (...) {
      abort_comms_locked();
    }
  }
  (void)cudaEventDestroy(sync_event_);
  (void)cudaGetLastError();
}

std::vector<ncclComm_t> NcclTransport::comms() const {
  std::vector<ncclComm_t> out;
  std::vector<ncclComm_t> all = {stage_comm_, tp_comm_};
  all.insert(all.end(), channel_comms_.begin(), channel_comms_.end());
  all.push_back(world_comm_);
  for (ncclComm_t c : all)
    if (c && std::find(out.begin(), out.end(), c) == out.end()) out.push_back(c);
  return out;
}

void NcclTransport::abort_comms_locked() noexcept {
  aborted_.store(true);
  if (comms_aborted_) return;
  if (group_depth_ > 0) return;  // group_end issues the group first, then aborts
  comms_aborted_ = true;
  for (ncclComm_t c : comms())
    (void)ncclCommAbort(c);  // ends kernels still waiting for peers; frees the communicator
  world_comm_ = stage_comm_ = tp_comm_ = nullptr;
  channel_comms_ = {};
}

void NcclTransport::fail(const std::string& op, const char* call, ncclResult_t r, ncclComm_t comm) {
  const std::string message = nccl_error_message(rank_, op, call, r, ncclGetLastError(comm));
  abort_comms_locked();
  throw Error(message);
}

bool NcclTransport::comms_idle(const std::string& op) {
  bool idle = true;
  for (ncclComm_t c : comms()) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t q = ncclCommGetAsyncError(c, &state);
    if (q != ncclSuccess) fail(op, "ncclCommGetAsyncError", q, c);
    if (state == ncclInProgress) {
      idle = false;
    } else if (state != ncclSuccess) {
      fail(op, "NCCL (asynchronous error)", state, c);
    }
  }
  return idle;
}

void NcclTransport::wait_idle(const std::string& op) {
  try {
    poll_until(
        rank_, op, timeout_s_, aborted_, [&] { return comms_idle(op); },
        [this] { abort_comms_locked(); });
  } catch (...) {
    abort_comms_locked();  // also when another thread's abort() was seen
    throw;
  }
}

void NcclTransport::check(const std::string& op, const char* call, ncclResult_t r,
                          ncclComm_t comm) {
  if (r != ncclSuccess && r != ncclInProgress) fail(op, call, r, comm);
  // Inside a group the calls only queue work; ncclGroupEnd is the one to poll.
  if (group_depth_ == 0) wait_idle(op);
}

void NcclTransport::entry_check(const std::string& op) {
  if (!aborted_.load()) return;
  abort_comms_locked();
  throw Error(aborted_message(rank_, op));
}

void NcclTransport::send(int src, int dst, Channel channel, const void* data, std::int64_t bytes,
                         cudaStream_t stream) {
  const std::string op = p2p_op_name("send", channel, "to", dst);
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  entry_check(op);
  if (src != rank_ || dst < 0 || dst >= world_ || bytes < 0 || (dst == rank_ && !group_depth_))
    throw Error("rank " + std::to_string(rank_) + ": " + op + " from " + std::to_string(src) +
                ", " + std::to_string(bytes) +
                " bytes: not a send of this rank (a send to itself needs a group)");
  check(op, "ncclSend",
        ncclSend(data, std::size_t(bytes), ncclUint8, dst, comm_for(channel, src, dst), stream),
        comm_for(channel, src, dst));
}

void NcclTransport::recv(int src, int dst, Channel channel, void* data, std::int64_t bytes,
                         cudaStream_t stream) {
  const std::string op = p2p_op_name("recv", channel, "from", src);
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  entry_check(op);
  if (dst != rank_ || src < 0 || src >= world_ || bytes < 0 || (src == rank_ && !group_depth_))
    throw Error("rank " + std::to_string(rank_) + ": " + op + " to " + std::to_string(dst) + ", " +
                std::to_string(bytes) +
                " bytes: not a receive of this rank (a receive from itself needs a group)");
  check(op, "ncclRecv",
        ncclRecv(data, std::size_t(bytes), ncclUint8, src, comm_for(channel, src, dst), stream),
        comm_for(channel, src, dst));
}

std::pair<ncclComm_t, const std::vector<int>*> NcclTransport::group_comm(
    const std::vector<int>& group, const std::string& op) const {
  std::vector<int> sorted = group;
  std::sort(sorted.begin(), sorted.end());
  if (sorted == stage_members_) return {stage_comm_, &stage_members_};
  if (tp_comm_ && sorted == tp_members_) return {tp_comm_, &tp_members_};
  throw Error("rank " + std::to_string(rank_) + ": " + op + ": the group must be this stage's " +
              "replicas " + group_text(stage_members_) +
              (tp_comm_ ? " or its TP group " + group_text(tp_members_) : std::string()) +
              ", called by rank " + std::to_string(rank_));
}

void NcclTransport::all_reduce_sum(const std::vector<int>& group, int rank, void* data,
                                   std::int64_t count, DType type, cudaStream_t stream) {
  const std::string op =
      std::string("all_reduce ") + dtype_name(type) + " over " + group_text(group);
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  entry_check(op);
  if (rank != rank_ || count < 0)
    throw Error("rank " + std::to_string(rank_) + ": " + op + ": called by rank " +
                std::to_string(rank) + " with " + std::to_string(count) + " elements");
  const ncclComm_t comm = group_comm(group, op).first;
  check(op, "ncclAllReduce",
        ncclAllReduce(data, data, std::size_t(count), nccl_type(type), ncclSum, comm, stream),
        comm);
}

void NcclTransport::reduce_scatter_sum(const std::vector<int>& group, int rank, void* data,
                                       const std::vector<std::int64_t>& bounds, DType type,
                                       cudaStream_t stream) {
  rooted(true, group, rank, data, bounds, type, stream);
}

void NcclTransport::all_gather(const std::vector<int>& group, int rank, void* data,
                               const std::vector<std::int64_t>& bounds, DType type,
                               cudaStream_t stream) {
  rooted(false, group, rank, data, bounds, type, stream);
}

void NcclTransport::rooted(bool reduce, const std::vector<int>& group, int rank, void* data,
                           const std::vector<std::int64_t>& bounds, DType type,
                           cudaStream_t stream) {
  const std::string op = std::string(reduce ? "reduce_scatter " : "all_gather ") +
                         dtype_name(type) + " over " + group_text(group);
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  entry_check(op);
  if (rank != rank_)
    throw Error("rank " + std::to_string(rank_) + ": " + op + ": called by rank " +
                std::to_string(rank));
  const auto [comm, members] = group_comm(group, op);
  check_bounds(rank_, op, group, bounds);
  // The communicator's ranks are the members in ascending world rank (ncclCommSplit's key).
  const auto root = [&, members = members](std::size_t k) {
    return int(std::lower_bound(members->begin(), members->end(), group[k]) - members->begin());
  };
  char* base = static_cast<char*>(data);
  const std::int64_t e = dtype_bytes(type);
  group_start();  // the parts progress together; group_end polls them with the deadline
  try {
    for (std::size_t k = 0; k + 1 < bounds.size(); ++k) {
      const std::int64_t n = bounds[k + 1] - bounds[k];
      if (n == 0) continue;
      void* part = base + bounds[k] * e;
      if (reduce)
        check(
            op, "ncclReduce",
            ncclReduce(part, part, std::size_t(n), nccl_type(type), ncclSum, root(k), comm, stream),
            comm);
      else
        check(op, "ncclBroadcast",
              ncclBroadcast(part, part, std::size_t(n), nccl_type(type), root(k), comm, stream),
              comm);
    }
  } catch (...) {
    try {
      group_end();
    } catch (...) {
    }
    throw;
  }
  group_end();
}

void NcclTransport::group_start() {
  mutex_.lock();  // held until group_end: one thread issues the whole group
  try {
    entry_check("group_start");
    const ncclResult_t r = ncclGroupStart();
    if (r != ncclSuccess) fail("group_start", "ncclGroupStart", r, world_comm_);
    ++group_depth_;
  } catch (...) {
    mutex_.unlock();
    throw;
  }
}

void NcclTransport::group_end() {
  struct Unlock {
    std::recursive_mutex& m;
    ~Unlock() { m.unlock(); }
  } unlock{mutex_};  // the lock taken by group_start
  if (group_depth_ == 0) throw Error("rank " + std::to_string(rank_) + ": group_end without start");
  --group_depth_;
  // Always end the group, even after an abort: NCCL's group state is per thread.
  const ncclResult_t r = ncclGroupEnd();
  if (group_depth_ > 0) return;
  entry_check("group_end");
  if (r != ncclSuccess && r != ncclInProgress) fail("group_end", "ncclGroupEnd", r, world_comm_);
  wait_idle("group_end");
}

void NcclTransport::connect(Channel channel, const std::vector<int>& peers) {
  const std::string op =
      std::string("connect ") + channel_name(channel) + " to " + group_text(peers);
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  entry_check(op);
  if (peers.empty()) return;
  for (int p : peers)
    if (p < 0 || p >= world_)
      throw Error("rank " + std::to_string(rank_) + ": " + op + ": no rank " + std::to_string(p));
  const std::size_t n = peers.size();
  char* scratch = nullptr;
  cudaStream_t stream = nullptr;
  PW_TRANSPORT_CUDA(rank_, op, cudaMalloc(&scratch, 2 * n));
  struct Free {
    char* p;
    cudaStream_t* s;
    ~Free() {
      if (*s) (void)cudaStreamDestroy(*s);
      (void)cudaFree(p);  // after the exchange finished (synchronize) or the comms were aborted
    }
  } release{scratch, &stream};
  PW_TRANSPORT_CUDA(rank_, op, cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  TransportGroup group(*this);
  for (std::size_t i = 0; i < n; ++i) {
    // Both directions with each peer (its communicator by the direction of each).
    ncclComm_t out = comm_for(channel, rank_, peers[i]), in = comm_for(channel, peers[i], rank_);
    check(op, "ncclSend", ncclSend(scratch + i, 1, ncclUint8, peers[i], out, stream), out);
    check(op, "ncclRecv", ncclRecv(scratch + n + i, 1, ncclUint8, peers[i], in, stream), in);
  }
  group.end();
  synchronize(rank_, stream, op);
}

void NcclTransport::synchronize(int rank, cudaStream_t stream, const std::string& op) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  entry_check(op);
  PW_TRANSPORT_CUDA(rank, op, cudaEventRecord(sync_event_, stream));
  try {
    poll_until(
        rank, op, timeout_s_, aborted_,
        [&] {
          const cudaError_t q = cudaEventQuery(sync_event_);
          if (q == cudaSuccess) return true;
          if (q != cudaErrorNotReady) throw_cuda_op(rank, op, "cudaEventQuery", q);
          (void)comms_idle(op);  // a peer's failure shows up here first
          return false;
        },
        [this] { abort_comms_locked(); });
  } catch (...) {
    abort_comms_locked();
    throw;
  }
}

void NcclTransport::abort() {
  aborted_.store(true);
  // The thread in an NCCL call holds the mutex and sees the flag at its next poll.
  std::unique_lock<std::recursive_mutex> lock(mutex_, std::try_to_lock);
  if (lock.owns_lock()) abort_comms_locked();
}

}  // namespace pw::exec::cuda
