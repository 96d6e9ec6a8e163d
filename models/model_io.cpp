// Model JSON files, presets and Hugging Face config.json import.
#include <algorithm>

#include <fmt/format.h>

#include "common/limits.hpp"
#include "common/presets.hpp"
#include "models/model.hpp"

namespace pw::models {

using common::Json;
using common::JsonReader;

namespace {

template <typename Enum>
Enum parse_choice(const JsonReader& r, const std::string& key, Enum dflt,
                  std::initializer_list<std::pair<const char*, Enum>> choices) {
  auto v = r.find(key);
  if (!v) return dflt;
  std::string s = v->as_string();
  std::string names;
  for (auto& [name, e] : choices) {
    if (s == name) return e;
    names += names.empty() ? name : std::string(", ") + name;
  }
  v->fail(fmt::format("unknown value \"{}\" (expected one of {})", s, names));
}

// A model dimension: 1 .. kMaxDim.
std::int64_t dim(const JsonReader& r, const std::string& key) {
  return r.get_int_in(key, 1, common::kMaxDim);
}

const char* mlp_name(Mlp m) {
  return m == Mlp::gelu ? "gelu" : "swiglu";
}
const char* norm_name(Norm n) {
  return n == Norm::layernorm ? "layernorm" : "rmsnorm";
}
const char* positions_name(Positions p) {
  return p == Positions::learned ? "learned" : "rope";
}

}  // namespace

ModelSpec parse_model(const Json& json, const std::string& source) {
  JsonReader r(json, source);
  r.expect_format("pipewright.model/1");
  ModelSpec s;
  s.name = r.get_string("name");
  s.arch = parse_choice(r, "arch", Arch::gpt, {{"gpt", Arch::gpt}, {"bert", Arch::bert}});
  s.layers = r.get_count("layers");
  s.hidden = dim(r, "hidden");
  s.heads = dim(r, "heads");
  s.ffn = r.has("ffn") ? dim(r, "ffn") : 4 * s.hidden;
  s.seq_len = dim(r, "seq_len");
  s.vocab = dim(r, "vocab");
  s.max_positions = r.has("max_positions") ? dim(r, "max_positions") : s.seq_len;
  s.type_vocab = r.has("type_vocab") ? r.get_int_in("type_vocab", 0, common::kMaxDim) : 0;
  s.tied_embeddings = r.has("tied_embeddings") ? r.get_bool("tied_embeddings") : true;
  s.bias = r.has("bias") ? r.get_bool("bias") : true;
  s.mlp = parse_choice(r, "mlp", Mlp::gelu, {{"gelu", Mlp::gelu}, {"swiglu", Mlp::swiglu}});
  s.norm = parse_choice(r, "norm", Norm::layernorm,
                        {{"layernorm", Norm::layernorm}, {"rmsnorm", Norm::rmsnorm}});
  s.positions = parse_choice(r, "positions", Positions::learned,
                             {{"learned", Positions::learned}, {"rope", Positions::rope}});
  s.dtype = parse_choice(r, "dtype", DType::fp16,
                         {{"fp32", DType::fp32}, {"fp16", DType::fp16}, {"bf16", DType::bf16}});
  s.kv_heads = r.has("kv_heads") ? r.get_int_in("kv_heads", 0, common::kMaxDim) : 0;
  if (s.kv_heads == 0) s.kv_heads = s.heads;  // 0 or missing: multi-head attention
  // FlashAttention is what 16-bit training runs; fp32 has no fused kernel in common use.
  s.attention =
      parse_choice(r, "attention", s.dtype == DType::fp32 ? Attention::unfused : Attention::fused,
                   {{"fused", Attention::fused}, {"unfused", Attention::unfused}});
  s.dropout = r.has("dropout") ? r.get_bool("dropout") : false;
  s.vocab_multiple = r.has("vocab_multiple") ? dim(r, "vocab_multiple") : 1;
  if (r.has("description")) s.description = r.get_string("description");
  validate(s, source);
  return s;
}

Json to_json(const ModelSpec& s) {
  Json j = {{"format", "pipewright.model/1"},
            {"name", s.name},
            {"arch", to_string(s.arch)},
            {"layers", s.layers},
            {"hidden", s.hidden},
            {"heads", s.heads},
            {"ffn", s.ffn},
            {"seq_len", s.seq_len},
            {"vocab", s.vocab},
            {"max_positions", s.max_positions},
            {"type_vocab", s.type_vocab},
            {"tied_embeddings", s.tied_embeddings},
            {"bias", s.bias},
            {"mlp", mlp_name(s.mlp)},
            {"norm", norm_name(s.norm)},
            {"positions", positions_name(s.positions)},
            {"dtype", to_string(s.dtype)},
            {"kv_heads", key_value_heads(s)},
            {"attention", to_string(s.attention)},
            {"dropout", s.dropout},
            {"vocab_multiple", s.vocab_multiple}};
  if (!s.description.empty()) j["description"] = s.description;
  return j;
}

std::vector<std::string> preset_names() {
  std::vector<std::string> names;
  for (const auto& f : common::embedded_models())
    names.emplace_back(f.name);
  return names;
}

bool is_hf_config(const Json& json) {
  return json.is_object() && !json.contains("format") &&
         (json.contains("n_layer") || json.contains("num_hidden_layers"));
}

namespace {

std::int64_t hf_int(const JsonReader& r, std::initializer_list<const char*> keys) {
  for (const char* k : keys)
    if (auto v = r.find(k)) return v->as_int_in(1, common::kMaxDim);
  r.fail(fmt::format("missing field {}", *keys.begin()));
}

std::string hf_string(const JsonReader& r, const char* key, const std::string& dflt) {
  auto v = r.find(key);
  return v ? v->as_string() : dflt;
}

}  // namespace

ModelSpec import_hf_config(const Json& json, const std::string& source, const std::string& name) {
  JsonReader r(json, source);
  if (!json.is_object()) r.fail("expected a Hugging Face config object");
  ModelSpec s;
  s.name = name;
  const std::string type = hf_string(r, "model_type", "gpt2");
  const bool gpt2_names = r.has("n_layer");
  s.layers = hf_int(r, {"n_layer", "num_hidden_layers"});
  s.hidden = hf_int(r, {"n_embd", "hidden_size"});
  s.heads = hf_int(r, {"n_head", "num_attention_heads"});
  s.vocab = hf_int(r, {"vocab_size"});
  s.kv_heads = r.has("num_key_value_heads") ? hf_int(r, {"num_key_value_heads"}) : s.heads;
  if (auto inner = r.find("n_inner"); inner)
    s.ffn = inner->as_int_in(1, common::kMaxDim);
  else if (r.has("intermediate_size"))
    s.ffn = dim(r, "intermediate_size");
  else
    s.ffn = 4 * s.hidden;
  if (type == "bert") {
    s.arch = Arch::bert;
    s.max_positions = hf_int(r, {"max_position_embeddings"});
    s.type_vocab =
        r.has("type_vocab_size") ? r.get_int_in("type_vocab_size", 0, common::kMaxDim) : 2;
  } else if (gpt2_names || type == "gpt2") {
    s.max_positions = hf_int(r, {"n_positions", "max_position_embeddings"});
  } else {
    // LLaMA-style decoder: RMSNorm, SwiGLU MLP, rotary positions, no biases, untied head.
    s.mlp = Mlp::swiglu;
    s.norm = Norm::rmsnorm;
    s.positions = Positions::rope;
    s.bias = r.has("attention_bias") ? r.get_bool("attention_bias") : false;
    s.max_positions = hf_int(r, {"max_position_embeddings"});
  }
  s.tied_embeddings =
      r.has("tie_word_embeddings") ? r.get_bool("tie_word_embeddings") : s.mlp != Mlp::swiglu;
  s.seq_len = s.max_positions;
  if (auto v = r.find("torch_dtype")) {
    const std::string dtype = v->as_string();
    if (dtype == "float32")
      s.dtype = DType::fp32;
    else if (dtype == "bfloat16")
      s.dtype = DType::bf16;
    else if (dtype == "float16")
      s.dtype = DType::fp16;
    else
      v->fail(
          fmt::format("unsupported dtype \"{}\" (expected bfloat16, float16 or float32)", dtype));
  }
  s.attention = s.dtype == DType::fp32 ? Attention::unfused : Attention::fused;
  s.description = fmt::format("imported from Hugging Face config {} (model_type {})", source, type);
  validate(s, source);
  return s;
}

ModelSpec load_model(const std::string& spec) {
  if (!common::looks_like_path(spec)) {
    const auto* f = common::find_embedded(common::embedded_models(), spec);
    if (!f) {
      std::string names;
      for (const auto& n : preset_names())
        names += (names.empty() ? "" : ", ") + n;
      throw InputError(fmt::format(
          "unknown model \"{}\" (presets: {}; or give a path to a JSON file)", spec, names));
    }
    return parse_model(common::parse_json(f->text, fmt::format("preset {}", spec)),
                       fmt::format("preset {}", spec));
  }
  Json j = common::read_json_file(spec);
  if (is_hf_config(j)) {
    std::string stem = spec.substr(spec.find_last_of('/') + 1);
    if (stem == "config.json") {
      auto dir = spec.substr(0, spec.find_last_of('/'));
      stem = dir.substr(dir.find_last_of('/') + 1);
    } else if (stem.size() > 5 && stem.ends_with(".json")) {
      stem = stem.substr(0, stem.size() - 5);
    }
    return import_hf_config(j, spec, stem);
  }
  return parse_model(j, spec);
}

}  // namespace pw::models
