// The CUDA GPT stage (exec/cuda/gpt_stage.*) against the CPU stage on the same weights and batch:
// loss and every gradient agree within bf16 tolerances, recompute rebuilds the stash bit for bit,
// and the arena is carved, never grown, in a training loop. All need a GPU; the layout and sizes
// both stages share are tested everywhere (tests/test_gpt_layout.cpp).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "cuda_test_util.hpp"
#include "exec/cuda/gpt_stage.hpp"
#include "exec/cuda/kernels.cuh"
#include "exec/cuda/optimizer.cuh"
#include "exec/stage_compute.hpp"
#include "models/model.hpp"
#include "test_util.hpp"

namespace {

using namespace pw::testing;
using pw::exec::StageSpec;
namespace cu = pw::exec::cuda;

constexpr auto stage = pw::testing::stage_spec;

struct Split {
  const char* name;
  StageSpec spec;
};

// The whole model on one stage, and the first, a middle and the last stage of a 3-way split.
std::vector<Split> splits(const pw::models::ModelSpec& m) {
  return {{"whole", stage(m, true, 0, 3, true)},
          {"first", stage(m, true, 0, 1, false)},
          {"middle", stage(m, false, 1, 1, false)},
          {"last", stage(m, false, 2, 1, true)}};
}

// ---- on a GPU ----------------------------------------------------------------------------------

constexpr std::int64_t kArenaBytes = 1ll << 30;

struct Batch {
  int b = 2;
  Vec params;  // fp32, already bf16 values
  Ids tokens, targets;
  Vec input, d_output;
};

// The CPU stage's GPT-2 init plus N(0, 0.02) noise (so biases and norms are not exactly 0 and 1),
// rounded to bf16: both backends then hold exactly the same weights and inputs.
Batch make_batch(const pw::exec::StageCompute& cpu, int b, unsigned seed) {
  const auto& m = cpu.spec().model;
  Batch x;
  x.b = b;
  x.params.resize(std::size_t(cpu.sizes(1).parameters));
  cpu.init_parameters(x.params.data(), seed);
  const Vec noise = randn(x.params.size(), seed + 1, 0.02f);
  for (std::size_t i = 0; i < x.params.size(); ++i)
    x.params[i] += noise[i];
  round_in_place(x.params);
  const std::size_t BT = std::size_t(b * m.seq_len), BTC = BT * std::size_t(m.hidden);
  x.tokens = random_ids(BT, int(m.vocab), seed + 2);
  x.targets = random_ids(BT, int(m.vocab), seed + 3);
  x.input = randn(BTC, seed + 4);
  x.d_output = randn(BTC, seed + 5);
  return x;
}

struct Result {
  float loss = 0;
  Vec output, grads, d_input;
  std::vector<std::uint16_t> stash;  // the full stash's bits
};

float scale_of(const Batch& x, const StageSpec& s) {
  return 1.0f / float(x.b * s.model.seq_len);  // the gradient of the mean loss
}

Result run_cpu(pw::exec::StageCompute& s, const Batch& x) {
  const auto z = s.sizes(x.b);
  const StageSpec& sp = s.spec();
  Vec stash(std::size_t(z.stash)), ws(std::size_t(z.workspace));
  Result r;
  r.output.resize(std::size_t(z.output));
  r.d_input.resize(std::size_t(z.input));
  r.grads.assign(std::size_t(z.parameters), 0.0f);
  r.loss = s.forward(x.params.data(), sp.has_embedding ? x.tokens.data() : nullptr,
                     sp.has_embedding ? nullptr : x.input.data(),
                     sp.has_head ? x.targets.data() : nullptr, x.b, false, stash.data(),
                     sp.has_head ? nullptr : r.output.data());
  s.backward(x.params.data(), stash.data(), sp.has_head ? nullptr : x.d_output.data(), x.b,
             scale_of(x, sp), r.grads.data(), sp.has_embedding ? nullptr : r.d_input.data(),
             ws.data());
  return r;
}

// Forward (tokens and targets straight from host memory), recompute if asked, backward.
Result run_gpu(cu::CudaGptStage& s, DeviceArena& arena, const Batch& x, bool recompute) {
  const auto z = s.sizes(x.b);
  const StageSpec& sp = s.spec();
  const auto e = [](std::int64_t elements) { return elements * std::int64_t(sizeof(bf16)); };
  DeviceBuffer params(arena, Category::weights, e(z.parameters));
  s.upload_parameters(x.params.data(), params.as<bf16>());
  auto grads = zeros(arena, e(z.parameters), Category::gradients);
  auto kept = zeros(arena, e(recompute ? z.stash_recompute : z.stash));
  auto full = zeros(arena, e(z.stash)), scratch = zeros(arena, e(z.scratch));
  auto out = zeros(arena, e(z.output)), d_in = zeros(arena, e(z.input));
  auto ws = zeros(arena, e(z.workspace), Category::workspace);
  auto input = to_device_bf16(arena, sp.has_embedding ? Vec{} : x.input);
  auto d_out = to_device_bf16(arena, sp.has_head ? Vec{} : x.d_output);
  s.forward(params.as<bf16>(), x.tokens.data(), input.as<bf16>(), x.targets.data(), x.b, recompute,
            kept.as<bf16>(), out.as<bf16>(), scratch.as<bf16>());
  Result r;
  if (sp.has_head) r.loss = s.last_loss();
  bf16* used = kept.as<bf16>();
  if (recompute) {
    s.recompute(params.as<bf16>(), x.targets.data(), x.b, kept.as<bf16>(), full.as<bf16>());
    used = full.as<bf16>();
  }
  s.backward(params.as<bf16>(), used, d_out.as<bf16>(), x.b, scale_of(x, sp), grads.as<bf16>(),
             d_in.as<bf16>(), ws.as<bf16>());
  s.check_ids();
  r.output = from_device_bf16(out.data(), z.output);
  r.grads = from_device_bf16(grads.data(), z.parameters);
  r.d_input = from_device_bf16(d_in.data(), z.input);
  r.stash = from_device<std::uint16_t>(used, z.stash);
  return r;
}

Vec slice(const Vec& v, const pw::exec::TensorSlot& t) {
  return Vec(v.begin() + t.offset, v.begin() + t.offset + t.size);
}

// Loss within 1e-2 relative, the output, every gradient tensor and d_input within 2e-2 in
// relative error norm: bf16 storage (8 bits of mantissa) with fp32 sums, against fp32.
TEST(CudaStage, ForwardAndBackwardMatchTheCpuStage) {
  PW_SKIP_WITHOUT_GPU();
  DeviceArena arena(kArenaBytes);
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreate(&stream));
  for (const Split& sp : splits(pw::testing::gpt_tiny(3))) {
    SCOPED_TRACE(sp.name);
    auto cpu = pw::exec::make_cpu_stage(sp.spec);
    cu::CudaGptStage gpu(sp.spec, arena, stream);
    const Batch x = make_batch(*cpu, 2, 40);
    const Result want = run_cpu(*cpu, x);
    const Result got = run_gpu(gpu, arena, x, false);
    if (sp.spec.has_head) {
      EXPECT_NEAR(got.loss, want.loss, 1e-2 * std::fabs(want.loss));
    } else {
      EXPECT_LE(rel_err(got.output, want.output), 2e-2);
    }
    for (const auto& t : cpu->layout())
      EXPECT_LE(rel_err(slice(got.grads, t), slice(want.grads, t)), 2e-2) << t.name;
    if (!sp.spec.has_embedding) {
      EXPECT_LE(rel_err(got.d_input, want.d_input), 2e-2);
    }
  }
  CUDA_CHECK(cudaStreamDestroy(stream));
}

// Closer to GPT-2 124M (C 768, 12 heads, V 50257: odd, so the logits' rows are 2-byte aligned),
// T cut to 256 to keep the CPU reference quick: the last stage.
TEST(CudaStage, Gpt2SizedLastStageMatchesTheCpuStage) {
  PW_SKIP_WITHOUT_GPU();
  auto m = pw::exec::as_executed(pw::models::load_model("gpt2-124m"));
  m.seq_len = 256;
  const StageSpec sp = stage(m, false, m.layers - 1, 1, true);
  DeviceArena arena(4ll << 30);
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreate(&stream));
  {
    auto cpu = pw::exec::make_cpu_stage(sp);
    cu::CudaGptStage gpu(sp, arena, stream);
    const Batch x = make_batch(*cpu, 1, 50);
    const Result want = run_cpu(*cpu, x);
    const Result got = run_gpu(gpu, arena, x, false);
    EXPECT_NEAR(got.loss, want.loss, 1e-2 * std::fabs(want.loss));
    for (const auto& t : cpu->layout())
      EXPECT_LE(rel_err(slice(got.grads, t), slice(want.grads, t)), 2e-2) << t.name;
    EXPECT_LE(rel_err(got.d_input, want.d_input), 2e-2);
  }
  CUDA_CHECK(cudaStreamDestroy(stream));
}

// Forward with recompute keeps only the stage input; recompute() rebuilds the same stash bits as a
// forward without recompute, so the backward gives the same gradients bit for bit.
TEST(CudaStage, RecomputeRebuildsTheSameStash) {
  PW_SKIP_WITHOUT_GPU();
  DeviceArena arena(kArenaBytes);
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreate(&stream));
  auto specs = splits(pw::testing::gpt_tiny(3));
  specs.push_back({"embedding only", stage(pw::testing::gpt_tiny(3), true, 0, 0, false)});
  for (const Split& sp : specs) {
    SCOPED_TRACE(sp.name);
    auto cpu = pw::exec::make_cpu_stage(sp.spec);
    cu::CudaGptStage gpu(sp.spec, arena, stream);
    const Batch x = make_batch(*cpu, 2, 60);
    const Result plain = run_gpu(gpu, arena, x, false);
    const Result rc = run_gpu(gpu, arena, x, true);
    EXPECT_TRUE(plain.stash == rc.stash);
    EXPECT_TRUE(plain.grads == rc.grads);
    EXPECT_TRUE(plain.d_input == rc.d_input);
    // The rolling forward runs the same GEMMs at other addresses: equal up to algorithm choice.
    EXPECT_NEAR(rc.loss, plain.loss, 1e-5 * std::fabs(plain.loss));
    EXPECT_LE(rel_err(rc.output, plain.output), 1e-3);
  }
  CUDA_CHECK(cudaStreamDestroy(stream));
}

// Every tensor in a device block of its own (offload chunks place a layer's tensors in several
// chunks), the layers' hooks recorded: (layer, backward, begin) per call.
class ScatteredMemory : public cu::DeviceLayerMemory {
 public:
  ScatteredMemory(DeviceArena& arena, const cu::CudaGptStage& s, const Vec& params) {
    for (const pw::exec::TensorSlot& t : s.layout()) {
      weights_.emplace(t.offset, to_device_bf16(arena, slice(params, t), Category::weights));
      grads_.emplace(t.offset,
                     zeros(arena, t.size * std::int64_t(sizeof(bf16)), Category::gradients));
    }
  }
  void begin_layer(int layer, bool backward) override { hooks.push_back({layer, backward, true}); }
  void end_layer(int layer, bool backward) override { hooks.push_back({layer, backward, false}); }
  const bf16* parameters(std::int64_t offset) override { return weights_.at(offset).as<bf16>(); }
  bf16* gradients(std::int64_t offset) override { return grads_.at(offset).as<bf16>(); }
  // The gradients in the layout's order.
  Vec gathered(const cu::CudaGptStage& s) const {
    Vec out(std::size_t(s.sizes(1).parameters), 0.0f);
    for (const pw::exec::TensorSlot& t : s.layout()) {
      const Vec g = from_device_bf16(grads_.at(t.offset).data(), t.size);
      std::copy(g.begin(), g.end(), out.begin() + t.offset);
    }
    return out;
  }
  struct Hook {
    int layer;
    bool backward, begin;
    bool operator==(const Hook&) const = default;
  };
  std::vector<Hook> hooks;

 private:
  std::map<std::int64_t, DeviceBuffer> weights_, grads_;
};

// The stage layer by layer (offload chunks' DeviceLayerMemory) with every tensor in its own block:
// the flat call's loss, output, gradients and d_input bit for bit (the same kernels on the same
// values in the same order), with and without recompute; each layer's hooks wrap its work, forward
// ascending (recompute: again), backward descending.
TEST(CudaStage, LayerByLayerIsTheFlatCallsBits) {
  PW_SKIP_WITHOUT_GPU();
  DeviceArena arena(kArenaBytes);
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreate(&stream));
  for (const Split& sp : splits(pw::testing::gpt_tiny(3))) {
    for (bool recompute : {false, true}) {
      SCOPED_TRACE(std::string(sp.name) + (recompute ? " recompute" : ""));
      auto cpu = pw::exec::make_cpu_stage(sp.spec);
      cu::CudaGptStage gpu(sp.spec, arena, stream);
      const Batch x = make_batch(*cpu, 2, 70);
      const Result want = run_gpu(gpu, arena, x, recompute);
      const auto z = gpu.sizes(x.b);
      const auto e = [](std::int64_t elements) { return elements * std::int64_t(sizeof(bf16)); };
      ScatteredMemory memory(arena, gpu, x.params);
      auto kept = zeros(arena, e(recompute ? z.stash_recompute : z.stash));
      auto full = zeros(arena, e(z.stash)), scratch = zeros(arena, e(z.scratch));
      auto out = zeros(arena, e(z.output)), d_in = zeros(arena, e(z.input));
      auto ws = zeros(arena, e(z.workspace), Category::workspace);
      auto input = to_device_bf16(arena, sp.spec.has_embedding ? Vec{} : x.input);
      auto d_out = to_device_bf16(arena, sp.spec.has_head ? Vec{} : x.d_output);
      gpu.forward(memory, x.tokens.data(), input.as<bf16>(), x.targets.data(), x.b, recompute,
                  kept.as<bf16>(), out.as<bf16>(), scratch.as<bf16>());
      const float loss = sp.spec.has_head ? gpu.last_loss() : 0.0f;
      bf16* used = kept.as<bf16>();
      if (recompute) {
        gpu.recompute(memory, x.targets.data(), x.b, kept.as<bf16>(), full.as<bf16>());
        used = full.as<bf16>();
      }
      gpu.backward(memory, used, d_out.as<bf16>(), x.b, scale_of(x, sp.spec), d_in.as<bf16>(),
                   ws.as<bf16>());
      gpu.check_ids();
      EXPECT_EQ(loss, want.loss);
      EXPECT_TRUE(from_device_bf16(out.data(), z.output) == want.output);
      EXPECT_TRUE(memory.gathered(gpu) == want.grads);
      EXPECT_TRUE(from_device_bf16(d_in.data(), z.input) == want.d_input);
      std::vector<ScatteredMemory::Hook> hooks;
      const int layers = gpu.layer_count();
      for (int pass = 0; pass < (recompute ? 2 : 1); ++pass)
        for (int l = 0; l < layers; ++l) {
          hooks.push_back({l, false, true});
          hooks.push_back({l, false, false});
        }
      for (int l = layers - 1; l >= 0; --l) {
        hooks.push_back({l, true, true});
        hooks.push_back({l, true, false});
      }
      EXPECT_TRUE(memory.hooks == hooks);
    }
  }
  CUDA_CHECK(cudaStreamDestroy(stream));
}

// GPipe-style steps (two microbatches' stashes live, then AdamW) on one arena: every category holds
// exactly what sizes() says, the peak is the static part plus two stashes, no cudaMalloc happens
// after the arena's own, and training on a fixed batch lowers its loss.
TEST(CudaStage, ArenaHoldsTheStageSizesAndNeverMallocsInTheLoop) {
  PW_SKIP_WITHOUT_GPU();
  const auto m = pw::testing::gpt_tiny(3);
  const StageSpec sp = stage(m, true, 0, 3, true);
  const std::int64_t mallocs = DeviceArena::cuda_malloc_calls();
  DeviceArena arena(kArenaBytes);
  EXPECT_EQ(DeviceArena::cuda_malloc_calls(), mallocs + 1);
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreate(&stream));
  {
    auto cpu = pw::exec::make_cpu_stage(sp);
    cu::CudaGptStage gpu(sp, arena, stream);
    const std::int64_t internal = gpu.internal_bytes();
    EXPECT_EQ(arena.bytes(Category::workspace), internal);
    const int b = 2, micro = 2;
    const auto z = gpu.sizes(b);
    const std::int64_t P = z.parameters;
    DeviceBuffer params(arena, Category::weights, 2 * P);
    auto grads = zeros(arena, 2 * P, Category::gradients);
    auto master = zeros(arena, 4 * P, Category::optimizer),
         mom = zeros(arena, 4 * P, Category::optimizer),
         vel = zeros(arena, 4 * P, Category::optimizer);
    DeviceBuffer ws(arena, Category::workspace, 2 * z.workspace);
    const Batch x = make_batch(*cpu, b, 70);
    gpu.upload_parameters(x.params.data(), params.as<bf16>(), master.as<float>());
    EXPECT_EQ(arena.bytes(Category::weights), 2 * P);
    EXPECT_EQ(arena.bytes(Category::gradients), 2 * P);
    EXPECT_EQ(arena.bytes(Category::optimizer), 12 * P);
    EXPECT_EQ(arena.bytes(Category::workspace), 2 * z.workspace + internal);
    const std::int64_t fixed = 16 * P + 2 * z.workspace + internal;
    std::vector<float> losses;
    for (int step = 1; step <= 3; ++step) {
      std::vector<DeviceBuffer> stashes;
      float loss = 0;
      for (int k = 0; k < micro; ++k) {
        stashes.emplace_back(arena, Category::activations, 2 * z.stash);
        gpu.forward(params.as<bf16>(), x.tokens.data(), nullptr, x.targets.data(), b, false,
                    stashes.back().as<bf16>(), nullptr);
        loss += gpu.last_loss() / micro;
      }
      EXPECT_EQ(arena.bytes(Category::activations), micro * 2 * z.stash);
      for (int k = micro - 1; k >= 0; --k)
        gpu.backward(params.as<bf16>(), stashes[std::size_t(k)].as<bf16>(), nullptr, b,
                     1.0f / float(micro * b * m.seq_len), grads.as<bf16>(), nullptr, ws.as<bf16>());
      stashes.clear();
      cu::adamw_update(master.as<float>(), params.as<bf16>(), grads.as<bf16>(), mom.as<float>(),
                       vel.as<float>(), P, {.lr = 1e-2f}, step, stream);
      losses.push_back(loss);
    }
    CUDA_CHECK(cudaStreamSynchronize(stream));
    EXPECT_EQ(arena.bytes(Category::activations), 0);
    EXPECT_EQ(arena.counter().peak(), fixed + micro * 2 * z.stash);
    EXPECT_EQ(arena.counter().at_peak().activations, micro * 2 * z.stash);
    EXPECT_EQ(DeviceArena::cuda_malloc_calls(), mallocs + 1);
    EXPECT_LT(losses.back(), losses.front());
    std::cout << arena.summary() << "\n";
  }
  CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST(CudaStage, BadIdsAreReportedOnTheHost) {
  PW_SKIP_WITHOUT_GPU();
  const auto m = pw::testing::gpt_tiny(3);
  const StageSpec sp = stage(m, true, 0, 3, true);
  DeviceArena arena(kArenaBytes);
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreate(&stream));
  {
    auto cpu = pw::exec::make_cpu_stage(sp);
    cu::CudaGptStage gpu(sp, arena, stream);
    Batch x = make_batch(*cpu, 1, 80);
    x.tokens[5] = std::int32_t(m.vocab);
    x.targets[7] = -1;
    const auto z = gpu.sizes(1);
    DeviceBuffer params(arena, Category::weights, 2 * z.parameters);
    gpu.upload_parameters(x.params.data(), params.as<bf16>());
    auto stash = zeros(arena, 2 * z.stash);
    gpu.forward(params.as<bf16>(), x.tokens.data(), nullptr, x.targets.data(), 1, false,
                stash.as<bf16>(), nullptr);
    try {
      gpu.check_ids();
      FAIL() << "bad ids not reported";
    } catch (const pw::InputError& e) {
      EXPECT_NE(std::string(e.what()).find("1 token ids and 1 target ids outside [0, 256)"),
                std::string::npos)
          << e.what();
    }
    EXPECT_NO_THROW(gpu.check_ids());  // the count was cleared
  }
  CUDA_CHECK(cudaStreamDestroy(stream));
}

}  // namespace
