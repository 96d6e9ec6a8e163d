// Trace format (round trip, reader errors, lookup by b) and the analytic roofline generator checked
// against hand computations.
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>

#include <gtest/gtest.h>

#include <unistd.h>
#include "tests/test_util.hpp"

#include "clusters/device.hpp"
#include "traces/analytic.hpp"
#include "traces/trace.hpp"

namespace pw::traces {
namespace {

namespace fs = std::filesystem;
using models::LayerKind;
using pw::testing::error_of;
using pw::testing::TempDir;

const double kH100Peak = 989e12, kH100Hbm = 3.35e12;

// GPT-3-like 8192-wide block, bf16, b = 1: every GEMM is large, so time is GEMM-dominated.
models::ModelSpec wide_gpt() {
  models::ModelSpec s;
  s.name = "wide";
  s.layers = 1;
  s.hidden = 8192;
  s.heads = 64;
  s.ffn = 32768;
  s.seq_len = 2048;
  s.vocab = 51200;
  s.max_positions = 2048;
  s.dtype = models::DType::bf16;
  return s;
}

// The curve written out by hand: 0.84 * prod x/(x+128), no memory cap (all compute-bound here).
double hand_gemm_s(double m, double n, double k, double batch = 1) {
  double eff = 0.84 * m / (m + 128) * n / (n + 128) * k / (k + 128);
  return 2 * m * n * k * batch / (kH100Peak * eff);
}

// validate's blocks: the mean of several profiles of one model is the mean of each time, and
// traces that differ in anything but their times are refused.
TEST(TraceMean, EveryTimeIsTheMeanOfTheTraces) {
  const Trace a = analytic_trace(wide_gpt(), clusters::load_device("H100-SXM"), {1, 2});
  Trace b = a;
  b.origin = "second";
  for (Entry& e : b.entries) {
    e.layers.block.forward_s *= 3;
    e.layers.head.recompute_s += 1;
  }
  b.statics.embedding.optimizer_step_s = 2 + a.statics.embedding.optimizer_step_s;
  const Trace m = mean_of({a, b});
  EXPECT_DOUBLE_EQ(m.at(2).layers.block.forward_s, 2 * a.at(2).layers.block.forward_s);
  EXPECT_DOUBLE_EQ(m.at(1).layers.head.recompute_s, a.at(1).layers.head.recompute_s + 0.5);
  EXPECT_DOUBLE_EQ(m.statics.embedding.optimizer_step_s, a.statics.embedding.optimizer_step_s + 1);
  EXPECT_EQ(m.at(1).layers.block.backward_s, a.at(1).layers.block.backward_s);
  EXPECT_EQ(m.at(1).layers.block.activation_bytes, a.at(1).layers.block.activation_bytes);
  EXPECT_EQ(mean_of({a}), a);

  Trace bytes = a;
  bytes.origin = "bytes";
  bytes.entries[0].layers.block.output_bytes += 4;
  EXPECT_EQ(error_of([&] {
              mean_of({a, bytes});
            }),
            "trace bytes: differs from trace " + a.origin + " in more than its times");
  Trace sizes = analytic_trace(wide_gpt(), clusters::load_device("H100-SXM"), {1});
  EXPECT_NE(error_of([&] {
              mean_of({a, sizes});
            }).find("in more than its times"),
            std::string::npos);
  EXPECT_EQ(error_of([&] { mean_of({}); }), "the mean of no traces");
}

TEST(Roofline, LargeGemmRunsAtTheMeasuredFractionOfPeak) {
  auto h100 = clusters::load_device("H100-SXM");
  models::Gemm g{"big", 8192, 8192, 8192, 1};
  // 0.84 * (8192/8320)^3 = 0.8018: 793 TFLOP/s against 790 measured.
  EXPECT_NEAR(gemm_efficiency(g, h100, models::DType::bf16), 0.8018, 1e-4);
  EXPECT_NEAR(gemm_time_s(g, h100, models::DType::bf16), 1.3865e-3, 1e-6);
  // fp32 uses the 67 TFLOP/s fp32 peak.
  EXPECT_NEAR(gemm_time_s(g, h100, models::DType::fp32) / gemm_time_s(g, h100, models::DType::bf16),
              989.0 / 67.0, 1e-9);
}

TEST(Roofline, SkinnyGemmIsMemoryBound) {
  auto h100 = clusters::load_device("H100-SXM");
  models::Gemm g{"skinny", 8192, 8192, 16, 1};
  // Intensity 2*8192*8192*16 / (2*(2*8192*16 + 8192^2)) = 15.9 FLOP/B, far below the ridge
  // 989/3.35 = 295: the time is the traffic over HBM bandwidth.
  double bytes = 2.0 * (2.0 * 8192 * 16 + 8192.0 * 8192);
  EXPECT_NEAR(gemm_time_s(g, h100, models::DType::bf16), bytes / kH100Hbm, 1e-12);
}

TEST(Roofline, BlockMatchesHandComputation) {
  const auto s = wide_gpt();
  const double C = 8192, F = 32768, T = 2048, NH = 64, hd = 128;
  // Weight GEMMs: qkv, attention projection, MLP up and down (rows = b*T = 2048).
  double weight_s =
      hand_gemm_s(T, 3 * C, C) + hand_gemm_s(T, C, C) + hand_gemm_s(T, F, C) + hand_gemm_s(T, C, F);
  // Attention: Q K^T (T x T x hd) and P V (T x hd x T), NH heads. Compute-bound: efficiency
  // 0.372 < memory cap 113.8 / 295.2 = 0.385.
  double attn_s = hand_gemm_s(T, T, hd, NH) + hand_gemm_s(T, hd, T, NH);
  // Elementwise: 2 bytes * T * (10C + 2 NH T + 2F) over HBM.
  double elem_s = 2 * T * (10 * C + 2 * NH * T + 2 * F) / kH100Hbm;

  Trace t = analytic_trace(s, clusters::load_device("H100-SXM"), {1});
  const LayerTimes& blk = t.at(1).layers.block;
  EXPECT_NEAR(blk.forward_s, weight_s + attn_s + elem_s, 1e-12);
  EXPECT_NEAR(blk.backward_input_s, weight_s + 2 * attn_s, 1e-12);
  EXPECT_NEAR(blk.backward_weight_s, weight_s, 1e-12);
  EXPECT_NEAR(blk.backward_s, 2 * weight_s + 2 * attn_s + 2 * elem_s, 1e-12);
  EXPECT_DOUBLE_EQ(blk.recompute_s, blk.forward_s);
  EXPECT_GT((weight_s + attn_s) / blk.forward_s, 0.9);  // GEMM-dominated
  EXPECT_NEAR(blk.forward_s, 5.181e-3, 0.001e-3);       // the numbers above, evaluated

  const auto costs = models::derive_costs(s);
  EXPECT_EQ(t.statics.block.parameters, costs.block.parameters);
  EXPECT_EQ(t.statics.block.parameter_bytes, 2 * costs.block.parameters);
  EXPECT_DOUBLE_EQ(t.statics.block.optimizer_step_s, 28.0 * costs.block.parameters / kH100Hbm);
  EXPECT_EQ(blk.activation_bytes, costs.block.activation_bytes);
}

// The launch floor o (formulas.md §6): with exponent 0 a pass takes max(g, o); with p it takes
// (g^p + o^p)^(1/p), g the pass's GPU time without the floor.
TEST(Roofline, LaunchFloorIsAMaxOrAPNormBlend) {
  const auto s = wide_gpt();
  clusters::DeviceSpec d = clusters::load_device("H100-SXM");
  const LayerTimes g = analytic_trace(s, d, {1}).at(1).layers.block;  // o = 0
  const double o = 4e-3;  // between the forward (5.18 ms) and below the backward
  d.efficiency.layer_overhead_s = o;
  const LayerTimes hard = analytic_trace(s, d, {1}).at(1).layers.block;
  EXPECT_DOUBLE_EQ(hard.forward_s, g.forward_s);  // 5.18 ms > 4 ms
  d.efficiency.layer_overhead_s = 6e-3;
  EXPECT_DOUBLE_EQ(analytic_trace(s, d, {1}).at(1).layers.block.forward_s, 6e-3);
  d.efficiency.layer_overhead_s = o;
  d.efficiency.overhead_exponent = 2;
  const LayerTimes soft = analytic_trace(s, d, {1}).at(1).layers.block;
  EXPECT_NEAR(soft.forward_s, std::sqrt(g.forward_s * g.forward_s + o * o), 1e-15);
  EXPECT_NEAR(soft.backward_s, std::sqrt(g.backward_s * g.backward_s + 4 * o * o), 1e-15);
  EXPECT_DOUBLE_EQ(soft.recompute_s, soft.forward_s);
  d.efficiency.overhead_exponent = 1;  // p = 1: the sum
  EXPECT_NEAR(analytic_trace(s, d, {1}).at(1).layers.block.forward_s, g.forward_s + o, 1e-15);
}

// A TP rank's trace is the roofline of its per-rank GEMMs and traffic (formulas.md §3a): with
// t = 4 every block GEMM is the hand shape with n or k / 4 and NH / 4 heads; the elementwise
// traffic outside the TP region (norms 4C, residual adds 6C) stays whole without SP.
TEST(Roofline, TensorParallelRankMatchesHandComputation) {
  const auto s = wide_gpt();  // unfused, no dropout
  const double C = 8192, F = 32768, T = 2048, NH = 64, hd = 128, t = 4;
  double weight_s = hand_gemm_s(T, 3 * C / t, C) + hand_gemm_s(T, C, C / t) +
                    hand_gemm_s(T, F / t, C) + hand_gemm_s(T, C, F / t);
  double attn_s = hand_gemm_s(T, T, hd, NH / t) + hand_gemm_s(T, hd, T, NH / t);
  double core_s = 2 * 2 * NH / t * T * T / kH100Hbm;  // softmax, read + write
  double elem_s = (2 * T * 10 * C + 2 * T * 2 * F / t) / kH100Hbm + core_s;
  Trace tr = analytic_trace(s, clusters::load_device("H100-SXM"), {1}, {4, false});
  EXPECT_EQ(tr.sharding, (models::Sharding{4, false}));
  const LayerTimes& blk = tr.at(1).layers.block;
  EXPECT_NEAR(blk.forward_s, weight_s + attn_s + elem_s, 1e-12);
  EXPECT_NEAR(blk.backward_input_s, weight_s + 2 * attn_s, 1e-12);
  // Selective recompute re-runs the attention core: its matmuls and its softmax traffic.
  EXPECT_NEAR(blk.selective_recompute_s, attn_s + core_s, 1e-12);
  const auto c = models::derive_costs(s, {4, false});
  EXPECT_EQ(blk.activation_selective_bytes, c.block.activation_selective_bytes);
  EXPECT_EQ(blk.activation_bytes - blk.activation_selective_bytes, 2 * 16 * 2048 * 2048);
  EXPECT_EQ(tr.statics.block.parameters, c.block.parameters);
}

// FlashAttention's backward recomputes Q K^T: one more scores matmul in the backward time; it
// stashes no core, so selective recompute has nothing to do.
TEST(Roofline, FusedAttentionBackwardRecomputesTheScores) {
  auto s = wide_gpt();
  s.attention = models::Attention::fused;
  const double T = 2048, NH = 64, hd = 128;
  const auto h100 = clusters::load_device("H100-SXM");
  const LayerTimes fused = analytic_trace(s, h100, {1}).at(1).layers.block;
  s.attention = models::Attention::unfused;
  const LayerTimes unfused = analytic_trace(s, h100, {1}).at(1).layers.block;
  // Same GEMMs; fused drops the softmax traffic 2 e NH T^2 and adds one Q K^T to the backward.
  EXPECT_NEAR(unfused.forward_s - fused.forward_s, 2 * 2 * NH * T * T / kH100Hbm, 1e-12);
  EXPECT_NEAR(fused.backward_input_s - unfused.backward_input_s, hand_gemm_s(T, T, hd, NH), 1e-12);
  EXPECT_EQ(fused.selective_recompute_s, 0);
  EXPECT_EQ(fused.activation_selective_bytes, fused.activation_bytes);
}

TEST(TraceFormat, ShardingAndSelectiveFieldsRoundTripAndDefault) {
  TempDir dir("traces");
  const auto s = wide_gpt();
  Trace t = analytic_trace(s, clusters::load_device("H100-SXM"), {1, 2}, {2, true});
  write_trace(dir.file("tp.json"), t);
  EXPECT_EQ(read_trace(dir.file("tp.json")), t);
  const common::Json j = to_json(t);
  EXPECT_EQ(j["tensor_parallel"], 2);
  EXPECT_EQ(j["sequence_parallel"], true);
  // A trace written before these fields: one rank, nothing dropped, nothing re-run.
  common::Json old = j;
  old.erase("tensor_parallel");
  old.erase("sequence_parallel");
  for (auto& e : old["entries"])
    for (auto& [kind, layer] : e["layers"].items()) {
      layer.erase("selective_recompute_s");
      layer.erase("activation_selective_bytes");
    }
  const Trace back = parse_trace(old, "old.json");
  EXPECT_EQ(back.sharding, (models::Sharding{1, false}));
  const LayerTimes& blk = back.at(2).layers.block;
  EXPECT_EQ(blk.activation_selective_bytes, blk.activation_bytes);
  EXPECT_EQ(blk.selective_recompute_s, 0);
  common::Json bad = j;
  bad["tensor_parallel"] = 0;
  EXPECT_NE(error_of([&] { parse_trace(bad, "bad.json"); }).find("bad.json: /tensor_parallel: "),
            std::string::npos);
  // A sharding the model cannot take is refused before anything is computed.
  EXPECT_THROW(analytic_trace(s, clusters::load_device("H100-SXM"), {1}, {3, false}), InputError);
  // A microbatch size that would wrap the byte counts is refused.
  EXPECT_THROW(analytic_trace(s, clusters::load_device("H100-SXM"), {std::int64_t(1) << 40}),
               InputError);
}

TEST(Roofline, WeightGemmsMatchTheModelsFlops) {
  const auto s = models::load_model("gpt2-124m");
  const auto costs = models::derive_costs(s);
  for (auto k : kLayerKinds) {
    SCOPED_TRACE(models::to_string(k));
    double weight = 0, attention = 0;
    for (const auto& g : models::forward_gemms(s, k, 3))
      (is_weight_gemm(g) ? weight : attention) += g.flops();
    const auto& c = costs.layer(k);
    EXPECT_NEAR(weight + attention, 3 * c.forward_flops, 1e-6 * c.forward_flops + 1);
    EXPECT_NEAR(weight, 3 * c.backward_weight_flops, 1e-6 * c.forward_flops + 1);
    EXPECT_NEAR(weight + 2 * attention, 3 * c.backward_input_flops, 1e-6 * c.forward_flops + 1);
  }
}

TEST(Roofline, MonotonicInMicrobatchSize) {
  Trace t = analytic_trace(models::load_model("gpt2-124m"), clusters::load_device("A100-80GB"),
                           {8, 1, 4, 2});
  EXPECT_EQ(t.microbatch_sizes(), (std::vector<std::int64_t>{1, 2, 4, 8}));
  for (std::size_t i = 1; i < t.entries.size(); ++i) {
    for (auto k : kLayerKinds) {
      SCOPED_TRACE(models::to_string(k));
      const auto& a = t.entries[i - 1].layers[k];
      const auto& b = t.entries[i].layers[k];
      EXPECT_GT(b.forward_s, a.forward_s);
      EXPECT_GT(b.backward_s, a.backward_s);
      EXPECT_GE(b.activation_bytes, a.activation_bytes);
      EXPECT_GT(b.output_bytes, a.output_bytes);
      // Bigger GEMMs run closer to peak: time grows at most linearly.
      EXPECT_LE(b.forward_s, 2 * a.forward_s * (1 + 1e-12));
    }
  }
  EXPECT_EQ(t.source.kind, "analytic");
  EXPECT_EQ(t.device, "A100-80GB");
  EXPECT_THROW(
      analytic_trace(models::load_model("gpt-tiny"), clusters::load_device("H200"), {2, 2}),
      InputError);
  EXPECT_THROW(analytic_trace(models::load_model("gpt-tiny"), clusters::load_device("H200"), {0}),
               InputError);
}

TEST(TraceFormat, RoundTripsThroughJsonFile) {
  TempDir dir("traces");
  Trace t =
      analytic_trace(models::load_model("gpt2-124m"), clusters::load_device("H100-SXM"), {1, 2, 4});
  write_trace(dir.file("t.json"), t);
  Trace back = read_trace(dir.file("t.json"));
  EXPECT_EQ(back, t);
  EXPECT_EQ(back.origin, dir.file("t.json"));
  EXPECT_EQ(to_json(back), to_json(t));
}

TEST(TraceFormat, AtNamesTheSizesItHas) {
  Trace t =
      analytic_trace(models::load_model("gpt-tiny"), clusters::load_device("H100-SXM"), {1, 2, 4});
  t.origin = "h100.json";
  EXPECT_EQ(t.at(2).microbatch_size, 2);
  EXPECT_EQ(error_of([&] { t.at(8); }),
            "trace h100.json: no entry for microbatch size 8 (has 1, 2, 4)");
}

TEST(TraceFormat, ReaderErrorsNameTheFileAndPath) {
  TempDir dir("traces");
  const common::Json good = to_json(
      analytic_trace(models::load_model("gpt-tiny"), clusters::load_device("H100-SXM"), {1, 2}));
  struct Case {
    const char* what;
    std::function<void(common::Json&)> edit;
    const char* path;
    const char* message;
  };
  const std::vector<Case> cases = {
      {"format", [](auto& j) { j["format"] = "pipewright.trace/2"; }, "/format", "unknown format"},
      {"missing", [](auto& j) { j["entries"][1]["layers"]["block"].erase("backward_s"); },
       "/entries/1/layers/block/backward_s", "missing required field"},
      {"negative", [](auto& j) { j["entries"][0]["layers"]["head"]["activation_bytes"] = -4; },
       "/entries/0/layers/head/activation_bytes", "must not be negative"},
      {"negative time", [](auto& j) { j["static"]["embedding"]["optimizer_step_s"] = -1e-3; },
       "/static/embedding/optimizer_step_s", "must not be negative"},
      {"type", [](auto& j) { j["entries"][0]["microbatch_size"] = "1"; },
       "/entries/0/microbatch_size", "expected a number"},
      {"duplicate", [](auto& j) { j["entries"][1]["microbatch_size"] = 1; },
       "/entries/1/microbatch_size", "appears twice"},
      {"dtype", [](auto& j) { j["dtype"] = "fp8"; }, "/dtype", "unknown dtype"},
      {"kind", [](auto& j) { j["source"]["kind"] = "guessed"; }, "/source/kind", "unknown kind"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.what);
    common::Json j = good;
    c.edit(j);
    std::string file = dir.file(std::string("bad_") + c.what + ".json");
    common::write_json_file(file, j);
    std::string msg = error_of([&] { read_trace(file); });
    EXPECT_NE(msg.find(file + ": " + c.path + ": "), std::string::npos) << msg;
    EXPECT_NE(msg.find(c.message), std::string::npos) << msg;
  }
}

}  // namespace
}  // namespace pw::traces
