// Derived per-layer costs of a transformer: parameters, FLOPs and the bytes a real implementation
// keeps. Every formula is written out in docs/formulas.md.
#include "models/model.hpp"

#include <limits>
#include <string_view>

#include <fmt/format.h>

#include "common/limits.hpp"

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

std::string to_string(Attention a) {
  return a == Attention::fused ? "fused" : "unfused";
}

Attention parse_attention(const std::string& s) {
  if (s == "fused") return Attention::fused;
  if (s == "unfused") return Attention::unfused;
  throw InputError(fmt::format("unknown attention \"{}\" (expected fused or unfused)", s));
}

std::string to_string(CollectiveKind k) {
  switch (k) {
    case CollectiveKind::all_reduce:
      return "all_reduce";
    case CollectiveKind::all_gather:
      return "all_gather";
    case CollectiveKind::reduce_scatter:
      return "reduce_scatter";
  }
  return "?";
}

const LayerCosts& ModelCosts::layer(LayerKind k) const {
  return k == LayerKind::embedding ? embedding : (k == LayerKind::block ? block : head);
}

namespace {

// Any size product pipewright forms stays below 2^53, so sums of a few hundred of them (and their
// conversion to double) are exact in int64.
constexpr std::int64_t kSizeLimit = std::int64_t(1) << 53;

// The product of the factors (all >= 0), or -1 when it passes kSizeLimit.
std::int64_t bounded_product(std::initializer_list<std::int64_t> factors) {
  std::int64_t p = 1;
  for (std::int64_t f : factors)
    if (__builtin_mul_overflow(p, f, &p) || p > kSizeLimit) return -1;
  return p;
}

}  // namespace

std::int64_t key_value_heads(const ModelSpec& spec) {
  return spec.kv_heads > 0 ? spec.kv_heads : spec.heads;
}

std::int64_t padded_vocab(const ModelSpec& spec, int t) {
  const std::int64_t multiple = bounded_product(
      {std::max<std::int64_t>(spec.vocab_multiple, 1), std::max<std::int64_t>(t, 1)});
  if (multiple < 0 || spec.vocab > kSizeLimit)
    throw InputError(
        fmt::format("model {}: /vocab_multiple: {} x tensor-parallel size {} is too "
                    "large",
                    spec.name, spec.vocab_multiple, t));
  return (spec.vocab + multiple - 1) / multiple * multiple;
}

void validate(const ModelSpec& s, const std::string& source) {
  auto bad = [&](const char* field, const std::string& why) {
    throw InputError(fmt::format("{}: /{}: {}", source, field, why));
  };
  const std::pair<const char*, std::int64_t> positive[] = {
      {"layers", s.layers}, {"hidden", s.hidden},   {"heads", s.heads},
      {"ffn", s.ffn},       {"seq_len", s.seq_len}, {"vocab", s.vocab}};
  for (auto [field, v] : positive) {
    const std::int64_t hi =
        std::string_view(field) == "layers" ? common::kMaxCount : common::kMaxDim;
    if (v < 1 || v > hi) bad(field, fmt::format("must be in 1 .. {}, found {}", hi, v));
  }
  const std::pair<const char*, std::int64_t> bounded[] = {{"kv_heads", s.kv_heads},
                                                          {"max_positions", s.max_positions},
                                                          {"type_vocab", s.type_vocab},
                                                          {"vocab_multiple", s.vocab_multiple}};
  for (auto [field, v] : bounded)
    if (v > common::kMaxDim)
      bad(field, fmt::format("must be at most {}, found {}", common::kMaxDim, v));
  if (s.hidden % s.heads != 0)
    bad("heads", fmt::format("hidden {} is not divisible by heads {}", s.hidden, s.heads));
  if (s.kv_heads < 0) bad("kv_heads", fmt::format("must not be negative, found {}", s.kv_heads));
  if (s.heads % key_value_heads(s) != 0)
    bad("kv_heads",
        fmt::format("heads {} is not divisible by kv_heads {}", s.heads, key_value_heads(s)));
  if (s.vocab_multiple < 1)
    bad("vocab_multiple", fmt::format("must be at least 1, found {}", s.vocab_multiple));
  if (s.max_positions < 0) bad("max_positions", "must not be negative");
  if (s.positions == Positions::learned && s.max_positions < s.seq_len)
    bad("max_positions", fmt::format("{} is less than seq_len {}", s.max_positions, s.seq_len));
  if (s.type_vocab < 0) bad("type_vocab", "must not be negative");
  // Sizes multiply (T x T x NH scores, V x C embeddings, layers x block parameters): refuse any
  // shape whose products would leave the exact int64 range instead of wrapping.
  auto too_large = [&](const char* field, std::initializer_list<std::int64_t> factors) {
    if (bounded_product(factors) < 0) bad(field, "too large: the model's sizes overflow");
  };
  too_large("hidden", {4, s.hidden, s.hidden});
  too_large("ffn", {4, s.hidden, s.ffn});
  too_large("vocab", {s.vocab});
  too_large("vocab_multiple", {s.vocab_multiple, 4096});
  const std::int64_t v_rows = s.vocab + s.vocab_multiple * 4096;  // padded vocab for t <= 4096
  too_large("vocab", {v_rows, s.hidden, 2});
  too_large("max_positions", {s.max_positions, s.hidden});
  too_large("type_vocab", {s.type_vocab, s.hidden});
  too_large("seq_len", {s.seq_len, s.seq_len, s.heads, 8});
  too_large("seq_len", {s.seq_len, 16, s.hidden + s.ffn});
  too_large("seq_len", {s.seq_len, 8, v_rows});
  too_large("layers", {s.layers, 4 * s.hidden + 3 * s.ffn + 16, s.hidden});
}

}  // namespace pw::models
