// --backend: which executor backend a command runs on, a one-line error when it cannot, the run
// itself on that backend, and the mpirun session of a job (one rank per process).
#pragma once

#include <functional>
#include <string>

#include "exec/runtime.hpp"
#include "planner/plan.hpp"

namespace pw::exec {
class MpiSession;
}  // namespace pw::exec

namespace pw::cli {

// "cpu" passes. "cuda" passes where this build has the CUDA parts and a CUDA device is found;
// otherwise an InputError saying why (a build without CUDA, or no device with cudaGetDeviceCount's
// answer). Anything else: an InputError naming the value.
void check_backend(const std::string& backend);

// Trains on the backend (check_backend first): train_cpu (every rank a thread, or under mpirun
// this process's rank: train_cpu_mpi), or train_cuda (every rank a thread on GPU 0, or under
// mpirun this process's rank on its GPU). A wait for a peer longer than `comm_timeout_s` ends the
// run with an error naming the rank and op (mpirun jobs and the CUDA backend; <= 0: no limit).
exec::TrainResult train_on(const std::string& backend, const models::ModelSpec& model,
                           const planner::Plan& plan, const exec::TrainOptions& options,
                           const std::function<void(const exec::StepLog&)>& on_step,
                           double comm_timeout_s = 300);

// The plan as the executor runs it: activation offload without per-stage choices (a plan file's
// "activations") swaps on every stage (the rule that picks swap or recompute needs a cluster's
// link; this machine's copies are memcpys). `train` and `validate` both start from it.
planner::Plan executed_plan(planner::Plan plan);

// What a measured run ran on, for its report: the cluster text ("cpu:<ranks>", or "<GPU name>:1"
// for ranks sharing GPU 0, "<GPU name>:<N>" under mpirun) and the devices' summed peak flops for
// MFU (0 where unknown: the CPU, or a GPU no cluster preset names).
struct MeasuredOn {
  std::string backend = "cpu";
  std::string cluster;
  std::string device;  // the GPU's name ("" on the CPU)
  double peak_flops_per_s = 0;
};
MeasuredOn measured_on(const std::string& backend, const models::ModelSpec& model,
                       const planner::Plan& plan);

// Starts MPI when this process was launched by mpirun/mpiexec (before any thread; from main).
void start_mpi_if_launched(int* argc, char*** argv);
// This process's rank under mpirun, else 0: only rank 0 prints step lines and writes files.
int process_rank();
// The processes of the mpirun job, else 1.
int process_count();
// The job's MPI session under mpirun, else null (exec/mpi/launch.hpp).
const exec::MpiSession* mpi_session();
// Under mpirun with more than one process: ends the whole job (MPI_Abort: the peers may wait).
void abort_job_if_mpi(int code);

}  // namespace pw::cli
