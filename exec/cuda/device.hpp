// The CUDA device probe, the checks that turn CUDA and cuBLAS failures into one-line pw::Error,
// and host-side bf16 conversions.
#pragma once

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "common/error.hpp"

namespace pw::exec::cuda {

using bf16 = __nv_bfloat16;

// What cudaGetDeviceCount says. Any error counts as "no device" (35: no driver, 100: a driver but
// no GPU); `error` then keeps "cudaGetDeviceCount: <name>: <text>" for messages.
struct DeviceProbe {
  int count = 0;
  std::string error;
};
DeviceProbe probe_devices();
int cuda_device_count();
// "no CUDA device (cudaGetDeviceCount: ...)", or "" when there is one.
std::string no_device_reason();

// Throw pw::Error "FILE:LINE: OP failed: NAME: TEXT" (one line). Use the macros below.
[[noreturn]] void throw_cuda_error(const char* file, int line, const char* op, cudaError_t e);
[[noreturn]] void throw_cublas_error(const char* file, int line, const char* op, cublasStatus_t s);

// Round to nearest even, as __float2bfloat16 does on the device.
std::vector<bf16> to_bf16(const float* x, std::int64_t n);
std::vector<float> to_float(const bf16* x, std::int64_t n);
// x rounded to bf16 and back: what a bf16 copy of x holds.
float round_to_bf16(float x);

}  // namespace pw::exec::cuda

#define CUDA_CHECK(call)                                                              \
  do {                                                                                \
    const cudaError_t pw_cuda_status_ = (call);                                       \
    if (pw_cuda_status_ != cudaSuccess)                                               \
      ::pw::exec::cuda::throw_cuda_error(__FILE__, __LINE__, #call, pw_cuda_status_); \
  } while (0)

#define CUBLAS_CHECK(call)                                                                \
  do {                                                                                    \
    const cublasStatus_t pw_cublas_status_ = (call);                                      \
    if (pw_cublas_status_ != CUBLAS_STATUS_SUCCESS)                                       \
      ::pw::exec::cuda::throw_cublas_error(__FILE__, __LINE__, #call, pw_cublas_status_); \
  } while (0)
