// The CUDA kernels, GEMM layers and arena carving against exec/cpu on random data (bf16 inputs
// shared by both sides, so only the GPU's arithmetic differs). GPU tests skip without a device;
// the probe, error and carving tests run everywhere.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "cuda_test_util.hpp"
#include "exec/cpu/kernels.hpp"
#include "exec/cuda/arena.hpp"
#include "exec/cuda/device.hpp"
#include "exec/cuda/gemm.hpp"
#include "exec/cuda/kernels.cuh"
#include "exec/cuda/layers.hpp"
#include "exec/cuda/optimizer.cuh"
#include "exec/optimizer.hpp"
#include "exec/runtime.hpp"

namespace {

using namespace pw::testing;
namespace cpu = pw::exec::cpu;
namespace cu = pw::exec::cuda;
using cu::OffsetAllocator;

constexpr std::int64_t kArenaBytes = 256ll << 20;

// ---- without a GPU -----------------------------------------------------------------------------

TEST(CudaDevice, ProbeTreatsAnyErrorAsNoDevice) {
  const cu::DeviceProbe p = cu::probe_devices();
  EXPECT_EQ(p.count, cu::cuda_device_count());
  if (p.count == 0) {
    EXPECT_NE(p.error.find("cudaGetDeviceCount"), std::string::npos) << p.error;
    EXPECT_EQ(cu::no_device_reason().rfind("no CUDA device (cudaGetDeviceCount", 0), 0u)
        << cu::no_device_reason();
  } else {
    EXPECT_EQ(cu::no_device_reason(), "");
  }
}

TEST(CudaDevice, ChecksThrowOneLineErrorsWithPlaceAndOp) {
  std::string msg;
  try {
    CUDA_CHECK(cudaErrorInvalidValue);
  } catch (const pw::Error& e) {
    msg = e.what();
  }
  EXPECT_EQ(msg.rfind("tests/test_cuda_kernels.cpp:", 0), 0u) << msg;
  EXPECT_NE(msg.find("cudaErrorInvalidValue failed: cudaErrorInvalidValue: "), std::string::npos)
      << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  msg.clear();
  try {
    CUBLAS_CHECK(CUBLAS_STATUS_NOT_SUPPORTED);
  } catch (const pw::Error& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("CUBLAS_STATUS_NOT_SUPPORTED"), std::string::npos) << msg;
}

TEST(CudaDevice, HostBf16RoundsToNearestEven) {
  // 1 + 2^-8 lies halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1).
  EXPECT_EQ(cu::round_to_bf16(1.0f + 0x1p-8f), 1.0f);
  EXPECT_EQ(cu::round_to_bf16(1.0f + 3 * 0x1p-8f), 1.0f + 0x1p-6f);
  EXPECT_EQ(cu::round_to_bf16(-2.5f), -2.5f);
}

// First fit, 256-byte blocks, and coalescing with both neighbours on release.
TEST(CudaArena, OffsetAllocatorCarvesFirstFitAndCoalesces) {
  OffsetAllocator a(4096 + 100);  // the capacity rounds down to whole blocks
  EXPECT_EQ(a.capacity(), 4096);
  const auto x = a.allocate(1), y = a.allocate(257), z = a.allocate(256);
  EXPECT_EQ(x, 0);
  EXPECT_EQ(y, 256);
  EXPECT_EQ(z, 768);
  EXPECT_EQ(a.used(), 1024);
  EXPECT_EQ(a.allocate(0), 0);  // not a block
  EXPECT_EQ(a.live_blocks(), 3u);
  EXPECT_EQ(a.allocate(4096), -1);
  EXPECT_EQ(a.release(x), 256);
  EXPECT_EQ(a.allocate(200), 0);  // first fit reuses the hole at the front
  EXPECT_EQ(a.release(0), 256);
  EXPECT_EQ(a.release(z), 256);  // merges with the free tail
  EXPECT_EQ(a.free_blocks(), 2u);
  EXPECT_EQ(a.release(y), 512);  // merges with both neighbours
  EXPECT_EQ(a.free_blocks(), 1u);
  EXPECT_EQ(a.largest_free(), 4096);
  EXPECT_EQ(a.used(), 0);
  EXPECT_THROW(a.release(y), pw::Error);
}

TEST(CudaArena, OffsetAllocatorReusesFreedSpaceWithoutGrowing) {
  OffsetAllocator a(1 << 20);
  for (int step = 0; step < 100; ++step) {
    std::vector<std::int64_t> live;
    for (int k = 1; k <= 8; ++k)
      live.push_back(a.allocate(k * 1000 + step));
    for (std::size_t i = 0; i < live.size(); i += 2)
      a.release(live[i]);
    for (std::size_t i = 1; i < live.size(); i += 2)
      a.release(live[i]);
    ASSERT_EQ(a.free_blocks(), 1u) << "step " << step;
  }
}

// ---- on a GPU ----------------------------------------------------------------------------------

TEST(CudaArena, OneCudaMallocAndBytesByCategory) {
  PW_SKIP_WITHOUT_GPU();
  const auto before = DeviceArena::cuda_malloc_calls();
  DeviceArena arena(64 << 20);
  EXPECT_EQ(DeviceArena::cuda_malloc_calls(), before + 1);
  {
    DeviceBuffer w(arena, Category::weights, 1000), g(arena, Category::gradients, 3000);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(g.data()) % 256, 0u);
    EXPECT_EQ(arena.bytes(Category::weights), 1000);
    EXPECT_EQ(arena.bytes(Category::gradients), 3000);
    EXPECT_EQ(arena.reserved_bytes(), 1024 + 3072);
    EXPECT_EQ(arena.counter().current(), 4000);
    for (int i = 0; i < 50; ++i)
      DeviceBuffer a(arena, Category::activations, 1 << 20);
  }
  EXPECT_EQ(arena.reserved_bytes(), 0);
  EXPECT_EQ(arena.counter().peak(), 4000 + (1 << 20));
  EXPECT_EQ(arena.peak_reserved_bytes(), 4096 + (1 << 20));
  EXPECT_THROW(DeviceBuffer(arena, Category::activations, 65 << 20), pw::Error);
  EXPECT_EQ(DeviceArena::cuda_malloc_calls(), before + 1);
  const std::string s = arena.summary();
  EXPECT_NE(s.find("driver:"), std::string::npos) << s;
  const auto info = cu::device_memory_info();
  EXPECT_GT(info.total_bytes, info.free_bytes);
}

TEST(CudaKernels, EmbeddingMatchesCpu) {
  PW_SKIP_WITHOUT_GPU();
  DeviceArena arena(kArenaBytes);
  struct Case {
    int B, T, C, V;
  };
  // Few ids, so each repeats; C = 1100 needs two channel slices in the wte backward.
  for (const Case k : {Case{3, 8, 40, 5}, Case{2, 6, 1100, 3}}) {
    const int N = k.B * k.T;
    const Ids tok = random_ids(std::size_t(N), k.V, 1);
    const Vec wte = randn(std::size_t(k.V * k.C), 2), wpe = randn(std::size_t(k.T * k.C), 3);
    Vec out(N * k.C);
    cpu::embedding_forward(out.data(), tok.data(), wte.data(), wpe.data(), k.B, k.T, k.C, k.V);
    auto d_tok = to_device(arena, tok);
    auto d_wte = to_device_bf16(arena, wte), d_wpe = to_device_bf16(arena, wpe);
    auto d_out = zeros(arena, N * k.C * 2), bad = zeros(arena, sizeof(int));
    cu::embedding_forward(d_out.as<bf16>(), d_tok.as<std::int32_t>(), d_wte.as<bf16>(),
                          d_wpe.as<bf16>(), k.B, k.T, k.C, k.V, bad.as<int>(), nullptr);
    EXPECT_LE(rel_err(from_device_bf16(d_out.data(), N * k.C), out), 4e-3);
    EXPECT_EQ(from_device<int>(bad.data(), 1)[0], 0);

    // Backward into gradients that already hold values.
    const Vec dout = randn(std::size_t(N * k.C), 4);
    Vec gwte = randn(wte.size(), 5), gwpe = randn(wpe.size(), 6);
    auto d_gwte = to_device_bf16(arena, gwte), d_gwpe = to_device_bf16(arena, gwpe);
    auto d_dout = to_device_bf16(arena, dout);
    cpu::embedding_backward(gwte.data(), gwpe.data(), dout.data(), tok.data(), k.B, k.T, k.C);
    cu::embedding_backward(d_gwte.as<bf16>(), d_gwpe.as<bf16>(), d_dout.as<bf16>(),
                           d_tok.as<std::int32_t>(), k.B, k.T, k.C, k.V, nullptr);
    EXPECT_LE(rel_err(from_device_bf16(d_gwte.data(), k.V * k.C), gwte), 1e-2) << "C " << k.C;
    EXPECT_LE(rel_err(from_device_bf16(d_gwpe.data(), k.T * k.C), gwpe), 1e-2) << "C " << k.C;
  }
}

TEST(CudaKernels, EmbeddingCountsBadIdsAndZeroesTheirRows) {
  PW_SKIP_WITHOUT_GPU();
  DeviceArena arena(kArenaBytes);
  const int B = 1, T = 4, C = 8, V = 5;
  const Ids tok = {1, 5, -1, 4};
  auto d_tok = to_device(arena, tok);
  auto d_wte = to_device_bf16(arena, randn(V * C, 1)),
       d_wpe = to_device_bf16(arena, randn(T * C, 2));
  auto d_out = zeros(arena, B * T * C * 2), bad = zeros(arena, sizeof(int));
  cu::embedding_forward(d_out.as<bf16>(), d_tok.as<std::int32_t>(), d_wte.as<bf16>(),
                        d_wpe.as<bf16>(), B, T, C, V, bad.as<int>(), nullptr);
  const Vec out = from_device_bf16(d_out.data(), B * T * C);
  EXPECT_EQ(from_device<int>(bad.data(), 1)[0], 2);
  for (int t : {1, 2})
    for (int c = 0; c < C; ++c)
      EXPECT_EQ(out[std::size_t(t * C + c)], 0.0f);
}

TEST(CudaKernels, LayerNormMatchesCpu) {
  PW_SKIP_WITHOUT_GPU();
  DeviceArena arena(kArenaBytes);
  const int N = 37, C = 72;
  Vec x = randn(std::size_t(N * C), 7, 2.0f);
  for (float& v : x)
    v = cu::round_to_bf16(v + 0.5f);  // a non-zero mean
  const Vec w = randn(std::size_t(C), 8), b = randn(std::size_t(C), 9);
  Vec out(x.size()), mean(N), rstd(N);
  cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C);
  auto dx = to_device_bf16(arena, x), dw = to_device_bf16(arena, w), db = to_device_bf16(arena, b);
  auto dout = zeros(arena, N * C * 2), dmean = zeros(arena, N * 4), drstd = zeros(arena, N * 4);
  cu::layernorm_forward(dout.as<bf16>(), dmean.as<float>(), drstd.as<float>(), dx.as<bf16>(),
                        dw.as<bf16>(), db.as<bf16>(), N, C, nullptr);
  EXPECT_LE(rel_err(from_device_bf16(dout.data(), N * C), out), 1e-2);
  EXPECT_LE(rel_err(from_device<float>(dmean.data(), N), mean), 1e-4);
  EXPECT_LE(rel_err(from_device<float>(drstd.data(), N), rstd), 1e-4);

  // Accumulating into dinp, and in place (dinp == dout) overwriting it; parameter gradients add.
  const Vec g = randn(x.size(), 10);
  for (const bool in_place : {false, true}) {
    Vec dinp = in_place ? g : randn(x.size(), 11), gw = randn(std::size_t(C), 12),
        gb = randn(std::size_t(C), 13);
    auto d_dinp = to_device_bf16(arena, dinp), d_gw = to_device_bf16(arena, gw),
         d_gb = to_device_bf16(arena, gb), d_g = to_device_bf16(arena, g);
    cpu::layernorm_backward(dinp.data(), gw.data(), gb.data(), in_place ? dinp.data() : g.data(),
                            x.data(), w.data(), mean.data(), rstd.data(), N, C, !in_place);
    cu::layernorm_backward(d_dinp.as<bf16>(), d_gw.as<bf16>(), d_gb.as<bf16>(),
                           in_place ? d_dinp.as<bf16>() : d_g.as<bf16>(), dx.as<bf16>(),
                           dw.as<bf16>(), dmean.as<float>(), drstd.as<float>(), N, C, !in_place,
                           nullptr);
    EXPECT_LE(rel_err(from_device_bf16(d_dinp.data(), N * C), dinp), 1e-2) << in_place;
    EXPECT_LE(rel_err(from_device_bf16(d_gw.data(), C), gw), 1e-2) << in_place;
    EXPECT_LE(rel_err(from_device_bf16(d_gb.data(), C), gb), 1e-2) << in_place;
  }
}

TEST(CudaKernels, GeluMatchesCpu) {
  PW_SKIP_WITHOUT_GPU();
  DeviceArena arena(kArenaBytes);
  const std::int64_t n = 1000;
  const Vec x = randn(std::size_t(n), 14, 2.0f), g = randn(std::size_t(n), 15);
  Vec y(x.size()), dx(x.size());
  cpu::gelu_forward(y.data(), x.data(), n);
  cpu::gelu_backward(dx.data(), x.data(), g.data(), n);
  auto d_x = to_device_bf16(arena, x), d_g = to_device_bf16(arena, g);
  auto d_y = zeros(arena, n * 2);
  cu::gelu_forward(d_y.as<bf16>(), d_x.as<bf16>(), n, nullptr);
  cu::gelu_backward(d_g.as<bf16>(), d_x.as<bf16>(), d_g.as<bf16>(), n, nullptr);  // in place
  EXPECT_LE(rel_err(from_device_bf16(d_y.data(), n), y), 1e-2);
  EXPECT_LE(rel_err(from_device_bf16(d_g.data(), n), dx), 1e-2);
}

// out = residual + inp W^T + bias and its backward, including an odd output width (unaligned
// rows: cuBLASLt must pick an algorithm for 2-byte alignment).
TEST(CudaLayers, LinearMatchesCpu) {
  PW_SKIP_WITHOUT_GPU();
  DeviceArena arena(kArenaBytes);
  DeviceBuffer ws(arena, Category::workspace, cu::Gemm::kDefaultWorkspaceBytes);
  cu::Gemm gemm(nullptr, ws.data(), ws.bytes());
  struct Case {
    int N, C, OC;
    bool bias, residual;
  };
  for (const Case k : {Case{48, 40, 24, true, true}, Case{256, 192, 320, true, false},
                       Case{37, 24, 23, true, true}, Case{16, 64, 32, false, false}}) {
    const std::string name =
        std::to_string(k.N) + "x" + std::to_string(k.C) + "x" + std::to_string(k.OC);
    const Vec x = randn(std::size_t(k.N * k.C), 16), w = randn(std::size_t(k.OC * k.C), 17, 0.1f);
    const Vec b = randn(std::size_t(k.OC), 18), r = randn(std::size_t(k.N * k.OC), 19);
    Vec out(k.N * k.OC);
    cpu::matmul_forward(out.data(), x.data(), w.data(), k.bias ? b.data() : nullptr,
                        k.residual ? r.data() : nullptr, k.N, k.C, k.OC);
    auto d_x = to_device_bf16(arena, x), d_w = to_device_bf16(arena, w);
    auto d_b = to_device_bf16(arena, b), d_r = to_device_bf16(arena, r);
    auto d_out = zeros(arena, k.N * k.OC * 2);
    cu::linear_forward(gemm, d_out.as<bf16>(), d_x.as<bf16>(), d_w.as<bf16>(),
                       k.bias ? d_b.as<bf16>() : nullptr, k.residual ? d_r.as<bf16>() : nullptr,
                       k.N, k.C, k.OC);
    EXPECT_LE(rel_err(from_device_bf16(d_out.data(), k.N * k.OC), out), 1e-2) << name;

    const Vec g = randn(out.size(), 20);
    Vec dx(x.size()), gw = randn(w.size(), 21), gb = randn(b.size(), 22);
    auto d_g = to_device_bf16(arena, g), d_gw = to_device_bf16(arena, gw),
         d_gb = to_device_bf16(arena, gb);
    auto d_dx = zeros(arena, k.N * k.C * 2);
    cpu::matmul_backward(dx.data(), gw.data(), k.bias ? gb.data() : nullptr, g.data(), x.data(),
                         w.data(), k.N, k.C, k.OC);
    cu::linear_backward(gemm, d_dx.as<bf16>(), d_gw.as<bf16>(), k.bias ? d_gb.as<bf16>() : nullptr,
                        d_g.as<bf16>(), d_x.as<bf16>(), d_w.as<bf16>(), k.N, k.C, k.OC);
    EXPECT_LE(rel_err(from_device_bf16(d_dx.data(), k.N * k.C), dx), 1e-2) << name;
    EXPECT_LE(rel_err(from_device_bf16(d_gw.data(), k.OC * k.C), gw), 1e-2) << name;
    if (k.bias) {
      EXPECT_LE(rel_err(from_device_bf16(d_gb.data(), k.OC), gb), 1e-2) << name;
    }
  }
}

// Forward, then backward with scratch for every sample, for two samples at a time, and for blocks
// of 5 query rows (the last block partial).
TEST(CudaLayers, AttentionMatchesCpu) {
  PW_SKIP_WITHOUT_GPU();
  DeviceArena arena(kArenaBytes);
  DeviceBuffer ws(arena, Category::workspace, cu::Gemm::kDefaultWorkspaceBytes);
  cu::Gemm gemm(nullptr, ws.data(), ws.bytes());
  const int B = 3, T = 16, C = 32, NH = 4;
  const std::int64_t n_qkv = B * T * 3 * C, n_out = B * T * C, n_att = B * NH * T * T;
  const Vec qkv = randn(std::size_t(n_qkv), 23);
  Vec out(n_out), att(n_att);
  cpu::attention_forward(out.data(), att.data(), qkv.data(), B, T, C, NH);
  auto d_qkv = to_device_bf16(arena, qkv);
  auto d_out = zeros(arena, n_out * 2), d_att = zeros(arena, n_att * 2);
  cu::attention_forward(gemm, d_out.as<bf16>(), d_att.as<bf16>(), d_qkv.as<bf16>(), B, T, C, NH);
  EXPECT_LE(rel_err(from_device_bf16(d_out.data(), n_out), out), 2e-2);
  EXPECT_LE(rel_err(from_device_bf16(d_att.data(), n_att), att), 2e-2);

  const Vec dout = randn(std::size_t(n_out), 24);
  Vec dqkv(n_qkv), scratch(T * T);
  cpu::attention_backward(dqkv.data(), dout.data(), qkv.data(), att.data(), scratch.data(),
                          std::int64_t(scratch.size()), B, T, C, NH);
  auto d_dout = to_device_bf16(arena, dout);
  const std::int64_t per_sample = 6ll * T * T, per_row = 6ll * T;
  for (const std::int64_t bytes : {B * per_sample + 64, 2 * per_sample + 32, 5 * per_row + 32}) {
    auto d_dqkv = zeros(arena, n_qkv * 2);
    DeviceBuffer s(arena, Category::workspace, bytes);
    cu::attention_backward(gemm, d_dqkv.as<bf16>(), d_dout.as<bf16>(), d_qkv.as<bf16>(),
                           d_att.as<bf16>(), cu::Carver(s.data(), bytes, "test scratch"), B, T, C,
                           NH);
    EXPECT_LE(rel_err(from_device_bf16(d_dqkv.data(), n_qkv), dqkv), 2e-2) << "scratch " << bytes;
  }
  DeviceBuffer tiny(arena, Category::workspace, 64);
  auto unused = zeros(arena, n_qkv * 2);
  EXPECT_THROW(
      cu::attention_backward(gemm, unused.as<bf16>(), d_dout.as<bf16>(), d_qkv.as<bf16>(),
                             d_att.as<bf16>(), cu::Carver(tiny.data(), 64, "tiny"), B, T, C, NH),
      pw::Error);
}

TEST(CudaKernels, CrossEntropyMatchesCpu) {
  PW_SKIP_WITHOUT_GPU();
  DeviceArena arena(kArenaBytes);
  const int N = 20, V = 50;
  const Vec logits = randn(std::size_t(N * V), 25, 3.0f);
  Ids tgt = random_ids(std::size_t(N), V, 26);
  Vec probs = logits, losses(N);
  const double sum =
      cpu::softmax_crossentropy_forward(probs.data(), losses.data(), tgt.data(), N, V);
  auto d_p = to_device_bf16(arena, logits);
  auto d_tgt = to_device(arena, tgt);
  auto d_losses = zeros(arena, N * 4), d_mean = zeros(arena, 4), bad = zeros(arena, 4);
  cu::crossentropy_forward(d_p.as<bf16>(), d_losses.as<float>(), d_tgt.as<std::int32_t>(), N, V,
                           bad.as<int>(), nullptr);
  cu::mean_loss(d_mean.as<float>(), d_losses.as<float>(), N, nullptr);
  EXPECT_LE(rel_err(from_device_bf16(d_p.data(), N * V), probs), 1e-2);
  EXPECT_LE(rel_err(from_device<float>(d_losses.data(), N), losses), 1e-4);
  EXPECT_NEAR(from_device<float>(d_mean.data(), 1)[0], sum / N, 1e-4 * sum / N);
  EXPECT_EQ(from_device<int>(bad.data(), 1)[0], 0);

  const float scale = 1.0f / N;
  Vec dlogits(probs.size());
  cpu::softmax_crossentropy_backward(dlogits.data(), probs.data(), tgt.data(), scale, N, V);
  auto d_dl = zeros(arena, N * V * 2);
  cu::crossentropy_backward(d_dl.as<bf16>(), d_p.as<bf16>(), d_tgt.as<std::int32_t>(), scale, N, V,
                            nullptr);
  EXPECT_LE(rel_err(from_device_bf16(d_dl.data(), N * V), dlogits), 1e-2);

  // A target outside [0, V): counted, zero loss.
  tgt[3] = V;
  auto d_bad_tgt = to_device(arena, tgt);
  auto d_p2 = to_device_bf16(arena, logits);
  cu::crossentropy_forward(d_p2.as<bf16>(), d_losses.as<float>(), d_bad_tgt.as<std::int32_t>(), N,
                           V, bad.as<int>(), nullptr);
  EXPECT_EQ(from_device<int>(bad.data(), 1)[0], 1);
  EXPECT_EQ(from_device<float>(d_losses.data(), N)[3], 0.0f);
}

// Two updates of each optimizer against exec/optimizer.cpp on the same (bf16) gradients: fp32
// master weights and moments agree, the bf16 copy is the rounded master, gradients are zeroed.
TEST(CudaKernels, OptimizersMatchCpu) {
  PW_SKIP_WITHOUT_GPU();
  DeviceArena arena(kArenaBytes);
  const std::int64_t n = 1000;
  for (const std::string opt : {"adamw", "sgd"}) {
    pw::exec::TrainOptions o;
    o.optimizer = opt;
    o.lr = 1e-2f;
    o.weight_decay = 0.1f;
    Vec w(n);
    {
      std::mt19937 gen(27);
      std::normal_distribution<float> d(0.0f, 1.0f);
      for (float& x : w)
        x = d(gen);
    }
    Vec m(w.size(), 0.0f), v(w.size(), 0.0f);
    auto d_master = to_device(arena, w), d_m = to_device(arena, m), d_v = to_device(arena, v);
    auto d_w = zeros(arena, n * 2);
    for (int update = 1; update <= 2; ++update) {
      Vec g = randn(w.size(), 28 + unsigned(update), 0.1f);
      auto d_g = to_device_bf16(arena, g);
      pw::exec::optimizer_update(o, update, w.data(), w.data(), g.data(), m.data(), v.data(), n);
      if (opt == "adamw")
        cu::adamw_update(d_master.as<float>(), d_w.as<bf16>(), d_g.as<bf16>(), d_m.as<float>(),
                         d_v.as<float>(), n, {o.lr, o.beta1, o.beta2, o.eps, o.weight_decay},
                         update, nullptr);
      else
        cu::sgd_momentum_update(d_master.as<float>(), d_w.as<bf16>(), d_g.as<bf16>(),
                                d_m.as<float>(), n, o.lr, o.momentum, nullptr);
      EXPECT_EQ(from_device_bf16(d_g.data(), n), Vec(w.size(), 0.0f)) << opt;
    }
    const Vec master = from_device<float>(d_master.data(), n);
    EXPECT_LE(rel_err(master, w), 1e-6) << opt;
    EXPECT_LE(rel_err(from_device<float>(d_m.data(), n), m), 1e-6) << opt;
    const Vec copy = from_device_bf16(d_w.data(), n);
    for (std::int64_t i = 0; i < n; ++i)
      ASSERT_EQ(copy[std::size_t(i)], cu::round_to_bf16(master[std::size_t(i)])) << opt << i;
  }
}

TEST(CudaKernels, CastsRoundLikeTheHostAndResidualAdds) {
  PW_SKIP_WITHOUT_GPU();
  DeviceArena arena(kArenaBytes);
  const std::int64_t n = 4097;
  Vec x(n);
  std::mt19937 gen(31);
  std::normal_distribution<float> d(0.0f, 10.0f);
  for (float& v : x)
    v = d(gen);
  auto d_x = to_device(arena, x), d_b = zeros(arena, n * 2), d_f = zeros(arena, n * 4);
  cu::cast_to_bf16(d_b.as<bf16>(), d_x.as<float>(), n, nullptr);
  cu::cast_to_float(d_f.as<float>(), d_b.as<bf16>(), n, nullptr);
  const Vec back = from_device<float>(d_f.data(), n);
  for (std::int64_t i = 0; i < n; ++i)
    ASSERT_EQ(back[std::size_t(i)], cu::round_to_bf16(x[std::size_t(i)])) << i;
  cu::residual_add(d_b.as<bf16>(), d_b.as<bf16>(), d_b.as<bf16>(), n, nullptr);
  const Vec twice = from_device_bf16(d_b.data(), n);
  for (std::int64_t i = 0; i < n; ++i)
    ASSERT_EQ(twice[std::size_t(i)], 2 * back[std::size_t(i)]) << i;
}

}  // namespace
