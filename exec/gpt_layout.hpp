// A GPT stage's parameter table, stash layout and buffer sizes, host-only and shared by the
// backends: exec/cpu counts in fp32 elements (4 bytes), exec/cuda in bf16 elements (2 bytes).
// Either way sizes x element bytes = models::derive_costs for a model of that dtype.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "exec/stage_compute.hpp"

namespace pw::exec {

// A block's tensors in layout order; weights are (out, in) as in nn.Linear.
enum BlockTensor {
  ln1_w,
  ln1_b,
  qkv_w,
  qkv_b,
  attproj_w,
  attproj_b,
  ln2_w,
  ln2_b,
  fc_w,
  fc_b,
  fcproj_w,
  fcproj_b,
  kBlockTensors
};

// The model as the executors run it: unfused attention (both backends materialize the T x T
// scores) and no dropout (neither backend has it). train, profile and validate plan and predict
// with this spec; a GptLayout refuses a fused or dropout one.
models::ModelSpec as_executed(models::ModelSpec model);

struct GptLayout {
  // A layout in elements of `dtype` (the backend computes in it whatever the model says).
  // Validates the model (GPT-2 style; with 2-byte elements an even seq_len) and the block range;
  // throws pw::InputError naming `backend` ("cpu", "cuda").
  GptLayout(const StageSpec& spec, models::DType dtype, const std::string& backend);

  // Sizes in elements for a microbatch of b samples: fp32 statistics and losses and int32 ids
  // take word_elements each, exactly as models/ counts them (4 bytes).
  StageSizes sizes(int b) const;

  // Stash elements of one layer for BT = b * T tokens (the carving in the backends' gpt_stage).
  std::int64_t embedding_elements(std::int64_t BT) const { return word_elements * BT; }
  // With TP (t > 1) a rank keeps the full-width x, ln1, resid1, ln2 and its shard of qkv, the
  // attention output, the scores and the MLP's F-wide tensors; the head its vocabulary shard.
  // With SP the full-width tensors and the norms' statistics hold the rank's rows(BT) tokens.
  std::int64_t rows(std::int64_t BT) const { return BT / T * R; }
  // Selective recompute: no scores.
  std::int64_t block_elements(std::int64_t BT) const {
    return rows(BT) * (4 * C + 4 * word_elements) +
           BT * (4 * C_t + 2 * F_t + (selective ? 0 : NH_t * T));
  }
  std::int64_t head_elements(std::int64_t BT) const {
    return rows(BT) * (2 * C + 2 * word_elements) + BT * (V_t + 2 * word_elements);
  }

  StageSpec spec;
  int element_bytes = 4;
  std::int64_t word_elements = 1;  // elements of one 4-byte value (fp32 statistic, int32 id)
  std::vector<TensorSlot> slots;   // names, offsets and sizes in elements, the same for any dtype
  models::ModelCosts costs;        // per sample, in the layout's dtype
  std::int64_t C = 0, F = 0, T = 0, NH = 0;
  // Vocabulary: V the model's, V_pad Megatron's padding of it for t (padded_vocab), V_t = V_pad / t
  // rows on each TP rank, this rank's rows [v_begin, v_begin + V_t) of the padded table. Logits of
  // rows >= V (padding) never enter the softmax.
  std::int64_t V = 0, V_pad = 0, V_t = 0, v_begin = 0;
  // TP: t ranks, this one tp; per-rank hidden (the attention's heads), ffn and heads.
  std::int64_t t = 1, tp = 0, C_t = 0, F_t = 0, NH_t = 0;
  bool sp = false;
  bool selective = false;  // StageSpec::selective
  std::int64_t R = 0;      // tokens per sample outside the TP region: T, or T / t with SP
  std::int64_t wte = -1, wpe = -1, lnf_w = -1, lnf_b = -1, head_w = -1, parameters = 0;
  std::vector<std::int64_t> block_base;     // offset of each block's first tensor
  std::int64_t block_rel[kBlockTensors]{};  // offsets of a block's tensors from its first

 private:
  std::int64_t add_slot(const std::string& name, std::int64_t size);
};

}  // namespace pw::exec
