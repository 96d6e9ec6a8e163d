// CUDA device probe, error checks and host bf16 conversions (exec/cuda/device.hpp).
#include "exec/cuda/device.hpp"

#include <cstring>

namespace pw::exec::cuda {

namespace {

// "exec/cuda/gemm.cpp" rather than the absolute path the build passes as __FILE__.
std::string short_file(const char* file) {
  const char* const roots[] = {"/exec/", "/tests/"};
  const char* best = nullptr;
  for (const char* r : roots)
    for (const char* p = std::strstr(file, r); p; p = std::strstr(p + 1, r))
      best = p + 1;
  return best ? best : file;
}

std::string where(const char* file, int line, const char* op) {
  return short_file(file) + ":" + std::to_string(line) + ": " + op + " failed: ";
}

}  // namespace

DeviceProbe probe_devices() {
  DeviceProbe p;
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();  // clear it so that later calls do not report it again
    p.error =
        std::string("cudaGetDeviceCount: ") + cudaGetErrorName(e) + ": " + cudaGetErrorString(e);
    return p;
  }
  p.count = n;
  if (n == 0) p.error = "cudaGetDeviceCount: 0 devices";
  return p;
}

int cuda_device_count() {
  return probe_devices().count;
}

std::string no_device_reason() {
  const DeviceProbe p = probe_devices();
  return p.count > 0 ? std::string() : "no CUDA device (" + p.error + ")";
}

void throw_cuda_error(const char* file, int line, const char* op, cudaError_t e) {
  throw Error(where(file, line, op) + cudaGetErrorName(e) + ": " + cudaGetErrorString(e));
}

void throw_cublas_error(const char* file, int line, const char* op, cublasStatus_t s) {
  throw Error(where(file, line, op) + cublasLtGetStatusName(s) + ": " + cublasLtGetStatusString(s));
}

std::vector<bf16> to_bf16(const float* x, std::int64_t n) {
  std::vector<bf16> out(std::size_t(n > 0 ? n : 0));
  for (std::int64_t i = 0; i < n; ++i)
    out[std::size_t(i)] = __float2bfloat16(x[i]);
  return out;
}

std::vector<float> to_float(const bf16* x, std::int64_t n) {
  std::vector<float> out(std::size_t(n > 0 ? n : 0));
  for (std::int64_t i = 0; i < n; ++i)
    out[std::size_t(i)] = __bfloat162float(x[i]);
  return out;
}

float round_to_bf16(float x) {
  return __bfloat162float(__float2bfloat16(x));
}

}  // namespace pw::exec::cuda
