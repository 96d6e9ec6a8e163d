// Internal to sim/: the Chrome-trace timeline (Perfetto, chrome://tracing) of a simulation.
#pragma once

#include "common/json_reader.hpp"
#include "sim/world.hpp"

namespace pw::sim::detail {

// A process per rank, a thread per stream (compute, send, recv, collective), each op a complete
// event ("ph": "X", microseconds), and the rank's memory as a counter track.
common::Json chrome_trace(const World& w);

}  // namespace pw::sim::detail
