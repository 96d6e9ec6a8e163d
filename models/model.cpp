// Derived per-layer costs of a transformer: parameters, FLOPs and the bytes a real implementation
// keeps. Every formula is written out in docs/formulas.md.
#include "models/model.hpp"

#include <algorithm>

#include <fmt/format.h>

namespace pw::models {

int dtype_bytes(DType t) {
  return t == DType::fp32 ? 4 : 2;
}

std::string to_string(DType t) {
  switch (t) {
    case DType::fp32:
      return "fp32";
    case DType::fp16:
      return "fp16";
    case DType::bf16:
      return "bf16";
  }
  return "?";
}

std::string to_string(Arch a) {
  return a == Arch::gpt ? "gpt" : "bert";
}

std::string to_string(LayerKind k) {
  switch (k) {
    case LayerKind::embedding:
      return "embedding";
    case LayerKind::block:
      return "block";
    case LayerKind::head:
      return "head";
  }
  return "?";
}

DType parse_dtype(const std::string& s) {
  if (s == "fp32") return DType::fp32;
  if (s == "fp16") return DType::fp16;
  if (s == "bf16") return DType::bf16;
  throw InputError(fmt::format("unknown dtype \"{}\" (expected fp32, fp16 or bf16)", s));
}

Arch parse_arch(const std::string& s) {
  if (s == "gpt") return Arch::gpt;
  if (s == "bert") return Arch::bert;
  throw InputError(fmt::format("unknown arch \"{}\" (expected gpt or bert)", s));
}

const LayerCosts& ModelCosts::layer(LayerKind k) const {
  return k == LayerKind::embedding ? embedding : (k == LayerKind::block ? block : head);
}

namespace {

constexpr std::int64_t kStatBytes = 4;  // LayerNorm mean / rstd, losses, token ids: fp32 / int32

// Parameters of one normalization over C features: scale (+ shift for LayerNorm).
std::int64_t norm_params(const ModelSpec& s) {
  return s.norm == Norm::layernorm ? 2 * s.hidden : s.hidden;
}

// Bytes a normalization keeps besides its output: mean and rstd per token (RMSNorm: rstd only).
std::int64_t norm_stat_bytes(const ModelSpec& s) {
  return (s.norm == Norm::layernorm ? 2 : 1) * s.seq_len * kStatBytes;
}

std::int64_t linear_params(const ModelSpec& s, std::int64_t in, std::int64_t out) {
  return in * out + (s.bias ? out : 0);
}

// Number of F-wide tensors the MLP keeps: GELU keeps the pre-activation and the activation;
// SwiGLU keeps gate, up and their product.
std::int64_t mlp_hidden_tensors(const ModelSpec& s) {
  return s.mlp == Mlp::gelu ? 2 : 3;
}

LayerCosts block_costs(const ModelSpec& s) {
  const std::int64_t C = s.hidden, F = s.ffn, T = s.seq_len, NH = s.heads, e = dtype_bytes(s.dtype);
  LayerCosts c;
  c.kind = LayerKind::block;
  const std::int64_t mlp_in = s.mlp == Mlp::gelu ? 1 : 2;  // SwiGLU has gate + up projections
  c.parameters = 2 * norm_params(s) + linear_params(s, C, 3 * C) + linear_params(s, C, C) +
                 mlp_in * linear_params(s, C, F) + linear_params(s, F, C);
  double gemm = 2.0 * T * C * (3.0 * C + C + (mlp_in + 1.0) * F);  // qkv, proj, MLP
  double attn = 2.0 * 2.0 * double(T) * T * C;                     // Q K^T and P V, all heads
  c.forward_flops = gemm + attn;
  // dX for every GEMM; attention backward needs two matmuls per forward one (dP, dV; dQ, dK).
  c.backward_input_flops = gemm + 2.0 * attn;
  c.backward_weight_flops = gemm;  // dW for every weight GEMM
  // Stashed tensors (per sample): x_in, ln1_out, qkv (3C), attention probabilities (NH x T x T),
  // attention output before the projection, residual after attention, ln2_out, MLP hidden
  // tensors, and the normalization statistics of both norms.
  c.activation_bytes =
      e * T * (8 * C + mlp_hidden_tensors(s) * F + NH * T) + 2 * norm_stat_bytes(s);
  c.input_bytes = e * T * C;
  c.activation_recompute_bytes = c.input_bytes;
  c.output_bytes = e * T * C;
  // Two gradient scratch buffers the size of the widest intermediate.
  c.workspace_bytes = 2 * e * T * std::max({3 * C, F, NH * T});
  // Forward traffic of non-GEMM ops (read + write): two norms (2 x 2TC), two residual adds
  // (2 x 3TC), softmax (2 x NH T T), activation (GELU: 2TF, SwiGLU: 3TF).
  c.elementwise_bytes =
      double(e) * T * (4.0 * C + 6.0 * C + 2.0 * NH * T + (s.mlp == Mlp::gelu ? 2.0 : 3.0) * F);
  return c;
}

LayerCosts embedding_costs(const ModelSpec& s) {
  const std::int64_t C = s.hidden, T = s.seq_len, e = dtype_bytes(s.dtype);
  LayerCosts c;
  c.kind = LayerKind::embedding;
  c.parameters = s.vocab * C;
  if (s.positions == Positions::learned) c.parameters += s.max_positions * C;
  c.parameters += s.type_vocab * C;
  const bool bert = s.arch == Arch::bert;
  if (bert) c.parameters += norm_params(s);  // BERT normalizes the summed embeddings
  c.input_bytes = T * kStatBytes;            // token ids (int32)
  // Kept for backward: the token ids (and BERT's token types, its pre-norm sum and statistics).
  c.activation_bytes = T * kStatBytes;
  if (bert) c.activation_bytes += T * kStatBytes + e * T * C + norm_stat_bytes(s);
  c.activation_recompute_bytes = c.activation_bytes;
  c.output_bytes = e * T * C;
  c.workspace_bytes = 0;
  // Gather rows, add positions (read 2TC, write TC); BERT's norm adds 2TC.
  c.elementwise_bytes = double(e) * T * C * (bert ? 5.0 : 3.0);
  return c;
}

LayerCosts head_costs(const ModelSpec& s) {
  const std::int64_t C = s.hidden, T = s.seq_len, V = s.vocab, e = dtype_bytes(s.dtype);
  const bool bert = s.arch == Arch::bert;
  LayerCosts c;
  c.kind = LayerKind::head;
  // GPT: final norm + LM head. BERT: MLM transform (dense + GELU + norm) + decoder bias.
  c.parameters = norm_params(s);
  if (bert) c.parameters += linear_params(s, C, C) + V;
  if (!s.tied_embeddings) c.parameters += V * C;
  double gemm = 2.0 * T * C * V + (bert ? 2.0 * T * C * C : 0.0);
  c.forward_flops = gemm;
  c.backward_input_flops = gemm;
  c.backward_weight_flops = gemm;
  // Kept: the input, the final norm output (+ statistics), BERT's dense and GELU outputs, the
  // logits (turned into probabilities in place for the loss backward), per-token losses, targets.
  c.input_bytes = e * T * C;
  c.activation_bytes = e * T * ((bert ? 4 : 2) * C + V) + norm_stat_bytes(s) + 2 * T * kStatBytes;
  c.activation_recompute_bytes = c.input_bytes;
  c.output_bytes = T * kStatBytes;  // per-token loss
  c.workspace_bytes = e * T * V;    // gradient of the logits
  c.elementwise_bytes = double(e) * T * (2.0 * C + 3.0 * V + (bert ? 6.0 * C : 0.0));
  return c;
}

}  // namespace

ModelCosts derive_costs(const ModelSpec& spec, const Sharding& sharding) {
  if (sharding.t != 1) throw InputError("tensor parallelism: not implemented yet");
  ModelCosts m;
  m.embedding = embedding_costs(spec);
  m.block = block_costs(spec);
  m.head = head_costs(spec);
  m.total_parameters =
      m.embedding.parameters + spec.layers * m.block.parameters + m.head.parameters;
  m.tied_copy_parameters = spec.tied_embeddings ? spec.vocab * spec.hidden : 0;
  double per_layer[3] = {0, 0, 0};
  const LayerCosts* layers[3] = {&m.embedding, &m.block, &m.head};
  for (int i = 0; i < 3; ++i)
    per_layer[i] = layers[i]->forward_flops + layers[i]->backward_flops();
  m.flops_per_sample = per_layer[0] + spec.layers * per_layer[1] + per_layer[2];
  return m;
}

std::vector<Gemm> forward_gemms(const ModelSpec& s, LayerKind kind, std::int64_t b,
                                const Sharding& sharding) {
  if (sharding.t != 1) throw InputError("tensor parallelism: not implemented yet");
  const std::int64_t C = s.hidden, F = s.ffn, T = s.seq_len, NH = s.heads, hd = C / NH;
  const std::int64_t rows = b * T;
  switch (kind) {
    case LayerKind::embedding:
      return {};
    case LayerKind::block: {
      std::vector<Gemm> g = {{"qkv", rows, 3 * C, C, 1},
                             {"attn_scores", T, T, hd, b * NH, false},
                             {"attn_values", T, hd, T, b * NH, false},
                             {"attn_proj", rows, C, C, 1}};
      if (s.mlp == Mlp::swiglu) {
        g.push_back({"mlp_gate", rows, F, C, 1});
        g.push_back({"mlp_up", rows, F, C, 1});
      } else {
        g.push_back({"mlp_fc", rows, F, C, 1});
      }
      g.push_back({"mlp_proj", rows, C, F, 1});
      return g;
    }
    case LayerKind::head: {
      std::vector<Gemm> g;
      if (s.arch == Arch::bert) g.push_back({"mlm_dense", rows, C, C, 1});
      g.push_back({"lm_head", rows, s.vocab, C, 1});
      return g;
    }
  }
  return {};
}

void validate(const ModelSpec& s, const std::string& source) {
  auto bad = [&](const char* field, const std::string& why) {
    throw InputError(fmt::format("{}: /{}: {}", source, field, why));
  };
  const std::pair<const char*, std::int64_t> positive[] = {
      {"layers", s.layers}, {"hidden", s.hidden},   {"heads", s.heads},
      {"ffn", s.ffn},       {"seq_len", s.seq_len}, {"vocab", s.vocab}};
  for (auto [field, v] : positive)
    if (v < 1) bad(field, fmt::format("must be at least 1, found {}", v));
  if (s.hidden % s.heads != 0)
    bad("heads", fmt::format("hidden {} is not divisible by heads {}", s.hidden, s.heads));
  if (s.positions == Positions::learned && s.max_positions < s.seq_len)
    bad("max_positions", fmt::format("{} is less than seq_len {}", s.max_positions, s.seq_len));
  if (s.type_vocab < 0) bad("type_vocab", "must not be negative");
}

}  // namespace pw::models

namespace pw::models {
// Placeholder until the models branch lands (it implements sharding).
void check_sharding(const ModelSpec&, const Sharding& sh, const std::string& source) {
  if (sh.t != 1)
    throw InputError(fmt::format("{}: tensor parallelism: not implemented yet", source));
}
}  // namespace pw::models
