// The CUDA GPT stage: exec/cpu's StageCompute semantics in bf16 with fp32 accumulation, on one
// stream, with device buffers from the arena.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "exec/cuda/arena.hpp"
#include "exec/cuda/gemm.hpp"
#include "exec/gpt_layout.hpp"

namespace pw::exec::cuda {

// Buffers are device pointers sized by sizes(b), in bf16 ELEMENTS (2 bytes; elements x 2 = the
// bytes models::derive_costs gives a bf16 model). The parameter blob, its gradient blob and the
// stash have exec/cpu's layout (same slot names and offsets, fp32 statistics and int32 ids in two
// elements each), so weights copy over slot by slot. Every call only enqueues work on `stream`;
// the loss, the id checks and upload_parameters synchronise.
// Where a backward adds each layer's parameter gradients (exec/stage_compute.hpp's GradientSink
// on the device, for optimizer offload): device pointers, the layers in backward order, a layer's
// tensors asked for, added into on the stage's stream, then the layer said done (its work enqueued,
// not finished: a sink that copies the gradients out orders its copy after the stream's work).
class DeviceGradientSink {
 public:
  virtual ~DeviceGradientSink() = default;
  // Device bf16 gradients of parameters [offset, offset + size) of the layout, added into.
  virtual bf16* at(std::int64_t offset, std::int64_t size) = 0;
  // The layer whose own parameters are [begin, end) has enqueued all of its gradients.
  virtual void layer_done(std::int64_t begin, std::int64_t end) = 0;
};

// Where a call's tensors are layer by layer (offload chunks: exec/stage_compute.hpp's LayerMemory
// on the device). Layers in forward order: the embedding (first stage), the blocks, the head (last
// stage). Before a layer's forward or backward work is enqueued the stage calls begin_layer, after
// it end_layer; between the two the addresses below hold for the layer's tensors (device bf16, a
// tensor's parameters and its gradients, added into; a layer's tensors may sit in different
// places, a tensor never straddles two).
class DeviceLayerMemory {
 public:
  virtual ~DeviceLayerMemory() = default;
  virtual void begin_layer(int layer, bool backward) = 0;
  virtual void end_layer(int layer, bool backward) = 0;
  // The layout's tensor that begins at `offset` (a TensorSlot's offset).
  virtual const bf16* parameters(std::int64_t offset) = 0;
  virtual bf16* gradients(std::int64_t offset) = 0;
  // Selective recompute: where block layer `layer`'s backward re-makes its attention
  // probabilities whole (b x heads x T x T bf16, valid from its begin_layer to its end_layer;
  // attention_probabilities, then the plain attention backward over them), or null: 64 query rows
  // at a time in the workspace, as without a DeviceLayerMemory.
  virtual bf16* attention_core(int /*layer*/) { return nullptr; }
};

class CudaGptStage {
 public:
  // Takes its own blocks from `arena` (category workspace): the cuBLASLt workspace and a status
  // word (id errors, the loss).
  CudaGptStage(const StageSpec& spec, DeviceArena& arena, cudaStream_t stream,
               std::int64_t gemm_workspace_bytes = Gemm::kDefaultWorkspaceBytes);
  ~CudaGptStage();
  CudaGptStage(const CudaGptStage&) = delete;
  CudaGptStage& operator=(const CudaGptStage&) = delete;

  // Selective recompute (spec().selective): the blocks keep no attention probabilities; the
  // forward makes them a block of query rows at a time in the workspace below and each block's
  // backward makes them again (layers.hpp, attention_forward_selective), so `workspace` is needed
  // before a forward at every t.
  // Tensor parallelism (spec().t > 1, Megatron's column-/row-parallel block, vocabulary-parallel
  // embedding and cross-entropy, sequence parallelism with spec().sp; the CPU stage's rules,
  // exec/cpu/gpt_stage.cpp) and vocabulary padding: `sum` adds `count` elements (fp32 or bf16) at a
  // device address over the TP group, enqueued on the stage's stream (null with t = 1);
  // `all_gather` and `reduce_scatter` (SP) the group's equal parts of `count` bf16 elements in
  // place (TP rank k's part at k count / t; reduce_scatter leaves the sum in the caller's part);
  // `workspace` (device, `workspace_elements` bf16 elements, free while a forward or recompute
  // runs: the rank's backward workspace) holds the cross-entropy's row statistics and SP's
  // full-width rows. Needed before a forward whenever t > 1 or the vocabulary is padded.
  struct Tp {
    std::function<void(void* data, std::int64_t count, bool fp32)> sum;
    std::function<void(bf16*data, std::int64_t count)> all_gather, reduce_scatter;
    bf16* workspace = nullptr;
    std::int64_t workspace_elements = 0;
  };
  void set_tp(Tp tp) { tp_ = std::move(tp); }
  bool vocab_parallel() const { return layout_.t > 1 || layout_.V_pad != layout_.V; }

  const StageSpec& spec() const { return layout_.spec; }
  const std::vector<TensorSlot>& layout() const { return layout_.slots; }
  StageSizes sizes(int b) const { return layout_.sizes(b); }
  cudaStream_t stream() const { return stream_; }
  std::int64_t internal_bytes() const { return gemm_workspace_.bytes() + status_.bytes(); }

  // params (bf16) = host fp32 weights rounded to nearest even; master (fp32, optional) = them
  // exactly. Synchronises. Host weights come from exec/cpu's init_parameters or a checkpoint.
  void upload_parameters(const float* host, bf16* params, float* master = nullptr) const;

  // Forward of one microbatch, as StageCompute::forward. `tokens` and `targets` (b*T int32) may be
  // host or device memory: they are copied into the stash before use. First stage: `tokens`;
  // others: `input` (b,T,C). Writes `stash` (sizes().stash, or stash_recompute with `recompute`)
  // and `output` (b,T,C) unless last. The last stage writes the mean loss of the microbatch to the
  // device float `loss`, or with null to the stage's own (last_loss()). With `recompute` the layers
  // run one at a time in `scratch` (sizes().scratch).
  void forward(const bf16* params, const std::int32_t* tokens, const bf16* input,
               const std::int32_t* targets, int b, bool recompute, bf16* stash, bf16* output,
               bf16* scratch = nullptr, float* loss = nullptr);

  // Rebuilds the full stash (sizes().stash) from the one kept with recompute (the stage input).
  void recompute(const bf16* params, const std::int32_t* targets, int b, const bf16* kept,
                 bf16* full_stash);

  // Backward from the full stash, as StageCompute::backward: `d_output` (b,T,C) unless last (whose
  // loss gradient is `loss_scale` per token); ADDS parameter gradients into `grads` (bf16, the
  // params layout; every sum in fp32); writes `d_input` (b,T,C) unless first. `workspace` holds
  // sizes().workspace elements.
  void backward(const bf16* params, const bf16* full_stash, const bf16* d_output, int b,
                float loss_scale, bf16* grads, bf16* d_input, bf16* workspace);
  // The same with the gradients where `grads` says, layer by layer (the same kernels on the same
  // values: each layer's gradients equal the flat call's when its sink buffer starts at zero as
  // the flat buffer does).
  void backward(const bf16* params, const bf16* full_stash, const bf16* d_output, int b,
                float loss_scale, DeviceGradientSink& grads, bf16* d_input, bf16* workspace);

  // The same three calls layer by layer with the tensors wherever `memory` says (offload chunks):
  // the same kernels on the same values in the same order, so the results are the flat calls'.
  void forward(DeviceLayerMemory& memory, const std::int32_t* tokens, const bf16* input,
               const std::int32_t* targets, int b, bool recompute, bf16* stash, bf16* output,
               bf16* scratch = nullptr, float* loss = nullptr);
  void recompute(DeviceLayerMemory& memory, const std::int32_t* targets, int b, const bf16* kept,
                 bf16* full_stash);
  void backward(DeviceLayerMemory& memory, const bf16* full_stash, const bf16* d_output, int b,
                float loss_scale, bf16* d_input, bf16* workspace);
  // The stage's layers (DeviceLayerMemory's numbering).
  int layer_count() const {
    return (layout_.spec.has_embedding ? 1 : 0) + int(layout_.spec.blocks) +
           (layout_.spec.has_head ? 1 : 0);
  }

  // Synchronises; throws pw::InputError when a token or target id outside [0, V) was seen since
  // the last check (the device gave it a zero row and zero loss), then clears the count.
  void check_ids();
  // Synchronises and returns the loss the last forward wrote to the stage's own float (after
  // check_ids()).
  float last_loss();
  const float* loss_device() const;

 private:
  // Where the tensors are during one call: one flat blob (`params`, gradients through `grads`),
  // or layer by layer wherever `memory` says.
  struct At {
    const bf16* params = nullptr;
    DeviceGradientSink* grads = nullptr;
    DeviceLayerMemory* memory = nullptr;
    const bf16* p(std::int64_t offset) const {
      return memory ? memory->parameters(offset) : params + offset;
    }
    bf16* g(std::int64_t offset, std::int64_t size) const {
      return memory ? memory->gradients(offset) : grads->at(offset, size);
    }
    void begin(int layer, bool backward) const {
      if (memory) memory->begin_layer(layer, backward);
    }
    void end(int layer, bool backward) const {
      if (memory) memory->end_layer(layer, backward);
    }
  };
  int block_layer(std::int64_t i) const { return int(i) + (layout_.spec.has_embedding ? 1 : 0); }
  void forward(const At& at, const std::int32_t* tokens, const bf16* input,
               const std::int32_t* targets, int b, bool recompute, bf16* stash, bf16* output,
               bf16* scratch, float* loss);
  void backward(const At& at, const bf16* full_stash, const bf16* d_output, int b, float loss_scale,
                bf16* d_input, bf16* workspace);
  template <bool Const>
  struct BlockActs;
  template <bool Const>
  struct HeadActs;
  template <bool Const, class P>
  BlockActs<Const> carve_block(P base, std::int64_t BT) const;
  template <bool Const, class P>
  HeadActs<Const> carve_head(P base, std::int64_t BT) const;

  void copy(void* dst, const void* src, std::int64_t bytes) const;
  void run(const At& at, const std::int32_t* tokens, const bf16* input, const std::int32_t* targets,
           int b, bf16* acts, bool rolling, bf16* output, float* loss);
  // Block i: its tensors from `base` (its first's offset) to `end`.
  void block_forward(const At& at, std::int64_t base, const BlockActs<false>& a, int b, bf16* out);
  void head_forward(const At& at, const HeadActs<false>& h, const std::int32_t* targets, int b,
                    float* loss);
  void block_backward(const At& at, int layer, std::int64_t base, std::int64_t end,
                      const BlockActs<true>& a, int b, bf16* dres, Carver ws);
  // out = residual + (the TP group's sum of inp · weight^T) + bias: a row-parallel projection
  // (t = 1: one fused GEMM).
  void row_parallel_forward(bf16* out, const bf16* inp, const bf16* weight, const bf16* bias,
                            const bf16* residual, int N, int C_in);
  void tp_sum(void* data, std::int64_t count, bool fp32) const;
  // SP: this rank's rows of a (BT, C) activation into `full` at its place, the group's gathered
  // around them; the group's sum of `full` with this rank's rows of it into `mine`.
  const bf16* gather(const bf16* mine, bf16* full, std::int64_t BT) const;
  void scatter(bf16* full, bf16* mine, std::int64_t BT) const;
  // The forward's full-width scratch (SP): the TP workspace, at least `elements` of it.
  bf16* tp_scratch(std::int64_t elements) const;
  // Selective recompute's forward: the probabilities' blocks in the rank's workspace (free while
  // a forward runs; the SP gathers before and after the attention are dead or not yet made).
  Carver selective_scratch() const;
  // LayerNorm's backward over this rank's N rows; with SP its weight and bias gradients of those
  // rows are summed over the group (in `temp`, `temp_elements` >= 2C free elements) before they
  // are added.
  void norm_backward(bf16* dinp, bf16* dweight, bf16* dbias, const bf16* dout, const bf16* inp,
                     const bf16* weight, const float* mean, const float* rstd, int N,
                     bool accumulate, bf16* temp, std::int64_t temp_elements) const;
  void head_backward(const At& at, const HeadActs<true>& h, int b, float loss_scale, bf16* dres,
                     Carver ws);

  struct Status {
    int bad_tokens;
    int bad_targets;
    float loss;
  };

  GptLayout layout_;  // in bf16 elements
  Tp tp_;
  cudaStream_t stream_;
  DeviceBuffer gemm_workspace_, status_;
  std::unique_ptr<Gemm> gemm_;
};

}  // namespace pw::exec::cuda
