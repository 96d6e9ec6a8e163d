// The process's transfer observer (see observer.hpp).
#include "sim/observer.hpp"

namespace pw::sim {

namespace {
TransferObserver& observer() {
  static TransferObserver o;
  return o;
}
}  // namespace

void set_transfer_observer(TransferObserver o) {
  observer() = std::move(o);
}

void observe_transfer(simgrid::s4u::Host* from, simgrid::s4u::Host* to, double bytes) {
  if (observer()) observer()(from, to, bytes);
}

}  // namespace pw::sim
