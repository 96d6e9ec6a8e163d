// Schedule checker: an abstract run (matching, collectives, deadlock) plus per-device invariants.
#include "planner/checker.hpp"

#include <algorithm>
#include <deque>
#include <string>
#include <unordered_map>

#include "common/error.hpp"

namespace pw::planner {

namespace {

std::string where(const Programs& p, int rank, std::size_t index) {
  const Op& op = p.devices[std::size_t(rank)].ops[index];
  std::string s = "rank " + std::to_string(rank) + " op " + std::to_string(index) + " " +
                  format_op(op, p.plan) + " (step " + std::to_string(op.step);
  if (op.microbatch >= 0) s += ", microbatch " + std::to_string(op.microbatch);
  if (p.plan.v > 1) s += ", chunk " + std::to_string(op.chunk);
  return s + ")";
}

[[noreturn]] void fail(const Programs& p, int rank, std::size_t index, const std::string& what) {
  throw ScheduleError(where(p, rank, index) + ": " + what);
}

bool in_range(int x, int n) {
  return x >= 0 && x < n;
}

// Runs every device until it blocks; a send or a completed collective wakes the blocked ranks.
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
  std::int64_t channel(int src, int dst, bool gradient) const {
    return (std::int64_t(src) * ranks_ + dst) * 2 + (gradient ? 1 : 0);
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
      const std::int64_t key = channel(r, op.peer, op.kind == OpKind::send_gradient);
      channels_[key].push_back(flat(r));
      if (waiting_[std::size_t(op.peer)] == key) {
        waiting_[std::size_t(op.peer)] = -1;
        ready_.push_back(op.peer);
      }
      complete(r);
      return true;
    }
    if (is_recv(op.kind)) return receive(r, op);
    if (op.kind == OpKind::all_reduce) return arrive(r, op);
    complete(r);
    return true;
  }

  bool receive(int r, const Op& op) {
    const std::int64_t key = channel(op.peer, r, op.kind == OpKind::recv_gradient);
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
  // stage; anything else means the two sides disagree on the channel's FIFO order.
  void check_pair(int r, const Op& recv, std::int64_t send_id) {
    const int src = recv.peer;
    const std::size_t index = std::size_t(send_id - ex_.offset[std::size_t(src)]);
    const Op& send = p_.devices[std::size_t(src)].ops[index];
    const Plan& plan = p_.plan;
    const int dir = recv.kind == OpKind::recv_activation ? 1 : -1;
    const bool ok = send.step == recv.step && send.microbatch == recv.microbatch &&
                    plan.replica_of(src) == plan.replica_of(r) &&
                    virtual_stage(plan, plan.stage_of(src), send.chunk) + dir ==
                        virtual_stage(plan, plan.stage_of(r), recv.chunk);
    if (!ok) {
      fail(p_, r, std::size_t(pc_[r]),
           "FIFO channel from rank " + std::to_string(src) + " delivers " + where(p_, src, index));
    }
  }

  bool arrive(int r, const Op& op) {
    const Plan& plan = p_.plan;
    const std::size_t index = std::size_t(pc_[r]);
    if (!in_range(op.step, p_.steps) || !in_range(op.chunk, plan.v) ||
        !in_range(op.bucket, p_.buckets)) {
      fail(p_, r, index, "all_reduce step, chunk or bucket out of range");
    }
    const std::int64_t key =
        ((std::int64_t(plan.stage_of(r)) * p_.steps + op.step) * plan.v + op.chunk) * p_.buckets +
        op.bucket;
    auto& members = pending_[key];
    for (std::int64_t id : members) {
      if (plan.replica_of(rank_of_flat(id)) == plan.replica_of(r)) {
        fail(p_, r, index, "joins the same all_reduce twice");
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
  // all_reduce.
  int waits_for(int r) const {
    const Op& op = op_at(r);
    if (is_recv(op.kind)) return op.peer;
    const int stage = p_.plan.stage_of(r);
    for (int replica = 0; replica < p_.plan.w; ++replica) {
      const int other = p_.plan.rank_of(stage, replica);
      if (other == r) continue;
      if (pc_[std::size_t(other)] >= op_count(other)) return other;
      const Op& theirs = op_at(other);
      if (!(theirs.kind == OpKind::all_reduce && theirs.step == op.step &&
            theirs.chunk == op.chunk && theirs.bucket == op.bucket)) {
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
    if (r < 0) return "wait chain ends at an incomplete all_reduce";
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
  std::unordered_map<std::int64_t, std::vector<std::int64_t>> pending_;
};

}  // namespace

Execution execute(const Programs& programs) {
  return Runner(programs).run();
}

int stash_limit(const Plan& plan) {
  switch (plan.schedule) {
    case Schedule::gpipe:
      return plan.m;
    case Schedule::interleaved:
      return plan.m * plan.v;
    default:
      return plan.d;
  }
}

namespace {

enum Flag : std::uint8_t {
  kRecvA = 1,
  kForward = 2,
  kSentA = 4,
  kRecvG = 8,
  kRecompute = 16,
  kBackward = 32,
  kSentG = 64,
};

// Walks one device's program in order and checks the per-device invariants.
class DeviceChecker {
 public:
  DeviceChecker(const Programs& p, int rank)
      : p_(p), plan_(p.plan), prog_(p.devices[std::size_t(rank)]) {
    const std::size_t slots = std::size_t(p.steps) * std::size_t(plan_.m) * std::size_t(plan_.v);
    flags_.assign(slots, 0);
    version_of_.assign(slots, -1);
    live_.assign(std::size_t(p.steps) + 2, 0);
    live_[0] = 1;
    users_.assign(live_.size(), 0);
    backwards_.assign(std::size_t(p.steps) * std::size_t(plan_.v), 0);
    all_reduces_.assign(std::size_t(p.steps), 0);
    steps_done_ = 0;
  }

  DeviceCheck run() {
    for (index_ = 0; index_ < prog_.ops.size(); ++index_)
      visit(prog_.ops[index_]);
    check_complete();
    return {prog_.rank, max_stash_, max_live_, std::int64_t(prog_.ops.size())};
  }

 private:
  [[noreturn]] void bad(const std::string& what) const { fail(p_, prog_.rank, index_, what); }
  int vs(const Op& op) const { return virtual_stage(plan_, prog_.stage, op.chunk); }
  bool first(const Op& op) const { return vs(op) == 0; }
  bool last(const Op& op) const { return vs(op) == plan_.virtual_stages() - 1; }
  std::uint8_t& flags(const Op& op) { return flags_[slot(op)]; }
  std::size_t slot(const Op& op) const {
    return (std::size_t(op.step) * std::size_t(plan_.m) + std::size_t(op.microbatch)) *
               std::size_t(plan_.v) +
           std::size_t(op.chunk);
  }

  void require(const Op& op, std::uint8_t need, const std::string& what) {
    if ((flags(op) & need) != need) bad(what);
  }
  void set_once(const Op& op, std::uint8_t flag, const std::string& what) {
    if (flags(op) & flag) bad(what + " twice");
    flags(op) |= flag;
  }

  void visit(const Op& op) {
    if (!in_range(op.step, p_.steps) || !in_range(op.chunk, plan_.v)) {
      bad("step or chunk out of range");
    }
    if (op.kind == OpKind::all_reduce && !in_range(op.bucket, p_.buckets)) {
      bad("bucket out of range");
    }
    if (op.microbatch >= 0 || is_compute(op.kind) || is_send(op.kind) || is_recv(op.kind)) {
      if (!in_range(op.microbatch, plan_.m)) bad("microbatch out of range");
    }
    switch (op.kind) {
      case OpKind::recv_activation:
        if (first(op)) bad("receives an activation at the first virtual stage");
        return set_once(op, kRecvA, "activation received");
      case OpKind::forward:
        return forward(op);
      case OpKind::send_activation:
        if (last(op)) bad("sends an activation from the last virtual stage");
        require(op, kForward, "sends an activation before its forward");
        return set_once(op, kSentA, "activation sent");
      case OpKind::recv_gradient:
        if (last(op)) bad("receives a gradient at the last virtual stage");
        require(op, kForward, "receives a gradient before its forward");
        return set_once(op, kRecvG, "gradient received");
      case OpKind::recompute:
        return recompute(op);
      case OpKind::backward:
        return backward(op);
      case OpKind::send_gradient:
        if (first(op)) bad("sends a gradient from the first virtual stage");
        require(op, kBackward, "sends a gradient before its backward");
        return set_once(op, kSentG, "gradient sent");
      case OpKind::all_reduce:
        return all_reduce(op);
      case OpKind::optimizer_step:
        return optimizer_step(op);
      case OpKind::free_version:
        return free_version(op);
    }
  }

  void use_version(const Op& op) {
    if (!in_range(op.version, int(live_.size()))) bad("weight version out of range");
    const int want = expected_version(plan_, op.step, op.microbatch);
    if (op.version != want) {
      bad("uses weight version " + std::to_string(op.version) + ", the rule gives " +
          std::to_string(want));
    }
    if (!live_[std::size_t(op.version)]) {
      bad("uses weight version " + std::to_string(op.version) + ", which is not live");
    }
  }

  void forward(const Op& op) {
    if (!first(op)) require(op, kRecvA, "forward before its activation is received");
    set_once(op, kForward, "forward");
    use_version(op);
    version_of_[slot(op)] = op.version;
    ++users_[std::size_t(op.version)];
    max_stash_ = std::max(max_stash_, ++stash_);
    if (stash_ > stash_limit(plan_)) {
      bad("stashes " + std::to_string(stash_) + " microbatches (limit " +
          std::to_string(stash_limit(plan_)) + ")");
    }
  }

  void same_version_as_forward(const Op& op, const char* what) {
    if (op.version != version_of_[slot(op)]) {
      bad(std::string(what) + " uses weight version " + std::to_string(op.version) +
          ", its forward used " + std::to_string(version_of_[slot(op)]));
    }
    use_version(op);
  }

  void recompute(const Op& op) {
    require(op, kForward, "recompute before its forward");
    if (flags(op) & kBackward) bad("recompute after its backward");
    set_once(op, kRecompute, "recompute");
    same_version_as_forward(op, "recompute");
  }

  void backward(const Op& op) {
    require(op, kForward, "backward before its forward");
    if (!last(op)) require(op, kRecvG, "backward before its gradient is received");
    if (plan_.recomputes(prog_.stage)) require(op, kRecompute, "backward without a recompute");
    set_once(op, kBackward, "backward");
    same_version_as_forward(op, "backward");
    --users_[std::size_t(op.version)];
    --stash_;
    ++backwards_[std::size_t(op.step) * std::size_t(plan_.v) + std::size_t(op.chunk)];
  }

  void all_reduce(const Op& op) {
    if (backwards_[std::size_t(op.step) * std::size_t(plan_.v) + std::size_t(op.chunk)] !=
        plan_.m) {
      bad("all_reduce before the step's backwards of this chunk");
    }
    ++all_reduces_[std::size_t(op.step)];
  }

  void optimizer_step(const Op& op) {
    if (op.step != steps_done_) bad("optimizer step out of order");
    for (int chunk = 0; chunk < plan_.v; ++chunk) {
      if (backwards_[std::size_t(op.step) * std::size_t(plan_.v) + std::size_t(chunk)] != plan_.m) {
        bad("optimizer step before the step's backwards");
      }
    }
    const int reduces = plan_.w > 1 ? p_.buckets * plan_.v : 0;
    if (all_reduces_[std::size_t(op.step)] != reduces) {
      bad("optimizer step after " + std::to_string(all_reduces_[std::size_t(op.step)]) +
          " all_reduces, expected " + std::to_string(reduces));
    }
    if (op.version != op.step + 1) bad("optimizer step must create version step+1");
    live_[std::size_t(op.version)] = 1;
    ++live_count_;
    ++steps_done_;
    max_live_ = std::max(max_live_, live_count_);
    if (live_count_ > version_limit(plan_)) {
      bad(std::to_string(live_count_) + " weight versions live (limit " +
          std::to_string(version_limit(plan_)) + ")");
    }
  }

  void free_version(const Op& op) {
    if (!in_range(op.version, int(live_.size())) || !live_[std::size_t(op.version)]) {
      bad("frees weight version " + std::to_string(op.version) + ", which is not live");
    }
    if (users_[std::size_t(op.version)] > 0) {
      bad("frees weight version " + std::to_string(op.version) + " still used by " +
          std::to_string(users_[std::size_t(op.version)]) + " stashed microbatches");
    }
    live_[std::size_t(op.version)] = 0;
    --live_count_;
  }

  void check_complete() const {
    if (steps_done_ != p_.steps) {
      throw ScheduleError("rank " + std::to_string(prog_.rank) + ": " +
                          std::to_string(steps_done_) + " optimizer steps, expected " +
                          std::to_string(p_.steps));
    }
    for (int step = 0; step < p_.steps; ++step) {
      for (int mb = 0; mb < plan_.m; ++mb) {
        for (int chunk = 0; chunk < plan_.v; ++chunk)
          check_slot(Op{OpKind::forward, step, mb, chunk});
      }
    }
  }

  void check_slot(const Op& op) const {
    std::uint8_t need = kForward | kBackward;
    if (!first(op)) need |= kRecvA | kSentG;
    if (!last(op)) need |= kSentA | kRecvG;
    if (plan_.recomputes(prog_.stage)) need |= kRecompute;
    if ((flags_[slot(op)] & need) != need) {
      throw ScheduleError("rank " + std::to_string(prog_.rank) + ": step " +
                          std::to_string(op.step) + " microbatch " + std::to_string(op.microbatch) +
                          " chunk " + std::to_string(op.chunk) +
                          " misses a forward, backward, recompute, send or receive");
    }
  }

  const Programs& p_;
  const Plan& plan_;
  const Program& prog_;
  std::size_t index_ = 0;
  std::vector<std::uint8_t> flags_;
  std::vector<int> version_of_;
  std::vector<char> live_;
  std::vector<int> users_;        // stashed microbatches per weight version
  std::vector<int> backwards_;    // per (step, chunk)
  std::vector<int> all_reduces_;  // per step
  int steps_done_ = 0;
  int live_count_ = 1;
  int max_live_ = 1;
  int stash_ = 0;
  int max_stash_ = 0;
};

}  // namespace

CheckReport check_programs(const Programs& programs) {
  CheckReport report;
  for (std::size_t r = 0; r < programs.devices.size(); ++r) {
    if (programs.devices[r].rank != int(r)) {
      throw ScheduleError("program " + std::to_string(r) + " names rank " +
                          std::to_string(programs.devices[r].rank));
    }
    DeviceCheck device = DeviceChecker(programs, int(r)).run();
    report.max_stash = std::max(report.max_stash, device.max_stash);
    report.max_live_versions = std::max(report.max_live_versions, device.max_live_versions);
    report.ops += device.ops;
    report.devices.push_back(device);
  }
  // Local invariants first: their messages are the most precise.
  const Execution ex = execute(programs);
  for (std::int64_t m : ex.match)
    report.messages += m >= 0 ? 1 : 0;
  report.collectives = std::int64_t(ex.groups.size());
  std::int64_t grouped = 0;
  for (const auto& g : ex.groups)
    grouped += std::int64_t(g.size());
  report.messages -= grouped;
  return report;
}

}  // namespace pw::planner
