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

// Exact counts of the released checkpoints (untied head, no biases, RMSNorm, SwiGLU):
// embedding V*C, per block 2C (norms) + C*(C + 2*KV*hd) (q, k, v) + C^2 (o) + 3*C*F (MLP),
// head C (final norm) + V*C.
//   Llama 2 7B: C 4096, KV 32, F 11008, V 32000: block 202,383,360; 131,072,000 + 32 blocks +
//   131,076,096 = 6,738,415,616.
//   Mistral 7B: KV 8 (hd 128: k and v are 1024 wide each), F 14336: block 8,192 + 25,165,824 +
//   16,777,216 + 176,160,768 = 218,112,000; 131,072,000 + 6,979,584,000 + 131,076,096 =
//   7,241,732,096.
//   Llama 3 8B: Mistral's block, V 128256: 525,336,576 + 6,979,584,000 + 525,340,672 =
//   8,030,261,248.
//   Llama 3.1 405B: C 16384, L 126, KV 8 (hd 128), F 53248, V 128256: block 32,768 +
//   301,989,888 + 268,435,456 + 2,617,245,696 = 3,187,703,808; 2,101,346,304 + 126 blocks +
//   2,101,362,688 = 405,853,388,800.
TEST(ModelParams, LlamaFamilyAndMistralMatchReleasedCountsExactly) {
  EXPECT_EQ(params("llama2-7b"), 6'738'415'616);
  EXPECT_EQ(params("mistral-7b"), 7'241'732'096);
  EXPECT_EQ(params("llama3-8b"), 8'030'261'248);
  EXPECT_EQ(params("llama3-405b"), 405'853'388'800);
  EXPECT_EQ(derive_costs(load_model("llama3-405b")).block.parameters, 3'187'703'808);
  EXPECT_EQ(derive_costs(load_model("mistral-7b")).block.parameters, 218'112'000);
  EXPECT_EQ(load_model("mistral-7b").kv_heads, 8);
  EXPECT_EQ(load_model("llama2-7b").kv_heads, 32);
  EXPECT_EQ(load_model("llama3-8b").seq_len, 8192);
  EXPECT_EQ(load_model("llama3-8b").dtype, DType::bf16);
}

// The Hugging Face config.json of each (fields as released, trimmed of what pipewright ignores
// except rms_norm_eps) imports to the same counts.
TEST(ModelIo, HuggingFaceGqaConfigsImportWithExactCounts) {
  const std::string common_fields = R"("hidden_act": "silu", "hidden_size": 4096,
      "num_attention_heads": 32, "num_hidden_layers": 32, "rms_norm_eps": 1e-05,
      "tie_word_embeddings": false, "torch_dtype": "bfloat16", )";
  const std::pair<std::string, std::int64_t> configs[] = {
      {R"({"model_type": "llama", )" + common_fields +
           R"("intermediate_size": 11008, "max_position_embeddings": 4096,
           "num_key_value_heads": 32, "vocab_size": 32000})",
       6'738'415'616},
      {R"({"model_type": "mistral", )" + common_fields +
           R"("intermediate_size": 14336, "max_position_embeddings": 32768,
           "num_key_value_heads": 8, "sliding_window": 4096, "vocab_size": 32000})",
       7'241'732'096},
      {R"({"model_type": "llama", )" + common_fields +
           R"("intermediate_size": 14336, "max_position_embeddings": 8192,
           "num_key_value_heads": 8, "rope_theta": 500000.0, "vocab_size": 128256})",
       8'030'261'248}};
  testing::TempDir dir("hf");
  for (const auto& [text, count] : configs) {
    const ModelSpec s = load_model(dir.write("config.json", text));
    EXPECT_EQ(derive_costs(s).total_parameters, count) << text;
    EXPECT_EQ(s.dtype, DType::bf16);
    EXPECT_EQ(s.attention, Attention::fused);
    EXPECT_FALSE(s.tied_embeddings);
  }
  // torch_dtype must be one the tool models; the error names the field.
  const std::string path =
      dir.write("config.json", R"({"model_type": "llama", )" +
                                   common_fields.substr(0, common_fields.find("\"torch_dtype")) +
                                   R"("torch_dtype": "float8_e4m3fn", "intermediate_size": 11008,
          "max_position_embeddings": 4096, "vocab_size": 32000})");
  const std::string msg = testing::error_of([&] { load_model(path); });
  EXPECT_NE(msg.find("/torch_dtype"), std::string::npos) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
}

// Grouped-query attention (Ainslie et al. 2023): KV heads share the keys and values of
// heads / KV query heads, so the QKV projection is C x (C + 2*KV*hd) and qkv stashes that width.
TEST(ModelCosts, GroupedQueryAttentionShrinksQkv) {
  ModelSpec s = load_model("gpt2-124m");
  s.attention = Attention::unfused;
  const ModelCosts mha = derive_costs(s);
  s.kv_heads = 4;  // 12 query heads in 4 groups, hd 64: K and V are 256 wide
  const ModelCosts gqa = derive_costs(s);
  const std::int64_t C = 768, T = 1024, e = 2, kv = 2 * 4 * 64;
  // Parameters: qkv weight + bias lose (2C - 2*KV*hd) * (C + 1).
  EXPECT_EQ(mha.block.parameters - gqa.block.parameters, (2 * C - kv) * (C + 1));
  // FLOPs: the projection loses 2*T*C*(2C - 2*KV*hd); attention FLOPs are unchanged.
  EXPECT_DOUBLE_EQ(mha.block.forward_flops - gqa.block.forward_flops, 2.0 * T * C * (2 * C - kv));
  // Stash: qkv is T x (C + 2*KV*hd).
  EXPECT_EQ(mha.block.activation_bytes - gqa.block.activation_bytes, e * T * (2 * C - kv));
  // The GEMM is the narrower one.
  EXPECT_EQ(forward_gemms(s, LayerKind::block, 1)[0].n, C + kv);
  // MQA: one KV head.
  s.kv_heads = 1;
  EXPECT_EQ(forward_gemms(s, LayerKind::block, 1)[0].n, C + 2 * 64);
}

TEST(ModelIo, AttentionDefaultsByDtypeAndIsWritten) {
  EXPECT_EQ(load_model("gpt-tiny").attention, Attention::unfused);        // fp32
  EXPECT_EQ(load_model("gpt2-124m").attention, Attention::fused);         // fp16
  EXPECT_EQ(load_model("llama2-7b").attention, Attention::fused);         // bf16
  EXPECT_EQ(load_model("pd2bw-gpt-1.3b").attention, Attention::unfused);  // says so
  EXPECT_EQ(to_json(load_model("gpt2-124m"))["attention"], "fused");
  EXPECT_EQ(to_json(load_model("gpt-tiny"))["kv_heads"], 4);
  EXPECT_EQ(to_json(load_model("gpt-tiny"))["dropout"], false);
  EXPECT_EQ(to_json(load_model("gpt-tiny"))["vocab_multiple"], 1);
  // Dropout per preset: the Megatron GPT-3 runs use it; GPT-2, BERT, PipeDream-2BW, gpt-tiny
  // and the Llama / Mistral presets describe runs without it.
  EXPECT_TRUE(load_model("gpt3-175b").dropout);
  EXPECT_FALSE(load_model("gpt2-124m").dropout);
  EXPECT_FALSE(load_model("pd2bw-gpt-3.9b").dropout);
  EXPECT_FALSE(load_model("gpt-tiny").dropout);
}

// Korthikanti et al. 2022, eq. 1: a GPT block (LayerNorm, GELU, F = 4C, unfused attention,
// dropout, 16-bit) stashes s*b*h*(34 + 5*a*s/h) bytes, with s = T, b = 1, h = C, a = NH:
//   attention: ln1 input 2, ln1 output (QKV input) 2, Q and K 4, V 2, softmax output 2as/h,
//     its dropout mask as/h, dropout output 2as/h, projection input 2, post-attention dropout
//     mask 1                                          -> 13 + 5as/h (ln1 input counted here)
//   MLP: ln2 input (the residual) 2, ln2 output 2, fc output 8, GELU output 8, post-MLP dropout
//     mask 1                                          -> 21
//   total 34 + 5as/h (per T*C). pipewright also keeps both norms' mean and rstd in fp32:
//   2 norms x 2 x T x 4 bytes = 16T.
ModelSpec korthikanti_gpt() {
  ModelSpec s;
  s.name = "k";
  s.layers = 4;
  s.hidden = 1024;
  s.heads = 16;
  s.ffn = 4096;
  s.seq_len = 2048;
  s.vocab = 51200;
  s.max_positions = 2048;
  s.dtype = DType::fp16;
  s.attention = Attention::unfused;
  s.dropout = true;
  return s;
}

TEST(ModelCosts, KorthikantiEquationOneForAGptBlock) {
  const ModelSpec s = korthikanti_gpt();
  const std::int64_t T = 2048, C = 1024, NH = 16;
  const LayerCosts b = derive_costs(s).block;
  // T*C*(34 + 5*NH*T/C) = 34*T*C + 5*NH*T*T.
  EXPECT_EQ(b.activation_bytes, 34 * T * C + 5 * NH * T * T + 16 * T);
  // Selective recompute drops the 5as/h term (probabilities, mask, dropout output) and re-runs
  // the attention core's two matmuls, 4*T^2*C FLOPs.
  EXPECT_EQ(b.activation_selective_bytes, 34 * T * C + 16 * T);
  EXPECT_DOUBLE_EQ(b.selective_recompute_flops, 4.0 * T * T * C);
  // Fused (FlashAttention, Dao et al. 2022): no T x T tensor, an fp32 logsumexp per row and
  // head; dropout regenerates its mask from the RNG state. Nothing is left to drop.
  ModelSpec f = s;
  f.attention = Attention::fused;
  const LayerCosts fb = derive_costs(f).block;
  EXPECT_EQ(fb.activation_bytes, 34 * T * C + 4 * NH * T + 16 * T);
  EXPECT_EQ(fb.activation_selective_bytes, fb.activation_bytes);
  EXPECT_EQ(fb.selective_recompute_flops, 0);
  // Model FLOPs do not count FlashAttention's recomputation of Q K^T (MFU convention).
  EXPECT_DOUBLE_EQ(fb.backward_flops(), b.backward_flops());
}

// Korthikanti et al. 2022, Table 2: with tensor parallelism alone the tensors between the
// column- and row-parallel GEMMs split (qkv 6, projection input 2, MLP 16 -> 24/t and the
// attention core 5as/(ht)); block input, norm outputs, residual and the two dropout masks (10)
// stay whole: s*b*h*(10 + 24/t + 5as/(ht)). With sequence parallelism everything splits:
// s*b*h*(34 + 5as/h)/t. The norm statistics split only with SP.
TEST(TensorParallel, ActivationsMatchKorthikanti) {
  const ModelSpec s = korthikanti_gpt();
  const std::int64_t T = 2048, C = 1024, NH = 16;
  for (int t : {2, 4, 8}) {
    SCOPED_TRACE(t);
    const LayerCosts tp = derive_costs(s, {t, false}).block;
    EXPECT_EQ(tp.activation_bytes, 10 * T * C + 24 * T * C / t + 5 * NH * T * T / t + 16 * T);
    EXPECT_EQ(tp.activation_selective_bytes, 10 * T * C + 24 * T * C / t + 16 * T);
    EXPECT_EQ(tp.input_bytes, 2 * T * C);  // every rank holds the whole block input
    const LayerCosts sp = derive_costs(s, {t, true}).block;
    EXPECT_EQ(sp.activation_bytes, (34 * T * C + 5 * NH * T * T + 16 * T) / t);
    EXPECT_EQ(sp.activation_selective_bytes, (34 * T * C + 16 * T) / t);
    EXPECT_EQ(sp.input_bytes, 2 * T * C / t);  // what the pipeline sends shrinks with SP
    EXPECT_EQ(sp.output_bytes, 2 * T * C / t);
    EXPECT_DOUBLE_EQ(sp.selective_recompute_flops, 4.0 * T * T * C / t);
  }
}

// Megatron-LM (Shoeybi et al. 2019): QKV and the MLP's first GEMM are column-parallel (weights
// and biases split), the two output projections row-parallel (weights split, biases replicated),
// norms replicated. Per rank, GPT-2 small (C 768, F 3072):
//   2*2C + (3C^2 + 3C)/t + C^2/t + C + (CF + F)/t + FC/t + C.
TEST(TensorParallel, ParametersAndFlopsSplitAsMegatron) {
  const ModelSpec s = load_model("gpt2-124m");
  const std::int64_t C = 768, F = 3072, V = 50257;
  const ModelCosts one = derive_costs(s);
  for (int t : {2, 4}) {
    SCOPED_TRACE(t);
    const ModelCosts c = derive_costs(s, {t, false});
    EXPECT_EQ(c.block.parameters,
              4 * C + (3 * C * C + 3 * C) / t + C * C / t + C + (C * F + F) / t + F * C / t + C);
    // Every GEMM and attention FLOP divides by t.
    EXPECT_DOUBLE_EQ(c.block.forward_flops, one.block.forward_flops / t);
    EXPECT_DOUBLE_EQ(c.block.backward_flops(), one.block.backward_flops() / t);
    // Vocabulary-parallel embedding: padded V rows / t; positions (1024 x C) replicated.
    const std::int64_t Vp = (V + t - 1) / t * t;  // 50258 for t = 2, 50260 for t = 4
    EXPECT_EQ(padded_vocab(s, t), Vp);
    EXPECT_EQ(c.embedding.parameters, Vp / t * C + 1024 * C);
    EXPECT_EQ(c.tied_copy_parameters, Vp / t * C);
    EXPECT_DOUBLE_EQ(c.head.forward_flops, 2.0 * 1024 * C * (Vp / t));
    // Whole-model totals: one copy of everything, with the padded rows.
    EXPECT_EQ(c.total_parameters, 124'439'808 + (Vp - V) * C);
    // Column- and row-parallel splits sum back to the whole block: t shards plus (t - 1) extra
    // copies of what is replicated (2 norms, 2 row-parallel biases).
    EXPECT_EQ(t * c.block.parameters - (t - 1) * (4 * C + 2 * C), one.block.parameters);
  }
  // sp with t = 1 changes nothing.
  EXPECT_EQ(derive_costs(s, {1, true}).block.activation_bytes, one.block.activation_bytes);
  EXPECT_TRUE(derive_costs(s, {1, true}).block.tp_forward.empty());
}

// Megatron's vocabulary padding (make-vocab-size-divisible-by 128, times t).
TEST(ModelCosts, VocabularyPadding) {
  ModelSpec s = load_model("gpt2-124m");
  EXPECT_EQ(padded_vocab(s), 50257);  // multiple 1, t 1: unchanged
  s.vocab_multiple = 128;
  EXPECT_EQ(padded_vocab(s), 50304);     // 393 x 128
  EXPECT_EQ(padded_vocab(s, 8), 51200);  // 50 x 1024
  // The embedding holds the padded rows: 47 more than 50257, x C.
  EXPECT_EQ(derive_costs(s).total_parameters, 124'439'808 + 47 * 768);
  EXPECT_EQ(parse_model(to_json(s), "rt").vocab_multiple, 128);
}

// Collectives per sample (bytes of the whole T x C tensor, e = 2 bytes, gpt2-124m T 1024):
// Megatron's f / g operators (all-reduce forward in g, backward in f) or, with SP, all-gather
// before and reduce-scatter after each parallel region (backward: the adjoints). f's backward runs
// beside the weight-gradient GEMM, SP's re-gather of a column-parallel input beside the
// input-gradient GEMM; only g's backward (with SP an all-gather) blocks.
TEST(TensorParallel, CollectiveListsAndSizes) {
  const ModelSpec s = load_model("gpt2-124m");
  const std::int64_t full = 2 * 1024 * 768, ce = 1024 * 4;
  using K = CollectiveKind;
  using L = std::vector<TpCollective>;
  const ModelCosts tp = derive_costs(s, {4, false});
  EXPECT_EQ(tp.block.tp_forward, (L{{K::all_reduce, full}, {K::all_reduce, full}}));
  EXPECT_TRUE(tp.block.tp_backward.empty());
  EXPECT_EQ(tp.block.tp_backward_wgrad, (L{{K::all_reduce, full}, {K::all_reduce, full}}));
  EXPECT_TRUE(tp.block.tp_backward_dgrad.empty());
  EXPECT_EQ(tp.embedding.tp_forward, (L{{K::all_reduce, full}}));
  EXPECT_TRUE(tp.embedding.tp_backward.empty());
  EXPECT_EQ(tp.head.tp_forward, (L{{K::all_reduce, ce}, {K::all_reduce, ce}, {K::all_reduce, ce}}));
  EXPECT_TRUE(tp.head.tp_backward.empty());
  EXPECT_EQ(tp.head.tp_backward_wgrad, (L{{K::all_reduce, full}}));
  const ModelCosts sp = derive_costs(s, {4, true});
  const L sp_block = {{K::all_gather, full},
                      {K::reduce_scatter, full},
                      {K::all_gather, full},
                      {K::reduce_scatter, full}};
  EXPECT_EQ(sp.block.tp_forward, sp_block);
  EXPECT_EQ(sp.block.tp_backward, (L{{K::all_gather, full}, {K::all_gather, full}}));
  EXPECT_EQ(sp.block.tp_backward_wgrad, (L{{K::reduce_scatter, full}, {K::reduce_scatter, full}}));
  EXPECT_EQ(sp.block.tp_backward_dgrad, (L{{K::all_gather, full}, {K::all_gather, full}}));
  EXPECT_EQ(sp.embedding.tp_forward, (L{{K::reduce_scatter, full}}));
  EXPECT_EQ(sp.embedding.tp_backward, (L{{K::all_gather, full}}));
  EXPECT_EQ(
      sp.head.tp_forward,
      (L{{K::all_gather, full}, {K::all_reduce, ce}, {K::all_reduce, ce}, {K::all_reduce, ce}}));
  EXPECT_TRUE(sp.head.tp_backward.empty());
  EXPECT_EQ(sp.head.tp_backward_wgrad, (L{{K::reduce_scatter, full}}));
  EXPECT_EQ(sp.head.tp_backward_dgrad, (L{{K::all_gather, full}}));
  const ModelCosts one = derive_costs(s);
  for (LayerKind k : {LayerKind::embedding, LayerKind::block, LayerKind::head}) {
    EXPECT_TRUE(one.layer(k).tp_forward.empty());
    EXPECT_TRUE(one.layer(k).tp_backward.empty());
    EXPECT_TRUE(one.layer(k).tp_backward_wgrad.empty());
    EXPECT_TRUE(one.layer(k).tp_backward_dgrad.empty());
  }
  EXPECT_EQ(to_string(K::reduce_scatter), "reduce_scatter");
}

// Per-rank GEMM shapes (Llama 3 8B, t = 4, b = 2): qkv n = (32 + 2*8)*128/4 = 1536, 8 heads per
// rank, proj k = 1024, MLP n = 3584, lm_head n = 128256/4 = 32064.
TEST(TensorParallel, ForwardGemmsArePerRank) {
  const ModelSpec s = load_model("llama3-8b");
  const auto g = forward_gemms(s, LayerKind::block, 2, {4, true});
  ASSERT_EQ(g.size(), 7u);
  EXPECT_EQ(g[0].n, 1536);
  EXPECT_EQ(g[0].m, 2 * 8192);  // the gathered sequence
  EXPECT_EQ(g[1].batch, 2 * 8);
  EXPECT_EQ(g[3].k, 1024);
  EXPECT_EQ(g[4].n, 3584);
  EXPECT_EQ(g[6].k, 3584);
  EXPECT_EQ(forward_gemms(s, LayerKind::head, 2, {4, true})[0].n, 32064);
  for (Sharding sh : {Sharding{1, false}, Sharding{4, false}, Sharding{8, true}})
    for (LayerKind k : {LayerKind::block, LayerKind::head}) {
      double sum = 0;
      for (const Gemm& x : forward_gemms(s, k, 2, sh))
        sum += x.flops();
      EXPECT_DOUBLE_EQ(sum, 2 * derive_costs(s, sh).layer(k).forward_flops);
    }
}

TEST(TensorParallel, ShardingsThatDoNotDivideAreOneLineErrors) {
  auto error = [](const ModelSpec& s, Sharding sh) {
    std::string msg = testing::error_of([&] { check_sharding(s, sh, "plan.json"); });
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    EXPECT_NE(msg.find("plan.json"), std::string::npos) << msg;
    return msg;
  };
  const ModelSpec gpt2 = load_model("gpt2-124m");  // 12 heads, ffn 3072
  EXPECT_NE(error(gpt2, {5, false}).find("/heads"), std::string::npos);
  EXPECT_NE(error(gpt2, {0, false}).find("at least 1"), std::string::npos);
  const ModelSpec mistral = load_model("mistral-7b");  // 32 heads, 8 KV heads
  EXPECT_NE(error(mistral, {16, false}).find("/kv_heads"), std::string::npos);
  ModelSpec odd_ffn = gpt2;
  odd_ffn.ffn = 3070;
  EXPECT_NE(error(odd_ffn, {4, false}).find("/ffn"), std::string::npos);
  ModelSpec odd_seq = gpt2;
  odd_seq.seq_len = 1022;
  odd_seq.attention = Attention::unfused;
  EXPECT_NO_THROW(check_sharding(odd_seq, {4, false}, "plan.json"));
  EXPECT_NE(error(odd_seq, {4, true}).find("/seq_len"), std::string::npos);
  EXPECT_THROW(derive_costs(gpt2, {5, false}), InputError);
  EXPECT_THROW(forward_gemms(gpt2, LayerKind::block, 1, {5, false}), InputError);
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
  EXPECT_NE(
      load_error(R"({"format": "pipewright.model/1", "name": "x", "kv_heads": 3, )" + ok_tail + "}")
          .find("/kv_heads"),
      std::string::npos);
  EXPECT_NE(load_error(R"({"format": "pipewright.model/1", "name": "x", "kv_heads": -1, )" +
                       ok_tail + "}")
                .find("/kv_heads"),
            std::string::npos);
  EXPECT_NE(load_error(R"({"format": "pipewright.model/1", "name": "x", "attention": "flash", )" +
                       ok_tail + "}")
                .find("/attention"),
            std::string::npos);
  EXPECT_NE(
      load_error(R"({"format": "pipewright.model/1", "name": "x", "dropout": 1, )" + ok_tail + "}")
          .find("/dropout"),
      std::string::npos);
  EXPECT_NE(load_error(R"({"format": "pipewright.model/1", "name": "x", "vocab_multiple": 0, )" +
                       ok_tail + "}")
                .find("/vocab_multiple"),
            std::string::npos);
  // Sizes whose products would wrap int64 are refused, not wrapped.
  EXPECT_NE(load_error(R"({"format": "pipewright.model/1", "name": "x", "layers": 2,
      "hidden": 4000000000, "heads": 4, "seq_len": 64, "vocab": 256, "max_positions": 64})")
                .find("/hidden"),
            std::string::npos);
  EXPECT_NE(load_error(R"({"format": "pipewright.model/1", "name": "x", "layers": 2,
      "hidden": 64, "heads": 4, "seq_len": 300000000, "vocab": 256, "positions": "rope"})")
                .find("/seq_len"),
            std::string::npos);
  EXPECT_NE(load_error(R"({"format": "pipewright.model/1", "name": "x", "layers": 2,
      "hidden": 64, "heads": 4, "seq_len": 64, "vocab": 256, "vocab_multiple": 9e15})")
                .find("/vocab_multiple"),
            std::string::npos);
  EXPECT_NE(load_error(R"({"format": "pipewright.model/1", "name": "x", "layers": 9e15,
      "hidden": 64, "heads": 4, "seq_len": 64, "vocab": 256})")
                .find("/layers"),
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
