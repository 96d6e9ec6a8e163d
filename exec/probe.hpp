// Measurements of this machine for a cluster description of it (`pipewright validate`): the
// in-process transport's latency and bandwidth (a ping-pong between two threads), the fp32 GEMM
// rate of one core, and the "cpu-host" cluster built from them: its cores as devices, the
// in-process transport as the intra-node link.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "clusters/cluster.hpp"
#include "exec/runtime.hpp"

namespace pw::exec {

struct TransportSample {
  std::int64_t bytes = 0;
  double one_way_s = 0;  // median over the round trips, halved
};

struct TransportFit {
  double latency_s = 0;              // fitted time of an empty message
  double bandwidth_bytes_per_s = 0;  // fitted inverse slope
  std::vector<TransportSample> samples;
  // How long the send call held the sending thread (MPI probe only; empty elsewhere): per size the
  // median over the round trips (`one_way_s` holds it), fitted as send_overhead_s + bytes /
  // send_overhead_bytes_per_s (clusters::Network's fields of the same names).
  std::vector<TransportSample> send_samples;
  double send_overhead_s = 0, send_overhead_bytes_per_s = 0;
};

// Least-squares fit of t = latency + bytes / bandwidth over the samples (at least two distinct
// sizes). The latency is at least 0; a slope of 0 or less (noise) gives the fastest sample's
// bandwidth-only figure, never infinity.
TransportFit fit_transport(const std::vector<TransportSample>& samples);

// Least-squares fit of the send calls' durations (send_samples) as overhead + bytes / rate into
// `fit`'s send_overhead_s and send_overhead_bytes_per_s: both >= 0; a slope of 0 or less (size
// made no difference) gives no per-byte part (rate 0) and the mean as the per-message time; a
// negative intercept gives 0 per message and the slope through the origin.
void fit_send_overhead(TransportFit& fit);

// Two threads ping-pong `round_trips` messages of each size over exec::InProcessTransport, each
// message copied out of a buffer into the send and copied into a fresh buffer on receipt, as the
// workers do; the one-way time is half the median round trip (after a few warm-up trips).
TransportFit measure_in_process_transport(const std::vector<std::int64_t>& sizes_bytes,
                                          int round_trips = 200);

// fp32 GEMM rate of one core (OpenBLAS single-threaded, n x n x n, best of `repeats` after a
// warm-up), the practical peak a stage's matmuls can reach.
double measure_sgemm_flops_per_s(int n = 512, int repeats = 5);

// Host memory (physical pages x page size) and hardware threads (at least 1).
std::int64_t host_memory_bytes();
int hardware_threads();

// "cpu-host": one node of `cores` devices named "cpu" (as profiled traces name it) (peak =
// `gemm_flops_per_s` for fp32 and fp16, memory = host RAM, memory bandwidth = twice the
// transport's, so that messages between ranks sharing a core cost the measured bandwidth: the
// simulator's same-device link runs at half the memory bandwidth), an intra-node fabric of kind
// "pcie" (a port per device, no per-pair division) with the transport's latency and bandwidth, no
// network, no host-device PCIe.
clusters::Cluster cpu_host_cluster(int cores, const TransportFit& transport,
                                   double gemm_flops_per_s);

// What offload runs on in the CPU executor, measured: a copy between the emulated device and the
// host pool (a memcpy of a buffer on a copy engine's thread, handed over and waited for as the
// workers do: `copy` fitted as latency + bytes / bandwidth over `sizes_bytes`, median of
// `repeats` each), and the optimizer update of one core (measure_optimizer_rate). `copy_what`
// says what the copy was (add_host writes it into the cluster's notes); the CUDA backend's
// measurement is exec::cuda::measure_host (pinned copies, the same optimizer rate).
struct HostFit {
  TransportFit copy;
  double optimizer_params_per_s = 0;
  std::string copy_what;
};
HostFit measure_host(const std::vector<std::int64_t>& sizes_bytes, const TrainOptions& options,
                     std::int64_t params = 1 << 20, int repeats = 20);

// The host's optimizer update on one core: exec::optimizer_update with `options` over `params`
// floats, parameters per second, median of `repeats` after a warm-up (CPU Adam of both backends:
// the CUDA worker's host functions run the same function).
double measure_optimizer_rate(const TrainOptions& options, std::int64_t params = 1 << 20,
                              int repeats = 20);

// `cluster` with the host side that offload plans need, from `host`: each device's host link the
// measured copy (kind pcie: no ceiling, one device per uplink), pinned memory the host's RAM, the
// CPU Adam rate the measured one per core over `cores` cores (at least 1 and at most the
// hardware threads; the CPU worker runs each rank's host work on an engine thread of its own, so
// it passes its ranks; the CUDA backend 1: host functions of different streams may be
// serialized).
void add_host(clusters::Cluster& cluster, const HostFit& host, int cores);

}  // namespace pw::exec
