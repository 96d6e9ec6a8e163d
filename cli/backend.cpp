// --backend checks and dispatch (see backend.hpp). The CUDA parts are linked only in builds with
// CUDA; the MPI session in every build (it throws where the build has no MPI).
#include "cli/backend.hpp"

#include <cstdlib>
#include <memory>
#include <vector>

#include <fmt/format.h>

#include "common/error.hpp"

#include "exec/mpi/launch.hpp"
#include "exec/mpi/train.hpp"
#ifdef PW_HAVE_CUDA
#include "exec/cuda/device.hpp"
#include "exec/cuda/probe.hpp"
#include "exec/cuda/runtime.hpp"
#endif

namespace pw::cli {

namespace {

// The MPI session of a job launched by mpirun (any backend), else null.
std::unique_ptr<exec::MpiSession>& mpi() {
  static std::unique_ptr<exec::MpiSession> session;
  return session;
}

}  // namespace

void check_backend(const std::string& backend) {
  if (backend != "cpu" && backend != "cuda")
    throw InputError(fmt::format("--backend: unknown \"{}\" (cpu or cuda)", backend));
#ifdef PW_HAVE_CUDA
  if (backend == "cpu") return;
  const exec::cuda::DeviceProbe probe = exec::cuda::probe_devices();
  if (probe.count == 0)
    throw InputError(fmt::format("--backend cuda: no CUDA device ({}); use --backend cpu",
                                 probe.error.empty() ? "cudaGetDeviceCount: 0" : probe.error));
#else
  if (backend == "cpu") return;
  throw InputError(
      "--backend cuda: this build has no CUDA parts (configured without nvcc, or with "
      "-DPW_ENABLE_CUDA=OFF); use --backend cpu");
#endif
}

exec::TrainResult train_on(const std::string& backend, const models::ModelSpec& model,
                           const planner::Plan& plan, const exec::TrainOptions& options,
                           const std::function<void(const exec::StepLog&)>& on_step,
                           double comm_timeout_s) {
  if (backend == "cpu") {
    if (mpi() && mpi()->size() > 1)
      return exec::train_cpu_mpi(model, plan, options, on_step, *mpi(), {comm_timeout_s});
    return exec::train_cpu(model, plan, options, on_step);
  }
#ifdef PW_HAVE_CUDA
  exec::cuda::CudaRunOptions run;
  run.mpi = mpi().get();
  run.timeout_s = comm_timeout_s;
  return exec::cuda::train_cuda(model, plan, options, on_step, run);
#else
  check_backend(backend);
  return {};
#endif
}

planner::Plan executed_plan(planner::Plan plan) {
  if (plan.offload_activations && plan.activations.empty()) {
    planner::set_activations(plan, std::vector<planner::ActivationChoice>(
                                       std::size_t(plan.d), planner::ActivationChoice::swap));
    planner::check(plan);
  }
  return plan;
}

MeasuredOn measured_on(const std::string& backend, const models::ModelSpec& model,
                       const planner::Plan& plan) {
  MeasuredOn on;
  on.backend = backend;
  on.cluster = fmt::format("cpu:{}", plan.gpus());  // a thread per device (t per rank)
#ifdef PW_HAVE_CUDA
  if (backend == "cuda") {
    const int gpus = mpi() ? mpi()->size() : 1;
    on.device = exec::cuda::current_gpu().name;
    on.cluster = fmt::format("{}:{}", on.device, gpus);
    try {
      on.peak_flops_per_s = gpus * exec::cuda::device_peak_flops(on.device, model.dtype);
    } catch (const Error&) {
      on.peak_flops_per_s = 0;  // no preset names this GPU: MFU is left at 0
    }
  }
#else
  (void)model;
#endif
  return on;
}

void start_mpi_if_launched(int* argc, char*** argv) {
  if (exec::detect_mpi_env().launched && exec::MpiSession::available()) {
#ifdef PW_HAVE_CUDA
    // Lazy module loading can make a kernel's first launch wait for the whole device, while NCCL
    // kernels of another stream wait for a peer: load every module at CUDA's initialisation.
    setenv("CUDA_MODULE_LOADING", "EAGER", 0);
#endif
    mpi() = std::make_unique<exec::MpiSession>(argc, argv);
  }
}

int process_rank() {
  return mpi() ? mpi()->rank() : 0;
}

const exec::MpiSession* mpi_session() {
  return mpi().get();
}

int process_count() {
  return mpi() ? mpi()->size() : 1;
}

void abort_job_if_mpi(int code) {
  if (mpi() && mpi()->size() > 1) mpi()->abort(code);
}

}  // namespace pw::cli
