// fp32 CPU kernels of a GPT-2 block (OpenBLAS GEMMs plus plain loops), forward and backward.
#include "exec/cpu/kernels.hpp"

#include <cblas.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <string>
#include <vector>

#include "common/error.hpp"

namespace pw::exec::cpu {

namespace {

using std::size_t;

void check_id(std::int32_t id, int V, const char* what) {
  if (id < 0 || id >= V)
    throw InputError(std::string(what) + " id " + std::to_string(id) + " outside [0, " +
                     std::to_string(V) + ")");
}

// The elementwise loops below are written so that the compiler vectorizes them (this file is
// built with -O3, see CMakeLists.txt) and give the same bits whatever the vector width: no FMA
// contraction (-ffp-contract=off), reductions in kLanes partial sums combined in a fixed order.
// With GCC on x86-64 the hot kernels are also compiled for AVX2 and picked at load time.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define PW_VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define PW_VECTOR_CLONES
#endif

constexpr int kLanes = 16;

// sum of f(i) for i in [0, n): lane i % kLanes collects f(i), then the lanes add as a tree.
template <class F>
inline float lane_sum(int n, F f) {
  float acc[kLanes] = {};
  int i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j)
      acc[j] += f(i + j);
  for (int j = 0; i + j < n; ++j)
    acc[j] += f(i + j);
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int j = 0; j < w; ++j)
      acc[j] += acc[j + w];
  return acc[0];
}

inline float row_max(const float* x, int n) {
  float acc[kLanes];
  for (int j = 0; j < kLanes; ++j)
    acc[j] = x[0];
  int i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j)
      acc[j] = acc[j] < x[i + j] ? x[i + j] : acc[j];
  for (int j = 0; i + j < n; ++j)
    acc[j] = acc[j] < x[i + j] ? x[i + j] : acc[j];
  float m = acc[0];
  for (int j = 1; j < kLanes; ++j)
    m = m < acc[j] ? acc[j] : m;
  return m;
}

// e^x, branch-free (so loops of it vectorize), within 1.3 ulp of the true value for x in
// [-87.3, 88]; exactly 0 below -87.3, e^88 above 88, NaN for NaN. x = n ln2 + r with
// |r| <= ln2 / 2 (ln2 in two parts, Cody-Waite), e^r by its Taylor polynomial of degree 7
// (truncation < 6e-9 relative), 2^n built in the exponent bits.
inline float exp_approx(float x) {
  const float xc = x < 88.0f ? (x > -87.3f ? x : -87.3f) : 88.0f;  // NaN: 88, converts safely
  const float magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float n = (xc * 1.44269504088896341f + magic) - magic;
  const float r = (xc - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const std::int32_t bits = (std::int32_t(n) + 127) << 23;
  const float e = p * std::bit_cast<float>(bits);
  return x >= -87.3f ? e : (x < -87.3f ? 0.0f : x);
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

// Each gradient element gets one addition per call: the contributions are summed from zero first
// (position rows over the batch; a token row over its occurrences, in order), then added. So a
// call on a zeroed buffer followed by adding that buffer to an accumulator gives the accumulator
// the same bits as a call on the accumulator (optimizer offload streams per-microbatch gradients
// to a host accumulator, docs/formulas.md section 9).
void embedding_backward(float* dwte, float* dwpe, const float* dout, const std::int32_t* tokens,
                        int B, int T, int C, std::int32_t row_begin, std::int32_t rows) {
  std::vector<float> sum(static_cast<std::size_t>(C));
  for (int t = 0; t < T; ++t) {
    std::fill(sum.begin(), sum.end(), 0.0f);
    for (int b = 0; b < B; ++b) {
      const float* d = dout + (size_t(b) * T + t) * C;
      for (int i = 0; i < C; ++i)
        sum[std::size_t(i)] += d[i];
    }
    float* dp = dwpe + size_t(t) * C;
    for (int i = 0; i < C; ++i)
      dp[i] += sum[std::size_t(i)];
  }
  // Token rows: positions grouped by id (stable: in position order within an id); with a shard
  // only the ids inside it.
  std::vector<std::size_t> order;
  order.reserve(std::size_t(B) * std::size_t(T));
  for (std::size_t i = 0; i < std::size_t(B) * std::size_t(T); ++i)
    if (rows < 0 || (tokens[i] >= row_begin && tokens[i] - row_begin < rows)) order.push_back(i);
  const std::size_t n = order.size();
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t a, std::size_t b) { return tokens[a] < tokens[b]; });
  for (std::size_t k = 0; k < n;) {
    const std::int32_t id = tokens[order[k]];
    std::fill(sum.begin(), sum.end(), 0.0f);
    for (; k < n && tokens[order[k]] == id; ++k) {
      const float* d = dout + order[k] * std::size_t(C);
      for (int i = 0; i < C; ++i)
        sum[std::size_t(i)] += d[i];
    }
    float* de = dwte + size_t(id - row_begin) * C;
    for (int i = 0; i < C; ++i)
      de[i] += sum[std::size_t(i)];
  }
}

PW_VECTOR_CLONES
void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                       const float* bias, int N, int C) {
  const float eps = 1e-5f;
  for (int n = 0; n < N; ++n) {
    const float* x = inp + size_t(n) * C;
    const float m = lane_sum(C, [&](int i) { return x[i]; }) / float(C);
    const float v = lane_sum(C, [&](int i) { return (x[i] - m) * (x[i] - m); }) / float(C);
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
PW_VECTOR_CLONES
void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                        const float* inp, const float* weight, const float* mean, const float* rstd,
                        int N, int C, bool accumulate) {
  // Summed over the rows from zero, then added once (see embedding_backward).
  std::vector<float> dw(std::size_t(C), 0.0f), db(std::size_t(C), 0.0f);
  for (int n = 0; n < N; ++n) {
    const float* d = dout + size_t(n) * C;
    const float* x = inp + size_t(n) * C;
    const float m = mean[n], s = rstd[n];
    const float dnorm_mean = lane_sum(C, [&](int i) { return d[i] * weight[i]; }) / float(C);
    const float dnorm_xhat_mean =
        lane_sum(C, [&](int i) { return d[i] * weight[i] * ((x[i] - m) * s); }) / float(C);
    for (int i = 0; i < C; ++i) {
      dw[std::size_t(i)] += d[i] * ((x[i] - m) * s);
      db[std::size_t(i)] += d[i];
    }
    // d is read before dx is written, element by element: dinp may alias dout.
    float* dx = dinp + size_t(n) * C;
    if (accumulate) {
      for (int i = 0; i < C; ++i)
        dx[i] += (d[i] * weight[i] - dnorm_mean - ((x[i] - m) * s) * dnorm_xhat_mean) * s;
    } else {
      for (int i = 0; i < C; ++i)
        dx[i] = (d[i] * weight[i] - dnorm_mean - ((x[i] - m) * s) * dnorm_xhat_mean) * s;
    }
  }
  for (int i = 0; i < C; ++i) {
    dweight[i] += dw[std::size_t(i)];
    dbias[i] += db[std::size_t(i)];
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
      if (r && bias) {
        for (int j = 0; j < OC; ++j)
          o[j] = r[j] + bias[j];
      } else if (r) {
        if (o != r) std::memcpy(o, r, size_t(OC) * sizeof(float));
      } else {
        std::memcpy(o, bias, size_t(OC) * sizeof(float));
      }
    }
  }
  // out (N, OC) = inp (N, C) · weight^T (C, OC) + beta out
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, OC, C, 1.0f, inp, C, weight, C, beta, out,
              OC);
}

void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, int N, int C, int OC, bool accumulate_input) {
  // dinp (N, C) = dout (N, OC) · weight (OC, C)
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, C, OC, 1.0f, dout, OC, weight, C,
              accumulate_input ? 1.0f : 0.0f, dinp, C);
  // dweight (OC, C) += dout^T (OC, N) · inp (N, C)
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, OC, C, N, 1.0f, dout, OC, inp, C, 1.0f,
              dweight, C);
  if (dbias) {  // summed from zero, then added once (see embedding_backward)
    std::vector<float> sum(std::size_t(OC), 0.0f);
    for (int n = 0; n < N; ++n) {
      const float* d = dout + size_t(n) * OC;
      for (int j = 0; j < OC; ++j)
        sum[std::size_t(j)] += d[j];
    }
    for (int j = 0; j < OC; ++j)
      dbias[j] += sum[std::size_t(j)];
  }
}

namespace {
const float kGeluScale = std::sqrt(2.0f / float(M_PI));
}

// 0.5 x (1 + tanh(u)) = x sigmoid(2u) = x / (1 + e^(-2u)), u = s (x + 0.044715 x^3).
PW_VECTOR_CLONES
void gelu_forward(float* out, const float* inp, std::int64_t n) {
  const float k = kGeluScale;
  for (std::int64_t i = 0; i < n; ++i) {
    const float x = inp[i];
    out[i] = x / (1.0f + exp_approx(-2.0f * k * (x + 0.044715f * x * x * x)));
  }
}

// With sg = sigmoid(2u) = 0.5 (1 + tanh(u)) and sech^2(u) = 4 sg (1 - sg):
// d/dx 0.5 x (1 + tanh(u)) = sg + 2 x sg (1 - sg) du/dx, du/dx = s (1 + 3 * 0.044715 x^2).
PW_VECTOR_CLONES
void gelu_backward(float* dinp, const float* inp, const float* dout, std::int64_t n) {
  const float k = kGeluScale;
  for (std::int64_t i = 0; i < n; ++i) {
    const float x = inp[i];
    const float sg = 1.0f / (1.0f + exp_approx(-2.0f * k * (x + 0.044715f * x * x * x)));
    const float g = sg + 2.0f * x * sg * (1.0f - sg) * k * (1.0f + 3.0f * 0.044715f * x * x);
    dinp[i] = g * dout[i];
  }
}

namespace {

// row[0, n) = softmax(row[0, n)), row[n, T) = 0.
inline void causal_softmax_row(float* row, int n, int T) {
  const float mx = row_max(row, n);
  for (int j = 0; j < n; ++j)
    row[j] = exp_approx(row[j] - mx);
  const float inv = 1.0f / lane_sum(n, [&](int j) { return row[j]; });
  for (int j = 0; j < n; ++j)
    row[j] *= inv;
  std::fill(row + n, row + T, 0.0f);
}

}  // namespace

// Rows of the causal attention taken together: rows [r0, r0 + n) attend to keys [0, r0 + n), so
// the products skip the blocks above the diagonal (they do 10/16 of the full T x T work at
// T = 256, 136/256 at T = 1024). 32 rows ran no faster on this project's machine, 128 slower.
constexpr int kAttentionRows = 64;

// Rows [r0, r0 + n) of P for one sample and head: S = q k^T / sqrt(hd) over keys [0, r0 + n),
// then the causal softmax of each row (zeros past its last key). The forward and a selective
// backward make a block with this one call: the same bits.
PW_VECTOR_CLONES
static void attention_block(float* pb, const float* q, const float* k, int r0, int n, int T, int hd,
                            int C3, float scale) {
  const int cols = r0 + n;
  // S[r0:r0+n, 0:cols] (n, cols) = q[r0:r0+n] (n, hd) · k[0:cols]^T (hd, cols) * scale
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, cols, hd, scale, q + size_t(r0) * C3, C3,
              k, C3, 0.0f, pb, T);
  for (int i = 0; i < n; ++i)
    causal_softmax_row(pb + size_t(i) * T, r0 + i + 1, T);
}

std::int64_t attention_block_floats(int T) {
  return std::int64_t(kAttentionRows) * T;
}

// Per sample and head: S = q k^T / sqrt(hd), P = causal softmax(S), y = P v, by row blocks of
// kAttentionRows. att holds P with zeros above the diagonal (selective: one block, reused).
PW_VECTOR_CLONES
void attention_forward(float* out, float* att, const float* qkv, int B, int T, int C, int NH,
                       bool selective) {
  const int hd = C / NH, C3 = 3 * C;
  const float scale = 1.0f / std::sqrt(float(hd));
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < NH; ++h) {
      const float* q = qkv + size_t(b) * T * C3 + size_t(h) * hd;
      const float* k = q + C;
      const float* v = q + 2 * C;
      float* p = att + (selective ? 0 : (size_t(b) * NH + h) * T * T);
      float* y = out + size_t(b) * T * C + size_t(h) * hd;
      for (int r0 = 0; r0 < T; r0 += kAttentionRows) {
        const int n = std::min(kAttentionRows, T - r0), cols = r0 + n;
        float* pb = selective ? p : p + size_t(r0) * T;
        attention_block(pb, q, k, r0, n, T, hd, C3, scale);
        // y[r0:r0+n] (n, hd) = P[r0:r0+n, 0:cols] (n, cols) · v[0:cols] (cols, hd)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, hd, cols, 1.0f, pb, T, v, C3,
                    0.0f, y + size_t(r0) * C, C);
      }
    }
  }
}

PW_VECTOR_CLONES
void attention_probabilities(float* att, const float* qkv, int B, int T, int C, int NH) {
  const int hd = C / NH, C3 = 3 * C;
  const float scale = 1.0f / std::sqrt(float(hd));
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < NH; ++h) {
      const float* q = qkv + size_t(b) * T * C3 + size_t(h) * hd;
      float* p = att + (size_t(b) * NH + h) * T * T;
      for (int r0 = 0; r0 < T; r0 += kAttentionRows)
        attention_block(p + size_t(r0) * T, q, q + C, r0, std::min(kAttentionRows, T - r0), T, hd,
                        C3, scale);
    }
}

// dv = P^T dy; dP = dy v^T; dS = P * (dP - rowsum(P * dP)); dq = dS k / sqrt(hd);
// dk = dS^T q / sqrt(hd). By row blocks of P as the forward's (no larger than the scratch), the
// last block first: it reaches every key, so it initializes dv and dk and the others add.
PW_VECTOR_CLONES
void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* att,
                        float* scratch, std::int64_t scratch_floats, int B, int T, int C, int NH) {
  const int hd = C / NH, C3 = 3 * C;
  const float scale = 1.0f / std::sqrt(float(hd));
  // Selective: the forward's blocks exactly (kAttentionRows rows), each made again in the
  // scratch's first block beside dS.
  float* made = nullptr;
  if (!att) {
    if (scratch_floats < 2 * attention_block_floats(T))
      throw Error(
          "attention_backward: a selective backward needs two blocks of 64 rows of scratch");
    made = scratch;
    scratch += attention_block_floats(T);
    scratch_floats -= attention_block_floats(T);
  }
  const int rows = int(std::min<std::int64_t>(kAttentionRows, scratch_floats / T));
  if (rows < 1) throw Error("attention_backward: scratch smaller than one row of T floats");
  const int last = (T - 1) / rows * rows;
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < NH; ++h) {
      const float* q = qkv + size_t(b) * T * C3 + size_t(h) * hd;
      const float* k = q + C;
      const float* v = q + 2 * C;
      float* dq = dqkv + size_t(b) * T * C3 + size_t(h) * hd;
      float* dk = dq + C;
      float* dv = dq + 2 * C;
      const float* p = made ? nullptr : att + (size_t(b) * NH + h) * T * T;
      const float* dy = dout + size_t(b) * T * C + size_t(h) * hd;
      for (int r0 = last; r0 >= 0; r0 -= rows) {
        const int n = std::min(rows, T - r0), cols = r0 + n;
        const float beta = r0 == last ? 0.0f : 1.0f;
        if (made) attention_block(made, q, k, r0, n, T, hd, C3, scale);
        const float* pb = made ? made : p + size_t(r0) * T;
        const float* dyb = dy + size_t(r0) * C;
        float* ds = scratch;  // (n, T), the first cols of each row used
        // dv[0:cols] (cols, hd) += P[r0:r0+n, 0:cols]^T (cols, n) · dy[r0:r0+n] (n, hd)
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, cols, hd, n, 1.0f, pb, T, dyb, C, beta,
                    dv, C3);
        // dP (n, cols) = dy[r0:r0+n] (n, hd) · v[0:cols]^T (hd, cols)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, cols, hd, 1.0f, dyb, C, v, C3, 0.0f,
                    ds, T);
        for (int i = 0; i < n; ++i) {
          float* row = ds + size_t(i) * T;
          const float* prow = pb + size_t(i) * T;
          const float dot = lane_sum(cols, [&](int j) { return prow[j] * row[j]; });
          for (int j = 0; j < cols; ++j)
            row[j] = prow[j] * (row[j] - dot);
        }
        // dq[r0:r0+n] (n, hd) = dS (n, cols) · k[0:cols] (cols, hd) * scale
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, hd, cols, scale, ds, T, k, C3,
                    0.0f, dq + size_t(r0) * C3, C3);
        // dk[0:cols] (cols, hd) += dS^T (cols, n) · q[r0:r0+n] (n, hd) * scale
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, cols, hd, n, scale, ds, T,
                    q + size_t(r0) * C3, C3, beta, dk, C3);
      }
    }
  }
}

PW_VECTOR_CLONES
double softmax_crossentropy_forward(float* probs, float* losses, const std::int32_t* targets, int N,
                                    int V) {
  double total = 0.0;
  for (int n = 0; n < N; ++n) {
    const std::int32_t y = targets[n];
    check_id(y, V, "target");
    float* row = probs + size_t(n) * V;
    const float mx = row_max(row, V);
    const double shifted_y = double(row[y]) - double(mx);
    for (int j = 0; j < V; ++j)
      row[j] = exp_approx(row[j] - mx);
    const double sum = lane_sum(V, [&](int j) { return row[j]; });
    losses[n] = float(std::log(sum) - shifted_y);  // -log p_y = log(sum) - (logit_y - max)
    const float inv = float(1.0 / sum);
    for (int j = 0; j < V; ++j)
      row[j] *= inv;
    total += losses[n];
  }
  return total;
}

PW_VECTOR_CLONES
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
