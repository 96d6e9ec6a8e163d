// Transformer model description and the per-layer costs derived from it (params, FLOPs, bytes).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/json_reader.hpp"

namespace pw::models {

enum class Arch { gpt, bert };           // causal decoder (pre-LN) or encoder (post-LN)
enum class DType { fp32, fp16, bf16 };   // training compute dtype of weights and activations
enum class Mlp { gelu, swiglu };         // 2-matrix GELU MLP (GPT/BERT) or 3-matrix SwiGLU (LLaMA)
enum class Norm { layernorm, rmsnorm };  // LayerNorm (scale + shift) or RMSNorm (scale only)
enum class Positions { learned, rope };  // learned position table, or rotary (no parameters)
// How attention runs: fused (FlashAttention: the T x T scores are never stored, only per-row
// softmax statistics) or unfused (scores and probabilities materialized and stashed).
enum class Attention { fused, unfused };

int dtype_bytes(DType t);
std::string to_string(DType t);
std::string to_string(Arch a);
DType parse_dtype(const std::string& s);  // throws InputError naming the value
Arch parse_arch(const std::string& s);
std::string to_string(Attention a);               // "fused", "unfused"
Attention parse_attention(const std::string& s);  // throws InputError naming the value

// The shape of a transformer: embedding, `layers` identical blocks, final norm + head.
struct ModelSpec {
  std::string name;
  Arch arch = Arch::gpt;
  std::int64_t layers = 0;
  std::int64_t hidden = 0;         // C
  std::int64_t heads = 0;          // NH, hidden % heads == 0
  std::int64_t kv_heads = 0;       // KV heads (GQA / MQA), heads % kv_heads == 0; == heads for MHA
  std::int64_t ffn = 0;            // F, usually 4C
  std::int64_t seq_len = 0;        // T, tokens per sample
  std::int64_t vocab = 0;          // V
  std::int64_t max_positions = 0;  // rows of the position embedding (>= seq_len)
  std::int64_t type_vocab = 0;     // BERT token-type rows (2); 0 for GPT
  bool tied_embeddings = true;     // LM head shares the token embedding
  bool bias = true;                // linear layers have biases (GPT-2, BERT) or not (LLaMA)
  Mlp mlp = Mlp::gelu;
  Norm norm = Norm::layernorm;
  Positions positions = Positions::learned;
  DType dtype = DType::fp16;
  Attention attention = Attention::unfused;  // model files default to fused for fp16/bf16
  bool dropout = false;             // dropout layers (Megatron GPT): 1-byte masks are stashed
  std::int64_t vocab_multiple = 1;  // Megatron's make-vocab-size-divisible-by (128): the
                                    // embedding has padded_vocab(t) rows
  std::string description;
};

// kv_heads, or heads when kv_heads is 0 (multi-head attention).
std::int64_t key_value_heads(const ModelSpec& spec);

// Megatron's padding: the vocabulary rounded up to a multiple of vocab_multiple * t. Throws
// InputError naming /vocab_multiple when that multiple is too large.
std::int64_t padded_vocab(const ModelSpec& spec, int t = 1);

// How one rank holds a layer: Megatron tensor parallelism over t ranks (column-parallel QKV and
// MLP input, row-parallel projections, vocabulary-parallel embedding and head), optionally with
// sequence parallelism (norms, dropouts and residuals split over the sequence).
struct Sharding {
  int t = 1;
  bool sp = false;
  bool operator==(const Sharding&) const = default;
};

// A tensor-parallel collective over the t ranks of a TP group.
enum class CollectiveKind { all_reduce, all_gather, reduce_scatter };
std::string to_string(CollectiveKind k);  // "all_reduce", "all_gather", "reduce_scatter"
struct TpCollective {
  CollectiveKind kind = CollectiveKind::all_reduce;
  std::int64_t bytes = 0;  // the full (unsharded) tensor, for ONE sample
  bool operator==(const TpCollective&) const = default;
};

// The three layer kinds a pipeline stage can hold. Stage 0 holds the embedding, the last stage the
// head; blocks are split among stages.
enum class LayerKind { embedding, block, head };
std::string to_string(LayerKind k);

// One matrix multiply C[m x n] = A[m x k] * B[k x n], `batch` times (attention uses batch = b*NH).
struct Gemm {
  std::string label;
  std::int64_t m = 0, n = 0, k = 0, batch = 1;
  bool has_weight = true;  // a weight operand (it has a dW GEMM); false for attention's matmuls
  double flops() const { return 2.0 * double(m) * double(n) * double(k) * double(batch); }
};

// Costs of one layer on ONE rank of its TP group (all of it when t = 1) for ONE sample
// (microbatch size 1). Everything scales linearly in b.
// Formulas and the tensors behind them: docs/formulas.md.
struct LayerCosts {
  LayerKind kind = LayerKind::block;
  std::int64_t parameters = 0;
  double forward_flops = 0;          // GEMMs + attention matmuls
  double backward_input_flops = 0;   // dL/dx: same matmul FLOPs as forward
  double backward_weight_flops = 0;  // dL/dW: forward FLOPs of the weight GEMMs
  double elementwise_bytes = 0;      // forward memory traffic of non-GEMM ops (norm, softmax, GELU,
                                     // residual adds, embedding gather), read + write
  std::int64_t activation_bytes = 0;            // stashed for backward without recompute,
                                                // including the layer's own input
  std::int64_t activation_recompute_bytes = 0;  // stashed with recompute: the input only
  std::int64_t activation_selective_bytes = 0;  // stashed with selective recompute (the
                                                // attention core's tensors dropped)
  double selective_recompute_flops = 0;         // re-running the attention core before backward
                                                // (unfused attention only; 0 when fused)
  double selective_recompute_elementwise_bytes = 0;  // its softmax (+ dropout) traffic
  std::int64_t input_bytes = 0;                      // the layer's input activation
  std::int64_t output_bytes = 0;                     // what it hands the next layer / stage
  std::int64_t workspace_bytes = 0;                  // transient scratch while it runs backward
  // TP collectives of one forward and of one backward (empty when t = 1), in execution order.
  // tp_backward holds the backward's blocking ones. Megatron issues the others asynchronously
  // beside the backward's GEMMs: the input gradient's all-reduce (reduce-scatter with SP) of each
  // column-parallel GEMM behind that GEMM's weight-gradient GEMM (tp_backward_wgrad) and, with
  // SP, the re-gather of its input behind its input-gradient GEMM (tp_backward_dgrad).
  std::vector<TpCollective> tp_forward, tp_backward;
  std::vector<TpCollective> tp_backward_wgrad, tp_backward_dgrad;
  double backward_flops() const { return backward_input_flops + backward_weight_flops; }
};

// Per-rank layer costs for a sharding; the totals are of the whole model (every TP shard).
struct ModelCosts {
  Sharding sharding;
  LayerCosts embedding, block, head;
  std::int64_t total_parameters = 0;  // embedding + layers * block + head (tied weights once)
  // Parameters (per rank) of the tied token embedding that the last stage must hold as a copy
  // when the embedding and the head sit on different stages (0 when untied).
  std::int64_t tied_copy_parameters = 0;
  double flops_per_sample = 0;  // forward + backward, whole model (all shards)
  const LayerCosts& layer(LayerKind k) const;
};

ModelCosts derive_costs(const ModelSpec& spec, const Sharding& sharding = {});
// The forward GEMMs one rank runs for one layer at microbatch size b.
std::vector<Gemm> forward_gemms(const ModelSpec& spec, LayerKind kind, std::int64_t b,
                                const Sharding& sharding = {});

// Throws InputError "<source>: /heads: tensor-parallel size 3 does not divide 32" when t does not
// divide heads, kv_heads, ffn or the padded vocabulary, or t < 1; with sp also seq_len. sp with
// t = 1 is allowed and changes nothing. derive_costs and forward_gemms call it.
void check_sharding(const ModelSpec& spec, const Sharding& sharding, const std::string& source);

// Throws InputError naming the field when a shape is impossible (hidden % heads, seq_len >
// max_positions, non-positive sizes).
void validate(const ModelSpec& spec, const std::string& source);

// JSON (format "pipewright.model/1"); see docs/formats.md.
ModelSpec parse_model(const common::Json& json, const std::string& source);
common::Json to_json(const ModelSpec& spec);

// A preset name ("gpt2-124m") or a path to a model JSON file or a Hugging Face config.json.
ModelSpec load_model(const std::string& name_or_path);
std::vector<std::string> preset_names();

// Hugging Face config.json (GPT-2: n_layer/n_embd/n_head/n_inner/n_positions/vocab_size;
// LLaMA-style: num_hidden_layers/hidden_size/num_attention_heads/intermediate_size/
// max_position_embeddings; BERT: model_type "bert", type_vocab_size).
ModelSpec import_hf_config(const common::Json& json, const std::string& source,
                           const std::string& name);
bool is_hf_config(const common::Json& json);

}  // namespace pw::models
