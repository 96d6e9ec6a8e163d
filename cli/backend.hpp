// --backend: which executor backend a command runs on, a one-line error when it cannot, the run
// itself on that backend, and the mpirun session of a CUDA job.
#pragma once

#include <functional>
#include <string>

#include "exec/runtime.hpp"

namespace pw::cli {

// "cpu" passes. "cuda" passes where this build has the CUDA parts and a CUDA device is found;
// otherwise an InputError saying why (a build without CUDA, or no device with cudaGetDeviceCount's
// answer). Anything else: an InputError naming the value. Under mpirun only cuda is allowed.
void check_backend(const std::string& backend);

// Trains on the backend (check_backend first): train_cpu, or train_cuda (every rank a thread on
// GPU 0, or under mpirun this process's rank on its GPU).
exec::TrainResult train_on(const std::string& backend, const models::ModelSpec& model,
                           const planner::Plan& plan, const exec::TrainOptions& options,
                           const std::function<void(const exec::StepLog&)>& on_step);

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
// Under mpirun with more than one process: ends the whole job (the peers may wait in NCCL).
void abort_job_if_mpi(int code);

}  // namespace pw::cli
