// models/: parameter counts against published figures, derived costs against hand formulas,
// the JSON format and Hugging Face import, and every bad-input path.
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>

#include "tests/test_util.hpp"

#include "models/model.hpp"

namespace pw::models {
namespace {

std::int64_t params(const std::string& preset) {
  return derive_costs(load_model(preset)).total_parameters;
}

// Published parameter counts (Hugging Face transformers, tied embeddings, 50,257-token vocab).
TEST(ModelParams, Gpt2FamilyMatchesPublishedCountsExactly) {
  EXPECT_EQ(params("gpt2-124m"), 124'439'808);
  EXPECT_EQ(params("gpt2-355m"), 354'823'168);
  EXPECT_EQ(params("gpt2-774m"), 774'030'080);
  EXPECT_EQ(params("gpt2-1.5b"), 1'557'611'200);
}

TEST(ModelParams, BertLargeWithMaskedLmHead) {
  // BertForMaskedLM (bert-large-uncased): embeddings + 24 post-LN blocks + MLM transform + bias.
  EXPECT_EQ(params("bert-large"), 335'174'458);
}

TEST(ModelParams, Gpt3FamilyWithinOnePercent) {
  const std::pair<const char*, double> published[] = {
      {"gpt3-125m", 125e6}, {"gpt3-350m", 350e6}, {"gpt3-760m", 760e6}, {"gpt3-1.3b", 1.3e9},
      {"gpt3-2.7b", 2.7e9}, {"gpt3-6.7b", 6.7e9}, {"gpt3-13b", 13e9},   {"gpt3-175b", 175e9}};
  for (auto [name, count] : published) {
    double rel = std::abs(double(params(name)) - count) / count;
    // The small GPT-3 models count embeddings differently in the paper; 175B must be within 1%.
    EXPECT_LT(rel, std::string(name) == "gpt3-175b" ? 0.01 : 0.05) << name << " " << params(name);
  }
}

TEST(ModelParams, PipeDream2bwModelsMatchTheirNames) {
  EXPECT_NEAR(params("pd2bw-gpt-1.3b") / 1e9, 1.3, 0.05);
  EXPECT_NEAR(params("pd2bw-gpt-2.2b") / 1e9, 2.2, 0.05);
  EXPECT_NEAR(params("pd2bw-gpt-3.9b") / 1e9, 3.9, 0.05);
}

TEST(ModelCosts, BlockFormulasForGpt2Small) {
  ModelSpec s = load_model("gpt2-124m");
  const double C = 768, F = 3072, T = 1024, NH = 12, e = 2;
  ModelCosts c = derive_costs(s);
  // Parameters per block: 4C^2 + 2CF + 9C + F.
  EXPECT_EQ(c.block.parameters, std::int64_t(4 * C * C + 2 * C * F + 9 * C + F));
  // Forward FLOPs per sample: 2T(4C^2 + 2CF) for the weight GEMMs + 4T^2 C for attention.
  EXPECT_DOUBLE_EQ(c.block.forward_flops, 2 * T * (4 * C * C + 2 * C * F) + 4 * T * T * C);
  // Backward = 2 x forward: dX and dW per weight GEMM; dP, dV, dQ, dK for attention.
  EXPECT_DOUBLE_EQ(c.block.backward_flops(), 2 * c.block.forward_flops);
  // fp16 resolves to fused (FlashAttention) attention: no NH x T x T probabilities, an fp32
  // logsumexp per row and head instead. Stash: e*T*(8C + 2F) + 4*NH*T + two norms x (mean, rstd)
  // x T x 4 bytes = 2*1024*12288 + 49,152 + 16,384 = 25,231,360.
  EXPECT_EQ(s.attention, Attention::fused);
  EXPECT_EQ(c.block.activation_bytes, std::int64_t(e * T * (8 * C + 2 * F) + 4 * NH * T + 16 * T));
  EXPECT_EQ(c.block.activation_bytes, 25'231'360);
  // Unfused (as the executors run it): the probabilities come back, e*T*NH*T more.
  s.attention = Attention::unfused;
  EXPECT_EQ(derive_costs(s).block.activation_bytes,
            std::int64_t(e * T * (8 * C + 2 * F + NH * T) + 16 * T));
  EXPECT_EQ(c.block.activation_recompute_bytes, std::int64_t(e * T * C));
  EXPECT_EQ(c.block.output_bytes, std::int64_t(e * T * C));
  // LM head: 2TCV forward FLOPs.
  EXPECT_DOUBLE_EQ(c.head.forward_flops, 2 * T * C * 50257);
  EXPECT_EQ(c.tied_copy_parameters, 50257 * 768);
}

TEST(ModelCosts, FlopsPerSampleMatchMegatronFormula) {
  // Megatron-LM (Narayanan et al. 2021): 72 B L T C^2 (1 + T/(6C) + V/(12 C L)) per batch of B,
  // for F = 4C, counting forward + backward without recomputation.
  ModelSpec s = load_model("gpt3-175b");
  const double L = 96, C = 12288, T = 2048, V = 50257;
  double megatron = 72 * L * T * C * C * (1 + T / (6 * C) + V / (12 * C * L));
  EXPECT_NEAR(derive_costs(s).flops_per_sample / megatron, 1.0, 1e-12);
}

TEST(ModelCosts, ForwardGemmsSumToForwardFlops) {
  for (const char* name : {"gpt2-124m", "bert-large", "gpt-tiny"}) {
    ModelSpec s = load_model(name);
    ModelCosts c = derive_costs(s);
    for (LayerKind k : {LayerKind::block, LayerKind::head}) {
      double sum = 0;
      for (const Gemm& g : forward_gemms(s, k, 4))
        sum += g.flops();
      EXPECT_DOUBLE_EQ(sum, 4 * c.layer(k).forward_flops) << name << " " << to_string(k);
    }
  }
}

TEST(ModelIo, JsonRoundTrip) {
  for (const auto& name : preset_names()) {
    ModelSpec s = load_model(name);
    ModelSpec t = parse_model(to_json(s), "roundtrip");
    EXPECT_EQ(to_json(s), to_json(t)) << name;
    EXPECT_EQ(s.name, name);
  }
}

TEST(ModelIo, HuggingFaceGpt2ConfigImportsAsGpt2Small) {
  ModelSpec s = load_model(std::string(PW_TEST_DATA_DIR) + "/hf-gpt2-config.json");
  EXPECT_EQ(s.layers, 12);
  EXPECT_EQ(s.ffn, 3072);  // n_inner null -> 4 * n_embd
  EXPECT_EQ(derive_costs(s).total_parameters, 124'439'808);
}

TEST(ModelIo, HuggingFaceLlamaConfigImports) {
  ModelSpec s = load_model(std::string(PW_TEST_DATA_DIR) + "/hf-llama-config.json");
  EXPECT_EQ(s.mlp, Mlp::swiglu);
  EXPECT_FALSE(s.tied_embeddings);
  // LLaMA-7B: 6,738,415,616 parameters.
  EXPECT_EQ(derive_costs(s).total_parameters, 6'738'415'616);
}

TEST(ModelIo, HuggingFaceBertConfigImports) {
  ModelSpec s = load_model(std::string(PW_TEST_DATA_DIR) + "/hf-bert-config.json");
  EXPECT_EQ(s.arch, Arch::bert);
  EXPECT_EQ(derive_costs(s).total_parameters, 335'174'458);
}

std::string load_error(const std::string& text) {
  testing::TempDir dir("models");
  const std::string path = dir.write("model.json", text);
  std::string msg = testing::error_of([&] { load_model(path); });
  EXPECT_NE(msg.find(path), std::string::npos) << msg;  // names the file
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;  // one line
  return msg;
}

TEST(ModelIo, BadInputsNameTheFileAndField) {
  const std::string ok_tail =
      R"("layers": 2, "hidden": 64, "heads": 4, "seq_len": 64, "vocab": 256)";
  EXPECT_NE(load_error("{ not json").find("invalid JSON"), std::string::npos);
  EXPECT_NE(load_error(R"({"format": "pipewright.model/9", "name": "x", )" + ok_tail + "}")
                .find("/format"),
            std::string::npos);
  EXPECT_NE(load_error(R"({"format": "pipewright.model/1", )" + ok_tail + "}").find("/name"),
            std::string::npos);
  EXPECT_NE(load_error(R"({"format": "pipewright.model/1", "name": "x", "layers": "2",
      "hidden": 64, "heads": 4, "seq_len": 64, "vocab": 256})")
                .find("/layers"),
            std::string::npos);
  EXPECT_NE(load_error(R"({"format": "pipewright.model/1", "name": "x", "layers": -2,
      "hidden": 64, "heads": 4, "seq_len": 64, "vocab": 256})")
                .find("/layers"),
            std::string::npos);
  EXPECT_NE(load_error(R"({"format": "pipewright.model/1", "name": "x", "layers": 2,
      "hidden": 64, "heads": 5, "seq_len": 64, "vocab": 256})")
                .find("/heads"),
            std::string::npos);
  EXPECT_NE(load_error(R"({"format": "pipewright.model/1", "name": "x", "dtype": "fp8", )" +
                       ok_tail + "}")
                .find("/dtype"),
            std::string::npos);
}

TEST(ModelIo, UnknownPresetListsThePresets) {
  try {
    load_model("gpt5");
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("gpt2-124m"), std::string::npos);
  }
  EXPECT_THROW(load_model("/nonexistent/model.json"), InputError);
}

}  // namespace
}  // namespace pw::models
