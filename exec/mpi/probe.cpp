// The MPI ping-pong probe (exec/mpi/probe.hpp).
#include "exec/mpi/probe.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "exec/mpi/transport.hpp"

namespace pw::exec {

#if PW_HAVE_MPI

TransportFit measure_mpi_transport(const MpiSession& mpi,
                                   const std::vector<std::int64_t>& sizes_bytes, int round_trips,
                                   double timeout_s) {
  if (mpi.size() < 2) throw Error("measure_mpi_transport: needs at least 2 processes");
  using Clock = std::chrono::steady_clock;
  MpiTransport t(mpi.rank(), timeout_s);
  t.barrier("ping-pong start barrier");
  std::vector<TransportSample> samples, send_samples;
  const int warm_up = std::max(3, round_trips / 10);
  if (mpi.rank() <= 1) {
    for (const std::int64_t bytes : sizes_bytes) {
      const std::size_t n = std::size_t(std::max<std::int64_t>(bytes / 4, 1));
      std::vector<float> out(n, 1.0f);
      std::vector<double> times, sends;
      for (int i = 0; i < warm_up + round_trips; ++i) {
        if (mpi.rank() == 0) {
          const auto a = Clock::now();
          t.send(0, 1, Channel::activation, std::vector<float>(out.begin(), out.end()));
          if (i >= warm_up)
            sends.push_back(std::chrono::duration<double>(Clock::now() - a).count());
          std::vector<float> back = t.recv(1, 0, Channel::gradient);
          std::vector<float> copy(back.size());
          std::memcpy(copy.data(), back.data(), back.size() * sizeof(float));
          if (i >= warm_up)
            times.push_back(std::chrono::duration<double>(Clock::now() - a).count());
        } else {
          std::vector<float> in = t.recv(0, 1, Channel::activation);
          std::vector<float> copy(in.size());
          std::memcpy(copy.data(), in.data(), in.size() * sizeof(float));
          t.send(1, 0, Channel::gradient, std::move(copy));
        }
      }
      if (mpi.rank() == 0) {
        std::sort(times.begin(), times.end());
        samples.push_back({std::int64_t(n * sizeof(float)), times[times.size() / 2] / 2});
        std::sort(sends.begin(), sends.end());
        send_samples.push_back({std::int64_t(n * sizeof(float)), sends[sends.size() / 2]});
      }
    }
    t.flush();
  }
  t.barrier("ping-pong end barrier");
  if (mpi.rank() != 0) return TransportFit{};
  TransportFit fit = fit_transport(samples);
  fit.send_samples = std::move(send_samples);
  fit_send_overhead(fit);
  return fit;
}

void wait_for_all(const MpiSession& mpi, const std::string& op, double timeout_s) {
  MpiTransport(mpi.rank(), timeout_s).barrier(op);
}

#else

TransportFit measure_mpi_transport(const MpiSession&, const std::vector<std::int64_t>&, int,
                                   double) {
  throw Error("this pipewright was built without MPI: install libopenmpi-dev and rebuild");
}

void wait_for_all(const MpiSession&, const std::string&, double) {}

#endif

}  // namespace pw::exec
