// fp32 CPU kernels of a GPT-2 block (OpenBLAS GEMMs plus plain loops), forward and backward.
#include "exec/cpu/kernels.hpp"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <string>

#include "common/error.hpp"

namespace pw::exec::cpu {

namespace {

using std::size_t;

void check_id(std::int32_t id, int V, const char* what) {
  if (id < 0 || id >= V)
    throw InputError(std::string(what) + " id " + std::to_string(id) + " outside [0, " +
                     std::to_string(V) + ")");
}

}  // namespace

void embedding_forward(float* out, const std::int32_t* tokens, const float* wte, const float* wpe,
                       int B, int T, int C, int V) {
  for (int b = 0; b < B; ++b) {
    for (int t = 0; t < T; ++t) {
      const std::int32_t id = tokens[size_t(b) * T + t];
      check_id(id, V, "token");
      float* o = out + (size_t(b) * T + t) * C;
      const float* e = wte + size_t(id) * C;
      const float* p = wpe + size_t(t) * C;
      for (int i = 0; i < C; ++i)
        o[i] = e[i] + p[i];
    }
  }
}

void embedding_backward(float* dwte, float* dwpe, const float* dout, const std::int32_t* tokens,
                        int B, int T, int C) {
  for (int b = 0; b < B; ++b) {
    for (int t = 0; t < T; ++t) {
      const float* d = dout + (size_t(b) * T + t) * C;
      float* de = dwte + size_t(tokens[size_t(b) * T + t]) * C;
      float* dp = dwpe + size_t(t) * C;
      for (int i = 0; i < C; ++i) {
        de[i] += d[i];
        dp[i] += d[i];
      }
    }
  }
}

void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                       const float* bias, int N, int C) {
  const float eps = 1e-5f;
  for (int n = 0; n < N; ++n) {
    const float* x = inp + size_t(n) * C;
    float m = 0.0f;
    for (int i = 0; i < C; ++i)
      m += x[i];
    m /= float(C);
    float v = 0.0f;
    for (int i = 0; i < C; ++i)
      v += (x[i] - m) * (x[i] - m);
    v /= float(C);
    const float s = 1.0f / std::sqrt(v + eps);
    float* o = out + size_t(n) * C;
    for (int i = 0; i < C; ++i)
      o[i] = (x[i] - m) * s * weight[i] + bias[i];
    mean[n] = m;
    rstd[n] = s;
  }
}

// With xhat = (x - mean) rstd and dnorm = dout * weight:
// dx = rstd (dnorm - mean(dnorm) - xhat mean(dnorm xhat)), dweight += dout xhat, dbias += dout.
void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                        const float* inp, const float* weight, const float* mean, const float* rstd,
                        int N, int C, bool accumulate) {
  for (int n = 0; n < N; ++n) {
    const float* d = dout + size_t(n) * C;
    const float* x = inp + size_t(n) * C;
    const float m = mean[n], s = rstd[n];
    float dnorm_mean = 0.0f, dnorm_xhat_mean = 0.0f;
    for (int i = 0; i < C; ++i) {
      const float xhat = (x[i] - m) * s;
      const float dnorm = d[i] * weight[i];
      dnorm_mean += dnorm;
      dnorm_xhat_mean += dnorm * xhat;
      dweight[i] += d[i] * xhat;
      dbias[i] += d[i];
    }
    dnorm_mean /= float(C);
    dnorm_xhat_mean /= float(C);
    float* dx = dinp + size_t(n) * C;
    for (int i = 0; i < C; ++i) {
      const float xhat = (x[i] - m) * s;
      const float v = (d[i] * weight[i] - dnorm_mean - xhat * dnorm_xhat_mean) * s;
      dx[i] = accumulate ? dx[i] + v : v;
    }
  }
}

void matmul_forward(float* out, const float* inp, const float* weight, const float* bias,
                    const float* residual, int N, int C, int OC) {
  float beta = 0.0f;
  if (bias || residual) {
    beta = 1.0f;
    for (int n = 0; n < N; ++n) {
      float* o = out + size_t(n) * OC;
      const float* r = residual ? residual + size_t(n) * OC : nullptr;
      for (int j = 0; j < OC; ++j)
        o[j] = (r ? r[j] : 0.0f) + (bias ? bias[j] : 0.0f);
    }
  }
  // out (N, OC) = inp (N, C) · weight^T (C, OC) + beta out
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, OC, C, 1.0f, inp, C, weight, C, beta, out,
              OC);
}

void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, int N, int C, int OC) {
  // dinp (N, C) = dout (N, OC) · weight (OC, C)
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, C, OC, 1.0f, dout, OC, weight, C, 0.0f,
              dinp, C);
  // dweight (OC, C) += dout^T (OC, N) · inp (N, C)
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, OC, C, N, 1.0f, dout, OC, inp, C, 1.0f,
              dweight, C);
  if (dbias) {
    for (int n = 0; n < N; ++n) {
      const float* d = dout + size_t(n) * OC;
      for (int j = 0; j < OC; ++j)
        dbias[j] += d[j];
    }
  }
}

namespace {
const float kGeluScale = std::sqrt(2.0f / float(M_PI));
}

void gelu_forward(float* out, const float* inp, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) {
    const float x = inp[i];
    out[i] = 0.5f * x * (1.0f + std::tanh(kGeluScale * (x + 0.044715f * x * x * x)));
  }
}

// d/dx 0.5 x (1 + tanh(u)) = 0.5 (1 + tanh(u)) + 0.5 x sech^2(u) du/dx,
// u = s (x + 0.044715 x^3), du/dx = s (1 + 3 * 0.044715 x^2).
void gelu_backward(float* dinp, const float* inp, const float* dout, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) {
    const float x = inp[i];
    const float u = kGeluScale * (x + 0.044715f * x * x * x);
    const float th = std::tanh(u);
    const float sech2 = 1.0f - th * th;
    const float g =
        0.5f * (1.0f + th) + 0.5f * x * sech2 * kGeluScale * (1.0f + 3.0f * 0.044715f * x * x);
    dinp[i] = g * dout[i];
  }
}

// Per sample and head: S = q k^T / sqrt(hd) (T, T), P = causal softmax(S), y = P v (T, hd).
// The full T x T product is computed (as docs/formulas.md counts it); the mask zeroes j > t.
void attention_forward(float* out, float* att, const float* qkv, int B, int T, int C, int NH) {
  const int hd = C / NH, C3 = 3 * C;
  const float scale = 1.0f / std::sqrt(float(hd));
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < NH; ++h) {
      const float* q = qkv + size_t(b) * T * C3 + size_t(h) * hd;
      const float* k = q + C;
      const float* v = q + 2 * C;
      float* p = att + (size_t(b) * NH + h) * T * T;
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, T, hd, scale, q, C3, k, C3, 0.0f, p,
                  T);
      for (int t = 0; t < T; ++t) {
        float* row = p + size_t(t) * T;
        float mx = row[0];
        for (int j = 1; j <= t; ++j)
          mx = std::max(mx, row[j]);
        float sum = 0.0f;
        for (int j = 0; j <= t; ++j) {
          row[j] = std::exp(row[j] - mx);
          sum += row[j];
        }
        const float inv = 1.0f / sum;
        for (int j = 0; j <= t; ++j)
          row[j] *= inv;
        for (int j = t + 1; j < T; ++j)
          row[j] = 0.0f;
      }
      float* y = out + size_t(b) * T * C + size_t(h) * hd;
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, T, hd, T, 1.0f, p, T, v, C3, 0.0f, y,
                  C);
    }
  }
}

// dv = P^T dy; dP = dy v^T; dS = P * (dP - rowsum(P * dP)); dq = dS k / sqrt(hd);
// dk = dS^T q / sqrt(hd). dP/dS are built in row blocks that fit the scratch.
void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* att,
                        float* scratch, std::int64_t scratch_floats, int B, int T, int C, int NH) {
  const int hd = C / NH, C3 = 3 * C;
  const float scale = 1.0f / std::sqrt(float(hd));
  const int rows = int(std::min<std::int64_t>(T, scratch_floats / T));
  if (rows < 1) throw Error("attention_backward: scratch smaller than one row of T floats");
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < NH; ++h) {
      const float* q = qkv + size_t(b) * T * C3 + size_t(h) * hd;
      const float* k = q + C;
      const float* v = q + 2 * C;
      float* dq = dqkv + size_t(b) * T * C3 + size_t(h) * hd;
      float* dk = dq + C;
      float* dv = dq + 2 * C;
      const float* p = att + (size_t(b) * NH + h) * T * T;
      const float* dy = dout + size_t(b) * T * C + size_t(h) * hd;
      // dv (T, hd) = P^T (T, T) · dy (T, hd)
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, T, hd, T, 1.0f, p, T, dy, C, 0.0f, dv,
                  C3);
      for (int r0 = 0; r0 < T; r0 += rows) {
        const int n = std::min(rows, T - r0);
        float* ds = scratch;  // (n, T)
        // dP (n, T) = dy[r0:r0+n] (n, hd) · v^T (hd, T)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, T, hd, 1.0f, dy + size_t(r0) * C, C,
                    v, C3, 0.0f, ds, T);
        for (int i = 0; i < n; ++i) {
          float* row = ds + size_t(i) * T;
          const float* prow = p + size_t(r0 + i) * T;
          float dot = 0.0f;
          for (int j = 0; j < T; ++j)
            dot += prow[j] * row[j];
          for (int j = 0; j < T; ++j)
            row[j] = prow[j] * (row[j] - dot);
        }
        // dq[r0:r0+n] (n, hd) = dS (n, T) · k (T, hd) * scale
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, hd, T, scale, ds, T, k, C3, 0.0f,
                    dq + size_t(r0) * C3, C3);
        // dk (T, hd) += dS^T (T, n) · q[r0:r0+n] (n, hd) * scale
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, T, hd, n, scale, ds, T,
                    q + size_t(r0) * C3, C3, r0 == 0 ? 0.0f : 1.0f, dk, C3);
      }
    }
  }
}

double softmax_crossentropy_forward(float* probs, float* losses, const std::int32_t* targets, int N,
                                    int V) {
  double total = 0.0;
  for (int n = 0; n < N; ++n) {
    const std::int32_t y = targets[n];
    check_id(y, V, "target");
    float* row = probs + size_t(n) * V;
    float mx = row[0];
    for (int j = 1; j < V; ++j)
      mx = std::max(mx, row[j]);
    const double shifted_y = double(row[y]) - double(mx);
    double sum = 0.0;
    for (int j = 0; j < V; ++j) {
      row[j] = std::exp(row[j] - mx);
      sum += row[j];
    }
    losses[n] = float(std::log(sum) - shifted_y);  // -log p_y = log(sum) - (logit_y - max)
    const float inv = float(1.0 / sum);
    for (int j = 0; j < V; ++j)
      row[j] *= inv;
    total += losses[n];
  }
  return total;
}

void softmax_crossentropy_backward(float* dlogits, const float* probs, const std::int32_t* targets,
                                   float scale, int N, int V) {
  for (int n = 0; n < N; ++n) {
    const float* p = probs + size_t(n) * V;
    float* d = dlogits + size_t(n) * V;
    for (int j = 0; j < V; ++j)
      d[j] = p[j] * scale;
    d[targets[n]] -= scale;
  }
}

}  // namespace pw::exec::cpu
