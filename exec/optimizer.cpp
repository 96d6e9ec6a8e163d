// AdamW (decoupled weight decay) and SGD with momentum, in fp32.
#include "exec/optimizer.hpp"

#include <cmath>

namespace pw::exec {

void optimizer_update(const TrainOptions& o, int update, const float* w, float* out, float* g,
                      float* m, float* v, std::int64_t n) {
  if (o.optimizer == "sgd") {
    for (std::int64_t i = 0; i < n; ++i) {
      m[i] = o.momentum * m[i] + g[i];
      out[i] = w[i] - o.lr * m[i];
      g[i] = 0;
    }
    return;
  }
  const float c1 = 1.0f - std::pow(o.beta1, float(update));
  const float c2 = 1.0f - std::pow(o.beta2, float(update));
  for (std::int64_t i = 0; i < n; ++i) {
    m[i] = o.beta1 * m[i] + (1 - o.beta1) * g[i];
    v[i] = o.beta2 * v[i] + (1 - o.beta2) * g[i] * g[i];
    const float step = (m[i] / c1) / (std::sqrt(v[i] / c2) + o.eps) + o.weight_decay * w[i];
    out[i] = w[i] - o.lr * step;
    g[i] = 0;
  }
}

}  // namespace pw::exec
