// Intra-node collective calibration: nccl-tests all-reduce times -> the cluster's intra_node
// efficiency and latency, through the cost model's ring formula (planner::ring_allreduce_s).
#pragma once

#include <string>
#include <vector>

#include "clusters/cluster.hpp"

namespace pw::calibrate {

struct AllReduceSample {
  int gpus = 0;
  double bytes = 0;
  double time_s = 0;  // out of place
};

// An nccl-tests all-reduce table as CSV ("size(B),count,type,time(ns),busbw(GB/s),...": the first
// time(ns) column, out of place). The GPU count comes from the file name ("allreduce_8gpu.csv").
std::vector<AllReduceSample> read_allreduce_csv(const std::string& path);

struct CollectiveFit {
  double efficiency = 1;  // of intra_node.bandwidth_bytes_per_s, in (0, 1)
  double latency_s = 0;   // per ring step
  std::vector<double> predicted_s;
  std::string status;
};

// Least squares on log(predicted / measured) with predicted = ring_allreduce_s(bytes, n, link),
// link = (bandwidth_bytes_per_s * efficiency, latency_s).
CollectiveFit fit_intra_node(const std::vector<AllReduceSample>& samples,
                             double bandwidth_bytes_per_s);

}  // namespace pw::calibrate
