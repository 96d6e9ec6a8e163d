// The GPT stage layout both backends share (exec/gpt_layout.*), in fp32 elements (exec/cpu) and
// bf16 elements (exec/cuda): sizes x element bytes are the planner's for a model of that dtype,
// the parameter table is the same for both and is the CPU stage's, and only the 4-byte values
// (statistics, losses, ids) take more elements in bf16. Host-only: runs in every build.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "exec/gpt_layout.hpp"
#include "exec/stage_compute.hpp"
#include "models/model.hpp"
#include "test_util.hpp"

namespace {

using pw::exec::GptLayout;
using pw::exec::StageSpec;
using pw::models::DType;

constexpr auto stage = pw::testing::stage_spec;

// The backends: exec/cpu in fp32, exec/cuda in bf16.
struct Backend {
  DType dtype;
  const char* name;
};
const Backend kBackends[] = {{DType::fp32, "cpu"}, {DType::bf16, "cuda"}};

GptLayout layout(const StageSpec& spec, const Backend& be) {
  return GptLayout(spec, be.dtype, be.name);
}

// The whole model, the first, a middle and the last stage of a 3-way split, the embedding alone.
std::vector<StageSpec> splits(const pw::models::ModelSpec& m) {
  return {stage(m, true, 0, 3, true), stage(m, true, 0, 1, false), stage(m, false, 1, 1, false),
          stage(m, false, 2, 1, true), stage(m, true, 0, 0, false)};
}

}  // namespace

// sizes() x element bytes = b x models::derive_costs (in the layout's dtype) summed over the
// stage's layers.
TEST(GptLayout, SizesMatchTheModelsCostsInEitherElementSize) {
  for (const Backend& be : kBackends) {
    SCOPED_TRACE(be.name);
    auto m = pw::testing::gpt_tiny(3);
    m.dtype = be.dtype;
    const std::int64_t e = pw::models::dtype_bytes(be.dtype);
    const auto c = pw::models::derive_costs(m);
    const auto& E = c.embedding;
    const auto& K = c.block;
    const auto& H = c.head;
    struct Case {
      StageSpec spec;
      std::int64_t act_bytes, input_bytes, params, workspace_bytes;
    };
    const Case cases[] = {
        {stage(m, true, 0, 3, true),
         E.activation_bytes + 3 * K.activation_bytes + H.activation_bytes,
         E.activation_recompute_bytes, c.total_parameters,
         std::max(K.workspace_bytes, H.workspace_bytes)},
        {stage(m, true, 0, 1, false), E.activation_bytes + K.activation_bytes,
         E.activation_recompute_bytes, E.parameters + K.parameters, K.workspace_bytes},
        {stage(m, false, 1, 1, false), K.activation_bytes, K.input_bytes, K.parameters,
         K.workspace_bytes},
        {stage(m, false, 2, 1, true), K.activation_bytes + H.activation_bytes, K.input_bytes,
         K.parameters + H.parameters + c.tied_copy_parameters,
         std::max(K.workspace_bytes, H.workspace_bytes)},
        {stage(m, true, 0, 0, false), E.activation_bytes, E.activation_recompute_bytes,
         E.parameters, E.workspace_bytes},
    };
    for (const int b : {1, 3}) {
      for (const Case& k : cases) {
        const auto z = layout(k.spec, be).sizes(b);
        EXPECT_EQ(z.stash * e, b * k.act_bytes);
        EXPECT_EQ(z.stash_recompute * e, b * k.input_bytes);
        EXPECT_EQ(z.parameters, k.params);
        EXPECT_EQ(z.workspace * e, b * k.workspace_bytes);
        EXPECT_EQ(z.input, k.spec.has_embedding ? 0 : b * m.seq_len * m.hidden);
        EXPECT_EQ(z.output, k.spec.has_head ? 0 : b * m.seq_len * m.hidden);
      }
    }
  }
}

// The same slots (names, offsets, sizes) in either element size, and they are the CPU stage's:
// weights copy between the backends slot by slot.
TEST(GptLayout, TheParameterTableIsTheCpuStagesInEitherElementSize) {
  for (const StageSpec& s : splits(pw::testing::gpt_tiny(3))) {
    const std::string name = "stage [" + std::to_string(s.first_block) + ", " +
                             std::to_string(s.first_block + s.blocks) + ")";
    const GptLayout fp32 = layout(s, kBackends[0]), bf16 = layout(s, kBackends[1]);
    const auto cpu = pw::exec::make_cpu_stage(s);
    ASSERT_EQ(bf16.slots.size(), cpu->layout().size()) << name;
    ASSERT_EQ(fp32.slots.size(), cpu->layout().size()) << name;
    std::int64_t end = 0;  // slots tile the blob
    for (std::size_t i = 0; i < cpu->layout().size(); ++i) {
      const auto& want = cpu->layout()[i];
      for (const GptLayout* l : {&fp32, &bf16}) {
        EXPECT_EQ(l->slots[i].name, want.name) << name;
        EXPECT_EQ(l->slots[i].offset, want.offset) << name;
        EXPECT_EQ(l->slots[i].size, want.size) << name;
      }
      EXPECT_EQ(want.offset, end) << want.name;
      end += want.size;
    }
    EXPECT_EQ(end, cpu->sizes(2).parameters) << name;
    EXPECT_EQ(bf16.sizes(2).parameters, cpu->sizes(2).parameters) << name;
    EXPECT_EQ(fp32.sizes(2).parameters, cpu->sizes(2).parameters) << name;
    EXPECT_EQ(bf16.block_base, fp32.block_base) << name;
    EXPECT_TRUE(std::equal(std::begin(bf16.block_rel), std::end(bf16.block_rel),
                           std::begin(fp32.block_rel)))
        << name;
    EXPECT_EQ(bf16.wte, fp32.wte) << name;
    EXPECT_EQ(bf16.head_w, fp32.head_w) << name;
  }
}

// A layer's stash holds the same tensors in either element size; per token the four 4-byte values
// of a block (two norms' mean and rstd) and of the head (mean, rstd, target id, loss) and the
// embedding's token id take one fp32 element or two bf16 elements each.
TEST(GptLayout, FourByteValuesTakeTwoBf16Elements) {
  const auto m = pw::testing::gpt_tiny(3);
  const GptLayout fp32 = layout(stage(m, true, 0, 3, true), kBackends[0]);
  const GptLayout bf16 = layout(stage(m, true, 0, 3, true), kBackends[1]);
  EXPECT_EQ(fp32.word_elements, 1);
  EXPECT_EQ(bf16.word_elements, 2);
  for (const std::int64_t BT : {m.seq_len, 3 * m.seq_len}) {
    EXPECT_EQ(fp32.embedding_elements(BT), BT);
    EXPECT_EQ(bf16.embedding_elements(BT), 2 * BT);
    EXPECT_EQ(bf16.block_elements(BT) - fp32.block_elements(BT), 4 * BT);
    EXPECT_EQ(bf16.head_elements(BT) - fp32.head_elements(BT), 4 * BT);
  }
}

TEST(GptLayout, RejectsWhatTheBackendsCannotRun) {
  for (const Backend& be : kBackends) {
    SCOPED_TRACE(be.name);
    auto m = pw::testing::gpt_tiny(3);
    m.mlp = pw::models::Mlp::swiglu;
    const std::string msg = pw::testing::error_of([&] { layout(stage(m, true, 0, 3, true), be); });
    const std::string backend = be.dtype == DType::fp32 ? "CPU backend" : "CUDA backend";
    EXPECT_NE(msg.find("mlp"), std::string::npos) << msg;
    EXPECT_NE(msg.find(backend), std::string::npos) << msg;
    m = pw::testing::gpt_tiny(3);
    m.arch = pw::models::Arch::bert;
    EXPECT_THROW(layout(stage(m, true, 0, 3, true), be), pw::InputError);
    EXPECT_THROW(layout(stage(pw::testing::gpt_tiny(3), false, 0, 1, true), be), pw::InputError);
    // Both backends run unfused attention without dropout or GQA (what the prediction counts must
    // be what they stash): one-line errors naming the field.
    auto refused = [&](auto edit, const char* field) {
      auto x = pw::testing::gpt_tiny(3);
      edit(x);
      const std::string e = pw::testing::error_of([&] { layout(stage(x, true, 0, 3, true), be); });
      EXPECT_NE(e.find(field), std::string::npos) << e;
      EXPECT_EQ(e.find('\n'), std::string::npos) << e;
    };
    refused([](auto& x) { x.attention = pw::models::Attention::fused; }, "attention = fused");
    refused([](auto& x) { x.dropout = true; }, "dropout");
    refused([](auto& x) { x.kv_heads = 2; }, "kv_heads");
    StageSpec sp = stage(pw::testing::gpt_tiny(3), true, 0, 3, true);
    sp.t = 2;
    sp.sp = true;
    EXPECT_NO_THROW(layout(sp, be));
    auto padded = pw::testing::gpt_tiny(3);
    padded.vocab_multiple = 100;
    EXPECT_EQ(layout(stage(padded, true, 0, 3, true), be).V_pad, 300);
    auto fused = pw::testing::gpt_tiny(3);
    fused.attention = pw::models::Attention::fused;
    EXPECT_NO_THROW(layout(stage(pw::exec::as_executed(fused), true, 0, 3, true), be));
  }
  // An odd seq_len would leave bf16's fp32 statistics misaligned; fp32 elements have no such limit.
  auto m = pw::testing::gpt_tiny(3);
  m.seq_len = 63;
  EXPECT_THROW(layout(stage(m, true, 0, 3, true), kBackends[1]), pw::InputError);
  EXPECT_NO_THROW(layout(stage(m, true, 0, 3, true), kBackends[0]));
}

// The layout of TP rank k of t, with and without SP, in either element size: sizes x element
// bytes = b x derive_costs(m, {t, sp}) (one rank's share, in the layout's dtype), the vocabulary
// padded for t and split in t row ranges; the CUDA layout's slots are the CPU layout's (weights
// copy slot by slot).
TEST(GptLayout, TensorParallelShardsMatchTheModelsCosts) {
  for (const Backend& be : kBackends)
    for (const int t : {2, 4})
      for (const bool sp : {false, true}) {
        SCOPED_TRACE(std::string(be.name) + " t=" + std::to_string(t) + (sp ? " sp" : ""));
        auto m = pw::testing::gpt_tiny(3);
        m.vocab = 250;
        m.vocab_multiple = 4;  // 256 rows for t = 2 and 4
        m.tied_embeddings = t == 2;
        m.dtype = be.dtype;
        const std::int64_t e = pw::models::dtype_bytes(be.dtype);
        const auto c = pw::models::derive_costs(m, {t, sp});
        for (int k = 0; k < t; ++k) {
          StageSpec first = stage(m, true, 0, 1, false), last = stage(m, false, 1, 2, true);
          first.t = last.t = t;
          first.sp = last.sp = sp;
          first.tp_rank = last.tp_rank = k;
          const GptLayout a = layout(first, be), z = layout(last, be);
          const GptLayout cpu = layout(last, kBackends[0]);
          ASSERT_EQ(z.slots.size(), cpu.slots.size());
          for (std::size_t i = 0; i < z.slots.size(); ++i) {
            EXPECT_EQ(z.slots[i].name, cpu.slots[i].name);
            EXPECT_EQ(z.slots[i].offset, cpu.slots[i].offset);
            EXPECT_EQ(z.slots[i].size, cpu.slots[i].size);
          }
          EXPECT_EQ(a.V_pad, 256);
          EXPECT_EQ(a.V_t, 256 / t);
          EXPECT_EQ(a.v_begin, k * 256 / t);
          for (const int b : {1, 2}) {
            const auto sa = a.sizes(b), sz = z.sizes(b);
            EXPECT_EQ(sa.parameters, c.embedding.parameters + c.block.parameters);
            EXPECT_EQ(sa.stash * e, b * (c.embedding.activation_bytes + c.block.activation_bytes));
            EXPECT_EQ(sa.workspace * e, b * c.block.workspace_bytes);
            EXPECT_EQ(sz.parameters,
                      2 * c.block.parameters + c.head.parameters + c.tied_copy_parameters);
            EXPECT_EQ(sz.stash * e, b * (2 * c.block.activation_bytes + c.head.activation_bytes));
            EXPECT_EQ(sz.workspace * e,
                      b * std::max(c.block.workspace_bytes, c.head.workspace_bytes));
            // Without SP the whole activation; with SP the rank's 1/t of the tokens.
            EXPECT_EQ(sz.input, b * m.seq_len * m.hidden / (sp ? t : 1));
          }
        }
      }
}
