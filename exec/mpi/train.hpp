// Training under `mpirun -np N`: the CPU backend with one rank per process (train_cpu_mpi), and the
// step logs and per-rank results every backend's mpirun job gathers (CUDA's too).
#pragma once

#include <functional>

#include "exec/mpi/launch.hpp"
#include "exec/run_common.hpp"
#include "exec/runtime.hpp"

namespace pw::exec {

struct MpiRunOptions {
  // A wait for a peer (a message, the all-reduce, a barrier) longer than this is a one-line error
  // naming the rank, the op and the peer; <= 0 waits forever.
  double timeout_s = 300;
};

// As train_cpu, this process running rank mpi.rank() of the plan (mpi.size() must equal the
// plan's ranks) over MpiTransport: the same losses as train_cpu, bit for bit. On every process the
// step logs are the job's (losses summed over processes, the latest end time); `on_step` is called
// on rank 0 only, after the run. The result's ranks hold every rank's memory and busy time; rank
// 0's result holds every rank's timeline too, the others' only their own (weights stay local).
// Built without MPI: an Error.
TrainResult train_cpu_mpi(const models::ModelSpec& model, const planner::Plan& plan,
                          const TrainOptions& options,
                          const std::function<void(const StepLog&)>& on_step, const MpiSession& mpi,
                          const MpiRunOptions& run = {});

namespace detail {

// Under mpirun each process logged its own ranks' view of a step: the loss only where the last
// stage runs, its own end time. The job's step log sums the losses and takes the latest end.
void merge_logs(StepBook& book, const MpiSession& mpi);

// Every rank's memory and busy time, for the job's report (from result.ranks.front(), this
// process's rank), gathered to every process; with `timelines`, every rank's timeline to rank 0.
void gather_ranks(TrainResult& result, const MpiSession& mpi, bool timelines);

}  // namespace detail
}  // namespace pw::exec
