// Every simulated transfer reports (from, to, bytes) here, so the simulator can count link bytes.
#pragma once

#include <functional>

#include <simgrid/s4u/Host.hpp>

namespace pw::sim {

using TransferObserver =
    std::function<void(simgrid::s4u::Host* from, simgrid::s4u::Host* to, double bytes)>;

// One observer per process (there is one simulation per process); nullptr removes it.
void set_transfer_observer(TransferObserver observer);
void observe_transfer(simgrid::s4u::Host* from, simgrid::s4u::Host* to, double bytes);

}  // namespace pw::sim
