// The Chrome-trace timeline (Perfetto, chrome://tracing) of a run, simulated or measured: a
// process per rank, a thread per stream, each timed op of the rank's program, memory as a counter.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "common/json_reader.hpp"
#include "planner/program.hpp"

namespace pw::planner {

// The tensor_parallel stream (a pass's TP collectives, blocking the compute stream) appears only
// in timelines of plans with t > 1.
enum Stream {
  kComputeStream = 0,
  kSendStream = 1,
  kRecvStream = 2,
  kCollectiveStream = 3,
  kTensorParallelStream = 4,
  // Optimizer offload (only in timelines of offload plans): the two copy engines and the host.
  kCopyOutStream = 5,  // device -> host
  kCopyInStream = 6,   // host -> device
  kHostStream = 7      // CPU Adam
};
inline constexpr const char* kStreamNames[] = {
    "compute", "send", "recv", "collective", "tensor_parallel", "copy_d2h", "copy_h2d", "host_cpu"};

struct TimedOp {
  int stream = kComputeStream;
  double start_s = 0;
  double end_s = 0;
  int op = 0;  // index into the rank's program
};

struct RankTimeline {
  int rank = 0;
  std::string label;  // "rank 3 (node 0 gpu 3, stage 3, replica 0)"
  std::vector<TimedOp> ops;
  std::vector<std::pair<double, std::int64_t>> memory;  // (time, bytes) at every change
  // Offload: the rank's bytes in host memory, (time, bytes) at every change; empty without.
  std::vector<std::pair<double, std::int64_t>> host_memory;
};

// Format described in docs/formats.md ("Timeline").
common::Json chrome_trace(const Programs& programs, const std::vector<RankTimeline>& ranks);

}  // namespace pw::planner
