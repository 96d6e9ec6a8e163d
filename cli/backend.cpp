// --backend checks (see backend.hpp). The CUDA probe is linked only in builds with CUDA.
#include "cli/backend.hpp"

#include <fmt/format.h>

#include "common/error.hpp"

#ifdef PW_HAVE_CUDA
#include "exec/cuda/device.hpp"
#endif

namespace pw::cli {

void check_backend(const std::string& backend) {
  if (backend == "cpu") return;
  if (backend != "cuda")
    throw InputError(fmt::format("--backend: unknown \"{}\" (cpu or cuda)", backend));
#ifdef PW_HAVE_CUDA
  const exec::cuda::DeviceProbe probe = exec::cuda::probe_devices();
  if (probe.count == 0)
    throw InputError(fmt::format("--backend cuda: no CUDA device ({}); use --backend cpu",
                                 probe.error.empty() ? "cudaGetDeviceCount: 0" : probe.error));
  throw InputError(fmt::format(
      "--backend cuda: {} CUDA device(s) found, but the runtime does not drive the CUDA stage yet "
      "(exec/cuda has the bf16 stage, not the worker and transports); use --backend cpu",
      probe.count));
#else
  throw InputError(
      "--backend cuda: this build has no CUDA parts (configured without nvcc, or with "
      "-DPW_ENABLE_CUDA=OFF); "
      "use --backend cpu");
#endif
}

}  // namespace pw::cli
