// GPU probes: what the GPU calls itself, the LocalTransport ping-pong, the gpu-host cluster.
#include "exec/cuda/probe.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <exception>
#include <thread>

#include <fmt/format.h>

#include "common/error.hpp"
#include "exec/cuda/arena.hpp"
#include "exec/cuda/device.hpp"
#include "exec/cuda/handles.hpp"
#include "exec/cuda/local_transport.hpp"
#include "exec/cuda/worker.hpp"

namespace pw::exec::cuda {

namespace {

using Clock = std::chrono::steady_clock;

std::string version_text(int v) {  // 13000 -> "13.0"
  return fmt::format("{}.{}", v / 1000, (v % 1000) / 10);
}

// Median one-way time of `trips` round trips of `bytes` between ranks 0 and 1 of a LocalTransport.
double ping_pong(DeviceArena& arena, std::int64_t bytes, int trips) {
  const int device = arena.device();
  const int warm_up = std::max(3, trips / 10);
  DeviceBuffer ping(arena, Category::activations, bytes), pong(arena, Category::activations, bytes),
      echo(arena, Category::activations, bytes);
  CUDA_CHECK(cudaMemset(ping.data(), 0, std::size_t(bytes)));
  CUDA_CHECK(cudaDeviceSynchronize());
  // Declared after the buffers: destroyed first, after both threads' work has finished.
  LocalTransport t(arena, 2, /*timeout_s=*/60);
  std::exception_ptr peer_error;
  // Rank 1: receive, send the same buffer back (the stream orders the copy out after the copy in).
  std::thread peer([&] {
    try {
      CUDA_CHECK(cudaSetDevice(device));
      const Stream s;
      for (int i = 0; i < warm_up + trips; ++i) {
        t.recv(0, 1, Channel::activation, echo.data(), bytes, s.get());
        t.send(1, 0, Channel::gradient, echo.data(), bytes, s.get());
      }
      t.synchronize(1, s.get(), "ping-pong echo");
    } catch (...) {
      peer_error = std::current_exception();
      t.abort();
    }
  });
  std::vector<double> times;
  try {
    CUDA_CHECK(cudaSetDevice(device));
    const Stream s;
    for (int i = 0; i < warm_up + trips; ++i) {
      const auto a = Clock::now();
      t.send(0, 1, Channel::activation, ping.data(), bytes, s.get());
      t.recv(1, 0, Channel::gradient, pong.data(), bytes, s.get());
      CUDA_CHECK(cudaStreamSynchronize(s.get()));
      if (i >= warm_up) times.push_back(std::chrono::duration<double>(Clock::now() - a).count());
    }
  } catch (...) {
    t.abort();
    peer.join();
    if (peer_error) std::rethrow_exception(peer_error);  // the cause; ours is its consequence
    throw;
  }
  peer.join();
  if (peer_error) std::rethrow_exception(peer_error);
  std::sort(times.begin(), times.end());
  return times[times.size() / 2] / 2;
}

}  // namespace

GpuInfo current_gpu() {
  if (cuda_device_count() == 0) throw InputError(no_device_reason());
  GpuInfo g;
  CUDA_CHECK(cudaGetDevice(&g.device));
  cudaDeviceProp p{};
  CUDA_CHECK(cudaGetDeviceProperties(&p, g.device));
  g.name = p.name;
  g.memory_bytes = std::int64_t(p.totalGlobalMem);
  g.major = p.major;
  g.minor = p.minor;
  int driver = 0, runtime = 0;
  CUDA_CHECK(cudaDriverGetVersion(&driver));
  CUDA_CHECK(cudaRuntimeGetVersion(&runtime));
  g.versions = fmt::format("CUDA driver {}, runtime {}, cuBLASLt {}, sm_{}{}", version_text(driver),
                           version_text(runtime), cublasLtGetVersion(), p.major, p.minor);
  return g;
}

TransportFit measure_local_transport(const std::vector<std::int64_t>& sizes_bytes,
                                     int round_trips) {
  if (round_trips < 1) throw InputError("transport probe: round trips must be at least 1");
  std::vector<std::int64_t> sizes;
  for (std::int64_t b : sizes_bytes)
    sizes.push_back(std::max<std::int64_t>(2, (b + 1) / 2 * 2));  // whole bf16 elements
  std::sort(sizes.begin(), sizes.end());
  sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
  if (sizes.size() < 2)
    throw InputError("transport probe: at least two distinct message sizes are needed");
  current_gpu();  // a device, or the one-line reason there is none
  // Three buffers of the largest size and the staging blocks in flight (a message each way and
  // those retiring behind their copies), with room to spare.
  const std::int64_t largest = (sizes.back() + 255) / 256 * 256;
  DeviceArena arena(16 * largest + (64 << 20));
  std::vector<TransportSample> samples;
  for (std::int64_t bytes : sizes)
    samples.push_back({bytes, ping_pong(arena, bytes, round_trips)});
  return fit_transport(samples);
}

HostFit measure_host(const std::vector<std::int64_t>& sizes_bytes, const TrainOptions& options,
                     std::int64_t params, int repeats) {
  if (repeats < 1) throw InputError("host probe: repeats must be at least 1");
  std::vector<std::int64_t> sizes;
  for (std::int64_t b : sizes_bytes)
    sizes.push_back(std::max<std::int64_t>(2, (b + 1) / 2 * 2));
  std::sort(sizes.begin(), sizes.end());
  sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
  if (sizes.size() < 2) throw InputError("host probe: at least two distinct copy sizes are needed");
  current_gpu();  // a device, or the one-line reason there is none
  const std::int64_t largest = (sizes.back() + 255) / 256 * 256;
  DeviceArena arena(largest + (16 << 20));
  DeviceBuffer device(arena, Category::workspace, largest);
  MemoryCounter host_counter;
  const detail::PinnedBuffer host(host_counter, Category::workspace, largest);
  CUDA_CHECK(cudaMemset(device.data(), 0, std::size_t(largest)));
  std::memset(host.as<char>(), 0, std::size_t(largest));
  CUDA_CHECK(cudaDeviceSynchronize());
  const Stream stream;
  std::vector<TransportSample> samples;
  for (std::int64_t bytes : sizes)
    for (const bool down : {true, false}) {
      std::vector<double> times;
      for (int k = -2; k < repeats; ++k) {  // two warm-up copies
        const auto t0 = Clock::now();
        if (down)
          CUDA_CHECK(cudaMemcpyAsync(host.as<char>(), device.data(), std::size_t(bytes),
                                     cudaMemcpyDeviceToHost, stream.get()));
        else
          CUDA_CHECK(cudaMemcpyAsync(device.data(), host.as<char>(), std::size_t(bytes),
                                     cudaMemcpyHostToDevice, stream.get()));
        CUDA_CHECK(cudaStreamSynchronize(stream.get()));
        if (k >= 0) times.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
      }
      std::sort(times.begin(), times.end());
      samples.push_back({bytes, times[times.size() / 2]});
    }
  HostFit fit;
  fit.copy = fit_transport(samples);
  fit.optimizer_params_per_s = measure_optimizer_rate(options, params, repeats);
  fit.copy_what = "cudaMemcpyAsync to and from pinned host memory";
  return fit;
}

clusters::Cluster gpu_host_cluster(int ranks, const TransportFit& link) {
  const GpuInfo g = current_gpu();
  return exec::gpu_host_cluster(g.name, g.memory_bytes, ranks, link, host_memory_bytes());
}

}  // namespace pw::exec::cuda
