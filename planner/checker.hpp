// Schedule checker: runs programs abstractly and proves matching, progress and the weight rules.
#pragma once

#include <cstdint>
#include <vector>

#include "planner/program.hpp"

namespace pw::planner {

// One abstract run: every op once, in an order that respects program order, FIFO channels
// (sends buffered, receives blocking) and collectives (all-reduce, the tied gathers). Ops are
// named by a flat id: op i of rank r is offset[r] + i.
struct Execution {
  std::vector<std::int64_t> offset;  // ranks + 1 entries
  std::vector<std::int64_t> order;  // flat ids in completion order; a collective's members adjacent
  std::vector<std::int64_t> match;  // per flat id: the send a receive got, the group of a
                                    // collective (index into groups), else -1
  std::vector<std::vector<std::int64_t>> groups;  // collective members (flat ids), by rank
};

// Throws ScheduleError for a send/receive mismatch (kind, peer, FIFO order), a malformed or
// incomplete collective, a deadlock (naming the stuck ranks, their ops and a wait cycle) or a
// message never received.
Execution execute(const Programs& programs);

struct DeviceCheck {
  int rank = 0;
  int max_stash = 0;          // most microbatch-chunks forwarded but not yet backwarded
  int max_live_versions = 0;  // most weight versions held at once
  std::int64_t ops = 0;
};

struct CheckReport {
  std::vector<DeviceCheck> devices;
  int max_stash = 0;
  int max_live_versions = 0;
  std::int64_t ops = 0;
  std::int64_t messages = 0;     // matched send/receive pairs
  std::int64_t collectives = 0;  // completed collective groups (all_reduce, tied gathers)
};

// Most stashed microbatch-chunks a device may hold: d for 1f1b, 2bw and dp; m for gpipe;
// m*v for interleaved.
int stash_limit(const Plan& plan);

// Runs execute() and checks every device's program: each (step, microbatch, chunk) is forwarded
// and backwarded exactly once, forward before backward, a recompute between them (and before every
// backward on a recomputing stage), activations received before the forward and gradients before
// the backward, backward with its forward's version, the version rule (step for flush schedules,
// max(floor((k-1)/m) - 1, 0) for 2bw), versions used only while live, at most version_limit()
// live, stash within stash_limit(), all-reduces after the step's backwards, one optimizer step
// per step. Throws ScheduleError naming rank, op, step and microbatch.
CheckReport check_programs(const Programs& programs);

}  // namespace pw::planner
