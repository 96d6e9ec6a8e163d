// Under `mpirun -np 2 --mca btl self,tcp`: does a message above the eager limit reach its receiver
// while its sender makes no MPI call? (exec/mpi/transport.hpp, "Progress".)
//
// Usage: mpi_progress_check DIR on|off
//   on:  the progress thread runs; rank 0 sends 4 MiB, then makes no MPI call until rank 1 says
//        (a file in DIR) that the whole message arrived. Fails if it has not within 60 s.
//   off: no progress thread, the same send; rank 1 must NOT have it after 2 s (the check can
//        tell the two apart), then rank 0 completes the send itself.
// Exit 0 on success, 1 with one line on failure, 77 where MPI cannot run threads serialized.
#include <chrono>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "exec/mpi/launch.hpp"
#include "exec/mpi/transport.hpp"

namespace fs = std::filesystem;
using pw::exec::Channel;

int main(int argc, char** argv) {
  if (argc != 3 || (std::string(argv[2]) != "on" && std::string(argv[2]) != "off")) {
    std::fprintf(stderr, "usage: mpi_progress_check DIR on|off\n");
    return 2;
  }
  const fs::path flag = fs::path(argv[1]) / "received";
  const bool on = std::string(argv[2]) == "on";
  int code = 0;
  try {
    pw::exec::MpiSession mpi(&argc, &argv);
    if (mpi.size() != 2) throw std::runtime_error("needs mpirun -np 2");
    pw::exec::MpiTransport t(mpi.rank(), 60);
    if (on && !t.start_progress(mpi.thread_level())) {
      std::printf("SKIP: MPI gives no MPI_THREAD_SERIALIZED\n");
      return 77;
    }
    t.barrier("start barrier");
    const std::size_t n = std::size_t(1) << 20;  // 4 MiB of floats
    if (mpi.rank() == 0) {
      t.send(0, 1, Channel::activation, std::vector<float>(n, 0.5f));
      // No MPI call from this thread until the flag shows up or the time is over.
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(on ? 60 : 2);
      while (!fs::exists(flag) && std::chrono::steady_clock::now() < until)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      const bool arrived = fs::exists(flag);
      if (on && !arrived) {
        std::printf(
            "FAIL: with the progress thread, 4 MiB did not arrive in 60 s while the "
            "sender made no MPI call\n");
        code = 1;
      } else if (!on && arrived) {
        std::printf(
            "FAIL: without the progress thread 4 MiB arrived anyway: this check cannot "
            "tell the two apart (eager limit above 4 MiB?)\n");
        code = 1;
      } else {
        std::printf("ok: progress %s: the message %s while the sender made no MPI call\n",
                    on ? "on" : "off", arrived ? "arrived" : "waited");
      }
      t.flush();
    } else {
      const std::vector<float> got = t.recv(0, 1, Channel::activation);
      if (got.size() != n || got.front() != 0.5f || got.back() != 0.5f)
        throw std::runtime_error("rank 1 received a wrong message");
      std::ofstream(flag) << "ok\n";
    }
    t.barrier("end barrier");
    t.stop_progress();
  } catch (const std::exception& e) {
    std::printf("FAIL: %s\n", e.what());
    return 1;
  }
  return code;
}
