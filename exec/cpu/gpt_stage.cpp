// The CPU StageCompute: one pipeline stage of a GPT-2 (embedding, pre-LN blocks, tied head), fp32.
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "exec/cpu/kernels.hpp"
#include "exec/gpt_layout.hpp"
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

// Elements [first, first + n) of the whole tensor `name` (a TP shard fills its slices of it).
void fill_normal(float* out, int64_t n, std::uint64_t seed, const std::string& name, float std,
                 int64_t first = 0) {
  const std::uint64_t key = splitmix64(seed ^ fnv1a(name));
  for (int64_t k = 0; k < n; ++k) {
    const std::uint64_t i = std::uint64_t(first + k);
    const double u1 = (double(splitmix64(key + 2 * i) >> 11) + 0.5) * 0x1p-53;
    const double u2 = (double(splitmix64(key + 2 * i + 1) >> 11) + 0.5) * 0x1p-53;
    out[k] = float(std * std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2));
  }
}

void check_id(std::int32_t id, int64_t V, const char* what) {
  if (id < 0 || id >= V)
    throw InputError(std::string(what) + " id " + std::to_string(id) + " outside [0, " +
                     std::to_string(V) + ")");
}

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

// The whole stage's gradients in one buffer, in the layout's order.
class FlatSink : public GradientSink {
 public:
  explicit FlatSink(float* grads) : grads_(grads) {}
  float* at(std::int64_t offset, std::int64_t) override { return grads_ + offset; }
  void layer_done(std::int64_t, std::int64_t) override {}

 private:
  float* grads_;
};

class CpuGptStage final : public StageCompute {
 public:
  explicit CpuGptStage(const StageSpec& spec);
  const StageSpec& spec() const override { return layout_.spec; }
  const std::vector<TensorSlot>& layout() const override { return layout_.slots; }
  StageSizes sizes(int b) const override { return layout_.sizes(b); }
  void init_parameters(float* params, std::uint64_t seed) const override;
  void set_tp(TpComm comm) override { tp_ = std::move(comm); }
  float forward(const float* params, const std::int32_t* tokens, const float* input,
                const std::int32_t* targets, int b, bool recompute, float* stash, float* output,
                float* scratch) override;
  void recompute(const float* params, const std::int32_t* tokens, const std::int32_t* targets,
                 int b, const float* kept, float* full_stash) override;
  void backward(const float* params, const float* full_stash, const float* d_output, int b,
                float loss_scale, float* grads, float* d_input, float* workspace) override;
  void backward(const float* params, const float* full_stash, const float* d_output, int b,
                float loss_scale, GradientSink& grads, float* d_input, float* workspace) override;
  float forward(LayerMemory& memory, const std::int32_t* tokens, const float* input,
                const std::int32_t* targets, int b, bool recompute, float* stash, float* output,
                float* scratch) override;
  void recompute(LayerMemory& memory, const std::int32_t* targets, int b, const float* kept,
                 float* full_stash) override;
  void backward(LayerMemory& memory, const float* full_stash, const float* d_output, int b,
                float loss_scale, float* d_input, float* workspace) override;
  MixedSizes mixed_sizes(int b, const std::vector<bool>& recomputed) const override;
  float forward_mixed(const float* params, const std::int32_t* tokens, const float* input,
                      const std::int32_t* targets, int b, const std::vector<bool>& recomputed,
                      float* swapped, float* checkpoints, float* output, float* scratch) override;
  void recompute_mixed(const float* params, const std::int32_t* targets, int b,
                       const std::vector<bool>& recomputed, const float* checkpoints,
                       float* remade) override;
  void backward_mixed(const float* params, const std::vector<bool>& recomputed,
                      const float* swapped, const float* remade, const float* d_output, int b,
                      float loss_scale, float* grads, GradientSink* sink, float* d_input,
                      float* workspace) override;
  std::int64_t layer_inputs(int b) const override;
  std::int64_t blocks_scratch(int b) const override;
  float forward_blocks(const float* params, const std::int32_t* tokens, const float* input,
                       const std::int32_t* targets, int b, float* kept, float* output,
                       float* scratch) override;
  void backward_blocks(const float* params, const float* kept, const std::int32_t* targets,
                       const float* d_output, int b, float loss_scale, float* grads,
                       GradientSink* sink, float* d_input, float* workspace,
                       float* scratch) override;
  float forward_blocks(LayerMemory& memory, const std::int32_t* tokens, const float* input,
                       const std::int32_t* targets, int b, float* kept, float* output,
                       float* scratch) override;
  void backward_blocks(LayerMemory& memory, const float* kept, const std::int32_t* targets,
                       const float* d_output, int b, float loss_scale, float* d_input,
                       float* workspace, float* scratch) override;

 private:
  // Where the tensors are during one call: one flat blob (`params`; gradients through a sink), or
  // layer by layer wherever a LayerMemory says (offload chunks).
  struct At {
    const float* params = nullptr;
    GradientSink* grads = nullptr;
    LayerMemory* memory = nullptr;
    // Whether the memory hears of the layers (false: a re-made layer inside its backward's visit).
    bool hooks = true;
    const float* p(int64_t offset) const {
      return memory ? memory->parameters(offset) : params + offset;
    }
    float* g(int64_t offset, int64_t size) const {
      return memory ? memory->gradients(offset) : grads->at(offset, size);
    }
    void begin(int layer, bool backward) const {
      if (memory && hooks) memory->begin_layer(layer, backward);
    }
    void end(int layer, bool backward) const {
      if (memory && hooks) memory->end_layer(layer, backward);
    }
  };
  // The stage's layers in forward order (LayerMemory's numbering).
  int block_layer(int64_t i) const { return int(i) + (layout_.spec.has_embedding ? 1 : 0); }
  int head_layer() const { return block_layer(layout_.spec.blocks); }
  int layer_count() const { return head_layer() + (layout_.spec.has_head ? 1 : 0); }
  // A layer's stash in elements for BT tokens.
  int64_t layer_elements(int layer, int64_t BT) const;
  // Where each layer's stash sits (null: not there): the layers `in` says, in forward order, one
  // after the other from `base`. The full stash: every layer.
  template <class Pred>
  std::vector<float*> place_layers(float* base, int64_t BT, Pred in) const;
  // A mixed stage (MixedSizes): whether layer `layer` recomputes (its block does), and the runs
  // of consecutive layers making one choice, in forward order.
  struct Segment {
    int from = 0, to = 0;  // layers [from, to]
    bool recomputed = false;
    int64_t checkpoint = 0;  // a recomputed run's checkpoint: its offset in the checkpoints
  };
  std::vector<Segment> segments(const std::vector<bool>& recomputed, int64_t BT) const;
  // Each layer's stash in the full stash (sizes().stash floats, layers in forward order).
  std::vector<const float*> full_layers(const float* full_stash, int b) const {
    const auto at = place_layers(const_cast<float*>(full_stash), int64_t(b) * layout_.T,
                                 [](int) { return true; });
    return {at.begin(), at.end()};
  }
  // `remake`, when given, runs before each layer's backward (block recompute: it re-makes that
  // layer's stash where `acts` says it is).
  void backward(const At& at, const std::vector<const float*>& acts, const float* d_output, int b,
                float loss_scale, float* d_input, float* workspace,
                const std::function<void(int)>& remake = {});
  // Block recompute: where each layer's input is kept (kept: layer_inputs floats, forward order).
  std::vector<float*> kept_layers(float* kept, int64_t BT) const;
  float forward_blocks(const At& at, const std::int32_t* tokens, const float* input,
                       const std::int32_t* targets, int b, float* kept, float* output,
                       float* scratch);
  // Block recompute with SP: while it lives, the layers' all-gathers go to the tail of the
  // scratch (blocks_scratch past sizes().scratch), not to the workspace a backward is using.
  class GathersInScratch {
   public:
    GathersInScratch(CpuGptStage& stage, float* scratch, int b);
    ~GathersInScratch();
    GathersInScratch(const GathersInScratch&) = delete;
    GathersInScratch& operator=(const GathersInScratch&) = delete;

   private:
    CpuGptStage& stage_;
    float* saved_ = nullptr;
    int64_t saved_floats_ = 0;
  };
  void backward_blocks(const At& at, const float* kept, const std::int32_t* targets,
                       const float* d_output, int b, float loss_scale, float* d_input,
                       float* workspace, float* scratch);
  float forward(const At& at, const std::int32_t* tokens, const float* input,
                const std::int32_t* targets, int b, bool recompute, float* stash, float* output,
                float* scratch) const;
  void recompute(const At& at, const std::int32_t* targets, int b, const float* kept,
                 float* full_stash) const;
  template <class F>
  BlockActs<F> carve_block(F* base, int64_t BT) const;
  template <class F>
  HeadActs<F> carve_head(F* base, int64_t BT) const;
  float run(const At& at, const std::int32_t* tokens, const float* input,
            const std::int32_t* targets, int b, float* acts, bool rolling, float* output) const;
  float run_range(const At& at, int from, int to, const std::int32_t* tokens, const float* input,
                  const std::int32_t* targets, int b, const std::vector<float*>& acts,
                  float* output) const;
  void block_forward(const At& at, int64_t base, const BlockActs<float>& a, int b,
                     float* out) const;
  void block_backward(const At& at, int64_t base, const BlockActs<const float>& a, int b,
                      float* dres, float* ws, int64_t ws_floats, float* core = nullptr) const;
  float head_forward(const At& at, const HeadActs<float>& h, const std::int32_t* targets,
                     int b) const;
  void head_backward(const At& at, const HeadActs<const float>& h, int b, float loss_scale,
                     float* dres, float* ws, int64_t ws_floats) const;
  void embedding_backward(const At& at, const float* token_stash, const float* demb, int b,
                          float* ws, int64_t ws_floats) const;

  // Tensor parallelism: the TP group's sum (nothing at t = 1); the row-parallel GEMM's output
  // summed over the group, then `residual` + bias added (as matmul_forward fuses them at t = 1).
  void tp_sum(float* data, int64_t n) const;
  // Sequence parallelism: this rank's rows (rows(BT) x C) into `full` (BT x C) and every other
  // rank's rows from them; the sum of every rank's `full` over this rank's rows into `mine`.
  const float* gather(const float* mine, float* full, int64_t BT) const;
  void scatter(float* full, float* mine, int64_t BT) const;
  // A norm's weight and bias gradients of this rank's rows, summed over the group (SP), added.
  void norm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, const float* mean, const float* rstd, int N,
                     bool accumulate) const;
  float* scratch(int64_t floats) const;
  void row_parallel_forward(float* out, const float* inp, const float* weight, const float* bias,
                            const float* residual, int N, int C_in) const;
  // The embedding and cross-entropy over this rank's vocabulary rows (t > 1 or padding).
  void embedding_forward_vp(float* out, const std::int32_t* tokens, const At& at, int b) const;
  double crossentropy_forward_vp(float* probs, float* losses, const std::int32_t* targets,
                                 int N) const;
  bool vocab_parallel() const { return layout_.t > 1 || layout_.V_pad != layout_.V; }

  GptLayout layout_;                     // in fp32 elements
  int64_t block_size_[kBlockTensors]{};  // a block's tensors' elements
  TpComm tp_;
};

// The CPU backend computes in fp32 whatever the model says.
CpuGptStage::CpuGptStage(const StageSpec& spec) : layout_(spec, models::DType::fp32, "cpu") {
  if (layout_.block_base.empty()) return;
  for (const TensorSlot& slot : layout_.slots)
    for (int k = 0; k < kBlockTensors; ++k)
      if (slot.offset == layout_.block_base.front() + layout_.block_rel[k])
        block_size_[k] = slot.size;
}

void CpuGptStage::init_parameters(float* params, std::uint64_t seed) const {
  const float proj_std = 0.02f / std::sqrt(2.0f * float(layout_.spec.model.layers));
  const int64_t C = layout_.C, F = layout_.F, C_t = layout_.C_t, F_t = layout_.F_t, tp = layout_.tp;
  for (const TensorSlot& s : layout_.slots) {
    float* p = params + s.offset;
    const std::string& n = s.name;
    const auto ends = [&](const char* suffix) {
      const std::size_t k = std::strlen(suffix);
      return n.size() >= k && n.compare(n.size() - k, k, suffix) == 0;
    };
    if (ends("ln1_w") || ends("ln2_w") || n == "lnf_w") {
      std::fill(p, p + s.size, 1.0f);
    } else if (ends("_b")) {
      std::fill(p, p + s.size, 0.0f);
    } else if (n == "wte" || n == "lm_head") {
      // This rank's vocabulary rows; the tied copy starts as the embedding.
      const std::string name = layout_.spec.model.tied_embeddings ? "wte" : n;
      fill_normal(p, s.size, seed, name, 0.02f, layout_.v_begin * C);
    } else if (ends("qkv_w")) {
      for (int64_t part = 0; part < 3; ++part)  // this rank's heads of q, k and v
        fill_normal(p + part * C_t * C, C_t * C, seed, n, 0.02f, (part * C + tp * C_t) * C);
    } else if (ends("fc_w")) {
      fill_normal(p, s.size, seed, n, 0.02f, tp * F_t * C);
    } else if (ends("attproj_w") || ends("fcproj_w")) {
      const int64_t in = ends("attproj_w") ? C : F, in_t = in / layout_.t;
      for (int64_t row = 0; row < C; ++row)  // this rank's input columns of every row
        fill_normal(p + row * in_t, in_t, seed, n, proj_std, row * in + tp * in_t);
    } else {
      fill_normal(p, s.size, seed, n, 0.02f);
    }
  }
}

void CpuGptStage::tp_sum(float* data, int64_t n) const {
  if (layout_.t == 1) return;
  if (!tp_.all_reduce) throw Error("cpu stage: t > 1 without the TP group's all-reduce");
  tp_.all_reduce(data, n);
}

float* CpuGptStage::scratch(int64_t floats) const {
  if (!tp_.scratch || tp_.scratch_floats < floats)
    throw Error(
        "cpu stage: sequence parallelism or selective recompute without a large enough scratch");
  return tp_.scratch;
}

const float* CpuGptStage::gather(const float* mine, float* full, int64_t BT) const {
  const int64_t n = layout_.rows(BT) * layout_.C;
  std::memcpy(full + layout_.tp * n, mine, std::size_t(n) * sizeof(float));
  tp_.all_gather(full, BT * layout_.C);
  return full;
}

void CpuGptStage::scatter(float* full, float* mine, int64_t BT) const {
  const int64_t n = layout_.rows(BT) * layout_.C;
  tp_.reduce_scatter(full, BT * layout_.C);
  std::memmove(mine, full + layout_.tp * n, std::size_t(n) * sizeof(float));
}

void CpuGptStage::norm_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                                const float* inp, const float* weight, const float* mean,
                                const float* rstd, int N, bool accumulate) const {
  const int C = int(layout_.C);
  if (!layout_.sp)
    return cpu::layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C,
                                   accumulate);
  std::vector<float> d(std::size_t(2 * C), 0.0f);
  cpu::layernorm_backward(dinp, d.data(), d.data() + C, dout, inp, weight, mean, rstd, N, C,
                          accumulate);
  tp_sum(d.data(), 2 * C);
  for (int j = 0; j < C; ++j) {
    dweight[j] += d[std::size_t(j)];
    dbias[j] += d[std::size_t(C + j)];
  }
}

void CpuGptStage::row_parallel_forward(float* out, const float* inp, const float* weight,
                                       const float* bias, const float* residual, int N,
                                       int C_in) const {
  const int C = int(layout_.C);
  if (layout_.t == 1) return cpu::matmul_forward(out, inp, weight, bias, residual, N, C_in, C);
  int64_t rows = N;
  if (layout_.sp) {  // the partial sums full-width in the scratch, this rank's rows summed
    float* full = scratch(int64_t(N) * C);
    cpu::matmul_forward(full, inp, weight, nullptr, nullptr, N, C_in, C);
    rows = layout_.rows(N);
    scatter(full, out, N);
  } else {
    cpu::matmul_forward(out, inp, weight, nullptr, nullptr, N, C_in, C);
    tp_sum(out, int64_t(N) * C);
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* o = out + r * C;
    const float* x = residual + r * C;
    for (int j = 0; j < C; ++j)
      o[j] = (x[j] + bias[j]) + o[j];
  }
}

// Rows of this rank's vocabulary range, zeros elsewhere, summed over the group; then positions.
void CpuGptStage::embedding_forward_vp(float* out, const std::int32_t* tokens, const At& at,
                                       int b) const {
  const int64_t T = layout_.T, C = layout_.C, BT = int64_t(b) * T;
  const float* wte = at.p(layout_.wte);
  // With SP the lookups full-width in the scratch, this rank's rows of their sum into out.
  float* looked = layout_.sp ? scratch(BT * C) : out;
  for (int64_t i = 0; i < BT; ++i) {
    check_id(tokens[i], layout_.V, "token");
    const int64_t row = tokens[i] - layout_.v_begin;
    float* o = looked + i * C;
    if (row >= 0 && row < layout_.V_t)
      std::memcpy(o, wte + row * C, std::size_t(C) * sizeof(float));
    else
      std::fill(o, o + C, 0.0f);
  }
  if (layout_.sp)
    scatter(looked, out, BT);
  else
    tp_sum(out, BT * C);
  const float* wpe = at.p(layout_.wpe);
  const int64_t rows = layout_.rows(BT), first = layout_.sp ? layout_.tp * rows : 0;
  for (int64_t i = 0; i < rows; ++i) {
    float* o = out + i * C;
    const float* p = wpe + ((first + i) % T) * C;
    for (int64_t j = 0; j < C; ++j)
      o[j] = o[j] + p[j];
  }
}

// Megatron's vocabulary-parallel cross-entropy over this rank's logits (N, V_t): the row maxima,
// the sums of exponentials and the target logits summed over the group; padded rows (>= V) get
// probability 0. Logits become probabilities in place.
double CpuGptStage::crossentropy_forward_vp(float* probs, float* losses,
                                            const std::int32_t* targets, int N) const {
  const int64_t Vt = layout_.V_t, t = layout_.t, tp = layout_.tp;
  const int64_t valid = std::clamp(layout_.V - layout_.v_begin, int64_t(0), Vt);
  // Each rank's row maxima side by side (a sum of one value and zeros is exact).
  std::vector<float> maxima(std::size_t(N * t), 0.0f), sums(std::size_t(2 * N), 0.0f);
  for (int64_t r = 0; r < N; ++r) {
    check_id(targets[r], layout_.V, "target");
    const float* l = probs + r * Vt;
    float m = -INFINITY;
    for (int64_t j = 0; j < valid; ++j)
      m = std::max(m, l[j]);
    maxima[std::size_t(r * t + tp)] = m;
  }
  tp_sum(maxima.data(), N * t);
  for (int64_t r = 0; r < N; ++r) {
    float m = -INFINITY;
    for (int64_t k = 0; k < t; ++k)
      m = std::max(m, maxima[std::size_t(r * t + k)]);
    float* l = probs + r * Vt;
    // The target's logit minus the maximum, on the rank that holds it.
    const int64_t target = targets[r] - layout_.v_begin;
    if (target >= 0 && target < valid) sums[std::size_t(N + r)] = l[target] - m;
    double sum = 0;
    for (int64_t j = 0; j < valid; ++j) {
      l[j] = std::exp(l[j] - m);
      sum += l[j];
    }
    std::fill(l + valid, l + Vt, 0.0f);
    sums[std::size_t(r)] = float(sum);
  }
  tp_sum(sums.data(), 2 * N);
  double total = 0;
  for (int64_t r = 0; r < N; ++r) {
    const float s = sums[std::size_t(r)];
    float* l = probs + r * Vt;
    const float inv = 1.0f / s;
    for (int64_t j = 0; j < valid; ++j)
      l[j] *= inv;
    losses[r] = std::log(s) - sums[std::size_t(N + r)];
    total += losses[r];
  }
  return total;
}

template <class F>
BlockActs<F> CpuGptStage::carve_block(F* base, int64_t BT) const {
  const int64_t C = layout_.C, T = layout_.T, C_t = layout_.C_t, NH_t = layout_.NH_t;
  Carver<F> c{base};
  BlockActs<F> a;
  const int64_t R = layout_.rows(BT);  // tokens outside the TP region (SP: this rank's)
  a.x = c.take(R * C), a.ln1 = c.take(R * C);
  a.ln1_mean = c.take(R), a.ln1_rstd = c.take(R);
  a.qkv = c.take(BT * 3 * C_t), a.att = layout_.selective ? nullptr : c.take(BT * NH_t * T);
  a.atty = c.take(BT * C_t);
  a.resid1 = c.take(R * C), a.ln2 = c.take(R * C);
  a.ln2_mean = c.take(R), a.ln2_rstd = c.take(R);
  a.fc = c.take(BT * layout_.F_t), a.gelu = c.take(BT * layout_.F_t);
  return a;
}

template <class F>
HeadActs<F> CpuGptStage::carve_head(F* base, int64_t BT) const {
  const int64_t C = layout_.C, V = layout_.V_t;
  Carver<F> c{base};
  HeadActs<F> h;
  const int64_t R = layout_.rows(BT);
  h.x = c.take(R * C), h.lnf = c.take(R * C), h.mean = c.take(R), h.rstd = c.take(R);
  h.probs = c.take(BT * V), h.targets = c.take(BT), h.losses = c.take(BT);
  return h;
}

float CpuGptStage::forward(const float* params, const std::int32_t* tokens, const float* input,
                           const std::int32_t* targets, int b, bool recompute, float* stash,
                           float* output, float* scratch) {
  return forward(At{params}, tokens, input, targets, b, recompute, stash, output, scratch);
}

float CpuGptStage::forward(LayerMemory& memory, const std::int32_t* tokens, const float* input,
                           const std::int32_t* targets, int b, bool recompute, float* stash,
                           float* output, float* scratch) {
  return forward(At{nullptr, nullptr, &memory}, tokens, input, targets, b, recompute, stash, output,
                 scratch);
}

float CpuGptStage::forward(const At& at, const std::int32_t* tokens, const float* input,
                           const std::int32_t* targets, int b, bool recompute, float* stash,
                           float* output, float* scratch) const {
  const StageSpec& s = layout_.spec;
  if ((s.has_embedding ? !tokens : !input) || (s.has_head ? !targets : !output))
    throw Error("cpu stage forward: missing tokens, input, targets or output");
  if (recompute && !scratch)
    throw Error("cpu stage forward with recompute needs scratch (sizes().scratch floats)");
  if (!recompute) return run(at, tokens, input, targets, b, stash, false, output);
  const int64_t BT = int64_t(b) * layout_.T;
  if (s.has_embedding)
    std::memcpy(stash, tokens, std::size_t(BT) * sizeof(float));
  else
    std::memcpy(stash, input, std::size_t(layout_.rows(BT) * layout_.C) * sizeof(float));
  return run(at, tokens, input, targets, b, scratch, true, output);
}

void CpuGptStage::recompute(const float* params, const std::int32_t*, const std::int32_t* targets,
                            int b, const float* kept, float* full_stash) {
  recompute(At{params}, targets, b, kept, full_stash);
}

void CpuGptStage::recompute(LayerMemory& memory, const std::int32_t* targets, int b,
                            const float* kept, float* full_stash) {
  recompute(At{nullptr, nullptr, &memory}, targets, b, kept, full_stash);
}

void CpuGptStage::recompute(const At& at, const std::int32_t* targets, int b, const float* kept,
                            float* full_stash) const {
  // The kept stash is the stage input: token ids (bit-cast) on the first stage, else (B, T, C).
  const bool first = layout_.spec.has_embedding;
  const auto* tokens = first ? reinterpret_cast<const std::int32_t*>(kept) : nullptr;
  run(at, tokens, first ? nullptr : kept, targets, b, full_stash, false, nullptr);
}

int64_t CpuGptStage::layer_elements(int layer, int64_t BT) const {
  if (layout_.spec.has_embedding && layer == 0) return layout_.embedding_elements(BT);
  if (layout_.spec.has_head && layer == head_layer()) return layout_.head_elements(BT);
  return layout_.block_elements(BT);
}

template <class Pred>
std::vector<float*> CpuGptStage::place_layers(float* base, int64_t BT, Pred in) const {
  std::vector<float*> acts(std::size_t(layer_count()), nullptr);
  for (int l = 0; l < layer_count(); ++l)
    if (in(l)) {
      acts[std::size_t(l)] = base;
      base += layer_elements(l, BT);
    }
  return acts;
}

// Runs the stage's layers. Without `rolling`, `acts` is the full stash and each layer writes the
// next one's input slot; with it, every layer reuses `acts` (scratch) in place. A null `output`
// skips the last block's output, which no backward needs (recompute).
float CpuGptStage::run(const At& at, const std::int32_t* tokens, const float* input,
                       const std::int32_t* targets, int b, float* acts, bool rolling,
                       float* output) const {
  const int64_t BT = int64_t(b) * layout_.T;
  const bool emb = layout_.spec.has_embedding;
  // Rolling: no layer keeps a stash, the embedding not even its token ids.
  const std::vector<float*> where = rolling ? place_layers(acts, BT, [](int) { return false; })
                                            : place_layers(acts, BT, [](int) { return true; });
  std::vector<float*> in_place = where;
  if (rolling)
    for (int l = emb ? 1 : 0; l < layer_count(); ++l)
      in_place[std::size_t(l)] = acts;
  return run_range(at, 0, layer_count() - 1, tokens, input, targets, b, in_place, output);
}

// Runs layers [from, to] (LayerMemory's numbering). acts[l]: where layer l's stash goes (a
// block's or the head's with its input at offset 0; the embedding's token ids, or null to keep
// none). Each layer writes its output into the next one's input slot, the last one into `output`
// (null: not computed; the head has none). The input of layer `from`: `tokens` for the
// embedding, else `input`, copied into its slot unless it is there. Returns the loss (0 without
// the head).
float CpuGptStage::run_range(const At& at, int from, int to, const std::int32_t* tokens,
                             const float* input, const std::int32_t* targets, int b,
                             const std::vector<float*>& acts, float* output) const {
  const StageSpec& s = layout_.spec;
  const int64_t BT = int64_t(b) * layout_.T;
  const auto next = [&](int l) { return l < to ? acts[std::size_t(l + 1)] : output; };
  if ((from != 0 || !s.has_embedding) && acts[std::size_t(from)] != input)
    std::memcpy(acts[std::size_t(from)], input,
                std::size_t(layout_.rows(BT) * layout_.C) * sizeof(float));
  float loss = 0.0f;
  for (int l = from; l <= to; ++l) {
    at.begin(l, false);
    if (s.has_embedding && l == 0) {
      if (acts[0]) std::memcpy(acts[0], tokens, std::size_t(BT) * sizeof(float));
      float* dst = next(l);
      if (dst && vocab_parallel())
        embedding_forward_vp(dst, tokens, at, b);
      else if (dst)
        cpu::embedding_forward(dst, tokens, at.p(layout_.wte), at.p(layout_.wpe), b, int(layout_.T),
                               int(layout_.C), int(layout_.V));
    } else if (s.has_head && l == head_layer()) {
      loss = head_forward(at, carve_head(acts[std::size_t(l)], BT), targets, b);
    } else {
      const int64_t i = l - (s.has_embedding ? 1 : 0);
      block_forward(at, layout_.block_base[std::size_t(i)], carve_block(acts[std::size_t(l)], BT),
                    b, next(l));
    }
    at.end(l, false);
  }
  return loss;
}

// A mixed stage's runs of layers. The embedding goes with the first block, the head with the
// last; a recomputed run's checkpoint is its input: the token ids (a run from the embedding) or a
// block's input (rows x C).
std::vector<CpuGptStage::Segment> CpuGptStage::segments(const std::vector<bool>& recomputed,
                                                        int64_t BT) const {
  const StageSpec& s = layout_.spec;
  if (s.blocks < 1 || std::int64_t(recomputed.size()) != s.blocks)
    throw Error("cpu stage: " + std::to_string(recomputed.size()) +
                " swap/recompute choices for a stage of " + std::to_string(s.blocks) + " blocks");
  const int emb = s.has_embedding ? 1 : 0;
  const auto of = [&](int l) {
    return bool(recomputed[std::size_t(std::clamp<int64_t>(l - emb, 0, s.blocks - 1))]);
  };
  std::vector<Segment> out;
  int64_t checkpoints = 0;
  for (int l = 0; l < layer_count(); ++l) {
    if (!out.empty() && out.back().recomputed == of(l)) {
      out.back().to = l;
      continue;
    }
    Segment g{l, l, of(l), 0};
    if (g.recomputed) {
      g.checkpoint = checkpoints;
      checkpoints += l == 0 && emb ? layout_.embedding_elements(BT) : layout_.rows(BT) * layout_.C;
    }
    out.push_back(g);
  }
  return out;
}

MixedSizes CpuGptStage::mixed_sizes(int b, const std::vector<bool>& recomputed) const {
  const int64_t BT = int64_t(b) * layout_.T;
  MixedSizes z;
  for (const Segment& g : segments(recomputed, BT)) {
    for (int l = g.from; l <= g.to; ++l) {
      (g.recomputed ? z.remade : z.swapped) += layer_elements(l, BT);
      // The embedding runs in its block's place (its output is the block's input).
      if (g.recomputed && !(layout_.spec.has_embedding && l == 0))
        z.scratch = std::max(z.scratch, layer_elements(l, BT));
    }
    if (g.recomputed)
      z.checkpoints += g.from == 0 && layout_.spec.has_embedding ? layout_.embedding_elements(BT)
                                                                 : layout_.rows(BT) * layout_.C;
  }
  return z;
}

float CpuGptStage::forward_mixed(const float* params, const std::int32_t* tokens,
                                 const float* input, const std::int32_t* targets, int b,
                                 const std::vector<bool>& recomputed, float* swapped,
                                 float* checkpoints, float* output, float* scratch) {
  const StageSpec& s = layout_.spec;
  if ((s.has_embedding ? !tokens : !input) || (s.has_head ? !targets : !output))
    throw Error("cpu stage forward: missing tokens, input, targets or output");
  const int64_t BT = int64_t(b) * layout_.T;
  const std::vector<Segment> segs = segments(recomputed, BT);
  if (std::any_of(segs.begin(), segs.end(), [](const Segment& g) { return g.recomputed; }) &&
      (!scratch || !checkpoints))
    throw Error("cpu stage mixed forward: needs checkpoints and scratch (mixed_sizes)");
  const int emb = s.has_embedding ? 1 : 0;
  const auto rc = [&](int l) {
    return bool(recomputed[std::size_t(std::clamp<int64_t>(l - emb, 0, s.blocks - 1))]);
  };
  const std::vector<float*> kept = place_layers(swapped, BT, [&](int l) { return !rc(l); });
  // The recomputed layers run in place in the scratch, keeping no stash (their checkpoint aside).
  std::vector<float*> rolling(std::size_t(layer_count()), nullptr);
  for (int l = emb; l < layer_count(); ++l)
    rolling[std::size_t(l)] = scratch;
  const At at{params};
  float loss = 0.0f;
  for (std::size_t k = 0; k < segs.size(); ++k) {
    const Segment& g = segs[k];
    // Where the run's output goes: the next run's checkpoint, or its first layer's stash slot.
    float* out = output;
    if (k + 1 < segs.size())
      out = segs[k + 1].recomputed ? checkpoints + segs[k + 1].checkpoint
                                   : kept[std::size_t(segs[k + 1].from)];
    if (!g.recomputed) {
      loss = run_range(at, g.from, g.to, tokens, g.from == 0 ? input : kept[std::size_t(g.from)],
                       targets, b, kept, out);
      continue;
    }
    float* ckpt = checkpoints + g.checkpoint;
    if (g.from == 0 && emb)
      std::memcpy(ckpt, tokens, std::size_t(BT) * sizeof(float));
    else if (g.from == 0)
      std::memcpy(ckpt, input, std::size_t(layout_.rows(BT) * layout_.C) * sizeof(float));
    // (a later run's checkpoint was written by the run before it)
    loss = run_range(at, g.from, g.to, tokens, ckpt, targets, b, rolling, out);
  }
  return loss;
}

void CpuGptStage::recompute_mixed(const float* params, const std::int32_t* targets, int b,
                                  const std::vector<bool>& recomputed, const float* checkpoints,
                                  float* remade) {
  const StageSpec& s = layout_.spec;
  const int64_t BT = int64_t(b) * layout_.T;
  const std::vector<Segment> segs = segments(recomputed, BT);
  const int emb = s.has_embedding ? 1 : 0;
  const auto rc = [&](int l) {
    return bool(recomputed[std::size_t(std::clamp<int64_t>(l - emb, 0, s.blocks - 1))]);
  };
  const std::vector<float*> acts = place_layers(remade, BT, rc);
  for (const Segment& g : segs) {
    if (!g.recomputed) continue;
    const float* ckpt = checkpoints + g.checkpoint;
    const auto* tokens = g.from == 0 && emb ? reinterpret_cast<const std::int32_t*>(ckpt) : nullptr;
    // The run's last output is the next (swapped) layer's input, which its stash holds already.
    run_range(At{params}, g.from, g.to, tokens, ckpt, targets, b, acts, nullptr);
  }
}

void CpuGptStage::backward_mixed(const float* params, const std::vector<bool>& recomputed,
                                 const float* swapped, const float* remade, const float* d_output,
                                 int b, float loss_scale, float* grads, GradientSink* sink,
                                 float* d_input, float* workspace) {
  const StageSpec& s = layout_.spec;
  const int64_t BT = int64_t(b) * layout_.T;
  segments(recomputed, BT);  // checks the choices
  const int emb = s.has_embedding ? 1 : 0;
  const auto rc = [&](int l) {
    return bool(recomputed[std::size_t(std::clamp<int64_t>(l - emb, 0, s.blocks - 1))]);
  };
  const std::vector<float*> a =
      place_layers(const_cast<float*>(swapped), BT, [&](int l) { return !rc(l); });
  const std::vector<float*> r = place_layers(const_cast<float*>(remade), BT, rc);
  std::vector<const float*> acts(a.size());
  for (std::size_t l = 0; l < a.size(); ++l)
    acts[l] = a[l] ? a[l] : r[l];
  FlatSink flat(grads);
  backward(At{params, sink ? sink : &flat}, acts, d_output, b, loss_scale, d_input, workspace);
}

void CpuGptStage::block_forward(const At& at, int64_t base, const BlockActs<float>& a, int b,
                                float* out) const {
  // With t > 1: this rank's heads and FFN columns (C_t, F_t), the projections row-parallel.
  const int BT = int(b * layout_.T), C = int(layout_.C), C_t = int(layout_.C_t),
            F_t = int(layout_.F_t);
  const int64_t* r = layout_.block_rel;
  const auto w = [&](int k) { return at.p(base + r[k]); };
  // With SP the norms run on this rank's rows, gathered full-width (scratch) for the GEMMs.
  const int R = int(layout_.rows(BT));
  const auto full = [&](const float* mine) {
    return layout_.sp ? gather(mine, scratch(int64_t(BT) * C), BT) : mine;
  };
  cpu::layernorm_forward(a.ln1, a.ln1_mean, a.ln1_rstd, a.x, w(ln1_w), w(ln1_b), R, C);
  cpu::matmul_forward(a.qkv, full(a.ln1), w(qkv_w), w(qkv_b), nullptr, BT, C, 3 * C_t);
  // Selective: the probabilities a block of rows at a time in the scratch (after the gathers').
  float* att = a.att;
  if (layout_.selective) {
    const int64_t gathers = layout_.sp ? int64_t(BT) * C : 0;
    att = scratch(gathers + cpu::attention_block_floats(int(layout_.T))) + gathers;
  }
  cpu::attention_forward(a.atty, att, a.qkv, b, int(layout_.T), C_t, int(layout_.NH_t),
                         layout_.selective);
  row_parallel_forward(a.resid1, a.atty, w(attproj_w), w(attproj_b), a.x, BT, C_t);
  cpu::layernorm_forward(a.ln2, a.ln2_mean, a.ln2_rstd, a.resid1, w(ln2_w), w(ln2_b), R, C);
  cpu::matmul_forward(a.fc, full(a.ln2), w(fc_w), w(fc_b), nullptr, BT, C, F_t);
  cpu::gelu_forward(a.gelu, a.fc, int64_t(BT) * F_t);
  // out may alias a.x (rolling): x is dead once resid1 exists.
  if (out) row_parallel_forward(out, a.gelu, w(fcproj_w), w(fcproj_b), a.resid1, BT, F_t);
}

float CpuGptStage::head_forward(const At& at, const HeadActs<float>& h, const std::int32_t* targets,
                                int b) const {
  const int BT = int(b * layout_.T);
  cpu::layernorm_forward(h.lnf, h.mean, h.rstd, h.x, at.p(layout_.lnf_w), at.p(layout_.lnf_b),
                         int(layout_.rows(BT)), int(layout_.C));
  const float* lnf = layout_.sp ? gather(h.lnf, scratch(BT * layout_.C), BT) : h.lnf;
  cpu::matmul_forward(h.probs, lnf, at.p(layout_.head_w), nullptr, nullptr, BT, int(layout_.C),
                      int(layout_.V_t));
  std::memcpy(h.targets, targets, std::size_t(BT) * sizeof(float));
  const double sum = vocab_parallel() ? crossentropy_forward_vp(h.probs, h.losses, targets, BT)
                                      : cpu::softmax_crossentropy_forward(
                                            h.probs, h.losses, targets, BT, int(layout_.V));
  return float(sum / double(BT));
}

// Workspace use: on the first stage the residual-stream gradient dres takes its first B*T*C
// floats (elsewhere dres is d_input); the rest is the scratch of the layers' backward.

void CpuGptStage::backward(const float* params, const float* full_stash, const float* d_output,
                           int b, float loss_scale, float* grads, float* d_input,
                           float* workspace) {
  FlatSink sink(grads);
  backward(params, full_stash, d_output, b, loss_scale, sink, d_input, workspace);
}

void CpuGptStage::backward(const float* params, const float* full_stash, const float* d_output,
                           int b, float loss_scale, GradientSink& grads, float* d_input,
                           float* workspace) {
  backward(At{params, &grads}, full_layers(full_stash, b), d_output, b, loss_scale, d_input,
           workspace);
}

void CpuGptStage::backward(LayerMemory& memory, const float* full_stash, const float* d_output,
                           int b, float loss_scale, float* d_input, float* workspace) {
  backward(At{nullptr, nullptr, &memory}, full_layers(full_stash, b), d_output, b, loss_scale,
           d_input, workspace);
}

// A flat call's sink hears of each layer's end (layer_done); a LayerMemory of each layer's
// beginning and end.
void CpuGptStage::backward(const At& at, const std::vector<const float*>& acts,
                           const float* d_output, int b, float loss_scale, float* d_input,
                           float* workspace, const std::function<void(int)>& remake) {
  const StageSpec& s = layout_.spec;
  const int64_t BT = int64_t(b) * layout_.T, BTC = layout_.rows(BT) * layout_.C;  // this rank's
  const bool has_layers = s.blocks > 0 || s.has_head;
  if ((!s.has_head && !d_output) || (!s.has_embedding && !d_input))
    throw Error("cpu stage backward: missing d_output or d_input");
  float* dres = d_input;
  float* ws = workspace;
  int64_t ws_floats = sizes(b).workspace;
  if (s.has_embedding && has_layers) {
    dres = workspace;
    ws += BTC;
    ws_floats -= BTC;
  }
  if (!s.has_head && has_layers) std::memcpy(dres, d_output, std::size_t(BTC) * sizeof(float));
  if (s.has_head) {
    at.begin(head_layer(), true);
    if (remake) remake(head_layer());
    head_backward(at, carve_head(acts[std::size_t(head_layer())], BT), b, loss_scale, dres, ws,
                  ws_floats);
    if (at.grads) at.grads->layer_done(layout_.lnf_w, layout_.parameters);
    at.end(head_layer(), true);
  }
  for (int64_t i = s.blocks - 1; i >= 0; --i) {
    const int64_t base = layout_.block_base[std::size_t(i)];
    const int64_t end = i + 1 < s.blocks ? layout_.block_base[std::size_t(i + 1)]
                                         : (s.has_head ? layout_.lnf_w : layout_.parameters);
    at.begin(block_layer(i), true);
    if (remake) remake(block_layer(i));
    // Selective: the attention core re-made whole where the memory says (offload chunks).
    float* core = layout_.selective && at.memory && at.hooks
                      ? at.memory->attention_core(block_layer(i))
                      : nullptr;
    block_backward(at, base, carve_block(acts[std::size_t(block_layer(i))], BT), b, dres, ws,
                   ws_floats, core);
    if (at.grads) at.grads->layer_done(base, end);
    at.end(block_layer(i), true);
  }
  if (!s.has_embedding) return;
  at.begin(0, true);
  embedding_backward(at, acts[0], has_layers ? dres : d_output, b, ws, ws_floats);
  at.end(0, true);
}

// Block recompute. Layer l keeps its input: the token ids (the embedding, whose stash they are),
// or the rows x C activation a block or the head starts from.
std::vector<float*> CpuGptStage::kept_layers(float* kept, int64_t BT) const {
  std::vector<float*> at(static_cast<std::size_t>(layer_count()));
  for (int l = 0; l < layer_count(); ++l) {
    at[std::size_t(l)] = kept;
    kept += layout_.spec.has_embedding && l == 0 ? BT : layout_.rows(BT) * layout_.C;
  }
  return at;
}

std::int64_t CpuGptStage::layer_inputs(int b) const {
  const int64_t BT = int64_t(b) * layout_.T;
  return (layout_.spec.has_embedding ? BT : 0) +
         (layer_count() - (layout_.spec.has_embedding ? 1 : 0)) * layout_.rows(BT) * layout_.C;
}

float CpuGptStage::forward_blocks(const float* params, const std::int32_t* tokens,
                                  const float* input, const std::int32_t* targets, int b,
                                  float* kept, float* output, float* scratch) {
  return forward_blocks(At{params}, tokens, input, targets, b, kept, output, scratch);
}

float CpuGptStage::forward_blocks(LayerMemory& memory, const std::int32_t* tokens,
                                  const float* input, const std::int32_t* targets, int b,
                                  float* kept, float* output, float* scratch) {
  return forward_blocks(At{nullptr, nullptr, &memory}, tokens, input, targets, b, kept, output,
                        scratch);
}

CpuGptStage::GathersInScratch::GathersInScratch(CpuGptStage& stage, float* scratch, int b)
    : stage_(stage), saved_(stage.tp_.scratch), saved_floats_(stage.tp_.scratch_floats) {
  if (!stage.layout_.sp) return;
  stage.tp_.scratch = scratch + stage.sizes(b).scratch;
  stage.tp_.scratch_floats = int64_t(b) * stage.layout_.T * stage.layout_.C;
}

CpuGptStage::GathersInScratch::~GathersInScratch() {
  stage_.tp_.scratch = saved_;
  stage_.tp_.scratch_floats = saved_floats_;
}

// The scratch a layer is made in, and with SP the full-width rows its all-gathers fill.
std::int64_t CpuGptStage::blocks_scratch(int b) const {
  return sizes(b).scratch + (layout_.sp ? int64_t(b) * layout_.T * layout_.C : 0);
}

float CpuGptStage::forward_blocks(const At& at, const std::int32_t* tokens, const float* input,
                                  const std::int32_t* targets, int b, float* kept, float* output,
                                  float* scratch) {
  const GathersInScratch gathers(*this, scratch, b);
  const int64_t BT = int64_t(b) * layout_.T;
  const std::vector<float*> k = kept_layers(kept, BT);
  const int n = layer_count();
  float loss = 0.0f;
  for (int l = 0; l < n; ++l) {
    // Layer l's stash in the scratch (the embedding's, its token ids, in its kept slot); its
    // output into the next layer's kept input, the last one's into `output`.
    std::vector<float*> acts(std::size_t(n), nullptr);
    const bool embedding = layout_.spec.has_embedding && l == 0;
    acts[std::size_t(l)] = embedding ? k[0] : scratch;
    float* out = l + 1 < n ? k[std::size_t(l + 1)] : output;
    if (l == 0 && !embedding)  // the stage input, kept
      std::memcpy(k[0], input, std::size_t(layout_.rows(BT) * layout_.C) * sizeof(float));
    loss +=
        run_range(at, l, l, tokens, embedding ? nullptr : k[std::size_t(l)], targets, b, acts, out);
  }
  return loss;
}

void CpuGptStage::backward_blocks(const float* params, const float* kept,
                                  const std::int32_t* targets, const float* d_output, int b,
                                  float loss_scale, float* grads, GradientSink* sink,
                                  float* d_input, float* workspace, float* scratch) {
  FlatSink flat(grads);
  backward_blocks(At{params, sink ? sink : &flat}, kept, targets, d_output, b, loss_scale, d_input,
                  workspace, scratch);
}

void CpuGptStage::backward_blocks(LayerMemory& memory, const float* kept,
                                  const std::int32_t* targets, const float* d_output, int b,
                                  float loss_scale, float* d_input, float* workspace,
                                  float* scratch) {
  backward_blocks(At{nullptr, nullptr, &memory}, kept, targets, d_output, b, loss_scale, d_input,
                  workspace, scratch);
}

void CpuGptStage::backward_blocks(const At& at, const float* kept, const std::int32_t* targets,
                                  const float* d_output, int b, float loss_scale, float* d_input,
                                  float* workspace, float* scratch) {
  const int64_t BT = int64_t(b) * layout_.T;
  const std::vector<float*> k = kept_layers(const_cast<float*>(kept), BT);
  const int n = layer_count();
  std::vector<const float*> acts(std::size_t(n), scratch);
  if (layout_.spec.has_embedding) acts[0] = k[0];
  // Inside each block's and the head's backward visit (its tensors there): that layer's forward
  // again from its input, unheard by a LayerMemory (the visit is the backward's).
  At forward_at = at;
  forward_at.grads = nullptr;
  forward_at.hooks = false;
  const auto remake = [&](int l) {
    const GathersInScratch gathers(*this, scratch, b);
    std::vector<float*> one(std::size_t(n), nullptr);
    one[std::size_t(l)] = scratch;
    run_range(forward_at, l, l, nullptr, k[std::size_t(l)], targets, b, one, nullptr);
  };
  backward(at, acts, d_output, b, loss_scale, d_input, workspace, remake);
}

void CpuGptStage::embedding_backward(const At& at, const float* token_stash, const float* demb,
                                     int b, float* ws, int64_t ws_floats) const {
  const int64_t BT = int64_t(b) * layout_.T;
  const int64_t wte_size = layout_.V_t * layout_.C,
                wpe_size = layout_.spec.model.max_positions * layout_.C;
  float* dwte = at.g(layout_.wte, wte_size);
  float* dwpe = at.g(layout_.wpe, wpe_size);
  if (layout_.sp) {  // every token's gradient (ws: past dres)
    if (ws_floats < BT * layout_.C)
      throw Error("cpu stage backward: workspace too small for the embedding");
    demb = gather(demb, ws, BT);
  }
  const auto* tokens = reinterpret_cast<const std::int32_t*>(token_stash);
  // Vocabulary-parallel: this rank's vocabulary rows only; the position table (replicated) takes
  // every token's.
  const bool vp = vocab_parallel();
  cpu::embedding_backward(dwte, dwpe, demb, tokens, b, int(layout_.T), int(layout_.C),
                          vp ? std::int32_t(layout_.v_begin) : 0,
                          vp ? std::int32_t(layout_.V_t) : -1);
  if (at.grads) at.grads->layer_done(layout_.wte, layout_.wpe + wpe_size);
}

// dlogits is built in row blocks that fit the workspace; dres receives d(lnf out), then the
// final norm's backward turns it, in place, into d(head input).
void CpuGptStage::head_backward(const At& at, const HeadActs<const float>& h, int b,
                                float loss_scale, float* dres, float* ws, int64_t ws_floats) const {
  const int BT = int(b * layout_.T), C = int(layout_.C), V = int(layout_.V_t);
  const int64_t BTC = int64_t(BT) * C;
  // With SP: d(lnf out) full-width and the gathered norm output first in the workspace.
  float* dlnf = dres;
  const float* lnf = h.lnf;
  if (layout_.sp) {
    if (ws_floats < 2 * BTC) throw Error("cpu stage backward: workspace too small for the head");
    dlnf = ws;
    lnf = gather(h.lnf, ws + BTC, BT);
    ws += 2 * BTC;
    ws_floats -= 2 * BTC;
  }
  const int rows = int(std::min<int64_t>(BT, ws_floats / V));
  if (rows < 1) throw Error("cpu stage backward: workspace smaller than one row of logits");
  const auto* targets = reinterpret_cast<const std::int32_t*>(h.targets);
  float* dhead = at.g(layout_.head_w, int64_t(V) * C);
  const float* head = at.p(layout_.head_w);
  // The logits' gradient does not fit the workspace whole (a stage with the embedding, whose
  // gradient takes part of it): vocabulary column blocks over every row, so that each element of
  // the head's weight gradient is added to once (one sgemm over all rows per block; the gradient
  // sums stay bit-identical under optimizer offload, exec/cpu/kernels.hpp).
  const int cols = int(std::min<int64_t>(V, ws_floats / BT));
  const bool columns = rows < BT && cols >= 1 && !vocab_parallel() && !layout_.sp;
  if (columns) {
    for (int v0 = 0; v0 < V; v0 += cols) {
      const int nv = std::min(cols, V - v0);
      for (int r = 0; r < BT; ++r) {
        const float* p = h.probs + int64_t(r) * V + v0;
        float* d = ws + int64_t(r) * nv;
        for (int j = 0; j < nv; ++j)
          d[j] = p[j] * loss_scale;
        const int target = targets[r] - v0;
        if (target >= 0 && target < nv) d[target] -= loss_scale;
      }
      cpu::matmul_backward(dlnf, dhead + int64_t(v0) * C, nullptr, ws, lnf, head + int64_t(v0) * C,
                           BT, C, nv, v0 > 0);
    }
  }
  for (int r0 = 0; r0 < BT && !columns; r0 += rows) {
    const int n = std::min(rows, BT - r0);
    if (vocab_parallel()) {
      // (probs - onehot) * scale over this rank's rows; padded rows have probability 0.
      for (int64_t i = 0; i < int64_t(n) * V; ++i)
        ws[i] = h.probs[int64_t(r0) * V + i] * loss_scale;
      for (int k = 0; k < n; ++k) {
        const int64_t target = targets[r0 + k] - layout_.v_begin;
        if (target >= 0 && target < V) ws[int64_t(k) * V + target] -= loss_scale;
      }
    } else {
      cpu::softmax_crossentropy_backward(ws, h.probs + int64_t(r0) * V, targets + r0, loss_scale, n,
                                         V);
    }
    cpu::matmul_backward(dlnf + int64_t(r0) * C, dhead, nullptr, ws, lnf + int64_t(r0) * C, head, n,
                         C, V);
  }
  // The vocabulary shards' parts of d(lnf out) summed (SP: this rank's rows of the sum).
  if (layout_.sp)
    scatter(dlnf, dres, BT);
  else
    tp_sum(dres, BTC);
  norm_backward(dres, at.g(layout_.lnf_w, C), at.g(layout_.lnf_b, C), dres, h.x,
                at.p(layout_.lnf_w), h.mean, h.rstd, int(layout_.rows(BT)), false);
}

// dres holds d(block output) and leaves holding d(block input). Scratch: the MLP phase uses
// [dgelu (BT F/t) | dln2 (BT C)], the attention phase [dqkv (BT 3C/t) | datty (BT C/t) | dS rows],
// then [dqkv | dln1 (BT C)].
void CpuGptStage::block_backward(const At& at, int64_t base, const BlockActs<const float>& a, int b,
                                 float* dres, float* ws, int64_t ws_floats, float* core) const {
  // With t > 1 the column-parallel GEMMs' input gradients (dln2, dln1) are this rank's part,
  // summed over the TP group before the norms' backward; the row-parallel biases' gradients are
  // whole on every rank (d(out) is). With SP dres holds this rank's rows: it is gathered
  // full-width (first BT C floats of the workspace) for the row-parallel GEMMs, the norm outputs
  // gathered again for the column-parallel weight gradients, and the partial input gradients
  // reduce-scattered back to rows.
  const int BT = int(b * layout_.T), C = int(layout_.C), C_t = int(layout_.C_t),
            F_t = int(layout_.F_t), R = int(layout_.rows(BT));
  const int64_t BTC = int64_t(BT) * C, BTC_t = int64_t(BT) * C_t;
  const bool sp = layout_.sp;
  float* A = ws;  // SP: the gathered tensor, then the summed rows
  if (sp) {
    ws += BTC;
    ws_floats -= BTC;
  }
  if (ws_floats < int64_t(BT) * F_t + BTC || ws_floats < 4 * BTC_t + layout_.T ||
      ws_floats < 3 * BTC_t + BTC)
    throw Error("cpu stage backward: workspace too small for a block");
  const int64_t* r = layout_.block_rel;
  const auto w = [&](int k) { return at.p(base + r[k]); };
  const auto g = [&](int k) { return at.g(base + r[k], block_size_[k]); };
  float* dgelu = ws;
  float* dln2 = ws + int64_t(BT) * F_t;
  const float* dout = sp ? gather(dres, A, BT) : dres;
  cpu::matmul_backward(dgelu, g(fcproj_w), g(fcproj_b), dout, a.gelu, w(fcproj_w), BT, F_t, C);
  cpu::gelu_backward(dgelu, a.fc, dgelu, int64_t(BT) * F_t);
  cpu::matmul_backward(dln2, g(fc_w), g(fc_b), dgelu, sp ? gather(a.ln2, A, BT) : a.ln2, w(fc_w),
                       BT, C, F_t);
  if (sp)
    scatter(dln2, A, BT);
  else
    tp_sum(dln2, BTC);
  norm_backward(dres, g(ln2_w), g(ln2_b), sp ? A : dln2, a.resid1, w(ln2_w), a.ln2_mean, a.ln2_rstd,
                R, true);
  float* dqkv = ws;
  float* datty = ws + 3 * BTC_t;
  dout = sp ? gather(dres, A, BT) : dres;
  cpu::matmul_backward(datty, g(attproj_w), g(attproj_b), dout, a.atty, w(attproj_w), BT, C_t, C);
  // Selective: a.att is null; with `core` the probabilities are made again whole there first,
  // else a block of rows at a time inside attention_backward (the same bits either way).
  const float* att = a.att;
  if (!att && core) {
    cpu::attention_probabilities(core, a.qkv, b, int(layout_.T), C_t, int(layout_.NH_t));
    att = core;
  }
  cpu::attention_backward(dqkv, datty, a.qkv, att, ws + 4 * BTC_t, ws_floats - 4 * BTC_t, b,
                          int(layout_.T), C_t, int(layout_.NH_t));
  float* dln1 = datty;  // datty is dead once dqkv exists (C wide from there on)
  cpu::matmul_backward(dln1, g(qkv_w), g(qkv_b), dqkv, sp ? gather(a.ln1, A, BT) : a.ln1, w(qkv_w),
                       BT, C, 3 * C_t);
  if (sp)
    scatter(dln1, A, BT);
  else
    tp_sum(dln1, BTC);
  norm_backward(dres, g(ln1_w), g(ln1_b), sp ? A : dln1, a.x, w(ln1_w), a.ln1_mean, a.ln1_rstd, R,
                true);
}

}  // namespace

std::unique_ptr<StageCompute> make_cpu_stage(const StageSpec& spec) {
  // The runtime runs one thread per device: OpenBLAS must not start its own pool on top.
  openblas_set_num_threads(1);
  return std::make_unique<CpuGptStage>(spec);
}

}  // namespace pw::exec
