// The CPU StageCompute: one pipeline stage of a GPT-2 (embedding, pre-LN blocks, tied head), fp32.
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "common/error.hpp"
#include "exec/cpu/kernels.hpp"
#include "exec/stage_compute.hpp"

namespace pw::exec {

namespace {

using std::int64_t;

// Counter-based normal(0, 1): value i of a tensor depends only on (seed, name, i).
std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

std::uint64_t fnv1a(const std::string& s) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s)
    h = (h ^ c) * 0x100000001b3ull;
  return h;
}

void fill_normal(float* out, int64_t n, std::uint64_t seed, const std::string& name, float std) {
  const std::uint64_t key = splitmix64(seed ^ fnv1a(name));
  for (int64_t i = 0; i < n; ++i) {
    const double u1 = (double(splitmix64(key + 2 * std::uint64_t(i)) >> 11) + 0.5) * 0x1p-53;
    const double u2 = (double(splitmix64(key + 2 * std::uint64_t(i) + 1) >> 11) + 0.5) * 0x1p-53;
    out[i] = float(std * std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2));
  }
}

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
const char* const kBlockNames[kBlockTensors] = {"ln1_w",     "ln1_b",     "qkv_w",    "qkv_b",
                                                "attproj_w", "attproj_b", "ln2_w",    "ln2_b",
                                                "fc_w",      "fc_b",      "fcproj_w", "fcproj_b"};

// Carves consecutive tensors out of a stash region.
template <class F>
struct Carver {
  F* p;
  F* take(int64_t n) {
    F* r = p;
    p += n;
    return r;
  }
};

// One block's stash (docs/formulas.md §3), in this order; x sits at offset 0.
template <class F>
struct BlockActs {
  F *x, *ln1, *ln1_mean, *ln1_rstd, *qkv, *att, *atty, *resid1, *ln2, *ln2_mean, *ln2_rstd, *fc,
      *gelu;
};

// The head's stash; x sits at offset 0. targets hold int32 ids bit-cast into float slots.
template <class F>
struct HeadActs {
  F *x, *lnf, *mean, *rstd, *probs, *targets, *losses;
};

class CpuGptStage final : public StageCompute {
 public:
  explicit CpuGptStage(const StageSpec& spec);
  const StageSpec& spec() const override { return spec_; }
  const std::vector<TensorSlot>& layout() const override { return layout_; }
  StageSizes sizes(int b) const override;
  void init_parameters(float* params, std::uint64_t seed) const override;
  float forward(const float* params, const std::int32_t* tokens, const float* input,
                const std::int32_t* targets, int b, bool recompute, float* stash, float* output,
                float* scratch) override;
  void recompute(const float* params, const std::int32_t* tokens, const std::int32_t* targets,
                 int b, const float* kept, float* full_stash) override;
  void backward(const float* params, const float* full_stash, const float* d_output, int b,
                float loss_scale, float* grads, float* d_input, float* workspace) override;

 private:
  int64_t add_slot(const std::string& name, int64_t size);
  int64_t block_floats(int64_t BT) const { return BT * (8 * C_ + 2 * F_ + NH_ * T_) + 4 * BT; }
  template <class F>
  BlockActs<F> carve_block(F* base, int64_t BT) const;
  template <class F>
  HeadActs<F> carve_head(F* base, int64_t BT) const;
  float run(const float* params, const std::int32_t* tokens, const float* input,
            const std::int32_t* targets, int b, float* acts, bool rolling, float* output) const;
  void block_forward(const float* w, const BlockActs<float>& a, int b, float* out) const;
  void block_backward(const float* w, float* g, const BlockActs<const float>& a, int b, float* dres,
                      float* ws, int64_t ws_floats) const;
  float head_forward(const float* params, const HeadActs<float>& h, const std::int32_t* targets,
                     int b) const;
  void head_backward(const float* params, float* grads, const HeadActs<const float>& h, int b,
                     float loss_scale, float* dres, float* ws, int64_t ws_floats) const;

  StageSpec spec_;
  std::vector<TensorSlot> layout_;
  models::ModelCosts costs_;  // per sample, fp32
  int64_t C_, F_, T_, NH_, V_;
  int64_t wte_ = -1, wpe_ = -1, lnf_w_ = -1, lnf_b_ = -1, head_w_ = -1, params_ = 0;
  std::vector<int64_t> block_base_;     // offset of each block's first tensor
  int64_t block_rel_[kBlockTensors]{};  // offsets of a block's tensors from its first
};

void unsupported(const models::ModelSpec& m, const std::string& field, const std::string& value) {
  throw InputError("model '" + m.name + "': " + field + " = " + value +
                   " is not supported by the CPU backend yet (GPT-2 style only)");
}

CpuGptStage::CpuGptStage(const StageSpec& spec) : spec_(spec) {
  const models::ModelSpec& m = spec.model;
  models::validate(m, "cpu stage");
  if (m.arch != models::Arch::gpt) unsupported(m, "arch", "bert");
  if (m.mlp != models::Mlp::gelu) unsupported(m, "mlp", "swiglu");
  if (m.norm != models::Norm::layernorm) unsupported(m, "norm", "rmsnorm");
  if (m.positions != models::Positions::learned) unsupported(m, "positions", "rope");
  if (!m.bias) unsupported(m, "bias", "false");
  if (spec.first_block < 0 || spec.blocks < 0 || spec.first_block + spec.blocks > m.layers ||
      (spec.has_embedding && spec.first_block != 0) ||
      (spec.has_head && spec.first_block + spec.blocks != m.layers))
    throw InputError("stage of model '" + m.name + "': blocks [" +
                     std::to_string(spec.first_block) + ", " +
                     std::to_string(spec.first_block + spec.blocks) +
                     ") do not fit the embedding/head placement or the model's " +
                     std::to_string(m.layers) + " layers");
  models::ModelSpec m32 = m;
  m32.dtype = models::DType::fp32;  // the CPU backend computes in fp32 whatever the model says
  costs_ = models::derive_costs(m32);
  C_ = m.hidden, F_ = m.ffn, T_ = m.seq_len, NH_ = m.heads, V_ = m.vocab;
  if (spec.has_embedding) {
    wte_ = add_slot("wte", V_ * C_);
    wpe_ = add_slot("wpe", m.max_positions * C_);
  }
  const int64_t sizes[kBlockTensors] = {C_, C_, 3 * C_ * C_, 3 * C_, C_ * C_, C_,
                                        C_, C_, F_ * C_,     F_,     C_ * F_, C_};
  for (int64_t l = spec.first_block; l < spec.first_block + spec.blocks; ++l) {
    block_base_.push_back(params_);
    for (int k = 0; k < kBlockTensors; ++k) {
      const int64_t off = add_slot("h" + std::to_string(l) + "." + kBlockNames[k], sizes[k]);
      block_rel_[k] = off - block_base_.back();
    }
  }
  if (spec.has_head) {
    lnf_w_ = add_slot("lnf_w", C_);
    lnf_b_ = add_slot("lnf_b", C_);
    // A single stage with both ends uses wte itself; otherwise the head holds its own V x C.
    head_w_ = (spec.has_embedding && m.tied_embeddings) ? wte_ : add_slot("lm_head", V_ * C_);
  }
}

int64_t CpuGptStage::add_slot(const std::string& name, int64_t size) {
  layout_.push_back({name, params_, size});
  params_ += size;
  return layout_.back().offset;
}

StageSizes CpuGptStage::sizes(int b) const {
  const models::LayerCosts* layers[3] = {spec_.has_embedding ? &costs_.embedding : nullptr,
                                         spec_.blocks > 0 ? &costs_.block : nullptr,
                                         spec_.has_head ? &costs_.head : nullptr};
  const int64_t count[3] = {1, spec_.blocks, 1};
  int64_t stash = 0, workspace = 0, largest = 0;
  for (int i = 0; i < 3; ++i) {
    if (!layers[i]) continue;
    stash += count[i] * layers[i]->activation_bytes;
    workspace = std::max(workspace, layers[i]->workspace_bytes);
    largest = std::max(largest, layers[i]->activation_bytes);
  }
  StageSizes s;
  s.parameters = params_;
  s.stash = b * stash / 4;
  s.stash_recompute = b *
                      (spec_.has_embedding ? costs_.embedding.activation_recompute_bytes
                                           : costs_.block.input_bytes) /
                      4;
  s.output = spec_.has_head ? 0 : b * T_ * C_;
  s.input = spec_.has_embedding ? 0 : b * T_ * C_;
  s.workspace = b * workspace / 4;
  s.scratch = b * largest / 4;
  return s;
}

void CpuGptStage::init_parameters(float* params, std::uint64_t seed) const {
  const float proj_std = 0.02f / std::sqrt(2.0f * float(spec_.model.layers));
  for (const TensorSlot& s : layout_) {
    float* p = params + s.offset;
    const std::string& n = s.name;
    const auto ends = [&](const char* suffix) {
      const std::size_t k = std::strlen(suffix);
      return n.size() >= k && n.compare(n.size() - k, k, suffix) == 0;
    };
    if (n == "lm_head" && spec_.model.tied_embeddings) {
      fill_normal(p, s.size, seed, "wte", 0.02f);  // the tied copy starts as the embedding
    } else if (ends("ln1_w") || ends("ln2_w") || n == "lnf_w") {
      std::fill(p, p + s.size, 1.0f);
    } else if (ends("_b")) {
      std::fill(p, p + s.size, 0.0f);
    } else {
      fill_normal(p, s.size, seed, n, ends("proj_w") ? proj_std : 0.02f);
    }
  }
}

template <class F>
BlockActs<F> CpuGptStage::carve_block(F* base, int64_t BT) const {
  Carver<F> c{base};
  BlockActs<F> a;
  a.x = c.take(BT * C_), a.ln1 = c.take(BT * C_);
  a.ln1_mean = c.take(BT), a.ln1_rstd = c.take(BT);
  a.qkv = c.take(BT * 3 * C_), a.att = c.take(BT * NH_ * T_), a.atty = c.take(BT * C_);
  a.resid1 = c.take(BT * C_), a.ln2 = c.take(BT * C_);
  a.ln2_mean = c.take(BT), a.ln2_rstd = c.take(BT);
  a.fc = c.take(BT * F_), a.gelu = c.take(BT * F_);
  return a;
}

template <class F>
HeadActs<F> CpuGptStage::carve_head(F* base, int64_t BT) const {
  Carver<F> c{base};
  HeadActs<F> h;
  h.x = c.take(BT * C_), h.lnf = c.take(BT * C_), h.mean = c.take(BT), h.rstd = c.take(BT);
  h.probs = c.take(BT * V_), h.targets = c.take(BT), h.losses = c.take(BT);
  return h;
}

float CpuGptStage::forward(const float* params, const std::int32_t* tokens, const float* input,
                           const std::int32_t* targets, int b, bool recompute, float* stash,
                           float* output, float* scratch) {
  if ((spec_.has_embedding ? !tokens : !input) || (spec_.has_head ? !targets : !output))
    throw Error("cpu stage forward: missing tokens, input, targets or output");
  if (recompute && !scratch)
    throw Error("cpu stage forward with recompute needs scratch (sizes().scratch floats)");
  if (!recompute) return run(params, tokens, input, targets, b, stash, false, output);
  const int64_t BT = int64_t(b) * T_;
  if (spec_.has_embedding)
    std::memcpy(stash, tokens, std::size_t(BT) * sizeof(float));
  else
    std::memcpy(stash, input, std::size_t(BT * C_) * sizeof(float));
  return run(params, tokens, input, targets, b, scratch, true, output);
}

void CpuGptStage::recompute(const float* params, const std::int32_t*, const std::int32_t* targets,
                            int b, const float* kept, float* full_stash) {
  // The kept stash is the stage input: token ids (bit-cast) on the first stage, else (B, T, C).
  const auto* tokens = spec_.has_embedding ? reinterpret_cast<const std::int32_t*>(kept) : nullptr;
  run(params, tokens, spec_.has_embedding ? nullptr : kept, targets, b, full_stash, false, nullptr);
}

// Runs the stage's layers. Without `rolling`, `acts` is the full stash and each layer writes the
// next one's input slot; with it, every layer reuses `acts` (scratch) in place. A null `output`
// skips the last block's output, which no backward needs (recompute).
float CpuGptStage::run(const float* params, const std::int32_t* tokens, const float* input,
                       const std::int32_t* targets, int b, float* acts, bool rolling,
                       float* output) const {
  const int64_t BT = int64_t(b) * T_;
  float* cur = acts;
  const bool has_layers = spec_.blocks > 0 || spec_.has_head;
  if (spec_.has_embedding) {
    if (!rolling) {
      std::memcpy(acts, tokens, std::size_t(BT) * sizeof(float));
      cur += BT;
    }
    float* dst = has_layers ? cur : output;
    if (dst)
      cpu::embedding_forward(dst, tokens, params + wte_, params + wpe_, b, int(T_), int(C_),
                             int(V_));
  } else {
    std::memcpy(cur, input, std::size_t(BT * C_) * sizeof(float));
  }
  for (int64_t i = 0; i < spec_.blocks; ++i) {
    float* next = rolling ? cur : cur + block_floats(BT);
    const bool last = i + 1 == spec_.blocks && !spec_.has_head;
    block_forward(params + block_base_[std::size_t(i)], carve_block(cur, BT), b,
                  last ? output : next);
    cur = next;
  }
  return spec_.has_head ? head_forward(params, carve_head(cur, BT), targets, b) : 0.0f;
}

void CpuGptStage::block_forward(const float* w, const BlockActs<float>& a, int b,
                                float* out) const {
  const int BT = int(b * T_), C = int(C_), F = int(F_);
  const int64_t* r = block_rel_;
  cpu::layernorm_forward(a.ln1, a.ln1_mean, a.ln1_rstd, a.x, w + r[ln1_w], w + r[ln1_b], BT, C);
  cpu::matmul_forward(a.qkv, a.ln1, w + r[qkv_w], w + r[qkv_b], nullptr, BT, C, 3 * C);
  cpu::attention_forward(a.atty, a.att, a.qkv, b, int(T_), C, int(NH_));
  cpu::matmul_forward(a.resid1, a.atty, w + r[attproj_w], w + r[attproj_b], a.x, BT, C, C);
  cpu::layernorm_forward(a.ln2, a.ln2_mean, a.ln2_rstd, a.resid1, w + r[ln2_w], w + r[ln2_b], BT,
                         C);
  cpu::matmul_forward(a.fc, a.ln2, w + r[fc_w], w + r[fc_b], nullptr, BT, C, F);
  cpu::gelu_forward(a.gelu, a.fc, int64_t(BT) * F);
  // out may alias a.x (rolling): x is dead once resid1 exists.
  if (out) cpu::matmul_forward(out, a.gelu, w + r[fcproj_w], w + r[fcproj_b], a.resid1, BT, F, C);
}

float CpuGptStage::head_forward(const float* params, const HeadActs<float>& h,
                                const std::int32_t* targets, int b) const {
  const int BT = int(b * T_);
  cpu::layernorm_forward(h.lnf, h.mean, h.rstd, h.x, params + lnf_w_, params + lnf_b_, BT, int(C_));
  cpu::matmul_forward(h.probs, h.lnf, params + head_w_, nullptr, nullptr, BT, int(C_), int(V_));
  std::memcpy(h.targets, targets, std::size_t(BT) * sizeof(float));
  const double sum = cpu::softmax_crossentropy_forward(h.probs, h.losses, targets, BT, int(V_));
  return float(sum / double(BT));
}

// Workspace use: on the first stage the residual-stream gradient dres takes its first B*T*C
// floats (elsewhere dres is d_input); the rest is the scratch of the layers' backward.
void CpuGptStage::backward(const float* params, const float* full_stash, const float* d_output,
                           int b, float loss_scale, float* grads, float* d_input,
                           float* workspace) {
  const int64_t BT = int64_t(b) * T_, BTC = BT * C_;
  const bool has_layers = spec_.blocks > 0 || spec_.has_head;
  if ((!spec_.has_head && !d_output) || (!spec_.has_embedding && !d_input))
    throw Error("cpu stage backward: missing d_output or d_input");
  float* dres = d_input;
  float* ws = workspace;
  int64_t ws_floats = sizes(b).workspace;
  if (spec_.has_embedding && has_layers) {
    dres = workspace;
    ws += BTC;
    ws_floats -= BTC;
  }
  if (!spec_.has_head && has_layers) std::memcpy(dres, d_output, std::size_t(BTC) * sizeof(float));
  const float* cur = full_stash + (spec_.has_embedding ? BT : 0);
  if (spec_.has_head)
    head_backward(params, grads, carve_head(cur + spec_.blocks * block_floats(BT), BT), b,
                  loss_scale, dres, ws, ws_floats);
  for (int64_t i = spec_.blocks - 1; i >= 0; --i) {
    const int64_t base = block_base_[std::size_t(i)];
    block_backward(params + base, grads + base, carve_block(cur + i * block_floats(BT), BT), b,
                   dres, ws, ws_floats);
  }
  if (spec_.has_embedding)
    cpu::embedding_backward(grads + wte_, grads + wpe_, has_layers ? dres : d_output,
                            reinterpret_cast<const std::int32_t*>(full_stash), b, int(T_), int(C_));
}

// dlogits is built in row blocks that fit the workspace; dres receives d(lnf out), then the
// final norm's backward turns it, in place, into d(head input).
void CpuGptStage::head_backward(const float* params, float* grads, const HeadActs<const float>& h,
                                int b, float loss_scale, float* dres, float* ws,
                                int64_t ws_floats) const {
  const int BT = int(b * T_), C = int(C_), V = int(V_);
  const int rows = int(std::min<int64_t>(BT, ws_floats / V_));
  if (rows < 1) throw Error("cpu stage backward: workspace smaller than one row of logits");
  const auto* targets = reinterpret_cast<const std::int32_t*>(h.targets);
  for (int r0 = 0; r0 < BT; r0 += rows) {
    const int n = std::min(rows, BT - r0);
    cpu::softmax_crossentropy_backward(ws, h.probs + int64_t(r0) * V, targets + r0, loss_scale, n,
                                       V);
    cpu::matmul_backward(dres + int64_t(r0) * C, grads + head_w_, nullptr, ws,
                         h.lnf + int64_t(r0) * C, params + head_w_, n, C, V);
  }
  cpu::layernorm_backward(dres, grads + lnf_w_, grads + lnf_b_, dres, h.x, params + lnf_w_, h.mean,
                          h.rstd, BT, C, false);
}

// dres holds d(block output) and leaves holding d(block input). Scratch: the MLP phase uses
// [dgelu (BT F) | dln2 (BT C)], the attention phase [dqkv (BT 3C) | datty (BT C) | dS rows].
void CpuGptStage::block_backward(const float* w, float* g, const BlockActs<const float>& a, int b,
                                 float* dres, float* ws, int64_t ws_floats) const {
  const int BT = int(b * T_), C = int(C_), F = int(F_);
  const int64_t BTC = int64_t(BT) * C;
  if (ws_floats < int64_t(BT) * F + BTC || ws_floats < 4 * BTC + T_)
    throw Error("cpu stage backward: workspace too small for a block");
  const int64_t* r = block_rel_;
  float* dgelu = ws;
  float* dln2 = ws + int64_t(BT) * F;
  cpu::matmul_backward(dgelu, g + r[fcproj_w], g + r[fcproj_b], dres, a.gelu, w + r[fcproj_w], BT,
                       F, C);
  cpu::gelu_backward(dgelu, a.fc, dgelu, int64_t(BT) * F);
  cpu::matmul_backward(dln2, g + r[fc_w], g + r[fc_b], dgelu, a.ln2, w + r[fc_w], BT, C, F);
  cpu::layernorm_backward(dres, g + r[ln2_w], g + r[ln2_b], dln2, a.resid1, w + r[ln2_w],
                          a.ln2_mean, a.ln2_rstd, BT, C, true);
  float* dqkv = ws;
  float* datty = ws + 3 * BTC;
  cpu::matmul_backward(datty, g + r[attproj_w], g + r[attproj_b], dres, a.atty, w + r[attproj_w],
                       BT, C, C);
  cpu::attention_backward(dqkv, datty, a.qkv, a.att, ws + 4 * BTC, ws_floats - 4 * BTC, b, int(T_),
                          C, int(NH_));
  float* dln1 = datty;  // datty is dead once dqkv exists
  cpu::matmul_backward(dln1, g + r[qkv_w], g + r[qkv_b], dqkv, a.ln1, w + r[qkv_w], BT, C, 3 * C);
  cpu::layernorm_backward(dres, g + r[ln1_w], g + r[ln1_b], dln1, a.x, w + r[ln1_w], a.ln1_mean,
                          a.ln1_rstd, BT, C, true);
}

}  // namespace

std::unique_ptr<StageCompute> make_cpu_stage(const StageSpec& spec) {
  // The runtime runs one thread per device: OpenBLAS must not start its own pool on top.
  openblas_set_num_threads(1);
  return std::make_unique<CpuGptStage>(spec);
}

}  // namespace pw::exec
