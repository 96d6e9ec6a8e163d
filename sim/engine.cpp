// The SimGrid engine, configured so simulated times equal the hand formulas (CM02, no TCP effects).
#include "sim/engine.hpp"

#include <atomic>
#include <string>

#include "common/error.hpp"

namespace pw::sim {

std::unique_ptr<sg4::Engine> make_engine() {
  static std::atomic<bool> made{false};
  if (made.exchange(true) || sg4::Engine::has_instance())
    throw Error("SimGrid allows one engine per process: make_engine() was already called");
  // SimGrid parses (and may rewrite) argv, so it gets writable copies.
  std::string prog = "pipewright-sim", log = "--log=root.thresh:warning";
  char* argv[] = {prog.data(), log.data(), nullptr};
  int argc = 2;
  auto engine = std::make_unique<sg4::Engine>(&argc, argv);
  // Must come before any zone is created (later is fatal).
  sg4::Engine::set_config("network/model:CM02");
  sg4::Engine::set_config("network/crosstraffic:0");
  sg4::Engine::set_config("network/TCP-gamma:0");
  sg4::Engine::set_config("network/weight-S:0");
  sg4::Engine::set_config("network/latency-factor:1");
  sg4::Engine::set_config("network/bandwidth-factor:1");
  return engine;
}

}  // namespace pw::sim
