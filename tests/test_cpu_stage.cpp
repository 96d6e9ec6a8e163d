// The CPU GPT stage (exec/cpu/gpt_stage.cpp): sizes match the planner, gradients match finite
// differences, splitting and recomputation change nothing.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "exec/stage_compute.hpp"
#include "models/model.hpp"
#include "test_util.hpp"

namespace {

using pw::exec::StageSpec;
using Vec = std::vector<float>;
using Ids = std::vector<std::int32_t>;

// 2 layers, C = 16, NH = 2, F = 64, T = 8, V = 32: small enough for finite differences.
pw::models::ModelSpec micro() {
  pw::models::ModelSpec m;
  m.name = "micro";
  m.layers = 2, m.hidden = 16, m.heads = 2, m.ffn = 64, m.seq_len = 8, m.vocab = 32;
  m.max_positions = 8;
  m.dtype = pw::models::DType::fp32;
  return m;
}

constexpr auto stage = pw::testing::stage_spec;

Ids random_ids(std::size_t n, int V, unsigned seed) {
  std::mt19937 gen(seed);
  Ids v(n);
  for (auto& x : v)
    x = std::int32_t(gen() % unsigned(V));
  return v;
}

// A buffer of n floats followed by guard values: the stage must write nothing past n.
struct Guarded {
  static constexpr int kGuard = 64;
  Vec v;
  explicit Guarded(std::int64_t n) : v(std::size_t(n + kGuard), 12345.0f) {}
  float* data() { return v.data(); }
  bool intact() const {
    for (std::size_t i = v.size() - kGuard; i < v.size(); ++i)
      if (v[i] != 12345.0f) return false;
    return true;
  }
};

const pw::exec::TensorSlot& slot(const pw::exec::StageCompute& s, const std::string& name) {
  for (const auto& t : s.layout())
    if (t.name == name) return t;
  throw std::runtime_error("no slot " + name);
}

// One stage's forward + backward with every buffer guarded.
struct StageRun {
  float loss = 0.0f;
  Vec stash, output, grads, d_input;
};

StageRun run_stage(pw::exec::StageCompute& s, const Vec& params, const Ids& tokens,
                   const Vec& input, const Ids& targets, const Vec& d_output, int b,
                   bool recompute) {
  const auto z = s.sizes(b);
  const StageSpec& sp = s.spec();
  Guarded stash(recompute ? z.stash_recompute : z.stash), out(z.output), ws(z.workspace),
      din(z.input), scratch(z.scratch), full(z.stash);
  StageRun r;
  r.loss = s.forward(params.data(), sp.has_embedding ? tokens.data() : nullptr,
                     sp.has_embedding ? nullptr : input.data(),
                     sp.has_head ? targets.data() : nullptr, b, recompute, stash.data(),
                     sp.has_head ? nullptr : out.data(), recompute ? scratch.data() : nullptr);
  float* used = stash.data();
  if (recompute) {
    s.recompute(params.data(), tokens.data(), targets.data(), b, stash.data(), full.data());
    used = full.data();
  }
  r.grads.assign(std::size_t(z.parameters), 0.0f);
  const float scale = 1.0f / float(b * sp.model.seq_len);  // gradient of the mean loss
  s.backward(params.data(), used, sp.has_head ? nullptr : d_output.data(), b, scale, r.grads.data(),
             sp.has_embedding ? nullptr : din.data(), ws.data());
  EXPECT_TRUE(stash.intact() && out.intact() && ws.intact() && din.intact() && scratch.intact() &&
              full.intact());
  r.stash.assign(used, used + z.stash);
  r.output.assign(out.v.begin(), out.v.begin() + z.output);
  r.d_input.assign(din.v.begin(), din.v.begin() + z.input);
  return r;
}

// Initial weights plus noise, so that biases and norms are not at 1/0 and gradients are O(1).
Vec perturbed_params(const pw::exec::StageCompute& s, std::uint64_t seed) {
  Vec p(std::size_t(s.sizes(1).parameters));
  s.init_parameters(p.data(), seed);
  std::mt19937 gen{unsigned(seed)};
  std::normal_distribution<float> d(0.0f, 0.2f);
  for (float& x : p)
    x += d(gen);
  return p;
}

}  // namespace

// sizes() x 4 bytes = b x models::derive_costs (fp32) summed over the stage's layers (§3).
TEST(CpuStage, SizesMatchTheModelsCosts) {
  const auto m = pw::testing::gpt_tiny(3);  // a middle stage of blocks only, too
  ASSERT_EQ(m.dtype, pw::models::DType::fp32);
  const auto c = pw::models::derive_costs(m);
  const int b = 4;
  struct Case {
    StageSpec spec;
    std::int64_t act_bytes, input_bytes, params, workspace_bytes;
  };
  const auto& E = c.embedding;
  const auto& K = c.block;
  const auto& H = c.head;
  const Case cases[] = {
      {stage(m, true, 0, 3, true), E.activation_bytes + 3 * K.activation_bytes + H.activation_bytes,
       E.activation_recompute_bytes, c.total_parameters,
       std::max(K.workspace_bytes, H.workspace_bytes)},
      {stage(m, true, 0, 1, false), E.activation_bytes + K.activation_bytes,
       E.activation_recompute_bytes, E.parameters + K.parameters, K.workspace_bytes},
      {stage(m, false, 1, 1, false), K.activation_bytes, K.input_bytes, K.parameters,
       K.workspace_bytes},
      {stage(m, false, 2, 1, true), K.activation_bytes + H.activation_bytes, K.input_bytes,
       K.parameters + H.parameters + c.tied_copy_parameters,
       std::max(K.workspace_bytes, H.workspace_bytes)},
  };
  for (const Case& k : cases) {
    const auto s = pw::exec::make_cpu_stage(k.spec);
    const auto z = s->sizes(b);
    EXPECT_EQ(z.stash * 4, b * k.act_bytes);
    EXPECT_EQ(z.stash_recompute * 4, b * k.input_bytes);
    EXPECT_EQ(z.parameters, k.params);
    EXPECT_EQ(z.workspace * 4, b * k.workspace_bytes);
    EXPECT_EQ(z.input, k.spec.has_embedding ? 0 : b * m.seq_len * m.hidden);
    EXPECT_EQ(z.output, k.spec.has_head ? 0 : b * m.seq_len * m.hidden);
    std::int64_t end = 0;  // slots tile the blob
    for (const auto& t : s->layout()) {
      EXPECT_EQ(t.offset, end) << t.name;
      end += t.size;
    }
    EXPECT_EQ(end, z.parameters);
  }
}

TEST(CpuStage, RejectsUnsupportedVariants) {
  auto m = micro();
  m.mlp = pw::models::Mlp::swiglu;
  try {
    pw::exec::make_cpu_stage(stage(m, true, 0, 2, true));
    FAIL() << "swiglu accepted";
  } catch (const pw::InputError& e) {
    EXPECT_NE(std::string(e.what()).find("mlp"), std::string::npos) << e.what();
  }
  m = micro();
  m.arch = pw::models::Arch::bert;
  EXPECT_THROW(pw::exec::make_cpu_stage(stage(m, true, 0, 2, true)), pw::InputError);
  EXPECT_THROW(pw::exec::make_cpu_stage(stage(micro(), false, 0, 1, true)), pw::InputError);
}

// With the GPT-2 init (std 0.02) the logits are near 0, so the loss is near ln V.
TEST(CpuStage, LossAtInitIsLogVocab) {
  const auto m = pw::models::load_model("gpt-tiny");
  auto s = pw::exec::make_cpu_stage(stage(m, true, 0, m.layers, true));
  Vec p(std::size_t(s->sizes(1).parameters));
  s->init_parameters(p.data(), 42);
  const int b = 4;
  const Ids tok = random_ids(std::size_t(b * m.seq_len), int(m.vocab), 1);
  const Ids tgt = random_ids(std::size_t(b * m.seq_len), int(m.vocab), 2);
  const StageRun r = run_stage(*s, p, tok, {}, tgt, {}, b, false);
  EXPECT_NEAR(r.loss, std::log(double(m.vocab)), 0.05);
}

// Central difference of the mean loss in coordinate k of x: (L(x + eps e_k) - L(x - eps e_k)) /
// (2 eps), with eps = 1e-2 (fp32 forward noise ~1e-6 / eps stays below the tolerance).
template <class Loss>
double numeric_gradient(Vec& x, std::size_t k, const Loss& loss) {
  const float eps = 1e-2f, saved = x[k];
  x[k] = saved + eps;
  const double up = loss();
  x[k] = saved - eps;
  const double down = loss();
  x[k] = saved;
  return (up - down) / (2.0 * double(eps));
}

// d(mean loss)/d(param), every tensor, and d(mean loss)/d(input) on sampled coordinates.
TEST(CpuStage, WholeModelGradientsMatchFiniteDifferences) {
  const auto m = micro();
  const int b = 2;
  const Ids tok = random_ids(std::size_t(b * m.seq_len), int(m.vocab), 3);
  const Ids tgt = random_ids(std::size_t(b * m.seq_len), int(m.vocab), 4);
  auto whole = pw::exec::make_cpu_stage(stage(m, true, 0, 2, true));
  Vec p = perturbed_params(*whole, 5);
  const StageRun r = run_stage(*whole, p, tok, {}, tgt, {}, b, false);
  const auto loss = [&] { return double(run_stage(*whole, p, tok, {}, tgt, {}, b, false).loss); };
  for (const auto& t : whole->layout()) {
    const std::size_t stride = std::max<std::size_t>(1, std::size_t(t.size) / 12);
    for (std::size_t i = 0; i < std::size_t(t.size); i += stride) {
      const std::size_t k = std::size_t(t.offset) + i;
      const double numeric = numeric_gradient(p, k, loss);
      EXPECT_NEAR(r.grads[k], numeric, 2e-2 * std::fabs(numeric) + 2e-4)
          << t.name << "[" << i << "]";
    }
  }
  // The last stage on its own (block 1 + head): d(loss)/d(input).
  auto tail = pw::exec::make_cpu_stage(stage(m, false, 1, 1, true));
  const Vec q = perturbed_params(*tail, 6);
  Vec input(std::size_t(b * m.seq_len * m.hidden));
  std::mt19937 gen(7);
  std::normal_distribution<float> d(0.0f, 1.0f);
  for (float& x : input)
    x = d(gen);
  const StageRun rt = run_stage(*tail, q, {}, input, tgt, {}, b, false);
  const auto tail_loss = [&] {
    return double(run_stage(*tail, q, {}, input, tgt, {}, b, false).loss);
  };
  for (std::size_t k = 0; k < input.size(); k += 7) {
    const double numeric = numeric_gradient(input, k, tail_loss);
    EXPECT_NEAR(rt.d_input[k], numeric, 2e-2 * std::fabs(numeric) + 2e-4) << "d_input[" << k << "]";
  }
}

// One stage vs two (embedding + block 0 | block 1 + head with the lm_head copy): the same loss and
// gradients; the tied wte's gradient is the sum of stage 0's wte and stage 1's lm_head gradients.
TEST(CpuStage, SplittingChangesNothing) {
  const auto m = micro();
  const int b = 3;
  const Ids tok = random_ids(std::size_t(b * m.seq_len), int(m.vocab), 8);
  const Ids tgt = random_ids(std::size_t(b * m.seq_len), int(m.vocab), 9);
  auto whole = pw::exec::make_cpu_stage(stage(m, true, 0, 2, true));
  auto s0 = pw::exec::make_cpu_stage(stage(m, true, 0, 1, false));
  auto s1 = pw::exec::make_cpu_stage(stage(m, false, 1, 1, true));
  Vec pw_(std::size_t(whole->sizes(1).parameters)), p0(std::size_t(s0->sizes(1).parameters)),
      p1(std::size_t(s1->sizes(1).parameters));
  whole->init_parameters(pw_.data(), 77);
  s0->init_parameters(p0.data(), 77);
  s1->init_parameters(p1.data(), 77);
  // The same tensor gets the same values on every split; the copy starts as wte.
  const auto same_init = [&](const pw::exec::StageCompute& s, const Vec& p) {
    for (const auto& t : s.layout()) {
      const auto& w = slot(*whole, t.name == "lm_head" ? "wte" : t.name);
      ASSERT_EQ(w.size, t.size);
      EXPECT_EQ(0, std::memcmp(&p[std::size_t(t.offset)], &pw_[std::size_t(w.offset)],
                               std::size_t(t.size) * sizeof(float)))
          << t.name;
    }
  };
  same_init(*s0, p0);
  same_init(*s1, p1);
  const StageRun rw = run_stage(*whole, pw_, tok, {}, tgt, {}, b, false);
  // Stage 0's forward; stage 1 runs on its output and hands back d_input as stage 0's d_output.
  const auto z0 = s0->sizes(b);
  Vec stash0(std::size_t(z0.stash)), out0(std::size_t(z0.output));
  s0->forward(p0.data(), tok.data(), nullptr, nullptr, b, false, stash0.data(), out0.data());
  const StageRun r1 = run_stage(*s1, p1, {}, out0, tgt, {}, b, false);
  const StageRun r0 = run_stage(*s0, p0, tok, {}, {}, r1.d_input, b, false);
  EXPECT_EQ(rw.loss, r1.loss);
  const auto expect_grad = [&](const std::string& name, const float* g, double tol) {
    const auto& w = slot(*whole, name);
    for (std::int64_t i = 0; i < w.size; ++i)
      ASSERT_NEAR(g[i], rw.grads[std::size_t(w.offset + i)], tol) << name << "[" << i << "]";
  };
  for (const auto& t : s0->layout())
    if (t.name != "wte") expect_grad(t.name, &r0.grads[std::size_t(t.offset)], 1e-7);
  for (const auto& t : s1->layout())
    if (t.name != "lm_head") expect_grad(t.name, &r1.grads[std::size_t(t.offset)], 1e-7);
  const auto& e = slot(*s0, "wte");
  const auto& h = slot(*s1, "lm_head");
  Vec sum(std::size_t(e.size));
  for (std::int64_t i = 0; i < e.size; ++i)
    sum[std::size_t(i)] = r0.grads[std::size_t(e.offset + i)] + r1.grads[std::size_t(h.offset + i)];
  expect_grad("wte", sum.data(), 1e-6);
}

// Forward with recompute keeps only the stage input; recompute() rebuilds the stash bit for bit,
// so loss and gradients are identical to a run without recompute.
TEST(CpuStage, RecomputeIsBitIdentical) {
  const auto m = micro();
  const int b = 2;
  const Ids tok = random_ids(std::size_t(b * m.seq_len), int(m.vocab), 10);
  const Ids tgt = random_ids(std::size_t(b * m.seq_len), int(m.vocab), 11);
  Vec input(std::size_t(b * m.seq_len * m.hidden)), d_out(input.size());
  std::mt19937 gen(12);
  std::normal_distribution<float> d(0.0f, 1.0f);
  for (float& x : input)
    x = d(gen);
  for (float& x : d_out)
    x = d(gen);
  const StageSpec specs[] = {stage(m, true, 0, 2, true), stage(m, true, 0, 1, false),
                             stage(m, false, 1, 1, true), stage(m, false, 0, 2, false),
                             stage(m, true, 0, 0, false)};
  for (const StageSpec& sp : specs) {
    auto s = pw::exec::make_cpu_stage(sp);
    const Vec p = perturbed_params(*s, 13);
    const StageRun plain = run_stage(*s, p, tok, input, tgt, d_out, b, false);
    const StageRun rc = run_stage(*s, p, tok, input, tgt, d_out, b, true);
    const std::string name =
        "stage [" + std::to_string(sp.first_block) + ", +" + std::to_string(sp.blocks) + ")";
    EXPECT_EQ(plain.loss, rc.loss) << name;
    EXPECT_EQ(plain.stash, rc.stash) << name;
    EXPECT_EQ(plain.output, rc.output) << name;
    EXPECT_EQ(plain.grads, rc.grads) << name;
    EXPECT_EQ(plain.d_input, rc.d_input) << name;
  }
}
