// profile_cuda: measured per-layer times and sizes on the GPU (see profile.hpp).
#include "exec/cuda/profile.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <string>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "common/error.hpp"
#include "exec/cuda/arena.hpp"
#include "exec/cuda/device.hpp"
#include "exec/cuda/gpt_stage.hpp"
#include "exec/cuda/handles.hpp"
#include "exec/cuda/optimizer.cuh"
#include "exec/cuda/probe.hpp"
#include "exec/gpu_host.hpp"
#include "exec/profile_driver.hpp"
#include "exec/stage_compute.hpp"

namespace pw::exec::cuda {

namespace {

// One single-block stage (with the embedding, the head, or neither) on `stream` and its buffers,
// all from `arena` (sizes(b) bf16 elements each, zeroed); GPT-2 initial weights, the synthetic
// corpus's first b samples. Throws DeviceMemoryError when the arena has no room.
class ProfiledStage {
 public:
  ProfiledStage(const models::ModelSpec& model, bool embedding, bool head, int b,
                DeviceArena& arena, cudaStream_t stream, const models::Sharding& sharding,
                bool selective = false)
      : embedding_(embedding),
        head_(head),
        b_(b),
        stream_(stream),
        stage_(spec_of(model, embedding, head, sharding, selective), arena, stream),
        sizes_(stage_.sizes(b)) {
    const StageSizes& z = sizes_;
    auto take = [&](std::int64_t elements, Category c) {
      return DeviceBuffer(arena, c, 2 * elements);  // bf16 elements
    };
    params_ = take(z.parameters, Category::weights);
    grads_ = take(z.parameters, Category::gradients);
    stash_ = take(z.stash, Category::activations);
    kept_ = take(z.stash_recompute, Category::activations);
    full_ = take(z.stash, Category::activations);
    out_ = take(z.output, Category::activations);
    din_ = take(z.input, Category::activations);
    dout_ = take(z.output, Category::activations);
    input_ = take(z.input, Category::activations);
    work_ = take(z.workspace, Category::workspace);
    scratch_ = take(z.scratch, Category::workspace);
    // A padded vocabulary's cross-entropy keeps its row statistics in the workspace, and so do SP's
    // gathers and a selective forward's probabilities, as in the worker. One TP rank alone: its
    // collectives do nothing (a sum of one; a gather leaves the other ranks' rows as they were),
    // so only its compute is timed, as profile_cpu times it.
    CudaGptStage::Tp tp;
    tp.workspace = work_.as<bf16>();
    tp.workspace_elements = z.workspace;
    if (sharding.t > 1) {
      tp.sum = [](void*, std::int64_t, bool) {};
      tp.all_gather = tp.reduce_scatter = [](bf16*, std::int64_t) {};
    }
    stage_.set_tp(std::move(tp));
    const profiling::Batch batch = profiling::synthetic_batch(model, b);
    const auto id_bytes = std::int64_t(batch.tokens.size() * sizeof(std::int32_t));
    tokens_ = DeviceBuffer(arena, Category::activations, id_bytes);
    targets_ = DeviceBuffer(arena, Category::activations, id_bytes);
    for (const DeviceBuffer* x :
         {&grads_, &stash_, &kept_, &full_, &out_, &din_, &dout_, &input_, &work_, &scratch_})
      if (x->bytes() > 0)
        CUDA_CHECK(cudaMemsetAsync(x->data(), 0, std::size_t(x->bytes()), stream));
    CUDA_CHECK(cudaMemcpyAsync(tokens_.data(), batch.tokens.data(), std::size_t(id_bytes),
                               cudaMemcpyHostToDevice, stream));
    CUDA_CHECK(cudaMemcpyAsync(targets_.data(), batch.targets.data(), std::size_t(id_bytes),
                               cudaMemcpyHostToDevice, stream));
    // The CPU stage's initial weights (the same tensors as in training), rounded to bf16.
    std::vector<float> host(std::size_t(z.parameters));
    make_cpu_stage(stage_.spec())->init_parameters(host.data(), 1);
    stage_.upload_parameters(host.data(), params_.as<bf16>());  // synchronises the stream
  }

  const DeviceBuffer& output() const { return out_; }
  const DeviceBuffer& d_input() const { return din_; }
  void feed(const DeviceBuffer& x) { copy_into(input_, x); }
  void feed_gradient(const DeviceBuffer& g) { copy_into(dout_, g); }
  // What the recompute reads: the stage input kept by a forward with recomputation.
  void keep() {
    stage_.forward(params(), tok(), in(), tgt(), b_, true, kept_.as<bf16>(), out(),
                   scratch_.as<bf16>());
  }
  void forward() {
    stage_.forward(params(), tok(), in(), tgt(), b_, false, stash_.as<bf16>(), out());
  }
  void backward() {
    stage_.backward(params(), stash_.as<bf16>(), head_ ? nullptr : dout_.as<bf16>(), b_, 1e-3f,
                    grads_.as<bf16>(), embedding_ ? nullptr : din_.as<bf16>(), work_.as<bf16>());
  }
  void recompute() { stage_.recompute(params(), tgt(), b_, kept_.as<bf16>(), full_.as<bf16>()); }
  // Out-of-range ids would have been zero rows and zero losses: a broken profile, not a slow one.
  void check_ids() { stage_.check_ids(); }

 private:
  static StageSpec spec_of(const models::ModelSpec& model, bool embedding, bool head,
                           const models::Sharding& sharding, bool selective) {
    StageSpec spec = profiling::single_block_stage(model, embedding, head, sharding);
    spec.selective = selective;
    return spec;
  }
  void copy_into(const DeviceBuffer& dst, const DeviceBuffer& src) const {
    if (dst.bytes() != src.bytes())
      throw Error(fmt::format("profile: a {}-byte activation fed to a {}-byte buffer", src.bytes(),
                              dst.bytes()));
    if (dst.bytes() > 0)
      CUDA_CHECK(cudaMemcpyAsync(dst.data(), src.data(), std::size_t(dst.bytes()),
                                 cudaMemcpyDeviceToDevice, stream_));
  }
  const bf16* params() const { return params_.as<bf16>(); }
  const std::int32_t* tok() const { return embedding_ ? tokens_.as<std::int32_t>() : nullptr; }
  const bf16* in() const { return embedding_ ? nullptr : input_.as<bf16>(); }
  const std::int32_t* tgt() const { return head_ ? targets_.as<std::int32_t>() : nullptr; }
  bf16* out() const { return head_ ? nullptr : out_.as<bf16>(); }

  bool embedding_, head_;
  int b_;
  cudaStream_t stream_;
  CudaGptStage stage_;
  StageSizes sizes_;
  DeviceBuffer params_, grads_, stash_, kept_, full_, out_, din_, dout_, input_, work_, scratch_,
      tokens_, targets_;
};

// The lone block, embedding + block and block + head, timed round-robin with CUDA events; with
// `selective` (else -1 there) the extra time of a selective block's backward over the plain one's.
std::array<profiling::StageTimes, 3> time_stages(const models::ModelSpec& model, int b, int repeats,
                                                 ProfileStatistic statistic, DeviceArena& arena,
                                                 cudaStream_t stream,
                                                 const models::Sharding& sharding, bool selective,
                                                 double& selective_s) {
  ProfiledStage block(model, false, false, b, arena, stream, sharding),
      embedding(model, true, false, b, arena, stream, sharding),
      head(model, false, true, b, arena, stream, sharding);
  EventTimer timer(stream);
  // Two seconds of warm-up before the first timed run. On an H100 (2026-11-24, docs/performance.md,
  // "On a GPU") one round of warm-up left a block's forward at b = 4 anywhere from 440 to 780 us
  // between processes; runs that had first kept the GPU busy for 2 s all gave 432 to 441 us. Why
  // (GPU clocks leaving idle, the host's launch speed) is not established.
  const auto times = profiling::time_round_robin(
      block, embedding, head, repeats, statistic, [&](const auto& op) { return timer.seconds(op); },
      2.0);
  embedding.check_ids();
  head.check_ids();
  selective_s = -1;
  if (!selective) return times;
  // As profile_cpu: the same input and output gradient as the plain block (the softmax's time
  // depends on the values); pairs alternate, so a slow spell of the GPU falls on both.
  ProfiledStage sel(model, false, false, b, arena, stream, sharding, true);
  sel.feed(embedding.output());
  sel.feed_gradient(head.d_input());
  std::vector<double> extra;
  for (int i = 0; i <= repeats; ++i) {  // the first pair warms the selective stage up
    block.forward();
    const double plain = timer.seconds([&] { block.backward(); });
    sel.forward();
    const double again = timer.seconds([&] { sel.backward(); });
    if (i > 0) extra.push_back(again - plain);
  }
  selective_s = std::max(0.0, profiling::summarize(extra, statistic));
  return times;
}

// AdamW over `parameters` (fp32 master, m, v; bf16 weights and gradients), timed with events.
double optimizer_time(std::int64_t parameters, int repeats, ProfileStatistic statistic,
                      DeviceArena& arena, cudaStream_t stream) {
  if (parameters == 0) return 0;
  const std::int64_t n = parameters;
  DeviceBuffer master(arena, Category::optimizer, 4 * n), m(arena, Category::optimizer, 4 * n),
      v(arena, Category::optimizer, 4 * n), w(arena, Category::weights, 2 * n),
      g(arena, Category::gradients, 2 * n);
  for (const DeviceBuffer* x : {&master, &m, &v, &w, &g})
    CUDA_CHECK(cudaMemsetAsync(x->data(), 0, std::size_t(x->bytes()), stream));
  EventTimer timer(stream);
  const AdamWParams p;
  int step = 1;
  const auto update = [&] {
    adamw_update(master.as<float>(), w.as<bf16>(), g.as<bf16>(), m.as<float>(), v.as<float>(), n, p,
                 step++, stream);
  };
  timer.seconds(update);  // warm-up
  std::vector<double> t;
  for (int i = 0; i < repeats; ++i)
    t.push_back(timer.seconds(update));
  return profiling::summarize(t, statistic);
}

// The arena: the device's free memory less a reserve for what lives outside it (cuBLASLt's handles,
// the CUDA context's growth, kernels' local memory).
std::string gib(std::int64_t bytes) {
  return fmt::format("{:.1f} GiB", double(bytes) / double(std::int64_t(1) << 30));
}

}  // namespace

traces::Trace profile_cuda(const models::ModelSpec& model,
                           const std::vector<std::int64_t>& microbatch_sizes, int repeats,
                           ProfileStatistic statistic, const models::Sharding& sharding,
                           bool selective) {
  check_gpu_model(model);
  if (repeats < 1) throw InputError("profile: --repeats must be at least 1");
  const std::vector<std::int64_t> sizes = profiling::distinct_sorted(microbatch_sizes);
  if (sizes.empty() || sizes.front() < 1)
    throw InputError("profile: microbatch sizes must be at least 1");
  // The model's shape is checked (GPT-2 style, even seq_len) before anything touches the GPU.
  const models::ModelCosts mc = models::derive_costs(model, sharding);  // t against the model
  for (const bool head : {false, true})
    (void)exec::GptLayout(profiling::single_block_stage(model, !head, head, sharding),
                          models::DType::bf16, "cuda");
  const GpuInfo gpu = current_gpu();  // mc: 2-byte sizes, the stages' own

  const std::int64_t capacity = default_arena_bytes();
  if (capacity < (std::int64_t(64) << 20))
    throw InputError(
        fmt::format("profile: {} has only {} free beyond its reserve (another process?)", gpu.name,
                    gib(capacity)));
  DeviceArena arena(capacity);
  const Stream stream;
  traces::Trace t = profiling::measured_trace(
      model, gpu.name, model.dtype, gpu.name, gpu.versions,
      fmt::format(
          "pipewright {} profile --backend cuda{}{} (bf16, {} of {} round-robin runs, CUDA "
          "events)",
          PW_VERSION,
          sharding.t > 1 ? fmt::format(" --tp {}{}", sharding.t, sharding.sp ? " --sp" : "") : "",
          selective ? " --selective" : "", profiling::statistic_name(statistic), repeats),
      2,
      [&](std::int64_t parameters) {
        try {
          return optimizer_time(parameters, repeats, statistic, arena, stream.get());
        } catch (const DeviceMemoryError& e) {
          throw InputError(
              fmt::format("profile: AdamW over {} parameters does not fit in {}'s {} arena: {}",
                          parameters, gpu.name, gib(capacity), e.what()));
        }
      },
      sharding);
  std::string last_error;
  for (std::int64_t b : sizes) {
    try {
      double selective_s = -1;
      const auto times = time_stages(model, int(b), repeats, statistic, arena, stream.get(),
                                     sharding, selective, selective_s);
      t.entries.push_back(profiling::measured_entry(mc, b, times, selective_s));
    } catch (const DeviceMemoryError& e) {
      // Every block is back in the arena (the buffers are gone); let the work queued before the
      // failure finish before the next size reuses the memory.
      CUDA_CHECK(cudaStreamSynchronize(stream.get()));
      last_error = e.what();
      fmt::print(stderr, "note: profile: microbatch size {} skipped: it does not fit on {} ({})\n",
                 b, gpu.name, last_error);
      std::fflush(stderr);
    }
  }
  if (t.entries.empty())
    throw InputError(fmt::format("profile: no microbatch size of {} fits on {} ({} arena): {}",
                                 fmt::join(sizes, ","), gpu.name, gib(capacity), last_error));
  return t;
}

}  // namespace pw::exec::cuda
