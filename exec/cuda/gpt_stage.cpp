// The CUDA GPT stage (exec/cuda/gpt_stage.hpp): embedding, pre-LN blocks and tied head in bf16,
// mirroring exec/cpu/gpt_stage.cpp call for call.
#include "exec/cuda/gpt_stage.hpp"

#include <algorithm>
#include <string>
#include <type_traits>

#include "exec/cuda/kernels.cuh"
#include "exec/cuda/layers.hpp"

namespace pw::exec::cuda {

using std::int64_t;

// One block's stash, in exec/cpu's order; x sits at offset 0. Statistics are fp32 in two elements.
template <bool Const>
struct CudaGptStage::BlockActs {
  using B = std::conditional_t<Const, const bf16*, bf16*>;
  using F = std::conditional_t<Const, const float*, float*>;
  B x, ln1;
  F ln1_mean, ln1_rstd;
  B qkv, att, atty, resid1, ln2;
  F ln2_mean, ln2_rstd;
  B fc, gelu;
};

// The head's stash; x sits at offset 0. targets are int32 in two elements each.
template <bool Const>
struct CudaGptStage::HeadActs {
  using B = std::conditional_t<Const, const bf16*, bf16*>;
  using F = std::conditional_t<Const, const float*, float*>;
  using I = std::conditional_t<Const, const std::int32_t*, std::int32_t*>;
  B x, lnf;
  F mean, rstd;
  B probs;
  I targets;
  F losses;
};

namespace {

// Carves consecutive tensors (counts in bf16 elements) out of a stash region.
template <class P>
struct Elements {
  P p;
  P take(int64_t n) {
    P r = p;
    p += n;
    return r;
  }
  template <class T>
  auto take_as(int64_t n) {  // n values of a 4-byte type T: 2n elements
    using Out = std::conditional_t<std::is_const_v<std::remove_pointer_t<P>>, const T*, T*>;
    return reinterpret_cast<Out>(take(2 * n));
  }
};

}  // namespace

static_assert(sizeof(float) + 2 * sizeof(int) == kCudaStatusBytes, "the status word's bytes");

CudaGptStage::CudaGptStage(const StageSpec& spec, DeviceArena& arena, cudaStream_t stream,
                           std::int64_t gemm_workspace_bytes)
    : layout_(spec, models::DType::bf16, "cuda"),  // bf16 whatever the model says
      stream_(stream),
      gemm_workspace_(arena, Category::workspace, gemm_workspace_bytes),
      status_(arena, Category::workspace, sizeof(Status)) {
  CUDA_CHECK(cudaMemsetAsync(status_.data(), 0, sizeof(Status), stream_));
  gemm_ = std::make_unique<Gemm>(stream_, gemm_workspace_.data(), gemm_workspace_.bytes());
}

CudaGptStage::~CudaGptStage() = default;

template <bool Const, class P>
CudaGptStage::BlockActs<Const> CudaGptStage::carve_block(P base, int64_t BT) const {
  // With t > 1 this rank's heads and FFN columns (C_t, F_t, NH_t; t = 1: C, F, NH).
  const int64_t C = layout_.C, C_t = layout_.C_t, F_t = layout_.F_t, T = layout_.T,
                NH_t = layout_.NH_t;
  Elements<P> c{base};
  BlockActs<Const> a;
  const int64_t R = layout_.rows(BT);  // tokens outside the TP region (SP: this rank's)
  a.x = c.take(R * C), a.ln1 = c.take(R * C);
  a.ln1_mean = c.template take_as<float>(R), a.ln1_rstd = c.template take_as<float>(R);
  // Selective recompute: no probabilities kept (the attention makes them in the workspace).
  a.qkv = c.take(BT * 3 * C_t), a.att = c.take(layout_.selective ? 0 : BT * NH_t * T),
  a.atty = c.take(BT * C_t);
  a.resid1 = c.take(R * C), a.ln2 = c.take(R * C);
  a.ln2_mean = c.template take_as<float>(R), a.ln2_rstd = c.template take_as<float>(R);
  a.fc = c.take(BT * F_t), a.gelu = c.take(BT * F_t);
  return a;
}

template <bool Const, class P>
CudaGptStage::HeadActs<Const> CudaGptStage::carve_head(P base, int64_t BT) const {
  const int64_t C = layout_.C, V = layout_.V_t;  // this rank's vocabulary rows (padded)
  Elements<P> c{base};
  HeadActs<Const> h;
  const int64_t R = layout_.rows(BT);
  h.x = c.take(R * C), h.lnf = c.take(R * C);
  h.mean = c.template take_as<float>(R), h.rstd = c.template take_as<float>(R);
  h.probs = c.take(BT * V);
  h.targets = c.template take_as<std::int32_t>(BT);
  h.losses = c.template take_as<float>(BT);
  return h;
}

void CudaGptStage::copy(void* dst, const void* src, int64_t bytes) const {
  CUDA_CHECK(cudaMemcpyAsync(dst, src, std::size_t(bytes), cudaMemcpyDefault, stream_));
}

void CudaGptStage::upload_parameters(const float* host, bf16* params, float* master) const {
  const int64_t n = layout_.parameters;
  const std::vector<bf16> rounded = to_bf16(host, n);
  copy(params, rounded.data(), n * int64_t(sizeof(bf16)));
  if (master) copy(master, host, n * int64_t(sizeof(float)));
  CUDA_CHECK(cudaStreamSynchronize(stream_));  // `rounded` dies here
}

void CudaGptStage::forward(const bf16* params, const std::int32_t* tokens, const bf16* input,
                           const std::int32_t* targets, int b, bool recompute, bf16* stash,
                           bf16* output, bf16* scratch, float* loss) {
  if (!params) throw Error("cuda stage forward: missing params");
  forward(At{params, nullptr, nullptr}, tokens, input, targets, b, recompute, stash, output,
          scratch, loss);
}

void CudaGptStage::forward(DeviceLayerMemory& memory, const std::int32_t* tokens, const bf16* input,
                           const std::int32_t* targets, int b, bool recompute, bf16* stash,
                           bf16* output, bf16* scratch, float* loss) {
  forward(At{nullptr, nullptr, &memory}, tokens, input, targets, b, recompute, stash, output,
          scratch, loss);
}

void CudaGptStage::forward(const At& at, const std::int32_t* tokens, const bf16* input,
                           const std::int32_t* targets, int b, bool recompute, bf16* stash,
                           bf16* output, bf16* scratch, float* loss) {
  const StageSpec& s = layout_.spec;
  if (b < 1 || !stash || (s.has_embedding ? !tokens : !input) || (s.has_head ? !targets : !output))
    throw Error(
        "cuda stage forward: b < 1 or missing params, stash, tokens, input, targets or "
        "output");
  if (recompute && !scratch)
    throw Error("cuda stage forward with recompute needs scratch (sizes().scratch elements)");
  if (!recompute) return run(at, tokens, input, targets, b, stash, false, output, loss);
  // Keep the stage input; the rolling run reads the device copy (tokens may be host memory).
  const int64_t BT = int64_t(b) * layout_.T;
  if (s.has_embedding)
    copy(stash, tokens, BT * int64_t(sizeof(std::int32_t)));
  else
    copy(stash, input, layout_.rows(BT) * layout_.C * int64_t(sizeof(bf16)));
  run(at, s.has_embedding ? reinterpret_cast<const std::int32_t*>(stash) : nullptr,
      s.has_embedding ? nullptr : stash, targets, b, scratch, true, output, loss);
}

void CudaGptStage::recompute(const bf16* params, const std::int32_t* targets, int b,
                             const bf16* kept, bf16* full_stash) {
  const bool first = layout_.spec.has_embedding;
  if (b < 1 || !params || !kept || !full_stash || (layout_.spec.has_head && !targets))
    throw Error("cuda stage recompute: b < 1 or missing params, kept stash, full stash or targets");
  run(At{params, nullptr, nullptr}, first ? reinterpret_cast<const std::int32_t*>(kept) : nullptr,
      first ? nullptr : kept, targets, b, full_stash, false, nullptr, nullptr);
}

void CudaGptStage::recompute(DeviceLayerMemory& memory, const std::int32_t* targets, int b,
                             const bf16* kept, bf16* full_stash) {
  const bool first = layout_.spec.has_embedding;
  if (b < 1 || !kept || !full_stash || (layout_.spec.has_head && !targets))
    throw Error("cuda stage recompute: b < 1 or missing kept stash, full stash or targets");
  run(At{nullptr, nullptr, &memory}, first ? reinterpret_cast<const std::int32_t*>(kept) : nullptr,
      first ? nullptr : kept, targets, b, full_stash, false, nullptr, nullptr);
}

// Runs the stage's layers. Without `rolling`, `acts` is the full stash and each layer writes the
// next one's input slot; with it, every layer reuses `acts` (scratch) in place and `tokens` must be
// device memory. A null `output` skips the last block's output, which no backward needs.
void CudaGptStage::run(const At& at, const std::int32_t* tokens, const bf16* input,
                       const std::int32_t* targets, int b, bf16* acts, bool rolling, bf16* output,
                       float* loss) {
  const StageSpec& s = layout_.spec;
  const int64_t BT = int64_t(b) * layout_.T, C = layout_.C;
  Status* status = status_.as<Status>();
  bf16* cur = acts;
  const bool has_layers = s.blocks > 0 || s.has_head;
  if (s.has_embedding) {
    at.begin(0, false);
    const std::int32_t* ids = tokens;
    if (!rolling) {
      copy(acts, tokens, BT * int64_t(sizeof(std::int32_t)));
      ids = reinterpret_cast<const std::int32_t*>(acts);
      cur += layout_.embedding_elements(BT);
    }
    bf16* dst = has_layers ? cur : output;
    if (dst && vocab_parallel()) {
      // This rank's vocabulary rows, zeros elsewhere, summed over the group (SP: full-width in
      // the scratch, this rank's rows of the sum into dst); then positions.
      bf16* looked = layout_.sp ? tp_scratch(BT * C) : dst;
      embedding_forward_vp(looked, ids, at.p(layout_.wte), int(layout_.v_begin), int(layout_.V_t),
                           b, int(layout_.T), int(C), int(layout_.V), &status->bad_tokens, stream_);
      if (layout_.sp)
        scatter(looked, dst, BT);
      else
        tp_sum(dst, BT * C, false);
      const int64_t rows = layout_.rows(BT);
      add_positions(dst, at.p(layout_.wpe), rows, layout_.sp ? layout_.tp * rows : 0,
                    int(layout_.T), int(C), stream_);
    } else if (dst) {
      embedding_forward(dst, ids, at.p(layout_.wte), at.p(layout_.wpe), b, int(layout_.T), int(C),
                        int(layout_.V), &status->bad_tokens, stream_);
    }
    at.end(0, false);
  } else {
    copy(cur, input, layout_.rows(BT) * C * int64_t(sizeof(bf16)));
  }
  for (int64_t i = 0; i < s.blocks; ++i) {
    bf16* next = rolling ? cur : cur + layout_.block_elements(BT);
    const bool last = i + 1 == s.blocks && !s.has_head;
    at.begin(block_layer(i), false);
    block_forward(at, layout_.block_base[std::size_t(i)], carve_block<false>(cur, BT), b,
                  last ? output : next);
    at.end(block_layer(i), false);
    cur = next;
  }
  if (s.has_head) {
    at.begin(block_layer(s.blocks), false);
    head_forward(at, carve_head<false>(cur, BT), targets, b, loss);
    at.end(block_layer(s.blocks), false);
  }
}

void CudaGptStage::tp_sum(void* data, std::int64_t count, bool fp32) const {
  if (layout_.t == 1) return;
  if (!tp_.sum) throw Error("cuda stage: t > 1 without the TP group's sum (set_tp)");
  tp_.sum(data, count, fp32);
}

bf16* CudaGptStage::tp_scratch(std::int64_t elements) const {
  if (!tp_.workspace || tp_.workspace_elements < elements)
    throw Error("cuda stage: sequence parallelism without a large enough workspace (set_tp)");
  return tp_.workspace;
}

Carver CudaGptStage::selective_scratch() const {
  if (!tp_.workspace)
    throw Error("cuda stage: selective recompute without the rank's workspace (set_tp)");
  return Carver(tp_.workspace, tp_.workspace_elements * int64_t(sizeof(bf16)),
                "cuda stage forward workspace (selective recompute)");
}

const bf16* CudaGptStage::gather(const bf16* mine, bf16* full, std::int64_t BT) const {
  if (!tp_.all_gather) throw Error("cuda stage: sequence parallelism without the TP all-gather");
  const int64_t n = layout_.rows(BT) * layout_.C;
  copy(full + layout_.tp * n, mine, n * int64_t(sizeof(bf16)));
  tp_.all_gather(full, BT * layout_.C);
  return full;
}

void CudaGptStage::scatter(bf16* full, bf16* mine, std::int64_t BT) const {
  if (!tp_.reduce_scatter)
    throw Error("cuda stage: sequence parallelism without the TP reduce-scatter");
  const int64_t n = layout_.rows(BT) * layout_.C;
  tp_.reduce_scatter(full, BT * layout_.C);
  copy(mine, full + layout_.tp * n, n * int64_t(sizeof(bf16)));
}

void CudaGptStage::norm_backward(bf16* dinp, bf16* dweight, bf16* dbias, const bf16* dout,
                                 const bf16* inp, const bf16* weight, const float* mean,
                                 const float* rstd, int N, bool accumulate, bf16* temp,
                                 std::int64_t temp_elements) const {
  const int C = int(layout_.C);
  if (!layout_.sp)
    return layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C, accumulate,
                              stream_);
  if (temp_elements < 2 * C)
    throw Error("cuda stage backward: no room for a norm's gradient sums (sequence parallelism)");
  CUDA_CHECK(cudaMemsetAsync(temp, 0, std::size_t(2 * C) * sizeof(bf16), stream_));
  layernorm_backward(dinp, temp, temp + C, dout, inp, weight, mean, rstd, N, C, accumulate,
                     stream_);
  tp_sum(temp, 2 * C, false);
  residual_add(dweight, dweight, temp, C, stream_);
  residual_add(dbias, dbias, temp + C, C, stream_);
}

void CudaGptStage::row_parallel_forward(bf16* out, const bf16* inp, const bf16* weight,
                                        const bf16* bias, const bf16* residual, int N, int C_in) {
  const int C = int(layout_.C);
  if (layout_.t == 1) return linear_forward(*gemm_, out, inp, weight, bias, residual, N, C_in, C);
  int64_t rows = N;
  if (layout_.sp) {  // the partial sums full-width in the scratch, this rank's rows summed
    bf16* full = tp_scratch(int64_t(N) * C);
    linear_forward(*gemm_, full, inp, weight, nullptr, nullptr, N, C_in, C);
    rows = layout_.rows(N);
    scatter(full, out, N);
  } else {
    linear_forward(*gemm_, out, inp, weight, nullptr, nullptr, N, C_in, C);
    tp_sum(out, int64_t(N) * C, false);
  }
  // The bias whole on every rank, added once after the sum; then the residual.
  add_bias(out, bias, rows, C, C, stream_);
  residual_add(out, out, residual, rows * C, stream_);
}

void CudaGptStage::block_forward(const At& at, int64_t base, const BlockActs<false>& a, int b,
                                 bf16* out) {
  // With t > 1: this rank's heads and FFN columns (C_t, F_t), the projections row-parallel.
  const int BT = int(b * layout_.T), C = int(layout_.C), C_t = int(layout_.C_t),
            F_t = int(layout_.F_t);
  const int64_t* r = layout_.block_rel;
  const auto w = [&](BlockTensor x) { return at.p(base + r[x]); };
  Gemm& g = *gemm_;
  // With SP the norms run on this rank's rows, gathered full-width (scratch) for the GEMMs.
  const int R = int(layout_.rows(BT));
  const auto full = [&](const bf16* mine) {
    return layout_.sp ? gather(mine, tp_scratch(int64_t(BT) * C), BT) : mine;
  };
  layernorm_forward(a.ln1, a.ln1_mean, a.ln1_rstd, a.x, w(ln1_w), w(ln1_b), R, C, stream_);
  linear_forward(g, a.qkv, full(a.ln1), w(qkv_w), w(qkv_b), nullptr, BT, C, 3 * C_t);
  if (layout_.selective)  // the probabilities a block of query rows at a time, in the workspace
    attention_forward_selective(g, a.atty, a.qkv, selective_scratch(), b, int(layout_.T), C_t,
                                int(layout_.NH_t));
  else
    attention_forward(g, a.atty, a.att, a.qkv, b, int(layout_.T), C_t, int(layout_.NH_t));
  row_parallel_forward(a.resid1, a.atty, w(attproj_w), w(attproj_b), a.x, BT, C_t);
  layernorm_forward(a.ln2, a.ln2_mean, a.ln2_rstd, a.resid1, w(ln2_w), w(ln2_b), R, C, stream_);
  linear_forward(g, a.fc, full(a.ln2), w(fc_w), w(fc_b), nullptr, BT, C, F_t);
  gelu_forward(a.gelu, a.fc, int64_t(BT) * F_t, stream_);
  // out may alias a.x (rolling): x is dead once resid1 exists.
  if (out) row_parallel_forward(out, a.gelu, w(fcproj_w), w(fcproj_b), a.resid1, BT, F_t);
}

void CudaGptStage::head_forward(const At& at, const HeadActs<false>& h, const std::int32_t* targets,
                                int b, float* loss) {
  // V: this rank's vocabulary rows (padded; t = 1 unpadded: the whole vocabulary).
  const int BT = int(b * layout_.T), C = int(layout_.C), V = int(layout_.V_t);
  Status* status = status_.as<Status>();
  layernorm_forward(h.lnf, h.mean, h.rstd, h.x, at.p(layout_.lnf_w), at.p(layout_.lnf_b),
                    int(layout_.rows(BT)), C, stream_);
  // SP: the norm's rows gathered full-width in the scratch (free again once the logits exist).
  const bf16* lnf = layout_.sp ? gather(h.lnf, tp_scratch(int64_t(BT) * C), BT) : h.lnf;
  // logits (BT, V) = lnf (BT, C) · head_w^T (C, V), into the probabilities' slot
  linear_forward(*gemm_, h.probs, lnf, at.p(layout_.head_w), nullptr, nullptr, BT, C, V);
  copy(h.targets, targets, int64_t(BT) * int64_t(sizeof(std::int32_t)));
  if (vocab_parallel()) {
    // Megatron's vocabulary-parallel cross-entropy: the row statistics in the workspace.
    const int64_t t = layout_.t;
    if (!tp_.workspace || tp_.workspace_elements * int64_t(sizeof(bf16)) <
                              int64_t(BT) * (t + 2) * int64_t(sizeof(float)))
      throw Error(
          "cuda stage: a vocabulary-parallel cross-entropy without a large enough workspace "
          "(set_tp)");
    const int valid = int(std::clamp<int64_t>(layout_.V - layout_.v_begin, 0, layout_.V_t));
    crossentropy_forward_vp(
        h.probs, h.losses, h.targets, BT, V, valid, int(t), int(layout_.tp), int(layout_.v_begin),
        int(layout_.V), reinterpret_cast<float*>(tp_.workspace),
        [this](float* data, std::int64_t n) { tp_sum(data, n, true); }, &status->bad_targets,
        stream_);
  } else {
    crossentropy_forward(h.probs, h.losses, h.targets, BT, V, &status->bad_targets, stream_);
  }
  mean_loss(loss ? loss : &status->loss, h.losses, BT, stream_);
}

namespace {
// The whole stage's gradients in one buffer, in the layout's order.
class FlatSink : public DeviceGradientSink {
 public:
  explicit FlatSink(bf16* grads) : grads_(grads) {}
  bf16* at(std::int64_t offset, std::int64_t) override { return grads_ + offset; }
  void layer_done(std::int64_t, std::int64_t) override {}

 private:
  bf16* grads_;
};
}  // namespace

void CudaGptStage::backward(const bf16* params, const bf16* full_stash, const bf16* d_output, int b,
                            float loss_scale, bf16* grads, bf16* d_input, bf16* workspace) {
  if (!grads) throw Error("cuda stage backward: missing grads");
  FlatSink sink(grads);
  backward(params, full_stash, d_output, b, loss_scale, sink, d_input, workspace);
}

void CudaGptStage::backward(const bf16* params, const bf16* full_stash, const bf16* d_output, int b,
                            float loss_scale, DeviceGradientSink& grads, bf16* d_input,
                            bf16* workspace) {
  if (!params) throw Error("cuda stage backward: missing params");
  backward(At{params, &grads, nullptr}, full_stash, d_output, b, loss_scale, d_input, workspace);
}

void CudaGptStage::backward(DeviceLayerMemory& memory, const bf16* full_stash, const bf16* d_output,
                            int b, float loss_scale, bf16* d_input, bf16* workspace) {
  backward(At{nullptr, nullptr, &memory}, full_stash, d_output, b, loss_scale, d_input, workspace);
}

// Workspace use: on the first stage the residual-stream gradient dres takes its first B*T*C
// elements (elsewhere dres is d_input); the rest is the scratch of the layers' backward.
void CudaGptStage::backward(const At& at, const bf16* full_stash, const bf16* d_output, int b,
                            float loss_scale, bf16* d_input, bf16* workspace) {
  const StageSpec& s = layout_.spec;
  // BTC: this rank's rows (SP) of the residual stream's gradient.
  const int64_t BT = int64_t(b) * layout_.T, BTC = layout_.rows(BT) * layout_.C;
  const bool has_layers = s.blocks > 0 || s.has_head;
  if (b < 1 || !full_stash || (!s.has_head && !d_output) || (!s.has_embedding && !d_input))
    throw Error("cuda stage backward: b < 1 or missing stash, d_output or d_input");
  Carver ws(workspace, sizes(b).workspace * int64_t(sizeof(bf16)), "cuda stage backward workspace");
  bf16* dres = d_input;
  if (s.has_embedding && has_layers) dres = ws.take<bf16>(BTC);
  if (!s.has_head && has_layers) copy(dres, d_output, BTC * int64_t(sizeof(bf16)));
  const bf16* cur = full_stash + (s.has_embedding ? layout_.embedding_elements(BT) : 0);
  if (s.has_head) {
    at.begin(block_layer(s.blocks), true);
    head_backward(at, carve_head<true>(cur + s.blocks * layout_.block_elements(BT), BT), b,
                  loss_scale, dres, ws);
    if (at.grads) at.grads->layer_done(layout_.lnf_w, layout_.parameters);
    at.end(block_layer(s.blocks), true);
  }
  for (int64_t i = s.blocks - 1; i >= 0; --i) {
    const int64_t base = layout_.block_base[std::size_t(i)];
    const int64_t end = i + 1 < s.blocks ? layout_.block_base[std::size_t(i + 1)]
                                         : (s.has_head ? layout_.lnf_w : layout_.parameters);
    at.begin(block_layer(i), true);
    block_backward(at, block_layer(i), base, end,
                   carve_block<true>(cur + i * layout_.block_elements(BT), BT), b, dres, ws);
    if (at.grads) at.grads->layer_done(base, end);
    at.end(block_layer(i), true);
  }
  if (s.has_embedding) {
    at.begin(0, true);
    const int64_t wte_size = layout_.V_t * layout_.C,
                  wpe_size = layout_.spec.model.max_positions * layout_.C;
    bf16* dwte = at.g(layout_.wte, wte_size);
    bf16* dwpe = at.g(layout_.wpe, wpe_size);
    // Vocabulary-parallel: this rank's rows only; the position table takes every token's (SP:
    // every token's gradient gathered past dres first).
    const bf16* demb = has_layers ? dres : d_output;
    if (layout_.sp) demb = gather(demb, ws.take<bf16>(BT * layout_.C), BT);
    embedding_backward_vp(dwte, dwpe, demb, reinterpret_cast<const std::int32_t*>(full_stash), b,
                          int(layout_.T), int(layout_.C), int(layout_.v_begin), int(layout_.V_t),
                          stream_);
    if (at.grads) at.grads->layer_done(layout_.wte, layout_.wpe + wpe_size);
    at.end(0, true);
  }
}

// dlogits is built in row blocks that fit the workspace; dres receives d(lnf out), then the final
// norm's backward turns it, in place, into d(head input).
void CudaGptStage::head_backward(const At& at, const HeadActs<true>& h, int b, float loss_scale,
                                 bf16* dres, Carver ws) {
  const int BT = int(b * layout_.T), C = int(layout_.C), V = int(layout_.V_t);
  const int64_t BTC = int64_t(BT) * C;
  // With SP: d(lnf out) full-width and the gathered norm output first in the workspace.
  bf16* dlnf = dres;
  const bf16* lnf = h.lnf;
  if (layout_.sp) {
    dlnf = ws.take<bf16>(BTC);
    lnf = gather(h.lnf, ws.take<bf16>(BTC), BT);
  }
  const int rows = int(std::min<int64_t>(BT, ws.left() / (int64_t(V) * int64_t(sizeof(bf16)))));
  if (rows < 1) throw Error("cuda stage backward: workspace smaller than one row of logits");
  bf16* dlogits = ws.take<bf16>(int64_t(rows) * V);  // (rows, V)
  bf16* dhead = at.g(layout_.head_w, int64_t(V) * C);
  for (int r0 = 0; r0 < BT; r0 += rows) {
    const int n = std::min(rows, BT - r0);
    if (vocab_parallel())
      crossentropy_backward_vp(dlogits, h.probs + int64_t(r0) * V, h.targets + r0, loss_scale, n, V,
                               int(layout_.v_begin), stream_);
    else
      crossentropy_backward(dlogits, h.probs + int64_t(r0) * V, h.targets + r0, loss_scale, n, V,
                            stream_);
    linear_backward(*gemm_, dlnf + int64_t(r0) * C, dhead, nullptr, dlogits, lnf + int64_t(r0) * C,
                    at.p(layout_.head_w), n, C, V);
  }
  // The vocabulary shards' parts of d(lnf out) summed (SP: this rank's rows of the sum).
  if (layout_.sp)
    scatter(dlnf, dres, BT);
  else
    tp_sum(dres, BTC, false);
  // dlogits is dead: the SP norm's gradient sums go there.
  norm_backward(dres, at.g(layout_.lnf_w, C), at.g(layout_.lnf_b, C), dres, h.x,
                at.p(layout_.lnf_w), h.mean, h.rstd, int(layout_.rows(BT)), false, dlogits,
                int64_t(rows) * V);
}

// dres holds d(block output) and leaves holding d(block input). Scratch: the MLP phase uses
// [dgelu (BT F) | dln2 (BT C)], the attention phase [dqkv (BT 3C) | datty (BT C) | dP, dS].
void CudaGptStage::block_backward(const At& at, int layer, int64_t base, int64_t end,
                                  const BlockActs<true>& a, int b, bf16* dres, Carver ws) {
  // With t > 1 the column-parallel GEMMs' input gradients (dln2, dln1) are this rank's part,
  // summed over the TP group before the norms' backward; the row-parallel biases' gradients are
  // whole on every rank (d(out) is).
  // With SP dres holds this rank's rows: it is gathered full-width (A, the workspace's first
  // BT C elements) for the row-parallel GEMMs, the norm outputs gathered again for the
  // column-parallel weight gradients, and the partial input gradients reduce-scattered back to
  // rows (into A) before the norms' backward, whose weight gradients are summed over the group.
  const int BT = int(b * layout_.T), C = int(layout_.C), C_t = int(layout_.C_t),
            F_t = int(layout_.F_t), R = int(layout_.rows(BT));
  const int64_t BTC = int64_t(BT) * C, BTC_t = int64_t(BT) * C_t;
  const bool sp = layout_.sp;
  const int64_t* r = layout_.block_rel;
  const auto w = [&](BlockTensor x) { return at.p(base + r[x]); };
  // The flat sink hands out the block's gradients at once (a streamed sink's one tile).
  bf16* flat = at.memory ? nullptr : at.grads->at(base, end - base);
  const auto g = [&](BlockTensor x) {
    return at.memory ? at.memory->gradients(base + r[x]) : flat + r[x];
  };
  Gemm& gm = *gemm_;
  bf16* A = sp ? ws.take<bf16>(BTC) : nullptr;
  Carver mlp = ws;
  bf16* dgelu = mlp.take<bf16>(int64_t(BT) * F_t);
  bf16* dln2 = mlp.take<bf16>(BTC);
  const bf16* dout = sp ? gather(dres, A, BT) : dres;
  linear_backward(gm, dgelu, g(fcproj_w), g(fcproj_b), dout, a.gelu, w(fcproj_w), BT, F_t, C);
  gelu_backward(dgelu, a.fc, dgelu, int64_t(BT) * F_t, stream_);
  linear_backward(gm, dln2, g(fc_w), g(fc_b), dgelu, sp ? gather(a.ln2, A, BT) : a.ln2, w(fc_w), BT,
                  C, F_t);
  if (sp)
    scatter(dln2, A, BT);
  else
    tp_sum(dln2, BTC, false);
  // dgelu is dead: the SP norm's gradient sums go there.
  norm_backward(dres, g(ln2_w), g(ln2_b), sp ? A : dln2, a.resid1, w(ln2_w), a.ln2_mean, a.ln2_rstd,
                R, true, dgelu, int64_t(BT) * F_t);
  Carver attn = ws;
  bf16* dqkv = attn.take<bf16>(3 * BTC_t);
  bf16* datty = attn.take<bf16>(BTC);  // C_t wide, then dln1 (C wide) in the same block
  dout = sp ? gather(dres, A, BT) : dres;
  linear_backward(gm, datty, g(attproj_w), g(attproj_b), dout, a.atty, w(attproj_w), BT, C_t, C);
  // Selective: the probabilities made again whole where the memory says (offload chunks, whose
  // moments count them), else each block of them beside dP and dS.
  bf16* core = layout_.selective && at.memory ? at.memory->attention_core(layer) : nullptr;
  if (core) {
    attention_probabilities(gm, core, a.qkv, b, int(layout_.T), C_t, int(layout_.NH_t));
    attention_backward(gm, dqkv, datty, a.qkv, core, attn, b, int(layout_.T), C_t,
                       int(layout_.NH_t));
  } else if (layout_.selective) {
    attention_backward_selective(gm, dqkv, datty, a.qkv, attn, b, int(layout_.T), C_t,
                                 int(layout_.NH_t));
  } else {
    attention_backward(gm, dqkv, datty, a.qkv, a.att, attn, b, int(layout_.T), C_t,
                       int(layout_.NH_t));
  }
  bf16* dln1 = datty;  // datty is dead once dqkv exists
  linear_backward(gm, dln1, g(qkv_w), g(qkv_b), dqkv, sp ? gather(a.ln1, A, BT) : a.ln1, w(qkv_w),
                  BT, C, 3 * C_t);
  if (sp)
    scatter(dln1, A, BT);
  else
    tp_sum(dln1, BTC, false);
  // dqkv is dead: the SP norm's gradient sums go there.
  norm_backward(dres, g(ln1_w), g(ln1_b), sp ? A : dln1, a.x, w(ln1_w), a.ln1_mean, a.ln1_rstd, R,
                true, dqkv, 3 * BTC_t);
}

void CudaGptStage::check_ids() {
  Status s{};
  CUDA_CHECK(cudaMemcpyAsync(&s, status_.data(), sizeof(Status), cudaMemcpyDeviceToHost, stream_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  if (s.bad_tokens == 0 && s.bad_targets == 0) return;
  CUDA_CHECK(cudaMemsetAsync(status_.data(), 0, 2 * sizeof(int), stream_));
  throw InputError("cuda stage: " + std::to_string(s.bad_tokens) + " token ids and " +
                   std::to_string(s.bad_targets) + " target ids outside [0, " +
                   std::to_string(layout_.V) + ")");
}

float CudaGptStage::last_loss() {
  check_ids();
  float loss = 0.0f;
  CUDA_CHECK(cudaMemcpyAsync(&loss, loss_device(), sizeof(float), cudaMemcpyDeviceToHost, stream_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  return loss;
}

const float* CudaGptStage::loss_device() const {
  return &status_.as<Status>()->loss;
}

}  // namespace pw::exec::cuda
