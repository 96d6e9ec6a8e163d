// Finite-difference gradient checks of the fp32 CPU kernels (exec/cpu/kernels.hpp).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

#include "common/error.hpp"
#include "exec/cpu/kernels.hpp"

namespace cpu = pw::exec::cpu;

namespace {

using Vec = std::vector<float>;

Vec randn(std::size_t n, unsigned seed, float std = 1.0f, float mean = 0.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(mean, std);
  Vec v(n);
  for (float& x : v)
    x = d(gen);
  return v;
}

// <a, g> in double: the scalar L whose gradient with respect to a kernel's output is g.
double dot(const Vec& a, const Vec& g) {
  double s = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i)
    s += double(a[i]) * double(g[i]);
  return s;
}

// Central differences: dL/dx_i ~ (L(x + eps e_i) - L(x - eps e_i)) / (2 eps), truncation error
// O(eps^2 L''') and fp32 rounding O(ulp(L) / eps). Accept |analytic - numeric| <= rtol * |numeric|
// + atol * max|analytic| on up to `samples` coordinates.
void expect_gradient(Vec& x, const Vec& analytic, const std::function<double()>& loss,
                     const char* what, float eps = 1e-2f, double rtol = 1e-2, double atol = 1e-3,
                     int samples = 300) {
  ASSERT_EQ(x.size(), analytic.size());
  double scale = 0.0;
  for (float a : analytic)
    scale = std::max(scale, double(std::fabs(a)));
  const std::size_t stride = std::max<std::size_t>(1, x.size() / std::size_t(samples));
  for (std::size_t i = 0; i < x.size(); i += stride) {
    const float saved = x[i];
    x[i] = saved + eps;
    const double up = loss();
    x[i] = saved - eps;
    const double down = loss();
    x[i] = saved;
    const double numeric = (up - down) / (2.0 * double(eps));
    EXPECT_NEAR(analytic[i], numeric, rtol * std::fabs(numeric) + atol * scale)
        << what << "[" << i << "]";
  }
}

}  // namespace

TEST(CpuKernels, LayerNormGradients) {
  const int N = 6, C = 16;
  Vec x = randn(N * C, 1, 2.0f, 0.5f), w = randn(C, 2, 0.3f, 1.0f), b = randn(C, 3, 0.3f);
  const Vec g = randn(N * C, 4);
  Vec out(N * C), mean(N), rstd(N);
  auto loss = [&] {
    cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N,
                           C);
    return dot(out, g);
  };
  loss();
  // Forward keeps each row's mean and rstd = 1 / sqrt(var + 1e-5) (biased variance).
  for (int n = 0; n < N; ++n) {
    double m = 0.0, v = 0.0;
    for (int i = 0; i < C; ++i)
      m += x[n * C + i];
    m /= C;
    for (int i = 0; i < C; ++i)
      v += (x[n * C + i] - m) * (x[n * C + i] - m);
    EXPECT_NEAR(mean[n], m, 1e-5);
    EXPECT_NEAR(rstd[n], 1.0 / std::sqrt(v / C + 1e-5), 1e-4);
  }
  Vec dx(N * C, 0.5f), dw(C, 0.0f), db(C, 0.0f);
  cpu::layernorm_backward(dx.data(), dw.data(), db.data(), g.data(), x.data(), w.data(),
                          mean.data(), rstd.data(), N, C, true);
  for (float& v : dx)
    v -= 0.5f;  // accumulate = true added to what was there
  expect_gradient(x, dx, loss, "dx");
  expect_gradient(w, dw, loss, "dw");
  expect_gradient(b, db, loss, "db");
  // In place without accumulation (the head's use) gives the same dx.
  Vec inplace = g, dw2(C, 0.0f), db2(C, 0.0f);
  cpu::layernorm_backward(inplace.data(), dw2.data(), db2.data(), inplace.data(), x.data(),
                          w.data(), mean.data(), rstd.data(), N, C, false);
  for (int i = 0; i < N * C; ++i)
    EXPECT_NEAR(inplace[i], dx[i], 1e-6f);
}

TEST(CpuKernels, MatmulBiasResidualGradients) {
  const int N = 5, C = 7, OC = 9;
  Vec x = randn(N * C, 5), w = randn(OC * C, 6), b = randn(OC, 7), r = randn(N * OC, 8);
  const Vec g = randn(N * OC, 9);
  Vec out(N * OC);
  auto loss = [&] {
    cpu::matmul_forward(out.data(), x.data(), w.data(), b.data(), r.data(), N, C, OC);
    return dot(out, g);
  };
  loss();
  // out[n][o] = r[n][o] + b[o] + sum_c x[n][c] w[o][c]
  for (int n = 0; n < N; ++n)
    for (int o = 0; o < OC; ++o) {
      double ref = r[n * OC + o] + b[o];
      for (int c = 0; c < C; ++c)
        ref += double(x[n * C + c]) * w[o * C + c];
      EXPECT_NEAR(out[n * OC + o], ref, 1e-5);
    }
  Vec dx(N * C, 7.0f), dw(OC * C, 0.0f), db(OC, 0.0f);
  cpu::matmul_backward(dx.data(), dw.data(), db.data(), g.data(), x.data(), w.data(), N, C, OC);
  expect_gradient(x, dx, loss, "dx");  // dx is overwritten, not accumulated
  expect_gradient(w, dw, loss, "dw");
  expect_gradient(b, db, loss, "db");
  // The residual passes the gradient through unchanged: dL/dr = g.
  expect_gradient(r, g, loss, "dresidual");
}

TEST(CpuKernels, GeluGradientAndValues) {
  const int n = 64;
  Vec x(n);
  for (int i = 0; i < n; ++i)
    x[i] = -4.0f + 8.0f * float(i) / float(n - 1);
  const Vec g = randn(n, 10);
  Vec out(n);
  auto loss = [&] {
    cpu::gelu_forward(out.data(), x.data(), n);
    return dot(out, g);
  };
  loss();
  EXPECT_NEAR(out[n - 1], 4.0f * 0.5f * (1.0f + std::tanh(0.7978845608f * (4.0f + 0.044715f * 64))),
              1e-5);
  Vec dx(n);
  cpu::gelu_backward(dx.data(), x.data(), g.data(), n);
  expect_gradient(x, dx, loss, "dx", 1e-3f);
}

TEST(CpuKernels, CausalAttentionGradients) {
  const int B = 2, T = 5, C = 8, NH = 2;
  Vec qkv = randn(B * T * 3 * C, 11);
  const Vec g = randn(B * T * C, 12);
  Vec out(B * T * C), att(B * NH * T * T);
  auto loss = [&] {
    cpu::attention_forward(out.data(), att.data(), qkv.data(), B, T, C, NH);
    return dot(out, g);
  };
  loss();
  // Probabilities: rows sum to 1, zero above the diagonal (a token sees only its past).
  for (int r = 0; r < B * NH * T; ++r) {
    const int t = r % T;
    double sum = 0.0;
    for (int j = 0; j < T; ++j) {
      sum += att[r * T + j];
      if (j > t) {
        EXPECT_EQ(att[r * T + j], 0.0f);
      }
    }
    EXPECT_NEAR(sum, 1.0, 1e-6);
  }
  Vec dqkv(qkv.size()), scratch(T * T);
  cpu::attention_backward(dqkv.data(), g.data(), qkv.data(), att.data(), scratch.data(), T * T, B,
                          T, C, NH);
  expect_gradient(qkv, dqkv, loss, "dqkv");
  // A scratch of one row (T floats) computes dS row by row: the same gradient.
  Vec dqkv_rows(qkv.size()), row(T);
  cpu::attention_backward(dqkv_rows.data(), g.data(), qkv.data(), att.data(), row.data(), T, B, T,
                          C, NH);
  for (std::size_t i = 0; i < dqkv.size(); ++i)
    EXPECT_NEAR(dqkv_rows[i], dqkv[i], 1e-6f);
}

// T = 150 spans three 64-row blocks, the last one partial: the blocks skip the keys past their
// last row, which must give the full causal product (naive reference in double) and its gradient.
TEST(CpuKernels, CausalAttentionRowBlocks) {
  const int B = 1, T = 150, C = 8, NH = 2, hd = C / NH;
  Vec qkv = randn(B * T * 3 * C, 21);
  const Vec g = randn(B * T * C, 22);
  Vec out(B * T * C), att(B * NH * T * T);
  auto loss = [&] {
    cpu::attention_forward(out.data(), att.data(), qkv.data(), B, T, C, NH);
    return dot(out, g);
  };
  loss();
  for (int h = 0; h < NH; ++h)
    for (int t = 0; t < T; t += 7) {
      std::vector<double> s(t + 1);
      double mx = -1e300, z = 0.0;
      for (int j = 0; j <= t; ++j) {
        s[j] = 0.0;
        for (int i = 0; i < hd; ++i)
          s[j] += double(qkv[t * 3 * C + h * hd + i]) * qkv[j * 3 * C + C + h * hd + i];
        s[j] /= std::sqrt(double(hd));
        mx = std::max(mx, s[j]);
      }
      for (int j = 0; j <= t; ++j)
        z += std::exp(s[j] - mx);
      for (int i = 0; i < hd; ++i) {
        double y = 0.0;
        for (int j = 0; j <= t; ++j)
          y += std::exp(s[j] - mx) / z * qkv[j * 3 * C + 2 * C + h * hd + i];
        EXPECT_NEAR(out[t * C + h * hd + i], y, 1e-5) << "h " << h << " t " << t << " i " << i;
      }
      for (int j = t + 1; j < T; ++j)
        EXPECT_EQ(att[(h * T + t) * T + j], 0.0f);
    }
  Vec dqkv(qkv.size()), scratch(T * T);
  cpu::attention_backward(dqkv.data(), g.data(), qkv.data(), att.data(), scratch.data(), T * T, B,
                          T, C, NH);
  expect_gradient(qkv, dqkv, loss, "dqkv");
  // 3-row blocks: the same gradient, up to the rounding of dk and dv summed over 50 blocks.
  Vec dqkv_rows(qkv.size()), rows(3 * T);
  cpu::attention_backward(dqkv_rows.data(), g.data(), qkv.data(), att.data(), rows.data(), 3 * T, B,
                          T, C, NH);
  for (std::size_t i = 0; i < dqkv.size(); ++i)
    EXPECT_NEAR(dqkv_rows[i], dqkv[i], 1e-5f);
}

// Selective recomputation: the forward keeps no probabilities (one 64-row block of scratch,
// reused), the backward makes each block again from q and k: the output and the gradient are
// those with the probabilities kept, bit for bit (T = 150: three blocks, the last partial; T = 5:
// one). Too little scratch for two blocks is an error, not other bits.
TEST(CpuKernels, SelectiveAttentionIsBitIdentical) {
  for (const int T : {5, 150}) {
    SCOPED_TRACE("T = " + std::to_string(T));
    const int B = 2, C = 8, NH = 2;
    const Vec qkv = randn(B * T * 3 * C, 31);
    const Vec g = randn(B * T * C, 32);
    Vec out(B * T * C), att(B * NH * T * T), scratch(T * T);
    cpu::attention_forward(out.data(), att.data(), qkv.data(), B, T, C, NH);
    Vec dqkv(qkv.size());
    cpu::attention_backward(dqkv.data(), g.data(), qkv.data(), att.data(), scratch.data(), T * T, B,
                            T, C, NH);
    const std::int64_t block = cpu::attention_block_floats(T);
    EXPECT_EQ(block, 64 * T);
    Vec out_s(B * T * C), one(block, -1.0f), ws(2 * block, -1.0f), dqkv_s(qkv.size());
    cpu::attention_forward(out_s.data(), one.data(), qkv.data(), B, T, C, NH, true);
    cpu::attention_backward(dqkv_s.data(), g.data(), qkv.data(), nullptr, ws.data(), 2 * block, B,
                            T, C, NH);
    EXPECT_EQ(std::memcmp(out.data(), out_s.data(), out.size() * sizeof(float)), 0);
    EXPECT_EQ(std::memcmp(dqkv.data(), dqkv_s.data(), dqkv.size() * sizeof(float)), 0);
    EXPECT_THROW(cpu::attention_backward(dqkv_s.data(), g.data(), qkv.data(), nullptr, ws.data(),
                                         2 * block - 1, B, T, C, NH),
                 pw::Error);
  }
}

TEST(CpuKernels, EmbeddingGradientsAndRange) {
  const int B = 2, T = 3, C = 4, V = 5;
  const std::vector<std::int32_t> tokens = {0, 4, 4, 2, 0, 1};
  Vec wte = randn(V * C, 13), wpe = randn(T * C, 14);
  const Vec g = randn(B * T * C, 15);
  Vec out(B * T * C);
  auto loss = [&] {
    cpu::embedding_forward(out.data(), tokens.data(), wte.data(), wpe.data(), B, T, C, V);
    return dot(out, g);
  };
  loss();
  Vec dwte(V * C, 0.0f), dwpe(T * C, 0.0f);
  cpu::embedding_backward(dwte.data(), dwpe.data(), g.data(), tokens.data(), B, T, C);
  expect_gradient(wte, dwte, loss, "dwte");  // row 3 unused: gradient 0
  expect_gradient(wpe, dwpe, loss, "dwpe");
  // A vocabulary shard (tensor parallelism): rows [2, 5) of the table only, the same bits as the
  // whole table's rows there, and the position table's whole gradient.
  Vec shard(3 * C, 0.0f), dwpe_shard(T * C, 0.0f);
  cpu::embedding_backward(shard.data(), dwpe_shard.data(), g.data(), tokens.data(), B, T, C, 2, 3);
  EXPECT_EQ(std::memcmp(shard.data(), dwte.data() + 2 * C, shard.size() * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(dwpe_shard.data(), dwpe.data(), dwpe.size() * sizeof(float)), 0);
  // Each element added to once: a call on a zeroed buffer added into an accumulator gives the
  // bits of the call on the accumulator (optimizer offload's gradient tiles rely on it).
  Vec acc = randn(3 * C, 16), direct = acc, dwpe_acc(T * C, 0.0f);
  cpu::embedding_backward(direct.data(), dwpe_acc.data(), g.data(), tokens.data(), B, T, C, 2, 3);
  for (std::size_t i = 0; i < acc.size(); ++i)
    acc[i] = acc[i] + shard[i];
  EXPECT_EQ(std::memcmp(acc.data(), direct.data(), acc.size() * sizeof(float)), 0);
  const std::vector<std::int32_t> bad = {0, 5, 0, 0, 0, 0};
  EXPECT_THROW(cpu::embedding_forward(out.data(), bad.data(), wte.data(), wpe.data(), B, T, C, V),
               pw::InputError);
}

TEST(CpuKernels, SoftmaxCrossEntropyGradients) {
  const int N = 4, V = 7;
  const std::vector<std::int32_t> targets = {0, 6, 3, 3};
  Vec logits = randn(N * V, 16, 2.0f);
  const float scale = 0.25f;  // L = scale * sum_n -log softmax(logits_n)[target_n]
  Vec probs(N * V), losses(N);
  auto loss = [&] {
    probs = logits;
    return scale *
           cpu::softmax_crossentropy_forward(probs.data(), losses.data(), targets.data(), N, V);
  };
  loss();
  for (int n = 0; n < N; ++n) {
    double z = 0.0;
    for (int j = 0; j < V; ++j)
      z += std::exp(double(logits[n * V + j]));
    EXPECT_NEAR(losses[n], std::log(z) - logits[n * V + targets[n]], 1e-5);
  }
  Vec dlogits(N * V);
  cpu::softmax_crossentropy_backward(dlogits.data(), probs.data(), targets.data(), scale, N, V);
  expect_gradient(logits, dlogits, loss, "dlogits", 1e-3f);
  const std::vector<std::int32_t> bad = {0, 7, 0, 0};
  probs = logits;
  EXPECT_THROW(cpu::softmax_crossentropy_forward(probs.data(), losses.data(), bad.data(), N, V),
               pw::InputError);
}

// The kernels' exp: far below the maximum a probability is exactly 0, not a denormal or garbage;
// a NaN logit makes its row's loss NaN (as std::exp would), not a number.
TEST(CpuKernels, SoftmaxExtremesAndNan) {
  const int N = 2, V = 4;
  const std::vector<std::int32_t> targets = {0, 1};
  Vec probs = {0.0f, -100.0f, -1000.0f, 50.0f, 1.0f, std::nanf(""), 2.0f, 3.0f}, losses(N);
  cpu::softmax_crossentropy_forward(probs.data(), losses.data(), targets.data(), N, V);
  EXPECT_EQ(probs[1], 0.0f);
  EXPECT_EQ(probs[2], 0.0f);
  EXPECT_NEAR(probs[3], 1.0f, 1e-6f);
  EXPECT_NEAR(losses[0], 50.0f, 1e-5f);
  EXPECT_TRUE(std::isnan(losses[1]));
}
