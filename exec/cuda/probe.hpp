// Measurements of this machine's GPU for a cluster description of it (`pipewright validate
// --backend cuda`, every pipeline rank a thread on the one GPU): what the GPU calls itself, the
// LocalTransport's latency and bandwidth (a ping-pong between two ranks on their own streams), and
// the "gpu-host" cluster built from them (exec/gpu_host.hpp, host-only, does the preset matching).
// Header without CUDA types, so cli/ can include it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "clusters/cluster.hpp"
#include "exec/gpu_host.hpp"
#include "exec/probe.hpp"

namespace pw::exec::cuda {

// The current device (cudaGetDevice; CUDA_VISIBLE_DEVICES picks it).
struct GpuInfo {
  int device = 0;
  std::string name;               // cudaGetDeviceProperties().name, "NVIDIA H100 80GB HBM3"
  std::int64_t memory_bytes = 0;  // totalGlobalMem
  int major = 0, minor = 0;       // compute capability
  std::string versions;           // "CUDA driver 13.0, runtime 13.0, cuBLASLt 130000, sm_90"
};
// Throws InputError "no CUDA device (...)" without one.
GpuInfo current_gpu();

// Two ranks of a LocalTransport, each a thread with its own stream on the current GPU, ping-pong
// `round_trips` messages of each size (device buffers; rank 1 sends back what it received, so a
// round trip is two sends and two receives, each a device copy into and out of a staging block).
// A round trip is timed on the host clock from rank 0's send to the end of cudaStreamSynchronize
// after its receive; one way is half the median round trip (after a few warm-up trips). Sizes are
// rounded up to 2 bytes (a bf16 element). The fit: exec::fit_transport (at least two sizes).
TransportFit measure_local_transport(const std::vector<std::int64_t>& sizes_bytes,
                                     int round_trips = 200);

// What offload runs on in the CUDA executor, measured on the current GPU (`validate --backend
// cuda` with an offload plan): a copy between a device buffer and pinned host memory
// (cudaMemcpyAsync on a stream of its own, then cudaStreamSynchronize, timed on the host clock as
// the worker's chunk moments wait for their evictions), each size `repeats` times each way after
// two warm-ups, both directions' medians fitted together (exec::fit_transport: latency + bytes /
// bandwidth); and the host's optimizer update (exec::measure_optimizer_rate: the CUDA worker's CPU
// Adam is the same function in a host function). Sizes are rounded up to 2 bytes; at least two
// distinct sizes. For exec::add_host with one core (host functions of different streams may be
// serialized: CUDA runtime API, cudaLaunchHostFunc).
HostFit measure_host(const std::vector<std::int64_t>& sizes_bytes, const TrainOptions& options,
                     std::int64_t params = 1 << 20, int repeats = 20);

// exec::gpu_host_cluster for the current GPU: its name and total memory, `ranks` devices, `link`
// as the intra-node link, this host's memory. Throws a one-line InputError naming the GPU and the
// presets when no device preset matches it.
clusters::Cluster gpu_host_cluster(int ranks, const TransportFit& link);

// The GPU's preset peak for a dtype, for MFU (host-only; see exec/gpu_host.hpp).
using exec::device_peak_flops;

}  // namespace pw::exec::cuda
