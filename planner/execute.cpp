// The abstract run of schedule programs: FIFO matching, collectives and deadlock detection.
#include <algorithm>
#include <deque>
#include <map>
#include <string>
#include <tuple>
#include <unordered_map>

#include "planner/checker.hpp"
#include "planner/op_errors.hpp"

namespace pw::planner {

namespace {

using detail::fail;
using detail::in_range;
using detail::where;

class Runner {
 public:
  explicit Runner(const Programs& p) : p_(p), ranks_(int(p.devices.size())) {
    ex_.offset.resize(std::size_t(ranks_) + 1, 0);
    for (int r = 0; r < ranks_; ++r) {
      ex_.offset[std::size_t(r) + 1] = ex_.offset[std::size_t(r)] + op_count(r);
    }
    ex_.match.assign(std::size_t(ex_.offset.back()), -1);
    ex_.order.reserve(std::size_t(ex_.offset.back()));
    pc_.assign(std::size_t(ranks_), 0);
    waiting_.assign(std::size_t(ranks_), -1);
  }

  Execution run() {
    for (int r = ranks_ - 1; r >= 0; --r)
      ready_.push_back(r);
    while (!ready_.empty()) {
      const int r = ready_.back();
      ready_.pop_back();
      while (pc_[std::size_t(r)] < op_count(r) && advance(r)) {
      }
    }
    report_deadlock();
    report_unreceived();
    return std::move(ex_);
  }

 private:
  std::int64_t op_count(int r) const { return std::int64_t(p_.devices[std::size_t(r)].ops.size()); }
  const Op& op_at(int r) const { return p_.devices[std::size_t(r)].ops[std::size_t(pc_[r])]; }
  std::int64_t flat(int r) const { return ex_.offset[std::size_t(r)] + pc_[std::size_t(r)]; }
  // FIFO per (src, dst, kind): activations, gradients, tied gradients, tied weights.
  static int channel_kind(OpKind kind) {
    switch (kind) {
      case OpKind::send_gradient:
      case OpKind::recv_gradient:
        return 1;
      case OpKind::send_tied_gradient:
      case OpKind::recv_tied_gradient:
        return 2;
      case OpKind::send_tied_weights:
      case OpKind::recv_tied_weights:
        return 3;
      default:
        return 0;
    }
  }
  std::int64_t channel(int src, int dst, OpKind kind) const {
    return (std::int64_t(src) * ranks_ + dst) * 4 + channel_kind(kind);
  }
  void complete(int r) {
    ex_.order.push_back(flat(r));
    ++pc_[std::size_t(r)];
  }

  // Executes the current op of rank r; false when it blocks.
  bool advance(int r) {
    const Op& op = op_at(r);
    if (is_send(op.kind) || is_recv(op.kind)) {
      if (!in_range(op.peer, ranks_)) fail(p_, r, std::size_t(pc_[r]), "peer out of range");
    }
    if (is_send(op.kind)) {
      const std::int64_t key = channel(r, op.peer, op.kind);
      channels_[key].push_back(flat(r));
      if (waiting_[std::size_t(op.peer)] == key) {
        waiting_[std::size_t(op.peer)] = -1;
        ready_.push_back(op.peer);
      }
      complete(r);
      return true;
    }
    if (is_recv(op.kind)) return receive(r, op);
    if (is_collective(op.kind)) return arrive(r, op);
    complete(r);
    return true;
  }

  bool receive(int r, const Op& op) {
    const std::int64_t key = channel(op.peer, r, op.kind);
    auto it = channels_.find(key);
    if (it == channels_.end() || it->second.empty()) {
      waiting_[std::size_t(r)] = key;
      return false;
    }
    const std::int64_t send = it->second.front();
    it->second.pop_front();
    check_pair(r, op, send);
    ex_.match[std::size_t(flat(r))] = send;
    complete(r);
    return true;
  }

  // The receive must get the message of the same step and microbatch from the adjacent virtual
  // stage (tied ops: the same step's gradient, the same version's weights, between the first and
  // last virtual stage); anything else means the two sides disagree on the channel's FIFO order.
  void check_pair(int r, const Op& recv, std::int64_t send_id) {
    const int src = recv.peer;
    const std::size_t index = std::size_t(send_id - ex_.offset[std::size_t(src)]);
    const Op& send = p_.devices[std::size_t(src)].ops[index];
    const Plan& plan = p_.plan;
    const int from = virtual_stage(plan, plan.stage_of(src), send.chunk);
    const int to = virtual_stage(plan, plan.stage_of(r), recv.chunk);
    bool ok = plan.replica_of(src) == plan.replica_of(r);
    if (recv.kind == OpKind::recv_tied_gradient) {
      ok = ok && send.step == recv.step && from == plan.virtual_stages() - 1 && to == 0;
    } else if (recv.kind == OpKind::recv_tied_weights) {
      ok = ok && send.version == recv.version && from == 0 && to == plan.virtual_stages() - 1;
    } else {
      const int dir = recv.kind == OpKind::recv_activation ? 1 : -1;
      ok = ok && send.step == recv.step && send.microbatch == recv.microbatch && from + dir == to;
    }
    if (!ok) {
      fail(p_, r, std::size_t(pc_[r]),
           "FIFO channel from rank " + std::to_string(src) + " delivers " + where(p_, src, index));
    }
  }

  // Collectives are matched over the stage's w replicas by (kind, stage, step, chunk, bucket);
  // the tied weights' gather by its version instead of the step.
  using CollectiveKey = std::tuple<int, int, int, int, int>;
  static CollectiveKey collective_key(const Plan& plan, int r, const Op& op) {
    const int when = op.kind == OpKind::gather_tied_weights ? op.version : op.step;
    return {int(op.kind), plan.stage_of(r), when, op.chunk, op.bucket};
  }

  bool arrive(int r, const Op& op) {
    const Plan& plan = p_.plan;
    const std::size_t index = std::size_t(pc_[r]);
    const int step = op.step - p_.first_step;
    if (!in_range(step, p_.steps) || !in_range(op.chunk, plan.v) ||
        (op.kind == OpKind::all_reduce && !in_range(op.bucket, p_.buckets))) {
      fail(p_, r, index, to_string(op.kind) + " step, chunk or bucket out of range");
    }
    const CollectiveKey key = collective_key(plan, r, op);
    auto& members = pending_[key];
    for (std::int64_t id : members) {
      if (plan.replica_of(rank_of_flat(id)) == plan.replica_of(r)) {
        fail(p_, r, index, "joins the same " + to_string(op.kind) + " twice");
      }
    }
    members.push_back(flat(r));
    if (int(members.size()) < plan.w) {
      waiting_[std::size_t(r)] = -2;
      return false;
    }
    std::sort(members.begin(), members.end());
    const std::int64_t group = std::int64_t(ex_.groups.size());
    for (std::int64_t id : members) {
      const int member = rank_of_flat(id);
      ex_.match[std::size_t(id)] = group;
      complete(member);
      if (member != r) {
        waiting_[std::size_t(member)] = -1;
        ready_.push_back(member);
      }
    }
    ex_.groups.push_back(std::move(members));
    pending_.erase(key);
    return true;
  }

  int rank_of_flat(std::int64_t id) const {
    auto it = std::upper_bound(ex_.offset.begin(), ex_.offset.end(), id);
    return int(it - ex_.offset.begin()) - 1;
  }

  // The rank a stuck rank waits for: the sender of its receive, or a replica missing from its
  // collective.
  int waits_for(int r) const {
    const Op& op = op_at(r);
    if (is_recv(op.kind)) return op.peer;
    const int stage = p_.plan.stage_of(r);
    for (int replica = 0; replica < p_.plan.w; ++replica) {
      const int other = p_.plan.rank_of(stage, replica);
      if (other == r) continue;
      if (pc_[std::size_t(other)] >= op_count(other)) return other;
      const Op& theirs = op_at(other);
      if (!is_collective(theirs.kind) ||
          collective_key(p_.plan, other, theirs) != collective_key(p_.plan, r, op)) {
        return other;
      }
    }
    return -1;
  }

  void report_deadlock() const {
    std::vector<int> stuck;
    for (int r = 0; r < ranks_; ++r) {
      if (pc_[std::size_t(r)] < op_count(r)) stuck.push_back(r);
    }
    if (stuck.empty()) return;
    std::string msg = "deadlock: " + std::to_string(stuck.size()) + " ranks stuck";
    for (std::size_t i = 0; i < stuck.size() && i < 4; ++i) {
      const int r = stuck[i];
      msg += "; " + where(p_, r, std::size_t(pc_[std::size_t(r)])) + " waits for rank " +
             std::to_string(waits_for(r));
    }
    msg += "; " + wait_chain(stuck.front());
    throw ScheduleError(msg);
  }

  // Follows wait-for edges from a stuck rank: a cycle, or a rank that finished without sending.
  std::string wait_chain(int start) const {
    std::vector<int> path;
    std::vector<int> seen(std::size_t(ranks_), -1);
    int r = start;
    while (r >= 0 && pc_[std::size_t(r)] < op_count(r) && seen[std::size_t(r)] < 0) {
      seen[std::size_t(r)] = int(path.size());
      path.push_back(r);
      r = waits_for(r);
    }
    if (r < 0) return "wait chain ends at an incomplete collective";
    if (pc_[std::size_t(r)] >= op_count(r)) {
      return "rank " + std::to_string(r) + " has finished its program";
    }
    std::string cycle = "wait cycle";
    for (std::size_t i = std::size_t(seen[std::size_t(r)]); i < path.size(); ++i) {
      cycle += " " + std::to_string(path[i]) + " ->";
    }
    return cycle + " " + std::to_string(r);
  }

  void report_unreceived() const {
    std::int64_t first = -1;
    for (const auto& [key, queue] : channels_) {
      if (!queue.empty() && (first < 0 || queue.front() < first)) first = queue.front();
    }
    if (first < 0) return;
    const int src = rank_of_flat(first);
    const std::size_t index = std::size_t(first - ex_.offset[std::size_t(src)]);
    const int dst = p_.devices[std::size_t(src)].ops[index].peer;
    fail(p_, src, index, "message never received by rank " + std::to_string(dst));
  }

  const Programs& p_;
  int ranks_;
  Execution ex_;
  std::vector<std::int64_t> pc_;
  std::vector<std::int64_t> waiting_;  // channel key a rank waits on, -2 an all_reduce, else -1
  std::vector<int> ready_;
  std::unordered_map<std::int64_t, std::deque<std::int64_t>> channels_;
  std::map<CollectiveKey, std::vector<std::int64_t>> pending_;
};

}  // namespace

Execution execute(const Programs& programs) {
  return Runner(programs).run();
}

}  // namespace pw::planner
