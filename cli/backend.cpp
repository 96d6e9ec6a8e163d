// --backend checks and dispatch (see backend.hpp). The CUDA parts are linked only in builds with
// CUDA.
#include "cli/backend.hpp"

#include <cstdlib>
#include <memory>

#include <fmt/format.h>

#include "common/error.hpp"

#ifdef PW_HAVE_CUDA
#include "exec/cuda/device.hpp"
#include "exec/cuda/mpi_launch.hpp"
#include "exec/cuda/probe.hpp"
#include "exec/cuda/runtime.hpp"
#endif

namespace pw::cli {

namespace {

#ifdef PW_HAVE_CUDA
std::unique_ptr<exec::cuda::MpiSession>& mpi() {
  static std::unique_ptr<exec::cuda::MpiSession> session;
  return session;
}
#endif

}  // namespace

void check_backend(const std::string& backend) {
  if (backend != "cpu" && backend != "cuda")
    throw InputError(fmt::format("--backend: unknown \"{}\" (cpu or cuda)", backend));
#ifdef PW_HAVE_CUDA
  if (backend == "cpu") {
    if (mpi() && mpi()->size() > 1)
      throw InputError(
          "--backend cpu runs every rank as a thread of one process: do not launch it with "
          "mpirun (use --backend cuda for one process per GPU)");
    return;
  }
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
                           const std::function<void(const exec::StepLog&)>& on_step) {
  if (backend == "cpu") return exec::train_cpu(model, plan, options, on_step);
#ifdef PW_HAVE_CUDA
  exec::cuda::CudaRunOptions run;
  run.mpi = mpi().get();
  return exec::cuda::train_cuda(model, plan, options, on_step, run);
#else
  check_backend(backend);
  return {};
#endif
}

MeasuredOn measured_on(const std::string& backend, const models::ModelSpec& model,
                       const planner::Plan& plan) {
  MeasuredOn on;
  on.backend = backend;
  on.cluster = fmt::format("cpu:{}", plan.ranks());
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
#ifdef PW_HAVE_CUDA
  if (exec::cuda::detect_mpi_env().launched && exec::cuda::MpiSession::available()) {
    // Lazy module loading can make a kernel's first launch wait for the whole device, while NCCL
    // kernels of another stream wait for a peer: load every module at CUDA's initialisation.
    setenv("CUDA_MODULE_LOADING", "EAGER", 0);
    mpi() = std::make_unique<exec::cuda::MpiSession>(argc, argv);
  }
#else
  (void)argc;
  (void)argv;
#endif
}

int process_rank() {
#ifdef PW_HAVE_CUDA
  return mpi() ? mpi()->rank() : 0;
#else
  return 0;
#endif
}

void abort_job_if_mpi(int code) {
#ifdef PW_HAVE_CUDA
  if (mpi() && mpi()->size() > 1) mpi()->abort(code);
#else
  (void)code;
#endif
}

}  // namespace pw::cli
