// The bf16 GPT stage's parameter table, stash layout and buffer sizes, host-only: the same tensor
// slots as exec/cpu, and sizes in bf16 elements whose bytes equal models::derive_costs for a bf16
// model.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "exec/stage_compute.hpp"

namespace pw::exec::cuda {

// A block's tensors in layout order; weights are (out, in) as in nn.Linear (as exec/cpu).
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

struct GptLayout {
  // Validates the model (GPT-2 style, even seq_len) and the block range; throws pw::InputError.
  explicit GptLayout(const StageSpec& spec);

  // Sizes in bf16 ELEMENTS (2 bytes) for a microbatch of b samples: fp32 statistics and losses and
  // int32 ids take two elements each, exactly as models/ counts them (4 bytes).
  StageSizes sizes(int b) const;

  // Stash elements of one layer for BT = b * T tokens (the carving in gpt_stage.cpp).
  std::int64_t embedding_elements(std::int64_t BT) const { return 2 * BT; }
  std::int64_t block_elements(std::int64_t BT) const {
    return BT * (8 * C + 2 * F + NH * T) + 8 * BT;
  }
  std::int64_t head_elements(std::int64_t BT) const { return BT * (2 * C + V) + 8 * BT; }

  StageSpec spec;
  std::vector<TensorSlot> slots;  // names, offsets and sizes in elements, as exec/cpu's layout()
  models::ModelCosts costs;       // per sample, bf16
  std::int64_t C = 0, F = 0, T = 0, NH = 0, V = 0;
  std::int64_t wte = -1, wpe = -1, lnf_w = -1, lnf_b = -1, head_w = -1, parameters = 0;
  std::vector<std::int64_t> block_base;     // offset of each block's first tensor
  std::int64_t block_rel[kBlockTensors]{};  // offsets of a block's tensors from its first

 private:
  std::int64_t add_slot(const std::string& name, std::int64_t size);
};

}  // namespace pw::exec::cuda
