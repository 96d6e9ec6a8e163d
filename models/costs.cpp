// Per-rank layer costs of a transformer under Megatron tensor (and sequence) parallelism:
// parameters, FLOPs, stashed bytes, elementwise traffic, TP collectives and GEMM shapes. Every
// formula is written out in docs/formulas.md.
#include <algorithm>

#include <fmt/format.h>

#include "models/model.hpp"

namespace pw::models {

namespace {

constexpr std::int64_t kStatBytes = 4;  // norm mean / rstd, logsumexp, losses, token ids
constexpr std::int64_t kMaskBytes = 1;  // Megatron's dropout masks: one byte per element

// One rank's share of the dimensions. Tensors inside the TP region (between the column-parallel
// and the row-parallel GEMM) are split over heads or ffn and span the whole sequence; those
// outside (block input, norms, residuals, their dropouts) span `rows` tokens: T, or T / t with
// sequence parallelism.
struct Dims {
  std::int64_t C, F, T, NH, KV, hd, e, t;
  std::int64_t C_t, Q_t, F_t, NH_t, V_t;  // per-rank hidden, qkv width, ffn, heads, vocab rows
  std::int64_t rows;                      // tokens outside the TP region
  std::int64_t V;                         // padded vocabulary (all ranks)
  bool unfused, dropout;
};

Dims dims_of(const ModelSpec& s, const Sharding& sh) {
  Dims d{};
  d.C = s.hidden, d.F = s.ffn, d.T = s.seq_len, d.NH = s.heads, d.KV = key_value_heads(s);
  d.hd = d.C / d.NH, d.e = dtype_bytes(s.dtype), d.t = sh.t;
  d.V = padded_vocab(s, sh.t);
  d.C_t = d.C / d.t, d.F_t = d.F / d.t, d.NH_t = d.NH / d.t, d.V_t = d.V / d.t;
  d.Q_t = (d.NH + 2 * d.KV) * d.hd / d.t;  // Q, K and V heads of this rank
  d.rows = sh.sp ? d.T / d.t : d.T;
  d.unfused = s.attention == Attention::unfused;
  d.dropout = s.dropout;
  return d;
}

std::int64_t norm_params(const ModelSpec& s) {
  return s.norm == Norm::layernorm ? 2 * s.hidden : s.hidden;
}

// Bytes a normalization keeps besides its output, for `rows` tokens: mean and rstd (RMSNorm: rstd).
std::int64_t norm_stat_bytes(const ModelSpec& s, std::int64_t rows) {
  return (s.norm == Norm::layernorm ? 2 : 1) * rows * kStatBytes;
}

// Number of F-wide tensors the MLP keeps: GELU keeps the pre-activation and the activation;
// SwiGLU keeps gate, up and their product.
std::int64_t mlp_hidden_tensors(const ModelSpec& s) {
  return s.mlp == Mlp::gelu ? 2 : 3;
}

std::vector<TpCollective> repeat(std::initializer_list<CollectiveKind> kinds, std::int64_t bytes) {
  std::vector<TpCollective> out;
  for (auto k : kinds)
    out.push_back({k, bytes});
  return out;
}

LayerCosts block_costs(const ModelSpec& s, const Sharding& sh) {
  const Dims d = dims_of(s, sh);
  const std::int64_t b = s.bias ? 1 : 0, mlp_in = s.mlp == Mlp::gelu ? 1 : 2;
  LayerCosts c;
  c.kind = LayerKind::block;
  // Column-parallel QKV and MLP input (weights and biases split), row-parallel projections
  // (weights split, biases replicated), norms replicated.
  c.parameters = 2 * norm_params(s) + (d.C * d.Q_t + b * d.Q_t) + (d.C_t * d.C + b * d.C) +
                 mlp_in * (d.C * d.F_t + b * d.F_t) + (d.F_t * d.C + b * d.C);
  const double T = double(d.T);
  const double gemm =
      2.0 * T * (double(d.C) * d.Q_t + double(d.C_t) * d.C + (mlp_in + 1.0) * d.C * d.F_t);
  const double attn =
      2.0 * 2.0 * T * T * double(d.NH_t * d.hd);  // Q K^T and P V, this rank's heads
  c.forward_flops = gemm + attn;
  // dX for every GEMM; attention backward needs two matmuls per forward one (dP, dV; dQ, dK).
  // FlashAttention's backward also recomputes Q K^T: that is time (traces/), not model FLOPs.
  c.backward_input_flops = gemm + 2.0 * attn;
  c.backward_weight_flops = gemm;
  // The attention core (unfused): softmax output NH x T x T, and with dropout its 1-byte mask and
  // its output. Fused attention keeps only the fp32 logsumexp per row and head.
  const std::int64_t scores = d.NH_t * d.T * d.T;
  const std::int64_t core =
      d.unfused ? d.e * scores + (d.dropout ? (kMaskBytes + d.e) * scores : 0) : 0;
  const std::int64_t lse = d.unfused ? 0 : d.NH_t * d.T * kStatBytes;
  // Outside the TP region: x_in, ln1_out, residual after attention, ln2_out, the post-attention
  // and post-MLP dropout masks, both norms' statistics.
  const std::int64_t outside = d.e * d.rows * 4 * d.C +
                               (d.dropout ? 2 * kMaskBytes * d.rows * d.C : 0) +
                               2 * norm_stat_bytes(s, d.rows);
  // Inside: qkv, attention output before the projection, the MLP's F-wide tensors.
  const std::int64_t inside = d.e * d.T * (d.Q_t + d.C_t + mlp_hidden_tensors(s) * d.F_t) + lse;
  c.activation_bytes = outside + inside + core;
  c.activation_selective_bytes = outside + inside;
  c.selective_recompute_flops = d.unfused ? attn : 0.0;
  c.input_bytes = d.e * d.rows * d.C;
  c.activation_recompute_bytes = c.input_bytes;
  c.output_bytes = c.input_bytes;
  // Two gradient scratch buffers the size of the widest intermediate (a full-width T x C one for
  // the row-parallel outputs; the T x T scores only when attention is unfused).
  c.workspace_bytes =
      2 * d.e * d.T * std::max({d.C, d.Q_t, d.F_t, d.unfused ? d.NH_t * d.T : std::int64_t(0)});
  // With t > 1 a full-width T x C more: the column-parallel inputs' gradients are summed over the
  // TP group whole (C wide, not C / t) while the first stage also keeps its residual-stream
  // gradient there (the executors' backward; at t = 1 the two buffers leave room for it).
  if (d.t > 1) c.workspace_bytes += d.e * d.T * d.C;
  // With SP also the first stage's residual-stream gradient (its rows) beside a gathered
  // full-width activation or gradient.
  if (d.t > 1 && sh.sp) c.workspace_bytes += d.e * d.rows * d.C;
  // Forward read + write traffic of the non-GEMM ops. Outside: two norms (2 x 2C), two residual
  // adds (2 x 3C), two dropouts (read, write, mask: 2e + 1 bytes each). Inside: the activation
  // (GELU 2F, SwiGLU 3F), unfused softmax (2 NH T) and its dropout.
  const double dropout_per_elem = double(2 * d.e + kMaskBytes);
  const double outside_traffic =
      double(d.rows) * d.C * (10.0 * d.e + (d.dropout ? 2.0 * dropout_per_elem : 0.0));
  const double core_traffic =
      d.unfused ? double(scores) * (2.0 * d.e + (d.dropout ? dropout_per_elem : 0.0)) : 0.0;
  c.elementwise_bytes =
      outside_traffic + core_traffic + double(d.e) * T * (s.mlp == Mlp::gelu ? 2.0 : 3.0) * d.F_t;
  c.selective_recompute_elementwise_bytes = core_traffic;
  if (d.t > 1) {
    const std::int64_t full = d.e * d.T * d.C;
    using K = CollectiveKind;
    // Megatron's f/g pair (all-reduce) or, with SP, g/g-bar (all-gather before the
    // column-parallel GEMM, reduce-scatter after the row-parallel one); backward the adjoints:
    // g's (identity, or with SP an all-gather) blocks, f's (the input gradient's all-reduce, or
    // with SP reduce-scatter) runs beside the weight-gradient GEMM, and with SP the
    // column-parallel GEMM's input, kept sharded, is gathered again beside its input-gradient GEMM.
    if (sh.sp) {
      c.tp_forward =
          repeat({K::all_gather, K::reduce_scatter, K::all_gather, K::reduce_scatter}, full);
      c.tp_backward = repeat({K::all_gather, K::all_gather}, full);
      c.tp_backward_wgrad = repeat({K::reduce_scatter, K::reduce_scatter}, full);
      c.tp_backward_dgrad = repeat({K::all_gather, K::all_gather}, full);
    } else {
      c.tp_forward = repeat({K::all_reduce, K::all_reduce}, full);
      c.tp_backward_wgrad = repeat({K::all_reduce, K::all_reduce}, full);
    }
  }
  return c;
}

LayerCosts embedding_costs(const ModelSpec& s, const Sharding& sh) {
  const Dims d = dims_of(s, sh);
  LayerCosts c;
  c.kind = LayerKind::embedding;
  // Vocabulary-parallel token table; position and token-type tables replicated.
  c.parameters = d.V_t * d.C;
  if (s.positions == Positions::learned) c.parameters += s.max_positions * d.C;
  c.parameters += s.type_vocab * d.C;
  const bool bert = s.arch == Arch::bert;
  if (bert) c.parameters += norm_params(s);  // BERT normalizes the summed embeddings
  c.input_bytes = d.T * kStatBytes;          // token ids (int32), on every rank
  // Kept for backward: the token ids (and BERT's token types, its pre-norm sum and statistics),
  // the embedding dropout's mask.
  c.activation_bytes = d.T * kStatBytes;
  if (bert)
    c.activation_bytes += d.T * kStatBytes + d.e * d.rows * d.C + norm_stat_bytes(s, d.rows);
  if (d.dropout) c.activation_bytes += kMaskBytes * d.rows * d.C;
  c.activation_recompute_bytes = c.activation_bytes;
  c.activation_selective_bytes = c.activation_bytes;
  c.output_bytes = d.e * d.rows * d.C;
  c.workspace_bytes = 0;
  // Gather rows, add positions (read 2TC, write TC); BERT's norm adds 2TC; dropout 2e + 1.
  c.elementwise_bytes = double(d.rows) * d.C *
                        (d.e * (bert ? 5.0 : 3.0) + (d.dropout ? 2.0 * d.e + kMaskBytes : 0.0));
  if (d.t > 1) {
    // Each rank looks up its vocabulary rows (zeros elsewhere); the partial sums are reduced.
    const std::int64_t full = d.e * d.T * d.C;
    if (sh.sp) {
      c.tp_forward = {{CollectiveKind::reduce_scatter, full}};
      c.tp_backward = {{CollectiveKind::all_gather, full}};
    } else {
      c.tp_forward = {{CollectiveKind::all_reduce, full}};
    }
  }
  return c;
}

LayerCosts head_costs(const ModelSpec& s, const Sharding& sh) {
  const Dims d = dims_of(s, sh);
  const bool bert = s.arch == Arch::bert;
  LayerCosts c;
  c.kind = LayerKind::head;
  // GPT: final norm + LM head. BERT: MLM transform (dense + GELU + norm, replicated) + decoder
  // bias. The head's weight and bias are vocabulary-parallel.
  c.parameters = norm_params(s);
  if (bert) c.parameters += d.C * d.C + (s.bias ? d.C : 0) + d.V_t;
  if (!s.tied_embeddings) c.parameters += d.V_t * d.C;
  const double T = double(d.T);
  const double gemm = 2.0 * T * d.C * d.V_t + (bert ? 2.0 * d.rows * d.C * d.C : 0.0);
  c.forward_flops = gemm;
  c.backward_input_flops = gemm;
  c.backward_weight_flops = gemm;
  // Kept: the input, the final norm output (+ statistics), BERT's dense and GELU outputs (rows
  // tokens each), this rank's logits (turned into probabilities in place for the loss
  // backward), per-token losses and targets (every rank).
  c.input_bytes = d.e * d.rows * d.C;
  c.activation_bytes = d.e * d.rows * (bert ? 4 : 2) * d.C + d.e * d.T * d.V_t +
                       norm_stat_bytes(s, d.rows) + 2 * d.T * kStatBytes;
  c.activation_recompute_bytes = c.input_bytes;
  c.activation_selective_bytes = c.activation_bytes;
  c.output_bytes = d.T * kStatBytes;      // per-token loss
  c.workspace_bytes = d.e * d.T * d.V_t;  // gradient of this rank's logits
  // With SP the gathered norm output and the full-width gradient of it beside them.
  if (d.t > 1 && sh.sp) c.workspace_bytes += 2 * d.e * d.T * d.C;
  c.elementwise_bytes = double(d.e) * (double(d.rows) * d.C * (bert ? 8.0 : 2.0) + 3.0 * T * d.V_t);
  if (d.t > 1) {
    const std::int64_t full = d.e * d.T * d.C;
    // Vocabulary-parallel cross entropy: fp32 all-reduces of the row max, the sum of
    // exponentials and the target logit, T values each.
    const auto ce =
        repeat({CollectiveKind::all_reduce, CollectiveKind::all_reduce, CollectiveKind::all_reduce},
               d.T * kStatBytes);
    if (sh.sp) c.tp_forward.push_back({CollectiveKind::all_gather, full});
    c.tp_forward.insert(c.tp_forward.end(), ce.begin(), ce.end());
    // The LM head is column-parallel: its input gradient's all-reduce (reduce-scatter) beside its
    // weight gradient, with SP its input re-gathered beside the input gradient (as a block's).
    c.tp_backward_wgrad = {
        {sh.sp ? CollectiveKind::reduce_scatter : CollectiveKind::all_reduce, full}};
    if (sh.sp) c.tp_backward_dgrad = {{CollectiveKind::all_gather, full}};
  }
  return c;
}

double fwd_bwd_flops(const LayerCosts& c) {
  return c.forward_flops + c.backward_flops();
}

}  // namespace

void check_sharding(const ModelSpec& spec, const Sharding& sh, const std::string& source) {
  if (sh.t < 1)
    throw InputError(
        fmt::format("{}: tensor-parallel size must be at least 1, found {}", source, sh.t));
  auto need = [&](const char* field, std::int64_t value, const char* what) {
    if (value % sh.t != 0)
      throw InputError(fmt::format("{}: /{}: tensor-parallel size {} does not divide {}{}", source,
                                   field, sh.t, what, value));
  };
  need("heads", spec.heads, "");
  need("kv_heads", key_value_heads(spec), "");
  need("ffn", spec.ffn, "");
  need("vocab", padded_vocab(spec, sh.t), "the padded vocabulary ");
  if (sh.sp) need("seq_len", spec.seq_len, "(sequence parallelism splits the tokens) ");
  // The padded vocabulary grows with t: keep its products in range too (model.cpp bounds the rest).
  const std::int64_t v = padded_vocab(spec, sh.t);
  std::int64_t p;
  if (__builtin_mul_overflow(v, spec.hidden, &p) || p > (std::int64_t(1) << 53) ||
      __builtin_mul_overflow(v, 8 * spec.seq_len, &p) || p > (std::int64_t(1) << 53))
    throw InputError(
        fmt::format("{}: /vocab_multiple: the padded vocabulary {} for "
                    "tensor-parallel size {} is too large",
                    source, v, sh.t));
}

ModelCosts derive_costs(const ModelSpec& spec, const Sharding& sharding) {
  check_sharding(spec, sharding, fmt::format("model {}", spec.name));
  ModelCosts m;
  m.sharding = sharding;
  m.embedding = embedding_costs(spec, sharding);
  m.block = block_costs(spec, sharding);
  m.head = head_costs(spec, sharding);
  m.tied_copy_parameters =
      spec.tied_embeddings ? padded_vocab(spec, sharding.t) / sharding.t * spec.hidden : 0;
  // Whole-model totals: the layers of one unsplit rank holding the vocabulary padded for t
  // (replicated parameters and work counted once).
  ModelSpec whole = spec;
  whole.vocab = padded_vocab(spec, sharding.t);
  whole.vocab_multiple = 1;
  const LayerCosts e = embedding_costs(whole, {}), b = block_costs(whole, {}),
                   h = head_costs(whole, {});
  m.total_parameters = e.parameters + spec.layers * b.parameters + h.parameters;
  m.flops_per_sample = fwd_bwd_flops(e) + double(spec.layers) * fwd_bwd_flops(b) + fwd_bwd_flops(h);
  return m;
}

std::vector<Gemm> forward_gemms(const ModelSpec& s, LayerKind kind, std::int64_t b,
                                const Sharding& sharding) {
  check_sharding(s, sharding, fmt::format("model {}", s.name));
  const Dims d = dims_of(s, sharding);
  // GEMMs inside the TP region run on the whole sequence (gathered with SP); BERT's replicated
  // MLM transform on this rank's rows.
  const std::int64_t rows = b * d.T;
  switch (kind) {
    case LayerKind::embedding:
      return {};
    case LayerKind::block: {
      std::vector<Gemm> g = {{"qkv", rows, d.Q_t, d.C, 1},
                             {"attn_scores", d.T, d.T, d.hd, b * d.NH_t, false},
                             {"attn_values", d.T, d.hd, d.T, b * d.NH_t, false},
                             {"attn_proj", rows, d.C, d.C_t, 1}};
      if (s.mlp == Mlp::swiglu) {
        g.push_back({"mlp_gate", rows, d.F_t, d.C, 1});
        g.push_back({"mlp_up", rows, d.F_t, d.C, 1});
      } else {
        g.push_back({"mlp_fc", rows, d.F_t, d.C, 1});
      }
      g.push_back({"mlp_proj", rows, d.C, d.F_t, 1});
      return g;
    }
    case LayerKind::head: {
      std::vector<Gemm> g;
      if (s.arch == Arch::bert) g.push_back({"mlm_dense", b * d.rows, d.C, d.C, 1});
      g.push_back({"lm_head", rows, d.V_t, d.C, 1});
      return g;
    }
  }
  return {};
}

}  // namespace pw::models
