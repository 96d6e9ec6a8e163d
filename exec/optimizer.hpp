// The optimizer update shared by every worker: fp32 master weights, AdamW or SGD with momentum.
#pragma once

#include <cstdint>

#include "exec/runtime.hpp"

namespace pw::exec {

// out = w - lr * step(g), updating the moments m (and v for AdamW), then zeroes g. `update` is the
// 1-based count of updates so far (AdamW's bias correction). `out` may alias `w` (in place).
void optimizer_update(const TrainOptions& o, int update, const float* w, float* out, float* g,
                      float* m, float* v, std::int64_t n);

}  // namespace pw::exec
