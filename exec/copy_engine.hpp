// The CPU backend's emulated copy engine: a FIFO of work on its own thread, one per direction
// (device -> host, host -> device) and one for the host's CPU (CPU Adam), as the simulator's copy
// engines and host CPU run beside a device's compute (docs/formulas.md section 9). The interface
// is a stream's: submit is an asynchronous launch, the ticket an event, wait an event
// synchronisation, so a CUDA backend maps it onto copy streams, cudaMemcpyAsync and events.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>

namespace pw::exec {

class CopyEngine {
 public:
  using Ticket = std::uint64_t;  // 1, 2, ... in submission order; 0: nothing (always done)
  CopyEngine();
  ~CopyEngine();  // drops the work not started, finishes the one running, joins
  CopyEngine(const CopyEngine&) = delete;
  CopyEngine& operator=(const CopyEngine&) = delete;

  // Queues `work`; it runs after every earlier one. A work item may wait on another engine's
  // ticket (a dependency across engines). After a failure the engine runs nothing more.
  Ticket submit(std::function<void()> work);
  // Blocks until `ticket` has run; rethrows the engine's failure, if any.
  void wait(Ticket ticket);
  // Blocks until everything submitted so far has run (rethrows as wait).
  void drain() { wait(last()); }
  Ticket last() const;

 private:
  void loop();
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  Ticket submitted_ = 0, done_ = 0;
  std::exception_ptr error_;
  bool stop_ = false;
  std::thread thread_;  // last: starts once the rest is built
};

}  // namespace pw::exec
