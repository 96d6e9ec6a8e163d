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
#ifdef PW_SANITIZED_BUILD
  // ASan cannot follow SimGrid's default (ucontext/raw) stack switches, and reports false stack
  // overflows or use-after-returns when an exception crosses one: a sanitized build runs each
  // simulated actor on a system thread instead. Same results, slower; the factory is chosen while
  // the engine starts, so it must come on the command line, not from set_config.
  std::string contexts = "--cfg=contexts/factory:thread";
  char* argv[] = {prog.data(), log.data(), contexts.data(), nullptr};
  int argc = 3;
#else
  char* argv[] = {prog.data(), log.data(), nullptr};
  int argc = 2;
#endif
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
