// The backend interface: forward, recompute and backward of one pipeline stage's layers for one
// microbatch. exec/cpu implements it with OpenBLAS in fp32; exec/cuda will implement it too.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "models/model.hpp"

namespace pw::exec {

// The layers one stage (one model chunk) holds: the embedding on the first, blocks
// [first_block, first_block + blocks), the final norm and LM head on the last.
struct StageSpec {
  models::ModelSpec model;
  bool has_embedding = false;
  std::int64_t first_block = 0;
  std::int64_t blocks = 0;
  bool has_head = false;
  // Megatron tensor parallelism: this stage is TP rank `tp_rank` of `t` (heads, FFN and the padded
  // vocabulary split; LayerNorms and the row-parallel biases replicated). t = 1: the whole layer.
  int t = 1;
  int tp_rank = 0;
  // Megatron's sequence parallelism (t > 1): outside the TP region (norms, residuals, the stage's
  // input and output) each TP rank holds 1/t of the microbatch's b*T tokens, rows
  // [tp_rank * bT/t, (tp_rank + 1) * bT/t); all-gathers before the column-parallel GEMMs and
  // reduce-scatters after the row-parallel ones replace the all-reduces.
  bool sp = false;
  // Selective recomputation (Korthikanti et al. 2022; plan recompute "selective"): the blocks keep
  // no attention probabilities; each block's backward makes them again from q and k (the same
  // bits). The forward makes them a block of rows at a time in the TpComm scratch (the rank's
  // workspace, free while it runs). CPU stage only.
  bool selective = false;
};

// The TP group's collectives over n floats in place (every member calls them in the same order
// with the same n; bit-identical results on every member). Only used when StageSpec::t > 1 (the
// scratch also with StageSpec::selective).
struct TpComm {
  std::function<void(float* data, std::int64_t n)> all_reduce;  // sum
  // data: t equal parts in group order. all_gather: every member's part to every member;
  // reduce_scatter: the caller's part becomes the sum of every member's part (the rest unchanged).
  std::function<void(float*data, std::int64_t n)> all_gather, reduce_scatter;
  // Sequence parallelism: where forward and recompute gather full-width activations
  // (sizes().workspace floats: the rank's backward workspace, free while they run); selective
  // recompute: where the forward makes the attention probabilities (after the gathers' rows).
  float* scratch = nullptr;
  std::int64_t scratch_floats = 0;
};

// A named tensor inside a stage's parameter blob (and, at the same offset, its gradient blob).
struct TensorSlot {
  std::string name;  // "wte", "wpe", "h3.ln1_w", "h3.qkv_w", ..., "lnf_w", "lm_head" (tied copy)
  std::int64_t offset = 0;
  std::int64_t size = 0;  // elements (floats here; bf16 elements in exec/cuda)
};

// Sizes in elements for a microbatch of b samples: floats (4 bytes) here, bf16 elements (2 bytes)
// in exec/cuda's stage. These equal models::derive_costs() x b
// for the stage's layers in fp32 exactly: the executor allocates what the planner predicts.
struct StageSizes {
  std::int64_t parameters = 0;
  std::int64_t stash = 0;            // kept from forward to backward without recompute
  std::int64_t stash_recompute = 0;  // kept with recompute (the stage input)
  std::int64_t output = 0;           // activation sent to the next stage (0 on the last stage)
  std::int64_t input = 0;            // activation received (0 on the first stage: token ids)
  std::int64_t workspace = 0;        // scratch the backward may use
  std::int64_t scratch = 0;          // transient activations of forward with recompute: the largest
                                     // layer's stash (the layers run one at a time in it)
};

// Where a backward adds parameter gradients, layer by layer ("tiles": the embedding, each block,
// the final norm with the head), for a runtime that moves each layer's gradients off the device
// as soon as they are complete (optimizer offload, docs/formulas.md section 9). The layers come in
// backward order; a layer asks for its tensors' gradients, adds into them, then says it is done.
class GradientSink {
 public:
  virtual ~GradientSink() = default;
  // Where the gradients of parameters [offset, offset + size) of the layout are (size floats, added
  // into).
  virtual float* at(std::int64_t offset, std::int64_t size) = 0;
  // The layer whose own parameters are [begin, end) has added all of its gradients.
  virtual void layer_done(std::int64_t begin, std::int64_t end) = 0;
};

// A stage whose parameters and gradients live in pieces that move between its layers (offload
// chunks, PatrickStar; docs/formulas.md section 9, chunks): before each layer of a forward or
// backward the runtime runs that moment's copies, then says where the layer's tensors are. Layers
// are the stage's own, in forward order: the embedding (if it has one), each block, the head
// (final norm and LM head, if it has one); a forward visits them ascending, a backward descending.
class LayerMemory {
 public:
  virtual ~LayerMemory() = default;
  // Layer `layer` is about to run its forward (backward false) or backward: from here to its
  // end_layer the addresses below hold for its tensors.
  virtual void begin_layer(int layer, bool backward) = 0;
  virtual void end_layer(int layer, bool backward) = 0;
  // The parameters of the layout's tensor that begins at `offset` (a TensorSlot's offset), and
  // its gradients (added into, as a backward adds into `grads`).
  virtual const float* parameters(std::int64_t offset) = 0;
  virtual float* gradients(std::int64_t offset) = 0;
  // Selective recompute: where block layer `layer`'s backward re-makes its attention probabilities
  // whole (b x heads x T x T elements, valid from its begin_layer to its end_layer), or null: a
  // block of 64 rows at a time in the workspace, as without a LayerMemory (the same bits).
  virtual float* attention_core(int /*layer*/) { return nullptr; }
};

// A stage mixing swapped and recomputed blocks (activation offload per layer, KARMA;
// docs/formulas.md section 9, per-layer choices): `recomputed` has one flag per block of the stage
// (forward order); the embedding goes with the first block, the head with the last. Its stash is
// in two pieces: the swapped layers' (the rest's stash, in forward order: what the copies move)
// and the recomputed layers' (re-made before the backward), and it keeps one checkpoint per run of
// consecutive recomputed blocks (the run's input: the token ids or the stage input for a run that
// starts at the first block, the block's input otherwise). Sizes in elements for b samples; they
// equal planner::ChunkCost's swap_bytes, layers_recompute_bytes and checkpoint_bytes.
struct MixedSizes {
  std::int64_t swapped = 0;      // the swapped layers' stash, kept from forward to backward
  std::int64_t checkpoints = 0;  // the runs' inputs, kept from forward to backward
  std::int64_t remade = 0;       // the recomputed layers' stash, from the recompute to the backward
  std::int64_t scratch = 0;      // the forward runs the recomputed layers in it: the largest one's
};

class StageCompute {
 public:
  virtual ~StageCompute() = default;
  virtual const StageSpec& spec() const = 0;
  virtual const std::vector<TensorSlot>& layout() const = 0;
  virtual StageSizes sizes(int b) const = 0;
  // The TP group's collectives (needed before forward when spec().t > 1). Backends without tensor
  // parallelism refuse t > 1 when they are built and ignore this.
  virtual void set_tp(TpComm) {}

  // GPT-2 initialisation (normal(0, 0.02), residual projections scaled by 1/sqrt(2L), norms at
  // 1/0), deterministic in (seed, tensor name, element of the whole tensor): the same tensor gets
  // the same values on every stage split, and a TP shard is the slice of the t = 1 tensor it
  // holds, so a d-stage, t-way run starts from the single-device weights. The last stage's tied
  // LM head copy gets the token embedding's values.
  virtual void init_parameters(float* params, std::uint64_t seed) const = 0;

  // Forward of one microbatch. First stage: `tokens` (b*T ids); other stages: `input` (b,T,C).
  // Writes `stash` (sizes().stash floats, or stash_recompute with `recompute`), and `output`
  // (b,T,C) unless last. The last stage reads `targets` (b*T) and returns the mean cross-entropy
  // of the microbatch; other stages return 0. With `recompute` the layers' activations live only
  // in `scratch` (sizes().scratch floats, free again when forward returns); without, it is unused
  // and may be null.
  virtual float forward(const float* params, const std::int32_t* tokens, const float* input,
                        const std::int32_t* targets, int b, bool recompute, float* stash,
                        float* output, float* scratch = nullptr) = 0;

  // Rebuilds the full stash (sizes().stash floats) from the stash kept with recompute.
  virtual void recompute(const float* params, const std::int32_t* tokens,
                         const std::int32_t* targets, int b, const float* kept,
                         float* full_stash) = 0;

  // Backward of one microbatch from the full stash. `d_output` (b,T,C) is the gradient of the
  // stage output (ignored on the last stage, whose loss gradient is `loss_scale` per token: the
  // runtime passes 1 / (tokens in the global batch) so summed gradients are those of the mean
  // loss). Adds parameter gradients into `grads` (same layout as params) and writes `d_input`
  // (b,T,C) unless first. `workspace` has sizes().workspace floats.
  virtual void backward(const float* params, const float* full_stash, const float* d_output, int b,
                        float loss_scale, float* grads, float* d_input, float* workspace) = 0;
  // The same with the gradients where `grads` says, layer by layer (bit-identical sums). Backends
  // that do not stream gradients refuse it (Error).
  virtual void backward(const float* params, const float* full_stash, const float* d_output, int b,
                        float loss_scale, GradientSink& grads, float* d_input, float* workspace);
  // Forward, recompute and backward with the tensors where `memory` says, layer by layer (the same
  // arithmetic as the calls above, so the same bits). Backends that do not run layer by layer
  // refuse them (Error).
  virtual float forward(LayerMemory& memory, const std::int32_t* tokens, const float* input,
                        const std::int32_t* targets, int b, bool recompute, float* stash,
                        float* output, float* scratch);
  virtual void recompute(LayerMemory& memory, const std::int32_t* targets, int b, const float* kept,
                         float* full_stash);
  virtual void backward(LayerMemory& memory, const float* full_stash, const float* d_output, int b,
                        float loss_scale, float* d_input, float* workspace);

  // A stage mixing swapped and recomputed blocks (MixedSizes). Backends that do not run one refuse
  // these (Error). forward_mixed: as forward, its swapped layers' stash into `swapped`, the runs'
  // inputs into `checkpoints`, the recomputed layers through `scratch` (free again when it
  // returns). recompute_mixed: the recomputed layers' stash from the checkpoints into `remade`.
  // backward_mixed: as backward, each layer's stash from `swapped` or `remade`; gradients into
  // `grads`, or layer by layer into `sink` when it is not null. The same arithmetic as without
  // offload, so the same bits.
  virtual MixedSizes mixed_sizes(int b, const std::vector<bool>& recomputed) const;
  virtual float forward_mixed(const float* params, const std::int32_t* tokens, const float* input,
                              const std::int32_t* targets, int b,
                              const std::vector<bool>& recomputed, float* swapped,
                              float* checkpoints, float* output, float* scratch);
  virtual void recompute_mixed(const float* params, const std::int32_t* targets, int b,
                               const std::vector<bool>& recomputed, const float* checkpoints,
                               float* remade);
  virtual void backward_mixed(const float* params, const std::vector<bool>& recomputed,
                              const float* swapped, const float* remade, const float* d_output,
                              int b, float loss_scale, float* grads, GradientSink* sink,
                              float* d_input, float* workspace);

  // Block recompute (Korthikanti et al.'s full recomputation; docs/formulas.md section 4): a
  // forward keeps every layer's input in `kept` (layer_inputs(b) elements: the token ids on the
  // first stage, each block's and the head's input), running the layers through `scratch`
  // (blocks_scratch(b) elements: sizes().scratch, and with SP the full-width rows the layers'
  // all-gathers fill, which must not be the workspace a backward is using); a backward re-makes
  // each layer alone from its input into `scratch`, then runs that layer's backward (the same
  // arithmetic as forward and backward, so the same bits).
  // Gradients into `grads`, or layer by layer into `sink` when it is not null. Backends that do
  // not run it refuse these (Error).
  virtual std::int64_t layer_inputs(int b) const;
  virtual std::int64_t blocks_scratch(int b) const;
  virtual float forward_blocks(const float* params, const std::int32_t* tokens, const float* input,
                               const std::int32_t* targets, int b, float* kept, float* output,
                               float* scratch);
  virtual void backward_blocks(const float* params, const float* kept, const std::int32_t* targets,
                               const float* d_output, int b, float loss_scale, float* grads,
                               GradientSink* sink, float* d_input, float* workspace,
                               float* scratch);
  // The same with the tensors where `memory` says, layer by layer (offload chunks): the forward
  // visits each layer once (begin_layer(l, false)); the backward visits each layer once
  // (begin_layer(l, true)) and re-makes it inside that visit, with its chunks already there.
  virtual float forward_blocks(LayerMemory& memory, const std::int32_t* tokens, const float* input,
                               const std::int32_t* targets, int b, float* kept, float* output,
                               float* scratch);
  virtual void backward_blocks(LayerMemory& memory, const float* kept, const std::int32_t* targets,
                               const float* d_output, int b, float loss_scale, float* d_input,
                               float* workspace, float* scratch);
};

std::unique_ptr<StageCompute> make_cpu_stage(const StageSpec& spec);

}  // namespace pw::exec
