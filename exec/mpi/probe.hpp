// The link between two processes of an mpirun job as validate measures it: a ping-pong over
// MpiTransport (the CPU ranks' transport), fitted as latency + bytes / bandwidth.
#pragma once

#include <cstdint>
#include <vector>

#include "exec/mpi/launch.hpp"
#include "exec/probe.hpp"

namespace pw::exec {

// Ranks 0 and 1 ping-pong `round_trips` messages of each size (after a few warm-up trips) over
// MpiTransport, each received message copied into a fresh buffer as the workers do; the one-way
// time is half the median round trip. Every process calls it (the others only wait, napping, for
// the end). Rank 0 also times each of its send calls (how long a send holds the sending thread:
// send_samples, fitted by fit_send_overhead). The fit is rank 0's (empty elsewhere). Needs at
// least 2 processes.
TransportFit measure_mpi_transport(const MpiSession& mpi,
                                   const std::vector<std::int64_t>& sizes_bytes, int round_trips,
                                   double timeout_s = 300);

// A barrier over every process that naps while it waits (a rank waiting here leaves its core to
// the ranks computing), with a timeout naming `op`.
void wait_for_all(const MpiSession& mpi, const std::string& op, double timeout_s = 300);

}  // namespace pw::exec
