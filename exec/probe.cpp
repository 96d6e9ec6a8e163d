// Machine probes: in-process transport ping-pong, one core's GEMM rate, the cpu-host cluster.
#include "exec/probe.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <exception>
#include <thread>
#include <utility>

#include <cblas.h>
#include <fmt/format.h>
#include <unistd.h>

#include "common/error.hpp"
#include "exec/copy_engine.hpp"
#include "exec/optimizer.hpp"
#include "exec/profile_driver.hpp"
#include "exec/transport.hpp"

namespace pw::exec {

namespace {

using Clock = std::chrono::steady_clock;

// Median one-way time of `trips` round trips of `floats` floats between two threads.
double ping_pong(std::int64_t floats, int trips) {
  InProcessTransport t;
  const std::size_t n = std::size_t(std::max<std::int64_t>(floats, 1));
  const int warm_up = std::max(3, trips / 10);
  std::exception_ptr error;
  // The echo side: receive into a fresh buffer (as Worker::to_buffer does), send it back.
  std::thread echo([&] {
    try {
      for (int i = 0; i < warm_up + trips; ++i) {
        std::vector<float> in = t.recv(0, 1, Channel::activation);
        std::vector<float> copy(in.size());
        std::memcpy(copy.data(), in.data(), in.size() * sizeof(float));
        t.send(1, 0, Channel::gradient, std::vector<float>(copy.begin(), copy.end()));
      }
    } catch (...) {
      error = std::current_exception();
    }
  });
  std::vector<double> times;
  std::vector<float> out(n, 1.0f);
  try {
    for (int i = 0; i < warm_up + trips; ++i) {
      const auto a = Clock::now();
      t.send(0, 1, Channel::activation, std::vector<float>(out.begin(), out.end()));
      std::vector<float> back = t.recv(1, 0, Channel::gradient);
      std::vector<float> copy(back.size());
      std::memcpy(copy.data(), back.data(), back.size() * sizeof(float));
      if (i >= warm_up) times.push_back(std::chrono::duration<double>(Clock::now() - a).count());
    }
  } catch (...) {
    t.abort();
    echo.join();
    throw;
  }
  echo.join();
  if (error) std::rethrow_exception(error);
  std::sort(times.begin(), times.end());
  return times[times.size() / 2] / 2;
}

}  // namespace

namespace {

// The sums of a least-squares line y = intercept + slope x through (bytes, time) samples (times
// below 0 taken as 0).
struct LineSums {
  double n = 0, sx = 0, sy = 0, sxx = 0, sxy = 0;
  explicit LineSums(const std::vector<TransportSample>& samples) : n(double(samples.size())) {
    for (const auto& s : samples) {
      const double x = double(s.bytes), y = std::max(0.0, s.one_way_s);
      sx += x;
      sy += y;
      sxx += x * x;
      sxy += x * y;
    }
  }
  double denominator() const { return n * sxx - sx * sx; }  // 0 when every x is the same
  double slope() const { return (n * sxy - sx * sy) / denominator(); }
  double intercept(double slope) const { return (sy - slope * sx) / n; }
};

}  // namespace

TransportFit fit_transport(const std::vector<TransportSample>& samples) {
  TransportFit f;
  f.samples = samples;
  if (samples.size() < 2) throw Error("fit_transport: at least two message sizes are needed");
  const LineSums sums(samples);
  if (sums.denominator() <= 0) throw Error("fit_transport: the message sizes must differ");
  const double slope = sums.slope();
  const double intercept = sums.intercept(slope);
  if (slope > 0) {
    f.bandwidth_bytes_per_s = 1.0 / slope;
    f.latency_s = std::max(0.0, intercept);
  } else {
    // Size made no measurable difference: the latency is the smallest time, the bandwidth that of
    // the largest message sent in the largest time (a lower bound).
    double smallest = samples[0].one_way_s, largest_t = 0;
    std::int64_t largest_bytes = 0;
    for (const auto& s : samples) {
      smallest = std::min(smallest, s.one_way_s);
      largest_t = std::max(largest_t, s.one_way_s);
      largest_bytes = std::max(largest_bytes, s.bytes);
    }
    f.latency_s = smallest;
    f.bandwidth_bytes_per_s = double(largest_bytes) / std::max(largest_t, 1e-9);
  }
  return f;
}

void fit_send_overhead(TransportFit& fit) {
  const std::vector<TransportSample>& samples = fit.send_samples;
  fit.send_overhead_s = 0;
  fit.send_overhead_bytes_per_s = 0;
  if (samples.empty()) return;
  const LineSums sums(samples);
  const double slope = sums.denominator() > 0 ? sums.slope() : 0;
  if (slope <= 0) {
    fit.send_overhead_s = sums.sy / sums.n;
    return;
  }
  const double intercept = sums.intercept(slope);
  if (intercept >= 0) {
    fit.send_overhead_s = intercept;
    fit.send_overhead_bytes_per_s = 1.0 / slope;
  } else {
    fit.send_overhead_bytes_per_s = sums.sxx / sums.sxy;  // y = x (sxy / sxx): through the origin
  }
}

TransportFit measure_in_process_transport(const std::vector<std::int64_t>& sizes_bytes,
                                          int round_trips) {
  if (round_trips < 1) throw InputError("transport probe: round trips must be at least 1");
  std::vector<std::int64_t> sizes = sizes_bytes;
  std::sort(sizes.begin(), sizes.end());
  sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
  std::vector<TransportSample> samples;
  for (std::int64_t bytes : sizes) {
    const std::int64_t floats = std::max<std::int64_t>(1, bytes / 4);
    samples.push_back({floats * 4, ping_pong(floats, round_trips)});
  }
  return fit_transport(samples);
}

double measure_sgemm_flops_per_s(int n, int repeats) {
  openblas_set_num_threads(1);  // as the workers run it: one core each
  std::vector<float> a(std::size_t(n) * n, 0.5f), b(a.size(), 0.25f), c(a.size(), 0.0f);
  auto gemm = [&] {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a.data(), n, b.data(), n,
                0.0f, c.data(), n);
  };
  gemm();  // warm-up
  double best = 0;
  for (int i = 0; i < std::max(1, repeats); ++i) {
    const auto t0 = Clock::now();
    gemm();
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    if (s > 0) best = std::max(best, 2.0 * n * n * double(n) / s);
  }
  return best;
}

std::int64_t host_memory_bytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? std::int64_t(pages) * page : 0;
}

int hardware_threads() {
  return std::max(1u, std::thread::hardware_concurrency());
}

clusters::Cluster cpu_host_cluster(int cores, const TransportFit& transport,
                                   double gemm_flops_per_s) {
  if (cores < 1) throw InputError("cpu-host cluster: at least one core");
  if (transport.bandwidth_bytes_per_s <= 0 || gemm_flops_per_s <= 0)
    throw Error("cpu-host cluster: the transport bandwidth and the GEMM rate must be positive");
  clusters::Cluster c;
  c.name = "cpu-host";
  c.nodes = 1;
  c.gpus_per_node = cores;
  c.device.name = "cpu";  // the device name profile_cpu gives its traces
  c.device.peak_fp32_flops_per_s = gemm_flops_per_s;
  c.device.peak_fp16_flops_per_s = gemm_flops_per_s;
  c.device.memory_bandwidth_bytes_per_s = 2 * transport.bandwidth_bytes_per_s;
  const std::int64_t ram = std::max<std::int64_t>(host_memory_bytes(), 1);
  c.device.memory_bytes = ram;
  c.device.notes =
      "one core of this machine: peak = measured single-threaded OpenBLAS sgemm rate; memory = "
      "host RAM; memory bandwidth = 2 x the in-process transport's (the simulator's same-device "
      "link is half of it)";
  c.intra_node.kind = cores > 1 ? clusters::IntraKind::pcie : clusters::IntraKind::none;
  c.intra_node.bandwidth_bytes_per_s = transport.bandwidth_bytes_per_s;
  c.intra_node.latency_s = transport.latency_s;
  c.intra_node.efficiency = 1;
  c.host.memory_bytes = ram;
  c.notes = fmt::format(
      "this machine as measured by pipewright validate: {} cores as devices; the intra-node link "
      "is the in-process transport (thread ping-pong fit: {:.3g} us + bytes / {:.3g} GB/s), "
      "kind pcie for a port per device with no per-pair division",
      cores, transport.latency_s * 1e6, transport.bandwidth_bytes_per_s / 1e9);
  return c;
}

HostFit measure_host(const std::vector<std::int64_t>& sizes_bytes, const TrainOptions& options,
                     std::int64_t params, int repeats) {
  if (sizes_bytes.size() < 2 || params < 1 || repeats < 1)
    throw Error("measure_host: two sizes or more, one parameter and one repeat at least");
  const auto median = [](std::vector<double> t) {
    return profiling::summarize(std::move(t), ProfileStatistic::median);
  };
  HostFit fit;
  CopyEngine engine;
  std::vector<TransportSample> samples;
  for (std::int64_t bytes : sizes_bytes) {
    const std::size_t n = std::size_t(std::max<std::int64_t>(bytes / 4, 1));
    std::vector<float> from(n, 1.0f), to(n, 0.0f);
    std::vector<double> times;
    for (int k = -2; k < repeats; ++k) {  // two warm-up copies
      const auto t0 = Clock::now();
      engine.wait(engine.submit([&] { std::memcpy(to.data(), from.data(), n * sizeof(float)); }));
      if (k >= 0) times.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    }
    samples.push_back({std::int64_t(n * sizeof(float)), median(times)});
  }
  fit.copy = fit_transport(samples);
  fit.optimizer_params_per_s = measure_optimizer_rate(options, params, repeats);
  fit.copy_what = "a copy engine's memcpy";
  return fit;
}

double measure_optimizer_rate(const TrainOptions& options, std::int64_t params, int repeats) {
  if (params < 1 || repeats < 1)
    throw Error("measure_optimizer_rate: one parameter and one repeat at least");
  const std::size_t n = std::size_t(params);
  std::vector<float> w(n, 0.5f), g(n), m(n, 0.0f), v(n, 0.0f);
  std::vector<double> times;
  for (int k = -1; k < repeats; ++k) {
    std::fill(g.begin(), g.end(), 1e-3f);  // the update zeroes the gradient
    const auto t0 = Clock::now();
    optimizer_update(options, k + 2, w.data(), w.data(), g.data(), m.data(), v.data(), params);
    if (k >= 0) times.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return double(params) /
         std::max(profiling::summarize(std::move(times), ProfileStatistic::median), 1e-12);
}

void add_host(clusters::Cluster& cluster, const HostFit& host, int cores) {
  if (host.copy.bandwidth_bytes_per_s <= 0 || host.optimizer_params_per_s <= 0)
    throw Error("cluster " + cluster.name +
                ": the host copy bandwidth and optimizer rate must be positive");
  clusters::Host& h = cluster.host;
  h.pcie_bandwidth_bytes_per_s = host.copy.bandwidth_bytes_per_s;
  h.pcie_latency_s = host.copy.latency_s;
  h.link = clusters::HostLinkKind::pcie;
  h.pinned_memory_bytes = h.memory_bytes;
  h.gpus_per_uplink = 1;
  h.uplink_bandwidth_bytes_per_s = h.pcie_bandwidth_bytes_per_s;
  h.cpu_cores = std::max(1, std::min(cores, hardware_threads()));
  h.cpu_adam_params_per_s_per_core = host.optimizer_params_per_s;
  cluster.notes += fmt::format(
      "; host link: {} ({:.3g} us + bytes / {:.3g} GB/s), CPU Adam {:.3g} parameters/s per core "
      "over {} core{}",
      host.copy_what.empty() ? "the measured copy" : host.copy_what, host.copy.latency_s * 1e6,
      host.copy.bandwidth_bytes_per_s / 1e9, host.optimizer_params_per_s, h.cpu_cores,
      h.cpu_cores == 1 ? "" : "s");
}

}  // namespace pw::exec
