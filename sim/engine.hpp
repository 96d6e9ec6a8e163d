// The SimGrid engine, configured so simulated times equal the hand formulas (CM02, no TCP effects).
#pragma once

#include <memory>

#include <simgrid/s4u/Engine.hpp>

namespace pw::sim {

namespace sg4 = simgrid::s4u;

// Makes the process's SimGrid engine: logs below warning silenced; network model CM02 with
// latency and bandwidth factors 1, no cross-traffic, TCP-gamma 0 (no window bound) and weight-S 0
// (no RTT unfairness), so a message of S bytes over a path of latency L and bottleneck bandwidth B
// takes exactly L + S / B. Call it before build_platform().
//
// SimGrid allows ONE Engine per process, ever: a second one aborts the process, even after the
// first is destroyed. make_engine() throws pw::Error instead of making a second one. A test that
// runs a simulation must therefore be its own TEST (ctest runs each TEST in its own process) and
// call make_engine() itself; never run two simulations in one TEST.
std::unique_ptr<sg4::Engine> make_engine();

}  // namespace pw::sim
