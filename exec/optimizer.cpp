// AdamW (decoupled weight decay) and SGD with momentum, in fp32.
#include "exec/optimizer.hpp"

#include <cmath>

namespace pw::exec {

// The loops read the options through locals so that they vectorize (this file is built with -O3
// -fno-math-errno, CMakeLists.txt); each element's arithmetic is the same as written.
void optimizer_update(const TrainOptions& o, int update, const float* w, float* out, float* g,
                      float* m, float* v, std::int64_t n) {
  const float lr = o.lr;
  if (o.optimizer == "sgd") {
    const float momentum = o.momentum;
    for (std::int64_t i = 0; i < n; ++i) {
      m[i] = momentum * m[i] + g[i];
      out[i] = w[i] - lr * m[i];
      g[i] = 0;
    }
    return;
  }
  const float beta1 = o.beta1, beta2 = o.beta2, eps = o.eps, wd = o.weight_decay;
  const float c1 = 1.0f - std::pow(beta1, float(update));
  const float c2 = 1.0f - std::pow(beta2, float(update));
  for (std::int64_t i = 0; i < n; ++i) {
    m[i] = beta1 * m[i] + (1 - beta1) * g[i];
    v[i] = beta2 * v[i] + (1 - beta2) * g[i] * g[i];
    const float step = (m[i] / c1) / (std::sqrt(v[i] / c2) + eps) + wd * w[i];
    out[i] = w[i] - lr * step;
    g[i] = 0;
  }
}

}  // namespace pw::exec
