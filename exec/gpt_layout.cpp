// A GPT stage's parameter table and sizes (exec/gpt_layout.hpp).
#include "exec/gpt_layout.hpp"

#include <algorithm>
#include <cctype>

#include "common/error.hpp"

namespace pw::exec {

namespace {

const char* const kBlockNames[kBlockTensors] = {"ln1_w",     "ln1_b",     "qkv_w",    "qkv_b",
                                                "attproj_w", "attproj_b", "ln2_w",    "ln2_b",
                                                "fc_w",      "fc_b",      "fcproj_w", "fcproj_b"};

void unsupported(const models::ModelSpec& m, const std::string& backend, const std::string& field,
                 const std::string& value) {
  std::string name = backend;
  for (char& c : name)
    c = char(std::toupper(static_cast<unsigned char>(c)));
  throw InputError("model '" + m.name + "': " + field + " = " + value +
                   " is not supported by the " + name + " backend yet (GPT-2 style only)");
}

}  // namespace

models::ModelSpec as_executed(models::ModelSpec model) {
  model.attention = models::Attention::unfused;
  model.dropout = false;
  return model;
}

GptLayout::GptLayout(const StageSpec& s, models::DType dtype, const std::string& backend)
    : spec(s), element_bytes(models::dtype_bytes(dtype)), word_elements(4 / element_bytes) {
  const models::ModelSpec& m = s.model;
  models::validate(m, backend + " stage");
  // t dividing heads, kv_heads, ffn and the padded vocabulary first: those errors name the field.
  if (s.t < 1 || s.tp_rank < 0 || s.tp_rank >= s.t)
    throw InputError("stage of model '" + m.name + "': TP rank " + std::to_string(s.tp_rank) +
                     " of t = " + std::to_string(s.t));
  const models::Sharding sharding{s.t, s.sp && s.t > 1};
  models::check_sharding(m, sharding, "model " + m.name);
  if (m.arch != models::Arch::gpt) unsupported(m, backend, "arch", "bert");
  if (m.mlp != models::Mlp::gelu) unsupported(m, backend, "mlp", "swiglu");
  if (m.norm != models::Norm::layernorm) unsupported(m, backend, "norm", "rmsnorm");
  if (m.positions != models::Positions::learned) unsupported(m, backend, "positions", "rope");
  if (!m.bias) unsupported(m, backend, "bias", "false");
  // Both backends materialize the attention scores (unfused) and run without dropout; the
  // planner's prediction must count the same tensors (as_executed()).
  if (m.attention != models::Attention::unfused) unsupported(m, backend, "attention", "fused");
  if (m.dropout) unsupported(m, backend, "dropout", "true");
  if (models::key_value_heads(m) != m.heads)
    unsupported(m, backend, "kv_heads", std::to_string(models::key_value_heads(m)));
  // Both stages run Megatron's tensor and sequence parallelism, vocabulary padding (padded
  // logits masked out of the softmax) and selective recompute.
  // fp32 statistics sit between 2-byte tensors in the stash: an even token count keeps them
  // 4-byte aligned for every b.
  if (m.seq_len % word_elements != 0)
    unsupported(m, backend, "seq_len", std::to_string(m.seq_len) + " (odd)");
  if (s.first_block < 0 || s.blocks < 0 || s.first_block + s.blocks > m.layers ||
      (s.has_embedding && s.first_block != 0) ||
      (s.has_head && s.first_block + s.blocks != m.layers))
    throw InputError("stage of model '" + m.name + "': blocks [" + std::to_string(s.first_block) +
                     ", " + std::to_string(s.first_block + s.blocks) +
                     ") do not fit the embedding/head placement or the model's " +
                     std::to_string(m.layers) + " layers");
  models::ModelSpec md = m;
  md.dtype = dtype;
  costs = models::derive_costs(md, sharding);
  C = m.hidden, F = m.ffn, T = m.seq_len, NH = m.heads, V = m.vocab;
  t = s.t, tp = s.tp_rank, C_t = C / t, F_t = F / t, NH_t = NH / t;
  sp = sharding.sp, R = sp ? T / t : T;
  selective = s.selective;
  // The embedding's backward gathers its output's gradient into the workspace of the stage's
  // blocks or head; an embedding-only stage has none.
  if (sp && s.has_embedding && s.blocks == 0 && !s.has_head)
    throw InputError("stage of model '" + m.name +
                     "': sequence parallelism needs blocks on the embedding's stage");
  V_pad = models::padded_vocab(m, s.t), V_t = V_pad / t, v_begin = tp * V_t;
  // The backends' stash carving must be what models/ counts.
  if (element_bytes * embedding_elements(T) != costs.embedding.activation_bytes ||
      element_bytes * block_elements(T) !=
          (selective ? costs.block.activation_selective_bytes : costs.block.activation_bytes) ||
      element_bytes * head_elements(T) != costs.head.activation_bytes)
    throw Error(backend + " stage: the stash layout disagrees with models::derive_costs (" +
                models::to_string(dtype) + ")");
  if (s.has_embedding) {
    wte = add_slot("wte", V_t * C);
    wpe = add_slot("wpe", m.max_positions * C);
  }
  // Column-parallel qkv (this rank's heads of q, k and v) and fc, row-parallel projections (their
  // biases whole), norms replicated.
  const std::int64_t sizes[kBlockTensors] = {C, C, 3 * C_t * C, 3 * C_t, C * C_t, C,
                                             C, C, F_t * C,     F_t,     C * F_t, C};
  for (std::int64_t l = s.first_block; l < s.first_block + s.blocks; ++l) {
    block_base.push_back(parameters);
    for (int k = 0; k < kBlockTensors; ++k) {
      const std::int64_t off = add_slot("h" + std::to_string(l) + "." + kBlockNames[k], sizes[k]);
      block_rel[k] = off - block_base.back();
    }
  }
  if (s.has_head) {
    lnf_w = add_slot("lnf_w", C);
    lnf_b = add_slot("lnf_b", C);
    // A single stage with both ends uses wte itself; otherwise the head holds its own V_t x C.
    head_w = (s.has_embedding && m.tied_embeddings) ? wte : add_slot("lm_head", V_t * C);
  }
}

std::int64_t GptLayout::add_slot(const std::string& name, std::int64_t size) {
  slots.push_back({name, parameters, size});
  parameters += size;
  return slots.back().offset;
}

StageSizes GptLayout::sizes(int b) const {
  const models::LayerCosts* layers[3] = {spec.has_embedding ? &costs.embedding : nullptr,
                                         spec.blocks > 0 ? &costs.block : nullptr,
                                         spec.has_head ? &costs.head : nullptr};
  const std::int64_t count[3] = {1, spec.blocks, 1};
  std::int64_t stash = 0, workspace = 0, largest = 0;
  for (int i = 0; i < 3; ++i) {
    if (!layers[i]) continue;
    // Selective: the blocks' stash without the scores (models/: activation_selective_bytes).
    stash += count[i] *
             (selective ? layers[i]->activation_selective_bytes : layers[i]->activation_bytes);
    workspace = std::max(workspace, layers[i]->workspace_bytes);
    largest = std::max(largest, layers[i]->activation_bytes);
  }
  StageSizes z;
  z.parameters = parameters;
  z.stash = b * stash / element_bytes;
  z.stash_recompute =
      b *
      (spec.has_embedding ? costs.embedding.activation_recompute_bytes : costs.block.input_bytes) /
      element_bytes;
  z.output = spec.has_head ? 0 : b * R * C;
  z.input = spec.has_embedding ? 0 : b * R * C;
  z.workspace = b * workspace / element_bytes;
  z.scratch = b * largest / element_bytes;
  return z;
}

}  // namespace pw::exec
