// Analytic (roofline) traces: per-layer times from the model's GEMM shapes and memory traffic and
// a device's peaks, for when nothing was measured. Formulas and the efficiency curve:
// docs/formulas.md.
#pragma once

#include <cstdint>
#include <vector>

#include "clusters/device.hpp"
#include "models/model.hpp"
#include "traces/trace.hpp"

namespace pw::traces {

// GEMM efficiency curve: gemm_max * h(m) * h(n) * h(k), h(x) = x / (x + gemm_half_dim), capped
// by the memory roofline; the parameters are the device's (clusters::DeviceEfficiency). The
// defaults (0.84, 128) put an 8192^3 bf16 GEMM at 0.80 of peak (790 of 989 TFLOP/s measured on
// H100 and H200).

// Tensor-core peak for fp16/bf16, the fp32 peak for fp32.
double peak_flops_per_s(const clusters::DeviceSpec& d, models::DType t);
// Fraction of peak_flops_per_s one GEMM reaches, in (0, gemm_max]; attention's activation
// matmuls (no weight operand) are further multiplied by the device's `attention` factor.
double gemm_efficiency(const models::Gemm& g, const clusters::DeviceSpec& d, models::DType t);
double gemm_time_s(const models::Gemm& g, const clusters::DeviceSpec& d, models::DType t);
// True for GEMMs with a weight operand (those have a dL/dW GEMM); false for attention's
// activation-by-activation matmuls.
bool is_weight_gemm(const models::Gemm& g);

// Bytes AdamW moves per parameter in one step: fp32 m and v read and written (16), the fp32
// master (16-bit dtypes) or the weights (fp32) read and written (8), the gradient read and, for
// 16-bit dtypes, the 16-bit weight written. 28 for every dtype.
double adamw_bytes_per_parameter(models::DType t);

// One entry per microbatch size (each >= 1, no duplicates; sorted in the result).
// Times and bytes are those of one rank of a TP group of `sharding`'s shape.
Trace analytic_trace(const models::ModelSpec& spec, const clusters::DeviceSpec& device,
                     const std::vector<std::int64_t>& microbatch_sizes,
                     const models::Sharding& sharding = {});

}  // namespace pw::traces
