// This machine's GPU as a cluster description, host-only (no CUDA): which device preset a GPU's
// name (cudaGetDeviceProperties) is, its peak FLOP/s, and the "gpu-host" cluster that `pipewright
// validate --backend cuda` simulates on (every pipeline rank a thread on the one GPU).
// exec/cuda/probe.hpp measures the GPU and the transport and calls these.
#pragma once

#include <cstdint>
#include <string>

#include "clusters/cluster.hpp"
#include "exec/probe.hpp"
#include "models/model.hpp"

namespace pw::exec {

// What each CUDA stage (a model chunk of a rank) keeps on its device besides the planner's
// figures: its cuBLASLt workspace (32 MiB, what cuBLAS recommends on Hopper) and its status word
// (two id counts and the loss, 4 bytes each). The rank's memory counter holds them as workspace.
inline constexpr std::int64_t kCudaGemmWorkspaceBytes = std::int64_t(32) << 20;
inline constexpr std::int64_t kCudaStatusBytes = 12;

// The device preset (clusters/devices) a GPU's name is, or "" when none is. The name is split into
// upper-case words at spaces and '-' ("NVIDIA A100-SXM4-80GB": NVIDIA, A100, SXM4, 80GB); it
// matches a preset when it has the preset's model word (H100, H200, A100, V100: "GH200" is not
// "H200") and the preset's memory word ("80GB") where the preset names one (H100, A100, V100: their
// names carry it); the H200 matches with any memory word or none. PCIe and NVL parts ("NVIDIA H100
// PCIe", "NVIDIA H200 NVL") match none: they have lower clocks, power and memory bandwidth than the
// SXM parts the presets describe.
//   "NVIDIA H100 80GB HBM3" -> H100-SXM, "NVIDIA H200" -> H200, "NVIDIA A100-SXM4-40GB" ->
//   A100-40GB, "Tesla V100-SXM2-32GB" -> V100-32GB.
std::string gpu_device_preset(const std::string& gpu_name);

// The CUDA backend computes in bf16: an InputError naming the model unless its dtype has 2 bytes
// (bf16, or fp16, which runs as bf16). Used by training, profiling and validate alike.
void check_gpu_model(const models::ModelSpec& model);

// The preset's figures under the GPU's own name. Throws a one-line InputError naming the GPU and
// the names the presets match when none does.
clusters::DeviceSpec gpu_device_spec(const std::string& gpu_name);

// Dense peak of the GPU's preset for `dtype` (fp16 and bf16: the tensor-core peak; fp32: the
// non-tensor peak), for MFU. Throws as gpu_device_spec.
double device_peak_flops(const std::string& gpu_name, models::DType dtype);

// "gpu-host": one node of `ranks` devices that are all the same physical GPU, named `gpu_name` (as
// profile_cuda names its traces), with its preset's peaks and memory bandwidth. Each device's
// memory is the WHOLE GPU's (`gpu_memory_bytes`), not a share of it: the simulator checks memory
// per rank, so a plan whose ranks together need more than the GPU still "fits" there (the real run
// then fails to allocate); likewise each rank computes at the full peak, while on the real GPU
// ranks that compute at the same time share it. The intra-node link is `link` (the measured
// LocalTransport fit), kind "pcie" for a port per device with no per-pair division (as cpu-host);
// no network; host memory `host_memory_bytes`, PCIe figures from the single-GPU cluster preset of
// the same device (h100-x1, h200-x1) when there is one, else none. Throws as gpu_device_spec, and
// an InputError for ranks < 1 or a link without bandwidth.
clusters::Cluster gpu_host_cluster(const std::string& gpu_name, std::int64_t gpu_memory_bytes,
                                   int ranks, const TransportFit& link,
                                   std::int64_t host_memory_bytes);

}  // namespace pw::exec
